"""The live panels of chapters 00, 01 and 07, built as the notebook builds them and driven from Python.

These checks used to be cells of the chapters ("drive the panel from Python once, as a test would"); they
are tests, so they live here (issue #28) and the reader's path keeps only the panel's cell.

The panel is built by running the notebook's own code cells in quick mode (``WORKBOOK_QUICK=1``): the
panel's cell and, transitively, each earlier cell that defines a name it reads. That is the selection the
browser suite makes (``panel_cells`` in ``tests/browser/test_chapters.py``), so the panel here is the
reader's panel, wired to the reader's own functions (chapter 01's ``make_loader``, ``to_device``,
``train_step``).
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path
from typing import Any

import pytest
from test_reader_path import driving_cells

from helpers.pipeline import loaders

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"


def _browser_panel_cells() -> Any:
    spec = importlib.util.spec_from_file_location("_browser_chapters", ROOT / "tests" / "browser" / "test_chapters.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.panel_cells


panel_cells = _browser_panel_cells()


def build_panel(chapter: str, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Run the cells the chapter's live panel needs, in quick mode; returns the notebook's namespace."""
    monkeypatch.setenv("WORKBOOK_QUICK", "1")
    monkeypatch.setenv("MPLBACKEND", "Agg")
    cells = json.loads((NOTEBOOKS / chapter).read_text())["cells"]
    code = ["".join(c["source"]) for c in cells if c["cell_type"] == "code"]
    needed = panel_cells(code)
    assert needed, f"{chapter}: no cell builds a widgets.Panel"
    ns: dict[str, Any] = {"__name__": "__main__"}
    for i in needed:
        exec(compile(code[i], f"{chapter}[code cell {i}]", "exec"), ns)
    assert "panel" in ns, f"{chapter}: the panel's cell binds no name `panel`"
    return ns


@pytest.mark.parametrize(
    "chapter", ["00_setup_and_measuring.ipynb", "01_baseline_pipeline.ipynb", "07_beyond_one_gpu.ipynb"]
)
def test_the_notebook_leaves_driving_to_these_tests(chapter: str) -> None:
    assert driving_cells(chapter) == [], f"{chapter}: a cell still drives the panel and asserts; it belongs here"


def test_ch00_panel_two_runs_keep_the_history(monkeypatch: pytest.MonkeyPatch) -> None:
    panel = build_panel("00_setup_and_measuring.ipynb", monkeypatch)["panel"]
    panel.set(op="add", n=128)
    panel.click()
    panel.set(op="matmul", n=128)
    panel.click()
    assert panel.error is None, panel.error
    assert len(panel.history) == 2 and panel.history[-1].values == {"op": "matmul", "n": 128}
    assert all(run.result.here for run in panel.history)  # each result is an Evidence: measured now, here


def test_ch01_panel_times_the_readers_functions(monkeypatch: pytest.MonkeyPatch) -> None:
    ns = build_panel("01_baseline_pipeline.ipynb", monkeypatch)
    panel = ns["panel"]
    panel.set(batch_size=ns["BATCH_SIZE"], crop_size=ns["CROP"], width=8)
    panel.click()
    assert panel.error is None, panel.error
    run = panel.last.result  # an Evidence: measured now, here, with its source
    assert panel.last.values["width"] == 8 and run.here and "forward" in run.value.phase_means
    assert run.value.settings["pipeline"] == "yours"  # the panel timed the notebook's functions
    assert ns["PIPELINE"]["train_step"].__code__.co_filename.startswith("01_baseline_pipeline.ipynb")


@pytest.mark.slow
def test_ch07_panel_runs_one_process_and_leaves_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    ns = build_panel("07_beyond_one_gpu.ipynb", monkeypatch)
    panel = ns["panel"]
    panel.set(processes=1, workers=ns["WORKERS"], batch_size=ns["BATCH"])
    panel.click()
    assert panel.error is None, panel.error
    one = panel.last.result.value  # the Evidence's payload: the DistributedRun, measured here
    assert panel.last.result.here and one.exactly_once_every_epoch() and one.nproc == 1
    assert one.leftover_pids == [] and not loaders.worker_processes()
    assert "measured here" in panel.last.summary
    assert os.environ["WORKBOOK_QUICK"] == "1"
