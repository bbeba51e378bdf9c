"""examples/fast_pipeline.py as a careful command-line tool (issue 25, items 1, 2 and 6).

Bad arguments and bad data exit with status 2 and one line; a worker that sleeps or is stopped ends the run
with one line (status 1) within ``--timeout``; Ctrl-C exits with status 130 and one line; no worker process
outlives the run. Argument checks run in-process (``parse_args``); runs that start workers run the script
in its own process group, so that a test that fails can still end every process it started.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest
from PIL import Image

from helpers.pipeline import data

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "fast_pipeline.py"


@pytest.fixture(scope="module")
def mod() -> Any:
    spec = importlib.util.spec_from_file_location("fast_pipeline_cli", SCRIPT)
    m = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(m)  # type: ignore[union-attr]
    return m


def _folder(root: Path, classes: int = 2, per_class: int = 3, size: int = 24) -> Path:
    rng = np.random.default_rng(0)
    for c in range(classes):
        (root / f"class{c}").mkdir(parents=True)
        for k in range(per_class):
            Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)).save(root / f"class{c}" / f"{k}.png")
    return root


BAD = {
    "--device banana": (["--device", "banana"], "--device banana"),
    "--device cuda:-1": (["--device", "cuda:-1"], "--device cuda:-1"),
    "--lr -1": (["--lr", "-1"], "--lr"),
    "--lr nan": (["--lr", "nan"], "--lr nan"),
    "--crop 100000": (["--crop", "100000"], "--crop 100000"),
    "--width 100000": (["--width", "100000"], "--width 100000"),
    "--workers 200 on 2 cores": (["--workers", "200"], "2 usable CPU cores"),
    "--prefetch-factor 1000000": (["--prefetch-factor", "1000000"], "--prefetch-factor 1000000"),
    "--timeout 0": (["--timeout", "0"], "--timeout"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_bad_argument_exits_2_with_one_line(
    case: str, mod: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(mod, "usable_cores", lambda: 2)
    args, words = BAD[case]
    with pytest.raises(SystemExit) as info:
        mod.parse_args([str(tmp_path), *args])
    err = capsys.readouterr().err.strip().splitlines()
    assert info.value.code == 2 and len(err) == 1 and words in err[0] and "error:" in err[0], err


def test_more_workers_than_cores_warns_in_one_line(
    mod: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(mod, "usable_cores", lambda: 2)
    args = mod.parse_args([str(tmp_path), "--workers", "6", "--device", "cpu"])
    err = capsys.readouterr().err.strip().splitlines()
    assert args.workers == 6 and len(err) == 1 and err[0].startswith("warning: --workers 6")


def test_a_one_class_folder_is_refused(mod: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = _folder(tmp_path / "one", classes=1)
    with pytest.raises(SystemExit) as info:
        mod.main([str(root), "--device", "cpu", "--workers", "0", "--batch-size", "2"])
    err = capsys.readouterr().err.strip().splitlines()
    assert info.value.code == 2 and len(err) == 1 and "1 class folder" in err[0] and "at least 2" in err[0], err


def test_16_bit_png_is_scaled_not_clipped(mod: Any, tmp_path: Path) -> None:
    root = _folder(tmp_path / "d")
    levels = np.linspace(0, 65535, 24 * 24).astype(np.uint16).reshape(24, 24)
    path = root / "class0" / "deep.png"
    Image.fromarray(levels).save(path)
    assert Image.open(path).mode.startswith("I")  # Pillow reads it as 16-bit greyscale
    ds = mod.image_folder(root, 8)
    got = np.asarray(ds.loader(str(path)))
    assert got.shape == (24, 24, 3)
    want = np.round(levels / 257)
    assert np.abs(got[..., 0].astype(float) - want).max() <= 1, "16-bit levels must map to 0-255"
    assert (got == 255).mean() < 0.01


def test_a_symlink_loop_is_not_followed_round(mod: Any, tmp_path: Path) -> None:
    root = _folder(tmp_path / "d", classes=2, per_class=3)
    os.symlink(root / "class0", root / "class0" / "again")  # class0/again -> class0: a loop
    os.symlink(root, root / "class1" / "up")  # class1/up -> the root: another loop
    ds = mod.image_folder(root, 8)
    assert len(ds) == 6, f"{len(ds)} images found in a folder of 6"


def _run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT
    )


def test_an_unreadable_image_exits_2_naming_the_file(tmp_path: Path) -> None:
    root = _folder(tmp_path / "d", classes=2, per_class=4)
    bad = root / "class1" / "broken.png"
    bad.write_bytes(b"not an image")
    out = _run(str(root), "--epochs", "1", "--workers", "1", "--batch-size", "9", "--crop", "16", "--device", "cpu")
    err = [ln for ln in out.stderr.splitlines() if ln.strip() and not ln.startswith("\r") and "epoch" not in ln]
    assert out.returncode == 2, out.stderr[-2000:]
    assert "Traceback" not in out.stderr and len(err) == 1 and str(bad) in err[0], out.stderr[-2000:]


# --- runs with workers: stopped, sleeping, interrupted ---------------------------------------------------------


class Run:
    """The script in its own process group; ``workers`` are its children once training started."""

    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(SCRIPT), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
            start_new_session=True,
        )
        self.proc.stdout.readline()  # type: ignore[union-attr]  # "N images in K classes ...": training starts

    def workers(self, n: int, wait_s: float = 30.0) -> list[psutil.Process]:
        deadline = time.monotonic() + wait_s
        while True:
            kids = psutil.Process(self.proc.pid).children()
            if len(kids) >= n or time.monotonic() > deadline:
                return kids
            time.sleep(0.1)

    def finish(self, timeout: float) -> tuple[int | None, str]:
        try:
            _out, err = self.proc.communicate(timeout=timeout)
            return self.proc.returncode, err
        except subprocess.TimeoutExpired:
            return None, ""
        finally:
            with_group = self.proc.returncode is None
            if with_group:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.communicate()


def _gone(procs: list[psutil.Process], wait_s: float = 5.0) -> bool:
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if all(not p.is_running() or p.status() == psutil.STATUS_ZOMBIE for p in procs):
            return True
        time.sleep(0.1)
    return False


@pytest.fixture(scope="module")
def shapes() -> Path:
    return data.make_shapes_dataset().train_dir


def test_a_stopped_worker_ends_the_run_in_one_line(shapes: Path) -> None:
    run = Run(str(shapes), "--epochs", "50", "--workers", "2", "--crop", "16", "--batch-size", "16", "--timeout", "3")
    workers = run.workers(2)
    assert len(workers) == 2
    workers[0].send_signal(signal.SIGSTOP)
    rc, err = run.finish(timeout=60)
    assert rc == 1, f"exit status {rc} (None: still running after 60 s)\n{err[-2000:]}"
    lines = [ln for ln in err.replace("\r", "\n").splitlines() if ln.strip() and not ln.startswith("epoch ")]
    assert len(lines) == 1 and "stopped (SIGSTOP" in lines[0], err[-2000:]  # torch's timeout or the watch
    assert _gone(workers), "a worker outlived the run"


def test_a_sleeping_worker_ends_the_run_in_one_line(tmp_path: Path) -> None:
    root = _folder(tmp_path / "d", classes=2, per_class=8)
    os.mkfifo(root / "class0" / "zz-never-written.png")  # opening it blocks for ever: a worker that sleeps
    run = Run(str(root), "--epochs", "3", "--workers", "1", "--crop", "16", "--batch-size", "4", "--timeout", "3")
    workers = run.workers(1)
    rc, err = run.finish(timeout=60)
    assert rc == 1, f"exit status {rc} (None: still running after 60 s)\n{err[-2000:]}"
    assert "no batch came from the worker processes in 3 s" in err and "Traceback" not in err, err[-2000:]
    assert _gone(workers)


@pytest.mark.parametrize("after_s", [0.0, 0.7, 2.0])
def test_ctrl_c_exits_130_in_one_line_and_leaves_no_worker(shapes: Path, after_s: float) -> None:
    run = Run(str(shapes), "--epochs", "50", "--workers", "2", "--crop", "16", "--batch-size", "16")
    time.sleep(after_s)
    workers = run.workers(2, wait_s=0 if after_s == 0 else 30)
    os.killpg(run.proc.pid, signal.SIGINT)  # as Ctrl-C in a terminal: the whole process group
    rc, err = run.finish(timeout=60)
    assert rc == 130, f"exit status {rc}\n{err[-2000:]}"
    lines = [ln for ln in err.replace("\r", "\n").splitlines() if ln.strip() and not ln.startswith("epoch ")]
    assert lines == ["interrupted; the worker processes were stopped"] or lines == ["interrupted"], err[-2000:]
    assert _gone(workers), "a worker outlived the run"


@pytest.mark.parametrize("after_s", [0.3, 1.0])
def test_ctrl_c_while_torch_loads_exits_130_in_one_line(shapes: Path, after_s: float) -> None:
    """A Ctrl-C in the seconds ``import torch`` takes printed a traceback through torch's import (issue #25.1)."""
    proc = subprocess.Popen(
        [sys.executable, "-X", "importtime", str(SCRIPT), str(shapes), "--epochs", "1", "--workers", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        start_new_session=True,
    )
    # -X importtime writes a line per module to stderr as it goes: wait until torch's import has begun
    assert proc.stderr is not None
    for line in proc.stderr:
        if line.rsplit("|", 1)[-1].strip() in ("torch._utils_internal", "torch.version"):
            break
    time.sleep(after_s)
    if proc.poll() is not None:
        pytest.skip("the run ended before the interrupt (a fast machine)")
    os.killpg(proc.pid, signal.SIGINT)
    try:
        _out, err = proc.communicate(timeout=60)
    finally:
        if proc.returncode is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    lines = [ln for ln in err.splitlines() if ln.strip() and not ln.startswith("import time:")]
    assert proc.returncode == 130 and lines == ["interrupted"], (proc.returncode, err[-2000:])


BUILD_PRESS = """
import gc, importlib.util, multiprocessing as mp, os, signal, sys
import torch
from torch.utils.data import DataLoader

spec = importlib.util.spec_from_file_location("fast_pipeline_cli", sys.argv[1])
m = importlib.util.module_from_spec(spec)
spec.loader.exec_module(m)


class PressWhileBuilding(type(mp.get_context("fork"))):
    def Queue(self, *args, **kwargs):  # the iterator's first step: Ctrl-C lands here
        os.kill(os.getpid(), signal.SIGINT)
        return super().Queue(*args, **kwargs)


loader = DataLoader(torch.arange(8), batch_size=2, num_workers=1, multiprocessing_context=PressWhileBuilding())
signal.signal(signal.SIGINT, m.INTERRUPT)
it = iter(loader)
print("built; pending", m.INTERRUPT.pending)
try:
    m.INTERRUPT.check()
except KeyboardInterrupt:
    print("raised after the step")
del it
gc.collect()
"""


def test_a_press_while_the_iterator_is_built_is_raised_after_it() -> None:
    """Ctrl-C inside the iterator's __init__ is kept: no half-built iterator, no "Exception ignored" (#25)."""
    done = subprocess.run([sys.executable, "-c", BUILD_PRESS, str(SCRIPT)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "built; pending True" in done.stdout and "raised after the step" in done.stdout
    assert "Exception ignored" not in done.stderr, done.stderr[-2000:]
