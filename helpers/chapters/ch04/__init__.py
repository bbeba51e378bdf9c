"""Chapter 04, worker processes: the live panel (the reader's ``make_loader`` on one of :data:`ITEM_COSTS`' data
sets) and the benchmark. Everything runs on the CPU, so every figure is measured here."""

from __future__ import annotations

import functools
import inspect
import os
from typing import Any, Callable, Mapping, Sequence

import ipywidgets as W
import torch
from torch.utils.data import DataLoader, Dataset

from ...core import config, evidence
from ...core.evidence import Evidence
from ...core.results import ResultSet
from ...core.rounds import intraop_threads
from ...core.validate import check_choice, check_int
from ...pipeline import loaders
from ...pipeline.data import ShapesDataset, default_sizes, make_shapes_dataset
from ...ui import plots
from . import speedup, sweeps
from .datasets import BatchedCheapDataset, CheapDataset, SpinDataset, UnevenDataset

NUMBER = "04"
TITLE = "DataLoader worker processes"
BENCH_WEIGHT = 2.25
PANEL_TITLE = "DataLoader workers: your make_loader"
PANEL_FIGSIZE = (8.0, 3.4)

ITEM_COSTS = ("cheap (in memory)", "baseline (JPEG decode + augment)", "heavy (baseline + 2 ms CPU)")

PREFETCH_VALUES = (1, 2, 4)
PREFETCH_REFERENCE = 2


# -- benchmark ---------------------------------------------------------------------------------------


def benchmark(
    results: ResultSet,
    device: torch.device | str | None = None,
    *,
    progress: Callable[..., Any] | None = None,
    info: Any = None,
    sizes: Mapping[str, int] | None = None,
    batches: int | None = None,
    warmup: int | None = None,
) -> ResultSet:
    """Chapter 04's figures on the shapes data set at the mode's sizes, on the CPU (``device`` unused), with one
    intra-op thread here as in every worker. ``info``, ``sizes``, ``batches``, ``warmup``: the tests' smaller runs."""
    progress = progress or (lambda *a, **k: None)
    sizes = dict(sizes) if sizes is not None else default_sizes()
    info = info if info is not None else make_shapes_dataset()
    ds = {out: ShapesDataset(info.train_dir, crop_size=sizes["crop_size"], output=out) for out in ("float", "uint8")}
    run = {
        "bs": sizes["batch_size"],
        "batches": check_int("batches", batches, 1, 100_000) if batches is not None else config.sized(30, 80),
        "warm": check_int("warmup", warmup, 0, 100_000) if warmup is not None else config.sized(4, 8),
    }
    steps = (
        (0.05, "worker sweep", _sweep_and_speedup),
        (0.5, "prefetch_factor, persistent, in_order", _knobs),
        (0.75, "__getitems__ and cheap items", _cheap_items),
    )
    with intraop_threads(1):
        for at, what, step in steps:
            progress(at, f"ch04: {what}")
            step(results, ds, **run)
    progress(1.0, "done")
    return results


def _flag(notes: Sequence[str], part: str = "") -> dict[str, Any]:
    notes = [n for n in notes if part in n]
    return {"flag": "; ".join(notes)} if notes else {}


def _spread(values: Sequence[float]) -> dict[str, Any]:
    return {"min": min(values), "max": max(values), "n": len(values)}


def _factory(ds: Dataset, bs: int, knob: str = "num_workers", **fixed: Any) -> Callable[[Any], DataLoader]:
    """Loaders as a function of ``knob``: 2 workers and persistent unless the knob says otherwise."""

    def build(value: Any) -> DataLoader:
        knobs = {"num_workers": 2, **fixed, knob: value}
        knobs.setdefault("persistent_workers", knobs["num_workers"] > 0)
        return loaders.build_loader(ds, batch_size=bs, **knobs)

    return build


