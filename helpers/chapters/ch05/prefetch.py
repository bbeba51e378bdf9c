"""Chapter 05's check of the reader's prefetcher (exercise 05.3): its stream protocol on any machine, under logging
test doubles of the CUDA stream API; on a GPU also its batches with real streams, races and overlap."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import statistics
import textwrap
from typing import Any, Callable, Iterable, Iterator, Sequence
from unittest import mock

import torch

from ...core.config import strict_gpu_error
from ...core.timing import GpuDelay, cuda_event_time
from ...pipeline.data import MEAN, STD, to_float_normalized
from ...pipeline.prefetch import Prefetcher, iter_tensors
from .feeding import calibrated_compute, time_batches

#: The stream a prefetcher's consumer runs on, in the logs.
CONSUMER = "current stream"
#: A prefetcher keeps one batch in flight (two-stage); this many ahead is still accepted.
MAX_AHEAD = 2


class _Protocol:
    """The log of one run under the doubles (module-global: doubles a reader cached log here too)."""

    def __init__(self) -> None:
        self.log: list[tuple[Any, ...]] = []
        self.consumer = self.current = _FakeStream(CONSUMER)
        self.probes: dict[int, tuple[int, str]] = {}  # id(loader tensor) -> (batch index, "x" or "y")


_ACTIVE: _Protocol | None = None
_STREAM_NUMBERS = itertools.count(1)  # doubles may outlive a run (a reader's cache): names stay unique


def _log(*entry: Any) -> int:
    if _ACTIVE is None:
        return -1
    _ACTIVE.log.append(entry)
    return len(_ACTIVE.log) - 1


def _name(stream: Any) -> Any:
    if stream is None:
        return _ACTIVE.current.name if _ACTIVE is not None else None
    return getattr(stream, "name", repr(stream))


class _FakeStream:
    def __init__(self, name: str) -> None:
        self.name = name

    def wait_stream(self, other: Any) -> None:
        _log("wait", self.name, _name(other), len(_ACTIVE.log) if _ACTIVE else -1)

    def wait_event(self, event: _FakeEvent) -> None:
        event.wait(self)

    def record_event(self, event: _FakeEvent | None = None) -> _FakeEvent:
        event = event if event is not None else _FakeEvent()
        event.record(self)
        return event

    def synchronize(self) -> None:
        _log("synchronize", self.name)

    def query(self) -> bool:
        return True

    def __repr__(self) -> str:
        return f"<test double of a CUDA stream: {self.name}>"


class _FakeEvent:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.stream: str | None = None
        self.at = -1

    def record(self, stream: _FakeStream | None = None) -> None:
        self.stream = _name(stream)
        self.at = _log("record event", self.stream)

    def wait(self, stream: _FakeStream | None = None) -> None:
        if self.stream is not None:
            _log("wait", _name(stream), self.stream, self.at)

    def synchronize(self) -> None:
        _log("synchronize", self.stream)

    def query(self) -> bool:
        return True


@contextlib.contextmanager
def stream_doubles() -> Iterator[_Protocol]:
    """The CUDA stream API replaced by logging doubles inside the block; ``.to()`` of a tensor in ``probes`` logs a
    move."""
    global _ACTIVE
    if _ACTIVE is not None:
        raise RuntimeError("stream_doubles() is already active (it does not nest)")
    proto = _Protocol()
    original_to = torch.Tensor.to

    def logged_to(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        hit = proto.probes.get(id(self))
        target = kwargs.get("device", args[0] if args else None)
        if hit is not None and isinstance(target, (str, int, torch.device)):  # a move, not x.to(torch.float32)
            _log("move", hit[0], hit[1], proto.current.name, bool(kwargs.get("non_blocking", False)))
        return original_to(self, *args, **kwargs)

    def record_stream(self: torch.Tensor, stream: Any) -> None:
        _log("record_stream", id(self), _name(stream))

    @contextlib.contextmanager
    def use_stream(stream: Any) -> Iterator[Any]:  # torch.cuda.stream(s): s is current inside the block
        before, proto.current = proto.current, (stream if stream is not None else proto.current)
        try:
            yield stream
        finally:
            proto.current = before

    def make_stream(device: Any = None, priority: int = 0, **kwargs: Any) -> _FakeStream:
        stream = _FakeStream(f"side stream {next(_STREAM_NUMBERS)}")
        _log("new stream", stream.name)
        return stream

    doubles = {
        "Stream": make_stream,
        "Event": _FakeEvent,
        "stream": use_stream,
        "current_stream": lambda device=None: proto.current,
        "default_stream": lambda device=None: proto.consumer,
        "synchronize": lambda device=None: _log("synchronize", "device"),
    }
    with contextlib.ExitStack() as stack:
        for name, double in doubles.items():
            stack.enter_context(mock.patch.object(torch.cuda, name, double))
        stack.enter_context(mock.patch.object(torch.Tensor, "to", logged_to))
        stack.enter_context(mock.patch.object(torch.Tensor, "record_stream", record_stream))
        _ACTIVE = proto
        try:
            yield proto
        finally:
            _ACTIVE = None


class PairProbeLoader:
    """Re-iterable ``(uint8 images, labels = i)`` batches; logs ``("request", i)``, and its moves given ``proto``."""

    def __init__(self, n_batches: int = 4, proto: _Protocol | None = None) -> None:
        g = torch.Generator().manual_seed(5)
        self.batches = [
            (torch.randint(0, 256, (2, 3, 4, 4), dtype=torch.uint8, generator=g), torch.full((2,), i))
            for i in range(n_batches)
        ]
        if proto is not None:
            for i, (x, y) in enumerate(self.batches):
                proto.probes[id(x)], proto.probes[id(y)] = (i, "x"), (i, "y")

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for i, batch in enumerate(self.batches):
            _log("request", i)
            yield batch


def stream_protocol(
    candidate: Any, n_batches: int = 4, epochs: int = 1
) -> tuple[list[tuple[Any, ...]], list[list[Any]]]:
    """``(log, handed per epoch)`` of ``candidate(PairProbeLoader, "cpu")`` under the doubles, ``epochs`` times."""
    handed: list[list[Any]] = []
    with stream_doubles() as proto:
        loader = PairProbeLoader(n_batches, proto)
        wrapped = candidate(loader, torch.device("cpu"))
        for epoch in range(epochs):
            if epoch and isinstance(wrapped, Iterator):
                wrapped = candidate(loader, torch.device("cpu"))
            _log("epoch", epoch)
            handed.append([])
            for k, batch in enumerate(wrapped):
                _log("handed", epoch, k, [id(t) for t in iter_tensors(batch)])
                handed[-1].append(batch)
        return proto.log, handed


#: Each kind of log entry in words (``w``: the entry with the consumer named "the current stream").
_SAYS: dict[str, Callable[[tuple[Any, ...], list[Any]], str]] = {
    "move": lambda e, w: f"copy {e[2]}{e[1]} on {w[3]}" + (" (non_blocking)" if e[4] else " (blocking)"),
    "request": lambda e, w: f"request {e[1]}",
    "new stream": lambda e, w: f"make {e[1]}",
    "wait": lambda e, w: f"{w[1]} waits for {w[2]}",
    "record event": lambda e, w: f"event on {w[1]}",
    "record_stream": lambda e, w: f"record_stream({w[2]})",
    "synchronize": lambda e, w: f"synchronize {e[1]}",
}


def format_protocol(log: Sequence[tuple[Any, ...]], width: int = 100) -> str:
    """The log, one wrapped block per hand-over: what was asked since the last (repeats counted)."""

    def counted(items: list[str]) -> str:
        groups = [(k, len(list(g))) for k, g in itertools.groupby(items)]
        return ", ".join(f"{it} (x{n})" if n > 1 else it for it, n in groups) or "nothing"

    blocks: list[str] = []
    pending: list[str] = []
    for e in log:
        if e[0] == "handed":
            blocks.append(f"hand over batch {e[2]} after: " + counted(pending))
            pending = []
        elif e[0] in _SAYS:
            pending.append(_SAYS[e[0]](e, ["the current stream" if x == CONSUMER else x for x in e]))
    if pending:
        blocks.append("after the last hand-over: " + counted(pending))
    return "\n".join(textwrap.fill(b, width=width, initial_indent="  ", subsequent_indent="      ") for b in blocks)


_NOT_MOVED = "no batch was moved with .to(device): copy x and y with .to(device, non_blocking=True)"


def _order_problem(events: list[tuple[Any, ...]], at_handed: dict[tuple[int, int], int], n: int) -> str | None:
    """(1) Batch i+1 requested and moved before batch i is handed over, at most MAX_AHEAD ahead."""
    moved_any = any(e[0] == "move" for e in events)
    for i in range(n - 1):
        before = events[: at_handed[(0, i)]]
        if ("request", i + 1) not in before:
            return (
                f"batch {i + 1} was requested only after batch {i} was handed over: nothing is prefetched (a "
                "pass-through). Request and copy the next batch before you yield the current one."
            )
        if not any(e[0] == "move" and e[1] == i + 1 for e in before):
            if not moved_any:
                return _NOT_MOVED
            return (
                f"batch {i + 1} was requested before batch {i} was handed over but moved only after it: "
                "queue its copy before you yield the current batch"
            )
        ahead = sum(1 for e in before if e[0] == "request") - (i + 1)
        if ahead > MAX_AHEAD:
            return f"{ahead} batches were read ahead of batch {i}: keep one batch in flight"
    return None


def _copy_problems(events: list[tuple[Any, ...]], moves: list[tuple[int, tuple[Any, ...]]]) -> list[str]:
    """(2) copies on a side stream, non-blocking, the stream made once; (3) it first waits for the current one."""
    problems: list[str] = []
    on_current = [e for _, e in moves if e[3] == CONSUMER]
    if on_current:
        problems.append(
            f"batch {on_current[0][1]}'s {on_current[0][2]} was moved on the current stream: queue the "
            "copies inside `with torch.cuda.stream(side):` so they can overlap with compute"
        )
    blocking = [e for _, e in moves if not e[4]]
    if blocking:
        problems.append(
            f"batch {blocking[0][1]}'s {blocking[0][2]} was moved without non_blocking=True: the copy "
            "call would hold the CPU until the copy is done"
        )
    if ("epoch", 1) in events and any(e[0] == "new stream" for e in events[events.index(("epoch", 1)) :]):
        problems.append(
            "a new side stream was made for the second epoch: make it once (in __init__, or cached "
            "per device) and reuse it; a stream per epoch makes the caching allocator keep memory for "
            "each of them"
        )
    side_moves = [(k, e) for k, e in moves if e[3] != CONSUMER]
    if side_moves:
        k0, e0 = side_moves[0]
        if not any(e[0] == "wait" and e[1] == e0[3] and e[2] == CONSUMER for e in events[:k0]):
            problems.append(
                "the side stream did not wait for the current stream before its first copy: call "
                "side.wait_stream(torch.cuda.current_stream(device)) at the start of __iter__ "
                "(work queued earlier on the current stream must come first)"
            )
    return problems


def _hand_over_problem(
    events: list[tuple[Any, ...]], moves: list[tuple[int, tuple[Any, ...]]], at_handed: dict[tuple[int, int], int]
) -> str | None:
    """(4) The current stream waits for batch i's copy before batch i is handed over; (5) record_stream on it."""
    side_moves = [(k, e) for k, e in moves if e[3] != CONSUMER]
    for (_epoch, i), at in sorted(at_handed.items()):
        mine = [(k, e) for k, e in side_moves if e[1] == i and k < at]
        if not mine:
            continue
        first_move, last_move = mine[0][0], mine[-1][0]
        streams = {e[3] for _, e in mine}
        if not any(
            e[0] == "wait" and e[1] == CONSUMER and e[2] in streams and e[3] > last_move for e in events[last_move:at]
        ):
            return (
                f"batch {i} was handed over before the current stream waited for its copy: call "
                "torch.cuda.current_stream(device).wait_stream(side) before you hand a batch over"
            )
        recorded = {e[1] for e in events[first_move:at] if e[0] == "record_stream" and e[2] == CONSUMER}
        if any(t not in recorded for t in events[at][3]):
            return (
                f"batch {i} was handed over without record_stream(current) on each of its tensors: "
                "they were made on the side stream, so the caching allocator could give their memory "
                "to the next copy while the current stream still reads them"
            )
    return None


