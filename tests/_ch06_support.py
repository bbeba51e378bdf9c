"""What chapter 06's test modules share: quick mode's small data set for the module, and a tiny job spec.

Imported as ``_ch06_support`` (pytest puts ``tests/`` on ``sys.path`` for its test modules). A test module that
imports ``quick_data_set`` gets it for all its tests (an autouse fixture applies in the module that holds it).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from helpers.chapters.ch06 import capstone as C
from helpers.chapters.ch06 import job

_JOB_SPEC = C.job_spec  # the real one: a test may patch C.job_spec with a function that calls tiny()


@pytest.fixture(autouse=True, scope="module")
def quick_data_set() -> Iterator[None]:
    """Quick mode for the importing module: the small generated data set (seconds), not the full one."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("WORKBOOK_QUICK", "1")
        job._CACHE.clear()
        yield
    job._CACHE.clear()


def tiny(regime: str = "data-bound", **kw: Any) -> C.JobSpec:
    """A job small enough for a unit test: chapter 06's ``regime``, the sizes overridden by ``kw``."""
    base: dict[str, Any] = dict(
        width=2, depth=1, batch_size=8, crop_size=32, train_items=24, warm_steps=1, warm_passes=1
    )
    base.update(kw)
    return _JOB_SPEC(regime, **base)


def flops(width: int, depth: int, crop: int) -> int:
    """The forward FLOPs the calibration ranks its ladder by: the kernel's count on the model on the meta device."""
    from helpers.chapters.ch06 import calibration
    from helpers.pipeline.models import flops_per_sample

    return flops_per_sample(calibration._on_meta(width, depth), crop)
