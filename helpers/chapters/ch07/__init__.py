"""Chapter 07, beyond one GPU: the chapter interface (:mod:`helpers.ui.chapter`) over :mod:`.distributed`.
Each panel run is a real torchrun job on this machine (``gloo`` on CPU cores, ``nccl`` one process per GPU):

>>> panel = widgets.Panel.for_chapter(ch07, device=DEVICE, nproc=NPROC, workers_per_rank=WORKERS, batch=BATCH,
...                                   epochs=EPOCHS, limit=LIMIT, width=WIDTH, timeout_s=TIMEOUT_S)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ...core import evidence
from ...core.config import sized
from ...core.device import has_cuda, resolve_device
from ...core.evidence import Evidence
from ...core.progress import ProgressFn, no_progress, scaled
from ...core.results import ResultSet
from ...core.validate import check_int
from . import distributed
from .distributed import DistributedRun

NUMBER = "07"
TITLE = "loading on several GPUs"
BENCH_WEIGHT = 1.0
PANEL_TITLE = "DistributedDataParallel on this machine"
PANEL_FIGSIZE = (7.5, 3.2)

#: Per-rank batch sizes offered by the panel.
BATCH_SIZES = (8, 16, 32, 64, 128)


def check_job_device(device: torch.device | str | None) -> torch.device:
    """``device`` as where a torchrun job runs (the GPUs with CUDA, else the CPU cores), or one ValueError saying
    what to use: a device this machine lacks, ``"cpu:1"``, ``"cpu"`` where the job would use the GPUs anyway."""
    use = "device='cuda' (or None)" if has_cuda() else "device='cpu' (or None)"
    try:
        dev = resolve_device(device)  # unknown strings, devices this machine lacks
    except ValueError as err:
        text = str(err)
        raise ValueError(text if "use device=" in text.lower() else f"{text}; use {use}") from None
    if dev.type == "cpu" and dev.index is not None:
        raise ValueError(f"device={str(device)!r}: the CPU has no device index; use {use}")
    if dev.type == "cpu" and has_cuda():
        raise ValueError(
            f"device={str(device)!r}: with CUDA present the torchrun job runs on the GPUs (nccl, one rank per "
            "GPU), not on the CPU; use device='cuda' (or None)"
        )
    return dev


def panel_controls(**context: Any) -> dict[str, Any]:
    """Processes (ranks), workers per rank and batch per rank, starting at ``context``'s ``nproc``,
    ``workers_per_rank`` and ``batch`` (one of :data:`BATCH_SIZES`)."""
    from ...ui.widgets import W  # optional/heavy: ipywidgets

    top = distributed.max_processes()
    batch = context.get("batch", 32)
    return {
        "processes": W.IntSlider(value=min(context.get("nproc", 1), top), min=1, max=top, description="processes"),
        "workers": W.IntSlider(value=context.get("workers_per_rank", 1), min=0, max=2, description="workers/rank"),
        "batch_size": W.Dropdown(
            options=list(BATCH_SIZES), value=batch if batch in BATCH_SIZES else 32, description="batch/rank"
        ),
    }


def panel_validate(values: Mapping[str, Any]) -> None:
    """Refuse panel settings the machine can't run (ValueError naming the setting)."""
    check_int("processes", values["processes"], 1, distributed.max_processes())
    check_int("workers", values["workers"], 0, distributed.MAX_WORKERS_PER_RANK)
    check_int("batch_size", values["batch_size"], 1, 4096)


def panel_run(
    progress: ProgressFn,
    *,
    device: torch.device | str,
    processes: int,
    workers: int,
    batch_size: int,
    epochs: int = 2,
    limit: int | None = None,
    width: int = 8,
    timeout_s: float = 300.0,
    **context: Any,
) -> Evidence[DistributedRun]:
    """One torchrun job with these settings (``epochs``, ``limit``, ``width``, ``timeout_s``: ``launch_ddp``'s),
    measured here."""
    device = check_job_device(device)
    run = distributed.launch_ddp(
        processes,
        workers=workers,
        batch_size=batch_size,
        epochs=epochs,
        limit=limit,
        width=width,
        timeout_s=timeout_s,
        progress=progress,
    )
    where = "the GPUs" if run.backend == "nccl" else "CPU cores"
    method = f"torchrun on this machine's {where}; items/s over the epochs after the first"
    return evidence.measured(f"a {run.nproc}-process DDP job ({run.backend})", run, device, method=method)


