"""Shared plots: step timelines and run histories.

Each draws on the ``Axes`` passed (or a new one) and returns it; a phase has one colour in every chapter, and
``source="Recorded on ..."`` is written under a plot of reference results.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping, Sequence

import matplotlib
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

from ..core.timing import SpanTrace

PHASE_COLORS: dict[str, str] = {
    "load": "#4e79a7", "collate": "#a0cbe8", "pin": "#d4a6c8", "h2d": "#f28e2b", "copy": "#f28e2b",
    "normalize": "#ffbe7d", "forward": "#59a14f", "backward": "#8cd17d", "optimizer": "#b6992d",
    "compute": "#59a14f", "wait": "#bab0ac", "d2h": "#e15759",
}  # fmt: skip
_CYCLE = ["#76b7b2", "#edc948", "#b07aa1", "#ff9da7", "#9c755f", "#499894", "#d37295"]
_COLORS = dict(PHASE_COLORS)  # and the other names met so far


def phase_color(name: str) -> str:
    """The colour for phase ``name`` (other names: stable within a session)."""
    return _COLORS.setdefault(name, _CYCLE[(len(_COLORS) - len(PHASE_COLORS)) % len(_CYCLE)])


def new_axes(figsize: tuple[float, float] = (8.0, 3.5)) -> Any:
    import matplotlib.pyplot as plt  # through pyplot, so that it displays in notebooks

    fig, ax = plt.subplots(figsize=figsize)
    return ax


def label_source(ax: Any, source: str | None) -> None:
    if source:
        ax.text(0.0, -0.28, source, transform=ax.transAxes, fontsize=8, color="#555", va="top", wrap=True)


def timeline(
    trace: SpanTrace | Mapping[str, Any],
    ax: Any = None,
    *,
    title: str = "Timeline of consecutive steps",
    lanes: Sequence[str] | None = None,
    source: str | None = None,
    max_steps: int | None = None,
) -> Any:
    """Gantt chart of a span trace (or its ``to_dict()`` form): one row per lane (``lanes``: their order; default
    first appearance), one bar per span, gaps = idle time; ``max_steps``: only the first N steps."""
    if not isinstance(trace, SpanTrace):
        trace = SpanTrace.from_dict(dict(trace))
    spans = trace.spans
    if max_steps is not None:
        keep = set(sorted({s.step for s in spans})[:max_steps])
        spans = [s for s in spans if s.step in keep]
    ax = ax if ax is not None else new_axes((9.0, 0.8 + 0.55 * max(2, len({s.lane for s in spans}))))
    if not spans:
        ax.text(0.5, 0.5, "no spans recorded", ha="center", va="center", transform=ax.transAxes)
        return ax
    order = list(dict.fromkeys([*(lanes or []), *(s.lane for s in spans)]))  # the lanes named first, top down
    t0 = min(s.start for s in spans)
    length = max(s.end for s in spans) - t0
    scale, unit = (1.0, "s") if length >= 1 else (1e3, "ms") if length >= 1e-3 else (1e6, "µs")
    seen: set[str] = set()
    for s in spans:
        label = None if s.name in seen else s.name  # one legend entry per phase
        seen.add(s.name)
        y, width, left = len(order) - 1 - order.index(s.lane), (s.end - s.start) * scale, (s.start - t0) * scale
        ax.barh(
            y, width, left=left, color=phase_color(s.name), label=label, height=0.6, edgecolor="white", linewidth=0.5
        )
    ax.set_yticks(range(len(order)))
    ax.set_yticklabels(list(reversed(order)))
    ax.set_xlabel(f"time since first span ({unit})")
    ax.set_title(title)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    ax.grid(axis="x", alpha=0.3)
    label_source(ax, source)
    return ax


def plain_log_ticks(axis: Any) -> None:
    """Label a log axis at 1-2-5 steps in plain numbers (a lone '10^1' can't be read off)."""
    axis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    axis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:g}"))
    axis.set_minor_formatter(NullFormatter())


def history_bars(
    labels: Iterable[str],
    values: Iterable[float],
    ax: Any = None,
    *,
    ylabel: str,
    title: str = "Runs so far",
    errors: Iterable[float] | None = None,
) -> Any:
    """A bar per panel run (the latest highlighted), for comparing runs."""
    labels, values = list(labels), list(values)
    ax = ax if ax is not None else new_axes((7.5, 3.2))
    colors = ["#4e79a7"] * (len(values) - 1) + ["#f28e2b"] * bool(values)
    yerr = None
    if errors is not None:
        errs = [abs(float(e)) for e in errors]
        # Times and rates are never negative: the lower bar stops at zero instead of drawing a negative time.
        lower = [min(e, v) if v >= 0 else e for e, v in zip(errs, values)]
        yerr = [lower, errs]
    ax.bar(range(len(values)), values, color=colors, yerr=yerr, capsize=3)
    if values and min(values) >= 0:
        ax.set_ylim(bottom=0)
    ax.set_xticks(range(len(values)))
    ax.set_xticklabels(labels, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(axis="y", alpha=0.3)
    return ax


# Keep matplotlib quiet and consistent in notebooks.
matplotlib.rcParams.update({"figure.dpi": 100, "axes.spines.top": False, "axes.spines.right": False})
