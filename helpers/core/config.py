"""Size tiers (quick, laptop, full) and folders. Every chapter picks its problem sizes with :func:`sized`.

``quick``   ``WORKBOOK_QUICK=1`` (the tests set it): the smallest sizes, the suite runs in minutes on 2 cores.
``laptop``  no CUDA GPU, or one with fewer than :data:`FULL_MIN_CPU_CORES` cores (a hosted T4 has 2 vCPUs, and
            the DataLoader chapters are CPU-bound): Run All of any chapter finishes in minutes on 2 cores.
``full``    a CUDA GPU and :data:`FULL_MIN_CPU_CORES`+ usable cores, or ``WORKBOOK_FULL=1`` on any machine:
            the sizes the reference results are recorded at.

``WORKBOOK_FULL`` decides when set: ``1`` full sizes anywhere, ``0`` laptop sizes even on a big CUDA host (the
GPU check and ``tools/time_chapters.py`` use it). Quick and full together are refused; quick with
``WORKBOOK_FULL=0`` is quick. The tier changes how much data goes through, never which code runs.

Yes/no variables (``WORKBOOK_QUICK``, ``_FULL``, ``_GRADE``, ``_REQUIRE_GPU``) take 1/0, true/false, yes/no (any
case; unset or empty is no); anything else raises a one-line ValueError (:func:`check_environment` checks all).
``WORKBOOK_CACHE``: generated data sets (default ``<repo>/data-cache``, else ``~/.cache/gpu-data-workbook``).
``WORKBOOK_ARTIFACTS``: figures and result files (default ``<repo>/artifacts``). ``WORKBOOK_REQUIRE_GPU=1``
(the GPU check): a run that would fall back to the CPU fails loudly instead.
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

# The full tier by default needs CUDA *and* this many usable CPU cores. Why 4: the chapters' loading work is
# CPU-bound, and the slowest full-size chapter (04, worker processes) took FULL_SLOWEST_2CORE_S of Run All on
# 2 cores (FIELD-NOTES, 2026-11-24) against at most 82 s for any chapter at laptop sizes (chapter_times.json).
# Scaled by cores, 4 cores bring it to about 290 s, under the 5 minutes a chapter may take; 2 cores (a hosted T4,
# 2 vCPUs) would need about 10 minutes per chapter, so such a host gets the laptop sizes.
FULL_MIN_CPU_CORES = 4
FULL_SLOWEST_2CORE_S = 571.0


TIERS = ("quick", "laptop", "full")


def quick_mode() -> bool:
    """True when ``WORKBOOK_QUICK`` asks for small problem sizes (ValueError for a value not yes/no)."""
    return _flag(QUICK_ENV)


def full_requested() -> bool:
    """True when ``WORKBOOK_FULL=1`` asks for full (GPU-sized) problems on any machine."""
    return _flag(FULL_ENV)


def grade_mode() -> bool:
    """True when ``WORKBOOK_GRADE=1``: wrong or missing answers raise (a typo raises too, never grades off)."""
    return _flag(GRADE_ENV)


def _full_refused() -> bool:
    """``WORKBOOK_FULL=0``: laptop sizes whatever the machine (unset: the machine decides)."""
    return os.environ.get(FULL_ENV, "").strip() != "" and not _flag(FULL_ENV)


def _cuda_present() -> bool:
    try:
        import torch  # heavy: imported only when no variable decides the tier

        return bool(torch.cuda.is_available())
    except Exception:  # a broken driver must not break size selection
        return False


def usable_cpu_cores() -> int:
    """The CPU cores this process may use: its affinity mask, capped by a cgroup CPU quota (containers)."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        n = os.cpu_count() or 1
    try:  # cgroup v2: "max 100000" (no cap) or "<quota> <period>"
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


def _decide() -> tuple[str, str]:
    """The size tier in force and one sentence: why, and how to choose another."""
    quick, full = _quick_or_full()
    if quick:
        return "quick", _NAMED["quick"]
    if full:
        return "full", f"full sizes ({FULL_ENV}=1 asks for them): the sizes the reference results are recorded at."
    if _full_refused():
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


#: What a tier means when a caller names one other than the tier in force (no reason is claimed for it).
_NAMED = {
    "quick": f"quick sizes ({QUICK_ENV}=1): the smallest problems, as the test suite runs them.",
    "laptop": f"laptop sizes: problems cut to finish in minutes ({FULL_ENV}=1 for the full sizes).",
    "full": "full sizes: the sizes the reference results are recorded at.",
}


def size_tier() -> str:
    """The size tier in force: ``"quick"``, ``"laptop"`` or ``"full"`` (see the module docstring)."""
    return _decide()[0]


def tier_reason(tier: str | None = None) -> str:
    """One sentence: which tier is in force, why, and how to choose another (``tier`` names another: what it is)."""
    decided, reason = _decide()
    return reason if tier in (None, decided) else _NAMED[tier]


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


def check_environment() -> None:
    """Check every yes/no ``WORKBOOK_*`` variable (and quick + full together) at once: tools that set them for
    child processes call this first, so ``WORKBOOK_QUICK=banana`` stops them with one line."""
    for env in _FLAG_MEANS:
        _flag(env)
    _quick_or_full()


def require_gpu() -> bool:
    """True when ``WORKBOOK_REQUIRE_GPU=1``: GPU paths must fail loudly rather than fall back."""
    return _flag(REQUIRE_GPU_ENV)


mode_name = size_tier  # the name result files and Timing metadata record it under


def sized(quick: T, full: T, laptop: T | None = None) -> T:
    """Pick a problem size for the tier in force (``laptop`` defaults to ``full``)."""
    tier = size_tier()
    return quick if tier == "quick" else laptop if tier == "laptop" and laptop is not None else full


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
    """How long Run All of ``chapter`` took at this tier, and where (``chapter_times.json``, written by
    ``tools/time_chapters.py``); ``None`` when nothing is recorded."""
    tier = tier or size_tier()
    try:
        data = json.loads(_chapter_times_file().read_text())
        seconds, machine = float(data["chapters"][chapter][tier]["seconds"]), str(data["machine"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    minutes = seconds / 60
    when = f"about {minutes:.0f} min" if minutes >= 1.5 else f"about {seconds:.0f} s"
    return f"Run All took {when} at {tier} sizes on {machine} (measured {data.get('date', '?')})."


def describe_sizes(chapter: str) -> str:
    """The setup cell's line about sizes: the tier, why it was chosen, and the recorded run time."""
    tier = size_tier()
    runtime = expected_runtime(chapter, tier)
    return wrap("\n".join([f"Sizes: {tier_reason(tier)}"] + ([runtime] if runtime else [])))
