"""The timing helpers' CUDA paths, run on a CPU with the CUDA stand-ins of :mod:`tests.cuda_standin`.

Two stand-in devices, ``cuda:0`` current and ``cuda:1`` measured: the case where ``Event.record()`` with
no stream (the current device's stream) guards nothing and ``torch.cuda.synchronize()`` with no device
waits for the wrong GPU. Checked: every event goes on ``cuda:1``'s stream (or the stream given), every
sync names ``cuda:1``, work that takes no device (``torch.cuda._sleep``) is queued on ``cuda:1``, and the
caller's current device is left as it was. No time made by a stand-in is asserted or shown.
"""

from __future__ import annotations

import ast
import json
from typing import Any

import pytest
import torch
from cuda_standin import FakeCuda, fake_cuda

from helpers.chapters.ch05 import feeding
from helpers.core import timing
from helpers.ui import codecells

CUDA1 = torch.device("cuda", 1)
#: What a SpanRecorder on cuda:1 does when made: a sync, its reference event, a sync (cuda_event_time times with one).
_RECORDER = ["host_sync", "record", "host_sync"]


def _records(cuda: FakeCuda) -> list[Any]:
    return cuda.ops("record")


def _device_syncs(cuda: FakeCuda) -> list[int]:
    """The device index each device-wide sync (torch.cuda / torch.accelerator.synchronize) waited for."""
    return [op["device"] for op in cuda.host_syncs() if "device" in op.detail]


@pytest.mark.parametrize("current", [0, 1])
def test_gpu_delay_calibrates_and_sleeps_on_the_measured_device(current: int) -> None:
    with fake_cuda(devices=2, current=current) as cuda:
        delay = timing.GpuDelay(CUDA1, seconds=0.01)
        calibration = len(cuda.log)
        delay()
        assert cuda.current == current  # the caller's device is left as it was
        side = torch.cuda.Stream(CUDA1)
        with torch.cuda.stream(side):
            delay()  # a stream the caller made current on cuda:1 is kept
    kernels = cuda.ops("kernel")
    assert len(kernels) == 4  # warm-up + probe, then the two calls
    assert all(k.stream is cuda.default[1] for k in kernels[:3]), "the sleep went to the current device's stream"
    assert kernels[3].stream is side
    records = _records(cuda)
    assert len(records) == 3 and all(r.stream is cuda.default[1] for r in records), "calibration events not on cuda:1"
    # warm-up, then cuda_event_time's recorder: sync, reference event, sync, (start, probe, end), sync
    assert [op.kind for op in cuda.log[:calibration]] == ["kernel"] + _RECORDER + [
        "record",
        "kernel",
        "record",
        "host_sync",
    ]
    assert _device_syncs(cuda) == [1, 1, 1]
    assert delay.cycles > 0


