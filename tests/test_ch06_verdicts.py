"""Chapter 06's printed verdicts after a laptop-size review: the threads comparison says whether its run agrees with
the waterfall's, the timeline's lines say what was measured, the doctor labels its estimate (an upper bound with
perfect overlap) and shows the waterfall's measured saving beside it, the calibration says what a thin data-bound
margin means, and the chapter prints no exercise's answer."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from _ch06_support import quick_data_set, tiny  # noqa: F401  (quick_data_set: autouse, for this module)

from helpers.chapters.ch06 import calibration as K
from helpers.chapters.ch06 import capstone as C
from helpers.chapters.ch06 import doctor as D
from helpers.core import evidence
from helpers.core.timing import Span, SpanTrace

NOTEBOOK = Path(__file__).resolve().parent.parent / "notebooks" / "06_capstone.ipynb"


def _result(name: str, times: list[float], trace: SpanTrace | None = None, steps: int = 10) -> C.ConfigResult:
    label = next(s.label for s in C.STEPS if s.name == name)
    return C.ConfigResult(
        name=name,
        label=label,
        settings=C.Settings(),
        spec=tiny(threads=1),
        epoch_s=sorted(times)[len(times) // 2],
        steps=steps,
        samples=8 * steps,
        accuracy=0.5,
        train_loss=1.0,
        trace=trace or SpanTrace(spans=[], metadata={}),
        compute_busy=0.5,
        data_stall=0.34,
        round_epoch_s=times,
    )


def _waterfall(*results: C.ConfigResult, rounds: int = 5) -> C.Waterfall:
    return C.Waterfall("data-bound", tiny(threads=1), "cpu", list(results), rounds)


# -- threads: a verdict on the one run against the waterfall's rounds -------------------------------------------


@pytest.mark.parametrize(
    ("epoch_s", "verdict"),
    [(0.15, "within noise"), (0.30, "slower beyond"), (0.10, "faster beyond")],
)
def test_a_thread_count_gets_a_verdict_against_the_waterfalls_range(epoch_s: float, verdict: str) -> None:
    line = C.thread_verdict(2, epoch_s, 1, 0.15, [0.14, 0.15, 0.16, 0.15, 0.14])
    assert line.startswith("verdict, 2 thread(s) against 1: " + verdict)
    assert "0.14-0.16 s" in line
    if verdict == "within noise":
        assert "no cost of sharing the cores was measured" in line
    if verdict == "slower beyond":
        assert "x2.00 its median" in line


def test_one_round_gives_no_range_to_judge() -> None:
    line = C.thread_verdict(2, 3.22, 1, 0.26, [0.26])
    assert "no range to judge" in line and "within noise" not in line and "slower" not in line


def test_compare_threads_ends_with_the_verdict(monkeypatch: pytest.MonkeyPatch) -> None:
    wf = _waterfall(_result("baseline", [0.2, 0.21, 0.2]), _result("persistent", [0.14, 0.16, 0.15]))

    def fake_run(settings, spec, *a, **kw):  # type: ignore[no-untyped-def]
        assert spec.threads == 2 and kw["stages"] is False
        return dataclasses.replace(wf.results[-1], epoch_s=0.15, round_epoch_s=[0.15])

    monkeypatch.setattr(C, "run_config", fake_run)
    lines = C.compare_threads(wf, "persistent", threads=(1, 2))
    assert lines[1].startswith("    1 thread(s): 0.15 s/epoch (the waterfall's median of 3 rounds, range 0.14-0.16")
    assert lines[2] == "    2 thread(s): 0.15 s/epoch (one run)"
    verdict = " ".join(ln.strip() for ln in lines[3:])
    assert verdict.startswith("verdict, 2 thread(s) against 1: within noise")
    assert all(len(ln) <= 110 for ln in lines)  # the root conftest's limit on a printed line


# -- the timeline: what this run measured, in words ---------------------------------------------------------------


def test_timeline_lines_give_the_first_and_median_waits_and_the_step() -> None:
    spans = []
    t = 0.0
    for step, (wait, work) in enumerate([(0.030, 0.010), (0.004, 0.012), (0.002, 0.011), (0.006, 0.013)]):
        spans.append(Span("batch", step, "data", t, t + wait, t, t + wait))
        t += wait
        spans.append(Span("train_step", step, "compute", t, t + work, t, t + work))
        t += work
    r = _result("persistent", [0.1, 0.1, 0.1], trace=SpanTrace(spans=spans), steps=4)
    (line,) = C.timeline_lines([r])
    assert line.startswith("+ persistent, prefetch 4: wait for a batch: first 30.0 ms, median 5.0 ms")
    assert "train_step: median 11.5 ms" in line and "data stall 34% of the epoch (4 steps, measured now)" in line
    (empty,) = C.timeline_lines([_result("baseline", [0.1])])
    assert empty == "baseline: no spans recorded"


# -- the doctor: its estimate labelled, the measured saving beside it ----------------------------------------------


def _facts(**kw):  # type: ignore[no-untyped-def]
    base = dict(loader_type="DataLoader", num_workers=0, pin_memory=False, persistent_workers=False, cpu_count=2,
                device_type="cpu", batch_bytes=3 * 2**20, batch_dtype="float32", batch_shape=(32, 3, 64, 64),
                float_image_batch=True, batch_pinned=False)  # fmt: skip
    base.update(kw)
    return D.PipelineFacts(**base)


def _m(wait: float, compute: float) -> D.Measurements:
    return D.Measurements(steps=10, wait_s=wait, h2d_s=0.0, compute_s=compute, facts=_facts())


def test_the_workers_estimate_is_labelled_an_upper_bound_and_the_measured_saving_is_shown() -> None:
    """The review's run: 14.03 ms 'saved' of a 21.7 ms step (x2.8), while the waterfall measured 20 -> 15 ms."""
    measured = {"workers": "slower", "persistent": "gain"}
    steps = {"workers": D.MeasuredStep("+ workers", 0.020, 0.023),
             "persistent": D.MeasuredStep("+ persistent, prefetch 4", 0.020, 0.015)}  # fmt: skip
    d = D.decide(_m(0.0145, 0.0080), measured=measured, measured_steps=steps)
    top = d.recommendations[0]
    assert top.step == "persistent" and top.bound and top.measured_step == steps["persistent"]
    assert top.gain_s == pytest.approx(0.0145)  # the bottleneck model's saving, unchanged
    text = " ".join(str(d).split())
    assert "saves at most ~14.50 ms/step (bottleneck model, perfect overlap)" in text
    assert "the waterfall measured 20.00 ms -> 15.00 ms per step, its baseline to '+ persistent, prefetch 4'" in text
    assert steps["persistent"].saving_s == pytest.approx(0.005) and steps["persistent"].share == pytest.approx(0.25)


