"""Host <-> GPU copies: pageable vs pinned memory, measured across sizes (chapter 02).

What lives here, one job per function (chapter 02's panel and headless benchmark are in
:mod:`helpers.chapters.ch02`):

Pure logic (runs anywhere, unit-tested on CPU)
    :func:`size_grid`, :func:`copy_sizes` - the byte sizes (of one copy) a sweep visits.
    :func:`fit_latency_bandwidth` - least-squares fit of ``time = latency + bytes / bandwidth``.
    :func:`predict_pinned_block` - the power-of-two block the caching host allocator takes.
    :func:`safe_pin_limit`, :func:`check_pin_size` - refuse to pin more than a safe share of RAM.
    :func:`images_nbytes` - bytes on the wire for a batch of images in a given dtype.
    :func:`break_even_uses`, :func:`pinning_pays` - when does pinning a buffer pay for itself?
    :func:`speedup_by_size`, :func:`claim_verdict` - test the "pinning is 30-50% faster" claim.

The reader's copy function, looped over sizes
    :func:`sweep` - calls the chapter's ``time_copy`` (any :data:`CopyFn`) for every size, pageable
    and pinned in alternating rounds, and records the times as sweeps. On a CPU device it asks only
    for pageable copies, which the chapter's function times as a host memcpy (labelled so).
    :func:`transfer_sweep` runs the same loop with the helper's own copy (either direction).
    :func:`measure_copy_fn` - one call of the reader's function at one size and dtype (the live panel).

Measurements that need CUDA (they return :class:`Unavailable`, never raise, without it)
    :func:`measure_copy`, :func:`transfer_sweep` - CUDA-event timed copies on a side stream.
    :func:`pin_cost` - what ``tensor.pin_memory()`` costs, cold and cached, vs what it saves.
    :func:`host_blocking_probe` - how long the CPU is held by a copy queued behind GPU work.
    :func:`pinned_rounding_demo`, :func:`host_allocator_stats` - the pinned caching allocator.

Reference records (``ch02.*``, recorded by :func:`helpers.chapters.ch02.benchmark`) back into results
    :func:`sweeps_from_records`, and the ``convert`` functions of
    :func:`helpers.core.evidence.measure_or_recall`: :func:`pin_costs_from_records`,
    :func:`host_blocking_from_records`, :func:`rounding_rows_from_records`, :func:`wire_from_records`;
    with the formatters that print either kind alike (:func:`pin_cost_table`, :func:`host_blocking_lines`,
    :func:`rounding_lines`, :func:`wire_lines`).

Measurements that are real on a CPU-only machine
    :func:`measure_host_copy`, :func:`host_copy_sweep` - pageable host-to-host ``copy_``
    (a CPU memcpy): a CPU-side reference point, *not* a GPU transfer.
    :func:`pinning_status` - tries to pin one byte and reports the driver's answer.

Units: sizes in bytes (binary prefixes when printed: KiB, MiB), times in seconds,
bandwidth in GB/s = 1e9 bytes per second (the unit link specifications use).
"""

from __future__ import annotations

import contextlib
import math
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterable, Sequence

import numpy as np
import torch

from ..core.config import require_gpu, sized
from ..core.device import has_cuda, intraop_threads, resolve_device, wrap
from ..core.timing import measure, summarize
from ..core.validate import check_choice, check_float, check_int, human_bytes, human_seconds

if TYPE_CHECKING:  # pragma: no cover
    from matplotlib.figure import Figure

__all__ = [
    "KiB",
    "MiB",
    "GiB",
    "DIRECTIONS",
    "MEMORY_KINDS",
    "DTYPES",
    "DEFAULT_PIN_SHARE",
    "CLAIM_RANGE",
    "NO_CUDA_REASON",
    "Unavailable",
    "is_available",
    "TransferPoint",
    "Sweep",
    "LatencyBandwidthFit",
    "PinCost",
    "HostBlocking",
    "RoundingRow",
    "WireResult",
    "size_grid",
    "copy_sizes",
    "fit_latency_bandwidth",
    "predict_pinned_block",
    "safe_pin_limit",
    "check_pin_size",
    "check_host_bytes",
    "images_nbytes",
    "break_even_uses",
    "pinning_pays",
    "speedup_by_size",
    "claim_verdict",
    "cuda_status",
    "pinning_status",
    "measure_host_copy",
    "host_copy_sweep",
    "measure_copy",
    "transfer_sweep",
    "CopyFn",
    "sweep",
    "measure_copy_fn",
    "pin_cost",
    "host_blocking_probe",
    "host_allocator_stats",
    "release_pinned_cache",
    "pinned_rounding_demo",
    "wire_comparison",
    "sweeps_from_records",
    "pin_costs_from_records",
    "host_blocking_from_records",
    "rounding_rows_from_records",
    "wire_from_records",
    "pin_cost_table",
    "host_blocking_lines",
    "rounding_lines",
    "wire_lines",
    "copy_paths_diagram",
    "plot_sweeps",
    "plot_pin_costs",
    "plot_speedup",
]

KiB = 1024
MiB = 1024**2
GiB = 1024**3

DIRECTIONS = ("h2d", "d2h")
"""GPU copy directions: host to device, device to host."""
MEMORY_KINDS = ("pageable", "pinned")
DTYPES: dict[str, torch.dtype] = {"uint8": torch.uint8, "float32": torch.float32}
DEFAULT_PIN_SHARE = 0.25
"""Largest share of the machine's *available* RAM the helpers agree to pin."""
CLAIM_RANGE = (1.3, 1.5)
"""The seeds' claim, "pinning makes transfers 30-50% faster", as a pageable/pinned time ratio."""
NO_CUDA_REASON = (
    "No CUDA device is present (torch.cuda.is_available() is False), so copies between host "
    "and GPU memory cannot be measured on this machine."
)
_MAX_BYTES = 64 * GiB
_DIRECTION_NAMES = {"h2d": "host→device", "d2h": "device→host", "h2h": "host→host"}


# ---------------------------------------------------------------------------
# Result types
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Unavailable:
    """A measurement that could not run here, and why (e.g. no CUDA device).

    Every GPU measurement in this module returns one of these instead of
    raising when the hardware is missing, so a notebook cell can print it and
    move on to reference results.
    """

    what: str
    reason: str
    available: bool = field(default=False, init=False)

    def __str__(self) -> str:
        return wrap(f"{self.what}: not measured here. {self.reason}")

    def __bool__(self) -> bool:  # `if result:` reads naturally
        return False


def is_available(result: Any) -> bool:
    """True unless ``result`` is an :class:`Unavailable`."""
    return not isinstance(result, Unavailable)


