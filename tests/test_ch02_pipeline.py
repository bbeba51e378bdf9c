"""Chapter 02's reader-built code: the timed copy loop (``time_copy``), the pipeline's ``to_device``,
the helpers that take them (``copies.sweep``, the live panel's ``ch02.panel_run(copy_fn=...)``), and
the chapter module (:mod:`helpers.chapters.ch02`: its GPU curves as an Evidence, its panel, its benchmark).

The chapter's own cells are read from the committed notebook and executed here, so what is tested
is what the reader runs. Tests that need a GPU say so in their skip reason (``tools.gpucheck``
selects them with ``--cuda-only``).
"""

from __future__ import annotations

import functools
import json
import statistics
import time

import pytest
import torch

from helpers.chapters import ch02
from helpers.chapters.ch02 import copies, pin_costs
from helpers.chapters.ch02.model import KiB, MiB
from helpers.core import evidence
from helpers.core.progress import no_progress
from helpers.core.results import ResultSet
from helpers.pipeline import transfer as T
from helpers.ui import codecells, widgets

HAS_CUDA = torch.cuda.is_available()


def _chapter_code_cells() -> list[str]:
    nb = json.loads(codecells.notebook_path("02").read_text(encoding="utf-8"))
    return ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code"]


def _time_copy_cell() -> str:
    found = [c for c in _chapter_code_cells() if "def time_copy(" in c]
    assert len(found) == 1, "chapter 02 defines time_copy in exactly one code cell"
    return found[0]


def _namespace(device: str | torch.device) -> dict:
    """What the chapter's setup cell gives its cells: torch, time, functools, DEVICE."""
    return {
        "torch": torch,
        "time": time,
        "functools": functools,
        "statistics": statistics,
        "DEVICE": torch.device(device),
    }


def chapter_time_copy():
    ns = _namespace("cpu")
    exec(compile(_time_copy_cell(), "<chapter 02: time_copy>", "exec"), ns)
    return ns["time_copy"]


def chapter_pipeline(device: str | torch.device) -> dict:
    ns = _namespace(device)
    for cell in codecells.pipeline_cells("02"):
        exec(compile(cell, "<chapter 02: pipeline>", "exec"), ns)
    return ns


# -- the cells themselves -----------------------------------------------------------


def test_time_copy_cell_is_short_and_teaches_the_loop():
    cell = _time_copy_cell()
    assert len([ln for ln in cell.splitlines() if ln.strip()]) <= 20
    for token in (
        ".pin_memory()",
        "non_blocking=True",
        "torch.cuda.Event(enable_timing=True)",
        "torch.cuda.current_stream(device)",
        "start.record(stream)",
        "end.record(stream)",
        "end.synchronize()",
        "elapsed_time",
        "warmup",
        "time.perf_counter()",
    ):
        assert token in cell, f"the timed copy loop should show {token}"
    # The pin happens once, before the timed loop, not inside it.
    assert cell.index(".pin_memory()") < cell.index("for _ in range(warmup + repeats):              #")


def test_pipeline_cell_defines_the_staged_copy():
    cells = codecells.pipeline_cells("02")
    assert len(cells) == 1
    defs = codecells.definitions(cells[0])
    assert set(defs) == {"staging", "stage", "to_device"}
    stage = defs["stage"]
    # The race guard: wait for the previous copy before the refill, record after queuing the copy.
    assert (
        stage.index("copied.synchronize()")
        < stage.index("buf.copy_(t)")
        < stage.index("buf.to(DEVICE, non_blocking=True)")
        < stage.index("copied.record(torch.cuda.current_stream(DEVICE))")
    )
    assert ".pin_memory()" in defs["staging"] and "lru_cache" in defs["staging"]
    assert "x.to(DEVICE), y.to(DEVICE)" in defs["to_device"]


def test_chapter_shows_the_diff_against_chapter_01():
    assert any('codecells.show_diff("01", "to_device"' in c for c in _chapter_code_cells())


# -- time_copy on this machine --------------------------------------------------------


def test_time_copy_on_a_cpu_times_a_host_memcpy():
    time_copy = chapter_time_copy()
    src = torch.arange(64 * KiB, dtype=torch.int64).to(torch.uint8)
    seconds = time_copy(src, torch.device("cpu"), False, 4)
    assert len(seconds) == 4 and all(s > 0 for s in seconds)
    # pinned=True cannot pin on a CPU device; the CPU branch never tries.
    assert len(time_copy(src, torch.device("cpu"), True, 2, warmup=0)) == 2


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_time_copy_on_cuda_times_both_kinds():  # pragma: no cover - GPU only
    time_copy = chapter_time_copy()
    src = torch.ones(4 * MiB, dtype=torch.uint8)
    for pinned in (False, True):
        seconds = time_copy(src, torch.device("cuda"), pinned, 5)
        assert len(seconds) == 5 and all(s > 0 for s in seconds)
    assert not src.is_pinned()  # the reader's buffer is pinned as a copy, never in place


