"""Chapter 05: overlapping the host-to-device copy with compute.

The 2x2 experiment
------------------
:func:`run_cell` runs one configuration of ``{pageable, pinned} x {default, side}``:
each step copies the *next* batch (``copy_mib`` MiB of float32) while it
computes on the *current* one (``torch.mm`` of ``matmul_n x matmul_n``), then
synchronises, as a training loop that logs its loss each step does. Copy and
compute are recorded with CUDA events through :class:`helpers.core.timing.SpanRecorder`,
one lane per stream, plus a host lane showing where the CPU thread waited.

Two labels come back, and they are derived independently:

* ``expected`` — from the configuration alone (:func:`expected_label`): overlap
  needs a pinned source AND a side stream (AND a free copy engine, which every
  current NVIDIA GPU has).
* ``measured`` — from the recorded spans (:func:`overlap_fraction`): the share of
  the shorter activity that ran at the same time as the other. Without a GPU
  there is nothing to measure and it is ``None``.

Why the other three cells serialise:

* pinned + default stream — one stream runs its work in order: the compute
  queued after the copy starts when the copy ends.
* pageable + side stream — a copy from pageable memory is staged by the driver
  through a pinned bounce buffer, and the call holds the host until the data
  is staged; the compute is queued only after that, so it cannot run alongside.
* pageable + default stream — both reasons.

Hazards
-------
:func:`hazard_d2h_read_before_sync`, :func:`hazard_pinned_source_mutation` and
:func:`hazard_hidden_syncs` each run a buggy and a fixed version and count what
went wrong. The bugs are races that only a GPU can show; on a CPU the copies are
synchronous and the functions say so instead of pretending.

Nothing here invents a number: :func:`schematic_trace` draws what each cell
*looks like* and is labelled "schematic, not measured" everywhere it appears.
What a GPU recorded elsewhere comes back as an :class:`~helpers.core.evidence.Evidence`
with its provenance (:func:`reference_cell`, :func:`timeline_evidence`,
:func:`sync_counts_reference`), and the ``convert``/format pairs here
(:func:`copy_call_rows_from_records` / :func:`copy_call_table`, ...) let the notebook
show a measurement or its recording with one call. The chapter's live panel and its
benchmark are in :mod:`helpers.chapters.ch05`.
"""

from __future__ import annotations

import inspect
import io
import math
import statistics
import textwrap
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch

from ...core import evidence
from ...core.config import sized
from ...core.device import resolve_device
from ...core.evidence import Evidence
from ...core.results import Record, ResultSet
from ...core.timing import GpuDelay, Span, SpanRecorder, SpanTrace, calibrated_compute, synchronize
from ...core.validate import check_choice, check_int, human_seconds
from ...pipeline.data import to_float_normalized
from ...pipeline.prefetch import Prefetcher, _loop_time

__all__ = [
    "MEMORY_KINDS",
    "STREAM_KINDS",
    "CELLS",
    "HOST_LANE",
    "OVERLAP_THRESHOLD",
    "expected_label",
    "expected_reason",
    "lanes_for",
    "overlap_fraction",
    "measured_label",
    "CellResult",
    "run_cell",
    "run_grid",
    "CopyCallRow",
    "copy_call_rows",
    "copy_call_rows_from_records",
    "copy_call_table",
    "schematic_trace",
    "artifact_name",
    "reference_cell",
    "timeline_evidence",
    "draw_cell",
    "HazardResult",
    "hazard_d2h_read_before_sync",
    "hazard_pinned_source_mutation",
    "hazard_hidden_syncs",
    "PRINT_SYNCS_WHY",
    "sync_counts_reference",
    "sync_count_lines",
    "hazard_count_lines",
    "BatchTimes",
    "IN_LINE",
    "PREFETCHED",
    "NO_COPY",
    "preload",
    "time_batches",
    "PREFETCH_REFERENCE_WHAT",
    "prefetch_times_from_records",
    "batch_time_lines",
    "prefetch_step_times",
]

MiB = 1 << 20
MEMORY_KINDS = ("pageable", "pinned")
STREAM_KINDS = ("default", "side")
CELLS: tuple[tuple[str, str], ...] = tuple((m, s) for m in MEMORY_KINDS for s in STREAM_KINDS)
HOST_LANE = "host thread"
#: A cell counts as overlapped when at least this share of the shorter activity ran concurrently.
OVERLAP_THRESHOLD = 0.3
OVERLAPPED, SERIALISED = "overlapped", "serialised"
SCHEMATIC = "schematic, not measured"


# ---------------------------------------------------------------------------
# Labels: from the configuration, and from measurements
# ---------------------------------------------------------------------------


def _check_cell(memory: str, stream: str) -> None:
    check_choice("memory", memory, MEMORY_KINDS)
    check_choice("stream", stream, STREAM_KINDS)


def expected_label(memory: str, stream: str) -> str:
    """``"overlapped"`` only for a pinned source on a side stream; else ``"serialised"``."""
    _check_cell(memory, stream)
    return OVERLAPPED if (memory == "pinned" and stream == "side") else SERIALISED


def expected_reason(memory: str, stream: str) -> str:
    """One sentence saying why a cell does or does not overlap."""
    _check_cell(memory, stream)
    if memory == "pinned" and stream == "side":
        return (
            "pinned source: the copy call returns at once and a copy engine does the DMA; "
            "side stream: nothing orders it after the compute, so both run together"
        )
    if memory == "pinned":
        return "one stream runs its work in order: the compute queued after the copy waits for it"
    if stream == "side":
        return (
            "pageable source: the driver stages the data through a pinned buffer and the call holds "
            "the host until it is staged, so the compute is queued only after the copy"
        )
    return "pageable source holds the host, and one stream runs its work in order"