def _sweep_and_speedup(results: ResultSet, ds: Mapping[str, Dataset], bs: int, batches: int, warm: int) -> None:
    cores = loaders.cpu_cores()
    ws = sorted(set([0, 1, 2, 3] + ([] if config.sized(True, False) else list(range(0, cores + 3)))))
    sw = sweeps.sweep_workers(_factory(ds["float"], bs), ws, batches=batches, warmup=warm)
    how: dict[str, Any] = {"output": "float", "method": "one-shot sweep"}
    for n, r in zip(sw.workers, sw.results):
        results.add("ch04.items_per_s", r.items_per_s, "items/s", num_workers=n, persistent=n > 0, **how)
    best = {"cores": cores, "method": "one-shot sweep", **_flag(sw.notes())}
    results.add("ch04.best_num_workers", sw.best_workers, "workers", **best)
    n_batches, rounds = max(2, min(batches, config.sized(10, 40))), config.sized(3, 7)
    for output in ("float", "uint8"):
        sr = speedup.knob_rounds(
            _factory(ds[output], bs), "num_workers", [0, 2], rounds=rounds, batches=n_batches, warmup=warm
        )
        at: dict[str, Any] = {"output": output, "cores": cores}
        method = "interleaved rounds, median of per-round ratios"
        params = {"num_workers": 2, **at, "main_threads": 1, "method": method}
        rec = results.add("ch04.speedup", sr.speedup, "ratio", spread=_spread(sr.ratios()), **params)
        for line in speedup.sweep_vs_rounds(sw, sr) if output == "float" else []:  # one measurement of the same
            if "disagree" in line:
                rec.flag(line)
        notes = sr.notes()
        results.add(
            "ch04.parallel_ceiling", sr.ceiling_speedup, "ratio", processes=2, **at, **_flag(notes, "ceiling of")
        )
        share = _flag(notes, "of the measured ceiling")
        results.add("ch04.share_of_ceiling", sr.share_of_ceiling, "fraction", num_workers=2, **at, **share)
        how = {"output": output, "method": "interleaved rounds, median of rounds"}
        for n in sr.rates if output == "uint8" else ():
            results.add("ch04.items_per_s", sr.median(n), "items/s", num_workers=n, persistent=n > 0, **how)


def _knobs(results: ResultSet, ds: Mapping[str, Dataset], bs: int, batches: int, warm: int) -> None:
    """prefetch_factor in alternating rounds (one measurement each can't tell it from drift), persistent_workers
    and in_order."""
    kr = speedup.knob_rounds(
        _factory(ds["float"], bs, "prefetch_factor"),
        "prefetch_factor",
        PREFETCH_VALUES,
        reference=PREFETCH_REFERENCE,
        rounds=config.sized(5, 7),
        batches=max(2, min(batches, config.sized(8, 40))),
        warmup=warm,
    )
    for v in kr.labels:
        at = {"prefetch_factor": v, "num_workers": 2}
        results.add("ch04.prefetch.items_per_s", kr.median(v), "items/s", spread=_spread(kr.rates[v]), **at)
        if v != kr.reference:
            spread = _spread(kr.ratios(v))
            results.add(
                "ch04.prefetch.ratio", kr.ratio(v, kr.reference), "ratio", spread=spread, reference=kr.reference, **at
            )
    short = torch.utils.data.Subset(ds["float"], range(min(len(ds["float"]), config.sized(160, 2400))))  # type: ignore[arg-type]
    pr = sweeps.persistent_experiment(_factory(short, bs, "persistent_workers"), epochs=3)
    for p in (False, True):
        for e, s in enumerate(pr.epoch_s[p]):
            results.add("ch04.persistent.epoch_s", s, "s", persistent=p, epoch=e)
    results.add("ch04.persistent.restart_cost_s", pr.restart_cost_s(), "s", num_workers=2)
    uneven = UnevenDataset(config.sized(96, 400) if batches >= 8 else 24)
    io = sweeps.in_order_experiment(_factory(uneven, 4, "in_order", shuffle=False, persistent_workers=False))
    for flag, r in io.results.items():
        results.add("ch04.in_order.p95_wait_ms", r.p95_wait_ms, "ms", in_order=flag)
        results.add("ch04.in_order.total_s", r.seconds, "s", in_order=flag)


def _cheap_items(results: ResultSet, ds: Mapping[str, Dataset], bs: int, batches: int, warm: int) -> None:
    run: dict[str, Any] = {"batch_size": bs, "batches": batches, "warmup": warm}
    n = config.sized(4096, 32768)
    for (fetch, w), r in sweeps.getitems_experiment(BatchedCheapDataset(n, 32, "uint8"), **run).items():
        results.add("ch04.getitems.items_per_s", r.items_per_s, "items/s", fetch=fetch, num_workers=w)
    size = int(getattr(ds["float"], "crop_size", 64))
    for row in sweeps.cheap_vs_expensive({}, n_cheap=n, image_size=size, **run):
        r = row["result"]
        knobs = {k: row[k] for k in ("items", "output", "collate", "num_workers")}
        results.add("ch04.cheap.items_per_s", r.items_per_s, "items/s", **knobs)
        results.add("ch04.cheap.main_busy", r.main_busy, "fraction", **knobs)


