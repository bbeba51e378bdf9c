"""The reader's pipeline as it grows: chapters 01-06 define it in code cells tagged ``pipeline``, each redefining
only what it teaches, so the pipeline after chapter N is the newest definition of every name in 01..N.
``show_diff("02", "make_loader")`` diffs the functions as they run in this kernel against it.
"""

from __future__ import annotations

import ast
import difflib
import html
import inspect
import json
import linecache
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

PIPELINE_TAG = "pipeline"
NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"


def _folder(notebooks: Path) -> Path:
    if not Path(notebooks).is_dir():
        raise FileNotFoundError(
            f"no notebooks folder at {notebooks}: the pipeline cells are read from the workbook's notebooks, "
            "so run from a checkout of the workbook, or pass notebooks=<the folder that holds them>"
        )
    return Path(notebooks)


def notebook_path(chapter: str, notebooks: Path = NOTEBOOKS) -> Path:
    """The notebook of ``chapter`` ("01" ... "07"); a clear error when there is none."""
    found = sorted(_folder(notebooks).glob(f"{chapter}_*.ipynb"))
    if not found:
        raise FileNotFoundError(
            f"no notebook for chapter {chapter!r} in {notebooks}; chapters are two digits, e.g. '03'"
        )
    return found[0]


def chapters(notebooks: Path = NOTEBOOKS) -> list[str]:
    """Every chapter that has a notebook, in order ("00", "01", ...)."""
    return sorted({p.name[:2] for p in _folder(notebooks).glob("[0-9][0-9]_*.ipynb")})


def pipeline_cells(chapter: str, notebooks: Path = NOTEBOOKS) -> list[str]:
    """The source of the code cells tagged ``pipeline`` in ``chapter``'s notebook, in order."""
    nb = json.loads(notebook_path(chapter, notebooks).read_text(encoding="utf-8"))
    return [
        "".join(c["source"])
        for c in nb["cells"]
        if c["cell_type"] == "code" and PIPELINE_TAG in c.get("metadata", {}).get("tags", [])
    ]


def definitions(source: str) -> dict[str, str]:
    """``{name: source}`` of the top-level ``def``/``class`` statements (decorators included; the last wins)."""
    tree = ast.parse(source)
    lines = source.splitlines()
    out: dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            first = min([node.lineno] + [d.lineno for d in node.decorator_list])
            out[node.name] = "\n".join(lines[first - 1 : node.end_lineno])
    return out


def pipeline_after(chapter: str, notebooks: Path = NOTEBOOKS) -> dict[str, str]:
    """The pipeline as chapter ``chapter`` leaves it: the newest definition of each name in chapters 01..``chapter``."""
    merged: dict[str, str] = {}
    for ch in chapters(notebooks):
        if ch > chapter:
            break
        for cell in pipeline_cells(ch, notebooks):
            merged.update(definitions(cell))
    return merged


def _kernel_inputs() -> list[str]:
    from IPython import get_ipython  # installed with JupyterLab

    ip = get_ipython()
    return [s for s in ip.user_ns.get("In", []) if isinstance(s, str)] if ip is not None else []


def current_source(name: str, namespace: Mapping[str, Any] | None = None) -> str:
    """The source of ``name`` as it runs now: its newest definition in the executed cells, else ``inspect``."""
    for cell in reversed(_kernel_inputs()):
        try:
            found = definitions(cell)
        except SyntaxError:  # a cell with magics or a typo: not a definition we can read
            continue
        if name in found:
            return found[name]
    obj = (namespace or {}).get(name)
    if obj is not None:
        try:
            return inspect.getsource(obj).rstrip("\n")
        except (OSError, TypeError):
            pass
        # A class defined in a cell: its module (__main__) has no file, and nbval keeps no input history, but
        # IPython registers each cell's file in linecache, where its methods' code points.
        codes = [getattr(getattr(v, "__func__", v), "__code__", None) for v in vars(obj).values()]
        files = dict.fromkeys(c.co_filename for c in codes if c is not None) if isinstance(obj, type) else {}
        for filename in files:
            try:
                source = definitions("".join(linecache.getlines(filename))).get(name)
            except SyntaxError:
                continue
            if source is not None:
                return source
    raise LookupError(f"{name!r} is not defined in the cells run so far: run the cell that defines it first")


@dataclass
class PipelineDiff:
    """What a chapter changed in the pipeline: a unified diff per name, with counts."""

    previous: str
    names: list[str]
    hunks: dict[str, list[str]] = field(default_factory=dict)

    def _changed(self, sign: str) -> list[str]:
        return [ln[1:] for h in self.hunks.values() for ln in h if ln[:1] == sign and ln[:3] != sign * 3]

    added = property(lambda self: self._changed("+"))
    removed = property(lambda self: self._changed("-"))

    def text(self) -> str:
        same = "# {}: unchanged since chapter " + self.previous  # show_diff keeps no empty hunk
        return "\n\n".join("\n".join(self.hunks[n]) if n in self.hunks else same.format(n) for n in self.names)

    __str__ = text

    def _repr_html_(self) -> str:
        colours = {"+": "#e6ffec", "-": "#ffebe9", "@": "#ddf4ff"}
        rows = []
        for line in self.text().splitlines():
            bg = colours.get(line[:1], "transparent") if not line.startswith(("+++", "---")) else "#f6f8fa"
            rows.append(f'<div style="background:{bg};white-space:pre">{html.escape(line) or "&nbsp;"}</div>')
        title = (
            f"What changed in the pipeline since chapter {self.previous} "
            f"({len(self.added)} lines added, {len(self.removed)} removed)"
        )
        return f'<div style="font-family:monospace;font-size:12px"><b>{html.escape(title)}</b>{"".join(rows)}</div>'


def show_diff(
    previous: str, *names: str, namespace: Mapping[str, Any] | None = None, notebooks: Path = NOTEBOOKS
) -> PipelineDiff:
    """What changed in ``names`` since chapter ``previous``, as the code runs in this kernel (a coloured diff;
    ``print`` gives text). ``namespace=globals()`` finds objects defined outside executed cells too."""
    if not names:
        raise ValueError("name at least one pipeline function, e.g. show_diff('02', 'make_loader')")
    if previous not in chapters(notebooks):
        raise ValueError(f"chapter {previous!r} has no notebook; chapters are {', '.join(chapters(notebooks))}")
    before = pipeline_after(previous, notebooks)
    out = PipelineDiff(previous=previous, names=list(names))
    for name in names:
        old, new = before.get(name, "").splitlines(), current_source(name, namespace).splitlines()
        label_old = f"chapter {previous}: {name}" if name in before else f"chapter {previous}: (no {name} yet)"
        lines = list(difflib.unified_diff(old, new, label_old, f"now: {name}", n=2, lineterm=""))
        if lines:
            out.hunks[name] = lines
    return out
