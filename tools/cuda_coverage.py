"""How much of ``helpers/`` the unit tests run, with the CUDA-only lines counted apart.

    python tools/cuda_coverage.py                       # every unit test file (tests/test_*.py; minutes)
    python tools/cuda_coverage.py --tests tests/test_transfer.py tests/test_cuda_ch02.py
    python tools/cuda_coverage.py --data .coverage.cuda # report an earlier run again, without running

It runs the chosen test files in one pytest process under ``coverage`` (``-n 0``: coverage follows
neither pytest-xdist workers nor DataLoader worker processes), measuring ``helpers/``, then prints the
total line coverage of ``helpers/`` and, per module, how many of its CUDA-only lines ran.

Which lines are CUDA-only (read from each module's syntax tree; a *line* is a statement that
coverage counts, so blank lines, comments and docstrings never count):

1. **A CUDA test.** An ``if`` (or conditional expression's statement) whose test mentions CUDA:
   ``torch.cuda.is_available()``, ``torch.accelerator.is_available()``, ``x.is_cuda``,
   ``dev.type == "cuda"`` / ``!= "cpu"``, a call of a function whose name contains ``cuda``
   (``cuda_status(dev)``, ``_is_cuda(dev)``), or a name that says so (``HAS_CUDA``, ``ON_GPU``,
   ``on_gpu``, ``is_cuda``, ``use_cuda``, ``cuda_ok``), or a name assigned from one of those in
   the same function (``ok, why = cuda_status(dev)``; ``on_gpu = dev.type == "cuda"``). Its
   positive branch is CUDA-only: the body of ``if <cuda>``, the ``else`` of ``if not <cuda>``
   (``not``, ``!=`` against ``"cuda"`` and ``==`` against ``"cpu"`` negate). When the negative
   branch ends in ``return``, ``raise``, ``continue`` or ``break`` (``if dev.type != "cuda":
   return ...``), every statement after the ``if`` in the same block is CUDA-only too.
2. **A CUDA function.** A function (or method) whose own body, outside any ``if``, calls
   ``torch.cuda.X(...)`` for an ``X`` that needs a device (``synchronize``, ``Event``, ``Stream``,
   ``current_stream``, ``_sleep``, ...: everything except ``is_available``, ``is_initialized``,
   ``device_count``, ``get_sync_debug_mode``, ``set_sync_debug_mode`` and ``memory``'s readers):
   the whole function is CUDA-only (it raises on the first such call without a GPU).
3. **A marker.** A statement whose first line ends with the comment ``# cuda-only`` (a ``def``,
   ``class``, ``if``, ``with`` ...): the whole statement, for what rules 1-2 cannot see.

The rule reads syntax, not meaning, so it errs in known ways: a ``.type == "cuda"`` test that guards
an error path for a CUDA device asked for on a CPU machine (``device.resolve_device``'s refusal) counts
as CUDA-only and runs without CUDA; a CUDA path behind a test it does not recognise is not counted
unless marked. Mark such a statement ``# cuda-only`` rather than bending the rule.

Lines marked ``# pragma: no cover`` are counted like any other here (coverage's default would drop
them): a CUDA-only line with that pragma is still a CUDA-only line that did not run.

Not counted: the notebooks' pipeline cells that tests execute (``tests/test_pipeline_cells.py``,
``tests/test_chNN_pipeline.py``, ``tests/test_cuda_*.py``) are compiled from strings, so coverage has
no file to attribute their lines to; they appear in neither figure.

Stand-ins: ``tests/cuda_standin.py`` replaces the CUDA API in tests only, so that a CUDA-only line can
run on a CPU and be checked (device placement, streams and events, host syncs); a number it makes
never reaches a reader.
"""

from __future__ import annotations

