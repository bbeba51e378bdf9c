"""Chapter 02's CUDA-only code, run on a CPU with the CUDA stand-ins of :mod:`tests.cuda_standin`.

What is checked is real: which device and stream each copy and each event go to (with ``DEVICE`` on
``cuda:1`` while ``cuda:0`` is current, the case where ``Event.record()`` without a stream guards
nothing), that a pinned source is pinned once and copied with ``non_blocking=True``, the dtype and
shape that arrive, the order of refill / copy / record / wait in the staging buffer, and that the
timed loop holds no host sync but the one it means. No time made by a stand-in is asserted or shown.
"""

from __future__ import annotations

import pytest
import torch
from cuda_standin import fake_cuda
from test_ch02_pipeline import chapter_pipeline as _pipeline
from test_ch02_pipeline import chapter_time_copy as _time_copy

from helpers.chapters.ch02 import pin_costs

CUDA1 = torch.device("cuda", 1)


@pytest.mark.parametrize("current", [0, 1])
@pytest.mark.parametrize("pinned", [True, False])
def test_time_copy_brackets_each_copy_on_the_copys_stream(current: int, pinned: bool) -> None:
    time_copy = _time_copy()
    src = torch.arange(4096, dtype=torch.int64).to(torch.uint8)
    with fake_cuda(devices=2, current=current) as cuda:
        seconds = time_copy(src, CUDA1, pinned, 3, warmup=2)
    assert len(seconds) == 3 and all(s > 0 for s in seconds)
    copies = cuda.ops("copy")
    assert len(copies) == 5  # warm-up + timed
    assert all(c["device"] == CUDA1 and c.stream is cuda.default[1] for c in copies)
    assert all(c["non_blocking"] == pinned and c["src_pinned"] == pinned for c in copies)
    assert all(c["shape"] == (4096,) and c["dtype"] == torch.uint8 for c in copies)
    assert len(cuda.ops("pin")) == (1 if pinned else 0)  # pinned once, before the loop
    assert not src.is_pinned()  # the reader's tensor is left as it was
    # Each copy is bracketed by two events on ITS stream, then the host waits for the end event, once.
    log = cuda.log
    for k, i in enumerate(n for n, op in enumerate(log) if op.kind == "copy"):
        start, end, wait = log[i - 1], log[i + 1], log[i + 2]
        assert start.kind == "record" and start.stream is log[i].stream, f"copy {k}: start event not on cuda:1's stream"
        assert end.kind == "record" and end.stream is log[i].stream, f"copy {k}: end event not on cuda:1's stream"
        assert wait.kind == "host_sync" and wait["event"] is end["event"]
    assert len(cuda.host_syncs()) == 5  # one per copy: end.synchronize(); no torch.cuda.synchronize()


def test_time_copy_on_the_current_device_still_brackets_its_copies() -> None:
    """The plain case (one GPU, cuda = cuda:0 current): the same order."""
    with fake_cuda(devices=1, current=0) as cuda:
        _time_copy()(torch.ones(64, dtype=torch.uint8), torch.device("cuda"), True, 2, warmup=0)
    kinds = [op.kind for op in cuda.log]
    assert kinds == ["pin"] + ["record", "copy", "record", "host_sync"] * 2
    assert {op.stream.index for op in cuda.log if op.stream is not None} == {0}


