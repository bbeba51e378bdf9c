"""Robustness of the live panels (helpers.ui.widgets.Panel), driven from Python.

What a reader can do to a panel, and what must hold afterwards:

* double-click **Run**: one run starts, the second click is ignored;
* click while a run is in progress: ignored;
* interrupt a run (Kernel > Interrupt, i.e. ``KeyboardInterrupt``), also in the
  middle of a DataLoader with worker processes: the panel says so, the button
  works again, no worker process is left, and the panel still shows the last
  complete run (no half-drawn output, no half-recorded history);
* press Run 50 times: the number of child processes stays flat and memory
  stays within a small bound;
* enter values out of range: refused, with a message that names the control.

The data set used with workers is ``helpers.chapters.ch04.datasets.CheapDataset`` (importable,
so the test holds for spawn/forkserver too).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any, Iterator

import ipywidgets as W
import psutil
import pytest

from helpers.chapters.ch04.datasets import CheapDataset
from helpers.core.validate import check_int
from helpers.pipeline import loaders
from helpers.ui.widgets import Panel


def _settle_children(expected: int, timeout_s: float = 10.0) -> list[Any]:
    """Worker processes of this process, after giving exiting ones up to ``timeout_s`` to go."""
    deadline = time.monotonic() + timeout_s
    while True:
        procs = [p for p in loaders.worker_processes() if p.status() != psutil.STATUS_ZOMBIE]
        if len(procs) <= expected or time.monotonic() > deadline:
            return procs
        time.sleep(0.1)


@pytest.fixture
def sigint_default() -> Iterator[None]:
    """Make SIGINT raise KeyboardInterrupt in the main thread, as in an IPython kernel."""
    old = signal.getsignal(signal.SIGINT)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)


def _plot(history: list[Any], ax: Any) -> None:
    ax.bar(range(len(history)), [r.result["items"] for r in history])
    ax.set_xlabel("run")
    ax.set_ylabel("items")


class LoaderRun:
    """A panel run function: a DataLoader with workers over CheapDataset, optionally interrupted."""

    def __init__(self) -> None:
        self.interrupt_after: int | None = None  # batches; None = run to the end
        self.real_signal = False  # True: send SIGINT to ourselves, as the kernel does

    def __call__(self, progress: Any, *, num_workers: int, batches: int) -> dict[str, Any]:
        ds = CheapDataset(512, image_size=8, output="uint8", bank=8)
        loader = loaders.build_loader(ds, batch_size=8, num_workers=num_workers)
        seen = 0

        def consume(batch: Any) -> None:
            nonlocal seen
            seen += 1
            if self.interrupt_after is not None and seen >= self.interrupt_after:
                if self.real_signal:
                    os.kill(os.getpid(), signal.SIGINT)
                    time.sleep(0.5)  # the handler raises KeyboardInterrupt here
                raise KeyboardInterrupt

        res = loaders.measure_throughput(loader, batches=batches, warmup=1, consume=consume, progress=progress)
        return {"items": res.items, "items_per_s": res.items_per_s}


def _loader_panel(run: LoaderRun, workers: int = 2) -> Panel:
    return Panel(
        "loader",
        {
            "num_workers": W.IntSlider(value=workers, min=0, max=4, description="workers"),
            "batches": W.IntSlider(value=6, min=1, max=200, description="batches"),
        },
        run,
        summarize=lambda r: f"{r['items']} items",
        plot=_plot,
    )


def _counting_panel(seconds: float = 0.0) -> tuple[Panel, list[dict[str, Any]]]:
    calls: list[dict[str, Any]] = []

    def run(progress: Any, *, n: int, mode: str) -> dict[str, Any]:
        check_int("n", n, 1, 50)  # a chapter's panel_run refuses what it can't run before it starts anything
        calls.append({"n": n, "mode": mode})
        progress(0.5, "half way")
        if seconds:
            time.sleep(seconds)
        return {"items": n}

    panel = Panel(
        "counting",
        {
            "n": W.IntSlider(value=10, min=1, max=100, description="n"),
            "mode": W.Dropdown(options=["a", "b"], value="a", description="mode"),
        },
        run,
        summarize=lambda r: f"{r['items']} items",
        plot=_plot,
    )
    return panel, calls


# -- clicks -------------------------------------------------------------------------


def test_double_click_starts_one_run() -> None:
    panel, calls = _counting_panel(seconds=0.05)
    panel.button.click()
    panel.button.click()  # arrives right after the first run ended: a double-click
    assert len(calls) == 1  # the second click was ignored: no run started for it
    assert len(panel.history) == 1 and panel.error is None
    time.sleep(panel.debounce_s + 0.05)
    panel.button.click()  # a deliberate later click runs again
    assert len(calls) == 2 and len(panel.history) == 2


def test_click_while_running_is_ignored() -> None:
    started, release = threading.Event(), threading.Event()
    calls = []

    def run(progress: Any, *, n: int) -> int:
        calls.append(n)
        started.set()
        assert release.wait(10)
        return n

    panel = Panel("busy", {"n": W.IntSlider(value=3, min=1, max=9)}, run)
    t = threading.Thread(target=panel.button.click)
    t.start()
    assert started.wait(10)
    assert panel.busy and panel.button.disabled
    panel.button.click()  # the reader clicks again while the first run is in progress
    assert panel.click() is None
    release.set()
    t.join(10)
    assert calls == [3]  # both clicks during the run were ignored: one run started
    assert not panel.busy and not panel.button.disabled


# -- interruption ----------------------------------------------------------------------


@pytest.mark.parametrize("real_signal", [False, True], ids=["KeyboardInterrupt", "SIGINT"])
def test_interrupt_releases_workers_and_keeps_last_complete_run(real_signal: bool, sigint_default: None) -> None:
    baseline = len(_settle_children(expected=10**6, timeout_s=0))
    run = LoaderRun()
    panel = _loader_panel(run, workers=2)
    first = panel.click()
    assert first is not None and panel.error is None, panel.error
    outputs_before = panel.out.outputs
    assert any(o.get("output_type") == "display_data" for o in outputs_before)

    run.interrupt_after, run.real_signal = 3, real_signal
    panel.set(batches=50)
    assert panel.click() is None
    assert panel.error is not None and panel.error.startswith("Interrupted"), panel.error
    assert "Interrupted" in panel.status.value
    assert not panel.busy and not panel.button.disabled
    # No half-drawn state: the history and the output still show the last complete run.
    assert len(panel.history) == 1 and panel.history[-1] is first
    assert panel.out.outputs == outputs_before
    # No worker process left behind.
    left = _settle_children(expected=baseline)
    assert len(left) <= baseline, f"worker processes left after an interrupted run: {[p.pid for p in left]}"

    run.interrupt_after = None  # the reader presses Run again: it works
    again = panel.click()
    assert again is not None and panel.error is None and len(panel.history) == 2


def test_interrupt_while_drawing_leaves_no_half_drawn_output() -> None:
    state = {"interrupt": False}

    def plot(history: list[Any], ax: Any) -> None:
        ax.plot([r.result for r in history])
        if state["interrupt"]:
            raise KeyboardInterrupt

    panel = Panel(
        "draw",
        {"n": W.IntSlider(value=1, min=1, max=9)},
        lambda progress, n: n,
        summarize=lambda r: f"value {r}",
        plot=plot,
    )
    assert panel.click() is not None
    outputs_before, history_before = panel.out.outputs, list(panel.history)
    state["interrupt"] = True
    panel.set(n=2)
    assert panel.click() is None
    assert panel.error is not None and panel.error.startswith("Interrupted")
    assert panel.out.outputs == outputs_before, "an interrupted redraw left a half-drawn output"
    assert panel.history == history_before, "an interrupted redraw left a run in the history that is not shown"
    state["interrupt"] = False
    rec = panel.click()
    assert rec is not None and rec.index == 2


# -- many runs -------------------------------------------------------------------------


@pytest.mark.slow
def test_fifty_reruns_keep_processes_and_memory_flat() -> None:
    run = LoaderRun()
    panel = _loader_panel(run, workers=2)
    panel.set(batches=3)
    proc = psutil.Process()
    for _ in range(5):  # warm-up: imports, matplotlib fonts, allocator pools
        assert panel.click() is not None, panel.error
    baseline_children = len(_settle_children(expected=0, timeout_s=5))
    rss0 = proc.memory_info().rss
    counts = []
    for i in range(50):
        panel.set(num_workers=1 + i % 2)
        rec = panel.click()
        assert rec is not None, panel.error
        counts.append(len(_settle_children(expected=baseline_children, timeout_s=5)))
    growth = proc.memory_info().rss - rss0
    assert max(counts) <= baseline_children, f"child processes grew over 50 runs: {counts}"
    assert len(panel.history) == panel.max_history
    assert len(panel.out.outputs) <= 2  # one summary line, one plot
    assert growth < 64 * 2**20, f"memory grew by {growth / 2**20:.1f} MiB over 50 runs"


# -- invalid values --------------------------------------------------------------------


def test_out_of_range_values_are_refused_with_a_message() -> None:
    panel, calls = _counting_panel()
    with pytest.raises(ValueError, match=r"n must be in \[1, 100\]"):
        panel.set(n=1000)
    with pytest.raises(ValueError, match=r"n must be in \[1, 100\]"):
        panel.set(n=0)
    with pytest.raises(ValueError, match=r"mode must be one of \['a', 'b'\]"):
        panel.set(mode="c")
    with pytest.raises(ValueError, match="unknown control"):
        panel.set(size=3)
    assert calls == [] and panel.history == []


def test_validate_refusal_shows_in_the_panel() -> None:
    panel, calls = _counting_panel()
    panel.set(n=80)  # allowed by the slider, refused by the run's own check
    assert panel.click() is None
    assert calls == [], "the run went on although it refused the values"
    assert panel.error is not None and "n" in panel.error and "[1, 50]" in panel.error, panel.error
    assert panel.error.startswith("Can't run with these settings")
    assert "Can&#x27;t run" in panel.status.value or "Can't run" in panel.status.value
    assert not panel.busy and not panel.button.disabled and panel.history == []
    panel.set(n=20)
    assert panel.click() is not None and panel.error is None


def test_run_refusing_values_shows_in_the_panel() -> None:
    run = LoaderRun()
    panel = _loader_panel(run, workers=0)
    panel.controls["num_workers"].max = 1000  # let the control through; the helper must refuse
    panel.set(num_workers=999)
    assert panel.click() is None
    assert panel.error is not None and "num_workers" in panel.error, panel.error
    assert not panel.busy and panel.history == []


# -- a real kernel interrupt ----------------------------------------------------------------

_KERNEL_SETUP = r"""
import json, os, time
import ipywidgets as W
from helpers.pipeline import loaders
from helpers.chapters.ch04.datasets import CheapDataset, SpinDataset
from helpers.ui.widgets import Panel

