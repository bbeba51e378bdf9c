"""Chapter 06: one configuration's run of the job (:func:`run_config`): its epoch time (worker start-up included),
accuracy, span trace and shares; each stage **alone** (the loader, the copy on CUDA, ``train_step`` on a batch on
the device); and the pipeline efficiency (:class:`Efficiency`)."""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch
from torch.utils.data import default_collate

from ...core.progress import no_progress
from ...core.rounds import intraop_threads
from ...core.timing import SpanRecorder, SpanTrace, synchronize, time_calls
from ...pipeline.data import to_float_normalized
from ...pipeline.models import build_model
from ...pipeline.prefetch import move_batch
from ...pipeline.train import COMPUTE_LANE_CPU, COMPUTE_LANE_GPU, DATA_LANE, make_optimizer
from .doctor import copy_seconds
from .job import (
    _CACHE,
    JobSpec,
    Pipeline,
    Settings,
    _pipeline,
    _val_batches,
    _warm_batches,
    built_loader,
    dataset_info,
    same_numerics,
    seed_order,
    train_items,
)


@dataclass
class ConfigResult:
    """One configuration's run: ``epoch_s`` per timed epoch (in a waterfall the median of ``round_epoch_s``);
    ``stages``: items/s of each stage alone (``None``: no such stage here)."""

    name: str
    label: str
    settings: Settings
    spec: JobSpec
    epoch_s: float
    steps: int
    samples: int
    accuracy: float
    train_loss: float
    trace: SpanTrace
    compute_busy: float
    data_stall: float
    stages: dict[str, float | None] = field(default_factory=dict)
    efficiency: Efficiency | None = None
    round_epoch_s: list[float] = field(default_factory=list)

    @property
    def throughput(self) -> float:  # training samples per second
        return self.samples / self.epoch_s if self.epoch_s > 0 else float("nan")

    @property
    def step_s(self) -> float:
        return self.epoch_s / max(1, self.steps)

    @property
    def slowest_stage(self) -> str | None:
        known = {k: v for k, v in self.stages.items() if v}
        return min(known, key=lambda k: known[k]) if known else None


def _shares(trace: SpanTrace, begins: list[float], epoch_total: float) -> tuple[float, float]:
    """(compute busy, data stall) as shares of the epochs; the stall includes each epoch's start-up (before its
    first span)."""
    totals = trace.phase_totals()
    startup = sum(min((s.host_start for s in trace.spans if s.host_start >= t0), default=t0) - t0 for t0 in begins)
    busy, stall = totals.get("train_step", 0.0), totals.get("batch", 0.0) + startup
    return min(1.0, busy / epoch_total), min(1.0, stall / epoch_total)


def _on_device(x: torch.Tensor, dev: torch.device, pipeline: Pipeline) -> None:
    if x.device.type != dev.type:
        raise ValueError(
            f"batches() put the batch on {x.device}, but the job runs on {dev}: the pipeline "
            f"({pipeline.source}) reads DEVICE; run the job on DEVICE (device=DEVICE)"
        )


def _warm_up(pipe: Pipeline, model: Any, opt: Any, loader: Any, s: Settings, spec: JobSpec, dev: torch.device) -> None:
    seed_order(loader, spec.seed, 0, fresh=True)
    it = pipe.batches(loader, **s.batches_kwargs())
    try:
        warm = _warm_batches(it, spec.warm_steps, drain=s.persistent_workers and s.num_workers > 0)
    finally:
        getattr(it, "close", lambda: None)()  # the loader iterator inside the generator is let go now
    for x, _y in warm:
        _on_device(x, dev, pipe)
    order = torch.Generator().manual_seed(spec.seed)
    for p in range(spec.warm_passes):
        for i in range(len(warm)) if p == 0 else torch.randperm(len(warm), generator=order).tolist():
            pipe.train_step(model, opt, *warm[i])


def _timed_epoch(
    pipe: Pipeline, model: Any, opt: Any, loader: Any, s: Settings, rec: SpanRecorder, epoch: int, first: int
) -> tuple[int, int, float, torch.Tensor]:
    """One pass of ``for x, y in batches(...): train_step(...)`` in spans; (steps, samples, seconds, summed loss)."""
    lane = COMPUTE_LANE_GPU if rec.cuda else COMPUTE_LANE_CPU
    total = torch.zeros((), device=rec.device)
    steps = samples = 0
    t0 = time.perf_counter()
    it = iter(pipe.batches(loader, **s.batches_kwargs()))
    try:
        while True:
            h0 = rec.now()
            try:
                x, y = next(it)
            except StopIteration:
                break
            rec.add("batch", first + steps, h0, rec.now(), lane=DATA_LANE)
            if steps == 0:
                _on_device(x, rec.device, pipe)
            with rec.span("train_step", first + steps, gpu=True, lane=lane):
                loss = pipe.train_step(model, opt, x, y)
            total += loss.detach().float() * y.shape[0]
            samples += int(y.shape[0])
            steps += 1
    finally:
        getattr(it, "close", lambda: None)()
    synchronize(rec.device)
    return steps, samples, time.perf_counter() - t0, total


