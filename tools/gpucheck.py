"""The GPU check: prove the workbook's GPU paths on a real CUDA GPU, inside a short booking.

Run it on a machine with a CUDA GPU, from the workbook folder::

    python -m tools.gpucheck --steps smoke      # <= 6 min: CUDA-only unit tests + every notebook, quick sizes
    python -m tools.gpucheck                    # bench (full), then notebooks (full where it fits), then unit
    python -m tools.gpucheck --steps bench      # only the benchmark (records a reference file)
    python -m tools.gpucheck --steps notebooks --notebooks 02,05
    python -m tools.gpucheck --dry-run          # print what it would run

The steps (``--steps``, run in the order given), each with its own time limit
that it keeps by itself, so that a leased machine (10 minutes per command, 30
minutes in all) gets the whole check in at most four commands:

``smoke`` (``--smoke-timeout``, default 330 s)
    The CUDA-only unit tests (not the slow ones) first, alone (some are
    timing-sensitive: overlap ratios, the 2x2 labels), then every notebook in QUICK
    mode, ``WORKBOOK_REQUIRE_GPU=1``, ``--jobs`` of them at a time: catches every
    crash of a GPU path in a few minutes.
``bench`` (``--bench-timeout``, default 450 s)
    ``python -m tools.bench --full --strict --reference --budget-s ...``: each
    chapter gets its share of the step's time and is stopped when it outruns it;
    the results file is saved after each chapter; the reference file holds only
    the chapters that completed, in full mode.
``notebooks`` (``--notebooks-timeout``, default 450 s)
    Every notebook under nbval, one after another, each within its share of the
    step's limit (its recorded laptop Run All time plus an equal part of the rest;
    unused time rolls over to the next ones), each at the **largest size tier
    whose estimate fits its share**: full if it fits, else laptop
    (:func:`choose_tiers`; ``WORKBOOK_FULL=1`` or ``WORKBOOK_FULL=0`` in its
    environment). Before it starts, the check prints the estimate
    (:func:`estimate_notebooks`: the recorded laptop times, scaled to full sizes
    by the data set's sizes and a per-item cost measured on this machine) and one
    line per notebook: each tier's estimate, its share, the tier chosen and why.
    The summary names the tier each notebook ran at: a laptop-size run is never
    reported as a full-size one. A bigger ``--notebooks-timeout`` (a notebook alone
    in a call: ``--notebooks 06``) lets a notebook's full sizes fit.
``unit`` (``--unit-timeout``, default 150 s)
    The CUDA-only unit tests, slow ones too (``--unit-scope all``: the whole suite).

"CUDA-only" tests are those marked ``pytest.mark.skipif(..., reason="needs
CUDA...")`` (any reason saying a test *needs* CUDA or a GPU); this module is
also the pytest plugin that selects them (``pytest -p tools.gpucheck --cuda-only``).

Before any step it refuses (exit code 2) without a CUDA device (``--allow-cpu``
to test the check itself) or without the packages it needs (carried as wheels on
a bare machine: ``tools/carry_wheels.sh``), and it reports which torch and
torchvision names used by the workbook the machine's torch lacks (the lent
machines have their own, older torch; nothing here installs or replaces it).
It prints a summary, writes ``summary.txt`` and ``summary.json`` beside the logs,
and exits 0 only if every step passed. ``--budget-s`` bounds the whole run.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import importlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as _FutureTimeout
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from helpers.core import config
from helpers.core.config import artifacts_dir, repo_root
from tools.bench import _write_probe, folder_problems

__all__ = [
    "NEEDED_MODULES",
    "STEPS",
    "CheckStep",
    "main",
    "plan",
    "checkout",
    "notebooks",
    "needs_cuda",
    "torch_api_gaps",
    "Estimate",
    "measure_item_cost",
    "estimate_notebooks",
    "TierChoice",
    "choose_tiers",
    "apply_tiers",
    "reads_data_set",
    "SMOKE_SERIAL_SHARE",
]

#: (import name, distribution name) of what the check needs beyond torch.
NEEDED_MODULES: tuple[tuple[str, str], ...] = (
    ("pytest", "pytest"),
    ("pytest_timeout", "pytest-timeout"),
    ("nbval", "nbval"),
    ("nbformat", "nbformat"),
    ("nbclient", "nbclient"),
    ("jupyter_client", "jupyter_client"),
    ("ipykernel", "ipykernel"),
    ("ipywidgets", "ipywidgets"),
    ("tqdm", "tqdm"),
    ("matplotlib", "matplotlib"),
    ("PIL", "pillow"),
    ("psutil", "psutil"),
    ("torchvision", "torchvision"),
)

#: The steps, in the order the documented procedure runs them, with their default time limits (s).
STEPS: dict[str, int] = {"smoke": 330, "bench": 450, "notebooks": 450, "unit": 150}
DEFAULT_STEPS = "bench,notebooks,unit"
NO_CUDA_EXIT = 2
#: Seconds the bench keeps for itself after its chapters' budget (saving the files, the PNG, the reference).
BENCH_MARGIN_S = 45
#: Share of the smoke step's limit for the CUDA-only unit tests, which run first and alone: some are
#: timing-sensitive (overlap ratios, the 2x2 labels) and must not share the GPU with notebooks.
SMOKE_SERIAL_SHARE = 0.4
#: A skipif reason that says a test needs CUDA (or a GPU): such a test is "CUDA-only".
NEEDS_CUDA_RE = re.compile(r"\b(needs?|requires?)\b.*\b(CUDA|GPU)\b", re.IGNORECASE)


def checkout() -> Path:
    """The workbook checkout this module runs from (the GPU check runs its tests and notebooks).

    Raises:
        SystemExit: the package is installed without its checkout (no notebooks or tests to run).
    """
    root = repo_root()
    if root is None:
        raise SystemExit(
            "the GPU check runs from a checkout of the workbook (with notebooks/ and tests/), "
            "not from an installed package: cd into the checkout and run make gpu-check"
        )
    return root


def notebooks(root: Path, spec: str | None = None) -> list[Path]:
    """Notebooks under ``root/notebooks`` (``spec``: comma-separated prefixes such as ``00,02``)."""
    found = sorted(p for p in (root / "notebooks").glob("*.ipynb") if not p.name.startswith("."))
    if spec is None:
        return found
    wanted = [s.strip() for s in spec.split(",") if s.strip()]
    if not wanted:
        raise ValueError(
            f"--notebooks is empty; name notebooks by prefix such as 00,02 (found "
            f"{', '.join(p.name[:2] for p in found) or 'none'}) or leave the option out for every notebook"
        )
    chosen = [p for p in found if any(p.name.startswith(w.zfill(2) if w.isdigit() else w) for w in wanted)]
    missing = [w for w in wanted if not any(p.name.startswith(w.zfill(2) if w.isdigit() else w) for p in found)]
    if missing:
        raise ValueError(
            f"--notebooks: no notebook starts with {', '.join(missing)}; "
            f"found {', '.join(p.name for p in found) or 'none'}"
        )
    return chosen


# ---------------------------------------------------------------------------
# The pytest plugin: select the CUDA-only tests (pytest -p tools.gpucheck --cuda-only)
# ---------------------------------------------------------------------------


def needs_cuda(item: Any) -> bool:
    """Whether a collected test is CUDA-only: a ``skipif`` whose reason says it needs CUDA or a GPU."""
    for mark in item.iter_markers("skipif"):
        reason = str(mark.kwargs.get("reason", ""))
        if NEEDS_CUDA_RE.search(reason):
            return True
    return False


def pytest_addoption(parser: Any) -> None:
    """pytest hook: ``--cuda-only`` keeps only the CUDA-only tests."""
    parser.addoption(
        "--cuda-only",
        action="store_true",
        default=False,
        help="tools.gpucheck: run only the tests marked as needing CUDA",
    )


def pytest_collection_modifyitems(config: Any, items: list[Any]) -> None:
    """pytest hook: with ``--cuda-only``, deselect every test that does not need CUDA."""
    if not config.getoption("--cuda-only", default=False):
        return
    keep = [i for i in items if needs_cuda(i)]
    dropped = [i for i in items if not needs_cuda(i)]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
    items[:] = keep


# ---------------------------------------------------------------------------
# The machine's torch against the names the workbook uses
# ---------------------------------------------------------------------------

_DOTTED_RE = re.compile(r"(?<![\w.])(torch|torchvision)((?:\.[A-Za-z_]\w*)+)")
_FROM_RE = re.compile(r"^\s*from\s+((?:torch|torchvision)(?:\.\w+)*)\s+import\s+\(?([\w\s,]+?)\)?\s*(?:#.*)?$", re.M)


def _sources(root: Path) -> list[tuple[str, str]]:
    """(name, code) of the helpers, the bench and the GPU check, the tests and the notebooks' code cells."""
    out = []
    own = [root / "tools" / f"{name}.py" for name in ("bench", "gpucheck")]  # the tools that run on the machine
    for path in (
        sorted((root / "helpers").rglob("*.py"))
        + sorted(p for p in own if p.is_file())
        + sorted((root / "tests").glob("*.py"))
    ):
        text = _without_comments_and_strings(path.read_text(encoding="utf-8", errors="replace"))
        out.append((str(path.relative_to(root)), text))
    for nb in sorted((root / "notebooks").glob("*.ipynb")):
        try:
            cells = json.loads(nb.read_text(encoding="utf-8"))["cells"]
        except (OSError, ValueError, KeyError):
            continue
        code = "\n".join("".join(c.get("source", "")) for c in cells if c.get("cell_type") == "code")
        out.append((str(nb.relative_to(root)), code))
    return out


