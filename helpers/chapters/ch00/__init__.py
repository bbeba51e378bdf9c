"""Chapter 00 · Setup, and measuring honestly: the live panel (one operation of ``hygiene.OPERATIONS`` timed at
a size the reader picks, on any device) and the headless benchmark (``ch00.*``)."""

from __future__ import annotations

from typing import Any

import ipywidgets as W
import torch

from ...core import evidence
from ...core.config import sized
from ...core.evidence import Evidence
from ...core.progress import ProgressFn, no_progress
from ...core.results import ResultSet
from ...core.timing import Timing
from ...core.validate import check_int
from ...ui import plots
from . import hygiene

NUMBER = "00"
TITLE = "measuring: warm-up, synchronisation, events"
BENCH_WEIGHT = 0.5
PANEL_TITLE = "Time an operation"

METHOD = "torch.utils.benchmark.Timer blocks, median and IQR (helpers.core.timing.measure)"


def benchmark(results: ResultSet, device: torch.device, *, progress: ProgressFn | None = None) -> None:
    """Record a fresh conv2d's ``ch00.first_call_s`` and ``ch00.steady_call_s`` (median of its first calls) and
    ``ch00.matmul_time_s`` {n, clock} for each clock (with and without sync; with CUDA, events and wall clock)."""
    report = progress or no_progress
    sizes = (sized(quick=256, full=1024), sized(quick=512, full=4096))
    total = 1 + 2 * len(sizes)
    report(0.0, "fresh conv2d, first calls")
    warm = hygiene.warmup_demo(device)
    results.add("ch00.first_call_s", warm.times_s[0], "s", what="fresh conv2d, first call")
    results.add("ch00.steady_call_s", warm.median_s, "s", what="fresh conv2d, median of the first calls")
    for i, n in enumerate(sizes):
        report((1 + 2 * i) / total, f"matmul n={n}: with and without synchronising")
        demo = hygiene.sync_demo(device, n=n)
        report((2 + 2 * i) / total, f"matmul n={n}: CUDA events vs wall clock")
        for name, t in {**demo, **(hygiene.events_vs_wall(device, n=n) or {})}.items():
            results.add("ch00.matmul_time_s", t.median_s, "s", spread={"iqr": t.iqr_s, "n": t.n}, n=n, clock=name)
    report(1.0, "done")


def panel_controls(**context: Any) -> dict[str, Any]:
    """The operation and its size ``n``, at most ``max_n`` (default 1024)."""
    max_n = check_int("max_n", context.get("max_n", 1024), 16, 16384)
    return {
        "op": W.Dropdown(options=list(hygiene.OPERATIONS), value="matmul", description="operation"),
        "n": W.IntSlider(value=min(256, max_n), min=16, max=max_n, step=16, description="size n"),
    }


def panel_run(
    progress: ProgressFn,
    *,
    device: torch.device,
    op: str,
    n: int,
    min_run_time: float = 0.2,
    max_seconds: float = hygiene.DEMO_MAX_SECONDS,
    **context: Any,
) -> Evidence[Timing]:
    progress(0.1, f"timing {op} n={n}")
    t = hygiene.time_op(op, n, device, min_run_time=min_run_time, max_seconds=max_seconds)
    return evidence.measured(f"{op} at n={n}", t, device, method=METHOD)


def panel_summary(result: Evidence[Timing]) -> str:
    t = result.value
    if t is None:
        return result.header()
    return f"median {t.median_s * 1e3:.3f} ms, IQR {t.iqr_s * 1e3:.3f} ms ({t.n} samples) — {result.header()}"


def panel_plot(history: list[Any], ax: Any) -> None:
    """Median bars with IQR error bars (half either side), on a log scale: runs differ by orders of magnitude."""
    runs = [r for r in history if r.result.value is not None]
    timings: list[Timing] = [r.result.value for r in runs]
    devices = sorted({str(t.metadata.get("device", "?")) for t in timings})
    plots.history_bars(
        [r.short_label() for r in runs],
        [t.median_s * 1e3 for t in timings],
        ax,
        errors=[t.iqr_s / 2 * 1e3 for t in timings],
        ylabel="median time per call (ms, log scale)",
        title=f"Timings (measured now on {', '.join(devices) or 'this machine'})",
    )
    ax.set_yscale("log")  # on a linear scale the small runs vanish
    ax.autoscale(axis="y")
