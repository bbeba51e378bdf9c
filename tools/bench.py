"""Headless benchmark: every chapter's measurements, one results file, one PNG.

Run it from the workbook folder (no browser, no notebook)::

    python -m tools.bench                      # the size tier in force (full on a CUDA machine), every chapter
    python -m tools.bench --quick              # small sizes: a smoke run, minutes on a laptop
    python -m tools.bench --full               # full sizes on any machine (sets WORKBOOK_FULL=1)
    python -m tools.bench --budget-s 450       # stop each chapter at its share of 450 s (partial file kept)
    python -m tools.bench --chapters 02,05     # only some chapters
    python -m tools.bench --full --reference   # also save it as a reference file (CUDA, full mode)
    python -m tools.bench --list               # which chapters have a benchmark() yet
    python -m tools.bench --plot-only FILE     # redraw the PNG summary of an existing results file
    python -m tools.bench --compare FILE  # your results beside the reference files (ratios on same hardware)
    python -m tools.bench --readme-table       # the README's table of reference figures

Each chapter module, ``helpers/chapters/chNN/__init__.py``, follows the one chapter interface
(:mod:`helpers.ui.chapter`): its ``benchmark(results, device, *, progress=None)`` adds
records keyed ``chNN.*`` (and artifacts such as span traces) to a
:class:`helpers.core.results.ResultSet`. This command finds the chapters by their file
names, reads each one's ``NUMBER``, ``TITLE`` and ``BENCH_WEIGHT`` from its source
(nothing is imported until the chapter runs), runs each benchmark guarded (a failing chapter is reported loudly,
with its traceback, and makes the exit code non-zero, but the other chapters
still run and the file is still written), shows progress bars, and writes:

* one results file in the helpers' JSON format, with provenance: the
  benchmark version, mode, method, date, library versions, the hardware
  report, and what happened to each chapter (``provenance["bench"]``);
* a PNG summary of the key plots drawn from the records (bandwidth sweep,
  pinning cost, timelines, the capstone waterfall, ...); a panel whose records
  are missing is skipped and the figure says so.

Exit codes: 0 every chapter that exists ran; 1 at least one chapter failed or
outran its time share (the file is still written); 2 refused before measuring
(bad arguments, an output path that collides with another or has the wrong
extension, a folder that cannot be written, or a CUDA device was required and is
absent: one ``error:`` or ``refusing`` line, never a traceback; every path is checked
with a real write before any work starts); 130 interrupted by Ctrl-C (SIGINT), 143
stopped by SIGTERM (what was measured so far is written, child processes are
stopped). A chapter that swallows the Ctrl-C never counts as ok.

Time budget (``--budget-s N``, which the GPU check sets): each chapter may run
for its share of the time left, in proportion to :attr:`Chapter.weight`, so a
fast chapter hands its unused time to the next ones. A chapter that outruns its
share is stopped (:class:`ChapterTimeout`, a ``KeyboardInterrupt``, so every
helper's clean-up for Ctrl-C runs), marked ``timed out``, kept in the results
file and left out of any reference file; the next chapter runs.

Figures that cannot be right (a fraction above 1, a measured bandwidth above the
theoretical link ceiling, a "best" worker count that contradicts a measured
speed-up) are flagged on their records (:func:`flag_lines`),
listed in ``provenance["bench"]["flags"]``, printed, and drawn in red.

Strict GPU mode (``--strict`` or ``WORKBOOK_REQUIRE_GPU=1``, which the GPU
check sets): a CUDA device is required, and a chapter that records nothing is
a failure. Chapters read the same variable to raise instead of falling back to
the CPU or to reference results inside a GPU path.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import datetime as _dt
import gc
import importlib
import importlib.metadata
import importlib.util
import json
import math
import os
import platform
import re
import signal
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Literal, Sequence

if TYPE_CHECKING:
    from helpers.core.results import ResultSet

__all__ = [
    "REQUIRE_GPU_ENV",
    "Chapter",
    "CHAPTERS",
    "CHAPTER_DIR",
    "discover_chapters",
    "ChapterOutcome",
    "ChapterTimeout",
    "signal_raises",
    "StopSignals",
    "output_problems",
    "folder_problems",
    "chapter_shares",
    "require_gpu",
    "select_chapters",
    "run_benchmarks",
    "run",
    "summary_figure",
    "reference_path",
    "readme_table",
    "readme_block",
    "readme_sections",
    "compare_lines",
    "ceiling_table",
    "flag_lines",
    "main",
]

#: Environment variable for strict GPU runs. When it is 1, the bench requires CUDA, and chapters
#: raise in a GPU path instead of quietly falling back (see docs/GPU-CHECK.md).
from helpers.core.config import REQUIRE_GPU_ENV  # noqa: E402

#: Optional: the git commit of the checkout, for machines whose copy of the tree has no .git folder.
COMMIT_ENV = "WORKBOOK_GIT_COMMIT"

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"", "0", "false", "no", "off"}


import helpers.chapters  # noqa: E402  (cheap: a layer's __init__ imports nothing)
from helpers.core import config  # noqa: E402
from helpers.core.config import (  # noqa: E402
    artifacts_dir,
    mode_name,
    quick_mode,
    require_gpu,  # noqa: E402  (re-exported: the flag lives in helpers.core.config)
    size_tier,
)
from helpers.core.evidence import missing_message, provenance_line, reference_dir, references  # noqa: E402
from helpers.core.progress import TqdmProgress  # noqa: E402
from helpers.core.results import ResultSet, comparable, compare_results  # noqa: E402
from helpers.core.results import flag_lines as _record_flag_lines  # noqa: E402
from helpers.core.timing import synchronize as sync_every_device  # noqa: E402
from helpers.core.validate import human_bytes  # noqa: E402

# ---------------------------------------------------------------------------
# Chapters
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Chapter:
    """A helper module that measures for one or more chapters."""

    ids: tuple[str, ...]
    module: str
    title: str
    #: Relative share of a ``--budget-s`` time budget (an estimate of the chapter's cost, not a measurement).
    weight: float = 1.0

    @property
    def label(self) -> str:
        return "ch" + "/".join(self.ids)

    @property
    def prefixes(self) -> tuple[str, ...]:
        return tuple(f"ch{i}." for i in self.ids)


#: Where the chapter modules are: ``helpers/chapters/chNN/__init__.py`` of the ``helpers`` that ``import helpers`` finds
#: (the checkout's, run from its root).
CHAPTER_DIR = Path(helpers.chapters.__file__).resolve().parent


def _constants(path: Path, names: tuple[str, ...] = ("NUMBER", "TITLE", "BENCH_WEIGHT")) -> dict[str, Any]:
    """The literal values of ``names`` assigned at the top level of a module's source (nothing is imported)."""
    out: dict[str, Any] = {}
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, value = [node.target], node.value
        else:
            continue
        for target in targets:
            if isinstance(target, ast.Name) and target.id in names:
                try:
                    out[target.id] = ast.literal_eval(value)
                except ValueError:
                    pass
    return out


def discover_chapters(folder: Path = CHAPTER_DIR) -> tuple[Chapter, ...]:
    """Every chapter folder in ``folder`` (``chNN/__init__.py``), in chapter order, from its ``NUMBER``, ``TITLE``
    and ``BENCH_WEIGHT`` (the interface in :mod:`helpers.ui.chapter`); a missing constant falls back to the folder
    name, the module name and 1.0, and the module's own check (tests/test_chapter_interface.py) says what is
    missing."""
    out = []
    for path in sorted(folder.glob("ch[0-9][0-9]/__init__.py")):
        name = path.parent.name
        c = _constants(path)
        out.append(
            Chapter(
                (str(c.get("NUMBER", name[2:])),),
                f"helpers.chapters.{name}",
                str(c.get("TITLE", name)),
                float(c.get("BENCH_WEIGHT", 1.0)),
            )
        )
    return tuple(out)


#: Every chapter module, in chapter order, found by file name.
CHAPTERS: tuple[Chapter, ...] = discover_chapters()


def select_chapters(spec: str | None, chapters: Sequence[Chapter] = CHAPTERS) -> list[Chapter]:
    """Chapters named in ``spec`` ("01,02" or "1,2"; None or "all" = every one), in chapter order.

    Raises:
        ValueError: naming ``--chapters`` and the allowed ids, for an unknown id or an empty list
            (``--chapters ""`` is a mistake, not a request for every chapter).
    """
    known = {i: c for c in chapters for i in c.ids}
    if spec is None or spec.strip().lower() == "all":
        return list(chapters)
    if not spec.replace(",", "").strip():
        raise ValueError(
            f"--chapters is empty; name chapters such as 02,05 (allowed: {', '.join(sorted(known))}) "
            "or leave the option out to run every chapter"
        )
    wanted: list[str] = []
    for raw in spec.split(","):
        raw = raw.strip().lower().removeprefix("ch")
        if not raw:
            continue
        cid = raw.zfill(2) if raw.isdigit() else raw
        if cid not in known:
            raise ValueError(f"--chapters: unknown chapter {raw!r}; allowed: {', '.join(sorted(known))} (or 'all')")
        wanted.append(cid)
    chosen = {known[c] for c in wanted}
    return [c for c in chapters if c in chosen]


@dataclass
class ChapterOutcome:
    """What happened when one chapter's benchmark ran."""

    chapter: str
    module: str
    status: str  # "ok" | "failed" | "timed out" | "skipped"
    reason: str = ""
    seconds: float = 0.0
    records: int = 0
    artifacts: int = 0
    error: str = ""
    warnings: list[str] = field(default_factory=list)
    first_record: int = 0
    artifact_names: list[str] = field(default_factory=list)
    budget_s: float | None = None


class ChapterTimeout(KeyboardInterrupt):
    """A chapter outran its share of the bench's time budget (``--budget-s``).

    A ``KeyboardInterrupt`` so that every helper's clean-up for Ctrl-C (worker
    processes, pinned buffers, CUDA streams) runs; :func:`run_benchmarks` turns
    it into the chapter's ``timed out`` outcome and goes on with the next chapter.
    """


#: Handlers installed by :func:`signal_raises` (signal number -> handler), reset in every forked child.
_OWN_HANDLERS: dict[int, Callable[..., Any]] = {}
_AT_FORK_REGISTERED = False