# -- copies.sweep: loops, alternates, records ---------------------------------------


def test_sweep_with_the_chapter_function_on_a_cpu():
    sizes = [4 * KiB, 64 * KiB, 1 * MiB]
    out = copies.sweep(chapter_time_copy(), sizes, device="cpu", repeats=3, rounds=2)
    assert list(out) == [("h2h", "pageable")]
    sw = out[("h2h", "pageable")]
    assert sw.sizes() == sizes and all(p.n == 6 and p.median_s > 0 for p in sw.points)
    assert sw.label.startswith("host memcpy") and "not a GPU copy" in sw.method and "time_copy()" in sw.method
    assert sw.source == "measured here (CPU memcpy)"


def test_sweep_calls_a_cpu_function_with_pageable_only():
    calls = []

    def fake(src, device, pinned, repeats):
        calls.append((src.numel(), src.dtype, device.type, pinned, repeats, src.is_contiguous()))
        return [1e-6 * (1 + src.numel() / 1e6)] * repeats

    progress = []
    out = copies.sweep(
        fake,
        [4 * KiB, 16 * KiB],
        device="cpu",
        repeats=2,
        rounds=3,
        progress=lambda f, text="": progress.append((f, text)),
    )
    # core.rounds.alternate: the order of the calls reversed every other round
    order = [4 * KiB, 16 * KiB, 16 * KiB, 4 * KiB, 4 * KiB, 16 * KiB]
    assert calls == [(n, torch.uint8, "cpu", False, 2, True) for n in order]
    assert len(progress) == 7 and "round 3/3" in progress[-2][1] and progress[-1] == (1.0, "done")
    assert out[("h2h", "pageable")].points[0].n == 6


def test_sweep_alternates_pageable_and_pinned_rounds_on_cuda():
    # No GPU needed: the CUDA stand-ins answer for the device, and the fake copy function touches none.
    from cuda_standin import fake_cuda

    calls = []

    def fake(src, device, pinned, repeats):
        calls.append((src.numel(), "pinned" if pinned else "pageable"))
        return 2e-6 if pinned else 3e-6  # one number is accepted as one sample

    with fake_cuda(devices=1):
        out = copies.sweep(fake, [4 * KiB, 8 * KiB], device="cuda", repeats=1, rounds=2)
    assert calls == [
        (4 * KiB, "pageable"),
        (4 * KiB, "pinned"),
        (8 * KiB, "pageable"),
        (8 * KiB, "pinned"),
        (8 * KiB, "pinned"),
        (8 * KiB, "pageable"),
        (4 * KiB, "pinned"),
        (4 * KiB, "pageable"),
    ]
    assert set(out) == {("h2d", "pageable"), ("h2d", "pinned")}
    pinned = out[("h2d", "pinned")]
    assert pinned.label == "H2D pinned" and pinned.device == "a stand-in GPU (no numbers)" and pinned.points[0].n == 2
    assert [p.median_s for p in pinned.points] == [2e-6, 2e-6]
    ratios = copies.speedup_by_size(out[("h2d", "pageable")], pinned)
    assert [r for _, r in ratios] == pytest.approx([1.5, 1.5])


@pytest.mark.parametrize("bad", [None, [], [-1.0], ["soon"], [float("nan")], "abc", True])
def test_sweep_refuses_a_function_that_returns_no_times(bad):
    with pytest.raises(ValueError, match="copy_fn"):
        copies.sweep(lambda *a: bad, [4 * KiB], device="cpu", repeats=1, rounds=1)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(copy_fn=42), "copy_fn"),
        (dict(sizes=[]), "sizes"),
        (dict(sizes=[0]), "sizes"),
        (dict(repeats=0), "repeats"),
        (dict(rounds=0), "rounds"),
    ],
)
def test_sweep_validates_its_arguments(kwargs, match):
    args = dict(copy_fn=lambda *a: [1e-6], sizes=[4 * KiB], device="cpu", repeats=1, rounds=1) | kwargs
    with pytest.raises(ValueError, match=match):
        copies.sweep(**args)


