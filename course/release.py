"""Make the student release of the chapters: the notebooks without answers, plus how to hand them in.

    python -m course.release                       # every chapter -> release/
    python -m course.release --chapters 04 05 --out release/
    python -m course.release --solutions SOLUTIONS.md   # the instructor's solutions, generated from the key

The chapters already hold no answers (they live in course/key.py); the release clears every output,
leaves course/ out, and fails if any answer of the key (a solution line, an explanation, an
``expected=`` argument) shows up in a released notebook, in a code or a markdown cell, or if an exercise
cell's ``answer = ...`` line holds anything but ``None``.
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
# In an exercise cell: `answer = ...` (`answer_a: int = ...`, `answer += ...`): the student's line, None when released
ANSWER_LINE = re.compile(r"^[ \t]*(answer\w*)[ \t]*(?::[^=\n]*)?(?:[-+*/%@&|^]|//|\*\*)?=(?!=)[ \t]*(.*)$", re.M)
# ... and what its check is handed: the student's `answer`, never a value (`exercises.check("04.3", 12)`)
CHECKED = re.compile(r'exercises\.check\(\s*"\d\d\.\d"\s*,\s*([^,)\s]+)|Part\(\s*([^,)\s]+)')
# A solution line that only names the class to hand in (05.3: `answer = LatePrefetcher`): a question may say it
HAND_IN = re.compile(r"answer\w* = (?!True$|False$|None$)[A-Z]\w*$")

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
            explanations.append(_words(e.explanation)[:60])
    return solutions, explanations


def _words(text: str) -> str:
    """``text`` with its line breaks and runs of spaces as single spaces (a copy in markdown is often re-wrapped)."""
    return " ".join(text.split())


def _code_without_comments(src: str) -> str:
    return "\n".join(line.split("#")[0] for line in src.splitlines())


def _answer_cell_leaks(where: str, code: str) -> list[str]:
    """What in one exercise cell's code (comments aside) is an answer: its ``answer = ...`` lines must be None."""
    found = []
    for name, value in ANSWER_LINE.findall(code):
        if value.strip() != "None":
            found.append(f"{where}: `{name} = {value.strip()}` is an answer; release the cell with `{name} = None`")
    for m in CHECKED.finditer(code):
        arg = m.group(1) or m.group(2)
        if not arg.startswith("answer"):
            found.append(f"{where}: the check is handed {arg!r}, not the student's `answer`")
    return found


def leaks(nb: nbformat.NotebookNode) -> list[str]:
    """What in ``nb`` gives an answer away (empty: nothing).

    A solution line or an explanation of the key in any cell, code or markdown (in code, comments aside: a
    placeholder such as ``answer = None  # answer = Prefetcher`` says what to hand in, not how), and in an
    exercise cell an ``expected=`` or ``explanation=`` argument, an ``answer = ...`` line that is not ``None``
    or a check handed anything but the student's ``answer``.
    """
    found = []
    solutions, explanations = _leak_needles()
    for i, cell in enumerate(nb.cells):
        if cell.cell_type not in ("code", "markdown"):
            continue
        code = _code_without_comments(cell.source) if cell.cell_type == "code" else cell.source
        check = CHECK_CALL.search(cell.source) if cell.cell_type == "code" else None
        where = f"cell {i} ({cell.cell_type}" + (f", exercise {check.group(1)})" if check else ")")
        if cell.cell_type == "code" and ("course.key" in code or "course/key" in code):
            found.append(f"{where}: reads the answer key")
        said = [n for n in solutions if n in code and not (cell.cell_type == "markdown" and HAND_IN.match(n))]
        found += [f"{where}: contains the key's solution {n!r}" for n in said]
        found += [f"{where}: contains the key's explanation {n!r}" for n in explanations if n in _words(cell.source)]
        if check:
            found += [f"{where}: the check passes {arg}" for arg in ("expected=", "explanation=") if arg in code]
            found += _answer_cell_leaks(where, code)
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
        more = f"; and {len(found) - 8} more" if len(found) > 8 else ""
        raise ValueError(f"{path.name} gives answers away: " + "; ".join(found[:8]) + more)
    return nb


def make_release(out: Path, chapters: list[str] | None = None) -> list[Path]:
    """Write the student release of ``chapters`` (default all) into ``out``; returns the notebooks written.

    Raises:
        ValueError: an answer shows in a chapter (every such chapter is named; nothing is written then).
    """
    released: dict[str, nbformat.NotebookNode] = {}
    refused: list[str] = []
    for path in chapter_notebooks(chapters):
        try:
            released[path.name] = release_notebook(path)
        except ValueError as exc:
            refused.append(str(exc))
    if refused:
        raise ValueError("\n".join(refused))
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, nb in released.items():
        nbformat.write(nb, out / name)
        written.append(out / name)
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
