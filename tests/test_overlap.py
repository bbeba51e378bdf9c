"""Tests for helpers.pipeline.overlap: the 2x2 labels, overlap measurement, hazards, panel fallback."""

from __future__ import annotations

import json

import matplotlib

matplotlib.use("Agg")

import pytest
import torch

from helpers.core.results import ResultSet
from helpers.core.timing import Span, SpanTrace
from helpers.pipeline import overlap as ov

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

# The truth table, written out by hand: overlap needs a pinned source AND a side stream.
TRUTH = {
    ("pageable", "default"): "serialised",
    ("pageable", "side"): "serialised",  # the pageable copy holds the host until it is staged
    ("pinned", "default"): "serialised",  # one stream runs its work in order
    ("pinned", "side"): "overlapped",
}


@pytest.mark.parametrize("cell", list(TRUTH))
def test_expected_labels_follow_the_configuration(cell: tuple[str, str]) -> None:
    memory, stream = cell
    assert ov.expected_label(memory, stream) == TRUTH[cell]
    assert ov.expected_reason(memory, stream)
    assert ov.schematic_trace(memory, stream).metadata["expected_label"] == TRUTH[cell]


def test_exactly_one_cell_overlaps_and_cells_cover_the_grid() -> None:
    assert set(ov.CELLS) == set(TRUTH)
    assert [c for c in ov.CELLS if ov.expected_label(*c) == "overlapped"] == [("pinned", "side")]


def test_bad_configuration_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="memory"):
        ov.expected_label("unified", "side")
    with pytest.raises(ValueError, match="stream"):
        ov.run_cell("pinned", "graph", device="cpu")
    with pytest.raises(ValueError, match="copy_mib"):
        ov.run_cell("pinned", "side", copy_mib=0, device="cpu")


def test_lanes_name_the_streams() -> None:
    assert ov.lanes_for("side") == ("side stream (copy)", "default stream (compute)")
    copy_lane, compute_lane = ov.lanes_for("default")
    assert copy_lane.startswith("default stream") and compute_lane.startswith("default stream")


def _trace(copy: list[tuple[float, float]], compute: list[tuple[float, float]]) -> SpanTrace:
    spans = [Span("copy", i, "c", a, b, a, b, True) for i, (a, b) in enumerate(copy)]
    spans += [Span("compute", i, "k", a, b, a, b, True) for i, (a, b) in enumerate(compute)]
    return SpanTrace(spans)


def test_overlap_fraction_and_measured_label() -> None:
    serial = _trace([(0, 1), (3, 4)], [(1, 3), (4, 6)])
    assert ov.overlap_fraction(serial) == 0.0
    assert ov.measured_label(ov.overlap_fraction(serial)) == "serialised"
    hidden = _trace([(0, 1), (2, 3)], [(0, 2), (2, 4)])
    assert ov.overlap_fraction(hidden) == pytest.approx(1.0)
    half = _trace([(0, 2)], [(1, 5)])
    assert ov.overlap_fraction(half) == pytest.approx(0.5)
    assert ov.measured_label(0.5) == "overlapped"
    assert ov.overlap_fraction(SpanTrace([])) == 0.0


@pytest.mark.parametrize("cell", list(TRUTH))
def test_schematic_shows_what_the_label_says(cell: tuple[str, str]) -> None:
    trace = ov.schematic_trace(*cell)
    assert trace.metadata["kind"] == "schematic, not measured"
    assert ov.measured_label(ov.overlap_fraction(trace)) == TRUTH[cell]


def test_run_cell_on_cpu_runs_but_claims_no_measurement() -> None:
    r = ov.run_cell("pinned", "side", copy_mib=1, matmul_n=32, steps=2, device="cpu")
    assert r.expected == "overlapped" and r.measured is None and r.agrees is None
    assert not r.on_gpu and r.notes  # says that pinning and streams were not available
    names = {s.name for s in r.trace.spans}
    assert {"copy", "compute", "copy call", "wait"} <= names
    assert r.trace.steps() == 2 and r.copy_bytes == 1 << 20
    assert "not measured" in r.summary()
    json.dumps(r.trace.to_dict())  # storable as a reference artifact


def test_draw_cell_labels_schematics() -> None:
    ax = ov.draw_cell(ov.schematic_trace("pinned", "side"))
    assert "SCHEMATIC" in ax.get_xlabel() and "schematic" in ax.get_title()
    r = ov.run_cell("pageable", "default", copy_mib=1, matmul_n=32, steps=2, device="cpu")
    ax = ov.draw_cell(r)
    assert "CPU run" in ax.get_title()


@pytest.mark.parametrize(
    "fn", [ov.hazard_d2h_read_before_sync, ov.hazard_pinned_source_mutation, ov.hazard_hidden_syncs]
)
def test_hazards_run_on_cpu_and_explain(fn) -> None:  # type: ignore[no-untyped-def]
    kwargs = {"steps": 2} if fn is ov.hazard_hidden_syncs else {"n": 1024}
    h = fn("cpu", **kwargs)
    assert not h.on_gpu and "GPU" in h.explanation
    assert "def " in h.code_bug and "def " in h.code_fix
    assert h.name in h.report()


