"""Chapter 02's costs of pinning itself: ``tensor.pin_memory()`` cold and cached against what it saves; how long
the CPU is held by a copy queued behind GPU work; the pinned caching allocator's power-of-two blocks. Without CUDA
each measurement returns :class:`~helpers.pipeline.transfer.Unavailable`; the ``*_from_records`` functions rebuild
it from reference records, and the formatters print either kind alike."""

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
from ...pipeline.transfer import Unavailable, break_even_uses, check_host_bytes, cuda_status, host_allocator_stats
from .copies import MEMORY_KINDS, Sweep, _check_device_bytes, _rows, pinning_status, transfer_sweep
from .model import _MAX_BYTES, MiB, check_pin_size, predict_pinned_block


def release_pinned_cache() -> bool:
    """Give cached, unused pinned blocks back to the driver (False if torch can't). Freed pinned tensors stay in
    PyTorch's caching host allocator (``cudaHostAlloc`` is slow); ``torch.cuda.empty_cache()`` releases *device*
    memory only, so the host cache is emptied by the private ``torch._C._host_emptyCache`` (guarded here)."""
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return False
    fn = getattr(torch._C, "_host_emptyCache", None)
    if fn is None:
        return False
    for i in range(torch.cuda.device_count()):  # copies from pinned blocks may be queued on any device
        torch.cuda.synchronize(i)
    fn()
    return True


@dataclass
class RoundingRow:
    """One pinned allocation: requested bytes, predicted block, and what the allocator took."""

    requested: int
    predicted_block: int
    allocated_delta: int | None


def pinned_rounding_demo(sizes: Sequence[int]) -> list[RoundingRow] | Unavailable:
    """Pin each size once, the host cache emptied first so a fresh block is made, and read how many bytes the
    allocator's pool grew by (None if this torch has no host-allocator statistics)."""
    ok, reason = cuda_status()
    if not ok:
        return Unavailable("pinned block rounding", reason)
    rows: list[RoundingRow] = []
    for n in sizes:
        check_pin_size(n)
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
    """What pinning one buffer costs and what it saves, for one size (seconds): ``t.pin_memory()`` when the
    allocator must call ``cudaHostAlloc`` (cold: host cache emptied first) or reuses a cached block (a memcpy);
    one H2D copy from a reused buffer, pageable or pinned (CUDA events); the synchronised wall time of
    ``t.to(dev)`` from pageable memory and of ``t.pin_memory().to(dev, non_blocking=True)`` with a cold
    allocator ("pin once, copy once"). Wall times: medians of ``repeats`` calls."""

    nbytes: int
    block_bytes: int
    pin_cold_s: float
    pin_cached_s: float
    pageable_copy_s: float
    pinned_copy_s: float
    plain_to_s: float
    pin_then_copy_s: float

    @property
    def saving_per_copy_s(self) -> float:
        return self.pageable_copy_s - self.pinned_copy_s

    @property
    def break_even_cold(self) -> float:
        """Copies of one buffer needed before a cold pin pays off."""
        return break_even_uses(self.pin_cold_s, self.pageable_copy_s, self.pinned_copy_s)


#: ``ch02.pin.<key>`` records -> the :class:`PinCost` field each holds (written by ``ch02.benchmark``).
RECORD_FIELDS = {
    "cold": "pin_cold_s",
    "cached": "pin_cached_s",
    "pageable_copy": "pageable_copy_s",
    "pinned_copy": "pinned_copy_s",
    "plain_to": "plain_to_s",
    "pin_then_copy": "pin_then_copy_s",
}


def _wall(fn: Callable[[], Any], dev: torch.device) -> float:
    """One call of ``fn``, wall clock, synchronised with ``dev`` before and after."""
    return time_calls(fn, repeats=1, device=dev).median_s


def pin_cost(nbytes: int, *, device: torch.device | str | None = None, repeats: int = 5) -> PinCost | Unavailable:
    """Measure pinning itself against the copy time it saves, at one size (H2D). Without CUDA:
    :class:`Unavailable` with the driver's own error (:func:`pinning_status`)."""
    nbytes = check_int("nbytes", nbytes, 1, _MAX_BYTES)
    ok, reason = cuda_status(device)
    if not ok:
        return Unavailable(f"cost of pinning {human_bytes(nbytes)}", reason + " " + pinning_status()[1])
    dev = resolve_device(device)
    block = check_pin_size(nbytes)
    check_host_bytes("nbytes", nbytes, what=f"the pageable source of {human_bytes(nbytes)}")
    _check_device_bytes("nbytes", 2 * nbytes, dev, f"two device copies of {human_bytes(nbytes)}")
    src = torch.ones(nbytes, dtype=torch.uint8)
    cold, cached, plain, pin_copy = [], [], [], []
    # noqa F821: each lambda runs before the `del src` in `finally` (which frees it even if a traceback holds us)
    try:
        plain.append(_wall(lambda: src.to(dev), dev))  # noqa: F821  (warm-up: CUDA context, device cache)
        for _ in range(repeats):
            release_pinned_cache()
            cold.append(_wall(lambda: src.pin_memory(), dev))  # noqa: F821  (block freed on return, stays cached)
            cached.append(_wall(lambda: src.pin_memory(), dev))  # noqa: F821
            plain.append(_wall(lambda: src.to(dev), dev))  # noqa: F821
            release_pinned_cache()
            pin_copy.append(_wall(lambda: src.pin_memory().to(dev, non_blocking=True), dev))  # noqa: F821
        reps = max(repeats, 5)
        pageable, pinned = (transfer_sweep("h2d", m, [nbytes], device=dev, repeats=reps) for m in MEMORY_KINDS)
        assert isinstance(pageable, Sweep) and isinstance(pinned, Sweep)
    finally:
        del src
        torch.cuda.empty_cache()
    med = statistics.median
    copy_s = (pageable.points[0].median_s, pinned.points[0].median_s)
    return PinCost(nbytes, block, med(cold), med(cached), *copy_s, med(plain[1:]), med(pin_copy))


