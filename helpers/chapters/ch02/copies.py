"""Chapter 02's copies: pageable against pinned host memory, measured across sizes.

- Pure logic (unit-tested on CPU): the size grid, the ``time = latency + bytes / bandwidth`` fit, the pinned
  allocator's power-of-two block, the safe pin limit, the "pinning is 30-50% faster" claim.
- :func:`sweep`: the one copy loop. It calls a :data:`CopyFn` (the reader's ``time_copy``, or the helper's own
  CUDA-event copy for :func:`transfer_sweep` and :func:`measure_copy`) for every size and memory kind, in
  alternating rounds (:func:`helpers.core.rounds.alternate`). Without CUDA it asks only for pageable copies,
  which ``time_copy`` times as a host memcpy (labelled so).
- :func:`measure_host_copy`: a host-to-host ``copy_``, the CPU-side reference point, real on any machine.
- Records (``ch02.*``) back into results: :func:`sweeps_from_records`, :func:`wire_from_records`; plots.

Measurements that need CUDA return :class:`~helpers.pipeline.transfer.Unavailable` without it, never raise.
Units: bytes (KiB, MiB when printed), seconds, GB/s = 1e9 bytes per second (the unit link specifications use).
"""

from __future__ import annotations

import contextlib
import math
import statistics
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable, Sequence

import numpy as np
import torch

from ...core.config import require_gpu, sized
from ...core.device import intraop_threads, resolve_device
from ...core.progress import ProgressFn
from ...core.rounds import alternate
from ...core.timing import measure, summarize
from ...core.validate import check_choice, check_float, check_int, human_bytes, human_seconds
from ...pipeline.transfer import DTYPES, Unavailable, _memory_now, check_host_bytes, cuda_status, images_nbytes

if TYPE_CHECKING:  # pragma: no cover
    from matplotlib.figure import Figure

KiB = 1024
MiB = 1024**2
GiB = 1024**3

DIRECTIONS = ("h2d", "d2h")
MEMORY_KINDS = ("pageable", "pinned")
DEFAULT_PIN_SHARE = 0.25
"""Largest share of the machine's *available* RAM the helpers agree to pin."""
CLAIM_RANGE = (1.3, 1.5)
"""The seeds' claim, "pinning makes transfers 30-50% faster", as a pageable/pinned time ratio."""
_MAX_BYTES = 64 * GiB
_DIRECTION_NAMES = {"h2d": "host→device", "d2h": "device→host", "h2h": "host→host"}

CopyFn = Callable[..., Any]
"""``copy_fn(src, device, pinned, repeats)`` -> seconds of each timed copy (a list), or one number.

The chapter's ``time_copy`` cell is one: warm-up, CUDA events, ``src.pin_memory()`` once when
``pinned``, ``.to(device, non_blocking=True)``; on a CPU device it times a host memcpy instead.
"""


@dataclass
class TransferPoint:
    """One copy size: median and IQR of the time of one copy. ``direction``: ``"h2d"``, ``"d2h"`` or ``"h2h"``
    (host memcpy, the CPU-only reference point); ``memory``: the host side's kind."""

    nbytes: int
    direction: str
    memory: str
    median_s: float
    iqr_s: float = 0.0
    n: int = 1
    dtype: str = "uint8"
    method: str = ""

    @property
    def gbps(self) -> float:
        """Achieved bandwidth in GB/s (1e9 bytes per second)."""
        return self.nbytes / self.median_s / 1e9 if self.median_s > 0 else float("nan")

    def __str__(self) -> str:
        return (
            f"{_DIRECTION_NAMES.get(self.direction, self.direction)} {self.memory} {self.dtype} "
            f"{human_bytes(self.nbytes)}: {human_seconds(self.median_s)} (IQR {human_seconds(self.iqr_s)}, "
            f"{self.gbps:.2f} GB/s)"
        )


@dataclass(frozen=True)
class LatencyBandwidthFit:
    """``time = latency_s + nbytes / bandwidth_Bps``, fitted to a sweep. ``max_rel_error``: the worst relative
    misfit over the points; ``latency_clamped``: the free fit's latency was negative, so it was fixed at 0."""

    latency_s: float
    bandwidth_Bps: float
    n_points: int
    max_rel_error: float
    latency_clamped: bool = False

    @property
    def gbps(self) -> float:
        return self.bandwidth_Bps / 1e9

    def predict_s(self, nbytes: float) -> float:
        """Predicted time of one copy of ``nbytes`` bytes, seconds."""
        return self.latency_s + float(nbytes) / self.bandwidth_Bps

    def half_bandwidth_bytes(self) -> float:
        """Copy size at which half the asymptotic bandwidth is reached (latency x bandwidth)."""
        return self.latency_s * self.bandwidth_Bps

    def __str__(self) -> str:
        note = " (latency clamped at 0)" if self.latency_clamped else ""
        return (
            f"latency {human_seconds(self.latency_s)}, bandwidth {self.gbps:.2f} GB/s{note}; "
            f"worst misfit {self.max_rel_error:.0%} over {self.n_points} sizes"
        )


