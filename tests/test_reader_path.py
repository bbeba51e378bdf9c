"""The reader's path is for reading (issue #28): no test cells in the chapters, progress in long cells.

* A code cell that drives a live panel from Python (``panel.click()``, ``panel.run(...)``, a ``drive``
  call) *and* asserts on it is a test, not something to read: it belongs in ``tests/test_panels_driven.py``.
  The notebook keeps the panel's own cell, for the reader to press **Run**.
* A cell that calls one of the workbook's long helpers (several seconds at laptop size) hands it a
  ``progress=`` callback, so the cell shows its own bar.
* The setup section says how to follow a Run All (JupyterLab follows the running cell to the bottom).

Every chapter follows these rules, and so does the chapter template (``templates/chapter_template.ipynb``) a new
chapter starts from.

The signal is syntactic (Python's ``ast``), so it needs no kernel.
"""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"
TEMPLATE = ROOT / "templates" / "chapter_template.ipynb"
CHAPTERS = sorted(p.name for p in NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))
STRUCTURED = [*CHAPTERS, TEMPLATE.name]  # the chapters and the template a new one is copied from

PANEL_BUILD = re.compile(r"\bPanel(\.for_chapter)?$")  # widgets.Panel(...) / widgets.Panel.for_chapter(...)
DRIVE_METHODS = {"click", "run", "drive"}
# The workbook's helpers that take several seconds at laptop size; a cell calling one passes progress=.
LONG_HELPERS = {
    "record_steps",
    "step_anatomy",
    "launch_ddp",
    "make_shapes_dataset",
    "train_epochs",
    "pin_pair_rounds",
    "sweep_workers",
    "knob_rounds",
    "calibrate",
    "run_waterfall",
    "compare_decode",
    "time_batches",
}
# Seconds at laptop size too, but a cell may also call it inside a longer cell's `with progress_bar(...)`
# (these take no progress=: the cell's bar moves between calls).
BAR_ENOUGH = {"evaluate", "compare_threads", "spawn_failure_demo"}


def notebook_path(name: str) -> Path:
    """A chapter's notebook (``NN_title.ipynb``), or the chapter template (``chapter_template.ipynb``)."""
    return TEMPLATE if name == TEMPLATE.name else NOTEBOOKS / name


def _code_cells(name: str) -> list[str]:
    cells = json.loads(notebook_path(name).read_text())["cells"]
    return ["".join(c["source"]) for c in cells if c["cell_type"] == "code"]


def _parse(source: str) -> ast.Module | None:
    # Cell magics and shell escapes are not Python: such a cell can't be judged by its syntax.
    lines = [ln for ln in source.splitlines() if not ln.lstrip().startswith(("%", "!"))]
    try:
        return ast.parse("\n".join(lines))
    except SyntaxError:
        return None


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return ""


def panel_names(sources: list[str]) -> set[str]:
    """Names bound to a live panel anywhere in the notebook (``panel = widgets.Panel.for_chapter(...)``)."""
    names = {"panel"}
    for src in sources:
        tree = _parse(src)
        for node in ast.walk(tree) if tree else ():
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
                if PANEL_BUILD.search(_dotted(node.value.func)):
                    names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    return names


def drives_and_asserts(source: str, panels: set[str]) -> bool:
    """True when the cell calls a panel's run API (``<panel>.click()``/``.run()``/``.drive()``, or a function
    named ``drive...``) and has an ``assert`` statement."""
    tree = _parse(source)
    if tree is None:
        return False
    drives = asserts = False
    for node in ast.walk(tree):
        if isinstance(node, ast.Assert):
            asserts = True
        elif isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Attribute) and func.attr in DRIVE_METHODS and _dotted(func.value) in panels:
                drives = True
            elif _dotted(func).rsplit(".", 1)[-1].startswith("drive"):
                drives = True
    return drives and asserts


def driving_cells(name: str) -> list[int]:
    """Code-cell indices (0-based, code cells only) that drive a panel and assert on it."""
    sources = _code_cells(name)
    panels = panel_names(sources)
    return [i for i, src in enumerate(sources) if drives_and_asserts(src, panels)]


@pytest.mark.parametrize("chapter", STRUCTURED)
def test_no_cell_drives_a_panel_and_asserts(chapter: str) -> None:
    found = driving_cells(chapter)
    assert found == [], (
        f"{chapter}: code cells {found} drive the live panel from Python and assert on it; that is a test: "
        "move it to tests/test_panels_driven.py and leave the reader the panel's cell and what to try with it"
    )


