"""Host <-> GPU copy facts two or more chapters use: whether copies can be measured here, host-RAM guards, bytes
on the wire, when pinning pays, the pinned allocator's counters. Sizes in bytes, times in seconds."""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import psutil
import torch

from ..core.device import has_cuda, resolve_device, wrap
from ..core.validate import check_choice, check_float, check_int, human_bytes

DTYPES: dict[str, torch.dtype] = {"uint8": torch.uint8, "float32": torch.float32}
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
