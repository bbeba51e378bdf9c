"""Host↔GPU copy bandwidths *published elsewhere*: cited, labelled, and kept apart from ours.

Four kinds of figure, each with its own label, never mixed in one column, series or fit: measured here,
recorded by this workbook on a named GPU (``helpers/core/reference/*.json``), published elsewhere with a
cited source (this module), and theoretical (a link's ceiling from its specification).

``helpers/ui/published.json`` holds one entry per figure, copied by hand from its ``url`` on its
``date_read``: GPU, link (as the source states it), tool and method, direction, memory kind, value and unit
*as published*, transfer size and NUMA placement when stated. :func:`load` refuses a file with a missing
field, a non-https URL, a non-positive value or an unknown unit. Nothing here measures or fits anything.
"""

from __future__ import annotations

import json
import re
import textwrap
from dataclasses import dataclass, fields
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterable, Sequence

from ..core.validate import check_choice, human_bytes

__all__ = [
    "KIND_MEASURED", "KIND_RECORDED", "KIND_PUBLISHED", "KIND_THEORETICAL", "KINDS", "NVLINK_C2C_GBPS", "UNITS",
    "PublishedFigure", "data_file", "load", "published_figures", "generations", "link_ceiling_gbps",
    "direction_pairs", "numa_pairs", "memory_pairs", "share_table", "markdown_table", "published_block",
    "point_series", "point_key", "largest_copies", "size_text", "short_source", "add_published_points",
    "add_theoretical_ceilings", "plot_share_of_ceiling",
]  # fmt: skip

KIND_MEASURED = "measured here"
KIND_RECORDED = "recorded by this workbook"
KIND_PUBLISHED = "published elsewhere"
KIND_THEORETICAL = "theoretical"
KINDS = (KIND_MEASURED, KIND_RECORDED, KIND_PUBLISHED, KIND_THEORETICAL)

#: NVLink-C2C (GH200's CPU-GPU link): 900 GB/s total, 450 GB/s per direction, per NVIDIA's
#: Grace Hopper architecture description. A **theoretical** ceiling, like the PCIe ones.
NVLINK_C2C_GBPS = 450.0

#: Units a published figure may carry, with the bytes per second one unit means. Tools differ:
#: the CUDA samples' bandwidthTest in its versions that print "MB/s" computes
#: ``1024 * bytes / (ms * 2**20)``, so one of its "MB/s" is 1,024,000 B/s.
UNITS: dict[str, tuple[float, ...]] = {"GB/s": (1e9,), "MB/s": (1e6, 1.024e6)}

DIRECTIONS = ("h2d", "d2h")
MEMORY_KINDS = ("pinned", "pageable")
_REQUIRED = tuple(
    "id gpu generation link product_link tool method direction memory value unit unit_bytes_per_s "
    "transfer_size_bytes numa url where published date_read notes".split()
)
_DATE = re.compile(r"^\d{4}-\d{2}-\d{2}$")
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

    kind = KIND_PUBLISHED

    @property
    def gbps(self) -> float:
        """The figure in GB/s (10**9 B/s), converted with the tool's own unit definition."""
        return self.value * self.unit_bytes_per_s / 1e9

    @property
    def as_published(self) -> str:
        """``'12150.7 MB/s'`` -- the value and unit exactly as the source prints them."""
        return f"{self.value:g} {self.unit}"

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

    @property
    def numa_short(self) -> str:
        """``'near socket'``, ``'far socket'``, ``'tool binds near'`` (nvbandwidth) or ``'not stated'``."""
        if self.numa_side:
            return f"{self.numa_side} socket"
        return "tool binds near" if "nvbandwidth binds" in self.numa else "not stated"

    @property
    def engine(self) -> str | None:
        """``'CE'`` (copy engine) or ``'SM'`` (copy kernel) for nvbandwidth tests, else None."""
        if "_memcpy_ce" in self.tool:
            return "CE"
        return "SM" if "_memcpy_sm" in self.tool else None

    def short_label(self) -> str:
        name = _short_gpu(self.gpu)
        engine = f" {self.engine}" if self.engine else ""
        side = f", {self.numa_side} socket" if self.numa_side else ""
        return f"{name} {self.direction.upper()} {self.memory}{engine}{side}"

    def citation(self) -> str:
        link = self.link if self.link != "not stated" else f"link not stated (product: {self.product_link})"
        return (
            f"[{KIND_PUBLISHED}] {self.gpu}, {link}; {self.tool}; {self.as_published}; "
            f"source: {self.url} ({self.where}); read {self.date_read}"
        )


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