@pytest.mark.skipif(HAS_CUDA, reason="checks the refusal on a machine without CUDA")
def test_sweep_refuses_a_cuda_device_that_is_not_there():
    with pytest.raises(ValueError, match="device='cuda' is not available on this machine"):
        copies.sweep(lambda *a: [1e-6], [4 * KiB], device="cuda")


def test_sweep_refuses_more_host_memory_than_is_free(monkeypatch):
    monkeypatch.setattr(T, "_memory_now", lambda: (8 * 1024**3, 1 * 1024**3))
    with pytest.raises(ValueError, match="sizes"):
        copies.sweep(lambda *a: [1e-6], [1024**3], device="cpu")


# -- the panel with the reader's function ----------------------------------------------


def _panel_run(size_mib, direction, memory, dtype, **context):
    context.setdefault("copy_fn", chapter_time_copy())
    return ch02.panel_run(
        no_progress,
        device=context.pop("device", "cpu"),
        size_mib=size_mib,
        direction=direction,
        memory=memory,
        dtype=dtype,
        **context,
    )


def test_panel_run_uses_the_readers_function_without_cuda(tmp_path, monkeypatch):
    monkeypatch.setenv("WORKBOOK_REFERENCE_DIR", str(tmp_path))
    seen = []

    def my_copy(src, device, pinned, repeats):
        seen.append((src.dtype, src.numel(), device.type, pinned, repeats))
        return [1e-4] * repeats

    result = _panel_run(0.25, "h2d", "pinned", "float32", copy_fn=my_copy)
    reading = result.value
    assert isinstance(result, evidence.Evidence) and result.here and "my_copy()" in result.source
    assert seen == [(torch.float32, 256 * KiB, "cpu", False, 10)]  # 0.25 MiB of pixels, 4 bytes each; 10 copies
    assert reading.measured is None and reading.host is not None
    assert reading.host.direction == "h2h" and reading.host.median_s == pytest.approx(1e-4)
    assert "my_copy()" in reading.host.method and "not a GPU copy" in reading.host.method
    assert "not a transfer to a GPU" in ch02.panel_summary(result)


def test_panel_run_with_the_chapter_function(tmp_path, monkeypatch):
    monkeypatch.setenv("WORKBOOK_REFERENCE_DIR", str(tmp_path))
    reading = _panel_run(0.25, "h2d", "pageable", "uint8", copy_fn=chapter_time_copy()).value
    assert reading.host is not None and reading.host.n == 10 and reading.host.gbps > 0


@pytest.mark.skipif(HAS_CUDA, reason="checks the no-GPU path")
def test_panel_run_without_cuda_explains_and_measures_host(tmp_path, monkeypatch):
    monkeypatch.setenv("WORKBOOK_REFERENCE_DIR", str(tmp_path))
    calls = []
    gpu = evidence.recorded("the GPU copy sweeps", "ch02.copy_time", convert=ch02.recorded_sweeps)
    result = ch02.panel_run(
        lambda f, text="": calls.append(f),
        device="cpu",
        size_mib=0.25,
        direction="d2h",
        memory="pinned",
        dtype="float32",
        copy_fn=chapter_time_copy(),
        gpu=gpu,
    )
    reading = result.value
    assert not gpu and reading.nbytes == 4 * 256 * KiB and calls[-1] == 1.0
    assert reading.measured is None and reading.reference is None and reading.host is not None
    s = ch02.panel_summary(result)
    assert "No CUDA device" in s and "make gpu-check" in s and "not a transfer to a GPU" in s
    assert "Pinning is impossible" in s
    with pytest.raises(ValueError, match="dtype"):
        _panel_run(1, "h2d", "pinned", "int64")
    monkeypatch.setattr(T, "_memory_now", lambda: (32 * 2**30, 3 * 2**30))
    with pytest.raises(ValueError, match="host RAM"):  # 2 x 1 GiB: more than half of the 3 GiB available
        _panel_run(256, "h2d", "pageable", "float32", copy_fn=chapter_time_copy())


def _reference_file(tmp_path):
    rs = ResultSet.new("ref", "unit test")
    rs.provenance["hardware"]["gpu_name"] = "Test GPU"
    rs.provenance["report"]["link_bandwidth_gbps"] = 31.5
    rs.provenance["report"]["link_description"] = "PCIe Gen4 x16 (theoretical, per direction)"
    for n in (4096, MiB):
        rs.add(
            "ch02.copy_time",
            1e-5 + n / 2e10,
            "s",
            spread={"iqr_s": 0.0, "n": 5},
            direction="h2d",
            memory="pageable",
            nbytes=n,
        )
    rs.save(tmp_path / "ref.json")


