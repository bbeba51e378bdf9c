"""Chapter 01's step anatomy: the reader's loader, ``to_device`` and ``train_step`` timed phase by phase on the
kernel's span recorder (two PyTorch hooks split the step into forward / backward / optimizer)."""

from __future__ import annotations

import contextlib
import functools
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Mapping

import psutil
import torch
from torch import nn

from ...core.progress import no_progress, scaled
from ...core.timing import SpanRecorder, SpanTrace
from ...core.validate import check_int
from ...pipeline.data import ShapesDataset, TimedCollate, make_shapes_dataset, to_float_normalized
from ...pipeline.loaders import timed_loader
from ...pipeline.models import build_model, flops_per_sample, output_numels
from ...pipeline.train import (
    COMPUTE_LANE_CPU,
    COMPUTE_LANE_GPU,
    COPY_LANE,
    DATA_LANE,
    make_optimizer,
)
from .training import blocking_copy

#: In step order (``pin`` only for pinning loaders, ``normalize`` only for uint8 batches).
PHASES: tuple[str, ...] = ("load", "collate", "pin", "h2d", "normalize", "forward", "backward", "optimizer")

#: The resources of the bottleneck model and the phases each one runs.
STAGES: dict[str, tuple[str, ...]] = {
    DATA_LANE: ("load", "collate", "pin"),
    COPY_LANE: ("h2d",),
    "compute (device)": ("normalize", "forward", "backward", "optimizer"),
}


@dataclass
class Prediction:
    """The bottleneck model's step time: ``serial`` (nothing overlaps), ``overlapped`` (the slowest stage)."""

    stage_times: dict[str, float]
    serial: float
    overlapped: float
    bottleneck: str

    def speedup_bound(self) -> float:
        return self.serial / self.overlapped if self.overlapped > 0 else float("nan")

    @property
    def one_step_overlap(self) -> float:
        """The naive loop's step on a GPU, copy + max(data, compute): asynchronous kernel launches let the CPU load
        batch i+1 while the GPU computes, and the blocking copy overlaps nothing."""
        names = list(STAGES)
        data, copy, compute = (self.stage_times[n] for n in names)
        rest = sum(v for k, v in self.stage_times.items() if k not in names)
        return copy + max(data, compute) + rest


def predict_step_time(phase_times: Mapping[str, float]) -> Prediction:
    """The step time from per-step phase times (seconds): ``serial`` adds every phase, ``overlapped`` is the slowest
    stage of :data:`STAGES` (every resource on a different step at once). Other phases are their own stage."""
    for name, value in phase_times.items():
        if value < 0 or value != value:
            raise ValueError(f"phase time {name!r} must be a non-negative number, got {value}")
    named = {p for phases in STAGES.values() for p in phases}
    stage_times = {stage: float(sum(phase_times.get(p, 0.0) for p in phases)) for stage, phases in STAGES.items()}
    stage_times.update({name: float(v) for name, v in phase_times.items() if name not in named})
    bottleneck = max(stage_times, key=lambda k: stage_times[k])
    return Prediction(stage_times, float(sum(phase_times.values())), stage_times[bottleneck], bottleneck)


def check_training_memory(
    model: nn.Module, image_size: int, batch_size: int, *, share: float = 0.8, available_bytes: int | None = None
) -> int:
    """Estimated bytes of one training step (outputs kept for backward, in-place ReLUs allocating nothing, their
    gradients and the float batch: not a measurement), or ValueError above ``share`` of the memory available now
    (host RAM, or free memory of the model's GPU; ``available_bytes`` overrides it)."""
    check_int("image_size", image_size, 1, 8192)
    check_int("batch_size", batch_size, 1, 10**7)
    kept = (nn.Conv2d, nn.BatchNorm2d, nn.MaxPool2d, nn.Linear)
    floats = sum(n for m, n in output_numels(model, image_size) if isinstance(m, kept))
    need = int(4 * (2 * floats + 3 * image_size * image_size) * batch_size)
    if available_bytes is None:
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        if device.type == "cuda":
            available_bytes = int(torch.cuda.mem_get_info(device)[0])
        else:
            available_bytes = int(psutil.virtual_memory().available)
    limit = int(share * available_bytes)
    if need > limit:
        width = getattr(model, "width", "?")
        raise ValueError(
            f"batch_size/crop_size/width: a training step with batch size {batch_size}, {image_size}x{image_size} "
            f"px images and width {width} needs about {need / 2**30:.1f} GiB (activations, their gradients "
            f"and the batch), more than the {limit / 2**30:.1f} GiB this machine has free for it. "
            f"Use a smaller batch, smaller images or a thinner model."
        )
    return need


