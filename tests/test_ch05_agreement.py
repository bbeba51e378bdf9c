"""Chapter 05's GPU-decode section without a GPU: two runs of one code path get a verdict.

Issue #28.3: "CPU decode, same code path" showed 109.57 against 28.71 ms per batch with no word on
whether they agree. The report now says whether their interquartile ranges overlap and, when they
do not, which run to trust. Synthetic timings: nothing here is timed.
"""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from helpers.chapters.ch05 import gpudecode  # noqa: E402
from helpers.core.timing import Timing  # noqa: E402

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "05_overlap_async_transfer.ipynb"


def _timing(ms: list[float]) -> Timing:
    s = sorted(v / 1e3 for v in ms)
    mid = s[len(s) // 2]
    return Timing("t", mid, 0.0, sum(s) / len(s), s[0], s[-1], len(s), times_s=s)


def _cmp(a_ms: list[float], b_ms: list[float], on_gpu: bool = False) -> gpudecode.DecodeComparison:
    return gpudecode.DecodeComparison(
        device="cpu",
        on_gpu=on_gpu,
        batch_size=4,
        crop_size=8,
        image_size=16,
        n_batches=1,
        bytes_per_batch={"jpeg": [100], "uint8": [768], "float32": [3072]},
        cpu_path=_timing(a_ms),
        device_path=_timing(b_ms),
        pinned=False,
    )


def _verdict(a: Timing, b: Timing) -> str:
    """The verdict a CPU-only comparison prints for timings ``a`` (path a, first) and ``b``."""
    cmp = _cmp([1], [1])
    cmp.cpu_path, cmp.device_path = a, b
    return cmp.verdict


def test_overlapping_quartiles_agree_within_their_spread() -> None:
    verdict = _verdict(_timing([28, 30, 32, 40, 45]), _timing([27, 29, 31, 33, 35]))
    assert "agree within their spread" in verdict and "noise" in verdict and "NOT" not in verdict


def test_separate_quartiles_do_not_agree_and_name_the_run_to_trust() -> None:
    verdict = _verdict(_timing([100, 105, 109.57, 112, 120]), _timing([27, 28, 28.71, 29, 30]))
    assert "109.57 ms (a, timed first) and 28.71 ms (b, timed second)" in verdict
    assert "do NOT agree within their spread" in verdict and "warm-up or load" in verdict
    assert "trust the faster, (b), timed second, 28.71 ms" in verdict
    slower_second = _verdict(_timing([27, 28, 29]), _timing([50, 55, 60]))
    assert "trust the faster, (a), timed first, 28.00 ms" in slower_second


def test_the_printed_report_carries_the_verdict_on_a_cpu_only() -> None:
    cmp = _cmp([100, 105, 109.57, 112, 120], [27, 28, 28.71, 29, 30])
    report = cmp.report()
    tail = report[report.index("  verdict: ") :]  # the table's last line, wrapped
    assert " ".join(line.strip() for line in tail.splitlines()) == f"verdict: {cmp.verdict}"
    assert "do NOT agree" in cmp.verdict
    fig = gpudecode.plot_comparison(cmp)
    assert "do NOT agree" in fig.axes[1].get_title()
    plt.close(fig)
    gpu = _cmp([100, 105, 110], [27, 28, 29], on_gpu=True)
    assert "verdict" not in gpu.report() and "different paths" in gpu.verdict


def test_the_chapter_text_names_the_verdict() -> None:
    cells = json.loads(NOTEBOOK.read_text())["cells"]
    text = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")
    assert "DecodeComparison.verdict" in text and "agree within their spread" in text
    assert "faster run is the one to trust" in text
