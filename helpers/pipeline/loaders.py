"""Building and timing loaders: :func:`build_loader`, :func:`guard` (its safety for a loader built in a cell) and
:func:`measure_throughput`, the one way to time a loader (its workers always released). Re-exports what the
notebooks' cells read from :mod:`~helpers.pipeline.workers`.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import shutil as shutil  # the /dev/shm check reads shutil.disk_usage: tests fake it as loaders.shutil
import statistics
import time
import warnings
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterable, Iterator, Mapping

import torch
from torch.utils.data import DataLoader, Dataset, default_collate

from ..core.failures import LoaderFailure as LoaderFailure
from ..core.failures import explain_loader_error as explain_loader_error
from ..core.rounds import intraop_threads
from ..core.validate import check_choice, check_float, check_int
from .data import TimedCollate, seed_worker
from .prefetch import iter_tensors
from .workers import (
    MAX_WORKERS,
    _WorkbookLoader,
    _WorkerInit,
    check_workers_for_cores,
    release,
    released,
    require_shm,
    require_short_tempdir,
    shm_needed_bytes,
)
from .workers import cpu_cores as cpu_cores  # re-exported for the notebooks' cells
from .workers import load_note as load_note
from .workers import open_iterator as open_iterator
from .workers import shm_status as shm_status
from .workers import worker_processes as worker_processes

#: Seconds a worker loader waits for one batch before it fails in plain words (``LoaderConfig.timeout`` overrides):
#: long enough for worker start-up on a busy 2-core machine, short enough that a frozen worker never hangs a panel.
WORKER_TIMEOUT_S = 60.0


@dataclass
class LoaderConfig:
    """The DataLoader knobs chapters 03-04 turn, checked together by :meth:`validated`. ``None``: DataLoader's
    default (``timeout``: :data:`WORKER_TIMEOUT_S` with workers; 0 waits forever). ``seed`` seeds the shuffle."""

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
        check_int("batch_size", self.batch_size, 1, 65536)
        check_int("num_workers", self.num_workers, 0, MAX_WORKERS)
        for name in ("pin_memory", "persistent_workers", "in_order", "shuffle", "drop_last"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        check_int("seed", self.seed, 0, 2**63 - 1)
        if self.timeout is not None:
            check_float("timeout", self.timeout, 0.0, 3600.0)
        if self.prefetch_factor is not None:
            check_int("prefetch_factor", self.prefetch_factor, 1, 64)
        check_choice("multiprocessing_context", self.multiprocessing_context, (None, *mp.get_all_start_methods()))
        worker_only = ("prefetch_factor", "persistent_workers", "timeout", "multiprocessing_context")  # truthy once set
        knob = next((k for k in worker_only if getattr(self, k)), None) if self.num_workers == 0 else None
        if knob:
            raise ValueError(
                f"{knob} only applies with worker processes: set num_workers to an integer in [1, {MAX_WORKERS}], "
                f"or leave {knob} at its default"
            )
        return self

    def replace(self, **changes: Any) -> "LoaderConfig":
        """A copy with some knobs changed (unknown names raise ValueError)."""
        unknown = set(changes) - set(asdict(self))
        if unknown:
            raise ValueError(f"unknown loader knob(s) {sorted(unknown)}; knobs are {sorted(asdict(self))}")
        return LoaderConfig(**{**asdict(self), **changes})

    def label(self) -> str:
        """E.g. ``'workers=2, batch=32, prefetch=2, persistent'``."""
        parts = [f"workers={self.num_workers}", f"batch={self.batch_size}"]
        if self.num_workers:
            parts.append(f"prefetch={self.prefetch_factor or 2}")
            parts += ["persistent"] * self.persistent_workers + ["in_order=False"] * (not self.in_order)
            parts += [self.multiprocessing_context] if self.multiprocessing_context else []
        return ", ".join(parts + ["pin_memory"] * self.pin_memory)


# -- building --------------------------------------------------------------------------------------------------


def _check_callable(name: str, fn: Any) -> None:
    if fn is None:
        return
    inner = getattr(fn, name, None) if not isinstance(fn, type) else None
    for f in (fn,) if inner is None else (fn, inner):
        if not callable(f):
            raise ValueError(
                f"{name} must be a function (a module-level one, not a lambda, for spawn workers), got {f!r}"
            )


def build_loader(
    dataset: Dataset,
    config: LoaderConfig | None = None,
    *,
    collate_fn: Callable[[Any], Any] | None = None,
    sampler: Any = None,
    **knobs: Any,
) -> DataLoader:
    """Every loader of the workbook: ``config`` with ``knobs`` over it, validated, then :func:`guard`ed; workers
    seeded by :func:`~helpers.pipeline.data.seed_worker`."""
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
    with warnings.catch_warnings(record=True) as wlist:
        warnings.simplefilter("always")
        loader = DataLoader(
            dataset,
            batch_size=cfg.batch_size,
            shuffle=cfg.shuffle,
            num_workers=cfg.num_workers,
            pin_memory=cfg.pin_memory,
            drop_last=cfg.drop_last,
            in_order=cfg.in_order,
            collate_fn=collate_fn if collate_fn is not None else default_collate,
            generator=torch.Generator().manual_seed(cfg.seed),
            sampler=sampler,
            worker_init_fn=seed_worker if cfg.num_workers else None,
            persistent_workers=cfg.persistent_workers,  # these three: at their defaults without workers (validated)
            prefetch_factor=cfg.prefetch_factor,
            multiprocessing_context=cfg.multiprocessing_context,
        )
    loader._workbook_warnings = [str(w.message).strip() for w in wlist]  # for Throughput.warnings, not stderr
    guard(loader)
    if cfg.num_workers > 0 and cfg.timeout is not None:  # 0: wait forever
        loader.timeout = float(cfg.timeout)
    return loader


def timed_loader(
    dataset: Dataset, batch_size: int, *, collate_fn: Callable[[Any], Any] | None = None, **knobs: Any
) -> DataLoader:
    """:func:`build_loader` with the collate wrapped in :class:`~helpers.pipeline.data.TimedCollate` (chapter 01)."""
    return build_loader(dataset, batch_size=batch_size, collate_fn=TimedCollate(collate_fn), **knobs)


def guard(loader: DataLoader, *, timeout: float | None = None, check_shm: bool = True) -> DataLoader:
    """Your DataLoader made safe in place: ``/dev/shm`` checked, a ``timeout`` if it has none, signal handlers dropped
    in each worker before your ``worker_init_fn``; it becomes a ``_WorkbookLoader`` (no leaked or frozen workers)."""
    if not isinstance(loader, DataLoader):
        raise ValueError(f"loader must be a torch DataLoader, got {type(loader).__name__}")
    if isinstance(loader, _WorkbookLoader):
        return loader
    if loader.num_workers > 0:
        if check_shm and loader.batch_size:
            try:  # the batches the workers may hold, estimated from dataset[0]
                sample = loader.dataset[0]
            except Exception:  # the loader reports a broken item itself, from the worker that meets it
                sample = None
            sample = sample if isinstance(sample, (tuple, list, torch.Tensor, Mapping)) else []
            batch = int(loader.batch_size) * _batch_bytes(sample)
            require_shm(shm_needed_bytes(batch, loader.num_workers, loader.prefetch_factor or 2))
        require_short_tempdir()
        if not loader.timeout:
            loader.timeout = WORKER_TIMEOUT_S if timeout is None else check_float("timeout", timeout, 0.001, 3600.0)
        if not isinstance(loader.worker_init_fn, _WorkerInit):
            loader.worker_init_fn = _WorkerInit(loader.worker_init_fn)
    if type(loader) is DataLoader:
        loader.__class__ = _WorkbookLoader
    loader._workbook_frozen = []
    loader._workbook_warnings = list(getattr(loader, "_workbook_warnings", []))
    return loader


# -- measuring --------------------------------------------------------------------------------------------------


def _batch_tensors(batch: Any) -> list[torch.Tensor]:
    return list(iter_tensors(batch))


def batch_len(batch: Any) -> int:
    """Items in ``batch``: its first tensor's first dimension (a 0-d tensor: 1), else a non-empty list's length."""
    first = next(iter_tensors(batch), None)
    if first is not None:
        return int(first.shape[0]) if first.dim() else 1
    return len(batch) if isinstance(batch, (list, tuple)) and batch else 1


def _batch_bytes(batch: Any) -> int:
    return sum(int(t.numel() * t.element_size()) for t in _batch_tensors(batch))


def _is_pinned(batch: Any) -> bool:
    ts = _batch_tensors(batch)
    return bool(ts) and all(t.device.type == "cpu" and t.is_pinned() for t in ts)


@dataclass
class Throughput:
    """One measured loader run: ``items``/``batches`` in the timed window of ``seconds`` (after the warm-up);
    ``startup_s`` until the first batch; ``wait_s`` per batch inside ``next()``; ``main_cpu_s`` the main thread's."""

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
        waits = torch.tensor(self.wait_s, dtype=torch.float64)  # linear interpolation between the two nearest
        return 1e3 * float(waits.quantile(0.95)) if self.wait_s else float("nan")

    @property
    def max_wait_ms(self) -> float:
        return 1e3 * max(self.wait_s) if self.wait_s else float("nan")

    @property
    def main_busy(self) -> float:
        """Near 1: the main process is the bottleneck."""
        return self.main_cpu_s / self.seconds if self.seconds > 0 else float("nan")


