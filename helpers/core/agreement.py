"""Two measurements of one thing: do they agree within their spread? The one way to compare, for every chapter.

Wherever a chapter shows one thing measured twice (a one-pass sweep and alternating rounds, a fit and its
points, two runs of one code path), it prints one sentence, in its own terms, saying whether the two agree
within their spread and which to trust when they do not. The rule behind each sentence is one of these:

=======================  =====================================================  ===================================
rule                     agree when                                             used by
=======================  =====================================================  ===================================
:func:`spreads_overlap`  two spreads, each a ``(low, high)`` interval, overlap  ch02 ``points_agree`` /
                         (a shared end counts): the quartiles ``(q1, q3)``       ``runs_agree`` (median ± IQR),
                         where a timing keeps them, else :func:`median_band`     ch05 ``same_path_verdict``,
                         ``(median - IQR, median + IQR)`` (errs toward agree)    ch00 ``sync_verdict`` (quartiles)
:func:`within_range`     a figure with no spread of its own lies within the     ch02 ``fit_check``, ch04
                         range of repeated measurements of the same thing       ``agreement_line``, ch01
                         (their lowest to highest, ends included)               ``step_verdict``/``regimes_verdict``
:func:`ratios_straddle`  per-round ratios (A / B, one per alternating round)    ch03 ``pin_pair_verdict``, ch04
``_one``                 fall on both sides of 1 (or touch it): no difference   ``difference_line`` / ``verdicts``
:func:`ratios_split_on`  the same, allowing a quarter of the rounds (rounded    ch06 ``Waterfall.within_noise``
``_direction``           down) on the other side: one disturbed round in 4+
:func:`within_noise`     a ratio differs from 1 by no more than a measured      ch06 ``Waterfall.within_noise``
``_floor``               noise (a fraction): per-round ratios' :func:`ratio_noise`
=======================  =====================================================  ===================================

When two measurements disagree, the chapter's sentence says which to trust: alternating rounds over a one-pass
figure (each round compares the two under the same load), more samples over fewer, and for the same code
timed twice the faster run (load and warm-up only add time). ``tests/test_agreement_pairs.py`` registers
every pair the chapters show and checks each carries a verdict.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

__all__ = [
    "median_band", "spreads_overlap", "within_range", "ratios_straddle_one", "within_noise_floor", "ratio_noise",
    "ratios_split_on_direction",
]  # fmt: skip


def _finite(*values: float) -> bool:
    return all(math.isfinite(float(v)) for v in values)


def median_band(median: float, spread: float) -> tuple[float, float]:
    """The spread of a figure that keeps only its median and IQR: ``(median - IQR, median + IQR)``.

    An IQR of 0 (one sample) gives a band of one point: any difference from it is a miss.
    """
    return (median - spread, median + spread)


def spreads_overlap(a: tuple[float, float], b: tuple[float, float]) -> bool:
    """Whether two spreads (``(low, high)`` each, either order) overlap; ends count. ValueError if not finite."""
    (a_lo, a_hi), (b_lo, b_hi) = sorted(a), sorted(b)
    if not _finite(a_lo, a_hi, b_lo, b_hi):
        raise ValueError(f"spreads_overlap needs finite spreads, got {a!r} and {b!r}")
    return a_lo <= b_hi and b_lo <= a_hi


def within_range(value: float, samples: Sequence[float]) -> bool:
    """Whether ``value`` (no spread of its own: a one-pass figure, a prediction, 1.0) lies within the range of
    ``samples`` (repeated measurements of the same thing), ends included. ValueError: none, or not finite."""
    vals = [float(s) for s in samples]
    if not vals or not _finite(value, *vals):
        raise ValueError(f"within_range needs a finite value and finite samples, got {value!r} and {list(samples)!r}")
    return min(vals) <= float(value) <= max(vals)


def ratios_straddle_one(ratios: Sequence[float]) -> bool:
    """Whether per-round ratios (A / B) include 1 in their range: True, the rounds disagree on the direction
    (noise); False, every round points the same way. ValueError: no ratios, or one not finite."""
    return within_range(1.0, ratios)


def within_noise_floor(ratio: float, floor: float) -> bool:
    """Whether ``ratio`` differs from 1 by no more than ``floor``, the measured noise (a fraction >= 0)."""
    if not _finite(ratio, floor) or floor < 0:
        raise ValueError(f"within_noise_floor needs a finite ratio and a floor >= 0, got {ratio!r} and {floor!r}")
    return abs(float(ratio) - 1.0) <= float(floor)


def ratio_noise(ratio_sets: Sequence[Sequence[float]]) -> float | None:
    """How much a per-round ratio scatters: the IQR of every round's ratio over its own set's median (a fraction;
    0.08: the middle half of the rounds lie within 8%), or None when no set has two rounds.

    ``ratio_sets``: per-round ratios (A / B) of each pair compared in alternating rounds; dividing each by its
    own median pools pairs with different effects. The noise of the *ratio*: drift that slows both sides of a
    round cancels out of it. An IQR settles as rounds are added (a range keeps widening) and reads somewhat low
    with few (3 rounds: about 60%), which the direction rule makes up for. With
    :func:`ratios_split_on_direction` and :func:`within_noise_floor` it makes chapter 06's verdict.
    """
    pooled: list[float] = []
    for ratios in ratio_sets:
        vals = [float(r) for r in ratios]
        if not _finite(*vals) or any(v <= 0 for v in vals):
            raise ValueError(f"ratio_noise needs finite positive ratios, got {list(ratios)!r}")
        if len(vals) > 1:
            mid = statistics.median(vals)
            pooled += [v / mid for v in vals]
    if len(pooled) < 2:
        return None
    q1, _, q3 = statistics.quantiles(pooled, n=4, method="inclusive")
    return q3 - q1


def ratios_split_on_direction(ratios: Sequence[float]) -> bool:
    """Whether per-round ratios (A / B) fail to agree on a direction (True: no difference is shown).

    They agree when all but a quarter of the rounds (rounded down) lie on one side of 1: all of 1-3, all but
    one of 4-7. A round on 1 counts against both sides. With up to 3 rounds this is :func:`ratios_straddle_one`;
    with more, the one disturbed round that more rounds ever more likely contain does not make it "noise".
    """
    vals = [float(r) for r in ratios]
    if not vals or not _finite(*vals):
        raise ValueError(f"ratios_split_on_direction needs finite ratios, got {list(ratios)!r}")
    need = len(vals) - len(vals) // 4
    return sum(v > 1.0 for v in vals) < need and sum(v < 1.0 for v in vals) < need
