"""Chapter 04, worker processes: the chapter's live panel and its benchmark.

The chapter interface (:mod:`helpers.ui.chapter`) for ``notebooks/04_worker_processes.ipynb``:

>>> from helpers.chapters import ch04
>>> panel = widgets.Panel.for_chapter(ch04, device=DEVICE, make_loader=make_loader, image_root=INFO.train_dir,
...                                   crop_size=CROP, batch=BATCH, batches=BATCHES, warmup=WARMUP, n_cheap=N_CHEAP)

Each panel run calls the reader's ``make_loader(dataset, batch_size, workers=..., persistent=...,
prefetch_factor=...)`` (the keyword names of chapter 04's pipeline cell) on one of three data sets
(:data:`ITEM_COSTS`: cheap in-memory items, the JPEG baseline, the JPEG baseline + 2 ms of CPU), gives the
loader the workbook's safety (:func:`helpers.chapters.ch04.sweeps.build_from_factory`: ``/dev/shm``, timeout,
leak-proof start), times it and releases its workers, also when the run is interrupted. Everything runs on
the CPU, so every figure is measured here. The loader machinery and the experiments stay in
:mod:`helpers.pipeline.loaders`.
"""

from __future__ import annotations

import functools
import inspect
import os
import statistics
from typing import Any, Callable, Mapping, Sequence

import ipywidgets as W
import torch
from torch.utils.data import DataLoader, Dataset

from ...core import config, evidence
from ...core.device import intraop_threads
from ...core.evidence import Evidence
from ...core.progress import ProgressFn, no_progress
from ...core.results import ResultSet
from ...core.validate import check_choice, check_int
from ...pipeline import loaders
from ...pipeline.data import ShapesDataset, default_sizes, make_shapes_dataset
from ...ui import plots
from . import speedup, sweeps

__all__ = [
    "NUMBER",
    "TITLE",
    "BENCH_WEIGHT",
    "PANEL_TITLE",
    "PANEL_FIGSIZE",
    "ITEM_COSTS",
    "benchmark",
    "agreement_lines",
    "panel_controls",
    "panel_run",
    "panel_summary",
    "panel_plot",
]

NUMBER = "04"
TITLE = "DataLoader worker processes"
BENCH_WEIGHT = 2.25
PANEL_TITLE = "DataLoader workers: your make_loader"
PANEL_FIGSIZE = (8.0, 3.4)

#: The panel's item costs: cheap in-memory items, the JPEG baseline, the baseline + 2 ms of CPU per item.
ITEM_COSTS = ("cheap (in memory)", "baseline (JPEG decode + augment)", "heavy (baseline + 2 ms CPU)")


# ---------------------------------------------------------------------------
# Benchmark
# ---------------------------------------------------------------------------


