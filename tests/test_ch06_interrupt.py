"""Chapter 06's panel interrupted (Ctrl-C, the kernel's interrupt) leaves no worker (issue 25, item 1).

A child Python process runs the panel's job with workers (persistent, and not), as a kernel would, and is
sent SIGINT (by itself, from inside the reader's ``train_step`` at its N-th call: a deterministic offset in
the warm-up, the timed epoch or a later run). It catches the KeyboardInterrupt as a kernel does, then waits
8 s (in a kernel, an error "DataLoader worker ... exited unexpectedly" arrived 7 s after the interrupt) and
reports its worker processes and any error that arrived meanwhile. (An interrupt that lands while a worker
is being forked is ``helpers.pipeline.loaders``' to handle, at worker start.)
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

CHILD = textwrap.dedent(
    """
    import os, signal, sys, time
    import psutil
    from helpers.chapters import ch06
    from helpers.chapters.ch06 import job
    from helpers.pipeline.loaders import worker_processes
    spec = job.job_spec("data-bound", width=2, depth=1, batch_size=8, crop_size=32, train_items=400, warm_steps=1,
                      warm_passes=1)
    job.train_items(spec)  # the data set exists before the first job
    ref = job.reference_pipeline("cpu")
    AT, calls = int(sys.argv[1]), [0]

    def train_step(model, optimizer, x, y):
        calls[0] += 1
        if calls[0] == AT:
            os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C, arriving here
        return ref.train_step(model, optimizer, x, y)

    pipe = job.Pipeline(ref.make_loader, ref.batches, train_step, ref.normalize, source="the test's")
    print("ready", flush=True)
    try:
        for k in range(4):
            ch06.panel_run(None, device="cpu", regime="data-bound", specs={"data-bound": spec}, pipeline=pipe,
                           workers=True, persistent=bool(k % 2))
        print("not interrupted", flush=True)
    except KeyboardInterrupt:
        print("interrupted", flush=True)
    late = None
    try:
        time.sleep(8)
    except BaseException as exc:  # what arrives late: a worker's death reported by torch's SIGCHLD handler
        late = f"{type(exc).__name__}: {exc}"
    left = [p.pid for p in worker_processes() if p.status() != psutil.STATUS_ZOMBIE]
    print(f"left={left} late={late}", flush=True)
    """
)


@pytest.mark.parametrize("at", [1, 5, 100])  # run 1: warm-up, timed epoch; run 2 (persistent): timed epoch
def test_an_interrupted_panel_run_leaves_no_worker_and_no_late_error(at: int) -> None:
    env = {**os.environ, "WORKBOOK_QUICK": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(at)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=ROOT,
    )
    try:
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert "interrupted" in out, out + err[-2000:]
    assert "left=[] late=None" in out, out + err[-2000:]
