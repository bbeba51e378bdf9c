"""Automatic checks for the exercises, with the answers kept out of the reader's notebook.

An exercise cell ends with ``check("02.1", answer, hint=...)`` or ``check_parts("02.3", a=Part(...), ...)``.
Expected values, explanations and solutions live in the answer key, ``course/key.py`` (left out of the
student release; without it the answer is only recorded). A check never prints the expected value: unanswered
(``None``/``...``) prints a hint and does not fail, so notebooks run top to bottom; an answer using what the
key's ``forbid`` rules out is not right. ``show_solution("02.1")`` shows the key's solution.

Every check leaves a record in its cell's output (``RECORD_MIME``, not displayed): the answer and the figures
of the reader's run. ``python -m course.grade`` grades those records with its own key, so an edited
``expected=`` or a deleted check cannot raise a score. ``WORKBOOK_GRADE=1``: anything not right raises.

``expected`` may be a number (relative tolerance), a string (case-, space- and ``"b)"``-insensitive), a
collection of strings, a bool, or ``expected(answer) -> bool | str``. An exception while comparing is a "not
quite" verdict, except a CUDA error on a strict GPU run (``WORKBOOK_REQUIRE_GPU=1``), which propagates.
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

__all__ = [
    "ExerciseResult", "Part", "RECORD_MIME", "check", "check_parts", "show_solution",
    "answer_key", "encode_answer", "decode_answer",
]  # fmt: skip

RECORD_MIME = "application/vnd.workbook.exercise+json"

KEY_ENV = "WORKBOOK_ANSWER_KEY"
"""Path of the answer key to use instead of ``course/key.py`` (``none``: behave as a student release)."""


class _FromKey:
    def __repr__(self) -> str:
        return "<from the answer key>"


FROM_KEY: Any = _FromKey()
"""The default ``expected``: the value the answer key computes for this exercise."""


def answer_key() -> ModuleType | None:
    """The answer key module (``course/key.py``), or None where it is absent (a student release)."""
    env = os.environ.get(KEY_ENV)
    if env is None:
        path = Path(__file__).resolve().parents[2] / "course" / "key.py"
        return _load_key(path) if path.is_file() else None
    if env.strip().lower() in ("", "none", "0"):
        return None
    if not Path(env).is_file():
        raise ValueError(
            f"{KEY_ENV}={Path(env).resolve()}: no such answer key file; unset it or point it at course/key.py"
        )
    return _load_key(Path(env).resolve())


@functools.lru_cache(maxsize=None)
def _load_key(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location("_workbook_answer_key", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


# What each measured exercise reads from the reader's own run (their notebook's namespace). It is saved in the
# check's grading record, so that the grader grades against the run the reader saw, never a re-run. These are
# the run's own figures (tables the chapter shows), not answers: the key turns them into the expected value.
def _phase_s(ns: dict[str, Any], answer: Any) -> dict[str, Any]:
    return {"phase_s": {str(k): float(v) for k, v in ns["phase_s"].items()}}


def _sweep(ns: dict[str, Any], answer: Any) -> dict[str, Any]:
    sweep = ns["sweep"]
    return {
        "workers": [int(w) for w in sweep.workers],
        "items_per_s": [float(v) for v in sweep.items_per_s],
        "rule_of_thumb": int(sweep.rule_of_thumb()),
    }


def _prefetcher(ns: dict[str, Any], answer: Any) -> dict[str, Any]:  # answered: _run_facts skips None and ...
    verdict = ns["prefetch"].check_pipeline_prefetcher(answer, ns.get("DEVICE"))
    name = str(getattr(answer, "__qualname__", type(answer).__name__))  # which class was handed in
    return {"checker_correct": bool(verdict.correct), "checker_message": str(verdict), "name": name}


def _waterfall(ns: dict[str, Any], regime: str) -> dict[str, Any]:
    wf = ns["wf"][regime]
    return {
        "steps": [str(r.name) for r in wf.results],
        "gains": [float(g) for g in wf.gains()],
        "best_steps": [str(n) for n in wf.best_steps()],
        "baseline_stages": {str(k): (float(v) if v else None) for k, v in wf.results[0].stages.items()},
    }


RUN_FACTS: dict[str, Callable[[dict[str, Any], Any], dict[str, Any]]] = {
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
    "06.3": lambda ns, a: _waterfall(ns, "data-bound"),
    "06.4": lambda ns, a: _waterfall(ns, "data-bound"),
    "99.1": lambda ns, a: {"nbytes": int(ns["src"].nbytes)},
}


def encode_answer(answer: Any) -> Any:
    """The answer as JSON (sets and tuples tagged, anything else by its ``repr``), for the grading record."""
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


def decode_answer(data: Any) -> Any:
    """The inverse of :func:`encode_answer` (an object known only by its ``repr`` comes back as that string)."""
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


_COLOURS = {"correct": "#1a7f37", "wrong": "#b00020", "unanswered": "#7a5a00", "recorded": "#444"}


@dataclass(repr=False)
class ExerciseResult:
    """The outcome of a check: ``status`` is 'correct', 'wrong', 'unanswered' or 'recorded' (no answer key here);
    ``record`` is what the grader reads. A multi-part check (:func:`check_parts`) holds one result per part in
    ``parts`` and is 'correct' when every part is, 'unanswered' when none is answered, 'recorded' when none is
    wrong. Shown as its message, one line per part (coloured in a notebook), with the grading records (see the
    module docstring) in the cell's output, not displayed."""

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
    expected: Any = FROM_KEY
    hint: str = ""
    explanation: str = ""
    rel_tol: float | None = None
    abs_tol: float | None = None