def _loader_params(loader: Any) -> tuple[dict[str, Any], str]:
    """``Throughput.config`` and the default label of what :func:`measure_throughput` times."""
    if not isinstance(loader, DataLoader):
        return {"loader": type(loader).__name__}, type(loader).__name__
    params: dict[str, Any] = {
        "batch_size": loader.batch_size,
        "num_workers": loader.num_workers,
        "pin_memory": bool(loader.pin_memory),
        "prefetch_factor": loader.prefetch_factor if loader.num_workers else None,
        "persistent_workers": bool(loader.persistent_workers),
        "in_order": bool(getattr(loader, "in_order", True)),
    }
    label = LoaderConfig(**{**params, "batch_size": int(loader.batch_size or 1)}).label()
    return {**params, "dataset": type(loader.dataset).__name__}, label


class Epochs:
    """A loader's batches across epoch ends: ``next()`` starts a new iterator at each end (persistent workers carry
    on; others are released); ``it``: the current iterator."""

    def __init__(self, loader: Iterable[Any]) -> None:
        self.loader, self.started = loader, 0
        self.it: Iterator[Any] | None = None

    def next(self) -> Any:
        for _attempt in range(2):  # the end of an epoch: one new iterator, then give up
            if self.it is None:
                self.it = iter(self.loader)
                self.started += 1
            try:
                return next(self.it)
            except StopIteration:
                if not getattr(self.loader, "persistent_workers", False):
                    release(self.it)
                self.it = None
        raise ValueError(
            "the loader yields no batches (a data set smaller than batch_size with drop_last=True, "
            "or a sampler with no indices): give it at least one full batch of items"
        )


