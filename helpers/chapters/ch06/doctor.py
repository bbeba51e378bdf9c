"""A pipeline doctor: is *your* training loop data-bound, transfer-bound or compute-bound?

``diagnose(loader, step_fn)`` runs a few real steps of any loader (a
``DataLoader``, a :class:`helpers.pipeline.prefetch.Prefetcher`, a list, any re-iterable
of batches) with any step function you wrote, and times three phases of every
step, each one on its own:

``wait``
    the loop waits for ``next(iterator)``: the **data stall** (with workers,
    only the part of loading they did not hide);
``h2d``
    the batch is copied to the device (synchronised; a no-op on the CPU);
``compute``
    ``step_fn(batch)`` runs (synchronised, so queued GPU work is counted).

It then applies chapter 01's bottleneck model: with every stage overlapped, a
step takes as long as its slowest stage, so that stage is the verdict. The
recommendations come from the same numbers, each with its evidence and an
estimated saving per step, ranked by that saving. The decision is a pure
function of the measurements (:func:`decide`), so it can be unit-tested with
made-up phase times, e.g. for a transfer-bound verdict that a CPU cannot show.

Caveats, said plainly in the output too:

* ``diagnose`` runs real steps: the reader's model trains for
  ``warmup + steps`` steps (pass a copy if that matters).
* Phases are synchronised one by one so that each is timed alone; the overlap a
  real loop gets is then *predicted* from the stage times, not measured.
* A time limit (``time_limit_s``) bounds the whole run; a ``next()`` or step
  that hangs is interrupted (Unix main thread) and reported, never waited on
  forever.
"""

from __future__ import annotations

import contextlib
import html
import math
import os
import re
import signal
import statistics
import textwrap
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterable, Iterator, Mapping

import torch

from ...core.config import require_gpu
from ...core.device import resolve_device
from ...core.validate import check_choice, check_float, check_int
from ...pipeline.prefetch import iter_tensors, map_tensors, move_batch

__all__ = [
    "VERDICTS",
    "PipelineFacts",
    "Measurements",
    "Recommendation",
    "Decision",
    "Diagnosis",
    "DoctorTimeout",
    "decide",
    "diagnose",
    "inspect_loader",
    "usable_cores",
    "SyntheticImages",
    "BusyStep",
]

VERDICTS: tuple[str, ...] = ("data-bound", "transfer-bound", "compute-bound")


class DoctorTimeout(TimeoutError):
    """A ``next()`` or a step did not finish within the doctor's time limit."""


