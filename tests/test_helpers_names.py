"""No helpers module defines a top-level name twice (the second would silently replace the first), and
every name in a module's ``__all__`` is listed once and exists."""

from __future__ import annotations

import ast
import collections
import importlib
from pathlib import Path

import pytest

HELPERS = Path(__file__).resolve().parents[1] / "helpers"
#: Every module below a layer folder, chapter folders included: ``core.timing``, ``chapters.ch06.capstone``,
#: ``chapters.ch06.__init__`` (a chapter folder's interface module keeps its ``__init__`` here: a file name).
MODULES = sorted(
    str(p.relative_to(HELPERS).with_suffix("")).replace("/", ".")
    for p in HELPERS.glob("*/**/*.py")
    if p.parent != HELPERS and not (p.stem == "__init__" and p.parent.parent == HELPERS)
)


@pytest.mark.parametrize("name", MODULES)
def test_no_top_level_name_is_defined_twice(name: str) -> None:
    tree = ast.parse((HELPERS / (name.replace(".", "/") + ".py")).read_text(encoding="utf-8"))
    counts = collections.Counter(
        n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
    )
    twice = sorted(n for n, k in counts.items() if k > 1)
    assert not twice, (
        f"helpers/{name.replace('.', '/')}.py defines {twice} more than once: the later one replaces the earlier"
    )


@pytest.mark.parametrize("name", MODULES)
def test_all_lists_each_existing_name_once(name: str) -> None:
    module = importlib.import_module(f"helpers.{name.removesuffix('.__init__')}")
    names = list(getattr(module, "__all__", []))
    assert len(names) == len(set(names)), [n for n, k in collections.Counter(names).items() if k > 1]
    missing = [n for n in names if not hasattr(module, n)]
    assert not missing, f"helpers.{name}.__all__ lists names it does not define: {missing}"


#: Names every chapter module defines on purpose (the one chapter interface, helpers/ui/chapter.py), and `main`.
SHARED_BY_DESIGN = {
    "NUMBER", "TITLE", "BENCH_WEIGHT", "PANEL_TITLE", "PANEL_FIGSIZE", "benchmark", "panel_controls", "panel_run",
    "panel_summary", "panel_plot", "main",
}  # fmt: skip


#: Names defined twice on purpose, with the modules that define them. The take-home pipeline
#: (chapters.ch06.fast_pipeline) is chapter 06's cells line for line: its names are the reader's, and renaming one would
#: change what the chapter teaches.
TWICE_BY_DESIGN = {"Prefetcher": ["chapters.ch06.fast_pipeline", "pipeline.prefetch"]}


def test_no_public_function_or_class_name_is_defined_in_two_modules() -> None:
    """`from helpers.x import name` must say which one: one public function or class per name in the package."""
    where = collections.defaultdict(list)
    for name in MODULES:
        tree = ast.parse((HELPERS / (name.replace(".", "/") + ".py")).read_text(encoding="utf-8"))
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and not node.name.startswith(
                "_"
            ):
                where[node.name].append(name)
    twice = {
        n: mods
        for n, mods in where.items()
        if len(mods) > 1 and n not in SHARED_BY_DESIGN and sorted(mods) != TWICE_BY_DESIGN.get(n)
    }
    assert not twice, f"public names defined in several helpers modules (rename one): {twice}"
