"""Size tiers (quick, laptop, full), yes/no settings and folders; chapters pick problem sizes with :func:`sized`.

``WORKBOOK_QUICK=1``: quick (the tests). ``WORKBOOK_FULL=1``: full anywhere, ``=0``: laptop anywhere. Unset, full
needs CUDA and :data:`FULL_MIN_CPU_CORES` usable cores, else laptop. A tier changes how much data goes through,
never which code runs. Yes/no variables take 1/0, true/false, yes/no (any case); anything else is a ValueError.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TypeVar

from .validate import wrap

T = TypeVar("T")

QUICK_ENV = "WORKBOOK_QUICK"
FULL_ENV = "WORKBOOK_FULL"
GRADE_ENV = "WORKBOOK_GRADE"
CACHE_ENV = "WORKBOOK_CACHE"
ARTIFACTS_ENV = "WORKBOOK_ARTIFACTS"
REQUIRE_GPU_ENV = "WORKBOOK_REQUIRE_GPU"

_TRUE = ("1", "true", "yes")
_FALSE = ("0", "false", "no")  # and unset or empty
_FLAG_MEANS = {QUICK_ENV: "quick mode", FULL_ENV: "full sizes", GRADE_ENV: "grade exercises"}
_FLAG_MEANS[REQUIRE_GPU_ENV] = "strict GPU run"

# Why 4 cores: the loading chapters are CPU-bound; the slowest at full size (04) took FULL_SLOWEST_2CORE_S of Run
# All on 2 cores (FIELD-NOTES, 2026-11-24), about 290 s on 4, under the 5 minutes a chapter may take.
FULL_MIN_CPU_CORES = 4
FULL_SLOWEST_2CORE_S = 571.0

TIERS = ("quick", "laptop", "full")


def _flag(env: str) -> bool:
    raw = os.environ.get(env, "").strip()
    if raw.lower() in _TRUE:
        return True
    if raw == "" or raw.lower() in _FALSE:
        return False
    raise ValueError(
        f"{env}={raw!r} is not understood ({_FLAG_MEANS[env]}): use one of {'/'.join(_TRUE + _FALSE)} (any case), "
        "or unset it."
    )


def quick_mode() -> bool:
    return _flag(QUICK_ENV)


def full_requested() -> bool:
    return _flag(FULL_ENV)


def grade_mode() -> bool:
    """``WORKBOOK_GRADE=1``: wrong or missing answers raise."""
    return _flag(GRADE_ENV)


def require_gpu() -> bool:
    """``WORKBOOK_REQUIRE_GPU=1`` (the GPU check): GPU paths fail loudly rather than fall back to the CPU."""
    return _flag(REQUIRE_GPU_ENV)


def strict_gpu_error(exc: BaseException) -> bool:
    """A CUDA error on a strict GPU run: it must reach the reader, not become a verdict (matched without torch)."""
    if not require_gpu():
        return False
    if any(cls.__name__ == "AcceleratorError" for cls in type(exc).__mro__):
        return True
    return isinstance(exc, RuntimeError) and "CUDA" in str(exc)


def check_environment() -> None:
    """Check every yes/no ``WORKBOOK_*`` variable, and quick with full, at once (tools call it first)."""
    for env in _FLAG_MEANS:
        _flag(env)
    _quick_or_full()


def _cuda_present() -> bool:
    try:
        import torch  # heavy: imported only when no variable decides the tier

        return bool(torch.cuda.is_available())
    except Exception:  # a broken driver must not break size selection
        return False


def usable_cpu_cores() -> int:
    """The CPU cores this process may use: its affinity mask, capped by a cgroup v2 CPU quota (containers)."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        n = os.cpu_count() or 1
    try:  # "max 100000" (no cap) or "<quota> <period>"
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        if quota != "max" and int(period) > 0:
            n = min(n, max(1, -(-int(quota) // int(period))))
    except (OSError, ValueError):
        pass
    return max(1, n)


def _quick_or_full() -> tuple[bool, bool]:
    quick, full = quick_mode(), full_requested()
    if quick and full:
        raise ValueError(f"{QUICK_ENV}=1 and {FULL_ENV}=1 contradict each other; unset one of them.")
    return quick, full


def decide_tier() -> tuple[str, str]:
    """The size tier in force and one sentence: why, and how to choose another."""
    quick, full = _quick_or_full()
    if quick:
        return "quick", f"quick sizes ({QUICK_ENV}=1): the smallest problems, as the test suite runs them."
    if full:
        return "full", f"full sizes ({FULL_ENV}=1 asks for them): the sizes the reference results are recorded at."
    if os.environ.get(FULL_ENV, "").strip():
        return "laptop", (
            f"laptop sizes ({FULL_ENV}=0 asks for them, whatever the machine): problems cut to finish in minutes "
            f"(unset {FULL_ENV} to let the machine choose: full with a CUDA GPU and {FULL_MIN_CPU_CORES}+ CPU cores)."
        )
    if not _cuda_present():
        return "laptop", (
            "laptop sizes: no CUDA GPU here, so problems are cut to finish in minutes on a CPU "
            f"({FULL_ENV}=1 for the full GPU sizes, {QUICK_ENV}=1 for the smallest)."
        )
    cores = usable_cpu_cores()
    if cores >= FULL_MIN_CPU_CORES:
        why = f"a CUDA GPU and {cores} CPU cores are present"
        return "full", f"full sizes ({why}): the sizes the reference results are recorded at."
    minutes = FULL_SLOWEST_2CORE_S * 2 / cores / 60  # the slowest chapter's Run All, scaled by cores
    return "laptop", (
        f"laptop sizes (CUDA present, but {cores} CPU core{'s' if cores != 1 else ''}: full sizes would take up to "
        f"~{minutes:.0f} min per chapter; they need {FULL_MIN_CPU_CORES}+ cores to be the default). "
        f"{FULL_ENV}=1 uses them anyway, {QUICK_ENV}=1 the smallest."
    )


def size_tier() -> str:
    """``"quick"``, ``"laptop"`` or ``"full"``."""
    return decide_tier()[0]


mode_name = size_tier  # the name result files and Timing metadata record it under


def sized(quick: T, full: T, laptop: T | None = None) -> T:
    """Pick a problem size for the tier in force (``laptop`` defaults to ``full``)."""
    tier = size_tier()
    return quick if tier == "quick" else laptop if tier == "laptop" and laptop is not None else full


def repo_root() -> Path | None:
    """The workbook's checkout folder, if the package runs from one (editable install)."""
    here = Path(__file__).resolve().parents[2]
    return here if (here / "pyproject.toml").is_file() and (here / "notebooks").is_dir() else None


def _folder(env: str, name: str) -> Path:
    raw, root = os.environ.get(env), repo_root()
    path = Path(raw).expanduser() if raw else root / name if root else Path.home() / ".cache/gpu-data-workbook" / name
    path.mkdir(parents=True, exist_ok=True)
    return path


def cache_dir() -> Path:
    """Generated data sets: ``$WORKBOOK_CACHE``, else ``<repo>/data-cache`` or ``~/.cache/gpu-data-workbook``."""
    return _folder(CACHE_ENV, "data-cache")


def artifacts_dir() -> Path:
    """Figures and result files written by runs: ``$WORKBOOK_ARTIFACTS``, else ``<repo>/artifacts``."""
    return _folder(ARTIFACTS_ENV, "artifacts")


def _chapter_times_file() -> Path:
    return Path(__file__).resolve().parent / "chapter_times.json"


def describe_sizes(chapter: str) -> str:
    """The setup cell's line about sizes: the tier, why it was chosen, and how long Run All of ``chapter`` took at
    this tier, and where, when recorded (``chapter_times.json``, written by ``tools/time_chapters.py``)."""
    tier, reason = decide_tier()
    lines = [f"Sizes: {reason}"]
    try:
        data = json.loads(_chapter_times_file().read_text())
        seconds, machine = float(data["chapters"][chapter][tier]["seconds"]), str(data["machine"])
        when = f"about {seconds / 60:.0f} min" if seconds >= 90 else f"about {seconds:.0f} s"
        lines.append(f"Run All took {when} at {tier} sizes on {machine} (measured {data.get('date', '?')}).")
    except (OSError, ValueError, KeyError, TypeError):
        pass  # no record for this chapter and tier: the sizes line alone
    return wrap("\n".join(lines))
