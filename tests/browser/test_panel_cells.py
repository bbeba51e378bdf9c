"""Which cells the browser suite runs after nbval (``panel_cells``): no browser needed, runs with the unit tests."""

from __future__ import annotations

import json

import pytest
from test_chapters import CHAPTERS, NOTEBOOKS, panel_cells


def _code(name: str) -> list[str]:
    cells = json.loads((NOTEBOOKS / name).read_text())["cells"]
    return ["".join(c["source"]) for c in cells if c["cell_type"] == "code"]


def test_follows_globals_not_parameters_or_loop_targets() -> None:
    cells = [
        "import torch\nSEED = 0\nx = 1",  # 0: setup
        "with bar() as progress:\n    y = slow(progress)",  # 1: a measurement (binds y, progress)
        "def make(n, progress=None):\n    return torch.ones(n) * SEED + progress",  # 2: reads SEED, not n/progress
        "for x in range(3):\n    print(x)",  # 3: its own x
        "panel = widgets.Panel('p', {}, lambda progress, n: make(n, progress))",  # 4
    ]
    assert panel_cells(cells) == [0, 2, 4]


def test_a_global_read_pulls_in_the_latest_cell_that_defines_it() -> None:
    cells = ["A = 1", "A = 2\nB = A", "C = [a for a in range(B)]", "unrelated = 5", "panel = Panel(C)"]
    assert panel_cells(cells) == [1, 2, 4]


def test_no_panel_means_run_all() -> None:
    assert panel_cells(["x = 1", "print(x)"]) is None


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_every_chapter_has_a_panel_and_its_cells_start_with_the_setup_cell(chapter: str) -> None:
    code = _code(chapter)
    needed = panel_cells(code)
    assert needed, f"{chapter}: no cell builds a widgets.Panel"
    assert needed[0] == 0 and "Panel.for_chapter(" in code[needed[-1]]
