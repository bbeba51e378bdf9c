"""The timeline's phases and lanes, the optimizer, and the bottleneck model (chapters 01 and 06).

One training step has six phases, recorded with :class:`helpers.core.timing.SpanRecorder`:

========== ======================================================= ==============
phase      what happens                                            timeline lane
========== ======================================================= ==============
load       the loader reads, decodes and augments the images       data (CPU)
collate    the per-image tensors are stacked into one batch        data (CPU)
h2d        the batch is copied host -> device (a no-op on CPU)     copy (link)
forward    model(x)                                                compute (GPU)
backward   loss.backward() (in record_steps: the loss too)         compute (GPU)
optimizer  optimizer.step()                                        compute (GPU)
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

Chapter 01's own code is in its folder: the step anatomy (``record_steps``: the reader's loader,
``to_device`` and ``train_step`` timed phase by phase; ``step_anatomy``, the live panel's and benchmark's short
run) in :mod:`helpers.chapters.ch01.anatomy`, and the evaluation (``evaluate``) in
:mod:`helpers.chapters.ch01.training`.

Here (chapter 01 and chapter 06's waterfall, and the course's answer key, use them):

``STAGES``, ``DATA_LANE``, ``COPY_LANE``, ``COMPUTE_LANE_GPU``, ``COMPUTE_LANE_CPU``  (the timeline's stages and lanes)
``make_optimizer(model, lr=3e-3) -> torch.optim.Optimizer``
``predict_step_time(phase_times) -> Prediction``  (the bottleneck model)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping

import torch
from torch import nn

from ..core.validate import check_float

__all__ = [
    "STAGES",
    "DATA_LANE",
    "COPY_LANE",
    "COMPUTE_LANE_GPU",
    "COMPUTE_LANE_CPU",
    "Prediction",
    "make_optimizer",
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


def make_optimizer(model: nn.Module, lr: float = 3e-3, weight_decay: float = 0.0) -> torch.optim.Optimizer:
    """Adam with the workbook's default learning rate (reaches good accuracy in a few epochs)."""
    check_float("lr", lr, 1e-7, 10.0)
    check_float("weight_decay", weight_decay, 0.0, 1.0)
    return torch.optim.Adam(model.parameters(), lr=lr, weight_decay=weight_decay)


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
