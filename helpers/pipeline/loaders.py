"""DataLoader knobs, measured one at a time (chapters 03 and 04).

Everything a DataLoader experiment needs, kept out of the notebooks so that it
works with every worker start method (fork, spawn, forkserver):

Building and running loaders
    :class:`LoaderConfig` / :func:`build_loader` validate the knobs
    (``num_workers``, ``batch_size``, ``prefetch_factor``, ``persistent_workers``,
    ``in_order``, ``pin_memory``, start method, timeout) with plain messages.
    :func:`measure_throughput`, the one way to time a loader, runs any loader (the
    workbook's, the reader's ``make_loader(...)``, any iterable of batches) for N
    batches after a warm-up, optionally through the reader's ``to_device`` (its copy
    time recorded apart), and **always** shuts its workers down (``finally``, also on
    ``KeyboardInterrupt``, also one that arrives while workers start; waits are bounded).
    :func:`measure_config` = :func:`build_loader` (``/dev/shm`` checked there) + measure.

Worker processes that can't hang or leak
    Every worker loader built here has a timeout (:data:`WORKER_TIMEOUT_S`), a
    worker that is stopped longer than that is ended, a worker that ends (even
    with exit code 0) is noticed within a quarter second, and failures come back
    as :class:`LoaderFailure`, one line naming the worker (and the item) and what
    to check (:func:`explain_loader_error`: timeout, a crash, the OOM killer,
    ``/dev/shm``, a clean exit, the data set's own exception). A Ctrl-C while
    workers are forked is held until they are up, then raised (Python drops an
    exception raised inside an at-fork callback). Children never run the parent's
    signal handlers (:func:`reset_child_signals`, :func:`start_pool`,
    :func:`close_pool`). Far more workers than cores are refused where a reader
    asks for them (:func:`check_workers_for_cores`).

Experiments (each changes one knob against its own baseline)
    :func:`pin_memory_experiment` (chapter 03), :func:`sweep_workers`,
    :func:`interleaved_speedup` (workers vs one process in alternating rounds, beside
    :func:`parallel_ceiling`, the machine's measured ceiling),
    :func:`knob_experiment` (prefetch_factor, ...), :func:`persistent_experiment`,
    :func:`in_order_experiment`, :func:`getitems_experiment`,
    :func:`cheap_vs_expensive` (chapter 04).

Your own loaders (chapter 04)
    The worker experiments also take a *loader factory*, a function of the knob they
    change that returns your DataLoader (``lambda w: make_loader(ds, 32, workers=w)``),
    and time the loaders it builds (:func:`build_from_factory`, then
    :func:`measure_throughput`). :func:`guard` gives such a loader the same safety as
    :func:`build_loader`'s (``/dev/shm``, timeout, signal reset in workers, leak-proof
    start, freeze watchdog).

Demo data sets and collate functions (module level, so spawn can import them)
    :class:`CheapDataset`, :class:`BatchedCheapDataset` (``__getitems__``),
    :class:`SpinDataset` (adds CPU work per item), :class:`UnevenDataset`
    (some items slow), :class:`FailingDataset` (raises in a worker),
    :class:`BadRNGDataset` / :class:`FixedRNGDataset` (the duplicated-augmentation
    bug and its fix), :class:`PinnableBatch` + :func:`collate_pinnable` (a custom
    batch type with its own ``pin_memory()``), :func:`light_uint8_collate`,
    :func:`passthrough_collate`.

Pitfalls, demonstrated without crashing the kernel
    :func:`shm_status` / :func:`require_shm` (``/dev/shm`` too small),
    :func:`spawn_failure_demo` (a notebook-defined class under spawn),
    :func:`worker_error_demo` (a worker's traceback surfacing),
    :func:`rng_duplicates` (workers repeating each other's random draws).

The chapters' live panels and benchmarks are in :mod:`helpers.chapters.ch03` and
:mod:`helpers.chapters.ch04`; they use what is here.

No speed is ever asserted here; every number comes from a run.
"""

from __future__ import annotations

import contextlib
import gc
import math
import multiprocessing as mp
import os
import re
import shutil
import signal
import statistics
import tempfile
import textwrap
import threading
import time
import warnings
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Mapping, Sequence

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, default_collate, get_worker_info
from torch.utils.data._utils import MP_STATUS_CHECK_INTERVAL
from torch.utils.data.dataloader import _MultiProcessingDataLoaderIter

from ..core import agreement
from ..core.device import intraop_threads
from ..core.failures import ITEM_NOTE as _ITEM_NOTE
from ..core.failures import LoaderFailure, ended_in_words, explain_loader_error
from ..core.validate import check_choice, check_float, check_int, human_bytes
from .data import TimedCollate, seed_worker

if TYPE_CHECKING:
    from typing_extensions import TypeIs  # for mypy only: typing.TypeIs is Python 3.13+

__all__ = [
    "MAX_WORKERS",
    "WORKERS_PER_CORE",
    "workers_limit",
    "check_workers_for_cores",
    "START_METHODS",
    "cpu_cores",
    "load_note",
    "LoaderConfig",
    "build_loader",
    "timed_loader",
    "release",
    "open_iterator",
    "child_processes",
    "worker_processes",
    "Throughput",
    "measure_throughput",
    "measure_config",
    "pin_thread_alive",
    "pin_threads",
    "thread_label",
    "WORKER_TIMEOUT_S",
    "LoaderFailure",
    "explain_loader_error",
    "reset_child_signals",
    "close_pool",
    "pin_memory_warning",
    "CheapDataset",
    "BatchedCheapDataset",
    "SpinDataset",
    "UnevenDataset",
    "FailingDataset",
    "BadRNGDataset",
    "FixedRNGDataset",
    "PinnableBatch",
    "collate_pinnable",
    "light_uint8_collate",
    "passthrough_collate",
    "ShmStatus",
    "shm_status",
    "shm_needed_bytes",
    "require_shm",
    "SpawnOutcome",
    "spawn_failure_demo",
    "worker_error_demo",
    "rng_draws",
    "rng_duplicates",
    "PinRow",
    "pin_memory_experiment",
    "pin_verdict",
    "PinLog",
    "batch_copy_seconds",
    "pin_pair_rounds",
    "pin_step_seconds",
    "WorkerSweep",
    "sweep_workers",
    "plot_sweep",
    "parallel_ceiling",
    "SpeedupRounds",
    "interleaved_speedup",
    "plot_rounds",
    "KnobResult",
    "knob_experiment",
    "knob_rounds",
    "KnobRounds",
    "within_spread",
    "sweep_vs_rounds",
    "agreement_line",
    "difference_line",
    "TRUST_ROUNDS",
    "PersistentResult",
    "persistent_experiment",
    "InOrderResult",
    "in_order_experiment",
    "guard",
    "build_from_factory",
    "sampler_batches",
    "getitems_experiment",
    "cheap_vs_expensive",
]

#: Upper bound accepted for ``num_workers`` (beyond this a typo is more likely than intent).
MAX_WORKERS = 64
#: Start methods a loader may ask for (``None`` = the platform default).
START_METHODS: tuple[str | None, ...] = (None, "fork", "spawn", "forkserver")

_PIN_WARNING = "'pin_memory' argument is set as true but no accelerator is found"

#: Seconds a loader built here waits for one batch from its workers before it gives up with a plain
#: message (:class:`LoaderFailure`), unless ``LoaderConfig.timeout`` says otherwise. Long enough for
#: worker start-up on a busy 2-core machine; short enough that a frozen worker never hangs a panel.
WORKER_TIMEOUT_S = 60.0
#: Seconds a shutdown waits for worker or pool processes before it kills them (bounded waits).
SHUTDOWN_GRACE_S = 3.0


def cpu_cores() -> int:
    """CPU cores this process may run on (affinity-aware; at least 1)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # pragma: no cover - macOS / Windows
        return max(1, os.cpu_count() or 1)


#: Workers per CPU core beyond which a reader's request is refused (:func:`check_workers_for_cores`).
WORKERS_PER_CORE = 4


def workers_limit() -> int:
    """The most workers the reader's entry points (panels, :func:`measure_config`) start on this machine:
    :data:`WORKERS_PER_CORE` per core, and never fewer than 8."""
    return max(8, WORKERS_PER_CORE * cpu_cores())


def check_workers_for_cores(num_workers: int, name: str = "num_workers") -> int:
    """``num_workers``, or ValueError (one line: what to do) when it is far above this machine's cores.

    Each worker is a whole Python process with its own copy of the data set's state; 64 workers on 2 cores only
    add start-up time and memory (and can exhaust both), they never load faster.
    """
    limit, cores = workers_limit(), cpu_cores()
    if num_workers > limit:
        raise ValueError(
            f"{name}={num_workers} is far more than this machine's {cores} CPU cores: each worker is a whole "
            f"process, and beyond a few per core they only add start-up time and memory. Choose at most {limit} "
            f"here ({WORKERS_PER_CORE} per core); the best count is usually near the number of cores."
        )
    return num_workers


def load_note() -> str:
    """One line on how busy this machine is (1-minute load average against the core count).

    Loader measurements share the cores with everything else that runs; when
    the load average exceeds the core count, workers get only a slice of a core
    and throughput figures understate what the same settings do on an idle machine.
    """
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):  # pragma: no cover - Windows
        return "Load average: not available on this platform."
    cores = cpu_cores()
    text = f"Load average (1 min): {load:.1f} on {cores} cores."
    if load > cores:
        text += (
            "\nOther programs compete for the cores right now, so the figures below understate what these "
            "settings\ngive on an idle machine; re-run later to compare."
        )
    return text


def _check_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")
    return value


# ---------------------------------------------------------------------------
# Building loaders
# ---------------------------------------------------------------------------


@dataclass
class LoaderConfig:
    """The DataLoader knobs chapters 03-04 turn, validated together.

    Attributes:
        batch_size: items per batch (1-65536).
        num_workers: worker processes (0 = load in the main process; 0-64).
        pin_memory: page-locked batches (needs an accelerator; a no-op with a warning otherwise).
        prefetch_factor: batches each worker keeps in flight (1-64); only with workers.
            ``None`` = DataLoader's default (2 with workers).
        persistent_workers: keep workers alive between epochs; only with workers.
        in_order: deliver batches in sampler order (False: as soon as any is ready).
        multiprocessing_context: ``None`` (platform default), "fork", "spawn", "forkserver".
        timeout: seconds to wait for a batch from a worker before failing with a plain message;
            ``None`` = :data:`WORKER_TIMEOUT_S` with workers, 0 = wait forever; only with workers.
        shuffle: reshuffle every epoch (seeded by ``seed``).
        seed: seed of the shuffling generator and of the workers' base seed.
        drop_last: drop a final short batch.
    """

    batch_size: int = 32
    num_workers: int = 0
    pin_memory: bool = False
    prefetch_factor: int | None = None
    persistent_workers: bool = False
    in_order: bool = True
    multiprocessing_context: str | None = None
    timeout: float | None = None
    shuffle: bool = True
    seed: int = 0
    drop_last: bool = False

    def validated(self) -> "LoaderConfig":
        """Return self after checking every knob; ValueError names the knob and its range."""
        check_int("batch_size", self.batch_size, 1, 65536)
        check_int("num_workers", self.num_workers, 0, MAX_WORKERS)
        _check_bool("pin_memory", self.pin_memory)
        _check_bool("persistent_workers", self.persistent_workers)
        _check_bool("in_order", self.in_order)
        _check_bool("shuffle", self.shuffle)
        _check_bool("drop_last", self.drop_last)
        check_int("seed", self.seed, 0, 2**63 - 1)
        if self.timeout is not None:
            check_float("timeout", self.timeout, 0.0, 3600.0)
        if self.prefetch_factor is not None:
            check_int("prefetch_factor", self.prefetch_factor, 1, 64)
        check_choice("multiprocessing_context", self.multiprocessing_context, START_METHODS)
        if self.multiprocessing_context is not None and self.multiprocessing_context not in mp.get_all_start_methods():
            raise ValueError(
                f"multiprocessing_context {self.multiprocessing_context!r} is not available on this platform; "
                f"choose one of {mp.get_all_start_methods()}"
            )
        if self.num_workers == 0:
            for knob, bad in (
                ("prefetch_factor", self.prefetch_factor is not None),
                ("persistent_workers", self.persistent_workers),
                ("timeout", self.timeout is not None and self.timeout > 0),
                ("multiprocessing_context", self.multiprocessing_context is not None),
            ):
                if bad:
                    raise ValueError(
                        f"{knob} only applies with worker processes: set num_workers to an integer in "
                        f"[1, {MAX_WORKERS}], or leave {knob} at its default"
                    )
        return self

    def effective_timeout(self) -> float:
        """The DataLoader's ``timeout``: 0 without workers, :data:`WORKER_TIMEOUT_S` unless set."""
        if self.num_workers == 0:
            return 0.0
        return WORKER_TIMEOUT_S if self.timeout is None else float(self.timeout)

    def replace(self, **changes: Any) -> "LoaderConfig":
        """A copy with some knobs changed (unknown names raise ValueError)."""
        unknown = set(changes) - set(asdict(self))
        if unknown:
            raise ValueError(f"unknown loader knob(s) {sorted(unknown)}; knobs are {sorted(asdict(self))}")
        data = asdict(self)
        data.update(changes)
        return LoaderConfig(**data)

    def params(self) -> dict[str, Any]:
        """The knobs as a plain dict (for result files)."""
        return asdict(self)

    def label(self) -> str:
        """Short text such as ``'workers=2, batch=32, prefetch=2, persistent'``."""
        parts = [f"workers={self.num_workers}", f"batch={self.batch_size}"]
        if self.num_workers:
            parts.append(f"prefetch={self.prefetch_factor or 2}")
            if self.persistent_workers:
                parts.append("persistent")
            if not self.in_order:
                parts.append("in_order=False")
            if self.multiprocessing_context:
                parts.append(self.multiprocessing_context)
        if self.pin_memory:
            parts.append("pin_memory")
        return ", ".join(parts)


def _item_bytes(dataset: Dataset) -> int | None:
    """Bytes of ``dataset[0]`` (the tensors in it), or ``None`` when the item can't be loaded here."""
    try:
        sample = dataset[0]
    except Exception:  # the loader reports a broken item itself, from the worker that meets it
        return None
    return _batch_bytes(sample if isinstance(sample, (tuple, list, torch.Tensor, Mapping)) else [])


def _check_callable(name: str, fn: Any) -> None:
    """``fn`` (and the function a wrapper such as :class:`helpers.pipeline.data.TimedCollate` holds) is callable."""
    if fn is None:
        return
    inner = getattr(fn, name, None) if not isinstance(fn, type) else None
    for f in (fn, inner) if inner is not None else (fn,):
        if not callable(f):
            raise ValueError(
                f"{name} must be a function (a module-level one, not a lambda, for spawn workers), got {f!r}"
            )


class _WorkerInit:
    """``worker_init_fn`` of every loader built here: reset the parent's signal handlers, then run ``fn``.

    Module-level and picklable, so it works under spawn and forkserver.
    """

    def __init__(self, fn: Callable[[int], None] | None) -> None:
        self.fn = fn

    def __call__(self, worker_id: int) -> None:
        reset_child_signals()
        _name_failing_items()
        if self.fn is not None:
            self.fn(worker_id)


def _failing_item(dataset: Any, index: Any, batched: bool) -> str:
    """Which item of ``index`` (a batch of indices, or one index) makes ``dataset`` raise: loaded again one by one,
    in the worker, only after the batch failed. ``'collate_fn'`` when every item loads on its own."""
    if not batched:
        return repr(index)
    for idx in list(index)[:1024]:
        try:
            dataset[idx]
        except Exception:
            return repr(idx)
    return "none (each item loads on its own: the collate function raised)"


def _name_failing_items() -> None:
    """In a worker: a data set's exception gets a note naming the item that raised it, which reaches the main
    process inside torch's worker traceback (the main process knows only the batch). Patches the fetcher class
    of this worker process only; map-style data sets only."""
    from torch.utils.data._utils import fetch

    cls = fetch._MapDatasetFetcher
    if getattr(cls.fetch, "_workbook", False):
        return
    original = cls.fetch

    def fetch_naming_the_item(self: Any, possibly_batched_index: Any) -> Any:
        try:
            return original(self, possibly_batched_index)
        except Exception as exc:
            if hasattr(exc, "add_note"):  # Python 3.11+
                with contextlib.suppress(Exception):
                    item = _failing_item(self.dataset, possibly_batched_index, self.auto_collation)
                    exc.add_note(f"{_ITEM_NOTE} {item}")
            raise

    fetch_naming_the_item._workbook = True  # type: ignore[attr-defined]
    cls.fetch = fetch_naming_the_item  # type: ignore[method-assign]


