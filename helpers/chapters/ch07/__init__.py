"""Chapter 07, beyond one GPU: the chapter interface (:mod:`helpers.ui.chapter`) over :mod:`.distributed`.

Each panel run is a real torchrun job on this machine (``gloo`` on CPU cores, ``nccl`` with one process per
GPU), so it is measured here on any machine:

>>> panel = widgets.Panel.for_chapter(ch07, device=DEVICE, nproc=NPROC, workers_per_rank=WORKERS, batch=BATCH,
...                                   epochs=EPOCHS, limit=LIMIT, width=WIDTH, timeout_s=TIMEOUT_S)

``nproc``, ``workers_per_rank`` and ``batch`` are the controls' starting values; ``epochs``, ``limit``,
``width`` and ``timeout_s`` size every job (:func:`.distributed.launch_ddp`).
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

__all__ = ["NUMBER", "TITLE", "BENCH_WEIGHT", "PANEL_TITLE", "PANEL_FIGSIZE", "benchmark", "check_job_device"]
__all__ += ["record_run", "panel_controls", "panel_validate", "panel_run", "panel_summary", "panel_plot"]

NUMBER = "07"
TITLE = "loading on several GPUs"
BENCH_WEIGHT = 1.0
PANEL_TITLE = "DistributedDataParallel on this machine"
PANEL_FIGSIZE = (7.5, 3.2)

#: Per-rank batch sizes offered by the panel.
BATCH_SIZES = (8, 16, 32, 64, 128)


def check_job_device(device: torch.device | str | None) -> torch.device:
    """``device`` as where a torchrun job runs, or one ValueError saying what to use.

    The job runs on this machine's GPUs (``nccl``, one rank per GPU) with CUDA, else on its CPU cores
    (``gloo``); ``device`` names which, so the result is labelled truthfully. Refused: a device this machine
    lacks, an indexed CPU (``"cpu:1"``), ``"cpu"`` where the job would use the GPUs anyway, and non-devices.
    """
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
    """Processes (ranks), DataLoader workers per rank and the per-rank batch size; ``context`` may set their
    starting values: ``nproc`` (1), ``workers_per_rank`` (1) and ``batch`` (32, one of :data:`BATCH_SIZES`)."""
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
    """One torchrun job with these settings, measured here (``device``: CPU cores or the GPUs, see
    :func:`check_job_device`). ``epochs``, ``limit``, ``width`` and ``timeout_s`` go to ``launch_ddp``."""
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
    palette = ["#4e79a7", "#59a14f", "#edc948", "#b07aa1", "#76b7b2", "#ff9da7", "#9c755f", "#bab0ac"]
    runs = [rec for rec in history if rec.result.value is not None]
    labels, ranks_drawn, top = [], 0, 0.0
    for i, rec in enumerate(runs):
        run: DistributedRun = rec.result.value
        per, bottom = run.per_rank_items_per_s(), 0.0
        for r, v in enumerate(per):
            label = f"rank {r}" if r >= ranks_drawn else None  # one legend entry per rank
            ax.bar(i, v, bottom=bottom, width=0.6, color=palette[r % len(palette)], edgecolor="white", label=label)
            bottom += v
        ranks_drawn, top = max(ranks_drawn, len(per)), max(top, bottom)
        ax.annotate(f"total {run.total_items_per_s():.0f}", (i, bottom), ha="center", va="bottom", fontsize=8)
        v = rec.values
        labels.append(f"#{rec.index}: {v['processes']} proc, {v['workers']} wk, bs {v['batch_size']}")
    where = runs[-1].result.source.split(",")[0] if runs else "measured now"
    ax.set_xticks(range(len(labels)))
    ax.set_xticklabels(labels, rotation=20, ha="right", fontsize=8)
    ax.set_xlim(-0.6, max(len(labels), 3) - 0.4)
    ax.set_ylim(0, top * 1.15 if top > 0 else 1)
    ax.set_ylabel("items/s (ranks stacked)")
    ax.set_title(f"Runs so far ({where}): each rank's throughput, stacked to the job's total", fontsize=9)
    ax.grid(axis="y", alpha=0.3)
    if runs:
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))


def record_run(results: ResultSet, run: DistributedRun) -> None:
    """One run's figures under ``ch07.ddp.*``: ``total_items_per_s``, ``wall_time``, ``exactly_once`` (1 if every
    epoch covered every sample once) and ``rank_items_per_s`` (param ``rank``), each with the job's settings."""
    p = run.params()
    results.add("ch07.ddp.total_items_per_s", run.total_items_per_s(), "items/s", **p)
    for r, v in zip(run.ranks, run.per_rank_items_per_s()):
        results.add("ch07.ddp.rank_items_per_s", v, "items/s", rank=int(r["rank"]), **p)
    results.add("ch07.ddp.wall_time", run.wall_s, "s", **p)
    results.add("ch07.ddp.exactly_once", float(run.exactly_once_every_epoch()), "ratio", **p)


def benchmark(results: ResultSet, device: torch.device | str | None, *, progress: ProgressFn | None = None) -> None:
    """Chapter 07's multi-GPU figures (CUDA only: a CPU records nothing): the DDP job with 1 process and with
    one per GPU (nccl), 2 workers per rank, recorded by :func:`record_run`."""
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
