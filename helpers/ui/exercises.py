"""Exercise checks: ``check("02.1", answer, hint=...)`` and ``check_parts(...)`` judge the reader's answer with the
answer key, ``course/key.py`` (left out of the student release: there the answer is only recorded). Every check
leaves a grading record in its cell's output (``RECORD_MIME``): the answer and the figures of the reader's run, so
``python -m course.grade`` grades the run the reader saw with its own key; ``WORKBOOK_GRADE=1``: not right raises.
"""

from __future__ import annotations

import functools
import html
import importlib.util
import math
import numbers
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Collection

from ..core import config

RECORD_MIME = "application/vnd.workbook.exercise+json"
KEY_ENV = "WORKBOOK_ANSWER_KEY"  # "none": behave as a student release (no key)


def answer_key() -> ModuleType | None:
    """The answer key module (``course/key.py``), or None where it is absent (a student release)."""
    path = Path(__file__).resolve().parents[2] / "course" / "key.py"
    if not path.is_file() or os.environ.get(KEY_ENV, "").strip().lower() in ("none", "0"):
        return None
    return _load_key(path)


@functools.lru_cache(maxsize=None)
def _load_key(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location("_workbook_answer_key", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


# What each measured exercise reads from the reader's run (the notebook's namespace), saved in the grading record:
# the run's own figures, not answers (the key turns them into the expected value). They are read here, on the
# student's side, because the key is absent from a student release while the grader needs the run's figures.
def _phase_s(ns: dict[str, Any], answer: Any) -> dict[str, Any]:
    return {"phase_s": {str(k): float(v) for k, v in ns["phase_s"].items()}}


def _sweep(ns: dict[str, Any], answer: Any) -> dict[str, Any]:
    sweep = ns["sweep"]
    return {
        "workers": [int(w) for w in sweep.workers],
        "items_per_s": [float(v) for v in sweep.items_per_s],
        "rule_of_thumb": int(sweep.rule_of_thumb()),
    }


def _prefetcher(ns: dict[str, Any], answer: Any) -> dict[str, Any] | None:
    if answer is None or answer is Ellipsis:  # nothing handed in: nothing to run the checker on
        return None
    verdict = ns["prefetch"].check_pipeline_prefetcher(answer, ns.get("DEVICE"))
    name = str(getattr(answer, "__qualname__", type(answer).__name__))  # which class was handed in
    return {"checker_correct": bool(verdict.correct), "checker_message": str(verdict), "name": name}


def _waterfall(ns: dict[str, Any], answer: Any) -> dict[str, Any]:
    wf = ns["wf"]["data-bound"]
    return {
        "steps": [str(r.name) for r in wf.results],
        "gains": [float(g) for g in wf.gains()],
        "best_steps": [str(n) for n in wf.best_steps()],
        "baseline_stages": {str(k): (float(v) if v else None) for k, v in wf.results[0].stages.items()},
    }


RUN_FACTS: dict[str, Callable[[dict[str, Any], Any], dict[str, Any] | None]] = {
    "00.1": lambda ns, a: {"times_s": [float(t) for t in ns["warm"].times_s]},
    "01.1": _phase_s,
    "01.2": _phase_s,
    "01.3": lambda ns, a: {
        "stage_times": {str(k): float(v) for k, v in ns["regimes"]["width 2"].prediction.stage_times.items()}
    },
    "02.1": lambda ns, a: {"latency_s": float(ns["FIT"].latency_s), "bandwidth_Bps": float(ns["FIT"].bandwidth_Bps)},
    "03.2": lambda ns, a: {"pinned": bool(next(r.pin_active for r in ns["rows"] if r.pin_memory))},
    "04.1": _sweep,
    "04.2": _sweep,
    "05.3": _prefetcher,
    "05.4": lambda ns, a: {"bytes": {str(k): float(v) for k, v in ns["cmp"].bytes.items()}},
    "06.1": lambda ns, a: {"verdict": str(ns["diagnoses"]["compute-bound"].verdict)},
    "06.3": _waterfall,
    "06.4": _waterfall,
    "99.1": lambda ns, a: {"nbytes": int(ns["src"].nbytes)},
}


def encode_answer(answer: Any) -> Any:
    """The answer as JSON (sets and tuples tagged, anything else by its ``repr``), for the grading record
    (``course.grade.decode_answer`` reads it back)."""
    if answer is None or isinstance(answer, (bool, str)):
        return answer
    if isinstance(answer, numbers.Integral):
        return int(answer)
    if isinstance(answer, numbers.Real):
        value = float(answer)
        return value if math.isfinite(value) else {"float": repr(value)}
    if isinstance(answer, (set, frozenset)):
        return {"set": [encode_answer(x) for x in sorted(answer, key=repr)]}
    if isinstance(answer, (list, tuple)):
        return {"tuple" if isinstance(answer, tuple) else "list": [encode_answer(x) for x in answer]}
    if answer is Ellipsis:
        return {"ellipsis": True}
    return {"repr": repr(answer)}


_COLOURS = {"correct": "#1a7f37", "wrong": "#b00020", "unanswered": "#7a5a00", "recorded": "#444"}


@dataclass(repr=False)
class ExerciseResult:
    """A check's outcome: ``status`` 'correct', 'wrong', 'unanswered' or 'recorded' (no key here), ``record`` what the
    grader reads; a multi-part check holds one result per part in ``parts``. Shown as its message, one line a part."""

    exercise: str
    status: str
    message: str
    record: dict[str, Any] | None = None
    parts: list[ExerciseResult] = field(default_factory=list)

    @property
    def correct(self) -> bool:
        return self.status == "correct"

    def _parts(self) -> list[ExerciseResult]:
        return self.parts or [self]

    def __str__(self) -> str:
        return self.message

    __repr__ = __str__

    def _repr_html_(self) -> str:  # pragma: no cover - display only
        return "<br>".join(
            f"<span style='color:{_COLOURS[p.status]}'>{html.escape(p.message)}</span>" for p in self._parts()
        )

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> dict[str, Any]:
        return {RECORD_MIME: {"records": [p.record for p in self._parts() if p.record]}}


@dataclass
class Part:
    """One part of a multi-part exercise: the reader's ``answer`` and what :func:`check` needs."""

    answer: Any
    expected: Any = None  # None: what the answer key computes for this run
    hint: str = ""
    explanation: str = ""


class Solution(str):
    """The key's reference solution (:func:`show_solution`), shown unquoted."""

    __repr__ = str.__str__


def _norm(s: Any) -> str:
    return " ".join(str(s).lower().split()).strip("()\"'. ")


_UNIT_SLIPS = ((1e3, "seconds or milliseconds? a factor of 1,000", 0.01), (2**20 / 1e6, "MiB or MB?", 2e-3))


def compare(answer: Any, expected: Any, rel_tol: float = 0.05, abs_tol: float = 0.0) -> tuple[bool, str]:
    """``(right?, what is wrong)``; ``expected`` is a number (relative tolerance), a string or strings (case-, space-
    and ``"b)"``-insensitive), a bool, or ``expected(answer) -> bool | str``. Never names the expected value."""
    if callable(expected):
        verdict = expected(answer)
        return (False, verdict) if isinstance(verdict, str) else (bool(verdict), "")
    if isinstance(expected, bool):
        if not isinstance(answer, bool):
            return False, f"answer with True or False, not {answer!r}"
        return answer is expected, ""
    if isinstance(expected, numbers.Real):
        if isinstance(answer, bool) or not isinstance(answer, numbers.Real):
            return False, f"answer with a number, not {type(answer).__name__} {answer!r}"
        if not math.isfinite(float(answer)):
            return False, "the answer is not a finite number"
        if math.isclose(float(answer), float(expected), rel_tol=rel_tol, abs_tol=abs_tol):
            return True, ""
        ratio = float(answer) / float(expected) if expected and answer else 0.0
        slips = [what for f, what, tol in _UNIT_SLIPS if any(math.isclose(ratio, r, rel_tol=tol) for r in (f, 1 / f))]
        hint = f"; check the units: {slips[0]}" if slips else ""  # off by a unit factor (s vs ms, MiB vs MB)
        return False, f"{answer:.4g} is {'too high' if float(answer) > float(expected) else 'too low'}{hint}"
    if isinstance(expected, Collection):  # a string, or a collection of accepted strings
        if not isinstance(answer, str):
            return False, f"answer with a string, not {type(answer).__name__} {answer!r}"
        return _norm(answer) in {_norm(e) for e in ([expected] if isinstance(expected, str) else expected)}, ""
    return answer == expected, ""


def check(exercise: str, answer: Any, expected: Any = None, *, hint: str = "", explanation: str = "") -> ExerciseResult:
    """Check ``answer`` of ``exercise`` (``"00.2"``) against the key's value for the caller's run (or ``expected``,
    a number, string(s), bool or ``expected(answer) -> bool | str``: see :func:`compare`).
    Unanswered (``None``/``...``) shows ``hint`` and does not fail; numbers within 5 %."""
    part = Part(answer, expected, hint, explanation)
    return _graded(_evaluate(exercise, part, sys._getframe(1).f_globals))


def check_parts(exercise: str, **parts: Part) -> ExerciseResult:
    """Check every part (``a=Part(...)`` is part "02.3a"), even after a wrong one, and show all verdicts together."""
    if not parts:
        raise ValueError("check_parts needs at least one part, e.g. a=Part(answer_a, hint=...)")
    for name, part in parts.items():
        if not isinstance(part, Part):
            raise ValueError(f"part {name!r} must be a Part(answer, ...), got {type(part).__name__}")
    ns = sys._getframe(1).f_globals
    results = [_evaluate(f"{exercise}{name}", p, ns) for name, p in parts.items()]
    seen = {p.status for p in results}  # one status: the whole's; recorded beside unanswered: recorded; else wrong
    status = seen.pop() if len(seen) == 1 else "recorded" if seen == {"recorded", "unanswered"} else "wrong"
    return _graded(ExerciseResult(exercise, status, "\n".join(p.message for p in results), None, results))


def _graded(shown: ExerciseResult) -> ExerciseResult:
    """``shown``, or with ``WORKBOOK_GRADE=1`` an AssertionError naming every part wrong or unanswered."""
    if config.grade_mode() and any(p.status in ("wrong", "unanswered") for p in shown._parts()):
        raise AssertionError("\n".join(p.message for p in shown._parts() if not p.correct))
    return shown


def show_solution(exercise: str) -> Solution:
    """The answer key's reference solution and explanation for ``exercise`` (ValueError for an unknown id)."""
    key = answer_key()
    if key is None:
        return Solution(f"Exercise {exercise}: no solutions in this copy (a course release); ask your instructor.")
    return Solution(key.solution_text(exercise))


def _evaluate(exercise: str, part: Part, ns: dict[str, Any]) -> ExerciseResult:
    answer, expected, hint, explanation = part.answer, part.expected, part.hint, part.explanation
    facts, facts_error = None, ""  # the figures of the reader's run this exercise is graded on
    try:
        facts = RUN_FACTS[exercise](dict(ns), answer) if exercise in RUN_FACTS else None
    except Exception as exc:  # the run's figures are missing: say so instead of a traceback
        if config.strict_gpu_error(exc):
            raise
        facts_error = f"{type(exc).__name__}: {exc}"
    record = {"exercise": exercise, "answer": encode_answer(answer), "facts": facts}
    record["expected_given"] = expected is not None
    if answer is None or answer is Ellipsis:
        msg = f"Exercise {exercise}: not answered yet." + (f" Hint: {hint}" if hint else "")
        return ExerciseResult(exercise, "unanswered", msg, record)
    key = answer_key() if expected is None else None
    if expected is None and key is None:
        text = repr(answer) if len(repr(answer)) <= 60 else repr(answer)[:57] + "..."
        msg = f"Exercise {exercise}: answer recorded ({text}); your instructor's grader checks it."
        return ExerciseResult(exercise, "recorded", msg, record)
    if key is not None and facts_error:
        msg = f"Exercise {exercise}: could not read this run's figures ({facts_error}): "
        msg += "run the chapter's cells above first."
        return ExerciseResult(exercise, "wrong", msg, record)
    try:
        cell = ns.get("_ih")  # the source of the cell being run, where an IPython kernel keeps it
        source = cell[-1] if isinstance(cell, list) and cell and isinstance(cell[-1], str) else ""
        used = key.forbidden_use(exercise, source) if key is not None else None
        if used:  # the grader scores it 0: say so now
            ok, why = False, f"it uses {used}, which the exercise rules out: work it out yourself"
        elif key is not None:
            ok, why = key.grade(exercise, answer, facts or {})
            explanation = explanation or (key.explanation(exercise, facts or {}) if ok else "")
        else:
            ok, why = compare(answer, expected)
    except Exception as exc:  # a reader's odd answer must not crash the checker
        if config.strict_gpu_error(exc):  # ... but a strict GPU run's CUDA error must not become a verdict
            raise
        ok, why = False, f"could not compare the answer ({type(exc).__name__}: {exc})"
    if ok:
        msg = f"Exercise {exercise}: correct." + (f" {explanation}" if explanation else "")
        return ExerciseResult(exercise, "correct", msg, record)
    msg = f"Exercise {exercise}: not quite" + (f" ({why})" if why else "") + "." + (f" Hint: {hint}" if hint else "")
    return ExerciseResult(exercise, "wrong", msg, record)
