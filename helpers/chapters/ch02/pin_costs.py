"""Chapter 02's costs of pinning itself: ``pin_memory()`` cold and cached against what it saves, the CPU held by a
copy queued behind GPU work, the pinned allocator's power-of-two blocks. Without CUDA each measurement returns
:class:`~helpers.pipeline.transfer.Unavailable`; ``*_from_records`` rebuild it from reference records."""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import torch

from ...core.device import resolve_device, wrap
from ...core.rounds import table
from ...core.timing import GpuDelay, cuda_event_time, time_calls
from ...core.validate import check_float, check_int, human_bytes, human_seconds
from ...pipeline.transfer import (
    Unavailable,
    check_host_bytes,
    cuda_status,
    empty_host_cache,
    host_allocator_stats,
)
from .copies import MEMORY_KINDS, _check_device_bytes, pinning_status, transfer_sweep
from .model import _MAX_BYTES, MiB, break_even_uses, check_pin_size, predict_pinned_block


@dataclass
class PinnedBlocks:
    """Pinned allocations: ``(requested bytes, what the allocator's pool grew by, None if unknown)`` each."""

    rows: list[tuple[int, int | None]]

    def lines(self) -> list[str]:
        out = []
        for n, d in self.rows:
            grew = "an unknown amount (no host_memory_stats)" if d is None else f"{d / MiB:.0f} MiB"
            predicted = f"{predict_pinned_block(n) / MiB:.0f} MiB"
            out.append(f"  requested {n / MiB:.0f} MiB: pool grew by {grew} (predicted {predicted})")
        return out


def pinned_rounding_demo(sizes: Sequence[int]) -> PinnedBlocks | Unavailable:
    """Pin each size once, the host cache emptied first, and read how much the allocator's pool grew."""
    ok, reason = cuda_status()
    if not ok:
        return Unavailable("pinned block rounding", reason)
    rows: list[tuple[int, int | None]] = []
    for n in sizes:
        check_pin_size(n)
        empty_host_cache()
        before = host_allocator_stats()
        t = torch.empty(n, dtype=torch.uint8, pin_memory=True)
        after = host_allocator_stats()
        del t  # back to the allocator's cache; released before the next size
        both = isinstance(before, dict) and isinstance(after, dict)
        rows.append((n, after["allocated_bytes"] - before["allocated_bytes"] if both else None))  # type: ignore[index]
    empty_host_cache()
    return PinnedBlocks(rows)


@dataclass
class PinCost:
    """What pinning one buffer costs and saves, in seconds: ``pin_memory()`` with a cold allocator (host cache
    emptied: ``cudaHostAlloc``) and a cached block; one H2D copy from a reused pageable or pinned buffer (CUDA
    events); synchronised wall times of ``t.to(dev)`` and of "pin once, copy once" (cold). Medians."""

    nbytes: int
    cold: float
    cached: float
    pageable_copy: float
    pinned_copy: float
    plain_to: float
    pin_then_copy: float

    @property
    def saving_per_copy(self) -> float:
        return self.pageable_copy - self.pinned_copy

    @property
    def break_even_cold(self) -> float:  # copies of one buffer before a cold pin pays off
        return break_even_uses(self.cold, self.pageable_copy, self.pinned_copy)


#: The seconds fields of :class:`PinCost`, each recorded as ``ch02.pin.<field>``.
RECORD_FIELDS = ("cold", "cached", "pageable_copy", "pinned_copy", "plain_to", "pin_then_copy")


def _wall(fn: Callable[[], Any], dev: torch.device) -> float:
    return time_calls(fn, repeats=1, device=dev).median_s


def pin_cost(nbytes: int, *, device: torch.device | str | None = None) -> PinCost | Unavailable:
    """Pinning itself against the H2D copy time it saves, at one size; without CUDA, the driver's own error."""
    nbytes = check_int("nbytes", nbytes, 1, _MAX_BYTES)
    ok, reason = cuda_status(device)
    if not ok:
        return Unavailable(f"cost of pinning {human_bytes(nbytes)}", reason + " " + pinning_status()[1])
    dev = resolve_device(device)
    check_pin_size(nbytes)
    check_host_bytes("nbytes", nbytes, what=f"the pageable source of {human_bytes(nbytes)}")
    _check_device_bytes("nbytes", 2 * nbytes, dev, f"two device copies of {human_bytes(nbytes)}")
    src = torch.ones(nbytes, dtype=torch.uint8)
    cold, cached, plain, pin_copy = [], [], [], []
    # noqa F821: each lambda runs before the `del src` in `finally` (which frees it even if a traceback holds us)
    try:
        plain.append(_wall(lambda: src.to(dev), dev))  # noqa: F821  (warm-up: CUDA context, device cache)
        for _ in range(5):
            empty_host_cache()
            cold.append(_wall(lambda: src.pin_memory(), dev))  # noqa: F821  (block freed on return, stays cached)
            cached.append(_wall(lambda: src.pin_memory(), dev))  # noqa: F821
            plain.append(_wall(lambda: src.to(dev), dev))  # noqa: F821
            empty_host_cache()
            pin_copy.append(_wall(lambda: src.pin_memory().to(dev, non_blocking=True), dev))  # noqa: F821
        pageable, pinned = (transfer_sweep("h2d", m, [nbytes], device=dev, repeats=5) for m in MEMORY_KINDS)
    finally:
        del src
        torch.cuda.empty_cache()
    med = statistics.median
    copy_s = (pageable.points[0].median_s, pinned.points[0].median_s)
    return PinCost(nbytes, med(cold), med(cached), *copy_s, med(plain[1:]), med(pin_copy))