def _short_gpu(gpu: str) -> str:
    s = re.sub(r"^(NVIDIA |Tesla |GeForce )+", "", gpu)
    s = s.replace("GeForce ", "")
    s = re.sub(r"\s*\(.*?\)", "", s)
    return s.strip()


def data_file() -> Path:
    return Path(__file__).resolve().parent / "published.json"


def link_ceiling_gbps(link: str) -> float | None:
    """The **theoretical** per-direction ceiling of ``'PCIe Gen4 x16'`` or ``'NVLink-C2C'``; None if unknown."""
    from ..core import device  # heavy: torch (this module imports without it)

    m = _PCIE.match(link.strip())
    if m:
        return device.pcie_bandwidth_gbps(int(m.group(1)), int(m.group(2)))
    if link.strip() == "NVLink-C2C":
        return NVLINK_C2C_GBPS
    return None


def _check_entry(raw: Any, index: int) -> PublishedFigure:
    if not isinstance(raw, dict):
        raise ValueError(f"published figure #{index} must be a JSON object, got {type(raw).__name__}")
    name = f"published figure #{index} ({raw.get('id', 'no id')})"
    missing = [k for k in _REQUIRED if k not in raw]
    if missing:
        raise ValueError(f"{name} lacks field(s) {missing}: every entry needs {list(_REQUIRED)}")
    extra = sorted(set(raw) - set(_REQUIRED))
    if extra:
        raise ValueError(f"{name} has unknown field(s) {extra}; allowed: {list(_REQUIRED)}")
    for key in _REQUIRED:
        if key in ("value", "unit_bytes_per_s", "transfer_size_bytes", "notes"):
            continue
        if not isinstance(raw[key], str) or not raw[key].strip():
            raise ValueError(f"{name}: field '{key}' must be a non-empty string, got {raw[key]!r}")
    if not isinstance(raw["notes"], str):
        raise ValueError(f"{name}: field 'notes' must be a string (may be empty), got {raw['notes']!r}")
    if not raw["url"].startswith("https://"):
        raise ValueError(f"{name}: url must start with https://, got {raw['url']!r}")
    value = raw["value"]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{name}: value must be a number > 0, got {value!r}")
    check_choice(f"{name}: unit", raw["unit"], UNITS)
    if raw["unit_bytes_per_s"] not in UNITS[raw["unit"]]:
        raise ValueError(
            f"{name}: unit_bytes_per_s for {raw['unit']} must be one of {list(UNITS[raw['unit']])}, "
            f"got {raw['unit_bytes_per_s']!r}"
        )
    check_choice(f"{name}: direction", raw["direction"], DIRECTIONS)
    check_choice(f"{name}: memory", raw["memory"], MEMORY_KINDS)
    size = raw["transfer_size_bytes"]
    if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size <= 0):
        raise ValueError(f"{name}: transfer_size_bytes must be a positive integer or null, got {size!r}")
    if not _DATE.match(raw["date_read"]):
        raise ValueError(f"{name}: date_read must be YYYY-MM-DD, got {raw['date_read']!r}")
    if raw["product_link"] != "not stated" and link_ceiling_gbps(raw["product_link"]) is None:
        raise ValueError(
            f"{name}: product_link must look like 'PCIe Gen4 x16' or 'NVLink-C2C', got {raw['product_link']!r}"
        )
    return PublishedFigure(**{f.name: raw[f.name] for f in fields(PublishedFigure)})


def _key(f: PublishedFigure) -> tuple[Any, ...]:
    return (f.url, f.gpu, f.tool, f.direction, f.memory, f.transfer_size_bytes, f.numa)


def load(path: str | Path | None = None) -> list[PublishedFigure]:
    """Read and validate a published-figures file (default: :func:`data_file`); ValueError for a bad entry or
    a duplicate."""
    p = Path(path) if path is not None else data_file()
    try:
        doc = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read published figures from {p}: {exc}") from exc
    if not isinstance(doc, dict) or doc.get("kind") != KIND_PUBLISHED or not isinstance(doc.get("figures"), list):
        raise ValueError(f"{p} must be a JSON object with kind '{KIND_PUBLISHED}' and a 'figures' list")
    out = [_check_entry(raw, i) for i, raw in enumerate(doc["figures"])]
    seen_ids: set[str] = set()
    seen_keys: set[tuple[Any, ...]] = set()
    for f in out:
        if f.id in seen_ids:
            raise ValueError(f"duplicate published figure id {f.id!r} in {p}")
        if _key(f) in seen_keys:
            raise ValueError(
                f"published figure {f.id!r} duplicates another entry (same source, GPU, tool, direction, "
                f"memory, size and NUMA placement) in {p}"
            )
        seen_ids.add(f.id)
        seen_keys.add(_key(f))
    return out