import argparse
import ast
import io
import os
import subprocess
import sys
import tempfile
import tokenize
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: ``torch.cuda`` calls that do not need a device (a function calling only these is not CUDA-only).
SAFE_CUDA_CALLS = frozenset(
    {
        "is_available",
        "is_initialized",
        "device_count",
        "get_sync_debug_mode",
        "set_sync_debug_mode",
        "memory_allocated",
        "max_memory_allocated",
        "memory_reserved",
        "get_device_name",
        "get_device_properties",
    }
)
#: Names that mean "CUDA is here" when an ``if`` tests them.
CUDA_NAMES = frozenset({"has_cuda", "on_gpu", "is_cuda", "use_cuda", "cuda_ok", "cuda", "gpu", "with_cuda"})
MARKER = "# cuda-only"


# -- which lines are CUDA-only -------------------------------------------------------------------


def _dotted(node: ast.AST) -> str:
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    return ".".join(reversed(parts))


def _const_str(node: ast.AST) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


class _Predicate:
    """Says whether an ``if`` test means CUDA (+1), no CUDA (-1) or neither (0), with names learnt in a function."""

    def __init__(self) -> None:
        self.flags: set[str] = set()

    def sign(self, test: ast.AST) -> int:
        if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
            return -self.sign(test.operand)
        if isinstance(test, ast.BoolOp):
            signs = [self.sign(v) for v in test.values]
            pos, neg = [s for s in signs if s > 0], [s for s in signs if s < 0]
            if isinstance(test.op, ast.And) and pos and not neg:
                return 1  # `if on_gpu and x`: the body needs CUDA
            if isinstance(test.op, ast.Or) and neg and not pos:
                return -1  # `if not on_gpu or x`: the else needs CUDA
            return 0
        if isinstance(test, ast.Compare) and len(test.ops) == 1:
            left, right = _dotted(test.left), test.comparators[0]
            value = _const_str(right)
            if left.endswith(".type") or left == "type":
                op = test.ops[0]
                if value == "cuda":
                    return 1 if isinstance(op, ast.Eq) else -1 if isinstance(op, ast.NotEq) else 0
                if value == "cpu":
                    return -1 if isinstance(op, ast.Eq) else 1 if isinstance(op, ast.NotEq) else 0
            return 0
        if isinstance(test, ast.Call):
            name = _dotted(test.func)
            if name in ("torch.cuda.is_available", "torch.accelerator.is_available"):
                return 1
            return 1 if "cuda" in name.rsplit(".", 1)[-1].lower() else 0
        if isinstance(test, (ast.Name, ast.Attribute)):
            name = _dotted(test)
            last = name.rsplit(".", 1)[-1]
            if last == "is_cuda" or last.lower() in CUDA_NAMES or name in self.flags:
                return 1
        return 0

    def learn(self, stmt: ast.stmt) -> None:
        """``on_gpu = dev.type == "cuda"`` / ``ok, why = cuda_status(dev)``: the name (first target) is a flag."""
        if not isinstance(stmt, ast.Assign) or len(stmt.targets) != 1:
            return
        target, value = stmt.targets[0], stmt.value
        if isinstance(target, ast.Tuple) and target.elts and isinstance(value, ast.Call):
            target = target.elts[0]
        if isinstance(target, ast.Name) and self.sign(value) > 0:
            self.flags.add(target.id)


def _span(node: ast.AST) -> range:
    return range(node.lineno, (getattr(node, "end_lineno", None) or node.lineno) + 1)  # type: ignore[attr-defined]


def _ends_flow(body: list[ast.stmt]) -> bool:
    return bool(body) and isinstance(body[-1], (ast.Return, ast.Raise, ast.Continue, ast.Break))