@dataclass
class Sweep:
    """Copy times across sizes for one (direction, memory kind) pair; ``source``: ``"measured here"`` or
    the reference it was recorded in."""

    direction: str
    memory: str
    points: list[TransferPoint]
    source: str = "measured here"
    device: str = ""
    method: str = ""

    @property
    def label(self) -> str:
        """Legend label, e.g. ``'H2D pinned'``."""
        if self.direction == "h2h":
            return "host memcpy (CPU→CPU, not a GPU copy)"
        return f"{self.direction.upper()} {self.memory}"

    def sizes(self) -> list[int]:
        return [p.nbytes for p in self.points]

    def times(self) -> list[float]:
        return [p.median_s for p in self.points]

    def gbps(self) -> list[float]:
        return [p.gbps for p in self.points]

    def fit(self) -> LatencyBandwidthFit:
        return fit_latency_bandwidth(self.sizes(), self.times())


def size_grid(lo: int = 4 * KiB, hi: int = 256 * MiB, factor: int = 2) -> list[int]:
    """Geometric grid of byte sizes ``lo, lo*factor, ...`` up to and including ``hi``.

    >>> size_grid(4 * KiB, 64 * KiB, 4)
    [4096, 16384, 65536]
    """
    lo = check_int("lo", lo, 1, _MAX_BYTES)
    hi = check_int("hi", hi, lo, _MAX_BYTES)
    factor = check_int("factor", factor, 2, 1024)
    sizes = [lo]
    while sizes[-1] * factor <= hi:
        sizes.append(sizes[-1] * factor)
    return sizes


def copy_sizes() -> list[int]:
    """Bytes per copy of the chapter's sweep: 4 KiB..16 MiB (x4) in quick mode, 4 KiB..256 MiB (x2) in full mode."""
    return sized(quick=size_grid(4 * KiB, 16 * MiB, 4), full=size_grid(4 * KiB, 256 * MiB, 2))


def _as_positive_array(name: str, values: Iterable[float]) -> np.ndarray:
    arr = np.asarray(list(values), dtype=float)
    if arr.ndim != 1 or arr.size == 0:
        raise ValueError(f"{name} must be a non-empty list of numbers")
    if not np.all(np.isfinite(arr)) or np.any(arr <= 0):
        raise ValueError(f"{name} must hold finite numbers > 0, got {arr.tolist()}")
    return arr


def fit_latency_bandwidth(nbytes: Sequence[float], seconds: Sequence[float]) -> LatencyBandwidthFit:
    """Least-squares fit of ``seconds = latency + nbytes / bandwidth``.

    Times across a sweep span four or five orders of magnitude, so an ordinary least-squares fit would be
    decided by the largest copies alone. We minimise the *relative* error, ``sum(((latency + nbytes * k) / t
    - 1) ** 2)`` with ``k = 1 / bandwidth``, which weights every size equally and is still linear. A negative
    best latency (noise at small sizes) is refitted at zero (``latency_clamped``).

    Raises:
        ValueError: fewer than two distinct sizes, lengths differ, values not positive, or times that do
            not grow with size (no bandwidth to fit).
    """
    x = _as_positive_array("nbytes", nbytes)
    t = _as_positive_array("seconds", seconds)
    if x.size != t.size:
        raise ValueError(f"nbytes and seconds must have the same length, got {x.size} and {t.size}")
    if np.unique(x).size < 2:
        raise ValueError("fit_latency_bandwidth needs at least two distinct sizes")
    (latency, k), *_ = np.linalg.lstsq(np.column_stack([1.0 / t, x / t]), np.ones_like(t), rcond=None)
    clamped = bool(latency < 0)
    if clamped:
        u = x / t
        latency, k = 0.0, float(u.sum() / (u * u).sum())
    if not k > 0:
        raise ValueError(
            "times do not grow with size, so no bandwidth can be fitted; "
            "check that the sweep covers sizes large enough for the copy to dominate"
        )
    worst = float(np.max(np.abs((latency + x * k) / t - 1.0)))
    return LatencyBandwidthFit(float(latency), float(1.0 / k), int(x.size), worst, clamped)


def predict_pinned_block(nbytes: int) -> int:
    """Bytes the caching host allocator reserves for a pinned request of ``nbytes``.

    PyTorch's ``CachingHostAllocator`` rounds every request up to the next power of two before calling
    ``cudaHostAlloc``, so a 300 MiB pin takes a 512 MiB block. Requests above ``pinned_max_round_threshold_mb``
    (or ``pinned_max_cached_size_mb``), set in ``PYTORCH_ALLOC_CONF`` (``PYTORCH_CUDA_ALLOC_CONF`` is still
    read), keep their exact size; both are unlimited by default, which is what this prediction assumes.

    >>> predict_pinned_block(300 * MiB) // MiB
    512
    """
    nbytes = check_int("nbytes", nbytes, 0)
    return nbytes if nbytes <= 1 else 1 << (nbytes - 1).bit_length()


def safe_pin_limit(
    share: float = DEFAULT_PIN_SHARE, *, total_bytes: int | None = None, available_bytes: int | None = None
) -> int:
    """Most bytes the helpers agree to pin: ``share`` of the smaller of total and available RAM (default: psutil's
    figures now). Pinned memory can never be swapped out, so pinning too much starves the OS and can hang it."""
    share = check_float("share", share, 0.001, 0.9)
    total, avail = _memory_now() if total_bytes is None or available_bytes is None else (0, 0)
    total_bytes = check_int("total_bytes", total if total_bytes is None else total_bytes, 1)
    available_bytes = check_int("available_bytes", avail if available_bytes is None else available_bytes, 0)
    return int(share * min(total_bytes, available_bytes))


