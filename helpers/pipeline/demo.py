"""Chapter 03's batch type, in the kernel because loaders re-exports it (and workers import collate functions by
name); chapter 04's data sets are in :mod:`helpers.chapters.ch04.datasets`."""

from __future__ import annotations

import threading
import time
from typing import Any

import torch
from torch.utils.data import default_collate

__all__ = ["PinnableBatch", "collate_pinnable", "thread_label"]

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