def _reset_own_handlers_in_child() -> None:
    """``os.register_at_fork`` hook: a forked child starts with the default action for our signals.

    A child that inherited a Python-level handler can only act on the signal once
    its main thread runs Python code again; one stuck in a C-level lock it
    inherited (a pool worker on its queue's lock) never does, and then
    ``pool.terminate()`` waits for it forever.
    """
    for num, handler in list(_OWN_HANDLERS.items()):
        try:
            if signal.getsignal(num) is handler:
                signal.signal(num, _child_default(num))
        except (ValueError, OSError):  # not the child's main thread: the handler's own pid check still applies
            pass


def _child_default(num: int) -> Any:
    """What a child process gets back for signal ``num``: Python's own handler for SIGINT (a
    KeyboardInterrupt, as in any Python process), the default action for the others."""
    return signal.default_int_handler if num == signal.SIGINT else signal.SIG_DFL


class StopSignals:
    """While in force, SIGINT (Ctrl-C) and SIGTERM raise ``KeyboardInterrupt`` in this process, and the
    first one received is remembered, so that a chapter which swallows the ``KeyboardInterrupt`` (or turns
    it into another error) cannot turn the stop into a success: :func:`run_benchmarks` asks
    :attr:`received` after every chapter."""

    def __init__(self) -> None:
        self.received: int | None = None

    def _raise(self, num: int) -> BaseException:
        if self.received is None:
            self.received = num
        return KeyboardInterrupt(f"signal {signal.Signals(num).name}")

    @property
    def name(self) -> str:
        return signal.Signals(self.received).name if self.received is not None else ""

    @property
    def exit_code(self) -> int:
        """128 + the signal number (130 for SIGINT, 143 for SIGTERM), as a shell reports it."""
        return 128 + (self.received if self.received is not None else signal.SIGINT)

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for num in (signal.SIGINT, signal.SIGTERM):
                # a signal ignored when the process started (e.g. SIGINT for `cmd &` in a script) stays ignored
                if signal.getsignal(num) is not signal.SIG_IGN:
                    stack.enter_context(signal_raises(num, self._raise))
            yield


def _release_children(timeout: float = 5.0) -> list[int]:
    """Stop the child processes this process still has (workers of an interrupted chapter); returns their pids."""
    import multiprocessing

    children = multiprocessing.active_children()
    if children:  # only then: the workers module imports torch, slow for a Ctrl-C before any chapter ran
        from helpers.pipeline.workers import stop_processes  # the loaders' one SIGTERM, wait, SIGKILL

        stop_processes(children, grace_s=timeout)
    return [c.pid for c in children if c.pid is not None]


@contextlib.contextmanager
def signal_raises(signum: int, make_exc: Callable[[int], BaseException | None]) -> Iterator[bool]:
    """While the block runs, signal ``signum`` raises ``make_exc(signum)`` in THIS process only
    (nothing when ``make_exc`` returns None).

    Child processes never act on it: a process forked meanwhile (a pool worker, a
    DataLoader worker) gets the default action back as it starts
    (``os.register_at_fork``), and should a copy of the handler still run in a
    child, it restores the default action and sends itself the signal again. So
    the child ends exactly as if no handler had been installed: a pool worker
    that inherited a handler turning SIGTERM into KeyboardInterrupt made
    ``pool.terminate()`` wait forever (issue 15). The previous handler is
    restored when the block ends. Yields False (and installs nothing) outside the
    main thread, where Python cannot set signal handlers.
    """
    global _AT_FORK_REGISTERED
    if threading.current_thread() is not threading.main_thread():
        yield False
        return
    owner = os.getpid()

    def handler(num: int, frame: Any) -> None:
        if os.getpid() != owner:  # an inherited copy in a child process: behave as the default would
            signal.signal(num, _child_default(num))
            if num == signal.SIGINT:
                raise KeyboardInterrupt
            os.kill(os.getpid(), num)
            return
        exc = make_exc(num)
        if exc is not None:
            raise exc

    if not _AT_FORK_REGISTERED and hasattr(os, "register_at_fork"):
        os.register_at_fork(after_in_child=_reset_own_handlers_in_child)
        _AT_FORK_REGISTERED = True
    try:
        previous = signal.signal(signum, handler)
    except (ValueError, OSError):
        yield False
        return
    outer = _OWN_HANDLERS.get(signum)
    _OWN_HANDLERS[signum] = handler
    try:
        yield True
    finally:
        signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
        if outer is not None:
            _OWN_HANDLERS[signum] = outer
        else:
            _OWN_HANDLERS.pop(signum, None)


def chapter_shares(chapters: Sequence[Chapter], left_s: float) -> list[float]:
    """Each chapter's share of ``left_s`` seconds, in proportion to its weight (the first is the one due now)."""
    total = sum(max(c.weight, 0.01) for c in chapters) or 1.0
    return [left_s * max(c.weight, 0.01) / total for c in chapters]


def _find_benchmark(ch: Chapter) -> tuple[Callable[..., Any] | None, str, str]:
    """(function, status, reason): status is "" when found, else "skipped" or "failed"."""
    try:
        if importlib.util.find_spec(ch.module) is None:
            return None, "skipped", f"module {ch.module} does not exist yet"
    except (ImportError, ValueError) as exc:
        return None, "skipped", f"module {ch.module} cannot be located ({exc})"
    try:
        mod = importlib.import_module(ch.module)
    except ModuleNotFoundError as exc:
        if exc.name == ch.module:
            return None, "skipped", f"module {ch.module} does not exist yet"
        return None, "failed", f"importing {ch.module} failed: {exc!r}\n{traceback.format_exc()}"
    except Exception as exc:  # a broken module is a failure, loudly
        return None, "failed", f"importing {ch.module} failed: {exc!r}\n{traceback.format_exc()}"
    fn = getattr(mod, "benchmark", None)
    if fn is None:
        return None, "skipped", f"{ch.module} has no benchmark() function yet"
    if not callable(fn):
        return None, "failed", f"{ch.module}.benchmark is not callable"
    return fn, "", ""


def _free_memory() -> str:
    """Free memory between chapters; returns "" or the CUDA error that surfaced while synchronising.

    A CUDA error is sticky and asynchronous: it may surface only here, after the
    chapter that caused it returned. It is never swallowed: the caller fails that chapter.
    """
    gc.collect()
    import torch

    if not torch.cuda.is_available():
        return ""
    try:
        sync_every_device()  # every CUDA device in use, not only the current one
        torch.cuda.empty_cache()
    except RuntimeError as exc:  # torch.AcceleratorError is a RuntimeError
        return f"CUDA error after the chapter returned: {type(exc).__name__}: {exc}"
    return ""


def _banner(text: str) -> str:
    bar = "!" * 78
    return f"\n{bar}\n{text}\n{bar}"


