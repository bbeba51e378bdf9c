"""Chapter 01's bottleneck model against the measured steps: a verdict, and which to trust (issue #28.3).

Section 5 printed the predicted step (the sum of the phases) beside the measured one, and its table the
sum beside the measured step of a thin and a wide model, with no word on whether they agree.
:func:`helpers.chapters.ch01.step_verdict` and :func:`~helpers.chapters.ch01.regimes_verdict` now say
whether the prediction for the naive loop on this device lies within the range of the measured steps'
wall times (:func:`helpers.chapters.ch01.anatomy.step_times`; :func:`helpers.core.agreement.within_range`), and
that the measured step is the one to trust when it does not. Synthetic figures: nothing here is timed.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from helpers.chapters import ch01
from helpers.chapters.ch01 import anatomy
from helpers.core import agreement
from helpers.core.timing import Span, SpanTrace

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "01_baseline_pipeline.ipynb"
#: Phases of one step, in seconds: the sum is 13 ms; on a GPU, copy + max(data, compute) is 1 + max(5, 7) = 8 ms.
PHASES = {"load": 4e-3, "collate": 1e-3, "h2d": 1e-3, "forward": 2e-3, "backward": 4e-3, "optimizer": 1e-3}
PRED = anatomy.predict_step_time(PHASES)
AROUND_SUM = [12.8e-3, 13.1e-3, 13.5e-3]
SLOWER = [13.8e-3, 14.1e-3, 14.5e-3]
AROUND_GPU = [7.5e-3, 8.2e-3, 8.9e-3]


def _flat(text: str) -> str:
    return " ".join(text.split())


def test_step_times_are_each_steps_wall_time_and_add_up_to_the_trace() -> None:
    spans = []
    for step, (t0, parts) in enumerate([(0.0, (0.004, 0.006)), (0.0105, (0.003, 0.009)), (0.0240, (0.005, 0.005))]):
        a = t0 + parts[0]
        spans += [Span("load", step, "data (CPU)", t0, a, t0, a), Span("forward", step, "compute (CPU)", a,
                                                                       a + parts[1], a, a + parts[1])]  # fmt: skip
    trace = SpanTrace(spans)
    times = anatomy.step_times(trace)
    assert times == pytest.approx([0.0105, 0.0135, 0.010])  # start to next start; the last to its end
    assert sum(times) == pytest.approx(trace.wall_time())
    assert sum(times) / len(times) == pytest.approx(trace.wall_time() / trace.steps())  # the measured step


def test_a_prediction_within_the_steps_range_agrees() -> None:
    text = _flat(ch01.step_verdict(PRED, AROUND_SUM, device="cpu"))
    assert "a CPU pays the sum of the phases, 13.00 ms" in text
    assert "within the range of the 3 measured steps (12.80-13.50 ms)" in text
    assert "they agree within their spread." in text and "NOT" not in text and "Trust" not in text


def test_a_prediction_outside_the_steps_range_does_not_agree_and_the_measured_step_is_trusted() -> None:
    text = _flat(ch01.step_verdict(PRED, SLOWER, device="cpu"))
    assert "13.00 ms, which lies below the range of the 3 measured steps (13.80-14.50 ms)" in text
    assert "they do NOT agree within their spread" in text and "they agree" not in text
    assert "Trust the measured step: it is what the loop pays" in text
    above = _flat(ch01.step_verdict(PRED, [10e-3, 11e-3], device="cpu"))
    assert "lies above the range" in above and "do NOT agree" in above


def test_on_a_gpu_the_naive_loops_prediction_is_copy_plus_the_larger_of_data_and_compute() -> None:
    on_gpu = _flat(ch01.step_verdict(PRED, AROUND_GPU, device="cuda"))
    assert "a GPU pays copy + max(data, compute), 8.00 ms" in on_gpu and "they agree within their spread" in on_gpu
    on_cpu = _flat(ch01.step_verdict(PRED, AROUND_GPU, device="cpu"))  # the same steps against the sum: a miss
    assert "do NOT agree" in on_cpu and "overlaps compute by exactly one step" not in on_cpu
    off = _flat(ch01.step_verdict(PRED, AROUND_SUM, device="cuda"))
    assert "do NOT agree" in off and "assumes data overlaps compute by exactly one step" in off


def test_the_table_verdict_names_each_row_and_trusts_the_measured_step_where_one_misses() -> None:
    agree = _flat(ch01.regimes_verdict({"width 2": (PRED, AROUND_SUM), "width 64": (PRED, AROUND_SUM)}, device="cpu"))
    assert "width 2: agree (13.00 ms within 12.80-13.50 ms)" in agree and "width 64: agree" in agree
    assert agree.endswith("they agree within their spread.") and "NOT" not in agree
    one_off = _flat(ch01.regimes_verdict({"width 2": (PRED, AROUND_SUM), "width 64": (PRED, SLOWER)}, device="cpu"))
    assert "width 2: agree" in one_off and "width 64: do NOT agree (13.00 ms below 13.80-14.50 ms)" in one_off
    assert "Where they do NOT agree, trust the measured step" in one_off and "they agree within" not in one_off
    with pytest.raises(ValueError, match="at least one"):
        ch01.regimes_verdict({}, device="cpu")
    with pytest.raises(ValueError, match="finite"):
        ch01.step_verdict(PRED, [], device="cpu")


def test_the_verdicts_are_the_kernel_rule() -> None:
    rng = random.Random(1)
    for _ in range(300):
        times = [rng.uniform(10e-3, 16e-3) for _ in range(rng.randint(1, 8))]
        for device, value in (("cpu", PRED.serial), ("cuda", PRED.one_step_overlap)):
            inside = agreement.within_range(value, times)
            assert ("do NOT agree" not in _flat(ch01.step_verdict(PRED, times, device=device))) == inside
            rows = _flat(ch01.regimes_verdict({"w": (PRED, times)}, device=device))
            assert ("do NOT agree" not in rows) == inside


@pytest.mark.parametrize("scale", [1e-3, 1.0, 50.0, 5000.0])
def test_every_printed_line_fits_for_any_plausible_size(scale: float) -> None:
    pred = anatomy.predict_step_time({k: v * scale for k, v in PHASES.items()})
    runs = {f"width {w}": (pred, [t * scale for t in ts]) for w, ts in ((2, AROUND_SUM), (16, SLOWER), (64, [1.0]))}
    for device in ("cpu", "cuda"):
        one = ch01.step_verdict(pred, runs["width 16"][1], device=device)
        for text in (one, ch01.regimes_verdict(runs, device=device)):
            assert max(len(line) for line in text.splitlines()) <= 110, text


def test_the_notebook_prints_both_verdicts_in_section_5() -> None:
    cells = ["".join(c["source"]) for c in json.loads(NOTEBOOK.read_text(encoding="utf-8"))["cells"]]
    (pred_cell,) = [c for c in cells if "pred = anatomy.predict_step_time(phase_s)" in c]
    assert "ch01.step_verdict(pred, anatomy.step_times(trace), device=DEVICE)" in pred_cell
    (table,) = [c for c in cells if "p.serial * 1e3" in c]
    assert "runs[label] = (p, anatomy.step_times(tr))" in table and "ch01.regimes_verdict(runs, device=DEVICE)" in table
