"""Chapter 00's measurement-hygiene experiments, as functions.

Each function runs one small, real experiment and returns
:class:`helpers.core.timing.Timing` objects, so the notebook only shows the
shape of the experiment and the result:

* :func:`warmup_demo` — the first calls of a fresh operation are slower.
* :func:`sync_demo` — timing GPU work without synchronising measures the
  launch, not the work; :func:`sync_verdict` says, on a CPU, whether its two timings agree.
* :func:`events_vs_wall` — CUDA events vs a synchronised wall clock.
* :func:`time_op` — the operation the live panel times.
* :func:`clock_timings` / :func:`clock_timings_from_records` / :func:`clock_table` — one
  matrix product timed by several clocks, measured here or read from reference records
  (``ch00.matmul_time_s``), and its printed form.

Chapter 00's panel and its headless benchmark are in :mod:`helpers.chapters.ch00`.
"""

from __future__ import annotations

import textwrap
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ...core import agreement
from ...core.device import resolve_device
from ...core.results import Record, ResultSet
from ...core.timing import Timing, cuda_event_time, measure, synchronize, time_calls
from ...core.validate import check_choice, check_float, check_int
from ...pipeline.transfer import check_host_bytes

__all__ = [
    "OPERATIONS",
    "DEMO_MAX_SECONDS",
    "SYNC_DEMO_MAX_SECONDS",
    "make_op",
    "estimate_call_s",
    "calls_within",
    "warmup_demo",
    "sync_demo",
    "sync_verdict",
    "events_vs_wall",
    "time_op",
    "ClockTiming",
    "clock_timings",
    "clock_timings_from_records",
    "clock_table",
]

DEMO_MAX_SECONDS = 60.0
"""Default time budget of one :func:`time_op` (the panel's run): blocks are cut to fit it, and a
size too big even for three is refused with a ValueError that names the largest size that fits."""
SYNC_DEMO_MAX_SECONDS = 120.0
"""Default time budget of :func:`sync_demo` and :func:`events_vs_wall` (a chapter cell, which
may run the full sizes on a CPU when ``WORKBOOK_FULL=1`` asks for them): repeats are cut to fit."""

#: Operations the live panel offers, with what their size means.
OPERATIONS: dict[str, str] = {
    "matmul": "n x n float32 matrix product",
    "add": "element-wise add of two float32 vectors of n*n elements",
    "copy": "copy of a float32 tensor of n*n elements",
}


def make_op(op: str, n: int, device: torch.device | str) -> Callable[[], Any]:
    """Allocate inputs for ``op`` at size ``n`` on ``device`` and return a closure that runs it.

    Raises:
        ValueError: unknown op, or a size whose inputs would not fit (limit: 1 GiB of inputs,
            and half the RAM available now).
    """
    check_choice("op", op, OPERATIONS)
    n = check_int("n", n, 1, 16384)
    need = 3 * n * n * 4
    if need > (1 << 30):
        raise ValueError(f"n={n} needs {need / 2**30:.1f} GiB of inputs; choose n <= 9000 so inputs stay under 1 GiB")
    dev = resolve_device(device)
    check_host_bytes("n", need if dev.type == "cpu" else 2 * n * n * 4, what=f"{op} at n={n}")
    gen = torch.Generator(device="cpu").manual_seed(0)
    a = torch.randn(n, n, generator=gen).to(dev)
    b = torch.randn(n, n, generator=gen).to(dev)
    out = torch.empty_like(a)
    if op == "matmul":
        return lambda: torch.matmul(a, b, out=out)
    if op == "add":
        return lambda: torch.add(a, b, out=out)
    return lambda: out.copy_(a)


def estimate_call_s(op: str, n: int, device: torch.device | str, *, probe_s: float = 0.2) -> float:
    """Predict the time of one call of ``op`` at size ``n`` from short calibration runs.

    Times the op (best of three synchronised calls, after one warm-up) at 256, 512, ...
    until one call takes ``probe_s`` or the size reaches ``n``, then scales by the work:
    ``n**3`` for a matrix product, ``n**2`` for the element-wise ops. Small sizes run less
    efficiently than large ones (and a busy machine slows them most), so this errs on the
    slow side.
    """
    n = check_int("n", n, 1, 16384)
    n0 = min(n, 256)
    while True:
        fn = make_op(op, n0, device)
        fn()
        synchronize(device)
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            fn()
            synchronize(device)
            best = min(best, time.perf_counter() - t0)
        del fn
        if best >= probe_s or n0 >= n:
            break
        n0 = min(n, 2 * n0)
    power = 3 if op == "matmul" else 2
    return best * (n / n0) ** power


def calls_within(
    op: str, n: int, device: torch.device | str, *, wanted: int, overhead: int, max_seconds: float, least: int = 3
) -> int:
    """How many timed calls (at most ``wanted``) of ``op`` fit in ``max_seconds``, with ``overhead`` untimed calls.

    Raises:
        ValueError: even ``least`` calls would take longer than ``max_seconds``; the message
            names the largest size that fits.
    """
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


