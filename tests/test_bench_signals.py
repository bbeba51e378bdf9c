"""Ctrl-C and SIGTERM stop the bench: exit 130 / 143, the partial file kept, one line, no child left (issue 25.1).

A chapter that swallows the KeyboardInterrupt (as a DataLoader worker start once did) must not turn the stop
into success. The subprocess tests send the real signal to a real bench process.
"""

from __future__ import annotations

import importlib.machinery
import os
import signal
import subprocess
import sys
import textwrap
import time
import types
from pathlib import Path

import pytest
from _support import ROOT
from _support import workbook_env as _env

from helpers.core.results import ResultSet
from tools import bench

DRIVER = textwrap.dedent(
    """
    import multiprocessing as mp, sys, time
    from tools import bench

    chapters = [bench.Chapter(("97",), "fake_swallow", "swallows Ctrl-C"), bench.Chapter(("96",), "fake_next", "next")]
    code, _, _ = bench.run(chapters=chapters, device="cpu", out=sys.argv[1], png=False, progress=False)
    sys.exit(code)
    """
)

SWALLOW = textwrap.dedent(
    """
    import multiprocessing as mp, os, sys, time

    def _child():
        time.sleep(600)

    def benchmark(results, device, *, progress=None):
        results.add("ch97.before", 1.0, "s")
        child = mp.get_context("fork").Process(target=_child)
        child.start()
        with open(os.environ["CHILD_PID_FILE"], "w") as fh:
            fh.write(str(child.pid))
        print("READY", flush=True)
        try:
            time.sleep(120)
        except KeyboardInterrupt:
            pass  # swallowed: the chapter returns as if nothing happened, its child still running
    """
)

NEXT = "def benchmark(results, device, *, progress=None):\n    results.add('ch96.ran', 1.0, 's')\n"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.timeout(240)
@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)], ids=["SIGINT", "SIGTERM"])
def test_a_signal_swallowed_by_a_chapter_still_stops_the_bench(tmp_path: Path, sig: int, code: int) -> None:
    (tmp_path / "fake_swallow.py").write_text(SWALLOW)
    (tmp_path / "fake_next.py").write_text(NEXT)
    (tmp_path / "driver.py").write_text(DRIVER)
    env = _env(tmp_path)
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env["PYTHONPATH"]])
    env["CHILD_PID_FILE"] = str(tmp_path / "child.pid")
    out = tmp_path / "r.json"
    proc = subprocess.Popen(
        [sys.executable, str(tmp_path / "driver.py"), str(out)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    child = None
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if "READY" in line:
                break
        child = int((tmp_path / "child.pid").read_text())
        time.sleep(0.3)
        proc.send_signal(sig)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    try:
        assert proc.returncode == code, stderr[-2000:]
        assert "Traceback" not in stdout + stderr
        lines = [ln for ln in stderr.splitlines() if ln.startswith("interrupted")]
        assert len(lines) == 1 and signal.Signals(sig).name in lines[0], stderr
        saved = ResultSet.load(out)
        info = saved.provenance["bench"]
        assert info["interrupted"] is True and info["ok"] is False
        assert [(c["chapter"], c["status"]) for c in info["chapters"]] == [("ch97", "failed")]
        assert "interrupted" in info["chapters"][0]["reason"]
        assert saved.find("ch97.before") and not saved.find("ch96.ran"), "kept what was measured; ran nothing more"
        assert child is not None and not _alive(child), "the chapter's child process was left running"
    finally:
        if child is not None and _alive(child):
            os.kill(child, signal.SIGKILL)


def _module(name: str, benchmark) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__spec__ = importlib.machinery.ModuleSpec(name, None)
    mod.benchmark = benchmark
    return mod


def _ran(results, device, *, progress=None) -> None:
    results.add("ch96.ran", 1.0, "s")


def test_a_chapter_that_turns_ctrl_c_into_an_error_is_interrupted_not_failed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def converts(results, device, *, progress=None) -> None:
        results.add("ch95.before", 1.0, "s")
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)
        except KeyboardInterrupt:
            raise RuntimeError("DataLoader worker (pid 1) exited unexpectedly") from None

    monkeypatch.setitem(sys.modules, "fake_converts", _module("fake_converts", converts))
    monkeypatch.setitem(sys.modules, "fake_ran", _module("fake_ran", _ran))
    chapters = [bench.Chapter(("95",), "fake_converts", "c"), bench.Chapter(("96",), "fake_ran", "r")]
    before = signal.getsignal(signal.SIGINT)
    code, rs, _ = bench.run(chapters=chapters, device="cpu", out=tmp_path / "r.json", png=False, progress=False)
    assert code == 130
    assert signal.getsignal(signal.SIGINT) is before, "the previous Ctrl-C handler is back"
    chapters_done = rs.provenance["bench"]["chapters"]
    assert [(c["chapter"], c["status"]) for c in chapters_done] == [("ch95", "failed")]
    assert chapters_done[0]["reason"] == "interrupted (SIGINT)"


def test_a_signal_between_chapters_stops_before_the_next(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def signals_and_returns(results, device, *, progress=None) -> None:
        results.add("ch94.done", 1.0, "s")
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)
        except KeyboardInterrupt:
            pass

    monkeypatch.setitem(sys.modules, "fake_sig", _module("fake_sig", signals_and_returns))
    monkeypatch.setitem(sys.modules, "fake_ran", _module("fake_ran", _ran))
    chapters = [bench.Chapter(("94",), "fake_sig", "s"), bench.Chapter(("96",), "fake_ran", "r")]
    code, rs, _ = bench.run(chapters=chapters, device="cpu", out=tmp_path / "r.json", png=False, progress=False)
    assert code == 143 and not rs.find("ch96.ran")
    assert ResultSet.load(tmp_path / "r.json").provenance["bench"]["interrupted_by"] == "SIGTERM"


def test_a_forked_child_gets_pythons_own_ctrl_c_handler_back() -> None:
    import multiprocessing as mp

    def probe() -> None:
        os._exit(0 if signal.getsignal(signal.SIGINT) is signal.default_int_handler else 3)

    with bench.StopSignals().installed():
        p = mp.get_context("fork").Process(target=probe)
        p.start()
        p.join(10)
    assert p.exitcode == 0


def test_a_signal_ignored_at_start_stays_ignored() -> None:
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # as for `cmd &` started by a script
    try:
        with bench.StopSignals().installed():
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
            assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
    finally:
        signal.signal(signal.SIGINT, previous)
