"""Chapter 05's hazards of asynchronous copies, each run buggy and fixed, counting what went wrong. The races need a
GPU; on a CPU the results say so."""

from __future__ import annotations

import functools
import io
import math
import textwrap
import time
import warnings
from dataclasses import dataclass
from inspect import getsource
from typing import Any, Callable

import torch

from ...core import evidence
from ...core.config import sized
from ...core.device import resolve_device
from ...core.results import Record, ResultSet
from ...core.timing import GpuDelay, synchronize
from ...core.validate import check_int, human_seconds

N = 4 << 20  # elements copied in hazards 1 and 2


@dataclass
class HazardResult:
    """A buggy and a fixed run of one hazard: what each counted, and both functions' source."""

    name: str
    device: str
    on_gpu: bool
    bug: dict[str, Any]
    fix: dict[str, Any]
    code_bug: str
    code_fix: str
    explanation: str
    key: str  # what the benchmark records it under

    def report(self) -> str:
        lines = [f"{self.name} (on {self.device})"]
        lines.append("  buggy version: " + ", ".join(f"{k} = {_text(v)}" for k, v in self.bug.items()))
        lines.append("  fixed version: " + ", ".join(f"{k} = {_text(v)}" for k, v in self.fix.items()))
        lines.append("  " + self.explanation)
        return "\n".join(textwrap.fill(ln, 105, subsequent_indent="    ") for ln in lines)

    def show(self) -> None:
        """The buggy and the fixed code, the report; without a GPU, what one recorded (or that none is recorded)."""
        print(self.code_bug, self.code_fix, self.report(), sep="\n")
        if not self.on_gpu:
            evidence.recorded(RECORDED_AS[self.key], self.key, convert=_recorded_lines).show(list)


def _text(value: Any) -> str:
    """A count with thousands separators (4,194,304); anything else as it is."""
    return f"{value:,}" if isinstance(value, int) and not isinstance(value, bool) else str(value)


#: What each hazard's recording is called, by its key (each key written here only: a HazardResult carries it).
RECORDED_AS = {
    "ch05.hazard.d2h_wrong": "hazard 1 on a GPU",
    "ch05.hazard.mutation_wrong": "hazard 2 on a GPU",
    "ch05.hazard.syncs": "the synchronisation counts of hazard 3",
}
_D2H_KEY, _MUTATION_KEY, _SYNCS_KEY = RECORDED_AS


def _recorded_lines(rs: ResultSet, records: list[Record]) -> list[str]:
    """Hazards 1 and 2: wrong elements per version; hazard 3: synchronisations per loop, then per line alone."""
    if records[0].key != _SYNCS_KEY:
        return [
            f"  {r.params.get('variant')} version: {r.value:,.0f} of {int(r.params.get('n', 0)):,} elements wrong"
            for r in records
        ]
    loops = [(r.params.get("variant"), int(r.params.get("steps") or 1), r.value) for r in records]
    lines = [f"  {v} loop, {n} steps: {value:.0f} synchronisations ({value / n:.2f} per step)" for v, n, value in loops]
    return lines + [f"  {r.params.get('line')} alone: {r.value:.0f}" for r in rs.find("ch05.hazard.syncs_per_line")]


def _result(
    name: str, dev: torch.device, code: tuple[Any, ...], counts: list[Any], why: dict[bool, str], key: str
) -> HazardResult:
    on_gpu, (bug, fix), (code_bug, code_fix) = dev.type == "cuda", counts, map(getsource, code)
    return HazardResult(name, str(dev), on_gpu, bug, fix, code_bug, code_fix, why[on_gpu], key)


def _d2h_bug(x_gpu: torch.Tensor, out: torch.Tensor) -> int:
    """BUG: read the result of a non-blocking device-to-host copy before synchronising."""
    out.copy_(x_gpu, non_blocking=True)  # returns at once: the copy is only queued
    return int((out != 1).sum())  # reads `out` now, while the copy may not have run yet


def _d2h_fix(x_gpu: torch.Tensor, out: torch.Tensor) -> int:
    """FIX: wait for exactly this copy (an event) before reading the host tensor."""
    out.copy_(x_gpu, non_blocking=True)
    if x_gpu.is_cuda:
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(x_gpu.device))  # on the stream the copy went to
        done.synchronize()  # the host waits until the GPU has passed this point
    return int((out != 1).sum())


