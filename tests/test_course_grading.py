"""The course kit: the student release holds no answers; the grader gives the right points.

Grading executes nothing, so these tests are fast: each synthetic submission holds only a chapter's
exercise cells (taken from the release, so they follow the notebooks) after one setup cell of stand-ins
for the figures a run measures. The cells run in-process (``exec`` plus IPython's display formatter,
as a kernel shows a cell's last value); one test runs a submission in a real kernel (nbclient).
"""

from __future__ import annotations

import ast
import re
import time
from pathlib import Path
from typing import Any

import nbformat
import pytest

from course import grade, key, release
from helpers.ui import exercises

ROOT = Path(__file__).resolve().parents[1]
CHAPTERS = [release.chapter_of(p) for p in release.chapter_notebooks()]

# The figures of one student's run, as the chapters' objects expose them (stand-ins, never shown to a reader).
SETUP = """
import functools
from types import SimpleNamespace
import torch
from helpers.core import device
from helpers.chapters.ch05 import prefetch  # 05.3's check, as chapter 05 imports it
from helpers.pipeline import data
from helpers.ui import codecells, exercises

RUN = {run!r}
warm = SimpleNamespace(times_s=[0.010, 0.002, 0.003, 0.0021], median_s=0.00255)
phase_s = {{"load": 0.004, "collate": 0.001, "h2d": 0.0005, "forward": 0.002, "backward": 0.005, "optimizer": 0.001}}
regimes = {{"width 2": SimpleNamespace(prediction=SimpleNamespace(
    stage_times={{"data (CPU)": 0.005, "copy (link)": 0.0005, "compute (device)": 0.001}},
    bottleneck="data (CPU)"))}}
fits = {{"H2D pinned": SimpleNamespace(latency_s=1e-5, bandwidth_Bps=2e10, predict_s=lambda n: 1e-5 + n / 2e10)}}
FIT = fits["H2D pinned"]  # chapter 02's exercise cell sets it again, as the chapter does
host = SimpleNamespace(label="host memcpy")
sweeps = {{("h2d", "pinned"): None}}
ch02 = SimpleNamespace(fit_check=lambda sw, fit: SimpleNamespace(verdict=lambda: "the model fits its points"))
rows = [SimpleNamespace(pin_memory=False, pin_active=False), SimpleNamespace(pin_memory=True, pin_active=False)]

class Sweep:
    workers = [0, 1, 2, 4]
    items_per_s = RUN["items_per_s"]
    best_workers = workers[items_per_s.index(max(items_per_s))]
    def rule_of_thumb(self):
        return 1
    def at(self, w):
        return SimpleNamespace(items_per_s=self.items_per_s[self.workers.index(w)])

sweep, CORES, DUP_BAD = Sweep(), 2, 0.97

DEVICE = torch.device("cpu")
exec("\\n\\n".join(codecells.pipeline_cells("05")))  # chapter 05's side_stream, copy_on, Prefetcher: 05.3's check

cmp = SimpleNamespace(bytes={{"jpeg": 1000.0, "uint8": 3000.0, "float32": 12000.0}})
diagnoses = {{"compute-bound": SimpleNamespace(verdict="compute-bound")}}

class Waterfall:
    def __init__(self, names, gains, best, stages):
        self.results = [SimpleNamespace(name=n, stages=stages, slowest_stage=min(stages, key=stages.get))
                        for n in names]
        self._gains, self._best = gains, best
    def gains(self):
        return self._gains
    def best_steps(self):
        return self._best
    def no_effect(self):
        return [False] * len(self.results)

STEPS = ["baseline", "pinned", "workers", "persistent", "uint8", "prefetcher"]
wf = {{"data-bound": Waterfall(STEPS, [1.0, 1.0, 1.8, 1.1, 1.2, 1.0], [RUN["best_step"]],
                              {{"loader": 900.0, "copy": 9000.0, "compute": 4000.0}}),
      "compute-bound": Waterfall(STEPS, [1.0] * 6, ["pinned"], {{"loader": 3000.0, "copy": 9000.0, "compute": 500.0}})}}
"""
RUN_A = {"items_per_s": [1000.0, 900.0, 1500.0, 1700.0], "best_step": "workers"}  # best num_workers: 4
RUN_B = {"items_per_s": [1000.0, 900.0, 1800.0, 1700.0], "best_step": "uint8"}  # best num_workers: 2


