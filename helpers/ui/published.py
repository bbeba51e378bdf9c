"""Host↔GPU copy bandwidths *published elsewhere* (``published.json``: each figure cited, with its GPU, tool,
method and date read), labelled as such and never mixed with ours or with a link's theoretical ceiling in one
column, series or fit. ``tools/published_table.py`` validates the file (a test runs it) and prints the README's table.
"""

from __future__ import annotations

import json
import re
import textwrap
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterable

from ..core.validate import check_choice, human_bytes

KIND_MEASURED = "measured here"
KIND_RECORDED = "recorded by this workbook"
KIND_PUBLISHED = "published elsewhere"
KIND_THEORETICAL = "theoretical"

#: NVLink-C2C (GH200's CPU-GPU link): 900 GB/s total, 450 GB/s per direction, per NVIDIA's
#: Grace Hopper architecture description. A **theoretical** ceiling, like the PCIe ones.
NVLINK_C2C_GBPS = 450.0
DIRECTIONS = ("h2d", "d2h")
MEMORY_KINDS = ("pinned", "pageable")
_PCIE = re.compile(r"^PCIe Gen(\d) x(\d+)$")


@dataclass(frozen=True)
class PublishedFigure:
    """One host↔GPU bandwidth figure published elsewhere (kind :data:`KIND_PUBLISHED`)."""

    id: str
    gpu: str
    generation: str
    link: str  # as the source states it, else "not stated"
    product_link: str  # the GPU product's host link per vendor spec (not from the source)
    tool: str
    method: str
    direction: str  # "h2d" | "d2h"
    memory: str  # "pinned" | "pageable"
    value: float  # as published
    unit: str  # as published
    unit_bytes_per_s: float  # what one unit means for that tool
    transfer_size_bytes: int | None
    numa: str
    url: str
    where: str
    published: str
    date_read: str
    notes: str

    @property
    def gbps(self) -> float:
        """The figure in GB/s (10**9 B/s), converted with the tool's own unit definition."""
        return self.value * self.unit_bytes_per_s / 1e9

    @property
    def numa_side(self) -> str | None:
        """``'near'`` / ``'far'`` when the source places the process relative to the GPU's socket, else None."""
        head = self.numa.split(":", 1)[0].strip().lower()
        return head if head in ("near", "far") and "not stated in the source" not in self.numa else None

    @property
    def ceiling_gbps(self) -> float | None:
        """**Theoretical** per-direction ceiling of the GPU product's host link (``product_link``)."""
        return link_ceiling_gbps(self.product_link)

    @property
    def share_of_ceiling(self) -> float | None:
        """This figure as a fraction of :attr:`ceiling_gbps` (published / theoretical), or None."""
        c = self.ceiling_gbps
        return None if c is None else self.gbps / c

    def short_label(self) -> str:
        """``'H100 H2D pinned CE, near socket'``: GPU, copy, nvbandwidth's engine (CE/SM) and socket when stated."""
        name = re.sub(r"\s*\(.*?\)", "", re.sub(r"^(NVIDIA |Tesla |GeForce )+", "", self.gpu).replace("GeForce ", ""))
        engine = " CE" if "_memcpy_ce" in self.tool else " SM" if "_memcpy_sm" in self.tool else ""
        side = f", {self.numa_side} socket" if self.numa_side else ""
        return f"{name.strip()} {self.direction.upper()} {self.memory}{engine}{side}"


def size_text(n: int | None) -> str:
    """A transfer size as the source would write it: ``'32 MB'`` for 32,000,000 B, ``'32.0 MiB'`` for 2**25 B."""
    if n is None:
        return "size not stated"
    if n % 2**20 and n % 10**9 == 0:
        return f"{n / 1e9:g} GB"
    if n % 2**20 and n % 10**6 == 0:
        return f"{n / 1e6:g} MB"
    return human_bytes(n)


def short_source(url: str) -> str:
    """``'NVIDIA/nvbandwidth/issues/24'`` or ``'owner/repo@abc1234/path'`` for a GitHub URL."""
    src = re.sub(r"^https://github\.com/", "", url)
    return re.sub(r"/blob/([0-9a-f]{7})[0-9a-f]*/", r"@\1/", src)


def data_file() -> Path:
    return Path(__file__).resolve().parent / "published.json"


def link_ceiling_gbps(link: str) -> float | None:
    """The **theoretical** per-direction ceiling of ``'PCIe Gen4 x16'`` or ``'NVLink-C2C'``; None if unknown."""
    from ..core import device  # heavy: torch (this module imports without it)

    m = _PCIE.match(link.strip())
    if m:
        return device.pcie_bandwidth_gbps(int(m.group(1)), int(m.group(2)))
    return NVLINK_C2C_GBPS if link.strip() == "NVLink-C2C" else None


