"""The reader builds the pipeline: the lines each chapter teaches stand in its own short code cells.

Rules (issue "The reader builds the pipeline"):
- every chapter 01-06 has code cells tagged ``pipeline`` that define the pipeline's functions;
- the tokens a chapter teaches appear in its code cells, not only in markdown;
- no code cell of chapters 01-06 is longer than 25 lines, and no pipeline cell longer than 20 code lines;
- chapters 02-06 show what they changed with ``codecells.show_diff``;
- chapter 06's pipeline cells are, line for line, the pipeline of ``examples/fast_pipeline.py``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers.ui import codecells

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "fast_pipeline.py"
TEACHES = {
    "01": ("DataLoader(", ".to("),
    "02": ("pin_memory()", ".to(", "non_blocking=True"),
    "03": ("DataLoader(", "pin_memory=True", "non_blocking=True"),
    "04": ("num_workers", "persistent_workers", "prefetch_factor", "worker_init_fn", "in_order"),
    "05": ("torch.cuda.Stream", "wait_stream", "record_stream", "non_blocking=True"),
    "06": (
        "DataLoader(",
        "pin_memory",
        "num_workers",
        "persistent_workers",
        "prefetch_factor",
        "non_blocking=True",
        "wait_stream",
        "record_stream",
    ),
}
MAX_CELL_LINES = 25
MAX_PIPELINE_LINES = 20


def code_lines(source: str) -> int:
    """Lines of a cell that a reader reads: not blank, not only a comment."""
    return sum(1 for ln in source.splitlines() if ln.strip() and not ln.strip().startswith("#"))


def test_code_lines_skip_blanks_and_comments() -> None:
    assert code_lines("a = 1\n\n# note\n  # indented note\nb = 2  # trailing\n") == 2


def _code_cells(chapter: str) -> list[str]:
    nb = json.loads(codecells.notebook_path(chapter).read_text(encoding="utf-8"))
    return ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code"]


@pytest.mark.parametrize("chapter", sorted(TEACHES))
def test_chapter_defines_its_pipeline_in_tagged_cells(chapter: str) -> None:
    cells = codecells.pipeline_cells(chapter)
    assert cells, f"chapter {chapter}: tag the cells that define the pipeline with '{codecells.PIPELINE_TAG}'"
    for cell in cells:
        assert codecells.definitions(cell), f"chapter {chapter}: a pipeline cell defines no function:\n{cell}"
        assert code_lines(cell) <= MAX_PIPELINE_LINES, f"chapter {chapter}: pipeline cell too long:\n{cell}"


@pytest.mark.parametrize("chapter", sorted(TEACHES))
def test_taught_tokens_are_in_code_cells(chapter: str) -> None:
    code = "\n".join(_code_cells(chapter))
    missing = [t for t in TEACHES[chapter] if t not in code]
    assert not missing, f"chapter {chapter} teaches {missing} only in markdown (or not at all)"


@pytest.mark.parametrize("chapter", sorted(TEACHES))
def test_no_code_cell_is_longer_than_a_screen(chapter: str) -> None:
    for cell in _code_cells(chapter):
        lines = [ln for ln in cell.splitlines() if ln.strip()]
        assert len(lines) <= MAX_CELL_LINES, f"chapter {chapter}: a code cell has {len(lines)} lines:\n{cell[:400]}"


@pytest.mark.parametrize("chapter", [c for c in sorted(TEACHES) if c != "01"])
def test_chapter_shows_its_diff(chapter: str) -> None:
    assert any("show_diff(" in cell for cell in _code_cells(chapter)), f"chapter {chapter} never shows its diff"


def _script_pipeline() -> list[str]:
    lines = SCRIPT.read_text(encoding="utf-8").splitlines()
    start, end = lines.index("# --- pipeline: start ---"), lines.index("# --- pipeline: end ---")
    return [ln.rstrip() for ln in lines[start + 1 : end] if ln.strip()]


def test_chapter_06_pipeline_is_the_take_home_script() -> None:
    cells = [ln.rstrip() for cell in codecells.pipeline_cells("06") for ln in cell.splitlines() if ln.strip()]
    assert cells == _script_pipeline(), (
        "chapter 06's pipeline cells and the lines between the markers of examples/fast_pipeline.py must be "
        "identical (blank lines aside); change both together"
    )


def test_the_packages_take_home_pipeline_is_the_script() -> None:
    """Issue #27: the capstone times the take-home pipeline without reading examples/ (a file outside the installed
    package): helpers/chapters/ch06/fast_pipeline.py holds the same lines as the script's pipeline block."""
    lines = (ROOT / "helpers" / "chapters" / "ch06" / "fast_pipeline.py").read_text(encoding="utf-8").splitlines()
    start, end = lines.index("# --- pipeline: start ---"), lines.index("# --- pipeline: end ---")
    assert [ln.rstrip() for ln in lines[start + 1 : end] if ln.strip()] == _script_pipeline(), (
        "helpers/chapters/ch06/fast_pipeline.py and examples/fast_pipeline.py must have the same lines between the "
        "pipeline markers (blank lines aside); change both together (and chapter 06's pipeline cells)"
    )


def test_the_pipeline_grows_one_chapter_at_a_time() -> None:
    before = codecells.pipeline_after("01")
    after = codecells.pipeline_after("06")
    assert set(before) <= set(after)
    for chapter in sorted(TEACHES)[1:]:
        prev = f"{int(chapter) - 1:02d}"
        changed = {
            n for n, src in codecells.pipeline_after(chapter).items() if codecells.pipeline_after(prev).get(n) != src
        }
        assert changed, f"chapter {chapter} changes no pipeline function"
