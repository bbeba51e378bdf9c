"""Host↔GPU copy bandwidths *published elsewhere* (``published.json``: each figure cited, with its GPU, tool,
method and date read), labelled as such and never mixed with ours or with a link's theoretical ceiling in one
column, series or fit. ``tools/published_table.py`` validates the file (a test runs it) and prints the README's table.
"""

from __future__ import annotations

import json
import re
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
    return list(dict.fromkeys(f.generation for f in (_cached() if figures is None else figures)))


def point_series(figures: Iterable[PublishedFigure]) -> list[list[PublishedFigure]]:
    """Figures with a stated size, grouped by source and run (series ``k`` is marked ``[k]``), sizes ascending."""
    series: dict[tuple[Any, ...], list[PublishedFigure]] = {}
    for f in figures:
        if f.transfer_size_bytes is not None:
            series.setdefault((f.url, f.gpu, f.direction, f.memory, f.numa, f.tool), []).append(f)
    return [sorted(group, key=lambda f: f.transfer_size_bytes or 0) for group in series.values()]


_DIR_COLOR = {"h2d": "#f28e2b", "d2h": "#4e79a7"}
_MEM_MARKER = {"pinned": "D", "pageable": "v"}


def mark_figure(
    ax: Any, f: PublishedFigure, xs: list[float], ys: list[float], done: set[Any], suffix: str, **kw: Any
) -> None:
    """Plot ``f``'s kind of copy (orange H2D, blue D2H; diamond pinned, triangle pageable), black-edged, with a
    legend entry for the first of each kind only."""
    label = None if (f.direction, f.memory) in done else f"{f.direction.upper()} {f.memory}, {KIND_PUBLISHED}{suffix}"
    done.add((f.direction, f.memory))
    style = {"marker": _MEM_MARKER[f.memory], "color": _DIR_COLOR[f.direction], "markeredgecolor": "black"}
    ax.plot(xs, ys, label=label, markersize=6, **style, **kw)
