"""The pipeline doctor's measurement: ``diagnose(loader, step_fn)`` times the wait for data, the copy and the compute
of a few real steps, synchronised one by one, and :func:`.diagnosis.decide` turns them into a verdict and ranked
advice. A time limit bounds the run; a ``next()`` or step that hangs is interrupted (Unix main thread)."""

from __future__ import annotations

import contextlib
import math
import signal
import statistics
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Mapping

import torch
from torch.utils.data import DataLoader

from ...core.config import require_gpu
from ...core.device import resolve_device
from ...core.timing import SpanRecorder, synchronize, time_calls
from ...core.validate import check_float, check_int
from ...pipeline.prefetch import iter_tensors, map_tensors, move_batch
from ...pipeline.workers import cpu_cores as usable_cores  # CPU cores this process may run on
from ...pipeline.workers import release
from .diagnosis import VERDICTS, Diagnosis, MeasuredStep, Measurements, PipelineFacts, Recommendation, decide

__all__ = [
    "VERDICTS", "PipelineFacts", "Measurements", "MeasuredStep", "Recommendation", "Diagnosis", "decide",
    "usable_cores",
]  # fmt: skip


class DoctorTimeout(TimeoutError):
    """A ``next()`` or a step did not finish within the doctor's time limit."""


def _unwrap(loader: Any) -> tuple[Any, bool]:
    """The innermost DataLoader (if any) and whether a prefetcher wraps it."""
    obj, prefetcher = loader, False
    for _ in range(4):
        attrs = (getattr(obj, a, None) for a in ("loader", "dataloader", "_loader", "base_loader"))
        inner = next((x for x in attrs if x is not None), None)
        if isinstance(obj, DataLoader) or inner is None:
            break
        prefetcher = prefetcher or "prefetch" in type(obj).__name__.lower() or hasattr(obj, "stream")
        obj = inner
    return obj, prefetcher


def inspect_loader(loader: Any, device: torch.device | str = "cpu") -> PipelineFacts:
    dl, prefetcher = _unwrap(loader)
    facts = PipelineFacts(type(loader).__name__, cpu_count=usable_cores(),
                          device_type=torch.device(device).type, uses_prefetcher=prefetcher)  # fmt: skip
    if isinstance(dl, DataLoader):
        facts.num_workers, facts.pin_memory = int(dl.num_workers), bool(dl.pin_memory)
        facts.persistent_workers = bool(dl.persistent_workers)
        facts.prefetch_factor = dl.prefetch_factor if dl.num_workers > 0 else None
    with contextlib.suppress(TypeError):  # a plain iterable has no length: batches_per_epoch stays None
        facts.batches_per_epoch = len(loader)
    return facts


def _describe_batch(batch: Any, facts: PipelineFacts) -> None:
    tensors = list(iter_tensors(batch))
    facts.batch_bytes = int(sum(t.numel() * t.element_size() for t in tensors))
    if tensors:
        big = max(tensors, key=lambda t: t.numel())
        facts.batch_dtype = str(big.dtype).replace("torch.", "")
        facts.batch_shape = tuple(int(s) for s in big.shape)
        facts.float_image_batch = big.dim() == 4 and big.is_floating_point() and big.shape[1] in (1, 3)
        cpu = [t for t in tensors if t.device.type == "cpu"]
        if cpu and facts.cuda:
            try:
                facts.batch_pinned = all(t.is_pinned() for t in cpu)
            except RuntimeError:
                if require_gpu():  # a strict GPU run must see a broken CUDA path, not "unknown"
                    raise
                facts.batch_pinned = None


