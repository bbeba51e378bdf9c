"""The README's install for an environment that already has torch keeps that torch (issue #24.4).

Nothing here can reach the network, so the hosted-notebook cell is checked piece by piece: ``git clone`` is
stood in for by a link to this checkout, ``%pip install`` runs as pip's dry run against this environment's
installed packages (``--no-index``: anything pip wanted to download would fail), and the cell's Python line
runs in a fresh interpreter that must then import *this* checkout's ``helpers``.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent


def _cell() -> list[str]:
    readme = (ROOT / "README.md").read_text()
    m = re.search(
        r"<!-- hosted-install-cell: start -->\n```python\n(.*?)```\n<!-- hosted-install-cell: end -->", readme, re.S
    )
    assert m, "README.md has no hosted-install cell between its markers"
    return [ln for ln in m.group(1).splitlines() if ln.strip()]


def test_cell_installs_without_pins() -> None:
    cell = _cell()
    assert cell[0].startswith("!git clone ") and cell[0].split()[-1] == "gpu-data-workbook"
    assert any(ln.startswith("%pip install") and "-e ./gpu-data-workbook" in ln for ln in cell)
    text = "\n".join(cell)
    assert "constraints" not in text and "torch" not in text.replace("gpu-data-workbook", "")


def _setuptools_ok() -> bool:
    try:
        return Version(version("setuptools")) >= Version("77")
    except Exception:
        return False


@pytest.mark.skipif(not _setuptools_ok(), reason="the dry run builds metadata with this env's setuptools (>=77)")
def test_cell_keeps_the_installed_torch(tmp_path: Path) -> None:
    (tmp_path / "gpu-data-workbook").symlink_to(ROOT, target_is_directory=True)  # stands in for `git clone`
    (pip_line,) = [ln for ln in _cell() if ln.startswith("%pip ")]
    args = shlex.split(pip_line)[1:]  # ["install", "--quiet", "-e", "./gpu-data-workbook"]
    report = tmp_path / "report.json"
    cmd = [
        sys.executable,
        "-m",
        "pip",
        *args,
        "--dry-run",
        "--no-index",
        "--no-build-isolation",
        "--report",
        str(report),
    ]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    would_install = {item["metadata"]["name"].lower() for item in json.loads(report.read_text())["install"]}
    assert would_install == {"gpu-data-workbook"}, f"pip would also install {sorted(would_install)}"


def test_cell_makes_this_checkout_importable(tmp_path: Path) -> None:
    (tmp_path / "gpu-data-workbook").symlink_to(ROOT, target_is_directory=True)
    py_lines = [ln for ln in _cell() if not ln.startswith(("!", "%"))]
    code = "\n".join(py_lines + ["import helpers, os; print(os.path.realpath(helpers.__file__))"])
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert Path(proc.stdout.strip()) == (ROOT / "helpers" / "__init__.py").resolve()
