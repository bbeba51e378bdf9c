"""Chapter 05: the 2x2 experiment ``{pageable, pinned} x {default, side}`` overlapping a host-to-device copy with
compute, and its timelines. Two labels are derived independently: ``expected`` from the configuration (overlap
needs a pinned source AND a side stream), ``measured`` from the CUDA-event spans (None without a GPU).
"""

from __future__ import annotations

import contextlib
import math
import statistics
from dataclasses import dataclass, replace
from typing import Any, Callable

import torch

from ...core import evidence
from ...core.config import sized
from ...core.device import resolve_device
from ...core.evidence import Evidence
from ...core.results import Record, ResultSet
from ...core.rounds import table
from ...core.timing import Span, SpanRecorder, SpanTrace, synchronize
from ...core.validate import check_choice, check_int, human_seconds

MiB = 1 << 20
MEMORY_KINDS = ("pageable", "pinned")
STREAM_KINDS = ("default", "side")
CELLS: tuple[tuple[str, str], ...] = tuple((m, s) for m in MEMORY_KINDS for s in STREAM_KINDS)
HOST_LANE = "host thread"
#: A cell counts as overlapped when at least this share of the shorter activity ran concurrently.
OVERLAP_THRESHOLD = 0.3
OVERLAPPED, SERIALISED = "overlapped", "serialised"
SCHEMATIC = "schematic, not measured"


def expected_label(memory: str, stream: str) -> str:
    """``"overlapped"`` only for a pinned source on a side stream (checks both)."""
    check_choice("memory", memory, MEMORY_KINDS)
    check_choice("stream", stream, STREAM_KINDS)
    return OVERLAPPED if (memory, stream) == ("pinned", "side") else SERIALISED


def overlap_fraction(trace: SpanTrace) -> float:
    """Share (0-1) of the shorter activity (spans ``copy``, ``compute``) that ran while the other did: by inclusion-
    exclusion over the busy time of each activity and of either (:meth:`SpanTrace.lane_busy` merges overlaps)."""
    spans = [s for s in trace.spans if s.name in ("copy", "compute")]
    busy = SpanTrace([replace(s, lane=lane) for s in spans for lane in (s.name, "either")]).lane_busy()
    copy, compute = busy.get("copy", 0.0), busy.get("compute", 0.0)
    if min(copy, compute) <= 0:
        return 0.0
    return max(0.0, min(1.0, (copy + compute - busy["either"]) / min(copy, compute)))


def measured_label(fraction: float) -> str:
    return OVERLAPPED if fraction >= OVERLAP_THRESHOLD else SERIALISED


