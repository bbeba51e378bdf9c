"""Tests for helpers.capstone: steps as data, same job in every configuration, records, plots."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import pytest
import torch
from torch.utils.data import DataLoader

from helpers import capstone as C
from helpers.results import ResultSet


_JOB_SPEC = C.job_spec


@pytest.fixture(autouse=True, scope="module")
def _quick_data_set():
    """Quick mode for this module: the small generated data set (seconds), not the full one."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("WORKBOOK_QUICK", "1")
        C._CACHE.clear()
        yield
    C._CACHE.clear()


def tiny(regime: str = "data-bound", **kw) -> C.JobSpec:
    base = dict(width=2, depth=1, batch_size=8, crop_size=32, train_items=24, warm_steps=1)
    base.update(kw)
    return _JOB_SPEC(regime, **base)


def test_steps_are_cumulative_and_each_adds_one_change() -> None:
    assert C.STEP_NAMES == ("baseline", "pinned", "workers", "persistent", "uint8", "prefetcher")
    cfgs = C.configurations(workers=2)
    assert [s.name for s, _ in cfgs] == list(C.STEP_NAMES)
    assert cfgs[0][1] == C.Settings()
    last = cfgs[-1][1]
    assert (last.num_workers, last.pin_memory, last.persistent_workers, last.prefetch_factor, last.output,
            last.prefetcher) == (2, True, True, 4, "uint8", True)
    for (_, a), (_, b) in zip(cfgs, cfgs[1:]):
        changed = [f for f in ("num_workers", "pin_memory", "persistent_workers", "output", "prefetcher")
                   if getattr(a, f) != getattr(b, f)]
        assert len(changed) == 1


def test_settings_validation() -> None:
    with pytest.raises(ValueError, match="persistent workers need workers"):
        C.settings_for(["persistent"])
    with pytest.raises(ValueError, match="step"):
        C.settings_for(["turbo"])
    with pytest.raises(ValueError, match="regime"):
        C.job_spec("io-bound")
    assert C.settings_for(["uint8"]).prefetch_factor is None


def test_only_pinning_and_prefetcher_need_cuda() -> None:
    assert [s.name for s in C.STEPS if not C.effective_on(s, "cpu")] == ["pinned", "prefetcher"]


def test_pipeline_efficiency_and_tolerance() -> None:
    assert C.pipeline_efficiency(900.0, {"loader": 1000.0, "copy": None, "compute": 3000.0}) == pytest.approx(0.9)
    assert C.pipeline_efficiency(10.0, {"copy": None}) is None
    assert C.accuracy_tolerance(256) == pytest.approx(0.0625)
    with pytest.raises(ValueError):
        C.accuracy_tolerance(0)


def test_sampler_order_is_seeded_and_encodes_the_epoch() -> None:
    a, b = C.EpochSampler(10, 6, seed=3), C.EpochSampler(10, 6, seed=3)
    e0, e1 = list(a), list(a)
    assert e0 == list(b) and len(e0) == 6 and all(0 <= i < 10 for i in e0)
    assert all(10 <= i < 20 for i in e1) and [i - 10 for i in e1] != e0


def test_crops_do_not_depend_on_the_loading_process() -> None:
    ds = C._train_items(tiny(), "uint8")
    idx = [3, 17, 25, 4]
    direct = [ds[i][0] for i in idx]
    loader = DataLoader(ds, batch_size=1, sampler=idx, num_workers=2)
    try:
        via_workers = [x[0] for x, _ in loader]
    finally:
        del loader
    assert all(torch.equal(a, b) for a, b in zip(direct, via_workers))


def test_same_job_same_accuracy_across_configurations() -> None:
    spec = tiny()
    base = C.run_config(C.Settings(), spec, "cpu", name="baseline")
    other = C.run_config(C.settings_for(["workers", "persistent", "uint8"], workers=2), spec, "cpu", name="stack")
    ok, msg = C.check_accuracies([base, other], num_classes=6, n_val=256, above_chance=False)
    assert ok, msg
    for r in (base, other):
        assert r.steps == 3 and r.samples == 24 and r.epoch_s > 0
        assert 0 <= r.compute_busy <= 1 and 0 <= r.data_stall <= 1
        assert {"load", "forward", "backward", "optimizer"} <= set(r.trace.phase_totals())
        assert r.stages["copy"] is None and r.stages["loader"] > 0 and r.stages["compute"] > 0
        assert r.efficiency == pytest.approx(r.throughput / min(r.stages["loader"], r.stages["compute"]))
    assert "normalize" in other.trace.phase_totals()