def test_without_measured_steps_the_report_is_the_estimate_alone() -> None:
    d = D.decide(_m(0.0145, 0.0072))
    assert d.recommendations[0].measured_step is None
    assert "the waterfall measured" not in str(d) and "(bottleneck model, perfect overlap)" in str(d)


def test_a_recommendation_is_ranked_by_its_measured_saving() -> None:
    """Compute-bound on a CPU: more workers estimated at 28% of the step, measured at 2%: below the notable share,
    it no longer outranks the advice on the bottleneck itself."""
    m = _m(0.014, 0.036)
    alone = D.decide(m, measured={"workers": "gain"})
    assert alone.verdict == "compute-bound" and alone.recommendations[0].step == "workers"
    small = {"workers": D.MeasuredStep("+ workers", 0.050, 0.049)}
    d = D.decide(m, measured={"workers": "gain"}, measured_steps=small)
    assert [r.stage for r in d.recommendations] == ["compute", "data"]
    assert d.recommendations[1].gain_s == pytest.approx(0.014)  # the estimate is kept, shown beside the measurement


def test_other_estimates_are_labelled_estimates() -> None:
    m = D.Measurements(steps=10, wait_s=0.002, h2d_s=0.0, compute_s=0.010, first_batch_s=0.5,
                       facts=_facts(num_workers=2))  # fmt: skip
    (persist,) = [r for r in D.decide(m).recommendations if r.step == "persistent"]
    assert not persist.bound and persist.saving().endswith("/step (estimate)")


@pytest.mark.parametrize("bad", [0.015, D.MeasuredStep("x", 0.0, 0.01), D.MeasuredStep("x", 0.02, float("nan"))])
def test_decide_refuses_bad_measured_steps(bad: object) -> None:
    with pytest.raises(ValueError, match="measured_steps"):
        D.decide(_m(0.0145, 0.0072), measured_steps={"workers": bad})  # type: ignore[dict-item]


def test_the_waterfall_gives_each_step_its_time_per_step_against_the_baseline() -> None:
    wf = _waterfall(_result("baseline", [0.20, 0.21, 0.20]), _result("workers", [0.23, 0.24, 0.23]),
                    _result("persistent", [0.15, 0.15, 0.16]))  # fmt: skip
    steps = wf.measured_steps()
    assert list(steps) == ["workers", "persistent"]
    persistent = steps["persistent"]
    assert persistent.label == "+ persistent, prefetch 4"
    assert (persistent.baseline_s, persistent.with_step_s) == (pytest.approx(0.020), pytest.approx(0.015))


# -- the calibration: a thin data-bound margin still leaves the loader the slower stage ----------------------------


def test_a_thin_data_bound_margin_says_the_loader_is_still_the_slower_stage() -> None:
    thin = K.choose_model("data-bound", lambda w, d: 0.0084, 0.0135, start=(1, 4), crop_size=64)
    assert not thin.reached
    assert "the loader is the slower stage (1.61x" in thin.reason and "loading steps can still gain" in thin.reason
    assert "gain little" not in thin.reason
    slow = K.choose_model("data-bound", lambda w, d: 0.02, 0.0135, start=(1, 4), crop_size=64)
    assert not slow.reached and "no faster than the loader" in slow.reason and "gain less" in slow.reason
    fast = K.choose_model("data-bound", lambda w, d: 0.005, 0.0135, start=(1, 4), crop_size=64)
    assert fast.reached and "2.7x faster than the loader" in fast.reason


# -- the text the chapter prints --------------------------------------------------------------------------------


def test_the_no_published_figure_sentence_names_the_six_steps_and_no_decode() -> None:
    sentence = evidence.no_published_sentence("ch06.efficiency") or ""
    for word in ("baseline", "pinned", "workers", "persistent", "uint8", "prefetcher"):
        assert word in sentence
    assert "decode" not in sentence.lower()


def _code_cells() -> list[str]:
    cells = json.loads(NOTEBOOK.read_text(encoding="utf-8"))["cells"]
    return ["".join(c["source"]) for c in cells if c["cell_type"] == "code"]


def test_the_chapter_does_not_print_exercise_063s_answer() -> None:
    """The grader forbids ``best_step`` and ``best_steps`` for 06.3: the chapter must not print them either."""
    assert not any(".best_step" in src for src in _code_cells())