@dataclass
class CellResult:
    """One run of the 2x2 experiment: labels, overlap fraction (0 on a CPU), medians per step (s)."""

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

    @property
    def name(self) -> str:
        return f"{self.memory} + {self.stream} stream"

    @property
    def copy_call_s(self) -> float | None:
        """The CPU's median (upper middle) seconds inside the copy call."""
        calls = sorted(s.duration for s in self.trace.spans if s.name == "copy call")
        return calls[len(calls) // 2] if calls else None

    @property
    def agrees(self) -> bool | None:
        return None if self.measured is None else self.measured == self.expected

    def summary(self) -> str:
        base = (
            f"{self.name}: expected {self.expected}; step {human_seconds(self.step_s)}, "
            f"copy {human_seconds(self.copy_s)}, compute {human_seconds(self.compute_s)}"
        )
        if self.measured is None:
            return base + f"; not measured on {self.device} (no CUDA streams or copy engines)"
        return base + f"; measured {self.measured} ({self.fraction:.0%} of the shorter activity hidden)"


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
    """One cell: step ``i`` copies ``copy_mib`` MiB into buffer ``i % 2`` (non-blocking, on the cell's stream) while
    computing on the other (a ``matmul_n`` square ``torch.mm``), then synchronises; no GPU: ``measured`` is None."""
    expected = expected_label(memory, stream)
    dev = resolve_device(device)
    on_gpu = dev.type == "cuda"
    copy_mib = check_int("copy_mib", copy_mib if copy_mib is not None else (64 if on_gpu else 4), 1, 4096)
    matmul_n = check_int("matmul_n", matmul_n if matmul_n is not None else (4096 if on_gpu else 256), 16, 16384)
    steps = check_int("steps", steps if steps is not None else sized(4, 8), 1, 200)
    src = torch.ones(copy_mib * MiB // 4, dtype=torch.float32)
    if memory == "pinned" and on_gpu:  # pinning needs a CUDA driver: a CPU run copies from pageable memory
        src = src.pin_memory()
    lanes = (f"{stream} stream (copy)", "default stream (compute)") if on_gpu else ("copy (CPU)", "compute (CPU)")
    meta = {"memory": memory, "stream": stream, "copy_bytes": src.numel() * 4, "matmul_n": matmul_n, "steps": steps}
    trace = _record_steps(dev, src, stream == "side", lanes, progress, meta)
    frac = overlap_fraction(trace) if on_gpu else 0.0
    measured = measured_label(frac) if on_gpu else None
    trace.metadata.update(lanes=[*lanes, HOST_LANE], expected_label=expected, measured_label=measured,
                          overlap_fraction=frac)  # fmt: skip
    spans = {n: [s for s in trace.spans if s.name == n] for n in ("copy", "compute", "copy call", "wait")}
    step_s = statistics.median(w.end - c.start for c, w in zip(spans["copy call"], spans["wait"]))  # host clock
    copy_s, compute_s = (statistics.median([s.duration for s in spans[n]] or [math.nan]) for n in ("copy", "compute"))
    return CellResult(
        memory, stream, trace, expected, measured, frac, step_s, copy_s, compute_s, src.numel() * 4, matmul_n,
        str(dev), on_gpu,
    )  # fmt: skip


def _record_steps(
    dev: torch.device,
    src: torch.Tensor,
    side: bool,
    lanes: tuple[str, str],
    progress: Callable[[float, str], None] | None,
    meta: dict[str, Any],
) -> SpanTrace:
    """:func:`run_cell`'s loop on ``dev`` (current or not): copy and compute on their streams' lanes, and on the host's
    lane the copy call and the wait at the step's end (a step: from the call's start to the wait's end)."""
    on_gpu, matmul_n, steps = dev.type == "cuda", meta["matmul_n"], meta["steps"]
    bufs = [torch.empty(src.numel(), dtype=torch.float32, device=dev) for _ in range(2)]
    g = torch.Generator().manual_seed(0)
    a = (torch.randn(matmul_n, matmul_n, generator=g) / math.sqrt(matmul_n)).to(dev)
    c = torch.empty_like(a)
    compute_stream = torch.cuda.current_stream(dev) if on_gpu else None  # dev's, whichever device is current
    side_stream = torch.cuda.Stream(dev) if (on_gpu and side) else None
    copy_stream = side_stream if side_stream is not None else compute_stream

    def do_copy(dst: torch.Tensor) -> None:
        with torch.cuda.stream(side_stream) if side_stream is not None else contextlib.nullcontext():
            dst.copy_(src, non_blocking=True)

    def do_compute(batch: torch.Tensor) -> torch.Tensor:
        torch.mm(a, a, out=c)
        return batch.sum()

    try:
        do_copy(bufs[1])  # warm-up, untimed
        do_compute(bufs[0])
        synchronize(dev)
        if side_stream is not None and compute_stream is not None:
            side_stream.wait_stream(compute_stream)  # the side stream starts after the warm-up's work
        rec = SpanRecorder(dev, experiment="ch05.2x2", **meta)
        for i in range(steps):
            nxt, cur = bufs[i % 2], bufs[(i + 1) % 2]
            h0 = rec.now()
            with rec.span("copy", i, gpu=True, lane=lanes[0], stream=copy_stream):
                do_copy(nxt)
            rec.add("copy call", i, h0, rec.now(), lane=HOST_LANE)
            with rec.span("compute", i, gpu=True, lane=lanes[1], stream=compute_stream):
                do_compute(cur)
            h2 = rec.now()
            synchronize(dev)
            rec.add("wait", i, h2, rec.now(), lane=HOST_LANE)
            if progress is not None:
                progress((i + 1) / steps, f"step {i + 1}/{steps}")
        trace = rec.finish()
    finally:
        synchronize(dev)
    return trace


#: (configuration, CPU seconds in the copy call or None, the copy's GPU seconds, seconds per step).
CopyCallRow = tuple[str, float | None, float, float]


def copy_call_rows_from_records(rs: ResultSet, records: list[Record]) -> list[CopyCallRow] | None:
    """The rows from a reference file's step and copy times (the call is not recorded)."""
    rows: list[CopyCallRow] = []
    for m, s in CELLS:
        for r in records:
            copy = rs.find("ch05.overlap.copy_time", **r.params)
            if (r.params.get("memory"), r.params.get("stream")) == (m, s) and copy:
                rows.append((f"{m} + {s} stream", None, copy[0].value, r.value))
    return rows or None


def copy_call_table(cells: list[CellResult] | list[CopyCallRow]) -> list[str]:
    """Per cell (measured, or recorded rows): the CPU's time in ``copy_(..., non_blocking=True)``, the copy's, the
    step's."""

    def ms(s: float | None) -> str:
        return "not recorded" if s is None else f"{s * 1e3:.3f} ms"

    rows = [c if isinstance(c, tuple) else (c.name, c.copy_call_s, c.copy_s, c.step_s) for c in cells]
    headers = ["configuration", "copy call (CPU)", "copy on GPU", "step"]
    return table(headers, [[name, ms(call), ms(copy), ms(step)] for name, call, copy, step in rows])


COPY_CALL_WHAT = "the copy call's duration"


def copy_call_evidence(cells: list[CellResult], device: torch.device | str) -> Evidence[Any]:
    """The copy-call table's rows: ``cells`` measured here on CUDA; else a GPU's recording; else missing. Never the
    published totals of :func:`related_totals`: they time copy + kernel + copy, not the copy call."""
    return evidence.measure_or_recall(
        COPY_CALL_WHAT, device, lambda: cells, key="ch05.overlap.step_time", convert=copy_call_rows_from_records,
        no_published="No published figure of the copy call's duration is shown.",
    )  # fmt: skip


def related_totals() -> Evidence[Any]:
    """A related experiment others published (the NVIDIA post's totals): the whole time of copy in, kernel and copy
    out, in sequence and overlapped on 4 streams, said to be totals and not the copy call; missing if none is cited."""
    what = "a related experiment: copy + kernel + copy totals, sequential vs overlapped"
    figs = evidence.cited_for("ch05.overlap.step_time")  # the experiment the copy-call table's rows are recorded as
    if not figs:
        return evidence.missing(what)
    source = (
        "published by others (not this machine, not this workbook's setup). Each figure is the total time of a "
        "host-to-device copy, a kernel and a device-to-host copy; none is the copy call's duration"
    )
    return Evidence(what, "published", None, source, cited=figs)


def schematic_trace(memory: str, stream: str) -> SpanTrace:
    """What a cell's timeline looks like, in arbitrary units; its metadata says ``schematic, not measured``."""
    expected = expected_label(memory, stream)  # checks memory and stream
    overlapped, host_blocked = expected == OVERLAPPED, memory == "pageable"
    copy_lane, compute_lane = f"{stream} stream (copy)", "default stream (compute)"  # as run_cell names them
    spans: list[Span] = []
    t, call, copy, compute = 0.0, 0.08, 1.0, 1.5
    for i in range(3):
        c1 = t + copy
        k0 = (t + 2 * call) if overlapped else c1 + (call if host_blocked else 0.0)
        end = max(c1, k0 + compute)
        call_end = c1 if host_blocked else t + call
        spans += [
            Span("copy", i, copy_lane, t, c1, t, c1, True),
            Span("compute", i, compute_lane, k0, k0 + compute, k0, k0 + compute, True),
            Span("copy call", i, HOST_LANE, t, call_end, t, call_end, False),
            Span("wait", i, HOST_LANE, call_end + call, end, call_end + call, end, False),
        ]
        t = end + 0.15
    lanes = [copy_lane, compute_lane, HOST_LANE]
    return SpanTrace(spans, {"kind": SCHEMATIC, "memory": memory, "stream": stream, "lanes": lanes,
                             "expected_label": expected})  # fmt: skip


def artifact_name(memory: str, stream: str) -> str:
    return f"ch05.timeline.{memory}.{stream}"


def reference_cell(memory: str, stream: str) -> Evidence[SpanTrace]:
    """The newest reference recording of a cell's timeline, or ``missing``."""
    return evidence.recorded_artifact(
        f"the timeline of {memory} + {stream} stream",
        artifact_name(memory, stream),
        lambda rs, data: SpanTrace.from_dict(dict(data)),
    )


def timeline_evidence(cell: CellResult) -> Evidence[Any]:
    """A cell's timeline: measured here on CUDA, else its reference recording (a CPU run is not the experiment)."""
    if cell.on_gpu:
        what = f"the timeline of {cell.memory} + {cell.stream} stream"
        return evidence.measured(what, cell, cell.device, method="CUDA events, one lane per stream")
    return reference_cell(cell.memory, cell.stream)


def _title(meta: dict[str, Any]) -> str:
    title = f"{meta.get('memory', '?')} source, {meta.get('stream', '?')} stream"
    if meta.get("kind") == SCHEMATIC:
        return title + f" — expected: {meta.get('expected_label')} ({SCHEMATIC})"
    if meta.get("measured_label"):
        return title + (
            f" — measured: {meta['measured_label']} "
            f"({float(meta.get('overlap_fraction', 0)):.0%} hidden), expected: {meta.get('expected_label')}"
        )
    return title


def draw_cell(cell: CellResult | SpanTrace | Evidence[Any], ax: Any = None) -> Any:
    """A cell's timeline, schematics labelled; an Evidence with its source line, a missing one as an empty axis."""
    from ...ui.plots import new_axes, timeline  # optional/heavy: matplotlib

    shown, source = (cell.value, cell.source) if isinstance(cell, Evidence) else (cell, None)
    if shown is None:
        ax = ax if ax is not None else new_axes()
        ax.set_axis_off()
        ax.set_title(
            f"{getattr(cell, 'what', '')}: no reference recording yet (its schematic is in Theory)", fontsize=9
        )
        return ax
    trace: SpanTrace = shown.trace if isinstance(shown, CellResult) else shown
    meta = trace.metadata
    lanes = list(meta.get("lanes") or []) or None
    ax = timeline(trace, ax, title=_title(meta), lanes=lanes, source=source, max_steps=3)
    ax.title.set_fontsize(9)
    if meta.get("kind") == SCHEMATIC:
        ax.set_xlabel(f"time (arbitrary units) — {SCHEMATIC.upper()}")
        ax.set_xticks([])
    return ax
