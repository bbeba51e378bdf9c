"""Chapter 00's measurement-hygiene experiments (warm-up, synchronisation, CUDA events, the panel's operation),
each a small real one returning :class:`~helpers.core.timing.Timing`, and the clocks' rows, measured or recorded."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ...core import agreement, evidence
from ...core.device import resolve_device
from ...core.evidence import Evidence
from ...core.results import Record, ResultSet
from ...core.timing import Timing, cuda_event_time, measure, time_calls
from ...core.validate import check_choice, check_float, check_int, wrap
from ...pipeline.transfer import check_host_bytes

#: Time budgets (s) of the panel's run and of a clocks cell (full sizes on a CPU): repeats are cut to fit.
DEMO_MAX_SECONDS = 60.0
SYNC_DEMO_MAX_SECONDS = 120.0

OPERATIONS: dict[str, str] = {
    "matmul": "n x n float32 matrix product",
    "add": "element-wise add of two float32 vectors of n*n elements",
    "copy": "copy of a float32 tensor of n*n elements",
}


def make_op(op: str, n: int, device: torch.device | str) -> Callable[[], Any]:
    """A closure that runs ``op`` at size ``n`` on inputs on ``device`` (at most 1 GiB, and what free RAM allows)."""
    check_choice("op", op, OPERATIONS)
    n = check_int("n", n, 1, 16384)
    need = 3 * n * n * 4
    if need > (1 << 30):
        raise ValueError(f"n={n} needs {need / 2**30:.1f} GiB of inputs; choose n <= 9000 so inputs stay under 1 GiB")
    dev = resolve_device(device)
    check_host_bytes("n", need if dev.type == "cpu" else 2 * n * n * 4, what=f"{op} at n={n}")
    gen = torch.Generator(device="cpu").manual_seed(0)
    a, b = torch.randn(n, n, generator=gen).to(dev), torch.randn(n, n, generator=gen).to(dev)
    out = torch.empty_like(a)
    runs = {"matmul": lambda: torch.matmul(a, b, out=out), "add": lambda: torch.add(a, b, out=out)}
    return runs.get(op, lambda: out.copy_(a))


def estimate_call_s(op: str, n: int, device: torch.device | str, *, probe_s: float = 0.2) -> float:
    """One call's time at size ``n``, predicted from sizes 256, 512, ... (until one takes ``probe_s``) scaled by the
    work (``n**3`` for a matrix product, else ``n**2``); small sizes run less efficiently, so it errs slow."""
    n0 = min(n, 256)
    while True:
        best = time_calls(make_op(op, n0, device), repeats=3, warmup=1, device=device).min_s
        if best >= probe_s or n0 >= n:
            break
        n0 = min(n, 2 * n0)
    power = 3 if op == "matmul" else 2
    return best * (n / n0) ** power


def calls_within(
    op: str, n: int, device: torch.device | str, *, wanted: int, overhead: int, max_seconds: float, least: int = 3
) -> int:
    """Timed calls (at most ``wanted``) that fit in ``max_seconds`` with ``overhead`` untimed ones; ValueError naming
    the largest size that fits when not even ``least`` do."""
    max_seconds = check_float("max_seconds", max_seconds, 0.1, 3600.0)
    one = max(estimate_call_s(op, n, device), 1e-9)
    fit = int(max_seconds / one) - overhead
    if fit < least:
        power = 3 if op == "matmul" else 2
        largest = int(n * (max_seconds / ((least + overhead) * one)) ** (1 / power))
        raise ValueError(
            f"n={n}: one {op} call at this size takes about {one:.1f} s on {torch.device(device)}, so "
            f"{least + overhead} calls would need about {(least + overhead) * one:.0f} s, beyond the "
            f"{max_seconds:.0f} s budget (max_seconds); choose n <= {max(largest, 1)}"
        )
    return min(wanted, fit)


#: The warm-up verdict's rules (this workbook's choices): the gap is called warm-up only when the first call took at
#: least ``WARMUP_MIN_RATIO`` times the later calls' median, the later calls' IQR is at most ``WARMUP_MAX_SPREAD``
#: of their median, and (on a CPU) the thread ran on the CPU for at least ``WARMUP_MIN_ON_CPU`` of the first call.
WARMUP_MIN_RATIO = 3.0
WARMUP_MAX_SPREAD = 0.5
WARMUP_MIN_ON_CPU = 0.5
#: This thread's CPU time, where the system has a per-thread clock (Linux, macOS; Windows' is too coarse to use).
_THREAD_CLOCK: int | None = getattr(time, "CLOCK_THREAD_CPUTIME_ID", None)


def warmup_demo(device: torch.device | str, repeats: int = 15) -> Timing:
    """The first ``repeats`` calls of a fresh, small convolution, no warm-up: the first pays one-off costs (on a GPU,
    with the context already made: cuDNN's set-up and lazy module loading), not drowned by the work. Timed on one
    intra-op thread (``torch.set_num_threads(1)``, restored after), so a call never waits for a second thread that
    other programs hold. Wall clock per call, synchronised; on a CPU with a per-thread clock,
    ``metadata["cpu_times_s"]``: this thread's CPU time per call (time spent waiting adds nothing to it)."""
    check_int("repeats", repeats, 2, 10_000)
    dev = torch.device(device)
    torch.manual_seed(0)
    # 7 -> 10 channels at 20 px: a shape not used elsewhere, so nothing is cached from earlier cells.
    conv = torch.nn.Conv2d(7, 10, kernel_size=5, padding=2).to(dev)
    x = torch.randn(4, 7, 20, 20, device=dev)
    clock = _THREAD_CLOCK if dev.type == "cpu" else None
    cpus: list[float] = []

    def call() -> None:  # the kernel's time_calls times it; this adds the thread's CPU time (a CPU runs it inline)
        c0 = time.clock_gettime(clock) if clock is not None else 0.0
        conv(x)
        cpus.append(time.clock_gettime(clock) - c0 if clock is not None else 0.0)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.no_grad():
            warm = time_calls(call, repeats=repeats, warmup=0, device=dev, label="fresh conv2d, no warm-up")
    finally:
        torch.set_num_threads(threads)
    warm.metadata.update(method="wall clock per call, synchronised, one intra-op thread", num_threads=1)
    if clock is not None:
        warm.metadata["cpu_times_s"] = cpus
    return warm


@dataclass(frozen=True)
class WarmupVerdict:
    """What :func:`warmup_demo`'s calls say: ``reasons`` why warm-up cannot be told apart from the machine's load
    in this run (empty: the gap is warm-up), and the printed ``text``."""

    first_s: float
    later_median_s: float
    later_iqr_s: float
    ratio: float
    first_cpu_s: float | None
    reasons: tuple[str, ...]
    text: str

    @property
    def warm_up(self) -> bool:
        return not self.reasons

    def __str__(self) -> str:
        return self.text


def warmup_verdict(warm: Timing, *, width: int = 100) -> WarmupVerdict:
    """The verdict on :func:`warmup_demo`'s calls, from their own timings (the rules: ``WARMUP_*`` above)."""
    times = list(warm.times_s)
    if len(times) < 2:
        raise ValueError(f"warm must hold the first call and at least one later call, got {len(times)} call(s)")
    first, later = times[0], sorted(times[1:])
    median = statistics.median(later)
    q1, _, q3 = statistics.quantiles(later, n=4, method="inclusive") if len(later) > 1 else [median] * 3
    iqr = q3 - q1
    ratio = first / median if median > 0 else float("inf")
    spread = iqr / median if median > 0 else float("inf")
    cpus = warm.metadata.get("cpu_times_s")
    first_cpu = float(cpus[0]) if cpus else None
    on_cpu = min(1.0, first_cpu / first) if first_cpu is not None and first > 0 else None

    reasons = []
    if spread > WARMUP_MAX_SPREAD:
        reasons.append(
            f"the later calls scatter (their IQR is {spread:.0%} of their median; the rule allows "
            f"{WARMUP_MAX_SPREAD:.0%})"
        )
    if ratio < WARMUP_MIN_RATIO:
        reasons.append(f"the first call took only {ratio:.1f}x their median (the rule asks for {WARMUP_MIN_RATIO:g}x)")
    if on_cpu is not None and on_cpu < WARMUP_MIN_ON_CPU:
        reasons.append(
            f"the thread ran on the CPU for only {on_cpu:.0%} of the first call (the rule asks for "
            f"{WARMUP_MIN_ON_CPU:.0%}): for the rest it waited, for other programs or for the disk"
        )

    lines = [
        f"first call: {first * 1e3:.3f} ms · median of the later {len(later)} calls: {median * 1e3:.3f} ms "
        f"(IQR {iqr * 1e3:.3f} ms) · ratio {ratio:.1f}x"
    ]
    if first_cpu is not None:
        lines.append(
            f"first call's CPU time (one intra-op thread; waiting adds none): {first_cpu * 1e3:.3f} ms of its "
            f"{first * 1e3:.3f} ms"
        )
    if reasons:
        verdict = (
            "Verdict: cannot tell. In this run, warm-up cannot be told apart from the machine's load: "
            + "; ".join(reasons)
            + ". Re-run the cell, ideally while other programs are quiet."
        )
    else:
        verdict = (
            f"Verdict: warm-up. The first call took {ratio:.1f}x the later calls' median, and the later calls agree "
            f"with each other (IQR {spread:.0%} of their median)"
            + (f"; the thread ran on the CPU for {on_cpu:.0%} of the first call" if on_cpu is not None else "")
            + ". This run shows warm-up: the first call paid one-off costs that the later calls did not."
        )
    lines.append(wrap(verdict, width))
    return WarmupVerdict(first, median, iqr, ratio, first_cpu, tuple(reasons), "\n".join(lines))


def plot_warmup(warm: Timing, ax: Any = None) -> Any:
    """Time per call of :func:`warmup_demo` on a log scale, by call number (whole numbers), with this thread's CPU
    time per call when it was read."""
    from matplotlib.ticker import MaxNLocator  # optional/heavy: matplotlib

    from ...ui import plots  # optional/heavy: matplotlib

    ax = ax if ax is not None else plots.new_axes((7, 3))
    calls = range(1, warm.n + 1)
    ax.plot(calls, [t * 1e3 for t in warm.times_s], marker="o", label="wall clock")
    cpus = warm.metadata.get("cpu_times_s")
    if cpus:
        ax.plot(calls, [t * 1e3 for t in cpus], marker="x", linestyle="--", label="this thread's CPU time")
        ax.legend(fontsize=8)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("call number")
    ax.set_ylabel("time per call (ms, log scale)")
    ax.set_title(f"Fresh conv2d on {warm.metadata.get('device', '?')}, no warm-up, one thread (measured now)")
    ax.set_yscale("log")
    ax.grid(alpha=0.3)
    return ax


def sync_demo(
    device: torch.device | str, n: int = 2048, repeats: int = 10, *, max_seconds: float = SYNC_DEMO_MAX_SECONDS
) -> dict[str, Timing]:
    """A matrix product timed with and without synchronising: on a GPU ``"no sync"`` times only the *queueing*."""
    dev = torch.device(device)
    check_int("repeats", repeats, 1, 100_000)
    repeats = calls_within("matmul", n, dev, wanted=2 * repeats, overhead=3, max_seconds=max_seconds, least=6) // 2
    fn = make_op("matmul", n, dev)
    fn()  # warm up
    return {
        "no sync": time_calls(fn, repeats=repeats, device=dev, sync=False, warmup=1, label=f"matmul {n}, no sync"),
        "sync": time_calls(fn, repeats=repeats, device=dev, sync=True, warmup=1, label=f"matmul {n}, synchronised"),
    }


def sync_verdict(no_sync: Timing, sync: Timing, *, width: int = 100) -> str:
    """On a CPU, whether :func:`sync_demo`'s two timings (the same work) agree: their quartiles overlap."""
    (a_lo, a_hi), (b_lo, b_hi) = no_sync.quartiles_s, sync.quartiles_s
    a_ms, b_ms = no_sync.median_s * 1e3, sync.median_s * 1e3
    pair = f"no sync {a_ms:.3f} ms (timed first) and sync {b_ms:.3f} ms (timed second)"
    spread = f"quartiles {a_lo * 1e3:.3f}-{a_hi * 1e3:.3f} and {b_lo * 1e3:.3f}-{b_hi * 1e3:.3f} ms"
    head = "On the CPU, operations are synchronous, so both clocks timed the same work:"
    if agreement.spreads_overlap(no_sync.quartiles_s, sync.quartiles_s):
        text = f"{head} {pair} agree within their spread ({spread} overlap). The gap is noise."
    else:
        which = "sync, timed second" if b_ms <= a_ms else "no sync, timed first"
        text = (
            f"{head} {pair} do NOT agree within their spread ({spread} do not overlap). Same work, so the gap "
            f"is warm-up or load on this machine, not the clock: trust the faster, {which}, "
            f"{min(a_ms, b_ms):.3f} ms (load and warm-up only ever add time), or re-run the cell."
        )
    return wrap(text, width)


def events_vs_wall(
    device: torch.device | str, n: int = 2048, repeats: int = 10, *, max_seconds: float = SYNC_DEMO_MAX_SECONDS
) -> dict[str, Timing] | None:
    """CUDA-event time vs synchronised wall time of a matrix product; ``None`` without CUDA."""
    dev = torch.device(device)
    if dev.type != "cuda" or not torch.cuda.is_available():
        return None
    check_int("repeats", repeats, 1, 100_000)
    repeats = calls_within("matmul", n, dev, wanted=2 * repeats, overhead=4, max_seconds=max_seconds, least=6) // 2
    fn = make_op("matmul", n, dev)
    return {
        "CUDA events": cuda_event_time(fn, repeats=repeats, warmup=2, device=dev, label=f"matmul {n}, events"),
        "wall clock + sync": time_calls(
            fn, repeats=repeats, device=dev, sync=True, warmup=2, label=f"matmul {n}, wall"
        ),
    }


def time_op(
    op: str, n: int, device: torch.device | str, min_run_time: float = 0.2, *, max_seconds: float = DEMO_MAX_SECONDS
) -> Timing:
    """Median/IQR timing of ``op`` at size ``n`` (the panel's run): 15 blocks, cut (to 3) to fit ``max_seconds``."""
    check_float("min_run_time", min_run_time, 0.01, 60.0)
    check_float("max_seconds", max_seconds, 0.1, 3600.0)
    if min_run_time > max_seconds:
        raise ValueError(f"min_run_time must not exceed max_seconds ({max_seconds:g} s), got {min_run_time:g}")
    check_choice("op", op, OPERATIONS)
    check_int("n", n, 1, 16384)
    blocks = calls_within(op, n, device, wanted=15, overhead=3, max_seconds=max_seconds)
    fn = make_op(op, n, device)
    return measure(fn, label=f"{op} n={n}", device=device, min_run_time=min_run_time, blocks=blocks)


@dataclass(frozen=True)
class ClockTiming:
    """One ``n x n`` matrix product timed by one clock; ``iqr_s``: None when a record has no spread."""

    clock: str
    n: int
    median_s: float
    iqr_s: float | None = None


def clock_timings(timings: dict[str, Timing] | None, n: int) -> list[ClockTiming]:
    """The rows of :func:`sync_demo`'s or :func:`events_vs_wall`'s result."""
    return [ClockTiming(clock, n, t.median_s, t.iqr_s) for clock, t in (timings or {}).items()]


def clock_timings_from_records(rs: ResultSet, records: list[Record]) -> list[ClockTiming] | None:
    """``ch00.matmul_time_s`` records made on a GPU as rows; else None."""
    if not rs.hardware.get("gpu_name"):
        return None
    rows = [
        ClockTiming(str(r.params.get("clock")), int(r.params.get("n", 0)), r.value, (r.spread or {}).get("iqr"))
        for r in records
    ]
    return rows or None


def clock_table(rows: list[ClockTiming]) -> list[str]:
    return [
        f"{r.clock:>18}, n={r.n}: median {r.median_s * 1e3:.3f} ms"
        + (f" (IQR {r.iqr_s * 1e3:.3f} ms)" if r.iqr_s is not None else "")
        for r in rows
    ]


#: Section 4's two clocks, as :func:`events_vs_wall` names them (and ``ch00.benchmark`` records them).
EVENT_CLOCKS = ("CUDA events", "wall clock + sync")
#: Why section 4 shows no published figure: the ones of ``ch00.matmul_time_s`` compare sync with no sync.
NO_PUBLISHED_EVENTS = (
    "No published figure of this comparison is shown: the published figures in section 2 time a matmul on the "
    "host clock, with and without synchronising, and none of them uses CUDA events."
)


def event_rows_from_records(rs: ResultSet, records: list[Record]) -> list[ClockTiming] | None:
    """Section 4's rows (both clocks of :data:`EVENT_CLOCKS`) from ``ch00.matmul_time_s`` records made on a GPU;
    None when the file holds no CUDA-event timing."""
    rows = clock_timings_from_records(rs, [r for r in records if r.params.get("clock") in EVENT_CLOCKS])
    return rows if rows and any(r.clock == EVENT_CLOCKS[0] for r in rows) else None


def clocks_evidence(device: torch.device | str, n: int, repeats: int) -> Evidence[list[ClockTiming]]:
    """CUDA events vs a synchronised wall clock for an ``n x n`` matmul: measured here with CUDA; else a GPU's
    recording of both clocks; else missing, and it says that no published figure of it is shown (section 2's
    published figures compare sync with no sync, which says nothing about CUDA events)."""
    return evidence.measure_or_recall(
        "CUDA events vs wall clock", device, lambda: clock_timings(events_vs_wall(device, n=n, repeats=repeats), n),
        key="ch00.matmul_time_s", convert=event_rows_from_records, no_published=NO_PUBLISHED_EVENTS,
        method="CUDA events and a synchronised wall clock, median",
    )  # fmt: skip
