from __future__ import annotations

import doctest

from helpers.core import progress


def test_doctests() -> None:
    assert doctest.testmod(progress).failed == 0


def test_progress_bar_counts_percent_and_closes() -> None:
    with progress.progress_bar("demo") as p:
        p(0.25, "a quarter")
        p(0.1)  # never goes backwards
        assert p.bar.n == 25
        p(2.0)
        assert p.bar.n == 100
        p("not a number")  # ignored, never raises
    assert p.bar.disable or p.bar.n == 100


def test_scaled_without_progress_is_silent() -> None:
    progress.scaled(None, 0, 1)(0.5, "x")
