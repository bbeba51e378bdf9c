"""Chapter 03's experiments: its batch type (in a module, so that workers import it by name), the pin thread,
pinned against pageable batches in alternating rounds, what one pin step costs. The loader plumbing they measure
with is shared: :mod:`helpers.pipeline.loaders`."""

from __future__ import annotations

import dataclasses
import statistics
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
from torch.utils.data import Dataset, default_collate

from ...core.progress import ProgressFn
from ...core.rounds import alternate
from ...core.timing import measure, time_calls
from ...core.validate import check_int
from ...pipeline.loaders import LoaderConfig, Throughput, measure_config, measure_throughput
from ...pipeline.workers import MAX_WORKERS

#: What the workbook calls the DataLoader's pin-memory thread: the name torch gives the OS thread.
PIN_THREAD_NAME = "pt_data_pin"


def _is_pin_thread(thread: threading.Thread) -> bool:
    """A DataLoader pin-memory thread, by its target: only the OS-level thread is named ``pt_data_pin``."""
    target = getattr(thread, "_target", None)  # set while the thread runs (Thread.run deletes it at the end)
    if getattr(target, "__name__", None) == "_pin_memory_loop":
        return True
    return thread.name == PIN_THREAD_NAME or thread.name.endswith("(_pin_memory_loop)")


def thread_label(thread: threading.Thread | None = None) -> str:
    """``pt_data_pin`` for a pin-memory thread, else the thread's Python name (default: the current thread)."""
    thread = thread if thread is not None else threading.current_thread()
    return PIN_THREAD_NAME if _is_pin_thread(thread) else thread.name


