"""Chapter 01's evaluation, and the blocking batch copy its recorded steps share."""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch
from torch import nn

from ...core.progress import no_progress
from ...pipeline.data import to_float_normalized
from ...pipeline.prefetch import move_batch


def blocking_copy(batch: Any, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch's ``(x, y)`` on ``device``, copied blocking (the baseline's) by the workbook's one batch mover."""
    x, y = move_batch((batch[0], batch[1]), device, non_blocking=False)
    return x, y


@torch.no_grad()
def evaluate(
    model: nn.Module, loader: Iterable[Any], device: torch.device | str, *, progress: Callable[..., None] | None = None
) -> float:
    """Top-1 accuracy (0-1) of ``model`` over every batch of ``loader``, in eval mode (restored after). A shorter
    evaluation needs an evenly spread subset: a class-folder data set read in order starts with one class."""
    device = torch.device(device)
    report = progress or no_progress
    try:
        total: int | None = len(loader)  # type: ignore[arg-type]
    except TypeError:  # a generator, or a DataLoader over an IterableDataset without __len__
        total = None
    was_training = model.training
    model.eval()
    correct = torch.zeros((), device=device, dtype=torch.long)
    seen = 0
    try:
        for i, batch in enumerate(loader):
            x, y = blocking_copy(batch, device)
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