def run_benchmarks(
    results: Any,
    device: Any,
    chapters: Sequence[Chapter] = CHAPTERS,
    *,
    strict: bool = False,
    progress: bool = True,
    log: Callable[[str], None] | None = None,
    checkpoint: Callable[[list[ChapterOutcome]], None] | None = None,
    into: list[ChapterOutcome] | None = None,
    budget_s: float | None = None,
    stop: StopSignals | None = None,
) -> list[ChapterOutcome]:
    """Run each chapter's ``benchmark(results, device, progress=...)``, guarded; return one outcome per chapter.

    Every chapter's benchmark takes a ``progress(fraction, text)`` keyword (the chapter interface); with
    ``progress`` on, it drives a second progress bar.

    A chapter whose module or function does not exist yet is skipped; one that
    raises is reported (banner + traceback through ``log``) and marked failed,
    and the next chapter runs. With ``strict``, a chapter that adds no records
    is a failure too. ``checkpoint(outcomes)`` is called after each chapter
    (to save a partial file). ``KeyboardInterrupt`` propagates (after the
    outcome of the interrupted chapter is appended to ``into``, if given).

    With ``budget_s``, each chapter may run for its share of the time left
    (:func:`chapter_shares`); one that outruns it is stopped with
    :class:`ChapterTimeout` (a SIGALRM timer, main thread only) and marked
    ``timed out``, and the next chapter runs. After each chapter the records are
    checked (:func:`flag_lines`) and flagged where impossible.

    With ``stop`` (a :class:`StopSignals` in force), a chapter that returns, or fails, after a
    SIGINT/SIGTERM arrived is marked interrupted and ``KeyboardInterrupt`` propagates: a chapter
    that swallowed the signal never counts as ok, and no further chapter runs.
    """
    from tqdm import tqdm

    def stopped() -> bool:
        return stop is not None and stop.received is not None

    say = log or (lambda s: tqdm.write(s, file=sys.stderr))
    outcomes: list[ChapterOutcome] = [] if into is None else into
    bar = tqdm(
        total=len(chapters), desc="bench", unit="chapter", disable=not progress, file=sys.stderr, dynamic_ncols=True
    )
    live = _LiveCounter(bar)
    previous_hook = getattr(results, "_on_add", None)
    try:
        results._on_add = live.added  # counts records as they arrive, for the progress bar
    except Exception:
        pass
    deadline = time.monotonic() + budget_s if budget_s is not None else None
    timer = _ChapterTimer()
    try:
        for pos, ch in enumerate(chapters):
            bar.set_description(f"bench {ch.label}")
            live.start(ch.label)
            out = ChapterOutcome(chapter=ch.label, module=ch.module, status="ok")
            outcomes.append(out)
            fn, status, reason = _find_benchmark(ch)
            if fn is None:
                out.status, out.reason = status, reason.splitlines()[0]
                if status == "failed":
                    out.error = reason
                    say(_banner(f"{ch.label} ({ch.module}) FAILED before running:\n{reason}"))
                else:
                    say(f"{ch.label}: skipped — {reason}")
                bar.update(1)
                continue
            n_rec, arts_before = len(results.records), set(results.artifacts)
            n_art = len(arts_before)
            out.first_record = n_rec
            t0 = time.perf_counter()
            kwargs: dict[str, Any] = {}
            inner = None
            if progress:
                inner = tqdm(
                    total=100,
                    desc=f"  {ch.label}",
                    unit="%",
                    leave=False,
                    file=sys.stderr,
                    dynamic_ncols=True,
                    bar_format="{desc}: {percentage:3.0f}%|{bar}| {postfix}",
                )
                kwargs["progress"] = TqdmProgress(inner)
            if deadline is not None:
                out.budget_s = round(max(1.0, chapter_shares(chapters[pos:], deadline - time.monotonic())[0]), 1)
            try:
                try:
                    with timer.limit(out.budget_s, ch.label):
                        fn(results, device, **kwargs)
                    if stopped():  # the chapter swallowed the user's Ctrl-C / SIGTERM and returned
                        raise KeyboardInterrupt(stop.name if stop else "")
                    if timer.fired:  # the chapter caught the ChapterTimeout itself and returned
                        raise ChapterTimeout(ch.label)
                except Exception:
                    if stopped():  # ... or turned it into another error (e.g. a DataLoader worker killed)
                        raise KeyboardInterrupt(stop.name if stop else "") from None
                    if timer.fired:
                        raise ChapterTimeout(ch.label) from None
                    raise
            except (ChapterTimeout, KeyboardInterrupt) as exc:
                if stopped() or not (isinstance(exc, ChapterTimeout) or timer.fired):
                    why = stop.name if stop is not None and stop.received is not None else "Ctrl-C or SIGTERM"
                    out.status, out.reason = "failed", f"interrupted ({why})"
                    out.seconds = time.perf_counter() - t0
                    raise
                # stopped by its time share (also when the chapter caught the ChapterTimeout, or turned it into
                # a plain KeyboardInterrupt or another error)
                out.status = "timed out"
                out.reason = (
                    f"stopped after its share of the time budget ({out.budget_s:.0f} s of --budget-s); "
                    "its records are kept in the results file, never in a reference file"
                )
                say(_banner(f"{ch.label} ({ch.module}.benchmark) TIMED OUT: {out.reason}"))
            except Exception as exc:
                out.status = "failed"
                out.reason = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
                out.error = traceback.format_exc()
                say(_banner(f"{ch.label} ({ch.module}.benchmark) FAILED: {out.reason}\n\n{out.error}"))
            finally:
                if inner is not None:
                    inner.close()
                out.seconds = round(time.perf_counter() - t0, 3)
                out.records = len(results.records) - n_rec
                out.artifacts = len(results.artifacts) - n_art
                out.artifact_names = sorted(set(results.artifacts) - arts_before)
                cuda_error = _free_memory()
                if cuda_error and out.status == "ok":
                    out.status, out.reason = "failed", cuda_error.splitlines()[0][:300]
                    say(_banner(f"{ch.label} ({ch.module}.benchmark) FAILED: {cuda_error}"))
            new = results.records[n_rec:]
            for msg in flag_lines(results, new):
                out.warnings.append(f"flagged: {msg}")
            stray = sorted({r.key for r in new if not r.key.startswith(ch.prefixes)})
            if stray:
                out.warnings.append(f"record keys without the prefix {'/'.join(ch.prefixes)}: {', '.join(stray[:5])}")
            if out.status == "ok" and out.records == 0:
                msg = "added no records"
                if strict:
                    out.status, out.reason = "failed", msg + " (strict GPU run: a chapter must record something)"
                    say(_banner(f"{ch.label} ({ch.module}.benchmark) FAILED: {out.reason}"))
                else:
                    out.warnings.append(msg)
            for w in out.warnings:
                say(f"{ch.label}: warning — {w}")
            if out.status == "ok":
                say(f"{ch.label}: ok — {out.records} records, {out.artifacts} artifacts in {out.seconds:.1f} s")
            bar.update(1)
            if checkpoint is not None:
                try:
                    checkpoint(outcomes)
                except Exception as exc:
                    say(f"warning: could not save the partial results file: {exc!r}")
            if stopped():  # arrived after the chapter ended (e.g. while saving): stop before the next one
                raise KeyboardInterrupt(stop.name if stop else "")
    finally:
        bar.close()
        try:
            results._on_add = previous_hook
        except Exception:
            pass
    return outcomes


class _ChapterTimer:
    """Raises :class:`ChapterTimeout` in the bench's process when a chapter outruns its share (SIGALRM)."""

    def __init__(self) -> None:
        self.armed = False
        self.fired = False

    @contextlib.contextmanager
    def limit(self, seconds: float | None, label: str) -> Iterator[None]:
        self.fired = False
        if seconds is None:
            yield
            return

        def timeout(num: int) -> BaseException | None:
            if not self.armed:  # fired as the chapter was ending: nothing to stop
                return None
            self.fired = True
            return ChapterTimeout(f"{label}: outran its share of the time budget ({seconds:.0f} s)")

        with signal_raises(signal.SIGALRM, timeout) as installed:
            if installed:
                self.armed = True
                signal.setitimer(signal.ITIMER_REAL, seconds)
            try:
                yield
            finally:
                self.armed = False
                if installed:
                    signal.setitimer(signal.ITIMER_REAL, 0)


class _LiveCounter:
    """Shows the number of records of the running chapter on the progress bar (at most 4 updates/s)."""

    def __init__(self, bar: Any) -> None:
        self.bar, self.label, self.n, self.last = bar, "", 0, 0.0

    def start(self, label: str) -> None:
        self.label, self.n = label, 0
        self.bar.set_postfix_str(f"{label}: starting")

    def added(self, rec: Any) -> None:
        self.n += 1
        now = time.monotonic()
        if now - self.last > 0.25:
            self.last = now
            self.bar.set_postfix_str(f"{self.label}: {self.n} records, last {getattr(rec, 'key', '?')}")


def _live_result_set_class() -> type[ResultSet]:
    """A ResultSet whose ``add`` also calls an optional ``_on_add`` hook (for progress)."""

    class LiveResultSet(ResultSet):
        _on_add: Callable[[Any], None] | None = None

        def add(self, *args: Any, **kwargs: Any) -> Any:
            rec = super().add(*args, **kwargs)
            hook = self._on_add
            if hook is not None:
                try:
                    hook(rec)
                except Exception:
                    pass
            return rec

    return LiveResultSet


# ---------------------------------------------------------------------------
# Provenance
# ---------------------------------------------------------------------------

_VERSIONED = (
    "torch",
    "torchvision",
    "numpy",
    "matplotlib",
    "pillow",
    "psutil",
    "nvidia-ml-py",
    "tqdm",
    "ipywidgets",
    "nbval",
    "gpu-data-workbook",
)


def _versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for name in _VERSIONED:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    try:
        import helpers

        out["helpers"] = getattr(helpers, "__version__", None)
    except Exception:
        out["helpers"] = None
    return out


def _git_commit() -> tuple[str | None, bool | None]:
    env = os.environ.get(COMMIT_ENV)
    if env:
        return env.strip(), None
    root = Path(__file__).resolve().parents[1]  # the checkout: tools/bench.py
    if not (root / ".git").exists():
        return None, None
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=20,
        )
        if sha.returncode != 0:
            return None, None
        return sha.stdout.strip(), bool(dirty.stdout.strip()) if dirty.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None, None


METHOD = (
    "python -m tools.bench: each chapter's helpers benchmark(results, device), run one after another in "
    "one process; timings are medians over repeated runs (torch.utils.benchmark Timer, or CUDA events on a "
    "GPU), with each record's spread and method in its params/spread; GPU memory is freed between chapters"
)


# ---------------------------------------------------------------------------
# Figures that cannot be right (beside helpers.core.results' own: a fraction outside 0..1)
# ---------------------------------------------------------------------------


def flag_lines(rs: Any, records: Iterable[Any] | None = None) -> list[str]:
    """One line per flag on ``records`` (default: every record of ``rs``) after checking them: a fraction outside
    0..1, a chapter 02 copy above the theoretical link ceiling (maybe a VM's virtual root port), and chapter 04's
    ``best_num_workers`` = 0 beside a ``speedup`` above 1 in every round. Values are never changed."""
    todo = list(rs.records if records is None else records)
    report = rs.provenance.get("report", {}) if isinstance(rs.provenance, dict) else {}
    raw_ceiling = report.get("link_bandwidth_gbps") if isinstance(report, dict) else None
    ceiling = float(raw_ceiling) if raw_ceiling else None
    for rec in todo:
        gbps = _copy_gbps(rec) if ceiling else None
        if ceiling and gbps is not None and gbps > ceiling * 1.02:
            rec.flag(
                f"above the theoretical link ceiling ({gbps:.1f} > {ceiling:.1f} GB/s): the reported "
                "link (NVML, maybe a virtual root port) is not the real path"
            )
    for chap in {r.key.split(".", 1)[0] for r in todo}:
        for best, up, why in _workers_contradicted(rs, chap):
            best.flag(why)
            up.flag(why)
    return _record_flag_lines(rs, todo)


def _num(value: Any, default: float = 0.0) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return default


def _copy_gbps(rec: Any) -> float | None:
    """The GB/s of a chapter 02 copy record (a bandwidth, or a copy time of ``nbytes``), else None."""
    if not rec.key.startswith("ch02."):
        return None
    if rec.unit == "GB/s" and "bandwidth" in rec.key:
        return float(rec.value)
    if rec.unit == "s" and rec.key == "ch02.copy_time" and rec.value > 0 and _num(rec.params.get("nbytes")) > 0:
        return _num(rec.params["nbytes"]) / rec.value / 1e9
    return None


def _workers_contradicted(rs: Any, chap: str) -> list[tuple[Any, Any, str]]:
    """``(best_num_workers = 0, the largest speed-up above 1 in every round, why)`` in chapter ``chap``."""
    mine = [r for r in rs.records if r.key.startswith(chap + ".")]
    ups = [
        r
        for r in mine
        if r.key.endswith(".speedup")
        and _num(r.params.get("num_workers")) > 0
        and r.value > 1
        and _num(r.spread.get("min"), r.value) > 1
    ]
    if not ups:
        return []
    up = max(ups, key=lambda r: r.value)
    why = (
        f"contradictory: best_num_workers = 0, yet {up.key} measured x{up.value:.2f} for "
        f"num_workers={up.params.get('num_workers')} (every round above 1)"
    )
    return [(b, up, why) for b in mine if b.key.endswith("best_num_workers") and b.value == 0]


# ---------------------------------------------------------------------------
# Records -> plot data (tolerant of chapter modules still being written)
# ---------------------------------------------------------------------------