def check_protocol(log: Sequence[tuple[Any, ...]], handed: Sequence[Sequence[Any]], n_batches: int) -> list[str]:
    """Problems (empty: none) in a :func:`stream_protocol` log: (1) order, (2-3) the copies and their stream,
    (4-5) each hand-over's wait and ``record_stream``."""
    if [len(h) for h in handed] != [n_batches] * len(handed):
        return [f"gave {[len(h) for h in handed]} batches per epoch, expected {n_batches}"]
    events = list(log)
    moves = [(k, e) for k, e in enumerate(events) if e[0] == "move"]
    at_handed = {(e[1], e[2]): k for k, e in enumerate(events) if e[0] == "handed"}
    order = _order_problem(events, at_handed, n_batches)
    problems = [order] if order else []
    if not moves:
        return problems or [_NOT_MOVED]
    hand_over = _hand_over_problem(events, moves, at_handed)
    return problems + _copy_problems(events, moves) + ([hand_over] if hand_over else [])


# -- With real streams (CUDA): races, and how much of the copy a prefetcher hides --


def _delay_behind_copy(src: torch.Tensor, dev: torch.device) -> GpuDelay:
    """Queued GPU work lasting about three copies of ``src``."""
    probe = torch.empty_like(src, device=dev)
    copy = cuda_event_time(lambda: probe.copy_(src, non_blocking=True), repeats=1, warmup=0, device=dev)
    return GpuDelay(dev, seconds=max(3 * copy.median_s, 0.002))  # it queues on dev, whatever is current


