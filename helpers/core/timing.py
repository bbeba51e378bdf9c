"""Timing that tells the truth, one tool per question: ``measure`` (how long an operation takes: Timer blocks,
median and IQR), ``time_calls`` (what single calls cost: the wall clock), ``SpanRecorder`` (where a step's time
goes: host clock, CUDA events for GPU phases). An event or sync without a device guards only the *current*
device, so every event here is recorded on ``dev``'s stream, every sync names ``dev``, and ``fn`` runs on ``dev``.
"""

from __future__ import annotations

import collections
import contextlib
import io
import logging
import math
import statistics
import sys
import time
import timeit
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterator

import torch

# torch.utils.benchmark imports cpp_extension, which says "No CUDA runtime is found, using CUDA_HOME=..." on a machine
# with a CUDA toolkit but no GPU (a logger warning; torch 2.7, the floor, prints it to stderr): noise for readers.
# Every other line the import writes to stderr is written again.
logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
with contextlib.redirect_stderr(io.StringIO()) as _said:
    import torch.utils.benchmark as tbench  # noqa: E402
sys.stderr.write("".join(x for x in _said.getvalue().splitlines(True) if not x.startswith("No CUDA runtime is found")))

from .config import mode_name
from .validate import check_float, check_int, human_seconds, wrap


def synchronize(device: torch.device | str | None = None) -> None:
    """Wait for all queued work on ``device`` (no-op on CPU); None: every CUDA device with a context."""
    if device is None:
        if torch.cuda.is_available():
            for index in _cuda_devices_in_use():
                torch.cuda.synchronize(index)
        elif torch.accelerator.is_available():
            torch.accelerator.synchronize()
        return
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    elif dev.type != "cpu" and torch.accelerator.is_available():
        torch.accelerator.synchronize(dev)


def _cuda_devices_in_use() -> list[int]:
    """CUDA devices with a context (others have nothing queued; a sync would create one)."""
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


def _cuda_device(device: torch.device | str | None) -> torch.device:
    """``device`` as a CUDA device with its index (``cuda`` alone: the current one)."""
    dev = torch.device(device) if device is not None else torch.device("cuda")
    return dev if dev.index is not None else torch.device("cuda", torch.cuda.current_device())


def _is_cuda(device: torch.device | str | None) -> bool:
    return device is not None and torch.device(device).type == "cuda" and torch.cuda.is_available()


@dataclass
class Timing:
    """Repeated timings of one call, in seconds: the ``n`` per-call samples (blocks or calls), their summary
    (IQR: 75th - 25th percentile; the mean is pulled up by outliers) and how they were measured."""

    label: str
    median_s: float
    iqr_s: float
    mean_s: float
    min_s: float
    max_s: float
    n: int
    times_s: list[float] = field(default_factory=list)
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def quartiles_s(self) -> tuple[float, float]:
        """(25th, 75th) percentile of one call, interpolated (the median twice with fewer than 2 samples)."""
        if len(self.times_s) < 2:
            return self.median_s, self.median_s
        q1, _, q3 = statistics.quantiles(self.times_s, n=4, method="inclusive")
        return q1, q3

    def __str__(self) -> str:
        text = (
            f"{self.label}: median {human_seconds(self.median_s)}"
            f" (IQR {human_seconds(self.iqr_s)}, n={self.n}, {self.metadata.get('method', '?')})"
        )
        return wrap(text, indent="    ")