def _exercise_cells(chapter: str, tmp: Path) -> list[nbformat.NotebookNode]:
    """The release's exercise section of ``chapter``: every cell from '## Exercises' to '## Summary'."""
    (path,) = release.chapter_notebooks([chapter])
    nb = release.release_notebook(path)
    start = next(i for i, c in enumerate(nb.cells) if c.cell_type == "markdown" and "## Exercises" in c.source)
    end = next(i for i, c in enumerate(nb.cells) if c.cell_type == "markdown" and c.source.startswith("## Summary"))
    return [c for c in nb.cells[start:end] if c.cell_type == "markdown" or release.CHECK_CALL.search(c.source)]


def _answer(cell_src: str, answers: dict[str, str]) -> str:
    """The cell with its ``answer = None`` lines replaced (answers: exercise id or part id -> code)."""
    m = release.CHECK_CALL.search(cell_src)
    assert m, cell_src
    ex = m.group(1)
    out = []
    for line in cell_src.splitlines():
        a = re.match(r"answer(_[ab])? = None", line)
        if a:
            part = ex + (a.group(1)[1:] if a.group(1) else "")
            if part in answers:
                code = answers[part]
                if a.group(1):
                    code = code.replace("answer =", f"answer{a.group(1)} =")
                out.append(code)
                continue
        out.append(line)
    return "\n".join(out)


def _run(src: str, ns: dict[str, Any]) -> list[Any]:
    """Run one cell as a kernel would: its last expression's value becomes an execute_result."""
    from IPython.core.interactiveshell import InteractiveShell

    tree = ast.parse(src)
    last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
    exec(compile(tree, "<cell>", "exec"), ns)
    if last is None:
        return []
    value = eval(compile(ast.Expression(last.value), "<cell>", "eval"), ns)
    if value is None:
        return []
    data, _ = InteractiveShell.instance().display_formatter.format(value)
    return [nbformat.v4.new_output("execute_result", data=data, execution_count=1)]


def _submission(
    chapter: str, run: dict[str, Any], answers: dict[str, str], tmp: Path, edit=None, before: str = ""
) -> Any:
    """A synthetic, executed submission of ``chapter``: setup stand-ins, then its exercise cells.

    ``before``: the code of one more cell run before the exercises, as a chapter cell of section 4 would be.
    """
    nb = nbformat.v4.new_notebook()
    ns: dict[str, Any] = {"__name__": "__main__"}
    for src in [SETUP.format(run=run)] + ([before] if before else []):
        cell = nbformat.v4.new_code_cell(src)
        cell.outputs = _run(cell.source, ns)
        nb.cells.append(cell)
    for cell in _exercise_cells(chapter, tmp):
        if cell.cell_type == "code":
            cell.source = _answer(cell.source, answers)
            if edit:
                cell.source = edit(cell.source)
            cell.outputs = _run(cell.source, ns)
        nb.cells.append(cell)
    return nb


def _solutions() -> dict[str, str]:
    """The key's own reference solutions: a submission of them must earn every point."""
    return {ex: e.solution for ex, e in key.ANSWERS.items()}


def _chapter_name(chapter: str) -> str:
    return release.chapter_notebooks([chapter])[0].name


def _write(folder: Path, student: str, chapter: str, nb: Any) -> None:
    (folder / student).mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, folder / student / _chapter_name(chapter))


def _tamper(src: str) -> str:
    src = re.sub(r'(exercises\.check\("[\d.]+", answer,)', r"\1 expected=lambda a: True,", src)
    return re.sub(r"(Part\(answer_[ab],)", r"\1 expected=lambda a: True,", src)


def _delete_check(src: str) -> str:
    """The exercise cell with its check call removed (answer lines kept)."""
    keep = []
    for line in src.splitlines():
        if line.startswith("exercises.check"):
            break
        keep.append(line)
    return "\n".join(keep)


WRONG = {ex: "answer = 999" for ex in key.ANSWERS}


def _prelude(exercise: str) -> str:
    """What ``exercise``'s cell runs before ``answer = None`` (e.g. 05.3's LatePrefetcher, 02.1's FIT)."""
    (path,) = release.chapter_notebooks([exercise[:2]])
    nb = nbformat.read(path, as_version=4)
    src = next(c.source for c in nb.cells for m in [release.CHECK_CALL.search(c.source)] if m and m[1] == exercise[:4])
    return src[: src.index("answer")]


