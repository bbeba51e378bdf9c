"""Grade a folder of submitted notebooks: one table of student, exercise, points and feedback.

    python -m course.grade SUBMISSIONS [--out grades.csv]

SUBMISSIONS holds one folder per student with their notebooks (``alice/04_worker_processes.ipynb``), or
notebooks named ``<student>__04_worker_processes.ipynb`` (or ``<student>.ipynb`` for one chapter, named by the
notebook's title). A chapter is known by its file name (``NN_``) or its title cell (``# NN · ...``).

Nothing is executed: every check leaves a record in its cell's output (``helpers.ui.exercises.RECORD_MIME``):
the answer as the student's run computed it and the figures that run measured. The grader grades each record
with its own copy of the answer key (course/key.py), so

* an edited check (``expected=answer``, a lambda returning True) changes nothing: the key decides;
* a deleted or unrun check scores 0, with feedback saying so;
* an answer computed with what the exercise rules out (``key.Answer.forbid``: ``statistics`` in 00.1, the
  helper attribute ``sweep.best_workers`` in 04.1) scores 0, whatever its value;
* a measured answer (e.g. 04.1's best ``num_workers``) is graded against the figures the student's own run
  recorded, never a fresh re-run: a value read off their table passes.

Limits: a student who forges the record by hand (editing the notebook's JSON) is not caught; re-run
suspicious submissions in front of you. The ``forbid`` check reads the exercise's own cell only: a value computed
with a ruled-out helper in another cell (``bw = sweep.best_workers``, then ``answer = bw``) is not caught. Grading
reads JSON only: seconds for a class.
"""

from __future__ import annotations

import argparse
import csv
import io
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nbformat

from course import key
from helpers.ui import exercises

FIELDS = ["student", "chapter", "exercise", "points", "max_points", "feedback"]


@dataclass
class Row:
    student: str
    chapter: str
    exercise: str
    points: float
    max_points: int
    feedback: str


def chapter_of(path: Path, nb: nbformat.NotebookNode) -> str | None:
    m = re.match(r"(?:.*__)?(\d\d)_", path.name)
    if m:
        return m.group(1)
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            t = re.match(r"#\s+(\d\d)\s", cell.source)
            if t:
                return t.group(1)
    return None


def student_of(path: Path, root: Path) -> str:
    rel = path.relative_to(root)
    if len(rel.parts) > 1:
        return rel.parts[0]
    return path.stem.split("__")[0]


def records(nb: nbformat.NotebookNode) -> dict[str, tuple[dict[str, Any], str]]:
    """Each exercise's last record in ``nb``, with the source of the cell that made it."""
    found: dict[str, tuple[dict[str, Any], str]] = {}
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        for out in cell.get("outputs", []):
            data = out.get("data", {}) if out.get("output_type") in ("execute_result", "display_data") else {}
            bundle = data.get(exercises.RECORD_MIME)
            if isinstance(bundle, dict):
                for rec in bundle.get("records", []):
                    if isinstance(rec, dict) and isinstance(rec.get("exercise"), str):
                        found[rec["exercise"]] = (rec, cell.source)
    return found


def decode_answer(data: Any) -> Any:
    """The inverse of ``helpers.ui.exercises.encode_answer`` (an object known only by its ``repr`` comes back as that
    string)."""
    if not isinstance(data, dict):
        return data
    if "set" in data:
        return {_hashable(decode_answer(x)) for x in data["set"]}
    if "tuple" in data:
        return tuple(decode_answer(x) for x in data["tuple"])
    if "list" in data:
        return [decode_answer(x) for x in data["list"]]
    if "float" in data:
        return float(data["float"])
    if data.get("ellipsis"):
        return Ellipsis
    return str(data.get("repr", ""))  # a class, a function: the key's checker ran in the reader's run


def _hashable(x: Any) -> Any:
    return tuple(_hashable(i) for i in x) if isinstance(x, list) else x


