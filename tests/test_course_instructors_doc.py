"""docs/INSTRUCTORS.md's times match their sources: Run All from helpers/core/chapter_times.json (laptop tier),
reading from the words of each chapter's markdown cells at 200 words a minute."""

from __future__ import annotations

import json
import re
from pathlib import Path

import nbformat
import pytest

from course import release
from helpers.core import config

DOC = Path(__file__).resolve().parents[1] / "docs" / "INSTRUCTORS.md"
ROW = re.compile(r"^\| (\d\d) · [^|]+\| (\d+) min \| (\d+) s \|", re.M)
TOTAL = re.compile(r"^\| \*\*all\*\* \| \*\*about (\d+) min\*\* \| \*\*about (\d+) min\*\* \((\d+) s\) \|", re.M)
WORDS_PER_MINUTE = 200


def _half_up(x: float) -> int:
    return int(x + 0.5)


def _table() -> tuple[dict[str, tuple[int, int]], tuple[int, int, int]]:
    """The doc's table: chapter -> (reading min, Run All s), and the 'all' row (reading min, Run All min, s)."""
    text = DOC.read_text()
    rows = {ch: (int(read), int(run)) for ch, read, run in ROW.findall(text)}
    total = TOTAL.search(text)
    assert total, "the table's **all** row is not in the expected form"
    return rows, (int(total[1]), int(total[2]), int(total[3]))


def _laptop_seconds() -> dict[str, float]:
    f = config._chapter_times_file()
    if not f.exists():
        pytest.skip("no chapter times recorded (python tools/time_chapters.py)")
    chapters = json.loads(f.read_text())["chapters"]
    return {ch: float(tiers["laptop"]["seconds"]) for ch, tiers in chapters.items() if "laptop" in tiers}


def _markdown_words(path: Path) -> int:
    nb = nbformat.read(path, as_version=4)
    return sum(len(c.source.split()) for c in nb.cells if c.cell_type == "markdown")


def test_run_all_figures_are_the_times_files() -> None:
    text = " ".join(DOC.read_text().split())
    rows, (_, total_min, total_s) = _table()
    seconds = _laptop_seconds()
    assert {ch: run for ch, (_, run) in rows.items()} == {ch: _half_up(s) for ch, s in seconds.items()}
    total = sum(seconds.values())
    assert (total_s, total_min) == (_half_up(total), _half_up(total / 60))
    slowest = max(seconds, key=seconds.__getitem__)
    assert f"at most {_half_up(seconds[slowest])} s at the laptop tier, chapter {slowest}'s" in text
    assert f"about {_half_up(total / 60)} minutes of Run All ({_half_up(total)} s in all)" in text


def test_reading_figures_add_up_and_follow_the_chapters() -> None:
    rows, (total_reading, _, _) = _table()
    assert sum(read for read, _ in rows.values()) == total_reading
    words = {release.chapter_of(p): _markdown_words(p) for p in release.chapter_notebooks()}
    assert set(rows) == set(words)
    drifted = {}
    for ch, (read, _) in rows.items():
        now = words[ch] / WORDS_PER_MINUTE
        if abs(read - now) > max(2.0, 0.15 * now):
            drifted[ch] = f"{read} min in the doc, {now:.1f} min now ({words[ch]:,} words)"
    assert not drifted, f"update docs/INSTRUCTORS.md's reading column: {drifted}"
    said = re.search(r"([\d,]+) in all, counted on", DOC.read_text())
    assert said, "the doc no longer says how many words the chapters hold"
    assert abs(int(said[1].replace(",", "")) - sum(words.values())) <= 0.15 * sum(words.values())