def _calls_cuda(node: ast.AST) -> bool:
    """A call of ``torch.cuda.X`` that needs a device, in ``node``, that runs whenever ``node`` does (not inside a
    lambda, nor in a branch of a conditional expression or after the first operand of ``and`` / ``or``)."""
    if isinstance(node, ast.Lambda):
        return False
    if isinstance(node, ast.IfExp):  # `stream() if on_gpu else None`: only the test runs for sure
        return _calls_cuda(node.test)
    if isinstance(node, ast.BoolOp):  # `on_gpu and torch.cuda...`: only the first operand runs for sure
        return _calls_cuda(node.values[0])
    if isinstance(node, ast.Call):
        name = _dotted(node.func)
        if name.startswith("torch.cuda.") and name.split(".")[2] not in SAFE_CUDA_CALLS:
            return True
    return any(_calls_cuda(child) for child in ast.iter_child_nodes(node))


def _calls_cuda_unconditionally(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    """Rule 2. Stops at a "no CUDA: return" guard (what follows it is rule 1's), so the CPU path stays apart."""
    pred = _Predicate()

    def walk(stmts: list[ast.stmt]) -> bool:
        for st in stmts:
            pred.learn(st)
            if isinstance(st, ast.If) and pred.sign(st.test) < 0 and _ends_flow(st.body):
                return False
            if isinstance(st, (ast.If, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Match)):
                continue  # a branch, or code that runs when called
            # a simple statement, or the header of a compound one (a loop's iterable, a with's items)
            header = [getattr(st, f) for f in ("iter", "test", "value", "targets", "target") if hasattr(st, f)]
            header += [item.context_expr for item in getattr(st, "items", [])]
            if not hasattr(st, "body"):
                header = [st]
            if any(_calls_cuda(node) for node in header if isinstance(node, ast.AST)):
                return True
            if isinstance(st, ast.While):
                continue  # its body may run zero times
            for field in ("body", "finalbody"):
                inner = getattr(st, field, None)
                if isinstance(inner, list) and inner and isinstance(inner[0], ast.stmt) and walk(inner):
                    return True
        return False

    return walk(fn.body)


def cuda_only_lines(source: str) -> set[int]:
    """The line numbers of ``source`` that run only with CUDA, by the three rules of the module docstring."""
    tree = ast.parse(source)
    lines: set[int] = set()
    marked = set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT and tok.string.strip().lower().startswith(MARKER):
            marked.add(tok.start[0])

    def block(stmts: list[ast.stmt], pred: _Predicate) -> None:
        rest_is_cuda = False
        for st in stmts:
            if rest_is_cuda or st.lineno in marked:
                lines.update(_span(st))
                continue
            pred.learn(st)
            if isinstance(st, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if _calls_cuda_unconditionally(st):
                    lines.update(_span(st))
                else:
                    block(st.body, _Predicate())
                continue
            if isinstance(st, ast.ClassDef):
                block(st.body, pred)
                continue
            if isinstance(st, ast.If):
                sign = pred.sign(st.test)
                if sign > 0:
                    for s in st.body:
                        lines.update(_span(s))
                    block(st.orelse, pred)
                    continue
                if sign < 0:
                    block(st.body, pred)
                    for s in st.orelse:
                        lines.update(_span(s))
                    if _ends_flow(st.body) and not st.orelse:
                        rest_is_cuda = True
                    continue
            for field in ("body", "orelse", "finalbody", "handlers"):
                inner = getattr(st, field, None)
                if isinstance(inner, list) and inner:
                    if isinstance(inner[0], ast.ExceptHandler):
                        for h in inner:
                            block(h.body, pred)
                    elif isinstance(inner[0], ast.stmt):
                        block(inner, pred)
            if isinstance(st, ast.Match):
                for case in st.cases:
                    block(case.body, pred)

    block(tree.body, _Predicate())
    return lines


# -- running the tests under coverage ---------------------------------------------------------------


@dataclass
class ModuleFigures:
    path: str
    statements: int
    executed: int
    cuda: int
    cuda_executed: int


def default_tests(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in (root / "tests").glob("test_*.py"))


def run_tests(root: Path, tests: list[str], data_file: Path) -> int:
    env = dict(os.environ, PYTHONPATH=str(root), WORKBOOK_QUICK=os.environ.get("WORKBOOK_QUICK", "1"))
    cmd = [sys.executable, "-m", "coverage", "run", f"--data-file={data_file}", f"--source={root / 'helpers'}"]
    cmd += ["-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "0", *tests]
    print("running:", " ".join(cmd[2:]), flush=True)
    return subprocess.run(cmd, cwd=root, env=env).returncode


def analyse(root: Path, data_file: Path) -> list[ModuleFigures]:
    import coverage  # the tool's own dependency: in the test extras

    cov = coverage.Coverage(data_file=str(data_file), config_file=False)
    cov.set_option("report:exclude_lines", [])  # count "pragma: no cover" lines too (see the docstring)
    cov.load()
    out = []
    for path in sorted((root / "helpers").rglob("*.py")):
        _, statements, _, missing, _ = cov.analysis2(str(path))
        stmts, miss = set(statements), set(missing)
        cuda = cuda_only_lines(path.read_text(encoding="utf-8")) & stmts
        out.append(
            ModuleFigures(str(path.relative_to(root)), len(stmts), len(stmts - miss), len(cuda), len(cuda - miss))
        )
    return out


def _pct(a: int, b: int) -> str:
    return f"{100 * a / b:5.1f}%" if b else "    -"


def report(figures: list[ModuleFigures], tests: list[str] | None) -> str:
    total = sum(f.statements for f in figures)
    ran = sum(f.executed for f in figures)
    cuda = sum(f.cuda for f in figures)
    cuda_ran = sum(f.cuda_executed for f in figures)
    width = max(len(f.path) for f in figures)
    lines = [
        f"helpers/ line coverage: {_pct(ran, total).strip()} ({ran} of {total} statements)",
        f"CUDA-only lines run: {_pct(cuda_ran, cuda).strip()} ({cuda_ran} of {cuda}; rule: tools/cuda_coverage.py)",
        "",
        f"{'module':<{width}}  {'lines':>6} {'run':>6} {'cover':>6}   {'cuda-only':>9} {'run':>5} {'cover':>6}",
    ]
    for f in figures:
        if f.statements:
            lines.append(
                f"{f.path:<{width}}  {f.statements:>6} {f.executed:>6} {_pct(f.executed, f.statements):>6}   "
                f"{f.cuda:>9} {f.cuda_executed:>5} {_pct(f.cuda_executed, f.cuda):>6}"
            )
    lines.append(f"{'total':<{width}}  {total:>6} {ran:>6} {_pct(ran, total):>6}   ")
    lines[-1] += f"{cuda:>9} {cuda_ran:>5} {_pct(cuda_ran, cuda):>6}"
    lines.append("")
    if tests is not None:
        lines.append(f"Measured with {len(tests)} test file(s): " + " ".join(Path(t).name for t in tests))
    lines.append(
        "Not counted: notebook cells that tests execute (compiled from strings: no file for coverage to attribute)."
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--tests", nargs="+", help="test files to run (default: every tests/test_*.py)")
    parser.add_argument("--data", type=Path, help="a coverage data file: reuse it if it exists, else write it")
    parser.add_argument("--root", type=Path, default=ROOT, help="the workbook's root (default: this checkout)")
    args = parser.parse_args(argv)
    root = args.root.resolve()
    tests = args.tests or default_tests(root)
    with tempfile.TemporaryDirectory() as tmp:
        data_file = args.data.resolve() if args.data else Path(tmp) / ".coverage"
        ran_now = not data_file.exists()
        if ran_now:
            rc = run_tests(root, tests, data_file)
            if rc not in (0, 1):  # 1: some test failed; the figures still mean something, and say so below
                print(f"pytest ended with exit status {rc}: no report", file=sys.stderr)
                return rc
            if rc == 1:
                print("note: some tests failed; the figures below count what ran anyway", file=sys.stderr)
        print(report(analyse(root, data_file), tests if ran_now else None))
    return 0


if __name__ == "__main__":
    sys.exit(main())