def benchmark(
    results: ResultSet,
    device: torch.device | str | None = None,
    *,
    progress: ProgressFn | None = None,
    info: Any = None,
    sizes: Mapping[str, int] | None = None,
    batches: int | None = None,
    warmup: int | None = None,
) -> ResultSet:
    """Record chapter 04's key measurements into ``results``, on the shapes data set at the mode's sizes.

    Everything runs on the CPU (``device`` is not used), with one intra-op thread in the main process, as in
    every worker, so that workers=0 is a single-core baseline (the notebook does the same). Keys written:

    * ``ch04.items_per_s`` {num_workers, persistent, output} - the worker sweep
    * ``ch04.speedup`` {num_workers: 2, output, cores, main_threads, method} - steady state, persistent workers vs
      workers=0, median of alternating rounds (:func:`~helpers.chapters.ch04.speedup.interleaved_speedup`);
      spread = lowest/highest round
    * ``ch04.parallel_ceiling`` {processes: 2, output, cores} - 2 independent processes vs workers=0 (the measured
      ceiling), ``ch04.share_of_ceiling`` {num_workers: 2, output, cores} - the loader's share of it
    * ``ch04.best_num_workers`` {cores, method}
    * ``ch04.prefetch.items_per_s`` {prefetch_factor, num_workers} (median of alternating rounds, spread =
      lowest/highest round), ``ch04.prefetch.ratio`` {prefetch_factor, reference, num_workers} (median per-round
      ratio against ``reference``, spread = lowest/highest)
    * ``ch04.persistent.epoch_s`` {persistent, epoch} (short epochs: a subset of 160 / 2,400 images),
      ``ch04.persistent.restart_cost_s`` {num_workers}
    * ``ch04.in_order.p95_wait_ms`` / ``ch04.in_order.total_s`` {in_order}
    * ``ch04.getitems.items_per_s`` {fetch, num_workers}
    * ``ch04.cheap.items_per_s`` / ``ch04.cheap.main_busy`` {items, output, collate, num_workers}

    Args:
        results: the ResultSet to add records to.
        device: the bench's device (unused: workers are a CPU matter).
        progress: optional ``progress(fraction, text)``.
        info / sizes / batches / warmup: overrides (a :class:`helpers.pipeline.data.DatasetInfo`, a
            :func:`helpers.pipeline.data.default_sizes`-like dict, batches per run); for tests.

    Where two records measure one thing (the sweep's 2-worker point and ``ch04.speedup``), a disagreement is
    flagged on ``ch04.speedup``; :func:`agreement_lines` gives the verdict for every such pair.

    Returns ``results``.
    """
    progress = progress or no_progress
    sizes = dict(sizes) if sizes is not None else default_sizes()
    info = info if info is not None else make_shapes_dataset()
    ds_float = ShapesDataset(info.train_dir, crop_size=sizes["crop_size"], output="float")
    ds_uint8 = ShapesDataset(info.train_dir, crop_size=sizes["crop_size"], output="uint8")
    bs = sizes["batch_size"]
    batches = check_int("batches", batches, 1, 100_000) if batches is not None else config.sized(30, 80)
    warm = check_int("warmup", warmup, 0, 100_000) if warmup is not None else config.sized(4, 8)
    progress(0.05, "ch04: worker sweep")
    with intraop_threads(1):
        _sweep_and_speedup(results, ds_float, ds_uint8, bs, batches, warm)
        progress(0.5, "ch04: prefetch_factor, persistent, in_order")
        _knobs(results, ds_float, bs, batches, warm)
        progress(0.75, "ch04: __getitems__ and cheap items")
        _cheap_items(results, ds_float, bs, batches, warm)
    progress(1.0, "done")
    return results


def _flag(notes: Sequence[str]) -> dict[str, Any]:
    """``{"flag": "..."}`` for a record whose figure looks impossible or contradicts another; else ``{}``."""
    return {"flag": "; ".join(notes)} if notes else {}


def _sweep_and_speedup(
    results: ResultSet, ds_float: Dataset, ds_uint8: Dataset, bs: int, batches: int, warm: int
) -> None:
    """The worker sweep, then the 2-worker speed-up in alternating rounds beside the measured ceiling."""
    cores = loaders.cpu_cores()
    ws = sorted(set([0, 1, 2, 3] + ([] if config.sized(True, False) else list(range(0, cores + 3)))))
    sw = sweeps.sweep_workers(ds_float, ws, batch_size=bs, batches=batches, warmup=warm)
    for n, r in zip(sw.workers, sw.results):
        results.add("ch04.items_per_s", r.items_per_s, "items/s", num_workers=n, persistent=n > 0, output="float")
    # The headline speed-up is measured in alternating rounds (drift in the machine's speed cancels),
    # beside the measured ceiling of 2 independent processes.
    for output, ds in (("float", ds_float), ("uint8", ds_uint8)):
        sr = speedup.interleaved_speedup(
            ds,
            2,
            rounds=config.sized(3, 7),
            batches=max(2, min(batches, config.sized(10, 40))),
            batch_size=bs,
            warmup=warm,
        )
        if output == "float":
            # best_num_workers comes from a one-shot sweep: flagged where it contradicts the rounds.
            flags = _flag(sw.notes(sr))
            results.add(
                "ch04.best_num_workers", sw.best_workers, "workers", cores=cores, method="one-shot sweep", **flags
            )
        spread = {"min": sr.spread[0], "max": sr.spread[1], "n": len(sr.ratios)}
        method = "interleaved rounds, median of per-round ratios"
        rec = results.add(
            "ch04.speedup",
            sr.speedup,
            "ratio",
            spread=spread,
            num_workers=2,
            output=output,
            cores=cores,
            main_threads=1,
            method=method,
        )
        if output == "float":
            # the sweep's 2-worker point is a second measurement of the same speed-up: flagged where it disagrees
            for line in speedup.sweep_vs_rounds(sw, sr):
                if "disagree" in line:
                    rec.flag(line)
        results.add(
            "ch04.parallel_ceiling",
            sr.ceiling_speedup,
            "ratio",
            processes=2,
            output=output,
            cores=cores,
            **_flag([n for n in sr.notes() if "ceiling of" in n]),
        )
        results.add(
            "ch04.share_of_ceiling",
            sr.share_of_ceiling,
            "fraction",
            num_workers=2,
            output=output,
            cores=cores,
            **_flag([n for n in sr.notes() if "of the measured ceiling" in n]),
        )
        if output == "uint8":
            for n, rates in ((0, sr.single), (2, sr.workers)):
                results.add(
                    "ch04.items_per_s",
                    statistics.median(rates),
                    "items/s",
                    num_workers=n,
                    persistent=n > 0,
                    output="uint8",
                )