def _params(rec: Any) -> dict[str, Any]:
    """A record's params; ``{"params": {...}}`` (params passed as one keyword) is flattened."""
    p = dict(getattr(rec, "params", None) or (rec.get("params") if isinstance(rec, dict) else None) or {})
    inner = p.get("params")
    if isinstance(inner, dict) and len(p) == 1:
        p = dict(inner)
    return p


def _records(rs: Any, key: str) -> list[Any]:
    return [r for r in rs.records if r.key == key]


def _records_prefix(rs: Any, prefix: str) -> list[Any]:
    return [r for r in rs.records if r.key.startswith(prefix)]


def _gbps(nbytes: float, seconds: float) -> float:
    return nbytes / seconds / 1e9


def _is_trace(value: Any) -> bool:
    return isinstance(value, dict) and isinstance(value.get("spans"), list) and bool(value["spans"])


_RATE_UNITS = {"items/s", "img/s", "images/s", "samples/s", "steps/s", "batches/s", "GB/s", "MB/s"}
_RATIO_UNITS = {"ratio", "fraction", "x"}
#: Bars per panel of measured rates or ratios; more records go on further pages (never dropped silently).
BARS_PER_PANEL = 14
#: Pages per chapter and kind; records beyond them are counted in the figure's footnote.
MAX_PAGES = 3
_LABEL_IGNORE = {"method", "n", "iqr_s", "device"}


def _bytes_tick(value: float, _pos: Any = None) -> str:
    return _fmt_bytes(value).replace(".0 ", " ") if value >= 1 else ""


def _plain_tick(value: float, _pos: Any = None) -> str:
    return f"{value:g}"


def _minor_tick(value: float, _pos: Any = None) -> str:
    """Label only the 2s and 5s between decades on a log axis."""
    if value <= 0:
        return ""
    lead = value / 10 ** math.floor(math.log10(value) + 1e-9)
    return f"{value:g}" if round(lead, 6) in (2.0, 5.0) else ""


def _inactive_settings(p: dict[str, Any]) -> list[str]:
    """Settings a record asked for that had no effect: ``X_active=False`` beside ``X...=True``.

    E.g. ``pin_memory=True`` with ``pin_active=False`` (nothing was pinned: no CUDA).
    """
    out = []
    for k, v in p.items():
        if k.endswith("_active") and v is False:
            stem = k[: -len("_active")]
            asked = [n for n, val in p.items() if n != k and n.startswith(stem) and val is True]
            out += [f"{n}=True had no effect ({k}=False)" for n in asked]
    return out


def _constant_params(recs: Sequence[Any]) -> dict[str, Any]:
    """Parameters with one value across every record of ``recs`` (what the bar labels leave out)."""
    plist = [_params(r) for r in recs]
    if not plist:
        return {}
    names = dict.fromkeys(k for p in plist for k in p if k not in _LABEL_IGNORE)
    out = {}
    for k in names:
        vals = {json.dumps(p.get(k), default=str) for p in plist}
        if len(vals) == 1 and all(k in p for p in plist) and not isinstance(plist[0][k], (dict, list)):
            out[k] = plist[0][k]
    return out


def _varying_labels(recs: Sequence[Any]) -> list[str]:
    """'key-without-chapter (the params that differ between records of that key)' per record.

    A setting that had no effect (:func:`_inactive_settings`) is said in the label,
    even when the parameter that shows it is the same in every record.
    """
    ignore = _LABEL_IGNORE
    by_key: dict[str, list[dict[str, Any]]] = {}
    for r in recs:
        by_key.setdefault(r.key, []).append(_params(r))
    varying: dict[str, list[str]] = {}
    for key, plist in by_key.items():
        names = dict.fromkeys(k for p in plist for k in p if k not in ignore)
        shown: list[str] = []
        for k in names:
            if len({json.dumps(p.get(k), default=str) for p in plist}) < 2:
                continue
            # skip a parameter that only relabels ones already shown (e.g. label/order beside stage)
            before = {json.dumps([p.get(c) for c in shown], default=str) for p in plist}
            after = {json.dumps([p.get(c) for c in shown + [k]], default=str) for p in plist}
            if not shown or len(after) > len(before):
                shown.append(k)
        varying[key] = shown
    out = []
    for r in recs:
        p = _params(r)
        shown_text = ", ".join(f"{k}={p.get(k)}" for k in varying[r.key][:3])
        label = f"{r.key[5:]} ({shown_text})" if shown_text else r.key[5:]
        inactive = _inactive_settings(p)
        if inactive:
            label += " [no effect]"
        if getattr(r, "flags", None):
            label = "! " + label
        out.append(label)
    return out


def _fmt_bytes(n: float) -> str:
    return human_bytes(int(n))


# ---------------------------------------------------------------------------
# The PNG summary
# ---------------------------------------------------------------------------

SummaryPanel = Callable[[Any, Any], None]


def _panel_bandwidth(rs: Any) -> tuple[str, Callable[[Any], None]] | str:
    copies = _records(rs, "ch02.copy_time")
    host = _records(rs, "ch02.host_copy_time")
    if not copies and not host:
        return "ch02 bandwidth sweep: no ch02.copy_time or ch02.host_copy_time records"
    fits: dict[tuple[str, str], dict[str, float]] = {}
    for r in _records_prefix(rs, "ch02.fit."):
        p = _params(r)
        fits.setdefault((str(p.get("direction")), str(p.get("memory"))), {})[r.key.rsplit(".", 1)[-1]] = r.value
    series: dict[str, tuple[list[float], list[float]]] = {}
    for r in copies:
        p = _params(r)
        if "nbytes" not in p or r.value <= 0:
            continue
        d, m = str(p.get("direction", "?")), str(p.get("memory", "?"))
        label = f"{d.upper()} {m}"
        f = fits.get((d, m), {})
        if "bandwidth" in f and "latency" in f:
            label += f" (fit: {f['latency'] * 1e6:.1f} µs + size / {f['bandwidth']:.1f} GB/s)"
        xs, ys = series.setdefault(label, ([], []))
        xs.append(float(p["nbytes"]))
        ys.append(_gbps(float(p["nbytes"]), r.value))
    for r in host:
        p = _params(r)
        if "nbytes" in p and r.value > 0:
            xs, ys = series.setdefault("host memcpy on the CPU (bytes / time; not a GPU transfer)", ([], []))
            xs.append(float(p["nbytes"]))
            ys.append(_gbps(float(p["nbytes"]), r.value))
    if not series:
        return "ch02 bandwidth sweep: records lack the nbytes parameter"
    for xs, ys in series.values():
        order = sorted(range(len(xs)), key=xs.__getitem__)
        xs[:], ys[:] = [xs[i] for i in order], [ys[i] for i in order]
    report = rs.provenance.get("report", {}) if isinstance(rs.provenance, dict) else {}
    ceiling = None
    if report.get("link_bandwidth_gbps"):
        desc = report.get("link_description") or "link ceiling"
        ceiling = (float(report["link_bandwidth_gbps"]), f"{desc.split(' (')[0]}: theoretical ceiling")

    def draw(ax: Any) -> None:
        from matplotlib.ticker import FuncFormatter, NullLocator  # optional/heavy: matplotlib

        from helpers.chapters.ch02.figures import sweep_plot  # optional/heavy: matplotlib

        sweep_plot(
            series,
            ax,
            xlabel="transfer size",
            ylabel="bandwidth (GB/s, log scale)",
            title="ch02 · bandwidth by size and direction",
            ceiling=ceiling,
        )
        xs_all = [x for xs, _ in series.values() for x in xs]
        ticks = [float(2**k) for k in range(0, 41, 2) if min(xs_all) / 2 <= 2**k <= max(xs_all) * 2]
        if ticks:
            ax.set_xticks(ticks)
            ax.xaxis.set_minor_locator(NullLocator())
        ax.xaxis.set_major_formatter(FuncFormatter(_bytes_tick))
        ax.yaxis.set_major_formatter(FuncFormatter(_plain_tick))
        ys_all = [y for _, ys in series.values() for y in ys if y > 0]
        if ys_all and max(ys_all) / min(ys_all) < 300:
            ax.yaxis.set_minor_formatter(FuncFormatter(_minor_tick))
            ax.tick_params(axis="y", which="minor", labelsize=7)
        ax.legend(fontsize=6.5, loc="lower right")

    return "ch02 · bandwidth by size and direction", draw


def _panel_pin_cost(rs: Any) -> tuple[str, Callable[[Any], None]] | str:
    recs = _records_prefix(rs, "ch02.pin.")
    if not recs:
        return "ch02 pinning cost: no ch02.pin.* records (recorded only with CUDA)"
    sizes = sorted({float(_params(r).get("nbytes", 0)) for r in recs})
    kinds = list(dict.fromkeys(r.key.rsplit(".", 1)[-1] for r in recs))
    table = {(r.key.rsplit(".", 1)[-1], float(_params(r).get("nbytes", 0))): r.value for r in recs}

    def draw(ax: Any) -> None:
        width = 0.8 / max(1, len(kinds))
        for i, k in enumerate(kinds):
            vals = [table.get((k, s), float("nan")) * 1e3 for s in sizes]
            ax.bar([j + i * width for j in range(len(sizes))], vals, width=width, label=k.replace("_", " "))
        ax.set_xticks([j + width * (len(kinds) - 1) / 2 for j in range(len(sizes))])
        ax.set_xticklabels([_fmt_bytes(s) for s in sizes])
        ax.set_yscale("log")
        ax.set_ylabel("time (ms, log scale)")
        ax.set_xlabel("buffer size")
        ax.set_title("ch02 · cost of pinning vs a plain copy")
        ax.legend(fontsize=7)
        ax.grid(axis="y", alpha=0.3, which="both")

    return "ch02 · cost of pinning", draw


