"""Worker failures in plain words (issue 25 item 3): a segfaulting worker, a worker that exits cleanly, and a data
set that raises at item k each reach the reader as one :class:`LoaderFailure` line that says which worker (and
which item) and what to check - from ``measure_throughput``, from ``open_iterator`` and in a panel's status line.

CPU only; no speed is asserted (a clean exit must be noticed before the loader's timeout, which is correctness).
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import psutil
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from helpers.chapters.ch04.datasets import CheapDataset
from helpers.core.failures import ITEM_NOTE
from helpers.pipeline import loaders as L
from helpers.pipeline import workers

BAD = 13  # the broken item: batch 3 of 4 items (shuffle=False), so worker 1 of 2 meets it


class Breaks(Dataset):
    """Item ``BAD`` segfaults its worker, ends it with exit code 0, or raises ValueError (``how``)."""

    def __init__(self, how: str, n: int = 64) -> None:
        self.how, self.n = how, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        if i == BAD and get_worker() is not None:
            if self.how == "segfault":
                os.kill(os.getpid(), signal.SIGSEGV)
                time.sleep(5)
            elif self.how == "exit0":
                os._exit(0)
        if i == BAD and self.how == "value":
            raise ValueError(f"item {i} is broken")
        return torch.zeros(4), i


def get_worker() -> Any:
    return torch.utils.data.get_worker_info()


def _settle(timeout_s: float = 5.0) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while True:
        left = [p.pid for p in L.worker_processes() if p.status() != psutil.STATUS_ZOMBIE]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


def _loader(how: str, guarded: bool) -> DataLoader:
    if guarded:  # the reader's own loader, given the workbook's safety
        return L.guard(DataLoader(Breaks(how), batch_size=4, shuffle=False, num_workers=2, timeout=30.0))
    return L.build_loader(Breaks(how), batch_size=4, shuffle=False, num_workers=2, timeout=30.0)


EXPECTED = {
    "segfault": ("Worker 1 (pid", "crashed (SIGSEGV", "num_workers=0"),
    "exit0": ("Worker 1 (pid", "exited cleanly (exit code 0)", "os._exit()", "num_workers=0"),
    "value": ("Worker 1 raised ValueError: item 13 is broken", f"item {BAD}", f"dataset[{BAD}]"),
}


def _check(msg: str, how: str) -> None:
    for part in EXPECTED[how]:
        assert part in msg, f"{part!r} not in {msg!r}"
    assert "\n" not in msg and "out-of-memory" not in msg and "timed out" not in msg, msg


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", list(EXPECTED))
def test_measure_throughput_names_the_worker_and_what_to_check(how: str) -> None:
    t0 = time.monotonic()
    with pytest.raises(L.LoaderFailure) as info:
        L.measure_throughput(_loader(how, guarded=False), batches=12, warmup=0)
    _check(str(info.value), how)
    assert info.value.__cause__ is not None  # torch's own error stays attached (the panel's details)
    assert time.monotonic() - t0 < 25, "a worker that ended was noticed only at the loader's timeout"
    assert not _settle()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", list(EXPECTED))
def test_open_iterator_turns_torchs_errors_into_plain_words(how: str) -> None:
    t0 = time.monotonic()
    with pytest.raises(L.LoaderFailure) as info:
        with L.open_iterator(_loader(how, guarded=True)) as it:
            for _ in range(12):
                next(it)
    _check(str(info.value), how)
    assert time.monotonic() - t0 < 25
    assert not _settle()


def test_a_broken_connection_is_explained_by_the_worker_that_died() -> None:
    """EOFError / ConnectionResetError: met while fetching a batch from a worker that just died."""
    loader = L.build_loader(CheapDataset(64, 4), batch_size=4, num_workers=2)
    with L.open_iterator(loader) as it:
        next(it)
        torch.utils.data._utils.signal_handling._remove_worker_pids(id(it))  # no SIGCHLD error: not tested here
        it._worker_pids_set = False
        victim = loader._workbook_workers[1]
        os.kill(victim.pid, signal.SIGSEGV)
        victim.join(5)
        for exc in (EOFError(), ConnectionResetError(104, "Connection reset by peer")):
            failure = workers.plain_failure(exc, loader)
            assert isinstance(failure, L.LoaderFailure) and failure.__cause__ is exc
            assert f"Worker 1 (pid {victim.pid}) crashed (SIGSEGV" in str(failure)
    assert not _settle()


def test_explain_names_each_kind_from_torchs_text() -> None:
    seg = L.explain_loader_error(RuntimeError("DataLoader worker (pid 12) is killed by signal: Segmentation fault. "))
    assert seg and "(pid 12) crashed (SIGSEGV" in seg
    kill = L.explain_loader_error(RuntimeError("DataLoader worker (pid 12) is killed by signal: Killed. "))
    assert kill and "out-of-memory killer" in kill
    code = L.explain_loader_error(RuntimeError("DataLoader worker (pid 12) exited unexpectedly with exit code 3. "))
    assert code and "exited with code 3" in code
    # under spawn, exit code 1 is most often a worker that could not import a class defined in a notebook
    # (chapter 04, pitfall b): num_workers=0 would hide that cause, so the words name it first
    assert "could not import the data set" in code and "define them in a module you import" in code
    ours = L.explain_loader_error(
        RuntimeError("DataLoader worker (pid(s) 12) exited unexpectedly (worker 1 (pid 12): exit code 0)")
    )
    assert ours and ours.startswith("Worker 1 (pid 12) exited cleanly")
    raw = ValueError(
        "Caught ValueError in DataLoader worker process 0.\nOriginal Traceback (most recent call last):\n"
        '  File "x.py", line 3, in __getitem__\n    raise ValueError("bad")\nValueError: bad\n'
        f"{ITEM_NOTE} 7\n"
    )
    words = L.explain_loader_error(raw)
    assert words == (
        "Worker 0 raised ValueError: bad while loading item 7. What to check: the data set's __getitem__ for that "
        "item: run dataset[7] in the main process to see it (details below)."
    )


def test_a_panel_shows_a_data_set_error_as_a_failed_run_not_as_bad_settings() -> None:
    pytest.importorskip("ipywidgets")
    from helpers.ui import widgets

    def run(progress: Any, **values: Any) -> Any:
        # torch's own error, as a reader's loop without the workbook's helpers meets it
        raise ValueError(
            "Caught ValueError in DataLoader worker process 0.\nOriginal Traceback (most recent call last):\n"
            "ValueError: item 3 is broken\n"
        )

    panel = widgets.Panel(title="t", controls={}, run=run)
    panel.click()
    assert panel.error is not None
    assert panel.error.startswith("The run failed: Worker 0 raised ValueError: item 3 is broken"), panel.error


def test_torchs_sigchld_error_while_the_explainer_waits_is_not_let_through(monkeypatch: pytest.MonkeyPatch) -> None:
    """A fresh-clone run on a loaded machine: torch's SIGCHLD handler raised "DataLoader worker (pid N) is killed
    by signal: Segmentation fault." inside the explainer's short wait for the dead worker's exit status, and that
    raw error reached the reader instead of the plain line."""

    class Ended:
        pid, exitcode = 4242, None

    class Loader:
        _workbook_workers = [Ended()]

    calls = []

    def sleep(_s: float) -> None:
        calls.append(_s)
        if len(calls) == 1:
            Ended.exitcode = -11
            raise RuntimeError("DataLoader worker (pid 4242) is killed by signal: Segmentation fault. ")

    monkeypatch.setattr(L.time, "sleep", sleep)
    failure = workers.plain_failure(EOFError(), Loader())  # the explainer waits for the ended worker's exit status
    assert isinstance(failure, L.LoaderFailure) and "Worker 0 (pid 4242) crashed (SIGSEGV" in str(failure)
    monkeypatch.setattr(L.time, "sleep", lambda _s: (_ for _ in ()).throw(RuntimeError("something else")))
    Ended.exitcode = None
    with pytest.raises(RuntimeError, match="something else"):
        workers.plain_failure(EOFError(), Loader())


class NoNotes(ValueError):
    """A data set's own error that refuses notes: naming the item must not replace it."""

    def add_note(self, note: str) -> None:
        raise RuntimeError("this error takes no notes")


class RaisesNoNotes(Dataset):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        if i == 5:
            raise NoNotes(f"item {i} is broken")
        return torch.zeros(4), i


def test_naming_the_failing_item_never_replaces_the_data_sets_error() -> None:
    loader = L.build_loader(RaisesNoNotes(), batch_size=2, num_workers=1, shuffle=False)
    with pytest.raises(Exception) as info:
        with L.open_iterator(loader) as it:
            for _ in it:
                pass
    chain = [info.value, info.value.__cause__]  # in plain words or not, the data set's own error is what arrives
    assert any(isinstance(e, NoNotes) and "item 5 is broken" in str(e) for e in chain), chain
    assert not _settle()