@dataclass
class TransferPoint:
    """One measured copy size: median and spread of the time of one copy.

    ``direction`` is ``"h2d"``, ``"d2h"`` or ``"h2h"`` (host memcpy, the CPU-only
    reference point); ``memory`` is the host side's kind, ``"pageable"`` or ``"pinned"``.
    """

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
    """``time = latency_s + nbytes / bandwidth_Bps``, fitted to a sweep.

    Attributes:
        latency_s: fixed cost of one copy, seconds (launch, driver, DMA setup).
        bandwidth_Bps: asymptotic bandwidth, bytes per second.
        n_points: number of sizes used.
        max_rel_error: worst relative misfit over the points (0.1 = 10 %).
        latency_clamped: True if the unconstrained fit gave a negative latency
            and the fit was redone with latency fixed at 0.
    """

    latency_s: float
    bandwidth_Bps: float
    n_points: int
    max_rel_error: float
    latency_clamped: bool = False

    @property
    def gbps(self) -> float:
        """Fitted bandwidth in GB/s."""
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
    """Copy times across sizes for one (direction, memory kind) pair.

    ``source`` says where the numbers come from: ``"measured here"`` or a
    reference description (the GPU, date and commit it was recorded with).
    """

    direction: str
    memory: str
    points: list[TransferPoint]
    source: str = "measured here"
    device: str = ""
    method: str = ""

    @property
    def label(self) -> str:
        """Legend label, e.g. ``'H2D pinned'`` or ``'host memcpy (CPU only)'``."""
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
        """Fit ``time = latency + bytes / bandwidth`` to this sweep's medians."""
        return fit_latency_bandwidth(self.sizes(), self.times())

    def peak_gbps(self) -> float:
        return max(self.gbps()) if self.points else float("nan")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# ---------------------------------------------------------------------------
# Pure logic
# ---------------------------------------------------------------------------


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

    Times across a sweep span four or five orders of magnitude, so an ordinary
    least-squares fit would be decided by the largest copies alone and the
    latency would come out as noise. We minimise the *relative* error instead,
    ``sum(((latency + nbytes * k) / t - 1) ** 2)`` with ``k = 1 / bandwidth``,
    which weights every size equally. It is still a linear least-squares
    problem, solved with :func:`numpy.linalg.lstsq`.

    If the best latency is negative (noise at small sizes), the fit is redone
    with latency fixed at zero and ``latency_clamped`` is set.

    Raises:
        ValueError: fewer than two distinct sizes, lengths differ, values not
            positive, or times that do not grow with size (no bandwidth to fit).
    """
    x = _as_positive_array("nbytes", nbytes)
    t = _as_positive_array("seconds", seconds)
    if x.size != t.size:
        raise ValueError(f"nbytes and seconds must have the same length, got {x.size} and {t.size}")
    if np.unique(x).size < 2:
        raise ValueError("fit_latency_bandwidth needs at least two distinct sizes")
    design = np.column_stack([1.0 / t, x / t])
    (latency, k), *_ = np.linalg.lstsq(design, np.ones_like(t), rcond=None)
    clamped = False
    if latency < 0:
        u = x / t
        latency, k = 0.0, float(u.sum() / (u * u).sum())
        clamped = True
    if not k > 0:
        raise ValueError(
            "times do not grow with size, so no bandwidth can be fitted; "
            "check that the sweep covers sizes large enough for the copy to dominate"
        )
    pred = latency + x * k
    return LatencyBandwidthFit(
        latency_s=float(latency),
        bandwidth_Bps=float(1.0 / k),
        n_points=int(x.size),
        max_rel_error=float(np.max(np.abs(pred / t - 1.0))),
        latency_clamped=clamped,
    )


def predict_pinned_block(nbytes: int) -> int:
    """Bytes the caching host allocator reserves for a pinned request of ``nbytes``.

    PyTorch's ``CachingHostAllocator`` rounds every request up to the next power of
    two before calling ``cudaHostAlloc``, so a 300 MiB pin takes a 512 MiB block.
    Requests above ``pinned_max_round_threshold_mb`` (or ``pinned_max_cached_size_mb``),
    set in ``PYTORCH_ALLOC_CONF`` (``PYTORCH_CUDA_ALLOC_CONF`` is still read), keep their
    exact size; both are unlimited by default, which is what this prediction assumes.

    >>> predict_pinned_block(300 * MiB) // MiB
    512
    """
    nbytes = check_int("nbytes", nbytes, 0)
    if nbytes <= 1:
        return nbytes
    return 1 << (nbytes - 1).bit_length()


def _memory_now() -> tuple[int, int]:
    import psutil

    vm = psutil.virtual_memory()
    return int(vm.total), int(vm.available)


def safe_pin_limit(
    share: float = DEFAULT_PIN_SHARE,
    *,
    total_bytes: int | None = None,
    available_bytes: int | None = None,
) -> int:
    """Most bytes the helpers agree to pin: ``share`` of the smaller of total and available RAM.

    Pinned (page-locked) memory can never be swapped out or moved by the
    kernel, so pinning too much starves the operating system and every other
    process, and can hang the machine. ``total_bytes`` / ``available_bytes``
    default to :func:`psutil.virtual_memory` (pass them to test or to plan).
    """
    share = check_float("share", share, 0.001, 0.9)
    if total_bytes is None or available_bytes is None:
        total, avail = _memory_now()
        total_bytes = total if total_bytes is None else total_bytes
        available_bytes = avail if available_bytes is None else available_bytes
    total_bytes = check_int("total_bytes", total_bytes, 1)
    available_bytes = check_int("available_bytes", available_bytes, 0)
    return int(share * min(total_bytes, available_bytes))


def check_pin_size(
    nbytes: int,
    *,
    share: float = DEFAULT_PIN_SHARE,
    already_pinned: int = 0,
    total_bytes: int | None = None,
    available_bytes: int | None = None,
) -> int:
    """Return the block size a pin of ``nbytes`` takes, or raise if that is unsafe.

    The check uses the *rounded* block (see :func:`predict_pinned_block`) plus
    ``already_pinned`` bytes the caller holds.

    Raises:
        ValueError: naming the request, the limit and what to do instead.
    """
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


def check_host_bytes(
    name: str,
    nbytes: int,
    *,
    share: float = 0.5,
    what: str = "",
    available_bytes: int | None = None,
) -> int:
    """Return ``nbytes`` if that much host RAM can be allocated safely, else raise ValueError.

    ``nbytes`` is the *total* the caller is about to allocate (e.g. both buffers of a
    copy). The limit is ``share`` of the RAM :func:`psutil.virtual_memory` reports as
    available now (pass ``available_bytes`` to test or to plan), so a request that
    would push the machine into swap or the out-of-memory killer is refused first.
    """
    nbytes = check_int(name, nbytes, 0)
    share = check_float("share", share, 0.01, 0.95)
    if available_bytes is None:
        available_bytes = _memory_now()[1]
    limit = int(share * check_int("available_bytes", available_bytes, 0))
    if nbytes > limit:
        raise ValueError(
            f"{name}: {what or 'this request'} needs {human_bytes(nbytes)} of host RAM, more than "
            f"{share:.0%} of the {human_bytes(available_bytes)} available now ({human_bytes(limit)}). "
            "Choose a smaller size."
        )
    return nbytes


def _check_device_bytes(name: str, nbytes: int, dev: torch.device, what: str) -> None:
    """Refuse a GPU allocation larger than 80% of the device memory free now."""
    free, _ = torch.cuda.mem_get_info(dev)
    if nbytes > 0.8 * free:
        raise ValueError(
            f"{name}: {what} needs {human_bytes(nbytes)} of GPU memory, more than 80% of the "
            f"{human_bytes(free)} free on {dev} now. Choose a smaller size."
        )


def images_nbytes(batch: int, channels: int, height: int, width: int, dtype: str = "uint8") -> int:
    """Bytes of a ``(batch, channels, height, width)`` image tensor in ``dtype``.

    >>> images_nbytes(256, 3, 224, 224, "float32") // images_nbytes(256, 3, 224, 224, "uint8")
    4
    """
    batch = check_int("batch", batch, 1, 1_000_000)
    channels = check_int("channels", channels, 1, 1024)
    height = check_int("height", height, 1, 65536)
    width = check_int("width", width, 1, 65536)
    dtype = check_choice("dtype", dtype, DTYPES)
    item = torch.empty((), dtype=DTYPES[dtype]).element_size()
    return batch * channels * height * width * item


def break_even_uses(pin_s: float, pageable_copy_s: float, pinned_copy_s: float) -> float:
    """Copies of one buffer after which pinning it has paid for itself.

    Pinning costs ``pin_s`` once and saves ``pageable_copy_s - pinned_copy_s`` per copy,
    so it pays after ``pin_s / saving`` copies. Returns ``inf`` if pinned copies save
    nothing, and 0 if pinning is free.
    """
    pin_s = check_float("pin_s", pin_s, 0.0)
    pageable_copy_s = check_float("pageable_copy_s", pageable_copy_s, 0.0)
    pinned_copy_s = check_float("pinned_copy_s", pinned_copy_s, 0.0)
    saving = pageable_copy_s - pinned_copy_s
    if saving <= 0:
        return math.inf
    return pin_s / saving


def pinning_pays(uses: int, pin_s: float, pageable_copy_s: float, pinned_copy_s: float) -> bool:
    """True if pinning once and copying ``uses`` times beats ``uses`` pageable copies."""
    uses = check_int("uses", uses, 1)
    return pin_s + uses * pinned_copy_s < uses * pageable_copy_s


def speedup_by_size(pageable: Sweep, pinned: Sweep) -> list[tuple[int, float]]:
    """``(nbytes, pageable_time / pinned_time)`` for every size both sweeps measured.

    A ratio of 1.3 means the pinned copy is 30 % faster (1.3x the bandwidth).
    """
    if pageable.direction != pinned.direction:
        raise ValueError(
            f"pageable and pinned must have the same direction, got {pageable.direction!r} and {pinned.direction!r}"
        )
    pinned_t = {p.nbytes: p.median_s for p in pinned.points}
    return [(p.nbytes, p.median_s / pinned_t[p.nbytes]) for p in pageable.points if p.nbytes in pinned_t]


def claim_verdict(ratio: float, lo: float = CLAIM_RANGE[0], hi: float = CLAIM_RANGE[1]) -> str:
    """Place a pageable/pinned time ratio against the claim "30-50 % faster".

    Returns ``"below"`` (pinning gains less than claimed, or loses), ``"within"`` or ``"above"``.
    """
    ratio = check_float("ratio", ratio, 0.0)
    if ratio < lo:
        return "below"
    if ratio > hi:
        return "above"
    return "within"


# ---------------------------------------------------------------------------
# What this machine can do
# ---------------------------------------------------------------------------


def _names_cuda(device: Any) -> bool:
    try:
        return torch.device(device).type == "cuda"
    except (RuntimeError, TypeError, ValueError):
        return False


def cuda_status(device: torch.device | str | None = None) -> tuple[bool, str]:
    """``(True, '')`` if ``device`` is a usable CUDA device, else ``(False, reason)``.

    ``device`` goes through :func:`helpers.core.device.resolve_device` (``None``: CUDA when present),
    which refuses with a ValueError a device that is not ``cpu`` or ``cuda`` or not spelled as one, and,
    with CUDA, a GPU that is not there (``"cuda:3"`` with one GPU). Without CUDA, a CUDA device is
    answered with :data:`NO_CUDA_REASON`, not refused: a measurement asked for ``device="cuda"`` on a
    CPU-only machine returns :class:`Unavailable`.
    """
    if not has_cuda():
        if device is not None:  # the spelling is checked all the same; 'cuda' is absent here, not wrong
            resolve_device("cpu" if _names_cuda(device) else device)
        return False, NO_CUDA_REASON
    dev = resolve_device(device)
    if dev.type != "cuda":
        return False, f"device {str(dev)!r} is not a CUDA device; pass device='cuda' to measure copies."
    return True, ""


def pinning_status() -> tuple[bool, str]:
    """Try to pin one byte. ``(True, msg)`` if it works, ``(False, msg)`` with the driver's answer."""
    try:
        t = torch.empty(1, dtype=torch.uint8).pin_memory()
        ok = bool(t.is_pinned())
        del t
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


