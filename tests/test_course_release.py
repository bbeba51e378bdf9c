"""The student release refuses an answer left in a chapter: in an exercise cell's ``answer = ...`` line, in its
check, or the key's explanation copied into any cell, markdown included (``python -m course.release``)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import nbformat
import pytest

from course import key, release


def _exercise_cell(nb: Any, exercise: str) -> Any:
    return next(
        c
        for c in nb.cells
        if c.cell_type == "code" and (m := release.CHECK_CALL.search(c.source)) and m.group(1) == exercise
    )


def test_every_chapters_exercise_cells_hand_out_answer_none() -> None:
    for path in release.chapter_notebooks():
        nb = nbformat.read(path, as_version=4)
        for cell in nb.cells:
            if cell.cell_type == "code" and release.CHECK_CALL.search(cell.source):
                lines = release.ANSWER_LINE.findall(release._code_without_comments(cell.source))
                assert lines and all(value.strip() == "None" for _, value in lines), (path.name, cell.source[:200])
        assert release.leaks(nb) == [], path.name


@pytest.fixture
def chapter_04(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A copy of notebooks/ to spoil (release.NOTEBOOKS points there); returns chapter 04's copy."""
    folder = tmp_path / "notebooks"
    folder.mkdir()
    for path in release.chapter_notebooks():
        shutil.copy(path, folder / path.name)
    monkeypatch.setattr(release, "NOTEBOOKS", folder)
    (path,) = release.chapter_notebooks(["04"])
    return path


def _spoil(path: Path, change: Any) -> None:
    nb = nbformat.read(path, as_version=4)
    change(nb)
    nbformat.write(nb, path)


def _answers_left_in(nb: Any) -> None:
    for exercise, value in (("04.3", "12"), ("04.4", "250")):
        cell = _exercise_cell(nb, exercise)
        cell.source = cell.source.replace("answer = None", f"answer = {value}", 1)


def test_an_answer_value_left_in_an_exercise_cell_is_refused(
    chapter_04: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The reviewer's case: ``answer = 12`` (04.3) and ``answer = 250`` (04.4), too short for a solution line."""
    _spoil(chapter_04, _answers_left_in)
    with pytest.raises(ValueError) as caught:
        release.release_notebook(chapter_04)
    said = str(caught.value)
    assert said.startswith("04_worker_processes.ipynb gives answers away")
    assert "exercise 04.3" in said and "`answer = 12`" in said
    assert "exercise 04.4" in said and "`answer = 250`" in said
    nb = nbformat.read(chapter_04, as_version=4)
    assert f"cell {nb.cells.index(_exercise_cell(nb, '04.3'))} (code, exercise 04.3)" in said
    out = tmp_path / "release"
    assert release.main(["--out", str(out)]) == 1  # the command fails ...
    assert "04_worker_processes.ipynb" in capsys.readouterr().err
    assert not out.exists()  # ... and hands out nothing, not even the chapters before it


def test_the_keys_explanation_in_a_markdown_cell_is_refused(chapter_04: Path) -> None:
    explanation = key.entry("04.4").explanation
    assert isinstance(explanation, str)
    rewrapped = explanation.replace(" the same ", "\nthe same ", 1)  # re-wrapped, as a markdown copy often is

    def add(nb: Any) -> None:
        nb.cells.insert(3, nbformat.v4.new_markdown_cell("A note for the class:\n\n" + rewrapped))

    _spoil(chapter_04, add)
    with pytest.raises(ValueError, match=r"cell 3 \(markdown\): contains the key's explanation"):
        release.release_notebook(chapter_04)


@pytest.mark.parametrize(
    "code",
    [
        "answer = 3 * 4",  # the key's solution line (it was caught before, too)
        "answer = 12",
        'answer = "b"',
        "answer: int = 12",
        "answer += 12",
        "answer = None\nanswer = 12",
    ],
)
def test_any_answer_line_but_none_in_an_exercise_cell_is_refused(code: str) -> None:
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(f'{code}\n\nexercises.check("04.3", answer, hint="workers x prefetch")')]
    assert any("exercise 04.3" in f and "is an answer" in f for f in release.leaks(nb)), code


def test_a_check_handed_a_value_and_parts_are_refused_too() -> None:
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell('answer = None\nexercises.check("04.3", 12, hint="x")')]
    assert any("the check is handed '12'" in f for f in release.leaks(nb))
    nb.cells = [
        nbformat.v4.new_code_cell(
            "answer_a = None\nanswer_b = 4\n\n"
            'exercises.check_parts(\n    "02.3",\n    a=exercises.Part(answer_a, hint="h"),\n'
            '    b=exercises.Part(answer_b, hint="h"),\n)'
        )
    ]
    assert [f for f in release.leaks(nb) if "is an answer" in f] == [
        "cell 0 (code, exercise 02.3): `answer_b = 4` is an answer; release the cell with `answer_b = None`"
    ]


def test_what_a_question_may_say_is_not_refused() -> None:
    nb = nbformat.v4.new_notebook()
    nb.cells = [
        # 05.3's question names what to hand in; a comment says the form of the answer
        nbformat.v4.new_markdown_cell("Fix it in this cell and hand in `answer = LatePrefetcher`."),
        nbformat.v4.new_code_cell('answer = None  # answer = 12, e.g.\n\nexercises.check("04.3", answer, hint="h")'),
        nbformat.v4.new_code_cell("if answer == 3:\n    pass"),  # a comparison, not an assignment
    ]
    assert release.leaks(nb) == []
    nb.cells.append(nbformat.v4.new_markdown_cell("We wrote `answer = 1320 / 1500` here."))  # a solution line, in text
    assert release.leaks(nb) == ["cell 3 (markdown): contains the key's solution 'answer = 1320 / 1500'"]
