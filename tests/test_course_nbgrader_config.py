"""What ``python -m course.with_nbgrader`` writes beside the assignments works without an activated venv (no
nbgrader needed here: tests/test_nbgrader_course.py runs nbgrader's commands themselves)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from course import with_nbgrader

BIN = str(Path(sys.executable).parent)


def _run_config(course: Path, path: str) -> str:
    """Execute the written nbgrader_config.py as nbgrader does (in-process, ``get_config`` given) under ``PATH``;
    returns ``PATH`` as the config left it."""
    ns: dict[str, Any] = {"get_config": lambda: _Config()}
    old = os.environ.get("PATH", "")
    os.environ["PATH"] = path
    try:
        exec(compile((course / "nbgrader_config.py").read_text(), "nbgrader_config.py", "exec"), ns)
        return os.environ["PATH"]
    finally:
        os.environ["PATH"] = old


class _Config:
    """A stand-in for traitlets' Config: any attribute, at any depth, takes any value."""

    def __getattr__(self, name: str) -> _Config:
        value = _Config()
        object.__setattr__(self, name, value)
        return value


@pytest.fixture(scope="module")
def course(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("course")
    with_nbgrader.make_course(root, ["04"])
    return root


def test_the_config_puts_the_venvs_bin_on_path_once(course: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """nbgrader runs `alembic` by bare name: the folder of the Python running nbgrader (where alembic is) goes first."""
    monkeypatch.setattr(sys, "path", list(sys.path))  # the config inserts the checkout
    without = os.pathsep.join(p for p in os.environ.get("PATH", "").split(os.pathsep) if p != BIN) or os.defpath
    assert _run_config(course, without).split(os.pathsep)[0] == BIN
    already = BIN + os.pathsep + "/usr/bin"
    assert _run_config(course, already) == already  # an activated venv: PATH left as it is


def test_the_plugins_module_serves_the_exporter_without_pythonpath(course: Path) -> None:
    """nbgrader imports --exporter=... before it reads its config, with the course folder on sys.path."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    code = "import sys; sys.path.insert(0, '.'); import workbook_plugins as w; print(w.ExerciseTable.__module__)"
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=course, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "course.with_nbgrader"
