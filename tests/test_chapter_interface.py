"""Every chapter module follows the one interface (helpers/ui/chapter.py), and so does the template.

Chapter modules are found by folder name: ``helpers/chapters/chNN/__init__.py``, one per notebook
``notebooks/NN_*.ipynb``.
"""

from __future__ import annotations

import importlib
import re
import types
from pathlib import Path

import pytest

from helpers.chapters import _template
from helpers.core import evidence
from helpers.ui import chapter, widgets

ROOT = Path(__file__).resolve().parents[1]
MODULES = sorted(p.parent.name for p in (ROOT / "helpers" / "chapters").glob("ch[0-9][0-9]/__init__.py"))
NOTEBOOKS = sorted(re.match(r"\d\d", p.name).group(0) for p in (ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))


@pytest.mark.parametrize("name", MODULES)
def test_chapter_module_follows_the_interface(name: str) -> None:
    module = importlib.import_module(f"helpers.chapters.{name}")
    assert chapter.problems(module) == []


def test_the_template_follows_the_interface_and_its_panel_runs() -> None:
    assert chapter.problems(_template) == []
    panel = widgets.Panel.for_chapter(_template, device="cpu", mib=2)
    assert panel.controls["size_mib"].value == 2
    panel.set(size_mib=1)
    panel.click()
    assert panel.error is None, panel.error
    assert isinstance(panel.last.result, evidence.Evidence) and panel.last.result.here
    assert "measured here" in panel.last.summary


def test_for_chapter_refuses_a_module_off_the_interface_and_a_run_without_evidence() -> None:
    broken = types.ModuleType("helpers.chapters.ch98")
    broken.NUMBER = "97"
    with pytest.raises(ValueError, match="does not follow the chapter interface.*NUMBER is '97'"):
        widgets.Panel.for_chapter(broken, device="cpu")
    fake = types.ModuleType("fake")
    for name in (
        "NUMBER",
        "TITLE",
        "BENCH_WEIGHT",
        "PANEL_TITLE",
        "benchmark",
        "panel_controls",
        "panel_summary",
        "panel_plot",
    ):
        setattr(fake, name, getattr(_template, name))
    fake.panel_run = lambda progress, *, device, **values: 42
    panel = widgets.Panel.for_chapter(fake, device="cpu")
    panel.click()
    assert panel.error is not None and "not an Evidence" in panel.error
    with pytest.raises(ValueError, match="both panel controls and context"):
        widgets.Panel.for_chapter(_template, device="cpu", size_mib=3)


def test_every_notebook_has_its_chapter_module() -> None:
    assert [m[2:] for m in MODULES] == NOTEBOOKS
