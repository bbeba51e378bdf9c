"""The timeline's phases and lanes, the optimizer, and the bottleneck model (chapters 01 and 06, the answer key).
Each phase of a step occupies one lane: ``load``, ``collate`` and ``pin`` the data (CPU) lane; ``h2d`` the copy lane;
``normalize``, ``forward``, ``backward`` and ``optimizer`` the compute lane."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import torch
from torch import nn

from ..core.validate import check_float
from .workers import HeldSignals

#: Timeline lanes (rows of a Gantt chart): the resource each phase occupies.
DATA_LANE = "data (CPU)"
COPY_LANE = "copy (link)"
COMPUTE_LANE_GPU = "compute (GPU)"
COMPUTE_LANE_CPU = "compute (CPU)"
#: The resources of the bottleneck model and the phases each one runs.
STAGES: dict[str, tuple[str, ...]] = {
    DATA_LANE: ("load", "collate", "pin"),
    COPY_LANE: ("h2d",),
    "compute (device)": ("normalize", "forward", "backward", "optimizer"),
}


def make_optimizer(model: nn.Module, lr: float = 3e-3) -> torch.optim.Optimizer:
    """Adam at the workbook's learning rate (good accuracy in a few epochs)."""
    check_float("lr", lr, 1e-7, 10.0)
    # The first optimizer of a process imports torch._dynamo (about a second, sympy included). A Ctrl-C inside
    # that import leaves sympy half-imported, and every later run in the kernel fails: hold it until the end.
    with HeldSignals() as held:
        opt = torch.optim.Adam(model.parameters(), lr=lr)
    held.deliver()
    return opt


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
