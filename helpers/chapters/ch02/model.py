"""Chapter 02's arithmetic: the sweep's sizes, the ``time = latency + bytes / bandwidth`` fit, the pinned block and
the safe pin limit, the "30-50% faster" claim, bytes on the wire, when pinning pays. Units: bytes, seconds, GB/s =
1e9 bytes per second (as links are)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np
import torch

from ...core.config import sized
from ...core.validate import check_choice, check_float, check_int, human_bytes, human_seconds
from ...pipeline import transfer

KiB = 1024
MiB = 1024**2
GiB = 1024**3

DEFAULT_PIN_SHARE = 0.25  # the largest share of the *available* RAM the helpers agree to pin
CLAIM_RANGE = (1.3, 1.5)  # "pinning makes transfers 30-50% faster", as a pageable/pinned time ratio
_MAX_BYTES = 64 * GiB
DTYPES: dict[str, torch.dtype] = {"uint8": torch.uint8, "float32": torch.float32}


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
        return self.latency_s + float(nbytes) / self.bandwidth_Bps

    def half_bandwidth_bytes(self) -> float:  # the size at which half the bandwidth is reached
        return self.latency_s * self.bandwidth_Bps

    def __str__(self) -> str:
        note = " (latency clamped at 0)" if self.latency_clamped else ""
        return (
            f"latency {human_seconds(self.latency_s)}, bandwidth {self.gbps:.2f} GB/s{note}; "
            f"worst misfit {self.max_rel_error:.0%} over {self.n_points} sizes"
        )


def copy_sizes() -> list[int]:
    """Bytes per copy of the chapter's sweep: 4 KiB..16 MiB (x4) in quick mode, 4 KiB..256 MiB (x2) in full mode."""
    factor, hi = sized(quick=(4, 16 * MiB), full=(2, 256 * MiB))
    return [4 * KiB * factor**i for i in range(64) if 4 * KiB * factor**i <= hi]


def _as_positive_array(name: str, values: Iterable[float]) -> np.ndarray:
    arr = np.asarray(list(values), dtype=float)
    if arr.ndim != 1 or arr.size == 0 or not np.all(np.isfinite(arr)) or np.any(arr <= 0):
        raise ValueError(f"{name} must be a non-empty list of finite numbers > 0, got {arr.tolist()}")
    return arr


