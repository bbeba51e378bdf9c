"""Pipeline efficiency is never shown above 1 (issue #28, item 2).

A pipeline cannot beat its slowest stage alone: a measured ratio above 1 within the noise is shown as
1.00, 'at the bottleneck (within noise)'; further above, no value at all, only 'out of range' and why.
"""

from __future__ import annotations

import matplotlib
import pytest

matplotlib.use("Agg")

from helpers.chapters import ch06  # noqa: E402
from helpers.chapters.ch06 import capstone as C  # noqa: E402
from helpers.core import evidence  # noqa: E402
from helpers.core.timing import SpanTrace  # noqa: E402


def test_below_one_is_the_ratio() -> None:
    e = C.pipeline_efficiency(900.0, {"loader": 1000.0, "copy": None, "compute": 3000.0})
    assert e is not None and e.value == pytest.approx(0.9) and e.verdict == "" and str(e) == "0.90"


def test_equal_is_one() -> None:
    e = C.pipeline_efficiency(1000.0, {"loader": 1000.0, "compute": 3000.0})
    assert e is not None and e.value == 1.0 and e.short() == "1.00"


def test_just_above_one_within_noise_is_capped_at_the_bottleneck() -> None:
    e = C.pipeline_efficiency(1050.0, {"loader": 1000.0, "compute": 3000.0})
    assert e is not None and e.ratio == pytest.approx(1.05) and e.value == 1.0
    assert "at the bottleneck (within noise)" in str(e) and e.short() == "1.00 (noise)"


def test_far_above_one_is_out_of_range_with_no_value() -> None:
    e = C.pipeline_efficiency(1490.0, {"loader": 1000.0, "compute": 3000.0})
    assert e is not None and e.value is None and e.ratio == pytest.approx(1.49)
    assert str(e).startswith("out of range") and "stages-alone" in str(e) and e.short() == "out of range"
    # a larger noise (a run's own spread) widens the band
    e = C.pipeline_efficiency(1490.0, {"loader": 1000.0}, noise=0.5)
    assert e is not None and e.value == 1.0


def test_nothing_measured_is_none() -> None:
    assert C.pipeline_efficiency(10.0, {"copy": None}) is None
    assert C.pipeline_efficiency(0.0, {"loader": 5.0}) is None


def _result(label: str, ratio: float) -> C.ConfigResult:
    """A configuration with 100 samples in 1 s whose loader alone ran 100 / ratio items/s."""
    spec = C.job_spec("data-bound", width=2, depth=1, batch_size=8, crop_size=32, train_items=24)
    stages: dict[str, float | None] = {"loader": 100.0 / ratio, "copy": None, "compute": 1000.0}
    r = C.ConfigResult(
        name="baseline", label=label, settings=C.Settings(), spec=spec,
        epoch_s=1.0, steps=10, samples=100, accuracy=0.5, train_loss=1.0, trace=SpanTrace([]),
        compute_busy=0.5, data_stall=0.5, stages=stages,
    )  # fmt: skip
    r.efficiency = C.pipeline_efficiency(r.throughput, r.stages)
    return r


def _waterfall() -> C.Waterfall:
    rs = [_result("baseline", 0.8), _result("+ workers", 1.05), _result("+ pinned", 1.49)]
    return C.Waterfall("data-bound", rs[0].spec, "cpu", rs)


def test_table_never_shows_an_efficiency_above_one() -> None:
    table = _waterfall().table()
    end = table.splitlines()[1].index("efficiency") + len("efficiency")  # the column is right-aligned
    effs = [line[end - len("out of range") : end] for line in table.splitlines()[2:5]]  # the efficiency column
    assert [e.strip() for e in effs] == ["0.80", "1.00 (noise)", "out of range"]
    assert "1.49" not in table and "1.05" not in table and "*" not in table


def test_panel_line_never_shows_an_efficiency_above_one() -> None:
    lines = [ch06.panel_summary(evidence.measured("the job", r, "cpu")) for r in _waterfall().results]
    effs = [line.split("efficiency ", 1)[1].split(", accuracy")[0] for line in lines]
    assert effs[:2] == ["0.80", "1.00, at the bottleneck (within noise)"]
    assert effs[2].startswith("out of range: the pipeline ran 1.49x its slowest stage alone")


def test_plot_never_draws_an_efficiency_above_100_percent() -> None:
    ax = C.plot_shares(_waterfall())
    ys = [y for line in ax.get_lines() for y in line.get_ydata()]
    assert ys and max(ys) <= 100.0
    assert any("out of range" in t.get_text() for t in ax.texts)


def test_recorded_efficiencies_are_shown_through_the_same_rule() -> None:
    text = " ".join(C.efficiency_lines([("baseline", 0.52), ("+ workers", 1.02), ("+ pinned", 1.49)]))
    assert "baseline 0.52" in text and "+ workers 1.00 (noise)" in text and "+ pinned out of range" in text