def warmup_demo(device: torch.device | str, repeats: int = 15, channels: int = 7, size: int = 20) -> Timing:
    """Time the first ``repeats`` calls of a freshly built convolution, with no warm-up.

    The first call pays one-off costs: memory allocation, kernel selection and
    library initialisation. On a GPU the CUDA context already exists by then
    (the inputs were created on the device before the clock starts), so what the
    first call pays there is cuDNN's set-up (its handle and the choice of a
    convolution algorithm) and lazy module loading: CUDA loads a kernel's code
    only when it is first launched (``CUDA_MODULE_LOADING=LAZY``, the default on
    Linux since CUDA 12.2). Later calls pay none of it. ``times_s[0]`` is the
    first call. The default problem is small on purpose, so the one-off cost is
    not drowned by the work itself.
    """
    check_int("repeats", repeats, 2, 10_000)
    check_int("channels", channels, 1, 1024)
    check_int("size", size, 8, 1024)
    dev = torch.device(device)
    torch.manual_seed(0)
    # A channel count and size not used elsewhere, so nothing is cached from earlier cells.
    conv = torch.nn.Conv2d(channels, channels + 3, kernel_size=5, padding=2).to(dev)
    x = torch.randn(4, channels, size, size, device=dev)
    with torch.no_grad():
        return time_calls(lambda: conv(x), repeats=repeats, warmup=0, device=dev, label="fresh conv2d, no warm-up")


def sync_demo(
    device: torch.device | str, n: int = 2048, repeats: int = 10, *, max_seconds: float = SYNC_DEMO_MAX_SECONDS
) -> dict[str, Timing]:
    """Time the same matrix product with and without synchronising before reading the clock.

    On a GPU, ``"no sync"`` measures only how long the CPU takes to *queue*
    the kernel; on a CPU both time the same work, because CPU operations are synchronous
    (:func:`sync_verdict` says whether the two agree within their spread).
    ``repeats`` is cut (to at least 3 each) so the demo fits ``max_seconds``; each
    result's ``n`` says how many calls were timed.
    """
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
    """On a CPU, whether :func:`sync_demo`'s two timings agree within their spread, and which to trust if not.

    CPU operations are synchronous, so both clocks time the same work: they agree when their
    interquartile ranges (:attr:`Timing.quartiles_s`) overlap
    (:func:`helpers.core.agreement.spreads_overlap`), and the gap between the medians is noise. When
    they do not overlap, the gap is still not the clock's (the same work was timed): it is warm-up or
    load on this machine, and the faster timing is the one to trust, since load and warm-up only ever
    add time. ``no_sync`` was timed first. The sentence is wrapped at ``width`` characters.
    """
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
    return textwrap.fill(text, width, break_long_words=False, break_on_hyphens=False)


def events_vs_wall(
    device: torch.device | str, n: int = 2048, repeats: int = 10, *, max_seconds: float = SYNC_DEMO_MAX_SECONDS
) -> dict[str, Timing] | None:
    """CUDA-event time vs synchronised wall time of a matrix product; ``None`` without CUDA.

    ``repeats`` is cut (to at least 3 each) so the demo fits ``max_seconds``.
    """
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
    """Median/IQR timing of ``op`` at size ``n`` (what the chapter-00 panel runs).

    ``measure`` times 15 blocks of at least one call each; for a slow op the number of
    blocks is cut (to at least 3) so the whole timing fits ``max_seconds``, and a size
    too slow even for that is refused with a ValueError naming the largest size that fits.
    """
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
    """One matrix product timed by one clock (a row of :func:`clock_table`).

    Attributes:
        clock: ``"no sync"``, ``"sync"`` (:func:`sync_demo`), ``"CUDA events"`` or ``"wall clock + sync"``
            (:func:`events_vs_wall`).
        n: the size of the ``n x n`` product.
        median_s: the median time of one call, in seconds.
        iqr_s: its inter-quartile range, in seconds (None when the record has no spread).
    """

    clock: str
    n: int
    median_s: float
    iqr_s: float | None = None


def clock_timings(timings: dict[str, Timing] | None, n: int) -> list[ClockTiming]:
    """The rows of :func:`sync_demo`'s or :func:`events_vs_wall`'s result at size ``n`` (none for None)."""
    return [ClockTiming(clock, n, t.median_s, t.iqr_s) for clock, t in (timings or {}).items()]


def clock_timings_from_records(rs: ResultSet, records: list[Record]) -> list[ClockTiming] | None:
    """Reference records of ``ch00.matmul_time_s`` as rows (a ``convert`` for :mod:`helpers.core.evidence`).

    Only a result set recorded on a CUDA GPU counts (on a CPU the clocks agree: that is no reference
    for GPU timings); None otherwise, which :func:`helpers.core.evidence.recorded` reads as missing.
    """
    if not rs.hardware.get("gpu_name"):
        return None
    rows = []
    for r in records:
        spread = r.spread or {}
        iqr = spread.get("iqr")
        rows.append(ClockTiming(str(r.params.get("clock")), int(r.params.get("n", 0)), r.value, iqr))
    return rows or None


def clock_table(rows: list[ClockTiming]) -> list[str]:
    """One line per row: clock, size, median and IQR in milliseconds."""
    out = []
    for r in rows:
        iqr = f" (IQR {r.iqr_s * 1e3:.3f} ms)" if r.iqr_s is not None else ""
        out.append(f"{r.clock:>18}, n={r.n}: median {r.median_s * 1e3:.3f} ms{iqr}")
    return out
