"""Every link in every chapter must open from JupyterLab as `make lab` starts it.

`make lab` roots the server at the repository, so a chapter's relative link resolves against
`notebooks/` and must land on a file inside the repository (and on a real heading when it
names one). The server must listen on loopback only.
"""

from __future__ import annotations

import re
from pathlib import Path

import nbformat
import pytest

from tests.test_docs_links import _anchors

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _lab_command() -> str:
    text = (ROOT / "Makefile").read_text()
    block = text[text.index("\nlab:") :]
    return block[: block.index("\n\n")]


def test_make_lab_roots_at_the_repository_on_loopback() -> None:
    cmd = _lab_command()
    assert "--ServerApp.root_dir=." in cmd, "make lab must root JupyterLab at the repository so ../docs links open"
    assert "--notebook-dir" not in cmd
    assert "--ip=127.0.0.1" in cmd, "make lab must bind JupyterLab to loopback"


@pytest.mark.parametrize("nb_path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_every_relative_link_opens(nb_path: Path) -> None:
    bad = []
    for cell in nbformat.read(nb_path, as_version=4).cells:
        if cell.cell_type != "markdown":
            continue
        for target in LINK.findall(cell.source):
            if re.match(r"^[a-z]+:", target) or target.startswith("#"):
                continue  # web links and in-page anchors
            path, _, anchor = target.partition("#")
            resolved = (nb_path.parent / path).resolve()
            if ROOT not in resolved.parents:
                bad.append(f"{target} (outside the repository: JupyterLab cannot open it)")
            elif not resolved.exists():
                bad.append(f"{target} (no such file)")
            elif anchor and resolved.suffix == ".ipynb" and anchor not in _anchors(resolved):
                bad.append(f"{target} (no such heading)")
    assert not bad, f"{nb_path.name}: dead links: {bad}"