# ---------------------------------------------------------------------------
# CPU-side reference: host memcpy (real on any machine)
# ---------------------------------------------------------------------------


def measure_host_copy(
    nbytes: int,
    *,
    dtype: str = "uint8",
    min_run_time: float | None = None,
    num_threads: int = 1,
    max_seconds: float = 20.0,
) -> TransferPoint:
    """Time ``dst.copy_(src)`` between two pageable host tensors of ``nbytes`` bytes.

    This is a CPU memcpy, the same work the driver does when it stages a
    pageable buffer into its pinned bounce buffer. It is a CPU-side reference
    point, **not** a host-to-GPU transfer. Timed with
    :func:`helpers.core.timing.measure` (warm-up, blocked runs, median).

    One thread by default: the driver stages a pageable copy with one CPU
    thread, and a multi-threaded copy on a busy 2-core machine mostly measures
    how long the threads wait for each other.

    The two buffers must fit in half the RAM available now (ValueError otherwise),
    and for a large copy the number of timed blocks is cut (to at least 3) so the
    measurement takes about ``max_seconds`` at most.
    """
    nbytes = check_int("nbytes", nbytes, 1, _MAX_BYTES)
    dtype = check_choice("dtype", dtype, DTYPES)
    check_host_bytes("nbytes", 2 * nbytes, what=f"a host copy of {human_bytes(nbytes)} (source and destination)")
    run_time = sized(0.02, 0.1) if min_run_time is None else check_float("min_run_time", min_run_time, 1e-4, 60.0)
    n = _numel(nbytes, dtype)
    src = torch.ones(n, dtype=DTYPES[dtype])
    dst = torch.zeros(n, dtype=DTYPES[dtype])  # pages touched now, not during timing
    max_seconds = check_float("max_seconds", max_seconds, 0.1, 3600.0)
    try:
        t0 = time.perf_counter()
        dst.copy_(src)  # one untimed call, to size the measurement
        one = time.perf_counter() - t0
        blocks = max(3, min(15, int(max_seconds / max(one, 1e-9)) - 4))
        # The lambda runs inside measure(), before the `del` in `finally` (which frees the buffers even when a
        # traceback keeps this frame alive); ruff's F821 counts the later `del` against it.
        timing = measure(
            lambda: dst.copy_(src),  # noqa: F821
            label=f"host copy {human_bytes(nbytes)}",
            device="cpu",
            min_run_time=run_time,
            warmup=2,
            blocks=blocks,
            num_threads=check_int("num_threads", num_threads, 1, 1024),
        )
    finally:
        del src, dst
    return TransferPoint(
        nbytes=nbytes,
        direction="h2h",
        memory="pageable",
        median_s=timing.median_s,
        iqr_s=timing.iqr_s,
        n=timing.n,
        dtype=dtype,
        method=f"host tensor copy_ (CPU memcpy, {timing.metadata.get('num_threads')} thread(s)), "
        f"{timing.metadata.get('method', '')}",
    )