@lru_cache(maxsize=1)
def _cached() -> tuple[PublishedFigure, ...]:
    return tuple(load())


def published_figures(
    direction: str | None = None, memory: str | None = None, *, generation: str | None = None, sized: bool = False
) -> list[PublishedFigure]:
    """The shipped published figures, filtered by direction, memory kind, GPU generation (``"Ampere"``), and
    to those whose source states the transfer size (``sized``); None keeps all."""
    if direction is not None:
        check_choice("direction", direction, DIRECTIONS)
    if memory is not None:
        check_choice("memory", memory, MEMORY_KINDS)
    figs = list(_cached())
    if generation is not None:
        check_choice("generation", generation, generations(figs))
    return [
        f
        for f in figs
        if (direction is None or f.direction == direction)
        and (memory is None or f.memory == memory)
        and (generation is None or f.generation == generation)
        and (not sized or f.transfer_size_bytes)
    ]


def generations(figures: Iterable[PublishedFigure] | None = None) -> list[str]:
    """GPU generations present, in the order they first appear."""
    figs = list(figures) if figures is not None else list(_cached())
    return list(dict.fromkeys(f.generation for f in figs))


def _pair(
    figures: Iterable[PublishedFigure] | None, field: str, a: str, b: str, same: Sequence[str]
) -> list[tuple[PublishedFigure, PublishedFigure]]:
    """Pairs (x, y) with x.field == a, y.field == b and equal values of every attribute in ``same``."""
    figs = list(figures) if figures is not None else list(_cached())
    xs, ys = [x for x in figs if getattr(x, field) == a], [y for y in figs if getattr(y, field) == b]
    return [(x, y) for x in xs for y in ys if all(getattr(x, s) == getattr(y, s) for s in same)]


def direction_pairs(figures: Iterable[PublishedFigure] | None = None) -> list[tuple[PublishedFigure, PublishedFigure]]:
    """(H2D, D2H) pairs from one source and run: same GPU, memory kind, size and NUMA placement."""
    return _pair(figures, "direction", "h2d", "d2h", ("url", "gpu", "memory", "transfer_size_bytes", "numa", "method"))


def numa_pairs(figures: Iterable[PublishedFigure] | None = None) -> list[tuple[PublishedFigure, PublishedFigure]]:
    """(near socket, far socket) pairs: the same GPU, direction and copy, placed on either socket."""
    return _pair(
        figures, "numa_side", "near", "far", ("url", "gpu", "direction", "memory", "transfer_size_bytes", "tool")
    )


def memory_pairs(figures: Iterable[PublishedFigure] | None = None) -> list[tuple[PublishedFigure, PublishedFigure]]:
    """(pageable, pinned) pairs: same source, GPU, direction, size and NUMA placement."""
    return _pair(figures, "memory", "pageable", "pinned", ("url", "gpu", "direction", "transfer_size_bytes", "numa"))


def share_table(figures: Iterable[PublishedFigure] | None = None) -> str:
    """A plain-text table: published GB/s and, in its own column, the **theoretical** host-link ceiling."""
    figs = list(figures) if figures is not None else list(_cached())
    head = (
        f"{'GPU, copy':<40}{'size':>10}{'published':>11}  {'host link':<15}{'theoretical':>13}{'share':>7}\n"
        f"{'':<50}{'GB/s':>11}  {'(product spec)':<15}{'GB/s':>13}"
    )
    lines = [head, "-" * len(head.splitlines()[0])]
    for f in figs:
        c = f.ceiling_gbps
        share = f"{f.share_of_ceiling:.0%}" if c else "—"
        size = "—" if f.transfer_size_bytes is None else size_text(f.transfer_size_bytes)
        lines.append(
            f"{f.short_label():<40}{size:>10}{f.gbps:>11.2f}  {f.product_link:<15}"
            f"{(f'{c:.1f}' if c else '—'):>13}{share:>7}"
        )
    return "\n".join(lines)