def test_waterfall_benchmark_records_and_plots(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(C, "job_spec", lambda regime: tiny(regime))
    monkeypatch.setattr(C, "default_workers", lambda: 1)
    rs = ResultSet.new("test", "unit test")
    C.benchmark(rs, "cpu")
    for key in ("ch06.waterfall.step_time", "ch06.epoch_time", "ch06.throughput", "ch06.speedup", "ch06.accuracy",
                "ch06.compute_busy", "ch06.data_stall", "ch06.efficiency", "ch06.stage_alone"):
        assert rs.find(key), key
    steps = rs.find("ch06.waterfall.step_time", regime="compute-bound")
    assert [r.params["stage"] for r in sorted(steps, key=lambda r: r.params["order"])] == list(C.STEP_NAMES)
    assert rs.find("ch06.speedup", stage="baseline", regime="data-bound")[0].value == pytest.approx(1.0)
    assert "ch06.trace.data-bound.prefetcher" in rs.artifacts
    wf = C.run_waterfall("data-bound", "cpu", names=["baseline", "workers"], spec=tiny(), workers=1, stages=False)
    assert len(wf.speedups()) == 2 and wf.best_step() == "workers" and "baseline" in wf.table()
    C.plot_waterfall(wf)
    C.plot_shares(wf)
    C.plot_reference_waterfall("data-bound")


def test_panel_run_and_bad_toggles(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(C, "job_spec", lambda regime: tiny(regime))
    r = C.panel_run(None, regime="compute-bound", baseline=True, uint8=True, pinned=False)
    assert r.settings.output == "uint8" and r.regime == "compute-bound"
    assert "s/epoch" in C.panel_summary(r)
    with pytest.raises(ValueError, match="step"):
        C.panel_run(None, regime="data-bound", turbo=True)


def test_regimes_tiny_model_for_data_bound_and_threads_in_the_spec() -> None:
    from helpers.models import build_model, flops_per_sample

    specs = {r: C.job_spec(r) for r in C.REGIMES}
    flops = {r: flops_per_sample(build_model(width=s.width, depth=s.depth), s.crop_size) for r, s in specs.items()}
    assert flops["compute-bound"] > 20 * flops["data-bound"]
    assert specs["data-bound"].depth == 1 and all(s.threads == C.compute_threads() for s in specs.values())
    assert C.compute_threads(workers=64) == 1
    with pytest.raises(ValueError, match="depth"):
        C.job_spec("data-bound", depth=0)


def test_main_threads_sets_and_restores() -> None:
    before = torch.get_num_threads()
    with C.main_threads(1):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before
    with pytest.raises(RuntimeError):
        with C.main_threads(1):
            raise RuntimeError("boom")
    assert torch.get_num_threads() == before
    with pytest.raises(ValueError, match="threads"):
        with C.main_threads(0):
            pass


def test_warm_up_drains_the_pass_only_when_asked() -> None:
    seen: list[int] = []

    class Source:
        def __iter__(self):
            for i in range(5):
                seen.append(i)
                yield i

    assert C._warm_batches(Source(), 2, drain=False) == [0, 1] and seen == [0, 1]
    seen.clear()
    assert C._warm_batches(Source(), 2, drain=True) == [0, 1] and seen == [0, 1, 2, 3, 4]


def test_compare_threads_runs_back_to_back_and_restores() -> None:
    before = torch.get_num_threads()
    rs = C.compare_threads(tiny(), "baseline", "cpu", threads=(1, 2))
    assert [r.trace.metadata["threads"] for r in rs] == [1, 2] and all(r.stages == {} for r in rs)
    assert "2 threads" in rs[1].label and torch.get_num_threads() == before
    with pytest.raises(ValueError, match="step"):
        C.compare_threads(tiny(), "turbo")


def test_efficiency_above_one_is_marked_as_noise() -> None:
    r = C.run_config(C.Settings(), tiny(), "cpu", name="baseline", stages=False)
    r.efficiency = 1.2
    wf = C.Waterfall("data-bound", tiny(), "cpu", [r])
    assert "1.20*" in wf.table() and "noise" in wf.table()


def test_panel_checkboxes_stay_consistent() -> None:
    c = C.panel_controls()
    assert set(c) == {"regime", *C.STEP_NAMES[1:]}
    c["persistent"].value = True
    assert c["workers"].value is True
    c["workers"].value = False
    assert c["persistent"].value is False
    c["uint8"].value = True
    assert c["workers"].value is False  # uint8 needs nothing else
    on = [k for k in C.STEP_NAMES[1:] if c[k].value]
    C.settings_for(on)  # whatever the reader ticks is a valid configuration