@torch.no_grad()
def _evaluate(pipeline: Pipeline, model: Any, spec: JobSpec) -> float:
    model.eval()  # the job's model is not trained after this
    correct, seen = torch.zeros((), dtype=torch.int64), 0
    for x, y in pipeline.batches(_val_batches(spec)):
        correct = correct.to(x.device) + (model(x).argmax(1) == y).sum()
        seen += int(y.shape[0])
    if not seen:
        raise ValueError("the validation set yielded no batch")
    return float(correct.item()) / seen


def run_config(
    settings: Settings,
    spec: JobSpec,
    device: torch.device | str = "cpu",
    *,
    name: str = "custom",
    label: str | None = None,
    stages: bool = True,
    progress: Callable[[float, str], None] | None = None,
    pipeline: Pipeline | None = None,
) -> ConfigResult:
    """Train the job once with ``settings`` through ``pipeline`` (default the take-home one): warm-up, timed epochs,
    accuracy; with ``stages``, each stage alone and the efficiency. Workers, RNG state and threads are restored."""
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device is 'cuda' but no CUDA device is available; use device='cpu'")
    pipe = _pipeline(pipeline, dev, spec.seed)
    report = progress or no_progress
    model = build_model(width=spec.width, depth=spec.depth, num_classes=len(dataset_info().classes), seed=spec.seed)
    model = model.to(dev)
    opt = make_optimizer(model, lr=spec.lr)
    begins: list[float] = []  # each timed epoch's start
    total_s, steps, samples, loss = 0.0, 0, 0, torch.zeros((), device=dev)
    with built_loader(pipe, spec, settings) as loader:
        report(0.05, f"{name}: warm-up")
        if spec.warm_steps:
            _warm_up(pipe, model, opt, loader, settings, spec, dev)
        rec = SpanRecorder(dev, config=name, regime=spec.regime, calls=settings.calls(), pipeline=pipe.source)
        for e in range(spec.epochs):
            report(0.1 + 0.7 * e / spec.epochs, f"{name}: epoch {e + 1}/{spec.epochs}")
            begins.append(rec.now())
            seed_order(loader, spec.seed, e + 1, fresh=not spec.warm_steps and e == 0)
            n, k, sec, summed = _timed_epoch(pipe, model, opt, loader, settings, rec, e + 1, steps)
            total_s, steps, samples, loss = total_s + sec, steps + n, samples + k, loss + summed
        trace = rec.finish()
        report(0.85, f"{name}: evaluating")
        acc = _evaluate(pipe, model, spec)
    if steps == 0:
        raise ValueError(f"train_items={spec.train_items} gives no full batch of {spec.batch_size}; raise train_items")
    busy, stall = _shares(trace, begins, total_s)
    trace.metadata.update({"epoch_s": total_s / spec.epochs, "compute_busy": busy, "data_stall": stall})
    result = ConfigResult(name, label or name, settings, spec, total_s / spec.epochs,
                          steps // spec.epochs, samples // spec.epochs, acc, float(loss.item()) / max(1, samples),
                          trace, busy, stall)  # fmt: skip
    if stages:  # each stage alone, as the job runs it; cached per stage settings (an unchanged stage: measured once)
        report(0.9, f"{name}: stages alone")
        result.stages = {"loader": _loader_alone(pipe, spec, settings, dev), "copy": _copy_alone(spec, settings, dev),
                         "compute": _compute_alone(pipe, spec, dev)}  # fmt: skip
        result.efficiency = pipeline_efficiency(result.throughput, result.stages)
    report(1.0, f"{name}: done")
    return result


def _loader_alone(pipeline: Pipeline, spec: JobSpec, s: Settings, dev: torch.device) -> float:
    """Items/s of the loader alone over one pass, start-up included, after at most 2 warm-up batches (cached)."""
    key = ("loader", id(pipeline.make_loader), spec.train_items, spec.batch_size, spec.crop_size, s.num_workers,
           s.persistent_workers, s.prefetch_factor, s.pin_memory and dev.type == "cuda", spec.threads,
           min(spec.warm_steps, 2))  # fmt: skip
    if key not in _CACHE:
        with built_loader(pipeline, spec, s) as loader:
            seed_order(loader, spec.seed, 0, fresh=True)
            _warm_batches(loader, min(spec.warm_steps, 2), drain=s.persistent_workers and s.num_workers > 0)
            seed_order(loader, spec.seed, 1, fresh=False)
            t0 = time.perf_counter()
            n = sum(int(x.shape[0]) for x, _y in loader)
            seconds = time.perf_counter() - t0
        _CACHE[key] = n / seconds if seconds > 0 else float("nan")
    return _CACHE[key]


