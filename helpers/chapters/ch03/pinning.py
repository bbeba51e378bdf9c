"""Chapter 03's experiments: the pin thread, pinned against pageable batches in alternating rounds, what one
pin step costs.

The loader plumbing they measure with (:func:`helpers.pipeline.loaders.measure_throughput`, the pinnable batch
and its collate function, which workers import by name) is shared and stays in :mod:`helpers.pipeline.loaders`.
"""

from __future__ import annotations

import statistics
import threading
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
from torch.utils.data import DataLoader, Dataset

from ...core.device import intraop_threads
from ...core.validate import check_int
from ...pipeline.loaders import (
    MAX_WORKERS,
    CheapDataset,
    LoaderConfig,
    PinnableBatch,
    Throughput,
    _is_pin_thread,
    collate_pinnable,
    measure_config,
    measure_throughput,
    release,
)

__all__ = [
    "pin_threads",
    "pin_thread_alive",
    "pin_memory_warning",
    "batch_copy_seconds",
    "PinRow",
    "PinLog",
    "pin_memory_experiment",
    "pin_pair_rounds",
    "pin_step_seconds",
]


def pin_threads() -> list[threading.Thread]:
    """The DataLoader pin-memory threads alive in this process."""
    return [t for t in threading.enumerate() if t.is_alive() and _is_pin_thread(t)]


def pin_thread_alive() -> bool:
    """True while a DataLoader pin-memory thread (``pt_data_pin``) runs in this process."""
    return bool(pin_threads())


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
    speed cancels; a row's ``items_per_s`` is then its median over the rounds.
    The other fields come from the row's last round.
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
    The chapter's ``ch03.pin_pair_verdict`` turns the rows into one honest sentence. No pin time is read here
    (plain tuples carry none): see :func:`pin_step_seconds`. ``threads``: intra-op threads while measuring (default 1,
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