ToDevice = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


StepFn = Callable[[nn.Module, torch.optim.Optimizer, torch.Tensor, torch.Tensor], Any]


def baseline_train_step(
    model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor
) -> torch.Tensor:
    """Chapter 01's ``train_step`` cell, for the headless runs (a test compares the weights)."""
    loss = nn.functional.cross_entropy(model(x), y)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return loss.detach()


@contextlib.contextmanager
def _phase_hooks(
    model: nn.Module, optimizer: torch.optim.Optimizer, recorder: SpanRecorder, lane: str
) -> Iterator[Callable[..., None]]:
    """``begin(name, step)`` closes the open phase span and opens ``name``; ``model(x)`` returning begins
    "backward", ``optimizer.step()`` "optimizer" (the hooks run in order with the step's calls, so on a GPU their
    CUDA events sit in the stream between the two phases' kernels)."""
    spans, at = contextlib.ExitStack(), [0]

    def begin(name: str | None, step: int | None = None) -> None:
        spans.close()
        at[0] = at[0] if step is None else step
        if name is not None:
            spans.enter_context(recorder.span(name, at[0], gpu=True, lane=lane))

    handles = [
        model.register_forward_hook(lambda module, args, output: begin("backward")),
        optimizer.register_step_pre_hook(lambda opt, args, kwargs: begin("optimizer")),
    ]
    try:
        yield begin
    finally:
        spans.close()
        for h in handles:
            h.remove()


@contextlib.contextmanager
def _collate_timer(loader: Iterable[Any]) -> Iterator[TimedCollate | None]:
    """The loader's collate function with a clock around it while it runs in this process; else None."""
    collate = getattr(loader, "collate_fn", None)
    ours = isinstance(collate, TimedCollate) or isinstance(loader, torch.utils.data.DataLoader)
    if collate is None or getattr(loader, "num_workers", 1) != 0 or not ours:
        yield None
        return
    timed = collate if isinstance(collate, TimedCollate) else TimedCollate(collate)
    loader.collate_fn = timed  # type: ignore[attr-defined]  # read by the next iter(loader)
    try:
        yield timed
    finally:
        loader.collate_fn = collate  # type: ignore[attr-defined]


def _can_pin() -> bool:  # a pin_memory=True loader pins only with a CUDA device
    return torch.cuda.is_available()


def _record_wait(recorder: SpanRecorder, step: int, h0: float, timed: TimedCollate | None, pinning: bool) -> None:
    """Record the wait for one batch, from ``h0`` until now: load, then collate (and pin) when ``timed`` saw it."""
    h1 = recorder.now()
    if timed is not None and timed.last is not None:  # collate ran before next() returned: c0 <= c1 <= h1
        c0, c1 = (min(recorder.since_start(t), h1) for t in timed.last)
        recorder.add("load", step, h0, max(h0, c0), lane=DATA_LANE)
        if pinning and h1 > c1:  # the main process pins the batch right after collating it
            recorder.add("collate", step, max(h0, c0), c1, lane=DATA_LANE)
            recorder.add("pin", step, c1, h1, lane=DATA_LANE)
        else:
            recorder.add("collate", step, max(h0, c0), h1, lane=DATA_LANE)
    else:
        recorder.add("load", step, h0, h1, lane=DATA_LANE)


