"""Count helpers/ the way issue #27 counts it, so before and after are measured alike.

    python tools/code_size.py [ROOT]          # ROOT: a checkout (default: this one)

Lines are ``wc -l`` lines of every ``.py`` file. The kernel is ``core`` + ``ui`` + ``pipeline``; a chapter's own
code is its folder ``chapters/chNN/``. "Reading chapter NN" is its folder plus every kernel module it imports,
directly or through other kernel modules. A function's length runs from its ``def`` to its last line.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

KERNEL = ("core", "ui", "pipeline")


def lines(path: Path) -> int:
    return len(path.read_text().splitlines())


def module_name(helpers: Path, path: Path) -> str:
    rel = path.relative_to(helpers.parent).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def imports(path: Path, name: str) -> set[str]:
    """Every ``helpers.*`` module that module ``name`` at ``path`` imports (relative ones too, functions included)."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("helpers")}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            if base.startswith("helpers"):
                found.add(base)
                found |= {f"{base}.{a.name}" for a in node.names}
    return found


def long_functions(path: Path, limit: int = 60) -> list[tuple[str, int]]:
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno is not None:
            n = node.end_lineno - node.lineno + 1
            if n > limit:
                out.append((f"{path.name}:{node.name}", n))
    return out


def report(root: Path) -> str:
    helpers = root / "helpers"
    files = {module_name(helpers, p): p for p in sorted(helpers.rglob("*.py"))}
    size = {m: lines(p) for m, p in files.items()}
    kernel = {m for m in files if m.split(".")[1:2] and m.split(".")[1] in KERNEL}
    out = [f"helpers/: {sum(size.values()):,} lines in {len(files)} modules"]
    out.append(f"kernel (core+ui+pipeline): {sum(size[m] for m in kernel):,}")
    for layer in KERNEL:
        out.append(f"  {layer}: {sum(n for m, n in size.items() if m.startswith(f'helpers.{layer}')):,}")

    def kernel_deps(m: str) -> set[str]:
        deps = {imp if imp in files else imp.rsplit(".", 1)[0] for imp in imports(files[m], m)}
        return {d for d in deps if d in kernel and not (files[d].name == "__init__.py" and size[d] < 40)}

    chapters = sorted({m.split(".")[2] for m in files if m.startswith("helpers.chapters.ch")})
    for ch in chapters:
        own = [m for m in files if m.startswith(f"helpers.chapters.{ch}")]
        direct = {d for m in own for d in kernel_deps(m)}
        seen, todo = set(direct), list(direct)
        while todo:
            for dep in kernel_deps(todo.pop()) - seen:
                seen.add(dep)
                todo.append(dep)
        mine = sum(size[m] for m in own)
        reading, closure = mine + sum(size[m] for m in direct), mine + sum(size[m] for m in seen)
        out.append(
            f"{ch}: own {mine:,}; reading it = own + the kernel modules it imports: {reading:,}"
            f" ({len(direct)} modules; {closure:,} counting their imports too)"
        )
    big = sorted(size.items(), key=lambda kv: -kv[1])[:5]
    out.append("largest modules: " + ", ".join(f"{m.removeprefix('helpers.')} {n:,}" for m, n in big))
    longs = sorted((f for p in files.values() for f in long_functions(p)), key=lambda f: -f[1])
    named = ", ".join(f"{name} {n}" for name, n in longs[:5])
    out.append(f"functions over 60 lines: {len(longs)}" + (f"; longest: {named}" if longs else ""))
    return "\n".join(out)


if __name__ == "__main__":
    print(report(Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).resolve().parents[1])))