@pytest.fixture(scope="module")
def graded(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[tuple[str, str], grade.Row], float]:
    tmp = tmp_path_factory.mktemp("submissions")
    folder = tmp / "in"
    for ch in CHAPTERS:
        assert ch is not None
        _write(folder, "alice_correct", ch, _submission(ch, RUN_A, _solutions(), tmp))
        _write(folder, "bob_empty", ch, _submission(ch, RUN_A, {}, tmp))
        _write(folder, "carol_edited_check", ch, _submission(ch, RUN_A, WRONG, tmp, edit=_tamper))
        _write(folder, "dave_deleted_check", ch, _submission(ch, RUN_A, WRONG, tmp, edit=_delete_check))
    measured = {
        "04.1": "answer = 2",
        "04.2": "answer = 900 / 1800",  # the rule's items/s over the best, read off her table
        "06.3": 'answer = "uint8"',
        "00.1": "s = sorted(warm.times_s)\nanswer = (s[1] + s[2]) / 2 * 1e3",
    }
    _write(folder, "erin_own_run", "04", _submission("04", RUN_B, measured, tmp))  # her run: 2 workers best
    _write(folder, "erin_own_run", "06", _submission("06", RUN_B, measured, tmp))
    _write(folder, "frank_other_run", "04", _submission("04", RUN_A, measured, tmp))  # his run: 4 was best
    copied = {"00.1": "import statistics\nanswer = statistics.median(warm.times_s) * 1e3", "00.3": 'answer = "b)"'}
    _write(folder, "gina_copied", "00", _submission("00", RUN_A, copied, tmp))
    t0 = time.perf_counter()
    rows = grade.grade_folder(folder)
    elapsed = time.perf_counter() - t0
    grade.write_csv(rows, tmp / "grades.csv")
    assert (tmp / "grades.csv").read_text().splitlines()[0] == ",".join(grade.FIELDS)
    print(grade.table(rows))
    print(f"graded {len(rows)} rows from {len(list(folder.rglob('*.ipynb')))} notebooks in {elapsed:.2f} s")
    return {(r.student, r.exercise): r for r in rows}, elapsed


def _graded_ids() -> list[str]:
    return [ex for ch in CHAPTERS for ex in key.chapter_exercises(ch or "")]


def test_every_chapter_exercise_is_in_the_key() -> None:
    for path in release.chapter_notebooks():
        nb = nbformat.read(path, as_version=4)
        ids = {
            m.group(1) for c in nb.cells if c.cell_type == "code" for m in [release.CHECK_CALL.search(c.source)] if m
        }
        assert ids == {ex[:4] for ex in key.chapter_exercises(release.chapter_of(path) or "")}, path.name


def test_student_release_of_every_chapter_gives_no_answer_away(tmp_path: Path) -> None:
    written = release.make_release(tmp_path)
    assert [p.name for p in written] == [p.name for p in release.chapter_notebooks()]
    solutions, explanations = release._leak_needles()
    assert len(solutions) > 20 and len(explanations) > 25  # the needles are real
    for path in written:
        nb = nbformat.read(path, as_version=4)
        assert release.leaks(nb) == [], path.name
        assert all("expected=" not in c.source for c in nb.cells if c.cell_type == "code"), path.name
        assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code")
    assert not (tmp_path / "course").exists() and (tmp_path / "README.md").is_file()


def test_release_refuses_a_chapter_with_an_answer_in_it(tmp_path: Path) -> None:
    old = nbformat.v4.new_notebook()
    old.cells = [nbformat.v4.new_code_cell('answer = None\n\nexercises.check("04.3", answer, expected=3 * 4)')]
    assert any("expected=" in f for f in release.leaks(old))
    old.cells = [nbformat.v4.new_code_cell("print(1)\nanswer = 1700 / min(2400, 9000, 2000)")]
    assert release.leaks(old)


def test_solutions_are_generated_for_every_exercise() -> None:
    text = release.solutions_markdown()
    for ex, e in key.ANSWERS.items():
        if ex.startswith("99."):
            continue
        assert f"*Solution {ex}*" in text and e.solution in text


