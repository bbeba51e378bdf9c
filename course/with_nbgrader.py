"""The chapters as an nbgrader course: nbgrader's own commands release, collect, grade and export them.

    python -m course.with_nbgrader COURSE [--chapters 04 05]

writes ``COURSE/nbgrader_config.py``, ``COURSE/workbook_plugins.py`` and ``COURSE/source/chNN/NN_title.ipynb``
(the instructor's version: each exercise's solution inside nbgrader's ``### BEGIN SOLUTION`` region, its check a
locked grade cell worth the key's points). From there on, nbgrader's commands, run in ``COURSE``::

    nbgrader generate_assignment ch04      # release/ch04/: no solutions, no key
    nbgrader autograde ch04 --create       # submitted/<student>/ch04/*.ipynb -> the gradebook
    nbgrader export --to grades.csv        # one row per student and assignment
    nbgrader export --exporter=workbook_plugins.ExerciseTable --to exercises.csv
                                           # one row per student and exercise, with the feedback

nbgrader imports an ``--exporter`` class before it reads ``nbgrader_config.py`` (whose ``sys.path`` entry makes
``course`` importable), but after it put the course folder on its path: ``COURSE/workbook_plugins.py`` hands it
:class:`ExerciseTable` from there, so no ``PYTHONPATH`` is needed. The config also puts the folder of the Python
running nbgrader on ``PATH``: nbgrader runs ``alembic`` by name to create ``gradebook.db``, and ``.venv/bin/nbgrader``
must work without an activated venv.

Autograding here **executes nothing**. nbgrader's default clears every output and re-runs the notebook,
which would grade a measured answer (04.1's best ``num_workers``) against the grader's run, not the
student's. The config swaps nbgrader's ``ClearOutput`` and ``Execute`` steps for :class:`GradeFromRecords`,
which reads the record each check left in its output (the answer, and the figures the student's own run
measured) and grades it with the key (:func:`course.grade.grade_one`, the same rules as ``make grade``):
the grade cell's output becomes the points (an ``execute_result``) or an error with the feedback
(0 points), which nbgrader's ``SaveAutoGrades`` stores as usual. nbgrader restores an edited check cell
(it is locked) and re-adds a deleted one (``add_missing_cells``): without a record, it scores 0.
"""

from __future__ import annotations

import argparse
import csv
import importlib
import sys
from pathlib import Path
from typing import Any

import nbformat

from course import grade, key, release

ROOT = Path(__file__).resolve().parents[1]
CODE_STUB = "# YOUR ANSWER: replace None above, then run the next cell (its check records your answer)"

CONFIG = '''"""nbgrader configuration for the workbook's chapters (written by python -m course.with_nbgrader)."""
import os
import sys

sys.path.insert(0, {root!r})  # course/ (the answer key and GradeFromRecords) lives in the workbook's checkout
# nbgrader runs `alembic` by bare name to create gradebook.db: put the scripts folder of the Python running nbgrader
# (the venv's bin/) on PATH, so that `../.venv/bin/nbgrader ...` works without activating the venv.
_bin = os.path.dirname(sys.executable)
if _bin not in os.environ.get("PATH", "").split(os.pathsep):
    os.environ["PATH"] = _bin + os.pathsep + os.environ.get("PATH", "")

c = get_config()  # noqa: F821 (nbgrader defines it)
c.CourseDirectory.course_id = "gpu-data-workbook"
c.ClearSolutions.code_stub = {{"python": {stub!r}}}
c.OverwriteCells.add_missing_cells = True
# Grade from the records each check left in the student's outputs: no ClearOutput, no Execute.
c.Autograde.sanitize_preprocessors = [
    "nbgrader.preprocessors.DeduplicateIds",
    "nbgrader.preprocessors.OverwriteKernelspec",
    "nbgrader.preprocessors.OverwriteCells",
    "nbgrader.preprocessors.CheckCellMetadata",
]
c.Autograde.autograde_preprocessors = [
    "course.with_nbgrader.GradeFromRecords",
    "nbgrader.preprocessors.LimitOutput",
    "nbgrader.preprocessors.SaveAutoGrades",
    "nbgrader.preprocessors.AssignLatePenalties",
    "nbgrader.preprocessors.CheckCellMetadata",
]
'''


