"""Links from the docs into chapter sections must land on a real heading (JupyterLab anchors)."""

from __future__ import annotations

import re
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"\]\((\.\./notebooks/[^)#]+\.ipynb)(?:#([^)]+))?\)")


def _anchors(nb_path: Path) -> set[str]:
    """JupyterLab's heading anchors: the rendered heading text, spaces replaced by '-'."""
    out = set()
    for cell in nbformat.read(nb_path, as_version=4).cells:
        if cell.cell_type != "markdown":
            continue
        for line in cell.source.splitlines():
            m = re.match(r"^#{1,6}\s+(.*)$", line)
            if m:
                text = re.sub(r"[`*]", "", m.group(1)).strip()
                out.add(text.replace(" ", "-"))
    return out


DOCS = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]


@pytest.mark.parametrize("doc", DOCS, ids=[p.name for p in DOCS])
def test_links_to_notebook_sections_resolve(doc):
    bad = []
    for target, anchor in LINK.findall(doc.read_text(encoding="utf-8")):
        nb = (doc.parent / target).resolve()
        if not nb.is_file():
            bad.append(f"{target} (no such notebook)")
        elif anchor and anchor not in _anchors(nb):
            bad.append(f"{target}#{anchor} (no such heading)")
    assert not bad, f"{doc.name}: broken links: {bad}"