def test_all_correct_earns_every_point(graded) -> None:
    rows, _ = graded
    for ex in _graded_ids():
        r = rows[("alice_correct", ex)]
        assert r.points == key.points(ex) and r.feedback.startswith("correct"), (ex, r.feedback)


def test_all_empty_earns_nothing(graded) -> None:
    rows, _ = graded
    for ex in _graded_ids():
        r = rows[("bob_empty", ex)]
        assert r.points == 0 and r.feedback == "not answered", (ex, r.feedback)


def test_an_edited_check_cannot_raise_the_score(graded) -> None:
    rows, _ = graded
    for ex in _graded_ids():
        r = rows[("carol_edited_check", ex)]
        assert r.points == 0 and "expected= was edited" in r.feedback, (ex, r.feedback)


def test_a_deleted_check_scores_nothing(graded) -> None:
    rows, _ = graded
    for ex in _graded_ids():
        r = rows[("dave_deleted_check", ex)]
        assert r.points == 0 and "no recorded check" in r.feedback, (ex, r.feedback)


def test_measured_answers_are_graded_against_the_students_own_run(graded) -> None:
    rows, _ = graded
    # Erin hard-codes what her own run showed: 2 workers best, uint8 the largest gain. Right for her run...
    for ex in ("04.1", "04.2", "06.3", "00.1"):
        if ("erin_own_run", ex) in rows:
            assert rows[("erin_own_run", ex)].points == key.points(ex), rows[("erin_own_run", ex)].feedback
    # ... and wrong for Frank, whose own run found 4 workers best: never graded against anyone else's run
    assert rows[("frank_other_run", "04.1")].points == 0
    assert rows[("frank_other_run", "04.2")].points == 0  # his table: 900 / 1700, not her 900 / 1800


def test_a_copied_forbidden_call_and_a_choice_with_a_parenthesis(graded) -> None:
    rows, _ = graded
    assert rows[("gina_copied", "00.1")].points == 0 and "statistics" in rows[("gina_copied", "00.1")].feedback
    assert rows[("gina_copied", "00.3")].points == 1  # "b)" is the choice b


def test_grading_is_fast(graded) -> None:
    _, elapsed = graded
    assert elapsed < 60  # reads JSON only; no notebook runs (a loose bound: correctness, not speed)


def test_grade_command_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert grade.main([str(tmp_path / "missing")]) == 2
    assert "not a folder" in capsys.readouterr().err
    _write(tmp_path / "subs", "zoe", "07", _submission("07", RUN_A, _solutions(), tmp_path))
    assert grade.main([str(tmp_path / "subs"), "--out", str(tmp_path / "g.csv")]) == 0
    out = capsys.readouterr().out
    assert "zoe" in out and "totals: zoe 5/5" in out
    assert (tmp_path / "g.csv").read_text().count("\n") == 6


def test_self_check_never_prints_the_expected_value(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WORKBOOK_GRADE", raising=False)
    ns: dict[str, Any] = {}
    exec(SETUP.format(run=RUN_A), ns)
    exec("r = exercises.check('04.1', 3)\ns = exercises.check('05.2', 40.0)\nt = exercises.check('00.2', 1.3)", ns)
    assert ns["r"].status == "wrong" and "4" not in ns["r"].message.replace("04.1", "")
    assert "36.75" not in ns["s"].message and "too high" in ns["s"].message
    assert ns["t"].status == "wrong"  # 1.3 ms is 4 % off 1.248: the old 5 % tolerance passed it
    exec("u = exercises.check('04.1', 4)", ns)
    assert ns["u"].correct and ns["u"].record["facts"]["items_per_s"] == RUN_A["items_per_s"]
    assert "max(zip(sweep.items_per_s, sweep.workers))" in str(exercises.show_solution("04.1"))


def test_without_the_key_a_check_records_the_answer(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(exercises.KEY_ENV, "none")
    monkeypatch.setenv("WORKBOOK_GRADE", "1")  # a recorded answer is no failure
    r = exercises.check("04.3", 11)
    assert r.status == "recorded" and "recorded" in r.message and r.record["answer"] == 11
    assert "no solutions" in str(exercises.show_solution("04.3"))


def test_answers_round_trip_through_the_record() -> None:
    for value in (None, True, 3, 2.5, "b", {("pinned", "side")}, [1, 2], (1, "a")):
        assert grade.decode_answer(exercises.encode_answer(value)) == value
    assert isinstance(grade.decode_answer(exercises.encode_answer(object)), str)


@pytest.mark.timeout(180)
def test_a_submission_run_in_a_real_kernel_is_graded(tmp_path: Path) -> None:
    nbclient = pytest.importorskip("nbclient")
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.cells.append(nbformat.v4.new_code_cell(SETUP.format(run=RUN_B)))
    for cell in _exercise_cells("04", tmp_path):
        if cell.cell_type == "code":
            cell.source = _answer(cell.source, {"04.1": "answer = 2", "04.3": "answer = 3 * 4", "04.5": "answer = 0.5"})
        nb.cells.append(cell)
    nbclient.NotebookClient(
        nb, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}}
    ).execute()
    _write(tmp_path / "subs", "kim", "04", nb)
    rows = {r.exercise: r for r in grade.grade_folder(tmp_path / "subs")}
    assert rows["04.1"].points == 1 and rows["04.3"].points == 1
    assert rows["04.5"].points == 0 and rows["04.2"].feedback == "not answered"