# -- live panel --------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=8)
def _panel_dataset(item_cost: str, image_root: str | None, crop_size: int, n_cheap: int) -> Dataset:
    if item_cost == ITEM_COSTS[0]:
        return CheapDataset(n_cheap, image_size=crop_size)
    if image_root is None:
        raise ValueError(f"this panel has no image data set (no image_root); choose item_cost={ITEM_COSTS[0]!r}")
    base = ShapesDataset(image_root, crop_size=crop_size)
    return base if item_cost == ITEM_COSTS[1] else SpinDataset(base, 2.0)


def _default(make_loader: Any, name: str, fallback: Any) -> Any:
    try:
        default = inspect.signature(make_loader).parameters[name].default
    except (TypeError, ValueError, KeyError):
        return fallback
    return fallback if default is inspect.Parameter.empty else default


def panel_controls(**context: Any) -> dict[str, Any]:
    """Defaults: the reader's ``make_loader``'s, and ``batch=``."""
    make_loader = context.get("make_loader")
    prefetch, persistent = _default(make_loader, "prefetch_factor", 2), _default(make_loader, "persistent", True)
    return {
        "num_workers": W.IntSlider(value=2, min=0, max=loaders.cpu_cores() + 2, description="num_workers"),
        "batch_size": W.IntSlider(value=context.get("batch", 32), min=8, max=256, step=8, description="batch_size"),
        "prefetch_factor": W.IntSlider(value=prefetch, min=1, max=8, description="prefetch_factor"),
        "persistent": W.Checkbox(value=bool(persistent), description="persistent workers"),
        "item_cost": W.Dropdown(options=list(ITEM_COSTS), value=ITEM_COSTS[1], description="items"),
    }


def panel_run(
    progress: Callable[..., Any],
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
    """One run of the reader's ``make_loader(dataset, batch_size, workers=..., persistent=..., prefetch_factor=...)``
    on the ``item_cost`` data set. ValueError: bad settings, far more workers than cores, a ``make_loader`` that
    ignores ``workers``/``batch_size``, image items without ``image_root``."""
    if not callable(make_loader):
        raise ValueError(f"make_loader must be your loader function, got {type(make_loader).__name__}")
    check_choice("item_cost", item_cost, ITEM_COSTS)
    if not isinstance(persistent, bool):
        raise ValueError(f"persistent must be True or False, got {persistent!r}")
    workers = loaders.check_workers_for_cores(check_int("num_workers", num_workers, 0, loaders.MAX_WORKERS))
    knobs = {
        "workers": workers,
        "persistent": persistent,
        "prefetch_factor": check_int("prefetch_factor", prefetch_factor, 1, 64),
    }
    bs = check_int("batch_size", batch_size, 1, 65536)
    root = None if image_root is None else os.fspath(image_root)
    ds = _panel_dataset(
        item_cost, root, check_int("crop_size", crop_size, 8, 1024), check_int("n_cheap", n_cheap, 1, 10**7)
    )
    expect = {"num_workers": workers, "batch_size": bs}
    loader = sweeps.build_from_factory(lambda _: make_loader(ds, bs, **knobs), workers, expect=expect)
    batches, warmup = check_int("batches", batches, 1, 100_000), check_int("warmup", warmup, 0, 10_000)
    res = loaders.measure_throughput(loader, batches=batches, warmup=warmup, progress=progress)
    items = item_cost.split(" ")[0]
    res.label = f"{res.label}, {items}"
    res.extra["item_cost"] = item_cost
    method = f"{res.batches} batches after {res.warmup_batches} warm-up"
    return evidence.measured(f"your make_loader, {items} items", res, "cpu", method=method)


def panel_summary(result: Evidence[loaders.Throughput]) -> str:
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
    runs = [rec for rec in history if rec.result.value is not None]
    labels = [
        f"#{r.index} w={v.get('num_workers')} b={v.get('batch_size')} pf={v.get('prefetch_factor')}"
        f"{' P' if v.get('persistent') else ''} {str(v.get('item_cost', '')).split(' ')[0]}"
        for r in runs
        for v in [r.values]
    ]
    source = runs[-1].result.source.split(";")[0] if runs else "no run yet"
    plots.history_bars(
        labels,
        [rec.result.value.items_per_s for rec in runs],
        ax,
        ylabel="throughput (items/s)",
        title=f"Panel runs so far (P = persistent workers)\n{source}",
    )