class Solution(str):
    """A reference solution from the answer key, shown on request (:func:`show_solution`): its text, unquoted."""

    __repr__ = str.__str__


def _norm(s: Any) -> str:
    return " ".join(str(s).lower().split()).strip("()\"'. ")


def _strict_gpu_error(exc: BaseException) -> bool:
    """A CUDA error on a strict GPU run, which must reach the reader, not a verdict (``prefetch._gpu_error``'s
    rule without importing torch: ``AcceleratorError`` matched by name)."""
    if not config.require_gpu():
        return False
    if any(cls.__name__ == "AcceleratorError" for cls in type(exc).__mro__):
        return True
    return isinstance(exc, RuntimeError) and "CUDA" in str(exc)


def _units_hint(answer: float, expected: float) -> str:
    """A hint when the answer is off by a unit factor (s vs ms, MiB vs MB), else ''."""
    if expected == 0 or answer == 0:
        return ""
    ratio = answer / expected
    for factor, what, tol in (
        (1e3, "seconds or milliseconds? a factor of 1,000", 0.01),
        (2**20 / 1e6, "MiB or MB?", 2e-3),
    ):
        for r in (factor, 1 / factor):
            if math.isclose(ratio, r, rel_tol=tol):
                return f"; check the units: {what}"
    return ""


def compare(answer: Any, expected: Any, rel_tol: float = 0.05, abs_tol: float = 0.0) -> tuple[bool, str]:
    """``(right?, what is wrong)``; the message never names the expected value (a direction or unit hint at most)."""
    if callable(expected):
        verdict = expected(answer)
        if isinstance(verdict, str):
            return False, verdict
        return bool(verdict), ""
    if isinstance(expected, bool):
        if not isinstance(answer, bool):
            return False, f"answer with True or False, not {answer!r}"
        return answer is expected, ""
    if isinstance(expected, numbers.Real):
        if isinstance(answer, bool) or not isinstance(answer, numbers.Real):
            return False, f"answer with a number, not {type(answer).__name__} {answer!r}"
        if not math.isfinite(float(answer)):
            return False, "the answer is not a finite number"
        ok = math.isclose(float(answer), float(expected), rel_tol=rel_tol, abs_tol=abs_tol)
        if ok:
            return True, ""
        direction = "too high" if float(answer) > float(expected) else "too low"
        return False, f"{answer:.4g} is {direction}{_units_hint(float(answer), float(expected))}"
    if isinstance(expected, Collection):  # a string, or a collection of accepted strings
        if not isinstance(answer, str):
            return False, f"answer with a string, not {type(answer).__name__} {answer!r}"
        return _norm(answer) in {_norm(e) for e in ([expected] if isinstance(expected, str) else expected)}, ""
    return answer == expected, ""


def check(
    exercise: str,
    answer: Any,
    expected: Any = FROM_KEY,
    *,
    hint: str = "",
    explanation: str = "",
    rel_tol: float | None = None,
    abs_tol: float | None = None,
) -> ExerciseResult:
    """Check ``answer`` of ``exercise`` (``"00.2"``) against the key's value for the caller's run (or ``expected``);
    ``hint`` shows when unanswered or wrong, ``explanation`` when right; numbers within 5 % by default."""
    part = Part(answer, expected, hint, explanation, rel_tol, abs_tol)
    return _graded(_evaluate(exercise, part, sys._getframe(1).f_globals))


def check_parts(exercise: str, **parts: Part) -> ExerciseResult:
    """Check every part (``a=Part(...)`` is part "02.3a"), even after a wrong one, and show all verdicts together;
    with ``WORKBOOK_GRADE=1`` any part not right raises ``AssertionError`` naming all of them."""
    if not parts:
        raise ValueError("check_parts needs at least one part, e.g. a=Part(answer_a, hint=...)")
    for name, part in parts.items():
        if not isinstance(part, Part):
            raise ValueError(f"part {name!r} must be a Part(answer, ...), got {type(part).__name__}")
    ns = sys._getframe(1).f_globals
    results = [_evaluate(f"{exercise}{name}", p, ns) for name, p in parts.items()]
    statuses = {p.status for p in results}
    status = next(s for s in ("correct", "unanswered", "recorded", "wrong") if statuses <= _AT_MOST[s])
    return _graded(ExerciseResult(exercise, status, "\n".join(p.message for p in results), None, results))