@contextlib.contextmanager
def _alarm(seconds: float, what: list[str]) -> Iterator[None]:
    """Raise DoctorTimeout in the main thread after ``seconds`` (Unix only)."""
    if not hasattr(signal, "setitimer") or threading.current_thread() is not threading.main_thread():  # Unix: SIGALRM
        yield
        return

    def handler(signum: int, frame: Any) -> None:
        raise DoctorTimeout(f"{what[0]} did not finish within the doctor's time limit ({seconds:.0f} s)")

    previous = signal.signal(signal.SIGALRM, handler)
    signal.setitimer(signal.ITIMER_REAL, max(0.01, seconds))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def copy_seconds(batch: Any, dev: torch.device, *, pin: bool = True, repeats: int = 5, warmup: int = 1) -> float:
    """Median seconds to copy ``batch`` to ``dev`` (CUDA only: callers check), from pinned memory and non-blocking
    when ``pin``: the doctor's pinned probe and the waterfall's copy alone."""
    if pin:
        batch = map_tensors(lambda t: t.pin_memory() if t.device.type == "cpu" else t, batch)
    return time_calls(lambda: move_batch(batch, dev, non_blocking=pin), repeats=repeats, device=dev,
                      warmup=warmup).median_s  # fmt: skip


def _pinned_probe(batch: Any, dev: torch.device) -> float | None:
    """:func:`copy_seconds` from pinned memory; ``None`` if that fails, unless ``require_gpu()``."""
    try:
        return copy_seconds(batch, dev)
    except RuntimeError:
        if require_gpu():
            raise
        return None


@dataclass
class _Loop:
    rec: SpanRecorder  # the kernel's stage timer: a span per phase of each timed step
    timed: int = 0
    first_batch_s: float | None = None
    sample: Any = None
    done: int = 0
    notes: list[str] = field(default_factory=list)
    limit_s: float = 60.0
    deadline: float = math.inf


def _time_steps(out: _Loop, loader: Iterable[Any], step_fn: Callable[[Any], Any],
                move: Callable[[Any, torch.device], Any], dev: torch.device, facts: PipelineFacts, steps: int,
                warmup: int, what: list[str]) -> None:  # fmt: skip
    """Time ``steps`` steps after ``warmup`` (never a new iterator's first batch); at most 3 restarts of the loader."""
    restarts, it = 0, iter(loader)
    fresh = True  # the next batch comes from a new iterator: its wait includes start-up
    try:
        while out.timed < steps:
            if time.perf_counter() > out.deadline and out.timed >= 2:
                out.notes.append(f"Stopped after {out.timed} timed steps: time limit of {out.limit_s:.0f} s reached.")
                break
            what[0] = "next(iterator) on the loader"
            t0 = out.rec.now()
            try:
                batch = next(it)
            except StopIteration:
                if out.done == 0:
                    raise ValueError("the loader yielded no batches") from None
                restarts += 1
                if restarts > 3:
                    out.notes.append("The loader ran out of batches four times; measured what it had.")
                    break
                it, fresh = iter(loader), True  # a new epoch
                continue
            t1 = out.rec.now()
            if out.first_batch_s is None:
                out.first_batch_s, out.sample = t1 - t0, batch
                _describe_batch(batch, facts)
            what[0] = "the copy to the device"
            moved = move(batch, dev)
            synchronize(dev)
            t2 = out.rec.now()
            what[0] = "step_fn"
            step_fn(moved)
            synchronize(dev)
            if out.done >= warmup and not fresh:  # the phases one after the other, each synchronised
                for name, a, b in (("wait", t0, t1), ("h2d", t1, t2), ("compute", t2, out.rec.now())):
                    out.rec.add(name, out.timed, a, b)
                out.timed += 1
            fresh, out.done = False, out.done + 1
            del batch, moved
    finally:
        if not getattr(_unwrap(loader)[0], "persistent_workers", False):
            release(it)  # the kernel's one teardown: this iterator's workers, also a frozen one
        del it  # the iterator (and its workers) is let go now, also on an error
    if restarts:
        out.notes.append(f"The loader was restarted {restarts} time(s) to get enough steps; each restart's first "
                         "batch was not counted as a wait.")  # fmt: skip


