"""Tests for helpers.chapters.ch06.capstone: steps as data, same job in every configuration, records, plots."""

from __future__ import annotations

from types import SimpleNamespace

import matplotlib

matplotlib.use("Agg")

import pytest
import torch
from _ch06_support import flops, quick_data_set, tiny  # noqa: F401  (quick_data_set: autouse, for this module)

from helpers.chapters import ch06
from helpers.chapters.ch06 import calibration as K
from helpers.chapters.ch06 import capstone as C
from helpers.chapters.ch06 import doctor as D
from helpers.chapters.ch06 import job
from helpers.core import evidence
from helpers.core.results import ResultSet


def test_steps_are_cumulative_and_each_adds_one_change() -> None:
    assert C.STEP_NAMES == ("baseline", "pinned", "workers", "persistent", "uint8", "prefetcher")
    cfgs = C.configurations(workers=2)
    assert [s.name for s, _ in cfgs] == list(C.STEP_NAMES)
    assert cfgs[0][1] == C.Settings()
    last = cfgs[-1][1]
    assert (
        last.num_workers,
        last.pin_memory,
        last.persistent_workers,
        last.prefetch_factor,
        last.output,
        last.prefetcher,
    ) == (2, True, True, 4, "uint8", True)
    for (_, a), (_, b) in zip(cfgs, cfgs[1:]):
        changed = [
            f
            for f in ("num_workers", "pin_memory", "persistent_workers", "output", "prefetcher")
            if getattr(a, f) != getattr(b, f)
        ]
        assert len(changed) == 1


def test_settings_validation() -> None:
    with pytest.raises(ValueError, match="persistent workers need workers"):
        job.settings_for(["persistent"])
    with pytest.raises(ValueError, match="step"):
        ch06.panel_run(None, device="cpu", turbo=True)  # the entry point checks the step names
    with pytest.raises(ValueError, match="regime"):
        C.job_spec("io-bound")
    assert job.settings_for(["uint8"]).prefetch_factor is None


def test_only_pinning_uint8_and_prefetcher_need_cuda() -> None:
    """uint8 on a CPU: batches() normalises on the same processor in the same process either way."""
    assert [s.name for s in C.STEPS if not C.effective_on(s, "cpu")] == ["pinned", "uint8", "prefetcher"]


def test_pipeline_efficiency_and_tolerance() -> None:
    e = C.pipeline_efficiency(900.0, {"loader": 1000.0, "copy": None, "compute": 3000.0})
    assert e is not None and e.value == pytest.approx(0.9)
    assert C.pipeline_efficiency(10.0, {"copy": None}) is None
    assert C.accuracy_tolerance(256) == pytest.approx(0.0625)
    with pytest.raises(ValueError):
        C.accuracy_tolerance(0)


def test_crops_do_not_depend_on_the_loading_process() -> None:
    ds = job.train_items(tiny(train_items=32))
    idx = [3, 17, 25, 4]
    direct = [ds[i][0] for i in idx]
    from helpers.pipeline.loaders import build_loader, release

    loader = build_loader(ds, batch_size=1, sampler=idx, shuffle=False, num_workers=2)
    try:
        via_workers = [x[0] for x, _ in loader]
    finally:
        release(loader)
    assert all(torch.equal(a, b) for a, b in zip(direct, via_workers))


def test_same_job_same_accuracy_across_configurations() -> None:
    spec = tiny()
    base = C.run_config(C.Settings(), spec, "cpu", name="baseline")
    other = C.run_config(job.settings_for(["workers", "persistent", "uint8"], workers=2), spec, "cpu", name="stack")
    ok, msg = C.check_accuracies([base, other], num_classes=6, n_val=256, above_chance=False)
    assert ok, msg
    for r in (base, other):
        assert r.steps == 3 and r.samples == 24 and r.epoch_s > 0
        assert 0 <= r.compute_busy <= 1 and 0 <= r.data_stall <= 1
        assert {"batch", "train_step"} == set(r.trace.phase_totals())
        assert r.stages["copy"] is None and r.stages["loader"] > 0 and r.stages["compute"] > 0
        assert r.efficiency is not None
        assert r.efficiency.ratio == pytest.approx(r.throughput / min(r.stages["loader"], r.stages["compute"]))
    assert "batches(loader, prefetch=False, float_on_host=False)" in other.trace.metadata["calls"]


