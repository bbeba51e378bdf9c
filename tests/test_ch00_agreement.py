"""Chapter 00's sync demo without a GPU: the two timings of the same work get a measured verdict (issue #28.3).

On a CPU the "no sync" and "sync" timings time the same synchronous work. The cell printed "only noise
separates them" whatever the two medians were; :func:`helpers.chapters.ch00.hygiene.sync_verdict` now says whether
their interquartile ranges overlap (:func:`helpers.core.agreement.spreads_overlap`) and, when they do not,
which one to trust. Synthetic timings: nothing here is timed.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from helpers.chapters.ch00 import hygiene
from helpers.core import agreement
from helpers.core.timing import Timing

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "00_setup_and_measuring.ipynb"


def _timing(ms: list[float]) -> Timing:
    s = sorted(v / 1e3 for v in ms)
    return Timing("t", s[len(s) // 2], 0.0, sum(s) / len(s), s[0], s[-1], len(s), times_s=s)


def _flat(text: str) -> str:
    return " ".join(text.split())


def test_overlapping_quartiles_agree_and_the_gap_is_noise() -> None:
    text = _flat(hygiene.sync_verdict(_timing([10.0, 10.4, 10.8, 11.5]), _timing([10.2, 10.6, 11.0, 12.0])))
    assert "agree within their spread" in text and "NOT" not in text
    assert "The gap is noise." in text and "trust" not in text
    assert "no sync 10.800 ms" in text and "sync 11.000 ms" in text  # the medians the cell printed above


@pytest.mark.parametrize(
    ("no_sync", "sync", "trusted"),
    [
        ([10.0, 10.2, 10.4, 10.6], [14.0, 14.2, 14.4, 14.6], "trust the faster, no sync, timed first, 10.400 ms"),
        ([14.0, 14.2, 14.4, 14.6], [10.0, 10.2, 10.4, 10.6], "trust the faster, sync, timed second, 10.400 ms"),
    ],
)
def test_quartiles_apart_do_not_agree_and_the_faster_is_trusted(
    no_sync: list[float], sync: list[float], trusted: str
) -> None:
    text = _flat(hygiene.sync_verdict(_timing(no_sync), _timing(sync)))
    assert "do NOT agree within their spread" in text and "do not overlap" in text
    assert "warm-up or load on this machine, not the clock" in text
    assert trusted in text


def test_the_verdict_is_the_kernel_rule_on_the_quartiles() -> None:
    rng = random.Random(0)
    for _ in range(300):
        a = _timing([rng.uniform(5, 15) for _ in range(rng.randint(3, 12))])
        b = _timing([rng.uniform(5, 15) for _ in range(rng.randint(3, 12))])
        agree = agreement.spreads_overlap(a.quartiles_s, b.quartiles_s)
        assert ("do NOT agree" not in _flat(hygiene.sync_verdict(a, b))) == agree


@pytest.mark.parametrize("scale_ms", [1e-4, 0.05, 3.0, 900.0, 2e5])
def test_every_printed_line_fits_for_any_plausible_size(scale_ms: float) -> None:
    for a, b in (([1.0, 1.1, 1.2], [1.05, 1.15, 1.3]), ([1.0, 1.01, 1.02], [7.77, 7.78, 7.79])):
        text = hygiene.sync_verdict(_timing([v * scale_ms for v in a]), _timing([v * scale_ms for v in b]))
        assert max(len(line) for line in text.splitlines()) <= 110, text


def test_the_notebook_prints_the_verdict_on_a_cpu_not_a_fixed_sentence() -> None:
    cells = ["".join(c["source"]) for c in json.loads(NOTEBOOK.read_text(encoding="utf-8"))["cells"]]
    (cell,) = [c for c in cells if "demo = hygiene.sync_demo(" in c]
    assert 'hygiene.sync_verdict(demo["no sync"], demo["sync"])' in cell
    assert "only noise separates them" not in cell
