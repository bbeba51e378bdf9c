"""Chapter 05's CUDA-only helpers, run on a CPU with the CUDA stand-ins of :mod:`tests.cuda_standin`:
the hazards' fixes wait on an event recorded on the stream their copy went to (on ``cuda:1`` while
``cuda:0`` is current too), and the sync counter synchronises the device it counts. No time made by
a stand-in is asserted or shown.
"""

from __future__ import annotations

import torch
from cuda_standin import fake_cuda

from helpers.pipeline import overlap

CUDA1 = torch.device("cuda", 1)


def test_d2h_fix_waits_for_its_copy_on_the_copys_device() -> None:
    with fake_cuda(devices=2, current=0) as cuda:
        x_gpu = torch.ones(16).to(CUDA1)
        out = torch.full((16,), -1.0)
        assert overlap._d2h_fix(x_gpu, out) == 0
    copy = [op for op in cuda.ops("copy") if op["direction"] == "d2h"]
    assert len(copy) == 1 and copy[0].stream is cuda.default[1] and copy[0]["non_blocking"]
    (record,) = cuda.ops("record")
    assert record.stream is copy[0].stream, "the event must follow the D2H copy on cuda:1's stream"
    (wait,) = cuda.host_syncs()
    assert wait["event"] is record["event"] and cuda.log.index(wait) > cuda.log.index(record)


def test_mutation_fix_waits_for_the_copy_before_refilling_its_source() -> None:
    with fake_cuda(devices=2, current=0) as cuda:
        dst = torch.zeros(8).to(CUDA1)
        src = torch.ones(8).pin_memory()
        overlap._mutation_fix(src, dst)
        assert torch.equal(dst.cpu(), torch.ones(8))  # the copy read the ones, not the refill's twos
    kinds = [op.kind for op in cuda.log if op.kind in ("copy", "record", "host_sync", "fill_pinned")]
    assert kinds[:4] == ["copy", "copy", "record", "host_sync"]  # zeros -> dst, then src -> dst, event, wait
    copy, record = cuda.log[[op.kind for op in cuda.log].index("record") - 1], cuda.ops("record")[0]
    assert copy.kind == "copy" and copy.stream is record.stream is cuda.default[1]


def test_sync_counter_synchronises_the_device_it_counts() -> None:
    with fake_cuda(devices=2, current=0) as cuda:
        overlap._count_syncs(lambda: None, CUDA1)
    syncs = cuda.host_syncs()
    assert len(syncs) == 2 and all(op["device"] == 1 for op in syncs)  # before and after fn, on cuda:1
    assert overlap._count_syncs(lambda: None, torch.device("cpu"))[0] is None  # nothing to count on a CPU