def _sample_batch(spec: JobSpec) -> tuple[torch.Tensor, torch.Tensor]:
    key = ("sample", spec.batch_size, spec.crop_size, spec.seed, spec.train_items)  # the first batch, uint8
    if key not in _CACHE:
        ds = train_items(spec)
        with torch.random.fork_rng(devices=[]):
            _CACHE[key] = default_collate([ds[i] for i in range(min(spec.batch_size, len(ds)))])
    return _CACHE[key]


def _copy_alone(spec: JobSpec, s: Settings, dev: torch.device) -> float | None:
    """Items/s of copying one batch as the configuration sends it; CUDA only."""
    if dev.type != "cuda":
        return None
    x, y = _sample_batch(spec)
    x = x.float() if s.output == "float" else x  # the bytes a float batch moves (values do not change a copy's time)
    return spec.batch_size / copy_seconds((x, y), dev, pin=s.pin_memory, repeats=10, warmup=2)


def _compute_alone(pipeline: Pipeline, spec: JobSpec, dev: torch.device) -> float:
    """Items/s of ``train_step`` on one batch on the device over an epoch's steps (4 to 20): the lower-quartile step,
    its own pace (steps slowed by other programs count against the efficiency)."""
    key = ("compute", id(pipeline.train_step), spec.width, spec.depth, spec.batch_size, spec.crop_size, str(dev),
           spec.threads, spec.train_items)  # fmt: skip
    if key not in _CACHE:
        times = _step_times(spec, dev, max(4, min(spec.steps_per_epoch, 20)), pipeline.train_step)
        _CACHE[key] = spec.batch_size / statistics.quantiles(times, n=4, method="inclusive")[0]
    return _CACHE[key]


def _step_times(spec: JobSpec, dev: torch.device, n: int, step: Callable[..., Any], warm: int = 2) -> list[float]:
    x, y = move_batch(_sample_batch(spec), dev, non_blocking=False)
    x = to_float_normalized(x)
    classes = int(dataset_info().params["num_classes"])
    model = build_model(width=spec.width, depth=spec.depth, num_classes=classes, seed=spec.seed).to(dev)
    opt = make_optimizer(model, lr=spec.lr)
    with intraop_threads(spec.threads), same_numerics():
        return time_calls(lambda: step(model, opt, x, y), repeats=n, device=dev, warmup=warm).times_s


#: A pipeline measured faster than its slowest stage alone by no more than this is 'at the bottleneck'.
EFFICIENCY_NOISE = 0.10


@dataclass(frozen=True)
class Efficiency:
    """``ratio``: throughput / slowest stage alone; ``value``: shown, never above 1 (1.0 within the noise above,
    ``None`` further); ``verdict``: why ``value`` is not the ratio."""

    ratio: float
    value: float | None
    verdict: str = ""

    @classmethod
    def of_ratio(cls, ratio: float, noise: float = EFFICIENCY_NOISE) -> Efficiency:
        if ratio <= 1.0:
            return cls(ratio, ratio)
        if ratio <= 1.0 + noise:
            return cls(ratio, 1.0, "at the bottleneck (within noise)")
        return cls(
            ratio,
            None,
            f"out of range: the pipeline ran {ratio:.2f}x its slowest stage alone, beyond the {noise:.0%} "
            "noise; the stages-alone figures were measured under other conditions (a pipeline cannot beat "
            "its bottleneck)",
        )

    def short(self) -> str:
        if self.value is None:
            return "out of range"
        return f"{self.value:.2f}" + (" (noise)" if self.verdict else "")

    def __str__(self) -> str:
        if self.value is None:
            return self.verdict
        return f"{self.value:.2f}" + (f", {self.verdict}" if self.verdict else "")


def pipeline_efficiency(
    throughput: float, stages: Mapping[str, float | None], noise: float = EFFICIENCY_NOISE
) -> Efficiency | None:
    """Throughput over the slowest known stage alone's; ``None`` if none is known."""
    known = [float(v) for v in stages.values() if v is not None and v > 0 and math.isfinite(v)]
    if not known or not (throughput > 0):
        return None
    return Efficiency.of_ratio(float(throughput) / min(known), noise)
