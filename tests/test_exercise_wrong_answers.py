"""Every exercise asks for thought, not transcription (#26.4).

A lazy answer to each exercise that used to pass: the helper attribute or function the chapter just used
(``sweep.best_workers``, ``predict_step_time``, ``rank_share``), the figure the chapter printed (``DUP_BAD``,
the doctor's verdict), or the class the chapter already wrote (``answer = Prefetcher``). Each is handed in as a
student would, in the exercise's own cell of the release, and graded by ``course.grade``: it scores 0, and the
key's own solution, handed in the same way, scores full points. Every other exercise's typical wrong answer (a
lazy, copied or unit mistake) is refused in tests/test_course_grading.py (``WRONG_ANSWERS``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from test_course_grading import RUN_A, SETUP, _solutions, _submission, _write

from course import grade, key
from helpers.ui import exercises

LAZY = {
    "00.1": "answer = warm.median_s * 1e3",  # the timing helper's own median
    "01.2": "answer = anatomy.predict_step_time(phase_s).overlapped * 1e3",  # the prediction section 4 printed
    "01.3": 'answer = regimes["width 2"].prediction.bottleneck',  # the bottleneck section 5 printed
    "02.1": "answer = FIT.predict_s(48 * 2**20) * 1e3",  # the fit's own prediction
    "02.2": 'answer = model.images_nbytes(128, 3, 160, 160, "float32") - '
    'model.images_nbytes(128, 3, 160, 160, "uint8")',
    "02.3a": "answer = model.pinning_pays(1, 8e-3, 5e-3, 3e-3)",
    "02.3b": "answer = model.break_even_uses(8e-3, 5e-3, 3e-3)",
    "04.1": "answer = sweep.best_workers",  # the sweep's own answer
    "04.2": "answer = sweep.best_workers == sweep.rule_of_thumb()",
    "04.4": "answer = DUP_BAD",  # the share the pitfall printed
    "05.3": "answer = Prefetcher",  # the class section 3 wrote
    "05.4": 'answer = cmp.bytes["float32"] / cmp.bytes["jpeg"]',  # the division the old hint spelled out
    "06.1": 'answer = diagnoses["compute-bound"].verdict',  # the verdict the doctor printed
    "06.2": "answer = capstone.pipeline_efficiency(1700, {'loader': 2400, 'copy': 9000, 'compute': 2000}).value",
    "06.3": 'answer = wf["data-bound"].best_steps()[0]',  # the waterfall's own answer
    "06.4": 'answer = wf["compute-bound"].results[0].slowest_stage',  # the stage the chapter printed
    "07.1": "answer = distributed.rank_share(1000, 3).per_rank",  # the helper the chapter just called
    "07.2": "answer = distributed.rank_share(1000, 3, drop_last=True).dropped",
    "07.4": "answer = distributed.batches_per_rank(50_000, 8, 64)",
}
IMPORTS = (
    "from helpers.chapters.ch02 import model\n"
    "from helpers.chapters.ch01 import anatomy\n"
    "from helpers.chapters.ch06 import capstone\n"
    "from helpers.chapters.ch07 import distributed\n"
    "DUP_BAD = 1.0\n"  # what chapter 04's pitfall (a) prints
)
CHAPTERS = sorted({ex[:2] for ex in LAZY})


def _with_imports(answers: dict[str, str]) -> dict[str, str]:
    return {ex: IMPORTS + code for ex, code in answers.items()}


@pytest.fixture(scope="module")
def graded(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], grade.Row]:
    folder = tmp_path_factory.mktemp("lazy") / "in"
    tmp = folder.parent
    for ch in CHAPTERS:
        _write(folder, "lazy", ch, _submission(ch, RUN_A, _with_imports(LAZY), tmp))
        _write(folder, "key", ch, _submission(ch, RUN_A, _with_imports(_solutions()), tmp))
    return {(r.student, r.exercise): r for r in grade.grade_folder(folder)}


@pytest.mark.parametrize("exercise", sorted(LAZY))
def test_a_lazy_answer_scores_nothing_and_the_keys_solution_scores_full(graded, exercise: str) -> None:
    lazy, right = graded[("lazy", exercise)], graded[("key", exercise)]
    assert lazy.points == 0, f"{exercise}: {LAZY[exercise]!r} earned {lazy.points} ({lazy.feedback})"
    assert right.points == key.points(exercise) > 0 or exercise.startswith("99."), (exercise, right.feedback)


# 01.2 answered from the prediction chapter 01's own section 4 cell computed (`pred = predict_step_time(phase_s)`,
# in another cell): each hands the helper's answer over, right in value, and scores 0.
FROM_THE_PREDICTION = {
    "overlapped": "answer = 1 - pred.overlapped / pred.serial",
    "speedup_bound": "answer = 1 - 1 / pred.speedup_bound()",
    "serial": 'slowest = max(phase_s["load"] + phase_s["collate"], phase_s["h2d"],\n'
    '              phase_s["forward"] + phase_s["backward"] + phase_s["optimizer"])\n'
    "answer = 1 - slowest / pred.serial",  # its own grouping, but the helper's serial time
    "stage_times": "st = pred.stage_times\nanswer = 1 - max(st.values()) / sum(st.values())",
    "getattr": 'answer = 1 - getattr(pred, "overlapped") / getattr(pred, "serial")',
}
CHAPTER_01_SECTION_4 = "from helpers.chapters.ch01 import anatomy\npred = anatomy.predict_step_time(phase_s)"


@pytest.fixture(scope="module")
def from_the_prediction(tmp_path_factory: pytest.TempPathFactory) -> dict[str, grade.Row]:
    folder = tmp_path_factory.mktemp("pred") / "in"
    for name, code in FROM_THE_PREDICTION.items():
        nb = _submission("01", RUN_A, {"01.2": code}, folder.parent, before=CHAPTER_01_SECTION_4)
        _write(folder, name, "01", nb)
    nb = _submission("01", RUN_A, _solutions(), folder.parent, before=CHAPTER_01_SECTION_4)
    _write(folder, "key", "01", nb)
    return {r.student: r for r in grade.grade_folder(folder) if r.exercise == "01.2"}


@pytest.mark.parametrize("name", sorted(FROM_THE_PREDICTION))
def test_01_2_answered_from_the_chapters_prediction_scores_nothing(from_the_prediction, name: str) -> None:
    row = from_the_prediction[name]
    assert row.points == 0 and "which the exercise rules out" in row.feedback, (name, row.feedback)
    assert from_the_prediction["key"].points == 1, from_the_prediction["key"].feedback  # same cells, own grouping


def test_01_2_from_the_prediction_is_right_in_value_so_the_rule_is_what_refuses_it() -> None:
    ns: dict[str, Any] = {}
    exec(SETUP.format(run=RUN_A) + "\n" + CHAPTER_01_SECTION_4, ns)
    facts = exercises.RUN_FACTS["01.2"](ns, None)
    for name, code in FROM_THE_PREDICTION.items():
        exec(code, ns)
        assert key.grade("01.2", ns["answer"], facts)[0], name
        assert key.forbidden_use("01.2", code), name
    assert key.forbidden_use("01.2", key.entry("01.2").solution) is None  # the key's own solution uses none


def test_every_forbidden_name_of_the_key_is_caught_as_a_student_writes_it() -> None:
    for ex, e in key.ANSWERS.items():
        for name in e.forbid:
            bare = name.lstrip(".")
            written = f"answer = x.{bare}" if name.startswith(".") else f"answer = {bare}.thing"
            assert key.forbidden_use(ex, written) == name, (ex, name)
            assert key.forbidden_use(ex, f"answer = None  # not {written}") is None  # a comment uses nothing
    assert key.forbidden_use("04.1", 'answer = getattr(sweep, "best_workers")') == ".best_workers"
    assert key.forbidden_use("04.1", "best = max(zip(sweep.items_per_s, sweep.workers))[1]") is None
    assert key.forbidden_use("05.3", "class LatePrefetcher(Prefetcher): pass") == "Prefetcher"
    assert key.forbidden_use("05.3", "class LatePrefetcher:\n    pass\nanswer = LatePrefetcher") is None


def test_the_self_check_in_a_kernel_refuses_a_forbidden_helper_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """In a kernel the cell's source is known (``_ih``): the reader hears at once what the grader will say."""
    monkeypatch.delenv("WORKBOOK_GRADE", raising=False)
    ns: dict[str, Any] = {}
    exec(SETUP.format(run=RUN_A), ns)
    ns["_ih"] = ["", 'answer = sweep.best_workers\nexercises.check("04.1", answer)']
    exec('r = exercises.check("04.1", sweep.best_workers)', ns)
    assert ns["r"].status == "wrong" and "best_workers" in ns["r"].message
    ns["_ih"].append('answer = 4\nexercises.check("04.1", answer)')
    exec('r = exercises.check("04.1", 4)', ns)
    assert ns["r"].correct  # read off the table: right
    exec(CHAPTER_01_SECTION_4, ns)
    ns["_ih"].append('answer = 1 - pred.overlapped / pred.serial\nexercises.check("01.2", answer)')
    exec('r = exercises.check("01.2", 1 - pred.overlapped / pred.serial)', ns)
    assert ns["r"].status == "wrong" and ".overlapped" in ns["r"].message


