"""Chapter 06's job, panel and waterfall with a worker that sleeps or is stopped (issue 25, items 1 and 2).

Every loader the capstone times gets chapter 04's protection (:func:`helpers.pipeline.loaders.guard`): a
timeout, and a worker stopped (SIGSTOP) longer than that is ended. The run then ends in a
:class:`~helpers.pipeline.loaders.LoaderFailure` in plain words, in bounded time, with no worker left.
Small timeouts here (``loaders.WORKER_TIMEOUT_S`` patched to 2 s).
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import psutil
import pytest
from _ch06_support import quick_data_set  # noqa: F401  (quick_data_set: autouse, for this module)
from torch.utils.data import DataLoader, Dataset

from helpers.chapters import ch06
from helpers.chapters.ch06 import capstone as C
from helpers.chapters.ch06 import job
from helpers.pipeline import loaders


@pytest.fixture(autouse=True)
def _short_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(loaders, "WORKER_TIMEOUT_S", 2.0)


class Misbehaving(Dataset):
    """``base``, but the worker that loads item ``at`` sleeps for ever, or stops itself (SIGSTOP)."""

    def __init__(self, base: Any, how: str, at: int = 5) -> None:
        self.base, self.how, self.at = base, how, at

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, i: int) -> Any:
        if i == self.at:
            if self.how == "sleep":
                time.sleep(3600)
            else:
                os.kill(os.getpid(), signal.SIGSTOP)
        return self.base[i]


def _pipeline(how: str) -> C.Pipeline:
    ref = job.reference_pipeline("cpu")

    def make_loader(dataset, batch_size, workers=2, pin=True, prefetch_factor=4, persistent=True):
        return DataLoader(  # the reader's own loader, no timeout of its own: the capstone guards it
            Misbehaving(dataset, how),
            batch_size=batch_size,
            shuffle=False,
            drop_last=True,
            num_workers=workers,
            persistent_workers=persistent and workers > 0,
            prefetch_factor=prefetch_factor if workers > 0 else None,
        )

    return C.Pipeline(make_loader, ref.batches, ref.train_step, source="a test pipeline")


def _spec() -> C.JobSpec:
    return C.job_spec(
        "data-bound", width=2, depth=1, batch_size=8, crop_size=32, train_items=48, warm_steps=1, warm_passes=1
    )


def _children() -> set[int]:
    return {
        p.pid
        for p in psutil.Process().children(recursive=True)
        if p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    }


def _no_new_children(before: set[int], wait_s: float = 5.0) -> set[int]:
    deadline = time.monotonic() + wait_s
    while True:
        extra = _children() - before
        if not extra or time.monotonic() > deadline:
            return extra
        time.sleep(0.1)


@pytest.mark.parametrize("how", ["sleep", "stop"])
def test_a_frozen_worker_ends_the_job_in_plain_words_and_leaves_no_worker(how: str) -> None:
    before = _children()
    settings = job.settings_for(["workers"], workers=2)
    t0 = time.monotonic()
    with pytest.raises(loaders.LoaderFailure) as info:
        C.run_config(settings, _spec(), "cpu", stages=False, pipeline=_pipeline(how))
    took = time.monotonic() - t0
    assert took < 30, f"the job took {took:.0f} s to give up on a {how} worker"
    text = str(info.value)
    assert "SIGSTOP" in text and ("No batch arrived" in text or how == "stop"), text
    assert not _no_new_children(before), "the job left worker processes behind"


def test_the_panel_gets_the_same_protection() -> None:
    before = _children()
    t0 = time.monotonic()
    with pytest.raises(loaders.LoaderFailure):
        ch06.panel_run(
            None,
            device="cpu",
            regime="data-bound",
            specs={"data-bound": _spec()},
            pipeline=_pipeline("stop"),
            workers=True,
            persistent=True,
        )
    assert time.monotonic() - t0 < 30
    assert not _no_new_children(before)
