"""tools/code_size.py counts helpers/ as issue #27 does (wc -l), resolving relative imports."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

import code_size  # noqa: E402


def test_counts_lines_like_wc(tmp_path: Path) -> None:
    pkg = tmp_path / "helpers"
    for folder in ("core", "chapters/ch09"):
        (pkg / folder).mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "core" / "__init__.py").write_text("")
    (pkg / "core" / "timing.py").write_text("def f():\n" + "    x = 1\n" * 70)
    (pkg / "chapters" / "__init__.py").write_text("")
    (pkg / "chapters" / "ch09" / "__init__.py").write_text("from ...core import timing\n")
    text = code_size.report(tmp_path)
    assert "helpers/: 72 lines in 5 modules" in text
    assert "ch09: own 1; reading it = own + the kernel modules it imports: 72 (1 modules" in text
    assert "functions over 60 lines: 1; longest: timing.py:f 71" in text


def test_runs_on_this_checkout() -> None:
    done = subprocess.run([sys.executable, str(ROOT / "tools" / "code_size.py")], capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.startswith("helpers/: ")


def test_no_module_over_600_lines_and_no_function_over_60() -> None:
    """The limits docs/CONTRIBUTING.md sets (issue #27), held for every module of helpers/."""
    helpers = ROOT / "helpers"
    big = {str(p.relative_to(ROOT)): n for p in helpers.rglob("*.py") if (n := code_size.lines(p)) > 600}
    assert big == {}, f"modules over 600 lines: {big}: split them by job"
    long = [f for p in helpers.rglob("*.py") for f in code_size.long_functions(p)]
    assert long == [], f"functions over 60 lines: {long}: split them into named steps"


#: What issue #27's passes brought helpers/ and its kernel down to (tools/code_size.py, 2026-11-25), plus about
#: 2% room. A change that needs more cuts elsewhere first, or says in its commit why the ceiling must rise.
#: helpers/ rose from 14,800 to 15,350 on 2026-11-25: four laptop-size reads of the chapters found prose their
#: outputs contradicted, and the fixes print verdicts computed from the run (warm-up, main-process limit, restart
#: cost both ways, threads, the doctor's measured savings, the published '30-50%' pairs): about 450 lines.
CEILINGS = {"helpers/": 15_350, "kernel (core+ui+pipeline)": 5_350}


def test_helpers_do_not_grow_back() -> None:
    """The size issue #27 reached is held: helpers/ and its shared kernel stay under their ceilings."""
    text = code_size.report(ROOT)
    for label, ceiling in CEILINGS.items():
        line = next(x for x in text.splitlines() if x.startswith(label))
        n = int(line.split(": ")[1].split()[0].replace(",", ""))
        assert n <= ceiling, f"{label} is {n:,} lines, over its ceiling of {ceiling:,}: cut elsewhere first"
