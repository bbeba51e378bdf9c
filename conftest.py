"""Checks that apply to the notebooks as nbval runs them.

A printed line longer than ``MAX_PRINTED`` characters wraps in JupyterLab, often in the middle of a
word: every chapter's printed text must stay within it (print shorter lines, or wrap them with
``textwrap``; tables too). nbval stores each cell's outputs in ``item.test_outputs``.

Each notebook nbval ran to completion, every cell passing, is also written with the outputs of that run
to ``artifacts/nbval-outputs/<notebook>``. The browser suite (``tests/browser``, run after nbval by
``make test``) opens that copy, so the reader's view of every output is checked without running every
cell a second time: in the browser it runs only the cells the live panel needs (docs/BROWSER-TESTS.md).
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Generator
from pathlib import Path
from typing import Any

import pytest

MAX_PRINTED = 110
NBVAL_OUTPUTS = Path(__file__).resolve().parent / "artifacts" / "nbval-outputs"
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
# notebook path -> (the notebook nbval read, {code cell number: outputs}, every cell passed so far)
_RUNS: dict[str, tuple[Any, dict[int, list[Any]], bool]] = {}


def long_lines(outputs: list[Any] | None) -> list[str]:
    """Printed (stream) lines longer than ``MAX_PRINTED`` characters in nbval's outputs of one cell."""
    found = []
    for out in outputs or []:
        if out.get("output_type") == "stream":
            found += [
                ln
                for ln in str(out.get("text", "")).splitlines()
                if len(ln) > MAX_PRINTED and not ln.startswith('  File "')
            ]  # a traceback's file paths
    return found


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, Any, None]:
    outcome = yield
    report = outcome.get_result()
    if call.when != "call" or not hasattr(item, "test_outputs"):
        return
    _remember_outputs(item, report.passed)
    if not report.passed:
        return
    too_long = long_lines(item.test_outputs)
    if too_long:
        report.outcome = "failed"
        report.longrepr = (
            f"{len(too_long)} printed line(s) longer than {MAX_PRINTED} characters "
            "(they wrap mid-word in JupyterLab); shorten or wrap them:\n"
            + "\n".join(f"  [{len(ln)}] {ln}" for ln in too_long[:5])
        )
        _remember_outputs(item, False)


def _remember_outputs(item: pytest.Item, passed: bool) -> None:
    nb = getattr(item.parent, "nb", None)
    if nb is None or not hasattr(item, "cell_num"):
        return
    key = str(item.path)
    _, outputs, ok = _RUNS.get(key, (nb, {}, True))
    outputs[int(item.cell_num)] = list(item.test_outputs or [])
    _RUNS[key] = (nb, outputs, ok and passed)


def _without_widget_views(outputs: list[Any]) -> list[Any]:
    """Widget views need the kernel that made them (gone now): drop them; keep every other output."""
    kept = []
    for out in outputs:
        data = out.get("data") if isinstance(out, dict) else None
        if data and WIDGET_VIEW in data:
            continue
        kept.append(out)
    return kept


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Write each notebook whose every code cell ran and passed, with the outputs of this run."""
    import nbformat

    for path, (nb, outputs, ok) in _RUNS.items():
        target = NBVAL_OUTPUTS / Path(path).name
        code = [c for c in nb.cells if c.cell_type == "code"]
        if not ok or set(outputs) != set(range(len(code))):
            target.unlink(missing_ok=True)  # never leave an older run's outputs for the browser suite
            continue
        done = copy.deepcopy(nb)
        for n, cell in enumerate(c for c in done.cells if c.cell_type == "code"):
            cell.outputs = [nbformat.from_dict(o) for o in _without_widget_views(outputs[n])]
            cell.execution_count = n + 1
            for out in cell.outputs:
                if "execution_count" in out:
                    out.execution_count = n + 1
        done.metadata["nbval_outputs"] = {
            "source": Path(path).name,
            "cells": len(code),
            "WORKBOOK_QUICK": os.environ.get("WORKBOOK_QUICK", ""),
            "note": "outputs of the nbval run; widget views dropped",
        }
        NBVAL_OUTPUTS.mkdir(parents=True, exist_ok=True)
        target.write_text(json.dumps(done, indent=1, ensure_ascii=False) + "\n")