def _without_comments_and_strings(code: str) -> str:
    """``code`` with its comments and string literals (docstrings: ``torch.cuda.X`` as a placeholder) blanked
    out, line structure kept; as it is when it does not tokenize."""
    import io
    import tokenize

    lines = code.splitlines(keepends=True)
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(code).readline))
    except (tokenize.TokenError, SyntaxError):
        return code
    for tok in reversed(tokens):  # from the end, so that earlier positions stay valid
        if tok.type not in (tokenize.COMMENT, tokenize.STRING):
            continue
        (r0, c0), (r1, c1) = tok.start, tok.end
        if r0 == r1:
            line = lines[r0 - 1]
            lines[r0 - 1] = line[:c0] + " " * (c1 - c0) + line[c1:]
        else:
            lines[r0 - 1] = lines[r0 - 1][:c0] + "\n"
            for r in range(r0, r1 - 1):
                lines[r] = "\n"
            lines[r1 - 1] = " " * c1 + lines[r1 - 1][c1:]
    return "".join(lines)


def _missing_prefix(dotted: str) -> str | None:
    """The shortest prefix of ``dotted`` that does not resolve (module or attribute), or None."""
    parts = dotted.split(".")
    try:
        obj: Any = importlib.import_module(parts[0])
    except ImportError:
        return parts[0]
    name = parts[0]
    for part in parts[1:]:
        name += "." + part
        if hasattr(obj, part):
            obj = getattr(obj, part)
            continue
        try:
            obj = importlib.import_module(name)
        except ImportError:
            return name
    return None


def torch_api_gaps(root: Path | None = None) -> list[str]:
    """Names of torch/torchvision that the workbook's code uses and this machine's versions lack.

    A static scan (dotted names and ``from torch... import`` lists) of the helpers,
    the tests and the notebooks, each name resolved against the installed
    packages; one line per missing name with where it is first used. Empty when
    everything resolves. The lent GPU machines have their own torch (2.11 at the
    last reading, against the pinned 2.14.1), so the check says which names it lacks.
    """
    root = root or checkout()
    first_use: dict[str, str] = {}
    for name, code in _sources(root):
        for m in _DOTTED_RE.finditer(code):
            first_use.setdefault(m.group(1) + m.group(2), name)
        for m in _FROM_RE.finditer(code):
            for item in m.group(2).replace("\n", " ").split(","):
                item = item.strip().split(" as ")[0].strip()
                if item and item.isidentifier():
                    first_use.setdefault(f"{m.group(1)}.{item}", name)
    missing: dict[str, str] = {}
    for dotted in sorted(first_use):
        gap = _missing_prefix(dotted)
        if gap is not None:
            missing.setdefault(gap, first_use[dotted])
    return [f"{name} (used in {where})" for name, where in sorted(missing.items())]


def _versions_line() -> str:
    try:
        import torch

        line = f"torch {torch.__version__} (CUDA {torch.version.cuda})"
    except Exception as exc:  # the refusal below says it plainly
        return f"torch cannot be imported ({exc})"
    try:
        import torchvision

        line += f", torchvision {torchvision.__version__}"
    except Exception as exc:
        line += f", torchvision cannot be imported ({exc})"
    pins = checkout() / "constraints.txt"
    if pins.is_file():
        pinned = re.findall(r"^(torch|torchvision)==(\S+)", pins.read_text(encoding="utf-8"), re.M)
        if pinned:
            line += "; the workbook pins " + ", ".join(f"{n} {v}" for n, v in pinned) + " (constraints.txt)"
    return line


# ---------------------------------------------------------------------------
# Steps
# ---------------------------------------------------------------------------


@dataclass
class CheckStep:
    """One command of the check: its argv, its log, and how it went."""

    name: str
    argv: list[str]
    timeout_s: float
    group: str = ""  # "smoke" | "bench" | "notebooks" | "unit"
    log: str = ""
    status: str = "not run"  # "passed" | "failed" | "timed out" | "not run"
    returncode: int | None = None
    seconds: float = 0.0
    detail: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)  # overrides of the check's environment for this step


def _check_imports() -> list[str]:
    missing = []
    for mod, dist in NEEDED_MODULES:
        try:
            importlib.import_module(mod)
        except Exception as exc:
            missing.append(f"{dist} (import {mod}: {exc})")
    return missing


#: The variables that choose each size tier, set explicitly (``WORKBOOK_FULL=0`` is the laptop tier even on a
#: CUDA host with many cores: :func:`helpers.core.config.size_tier`).
TIER_ENV: dict[str, dict[str, str]] = {
    "quick": {"WORKBOOK_QUICK": "1", "WORKBOOK_FULL": "0"},
    "laptop": {"WORKBOOK_QUICK": "0", "WORKBOOK_FULL": "0"},
    "full": {"WORKBOOK_QUICK": "0", "WORKBOOK_FULL": "1"},
}


def _tier_env(quick: bool) -> dict[str, str]:
    """The variables that choose the size tier: quick, or explicitly full (never both)."""
    return dict(TIER_ENV["quick" if quick else "full"])


