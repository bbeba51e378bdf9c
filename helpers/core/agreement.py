"""Two measurements of one thing: do they agree within their spread? The one way to compare, for every chapter.

Wherever a chapter shows one thing measured twice (a one-pass sweep and alternating rounds, a fit and its
points, two runs of one code path, a setting and its reference in alternating rounds), it prints one
sentence saying whether the two agree within their spread, and which to trust when they do not. The
sentences stay in the chapters (each says it in its own terms); the rule behind each is one of these:

=======================  =====================================================  ===================================
rule                     agree when                                             used by
=======================  =====================================================  ===================================
:func:`spreads_overlap`  two spreads, each a ``(low, high)`` interval, overlap  ch02 ``points_agree`` /
                         (a shared end counts). A spread is the quartiles        ``runs_agree`` (median ± IQR),
                         ``(q1, q3)`` where a timing keeps them, else            ch05 ``same_path_verdict``
                         :func:`median_band` ``(median - IQR, median + IQR)``    (quartiles)
:func:`within_range`     a figure with no spread of its own lies within the     ch02 ``fit_check`` (fit vs a
                         range of repeated measurements of the same thing       point's median ± IQR), ch04
                         (their lowest to highest, ends included)               ``agreement_line``
:func:`ratios_straddle`  per-round ratios (A / B, one per alternating round)    ch03 ``pin_pair_verdict``, ch04
``_one``                 fall on both sides of 1 (or touch it): the rounds      ``difference_line`` /
                         disagree on the direction, so no difference is shown   ``KnobRounds.verdicts``
:func:`ratios_split_on`  the same, allowing a quarter of the rounds (rounded    ch06 ``Waterfall.within_noise``
``_direction``           down) on the other side: one disturbed round in 4+
:func:`within_noise`     a ratio differs from 1 by no more than a measured      ch06 ``Waterfall.within_noise``
``_floor``               noise (a fraction): for per-round ratios, their        (with the rule above and
                         :func:`ratio_noise`                                    :func:`ratio_noise`)
=======================  =====================================================  ===================================

Also: ch00 ``hygiene.sync_verdict`` (:func:`spreads_overlap` on quartiles) and ch01 ``ch01.step_verdict`` /
``ch01.regimes_verdict`` (:func:`within_range`: the predicted step within the measured steps' range).

Two spreads, one rule. Chapter 02's sweep points keep only a median and an IQR, so their spread is the
wider band ``median ± IQR`` (two such bands overlap exactly when the medians differ by at most the sum
of the IQRs); chapter 05's timings keep their quartiles, so theirs is ``(q1, q3)``. Both are
:func:`spreads_overlap`; the wider band errs toward "agree", and each chapter keeps the spread its
data carries (no test has shown either to call a real difference noise, or noise a difference).

Which to trust when two measurements disagree is the chapter's to say, and the sentence must say it:
alternating rounds over a one-pass figure (each round compares the two under the same load), more
samples over fewer, and for the same code timed twice the faster run (load and warm-up only ever add
time). The registry of every pair the chapters show, and the test that each carries a verdict, is
``tests/test_agreement_pairs.py``.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

__all__ = [
    "median_band",
    "spreads_overlap",
    "within_range",
    "ratios_straddle_one",
    "within_noise_floor",
    "ratio_noise",
    "ratios_split_on_direction",
]


def _finite(*values: float) -> bool:
    return all(math.isfinite(float(v)) for v in values)


def median_band(median: float, spread: float) -> tuple[float, float]:
    """The spread of a figure that keeps only its median and IQR: ``(median - IQR, median + IQR)``.

    An IQR of 0 (one sample) gives a band of one point: any difference from it is a miss.
    """
    return (median - spread, median + spread)


def spreads_overlap(a: tuple[float, float], b: tuple[float, float]) -> bool:
    """Whether two measurements of one thing agree: their spreads (``(low, high)`` each) overlap.

    Ends count: ``(1, 2)`` and ``(2, 3)`` overlap. Each pair may be given in either order.

    Raises:
        ValueError: an end that is not a finite number.
    """
    (a_lo, a_hi), (b_lo, b_hi) = sorted(a), sorted(b)
    if not _finite(a_lo, a_hi, b_lo, b_hi):
        raise ValueError(f"spreads_overlap needs finite spreads, got {a!r} and {b!r}")
    return a_lo <= b_hi and b_lo <= a_hi


def within_range(value: float, samples: Sequence[float]) -> bool:
    """Whether ``value`` lies within the range of ``samples`` (their lowest to highest, ends included).

    The rule for a figure with no spread of its own (a one-pass measurement, a model's prediction, or 1.0,
    "no difference") against repeated measurements of the same thing, whose range is the noise band.

    Raises:
        ValueError: no samples, or a value or sample that is not a finite number.
    """
    vals = [float(s) for s in samples]
    if not vals or not _finite(value, *vals):
        raise ValueError(f"within_range needs a finite value and finite samples, got {value!r} and {list(samples)!r}")
    return min(vals) <= float(value) <= max(vals)


def ratios_straddle_one(ratios: Sequence[float]) -> bool:
    """Whether per-round ratios (A / B, one per alternating round) include 1 in their range.

    True: the rounds disagree on the direction (or one round found no difference), so the gap between A and
    B is within the rounds' spread: noise. False: every round points the same way, a difference beyond the
    spread. A single ratio has no spread: it straddles 1 only if it is 1.

    Raises:
        ValueError: no ratios, or one that is not a finite number.
    """
    return within_range(1.0, ratios)


def within_noise_floor(ratio: float, floor: float) -> bool:
    """Whether ``ratio`` differs from 1 by no more than ``floor``, the measured run-to-run noise (a fraction).

    Raises:
        ValueError: a ratio or floor that is not a finite number, or a negative floor.
    """
    if not _finite(ratio, floor) or floor < 0:
        raise ValueError(f"within_noise_floor needs a finite ratio and a floor >= 0, got {ratio!r} and {floor!r}")
    return abs(float(ratio) - 1.0) <= float(floor)


def ratio_noise(ratio_sets: Sequence[Sequence[float]]) -> float | None:
    """How much a per-round ratio scatters: the interquartile range of every round's ratio divided by the
    median of its own set (a fraction; e.g. 0.08: the middle half of the rounds lie within 8% of each other).

    ``ratio_sets``: one set of per-round ratios per pair compared in alternating rounds (A / B, one per round).
    Each is divided by its own median, so pairs with different effects pool into one estimate of the noise of
    a ratio; sets of one round are left out (no spread). The quartiles are ``statistics.quantiles(...,
    method="inclusive")``: for one set of 3 rounds the result is half its range relative to its median.

    The noise of the *ratio*, not of the epoch times: alternating rounds measure neighbours back to back so
    that drift of the machine's speed cancels out of their ratio, and a slow round that slows both sides
    leaves it unchanged. An interquartile range settles as rounds are added (a range keeps widening: more
    rounds, more chances of an outlier), and one outlying round moves it little. With few rounds it reads
    somewhat low (3 rounds: about 60% of what many rounds give), which the direction rule makes up for: with
    up to 3 rounds every round must agree. With :func:`ratios_split_on_direction` and
    :func:`within_noise_floor` it makes chapter 06's verdict: a difference when the rounds agree on the
    direction and the median ratio differs from 1 by more than this.

    Returns:
        The fraction, or None when no set has two rounds.

    Raises:
        ValueError: a ratio that is not a finite positive number.
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
    """Whether per-round ratios (A / B, one per alternating round) fail to agree on a direction.

    They agree when every round but at most a quarter of them (rounded down) lies on the same side of 1:
    all of 1-3 rounds, all but one of 4-7, all but two of 8-11. A round on 1 counts against both sides.
    With up to 3 rounds this is :func:`ratios_straddle_one`; with more it does not turn into "noise"
    because of the one disturbed round that more rounds are ever more likely to contain (a full range
    keeps widening as rounds are added; this rule, like :func:`ratio_noise`, does not).

    True: no direction agreed, so no difference is shown. False: the rounds agree on one.

    Raises:
        ValueError: no ratios, or one that is not a finite number.
    """
    vals = [float(r) for r in ratios]
    if not vals or not _finite(*vals):
        raise ValueError(f"ratios_split_on_direction needs finite ratios, got {list(ratios)!r}")
    need = len(vals) - len(vals) // 4
    return sum(v > 1.0 for v in vals) < need and sum(v < 1.0 for v in vals) < need