@dataclass
class HostBlocking:
    """How long the CPU was held inside a copy call queued behind GPU work (seconds)."""

    nbytes: int
    gpu_work_s: float
    held_s: dict[str, float]
    method: str = ""


_CASES = {
    "pageable": ("pageable", False),
    "pageable, non_blocking=True": ("pageable", True),
    "pinned, non_blocking=True": ("pinned", True),
}


def _held(dst: torch.Tensor, src: torch.Tensor, nb: bool, work: Callable[[], None], dev: torch.device, n: int) -> float:
    """Median host time of the call ``dst.copy_(src)`` queued right behind ``work()`` (``n`` times, after a warm-up)."""
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
    *, device: torch.device | str | None = None, gpu_work_s: float = 0.1, nbytes: int = 64 * MiB, repeats: int = 3
) -> HostBlocking | Unavailable:
    """Queue ``gpu_work_s`` of GPU work, then time (host clock) the H2D copy *call* of each of :data:`_CASES`: a
    call that holds the host about as long as the work waited for the GPU; one that returns at once let the CPU
    run ahead."""
    gpu_work_s = check_float("gpu_work_s", gpu_work_s, 0.001, 5.0)
    nbytes = check_int("nbytes", nbytes, 1, _MAX_BYTES)
    repeats = check_int("repeats", repeats, 1, 100)
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
        held = {name: _held(dst, bufs[kind], nb, work, dev, repeats) for name, (kind, nb) in _CASES.items()}
    finally:
        torch.cuda.synchronize(dev)
        bufs.clear()
        del dst
        torch.cuda.empty_cache()
    how = f"GPU work: torch.cuda._sleep on the current stream; copy call timed with perf_counter, median of {repeats}"
    return HostBlocking(nbytes, measured_work, held, how)


def pin_costs_from_records(result_set: Any, records: Iterable[Any]) -> list[PinCost] | None:
    """:class:`PinCost` rows from ``ch02.pin.*`` records (sizes with all six fields); None if none has them."""
    by_size: dict[int, dict[str, float]] = {}
    for key, params, value, _ in _rows(records, "ch02.pin"):
        by_size.setdefault(int(params.get("nbytes", 0)), {})[key.rsplit(".", 1)[1]] = value
    rows = [
        PinCost(n, predict_pinned_block(n), **{name: f[k] for k, name in RECORD_FIELDS.items()})
        for n, f in sorted(by_size.items())
        if n > 0 and set(RECORD_FIELDS) <= set(f)
    ]
    return rows or None


def host_blocking_from_records(result_set: Any, records: Iterable[Any]) -> HostBlocking | None:
    """A :class:`HostBlocking` from ``ch02.host_held`` records (one per case, of the first probe); None if none."""
    rows = [(p, v) for _, p, v, _ in _rows(records, "ch02.host_held") if "case" in p]
    if not rows:
        return None
    first = rows[0][0]
    held = {str(p["case"]): v for p, v in rows if p.get("gpu_work_s") == first.get("gpu_work_s")}
    return HostBlocking(int(first.get("nbytes", 0)), float(first.get("gpu_work_s", 0.0)), held)


def rounding_rows_from_records(result_set: Any, records: Iterable[Any]) -> list[RoundingRow] | None:
    """:class:`RoundingRow` s from ``ch02.pinned_block`` records (the pool growth per request); None if none."""
    asked = sorted(
        (int(p["requested"]), int(v)) for _, p, v, _ in _rows(records, "ch02.pinned_block") if "requested" in p
    )
    return [RoundingRow(n, predict_pinned_block(n), grew) for n, grew in asked] or None


def pin_cost_table(rows: Sequence[PinCost]) -> str:
    """Pinning cost against copy saving, one line per size (:func:`helpers.core.rounds.table`)."""
    head = ["size", "pin (cold)", "pin (cached)", "pageable copy", "pinned copy", "to() plain", "pin+copy once"]
    cells = []
    for r in rows:
        be = r.break_even_cold
        pays = "never" if math.isinf(be) else f"{math.ceil(be) if be > 0 else 0} uses"
        times = (r.pin_cold_s, r.pin_cached_s, r.pageable_copy_s, r.pinned_copy_s, r.plain_to_s, r.pin_then_copy_s)
        cells.append([human_bytes(r.nbytes), *map(human_seconds, times), pays])
    return "\n".join(table([*head, "pays after"], cells, left=0, gap=1))


def host_blocking_lines(probe: HostBlocking) -> list[str]:
    """The probe as printed lines: the GPU work queued ahead, then the time each copy call held the CPU."""
    how = f" ({probe.method})" if probe.method else ""
    lines = [wrap(f"GPU work queued ahead of the copy: {probe.gpu_work_s * 1e3:.1f} ms{how}", indent="  ")]
    lines += [f"  {case:<28} CPU held for {s * 1e3:8.3f} ms" for case, s in probe.held_s.items()]
    return lines


def rounding_lines(rows: Sequence[RoundingRow]) -> list[str]:
    """One line per pin: requested, how much the pinned pool grew, and the predicted power-of-two block."""
    out = []
    for r in rows:
        d = r.allocated_delta
        grew = "an unknown amount (no host_memory_stats)" if d is None else f"{d / MiB:.0f} MiB"
        block = f"{r.predicted_block / MiB:.0f} MiB"
        out.append(f"  requested {r.requested / MiB:.0f} MiB: pool grew by {grew} (predicted {block})")
    return out
