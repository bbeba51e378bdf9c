"""Chapter 04's fair comparisons: workers=0 against workers=N (and the machine's own parallel ceiling), and a
knob's values, each in alternating rounds (:func:`helpers.core.rounds.alternate`), with the verdicts on two
measurements of one thing.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import signal
import statistics
import threading
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch
from torch.utils.data import DataLoader, Dataset, default_collate

from ...core import agreement
from ...core.failures import LoaderFailure
from ...core.rounds import alternate, intraop_threads, table
from ...core.validate import check_float, check_int
from ...pipeline.loaders import WORKER_TIMEOUT_S, Epochs, batch_len
from ...pipeline.workers import (
    MAX_WORKERS,
    SHUTDOWN_GRACE_S,
    HeldSignals,
    cpu_cores,
    released,
    reset_child_signals,
    stop_processes,
)
from .sweeps import SpeedupRounds, WorkerSweep, build_from_factory

# -- the measured ceiling: N independent processes, no loader around them ---------------------------


def _ceiling_task(args: tuple[Any, int, int, Any, float, float]) -> tuple[int, float]:
    """One process of :func:`parallel_ceiling`: load and collate batches for ``seconds``; (items, seconds)."""
    dataset, offset, batch_size, collate_fn, start_at, seconds = args
    torch.set_num_threads(1)
    collate = collate_fn if collate_fn is not None else default_collate
    while time.time() < start_at:  # all processes start together
        time.sleep(0.0005)
    n, k, t0 = len(dataset), 0, time.perf_counter()
    while True:
        collate([dataset[(offset + k + j) % n] for j in range(batch_size)])
        k += batch_size
        dt = time.perf_counter() - t0
        if dt >= seconds:
            return k, dt


def parallel_ceiling(
    dataset: Dataset,
    processes: int = 2,
    seconds: float = 1.0,
    *,
    batch_size: int = 32,
    collate_fn: Callable[[Any], Any] | None = None,
    pool: Any = None,
) -> float:
    """Items/s that ``processes`` independent processes reach together, each doing what ``num_workers=0``
    does (``collate_fn([dataset[i] for i in batch])``) with no queues, shared memory or main process to feed.

    That is the most ``num_workers=processes`` can deliver here right now: the *measured* core-count
    ceiling, below ``processes`` x the single-process rate on a turbo-boosting laptop, on a VM whose virtual
    cores share physical ones, or next to other programs. ``pool``: an open pool of :func:`start_pool` to
    reuse; by default one is started and closed here (also on ``KeyboardInterrupt``).
    """
    processes = check_int("processes", processes, 1, MAX_WORKERS)
    seconds = check_float("seconds", seconds, 0.05, 600.0)
    batch_size = check_int("batch_size", batch_size, 1, 65536)
    own = pool is None
    try:
        if own:
            pool = start_pool(processes)
        n = max(1, len(dataset))  # type: ignore[arg-type]
        start_at = time.time() + 0.05
        tasks = [(dataset, (i * n) // processes, batch_size, collate_fn, start_at, seconds) for i in range(processes)]
        # Bounded: a task that never returns (a frozen process) ends the call instead of hanging it.
        done = pool.map_async(_ceiling_task, tasks, chunksize=1).get(timeout=seconds + WORKER_TIMEOUT_S)
    except mp.TimeoutError:
        raise LoaderFailure(
            f"parallel_ceiling: the {processes} processes did not report within "
            f"{seconds + WORKER_TIMEOUT_S:g} s (a frozen or starved process); they were stopped"
        ) from None
    finally:
        if own and pool is not None:
            close_pool(pool)
    return sum(k / dt for k, dt in done)


def _pool_initializer() -> None:
    reset_child_signals()
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})


def start_pool(processes: int) -> Any:
    """A ``multiprocessing`` pool whose processes never run the parent's signal handlers; close it with
    :func:`close_pool`. SIGINT and SIGTERM stay blocked while the pool forks, until each child has reset its
    handlers (:func:`~helpers.pipeline.loaders.reset_child_signals`)."""
    processes = check_int("processes", processes, 1, MAX_WORKERS)
    with HeldSignals() as held:  # a Ctrl-C during the forks is noted, not lost in an at-fork callback
        old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
        try:
            pool = mp.get_context().Pool(processes, initializer=_pool_initializer)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)
    try:
        held.deliver()
    except BaseException:
        close_pool(pool)
        raise
    return pool


def close_pool(pool: Any, grace_s: float = SHUTDOWN_GRACE_S) -> None:
    """``pool.terminate()`` + ``join()``, bounded: after ``grace_s`` the processes are killed.

    ``terminate()`` can block for ever on a queue lock a misbehaving process holds, so it runs in a helper
    thread; killing the processes releases what they held. An interrupt meanwhile is re-raised at the end.
    """
    import multiprocessing.pool as mp_pool

    handler = getattr(pool, "_worker_handler", None)
    if handler is not None:  # stop the pool replacing workers that exit while it closes (they would be missed)
        handler._state = mp_pool.TERMINATE
    procs = list(getattr(pool, "_pool", []) or [])

    def terminate() -> None:
        with contextlib.suppress(Exception):
            pool.terminate()
            pool.join()

    pending: BaseException | None = None
    t = threading.Thread(target=terminate, name="workbook-pool-close", daemon=True)
    t.start()
    for _attempt in range(4):
        try:
            t.join(grace_s)
            if t.is_alive():
                stop_processes(procs, grace_s=0.0)
                t.join(grace_s)
            # A worker the pool started while it was closing is not in ``procs``: forked while another
            # thread held a lock, it can sit on that lock for ever (an orphan after the run). Stop it too.
            late = [p for p in list(getattr(pool, "_pool", []) or []) if all(p is not q for q in procs)]
            stop_processes(procs + late, grace_s=0.5)
            break
        except KeyboardInterrupt as exc:
            pending = exc
    if pending is not None:
        raise pending


# -- loaders measured in alternating rounds -------------------------------------------------------------


class _Batches(Epochs):
    """Batches from one loader across epoch ends, timed."""

    loader: DataLoader

    def __init__(self, loader: DataLoader) -> None:
        super().__init__(loader)
        self.last_s = 0.05
        # the batches its workers buffer while idle (num_workers x prefetch_factor): taken untimed first
        self.buffered = loader.num_workers * (loader.prefetch_factor or 2)

    def take(self, count: int) -> tuple[int, float]:
        """Take ``count`` batches; returns (items, seconds)."""
        t0 = time.perf_counter()
        items = sum(batch_len(self.next()) for _ in range(count))
        self.last_s = time.perf_counter() - t0
        return items, self.last_s

    def rate(self, batches: int) -> float:
        """Items/s over ``batches`` batches, after the batches prepared while idle (not the steady state)."""
        self.take(self.buffered)
        items, secs = self.take(batches)
        return items / secs


#: The knobs a DataLoader shows as attributes: the factory's loader is checked to have the value asked for.
_VISIBLE_KNOBS = ("num_workers", "batch_size", "prefetch_factor", "persistent_workers", "in_order", "pin_memory")


@contextlib.contextmanager
def _loader_rounds(
    factory: Callable[[Any], DataLoader], expect: Mapping[Any, Mapping[str, Any] | None], warmup: int
) -> Iterator[list[_Batches]]:
    """``factory(value)`` for each value of ``expect`` (checked to have the knobs given there), all built before
    any is warmed up; one intra-op thread and the core-count warning quiet meanwhile; every worker released."""
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


def interleaved_speedup(
    factory: Callable[[int], DataLoader],
    num_workers: int = 2,
    *,
    rounds: int = 5,
    batches: int = 30,
    warmup: int = 4,
    progress: Callable[..., Any] | None = None,
) -> SpeedupRounds:
    """The worker speed-up in alternating rounds, so that drift in the machine's speed cancels out.

    ``factory(0)`` and ``factory(num_workers)`` (persistent workers) are your loaders. Each round measures, back to
    back (reversed every other round): ``batches`` batches in one process, :func:`parallel_ceiling`
    (``num_workers`` processes, the same batches, for as long) and ``batches`` batches from the worker loader,
    after the batches its idle workers buffered. The main process uses one intra-op thread. ValueError for bad
    arguments or too little ``/dev/shm`` (before any worker starts).
    """
    num_workers = check_int("num_workers", num_workers, 1, MAX_WORKERS)
    rounds = check_int("rounds", rounds, 1, 1000)
    batches = check_int("batches", batches, 1, 1_000_000)
    warmup = check_int("warmup", warmup, 0, 1_000_000)
    t_start = time.perf_counter()
    expect = {0: {"num_workers": 0}, num_workers: {"num_workers": num_workers, "persistent_workers": True}}
    with _loader_rounds(factory, expect, warmup) as (one, many):
        ds, collate, bs = many.loader.dataset, many.loader.collate_fn, int(many.loader.batch_size or 1)
        pool = start_pool(num_workers)
        try:
            got = alternate(
                {
                    "workers=0": lambda: one.rate(batches),
                    # as long as the latest single-process window
                    "ceiling": lambda: parallel_ceiling(
                        ds, num_workers, max(0.05, one.last_s), batch_size=bs, collate_fn=collate, pool=pool
                    ),
                    "workers": lambda: many.rate(batches),
                },
                rounds,
                progress=progress,
            )
        finally:
            close_pool(pool)
    return SpeedupRounds(
        num_workers=num_workers,
        batch_size=bs,
        single=got.values["workers=0"],
        workers=got.values["workers"],
        ceiling=got.values["ceiling"],
        cores=cpu_cores(),
        seconds=time.perf_counter() - t_start,
    )


def plot_rounds(sr: SpeedupRounds, ax: Any = None, title: str = "") -> Any:
    """Items/s per round: one process, the worker loader, and (if measured) the measured ceiling."""
    import matplotlib.pyplot as plt  # optional/heavy: matplotlib

    if ax is None:
        _, ax = plt.subplots(figsize=(8, 3.4))
    xs = list(range(1, len(sr.single) + 1))
    if sr.ceiling:
        ax.plot(xs, sr.ceiling, "s--", color="#444", label=f"ceiling: {sr.num_workers} independent processes")
    ax.plot(xs, sr.workers, "o-", color="#f28e2b", label=f"loader, num_workers={sr.num_workers} (persistent)")
    ax.plot(xs, sr.single, "o-", color="#4e79a7", label="loader, num_workers=0")
    ax.set(xticks=xs, xlabel="round (each measures all series back to back)", ylabel="throughput (items/s)")
    ax.set_ylim(bottom=0)
    ax.set_title(title or f"Speed-up in alternating rounds: median {sr.speedup:.2f}x")
    ax.legend(fontsize=8, loc="lower right")
    ax.grid(alpha=0.3)
    return ax


@dataclass
class KnobRounds:
    """One knob's values measured in alternating rounds: ``rates[v]`` holds items/s of value ``v``, one per round."""

    knob: str
    values: list[Any]
    rates: dict[Any, list[float]]
    reference: Any
    seconds: float

    def ratios(self, value: Any) -> list[float]:
        """Per-round items/s of ``value`` over the reference value's, measured seconds apart."""
        return [a / b for a, b in zip(self.rates[value], self.rates[self.reference])]

    def median(self, value: Any) -> float:
        return statistics.median(self.rates[value])

    def table(self) -> list[str]:
        n = len(self.rates[self.reference])
        rows = [[v, f"{self.median(v):,.0f}", " ".join(f"{r:,.0f}" for r in self.rates[v])] for v in self.values]
        lines = table([self.knob, "items/s (median)", "per round"], rows, left=0)
        return [f"{lines[0]}   ({n} alternating rounds)", *lines[1:]]

    def verdicts(self) -> list[str]:
        """One :func:`difference_line` per value against the reference: within the noise, or a real difference."""
        n = len(self.rates[self.reference])
        return [
            difference_line(self.knob, v, self.reference, self.ratios(v), n) for v in self.values if v != self.reference
        ]


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
) -> KnobRounds:
    """Your loader ``factory(value)`` (persistent workers) at each of a knob's ``values``, in alternating rounds
    like :func:`interleaved_speedup`; ``reference`` (default: the first value) is what
    :meth:`KnobRounds.verdicts` compares against. ValueError: bad arguments, a factory that ignores the value,
    or too little ``/dev/shm``."""
    if not isinstance(knob, str) or not knob:
        raise ValueError(f"knob must name what the factory's argument changes, e.g. 'prefetch_factor'; got {knob!r}")
    values = list(values)
    if len(values) < 2:
        raise ValueError("values must hold at least two settings to compare")
    reference = values[0] if reference is None else reference
    if reference not in values:
        raise ValueError(f"reference must be one of {values}, got {reference!r}")
    rounds = check_int("rounds", rounds, 1, 1000)
    batches = check_int("batches", batches, 1, 1_000_000)
    warmup = check_int("warmup", warmup, 0, 1_000_000)
    t_start = time.perf_counter()
    expect = {v: {knob: v} if knob in _VISIBLE_KNOBS else None for v in values}
    with _loader_rounds(factory, expect, warmup) as takers:
        measures = {f"{knob}={v}": (lambda t=t: t.rate(batches)) for v, t in zip(values, takers)}
        got = alternate(measures, rounds, progress=progress)
    rates = {v: got.values[f"{knob}={v}"] for v in values}
    return KnobRounds(knob=knob, values=values, rates=rates, reference=reference, seconds=time.perf_counter() - t_start)


