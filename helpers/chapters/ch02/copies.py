"""Chapter 02's copies: :func:`sweep` is the one copy loop (the reader's ``time_copy`` or the helper's CUDA-event
copy, every size and memory kind in alternating rounds); beside it the host memcpy, bytes on the wire, and the
``ch02.*`` records read back."""

from __future__ import annotations

import functools
import math
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import torch

from ...core.config import require_gpu, sized
from ...core.device import resolve_device
from ...core.progress import ProgressFn
from ...core.rounds import alternate
from ...core.timing import cuda_event_time, measure, summarize
from ...core.validate import check_int, human_bytes, human_seconds
from ...pipeline.transfer import check_host_bytes, cuda_status
from .model import (
    _MAX_BYTES,
    DTYPES,
    LatencyBandwidthFit,
    MiB,
    check_pin_size,
    copy_sizes,
    fit_latency_bandwidth,
    images_nbytes,
)

_WARMUP = 3  # untimed copies before the helper's timed ones

DIRECTIONS = ("h2d", "d2h")
MEMORY_KINDS = ("pageable", "pinned")
_DIRECTION_NAMES = {"h2d": "host→device", "d2h": "device→host", "h2h": "host→host"}

CopyFn = Callable[..., Any]
"""``copy_fn(src, device, pinned, repeats)`` -> seconds of each timed copy (a list), or one number: the chapter's
``time_copy`` (on a CPU device it times a host memcpy)."""


@dataclass
class TransferPoint:
    """One copy size: median and IQR of one copy's time; ``direction`` ``"h2h"`` is the host memcpy."""

    nbytes: int
    direction: str
    memory: str
    median_s: float
    iqr_s: float = 0.0
    n: int = 1
    dtype: str = "uint8"
    method: str = ""

    @property
    def gbps(self) -> float:  # GB/s = 1e9 bytes per second
        return self.nbytes / self.median_s / 1e9 if self.median_s > 0 else float("nan")

    def __str__(self) -> str:
        return (
            f"{_DIRECTION_NAMES.get(self.direction, self.direction)} {self.memory} {self.dtype} "
            f"{human_bytes(self.nbytes)}: {human_seconds(self.median_s)} (IQR {human_seconds(self.iqr_s)}, "
            f"{self.gbps:.2f} GB/s)"
        )


@dataclass
class Sweep:
    """Copy times across sizes for one (direction, memory kind); ``source``: measured here, or the reference."""

    direction: str
    memory: str
    points: list[TransferPoint]
    source: str = "measured here"
    device: str = ""
    method: str = ""

    @property
    def label(self) -> str:
        h2h = self.direction == "h2h"
        return "host memcpy (CPU→CPU, not a GPU copy)" if h2h else f"{self.direction.upper()} {self.memory}"

    def sizes(self) -> list[int]:
        return [p.nbytes for p in self.points]

    def gbps(self) -> list[float]:
        return [p.gbps for p in self.points]

    def fit(self) -> LatencyBandwidthFit:
        return fit_latency_bandwidth(self.sizes(), [p.median_s for p in self.points])


def _check_device_bytes(name: str, nbytes: int, dev: torch.device, what: str) -> None:
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


def pinning_status() -> tuple[bool, str]:
    """Try to pin one byte: ``(ok, message)``, with the driver's own answer when it fails."""
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


def measure_host_copy(nbytes: int, *, dtype: str = "uint8") -> TransferPoint:
    """Time ``dst.copy_(src)`` between two pageable host tensors of ``nbytes``: a CPU memcpy (what the driver does
    to stage a pageable buffer), **not** a host-to-GPU transfer. One thread, as the driver stages one; a slow copy
    gets fewer timed blocks (at least 3), so it takes about 20 s at most."""
    check_host_bytes("nbytes", 2 * nbytes, what=f"a host copy of {human_bytes(nbytes)} (source and destination)")
    n = _numel(nbytes, dtype)
    src = torch.ones(n, dtype=DTYPES[dtype])
    dst = torch.zeros(n, dtype=DTYPES[dtype])  # pages touched now, not during timing
    copy = functools.partial(dst.copy_, src)
    try:
        t0 = time.perf_counter()
        copy()  # one untimed call, to size the measurement
        blocks = max(3, min(15, int(20.0 / max(time.perf_counter() - t0, 1e-9)) - 4))
        run: dict[str, Any] = {"min_run_time": sized(0.02, 0.1), "warmup": 2, "blocks": blocks, "num_threads": 1}
        timing = measure(copy, label=f"host copy {human_bytes(nbytes)}", device="cpu", **run)
    finally:
        del src, dst, copy  # freed now, even if a traceback holds this frame
    meta = timing.metadata
    how = f"host tensor copy_ (CPU memcpy, {meta.get('num_threads')} thread(s)), {meta.get('method', '')}"
    return TransferPoint(nbytes, "h2h", "pageable", timing.median_s, timing.iqr_s, timing.n, dtype, how)


