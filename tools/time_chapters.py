#!/usr/bin/env python3
"""Measure how long Run All of each chapter takes here, and record it for the setup cells.

    python tools/time_chapters.py                    # the tier this machine gets (laptop without a GPU)
    python tools/time_chapters.py --tier quick 00 04 # chosen chapters, another tier

Each chapter runs top to bottom in a fresh kernel (nbclient), as Run All in JupyterLab does,
with a per-chapter time limit. The wall times go into ``helpers/core/chapter_times.json``
with the machine they were measured on, so that a chapter's setup cell can say how long it
should take (``helpers.core.config.describe_sizes``) and the README can list them. A chapter that
fails or runs past the limit is recorded as such, never as a time. It is a measurement, not a
test: CI never runs it.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "helpers" / "core" / "chapter_times.json"  # where helpers.core.config reads them


def machine() -> str:
    import psutil
    import torch

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    ram = psutil.virtual_memory().total / 2**30
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return f"{cores} cores, {ram:.0f} GiB RAM, {gpu} ({platform.machine()}, torch {torch.__version__})"


def run_chapter(path: Path, tier: str, limit_s: int) -> dict[str, object]:
    import nbformat
    from nbclient import NotebookClient

    env_tier = {
        "quick": {"WORKBOOK_QUICK": "1", "WORKBOOK_FULL": "0"},
        "laptop": {"WORKBOOK_QUICK": "0", "WORKBOOK_FULL": "0"},
        "full": {"WORKBOOK_QUICK": "0", "WORKBOOK_FULL": "1"},
    }[tier]
    os.environ.update(env_tier)
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(
        nb, timeout=limit_s, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}
    )
    started = time.perf_counter()
    try:
        client.execute()
    except Exception as exc:  # a failure or a time-out is recorded, not hidden
        return {
            "status": "failed",
            "seconds": round(time.perf_counter() - started, 1),
            "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}",
        }
    return {"status": "ok", "seconds": round(time.perf_counter() - started, 1)}


def main(argv: list[str] | None = None) -> int:
    sys.path.insert(0, str(ROOT))
    from helpers.core import config

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("chapters", nargs="*", help="two-digit chapter numbers (default: all)")
    p.add_argument("--tier", choices=config.TIERS, default=None, help="default: this machine's tier")
    p.add_argument("--limit", type=int, default=900, help="seconds allowed per chapter")
    p.add_argument(
        "--out", type=Path, default=OUT, help="default: helpers/core/chapter_times.json, the file the setup cells read"
    )
    args = p.parse_args(argv)
    tier = args.tier or config.size_tier()
    notebooks = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
    chosen = [nb for nb in notebooks if not args.chapters or nb.name[:2] in args.chapters]
    if not chosen:
        p.error(f"no chapter matches {args.chapters}; chapters are {[nb.name[:2] for nb in notebooks]}")
    try:
        record = json.loads(args.out.read_text())
    except (OSError, ValueError):
        record = {}
    here = machine()
    if record.get("machine") != here:
        record = {"chapters": {}}  # times from another machine are not mixed with these
    record.update(
        machine=here,
        date=dt.date.today().isoformat(),
        method="nbclient Run All in a fresh kernel, wall clock, one run per chapter",
    )
    for nb in chosen:
        print(f"{nb.name} at {tier} sizes ...", end=" ", flush=True)
        result = run_chapter(nb, tier, args.limit)
        print(result)
        if result["status"] == "ok":
            record["chapters"].setdefault(nb.name[:2], {})[tier] = {"seconds": result["seconds"]}
        else:
            record["chapters"].setdefault(nb.name[:2], {}).pop(tier, None)
        args.out.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
