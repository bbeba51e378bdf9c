"""Size tiers (quick, laptop, full) and folders.

Every chapter picks its problem sizes with :func:`sized`, from one of three tiers:

``quick``
    ``WORKBOOK_QUICK=1`` (the test command sets it): the smallest sizes, so the
    whole test suite runs in minutes on a 2-core CPU machine.
``laptop``
    The default on a machine **without** a CUDA GPU: sizes cut so that Run All of
    any chapter finishes in a few minutes on a 2-core laptop.
``full``
    The default on a machine with a CUDA GPU, or asked for on any machine with
    ``WORKBOOK_FULL=1``: the sizes the reference results are recorded at.

The tier never changes *which* code runs, only how much data goes through it.
``WORKBOOK_QUICK=1`` and ``WORKBOOK_FULL=1`` together are refused.

Other variables:

``WORKBOOK_CACHE``
    Folder for generated data sets (default: ``<repo>/data-cache``, else
    ``~/.cache/gpu-data-workbook``).
``WORKBOOK_ARTIFACTS``
    Folder where notebooks and benchmarks write figures and result files
    (default: ``<repo>/artifacts``).
``WORKBOOK_REQUIRE_GPU``
    Set to ``1`` by the GPU check (``python -m helpers.tools.gpucheck``): a run that
    would fall back to the CPU fails loudly instead (see
    :func:`helpers.core.device.pick_device`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")

QUICK_ENV = "WORKBOOK_QUICK"
FULL_ENV = "WORKBOOK_FULL"
GRADE_ENV = "WORKBOOK_GRADE"
CACHE_ENV = "WORKBOOK_CACHE"
ARTIFACTS_ENV = "WORKBOOK_ARTIFACTS"
REQUIRE_GPU_ENV = "WORKBOOK_REQUIRE_GPU"

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"", "0", "false", "no", "off"}


TIERS = ("quick", "laptop", "full")


def quick_mode() -> bool:
    """Return True when ``WORKBOOK_QUICK`` asks for small problem sizes.

    Raises:
        ValueError: if the variable holds something other than a yes/no value.
    """
    return _flag(QUICK_ENV, "quick mode")


def full_requested() -> bool:
    """True when ``WORKBOOK_FULL=1`` asks for full (GPU-sized) problems on any machine.

    Raises:
        ValueError: if the variable holds something other than a yes/no value.
    """
    return _flag(FULL_ENV, "full sizes")


def grade_mode() -> bool:
    """True when ``WORKBOOK_GRADE=1``: wrong or missing exercise answers raise (course assignments).

    Raises:
        ValueError: if the variable holds something other than a yes/no value, so that a typo
            never turns grading off silently.
    """
    return _flag(GRADE_ENV, "grade exercises")


def _cuda_present() -> bool:
    try:
        import torch  # heavy: imported only when no variable decides the tier

        return bool(torch.cuda.is_available())
    except Exception:  # a broken driver must not break size selection
        return False


def size_tier() -> str:
    """The size tier in force: ``"quick"``, ``"laptop"`` or ``"full"`` (see the module docstring).

    Raises:
        ValueError: a variable holds an unknown value, or quick and full are both asked for.
    """
    quick, full = quick_mode(), full_requested()
    if quick and full:
        raise ValueError(f"{QUICK_ENV}=1 and {FULL_ENV}=1 contradict each other; unset one of them.")
    if quick:
        return "quick"
    if full:
        return "full"
    return "full" if _cuda_present() else "laptop"


def tier_reason(tier: str | None = None) -> str:
    """One sentence: which tier is in force, why, and how to choose another."""
    tier = tier or size_tier()
    if tier == "quick":
        return f"quick sizes ({QUICK_ENV}=1): the smallest problems, as the test suite runs them."
    if tier == "full":
        why = f"{FULL_ENV}=1 asks for them" if full_requested() else "a CUDA GPU is present"
        return f"full sizes ({why}): the sizes the reference results are recorded at."
    return (
        "laptop sizes: no CUDA GPU here, so problems are cut to finish in minutes on a CPU "
        f"({FULL_ENV}=1 for the full GPU sizes, {QUICK_ENV}=1 for the smallest)."
    )


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
    """The size tier, as recorded in result files: ``"quick"``, ``"laptop"`` or ``"full"``."""
    return size_tier()


def sized(quick: T, full: T, laptop: T | None = None) -> T:
    """Pick a problem size for the tier in force (``laptop`` defaults to ``full``).

    >>> sized(quick=64, full=4096, laptop=512) in (64, 512, 4096)
    True
    """
    tier = size_tier()
    if tier == "quick":
        return quick
    if tier == "laptop" and laptop is not None:
        return laptop
    return full


def repo_root() -> Path | None:
    """The workbook's checkout folder, if the package runs from one (editable install)."""
    here = Path(__file__).resolve().parents[2]
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


def _chapter_times_file() -> Path:
    return Path(__file__).resolve().parent / "chapter_times.json"


def expected_runtime(chapter: str, tier: str | None = None) -> str | None:
    """How long Run All of ``chapter`` (e.g. ``"04"``) took at this tier, as measured by
    ``tools/time_chapters.py`` and recorded in ``helpers/core/chapter_times.json``,
    with the machine it was measured on; ``None`` when no such measurement is recorded."""
    import json

    tier = tier or size_tier()
    try:
        data = json.loads(_chapter_times_file().read_text())
        entry = data["chapters"][chapter][tier]
        seconds = float(entry["seconds"])
        machine = str(data["machine"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    minutes = seconds / 60
    when = f"about {minutes:.0f} min" if minutes >= 1.5 else f"about {seconds:.0f} s"
    return f"Run All took {when} at {tier} sizes on {machine} (measured {data.get('date', '?')})."


def describe_sizes(chapter: str) -> str:
    """The setup cell's line about sizes: the tier, why it was chosen, and the recorded run time."""
    import textwrap

    tier = size_tier()
    runtime = expected_runtime(chapter, tier)
    lines = [f"Sizes: {tier_reason(tier)}"] + ([runtime] if runtime else [])
    return "\n".join(textwrap.fill(line, width=100, break_on_hyphens=False, break_long_words=False) for line in lines)
