"""The kernel's one alternating-rounds runner and one table renderer."""

from __future__ import annotations

import pytest

from helpers.core.rounds import Rounds, alternate, table


def test_order_reverses_every_other_round() -> None:
    calls: list[str] = []
    r = alternate({k: (lambda k=k: calls.append(k) or 1.0) for k in "abc"}, rounds=3)
    assert calls == list("abccbaabc")
    assert r.n == 3 and r.values["a"] == [1.0, 1.0, 1.0]


def test_ratios_are_within_a_round() -> None:
    r = Rounds(("a", "b"), {"a": [1.0, 2.0, 4.0], "b": [2.0, 2.0, 2.0]})
    assert r.ratios("b", "a") == [2.0, 1.0, 0.5]
    assert r.ratio("b", "a") == 1.0
    assert r.median("a") == 2.0


def test_progress_reaches_the_measure_and_ends_at_one() -> None:
    seen: list[tuple[float, str]] = []
    inner: list[float] = []

    def slow(progress) -> float:  # type: ignore[no-untyped-def]
        progress(0.5, "half")
        inner.append(1.0)
        return 3.0

    alternate({"fast": lambda: 1.0, "slow": slow}, 2, progress=lambda f, t="": seen.append((f, t)))
    assert inner == [1.0, 1.0]
    assert (0.25 + 0.125, "round 1/2, slow: half") in seen
    assert seen[-1] == (1.0, "done")
    assert all(a[0] <= b[0] for a, b in zip(seen, seen[1:]))


@pytest.mark.parametrize("rounds", [0, -1, 1.5, "3"])
def test_bad_rounds_say_what_to_do(rounds: object) -> None:
    with pytest.raises(ValueError, match="rounds"):
        alternate({"a": lambda: 1.0}, rounds)  # type: ignore[arg-type]


def test_no_configuration_is_refused() -> None:
    with pytest.raises(ValueError, match="at least one"):
        alternate({}, 2)


def test_table_aligns_and_checks_row_length() -> None:
    lines = table(["name", "ms"], [["copy", "1.50"], ["compute", "12.25"]])
    assert lines == ["name        ms", "copy      1.50", "compute  12.25"]
    assert len({len(line) for line in lines}) == 1
    with pytest.raises(ValueError, match="one per header"):
        table(["a", "b"], [["only one"]])