class _FreezeWatch(threading.Thread):
    """Kills a worker that has been stopped (SIGSTOP, Ctrl-Z) for longer than the loader's timeout.

    torch's ``timeout`` covers waiting for a batch, but not the hand-over of a batch's shared memory:
    with the ``file_descriptor`` strategy the main process fetches each tensor's descriptor from the
    worker that made it, and blocks for ever if that worker is frozen. Killing the frozen worker ends
    the wait; its pid is noted in ``frozen`` so the error can say what happened.
    """

    def __init__(self, it: Any, timeout_s: float, frozen: list[int]) -> None:
        import weakref

        super().__init__(name="workbook-freeze-watch", daemon=True)
        self._it = weakref.ref(it)
        self.timeout_s = float(timeout_s)
        self.frozen = frozen

    def run(self) -> None:
        import psutil

        since: dict[int, float] = {}
        while True:
            time.sleep(min(0.5, self.timeout_s / 2))
            it = self._it()
            if it is None or getattr(it, "_shutdown", True):
                return
            pids = [w.pid for w in list(getattr(it, "_workers", []))]
            del it
            now = time.monotonic()
            for pid in pids:
                try:
                    stopped = psutil.Process(pid).status() == psutil.STATUS_STOPPED
                except psutil.Error:
                    continue
                if not stopped:
                    since.pop(pid, None)
                elif now - since.setdefault(pid, now) > self.timeout_s:
                    self.frozen.append(pid)
                    with contextlib.suppress(OSError):
                        os.kill(pid, signal.SIGKILL)


class _HeldSignals:
    """``with _HeldSignals() as held:`` - SIGINT and SIGTERM are only noted while the block runs (workers are forked);
    ``held.deliver()`` afterwards runs the handler they were meant for (``KeyboardInterrupt`` for Ctrl-C).

    Why: ``os.fork()`` runs Python's at-fork callbacks (``logging``'s lock release, ...) in the parent, and an
    exception raised inside one of them is printed ("Exception ignored in ...") and dropped. A Ctrl-C whose
    ``KeyboardInterrupt`` is raised there is lost; the run goes on. A handler that only notes the signal never
    raises, so nothing is dropped. A forked child inherits the noting handler too, so a Ctrl-C that reaches a
    new worker before :func:`reset_child_signals` ignores it no longer ends that worker. Only in the main
    thread (where Python runs signal handlers, whichever thread the OS delivered the signal to), and only for
    signals whose handler is a Python function (not ``SIG_IGN``/``SIG_DFL``).
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, *, escape: bool = False) -> None:
        """``escape=True``: a second signal while the block runs is not held but handled at once (a second
        Ctrl-C always ends a teardown that takes too long)."""
        self.saved: dict[int, Callable[..., Any]] = {}
        self.noted: list[int] = []
        self.escape = escape

    def _note(self, signum: int, frame: Any) -> None:
        self.noted.append(signum)
        if self.escape and len(self.noted) > 1 and signum in self.saved:
            self.noted.clear()
            self.saved[signum](signum, frame)

    def __enter__(self) -> "_HeldSignals":
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                handler = signal.getsignal(sig)
                if callable(handler):
                    self.saved[sig] = handler
                    signal.signal(sig, self._note)
        return self

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self.saved.items():
            signal.signal(sig, handler)

    def deliver(self) -> None:
        """Run the original handler of the first noted signal (default_int_handler raises KeyboardInterrupt)."""
        if self.noted:
            sig = self.noted[0]
            self.noted.clear()
            self.saved[sig](sig, None)


#: Seconds between two checks that every worker is still alive while the main process waits for a batch.
_ALIVE_CHECK_S = 0.25


class _WatchedIter(_MultiProcessingDataLoaderIter):
    """torch's worker iterator, waiting for a batch in short slices: a worker that ended (even with exit code 0,
    which torch's SIGCHLD handler ignores) is noticed within :data:`_ALIVE_CHECK_S` instead of after the loader's
    whole timeout. The loader's timeout still counts from the start of the wait."""

    def _try_get_data(self, timeout: float = MP_STATUS_CHECK_INTERVAL) -> tuple[bool, Any]:
        deadline = time.monotonic() + timeout
        while True:
            try:
                ok, data = super()._try_get_data(max(0.0, min(_ALIVE_CHECK_S, deadline - time.monotonic())))
            except RuntimeError as exc:
                if "exited unexpectedly" in str(exc):
                    raise RuntimeError(f"{exc} ({_worker_exits(self._workers)})") from exc
                raise
            if ok or time.monotonic() >= deadline:
                return ok, data


def _worker_exits(procs: Sequence[Any]) -> str:
    """``'worker 1 (pid 123): exit code 0'`` for each ended worker of ``procs`` (worker id = position)."""
    parts = []
    for wid, w in enumerate(procs):
        code = getattr(w, "exitcode", None)
        if code is not None:
            parts.append(f"worker {wid} (pid {w.pid}): exit code {code}")
    return "; ".join(parts) or "no exit status"


class _WorkbookLoader(DataLoader):
    """A DataLoader whose worker start-up can't leak or lose an interrupt: a Ctrl-C (or the panel's interrupt)
    while ``iter(loader)`` starts workers is held until they are all started (:class:`_HeldSignals`), then the
    workers are stopped and ``KeyboardInterrupt`` raised; and a worker that ends is noticed at once
    (:class:`_WatchedIter`)."""

    _workbook_frozen: list[int]  # pids _FreezeWatch killed (set by build_loader and guard)
    _workbook_warnings: list[str]
    _workbook_workers: list[Any]  # the worker processes of the latest iterator (worker id = position)

    def _get_iterator(self) -> Any:
        if self.num_workers == 0:
            return super()._get_iterator()
        before = _worker_children()
        it = None
        held = _HeldSignals()
        try:
            with held:
                self.check_worker_number_rationality()
                it = _WatchedIter.__new__(_WatchedIter)
                it.__init__(self)  # type: ignore[misc]
            self._workbook_workers = list(it._workers)
            held.deliver()  # a Ctrl-C that came while the workers started: raised here, with `it` known
            if self.timeout > 0:
                _FreezeWatch(it, self.timeout, self._workbook_frozen).start()
            return it
        except BaseException:
            _finish([it] if it is not None else [], before)
            raise


def build_loader(
    dataset: Dataset,
    config: LoaderConfig | None = None,
    *,
    collate_fn: Callable[[Any], Any] | None = None,
    worker_init_fn: Callable[[int], None] | None = None,
    sampler: Any = None,
    check_shm: bool = True,
    **knobs: Any,
) -> DataLoader:
    """A DataLoader from validated knobs (every loader in the workbook is built here).

    With workers, the loader also

    * refuses to start when ``/dev/shm`` can't hold the batches its workers may
      have in flight (:func:`require_shm`, estimated from ``dataset[0]``), so no
      path can skip the check;
    * waits at most :data:`WORKER_TIMEOUT_S` for a batch (unless ``timeout`` is set), so a
      frozen worker ends in :class:`LoaderFailure` instead of a hang;
    * resets SIGINT/SIGTERM in each worker (:func:`reset_child_signals`): a handler
      meant for the parent never runs in a worker;
    * stops the workers it started if ``iter(loader)`` is interrupted half-way.

    Args:
        dataset: a map-style data set (defined in an importable module if workers use spawn/forkserver).
        config: the knobs; keyword ``knobs`` override single fields
            (``build_loader(ds, num_workers=2)``).
        collate_fn: default ``torch.utils.data.default_collate``.
        worker_init_fn: default :func:`helpers.pipeline.data.seed_worker` when workers are used.
        sampler: optional sampler deciding the order of indices (then ``shuffle`` must be False).
        check_shm: check ``/dev/shm`` before any worker starts (default True).

    Raises:
        ValueError: a knob out of range, a knob that needs workers used without them, a
            sampler together with ``shuffle=True``, a collate or init function that is not
            callable, or too little ``/dev/shm``.
    """
    if not hasattr(dataset, "__getitem__") or not hasattr(dataset, "__len__"):
        raise ValueError(
            f"dataset must be a map-style data set (with __getitem__ and __len__), got {type(dataset).__name__}"
        )
    cfg = (config or LoaderConfig()).replace(**knobs).validated()
    if len(dataset) == 0:
        raise ValueError("dataset is empty; a loader needs at least one item")
    if sampler is not None and cfg.shuffle:
        raise ValueError("a sampler decides the order itself: pass shuffle=False together with sampler")
    _check_callable("collate_fn", collate_fn)
    _check_callable("worker_init_fn", worker_init_fn)
    kwargs: dict[str, Any] = {}
    if cfg.num_workers > 0:
        if check_shm:
            per_item = _item_bytes(dataset)
            if per_item is not None:
                require_shm(shm_needed_bytes(per_item * cfg.batch_size, cfg.num_workers, cfg.prefetch_factor or 2))
        kwargs.update(
            worker_init_fn=_WorkerInit(worker_init_fn if worker_init_fn is not None else seed_worker),
            persistent_workers=cfg.persistent_workers,
            prefetch_factor=cfg.prefetch_factor,
            timeout=cfg.effective_timeout(),
            in_order=cfg.in_order,
        )
        if cfg.multiprocessing_context is not None:
            kwargs["multiprocessing_context"] = cfg.multiprocessing_context
    gen = torch.Generator()
    gen.manual_seed(cfg.seed)
    with warnings.catch_warnings(record=True) as wlist:
        warnings.simplefilter("always")
        loader = _WorkbookLoader(
            dataset,
            batch_size=cfg.batch_size,
            shuffle=cfg.shuffle,
            num_workers=cfg.num_workers,
            pin_memory=cfg.pin_memory,
            drop_last=cfg.drop_last,
            collate_fn=collate_fn if collate_fn is not None else default_collate,
            generator=gen,
            sampler=sampler,
            **kwargs,
        )
    # e.g. "This DataLoader will create 3 worker processes in total. Our suggested max ..." -
    # kept for the reader (Throughput.warnings), not printed to stderr.
    loader._workbook_warnings = [str(w.message).strip() for w in wlist]
    loader._workbook_frozen = []  # pids _FreezeWatch killed
    return loader


def timed_loader(
    dataset: Dataset,
    batch_size: int,
    *,
    shuffle: bool = True,
    num_workers: int = 0,
    seed: int = 0,
    pin_memory: bool = False,
    drop_last: bool = False,
    timed_collate: bool = True,
    **kwargs: Any,
) -> DataLoader:
    """Chapter 01's loader: :func:`build_loader` with plain keyword arguments and a timed collate.

    The baseline (chapter 01) is ``timed_loader(ds, 32)``: ``num_workers=0``,
    pageable memory, reproducible shuffling, workers seeded by :func:`helpers.pipeline.data.seed_worker`.
    (Named so that it is never confused with the ``make_loader`` the chapters write in their cells.)
    Extra keyword arguments are the other :class:`LoaderConfig`
    knobs (``persistent_workers``, ``prefetch_factor``, ``multiprocessing_context``,
    ``in_order``, ``timeout``), plus ``collate_fn``, ``worker_init_fn`` and
    ``sampler``. All of them are validated: a bad value raises ``ValueError``
    naming the knob, and an unknown name lists the knobs.

    Args:
        dataset: any map-style dataset.
        batch_size: items per batch (1-65536).
        shuffle: reshuffle every epoch, from a generator seeded with ``seed``.
        num_workers: worker processes (0: load in the main process).
        seed: seed of the shuffling generator (and of workers' base seed).
        pin_memory: page-locked batches (only with CUDA; see chapter 02).
        drop_last: drop a final short batch.
        timed_collate: wrap the collate function in :class:`helpers.pipeline.data.TimedCollate`.
    """
    collate = kwargs.pop("collate_fn", None)
    worker_init_fn = kwargs.pop("worker_init_fn", None)
    sampler = kwargs.pop("sampler", None)
    config = LoaderConfig(
        batch_size=batch_size,
        num_workers=num_workers,
        pin_memory=pin_memory,
        shuffle=shuffle,
        seed=seed,
        drop_last=drop_last,
    )
    return build_loader(
        dataset,
        config,
        collate_fn=TimedCollate(collate) if timed_collate else collate,
        worker_init_fn=worker_init_fn,
        sampler=sampler,
        **kwargs,
    )


# ---------------------------------------------------------------------------
# Releasing workers: bounded waits, whatever interrupts them
# ---------------------------------------------------------------------------


def reset_child_signals() -> None:
    """In a child process (a loader worker, a pool process): drop signal handlers meant for the parent.

    A forked child inherits the parent's Python signal handlers. A parent that turns SIGTERM into
    ``KeyboardInterrupt`` (a benchmark saving a partial file) would make ``pool.terminate()`` raise
    inside a pool worker that holds a queue lock, and the parent then waits for that lock forever.
    Here SIGTERM goes back to the default (the process ends at once) and SIGINT is ignored: the
    parent receives Ctrl-C and shuts its children down.
    """
    for sig, handler in ((signal.SIGTERM, signal.SIG_DFL), (signal.SIGINT, signal.SIG_IGN)):
        try:
            signal.signal(sig, handler)
        except (ValueError, OSError):  # pragma: no cover - not the main thread of the child
            pass


def _worker_children() -> set[int]:
    """Pids of this process's live children, less multiprocessing's long-lived helpers (see
    :func:`worker_processes`). Taken from the OS, so a worker that was forked but not yet recorded
    by ``multiprocessing`` (an interrupt inside ``Process.start()``) is included."""
    import psutil

    out = set()
    for p in worker_processes():
        try:
            if p.status() != psutil.STATUS_ZOMBIE:
                out.add(p.pid)
        except psutil.Error:
            pass
    return out


def _stop_new_children(before: set[int]) -> None:
    """Stop every child started since ``before`` (pids) that is still alive; bounded waits."""
    import psutil

    new = _worker_children() - before
    if not new:
        return
    known = {p.pid: p for p in mp.active_children()}
    _stop_processes([known[pid] for pid in new if pid in known])
    strays = []
    for pid in new - set(known):
        with contextlib.suppress(psutil.Error):
            strays.append(psutil.Process(pid))
    for p in strays:
        with contextlib.suppress(psutil.Error):
            p.terminate()
    _gone, alive = psutil.wait_procs(strays, timeout=SHUTDOWN_GRACE_S)
    for p in alive:
        with contextlib.suppress(psutil.Error):
            p.kill()
    psutil.wait_procs(alive, timeout=1.0)


def _stop_processes(procs: Sequence[Any], grace_s: float = SHUTDOWN_GRACE_S) -> None:
    """SIGTERM, wait at most ``grace_s`` in all, then SIGKILL (which also ends a stopped process)."""
    procs = [p for p in procs if p.is_alive()]
    for p in procs:
        with contextlib.suppress(Exception):
            p.terminate()
    deadline = time.monotonic() + grace_s
    for p in procs:
        with contextlib.suppress(Exception):
            p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            with contextlib.suppress(Exception):
                p.kill()
                p.join(1.0)


def _kill_stopped(procs: Sequence[Any]) -> None:
    """SIGKILL workers that are stopped (SIGSTOP/SIGTSTP): nothing else can end them, and a shutdown
    would otherwise wait its full grace period for each."""
    import psutil

    for p in procs:
        try:
            if p.is_alive() and psutil.Process(p.pid).status() == psutil.STATUS_STOPPED:
                p.kill()
                p.join(1.0)
        except Exception:
            pass


def _finish(objs: Sequence[Any], before: set[int] | None = None) -> None:
    """Release every loader/iterator in ``objs``, then stop any loader worker started since ``before``.

    Runs to the end even if an interrupt arrives meanwhile, so no worker outlives the helper that started it:
    SIGINT and SIGTERM are held while it runs (:class:`_HeldSignals`) and the first one is raised once it is
    done; a second press escapes at once. Holding, rather than catching the ``KeyboardInterrupt``, matters:
    the teardown runs finalizers (torch's iterator, its queues and pipes, the worker processes' own), and a
    ``KeyboardInterrupt`` raised inside a finalizer is printed as "Exception ignored" and lost - the press
    would go unanswered. Young cyclic garbage is collected inside the hold for the same reason.
    """
    held = _HeldSignals(escape=True)
    with held:
        for obj in objs:
            release(obj)
        if before is not None:
            _stop_new_children(before)
        gc.collect(1)  # the young generations, where the run's iterator and queues are (< 1 ms; a full one: ~0.1 s)
    held.deliver()


