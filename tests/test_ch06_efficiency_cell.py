"""Chapter 06's pipeline-efficiency cell (section 6) prints no line longer than 110 characters, whatever it measured.

An efficiency out of range ("out of range: the pipeline ran 1.10x its slowest stage alone, ...") made the cell
print a 219-character line: the root conftest failed the nbval cell (JupyterLab would wrap it mid-word), in about
one quick run of the chapter in five under load. The cell is run here with each kind of efficiency the capstone
can report, on a CPU and on a GPU, without running the waterfall.
"""

from __future__ import annotations

import contextlib
import io
import json
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest

from helpers.chapters.ch06 import capstone, job
from helpers.chapters.ch06.capstone import Efficiency

CELL_ID = "2c4de75d"  # section 6: Pipeline efficiency
NOTEBOOK = Path(__file__).resolve().parent.parent / "notebooks" / "06_capstone.ipynb"
MAX_LINE = 110  # the root conftest's limit on a printed line


def _cell() -> str:
    cells = json.loads(NOTEBOOK.read_text())["cells"]
    (source,) = ["".join(c["source"]) for c in cells if c.get("id") == CELL_ID]
    return source


def _waterfall(ratio: float) -> SimpleNamespace:
    return SimpleNamespace(
        results=[SimpleNamespace(label=s.label, efficiency=Efficiency.of_ratio(ratio)) for s in capstone.STEPS]
    )


@pytest.mark.parametrize("on_gpu", [False, True])
@pytest.mark.parametrize("ratio", [0.8, 1.05, 1.10, 1.49])  # a share; within the noise, and at its edge; out of range
def test_the_efficiency_cell_prints_no_line_too_long(ratio: float, on_gpu: bool) -> None:
    ns = {"wf": {"data-bound": _waterfall(ratio), "compute-bound": _waterfall(ratio)}, "ON_GPU": on_gpu}
    ns |= {"capstone": capstone, "job": job, "textwrap": textwrap}  # what earlier cells of the chapter imported
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(_cell(), f"06_capstone.ipynb[{CELL_ID}]", "exec"), ns)
    text = out.getvalue()
    assert "full stack efficiency" in text
    long = [ln for ln in text.splitlines() if len(ln) > MAX_LINE]
    assert long == [], f"lines over {MAX_LINE} characters: {long}"
    if ratio > 1.1:  # out of range: the reason is shown in full, not cut
        assert "a pipeline cannot beat its bottleneck" in " ".join(text.split())