# -- verdicts: two measurements of one thing ---------------------------------------------------------------

#: What the verdict says when a one-pass figure falls outside the alternating rounds' range.
TRUST_ROUNDS = (
    "trust the alternating rounds (each round compares the two settings under the same load; "
    "the one-pass sweep measures each setting once, at different moments)"
)


def within_spread(value: float, samples: Sequence[float]) -> bool:
    """Whether ``value`` lies within ``samples``' lowest to highest (their noise band; ValueError if not finite)."""
    return agreement.within_range(value, samples)


def agreement_line(num_workers: int, one_pass: float, rounds: Sequence[float]) -> str:
    """The verdict on one speed-up measured in a one-pass sweep and per round in alternating rounds
    (``rounds``: per-round speed-ups, or their lowest and highest): "agree within their spread" or
    "disagree: " + :data:`TRUST_ROUNDS`."""
    lo, hi = min(rounds), max(rounds)
    verdict = "agree within their spread" if within_spread(one_pass, rounds) else f"disagree: {TRUST_ROUNDS}"
    return (
        f"num_workers={num_workers}: one-pass sweep {one_pass:.2f}x (one measurement, no spread of its own) vs "
        f"alternating rounds {statistics.median(rounds):.2f}x (range {lo:.2f}-{hi:.2f}x over the rounds, "
        f"the noise band): {verdict}"
    )