@dataclass
class HostBlocking:
    """How long the CPU was held inside a copy call queued behind GPU work (seconds)."""

    nbytes: int
    gpu_work_s: float
    held_s: dict[str, float]
    method: str = ""

    def lines(self) -> list[str]:
        how = f" ({self.method})" if self.method else ""
        lines = [wrap(f"GPU work queued ahead of the copy: {self.gpu_work_s * 1e3:.1f} ms{how}", indent="  ")]
        return lines + [f"  {case:<28} CPU held for {s * 1e3:8.3f} ms" for case, s in self.held_s.items()]


_CASES = {
    "pageable": ("pageable", False),
    "pageable, non_blocking=True": ("pageable", True),
    "pinned, non_blocking=True": ("pinned", True),
}


def _held(dst: torch.Tensor, src: torch.Tensor, nb: bool, work: Callable[[], None], dev: torch.device, n: int) -> float:
    """Median host time of the call ``dst.copy_(src)`` queued right behind ``work()``."""
    dst.copy_(src, non_blocking=nb)
    samples = []
    for _ in range(n):
        torch.cuda.synchronize(dev)
        work()  # queued on the current stream, ahead of the copy
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=nb)
        samples.append(time.perf_counter() - t0)
        torch.cuda.synchronize(dev)
    return statistics.median(samples)


def host_blocking_probe(
    *, device: torch.device | str | None = None, gpu_work_s: float = 0.1, nbytes: int = 64 * MiB
) -> HostBlocking | Unavailable:
    """Queue ``gpu_work_s`` of GPU work, then time (host clock) the H2D copy *call* of each of :data:`_CASES`, 3
    times: one that holds the host as long as the work waited for the GPU; one that returns at once let the CPU run
    ahead."""
    gpu_work_s = check_float("gpu_work_s", gpu_work_s, 0.001, 5.0)
    nbytes = check_int("nbytes", nbytes, 1, _MAX_BYTES)
    ok, reason = cuda_status(device)
    if not ok:
        return Unavailable("host-blocking probe", reason)
    dev = resolve_device(device)
    check_pin_size(nbytes)
    check_host_bytes("nbytes", nbytes, what=f"the pageable source of {human_bytes(nbytes)}")
    _check_device_bytes("nbytes", nbytes, dev, f"a device buffer of {human_bytes(nbytes)}")
    bufs: dict[str, torch.Tensor] = {}
    dst = None
    try:
        work = GpuDelay(dev, gpu_work_s)
        measured_work = cuda_event_time(work, repeats=1, warmup=0, device=dev).median_s
        dst = torch.empty(nbytes, dtype=torch.uint8, device=dev)
        bufs["pageable"] = torch.ones(nbytes, dtype=torch.uint8)
        bufs["pinned"] = torch.ones(nbytes, dtype=torch.uint8, pin_memory=True)
        held = {name: _held(dst, bufs[kind], nb, work, dev, 3) for name, (kind, nb) in _CASES.items()}
    finally:
        torch.cuda.synchronize(dev)
        bufs.clear()
        del dst
        torch.cuda.empty_cache()
    how = "GPU work: torch.cuda._sleep on the current stream; copy call timed with perf_counter, median of 3"
    return HostBlocking(nbytes, measured_work, held, how)


def pin_costs_from_records(result_set: Any, records: Iterable[Any]) -> list[PinCost] | None:
    """:class:`PinCost` rows from ``ch02.pin.*`` records (sizes with every field); None if none has them."""
    by_size: dict[int, dict[str, float]] = {}
    for r in records:
        by_size.setdefault(int(r.params.get("nbytes", 0)), {})[r.key.rsplit(".", 1)[1]] = r.value
    rows = [
        PinCost(n, **{k: f[k] for k in RECORD_FIELDS})
        for n, f in sorted(by_size.items())
        if n > 0 and set(RECORD_FIELDS) <= set(f)
    ]
    return rows or None


def host_blocking_from_records(result_set: Any, records: Iterable[Any]) -> HostBlocking | None:
    """A :class:`HostBlocking` from ``ch02.host_held`` records (the first probe's cases); None if none."""
    rows = [(r.params, r.value) for r in records if "case" in r.params]
    if not rows:
        return None
    first = rows[0][0]
    held = {str(p["case"]): v for p, v in rows if p.get("gpu_work_s") == first.get("gpu_work_s")}
    return HostBlocking(int(first.get("nbytes", 0)), float(first.get("gpu_work_s", 0.0)), held)


def pinned_blocks_from_records(result_set: Any, records: Iterable[Any]) -> PinnedBlocks | None:
    """:class:`PinnedBlocks` from ``ch02.pinned_block`` records; None if none."""
    asked = sorted((int(r.params["requested"]), int(r.value)) for r in records if "requested" in r.params)
    return PinnedBlocks(list(asked)) if asked else None


def pin_cost_table(rows: Sequence[PinCost]) -> str:
    head = ["size", "pin (cold)", "pin (cached)", "pageable copy", "pinned copy", "to() plain", "pin+copy once"]
    cells = []
    for r in rows:
        be = r.break_even_cold
        pays = "never" if math.isinf(be) else f"{math.ceil(be) if be > 0 else 0} uses"
        cells.append([human_bytes(r.nbytes), *(human_seconds(getattr(r, k)) for k in RECORD_FIELDS), pays])
    return "\n".join(table([*head, "pays after"], cells, left=0, gap=1))
