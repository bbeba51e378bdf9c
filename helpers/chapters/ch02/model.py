"""Chapter 02's arithmetic, unit-tested on CPU: the sizes a sweep visits, the ``time = latency + bytes /
bandwidth`` model and its fit, the pinned allocator's power-of-two block and the safe pin limit, the claim
"pinning is 30-50% faster". Units: bytes, seconds, GB/s = 1e9 bytes per second (as links are specified)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np

from ...core.config import sized
from ...core.validate import check_float, check_int, human_bytes, human_seconds
from ...pipeline.transfer import _memory_now

KiB = 1024
MiB = 1024**2
GiB = 1024**3

DEFAULT_PIN_SHARE = 0.25
"""Largest share of the machine's *available* RAM the helpers agree to pin."""
CLAIM_RANGE = (1.3, 1.5)
"""The seeds' claim, "pinning makes transfers 30-50% faster", as a pageable/pinned time ratio."""
_MAX_BYTES = 64 * GiB


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


def size_grid(lo: int = 4 * KiB, hi: int = 256 * MiB, factor: int = 2) -> list[int]:
    """Geometric grid of byte sizes ``lo, lo*factor, ...`` up to and including ``hi``: ``size_grid(4096, 65536, 4)``
    is ``[4096, 16384, 65536]``."""
    lo, factor = check_int("lo", lo, 1, _MAX_BYTES), check_int("factor", factor, 2, 1024)
    hi = check_int("hi", hi, lo, _MAX_BYTES)
    sizes = [lo]
    while sizes[-1] * factor <= hi:
        sizes.append(sizes[-1] * factor)
    return sizes


def copy_sizes() -> list[int]:
    """Bytes per copy of the chapter's sweep: 4 KiB..16 MiB (x4) in quick mode, 4 KiB..256 MiB (x2) in full mode."""
    return sized(quick=size_grid(4 * KiB, 16 * MiB, 4), full=size_grid(4 * KiB, 256 * MiB, 2))


def _as_positive_array(name: str, values: Iterable[float]) -> np.ndarray:
    arr = np.asarray(list(values), dtype=float)
    if arr.ndim != 1 or arr.size == 0 or not np.all(np.isfinite(arr)) or np.any(arr <= 0):
        raise ValueError(f"{name} must be a non-empty list of finite numbers > 0, got {arr.tolist()}")
    return arr


def fit_latency_bandwidth(nbytes: Sequence[float], seconds: Sequence[float]) -> LatencyBandwidthFit:
    """Least-squares fit of ``seconds = latency + nbytes / bandwidth``.

    Times across a sweep span four or five orders of magnitude, so an ordinary least-squares fit would be
    decided by the largest copies alone. We minimise the *relative* error, ``sum(((latency + nbytes * k) / t
    - 1) ** 2)`` with ``k = 1 / bandwidth``, which weights every size equally and is still linear. A negative
    best latency (noise at small sizes) is refitted at zero (``latency_clamped``).
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


def claim_verdict(ratio: float, lo: float = CLAIM_RANGE[0], hi: float = CLAIM_RANGE[1]) -> str:
    """A pageable/pinned time ratio against the claim "30-50 % faster": ``"below"``, ``"within"`` or ``"above"``."""
    return "below" if ratio < lo else "above" if ratio > hi else "within"
