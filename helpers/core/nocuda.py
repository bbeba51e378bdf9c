"""Why torch cannot use an NVIDIA GPU that seems installed, and the command that fixes it.

Pure logic on facts passed in (the device module reads them from NVML and ``nvidia-smi``), so every case
is tested on any machine. The usual one: the pinned torch wheel is a CUDA 13 build and the driver
supports only CUDA 12.x; torch then reports no GPU and every chapter would silently run its CPU fallback.
"""

from __future__ import annotations

import torch

#: The PyTorch wheel index that holds builds for each CUDA 12.x level (see https://pytorch.org/get-started/locally/).
_CUDA12_INDEXES = ((12, 8, "cu128"), (12, 6, "cu126"))


def _version_tuple(text: str | None) -> tuple[int, int] | None:
    try:
        parts = str(text).split(".")
        return int(parts[0]), int(parts[1]) if len(parts) > 1 else 0
    except (ValueError, IndexError):
        return None


def diagnose_no_cuda(
    *,
    cuda_available: bool,
    torch_cuda: str | None,
    driver_cuda: str | None,
    driver_version: str | None = None,
    nvidia_smi: bool = False,
    torch_version: str = torch.__version__,
) -> str | None:
    """Why torch cannot use an NVIDIA GPU that seems installed, and the fix; ``None`` if no such case.
    ``torch_cuda``: ``torch.version.cuda`` (None: CPU-only build); ``driver_cuda``: NVML's newest CUDA (``"12.4"``)."""
    if cuda_available or (driver_cuda is None and not nvidia_smi):
        return None
    tv = _torchvision_base()
    pins = f"torch=={torch_version.split('+')[0]} " + (f"torchvision=={tv}" if tv else "torchvision")
    drv = f"driver {driver_version}" if driver_version else "an NVIDIA driver"
    if not torch_cuda:
        return (
            f"An NVIDIA GPU driver is installed, but this torch ({torch_version}) is a CPU-only build, "
            "so every chapter runs on the CPU. Install a CUDA build, e.g. "
            f"`.venv/bin/python -m pip install --force-reinstall {pins} --index-url "
            "https://download.pytorch.org/whl/cu128`."
        )
    need, have = _version_tuple(torch_cuda), _version_tuple(driver_cuda)
    if need is not None and have is not None and have < (need[0], 0):
        index = next((tag for major, minor, tag in _CUDA12_INDEXES if have >= (major, minor)), None)
        if have[0] == 12 and index:
            fix = (
                f"Either update the NVIDIA driver (CUDA {need[0]} needs driver 580 or newer), or install "
                f"the torch build for CUDA {have[0]}.x: `.venv/bin/python -m pip install --force-reinstall "
                f"{pins} --index-url https://download.pytorch.org/whl/{index}` "
                "(https://pytorch.org/get-started/locally/ lists the builds each torch version has)."
            )
        else:
            fix = (
                f"Update the NVIDIA driver (CUDA {need[0]} needs driver 580 or newer); builds of this torch for "
                f"CUDA {driver_cuda} may not exist (see https://pytorch.org/get-started/locally/)."
            )
        return (
            f"The GPU cannot be used: {drv} supports CUDA up to {driver_cuda}, but this torch "
            f"({torch_version}) is built for CUDA {torch_cuda}, so torch.cuda.is_available() is False and "
            f"the workbook falls back to the CPU. {fix}"
        )
    subject = f"NVIDIA driver {driver_version}" if driver_version else "An NVIDIA driver"
    return (
        f"{subject} is installed"
        + (f" (CUDA up to {driver_cuda})" if driver_cuda else "")
        + f", but torch ({torch_version}, CUDA {torch_cuda}) cannot use the GPU, so the workbook falls back "
        "to the CPU. Run `nvidia-smi` to see whether the GPU is visible (in a container: start it with "
        "--gpus all), and check CUDA_VISIBLE_DEVICES."
    )


def _torchvision_base() -> str | None:
    try:
        from importlib.metadata import version

        return version("torchvision").split("+")[0]
    except Exception:  # torchvision not installed: the command names it without a version
        return None