def host_copy_sweep(sizes: Sequence[int] | None = None, *, min_run_time: float | None = None) -> Sweep:
    """:func:`measure_host_copy` over ``sizes`` (default :func:`copy_sizes`)."""
    sizes = list(copy_sizes() if sizes is None else sizes)
    points = [measure_host_copy(n, min_run_time=min_run_time) for n in sizes]
    return Sweep(
        direction="h2h",
        memory="pageable",
        points=points,
        source="measured here (CPU memcpy)",
        device="cpu",
        method=points[0].method if points else "",
    )


# ---------------------------------------------------------------------------
# GPU measurements (return Unavailable without CUDA)
# ---------------------------------------------------------------------------


def _alloc_pair(
    nbytes: int, direction: str, memory: str, dev: torch.device, dtype: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dst, src)`` for one copy; the host side pinned if ``memory == 'pinned'``."""
    n = _numel(nbytes, dtype)
    dt = DTYPES[dtype]
    pin = memory == "pinned"
    host = torch.empty(n, dtype=dt, pin_memory=pin)
    host.zero_()  # fault the pages in now (pageable memory is lazily mapped)
    gpu = torch.empty(n, dtype=dt, device=dev)
    gpu.zero_()
    return (gpu, host) if direction == "h2d" else (host, gpu)


def _event_times(
    dst: torch.Tensor,
    src: torch.Tensor,
    *,
    non_blocking: bool,
    repeats: int,
    warmup: int,
    stream: "torch.cuda.Stream",
) -> list[float]:
    """Per-copy GPU times (s) of ``dst.copy_(src)`` on ``stream``, bracketed by CUDA events.

    For a pageable source the copy call itself blocks the host while the
    driver stages the data, and the end event is recorded after it returns, so
    the event interval covers the staging too.
    """
    stream.wait_stream(torch.cuda.current_stream(stream.device))  # the zero_() fills are done
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
    """Time one host<->GPU copy size with CUDA events on a side stream (median of ``repeats``).

    Buffers are allocated once and reused for every repeat; pinned copies use
    ``non_blocking=True`` (truly asynchronous), pageable copies the default
    ``non_blocking=False`` (what ``tensor.to('cuda')`` does). Buffers are freed in
    ``finally``; a freed pinned block goes back to PyTorch's caching host
    allocator, which keeps it for the next pin of that size (see
    :func:`release_pinned_cache`).

    Returns :class:`Unavailable` without CUDA. Raises ValueError for bad arguments
    or a pin beyond the safe limit.
    """
    nbytes = check_int("nbytes", nbytes, 1, _MAX_BYTES)
    direction = check_choice("direction", direction, DIRECTIONS)
    memory = check_choice("memory", memory, MEMORY_KINDS)
    dtype = check_choice("dtype", dtype, DTYPES)
    repeats = check_int("repeats", repeats, 1, 10_000)
    warmup = check_int("warmup", warmup, 0, 1_000)
    _numel(nbytes, dtype)
    ok, reason = cuda_status(device)
    what = f"{direction.upper()} {memory} copy of {human_bytes(nbytes)}"
    if not ok:
        return Unavailable(what, reason)
    dev = resolve_device(device)
    if memory == "pinned":
        check_pin_size(nbytes, share=pin_share)
    else:
        check_host_bytes("nbytes", nbytes, what=f"a pageable buffer of {human_bytes(nbytes)}")
    _check_device_bytes("nbytes", nbytes, dev, f"a device buffer of {human_bytes(nbytes)}")
    dst = src = None
    try:
        dst, src = _alloc_pair(nbytes, direction, memory, dev, dtype)
        stream = torch.cuda.Stream(device=dev)
        times = _event_times(dst, src, non_blocking=(memory == "pinned"), repeats=repeats, warmup=warmup, stream=stream)
    finally:
        torch.cuda.synchronize(dev)
        del dst, src

    t = summarize(what, times)
    return TransferPoint(
        nbytes=nbytes,
        direction=direction,
        memory=memory,
        median_s=t.median_s,
        iqr_s=t.iqr_s,
        n=t.n,
        dtype=dtype,
        method=f"CUDA events on a side stream, {warmup} warm-up copies, median of {repeats}",
    )


def transfer_sweep(
    direction: str,
    memory: str,
    sizes: Sequence[int] | None = None,
    *,
    device: torch.device | str | None = None,
    repeats: int | None = None,
    warmup: int = 3,
    pin_share: float = DEFAULT_PIN_SHARE,
    progress: Callable[..., Any] | None = None,
) -> Sweep | Unavailable:
    """Measure one (direction, memory kind) curve over ``sizes`` (default :func:`copy_sizes`) with the helper's copy.

    The loop is :func:`sweep`'s (one round, one memory kind); the copy is the helper's own
    (:func:`_helper_copy`: CUDA events on a side stream, ``warmup`` untimed copies, buffers reused for
    every repeat), in either direction. ``progress(fraction, text)`` is called after every size.

    Returns :class:`Unavailable` without CUDA (checked before anything is allocated).
    """
    direction = check_choice("direction", direction, DIRECTIONS)
    memory = check_choice("memory", memory, MEMORY_KINDS)
    sizes = list(copy_sizes() if sizes is None else sizes)
    for n in sizes:
        check_int("sizes[i]", n, 1, _MAX_BYTES)
    reps = sized(10, 30) if repeats is None else check_int("repeats", repeats, 1, 10_000)
    warmup = check_int("warmup", warmup, 0, 1_000)
    ok, reason = cuda_status(device)
    if not ok:
        return Unavailable(f"{direction.upper()} {memory} sweep", reason)
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
        method=f"CUDA events on a side stream, {warmup} warm-up copies, median of {reps}",
    )
    return curves[(direction, memory)]


def _helper_copy(direction: str, warmup: int) -> CopyFn:
    """The helper's own copy as a :data:`CopyFn` for :func:`sweep` (CUDA only), in ``direction``.

    H2D: from ``src`` itself (pageable) or from a pinned copy of it made once; D2H: from a device copy of
    ``src`` into a host buffer, pinned or pageable. Each call times ``repeats`` copies between the same two
    buffers with CUDA events on a side stream (:func:`_event_times`), after ``warmup`` untimed ones.
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


# ---------------------------------------------------------------------------
# The reader's copy function, swept over sizes (chapter 02's practice cells)
# ---------------------------------------------------------------------------


CopyFn = Callable[..., Any]
"""``copy_fn(src, device, pinned, repeats)`` -> seconds of each timed copy (a list), or one number.

The chapter's ``time_copy`` cell is one: warm-up, CUDA events, ``src.pin_memory()`` once when
``pinned``, ``.to(device, non_blocking=True)``; on a CPU device it times a host memcpy instead.
"""


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