def fit_latency_bandwidth(nbytes: Sequence[float], seconds: Sequence[float]) -> LatencyBandwidthFit:
    """Least-squares fit of ``seconds = latency + nbytes / bandwidth`` minimising the *relative* error (times span
    orders of magnitude: plain least squares would fit the largest copies only); a negative latency is refitted at 0.
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
    """Bytes the caching host allocator reserves for a pinned request: the next power of two (300 MiB -> 512 MiB).
    Requests above ``pinned_max_round_threshold_mb`` (or ``pinned_max_cached_size_mb``) in ``PYTORCH_ALLOC_CONF``
    keep their exact size; both are unlimited by default, as assumed here."""
    nbytes = check_int("nbytes", nbytes, 0)
    return nbytes if nbytes <= 1 else 1 << (nbytes - 1).bit_length()


def safe_pin_limit(share: float = DEFAULT_PIN_SHARE) -> int:
    """Most bytes the helpers agree to pin: ``share`` of the smaller of total and available RAM (psutil's figures
    now). Pinned memory can never be swapped out, so pinning too much starves the OS and can hang it."""
    share = check_float("share", share, 0.001, 0.9)
    return int(share * min(transfer._memory_now()))


def check_pin_size(nbytes: int, *, share: float = DEFAULT_PIN_SHARE) -> int:
    """The block a pin of ``nbytes`` takes; ValueError (what to do instead) when it is over :func:`safe_pin_limit`."""
    nbytes = check_int("nbytes", nbytes, 1)
    block = predict_pinned_block(nbytes)
    limit = safe_pin_limit(share)
    if block > limit:
        raise ValueError(
            f"nbytes: refusing to pin {human_bytes(nbytes)} (a {human_bytes(block)} block after "
            f"power-of-two rounding): the safe limit is {human_bytes(limit)}, which is "
            f"{share:.0%} of this machine's free RAM. Pinned memory cannot be swapped out, so "
            "pinning too much starves the OS and other processes. Use a smaller buffer (pin one "
            "batch and reuse it for every batch), or pass a larger `share` if you know this "
            "machine can spare it."
        )
    return block


def claim_verdict(ratio: float) -> str:
    """A pageable/pinned time ratio against the claim "30-50 % faster": ``"below"``, ``"within"`` or ``"above"``."""
    return "below" if ratio < CLAIM_RANGE[0] else "above" if ratio > CLAIM_RANGE[1] else "within"


def claim_check(ratios: Sequence[float]) -> str:
    """The claim "30-50 % faster" against several pageable/pinned time ratios: how many fall below, within and
    above its band, and whether it holds for all, some or none of them."""
    rs = [check_float(f"ratios[{i}]", r, 0.0) for i, r in enumerate(ratios)]
    if not rs:
        raise ValueError("ratios must hold at least one pageable/pinned time ratio")
    n = {v: sum(claim_verdict(r) == v for r in rs) for v in ("below", "within", "above")}
    k = n["within"]
    holds = "all of them" if k == len(rs) else "none of them" if not k else f"{k} of {len(rs)} only"
    return (
        f"{k} of {len(rs)} in the claimed band {CLAIM_RANGE[0]:.1f}x-{CLAIM_RANGE[1]:.1f}x, {n['below']} below, "
        f"{n['above']} above (ratios {min(rs):.2f}x-{max(rs):.2f}x): the claim holds for {holds}."
    )


def ceiling_share(measured_gbps: float, ceiling_gbps: float | None, *, tolerance: float = 0.03) -> str:
    """``"62% of the theoretical ceiling"``; above it (beyond ``tolerance``) is flagged, never ``110%``."""
    measured_gbps = float(measured_gbps)
    if not ceiling_gbps or ceiling_gbps <= 0 or measured_gbps != measured_gbps:
        return "no theoretical ceiling is known for this link"
    share = measured_gbps / float(ceiling_gbps)
    if share > 1.0 + tolerance:
        return (
            f"ABOVE the theoretical ceiling ({measured_gbps:.1f} > {float(ceiling_gbps):.1f} GB/s), which that "
            "link cannot carry: the ceiling is wrong for this machine (NVML may describe a virtual root port "
            "in a VM, or the copy does not cross PCIe)"
        )
    return f"{share:.0%} of the theoretical ceiling"


def images_nbytes(batch: int, channels: int, height: int, width: int, dtype: str = "uint8") -> int:
    """Bytes of a ``(batch, channels, height, width)`` image tensor in ``dtype``."""
    batch = check_int("batch", batch, 1, 1_000_000)
    channels = check_int("channels", channels, 1, 1024)
    height = check_int("height", height, 1, 65536)
    width = check_int("width", width, 1, 65536)
    dtype = check_choice("dtype", dtype, DTYPES)
    item = torch.empty((), dtype=DTYPES[dtype]).element_size()
    return batch * channels * height * width * item


def break_even_uses(pin_s: float, pageable_copy_s: float, pinned_copy_s: float) -> float:
    """Copies of one buffer after which pinning it (``pin_s`` once) has paid for itself; ``inf``: never."""
    pin_s = check_float("pin_s", pin_s, 0.0)
    pageable_copy_s = check_float("pageable_copy_s", pageable_copy_s, 0.0)
    pinned_copy_s = check_float("pinned_copy_s", pinned_copy_s, 0.0)
    saving = pageable_copy_s - pinned_copy_s
    return pin_s / saving if saving > 0 else math.inf


def pinning_pays(uses: int, pin_s: float, pageable_copy_s: float, pinned_copy_s: float) -> bool:
    """True if pinning once and copying ``uses`` times beats ``uses`` pageable copies."""
    uses = check_int("uses", uses, 1)
    return pin_s + uses * pinned_copy_s < uses * pageable_copy_s