def record_steps(
    loader: Iterable[Any],
    to_device: ToDevice,
    train_step: StepFn,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    recorder: SpanRecorder | None = None,
    *,
    steps: int,
    start_step: int = 0,
    progress: Callable[..., None] | None = None,
) -> int:
    """Run ``steps`` steps of the reader's pipeline (the loader restarted when it runs out), each call in its own
    span of ``recorder`` (None: dropped, for warm-up): load (and collate), h2d (and normalize), then forward,
    backward and optimizer inside ``train_step``. The caller calls ``recorder.finish()``."""
    check_int("steps", steps, 0, 10**9)
    check_int("start_step", start_step, 0, 10**9)
    if steps == 0:
        return 0
    report, recorder = progress or no_progress, recorder if recorder is not None else SpanRecorder("cpu")
    lane = COMPUTE_LANE_GPU if recorder.cuda else COMPUTE_LANE_CPU
    pinning = bool(getattr(loader, "pin_memory", False)) and _can_pin()
    it = None
    with _collate_timer(loader) as timed, _phase_hooks(model, optimizer, recorder, lane) as begin:
        try:
            it = iter(loader)
            for step in range(start_step, start_step + steps):
                if timed is not None:
                    timed.last = None
                h0 = recorder.now()
                batch = next(it, None)
                if batch is None:  # the loader ran out: the next epoch begins
                    it = iter(loader)
                    if (batch := next(it, None)) is None:
                        raise ValueError(
                            "the loader yielded no batch; check the data set and the batch size "
                            "(with drop_last=True a data set smaller than one batch yields none)"
                        )
                x, y = batch
                _record_wait(recorder, step, h0, timed, pinning)
                with recorder.span("h2d", step, gpu=True, lane=COPY_LANE):
                    x, y = to_device(x, y)
                if x.dtype == torch.uint8:
                    with recorder.span("normalize", step, gpu=True, lane=lane):
                        x = to_float_normalized(x)
                begin("forward", step)
                train_step(model, optimizer, x, y)
                begin(None)
                report((step - start_step + 1) / steps, f"step {step - start_step + 1} of {steps}")
        finally:
            del it  # a loader with workers shuts them down when its iterator goes
    return steps


def lane_overlap(trace: SpanTrace, lane_a: str, lane_b: str) -> float:
    """Seconds both lanes of ``trace`` were busy at once (a GPU's naive loop: about one step of loading)."""
    spans = [s for s in trace.spans if s.lane in (lane_a, lane_b) and s.end > s.start]
    edges = sorted((t, d, s.lane) for s in spans for t, d in ((s.start, 1), (s.end, -1)))
    busy: Counter[str] = Counter()
    total, last = 0.0, 0.0
    for t, d, lane in edges:  # a sweep over every span's start and end
        if busy[lane_a] and busy[lane_b]:
            total += t - last
        busy[lane] += d
        last = t
    return total


def step_times(trace: SpanTrace) -> list[float]:
    """Each step's wall time, from its first span's start to the next step's; they add up to the trace's."""
    starts: dict[int, float] = {}
    end = 0.0
    for s in trace.spans:
        starts[s.step] = min(starts.get(s.step, s.start), s.start)
        end = max(end, s.end)
    order = sorted(starts.values())
    return [b - a for a, b in zip(order, [*order[1:], end])]


@dataclass
class Anatomy:
    """A few measured steps at one setting: phase means and step time (s per step), the bottleneck model's
    prediction, the spans and ``gflop_per_step`` (forward + backward, about 3x the forward pass)."""

    settings: dict[str, Any]
    phase_means: dict[str, float]
    step_time: float
    prediction: Prediction
    trace: SpanTrace
    gflop_per_step: float = 0.0

    @classmethod
    def of(cls, settings: dict[str, Any], trace: SpanTrace, gflop: float) -> "Anatomy":
        means, n = trace.phase_totals(), trace.steps()
        phase_means = {p: means[p] / n for p in PHASES if p in means}
        return cls(settings, phase_means, trace.wall_time() / n, predict_step_time(phase_means), trace, gflop)

    @property
    def samples_per_s(self) -> float:
        return self.settings["batch_size"] / self.step_time if self.step_time > 0 else float("nan")

    @property
    def dominant_phase(self) -> str:
        return max(self.phase_means, key=lambda k: self.phase_means[k])


_RANGES = dict(batch_size=(1, 1024), crop_size=(16, 512), steps=(1, 1000), warmup=(0, 100), num_workers=(0, 64))