#: A multi-part result's status: the first whose set holds every part's status.
_AT_MOST = {"correct": {"correct"}, "unanswered": {"unanswered"}, "recorded": {"recorded", "unanswered"}}
_AT_MOST["wrong"] = {"correct", "wrong", "unanswered", "recorded"}


def _graded(shown: ExerciseResult) -> ExerciseResult:
    """``shown``; with ``WORKBOOK_GRADE=1``, an AssertionError naming every part not right, if one is wrong or
    unanswered."""
    if config.grade_mode() and any(p.status in ("wrong", "unanswered") for p in shown._parts()):
        raise AssertionError("\n".join(p.message for p in shown._parts() if not p.correct))
    return shown


def show_solution(exercise: str) -> Solution:
    """The answer key's reference solution and explanation for ``exercise`` (ValueError for an unknown id)."""
    key = answer_key()
    if key is None:
        return Solution(f"Exercise {exercise}: no solutions in this copy (a course release); ask your instructor.")
    return Solution(key.solution_text(exercise))


def _cell_source(ns: dict[str, Any] | None) -> str:
    """The source of the cell being run, where an IPython kernel keeps it (``_ih``), else ''."""
    inputs = (ns or {}).get("_ih")
    return inputs[-1] if isinstance(inputs, list) and inputs and isinstance(inputs[-1], str) else ""


def _run_facts(exercise: str, answer: Any, ns: dict[str, Any]) -> tuple[dict[str, Any] | None, str]:
    """``(the figures of the reader's run this exercise is graded on, why they could not be read)``."""
    if exercise not in RUN_FACTS or (exercise == "05.3" and (answer is None or answer is Ellipsis)):
        return None, ""
    try:
        return RUN_FACTS[exercise](dict(ns), answer), ""
    except Exception as exc:  # the run's figures are missing: say so instead of a traceback
        if _strict_gpu_error(exc):
            raise
        return None, f"{type(exc).__name__}: {exc}"


def _evaluate(exercise: str, part: Part, ns: dict[str, Any]) -> ExerciseResult:
    answer, expected, hint, explanation = part.answer, part.expected, part.hint, part.explanation
    facts, facts_error = _run_facts(exercise, answer, ns)
    record = {"exercise": exercise, "answer": encode_answer(answer), "facts": facts}
    record["expected_given"] = expected is not FROM_KEY
    if answer is None or answer is Ellipsis:
        msg = f"Exercise {exercise}: not answered yet." + (f" Hint: {hint}" if hint else "")
        return ExerciseResult(exercise, "unanswered", msg, record)
    key = None
    if expected is FROM_KEY:
        key = answer_key()
        if key is None:
            msg = f"Exercise {exercise}: answer recorded ({_short(answer)}); your instructor's grader checks it."
            return ExerciseResult(exercise, "recorded", msg, record)
        if facts_error:
            msg = (
                f"Exercise {exercise}: could not read this run's figures ({facts_error}): run the chapter's "
                "cells above first."
            )
            return ExerciseResult(exercise, "wrong", msg, record)
    try:
        used = key.forbidden_use(exercise, _cell_source(ns)) if key is not None else None
        if used:  # the grader scores it 0: say so now
            ok, why = False, f"it uses {used}, which the exercise rules out: work it out yourself"
        elif key is not None:
            ok, why = key.grade(exercise, answer, facts or {})
            if ok and not explanation:
                explanation = key.explanation(exercise, facts or {})
        else:
            rel_tol = 0.05 if part.rel_tol is None else part.rel_tol
            ok, why = compare(answer, expected, rel_tol, part.abs_tol or 0.0)
    except Exception as exc:  # a reader's odd answer must not crash the checker
        if _strict_gpu_error(exc):  # ... but a strict GPU run's CUDA error must not become a verdict
            raise
        ok, why = False, f"could not compare the answer ({type(exc).__name__}: {exc})"
    if ok:
        msg = f"Exercise {exercise}: correct." + (f" {explanation}" if explanation else "")
        return ExerciseResult(exercise, "correct", msg, record)
    msg = f"Exercise {exercise}: not quite" + (f" ({why})" if why else "") + "." + (f" Hint: {hint}" if hint else "")
    return ExerciseResult(exercise, "wrong", msg, record)


def _short(answer: Any) -> str:
    text = repr(answer)
    return text if len(text) <= 60 else text[:57] + "..."