def test_waterfall_benchmark_records_and_plots(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ch06, "job_spec", lambda regime, **kw: tiny(regime))
    monkeypatch.setattr(job, "default_workers", lambda: 1)  # what settings_for reads
    fixed = {r: C.Calibration(r, 2, 1, 0.01, 0.02, True, reason="fixed for the test") for r in C.REGIMES}
    monkeypatch.setattr(ch06, "calibrate", lambda dev, **kw: fixed)
    rs = ResultSet.new("test", "unit test")
    seen = []
    ch06.benchmark(rs, "cpu", progress=lambda f, t="": seen.append(f))
    assert seen == sorted(seen) and seen[-1] == 1.0
    for key in (
        "ch06.waterfall.step_time",
        "ch06.epoch_time",
        "ch06.throughput",
        "ch06.speedup",
        "ch06.accuracy",
        "ch06.compute_busy",
        "ch06.data_stall",
        "ch06.efficiency",
        "ch06.stage_alone",
    ):
        assert rs.find(key), key
    steps = rs.find("ch06.waterfall.step_time", regime="compute-bound")
    acting = [s.name for s in C.STEPS if C.effective_on(s, "cpu")]  # on a CPU only the steps that can act there
    assert [r.params["stage"] for r in sorted(steps, key=lambda r: r.params["order"])] == acting
    assert rs.find("ch06.speedup", stage="baseline", regime="data-bound")[0].value == pytest.approx(1.0)
    assert "ch06.trace.data-bound.persistent" in rs.artifacts and not rs.find("ch06.speedup", stage="pinned")
    wf = C.run_waterfall("data-bound", "cpu", names=["baseline", "workers"], spec=tiny(), workers=1, stages=False)
    assert len(wf.speedups()) == 2 and wf.best_step() == "workers" and "baseline" in wf.table()
    C.plot_waterfall(wf)
    C.plot_shares(wf)
    C.plot_reference_waterfall("data-bound")


