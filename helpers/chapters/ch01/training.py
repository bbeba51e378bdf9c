"""Chapter 01's training loop: one epoch with every phase recorded, evaluation, and the two together.

``train_epoch(model, loader, device, optimizer, *, recorder=None, transfer="blocking", ...) -> EpochStats``
``evaluate(model, loader, device, *, transfer="blocking", max_batches=None) -> float``
``fit(model, train_loader, val_loader, device, *, epochs, ...) -> list[EpochStats]``

The ``transfer="blocking"`` / ``"non_blocking"`` copies of :func:`train_epoch` and :func:`evaluate` are the
workbook's one batch mover, :func:`helpers.pipeline.prefetch.move_batch`. The phases, their lanes and the
bottleneck model are shared, in :mod:`helpers.pipeline.train`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch
from torch import nn

from ...core.progress import no_progress
from ...core.timing import SpanRecorder
from ...core.validate import check_choice, check_int
from ...pipeline.data import TimedCollate, to_float_normalized
from ...pipeline.prefetch import move_batch
from ...pipeline.train import (
    COMPUTE_LANE_CPU,
    COMPUTE_LANE_GPU,
    COPY_LANE,
    DATA_LANE,
    make_optimizer,
)

__all__ = [
    "EpochStats",
    "train_epoch",
    "evaluate",
    "fit",
]


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
