from __future__ import annotations

import time

import pytest
import torch

from helpers.core import timing


def test_summarize_statistics() -> None:
    t = timing.summarize("x", [3.0, 1.0, 2.0, 100.0, 2.0])
    assert t.median_s == 2.0 and t.min_s == 1.0 and t.max_s == 100.0 and t.n == 5
    assert t.mean_s == pytest.approx(21.6)
    assert t.iqr_s == pytest.approx(1.0)  # q75=3, q25=2
    assert t.metadata["mode"] in ("quick", "full")
    with pytest.raises(ValueError, match="at least one sample"):
        timing.summarize("x", [])


def test_measure_cpu() -> None:
    x = torch.randn(64, 64)
    t = timing.measure(lambda: x @ x, label="mm", min_run_time=0.02, blocks=5)
    assert t.n == 5 and t.median_s > 0 and t.iqr_s >= 0
    assert "torch.utils.benchmark" in t.metadata["method"]
    assert t.metadata["num_threads"] == torch.get_num_threads()
    assert "median" in str(t)


def test_measure_bad_input() -> None:
    with pytest.raises(ValueError, match="callable"):
        timing.measure(42)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="min_run_time"):
        timing.measure(lambda: None, min_run_time=0)
    with pytest.raises(ValueError, match="blocks"):
        timing.measure(lambda: None, blocks=1)


def test_time_calls_records_each_call_and_sync_flag() -> None:
    calls = []
    t = timing.time_calls(lambda: calls.append(1), repeats=7, sync=False, warmup=2)
    assert len(calls) == 9 and t.n == 7 and "NOT synchronised" in t.metadata["method"]


def test_cuda_event_time_falls_back_on_cpu() -> None:
    t = timing.cuda_event_time(lambda: time.sleep(0.001), repeats=3, warmup=0, device="cpu")
    assert t.n == 3 and t.median_s >= 0.0009
    if not torch.cuda.is_available():
        assert "no CUDA device" in t.metadata["method"]


def test_span_recorder_cpu() -> None:
    rec = timing.SpanRecorder("cpu", run="test")
    for step in range(3):
        with rec.span("load", step):
            time.sleep(0.002)
        with rec.span("compute", step, gpu=True):  # gpu=True on CPU falls back to the host clock
            time.sleep(0.004)
    trace = rec.finish()
    assert rec.finish() is trace  # idempotent
    assert [s.name for s in trace.spans] == ["load", "compute"] * 3
    assert trace.steps() == 3 and trace.metadata["run"] == "test" and trace.metadata["device"] == "cpu"
    totals = trace.phase_totals()
    # sleep() guarantees a lower bound only (a busy machine oversleeps), so compare with that
    assert totals["compute"] >= 3 * 0.004 * 0.99 and totals["load"] >= 3 * 0.002 * 0.99
    assert trace.phase_means()["load"] == pytest.approx(totals["load"] / 3)
    busy = trace.lane_busy()
    assert set(busy) == {"host", "gpu"} and all(0 < v <= 1 for v in busy.values())
    assert sum(totals.values()) <= trace.wall_time() * 1.05
    # spans are ordered in time and never overlap on one host thread
    ends = [(s.start, s.end) for s in trace.spans]
    assert all(a[1] <= b[0] + 1e-9 for a, b in zip(ends, ends[1:]))
    again = timing.SpanTrace.from_dict(trace.to_dict())
    assert again.phase_totals() == totals
    with pytest.raises(RuntimeError, match="finished"):
        with rec.span("late", 9):
            pass


def test_span_recorder_add_and_lane_merge() -> None:
    rec = timing.SpanRecorder("cpu")
    rec.add("copy", 0, 0.0, 1.0, lane="copy stream")
    rec.add("copy", 1, 0.5, 1.5, lane="copy stream")  # overlaps: merged for busy share
    rec.add("compute", 0, 1.5, 2.0, lane="compute stream")
    trace = rec.finish()
    assert trace.wall_time() == pytest.approx(2.0)
    assert trace.lane_busy()["copy stream"] == pytest.approx(0.75)
    assert trace.lane_busy()["compute stream"] == pytest.approx(0.25)


def test_span_records_even_when_body_raises() -> None:
    rec = timing.SpanRecorder("cpu")
    with pytest.raises(KeyError):
        with rec.span("load", 0):
            raise KeyError("x")
    assert rec.finish().spans[0].name == "load"


def test_timing_quartiles_from_samples():
    from helpers.core.timing import summarize

    t = summarize("x", [1.0, 2.0, 3.0, 4.0, 5.0])
    assert t.quartiles_s == (2.0, 4.0)
    assert t.quartiles_s[1] - t.quartiles_s[0] == pytest.approx(t.iqr_s)
    one = summarize("y", [0.5])
    assert one.quartiles_s == (one.median_s, one.median_s)


def test_time_chapters_writes_where_the_setup_cells_read() -> None:
    """tools/time_chapters.py's default output is the file helpers.core.config reads the Run All times from."""
    import importlib.util
    from pathlib import Path

    from helpers.core import config

    path = Path(__file__).resolve().parents[1] / "tools" / "time_chapters.py"
    spec = importlib.util.spec_from_file_location("time_chapters", path)
    assert spec is not None and spec.loader is not None
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    assert tool.OUT == config._chapter_times_file()
    assert tool.OUT.is_file()


def test_measure_names_the_wall_clock_for_any_cpu_spelling() -> None:
    from helpers.core.timing import measure

    t = measure(lambda: None, device="cpu:0", min_run_time=0.01)
    assert "(wall clock)" in t.metadata["method"]


_NOISY_IMPORT = """
import importlib.abc, importlib.util, sys

class Noisy(importlib.abc.MetaPathFinder):  # torch 2.7's cpp_extension print, and a line that must stay
    def find_spec(self, name, path, target=None):
        if name != "torch.utils.benchmark":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        real = spec.loader.exec_module

        def exec_module(module):
            print("No CUDA runtime is found, using CUDA_HOME='/usr/local'", file=sys.stderr)
            print("a warning the reader should see", file=sys.stderr)
            real(module)

        spec.loader.exec_module = exec_module
        return spec

sys.meta_path.insert(0, Noisy())
import helpers.core.timing
"""


def test_importing_timing_drops_only_torchs_no_cuda_runtime_line() -> None:
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-c", _NOISY_IMPORT], capture_output=True, text=True, cwd=root, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "a warning the reader should see" in done.stderr and "No CUDA runtime" not in done.stderr