@pytest.mark.parametrize("current", [0, 1])
def test_calibrated_compute_times_its_products_on_the_measured_device(
    current: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    with fake_cuda(devices=2, current=current) as cuda:

        def mm(a: torch.Tensor, b: torch.Tensor, *, out: torch.Tensor) -> torch.Tensor:
            # The operands live on cuda:1 (made with device=dev): ATen guards to that device and takes ITS
            # current stream, whichever device is current. A stand-in: no product is made.
            cuda._op("kernel", cuda.current_stream(CUDA1), what="mm")
            return out.zero_()

        monkeypatch.setattr(torch, "mm", mm)
        compute = feeding.calibrated_compute(CUDA1, target_s=0.002)
        calibration = len(cuda.log)
        out = compute(torch.ones(4, 3))
    assert float(out) == 12.0  # the batch's sum plus one element of the (stand-in, zero) product
    log = cuda.log[:calibration]
    assert [op.kind for op in log] == ["kernel"] * 5 + _RECORDER + ["record"] + ["kernel"] * 5 + ["record", "host_sync"]
    records = _records(cuda)
    assert len(records) == 3 and all(r.stream is cuda.default[1] for r in records), "calibration events not on cuda:1"
    assert all(k.stream is cuda.default[1] for k in cuda.ops("kernel"))
    assert _device_syncs(cuda) == [1, 1, 1]
    # one product takes a fifth of the calibration's (stand-in) 1 ms: 0.002 s is 10 products, on cuda:1
    assert [op.kind for op in cuda.log[calibration:]] == ["kernel"] * 10


@pytest.mark.parametrize("current", [0, 1])
def test_cuda_event_time_brackets_each_call_on_the_measured_device(current: int) -> None:
    with fake_cuda(devices=2, current=current) as cuda:
        t = timing.cuda_event_time(lambda: torch.cuda._sleep(10), repeats=3, warmup=1, device=CUDA1)
        assert cuda.current == current
    # warm-up kernel, the recorder's syncs around its reference event, (start, kernel, end) x 3, a final sync
    assert [op.kind for op in cuda.log] == ["kernel"] + _RECORDER + ["record", "kernel", "record"] * 3 + ["host_sync"]
    on_streams = [op.stream for op in cuda.log if op.kind in ("record", "kernel")]
    assert all(s is cuda.default[1] for s in on_streams), "events or fn's work not on cuda:1's stream"
    assert _device_syncs(cuda) == [1, 1, 1]
    assert t.n == 3 and t.metadata["device"] == "cuda:1" and "cuda:1" in t.metadata["method"]


def test_cuda_event_time_on_cuda_without_an_index_times_the_current_device() -> None:
    with fake_cuda(devices=2, current=1) as cuda:
        t = timing.cuda_event_time(lambda: torch.cuda._sleep(10), repeats=2, warmup=0, device="cuda")
    assert {op.stream for op in cuda.log if op.stream is not None} == {cuda.default[1]}
    assert _device_syncs(cuda) == [1, 1, 1] and t.metadata["device"] == "cuda:1"


@pytest.mark.parametrize("current", [0, 1])
def test_span_recorder_records_every_event_on_the_measured_device(current: int) -> None:
    with fake_cuda(devices=2, current=current) as cuda:
        rec = timing.SpanRecorder(CUDA1)
        side = torch.cuda.Stream(CUDA1)
        start = len(cuda.log)
        with rec.span("compute", 0, gpu=True):
            assert cuda.current == 1  # the body's work that takes no device goes to cuda:1 too
            torch.cuda._sleep(10)
        with rec.span("h2d", 0, gpu=True, lane="copy stream", stream=side):
            pass
        with rec.span("load", 1):  # a host span: no event, the device untouched
            assert cuda.current == current
        assert cuda.current == current
        trace = rec.finish()
    ref = cuda.log[1]
    assert ref.kind == "record" and ref.stream is cuda.default[1], "the reference event is not on cuda:1's stream"
    spans = cuda.log[start:]
    assert [(op.kind, op.stream) for op in spans if op.kind != "host_sync"] == [
        ("record", cuda.default[1]),
        ("kernel", cuda.default[1]),
        ("record", cuda.default[1]),
        ("record", side),
        ("record", side),
    ]
    assert _device_syncs(cuda) == [1, 1, 1]  # before and after the reference event, and finish()
    assert [(s.name, s.on_gpu) for s in trace.spans] == [("compute", True), ("h2d", True), ("load", False)]
    assert trace.metadata["device"] == "cuda:1"


def test_span_recorder_refuses_a_stream_of_another_device() -> None:
    with fake_cuda(devices=2, current=0):
        rec = timing.SpanRecorder(CUDA1)
        with pytest.raises(ValueError, match=r"stream is on cuda:0 but this recorder times cuda:1"):
            with rec.span("h2d", 0, gpu=True, stream=torch.cuda.Stream(torch.device("cuda", 0))):
                pass


def test_span_recorder_on_cuda_without_an_index_keeps_the_device_current_when_made() -> None:
    with fake_cuda(devices=2, current=1) as cuda:
        rec = timing.SpanRecorder("cuda")
        torch.cuda.set_device(0)  # the current device changes afterwards: the spans stay on cuda:1
        with rec.span("compute", 0, gpu=True):
            pass
        rec.finish()
    assert {op.stream for op in _records(cuda)} == {cuda.default[1]}
    assert set(_device_syncs(cuda)) == {1}


def test_synchronize_without_a_device_waits_for_every_device() -> None:
    with fake_cuda(devices=2, current=0) as cuda:
        timing.synchronize()
        timing.synchronize(None)
    assert _device_syncs(cuda) == [0, 1, 0, 1]


def test_synchronize_names_the_device() -> None:
    with fake_cuda(devices=2, current=0) as cuda:
        timing.synchronize(CUDA1)
        timing.synchronize("cpu")  # nothing to wait for
    assert _device_syncs(cuda) == [1]


@pytest.mark.parametrize("current", [0, 1])
def test_measure_synchronises_the_measured_device_before_every_clock_read(current: int) -> None:
    calls = []
    with fake_cuda(devices=2, current=current) as cuda:
        t = timing.measure(lambda: calls.append(1), device=CUDA1, min_run_time=0.001, blocks=3, warmup=1)
    syncs = _device_syncs(cuda)
    assert len(syncs) >= 1 + 2 * (1 + 3)  # the warm-up's, then two clock reads per timed block
    assert set(syncs) == {1}, "a clock read waited for another device than cuda:1"
    assert t.n == 3 and "synchronised with cuda:1" in t.metadata["method"]


def test_measure_of_host_work_reads_a_plain_clock() -> None:
    with fake_cuda(devices=2, current=0) as cuda:
        t = timing.measure(lambda: None, device="cpu", min_run_time=0.001, blocks=3, warmup=0)
    assert _device_syncs(cuda) == [] and "wall clock" in t.metadata["method"]


# -- the chapters' own cells ----------------------------------------------------------------------------------------

#: Calls that act on the *current* device when given no argument, as the chapters' code would write them.
_CURRENT_DEVICE_CALLS = {
    "synchronize": "torch.cuda.synchronize() waits for the current device only: name the device",
    "current_stream": "torch.cuda.current_stream() is the current device's stream: name the device",
    "default_stream": "torch.cuda.default_stream() is the current device's stream: name the device",
    "Stream": "torch.cuda.Stream() is made on the current device: name the device",
}


def _current_device_calls(source: str) -> list[str]:
    """Calls in ``source`` that fall back to the current CUDA device: ``torch.cuda.X()`` of the table above with
    no argument, and ``event.record()`` with no stream (``torch.cuda.current_stream()``). Strings are not code."""
    code = "\n".join("" if line.lstrip().startswith(("%", "!")) else line for line in source.splitlines())
    found = []
    for node in ast.walk(ast.parse(code)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)) or node.args or node.keywords:
            continue
        name, owner = node.func.attr, ast.unparse(node.func.value)
        if owner in ("torch.cuda", "cuda") and name in _CURRENT_DEVICE_CALLS:
            found.append(f"line {node.lineno}: {_CURRENT_DEVICE_CALLS[name]}")
        elif name == "record":
            found.append(f"line {node.lineno}: {owner}.record() records on the current device's stream: pass one")
    return found