def check_pin_size(
    nbytes: int,
    *,
    share: float = DEFAULT_PIN_SHARE,
    already_pinned: int = 0,
    total_bytes: int | None = None,
    available_bytes: int | None = None,
) -> int:
    """The block a pin of ``nbytes`` takes (:func:`predict_pinned_block`); ValueError (what to do instead) when
    that block plus ``already_pinned`` is over :func:`safe_pin_limit`."""
    nbytes = check_int("nbytes", nbytes, 1)
    already_pinned = check_int("already_pinned", already_pinned, 0)
    block = predict_pinned_block(nbytes)
    limit = safe_pin_limit(share, total_bytes=total_bytes, available_bytes=available_bytes)
    if block + already_pinned > limit:
        held = f" on top of {human_bytes(already_pinned)} already pinned" if already_pinned else ""
        raise ValueError(
            f"nbytes: refusing to pin {human_bytes(nbytes)} (a {human_bytes(block)} block after "
            f"power-of-two rounding){held}: the safe limit is {human_bytes(limit)}, which is "
            f"{share:.0%} of this machine's free RAM. Pinned memory cannot be swapped out, so "
            "pinning too much starves the OS and other processes. Use a smaller buffer (pin one "
            "batch and reuse it for every batch), or pass a larger `share` if you know this "
            "machine can spare it."
        )
    return block


def _check_device_bytes(name: str, nbytes: int, dev: torch.device, what: str) -> None:
    """Refuse a GPU allocation larger than 80% of the device memory free now."""
    free, _ = torch.cuda.mem_get_info(dev)
    if nbytes > 0.8 * free:
        raise ValueError(
            f"{name}: {what} needs {human_bytes(nbytes)} of GPU memory, more than 80% of the "
            f"{human_bytes(free)} free on {dev} now. Choose a smaller size."
        )


def speedup_by_size(pageable: Sweep, pinned: Sweep) -> list[tuple[int, float]]:
    """``(nbytes, pageable_time / pinned_time)`` for every size both sweeps measured (1.3: 30 % faster)."""
    if pageable.direction != pinned.direction:
        raise ValueError(
            f"pageable and pinned must have the same direction, got {pageable.direction!r} and {pinned.direction!r}"
        )
    pinned_t = {p.nbytes: p.median_s for p in pinned.points}
    return [(p.nbytes, p.median_s / pinned_t[p.nbytes]) for p in pageable.points if p.nbytes in pinned_t]


def claim_verdict(ratio: float, lo: float = CLAIM_RANGE[0], hi: float = CLAIM_RANGE[1]) -> str:
    """A pageable/pinned time ratio against the claim "30-50 % faster": ``"below"``, ``"within"`` or ``"above"``."""
    return "below" if ratio < lo else "above" if ratio > hi else "within"


def pinning_status() -> tuple[bool, str]:
    """Try to pin one byte. ``(True, msg)`` if it works, ``(False, msg)`` with the driver's answer."""
    try:
        ok = bool(torch.empty(1, dtype=torch.uint8).pin_memory().is_pinned())
        return ok, "tensor.pin_memory() works here: the driver page-locked the buffer."
    except RuntimeError as exc:
        if require_gpu():  # a strict GPU run must see a pinning failure, not a fallback message
            raise
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return False, (
            f"tensor.pin_memory() failed here with: {first!r}. Page-locking is done by the NVIDIA "
            "driver (cudaHostAlloc / cudaHostRegister), so without a driver and a GPU nothing can "
            "be pinned, and pinned-copy numbers can only come from reference runs."
        )


def _numel(nbytes: int, dtype: str) -> int:
    item = torch.empty((), dtype=DTYPES[dtype]).element_size()
    if nbytes % item:
        raise ValueError(f"nbytes must be a multiple of {item} for dtype {dtype}, got {nbytes}")
    return nbytes // item


def measure_host_copy(
    nbytes: int,
    *,
    dtype: str = "uint8",
    min_run_time: float | None = None,
    num_threads: int = 1,
    max_seconds: float = 20.0,
) -> TransferPoint:
    """Time ``dst.copy_(src)`` between two pageable host tensors of ``nbytes``: a CPU memcpy, the work the driver
    does to stage a pageable buffer, **not** a host-to-GPU transfer (:func:`helpers.core.timing.measure`).

    One thread by default, as the driver stages a pageable copy (a multi-threaded copy on a busy 2-core machine
    mostly measures threads waiting for each other). Both buffers must fit in half the RAM available now; a slow
    copy gets fewer timed blocks (at least 3), so it takes about ``max_seconds`` at most.
    """
    nbytes = check_int("nbytes", nbytes, 1, _MAX_BYTES)
    dtype = check_choice("dtype", dtype, DTYPES)
    check_host_bytes("nbytes", 2 * nbytes, what=f"a host copy of {human_bytes(nbytes)} (source and destination)")
    run_time = sized(0.02, 0.1) if min_run_time is None else check_float("min_run_time", min_run_time, 1e-4, 60.0)
    max_seconds = check_float("max_seconds", max_seconds, 0.1, 3600.0)
    num_threads = check_int("num_threads", num_threads, 1, 1024)
    n = _numel(nbytes, dtype)
    src = torch.ones(n, dtype=DTYPES[dtype])
    dst = torch.zeros(n, dtype=DTYPES[dtype])  # pages touched now, not during timing
    try:
        t0 = time.perf_counter()
        dst.copy_(src)  # one untimed call, to size the measurement
        blocks = max(3, min(15, int(max_seconds / max(time.perf_counter() - t0, 1e-9)) - 4))
        # The lambda runs inside measure(), before the `del` in `finally` (which frees the buffers even when a
        # traceback keeps this frame alive); ruff's F821 counts the later `del` against it.
        timing = measure(
            lambda: dst.copy_(src),  # noqa: F821
            label=f"host copy {human_bytes(nbytes)}",
            device="cpu",
            min_run_time=run_time,
            warmup=2,
            blocks=blocks,
            num_threads=num_threads,
        )
    finally:
        del src, dst
    how = f"host tensor copy_ (CPU memcpy, {timing.metadata.get('num_threads')} thread(s)), "
    return TransferPoint(
        nbytes,
        "h2h",
        "pageable",
        timing.median_s,
        timing.iqr_s,
        timing.n,
        dtype,
        how + timing.metadata.get("method", ""),
    )


