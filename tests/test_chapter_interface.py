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


def test_for_chapter_shows_a_result_without_a_value_as_its_header_and_plots_only_runs_with_one() -> None:
    """The panel, not each chapter, handles a result without a value: its header is the summary, and the
    chapter's ``panel_plot`` gets only the runs that have one (here the template's; it would fail on a None)."""
    fake = types.ModuleType("fake")
    for name in chapter.CONSTANTS.keys() | {"benchmark", "panel_controls", "panel_summary", "panel_plot"}:
        setattr(fake, name, getattr(_template, name))
    nothing = evidence.missing("a host copy", "not recorded")
    outcomes = iter([nothing, None])

    def run(progress: object, *, device: object, **values: object) -> evidence.Evidence:
        out = next(outcomes)
        return out if out is not None else _template.panel_run(progress, device=device, **values)

    fake.panel_run = run
    panel = widgets.Panel.for_chapter(fake, device="cpu")
    first = panel.click()
    assert panel.error is None, panel.error
    assert first is not None and first.summary == nothing.header()
    panel.click()
    assert panel.error is None and len(panel.history) == 2 and "measured here" in panel.last.summary


def test_loader_panels_start_at_the_readers_make_loader_defaults() -> None:
    """Chapters 03 and 04 start their controls at the defaults of the reader's ``make_loader`` (else their own)."""
    from helpers.chapters import ch03, ch04

    def mine(ds: object, bs: int, pin_memory: bool = True, persistent: bool = False, prefetch_factor: int = 4) -> None:
        pass

    def bare(ds: object, bs: int, pin_memory: bool, persistent: bool, prefetch_factor: int) -> None:
        pass

    for make_loader, want in ((mine, (True, 4, False)), (bare, (False, 2, True)), (None, (False, 2, True))):
        c3, c4 = ch03.panel_controls(make_loader=make_loader), ch04.panel_controls(make_loader=make_loader)
        assert (c3["pin_memory"].value, c4["prefetch_factor"].value, c4["persistent"].value) == want
