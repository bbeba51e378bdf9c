"""Make the student release of the chapters: the notebooks without answers, plus how to hand them in.

    python -m course.release                       # every chapter -> release/
    python -m course.release --chapters 04 05 --out release/
    python -m course.release --solutions SOLUTIONS.md   # the instructor's solutions, generated from the key

The chapters already hold no answers (they live in course/key.py); the release clears every output,
leaves course/ out, and fails if any answer of the key (a solution line, an explanation, an
``expected=`` argument) shows up in a released notebook.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import nbformat

from course import key

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"
CHECK_CALL = re.compile(r'exercises\.check(?:_parts)?\(\s*"(\d\d\.\d)"')

STUDENT_README = """# Course release: {chapters}

1. Install the workbook's package as your instructor says (e.g. `pip install <the wheel or folder given>`).
2. Open each notebook, run all cells (Run > Run All Cells), answer each exercise in place of `None`
   and run its cell again. Without the answer key a check says "answer recorded": your instructor grades it.
3. Save the notebook **with its outputs** and hand it in unchanged in name (e.g. `04_worker_processes.ipynb`):
   the grader reads each check's recorded answer and the figures your own run measured, so a measured answer
   is graded against your run. A deleted check or an unrun cell scores 0 for that exercise.
"""


def chapter_of(path: Path) -> str | None:
    m = re.match(r"(\d\d)_", path.name)
    return m.group(1) if m else None


def chapter_notebooks(chapters: list[str] | None = None) -> list[Path]:
    paths = sorted(NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))
    if chapters:
        unknown = set(chapters) - {chapter_of(p) for p in paths}
        if unknown:
            raise SystemExit(f"no chapter {sorted(unknown)} in notebooks/ (there are {[chapter_of(p) for p in paths]})")
        paths = [p for p in paths if chapter_of(p) in chapters]
    return paths


def _leak_needles() -> tuple[list[str], list[str]]:
    """Text that must not appear in a student's notebook: the key's solution lines and explanations."""
    solutions: list[str] = []
    explanations: list[str] = []
    for e in key.ANSWERS.values():
        for line in e.solution.splitlines():
            code = line.split("#")[0].strip()
            if len(code) >= 12:
                solutions.append(code)
        if isinstance(e.explanation, str) and e.explanation:
            explanations.append(e.explanation[:60])
    return solutions, explanations


def _code_without_comments(src: str) -> str:
    return "\n".join(line.split("#")[0] for line in src.splitlines())


def leaks(nb: nbformat.NotebookNode) -> list[str]:
    """What in ``nb``'s code cells gives an answer away (empty: nothing).

    A solution line of the key in any code cell (comments aside: a placeholder such as
    ``answer = None  # answer = Prefetcher`` says what to hand in, not how), and in an exercise cell an
    ``expected=`` or ``explanation=`` argument, or the key's explanation.
    """
    found = []
    solutions, explanations = _leak_needles()
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        code = _code_without_comments(cell.source)
        if "course.key" in code or "course/key" in code:
            found.append(f"cell {i}: reads the answer key")
        found += [f"cell {i}: contains the key's solution {n!r}" for n in solutions if n in code]
        if CHECK_CALL.search(cell.source):
            found += [f"cell {i}: the check passes {arg}" for arg in ("expected=", "explanation=") if arg in code]
            found += [f"cell {i}: contains the key's explanation {n!r}" for n in explanations if n in cell.source]
    return found


def release_notebook(path: Path) -> nbformat.NotebookNode:
    """The student's copy of one chapter: outputs and execution counts cleared, no answers.

    Raises:
        ValueError: an answer of the key shows in the chapter (fix the chapter, not the release).
    """
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs = []
            cell.execution_count = None
    found = leaks(nb)
    if found:
        raise ValueError(f"{path.name} gives answers away: " + "; ".join(found[:5]))
    return nb


def make_release(out: Path, chapters: list[str] | None = None) -> list[Path]:
    """Write the student release of ``chapters`` (default all) into ``out``; returns the notebooks written."""
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for path in chapter_notebooks(chapters):
        nbformat.write(release_notebook(path), out / path.name)
        written.append(out / path.name)
    names = ", ".join(p.stem for p in written)
    (out / "README.md").write_text(STUDENT_README.format(chapters=names))
    return written


def question_texts(path: Path) -> dict[str, str]:
    """Each exercise's question (the markdown cell before its check) in one chapter."""
    nb = nbformat.read(path, as_version=4)
    out: dict[str, str] = {}
    for i, cell in enumerate(nb.cells):
        m = CHECK_CALL.search(cell.source) if cell.cell_type == "code" else None
        if m:
            prev = next((c for c in reversed(nb.cells[:i]) if c.cell_type == "markdown"), None)
            text = prev.source if prev else ""
            bold = text.find(f"**{m.group(1)}")
            out[m.group(1)] = text[bold:] if bold >= 0 else text
    return out


def solutions_markdown(chapters: list[str] | None = None) -> str:
    """The instructor's solutions, generated from the key (never hand-copied)."""
    lines = ["# Solutions (instructor only; generated by `python -m course.release --solutions`)", ""]
    for path in chapter_notebooks(chapters):
        chapter = chapter_of(path) or ""
        lines += [f"## {path.stem}", ""]
        questions = question_texts(path)
        for ex in key.chapter_exercises(chapter):
            e = key.entry(ex)
            q = questions.get(ex[:4], "")
            if q and not ex[4:] or ex.endswith("a"):
                lines += [q.strip(), ""]
            kind = "measured: graded against the student's own run" if e.measured else "fixed answer"
            why = e.explanation if isinstance(e.explanation, str) else "(uses the run's figures)"
            lines += [
                f"*Solution {ex}* ({e.points} point{'s' if e.points != 1 else ''}, {kind})",
                "",
                "```python",
                e.solution,
                "```",
                "",
                f"Why: {why}",
                "",
            ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chapters", nargs="*", help="chapter numbers, e.g. 04 05 (default: all)")
    ap.add_argument("--out", type=Path, default=Path("release"), help="output folder (default: release/)")
    ap.add_argument("--solutions", type=Path, help="write the instructor's solutions (markdown) to this file instead")
    args = ap.parse_args(argv)
    chapters = [c.zfill(2) for c in args.chapters] if args.chapters else None
    try:
        if args.solutions:
            args.solutions.parent.mkdir(parents=True, exist_ok=True)
            args.solutions.write_text(solutions_markdown(chapters))
            print(f"wrote {args.solutions} (instructor only: do not hand it out)")
            return 0
        written = make_release(args.out, chapters)
    except ValueError as exc:
        print(f"release: {exc}", file=sys.stderr)
        return 1
    print(f"wrote the student release of {len(written)} chapter(s) to {args.out}/ (no answers, no key):")
    for p in written:
        print(f"  {p}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
