"""Chapter 04's fair speed-up figure: alternating rounds of workers=0 against workers=N, the machine's own
parallel ceiling beside them, and whether two measurements of one thing agree within their spread.
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
from typing import Any, Callable, Iterator, Sequence

import torch
from torch.utils.data import DataLoader, Dataset, default_collate

from ...core import agreement
from ...core.device import intraop_threads
from ...core.failures import LoaderFailure
from ...core.validate import check_float, check_int
from ...pipeline.loaders import (
    MAX_WORKERS,
    SHUTDOWN_GRACE_S,
    WORKER_TIMEOUT_S,
    LoaderConfig,
    _batch_len,
    _finish,
    _HeldSignals,
    _stop_processes,
    _worker_children,
    build_loader,
    cpu_cores,
    reset_child_signals,
)
from .sweeps import _LABEL_PART, SpeedupRounds, WorkerSweep, _is_factory, build_from_factory

__all__ = [
    "parallel_ceiling",
    "close_pool",
    "interleaved_speedup",
    "plot_rounds",
    "TRUST_ROUNDS",
    "within_spread",
    "agreement_line",
    "difference_line",
    "sweep_vs_rounds",
    "KnobRounds",
    "knob_rounds",
]


def _ceiling_task(args: tuple[Any, int, int, Any, float, float]) -> tuple[int, float]:
    """One process of :func:`parallel_ceiling`: load and collate batches in a loop for ``seconds``; (items, seconds)."""
    dataset, offset, batch_size, collate_fn, start_at, seconds = args
    torch.set_num_threads(1)
    collate = collate_fn if collate_fn is not None else default_collate
    while time.time() < start_at:  # all processes start together
        time.sleep(0.0005)
    n = len(dataset)
    k = 0
    t0 = time.perf_counter()
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
    """Items/s that ``processes`` independent processes reach together, each loading and collating batches.

    Each process does exactly what ``num_workers=0`` does in the main process -
    ``collate_fn([dataset[i] for i in batch])`` - but with no loader around it: no
    queues, no shared memory, no main process to feed. That is the most
    ``num_workers=processes`` can deliver on this machine right now - the
    *measured* core-count ceiling. On a laptop with turbo boost, on a VM whose
    virtual cores share physical ones, or next to other programs it is below
    ``processes`` x the single-process rate.

    Args:
        dataset: a map-style data set (picklable; from an importable module under spawn).
        processes: how many processes (1-64).
        seconds: how long each one runs (0.05-600); at least one batch is always completed.
        batch_size: items per batch (1-65536).
        collate_fn: default ``torch.utils.data.default_collate``.
        pool: an open ``multiprocessing`` pool with ``processes`` processes to reuse; default: one is
            started for this call and terminated afterwards (also on ``KeyboardInterrupt``).
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
            f"{seconds + WORKER_TIMEOUT_S:g} s (a frozen or starved process); "
            "they were stopped"
        ) from None
    finally:
        if own and pool is not None:
            close_pool(pool)
    return sum(k / dt for k, dt in done)


def _pool_initializer() -> None:
    reset_child_signals()
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})


