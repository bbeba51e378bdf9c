"""``workers._finish`` holds Ctrl-C while it tears a run down (issue 25): a press is answered once the teardown is
done, a second press escapes at once, and a press that lands inside a finalizer the teardown runs is not lost.

A ``KeyboardInterrupt`` raised inside ``__del__`` or a weakref callback is printed as "Exception ignored" and
dropped by Python: a press that lands there would go unanswered. In the 300-press battery on a loaded machine one
press of 300 was lost this way ("never answered", one "Exception ignored" line on the child's stderr); once
more (2026-11-25, seed 4101) in multiprocessing's ``WeakValueDictionary``, outside any teardown. So importing the
workbook also installs a ``sys.unraisablehook`` that sends such a press again, to be raised in ordinary code.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import traceback
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from helpers.pipeline import workers

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def ctrl_c() -> Iterator[None]:
    """SIGINT raises KeyboardInterrupt in the main thread (Python's default), restored afterwards."""
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)


def _busy(seconds: float) -> None:
    """Python bytecode for ``seconds`` (the interpreter checks for pending signals between bytecodes)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _press() -> None:
    os.kill(os.getpid(), signal.SIGINT)
    _busy(0.02)


def test_a_press_during_the_teardown_is_raised_once_it_is_done(ctrl_c: None, monkeypatch: Any) -> None:
    calls = {"started": 0, "completed": 0}

    def release(_obj: Any) -> None:
        calls["started"] += 1
        if calls["started"] == 1:
            _press()
        _busy(0.01)
        calls["completed"] += 1

    monkeypatch.setattr(workers, "release", release)
    with pytest.raises(KeyboardInterrupt):
        workers._finish([object()])
    assert calls == {"started": 1, "completed": 1}, "the teardown was interrupted half-way, then run again"


def test_a_second_press_escapes_a_slow_teardown(ctrl_c: None, monkeypatch: Any) -> None:
    calls = {"started": 0, "completed": 0}

    def release(_obj: Any) -> None:
        calls["started"] += 1
        _press()
        _press()
        _busy(0.01)
        calls["completed"] += 1

    monkeypatch.setattr(workers, "release", release)
    with pytest.raises(KeyboardInterrupt):
        workers._finish([object()])
    assert calls == {"started": 1, "completed": 0}, "the second press did not end the teardown at once"


class _PressInFinalizer:
    """An object whose finalizer is where the press lands (as torch's queues and pipes are, when freed)."""

    def __del__(self) -> None:
        _press()


def test_a_press_inside_a_finalizer_the_teardown_runs_is_not_lost(ctrl_c: None, monkeypatch: Any) -> None:
    def release(_obj: Any) -> None:
        obj = _PressInFinalizer()
        del obj  # its __del__ runs here, and the press lands inside it

    monkeypatch.setattr(workers, "release", release)
    with pytest.raises(KeyboardInterrupt):  # before: "Exception ignored in ... __del__", and _finish returned
        workers._finish([object()])


def test_the_signal_handlers_are_restored_after_the_teardown(ctrl_c: None, monkeypatch: Any) -> None:
    monkeypatch.setattr(workers, "release", lambda _obj: None)
    workers._finish([object()])
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_press_dropped_in_a_weakref_callback_outside_the_teardown_is_sent_again(
    ctrl_c: None, monkeypatch: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    """The press lands in a weakref callback, as in multiprocessing's WeakValueDictionary (battery, seed 4101):
    Python drops it there, and the workbook's unraisable hook sends SIGINT again, so ordinary code raises it."""
    dropped: list[Any] = []
    monkeypatch.setattr(sys, "unraisablehook", workers._resend_dropped_interrupts(dropped.append))

    class Registered:
        pass

    obj = Registered()
    ref = weakref.ref(obj, lambda _ref: _press())  # the handler runs inside the callback, whose exception is dropped
    t0 = time.monotonic()
    with pytest.raises(KeyboardInterrupt) as caught:
        del obj  # the callback runs here, and its KeyboardInterrupt is dropped
        time.sleep(5.0)  # a blocking call, as a read of a worker's batch: the press sent again must end it
    assert time.monotonic() - t0 < 2.0, "the press sent again waited for the blocking call to end"
    assert workers.RESENT in capsys.readouterr().err
    assert ref() is None and not dropped
    assert not any(f.name == "<lambda>" for f in traceback.extract_tb(caught.value.__traceback__)), "raised again"
    boom = weakref.ref(obj := Registered(), lambda _ref: 1 / 0)
    del obj  # any other exception is the previous hook's, as before
    assert boom() is None and [u.exc_type for u in dropped] == [ZeroDivisionError]


def test_importing_the_workbook_installs_the_hook_once() -> None:
    code = (
        "import importlib, sys; default = sys.unraisablehook; from helpers.pipeline import workers; "
        "hook = sys.unraisablehook; importlib.reload(workers); "
        "print(hook is not default, hook.workbook_resends, sys.unraisablehook is hook)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.split() == ["True", "True", "True"]