def _md_escape(s: str) -> str:
    return s.replace("|", "\\|")


def markdown_table(figures: Iterable[PublishedFigure] | None = None) -> str:
    """The README's **Published elsewhere** table (never our measurements or ceilings): a row per figure."""
    figs = list(figures) if figures is not None else list(_cached())
    rows = [
        "| GPU | copy | as published | GB/s (10^9 B/s) | transfer size | tool | NUMA placement | link (source) "
        "| source | read |",
        "|---|---|---:|---:|---:|---|---|---|---|---|",
    ]
    for f in figs:
        numa = f.numa_short
        size = size_text(f.transfer_size_bytes)
        src = short_source(f.url)
        rows.append(
            f"| {_md_escape(f.gpu)} | {f.direction.upper()} {f.memory} | {f.as_published} | {f.gbps:.2f} | {size} | "
            f"{_md_escape(f.tool)} | {numa} | {_md_escape(f.link)} | [{_md_escape(src)}]({f.url}) | {f.date_read} |"
        )
    return "\n".join(rows)


def published_block() -> str:
    """The README section proposed for published figures: a heading, what they are, and the table."""
    figs = list(_cached())
    gens = generations(figs)
    return "\n".join(
        [
            "### Published elsewhere (cited, not measured by this workbook)",
            "",
            f"Host↔GPU copy bandwidths that others measured and published, {len(figs)} figures on "
            f"{len(gens)} GPU generations ({', '.join(gens)}). Each row was copied by hand from its source on the "
            "date shown, with the tool and its method (`helpers/ui/published.json` holds every field, including the "
            "exact method and notes). They are a third kind of figure: not our measurements, not our reference "
            "files, and not theoretical ceilings, so they get their own table and are never fitted together with "
            "ours. Chapters 00 and 02 show them beside the theoretical ceilings and beside your own curve.",
            "",
            markdown_table(figs),
            "",
            '"link (source)" is the host link as the source states it; most sources do not. "NUMA placement: tool '
            "binds near\" means nvbandwidth pins itself to the GPU's socket before allocating the host buffer.",
        ]
    )


_DIR_COLOR = {"h2d": "#f28e2b", "d2h": "#4e79a7"}
_MEM_MARKER = {"pinned": "D", "pageable": "v"}


def point_series(figures: Iterable[PublishedFigure] | None = None) -> list[list[PublishedFigure]]:
    """Figures with a stated size, grouped by source and run (series ``k`` is marked ``[k]``), sizes ascending."""
    figs = list(figures) if figures is not None else list(_cached())
    series: dict[tuple[Any, ...], list[PublishedFigure]] = {}
    for f in figs:
        if f.transfer_size_bytes is not None:
            series.setdefault((f.url, f.gpu, f.direction, f.memory, f.numa, f.tool), []).append(f)
    return [sorted(group, key=lambda f: f.transfer_size_bytes or 0) for group in series.values()]


def largest_copies(figures: Iterable[PublishedFigure] | None = None) -> list[PublishedFigure]:
    """One figure per source and run: its largest stated transfer size (figures without a size kept as they are)."""
    figs = list(figures) if figures is not None else list(_cached())
    keep = {id(group[-1]) for group in point_series(figs)}
    return [f for f in figs if f.transfer_size_bytes is None or id(f) in keep]


def point_key(figures: Iterable[PublishedFigure] | None = None) -> str:
    """The key to the ``[k]`` marks of :func:`add_published_points`: one line per series, with its source."""
    lines = []
    for k, group in enumerate(point_series(figures), start=1):
        f = group[-1]
        sizes = ", ".join(size_text(g.transfer_size_bytes) for g in group)
        vals = ", ".join(f"{g.gbps:.1f}" for g in group)
        lines.append(f"[{k}] {f.short_label()}: {vals} GB/s at {sizes}")
        lines += [f"     {wrapped}" for wrapped in textwrap.wrap(f"{f.tool}; source: {short_source(f.url)}", 100)]
    return "\n".join(lines)


