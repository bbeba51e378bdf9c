"""Chapter 00 · Setup, and measuring honestly: the live panel (one operation of ``hygiene.OPERATIONS`` timed at
a size the reader picks, on any device) and the headless benchmark (``ch00.*``)."""

from __future__ import annotations

import importlib
import platform
import sys
import textwrap
from dataclasses import dataclass
from typing import Any, Sequence

import ipywidgets as W
import torch

from ...core import evidence
from ...core.config import decide_tier, sized
from ...core.device import HardwareReport, cuda_driver_problem, hardware_report
from ...core.evidence import Evidence
from ...core.progress import ProgressFn, no_progress
from ...core.results import ResultSet
from ...core.timing import Timing
from ...core.validate import check_int, human_bytes, wrap
from ...ui import plots, published
from ...ui.published import PublishedFigure
from . import hygiene

NUMBER = "00"
TITLE = "measuring: warm-up, synchronisation, events"
BENCH_WEIGHT = 0.5
PANEL_TITLE = "Time an operation"

METHOD = "torch.utils.benchmark.Timer blocks, median and IQR (helpers.core.timing.measure)"


@dataclass
class CheckLine:
    name: str
    ok: bool
    detail: str

    def __str__(self) -> str:
        return wrap(f"[{'ok' if self.ok else 'warning'}] {self.name}: {self.detail}", indent="    ")


_PACKAGES = ("torch", "torchvision", "numpy", "matplotlib", "ipywidgets", "psutil", "pynvml", "tqdm", "PIL")


def environment_check(report: HardwareReport | None = None, shm_min_bytes: int = 1 << 30) -> list[CheckLine]:
    """An ok/warning line per package, the device (why an installed GPU is unusable), the size tier, /dev/shm."""
    lines: list[CheckLine] = []
    ok_v = sys.version_info >= (3, 10)
    lines.append(CheckLine("python", ok_v, platform.python_version() + ("" if ok_v else " (3.10 or newer is needed)")))
    for mod in _PACKAGES:
        try:
            lines.append(CheckLine(mod, True, str(getattr(importlib.import_module(mod), "__version__", "installed"))))
        except Exception as exc:
            lines.append(CheckLine(mod, False, f"cannot import ({exc}); run `make setup` from the workbook folder"))
    rep = report or hardware_report()
    problem = None if rep.cuda_available else cuda_driver_problem(rep)
    if rep.cuda_available:
        detail = f"CUDA: {rep.gpu_name}, driver {rep.driver_version or 'unknown'}"
    elif problem:
        detail = f"running on {rep.device}, not on the GPU. {problem}"
    else:
        detail = f"no CUDA device; running on {rep.device}. Every chapter still runs: CPU parts are measured live, "
        detail += "GPU parts show reference results recorded on a real GPU"
    lines.append(CheckLine("device", rep.cuda_available, detail))
    try:
        tier, reason = decide_tier()
        lines.append(CheckLine("sizes", True, f"{tier} tier: {reason}"))
    except ValueError as exc:  # a WORKBOOK_* variable with an unknown value
        lines.append(CheckLine("sizes", False, str(exc)))
    if rep.shm_free_bytes is None:
        lines.append(CheckLine("/dev/shm", False, rep.missing.get("shm_free_bytes", "unknown")))
    else:
        ok = rep.shm_free_bytes >= shm_min_bytes
        detail = f"{human_bytes(rep.shm_free_bytes)} free of {human_bytes(rep.shm_total_bytes or 0)}"
        if not ok:
            detail += (
                f" — below {human_bytes(shm_min_bytes)}: DataLoader workers may die with a bus error. "
                "In Docker, start the container with --shm-size=2g (or --ipc=host)"
            )
        lines.append(CheckLine("/dev/shm", ok, detail))
    return lines


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


# -- section 1: published copies against their host link's theoretical ceiling ----------------------------


def largest_copies(figures: Sequence[PublishedFigure]) -> list[PublishedFigure]:
    """One figure per source and run: its largest stated transfer size (figures without a size kept as they are)."""
    keep = {id(group[-1]) for group in published.point_series(figures)}
    return [f for f in figures if f.transfer_size_bytes is None or id(f) in keep]


def share_table(figures: Sequence[PublishedFigure]) -> str:
    """Published GB/s and, in its own column, the **theoretical** host-link ceiling."""
    head = (
        f"{'GPU, copy':<40}{'size':>10}{'published':>11}  {'host link':<15}{'theoretical':>13}{'share':>7}\n"
        f"{'':<50}{'GB/s':>11}  {'(product spec)':<15}{'GB/s':>13}"
    )
    lines = [head, "-" * len(head.splitlines()[0])]
    for f in figures:
        c = f.ceiling_gbps
        size = "—" if f.transfer_size_bytes is None else published.size_text(f.transfer_size_bytes)
        lines.append(
            f"{f.short_label():<40}{size:>10}{f.gbps:>11.2f}  {f.product_link:<15}"
            f"{(f'{c:.1f}' if c else '—'):>13}{(f'{f.share_of_ceiling:.0%}' if c else '—'):>7}"
        )
    return "\n".join(lines)


def plot_share_of_ceiling(figures: Sequence[PublishedFigure]) -> Any:
    """A row per figure: the **published** GB/s (marker), its host link's **theoretical** ceiling (bar) and the
    share. Log x axis: NVLink-C2C and PCIe Gen3 differ tenfold."""
    figs = [f for f in figures if f.ceiling_gbps]
    ax = plots.new_axes((8.5, 0.32 * len(figs) + 1.4))
    ys = list(range(len(figs)))[::-1]
    ceilings = [f.ceiling_gbps or 0.0 for f in figs]
    ax.barh(ys, ceilings, color="#e6e6e6", edgecolor="#999", label=f"host link ceiling, {published.KIND_THEORETICAL}")
    done: set[Any] = set()
    for y, f, c in zip(ys, figs, ceilings):
        published.mark_figure(ax, f, [f.gbps], [y], done, "", linestyle="")
        ax.text(c * 1.08, y, f"{f.share_of_ceiling:.0%}", va="center", fontsize=7)
    ax.set_yticks(ys)
    ax.set_yticklabels([f"{f.short_label()} ({f.product_link})" for f in figs], fontsize=7)
    ax.set(xscale="log", xlim=(1, max(ceilings) * 2.2 if figs else 10), xlabel="GB/s (10^9 B/s, log scale)")
    plots.plain_log_ticks(ax.xaxis)
    ax.set_title("Published copies against the theoretical ceiling of each GPU's host link")
    ax.legend(fontsize=7, loc="lower right")
    note = textwrap.fill(
        "Markers: published elsewhere (sources in helpers/ui/published.json). Bars: theoretical, from the link "
        "each GPU product has per its specification; the actual slot may be slower.",
        110,
    )
    style = {"xycoords": "axes fraction", "textcoords": "offset points", "fontsize": 7.5, "color": "#555"}
    ax.annotate(note, xy=(0, 0), xytext=(0, -34), va="top", **style)
    return ax
