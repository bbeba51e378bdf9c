#!/usr/bin/env python3
"""Print the README's "Published elsewhere" block, generated from ``helpers/ui/published.json``.

    python tools/published_table.py      # paste the output between README's published-table markers

A maintainer's tool (the reader's package never needs it); ``tests/test_published.py`` checks that the README
holds what it prints.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Iterable

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: the checkout's helpers
    sys.path.insert(0, str(ROOT))

from helpers.ui.published import PublishedFigure, generations, published_figures, short_source, size_text  # noqa: E402


def markdown_table(figures: Iterable[PublishedFigure] | None = None) -> str:
    """The README's **Published elsewhere** table (never our measurements or ceilings): a row per figure."""
    rows = [
        "| GPU | copy | as published | GB/s (10^9 B/s) | transfer size | tool | NUMA placement | link (source) "
        "| source | read |",
        "|---|---|---:|---:|---:|---|---|---|---|---|",
    ]
    for f in published_figures() if figures is None else figures:
        numa = f"{f.numa_side} socket" if f.numa_side else "not stated"
        numa = "tool binds near" if not f.numa_side and "nvbandwidth binds" in f.numa else numa
        gpu, tool, link, src = (s.replace("|", "\\|") for s in (f.gpu, f.tool, f.link, short_source(f.url)))
        rows.append(
            f"| {gpu} | {f.direction.upper()} {f.memory} | {f.value:g} {f.unit} | {f.gbps:.2f} | "
            f"{size_text(f.transfer_size_bytes)} | {tool} | {numa} | {link} | [{src}]({f.url}) "
            f"| {f.date_read} |"
        )
    return "\n".join(rows)


def published_block() -> str:
    """The README section for published figures: a heading, what they are, and the table."""
    figs = published_figures()
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


if __name__ == "__main__":
    print(published_block())
