"""What the pipeline doctor decides and reports: :func:`decide` applies chapter 01's bottleneck model to measured
phase times, a pure function (so a transfer-bound verdict, which a CPU cannot show, is tested with made-up times)."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Mapping

from ...core.validate import check_int, wrap

VERDICTS: tuple[str, ...] = ("data-bound", "transfer-bound", "compute-bound")
#: With workers, a wait of at least this share of the step means the loader sets the pace (else it is hidden).
STALL_THRESHOLD = 0.15
#: Advice saving at least this share of a step is ranked first; a copy below it is not worth advice.
NOTABLE_SHARE = 0.05


@dataclass
class PipelineFacts:
    """Facts read from the loader and the first batch (not timed); ``None``: unknown (a plain iterable's workers)."""

    loader_type: str = "unknown"
    num_workers: int | None = None
    pin_memory: bool | None = None
    persistent_workers: bool | None = None
    prefetch_factor: int | None = None
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
    """Mean seconds per step of each phase; ``transfer_separate``: False when the step function copies (the copy is
    then inside ``compute_s``)."""

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
    def step_s(self) -> float:  # the measured (synchronised, serial) loop's
        return self.wait_s + self.h2d_s + self.compute_s

    @property
    def busy_s(self) -> float:  # the loop's own work per step
        return self.h2d_s + self.compute_s


@dataclass(frozen=True)
class MeasuredStep:
    """What a waterfall measured for one step: seconds per step at its baseline and in ``label``, the configuration
    with that step (and the steps before it) switched on."""

    label: str
    baseline_s: float
    with_step_s: float

    @property
    def saving_s(self) -> float:  # below 0: the configuration was slower than the baseline
        return self.baseline_s - self.with_step_s

    @property
    def share(self) -> float:  # the saving as a share of the baseline's step
        return self.saving_s / self.baseline_s

    def describe(self) -> str:
        return (f"the waterfall measured {_ms(self.baseline_s)} -> {_ms(self.with_step_s)} per step, its baseline "
                f"to '{self.label}' (with the steps before it)")  # fmt: skip


@dataclass
class Recommendation:
    """One piece of advice: ``gain_s`` is the estimated saving per step (``None``: not estimable); ``bound``: it is
    the bottleneck model's saving with perfect overlap, an upper bound; ``step`` the waterfall step making this
    change ('' if none): what ``measured`` and ``measured_steps`` are matched on; ``measured_step``: what the
    waterfall measured for it."""

    action: str
    evidence: str
    stage: str
    gain_s: float | None = None
    chapter: str = ""
    step: str = ""
    bound: bool = False
    measured_step: MeasuredStep | None = None

    def saving(self) -> str:
        """The estimate, labelled (an upper bound or an estimate), and beside it what the waterfall measured."""
        if self.gain_s is None:
            text = "saving not estimable here"
        elif self.bound:
            text = f"saves at most ~{_ms(self.gain_s)}/step (bottleneck model, perfect overlap)"
        else:
            text = f"saves ~{_ms(self.gain_s)}/step (estimate)"
        if self.measured_step is not None:
            text += f"; {self.measured_step.describe()}"
        return text


LINE_WIDTH = 105


def _wrap(head: str, text: str) -> list[str]:
    """``head + text`` wrapped under the text, never splitting ``data-bound``, a path or ``34.25 ms``."""
    glued = re.sub(r"(?<=\d) (?=\S)", "\xa0", head + text)  # textwrap breaks at ASCII whitespace only
    return wrap(glued, LINE_WIDTH, indent=" " * len(head)).replace("\xa0", " ").split("\n")


@dataclass(repr=False)
class Diagnosis:
    """The verdict, the bottleneck model's stages (``None``: hidden by workers) and the ranked advice; ``seconds``:
    how long the doctor ran (0 for a bare :func:`decide`). A bare ``diag`` in a notebook shows the report."""

    verdict: str
    measurements: Measurements
    stage_times: dict[str, float | None]
    shares: dict[str, float]
    recommendations: list[Recommendation]
    notes: list[str]
    seconds: float = 0.0

    def __repr__(self) -> str:
        return f"Diagnosis(verdict={self.verdict!r}, recommendations={len(self.recommendations)})"

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:  # IPython's display of a bare ``diag``: the report
        p.text(str(self))

    def __str__(self) -> str:
        m, f = self.measurements, self.measurements.facts
        out = [
            f"Verdict: {self.verdict.upper()}  ({m.steps} steps measured on {f.device_type}, {self.seconds:.1f} s)",
            *_wrap("Per step: ", f"wait for data {_ms(m.wait_s)} ({self.shares['wait']:.0%}) · copy {_ms(m.h2d_s)} "
                   f"({self.shares['h2d']:.0%}) · compute {_ms(m.compute_s)} ({self.shares['compute']:.0%}) · "
                   f"total {_ms(m.step_s)}"),
            *_wrap("Stages (bottleneck model): ",
                   " · ".join(f"{k} {'hidden' if v is None else _ms(v)}" for k, v in self.stage_times.items())
                   + f" -> overlapped step >= {_ms(max(v for v in self.stage_times.values() if v is not None))}"),
            *_wrap("Pipeline: ", f"{f.loader_type}, num_workers={f.num_workers}, pin_memory={f.pin_memory}, "
                   f"persistent_workers={f.persistent_workers}, prefetch_factor={f.prefetch_factor}, "
                   f"{f.cpu_count} cores, batch {f.batch_dtype} {list(f.batch_shape)} ({f.batch_bytes / 2**20:.2f} MiB)"
                   + (f", first batch after {m.first_batch_s:.3f} s" if m.first_batch_s is not None else "")),
        ]  # fmt: skip
        if self.recommendations:
            out.append("Recommendations, most promising first:")
            for i, r in enumerate(self.recommendations, 1):
                out += _wrap(f"  {i}. ", f"{r.action}  [{r.saving()}; chapter {r.chapter}]")
                out += _wrap("     ", f"because {r.evidence}")
        for n in self.notes:
            out += _wrap("Note: ", n)
        return "\n".join(out)


def _ms(s: float | None) -> str:
    return "n/a" if s is None else f"{s * 1e3:.2f} ms"


def _more_workers(m: Measurements, d: Diagnosis) -> list[Recommendation]:
    f, nw, busy, stall = m.facts, m.facts.num_workers or 0, m.busy_s, d.shares["wait"]
    cores = max(1, int(f.cpu_count))
    per_batch = m.wait_s if not nw else nw * (m.wait_s + busy)  # seconds one worker needs per batch
    need = math.ceil(per_batch / busy) if busy > 0 else cores
    suggested = max(nw + 1, min(need, cores))
    if nw >= cores:
        extra = (
            "or decode JPEGs on the GPU (torchvision.io.decode_jpeg(device='cuda'))" if f.cuda else "or pre-decode once"
        )
        return [Recommendation(
            action="make each sample cheaper to load: send uint8, decode smaller or cached images, " + extra,
            evidence=f"already {nw} workers on {cores} cores and the loop still waits {_ms(m.wait_s)} per step "
            f"({stall:.0%}): more workers than cores cannot help CPU-bound decoding",
            stage="data", chapter="04 · workers",
        )]  # fmt: skip
    who = "in the main process" if not nw else f"per worker (with {nw} worker{'s' if nw != 1 else ''})"
    what = (
        "raise num_workers" if f.num_workers is not None else "load in worker processes (a DataLoader with num_workers)"
    )
    return [Recommendation(
        action=f"{what} from {nw} to {suggested}",
        evidence=f"the loop waited {_ms(m.wait_s)} per step for data ({stall:.0%} of the step); loading one batch "
        f"takes {_ms(per_batch)} {who} while the step's own work takes {_ms(busy)}, so ceil({per_batch * 1e3:.2f} "
        f"/ {busy * 1e3:.2f}) = {need} worker{'s' if need != 1 else ''} would keep up; this machine has {cores} "
        f"usable core{'s' if cores != 1 else ''}" + ("" if f.cuda else " (on a CPU device the workers share them "
        "with the model)"),
        stage="data", gain_s=max(0.0, m.wait_s - max(0.0, per_batch / suggested - busy)), chapter="04 · workers",
        step="workers", bound=True,
    )]  # fmt: skip


def _data_advice(m: Measurements, d: Diagnosis) -> list[Recommendation]:
    f, nw = m.facts, m.facts.num_workers or 0
    recs: list[Recommendation] = []
    if m.wait_s > 0 and (not nw or d.shares["wait"] >= STALL_THRESHOLD):
        recs += _more_workers(m, d)
        med, p90 = m.wait_median_s, m.wait_p90_s
        if nw and p90 is not None and med is not None and f.prefetch_factor and p90 > 3 * max(med, 1e-6) and (
                p90 > 0.1 * m.busy_s):  # fmt: skip
            recs.append(Recommendation(
                action=f"raise prefetch_factor from {f.prefetch_factor} to {2 * f.prefetch_factor}",
                evidence=f"waits are bursty: median {_ms(med)}, 90th percentile {_ms(p90)}; a deeper queue absorbs "
                "bursts (it cannot raise the loader's average rate)",
                stage="data", gain_s=max(0.0, m.wait_s - med), chapter="04 · prefetch_factor", step="persistent",
            ))  # fmt: skip
    if nw and f.persistent_workers is False and m.first_batch_s is not None:
        per_epoch = f.batches_per_epoch or m.steps
        startup = max(0.0, m.first_batch_s - m.wait_s)
        recs.append(Recommendation(
            action="set persistent_workers=True",
            evidence=f"each epoch restarts {nw} worker{'s' if nw != 1 else ''}: the first batch took "
            f"{m.first_batch_s:.3f} s, {startup:.3f} s more than a typical wait; spread over {per_epoch} steps "
            "per epoch",
            stage="data", gain_s=startup / max(1, per_epoch), chapter="04 · persistent workers", step="persistent",
        ))  # fmt: skip
    return recs


def _transfer_advice(m: Measurements, d: Diagnosis) -> list[Recommendation]:
    f = m.facts
    recs: list[Recommendation] = []
    if not (f.cuda and m.transfer_separate and d.shares["h2d"] >= NOTABLE_SHARE):
        if not f.cuda and f.float_image_batch and f.num_workers and d.verdict == "data-bound":
            recs.append(Recommendation(
                action="send uint8 images from the workers and normalise in the step",
                evidence=f"workers hand over {f.batch_bytes / 2**20:.2f} MiB float batches; uint8 is 4x fewer bytes "
                "to collate and pass between processes, and skips the float conversion in the workers",
                stage="data", chapter="04 · uint8 batches",
            ))  # fmt: skip
        return recs
    after_pin = m.h2d_s
    if not (f.pin_memory or f.batch_pinned):
        gain, ev = None, f"the copy takes {_ms(m.h2d_s)} per step ({d.shares['h2d']:.0%}) from pageable memory"
        if m.pinned_h2d_s is not None:
            gain, after_pin = max(0.0, m.h2d_s - m.pinned_h2d_s), min(m.h2d_s, m.pinned_h2d_s)
            ev = f"the copy takes {_ms(m.h2d_s)} from pageable memory and {_ms(m.pinned_h2d_s)} from pinned " + (
                "memory (same batch, measured)")  # fmt: skip
        recs.append(Recommendation(
            action="pin memory: DataLoader(pin_memory=True)",
            evidence=ev + "; pinned memory is also what lets a copy overlap with compute",
            stage="transfer", gain_s=gain, chapter="02 · pinned memory", step="pinned",
        ))  # fmt: skip
    if f.float_image_batch:
        recs.append(Recommendation(
            action="send uint8 images and normalise on the GPU (4x fewer bytes)",
            evidence=f"the batch is {f.batch_dtype} {list(f.batch_shape)}, {f.batch_bytes / 2**20:.1f} MiB; as uint8 "
            f"it would be {f.batch_bytes / 4 / 2**20:.1f} MiB; copy time scales with bytes for batches this size "
            "(estimate: three quarters of the copy)",
            stage="transfer", gain_s=0.75 * after_pin, chapter="05 · uint8 + GPU normalise", step="uint8",
        ))  # fmt: skip
        after_pin *= 0.25
    if not f.uses_prefetcher:
        recs.append(Recommendation(
            action="overlap the copy with compute: a side-stream prefetcher (helpers.pipeline.prefetch.Prefetcher) "
            "on pinned batches",
            evidence=f"the copy ({_ms(after_pin)} after the steps above) and the compute ({_ms(m.compute_s)}) run "
            "one after the other; overlapped, the smaller one hides behind the larger",
            stage="transfer", gain_s=min(after_pin, m.compute_s), chapter="05 · overlap", step="prefetcher",
            bound=True,
        ))  # fmt: skip
    return recs


def _compute_advice(m: Measurements, d: Diagnosis) -> list[Recommendation]:
    if d.verdict != "compute-bound":
        return []
    quiet = d.shares["wait"] < STALL_THRESHOLD
    if m.facts.num_workers or quiet:
        d.notes.append(
            "More workers or a deeper prefetch queue would not speed this loop up: it barely waits for data."
        )
    return [Recommendation(
        action="speed up the step itself: mixed precision (torch.autocast), channels_last, torch.compile, or a larger "
        "batch" + ("; the input pipeline already keeps up" if quiet else ""),
        evidence=f"compute takes {_ms(m.compute_s)} of a {_ms(m.step_s)} step ({d.shares['compute']:.0%}); the loop "
        f"waited {d.shares['wait']:.0%} of its time for data",
        stage="compute", chapter="01 · bottleneck model",
    )]  # fmt: skip


def _agree_with(recs: list[Recommendation], measured: Mapping[str, str], notes: list[str]) -> list[Recommendation]:
    agreed: list[Recommendation] = []
    here = "the waterfall on this machine"
    for r in recs:
        v = measured.get(r.step) if r.step else None
        if v == "slower" and r.step == "workers" and measured.get("persistent") == "gain":
            r.action += " with persistent_workers=True"  # what the waterfall measured as a gain
            r.evidence += (f"; {here} measured workers that restart every epoch slower beyond its noise, and "
                           "persistent workers (with prefetch_factor=4) a gain")  # fmt: skip
            r.step = "persistent"
        elif v == "slower":
            notes.append(f"Not recommended here: {r.action}. The waterfall on this machine measured its step "
                         f"('{r.step}') slower beyond its noise.")  # fmt: skip
            continue
        elif v in ("within noise", "no effect", "needs CUDA"):
            r.gain_s = None  # the measurement saw no saving: no estimate ranks it
            r.evidence += f"; but {here} measured this step ('{r.step}'): {v}"
        elif v == "one round":
            r.evidence += f"; {here} ran this step ('{r.step}') in one round: no verdict"
        elif v is not None:
            r.evidence += f"; {here} measured this step ('{r.step}'): {v}"
        agreed.append(r)
    return agreed


def _check_inputs(
    m: Measurements, measured: Mapping[str, str] | None, measured_steps: Mapping[str, MeasuredStep] | None
) -> None:
    """:func:`decide`'s arguments, checked: finite phase times >= 0, a step of more than 0 s, verdicts as text."""
    check_int("steps", m.steps, 1)
    for name in ("wait_s", "h2d_s", "compute_s"):
        v = getattr(m, name)
        if not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
            raise ValueError(f"{name} must be a finite number >= 0 seconds, got {v!r}")
    for k, v in (measured or {}).items():
        if not isinstance(v, str):
            raise ValueError(f"measured[{k!r}] must be a verdict such as 'gain' or 'slower', got {v!r}")
    for k, ms in (measured_steps or {}).items():
        times = (getattr(ms, "baseline_s", None), getattr(ms, "with_step_s", None))
        if not isinstance(ms, MeasuredStep) or not all(
            isinstance(t, (int, float)) and math.isfinite(t) and t > 0 for t in times
        ):
            raise ValueError(f"measured_steps[{k!r}] must be a MeasuredStep with times > 0 seconds, got {ms!r}")
    if m.step_s <= 0:
        raise ValueError("the measured step time is 0 s: nothing was timed")


def decide(
    m: Measurements,
    *,
    measured: Mapping[str, str] | None = None,
    measured_steps: Mapping[str, MeasuredStep] | None = None,
) -> Diagnosis:
    """Verdict and ranked advice: overlapped, a step takes as long as its slowest stage. **data**: without workers the
    wait; with workers ``wait + h2d + compute`` when the wait is at least :data:`STALL_THRESHOLD` of the step, else
    hidden. ``measured`` (a waterfall's step verdicts): a step measured 'slower' is withdrawn with a note; one
    within noise keeps no estimated saving. ``measured_steps`` (a waterfall's step times): shown beside the
    estimate, and a recommendation that keeps a saving is ranked by the measured one."""
    _check_inputs(m, measured, measured_steps)
    step, nw = m.step_s, m.facts.num_workers
    stall = m.wait_s / step
    shares = {"wait": stall, "h2d": m.h2d_s / step, "compute": m.compute_s / step}
    notes: list[str] = []
    data_stage: float | None = m.wait_s if not nw else m.wait_s + m.h2d_s + m.compute_s
    if nw and stall < STALL_THRESHOLD:
        data_stage = None  # hidden by the workers: below the step's own work
        notes.append(f"Loading is hidden by {nw} worker(s): the loop waited only {stall:.0%} of its time for data.")
    stages: dict[str, float | None] = {"data": data_stage, "transfer": m.h2d_s, "compute": m.compute_s}
    known = {k: v for k, v in stages.items() if v is not None}
    bottleneck = max(known, key=lambda k: known[k])
    if not m.transfer_separate:
        notes.append("The step function does its own copy, so the copy is counted inside 'compute'.")
    if not m.facts.cuda:
        notes.append("No CUDA device: the copy to the device is a no-op here, so transfer cannot be the bottleneck.")
    d = Diagnosis(f"{bottleneck}-bound", m, stages, shares, [], notes)
    recs = _data_advice(m, d) + _transfer_advice(m, d) + _compute_advice(m, d)
    if measured:
        recs = _agree_with(recs, measured, notes)
    for r in recs:  # after _agree_with: it may have moved the advice to another step
        r.measured_step = (measured_steps or {}).get(r.step) if r.step else None

    def rank(r: Recommendation) -> tuple[int, float]:  # by the measured saving when there is one, else the estimate
        if r.gain_s is None:
            share = 0.0
        else:
            share = r.measured_step.share if r.measured_step is not None else r.gain_s / step
        return (0 if r.gain_s is not None and share >= NOTABLE_SHARE else 1 if r.stage == bottleneck else 2, -share)

    recs.sort(key=rank)
    if not recs:
        notes.append("No change is indicated by these measurements.")
    d.recommendations = recs
    return d