def _helper_copy(direction: str) -> CopyFn:
    """The helper's own copy as a :data:`CopyFn` (CUDA only): each bracketed by CUDA events on a side stream (a
    pageable copy call holds the host while the driver stages it: the interval covers the staging too)."""

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
            stream.wait_stream(torch.cuda.current_stream(device))  # the buffers' fills are done
            with torch.cuda.stream(stream):  # device's current stream, where cuda_event_time runs and records
                copy = functools.partial(dst.copy_, buf, non_blocking=pinned)
                return cuda_event_time(copy, repeats=repeats, warmup=_WARMUP, device=device).times_s
        finally:
            torch.cuda.synchronize(device)
            del dst, buf

    helper_copy.__name__ = f"helper_copy_{direction}"
    return helper_copy


def _samples(copy_fn: CopyFn, result: Any) -> list[float]:
    name = getattr(copy_fn, "__name__", "copy_fn")
    values = [result] if isinstance(result, (int, float)) and not isinstance(result, bool) else result
    try:
        out = [float(v) for v in values]
    except (TypeError, ValueError):
        out = []
    if not out or not all(math.isfinite(v) and v >= 0 for v in out):
        raise ValueError(
            f"copy_fn: {name}(...) must return the seconds of each timed copy (a list of numbers >= 0) or one "
            f"number, got {result!r}"
        )
    return out


def _refuse_too_big(sizes: list[int], cuda: torch.device | None, kinds: Sequence[str]) -> int:
    """The largest size, refused (one line) if it would not fit: host RAM, the safe pin limit, GPU memory."""
    biggest = max(sizes)
    check_host_bytes("sizes", 2 * biggest, what=f"a source of {human_bytes(biggest)} and one copy of it")
    if cuda is not None and "pinned" in kinds:
        check_pin_size(biggest)
    if cuda is not None:
        _check_device_bytes("sizes", biggest, cuda, f"a device copy of {human_bytes(biggest)}")
    return biggest


def sweep(
    copy_fn: CopyFn,
    sizes: Sequence[int] | None = None,
    *,
    device: torch.device | str | None = None,
    repeats: int | None = None,
    rounds: int = 2,
    progress: ProgressFn | None = None,
    direction: str = "h2d",
    kinds: Sequence[str] = MEMORY_KINDS,
    method: str | None = None,
    dtype: str = "uint8",
) -> dict[tuple[str, str], Sweep]:
    """Time *your* copy function over ``sizes``: each round calls ``copy_fn(src, device, pinned, repeats)`` once per
    size and memory kind (``src``: a slice of one host buffer), in alternating rounds (a drifting machine hurts both
    kinds alike), and pools all rounds' seconds (median, IQR) into one curve per ``(direction, kind)``. Without
    CUDA: only pageable copies, as ``("h2h", "pageable")``, the host memcpy ``time_copy`` times on a CPU."""
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
    biggest = _refuse_too_big(sizes, dev if ok else None, kinds)
    samples: dict[tuple[str, int], list[float]] = {(m, n): [] for m in kinds for n in sizes}
    base = torch.ones(_numel(biggest, dtype), dtype=DTYPES[dtype])  # every size is a slice of it

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
    name = getattr(copy_fn, "__name__", "copy_fn")
    how = method or f"{name}(), yours: {rounds} alternating round(s) x {reps} timed copies, median" + (
        "" if ok else "; no CUDA device here, so a host memcpy, not a GPU copy"
    )
    where = ("measured here", torch.cuda.get_device_name(dev)) if ok else ("measured here (CPU memcpy)", "cpu")
    out: dict[tuple[str, str], Sweep] = {}
    for (m, n), seconds in samples.items():
        t = summarize(f"{direction} {m} {human_bytes(n)}", seconds)
        sw = out.setdefault((direction, m), Sweep(direction, m, [], *where, how))
        sw.points.append(TransferPoint(n, direction, m, t.median_s, t.iqr_s, t.n, dtype, how))
    return out