def _knobs(results: ResultSet, ds_float: Dataset, bs: int, batches: int, warm: int) -> None:
    """prefetch_factor, persistent_workers and in_order, each against its own baseline."""
    # alternating rounds: single measurements of 1, 2 and 4 could not tell a difference from the machine's drift
    kr = speedup.knob_rounds(
        functools.partial(_prefetch_loader, ds_float, bs),
        "prefetch_factor",
        PREFETCH_VALUES,
        reference=PREFETCH_REFERENCE,
        rounds=config.sized(5, 7),
        batches=max(2, min(batches, config.sized(8, 40))),
        warmup=warm,
    )
    for v in kr.values:
        rates = kr.rates[v]
        spread = {"min": min(rates), "max": max(rates), "n": len(rates)}
        results.add(
            "ch04.prefetch.items_per_s", kr.median(v), "items/s", spread=spread, prefetch_factor=v, num_workers=2
        )
        if v != kr.reference:
            ratios = kr.ratios(v)
            results.add(
                "ch04.prefetch.ratio",
                statistics.median(ratios),
                "ratio",
                spread={"min": min(ratios), "max": max(ratios), "n": len(ratios)},
                prefetch_factor=v,
                reference=kr.reference,
                num_workers=2,
            )
    n_short = min(len(ds_float), config.sized(160, 2400))  # type: ignore[arg-type]
    short = torch.utils.data.Subset(ds_float, range(n_short))
    pr = sweeps.persistent_experiment(short, num_workers=2, epochs=3, batch_size=bs)
    for p in (False, True):
        for e, s in enumerate(pr.epoch_s[p]):
            results.add("ch04.persistent.epoch_s", s, "s", persistent=p, epoch=e)
    results.add("ch04.persistent.restart_cost_s", pr.restart_cost_s(), "s", num_workers=2)
    io = sweeps.in_order_experiment(loaders.UnevenDataset(config.sized(96, 400) if batches >= 8 else 24), num_workers=2)
    for flag, r in io.results.items():
        results.add("ch04.in_order.p95_wait_ms", r.p95_wait_ms, "ms", in_order=flag)
        results.add("ch04.in_order.total_s", r.seconds, "s", in_order=flag)


#: prefetch_factor values the benchmark compares, in alternating rounds, against the DataLoader's default.
PREFETCH_VALUES = (1, 2, 4)
PREFETCH_REFERENCE = 2


def _prefetch_loader(ds: Dataset, bs: int, prefetch_factor: int) -> DataLoader:
    """The benchmark's 2-worker persistent loader at ``prefetch_factor`` (a module function: picklable)."""
    cfg = loaders.LoaderConfig(batch_size=bs, num_workers=2, persistent_workers=True, prefetch_factor=prefetch_factor)
    return loaders.build_loader(ds, cfg)


