"""The one setup call every chapter makes first: ``DEVICE = setup.chapter("02", gpu_for="host-to-GPU copies")``."""

from __future__ import annotations

import torch

from .config import describe_sizes, mode_name
from .device import no_cuda_message, pick_device
from .validate import wrap


def chapter(chapter: str, gpu_for: str | None = None, prefer: str | None = None) -> torch.device:
    """Print the chapter's mode and sizes lines (and, without CUDA, what ``gpu_for`` cannot run); return its device."""
    if not (isinstance(chapter, str) and len(chapter) == 2 and chapter.isdigit()):
        raise ValueError(f"chapter must be two digits such as '02', got {chapter!r}")
    device = pick_device(prefer)
    print(f"Chapter {chapter} · {mode_name()} mode · device: {device} · torch {torch.__version__}")
    print(wrap(describe_sizes(chapter)))
    if device.type != "cuda" and gpu_for:
        print(no_cuda_message(gpu_for))
    return device
