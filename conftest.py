"""Checks that apply to the notebooks as nbval runs them.

A printed line longer than ``MAX_PRINTED`` characters wraps in JupyterLab, often in the middle of a
word: every chapter's printed text must stay within it (print shorter lines, or wrap them with
``textwrap``; tables too). nbval stores each cell's outputs in ``item.test_outputs``.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

import pytest

MAX_PRINTED = 110


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
    if call.when != "call" or not report.passed or not hasattr(item, "test_outputs"):
        return
    too_long = long_lines(item.test_outputs)
    if too_long:
        report.outcome = "failed"
        report.longrepr = (
            f"{len(too_long)} printed line(s) longer than {MAX_PRINTED} characters "
            "(they wrap mid-word in JupyterLab); shorten or wrap them:\n"
            + "\n".join(f"  [{len(ln)}] {ln}" for ln in too_long[:5])
        )