@pytest.mark.parametrize("current", [0, 1])
def test_stage_guards_each_refill_with_an_event_on_the_copys_stream(current: int) -> None:
    ns = _pipeline(CUDA1)
    gen = torch.Generator().manual_seed(0)
    batches = [
        (torch.randint(0, 256, (4, 3, 8, 8), dtype=torch.uint8, generator=gen), torch.randint(0, 10, (4,)))
        for _ in range(3)
    ]
    with fake_cuda(devices=2, current=current) as cuda:
        arrived = [ns["to_device"](x, y) for x, y in batches]
        for (x, y), (xd, yd) in zip(batches, arrived):  # placement, dtype, shape and values
            assert xd.device == CUDA1 and yd.device == CUDA1
            assert (xd.dtype, xd.shape, yd.dtype, yd.shape) == (x.dtype, x.shape, y.dtype, y.shape)
            assert torch.equal(xd.cpu(), x) and torch.equal(yd.cpu(), y)
    assert ns["staging"].cache_info().currsize == 2  # one buffer (and event) for the images, one for the labels
    assert len(cuda.ops("pin")) == 2
    log = cuda.log
    copies = [i for i, op in enumerate(log) if op.kind == "copy" and op["direction"] == "h2d"]
    assert len(copies) == 6
    for i in copies:
        copy = log[i]
        assert copy.stream is cuda.default[1] and copy["non_blocking"] and copy["src_pinned"]
        record = log[i + 1]
        assert record.kind == "record" and record.stream is copy.stream, "the event must go to the copy's stream"
    # Each refill of a buffer waits (host) for the event recorded after that buffer's previous copy.
    last_record: dict[int, object] = {}  # buffer id -> its event, as last recorded
    for i, op in enumerate(log):
        if op.kind == "fill_pinned" and op["buffer"] in last_record:
            wait = log[i - 1]
            assert wait.kind == "host_sync" and wait["event"] is last_record[op["buffer"]]
        if op.kind == "copy" and op["direction"] == "h2d":
            last_record[op["src"]] = log[i + 1]["event"]
    # No other host sync in to_device: one event wait per staged tensor (the first waits on a fresh event).
    assert len([op for op in cuda.host_syncs() if op["what"] == "event.synchronize"]) == 6


def test_on_a_cpu_device_to_device_copies_nothing_even_with_cuda_present() -> None:
    ns = _pipeline(torch.device("cpu"))
    x, y = torch.zeros(2, 3), torch.zeros(2)
    with fake_cuda() as cuda:
        xd, yd = ns["to_device"](x, y)
    assert xd is x and yd is y and cuda.log == []


def _by_device(cuda) -> set[int]:
    return {op.stream.index for op in cuda.log if op.stream is not None} | {
        op["device"] for op in cuda.host_syncs() if "device" in op.detail
    }


def test_measure_sweeps_times_both_directions_on_the_chosen_device() -> None:
    """ch02.measure_sweeps: H2D by the reader's time_copy, D2H by transfer_sweep on a side stream; all on cuda:1."""
    from helpers.chapters import ch02

    sizes = [4 * 1024, 64 * 1024]
    with fake_cuda(devices=2, current=0) as cuda:
        result = ch02.measure_sweeps(_time_copy(), sizes, device=CUDA1, repeats=2, rounds=1)
    assert set(result.sweeps) == {("h2d", "pageable"), ("h2d", "pinned"), ("d2h", "pageable"), ("d2h", "pinned")}
    assert all(sw.sizes() == sizes for sw in result.sweeps.values())
    assert _by_device(cuda) == {1}, "something ran on cuda:0, the current device, not the one measured"
    log = cuda.log
    for i, op in enumerate(log):
        if op.kind != "copy" or op["direction"] == "d2d":
            continue
        if op["direction"] == "h2d" and op["shape"] in ((4 * 1024,), (64 * 1024,)) and log[i - 1].kind == "record":
            assert log[i - 1].stream is op.stream is cuda.default[1]  # the reader's loop: DEVICE's stream
        if op["direction"] == "d2h":
            assert op.stream is not cuda.default[1] and op.stream.index == 1  # transfer_sweep's side stream
            assert op["non_blocking"] == op["src_pinned"] or not op["src_pinned"]
            if log[i - 1].kind == "record":  # a timed copy: bracketed by events on its own stream
                assert log[i - 1].stream is op.stream is log[i + 1].stream and log[i + 1].kind == "record"
    d2h_records = [op for op in cuda.ops("record") if op.stream is not cuda.default[1]]
    assert d2h_records and all(op.stream.index == 1 for op in d2h_records)


