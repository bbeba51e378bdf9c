#!/usr/bin/env python3
"""Check ``helpers/ui/published.json`` and print the README's "Published elsewhere" block from it.

    python tools/published_table.py      # paste the output between README's published-table markers

A maintainer's tool (the reader's package never needs it); ``tests/test_published.py`` checks the shipped file
with :func:`check_file` and that the README holds what this prints.
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import fields
from pathlib import Path
from typing import Any, Iterable

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: the checkout's helpers
    sys.path.insert(0, str(ROOT))

from helpers.ui import published  # noqa: E402
from helpers.ui.published import PublishedFigure, generations, published_figures, short_source, size_text  # noqa: E402

#: Units a published figure may carry, with the bytes per second one unit means. Tools differ:
#: the CUDA samples' bandwidthTest in its versions that print "MB/s" computes
#: ``1024 * bytes / (ms * 2**20)``, so one of its "MB/s" is 1,024,000 B/s.
UNITS: dict[str, tuple[float, ...]] = {"GB/s": (1e9,), "MB/s": (1e6, 1.024e6)}
REQUIRED = tuple(f.name for f in fields(PublishedFigure))
_DATE = re.compile(r"^\d{4}-\d{2}-\d{2}$")


def _check_entry(raw: Any, index: int) -> PublishedFigure:
    if not isinstance(raw, dict):
        raise ValueError(f"published figure #{index} must be a JSON object, got {type(raw).__name__}")
    name = f"published figure #{index} ({raw.get('id', 'no id')})"
    missing, extra = [k for k in REQUIRED if k not in raw], sorted(set(raw) - set(REQUIRED))
    if missing or extra:
        what = f"lacks field(s) {missing}" if missing else f"has unknown field(s) {extra}"
        raise ValueError(f"{name} {what}: every entry needs exactly {list(REQUIRED)}")

    def need(ok: bool, message: str) -> None:
        if not ok:
            raise ValueError(f"{name}: {message}")

    for key in REQUIRED:
        if key not in ("value", "unit_bytes_per_s", "transfer_size_bytes", "notes"):
            text = isinstance(raw[key], str) and bool(raw[key].strip())
            need(text, f"field '{key}' must be a non-empty string, got {raw[key]!r}")
    need(isinstance(raw["notes"], str), f"field 'notes' must be a string (may be empty), got {raw['notes']!r}")
    need(raw["url"].startswith("https://"), f"url must start with https://, got {raw['url']!r}")
    value, size, unit, link = raw["value"], raw["transfer_size_bytes"], raw["unit"], raw["product_link"]
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    need(number and value > 0, f"value must be a number > 0, got {value!r}")
    for key, choices in (("unit", UNITS), ("direction", published.DIRECTIONS), ("memory", published.MEMORY_KINDS)):
        need(raw[key] in choices, f"{key} must be one of {list(choices)}, got {raw[key]!r}")
    per, got = UNITS[unit], raw["unit_bytes_per_s"]
    need(got in per, f"unit_bytes_per_s for {unit} must be one of {list(per)}, got {got!r}")
    whole = size is None or (isinstance(size, int) and not isinstance(size, bool) and size > 0)
    need(whole, f"transfer_size_bytes must be a positive integer or null, got {size!r}")
    need(bool(_DATE.match(raw["date_read"])), f"date_read must be YYYY-MM-DD, got {raw['date_read']!r}")
    known = link == "not stated" or published.link_ceiling_gbps(link) is not None
    need(known, f"product_link must look like 'PCIe Gen4 x16' or 'NVLink-C2C', got {link!r}")
    return PublishedFigure(**raw)


def same_copy(f: PublishedFigure) -> tuple[Any, ...]:
    """What makes two entries the same copy: source, GPU, tool, direction, memory, size and NUMA placement."""
    return (f.url, f.gpu, f.tool, f.direction, f.memory, f.transfer_size_bytes, f.numa)


def check_file(path: Path) -> list[PublishedFigure]:
    """The figures of a published-figures file; ValueError for a missing field, a non-https URL, a non-positive
    value, an unknown unit, link or date, or a duplicate."""
    try:
        doc = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read published figures from {path}: {exc}") from exc
    if (
        not isinstance(doc, dict)
        or doc.get("kind") != published.KIND_PUBLISHED
        or not isinstance(doc.get("figures"), list)
    ):
        raise ValueError(f"{path} must be a JSON object with kind '{published.KIND_PUBLISHED}' and a 'figures' list")
    out = [_check_entry(raw, i) for i, raw in enumerate(doc["figures"])]
    for i, f in enumerate(out):
        if f.id in {g.id for g in out[:i]}:
            raise ValueError(f"duplicate published figure id {f.id!r} in {path}")
        if same_copy(f) in {same_copy(g) for g in out[:i]}:
            raise ValueError(
                f"published figure {f.id!r} duplicates another entry (same source, GPU, tool, direction, "
                f"memory, size and NUMA placement) in {path}"
            )
    return out


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
