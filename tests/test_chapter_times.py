"""The recorded Run All times a setup cell quotes (tools/time_chapters.py writes them)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers.core import config


def _runtime_line(monkeypatch: pytest.MonkeyPatch, chapter: str, tier: str) -> str | None:
    """The Run All line describe_sizes prints for ``chapter`` at ``tier`` (chosen by the variables), if any."""
    monkeypatch.setenv(config.QUICK_ENV, "1" if tier == "quick" else "0")
    monkeypatch.setenv(config.FULL_ENV, {"quick": "", "laptop": "0", "full": "1"}[tier])
    last = config.describe_sizes(chapter).splitlines()[-1]
    return last if last.startswith("Run All took") else None


def test_expected_runtime_reads_the_record(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    f = tmp_path / "t.json"
    f.write_text(
        json.dumps(
            {
                "machine": "2 cores, no GPU",
                "date": "2026-11-22",
                "chapters": {"04": {"laptop": {"seconds": 170.0}, "quick": {"seconds": 40}}},
            }
        )
    )
    monkeypatch.setattr(config, "_chapter_times_file", lambda: f)
    assert (
        _runtime_line(monkeypatch, "04", "laptop")
        == "Run All took about 3 min at laptop sizes on 2 cores, no GPU (measured 2026-11-22)."
    )
    assert "about 40 s" in (_runtime_line(monkeypatch, "04", "quick") or "")
    assert _runtime_line(monkeypatch, "04", "full") is None
    assert _runtime_line(monkeypatch, "09", "quick") is None


def test_expected_runtime_survives_a_missing_or_broken_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(config, "_chapter_times_file", lambda: tmp_path / "none.json")
    assert _runtime_line(monkeypatch, "00", "quick") is None
    (tmp_path / "bad.json").write_text("{not json")
    monkeypatch.setattr(config, "_chapter_times_file", lambda: tmp_path / "bad.json")
    assert _runtime_line(monkeypatch, "00", "quick") is None
    monkeypatch.setenv(config.QUICK_ENV, "1")
    assert config.describe_sizes("00").startswith("Sizes: quick sizes")


def test_committed_record_is_well_formed() -> None:
    f = config._chapter_times_file()
    if not f.exists():
        pytest.skip("no chapter times recorded yet (python tools/time_chapters.py)")
    data = json.loads(f.read_text())
    assert {"machine", "date", "method", "chapters"} <= data.keys()
    for chapter, tiers in data["chapters"].items():
        assert len(chapter) == 2 and chapter.isdigit()
        for tier, entry in tiers.items():
            assert tier in config.TIERS and entry["seconds"] > 0
