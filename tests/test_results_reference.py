from __future__ import annotations

import json

import pytest

from helpers.core import evidence, results


@pytest.fixture()
def rs() -> results.ResultSet:
    r = results.ResultSet.new("unit", "test method")
    r.add("ch02.h2d_bandwidth", 10.0, "GB/s", bytes=4096, memory="pinned")
    r.add("ch02.h2d_bandwidth", 5.0, "GB/s", spread={"iqr": 0.1}, bytes=4096, memory="pageable")
    r.artifacts["ch05.trace"] = {"spans": [], "metadata": {}}
    return r


def test_provenance_fields(rs: results.ResultSet) -> None:
    p = rs.provenance
    for key in ("hardware", "torch_version", "python_version", "driver_version", "report"):
        assert key in p
    assert rs.mode in ("quick", "laptop", "full") and rs.benchmark_version == results.BENCHMARK_VERSION
    assert rs.created[:4].isdigit() and "torch" in rs.label()


def test_save_load_roundtrip(rs: results.ResultSet, tmp_path) -> None:
    path = rs.save(tmp_path / "sub" / "r.json")
    data = json.loads(path.read_text())
    assert data["schema"] == results.SCHEMA and data["schema_version"] == results.SCHEMA_VERSION
    back = results.ResultSet.load(path)
    assert back.records == rs.records and back.artifacts == rs.artifacts and back.provenance == rs.provenance


def test_find(rs: results.ResultSet) -> None:
    assert len(rs.find("ch02.h2d_bandwidth")) == 2
    assert len(rs.find("ch02")) == 2  # prefix match on dotted keys
    assert len(rs.find("ch02.h2d")) == 0  # not a dotted prefix
    assert [r.value for r in rs.find("ch02.h2d_bandwidth", memory="pinned")] == [10.0]
    assert rs.keys() == ["ch02.h2d_bandwidth"]


def test_add_refuses_bad_values(rs: results.ResultSet) -> None:
    with pytest.raises(ValueError, match="finite"):
        rs.add("k", float("nan"), "s")
    with pytest.raises(ValueError, match="number"):
        rs.add("k", "fast", "s")
    with pytest.raises(ValueError, match="key"):
        rs.add("", 1.0, "s")


def test_load_refuses_non_results(tmp_path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        results.ResultSet.load(bad)
    bad.write_text(json.dumps({"schema": "something else"}))
    with pytest.raises(ValueError, match="not a workbook result file"):
        results.ResultSet.load(bad)
    with pytest.raises(FileNotFoundError):
        results.ResultSet.load(tmp_path / "missing.json")


def test_compare_same_hardware(rs: results.ResultSet) -> None:
    other = results.ResultSet.from_dict(rs.to_dict())
    other.records[0].value = 20.0
    lines = results.compare_results(rs, other)  # a line per matching record: reference -> yours (ratio yours/ref)
    pinned, pageable = [[ln for ln in lines if f"'memory': '{m}'" in ln] for m in ("pinned", "pageable")]
    assert len(lines) == 2 and pinned[0].endswith("10 -> 20 GB/s  (x2.00)")
    assert pageable[0].endswith("5 -> 5 GB/s  (x1.00)")


def test_compare_refuses_different_hardware(rs: results.ResultSet) -> None:
    other = results.ResultSet.from_dict(rs.to_dict())
    other.provenance["hardware"]["gpu_name"] = "NVIDIA H100 80GB HBM3"
    ok, why = results.comparable(rs, other)
    assert not ok and "gpu_name" in why
    with pytest.raises(results.NotComparableError, match="refusing to compare"):
        results.compare_results(rs, other)


def test_reference_fallback_and_lookup(rs: results.ResultSet, tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(evidence.REFERENCE_ENV, str(tmp_path))
    assert evidence.references() == []
    msg = evidence.missing_message("ch02.h2d_bandwidth")  # what a chapter shows when no file holds the key
    assert "No reference results" in msg and "make gpu-check" in msg
    # a reference recorded on another machine
    ref = results.ResultSet.from_dict(rs.to_dict())
    ref.provenance["hardware"]["gpu_name"] = "NVIDIA H200"
    ref.provenance["driver_version"] = "580.1"
    ref.save(tmp_path / "h200.json")
    (tmp_path / "broken.json").write_text("{")
    assert len(evidence.references()) == 1  # the broken file is skipped
    hits = evidence.recorded("H2D", "ch02.h2d_bandwidth", lambda rs, recs: recs, memory="pinned")
    assert hits.kind == "recorded" and len(hits.value) == 1 and hits.value[0].value == 10.0
    assert "Recorded on NVIDIA H200, driver 580.1" in hits.source
    assert evidence.recorded_artifact("trace", "ch05.trace").value == {"spans": [], "metadata": {}}