def start_pool(processes: int) -> Any:
    """A ``multiprocessing`` pool whose processes never run the parent's signal handlers.

    SIGINT and SIGTERM are blocked in this thread while the pool forks, so a child can't receive
    one before its initializer has reset the handlers (:func:`reset_child_signals`) and unblocked them.
    Close it with :func:`close_pool`.
    """
    processes = check_int("processes", processes, 1, MAX_WORKERS)
    with _HeldSignals() as held:  # a Ctrl-C during the forks is noted, not lost in an at-fork callback
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
    """``pool.terminate()`` + ``join()``, with a bounded wait: after ``grace_s`` the processes are killed.

    ``terminate()`` can block for ever on a queue lock that a misbehaving process holds; it runs in a
    helper thread here, and killing the processes releases what they held. An interrupt that arrives
    meanwhile is re-raised after the processes are gone.
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
                _stop_processes(procs, grace_s=0.0)
                t.join(grace_s)
            # A worker the pool started while it was closing is not in ``procs``: forked while another
            # thread held a lock, it can sit on that lock for ever (an orphan after the run). Stop it too.
            late = [p for p in list(getattr(pool, "_pool", []) or []) if all(p is not q for q in procs)]
            _stop_processes(procs + late, grace_s=0.5)
            break
        except KeyboardInterrupt as exc:
            pending = exc
    if pending is not None:
        raise pending


class _Batches:
    """Take batches from a loader across epoch ends (persistent workers carry on); close() releases the workers."""

    def __init__(self, loader: DataLoader) -> None:
        self.loader = loader
        self.it: Iterator[Any] | None = None

    def take(self, count: int) -> tuple[int, float]:
        """Take ``count`` batches; returns (items, seconds)."""
        items = 0
        t0 = time.perf_counter()
        for _ in range(count):
            if self.it is None:
                self.it = iter(self.loader)
            try:
                batch = next(self.it)
            except StopIteration:
                self.it = iter(self.loader)
                batch = next(self.it)
            items += _batch_len(batch)
        return items, time.perf_counter() - t0

    def objs(self) -> list[Any]:
        """What :func:`_finish` must release."""
        return [x for x in (self.it, self.loader) if x is not None]

    def close(self) -> None:
        _finish(self.objs())


def interleaved_speedup(
    dataset: "Dataset | Callable[[int], DataLoader]",
    num_workers: int = 2,
    *,
    rounds: int = 5,
    batches: int = 30,
    batch_size: int = 32,
    warmup: int = 4,
    prefetch_factor: int | None = None,
    ceiling: bool = True,
    collate_fn: Callable[[Any], Any] | None = None,
    progress: Callable[..., Any] | None = None,
) -> SpeedupRounds:
    """Measure the worker speed-up in alternating rounds, so that drift in the machine's speed cancels out.

    A sequential comparison (all of ``num_workers=0``, then all of the worker
    loader) is at the mercy of the machine's speed at the time: on a shared or
    turbo-boosting CPU the single-core rate moves by a third within seconds.
    Here each round measures, back to back: ``batches`` batches in one process,
    (optionally) :func:`parallel_ceiling` (the same batches, collated the same way,
    in ``num_workers`` independent processes) for as long, then ``batches`` batches
    from the worker loader. The speed-up of each round compares measurements
    taken seconds apart; the result is their median.

    The worker loader is built once, with persistent workers, and warmed up. While
    the single-process window runs, its workers sit idle with full buffers, so the
    ``num_workers x prefetch_factor`` batches they hold are taken (untimed) before
    each timed window. The main process uses one intra-op thread throughout.

    ``dataset`` is either your loader factory (a function of the worker count: ``factory(0)`` is the
    single-process loader, ``factory(num_workers)`` the worker loader; give it persistent workers), or a
    data set (then both loaders are built here from ``batch_size``, ``prefetch_factor`` and ``collate_fn``).
    With a factory, the ceiling runs the worker loader's own data set, collate function and batch size,
    and its ``prefetch_factor`` sets how many buffered batches are taken before each window.

    Raises:
        ValueError: bad arguments, or too little ``/dev/shm`` (checked before any worker starts).
    """
    num_workers = check_int("num_workers", num_workers, 1, MAX_WORKERS)
    rounds = check_int("rounds", rounds, 1, 1000)
    batches = check_int("batches", batches, 1, 1_000_000)
    warmup = check_int("warmup", warmup, 0, 1_000_000)
    single: list[float] = []
    workers: list[float] = []
    ceil: list[float] = []
    t_start = time.perf_counter()
    if _is_factory(dataset):
        # your loaders, with the workbook's safety (guard: /dev/shm checked before any worker starts)
        one = _Batches(build_from_factory(dataset, 0, expect={"num_workers": 0}))
        many = _Batches(
            build_from_factory(dataset, num_workers, expect={"num_workers": num_workers, "persistent_workers": True})
        )
        dataset, collate_fn = many.loader.dataset, many.loader.collate_fn
        batch_size, prefetch_factor = int(many.loader.batch_size or 1), many.loader.prefetch_factor
    else:
        single_cfg = LoaderConfig(batch_size=batch_size)
        worker_cfg = single_cfg.replace(
            num_workers=num_workers, persistent_workers=True, prefetch_factor=prefetch_factor
        )
        worker_cfg.validated()
        # build_loader checks /dev/shm before any worker starts
        one = _Batches(build_loader(dataset, single_cfg, collate_fn=collate_fn))
        many = _Batches(build_loader(dataset, worker_cfg, collate_fn=collate_fn))
    buffered = num_workers * (prefetch_factor or 2)
    with intraop_threads(1), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*suggested max number of worker.*")
        pool = None
        before = _worker_children()
        try:
            one.take(max(1, warmup))
            many.take(warmup + buffered)
            if ceiling:
                pool = start_pool(num_workers)
            for r in range(rounds):
                items, secs = one.take(batches)
                single.append(items / secs)
                if pool is not None:
                    ceil.append(
                        parallel_ceiling(
                            dataset,
                            num_workers,
                            max(0.05, secs),
                            batch_size=batch_size,
                            collate_fn=collate_fn,
                            pool=pool,
                        )
                    )
                many.take(buffered)  # prepared while idle: not part of the steady state
                items, secs = many.take(batches)
                workers.append(items / secs)
                if progress is not None:
                    progress((r + 1) / rounds, f"round {r + 1}/{rounds}")
        finally:
            try:
                if pool is not None:
                    close_pool(pool)
            finally:
                _finish([*many.objs(), *one.objs()], before)
    return SpeedupRounds(
        num_workers=num_workers,
        batch_size=batch_size,
        single=single,
        workers=workers,
        ceiling=ceil,
        cores=cpu_cores(),
        seconds=time.perf_counter() - t_start,
    )


def plot_rounds(sr: SpeedupRounds, ax: Any = None, title: str = "") -> Any:
    """Items/s per round: one process, the worker loader, and (if measured) the measured ceiling."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(8, 3.4))
    xs = list(range(1, len(sr.single) + 1))
    if sr.ceiling:
        ax.plot(xs, sr.ceiling, "s--", color="#444", label=f"ceiling: {sr.num_workers} independent processes")
    ax.plot(xs, sr.workers, "o-", color="#f28e2b", label=f"loader, num_workers={sr.num_workers} (persistent)")
    ax.plot(xs, sr.single, "o-", color="#4e79a7", label="loader, num_workers=0")
    ax.set_xticks(xs)
    ax.set_xlabel("round (each measures all series back to back)")
    ax.set_ylabel("throughput (items/s)")
    ax.set_ylim(bottom=0)
    ax.set_title(title or f"Speed-up in alternating rounds: median {sr.speedup:.2f}x")
    ax.legend(fontsize=8, loc="lower right")
    ax.grid(alpha=0.3)
    return ax