def _timed_window(
    epochs: Epochs,
    warmup: int,
    batches: int,
    to_device: Callable[..., Any] | None,
    consume: Callable[[Any], Any] | None,
    on_batch: Callable[[Any], None] | None,
    progress: Callable[..., Any] | None,
) -> dict[str, Any]:
    total, waits, copies = warmup + batches, [], []
    items = first_bytes = pinned = 0
    cuda_dev: torch.device | None = None  # where to_device put the batches, if on a CUDA device
    startup = float("nan")
    t_start = t_window = time.perf_counter()
    t_cpu = time.thread_time()
    for n in range(total):
        if n == warmup:
            if cuda_dev is not None:
                torch.cuda.synchronize(cuda_dev)  # the warm-up's copies are not the window's
            t_window, t_cpu = time.perf_counter(), time.thread_time()
        t0 = time.perf_counter()
        batch = epochs.next()
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
            items += batch_len(batch)
            pinned += _is_pinned(batch)
            first_bytes = first_bytes if n > warmup else _batch_bytes(batch)
            if on_batch is not None:
                on_batch(batch)
        del batch, out
        if progress is not None and ((n + 1) % max(1, total // 50) == 0 or n + 1 == total):
            progress((n + 1) / total, f"{n + 1}/{total} batches")
    if cuda_dev is not None:
        torch.cuda.synchronize(cuda_dev)  # copies still queued belong to this window
    extra: dict[str, Any] = {"pinned_batches": pinned, "on_cuda": cuda_dev is not None}
    if to_device is not None:
        extra.update(copy_s=copies, copy_ms_per_batch=1e3 * statistics.fmean(copies))
    seconds, cpu = time.perf_counter() - t_window, time.thread_time() - t_cpu
    timed = dict(items=items, batches=batches, seconds=seconds, startup_s=startup, wait_s=waits, main_cpu_s=cpu)
    return {**timed, "batch_bytes": first_bytes, "extra": extra}


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
    """Time the last ``batches`` of ``warmup + batches`` (across epoch ends) of any iterable of batches, workers
    released however it ends. ``to_device(*batch)`` is timed apart (``extra["copy_s"]``); ``consume(batch)`` runs
    inside the window, ``on_batch`` outside the wait timing; ``threads``: torch's intra-op threads meanwhile. A
    DataLoader goes through :func:`guard` first."""
    if not hasattr(loader, "__iter__"):
        raise ValueError(
            f"loader must be an iterable of batches (a DataLoader, e.g. make_loader(...)), got {type(loader).__name__}"
        )
    _check_callable("to_device", to_device)
    check_int("batches", batches, 1, 1_000_000)
    check_int("warmup", warmup, 0, 1_000_000)
    if isinstance(loader, DataLoader):  # a reader's own DataLoader too: /dev/shm, a timeout, no frozen workers
        guard(loader)
    params, default_label = _loader_params(loader)
    caught: list[str] = list(getattr(loader, "_workbook_warnings", []))
    epochs = Epochs(loader)
    with released([loader], loader) as objs:
        with (
            warnings.catch_warnings(record=True) as wlist,
            intraop_threads(threads) if threads is not None else contextlib.nullcontext(),
        ):
            warnings.simplefilter("always")
            warnings.filterwarnings("ignore", category=DeprecationWarning)
            try:
                timed = _timed_window(epochs, warmup, batches, to_device, consume, on_batch, progress)
            finally:
                objs[:0] = [epochs.it] if epochs.it is not None else []  # released first, as open_iterator does
        caught += [m for m in dict.fromkeys(str(w.message).strip() for w in wlist) if m not in caught]
    return Throughput(
        label=label or default_label,
        config=params,
        warmup_batches=warmup,
        epochs_started=epochs.started,
        warnings=caught,
        **timed,
    )


def measure_config(
    dataset: Dataset,
    config: LoaderConfig | None = None,
    *,
    batches: int,
    warmup: int = 2,
    collate_fn: Callable[[Any], Any] | None = None,
    label: str | None = None,
    on_batch: Callable[[Any], None] | None = None,
    **knobs: Any,
) -> Throughput:
    """:func:`build_loader` then :func:`measure_throughput`, refusing far more workers than cores."""
    cfg = (config or LoaderConfig()).replace(**knobs).validated()
    check_workers_for_cores(cfg.num_workers)
    loader = build_loader(dataset, cfg, collate_fn=collate_fn)
    result = measure_throughput(loader, batches=batches, warmup=warmup, label=label or cfg.label(), on_batch=on_batch)
    collate = getattr(collate_fn, "__name__", "default_collate")
    result.config = {**asdict(cfg), "dataset": type(dataset).__name__, "collate": collate}
    return result
