"""Chapter 04's comparisons in alternating rounds (:func:`helpers.core.rounds.alternate`): a knob's values, the
worker speed-up beside the measured parallel ceiling, and the verdicts on two measurements of one thing."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import signal
import statistics
import time
import warnings
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch
from torch.utils.data import DataLoader, Dataset, default_collate

from ...core import agreement
from ...core.rounds import Rounds, alternate, intraop_threads, table
from ...core.validate import check_float, check_int
from ...pipeline.loaders import WORKER_TIMEOUT_S, Epochs, LoaderFailure, batch_len
from ...pipeline.workers import (
    MAX_WORKERS,
    HeldSignals,
    released,
    reset_child_signals,
    stop_processes,
)
from .sweeps import WorkerSweep, build_from_factory

# -- the measured ceiling: N independent processes, no loader around them ---------------------------


def _ceiling_process(conn: Any, go: Any, task: tuple[Any, int, int, Any, float]) -> None:
    """One process of :func:`parallel_ceiling`: sends (items, seconds) of loading and collating for ``seconds``,
    after one untimed batch (a fresh process's first batch is slow, and the loader's workers it is set against
    are warm), or ("error", what went wrong)."""
    reset_child_signals()
    signal.pthread_sigmask(signal.SIG_UNBLOCK, HeldSignals.SIGNALS)
    dataset, offset, batch_size, collate_fn, seconds = task
    torch.set_num_threads(1)
    collate = collate_fn if collate_fn is not None else default_collate
    n = len(dataset)
    try:
        collate([dataset[(offset + j) % n] for j in range(batch_size)])
        go.wait(WORKER_TIMEOUT_S)  # all processes start together
        k, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            collate([dataset[(offset + k + j) % n] for j in range(batch_size)])
            k += batch_size
    except Exception as exc:  # the parent raises it, in one line
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        return
    conn.send((k, time.perf_counter() - t0))


def parallel_ceiling(
    dataset: Dataset,
    processes: int = 2,
    seconds: float = 1.0,
    *,
    batch_size: int = 32,
    collate_fn: Callable[[Any], Any] | None = None,
) -> float:
    """Items/s that ``processes`` independent processes reach together, each doing what ``num_workers=0`` does,
    with no queues, shared memory or main process to feed: the most ``num_workers=processes`` can deliver here now.
    The processes never run the parent's signal handlers, and are stopped when it returns or is interrupted."""
    processes = check_int("processes", processes, 1, MAX_WORKERS)
    seconds = check_float("seconds", seconds, 0.05, 600.0)
    batch_size = check_int("batch_size", batch_size, 1, 65536)
    n = max(1, len(dataset))  # type: ignore[arg-type]
    ctx, procs, conns = mp.get_context(), [], []
    go = ctx.Event()
    try:
        with HeldSignals() as held:  # a Ctrl-C during the forks is noted, not lost in an at-fork callback
            old = signal.pthread_sigmask(signal.SIG_BLOCK, HeldSignals.SIGNALS)
            try:
                for i in range(processes):
                    conns.append(ctx.Pipe(duplex=False))
                    task = (dataset, (i * n) // processes, batch_size, collate_fn, seconds)
                    procs.append(ctx.Process(target=_ceiling_process, args=(conns[-1][1], go, task), daemon=True))
                    procs[-1].start()
                    conns[-1][1].close()
            finally:
                signal.pthread_sigmask(signal.SIG_SETMASK, old)
        held.deliver()
        go.set()
        deadline, done = time.monotonic() + seconds + WORKER_TIMEOUT_S, []
        for recv, _ in conns:
            # Bounded: a process that never reports (frozen, or dead: EOF) ends the call instead of hanging it.
            if not recv.poll(max(0.0, deadline - time.monotonic())):
                raise EOFError
            done.append(recv.recv())
            if done[-1][0] == "error":
                raise LoaderFailure(f"parallel_ceiling: a process failed while loading: {done[-1][1]}")
    except EOFError:
        raise LoaderFailure(
            f"parallel_ceiling: the {processes} processes did not report within {seconds + WORKER_TIMEOUT_S:g} s "
            f"(a frozen, starved or failed process); they were stopped"
        ) from None
    finally:
        stop_processes(procs, grace_s=0.5)
        for recv, _ in conns:
            recv.close()
    return sum(k / dt for k, dt in done)


# -- loaders measured in alternating rounds -------------------------------------------------------------


class _Batches(Epochs):
    loader: DataLoader

    def __init__(self, loader: DataLoader) -> None:
        super().__init__(loader)
        self.last_s = 0.05
        # the batches its workers buffer while idle (num_workers x prefetch_factor): taken untimed first
        self.buffered = loader.num_workers * (loader.prefetch_factor or 2)

    def take(self, count: int) -> tuple[int, float]:
        t0 = time.perf_counter()
        items = sum(batch_len(self.next()) for _ in range(count))
        self.last_s = time.perf_counter() - t0
        return items, self.last_s

    def rate(self, batches: int) -> float:
        self.take(self.buffered)
        items, secs = self.take(batches)
        return items / secs


#: The knobs a DataLoader shows as attributes: the factory's loader is checked to have the value asked for.
_VISIBLE_KNOBS = ("num_workers", "batch_size", "prefetch_factor", "persistent_workers", "in_order", "pin_memory")


@contextlib.contextmanager
def _loader_rounds(
    factory: Callable[[Any], DataLoader], expect: Mapping[Any, Mapping[str, Any] | None], warmup: int
) -> Iterator[list[_Batches]]:
    """All loaders built before any is warmed up; every worker released at the end."""
    with released([]) as objs, intraop_threads(1), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*suggested max number of worker.*")
        takers = []
        for value, knobs in expect.items():
            objs.append(build_from_factory(factory, value, expect=knobs))
            takers.append(_Batches(objs[-1]))
        try:
            for t in takers:
                t.take(max(warmup + t.buffered, 1))  # at least one untimed batch: iter() and the first
            yield takers
        finally:
            objs[:0] = [t.it for t in takers if t.it is not None]


def _median_ratio(a: Sequence[float], b: Sequence[float]) -> float:
    return statistics.median(x / y for x, y in zip(a, b)) if a and b else float("nan")


@dataclass(init=False)  # its own fields in repr and ==: a num_workers result never equals a prefetch_factor one
class LoaderRounds(Rounds):
    """Items/s of each value of a knob per alternating round: a :class:`~helpers.core.rounds.Rounds` whose labels
    are the knob's values (``rates``: its ``values``); for ``num_workers`` also ``ceiling`` per round."""

    knob: str = ""  # the defaults only satisfy dataclass field order: __init__ sets all three
    reference: Any = None
    ceiling: list[float] = field(default_factory=list)

    def __init__(self, knob: str, rates: dict[Any, list[float]], reference: Any, ceiling: Sequence[float] = ()) -> None:
        super().__init__(tuple(rates), rates)
        self.knob, self.reference, self.ceiling = knob, reference, list(ceiling)

    @property
    def rates(self) -> dict[Any, list[float]]:
        return self.values

    @property
    def num_workers(self) -> Any:
        return self.labels[-1]

    def ratios(self, label: Any = None, base: Any = None) -> list[float]:
        """Per-round items/s of ``label`` (default: the last value) over ``base``'s (default: the reference's)."""
        return super().ratios(self.num_workers if label is None else label, self.reference if base is None else base)

    @property
    def speedup(self) -> float:
        return statistics.median(self.ratios())

    @property
    def spread(self) -> tuple[float, float]:
        return min(self.ratios()), max(self.ratios())

    @property
    def ceiling_speedup(self) -> float:
        return _median_ratio(self.ceiling, self.rates[self.reference])

    @property
    def share_of_ceiling(self) -> float:
        return _median_ratio(self.rates[self.num_workers], self.ceiling)

    def notes(self) -> list[str]:
        """Impossible-looking figures: the ceiling is a measurement too, and a disturbed one is no upper bound."""
        out: list[str] = []
        if not self.ceiling:
            return out
        if self.share_of_ceiling > 1.0:
            out.append(
                f"the loader measured {self.share_of_ceiling:.0%} of the measured ceiling (over 100%): the "
                f"ceiling runs were slowed by something else on this machine, so here they are no upper bound "
                f"(noise); re-run on a quieter machine"
            )
        else:
            over = [str(k + 1) for k, (w, c) in enumerate(zip(self.rates[self.num_workers], self.ceiling)) if w > c]
            if over:
                many = len(over) > 1
                out.append(
                    f"round{'s' if many else ''} {', '.join(over)} show{'' if many else 's'} a share over 100%: "
                    f"{'those rounds' if many else 'that round'}'s ceiling runs were slowed by something else on "
                    f"this machine (noise), so the median share is the figure to read"
                )
        if self.ceiling_speedup > self.num_workers * 1.05:
            out.append(
                f"the ceiling of {self.num_workers} processes measured {self.ceiling_speedup:.2f}x one process "
                f"(more than {self.num_workers}x): the single-process rounds ran slow (noise)"
            )
        return out

    def table(self) -> list[str]:
        rate, ratio = "{:,.0f}".format, "{:.2f}x".format
        others = [v for v in self.labels if v != self.reference]
        cols = [(f"{self.knob}={v}", self.rates[v], rate) for v in self.labels]
        cols += [(f"{v} vs {self.reference}", self.ratios(v), ratio) for v in others]
        if self.ceiling:
            ref, mine = self.rates[self.reference], self.rates[self.num_workers]
            cols += [(f"{self.num_workers} procs", self.ceiling, rate)]
            cols += [("ceiling", [c / s for c, s in zip(self.ceiling, ref)], ratio)]
            cols += [("share", [w / c for w, c in zip(mine, self.ceiling)], "{:.0%}".format)]
        rows = [[k + 1, *(f(xs[k]) for _, xs, f in cols)] for k in range(self.n)]
        rows.append(["median", *(f(statistics.median(xs)) for _, xs, f in cols)])
        lines = table(["round", *(h for h, _, _ in cols)], rows)
        return [f"{lines[0]}   (items/s)", *lines[1:]]

    def verdicts(self) -> list[str]:
        """Per value against the reference: "within the noise" when the per-round ratios' range includes 1.0, else
        "a real difference", with how often two equal settings would land on one side in every round by chance."""
        out = []
        for v in [v for v in self.labels if v != self.reference]:
            ratios = self.ratios(v)
            lo, hi, n = min(ratios), max(ratios), len(ratios)
            head = (
                f"{self.knob}={v} vs {self.reference}: {statistics.median(ratios):.2f}x (per-round ratios over {n} "
                f"rounds, range {lo:.2f}-{hi:.2f}x)"
            )
            if agreement.ratios_straddle_one(ratios):
                out.append(f"{head}: within the noise (the rounds' range includes 1.00x): no difference shown")
                continue
            side, chance = "faster" if lo > 1.0 else "slower", round(1 / (2 * 0.5 ** max(1, n)))
            out.append(
                f"{head}: a real difference ({side} in all {n} rounds; two equal settings would do that by chance "
                f"1 time in {chance})"
            )
        return out

    def summary(self) -> str:
        lo, hi = self.spread
        text = (
            f"{self.num_workers} persistent workers: {self.speedup:.2f}x the single-process throughput (median of "
            f"{len(self.ratios())} rounds, range {lo:.2f}-{hi:.2f}x)."
        )
        if self.ceiling:
            text += (
                f" {self.num_workers} independent processes loading and collating the same batches reach "
                f"{self.ceiling_speedup:.2f}x: the measured ceiling. "
                f"The loader's median share of it is {self.share_of_ceiling:.0%} (the median of the per-round "
                f"shares, so it need not equal {self.speedup:.2f}x / {self.ceiling_speedup:.2f}x)."
            )
        return text + "".join(f" Note: {note}." for note in self.notes())

    def plot(self, ax: Any = None, title: str = "") -> Any:
        from ...ui import plots  # optional/heavy: matplotlib

        ax = ax if ax is not None else plots.new_axes((8.0, 3.4))
        n, single = self.num_workers, self.rates[self.reference]
        xs = list(range(1, len(single) + 1))
        if self.ceiling:
            ax.plot(xs, self.ceiling, "s--", color="#444", label=f"ceiling: {n} independent processes")
        ax.plot(xs, self.rates[n], "o-", color="#f28e2b", label=f"loader, num_workers={n} (persistent)")
        ax.plot(xs, single, "o-", color="#4e79a7", label="loader, num_workers=0")
        ax.set(xticks=xs, xlabel="round (each measures all series back to back)", ylabel="throughput (items/s)")
        ax.set_ylim(bottom=0)
        where = "measured now on this machine"
        ax.set_title(title or f"Speed-up in alternating rounds: median {self.speedup:.2f}x ({where})")
        ax.legend(fontsize=8, loc="lower right")
        ax.grid(alpha=0.3)
        return ax


def knob_rounds(
    factory: Callable[[Any], DataLoader],
    knob: str,
    values: Sequence[Any],
    *,
    reference: Any = None,
    rounds: int = 3,
    batches: int = 20,
    warmup: int = 4,
    progress: Callable[..., Any] | None = None,
) -> LoaderRounds:
    """Your loader ``factory(value)`` at each of a knob's ``values`` (all built first), ``batches`` batches of each
    per round, back to back, the order reversed every other round; ratios against ``reference`` (default: the
    first value). For ``knob="num_workers"`` (``values`` from 0, the largest last: ``[0, 2]``, the speed-up) the
    workers persist and :func:`parallel_ceiling` with ``values[-1]`` processes runs after the reference each round.
    ValueError: bad arguments, a factory that ignores the value, or too little ``/dev/shm``."""
    if not isinstance(knob, str) or not knob:
        raise ValueError(f"knob must name what the factory's argument changes, e.g. 'prefetch_factor'; got {knob!r}")
    values = list(values)
    if len(values) < 2 or len(set(values)) != len(values):
        raise ValueError(f"values must hold at least two settings of {knob} to compare, each once; got {values}")
    reference = values[0] if reference is None else reference
    if reference not in values:
        raise ValueError(f"reference must be one of {values}, got {reference!r}")
    rounds = check_int("rounds", rounds, 1, 1000)
    batches = check_int("batches", batches, 1, 1_000_000)
    warmup = check_int("warmup", warmup, 0, 1_000_000)
    expect = {v: {knob: v} if knob in _VISIBLE_KNOBS else None for v in values}
    procs = 0
    if knob == "num_workers":  # workers stay up between rounds; the last count is set against its ceiling
        counts = [check_int("num_workers", v, 0, MAX_WORKERS) for v in values]
        if reference != 0 or counts[0] != 0 or counts[-1] != max(counts):
            raise ValueError(
                "num_workers rounds compare each count with num_workers=0, first and the reference, and set the "
                f"largest count, last, against the ceiling of that many processes: values such as [0, 2] or "
                f"[0, 1, 2]; got {values} with reference {reference!r}"
            )
        expect = {v: {knob: v, "persistent_workers": True} if v else {knob: v} for v in values}
        procs = counts[-1]
    with _loader_rounds(factory, expect, warmup) as takers:
        by_value = dict(zip(values, takers))
        measures: dict[str, Callable[[], float]] = {
            f"{knob}={v}": partial(t.rate, batches) for v, t in by_value.items()
        }
        if procs:
            ref, loader = by_value[reference], takers[-1].loader
            bs, ds, collate = int(loader.batch_size or 1), loader.dataset, loader.collate_fn

            def run_ceiling() -> float:  # as long as the reference's latest window
                return parallel_ceiling(ds, procs, max(0.05, ref.last_s), batch_size=bs, collate_fn=collate)

            first, *rest = measures.items()
            measures = dict([first, ("ceiling", run_ceiling), *rest])
        got = alternate(measures, rounds, progress=progress)
    rates = {v: got.values[f"{knob}={v}"] for v in values}
    return LoaderRounds(knob, rates, reference, got.values.get("ceiling", []))


def sweep_vs_rounds(sweep: WorkerSweep, rounds: LoaderRounds) -> list[str]:
    """The verdict on the worker count both the one-pass ``sweep`` (from ``num_workers=0``) and the ``rounds``
    measured: "agree within their spread" when the one-pass figure lies in the rounds' range (their noise band),
    else "disagree" and which to trust; [] if they share none."""
    n, ratios = rounds.num_workers, rounds.ratios()
    if rounds.knob != "num_workers" or not ratios or n not in sweep.workers or min(sweep.workers) != 0:
        return []
    one_pass, lo, hi = sweep.speedup(n), min(ratios), max(ratios)
    verdict = "agree within their spread" if agreement.within_range(one_pass, ratios) else f"disagree: {TRUST_ROUNDS}"
    return [
        f"num_workers={n}: one-pass sweep {one_pass:.2f}x (one measurement, no spread of its own) vs alternating "
        f"rounds {statistics.median(ratios):.2f}x (range {lo:.2f}-{hi:.2f}x over the rounds, the noise band): {verdict}"
    ]


TRUST_ROUNDS = (
    "trust the alternating rounds (each round compares the two settings under the same load; "
    "the one-pass sweep measures each setting once, at different moments)"
)