FLAG = {flag!r}

def consume(batch):
    if not os.path.exists(FLAG):
        open(FLAG, "w").close()

def run(progress, n):
    ds = SpinDataset(CheapDataset(4096, image_size=8, output="uint8", bank=8), 5.0)
    loader = loaders.build_loader(ds, batch_size=8, num_workers=2)
    return loaders.measure_throughput(loader, batches=n, warmup=1, consume=consume, progress=progress).items

panel = Panel("interrupt me", {{"n": W.IntSlider(value=400, min=1, max=1000)}}, run, summarize=str)
"""

_KERNEL_CHECK = r"""
time.sleep(1.0)
print(json.dumps({"error": panel.error, "busy": panel.busy, "disabled": panel.button.disabled,
                  "history": len(panel.history), "workers": [p.pid for p in loaders.worker_processes()]}))
"""


def _execute(kc: Any, code: str, timeout: float = 120.0) -> tuple[str, str]:
    """Run code in the kernel; return (reply status, collected stdout)."""
    msg_id = kc.execute(code)
    out = []
    while True:
        msg = kc.get_iopub_msg(timeout=timeout)
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        if msg["msg_type"] == "stream" and msg["content"]["name"] == "stdout":
            out.append(msg["content"]["text"])
        if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
            break
    reply = kc.get_shell_msg(timeout=timeout)
    return reply["content"]["status"], "".join(out)


@pytest.mark.slow
def test_kernel_interrupt_during_a_loader_run(tmp_path: Any) -> None:
    """Kernel > Interrupt (SIGINT to the kernel's process group) while a panel's DataLoader runs."""
    import json

    from jupyter_client.manager import start_new_kernel

    flag = tmp_path / "first-batch"
    km, kc = start_new_kernel(kernel_name="python3", env={**os.environ, "WORKBOOK_QUICK": "1"})
    try:
        status, _ = _execute(kc, _KERNEL_SETUP.format(flag=str(flag)))
        assert status == "ok"
        msg_id = kc.execute("panel.click()")
        deadline = time.monotonic() + 60
        while not flag.exists():
            assert time.monotonic() < deadline, "the panel's run never got its first batch"
            time.sleep(0.1)
        time.sleep(0.5)
        km.interrupt_kernel()
        while True:  # the click's reply: the panel catches the interrupt, so the cell itself is fine
            reply = kc.get_shell_msg(timeout=60)
            if reply["parent_header"].get("msg_id") == msg_id:
                break
        assert reply["content"]["status"] == "ok", reply["content"]
        status, out = _execute(kc, _KERNEL_CHECK)
        assert status == "ok", out
        state = json.loads(out.strip().splitlines()[-1])
        assert state["error"] and state["error"].startswith("Interrupted"), state
        assert not state["busy"] and not state["disabled"] and state["history"] == 0, state
        assert state["workers"] == [], f"DataLoader workers left after Kernel > Interrupt: {state['workers']}"
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
