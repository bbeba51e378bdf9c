"""Do repeated runs of chapter 06's waterfall give the same verdict for every step? (issue #28.2)

Usage: ``python tools/verdict_runs.py --runs 3`` (from the workbook's folder, with the workbook installed or
``PYTHONPATH`` set to it). It runs what a Run All of chapter 06 runs at the laptop tier (it sets
``WORKBOOK_QUICK=0 WORKBOOK_FULL=0`` for itself): calibrate both regimes on this machine, then each regime's
waterfall in alternating rounds, through the pipeline of ``examples/fast_pipeline.py`` (the chapter's cells,
line for line). It does that ``--runs`` times and prints, per regime and step, the verdict of each run, its
median gain, and whether all runs agree. Steps that cannot act on this device are listed as 'needs CUDA'
(not measured). Exits 0 either way: disagreement is a finding, not an error.

It takes minutes (about 2-4 per run on 2 cores) and its verdicts depend on what else the machine runs:
say so when you report them.
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="how many times to run the chapter's waterfalls (1-20)")
    parser.add_argument("--regimes", nargs="+", default=["data-bound", "compute-bound"], help="which regimes")
    parser.add_argument("--rounds", type=int, default=None, help="rounds per waterfall (default: the tier's)")
    args = parser.parse_args(argv)
    if not 1 <= args.runs <= 20:
        parser.error("--runs must be 1-20")
    os.environ["WORKBOOK_QUICK"] = "0"  # the laptop tier, as a reader's Run All on a machine without a GPU
    os.environ["WORKBOOK_FULL"] = "0"

    from helpers.chapters.ch06 import calibration, capstone, job  # after the environment: sizes are read from it
    from helpers.core.device import resolve_device

    for regime in args.regimes:
        if regime not in capstone.REGIMES:
            parser.error(f"unknown regime {regime!r}; choose from {', '.join(capstone.REGIMES)}")
    dev = resolve_device(None)
    pipe = job.reference_pipeline(dev)
    table: dict[str, dict[str, list[tuple[str, float | None]]]] = {r: {} for r in args.regimes}
    for run in range(args.runs):
        t0 = time.perf_counter()
        cal = calibration.calibrate(dev, pipeline=pipe)
        for regime in args.regimes:
            spec = job.job_spec(regime, width=cal[regime].width, depth=cal[regime].depth)
            wf = capstone.run_waterfall(
                regime, dev, spec=spec, calibration=cal[regime], rounds=args.rounds, pipeline=pipe
            )
            gains = dict(zip((r.name for r in wf.results), wf.gains()))
            for name, verdict in wf.step_verdicts().items():
                table[regime].setdefault(name, []).append((verdict, gains.get(name)))
            floor, noise = wf.noise_floor(), wf.ratio_noise()
            spread = (
                f"epoch times varied {floor:.0%} between rounds, step gains scattered {noise:.0%} (IQR)"
                if floor is not None and noise is not None
                else "one round: no spread"
            )
            print(
                f"run {run + 1}/{args.runs}, {regime}: width {spec.width}, depth {spec.depth}, {wf.rounds} "
                f"rounds, {spread}; " + ", ".join(f"{r.name} {r.epoch_s:.2f} s" for r in wf.results),
                flush=True,
            )
        load = f", load average {os.getloadavg()[0]:.1f}" if hasattr(os, "getloadavg") else ""
        print(f"run {run + 1}/{args.runs} took {time.perf_counter() - t0:.0f} s{load}", flush=True)
    print()
    print(f"{'regime':<14}{'step':<12}" + "".join(f"{'run ' + str(i + 1):<22}" for i in range(args.runs)) + "agree")
    disagree = 0
    for regime, steps in table.items():
        for name, runs in steps.items():
            cells = [v if g is None else f"{v} x{g:.2f}" for v, g in runs]
            same = len({v for v, _ in runs}) == 1
            disagree += not same
            print(f"{regime:<14}{name:<12}" + "".join(f"{c:<22}" for c in cells) + ("yes" if same else "NO"))
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "n/a"
    print(
        f"\n{disagree} step(s) whose verdict differs between runs, on {dev} ({os.cpu_count()} CPUs seen; "
        f"load average at the end {load}: other programs' work shows up as noise)."
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
