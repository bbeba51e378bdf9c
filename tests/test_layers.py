"""The helpers package has layers, one folder each, and its imports form no cycle.

The layout is the architecture: ``helpers/<layer>/<module>.py``, with the layers in :data:`ORDER`
(lowest first). Every module is parsed (nothing is imported) and each import of another helpers
module is an edge: ``from .x import y``, ``from ..core import x``, ``from ..core.x import y``,
``from helpers.core import x``, ``import helpers.core.x``, at module level and inside functions alike
(an import inside a function is still a dependency; it only runs later). A module named in a string
(``sys.modules["helpers.pipeline.loaders"]``, ``importlib.import_module("helpers.chapters.ch04")``) is a
dependency too, one the import graph cannot see: outside docstrings, a module may not name a layer above its
own in a string (``helpers.<layer>``) either.

A module may import modules of its own layer and of the layers below it, never above.
A new module goes in a layer folder (and in the table in docs/CONTRIBUTING.md).

The maintainer's tools (the bench, the GPU check) live outside the package, in the checkout's ``tools/``:
they import ``helpers``, and nothing in ``helpers`` imports them or names them as a module.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HELPERS = ROOT / "helpers"

#: Lowest layer first. Keep in step with the "Layers" table in docs/CONTRIBUTING.md.
ORDER = ("core", "ui", "pipeline", "chapters")

#: Imports allowed to go up a layer: (importer, imported) -> why. Empty, and it should stay so.
ALLOWED_UPWARD: dict[tuple[str, str], str] = {}


def _layout() -> dict[str, Path]:
    """Every module of the package by its dotted name below ``helpers`` (``core.timing``, ``chapters.ch05``,
    ``chapters.ch05.overlap``), read from the layer folders and the chapter folders inside ``chapters/``."""
    out: dict[str, Path] = {}
    for layer in ORDER:
        for p in sorted((HELPERS / layer).rglob("*.py")):
            parts = list(p.relative_to(HELPERS).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
                if len(parts) == 1:
                    continue  # a layer's own __init__: a docstring, no code
            out[".".join(parts)] = p
    return out


MODULES = _layout()
LAYER_OF = {mod: mod.split(".")[0] for mod in MODULES}
RANK = {mod: ORDER.index(layer) for mod, layer in LAYER_OF.items()}
LAYERS = {layer: tuple(m for m in MODULES if LAYER_OF[m] == layer) for layer in ORDER}
#: A chapter's folder: ``chapters.chNN`` and the modules inside it.
_CHAPTER = re.compile(r"chapters\.(ch\d\d)(\.|$)")


def _path(module: str) -> Path:
    return HELPERS / "__init__.py" if module == "__init__" else MODULES[module]


def _rel(module: str) -> str:
    return str(_path(module).relative_to(ROOT))


def _modules() -> list[str]:
    return sorted(MODULES)


def _package(module: str) -> list[str]:
    """The package ``module`` lives in (itself, for a chapter folder's ``__init__``), as parts below helpers."""
    if module == "__init__":
        return []
    parts = module.split(".")
    return parts if _path(module).name == "__init__.py" else parts[:-1]


def _resolve(name: str) -> list[str]:
    """The modules a dotted name below helpers stands for: the module itself, else the longest module it is in."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in MODULES:
            return [".".join(parts[:n])]
    return []


def _targets(node: ast.AST, module: str) -> list[str]:
    """The helpers modules an import statement names (empty for any other import)."""
    if isinstance(node, ast.ImportFrom):
        parts = node.module.split(".") if node.module else []
        if node.level == 0:
            if not parts or parts[0] != "helpers":
                return []
            base = parts[1:]
        else:
            pkg = _package(module)
            if node.level - 1 > len(pkg):
                raise AssertionError(f"{_rel(module)}:{node.lineno}: an import above the package")
            base = pkg[: len(pkg) - (node.level - 1)] + parts
        named = [".".join([*base, a.name]) for a in node.names if ".".join([*base, a.name]) in MODULES]
        return named or _resolve(".".join(base))
    if isinstance(node, ast.Import):
        out = []
        for a in node.names:
            parts = a.name.split(".")
            if parts[0] == "helpers":
                out += _resolve(".".join(parts[1:]))
        return out
    return []


def _imports(module: str) -> list[tuple[str, int, bool]]:
    """(imported module, line, inside a function) for each helpers import of ``module``."""
    tree = ast.parse(_path(module).read_text(encoding="utf-8"))
    out: list[tuple[str, int, bool]] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            for target in _targets(child, module):
                if target != module:
                    out.append((target, child.lineno, in_function))
            visit(child, inner)

    visit(tree, False)
    return out


def _graph() -> dict[str, dict[str, list[int]]]:
    """importer -> imported -> lines."""
    graph: dict[str, dict[str, list[int]]] = {}
    for mod in _modules():
        graph[mod] = {}
        for target, line, _ in _imports(mod):
            graph[mod].setdefault(target, []).append(line)
    return graph


def _cycles(graph: dict[str, dict[str, list[int]]]) -> list[list[str]]:
    """One cycle (as a path a -> ... -> a) through each strongly connected group of modules."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def strong(v: str) -> None:  # Tarjan
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    cycles = []
    for group in groups:  # a shortest way back to the start, within the group
        start, members = group[0], set(group)
        paths = {start: [start]}
        frontier = [start]
        found = None
        while frontier and found is None:
            nxt = []
            for v in frontier:
                for w in sorted(graph.get(v, {})):
                    if w == start:
                        found = paths[v] + [start]
                        break
                    if w in members and w not in paths:
                        paths[w] = paths[v] + [w]
                        nxt.append(w)
                if found:
                    break
            frontier = nxt
        cycles.append(found or group)
    return cycles


def _describe(path: list[str], graph: dict[str, dict[str, list[int]]]) -> str:
    return (
        " -> ".join(path)
        + "  ("
        + "; ".join(f"{_rel(a)}:{','.join(map(str, graph[a][b]))} imports {b}" for a, b in zip(path, path[1:]))
        + ")"
    )


def test_the_graph_sees_module_level_and_function_level_imports() -> None:
    edges = _imports("chapters.ch06.capstone")
    assert any(t == "core.timing" and not inner for t, _, inner in _imports("chapters.ch06.run"))
    assert any(t == "ui.plots" and inner for t, _, inner in edges)  # matplotlib: imported where it is drawn
    assert any(t == "chapters.ch06.doctor" for t, _, _ in _imports("chapters.ch06.capstone"))  # from .doctor import
    assert any(t == "chapters.ch06.capstone" for t, _, _ in _imports("chapters.ch06"))  # from . import capstone
    assert _cycles({"a": {"b": [1]}, "b": {"c": [2]}, "c": {"a": [3]}, "d": {"a": [4]}}) == [["a", "b", "c", "a"]]


def test_no_import_cycles() -> None:
    graph = _graph()
    cycles = _cycles(graph)
    for c in cycles:
        print("import cycle:", _describe(c, graph))
    assert not cycles, "import cycles in helpers/:\n" + "\n".join(_describe(c, graph) for c in cycles)


def test_every_module_lives_in_one_layer_folder() -> None:
    loose = sorted(p.name for p in HELPERS.glob("*.py") if p.stem != "__init__")
    assert not loose, f"modules outside a layer folder: {loose}; move each into one of {ORDER}"
    folders = sorted(p.name for p in HELPERS.iterdir() if p.is_dir() and (p / "__init__.py").exists())
    assert folders == sorted(ORDER), f"layer folders {folders} != ORDER {ORDER} (tests/test_layers.py)"
    for layer in ORDER:
        assert (HELPERS / layer / "__init__.py").read_text(encoding="utf-8").startswith('"""'), (
            f"helpers/{layer}/__init__.py must say in its docstring what the layer is for"
        )
    nested = sorted(str(p.relative_to(HELPERS)) for p in HELPERS.glob("*/*/") if p.name != "__pycache__")
    wrong = [n for n in nested if not re.fullmatch(r"chapters/ch\d\d|core/reference", n)]
    assert not wrong, f"folders inside a layer: {wrong}; only chapters/chNN (one chapter's code) is a package"


def test_a_chapter_imports_no_other_chapter() -> None:
    """A chapter is one folder: its code imports the layers below and its own folder, never another chapter's.
    What two chapters share goes down into pipeline, ui or core."""
    crossing = [f"{_rel(a)}:{','.join(map(str, lines))} imports {b}" for a, b, lines in _crossings(_graph())]
    assert not crossing, "imports of another chapter's folder:\n" + "\n".join(crossing)


def _crossings(graph: dict[str, dict[str, list[int]]]) -> list[tuple[str, str, list[int]]]:
    """(importer, imported, lines) for each import of a chapter folder from outside that folder."""
    out = []
    for a, targets in sorted(graph.items()):
        ma = _CHAPTER.match(a)
        for b, lines in sorted(targets.items()):
            mb = _CHAPTER.match(b)
            if mb and (ma is None or ma.group(1) != mb.group(1)):
                out.append((a, b, lines))
    return out


def test_the_chapter_rule_sees_a_crossing() -> None:
    graph = {
        "chapters.ch06.capstone": {"chapters.ch06.doctor": [1], "chapters.ch05.overlap": [2], "core.timing": [3]},
        "chapters.ch06": {"chapters.ch06.capstone": [4]},
        "chapters._template": {"chapters.ch04": [5]},
    }
    assert _crossings(graph) == [
        ("chapters._template", "chapters.ch04", [5]),
        ("chapters.ch06.capstone", "chapters.ch05.overlap", [2]),
    ]


def test_no_module_imports_a_layer_above_its_own() -> None:
    graph = _graph()
    upward = []
    for a, targets in sorted(graph.items()):
        for b, lines in sorted(targets.items()):
            if a in RANK and b in RANK and RANK[b] > RANK[a] and (a, b) not in ALLOWED_UPWARD:
                upward.append(f"{_rel(a)}:{','.join(map(str, lines))} ({LAYER_OF[a]}) imports {b} ({LAYER_OF[b]})")
    for line in upward:
        print("upward import:", line)
    assert not upward, "imports that go up a layer (order: " + " < ".join(LAYERS) + "):\n" + "\n".join(upward)
    stale = [edge for edge in ALLOWED_UPWARD if edge[1] not in graph.get(edge[0], {})]
    assert not stale, f"ALLOWED_UPWARD lists imports that no longer exist: {stale}"


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the docstring nodes of a module, its classes and its functions."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                out.add(id(first.value))
    return out


def _strings(source: str) -> list[tuple[int, str]]:
    """(line, text) of every string literal of ``source`` but the docstrings (f-strings' literal parts included)."""
    tree = ast.parse(source)
    docs = _docstrings(tree)
    return [
        (node.lineno, node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs
    ]


#: ``helpers.<layer>`` in a string: a module reached by name (sys.modules, importlib), unseen by the import graph.
_LAYER_NAMED = re.compile(r"\bhelpers\.([a-z_]+)(?:\.\w+)*")


def _upward_strings(module: str, source: str) -> list[str]:
    """Where ``source`` (a module of ``module``'s layer) names a helpers layer above its own in a string."""
    own = ORDER.index(LAYER_OF[module])
    found = []
    for line, text in _strings(source):
        for m in _LAYER_NAMED.finditer(text):
            if m.group(1) in ORDER and ORDER.index(m.group(1)) > own:
                found.append(f"{_rel(module)}:{line} ({LAYER_OF[module]}) names {m.group(0)!r} in a string")
    return found


def test_the_string_scan_sees_a_reach_through_sys_modules() -> None:
    """The hidden reach issue #27 found in ui/widgets.py: caught in a lower layer, allowed in a higher one."""
    reach = 'import sys\nloaders = sys.modules.get("helpers.pipeline.loaders")\n'
    assert _upward_strings("ui.widgets", reach) == [
        "helpers/ui/widgets.py:2 (ui) names 'helpers.pipeline.loaders' in a string"
    ]
    assert _upward_strings("chapters.ch06.capstone", reach) == []  # chapters may use pipeline
    by_name = 'def f():\n    """Uses helpers.chapters.ch04 (a docstring may say so)."""\n    return 1\n'
    assert _upward_strings("core.config", by_name) == []
    assert _upward_strings("core.config", 'import importlib\nm = importlib.import_module(f"helpers.ui.{n}")\n')


def test_no_module_reaches_a_layer_above_by_name() -> None:
    """``sys.modules["helpers.<upper>..."]`` or ``importlib.import_module("helpers.<upper>...")``: a dependency
    the import graph cannot see. Pass what the upper layer offers in as an argument, or move it down."""
    found = [line for mod in _modules() for line in _upward_strings(mod, _path(mod).read_text(encoding="utf-8"))]
    assert not found, "modules that reach a layer above by name:\n" + "\n".join(found)


#: A module name of the checkout's tools: ``tools``, ``tools.bench``, ...
_TOOLS_MODULE = re.compile(r"tools(\.\w+)*")


def test_nothing_in_helpers_imports_the_maintainer_tools() -> None:
    """The bench and the GPU check (``tools/``) are outside the reader's package: an installed ``helpers`` has no
    ``tools`` to import. Checked for imports and for module names in strings (importlib, sys.modules)."""
    back = sorted(p.name for p in (HELPERS / "tools").glob("*.py"))  # a stale __pycache__ of an old checkout is fine
    assert not back, f"helpers/tools/ is back ({back}): the maintainer's tools live in tools/"
    packages = re.search(r"^packages = \[(.*)\]$", (ROOT / "pyproject.toml").read_text(encoding="utf-8"), re.M)
    assert packages, "pyproject.toml: [tool.setuptools] packages = [...] on one line"
    chapters = sorted(f"helpers.{m}" for m in MODULES if _CHAPTER.fullmatch(m + "."))
    assert re.findall(r'"([^"]+)"', packages.group(1)) == [
        "helpers",
        *(f"helpers.{layer}" for layer in ORDER),
        *chapters,
    ], "pyproject.toml ships the reader's package only: helpers, its layers and chapter folders (not the tools)"
    found = []
    for path in sorted(HELPERS.rglob("*.py")):
        source = path.read_text(encoding="utf-8")
        for node in ast.walk(ast.parse(source)):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            found += [
                f"{path.relative_to(ROOT)}:{node.lineno}: import {n}" for n in names if _TOOLS_MODULE.fullmatch(n)
            ]
        found += [
            f"{path.relative_to(ROOT)}:{line}: names the module {text!r}"
            for line, text in _strings(source)
            if _TOOLS_MODULE.fullmatch(text)
        ]
    assert not found, "helpers must not import the maintainer's tools:\n" + "\n".join(found)


def test_each_import_left_inside_a_function_says_why() -> None:
    """Sibling imports go at module level; one left in a function carries a comment (heavy, optional, cycle)."""
    silent = []
    for mod in _modules():
        lines = _path(mod).read_text(encoding="utf-8").splitlines()
        tree = ast.parse("\n".join(lines))
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for inner in ast.walk(node):
                    if _targets(inner, mod) and "#" not in lines[inner.end_lineno - 1]:  # type: ignore[attr-defined]
                        silent.append(f"{_rel(mod)}:{inner.lineno}: {lines[inner.lineno - 1].strip()}")
    assert not silent, (
        "imports inside functions without a reason (move them to the top, or add a comment "
        "such as '# optional/heavy: matplotlib' or '# avoids a cycle with x'):\n" + "\n".join(sorted(set(silent)))
    )


def test_the_package_and_layer_inits_import_no_module() -> None:
    for init in [HELPERS / "__init__.py", *(HELPERS / layer / "__init__.py" for layer in ORDER)]:
        tree = ast.parse(init.read_text(encoding="utf-8"))
        imports = [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]
        assert not imports, f"{init.relative_to(ROOT)} imports something: importing a layer must stay cheap"


def test_contributing_lists_the_same_layers() -> None:
    text = (ROOT / "docs" / "CONTRIBUTING.md").read_text(encoding="utf-8")
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("|") else []
        if len(cells) >= 3 and cells[0] in LAYERS:
            rows[cells[0]] = set(re.findall(r"`([A-Za-z_0-9]+)`", cells[1]))
    assert list(rows) == list(LAYERS), "docs/CONTRIBUTING.md needs a Layers table with one row per layer, in order"
    for layer, mods in LAYERS.items():
        # a chapter folder is one row entry, `chNN`; the modules inside it are in the chapter-folder table
        named = {"chNN" if _CHAPTER.match(m) else m.split(".")[-1] for m in mods}
        assert rows[layer] == named, f"docs/CONTRIBUTING.md, layer {layer}: {sorted(rows[layer])} != {sorted(named)}"


def test_contributing_lists_each_chapter_folder() -> None:
    """The chapter-folder table: one row per ``chapters/chNN/``, naming the modules besides its ``__init__``."""
    text = (ROOT / "docs" / "CONTRIBUTING.md").read_text(encoding="utf-8")
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("|") else []
        if len(cells) >= 2 and re.fullmatch(r"`chapters/ch\d\d/`", cells[0]):
            rows[cells[0].strip("`").split("/")[1]] = set(re.findall(r"`([A-Za-z_0-9]+)`", cells[1])) - {"__init__"}
    folders = sorted({m.group(1) for mod in MODULES if (m := _CHAPTER.match(mod))})
    assert sorted(rows) == folders, f"docs/CONTRIBUTING.md: chapter-folder rows {sorted(rows)} != folders {folders}"
    for ch in folders:
        inside = {m.split(".")[-1] for m in MODULES if m.startswith(f"chapters.{ch}.")}
        assert rows[ch] == inside, f"docs/CONTRIBUTING.md, chapters/{ch}/: {sorted(rows[ch])} != {sorted(inside)}"