def difference_line(knob: str, value: Any, reference: Any, ratios: Sequence[float], rounds: int) -> str:
    """The verdict on ``knob=value`` against ``knob=reference`` from per-round ratios (or their lowest and
    highest, with ``rounds`` their count): "within the noise" when 1.0 lies in their range
    (:func:`helpers.core.agreement.ratios_straddle_one`), else "a real difference", with how often two equal
    settings would land on one side in every round by chance."""
    lo, hi = min(ratios), max(ratios)
    head = (
        f"{knob}={value} vs {reference}: {statistics.median(ratios):.2f}x (per-round ratios over {rounds} rounds, "
        f"range {lo:.2f}-{hi:.2f}x)"
    )
    if agreement.ratios_straddle_one(ratios):
        return f"{head}: within the noise (the rounds' range includes 1.00x): no difference shown"
    side = "faster" if lo > 1.0 else "slower"
    chance = round(1 / (2 * 0.5 ** max(1, rounds)))
    return (
        f"{head}: a real difference ({side} in all {rounds} rounds; two equal settings would do that by chance "
        f"1 time in {chance})"
    )


def sweep_vs_rounds(sweep: WorkerSweep, rounds: SpeedupRounds | Sequence[SpeedupRounds]) -> list[str]:
    """:func:`agreement_line` for every worker count both the one-pass ``sweep`` (with its ``num_workers=0``
    baseline) and the alternating ``rounds`` measured."""
    out = []
    for sr in [rounds] if isinstance(rounds, SpeedupRounds) else list(rounds):
        if sr.ratios and sr.num_workers in sweep.workers and min(sweep.workers) == 0:
            out.append(agreement_line(sr.num_workers, sweep.speedup(sr.num_workers), sr.ratios))
    return out