# One typical wrong answer per exercise (a lazy, copied or unit mistake), as code run in the stand-in run.
WRONG_ANSWERS = {
    "00.1": "sum(warm.times_s) / len(warm.times_s) * 1e3",  # the mean, not the median
    "00.2": "128 * 3 * 160 * 160 * 4 / (device.pcie_bandwidth_gbps(4, 16) * 1e9)",  # seconds, not ms
    "00.3": '"a"',
    "01.1": '"forward"',
    "01.2": "sum(phase_s.values()) * 1e3",  # the serial time, not the slowest stage
    "01.3": '"a"',  # a faster GPU: the width 2 run is data-bound
    "02.1": "(FIT.latency_s + 48e6 / FIT.bandwidth_Bps) * 1e3",  # MB, not MiB
    "02.2": "128 * 3 * 160 * 160 * 4",  # all the float32 bytes, not the extra ones
    "02.3a": "True",
    "02.3b": "8 / 3",
    "02.4": '"a"',
    "02.5": '"c"',
    "03.1": '"pin_memory"',
    "03.2": "True",  # what the flag asked for, not what this run got
    "03.3": '"pin thread"',
    "03.4": '"a"',
    "04.1": "sweep.rule_of_thumb()",
    "04.2": "True",
    "04.3": "3",
    "04.4": "1000",  # as if every worker drew its own values
    "04.5": "1320 / 1600",  # against cores x one process, not the measured ceiling
    "05.1": '{("pinned", "default")}',
    "05.2": "256 * 3 * 224 * 224 * 4 / 2**20",  # float32
    "05.3": "type('PassThrough', (), {})",  # a prefetcher that never waits: the checker refuses it
    "05.4": 'cmp.bytes["float32"] / cmp.bytes["jpeg"]',  # against float32, not what the pipeline sends
    "06.1": '"a"',  # more workers for a compute-bound job
    "06.2": "1700 / 2400",  # against the loader, not the slowest stage
    "06.3": '"pinned"',
    "06.4": 'min(wf["data-bound"].results[0].stages.values())',  # the loader's own rate: nothing removed
    "07.1": "1000 // 3",
    "07.2": "0",
    "07.3": '"C"',
    "07.4": "50_000 // 8 // 64",
    "07.5": "4 * 6",
}


@pytest.mark.parametrize("exercise", [ex for ex in key.ANSWERS if not ex.startswith("99.")])
def test_each_exercise_refuses_a_typical_wrong_answer_and_accepts_its_solution(exercise: str) -> None:
    ns: dict[str, Any] = {}
    exec(SETUP.format(run=RUN_A), ns)
    exec(_prelude(exercise), ns)
    wrong = eval(WRONG_ANSWERS[exercise], ns)
    facts = exercises.RUN_FACTS[exercise](ns, wrong) if exercise in exercises.RUN_FACTS else {}
    assert not key.grade(exercise, wrong, facts)[0], f"{exercise}: {WRONG_ANSWERS[exercise]} passed"
    solution = key.entry(exercise).solution.replace(f"answer_{exercise[-1]} =", "answer =")
    exec(solution, ns)
    facts = exercises.RUN_FACTS[exercise](ns, ns["answer"]) if exercise in exercises.RUN_FACTS else {}
    assert key.grade(exercise, ns["answer"], facts)[0], f"{exercise}: the key's own solution fails"