def _panels_timelines(rs: Any, per_chapter: int = 2, limit: int = 4) -> list[tuple[str, Callable[[Any], None]] | str]:
    """Span-trace artifacts as timelines: ch05 first, at most ``per_chapter`` per chapter (first and last)."""
    names = [k for k, v in rs.artifacts.items() if _is_trace(v)]
    if not names:
        return ["timelines: no span-trace artifacts (e.g. ch05 overlap traces) in this file"]
    groups: dict[str, list[str]] = {}
    for k in names:
        groups.setdefault(k.split(".", 1)[0], []).append(k)
    chosen: list[str] = []
    for chap in sorted(groups, key=lambda c: (c != "ch05", c)):
        g = groups[chap]
        pick = g if len(g) <= per_chapter else [g[0], g[-1]][:per_chapter]
        chosen += pick[: max(0, limit - len(chosen))]
    out: list[tuple[str, Callable[[Any], None]] | str] = []
    for name in chosen:

        def draw(ax: Any, _name: str = name) -> None:
            from helpers.ui.plots import timeline  # optional/heavy: matplotlib

            timeline(rs.artifacts[_name], ax, title=f"timeline · {_name}", max_steps=6)

        out.append((f"timeline · {name}", draw))
    rest = [k for k in names if k not in chosen]
    if rest:
        prefixes = sorted({k.rsplit(".", 1)[0] + ".*" for k in rest})
        out.append(
            f"timelines: {len(rest)} more trace(s) not drawn ({', '.join(prefixes)}); "
            "redraw them with helpers.ui.plots.timeline"
        )
    return out


def _waterfall_metric(rs: Any) -> str:
    """'step time' for ch06.waterfall.step_time, etc."""
    for r in _records_prefix(rs, "ch06."):
        if "waterfall" in r.key:
            last = r.key.rsplit(".", 1)[-1]
            return "value" if last == "waterfall" else last.replace("_", " ")
    return "value"


def _waterfall_groups(rs: Any) -> dict[str, list[tuple[str, float, str]]]:
    """ch06 waterfall records grouped by regime: regime -> [(stage, value, unit)] in recorded order."""
    groups: dict[str, list[tuple[int, int, str, float, str]]] = {}
    for i, r in enumerate(_records_prefix(rs, "ch06.")):
        p = _params(r)
        stage = p.get("stage", p.get("step"))
        if stage is None or "waterfall" not in r.key:
            continue
        order = p.get("order", i)
        groups.setdefault(str(p.get("regime", "default")), []).append(
            (int(order) if isinstance(order, (int, float)) else i, i, str(stage), r.value, r.unit)
        )
    return {g: [(s, v, u) for _, _, s, v, u in sorted(rows)] for g, rows in groups.items()}


def _panels_waterfall(rs: Any) -> list[tuple[str, Callable[[Any], None]] | str]:
    groups = _waterfall_groups(rs)
    if not groups:
        return ["ch06 capstone waterfall: no ch06.waterfall* records with a 'stage' parameter"]
    out: list[tuple[str, Callable[[Any], None]] | str] = []
    for regime, rows in groups.items():

        def draw(ax: Any, _regime: str = regime, _rows: list[tuple[str, float, str]] = rows) -> None:
            unit = _rows[0][2]
            scale, shown = (1e3, "ms") if unit == "s" else (1.0, unit)
            vals = [v * scale for _, v, _ in _rows]
            ax.bar(range(len(vals)), vals, color=["#bab0ac"] + ["#4e79a7"] * (len(vals) - 1))
            for j, v in enumerate(vals):
                ax.text(j, v, f"{v:.0f}" if abs(v) >= 100 else f"{v:.3g}", ha="center", va="bottom", fontsize=7)
            ax.set_xticks(range(len(vals)))
            ax.set_xticklabels([s for s, _, _ in _rows], rotation=25, ha="right", fontsize=7)
            metric = _waterfall_metric(rs)
            ax.set_ylabel(f"{metric} ({shown})")
            ax.set_title(f"ch06 · capstone waterfall ({_regime})")
            ax.grid(axis="y", alpha=0.3)

        out.append((f"ch06 · capstone waterfall ({regime})", draw))
    return out


def _pages(recs: Sequence[Any], size: int) -> list[list[Any]]:
    """Records split into pages of at most ``size``, keeping a key's records together where they fit."""
    groups: dict[str, list[Any]] = {}
    for r in recs:
        groups.setdefault(r.key, []).append(r)
    pages: list[list[Any]] = [[]]
    for g in groups.values():
        if pages[-1] and len(pages[-1]) + len(g) > size:
            pages.append([])
        for r in g:
            if len(pages[-1]) >= size:
                pages.append([])
            pages[-1].append(r)
    return [p for p in pages if p]


def _bar_panel(chap: str, kind: str, recs: list[Any], page: int, pages: int) -> tuple[str, Callable[[Any], None]]:
    """One horizontal bar panel of a chapter's measured rates or ratios (flagged bars in red)."""
    title = f"{chap} · measured {kind}" + (f" ({page}/{pages})" if pages > 1 else "")

    def draw(ax: Any) -> None:
        labels = _varying_labels(recs)
        vals = [r.value for r in recs]
        colors = ["#e15759" if getattr(r, "flags", None) else "#4e79a7" for r in recs]
        ax.barh(range(len(vals)), vals, color=colors)
        ax.set_yticks(range(len(vals)))
        ax.set_yticklabels(labels, fontsize=6.5)
        ax.invert_yaxis()
        units = " / ".join(sorted({r.unit for r in recs}))
        positive = [v for v in vals if v > 0]
        if kind == "rates" and positive and max(positive) / min(positive) > 30:
            ax.set_xscale("log")
            units += " (log scale)"
        if kind == "ratios":
            ax.axvline(1.0, color="black", lw=0.8, ls="--")
            for j, v in enumerate(vals):
                ax.text(v, j, f" {v:.2f}", va="center", fontsize=6)
        ax.set_xlabel(units + ("  (dashed: 1)" if kind == "ratios" else ""))
        notes = []
        const = _constant_params(recs)
        if const:
            notes.append("same in every bar: " + ", ".join(f"{k}={v}" for k, v in list(const.items())[:4]))
        inactive = sorted({t for r in recs for t in _inactive_settings(_params(r))})
        if inactive:
            notes.append("NO EFFECT: " + "; ".join(inactive) + " — differences between those bars are noise")
        if any(getattr(r, "flags", None) for r in recs):
            notes.append("red '!': flagged as impossible or contradictory (see the footnote)")
        ax.set_title(title + "".join("\n" + n for n in notes), fontsize=8 if notes else 10)
        ax.grid(axis="x", alpha=0.3)

    return title, draw


def _panels_measured(rs: Any, rate_skip: Iterable[str]) -> list[tuple[str, Callable[[Any], None]] | str]:
    """Bar panels per chapter of its measured rates and of its ratios/fractions (speed-ups, shares).

    Chapters in ``rate_skip`` get no rate panel (they have their own plot), but their
    ratios are drawn. At most :data:`BARS_PER_PANEL` bars per panel and
    :data:`MAX_PAGES` pages per chapter and kind; records beyond that are counted
    in the footnote, never dropped without a word.
    """
    skip = tuple(rate_skip)
    by: dict[tuple[str, str], list[Any]] = {}
    for r in rs.records:
        if not re.match(r"ch\d\d\.", r.key):
            continue
        if r.unit in _RATE_UNITS and not r.key.startswith(skip):
            by.setdefault((r.key[:4], "rates"), []).append(r)
        elif r.unit in _RATIO_UNITS:
            by.setdefault((r.key[:4], "ratios"), []).append(r)
    out: list[tuple[str, Callable[[Any], None]] | str] = []
    for (chap, kind), recs in sorted(by.items()):
        pages = _pages(recs, BARS_PER_PANEL)
        shown = pages[:MAX_PAGES]
        for i, page in enumerate(shown, 1):
            out.append(_bar_panel(chap, kind, page, i, len(shown)))
        left = sum(len(p) for p in pages[MAX_PAGES:])
        if left:
            keys = sorted({r.key for p in pages[MAX_PAGES:] for r in p})
            out.append(
                f"{chap} measured {kind}: {left} more record(s) not drawn ({', '.join(keys[:6])}"
                f"{', ...' if len(keys) > 6 else ''}); every record is in the results file"
            )
    return out


def summary_panels(rs: Any) -> tuple[list[tuple[str, Callable[[Any], None]]], list[str]]:
    """(panels to draw, reasons for the panels skipped) for a result set."""
    items: list[tuple[str, Callable[[Any], None]] | str] = [_panel_bandwidth(rs), _panel_pin_cost(rs)]
    items += _panels_timelines(rs)
    items += _panels_waterfall(rs)
    items += _panels_measured(rs, ("ch02.", "ch06."))  # ch02 and ch06 draw their rates in their own panels
    panels = [i for i in items if not isinstance(i, str)]
    skipped = [i for i in items if isinstance(i, str)]
    return panels, skipped


def summary_figure(rs: Any, path: str | Path) -> tuple[Path, list[str], list[str]]:
    """Draw the PNG summary of ``rs`` to ``path``; returns (path, panels drawn, panels skipped with why)."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    flags = flag_lines(rs)  # flags old files too; the figure draws flagged bars in red
    panels, skipped = summary_panels(rs)
    ncols = 2
    nrows = max(1, math.ceil(len(panels) / ncols))
    n_foot = 2 + sum(1 + len(s) // 150 for s in skipped) + sum(1 + len(f) // 150 for f in flags)
    fig = plt.figure(figsize=(15, 1.2 + 4.2 * nrows + 0.16 * n_foot), layout="constrained")
    grid = fig.add_gridspec(nrows + 1, ncols, height_ratios=[4.2] * nrows + [0.2 + 0.16 * n_foot])
    drawn: list[str] = []
    for i, (title, draw) in enumerate(panels):
        ax = fig.add_subplot(grid[i // ncols, i % ncols])
        try:
            draw(ax)
            drawn.append(title)
        except Exception as exc:  # one odd record format must not lose the whole summary
            ax.clear()
            ax.axis("off")
            ax.text(
                0.5, 0.5, f"{title}\ncould not be drawn: {exc!r}"[:300], ha="center", va="center", fontsize=8, wrap=True
            )
            skipped.append(f"{title}: drawing failed ({exc!r})")
    foot = fig.add_subplot(grid[nrows, :])
    foot.axis("off")
    import textwrap

    lines = ["Not drawn (panels whose records are missing, records beyond the pages):"]
    for item in skipped:
        lines += textwrap.wrap(item, 150, initial_indent="  • ", subsequent_indent="    ")
    if not skipped:
        lines = ["Every panel had its records, and every record of a drawn kind is drawn."]
    flag_text: list[str] = []
    if flags:
        flag_text = ["FLAGGED as impossible or contradictory (red bars marked '!'):"]
        for item in flags:
            flag_text += textwrap.wrap(item, 150, initial_indent="  ! ", subsequent_indent="    ")
    foot.text(
        0.0,
        1.0,
        "\n".join([" "] * len(flag_text) + ([""] if flag_text else []) + lines),
        va="top",
        ha="left",
        fontsize=8,
        family="monospace",
        transform=foot.transAxes,
    )
    if flags:
        foot.text(
            0.0,
            1.0,
            "\n".join(flag_text),
            va="top",
            ha="left",
            fontsize=8,
            family="monospace",
            color="#c0392b",
            transform=foot.transAxes,
        )
    if not panels:
        fig.text(
            0.5,
            0.6,
            "No panel could be drawn: this file has none of the records the summary plots.",
            ha="center",
            fontsize=11,
        )
    hw = rs.hardware.get("gpu_name") or f"no GPU (CPU: {rs.hardware.get('cpu_model') or 'unknown'})"
    fig.suptitle(
        f"tools.bench summary — {hw}\n{rs.label()}; benchmark v{rs.benchmark_version}; "
        "measured values only (dashed: a theoretical ceiling, or 1 in a ratio panel)",
        fontsize=10,
    )
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return path, drawn, skipped


# ---------------------------------------------------------------------------
# Reference files and the README table
# ---------------------------------------------------------------------------


def slug(text: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'nvidia-h100-80gb-hbm3'."""
    s = re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")
    return s or "unknown"


