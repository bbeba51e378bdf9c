"""Chapter 03's section-4 verdict: the pin_memory pair's gap is called noise only within the rounds' spread.

Issue #28.3: a 27% gap between two settings that, on a CPU, do the same work was printed beside "noise".
The verdict now follows from the per-round ratios, and a gap beyond their spread is reported as a gap,
with its cause and the figure to trust. Synthetic rows: nothing here is timed.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers.chapters import ch03
from helpers.chapters.ch03 import pinning
from helpers.pipeline import loaders as L

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "03_dataloader_pinning.ipynb"


def _row(pin_memory: bool, rounds: list[float], *, pin_active: bool = False) -> pinning.PinRow:
    result = L.Throughput(
        label=f"pin_memory={pin_memory}",
        config={},
        items=100,
        batches=10,
        seconds=1.0,
        startup_s=0.0,
        warmup_batches=0,
        epochs_started=1,
    )
    return pinning.PinRow(0, pin_memory, result, pin_active and pin_memory, None, None, rounds)


def test_a_gap_within_the_rounds_spread_is_within_noise() -> None:
    rows = [_row(False, [100.0, 100.0, 100.0]), _row(True, [127.0, 95.0, 140.0])]
    verdict = ch03.pin_pair_verdict(rows)
    assert "x1.27, within noise (127 vs 100 items/s" in verdict and "0.95-1.40x" in verdict
    assert "beyond" not in verdict and "faster" not in verdict  # a gap within noise is not called faster


def test_a_gap_beyond_the_spread_without_an_accelerator_is_load_not_the_flag() -> None:
    rows = [_row(False, [100.0, 110.0, 90.0]), _row(True, [127.0, 140.0, 110.0])]
    verdict = ch03.pin_pair_verdict(rows)
    assert "27% faster" in verdict and "within noise" not in verdict
    assert "beyond the rounds' spread" in verdict and "nothing was pinned" in verdict
    assert "load on this machine, not the flag" in verdict
    assert "Trust the faster figure, pin_memory=True at 127 items/s" in verdict  # the median of its rounds


def test_a_slower_gap_names_the_other_setting_to_trust() -> None:
    rows = [_row(False, [100.0, 100.0]), _row(True, [70.0, 80.0])]
    verdict = ch03.pin_pair_verdict(rows)
    assert "25% slower" in verdict and "pin_memory=False at 100 items/s" in verdict


def test_a_gap_beyond_the_spread_with_pinning_is_the_flags_effect() -> None:
    rows = [_row(False, [100.0, 100.0, 100.0]), _row(True, [80.0, 85.0, 90.0], pin_active=True)]
    verdict = ch03.pin_pair_verdict(rows)
    assert "slower in every round" in verdict and "the flag's effect" in verdict and "load" not in verdict


def test_the_gap_is_the_tables_medians_not_the_median_ratio() -> None:
    # Measured in this chapter on a busy CPU: True's median is lower although the median ratio is above 1.
    rows = [_row(False, [655.0, 752.0, 759.0]), _row(True, [724.0, 711.0, 1576.0])]
    verdict = ch03.pin_pair_verdict(rows)
    assert verdict.startswith("pin_memory=True vs False: x0.96, within noise (724 vs 752 items/s;")
    assert "slower" not in verdict


def test_one_round_cannot_tell_and_bad_rows_are_refused() -> None:
    one = ch03.pin_pair_verdict([_row(False, [100.0]), _row(True, [130.0])])
    assert "can't tell" in one and "x1.30 (130 vs 100" in one and "faster" not in one
    with pytest.raises(ValueError, match="pair"):
        ch03.pin_pair_verdict([_row(False, [100.0])])


def test_the_notebook_prints_this_verdict_and_its_text_matches() -> None:
    cells = json.loads(NOTEBOOK.read_text())["cells"]
    code = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
    text = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")
    assert "VERDICT = ch03.pin_pair_verdict(rows)" in code and "print(textwrap.fill(VERDICT" in code
    assert "differs only by noise" not in text  # the old, unconditional claim
    assert "within noise" in text and "trust the faster figure" in text