def host_copy_sweep(sizes: Sequence[int] | None = None, *, min_run_time: float | None = None) -> Sweep:
    """:func:`measure_host_copy` over ``sizes`` (default :func:`copy_sizes`)."""
    points = [measure_host_copy(n, min_run_time=min_run_time) for n in (copy_sizes() if sizes is None else sizes)]
    return Sweep("h2h", "pageable", points, "measured here (CPU memcpy)", "cpu", points[0].method if points else "")


def _event_times(
    dst: torch.Tensor, src: torch.Tensor, *, non_blocking: bool, repeats: int, warmup: int, stream: torch.cuda.Stream
) -> list[float]:
    """Per-copy GPU times (s) of ``dst.copy_(src)`` on ``stream``, each bracketed by CUDA events on that stream.

    For a pageable source the copy call itself blocks the host while the driver stages the data, and the end
    event is recorded after it returns, so the interval covers the staging too.
    """
    stream.wait_stream(torch.cuda.current_stream(stream.device))  # the buffers' fills are done
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            dst.copy_(src, non_blocking=non_blocking)
        stream.synchronize()
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
        for s, e in zip(starts, ends):
            s.record(stream)
            dst.copy_(src, non_blocking=non_blocking)
            e.record(stream)
    stream.synchronize()
    return [s.elapsed_time(e) / 1e3 for s, e in zip(starts, ends)]


def _helper_copy(direction: str, warmup: int) -> CopyFn:
    """The helper's own copy as a :data:`CopyFn` (CUDA only), in ``direction``.

    H2D: from ``src`` itself (pageable) or from a pinned copy of it made once; D2H: from a device copy of ``src``
    into a host buffer, pinned or pageable. Each call times ``repeats`` copies between the same two buffers on a
    side stream (:func:`_event_times`), after ``warmup`` untimed ones.
    """

    def helper_copy(src: torch.Tensor, device: torch.device, pinned: bool, repeats: int) -> list[float]:
        dst = buf = None
        try:
            if direction == "h2d":
                buf = src.pin_memory() if pinned else src
                dst = torch.zeros_like(src, device=device)
            else:
                buf = src.to(device)
                dst = torch.zeros(src.shape, dtype=src.dtype, pin_memory=pinned)
            stream = torch.cuda.Stream(device=device)
            return _event_times(dst, buf, non_blocking=pinned, repeats=repeats, warmup=warmup, stream=stream)
        finally:
            torch.cuda.synchronize(device)
            del dst, buf

    helper_copy.__name__ = f"helper_copy_{direction}"
    return helper_copy


def _gpu_name(dev: torch.device) -> str:
    try:
        return torch.cuda.get_device_name(dev)
    except Exception:  # pragma: no cover - only on odd drivers
        if require_gpu():
            raise
        return str(dev)


def _samples(copy_fn: CopyFn, result: Any) -> list[float]:
    """The seconds ``copy_fn`` returned, as a list of floats >= 0 (a clear ValueError otherwise)."""
    name = getattr(copy_fn, "__name__", "copy_fn")
    values = [result] if isinstance(result, (int, float)) and not isinstance(result, bool) else result
    try:
        out = [float(v) for v in values]
    except (TypeError, ValueError):
        raise ValueError(
            f"copy_fn: {name}(...) must return the seconds of each timed copy (a list of "
            f"numbers) or one number, got {result!r}"
        ) from None
    if not out or not all(math.isfinite(v) and v >= 0 for v in out):
        raise ValueError(f"copy_fn: {name}(...) returned {out!r}; expected one or more times in seconds, >= 0")
    return out


def _check_sweep_memory(sizes: list[int], kinds: tuple[str, ...], dev: torch.device, gpu: bool, share: float) -> None:
    """Refuse (one line) a sweep whose largest buffers would not fit: host RAM, the safe pin limit, GPU memory."""
    biggest = max(sizes)
    check_host_bytes("sizes", 2 * biggest, what=f"a source of {human_bytes(biggest)} and one copy of it")
    if gpu and "pinned" in kinds:
        check_pin_size(biggest, share=share)
    if gpu:
        _check_device_bytes("sizes", biggest, dev, f"a device copy of {human_bytes(biggest)}")