#: The GPU checks' batches as (MiB per batch, batches): the race check's and the overlap ratio's; its rounds.
RACE_BATCHES, OVERLAP_BATCHES, OVERLAP_ROUNDS = (64, 8), (32, 8), 3


def _pinned_pairs(batches: tuple[int, int], value: Callable[[int], int]) -> list[tuple[torch.Tensor, ...]]:
    """Pinned ``(uint8 images, labels)`` batches of about ``batches[0]`` MiB; batch i's pixels = value(i)."""
    side = max(8, int((batches[0] * (1 << 20) / (3 * 64)) ** 0.5))
    return [
        (
            torch.full((64, 3, side, side), value(i), dtype=torch.uint8).pin_memory(),
            torch.full((64,), i, dtype=torch.int64).pin_memory(),
        )
        for i in range(batches[1])
    ]


_RACE_WHY = {
    False: "the current stream read a batch before its copy had finished: call current.wait_stream(side) before "
    "handing it over",
    True: "a batch's memory was reused while the current stream still had to read it: call "
    "t.record_stream(current) on each tensor you hand over",
}


def check_pipeline_race(candidate: Any, device: torch.device | str = "cuda") -> list[str]:
    """Problems (empty: none) when each batch is checked on the current stream and dropped: at once (a missing
    ``wait_stream``), then behind queued work (a missing ``record_stream``)."""
    dev, n_batches = torch.device(device), RACE_BATCHES[1]
    loader = _pinned_pairs(RACE_BATCHES, lambda i: 10 + 20 * i)
    refs = [
        to_float_normalized(torch.full((1, 3, 1, 1), 10 + 20 * i, dtype=torch.uint8, device=dev))
        for i in range(n_batches)
    ]
    delay = _delay_behind_copy(loader[0][0], dev)
    problems: list[str] = []
    for label, wait in (("checked at once", False), ("checked behind queued work", True)):
        counts: list[torch.Tensor] = []
        for i, batch in enumerate(candidate(loader, dev)):
            x, y = batch
            if x.device.type != "cuda":
                return [f"race check: batch {i} came back on {x.device}, not on the CUDA device"]
            if wait:
                delay()
            counts.append(((x - refs[i]).abs() > 1e-3).sum() + (y != i).sum())
            del batch, x, y  # the consumer drops the batch at once: its memory may now be reused
        torch.cuda.synchronize(dev)
        wrong = [int(c) for c in counts]
        if len(wrong) != n_batches:
            problems.append(f"race check ({label}): gave {len(wrong)} batches of {n_batches}")
        elif any(wrong):
            first = next(i for i, w in enumerate(wrong) if w)
            problems.append(
                f"race check ({label}): batch {first} had {wrong[first]:,} wrong elements when read "
                f"on the current stream: {_RACE_WHY[wait]}"
            )
    return problems


