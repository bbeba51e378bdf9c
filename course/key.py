"""The answer key: every exercise's expected value, points, reference solution and explanation.

One place for the answers (the notebooks hold only the question, ``answer = None`` and the hint).
``helpers.ui.exercises.check`` loads this file to self-check a reader's answer; ``course.grade``
loads it to grade submissions; ``course.release --solutions`` prints the solutions from it.

A measured exercise's expected value is computed from ``facts``: the figures of the reader's own
run, recorded by the check (``helpers.ui.exercises.RUN_FACTS``), never from a re-run.
"""

from __future__ import annotations

import re
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
    # What the answer must not be computed with: a name (``"statistics"``) or, with a leading dot, an attribute
    # or method of the chapter's helpers that yields the answer (``".best_workers"``). Checked in the cell's code
    # (comments aside) by the grader, and by the self-check where the notebook's kernel knows the cell's source.
    forbid: tuple[str, ...] = ()


def _const(value: Any) -> Callable[[Facts], Any]:
    return lambda facts: value


def _pcie_ms() -> float:
    from helpers.core import device

    return 128 * 3 * 160 * 160 * 4 / (device.pcie_bandwidth_gbps(4, 16) * 1e9) * 1e3


def _phase_ok(facts: Facts) -> Callable[[Any], bool]:
    phase_s = facts["phase_s"]
    top = max(phase_s.values())
    return lambda a: isinstance(a, str) and phase_s.get(a.strip().lower(), -1) >= 0.9 * top


def _bytes_extra() -> int:
    from helpers.chapters.ch02 import model

    return model.images_nbytes(128, 3, 160, 160, "float32") - model.images_nbytes(128, 3, 160, 160, "uint8")


def _pinning(part: str) -> Any:
    from helpers.chapters.ch02 import model

    if part == "a":
        return model.pinning_pays(1, 8e-3, 5e-3, 3e-3)
    return model.break_even_uses(8e-3, 5e-3, 3e-3)


def _share_hidden(facts: Facts) -> float:
    from helpers.chapters.ch01 import anatomy

    p = anatomy.predict_step_time(facts["phase_s"])
    return 1 - p.overlapped / p.serial


# 01.3 and 06.1: the change that helps a job limited by each stage ("data (CPU)": "data") or verdict
_FIX_FOR = {"data": "b", "copy": "c", "compute": "a"}
_FIX_FOR_VERDICT = {"data-bound": "a", "transfer-bound": "b", "compute-bound": "c"}


def _letter(letter: str) -> Callable[[Any], bool | str]:
    def ok(a: Any) -> bool | str:
        if not isinstance(a, str) or a.strip().strip("()").lower() not in ("a", "b", "c"):
            return f'answer with the letter "a", "b" or "c", not {a!r}'
        return a.strip().strip("()").lower() == letter

    return ok


def _best_workers(facts: Facts) -> int:
    items = facts["items_per_s"]
    return int(facts["workers"][items.index(max(items))])


def _overlapping_cells(a: Any) -> bool | str:
    if not isinstance(a, (set, frozenset, list, tuple)):
        return "answer with a set of (memory, stream) pairs"
    return {tuple(x) for x in a} == {("pinned", "side")}


def _rule_share(facts: Facts) -> float | Callable[[Any], str]:
    items, workers = facts["items_per_s"], facts["workers"]
    if facts["rule_of_thumb"] not in workers:
        return lambda a: "this run's sweep did not measure the rule's num_workers: run section 1 again"
    return float(items[workers.index(facts["rule_of_thumb"])] / max(items))


def _prefetcher_ok(facts: Facts) -> Callable[[Any], bool | str]:
    def ok(candidate: Any) -> bool | str:
        if "checker_correct" not in facts:
            return "hand in the class of this cell, fixed (answer = LatePrefetcher), and run the cell"
        if facts.get("name") != "LatePrefetcher":
            return (
                f"hand in LatePrefetcher, fixed in this cell, not {facts.get('name') or 'another class'} "
                "(your section 3 Prefetcher is the model to reason from, not the answer)"
            )
        return True if facts["checker_correct"] else str(facts.get("checker_message", "the checker refused it"))

    return ok


def _efficiency() -> float:
    from helpers.chapters.ch06 import capstone

    return capstone.pipeline_efficiency(1700, {"loader": 2400, "copy": 9000, "compute": 2000}).value


