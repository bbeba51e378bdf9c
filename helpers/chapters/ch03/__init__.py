"""Chapter 03, ``pin_memory=True`` in the DataLoader: the panel and benchmark, section 4's verdict and the pin-time
figure (the pin step's own time needs CUDA; else the reference runs' figure)."""

from __future__ import annotations

import inspect
import statistics
from typing import Any, Callable, Mapping, Sequence

import ipywidgets as W
import torch

from ...core import agreement, config, evidence
from ...core.device import resolve_device
from ...core.evidence import Evidence
from ...core.progress import ProgressFn, no_progress, scaled
from ...core.results import Record, ResultSet
from ...core.validate import check_int
from ...pipeline import loaders
from ...pipeline.data import ShapesDataset, default_sizes, make_shapes_dataset
from ...ui import plots
from . import pinning

NUMBER = "03"
TITLE = "pin_memory in the DataLoader"
BENCH_WEIGHT = 0.75
PANEL_TITLE = "pin_memory in your DataLoader"

#: The pin-time figure: (what, ms per batch) rows.
PinTimes = list[tuple[str, float]]


def benchmark(
    results: ResultSet,
    device: torch.device | str | None,
    *,
    progress: ProgressFn | None = None,
    info: Any = None,
    sizes: Mapping[str, int] | None = None,
    batches: int | None = None,
    warmup: int | None = None,
) -> ResultSet:
    """Record ``ch03.items_per_s`` {num_workers, pin_memory, pin_active, device}, ``ch03.main_wait_ms`` (the main
    thread's mean wait per batch), ``ch03.pin_ms_per_batch`` {num_workers, thread} (CUDA only) and
    ``ch03.copy_ms_per_batch`` {bytes} (a plain copy of one batch). The keywords are overrides for tests."""
    progress = progress or no_progress
    dev = resolve_device(device)
    sizes = dict(sizes) if sizes is not None else default_sizes()
    info = info if info is not None else make_shapes_dataset()
    ds = ShapesDataset(info.train_dir, crop_size=sizes["crop_size"], output="float")
    bs = sizes["batch_size"]
    batches = batches if batches is not None else config.sized(30, 80)
    warm = warmup if warmup is not None else config.sized(4, 8)

    progress(0.05, "ch03: pin_memory")
    rows = pinning.pin_memory_experiment(
        ds, workers=(0, 2), batch_size=bs, batches=batches, warmup=warm, progress=scaled(progress, 0.05, 0.9, "ch03: ")
    )
    for r in rows:
        knobs: dict[str, Any] = {"num_workers": r.num_workers, "pin_memory": r.pin_memory}
        results.add("ch03.items_per_s", r.items_per_s, "items/s", **knobs, pin_active=r.pin_active, device=str(dev))
        results.add("ch03.main_wait_ms", r.result.mean_wait_ms, "ms", **knobs)
        if r.pin_ms_per_batch is not None:
            results.add(
                "ch03.pin_ms_per_batch", r.pin_ms_per_batch, "ms", num_workers=r.num_workers, thread=r.pin_thread
            )
    progress(0.9, "ch03: a plain copy of one batch")
    nbytes = rows[0].result.batch_bytes or 1
    results.add("ch03.copy_ms_per_batch", 1e3 * pinning.batch_copy_seconds(nbytes), "ms", bytes=nbytes)
    progress(1.0, "done")
    return results


def _pair(rows: Sequence[pinning.PinRow]) -> tuple[pinning.PinRow, pinning.PinRow]:
    """The pin_memory=False and True rows of :func:`~.pinning.pin_pair_rounds`."""
    pair = {r.pin_memory: r for r in rows}
    if set(pair) != {False, True} or len(rows) != 2:
        raise ValueError("rows must hold the pin_memory=False/True pair of pin_pair_rounds")
    return pair[False], pair[True]


def pin_pair_verdict(rows: Sequence[pinning.PinRow]) -> str:
    """One sentence on section 4's pair: the gap is within noise when the per-round ratios fall on both sides of 1;
    else, with CUDA, the flag's effect; without, load (both did the same work), and the faster figure is trusted."""
    off, on = _pair(rows)
    ratios = [
        a / b for a, b in zip(on.round_items_per_s or [on.items_per_s], off.round_items_per_s or [off.items_per_s])
    ]
    med, lo, hi, n = statistics.median(ratios), min(ratios), max(ratios), len(ratios)
    gain = on.items_per_s / off.items_per_s  # the table's figures: the medians over the rounds
    rng = f"per-round ratios over {n} alternating round{'s' if n > 1 else ''}: {lo:.2f}-{hi:.2f}x, median {med:.2f}x"
    figures = f"({on.items_per_s:,.0f} vs {off.items_per_s:,.0f} items/s; {rng})"
    noise = n > 1 and agreement.ratios_straddle_one(ratios)
    if n < 2 or noise:  # a gap that can't be told from noise is a ratio, never "faster" or "slower"
        gap = f"x{gain:.2f}{', within noise' if noise else ''}"
    else:
        gap = f"{abs(gain - 1):.0%} {'faster' if gain >= 1 else 'slower'}"
    head = f"pin_memory=True vs False: {gap} {figures}"
    if n < 2:
        return f"{head}; one round has no spread, so it can't tell an effect from noise: run more rounds."
    if noise:
        why = "" if on.pin_active else " (as it should be: nothing was pinned, no accelerator)"
        return f"{head}: the rounds disagree on the direction, so the gap is within their spread{why}."
    if on.pin_active:
        way = "faster" if lo > 1 else "slower"
        return f"{head}: {way} in every round, a gap beyond the rounds' spread: the flag's effect."
    faster = on if gain >= 1 else off
    return (
        f"{head}: every round points the same way, a gap beyond the rounds' spread. Yet nothing was pinned "
        f"(no accelerator): both settings did the same work, so the gap is load on this machine, not the flag. "
        f"Trust the faster figure, pin_memory={faster.pin_memory} at {faster.items_per_s:,.0f} items/s "
        f"(load only ever slows a run down), as this loader's speed."
    )