def _env(root: Path, quick: bool) -> dict[str, str]:
    env = dict(os.environ)
    paths = [str(root)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))  # `import helpers` from the notebooks' folder
    env.update(_tier_env(quick))
    env["WORKBOOK_REQUIRE_GPU"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("MPLBACKEND", "Agg")
    return env


def _unit_argv(py: str, *, scope: str, slow: bool, per_test_s: int) -> list[str]:
    argv = [
        py,
        "-m",
        "pytest",
        "-q",
        "-rs",
        "-p",
        "no:cacheprovider",
        "-o",
        "addopts=",
        f"--timeout={per_test_s}",
        "--ignore=tests/browser",
        "--ignore=tests/test_environment_sync.py",
        "--durations=10",
    ]
    if scope == "cuda":
        argv += ["-p", "tools.gpucheck", "--cuda-only"]
    if not slow:
        argv += ["-m", "not slow and not browser"]
    return argv + ["tests"]


def _notebook_argv(py: str, root: Path, nb: Path, cell_timeout: int) -> list[str]:
    argv = [
        py,
        "-m",
        "pytest",
        "-v",
        "-p",
        "no:cacheprovider",
        "--nbval-lax",
        "--nbval-current-env",
        f"--nbval-cell-timeout={cell_timeout}",
        f"--timeout={cell_timeout + 30}",
        "-o",
        "addopts=",
        "--durations=5",
    ]
    sanitize = root / "tests" / "nbval_sanitize.cfg"
    if sanitize.is_file():
        argv += ["--nbval-sanitize-with", str(sanitize)]
    return argv + [str(nb.relative_to(root))]


def plan(
    root: Path,
    nbs: Sequence[Path],
    *,
    steps: Sequence[str],
    cell_timeout: int,
    notebook_timeout: int,
    step_timeouts: dict[str, float] | None = None,
    reference: bool,
    strict: bool,
    quick: bool,
    workdir: Path,
    unit_scope: str = "cuda",
) -> list[CheckStep]:
    """The commands the check runs, in the order of ``steps``.

    ``timeout_s`` of a step is its own upper limit; at run time it is also cut to
    its group's time left (see :func:`main`). A CUDA-only test runs with
    ``WORKBOOK_REQUIRE_GPU=1``; the whole suite (``unit_scope="all"``) runs without
    it, since some tests check the CPU fallbacks on purpose.
    """
    py = sys.executable
    limits = {**STEPS, **(step_timeouts or {})}
    out: list[CheckStep] = []
    for group in steps:
        if group == "smoke":
            out.append(
                CheckStep(
                    name="smoke: CUDA-only unit tests",
                    group="smoke",
                    timeout_s=max(60.0, round(limits["smoke"] * SMOKE_SERIAL_SHARE)),
                    argv=_unit_argv(py, scope="cuda", slow=False, per_test_s=120),
                    env=_tier_env(True),
                    extra={"alone": True},  # timing-sensitive tests: nothing else on the GPU meanwhile
                )
            )
            for nb in nbs:
                out.append(
                    CheckStep(
                        name=f"smoke: notebook {nb.stem}",
                        group="smoke",
                        timeout_s=min(notebook_timeout, limits["smoke"]),
                        argv=_notebook_argv(py, root, nb, min(cell_timeout, 120)),
                        env=_tier_env(True),
                    )
                )
        elif group == "unit":
            env = _tier_env(True)  # the unit tests choose quick sizes
            if unit_scope == "all":
                env["WORKBOOK_REQUIRE_GPU"] = "0"
            out.append(
                CheckStep(
                    name="unit tests" + (" (CUDA-only)" if unit_scope == "cuda" else " (all)"),
                    group="unit",
                    timeout_s=limits["unit"],
                    env=env,
                    argv=_unit_argv(py, scope=unit_scope, slow=True, per_test_s=300),
                )
            )
        elif group == "notebooks":  # full until main() chooses each notebook's tier (apply_tiers)
            tier = "quick" if quick else "full"
            for nb, w in zip(nbs, notebook_weights(nbs, tier)):
                out.append(
                    CheckStep(
                        name=f"notebook {nb.stem} ({tier} sizes)",
                        group="notebooks",
                        timeout_s=min(notebook_timeout, limits["notebooks"]),
                        argv=_notebook_argv(py, root, nb, cell_timeout),
                        env=dict(TIER_ENV[tier]),
                        extra={"weight": round(w, 1), "tier": tier},
                    )
                )
        elif group == "bench":
            argv = [
                py,
                "-m",
                "tools.bench",
                "--quick" if quick else "--full",
                "--no-progress",
                "--out",
                str(workdir / "bench.json"),
                "--png",
                str(workdir / "bench.png"),
                "--budget-s",
                str(max(10, int(limits["bench"]) - BENCH_MARGIN_S)),
            ]
            if strict:
                argv.append("--strict")
            if reference:
                argv.append("--reference")
            out.append(CheckStep(name="bench", group="bench", argv=argv, timeout_s=limits["bench"]))
    return out


def _fit_argv(step: CheckStep, timeout: float) -> list[str]:
    """The step's argv with its inner time limits cut to fit ``timeout`` (so it stops itself, cleanly)."""
    argv = list(step.argv)
    for i, a in enumerate(argv):
        if a.startswith("--nbval-cell-timeout="):
            cell = max(10, min(int(a.split("=", 1)[1]), int(timeout) - 15))
            argv[i] = f"--nbval-cell-timeout={cell}"
            argv = [f"--timeout={cell + 10}" if x.startswith("--timeout=") else x for x in argv]
            break
    if "tools.bench" in argv and "--budget-s" in argv:
        j = argv.index("--budget-s") + 1
        argv[j] = str(max(10, min(int(float(argv[j])), int(timeout) - BENCH_MARGIN_S)))
    return argv


_RUNNING: set[subprocess.Popen] = set()
_RUNNING_LOCK = threading.Lock()


def _run_step(
    step: CheckStep, root: Path, env: dict[str, str], log_path: Path, timeout: float, prefix: str = ""
) -> None:
    """Run one step within ``timeout`` seconds (its processes are stopped at the limit)."""
    step.log = str(log_path)
    if timeout < 10:
        step.status, step.detail = "not run", "its time limit was used up by the steps before it"
        return
    argv = _fit_argv(step, timeout)
    print(f"\n=== {step.name}: {shlex.join(argv)}  (time limit {timeout:.0f} s)", flush=True)
    t0 = time.monotonic()
    with open(log_path, "w", encoding="utf-8") as log:
        log.write(f"$ {shlex.join(argv)}\n\n")
        log.flush()
        proc = subprocess.Popen(
            argv,
            cwd=root,
            env={**env, **step.env},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
            start_new_session=True,
            bufsize=1,
        )
        with _RUNNING_LOCK:
            _RUNNING.add(proc)
        reader = threading.Thread(target=_tee, args=(proc, log, prefix), daemon=True)
        reader.start()
        try:
            proc.wait(timeout=timeout)  # a silent hang is caught too: the reader thread does the output
        except subprocess.TimeoutExpired:
            _kill(proc)
            step.status, step.detail = "timed out", f"stopped at its time limit ({timeout:.0f} s)"
        except KeyboardInterrupt:
            _kill(proc)
            step.status, step.detail = "failed", "interrupted"
            raise
        finally:
            step.seconds = round(time.monotonic() - t0, 1)
            if proc.poll() is None:
                _kill(proc)
            with _RUNNING_LOCK:
                _RUNNING.discard(proc)
            reader.join(timeout=10)
            if step.status == "timed out":
                log.write(f"\n[gpucheck] TIMED OUT after {timeout:.0f} s: the step was stopped\n")
    step.returncode = proc.returncode
    if step.status == "not run":
        step.status = "passed" if proc.returncode == 0 else "failed"
        if proc.returncode != 0:
            step.detail = f"exit code {proc.returncode}; see {log_path.name}"


def _tee(proc: subprocess.Popen, log: Any, prefix: str = "") -> None:
    """Copy a step's output to the console (prefixed when steps run side by side) and its log."""
    assert proc.stdout is not None
    for line in proc.stdout:
        sys.stdout.write(prefix + line)
        sys.stdout.flush()
        log.write(line)
    log.flush()


def _kill(proc: subprocess.Popen) -> None:
    """Stop a step and the processes it started (its own session, e.g. a notebook kernel)."""
    import signal

    try:
        os.killpg(proc.pid, signal.SIGTERM)  # the bench saves a partial file on SIGTERM
        proc.wait(timeout=30)
    except (ProcessLookupError, subprocess.TimeoutExpired, PermissionError):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass


def _run_group(
    group: str, steps: list[CheckStep], root: Path, env: dict[str, str], logdir: Path, limit: float, jobs: int
) -> None:
    """Run one group of steps within ``limit`` seconds.

    ``notebooks``: one after another, each within its fair share of the time
    left (what one leaves unused rolls over). ``smoke``: first the steps marked
    ``alone`` (the CUDA-only unit tests, some timing-sensitive), one at a time with
    nothing else running; then the others ``jobs`` at a time, each within the
    group's time left. Other groups: one step with the group's limit.
    """
    end = time.monotonic() + limit

    def log_path(step: CheckStep) -> Path:
        return logdir / (re.sub(r"[^\w.-]+", "-", step.name).strip("-") + ".log")

    if group == "smoke":
        for step in [s for s in steps if s.extra.get("alone")]:
            _run_step(step, root, env, log_path(step), min(step.timeout_s, end - time.monotonic()))
        steps = [s for s in steps if not s.extra.get("alone")]
    if group == "smoke" and jobs > 1 and len(steps) > 1:

        def one(step: CheckStep) -> None:
            _run_step(
                step,
                root,
                env,
                log_path(step),
                min(step.timeout_s, end - time.monotonic()),
                prefix=f"[{step.name.split(': ', 1)[-1]}] ",
            )

        with ThreadPoolExecutor(max_workers=jobs) as pool:
            futures = [pool.submit(one, s) for s in steps]
            try:
                for f in futures:
                    while True:
                        try:
                            f.result(timeout=1.0)
                            break
                        except _FutureTimeout:
                            continue
            except KeyboardInterrupt:
                for f in futures:
                    f.cancel()
                with _RUNNING_LOCK:
                    running = list(_RUNNING)
                for proc in running:
                    _kill(proc)
                raise
        return
    weights = [float(step.extra.get("weight", 1.0)) for step in steps]
    for i, step in enumerate(steps):
        left = end - time.monotonic()
        share = left * weights[i] / sum(weights[i:]) if group == "notebooks" else left
        _run_step(step, root, env, log_path(step), min(step.timeout_s, share))


def notebook_weights(nbs: Sequence[Path], tier: str) -> list[float]:
    """Relative cost of each notebook: its recorded Run All time at ``tier`` (else at the laptop tier), from
    the chapter times that ``tools/time_chapters.py`` records; the mean of the known ones where none is
    recorded; all equal when nothing is recorded."""
    try:
        data = json.loads(config._chapter_times_file().read_text(encoding="utf-8"))["chapters"]
    except (OSError, ValueError, KeyError, TypeError):
        data = {}
    times: list[float | None] = []
    for nb in nbs:
        entry = data.get(nb.name[:2], {}) if isinstance(data, dict) else {}
        secs = None
        for t in (tier, "laptop"):
            try:
                secs = float(entry[t]["seconds"])
                break
            except (KeyError, TypeError, ValueError):
                continue
        times.append(secs if secs and secs > 0 else None)
    known = [t for t in times if t is not None]
    mean = sum(known) / len(known) if known else 1.0
    return [t if t is not None else mean for t in times]


# ---------------------------------------------------------------------------
# How long the notebooks take at full sizes: an estimate computed before the check starts
# ---------------------------------------------------------------------------


def measure_item_cost(image_size: int, crop_size: int, *, n: int = 12, rounds: int = 5) -> float:
    """Seconds per item to read, decode and augment one data-set image of ``image_size`` px cropped to
    ``crop_size``, measured here and now: ``n`` images drawn as the data set draws them, written as JPEG
    files to a temporary folder, read through :class:`helpers.pipeline.data.ShapesDataset` (augment on,
    float output) in this process on one thread (as in a DataLoader worker), ``rounds`` times; the fastest
    round's time per item (the least disturbed by other work on the machine). About a second."""
    import tempfile

    import numpy as np

    from helpers.pipeline import data, shapes  # heavy: torch, torchvision

    with tempfile.TemporaryDirectory(prefix="gpucheck-probe-") as tmp:
        folder = Path(tmp) / shapes.SHAPE_CLASSES[0]
        folder.mkdir()
        for i in range(n):
            img = shapes.render_image(i % len(shapes.SHAPE_CLASSES), image_size, np.random.default_rng(i))
            (folder / f"{i:05d}.jpg").write_bytes(shapes._encode_jpeg(img, 90))
        ds = data.ShapesDataset(tmp, crop_size=crop_size, augment=True, output="float")
        import torch

        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # as in a DataLoader worker, which the DataLoader sets to one thread
        try:
            ds[0]  # warm-up: first-call costs are not per-item work
            per_item = []
            for _ in range(rounds):
                t0 = time.perf_counter()
                for i in range(n):
                    ds[i]
                per_item.append((time.perf_counter() - t0) / n)
        finally:
            torch.set_num_threads(threads)
    return min(per_item)


@dataclass
class Estimate:
    """How long the notebooks should take at ``tier``, computed from the sizes and a per-item cost measured here.

    For each notebook: its Run All time recorded at ``tier`` (``tools/time_chapters.py``) when one is
    recorded; otherwise, for a notebook that reads the data set (:func:`reads_data_set`), its recorded
    laptop-tier time x :attr:`ratio` (else its laptop time as it is), the work of the tier over the work of
    the laptop tier: ``(items at tier x per-item cost at tier) / (items at laptop x per-item cost at laptop)``,
    items from :func:`helpers.pipeline.data.default_sizes` (training + validation images) and the per-item
    costs measured on this machine (:func:`measure_item_cost`). The recorded times come from the machine named
    in ``chapter_times.json`` (2 cores), so this is what the work costs at that machine's pace: a host with
    more cores runs the data-loading part faster, one with a slow GPU may take longer.
    """

    tier: str
    items: dict[str, int]
    per_item_s: dict[str, float]
    ratio: float
    seconds: dict[str, float | None]
    how: dict[str, str]
    #: each notebook's recorded laptop Run All time (the laptop tier's estimate), None where none is recorded
    laptop_s: dict[str, float | None] = field(default_factory=dict)
    #: the machine the recorded times were measured on (``chapter_times.json``)
    machine: str = ""

    @property
    def total_s(self) -> float:
        return sum(v for v in self.seconds.values() if v is not None)

    def over(self, limit_s: float) -> list[str]:
        """Notebooks whose estimate alone is above ``limit_s``."""
        return [nb for nb, v in self.seconds.items() if v is not None and v > limit_s]

    def line(self, limit_s: float | None = None, choices: Sequence[TierChoice] | None = None) -> str:
        """What the check prints before the notebooks step: the total, the method, and per notebook either
        the estimate or (``choices``) one line with each tier's estimate, its share and the tier chosen."""
        t, lap = self.tier, "laptop"
        head = f"estimate: the notebooks at {t} sizes need about {self.total_s:,.0f} s of Run All" + (
            f" (the step's limit is {limit_s:,.0f} s)" if limit_s is not None else ""
        )
        machine = f" on {self.machine}" if self.machine else ""
        method = (
            f"method: recorded laptop Run All time{machine} of each notebook that reads the data set x "
            f"{self.ratio:.1f} = ({self.items[t]} items x {self.per_item_s[t] * 1e3:.2f} ms at {t}) / "
            f"({self.items[lap]} items x {self.per_item_s[lap] * 1e3:.2f} ms at laptop); per-item read + decode + "
            "augment cost measured here, on this machine, just now, one thread (fastest of 5 rounds of 12 images); "
            f"a time recorded at {t} is used as it is; the laptop tier's estimate is the recorded laptop time"
        )
        if choices is not None:
            return f"{head}\n    {method}\n" + "\n".join("    " + c.line(self.ratio) for c in choices)
        parts = ", ".join(
            f"{nb[:2]} {v:.0f} s"
            + {"recorded": " (recorded)", "laptop": " (laptop time: reads no data set)"}.get(self.how[nb], "")
            for nb, v in self.seconds.items()
            if v is not None
        )
        unknown = [nb[:2] for nb, v in self.seconds.items() if v is None]
        return f"{head}\n    {method}\n    per notebook: {parts or 'none recorded'}" + (
            f"; no recorded time: {', '.join(unknown)}" if unknown else ""
        )


_DATA_SET_RE = re.compile(r"\b(make_shapes_dataset|default_sizes|ShapesDataset)\b")


def reads_data_set(nb: Path) -> bool:
    """Whether a notebook's work grows with the data set's sizes: its code cells, its chapter module
    (``helpers/chapters/chNN/__init__.py``) or a chapter module that one imports name the data set's functions."""
    texts = []
    with_suppress = (OSError, ValueError, KeyError, TypeError)
    try:
        cells = json.loads(nb.read_text(encoding="utf-8"))["cells"]
        texts.append("\n".join("".join(c.get("source", "")) for c in cells if c.get("cell_type") == "code"))
    except with_suppress:
        pass
    chapters = nb.parent.parent / "helpers" / "chapters"
    module = chapters / f"ch{nb.name[:2]}.py"
    if module.is_file():
        src = module.read_text(encoding="utf-8")
        texts.append(src)
        names = re.findall(r"^from \.(\w+) import", src, re.M)
        for group in re.findall(r"^from \. import ([\w, ]+)", src, re.M):
            names += [n.strip() for n in group.split(",")]
        for name in names:
            if (chapters / f"{name}.py").is_file():
                texts.append((chapters / f"{name}.py").read_text(encoding="utf-8"))
    return any(_DATA_SET_RE.search(t) for t in texts)


def estimate_notebooks(nbs: Sequence[Path], tier: str, cost: Callable[[int, int], float] | None = None) -> Estimate:
    """:class:`Estimate` for the notebooks ``nbs`` at ``tier``; ``cost(image_size, crop_size)`` gives seconds
    per item (default: measured here, :func:`measure_item_cost`)."""
    from helpers.pipeline.data import default_sizes  # heavy: torch

    cost = cost or measure_item_cost
    items: dict[str, int] = {}
    per_item: dict[str, float] = {}
    for name in dict.fromkeys((tier, "laptop")):
        sizes = default_sizes(name)
        items[name] = sizes["n_train"] + sizes["n_val"]
        per_item[name] = cost(sizes["image_size"], sizes["crop_size"])
    ratio = (items[tier] * per_item[tier]) / (items["laptop"] * per_item["laptop"])
    try:
        recorded = json.loads(config._chapter_times_file().read_text(encoding="utf-8"))["chapters"]
    except (OSError, ValueError, KeyError, TypeError):
        recorded = {}
    seconds: dict[str, float | None] = {}
    how: dict[str, str] = {}
    laptop_s: dict[str, float | None] = {}
    for nb in nbs:
        entry = recorded.get(nb.name[:2], {}) if isinstance(recorded, dict) else {}
        own = (entry.get(tier) or {}).get("seconds") if isinstance(entry, dict) else None
        lap = (entry.get("laptop") or {}).get("seconds") if isinstance(entry, dict) else None
        laptop_s[nb.name] = float(lap) if isinstance(lap, (int, float)) and lap > 0 else None
        if isinstance(own, (int, float)) and own > 0:
            seconds[nb.name], how[nb.name] = float(own), "recorded"
        elif isinstance(lap, (int, float)) and lap > 0 and reads_data_set(nb):
            seconds[nb.name], how[nb.name] = float(lap) * ratio, "scaled"
        elif isinstance(lap, (int, float)) and lap > 0:
            seconds[nb.name], how[nb.name] = float(lap), "laptop"
        else:
            seconds[nb.name], how[nb.name] = None, "unknown"
    machine = ""
    try:
        machine = str(json.loads(config._chapter_times_file().read_text(encoding="utf-8")).get("machine", ""))
    except (OSError, ValueError, AttributeError):
        pass
    return Estimate(
        tier=tier,
        items=items,
        per_item_s=per_item,
        ratio=ratio,
        seconds=seconds,
        how=how,
        laptop_s=laptop_s,
        machine=machine.split(" (")[0],
    )


# ---------------------------------------------------------------------------
# Which size tier each notebook runs at: the largest whose estimate fits its share of the step's limit
# ---------------------------------------------------------------------------


@dataclass
class TierChoice:
    """One notebook's size tier in the notebooks step, and why."""

    notebook: str  # file name, e.g. "06_capstone.ipynb"
    share_s: float  # its share of the step's limit
    full_s: float | None  # estimated Run All at full sizes (None: no estimate)
    laptop_s: float | None  # estimated Run All at laptop sizes: the recorded laptop time (None: none recorded)
    tier: str  # "full" | "laptop"
    how: str = "scaled"  # how full_s was made: "scaled" | "recorded" | "laptop" | "unknown" (Estimate.how)

    @property
    def estimate_s(self) -> float | None:
        """The estimate at the chosen tier."""
        return self.full_s if self.tier == "full" else self.laptop_s

    def line(self, ratio: float | None = None) -> str:
        """E.g. ``06: full ~2,463 s (...) > share 130 s -> laptop ~82 s (...)``."""
        nn = self.notebook[:2]
        if self.full_s is None:
            full = "full: no estimate (no time recorded)"
        else:
            lap = f"{self.laptop_s:,.0f} s" if self.laptop_s is not None else "time"
            tag = {
                "recorded": "recorded at full sizes",
                "laptop": "reads no data set: its recorded laptop time",
            }.get(
                self.how,
                f"recorded laptop {lap} x {ratio:.1f}, the work ratio from per-item costs measured on this machine"
                if ratio is not None
                else "recorded laptop time x the work ratio measured on this machine",
            )
            full = f"full ~{self.full_s:,.0f} s ({tag})"
        share = f"share {self.share_s:,.0f} s"
        if self.tier == "full":
            return f"{nn}: {full} <= {share} -> full"
        laptop = (
            f"laptop ~{self.laptop_s:,.0f} s (the recorded laptop Run All time)"
            if self.laptop_s is not None
            else "laptop (no time recorded)"
        )
        text = f"{nn}: {full} {'>' if self.full_s is not None else 'vs'} {share} -> {laptop}"
        if self.laptop_s is not None and self.laptop_s > self.share_s:
            text += "; above its share too: it may be stopped"
        return text


def choose_tiers(
    full_s: dict[str, float | None],
    laptop_s: dict[str, float | None],
    limit_s: float,
    *,
    per_notebook_s: float | None = None,
    how: dict[str, str] | None = None,
) -> list[TierChoice]:
    """Each notebook's tier: ``full`` when its full-size estimate fits its share of ``limit_s``, else ``laptop``.

    A notebook's share is its laptop estimate (its recorded laptop Run All time; the mean of the known ones
    for a notebook with none) plus an equal part of what the laptop estimates leave of ``limit_s`` (so a short
    notebook still has room to start its kernel and CUDA), capped at ``per_notebook_s``; when the laptop
    estimates alone exceed ``limit_s``, the shares are in proportion to them. The tier every notebook can run
    at gets its room first, and a notebook runs at full sizes only when that fits in the same room. A notebook
    with no full-size estimate runs at laptop sizes. ``full_s`` and ``laptop_s`` are keyed by notebook file
    name, in the order the notebooks run; the shares add up to ``limit_s`` (before the cap).
    """
    names = list(full_s)
    known = [v for v in (laptop_s.get(n) for n in names) if v is not None and v > 0]
    mean = sum(known) / len(known) if known else 1.0
    weights = [laptop_s.get(n) or mean for n in names]
    total = sum(weights) or 1.0
    rest = limit_s - total
    out = []
    for name, w in zip(names, weights):
        share = w + rest / len(names) if rest >= 0 else limit_s * w / total
        if per_notebook_s is not None:
            share = min(share, per_notebook_s)
        full = full_s.get(name)
        tier = "full" if full is not None and full <= share else "laptop"
        out.append(
            TierChoice(
                notebook=name,
                share_s=round(share, 1),
                full_s=full,
                laptop_s=laptop_s.get(name),
                tier=tier,
                how=(how or {}).get(name, "scaled"),
            )
        )
    return out


def apply_tiers(steps: Sequence[CheckStep], choices: Sequence[TierChoice]) -> None:
    """Give each notebook step of ``steps`` its chosen tier: the variables that select it (``WORKBOOK_FULL=1``
    or ``=0``), its name (``notebook 06_capstone (laptop sizes)``), and its share as its weight."""
    by_name = {c.notebook: c for c in choices}
    for s in steps:
        if s.group != "notebooks":
            continue
        c = by_name.get(s.argv[-1].rsplit("/", 1)[-1])
        if c is None:
            continue
        s.env = {**s.env, **TIER_ENV[c.tier]}
        s.name = f"notebook {Path(c.notebook).stem} ({c.tier} sizes)"
        s.extra["tier"] = c.tier
        s.extra["weight"] = max(c.share_s, 0.1)
        s.extra["share_s"] = c.share_s
        if c.estimate_s is not None:
            s.extra["estimate_s"] = round(c.estimate_s, 1)


def _choose_notebook_tiers(
    the_plan: list[CheckStep], nbs: Sequence[Path], limit_s: float, per_notebook_s: float
) -> None:
    """Estimate the notebooks, choose each one's tier (:func:`choose_tiers`), print why, apply it to the plan."""
    estimate: Estimate | None = None
    try:
        estimate = estimate_notebooks(nbs, "full")
        full_s, laptop_s, how = dict(estimate.seconds), dict(estimate.laptop_s), dict(estimate.how)
    except Exception as exc:  # an estimate must never stop the check; say why there is none
        print(
            f"  estimate: none ({type(exc).__name__}: {exc}); without a full-size estimate every notebook runs "
            "at laptop sizes",
            flush=True,
        )
        full_s = {nb.name: None for nb in nbs}
        laptop_s = {nb.name: _recorded_laptop_s(nb) for nb in nbs}
        how = {nb.name: "unknown" for nb in nbs}
    choices = choose_tiers(full_s, laptop_s, limit_s, per_notebook_s=per_notebook_s, how=how)
    if estimate is not None:
        print("  " + estimate.line(limit_s, choices), flush=True)
    else:
        print("\n".join("    " + c.line() for c in choices), flush=True)
    chosen = [c.estimate_s for c in choices]
    total = sum(v for v in chosen if v is not None)
    print(
        f"  notebooks step: {sum(c.tier == 'full' for c in choices)} of {len(choices)} at full sizes, about "
        f"{total:,.0f} s at the chosen tiers (limit {limit_s:,.0f} s; a share is the recorded laptop "
        "time plus an equal part of the rest)",
        flush=True,
    )
    if total > limit_s:
        print(
            f"  WARNING: even at the chosen tiers the notebooks need about {total:,.0f} s, above the step's limit "
            f"({limit_s:,.0f} s): those that outrun their shares will be stopped ('timed out'). Split them over "
            "calls (--steps notebooks --notebooks NN) or raise --notebooks-timeout",
            flush=True,
        )
    apply_tiers(the_plan, choices)


def _recorded_laptop_s(nb: Path) -> float | None:
    """The notebook's recorded laptop Run All time (``chapter_times.json``), None where none is recorded."""
    try:
        secs = json.loads(config._chapter_times_file().read_text(encoding="utf-8"))["chapters"][nb.name[:2]]
        value = float(secs["laptop"]["seconds"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return value if value > 0 else None


def _logs_problem(path: Path) -> str:
    """Why ``--logs`` cannot hold the check's files ("" if it can), found with a real write; creates the folder."""
    if path.exists() and not path.is_dir():
        return f"--logs: {path} is a file; give a folder (it is created if missing)"
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return f"--logs: the folder {path} cannot be created ({exc.strerror or exc})"
    why = _write_probe(path)
    return f"--logs: {why}" if why else ""


# ---------------------------------------------------------------------------
# The command
# ---------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m tools.gpucheck",
        description="Prove the workbook's GPU paths on a CUDA GPU within a short booking: a quick smoke run, the "
        "reference bench at full sizes, every notebook under nbval (full sizes where its estimate fits its share, "
        "else laptop), the CUDA-only unit tests; fail loudly on any "
        "error in a GPU path.",
    )
    ap.add_argument(
        "--steps",
        default=DEFAULT_STEPS,
        help=f"which steps, in the order given: smoke, bench, notebooks, unit (default {DEFAULT_STEPS})",
    )
    ap.add_argument("--notebooks", metavar="LIST", help="only notebooks starting with these prefixes, e.g. 00,02")
    ap.add_argument(
        "--logs", metavar="DIR", help="folder for logs, results and the summary (default: artifacts/gpucheck-<time>)"
    )
    ap.add_argument(
        "--bundle",
        action="store_true",
        help="put the per-step logs in one gpucheck-logs.tar.gz inside "
        "--logs (few files: for machines that return a limited number of files)",
    )
    for name, default in STEPS.items():
        ap.add_argument(
            f"--{name}-timeout",
            type=int,
            default=default,
            metavar="S",
            help=f"time limit of the {name} step, seconds (default {default})",
        )
    ap.add_argument(
        "--cell-timeout",
        type=int,
        default=600,
        help="seconds per notebook cell at most (default 600; cut to fit each notebook's share)",
    )
    ap.add_argument("--notebook-timeout", type=int, default=900, help="seconds per notebook at most (default 900)")
    ap.add_argument("--jobs", type=int, default=4, help="smoke: how many tests/notebooks run side by side (default 4)")
    ap.add_argument(
        "--unit-scope",
        choices=("cuda", "all"),
        default="cuda",
        help="unit: the CUDA-only tests (default) or the whole suite",
    )
    ap.add_argument("--budget-s", type=float, help="stop starting steps when this many seconds have passed in all")
    ap.add_argument("--no-reference", action="store_true", help="do not save the bench results as a reference file")
    ap.add_argument(
        "--allow-cpu",
        action="store_true",
        help="run without CUDA (to test the check itself; no reference file is written, and strict GPU checks are off)",
    )
    ap.add_argument(
        "--quick",
        action="store_true",
        help="bench and notebooks in quick mode instead of full (to test the check itself; no reference file)",
    )
    ap.add_argument("--dry-run", action="store_true", help="print the plan and exit")
    return ap


def _has_cuda() -> tuple[bool, str]:
    try:
        import torch
    except Exception as exc:
        return False, f"torch cannot be imported ({exc})"
    try:
        if torch.cuda.is_available():
            return True, f"{torch.cuda.get_device_name(0)} (torch {torch.__version__}, CUDA {torch.version.cuda})"
    except Exception as exc:
        return False, f"torch.cuda failed: {exc}"
    why = "this torch build has no CUDA support" if not torch.version.cuda else "no CUDA device or driver is visible"
    return False, f"{why} (torch {torch.__version__})"


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; returns the exit code (0 all passed, 1 a step failed, 2 refused, 130 interrupted)."""
    args = _parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        config.check_environment()  # the check sets WORKBOOK_QUICK/FULL for its children: a typo would be lost
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    root = checkout()
    steps = [s.strip() for s in args.steps.split(",") if s.strip()]
    bad = [s for s in steps if s not in STEPS]
    if bad or not steps or len(set(steps)) != len(steps):
        print(
            f"error: --steps: {'unknown step(s) ' + ', '.join(bad) if bad else 'empty or repeated'}; "
            f"allowed: {', '.join(STEPS)}",
            file=sys.stderr,
        )
        return 2
    limits = ["cell_timeout", "notebook_timeout"] + [f"{n}_timeout" for n in STEPS]
    for name in limits:
        if not 10 <= getattr(args, name) <= 86_400:
            print(f"error: --{name.replace('_', '-')} must be between 10 and 86400 seconds", file=sys.stderr)
            return 2
    if not 1 <= args.jobs <= 32:
        print("error: --jobs must be between 1 and 32", file=sys.stderr)
        return 2
    if args.budget_s is not None and not 60 <= args.budget_s <= 7 * 86_400:
        print("error: --budget-s must be between 60 and 604800 seconds", file=sys.stderr)
        return 2
    start = time.monotonic()
    deadline = start + args.budget_s if args.budget_s else None

    cuda, cuda_line = _has_cuda()
    if not cuda and not args.allow_cpu:
        print(
            "gpucheck refused: no CUDA GPU is usable here — " + cuda_line + ".\n"
            "The GPU check proves the workbook's GPU paths and records reference results, so it needs a machine "
            "with a CUDA GPU (see docs/GPU-CHECK.md). On a machine without one, run `make test` instead; "
            "to test the check itself, add --allow-cpu.",
            file=sys.stderr,
        )
        return NO_CUDA_EXIT
    try:
        nbs = notebooks(root, args.notebooks) if {"notebooks", "smoke"} & set(steps) else []
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if {"notebooks", "smoke"} & set(steps) and not nbs:
        print(f"error: no notebooks under {root / 'notebooks'}", file=sys.stderr)
        return 2

    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    problems = folder_problems(("WORKBOOK_CACHE",) if args.logs else ("WORKBOOK_ARTIFACTS", "WORKBOOK_CACHE"))
    if args.logs is not None and not str(args.logs).strip():
        problems.insert(0, "--logs is empty; give a folder")
    if problems:
        print(f"error: {problems[0]}", file=sys.stderr)
        return 2
    if args.logs:
        workdir = Path(args.logs).expanduser().resolve()
    else:
        workdir = artifacts_dir().resolve() / f"gpucheck-{stamp}"
    if not args.dry_run:
        problem = _logs_problem(workdir)
        if problem:
            print(f"error: {problem}", file=sys.stderr)
            return 2
    elif workdir.exists() and not workdir.is_dir():
        print(f"error: --logs: {workdir} is a file; give a folder (it is created if missing)", file=sys.stderr)
        return 2
    reference = cuda and not args.no_reference and not args.quick
    strict = cuda
    step_timeouts = {n: float(getattr(args, f"{n}_timeout")) for n in STEPS}
    the_plan = plan(
        root,
        nbs,
        steps=steps,
        cell_timeout=args.cell_timeout,
        notebook_timeout=args.notebook_timeout,
        step_timeouts=step_timeouts,
        reference=reference,
        strict=strict,
        quick=args.quick,
        workdir=workdir,
        unit_scope=args.unit_scope,
    )
    env = _env(root, args.quick)
    if not cuda:
        env["WORKBOOK_REQUIRE_GPU"] = "0"
        for s in the_plan:
            s.env.pop("WORKBOOK_REQUIRE_GPU", None)
    mode = "quick" if args.quick else "full"

    print(f"gpucheck: {cuda_line if cuda else 'NO CUDA (--allow-cpu): testing the check itself'}")
    print(
        f"  workbook: {root}\n  python: {sys.executable}\n  steps: {', '.join(steps)} (time limits: "
        + ", ".join(f"{g} {step_timeouts[g]:.0f} s" for g in steps)
        + ")\n"
        f"  sizes: smoke and unit tests quick; bench {mode} (WORKBOOK_FULL={env['WORKBOOK_FULL']}); notebooks "
        + (
            "quick"
            if args.quick
            else "each at the largest tier whose estimate fits its share of the step (full, else laptop)"
        )
        + f"; WORKBOOK_REQUIRE_GPU={env['WORKBOOK_REQUIRE_GPU']}; logs: {workdir}"
    )
    if "notebooks" in steps and not args.quick:
        _choose_notebook_tiers(the_plan, nbs, step_timeouts["notebooks"], args.notebook_timeout)
    if args.dry_run:
        for s in the_plan:
            extra = " ".join(f"{k}={v}" for k, v in s.env.items())
            print(
                f"  would run [{s.name}] (at most {s.timeout_s:.0f} s){' with ' + extra if extra else ''}: "
                f"{shlex.join(s.argv)}"
            )
        return 0

    missing = _check_imports()
    if missing:
        print(
            "gpucheck refused: these packages are missing: " + "; ".join(missing) + ".\n"
            "On a machine without network, carry them as wheels: see tools/carry_wheels.sh and docs/GPU-CHECK.md.",
            file=sys.stderr,
        )
        return 2
    versions = _versions_line()
    gaps = torch_api_gaps(root)
    print(f"  {versions}")
    if gaps:
        print(
            "  WARNING: this machine's torch/torchvision lack names the workbook uses (a step that reaches one "
            "fails with AttributeError/ImportError):\n    " + "\n    ".join(gaps),
            flush=True,
        )
    else:
        print("  every torch/torchvision name the workbook's code uses exists in this machine's versions", flush=True)

    workdir.mkdir(parents=True, exist_ok=True)
    logdir = Path(tempfile.mkdtemp(prefix="gpucheck-logs-")) if args.bundle else workdir / "logs"
    logdir.mkdir(parents=True, exist_ok=True)
    preflight_error = ""
    try:
        from helpers.core.device import hardware_report  # heavy: torch (this module imports without it)

        (logdir / "hardware.txt").write_text(hardware_report().describe() + "\n", encoding="utf-8")
    except Exception as exc:  # a GPU path: reported as a failure of the check, not swallowed
        preflight_error = f"hardware_report failed: {exc!r}"
        (logdir / "hardware.txt").write_text(preflight_error + "\n", encoding="utf-8")
        print(f"  FAILED: {preflight_error}", file=sys.stderr)

    interrupted = False
    try:
        for group in steps:
            members = [s for s in the_plan if s.group == group]
            limit = step_timeouts[group]
            if deadline is not None:
                limit = min(limit, deadline - time.monotonic())
            _run_group(group, members, root, env, logdir, limit, args.jobs)
    except KeyboardInterrupt:
        interrupted = True
        print("\ngpucheck interrupted", file=sys.stderr)

    # -- what the bench wrote -----------------------------------------------------
    bench_step = next((s for s in the_plan if s.group == "bench"), None)
    ref_file = None
    if bench_step is not None and bench_step.log and Path(bench_step.log).is_file():
        log_text = Path(bench_step.log).read_text(encoding="utf-8", errors="replace")
        if reference and "reference file:" not in log_text and (workdir / "bench.json").is_file():
            # the bench was stopped before writing its reference: keep the chapters it completed
            done = subprocess.run(
                [sys.executable, "-m", "tools.bench", "--reference-from", str(workdir / "bench.json")],
                cwd=root,
                env=env,
                capture_output=True,
                text=True,
                timeout=120,
            )
            with open(bench_step.log, "a", encoding="utf-8") as fh:
                fh.write("\n[gpucheck] --reference-from the partial results:\n" + done.stdout + done.stderr)
            log_text += "\n" + done.stdout
            print(done.stdout + done.stderr)
        for line in log_text.splitlines():
            if line.strip().startswith("reference file:"):
                ref_file = line.split("reference file:", 1)[1].split("(")[0].strip()
        if ref_file and Path(ref_file).is_file():
            shutil.copy2(ref_file, workdir / Path(ref_file).name)
            bench_step.extra["reference_file"] = ref_file
        if (workdir / "bench.json").is_file():
            try:
                data = json.loads((workdir / "bench.json").read_text(encoding="utf-8"))
                info = data["provenance"]["bench"]
                bench_step.extra["chapters"] = {c["chapter"]: c["status"] for c in info["chapters"]}
                bench_step.extra["mode"] = data.get("mode")
                bench_step.extra["flags"] = info.get("flags", [])
            except (OSError, ValueError, KeyError, TypeError):
                pass
            if not args.quick and bench_step.extra.get("mode") not in (None, "full"):
                bench_step.status = "failed"
                bench_step.detail = f"recorded in {bench_step.extra['mode']} mode; a GPU check records full mode"

    # -- summary ----------------------------------------------------------------------
    failed = [s for s in the_plan if s.status != "passed"]
    nb_steps = [s for s in the_plan if s.group == "notebooks"]
    passed = not failed and not interrupted and not preflight_error
    lines = [
        f"gpucheck {stamp}: {'PASSED' if passed else 'FAILED'}",
        f"device: {cuda_line if cuda else 'no CUDA (--allow-cpu)'}",
        f"software: {versions}",
        "torch names the workbook uses but this torch lacks: " + ("; ".join(gaps) if gaps else "none"),
        f"sizes: smoke/unit quick; bench {mode}"
        + (
            "; notebooks " + ", ".join(f"{Path(s.argv[-1]).name[:2]} {s.extra.get('tier', '?')}" for s in nb_steps)
            if nb_steps
            else ""
        ),
        f"total: {time.monotonic() - start:.0f} s",
        "",
    ]
    if preflight_error:
        lines.insert(-1, f"FAILED preflight: {preflight_error}")
    for s in the_plan:
        lines.append(f"{s.status.upper():<10} {s.name:<40} {s.seconds:>7.1f} s  {s.detail}")
        if s.extra.get("chapters"):
            lines.append(
                f"           chapters ({s.extra.get('mode')} mode): "
                + ", ".join(f"{k} {v}" for k, v in s.extra["chapters"].items())
            )
        for flag in s.extra.get("flags", []):
            lines.append(f"           FLAGGED: {flag}")
    below_full = [Path(s.argv[-1]).name[:2] for s in nb_steps if s.extra.get("tier") == "laptop"]
    if below_full:
        lines += [
            "",
            f"notebooks run at LAPTOP sizes, not full: {', '.join(below_full)} (their full-size estimates did not "
            "fit their shares of the notebooks step; one alone with a longer limit: --steps notebooks "
            "--notebooks NN --notebooks-timeout S)",
        ]
    if ref_file:
        lines += [
            "",
            f"reference file written: {ref_file}",
            "commit it (copy it into helpers/core/reference/ of your checkout if this ran elsewhere); "
            "then `python -m tools.bench --readme-table --update README.md`",
        ]
    elif reference and bench_step is not None:
        lines += ["", "no reference file was written (see the bench log)"]
    text = "\n".join(lines)
    print("\n" + "=" * 78 + "\n" + text + "\n" + "=" * 78)
    (workdir / "summary.txt").write_text(text + "\n", encoding="utf-8")
    (workdir / "summary.json").write_text(
        json.dumps(
            {
                "passed": passed,
                "stamp": stamp,
                "device": cuda_line,
                "cuda": cuda,
                "software": versions,
                "torch_api_gaps": gaps,
                "mode": mode,
                "notebook_tiers": {s.argv[-1].rsplit("/", 1)[-1]: s.extra.get("tier") for s in nb_steps},
                "steps": [asdict(s) for s in the_plan],
                "preflight_error": preflight_error,
                "reference_file": ref_file,
            },
            indent=1,
        )
        + "\n",
        encoding="utf-8",
    )
    if args.bundle:
        with tarfile.open(workdir / "gpucheck-logs.tar.gz", "w:gz") as tar:
            tar.add(logdir, arcname="gpucheck-logs")
        shutil.rmtree(logdir, ignore_errors=True)
    if not passed:
        print(
            "\n"
            + "!" * 78
            + "\nGPU CHECK FAILED: "
            + ", ".join([f"{s.name} ({s.status})" for s in failed] + (["preflight"] if preflight_error else []))
            + "\n"
            + "!" * 78,
            file=sys.stderr,
        )
        return 130 if interrupted else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