def sweep(
    copy_fn: CopyFn,
    sizes: Sequence[int] | None = None,
    *,
    device: torch.device | str | None = None,
    repeats: int | None = None,
    rounds: int = 2,
    pin_share: float = DEFAULT_PIN_SHARE,
    progress: Callable[..., Any] | None = None,
    direction: str = "h2d",
    kinds: Sequence[str] = MEMORY_KINDS,
    method: str | None = None,
) -> dict[tuple[str, str], Sweep]:
    """Time *your* copy function over ``sizes``: this helper only loops, alternates, records.

    For every round and every size it calls ``copy_fn(src, device, pinned, repeats)`` once per
    memory kind, with ``src`` a host ``uint8`` tensor of that many bytes (a slice of one buffer
    allocated once), and pools the seconds it returns. The two kinds alternate within each size,
    and their order flips every round (pageable first in even rounds, pinned first in odd ones),
    so that a machine that slows down or speeds up during the sweep hurts both kinds alike.

    On a usable CUDA ``device``: every kind in ``kinds`` (default both), recorded as
    ``(direction, "pageable")`` and ``(direction, "pinned")``. On any other device there is no
    host-to-device copy and nothing can be pinned: only ``pinned=False`` is asked for, and the
    result is recorded as ``("h2h", "pageable")``, the host memcpy (labelled "not a GPU copy" on
    plots), which is what the chapter's ``time_copy`` times on a CPU.

    Args:
        copy_fn: see :data:`CopyFn`.
        sizes: bytes per copy (default :func:`copy_sizes`).
        repeats: timed copies asked for per call (default 5 quick, 15 full).
        rounds: calls per size and kind; the samples of all rounds are pooled (median, IQR).
        progress: ``progress(fraction, text)``, called after every call.
        direction: what ``copy_fn`` copies on a CUDA device, ``"h2d"`` (the reader's ``time_copy``)
            or ``"d2h"`` (:func:`transfer_sweep`'s copy); it labels the curves.
        kinds: the memory kinds asked for on a CUDA device, in this order in even rounds.
        method: how the times were taken, for the curves (default: "<copy_fn>(), yours: ...").

    Returns ``{(direction, memory): Sweep}``. Raises ValueError for bad arguments, a buffer
    beyond the safe pin limit or the RAM available, or a ``copy_fn`` that returns no times.
    """
    if not callable(copy_fn):
        raise ValueError(f"copy_fn must be a function copy_fn(src, device, pinned, repeats), got {copy_fn!r}")
    sizes = list(copy_sizes() if sizes is None else sizes)
    if not sizes:
        raise ValueError("sizes must hold at least one size in bytes")
    sizes = [check_int("sizes[i]", n, 1, _MAX_BYTES) for n in sizes]
    reps = sized(5, 15) if repeats is None else check_int("repeats", repeats, 1, 10_000)
    rounds = check_int("rounds", rounds, 1, 100)
    direction = check_choice("direction", direction, DIRECTIONS)
    kinds = tuple(check_choice("kinds[i]", k, MEMORY_KINDS) for k in kinds)
    if not kinds or len(set(kinds)) != len(kinds):
        raise ValueError(f"kinds must name each memory kind at most once, at least one, got {kinds!r}")
    dev = resolve_device(device)  # 'cuda' on a machine without one: a ValueError that says so
    ok, _ = cuda_status(dev)
    if not ok:  # no host-to-device copy here: the reader's function times a host memcpy
        kinds, direction = ("pageable",), "h2h"
    biggest = max(sizes)
    check_host_bytes("sizes", 2 * biggest, what=f"a source of {human_bytes(biggest)} and one copy of it")
    if ok:
        if "pinned" in kinds:
            check_pin_size(biggest, share=pin_share)
        _check_device_bytes("sizes", biggest, dev, f"a device copy of {human_bytes(biggest)}")
    name = getattr(copy_fn, "__name__", "copy_fn")
    samples: dict[tuple[str, int], list[float]] = {(m, n): [] for m in kinds for n in sizes}
    calls, done = rounds * len(sizes) * len(kinds), 0
    base = torch.ones(biggest, dtype=torch.uint8)  # one host buffer; every size is a slice of it
    try:
        for r in range(rounds):
            order = kinds if r % 2 == 0 else kinds[::-1]
            for n in sizes:
                for memory in order:
                    result = copy_fn(base[:n], dev, memory == "pinned", reps)
                    samples[(memory, n)] += _samples(copy_fn, result)
                    done += 1
                    if progress is not None:
                        progress(done / calls, f"round {r + 1}/{rounds}, {human_bytes(n)} {memory}")
    finally:
        del base
        if ok:
            torch.cuda.synchronize(dev)
            torch.cuda.empty_cache()  # device copies back to the driver; pinned blocks stay cached

    how = method or f"{name}(), yours: {rounds} alternating rounds x {reps} timed copies, median" + (
        "" if ok else "; no CUDA device here, so a host memcpy (CPU→CPU), not a GPU copy"
    )
    out: dict[tuple[str, str], Sweep] = {}
    for memory in kinds:
        points = []
        for n in sizes:
            t = summarize(f"{direction} {memory} {human_bytes(n)}", samples[(memory, n)])
            points.append(
                TransferPoint(
                    nbytes=n, direction=direction, memory=memory, median_s=t.median_s, iqr_s=t.iqr_s, n=t.n, method=how
                )
            )
        out[(direction, memory)] = Sweep(
            direction=direction,
            memory=memory,
            points=points,
            source="measured here" if ok else "measured here (CPU memcpy)",
            device=_gpu_name(dev) if ok else "cpu",
            method=how,
        )
    return out


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
    """One call of *your* copy function on a host tensor of ``nbytes`` bytes of ``dtype``, as a point.

    On a CUDA ``device`` it is an H2D copy (``pinned`` when ``memory == "pinned"``); on any other device
    there is no host-to-device copy, and ``copy_fn`` is asked for a pageable copy, which the chapter's
    ``time_copy`` times as a host memcpy, run on one CPU thread (as the driver stages a pageable copy,
    and as :func:`sweep` runs on a CPU). Raises ValueError for bad arguments, a buffer beyond the RAM
    available or the safe pin limit, or a ``copy_fn`` that returns no times.
    """
    if not callable(copy_fn):
        raise ValueError(f"copy_fn must be a function copy_fn(src, device, pinned, repeats), got {copy_fn!r}")
    nbytes = check_int("nbytes", nbytes, 1, _MAX_BYTES)
    memory = check_choice("memory", memory, MEMORY_KINDS)
    dtype = check_choice("dtype", dtype, DTYPES)
    repeats = check_int("repeats", repeats, 1, 10_000)
    dev = resolve_device(device)
    gpu, _ = cuda_status(dev)
    pinned = gpu and memory == "pinned"
    check_host_bytes("nbytes", 2 * nbytes, what=f"a source of {human_bytes(nbytes)} and one copy of it")
    if pinned:
        check_pin_size(nbytes, share=pin_share)
    src = torch.ones(_numel(nbytes, dtype), dtype=DTYPES[dtype])
    try:
        with contextlib.nullcontext() if gpu else intraop_threads(1):
            t = summarize("copy", _samples(copy_fn, copy_fn(src, dev, pinned, repeats)))
    finally:
        del src
    name = getattr(copy_fn, "__name__", "copy_fn")
    return TransferPoint(
        nbytes=nbytes,
        direction="h2d" if gpu else "h2h",
        memory=memory if gpu else "pageable",
        median_s=t.median_s,
        iqr_s=t.iqr_s,
        n=t.n,
        dtype=dtype,
        method=f"{name}(), yours, median of {t.n}" + ("" if gpu else " (host memcpy, not a GPU copy)"),
    )


