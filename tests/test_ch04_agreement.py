"""Chapter 04: two measurements of one thing get a verdict (issue 28, item 3: no silent contradictions).

The one-pass worker sweep and the alternating rounds both measure the 2-worker speed-up; the prefetch_factor
rows are compared in alternating rounds. Each pair gets one line: agree / disagree (trust the rounds), or
within the noise / a real difference. Synthetic figures throughout (no speed is asserted), except one tiny
real run of ``knob_rounds`` that checks its bookkeeping and that its workers are released.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from torch.utils.data import DataLoader

from helpers.chapters import ch04
from helpers.chapters.ch04 import speedup, sweeps
from helpers.chapters.ch04.datasets import CheapDataset
from helpers.core.results import ResultSet
from helpers.pipeline import loaders as L

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "04_worker_processes.ipynb"
TRUST = (
    "trust the alternating rounds (each round compares the two settings under the same load; "
    "the one-pass sweep measures each setting once, at different moments)"
)


def _sweep(rates: dict[int, float]) -> sweeps.WorkerSweep:
    results: list[Any] = [SimpleNamespace(items_per_s=r) for r in rates.values()]
    return sweeps.WorkerSweep(workers=list(rates), results=results, cores=2)


def _rounds(single: list[float], workers: list[float], n: int = 2, ceiling: float = 0.0) -> speedup.LoaderRounds:
    ceil = [ceiling] * len(single) if ceiling else []
    return speedup.LoaderRounds("num_workers", {0: single, n: workers}, 0, ceil)


def test_sweep_vs_rounds_agrees_or_says_to_trust_the_rounds() -> None:
    (agree,) = speedup.sweep_vs_rounds(_sweep({0: 100.0, 2: 150.0}), _rounds([100.0] * 3, [130.0, 144.0, 160.0]))
    assert agree.endswith("agree within their spread") and "num_workers=2" in agree
    assert "no spread of its own" in agree and "1.50x" in agree and "1.30-1.60x" in agree
    (disagree,) = speedup.sweep_vs_rounds(_sweep({0: 100.0, 2: 96.0}), _rounds([100.0] * 3, [130.0, 144.0, 160.0]))
    assert disagree.endswith(f"disagree: {TRUST}") and "0.96x" in disagree and "1.44x" in disagree
    assert speedup.TRUST_ROUNDS == TRUST


def _verdict(ratios: list[float]) -> str:
    (line,) = speedup.LoaderRounds("prefetch_factor", {2: [1.0] * len(ratios), 4: ratios}, 2).verdicts()
    return line


def test_verdicts_within_the_noise_or_a_real_difference() -> None:
    noise = _verdict([0.8, 0.95, 1.1])
    assert "prefetch_factor=4 vs 2" in noise and "within the noise" in noise and "real" not in noise
    real = _verdict([0.5, 0.6, 0.55, 0.7, 0.52])
    assert "a real difference (slower in all 5 rounds" in real and "1 time in 16" in real
    faster = _verdict([1.1, 1.2, 1.3])
    assert "faster in all 3 rounds" in faster and "1 time in 4" in faster


def test_sweep_vs_rounds_gives_one_verdict_per_shared_worker_count() -> None:
    sweep = _sweep({0: 100.0, 1: 90.0, 2: 96.0, 3: 150.0})  # the one-pass sweep: 2 workers x0.96
    r2 = _rounds([100.0, 100.0, 100.0], [130.0, 144.0, 160.0])  # the rounds: x1.30-x1.60
    r3 = _rounds([100.0, 100.0], [140.0, 170.0], n=3)  # x1.50 lies within x1.40-x1.70
    r5 = _rounds([100.0], [200.0], n=5)  # not in the sweep: no verdict
    (two,), (three,) = speedup.sweep_vs_rounds(sweep, r2), speedup.sweep_vs_rounds(sweep, r3)
    assert two.startswith("num_workers=2:") and two.endswith(f"disagree: {TRUST}")
    assert three.startswith("num_workers=3:") and three.endswith("agree within their spread")
    assert speedup.sweep_vs_rounds(sweep, r5) == []
    assert speedup.sweep_vs_rounds(sweep, speedup.LoaderRounds("prefetch_factor", {2: [1.0], 3: [1.0]}, 2)) == []


def test_the_benchmark_flags_a_speedup_the_sweep_contradicts(monkeypatch: pytest.MonkeyPatch) -> None:
    sweep = _sweep({0: 100.0, 1: 95.0, 2: 96.0, 3: 120.0})
    monkeypatch.setattr(sweeps, "sweep_workers", lambda *a, **k: sweep)
    monkeypatch.setattr(
        speedup, "knob_rounds", lambda *a, **k: _rounds([100.0] * 3, [130.0, 144.0, 160.0], ceiling=190.0)
    )
    rs = ResultSet.new("t", "synthetic")
    ch04._sweep_and_speedup(rs, {"float": CheapDataset(8, 4), "uint8": CheapDataset(8, 4)}, 4, 2, 0)
    (up,) = rs.find("ch04.speedup", output="float")
    assert any(f.endswith(f"disagree: {TRUST}") for f in up.flags), up.flags
    (up8,) = rs.find("ch04.speedup", output="uint8")
    assert not any("disagree" in f for f in up8.flags)  # no one-pass figure for uint8


def test_knob_rounds_measures_every_value_each_round_and_releases_its_workers() -> None:
    ds = CheapDataset(64, 4)
    kr = speedup.knob_rounds(
        lambda f: DataLoader(ds, batch_size=8, num_workers=1, persistent_workers=True, prefetch_factor=f),
        "prefetch_factor",
        [1, 2],
        reference=2,
        rounds=2,
        batches=2,
        warmup=0,
    )
    assert set(kr.rates) == {1, 2} and all(len(r) == 2 and min(r) > 0 for r in kr.rates.values())
    (line,) = kr.verdicts()
    assert line.startswith("prefetch_factor=1 vs 2") and ("within the noise" in line or "a real difference" in line)
    assert len(kr.table()) == 4 and not L.worker_processes()  # a row per round, and the medians
    with pytest.raises(ValueError, match="refus|asked for|pass the value"):
        speedup.knob_rounds(lambda f: DataLoader(ds, batch_size=8), "prefetch_factor", [1, 2], rounds=1, batches=1)
    with pytest.raises(ValueError, match="two settings"):
        speedup.knob_rounds(lambda f: DataLoader(ds, batch_size=8), "prefetch_factor", [1])


@pytest.mark.parametrize("values, reference", [([2, 0], None), ([1, 2], None), ([0, 2], 2), ([0, 2, 1], None)])
def test_worker_rounds_refuse_counts_the_ceiling_cannot_be_set_against(values: list[int], reference: Any) -> None:
    """num_workers rounds compare with 0 workers and set the largest count, last, against its ceiling."""
    with pytest.raises(ValueError, match=r"such as \[0, 2\]"):
        speedup.knob_rounds(lambda w: DataLoader(CheapDataset(16, 4), batch_size=4), "num_workers", values,
                            reference=reference)  # fmt: skip
    assert not L.worker_processes()


def _cells() -> list[dict[str, Any]]:
    return json.loads(NOTEBOOK.read_text())["cells"]


def test_the_notebook_prints_the_verdicts_and_its_text_matches_them() -> None:
    cells = _cells()
    code = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
    text = " ".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown").replace("\n", " ")
    assert "speedup.sweep_vs_rounds(sweep, ROUNDS)" in code  # section 1b: the sweep's point against the rounds
    assert "speedup.knob_rounds(" in code and "pf.verdicts()" in code  # section 2: rounds, with verdicts
    assert "knob_experiment(" not in code  # no single-measurement rows left without a verdict
    for phrase in ("agree within their spread", "trust the alternating rounds", "within the noise",
                   "a real difference", "each round compares the two settings under the same load",
                   "measures each setting once, at different moments"):  # fmt: skip
        assert phrase in text, phrase