def panel_summary(result: Evidence[DistributedRun]) -> str:
    """The job's figures, its coverage, its validation accuracy beside chance, and where it was measured."""
    run = result.value
    if run is None:
        return result.header()
    cov = "every sample once per epoch" if run.exactly_once_every_epoch() else "coverage NOT exact"
    learned = ""
    if run.val_accuracy is not None and run.chance is not None:
        learned = f"; validation accuracy {run.val_accuracy:.0%} (chance {run.chance:.0%})"
    return f"{run.summary()}; {cov}{learned} — {result.header()}"


def panel_plot(history: Sequence[Any], ax: Any) -> None:
    """Stacked bars per panel run: each rank's items/s (stacked) adding up to the total."""
    from ...ui import plots  # optional/heavy: matplotlib (the ranks import this package too)

    runs = [rec for rec in history if rec.result.value is not None]
    bars = {
        f"#{rec.index}: {rec.values['processes']} proc, {rec.values['workers']} wk, bs {rec.values['batch_size']}": {
            f"rank {r}": v for r, v in enumerate(rec.result.value.per_rank_items_per_s())
        }
        for rec in runs
    }
    where = runs[-1].result.source.split(",")[0] if runs else "measured now"
    title = f"Runs so far ({where}): each rank's throughput, stacked to the job's total"
    if bars:  # (none: an empty chart with its labels)
        plots.stacked_phases(bars, ax, unit="s", title=title)
    tops = [sum(per.values()) for per in bars.values()]
    for i, (rec, top) in enumerate(zip(runs, tops)):
        ax.annotate(f"total {rec.result.value.total_items_per_s():.0f}", (i, top), ha="center", va="bottom", fontsize=8)
    ax.set_xlim(-0.6, max(len(runs), 3) - 0.4)
    ax.set_ylim(0, max(tops, default=0) * 1.15 or 1)
    ax.set_ylabel("items/s (ranks stacked)")
    ax.set_title(title, fontsize=9)
    ax.grid(axis="y", alpha=0.3)


def record_run(results: ResultSet, run: DistributedRun) -> None:
    """One run's figures under ``ch07.ddp.*`` (``total_items_per_s``, ``rank_items_per_s`` per ``rank``,
    ``wall_time``, ``exactly_once``: 1 if every epoch covered every sample once), with the job's settings."""
    p = run.params()
    results.add("ch07.ddp.total_items_per_s", run.total_items_per_s(), "items/s", **p)
    for r, v in zip(run.ranks, run.per_rank_items_per_s()):
        results.add("ch07.ddp.rank_items_per_s", v, "items/s", rank=int(r["rank"]), **p)
    results.add("ch07.ddp.wall_time", run.wall_s, "s", **p)
    results.add("ch07.ddp.exactly_once", float(run.exactly_once_every_epoch()), "ratio", **p)


def benchmark(results: ResultSet, device: torch.device | str | None, *, progress: ProgressFn | None = None) -> None:
    """The DDP job with 1 process and with one per GPU, 2 workers per rank (:func:`record_run`); CUDA only."""
    progress = progress or no_progress
    if resolve_device(device).type != "cuda":  # a device this machine lacks, or no device at all: ValueError
        progress(1.0, "no CUDA device: nothing to record")
        return
    counts = sorted({1, torch.cuda.device_count()})
    for k, nproc in enumerate(counts):
        part = scaled(progress, k / len(counts), (k + 1) / len(counts), f"{nproc} process(es): ")
        run = distributed.launch_ddp(
            nproc, workers=2, batch_size=64, epochs=sized(3, 4), width=16, timeout_s=900, progress=part
        )
        record_run(results, run)
    progress(1.0, "done")