def pin_step_rows(pin_s: float | None, rows: Sequence[pinning.PinRow]) -> PinTimes:
    """The loader's pin step on one batch beside how much longer ``next()`` took with ``pin_memory=True`` in the
    last round of ``rows`` (the main thread pins)."""
    if pin_s is None:
        raise ValueError("pin_s is None: the pin step can only be timed with a CUDA device")
    off, on = _pair(rows)
    extra_ms = on.result.mean_wait_ms - off.result.mean_wait_ms
    return [
        ("the loader's pin step on one batch of your loader (median)", 1e3 * pin_s),
        ("extra time in next() with pin_memory=True (last round of section 4)", extra_ms),
    ]


def pin_rows_from_records(_rs: ResultSet, records: list[Record]) -> PinTimes | None:
    """One row per ``ch03.pin_ms_per_batch`` record."""
    rows = [
        (f"workers={rec.params.get('num_workers')}, pinned in {rec.params.get('thread')}", float(rec.value))
        for rec in records
    ]
    return rows or None


def pin_row_lines(rows: PinTimes) -> list[str]:
    return [f"  {what}: {ms:.3f} ms per batch" for what, ms in rows]


def panel_controls(**context: Any) -> dict[str, Any]:
    """Batch size and ``pin_memory`` (starting at the default of the reader's ``make_loader``)."""
    try:
        pin = inspect.signature(context.get("make_loader")).parameters["pin_memory"].default  # type: ignore[arg-type]
    except (TypeError, ValueError, KeyError):
        pin = False
    return {
        "batch_size": W.IntSlider(value=context.get("batch", 32), min=8, max=128, step=8, description="batch_size"),
        "pin_memory": W.Checkbox(value=pin if isinstance(pin, bool) else False, description="pin_memory"),
    }


def panel_run(
    progress: ProgressFn,
    *,
    device: torch.device | str,
    batch_size: int = 32,
    pin_memory: bool = False,
    make_loader: Callable[..., Any],
    dataset: Any,
    to_device: Callable[..., Any] | None = None,
    batches: int = 30,
    warmup: int = 2,
    threads: int | None = 1,
    **context: Any,
) -> Evidence[loaders.Throughput]:
    """The reader's ``make_loader(dataset, batch_size, pin_memory=...)`` timed with their ``to_device`` (``threads``
    intra-op threads, as in the pin thread); without an accelerator ``pin_memory=True`` pins nothing."""
    bs = check_int("batch_size", batch_size, 1, 100_000)
    if not isinstance(pin_memory, bool):
        raise ValueError(f"pin_memory must be True or False, got {pin_memory!r}")
    kw = {"to_device": to_device, "batches": batches, "warmup": warmup, "threads": threads, "progress": progress}
    label = f"batch_size={bs}, pin_memory={pin_memory}"
    res, _ = pinning.time_readers_loader(make_loader, dataset, bs, pin_memory, label=label, **kw)
    res.config.update(batch_size=bs, pin_memory=pin_memory)
    return evidence.measured(
        f"your make_loader + to_device (batch_size={bs}, pin_memory={pin_memory})",
        res,
        device,
        method=f"{batches} batches after {warmup} warm-up",
    )


def panel_summary(result: Evidence[loaders.Throughput]) -> str:
    res = result.value
    if res is None:
        return result.header()
    text = f"{res.items_per_s:,.0f} items/s; per batch the main thread waited {res.mean_wait_ms:.2f} ms in next()"
    copy_ms = res.extra.get("copy_ms_per_batch")
    text += f" and spent {copy_ms:.2f} ms in to_device." if copy_ms is not None else "."
    if res.config.get("pin_memory"):
        text += (
            " Batches arrived pinned."
            if res.extra.get("pinned_batches")
            else " pin_memory=True, but nothing was pinned (no accelerator: the flag only warns)."
        )
    return f"{text} — {result.header()}"


def panel_plot(history: Sequence[Any], ax: Any) -> None:
    """A bar per run (items/s), latest highlighted."""
    runs = [rec for rec in history if rec.result.value is not None]
    source = runs[-1].result.source.split(";")[0] if runs else "no run yet"
    plots.history_bars(
        [
            f"#{rec.index} b={rec.values.get('batch_size')}{' pin' if rec.values.get('pin_memory') else ''}"
            for rec in runs
        ],
        [rec.result.value.items_per_s for rec in runs],
        ax,
        ylabel="throughput (items/s)",
        title=f"Panel runs so far (your make_loader and to_device)\n{source}",
    )
