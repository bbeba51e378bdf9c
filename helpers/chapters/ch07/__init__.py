"""Chapter 07, beyond one GPU: the chapter interface over :mod:`.distributed`; each panel run is a real torchrun
job on this machine (``gloo`` on CPU cores, ``nccl`` one process per GPU)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ...core import evidence
from ...core.config import sized
from ...core.device import has_cuda, resolve_device
from ...core.evidence import Evidence
from ...core.progress import ProgressFn, no_progress, scaled
from ...core.results import ResultSet
from . import distributed
from .distributed import DistributedRun

NUMBER = "07"
TITLE = "loading on several GPUs"
BENCH_WEIGHT = 1.0
PANEL_TITLE = "DistributedDataParallel on this machine"

BATCH_SIZES = (8, 16, 32, 64, 128)


def check_job_device(device: torch.device | str | None) -> torch.device:
    """Where a torchrun job runs (the GPUs with CUDA, else the CPU cores), or one ValueError saying what to use."""
    use = f"use device={'cuda' if has_cuda() else 'cpu'!r} (or None)"
    try:
        dev = resolve_device(device)  # unknown strings, devices this machine lacks
    except ValueError as err:
        raise ValueError(str(err) if "use device=" in str(err).lower() else f"{err}; {use}") from None
    if dev.type == "cpu" and (dev.index is not None or has_cuda()):
        why = "with CUDA present the torchrun job runs on the GPUs (nccl, one rank per GPU), not on the CPU"
        why = "the CPU has no device index" if dev.index is not None else why
        raise ValueError(f"device={str(device)!r}: {why}; {use}")
    return dev


def panel_controls(**context: Any) -> dict[str, Any]:
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


def panel_run(
    progress: ProgressFn, *, device: torch.device | str, processes: int, workers: int, batch_size: int, **context: Any
) -> Evidence[DistributedRun]:
    device = check_job_device(device)
    job = {k: context[k] for k in ("epochs", "limit", "width", "timeout_s") if k in context}
    run = distributed.launch_ddp(processes, workers=workers, batch_size=batch_size, progress=progress, **job)
    where = "the GPUs" if run.backend == "nccl" else "CPU cores"
    method = f"torchrun on this machine's {where}; items/s over the epochs after the first"
    return evidence.measured(f"a {run.nproc}-process DDP job ({run.backend})", run, device, method=method)


def panel_summary(result: Evidence[DistributedRun]) -> str:
    run = result.value
    if run is None:
        return result.header()
    cov = "every sample once per epoch" if run.exactly_once_every_epoch() else "coverage NOT exact"
    return f"{run.summary()}; {cov}; {run.learning()} — {result.header()}"


def panel_plot(history: Sequence[Any], ax: Any) -> None:
    """The last four runs side by side: each rank's items/s, then the job's total."""
    runs = [rec for rec in history if rec.result.value is not None][-4:]
    where = runs[-1].result.source.split(",")[0] if runs else "measured now"
    title = f"Runs so far ({where}): each rank's items/s, then the total (wk: workers/rank, bs: batch/rank)"
    distributed.plot_runs([rec.result.value for rec in runs], ax, names=[f"#{r.index} " for r in runs], title=title)


def record_run(results: ResultSet, run: DistributedRun) -> None:
    """One run's figures under ``ch07.ddp.*``, with the job's settings."""
    p = run.params()
    results.add("ch07.ddp.total_items_per_s", run.total_items_per_s(), "items/s", **p)
    for r, v in zip(run.ranks, run.per_rank_items_per_s()):
        results.add("ch07.ddp.rank_items_per_s", v, "items/s", rank=int(r["rank"]), **p)
    results.add("ch07.ddp.wall_time", run.wall_s, "s", **p)
    results.add("ch07.ddp.exactly_once", float(run.exactly_once_every_epoch()), "ratio", **p)


def benchmark(results: ResultSet, device: torch.device | str | None, *, progress: ProgressFn | None = None) -> None:
    """The DDP job with 1 process and with one per GPU, 2 workers per rank; CUDA only."""
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