def release(obj: Any) -> None:
    """Shut down the worker processes (and pin thread) behind a loader or an iterator.

    Safe to call more than once, on loaders with or without workers, on persistent
    loaders (whose iterator the DataLoader keeps in ``_iterator``) and on half-started
    iterators. Waits are bounded: a worker that does not end within
    :data:`SHUTDOWN_GRACE_S` (or is frozen) is killed.
    """
    its = []
    if isinstance(obj, DataLoader):
        its.append(getattr(obj, "_iterator", None))
    else:
        its.append(obj)
    for it in its:
        if it is None:
            continue
        workers = list(getattr(it, "_workers", []) or [])
        if getattr(it, "_worker_pids_set", False):
            # From here on a worker that ends (or is killed below) is expected: torch's SIGCHLD
            # handler must not raise "killed by signal" into whatever the main thread does next.
            with contextlib.suppress(Exception):
                torch.utils.data._utils.signal_handling._remove_worker_pids(id(it))
                it._worker_pids_set = False
        _kill_stopped(workers)
        shutdown = getattr(it, "_shutdown_workers", None)
        if shutdown is not None:
            try:
                shutdown()
            except Exception:  # a half-started iterator must not block cleanup
                pass
            it._shutdown = True  # a later __del__ has nothing left to do
        _stop_processes(workers)
    if isinstance(obj, DataLoader):
        obj._iterator = None


@contextlib.contextmanager
def open_iterator(loader: DataLoader) -> Iterator[Iterator[Any]]:
    """``with open_iterator(loader) as it:`` - the workers are released when the block ends, however it ends
    (an interrupt while the workers start included). A worker failure inside the block (a worker that died or
    froze, an exception the data set raised in a worker) comes out as :class:`LoaderFailure` in plain words,
    torch's error kept as its ``__cause__``."""
    it = None
    before = _worker_children()
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*suggested max number of worker.*")
            warnings.filterwarnings("ignore", message=re.escape(_PIN_WARNING))
            it = iter(loader)
        yield it
    except Exception as exc:  # a worker that died or froze, the data set's error in a worker: in plain words
        failure = _plain_failure(exc, loader)
        if failure is exc:
            raise
        raise failure from exc
    finally:
        _finish([x for x in (it, loader) if x is not None], before)


# ---------------------------------------------------------------------------
# Failures in plain words (the words themselves: helpers.core.failures, so that the panels reach them too)
# ---------------------------------------------------------------------------


def _ended_workers(loader: Any, wait_s: float = 1.0) -> list[tuple[int, Any]]:
    """(worker id, process) of the loader's latest workers that have ended; waits up to ``wait_s`` for one to show
    (a broken pipe is often seen a moment before the worker's exit status)."""
    procs = list(getattr(loader, "_workbook_workers", []) or [])
    deadline = time.monotonic() + wait_s
    while procs:
        try:
            ended = [(wid, w) for wid, w in enumerate(procs) if w.exitcode is not None]
            if ended or time.monotonic() >= deadline:
                return ended
            time.sleep(0.05)
        except RuntimeError as err:  # torch's SIGCHLD handler, raising for the worker that just ended: that is
            if not _TORCH_WORKER_DIED.search(str(err)):  # what this waits for, so look again
                raise
    return []


#: torch's SIGCHLD handler's words for a worker that ended (``_error_if_any_worker_fails``).
_TORCH_WORKER_DIED = re.compile(r"DataLoader worker \(pid[^)]*\) (is killed by signal|exited unexpectedly)")


def _plain_failure(exc: BaseException, loader: Any = None) -> BaseException:
    """``LoaderFailure`` with plain words for a known failure, else ``exc`` itself."""
    if isinstance(exc, LoaderFailure):
        return exc
    frozen = getattr(loader, "_workbook_frozen", None)
    text = str(exc)
    advice: str | None
    if frozen:
        advice = explain_loader_error(RuntimeError(f"DataLoader timed out after {loader.timeout:g} seconds"))
        advice = (advice or "") + f" (Stopped worker pid(s) {', '.join(map(str, frozen))}: ended by the workbook.)"
        frozen.clear()
    elif isinstance(exc, (EOFError, ConnectionError)) or (
        isinstance(exc, RuntimeError) and ("exited unexpectedly" in text or "is killed by signal" in text)
    ):
        # A worker died: torch says so without the worker's number or exit status, or the main process met the
        # broken connection first (EOFError, ConnectionResetError while it fetched a batch's shared memory).
        ended = _ended_workers(loader)
        if ended:
            advice = " ".join(ended_in_words(wid, w.pid, int(w.exitcode)) for wid, w in ended[:2])
        else:
            advice = explain_loader_error(exc)
    else:
        advice = explain_loader_error(exc)
    if advice is None:
        return exc
    failure = LoaderFailure(advice)
    failure.__cause__ = exc
    return failure


def child_processes() -> list[Any]:
    """Live child processes of this process (psutil objects), recursively."""
    import psutil

    try:
        return [p for p in psutil.Process().children(recursive=True) if p.is_running()]
    except psutil.Error:  # pragma: no cover
        return []


def worker_processes() -> list[Any]:
    """Children that are not multiprocessing's own long-lived helpers.

    ``spawn``/``forkserver`` start one *resource tracker* (and a forkserver)
    per Python process, by design; they stay until the kernel exits and are
    not leaked workers.
    """
    out = []
    for p in child_processes():
        try:
            cmd = " ".join(p.cmdline())
        except Exception:
            cmd = ""
        if "resource_tracker" in cmd or "forkserver" in cmd:
            continue
        out.append(p)
    return out


# ---------------------------------------------------------------------------
# Measuring
# ---------------------------------------------------------------------------


def _batch_len(batch: Any) -> int:
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() else 1
    if isinstance(batch, PinnableBatch):
        return len(batch)
    if isinstance(batch, Mapping):
        return _batch_len(next(iter(batch.values())))
    if isinstance(batch, (list, tuple)) and batch:
        first = batch[0]
        if isinstance(first, (torch.Tensor, list, tuple, PinnableBatch, Mapping)):
            return _batch_len(first)
        return len(batch)
    return 1


def _batch_bytes(batch: Any) -> int:
    if isinstance(batch, torch.Tensor):
        return int(batch.numel() * batch.element_size())
    if isinstance(batch, PinnableBatch):
        return _batch_bytes(batch.images) + _batch_bytes(batch.labels)
    if isinstance(batch, Mapping):
        return sum(_batch_bytes(v) for v in batch.values())
    if isinstance(batch, (list, tuple)):
        return sum(_batch_bytes(v) for v in batch)
    return 0


def _batch_tensors(batch: Any) -> list[torch.Tensor]:
    """The tensors in a batch (a tensor, tuple, list, dict or :class:`PinnableBatch`), in order."""
    if isinstance(batch, torch.Tensor):
        return [batch]
    if isinstance(batch, PinnableBatch):
        return [batch.images, batch.labels]
    if isinstance(batch, Mapping):
        return [t for v in batch.values() for t in _batch_tensors(v)]
    if isinstance(batch, (list, tuple)):
        return [t for v in batch for t in _batch_tensors(v)]
    return []


def _is_pinned(batch: Any) -> bool:
    """True when every tensor of ``batch`` is in page-locked memory (False for a batch without tensors)."""
    ts = _batch_tensors(batch)
    return bool(ts) and all(t.device.type == "cpu" and t.is_pinned() for t in ts)


