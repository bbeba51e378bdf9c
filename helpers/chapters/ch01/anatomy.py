"""Chapter 01's step anatomy: the reader's training step timed phase by phase, and what the timeline shows.

**What is timed is what is shown.** :func:`record_steps` times the reader's own objects: it calls
``next()`` on the reader's loader, the reader's ``to_device(x, y)`` and the reader's
``train_step(model, optimizer, x, y)``, and splits the step into forward / backward / optimizer
with two PyTorch hooks (``model.register_forward_hook``: ``model(x)`` has returned;
``optimizer.register_step_pre_hook``: ``optimizer.step()`` begins). :func:`step_anatomy` (and through
it chapter 01's live panel, :func:`helpers.chapters.ch01.panel_run`) takes the reader's ``make_loader``,
``to_device`` and ``train_step`` and runs them through :func:`record_steps`; without them (the headless
benchmark) it uses the baseline of chapter 01 (:func:`baseline_train_step`, a blocking ``Tensor.to``,
:func:`helpers.pipeline.loaders.timed_loader`).

``record_steps(loader, to_device, train_step, model, optimizer, recorder=None, *, steps, ...) -> int``
    (the reader's pipeline, timed phase by phase)
``baseline_train_step(model, optimizer, x, y) -> Tensor``  (chapter 01's train_step, for callers without a notebook)
``step_anatomy(*, batch_size, crop_size, width, ..., make_loader=, to_device=, train_step=) -> Anatomy``
    (a few measured steps of a fresh model; the thin/wide regimes and the live panel call it)
``lane_overlap(trace, lane_a, lane_b) -> float``  (seconds two timeline lanes were busy at once)
``step_times(trace) -> list[float]``  (each recorded step's wall time; their mean is the measured step time)

The phases, their lanes and the bottleneck model (:func:`~helpers.pipeline.train.predict_step_time`) are shared,
in :mod:`helpers.pipeline.train`.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator

import torch
from torch import nn

from ...core.progress import no_progress, scaled
from ...core.timing import SpanRecorder, SpanTrace
from ...core.validate import check_int
from ...pipeline.data import ShapesDataset, TimedCollate, make_shapes_dataset, to_float_normalized
from ...pipeline.loaders import timed_loader
from ...pipeline.models import build_model, check_training_memory, flops_per_sample
from ...pipeline.train import (
    COMPUTE_LANE_CPU,
    COMPUTE_LANE_GPU,
    COPY_LANE,
    Prediction,
    make_optimizer,
    predict_step_time,
)
from .training import _NULL, Transfer, _can_pin, _record_wait, _resolve_transfer

__all__ = [
    "PHASES",
    "baseline_train_step",
    "record_steps",
    "lane_overlap",
    "step_times",
    "Anatomy",
    "step_anatomy",
]


#: Phase names in step order (``pin`` only for pinning loaders, ``normalize`` only for uint8 batches).
PHASES: tuple[str, ...] = ("load", "collate", "pin", "h2d", "normalize", "forward", "backward", "optimizer")


ToDevice = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


StepFn = Callable[[nn.Module, torch.optim.Optimizer, torch.Tensor, torch.Tensor], Any]


def baseline_train_step(
    model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor
) -> torch.Tensor:
    """Chapter 01's ``train_step``, for callers that have no notebook (the benchmark, the tests).

    The same four lines as the chapter's pipeline cell (a test runs both and compares the weights):
    forward and loss, ``zero_grad``, backward, optimizer step. Returns the loss without reading it,
    so that nothing waits for the GPU.
    """
    loss = nn.functional.cross_entropy(model(x), y)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return loss.detach()


def _baseline_to_device(device: torch.device, transfer: str | Transfer) -> ToDevice:
    """``to_device(x, y)`` for :func:`step_anatomy` without the reader's: ``transfer`` to ``device``."""
    move = _resolve_transfer(transfer)

    def to_device(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return move((x, y), device)

    to_device.__name__ = transfer if isinstance(transfer, str) else getattr(transfer, "__name__", "custom")
    return to_device


class _StepMarks:
    """The spans inside one call of the reader's ``train_step``: one open at a time, switched by hooks."""

    def __init__(self, recorder: SpanRecorder | None, lane: str) -> None:
        self.recorder, self.lane, self.step = recorder, lane, 0
        self._open: Any = None

    def begin(self, name: str) -> None:
        """Close the open span (if any) and open phase ``name`` of :attr:`step`."""
        self.end()
        if self.recorder is not None:
            span = self.recorder.span(name, self.step, gpu=True, lane=self.lane)
            span.__enter__()
            self._open = span

    def end(self) -> None:
        span, self._open = self._open, None
        if span is not None:
            span.__exit__(None, None, None)


@contextlib.contextmanager
def _phase_hooks(model: nn.Module, optimizer: torch.optim.Optimizer, marks: _StepMarks) -> Iterator[None]:
    """While active, ``model(x)`` returning begins "backward" and ``optimizer.step()`` beginning begins "optimizer".

    PyTorch's own hooks, removed on exit: they run on the host, in order with the calls of the step,
    so on a GPU the CUDA events they record sit in the stream between the kernels of the two phases.
    """
    handles = [
        model.register_forward_hook(lambda module, args, output: marks.begin("backward")),
        optimizer.register_step_pre_hook(lambda opt, args, kwargs: marks.begin("optimizer")),
    ]
    try:
        yield
    finally:
        marks.end()
        for h in handles:
            h.remove()


@contextlib.contextmanager
def _collate_timer(loader: Iterable[Any]) -> Iterator[TimedCollate | None]:
    """The loader's collate function with a clock around it, when it runs in this process; else None.

    A ``DataLoader`` with ``num_workers=0`` and a plain collate function gets it wrapped in a
    :class:`helpers.pipeline.data.TimedCollate` (the same function, called with the same batch, with a clock
    reading before and after) until the block ends; then the original is put back. A loader whose
    collate function is already a ``TimedCollate`` is used as it is.
    """
    collate = getattr(loader, "collate_fn", None)
    if collate is None or getattr(loader, "num_workers", 1) != 0:
        yield None
    elif isinstance(collate, TimedCollate):
        yield collate
    elif isinstance(loader, torch.utils.data.DataLoader):
        timed = TimedCollate(collate)
        loader.collate_fn = timed  # read by the next iter(loader)
        try:
            yield timed
        finally:
            loader.collate_fn = collate
    else:
        yield None


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
    """Run ``steps`` steps of the reader's pipeline; with a ``recorder``, record every phase as a span.

    Each step makes the calls of chapter 01's loop, one at a time so that each gets its own span::

        x, y = next(it)                              # load (and collate): it = iter(loader)
        x, y = to_device(x, y)                       # h2d
        loss = train_step(model, optimizer, x, y)    # forward | backward | optimizer

    which is what ``for x, y in batches(loader): loss = train_step(model, optimizer, x, y)`` does.
    Nothing here is a copy of the reader's code: ``train_step`` runs as written, and two PyTorch
    hooks, active only during this call, mark where its phases meet: ``model.register_forward_hook``
    (``model(x)`` has returned: "forward" ends, "backward" begins) and
    ``optimizer.register_step_pre_hook`` (``optimizer.step()`` begins: "optimizer" begins, until
    ``train_step`` returns). So the loss (computed after ``model(x)``; microseconds) and ``zero_grad``
    count as part of "backward". On a CUDA device these spans, and "h2d", are CUDA events: what the GPU
    did, when. "collate" is split from "load" when the loader collates in this process (see
    :func:`_collate_timer`). A ``to_device`` that hands over uint8 batches gets a "normalize" span
    (:func:`helpers.pipeline.data.to_float_normalized`, on the device).

    When the loader runs out before ``steps`` steps, the next epoch begins (a new iterator; its start
    is part of that step's "load"). Steps are numbered from ``start_step``; the caller calls
    ``recorder.finish()``. ``progress(fraction, text)`` is told after every step (host side only).

    Returns:
        the number of steps run (``steps``).

    Raises:
        ValueError: for a bad ``steps``/``start_step``, or a loader that yields no batch at all.
    """
    check_int("steps", steps, 0, 10**9)
    check_int("start_step", start_step, 0, 10**9)
    if steps == 0:
        return 0
    report = progress or no_progress
    compute_lane = COMPUTE_LANE_GPU if (recorder is not None and recorder.cuda) else COMPUTE_LANE_CPU
    marks = _StepMarks(recorder, compute_lane)
    pinning = bool(getattr(loader, "pin_memory", False)) and _can_pin()

    def span(name: str, step: int, lane: str) -> Any:
        return _NULL if recorder is None else recorder.span(name, step, gpu=True, lane=lane)

    it = None
    with contextlib.ExitStack() as stack:
        timed = stack.enter_context(_collate_timer(loader)) if recorder is not None else None
        if recorder is not None:
            stack.enter_context(_phase_hooks(model, optimizer, marks))
        try:
            it = iter(loader)
            for done in range(steps):
                step = start_step + done
                if timed is not None:
                    timed.last = None
                h0 = recorder.now() if recorder is not None else 0.0
                batch = next(it, None)
                if batch is None:  # the loader ran out: the next epoch begins
                    it = iter(loader)
                    batch = next(it, None)
                    if batch is None:
                        raise ValueError(
                            "the loader yielded no batch; check the data set and the batch size "
                            "(with drop_last=True a data set smaller than one batch yields none)"
                        )
                if recorder is not None:
                    _record_wait(recorder, step, h0, timed, pinning)
                x, y = batch
                with span("h2d", step, COPY_LANE):
                    x, y = to_device(x, y)
                if x.dtype == torch.uint8:
                    with span("normalize", step, compute_lane):
                        x = to_float_normalized(x)
                marks.step = step
                marks.begin("forward")
                train_step(model, optimizer, x, y)
                marks.end()
                report((done + 1) / steps, f"step {done + 1} of {steps}")
        finally:
            marks.end()
            del it  # a loader with workers shuts them down when its iterator goes
    return steps


def lane_overlap(trace: SpanTrace, lane_a: str, lane_b: str) -> float:
    """Seconds during which both lanes of ``trace`` were busy at once (0 when they took turns).

    On a GPU, the data lane (host clock) and the compute lane (CUDA events) of the
    naive loop overlap by about one step's worth of loading: the CPU loads batch
    i+1 while the GPU computes step i. On a CPU the two take turns, and this is 0
    up to clock rounding.
    """

    def merged(lane: str) -> list[tuple[float, float]]:
        spans = sorted((s.start, s.end) for s in trace.spans if s.lane == lane and s.end > s.start)
        out: list[tuple[float, float]] = []
        for a, b in spans:
            if out and a <= out[-1][1]:
                out[-1] = (out[-1][0], max(out[-1][1], b))
            else:
                out.append((a, b))
        return out

    xs, ys = merged(lane_a), merged(lane_b)
    total, i, j = 0.0, 0, 0
    while i < len(xs) and j < len(ys):
        lo, hi = max(xs[i][0], ys[j][0]), min(xs[i][1], ys[j][1])
        if hi > lo:
            total += hi - lo
        if xs[i][1] < ys[j][1]:
            i += 1
        else:
            j += 1
    return total


def step_times(trace: SpanTrace) -> list[float]:
    """Each recorded step's wall time, in step order: from its first span's start to the next step's.

    The last step ends with its last span. The times add up to ``trace.wall_time()``, so their mean is
    the measured step time (``trace.wall_time() / trace.steps()``), and their range is the spread a
    prediction of the step is held against (chapter 01, :func:`helpers.chapters.ch01.step_verdict`).
    """
    starts: dict[int, float] = {}
    end = 0.0
    for s in trace.spans:
        starts[s.step] = min(starts.get(s.step, s.start), s.start)
        end = max(end, s.end)
    order = sorted(starts.values())
    return [b - a for a, b in zip(order, [*order[1:], end])]


@dataclass
class Anatomy:
    """Phase times of a few measured training steps at one setting.

    Attributes:
        settings: the arguments of the run (batch size, crop size, width, ...).
        phase_means: mean seconds per step of each phase, in step order.
        step_time: measured seconds per step (wall time of the timed steps / steps).
        prediction: the bottleneck model's prediction from ``phase_means``.
        trace: the recorded spans (for timelines).
        gflop_per_step: forward+backward GFLOP of one step (about 3x the forward pass).
    """

    settings: dict[str, Any]
    phase_means: dict[str, float]
    step_time: float
    prediction: Prediction
    trace: SpanTrace
    gflop_per_step: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def samples_per_s(self) -> float:
        return self.settings["batch_size"] / self.step_time if self.step_time > 0 else float("nan")

    @property
    def dominant_phase(self) -> str:
        """The phase with the largest mean time."""
        return max(self.phase_means, key=lambda k: self.phase_means[k])


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
    output: str = "float",
    transfer: str | Transfer = "blocking",
    data_root: Any = None,
    seed: int = 0,
    progress: Callable[..., None] | None = None,
    make_loader: Callable[[Any, int], Iterable[Any]] | None = None,
    to_device: ToDevice | None = None,
    train_step: StepFn | None = None,
) -> Anatomy:
    """Train a fresh model ``warmup`` untimed then ``steps`` timed steps; return the phase times.

    Builds the data set (on ``data_root`` or the default generated one), a model
    (:func:`helpers.pipeline.models.build_model`) and Adam from the arguments, so a live panel can call it
    with slider values, then runs the steps with :func:`record_steps`. Workers (if any) are shut
    down on return.

    The pipeline is the reader's when given (chapter 01 passes the functions its cells define):
    ``make_loader(dataset, batch_size)``, ``to_device(x, y)``, ``train_step(model, optimizer, x, y)``.
    Without them (the headless benchmark): :func:`helpers.pipeline.loaders.timed_loader` (shuffled with ``seed``,
    ``drop_last=True``, ``num_workers`` workers, timed collate), ``transfer`` to ``device``, and
    :func:`baseline_train_step`.

    Args:
        batch_size: 1-1024. crop_size: 16-512 (the image size the model sees).
        width / depth: model knobs (see :class:`helpers.pipeline.models.SmallCNN`).
        steps: timed steps (1-1000). warmup: untimed steps first (0-100).
        device: where the model runs (the reader's ``to_device`` must copy there).
        num_workers: loader workers for the default loader (0: the baseline); with the reader's
            ``make_loader`` it must stay 0 (the reader's loader sets its own workers).
        output: ``"float"`` or ``"uint8"`` batches.
        transfer: the default copy, ``"blocking"`` or ``"non_blocking"`` (ignored with the reader's ``to_device``).
        data_root: a class-folder root (e.g. ``info.train_dir``); default: the
            training split of ``make_shapes_dataset()``.
        seed: seeds the model, the shuffling of the default loader and the augmentation.
        progress: ``progress(fraction, text)`` (see :mod:`helpers.core.progress`), told after every step.
        make_loader / to_device / train_step: the reader's pipeline functions (see above).

    The default loader with workers is built by :func:`helpers.pipeline.loaders.timed_loader`, i.e. by
    :func:`helpers.pipeline.loaders.build_loader`, which checks /dev/shm and sets a timeout.
    """
    check_int("batch_size", batch_size, 1, 1024)
    check_int("crop_size", crop_size, 16, 512)
    check_int("steps", steps, 1, 1000)
    check_int("warmup", warmup, 0, 100)
    check_int("num_workers", num_workers, 0, 64)
    if make_loader is not None and num_workers != 0:
        raise ValueError(
            f"num_workers={num_workers}: with your own make_loader, the loader's workers are set "
            "inside make_loader; leave num_workers at 0"
        )
    device = torch.device(device)
    report = progress or no_progress
    root = data_root if data_root is not None else make_shapes_dataset().train_dir
    ds = ShapesDataset(root, crop_size=crop_size, augment=True, output=output)
    model = build_model(width=width, depth=depth, num_classes=len(ds.classes), seed=seed).to(device)
    check_training_memory(model, crop_size, batch_size)  # refuse sizes that cannot fit, before allocating
    if len(ds) < batch_size:
        raise ValueError(
            f"the data set has fewer than batch_size={batch_size} images ({len(ds)}); lower the batch size"
        )
    opt = make_optimizer(model)
    move = to_device if to_device is not None else _baseline_to_device(device, transfer)
    step_fn = train_step if train_step is not None else baseline_train_step
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if make_loader is not None:
            loader = make_loader(ds, batch_size)
        else:
            loader = timed_loader(
                ds,
                batch_size,
                shuffle=True,
                seed=seed,
                num_workers=num_workers,
                drop_last=True,
                persistent_workers=num_workers > 0,
            )
        try:
            total = warmup + steps
            report(0.0, f"width {width}: {warmup} untimed warm-up step(s), then {steps} timed")
            # untimed: first calls pay for lazy initialisation
            record_steps(
                loader,
                move,
                step_fn,
                model,
                opt,
                steps=warmup,
                progress=scaled(report, 0.0, warmup / total, f"width {width}, warm-up: "),
            )
            rec = SpanRecorder(
                device,
                batch_size=batch_size,
                crop_size=crop_size,
                width=width,
                depth=depth,
                num_workers=getattr(loader, "num_workers", num_workers),
                output=output,
            )
            record_steps(
                loader,
                move,
                step_fn,
                model,
                opt,
                rec,
                steps=steps,
                progress=scaled(report, warmup / total, 1.0, f"width {width}, timed: "),
            )
            trace = rec.finish()
        finally:
            workers = getattr(loader, "num_workers", num_workers)
            del loader  # shuts persistent workers down
    means = trace.phase_totals()
    n = trace.steps()
    phase_means = {p: means[p] / n for p in PHASES if p in means}
    step_time = trace.wall_time() / n
    flops = flops_per_sample(model, crop_size)
    settings = {
        "batch_size": batch_size,
        "crop_size": crop_size,
        "width": width,
        "depth": depth,
        "steps": steps,
        "warmup": warmup,
        "device": str(device),
        "num_workers": workers,
        "output": output,
        "transfer": getattr(move, "__name__", "custom"),
        "pipeline": "yours" if any(f is not None for f in (make_loader, to_device, train_step)) else "helpers",
    }
    return Anatomy(
        settings=settings,
        phase_means=phase_means,
        step_time=step_time,
        prediction=predict_step_time(phase_means),
        trace=trace,
        gflop_per_step=3 * flops * batch_size / 1e9,
    )