def prefetch_overlap_ratio(candidate: Any, dev: torch.device) -> float:
    """Share (0-1) of copy time hidden behind compute: median of ``(copy + compute - both) / min(copy, compute)``."""
    loader = _pinned_pairs(OVERLAP_BATCHES, lambda i: i)
    resident = [(to_float_normalized(x.to(dev)), y.to(dev)) for x, y in loader]

    def copies() -> Iterator[Any]:
        return ((to_float_normalized(x.to(dev, non_blocking=True)), y.to(dev, non_blocking=True)) for x, y in loader)

    def nothing(x: Any, y: Any) -> None:
        pass

    t_copy = time_batches({"copy": copies}, nothing, dev, rounds=1).median("copy")  # a warm-up pass, a timed one
    compute = calibrated_compute(dev, 1.5 * t_copy)  # on dev, whichever device is current
    ways: dict[str, Callable[[], Iterable[Any]]] = {
        "copy": copies,
        "compute": lambda: ((compute(x), y) for x, y in resident),
        "both": lambda: ((compute(x), y) for x, y in candidate(loader, dev)),
    }
    t = time_batches(ways, nothing, dev, rounds=OVERLAP_ROUNDS).values
    ratios = [(c + k - b) / max(min(c, k), 1e-9) for c, k, b in zip(t["copy"], t["compute"], t["both"])]
    return max(0.0, min(1.0, statistics.median(ratios)))