def agreement_lines(results: ResultSet) -> list[str]:
    """One verdict line per pair of chapter 04 records that measure the same thing (the chapter's rule: no
    silent contradictions).

    * ``ch04.speedup`` (alternating rounds; spread = lowest/highest round) against the one-pass sweep's
      ``ch04.items_per_s`` at the same ``num_workers`` over ``num_workers=0`` (output "float": the sweep's; one
      measurement each, no spread): "agree within their spread" or "disagree: trust the alternating rounds ...";
    * ``ch04.prefetch.ratio`` (per-round ratios against the reference prefetch_factor): within the noise (the
      rounds' range includes 1.00x) or a real difference.

    The verdict is :func:`helpers.chapters.ch04.speedup.within_spread` on the recorded spreads.
    """
    out = []
    for sp in results.find("ch04.speedup", output="float"):
        n = int(sp.params.get("num_workers") or 0)
        one = results.find("ch04.items_per_s", num_workers=n, output="float")
        zero = results.find("ch04.items_per_s", num_workers=0, output="float")
        if one and zero and zero[0].value > 0 and {"min", "max"} <= set(sp.spread):
            band = [float(sp.spread["min"]), sp.value, float(sp.spread["max"])]
            out.append(speedup.agreement_line(n, one[0].value / zero[0].value, band))
    for pr in results.find("ch04.prefetch.ratio"):
        if {"min", "max"} <= set(pr.spread):
            p = pr.params
            band = [float(pr.spread["min"]), pr.value, float(pr.spread["max"])]
            rounds = int(pr.spread.get("n", 0))
            out.append(
                speedup.difference_line("prefetch_factor", p.get("prefetch_factor"), p.get("reference"), band, rounds)
            )
    return out


def _cheap_items(results: ResultSet, ds_float: Dataset, bs: int, batches: int, warm: int) -> None:
    """``__getitems__`` against per-item fetching, and cheap items (where the main process is the bottleneck)."""
    gi = sweeps.getitems_experiment(config.sized(4096, 32768), batch_size=bs, batches=batches, warmup=warm)
    for (fetch, w), r in gi.items():
        results.add("ch04.getitems.items_per_s", r.items_per_s, "items/s", fetch=fetch, num_workers=w)
    ce = sweeps.cheap_vs_expensive(
        {},
        n_cheap=config.sized(4096, 32768),
        image_size=int(getattr(ds_float, "crop_size", 64)),
        batch_size=bs,
        batches=batches,
        warmup=warm,
    )
    for row in ce:
        r = row["result"]
        knobs = {k: row[k] for k in ("items", "output", "collate", "num_workers")}
        results.add("ch04.cheap.items_per_s", r.items_per_s, "items/s", **knobs)
        results.add("ch04.cheap.main_busy", r.main_busy, "fraction", **knobs)


# ---------------------------------------------------------------------------
# Live panel
# ---------------------------------------------------------------------------


@functools.lru_cache(maxsize=8)
def _panel_dataset(item_cost: str, image_root: str | None, crop_size: int, n_cheap: int) -> Dataset:
    """The data set behind ``item_cost`` (built once per setting: the panel reruns it often)."""
    if item_cost == ITEM_COSTS[0]:
        return loaders.CheapDataset(n_cheap, image_size=crop_size)
    if image_root is None:
        raise ValueError(f"this panel has no image data set (no image_root); choose item_cost={ITEM_COSTS[0]!r}")
    base = ShapesDataset(image_root, crop_size=crop_size)
    return base if item_cost == ITEM_COSTS[1] else loaders.SpinDataset(base, 2.0)


def _default(make_loader: Any, name: str, fallback: Any) -> Any:
    """The default of the reader's ``make_loader`` parameter ``name`` (``fallback`` when it has none)."""
    try:
        default = inspect.signature(make_loader).parameters[name].default
    except (TypeError, ValueError, KeyError):
        return fallback
    return fallback if default is inspect.Parameter.empty else default


def panel_controls(**context: Any) -> dict[str, Any]:
    """Workers, batch size (``batch=``), prefetch factor and persistence (defaults: the reader's ``make_loader``'s),
    and the cost per item."""
    make_loader = context.get("make_loader")
    return {
        "num_workers": W.IntSlider(value=2, min=0, max=loaders.cpu_cores() + 2, description="num_workers"),
        "batch_size": W.IntSlider(value=context.get("batch", 32), min=8, max=256, step=8, description="batch_size"),
        "prefetch_factor": W.IntSlider(
            value=_default(make_loader, "prefetch_factor", 2), min=1, max=8, description="prefetch_factor"
        ),
        "persistent": W.Checkbox(
            value=bool(_default(make_loader, "persistent", True)), description="persistent workers"
        ),
        "item_cost": W.Dropdown(options=list(ITEM_COSTS), value=ITEM_COSTS[1], description="items"),
    }