def _best_step_answers(facts: Facts) -> set[str]:
    from helpers.chapters.ch06 import job

    return set().union(*(job.step_answers(n) for n in facts["best_steps"]))


def _ceiling_without_loader(facts: Facts) -> float | None:
    rest = [v for k, v in facts["baseline_stages"].items() if k != "loader" and v]
    return min(rest) if rest else None


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
        forbid=("statistics", "numpy", "np.", ".median_s"),
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
        _share_hidden,
        'stages = [phase_s["load"] + phase_s["collate"], phase_s["h2d"],\n'
        '          phase_s["forward"] + phase_s["backward"] + phase_s["optimizer"]]\n'
        "answer = 1 - max(stages) / sum(phase_s.values())  # all but the slowest stage hides behind it",
        "perfect overlap hides every stage but the slowest; to go faster still, shrink that stage.",
        rel_tol=0,
        abs_tol=0.01,
        measured=True,
        # the helper, and the attributes of the prediction section 4 printed (pred = predict_step_time(phase_s))
        # that hand the answer or the grouping over: `1 - pred.overlapped / pred.serial` is the helper's answer
        forbid=("predict_step_time", ".overlapped", ".serial", ".speedup_bound", ".one_step_overlap", ".stage_times"),
    ),
    "01.3": Answer(
        lambda f: _letter(_FIX_FOR[max(f["stage_times"], key=lambda k: f["stage_times"][k]).split()[0]]),
        'st = regimes["width 2"].prediction.stage_times  # the largest stage sets the overlapped step\n'
        'answer = {"data": "b", "copy": "c", "compute": "a"}[max(st, key=st.get).split()[0]]  # "data (CPU)" etc.',
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
        forbid=(".predict_s", ".half_bandwidth_bytes"),
    ),
    "02.2": Answer(
        lambda f: _bytes_extra(),
        "answer = 128 * 3 * 160 * 160 * (4 - 1)",
        "three extra bytes per value: send uint8 and normalise on the GPU.",
        rel_tol=0,
        forbid=("images_nbytes",),
    ),
    "02.3a": Answer(
        lambda f: _pinning("a"),
        "answer_a = False  # 8 + 3 ms > 5 ms",
        "pin once, copy once loses.",
        forbid=("pinning_pays", "break_even_uses"),
    ),
    "02.3b": Answer(
        lambda f: _pinning("b"),
        "answer_b = 8 / (5 - 3)  # 4 copies",
        "a DataLoader reuses cached pinned blocks for every batch, so it is far past break-even.",
        forbid=("pinning_pays", "break_even_uses"),
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
        "answer = max(zip(sweep.items_per_s, sweep.workers))[1]  # or read the largest items/s off the table",
        "measure on your own machine: the best value depends on cores, item cost and what else runs.",
        rel_tol=0,
        measured=True,
        forbid=(".best_workers",),
    ),
    "04.2": Answer(
        _rule_share,
        "answer = sweep.at(sweep.rule_of_thumb()).items_per_s / max(sweep.items_per_s)",
        "a rule of thumb is a starting point for a sweep, not a result: here is what trusting it costs (or not).",
        rel_tol=0.02,
        measured=True,
        forbid=(".best_workers",),
    ),
    "04.3": Answer(
        _const(12),
        "answer = 3 * 4  # num_workers x prefetch_factor",
        "and each of them may sit in /dev/shm: that is what the shm check multiplies.",
        rel_tol=0,
    ),
    "04.4": Answer(
        _const(250),
        "answer = 1000 // 4  # every worker replays the same 250 draws",
        "every worker got a copy of the same generator state, so the 4 workers draw the same 250 values: "
        "create generators per worker (seeded from the worker's id), never in __init__.",
        rel_tol=0,
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
        "def _iter_ahead(self):  # LatePrefetcher.__iter__, fixed: queue batch i+1 before handing batch i over\n"
        "    cur = torch.cuda.current_stream(self.device)\n"
        "    self.side.wait_stream(cur)\n"
        "    pending = iter(self.loader)\n"
        "    ahead = copy_on(self.side, next(pending, None), self.device)  # batch 0, before the loop\n"
        "    while ahead is not None:\n"
        "        cur.wait_stream(self.side)  # the copy is done before cur uses the batch\n"
        "        for t in ahead:\n"
        "            t.record_stream(cur)  # its memory is kept while cur may read it\n"
        "        out, ahead = ahead, copy_on(self.side, next(pending, None), self.device)  # batch i+1 now\n"
        "        yield out\n"
        "LatePrefetcher.__iter__ = _iter_ahead\n"
        "answer = LatePrefetcher",
        "the late version copies batch i only when it is asked for it, so every copy runs while compute waits, and "
        "it never calls record_stream. Issuing batch i+1's copy before handing batch i over lets the copy run "
        "while batch i trains; the wait and record_stream keep it correct (on a GPU: race-free and overlapped).",
        points=2,
        measured=True,
        forbid=("Prefetcher",),  # the section 3 class (or a subclass of it) is not the fix; LatePrefetcher is fine
    ),
    "05.4": Answer(
        lambda f: f["bytes"]["uint8"] / f["bytes"]["jpeg"],
        'answer = cmp.bytes["uint8"] / cmp.bytes["jpeg"]  # your pipeline already sends uint8',
        "the file is compressed, but it holds the whole stored image, not the crop: with crops much smaller than "
        "the stored image the factor shrinks, and it can drop below 1 (then JPEG bytes cost more link time).",
        rel_tol=0.01,
        measured=True,
    ),
    # 06 · Capstone
    "06.1": Answer(
        lambda f: _letter(_FIX_FOR_VERDICT.get(f["verdict"], "?")),
        'fix = {"data-bound": "a", "transfer-bound": "b", "compute-bound": "c"}  # what shortens each bottleneck\n'
        'answer = fix[diagnoses["compute-bound"].verdict]',
        "the verdict is the stage that would set the pace if everything overlapped: shortening that stage "
        "shortens the overlapped step (other changes can still save time by hiding waits) (data-bound: loading, a; "
        "transfer-bound: the copy, b; compute-bound: the model or the GPU, c).",
        measured=True,
    ),
    "06.2": Answer(
        lambda f: _efficiency(),
        "answer = 1700 / min(2400, 9000, 2000)",
        "the compute (2,000 images/s) is the bottleneck; the pipeline reaches 85% of it.",
        rel_tol=1e-3,
        forbid=("pipeline_efficiency", ".efficiency"),
    ),
    "06.3": Answer(
        _best_step_answers,
        'dw = wf["data-bound"]  # the table you saw: each row\'s gain (x) over the one before; idle: cannot act here\n'
        "g, idle = dw.gains(), dw.no_effect()\n"
        "answer = dw.results[max((i for i in range(1, len(g)) if not idle[i]), key=g.__getitem__)].name",
        "the best step is the one that shortened or hid the slowest stage.",
        measured=True,
        forbid=(".best_step", ".best_steps"),
    ),
    "06.4": Answer(
        _ceiling_without_loader,
        'st = wf["data-bound"].results[0].stages\n'
        'answer = min(v for k, v in st.items() if k != "loader" and v)  # the next slowest stage sets the pace',
        "remove the bottleneck and the next slowest stage sets the pace: that is how far loading steps alone "
        "can take this job.",
        rel_tol=0.01,
        measured=True,
        forbid=(".slowest_stage", ".efficiency"),
    ),
    # 07 · Beyond one GPU
    "07.1": Answer(
        lambda f: _dist("per_rank"),
        "answer = -(-1000 // 3)  # ceil(1000 / 3)",
        "ceil(1000 / 3) = 334: ranks load 1,002 samples together, 2 of them repeated.",
        rel_tol=0,
        forbid=("rank_share", "batches_per_rank", "DistributedSampler"),
    ),
    "07.2": Answer(
        lambda f: _dist("dropped"),
        "answer = 1000 - 3 * (1000 // 3)",
        "3 x 333 = 999, so one image sits out each epoch, a different one each epoch when shuffling.",
        rel_tol=0,
        forbid=("rank_share", "batches_per_rank", "DistributedSampler"),
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
        forbid=("rank_share", "batches_per_rank", "DistributedSampler"),
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


def forbidden_use(exercise: str, source: str) -> str | None:
    """The first name or attribute the exercise rules out (``Answer.forbid``) that ``source`` uses, else None.

    Comments are left out: ``answer = None  # e.g. sorted(...)`` uses nothing.
    """
    code = "\n".join(line.split("#")[0] for line in source.splitlines())
    for name in entry(exercise).forbid:
        if name.startswith("."):  # an attribute: x.name, also getattr(x, "name")
            attr = re.escape(name[1:])
            if re.search(rf"\.\s*{attr}\b|[\"']{attr}[\"']", code):
                return name
        elif re.search(rf"(?<!\w){re.escape(name)}", code):
            return name
    return None


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