def test_a_fraction_off_by_a_few_percent_gets_no_units_hint() -> None:
    ok, why = exercises.compare(0.5, 900 / 1700, rel_tol=0.02)
    assert not ok and "units" not in why  # 5.5 % off is not the MiB/MB factor (4.9 %)
    assert "MiB or MB" in exercises.compare(48e6 / 2**20, 48.0, rel_tol=1e-3)[1]


def test_late_prefetcher_fails_as_handed_out_and_its_fix_passes(tmp_path: Path) -> None:
    """05.3 with the chapter's own pipeline cells and the real checker (stream test doubles, on a CPU)."""
    ns: dict[str, Any] = {}
    exec(SETUP.format(run=RUN_A), ns)
    nb = _submission("05", RUN_A, {"05.3": "answer = LatePrefetcher"}, tmp_path)
    rec = grade.records(nb)["05.3"][0]
    assert rec["facts"]["name"] == "LatePrefetcher" and rec["facts"]["checker_correct"] is False
    assert "requested only after" in rec["facts"]["checker_message"]  # no prefetching
    assert "record_stream" in rec["facts"]["checker_message"]
    _write(tmp_path / "in", "late", "05", nb)
    row = next(r for r in grade.grade_folder(tmp_path / "in") if r.exercise == "05.3")
    assert row.points == 0