def release_pinned_cache() -> bool:
    """Give cached, unused pinned blocks back to the driver. Returns False if torch can't.

    Freed pinned tensors normally stay in PyTorch's caching host allocator, because
    ``cudaHostAlloc`` is slow and a loader pins the same size every batch.
    ``torch.cuda.empty_cache()`` releases *device* memory only; the host cache is
    emptied by the private ``torch._C._host_emptyCache`` (guarded here).
    """
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return False
    fn = getattr(torch._C, "_host_emptyCache", None)
    if fn is None:
        return False
    for i in range(torch.cuda.device_count()):  # copies from pinned blocks may be queued on any device
        torch.cuda.synchronize(i)
    fn()
    return True


def host_allocator_stats() -> dict[str, int] | Unavailable:
    """Key counters of the pinned caching allocator (``torch.cuda.memory.host_memory_stats``).

    Returns the keys ``allocated_bytes`` (pinned bytes the allocator owns, active + cached,
    at their rounded size), ``active_bytes`` (handed out now), ``allocations``,
    ``num_host_alloc`` and ``num_host_free`` (``cudaHostAlloc`` / ``cudaFreeHost`` calls).
    """
    ok, reason = cuda_status()
    if not ok:
        return Unavailable("pinned allocator statistics", reason)
    fn = getattr(getattr(torch.cuda, "memory", None), "host_memory_stats", None)
    if fn is None:
        return Unavailable(
            "pinned allocator statistics", f"torch {torch.__version__} has no torch.cuda.memory.host_memory_stats()"
        )
    torch.cuda.init()
    raw = fn()
    keys = {
        "allocated_bytes": "allocated_bytes.current",
        "active_bytes": "active_bytes.current",
        "allocations": "allocations.current",
        "num_host_alloc": "num_host_alloc",
        "num_host_free": "num_host_free",
    }
    return {short: int(raw.get(k, 0)) for short, k in keys.items()}


@dataclass
class RoundingRow:
    """One pinned allocation: requested bytes, predicted block, and what the allocator took."""

    requested: int
    predicted_block: int
    allocated_delta: int | None

    @property
    def waste(self) -> int:
        return self.predicted_block - self.requested


def pinned_rounding_demo(
    sizes: Sequence[int], *, pin_share: float = DEFAULT_PIN_SHARE
) -> list[RoundingRow] | Unavailable:
    """Pin each size once and read how many bytes the allocator's pool grew by.

    The host cache is emptied before each allocation so a fresh block is created.
    ``allocated_delta`` is None if this torch has no host-allocator statistics.
    """
    sizes = [check_int("sizes[i]", n, 1, _MAX_BYTES) for n in sizes]
    ok, reason = cuda_status()
    if not ok:
        return Unavailable("pinned block rounding", reason)
    rows: list[RoundingRow] = []
    for n in sizes:
        check_pin_size(n, share=pin_share)
        release_pinned_cache()
        before = host_allocator_stats()
        t = None
        try:
            t = torch.empty(n, dtype=torch.uint8, pin_memory=True)
            after = host_allocator_stats()
        finally:
            del t
        delta = None
        if isinstance(before, dict) and isinstance(after, dict):
            delta = after["allocated_bytes"] - before["allocated_bytes"]
        rows.append(RoundingRow(n, predict_pinned_block(n), delta))
    release_pinned_cache()
    return rows


@dataclass
class PinCost:
    """What pinning one buffer costs and what it saves, for one size (seconds).

    Attributes:
        pin_cold_s: ``t.pin_memory()`` when the allocator must call ``cudaHostAlloc``.
        pin_cached_s: the same when a cached block of that size is reused (a memcpy).
        pageable_copy_s / pinned_copy_s: one H2D copy from a reused buffer (CUDA events).
        plain_to_s: wall time of ``t.to(dev)`` from pageable memory, synchronised.
        pin_then_copy_s: wall time of ``t.pin_memory().to(dev, non_blocking=True)`` with a
            cold allocator, synchronised: "pin once, copy once".
    """

    nbytes: int
    block_bytes: int
    pin_cold_s: float
    pin_cached_s: float
    pageable_copy_s: float
    pinned_copy_s: float
    plain_to_s: float
    pin_then_copy_s: float
    method: str = ""

    @property
    def saving_per_copy_s(self) -> float:
        return self.pageable_copy_s - self.pinned_copy_s

    @property
    def break_even_cold(self) -> float:
        """Copies of one buffer needed before a cold pin pays off."""
        return break_even_uses(self.pin_cold_s, self.pageable_copy_s, self.pinned_copy_s)

    @property
    def break_even_cached(self) -> float:
        return break_even_uses(self.pin_cached_s, self.pageable_copy_s, self.pinned_copy_s)


def _wall(fn: Callable[[], Any], dev: torch.device) -> float:
    torch.cuda.synchronize(dev)
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize(dev)
    return time.perf_counter() - t0


def pin_cost(
    nbytes: int,
    *,
    device: torch.device | str | None = None,
    repeats: int = 5,
    pin_share: float = DEFAULT_PIN_SHARE,
) -> PinCost | Unavailable:
    """Measure pinning itself against the copy time it saves, at one size (H2D).

    Without CUDA this returns :class:`Unavailable` carrying the driver's own
    error from :func:`pinning_status`.
    """
    nbytes = check_int("nbytes", nbytes, 1, _MAX_BYTES)
    repeats = check_int("repeats", repeats, 1, 1000)
    ok, reason = cuda_status(device)
    if not ok:
        return Unavailable(f"cost of pinning {human_bytes(nbytes)}", reason + " " + pinning_status()[1])
    dev = resolve_device(device)
    block = check_pin_size(nbytes, share=pin_share)
    check_host_bytes("nbytes", nbytes, what=f"the pageable source of {human_bytes(nbytes)}")
    _check_device_bytes("nbytes", 2 * nbytes, dev, f"two device copies of {human_bytes(nbytes)}")
    src = torch.ones(nbytes, dtype=torch.uint8)
    cold, cached, plain, pin_copy = [], [], [], []
    # Each lambda runs inside _wall(), before the `del src` in `finally` (which frees the buffer even when a
    # traceback keeps this frame alive); ruff's F821 counts the later `del` against them.
    try:
        plain.append(_wall(lambda: src.to(dev), dev))  # noqa: F821  (warm-up: CUDA context, device cache)
        for _ in range(repeats):
            release_pinned_cache()
            cold.append(_wall(lambda: src.pin_memory(), dev))  # noqa: F821  (block freed on return, stays cached)
            cached.append(_wall(lambda: src.pin_memory(), dev))  # noqa: F821
            plain.append(_wall(lambda: src.to(dev), dev))  # noqa: F821
            release_pinned_cache()
            pin_copy.append(_wall(lambda: src.pin_memory().to(dev, non_blocking=True), dev))  # noqa: F821
        pageable = measure_copy(nbytes, "h2d", "pageable", device=dev, repeats=max(repeats, 5), pin_share=pin_share)
        pinned = measure_copy(nbytes, "h2d", "pinned", device=dev, repeats=max(repeats, 5), pin_share=pin_share)
        assert isinstance(pageable, TransferPoint) and isinstance(pinned, TransferPoint)
    finally:
        del src
        torch.cuda.empty_cache()
    med = statistics.median
    return PinCost(
        nbytes=nbytes,
        block_bytes=block,
        pin_cold_s=med(cold),
        pin_cached_s=med(cached),
        pageable_copy_s=pageable.median_s,
        pinned_copy_s=pinned.median_s,
        plain_to_s=med(plain[1:]),
        pin_then_copy_s=med(pin_copy),
        method=(
            f"pin and to(): synchronised wall clock, median of {repeats}; copies: CUDA events; "
            "'cold' = host cache emptied first (torch._C._host_emptyCache)"
        ),
    )