def reference_path(rs: Any, folder: str | Path | None = None) -> Path:
    """``helpers/core/reference/<gpu-slug>-<date>.json`` (``-2``, ``-3`` ... if taken)."""
    folder = Path(folder) if folder is not None else reference_dir()
    gpu = rs.hardware.get("gpu_name") or "cpu"
    base = f"{slug(gpu)}-{rs.created[:10]}"
    path = folder / f"{base}.json"
    n = 2
    while path.exists():
        path = folder / f"{base}-{n}.json"
        n += 1
    return path


def _first(rs: Any, key: str, **params: Any) -> Any:
    for r in _records(rs, key):
        p = _params(r)
        if all(p.get(k) == v for k, v in params.items()):
            return r
    return None


def _cell_fit(rs: Any, direction: str, memory: str) -> str:
    r = _first(rs, "ch02.fit.bandwidth", direction=direction, memory=memory)
    return f"{r.value:.1f}" if r else "—"


def _cell_best(rs: Any, direction: str, memory: str) -> str:
    best = None
    for r in _records(rs, "ch02.copy_time"):
        p = _params(r)
        if p.get("direction") == direction and p.get("memory") == memory and "nbytes" in p and r.value > 0:
            g = _gbps(float(p["nbytes"]), r.value)
            if best is None or g > best[0]:
                best = (g, float(p["nbytes"]))
    return f"{best[0]:.1f} @ {_fmt_bytes(best[1])}" if best else "—"


def _cell_latency(rs: Any) -> str:
    r = _first(rs, "ch02.fit.latency", direction="h2d", memory="pinned")
    return f"{r.value * 1e6:.1f}" if r else "—"


def _cell_pin(rs: Any) -> str:
    recs = _records(rs, "ch02.pin.cold")
    if not recs:
        return "—"
    r = max(recs, key=lambda x: float(_params(x).get("nbytes", 0)))
    return f"{r.value * 1e3:.2f} ({_fmt_bytes(float(_params(r).get('nbytes', 0)))})"


def _cell_waterfall(rs: Any) -> str:
    groups = _waterfall_groups(rs)
    if not groups:
        return "—"
    parts = []
    for regime, rows in groups.items():
        (_, v0, unit), (_, v1, _) = rows[0], rows[-1]
        if unit == "s":
            parts.append(f"{regime}: {v0 * 1e3:.3g} → {v1 * 1e3:.3g} ms/step")
        else:
            parts.append(f"{regime}: {v0:.3g} → {v1:.3g} {unit}")
    return "; ".join(parts)


def _cell_ceiling(rs: Any) -> str:
    rep = rs.provenance.get("report", {}) if isinstance(rs.provenance, dict) else {}
    if rep.get("link_bandwidth_gbps"):
        desc = (rep.get("link_description") or "").split(" (")[0]
        return (
            f"{float(rep['link_bandwidth_gbps']):.1f} ({desc})" if desc else f"{float(rep['link_bandwidth_gbps']):.1f}"
        )
    return "not reported"


def readme_table(sets: Sequence[Any] | None = None) -> str:
    """Markdown: one row of headline measured figures per reference file, then the theoretical ceiling.

    Rendered from the committed reference files (``helpers/core/reference/*.json``,
    or ``$WORKBOOK_REFERENCE_DIR``). Measured and theoretical columns are
    separated; nothing is filled in that a file does not hold ("—").
    """
    if sets is None:
        sets = references()
    sets = sorted(sets, key=lambda r: (r.hardware.get("gpu_name") or "~", r.created))
    header = (
        "| GPU | recorded (UTC) | mode | torch / CUDA / driver | H2D pinned GB/s (fit) | H2D pinned, best point "
        "| H2D pageable GB/s (fit) | D2H pinned GB/s (fit) | D2H pageable GB/s (fit) | H2D pinned latency µs (fit) "
        "| pinning, cold, ms (size) | capstone waterfall, first → last stage | ‖ | link ceiling per direction, GB/s "
        "— theoretical, not measured |\n"
        "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|---|---:|"
    )
    if not sets:
        return header + "\n| *no reference results recorded yet* | | | | | | | | | | | | ‖ | |"
    rows = [header]
    for rs in sets:
        p = rs.provenance if isinstance(rs.provenance, dict) else {}
        versions = (
            f"{p.get('torch_version') or '?'} / {p.get('cuda_runtime_version') or '?'} / "
            f"{p.get('driver_version') or '?'}"
        )
        rows.append(
            f"| {rs.hardware.get('gpu_name') or 'no GPU'} | {rs.created[:16].replace('T', ' ')} | {rs.mode} "
            f"| {versions} "
            f"| {_cell_fit(rs, 'h2d', 'pinned')} | {_cell_best(rs, 'h2d', 'pinned')} "
            f"| {_cell_fit(rs, 'h2d', 'pageable')} "
            f"| {_cell_fit(rs, 'd2h', 'pinned')} | {_cell_fit(rs, 'd2h', 'pageable')} | {_cell_latency(rs)} "
            f"| {_cell_pin(rs)} | {_cell_waterfall(rs)} | ‖ | {_cell_ceiling(rs)} |"
        )
    return "\n".join(rows)


def ceiling_table() -> str:
    """Markdown: theoretical per-direction PCIe x16 ceilings, from :func:`helpers.core.device.pcie_bandwidth_gbps`."""
    from helpers.core.device import pcie_bandwidth_gbps  # heavy: torch (this module imports without it)

    rows = ["| host link (theoretical) | per direction, GB/s (10^9 B/s) |", "|---|---:|"]
    for gen in (3, 4, 5, 6):
        rows.append(f"| PCIe Gen{gen} x16 | {pcie_bandwidth_gbps(gen, 16):.1f} |")
    return "\n".join(rows)


def readme_sections(sets: Sequence[Any] | None = None) -> list[tuple[str, str]]:
    """The README's generated sections, in order, as (heading, markdown table); kinds never mixed.

    * **Measured**: one row per committed reference file (:func:`readme_table`);
    * **Theoretical**: the link ceilings (:func:`ceiling_table`).

    Figures published elsewhere have their own README block, generated from
    ``helpers/ui/published.json`` (`tools/published_table.py`).
    """
    sections = [
        ('**Measured** (one row per committed reference file; "—" = not recorded in that file):', readme_table(sets))
    ]
    sections.append(
        ("**Theoretical** link ceilings (from the PCIe generation and width; never measured):", ceiling_table())
    )
    return sections


def readme_block(sets: Sequence[Any] | None = None) -> str:
    """The generated README section: measured, then theoretical tables, kept apart."""
    return "\n\n".join(f"{heading}\n\n{table}" for heading, table in readme_sections(sets))


TABLE_START = "<!-- reference-table:start (generated by `python -m tools.bench --readme-table --update FILE`) -->"
TABLE_END = "<!-- reference-table:end -->"


def update_table_file(path: str | Path, table: str) -> Path:
    """Replace the text between the table markers in ``path`` with ``table``."""
    path = Path(path)
    text = path.read_text(encoding="utf-8")
    start, end = text.find(TABLE_START), text.find(TABLE_END)
    if start < 0 or end < start:
        raise ValueError(f"--update: {path} has no '{TABLE_START}' ... '{TABLE_END}' markers")
    new = text[: start + len(TABLE_START)] + "\n" + table + "\n" + text[end:]
    path.write_text(new, encoding="utf-8")
    return path


# ---------------------------------------------------------------------------
# The command
# ---------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m tools.bench",
        description="Run every chapter's measurements headless; write one results file (JSON, with provenance) "
        "and a PNG summary.",
    )
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="small sizes (sets WORKBOOK_QUICK=1)")
    mode.add_argument(
        "--full",
        action="store_true",
        help="full sizes on any machine (sets WORKBOOK_FULL=1); the default on a CUDA machine",
    )
    ap.add_argument("--out", metavar="PATH", help="results file (default: artifacts/bench-<gpu>-<time>.json)")
    ap.add_argument("--png", metavar="PATH", help="PNG summary (default: the results path with .png)")
    ap.add_argument("--no-png", action="store_true", help="write no PNG summary")
    ap.add_argument("--chapters", metavar="LIST", help="comma-separated chapter ids, e.g. 01,02,05 (default: all)")
    ap.add_argument("--device", metavar="DEV", help="torch device to measure on (default: CUDA if present, else CPU)")
    ap.add_argument(
        "--reference",
        action="store_true",
        help="also save the results as a reference file helpers/core/reference/<gpu>-<date>.json "
        "(needs CUDA and full mode)",
    )
    ap.add_argument(
        "--strict",
        action="store_true",
        help=f"strict GPU run: require CUDA, a chapter that records nothing fails (also {REQUIRE_GPU_ENV}=1)",
    )
    ap.add_argument(
        "--budget-s",
        type=float,
        metavar="S",
        help="time budget: each chapter may run for its share "
        "of the time left and is stopped (marked 'timed out', partial file kept) when it outruns it",
    )
    ap.add_argument("--no-progress", action="store_true", help="no progress bars")
    ap.add_argument("--notes", default="", help="free text stored in the results file (e.g. the cluster's name)")
    ap.add_argument("--list", action="store_true", help="list the chapters and whether their benchmark() exists")
    ap.add_argument("--plot-only", metavar="RESULTS", help="only draw the PNG summary of an existing results file")
    ap.add_argument(
        "--reference-from",
        metavar="RESULTS",
        help="save an existing (possibly partial) GPU results file "
        "as a reference file, keeping only the chapters that completed",
    )
    ap.add_argument(
        "--compare",
        metavar="RESULTS",
        help="compare a results file with the reference files (ratios "
        "only where the hardware matches; otherwise each reference is shown as 'recorded on ...')",
    )
    ap.add_argument("--against", metavar="REF", help="with --compare: one reference/results file instead of all")
    ap.add_argument(
        "--readme-table",
        action="store_true",
        help="print the README tables (measured reference figures from the committed reference files, "
        "then the theoretical link ceilings)",
    )
    ap.add_argument(
        "--update", metavar="FILE", help="with --readme-table: replace the table between the markers in FILE"
    )
    return ap


