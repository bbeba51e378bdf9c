"""Committed notebooks: no outputs, kernelspec python3, the chapter template, a parameters cell."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
#: The template a new chapter starts from: it follows every structural rule a chapter does.
CHAPTER_TEMPLATE = ROOT / "templates" / "chapter_template.ipynb"
STRUCTURED = [*NOTEBOOKS, CHAPTER_TEMPLATE]
TEMPLATE = ["Aim", "Setup", "Theory", "Practice", "Live panel", "Exercises", "Summary"]


def test_there_are_notebooks() -> None:
    assert NOTEBOOKS, "no notebooks found under notebooks/"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_name_pattern(path: Path) -> None:
    assert re.fullmatch(r"\d\d_[a-z0-9_]+\.ipynb", path.name), f"{path.name}: chapters are named NN_title.ipynb"


def test_chapter_numbers_run_from_00_without_gaps() -> None:
    numbers = [int(p.name[:2]) for p in NOTEBOOKS]
    assert numbers == list(range(len(NOTEBOOKS))), f"chapter numbers {numbers}: one per number, from 00, no gap"


@pytest.mark.parametrize("path", STRUCTURED, ids=lambda p: p.name)
def test_committed_without_outputs(path: Path) -> None:
    nb = json.loads(path.read_text())
    dirty = [
        i
        for i, c in enumerate(nb["cells"])
        if c["cell_type"] == "code" and (c.get("outputs") or c.get("execution_count"))
    ]
    assert not dirty, f"{path.name}: cells {dirty} carry outputs or execution counts; clear them before committing"


@pytest.mark.parametrize("path", STRUCTURED, ids=lambda p: p.name)
def test_kernelspec_is_python3(path: Path) -> None:
    nb = json.loads(path.read_text())
    assert nb["metadata"].get("kernelspec", {}).get("name") == "python3", f"{path.name}: kernelspec must be python3"


@pytest.mark.parametrize("path", STRUCTURED, ids=lambda p: p.name)
def test_follows_template(path: Path) -> None:
    nb = json.loads(path.read_text())
    heads = []
    for c in nb["cells"]:
        if c["cell_type"] == "markdown":
            src = "".join(c["source"])
            heads += [m.group(1).strip() for m in re.finditer(r"^## +(.+)$", src, re.M)]
    positions = []
    for section in TEMPLATE:
        found = [i for i, h in enumerate(heads) if h.lower().startswith(section.lower())]
        assert found, f"{path.name}: missing section '## {section}' (template: {TEMPLATE})"
        positions.append(found[0])
    assert positions == sorted(positions), f"{path.name}: sections out of order; expected {TEMPLATE}"


@pytest.mark.parametrize("path", STRUCTURED, ids=lambda p: p.name)
def test_setup_cell_tagged_parameters(path: Path) -> None:
    nb = json.loads(path.read_text())
    tagged = [c for c in nb["cells"] if "parameters" in c.get("metadata", {}).get("tags", [])]
    assert len(tagged) == 1, f"{path.name}: exactly one cell must be tagged 'parameters' (the setup cell)"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_no_lambdas_in_dataloaders(path: Path) -> None:
    nb = json.loads(path.read_text())
    for c in nb["cells"]:
        src = "".join(c["source"])
        if c["cell_type"] == "code" and "DataLoader(" in src:
            assert not re.search(r"(collate_fn|worker_init_fn)\s*=\s*lambda", src), (
                f"{path.name}: lambdas break spawn workers"
            )


@pytest.mark.parametrize("path", NOTEBOOKS[:-1], ids=lambda p: p.name)
def test_summary_links_to_next_chapter(path: Path) -> None:
    """Each chapter but the last ends by linking to the next notebook, which must exist."""
    nb = json.loads(path.read_text())
    text = "".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "markdown")
    nxt = NOTEBOOKS[NOTEBOOKS.index(path) + 1].name
    assert f"]({nxt})" in text, f"{path.name}: the summary should link to the next chapter, {nxt}"


def test_chapters_complete() -> None:
    """The chapters are numbered 00, 01, ... with no gap (derived from the files, so a new chapter needs no
    edit here), and the README lists each of them."""
    numbers = sorted(p.name[:2] for p in NOTEBOOKS)
    assert numbers == [f"{i:02d}" for i in range(len(numbers))], numbers
    readme = (ROOT / "README.md").read_text()
    for p in NOTEBOOKS:
        assert f"(notebooks/{p.name})" in readme, f"README does not link {p.name}"


@pytest.mark.parametrize("path", STRUCTURED, ids=lambda p: p.name)
def test_no_hand_written_reference_fallback(path: Path) -> None:
    """A figure from elsewhere reaches a cell as an Evidence (helpers.core.evidence), which carries its provenance;
    no cell looks up reference files itself (`if HAS_CUDA: ... else: reference.find(...)`)."""
    nb = json.loads(path.read_text())
    found = [
        c.get("id")
        for c in nb["cells"]
        if c["cell_type"] == "code" and re.search(r"\breference\.\w", "".join(c["source"]))
    ]
    assert not found, f"{path.name}: cells {found} use reference.* directly; return an Evidence from the helper"


@pytest.mark.parametrize("path", STRUCTURED, ids=lambda p: p.name)
def test_setup_cell_makes_the_one_setup_call(path: Path) -> None:
    nb = json.loads(path.read_text())
    setup = next(c for c in nb["cells"] if "parameters" in c.get("metadata", {}).get("tags", []))
    number = path.name[:2] if path in NOTEBOOKS else "99"
    assert f'DEVICE = setup.chapter("{number}"' in "".join(setup["source"]), (
        f'{path.name}: the setup cell sets DEVICE = setup.chapter("{number}", gpu_for=...)'
    )
