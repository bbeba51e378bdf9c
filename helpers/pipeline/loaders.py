"""The DataLoader plumbing every chapter uses: building, measuring and releasing loaders, and the demo data sets.

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
    signal handlers (:func:`reset_child_signals`). Far more workers than cores are refused where a reader
    asks for them (:func:`check_workers_for_cores`).

The chapters' own experiments live in their folders
    Chapter 03's (the pin thread, pinned against pageable rounds): :mod:`helpers.chapters.ch03.pinning`.
    Chapter 04's (the worker sweep, one knob at a time, the fair speed-up figure, the pitfalls shown live):
    :mod:`helpers.chapters.ch04.sweeps`, :mod:`helpers.chapters.ch04.speedup`, :mod:`helpers.chapters.ch04.pitfalls`.

Your own loaders
    :func:`guard` gives a DataLoader built in a cell (the reader's ``make_loader(...)``) the same safety as
    :func:`build_loader`'s (``/dev/shm``, timeout, signal reset in workers, leak-proof start, freeze watchdog).

Demo data sets and collate functions (module level, so spawn can import them)
    :class:`CheapDataset`, :class:`BatchedCheapDataset` (``__getitems__``),
    :class:`SpinDataset` (adds CPU work per item), :class:`UnevenDataset`
    (some items slow), :class:`FailingDataset` (raises in a worker),
    :class:`BadRNGDataset` / :class:`FixedRNGDataset` (the duplicated-augmentation
    bug and its fix), :class:`PinnableBatch` + :func:`collate_pinnable` (a custom
    batch type with its own ``pin_memory()``), :func:`light_uint8_collate`,
    :func:`passthrough_collate`.

``/dev/shm``
    :func:`shm_status` / :func:`require_shm` (``/dev/shm`` too small, refused before any worker starts).

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
import textwrap
import threading
import time
import warnings
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, default_collate, get_worker_info
from torch.utils.data._utils import MP_STATUS_CHECK_INTERVAL
from torch.utils.data.dataloader import _MultiProcessingDataLoaderIter

from ..core.device import intraop_threads
from ..core.failures import ITEM_NOTE as _ITEM_NOTE
from ..core.failures import LoaderFailure, ended_in_words, explain_loader_error
from ..core.validate import check_choice, check_float, check_int, human_bytes
from .data import TimedCollate, seed_worker

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
    "thread_label",
    "WORKER_TIMEOUT_S",
    "LoaderFailure",
    "explain_loader_error",
    "reset_child_signals",
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
    "guard",
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
# The pin thread and a batch type with its own pin_memory() (chapter 03's experiments: helpers.chapters.ch03.pinning)
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


def thread_label(thread: threading.Thread | None = None) -> str:
    """A stable name for a thread: ``pt_data_pin`` for a pin-memory thread, else its Python name
    (``MainThread`` for the main thread). Default: the current thread."""
    thread = thread if thread is not None else threading.current_thread()
    return PIN_THREAD_NAME if _is_pin_thread(thread) else thread.name


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


# ---------------------------------------------------------------------------
# The reader's own loaders: the workbook's safety given to a DataLoader built in a cell
# ---------------------------------------------------------------------------


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


def _config_of(params: Mapping[str, Any]) -> LoaderConfig:
    """A :class:`LoaderConfig` (for labels) from a result's ``config`` (:func:`_loader_params`)."""
    keep = {
        k: params[k]
        for k in ("batch_size", "num_workers", "pin_memory", "prefetch_factor", "persistent_workers", "in_order")
        if k in params
    }
    keep["batch_size"] = int(keep.get("batch_size") or 1)
    return LoaderConfig(**keep)


class _PerItem(Dataset):
    """A view of a data set that fetches item by item (hides its ``__getitems__``)."""

    def __init__(self, base: Dataset) -> None:
        self.base = base

    def __len__(self) -> int:
        return len(self.base)  # type: ignore[arg-type]

    def __getitem__(self, index: int) -> Any:
        return self.base[index]