# -- The check of the exercise: the reader's Prefetcher of (uint8 x, y) pairs --


@dataclasses.dataclass
class PrefetcherCheck:
    correct: bool
    messages: list[str]

    def __str__(self) -> str:
        return ("PASS" if self.correct else "FAIL") + ":\n  " + "\n  ".join(self.messages)


_REFUSED = (
    "this is (or uses) helpers.pipeline.prefetch.Prefetcher, the chapter's reference: "
    "hand in the Prefetcher you wrote in the chapter"
)
_PASSED = [
    "order: batch i+1 is requested and copied before batch i is handed over",
    "streams: copies with non_blocking=True on one side stream, made once, which first waits for the "
    "current stream; the current stream waits before each hand-over; record_stream on every tensor "
    "handed over (checked with test doubles of the CUDA stream API)",
    "values: the reference prefetcher's batches (normalised with data.MEAN and data.STD), in order, twice",
]


_NO_GPU = "real streams, races and overlap not checked: no CUDA device here"
_RACE_FREE = (
    "on {dev}: with real streams, each batch right when read on the current stream, at once and behind queued work"
)
_OVERLAP = "overlap on {}: {:.0%} of the copy time hidden behind compute -> {}"


def _pair_problems(got: Sequence[Any], loader: Iterable[Any], epoch: int) -> list[str]:
    """What differs from the reference :class:`Prefetcher`'s batches (on the CPU: normalised, in order)."""
    want = [(to_float_normalized(x, MEAN, STD), y) for x, y in loader]  # what the reference gives on a CPU
    if len(got) != len(want):
        return [f"epoch {epoch}: gave {len(got)} batches, expected {len(want)}"]
    for i, (g, (x_ref, y_ref)) in enumerate(zip(got, want)):
        if not (isinstance(g, (tuple, list)) and len(g) == 2 and all(isinstance(t, torch.Tensor) for t in g)):
            return [f"epoch {epoch}: batch {i} is a {type(g).__name__}, not an (x, y) pair of tensors"]
        x, y = g
        if x.dtype != x_ref.dtype or x.shape != x_ref.shape or x.device.type != x_ref.device.type:
            return [
                f"epoch {epoch}: batch {i}'s x is {x.dtype} {tuple(x.shape)} on {x.device}, expected "
                f"{x_ref.dtype} {tuple(x_ref.shape)} on {x_ref.device.type} (normalise the uint8 images)"
            ]
        if not torch.allclose(x.cpu(), x_ref.cpu(), rtol=0, atol=1e-5) or not torch.equal(y.cpu(), y_ref.cpu()):
            return [
                f"epoch {epoch}: batch {i} differs from the reference's (order, or normalisation: use "
                "data.MEAN and data.STD as helpers.pipeline.data.to_float_normalized does)"
            ]
    return []


