"""Chapter 03's CUDA-only path, run on a CPU with the CUDA stand-ins of :mod:`tests.cuda_standin`:
``DataLoader(pin_memory=True)`` with a CUDA device, in the main thread (``num_workers=0``) and in the
loader's pin thread (workers), then the chapter's ``to_device``.

What is checked is real: every batch is pinned (x and y, once each) before it is handed over, by the
thread the chapter says (the main thread, or the pin thread on the device that was current when the
iterator was made); the batches keep their dtype and shape; ``to_device`` queues one non-blocking copy
per tensor from pinned memory onto ``DEVICE``'s current stream (``cuda:1`` while ``cuda:0`` is current)
and the result says it is on ``DEVICE``; nothing in it waits for the GPU; the pin thread and the workers
are gone when the block ends. The chapter's cells are read from the notebook, not copied.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from cuda_standin import fake_cuda
from torch.utils.data import DataLoader, TensorDataset

from helpers.chapters.ch03 import pinning
from helpers.pipeline import loaders
from helpers.ui import codecells

CUDA1 = torch.device("cuda", 1)


def _dataset(n: int = 24) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.rand(n, 3, 8, 8, generator=g), torch.randint(0, 6, (n,), generator=g))


def _chapter(device: torch.device) -> dict[str, Any]:
    ns: dict[str, Any] = {"torch": torch, "DataLoader": DataLoader, "SEED": 0, "DEVICE": device}
    for cell in codecells.pipeline_cells("03"):
        exec(compile(cell, "<chapter 03: pipeline>", "exec"), ns)
    return ns


@pytest.mark.parametrize("current", [0, 1])
def test_make_loader_pins_every_batch_and_to_device_queues_copies_on_devices_stream(current: int) -> None:
    with fake_cuda(devices=2, current=current) as cuda:
        ns = _chapter(CUDA1)
        loader = ns["make_loader"](_dataset(), 8)  # pin_memory defaults to DEVICE.type == "cuda": on
        assert loader.pin_memory
        arrived = []
        for x, y in loader:
            assert x.is_pinned() and y.is_pinned(), "the loader hands over pinned batches"
            assert (x.dtype, x.shape, y.dtype, y.shape) == (torch.float32, (8, 3, 8, 8), torch.int64, (8,))
            start = len(cuda.log)
            xd, yd = ns["to_device"](x, y)
            assert xd.device == CUDA1 and yd.device == CUDA1 and torch.equal(xd.cpu(), x)
            ops = cuda.log[start : start + 2]
            assert [op.kind for op in ops] == ["copy", "copy"]
            assert all(op.stream is cuda.default[1] and op["non_blocking"] and op["src_pinned"] for op in ops)
            arrived.append(x)
    pins = cuda.ops("pin")
    assert len(pins) == 2 * 3 and all(op.thread == "MainThread" for op in pins)  # num_workers=0: main thread
    assert len({id(x) for x in arrived}) == 3  # a fresh pinned block per batch: no buffer is refilled
    assert not [op for op in cuda.host_syncs() if op["what"] != "blocking D2H copy"]  # to_device never waits


def test_without_pinning_to_device_copies_pageable_batches() -> None:
    with fake_cuda(devices=2, current=0) as cuda:
        ns = _chapter(CUDA1)
        x, y = next(iter(ns["make_loader"](_dataset(), 8, pin_memory=False)))
        assert not x.is_pinned()
        ns["to_device"](x, y)
    assert not cuda.ops("pin")
    assert all(not op["src_pinned"] and op.stream is cuda.default[1] for op in cuda.ops("copy"))


def test_the_pin_thread_pins_on_the_current_device_and_is_released() -> None:
    threads = torch.get_num_threads()  # torch's _pin_memory_loop sets one intra-op thread for its process
    try:
        with fake_cuda(devices=2, current=1) as cuda:
            loader = loaders.build_loader(_dataset(16), batch_size=4, num_workers=2, pin_memory=True)
            with loaders.open_iterator(loader) as it:
                batches = [next(it)]
                assert pinning.pin_thread_alive()  # running while the iterator is open
                batches += list(it)
            assert not pinning.pin_thread_alive() and not loaders.worker_processes()
    finally:
        torch.set_num_threads(threads)
    assert len(batches) == 4 and all(x.shape == (4, 3, 8, 8) and y.dtype == torch.int64 for x, y in batches)
    pins = cuda.ops("pin")
    assert len(pins) == 2 * 4 and all(op.thread != "MainThread" for op in pins), "pinned in the pin thread"
    (set_dev,) = cuda.ops("set_device_index")
    assert set_dev["device"] == 1 and set_dev.thread == pins[0].thread  # the device current at iter()
