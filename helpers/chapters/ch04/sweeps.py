"""Chapter 04's one-pass measurements: the worker sweep, persistent workers, in-order delivery, batched fetching,
cheap against expensive items. An experiment of one knob takes the reader's ``make_loader`` as a function of it
(``lambda w: make_loader(ds, 32, workers=w)``), which decides every other knob."""

from __future__ import annotations

import contextlib
import statistics
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from ...core.rounds import table
from ...core.validate import check_int
from ...pipeline.loaders import Throughput, guard, measure_config, measure_throughput
from ...pipeline.workers import MAX_WORKERS, cpu_cores, open_iterator, released
from .datasets import CheapDataset, PerItem, light_uint8_collate, passthrough_collate


def build_from_factory(
    factory: Callable[[Any], DataLoader], value: Any, *, expect: Mapping[str, Any] | None = None
) -> DataLoader:
    """``factory(value)``, guarded, its build warnings kept; ``expect``: knobs it must have (a factory that ignores
    its value would compare a loader with itself)."""
    if not callable(factory):
        raise ValueError(f"factory must be a function that returns a DataLoader, got {type(factory).__name__}")
    with warnings.catch_warnings(record=True) as wlist:
        warnings.simplefilter("always")
        loader = factory(value)
    if not isinstance(loader, DataLoader):
        raise ValueError(
            f"the loader factory returned {type(loader).__name__} for {value!r}; it must return a "
            f"torch DataLoader (e.g. lambda w: make_loader(dataset, batch_size, workers=w))"
        )
    wrong = {k: getattr(loader, k, None) for k, v in (expect or {}).items() if getattr(loader, k, None) != v}
    if wrong:
        raise ValueError(
            f"the loader factory was asked for {dict(expect or {})} (value {value!r}) but built a loader "
            f"with {wrong}: pass the value on to the DataLoader (e.g. num_workers=workers)"
        )
    guard(loader)
    loader._workbook_warnings += [str(w.message).strip() for w in wlist]  # type: ignore[attr-defined]
    return loader


# -- the worker sweep ---------------------------------------------------------------------------------


