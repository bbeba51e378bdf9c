"""Every link from the docs into a notebook section lands on a heading: renaming a heading must carry its links along.

JupyterLab makes a heading's anchor from its rendered text with each space turned into ``-``
(``### 1. The `num_workers` sweep`` -> ``#1.-The-num_workers-sweep``).
"""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "notebooks").glob("*.ipynb")])
LINK = re.compile(r"\]\(((?:\.\./)?(?:notebooks/)?(\d\d_\w+\.ipynb))#([^)\s]+)\)")


def anchors(notebook: Path) -> set[str]:
    """The anchors of every markdown heading of ``notebook``."""
    out = set()
    for cell in nbformat.read(notebook, as_version=4).cells:
        if cell.cell_type != "markdown":
            continue
        for line in cell.source.splitlines():
            m = re.match(r"#{1,6}\s+(.*?)\s*$", line)
            if m:
                text = re.sub(r"\*\*|`", "", m.group(1))
                text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)  # a link in a heading: its text
                out.add(text.replace(" ", "-"))
    return out


def links() -> list[tuple[str, str, str]]:
    found = []
    for doc in DOCS:
        text = doc.read_text(encoding="utf-8")
        if doc.suffix == ".ipynb":
            text = "\n".join(c.source for c in nbformat.reads(text, as_version=4).cells if c.cell_type == "markdown")
        found += [(doc.name, name, unquote(anchor)) for _, name, anchor in LINK.findall(text)]
    return found


def test_the_docs_link_into_notebook_sections() -> None:
    assert len(links()) >= 20  # the checklist alone links every lesson


@pytest.mark.parametrize(("doc", "notebook", "anchor"), links())
def test_every_section_link_lands_on_a_heading(doc: str, notebook: str, anchor: str) -> None:
    target = ROOT / "notebooks" / notebook
    assert target.is_file(), f"{doc} links to {notebook}, which does not exist"
    assert anchor in anchors(target), f"{doc} links to {notebook}#{anchor}: no heading has that anchor"
