"""Two measurements of one thing: do they agree within their spread? The rules every chapter's verdict uses.

When they disagree, trust alternating rounds over a one-pass figure (each round compares under the same load),
more samples over fewer, and of the same code timed twice the faster run (load and warm-up only add time).
``tests/test_agreement_pairs.py`` registers every pair the chapters show.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

__all__ = [  # the rules (tests/test_agreement_pairs.py: a verdict's chain ends in one of them)
    "median_band", "spreads_overlap", "within_range", "ratios_straddle_one", "within_noise_floor", "ratio_noise",
    "ratios_split_on_direction",
]  # fmt: skip


def _finite(*values: float) -> bool:
    return all(math.isfinite(float(v)) for v in values)


def median_band(median: float, spread: float) -> tuple[float, float]:
    """The spread of a figure that keeps only its median and IQR (0, one sample: a point, any difference misses)."""
    return (median - spread, median + spread)


def spreads_overlap(a: tuple[float, float], b: tuple[float, float]) -> bool:
    """Whether two spreads (``(low, high)`` each, either order) overlap; ends count. ValueError if not finite."""
    (a_lo, a_hi), (b_lo, b_hi) = sorted(a), sorted(b)
    if not _finite(a_lo, a_hi, b_lo, b_hi):
        raise ValueError(f"spreads_overlap needs finite spreads, got {a!r} and {b!r}")
    return a_lo <= b_hi and b_lo <= a_hi


def within_range(value: float, samples: Sequence[float]) -> bool:
    """Whether ``value`` (no spread of its own) lies within ``samples``' lowest..highest, ends included."""
    vals = [float(s) for s in samples]
    if not vals or not _finite(value, *vals):
        raise ValueError(f"within_range needs a finite value and finite samples, got {value!r} and {list(samples)!r}")
    return min(vals) <= float(value) <= max(vals)


def ratios_straddle_one(ratios: Sequence[float]) -> bool:
    """True when per-round ratios (A / B) include 1 in their range: the rounds disagree on the direction."""
    return within_range(1.0, ratios)


def within_noise_floor(ratio: float, floor: float) -> bool:
    """Whether ``ratio`` differs from 1 by no more than ``floor``, the measured noise (a fraction >= 0)."""
    if not _finite(ratio, floor) or floor < 0:
        raise ValueError(f"within_noise_floor needs a finite ratio and a floor >= 0, got {ratio!r} and {floor!r}")
    return abs(float(ratio) - 1.0) <= float(floor)


def ratio_noise(ratio_sets: Sequence[Sequence[float]]) -> float | None:
    """The IQR of every round's ratio over its own set's median (0.08: the middle half lie within 8%), or None
    when no set has two rounds. Per-set medians pool pairs with different effects; an IQR settles as rounds are
    added (a range keeps widening) but reads low with few rounds, which the direction rule makes up for."""
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
    """Whether per-round ratios (A / B) fail to agree on a direction (True: no difference is shown). They agree
    when all but a quarter of the rounds (rounded down) lie on one side of 1 (a round on 1 counts against both),
    so the one disturbed round that more rounds ever more likely contain does not make it "noise"."""
    vals = [float(r) for r in ratios]
    if not vals or not _finite(*vals):
        raise ValueError(f"ratios_split_on_direction needs finite ratios, got {list(ratios)!r}")
    need = len(vals) - len(vals) // 4
    return sum(v > 1.0 for v in vals) < need and sum(v < 1.0 for v in vals) < need
