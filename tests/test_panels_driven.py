"""Every chapter's live panel (and the chapter template's), built as the notebook builds it and driven from Python.

These checks used to be cells of the chapters ("drive the panel from Python once, as a test would"); they
are tests, so they live here (issue #28) and the reader's path keeps only the panel's cell. A new chapter's
panel test goes here too (the template's is the model).

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
from test_reader_path import STRUCTURED, driving_cells, notebook_path

from helpers.chapters.ch02.copies import MiB
from helpers.chapters.ch06 import capstone
from helpers.core import evidence
from helpers.pipeline import loaders

ROOT = Path(__file__).resolve().parent.parent


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
    cells = json.loads(notebook_path(chapter).read_text())["cells"]
    code = ["".join(c["source"]) for c in cells if c["cell_type"] == "code"]
    needed = panel_cells(code)
    assert needed, f"{chapter}: no cell builds a widgets.Panel"
    ns: dict[str, Any] = {"__name__": "__main__"}
    for i in needed:
        exec(compile(code[i], f"{chapter}[code cell {i}]", "exec"), ns)
    assert "panel" in ns, f"{chapter}: the panel's cell binds no name `panel`"
    return ns


@pytest.mark.parametrize("chapter", STRUCTURED)
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


def test_ch02_panel_copies_a_float32_batch_with_the_readers_time_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    ns = build_panel("02_pageable_vs_pinned.ipynb", monkeypatch)
    panel = ns["panel"]
    panel.set(size_mib=1, direction="h2d", memory="pageable", dtype="float32")
    panel.click()
    assert panel.error is None, panel.error
    result = panel.last.result  # an Evidence: measured here, whatever the machine
    reading = result.value
    assert result.here and reading.nbytes == 4 * MiB and (reading.measured is not None) == ns["HAS_CUDA"]


def test_ch03_panel_runs_the_readers_loader_pinned_and_leaves_no_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    panel = build_panel("03_dataloader_pinning.ipynb", monkeypatch)["panel"]
    panel.set(pin_memory=True)
    rec = panel.click()
    assert panel.error is None, panel.error
    assert rec.result.here and not loaders.worker_processes()  # measured here; no worker left behind
    assert "measured here" in rec.summary  # the line the cell printed for the reader


def test_ch04_panel_runs_two_persistent_workers_and_releases_them(monkeypatch: pytest.MonkeyPatch) -> None:
    panel = build_panel("04_worker_processes.ipynb", monkeypatch)["panel"]
    panel.set(num_workers=2, persistent=True)
    rec = panel.click()
    assert panel.error is None, panel.error
    assert rec.result.here and not loaders.worker_processes()  # measured here; workers released
    assert "measured here" in rec.summary  # the line the cell printed for the reader


def test_ch05_panel_shows_a_cell_of_the_2x2_experiment(monkeypatch: pytest.MonkeyPatch) -> None:
    ns = build_panel("05_overlap_async_transfer.ipynb", monkeypatch)
    panel = ns["panel"]
    panel.set(memory="pageable", stream="side", copy_mib=2, matmul_n=128)
    panel.click()
    assert panel.error is None, panel.error
    assert isinstance(panel.last.result, evidence.Evidence) and panel.last.result.here == ns["ON_GPU"]
    assert panel.last.result.kind in ("measured", "recorded", "theoretical")


def test_ch06_panel_keeps_its_ticks_consistent_and_runs_what_they_show(monkeypatch: pytest.MonkeyPatch) -> None:
    panel = build_panel("06_capstone.ipynb", monkeypatch)["panel"]
    panel.set(regime="data-bound", workers=False, persistent=True)  # persistent ticks workers too
    assert panel.controls["workers"].value is True
    panel.set(workers=False)  # ... and unticking workers unticks persistent
    assert panel.controls["persistent"].value is False
    panel.set(workers=True, persistent=True, uint8=True)  # the run below uses these ticks
    panel.click()
    assert panel.error is None, panel.error
    assert panel.last.result.here  # measured now, on this machine
    assert len(panel.history) == 1 and panel.last.result.value.settings.output == "uint8"
    ran = panel.last.result.value.settings
    assert (panel.controls["workers"].value, panel.controls["persistent"].value, panel.controls["uint8"].value) == (
        ran.num_workers > 0,
        ran.persistent_workers,
        ran.output == "uint8",
    )  # controls and status agree
    ticked = [s.label for s in capstone.STEPS[1:] if panel.controls[s.name].value]
    assert ticked == ["+ workers", "+ persistent, prefetch 4", "+ uint8, device normalise"]
    assert not loaders.worker_processes()


def test_template_panel_times_a_host_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    panel = build_panel("chapter_template.ipynb", monkeypatch)["panel"]
    panel.set(size_mib=1)
    panel.click()
    assert panel.error is None, panel.error
    assert panel.last.result.here and panel.last.result.value.median_s > 0
