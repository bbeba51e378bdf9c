"""The take-home pipeline, copied into the package (which reads no file outside it): what the capstone times without
the reader's cells. Between the ``pipeline`` markers, line for line ``examples/fast_pipeline.py``'s block and chapter
06's cells (tests/test_pipeline_cells.py). It reads the globals ``DEVICE``, ``WORKERS`` and ``SEED``
(:func:`helpers.chapters.ch06.job.reference_pipeline` sets them); laid out by hand, as the script is."""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

__all__ = ["DEVICE", "WORKERS", "SEED", "MEAN", "STD", "make_loader", "normalize", "Prefetcher", "batches",
           "train_step"]

MEAN = (0.5, 0.5, 0.5)  # per-channel statistics of the images (0-1 scale), as in the script
STD = (0.25, 0.25, 0.25)

# The pipeline reads these three globals (the script's main() sets its own from the command line).
DEVICE = torch.device("cpu")
WORKERS = min(8, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1))
SEED = 0


# --- pipeline: start ---
def make_loader(dataset, batch_size, workers=WORKERS, pin=True, prefetch_factor=4, persistent=True):
    return DataLoader(dataset, batch_size=batch_size, shuffle=True, drop_last=True,
                      generator=torch.Generator().manual_seed(SEED),      # 01: the same order in every run
                      num_workers=workers,                                # 04: load in worker processes
                      pin_memory=pin and DEVICE.type == "cuda",           # 03: page-locked batches (CUDA only)
                      persistent_workers=persistent and workers > 0,      # 04: keep the workers between epochs
                      prefetch_factor=prefetch_factor if workers > 0 else None)  # 04: batches queued per worker


@functools.lru_cache(maxsize=None)
def stats(device):                                        # made once per device: a new one would copy and sync
    return (torch.tensor(MEAN, device=device).view(1, 3, 1, 1) * 255,
            torch.tensor(STD, device=device).view(1, 3, 1, 1) * 255)


def normalize(x):                                         # 05: uint8 -> float, on the tensor's device
    mean, std = stats(x.device)
    return (x.float() - mean) / std


@functools.lru_cache(maxsize=None)
def side_stream(device):                                  # 05: one side stream per device, made once
    return torch.cuda.Stream(device)                      # (batches() makes a Prefetcher every epoch)


class Prefetcher:                                         # 05: copy batch i+1 on a side stream while i trains
    def __init__(self, loader):
        self.loader, self.stream = loader, side_stream(DEVICE)  # the device's one side stream, every epoch

    def __iter__(self):
        main = torch.cuda.current_stream(DEVICE)
        self.stream.wait_stream(main)                     # the side stream starts after earlier work
        it = iter(self.loader)
        nxt = self._send(next(it, None))
        while nxt is not None:
            main.wait_stream(self.stream)                 # batch i's copy is done before main uses it
            x, y = nxt
            x.record_stream(main)                         # its memory is not reused while main needs it
            y.record_stream(main)
            nxt = self._send(next(it, None))              # queue batch i+1's copy now
            yield x, y

    def _send(self, batch):
        if batch is None:
            return None
        with torch.cuda.stream(self.stream):              # pinned batches: the copy runs beside compute
            return batch[0].to(DEVICE, non_blocking=True), batch[1].to(DEVICE, non_blocking=True)


def batches(loader, prefetch=True, float_on_host=False):
    if prefetch and DEVICE.type == "cuda" and not float_on_host:
        for x, y in Prefetcher(loader):
            yield normalize(x), y                         # 05: uint8 crossed the link; float made on the GPU
        return
    for x, y in loader:
        if float_on_host:                                 # float32 crosses the link: 4x the bytes
            x = normalize(x).pin_memory() if x.is_pinned() else normalize(x)  # pinned, as the loader's was
        x, y = x.to(DEVICE, non_blocking=True), y.to(DEVICE, non_blocking=True)  # 03: async from pinned memory
        yield (x if float_on_host else normalize(x)), y


def train_step(model, optimizer, x, y):
    loss = F.cross_entropy(model(x), y)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return loss.detach()                                  # no .item(): reading it would sync every step
# --- pipeline: end ---
