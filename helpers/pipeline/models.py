"""The workbook's model: a small CNN whose compute is one knob, ``width`` (compute grows with ``width**2``): a tiny
one makes the pipeline data-bound, a wide one compute-bound, its cost counted (FLOPs, output sizes)."""

from __future__ import annotations

import torch
from torch import nn

from ..core.validate import check_int


class SmallCNN(nn.Module):
    """A plain CNN for normalised ``(N, 3, H, W)`` float images, ``H, W >= 2**depth``: ``depth`` stages that halve
    the resolution, stage ``i`` with ``width * 2**i`` channels and ``convs_per_stage`` 3x3 convolutions."""

    def __init__(
        self,
        num_classes: int = 6,
        width: int = 16,
        depth: int = 3,
        convs_per_stage: int = 1,
    ) -> None:
        super().__init__()
        self.num_classes = check_int("num_classes", num_classes, 2, 1000)
        self.width = check_int("width", width, 1, 512)
        self.depth = check_int("depth", depth, 1, 6)
        self.convs_per_stage = check_int("convs_per_stage", convs_per_stage, 1, 8)
        layers: list[nn.Module] = []
        c_in = 3
        for stage in range(self.depth):
            c_out = self.width * 2**stage
            for _ in range(self.convs_per_stage):
                layers += [
                    nn.Conv2d(c_in, c_out, kernel_size=3, padding=1, bias=False),
                    nn.BatchNorm2d(c_out),
                    nn.ReLU(inplace=True),
                ]
                c_in = c_out
            layers.append(nn.MaxPool2d(2))
        self.features = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Linear(c_in, self.num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.flatten(self.pool(self.features(x)), 1))

    def extra_repr(self) -> str:
        return f"width={self.width}, depth={self.depth}, convs_per_stage={self.convs_per_stage}"


def build_model(width: int = 16, depth: int = 3, num_classes: int = 6, seed: int = 0) -> SmallCNN:
    """A :class:`SmallCNN` with weights initialised from ``seed`` (global RNG left untouched)."""
    check_int("seed", seed, 0, 2**63 - 1)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return SmallCNN(num_classes=num_classes, width=width, depth=depth)


def output_numels(model: nn.Module, image_size: int) -> list[tuple[nn.Module, int]]:
    """(module, elements of its output) for each module of one no-grad eval forward pass of a zero image, on the
    model's device: a model built on the meta device (``with torch.device("meta"):``) gives shapes without memory."""
    seen: list[tuple[nn.Module, int]] = []
    handles = [m.register_forward_hook(lambda mod, inp, out: seen.append((mod, out.numel()))) for m in model.modules()]
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    was_training = model.training
    try:
        model.eval()
        with torch.no_grad():
            model(torch.zeros(1, 3, image_size, image_size, device=device))
    finally:
        model.train(was_training)
        for h in handles:
            h.remove()
    return seen


def flops_per_sample(model: nn.Module, image_size: int) -> int:
    """Forward FLOPs of one image (2 per multiply-add; convolutions and linear layers). Training: about 3x."""
    check_int("image_size", image_size, 1, 8192)
    total = 0
    for mod, n in output_numels(model, image_size):
        if isinstance(mod, nn.Conv2d):
            total += 2 * mod.kernel_size[0] * mod.kernel_size[1] * (mod.in_channels // mod.groups) * n
        elif isinstance(mod, nn.Linear):
            total += 2 * mod.in_features * n
    return total


def describe_model(model: nn.Module, image_size: int) -> str:
    extra = f" {model.extra_repr().replace('_per_', '/')}," if isinstance(model, SmallCNN) else ""
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return (
        f"{type(model).__name__}:{extra} {trained / 1e3:.1f} k parameters, "
        f"{flops_per_sample(model, image_size) / 1e9:.3f} GFLOP forward per {image_size}x{image_size} image"
    )
