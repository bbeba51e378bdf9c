"""helpers.ui.codecells: reading tagged pipeline cells, merging chapters, rendering a diff."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers.ui import codecells


def _nb(path: Path, cells: list[tuple[str, bool]]) -> None:
    nb = {
        "cells": [
            {
                "cell_type": "code",
                "source": src,
                "metadata": {"tags": ["pipeline"] if tagged else []},
                "outputs": [],
                "execution_count": None,
            }
            for src, tagged in cells
        ],
        "metadata": {},
        "nbformat": 4,
        "nbformat_minor": 5,
    }
    path.write_text(json.dumps(nb))


@pytest.fixture
def books(tmp_path: Path) -> Path:
    _nb(
        tmp_path / "01_a.ipynb",
        [("def to_device(x, y):\n    return x.to(D), y.to(D)\n", True), ("def helper():\n    pass\n", False)],
    )
    _nb(
        tmp_path / "02_b.ipynb",
        [
            (
                "import functools\n\n@functools.cache\ndef to_device(x, y):\n"
                "    return x.to(D, non_blocking=True), y.to(D, non_blocking=True)\n",
                True,
            )
        ],
    )
    return tmp_path


def test_definitions_keep_decorators_and_the_last_definition() -> None:
    src = "import f\n@f.cache\ndef a():\n    return 1\n\nclass B:\n    x = 1\n\ndef a():\n    return 2\n"
    found = codecells.definitions(src)
    assert found == {"a": "def a():\n    return 2", "B": "class B:\n    x = 1"}
    assert codecells.definitions("@f.cache\ndef g():\n    pass")["g"].startswith("@f.cache")


def test_pipeline_after_merges_tagged_cells_in_chapter_order(books: Path) -> None:
    assert codecells.chapters(books) == ["01", "02"]
    assert codecells.pipeline_after("01", books) == {"to_device": "def to_device(x, y):\n    return x.to(D), y.to(D)"}
    assert "non_blocking=True" in codecells.pipeline_after("02", books)["to_device"]
    assert "helper" not in codecells.pipeline_after("02", books)


def test_show_diff_against_the_previous_chapter(books: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(LookupError, match="run the cell"):
        codecells.show_diff("01", "to_device", notebooks=books)  # not in any executed cell, no namespace
    cells = ["def to_device(x, y):\n    return x.to(D, non_blocking=True), y.to(D)\n"]
    monkeypatch.setattr(codecells, "_kernel_inputs", lambda: cells)
    d = codecells.show_diff("01", "to_device", notebooks=books)
    assert d.added == ["    return x.to(D, non_blocking=True), y.to(D)"]
    assert d.removed == ["    return x.to(D), y.to(D)"]
    assert "non_blocking" in d._repr_html_() and "1 lines added" in d._repr_html_()
    cells[0] = codecells.pipeline_after("02", books)["to_device"]
    unchanged = codecells.show_diff("02", "to_device", notebooks=books)
    assert "unchanged since chapter 02" in unchanged.text()
    with pytest.raises(ValueError, match="chapters are"):
        codecells.show_diff("09", "to_device", notebooks=books)
    with pytest.raises(ValueError, match="name at least one"):
        codecells.show_diff("01", notebooks=books)


def test_new_function_is_all_added(books: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(codecells, "_kernel_inputs", lambda: ["class Prefetcher:\n    pass\n"])
    d = codecells.show_diff("02", "Prefetcher", notebooks=books)
    assert d.added == ["class Prefetcher:", "    pass"] and "no Prefetcher yet" in d.text()


def test_current_source_reads_the_newest_executed_cell(monkeypatch: pytest.MonkeyPatch) -> None:
    cells = ["def f():\n    return 1\n", "%time x = 1\n", "def f():\n    return 2\n", "print(1)\n"]
    monkeypatch.setattr(codecells, "_kernel_inputs", lambda: cells)
    assert codecells.current_source("f") == "def f():\n    return 2"


def test_without_a_checkout_the_cells_say_where_they_are_read(tmp_path: Path) -> None:
    """The installed package has no notebooks beside it: one clear line, not an empty chapter list."""
    nowhere = tmp_path / "site-packages" / "notebooks"
    for call in (lambda: codecells.chapters(nowhere), lambda: codecells.pipeline_cells("02", nowhere)):
        with pytest.raises(FileNotFoundError, match="run from a checkout of the workbook, or pass notebooks="):
            call()
    with pytest.raises(FileNotFoundError, match="no notebooks folder"):
        codecells.show_diff("01", "to_device", namespace={"to_device": len}, notebooks=nowhere)
