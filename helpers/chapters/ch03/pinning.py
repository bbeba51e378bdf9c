"""Chapter 03's experiments: the pin thread, pinned against pageable batches in alternating rounds
(:func:`helpers.core.rounds.alternate`), what one pin step costs.

The loader plumbing they measure with (:func:`helpers.pipeline.loaders.measure_throughput`, the pinnable batch
and its collate function, which workers import by name) is shared and stays in :mod:`helpers.pipeline.loaders`.
"""

from __future__ import annotations

import statistics
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
from torch.utils.data import Dataset

from ...core.progress import ProgressFn
from ...core.rounds import alternate
from ...core.timing import measure
from ...core.validate import check_int
from ...pipeline.loaders import (
    MAX_WORKERS,
    LoaderConfig,
    PinnableBatch,
    Throughput,
    _is_pin_thread,
    collate_pinnable,
    measure_config,
    measure_throughput,
)


def pin_threads() -> list[threading.Thread]:
    """The DataLoader pin-memory threads alive in this process."""
    return [t for t in threading.enumerate() if t.is_alive() and _is_pin_thread(t)]


def pin_thread_alive() -> bool:
    """True while a DataLoader pin-memory thread (``pt_data_pin``) runs in this process."""
    return bool(pin_threads())


def batch_copy_seconds(nbytes: int, repeats: int = 20) -> float:
    """Median time of one plain CPU copy of ``nbytes``: the memcpy inside pinning, measurable on any machine
    (a lower bound of the pin step, not its cost). One thread, as in the DataLoader's pin thread."""
    nbytes = check_int("nbytes", nbytes, 1, 1 << 34)
    src = torch.empty(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    blocks = check_int("repeats", repeats, 1, 10_000)
    timing = measure(
        lambda: dst.copy_(src), label="batch copy", device="cpu", min_run_time=0.01, blocks=blocks, num_threads=1
    )
    return timing.median_s


@dataclass
class PinRow:
    """One configuration of the pin experiment: its rounds' items/s, and its last round's run."""

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
    progress: ProgressFn | None = None,
    rounds: int = 1,
) -> list[PinRow]:
    """The workbook's loader with and without ``pin_memory``, for each worker count, in alternating rounds.

    Batches are :class:`PinnableBatch`: when pinning really happens (CUDA) each says how long it took and
    which thread did it (the main thread with ``num_workers=0``, ``pt_data_pin`` with workers). Without an
    accelerator the flag only warns: ``pin_active=False``, no pin time. Rows are ordered (workers, False/True).
    """
    ws = [check_int(f"workers[{i}]", w, 0, MAX_WORKERS) for i, w in enumerate(workers)]
    last: dict[tuple[int, bool], tuple[Throughput, PinLog]] = {}

    def run(w: int, pin: bool) -> Callable[[], float]:
        def once() -> float:
            log = PinLog()
            cfg = LoaderConfig(batch_size=batch_size, num_workers=w, pin_memory=pin, persistent_workers=w > 0)
            res = measure_config(
                dataset, cfg, batches=batches, warmup=warmup, collate_fn=collate_pinnable, on_batch=log
            )
            last[(w, pin)] = res, log
            return res.items_per_s

        return once

    keys = [(w, pin) for w in ws for pin in (False, True)]
    measures = {f"workers={w}, pin_memory={pin}": run(w, pin) for w, pin in keys}
    out = alternate(measures, check_int("rounds", rounds, 1, 100), progress=progress)
    rows = []
    for label, (w, pin) in zip(measures, keys):
        res, log = last[(w, pin)]
        rows.append(PinRow(w, pin, res, bool(log.seconds), log.ms_per_batch, log.thread, out.values[label]))
    return rows


def check_make_loader(make_loader: Any) -> None:
    """The reader's ``make_loader`` must be a function (one clear line otherwise)."""
    if not callable(make_loader):
        raise ValueError(
            f"make_loader must be a function such as make_loader(dataset, batch_size, pin_memory=...), "
            f"got {make_loader!r}"
        )


def _readers_loader(make_loader: Callable[..., Any], dataset: Dataset, batch_size: int, pin: bool) -> Any:
    try:
        return make_loader(dataset, batch_size, pin_memory=pin)
    except TypeError as exc:
        raise ValueError(
            "make_loader must accept pin_memory=True/False as a keyword "
            f"(def make_loader(dataset, batch_size, pin_memory=...)): {exc}"
        ) from None


def pin_pair_rounds(
    make_loader: Callable[..., Any],
    dataset: Dataset,
    batch_size: int,
    *,
    to_device: Callable[..., Any] | None = None,
    batches: int = 30,
    warmup: int = 2,
    rounds: int = 3,
    progress: ProgressFn | None = None,
    threads: int | None = 1,
) -> list[PinRow]:
    """The reader's ``make_loader(dataset, batch_size, pin_memory=flag)``, False against True, in alternating rounds.

    Each round builds the reader's loader once per flag and times it with :func:`measure_throughput`, each
    batch copied by the reader's ``to_device`` (``threads`` intra-op threads, as in the pin thread). Returns
    two :class:`PinRow` (False, True): every round's items/s, the last round's :class:`Throughput`, and
    ``pin_active``: whether the timed batches arrived pinned (never without an accelerator). No pin time is
    read here (plain tuples carry none): see :func:`pin_step_seconds`. Raises ValueError for bad arguments or
    a ``make_loader`` without a ``pin_memory`` keyword.
    """
    check_make_loader(make_loader)
    batch_size = check_int("batch_size", batch_size, 1, 1_000_000)
    last: dict[bool, tuple[Any, Throughput]] = {}

    def run(pin: bool) -> Callable[..., float]:
        def once(progress: ProgressFn) -> float:
            loader = _readers_loader(make_loader, dataset, batch_size, pin)
            label = f"pin_memory={pin}"
            res = measure_throughput(
                loader,
                to_device=to_device,
                batches=batches,
                warmup=warmup,
                label=label,
                progress=progress,
                threads=threads,
            )
            last[pin] = loader, res
            return res.items_per_s

        return once

    out = alternate({"pin_memory=False": run(False), "pin_memory=True": run(True)}, rounds, progress=progress)
    rows = []
    for pin in (False, True):
        loader, res = last[pin]
        workers, active = int(getattr(loader, "num_workers", 0)), res.extra["pinned_batches"] > 0
        rows.append(PinRow(workers, pin, res, active, None, None, out.values[f"pin_memory={pin}"]))
    return rows


def pin_step_seconds(batch: Any, repeats: int = 10) -> float | None:
    """Median time of the DataLoader's own pin step on ``batch`` (``None``: no CUDA device, nothing can be pinned).

    Times ``torch.utils.data._utils.pin_memory.pin_memory(batch)``, what the loader calls on every batch with
    ``pin_memory=True``: a page-locked block from the caching host allocator, then a copy into it. One untimed
    call first, so the allocator has a warm block.
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
