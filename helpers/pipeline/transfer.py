"""Host <-> GPU copy facts two or more chapters use: whether copies can be measured here, host-RAM guards, the
pinned allocator's counters. Sizes in bytes, times in seconds."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import psutil
import torch

from ..core.device import has_cuda, resolve_device, wrap
from ..core.validate import check_int, human_bytes

NO_CUDA_REASON = (
    "No CUDA device is present (torch.cuda.is_available() is False), so copies between host "
    "and GPU memory cannot be measured on this machine."
)


@dataclass(frozen=True)
class Unavailable:
    """A measurement that could not run here, and why: returned, not raised (a cell prints it and moves on)."""

    what: str
    reason: str

    def __str__(self) -> str:
        return wrap(f"{self.what}: not measured here. {self.reason}")

    def __bool__(self) -> bool:  # `if result:` reads naturally
        return False


def _memory_now() -> tuple[int, int]:
    vm = psutil.virtual_memory()
    return int(vm.total), int(vm.available)


def check_host_bytes(name: str, nbytes: int, *, what: str = "") -> int:
    """``nbytes`` about to be allocated, or ValueError above half the RAM available now (no swap, no OOM)."""
    nbytes, available = check_int(name, nbytes, 0), _memory_now()[1]
    if nbytes > available // 2:
        raise ValueError(
            f"{name}: {what or 'this request'} needs {human_bytes(nbytes)} of host RAM, more than 50% of the "
            f"{human_bytes(available)} available now ({human_bytes(available // 2)}). Choose a smaller size."
        )
    return nbytes


def cuda_status(device: torch.device | str | None = None) -> tuple[bool, str]:
    """``(True, '')`` for a usable CUDA device, else ``(False, reason)``; a misspelt device is a ValueError."""
    if not has_cuda():
        if device is not None:  # the spelling is checked all the same; 'cuda' is absent here, not wrong
            with contextlib.suppress(RuntimeError, TypeError, ValueError):
                device = "cpu" if torch.device(device).type == "cuda" else device
            resolve_device(device)
        return False, NO_CUDA_REASON
    dev = resolve_device(device)
    if dev.type != "cuda":
        return False, f"device {str(dev)!r} is not a CUDA device; pass device='cuda' to measure copies."
    return True, ""


def empty_host_cache() -> str | None:
    """Give the pinned blocks PyTorch's host allocator caches back to the driver, every device synchronised first
    (copies from them may be queued); the call used, or None if this torch has none. CUDA only (callers check:
    on MPS torch 2.13's public call crashes, pytorch/pytorch#197561). ``torch.cuda.empty_cache()`` frees device
    memory only; newer torch has the public ``torch.accelerator.empty_host_cache()`` (pytorch/pytorch#171270), older
    (2.5+) only the private call it wraps."""
    fn = getattr(getattr(torch, "accelerator", None), "empty_host_cache", None)
    name = "torch.accelerator.empty_host_cache()"
    if fn is None:
        fn, name = getattr(torch._C, "_host_emptyCache", None), "torch._C._host_emptyCache()"
    if fn is None:
        return None
    for i in range(torch.cuda.device_count()):
        torch.cuda.synchronize(i)
    fn()
    return name


def host_allocator_stats() -> dict[str, int] | Unavailable:
    """The pinned caching allocator's counters: ``allocated_bytes`` (owned: active + cached, rounded),
    ``active_bytes`` (handed out), ``allocations``, ``num_host_alloc``/``_free`` (cudaHostAlloc, cudaFreeHost)."""
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
    keys = ("allocated_bytes.current", "active_bytes.current", "allocations.current", "num_host_alloc", "num_host_free")
    return {k.removesuffix(".current"): int(raw.get(k, 0)) for k in keys}
