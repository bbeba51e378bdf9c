"""The one setup call every chapter makes first.

>>> from helpers.core import setup
>>> DEVICE = setup.chapter("02", gpu_for="host-to-GPU copies and pinning")

It picks the device (:func:`helpers.core.device.pick_device`), prints the mode line (chapter, size
tier, device, torch version), the sizes line with the chapter's recorded Run All time, and, when no
CUDA device is present, the one plain sentence that says which of the chapter's measurements cannot
run here (:func:`helpers.core.device.no_cuda_message`). It returns the device.
"""

from __future__ import annotations

import torch

from .config import describe_sizes, mode_name
from .device import no_cuda_message, pick_device, wrap

__all__ = ["chapter", "mode_line"]


def mode_line(chapter: str, device: torch.device) -> str:
    """'Chapter 02 · quick mode · device: cpu · torch 2.x'."""
    return f"Chapter {chapter} · {mode_name()} mode · device: {device} · torch {torch.__version__}"


def chapter(chapter: str, gpu_for: str | None = None, prefer: str | None = None) -> torch.device:
    """Print the chapter's mode and sizes lines (and the no-CUDA sentence) and return its device.

    Args:
        chapter: the chapter's two-digit number, e.g. ``"02"``.
        gpu_for: what in this chapter needs a CUDA device (``"host-to-GPU copies"``); printed in the
            no-CUDA sentence when there is none. ``None``: the chapter has nothing GPU-only.
        prefer: a device to use instead of the automatic choice (see ``pick_device``).

    Raises:
        ValueError: ``chapter`` is not two digits, or ``prefer`` names a device this machine lacks.
    """
    if not (isinstance(chapter, str) and len(chapter) == 2 and chapter.isdigit()):
        raise ValueError(f"chapter must be two digits such as '02', got {chapter!r}")
    device = pick_device(prefer)
    print(mode_line(chapter, device))
    print(wrap(describe_sizes(chapter)))
    if device.type != "cuda" and gpu_for:
        print(no_cuda_message(gpu_for))
    return device
