"""Chapter 05 without a GPU, after a laptop-size review: what each fallback shows is what it says it is.

The copy-call table no longer shows the NVIDIA post's copy + kernel + copy totals under the heading "the copy
call's duration": it says that nothing of the copy call is shown, and the totals follow under their own heading, as
a related experiment. The hazard reports read as words ("elements copied = 4,194,304", not "of = 4194304"), the
decode comparison's bytes panel says its counts are counted, not timed, and the chapter's text neither gives
exercise 05.1's answer in the live panel's prose nor says that the timings fall back to a schematic.
"""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from helpers.chapters.ch05 import gpudecode, hazards  # noqa: E402
from helpers.chapters.ch05 import overlap as ov  # noqa: E402
from helpers.core import evidence  # noqa: E402
from helpers.core.results import ResultSet  # noqa: E402
from helpers.core.timing import Timing  # noqa: E402

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "05_overlap_async_transfer.ipynb"
no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")


def _cells() -> list[dict]:
    return json.loads(NOTEBOOK.read_text(encoding="utf-8"))["cells"]


def _flat(text: str) -> str:
    return " ".join(text.split())


def _cpu_cells() -> list[ov.CellResult]:
    return [ov.run_cell(m, s, copy_mib=1, matmul_n=32, steps=2, device="cpu") for m, s in ov.CELLS]


@no_gpu
def test_without_a_recording_the_copy_call_shows_nothing_and_no_published_total(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(evidence.REFERENCE_ENV, str(tmp_path))
    ev = ov.copy_call_evidence(_cpu_cells(), "cpu")
    text = _flat(str(ev))
    assert ev.kind == "missing" and not ev and not ev.cited
    assert text.startswith("No CUDA device") and "[missing] the copy call's duration" in text
    assert "No published figure of the copy call's duration is shown." in text
    assert "8.84588" not in text and "Harris" not in text


@no_gpu
def test_a_gpu_recording_fills_the_copy_call_table(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(evidence.REFERENCE_ENV, str(tmp_path))
    rs = ResultSet(name="t", method="test", provenance={"hardware": {"gpu_name": "TestGPU"}},
                   created="2026-01-01T00:00:00+00:00", mode="quick")  # fmt: skip
    p = {"memory": "pinned", "stream": "side", "copy_bytes": 1 << 20, "matmul_n": 32, "steps": 8}
    rs.add("ch05.overlap.step_time", 0.004, "s", **p)
    rs.add("ch05.overlap.copy_time", 0.001, "s", **p)
    rs.save(tmp_path / "ref.json")
    ev = ov.copy_call_evidence(_cpu_cells(), "cpu")
    assert ev.kind == "recorded" and ev.value == [("pinned + side stream", None, 0.001, 0.004)]


def test_the_published_totals_are_a_related_experiment_not_the_copy_call() -> None:
    ev = ov.related_totals()
    assert ev.kind == "published" and ev.cited and not ev
    assert all(f.matches("ch05.overlap.step_time") for f in ev.cited)
    header = _flat(ev.header())
    assert header.startswith("[published] a related experiment: copy + kernel + copy totals")
    assert "none is the copy call's duration" in header and "the copy call's duration:" not in header
    text = _flat(str(ev))
    assert all(f.url in text and f.date_read in text for f in ev.cited)


def test_the_notebook_shows_the_totals_apart_from_the_copy_call_table() -> None:
    sources = ["".join(c["source"]) for c in _cells()]
    (cell,) = [s for s in sources if "overlap.copy_call_table" in s]
    assert "overlap.copy_call_evidence(cells, DEVICE)" in cell and "overlap.related_totals().show()" in cell
    assert "measure_or_recall" not in cell
    text = "\n".join(sources)
    assert "figures of the same experiment that others published" not in text
    assert "a related experiment" in text


def test_the_live_panel_prose_does_not_give_exercise_05_1_away() -> None:
    (panel,) = [c for c in _cells() if c["cell_type"] == "markdown" and "".join(c["source"]).startswith("## Live")]
    text = "".join(panel["source"])
    assert "pinned source on a side stream" not in text and "the three conditions of Theory" in text


def test_the_aim_says_what_the_timings_fall_back_to() -> None:
    aim = "".join(_cells()[0]["source"])
    assert "figures others published" in aim and "expected" in aim
    assert "timings are reference recordings with their provenance, or, if none has been recorded yet, a" not in aim


@no_gpu
@pytest.mark.parametrize(
    ("run", "count"),
    [
        (hazards.hazard_d2h_read_before_sync, "wrong elements when read"),
        (hazards.hazard_pinned_source_mutation, "elements that arrived wrong"),
    ],  # fmt: skip
)
def test_a_hazard_report_reads_as_words(run, count: str) -> None:  # type: ignore[no-untyped-def]
    h = run("cpu")
    assert h.bug["elements copied"] == h.fix["elements copied"] == hazards.N and "of" not in h.bug
    report = h.report()
    assert f"{count} = 0, elements copied = {hazards.N:,}" in report
    assert " of = " not in report and f"= {hazards.N}," not in report


def test_the_bytes_panel_says_its_counts_are_counted_not_timed() -> None:
    t = Timing("t", 0.01, 0.0, 0.01, 0.01, 0.01, 1, times_s=[0.01])
    cmp = gpudecode.DecodeComparison("cpu", False, 4, 8, 16, 1, {"jpeg": [100], "uint8": [768], "float32": [3072]},
                                     t, t, False)  # fmt: skip
    fig = gpudecode.plot_comparison(cmp)
    title = _flat(fig.axes[0].get_title())
    assert "counted from the files and the crop shapes, not timed" in title
    plt.close(fig)
    note = _flat(cmp.report())
    assert "GPU figures come from a GPU's recording or, without one, from figures others published" in note
