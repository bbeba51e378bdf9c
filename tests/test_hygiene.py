from __future__ import annotations

import pytest
import torch

from helpers.chapters import ch00
from helpers.chapters.ch00 import hygiene
from helpers.core import evidence, results
from helpers.ui import widgets


def test_make_op_validates() -> None:
    with pytest.raises(ValueError, match="op must be one of"):
        hygiene.make_op("fft", 8, "cpu")
    with pytest.raises(ValueError, match="n must be an integer"):
        hygiene.make_op("add", 0, "cpu")
    with pytest.raises(ValueError, match="GiB of inputs"):
        hygiene.make_op("add", 16000, "cpu")


@pytest.mark.parametrize("op", list(hygiene.OPERATIONS))
def test_ops_compute_the_right_thing(op: str) -> None:
    fn = hygiene.make_op(op, 8, "cpu")
    out = fn()
    assert out.shape == (8, 8) and torch.isfinite(out).all()


def test_demos_on_cpu() -> None:
    warm = hygiene.warmup_demo("cpu", repeats=4)
    assert warm.n == 4 and warm.metadata["warmup"] == 0
    demo = hygiene.sync_demo("cpu", n=32, repeats=3)
    assert set(demo) == {"no sync", "sync"} and demo["no sync"].metadata["sync"] is False
    if not torch.cuda.is_available():
        assert hygiene.events_vs_wall("cpu") is None
    t = hygiene.time_op("add", 32, "cpu", min_run_time=0.02)
    assert t.median_s > 0 and t.label == "add n=32"


def test_benchmark_records(monkeypatch: pytest.MonkeyPatch) -> None:
    rs = results.ResultSet.new("t", "m")
    monkeypatch.setattr(hygiene, "sync_demo", lambda device, n: {"sync": hygiene.time_op("add", 16, "cpu", 0.01)})
    told: list[float] = []
    ch00.benchmark(rs, torch.device("cpu"), progress=lambda f, t="": told.append(f))
    assert {"ch00.first_call_s", "ch00.steady_call_s", "ch00.matmul_time_s"} <= set(rs.keys())
    assert told[0] == 0.0 and told[-1] == 1.0 and told == sorted(told)
    assert {r.params["clock"] for r in rs.find("ch00.matmul_time_s")} == {"sync"}


def test_chapter_panel_measures_here_and_plots_every_run() -> None:
    import matplotlib

    matplotlib.use("Agg")
    panel = widgets.Panel.for_chapter(ch00, device=torch.device("cpu"), max_n=64, min_run_time=0.01, max_seconds=5.0)
    assert panel.controls["n"].max == 64
    for op in ("add", "copy"):
        panel.set(op=op, n=32)
        panel.click()
    assert panel.error is None, panel.error
    assert len(panel.history) == 2 and all(r.result.here for r in panel.history)
    assert panel.last.result.value.label == "copy n=32" and "measured here" in panel.last.summary
    assert "median" in ch00.panel_summary(panel.last.result)


def test_clock_rows_measured_and_recorded(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    demo = hygiene.sync_demo("cpu", n=32, repeats=3)
    rows = hygiene.clock_timings(demo, n=32)
    assert [r.clock for r in rows] == ["no sync", "sync"] and hygiene.clock_timings(None, n=32) == []
    assert "no sync, n=32: median" in hygiene.clock_table(rows)[0]

    monkeypatch.setenv("WORKBOOK_REFERENCE_DIR", str(tmp_path))
    assert not evidence.recorded("the gap", "ch00.matmul_time_s", convert=hygiene.clock_timings_from_records)
    rs = results.ResultSet.new("t", "m")
    for r in rows:
        rs.add("ch00.matmul_time_s", r.median_s, "s", spread={"iqr": r.iqr_s, "n": 3}, n=32, clock=r.clock)
    rs.save(tmp_path / "cpu.json")  # recorded without a GPU: no reference for GPU timings
    assert not evidence.recorded("the gap", "ch00.matmul_time_s", convert=hygiene.clock_timings_from_records)
    rs.provenance["hardware"] = {**rs.hardware, "gpu_name": "Test GPU"}
    rs.save(tmp_path / "gpu.json")
    ev = evidence.recorded("the gap", "ch00.matmul_time_s", convert=hygiene.clock_timings_from_records, clock="sync")
    assert ev.kind == "recorded" and [r.clock for r in ev.value] == ["sync"] and ev.value[0].iqr_s == rows[1].iqr_s


# --- demos bounded in time and memory (issue 15 item 10) ----------------------------------------


def test_time_op_refuses_a_size_that_would_run_for_minutes(monkeypatch: pytest.MonkeyPatch) -> None:
    import time

    monkeypatch.setattr(hygiene, "estimate_call_s", lambda op, n, device: 40.0)
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match=r"beyond the 60 s budget.*choose n <= \d+"):
        hygiene.time_op("matmul", 9000, "cpu")
    assert time.perf_counter() - t0 < 5  # refused before any big allocation or call


def test_time_op_cuts_blocks_to_fit_the_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = {}

    def fake_measure(fn, **kw):
        seen.update(kw)
        return "timed"

    monkeypatch.setattr(hygiene, "estimate_call_s", lambda op, n, device: 2.0)
    monkeypatch.setattr(hygiene, "measure", fake_measure)
    assert hygiene.time_op("add", 16, "cpu", max_seconds=20.0) == "timed"
    assert seen["blocks"] == 7  # 20 s / 2 s = 10 calls, minus 3 untimed
    with pytest.raises(ValueError, match="min_run_time must not exceed max_seconds"):
        hygiene.time_op("add", 16, "cpu", min_run_time=5.0, max_seconds=1.0)


def test_sync_demo_cuts_repeats_to_fit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hygiene, "estimate_call_s", lambda op, n, device: 1.0)
    demo = hygiene.sync_demo("cpu", n=32, repeats=40, max_seconds=20.0)
    assert demo["sync"].n == demo["no sync"].n == 8  # (20 - 3) // 2
    with pytest.raises(ValueError, match="choose n <="):
        hygiene.sync_demo("cpu", n=32, repeats=40, max_seconds=5.0)


def test_estimate_scales_with_the_work() -> None:
    small = hygiene.estimate_call_s("add", 64, "cpu")
    assert small > 0
    assert hygiene.calls_within("add", 64, "cpu", wanted=5, overhead=1, max_seconds=60.0) == 5


def test_make_op_checks_available_ram(monkeypatch: pytest.MonkeyPatch) -> None:
    from helpers.pipeline import transfer

    monkeypatch.setattr(transfer, "_memory_now", lambda: (8 << 30, 100 << 20))  # 100 MiB available
    with pytest.raises(ValueError, match="host RAM"):
        hygiene.make_op("add", 4096, "cpu")  # 192 MiB of inputs
    assert hygiene.make_op("add", 512, "cpu")() is not None


def test_make_op_refuses_a_device_not_present() -> None:
    if torch.cuda.is_available():
        pytest.skip("checks the no-GPU message")
    with pytest.raises(ValueError, match="not available on this machine"):
        hygiene.make_op("add", 8, "cuda:3")