def _default_out(gpu: str | None) -> Path:
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    return artifacts_dir() / f"bench-{slug(gpu or 'cpu')}-{stamp}.json"


def run(
    *,
    chapters: Sequence[Chapter] = CHAPTERS,
    device: Any = None,
    out: str | Path | None = None,
    png: str | Path | Literal[False] | None = None,
    reference: bool = False,
    strict: bool = False,
    progress: bool = True,
    notes: str = "",
    argv: Sequence[str] | None = None,
    budget_s: float | None = None,
) -> tuple[int, Any, dict[str, Any]]:
    """Run the benchmarks and write the files. Returns (exit code, ResultSet, paths/outcomes summary).

    The size tier comes from :func:`helpers.core.config.size_tier` (``main`` sets
    ``WORKBOOK_QUICK``/``WORKBOOK_FULL`` from --quick/--full). ``budget_s``: see
    :func:`run_benchmarks`. Refusals (exit code 2) print one line and measure nothing.
    """
    import torch

    from helpers.core.device import has_cuda, pick_device  # heavy: torch (this module imports without it)

    def err(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    cuda_here = has_cuda()
    if strict and not cuda_here:  # before pick_device(), which raises under WORKBOOK_REQUIRE_GPU=1
        err(
            f"refusing: a strict GPU run ({REQUIRE_GPU_ENV}=1 or --strict) needs a CUDA device, and none is "
            "present on this machine."
        )
        return 2, None, {}
    dev = torch.device(device) if device is not None else pick_device()
    cuda = cuda_here and dev.type == "cuda"
    if strict and not cuda:
        err(f"refusing: a strict GPU run ({REQUIRE_GPU_ENV}=1 or --strict) needs a CUDA device, and --device is {dev}.")
        return 2, None, {}
    if reference and not cuda:
        err(
            "refusing --reference: reference results must be measured on a CUDA GPU, and "
            + ("no CUDA device is present on this machine." if not cuda_here else f"--device is {dev}.")
        )
        return 2, None, {}
    tier = mode_name()
    if reference and tier != "full":
        err(f"refusing --reference in {tier} mode: reference results are recorded with full sizes (use --full).")
        return 2, None, {}
    png_target: str | Path | None = png if png is not None and png is not False else None
    if png_target is None and png is not False and out:
        png_target = Path(out).with_suffix(".png")  # the default summary path, beside the results
    problems = output_problems(out, png_target) + folder_problems(
        ("WORKBOOK_CACHE",) if out else ("WORKBOOK_ARTIFACTS", "WORKBOOK_CACHE")
    )
    if problems:
        err(f"error: {problems[0]}")
        return 2, None, {}

    LiveResultSet = _live_result_set_class()
    started = time.perf_counter()
    rs = LiveResultSet.new("bench", METHOD, device=dev, notes=notes)
    commit, dirty = _git_commit()
    bench_info: dict[str, Any] = {
        "command": "python -m tools.bench " + " ".join(argv if argv is not None else sys.argv[1:]),
        "started": rs.created,
        "chapters_requested": [c.label for c in chapters],
        "strict": bool(strict),
        "device": str(dev),
        "versions": _versions(),
        "python_executable": sys.executable,
        "git_commit": commit,
        "git_dirty": dirty,
        "cpu_threads": torch.get_num_threads(),
        "machine": platform.machine(),
        "mode": tier,
        "budget_s": budget_s,
    }
    rs.provenance["bench"] = bench_info
    print(
        f"tools.bench: {rs.mode} mode on {dev} "
        f"({rs.hardware.get('gpu_name') or 'no CUDA device'}); chapters {', '.join(c.label for c in chapters)}",
        file=sys.stderr,
        flush=True,
    )

    out_path = Path(out) if out else _default_out(rs.hardware.get("gpu_name"))

    def plain_copy() -> ResultSet:  # a plain ResultSet (without the progress hook class)
        return ResultSet(**{f: getattr(rs, f) for f in ResultSet.__dataclass_fields__})

    def checkpoint(done: list[ChapterOutcome]) -> None:
        bench_info["chapters"] = [asdict(o) for o in done]
        bench_info["partial"] = True
        plain_copy().save(out_path)

    interrupted = False
    outcomes: list[ChapterOutcome] = []
    # Ctrl-C (SIGINT) and SIGTERM (a scheduler's or the GPU check's time limit) -> KeyboardInterrupt in this
    # process only, remembered: a chapter that swallows it is still interrupted (exit 130 / 143, never 0).
    stop = StopSignals()
    with stop.installed():
        try:
            run_benchmarks(
                rs,
                dev,
                chapters,
                strict=strict,
                progress=progress,
                checkpoint=checkpoint,
                into=outcomes,
                budget_s=budget_s,
                stop=stop,
            )
        except KeyboardInterrupt:
            interrupted = True
        if stop.received is not None:
            interrupted = True
    if interrupted:
        released = _release_children()
        err(
            f"\ninterrupted ({stop.name or 'KeyboardInterrupt'}): writing what was measured so far to {out_path}"
            + (f" (stopped {len(released)} leftover worker process(es))" if released else "")
        )
        bench_info["interrupted_by"] = stop.name or "KeyboardInterrupt"
    bench_info.pop("partial", None)
    bench_info["chapters"] = [asdict(o) for o in outcomes]
    bench_info["seconds"] = round(time.perf_counter() - started, 2)
    bench_info["finished"] = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    bench_info["interrupted"] = interrupted
    failed = [o for o in outcomes if o.status in ("failed", "timed out")]
    bench_info["ok"] = not failed and not interrupted

    flags = flag_lines(rs)
    bench_info["flags"] = flags

    plain = plain_copy()
    plain.save(out_path)
    paths: dict[str, Any] = {"results": str(out_path)}
    ref_path = None
    if reference:
        ref = reference_subset(plain, outcomes)
        if ref.records:
            ref_path = reference_path(ref)
            ref.save(ref_path)
            paths["reference"] = str(ref_path)
        else:
            err("no reference file written: no chapter completed with records")
    if png is not False:
        png_path = Path(png) if png else out_path.with_suffix(".png")
        try:
            _, drawn, skipped = summary_figure(plain, png_path)
            paths.update(png=str(png_path), panels=drawn, panels_skipped=skipped)
        except Exception as exc:
            err(_banner(f"the PNG summary could not be drawn: {exc!r}\n{traceback.format_exc()}"))
            failed.append(ChapterOutcome(chapter="summary", module="tools.bench", status="failed", reason=repr(exc)))

    # -- the report -------------------------------------------------------------
    print("\ntools.bench summary", flush=True)
    print(f"  {plain.label()}")
    for o in outcomes:
        extra = (
            f"{o.records} records, {o.artifacts} artifacts, {o.seconds:.1f} s" if o.status != "skipped" else o.reason
        )
        if o.status == "failed":
            extra = f"{o.reason} ({o.seconds:.1f} s)"
        print(f"  {o.chapter:<9} {o.module:<22} {o.status.upper():<9} {extra}")
    print(f"  total: {len(plain.records)} records in {bench_info['seconds']:.1f} s ({tier} mode)")
    for msg in flags:
        print(f"  FLAGGED: {msg}")
    print(f"  results file: {out_path}")
    if ref_path:
        print(f"  reference file: {ref_path}  (commit it; see docs/GPU-CHECK.md)")
    if "png" in paths:
        print(f"  PNG summary: {paths['png']}")
        for s in paths.get("panels_skipped", []):
            print(f"    panel skipped — {s}")
    paths["outcomes"] = [asdict(o) for o in outcomes]
    if interrupted:
        return stop.exit_code, plain, paths
    if failed:
        names = ", ".join(o.chapter for o in failed)
        err(
            _banner(
                f"tools.bench: FAILED — {names}. The results file holds the other chapters' records; "
                "see the tracebacks above."
            )
        )
        return 1, plain, paths
    return 0, plain, paths


def compare_lines(mine: Any, refs: Sequence[Any]) -> list[str]:
    """Lines comparing ``mine`` with each reference: ratios (this run / reference) only on matching hardware."""
    lines: list[str] = []
    if not refs:
        return [missing_message("any benchmark")]
    for ref in refs:
        ok, why = comparable(ref, mine)
        if not ok:
            lines.append(f"{provenance_line(ref)} — not compared with your file: {why}")
            continue
        matched = compare_results(ref, mine)
        lines.append(
            f"{provenance_line(ref)} — same hardware: {len(matched)} matching records "
            "(reference -> yours, ratio yours/reference)"
        )
        lines += ["  " + ln for ln in matched]
        if ref.mode != mine.mode:
            lines.append(
                f"  note: the reference is {ref.mode} mode and yours is {mine.mode} mode; only records "
                "with identical parameters were matched"
            )
    return lines


def _reference_from_cli(path: str) -> int:
    try:
        rs = ResultSet.load(path)
    except (OSError, ValueError) as exc:
        print(f"error: --reference-from: {exc}", file=sys.stderr)
        return 2
    if not rs.hardware.get("gpu_name"):
        print("refusing --reference-from: that file was not measured on a CUDA GPU", file=sys.stderr)
        return 2
    if rs.mode != "full":
        print("refusing --reference-from: reference results are recorded in full mode", file=sys.stderr)
        return 2
    known = set(ChapterOutcome.__dataclass_fields__)
    outcomes = [
        ChapterOutcome(**{k: v for k, v in c.items() if k in known})
        for c in rs.provenance.get("bench", {}).get("chapters", [])
    ]
    ref = reference_subset(rs, outcomes)
    if not ref.records:
        print("no reference file written: no chapter completed with records", file=sys.stderr)
        return 1
    out = reference_path(ref)
    ref.save(out)
    print(f"  reference file: {out}  (commit it; see docs/GPU-CHECK.md)")
    return 0


def _compare_cli(path: str, against: str | None) -> int:
    try:
        mine = ResultSet.load(path)
        refs = [ResultSet.load(against)] if against else references()
    except (OSError, ValueError) as exc:
        print(f"error: --compare: {exc}", file=sys.stderr)
        return 2
    print(f"your file: {mine.label()}")
    for line in compare_lines(mine, refs):
        print(line)
    return 0


def reference_subset(rs: Any, outcomes: Sequence[ChapterOutcome]) -> Any:
    """A copy of ``rs`` keeping only the records and artifacts of chapters that completed ("ok").

    Reference files must not hold half a sweep from a chapter that failed or was
    interrupted; what was left out is listed in ``provenance["bench"]["reference_excludes"]``.
    """
    keep_idx: set[int] = set()
    keep_art: set[str] = set()
    dropped: list[str] = []
    for o in outcomes:
        span = range(o.first_record, o.first_record + o.records)
        if o.status == "ok":
            keep_idx.update(span)
            keep_art.update(o.artifact_names)
        elif o.records or o.artifact_names:
            dropped.append(f"{o.chapter} ({o.status}: {o.records} records, {len(o.artifact_names)} artifacts)")
    data = json.loads(json.dumps(rs.to_dict(), default=str))
    data["records"] = [r for i, r in enumerate(data["records"]) if i in keep_idx]
    data["artifacts"] = {k: v for k, v in data["artifacts"].items() if k in keep_art}
    data["provenance"].setdefault("bench", {})["reference_excludes"] = dropped
    return ResultSet.from_dict(data)


def _write_probe(folder: Path) -> str:
    """ "" if a file can really be created in ``folder``, else why not (a real write: ``os.access`` says
    yes to root everywhere, and to folders such as /proc that take no files)."""
    import tempfile

    try:
        fd, name = tempfile.mkstemp(prefix=".bench-probe-", dir=folder)
    except OSError as exc:
        return f"the folder {folder} is not writable ({exc.strerror or type(exc).__name__})"
    os.close(fd)
    with contextlib.suppress(OSError):
        os.unlink(name)
    return ""


def _unwritable(target: str | Path | None, suffix: str = "") -> str:
    """Why a file cannot be written at ``target`` ("" if it can). Folders are never created for it.

    ``suffix``: the extension the file must have (``.json`` for results, ``.png`` for the summary).
    """
    if target is None:
        return ""
    if str(target).strip() == "":
        return "the path is empty"
    path = Path(target).expanduser()
    parent = path.parent if str(path.parent) else Path(".")
    if path.is_dir():
        return f"{path} is a folder; give a file name such as {path / ('bench' + (suffix or '.json'))}"
    if suffix and path.suffix.lower() != suffix:
        return f"{path} does not end with {suffix}; give a {suffix} file name (e.g. {path.with_suffix(suffix).name})"
    if path.exists() and not path.is_file():
        return f"{path} exists and is not a regular file"
    if not parent.is_dir():
        what = "is a file, not a folder" if parent.exists() else "does not exist; create it first"
        return f"the folder {parent} {what} (the bench never creates it)"
    return _write_probe(parent)


def output_problems(out: str | Path | None, png: str | Path | None) -> list[str]:
    """Lines (``--flag: why``) saying why the bench's output paths cannot be used; empty when they can.

    The results file must be a writable ``.json``, the summary a writable ``.png``, and no two outputs may
    be the same file (``--out r.png`` would have the summary drawn over the results).
    """
    problems = [
        f"{flag}: {why}"
        for flag, target, sfx in (("--out", out, ".json"), ("--png", png, ".png"))
        if (why := _unwritable(target, sfx))
    ]
    if out is not None and png is not None and not problems:
        if Path(out).expanduser().resolve() == Path(png).expanduser().resolve():
            problems.append(f"--out and --png are the same file ({out}); give two different files")
    return problems


def folder_problems(names: Sequence[str] = ("WORKBOOK_ARTIFACTS", "WORKBOOK_CACHE")) -> list[str]:
    """Lines saying why a folder the run writes into cannot be used (from its environment variable, or the
    default), checked with a real write before any work starts; empty when every one can be used."""
    getters = {
        config.ARTIFACTS_ENV: ("artifacts", "results and figures"),
        config.CACHE_ENV: ("data-cache", "generated data sets"),
    }
    out = []
    for env in names:
        default, what = getters[env]
        raw = os.environ.get(env)
        if raw:
            folder, label = Path(raw).expanduser(), f"{env}={raw!r}"
        else:
            root = config.repo_root()
            folder = root / default if root else Path.home() / ".cache" / "gpu-data-workbook" / default
            label = f"the default folder for {what} ({folder}; set {env} to choose another)"
        if folder.exists() and not folder.is_dir():
            out.append(f"{label} is a file, not a folder; point {env} at a writable folder")
            continue
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            out.append(f"{label} cannot be created ({exc.strerror or exc}); point {env} at a writable folder")
            continue
        why = _write_probe(folder)
        if why:
            out.append(f"{label}: {why}; point {env} at a writable folder")
    return out


def _list(chapters: Sequence[Chapter]) -> int:
    for ch in chapters:
        fn, status, reason = _find_benchmark(ch)
        state = "benchmark() found" if fn is not None else f"{status}: {reason.splitlines()[0]}"
        print(f"{ch.label:<9} {ch.module:<22} {ch.title:<34} {state}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; returns the exit code (130 / 143 when stopped by Ctrl-C / SIGTERM)."""
    try:
        return _main(argv)
    except KeyboardInterrupt:  # before the chapters started, or a second Ctrl-C while writing the files
        _release_children()
        print(
            "\ninterrupted: stopped before the results were complete (a results file saved after the last "
            "finished chapter, if any, is kept)",
            file=sys.stderr,
        )
        return 130


def _main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    ap = _parser()
    args = ap.parse_args(args_list)
    if args.update and not args.readme_table:
        ap.error("--update needs --readme-table")
    if args.no_png and args.png:
        ap.error("--png and --no-png contradict each other; give one")
    try:
        config.check_environment()  # --quick/--full set WORKBOOK_QUICK/FULL: a typo in them would be lost
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.readme_table:
        table = readme_block()
        if args.update:
            try:
                update_table_file(args.update, table)
            except (OSError, ValueError) as exc:
                print(f"error: {exc}", file=sys.stderr)
                return 2
            print(f"updated the table in {args.update}")
        else:
            print(table)
        return 0
    if args.reference_from:
        return _reference_from_cli(args.reference_from)
    if args.against and not args.compare:
        ap.error("--against needs --compare")
    if args.compare:
        return _compare_cli(args.compare, args.against)
    if args.plot_only:
        try:
            rs = ResultSet.load(args.plot_only)
        except (OSError, ValueError) as exc:
            print(f"error: --plot-only: {exc}", file=sys.stderr)
            return 2
        png = Path(args.png) if args.png else Path(args.plot_only).with_suffix(".png")
        if png.resolve() == Path(args.plot_only).resolve():
            print("error: --png must differ from the results file", file=sys.stderr)
            return 2
        problem = _unwritable(png, ".png")
        if problem:
            print(f"error: --png: {problem}", file=sys.stderr)
            return 2
        _, drawn, skipped = summary_figure(rs, png)
        print(f"PNG summary: {png} ({len(drawn)} panels; skipped: {len(skipped)})")
        for s in skipped:
            print(f"  panel skipped — {s}")
        return 0
    if args.quick:
        os.environ["WORKBOOK_QUICK"], os.environ["WORKBOOK_FULL"] = "1", "0"
    elif args.full:  # explicit full sizes, on a CPU too (otherwise a CPU machine runs the laptop tier)
        os.environ["WORKBOOK_QUICK"], os.environ["WORKBOOK_FULL"] = "0", "1"
    if args.budget_s is not None and not 10 <= args.budget_s <= 7 * 86_400:
        print("error: --budget-s must be between 10 and 604800 seconds", file=sys.stderr)
        return 2
    try:
        strict = args.strict or require_gpu()
        quick_mode()  # validates WORKBOOK_QUICK early, with its own clear message
        size_tier()  # ... and WORKBOOK_FULL, and the two together
        chapters = select_chapters(args.chapters)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if strict:
        os.environ[REQUIRE_GPU_ENV] = "1"  # chapters read it too
    if args.list:
        return _list(chapters)
    os.environ.setdefault("MPLBACKEND", "Agg")
    device = args.device
    if device is not None:
        import torch

        try:
            torch.device(device)
        except (RuntimeError, ValueError):
            print(f"error: --device {device!r} is not a torch device (e.g. cuda, cuda:0, cpu)", file=sys.stderr)
            return 2
        dev = torch.device(device)
        if dev.type not in ("cpu", "cuda"):
            print(f"error: --device {device!r}: the bench measures on cpu or cuda", file=sys.stderr)
            return 2
        if dev.type == "cuda":
            n = torch.cuda.device_count() if torch.cuda.is_available() else 0
            if n == 0 or (dev.index is not None and dev.index >= n):
                print(
                    f"error: --device {device!r}: "
                    + (
                        "no CUDA device is present on this machine"
                        if n == 0
                        else f"this machine has {n} CUDA device(s), cuda:0 to cuda:{n - 1}"
                    ),
                    file=sys.stderr,
                )
                return 2
    code, _, _ = run(
        chapters=chapters,
        device=device,
        out=args.out,
        png=False if args.no_png else args.png,
        reference=args.reference,
        strict=strict,
        progress=not args.no_progress,
        notes=args.notes,
        argv=args_list,
        budget_s=args.budget_s,
    )
    return code


if __name__ == "__main__":
    sys.exit(main())
