"""The one result type: measured / recorded / published / theoretical / missing, and the one setup call."""

from __future__ import annotations

import pytest
import torch

from helpers.core import evidence, results, setup


@pytest.fixture()
def refdir(tmp_path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv(evidence.REFERENCE_ENV, str(tmp_path))
    return tmp_path


def _reference(refdir) -> None:
    rs = results.ResultSet.new("unit", "events around 20 copies")
    rs.provenance["hardware"]["gpu_name"] = "NVIDIA H200"
    rs.provenance["driver_version"] = "580.1"
    rs.add("ch02.pin", 0.004, "s", bytes=1 << 20)
    rs.add("ch02.pin", 0.02, "s", bytes=16 << 20)
    rs.save(refdir / "h200.json")


def test_measured_is_true_and_names_the_device() -> None:
    ev = evidence.measured("the copy time", 1.5, torch.device("cpu"), method="median of 5")
    assert ev and ev.here and ev.kind == "measured" and ev.value == 1.5
    assert ev.source.startswith("measured now on cpu") and "median of 5" in ev.source
    assert ev.lines(lambda v: f"{v} s")[-1] == "1.5 s"
    assert ev.header().startswith("[measured here] the copy time: measured now on cpu")


def test_missing_is_false_has_no_value_and_says_how_to_record(refdir) -> None:
    ev = evidence.recorded("the uint8 vs float32 GPU copy", "ch02.wire_time")  # nothing published either
    assert not ev and ev.kind == "missing" and ev.value is None
    assert "make gpu-check" in str(ev) and "[missing] the uint8 vs float32 GPU copy" in str(ev)
    assert "No published figure of this experiment was found" in " ".join(str(ev).split())
    assert ev.lines(lambda v: "never called") == ev.lines()  # no value, no body


def test_without_a_recording_the_published_figures_of_the_experiment_are_shown(refdir) -> None:
    ev = evidence.recorded("the cost of pinning", "ch02.pin", note="No CUDA device here.")
    assert ev.kind == "published" and ev.value is None and ev.cited and not ev  # text only: never drawn
    text = ev.lines(lambda v: "never called")
    assert "never called" not in text and text[0] == "No CUDA device here."
    assert text[1].startswith("[published] the cost of pinning: No reference results for the cost of pinning")
    joined = " ".join(" ".join(text).split())
    for fig in ev.cited:
        assert fig.url in joined and fig.date_read in joined and " ".join(fig.quote.split()) in joined


def test_recorded_reads_the_newest_reference_with_its_provenance(refdir) -> None:
    _reference(refdir)
    ev = evidence.recorded("the cost of pinning", "ch02.pin", convert=lambda rs, recs: [r.value for r in recs])
    assert ev and not ev.here and ev.kind == "recorded" and ev.value == [0.004, 0.02]
    assert "Recorded on NVIDIA H200, driver 580.1" in ev.source and "not this machine" in ev.source
    one = evidence.recorded("one size", "ch02.pin", bytes=1 << 20)
    assert [r.value for r in one.value] == [0.004]
    unusable = evidence.recorded("the cost of pinning", "ch02.pin", convert=lambda rs, recs: None)
    assert not unusable and unusable.kind == "published"  # unusable records: the published figures instead


def test_measure_or_recall_measures_only_on_cuda(refdir) -> None:
    calls = []

    def measure() -> float:
        calls.append(1)
        return 1.0

    ev = evidence.measure_or_recall("the cost of pinning", "cpu", measure, key="ch02.pin")
    assert not calls and not ev and ev.kind == "published"  # no recording: others' figures, cited
    assert ev.note.startswith("No CUDA device") and str(ev).startswith("No CUDA device")
    _reference(refdir)
    ev = evidence.measure_or_recall("the cost of pinning", "cpu", measure, key="ch02.pin")
    assert not calls and ev.kind == "recorded" and len(ev.value) == 2


def test_theoretical_needs_its_basis() -> None:
    assert evidence.theoretical("PCIe 5 x16", 63.0, "32 GT/s x 16 lanes, 128b/130b").source.startswith("theoretical")
    with pytest.raises(ValueError, match="basis"):
        evidence.theoretical("x", 1.0, "")


def test_the_type_refuses_inconsistent_states() -> None:
    with pytest.raises(ValueError, match="kind must be one of"):
        evidence.Evidence("x", "simulated", 1.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="exactly when"):
        evidence.Evidence("x", "measured", None)
    with pytest.raises(ValueError, match="exactly when"):
        evidence.Evidence("x", "missing", 1.0)
    fig = evidence.cited_for("ch02.pin")[0]
    with pytest.raises(ValueError, match="cited figures belong"):
        evidence.Evidence("x", "missing", None, cited=(fig,))
    with pytest.raises(ValueError, match="cited figures belong"):
        evidence.Evidence("x", "published", 1.0, "a citation", cited=(fig,))


def test_setup_chapter_prints_the_mode_line_and_returns_the_device(capsys: pytest.CaptureFixture[str]) -> None:
    dev = setup.chapter("02", gpu_for="host-to-GPU copies", prefer="cpu")
    out = capsys.readouterr().out.splitlines()
    assert dev == torch.device("cpu")
    assert out[0].startswith("Chapter 02 · ") and "device: cpu" in out[0] and torch.__version__ in out[0]
    assert any(line.startswith("Sizes:") for line in out)
    assert any("No CUDA device" in line for line in out) and "host-to-GPU copies" in " ".join(out)
    setup.chapter("02", prefer="cpu")
    assert "No CUDA device" not in capsys.readouterr().out  # nothing GPU-only: no sentence
    with pytest.raises(ValueError, match="two digits"):
        setup.chapter("2")