def test_the_signal_finds_a_driving_cell_and_spares_the_panel_cell() -> None:
    build = "panel = widgets.Panel.for_chapter(ch00, device=DEVICE)\npanel"
    drive = "panel.set(op='add')\npanel.click()\nassert panel.error is None"
    other = "p2 = Panel('t', {}, run)\n"
    panels = panel_names([build, other])
    assert panels == {"panel", "p2"}
    assert not drives_and_asserts(build, panels)
    assert drives_and_asserts(drive, panels)
    assert drives_and_asserts("p2.run(n=3)\nassert p2.last", panels)
    assert drives_and_asserts("drive_panel(panel)\nassert True", panels)
    assert not drives_and_asserts("panel.click()", panels)  # driving without asserting: a demo, not a test
    assert not drives_and_asserts("loader.run()\nassert x", panels)  # not a panel
    assert not drives_and_asserts("%time panel.click(\nassert", panels)  # not Python: not judged


def _long_calls_without_progress(source: str) -> list[str]:
    tree = _parse(source)
    if tree is None:
        return []
    in_bar: set[int] = set()  # calls inside a `with progress_bar(...)` block
    for node in ast.walk(tree):
        if isinstance(node, ast.With) and any(
            isinstance(item.context_expr, ast.Call) and _dotted(item.context_expr.func).endswith("progress_bar")
            for item in node.items
        ):
            in_bar |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            fn = _dotted(node.func).rsplit(".", 1)[-1]
            told = any(k.arg == "progress" for k in node.keywords)
            if (fn in LONG_HELPERS and not told) or (fn in BAR_ENOUGH and not told and id(node) not in in_bar):
                out.append(fn)
    return out


def test_the_progress_rule() -> None:
    assert _long_calls_without_progress("anatomy.record_steps(a, steps=3)") == ["record_steps"]
    assert _long_calls_without_progress("anatomy.record_steps(a, steps=3, progress=p)") == []
    assert _long_calls_without_progress("acc = training.evaluate(m, v, D)") == ["evaluate"]
    assert _long_calls_without_progress('with progress_bar("x") as p:\n    training.evaluate(m, v, D)') == []
    assert _long_calls_without_progress('with progress_bar("x") as p:\n    anatomy.record_steps(a)') == ["record_steps"]
    assert _long_calls_without_progress("INFO = data.make_shapes_dataset()") == ["make_shapes_dataset"]
    assert _long_calls_without_progress('with progress_bar("d") as p:\n    data.make_shapes_dataset(progress=p)') == []
    assert _long_calls_without_progress("pitfalls.spawn_failure_demo(ds)") == ["spawn_failure_demo"]
    assert _long_calls_without_progress('with progress_bar("x") as p:\n    pitfalls.spawn_failure_demo(ds)') == []


def test_evaluate_reports_progress_after_every_batch() -> None:
    import torch

    from helpers.chapters.ch01 import training

    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(12, 3))
    batches = [(torch.randn(4, 3, 2, 2), torch.randint(0, 3, (4,))) for _ in range(3)]
    told: list[tuple[float, str]] = []
    acc = training.evaluate(model, batches, "cpu", progress=lambda f, t="": told.append((f, t)))
    assert 0.0 <= acc <= 1.0
    assert [f for f, _ in told] == [1 / 3, 2 / 3, 1.0, 1.0] and told[-1][1] == "validated 12 images"
    told.clear()
    training.evaluate(model, iter(batches), "cpu", progress=lambda f, t="": told.append((f, t)))  # no len: the end
    assert told == [(1.0, "validated 12 images")]


@pytest.mark.parametrize("chapter", STRUCTURED)
def test_long_cells_show_their_own_progress(chapter: str) -> None:
    missing = {i: f for i, src in enumerate(_code_cells(chapter)) if (f := _long_calls_without_progress(src))}
    assert missing == {}, (
        f"{chapter}: code cells {missing} call a helper that runs for seconds without progress=: wrap the call "
        'in `with progress_bar("what") as progress:` and pass progress=progress'
    )


@pytest.mark.parametrize("chapter", STRUCTURED)
def test_setup_section_says_how_to_follow_a_run_all(chapter: str) -> None:
    cells = json.loads(notebook_path(chapter).read_text())["cells"]
    setup = next("".join(c["source"]) for c in cells if "".join(c["source"]).startswith("## Setup"))
    assert "Run All" in setup and "progress" in setup, (
        f"{chapter}: the setup section must say how to follow progress during Run All "
        "(the running cell's [*], the progress bars, where Run All leaves the page)"
    )