PLUGINS = '''"""The workbook's nbgrader plugins for nbgrader's command line (written by python -m course.with_nbgrader).

nbgrader puts the course folder on its path, then imports an --exporter=... class before it reads
nbgrader_config.py:  nbgrader export --exporter=workbook_plugins.ExerciseTable --to exercises.csv
"""
import sys

sys.path.insert(0, {root!r})  # course/ lives in the workbook's checkout
from course.with_nbgrader import ExerciseTable  # noqa: E402, F401
'''


def _ids(exercise: str) -> list[str]:
    """The key's ids graded by one exercise cell: ``04.1``, or its parts ``02.2a``, ``02.2b``."""
    return [i for i in key.chapter_exercises(exercise[:2]) if i[:4] == exercise]


def _meta(grade_id: str, *, solution: bool, points: int | None = None) -> dict[str, Any]:
    meta: dict[str, Any] = {"grade_id": grade_id, "solution": solution, "grade": points is not None}
    meta.update(locked=not solution, schema_version=3)
    if points is not None:
        meta["points"] = points
    return {"nbgrader": meta}


def split_exercise(cell: nbformat.NotebookNode) -> list[nbformat.NotebookNode]:
    """One exercise cell as nbgrader's two: the answer (a solution cell) and the check (a locked grade cell)."""
    m = release.CHECK_CALL.search(cell.source)
    if not m:
        return [cell]
    ex = m.group(1)
    answer_src, check_src = cell.source[: m.start()].rstrip(), cell.source[m.start() :]
    solution = "\n".join(key.entry(i).solution for i in _ids(ex))
    answer_src = f"{answer_src}\n### BEGIN SOLUTION\n{solution}\n### END SOLUTION"
    tag = ex.replace(".", "_")
    points = sum(key.points(i) for i in _ids(ex))
    return [
        nbformat.v4.new_code_cell(answer_src, metadata=_meta(f"answer_{tag}", solution=True)),
        nbformat.v4.new_code_cell(check_src, metadata=_meta(f"check_{tag}", solution=False, points=points)),
    ]


def source_notebook(path: Path) -> nbformat.NotebookNode:
    """The instructor's nbgrader version of one chapter (outputs cleared, solutions in their regions)."""
    nb = release.release_notebook(path)
    nb.cells = [new for cell in nb.cells for new in split_exercise(cell)]
    for i, cell in enumerate(nb.cells):
        cell.pop("id", None)
        cell["id"] = f"cell-{i}"
    return nb


def make_course(course: Path, chapters: list[str] | None = None) -> list[Path]:
    """Write ``course/nbgrader_config.py``, ``course/workbook_plugins.py`` and one assignment ``source/chNN/`` per
    chapter; returns the notebooks."""
    course.mkdir(parents=True, exist_ok=True)
    (course / "nbgrader_config.py").write_text(CONFIG.format(root=str(ROOT), stub=CODE_STUB))
    (course / "workbook_plugins.py").write_text(PLUGINS.format(root=str(ROOT)))
    written = []
    for path in release.chapter_notebooks(chapters):
        chapter = release.chapter_of(path) or ""
        if not key.chapter_exercises(chapter):
            continue
        out = course / "source" / f"ch{chapter}" / path.name
        out.parent.mkdir(parents=True, exist_ok=True)
        nbformat.write(source_notebook(path), out)
        written.append(out)
    return written


def _answer_sources(nb: nbformat.NotebookNode) -> dict[str, str]:
    return {_grade_id(c): c.source for c in nb.cells if c.get("metadata", {}).get("nbgrader", {}).get("solution")}