def test_no_chapter_cell_times_or_guards_on_the_current_device_by_default() -> None:
    """A cell that runs on ``DEVICE`` names it: with ``DEVICE = cuda:1`` a bare ``torch.cuda.synchronize()`` lets
    the clock stop while cuda:1 is still working (chapter 01's epoch timing did), a bare ``record()`` guards nothing."""
    problems = []
    for chapter in codecells.chapters():
        nb = json.loads(codecells.notebook_path(chapter).read_text(encoding="utf-8"))
        for i, cell in enumerate(nb["cells"]):
            if cell["cell_type"] == "code":
                problems += [
                    f"chapter {chapter}, cell {i}, {p}" for p in _current_device_calls("".join(cell["source"]))
                ]
    assert not problems, "\n".join(problems)


def test_the_cell_check_sees_what_it_looks_for() -> None:
    bad = "torch.cuda.synchronize()\nstart.record()\ns = torch.cuda.Stream()\nprint('torch.cuda.synchronize()')"
    assert len(_current_device_calls(bad)) == 3  # the one in a string is no call
    good = "%time x = 1\ntorch.cuda.synchronize(DEVICE)\nstart.record(torch.cuda.current_stream(DEVICE))\n"
    good += "done.synchronize()\nwith torch.cuda.stream(torch.cuda.Stream(DEVICE)):\n    pass"
    assert _current_device_calls(good) == []