def summarize(label: str, times_s: list[float], **metadata: Any) -> Timing:
    """A :class:`Timing` of raw per-call samples (seconds); ValueError if there are none."""
    if len(times_s) == 0:
        raise ValueError("times_s must hold at least one sample, got none")
    samples = [float(t) for t in times_s]
    metadata.setdefault("mode", mode_name())
    median, mean = statistics.median(samples), statistics.fmean(samples)
    timing = Timing(label, median, 0.0, mean, min(samples), max(samples), len(samples), samples, metadata)
    q1, q3 = timing.quartiles_s
    timing.iqr_s = q3 - q1
    return timing


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
    """Time ``fn()`` with ``torch.utils.benchmark.Timer``, its clock synchronised with ``device`` (None: every
    CUDA device in use): ``blocks`` blocks of calls fill about ``min_run_time`` (``blocked_autorange`` often takes
    one huge block, which hides the spread). ``num_threads``: the current torch's (the Timer alone would use 1).
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

    def clock() -> float:  # the Timer's own clock waits for the current device only
        synchronize(device)
        return timeit.default_timer()

    timer = tbench.Timer(stmt="fn()", globals={"fn": fn}, label=label, num_threads=threads, timer=clock)
    one = max(timer.timeit(1).median, 1e-9)  # one synchronised call, to size the blocks
    number = max(1, min(1_000_000, int((min_run_time / blocks) / one)))
    samples = [timer.timeit(number).median for _ in range(blocks)]
    dev = str(torch.device(device)) if device is not None else "cpu"
    kind = torch.device(dev).type
    synced = torch.cuda.is_available() if kind == "cuda" or device is None else kind != "cpu"
    clock_name = f"clock reads synchronised with {'every CUDA device' if device is None else dev}"
    clock_name = clock_name if synced else "wall clock"
    return summarize(
        label,
        samples,
        device=dev,
        method=f"torch.utils.benchmark.Timer.timeit, {blocks} blocks of {number} call(s) ({clock_name})",
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
    """Time ``repeats`` single calls with the wall clock: *shows* what the Timer hides, the first call's cost
    (``warmup=0``) or a missing sync (``sync=False``: the clock stops when the CPU has *queued* the work)."""
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
    """Time ``fn``'s GPU execution with CUDA events (one :class:`SpanRecorder` span per call, ``device`` current).
    Without CUDA: synchronised wall-clock timing, said so in ``metadata['method']``."""
    if not _is_cuda("cuda" if device is None else device):
        timing = time_calls(fn, repeats=repeats, label=label, device="cpu", sync=True, warmup=warmup)
        timing.metadata["method"] = "wall clock (no CUDA device: CUDA events unavailable)"
        return timing
    dev = _cuda_device(device)
    with torch.cuda.device(dev):
        for _ in range(warmup):
            fn()
    rec = SpanRecorder(dev)  # synchronises dev first
    for i in range(repeats):
        with rec.span(label, i, gpu=True):
            fn()
    samples = [s.duration for s in rec.finish().spans]
    return summarize(label, samples, device=str(dev), method=f"CUDA events on {dev}'s current stream", warmup=warmup)


@dataclass
class Span:
    """One phase of one step, in seconds since the recorder started: ``start``/``end`` when the work *ran* (CUDA
    events for a GPU span), ``host_start``/``host_end`` when the CPU was inside the ``with`` block."""

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
    spans: list[Span]
    metadata: dict[str, Any] = field(default_factory=dict)

    def phase_totals(self) -> dict[str, float]:
        totals: dict[str, float] = {}
        for s in self.spans:
            totals[s.name] = totals.get(s.name, 0.0) + s.duration
        return totals

    def phase_means(self) -> dict[str, float]:
        """Mean seconds per step for each phase, over the steps in which it occurs."""
        counts = collections.Counter(s.name for s in self.spans)
        return {k: v / counts[k] for k, v in self.phase_totals().items()}

    def wall_time(self) -> float:
        """Seconds from the first span's start to the last span's end."""
        return max(s.end for s in self.spans) - min(s.start for s in self.spans) if self.spans else 0.0

    def lane_busy(self) -> dict[str, float]:
        """Fraction of the wall time each lane was busy (overlapping spans in a lane merged)."""
        wall = self.wall_time()
        busy = dict.fromkeys((s.lane for s in self.spans), 0.0)
        reached: dict[str, float] = {}  # per lane, the latest end so far: a later span adds only what lies beyond
        for s in sorted(self.spans, key=lambda s: s.start):
            r = reached.get(s.lane, -math.inf)
            busy[s.lane] += max(0.0, s.end - max(s.start, r))
            reached[s.lane] = max(r, s.end)
        return {lane: b / wall for lane, b in busy.items()} if wall > 0 else {}

    def steps(self) -> int:
        return len({s.step for s in self.spans})

    def to_dict(self) -> dict[str, Any]:
        return {"spans": [asdict(s) for s in self.spans], "metadata": dict(self.metadata)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "SpanTrace":
        return cls(spans=[Span(**s) for s in data["spans"]], metadata=dict(data.get("metadata", {})))


class SpanRecorder:
    """Record the phases of consecutive steps: ``with rec.span("compute", step=0): ...``, then ``rec.finish()``.

    ``gpu=True`` on CUDA: CUDA events around the phase on the device's current stream (or ``stream``), the body
    run with that device current. Nothing is synchronised between spans, so recording does not change the
    overlap it reveals; :meth:`finish` synchronises once. ``lane`` names the resource, for timelines.
    """

    def __init__(self, device: torch.device | str = "cpu", **metadata: Any) -> None:
        self.device = torch.device(device)
        self.cuda = _is_cuda(self.device)
        self._spans: list[Span] = []
        self._events: list[tuple[Span, Any, Any]] = []  # a GPU span and its CUDA events, resolved by finish()
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
            self._spans.append(Span(name, int(step), lane_name, h0, h1, h0, h1, on_gpu=use_events))
            if use_events:
                self._events.append((self._spans[-1], start_ev, end_ev))

    def add(self, name: str, step: int, start: float, end: float, lane: str = "host") -> None:
        self._spans.append(Span(name, int(step), lane, float(start), float(end), float(start), float(end)))

    def now(self) -> float:
        return time.perf_counter() - self._t0

    def since_start(self, perf_counter_s: float) -> float:
        """A ``time.perf_counter()`` reading as seconds since this recorder started."""
        return perf_counter_s - self._t0

    def finish(self) -> SpanTrace:
        """Synchronise, resolve CUDA events, and return the trace (idempotent)."""
        if self._finished is None:
            if self.cuda:
                torch.cuda.synchronize(self._cuda)
            for span, ev0, ev1 in self._events:  # GPU clock, aligned to the reference event
                span.start = self._ref.elapsed_time(ev0) / 1e3
                span.end = span.start + ev0.elapsed_time(ev1) / 1e3  # the pair itself: exact however long the run
            self._finished = SpanTrace(spans=list(self._spans), metadata=dict(self.metadata))
        return self._finished


class GpuDelay:
    """``GpuDelay(dev)()`` queues about ``seconds`` of do-nothing GPU work on ``dev``'s current stream (CUDA
    only), so a missing synchronisation shows (chapter 05's hazards, the prefetcher's race checks)."""

    def __init__(self, dev: torch.device, seconds: float = 0.05) -> None:
        self.dev = dev
        probe = 5_000_000
        took = cuda_event_time(lambda: torch.cuda._sleep(probe), repeats=1, warmup=1, device=dev).median_s
        self.cycles = int(seconds * probe / max(took, 1e-6))

    def __call__(self) -> None:
        with torch.cuda.device(self.dev):
            torch.cuda._sleep(self.cycles)