def test_host_blocking_probe_queues_each_copy_behind_the_gpu_work_on_its_device() -> None:
    with fake_cuda(devices=2, current=0) as cuda:
        held = pin_costs.host_blocking_probe(device=CUDA1, gpu_work_s=0.01, nbytes=1 << 20)
    assert set(held.held_s) == {"pageable", "pageable, non_blocking=True", "pinned, non_blocking=True"}
    assert _by_device(cuda) == {1}
    # the GPU work's calibration, its kernels and events go to the device probed, not to the current one
    assert cuda.ops("kernel") and all(op.stream.index == 1 for op in cuda.ops("kernel"))
    assert cuda.ops("record") and all(op.stream.index == 1 for op in cuda.ops("record"))
    assert all(op["device"] == 1 for op in cuda.host_syncs() if "device" in op.detail)
    log = cuda.log
    timed = [i for i, op in enumerate(log) if op.kind == "copy" and log[i - 1].kind == "kernel"]
    assert len(timed) == 9  # each case, 3 times: the work, then at once the copy call whose time is taken
    for i in timed:
        assert log[i - 1].stream is log[i].stream is cuda.default[1]  # same stream: the copy waits for the work
        assert log[i - 2].kind == "host_sync" and log[i + 1].kind == "host_sync"  # synced before and after only


@pytest.mark.parametrize(("direction", "memory"), [("h2d", "pinned"), ("h2d", "pageable"), ("d2h", "pinned")])
def test_the_panel_measures_on_the_chosen_device_with_the_readers_function(direction: str, memory: str) -> None:
    """ch02.panel_run with CUDA: an H2D copy by the reader's time_copy, a D2H one by transfer_sweep, on cuda:1."""
    from helpers.chapters import ch02
    from helpers.core.progress import no_progress

    with fake_cuda(devices=2, current=0) as cuda:
        ev = ch02.panel_run(
            no_progress,
            device=CUDA1,
            size_mib=1,
            direction=direction,
            memory=memory,
            dtype="float32",
            copy_fn=_time_copy(),
        )
    reading = ev.value
    assert ev.here and reading.nbytes == 4 << 20 and reading.measured is not None and reading.host is None
    assert (reading.measured.direction, reading.measured.memory) == (direction, memory)
    assert _by_device(cuda) == {1}
    timed = [op for op in cuda.ops("copy") if op["direction"] == direction and op["shape"] == (1 << 20,)]
    host_side = "src_pinned" if direction == "h2d" else "dst_pinned"
    assert timed and all(op["dtype"] == torch.float32 and op[host_side] == (memory == "pinned") for op in timed)
    log = cuda.log
    for op in timed:
        i = log.index(op)
        if log[i - 1].kind == "record":  # a timed copy: both events on the copy's stream
            assert log[i - 1].stream is op.stream is log[i + 1].stream


def test_benchmark_records_every_key_with_all_gpu_work_on_the_chosen_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """ch02.benchmark's CUDA path: every curve, the pin costs, the probe, the wire and the allocator's blocks."""
    from helpers.chapters import ch02
    from helpers.chapters.ch02 import copies, model
    from helpers.core.results import ResultSet

    # The stand-in's times are one fixed value, so no size dependence to fit: the fit is given.
    monkeypatch.setattr(copies.Sweep, "fit", lambda self: model.LatencyBandwidthFit(1e-5, 1e10, 2, 0.0))
    rs = ResultSet.new("test", "unit test")
    with fake_cuda(devices=2, current=0) as cuda:
        ch02.benchmark(rs, CUDA1, sizes=[4096, 65536])
    assert len(rs.find("ch02.copy_time")) == 8 and len(rs.find("ch02.fit.bandwidth")) == 4
    assert {r.spread["n"] for r in rs.find("ch02.copy_time")} == {10}  # quick: 2 rounds x 5 copies, every curve
    cases = {"pageable", "pageable, non_blocking=True", "pinned, non_blocking=True"}
    assert {r.params["case"] for r in rs.find("ch02.host_held")} == cases
    assert {r.key for r in rs.find("ch02.pin")} == {f"ch02.pin.{k}" for k in pin_costs.RECORD_FIELDS}
    assert rs.find("ch02.wire_time") and rs.find("ch02.host_copy_time")
    assert {op.stream.index for op in cuda.log if op.stream is not None} == {1}
