"""Chapter 00's measurement-hygiene experiments (warm-up, synchronisation, CUDA events, the panel's operation),
each a small real one returning :class:`~helpers.core.timing.Timing`, and the clocks' rows, measured or recorded."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from ...core import agreement
from ...core.device import resolve_device
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


def warmup_demo(device: torch.device | str, repeats: int = 15) -> Timing:
    """The first ``repeats`` calls of a fresh, small convolution, no warm-up: the first pays one-off costs (on a GPU,
    with the context already made: cuDNN's set-up and lazy module loading), not drowned by the work."""
    check_int("repeats", repeats, 2, 10_000)
    dev = torch.device(device)
    torch.manual_seed(0)
    # 7 -> 10 channels at 20 px: a shape not used elsewhere, so nothing is cached from earlier cells.
    conv = torch.nn.Conv2d(7, 10, kernel_size=5, padding=2).to(dev)
    x = torch.randn(4, 7, 20, 20, device=dev)
    with torch.no_grad():
        return time_calls(lambda: conv(x), repeats=repeats, warmup=0, device=dev, label="fresh conv2d, no warm-up")


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
