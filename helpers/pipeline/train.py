"""The timeline's lanes and the optimizer (chapters 01 and 06).
Each phase of a step occupies one lane: ``load``, ``collate`` and ``pin`` the data (CPU) lane; ``h2d`` the copy lane;
``normalize``, ``forward``, ``backward`` and ``optimizer`` the compute lane."""

from __future__ import annotations

import torch
from torch import nn

from ..core.validate import check_float
from .workers import HeldSignals

#: Timeline lanes (rows of a Gantt chart): the resource each phase occupies.
DATA_LANE = "data (CPU)"
COPY_LANE = "copy (link)"
COMPUTE_LANE_GPU = "compute (GPU)"
COMPUTE_LANE_CPU = "compute (CPU)"


def make_optimizer(model: nn.Module, lr: float = 3e-3) -> torch.optim.Optimizer:
    """Adam at the workbook's learning rate (good accuracy in a few epochs)."""
    check_float("lr", lr, 1e-7, 10.0)
    # The first optimizer of a process imports torch._dynamo (about a second, sympy included). A Ctrl-C inside
    # that import leaves sympy half-imported, and every later run in the kernel fails: hold it until the end.
    with HeldSignals() as held:
        opt = torch.optim.Adam(model.parameters(), lr=lr)
    held.deliver()
    return opt