def transfer_sweep(
    direction: str,
    memory: str,
    sizes: Sequence[int] | None = None,
    *,
    device: torch.device | str | None = None,
    repeats: int | None = None,
    progress: ProgressFn | None = None,
    dtype: str = "uint8",
) -> Sweep:
    """One (direction, memory kind) curve: :func:`sweep`'s loop, one round, with the helper's copy (CUDA only:
    the callers check)."""
    reps = sized(10, 30) if repeats is None else repeats
    how = f"CUDA events on a side stream, {_WARMUP} warm-up copies, median of {reps}"
    kw: dict[str, Any] = {"device": device, "repeats": reps, "rounds": 1, "direction": direction, "kinds": (memory,)}
    return sweep(_helper_copy(direction), sizes, method=how, dtype=dtype, progress=progress, **kw)[(direction, memory)]


@dataclass
class WireResult:
    """The same images as uint8 and as float32: bytes and copy time of each."""

    nbytes: dict[str, int]
    seconds: dict[str, float]
    what: str

    @property
    def byte_ratio(self) -> float:
        return self.nbytes["float32"] / self.nbytes["uint8"]

    @property
    def time_ratio(self) -> float:
        return self.seconds["float32"] / self.seconds["uint8"]

    def lines(self) -> list[str]:
        out = [f"{d:>8}: {self.nbytes[d] / MiB:7.2f} MiB, {self.seconds[d] * 1e3:7.3f} ms" for d in DTYPES]
        return out + [f"bytes ratio {self.byte_ratio:.0f}x, time ratio {self.time_ratio:.1f}x — {self.what}"]


def wire_comparison(
    batch: int = 64, channels: int = 3, height: int = 224, width: int = 224, *, device: torch.device | str | None = None
) -> WireResult:
    """Copy the same images as uint8 and as float32 and time both: pinned H2D copies (CUDA events, median of 10) on
    a CUDA device; else a pageable host memcpy (real, but a CPU copy, and ``what`` says so)."""
    limits = {"batch": (batch, 100_000), "channels": (channels, 64), "height": (height, 8192), "width": (width, 8192)}
    b, c, h, w = (check_int(name, value, 1, hi) for name, (value, hi) in limits.items())
    nbytes = {d: images_nbytes(b, c, h, w, dtype=d) for d in DTYPES}
    if cuda_status(device)[0]:
        dev = resolve_device(device)
        curves = {d: transfer_sweep("h2d", "pinned", [n], device=dev, repeats=10, dtype=d) for d, n in nbytes.items()}
        seconds = {d: sw.points[0].median_s for d, sw in curves.items()}
        return WireResult(nbytes, seconds, f"pinned H2D copy on {torch.cuda.get_device_name(dev)}")
    seconds = {d: measure_host_copy(n, dtype=d).median_s for d, n in nbytes.items()}
    what = "host memcpy on this CPU (no GPU here: not a GPU transfer)"
    return WireResult(nbytes, seconds, what)


# ``wire_from_records(result_set, records)`` is a ``convert`` for helpers.core.evidence: a WireResult rebuilt from
# the ``ch02.wire_time`` records ch02.benchmark wrote, or None (missing).


def wire_from_records(result_set: Any, records: Iterable[Any]) -> WireResult | None:
    """A :class:`WireResult` from ``ch02.wire_time`` records; None unless both dtypes are there."""
    got = {r.params.get("dtype"): r for r in records}
    if not all(d in got and got[d].value and got[d].params.get("nbytes") for d in DTYPES):
        return None
    return WireResult(
        {d: int(got[d].params["nbytes"]) for d in DTYPES}, {d: got[d].value for d in DTYPES}, "pinned H2D copy"
    )