def test_the_gpu_sweeps_say_plainly_when_none_is_recorded(tmp_path, monkeypatch):
    monkeypatch.setenv("WORKBOOK_REFERENCE_DIR", str(tmp_path))
    gpu = evidence.recorded("the GPU copy sweeps", "ch02.copy_time", convert=ch02.recorded_sweeps)
    assert not gpu and gpu.kind in ("missing", "published")  # published: others' figures, cited, never drawn
    assert "No reference results" in gpu.source and "make gpu-check" in gpu.source
    assert "none measured here and none recorded" in ch02.sweeps_caption(gpu)


def test_the_gpu_sweeps_load_a_recorded_file(tmp_path, monkeypatch):
    _reference_file(tmp_path)
    monkeypatch.setenv("WORKBOOK_REFERENCE_DIR", str(tmp_path))
    gpu = evidence.recorded("the GPU copy sweeps", "ch02.copy_time", convert=ch02.recorded_sweeps)
    assert gpu.kind == "recorded" and "Test GPU" in gpu.source and "not this machine" in gpu.source
    ref = gpu.value
    assert list(ref.sweeps) == [("h2d", "pageable")] and ref.sweeps[("h2d", "pageable")].sizes() == [4096, MiB]
    assert ref.gpu == "Test GPU" and ref.ceiling == (31.5, "PCIe Gen4 x16 (theoretical, per direction)")
    assert any("link ceiling: 31.5 GB/s" in line for line in ref.lines())
    assert ch02.sweeps_caption(gpu).startswith("GPU curves: Recorded on")
    if not HAS_CUDA:
        reading = _panel_run(1, "h2d", "pageable", "uint8", gpu=gpu).value
        assert reading.reference is not None and reading.reference.nbytes == MiB
        assert "Test GPU" in reading.note and reading.ceiling == ref.ceiling


def test_the_panel_is_three_lines_and_draws_its_runs(tmp_path, monkeypatch):
    import matplotlib

    matplotlib.use("Agg")
    _reference_file(tmp_path)
    monkeypatch.setenv("WORKBOOK_REFERENCE_DIR", str(tmp_path))
    gpu = evidence.recorded("the GPU copy sweeps", "ch02.copy_time", convert=ch02.recorded_sweeps)
    host = copies.sweep(chapter_time_copy(), [4 * KiB, 64 * KiB], device="cpu", repeats=2, rounds=1)[
        ("h2h", "pageable")
    ]
    panel = widgets.Panel.for_chapter(ch02, device="cpu", copy_fn=chapter_time_copy(), gpu=gpu, host=host)
    assert set(panel.controls) == {"size_mib", "direction", "memory", "dtype"}
    for size in (0.25, 1):
        panel.set(size_mib=size, memory="pageable")
        panel.click()
        assert panel.error is None, panel.error
    assert [r.result.value.nbytes for r in panel.history] == [256 * KiB, MiB]
    assert len(panel.history[-1].result.value.background) == 2  # the recorded curve and the host memcpy


# -- the chapter's benchmark ------------------------------------------------------------


class _FakeResults:
    """Stands in for helpers.core.results.ResultSet.add (records only)."""

    def __init__(self):
        self.records = []

    def add(self, key, value, unit, spread=None, **params):
        self.records.append({"key": key, "value": value, "unit": unit, "params": params, "spread": spread or {}})


@pytest.mark.skipif(HAS_CUDA, reason="checks the no-GPU path")
def test_benchmark_without_cuda_records_only_host_copies():
    res, seen = _FakeResults(), []
    ch02.benchmark(res, "cpu", sizes=[4 * KiB, 64 * KiB], progress=lambda f, text="": seen.append(f))
    assert {r["key"] for r in res.records} == {"ch02.host_copy_time"}
    assert [r["params"]["nbytes"] for r in res.records] == [4 * KiB, 64 * KiB]
    assert all(r["unit"] == "s" and r["value"] > 0 and r["spread"]["n"] >= 1 for r in res.records)
    assert seen[0] == 0.0 and seen[-1] == 1.0


def test_benchmark_writes_into_a_real_resultset():
    rs = ResultSet.new("test", "unit test")
    ch02.benchmark(rs, "cpu", sizes=[4 * KiB])
    assert rs.find("ch02.host_copy_time", nbytes=4 * KiB)
    with pytest.raises(ValueError, match="sizes"):
        ch02.benchmark(rs, "cpu", sizes=[0])