def sweep(
    copy_fn: CopyFn,
    sizes: Sequence[int] | None = None,
    *,
    device: torch.device | str | None = None,
    repeats: int | None = None,
    rounds: int = 2,
    pin_share: float = DEFAULT_PIN_SHARE,
    progress: ProgressFn | None = None,
    direction: str = "h2d",
    kinds: Sequence[str] = MEMORY_KINDS,
    method: str | None = None,
    dtype: str = "uint8",
) -> dict[tuple[str, str], Sweep]:
    """Time *your* copy function over ``sizes``: this helper only loops, alternates, records.

    Each round calls ``copy_fn(src, device, pinned, repeats)`` once per size and memory kind, ``src`` a host
    tensor of that many bytes of ``dtype`` (a slice of one buffer), pageable and pinned side by side, in
    alternating rounds (:func:`helpers.core.rounds.alternate`: the order flips every round, so a machine that
    drifts hurts both kinds alike); the seconds of all rounds are pooled (median, IQR).

    On a CUDA ``device``: each kind in ``kinds``, recorded as ``(direction, kind)``; ``direction`` is what
    ``copy_fn`` copies (``"h2d"``, the reader's ``time_copy``; ``"d2h"`` for :func:`transfer_sweep`). On any
    other device nothing can be pinned: only pageable copies, recorded as ``("h2h", "pageable")``, the host
    memcpy the chapter's ``time_copy`` times on a CPU. ``repeats``: timed copies per call (default 5 quick, 15
    full); ``method``: how the times were taken (default: "<copy_fn>(), yours: ...").

    Raises ValueError for bad arguments, a buffer beyond the safe pin limit or the RAM available, or a
    ``copy_fn`` that returns no times.
    """
    if not callable(copy_fn):
        raise ValueError(f"copy_fn must be a function copy_fn(src, device, pinned, repeats), got {copy_fn!r}")
    sizes = [check_int("sizes[i]", n, 1, _MAX_BYTES) for n in (copy_sizes() if sizes is None else sizes)]
    if not sizes:
        raise ValueError("sizes must hold at least one size in bytes")
    sizes = list(dict.fromkeys(sizes))
    reps = sized(5, 15) if repeats is None else check_int("repeats", repeats, 1, 10_000)
    dev = resolve_device(device)  # 'cuda' on a machine without one: a ValueError that says so
    ok, _ = cuda_status(dev)
    kinds, direction = (tuple(kinds), direction) if ok else (("pageable",), "h2h")  # no GPU: a host memcpy
    _check_sweep_memory(sizes, kinds, dev, ok, pin_share)
    item = torch.empty((), dtype=DTYPES[dtype]).element_size()
    samples: dict[tuple[str, int], list[float]] = {(m, n): [] for m in kinds for n in sizes}
    base = torch.ones(max(sizes) // item, dtype=DTYPES[dtype])  # every size is a slice of it

    def call(memory: str, n: int) -> Callable[[], float]:
        def once() -> float:
            got = _samples(copy_fn, copy_fn(base[: _numel(n, dtype)], dev, memory == "pinned", reps))  # noqa: F821
            samples[(memory, n)] += got
            return statistics.median(got)

        return once

    names = {n: human_bytes(n) for n in sizes}
    names = names if len(set(names.values())) == len(sizes) else {n: f"{n:,} B" for n in sizes}
    try:
        alternate({f"{names[n]} {m}": call(m, n) for n in sizes for m in kinds}, rounds, progress=progress)
    finally:
        del base
        if ok:
            torch.cuda.synchronize(dev)
            torch.cuda.empty_cache()  # device copies back to the driver; pinned blocks stay cached
    how = method or f"{getattr(copy_fn, '__name__', 'copy_fn')}(), yours: {rounds} alternating round(s) x {reps} " + (
        "timed copies, median" if ok else "timed copies, median; no CUDA device here, so a host memcpy, not a GPU copy"
    )
    source, where = ("measured here", _gpu_name(dev)) if ok else ("measured here (CPU memcpy)", "cpu")
    out = {}
    for m in kinds:
        pts = [summarize(f"{direction} {m} {human_bytes(n)}", samples[(m, n)]) for n in sizes]
        points = [TransferPoint(n, direction, m, t.median_s, t.iqr_s, t.n, dtype, how) for n, t in zip(sizes, pts)]
        out[(direction, m)] = Sweep(direction, m, points, source, where, how)
    return out


def transfer_sweep(
    direction: str,
    memory: str,
    sizes: Sequence[int] | None = None,
    *,
    device: torch.device | str | None = None,
    repeats: int | None = None,
    warmup: int = 3,
    pin_share: float = DEFAULT_PIN_SHARE,
    progress: ProgressFn | None = None,
    dtype: str = "uint8",
) -> Sweep | Unavailable:
    """One (direction, memory kind) curve over ``sizes`` (default :func:`copy_sizes`): :func:`sweep`'s loop (one
    round) with the helper's own copy (:func:`_helper_copy`: CUDA events on a side stream, buffers reused for
    every repeat, ``warmup`` untimed copies first), in either direction. :class:`Unavailable` without CUDA,
    checked before anything is allocated."""
    direction = check_choice("direction", direction, DIRECTIONS)
    memory = check_choice("memory", memory, MEMORY_KINDS)
    reps = sized(10, 30) if repeats is None else check_int("repeats", repeats, 1, 10_000)
    warmup = check_int("warmup", warmup, 0, 1_000)
    ok, reason = cuda_status(device)
    if not ok:
        return Unavailable(f"{direction.upper()} {memory} copies", reason)
    how = f"CUDA events on a side stream, {warmup} warm-up copies, median of {reps}"
    curves = sweep(
        _helper_copy(direction, warmup),
        sizes,
        device=resolve_device(device),
        repeats=reps,
        rounds=1,
        pin_share=pin_share,
        progress=progress,
        direction=direction,
        kinds=(memory,),
        method=how,
        dtype=dtype,
    )
    return curves[(direction, memory)]


def measure_copy(
    nbytes: int,
    direction: str = "h2d",
    memory: str = "pinned",
    *,
    dtype: str = "uint8",
    device: torch.device | str | None = None,
    repeats: int = 20,
    warmup: int = 3,
    pin_share: float = DEFAULT_PIN_SHARE,
) -> TransferPoint | Unavailable:
    """One host<->GPU copy size, timed as :func:`transfer_sweep` times each size (median of ``repeats``; pinned
    copies ``non_blocking=True``, pageable ones the default, as ``tensor.to('cuda')``). A freed pinned block stays
    in PyTorch's caching host allocator for the next pin of that size. :class:`Unavailable` without CUDA."""
    nbytes = check_int("nbytes", nbytes, 1, _MAX_BYTES)
    _numel(nbytes, check_choice("dtype", dtype, DTYPES))
    sw = transfer_sweep(
        direction, memory, [nbytes], device=device, repeats=repeats, warmup=warmup, pin_share=pin_share, dtype=dtype
    )
    return sw if isinstance(sw, Unavailable) else sw.points[0]


def measure_copy_fn(
    copy_fn: CopyFn,
    nbytes: int,
    memory: str = "pageable",
    *,
    dtype: str = "uint8",
    device: torch.device | str | None = None,
    repeats: int = 10,
    pin_share: float = DEFAULT_PIN_SHARE,
) -> TransferPoint:
    """One call of *your* copy function on ``nbytes`` of ``dtype``, as a point (:func:`sweep`, one size, one round).

    On a CUDA ``device`` an H2D copy (pinned when ``memory == "pinned"``); on any other device a pageable copy,
    which the chapter's ``time_copy`` times as a host memcpy, on one CPU thread (as the driver stages one).
    """
    memory = check_choice("memory", memory, MEMORY_KINDS)
    dtype = check_choice("dtype", dtype, DTYPES)
    nbytes = check_int("nbytes", nbytes, 1, _MAX_BYTES)
    _numel(nbytes, dtype)
    gpu, _ = cuda_status(device)
    with contextlib.nullcontext() if gpu else intraop_threads(1):
        curves = sweep(
            copy_fn,
            [nbytes],
            device=device,
            repeats=repeats,
            rounds=1,
            pin_share=pin_share,
            kinds=(memory,),
            dtype=dtype,
        )
    return next(iter(curves.values())).points[0]


@dataclass
class WireResult:
    """The same images as uint8 and as float32: bytes and copy time of each."""

    shape: tuple[int, int, int, int] | None  # None: rebuilt from records, which keep only the bytes
    nbytes: dict[str, int]
    seconds: dict[str, float]
    what: str
    method: str = ""

    @property
    def byte_ratio(self) -> float:
        return self.nbytes["float32"] / self.nbytes["uint8"]

    @property
    def time_ratio(self) -> float:
        return self.seconds["float32"] / self.seconds["uint8"]


def wire_comparison(
    batch: int = 64,
    channels: int = 3,
    height: int = 224,
    width: int = 224,
    *,
    device: torch.device | str | None = None,
    repeats: int = 10,
) -> WireResult:
    """Copy the same images as uint8 and as float32 and time both: pinned H2D copies (CUDA events) on a CUDA
    device; else a pageable host memcpy (real, but a CPU copy, and ``what`` says so)."""
    shape = (
        check_int("batch", batch, 1, 100_000),
        check_int("channels", channels, 1, 64),
        check_int("height", height, 1, 8192),
        check_int("width", width, 1, 8192),
    )
    nbytes = {d: images_nbytes(*shape, dtype=d) for d in DTYPES}
    if cuda_status(device)[0]:
        dev = resolve_device(device)
        points = {d: measure_copy(n, "h2d", "pinned", dtype=d, device=dev, repeats=repeats) for d, n in nbytes.items()}
        seconds = {d: p.median_s for d, p in points.items() if isinstance(p, TransferPoint)}
        return WireResult(shape, nbytes, seconds, f"pinned H2D copy on {_gpu_name(dev)}", "CUDA events, median")
    seconds = {d: measure_host_copy(n, dtype=d).median_s for d, n in nbytes.items()}
    what = "host memcpy on this CPU (no GPU here: not a GPU transfer)"
    return WireResult(shape, nbytes, seconds, what, "torch.utils.benchmark Timer, median")


# Each ``*_from_records(result_set, records)`` is a ``convert`` for helpers.core.evidence.recorded /
# measure_or_recall: it rebuilds what the measuring function returns from the records
# helpers.chapters.ch02.benchmark wrote, or None when the records cannot make one (then the figure is missing).


def _field(record: Any, name: str) -> Any:
    """A record's field, whether it is a :class:`helpers.core.results.Record` or a dict."""
    return record.get(name) if isinstance(record, dict) else getattr(record, name, None)


def _params(record: Any) -> dict[str, Any]:
    return dict(_field(record, "params") or {})


def sweeps_from_records(records: Iterable[Any], source: str = "reference") -> dict[tuple[str, str], Sweep]:
    """Rebuild sweeps from ``ch02.copy_time`` records (objects or dicts with key/value/params).

    Returns ``{(direction, memory): Sweep}``, sizes ascending; empty if there are none.
    """
    found: dict[tuple[str, str], list[TransferPoint]] = {}
    for r in records:
        if _field(r, "key") != "ch02.copy_time":
            continue
        params = _field(r, "params") or {}
        spread = _field(r, "spread") or {}
        d, m = params.get("direction"), params.get("memory")
        if d not in DIRECTIONS or m not in MEMORY_KINDS:
            continue
        found.setdefault((d, m), []).append(
            TransferPoint(
                nbytes=int(params["nbytes"]),
                direction=d,
                memory=m,
                median_s=float(_field(r, "value")),
                iqr_s=float(spread.get("iqr_s", 0.0)),
                n=int(spread.get("n", 1)),
                method="reference record",
            )
        )
    return {
        k: Sweep(direction=k[0], memory=k[1], points=sorted(v, key=lambda p: p.nbytes), source=source)
        for k, v in found.items()
    }


def wire_from_records(result_set: Any, records: Iterable[Any]) -> WireResult | None:
    """A :class:`WireResult` from ``ch02.wire_time`` records (uint8 and float32); None unless both are there."""
    nbytes: dict[str, int] = {}
    seconds: dict[str, float] = {}
    for r in records:
        d = _params(r).get("dtype")
        if _field(r, "key") == "ch02.wire_time" and d in DTYPES:
            nbytes[d], seconds[d] = int(_params(r).get("nbytes", 0)), float(_field(r, "value"))
    if set(nbytes) != set(DTYPES) or not all(nbytes.values()) or not all(seconds.values()):
        return None
    return WireResult(None, nbytes, seconds, what="pinned H2D copy", method="reference record")


def wire_lines(wire: WireResult) -> list[str]:
    """Bytes and copy time of each dtype, then the two ratios and what was copied."""
    lines = [f"{d:>8}: {wire.nbytes[d] / MiB:7.2f} MiB, {wire.seconds[d] * 1e3:7.3f} ms" for d in DTYPES]
    lines.append(f"bytes ratio {wire.byte_ratio:.0f}x, time ratio {wire.time_ratio:.1f}x — {wire.what}")
    return lines


def copy_paths_diagram() -> "Figure":
    """Draw the two paths a host-to-device copy can take (matplotlib figure).

    Top: pageable source. The CPU (driver) first copies it into a pinned staging
    ("bounce") buffer, then the GPU's copy engine pulls it by DMA over the link,
    chunk by chunk. Bottom: pinned source. The copy engine reads it directly.
    """
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

    fig, ax = plt.subplots(figsize=(9.5, 4.2))
    ax.set_xlim(0, 10)
    ax.set_ylim(0, 5.2)
    ax.axis("off")

    def box(x: float, y: float, w: float, text: str, color: str) -> None:
        ax.add_patch(FancyBboxPatch((x, y), w, 0.9, boxstyle="round,pad=0.05", fc=color, ec="black", lw=1))
        ax.text(x + w / 2, y + 0.45, text, ha="center", va="center", fontsize=9.5)

    def arrow(x0: float, x1: float, y: float, text: str) -> None:
        ax.add_patch(FancyArrowPatch((x0, y), (x1, y), arrowstyle="-|>", mutation_scale=16, lw=1.6))
        ax.text((x0 + x1) / 2, y + 0.18, text, ha="center", va="bottom", fontsize=8.5)

    # Region shading: host RAM vs GPU memory.
    ax.add_patch(FancyBboxPatch((0.1, 0.2), 6.2, 4.6, boxstyle="round,pad=0.02", fc="#f3f3f3", ec="#999999", lw=0.8))
    ax.add_patch(FancyBboxPatch((7.9, 0.2), 2.0, 4.6, boxstyle="round,pad=0.02", fc="#eef6ee", ec="#999999", lw=0.8))
    ax.text(3.2, 4.95, "host RAM (CPU side)", ha="center", fontsize=10, weight="bold")
    ax.text(8.9, 4.95, "GPU memory", ha="center", fontsize=10, weight="bold")
    ax.text(7.1, 4.95, "link (PCIe / NVLink)", ha="center", fontsize=8.5, style="italic")

    # Pageable path.
    ax.text(0.25, 4.35, "pageable source: two copies, and the CPU is busy for the first", fontsize=9, color="#a03000")
    box(0.3, 3.2, 2.1, "pageable buffer\n(may be swapped out)", "#ffd9c7")
    box(3.6, 3.2, 2.5, "driver's pinned\nstaging (bounce) buffer", "#c7dcff")
    box(8.1, 3.2, 1.6, "device\nbuffer", "#c9efc9")
    arrow(2.45, 3.55, 3.65, "CPU memcpy")
    arrow(6.15, 8.05, 3.65, "DMA by copy engine")

    # Pinned path.
    ax.text(0.25, 2.0, "pinned source: one DMA, the CPU is free (non_blocking=True)", fontsize=9, color="#005a00")
    box(0.3, 0.8, 2.1, "pinned buffer\n(page-locked)", "#c7dcff")
    box(8.1, 0.8, 1.6, "device\nbuffer", "#c9efc9")
    arrow(2.45, 8.05, 1.25, "DMA by copy engine: reads host RAM directly, at the link's speed")
    ax.text(
        5.0,
        0.35,
        "DMA needs physical addresses that cannot move: only page-locked memory qualifies.",
        ha="center",
        fontsize=8.5,
        style="italic",
    )
    fig.tight_layout()
    return fig


def _bytes_ticks(ax: Any, sizes: Sequence[float]) -> None:
    """Label a log x axis of byte sizes with 4 KiB, 16 KiB, ... 4 GiB ticks inside the data range."""
    if not sizes:
        return
    lo, hi = min(sizes) / 1.5, max(sizes) * 1.5
    shown = [4**k * KiB for k in range(1, 12) if lo <= 4**k * KiB <= hi] + ([4 * KiB] if lo <= 4 * KiB <= hi else [])
    shown = sorted(set(shown))
    if len(shown) > 6:
        shown = shown[::2]
    ax.set_xticks(shown)
    ax.set_xticklabels([human_bytes(v).replace(".0 ", " ") for v in shown])
    ax.minorticks_off() if len(shown) >= 2 else None


_SWEEP_STYLES: dict[str, dict[str, Any]] = {
    "H2D pageable": {"color": "#f28e2b", "linestyle": "-", "marker": "o"},
    "H2D pinned": {"color": "#f28e2b", "linestyle": "-", "marker": "s", "markerfacecolor": "white"},
    "D2H pageable": {"color": "#4e79a7", "linestyle": "-", "marker": "o"},
    "D2H pinned": {"color": "#4e79a7", "linestyle": "-", "marker": "s", "markerfacecolor": "white"},
}


def plot_sweeps(
    sweeps: Sequence[Sweep],
    ax: Any = None,
    *,
    ceiling: tuple[float, str] | None = None,
    source: str | None = None,
    title: str = "Copy bandwidth vs size",
    fits: bool = True,
    points: Sequence[tuple[TransferPoint, str]] = (),
) -> Any:
    """Bandwidth (GB/s) against copy size (bytes) on log-log axes, via :func:`helpers.ui.plots.sweep_plot`.

    Args:
        sweeps: curves to draw (measured here, or reference; say which with ``source``).
        ceiling: ``(GB/s, label)`` of the link's theoretical ceiling, drawn dashed.
        fits: also draw each curve's fitted ``latency + bytes / bandwidth`` model, dotted.
        points: extra single points ``(point, label)``, e.g. the live panel's runs, drawn as stars.
    """
    from ...ui import plots  # optional/heavy: matplotlib

    series: dict[str, tuple[Sequence[float], list[float]]] = {}
    styles: dict[str, dict[str, Any]] = {}
    for sw in sweeps:
        if not sw.points:
            continue
        series[sw.label] = (sw.sizes(), sw.gbps())
        styles[sw.label] = dict(_SWEEP_STYLES.get(sw.label, {"color": "#59a14f", "marker": "^"}), markersize=4)
        if fits and len(set(sw.sizes())) >= 2:
            try:
                f = sw.fit()
            except ValueError:
                continue
            xs = np.geomspace(min(sw.sizes()), max(sw.sizes()), 60)
            name = f"{sw.label} fit: {human_seconds(f.latency_s)} + bytes / {f.gbps:.1f} GB/s"
            series[name] = (xs.tolist(), (xs / np.array([f.predict_s(x) for x in xs]) / 1e9).tolist())
            styles[name] = {
                "color": styles[sw.label].get("color", "#555"),
                "linestyle": ":",
                "marker": "",
                "linewidth": 1.2,
            }
    ax = plots.sweep_plot(
        series,
        ax,
        xlabel="copy size (bytes, log scale)",
        ylabel="bandwidth (GB/s = 1e9 B/s, log scale)",
        title=title,
        ceiling=ceiling,
        source=source,
        styles=styles,
    )
    star_colors = ["#e15759", "#b07aa1", "#edc948", "#76b7b2", "#ff9da7", "#9c755f"]
    for i, (p, label) in enumerate(points):
        ax.plot(
            [p.nbytes],
            [p.gbps],
            marker="*",
            markersize=14,
            color=star_colors[i % len(star_colors)],
            markeredgecolor="black",
            linestyle="",
            label=label,
            zorder=5,
        )
    _bytes_ticks(ax, [n for sw in sweeps for n in sw.sizes()] + [p.nbytes for p, _ in points])
    ax.legend(fontsize=7.5, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    return ax


def plot_speedup(pairs: dict[str, list[tuple[int, float]]], ax: Any = None, *, source: str | None = None) -> Any:
    """pageable/pinned time ratio per size, with the claimed 1.3-1.5 band shaded."""
    from ...ui import plots  # optional/heavy: matplotlib

    series = {
        f"{name}: pageable time / pinned time": ([n for n, _ in v], [r for _, r in v]) for name, v in pairs.items()
    }
    ax = plots.sweep_plot(
        series,
        ax,
        xlabel="copy size (bytes, log scale)",
        ylabel="speed-up of pinned (x)",
        title="Is pinning 30-50% faster? Measured ratio per size",
        logy=False,
        source=source,
    )
    ax.axhspan(CLAIM_RANGE[0], CLAIM_RANGE[1], color="#bab0ac", alpha=0.35, label="the claim: 1.3x-1.5x")
    ax.axhline(1.0, color="black", linewidth=0.8)
    _bytes_ticks(ax, [n for v in pairs.values() for n, _ in v])
    ax.legend(fontsize=8)
    return ax
