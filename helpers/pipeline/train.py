"""The training loop, the timeline's phases and lanes, and the bottleneck model.

One training step has six phases, recorded with :class:`helpers.core.timing.SpanRecorder`:

========== ======================================================= ==============
phase      what happens                                            timeline lane
========== ======================================================= ==============
load       the loader reads, decodes and augments the images       data (CPU)
collate    the per-image tensors are stacked into one batch        data (CPU)
h2d        the batch is copied host -> device (a no-op on CPU)     copy (link)
forward    model(x) (and, in :func:`train_epoch`, the loss)        compute (GPU)
backward   loss.backward() (in record_steps: the loss too)         compute (GPU)
optimizer  optimizer.step() (and zero_grad in :func:`train_epoch`) compute (GPU)
========== ======================================================= ==============

On a CUDA device the copy and compute phases are timed with CUDA events (what
the GPU did, when); on the CPU every phase is wall-clock time and the compute
lane is called "compute (CPU)".

(plus ``normalize`` when the batch arrives as uint8 and is converted on the
device, and ``pin`` when a ``pin_memory=True`` loader pins the batch in the main
process on a CUDA machine). "collate" is split out of "load" only when the loader runs in the main
process (``num_workers=0``) and its collate function is timed (:class:`helpers.pipeline.data.TimedCollate`;
:func:`~helpers.chapters.ch01.anatomy.record_steps` wraps a plain loader's collate function in one for the
duration of the run); with workers, "load" is the time the main process *waits* for the next batch.

Chapter 01's step anatomy (:func:`~helpers.chapters.ch01.anatomy.record_steps`: the reader's loader,
``to_device`` and ``train_step`` timed phase by phase; :func:`~helpers.chapters.ch01.anatomy.step_anatomy`, the
live panel's and benchmark's short run; ``lane_overlap``, ``step_times``) is in :mod:`helpers.chapters.ch01.anatomy`.

Public API (stable; later chapters rely on it):

``train_epoch(model, loader, device, optimizer, *, recorder=None, transfer="blocking", ...) -> EpochStats``
``evaluate(model, loader, device, *, transfer="blocking", max_batches=None) -> float``
``make_optimizer(model, lr=3e-3) -> torch.optim.Optimizer``
``fit(model, train_loader, val_loader, device, *, epochs, ...) -> list[EpochStats]``
``predict_step_time(phase_times) -> Prediction``  (the bottleneck model)
``STAGES``, ``DATA_LANE``, ``COPY_LANE``, ``COMPUTE_LANE_GPU``, ``COMPUTE_LANE_CPU``  (the timeline's stages and lanes)

The ``transfer="blocking"`` / ``"non_blocking"`` copies of :func:`train_epoch` and :func:`evaluate` are the
workbook's one batch mover, :func:`helpers.pipeline.prefetch.move_batch`. Chapter 01's live panel, its
headless benchmark (keys ``ch01.*``) and its recorded GPU breakdown are in :mod:`helpers.chapters.ch01`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

import torch
from torch import nn

from ..core.progress import no_progress
from ..core.timing import SpanRecorder
from ..core.validate import check_choice, check_float, check_int
from .data import TimedCollate, to_float_normalized
from .prefetch import move_batch

__all__ = [
    "STAGES",
    "DATA_LANE",
    "COPY_LANE",
    "COMPUTE_LANE_GPU",
    "COMPUTE_LANE_CPU",
    "EpochStats",
    "Prediction",
    "make_optimizer",
    "train_epoch",
    "evaluate",
    "fit",
    "predict_step_time",
]


#: The resources of the bottleneck model and the phases each one runs.
STAGES: dict[str, tuple[str, ...]] = {
    "data (CPU)": ("load", "collate", "pin"),
    "copy (link)": ("h2d",),
    "compute (device)": ("normalize", "forward", "backward", "optimizer"),
}

#: Timeline lanes (rows of a Gantt chart): the resource each phase occupies.
DATA_LANE = "data (CPU)"
COPY_LANE = "copy (link)"
COMPUTE_LANE_GPU = "compute (GPU)"
COMPUTE_LANE_CPU = "compute (CPU)"

Transfer = Callable[[Any, torch.device], tuple[torch.Tensor, torch.Tensor]]


def _blocking(batch: Any, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``transfer="blocking"``: the batch's ``(x, y)`` to ``device`` with a blocking ``Tensor.to`` (the baseline)."""
    x, y = move_batch((batch[0], batch[1]), device, non_blocking=False)
    return x, y