def grade_one(exercise: str, found: dict[str, tuple[dict[str, Any], str]]) -> tuple[float, str]:
    """``(points, feedback)`` for one exercise of one submission."""
    e = key.entry(exercise)
    if exercise not in found:
        return 0, "no recorded check: the check cell was deleted, changed or not run (run it and save with outputs)"
    rec, source = found[exercise]
    answer = decode_answer(rec.get("answer"))
    if answer is None or answer is Ellipsis:
        return 0, "not answered"
    note = " (the check's expected= was edited: graded against the key)" if rec.get("expected_given") else ""
    used = key.forbidden_use(exercise, source)
    if used:
        return 0, f"uses {used}, which the exercise rules out{note}"
    facts = rec.get("facts")
    if e.measured and not isinstance(facts, dict):
        return 0, f"the run's figures were not recorded (the chapter's cells did not run before the check){note}"
    try:
        ok, why = key.grade(exercise, answer, facts or {})
    except Exception as exc:  # an odd record must not stop the class's grading
        ok, why = False, f"could not grade the answer ({type(exc).__name__}: {exc})"
    if ok:
        return e.points, "correct" + (" (against this student's own run)" if e.measured else "") + note
    return 0, "not quite" + (f": {why}" if why else "") + note


def grade_notebook(path: Path, student: str) -> list[Row]:
    try:
        nb = nbformat.read(path, as_version=4)
    except Exception as exc:  # a broken file is one row of feedback, not a crash
        return [Row(student, "?", "?", 0, 0, f"{path.name}: not a readable notebook ({type(exc).__name__})")]
    chapter = chapter_of(path, nb)
    ids = key.chapter_exercises(chapter) if chapter else []
    if not ids:
        return [Row(student, chapter or "?", "?", 0, 0, f"{path.name}: no chapter with exercises recognised")]
    found = records(nb)
    rows = []
    for ex in ids:
        pts, feedback = grade_one(ex, found)
        rows.append(Row(student, chapter or "?", ex, pts, key.points(ex), feedback))
    return rows


def grade_folder(root: Path) -> list[Row]:
    """Every submission under ``root``, one row per student and exercise.

    Raises:
        ValueError: ``root`` is not a folder or holds no notebook.
    """
    if not root.is_dir():
        raise ValueError(f"SUBMISSIONS={root} is not a folder; give the folder of submitted notebooks")
    paths = sorted(p for p in root.rglob("*.ipynb") if ".ipynb_checkpoints" not in p.parts)
    if not paths:
        raise ValueError(f"no .ipynb under {root}")
    rows: list[Row] = []
    for path in paths:
        rows += grade_notebook(path, student_of(path, root))
    return rows


def write_csv(rows: list[Row], out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(FIELDS)
        for r in rows:
            w.writerow([r.student, r.chapter, r.exercise, r.points, r.max_points, r.feedback])


def table(rows: list[Row]) -> str:
    """The grades as printed: one line per student and exercise, then each student's total."""
    buf = io.StringIO()
    buf.write(f"{'student':<16} {'exercise':<8} {'points':>6}  feedback\n")
    for r in rows:
        buf.write(f"{r.student[:16]:<16} {r.exercise:<8} {r.points:>3g}/{r.max_points:<2}  {r.feedback}\n")
    totals: dict[str, list[float]] = {}
    for r in rows:
        t = totals.setdefault(r.student, [0, 0])
        t[0] += r.points
        t[1] += r.max_points
    buf.write("totals: " + ", ".join(f"{s} {p:g}/{m:g}" for s, (p, m) in totals.items()) + "\n")
    return buf.getvalue()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("submissions", type=Path, help="folder of submitted notebooks")
    ap.add_argument("--out", type=Path, default=Path("grades.csv"), help="CSV to write (default: grades.csv)")
    args = ap.parse_args(argv)
    try:
        rows = grade_folder(args.submissions)
    except ValueError as exc:
        print(f"grade: {exc}", file=sys.stderr)
        return 2
    write_csv(rows, args.out)
    print(table(rows), end="")
    print(f"wrote {args.out} ({len(rows)} rows)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