def diagnose(
    loader: Iterable[Any],
    step_fn: Callable[[Any], Any],
    device: torch.device | str | None = None,
    *,
    steps: int = 20,
    warmup: int = 3,
    transfer: str = "auto",
    time_limit_s: float = 60.0,
    measured: Mapping[str, str] | None = None,
    measured_steps: Mapping[str, MeasuredStep] | None = None,
) -> Diagnosis:
    """Measure a few steps of ``loader`` + ``step_fn(batch)`` on ``device`` (default CUDA if present) and diagnose
    them. ``transfer="none"``: ``step_fn`` copies (counted as compute). ``measured``, ``measured_steps``: see
    :func:`decide`."""
    if not hasattr(loader, "__iter__"):
        raise ValueError(f"loader must be an iterable of batches, got {type(loader).__name__}")
    if not callable(step_fn):
        raise ValueError(f"step_fn must be a callable taking one batch, got {type(step_fn).__name__}")
    check_int("steps", steps, 1, 10_000)
    check_int("warmup", warmup, 0, 1000)
    check_float("time_limit_s", time_limit_s, 0.1, 24 * 3600.0)
    if transfer not in ("auto", "none"):
        raise ValueError(f"transfer must be 'auto' or 'none', got {transfer!r}")
    dev = resolve_device(device)  # None: CUDA when present; a device this machine lacks: ValueError
    separate = transfer == "auto"
    move = (lambda b, d: move_batch(b, d, non_blocking=False)) if separate else (lambda b, d: b)
    facts = inspect_loader(loader, dev)
    t_start = time.perf_counter()
    what, timed_out = ["the loader"], False
    loop = _Loop(SpanRecorder(dev), limit_s=time_limit_s, deadline=t_start + time_limit_s)
    try:
        with _alarm(time_limit_s, what):
            _time_steps(loop, loader, step_fn, move, dev, facts, steps, warmup, what)
    except DoctorTimeout as exc:
        timed_out = True
        n = loop.timed
        if n < 2:
            raise DoctorTimeout(
                f"{exc}; only {n} step(s) were timed. Is the loader stuck (e.g. a worker that died) or "
                f"is one step longer than the limit? Raise time_limit_s or lower steps."
            ) from None
        loop.notes.append(f"Interrupted: {exc}; measured {n} steps before that.")
    return _diagnosis(loop, facts, dev, separate, timed_out, t_start, warmup, measured, measured_steps)


def _diagnosis(loop: _Loop, facts: PipelineFacts, dev: torch.device, separate: bool, timed_out: bool,
               t_start: float, warmup: int, measured: Mapping[str, str] | None,
               measured_steps: Mapping[str, MeasuredStep] | None = None) -> Diagnosis:  # fmt: skip
    trace = loop.rec.finish()
    waits, mean = [s.duration for s in trace.spans if s.name == "wait"], trace.phase_means()
    if not waits:
        raise ValueError(f"no step could be timed: raise steps, or lower warmup below the loader's {loop.done} batches")
    probe = not timed_out and separate and dev.type == "cuda" and loop.sample is not None and not facts.batch_pinned
    pinned_h2d = _pinned_probe(loop.sample, dev) if probe and time.perf_counter() < loop.deadline else None
    m = Measurements(
        steps=len(waits),
        wait_s=mean["wait"],
        h2d_s=mean["h2d"],
        compute_s=mean["compute"],
        wait_median_s=statistics.median(waits),
        wait_p90_s=sorted(waits)[min(len(waits) - 1, int(0.9 * len(waits)))],
        first_batch_s=loop.first_batch_s,
        pinned_h2d_s=pinned_h2d,
        transfer_separate=separate,
        facts=facts,
    )
    d = decide(m, measured=measured, measured_steps=measured_steps)
    ran = f"The doctor ran {warmup + len(waits)} real steps: step_fn's model has trained on them."
    d.notes[:0] = [*loop.notes, ran]
    d.seconds = time.perf_counter() - t_start
    return d