@dataclass
class WorkerSweep:
    """Throughput against ``num_workers``, one measurement per point."""

    workers: list[int]
    results: list[Throughput]
    cores: int

    @property
    def items_per_s(self) -> list[float]:
        return [r.items_per_s for r in self.results]

    def at(self, n: int) -> Throughput:
        return self.results[self.workers.index(n)]

    @property
    def baseline(self) -> float:  # the fewest workers measured
        return self.at(min(self.workers)).items_per_s

    def speedup(self, n: int) -> float:
        return self.at(n).items_per_s / self.baseline

    def efficiency(self, n: int) -> float:  # 1.0: linear
        return self.speedup(n) / max(n, 1)

    @property
    def best_workers(self) -> int:
        return self.workers[int(np.argmax(self.items_per_s))]

    def rule_of_thumb(self) -> int:  # "half the cores"
        return max(1, self.cores // 2)

    def notes(self) -> list[str]:
        """Efficiencies over 100%: the workers=0 row ran slow."""
        return [
            f"num_workers={n} measured {100 * self.efficiency(n):.0f}% efficiency (over 100%): the "
            f"single-process row was slow in this one-shot sweep (a busy machine, or more main-process "
            f"threads than one); compare in alternating rounds (knob_rounds)"
            for n in self.workers
            if n > 0 and self.efficiency(n) > 1.0
        ]

    def table(self) -> list[str]:
        rows = []
        for n, r in zip(self.workers, self.results):
            ratios = f"{self.speedup(n):.2f}x", f"{100 * self.efficiency(n):.0f}%"
            rows.append([n, f"{r.items_per_s:,.0f}", *ratios, f"{r.startup_s:.2f}s"])
        return table(["workers", "items/s", "speedup", "efficiency", "startup"], rows, left=0)

    def plot(self, axes: Sequence[Any] | None = None, title: str = "") -> Any:
        import matplotlib.pyplot as plt  # optional/heavy: matplotlib

        if axes is None:
            _, axes = plt.subplots(1, 2, figsize=(11, 3.8))
        ax1, ax2 = axes
        base, xs, rule = self.baseline, self.workers, self.rule_of_thumb()
        ax1.plot(xs, self.items_per_s, "o-", color="#4e79a7", label="measured")
        ax1.plot(
            xs, [base * max(n, 1) for n in xs], ":", color="#59a14f", label="ideal: each worker as fast as workers=0"
        )
        ceiling = f"core-count ceiling ({self.cores} cores x workers=0 rate)"
        ax1.axhline(base * self.cores, color="#444", linestyle="--", linewidth=1, label=ceiling)
        ax1.axvline(rule, color="#e15759", alpha=0.4, linewidth=6, label=f"'half the cores' rule: {rule}")
        ax1.set(xlabel="num_workers", ylabel="throughput (items/s)", xticks=xs, ylim=(0, None))
        ax1.set_title(title or "Loader throughput vs num_workers")
        ax1.legend(fontsize=8, loc="upper left")
        ax1.grid(alpha=0.3)
        eff_x = [n for n in xs if n > 0]
        ax2.bar([str(n) for n in eff_x], [100 * self.efficiency(n) for n in eff_x], color="#f28e2b")
        ax2.axhline(100, color="#59a14f", linestyle=":", label="linear scaling")
        ax2.set(xlabel="num_workers", ylabel="scaling efficiency (%)\n= speedup / num_workers")
        ax2.set_title("Scaling efficiency vs workers=0")
        ax2.legend(fontsize=8)
        ax2.grid(axis="y", alpha=0.3)
        return axes


def sweep_workers(
    factory: Callable[[int], DataLoader],
    workers: Sequence[int],
    *,
    batches: int = 40,
    warmup: int = 4,
    progress: Callable[..., Any] | None = None,
) -> WorkerSweep:
    """Steady-state throughput of ``factory(n)`` for each ``n`` in ``workers``, one measurement each, with one
    intra-op thread here as in every worker (else workers=0 would use every core)."""
    try:
        ws = [check_int(f"workers[{i}]", w, 0, MAX_WORKERS) for i, w in enumerate(workers)]
    except TypeError:
        raise ValueError(f"workers must be a list of integers in [0, {MAX_WORKERS}], got {workers!r}") from None
    if not ws or len(set(ws)) != len(ws):
        raise ValueError(
            f"workers must be a non-empty list of distinct integers in [0, {MAX_WORKERS}], got {list(workers)}"
        )
    results, progress = [], progress or (lambda *a: None)
    for k, n in enumerate(ws):
        progress(k / len(ws), f"num_workers={n} ({k + 1} of {len(ws)})")
        loader = build_from_factory(factory, n, expect={"num_workers": n})
        results.append(measure_throughput(loader, batches=batches, warmup=warmup, threads=1))
    progress(1.0, "done")
    return WorkerSweep(workers=ws, results=results, cores=cpu_cores())


# -- persistent workers and in-order delivery ---------------------------------------------------------


@dataclass
class PersistentResult:
    """Per-epoch wall time and time to the first batch, with and without persistent workers."""

    epoch_s: dict[bool, list[float]]
    first_batch_s: dict[bool, list[float]]
    num_workers: int

    def restart_cost_s(self) -> float:  # the median extra wait for the first batch of epochs 2+
        return self._extra(self.first_batch_s)

    def epoch_cost_s(self) -> float:
        """The median extra epoch time of epochs 2+: starting the workers, stopping them at the epoch's end (inside
        the timed epoch without persistent workers), and whatever a fresh start slows down."""
        return self._extra(self.epoch_s)

    @staticmethod
    def _extra(per_epoch: dict[bool, list[float]]) -> float:
        a, b = per_epoch[False][1:] or per_epoch[False], per_epoch[True][1:] or per_epoch[True]
        return statistics.median(a) - statistics.median(b)

    def summary(self) -> str:
        """Both measures of the restart cost in one sentence; a difference of zero or less is noise."""

        def cost(s: float) -> str:
            ms = 1e3 * s
            return f"about {ms:.0f} ms" if round(ms) > 0 else f"nothing above the noise ({ms:.0f} ms)"

        n = len(self.epoch_s[False])
        which = "from epoch 1" if n < 2 else "from epoch 2" if n == 2 else f"medians of epochs 2-{n}"
        return (
            f"Restarting workers every epoch costs {cost(self.restart_cost_s())} per epoch in the time to the first "
            f"batch (the start-up wait), and {cost(self.epoch_cost_s())} in the epoch time (start-up, stopping the "
            f"workers at the end, and the rest of the epoch); {which}."
        )

    def table(self) -> list[str]:
        rows = [
            [
                f"persistent_workers={p}",
                ", ".join(f"{s:.2f}" for s in self.epoch_s[p]),
                ", ".join(f"{1e3 * s:.0f}" for s in self.first_batch_s[p]),
            ]
            for p in (False, True)
        ]
        return table(["", "epoch times (s)", "first batch (ms)"], rows)


def persistent_experiment(factory: Callable[[bool], DataLoader], *, epochs: int = 3) -> PersistentResult:
    epochs = check_int("epochs", epochs, 1, 100)
    epoch_s: dict[bool, list[float]] = {False: [], True: []}
    first: dict[bool, list[float]] = {False: [], True: []}
    for persistent in (False, True):
        loader = build_from_factory(factory, persistent, expect={"persistent_workers": persistent})
        with released([loader]), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if loader.num_workers < 1:
                raise ValueError(
                    "persistent_experiment: the loader factory must build a loader with workers "
                    "(num_workers >= 1): persistent_workers only matters with worker processes"
                )
            for _ in range(epochs):
                t0, t_first = time.perf_counter(), None
                with open_iterator(loader) if not persistent else contextlib.nullcontext(iter(loader)) as it:
                    for _batch in it:
                        t_first = t_first or time.perf_counter() - t0
                epoch_s[persistent].append(time.perf_counter() - t0)
                first[persistent].append(t_first or 0.0)
    return PersistentResult(epoch_s=epoch_s, first_batch_s=first, num_workers=loader.num_workers)


@dataclass
class InOrderResult:
    """Per-batch waits with ``in_order`` True and False, and the share of batches out of sampler order."""

    results: dict[bool, Throughput]
    out_of_order: dict[bool, float]

    def table(self) -> list[str]:
        rows = []
        for flag in (True, False):
            r, ooo = self.results[flag], f"{100 * self.out_of_order[flag]:.0f}%"
            ms = [1e3 * statistics.median(r.wait_s), r.p95_wait_ms, r.max_wait_ms]
            rows.append([f"in_order={flag}", f"{r.seconds:.2f} s", *(f"{x:.1f} ms" for x in ms), ooo])
        return table(["", "total", "median wait", "p95 wait", "max wait", "batches out of order"], rows)


def in_order_experiment(factory: Callable[[bool], DataLoader]) -> InOrderResult:
    """One epoch of ``factory(True)`` then ``factory(False)``; items carry their index as the label. No worker runs
    before :func:`measure_throughput`, which releases them however it ends."""
    results: dict[bool, Throughput] = {}
    ooo: dict[bool, float] = {}
    for flag in (True, False):
        loader = build_from_factory(factory, flag, expect={"in_order": flag})
        order = sampler_batches(loader)
        if len(order) < 2:
            raise ValueError(
                f"in_order_experiment needs at least 2 batches per epoch; the loader has {len(order)} "
                "(give the data set more items than the batch size)"
            )
        where = {tuple(b): k for k, b in enumerate(order)}
        seen: list[int | None] = []

        def note(batch: Any, seen: list[int | None] = seen, where: dict[tuple, int] = where) -> None:
            seen.append(where.get(tuple(int(i) for i in batch[1])))

        results[flag] = measure_throughput(loader, batches=len(order) - 1, warmup=1, on_batch=note)
        if None in seen:
            raise ValueError(
                "in_order_experiment: the batches' labels must be the items' indices (as UnevenDataset's "
                "are), so that each batch can be found in the sampler's order"
            )
        pos = [s for s in seen if s is not None]
        ooo[flag] = sum(b < a for a, b in zip(pos, pos[1:])) / max(1, len(pos) - 1)
    return InOrderResult(results=results, out_of_order=ooo)


def sampler_batches(loader: DataLoader) -> list[list[int]]:
    """The batches of indices the next ``iter(loader)`` hands out, without changing them: each iterator first draws
    its workers' base seed from ``loader.generator`` (torch's ``_BaseDataLoaderIter``), then the sampler draws the
    permutation; both are replayed here and the generators' states put back."""
    if loader.batch_sampler is None:
        raise ValueError("sampler_batches needs a loader with batch_size set (batches come from a batch sampler)")
    owners = (loader.generator, getattr(loader.sampler, "generator", None))
    gens = list({id(g): g for g in owners if g is not None}.values())
    saved = [g.get_state() for g in gens]
    saved_global = torch.get_rng_state()
    try:
        torch.empty((), dtype=torch.int64).random_(generator=loader.generator)
        return [[int(i) for i in b] for b in loader.batch_sampler]
    finally:
        for g, st in zip(gens, saved):
            g.set_state(st)
        torch.set_rng_state(saved_global)


# -- batched fetching and cheap items -------------------------------------------------------------------

#: The main thread's busy share, with workers, that :func:`main_limit_verdicts` counts as "near 100%": from
#: there on the main process is the limit. A threshold chosen for the verdict, not a measurement.
MAIN_LIMIT_BUSY = 0.9


def _measure_cases(
    cases: Sequence[tuple[Any, str, Dataset, Callable[[Any], Any] | None]], workers: Sequence[int], **run: Any
) -> list[tuple[Any, int, Throughput]]:
    out = []
    for (key, label, ds, fn), w in ((case, w) for case in cases for w in workers):
        res = measure_config(
            ds, num_workers=w, persistent_workers=w > 0, collate_fn=fn, label=f"{label}, workers={w}", **run
        )
        out.append((key, w, res))
    return out


def getitems_experiment(
    dataset: Dataset, *, workers: Sequence[int] = (0, 2), batch_size: int = 64, batches: int = 60, warmup: int = 4
) -> dict[tuple[str, int], Throughput]:
    """Per-item fetching (``__getitem__`` + default_collate, ``__getitems__`` hidden) against one ``__getitems__``
    call per batch that returns a finished batch."""
    if not hasattr(dataset, "__getitems__"):
        raise ValueError(
            f"dataset must be a data set with __getitems__ (e.g. BatchedCheapDataset), got {type(dataset).__name__}"
        )
    cases = [
        ("per-item", "__getitem__", PerItem(dataset), None),
        ("batched", "__getitems__", dataset, passthrough_collate),
    ]
    run = {"batch_size": batch_size, "batches": batches, "warmup": warmup}
    got = [row for w in workers for row in _measure_cases(cases, [w], **run)]  # both ways back to back per count
    return {(key, w): r for key, w, r in got}


def cheap_vs_expensive(
    expensive: Mapping[str, Dataset],
    *,
    n_cheap: int,
    image_size: int,
    workers: Sequence[int] = (0, 2),
    batch_size: int = 32,
    batches: int = 40,
    warmup: int = 4,
) -> list[dict[str, Any]]:
    """Throughput and main-thread load for cheap in-memory items (float, uint8, uint8 + light collate) and for
    ``expensive`` (name -> data set); rows ``{"items", "output", "collate", "num_workers", "result"}``."""
    cases: list[tuple[Any, str, Dataset, Callable[[Any], Any] | None]] = [
        (("cheap", out, coll), f"cheap {out} ({coll} collate)", CheapDataset(n_cheap, image_size, out), fn)
        for out, coll, fn in (
            ("float", "default", None),
            ("uint8", "default", None),
            ("uint8", "light", light_uint8_collate),
        )
    ]
    for name, ds in expensive.items():
        out = getattr(ds, "output", "?")
        cases.append(((name, out, "default"), f"{name} {out} (default collate)", ds, None))
    run = {"batch_size": batch_size, "batches": batches, "warmup": warmup}
    keys = ("items", "output", "collate")
    return [{**dict(zip(keys, k)), "num_workers": w, "result": r} for k, w, r in _measure_cases(cases, workers, **run)]


def main_limit_verdicts(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """One line per kind of item (``items``, ``output``, ``collate``) and worker count, for rows as
    :func:`cheap_vs_expensive` returns them: the workers' items/s against ``num_workers=0``'s, and whether the main
    thread was near 100% busy with workers (at least :data:`MAIN_LIMIT_BUSY`), i.e. the main process is the limit."""
    groups: dict[tuple[str, str, str], dict[int, Throughput]] = {}
    for row in rows:
        key = (str(row["items"]).strip(), str(row["output"]), str(row["collate"]))
        groups.setdefault(key, {})[int(row["num_workers"])] = row["result"]
    out = []
    for (items, output, collate), by_workers in groups.items():
        none = by_workers.get(0)
        if none is None:  # nothing to compare the workers with
            continue
        for w in sorted(n for n in by_workers if n > 0):
            r = by_workers[w]
            ratio, busy = r.items_per_s / none.items_per_s, r.main_busy
            # one run each: a difference within 10% is not called a direction
            pace = "faster" if ratio > 1.1 else "slower" if ratio < 1 / 1.1 else "within 10%: no clear difference"
            if busy >= MAIN_LIMIT_BUSY:
                limit = f"at least {MAIN_LIMIT_BUSY:.0%}, near 100%: the main process is the limit"
            else:
                limit = (
                    f"under {MAIN_LIMIT_BUSY:.0%}: the main process is not the limit (not running {1 - busy:.0%} "
                    f"of the time: waiting for batches, or for a core)"
                )
            out.append(
                f"{items} {output} ({collate} collate): {w} workers give {ratio:.2f}x the items/s of "
                f"num_workers=0 ({pace}); main thread busy {busy:.0%} with workers, {limit}"
            )
    return out