def test_reference_lookups_are_evidence(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """The waterfall, efficiency and timeline lookups say recorded (with provenance) or missing, never more."""
    monkeypatch.setenv("WORKBOOK_REFERENCE_DIR", str(tmp_path))
    ref = C.reference_efficiency("data-bound")
    assert not ref and ref.kind == "missing" and ref.value is None
    ax = C.plot_reference_waterfall("data-bound")  # missing: no bar, the reason instead
    assert not ax.patches and "No reference results" in ax.texts[0].get_text().replace("\n", " ")
    assert C.reference_timeline("data-bound", "prefetcher").kind == "missing"
    rs = ResultSet.new("ref", "unit test")
    for i, stage in enumerate(C.STEP_NAMES):
        p = dict(regime="data-bound", stage=stage, label=f"L{i}", order=len(C.STEP_NAMES) - 1 - i)
        rs.add("ch06.waterfall.step_time", 0.01 * (i + 1), "s", **p)
        rs.add("ch06.efficiency", 0.5 + 0.05 * i, "ratio", **p)
    rs.artifacts["ch06.trace.data-bound.prefetcher"] = {"spans": [], "metadata": {}}
    rs.save(tmp_path / "ref.json")
    ax = C.plot_reference_waterfall("data-bound")  # recorded: the bars in stacking order, their provenance
    assert "not this machine" in ax.texts[-1].get_text()  # the evidence's source, drawn last
    assert [t.get_text() for t in ax.get_xticklabels()] == [f"L{i}" for i in reversed(range(len(C.STEP_NAMES)))]
    assert [p.get_height() for p in ax.patches] == [pytest.approx(10.0 * (i + 1)) for i in reversed(range(6))]
    eff = C.reference_efficiency("data-bound")
    assert eff.kind == "recorded" and C.efficiency_lines(eff.value)[0].startswith("    L5 0.75 · L4 0.70")
    assert not C.reference_efficiency("compute-bound")  # nothing recorded for that regime
    tl = C.reference_timeline("data-bound", "prefetcher")
    assert tl.kind == "recorded" and tl.value == {"spans": [], "metadata": {}}
    with pytest.raises(ValueError, match="regime"):
        C.plot_reference_waterfall("io-bound")


def test_panel_run_and_bad_toggles(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ch06, "job_spec", lambda regime, **kw: tiny(regime))
    ev = ch06.panel_run(None, device="cpu", regime="compute-bound", baseline=True, uint8=True, pinned=False)
    assert ev.here and ev.value.settings.output == "uint8" and ev.value.spec.regime == "compute-bound"
    assert "s/epoch" in ch06.panel_summary(ev) and "measured here" in ch06.panel_summary(ev)
    with pytest.raises(ValueError, match="step"):
        ch06.panel_run(None, device="cpu", regime="data-bound", turbo=True)
    with pytest.raises(ValueError, match="regime"):
        ch06.panel_run(None, device="cpu", regime="data-bound", specs={"data-bound": tiny("compute-bound")})
    with pytest.raises(ValueError, match="regime"):
        ch06.panel_run(None, device="cpu", regime="io-bound")
    specs = {"compute-bound": tiny("compute-bound", width=3)}
    assert ch06.panel_run(None, device="cpu", regime="compute-bound", specs=specs).value.spec.width == 3


def test_panel_for_chapter_drives_the_reader_pipeline() -> None:
    """Panel.for_chapter(ch06, ...): the context (specs, pipeline) reaches every run; the result is Evidence."""
    from helpers.ui import widgets

    specs = {r: tiny(r) for r in C.REGIMES}
    panel = widgets.Panel.for_chapter(ch06, device="cpu", specs=specs, pipeline=job.reference_pipeline("cpu"))
    panel.set(regime="data-bound", workers=True)
    panel.click()
    assert panel.error is None, panel.error
    ev = panel.last.result
    assert ev.here and ev.value.spec == specs["data-bound"] and ev.value.settings.num_workers > 0
    assert ev.value.trace.metadata["pipeline"] == "examples/fast_pipeline.py"
    assert "measured here" in panel.last.summary


def test_regimes_tiny_model_for_data_bound_and_threads_in_the_spec(monkeypatch: pytest.MonkeyPatch) -> None:
    from helpers.pipeline.models import build_model, flops_per_sample

    specs = {r: C.job_spec(r) for r in C.REGIMES}
    flops = {r: flops_per_sample(build_model(width=s.width, depth=s.depth), s.crop_size) for r, s in specs.items()}
    assert flops["compute-bound"] > 20 * flops["data-bound"]
    assert (specs["data-bound"].width, specs["data-bound"].depth) == (1, 4)  # one channel at full resolution
    assert all(s.threads == job.compute_threads() for s in specs.values())
    assert all(s.warm_steps == s.steps_per_epoch and s.warm_passes > 1 for s in specs.values())  # the job learns
    monkeypatch.setattr(job, "usable_cores", lambda: 1)  # the workers take every core: the main process keeps one
    assert job.compute_threads() == 1
    with pytest.raises(ValueError, match="depth"):
        C.job_spec("data-bound", depth=0)


def test_warm_up_drains_the_pass_only_when_asked() -> None:
    seen: list[int] = []

    class Source:
        def __iter__(self):
            for i in range(5):
                seen.append(i)
                yield i

    assert job._warm_batches(Source(), 2, drain=False) == [0, 1] and seen == [0, 1]
    seen.clear()
    assert job._warm_batches(Source(), 2, drain=True) == [0, 1] and seen == [0, 1, 2, 3, 4]


def test_compare_threads_runs_back_to_back_and_restores(monkeypatch: pytest.MonkeyPatch) -> None:
    before = torch.get_num_threads()
    wf = C.run_waterfall("data-bound", "cpu", names=["baseline"], spec=tiny(threads=1), stages=False)
    wf.results[0].round_epoch_s = [0.5, 0.25, 0.75]  # as a waterfall of 3 rounds records it
    real, runs = C.run_config, []

    def spy(settings, spec, *a, **kw):  # type: ignore[no-untyped-def]
        runs.append((spec.threads, kw["stages"]))
        return real(settings, spec, *a, **kw)

    monkeypatch.setattr(C, "run_config", spy)
    lines = C.compare_threads(wf, "baseline", threads=(1, 2))
    assert runs == [(2, False)]  # run once more, without the stages alone, only at a count other than the job's
    assert (
        lines[1] == f"    1 thread(s): {wf.results[0].epoch_s:.2f} s/epoch (the waterfall's median of 3 rounds, "
        "range 0.25-0.75 s)"
    )  # the job's thread count: the waterfall's own run
    assert lines[2].startswith("    2 thread(s): ") and lines[2].endswith("(one run)")
    assert torch.get_num_threads() == before
    with pytest.raises(ValueError, match="step"):
        C.compare_threads(wf, "turbo")


def test_efficiency_above_one_is_never_shown() -> None:
    r = C.run_config(C.Settings(), tiny(), "cpu", name="baseline", stages=False)
    r.efficiency = C.Efficiency.of_ratio(1.2)
    wf = C.Waterfall("data-bound", tiny(), "cpu", [r])
    assert "1.20" not in wf.table() and "out of range" in wf.table()


def test_panel_checkboxes_stay_consistent() -> None:
    c = ch06.panel_controls()
    assert set(c) == {"regime", *C.STEP_NAMES[1:]}
    c["persistent"].value = True
    assert c["workers"].value is True
    c["workers"].value = False
    assert c["persistent"].value is False
    c["uint8"].value = True
    assert c["workers"].value is False  # uint8 needs nothing else
    on = [k for k in C.STEP_NAMES[1:] if c[k].value]
    job.settings_for(on)  # whatever the reader ticks is a valid configuration


# -- issue 14/15/19: same numerics, calibration, rounds, threads, the checklist ----------------------------------


def test_every_configuration_is_bit_identical_on_cpu() -> None:
    """One normalisation function and the same threads: float and uint8 configurations train identically."""
    spec = tiny(warm_steps=0)
    rs = [
        C.run_config(job.settings_for(n, workers=2), spec, "cpu", name="x", stages=False)
        for n in ([], ["workers", "persistent"], ["workers", "uint8", "prefetcher"])
    ]
    assert len({r.train_loss for r in rs}) == 1 and len({r.accuracy for r in rs}) == 1
    ok, msg = C.check_accuracies(rs, num_classes=6, n_val=256, above_chance=False)
    assert ok and "bit-identical" in msg
    assert job.normalizer_device_exact("cpu") and job.normalizer_device_exact("cpu", job.reference_pipeline().normalize)


def test_same_numerics_sets_and_restores_cudnn_flags() -> None:
    cudnn = torch.backends.cudnn
    before = (cudnn.deterministic, cudnn.benchmark)
    with pytest.raises(RuntimeError):
        with job.same_numerics():
            assert cudnn.deterministic is True and cudnn.benchmark is False
            raise RuntimeError("boom")
    assert (cudnn.deterministic, cudnn.benchmark) == before


def test_tolerance_grows_to_the_measured_seed_spread() -> None:
    assert C.accuracy_tolerance(256, seed_spread=0.2) == pytest.approx(0.2)
    assert C.accuracy_tolerance(256, seed_spread=0.01) == pytest.approx(0.0625)
    with pytest.raises(ValueError, match="seed_spread"):
        C.accuracy_tolerance(256, seed_spread=-1.0)


def test_run_config_sets_the_main_thread_count_where_it_measures() -> None:
    """A workers=0 row must not run on the reader's thread count while worker rows run on spec.threads."""
    ref = job.reference_pipeline("cpu")
    seen: list[int] = []

    def spy(model, optimizer, x, y):
        seen.append(torch.get_num_threads())
        return ref.train_step(model, optimizer, x, y)

    pipe = C.Pipeline(ref.make_loader, ref.batches, spy)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for names in ([], ["workers"]):
            C.run_config(job.settings_for(names, workers=1), tiny(threads=1), "cpu", stages=False, pipeline=pipe)
    finally:
        torch.set_num_threads(before)
    assert seen and set(seen) == {1}


def test_loaders_are_built_by_the_pipelines_make_loader() -> None:
    ref = job.reference_pipeline("cpu")
    calls: list[dict] = []

    def spy(dataset, batch_size, **kw):
        calls.append(dict(kw, n=len(dataset), batch_size=batch_size))
        return ref.make_loader(dataset, batch_size, **kw)

    C.run_config(
        job.settings_for(["workers"], workers=1),
        tiny(),
        "cpu",
        stages=True,
        pipeline=C.Pipeline(spy, ref.batches, ref.train_step),
    )
    assert dict(workers=1, pin=False, prefetch_factor=2, persistent=False, n=24, batch_size=8) in calls


def _fake_measure(per_flop_s: float, crop: int, oom_above: int | None = None):
    calls: list[tuple[int, int]] = []

    def measure(width: int, depth: int) -> float:
        calls.append((width, depth))
        if oom_above is not None and flops(width, depth, crop) > oom_above:
            raise torch.OutOfMemoryError("CUDA out of memory (fake)")
        return per_flop_s * flops(width, depth, crop)

    return measure, calls


def test_calibration_grows_the_model_on_a_fast_device() -> None:
    # An H200-like device: the CPU's wide model (96, 3) takes far less than the loader's batch.
    measure, calls = _fake_measure(1e-12, 224)
    loader_s = 0.2
    cal = K.choose_model("compute-bound", measure, loader_s, start=(96, 3), crop_size=224, budget_s=1e9)
    assert cal.reached and cal.compute_s >= 2 * loader_s and calls[0] == (96, 3) and len(calls) <= 6
    assert flops(cal.width, cal.depth, 224) > flops(96, 3, 224)
    assert "smallest model" in cal.reason  # the first model tried is the start: calls[0] above


def test_calibration_keeps_a_model_that_already_fits_and_shrinks_an_oversized_one() -> None:
    measure, calls = _fake_measure(1e-9, 64)
    t96 = 1e-9 * flops(96, 3, 64)
    cal = K.choose_model("compute-bound", measure, t96 / 3, start=(96, 3), crop_size=64)
    assert (cal.width, cal.depth) == (96, 3) and cal.reached and calls == [(96, 3)]
    measure, calls = _fake_measure(1e-9, 64)
    cal = K.choose_model("compute-bound", measure, t96 / 50, start=(96, 3), crop_size=64, budget_s=1e9)
    assert cal.reached and 2 <= cal.ratio <= 50 and flops(cal.width, cal.depth, 64) < flops(96, 3, 64)


def test_calibration_says_when_a_regime_is_not_reached() -> None:
    measure, _ = _fake_measure(1e-15, 224, oom_above=10**11)
    cal = K.choose_model("compute-bound", measure, 10.0, start=(96, 3), crop_size=224, budget_s=1e9)
    assert not cal.reached and "NOT reached" in cal.reason
    clock = iter(range(0, 10**6, 100))  # every probe "takes" 100 s: the budget stops the search
    measure, calls = _fake_measure(1e-15, 224)
    cal = K.choose_model(
        "compute-bound", measure, 10.0, start=(96, 3), crop_size=224, budget_s=30, clock=lambda: float(next(clock))
    )
    assert len(calls) == 1 and "budget" in cal.reason and not cal.reached
    measure, _ = _fake_measure(1e-9, 64)
    slow = K.choose_model("data-bound", measure, 1e-9, start=(2, 1), crop_size=64)
    assert not slow.reached and "not reached" in slow.reason
    fast = K.choose_model("data-bound", measure, 1.0, start=(2, 1), crop_size=64)
    assert fast.reached and (fast.width, fast.depth) == (2, 1)


def test_model_flops_matches_the_model() -> None:
    """The calibration counts FLOPs on the meta device (no memory): the same count as the real model's."""
    from helpers.pipeline.models import build_model, flops_per_sample

    for w, d, c in [(2, 1, 64), (12, 3, 32), (8, 4, 64)]:
        assert flops(w, d, c) == flops_per_sample(build_model(width=w, depth=d), c)


def _result(name: str, times: list[float]) -> C.ConfigResult:
    from helpers.core.timing import SpanTrace

    label = next(s.label for s in C.STEPS if s.name == name)
    return C.ConfigResult(
        name=name,
        label=label,
        settings=C.Settings(),
        spec=tiny(),
        epoch_s=sorted(times)[len(times) // 2],
        steps=3,
        samples=24,
        accuracy=0.5,
        train_loss=1.0,
        trace=SpanTrace(spans=[], metadata={}),
        compute_busy=0.5,
        data_stall=0.5,
        round_epoch_s=times,
    )


def test_waterfall_gains_come_from_rounds_and_noise_is_called_noise() -> None:
    wf = C.Waterfall(
        "data-bound",
        tiny(),
        "cpu",
        [
            _result("baseline", [1.0, 1.02, 0.99]),
            _result("pinned", [0.99, 1.03, 1.0]),  # pinning cannot act on a CPU, and within noise: no effect
            _result("workers", [0.5, 0.52, 0.5]),  # back to back: ratios 1.98, 1.98, 2.0 -> faster
            _result("persistent", [0.6, 0.62, 0.6]),  # 0.83, 0.84, 0.83 -> slower
            _result("uint8", [0.59, 0.63, 0.6]),  # 1.02, 0.98, 1.0: uint8 cannot act on a CPU -> no effect
        ],
        rounds=3,
    )
    assert wf.verdicts() == ["", "needs CUDA", "gain", "slower", "needs CUDA"]  # measured anyway: still no verdict
    assert wf.noise_floor() == pytest.approx(0.04, abs=0.02)
    assert wf.gains()[2] == pytest.approx(1.98, rel=0.01)
    assert wf.best_step() == "workers" and wf.best_steps() == ["workers"]  # never the step that cannot act
    table = wf.table()
    assert "within noise" in table and "median of 3 round(s)" in table and "no effect" in table
    assert max(len(line) for line in table.splitlines()) <= 110  # a notebook wraps longer lines mid-word
    (pinned_row,) = [line for line in table.splitlines() if line.startswith("+ pinned memory")]
    assert "needs CUDA" in pinned_row and " x" not in pinned_row  # no ratio for a step that cannot act here
    assert any("pinned memory" in e and "needs CUDA" in e and "noise" in e for e in wf.expectations())
    costly = C.Waterfall(
        "data-bound",
        tiny(),
        "cpu",
        [_result("uint8", [1.0, 1.01, 1.0]), _result("prefetcher", [1.3, 1.31, 1.3])],
        rounds=3,
    )
    assert costly.verdicts() == ["", "needs CUDA"]  # cannot act on a CPU: its x0.77 is noise, not a verdict
    assert "not the step's effect" in costly.expectations()[0]
    small = C.Waterfall(
        "data-bound",
        tiny(),
        "cpu",
        [_result("baseline", [1.0, 1.0, 1.0]), _result("workers", [0.98, 0.8, 0.95])],
        rounds=3,
    )
    assert small.verdicts() == ["", "within noise"]  # every round agrees (x1.02-1.25), x1.05 within their scatter
    same = C.Waterfall(
        "data-bound",
        tiny(),
        "cpu",
        [_result("baseline", [1.0, 1.02, 0.99]), _result("workers", [1.0, 1.01, 0.99])],
        rounds=3,
    )
    assert same.verdicts() == ["", "no effect"]  # every round within the run-to-run variation of x1.00
    assert set(same.verdicts()[1:] + small.verdicts()[1:] + wf.verdicts()[1:]) <= set(C.VERDICTS)
    one = C.Waterfall("data-bound", tiny(), "cpu", [_result("baseline", [1.0]), _result("workers", [0.5])])
    assert one.verdicts() == ["", "one round"]  # one round: no judgement of the noise


def test_a_slow_round_that_slows_both_neighbours_does_not_hide_a_gain() -> None:
    """The verdict judges the per-round *ratios*: a round in which the machine ran at half speed slows both
    neighbours measured back to back and leaves their ratio as it was (issue #28.2: the epoch times' spread
    across rounds, 50-130% on a loaded 2-core machine, made every step 'within noise')."""
    drift = C.Waterfall(
        "data-bound",
        tiny(),
        "cpu",
        [
            _result("baseline", [1.0, 2.0, 1.0]),  # round 2 ran at half speed ...
            _result("workers", [0.7, 1.4, 0.7]),  # ... for both neighbours: x1.43 in every round
            _result("persistent", [0.7, 1.44, 0.69]),  # x1.00, 0.97, 1.01: the rounds disagree
        ],
        rounds=3,
    )
    assert drift.verdicts() == ["", "gain", "within noise"]
    assert drift.noise_floor() == pytest.approx(1.0, abs=0.05)  # the epoch times varied 100% between rounds
    assert drift.ratio_noise() is not None and drift.ratio_noise() < 0.05  # the ratios scattered little
    scattered = C.Waterfall(
        "data-bound",
        tiny(),
        "cpu",
        [_result("baseline", [1.0, 1.0, 1.0, 1.0, 1.0]), _result("workers", [0.9, 0.6, 0.85, 0.99, 0.7])],
        rounds=5,
    )
    assert scattered.verdicts() == ["", "within noise"]  # x1.01-1.67, every round faster, x1.18 within the scatter
    disturbed = C.Waterfall(
        "data-bound",
        tiny(),
        "cpu",
        [_result("baseline", [1.0, 1.0, 1.0, 1.0, 1.0]), _result("workers", [0.7, 0.72, 1.05, 0.69, 0.71])],
        rounds=5,
    )
    assert disturbed.verdicts() == ["", "gain"]  # x1.39-1.45 in 4 rounds of 5, one disturbed round (x0.95)


def test_waterfall_runs_in_alternating_rounds(monkeypatch: pytest.MonkeyPatch) -> None:
    order: list[tuple[str, bool]] = []

    def fake_run(settings, spec, device="cpu", *, name="custom", label=None, stages=True, progress=None, **kw):
        order.append((name, stages))
        r = _result(name, [1.0])
        r.round_epoch_s = []
        return r

    monkeypatch.setattr(C, "run_config", fake_run)
    seen: list[float] = []
    wf = C.run_waterfall(
        "data-bound",
        "cpu",
        names=["baseline", "workers", "persistent"],  # three steps that can act on a CPU
        spec=tiny(),
        workers=1,
        rounds=2,
        progress=lambda f, t="": seen.append(f),
    )
    # one untimed warm-up run, then forwards, then backwards
    assert [n for n, _ in order] == [
        "baseline",
        "baseline",
        "workers",
        "persistent",
        "persistent",
        "workers",
        "baseline",
    ]
    assert [s for _, s in order] == [False] + [True] * 3 + [False] * 3  # stages alone in the first round only
    assert all(len(r.round_epoch_s) == 2 for r in wf.results) and seen[-1] == 1.0 and seen == sorted(seen)


def test_exercise_063_accepts_the_label_the_table_prints() -> None:
    from helpers.ui import exercises

    expected = job.step_answers("workers")
    for answer in ("workers", "+ workers", "Workers"):
        assert exercises.check("06.3", answer, expected=expected).correct
    assert not exercises.check("06.3", "+ pinned memory", expected=expected).correct


def test_checklist_renders_as_lists() -> None:
    """An ordered list that does not start at 1 cannot interrupt a paragraph (CommonMark): every item must
    still render as a list item."""
    import re
    from pathlib import Path

    mistune = pytest.importorskip("mistune")
    text = (Path(__file__).resolve().parents[1] / "docs" / "CHECKLIST.md").read_text(encoding="utf-8")
    items = len(re.findall(r"^\d+\. \[ \]", text, flags=re.M))
    assert items >= 12 and mistune.html(text).count("<li>") == items


def test_laptop_tier_uses_the_small_data_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WORKBOOK_QUICK", raising=False)
    monkeypatch.delenv("WORKBOOK_FULL", raising=False)
    monkeypatch.setattr("helpers.core.config._cuda_present", lambda: False)
    sizes = job.job_sizes()
    assert sizes["image_size"] == 80 and sizes["train_items"] <= sizes["n_train"] <= 640
    # Issue 28: 10-step epochs. With 15, '+ workers' sat at x1.00 on a quiet 2-core machine (gain, within noise or
    # no effect from run to run); with 10 it came out 'slower' in 6 of 6 runs, quiet and loaded.
    assert sizes["train_items"] // sizes["batch_size"] == 10


@pytest.mark.slow
def test_panel_runs_repeated_keep_memory_flat_and_leave_no_process() -> None:
    """Issue 15: chapter 06's panel grew its RSS in its first runs, then stayed flat; no run left a process."""
    import gc
    import time

    import psutil

    me = psutil.Process()
    before = {p.pid for p in me.children(recursive=True)}
    spec = tiny()
    toggles = [
        dict(workers=True),
        dict(workers=True, persistent=True),
        dict(workers=True, persistent=True, uint8=True),
        {},
    ]
    rss = []
    for k in range(16):
        r = ch06.panel_run(
            None, regime="data-bound", device="cpu", specs={"data-bound": spec}, **toggles[k % len(toggles)]
        ).value
        assert r.throughput > 0
        gc.collect()
        rss.append(me.memory_info().rss)
    settled, last = rss[7], rss[-1]
    assert last <= settled * 1.10 + 32 * 2**20, f"RSS kept growing after the first runs: {rss}"
    deadline = time.monotonic() + 10
    while True:
        extra = {
            p.pid for p in me.children(recursive=True) if p.is_running() and p.status() != psutil.STATUS_ZOMBIE
        } - before
        if not extra or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert not extra, f"panel runs left processes behind: {extra}"


def test_on_a_cpu_the_waterfall_measures_only_the_steps_that_can_act(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue #28.2: without CUDA, pinning, uint8 on the device and the prefetcher get no ratio: they are left
    out of the rounds, labelled "needs CUDA" in the table, with their published figure (or none found)."""
    ran: list[tuple[str, C.Settings]] = []

    def fake_run(settings, spec, device="cpu", *, name="custom", label=None, stages=True, progress=None, **kw):
        ran.append((name, settings))
        return _result(name, [1.0])

    monkeypatch.setattr(C, "run_config", fake_run)
    wf = C.run_waterfall("data-bound", "cpu", spec=tiny(), workers=1, rounds=2)
    cuda_only = [s.name for s in C.STEPS if s.needs_cuda]
    assert cuda_only == ["pinned", "uint8", "prefetcher"]
    assert [r.name for r in wf.results] == ["baseline", "workers", "persistent"]
    assert {n for n, _ in ran} == {"baseline", "workers", "persistent"} and wf.not_measured == cuda_only
    assert not any(s.pin_memory or s.output == "uint8" or s.prefetcher for _, s in ran)  # nothing it cannot do
    assert all(v in ("gain", "slower", "no effect", "within noise") for v in wf.verdicts()[1:])
    assert {k: v for k, v in wf.step_verdicts().items() if k in cuda_only} == dict.fromkeys(cuda_only, "needs CUDA")
    table = wf.table()
    assert max(len(line) for line in table.splitlines()) <= 110
    for step in C.STEPS:
        if step.needs_cuda:
            (row,) = [line for line in table.splitlines() if line.startswith(step.label)]
            assert "needs CUDA" in row and " x" not in row  # labelled, and no ratio
    assert "sd-scripts/pull/1894" in table and "pytorch_geometric/pull/7378" in table  # pinning, the prefetcher
    assert "No published figure of this experiment was found" in table  # uint8 over the link: none published
    pinned = evidence.published_elsewhere("the pinned step", C.STEPS[1].published_key)  # what cuda_lines cites
    assert pinned.cited and not pinned  # cited, no value
    C.plot_waterfall(wf)  # a labelled slot for each step left out
    with pytest.raises(ValueError, match="need CUDA"):
        C.run_waterfall("data-bound", "cpu", names=["pinned", "uint8"], spec=tiny(), workers=1, rounds=2)
    ran.clear()
    monkeypatch.setattr(C, "_pipeline", lambda *a, **kw: None)
    on_gpu = C.run_waterfall("data-bound", "cuda", spec=tiny(), workers=1, rounds=2)
    assert [r.name for r in on_gpu.results] == list(C.STEP_NAMES) and on_gpu.not_measured == []


def test_accuracy_and_bottleneck_verdicts_follow_the_figures() -> None:
    """Issue #28: each pair's printed sentence follows its two figures (agree, and not)."""
    tol = C.accuracy_tolerance(256)
    assert "agree within their spread" in C.accuracy_verdict([0.5, 0.5 + 0.99 * tol], tol)
    assert "do NOT agree" in C.accuracy_verdict([0.5, 0.5 + 1.01 * tol], tol)
    res = [SimpleNamespace(accuracy=a, train_loss=1.0) for a in (0.5, 0.5 + 1.01 * tol)]
    ok, msg = C.check_accuracies(res, 6, 256, chance=0.17)  # type: ignore[arg-type]
    assert not ok and msg.endswith(C.accuracy_verdict([0.5, 0.5 + 1.01 * tol], tol))
    base = SimpleNamespace(name="baseline", epoch_s=1.0, round_epoch_s=[1.0], stages={}, slowest_stage=None)
    m = D.Measurements(steps=4, wait_s=0.01, h2d_s=0.0, compute_s=0.005)
    d = D.decide(m)
    no_stages = C.bottleneck_verdict(d, C.Waterfall("data-bound", tiny(), "cpu", [base]))  # type: ignore[list-item]
    assert "cannot be compared" in no_stages and "agree" not in no_stages


@pytest.mark.parametrize("workers", [0, -2, 500])
def test_a_worker_count_out_of_range_is_refused_in_plain_words(workers: int) -> None:
    """run_waterfall(workers=), benchmark and tools/verdict_runs build their steps through configurations()."""
    with pytest.raises(ValueError, match="workers"):
        C.configurations(workers, names=["baseline", "workers"])