# A unit mistake for every exercise answered with a quantity: refused, and where the factor is a unit's, said so.
UNIT_MISTAKES = {
    "00.1": ("s = sorted(warm.times_s)\nanswer = (s[1] + s[2]) / 2", "units"),  # seconds, not ms
    "00.2": ("answer = 128 * 3 * 160 * 160 * 4 / (device.pcie_bandwidth_gbps(4, 16) * 2**30) * 1e3", ""),  # GiB/s
    "01.2": ("answer = 100 * (1 - 0.008 / 0.0135)", ""),  # a percentage, not a fraction
    "02.1": ("answer = FIT.latency_s + 48 * 2**20 / FIT.bandwidth_Bps", "units"),  # seconds, not ms
    "02.2": ("answer = 128 * 3 * 160 * 160 * 3 * 8", ""),  # bits, not bytes
    "04.2": ("answer = 100 * 900 / 1700", ""),  # a percentage
    "05.2": ("answer = 256 * 3 * 224 * 224 / 1e6", "MiB or MB"),  # MB, not MiB
    "05.4": ('answer = cmp.bytes["jpeg"] / cmp.bytes["uint8"]', ""),  # upside down
    "06.2": ("answer = 100 * 1700 / 2000", ""),  # a percentage
    "06.4": ("answer = 1 / 4000", ""),  # seconds per image, not images/s
}


@pytest.mark.parametrize("exercise", sorted(UNIT_MISTAKES))
def test_a_unit_mistake_is_refused(exercise: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WORKBOOK_GRADE", raising=False)
    code, said = UNIT_MISTAKES[exercise]
    ns: dict[str, Any] = {}
    exec(SETUP.format(run=RUN_A), ns)
    exec(code + f'\nr = exercises.check("{exercise}", answer)', ns)
    assert ns["r"].status == "wrong", (exercise, ns["r"].message)
    assert said in ns["r"].message, ns["r"].message