@lru_cache(maxsize=1)
def _cached() -> tuple[PublishedFigure, ...]:
    """Every shipped figure, in the file's order."""
    return tuple(PublishedFigure(**raw) for raw in json.loads(data_file().read_text(encoding="utf-8"))["figures"])


def _figs(figures: Iterable[PublishedFigure] | None) -> list[PublishedFigure]:
    return list(figures) if figures is not None else list(_cached())


def published_figures(
    direction: str | None = None, memory: str | None = None, *, sized: bool = False
) -> list[PublishedFigure]:
    """The shipped published figures, filtered by direction, memory kind, and to those whose source states the
    transfer size (``sized``); None keeps all."""
    if direction is not None:
        check_choice("direction", direction, DIRECTIONS)
    if memory is not None:
        check_choice("memory", memory, MEMORY_KINDS)
    return [
        f
        for f in _cached()
        if direction in (None, f.direction) and memory in (None, f.memory) and (not sized or f.transfer_size_bytes)
    ]


def generations(figures: Iterable[PublishedFigure] | None = None) -> list[str]:
    """GPU generations present, in the order they first appear."""
    return list(dict.fromkeys(f.generation for f in _figs(figures)))


#: What :func:`pairs` pairs: the attribute that differs, its two values, and the attributes both must share.
_PAIRS = {
    "direction": ("direction", "h2d", "d2h", ("url", "gpu", "memory", "transfer_size_bytes", "numa", "method")),
    "numa": ("numa_side", "near", "far", ("url", "gpu", "direction", "memory", "transfer_size_bytes", "tool")),
    "memory": ("memory", "pageable", "pinned", ("url", "gpu", "direction", "transfer_size_bytes", "numa")),
}


def pairs(what: str, figures: Iterable[PublishedFigure] | None = None) -> list[tuple[PublishedFigure, PublishedFigure]]:
    """Figures that differ in one thing only, from one source and run: ``"direction"`` gives (H2D, D2H) pairs
    (same GPU, memory kind, size, NUMA placement), ``"numa"`` (near socket, far socket) pairs (same GPU, direction
    and copy), ``"memory"`` (pageable, pinned) pairs (same GPU, direction, size and NUMA placement)."""
    field, a, b, same = _PAIRS[check_choice("what", what, _PAIRS)]
    figs = _figs(figures)
    xs, ys = [x for x in figs if getattr(x, field) == a], [y for y in figs if getattr(y, field) == b]
    return [(x, y) for x in xs for y in ys if all(getattr(x, s) == getattr(y, s) for s in same)]


def share_table(figures: Iterable[PublishedFigure] | None = None) -> str:
    """A plain-text table: published GB/s and, in its own column, the **theoretical** host-link ceiling."""
    from ..core.rounds import table  # heavy: torch (this module imports without it)

    rows = [["", "", "GB/s", "(product spec)", "GB/s", ""]]
    for f in _figs(figures):
        c, size = f.ceiling_gbps, size_text(f.transfer_size_bytes) if f.transfer_size_bytes else "—"
        share = [f"{c:.1f}", f"{f.share_of_ceiling:.0%}"] if c else ["—", "—"]
        rows.append([f.short_label(), size, f"{f.gbps:.2f}", f.product_link, *share])
    lines = table(["GPU, copy", "size", "published", "host link", "theoretical", "share"], rows)
    return "\n".join([*lines[:2], "-" * len(lines[0]), *lines[2:]])


def _point_series(figures: Iterable[PublishedFigure] | None = None) -> list[list[PublishedFigure]]:
    """Figures with a stated size, grouped by source and run (series ``k`` is marked ``[k]``), sizes ascending."""
    series: dict[tuple[Any, ...], list[PublishedFigure]] = {}
    for f in _figs(figures):
        if f.transfer_size_bytes is not None:
            series.setdefault((f.url, f.gpu, f.direction, f.memory, f.numa, f.tool), []).append(f)
    return [sorted(group, key=lambda f: f.transfer_size_bytes or 0) for group in series.values()]


def largest_copies(figures: Iterable[PublishedFigure] | None = None) -> list[PublishedFigure]:
    """One figure per source and run: its largest stated transfer size (figures without a size kept as they are)."""
    figs = _figs(figures)
    keep = {id(group[-1]) for group in _point_series(figs)}
    return [f for f in figs if f.transfer_size_bytes is None or id(f) in keep]


def point_key(figures: Iterable[PublishedFigure] | None = None) -> str:
    """The key to the ``[k]`` marks of :func:`add_published_points`: one line per series, with its source."""
    lines = []
    for k, group in enumerate(_point_series(figures), start=1):
        f = group[-1]
        sizes = ", ".join(size_text(g.transfer_size_bytes) for g in group)
        vals = ", ".join(f"{g.gbps:.1f}" for g in group)
        lines.append(f"[{k}] {f.short_label()}: {vals} GB/s at {sizes}")
        lines += [f"     {wrapped}" for wrapped in textwrap.wrap(f"{f.tool}; source: {short_source(f.url)}", 100)]
    return "\n".join(lines)