def lanes_for(stream: str) -> tuple[str, str]:
    """(copy lane, compute lane) names: one lane per stream, with the operation in brackets."""
    check_choice("stream", stream, STREAM_KINDS)
    if stream == "side":
        return "side stream (copy)", "default stream (compute)"
    return "default stream (copy)", "default stream (compute)"


def _merge(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def overlap_fraction(trace: SpanTrace, copy: str = "copy", compute: str = "compute") -> float:
    """Share (0-1) of the shorter of the two activities that ran at the same time as the other.

    Computed from the spans named ``copy`` and ``compute`` (their ``start``/``end``:
    the GPU's clock for GPU spans). 0 means strictly one after the other; 1 means
    the shorter one was entirely hidden behind the longer one.
    """
    a = _merge((s.start, s.end) for s in trace.spans if s.name == copy)
    b = _merge((s.start, s.end) for s in trace.spans if s.name == compute)
    total_a = sum(e - s for s, e in a)
    total_b = sum(e - s for s, e in b)
    denom = min(total_a, total_b)
    if denom <= 0:
        return 0.0
    both = 0.0
    for s1, e1 in a:
        for s2, e2 in b:
            both += max(0.0, min(e1, e2) - max(s1, s2))
    return max(0.0, min(1.0, both / denom))


def measured_label(fraction: float, threshold: float = OVERLAP_THRESHOLD) -> str:
    """``"overlapped"`` if ``fraction >= threshold`` else ``"serialised"``."""
    return OVERLAPPED if fraction >= threshold else SERIALISED


# ---------------------------------------------------------------------------
# One cell of the 2x2 experiment
# ---------------------------------------------------------------------------


@dataclass
class CellResult:
    """One run of the 2x2 experiment.

    Attributes:
        memory / stream: the configuration asked for.
        expected: label derived from the configuration.
        measured: label derived from the spans (``None`` without a GPU).
        fraction: :func:`overlap_fraction` of the trace (GPU spans; 0 on CPU).
        step_s / copy_s / compute_s: medians per step (seconds).
        on_gpu: whether CUDA events timed the copy and compute.
        notes: what differs from the configuration on this machine (e.g. no pinning without CUDA).
    """

    memory: str
    stream: str
    trace: SpanTrace
    expected: str
    measured: str | None
    fraction: float
    step_s: float
    copy_s: float
    compute_s: float
    copy_bytes: int
    matmul_n: int
    device: str
    on_gpu: bool
    notes: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        return f"{self.memory} + {self.stream} stream"

    @property
    def agrees(self) -> bool | None:
        """Whether the measured label equals the expected one (``None`` when not measured)."""
        return None if self.measured is None else self.measured == self.expected

    def summary(self) -> str:
        """One line: configuration, labels and medians."""
        base = (
            f"{self.name}: expected {self.expected}; step {human_seconds(self.step_s)}, "
            f"copy {human_seconds(self.copy_s)}, compute {human_seconds(self.compute_s)}"
        )
        if self.measured is None:
            return base + f"; not measured on {self.device} (no CUDA streams or copy engines)"
        return base + f"; measured {self.measured} ({self.fraction:.0%} of the shorter activity hidden)"


def _defaults(on_gpu: bool, copy_mib: int | None, matmul_n: int | None, steps: int | None) -> tuple[int, int, int]:
    copy_mib = check_int("copy_mib", copy_mib if copy_mib is not None else (64 if on_gpu else 4), 1, 4096)
    matmul_n = check_int("matmul_n", matmul_n if matmul_n is not None else (4096 if on_gpu else 256), 16, 16384)
    steps = check_int("steps", steps if steps is not None else sized(4, 8), 1, 200)
    return copy_mib, matmul_n, steps


def run_cell(
    memory: str,
    stream: str,
    *,
    copy_mib: int | None = None,
    matmul_n: int | None = None,
    steps: int | None = None,
    device: torch.device | str | None = None,
    progress: Callable[[float, str], None] | None = None,
) -> CellResult:
    """Run one cell of the 2x2 experiment and return its trace and labels.

    Each step ``i``: copy the next batch into buffer ``i % 2`` (on the side stream
    or the default stream, from pinned or pageable memory, ``non_blocking=True``),
    compute on the other buffer (``torch.mm`` on the default stream, plus a sum that
    reads the batch), then synchronise. Buffers alternate, so the copy never writes
    what the compute reads. One warm-up step runs first, untimed.

    Without CUDA the same loop runs on the CPU with host timing (there are no
    streams and pinning needs a driver); ``measured`` is then ``None``.

    Args:
        memory: ``"pageable"`` or ``"pinned"``.
        stream: ``"default"`` or ``"side"``.
        copy_mib: MiB copied per step (default 64 on a GPU, 4 on a CPU).
        matmul_n: matrix side of the compute (default 4096 on a GPU, 256 on a CPU).
        steps: recorded steps (default 4 in quick mode, 8 otherwise).
    """
    _check_cell(memory, stream)
    dev = resolve_device(device)
    return _run_cell(memory, stream, dev, copy_mib=copy_mib, matmul_n=matmul_n, steps=steps, progress=progress)


def _run_cell(
    memory: str,
    stream: str,
    dev: torch.device,
    *,
    copy_mib: int | None,
    matmul_n: int | None,
    steps: int | None,
    progress: Callable[[float, str], None] | None,
) -> CellResult:
    """:func:`run_cell` on a resolved device (current, when CUDA)."""
    on_gpu = dev.type == "cuda"
    copy_mib, matmul_n, steps = _defaults(on_gpu, copy_mib, matmul_n, steps)
    notes: list[str] = []
    n = copy_mib * MiB // 4
    copy_lane, compute_lane = lanes_for(stream) if on_gpu else ("copy (CPU)", "compute (CPU)")
    src = torch.ones(n, dtype=torch.float32)
    if memory == "pinned":
        if on_gpu:
            src = src.pin_memory()
        else:
            notes.append("pinning needs a CUDA driver: this CPU run copies from pageable memory")
    if stream == "side" and not on_gpu:
        notes.append("no CUDA streams on the CPU: the copy runs in order with the compute")
    bufs = [torch.empty(n, dtype=torch.float32, device=dev) for _ in range(2)]
    g = torch.Generator().manual_seed(0)
    a = (torch.randn(matmul_n, matmul_n, generator=g) / math.sqrt(matmul_n)).to(dev)
    c = torch.empty_like(a)
    compute_stream = torch.cuda.current_stream(dev) if on_gpu else None
    copy_stream = torch.cuda.Stream(dev) if (on_gpu and stream == "side") else compute_stream

    def do_copy(dst: torch.Tensor) -> None:
        if on_gpu and stream == "side":
            with torch.cuda.stream(copy_stream):
                dst.copy_(src, non_blocking=True)
        else:
            dst.copy_(src, non_blocking=True)

    def do_compute(batch: torch.Tensor) -> torch.Tensor:
        torch.mm(a, a, out=c)
        return batch.sum()

    try:
        do_copy(bufs[1])
        do_compute(bufs[0])
        synchronize(dev)
        if copy_stream is not None and compute_stream is not None and copy_stream is not compute_stream:
            copy_stream.wait_stream(compute_stream)
        rec = SpanRecorder(
            dev, experiment="ch05.2x2", memory=memory, stream=stream, copy_bytes=n * 4, matmul_n=matmul_n, steps=steps
        )
        steps_s: list[float] = []
        for i in range(steps):
            t0 = time.perf_counter()
            nxt, cur = bufs[i % 2], bufs[(i + 1) % 2]
            h0 = rec.now()
            with rec.span("copy", i, gpu=True, lane=copy_lane, stream=copy_stream if on_gpu else None):
                do_copy(nxt)
            rec.add("copy call", i, h0, rec.now(), lane=HOST_LANE)
            with rec.span("compute", i, gpu=True, lane=compute_lane, stream=compute_stream):
                do_compute(cur)
            h2 = rec.now()
            synchronize(dev)
            rec.add("wait", i, h2, rec.now(), lane=HOST_LANE)
            steps_s.append(time.perf_counter() - t0)
            if progress is not None:
                progress((i + 1) / steps, f"step {i + 1}/{steps}")
        trace = rec.finish()
    finally:
        synchronize(dev)
    trace.metadata.update(notes=list(notes), lanes=[copy_lane, compute_lane, HOST_LANE])

    def med(name: str) -> float:
        vals = [s.duration for s in trace.spans if s.name == name]
        return statistics.median(vals) if vals else float("nan")

    frac = overlap_fraction(trace) if on_gpu else 0.0
    result = CellResult(
        memory=memory,
        stream=stream,
        trace=trace,
        expected=expected_label(memory, stream),
        measured=measured_label(frac) if on_gpu else None,
        fraction=frac,
        step_s=statistics.median(steps_s),
        copy_s=med("copy"),
        compute_s=med("compute"),
        copy_bytes=n * 4,
        matmul_n=matmul_n,
        device=str(dev),
        on_gpu=on_gpu,
        notes=notes,
    )
    trace.metadata.update(expected_label=result.expected, measured_label=result.measured, overlap_fraction=frac)
    return result


def run_grid(**kwargs: Any) -> list[CellResult]:
    """All four cells, in :data:`CELLS` order (same keyword arguments as :func:`run_cell`)."""
    return [run_cell(m, s, **kwargs) for m, s in CELLS]


#: One row of the copy-call table: (configuration, CPU seconds inside the copy call or None when not
#: recorded, the copy's GPU seconds, seconds per step).
CopyCallRow = tuple[str, float | None, float, float]


def copy_call_rows(cells: Iterable[CellResult]) -> list[CopyCallRow]:
    """Per cell: the median time the CPU spent inside ``copy_(..., non_blocking=True)``, the copy, the step.

    The copy call's median is the middle value of the sorted spans (the upper one of an even count).
    """
    rows: list[CopyCallRow] = []
    for r in cells:
        calls = sorted(s.duration for s in r.trace.spans if s.name == "copy call")
        rows.append((r.name, calls[len(calls) // 2] if calls else None, r.copy_s, r.step_s))
    return rows


def copy_call_rows_from_records(rs: ResultSet, records: list[Record]) -> list[CopyCallRow] | None:
    """The copy-call table from a reference file: ``ch05.overlap.step_time`` records with their copy times.

    The duration of the copy call itself is not recorded (None: the table says so). None when no record
    has its copy time in the same file.
    """
    rows: list[CopyCallRow] = []
    for m, s in CELLS:
        for r in records:
            if (r.params.get("memory"), r.params.get("stream")) != (m, s):
                continue
            copy = rs.find("ch05.overlap.copy_time", **r.params)
            if copy:
                rows.append((f"{m} + {s} stream", None, copy[0].value, r.value))
    return rows or None


def copy_call_table(rows: list[CopyCallRow]) -> list[str]:
    """The rows as a table: configuration, copy call (CPU), copy on GPU, step (ms)."""
    lines = [f"{'configuration':<28}{'copy call (CPU)':>16}{'copy on GPU':>14}{'step':>12}"]
    for name, call, copy, step in rows:
        call_text = f"{call * 1e3:>13.3f} ms" if call is not None else f"{'not recorded':>16}"
        lines.append(f"{name:<28}{call_text}{copy * 1e3:>11.3f} ms{step * 1e3:>9.3f} ms")
    return lines


# ---------------------------------------------------------------------------
# Schematic and reference timelines
# ---------------------------------------------------------------------------


def schematic_trace(memory: str, stream: str, steps: int = 3, copy: float = 1.0, compute: float = 1.5) -> SpanTrace:
    """What a cell's timeline *looks like*, in arbitrary units. Not a measurement.

    The metadata says ``kind: "schematic, not measured"``; :func:`draw_cell` labels it so.
    """
    _check_cell(memory, stream)
    check_int("steps", steps, 1, 20)
    copy_lane, compute_lane = lanes_for(stream)
    overlapped = expected_label(memory, stream) == OVERLAPPED
    host_blocked = memory == "pageable"
    spans: list[Span] = []
    t = 0.0
    call = 0.08
    for i in range(steps):
        c0 = t
        c1 = c0 + copy
        k0 = (t + 2 * call) if overlapped else c1 + (call if host_blocked else 0.0)
        k1 = k0 + compute
        end = max(c1, k1)
        host_call_end = c1 if host_blocked else t + call
        spans += [
            Span("copy", i, copy_lane, c0, c1, c0, c1, True),
            Span("compute", i, compute_lane, k0, k1, k0, k1, True),
            Span("copy call", i, HOST_LANE, t, host_call_end, t, host_call_end, False),
            Span("wait", i, HOST_LANE, host_call_end + call, end, host_call_end + call, end, False),
        ]
        t = end + 0.15
    return SpanTrace(
        spans, {"kind": SCHEMATIC, "memory": memory, "stream": stream, "expected_label": expected_label(memory, stream)}
    )


def artifact_name(memory: str, stream: str) -> str:
    """Name of the reference artifact holding a cell's recorded trace."""
    _check_cell(memory, stream)
    return f"ch05.timeline.{memory}.{stream}"


def _timeline_what(memory: str, stream: str) -> str:
    return f"the timeline of {memory} + {stream} stream"


def reference_cell(memory: str, stream: str) -> Evidence[SpanTrace]:
    """The newest reference recording of a cell's timeline (``recorded``), or ``missing`` if none exists.

    Its ``source`` is the recording's provenance line (GPU, driver, torch, date, mode, method).
    """
    return evidence.recorded_artifact(
        _timeline_what(memory, stream), artifact_name(memory, stream), lambda rs, data: SpanTrace.from_dict(dict(data))
    )


def timeline_evidence(cell: CellResult) -> Evidence[Any]:
    """A cell's timeline: measured here when ``cell`` ran on CUDA, else its reference recording, or missing.

    A CPU run is not the GPU experiment (no streams, no pinning), so its trace is never shown as the
    timeline: without CUDA this is :func:`reference_cell`.
    """
    if cell.on_gpu:
        return evidence.measured(
            _timeline_what(cell.memory, cell.stream), cell, cell.device, method="CUDA events, one lane per stream"
        )
    return reference_cell(cell.memory, cell.stream)


def draw_cell(
    cell: CellResult | SpanTrace | Evidence[Any],
    ax: Any = None,
    *,
    title: str | None = None,
    source: str | None = None,
    max_steps: int | None = 3,
) -> Any:
    """Draw a cell's timeline with :func:`helpers.ui.plots.timeline` (schematics labelled as such).

    ``cell`` may be an :class:`~helpers.core.evidence.Evidence` of a cell or trace: it is drawn with its
    provenance line as ``source``; a ``missing`` one leaves the axis empty, titled with what is missing
    (the schematic of each cell is drawn in the chapter's Theory).
    """
    if isinstance(cell, Evidence):
        if cell.value is None:
            if ax is None:
                import matplotlib.pyplot as plt  # optional/heavy: matplotlib

                ax = plt.gca()
            ax.set_axis_off()
            ax.set_title(title or f"{cell.what}: no reference recording yet (its schematic is in Theory)", fontsize=9)
            return ax
        return draw_cell(cell.value, ax, title=title, source=source or cell.source, max_steps=max_steps)
    from ...ui.plots import timeline  # optional/heavy: matplotlib

    trace = cell.trace if isinstance(cell, CellResult) else cell
    meta = trace.metadata
    memory, stream = meta.get("memory", "?"), meta.get("stream", "?")
    schematic = meta.get("kind") == SCHEMATIC
    if title is None:
        title = f"{memory} source, {stream} stream"
        if schematic:
            title += f" — expected: {meta.get('expected_label')} ({SCHEMATIC})"
        elif meta.get("measured_label"):
            title += (
                f" — measured: {meta['measured_label']} "
                f"({float(meta.get('overlap_fraction', 0)):.0%} hidden), expected: {meta.get('expected_label')}"
            )
        elif isinstance(cell, CellResult) and not cell.on_gpu:
            title += " — CPU run (no streams): not the GPU experiment"
    lanes = list(meta.get("lanes") or []) or None
    if lanes is None and stream in STREAM_KINDS and any(sp.lane in lanes_for(stream) for sp in trace.spans):
        lanes = [*lanes_for(stream), HOST_LANE]
    ax = timeline(trace, ax, title=title, lanes=lanes, source=source, max_steps=max_steps)
    ax.title.set_fontsize(9)
    if schematic:
        ax.set_xlabel(f"time (arbitrary units) — {SCHEMATIC.upper()}")
        ax.set_xticks([])
    return ax


# ---------------------------------------------------------------------------
# Hazards
# ---------------------------------------------------------------------------


@dataclass
class HazardResult:
    """A buggy and a fixed run of one hazard.

    ``bug`` / ``fix``: what was counted in each (e.g. wrong elements). ``code_bug``
    / ``code_fix``: the source of the two functions that ran. ``on_gpu``: whether
    the race could happen at all here.
    """

    name: str
    device: str
    on_gpu: bool
    bug: dict[str, Any]
    fix: dict[str, Any]
    code_bug: str
    code_fix: str
    explanation: str

    def report(self) -> str:
        """Plain-text report: what ran, what was counted, what it means."""
        lines = [f"{self.name} (on {self.device})"]
        lines.append("  buggy version: " + ", ".join(f"{k} = {v}" for k, v in self.bug.items()))
        lines.append("  fixed version: " + ", ".join(f"{k} = {v}" for k, v in self.fix.items()))
        lines.append("  " + self.explanation)
        return "\n".join(textwrap.fill(ln, 105, subsequent_indent="    ") for ln in lines)


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


def hazard_d2h_read_before_sync(device: torch.device | str | None = None, n: int | None = None) -> HazardResult:
    """Count values read from a non-blocking D2H copy before and after a proper wait.

    The device tensor is all ones, produced *behind* ~50 ms of queued GPU work; the
    host buffer starts at -1. Any element still -1 (or anything not 1) when read
    was read before the copy wrote it.
    """
    dev = resolve_device(device)
    on_gpu = dev.type == "cuda"
    n = check_int("n", n if n is not None else 4 * MiB, 1, 256 * MiB)
    results: dict[str, dict[str, Any]] = {}
    for label, fn in (("bug", _d2h_bug), ("fix", _d2h_fix)):
        out = torch.full((n,), -1.0, pin_memory=on_gpu)
        x = torch.empty(n, device=dev)
        if on_gpu:
            GpuDelay(dev)()  # the GPU is busy for a while ...
        x.fill_(1.0)  # ... so x only becomes all ones later
        wrong = fn(x, out)
        synchronize(dev)
        results[label] = {"wrong elements when read": wrong, "of": n, "wrong after a later sync": int((out != 1).sum())}
    if on_gpu:
        expl = (
            "The buggy read happened while the copy was still queued behind GPU work, so it saw the "
            "buffer's old contents; after a sync the same buffer is right. Wait on an event (or "
            "synchronise the stream) before reading a non-blocking device-to-host copy."
        )
    else:
        expl = (
            "On a CPU the copy is synchronous, so both versions read correct values here. On a GPU, "
            "copy_(..., non_blocking=True) into pinned memory returns before the copy runs and the buggy "
            "read sees stale values (pytorch/pytorch#86264, #137878)."
        )
    return HazardResult(
        "non-blocking device-to-host copy read before a sync",
        str(dev),
        on_gpu,
        results["bug"],
        results["fix"],
        inspect.getsource(_d2h_bug),
        inspect.getsource(_d2h_fix),
        expl,
    )


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


def hazard_pinned_source_mutation(device: torch.device | str | None = None, n: int | None = None) -> HazardResult:
    """Count device elements that got the *new* value because the pinned source changed too early.

    The source holds ones; after queuing the copy behind ~50 ms of GPU work the host
    overwrites it with twos. The copy should deliver ones.
    """
    dev = resolve_device(device)
    on_gpu = dev.type == "cuda"
    n = check_int("n", n if n is not None else 4 * MiB, 1, 256 * MiB)
    results: dict[str, dict[str, Any]] = {}
    for label, fn in (("bug", _mutation_bug), ("fix", _mutation_fix)):
        src = torch.ones(n, pin_memory=on_gpu)
        dst = torch.zeros(n, device=dev)
        if on_gpu:
            GpuDelay(dev)()
        fn(src, dst)
        synchronize(dev)
        results[label] = {"elements that arrived wrong": int((dst != 1).sum()), "of": n}
    if on_gpu:
        expl = (
            "The copy ran after the host had overwritten the pinned buffer, so the device received "
            "the next batch's values. Wait for an event recorded after the copy, or alternate between "
            "two pinned buffers, before writing into a source again (pytorch/pytorch#127612)."
        )
    else:
        expl = (
            "On a CPU the copy finishes inside copy_(), so changing the source afterwards is harmless. On "
            "a GPU the copy from pinned memory is only queued; the DMA reads the buffer later, and if the "
            "host has refilled it the device gets the new values (pytorch/pytorch#127612)."
        )
    return HazardResult(
        "pinned source modified before its asynchronous copy ran",
        str(dev),
        on_gpu,
        results["bug"],
        results["fix"],
        inspect.getsource(_mutation_bug),
        inspect.getsource(_mutation_fix),
        expl,
    )


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


def _count_syncs(fn: Callable[[], Any], dev: torch.device) -> tuple[int | None, float]:
    """(synchronisations reported by torch's sync debug mode, wall seconds) of ``fn`` working on ``dev``."""
    if dev.type != "cuda":
        t0 = time.perf_counter()
        fn()
        return None, time.perf_counter() - t0
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
    count = sum(1 for w in caught if "synchroniz" in str(w.message).lower())
    return count, seconds


#: Why ``print(loss)`` costs more than one synchronisation (read in torch/_tensor_str.py, torch 2.14).
PRINT_SYNCS_WHY = (
    "print(loss) is not one read: torch/_tensor_str.py first picks the finite, non-zero values with "
    "torch.masked_select (its output size depends on the data, so the host waits to learn it), then, to "
    "choose a format, tests each value against its ceiling and the ranges that switch to scientific notation "
    "(each `if` on a CUDA tensor is a .item(): one wait each), and finally formats the value (.item() again)."
)


def hazard_hidden_syncs(
    device: torch.device | str | None = None, steps: int | None = None, size: int | None = None
) -> HazardResult:
    """Run a loop with ``.item()``, ``print`` and ``.cpu()`` each step, and one without.

    On a GPU, ``torch.cuda.set_sync_debug_mode("warn")`` reports every
    synchronising call: we count them for both loops (per step too), count each of
    the three lines alone on one step, and time both loops. On a CPU there is
    nothing to wait for, so there is nothing to count; the function says so and
    names the lines (:data:`PRINT_SYNCS_WHY` says why ``print`` costs several).
    """
    dev = resolve_device(device)
    on_gpu = dev.type == "cuda"
    steps = check_int("steps", steps if steps is not None else sized(20, 200, laptop=50), 1, 100_000)
    size = check_int("size", size if size is not None else (1024 if on_gpu else 128), 8, 16384)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(size, size, generator=g).to(dev)
    w = (torch.randn(size, size, generator=g) / math.sqrt(size)).to(dev)
    sink = io.StringIO()
    _loop_no_syncs(x, w, 2, sink)  # warm-up
    synchronize(dev)
    n_bug, s_bug = _count_syncs(lambda: _loop_hidden_syncs(x, w, steps, sink), dev)
    n_fix, s_fix = _count_syncs(lambda: _loop_no_syncs(x, w, steps, sink), dev)
    if on_gpu:
        assert n_bug is not None and n_fix is not None  # counted on a GPU
        loss = (x @ w).relu().mean()
        per_line = {
            ".item()": _count_syncs(lambda: loss.item(), dev)[0],
            "print(loss)": _count_syncs(lambda: print(loss, file=sink), dev)[0],
            ".cpu()": _count_syncs(lambda: loss.cpu(), dev)[0],
        }
        bug = {
            "synchronisations": n_bug,
            "steps": steps,
            "per step": round(n_bug / steps, 2),
            **{f"{k} alone": v for k, v in per_line.items()},
            "loop time": human_seconds(s_bug),
        }
        fix = {"synchronisations": n_fix, "steps": steps, "loop time": human_seconds(s_fix)}
        expl = (
            "Each synchronisation stops the CPU until the GPU has caught up, so the CPU cannot queue the next "
            "step (or prepare the next batch) meanwhile. " + PRINT_SYNCS_WHY + " The fixed loop keeps the "
            "value on the device and reads it once, after the loop."
        )
    else:
        bug = {
            "lines that synchronise on a GPU, per step": ".item(), print(loss), .cpu()",
            "steps": steps,
            "synchronisations": "not counted: no CUDA device",
        }
        fix = {
            "lines that synchronise on a GPU": "one .item(), after the loop",
            "steps": steps,
            "synchronisations": "not counted: no CUDA device",
        }
        expl = (
            "On a CPU every operation finishes before the next line runs, so nothing waits. On a GPU, "
            "torch.cuda.set_sync_debug_mode('warn') reports each synchronising call and this function counts "
            "them, per step and per line. " + PRINT_SYNCS_WHY
        )
    return HazardResult(
        "synchronisations hidden in .item(), print and .cpu()",
        str(dev),
        on_gpu,
        bug,
        fix,
        inspect.getsource(_loop_hidden_syncs),
        inspect.getsource(_loop_no_syncs),
        expl,
    )


def _sync_counts(rs: ResultSet, records: list[Record]) -> dict[str, Any]:
    """Hazard 3's recorded counts, from one reference file: per loop, and per line from the same file."""
    return {
        "loops": [(r.params.get("variant"), int(r.params.get("steps") or 1), r.value) for r in records],
        "per line": [(r.params.get("line"), r.value) for r in rs.find("ch05.hazard.syncs_per_line")],
    }


def sync_counts_reference() -> Evidence[dict[str, Any]]:
    """The reference recording of hazard 3's synchronisation counts (per loop, per step, per line), or missing.

    Show it with :func:`sync_count_lines`: ``sync_counts_reference().show(sync_count_lines)``.
    """
    return evidence.recorded("the synchronisation counts of hazard 3", "ch05.hazard.syncs", convert=_sync_counts)


def sync_count_lines(counts: dict[str, Any]) -> list[str]:
    """'  hidden loop, 50 steps: 450 synchronisations (9.00 per step)', then one line per line of the step."""
    lines = [
        f"  {variant} loop, {steps} steps: {value:.0f} synchronisations ({value / steps:.2f} per step)"
        for variant, steps, value in counts["loops"]
    ]
    lines.extend(f"  {line} alone: {value:.0f}" for line, value in counts["per line"])
    return lines


def hazard_count_lines(records: list[Record]) -> list[str]:
    """Recorded counts of hazard 1 or 2 (``ch05.hazard.d2h_wrong`` / ``.mutation_wrong``), one line per version."""
    return [
        f"  {r.params.get('variant')} version: {r.value:,.0f} of {int(r.params.get('n', 0)):,} elements wrong"
        for r in records
    ]


# ---------------------------------------------------------------------------
# Prefetcher measurements (GPU) — used by the chapter and its benchmark (helpers.chapters.ch05)
# ---------------------------------------------------------------------------

#: The three ways of chapter 05's "Does it pay?" that say how much of the copy the prefetcher hides:
#: uint8 batches copied and normalised in line on the current stream, through the reader's Prefetcher,
#: and already on the device (no copy at all: the floor). :meth:`BatchTimes.copy_hidden` reads them.
IN_LINE = "uint8, copied and normalised in line"
PREFETCHED = "uint8, through your Prefetcher"
NO_COPY = "uint8, already on the GPU (no copy)"


def preload(loader: Iterable[Any], device: torch.device | str | None = None) -> list[tuple[Any, ...]]:
    """One pass of ``loader``, held in host memory: its ``(x, y, ...)`` batches as a list, pinned for CUDA.

    Timing the copy with a loader in the loop times the loader: a pass that restarts it decodes a
    batch of images (milliseconds) for every copy (a fraction of a millisecond). Iterating this list
    instead costs nothing, so what a timed pass of ``batches(list)`` measures is the copy, the
    normalisation and the step. The list is a loader to the reader's ``batches`` and ``Prefetcher``
    (they only iterate it). With ``device`` on CUDA every tensor is pinned (a tensor the loader has
    pinned already is kept as it is), so each copy is one DMA, as from a ``pin_memory=True`` loader.

    Raises:
        ValueError: the loader gives no batch, or a batch that is not a tuple or list of tensors.
    """
    dev = resolve_device(device)
    out: list[tuple[Any, ...]] = []
    for i, batch in enumerate(loader):
        if not isinstance(batch, (tuple, list)) or not all(isinstance(t, torch.Tensor) for t in batch):
            raise ValueError(f"batch {i} of the loader is {type(batch).__name__}, not a tuple of tensors (x, y)")
        if dev.type == "cuda":
            batch = tuple(t if t.is_pinned() else t.pin_memory() for t in batch)
        out.append(tuple(batch))
    if not out:
        raise ValueError("the loader gave no batch to preload: give it at least batch_size items (drop_last=True)")
    return out


@dataclass
class BatchTimes:
    """Seconds per batch of a few ways to feed one training step, measured in alternating rounds.

    ``seconds[name]`` holds one value per round (wall clock for the round's batches, synchronised
    on a GPU, divided by the number of batches); ``batches[name]`` how many batches a round gave.
    """

    device: str
    seconds: dict[str, list[float]] = field(default_factory=dict)
    batches: dict[str, int] = field(default_factory=dict)

    def median(self, name: str) -> float:
        """Median seconds per batch of ``name`` over the rounds."""
        return statistics.median(self.seconds[name])

    def report(self, baseline: str | None = None) -> str:
        """One line per way: ms per batch (median, min-max over rounds), and the ratio to ``baseline``."""
        base = baseline if baseline in self.seconds else next(iter(self.seconds), None)
        width = max((len(n) for n in self.seconds), default=0)
        rounds = len(next(iter(self.seconds.values()), []))
        lines = [f"ms per batch on {self.device}, median of {rounds} alternating rounds (min-max):"]
        for name, vals in self.seconds.items():
            ratio = "" if base is None or name == base else f"  {self.median(base) / self.median(name):.2f}x"
            lines.append(
                f"  {name:<{width}}  {self.median(name) * 1e3:8.3f}  ({min(vals) * 1e3:.3f}-"
                f"{max(vals) * 1e3:.3f}){ratio}"
            )
        hidden = self.copy_hidden()
        if hidden is not None:
            lines += textwrap.wrap(hidden, 105)
        return "\n".join(lines)

    def copy_hidden(self) -> str | None:
        """How much of the in-line copy the prefetcher hid, from :data:`IN_LINE`, :data:`PREFETCHED` and
        :data:`NO_COPY` (None when one is missing): the copy costs ``in line - no copy`` per batch, the
        prefetcher saves ``in line - prefetched``. A cost within the rounds' spread is said to be noise."""
        if not all(k in self.seconds for k in (IN_LINE, PREFETCHED, NO_COPY)):
            return None
        inline, pf, floor = self.median(IN_LINE), self.median(PREFETCHED), self.median(NO_COPY)
        cost = inline - floor
        spread = max(max(v) - min(v) for k, v in self.seconds.items() if k in (IN_LINE, NO_COPY))
        if cost <= spread:
            return (
                f"The copy's cost per batch ({cost * 1e3:.3f} ms, in line minus no copy) is within the rounds' "
                f"spread ({spread * 1e3:.3f} ms): too small to say how much of it the prefetcher hides here."
            )
        return (
            f"The copy costs {cost * 1e3:.3f} ms per batch in line (in line minus no copy); the prefetcher "
            f"saves {(inline - pf) * 1e3:.3f} ms of it: {(inline - pf) / cost:.0%} hidden."
        )


def time_batches(
    variants: dict[str, Callable[[], Iterable[Any]]],
    step: Callable[..., Any],
    device: torch.device | str | None = None,
    *,
    rounds: int = 3,
    progress: Callable[[float, str], None] | None = None,
) -> BatchTimes:
    """Time the reader's pipeline: each of ``variants`` feeds ``step(x, y)`` for one pass, in alternating rounds.

    ``variants`` maps a label to a function that returns a fresh iterable of ``(x, y)`` device
    batches (e.g. ``lambda: batches(loader)``); ``step`` is the reader's training step (e.g.
    ``functools.partial(train_step, model, optimizer)``). One untimed warm-up pass per variant,
    then ``rounds`` rounds; each round runs every variant once, in an order that reverses every
    round (so drift in the machine's speed cancels), with the device synchronised before and
    after each pass. Works on any device; on a CPU there is no copy to hide, so the ways differ
    only by noise.

    What a pass times is everything ``variants[name]()`` does: give it batches that are already in
    memory (:func:`preload`), or each pass times the loader too, which dwarfs a copy.
    """
    dev = resolve_device(device)
    rounds = check_int("rounds", rounds, 1, 50)
    if not variants:
        raise ValueError("variants must name at least one way to feed the step, e.g. {'mine': lambda: batches(loader)}")
    names = list(variants)
    out = BatchTimes(device=str(dev), seconds={n: [] for n in names})

    def one_pass(name: str) -> tuple[float, int]:
        synchronize(dev)
        t0, k = time.perf_counter(), 0
        for x, y in variants[name]():
            step(x, y)
            k += 1
        synchronize(dev)
        if k == 0:
            raise ValueError(f"variant {name!r} gave no batches")
        return time.perf_counter() - t0, k

    total = len(names) * (rounds + 1)
    done = 0
    for r in range(-1, rounds):
        order = names if r % 2 == 0 else names[::-1]
        for name in order:
            seconds, k = one_pass(name)
            if r >= 0:
                out.seconds[name].append(seconds / k)
                out.batches[name] = k
            done += 1
            if progress is not None:
                progress(done / total, "warm-up" if r < 0 else f"round {r + 1} of {rounds}: {name}")
    return out


#: What the reference figures of the prefetcher are (they are not the reader's cells).
PREFETCH_REFERENCE_WHAT = (
    "Reference figures, recorded with the workbook's reference prefetcher (helpers.pipeline.prefetch.Prefetcher) "
    "on pre-loaded pinned batches and a synthetic compute per batch, not with your cells:"
)


def prefetch_times_from_records(rs: ResultSet, records: list[Record]) -> list[tuple[str, bool, float]]:
    """``ch05.prefetch.batch_time`` records as ``(dtype, prefetcher, seconds per batch)`` rows."""
    return [(str(r.params.get("dtype")), bool(r.params.get("prefetcher")), r.value) for r in records]


def batch_time_lines(times: BatchTimes | list[tuple[str, bool, float]]) -> list[str]:
    """The lines shown for the prefetcher's effect: a :class:`BatchTimes` measured here (its report), or
    the reference rows of :func:`prefetch_times_from_records`, introduced by what they are."""
    if isinstance(times, BatchTimes):
        return times.report().splitlines()
    lines = textwrap.wrap(PREFETCH_REFERENCE_WHAT, 105)
    lines += [f"  {dtype:>8}, prefetcher={pf}: {sec * 1e3:.3f} ms per batch" for dtype, pf, sec in times]
    return lines


def prefetch_step_times(
    device: torch.device | str = "cuda", *, batch: int = 256, image: int = 128, n_batches: int = 8
) -> dict[tuple[str, bool], float]:
    """Seconds per batch for {float32, uint8} pinned image batches, with and without the reference :class:`Prefetcher`.

    These are the *reference* figures (``ch05.prefetch.batch_time``, recorded by
    :func:`helpers.chapters.ch05.benchmark` on a GPU with the workbook's
    :class:`helpers.pipeline.prefetch.Prefetcher` and a synthetic compute);
    the chapter times the reader's own ``batches()`` and ``train_step`` with :func:`time_batches`.

    Without the prefetcher: ``x = batch.to(dev, non_blocking=True)`` (uint8 normalised
    on the device) then compute, all on the default stream. With it: the same
    compute on batches from ``Prefetcher(loader, dev, normalize=...)``. CUDA only.
    """
    dev = resolve_device(device)
    if dev.type != "cuda":
        raise ValueError("prefetch_step_times needs a CUDA device")
    mean, std = (0.5, 0.5, 0.5), (0.25, 0.25, 0.25)
    g = torch.Generator().manual_seed(0)
    u8 = [
        torch.randint(0, 256, (batch, 3, image, image), dtype=torch.uint8, generator=g).pin_memory()
        for _ in range(n_batches)
    ]
    f32 = [to_float_normalized(b, mean, std).pin_memory() for b in u8]
    f32[0].to(dev)  # warm-up
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record(torch.cuda.current_stream(dev))  # on the copy's stream
    f32[0].to(dev, non_blocking=True)
    e.record(torch.cuda.current_stream(dev))
    torch.cuda.synchronize(dev)
    compute = calibrated_compute(dev, 1.2 * s.elapsed_time(e) / 1e3)
    out: dict[tuple[str, bool], float] = {}
    for dtype_name, loader in (("float32", f32), ("uint8", u8)):
        norm = (mean, std) if dtype_name == "uint8" else None

        # this iteration's loader and norm, bound as defaults (B023)
        def plain(loader: Any = loader, norm: Any = norm) -> Iterable[torch.Tensor]:
            for b in loader:
                x = b.to(dev, non_blocking=True)
                yield to_float_normalized(x, mean, std) if norm else x

        pf = Prefetcher(loader, dev, normalize=norm)
        _loop_time(plain(), compute, dev)
        _loop_time(pf, compute, dev)  # warm-up
        out[(dtype_name, False)] = statistics.median(_loop_time(plain(), compute, dev) for _ in range(3)) / n_batches
        out[(dtype_name, True)] = statistics.median(_loop_time(pf, compute, dev) for _ in range(3)) / n_batches
    return out
