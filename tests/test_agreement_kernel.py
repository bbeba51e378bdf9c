"""The agreement rules (helpers/core/agreement.py): one way to say whether two measurements of one thing agree.

Each rule on hand-made inputs, its edges and its refusals; then each chapter function that states an agreement
is checked to decide exactly as its rule does, on many random inputs (the rules moved into the kernel without
changing any chapter's verdict).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest

from helpers.chapters import ch02, ch03
from helpers.chapters.ch02.copies import MiB, Sweep, TransferPoint
from helpers.chapters.ch03 import pinning
from helpers.chapters.ch04 import speedup, sweeps
from helpers.chapters.ch05 import gpudecode
from helpers.core import agreement as A
from helpers.core.timing import Timing
from helpers.pipeline import loaders as L


def test_median_band_is_the_median_plus_or_minus_the_spread() -> None:
    assert A.median_band(10.0, 2.0) == (8.0, 12.0)
    assert A.median_band(10.0, 0.0) == (10.0, 10.0)  # one sample: a band of one point


def test_spreads_overlap_counts_shared_ends_and_any_order() -> None:
    assert A.spreads_overlap((1.0, 2.0), (1.5, 3.0))
    assert A.spreads_overlap((1.0, 2.0), (2.0, 3.0))  # a shared end
    assert A.spreads_overlap((2.0, 1.0), (3.0, 2.0))  # ends in either order
    assert A.spreads_overlap((0.0, 10.0), (4.0, 5.0))  # one inside the other
    assert not A.spreads_overlap((1.0, 2.0), (2.5, 3.0))
    assert not A.spreads_overlap((2.5, 3.0), (1.0, 2.0))
    with pytest.raises(ValueError, match="finite"):
        A.spreads_overlap((1.0, float("nan")), (1.0, 2.0))


def test_two_median_bands_overlap_exactly_when_the_gap_is_at_most_the_summed_spreads() -> None:
    rng = random.Random(0)
    for _ in range(2000):
        ma, mb = rng.uniform(1, 100), rng.uniform(1, 100)
        ia, ib = rng.choice([0.0, rng.uniform(0, 30)]), rng.uniform(0, 30)
        bands = A.spreads_overlap(A.median_band(ma, ia), A.median_band(mb, ib))
        assert bands == (abs(ma - mb) <= ia + ib) or abs(abs(ma - mb) - (ia + ib)) < 1e-9


def test_within_range_includes_the_ends_and_refuses_no_samples() -> None:
    assert A.within_range(1.5, [1.3, 1.44, 1.6])
    assert A.within_range(1.3, [1.6, 1.3]) and A.within_range(1.6, [1.3, 1.6])
    assert not A.within_range(0.96, [1.3, 1.6]) and not A.within_range(1.7, [1.3, 1.6])
    assert A.within_range(2.0, [2.0])  # one sample: only that value
    for value, bad in ((1.0, []), (1.0, [float("nan")]), (float("inf"), [1.0, 2.0])):
        with pytest.raises(ValueError, match="finite"):
            A.within_range(value, bad)


def test_ratios_straddle_one_when_the_rounds_disagree_on_the_direction() -> None:
    assert A.ratios_straddle_one([0.95, 1.1, 1.4])
    assert A.ratios_straddle_one([1.0, 1.2])  # one round found no difference
    assert not A.ratios_straddle_one([1.05, 1.1, 1.4])  # faster in every round
    assert not A.ratios_straddle_one([0.5, 0.7])  # slower in every round
    assert not A.ratios_straddle_one([1.3])  # one ratio: no spread, not 1
    with pytest.raises(ValueError, match="finite"):
        A.ratios_straddle_one([])


def test_within_noise_floor() -> None:
    assert A.within_noise_floor(1.1, 0.15) and A.within_noise_floor(0.9, 0.1)
    assert not A.within_noise_floor(1.3, 0.15)
    assert A.within_noise_floor(1.0, 0.0)
    for ratio, floor in ((float("nan"), 0.1), (1.0, -0.1)):
        with pytest.raises(ValueError, match="floor"):
            A.within_noise_floor(ratio, floor)


def test_ratio_noise_is_the_interquartile_range_of_the_rounds_relative_to_their_median() -> None:
    assert A.ratio_noise([[0.9, 1.0, 1.2]]) == pytest.approx(0.15)  # three rounds: half the range over the median
    assert A.ratio_noise([[2.0, 2.0, 2.0]]) == 0.0  # every round the same ratio: no scatter, whatever the ratio
    # sets with different effects pool, each relative to its own median: x2 and x0.5 scatter alike here
    same = A.ratio_noise([[0.9, 1.0, 1.2], [0.9, 1.0, 1.2]])
    assert A.ratio_noise([[1.8, 2.0, 2.4], [0.45, 0.5, 0.6]]) == pytest.approx(same)
    assert A.ratio_noise([[1.3], [0.7]]) is None and A.ratio_noise([]) is None  # one round: no spread
    for bad in ([[1.0, float("nan")]], [[1.0, 0.0]], [[-1.0, 1.0]]):
        with pytest.raises(ValueError, match="finite positive"):
            A.ratio_noise(bad)


def test_ratio_noise_settles_as_rounds_are_added_where_a_range_keeps_widening() -> None:
    rng = random.Random(1)

    def typical(n: int, measure: Callable[[list[float]], float]) -> float:  # median over 400 sets of n rounds
        values = sorted(measure([rng.lognormvariate(0, 0.1) for _ in range(n)]) for _ in range(400))
        return values[200]

    def width(s: list[float]) -> float:
        return max(s) - min(s)

    def iqr(s: list[float]) -> float:
        return A.ratio_noise([s]) or 0.0

    assert typical(60, width) > 1.25 * typical(15, width)  # a range widens with more rounds ...
    assert typical(60, iqr) == pytest.approx(typical(15, iqr), rel=0.15)  # ... the interquartile range settles
    outlier = A.ratio_noise([[1.0, 1.02, 0.98, 1.01, 0.99, 3.0]])
    assert outlier is not None and outlier < 0.05  # one disturbed round moves it little


def test_ratios_split_on_direction_allows_a_quarter_of_the_rounds_on_the_other_side() -> None:
    rng = random.Random(2)
    for _ in range(500):  # up to 3 rounds: every round must agree, as ratios_straddle_one says
        ratios = [rng.choice([1.0, rng.uniform(0.5, 1.5)]) for _ in range(rng.randint(1, 3))]
        assert A.ratios_split_on_direction(ratios) == A.ratios_straddle_one(ratios)
    assert not A.ratios_split_on_direction([1.4, 1.4, 0.9, 1.5, 1.4])  # one disturbed round in 5
    assert A.ratios_split_on_direction([1.4, 0.95, 0.9, 1.5, 1.4])  # two in 5: no direction
    assert A.ratios_split_on_direction([1.4, 1.0, 1.3, 1.5, 1.0])  # a round on 1 counts against both sides
    assert not A.ratios_split_on_direction([0.7] * 6 + [1.2, 1.1])  # 2 of 8 may disagree
    assert A.ratios_split_on_direction([0.7] * 5 + [1.2, 1.1, 1.0])
    with pytest.raises(ValueError, match="finite"):
        A.ratios_split_on_direction([])


# --- each chapter function decides as its rule does (the old inline rules, restated here) ---------------------


def _point(median: float, iqr: float) -> TransferPoint:
    return TransferPoint(MiB, "h2h", "pageable", median, iqr, n=10)


def test_ch02_points_agree_is_the_median_band_rule() -> None:
    rng = random.Random(1)
    for _ in range(300):
        a = _point(rng.uniform(1e-5, 1e-3), rng.choice([0.0, rng.uniform(0, 2e-4)]))
        b = _point(rng.uniform(1e-5, 1e-3), rng.uniform(0, 2e-4))
        old = abs(a.median_s - b.median_s) <= a.iqr_s + b.iqr_s  # the rule before the kernel
        line = ch02.points_agree("a", a, "b", b)
        assert ("they agree within their spread" in line) == old
        assert ("do NOT agree" in line) == (not old)


def test_ch02_fit_check_is_the_within_range_rule() -> None:
    rng = random.Random(2)
    sizes = [4096 * 4**k for k in range(6)]
    for _ in range(50):
        pts = [TransferPoint(n, "h2h", "pageable", (t := 5e-6 + n / 10e9) * rng.uniform(0.7, 1.3),
                             t * rng.choice([0.0, 0.01, 0.2]), n=10) for n in sizes]  # fmt: skip
        sw = Sweep("h2h", "pageable", pts)
        fit = sw.fit()
        old = [p.nbytes for p in pts if abs(fit.predict_s(p.nbytes) - p.median_s) > p.iqr_s]
        assert [m[0] for m in ch02.fit_check(sw, fit).misses] == old


def _timing(ms: list[float]) -> Timing:
    s = sorted(v / 1e3 for v in ms)
    return Timing("t", s[len(s) // 2], 0.0, sum(s) / len(s), s[0], s[-1], len(s), times_s=s)


def test_ch05_same_path_verdict_is_the_quartiles_rule() -> None:
    rng = random.Random(3)
    for _ in range(300):
        a = _timing([rng.uniform(20, 40) for _ in range(rng.randint(3, 9))])
        b = _timing([rng.uniform(25, 60) for _ in range(rng.randint(3, 9))])
        (a_lo, a_hi), (b_lo, b_hi) = a.quartiles_s, b.quartiles_s
        old = a_lo <= b_hi and b_lo <= a_hi
        cmp = gpudecode.DecodeComparison("cpu", False, 4, 8, 16, 1, {}, a, b, pinned=False)
        line = cmp.verdict
        assert ("agree within their spread" in line and "NOT" not in line) == old


def _pin_rows(on: list[float], off: list[float]) -> list[pinning.PinRow]:
    def row(pin: bool, rounds: list[float]) -> pinning.PinRow:
        res = L.Throughput(label=f"pin_memory={pin}", config={}, items=100, batches=10, seconds=1.0, startup_s=0.0,
                           warmup_batches=0, epochs_started=1)  # fmt: skip
        return pinning.PinRow(0, pin, res, False, None, None, rounds)

    return [row(False, off), row(True, on)]


def test_ch03_and_ch04_ratio_verdicts_are_the_straddle_rule() -> None:
    rng = random.Random(4)
    for _ in range(200):
        n = rng.randint(2, 6)
        on, off = [rng.uniform(80, 130) for _ in range(n)], [rng.uniform(80, 130) for _ in range(n)]
        ratios = [a / b for a, b in zip(on, off)]
        old = min(ratios) <= 1.0 <= max(ratios)
        assert ("within noise" in ch03.pin_pair_verdict(_pin_rows(on, off))) == old
        (verdict,) = speedup.LoaderRounds("k", {1: on, 2: off}, 2).verdicts()
        assert ("within the noise" in verdict) == old
        one_pass = rng.uniform(0.8, 1.3)
        results: list[Any] = [SimpleNamespace(items_per_s=v) for v in (1.0, one_pass)]
        sweep = sweeps.WorkerSweep(workers=[0, 2], results=results, cores=2)
        (line,) = speedup.sweep_vs_rounds(sweep, speedup.LoaderRounds("num_workers", {0: off, 2: on}, 0))
        assert line.endswith("agree within their spread") == (min(ratios) <= one_pass <= max(ratios))