#: What the verdict says when a one-pass figure falls outside the alternating rounds' range.
TRUST_ROUNDS = (
    "trust the alternating rounds (each round compares the two settings under the same load; "
    "the one-pass sweep measures each setting once, at different moments)"
)


def within_spread(value: float, samples: Sequence[float]) -> bool:
    """The verdict: whether ``value`` lies within the spread of ``samples`` (their lowest to highest, inclusive).

    The one small rule behind every "agree / disagree" line of chapter 04: a figure with no spread of its own
    (a one-pass measurement; or 1.0, "no difference") is compared with the range of repeated measurements
    of the same thing (alternating rounds), which serves as the noise band: :func:`helpers.core.agreement.within_range`.

    Raises:
        ValueError: no samples, or a value/sample that is not a finite number.
    """
    return agreement.within_range(value, samples)


def agreement_line(num_workers: int, one_pass: float, rounds: Sequence[float]) -> str:
    """The verdict on one speed-up measured twice: once in a one-pass sweep, and per round in alternating rounds.

    ``one_pass`` has no spread of its own; the rounds' range (``rounds``: per-round speed-ups, or just their
    lowest and highest) is the noise band (:func:`within_spread`). Ends in "agree within their spread" or
    "disagree: " + :data:`TRUST_ROUNDS`.
    """
    lo, hi = min(rounds), max(rounds)
    verdict = "agree within their spread" if within_spread(one_pass, rounds) else f"disagree: {TRUST_ROUNDS}"
    return (
        f"num_workers={num_workers}: one-pass sweep {one_pass:.2f}x (one measurement, no spread of its own) vs "
        f"alternating rounds {statistics.median(rounds):.2f}x (range {lo:.2f}-{hi:.2f}x over the rounds, "
        f"the noise band): {verdict}"
    )


