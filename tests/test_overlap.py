"""Tests for helpers.chapters.ch05.overlap: the 2x2 labels, overlap measurement, hazards, what a GPU recorded.

The live panel and the benchmark are chapter 05's module (tests/test_ch05_pipeline.py)."""

from __future__ import annotations

import inspect
import json

import matplotlib

matplotlib.use("Agg")

import pytest
import torch

from helpers.chapters.ch05 import feeding, hazards
from helpers.chapters.ch05 import overlap as ov
from helpers.core import evidence
from helpers.core.evidence import Evidence
from helpers.core.results import ResultSet
from helpers.core.timing import Span, SpanTrace

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
    assert ov.schematic_trace("pinned", "side").metadata["lanes"][:2] == [
        "side stream (copy)",
        "default stream (compute)",
    ]
    copy_lane, compute_lane, _ = ov.schematic_trace("pinned", "default").metadata["lanes"]
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
    assert not r.on_gpu
    names = {s.name for s in r.trace.spans}
    assert {"copy", "compute", "copy call", "wait"} <= names
    assert r.trace.steps() == 2 and r.copy_bytes == 1 << 20
    assert "not measured on cpu (no CUDA streams or copy engines)" in r.summary()
    json.dumps(r.trace.to_dict())  # storable as a reference artifact


def test_draw_cell_labels_schematics() -> None:
    ax = ov.draw_cell(ov.schematic_trace("pinned", "side"))
    assert "SCHEMATIC" in ax.get_xlabel() and "schematic" in ax.get_title()


@pytest.mark.parametrize(
    "fn", [hazards.hazard_d2h_read_before_sync, hazards.hazard_pinned_source_mutation, hazards.hazard_hidden_syncs]
)
def test_hazards_run_on_cpu_and_explain(fn) -> None:  # type: ignore[no-untyped-def]
    kwargs = {"steps": 2} if fn is hazards.hazard_hidden_syncs else {}
    h = fn("cpu", **kwargs)
    assert not h.on_gpu and "GPU" in h.explanation
    assert "def " in h.code_bug and "def " in h.code_fix
    assert h.name in h.report()


def test_cpu_hazards_count_no_wrong_values() -> None:
    h = hazards.hazard_d2h_read_before_sync("cpu")
    assert h.bug["wrong elements when read"] == 0 and h.fix["wrong elements when read"] == 0
    h = hazards.hazard_pinned_source_mutation("cpu")
    assert h.bug["elements that arrived wrong"] == 0


def _reference_set():  # type: ignore[no-untyped-def]
    return ResultSet(
        name="t",
        method="test",
        provenance={"hardware": {"gpu_name": "TestGPU"}},
        created="2026-01-01T00:00:00+00:00",
        mode="quick",
    )


