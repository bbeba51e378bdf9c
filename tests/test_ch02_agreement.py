"""Chapter 02 states whether two measurements of one thing agree (issue #28, item 3), from synthetic sweeps."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers.chapters import ch02
from helpers.chapters.ch02 import model
from helpers.chapters.ch02.copies import Sweep, TransferPoint
from helpers.chapters.ch02.model import KiB, MiB

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "02_pageable_vs_pinned.ipynb"


def _sweep(times_iqrs: list[tuple[int, float, float]]) -> Sweep:
    pts = [TransferPoint(n, "h2h", "pageable", t, iqr, n=10) for n, t, iqr in times_iqrs]
    return Sweep("h2h", "pageable", pts)


def test_fit_agrees_when_points_follow_the_model_within_their_spread() -> None:
    lat, bw = 5e-6, 10e9
    sw = _sweep([(n, lat + n / bw, 0.05 * (lat + n / bw)) for n in (4 * KiB, 64 * KiB, MiB, 16 * MiB)])
    check = ch02.fit_check(sw)
    assert check.agrees and check.n_points == 4
    assert "within the points' spread" in check.verdict() and "every size" in check.verdict()


def test_fit_that_misses_its_points_says_so_and_which_to_trust() -> None:
    # Cache-resident mid sizes 4x faster than RAM-bound large ones: no latency+bandwidth line fits, tight IQRs.
    sizes = [4 * KiB, 64 * KiB, MiB, 4 * MiB, 64 * MiB, 256 * MiB]
    rates = [5e9, 40e9, 42e9, 42e9, 11e9, 11.5e9]
    sw = _sweep([(n, n / r, 0.01 * n / r) for n, r in zip(sizes, rates)])
    fit = sw.fit()
    check = ch02.fit_check(sw, fit)
    assert not check.agrees
    verdict = check.verdict()
    assert f"misses {len(check.misses)} of 6 sizes" in verdict and "trust the points" in verdict
    # The worst miss it reports is at least the misfit the chapter's table prints (worst misfit ...%).
    assert max(m[1] for m in check.misses) == pytest.approx(fit.max_rel_error)


def test_runs_agree_and_disagree() -> None:
    point = TransferPoint(MiB, "h2h", "pageable", 100e-6, 10e-6, n=10)
    assert "agree within their spread" in ch02.runs_agree("one call", [98e-6, 100e-6, 103e-6], "sweep", point)
    line = ch02.runs_agree("one call", [300e-6, 310e-6, 305e-6], "sweep's point", point)
    assert "do NOT agree" in line and "Trust the sweep's point" in line


def test_cap_check_prints_the_sweeps_own_largest_copy_figure() -> None:
    # The 4 MiB copy (in cache) is faster than the 256 MiB one (from RAM): the cap is the largest copy's figure.
    sw = _sweep(
        [(4 * MiB, 4 * MiB / 42e9, 0.0), (64 * MiB, 64 * MiB / 20e9, 0.0), (256 * MiB, 256 * MiB / 11.5e9, 0.0)]
    )
    lines = ch02.memcpy_cap_lines(sw)
    big = sw.points[-1]
    assert ch02.largest_copy(sw) is big
    assert f"{big.gbps:.2f} GB/s" in lines[0] and "42.00" not in lines[0]
    assert len(lines) == 4 and "PCIe Gen5" in lines[-1]
    with pytest.raises(ValueError, match="run the sweep cell first"):
        ch02.largest_copy(_sweep([]))


def test_notebook_cap_check_and_sweep_print_use_the_same_point() -> None:
    cells = ["".join(c["source"]) for c in json.loads(NOTEBOOK.read_text())["cells"] if c["cell_type"] == "code"]
    text = "\n".join(cells)
    assert "ch02.memcpy_cap_lines(host)" in text and "big = ch02.largest_copy(host)" in text
    assert "max(p.gbps for p in host.points" not in text  # the old cap: the fastest copy of 4 MiB or more
    assert "ch02.fit_check(sw, fit).verdict()" in text and "ch02.runs_agree(" in text


@pytest.mark.parametrize(("sweep_s", "verdict"), [(1.05e-4, "they agree within their spread"), (5e-4, "do NOT agree")])
def test_panel_run_sets_the_host_copy_against_the_sweeps_point_of_the_same_size(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sweep_s: float, verdict: str
) -> None:
    monkeypatch.setenv("WORKBOOK_REFERENCE_DIR", str(tmp_path))

    def my_copy(src, device, pinned, repeats):  # type: ignore[no-untyped-def]
        return [1e-4] * repeats

    host = _sweep([(MiB, sweep_s, 1e-5), (4 * MiB, 4e-4, 1e-5)])
    result = ch02.panel_run(
        lambda f, text="": None,
        device="cpu",
        size_mib=1,
        direction="h2d",
        memory="pageable",
        dtype="uint8",
        copy_fn=my_copy,
        host=host,
    )
    summary = ch02.panel_summary(result)
    assert "sweep's 1.0 MiB point" in summary and verdict in summary


def test_claim_check_counts_the_ratios_against_the_band() -> None:
    none = model.claim_check([1.12, 1.22, 2.39, 5.24])
    assert none.startswith("0 of 4 in the claimed band 1.3x-1.5x, 2 below, 2 above (ratios 1.12x-5.24x)")
    assert none.endswith("the claim holds for none of them.")
    assert model.claim_check([1.3, 1.5]).endswith("holds for all of them.")  # the band's ends are in it
    assert "holds for 1 of 3 only" in model.claim_check([1.0, 1.4, 2.0])
    with pytest.raises(ValueError, match="at least one"):
        model.claim_check([])


def test_section_3_without_a_gpu_pair_gives_the_claims_verdict_from_published_pairs() -> None:
    lines = ch02.published_claim_lines()
    found = ch02.pairs("memory")
    ratios = [pinned.gbps / pageable.gbps for pageable, pinned in found]
    assert "published elsewhere (not this machine)" in lines[0]
    assert len(lines) == 2 + 2 * len(found)  # a head, two lines per pair (ratio and verdict, source), the verdict
    assert all(f"{r:5.2f}x ({model.claim_verdict(r)})" in line for r, line in zip(ratios, lines[1::2]))
    assert lines[-1] == f"Verdict on the published pairs: {model.claim_check(ratios)}"


def test_notebook_section_3_falls_back_to_the_published_pairs() -> None:
    cells = ["".join(c["source"]) for c in json.loads(NOTEBOOK.read_text())["cells"] if c["cell_type"] == "code"]
    section3 = next(c for c in cells if "copies.speedup_by_size(" in c)
    assert "ch02.published_claim_lines()" in section3 and "gpu.header()" not in section3
