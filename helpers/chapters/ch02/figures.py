"""Chapter 02's figures: the two paths of a host-to-device copy, the bandwidth curves (with the published points and
theoretical ceilings), the pinned/pageable ratio and the cost of pinning (matplotlib is imported when drawn)."""

from __future__ import annotations

import textwrap
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Sequence

import numpy as np

from ...core.validate import human_bytes, human_seconds
from ...ui import published
from ...ui.published import PublishedFigure
from .copies import Sweep, TransferPoint
from .model import CLAIM_RANGE
from .pin_costs import PinCost

if TYPE_CHECKING:  # pragma: no cover
    from matplotlib.figure import Figure


def copy_paths_diagram() -> "Figure":
    """The two paths a host-to-device copy can take. Top: a pageable source, copied by the CPU (driver) into a
    pinned staging ("bounce") buffer, then pulled by the GPU's copy engine (DMA) over the link. Bottom: a pinned
    source, read by the copy engine directly."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

    fig, ax = plt.subplots(figsize=(9.5, 4.2))
    ax.set(xlim=(0, 10), ylim=(0, 5.2))
    ax.axis("off")
    for x, w, fc in ((0.1, 6.2, "#f3f3f3"), (7.9, 2.0, "#eef6ee")):  # host RAM, GPU memory
        ax.add_patch(FancyBboxPatch((x, 0.2), w, 4.6, boxstyle="round,pad=0.02", fc=fc, ec="#999999", lw=0.8))
    ax.text(3.2, 4.95, "host RAM (CPU side)", ha="center", fontsize=10, weight="bold")
    ax.text(8.9, 4.95, "GPU memory", ha="center", fontsize=10, weight="bold")
    ax.text(7.1, 4.95, "link (PCIe / NVLink)", ha="center", fontsize=8.5, style="italic")
    ax.text(0.25, 4.35, "pageable source: two copies, and the CPU is busy for the first", fontsize=9, color="#a03000")
    ax.text(0.25, 2.0, "pinned source: one DMA, the CPU is free (non_blocking=True)", fontsize=9, color="#005a00")
    boxes = [
        (0.3, 3.2, 2.1, "pageable buffer\n(may be swapped out)", "#ffd9c7"),
        (3.6, 3.2, 2.5, "driver's pinned\nstaging (bounce) buffer", "#c7dcff"),
        (8.1, 3.2, 1.6, "device\nbuffer", "#c9efc9"),
        (0.3, 0.8, 2.1, "pinned buffer\n(page-locked)", "#c7dcff"),
        (8.1, 0.8, 1.6, "device\nbuffer", "#c9efc9"),
    ]
    for x, y, w, text, color in boxes:
        ax.add_patch(FancyBboxPatch((x, y), w, 0.9, boxstyle="round,pad=0.05", fc=color, ec="black", lw=1))
        ax.text(x + w / 2, y + 0.45, text, ha="center", va="center", fontsize=9.5)
    arrows = [
        (2.45, 3.55, 3.65, "CPU memcpy"),
        (6.15, 8.05, 3.65, "DMA by copy engine"),
        (2.45, 8.05, 1.25, "DMA by copy engine: reads host RAM directly, at the link's speed"),
    ]
    for x0, x1, y, text in arrows:
        ax.add_patch(FancyArrowPatch((x0, y), (x1, y), arrowstyle="-|>", mutation_scale=16, lw=1.6))
        ax.text((x0 + x1) / 2, y + 0.18, text, ha="center", va="bottom", fontsize=8.5)
    note = "DMA needs physical addresses that cannot move: only page-locked memory qualifies."
    ax.text(5.0, 0.35, note, ha="center", fontsize=8.5, style="italic")
    fig.tight_layout()
    return fig


_SWEEP_STYLES: dict[str, dict[str, Any]] = {
    "H2D pageable": {"color": "#f28e2b"},
    "H2D pinned": {"color": "#f28e2b", "marker": "s", "markerfacecolor": "white"},
    "D2H pageable": {"color": "#4e79a7"},
    "D2H pinned": {"color": "#4e79a7", "marker": "s", "markerfacecolor": "white"},
}


_SIDE = {"fontsize": 7.5, "loc": "upper left", "bbox_to_anchor": (1.01, 1.0), "frameon": False}
_STAR_COLORS = ["#e15759", "#b07aa1", "#edc948", "#76b7b2", "#ff9da7", "#9c755f"]
_SIZES = "copy size (bytes, log scale)"


def _finish(ax: Any, legend: dict[str, Any] = _SIDE) -> Any:
    size_ticks(ax)
    ax.legend(**legend)
    return ax


def plot_sweeps(
    sweeps: Sequence[Sweep],
    ax: Any = None,
    *,
    ceiling: tuple[float, str] | None = None,
    source: str | None = None,
    title: str = "Copy bandwidth vs size",
    fits: bool = True,
    points: Sequence[tuple[TransferPoint, str]] = (),
) -> Any:
    """Bandwidth against copy size (log-log): the ``sweeps``, the link's theoretical ``ceiling`` dashed, each
    curve's fitted model dotted (``fits``), and single ``points`` ``(point, label)`` (the panel's runs) as stars."""

    series: dict[str, tuple[Sequence[float], list[float]]] = {}
    styles: dict[str, dict[str, Any]] = {}
    for sw in (sw for sw in sweeps if sw.points):
        series[sw.label] = (sw.sizes(), sw.gbps())
        styles[sw.label] = dict(_SWEEP_STYLES.get(sw.label, {"color": "#59a14f", "marker": "^"}), markersize=4)
        fit = _fit_curve(sw) if fits else None
        if fit is not None:
            series[fit[0]] = fit[1]
            styles[fit[0]] = {"color": styles[sw.label]["color"], "linestyle": ":", "marker": "", "linewidth": 1.2}
    ylabel = "bandwidth (GB/s = 1e9 B/s, log scale)"
    ax = sweep_plot(series, ax, xlabel=_SIZES, ylabel=ylabel, title=title, ceiling=ceiling, source=source,
                          styles=styles)  # fmt: skip
    star = {"marker": "*", "markersize": 14, "markeredgecolor": "black", "linestyle": "", "zorder": 5}
    for i, (p, label) in enumerate(points):
        ax.plot([p.nbytes], [p.gbps], color=_STAR_COLORS[i % len(_STAR_COLORS)], label=label, **star)
    return _finish(ax)


def _fit_curve(sw: Sweep) -> tuple[str, tuple[list[float], list[float]]] | None:
    """The sweep's fitted model as a named (sizes, GB/s) curve; None if it can't fit (e.g. one size)."""
    try:
        f = sw.fit()
    except ValueError:
        return None
    xs = np.geomspace(min(sw.sizes()), max(sw.sizes()), 60)
    name = f"{sw.label} fit: {human_seconds(f.latency_s)} + bytes / {f.gbps:.1f} GB/s"
    return name, (xs.tolist(), (xs / np.array([f.predict_s(x) for x in xs]) / 1e9).tolist())


def plot_speedup(pairs: dict[str, list[tuple[int, float]]], ax: Any = None, *, source: str | None = None) -> Any:
    """pageable/pinned time ratio per size, with the claimed 1.3-1.5 band shaded."""

    series = {f"{k}: pageable time / pinned time": ([n for n, _ in v], [r for _, r in v]) for k, v in pairs.items()}
    title = "Is pinning 30-50% faster? Measured ratio per size"
    ax = sweep_plot(series, ax, xlabel=_SIZES, ylabel="speed-up of pinned (x)", title=title, logy=False,
                          source=source)  # fmt: skip
    ax.axhspan(CLAIM_RANGE[0], CLAIM_RANGE[1], color="#bab0ac", alpha=0.35, label="the claim: 1.3x-1.5x")
    ax.axhline(1.0, color="black", linewidth=0.8)
    return _finish(ax, {"fontsize": 8})


def plot_pin_costs(rows: Sequence[PinCost], ax: Any = None, *, source: str | None = None) -> Any:
    """Time of pinning (cold, cached) vs time one pinned copy saves, against size (log-log)."""

    lines = [  # label, PinCost field (s), style; a saving <= 0 is drawn at 1 ns (log axis)
        ("pin_memory(), new block (cudaHostAlloc)", "cold", {"color": "#e15759"}),
        ("pin_memory(), cached block (memcpy only)", "cached", {"color": "#f28e2b", "linestyle": "--"}),
        ("saving per copy (pageable − pinned)", "saving_per_copy", {"color": "#59a14f", "marker": "s"}),
    ]
    series = {
        label: ([r.nbytes for r in rows], [max(getattr(r, k), 1e-9) * 1e3 for r in rows]) for label, k, _ in lines
    }
    title, styles = "Cost of pinning vs what one pinned copy saves", {label: style for label, _, style in lines}
    ax = sweep_plot(series, ax, xlabel="buffer size (bytes, log scale)", ylabel="time (ms, log scale)",
                          title=title, source=source, styles=styles)  # fmt: skip
    return _finish(ax)


def add_published(ax: Any, figures: Sequence[PublishedFigure], *, skip_gbps: Iterable[float] = ()) -> str:
    """Draw the published ``figures`` that state a size on a bandwidth-vs-size Axes (black-edged diamonds: pinned,
    triangles: pageable; orange H2D, blue D2H; a source's sizes dotted, ``[k]`` by the largest) and dashed lines at
    the **theoretical** ceiling of their GPUs' host links (one per value; unknown links and ``skip_gbps``, already
    drawn, left out); an existing legend is drawn again to show them. Returns the key to the ``[k]`` marks: one line
    per series, with its source."""

    done: set[Any] = set()
    key: list[str] = []
    for k, group in enumerate(published.point_series(figures), start=1):
        f, xs, ys = group[-1], [float(g.transfer_size_bytes or 0) for g in group], [g.gbps for g in group]
        kw: dict[str, Any] = {"linewidth": 0.8, "markeredgewidth": 0.7, "zorder": 4}
        published.mark_figure(ax, f, xs, ys, done, " [k]", linestyle=":" if len(group) > 1 else "", **kw)
        text = {"textcoords": "offset points", "fontsize": 7, "color": "#222", "zorder": 5}
        ax.annotate(f"{k}", (xs[-1], ys[-1]), xytext=(4, -3), **text)
        sizes = ", ".join(published.size_text(g.transfer_size_bytes) for g in group)
        key.append(f"[{k}] {f.short_label()}: {', '.join(f'{y:.1f}' for y in ys)} GB/s at {sizes}")
        key += [f"     {line}" for line in textwrap.wrap(f"{f.tool}; source: {published.short_source(f.url)}", 100)]
    if ax.get_xscale() == "log":
        size_ticks(ax)
    skip = [float(s) for s in skip_gbps]
    by_value: dict[float, list[str]] = {}
    for link in dict.fromkeys(f.product_link for f in figures):
        c = published.link_ceiling_gbps(link)
        if c is not None and not any(abs(c - s) <= 1e-3 * c for s in skip):
            by_value.setdefault(next((v for v in by_value if abs(v - c) <= 1e-3 * c), c), []).append(link)
    styles = [":", "-.", (0, (5, 2)), (0, (1, 1))]
    for i, (c, names) in enumerate(sorted(by_value.items())):
        label = f"{' = '.join(names)}: {c:.1f} GB/s, {published.KIND_THEORETICAL}"
        ax.axhline(c, color="#777", linewidth=0.9, linestyle=styles[i % len(styles)], label=label, zorder=1)
    if ax.get_legend() is not None:  # drawn before these marks and lines: drawn again, with them
        ax.legend(**_SIDE)
    return "\n".join(key)


def sweep_plot(
    series: Mapping[str, tuple[Sequence[float], Sequence[float]]],
    ax: Any = None,
    *,
    xlabel: str,
    ylabel: str,
    title: str = "",
    logy: bool = True,
    ceiling: tuple[float, str] | None = None,
    source: str | None = None,
    styles: Mapping[str, Mapping[str, Any]] | None = None,
) -> Any:
    """Lines of y against x, ``series``: label -> (xs, ys), with per-series matplotlib ``styles``; ``ceiling``:
    ``(value, label)``, e.g. ``(31.5, "PCIe Gen4 x16, theoretical")``, drawn dashed."""
    from ...ui import plots  # optional/heavy: matplotlib

    ax = ax if ax is not None else plots.new_axes((7.5, 4.0))
    for label, (xs, ys) in series.items():
        ax.plot(list(xs), list(ys), label=label, **{"marker": "o", "markersize": 3, **(styles or {}).get(label, {})})
    if ceiling is not None:
        ax.axhline(ceiling[0], color="#444", linestyle="--", linewidth=1, label=ceiling[1])
    ax.set_xscale("log")
    if logy:
        ax.set_yscale("log")
        plots.plain_log_ticks(ax.yaxis)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if title:
        ax.set_title(title)
    ax.grid(True, which="both", alpha=0.25)
    ax.legend(fontsize=8)
    plots.label_source(ax, source)
    return ax


def size_ticks(ax: Any) -> None:
    """Label a log x axis of byte sizes at 4 KiB, 16 KiB, 64 KiB, ... (every other one past six) in its range."""
    lo, hi = ax.get_xlim()
    ticks = [4.0**k * 1024 for k in range(1, 16) if lo <= 4.0**k * 1024 <= hi]
    if len(ticks) > 6:
        ticks = ticks[::2]
    if ticks:
        ax.set_xticks(ticks)
        ax.set_xticklabels([human_bytes(t).replace(".0 ", " ") for t in ticks])
        ax.minorticks_off()
