from __future__ import annotations

import pytest
import torch

from helpers import hygiene, results


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
    hygiene.benchmark(rs, torch.device("cpu"))
    assert {"ch00.first_call_s", "ch00.steady_call_s", "ch00.matmul_time_s"} <= set(rs.keys())
