"""Timing that tells the truth: warm-up, synchronisation, medians and spread.

Three tools, one per question:

``measure(fn, ...)``
    "How long does this operation take?" Built on ``torch.utils.benchmark.Timer``,
    which warms up, synchronises CUDA before every clock read and reports the
    median and inter-quartile range (IQR) of many timed blocks.
``gpu_span()`` / ``cuda_event_time(fn)``
    "How long did the GPU spend on this?" CUDA events are recorded on the stream,
    so they time the GPU's work, not the CPU's enqueueing of it. On a machine with
    no CUDA device they fall back to the wall clock and say so in ``method``.
``SpanRecorder``
    "Where does a training step spend its time?" Records named phases (load,
    h2d, compute, ...) of consecutive steps with host timestamps, and CUDA event
    timestamps for work that runs on the GPU, so timelines can be drawn later.

Two sources of GPU work of a known duration, for experiments that need the GPU busy:
``GpuDelay(dev)()`` (do-nothing work, ``torch.cuda._sleep``) and ``calibrated_compute(dev, s)``
(matrix products). Chapter 05's hazards, race checks and overlap measurements use them.

Everything here measures the device it is given, not the current one. In torch,
``Event.record()`` with no stream records on ``torch.cuda.current_stream()`` (the *current*
device's stream) and ``torch.cuda.synchronize()`` with no device waits for the current device
only: with the work on ``cuda:1`` while ``cuda:0`` is current, such an event guards nothing and
such a timing times nothing. So every event here is recorded on ``torch.cuda.current_stream(dev)``
(or the stream you pass), every sync names ``dev``, and work that takes no device
(``torch.cuda._sleep``, your ``fn``) is queued under ``with torch.cuda.device(dev):``.

Every result carries its metadata (device, method, threads, mode) so that a
number never travels without the way it was measured.
"""

from __future__ import annotations

import contextlib
import logging
import math
import statistics
import time
import timeit
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterator

import torch

# torch.utils.benchmark imports cpp_extension, which logs a warning on machines
# without a CUDA toolkit; that line is noise for readers.
logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
import torch.utils.benchmark as tbench  # noqa: E402

from .config import mode_name
from .validate import check_float, check_int, human_seconds

__all__ = [
    "Timing",
    "measure",
    "time_calls",
    "summarize",
    "synchronize",
    "cuda_event_time",
    "Span",
    "SpanTrace",
    "SpanRecorder",
    "GpuDelay",
    "calibrated_compute",
]


def synchronize(device: torch.device | str | None = None) -> None:
    """Wait for all queued work on ``device`` (no-op on CPU).

    ``device=None`` waits for every CUDA device that has work (a CUDA context), not only the current
    one: ``torch.cuda.synchronize()`` with no argument would leave ``cuda:1``'s work running while
    ``cuda:0`` is current.
    """
    if device is None:
        if torch.cuda.is_available():
            for index in _cuda_devices_in_use():
                torch.cuda.synchronize(index)
        elif hasattr(torch, "accelerator") and torch.accelerator.is_available():
            torch.accelerator.synchronize()
        return
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    elif dev.type != "cpu" and hasattr(torch, "accelerator") and torch.accelerator.is_available():
        torch.accelerator.synchronize(dev)


def _cuda_devices_in_use() -> list[int]:
    """Indices of the CUDA devices that may have queued work: those with a CUDA context.

    A device without one has nothing queued, and synchronising it would create a context (memory on
    a GPU nobody uses). Without torch's (private) probe, every device is taken.
    """
    if not torch.cuda.is_initialized():
        return []
    has_context = getattr(torch._C, "_cuda_hasPrimaryContext", None)
    indices = list(range(torch.cuda.device_count()))
    if has_context is None:
        return indices
    try:
        return [i for i in indices if has_context(i)]
    except RuntimeError:
        return indices