def test_cpu_hazards_count_no_wrong_values() -> None:
    h = ov.hazard_d2h_read_before_sync("cpu", n=1000)
    assert h.bug["wrong elements when read"] == 0 and h.fix["wrong elements when read"] == 0
    h = ov.hazard_pinned_source_mutation("cpu", n=1000)
    assert h.bug["elements that arrived wrong"] == 0


def test_panel_without_gpu_shows_reference_or_a_labelled_schematic(monkeypatch, tmp_path) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("WORKBOOK_REFERENCE_DIR", str(tmp_path))
    out = ov.panel_run(None, memory="pageable", stream="side", device="cpu")
    assert out["kind"] == "schematic" and "not measured" in out["source"]
    assert out["trace"].metadata["kind"] == "schematic, not measured"
    with pytest.raises(ValueError):
        ov.panel_run(None, memory="pageable", stream="sideways", device="cpu")


def test_reference_artifact_round_trip(monkeypatch, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A recorded trace stored as an artifact comes back with its provenance line."""
    monkeypatch.setenv("WORKBOOK_REFERENCE_DIR", str(tmp_path))
    assert ov.reference_cell("pinned", "side") is None
    r = ov.run_cell("pinned", "side", copy_mib=1, matmul_n=32, steps=2, device="cpu")
    rs = ResultSet(
        name="t",
        method="test",
        provenance={"hardware": {"gpu_name": "TestGPU"}},
        created="2026-01-01T00:00:00+00:00",
        mode="quick",
    )
    rs.artifacts[ov.artifact_name("pinned", "side")] = r.trace.to_dict()
    rs.save(tmp_path / "ref.json")
    trace, line = ov.reference_cell("pinned", "side")
    assert len(trace.spans) == len(r.trace.spans) and "TestGPU" in line
    out = ov.panel_run(None, memory="pinned", stream="side", device="cpu")
    assert out["kind"] == "reference" and "TestGPU" in out["source"]


def test_sync_counts_reference_none_then_found(monkeypatch, tmp_path) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("WORKBOOK_REFERENCE_DIR", str(tmp_path))
    assert "ch05.hazard.syncs" in ov.sync_counts_reference()  # the "none recorded yet" message names the key
    rs = ResultSet(
        name="t",
        method="test",
        provenance={"hardware": {"gpu_name": "TestGPU"}},
        created="2026-01-01T00:00:00+00:00",
        mode="quick",
    )
    rs.add("ch05.hazard.syncs", 450, "count", variant="hidden", steps=50)
    rs.add("ch05.hazard.syncs", 1, "count", variant="fixed", steps=50)
    rs.add("ch05.hazard.syncs_per_line", 7, "count", line="print(loss)")
    rs.save(tmp_path / "ref.json")
    text = ov.sync_counts_reference()
    assert "TestGPU" in text and "9.00 per step" in text and "print(loss) alone: 7" in text


def test_hidden_syncs_on_cpu_claims_no_count() -> None:
    h = ov.hazard_hidden_syncs("cpu", steps=2)
    assert "not counted" in str(h.bug["synchronisations"]) and "masked_select" in h.explanation
    assert "three synchronisations" not in h.code_bug


def test_benchmark_records_nothing_without_cuda() -> None:
    if torch.cuda.is_available():
        pytest.skip("checks the no-CUDA path")
    rs = ResultSet(name="t", method="m", provenance={}, created="x", mode="quick")
    assert ov.benchmark(rs, "cpu").records == []


# -- CUDA only: the measured labels must agree with the configuration ------------


@cuda
@pytest.mark.parametrize("cell", list(TRUTH))
def test_measured_label_matches_configuration_on_gpu(cell: tuple[str, str]) -> None:
    r = ov.run_cell(*cell, copy_mib=64, matmul_n=4096, steps=4, device="cuda")
    assert r.on_gpu and r.measured == TRUTH[cell], r.summary()


@cuda
def test_hazards_show_on_gpu() -> None:
    h = ov.hazard_d2h_read_before_sync("cuda")
    assert h.fix["wrong elements when read"] == 0 and h.bug["wrong after a later sync"] == 0
    h = ov.hazard_pinned_source_mutation("cuda")
    assert h.fix["elements that arrived wrong"] == 0
    h = ov.hazard_hidden_syncs("cuda", steps=5)
    assert h.bug["synchronisations"] >= 3 * 5 and h.fix["synchronisations"] <= 2
    assert h.bug[".item() alone"] == 1 and h.bug[".cpu() alone"] == 1
    assert h.bug["print(loss) alone"] > 1  # torch/_tensor_str.py reads the value several times
    assert h.bug["per step"] == pytest.approx(h.bug["synchronisations"] / 5)


@cuda
def test_benchmark_on_gpu() -> None:
    rs = ResultSet(name="t", method="m", provenance={}, created="x", mode="quick")
    ov.benchmark(rs, "cuda")
    assert all(k.startswith("ch05.") for k in rs.keys())
    assert {ov.artifact_name(m, s) for m, s in ov.CELLS} <= set(rs.artifacts)