_DIR_COLOR = {"h2d": "#f28e2b", "d2h": "#4e79a7"}
_MEM_MARKER = {"pinned": "D", "pageable": "v"}


def _mark(
    ax: Any, f: PublishedFigure, xs: list[float], ys: list[float], done: set[Any], suffix: str, **kw: Any
) -> None:
    """Plot ``f``'s kind of copy (orange H2D, blue D2H; diamond pinned, triangle pageable), black-edged, with a
    legend entry for the first of each kind only."""
    label = None if (f.direction, f.memory) in done else f"{f.direction.upper()} {f.memory}, {KIND_PUBLISHED}{suffix}"
    done.add((f.direction, f.memory))
    style = {"marker": _MEM_MARKER[f.memory], "color": _DIR_COLOR[f.direction], "markeredgecolor": "black"}
    ax.plot(xs, ys, label=label, markersize=6, **style, **kw)


def add_published_points(ax: Any, figures: Iterable[PublishedFigure] | None = None) -> list[PublishedFigure]:
    """Draw published figures on a bandwidth-vs-size Axes (black-edged diamonds: pinned, triangles: pageable;
    orange H2D, blue D2H; a source's sizes dotted, ``[k]`` by the largest); return those without a size."""
    figs = _figs(figures)
    done: set[Any] = set()
    for k, group in enumerate(_point_series(figs), start=1):
        xs, ys = [float(f.transfer_size_bytes or 0) for f in group], [f.gbps for f in group]
        dotted = ":" if len(group) > 1 else ""
        _mark(ax, group[-1], xs, ys, done, " [k]", linestyle=dotted, linewidth=0.8, markeredgewidth=0.7, zorder=4)
        text = {"textcoords": "offset points", "fontsize": 7, "color": "#222", "zorder": 5}
        ax.annotate(f"{k}", (xs[-1], ys[-1]), xytext=(4, -3), **text)
    if ax.get_xscale() == "log":
        from .plots import size_ticks  # optional/heavy: matplotlib

        size_ticks(ax)
    return [f for f in figs if f.transfer_size_bytes is None]


def add_theoretical_ceilings(ax: Any, links: Iterable[str], *, skip_gbps: Iterable[float] = ()) -> list[str]:
    """Dashed lines at the **theoretical** per-direction ceiling of each link (``"PCIe Gen4 x16"``; unknown names
    ignored), labelled as theoretical, except ceilings in ``skip_gbps`` (already drawn). Returns the links drawn."""
    skip = [float(s) for s in skip_gbps]
    by_value: dict[float, list[str]] = {}
    for link in dict.fromkeys(links):
        c = link_ceiling_gbps(link)
        if c is None or any(abs(c - s) <= 1e-3 * c for s in skip):
            continue
        same = next((v for v in by_value if abs(v - c) <= 1e-3 * c), c)
        by_value.setdefault(same, []).append(link)
    styles = [":", "-.", (0, (5, 2)), (0, (1, 1))]
    for i, (c, names) in enumerate(sorted(by_value.items())):
        label = f"{' = '.join(names)}: {c:.1f} GB/s, {KIND_THEORETICAL}"
        ax.axhline(c, color="#777", linewidth=0.9, linestyle=styles[i % len(styles)], label=label, zorder=1)
    return [name for _, names in sorted(by_value.items()) for name in names]


def plot_share_of_ceiling(figures: Iterable[PublishedFigure] | None = None, ax: Any = None) -> Any:
    """A row per figure: the **published** GB/s (marker), its host link's **theoretical** ceiling (bar) and
    the share. Log x axis: NVLink-C2C and PCIe Gen3 differ tenfold."""
    from . import plots  # optional/heavy: matplotlib

    figs = [f for f in _figs(figures) if f.ceiling_gbps]
    ax = ax if ax is not None else plots.new_axes((8.5, 0.32 * len(figs) + 1.4))
    ys = list(range(len(figs)))[::-1]
    ceilings = [f.ceiling_gbps or 0.0 for f in figs]
    ax.barh(ys, ceilings, color="#e6e6e6", edgecolor="#999", label=f"host link ceiling, {KIND_THEORETICAL}")
    done: set[Any] = set()
    for y, f, c in zip(ys, figs, ceilings):
        _mark(ax, f, [f.gbps], [y], done, "", linestyle="")
        ax.text(c * 1.08, y, f"{f.share_of_ceiling:.0%}", va="center", fontsize=7)
    ax.set_yticks(ys)
    ax.set_yticklabels([f"{f.short_label()} ({f.product_link})" for f in figs], fontsize=7)
    ax.set_xscale("log")
    ax.set_xlim(1, max(ceilings) * 2.2 if figs else 10)
    plots.plain_log_ticks(ax.xaxis)
    ax.set_xlabel("GB/s (10^9 B/s, log scale)")
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
