"""The chapters as an nbgrader course, run end to end with nbgrader's own commands.

``python -m course.with_nbgrader`` writes the source assignment; ``nbgrader generate_assignment`` releases it
(no solution, no key); synthetic submissions go where ``nbgrader collect`` puts them; ``nbgrader autograde``
grades them from the records their checks left (nothing executed); ``nbgrader export`` writes the CSV.
Each submission is the nbgrader release with its answer cells filled and its check cells run in-process on
stand-in figures (``tests/test_course_grading.py``'s SETUP), as a student's kernel would leave them.
"""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import nbformat
import pytest

from course import grade, key, release, with_nbgrader
from tests.test_course_grading import RUN_A, RUN_B, SETUP, _run

pytest.importorskip("nbgrader", reason="the course extra (pip install -e '.[course]') brings nbgrader")

CHAPTER = "04"
BIN = Path(sys.executable).parent  # the venv's bin/ (Scripts on Windows): nbgrader and alembic live there
NBGRADER = BIN / ("nbgrader.exe" if os.name == "nt" else "nbgrader")


def _nbgrader(course: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``../.venv/bin/nbgrader ARGS`` in the course folder, as docs/INSTRUCTORS.md says: the venv not activated
    (its bin/ off PATH, no PYTHONPATH), so the config the course writes must find alembic and course/ itself."""
    if not NBGRADER.is_file():
        pytest.skip(f"no nbgrader script beside {sys.executable} (the course extra installs it there)")
    path = [p for p in os.environ.get("PATH", "").split(os.pathsep) if p and Path(p).resolve() != BIN.resolve()]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = os.pathsep.join(path) or os.defpath
    done = subprocess.run([str(NBGRADER), *args], cwd=course, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return done


def _grade_id(cell: Any) -> str:
    return str(cell.get("metadata", {}).get("nbgrader", {}).get("grade_id", ""))


def _submission(
    released: Path, run: dict[str, Any], answers: dict[str, str], edit: Callable[[Any], Any] | None = None
) -> Any:
    """The release, answered and checked in a stand-in kernel; ``edit`` may then change the saved notebook."""
    nb = nbformat.read(released, as_version=4)
    ns: dict[str, Any] = {"__name__": "__main__"}
    _run(SETUP.format(run=run), ns)
    for i, cell in enumerate(nb.cells):
        gid = _grade_id(cell)
        if gid.startswith("answer_"):
            ex = gid[len("answer_") :].replace("_", ".")
            if ex in answers:
                cell.source = cell.source.replace("answer = None", answers[ex], 1)
            _run(cell.source, ns)
        elif gid.startswith("check_"):
            cell.outputs = _run(cell.source, ns)
            cell.execution_count = i
    return edit(nb) if edit else nb


def _edit_check(nb: Any) -> Any:
    """Rewrite a check cell (saved source and output left as they were): nbgrader restores the locked cell."""
    for cell in nb.cells:
        if _grade_id(cell).startswith("check_"):
            cell.source = cell.source.replace("answer,", "answer, expected=lambda a: True,", 1)
    return nb


def _delete_checks(nb: Any) -> Any:
    nb.cells = [c for c in nb.cells if not _grade_id(c).startswith("check_")]
    return nb


@pytest.fixture(scope="module")
def course(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("course")
    (source,) = with_nbgrader.make_course(root, [CHAPTER])
    _nbgrader(root, "generate_assignment", f"ch{CHAPTER}")
    released = root / "release" / f"ch{CHAPTER}" / source.name
    solutions = {ex: e.solution for ex, e in key.ANSWERS.items()}
    wrong = {ex: "answer = 999" for ex in key.ANSWERS}
    students = {
        "alice_correct": _submission(released, RUN_A, solutions),
        "bob_empty": _submission(released, RUN_A, {}),
        "carol_edited_check": _submission(released, RUN_A, wrong, _edit_check),
        "dave_deleted_check": _submission(released, RUN_A, solutions, _delete_checks),
        "erin_own_run": _submission(released, RUN_B, {"04.1": "answer = 2"}),  # her table: 2 workers best
        "frank_other_run": _submission(released, RUN_A, {"04.1": "answer = 2"}),  # his table: 4 was best
        "gina_helper": _submission(released, RUN_A, {"04.1": "answer = sweep.best_workers"}),
    }
    for student, nb in students.items():
        out = root / "submitted" / student / f"ch{CHAPTER}" / source.name
        out.parent.mkdir(parents=True)
        nbformat.write(nb, out)
    _nbgrader(root, "autograde", f"ch{CHAPTER}", "--create")
    _nbgrader(root, "export", "--to", str(root / "grades.csv"))
    _nbgrader(root, "export", "--exporter=workbook_plugins.ExerciseTable", "--to", str(root / "exercises.csv"))
    with (root / "grades.csv").open() as f:
        totals = {row["student_id"]: float(row["raw_score"]) for row in csv.DictReader(f)}
    with (root / "exercises.csv").open() as f:
        table = list(csv.DictReader(f))
    graded = {s: nbformat.read(root / "autograded" / s / f"ch{CHAPTER}" / source.name, as_version=4) for s in students}
    return {"root": root, "source": source, "released": released, "totals": totals, "graded": graded, "table": table}


def _points(nb: Any, exercise: str) -> str:
    """What the autograded check cell of ``exercise`` shows: its points, or the error with feedback."""
    cell = next(c for c in nb.cells if _grade_id(c) == f"check_{exercise.replace('.', '_')}")
    out = cell.outputs[-1]
    return out["data"]["text/plain"] if out["output_type"] == "execute_result" else "error: " + out["evalue"]


def test_the_nbgrader_release_holds_no_answer(course: dict[str, Any]) -> None:
    source = nbformat.read(course["source"], as_version=4)
    assert "### BEGIN SOLUTION" in "".join(c.source for c in source.cells)  # the instructor's version has them
    nb = nbformat.read(course["released"], as_version=4)
    assert release.leaks(nb) == []
    text = "".join(c.source for c in nb.cells)
    assert "BEGIN SOLUTION" not in text and "course.key" not in text
    checks = [c for c in nb.cells if _grade_id(c).startswith("check_")]
    assert len(checks) == len({ex[:4] for ex in key.chapter_exercises(CHAPTER)})
    assert all(c.metadata["nbgrader"]["locked"] for c in checks)


def test_nbgrader_autograde_gives_the_right_points(course: dict[str, Any]) -> None:
    full = float(sum(key.points(ex) for ex in key.chapter_exercises(CHAPTER)))
    totals = course["totals"]
    assert totals["alice_correct"] == full
    assert totals["bob_empty"] == 0
    assert totals["carol_edited_check"] == 0  # the key decides, whatever the edited check accepted
    assert totals["dave_deleted_check"] == 0  # nbgrader re-adds the check; without a record it scores 0
    assert totals["erin_own_run"] == key.points("04.1")  # 2 read off her own table
    assert totals["frank_other_run"] == 0  # the same literal against a run where 4 was best
    assert totals["gina_helper"] == 0  # the helper the exercise rules out


def test_autograded_cells_say_why(course: dict[str, Any]) -> None:
    graded = course["graded"]
    assert _points(graded["erin_own_run"], "04.1") == "1"
    assert "not quite" in _points(graded["frank_other_run"], "04.1")
    assert "rules out" in _points(graded["gina_helper"], "04.1")
    assert "no recorded check" in _points(graded["dave_deleted_check"], "04.1")
    assert "not answered" in _points(graded["bob_empty"], "04.3")


def test_nothing_is_executed_when_grading(course: dict[str, Any]) -> None:
    """A measured answer is graded against the student's run: the autograded notebook keeps their outputs."""
    nb = course["graded"]["erin_own_run"]
    answer = next(c for c in nb.cells if _grade_id(c) == "answer_04_1")
    assert "answer = 2" in answer.source
    assert not any(c.get("outputs") for c in nb.cells if c.cell_type == "code" and not _grade_id(c))


def test_the_exercise_table_has_one_row_per_student_and_exercise(course: dict[str, Any]) -> None:
    table = course["table"]
    assert list(table[0]) == grade.FIELDS
    exercises = sorted({ex[:4] for ex in key.chapter_exercises(CHAPTER)})
    assert len(table) == len(course["totals"]) * len(exercises)
    rows = {(r["student"], r["exercise"]): r for r in table}
    assert rows[("erin_own_run", "04.1")]["points"] == "1" and "own run" in rows[("erin_own_run", "04.1")]["feedback"]
    assert rows[("frank_other_run", "04.1")]["points"] == "0"
    assert "not quite" in rows[("frank_other_run", "04.1")]["feedback"]
    for student, total in course["totals"].items():
        assert sum(float(r["points"]) for r in table if r["student"] == student) == total


def test_every_chapter_releases_through_nbgrader(tmp_path: Path) -> None:
    """nbgrader's generate_assignment takes every chapter: one locked check per exercise, the key's points,
    no answer left."""
    written = with_nbgrader.make_course(tmp_path)
    assert [p.name for p in written] == [p.name for p in release.chapter_notebooks()]
    for source in written:
        _nbgrader(tmp_path, "generate_assignment", source.parent.name)
        nb = nbformat.read(tmp_path / "release" / source.parent.name / source.name, as_version=4)
        assert release.leaks(nb) == [], source.name
        assert "BEGIN SOLUTION" not in "".join(c.source for c in nb.cells), source.name
        ids = key.chapter_exercises(release.chapter_of(source) or "")
        checks = {_grade_id(c): c.metadata["nbgrader"] for c in nb.cells if _grade_id(c).startswith("check_")}
        assert set(checks) == {f"check_{ex[:4].replace('.', '_')}" for ex in ids}, source.name
        assert sum(m["points"] for m in checks.values()) == sum(key.points(ex) for ex in ids), source.name
        assert all(m["locked"] for m in checks.values()), source.name
