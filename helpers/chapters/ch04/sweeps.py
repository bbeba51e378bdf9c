"""Chapter 04's measurements of the reader's own loaders: the worker sweep, one knob at a time, persistent
workers, in-order delivery, batched fetching, cheap against expensive items.

Each takes a loader factory (the reader's ``make_loader``) or builds loaders from the shared plumbing in
:mod:`helpers.pipeline.loaders`; the demo data sets and collate functions stay there (workers import them by name).
"""

from __future__ import annotations

import contextlib
import math
import statistics
import time
import warnings
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from ...core.device import intraop_threads
from ...core.validate import check_int

if TYPE_CHECKING:
    from typing_extensions import TypeIs  # for mypy only: typing.TypeIs is Python 3.13+
from ...pipeline.loaders import (
    MAX_WORKERS,
    BatchedCheapDataset,
    CheapDataset,
    LoaderConfig,
    Throughput,
    UnevenDataset,
    _check_bool,
    _config_of,
    _finish,
    _loader_params,
    _pct,
    _PerItem,
    _worker_children,
    build_loader,
    cpu_cores,
    guard,
    light_uint8_collate,
    measure_config,
    measure_throughput,
    open_iterator,
    passthrough_collate,
    release,
)

__all__ = [
    "WorkerSweep",
    "sweep_workers",
    "plot_sweep",
    "SpeedupRounds",
    "KnobResult",
    "knob_experiment",
    "PersistentResult",
    "persistent_experiment",
    "InOrderResult",
    "in_order_experiment",
    "build_from_factory",
    "sampler_batches",
    "getitems_experiment",
    "cheap_vs_expensive",
]