def test_reference_artifact_round_trip(monkeypatch, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A recorded trace stored as an artifact comes back as recorded Evidence with its provenance line."""
    monkeypatch.setenv("WORKBOOK_REFERENCE_DIR", str(tmp_path))
    none = ov.reference_cell("pinned", "side")
    assert not none and none.kind == "missing" and "ch05.timeline.pinned.side" in none.source
    r = ov.run_cell("pinned", "side", copy_mib=1, matmul_n=32, steps=2, device="cpu")
    rs = _reference_set()
    rs.artifacts[ov.artifact_name("pinned", "side")] = r.trace.to_dict()
    rs.save(tmp_path / "ref.json")
    ev = ov.reference_cell("pinned", "side")
    assert isinstance(ev, Evidence) and ev.kind == "recorded" and not ev.here
    assert len(ev.value.spans) == len(r.trace.spans) and "TestGPU" in ev.source and "not this machine" in ev.source


def test_timeline_evidence_never_shows_a_cpu_run_as_the_experiment(monkeypatch, tmp_path) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("WORKBOOK_REFERENCE_DIR", str(tmp_path))
    r = ov.run_cell("pageable", "default", copy_mib=1, matmul_n=32, steps=2, device="cpu")
    ev = ov.timeline_evidence(r)
    assert ev.kind == "missing" and ev.value is None
    ax = ov.draw_cell(ev)  # a missing timeline: an empty axis that says so
    assert "no reference recording yet" in ax.get_title() and not ax.axison


def test_draw_cell_takes_evidence_and_labels_it_with_its_source() -> None:
    ev = evidence.theoretical("a schematic", ov.schematic_trace("pinned", "side"), "schematic, not measured")
    ax = ov.draw_cell(ev)
    assert "SCHEMATIC" in ax.get_xlabel()
    assert any("theoretical: schematic" in t.get_text() for t in ax.texts + [ax.title, ax.xaxis.label])


def test_copy_call_rows_measured_and_recorded(monkeypatch, tmp_path) -> None:  # type: ignore[no-untyped-def]
    cells = [ov.run_cell(m, s, copy_mib=1, matmul_n=32, steps=3, device="cpu") for m, s in ov.CELLS]
    assert all(c.copy_call_s is not None and c.copy_call_s >= 0 for c in cells)
    calls = sorted(s.duration for s in cells[0].trace.spans if s.name == "copy call")
    assert cells[0].copy_call_s == calls[1]
    table = ov.copy_call_table(cells)
    assert len(table) == 5 and "copy call (CPU)" in table[0]
    ms = [f"{v * 1e3:.3f} ms" for v in (cells[0].copy_call_s, cells[0].copy_s, cells[0].step_s)]
    assert table[1].split() == [*cells[0].name.split(), *" ".join(ms).split()]  # name, call, copy, step
    assert [row.split(" stream")[0] + " stream" for row in table[1:]] == [c.name for c in cells]
    monkeypatch.setenv("WORKBOOK_REFERENCE_DIR", str(tmp_path))
    assert not evidence.recorded("x", "ch05.overlap.step_time", convert=ov.copy_call_rows_from_records)
    rs = _reference_set()
    p = {"memory": "pinned", "stream": "side", "copy_bytes": 1 << 20, "matmul_n": 32, "steps": 8}
    rs.add("ch05.overlap.step_time", 0.004, "s", **p)
    rs.add("ch05.overlap.copy_time", 0.001, "s", **p)
    rs.save(tmp_path / "ref.json")
    ev = evidence.recorded("x", "ch05.overlap.step_time", convert=ov.copy_call_rows_from_records)
    assert ev.kind == "recorded" and ev.value == [("pinned + side stream", None, 0.001, 0.004)]
    assert "not recorded" in ov.copy_call_table(ev.value)[1] and "4.000 ms" in ov.copy_call_table(ev.value)[1]


def test_prefetch_reference_rows_and_lines(monkeypatch, tmp_path) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("WORKBOOK_REFERENCE_DIR", str(tmp_path))
    rs = _reference_set()
    rs.add("ch05.prefetch.batch_time", 0.002, "s", dtype="uint8", prefetcher=True, batch=256, image=128)
    rs.save(tmp_path / "ref.json")
    ev = evidence.recorded("x", "ch05.prefetch.batch_time")
    lines = feeding.batch_time_lines(ev.value)
    assert "not with your cells" in " ".join(lines) and lines[-1].endswith("uint8, prefetcher=True: 2.000 ms per batch")
    times = feeding.BatchTimes(("a",), {"a": [0.001, 0.003]}, device="cpu")
    assert feeding.batch_time_lines(times) == times.report().splitlines()


def test_a_cpu_hazard_shows_what_a_gpu_recorded(monkeypatch, tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    """HazardResult.show() without a GPU: the code, the report, then the recorded counts of hazard 1 per version."""
    monkeypatch.setenv("WORKBOOK_REFERENCE_DIR", str(tmp_path))
    rs = _reference_set()
    rs.add("ch05.hazard.d2h_wrong", 1234, "count", variant="bug", n=4096)
    rs.save(tmp_path / "ref.json")
    h = hazards.hazard_d2h_read_before_sync("cpu")
    h.show()
    out = capsys.readouterr().out
    assert out.startswith(h.code_bug + "\n" + h.code_fix + "\n" + h.report())
    assert out.splitlines()[-1] == "  bug version: 1,234 of 4,096 elements wrong"


def test_sync_counts_reference_none_then_found(monkeypatch, tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("WORKBOOK_REFERENCE_DIR", str(tmp_path))
    h = hazards.hazard_hidden_syncs("cpu", steps=2)
    h.show()
    none = capsys.readouterr().out.split(h.report())[-1]
    assert "ch05.hazard.syncs" in none  # the "none recorded yet" message names the key
    rs = _reference_set()
    rs.add("ch05.hazard.syncs", 450, "count", variant="hidden", steps=50)
    rs.add("ch05.hazard.syncs", 1, "count", variant="fixed", steps=50)
    rs.add("ch05.hazard.syncs_per_line", 7, "count", line="print(loss)")
    rs.save(tmp_path / "ref.json")
    h.show()
    text = capsys.readouterr().out.split(h.report())[-1]
    assert "TestGPU" in text and "not this machine" in text  # recorded, with its source
    assert "9.00 per step" in text and "print(loss) alone: 7" in text


def test_hidden_syncs_on_cpu_claims_no_count() -> None:
    h = hazards.hazard_hidden_syncs("cpu", steps=2)
    assert "not counted" in str(h.bug["synchronisations"]) and "masked_select" in h.explanation
    assert "three synchronisations" not in h.code_bug


# -- CUDA only: the measured labels must agree with the configuration ------------


@cuda
@pytest.mark.parametrize("cell", list(TRUTH))
def test_measured_label_matches_configuration_on_gpu(cell: tuple[str, str]) -> None:
    r = ov.run_cell(*cell, copy_mib=64, matmul_n=4096, steps=4, device="cuda")
    assert r.on_gpu and r.measured == TRUTH[cell], r.summary()


@cuda
def test_hazards_show_on_gpu() -> None:
    h = hazards.hazard_d2h_read_before_sync("cuda")
    assert h.fix["wrong elements when read"] == 0 and h.bug["wrong after a later sync"] == 0
    h = hazards.hazard_pinned_source_mutation("cuda")
    assert h.fix["elements that arrived wrong"] == 0
    h = hazards.hazard_hidden_syncs("cuda", steps=5)
    assert h.bug["synchronisations"] >= 3 * 5 and h.fix["synchronisations"] <= 2
    assert h.bug[".item() alone"] == 1 and h.bug[".cpu() alone"] == 1
    assert h.bug["print(loss) alone"] > 1  # torch/_tensor_str.py reads the value several times
    assert h.bug["per step"] == pytest.approx(h.bug["synchronisations"] / 5)


def test_the_hazards_printed_code_fits_a_notebook_line() -> None:
    """Chapter 05 prints the buggy and fixed functions' source; a line over 110 characters wraps mid-word."""
    h = hazards
    for fn in (h._d2h_bug, h._d2h_fix, h._mutation_bug, h._mutation_fix, h._loop_hidden_syncs, h._loop_no_syncs):
        assert all(len(line) <= 110 for line in inspect.getsource(fn).splitlines()), fn.__name__