def panel_run(
    progress: ProgressFn,
    *,
    device: torch.device | str,
    num_workers: int = 0,
    batch_size: int = 32,
    prefetch_factor: int = 2,
    persistent: bool = False,
    item_cost: str = ITEM_COSTS[1],
    make_loader: Callable[..., DataLoader],
    image_root: str | os.PathLike[str] | None = None,
    crop_size: int = 64,
    batches: int = 30,
    warmup: int = 3,
    n_cheap: int = 2048,
    **context: Any,
) -> Evidence[loaders.Throughput]:
    """One run: the reader's ``make_loader(dataset, batch_size, workers=..., persistent=..., prefetch_factor=...)``
    on the ``item_cost`` data set, guarded, timed and released. Measured here (a CPU matter, on any machine).

    Raises:
        ValueError: bad settings (also far more workers than this machine has cores:
            :func:`~helpers.pipeline.loaders.check_workers_for_cores`); a ``make_loader`` that is not a function or
            ignores ``workers``/``batch_size``; image items without ``image_root``.
    """
    if not callable(make_loader):
        raise ValueError(f"make_loader must be your loader function, got {type(make_loader).__name__}")
    check_choice("item_cost", item_cost, ITEM_COSTS)
    if not isinstance(persistent, bool):
        raise ValueError(f"persistent must be True or False, got {persistent!r}")
    knobs = {
        "workers": loaders.check_workers_for_cores(check_int("num_workers", num_workers, 0, loaders.MAX_WORKERS)),
        "persistent": persistent,
        "prefetch_factor": check_int("prefetch_factor", prefetch_factor, 1, 64),
    }
    bs = check_int("batch_size", batch_size, 1, 65536)
    ds = _panel_dataset(
        item_cost,
        None if image_root is None else os.fspath(image_root),
        check_int("crop_size", crop_size, 8, 1024),
        check_int("n_cheap", n_cheap, 1, 10_000_000),
    )
    loader = sweeps.build_from_factory(
        lambda _: make_loader(ds, bs, **knobs),
        knobs["workers"],
        expect={"num_workers": knobs["workers"], "batch_size": bs},
    )
    res = loaders.measure_throughput(
        loader,
        batches=check_int("batches", batches, 1, 100_000),
        warmup=check_int("warmup", warmup, 0, 10_000),
        progress=progress,
    )
    res.label = f"{res.label}, {item_cost.split(' ')[0]}"
    res.extra["item_cost"] = item_cost
    return evidence.measured(
        f"your make_loader, {item_cost.split(' ')[0]} items",
        res,
        "cpu",
        method=f"{res.batches} batches after {res.warmup_batches} warm-up",
    )


def panel_summary(result: Evidence[loaders.Throughput]) -> str:
    """Throughput, start-up, how busy the main thread was; then the provenance."""
    res = result.value
    if res is None:
        return result.header()
    text = (
        f"{res.items_per_s:,.0f} items/s; first batch after {res.startup_s:.2f} s; "
        f"main thread busy {100 * res.main_busy:.0f}% of the window."
    )
    if res.config.get("pin_memory"):
        text += " pin_memory=True: the loader's pin thread pins every batch (included, not timed apart)."
    return f"{text} — {result.header()}"


def panel_plot(history: Sequence[Any], ax: Any) -> None:
    """A bar per run (items/s), latest highlighted; the settings as labels, the source in the title."""
    runs = [rec for rec in history if rec.result.value is not None]
    labels = []
    for rec in runs:
        v = rec.values
        parts = [f"#{rec.index} w={v.get('num_workers')}", f"b={v.get('batch_size')}", f"pf={v.get('prefetch_factor')}"]
        if v.get("persistent"):
            parts.append("P")
        parts.append(str(v.get("item_cost", "")).split(" ")[0])
        labels.append(" ".join(parts))
    source = runs[-1].result.source.split(";")[0] if runs else "no run yet"
    plots.history_bars(
        labels,
        [rec.result.value.items_per_s for rec in runs],
        ax,
        ylabel="throughput (items/s)",
        title=f"Panel runs so far (P = persistent workers)\n{source}",
    )
