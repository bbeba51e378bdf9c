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

An exercise with several parts is checked with one call, so that every part's verdict
is shown (two ``check`` calls in one cell would show only the last)::

    check_parts("02.3", a=Part(answer_a, expected=False, hint=...),
                        b=Part(answer_b, expected=4.0, hint=...))

``expected`` may be a number (compared with a relative tolerance), a string
(case- and space-insensitive), a collection of acceptable strings, a bool, or a
callable ``expected(answer) -> bool | str`` (a string is a message explaining
what is wrong).

An exception raised while comparing becomes a "not quite" verdict naming it (a reader's odd
answer must not crash the cell), with one exception: on a strict GPU run
(``WORKBOOK_REQUIRE_GPU=1``) a CUDA error (``torch.AcceleratorError``, or a ``RuntimeError``
naming CUDA) propagates, so that a GPU job fails loudly instead of printing a verdict. The
GPU checkers (e.g. ``prefetch.check_pipeline_prefetcher`` behind exercise 05.3) re-raise
exactly those errors; this module lets them through.
"""

from __future__ import annotations

import html
import math
import numbers
from dataclasses import dataclass
from typing import Any, Collection

from ..core import config

__all__ = ["ExerciseResult", "ExerciseReport", "Part", "check", "check_parts"]


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
        return f"<span style='color:{color}'>{html.escape(self.message)}</span>"


@dataclass
class Part:
    """One part of a multi-part exercise: the reader's ``answer`` and what :func:`check` needs."""

    answer: Any
    expected: Any
    hint: str = ""
    explanation: str = ""
    rel_tol: float = 0.05
    abs_tol: float = 0.0


@dataclass
class ExerciseReport:
    """The outcomes of every part of one exercise, shown together (one line per part)."""

    exercise: str
    parts: list[ExerciseResult]

    @property
    def correct(self) -> bool:
        return all(p.correct for p in self.parts)

    @property
    def status(self) -> str:
        """'correct' (every part), 'unanswered' (no part answered yet) or 'wrong'."""
        if self.correct:
            return "correct"
        if all(p.status == "unanswered" for p in self.parts):
            return "unanswered"
        return "wrong"

    @property
    def message(self) -> str:
        return "\n".join(p.message for p in self.parts)

    def __str__(self) -> str:
        return self.message

    def __repr__(self) -> str:
        return self.message

    def _repr_html_(self) -> str:  # pragma: no cover - display only
        return "<br>".join(p._repr_html_() for p in self.parts)


def _norm(s: str) -> str:
    return " ".join(str(s).lower().split())


def _strict_gpu_error(exc: BaseException) -> bool:
    """A CUDA error on a strict GPU run (``WORKBOOK_REQUIRE_GPU=1``): it must reach the reader, not a verdict.

    The same rule as the GPU checkers' (``prefetch._gpu_error``), without importing torch here:
    ``torch.AcceleratorError`` is matched by its class name.
    """
    if not config.require_gpu():
        return False
    if any(cls.__name__ == "AcceleratorError" for cls in type(exc).__mro__):
        return True
    return isinstance(exc, RuntimeError) and "CUDA" in str(exc)


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
    result = _evaluate(exercise, answer, expected, hint=hint, explanation=explanation, rel_tol=rel_tol, abs_tol=abs_tol)
    if config.grade_mode() and not result.correct:
        raise AssertionError(result.message)
    return result


def check_parts(exercise: str, **parts: Part) -> ExerciseReport:
    """Check every part of a multi-part exercise and show all their verdicts together.

    ``check_parts("02.3", a=Part(answer_a, expected=...), b=Part(answer_b, expected=...))``
    checks parts "02.3a" and "02.3b". Every part is checked even when an earlier one is
    wrong; with ``WORKBOOK_GRADE=1`` any part that is not right raises ``AssertionError``
    naming all of them.

    Raises:
        ValueError: no parts, or a part that is not a :class:`Part`.
    """
    if not parts:
        raise ValueError("check_parts needs at least one part, e.g. a=Part(answer_a, expected=...)")
    for name, part in parts.items():
        if not isinstance(part, Part):
            raise ValueError(f"part {name!r} must be a Part(answer, expected, ...), got {type(part).__name__}")
    report = ExerciseReport(
        exercise,
        [
            _evaluate(
                f"{exercise}{name}",
                p.answer,
                p.expected,
                hint=p.hint,
                explanation=p.explanation,
                rel_tol=p.rel_tol,
                abs_tol=p.abs_tol,
            )
            for name, p in parts.items()
        ],
    )
    if config.grade_mode() and not report.correct:
        raise AssertionError("\n".join(p.message for p in report.parts if not p.correct))
    return report


def _evaluate(
    exercise: str, answer: Any, expected: Any, *, hint: str, explanation: str, rel_tol: float, abs_tol: float
) -> ExerciseResult:
    """The verdict on one answer, without grade mode's AssertionError."""
    if answer is None or answer is Ellipsis:
        msg = f"Exercise {exercise}: not answered yet." + (f" Hint: {hint}" if hint else "")
        return ExerciseResult(exercise, "unanswered", msg)
    try:
        ok, why = _compare(answer, expected, rel_tol, abs_tol)
    except Exception as exc:  # a reader's odd answer must not crash the checker
        if _strict_gpu_error(exc):  # ... but a strict GPU run's CUDA error must not become a verdict
            raise
        ok, why = False, f"could not compare the answer ({type(exc).__name__}: {exc})"
    if ok:
        msg = f"Exercise {exercise}: correct." + (f" {explanation}" if explanation else "")
        return ExerciseResult(exercise, "correct", msg)
    msg = f"Exercise {exercise}: not quite" + (f" ({why})" if why else "") + "."
    if hint:
        msg += f" Hint: {hint}"
    return ExerciseResult(exercise, "wrong", msg)
