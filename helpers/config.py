"""Quick mode and problem sizes.

The whole workbook reads one environment variable, ``WORKBOOK_QUICK``. When it is
``1`` (the test command sets it), every chapter shrinks its problem sizes so the
full test suite runs in minutes on a 2-core CPU machine. Quick mode never changes
*which* code runs, only how much data goes through it.

Other variables:

``WORKBOOK_CACHE``
    Folder for generated data sets (default: ``<repo>/data-cache``, else
    ``~/.cache/gpu-data-workbook``).
``WORKBOOK_ARTIFACTS``
    Folder where notebooks and benchmarks write figures and result files
    (default: ``<repo>/artifacts``).
``WORKBOOK_REQUIRE_GPU``
    Set to ``1`` by the GPU check (``python -m helpers.gpucheck``): a run that
    would fall back to the CPU fails loudly instead (see
    :func:`helpers.device.pick_device`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")

QUICK_ENV = "WORKBOOK_QUICK"
CACHE_ENV = "WORKBOOK_CACHE"
ARTIFACTS_ENV = "WORKBOOK_ARTIFACTS"
REQUIRE_GPU_ENV = "WORKBOOK_REQUIRE_GPU"

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"", "0", "false", "no", "off"}


def quick_mode() -> bool:
    """Return True when ``WORKBOOK_QUICK`` asks for small problem sizes.

    Raises:
        ValueError: if the variable holds something other than a yes/no value.
    """
    return _flag(QUICK_ENV, "quick mode")


def _flag(env: str, what: str) -> bool:
    raw = os.environ.get(env, "").strip().lower()
    if raw in _TRUE:
        return True
    if raw in _FALSE:
        return False
    raise ValueError(f"{env}={raw!r} is not understood; set it to 1 ({what}) or 0.")


def require_gpu() -> bool:
    """True when ``WORKBOOK_REQUIRE_GPU=1``: GPU paths must fail loudly rather than fall back.

    Raises:
        ValueError: if the variable holds something other than a yes/no value.
    """
    return _flag(REQUIRE_GPU_ENV, "strict GPU run")


def mode_name() -> str:
    """``"quick"`` or ``"full"``, as recorded in result files."""
    return "quick" if quick_mode() else "full"


def sized(quick: T, full: T) -> T:
    """Pick a problem size: ``quick`` in quick mode, ``full`` otherwise.

    >>> sized(quick=64, full=4096) in (64, 4096)
    True
    """
    return quick if quick_mode() else full


def repo_root() -> Path | None:
    """The workbook's checkout folder, if the package runs from one (editable install)."""
    here = Path(__file__).resolve().parent.parent
    if (here / "pyproject.toml").is_file() and (here / "notebooks").is_dir():
        return here
    return None


def _folder(env: str, name: str) -> Path:
    raw = os.environ.get(env)
    if raw:
        path = Path(raw).expanduser()
    else:
        root = repo_root()
        path = root / name if root else Path.home() / ".cache" / "gpu-data-workbook" / name
    path.mkdir(parents=True, exist_ok=True)
    return path


def cache_dir() -> Path:
    """Folder for generated data sets (created if needed)."""
    return _folder(CACHE_ENV, "data-cache")


def artifacts_dir() -> Path:
    """Folder for figures and result files written by runs (created if needed)."""
    return _folder(ARTIFACTS_ENV, "artifacts")
