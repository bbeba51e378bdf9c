"""The answer key: every exercise's expected value, points, reference solution and explanation.

One place for the answers (the notebooks hold only the question, ``answer = None`` and the hint).
``helpers.ui.exercises.check`` loads this file to self-check a reader's answer; ``course.grade``
loads it to grade submissions; ``course.release --solutions`` prints the solutions from it.

A measured exercise's expected value is computed from ``facts``: the figures of the reader's own
run, recorded by the check (``helpers.ui.exercises.RUN_FACTS``), never from a re-run.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any, Callable

from helpers.ui.exercises import compare

Facts = dict[str, Any]


@dataclass(frozen=True)
class Answer:
    """One exercise: ``expected(facts)`` is a value or a callable for :func:`helpers.ui.exercises.compare`."""

    expected: Callable[[Facts], Any]
    solution: str
    explanation: str | Callable[[Facts], str] = ""
    points: int = 1
    rel_tol: float = 0.05
    abs_tol: float = 0.0
    measured: bool = False
    forbid: tuple[str, ...] = ()  # names the exercise says not to use (checked by the grader in the cell's code)


def _const(value: Any) -> Callable[[Facts], Any]:
    return lambda facts: value


def _pcie_ms() -> float:
    from helpers.core import device

    return 128 * 3 * 160 * 160 * 4 / (device.pcie_bandwidth_gbps(4, 16) * 1e9) * 1e3


def _phase_ok(facts: Facts) -> Callable[[Any], bool]:
    phase_s = facts["phase_s"]
    top = max(phase_s.values())
    return lambda a: isinstance(a, str) and phase_s.get(a.strip().lower(), -1) >= 0.9 * top


def _overlapped_ms(facts: Facts) -> float:
    from helpers.pipeline import train

    return train.predict_step_time(facts["phase_s"]).overlapped * 1e3


def _bytes_extra() -> int:
    from helpers.pipeline import transfer

    return transfer.images_nbytes(128, 3, 160, 160, "float32") - transfer.images_nbytes(128, 3, 160, 160, "uint8")


def _pinning(part: str) -> Any:
    from helpers.pipeline import transfer

    if part == "a":
        return transfer.pinning_pays(1, 8e-3, 5e-3, 3e-3)
    return transfer.break_even_uses(8e-3, 5e-3, 3e-3)


def _best_workers(facts: Facts) -> int:
    items = facts["items_per_s"]
    return int(facts["workers"][items.index(max(items))])


def _overlapping_cells(a: Any) -> bool | str:
    if not isinstance(a, (set, frozenset, list, tuple)):
        return "answer with a set of (memory, stream) pairs"
    return {tuple(x) for x in a} == {("pinned", "side")}


def _prefetcher_ok(facts: Facts) -> Callable[[Any], bool | str]:
    def ok(candidate: Any) -> bool | str:
        if "checker_correct" not in facts:
            return "hand in your Prefetcher class (answer = Prefetcher) and run the cell"
        return True if facts["checker_correct"] else str(facts.get("checker_message", "the checker refused it"))

    return ok


def _efficiency() -> float:
    from helpers.chapters.ch06 import capstone

    return capstone.pipeline_efficiency(1800, {"loader": 2400, "copy": 9000, "compute": 2000}).value


def _best_step_answers(facts: Facts) -> set[str]:
    from helpers.chapters.ch06 import capstone

    return set().union(*(capstone.step_answers(n) for n in facts["best_steps"]))


def _slowest(facts: Facts) -> str | None:
    known = {k: v for k, v in facts["baseline_stages"].items() if v}
    return min(known, key=lambda k: known[k]) if known else None


def _dist(kind: str) -> int:
    from helpers.chapters.ch07 import distributed

    if kind == "per_rank":
        return int(distributed.rank_share(1000, 3).per_rank)
    if kind == "dropped":
        return int(distributed.rank_share(1000, 3, drop_last=True).dropped)
    return int(distributed.batches_per_rank(50_000, 8, 64))


ANSWERS: dict[str, Answer] = {
    # 00 · Setup and measuring
    "00.1": Answer(
        lambda f: statistics.median(f["times_s"]) * 1e3,
        "s = sorted(warm.times_s); n = len(s)\n"
        "answer = (s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2) * 1e3",
        "the median ignores the slow first call that pulls the mean up.",
        rel_tol=1e-6,
        measured=True,
        forbid=("statistics", "numpy", "np."),
    ),
    "00.2": Answer(
        lambda f: _pcie_ms(),
        "answer = 128 * 3 * 160 * 160 * 4 / (device.pcie_bandwidth_gbps(4, 16) * 1e9) * 1e3",
        "a real copy takes longer: chapter 02 measures how much.",
        rel_tol=0.01,
    ),
    "00.3": Answer(
        _const("b"),
        'answer = "b"',
        "without torch.cuda.synchronize() (or CUDA events) you time the launch, not the work.",
    ),
    # 01 · Baseline pipeline
    "01.1": Answer(
        _phase_ok,
        "answer = max(phase_s, key=phase_s.get)  # the largest phase (within 10 % of it is accepted)",
        lambda f: (
            f"here backward took {f['phase_s']['backward'] / f['phase_s']['forward']:.1f}x the forward "
            "(arithmetic alone would say about 2x); with a thin model or big images, decoding can "
            "outweigh both."
        ),
        measured=True,
    ),
    "01.2": Answer(
        _overlapped_ms,
        'stages = {"data": phase_s["load"] + phase_s["collate"], "copy": phase_s["h2d"],\n'
        '          "compute": phase_s["forward"] + phase_s["backward"] + phase_s["optimizer"]}\n'
        "answer = max(stages.values()) * 1e3",
        "no pipeline can beat its slowest stage; to go faster still, shrink that stage.",
        rel_tol=0.02,
        measured=True,
    ),
    "01.3": Answer(
        lambda f: max(f["stage_times"], key=lambda k: f["stage_times"][k]),
        'answer = regimes["width 2"].prediction.bottleneck  # read off the largest stage of the width 2 run',
        "a data-bound job gains nothing from a faster GPU; it needs faster or overlapped loading (chapter 04), "
        "and a compute-bound one gains nothing from faster loading.",
        measured=True,
    ),
    # 02 · Pageable vs pinned
    "02.1": Answer(
        lambda f: (f["latency_s"] + 48 * 2**20 / f["bandwidth_Bps"]) * 1e3,
        "answer = (FIT.latency_s + 48 * 2**20 / FIT.bandwidth_Bps) * 1e3",
        "for large copies the latency term hardly matters; for 4 KiB it is most of the time.",
        rel_tol=0.01,
        measured=True,
    ),
    "02.2": Answer(
        lambda f: _bytes_extra(),
        "answer = 128 * 3 * 160 * 160 * (4 - 1)",
        "three extra bytes per value: send uint8 and normalise on the GPU.",
        rel_tol=0,
    ),
    "02.3a": Answer(lambda f: _pinning("a"), "answer_a = False  # 8 + 3 ms > 5 ms", "pin once, copy once loses."),
    "02.3b": Answer(
        lambda f: _pinning("b"),
        "answer_b = 8 / (5 - 3)  # 4 copies",
        "a DataLoader reuses cached pinned blocks for every batch, so it is far past break-even.",
    ),
    "02.4": Answer(
        _const("b"), 'answer = "b"', "change one setting at a time; chapter 04 measures workers on their own."
    ),
    "02.5": Answer(
        _const("b"),
        'answer = "b"',
        "it waits until the copy recorded by copied.record(...) has finished reading the buffer.",
    ),
    # 03 · DataLoader pinning
    "03.1": Answer(
        _const({"num_workers", "num workers", "workers"}),
        'answer = "num_workers"',
        "the first loaders use num_workers=8, the second ones the default 0. The slowdown can't be blamed on "
        "pinning when the workers were dropped at the same time. Change one knob at a time.",
    ),
    "03.2": Answer(
        lambda f: f["pinned"],
        "answer = next(r.pin_active for r in rows if r.pin_memory)  # the 'pinned?' column",
        "without an accelerator the flag only warns; with one, the loader pins every batch "
        "(here in the main thread: num_workers=0).",
        measured=True,
    ),
    "03.3": Answer(
        _const({"main", "main thread", "mainthread"}),
        'answer = "main"',
        "next() fetches, collates and pins in the main thread, so pinning adds to every step.",
    ),
    "03.4": Answer(
        _const("b"),
        'answer = "b"',
        "an in-place write to x can land before the GPU has read it. Dropping x is safe: its pinned block is not "
        "reused before the copy's recorded event completes. The next batch is pinned into a fresh block, so it "
        "never overwrites the one in flight.",
    ),
    # 04 · Worker processes
    "04.1": Answer(
        _best_workers,
        "answer = sweep.best_workers  # or read the largest items/s off the sweep table",
        "measure on your own machine: the best value depends on cores, item cost and what else runs.",
        rel_tol=0,
        measured=True,
    ),
    "04.2": Answer(
        lambda f: _best_workers(f) == f["rule_of_thumb"],
        "answer = sweep.best_workers == sweep.rule_of_thumb()",
        "a rule of thumb is a starting point for a sweep, not a result.",
        measured=True,
    ),
    "04.3": Answer(
        _const(12),
        "answer = 3 * 4  # num_workers x prefetch_factor",
        "and each of them may sit in /dev/shm: that is what the shm check multiplies.",
        rel_tol=0,
    ),
    "04.4": Answer(
        lambda f: f["dup_bad"],
        "answer = DUP_BAD  # the printed share for the bad data set",
        "every worker got the same generator state: create generators per worker, never in __init__.",
        abs_tol=0.01,
        rel_tol=0,
        measured=True,
    ),
    "04.5": Answer(
        _const(1320 / 1500),
        "answer = 1320 / 1500",
        "against 2 x 800 = 1,600 it would look like 83%; against what two cores really give, the loader keeps "
        "88%: the rest is its own overhead.",
        abs_tol=0.005,
        rel_tol=0,
    ),
    # 05 · Overlap and async transfer
    "05.1": Answer(
        _const(_overlapping_cells),
        'answer = {("pinned", "side")}',
        "a pinned source and a side stream: the copy call returns at once and nothing orders the copy "
        "after the compute.",
    ),
    "05.2": Answer(
        _const(256 * 3 * 224 * 224 / 2**20),
        "answer = 256 * 3 * 224 * 224 / 2**20  # 36.75 MiB",
        "as float32 it would be four times as much: the copy engine moves a quarter of the bytes.",
        rel_tol=1e-3,
    ),
    "05.3": Answer(
        _prefetcher_ok,
        "answer = Prefetcher  # your class from section 3, with wait_stream and record_stream",
        "batch i+1 is copied on the side stream before batch i is handed over, the current stream waits for it, "
        "and record_stream keeps its memory safe (on a GPU: race-free and overlapped).",
        points=2,
        measured=True,
    ),
    "05.4": Answer(
        lambda f: f["bytes"]["float32"] / f["bytes"]["jpeg"],
        'answer = cmp.bytes["float32"] / cmp.bytes["jpeg"]',
        "the file is compressed, but it holds the whole stored image: with crops much smaller than the stored "
        "image the factor shrinks, and against uint8 it can drop below 1.",
        rel_tol=0.01,
        measured=True,
    ),
    # 06 · Capstone
    "06.1": Answer(
        lambda f: f["verdict"],
        'answer = diagnoses["compute-bound"].verdict',
        "the verdict is the stage that would set the pace if everything overlapped.",
        measured=True,
    ),
    "06.2": Answer(
        lambda f: _efficiency(),
        "answer = 1800 / min(2400, 9000, 2000)",
        "the compute (2,000 images/s) is the bottleneck; the pipeline reaches 90% of it.",
        rel_tol=1e-3,
    ),
    "06.3": Answer(
        _best_step_answers,
        'answer = wf["data-bound"].best_steps()[0]  # the largest gain in the table you saw',
        "the best step is the one that shortened or hid the slowest stage.",
        measured=True,
    ),
    "06.4": Answer(
        _slowest,
        'answer = wf["compute-bound"].results[0].slowest_stage',
        "a wide model makes the compute the bottleneck; loading steps then have little to hide.",
        measured=True,
    ),
    # 07 · Beyond one GPU
    "07.1": Answer(
        lambda f: _dist("per_rank"),
        "answer = -(-1000 // 3)  # ceil(1000 / 3)",
        "ceil(1000 / 3) = 334: ranks load 1,002 samples together, 2 of them repeated.",
        rel_tol=0,
    ),
    "07.2": Answer(
        lambda f: _dist("dropped"),
        "answer = 1000 - 3 * (1000 // 3)",
        "3 x 333 = 999, so one image sits out each epoch, a different one each epoch when shuffling.",
        rel_tol=0,
    ),
    "07.3": Answer(
        _const("B"),
        'answer = "B"',
        "B never calls set_epoch, so the sampler shuffles with the same seed every epoch. C is clumsy "
        "(a new sampler and loader per epoch) but its seed changes every epoch.",
    ),
    "07.4": Answer(
        lambda f: _dist("batches"),
        "answer = -(-(50_000 // 8) // 64)  # ceil(6,250 / 64)",
        "50,000 / 8 = 6,250 samples per rank; ceil(6,250 / 64) = 98 steps, the last with 42 images.",
        rel_tol=0,
    ),
    "07.5": Answer(
        _const(28),
        "answer = 4 * (1 + 6)  # ranks x (main process + workers)",
        "4 ranks x (1 + 6) = 28 processes; size num_workers from the cores per GPU, not per machine.",
        rel_tol=0,
    ),
    # the chapter template's example (templates/chapter_template.ipynb); no chapter, no points
    "99.1": Answer(
        lambda f: 2 * f["nbytes"],
        "answer = 2 * src.nbytes",
        "bandwidth figures count one direction; a copy moves its bytes twice through memory.",
        points=0,
        measured=True,
    ),
}


def entry(exercise: str) -> Answer:
    """The key's entry for ``exercise``; a clear error for an id the key does not know."""
    try:
        return ANSWERS[exercise]
    except KeyError:
        raise ValueError(f"exercise {exercise!r} is not in the answer key (course/key.py): add it there") from None


def grade(exercise: str, answer: Any, facts: Facts) -> tuple[bool, str]:
    """``(right?, what is wrong)`` for ``answer`` given the run's ``facts``; never names the expected value."""
    e = entry(exercise)
    return compare(answer, e.expected(facts), e.rel_tol, e.abs_tol)


def explanation(exercise: str, facts: Facts) -> str:
    e = entry(exercise)
    return e.explanation(facts) if callable(e.explanation) else e.explanation


def solution_text(exercise: str) -> str:
    """The reference solution and why, as shown by ``exercises.show_solution``."""
    e = entry(exercise)
    why = e.explanation if isinstance(e.explanation, str) else "(the explanation uses your run's figures)"
    return f"Exercise {exercise}, a solution:\n{e.solution}\nWhy: {why}"


def chapter_exercises(chapter: str) -> list[str]:
    """The ids of chapter ``"04"``'s exercises, in order."""
    return [k for k in ANSWERS if k.startswith(f"{chapter}.")]


def points(exercise: str) -> int:
    return entry(exercise).points