def grade_cell(cell: nbformat.NotebookNode, found: dict[str, Any], answers: dict[str, str]) -> None:
    """Replace one grade cell's outputs by its points (or an error with the feedback, for 0)."""
    m = release.CHECK_CALL.search(cell.source)
    if not m:
        return
    ex = m.group(1)
    answer_src = answers.get(f"answer_{ex.replace('.', '_')}", "")
    total, notes = 0.0, []
    for i in _ids(ex):
        one = {i: (found[i][0], answer_src + "\n" + found[i][1])} if i in found else {}
        pts, feedback = grade.grade_one(i, one)
        total += pts
        notes.append(f"{i}: {pts:g}/{key.points(i)} {feedback}")
    text = "\n".join(notes)
    if total > 0:
        cell.outputs = [
            nbformat.v4.new_output("stream", name="stdout", text=text + "\n"),
            nbformat.v4.new_output("execute_result", data={"text/plain": f"{total:g}"}, execution_count=None),
        ]
    else:
        cell.outputs = [nbformat.v4.new_output("error", ename="NotGraded", evalue=text, traceback=[text])]


def _nbgrader_base(module: str, name: str) -> Any:
    """nbgrader's base class ``module.name``, or ``object`` without nbgrader (make_course needs none)."""
    try:
        return getattr(importlib.import_module(module), name)
    except ImportError:
        return object


class GradeFromRecords(_nbgrader_base("nbgrader.preprocessors", "NbGraderPreprocessor")):  # type: ignore[misc]
    """nbgrader's autograde step in place of Execute: grades each check's record with the key."""

    def preprocess(self, nb: nbformat.NotebookNode, resources: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        found, answers = grade.records(nb), _answer_sources(nb)
        for cell in nb.cells:
            if cell.cell_type == "code" and cell.get("metadata", {}).get("nbgrader", {}).get("grade"):
                grade_cell(cell, found, answers)
        return nb, resources


def _feedback(student: str, assignment: str, notebook: str) -> dict[str, str]:
    """Each grade cell's feedback in the autograded notebook (course root = the working folder), by grade_id."""
    path = Path("autograded") / student / assignment / f"{notebook}.ipynb"
    if not path.is_file():
        return {}
    nb = nbformat.read(path, as_version=4)
    out = {}
    for cell in nb.cells:
        texts = [o.get("text") or o.get("evalue") or "" for o in cell.get("outputs", [])]
        out[_grade_id(cell)] = " ".join(t.strip() for t in texts if t).replace("\n", "; ")
    return out


def _grade_id(cell: Any) -> str:
    return str(cell.get("metadata", {}).get("nbgrader", {}).get("grade_id", ""))


class ExerciseTable(_nbgrader_base("nbgrader.plugins", "ExportPlugin")):  # type: ignore[misc]
    """``nbgrader export --exporter=workbook_plugins.ExerciseTable``: one row per student and exercise.

    The columns of ``make grade``'s CSV (:data:`course.grade.FIELDS`: student, chapter, exercise, points,
    max_points, feedback), read from nbgrader's gradebook; the feedback from the autograded notebooks.
    """

    def export(self, gradebook: Any) -> None:
        from nbgrader.api import MissingEntry

        dest = Path(self.to or "exercises.csv")
        rows = []
        for assignment in gradebook.assignments:
            for student in gradebook.students:
                try:
                    submission = gradebook.find_submission(assignment.name, student.id)
                except MissingEntry:
                    continue
                for nb in submission.notebooks:
                    said = _feedback(student.id, assignment.name, nb.name)
                    for g in sorted(nb.grades, key=lambda g: g.name):
                        ex = g.name.removeprefix("check_").replace("_", ".")
                        score = g.score or 0.0
                        rows.append(
                            [student.id, assignment.name, ex, f"{score:g}", f"{g.max_score:g}", said.get(g.name, "")]
                        )
        with dest.open("w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(grade.FIELDS)
            writer.writerows(rows)
        self.log.info("wrote %s (%d rows: one per student and exercise)", dest, len(rows))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("course", type=Path, help="the nbgrader course folder to write (config and source/)")
    ap.add_argument("--chapters", nargs="*", help="chapter numbers, e.g. 04 05 (default: every chapter)")
    args = ap.parse_args(argv)
    chapters = [c.zfill(2) for c in args.chapters] if args.chapters else None
    try:
        written = make_course(args.course, chapters)
    except (ValueError, SystemExit) as exc:
        print(f"with_nbgrader: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {args.course}/nbgrader_config.py, workbook_plugins.py and {len(written)} assignment(s):")
    for p in written:
        print(f"  {p}")
    print(f"next: cd {args.course} && nbgrader generate_assignment {written[0].parent.name if written else 'chNN'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
