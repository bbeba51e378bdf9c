"""Reference results recorded on real GPUs, and the honest fallback.

Reference files are :class:`helpers.core.results.ResultSet` JSON files committed
under ``helpers/core/reference/`` by the GPU check (``make gpu-check``), one per
machine kind and run. Chapters use them when no CUDA device is present:

>>> from helpers.core import reference
>>> hits = reference.find("ch02.h2d_bandwidth")       # [(ResultSet, [Record, ...]), ...]
>>> print(reference.describe("ch02.h2d_bandwidth"))   # provenance lines, or a plain 'none recorded yet'

Nothing here ever makes up a number: when no file holds a key, the functions
say so.
"""

from __future__ import annotations

import os
import textwrap
from pathlib import Path
from typing import Any

from .results import Record, ResultSet, comparable

__all__ = [
    "reference_dir",
    "references",
    "find",
    "artifacts",
    "describe",
    "missing_message",
    "provenance_line",
    "live_vs_reference",
]

REFERENCE_ENV = "WORKBOOK_REFERENCE_DIR"


def reference_dir() -> Path:
    """Folder holding reference files (``$WORKBOOK_REFERENCE_DIR`` overrides, for tests)."""
    raw = os.environ.get(REFERENCE_ENV)
    return Path(raw) if raw else Path(__file__).resolve().parent / "reference"


def references() -> list[ResultSet]:
    """Every reference result set, newest first. Unreadable files are skipped with a warning line."""
    folder = reference_dir()
    out: list[ResultSet] = []
    if not folder.is_dir():
        return out
    for path in sorted(folder.glob("*.json")):
        try:
            out.append(ResultSet.load(path))
        except (OSError, ValueError) as exc:
            print(f"warning: skipping reference file {path.name}: {exc}")
    out.sort(key=lambda r: r.created, reverse=True)
    return out


def find(key: str, **params: Any) -> list[tuple[ResultSet, list[Record]]]:
    """Reference sets that hold records for ``key`` (and ``params``), with those records."""
    hits = []
    for rs in references():
        recs = rs.find(key, **params)
        if recs:
            hits.append((rs, recs))
    return hits


def artifacts(name: str) -> list[tuple[ResultSet, Any]]:
    """Reference sets that hold artifact ``name`` (e.g. a span trace), with it."""
    return [(rs, rs.artifacts[name]) for rs in references() if name in rs.artifacts]


def provenance_line(rs: ResultSet) -> str:
    """'Recorded on <GPU>, driver ..., torch ..., <date>, <mode> mode; method: ...'."""
    return f"Recorded on {rs.label()}; method: {rs.method}"


def missing_message(what: str) -> str:
    """The plain sentence shown when no reference holds ``what``."""
    return textwrap.fill(
        f"No reference results for {what} have been recorded on a real GPU yet. "
        "They are recorded by running `make gpu-check` on a machine with a CUDA GPU (see README); "
        "nothing is shown rather than a made-up number.",
        width=100,
    )


def describe(key: str, **params: Any) -> str:
    """Provenance lines for every reference holding ``key``, or the missing message."""
    hits = find(key, **params)
    if not hits:
        return missing_message(key)
    return "\n".join(f"{provenance_line(rs)} ({len(recs)} records)" for rs, recs in hits)


def live_vs_reference(live: ResultSet, key: str) -> list[str]:
    """Lines that put a live result beside each reference for ``key``.

    Ratios are given only when the hardware matches; otherwise the reference
    is shown as 'recorded on X' without a comparison.
    """
    lines = []
    for rs, recs in find(key):
        ok, why = comparable(rs, live)
        if not ok:
            lines.append(f"{provenance_line(rs)} — not compared with this machine: {why}")
            continue
        live_index = {r.ident(): r for r in live.records}
        for rec in recs:
            other = live_index.get(rec.ident())
            if other is not None and rec.value:
                lines.append(
                    f"{rec.key} {rec.params}: reference {rec.value:.4g} {rec.unit}, "
                    f"this run {other.value:.4g} {rec.unit} (x{other.value / rec.value:.2f})"
                )
    if not lines:
        lines.append(missing_message(key))
    return lines