def _synchronised_clock(device: torch.device | str | None) -> Callable[[], float]:
    """A clock for ``torch.utils.benchmark.Timer`` that first waits for ``device``'s queued work.

    The Timer's own clock calls ``torch.accelerator.synchronize()``, which waits for the *current*
    device only.
    """

    def clock() -> float:
        synchronize(device)
        return timeit.default_timer()

    return clock


def _clock_name(device: torch.device | str | None) -> str:
    """How :func:`_synchronised_clock` reads the time, for a result's metadata."""
    if device is None:
        return "clock reads synchronised with every CUDA device" if torch.cuda.is_available() else "wall clock"
    dev = torch.device(device)
    if dev.type == "cpu" or (dev.type == "cuda" and not torch.cuda.is_available()):
        return "wall clock"
    return f"clock reads synchronised with {dev}"


def _cuda_device(device: torch.device | str | None) -> torch.device:
    """``device`` as a CUDA device with its index (``cuda`` alone means the current device)."""
    dev = torch.device(device) if device is not None else torch.device("cuda")
    return dev if dev.index is not None else torch.device("cuda", torch.cuda.current_device())


def _is_cuda(device: torch.device | str | None) -> bool:
    if device is None:
        return False
    return torch.device(device).type == "cuda" and torch.cuda.is_available()


@dataclass
class Timing:
    """Summary of repeated timings of one operation, in seconds.

    Attributes:
        label: what was timed.
        median_s: median time of one call.
        iqr_s: inter-quartile range (75th minus 25th percentile) of one call.
        mean_s: mean time of one call (pulled up by outliers; prefer the median).
        min_s / max_s: extremes of the per-call times.
        n: number of timed samples (blocks or calls).
        times_s: the per-call samples themselves.
        metadata: how it was measured (device, method, threads, mode, ...).
    """

    label: str
    median_s: float
    iqr_s: float
    mean_s: float
    min_s: float
    max_s: float
    n: int
    times_s: list[float] = field(default_factory=list)
    metadata: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-friendly copy."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Timing":
        return cls(**data)

    @property
    def quartiles_s(self) -> tuple[float, float]:
        """(25th, 75th) percentile of one call, from :attr:`times_s` (the median twice with fewer than 2 samples)."""
        if len(self.times_s) < 2:
            return self.median_s, self.median_s
        ordered = sorted(self.times_s)
        return _quantile(ordered, 0.25), _quantile(ordered, 0.75)

    def __str__(self) -> str:
        import textwrap

        text = (
            f"{self.label}: median {human_seconds(self.median_s)}"
            f" (IQR {human_seconds(self.iqr_s)}, n={self.n}, {self.metadata.get('method', '?')})"
        )
        # Printed lines stay short and break between words (a notebook would break them anywhere).
        return textwrap.fill(text, width=100, subsequent_indent="    ", break_long_words=False, break_on_hyphens=False)