def _pct(values: Sequence[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    pos = (len(s) - 1) * q
    lo, hi = math.floor(pos), math.ceil(pos)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


@dataclass
class Throughput:
    """One measured loader run.

    Attributes:
        label: the configuration, in words.
        config: the knobs (and anything else that defines the run).
        items / batches: counted in the timed window (after warm-up).
        seconds: wall time of the timed window.
        startup_s: time from ``iter(loader)`` to the first batch (includes starting workers).
        warmup_batches: batches taken before the window opened.
        epochs_started: iterators created (1 + epoch restarts).
        wait_s: per timed batch, the time the main thread spent inside ``next()``.
        main_cpu_s: CPU time of the main thread in the window (``time.thread_time``).
        batch_bytes: bytes of the first timed batch.
        warnings: warnings the loader emitted (captured, not printed).
        extra: experiment-specific values (e.g. pin timings).
    """

    label: str
    config: dict[str, Any]
    items: int
    batches: int
    seconds: float
    startup_s: float
    warmup_batches: int
    epochs_started: int
    wait_s: list[float] = field(default_factory=list)
    main_cpu_s: float = 0.0
    batch_bytes: int = 0
    warnings: list[str] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def items_per_s(self) -> float:
        return self.items / self.seconds if self.seconds > 0 else float("nan")

    @property
    def ms_per_batch(self) -> float:
        return 1e3 * self.seconds / self.batches if self.batches else float("nan")

    @property
    def mean_wait_ms(self) -> float:
        return 1e3 * statistics.fmean(self.wait_s) if self.wait_s else float("nan")

    @property
    def p95_wait_ms(self) -> float:
        return 1e3 * _pct(self.wait_s, 0.95)

    @property
    def max_wait_ms(self) -> float:
        return 1e3 * max(self.wait_s) if self.wait_s else float("nan")

    @property
    def main_busy(self) -> float:
        """Fraction of the window the main thread was on a CPU (near 1: the main process is the bottleneck)."""
        return self.main_cpu_s / self.seconds if self.seconds > 0 else float("nan")

    def summary(self) -> str:
        return (
            f"{self.label}: {self.items_per_s:,.0f} items/s "
            f"({self.batches} batches in {self.seconds:.2f} s; first batch after {self.startup_s:.2f} s; "
            f"main thread busy {100 * self.main_busy:.0f}%)"
        )

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["items_per_s"] = self.items_per_s
        return d


def _loader_params(loader: DataLoader) -> dict[str, Any]:
    return {
        "batch_size": loader.batch_size,
        "num_workers": loader.num_workers,
        "pin_memory": bool(loader.pin_memory),
        "prefetch_factor": loader.prefetch_factor if loader.num_workers else None,
        "persistent_workers": bool(loader.persistent_workers),
        "in_order": bool(getattr(loader, "in_order", True)),
        "dataset": type(loader.dataset).__name__,
    }


def measure_throughput(
    loader: Iterable[Any],
    *,
    batches: int,
    warmup: int = 2,
    to_device: Callable[..., Any] | None = None,
    consume: Callable[[Any], Any] | None = None,
    on_batch: Callable[[Any], None] | None = None,
    threads: int | None = None,
    label: str | None = None,
    progress: Callable[..., Any] | None = None,
) -> Throughput:
    """Run ``loader`` for ``warmup`` + ``batches`` batches and time the last ``batches``: the one way to time a loader.

    ``loader`` is a DataLoader (one of :func:`build_loader`, or the reader's ``make_loader(...)`` or
    ``factory(value)``, given the workbook's safety by :func:`guard` / :func:`build_from_factory`) or any
    iterable of batches. For each timed batch the main thread's wait inside ``next()`` is recorded
    (loading, collating and, with ``pin_memory=True`` and no workers, pinning: ``Throughput.wait_s``).

    Epoch ends are crossed transparently (a new iterator is started; with ``persistent_workers`` the
    same workers carry on), so the window can be longer than one epoch. Workers are shut down in
    ``finally``: after a normal end, an exception, or ``KeyboardInterrupt`` - also one that arrives
    while the workers are starting, or during the shutdown itself.

    Args:
        loader: the DataLoader (or iterable of batches) to run.
        batches: batches in the timed window (1-1,000,000).
        warmup: batches taken first and not timed (worker start-up, first-call costs).
        to_device: the reader's copy function, called as ``to_device(*batch)`` on every batch; its time
            is recorded apart (``extra["copy_s"]``, ``extra["copy_ms_per_batch"]``: a blocking copy is all
            of the copy; a ``non_blocking`` copy from pinned memory is only the time to queue it). When it
            returns CUDA tensors, the window ends with ``torch.cuda.synchronize()``, so copies still in
            flight are inside the measured time.
        consume: optional ``consume(batch)`` called per batch (e.g. a training step; it gets what
            ``to_device`` returned, if given); its time is in the window.
        on_batch: optional ``on_batch(batch)`` called for every timed batch, outside the wait timing.
        threads: torch's intra-op threads in this process while it runs (``None``: leave the setting
            alone; chapters 03-04 pass 1, the count every worker and the pin thread use: on a busy machine
            a second thread mostly measures waiting for a descheduled helper thread).
        label: text for the result (default: the loader's knobs).
        progress: optional ``progress(fraction, text)`` (a panel's progress bar).

    Returns:
        A :class:`Throughput`; ``extra["pinned_batches"]`` counts the timed batches that arrived in
        page-locked memory, ``extra["on_cuda"]`` says whether ``to_device`` put them on a CUDA device.

    Raises:
        ValueError: bad arguments, or a loader that yields no batch at all.
        LoaderFailure: a worker froze (the loader's timeout fired), died, or raised (the data set's own exception,
            with the item that raised it); one line says which worker and what to check.
    """
    if not hasattr(loader, "__iter__"):
        raise ValueError(
            f"loader must be an iterable of batches (a DataLoader, e.g. make_loader(...)), got {type(loader).__name__}"
        )
    if to_device is not None:
        _check_callable("to_device", to_device)
    batches = check_int("batches", batches, 1, 1_000_000)
    warmup = check_int("warmup", warmup, 0, 1_000_000)
    total = warmup + batches
    params = _loader_params(loader) if isinstance(loader, DataLoader) else {"loader": type(loader).__name__}
    caught: list[str] = list(getattr(loader, "_workbook_warnings", []))
    waits: list[float] = []
    copies: list[float] = []
    items = bytes_first = pinned = epochs = 0
    cuda_dev: torch.device | None = None  # where to_device put the batches, if on a CUDA device
    it = None
    startup = float("nan")
    before = _worker_children()
    try:
        with (
            warnings.catch_warnings(record=True) as wlist,
            intraop_threads(threads) if threads is not None else contextlib.nullcontext(),
        ):
            warnings.simplefilter("always")
            warnings.filterwarnings("ignore", category=DeprecationWarning)
            t_start = t_window = time.perf_counter()
            t_cpu = time.thread_time()
            for n in range(total):
                if n == warmup:
                    if cuda_dev is not None:
                        torch.cuda.synchronize(cuda_dev)  # the warm-up's copies are not the window's
                    t_window, t_cpu = time.perf_counter(), time.thread_time()
                t0 = time.perf_counter()
                batch = None
                for _attempt in range(2):  # the end of an epoch: one new iterator, then give up
                    if it is None:
                        it = iter(loader)
                        epochs += 1
                    try:
                        batch = next(it)
                        break
                    except StopIteration:
                        if not getattr(loader, "persistent_workers", False):
                            release(it)
                        it = None
                if batch is None:
                    raise ValueError(
                        "the loader yields no batches (a data set smaller than batch_size with drop_last=True, "
                        "or a sampler with no indices): give it at least one full batch of items"
                    )
                t1 = time.perf_counter()
                out = to_device(*batch) if to_device is not None else batch
                t2 = time.perf_counter()
                if n == 0:
                    startup = t1 - t_start
                    cuda_dev = next((t.device for t in _batch_tensors(out) if t.is_cuda), None)
                if consume is not None:
                    consume(out)
                if n >= warmup:
                    waits.append(t1 - t0)
                    copies.append(t2 - t1)
                    items += _batch_len(batch)
                    pinned += _is_pinned(batch)
                    if n == warmup:
                        bytes_first = _batch_bytes(batch)
                    if on_batch is not None:
                        on_batch(batch)
                del batch, out
                if progress is not None and ((n + 1) % max(1, total // 50) == 0 or n + 1 == total):
                    progress((n + 1) / total, f"{n + 1}/{total} batches")
            if cuda_dev is not None:
                torch.cuda.synchronize(cuda_dev)  # copies still queued belong to this window
            seconds = time.perf_counter() - t_window
            cpu = time.thread_time() - t_cpu
            for w in wlist:
                msg = str(w.message).strip()
                if msg not in caught:
                    caught.append(msg)
    except Exception as exc:
        # torch's timeout, a dead worker (raised by its SIGCHLD handler wherever the main thread is, or met as
        # a broken connection), or the data set's own exception re-raised from a worker: in plain words
        failure = _plain_failure(exc, loader)
        if failure is exc:
            raise
        raise failure from exc
    finally:
        _finish([x for x in (it, loader) if x is not None], before)
    extra: dict[str, Any] = {"pinned_batches": pinned, "on_cuda": cuda_dev is not None}
    if to_device is not None:
        extra.update(copy_s=copies, copy_ms_per_batch=1e3 * statistics.fmean(copies))
    return Throughput(
        label=label or (_config_of(params).label() if isinstance(loader, DataLoader) else type(loader).__name__),
        config=params,
        items=items,
        batches=batches,
        seconds=seconds,
        startup_s=startup,
        warmup_batches=warmup,
        epochs_started=epochs,
        wait_s=waits,
        main_cpu_s=cpu,
        batch_bytes=bytes_first,
        warnings=caught,
        extra=extra,
    )


def measure_config(
    dataset: Dataset,
    config: LoaderConfig | None = None,
    *,
    batches: int,
    warmup: int = 2,
    collate_fn: Callable[[Any], Any] | None = None,
    label: str | None = None,
    check_shm: bool = True,
    progress: Callable[..., Any] | None = None,
    on_batch: Callable[[Any], None] | None = None,
    **knobs: Any,
) -> Throughput:
    """The workbook's own loader for ``config`` (and ``knobs``), measured: :func:`build_loader` (``/dev/shm``
    checked there), then :func:`measure_throughput`, which releases its workers however the run ends.

    ``result.config`` is the configuration's knobs with the data set's and the collate function's names.

    Raises:
        ValueError: bad knobs, far more workers than this machine has cores (:func:`check_workers_for_cores`),
            or too little ``/dev/shm`` for this configuration (refused before any worker starts; see
            :func:`require_shm`).
        LoaderFailure: a worker froze, died or raised (see :func:`measure_throughput`).
    """
    cfg = (config or LoaderConfig()).replace(**knobs).validated()
    check_workers_for_cores(cfg.num_workers)
    loader = build_loader(dataset, cfg, collate_fn=collate_fn, check_shm=check_shm)
    result = measure_throughput(
        loader, batches=batches, warmup=warmup, progress=progress, label=label or cfg.label(), on_batch=on_batch
    )
    result.config = {
        **cfg.params(),
        "dataset": type(dataset).__name__,
        "collate": getattr(collate_fn, "__name__", "default_collate"),
    }
    return result


# ---------------------------------------------------------------------------
# Chapter 03: the pin thread
# ---------------------------------------------------------------------------


#: What the workbook calls the DataLoader's pin-memory thread: the name torch gives the OS thread.
PIN_THREAD_NAME = "pt_data_pin"


def _is_pin_thread(thread: threading.Thread) -> bool:
    """True for a DataLoader pin-memory thread.

    torch starts it as ``threading.Thread(target=_pin_memory_loop, ...)`` without a ``name=``, so its
    Python name is ``Thread-N (_pin_memory_loop)``; only the OS-level thread is named ``pt_data_pin``
    (by ``torch.multiprocessing._set_thread_name`` inside the loop). So it is found by its target.
    """
    target = getattr(thread, "_target", None)  # set while the thread runs (Thread.run deletes it at the end)
    if getattr(target, "__name__", None) == "_pin_memory_loop":
        return True
    return thread.name == PIN_THREAD_NAME or thread.name.endswith("(_pin_memory_loop)")


def pin_threads() -> list[threading.Thread]:
    """The DataLoader pin-memory threads alive in this process."""
    return [t for t in threading.enumerate() if t.is_alive() and _is_pin_thread(t)]


def pin_thread_alive() -> bool:
    """True while a DataLoader pin-memory thread (``pt_data_pin``) runs in this process."""
    return bool(pin_threads())


def thread_label(thread: threading.Thread | None = None) -> str:
    """A stable name for a thread: ``pt_data_pin`` for a pin-memory thread, else its Python name
    (``MainThread`` for the main thread). Default: the current thread."""
    thread = thread if thread is not None else threading.current_thread()
    return PIN_THREAD_NAME if _is_pin_thread(thread) else thread.name


def pin_memory_warning() -> str | None:
    """The warning ``DataLoader(pin_memory=True)`` gives on this machine, captured (``None``: no warning).

    Creates one iterator over a 2-item data set with ``num_workers=0`` and
    records warnings instead of printing them.
    """
    loader = DataLoader(CheapDataset(4, image_size=4), batch_size=2, pin_memory=True)
    it = None
    try:
        with warnings.catch_warnings(record=True) as wlist:
            warnings.simplefilter("always")
            it = iter(loader)
            next(it)
    finally:
        release(it)
    msgs = [str(w.message) for w in wlist if "pin_memory" in str(w.message)]
    return msgs[0] if msgs else None


class PinnableBatch:
    """A custom batch type: images and labels, with its own ``pin_memory()``.

    The DataLoader's pin step calls ``batch.pin_memory()`` on any object that
    has one (in the pin thread with workers, in the main thread without). This
    one also records how long pinning took and which thread did it, so chapter
    03 can show where the pinning time goes.

    Attributes:
        images, labels: tensors.
        pin_seconds: time the last ``pin_memory()`` took (``None``: not pinned by it).
        pin_thread: name of the thread that pinned it.
    """

    def __init__(self, images: torch.Tensor, labels: torch.Tensor) -> None:
        self.images = images
        self.labels = labels
        self.pin_seconds: float | None = None
        self.pin_thread: str | None = None

    def pin_memory(self, device: Any = None) -> "PinnableBatch":
        """A copy in page-locked memory (what ``DataLoader(pin_memory=True)`` calls)."""
        t0 = time.perf_counter()
        out = PinnableBatch(self.images.pin_memory(), self.labels.pin_memory())
        out.pin_seconds = time.perf_counter() - t0
        out.pin_thread = thread_label()
        return out

    def is_pinned(self) -> bool:
        return bool(self.images.is_pinned() and self.labels.is_pinned())

    def to(self, device: Any, non_blocking: bool = False) -> "PinnableBatch":
        """Move both tensors (``non_blocking`` only overlaps when pinned)."""
        out = PinnableBatch(
            self.images.to(device, non_blocking=non_blocking), self.labels.to(device, non_blocking=non_blocking)
        )
        out.pin_seconds, out.pin_thread = self.pin_seconds, self.pin_thread
        return out

    def __len__(self) -> int:
        return int(self.images.shape[0])

    def __repr__(self) -> str:
        return f"PinnableBatch(images={tuple(self.images.shape)} {self.images.dtype}, pinned={self.is_pinned()})"


def _stack(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Stack like default_collate: straight into shared memory inside a worker (no extra copy)."""
    from torch.utils.data._utils.collate import collate_tensor_fn

    return collate_tensor_fn(tensors)


def collate_pinnable(items: list[tuple[torch.Tensor, int]]) -> PinnableBatch:
    """Collate ``(image, label)`` items into a :class:`PinnableBatch`."""
    return PinnableBatch(_stack([x for x, _ in items]), torch.as_tensor([int(y) for _, y in items]))


def batch_copy_seconds(nbytes: int, repeats: int = 20) -> float:
    """Median time of one plain CPU copy of ``nbytes`` (the memcpy inside pinning, measured here).

    Pinning a batch copies it into page-locked memory; once the caching host
    allocator has warm blocks, that copy is most of the cost. Without an
    accelerator nothing can be pinned, so this is the part that *can* be
    measured on any machine. It is a lower bound, not the pinning cost.
    """
    nbytes = check_int("nbytes", nbytes, 1, 1 << 34)
    repeats = check_int("repeats", repeats, 1, 10_000)
    src = torch.empty(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    # One thread, as in the DataLoader's pin thread (it calls torch.set_num_threads(1)); a multi-threaded
    # copy on a busy machine mostly measures waiting for a descheduled helper thread.
    with intraop_threads(1):
        dst.copy_(src)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


@dataclass
class PinRow:
    """One run of the pin experiment."""

    num_workers: int
    pin_memory: bool
    result: Throughput
    pin_active: bool
    pin_ms_per_batch: float | None
    pin_thread: str | None
    round_items_per_s: list[float] = field(default_factory=list)

    @property
    def items_per_s(self) -> float:
        """Median over the rounds (one round: that run's throughput)."""
        return statistics.median(self.round_items_per_s) if self.round_items_per_s else self.result.items_per_s


def pin_verdict(rows: Sequence[PinRow], num_workers: int) -> str:
    """One sentence on ``pin_memory=True`` against ``False`` at ``num_workers``, from the per-round ratios.

    The flag is credited with a difference only when every round agrees on its direction; otherwise
    the sentence says the pair differs by noise, and by how much.
    """
    pair = {r.pin_memory: r for r in rows if r.num_workers == num_workers}
    if set(pair) != {False, True}:
        raise ValueError(f"rows hold no pin_memory pair for num_workers={num_workers}")
    on, off = (
        pair[True].round_items_per_s or [pair[True].items_per_s],
        pair[False].round_items_per_s or [pair[False].items_per_s],
    )
    ratios = [a / b for a, b in zip(on, off)]
    med, lo, hi = statistics.median(ratios), min(ratios), max(ratios)
    n = len(ratios)
    rng = f"median {med:.2f}x over {n} alternating round{'s' if n > 1 else ''}, range {lo:.2f}-{hi:.2f}x"
    if not pair[True].pin_active:
        what = "nothing was pinned (no accelerator), so any difference is noise"
        return f"workers={num_workers}: pin_memory=True vs False {rng}; {what}."
    if n < 2:
        return f"workers={num_workers}: pin_memory=True vs False {rng}; one round can't tell an effect from noise."
    if lo > 1.0:
        return f"workers={num_workers}: pin_memory=True faster in every round ({rng})."
    if hi < 1.0:
        return f"workers={num_workers}: pin_memory=True slower in every round ({rng})."
    return f"workers={num_workers}: the rounds disagree ({rng}): within noise."


class PinLog:
    """``on_batch`` callback that collects the pin times :class:`PinnableBatch` batches carry."""

    def __init__(self) -> None:
        self.seconds: list[float] = []
        self.threads: list[str] = []

    def __call__(self, batch: Any) -> None:
        if isinstance(batch, PinnableBatch) and batch.pin_seconds is not None:
            self.seconds.append(batch.pin_seconds)
            self.threads.append(batch.pin_thread or "?")

    @property
    def ms_per_batch(self) -> float | None:
        """Median pin time per batch in ms (``None``: nothing was pinned)."""
        return 1e3 * statistics.median(self.seconds) if self.seconds else None

    @property
    def thread(self) -> str | None:
        """The thread that pinned most batches (``None``: nothing was pinned)."""
        return max(set(self.threads), key=self.threads.count) if self.threads else None


def pin_memory_experiment(
    dataset: Dataset,
    *,
    workers: Sequence[int] = (0, 2),
    batch_size: int = 32,
    batches: int = 30,
    warmup: int = 4,
    progress: Callable[..., Any] | None = None,
    rounds: int = 1,
) -> list[PinRow]:
    """The baseline loader with and without ``pin_memory``, for each worker count.

    Batches are :class:`PinnableBatch`, so when pinning really happens (a CUDA
    device is present) each batch says how long pinning took and which thread
    did it: the main thread with ``num_workers=0``, the ``pt_data_pin`` thread
    with workers. Without an accelerator the flag only warns; the rows then
    show ``pin_active=False`` and no pin time.

    With ``rounds`` > 1 the pair is measured in alternating rounds (False, True,
    False, True, ...; the order flips every round), so drift in the machine's
    speed cancels; a row's ``items_per_s`` is then its median over the rounds,
    and :func:`pin_verdict` says whether the flag made a difference or the pair
    differs by noise. The other fields come from the row's last round.
    """
    rounds = check_int("rounds", rounds, 1, 100)
    ws = [check_int(f"workers[{i}]", w, 0, MAX_WORKERS) for i, w in enumerate(workers)]
    by: dict[tuple[int, bool], PinRow] = {}
    total = len(ws) * 2 * rounds
    k = 0
    for r in range(rounds):
        for w in ws:
            for pin in (False, True) if r % 2 == 0 else (True, False):
                if progress is not None:
                    progress(k / total, f"round {r + 1}/{rounds}: workers={w}, pin_memory={pin}")
                log = PinLog()
                cfg = LoaderConfig(batch_size=batch_size, num_workers=w, pin_memory=pin, persistent_workers=w > 0)
                res = measure_config(
                    dataset, cfg, batches=batches, warmup=warmup, collate_fn=collate_pinnable, on_batch=log
                )
                prev = by.get((w, pin))
                by[(w, pin)] = PinRow(
                    num_workers=w,
                    pin_memory=pin,
                    result=res,
                    pin_active=bool(log.seconds),
                    pin_ms_per_batch=log.ms_per_batch,
                    pin_thread=log.thread,
                    round_items_per_s=(prev.round_items_per_s if prev else []) + [res.items_per_s],
                )
                k += 1
    if progress is not None:
        progress(1.0, "done")
    return [by[(w, pin)] for w in ws for pin in (False, True)]


def pin_pair_rounds(
    make_loader: Callable[..., Any],
    dataset: Dataset,
    batch_size: int,
    *,
    to_device: Callable[..., Any] | None = None,
    batches: int = 30,
    warmup: int = 2,
    rounds: int = 3,
    progress: Callable[..., Any] | None = None,
    threads: int | None = 1,
) -> list[PinRow]:
    """The reader's ``make_loader(dataset, batch_size, pin_memory=flag)``, False against True, in alternating rounds.

    Each round builds the reader's loader once per flag (False then True; the order flips every round,
    so drift in the machine's speed hits both alike) and times it with :func:`measure_throughput`, each
    batch copied by the reader's ``to_device``. Returns two :class:`PinRow` (pin_memory False, True):
    ``round_items_per_s`` holds every round, ``result`` the last round's :class:`Throughput`, and
    ``pin_active`` says whether the timed batches really arrived pinned (never without an accelerator).
    :func:`pin_verdict` turns the rows into one honest sentence. No pin time is read here (plain tuples
    carry none): see :func:`pin_step_seconds`. ``threads``: intra-op threads while measuring (default 1,
    as in the pin thread and every worker; see :func:`measure_throughput`).

    Raises:
        ValueError: bad arguments, or a ``make_loader`` without a ``pin_memory`` keyword.
    """
    if not callable(make_loader):
        raise ValueError(
            f"make_loader must be a function such as make_loader(dataset, batch_size, pin_memory=...), "
            f"got {make_loader!r}"
        )
    rounds = check_int("rounds", rounds, 1, 100)
    batch_size = check_int("batch_size", batch_size, 1, 1_000_000)
    by: dict[bool, PinRow] = {}
    total = 2 * rounds
    for r in range(rounds):
        for k, pin in enumerate((False, True) if r % 2 == 0 else (True, False)):
            done = 2 * r + k
            step = (
                None
                if progress is None
                else (
                    lambda f, text="", _d=done, _r=r, _p=pin: progress(
                        (_d + f) / total, f"round {_r + 1}/{rounds}, pin_memory={_p}: {text}"
                    )
                )
            )
            try:
                loader = make_loader(dataset, batch_size, pin_memory=pin)
            except TypeError as exc:
                raise ValueError(
                    "make_loader must accept pin_memory=True/False as a keyword "
                    f"(def make_loader(dataset, batch_size, pin_memory=...)): {exc}"
                ) from None
            res = measure_throughput(
                loader,
                to_device=to_device,
                batches=batches,
                warmup=warmup,
                label=f"pin_memory={pin}",
                progress=step,
                threads=threads,
            )
            prev = by.get(pin)
            by[pin] = PinRow(
                num_workers=int(getattr(loader, "num_workers", 0)),
                pin_memory=pin,
                result=res,
                pin_active=res.extra["pinned_batches"] > 0,
                pin_ms_per_batch=None,
                pin_thread=None,
                round_items_per_s=(prev.round_items_per_s if prev else []) + [res.items_per_s],
            )
    if progress is not None:
        progress(1.0, "done")
    return [by[False], by[True]]


def pin_step_seconds(batch: Any, repeats: int = 10) -> float | None:
    """Median time of the DataLoader's own pin step on ``batch`` (``None``: no CUDA device, nothing can be pinned).

    Times ``torch.utils.data._utils.pin_memory.pin_memory(batch)``, the function the loader calls on
    every batch when ``pin_memory=True`` (in the main thread without workers, in ``pt_data_pin`` with
    them): a page-locked block from the caching host allocator, then a copy into it. One untimed call
    first, so the allocator has a warm block.
    """
    repeats = check_int("repeats", repeats, 1, 10_000)
    if not torch.cuda.is_available():
        return None
    from torch.utils.data._utils.pin_memory import pin_memory as loader_pin

    loader_pin(batch)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        loader_pin(batch)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


# ---------------------------------------------------------------------------
# Demo data sets (module level: importable by spawn/forkserver workers)
# ---------------------------------------------------------------------------


class CheapDataset(Dataset):
    """Items that cost almost nothing: views into a small in-memory bank of random images.

    With items this cheap, a DataLoader's per-batch overhead in the main
    process (receiving and unpickling batches from workers) is what limits
    throughput, not the work in the workers.

    Args:
        n: number of items (1-10,000,000).
        image_size: side length (1-1024).
        output: ``"float"`` (float32, 4 bytes per value) or ``"uint8"``.
        bank: distinct images kept in memory (1-4096).
        seed: generator seed for the bank.
    """

    def __init__(self, n: int, image_size: int = 64, output: str = "float", bank: int = 64, seed: int = 0) -> None:
        self.n = check_int("n", n, 1, 10_000_000)
        self.image_size = check_int("image_size", image_size, 1, 1024)
        self.output = check_choice("output", output, ("float", "uint8"))
        bank = check_int("bank", bank, 1, 4096)
        g = torch.Generator().manual_seed(check_int("seed", seed, 0, 2**63 - 1))
        data = torch.randint(0, 256, (bank, 3, self.image_size, self.image_size), dtype=torch.uint8, generator=g)
        self.bank = data if output == "uint8" else data.float().div_(255.0)
        self.labels = torch.arange(bank) % 10

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        if not -self.n <= index < self.n:
            raise IndexError(f"index {index} out of range for {self.n} items")
        k = index % len(self.bank)
        return self.bank[k], int(self.labels[k])


class BatchedCheapDataset(CheapDataset):
    """:class:`CheapDataset` plus ``__getitems__``: one gather per batch instead of one call per item.

    The DataLoader passes what ``__getitems__`` returns straight to
    ``collate_fn``; this one returns a finished ``(images, labels)`` batch, so
    pair it with :func:`passthrough_collate`.
    """

    def __getitems__(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        idx = torch.as_tensor(indices, dtype=torch.long) % len(self.bank)
        shape = (len(indices), *self.bank.shape[1:])
        if get_worker_info() is not None:  # build the batch in shared memory, as default_collate does
            out = self.bank.new_empty(shape).share_memory_()
            torch.index_select(self.bank, 0, idx, out=out)
            images = out
        else:
            images = self.bank.index_select(0, idx)
        return images, self.labels.index_select(0, idx)


def passthrough_collate(batch: Any) -> Any:
    """A collate function that returns its input (for data sets that batch in ``__getitems__``)."""
    return batch


def light_uint8_collate(items: list[tuple[torch.Tensor, int]]) -> tuple[torch.Tensor, list[int]]:
    """A lighter collate for uint8 images: one shared-memory tensor per batch, labels as a plain list.

    ``default_collate`` turns the labels into a second tensor, and every tensor
    crosses the process boundary with its own shared-memory handle that the
    main process must open and map. Here only the images do; the labels are a
    tiny pickled list (turn them into a tensor on the main side with
    ``torch.as_tensor`` when needed).
    """
    images = _stack([x for x, _ in items])
    return images, [int(y) for _, y in items]


def _spin(seconds: float) -> None:
    """Burn ``seconds`` of this thread's CPU time (not wall time: on a busy machine it takes longer)."""
    end = time.thread_time() + seconds
    x = 0
    while time.thread_time() < end:
        x += 1


class SpinDataset(Dataset):
    """Wrap a data set and add ``extra_ms`` of CPU time per item (a stand-in for heavier augmentation).

    The work is a busy loop, so it competes for cores exactly like real
    augmentation would (``time.sleep`` would not).
    """

    def __init__(self, base: Dataset, extra_ms: float) -> None:
        self.base = base
        self.extra_ms = check_float("extra_ms", extra_ms, 0.0, 1000.0)

    def __len__(self) -> int:
        return len(self.base)  # type: ignore[arg-type]

    def __getitem__(self, index: int) -> Any:
        item = self.base[index]
        if self.extra_ms > 0:
            _spin(self.extra_ms / 1e3)
        return item


class UnevenDataset(Dataset):
    """Items whose cost is uneven: most take ``fast_ms``, every ``slow_every``-th takes ``slow_ms``.

    The cost is a ``time.sleep`` (think: a slow read from network storage), so
    it does not compete for CPU cores and the effect of ``in_order`` shows
    cleanly even on two cores. Items are small uint8 tensors.
    """

    def __init__(self, n: int, fast_ms: float = 1.0, slow_ms: float = 60.0, slow_every: int = 23) -> None:
        self.n = check_int("n", n, 1, 10_000_000)
        self.fast_ms = check_float("fast_ms", fast_ms, 0.0, 10_000.0)
        self.slow_ms = check_float("slow_ms", slow_ms, 0.0, 10_000.0)
        self.slow_every = check_int("slow_every", slow_every, 1, 10_000_000)

    def __len__(self) -> int:
        return self.n

    def is_slow(self, index: int) -> bool:
        return index % self.slow_every == 0

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        time.sleep((self.slow_ms if self.is_slow(index) else self.fast_ms) / 1e3)
        return torch.full((16,), index % 256, dtype=torch.uint8), index


class FailingDataset(Dataset):
    """Raises ``ValueError`` for one item, to show how a worker's exception reaches the main process."""

    def __init__(self, n: int = 32, bad_index: int = 13) -> None:
        self.n = check_int("n", n, 1, 10_000_000)
        self.bad_index = check_int("bad_index", bad_index, 0, self.n - 1)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        if index == self.bad_index:
            raise ValueError(f"item {index} is damaged (a deliberate failure in FailingDataset.__getitem__)")
        return torch.zeros(4), index


class BadRNGDataset(Dataset):
    """THE BUG: a random generator created in ``__init__``.

    Every worker receives a *copy* of the generator, state included, so all
    workers draw the same "random" augmentation parameters. Items are
    ``(index, worker_id, draw)``.
    """

    def __init__(self, n: int = 64, seed: int = 0) -> None:
        self.n = check_int("n", n, 1, 10_000_000)
        self.rng = np.random.default_rng(seed)  # <- copied into every worker

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> tuple[int, int, float]:
        info = get_worker_info()
        return index, (info.id if info else -1), float(self.rng.random())


class FixedRNGDataset(Dataset):
    """THE FIX: the generator is created lazily, in each process, from that worker's own seed.

    ``get_worker_info().seed`` differs per worker (and per epoch); in the main
    process the fixed ``seed`` is used. Works under fork, spawn and forkserver.
    """

    def __init__(self, n: int = 64, seed: int = 0) -> None:
        self.n = check_int("n", n, 1, 10_000_000)
        self.seed = check_int("seed", seed, 0, 2**63 - 1)
        self._rng: np.random.Generator | None = None
        self._rng_key: tuple[int, int] | None = None

    def __len__(self) -> int:
        return self.n

    def _generator(self) -> np.random.Generator:
        info = get_worker_info()
        key = (os.getpid(), info.seed if info else self.seed)
        if self._rng is None or self._rng_key != key:
            self._rng = np.random.default_rng(key[1])
            self._rng_key = key
        return self._rng

    def __getitem__(self, index: int) -> tuple[int, int, float]:
        info = get_worker_info()
        return index, (info.id if info else -1), float(self._generator().random())

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_rng"] = None
        state["_rng_key"] = None
        return state


def rng_draws(
    dataset: Dataset, *, num_workers: int = 2, batch_size: int = 4, multiprocessing_context: str | None = None
) -> dict[int, list[float]]:
    """Run ``dataset`` (items ``(index, worker_id, draw)``) through workers; draws per worker, in order
    (worker id -1: the main process, with ``num_workers=0``)."""
    cfg = LoaderConfig(
        batch_size=batch_size, num_workers=num_workers, shuffle=False, multiprocessing_context=multiprocessing_context
    )
    loader = build_loader(dataset, cfg)
    out: dict[int, list[float]] = {}
    with open_iterator(loader) as it:
        for _idx, wid, draw in it:
            for w, d in zip(wid.tolist(), draw.tolist()):
                out.setdefault(int(w), []).append(float(d))
    return out


def rng_duplicates(draws: Mapping[int, Sequence[float]]) -> float:
    """Fraction of draws made by workers other than the first that repeat one of worker 0's draws."""
    if len(draws) < 2:
        return 0.0
    ids = sorted(draws)
    first = set(draws[ids[0]])
    others = [d for w in ids[1:] for d in draws[w]]
    return sum(d in first for d in others) / len(others) if others else 0.0


# ---------------------------------------------------------------------------
# Pitfalls: /dev/shm, spawn, worker exceptions
# ---------------------------------------------------------------------------


@dataclass
class ShmStatus:
    """Size of the shared-memory file system DataLoader workers hand batches through."""

    path: str
    exists: bool
    total_bytes: int | None
    free_bytes: int | None
    sharing_strategy: str

    def explain(self, width: int = 105) -> str:
        """Plain-words summary, wrapped at word boundaries to lines of at most ``width`` characters."""
        if not self.exists:
            text = (
                f"{self.path} does not exist here; torch uses the '{self.sharing_strategy}' strategy "
                "for handing batches from workers to the main process."
            )
        else:
            text = (
                f"{self.path}: {human_bytes(self.total_bytes or 0)} in total, {human_bytes(self.free_bytes or 0)} free "
                f"(torch sharing strategy: '{self.sharing_strategy}'). Every batch a worker produces sits there until "
                f"the main process has taken it."
            )
        return textwrap.fill(text, width, break_long_words=False, break_on_hyphens=False)


def shm_status(path: str = "/dev/shm") -> ShmStatus:
    """Size and free space of ``/dev/shm`` (never raises)."""
    strategy = torch.multiprocessing.get_sharing_strategy()
    try:
        usage = shutil.disk_usage(path)
    except OSError:
        return ShmStatus(path, False, None, None, strategy)
    return ShmStatus(path, True, int(usage.total), int(usage.free), strategy)


def shm_needed_bytes(batch_bytes: int, num_workers: int, prefetch_factor: int = 2, margin: float = 2.0) -> int:
    """Shared memory a loader may hold at once: workers x prefetch_factor batches, times a safety margin."""
    check_int("batch_bytes", batch_bytes, 0, 1 << 50)
    check_int("num_workers", num_workers, 0, MAX_WORKERS)
    check_int("prefetch_factor", prefetch_factor, 1, 64)
    check_float("margin", margin, 1.0, 100.0)
    return int(batch_bytes * max(1, num_workers) * prefetch_factor * margin)


def require_shm(needed_bytes: int, path: str = "/dev/shm") -> ShmStatus:
    """Refuse (ValueError) before any worker starts if ``/dev/shm`` has less than ``needed_bytes`` free.

    A worker that runs out of shared memory is killed by SIGBUS ("bus error")
    and the DataLoader reports only that a worker "exited unexpectedly";
    refusing up front explains it instead. Docker gives containers 64 MiB of
    ``/dev/shm`` by default.
    """
    check_int("needed_bytes", needed_bytes, 0, 1 << 50)
    st = shm_status(path)
    if st.exists and st.free_bytes is not None and st.free_bytes < needed_bytes:
        raise ValueError(
            f"{path} has only {human_bytes(st.free_bytes)} free, but this loader may hold about "
            f"{human_bytes(needed_bytes)} of batches there (workers x prefetch_factor x batch bytes, x2 margin). "
            f"Workers would die with a bus error. Fix: in Docker start the container with --shm-size=2g "
            f"(or --ipc=host); or lower num_workers, prefetch_factor or batch_size; or call "
            f"torch.multiprocessing.set_sharing_strategy('file_system')."
        )
    return st


@contextlib.contextmanager
def _capture_fd2() -> Iterator[Callable[[], str]]:
    """Redirect file descriptor 2 (inherited by child processes) into a temporary file."""
    import sys

    with tempfile.TemporaryFile(mode="w+b") as tmp:
        try:
            sys.stderr.flush()
        except Exception:
            pass
        saved = os.dup(2)
        os.dup2(tmp.fileno(), 2)
        text: list[str] = []
        try:
            yield lambda: "".join(text)
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            text.append(tmp.read().decode("utf-8", "replace"))


@dataclass
class SpawnOutcome:
    """What happened when a loader ran with a given start method."""

    context: str
    ok: bool
    error_type: str | None
    message: str
    child_error: str | None
    seconds: float


def spawn_failure_demo(dataset: Dataset, *, context: str = "spawn", timeout_s: float = 30.0) -> SpawnOutcome:
    """Try one batch from ``dataset`` with one worker started by ``context``; report, never hang or leak.

    A data set class defined in a notebook cell lives in ``__main__``; a
    spawn/forkserver worker is a fresh interpreter that cannot import it, so it
    dies while unpickling the data set. The worker's own error message goes to
    its stderr, which this function captures and returns as ``child_error``
    (e.g. ``AttributeError: Can't get attribute 'MyData' on <module ...>``).

    Args:
        dataset: the data set to try.
        context: "spawn", "forkserver" or "fork".
        timeout_s: the DataLoader's timeout (1-600 s): the demo can't hang longer.
    """
    check_choice("context", context, [m for m in START_METHODS if m])
    timeout_s = check_float("timeout_s", timeout_s, 1.0, 600.0)
    cfg = LoaderConfig(batch_size=2, num_workers=1, shuffle=False, timeout=timeout_s, multiprocessing_context=context)
    loader = build_loader(dataset, cfg)
    t0 = time.perf_counter()
    err: BaseException | None = None
    with _capture_fd2() as captured:
        try:
            with open_iterator(loader) as it:
                next(it)
        except Exception as exc:  # the failure is the point of the demo
            err = exc
        # give a dying child a moment to flush its traceback
        time.sleep(0.05)
    child_text = captured()
    found = re.findall(r"^(\w+(?:Error|Exception)): (.*)$", child_text, flags=re.M)
    child_error = f"{found[-1][0]}: {found[-1][1]}" if found else None
    return SpawnOutcome(
        context=context,
        ok=err is None,
        error_type=type(err).__name__ if err else None,
        message=str(err).strip() if err else "one batch loaded fine",
        child_error=child_error,
        seconds=time.perf_counter() - t0,
    )


def worker_error_demo(dataset: Dataset | None = None, *, num_workers: int = 2) -> tuple[str, str]:
    """Load from a data set whose item raises in a worker; return torch's ``(exception type, message)``.

    The DataLoader re-raises the worker's exception in the main process, of
    the same type, with the worker's traceback in the message ("Caught
    ValueError in DataLoader worker process 1. Original Traceback ...").
    :func:`open_iterator` turns it into a :class:`LoaderFailure` in plain words
    (:func:`explain_loader_error`); this returns torch's own error, kept as its cause.
    """
    ds = dataset if dataset is not None else FailingDataset()
    cfg = LoaderConfig(batch_size=4, num_workers=check_int("num_workers", num_workers, 1, MAX_WORKERS), shuffle=False)
    loader = build_loader(ds, cfg)
    try:
        with open_iterator(loader) as it:
            for _ in it:
                pass
    except Exception as exc:
        raw = exc.__cause__ if isinstance(exc, LoaderFailure) and exc.__cause__ is not None else exc
        return type(raw).__name__, str(raw)
    return "none", "no worker raised"


# ---------------------------------------------------------------------------
# Chapter 04: workers
# ---------------------------------------------------------------------------


@dataclass
class WorkerSweep:
    """Throughput against ``num_workers`` (one :class:`Throughput` per point)."""

    workers: list[int]
    results: list[Throughput]
    cores: int

    @property
    def items_per_s(self) -> list[float]:
        return [r.items_per_s for r in self.results]

    def at(self, n: int) -> Throughput:
        return self.results[self.workers.index(n)]

    @property
    def baseline(self) -> float:
        """Throughput of the single-process loader (``num_workers=0``), or of the fewest workers measured."""
        return self.results[self.workers.index(min(self.workers))].items_per_s

    def speedup(self, n: int) -> float:
        return self.at(n).items_per_s / self.baseline

    def efficiency(self, n: int) -> float:
        """Speedup divided by the ideal speedup ``max(n, 1)`` (1.0 = perfectly linear)."""
        return self.speedup(n) / max(n, 1)

    @property
    def best_workers(self) -> int:
        """The worker count with the highest measured throughput (one measurement each: see :meth:`notes`)."""
        return self.workers[int(np.argmax(self.items_per_s))]

    def notes(self, rounds: "SpeedupRounds | None" = None) -> list[str]:
        """Flags for figures a reader should not take at face value (empty: nothing to flag).

        * an efficiency above 100% (``n`` workers more than ``n`` times the single process: the
          workers=0 row ran slower than a core can, e.g. on a busy machine);
        * ``rounds`` (the speed-up measured in alternating rounds) contradicting ``best_workers``
          from this one-shot sweep.
        """
        out = []
        for n in self.workers:
            if n > 0 and self.efficiency(n) > 1.0:
                out.append(
                    f"num_workers={n} measured {100 * self.efficiency(n):.0f}% efficiency (over 100%): the "
                    f"single-process row was slow in this one-shot sweep (a busy machine, or more main-process "
                    f"threads than one); compare in alternating rounds (interleaved_speedup)"
                )
        if rounds is not None and rounds.ratios and rounds.num_workers in self.workers:
            lo, _hi = rounds.spread
            if self.best_workers == 0 and lo > 1.0:
                out.append(
                    f"contradiction: the one-shot sweep found num_workers=0 best, but every alternating round "
                    f"gave {rounds.num_workers} workers more ({rounds.speedup:.2f}x median): trust the rounds"
                )
            elif self.best_workers == rounds.num_workers and _hi < 1.0:
                out.append(
                    f"contradiction: the one-shot sweep found num_workers={rounds.num_workers} best, but every "
                    f"alternating round gave it less than the single process: trust the rounds"
                )
        return out

    def rule_of_thumb(self) -> int:
        """The "half the cores" rule for this machine."""
        return max(1, self.cores // 2)

    def table(self) -> list[str]:
        lines = [f"{'workers':>7} {'items/s':>9} {'speedup':>8} {'efficiency':>10} {'startup':>8}"]
        for n, r in zip(self.workers, self.results):
            lines.append(
                f"{n:>7} {r.items_per_s:>9,.0f} {self.speedup(n):>7.2f}x {100 * self.efficiency(n):>9.0f}% "
                f"{r.startup_s:>7.2f}s"
            )
        return lines


def sweep_workers(
    dataset: "Dataset | Callable[[int], DataLoader]",
    workers: Sequence[int],
    *,
    batch_size: int = 32,
    batches: int = 40,
    warmup: int = 4,
    persistent: bool = True,
    prefetch_factor: int | None = None,
    collate_fn: Callable[[Any], Any] | None = None,
    progress: Callable[..., Any] | None = None,
    main_threads: int = 1,
) -> WorkerSweep:
    """Measure steady-state throughput for each ``num_workers`` (persistent workers, so epoch ends don't restart them).

    ``dataset`` is either your loader factory - a function of the worker count that returns your
    DataLoader, e.g. ``lambda w: make_loader(ds, 32, workers=w)`` - or a data set (then the loaders are
    built here from ``batch_size``, ``persistent``, ``prefetch_factor`` and ``collate_fn``, which a factory
    ignores: it decides them itself). A factory's loaders get the workbook's safety (:func:`guard`) and
    are released after each point, also on an interrupt.

    The main process runs with ``main_threads`` intra-op threads during the sweep (default 1, as in every
    worker), set here where the measurement is made: otherwise the workers=0 row would use all cores and
    a 1-worker row could show more than 100% "efficiency".
    """
    try:
        ws = [check_int(f"workers[{i}]", w, 0, MAX_WORKERS) for i, w in enumerate(workers)]
    except TypeError:
        raise ValueError(f"workers must be a list of integers in [0, {MAX_WORKERS}], got {workers!r}") from None
    if not ws or len(set(ws)) != len(ws):
        raise ValueError(
            f"workers must be a non-empty list of distinct integers in [0, {MAX_WORKERS}], got {list(workers)}"
        )
    _check_bool("persistent", persistent)
    results = []
    with intraop_threads(check_int("main_threads", main_threads, 1, 1024)):
        for k, n in enumerate(ws):
            if _is_factory(dataset):
                if progress is not None:
                    progress(k / len(ws), f"num_workers={n} ({k + 1} of {len(ws)})")
                results.append(
                    measure_throughput(
                        build_from_factory(dataset, n, expect={"num_workers": n}), batches=batches, warmup=warmup
                    )
                )
                continue
            cfg = LoaderConfig(
                batch_size=batch_size,
                num_workers=n,
                persistent_workers=persistent and n > 0,
                prefetch_factor=prefetch_factor if n > 0 else None,
            )
            if progress is not None:
                progress(k / len(ws), f"num_workers={n} ({k + 1} of {len(ws)})")
            results.append(measure_config(dataset, cfg, batches=batches, warmup=warmup, collate_fn=collate_fn))
        if progress is not None:
            progress(1.0, "done")
    return WorkerSweep(workers=ws, results=results, cores=cpu_cores())


def plot_sweep(sw: WorkerSweep, axes: Sequence[Any] | None = None, title: str = "") -> Any:
    """Two panels: throughput with the ideal linear line and the core-count ceiling; scaling efficiency."""
    import matplotlib.pyplot as plt

    if axes is None:
        fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    ax1, ax2 = axes
    base = sw.baseline
    xs = sw.workers
    ax1.plot(xs, sw.items_per_s, "o-", color="#4e79a7", label="measured")
    ax1.plot(xs, [base * max(n, 1) for n in xs], ":", color="#59a14f", label="ideal: each worker as fast as workers=0")
    ax1.axhline(
        base * sw.cores,
        color="#444",
        linestyle="--",
        linewidth=1,
        label=f"core-count ceiling ({sw.cores} cores x workers=0 rate)",
    )
    ax1.axvline(
        sw.rule_of_thumb(),
        color="#e15759",
        alpha=0.4,
        linewidth=6,
        label=f"'half the cores' rule: {sw.rule_of_thumb()}",
    )
    ax1.set_xlabel("num_workers")
    ax1.set_ylabel("throughput (items/s)")
    ax1.set_xticks(xs)
    ax1.set_ylim(bottom=0)
    ax1.set_title(title or "Loader throughput vs num_workers")
    ax1.legend(fontsize=8, loc="upper left")
    ax1.grid(alpha=0.3)
    eff_x = [n for n in xs if n > 0]
    ax2.bar([str(n) for n in eff_x], [100 * sw.efficiency(n) for n in eff_x], color="#f28e2b")
    ax2.axhline(100, color="#59a14f", linestyle=":", label="linear scaling")
    ax2.set_xlabel("num_workers")
    ax2.set_ylabel("scaling efficiency (%)\n= speedup / num_workers")
    ax2.set_title("Scaling efficiency vs workers=0")
    ax2.legend(fontsize=8)
    ax2.grid(axis="y", alpha=0.3)
    return axes


# ---------------------------------------------------------------------------
# A fair speed-up figure: interleaved rounds, and the machine's own parallel ceiling
# ---------------------------------------------------------------------------


def _ceiling_task(args: tuple[Any, int, int, Any, float, float]) -> tuple[int, float]:
    """One process of :func:`parallel_ceiling`: load and collate batches in a loop for ``seconds``; (items, seconds)."""
    dataset, offset, batch_size, collate_fn, start_at, seconds = args
    torch.set_num_threads(1)
    collate = collate_fn if collate_fn is not None else default_collate
    while time.time() < start_at:  # all processes start together
        time.sleep(0.0005)
    n = len(dataset)
    k = 0
    t0 = time.perf_counter()
    while True:
        collate([dataset[(offset + k + j) % n] for j in range(batch_size)])
        k += batch_size
        dt = time.perf_counter() - t0
        if dt >= seconds:
            return k, dt


def parallel_ceiling(
    dataset: Dataset,
    processes: int = 2,
    seconds: float = 1.0,
    *,
    batch_size: int = 32,
    collate_fn: Callable[[Any], Any] | None = None,
    pool: Any = None,
) -> float:
    """Items/s that ``processes`` independent processes reach together, each loading and collating batches.

    Each process does exactly what ``num_workers=0`` does in the main process -
    ``collate_fn([dataset[i] for i in batch])`` - but with no loader around it: no
    queues, no shared memory, no main process to feed. That is the most
    ``num_workers=processes`` can deliver on this machine right now - the
    *measured* core-count ceiling. On a laptop with turbo boost, on a VM whose
    virtual cores share physical ones, or next to other programs it is below
    ``processes`` x the single-process rate.

    Args:
        dataset: a map-style data set (picklable; from an importable module under spawn).
        processes: how many processes (1-64).
        seconds: how long each one runs (0.05-600); at least one batch is always completed.
        batch_size: items per batch (1-65536).
        collate_fn: default ``torch.utils.data.default_collate``.
        pool: an open ``multiprocessing`` pool with ``processes`` processes to reuse; default: one is
            started for this call and terminated afterwards (also on ``KeyboardInterrupt``).
    """
    processes = check_int("processes", processes, 1, MAX_WORKERS)
    seconds = check_float("seconds", seconds, 0.05, 600.0)
    batch_size = check_int("batch_size", batch_size, 1, 65536)
    own = pool is None
    try:
        if own:
            pool = start_pool(processes)
        n = max(1, len(dataset))  # type: ignore[arg-type]
        start_at = time.time() + 0.05
        tasks = [(dataset, (i * n) // processes, batch_size, collate_fn, start_at, seconds) for i in range(processes)]
        # Bounded: a task that never returns (a frozen process) ends the call instead of hanging it.
        done = pool.map_async(_ceiling_task, tasks, chunksize=1).get(timeout=seconds + WORKER_TIMEOUT_S)
    except mp.TimeoutError:
        raise LoaderFailure(
            f"parallel_ceiling: the {processes} processes did not report within "
            f"{seconds + WORKER_TIMEOUT_S:g} s (a frozen or starved process); "
            "they were stopped"
        ) from None
    finally:
        if own and pool is not None:
            close_pool(pool)
    return sum(k / dt for k, dt in done)


def _pool_initializer() -> None:
    reset_child_signals()
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})


def start_pool(processes: int) -> Any:
    """A ``multiprocessing`` pool whose processes never run the parent's signal handlers.

    SIGINT and SIGTERM are blocked in this thread while the pool forks, so a child can't receive
    one before its initializer has reset the handlers (:func:`reset_child_signals`) and unblocked them.
    Close it with :func:`close_pool`.
    """
    processes = check_int("processes", processes, 1, MAX_WORKERS)
    with _HeldSignals() as held:  # a Ctrl-C during the forks is noted, not lost in an at-fork callback
        old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
        try:
            pool = mp.get_context().Pool(processes, initializer=_pool_initializer)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)
    try:
        held.deliver()
    except BaseException:
        close_pool(pool)
        raise
    return pool


def close_pool(pool: Any, grace_s: float = SHUTDOWN_GRACE_S) -> None:
    """``pool.terminate()`` + ``join()``, with a bounded wait: after ``grace_s`` the processes are killed.

    ``terminate()`` can block for ever on a queue lock that a misbehaving process holds; it runs in a
    helper thread here, and killing the processes releases what they held. An interrupt that arrives
    meanwhile is re-raised after the processes are gone.
    """
    import multiprocessing.pool as mp_pool

    handler = getattr(pool, "_worker_handler", None)
    if handler is not None:  # stop the pool replacing workers that exit while it closes (they would be missed)
        handler._state = mp_pool.TERMINATE
    procs = list(getattr(pool, "_pool", []) or [])

    def terminate() -> None:
        with contextlib.suppress(Exception):
            pool.terminate()
            pool.join()

    pending: BaseException | None = None
    t = threading.Thread(target=terminate, name="workbook-pool-close", daemon=True)
    t.start()
    for _attempt in range(4):
        try:
            t.join(grace_s)
            if t.is_alive():
                _stop_processes(procs, grace_s=0.0)
                t.join(grace_s)
            # A worker the pool started while it was closing is not in ``procs``: forked while another
            # thread held a lock, it can sit on that lock for ever (an orphan after the run). Stop it too.
            late = [p for p in list(getattr(pool, "_pool", []) or []) if all(p is not q for q in procs)]
            _stop_processes(procs + late, grace_s=0.5)
            break
        except KeyboardInterrupt as exc:
            pending = exc
    if pending is not None:
        raise pending


class _Batches:
    """Take batches from a loader across epoch ends (persistent workers carry on); close() releases the workers."""

    def __init__(self, loader: DataLoader) -> None:
        self.loader = loader
        self.it: Iterator[Any] | None = None

    def take(self, count: int) -> tuple[int, float]:
        """Take ``count`` batches; returns (items, seconds)."""
        items = 0
        t0 = time.perf_counter()
        for _ in range(count):
            if self.it is None:
                self.it = iter(self.loader)
            try:
                batch = next(self.it)
            except StopIteration:
                self.it = iter(self.loader)
                batch = next(self.it)
            items += _batch_len(batch)
        return items, time.perf_counter() - t0

    def objs(self) -> list[Any]:
        """What :func:`_finish` must release."""
        return [x for x in (self.it, self.loader) if x is not None]

    def close(self) -> None:
        _finish(self.objs())


@dataclass
class SpeedupRounds:
    """Single process vs ``num_workers`` workers (and the measured ceiling), measured in alternating rounds.

    Attributes:
        num_workers: workers in the compared loader (persistent).
        batch_size: items per batch.
        single: items/s of ``num_workers=0`` in each round.
        workers: items/s of the worker loader in each round.
        ceiling: items/s of :func:`parallel_ceiling` (``num_workers`` processes) in each round; empty if not measured.
        cores: CPU cores this process may use.
        seconds: wall time of the whole measurement.
    """

    num_workers: int
    batch_size: int
    single: list[float]
    workers: list[float]
    ceiling: list[float]
    cores: int
    seconds: float

    @property
    def ratios(self) -> list[float]:
        """Per-round speed-up: workers / single, from measurements taken seconds apart."""
        return [w / s for w, s in zip(self.workers, self.single)]

    @property
    def speedup(self) -> float:
        """Median of the per-round speed-ups."""
        return statistics.median(self.ratios)

    @property
    def spread(self) -> tuple[float, float]:
        """(lowest, highest) per-round speed-up."""
        return min(self.ratios), max(self.ratios)

    @property
    def ceiling_speedup(self) -> float:
        """Median per-round ceiling / single: what ``num_workers`` cores give at best here (nan if not measured)."""
        if not self.ceiling:
            return float("nan")
        return statistics.median(c / s for c, s in zip(self.ceiling, self.single))

    @property
    def share_of_ceiling(self) -> float:
        """Median per-round workers / ceiling: how much of the machine's parallel capacity the loader gets."""
        if not self.ceiling:
            return float("nan")
        return statistics.median(w / c for w, c in zip(self.workers, self.ceiling))

    def notes(self) -> list[str]:
        """Flags for impossible-looking figures (empty: nothing to flag).

        The ceiling is a measurement too, taken next to the loader's: when the loader beats it
        (a share above 100%), the ceiling run was disturbed and is not an upper bound in this run.
        """
        out = []
        if self.ceiling and self.share_of_ceiling > 1.0:
            out.append(
                f"the loader measured {self.share_of_ceiling:.0%} of the measured ceiling (over 100%): the "
                f"ceiling runs were slowed by something else on this machine, so here they are no upper bound "
                f"(noise); re-run on a quieter machine"
            )
        if self.ceiling and self.ceiling_speedup > self.num_workers * 1.05:
            out.append(
                f"the ceiling of {self.num_workers} processes measured {self.ceiling_speedup:.2f}x one process "
                f"(more than {self.num_workers}x): the single-process rounds ran slow (noise)"
            )
        return out

    def table(self) -> list[str]:
        head = f"{'round':>5} {'workers=0':>10} {f'workers={self.num_workers}':>10} {'speed-up':>8}"
        if self.ceiling:
            head += f" {f'{self.num_workers} procs':>10} {'ceiling':>8} {'share':>6}"
        lines = [head + "   (items/s)"]
        for k, (s, w) in enumerate(zip(self.single, self.workers)):
            line = f"{k + 1:>5} {s:>10,.0f} {w:>10,.0f} {w / s:>7.2f}x"
            if self.ceiling:
                c = self.ceiling[k]
                line += f" {c:>10,.0f} {c / s:>7.2f}x {w / c:>6.0%}"
            lines.append(line)
        return lines

    def summary(self) -> str:
        lo, hi = self.spread
        text = (
            f"{self.num_workers} persistent workers: {self.speedup:.2f}x the single-process throughput (median of "
            f"{len(self.ratios)} rounds, range {lo:.2f}-{hi:.2f}x)."
        )
        if self.ceiling:
            text += (
                f" {self.num_workers} independent processes loading and collating the same batches reach "
                f"{self.ceiling_speedup:.2f}x: the measured ceiling. "
                f"The loader gets {self.share_of_ceiling:.0%} of it."
            )
        for note in self.notes():
            text += f" Note: {note}."
        return text

    def to_dict(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "speedup": self.speedup,
            "ceiling_speedup": self.ceiling_speedup,
            "share_of_ceiling": self.share_of_ceiling,
            "notes": self.notes(),
        }


def interleaved_speedup(
    dataset: "Dataset | Callable[[int], DataLoader]",
    num_workers: int = 2,
    *,
    rounds: int = 5,
    batches: int = 30,
    batch_size: int = 32,
    warmup: int = 4,
    prefetch_factor: int | None = None,
    ceiling: bool = True,
    collate_fn: Callable[[Any], Any] | None = None,
    progress: Callable[..., Any] | None = None,
) -> SpeedupRounds:
    """Measure the worker speed-up in alternating rounds, so that drift in the machine's speed cancels out.

    A sequential comparison (all of ``num_workers=0``, then all of the worker
    loader) is at the mercy of the machine's speed at the time: on a shared or
    turbo-boosting CPU the single-core rate moves by a third within seconds.
    Here each round measures, back to back: ``batches`` batches in one process,
    (optionally) :func:`parallel_ceiling` (the same batches, collated the same way,
    in ``num_workers`` independent processes) for as long, then ``batches`` batches
    from the worker loader. The speed-up of each round compares measurements
    taken seconds apart; the result is their median.

    The worker loader is built once, with persistent workers, and warmed up. While
    the single-process window runs, its workers sit idle with full buffers, so the
    ``num_workers x prefetch_factor`` batches they hold are taken (untimed) before
    each timed window. The main process uses one intra-op thread throughout.

    ``dataset`` is either your loader factory (a function of the worker count: ``factory(0)`` is the
    single-process loader, ``factory(num_workers)`` the worker loader; give it persistent workers), or a
    data set (then both loaders are built here from ``batch_size``, ``prefetch_factor`` and ``collate_fn``).
    With a factory, the ceiling runs the worker loader's own data set, collate function and batch size,
    and its ``prefetch_factor`` sets how many buffered batches are taken before each window.

    Raises:
        ValueError: bad arguments, or too little ``/dev/shm`` (checked before any worker starts).
    """
    num_workers = check_int("num_workers", num_workers, 1, MAX_WORKERS)
    rounds = check_int("rounds", rounds, 1, 1000)
    batches = check_int("batches", batches, 1, 1_000_000)
    warmup = check_int("warmup", warmup, 0, 1_000_000)
    single: list[float] = []
    workers: list[float] = []
    ceil: list[float] = []
    t_start = time.perf_counter()
    if _is_factory(dataset):
        # your loaders, with the workbook's safety (guard: /dev/shm checked before any worker starts)
        one = _Batches(build_from_factory(dataset, 0, expect={"num_workers": 0}))
        many = _Batches(
            build_from_factory(dataset, num_workers, expect={"num_workers": num_workers, "persistent_workers": True})
        )
        dataset, collate_fn = many.loader.dataset, many.loader.collate_fn
        batch_size, prefetch_factor = int(many.loader.batch_size or 1), many.loader.prefetch_factor
    else:
        single_cfg = LoaderConfig(batch_size=batch_size)
        worker_cfg = single_cfg.replace(
            num_workers=num_workers, persistent_workers=True, prefetch_factor=prefetch_factor
        )
        worker_cfg.validated()
        # build_loader checks /dev/shm before any worker starts
        one = _Batches(build_loader(dataset, single_cfg, collate_fn=collate_fn))
        many = _Batches(build_loader(dataset, worker_cfg, collate_fn=collate_fn))
    buffered = num_workers * (prefetch_factor or 2)
    with intraop_threads(1), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*suggested max number of worker.*")
        pool = None
        before = _worker_children()
        try:
            one.take(max(1, warmup))
            many.take(warmup + buffered)
            if ceiling:
                pool = start_pool(num_workers)
            for r in range(rounds):
                items, secs = one.take(batches)
                single.append(items / secs)
                if pool is not None:
                    ceil.append(
                        parallel_ceiling(
                            dataset,
                            num_workers,
                            max(0.05, secs),
                            batch_size=batch_size,
                            collate_fn=collate_fn,
                            pool=pool,
                        )
                    )
                many.take(buffered)  # prepared while idle: not part of the steady state
                items, secs = many.take(batches)
                workers.append(items / secs)
                if progress is not None:
                    progress((r + 1) / rounds, f"round {r + 1}/{rounds}")
        finally:
            try:
                if pool is not None:
                    close_pool(pool)
            finally:
                _finish([*many.objs(), *one.objs()], before)
    return SpeedupRounds(
        num_workers=num_workers,
        batch_size=batch_size,
        single=single,
        workers=workers,
        ceiling=ceil,
        cores=cpu_cores(),
        seconds=time.perf_counter() - t_start,
    )


def plot_rounds(sr: SpeedupRounds, ax: Any = None, title: str = "") -> Any:
    """Items/s per round: one process, the worker loader, and (if measured) the measured ceiling."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(8, 3.4))
    xs = list(range(1, len(sr.single) + 1))
    if sr.ceiling:
        ax.plot(xs, sr.ceiling, "s--", color="#444", label=f"ceiling: {sr.num_workers} independent processes")
    ax.plot(xs, sr.workers, "o-", color="#f28e2b", label=f"loader, num_workers={sr.num_workers} (persistent)")
    ax.plot(xs, sr.single, "o-", color="#4e79a7", label="loader, num_workers=0")
    ax.set_xticks(xs)
    ax.set_xlabel("round (each measures all series back to back)")
    ax.set_ylabel("throughput (items/s)")
    ax.set_ylim(bottom=0)
    ax.set_title(title or f"Speed-up in alternating rounds: median {sr.speedup:.2f}x")
    ax.legend(fontsize=8, loc="lower right")
    ax.grid(alpha=0.3)
    return ax


@dataclass
class KnobResult:
    """One knob changed against a fixed baseline."""

    knob: str
    values: list[Any]
    results: list[Throughput]
    base: LoaderConfig

    def rows(self) -> list[tuple[Any, Throughput]]:
        return list(zip(self.values, self.results))

    def table(self) -> list[str]:
        out = [f"baseline: {_label_without(self.base, self.knob)}; changing {self.knob}"]
        for v, r in self.rows():
            out.append(
                f"  {self.knob}={v!s:<6} {r.items_per_s:>9,.0f} items/s  mean wait {r.mean_wait_ms:6.2f} ms  "
                f"p95 wait {r.p95_wait_ms:6.2f} ms"
            )
        return out


def knob_experiment(
    dataset: "Dataset | Callable[[Any], DataLoader]",
    knob: str,
    values: Sequence[Any],
    *,
    base: LoaderConfig | None = None,
    batches: int = 40,
    warmup: int = 4,
    collate_fn: Callable[[Any], Any] | None = None,
    progress: Callable[..., Any] | None = None,
) -> KnobResult:
    """Measure ``base`` with ``knob`` set to each of ``values`` (everything else unchanged).

    ``dataset`` is either your loader factory - a function of the knob's value that returns your
    DataLoader, e.g. ``lambda pf: make_loader(ds, 32, workers=2, prefetch_factor=pf)``; ``base`` is then
    not needed (it is read from the first loader) - or a data set, measured with ``base`` changed in
    ``knob``. A factory must really change the knob: a loader whose ``knob`` differs from the value asked
    for is refused (ValueError).
    """
    if _is_factory(dataset):
        return _knob_factory(dataset, knob, values, batches=batches, warmup=warmup, progress=progress)
    if base is None:
        raise ValueError("base: give the baseline LoaderConfig when measuring a data set (or pass a loader factory)")
    if knob not in asdict(base):
        raise ValueError(f"knob must be one of {sorted(asdict(base))}, got {knob!r}")
    if not values:
        raise ValueError("values must hold at least one setting")
    results = []
    for k, v in enumerate(values):
        cfg = base.replace(**{knob: v})
        results.append(measure_config(dataset, cfg, batches=batches, warmup=warmup, collate_fn=collate_fn))
        if progress is not None:
            progress((k + 1) / len(values), f"{knob}={v}")
    return KnobResult(knob=knob, values=list(values), results=results, base=base)


# ---------------------------------------------------------------------------
# Two measurements of one thing: do they agree within their spread?
# ---------------------------------------------------------------------------

#: What the verdict says when a one-pass figure falls outside the alternating rounds' range.
TRUST_ROUNDS = (
    "trust the alternating rounds (each round compares the two settings under the same load; "
    "the one-pass sweep measures each setting once, at different moments)"
)


def within_spread(value: float, samples: Sequence[float]) -> bool:
    """The verdict: whether ``value`` lies within the spread of ``samples`` (their lowest to highest, inclusive).

    The one small rule behind every "agree / disagree" line of chapter 04: a figure with no spread of its own
    (a one-pass measurement; or 1.0, "no difference") is compared with the range of repeated measurements
    of the same thing (alternating rounds), which serves as the noise band: :func:`helpers.core.agreement.within_range`.

    Raises:
        ValueError: no samples, or a value/sample that is not a finite number.
    """
    return agreement.within_range(value, samples)


def agreement_line(num_workers: int, one_pass: float, rounds: Sequence[float]) -> str:
    """The verdict on one speed-up measured twice: once in a one-pass sweep, and per round in alternating rounds.

    ``one_pass`` has no spread of its own; the rounds' range (``rounds``: per-round speed-ups, or just their
    lowest and highest) is the noise band (:func:`within_spread`). Ends in "agree within their spread" or
    "disagree: " + :data:`TRUST_ROUNDS`.
    """
    lo, hi = min(rounds), max(rounds)
    verdict = "agree within their spread" if within_spread(one_pass, rounds) else f"disagree: {TRUST_ROUNDS}"
    return (
        f"num_workers={num_workers}: one-pass sweep {one_pass:.2f}x (one measurement, no spread of its own) vs "
        f"alternating rounds {statistics.median(rounds):.2f}x (range {lo:.2f}-{hi:.2f}x over the rounds, "
        f"the noise band): {verdict}"
    )


def difference_line(knob: str, value: Any, reference: Any, ratios: Sequence[float], rounds: int) -> str:
    """The verdict on ``knob=value`` against ``knob=reference`` from per-round ratios (value / reference).

    The noise is estimated from the rounds themselves: if 1.0 ("no difference") lies within the ratios' range
    (:func:`helpers.core.agreement.ratios_straddle_one`), the two settings can't be told apart here ("within the
    noise"); otherwise "a real difference" (every round on the same side), with how often two equal settings would
    do that by chance.
    ``ratios`` may be every per-round ratio or just their lowest and highest (with ``rounds`` their count).
    """
    lo, hi = min(ratios), max(ratios)
    head = (
        f"{knob}={value} vs {reference}: {statistics.median(ratios):.2f}x (per-round ratios over {rounds} rounds, "
        f"range {lo:.2f}-{hi:.2f}x)"
    )
    if agreement.ratios_straddle_one(ratios):
        return f"{head}: within the noise (the rounds' range includes 1.00x): no difference shown"
    side = "faster" if lo > 1.0 else "slower"
    chance = round(1 / (2 * 0.5 ** max(1, rounds)))
    return (
        f"{head}: a real difference ({side} in all {rounds} rounds; two equal settings would do that by chance "
        f"1 time in {chance})"
    )


def sweep_vs_rounds(sweep: "WorkerSweep", rounds: "SpeedupRounds | Sequence[SpeedupRounds]") -> list[str]:
    """:func:`agreement_line` for every worker count that both the one-pass ``sweep`` and alternating ``rounds``
    measured (the sweep must include ``num_workers=0``, its baseline)."""
    out = []
    for sr in [rounds] if isinstance(rounds, SpeedupRounds) else list(rounds):
        if sr.ratios and sr.num_workers in sweep.workers and min(sweep.workers) == 0:
            out.append(agreement_line(sr.num_workers, sweep.speedup(sr.num_workers), sr.ratios))
    return out


@dataclass
class KnobRounds:
    """One knob's values measured in alternating rounds: ``rates[v]`` holds items/s of value ``v``, one per round."""

    knob: str
    values: list[Any]
    rates: dict[Any, list[float]]
    reference: Any
    seconds: float

    def ratios(self, value: Any) -> list[float]:
        """Per-round items/s of ``value`` over the reference value's, measured seconds apart."""
        return [a / b for a, b in zip(self.rates[value], self.rates[self.reference])]

    def median(self, value: Any) -> float:
        return statistics.median(self.rates[value])

    def table(self) -> list[str]:
        n = len(self.rates[self.reference])
        lines = [f"{self.knob:>16} {'items/s (median)':>17} {'per round':>30}   ({n} alternating rounds)"]
        for v in self.values:
            rounds = " ".join(f"{r:,.0f}" for r in self.rates[v])
            lines.append(f"{v!s:>16} {self.median(v):>17,.0f} {rounds:>30}")
        return lines

    def verdicts(self) -> list[str]:
        """One :func:`difference_line` per value against the reference: within the noise, or a real difference."""
        n = len(self.rates[self.reference])
        return [
            difference_line(self.knob, v, self.reference, self.ratios(v), n) for v in self.values if v != self.reference
        ]


def knob_rounds(
    factory: Callable[[Any], DataLoader],
    knob: str,
    values: Sequence[Any],
    *,
    reference: Any = None,
    rounds: int = 3,
    batches: int = 20,
    warmup: int = 4,
    progress: Callable[..., Any] | None = None,
) -> KnobRounds:
    """Measure your loader at each of a knob's ``values`` in alternating rounds, like :func:`interleaved_speedup`.

    ``factory(value)`` builds your loader with the knob at ``value`` (persistent workers). All loaders are built
    once and warmed up; each round then times ``batches`` batches of each, one after another (each round starting
    with the next value, so that none always goes first), so that every round compares the values under the same
    load. Before each timed window the batches an idle loader's
    workers buffered (``num_workers x prefetch_factor``) are taken untimed. ``reference`` (default: the first
    value) is what :meth:`KnobRounds.verdicts` compares against. Workers are released at the end, also when
    interrupted.

    Raises:
        ValueError: bad arguments, a factory that ignores the value, or too little ``/dev/shm``.
    """
    if not isinstance(knob, str) or not knob:
        raise ValueError(f"knob must name what the factory's argument changes, e.g. 'prefetch_factor'; got {knob!r}")
    values = list(values)
    if len(values) < 2:
        raise ValueError("values must hold at least two settings to compare")
    reference = values[0] if reference is None else reference
    if reference not in values:
        raise ValueError(f"reference must be one of {values}, got {reference!r}")
    rounds = check_int("rounds", rounds, 1, 1000)
    batches = check_int("batches", batches, 1, 1_000_000)
    warmup = check_int("warmup", warmup, 0, 1_000_000)
    expect_knob = knob in _LABEL_PART and knob != "multiprocessing_context"
    t_start = time.perf_counter()
    rates: dict[Any, list[float]] = {v: [] for v in values}
    takers: list[_Batches] = []
    before = _worker_children()
    with intraop_threads(1), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*suggested max number of worker.*")
        try:
            for v in values:
                takers.append(_Batches(build_from_factory(factory, v, expect={knob: v} if expect_knob else None)))
            buffered = [t.loader.num_workers * (t.loader.prefetch_factor or 2) for t in takers]
            for t, b in zip(takers, buffered):
                t.take(warmup + b)
            order = list(zip(values, takers, buffered))
            for r in range(rounds):
                k = r % len(order)  # each round starts with the next value: no value always goes first
                for v, t, b in order[k:] + order[:k]:
                    t.take(b)  # prepared while idle: not part of the steady state
                    items, secs = t.take(batches)
                    rates[v].append(items / secs)
                if progress is not None:
                    progress((r + 1) / rounds, f"round {r + 1}/{rounds}")
        finally:
            _finish([x for t in takers for x in t.objs()], before)
    return KnobRounds(knob=knob, values=values, rates=rates, reference=reference, seconds=time.perf_counter() - t_start)


@dataclass
class PersistentResult:
    """Per-epoch wall time and time-to-first-batch, with and without persistent workers."""

    epoch_s: dict[bool, list[float]]
    first_batch_s: dict[bool, list[float]]
    num_workers: int

    def restart_cost_s(self) -> float:
        """Median extra time to the first batch of epochs 2+ when workers are restarted."""
        a = self.first_batch_s[False][1:] or self.first_batch_s[False]
        b = self.first_batch_s[True][1:] or self.first_batch_s[True]
        return statistics.median(a) - statistics.median(b)

    def table(self) -> list[str]:
        out = []
        for p in (False, True):
            ep = ", ".join(f"{s:.2f}" for s in self.epoch_s[p])
            fb = ", ".join(f"{1e3 * s:.0f}" for s in self.first_batch_s[p])
            out.append(f"persistent_workers={p!s:<5}  epoch times (s): {ep}   first batch (ms): {fb}")
        return out


def persistent_experiment(
    dataset: "Dataset | Callable[[bool], DataLoader]",
    *,
    num_workers: int = 2,
    epochs: int = 3,
    batch_size: int = 32,
    multiprocessing_context: str | None = None,
) -> PersistentResult:
    """Run ``epochs`` full epochs with ``persistent_workers`` off, then on, and time each epoch.

    ``dataset`` is either your loader factory - a function of ``persistent`` (False, then True) that
    returns your DataLoader with workers, e.g. ``lambda p: make_loader(ds, 32, workers=2, persistent=p)``;
    ``num_workers``, ``batch_size`` and ``multiprocessing_context`` are then the factory's - or a data set.
    """
    epochs = check_int("epochs", epochs, 1, 100)
    epoch_s: dict[bool, list[float]] = {}
    first: dict[bool, list[float]] = {}
    for persistent in (False, True):
        if _is_factory(dataset):
            loader = build_from_factory(dataset, persistent, expect={"persistent_workers": persistent})
            num_workers = loader.num_workers
            if num_workers < 1:
                release(loader)
                raise ValueError(
                    "persistent_experiment: the loader factory must build a loader with workers "
                    "(num_workers >= 1): persistent_workers only matters with worker processes"
                )
        else:
            cfg = LoaderConfig(
                batch_size=batch_size,
                num_workers=check_int("num_workers", num_workers, 1, MAX_WORKERS),
                persistent_workers=persistent,
                multiprocessing_context=multiprocessing_context,
            )
            loader = build_loader(dataset, cfg)
        epoch_s[persistent], first[persistent] = [], []
        before = _worker_children()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                for _ in range(epochs):
                    t0 = time.perf_counter()
                    t_first = None
                    with open_iterator(loader) if not persistent else contextlib.nullcontext(iter(loader)) as it:
                        for _batch in it:
                            if t_first is None:
                                t_first = time.perf_counter() - t0
                    epoch_s[persistent].append(time.perf_counter() - t0)
                    first[persistent].append(t_first or 0.0)
        finally:
            _finish([loader], before)
    return PersistentResult(epoch_s=epoch_s, first_batch_s=first, num_workers=num_workers)


@dataclass
class InOrderResult:
    """Per-batch waits with ``in_order`` True and False on a data set with uneven items."""

    results: dict[bool, Throughput]
    out_of_order: dict[bool, float]

    def table(self) -> list[str]:
        out = []
        for flag in (True, False):
            r = self.results[flag]
            out.append(
                f"in_order={flag!s:<5}  total {r.seconds:.2f} s  wait: median {1e3 * _pct(r.wait_s, 0.5):5.1f} ms, "
                f"p95 {r.p95_wait_ms:5.1f} ms, max {r.max_wait_ms:6.1f} ms  "
                f"batches out of order {100 * self.out_of_order[flag]:3.0f}%"
            )
        return out


def in_order_experiment(
    dataset: "UnevenDataset | Callable[[bool], DataLoader]",
    *,
    num_workers: int = 2,
    batch_size: int = 4,
    prefetch_factor: int | None = None,
) -> InOrderResult:
    """One epoch (no shuffling) with ``in_order=True`` then ``False``; per-batch waits and how many
    arrived out of order.

    ``prefetch_factor`` defaults to the DataLoader's (2 with workers); with ``num_workers=0`` both runs are
    the same single-process loader (the flag only matters with workers).

    ``dataset`` may instead be your loader factory, a function of ``in_order`` (True, then False) that
    returns your DataLoader, e.g. ``lambda flag: make_loader(uneven, 4, workers=2, in_order=flag)``; its
    items must carry their index as the label (as :class:`UnevenDataset`'s do). Then each run is one epoch
    of your loader, shuffled or not as it is built, and "out of order" is measured against the order its
    sampler hands out the batches in that epoch (see :func:`sampler_batches`).
    """
    if _is_factory(dataset):
        return _in_order_factory(dataset)
    num_workers = check_int("num_workers", num_workers, 0, MAX_WORKERS)
    batch_size = check_int("batch_size", batch_size, 1, 65536)
    n_batches = math.ceil(len(dataset) / batch_size)
    if n_batches < 2:
        raise ValueError(
            f"in_order_experiment needs at least 2 batches: give the data set more than "
            f"batch_size={batch_size} items (it has {len(dataset)})"
        )
    results: dict[bool, Throughput] = {}
    ooo: dict[bool, float] = {}
    for flag in (True, False):
        firsts: list[int] = []

        def note(batch: Any, firsts: list[int] = firsts) -> None:  # loop values bound as defaults (B023)
            firsts.append(int(batch[1][0]))

        cfg = LoaderConfig(
            batch_size=batch_size,
            num_workers=num_workers,
            shuffle=False,
            in_order=flag if num_workers else True,
            prefetch_factor=prefetch_factor,
        )
        res = measure_config(dataset, cfg, batches=n_batches - 1, warmup=1, on_batch=note)
        results[flag] = res
        ooo[flag] = sum(b < a for a, b in zip(firsts, firsts[1:])) / max(1, len(firsts) - 1)
    return InOrderResult(results=results, out_of_order=ooo)


# ---------------------------------------------------------------------------
# Chapter 04: measuring the reader's own loaders (a loader factory)
# ---------------------------------------------------------------------------


def _is_factory(obj: Any) -> TypeIs[Callable[..., DataLoader]]:
    """True for a loader factory (a function returning a DataLoader), False for a data set or a loader."""
    return callable(obj) and not isinstance(obj, (Dataset, DataLoader)) and not hasattr(obj, "__getitem__")


def guard(loader: DataLoader, *, timeout: float | None = None, check_shm: bool = True) -> DataLoader:
    """The workbook's safety, applied to a DataLoader you built yourself; returns the same loader.

    What :func:`build_loader` gives every loader it builds, given to yours (in place):

    * with workers, it refuses (ValueError) when ``/dev/shm`` can't hold the batches the workers may
      have in flight (:func:`require_shm`; estimated from ``loader.dataset[0]``), before any worker starts;
    * a loader without a ``timeout`` of its own gets ``timeout`` seconds (default :data:`WORKER_TIMEOUT_S`):
      a frozen worker ends in :class:`LoaderFailure` instead of a hang;
    * its ``worker_init_fn`` (yours, e.g. ``helpers.pipeline.data.seed_worker``) still runs in each worker, after
      the worker has dropped the parent's SIGINT/SIGTERM handlers (:func:`reset_child_signals`);
    * a plain ``DataLoader`` becomes a ``_WorkbookLoader``: the DataLoader subclass whose only change is
      that starting the workers can't leak them when interrupted, and that a worker stopped longer than
      the timeout is ended (the freeze watchdog). Its knobs, data set and sampler stay yours.

    A loader built by :func:`build_loader` already has all of this and is returned unchanged.
    """
    if not isinstance(loader, DataLoader):
        raise ValueError(f"loader must be a torch DataLoader, got {type(loader).__name__}")
    if isinstance(loader, _WorkbookLoader):
        return loader
    if loader.num_workers > 0:
        if check_shm and loader.batch_size:
            per_item = _item_bytes(loader.dataset)
            if per_item is not None:
                require_shm(
                    shm_needed_bytes(per_item * int(loader.batch_size), loader.num_workers, loader.prefetch_factor or 2)
                )
        if not loader.timeout:
            loader.timeout = WORKER_TIMEOUT_S if timeout is None else check_float("timeout", timeout, 0.001, 3600.0)
        if not isinstance(loader.worker_init_fn, _WorkerInit):
            loader.worker_init_fn = _WorkerInit(loader.worker_init_fn)
    if type(loader) is DataLoader:
        loader.__class__ = _WorkbookLoader
    loader._workbook_frozen = []
    loader._workbook_warnings = list(getattr(loader, "_workbook_warnings", []))
    return loader


def build_from_factory(
    factory: Callable[[Any], DataLoader], value: Any, *, expect: Mapping[str, Any] | None = None
) -> DataLoader:
    """``factory(value)``, checked and guarded: your loader for one point of an experiment.

    The DataLoader's own warnings while it is built (e.g. "suggested max number of worker") are kept
    with the loader (they reach ``Throughput.warnings``), not printed. ``expect`` names knobs the loader
    must have (``{"num_workers": 2}``): a factory that ignores the value it is given is refused, since
    the experiment would then compare a loader with itself.
    """
    if not callable(factory):
        raise ValueError(f"factory must be a function that returns a DataLoader, got {type(factory).__name__}")
    with warnings.catch_warnings(record=True) as wlist:
        warnings.simplefilter("always")
        loader = factory(value)
    if not isinstance(loader, DataLoader):
        raise ValueError(
            f"the loader factory returned {type(loader).__name__} for {value!r}; it must return a "
            f"torch DataLoader (e.g. lambda w: make_loader(dataset, batch_size, workers=w))"
        )
    params = _loader_params(loader)
    wrong = {k: params.get(k) for k, v in (expect or {}).items() if params.get(k) != v}
    if wrong:
        raise ValueError(
            f"the loader factory was asked for {dict(expect or {})} (value {value!r}) but built a loader "
            f"with {wrong}: pass the value on to the DataLoader (e.g. num_workers=workers)"
        )
    guard(loader)
    loader._workbook_warnings += [str(w.message).strip() for w in wlist]  # type: ignore[attr-defined]
    return loader


_LABEL_PART: dict[str, str | tuple[str, ...]] = {
    "num_workers": "workers=",
    "batch_size": "batch=",
    "prefetch_factor": "prefetch=",
    "persistent_workers": "persistent",
    "in_order": "in_order=",
    "pin_memory": "pin_memory",
    "multiprocessing_context": ("fork", "spawn", "forkserver"),
}


def _label_without(cfg: LoaderConfig, knob: str) -> str:
    """``cfg.label()`` without the part that shows ``knob`` (the knob an experiment changes)."""
    prefix = _LABEL_PART.get(knob)
    parts = cfg.label().split(", ")
    return ", ".join(p for p in parts if prefix is None or not p.startswith(prefix))


def _config_of(params: Mapping[str, Any]) -> LoaderConfig:
    """A :class:`LoaderConfig` (for labels) from a result's ``config`` (:func:`_loader_params`)."""
    keep = {
        k: params[k]
        for k in ("batch_size", "num_workers", "pin_memory", "prefetch_factor", "persistent_workers", "in_order")
        if k in params
    }
    keep["batch_size"] = int(keep.get("batch_size") or 1)
    return LoaderConfig(**keep)


def _knob_factory(
    factory: Callable[[Any], DataLoader],
    knob: str,
    values: Sequence[Any],
    *,
    batches: int,
    warmup: int,
    progress: Callable[..., Any] | None,
) -> KnobResult:
    """:func:`knob_experiment` with your loader factory: one loader per value, each released after its run."""
    if not isinstance(knob, str) or not knob:
        raise ValueError(f"knob must name what the factory's argument changes, e.g. 'prefetch_factor'; got {knob!r}")
    if not values:
        raise ValueError("values must hold at least one setting")
    expect_knob = knob in _LABEL_PART and knob != "multiprocessing_context"
    results = []
    for k, v in enumerate(values):
        results.append(
            measure_throughput(
                build_from_factory(factory, v, expect={knob: v} if expect_knob else None),
                batches=batches,
                warmup=warmup,
            )
        )
        if progress is not None:
            progress((k + 1) / len(values), f"{knob}={v}")
    return KnobResult(knob=knob, values=list(values), results=results, base=_config_of(results[0].config))


def sampler_batches(loader: DataLoader) -> list[list[int]]:
    """The batches of indices the next ``iter(loader)`` hands out, in sampler order, without changing them.

    Every DataLoader iterator first draws its workers' base seed from the loader's ``generator`` (torch's
    ``_BaseDataLoaderIter``), then its sampler draws the epoch's permutation. This replays both and puts
    the generators' states back, so the epoch that follows is exactly the one returned here.
    """
    if loader.batch_sampler is None:
        raise ValueError("sampler_batches needs a loader with batch_size set (batches come from a batch sampler)")
    gens = [
        g
        for g in {
            id(g): g for g in (loader.generator, getattr(loader.sampler, "generator", None)) if g is not None
        }.values()
    ]
    saved = [g.get_state() for g in gens]
    saved_global = torch.get_rng_state()
    try:
        torch.empty((), dtype=torch.int64).random_(generator=loader.generator)
        return [[int(i) for i in b] for b in loader.batch_sampler]
    finally:
        for g, st in zip(gens, saved):
            g.set_state(st)
        torch.set_rng_state(saved_global)


def _in_order_factory(factory: Callable[[bool], DataLoader]) -> InOrderResult:
    """:func:`in_order_experiment` with your loader factory: one epoch with in_order=True, then False."""
    results: dict[bool, Throughput] = {}
    ooo: dict[bool, float] = {}
    for flag in (True, False):
        loader = build_from_factory(factory, flag, expect={"in_order": flag})
        try:
            order = sampler_batches(loader)
            if len(order) < 2:
                raise ValueError(f"in_order_experiment needs at least 2 batches per epoch; the loader has {len(order)}")
            where = {tuple(b): k for k, b in enumerate(order)}
            seen: list[int | None] = []

            def note(batch: Any, seen: list[int | None] = seen, where: dict[tuple, int] = where) -> None:
                seen.append(where.get(tuple(int(i) for i in batch[1])))

            results[flag] = measure_throughput(loader, batches=len(order) - 1, warmup=1, on_batch=note)
        finally:
            release(loader)
        if None in seen:
            raise ValueError(
                "in_order_experiment: the batches' labels must be the items' indices (as UnevenDataset's "
                "are), so that each batch can be found in the sampler's order"
            )
        pos = [s for s in seen if s is not None]
        ooo[flag] = sum(b < a for a, b in zip(pos, pos[1:])) / max(1, len(pos) - 1)
    return InOrderResult(results=results, out_of_order=ooo)


def getitems_experiment(
    dataset: "BatchedCheapDataset | int",
    *,
    image_size: int = 32,
    output: str = "uint8",
    workers: Sequence[int] = (0, 2),
    batch_size: int = 64,
    batches: int = 60,
    warmup: int = 4,
) -> dict[tuple[str, int], Throughput]:
    """Per-item fetching (``__getitem__`` + default_collate) against one batched ``__getitems__`` call per batch.

    Args:
        dataset: the reader's data set with a ``__getitems__`` that returns a finished batch (like
            :class:`BatchedCheapDataset`); the per-item runs use the same object through a view that hides
            ``__getitems__``. An int ``n`` builds ``BatchedCheapDataset(n, image_size, output)``
            (``image_size`` and ``output`` are used only then).
    """
    out: dict[tuple[str, int], Throughput] = {}
    if isinstance(dataset, bool) or not (isinstance(dataset, int) or hasattr(dataset, "__getitems__")):
        raise ValueError(
            "dataset must be a data set with __getitems__ (e.g. loaders.BatchedCheapDataset) or an item "
            f"count, got {type(dataset).__name__}"
        )
    batched = (
        BatchedCheapDataset(check_int("n", dataset, 1, 10_000_000), image_size=image_size, output=output)
        if isinstance(dataset, int)
        else dataset
    )
    per_item = _PerItem(batched)
    for w in workers:
        base = LoaderConfig(batch_size=batch_size, num_workers=w, persistent_workers=w > 0)
        out[("per-item", w)] = measure_config(
            per_item, base, batches=batches, warmup=warmup, label=f"__getitem__, workers={w}"
        )
        out[("batched", w)] = measure_config(
            batched,
            base,
            batches=batches,
            warmup=warmup,
            collate_fn=passthrough_collate,
            label=f"__getitems__, workers={w}",
        )
    return out


class _PerItem(Dataset):
    """A view of a data set that fetches item by item (hides its ``__getitems__``)."""

    def __init__(self, base: Dataset) -> None:
        self.base = base

    def __len__(self) -> int:
        return len(self.base)  # type: ignore[arg-type]

    def __getitem__(self, index: int) -> Any:
        return self.base[index]


def cheap_vs_expensive(
    expensive: Mapping[str, Dataset],
    *,
    n_cheap: int,
    image_size: int,
    workers: Sequence[int] = (0, 2),
    batch_size: int = 32,
    batches: int = 40,
    warmup: int = 4,
) -> list[dict[str, Any]]:
    """Throughput and main-thread load for cheap items (float, uint8, uint8 + light collate) and expensive items.

    Args:
        expensive: name -> data set (e.g. ``{"JPEG float": ShapesDataset(...), "JPEG uint8": ...}``).
        n_cheap / image_size: the cheap in-memory data set's size.
    Returns:
        rows ``{"items", "output", "collate", "num_workers", "result"}``.
    """
    cases: list[tuple[str, str, str, Dataset, Callable[[Any], Any] | None]] = [
        ("cheap", "float", "default", CheapDataset(n_cheap, image_size, "float"), None),
        ("cheap", "uint8", "default", CheapDataset(n_cheap, image_size, "uint8"), None),
        ("cheap", "uint8", "light", CheapDataset(n_cheap, image_size, "uint8"), light_uint8_collate),
    ]
    for name, ds in expensive.items():
        out_kind = getattr(ds, "output", "?")
        cases.append((name, out_kind, "default", ds, None))
    rows = []
    for items, output, collate, ds, fn in cases:
        for w in workers:
            cfg = LoaderConfig(batch_size=batch_size, num_workers=w, persistent_workers=w > 0)
            res = measure_config(
                ds,
                cfg,
                batches=batches,
                warmup=warmup,
                collate_fn=fn,
                label=f"{items} {output} ({collate} collate), workers={w}",
            )
            rows.append({"items": items, "output": output, "collate": collate, "num_workers": w, "result": res})
    return rows