def step_anatomy(
    *,
    batch_size: int = 32,
    crop_size: int = 64,
    width: int = 16,
    depth: int = 3,
    steps: int = 6,
    warmup: int = 2,
    device: torch.device | str = "cpu",
    num_workers: int = 0,
    data_root: Any = None,
    seed: int = 0,
    progress: Callable[..., None] | None = None,
    make_loader: Callable[[Any, int], Iterable[Any]] | None = None,
    to_device: ToDevice | None = None,
    train_step: StepFn | None = None,
) -> Anatomy:
    """A fresh model trained ``warmup`` then ``steps`` recorded steps (:func:`record_steps`); workers are shut
    down on return. The pipeline is the reader's where given (then the loader sets its own workers), else the
    baseline's: a shuffled ``timed_loader`` with ``num_workers``, a blocking copy and :func:`baseline_train_step`.
    """
    given = dict(batch_size=batch_size, crop_size=crop_size, steps=steps, warmup=warmup, num_workers=num_workers)
    for name, (lo, hi) in _RANGES.items():
        check_int(name, given[name], lo, hi)
    if make_loader is not None and num_workers != 0:
        raise ValueError(
            f"num_workers={num_workers}: with your own make_loader, the loader's workers are set "
            "inside make_loader; leave num_workers at 0"
        )
    device = torch.device(device)
    ds, model = _fresh_model(data_root, crop_size, width, depth, seed, device, batch_size)
    run = functools.partial(
        record_steps,
        to_device=to_device or (lambda x, y: blocking_copy((x, y), device)),
        train_step=train_step or baseline_train_step,
        model=model,
        optimizer=make_optimizer(model),
    )
    settings: dict[str, Any] = {"batch_size": batch_size, "crop_size": crop_size, "width": width, "depth": depth}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if make_loader is not None:
            loader = make_loader(ds, batch_size)
        else:
            workers: dict[str, Any] = {"num_workers": num_workers, "persistent_workers": num_workers > 0}
            loader = timed_loader(ds, batch_size, shuffle=True, seed=seed, drop_last=True, **workers)
        try:
            settings["num_workers"] = getattr(loader, "num_workers", num_workers)
            trace = _warm_then_record(loader, run, warmup, steps, progress or no_progress, device, settings)
        finally:
            del loader  # shuts persistent workers down
    yours = any(f is not None for f in (make_loader, to_device, train_step))
    settings.update(steps=steps, warmup=warmup, device=str(device), pipeline="yours" if yours else "helpers")
    return Anatomy.of(settings, trace, gflop=3 * flops_per_sample(model, crop_size) * batch_size / 1e9)


def _fresh_model(
    data_root: Any, crop_size: int, width: int, depth: int, seed: int, device: torch.device, batch: int
) -> tuple[ShapesDataset, nn.Module]:
    ds = ShapesDataset(data_root or make_shapes_dataset().train_dir, crop_size=crop_size, augment=True)
    model = build_model(width=width, depth=depth, num_classes=len(ds.classes), seed=seed).to(device)
    check_training_memory(model, crop_size, batch)  # refuse sizes that cannot fit, before allocating
    if len(ds) < batch:
        raise ValueError(f"the data set has fewer than batch_size={batch} images ({len(ds)}); lower the batch size")
    return ds, model


def _warm_then_record(
    loader: Iterable[Any],
    run: Callable[..., int],
    warmup: int,
    steps: int,
    report: Callable[..., None],
    device: torch.device,
    settings: dict[str, Any],
) -> SpanTrace:
    """``warmup`` steps dropped (first calls pay for lazy initialisation), then ``steps`` recorded."""
    total, width = warmup + steps, settings["width"]
    report(0.0, f"width {width}: {warmup} untimed warm-up step(s), then {steps} timed")
    warm = scaled(report, 0.0, warmup / total, f"width {width}, warm-up: ")
    run(loader, steps=warmup, progress=warm)
    rec = SpanRecorder(device, **settings)
    run(loader, recorder=rec, steps=steps, progress=scaled(report, warmup / total, 1.0, f"width {width}, timed: "))
    return rec.finish()