_D2H_WHY = {
    True: "The buggy read happened while the copy was still queued behind GPU work, so it saw the "
    "buffer's old contents; after a sync the same buffer is right. Wait on an event (or "
    "synchronise the stream) before reading a non-blocking device-to-host copy.",
    False: "On a CPU the copy is synchronous, so both versions read correct values here. On a GPU, "
    "copy_(..., non_blocking=True) into pinned memory returns before the copy runs and the buggy "
    "read sees stale values (pytorch/pytorch#86264, #137878).",
}


def hazard_d2h_read_before_sync(device: torch.device | str | None = None) -> HazardResult:
    """Elements of a non-blocking D2H copy read wrong, without and with a wait (ones arrive behind queued work)."""
    dev = resolve_device(device)
    on_gpu = dev.type == "cuda"

    def run(fn: Callable[[torch.Tensor, torch.Tensor], int]) -> dict[str, Any]:
        out = torch.full((N,), -1.0, pin_memory=on_gpu)
        x = torch.empty(N, device=dev)
        if on_gpu:
            GpuDelay(dev)()  # the GPU is busy for a while ...
        x.fill_(1.0)  # ... so x only becomes all ones later
        wrong = fn(x, out)
        synchronize(dev)
        return {
            "wrong elements when read": wrong,
            "elements copied": N,
            "wrong after a later sync": int((out != 1).sum()),
        }

    name, code = "non-blocking device-to-host copy read before a sync", (_d2h_bug, _d2h_fix)
    return _result(name, dev, code, [run(fn) for fn in code], _D2H_WHY, _D2H_KEY)


def _mutation_bug(src: torch.Tensor, dst: torch.Tensor) -> None:
    """BUG: change a pinned source before its asynchronous copy has read it."""
    dst.copy_(src, non_blocking=True)  # queued; the DMA reads src later
    src.fill_(2.0)  # the next batch overwrites the buffer: the copy may read 2s


def _mutation_fix(src: torch.Tensor, dst: torch.Tensor) -> None:
    """FIX: record an event after the copy and wait for it before reusing the source."""
    dst.copy_(src, non_blocking=True)
    if dst.is_cuda:
        copied = torch.cuda.Event()
        copied.record(torch.cuda.current_stream(dst.device))  # on the stream the copy went to
        copied.synchronize()  # or: keep two source buffers and alternate
    src.fill_(2.0)


_MUTATION_WHY = {
    True: "The copy ran after the host had overwritten the pinned buffer, so the device received "
    "the next batch's values. Wait for an event recorded after the copy, or alternate between "
    "two pinned buffers, before writing into a source again (pytorch/pytorch#127612).",
    False: "On a CPU the copy finishes inside copy_(), so changing the source afterwards is harmless. On "
    "a GPU the copy from pinned memory is only queued; the DMA reads the buffer later, and if the "
    "host has refilled it the device gets the new values (pytorch/pytorch#127612).",
}


def hazard_pinned_source_mutation(device: torch.device | str | None = None) -> HazardResult:
    """Device elements that got the host's next value: the pinned source refilled while its copy waited."""
    dev = resolve_device(device)
    on_gpu = dev.type == "cuda"

    def run(fn: Callable[[torch.Tensor, torch.Tensor], None]) -> dict[str, Any]:
        src = torch.ones(N, pin_memory=on_gpu)
        dst = torch.zeros(N, device=dev)
        if on_gpu:
            GpuDelay(dev)()
        fn(src, dst)
        synchronize(dev)
        return {"elements that arrived wrong": int((dst != 1).sum()), "elements copied": N}

    name, code = "pinned source modified before its asynchronous copy ran", (_mutation_bug, _mutation_fix)
    return _result(name, dev, code, [run(fn) for fn in code], _MUTATION_WHY, _MUTATION_KEY)


def _loop_hidden_syncs(x: torch.Tensor, w: torch.Tensor, steps: int, sink: io.StringIO) -> float:
    """BUG: synchronisations hide in three innocent-looking lines of every step."""
    for _ in range(steps):
        loss = (x @ w).relu().mean()
        value = loss.item()  # sync: copies the value to the host and waits for it
        print(loss, file=sink)  # several syncs: formatting reads the value on the host again and again
        _ = loss.cpu()  # sync: a blocking device-to-host copy
    return value