@dataclass
class HostBlocking:
    """How long the CPU was held inside a copy call queued behind GPU work (seconds)."""

    nbytes: int
    gpu_work_s: float
    held_s: dict[str, float]
    method: str = ""


def _sleep_cycles_per_s(dev: torch.device) -> float:
    """Calibrate ``torch.cuda._sleep`` (a spin kernel measured in GPU clock cycles)."""
    cycles = 10_000_000
    with torch.cuda.device(dev):  # _sleep runs on the current device: make it `dev`
        stream = torch.cuda.current_stream(dev)  # Event.record() alone would use the current device's stream
        torch.cuda._sleep(cycles // 10)  # warm-up / module load
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        torch.cuda._sleep(cycles)
        end.record(stream)
    torch.cuda.synchronize(dev)
    return cycles / (start.elapsed_time(end) / 1e3)


def _queue_gpu_work_fn(seconds: float, dev: torch.device) -> Callable[[], None]:
    """A function that enqueues about ``seconds`` of GPU work on ``dev``'s current stream."""
    if hasattr(torch.cuda, "_sleep"):
        cycles = int(seconds * _sleep_cycles_per_s(dev))

        def sleep() -> None:
            with torch.cuda.device(dev):  # _sleep runs on the current device: make it `dev`
                torch.cuda._sleep(cycles)

        return sleep
    a = torch.randn(2048, 2048, device=dev)  # pragma: no cover - fallback for torch without _sleep
    one = _wall(lambda: a @ a, dev)
    k = max(1, int(seconds / max(one, 1e-6)))

    def matmuls() -> None:
        for _ in range(k):
            a @ a

    return matmuls


def host_blocking_probe(
    *,
    device: torch.device | str | None = None,
    gpu_work_s: float = 0.1,
    nbytes: int = 64 * MiB,
    repeats: int = 3,
    pin_share: float = DEFAULT_PIN_SHARE,
) -> HostBlocking | Unavailable:
    """Queue ``gpu_work_s`` of GPU work, then time (host clock) the H2D copy *call*.

    Cases: ``pageable`` (``copy_`` with the default ``non_blocking=False``),
    ``pageable, non_blocking=True`` and ``pinned, non_blocking=True``. A copy that
    holds the host about as long as the queued work has waited for the GPU; one
    that returns in microseconds let the CPU run ahead to prepare the next batch.
    """
    gpu_work_s = check_float("gpu_work_s", gpu_work_s, 0.001, 5.0)
    nbytes = check_int("nbytes", nbytes, 1, _MAX_BYTES)
    repeats = check_int("repeats", repeats, 1, 100)
    ok, reason = cuda_status(device)
    if not ok:
        return Unavailable("host-blocking probe", reason)
    dev = resolve_device(device)
    check_pin_size(nbytes, share=pin_share)
    check_host_bytes("nbytes", nbytes, what=f"the pageable source of {human_bytes(nbytes)}")
    _check_device_bytes("nbytes", nbytes, dev, f"a device buffer of {human_bytes(nbytes)}")
    cases = {
        "pageable": ("pageable", False),
        "pageable, non_blocking=True": ("pageable", True),
        "pinned, non_blocking=True": ("pinned", True),
    }
    held: dict[str, float] = {}
    bufs: dict[str, torch.Tensor] = {}
    dst = None
    try:
        work = _queue_gpu_work_fn(gpu_work_s, dev)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(torch.cuda.current_stream(dev))  # on dev's stream, where work() queues
        work()
        end.record(torch.cuda.current_stream(dev))
        torch.cuda.synchronize(dev)
        measured_work = start.elapsed_time(end) / 1e3
        dst = torch.empty(nbytes, dtype=torch.uint8, device=dev)
        bufs["pageable"] = torch.ones(nbytes, dtype=torch.uint8)
        bufs["pinned"] = torch.ones(nbytes, dtype=torch.uint8, pin_memory=True)
        for name, (kind, nb) in cases.items():
            dst.copy_(bufs[kind], non_blocking=nb)  # warm-up
            samples = []
            for _ in range(repeats):
                torch.cuda.synchronize(dev)
                work()  # queued on the current stream, ahead of the copy
                t0 = time.perf_counter()
                dst.copy_(bufs[kind], non_blocking=nb)
                samples.append(time.perf_counter() - t0)
                torch.cuda.synchronize(dev)
            held[name] = statistics.median(samples)
    finally:
        torch.cuda.synchronize(dev)
        bufs.clear()
        del dst
        torch.cuda.empty_cache()
    return HostBlocking(
        nbytes=nbytes,
        gpu_work_s=measured_work,
        held_s=held,
        method="GPU work: torch.cuda._sleep on the current stream; copy call timed with perf_counter, "
        f"median of {repeats}",
    )


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
    """Copy the same images as uint8 and as float32 and time both.

    On a CUDA device: pinned H2D copies timed with CUDA events. Without one:
    pageable host memcpy (real, but it is a CPU copy, and ``what`` says so).
    """
    shape = (
        check_int("batch", batch, 1, 100_000),
        check_int("channels", channels, 1, 64),
        check_int("height", height, 1, 8192),
        check_int("width", width, 1, 8192),
    )
    nbytes = {d: images_nbytes(*shape, dtype=d) for d in DTYPES}
    ok, _ = cuda_status(device)
    seconds: dict[str, float] = {}
    if ok:
        dev = resolve_device(device)
        for d, n in nbytes.items():
            p = measure_copy(n, "h2d", "pinned", dtype=d, device=dev, repeats=repeats)
            assert isinstance(p, TransferPoint)
            seconds[d] = p.median_s
        return WireResult(
            shape, nbytes, seconds, what=f"pinned H2D copy on {_gpu_name(dev)}", method="CUDA events, median"
        )
    for d, n in nbytes.items():
        seconds[d] = measure_host_copy(n, dtype=d).median_s
    return WireResult(
        shape,
        nbytes,
        seconds,
        what="host memcpy on this CPU (no GPU here: not a GPU transfer)",
        method="torch.utils.benchmark Timer, median",
    )


# ---------------------------------------------------------------------------
# Reference records (ch02.*) back into results, and what prints either kind
# ---------------------------------------------------------------------------
#
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


def pin_costs_from_records(result_set: Any, records: Iterable[Any]) -> list[PinCost] | None:
    """:class:`PinCost` rows from ``ch02.pin.*`` records (sizes with all six fields); None if none has them."""
    by_size: dict[int, dict[str, float]] = {}
    for r in records:
        key = str(_field(r, "key"))
        if not key.startswith("ch02.pin."):
            continue
        n = int(_params(r).get("nbytes", 0))
        by_size.setdefault(n, {})[key.rsplit(".", 1)[1]] = float(_field(r, "value"))
    need = ("cold", "cached", "pageable_copy", "pinned_copy", "plain_to", "pin_then_copy")
    rows = [
        PinCost(
            nbytes=n,
            block_bytes=predict_pinned_block(n),
            pin_cold_s=f["cold"],
            pin_cached_s=f["cached"],
            pageable_copy_s=f["pageable_copy"],
            pinned_copy_s=f["pinned_copy"],
            plain_to_s=f["plain_to"],
            pin_then_copy_s=f["pin_then_copy"],
            method="reference record",
        )
        for n, f in sorted(by_size.items())
        if n > 0 and all(k in f for k in need)
    ]
    return rows or None


def host_blocking_from_records(result_set: Any, records: Iterable[Any]) -> HostBlocking | None:
    """A :class:`HostBlocking` from ``ch02.host_held`` records (one per case); None if there are none."""
    recs = [r for r in records if _field(r, "key") == "ch02.host_held" and "case" in _params(r)]
    if not recs:
        return None
    first = _params(recs[0])
    same = [r for r in recs if _params(r).get("gpu_work_s") == first.get("gpu_work_s")]  # one probe's cases
    return HostBlocking(
        nbytes=int(first.get("nbytes", 0)),
        gpu_work_s=float(first.get("gpu_work_s", 0.0)),
        held_s={str(_params(r)["case"]): float(_field(r, "value")) for r in same},
    )


def rounding_rows_from_records(result_set: Any, records: Iterable[Any]) -> list[RoundingRow] | None:
    """:class:`RoundingRow` s from ``ch02.pinned_block`` records (the pool growth per request); None if none."""
    rows = [
        RoundingRow(
            int(_params(r)["requested"]), predict_pinned_block(int(_params(r)["requested"])), int(_field(r, "value"))
        )
        for r in records
        if _field(r, "key") == "ch02.pinned_block" and "requested" in _params(r)
    ]
    return sorted(rows, key=lambda row: row.requested) or None


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


def pin_cost_table(rows: Sequence[PinCost]) -> str:
    """A fixed-width text table of pinning cost vs copy saving, one line per size."""
    head = (
        f"{'size':>10} {'pin (cold)':>11} {'pin (cached)':>13} {'pageable copy':>14} {'pinned copy':>12} "
        f"{'to() plain':>11} {'pin+copy once':>14} {'pays after':>11}"
    )
    lines = [head]
    for r in rows:
        be = r.break_even_cold
        pays = "never" if math.isinf(be) else f"{math.ceil(be) if be > 0 else 0} uses"
        lines.append(
            f"{human_bytes(r.nbytes):>10} {human_seconds(r.pin_cold_s):>11} {human_seconds(r.pin_cached_s):>13} "
            f"{human_seconds(r.pageable_copy_s):>14} {human_seconds(r.pinned_copy_s):>12} "
            f"{human_seconds(r.plain_to_s):>11} {human_seconds(r.pin_then_copy_s):>14} {pays:>11}"
        )
    return "\n".join(lines)


def host_blocking_lines(probe: HostBlocking) -> list[str]:
    """The probe as printed lines: the GPU work queued ahead, then the time each copy call held the CPU."""
    how = f" ({probe.method})" if probe.method else ""
    lines = [wrap(f"GPU work queued ahead of the copy: {probe.gpu_work_s * 1e3:.1f} ms{how}", indent="  ")]
    lines += [f"  {case:<28} CPU held for {s * 1e3:8.3f} ms" for case, s in probe.held_s.items()]
    return lines


def rounding_lines(rows: Sequence[RoundingRow]) -> list[str]:
    """One line per pin: requested, how much the pinned pool grew, and the predicted power-of-two block."""
    return [
        f"  requested {r.requested / MiB:.0f} MiB: pool grew by "
        + (
            "an unknown amount (no host_memory_stats)"
            if r.allocated_delta is None
            else f"{r.allocated_delta / MiB:.0f} MiB"
        )
        + f" (predicted {r.predicted_block / MiB:.0f} MiB)"
        for r in rows
    ]


def wire_lines(wire: WireResult) -> list[str]:
    """Bytes and copy time of each dtype, then the two ratios and what was copied."""
    lines = [f"{d:>8}: {wire.nbytes[d] / MiB:7.2f} MiB, {wire.seconds[d] * 1e3:7.3f} ms" for d in DTYPES]
    lines.append(f"bytes ratio {wire.byte_ratio:.0f}x, time ratio {wire.time_ratio:.1f}x — {wire.what}")
    return lines


# ---------------------------------------------------------------------------
# The chapter's diagram
# ---------------------------------------------------------------------------


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


# ---------------------------------------------------------------------------
# Plots
# ---------------------------------------------------------------------------


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
    from ..ui import plots  # optional/heavy: matplotlib

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


def plot_pin_costs(rows: Sequence[PinCost], ax: Any = None, *, source: str | None = None) -> Any:
    """Time of pinning (cold, cached) vs time one pinned copy saves, against size (log-log)."""
    from ..ui import plots  # optional/heavy: matplotlib

    sizes = [r.nbytes for r in rows]
    series = {
        "pin_memory(), new block (cudaHostAlloc)": (sizes, [r.pin_cold_s * 1e3 for r in rows]),
        "pin_memory(), cached block (memcpy only)": (sizes, [r.pin_cached_s * 1e3 for r in rows]),
        "saving per copy (pageable − pinned)": (sizes, [max(r.saving_per_copy_s, 1e-9) * 1e3 for r in rows]),
    }
    styles = {
        "pin_memory(), new block (cudaHostAlloc)": {"color": "#e15759", "marker": "o"},
        "pin_memory(), cached block (memcpy only)": {"color": "#f28e2b", "marker": "o", "linestyle": "--"},
        "saving per copy (pageable − pinned)": {"color": "#59a14f", "marker": "s"},
    }
    ax = plots.sweep_plot(
        series,
        ax,
        xlabel="buffer size (bytes, log scale)",
        ylabel="time (ms, log scale)",
        title="Cost of pinning vs what one pinned copy saves",
        source=source,
        styles=styles,
    )
    _bytes_ticks(ax, sizes)
    ax.legend(fontsize=7.5, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    return ax


def plot_speedup(pairs: dict[str, list[tuple[int, float]]], ax: Any = None, *, source: str | None = None) -> Any:
    """pageable/pinned time ratio per size, with the claimed 1.3-1.5 band shaded."""
    from ..ui import plots  # optional/heavy: matplotlib

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
