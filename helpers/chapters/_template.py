"""Template for a chapter module: copy it to ``helpers/chapters/chNN/__init__.py`` (NN = the notebook's number).

A working example of the one chapter interface (:mod:`helpers.ui.chapter`): its panel times one host copy. The
notebook's cells teach; this module holds the plumbing. ``panel_run`` returns an Evidence whichever path ran;
record keys start with ``chNN.``; the test that drives the panel goes in ``tests/test_panels_driven.py``.
"""

from __future__ import annotations

from typing import Any

import ipywidgets as W
import torch

from ..core import config, evidence, timing
from ..core.evidence import Evidence
from ..core.progress import ProgressFn, no_progress
from ..core.results import ResultSet
from ..core.validate import check_int
from ..ui import plots

NUMBER = "99"
TITLE = "template: one host copy"
BENCH_WEIGHT = 0.1
PANEL_TITLE = "Copy a tensor on the host"

MIB = 2**20


def _copy_time(mib: int, device: torch.device, min_run_time: float) -> timing.Timing:
    src = torch.ones(mib * MIB, dtype=torch.uint8)
    dst = torch.empty_like(src)
    return timing.measure(lambda: dst.copy_(src), label=f"copy {mib} MiB", device="cpu", min_run_time=min_run_time)


def benchmark(results: ResultSet, device: torch.device, *, progress: ProgressFn | None = None) -> None:
    """Record ``ch99.copy_s`` for two sizes."""
    progress = progress or no_progress
    sizes = config.sized(quick=[1, 4], full=[4, 64])
    for i, mib in enumerate(sizes):
        progress(i / len(sizes), f"copy {mib} MiB")
        t = _copy_time(mib, device, config.sized(quick=0.02, full=0.2))
        results.add("ch99.copy_s", t.median_s, "s", spread={"iqr": t.iqr_s, "n": t.n}, mib=mib)
    progress(1.0, "done")


def panel_controls(**context: Any) -> dict[str, Any]:
    """``context`` may set the size's default as ``mib=``."""
    return {"size_mib": W.IntSlider(value=context.get("mib", 4), min=1, max=64, description="MiB")}


def panel_run(progress: ProgressFn, *, device: torch.device, size_mib: int, **context: Any) -> Evidence[timing.Timing]:
    """Time one host copy of ``size_mib`` MiB: measured here, on any machine."""
    size_mib = check_int("size_mib", size_mib, 1, 1024)
    progress(0.1, f"copying {size_mib} MiB")
    t = _copy_time(size_mib, device, config.sized(quick=0.02, full=0.2))
    return evidence.measured(f"a {size_mib} MiB host copy", t, "cpu", method="torch.utils.benchmark, median")


def panel_summary(result: Evidence[timing.Timing]) -> str:
    if result.value is None:
        return result.header()
    return f"median {result.value.median_s * 1e3:.3f} ms (IQR {result.value.iqr_s * 1e3:.3f} ms) — {result.header()}"


def panel_plot(history: list[Any], ax: Any) -> None:
    runs = [r for r in history if r.result.value is not None]
    plots.history_bars(
        [r.short_label() for r in runs],
        [r.result.value.median_s * 1e3 for r in runs],
        ax,
        ylabel="median time (ms)",
        title="Host copies (measured now)",
    )