# -- the pipeline's to_device ---------------------------------------------------------


def test_to_device_on_a_cpu_is_chapter_01s_copy():
    ns = chapter_pipeline("cpu")
    x = torch.randint(0, 256, (4, 3, 8, 8), dtype=torch.uint8)
    y = torch.arange(4)
    xd, yd = ns["to_device"](x, y)
    assert xd is x and yd is y  # x.to("cpu") is x: nothing pinned, nothing copied
    assert ns["staging"].cache_info().currsize == 0  # no pinned buffer was ever asked for


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_to_device_on_cuda_never_mixes_batches():  # pragma: no cover - GPU only
    ns = chapter_pipeline("cuda")
    gen = torch.Generator().manual_seed(0)
    shape = (64, 3, 224, 224)
    batches = [
        (torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen), torch.randint(0, 10, (64,))) for _ in range(12)
    ]
    slow = torch.randn(4096, 4096, device="cuda")
    arrived = []
    for x, y in batches:  # GPU work queued ahead of every copy: the DMA lags the host, as in training
        for _ in range(3):
            slow = slow @ slow / 64
        arrived.append(ns["to_device"](x, y))
    torch.cuda.synchronize()
    for (x, y), (xd, yd) in zip(batches, arrived):
        assert xd.is_cuda and torch.equal(xd.cpu(), x) and torch.equal(yd.cpu(), y)
    assert ns["staging"].cache_info().currsize == 2
    buf, _ = ns["staging"](shape, torch.uint8)
    assert buf.is_pinned()


# -- the chapter's GPU paths (run by tools.gpucheck --cuda-only) ------------------


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_measure_sweeps_on_cuda_times_h2d_with_time_copy_and_d2h_with_the_helper():  # pragma: no cover - GPU only
    sizes = [4 * KiB, 64 * KiB, 1 * MiB]
    gpu = evidence.measure_or_recall(
        "the GPU copy sweeps",
        "cuda",
        key="ch02.copy_time",
        convert=ch02.recorded_sweeps,
        measure=lambda: ch02.measure_sweeps(chapter_time_copy(), sizes, device="cuda", repeats=3, rounds=2),
    )
    assert gpu.here
    sweeps = gpu.value.sweeps
    assert set(sweeps) == {(d, m) for d in ("h2d", "d2h") for m in ("pageable", "pinned")}
    assert all(sw.sizes() == sizes and all(p.median_s > 0 for p in sw.points) for sw in sweeps.values())
    assert "time_copy()" in sweeps[("h2d", "pinned")].method and sweeps[("h2d", "pinned")].points[0].n == 6
    assert "CUDA events on a side stream" in sweeps[("d2h", "pageable")].method
    assert sweeps[("d2h", "pinned")].points[0].n == 6 and gpu.value.gpu == torch.cuda.get_device_name()
    assert gpu.value.ceiling is not None or gpu.value.ceiling_note


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_transfer_sweep_on_cuda_copies_both_directions():  # pragma: no cover - GPU only
    for direction in ("h2d", "d2h"):
        for memory in ("pageable", "pinned"):
            sw = copies.transfer_sweep(direction, memory, [4 * KiB, 1 * MiB], device="cuda", repeats=4)
            assert (sw.direction, sw.memory) == (direction, memory) and [p.n for p in sw.points] == [4, 4]
            assert all(p.median_s > 0 for p in sw.points)


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_panel_and_benchmark_on_cuda():  # pragma: no cover - GPU only
    for direction in ("h2d", "d2h"):
        result = _panel_run(1, direction, "pinned", "uint8", device="cuda", copy_fn=chapter_time_copy())
        assert result.here and result.value.measured is not None and result.value.host is None
    rs = ResultSet.new("test", "unit test")
    ch02.benchmark(rs, "cuda", sizes=[4 * KiB, 64 * KiB])
    for key in (
        "ch02.host_copy_time",
        "ch02.copy_time",
        "ch02.fit.bandwidth",
        "ch02.pin.cold",
        "ch02.host_held",
        "ch02.wire_time",
    ):
        assert rs.find(key), key
    assert len(rs.find("ch02.copy_time")) == 8
    rows = pin_costs.pin_costs_from_records(rs, rs.find("ch02.pin"))
    assert rows and rows[0].nbytes == 64 * KiB
    assert pin_costs.host_blocking_from_records(rs, rs.find("ch02.host_held")) is not None
    assert copies.wire_from_records(rs, rs.find("ch02.wire_time")).byte_ratio == 4