class PinnableBatch:
    """A batch whose ``pin_memory()`` (called by the DataLoader's pin step) records how long it took and in which
    thread: chapter 03 shows where the pinning time goes."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor) -> None:
        self.images = images
        self.labels = labels
        self.pin_seconds: float | None = None
        self.pin_thread: str | None = None

    def pin_memory(self, device: Any = None) -> "PinnableBatch":
        t0 = time.perf_counter()
        out = PinnableBatch(self.images.pin_memory(), self.labels.pin_memory())
        out.pin_seconds = time.perf_counter() - t0
        out.pin_thread = thread_label()
        return out

    def is_pinned(self) -> bool:
        return bool(self.images.is_pinned() and self.labels.is_pinned())

    def to(self, device: Any, non_blocking: bool = False) -> "PinnableBatch":
        out = PinnableBatch(
            self.images.to(device, non_blocking=non_blocking), self.labels.to(device, non_blocking=non_blocking)
        )
        out.pin_seconds, out.pin_thread = self.pin_seconds, self.pin_thread
        return out

    def __len__(self) -> int:
        return int(self.images.shape[0])

    def __repr__(self) -> str:
        return f"PinnableBatch(images={tuple(self.images.shape)} {self.images.dtype}, pinned={self.is_pinned()})"


def collate_pinnable(items: list[tuple[torch.Tensor, int]]) -> PinnableBatch:
    """``(image, label)`` items as a :class:`PinnableBatch` (stacked by default_collate: shared memory in a worker)."""
    return PinnableBatch(default_collate([x for x, _ in items]), torch.as_tensor([int(y) for _, y in items]))


def pin_threads() -> list[threading.Thread]:
    """The DataLoader pin-memory threads alive in this process."""
    return [t for t in threading.enumerate() if t.is_alive() and _is_pin_thread(t)]


def pin_thread_alive() -> bool:
    return bool(pin_threads())


def batch_copy_seconds(nbytes: int, repeats: int = 20) -> float:
    """Median time of one plain copy of ``nbytes`` on one thread: the memcpy inside pinning (a lower bound of it)."""
    src = torch.empty(check_int("nbytes", nbytes, 1, 1 << 34), dtype=torch.uint8)
    dst, blocks = torch.empty_like(src), check_int("repeats", repeats, 1, 10_000)
    copy = measure(
        lambda: dst.copy_(src), label="batch copy", device="cpu", min_run_time=0.01, blocks=blocks, num_threads=1
    )
    return copy.median_s


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
    def items_per_s(self) -> float:  # the median over the rounds
        return statistics.median(self.round_items_per_s) if self.round_items_per_s else self.result.items_per_s


def _rounds(runs: dict[str, Callable[[ProgressFn], PinRow]], rounds: int, progress: ProgressFn | None) -> list[PinRow]:
    """Each run once per round, alternating: its last round's row with every round's items/s."""
    last: dict[str, PinRow] = {}

    def timed(label: str) -> Callable[[ProgressFn], float]:
        def once(progress: ProgressFn) -> float:
            last[label] = runs[label](progress)
            return last[label].result.items_per_s

        return once

    out = alternate({label: timed(label) for label in runs}, rounds, progress=progress)
    return [dataclasses.replace(last[label], round_items_per_s=out.values[label]) for label in runs]


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
    """The workbook's loader with and without ``pin_memory``, per worker count, in alternating rounds; its batches
    say how long pinning took and in which thread (the row's median ms and most frequent thread)."""
    ws = [check_int(f"workers[{i}]", w, 0, MAX_WORKERS) for i, w in enumerate(workers)]

    def run(w: int, pin: bool) -> Callable[[ProgressFn], PinRow]:
        def once(progress: ProgressFn) -> PinRow:
            pinned: list[tuple[float, str]] = []  # (seconds, thread) of each batch that says it was pinned

            def log(batch: Any) -> None:
                if isinstance(batch, PinnableBatch) and batch.pin_seconds is not None:
                    pinned.append((batch.pin_seconds, batch.pin_thread or "?"))

            cfg = LoaderConfig(batch_size=batch_size, num_workers=w, pin_memory=pin, persistent_workers=w > 0)
            res = measure_config(
                dataset, cfg, batches=batches, warmup=warmup, collate_fn=collate_pinnable, on_batch=log
            )
            threads = [t for _, t in pinned]
            ms = 1e3 * statistics.median(s for s, _ in pinned) if pinned else None
            return PinRow(w, pin, res, bool(pinned), ms, max(set(threads), key=threads.count) if threads else None)

        return once

    return _rounds(
        {f"workers={w}, pin_memory={pin}": run(w, pin) for w in ws for pin in (False, True)}, rounds, progress
    )


def time_readers_loader(
    make_loader: Any, dataset: Any, batch_size: int, pin_memory: bool, **measure: Any
) -> tuple[Throughput, int]:
    """The reader's ``make_loader(dataset, batch_size, pin_memory=...)`` timed by :func:`measure_throughput`
    (``measure``: its keywords), and its worker count; one clear line when it cannot be called so."""
    if not callable(make_loader):
        raise ValueError(
            f"make_loader must be a function such as make_loader(dataset, batch_size, pin_memory=...), "
            f"got {make_loader!r}"
        )
    try:
        loader = make_loader(dataset, batch_size, pin_memory=pin_memory)
    except TypeError as exc:
        raise ValueError(
            "make_loader must accept pin_memory=True/False as a keyword "
            f"(def make_loader(dataset, batch_size, pin_memory=...)): {exc}"
        ) from None
    return measure_throughput(loader, **measure), int(getattr(loader, "num_workers", 0))


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
    """The reader's loader with ``pin_memory`` False against True, in alternating rounds, timed with the reader's
    ``to_device``: two rows; ``pin_active``: the batches arrived pinned (never without an accelerator)."""
    batch_size = check_int("batch_size", batch_size, 1, 1_000_000)

    kw: dict[str, Any] = {"to_device": to_device, "batches": batches, "warmup": warmup, "threads": threads}

    def run(pin: bool) -> Callable[[ProgressFn], PinRow]:
        def once(progress: ProgressFn) -> PinRow:
            label = f"pin_memory={pin}"
            res, workers = time_readers_loader(
                make_loader, dataset, batch_size, pin, label=label, progress=progress, **kw
            )
            return PinRow(workers, pin, res, res.extra["pinned_batches"] > 0, None, None)

        return once

    return _rounds({f"pin_memory={pin}": run(pin) for pin in (False, True)}, rounds, progress)


def pin_step_seconds(batch: Any, repeats: int = 10) -> float | None:
    """Median time of the DataLoader's own pin step on ``batch`` (``None`` without CUDA): the function it calls on
    every batch, which takes a block from the caching host allocator and copies into it (one untimed call first)."""
    repeats = check_int("repeats", repeats, 1, 10_000)
    if not torch.cuda.is_available():
        return None
    from torch.utils.data._utils.pin_memory import pin_memory as loader_pin

    return time_calls(lambda: loader_pin(batch), repeats=repeats, warmup=1, device="cpu").median_s