def check_pipeline_prefetcher(candidate: Any, device: torch.device | str | None = None) -> PrefetcherCheck:
    """Check the reader's prefetcher (``candidate(loader, device)``, refusing :class:`Prefetcher`): everywhere the
    protocol (two epochs) and the batches; on CUDA real streams, the race check and the copy time it hides."""
    if candidate is None:
        return PrefetcherCheck(False, ["no answer yet: set answer = Prefetcher (the class you wrote) and run again"])
    if not callable(candidate):
        return PrefetcherCheck(False, [f"expected a class or function, got {type(candidate).__name__}"])
    refused = PrefetcherCheck(False, [_REFUSED])
    if isinstance(candidate, type) and issubclass(candidate, Prefetcher):
        return refused
    dev = torch.device(device if device is not None else "cuda" if torch.cuda.is_available() else "cpu")
    made_before, n_batches = Prefetcher.made, 4
    try:
        log, handed = stream_protocol(candidate, n_batches, epochs=2)
        problems = check_protocol(log, handed, n_batches)
    except Exception as exc:  # the reader's code may raise anything
        problems, handed = [f"under the stream test doubles it raised {type(exc).__name__}: {exc}"], []
    if Prefetcher.made != made_before:
        return refused
    for epoch, got in enumerate(handed if not problems else []):
        problems += _pair_problems(got, PairProbeLoader(n_batches).batches, epoch + 1)
    if dev.type != "cuda":
        return PrefetcherCheck(not problems, [*(problems or _PASSED), _NO_GPU])
    if not torch.cuda.is_available():
        raise ValueError("device is 'cuda' but no CUDA device is available")
    if problems:
        return PrefetcherCheck(False, problems)
    try:
        gpu = check_pipeline_race(candidate, dev)
    except Exception as exc:  # the reader's code may raise anything; a CUDA error on a strict GPU run propagates
        if strict_gpu_error(exc):
            raise
        gpu = [f"on {dev}: raised {type(exc).__name__}: {exc}"]
    if Prefetcher.made != made_before:
        return refused
    if gpu:
        return PrefetcherCheck(False, [*_PASSED, *gpu])
    ratio = prefetch_overlap_ratio(candidate, dev)
    verdict = "overlaps" if ratio >= 0.3 else "does NOT overlap"
    return PrefetcherCheck(ratio >= 0.3, [*_PASSED, _RACE_FREE.format(dev=dev), _OVERLAP.format(dev, ratio, verdict)])