def usable_cores() -> int:
    """CPU cores this process may run on (affinity-aware; at least 1)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


# ---------------------------------------------------------------------------
# What the doctor knows about the pipeline
# ---------------------------------------------------------------------------


@dataclass
class PipelineFacts:
    """Facts about the pipeline read from the loader and the first batch (not timed).

    ``None`` means unknown (e.g. ``num_workers`` of a plain iterable).
    """

    loader_type: str = "unknown"
    is_dataloader: bool = False
    num_workers: int | None = None
    pin_memory: bool | None = None
    persistent_workers: bool | None = None
    prefetch_factor: int | None = None
    batch_size: int | None = None
    batches_per_epoch: int | None = None
    cpu_count: int = 1
    device_type: str = "cpu"
    batch_bytes: int = 0
    batch_dtype: str = "unknown"
    batch_shape: tuple[int, ...] = ()
    float_image_batch: bool = False
    batch_pinned: bool | None = None
    uses_prefetcher: bool = False

    @property
    def cuda(self) -> bool:
        return self.device_type == "cuda"


@dataclass
class Measurements:
    """Per-step phase times (seconds, means over the timed steps) plus the facts.

    Attributes:
        steps: timed steps.
        wait_s / h2d_s / compute_s: mean seconds per step of each phase.
        wait_median_s / wait_p90_s: spread of the waits (bursty loaders show a high p90).
        first_batch_s: seconds from ``iter(loader)`` to the first batch (worker start-up
            and first load); ``None`` if not measured.
        pinned_h2d_s: the same batch copied from pinned memory (CUDA probe), if measured.
        transfer_separate: False when the step function does its own copy (then the copy
            is inside ``compute_s``).
        facts: see :class:`PipelineFacts`.
    """

    steps: int
    wait_s: float
    h2d_s: float
    compute_s: float
    wait_median_s: float | None = None
    wait_p90_s: float | None = None
    first_batch_s: float | None = None
    pinned_h2d_s: float | None = None
    transfer_separate: bool = True
    facts: PipelineFacts = field(default_factory=PipelineFacts)

    @property
    def step_s(self) -> float:
        """Mean seconds per step of the (synchronised, serial) measured loop."""
        return self.wait_s + self.h2d_s + self.compute_s


@dataclass
class Recommendation:
    """One ranked piece of advice.

    Attributes:
        action: what to do, with concrete numbers.
        evidence: the measurements that justify it.
        stage: the stage it speeds up ("data", "transfer", "compute").
        gain_s: estimated seconds saved per step (``None``: not estimable from these measurements).
        chapter: where the workbook measures this effect.
        step: the chapter 06 waterfall step that makes this change ("workers", "persistent", "pinned",
            "uint8", "prefetcher"), or "" (no step of the waterfall does): what ``measured`` is matched on.
    """

    action: str
    evidence: str
    stage: str
    gain_s: float | None = None
    chapter: str = ""
    step: str = ""


@dataclass
class Decision:
    """The output of :func:`decide`."""

    verdict: str
    stage_times: dict[str, float | None]
    shares: dict[str, float]
    stall_share: float
    predicted_overlapped_s: float
    recommendations: list[Recommendation]
    notes: list[str]


# ---------------------------------------------------------------------------
# The pure decision
# ---------------------------------------------------------------------------


def _ms(s: float | None) -> str:
    return "n/a" if s is None else f"{s * 1e3:.2f} ms"


def decide(
    m: Measurements,
    *,
    stall_threshold: float = 0.15,
    notable_share: float = 0.05,
    measured: Mapping[str, str] | None = None,
) -> Decision:
    """Verdict and ranked recommendations from measured phase times (a pure function).

    The bottleneck model (chapter 01): with loading, copying and computing
    overlapped, a step takes as long as the slowest of the three stages, so
    that stage is the verdict.

    * **data stage.** With ``num_workers == 0`` (or a plain iterable) loading
      happens in the loop, so the wait *is* the data stage. With workers, the
      wait is only what they failed to hide: if it is at least
      ``stall_threshold`` of the step, the loader sets the pace and its stage
      time is ``wait + h2d + compute`` (one batch per loop iteration);
      otherwise loading is hidden and cannot be the bottleneck.
    * **transfer stage** = ``h2d``; **compute stage** = ``compute``.

    Recommendations carry an estimated saving per step computed from the same
    numbers; those saving at least ``notable_share`` of a step come first
    (largest first), then advice for the bottleneck stage that has no number,
    then the rest.

    ``measured``: what a waterfall measured on this machine, step name -> verdict
    (:meth:`helpers.chapters.ch06.capstone.Waterfall.step_verdicts`). The advice then agrees with it: a
    recommendation whose step was measured 'slower' (beyond the noise) is withdrawn, with a note
    saying why (workers measured slower while persistent workers measured a gain: the advice becomes
    persistent workers); one measured 'within noise', 'no effect' or 'needs CUDA' keeps no estimated saving (the
    measurement did not see one) and says what was measured; one measured 'gain' says so.

    Raises:
        ValueError: for negative or non-finite times, or no steps, or a ``measured`` verdict that is not text.
    """
    check_int("steps", m.steps, 1)
    for name in ("wait_s", "h2d_s", "compute_s"):
        v = getattr(m, name)
        if not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
            raise ValueError(f"{name} must be a finite number >= 0 seconds, got {v!r}")
    check_float("stall_threshold", stall_threshold, 0.0, 1.0)
    check_float("notable_share", notable_share, 0.0, 1.0)
    for k, v in (measured or {}).items():
        if not isinstance(v, str):
            raise ValueError(f"measured[{k!r}] must be a verdict such as 'gain' or 'slower', got {v!r}")
    f = m.facts
    step = m.step_s
    if step <= 0:
        raise ValueError("the measured step time is 0 s: nothing was timed")
    busy = m.h2d_s + m.compute_s  # the loop's own work per step
    stall = m.wait_s / step
    shares = {"wait": stall, "h2d": m.h2d_s / step, "compute": m.compute_s / step}
    nw = f.num_workers
    in_loop = nw is None or nw == 0
    notes: list[str] = []
    if in_loop:
        data_stage: float | None = m.wait_s
    elif stall >= stall_threshold:
        data_stage = m.wait_s + busy
    else:
        data_stage = None  # hidden by the workers: below the step's own work
        notes.append(f"Loading is hidden by {nw} worker(s): the loop waited only {stall:.0%} of its time for data.")
    stages: dict[str, float | None] = {"data": data_stage, "transfer": m.h2d_s, "compute": m.compute_s}
    known = {k: v for k, v in stages.items() if v is not None}
    bottleneck = max(known, key=lambda k: known[k])
    verdict = {"data": "data-bound", "transfer": "transfer-bound", "compute": "compute-bound"}[bottleneck]
    predicted = known[bottleneck]
    if not m.transfer_separate:
        notes.append("The step function does its own copy, so the copy is counted inside 'compute'.")
    if not f.cuda:
        notes.append("No CUDA device: the copy to the device is a no-op here, so transfer cannot be the bottleneck.")

    recs: list[Recommendation] = []
    cores = max(1, int(f.cpu_count))

    # -- data stage ---------------------------------------------------------
    if m.wait_s > 0 and (in_loop or stall >= stall_threshold):
        # Seconds one worker needs to produce one batch.
        per_batch = m.wait_s if in_loop else (nw or 1) * (m.wait_s + busy)
        current = nw or 0
        if busy > 0:
            need = math.ceil(per_batch / busy)
        else:
            need = cores
        suggested = max(current + 1, min(need, cores))
        if current < cores and suggested > current:
            new_wait = max(0.0, per_batch / suggested - busy)
            gain: float | None = max(0.0, m.wait_s - new_wait)
            who = (
                "in the main process" if in_loop else f"per worker (with {current} worker{'s' if current != 1 else ''})"
            )
            what = (
                "raise num_workers"
                if f.is_dataloader or nw is not None
                else "load in worker processes (a DataLoader with num_workers)"
            )
            recs.append(
                Recommendation(
                    action=f"{what} from {current} to {suggested}",
                    evidence=(
                        f"the loop waited {_ms(m.wait_s)} per step for data ({stall:.0%} of the step); "
                        f"loading one batch takes {_ms(per_batch)} {who} while the step's own work takes "
                        f"{_ms(busy)}, so "
                        f"ceil({per_batch * 1e3:.2f} / {busy * 1e3:.2f}) = {need} worker{'s' if need != 1 else ''} "
                        "would keep up; "
                        f"this machine has {cores} usable core{'s' if cores != 1 else ''}"
                        + (" (on a CPU device the workers share them with the model)" if not f.cuda else "")
                    ),
                    stage="data",
                    gain_s=gain,
                    chapter="04 · workers",
                    step="workers",
                )
            )
        elif current >= cores:
            recs.append(
                Recommendation(
                    action="make each sample cheaper to load: send uint8, decode smaller or cached images, "
                    + (
                        "or decode JPEGs on the GPU (torchvision.io.decode_jpeg(device='cuda'))"
                        if f.cuda
                        else "or pre-decode once"
                    ),
                    evidence=(
                        f"already {current} workers on {cores} cores and the loop still waits {_ms(m.wait_s)} "
                        f"per step ({stall:.0%}): more workers than cores cannot help CPU-bound decoding"
                    ),
                    stage="data",
                    gain_s=None,
                    chapter="04 · workers",
                )
            )
        if (nw or 0) > 0 and m.wait_p90_s is not None and m.wait_median_s is not None and f.prefetch_factor:
            if m.wait_p90_s > 3 * max(m.wait_median_s, 1e-6) and m.wait_p90_s > 0.1 * busy:
                recs.append(
                    Recommendation(
                        action=f"raise prefetch_factor from {f.prefetch_factor} to {2 * f.prefetch_factor}",
                        evidence=(
                            f"waits are bursty: median {_ms(m.wait_median_s)}, 90th percentile {_ms(m.wait_p90_s)}; "
                            "a deeper queue absorbs bursts (it cannot raise the loader's average rate)"
                        ),
                        stage="data",
                        gain_s=max(0.0, m.wait_s - m.wait_median_s),
                        chapter="04 · prefetch_factor",
                        step="persistent",
                    )
                )
    if (nw or 0) > 0 and f.persistent_workers is False and m.first_batch_s is not None:
        per_epoch = f.batches_per_epoch or m.steps
        startup = max(0.0, m.first_batch_s - m.wait_s)
        recs.append(
            Recommendation(
                action="set persistent_workers=True",
                evidence=(
                    f"each epoch restarts {nw} worker{'s' if nw != 1 else ''}: "
                    f"the first batch took {m.first_batch_s:.3f} s, "
                    f"{startup:.3f} s more than a typical wait; spread over {per_epoch} steps per epoch"
                ),
                stage="data",
                gain_s=startup / max(1, per_epoch),
                chapter="04 · persistent workers",
                step="persistent",
            )
        )

    # -- transfer stage -------------------------------------------------------
    if f.cuda and m.transfer_separate and shares["h2d"] >= notable_share:
        pinned = bool(f.pin_memory) or bool(f.batch_pinned)
        after_pin = m.h2d_s
        if not pinned:
            if m.pinned_h2d_s is not None:
                gain = max(0.0, m.h2d_s - m.pinned_h2d_s)
                after_pin = min(m.h2d_s, m.pinned_h2d_s)
                ev = (
                    f"the copy takes {_ms(m.h2d_s)} from pageable memory and {_ms(m.pinned_h2d_s)} "
                    "from pinned memory (same batch, measured)"
                )
            else:
                gain = None
                ev = f"the copy takes {_ms(m.h2d_s)} per step ({shares['h2d']:.0%}) from pageable memory"
            recs.append(
                Recommendation(
                    action="pin memory: DataLoader(pin_memory=True)",
                    evidence=ev + "; pinned memory is also what lets a copy overlap with compute",
                    stage="transfer",
                    gain_s=gain,
                    chapter="02 · pinned memory",
                    step="pinned",
                )
            )
        if f.float_image_batch:
            recs.append(
                Recommendation(
                    action="send uint8 images and normalise on the GPU (4x fewer bytes)",
                    evidence=(
                        f"the batch is {f.batch_dtype} {list(f.batch_shape)}, {f.batch_bytes / 2**20:.1f} MiB; "
                        f"as uint8 it would be {f.batch_bytes / 4 / 2**20:.1f} MiB; "
                        "copy time scales with bytes for batches this size "
                        "(estimate: three quarters of the copy)"
                    ),
                    stage="transfer",
                    gain_s=0.75 * after_pin,
                    chapter="05 · uint8 + GPU normalise",
                    step="uint8",
                )
            )
            after_pin *= 0.25
        if not f.uses_prefetcher:
            recs.append(
                Recommendation(
                    action="overlap the copy with compute: a side-stream prefetcher "
                    "(helpers.pipeline.prefetch.Prefetcher) on pinned batches",
                    evidence=(
                        f"the copy ({_ms(after_pin)} after the steps above) "
                        f"and the compute ({_ms(m.compute_s)}) run one "
                        "after the other; overlapped, the smaller one hides behind the larger"
                    ),
                    stage="transfer",
                    gain_s=min(after_pin, m.compute_s),
                    chapter="05 · overlap",
                    step="prefetcher",
                )
            )
    elif not f.cuda and f.float_image_batch and (nw or 0) > 0 and bottleneck == "data":
        recs.append(
            Recommendation(
                action="send uint8 images from the workers and normalise in the step",
                evidence=(
                    f"workers hand over {f.batch_bytes / 2**20:.2f} MiB float batches; uint8 is 4x fewer bytes to "
                    "collate and pass between processes, and skips the float conversion in the workers"
                ),
                stage="data",
                gain_s=None,
                chapter="04 · uint8 batches",
            )
        )

    # -- compute stage ----------------------------------------------------------
    if bottleneck == "compute":
        recs.append(
            Recommendation(
                action="speed up the step itself: mixed precision (torch.autocast), channels_last, torch.compile, "
                "or a larger batch" + ("; the input pipeline already keeps up" if stall < stall_threshold else ""),
                evidence=(
                    f"compute takes {_ms(m.compute_s)} of a {_ms(step)} step ({shares['compute']:.0%}); "
                    f"the loop waited {stall:.0%} of its time for data"
                ),
                stage="compute",
                gain_s=None,
                chapter="01 · bottleneck model",
            )
        )
        if (nw or 0) > 0 or stall < stall_threshold:
            notes.append(
                "More workers or a deeper prefetch queue would not speed this loop up: it barely waits for data."
            )

    # -- agreement with what a waterfall measured here ---------------------------
    if measured:
        agreed: list[Recommendation] = []
        for r in recs:
            v = measured.get(r.step) if r.step else None
            if v == "slower" and r.step == "workers" and measured.get("persistent") == "gain":
                r.action += " with persistent_workers=True"  # what the waterfall measured as a gain
                r.evidence += (
                    "; the waterfall on this machine measured workers that restart every epoch slower beyond its "
                    "noise, and persistent workers (with prefetch_factor=4) a gain"
                )
                r.step = "persistent"
                agreed.append(r)
                continue
            if v == "slower":
                notes.append(
                    f"Not recommended here: {r.action}. The waterfall on this machine measured its step "
                    f"('{r.step}') slower beyond its noise."
                )
                continue
            if v in ("within noise", "no effect", "needs CUDA"):
                r.gain_s = None  # the measurement saw no saving: no estimate ranks it
                r.evidence += f"; but the waterfall on this machine measured this step ('{r.step}'): {v}"
            elif v == "one round":
                r.evidence += f"; the waterfall on this machine ran this step ('{r.step}') in one round: no verdict"
            elif v is not None:
                r.evidence += f"; the waterfall on this machine measured this step ('{r.step}'): {v}"
            agreed.append(r)
        recs = agreed

    # -- ranking ----------------------------------------------------------------
    def key(r: Recommendation) -> tuple[int, float]:
        g = r.gain_s if r.gain_s is not None else 0.0
        if r.gain_s is not None and g >= notable_share * step:
            return (0, -g)
        if r.stage == bottleneck:
            return (1, -g)
        return (2, -g)

    recs.sort(key=key)
    if not recs:
        notes.append("No change is indicated by these measurements.")
    return Decision(
        verdict=verdict,
        stage_times=stages,
        shares=shares,
        stall_share=stall,
        predicted_overlapped_s=predicted,
        recommendations=recs,
        notes=notes,
    )


# ---------------------------------------------------------------------------
# Reading a loader
# ---------------------------------------------------------------------------


def _unwrap(loader: Any) -> tuple[Any, bool]:
    """The innermost DataLoader (if any) and whether a prefetcher wraps it."""
    from torch.utils.data import DataLoader

    obj, prefetcher = loader, False
    for _ in range(4):
        if isinstance(obj, DataLoader):
            return obj, prefetcher
        inner = None
        for attr in ("loader", "dataloader", "_loader", "base_loader"):
            inner = getattr(obj, attr, None)
            if inner is not None:
                break
        if inner is None:
            return obj, prefetcher
        if "prefetch" in type(obj).__name__.lower() or hasattr(obj, "stream"):
            prefetcher = True
        obj = inner
    return obj, prefetcher


def inspect_loader(loader: Any, device: torch.device | str = "cpu") -> PipelineFacts:
    """Read what can be read from ``loader`` without iterating it."""
    from torch.utils.data import DataLoader

    inner, prefetcher = _unwrap(loader)
    facts = PipelineFacts(
        loader_type=type(loader).__name__,
        cpu_count=usable_cores(),
        device_type=torch.device(device).type,
        uses_prefetcher=prefetcher,
    )
    if isinstance(inner, DataLoader):
        facts.is_dataloader = True
        facts.num_workers = int(inner.num_workers)
        facts.pin_memory = bool(inner.pin_memory)
        facts.persistent_workers = bool(inner.persistent_workers)
        facts.prefetch_factor = inner.prefetch_factor if inner.num_workers > 0 else None
        facts.batch_size = inner.batch_size
    try:
        facts.batches_per_epoch = len(loader)
    except TypeError:
        facts.batches_per_epoch = None
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


# ---------------------------------------------------------------------------
# Measuring
# ---------------------------------------------------------------------------


@contextlib.contextmanager
def _alarm(seconds: float, what: list[str]) -> Iterator[None]:
    """Raise DoctorTimeout in the main thread after ``seconds`` (Unix); else do nothing."""
    usable = (
        hasattr(signal, "SIGALRM")
        and hasattr(signal, "setitimer")
        and threading.current_thread() is threading.main_thread()
    )
    if not usable:
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


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _pinned_probe(batch: Any, dev: torch.device, repeats: int = 5) -> float | None:
    """Median seconds to copy ``batch`` to ``dev`` from pinned memory (CUDA only).

    ``None`` without CUDA, or when pinning or the copy fails with a ``RuntimeError``
    (the diagnosis then goes without the pinned figure), except in a strict GPU run
    (``WORKBOOK_REQUIRE_GPU=1``, :func:`helpers.core.config.require_gpu`): there the error
    is raised, so that a broken CUDA path never passes the GPU check silently.
    """
    if dev.type != "cuda":
        return None

    try:
        pinned = map_tensors(lambda t: t.pin_memory() if t.device.type == "cpu" else t, batch)
        times = []
        for _ in range(repeats + 1):
            _sync(dev)
            t0 = time.perf_counter()
            move_batch(pinned, dev, non_blocking=True)
            _sync(dev)
            times.append(time.perf_counter() - t0)
        del pinned
        return statistics.median(times[1:])
    except RuntimeError:
        if require_gpu():
            raise
        return None


#: The longest line the printed report has (a notebook wraps longer ones in the middle of a word).
LINE_WIDTH = 105


def _wrap(text: str, indent: str) -> list[str]:
    """``text`` wrapped at words to :data:`LINE_WIDTH` characters, continuation lines starting with ``indent``.

    Hyphenated words (``data-bound``) and long words (paths) are never split, nor a number from the word
    after it (``34.25 ms``, ``4 cores``)."""
    glued = re.sub(r"(?<=\d) (?=\S)", "\xa0", text)  # textwrap breaks at ASCII whitespace only
    lines = textwrap.wrap(
        glued, LINE_WIDTH, subsequent_indent=indent, break_on_hyphens=False, break_long_words=False
    ) or [glued]
    return [ln.replace("\xa0", " ") for ln in lines]


@dataclass
class Diagnosis:
    """What :func:`diagnose` found: a verdict, its evidence and ranked recommendations."""

    verdict: str
    measurements: Measurements
    decision: Decision
    seconds: float
    notes: list[str] = field(default_factory=list)

    @property
    def recommendations(self) -> list[Recommendation]:
        return self.decision.recommendations

    @property
    def stall_share(self) -> float:
        """Share of the measured step spent waiting for data (0-1)."""
        return self.decision.stall_share

    @property
    def evidence(self) -> dict[str, Any]:
        """Phase times (ms per step), shares and the facts the verdict rests on."""
        m, d, f = self.measurements, self.decision, self.measurements.facts
        return {
            "steps": m.steps,
            "wait_ms": m.wait_s * 1e3,
            "h2d_ms": m.h2d_s * 1e3,
            "compute_ms": m.compute_s * 1e3,
            "step_ms": m.step_s * 1e3,
            "stall_share": d.stall_share,
            "shares": dict(d.shares),
            "stage_ms": {k: (None if v is None else v * 1e3) for k, v in d.stage_times.items()},
            "predicted_overlapped_ms": d.predicted_overlapped_s * 1e3,
            "first_batch_s": m.first_batch_s,
            "num_workers": f.num_workers,
            "cores": f.cpu_count,
            "pin_memory": f.pin_memory,
            "device": f.device_type,
            "batch": f"{f.batch_dtype} {list(f.batch_shape)}",
        }

    def to_dict(self) -> dict[str, Any]:
        return {
            "verdict": self.verdict,
            "evidence": self.evidence,
            "recommendations": [asdict(r) for r in self.recommendations],
            "notes": self.notes + self.decision.notes,
            "seconds": self.seconds,
        }

    def _lines(self) -> list[str]:
        """The report's lines, each at most :data:`LINE_WIDTH` characters: a long one is wrapped at words,
        its continuation lines indented under its text."""
        m, d, f = self.measurements, self.decision, self.measurements.facts
        out = [
            f"Verdict: {self.verdict.upper()}  ({m.steps} steps measured on {f.device_type}, {self.seconds:.1f} s)",
            *_wrap(
                f"Per step: wait for data {_ms(m.wait_s)} ({d.shares['wait']:.0%}) · copy {_ms(m.h2d_s)} "
                f"({d.shares['h2d']:.0%}) · compute {_ms(m.compute_s)} ({d.shares['compute']:.0%}) · "
                f"total {_ms(m.step_s)}",
                " " * len("Per step: "),
            ),
            *_wrap(
                "Stages (bottleneck model): "
                + " · ".join(f"{k} {'hidden' if v is None else _ms(v)}" for k, v in d.stage_times.items())
                + f" -> overlapped step >= {_ms(d.predicted_overlapped_s)}",
                " " * len("Stages (bottleneck model): "),
            ),
            *_wrap(
                f"Pipeline: {f.loader_type}, num_workers={f.num_workers}, pin_memory={f.pin_memory}, "
                f"persistent_workers={f.persistent_workers}, prefetch_factor={f.prefetch_factor}, "
                f"{f.cpu_count} cores, batch {f.batch_dtype} {list(f.batch_shape)} "
                f"({f.batch_bytes / 2**20:.2f} MiB)"
                + (f", first batch after {m.first_batch_s:.3f} s" if m.first_batch_s is not None else ""),
                " " * len("Pipeline: "),
            ),
        ]
        if self.recommendations:
            out.append("Recommendations, most promising first:")
            for i, r in enumerate(self.recommendations, 1):
                gain = f"saves ~{_ms(r.gain_s)}/step" if r.gain_s is not None else "saving not estimable here"
                out += _wrap(f"  {i}. {r.action}  [{gain}; chapter {r.chapter}]", " " * len(f"  {i}. "))
                out += _wrap(f"     because {r.evidence}", " " * len("     "))
        for n in self.notes + d.notes:
            out += _wrap(f"Note: {n}", " " * len("Note: "))
        return out

    def __str__(self) -> str:
        return "\n".join(self._lines())

    def __repr__(self) -> str:
        return (
            f"Diagnosis(verdict={self.verdict!r}, stall_share={self.stall_share:.2f}, "
            f"recommendations={len(self.recommendations)})"
        )

    def _repr_html_(self) -> str:
        m, d = self.measurements, self.decision
        color = {"data-bound": "#4e79a7", "transfer-bound": "#f28e2b", "compute-bound": "#59a14f"}[self.verdict]
        rows = "".join(
            f"<tr><td>{p}</td><td style='text-align:right'>{v * 1e3:.2f} ms</td>"
            f"<td style='text-align:right'>{d.shares[k]:.0%}</td></tr>"
            for p, k, v in (
                ("wait for data", "wait", m.wait_s),
                ("copy to device", "h2d", m.h2d_s),
                ("compute", "compute", m.compute_s),
            )
        )
        recs = "".join(
            f"<li><b>{html.escape(r.action)}</b> "
            "<span style='color:#555'>("
            f"{'saves ~' + _ms(r.gain_s) + '/step' if r.gain_s is not None else 'saving not estimable'}; "
            f"chapter {html.escape(r.chapter)})</span><br><small>because {html.escape(r.evidence)}</small></li>"
            for r in self.recommendations
        )
        notes = "".join(f"<li>{html.escape(n)}</li>" for n in self.notes + d.notes)
        return (
            f"<div><b style='color:{color}'>Verdict: {self.verdict}</b> "
            f"<small>({m.steps} steps on {html.escape(m.facts.device_type)}, {self.seconds:.1f} s)</small>"
            f"<table><tr><th>phase</th><th>per step</th><th>share</th></tr>{rows}</table>"
            f"<ol>{recs}</ol>" + (f"<ul style='color:#555'>{notes}</ul>" if notes else "") + "</div>"
        )


def diagnose(
    loader: Iterable[Any],
    step_fn: Callable[[Any], Any],
    device: torch.device | str | None = None,
    *,
    steps: int = 20,
    warmup: int = 3,
    transfer: str | Callable[[Any, torch.device], Any] = "auto",
    time_limit_s: float = 60.0,
    stall_threshold: float = 0.15,
    measured: Mapping[str, str] | None = None,
) -> Diagnosis:
    """Measure a few steps of ``loader`` + ``step_fn`` and diagnose the pipeline.

    Args:
        loader: any re-iterable of batches (``DataLoader``, ``Prefetcher``, list, ...).
        step_fn: ``step_fn(batch)`` does one training step on a batch that is
            already on ``device`` (with ``transfer="auto"``).
        device: where the step runs; default CUDA if available, else CPU.
        steps: timed steps (1-10000). warmup: untimed steps first (0-1000).
        transfer: ``"auto"`` (the doctor copies every tensor in the batch with
            ``.to(device)``, timed as the copy phase), ``"none"`` (``step_fn``
            gets the batch as the loader yields it and copies it itself; the
            copy then counts as compute), or a callable ``(batch, device) -> batch``.
        time_limit_s: upper bound for the whole measurement; stops early after
            at least two timed steps, and interrupts a hanging ``next()`` or step.
        stall_threshold: see :func:`decide`.
        measured: what a waterfall run before measured on this machine, step name -> verdict (e.g.
            ``wf.step_verdicts()``); the advice then agrees with it (see :func:`decide`).

    Returns:
        A :class:`Diagnosis` (print it, or show it as the last line of a cell).

    Raises:
        ValueError: bad arguments, or the loader yields nothing.
        DoctorTimeout: fewer than two steps could be timed within ``time_limit_s``.
    """
    if not hasattr(loader, "__iter__"):
        raise ValueError(f"loader must be an iterable of batches, got {type(loader).__name__}")
    if not callable(step_fn):
        raise ValueError(f"step_fn must be a callable taking one batch, got {type(step_fn).__name__}")
    check_int("steps", steps, 1, 10_000)
    check_int("warmup", warmup, 0, 1000)
    check_float("time_limit_s", time_limit_s, 0.1, 24 * 3600.0)
    check_float("stall_threshold", stall_threshold, 0.0, 1.0)
    dev = resolve_device(device)  # None: CUDA when present; a device this machine lacks: ValueError

    if transfer == "auto":

        def move(b: Any, d: torch.device) -> Any:
            return move_batch(b, d, non_blocking=False)

        separate = True
    elif transfer == "none":

        def move(b: Any, d: torch.device) -> Any:
            return b

        separate = False
    elif callable(transfer):
        move = transfer  # type: ignore[assignment]
        separate = True
    else:
        raise ValueError(f"transfer must be 'auto', 'none' or a callable (batch, device) -> batch, got {transfer!r}")

    facts = inspect_loader(loader, dev)
    t_start = time.perf_counter()
    deadline = t_start + time_limit_s
    notes: list[str] = []
    waits: list[float] = []
    h2ds: list[float] = []
    computes: list[float] = []
    first_batch_s: float | None = None
    sample: Any = None
    restarts = 0
    what = ["the loader"]
    it: Iterator[Any] | None = None
    timed_out = False
    try:
        with _alarm(time_limit_s, what):
            it = iter(loader)
            fresh = True  # the next batch comes from a new iterator: its wait includes start-up
            done = 0
            while len(waits) < steps:
                if time.perf_counter() > deadline and len(waits) >= 2:
                    notes.append(f"Stopped after {len(waits)} timed steps: time limit of {time_limit_s:.0f} s reached.")
                    break
                what[0] = "next(iterator) on the loader"
                t0 = time.perf_counter()
                try:
                    batch = next(it)
                except StopIteration:
                    if done == 0:
                        raise ValueError("the loader yielded no batches") from None
                    restarts += 1
                    if restarts > 3:
                        notes.append("The loader ran out of batches four times; measured what it had.")
                        break
                    it = iter(loader)  # a new epoch
                    fresh = True
                    continue
                t1 = time.perf_counter()
                if first_batch_s is None:
                    first_batch_s = t1 - t0
                    sample = batch
                    _describe_batch(batch, facts)
                what[0] = "the copy to the device"
                moved = move(batch, dev)
                _sync(dev)
                t2 = time.perf_counter()
                what[0] = "step_fn"
                step_fn(moved)
                _sync(dev)
                t3 = time.perf_counter()
                if done >= warmup and not fresh:
                    waits.append(t1 - t0)
                    h2ds.append(t2 - t1)
                    computes.append(t3 - t2)
                fresh = False
                done += 1
                del batch, moved
            if restarts:
                notes.append(
                    f"The loader was restarted {restarts} time(s) to get enough steps; "
                    "each restart's first batch was not counted as a wait."
                )
    except DoctorTimeout as exc:
        timed_out = True
        if len(waits) < 2:
            raise DoctorTimeout(
                f"{exc}; only {len(waits)} step(s) were timed. Is the loader stuck (e.g. a worker that died) or "
                f"is one step longer than the limit? Raise time_limit_s or lower steps."
            ) from None
        notes.append(f"Interrupted: {exc}; measured {len(waits)} steps before that.")
    finally:
        if it is not None and not getattr(_unwrap(loader)[0], "persistent_workers", False):
            shutdown = getattr(it, "_shutdown_workers", None)
            if callable(shutdown):
                shutdown()
        it = None
    if not waits:
        raise ValueError(f"no step could be timed: raise steps, or lower warmup below the loader's {done} batches")
    pinned_h2d = None
    if (
        not timed_out
        and separate
        and dev.type == "cuda"
        and sample is not None
        and not facts.batch_pinned
        and time.perf_counter() < deadline
    ):
        pinned_h2d = _pinned_probe(sample, dev)
    del sample
    m = Measurements(
        steps=len(waits),
        wait_s=statistics.fmean(waits),
        h2d_s=statistics.fmean(h2ds),
        compute_s=statistics.fmean(computes),
        wait_median_s=statistics.median(waits),
        wait_p90_s=sorted(waits)[min(len(waits) - 1, int(0.9 * len(waits)))],
        first_batch_s=first_batch_s,
        pinned_h2d_s=pinned_h2d,
        transfer_separate=separate,
        facts=facts,
    )
    decision = decide(m, stall_threshold=stall_threshold, measured=measured)
    notes.append(f"The doctor ran {warmup + len(waits)} real steps: step_fn's model has trained on them.")
    return Diagnosis(
        verdict=decision.verdict, measurements=m, decision=decision, seconds=time.perf_counter() - t_start, notes=notes
    )


# ---------------------------------------------------------------------------
# Small pipelines of a known kind (tests and the chapter's demos)
# ---------------------------------------------------------------------------


class SyntheticImages(torch.utils.data.Dataset):
    """``n`` random images of ``size x size``, each costing ``delay_s`` seconds of CPU work to "load".

    The delay is spent busy (not sleeping), like decoding, so workers compete for
    cores as real loading does. Picklable, so it works with any worker start method.

    Args:
        n: items (1-1e6). size: image side (1-1024). delay_s: busy seconds per item (0-1).
        dtype: ``"float"`` (normalised float32) or ``"uint8"``.
    """

    def __init__(self, n: int = 256, size: int = 32, delay_s: float = 0.0, dtype: str = "float") -> None:
        self.n = check_int("n", n, 1, 1_000_000)
        self.size = check_int("size", size, 1, 1024)
        self.delay_s = check_float("delay_s", delay_s, 0.0, 1.0)
        self.dtype = check_choice("dtype", dtype, ("float", "uint8"))

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        if self.delay_s > 0:
            end = time.perf_counter() + self.delay_s
            while time.perf_counter() < end:
                pass
        g = torch.Generator().manual_seed(int(index))
        img = torch.randint(0, 256, (3, self.size, self.size), dtype=torch.uint8, generator=g)
        if self.dtype == "float":
            img = img.float().div_(255).sub_(0.5).div_(0.25)
        return img, int(index) % 4


class BusyStep:
    """A step function that spends ``seconds`` of busy CPU time per call (and counts calls)."""

    def __init__(self, seconds: float = 0.0) -> None:
        self.seconds = check_float("seconds", seconds, 0.0, 10.0)
        self.calls = 0

    def __call__(self, batch: Any) -> None:
        self.calls += 1
        end = time.perf_counter() + self.seconds
        while time.perf_counter() < end:
            pass