def _loop_no_syncs(x: torch.Tensor, w: torch.Tensor, steps: int, sink: io.StringIO) -> float:
    """FIX: keep the running loss on the device and read it once, after the loop."""
    total = torch.zeros((), device=x.device)
    for _ in range(steps):
        loss = (x @ w).relu().mean()
        total += loss.detach()  # stays on the device: no sync
    value = (total / steps).item()  # one sync, at the end
    print(f"mean loss {value:.4f}", file=sink)
    return value


def _count_syncs(fn: Callable[[], Any], dev: torch.device) -> tuple[int, float]:
    """(synchronisations torch's sync debug mode reports, wall seconds) of ``fn`` on CUDA ``dev``."""
    old = torch.cuda.get_sync_debug_mode()
    torch.cuda.synchronize(dev)  # dev's queued work, not the current device's
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            t0 = time.perf_counter()
            fn()
            torch.cuda.set_sync_debug_mode(old)
            torch.cuda.synchronize(dev)
            seconds = time.perf_counter() - t0
        finally:
            torch.cuda.set_sync_debug_mode(old)
    return sum(1 for w in caught if "synchroniz" in str(w.message).lower()), seconds


#: Why ``print(loss)`` costs more than one synchronisation (read in torch/_tensor_str.py, torch 2.14).
PRINT_SYNCS_WHY = (
    "print(loss) is not one read: torch/_tensor_str.py first picks the finite, non-zero values with "
    "torch.masked_select (its output size depends on the data, so the host waits to learn it), then, to "
    "choose a format, tests each value against its ceiling and the ranges that switch to scientific notation "
    "(each `if` on a CUDA tensor is a .item(): one wait each), and finally formats the value (.item() again)."
)
_SYNCS_WHY = {
    True: "Each synchronisation stops the CPU until the GPU has caught up, so the CPU cannot queue the next "
    "step (or prepare the next batch) meanwhile. " + PRINT_SYNCS_WHY + " The fixed loop keeps the "
    "value on the device and reads it once, after the loop.",
    False: "On a CPU every operation finishes before the next line runs, so nothing waits. On a GPU, "
    "torch.cuda.set_sync_debug_mode('warn') reports each synchronising call and this function counts "
    "them, per step and per line. " + PRINT_SYNCS_WHY,
}


def hazard_hidden_syncs(device: torch.device | str | None = None, steps: int | None = None) -> HazardResult:
    """Synchronisations (sync debug mode) of a loop with ``.item()``, ``print``, ``.cpu()``, of each line, the fix."""
    dev = resolve_device(device)
    steps = check_int("steps", steps if steps is not None else sized(20, 200, laptop=50), 1, 100_000)
    name, code = "synchronisations hidden in .item(), print and .cpu()", (_loop_hidden_syncs, _loop_no_syncs)
    if dev.type != "cuda":  # nothing waits on a CPU: the lines, named, and nothing run
        no = {"steps": steps, "synchronisations": "not counted: no CUDA device"}
        bug = {"lines that synchronise on a GPU, per step": ".item(), print(loss), .cpu()", **no}
        fix = {"lines that synchronise on a GPU": "one .item(), after the loop", **no}
        return _result(name, dev, code, [bug, fix], _SYNCS_WHY, _SYNCS_KEY)
    size, g = 1024, torch.Generator().manual_seed(0)
    x = torch.randn(size, size, generator=g).to(dev)
    w = (torch.randn(size, size, generator=g) / math.sqrt(size)).to(dev)
    sink = io.StringIO()
    _loop_no_syncs(x, w, 2, sink)  # warm-up
    synchronize(dev)
    (n_bug, s_bug), (n_fix, s_fix) = (_count_syncs(functools.partial(fn, x, w, steps, sink), dev) for fn in code)
    loss = (x @ w).relu().mean()
    print_loss = functools.partial(print, loss, file=sink)
    lines: dict[str, Callable[[], Any]] = {".item()": loss.item, "print(loss)": print_loss, ".cpu()": loss.cpu}
    bug = {"synchronisations": n_bug, "steps": steps, "per step": round(n_bug / steps, 2)}
    bug.update({f"{k} alone": _count_syncs(fn, dev)[0] for k, fn in lines.items()})
    bug["loop time"] = human_seconds(s_bug)
    fix = {"synchronisations": n_fix, "steps": steps, "loop time": human_seconds(s_fix)}
    return _result(name, dev, code, [bug, fix], _SYNCS_WHY, _SYNCS_KEY)