def difference_line(knob: str, value: Any, reference: Any, ratios: Sequence[float], rounds: int) -> str:
    """The verdict on ``knob=value`` against ``knob=reference`` from per-round ratios (value / reference).

    The noise is estimated from the rounds themselves: if 1.0 ("no difference") lies within the ratios' range
    (:func:`helpers.core.agreement.ratios_straddle_one`), the two settings can't be told apart here ("within the
    noise"); otherwise "a real difference" (every round on the same side), with how often two equal settings would
    do that by chance.
    ``ratios`` may be every per-round ratio or just their lowest and highest (with ``rounds`` their count).
    """
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


def sweep_vs_rounds(sweep: "WorkerSweep", rounds: "SpeedupRounds | Sequence[SpeedupRounds]") -> list[str]:
    """:func:`agreement_line` for every worker count that both the one-pass ``sweep`` and alternating ``rounds``
    measured (the sweep must include ``num_workers=0``, its baseline)."""
    out = []
    for sr in [rounds] if isinstance(rounds, SpeedupRounds) else list(rounds):
        if sr.ratios and sr.num_workers in sweep.workers and min(sweep.workers) == 0:
            out.append(agreement_line(sr.num_workers, sweep.speedup(sr.num_workers), sr.ratios))
    return out


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
        lines = [f"{self.knob:>16} {'items/s (median)':>17} {'per round':>30}   ({n} alternating rounds)"]
        for v in self.values:
            rounds = " ".join(f"{r:,.0f}" for r in self.rates[v])
            lines.append(f"{v!s:>16} {self.median(v):>17,.0f} {rounds:>30}")
        return lines

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
    """Measure your loader at each of a knob's ``values`` in alternating rounds, like :func:`interleaved_speedup`.

    ``factory(value)`` builds your loader with the knob at ``value`` (persistent workers). All loaders are built
    once and warmed up; each round then times ``batches`` batches of each, one after another (each round starting
    with the next value, so that none always goes first), so that every round compares the values under the same
    load. Before each timed window the batches an idle loader's
    workers buffered (``num_workers x prefetch_factor``) are taken untimed. ``reference`` (default: the first
    value) is what :meth:`KnobRounds.verdicts` compares against. Workers are released at the end, also when
    interrupted.

    Raises:
        ValueError: bad arguments, a factory that ignores the value, or too little ``/dev/shm``.
    """
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
    expect_knob = knob in _LABEL_PART and knob != "multiprocessing_context"
    t_start = time.perf_counter()
    rates: dict[Any, list[float]] = {v: [] for v in values}
    takers: list[_Batches] = []
    before = _worker_children()
    with intraop_threads(1), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*suggested max number of worker.*")
        try:
            for v in values:
                takers.append(_Batches(build_from_factory(factory, v, expect={knob: v} if expect_knob else None)))
            buffered = [t.loader.num_workers * (t.loader.prefetch_factor or 2) for t in takers]
            for t, b in zip(takers, buffered):
                t.take(warmup + b)
            order = list(zip(values, takers, buffered))
            for r in range(rounds):
                k = r % len(order)  # each round starts with the next value: no value always goes first
                for v, t, b in order[k:] + order[:k]:
                    t.take(b)  # prepared while idle: not part of the steady state
                    items, secs = t.take(batches)
                    rates[v].append(items / secs)
                if progress is not None:
                    progress((r + 1) / rounds, f"round {r + 1}/{rounds}")
        finally:
            _finish([x for t in takers for x in t.objs()], before)
    return KnobRounds(knob=knob, values=values, rates=rates, reference=reference, seconds=time.perf_counter() - t_start)
