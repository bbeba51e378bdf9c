"""Issue 25 item 7 (chapters 03-04's part): worker counts far above the machine's cores are refused where a reader asks
for them (``measure_config``, chapter 04's panel) with one line saying what to choose, before any worker starts;
and every code cell of notebooks 03 and 04 imports what it uses (a skipped cell never leaves a NameError behind).
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import nbformat
import pytest

from helpers.chapters import ch04
from helpers.chapters.ch04.datasets import CheapDataset
from helpers.core.progress import no_progress
from helpers.pipeline import loaders as L
from helpers.pipeline import workers

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def two_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(workers, "cpu_cores", lambda: 2)


def _assert_one_clear_line(msg: str) -> None:
    assert "num_workers=64" in msg and "2 CPU cores" in msg and "at most 8" in msg, msg
    assert "\n" not in msg


def _make_loader(dataset: Any, batch_size: int, workers: int = 0, persistent: bool = False, prefetch_factor: int = 2):
    raise AssertionError("the panel must refuse before it builds a loader")


def test_limit_is_four_per_core_and_never_below_eight(two_cores: None, monkeypatch: pytest.MonkeyPatch) -> None:
    assert L.check_workers_for_cores(8) == 8
    with pytest.raises(ValueError, match="at most 8"):
        L.check_workers_for_cores(9)
    monkeypatch.setattr(workers, "cpu_cores", lambda: 16)
    assert L.check_workers_for_cores(64) == 64
    with pytest.raises(ValueError, match="at most 64"):
        L.check_workers_for_cores(65)


def test_measure_config_refuses_64_workers_on_2_cores(two_cores: None) -> None:
    before = L.worker_processes()
    with pytest.raises(ValueError) as info:
        L.measure_config(CheapDataset(64, 4), batch_size=4, num_workers=64, batches=2)
    _assert_one_clear_line(str(info.value))
    assert L.worker_processes() == before  # refused before any worker started


def test_chapter_04_panel_refuses_64_workers_on_2_cores(two_cores: None) -> None:
    with pytest.raises(ValueError) as info:
        ch04.panel_run(
            no_progress, device="cpu", num_workers=64, item_cost=ch04.ITEM_COSTS[0], make_loader=_make_loader
        )
    _assert_one_clear_line(str(info.value))


def test_the_panel_shows_the_refusal_in_its_status_line(two_cores: None) -> None:
    from helpers.ui import widgets

    panel = widgets.Panel.for_chapter(ch04, device="cpu", make_loader=_make_loader, n_cheap=64)
    panel.controls["num_workers"].max = 100  # the slider stops at cores + 2; a cell can still ask for more
    panel.set(num_workers=64, item_cost=ch04.ITEM_COSTS[0])
    assert panel.click() is None
    assert panel.error is not None and panel.error.startswith("Can't run with these settings: num_workers=64")


def _imports(tree: ast.AST) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            names.update(a.asname or a.name for a in node.names)
    return names


@pytest.mark.parametrize("name", ["03_dataloader_pinning", "04_worker_processes"])
def test_every_cell_imports_what_it_uses(name: str) -> None:
    """A name imported in a cell other than the setup cell is imported again in every cell that uses it: a
    reader who skips the cell that first imported it (a long sweep) gets no NameError further down."""
    nb = nbformat.read(ROOT / "notebooks" / f"{name}.ipynb", as_version=4)
    cells = [c for c in nb.cells if c.cell_type == "code"]
    setup = next(c for c in cells if "parameters" in c.metadata.get("tags", []))
    trees = [ast.parse(c.source) for c in cells]
    from_setup = _imports(ast.parse(setup.source))
    elsewhere = set().union(*(_imports(t) for t in trees)) - from_setup
    missing = []
    for i, (cell, tree) in enumerate(zip(cells, trees)):
        used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
        lacking = (used & elsewhere) - _imports(tree)
        if lacking and cell is not setup:
            missing.append((i, sorted(lacking), cell.source.splitlines()[0]))
    assert not missing, f"code cells using a name imported only in another cell: {missing}"