def _non_blocking(batch: Any, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``transfer="non_blocking"``: ``Tensor.to(device, non_blocking=True)`` (asynchronous only towards CUDA)."""
    x, y = move_batch((batch[0], batch[1]), device, non_blocking=True)
    return x, y


def _resolve_transfer(transfer: str | Transfer) -> Transfer:
    """The copy a ``transfer`` argument names; both named ones are the workbook's one batch mover,
    :func:`helpers.pipeline.prefetch.move_batch`, over the batch's first two entries."""
    if callable(transfer):
        return transfer
    check_choice("transfer", transfer, ("blocking", "non_blocking"))
    return _blocking if transfer == "blocking" else _non_blocking


def make_optimizer(model: nn.Module, lr: float = 3e-3, weight_decay: float = 0.0) -> torch.optim.Optimizer:
    """Adam with the workbook's default learning rate (reaches good accuracy in a few epochs)."""
    check_float("lr", lr, 1e-7, 10.0)
    check_float("weight_decay", weight_decay, 0.0, 1.0)
    return torch.optim.Adam(model.parameters(), lr=lr, weight_decay=weight_decay)


@dataclass
class EpochStats:
    """What one call of :func:`train_epoch` did.

    Attributes:
        steps: optimizer steps taken.
        samples: training samples seen.
        seconds: wall-clock time of the epoch (synchronised at the end).
        loss: mean training loss.
        accuracy: training accuracy on the augmented batches (0-1).
        val_accuracy: filled in by :func:`fit` after evaluation, else None.
    """

    steps: int
    samples: int
    seconds: float
    loss: float
    accuracy: float
    val_accuracy: float | None = None

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.seconds if self.seconds > 0 else float("nan")


def _can_pin() -> bool:
    """Whether a ``pin_memory=True`` loader really pins here (it needs a CUDA device)."""
    return torch.cuda.is_available()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _record_wait(recorder: SpanRecorder, step: int, h0: float, timed: TimedCollate | None, pinning: bool) -> None:
    """Record the wait for one batch, from ``h0`` until now: load, and collate (and pin) when they are known.

    ``timed`` is the loader's :class:`TimedCollate` when it runs in this process (then ``timed.last``
    says when the batch was collated, on this process's clock); ``pinning``: the loader pins the
    batch in this process right after collating it (``pin_memory=True`` on a CUDA machine).
    """
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


def train_epoch(
    model: nn.Module,
    loader: Iterable[Any],
    device: torch.device | str,
    optimizer: torch.optim.Optimizer,
    *,
    recorder: SpanRecorder | None = None,
    transfer: str | Transfer = "blocking",
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    max_steps: int | None = None,
    start_step: int = 0,
    progress: Callable[..., None] | None = None,
) -> EpochStats:
    """Train ``model`` for one pass over ``loader`` (or ``max_steps`` steps).

    Args:
        model: already on ``device``.
        loader: yields ``(x, y)`` batches; ``x`` float (normalised) or uint8
            (then converted with :func:`helpers.pipeline.data.to_float_normalized` after the copy).
        device: where the model lives.
        optimizer: e.g. :func:`make_optimizer`.
        recorder: if given, every phase of every step is recorded as a span
            (steps numbered from ``start_step``). The caller calls ``recorder.finish()``.
        transfer: ``"blocking"`` (``x.to(device)``: the baseline), ``"non_blocking"``
            (``x.to(device, non_blocking=True)``), or a callable ``(batch, device) -> (x, y)``.
        loss_fn: default ``nn.functional.cross_entropy``.
        max_steps: stop after this many steps (default: the whole loader).
        start_step: number of the first step in the recorder.
        progress: ``progress(fraction, text)`` (see :mod:`helpers.core.progress`), told
            after every step (host-side only: it never waits for the device).

    The loss and accuracy are accumulated on the device, so nothing forces a
    host-device synchronisation inside the loop.
    """
    device = torch.device(device)
    move = _resolve_transfer(transfer)
    loss_fn = loss_fn or nn.functional.cross_entropy
    if max_steps is not None:
        check_int("max_steps", max_steps, 0, 10**9)
    check_int("start_step", start_step, 0, 10**9)
    collate = getattr(loader, "collate_fn", None)
    timed = collate if isinstance(collate, TimedCollate) and getattr(loader, "num_workers", 1) == 0 else None
    pinning = bool(getattr(loader, "pin_memory", False)) and _can_pin()

    compute_lane = COMPUTE_LANE_GPU if (recorder is not None and recorder.cuda) else COMPUTE_LANE_CPU

    def span(name: str, step: int, lane: str) -> Any:
        if recorder is None:
            return _NULL
        return recorder.span(name, step, gpu=True, lane=lane)

    try:
        planned = len(loader)  # type: ignore[arg-type]
    except TypeError:  # an iterable without a length
        planned = 0
    if max_steps is not None:
        planned = min(planned, max_steps) if planned else max_steps

    model.train()
    total_loss = torch.zeros((), device=device)
    correct = torch.zeros((), device=device, dtype=torch.long)
    samples = steps = 0
    t_start = time.perf_counter()
    it = iter(loader)
    while max_steps is None or steps < max_steps:
        step = start_step + steps
        # --- load (and collate): wait for the next batch from the loader ---
        if timed is not None:
            timed.last = None
        h0 = recorder.now() if recorder is not None else 0.0
        try:
            batch = next(it)
        except StopIteration:
            break
        if recorder is not None:
            _record_wait(recorder, step, h0, timed, pinning)
        # --- host to device copy ---
        with span("h2d", step, COPY_LANE):
            x, y = move(batch, device)
        if x.dtype == torch.uint8:
            with span("normalize", step, compute_lane):
                x = to_float_normalized(x)
        # --- forward, backward, optimizer ---
        with span("forward", step, compute_lane):
            logits = model(x)
            loss = loss_fn(logits, y)
            total_loss += loss.detach() * y.shape[0]
            correct += (logits.detach().argmax(1) == y).sum()
        with span("backward", step, compute_lane):
            loss.backward()
        with span("optimizer", step, compute_lane):
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        samples += int(y.shape[0])
        steps += 1
        if progress is not None:
            progress(steps / planned if planned else 0.0, f"step {steps} of {planned}" if planned else f"step {steps}")
    del it
    _sync(device)
    seconds = time.perf_counter() - t_start
    n = max(samples, 1)
    return EpochStats(
        steps=steps,
        samples=samples,
        seconds=seconds,
        loss=float(total_loss.item()) / n,
        accuracy=float(correct.item()) / n,
    )


class _NullContext:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


_NULL = _NullContext()


# ---------------------------------------------------------------------------
# Evaluating, and the whole loop
# ---------------------------------------------------------------------------


@torch.no_grad()
def evaluate(
    model: nn.Module,
    loader: Iterable[Any],
    device: torch.device | str,
    *,
    transfer: str | Transfer = "blocking",
    max_batches: int | None = None,
    progress: Callable[..., None] | None = None,
) -> float:
    """Top-1 accuracy (0-1) of ``model`` over ``loader`` (in eval mode; restores the mode after).

    ``max_batches`` scores only the loader's *first* batches. A validation loader goes over its data set in
    order, and a class-folder data set lists its classes in order, so those batches hold the first classes
    only: for a shorter evaluation, give a loader over a subset spread evenly over the data set (``n`` items:
    indices ``i * len(dataset) // n``, as chapter 07's job does), not ``max_batches``.

    ``progress(fraction, text)`` is told after every batch (a loader without ``len`` moves it only at the end).

    Raises:
        ValueError: if the loader yields no samples.
    """
    device = torch.device(device)
    move = _resolve_transfer(transfer)
    if max_batches is not None:
        check_int("max_batches", max_batches, 1, 10**9)
    report = progress or no_progress
    try:
        total: int | None = len(loader)  # type: ignore[arg-type]
    except TypeError:  # a generator, or a DataLoader over an IterableDataset without __len__
        total = None
    if total is not None and max_batches is not None:
        total = min(total, max_batches)
    was_training = model.training
    model.eval()
    correct = torch.zeros((), device=device, dtype=torch.long)
    seen = 0
    try:
        for i, batch in enumerate(loader):
            if max_batches is not None and i >= max_batches:
                break
            x, y = move(batch, device)
            if x.dtype == torch.uint8:
                x = to_float_normalized(x)
            correct += (model(x).argmax(1) == y).sum()
            seen += int(y.shape[0])
            if total:
                report(min(1.0, (i + 1) / total), f"validation batch {i + 1} of {total}")
    finally:
        model.train(was_training)
    if seen == 0:
        raise ValueError("the evaluation loader yielded no samples; check the data set and batch size")
    report(1.0, f"validated {seen} images")
    return float(correct.item()) / seen


def fit(
    model: nn.Module,
    train_loader: Iterable[Any],
    val_loader: Iterable[Any] | None,
    device: torch.device | str,
    *,
    epochs: int,
    optimizer: torch.optim.Optimizer | None = None,
    recorder: SpanRecorder | None = None,
    transfer: str | Transfer = "blocking",
) -> list[EpochStats]:
    """Train for ``epochs`` epochs, evaluating after each; returns one :class:`EpochStats` per epoch."""
    check_int("epochs", epochs, 1, 10_000)
    optimizer = optimizer or make_optimizer(model)
    history: list[EpochStats] = []
    step = 0
    for _ in range(epochs):
        stats = train_epoch(
            model, train_loader, device, optimizer, recorder=recorder, transfer=transfer, start_step=step
        )
        step += stats.steps
        if val_loader is not None:
            stats.val_accuracy = evaluate(model, val_loader, device, transfer=transfer)
        history.append(stats)
    return history


# ---------------------------------------------------------------------------
# The bottleneck model
# ---------------------------------------------------------------------------


@dataclass
class Prediction:
    """Step time predicted from phase times by the bottleneck model.

    Attributes:
        stage_times: seconds per step of each resource (:data:`STAGES`).
        serial: sum of all phases: the step time when nothing overlaps.
        overlapped: the slowest stage: the step time when all stages overlap perfectly.
        bottleneck: name of the slowest stage.
    """

    stage_times: dict[str, float]
    serial: float
    overlapped: float
    bottleneck: str

    def speedup_bound(self) -> float:
        """How much faster perfect overlap could make a step (serial / overlapped)."""
        return self.serial / self.overlapped if self.overlapped > 0 else float("nan")

    @property
    def one_step_overlap(self) -> float:
        """The naive loop's step on a GPU: copy + max(data, compute).

        CUDA kernel launches are asynchronous: once the CPU has queued step i's
        forward, backward and optimizer, it goes on to load batch i+1 while the
        GPU still computes step i; the next blocking ``x.to(device)`` then waits
        for the GPU. So data (CPU) overlaps compute (GPU) by one step for free,
        and the copy overlaps nothing. On a CPU the same cores do both and the
        naive loop pays :attr:`serial`. Needs the default :data:`STAGES` names
        (falls back to :attr:`serial` otherwise).
        """
        names = list(STAGES)
        if not all(n in self.stage_times for n in names):
            return self.serial
        data, copy, compute = (self.stage_times[n] for n in names)
        rest = sum(v for k, v in self.stage_times.items() if k not in names)
        return copy + max(data, compute) + rest


def predict_step_time(
    phase_times: Mapping[str, float], stages: Mapping[str, Iterable[str]] | None = None
) -> Prediction:
    """Predict the step time from per-step phase times (seconds).

    ``serial`` adds every phase (a naive loop: one thing at a time);
    ``overlapped`` is the slowest stage (a perfect pipeline: every resource works
    on a different step at once). Phases not named in ``stages`` count as their
    own stage.
    """
    stages = dict(STAGES if stages is None else stages)
    for name, value in phase_times.items():
        if value < 0 or value != value:
            raise ValueError(f"phase time {name!r} must be a non-negative number, got {value}")
    stage_times: dict[str, float] = {}
    named: set[str] = set()
    for stage, phases in stages.items():
        ph = tuple(phases)
        named.update(ph)
        stage_times[stage] = float(sum(phase_times.get(p, 0.0) for p in ph))
    for name, value in phase_times.items():
        if name not in named:
            stage_times[name] = float(value)
    if not stage_times:
        raise ValueError("phase_times is empty")
    bottleneck = max(stage_times, key=lambda k: stage_times[k])
    return Prediction(
        stage_times=stage_times,
        serial=float(sum(phase_times.values())),
        overlapped=stage_times[bottleneck],
        bottleneck=bottleneck,
    )