def add_published_points(
    ax: Any, figures: Iterable[PublishedFigure] | None = None, *, annotate: bool = True, fontsize: float = 7.0
) -> list[PublishedFigure]:
    """Draw published figures on a bandwidth-vs-size Axes (black-edged diamonds: pinned, triangles: pageable;
    orange H2D, blue D2H; a source's sizes dotted, ``[k]`` by the largest); return those without a size."""
    figs = list(figures) if figures is not None else list(_cached())
    skipped = [f for f in figs if f.transfer_size_bytes is None]
    legend_done: set[tuple[str, str]] = set()
    for k, group in enumerate(point_series(figs), start=1):
        f0 = group[-1]
        color, marker = _DIR_COLOR[f0.direction], _MEM_MARKER[f0.memory]
        xs = [float(f.transfer_size_bytes or 0) for f in group]
        ys = [f.gbps for f in group]
        key = (f0.direction, f0.memory)
        label = f"{f0.direction.upper()} {f0.memory}, {KIND_PUBLISHED} [k]" if key not in legend_done else None
        legend_done.add(key)
        line = {"linestyle": ":" if len(group) > 1 else "", "linewidth": 0.8, "markersize": 6, "zorder": 4}
        edge = {"markeredgecolor": "black", "markeredgewidth": 0.7}
        ax.plot(xs, ys, marker=marker, color=color, label=label, **line, **edge)
        if annotate:
            text = {"textcoords": "offset points", "fontsize": fontsize, "color": "#222", "zorder": 5}
            ax.annotate(f"{k}", (xs[-1], ys[-1]), xytext=(4, -3), **text)
    if ax.get_xscale() == "log":
        _size_ticks(ax)
    return skipped


def _size_ticks(ax: Any) -> None:
    """Label a log x axis of byte sizes at 4 KiB, 64 KiB, 1 MiB, ... across its whole current range."""
    lo, hi = ax.get_xlim()
    ticks = [4.0**k * 1024 for k in range(1, 16) if lo <= 4.0**k * 1024 <= hi]
    if len(ticks) > 6:
        ticks = ticks[::2]
    if ticks:
        ax.set_xticks(ticks)
        ax.set_xticklabels([human_bytes(t).replace(".0 ", " ") for t in ticks])
        ax.minorticks_off()


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
    drawn = []
    for i, (c, names) in enumerate(sorted(by_value.items())):
        label = f"{' = '.join(names)}: {c:.1f} GB/s, {KIND_THEORETICAL}"
        ax.axhline(c, color="#777", linewidth=0.9, linestyle=styles[i % len(styles)], label=label, zorder=1)
        drawn.extend(names)
    return drawn


def plot_share_of_ceiling(figures: Iterable[PublishedFigure] | None = None, ax: Any = None) -> Any:
    """A row per figure: the **published** GB/s (marker), its host link's **theoretical** ceiling (bar) and
    the share. Log x axis: NVLink-C2C and PCIe Gen3 differ tenfold."""
    from . import plots  # optional/heavy: matplotlib

    figs = [f for f in (figures if figures is not None else _cached()) if f.ceiling_gbps]
    ax = ax if ax is not None else plots.new_axes((8.5, 0.32 * len(figs) + 1.4))
    ys = list(range(len(figs)))[::-1]
    ceilings = [f.ceiling_gbps or 0.0 for f in figs]
    ax.barh(ys, ceilings, color="#e6e6e6", edgecolor="#999", label=f"host link ceiling, {KIND_THEORETICAL}")
    done: set[tuple[str, str]] = set()
    for y, f, c in zip(ys, figs, ceilings):
        key = (f.direction, f.memory)
        label = None if key in done else f"{f.direction.upper()} {f.memory}, {KIND_PUBLISHED}"
        style = {"markeredgecolor": "black", "linestyle": "", "markersize": 6}
        ax.plot([f.gbps], [y], marker=_MEM_MARKER[f.memory], color=_DIR_COLOR[f.direction], label=label, **style)
        done.add(key)
        ax.text(c * 1.08, y, f"{f.share_of_ceiling:.0%}", va="center", fontsize=7)
    ax.set_yticks(ys)
    ax.set_yticklabels([f"{f.short_label()} ({f.product_link})" for f in figs], fontsize=7)
    _share_axes(ax, max(ceilings) * 2.2 if figs else 10)
    return ax


def _share_axes(ax: Any, right: float) -> None:
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator  # optional/heavy: matplotlib

    ax.set_xscale("log")
    ax.set_xlim(1, right)
    ax.xaxis.set_major_locator(FixedLocator([1, 2, 5, 10, 20, 50, 100, 200, 500]))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:g}"))
    ax.xaxis.set_minor_locator(NullLocator())
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