@dataclass
class WorkerSweep:
    """Throughput against ``num_workers`` (one :class:`Throughput` per point)."""

    workers: list[int]
    results: list[Throughput]
    cores: int

    @property
    def items_per_s(self) -> list[float]:
        return [r.items_per_s for r in self.results]

    def at(self, n: int) -> Throughput:
        return self.results[self.workers.index(n)]

    @property
    def baseline(self) -> float:
        """Throughput of the single-process loader (``num_workers=0``), or of the fewest workers measured."""
        return self.results[self.workers.index(min(self.workers))].items_per_s

    def speedup(self, n: int) -> float:
        return self.at(n).items_per_s / self.baseline

    def efficiency(self, n: int) -> float:
        """Speedup divided by the ideal speedup ``max(n, 1)`` (1.0 = perfectly linear)."""
        return self.speedup(n) / max(n, 1)

    @property
    def best_workers(self) -> int:
        """The worker count with the highest measured throughput (one measurement each: see :meth:`notes`)."""
        return self.workers[int(np.argmax(self.items_per_s))]

    def notes(self, rounds: "SpeedupRounds | None" = None) -> list[str]:
        """Flags for figures a reader should not take at face value (empty: nothing to flag).

        * an efficiency above 100% (``n`` workers more than ``n`` times the single process: the
          workers=0 row ran slower than a core can, e.g. on a busy machine);
        * ``rounds`` (the speed-up measured in alternating rounds) contradicting ``best_workers``
          from this one-shot sweep.
        """
        out = []
        for n in self.workers:
            if n > 0 and self.efficiency(n) > 1.0:
                out.append(
                    f"num_workers={n} measured {100 * self.efficiency(n):.0f}% efficiency (over 100%): the "
                    f"single-process row was slow in this one-shot sweep (a busy machine, or more main-process "
                    f"threads than one); compare in alternating rounds (interleaved_speedup)"
                )
        if rounds is not None and rounds.ratios and rounds.num_workers in self.workers:
            lo, _hi = rounds.spread
            if self.best_workers == 0 and lo > 1.0:
                out.append(
                    f"contradiction: the one-shot sweep found num_workers=0 best, but every alternating round "
                    f"gave {rounds.num_workers} workers more ({rounds.speedup:.2f}x median): trust the rounds"
                )
            elif self.best_workers == rounds.num_workers and _hi < 1.0:
                out.append(
                    f"contradiction: the one-shot sweep found num_workers={rounds.num_workers} best, but every "
                    f"alternating round gave it less than the single process: trust the rounds"
                )
        return out

    def rule_of_thumb(self) -> int:
        """The "half the cores" rule for this machine."""
        return max(1, self.cores // 2)

    def table(self) -> list[str]:
        lines = [f"{'workers':>7} {'items/s':>9} {'speedup':>8} {'efficiency':>10} {'startup':>8}"]
        for n, r in zip(self.workers, self.results):
            lines.append(
                f"{n:>7} {r.items_per_s:>9,.0f} {self.speedup(n):>7.2f}x {100 * self.efficiency(n):>9.0f}% "
                f"{r.startup_s:>7.2f}s"
            )
        return lines


def sweep_workers(
    dataset: "Dataset | Callable[[int], DataLoader]",
    workers: Sequence[int],
    *,
    batch_size: int = 32,
    batches: int = 40,
    warmup: int = 4,
    persistent: bool = True,
    prefetch_factor: int | None = None,
    collate_fn: Callable[[Any], Any] | None = None,
    progress: Callable[..., Any] | None = None,
    main_threads: int = 1,
) -> WorkerSweep:
    """Measure steady-state throughput for each ``num_workers`` (persistent workers, so epoch ends don't restart them).

    ``dataset`` is either your loader factory - a function of the worker count that returns your
    DataLoader, e.g. ``lambda w: make_loader(ds, 32, workers=w)`` - or a data set (then the loaders are
    built here from ``batch_size``, ``persistent``, ``prefetch_factor`` and ``collate_fn``, which a factory
    ignores: it decides them itself). A factory's loaders get the workbook's safety (:func:`guard`) and
    are released after each point, also on an interrupt.

    The main process runs with ``main_threads`` intra-op threads during the sweep (default 1, as in every
    worker), set here where the measurement is made: otherwise the workers=0 row would use all cores and
    a 1-worker row could show more than 100% "efficiency".
    """
    try:
        ws = [check_int(f"workers[{i}]", w, 0, MAX_WORKERS) for i, w in enumerate(workers)]
    except TypeError:
        raise ValueError(f"workers must be a list of integers in [0, {MAX_WORKERS}], got {workers!r}") from None
    if not ws or len(set(ws)) != len(ws):
        raise ValueError(
            f"workers must be a non-empty list of distinct integers in [0, {MAX_WORKERS}], got {list(workers)}"
        )
    _check_bool("persistent", persistent)
    results = []
    with intraop_threads(check_int("main_threads", main_threads, 1, 1024)):
        for k, n in enumerate(ws):
            if _is_factory(dataset):
                if progress is not None:
                    progress(k / len(ws), f"num_workers={n} ({k + 1} of {len(ws)})")
                results.append(
                    measure_throughput(
                        build_from_factory(dataset, n, expect={"num_workers": n}), batches=batches, warmup=warmup
                    )
                )
                continue
            cfg = LoaderConfig(
                batch_size=batch_size,
                num_workers=n,
                persistent_workers=persistent and n > 0,
                prefetch_factor=prefetch_factor if n > 0 else None,
            )
            if progress is not None:
                progress(k / len(ws), f"num_workers={n} ({k + 1} of {len(ws)})")
            results.append(measure_config(dataset, cfg, batches=batches, warmup=warmup, collate_fn=collate_fn))
        if progress is not None:
            progress(1.0, "done")
    return WorkerSweep(workers=ws, results=results, cores=cpu_cores())


def plot_sweep(sw: WorkerSweep, axes: Sequence[Any] | None = None, title: str = "") -> Any:
    """Two panels: throughput with the ideal linear line and the core-count ceiling; scaling efficiency."""
    import matplotlib.pyplot as plt

    if axes is None:
        fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    ax1, ax2 = axes
    base = sw.baseline
    xs = sw.workers
    ax1.plot(xs, sw.items_per_s, "o-", color="#4e79a7", label="measured")
    ax1.plot(xs, [base * max(n, 1) for n in xs], ":", color="#59a14f", label="ideal: each worker as fast as workers=0")
    ax1.axhline(
        base * sw.cores,
        color="#444",
        linestyle="--",
        linewidth=1,
        label=f"core-count ceiling ({sw.cores} cores x workers=0 rate)",
    )
    ax1.axvline(
        sw.rule_of_thumb(),
        color="#e15759",
        alpha=0.4,
        linewidth=6,
        label=f"'half the cores' rule: {sw.rule_of_thumb()}",
    )
    ax1.set_xlabel("num_workers")
    ax1.set_ylabel("throughput (items/s)")
    ax1.set_xticks(xs)
    ax1.set_ylim(bottom=0)
    ax1.set_title(title or "Loader throughput vs num_workers")
    ax1.legend(fontsize=8, loc="upper left")
    ax1.grid(alpha=0.3)
    eff_x = [n for n in xs if n > 0]
    ax2.bar([str(n) for n in eff_x], [100 * sw.efficiency(n) for n in eff_x], color="#f28e2b")
    ax2.axhline(100, color="#59a14f", linestyle=":", label="linear scaling")
    ax2.set_xlabel("num_workers")
    ax2.set_ylabel("scaling efficiency (%)\n= speedup / num_workers")
    ax2.set_title("Scaling efficiency vs workers=0")
    ax2.legend(fontsize=8)
    ax2.grid(axis="y", alpha=0.3)
    return axes


@dataclass
class SpeedupRounds:
    """Single process vs ``num_workers`` workers (and the measured ceiling), measured in alternating rounds.

    Attributes:
        num_workers: workers in the compared loader (persistent).
        batch_size: items per batch.
        single: items/s of ``num_workers=0`` in each round.
        workers: items/s of the worker loader in each round.
        ceiling: items/s of :func:`parallel_ceiling` (``num_workers`` processes) in each round; empty if not measured.
        cores: CPU cores this process may use.
        seconds: wall time of the whole measurement.
    """

    num_workers: int
    batch_size: int
    single: list[float]
    workers: list[float]
    ceiling: list[float]
    cores: int
    seconds: float

    @property
    def ratios(self) -> list[float]:
        """Per-round speed-up: workers / single, from measurements taken seconds apart."""
        return [w / s for w, s in zip(self.workers, self.single)]

    @property
    def speedup(self) -> float:
        """Median of the per-round speed-ups."""
        return statistics.median(self.ratios)

    @property
    def spread(self) -> tuple[float, float]:
        """(lowest, highest) per-round speed-up."""
        return min(self.ratios), max(self.ratios)

    @property
    def ceiling_speedup(self) -> float:
        """Median per-round ceiling / single: what ``num_workers`` cores give at best here (nan if not measured)."""
        if not self.ceiling:
            return float("nan")
        return statistics.median(c / s for c, s in zip(self.ceiling, self.single))

    @property
    def share_of_ceiling(self) -> float:
        """Median per-round workers / ceiling: how much of the machine's parallel capacity the loader gets."""
        if not self.ceiling:
            return float("nan")
        return statistics.median(w / c for w, c in zip(self.workers, self.ceiling))

    def notes(self) -> list[str]:
        """Flags for impossible-looking figures (empty: nothing to flag).

        The ceiling is a measurement too, taken next to the loader's: when the loader beats it
        (a share above 100%), the ceiling run was disturbed and is not an upper bound in this run.
        """
        out = []
        if self.ceiling and self.share_of_ceiling > 1.0:
            out.append(
                f"the loader measured {self.share_of_ceiling:.0%} of the measured ceiling (over 100%): the "
                f"ceiling runs were slowed by something else on this machine, so here they are no upper bound "
                f"(noise); re-run on a quieter machine"
            )
        if self.ceiling and self.ceiling_speedup > self.num_workers * 1.05:
            out.append(
                f"the ceiling of {self.num_workers} processes measured {self.ceiling_speedup:.2f}x one process "
                f"(more than {self.num_workers}x): the single-process rounds ran slow (noise)"
            )
        return out

    def table(self) -> list[str]:
        head = f"{'round':>5} {'workers=0':>10} {f'workers={self.num_workers}':>10} {'speed-up':>8}"
        if self.ceiling:
            head += f" {f'{self.num_workers} procs':>10} {'ceiling':>8} {'share':>6}"
        lines = [head + "   (items/s)"]
        for k, (s, w) in enumerate(zip(self.single, self.workers)):
            line = f"{k + 1:>5} {s:>10,.0f} {w:>10,.0f} {w / s:>7.2f}x"
            if self.ceiling:
                c = self.ceiling[k]
                line += f" {c:>10,.0f} {c / s:>7.2f}x {w / c:>6.0%}"
            lines.append(line)
        return lines

    def summary(self) -> str:
        lo, hi = self.spread
        text = (
            f"{self.num_workers} persistent workers: {self.speedup:.2f}x the single-process throughput (median of "
            f"{len(self.ratios)} rounds, range {lo:.2f}-{hi:.2f}x)."
        )
        if self.ceiling:
            text += (
                f" {self.num_workers} independent processes loading and collating the same batches reach "
                f"{self.ceiling_speedup:.2f}x: the measured ceiling. "
                f"The loader gets {self.share_of_ceiling:.0%} of it."
            )
        for note in self.notes():
            text += f" Note: {note}."
        return text

    def to_dict(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "speedup": self.speedup,
            "ceiling_speedup": self.ceiling_speedup,
            "share_of_ceiling": self.share_of_ceiling,
            "notes": self.notes(),
        }


@dataclass
class KnobResult:
    """One knob changed against a fixed baseline."""

    knob: str
    values: list[Any]
    results: list[Throughput]
    base: LoaderConfig

    def rows(self) -> list[tuple[Any, Throughput]]:
        return list(zip(self.values, self.results))

    def table(self) -> list[str]:
        out = [f"baseline: {_label_without(self.base, self.knob)}; changing {self.knob}"]
        for v, r in self.rows():
            out.append(
                f"  {self.knob}={v!s:<6} {r.items_per_s:>9,.0f} items/s  mean wait {r.mean_wait_ms:6.2f} ms  "
                f"p95 wait {r.p95_wait_ms:6.2f} ms"
            )
        return out


def knob_experiment(
    dataset: "Dataset | Callable[[Any], DataLoader]",
    knob: str,
    values: Sequence[Any],
    *,
    base: LoaderConfig | None = None,
    batches: int = 40,
    warmup: int = 4,
    collate_fn: Callable[[Any], Any] | None = None,
    progress: Callable[..., Any] | None = None,
) -> KnobResult:
    """Measure ``base`` with ``knob`` set to each of ``values`` (everything else unchanged).

    ``dataset`` is either your loader factory - a function of the knob's value that returns your
    DataLoader, e.g. ``lambda pf: make_loader(ds, 32, workers=2, prefetch_factor=pf)``; ``base`` is then
    not needed (it is read from the first loader) - or a data set, measured with ``base`` changed in
    ``knob``. A factory must really change the knob: a loader whose ``knob`` differs from the value asked
    for is refused (ValueError).
    """
    if _is_factory(dataset):
        return _knob_factory(dataset, knob, values, batches=batches, warmup=warmup, progress=progress)
    if base is None:
        raise ValueError("base: give the baseline LoaderConfig when measuring a data set (or pass a loader factory)")
    if knob not in asdict(base):
        raise ValueError(f"knob must be one of {sorted(asdict(base))}, got {knob!r}")
    if not values:
        raise ValueError("values must hold at least one setting")
    results = []
    for k, v in enumerate(values):
        cfg = base.replace(**{knob: v})
        results.append(measure_config(dataset, cfg, batches=batches, warmup=warmup, collate_fn=collate_fn))
        if progress is not None:
            progress((k + 1) / len(values), f"{knob}={v}")
    return KnobResult(knob=knob, values=list(values), results=results, base=base)


@dataclass
class PersistentResult:
    """Per-epoch wall time and time-to-first-batch, with and without persistent workers."""

    epoch_s: dict[bool, list[float]]
    first_batch_s: dict[bool, list[float]]
    num_workers: int

    def restart_cost_s(self) -> float:
        """Median extra time to the first batch of epochs 2+ when workers are restarted."""
        a = self.first_batch_s[False][1:] or self.first_batch_s[False]
        b = self.first_batch_s[True][1:] or self.first_batch_s[True]
        return statistics.median(a) - statistics.median(b)

    def table(self) -> list[str]:
        out = []
        for p in (False, True):
            ep = ", ".join(f"{s:.2f}" for s in self.epoch_s[p])
            fb = ", ".join(f"{1e3 * s:.0f}" for s in self.first_batch_s[p])
            out.append(f"persistent_workers={p!s:<5}  epoch times (s): {ep}   first batch (ms): {fb}")
        return out


def persistent_experiment(
    dataset: "Dataset | Callable[[bool], DataLoader]",
    *,
    num_workers: int = 2,
    epochs: int = 3,
    batch_size: int = 32,
    multiprocessing_context: str | None = None,
) -> PersistentResult:
    """Run ``epochs`` full epochs with ``persistent_workers`` off, then on, and time each epoch.

    ``dataset`` is either your loader factory - a function of ``persistent`` (False, then True) that
    returns your DataLoader with workers, e.g. ``lambda p: make_loader(ds, 32, workers=2, persistent=p)``;
    ``num_workers``, ``batch_size`` and ``multiprocessing_context`` are then the factory's - or a data set.
    """
    epochs = check_int("epochs", epochs, 1, 100)
    epoch_s: dict[bool, list[float]] = {}
    first: dict[bool, list[float]] = {}
    for persistent in (False, True):
        if _is_factory(dataset):
            loader = build_from_factory(dataset, persistent, expect={"persistent_workers": persistent})
            num_workers = loader.num_workers
            if num_workers < 1:
                release(loader)
                raise ValueError(
                    "persistent_experiment: the loader factory must build a loader with workers "
                    "(num_workers >= 1): persistent_workers only matters with worker processes"
                )
        else:
            cfg = LoaderConfig(
                batch_size=batch_size,
                num_workers=check_int("num_workers", num_workers, 1, MAX_WORKERS),
                persistent_workers=persistent,
                multiprocessing_context=multiprocessing_context,
            )
            loader = build_loader(dataset, cfg)
        epoch_s[persistent], first[persistent] = [], []
        before = _worker_children()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                for _ in range(epochs):
                    t0 = time.perf_counter()
                    t_first = None
                    with open_iterator(loader) if not persistent else contextlib.nullcontext(iter(loader)) as it:
                        for _batch in it:
                            if t_first is None:
                                t_first = time.perf_counter() - t0
                    epoch_s[persistent].append(time.perf_counter() - t0)
                    first[persistent].append(t_first or 0.0)
        finally:
            _finish([loader], before)
    return PersistentResult(epoch_s=epoch_s, first_batch_s=first, num_workers=num_workers)


@dataclass
class InOrderResult:
    """Per-batch waits with ``in_order`` True and False on a data set with uneven items."""

    results: dict[bool, Throughput]
    out_of_order: dict[bool, float]

    def table(self) -> list[str]:
        out = []
        for flag in (True, False):
            r = self.results[flag]
            out.append(
                f"in_order={flag!s:<5}  total {r.seconds:.2f} s  wait: median {1e3 * _pct(r.wait_s, 0.5):5.1f} ms, "
                f"p95 {r.p95_wait_ms:5.1f} ms, max {r.max_wait_ms:6.1f} ms  "
                f"batches out of order {100 * self.out_of_order[flag]:3.0f}%"
            )
        return out


def in_order_experiment(
    dataset: "UnevenDataset | Callable[[bool], DataLoader]",
    *,
    num_workers: int = 2,
    batch_size: int = 4,
    prefetch_factor: int | None = None,
) -> InOrderResult:
    """One epoch (no shuffling) with ``in_order=True`` then ``False``; per-batch waits and how many
    arrived out of order.

    ``prefetch_factor`` defaults to the DataLoader's (2 with workers); with ``num_workers=0`` both runs are
    the same single-process loader (the flag only matters with workers).

    ``dataset`` may instead be your loader factory, a function of ``in_order`` (True, then False) that
    returns your DataLoader, e.g. ``lambda flag: make_loader(uneven, 4, workers=2, in_order=flag)``; its
    items must carry their index as the label (as :class:`UnevenDataset`'s do). Then each run is one epoch
    of your loader, shuffled or not as it is built, and "out of order" is measured against the order its
    sampler hands out the batches in that epoch (see :func:`sampler_batches`).
    """
    if _is_factory(dataset):
        return _in_order_factory(dataset)
    num_workers = check_int("num_workers", num_workers, 0, MAX_WORKERS)
    batch_size = check_int("batch_size", batch_size, 1, 65536)
    n_batches = math.ceil(len(dataset) / batch_size)
    if n_batches < 2:
        raise ValueError(
            f"in_order_experiment needs at least 2 batches: give the data set more than "
            f"batch_size={batch_size} items (it has {len(dataset)})"
        )
    results: dict[bool, Throughput] = {}
    ooo: dict[bool, float] = {}
    for flag in (True, False):
        firsts: list[int] = []

        def note(batch: Any, firsts: list[int] = firsts) -> None:  # loop values bound as defaults (B023)
            firsts.append(int(batch[1][0]))

        cfg = LoaderConfig(
            batch_size=batch_size,
            num_workers=num_workers,
            shuffle=False,
            in_order=flag if num_workers else True,
            prefetch_factor=prefetch_factor,
        )
        res = measure_config(dataset, cfg, batches=n_batches - 1, warmup=1, on_batch=note)
        results[flag] = res
        ooo[flag] = sum(b < a for a, b in zip(firsts, firsts[1:])) / max(1, len(firsts) - 1)
    return InOrderResult(results=results, out_of_order=ooo)


def _is_factory(obj: Any) -> TypeIs[Callable[..., DataLoader]]:
    """True for a loader factory (a function returning a DataLoader), False for a data set or a loader."""
    return callable(obj) and not isinstance(obj, (Dataset, DataLoader)) and not hasattr(obj, "__getitem__")


def build_from_factory(
    factory: Callable[[Any], DataLoader], value: Any, *, expect: Mapping[str, Any] | None = None
) -> DataLoader:
    """``factory(value)``, checked and guarded: your loader for one point of an experiment.

    The DataLoader's own warnings while it is built (e.g. "suggested max number of worker") are kept
    with the loader (they reach ``Throughput.warnings``), not printed. ``expect`` names knobs the loader
    must have (``{"num_workers": 2}``): a factory that ignores the value it is given is refused, since
    the experiment would then compare a loader with itself.
    """
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
    params = _loader_params(loader)
    wrong = {k: params.get(k) for k, v in (expect or {}).items() if params.get(k) != v}
    if wrong:
        raise ValueError(
            f"the loader factory was asked for {dict(expect or {})} (value {value!r}) but built a loader "
            f"with {wrong}: pass the value on to the DataLoader (e.g. num_workers=workers)"
        )
    guard(loader)
    loader._workbook_warnings += [str(w.message).strip() for w in wlist]  # type: ignore[attr-defined]
    return loader


_LABEL_PART: dict[str, str | tuple[str, ...]] = {
    "num_workers": "workers=",
    "batch_size": "batch=",
    "prefetch_factor": "prefetch=",
    "persistent_workers": "persistent",
    "in_order": "in_order=",
    "pin_memory": "pin_memory",
    "multiprocessing_context": ("fork", "spawn", "forkserver"),
}


def _label_without(cfg: LoaderConfig, knob: str) -> str:
    """``cfg.label()`` without the part that shows ``knob`` (the knob an experiment changes)."""
    prefix = _LABEL_PART.get(knob)
    parts = cfg.label().split(", ")
    return ", ".join(p for p in parts if prefix is None or not p.startswith(prefix))


def _knob_factory(
    factory: Callable[[Any], DataLoader],
    knob: str,
    values: Sequence[Any],
    *,
    batches: int,
    warmup: int,
    progress: Callable[..., Any] | None,
) -> KnobResult:
    """:func:`knob_experiment` with your loader factory: one loader per value, each released after its run."""
    if not isinstance(knob, str) or not knob:
        raise ValueError(f"knob must name what the factory's argument changes, e.g. 'prefetch_factor'; got {knob!r}")
    if not values:
        raise ValueError("values must hold at least one setting")
    expect_knob = knob in _LABEL_PART and knob != "multiprocessing_context"
    results = []
    for k, v in enumerate(values):
        results.append(
            measure_throughput(
                build_from_factory(factory, v, expect={knob: v} if expect_knob else None),
                batches=batches,
                warmup=warmup,
            )
        )
        if progress is not None:
            progress((k + 1) / len(values), f"{knob}={v}")
    return KnobResult(knob=knob, values=list(values), results=results, base=_config_of(results[0].config))


def sampler_batches(loader: DataLoader) -> list[list[int]]:
    """The batches of indices the next ``iter(loader)`` hands out, in sampler order, without changing them.

    Every DataLoader iterator first draws its workers' base seed from the loader's ``generator`` (torch's
    ``_BaseDataLoaderIter``), then its sampler draws the epoch's permutation. This replays both and puts
    the generators' states back, so the epoch that follows is exactly the one returned here.
    """
    if loader.batch_sampler is None:
        raise ValueError("sampler_batches needs a loader with batch_size set (batches come from a batch sampler)")
    gens = [
        g
        for g in {
            id(g): g for g in (loader.generator, getattr(loader.sampler, "generator", None)) if g is not None
        }.values()
    ]
    saved = [g.get_state() for g in gens]
    saved_global = torch.get_rng_state()
    try:
        torch.empty((), dtype=torch.int64).random_(generator=loader.generator)
        return [[int(i) for i in b] for b in loader.batch_sampler]
    finally:
        for g, st in zip(gens, saved):
            g.set_state(st)
        torch.set_rng_state(saved_global)


def _in_order_factory(factory: Callable[[bool], DataLoader]) -> InOrderResult:
    """:func:`in_order_experiment` with your loader factory: one epoch with in_order=True, then False."""
    results: dict[bool, Throughput] = {}
    ooo: dict[bool, float] = {}
    for flag in (True, False):
        loader = build_from_factory(factory, flag, expect={"in_order": flag})
        try:
            order = sampler_batches(loader)
            if len(order) < 2:
                raise ValueError(f"in_order_experiment needs at least 2 batches per epoch; the loader has {len(order)}")
            where = {tuple(b): k for k, b in enumerate(order)}
            seen: list[int | None] = []

            def note(batch: Any, seen: list[int | None] = seen, where: dict[tuple, int] = where) -> None:
                seen.append(where.get(tuple(int(i) for i in batch[1])))

            results[flag] = measure_throughput(loader, batches=len(order) - 1, warmup=1, on_batch=note)
        finally:
            release(loader)
        if None in seen:
            raise ValueError(
                "in_order_experiment: the batches' labels must be the items' indices (as UnevenDataset's "
                "are), so that each batch can be found in the sampler's order"
            )
        pos = [s for s in seen if s is not None]
        ooo[flag] = sum(b < a for a, b in zip(pos, pos[1:])) / max(1, len(pos) - 1)
    return InOrderResult(results=results, out_of_order=ooo)


def getitems_experiment(
    dataset: "BatchedCheapDataset | int",
    *,
    image_size: int = 32,
    output: str = "uint8",
    workers: Sequence[int] = (0, 2),
    batch_size: int = 64,
    batches: int = 60,
    warmup: int = 4,
) -> dict[tuple[str, int], Throughput]:
    """Per-item fetching (``__getitem__`` + default_collate) against one batched ``__getitems__`` call per batch.

    Args:
        dataset: the reader's data set with a ``__getitems__`` that returns a finished batch (like
            :class:`BatchedCheapDataset`); the per-item runs use the same object through a view that hides
            ``__getitems__``. An int ``n`` builds ``BatchedCheapDataset(n, image_size, output)``
            (``image_size`` and ``output`` are used only then).
    """
    out: dict[tuple[str, int], Throughput] = {}
    if isinstance(dataset, bool) or not (isinstance(dataset, int) or hasattr(dataset, "__getitems__")):
        raise ValueError(
            "dataset must be a data set with __getitems__ (e.g. loaders.BatchedCheapDataset) or an item "
            f"count, got {type(dataset).__name__}"
        )
    batched = (
        BatchedCheapDataset(check_int("n", dataset, 1, 10_000_000), image_size=image_size, output=output)
        if isinstance(dataset, int)
        else dataset
    )
    per_item = _PerItem(batched)
    for w in workers:
        base = LoaderConfig(batch_size=batch_size, num_workers=w, persistent_workers=w > 0)
        out[("per-item", w)] = measure_config(
            per_item, base, batches=batches, warmup=warmup, label=f"__getitem__, workers={w}"
        )
        out[("batched", w)] = measure_config(
            batched,
            base,
            batches=batches,
            warmup=warmup,
            collate_fn=passthrough_collate,
            label=f"__getitems__, workers={w}",
        )
    return out


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
    """Throughput and main-thread load for cheap items (float, uint8, uint8 + light collate) and expensive items.

    Args:
        expensive: name -> data set (e.g. ``{"JPEG float": ShapesDataset(...), "JPEG uint8": ...}``).
        n_cheap / image_size: the cheap in-memory data set's size.
    Returns:
        rows ``{"items", "output", "collate", "num_workers", "result"}``.
    """
    cases: list[tuple[str, str, str, Dataset, Callable[[Any], Any] | None]] = [
        ("cheap", "float", "default", CheapDataset(n_cheap, image_size, "float"), None),
        ("cheap", "uint8", "default", CheapDataset(n_cheap, image_size, "uint8"), None),
        ("cheap", "uint8", "light", CheapDataset(n_cheap, image_size, "uint8"), light_uint8_collate),
    ]
    for name, ds in expensive.items():
        out_kind = getattr(ds, "output", "?")
        cases.append((name, out_kind, "default", ds, None))
    rows = []
    for items, output, collate, ds, fn in cases:
        for w in workers:
            cfg = LoaderConfig(batch_size=batch_size, num_workers=w, persistent_workers=w > 0)
            res = measure_config(
                ds,
                cfg,
                batches=batches,
                warmup=warmup,
                collate_fn=fn,
                label=f"{items} {output} ({collate} collate), workers={w}",
            )
            rows.append({"items": items, "output": output, "collate": collate, "num_workers": w, "result": res})
    return rows
