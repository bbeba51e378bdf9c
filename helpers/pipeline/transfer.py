"""Host <-> GPU copy facts two or more chapters use (chapter 02's experiments are in :mod:`helpers.chapters.ch02`).

Here, one job per function:

* :func:`cuda_status` - whether copies to a device can be measured here, and if not the one sentence why;
  :class:`Unavailable` / :func:`is_available` - what a measurement that needs CUDA returns without it.
* :func:`check_host_bytes` - refuse (one line) host buffers larger than the RAM available now
  (chapter 00's hygiene operations, chapter 02's copies).
* :func:`images_nbytes`, :func:`break_even_uses`, :func:`pinning_pays` - bytes on the wire, and when
  pinning a buffer pays for itself (chapter 02, and the course's answer key).
* :func:`host_allocator_stats` - the pinned caching allocator's counters (chapter 02, chapter 06's waterfall).

Chapter 02's own measurements - the sweep of the reader's ``time_copy``, the helper's CUDA-event copies,
the latency + bandwidth fit, the host memcpy reference - are in :mod:`helpers.chapters.ch02.copies`; what
pinning itself costs, the host-blocking probe and the allocator's rounding are in
:mod:`helpers.chapters.ch02.pin_costs`.

Units: sizes in bytes, times in seconds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from ..core.device import has_cuda, resolve_device, wrap
from ..core.validate import check_choice, check_float, check_int, human_bytes

__all__ = [
    "DTYPES",
    "NO_CUDA_REASON",
    "Unavailable",
    "is_available",
    "check_host_bytes",
    "images_nbytes",
    "break_even_uses",
    "pinning_pays",
    "cuda_status",
    "host_allocator_stats",
]


DTYPES: dict[str, torch.dtype] = {"uint8": torch.uint8, "float32": torch.float32}
NO_CUDA_REASON = (
    "No CUDA device is present (torch.cuda.is_available() is False), so copies between host "
    "and GPU memory cannot be measured on this machine."
)


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


# ---------------------------------------------------------------------------
# Pure logic
# ---------------------------------------------------------------------------


def _memory_now() -> tuple[int, int]:
    import psutil

    vm = psutil.virtual_memory()
    return int(vm.total), int(vm.available)


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


# ---------------------------------------------------------------------------
# The pinned caching allocator (chapter 02, and chapter 06's waterfall reports it)
# ---------------------------------------------------------------------------


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
