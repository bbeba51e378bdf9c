"""Automatic checks for the exercises.

Each exercise cell ends with ``check("02.1", answer, expected=..., hint=...)``.

The result shows itself as the last expression of a cell (``print`` it in a
script).

* An unanswered exercise (``answer`` is ``None`` or ``...``) prints a hint and
  does not fail, so notebooks run top to bottom before anyone answers.
* A wrong answer prints what is wrong and a hint.
* A right answer prints a short explanation.

For course assignments set ``WORKBOOK_GRADE=1``: then anything but a right
answer raises ``AssertionError``, so an autograder (e.g. nbval or nbclient)
fails the notebook.

``expected`` may be a number (compared with a relative tolerance), a string
(case- and space-insensitive), a collection of acceptable strings, a bool, or a
callable ``expected(answer) -> bool | str`` (a string is a message explaining
what is wrong).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any, Collection

from . import config

__all__ = ["ExerciseResult", "check", "grade_mode", "GRADE_ENV"]

GRADE_ENV = config.GRADE_ENV


def grade_mode() -> bool:
    """True when ``WORKBOOK_GRADE=1``: wrong or missing answers raise (an unknown value raises ValueError)."""
    return config.grade_mode()


@dataclass
class ExerciseResult:
    """The outcome of one check: ``status`` is 'correct', 'wrong' or 'unanswered'."""

    exercise: str
    status: str
    message: str

    @property
    def correct(self) -> bool:
        return self.status == "correct"

    def __str__(self) -> str:
        return self.message

    def __repr__(self) -> str:
        return self.message

    def _repr_html_(self) -> str:  # pragma: no cover - display only
        color = {"correct": "#1a7f37", "wrong": "#b00020", "unanswered": "#7a5a00"}[self.status]
        return f"<span style='color:{color}'>{self.message}</span>"


def _norm(s: str) -> str:
    return " ".join(str(s).lower().split())


def _compare(answer: Any, expected: Any, rel_tol: float, abs_tol: float) -> tuple[bool, str]:
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
        return False, f"{answer:.4g} is {direction}"
    if isinstance(expected, str):
        return _norm(answer) == _norm(expected), ""
    if isinstance(expected, Collection):
        return _norm(answer) in {_norm(e) for e in expected}, ""
    return answer == expected, ""


def check(
    exercise: str,
    answer: Any,
    expected: Any,
    *,
    hint: str = "",
    explanation: str = "",
    rel_tol: float = 0.05,
    abs_tol: float = 0.0,
) -> ExerciseResult:
    """Check ``answer`` against ``expected`` and print feedback.

    Args:
        exercise: the exercise id, e.g. ``"00.2"``.
        answer: what the reader wrote (``None`` or ``...`` = not answered yet).
        expected: see the module docstring.
        hint: shown when unanswered or wrong.
        explanation: shown when right.
        rel_tol / abs_tol: tolerance for numbers.
    """
    if answer is None or answer is Ellipsis:
        msg = f"Exercise {exercise}: not answered yet." + (f" Hint: {hint}" if hint else "")
        result = ExerciseResult(exercise, "unanswered", msg)
    else:
        try:
            ok, why = _compare(answer, expected, rel_tol, abs_tol)
        except Exception as exc:  # a reader's odd answer must not crash the checker
            ok, why = False, f"could not compare the answer ({type(exc).__name__}: {exc})"
        if ok:
            msg = f"Exercise {exercise}: correct." + (f" {explanation}" if explanation else "")
            result = ExerciseResult(exercise, "correct", msg)
        else:
            msg = f"Exercise {exercise}: not quite" + (f" ({why})" if why else "") + "."
            if hint:
                msg += f" Hint: {hint}"
            result = ExerciseResult(exercise, "wrong", msg)
    if grade_mode() and not result.correct:
        raise AssertionError(result.message)
    return result