def _quantile(sorted_values: list[float], q: float) -> float:
    """Linear-interpolated quantile of an already sorted list."""
    if not sorted_values:
        return float("nan")
    pos = (len(sorted_values) - 1) * q
    lo = int(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    frac = pos - lo
    return sorted_values[lo] * (1 - frac) + sorted_values[hi] * frac


def summarize(label: str, times_s: list[float], **metadata: Any) -> Timing:
    """Build a :class:`Timing` from raw per-call samples (seconds).

    Raises:
        ValueError: if ``times_s`` is empty.
    """
    if len(times_s) == 0:
        raise ValueError("times_s must hold at least one sample, got none")
    values = sorted(float(t) for t in times_s)
    metadata.setdefault("mode", mode_name())
    return Timing(
        label=label,
        median_s=statistics.median(values),
        iqr_s=_quantile(values, 0.75) - _quantile(values, 0.25),
        mean_s=statistics.fmean(values),
        min_s=values[0],
        max_s=values[-1],
        n=len(values),
        times_s=[float(t) for t in times_s],
        metadata=metadata,
    )


def measure(
    fn: Callable[[], Any],
    *,
    label: str = "operation",
    device: torch.device | str | None = None,
    min_run_time: float = 0.2,
    blocks: int = 15,
    warmup: int = 2,
    num_threads: int | None = None,
) -> Timing:
    """Time ``fn()`` with ``torch.utils.benchmark.Timer``: warm-up, sync, median and IQR.

    The Timer synchronises ``device`` before each clock read (every CUDA device
    in use when ``device`` is None; nothing for the CPU) and runs ``fn`` in
    blocks of several calls so that clock overhead is negligible. We size the
    blocks so that about ``blocks`` of them fill ``min_run_time``
    (``Timer.blocked_autorange`` alone often takes a single huge block for fast
    operations, which hides the spread), and we warm up explicitly (``warmup``
    calls, then a synchronisation) so lazy initialisation is never timed.

    Args:
        fn: a zero-argument callable doing the work.
        label: what is being timed, for the result.
        device: the device the work runs on (for the metadata, the warm-up sync
            and the sync before every clock read).
        min_run_time: seconds of timed work to collect, roughly.
        blocks: number of timed blocks (samples) to collect.
        warmup: untimed calls first.
        num_threads: torch intra-op threads during timing; default: the
            current ``torch.get_num_threads()`` (the Timer alone would use 1).
    """
    if not callable(fn):
        raise ValueError(f"fn must be a callable taking no arguments, got {type(fn).__name__}")
    check_float("min_run_time", min_run_time, 1e-4, 600.0)
    check_int("blocks", blocks, 3, 100_000)
    check_int("warmup", warmup, 0, 10_000)
    threads = torch.get_num_threads() if num_threads is None else check_int("num_threads", num_threads, 1, 1024)
    for _ in range(warmup):
        fn()
    synchronize(device)
    timer = tbench.Timer(
        stmt="fn()", globals={"fn": fn}, label=label, num_threads=threads, timer=_synchronised_clock(device)
    )
    one = max(timer.timeit(1).median, 1e-9)  # one synchronised call, to size the blocks
    number = max(1, min(1_000_000, int((min_run_time / blocks) / one)))
    samples = [timer.timeit(number).median for _ in range(blocks)]
    dev = str(torch.device(device)) if device is not None else "cpu"
    clock = _clock_name(device)
    return summarize(
        label,
        samples,
        device=dev,
        method=f"torch.utils.benchmark.Timer.timeit, {blocks} blocks of {number} call(s) ({clock})",
        warmup=warmup,
        num_threads=threads,
        calls_per_block=number,
    )


def time_calls(
    fn: Callable[[], Any],
    *,
    repeats: int,
    label: str = "operation",
    device: torch.device | str | None = None,
    sync: bool = True,
    warmup: int = 0,
) -> Timing:
    """Time ``repeats`` single calls of ``fn`` with the wall clock, one sample each.

    Use this to *show* effects the benchmark Timer hides on purpose: the cost
    of the first call (``warmup=0``), or what happens when you forget to
    synchronise (``sync=False``: the clock stops when the CPU has *queued* the
    work, not when the GPU has done it).
    """
    check_int("repeats", repeats, 1, 1_000_000)
    check_int("warmup", warmup, 0, 10_000)
    for _ in range(warmup):
        fn()
    if sync:
        synchronize(device)
    samples: list[float] = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        if sync:
            synchronize(device)
        samples.append(time.perf_counter() - t0)
    method = "wall clock per call, " + ("synchronised" if sync else "NOT synchronised")
    dev = str(torch.device(device)) if device is not None else "cpu"
    return summarize(label, samples, device=dev, method=method, warmup=warmup, sync=sync)


def cuda_event_time(
    fn: Callable[[], Any],
    *,
    repeats: int = 10,
    warmup: int = 2,
    label: str = "operation",
    device: torch.device | str | None = None,
) -> Timing:
    """Time ``fn`` on the GPU with CUDA events (one start/end pair per call).

    Events are timestamps the GPU writes when it reaches them in its stream, so
    they measure GPU execution time, not CPU launch time. They are recorded on
    ``device``'s current stream, and ``fn`` runs with ``device`` current (so work
    that takes no device goes there too), whichever device was current before.
    Without a CUDA device this falls back to synchronised wall-clock timing and
    says so in ``metadata['method']``; it never raises for a missing GPU.
    """
    check_int("repeats", repeats, 1, 1_000_000)
    check_int("warmup", warmup, 0, 10_000)
    if not _is_cuda(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu")):
        timing = time_calls(fn, repeats=repeats, label=label, device="cpu", sync=True, warmup=warmup)
        timing.metadata["method"] = "wall clock (no CUDA device: CUDA events unavailable)"
        return timing
    dev = _cuda_device(device)
    pairs = []
    with torch.cuda.device(dev):
        for _ in range(warmup):
            fn()
        torch.cuda.synchronize(dev)
        for _ in range(repeats):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record(torch.cuda.current_stream(dev))
            fn()
            end.record(torch.cuda.current_stream(dev))
            pairs.append((start, end))
        torch.cuda.synchronize(dev)
    samples = [s.elapsed_time(e) / 1e3 for s, e in pairs]
    return summarize(label, samples, device=str(dev), method=f"CUDA events on {dev}'s current stream", warmup=warmup)


# ---------------------------------------------------------------------------
# Span recording for step anatomy and timelines
# ---------------------------------------------------------------------------


@dataclass
class Span:
    """One timed phase of one step.

    Times are seconds since the recorder started. ``start``/``end`` are when the
    work *ran*: for a GPU span those come from CUDA events (the GPU's own clock,
    aligned to the recorder's start), for a host span from the wall clock.
    ``host_start``/``host_end`` always hold the wall-clock interval during which
    the CPU was inside the ``with`` block (for a GPU span: enqueueing the work).
    """

    name: str
    step: int
    lane: str
    start: float
    end: float
    host_start: float
    host_end: float
    on_gpu: bool = False

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclass
class SpanTrace:
    """The spans of a recorded run, with metadata describing how they were taken."""

    spans: list[Span]
    metadata: dict[str, Any] = field(default_factory=dict)

    def phase_totals(self) -> dict[str, float]:
        """Total seconds per phase name, in first-seen order."""
        totals: dict[str, float] = {}
        for s in self.spans:
            totals[s.name] = totals.get(s.name, 0.0) + s.duration
        return totals

    def phase_means(self) -> dict[str, float]:
        """Mean seconds per step for each phase, over the steps in which it occurs."""
        counts: dict[str, int] = {}
        for s in self.spans:
            counts[s.name] = counts.get(s.name, 0) + 1
        return {k: v / counts[k] for k, v in self.phase_totals().items()}

    def wall_time(self) -> float:
        """Seconds from the first span's start to the last span's end."""
        if not self.spans:
            return 0.0
        return max(s.end for s in self.spans) - min(s.start for s in self.spans)

    def lane_busy(self) -> dict[str, float]:
        """Fraction of the wall time each lane was busy (overlapping spans in a lane merged)."""
        wall = self.wall_time()
        out: dict[str, float] = {}
        if wall <= 0:
            return out
        by_lane: dict[str, list[tuple[float, float]]] = {}
        for s in self.spans:
            by_lane.setdefault(s.lane, []).append((s.start, s.end))
        for lane, intervals in by_lane.items():
            intervals.sort()
            busy, cur_s, cur_e = 0.0, intervals[0][0], intervals[0][1]
            for a, b in intervals[1:]:
                if a > cur_e:
                    busy += cur_e - cur_s
                    cur_s, cur_e = a, b
                else:
                    cur_e = max(cur_e, b)
            busy += cur_e - cur_s
            out[lane] = busy / wall
        return out

    def steps(self) -> int:
        return len({s.step for s in self.spans})

    def to_dict(self) -> dict[str, Any]:
        return {"spans": [asdict(s) for s in self.spans], "metadata": dict(self.metadata)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "SpanTrace":
        return cls(spans=[Span(**s) for s in data["spans"]], metadata=dict(data.get("metadata", {})))


class SpanRecorder:
    """Record the phases of consecutive training steps.

    >>> rec = SpanRecorder("cpu")
    >>> with rec.span("compute", step=0):
    ...     _ = sum(range(1000))
    >>> trace = rec.finish()
    >>> trace.spans[0].name
    'compute'

    On a CUDA device, pass ``gpu=True`` for a phase that enqueues GPU work (a copy,
    the forward pass): the recorder then records CUDA events on the recorder's
    device's current stream (or on ``stream``, which must be on that device)
    around it, runs the body with that device current, and the span's
    ``start``/``end`` come from the GPU's clock. Host-only phases (``gpu=False``, the default) use the
    wall clock. Nothing is synchronised between spans, so recording does not
    change the overlap it is meant to reveal; call :meth:`finish` once at the
    end, which synchronises and resolves the events.

    Lanes name the resource a phase occupies, for timeline plots: by default
    ``"host"`` for host phases and ``"gpu"`` for GPU phases; pass ``lane=`` to
    split, e.g. ``"copy stream"`` vs ``"compute stream"``.
    """

    def __init__(self, device: torch.device | str = "cpu", **metadata: Any) -> None:
        self.device = torch.device(device)
        self.cuda = _is_cuda(self.device)
        self._open: list[tuple[str, int, str, float, float, Any, Any]] = []
        self.metadata: dict[str, Any] = dict(metadata)
        self.metadata.setdefault("device", str(self.device))
        self.metadata.setdefault("mode", mode_name())
        self.metadata["method"] = (
            "host phases: time.perf_counter; GPU phases: CUDA events aligned to a reference event"
            if self.cuda
            else "time.perf_counter (no CUDA device: every phase is timed on the host)"
        )
        if self.cuda:
            self._cuda = _cuda_device(self.device)  # "cuda" alone: the device current now, for every span
            torch.cuda.synchronize(self._cuda)
            self._ref = torch.cuda.Event(enable_timing=True)
            self._ref.record(torch.cuda.current_stream(self._cuda))
            torch.cuda.synchronize(self._cuda)
        self._t0 = time.perf_counter()
        self._finished: SpanTrace | None = None

    @contextlib.contextmanager
    def span(
        self,
        name: str,
        step: int,
        *,
        gpu: bool = False,
        lane: str | None = None,
        stream: "torch.cuda.Stream | None" = None,
    ) -> Iterator[None]:
        """Time the body of the ``with`` block as phase ``name`` of step ``step``."""
        if self._finished is not None:
            raise RuntimeError("this SpanRecorder is finished; create a new one for a new run")
        use_events = gpu and self.cuda
        lane_name = lane or ("gpu" if gpu else "host")
        start_ev = end_ev = None
        on_device: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
        if use_events:
            if stream is not None and _cuda_device(stream.device) != self._cuda:
                raise ValueError(
                    f"span {name!r}: stream is on {stream.device} but this recorder times {self._cuda}; "
                    f"pass a stream of {self._cuda} or record with a SpanRecorder({str(stream.device)!r})"
                )
            events_on = stream if stream is not None else torch.cuda.current_stream(self._cuda)
            on_device = torch.cuda.device(self._cuda)
            start_ev = torch.cuda.Event(enable_timing=True)
            start_ev.record(events_on)
        h0 = time.perf_counter() - self._t0
        try:
            with on_device:
                yield
        finally:
            if use_events:
                end_ev = torch.cuda.Event(enable_timing=True)
                end_ev.record(events_on)
            h1 = time.perf_counter() - self._t0
            self._open.append((name, int(step), lane_name, h0, h1, start_ev, end_ev))

    def add(self, name: str, step: int, start: float, end: float, lane: str = "host") -> None:
        """Add a span measured elsewhere (seconds since this recorder started)."""
        self._open.append((name, int(step), lane, float(start), float(end), None, None))

    def now(self) -> float:
        """Seconds since this recorder started (host clock)."""
        return time.perf_counter() - self._t0

    def since_start(self, perf_counter_s: float) -> float:
        """A ``time.perf_counter()`` reading of this process as seconds since this recorder started.

        One subtraction, no second clock read: converting through ``time.perf_counter() - self.now()``
        shifts the result by however long the thread was descheduled between the two reads.
        """
        return perf_counter_s - self._t0

    def finish(self) -> SpanTrace:
        """Synchronise, resolve CUDA events, and return the trace (idempotent)."""
        if self._finished is not None:
            return self._finished
        if self.cuda:
            torch.cuda.synchronize(self._cuda)
        spans: list[Span] = []
        for name, step, lane, h0, h1, ev0, ev1 in self._open:
            if ev0 is not None and ev1 is not None:
                g0 = self._ref.elapsed_time(ev0) / 1e3
                g1 = self._ref.elapsed_time(ev1) / 1e3
                spans.append(Span(name, step, lane, g0, g1, h0, h1, on_gpu=True))
            else:
                spans.append(Span(name, step, lane, h0, h1, h0, h1, on_gpu=False))
        self._finished = SpanTrace(spans=spans, metadata=dict(self.metadata))
        return self._finished


# ---------------------------------------------------------------------------
# GPU work of a known duration (for overlap and race experiments)
# ---------------------------------------------------------------------------


class GpuDelay:
    """Queue about ``seconds`` of do-nothing GPU work on ``dev``'s current stream (``torch.cuda._sleep``).

    ``GpuDelay(dev)()`` keeps the GPU busy while the host runs on: chapter 05's hazards and the
    prefetcher's race checks use it to make a missing synchronisation show. It calibrates and queues on
    ``dev`` whichever device is current (``torch.cuda._sleep`` takes no device: it is queued under
    ``with torch.cuda.device(dev):``), on the stream a ``with torch.cuda.stream(s):`` around the call
    made current on ``dev``. CUDA only.
    """

    def __init__(self, dev: torch.device, seconds: float = 0.05) -> None:
        self.dev = dev
        if hasattr(torch.cuda, "_sleep"):
            probe = 5_000_000
            with torch.cuda.device(dev):
                torch.cuda._sleep(probe // 10)
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record(torch.cuda.current_stream(dev))
                torch.cuda._sleep(probe)
                e.record(torch.cuda.current_stream(dev))
            torch.cuda.synchronize(dev)
            per_s = probe / max(s.elapsed_time(e) / 1e3, 1e-6)
            self.cycles = int(seconds * per_s)
            self.a = None
        else:  # pragma: no cover - very old torch
            self.cycles = 0
            self.a = torch.randn(2048, 2048, device=dev)

    def __call__(self) -> None:
        if self.a is None:
            with torch.cuda.device(self.dev):
                torch.cuda._sleep(self.cycles)
        else:  # pragma: no cover
            for _ in range(20):
                self.a @ self.a


def calibrated_compute(dev: torch.device, target_s: float) -> Callable[[torch.Tensor], torch.Tensor]:
    """A function of a batch that takes about ``target_s`` of GPU time (matrix products; CUDA only).

    Calibrated once on ``dev`` (events on ``dev``'s current stream, whichever device is current); the
    products run on ``dev``, on its current stream at call time. The function returns
    ``batch.float().sum()`` plus one element of the product, so its result depends on the batch.
    """
    a = torch.randn(2048, 2048, device=dev).div_(math.sqrt(2048))
    c = torch.empty_like(a)
    torch.mm(a, a, out=c)
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record(torch.cuda.current_stream(dev))
    for _ in range(5):
        torch.mm(a, a, out=c)
    e.record(torch.cuda.current_stream(dev))
    torch.cuda.synchronize(dev)
    one = max(s.elapsed_time(e) / 5e3, 1e-6)
    k = max(1, round(target_s / one))

    def compute(batch: torch.Tensor) -> torch.Tensor:
        for _ in range(k):
            torch.mm(a, a, out=c)
        return batch.float().sum() + c[0, 0]

    return compute
