"""Failures of DataLoader worker processes in plain words (what happened, what to check). Text only, in the lowest
layer, so the live panel gives the same advice for any run, the reader's own loop included."""

from __future__ import annotations

import re
import signal

#: Start of the note a worker adds to a data set's exception: which item raised it (the loaders add it in the worker).
ITEM_NOTE = "[workbook] failing item:"


class LoaderFailure(RuntimeError):
    """A loader's workers failed in a known way: what happened and what to check (torch's error is the cause)."""


_DEAD_WORKER_ADVICE = (
    "A DataLoader worker process died without raising a Python error. What to check: "
    "(1) the out-of-memory killer: `dmesg | tail` or `journalctl -k | grep -i oom` names the killed pid; "
    "use fewer workers, a smaller batch_size or prefetch_factor; "
    "(2) /dev/shm: `df -h /dev/shm` - a full one kills workers with a bus error (SIGBUS); in Docker start the "
    "container with --shm-size=2g or --ipc=host; "
    "(3) a crash (segfault) in a native library used by the data set (an image decoder, OpenCV, a "
    "library not safe after fork): run the loader with num_workers=0 to see the error in the main process."
)


_SIGNAL_BY_TEXT = {signal.strsignal(sig) or sig.name: sig for sig in signal.Signals}


_CRASHES = (signal.SIGSEGV, signal.SIGILL, signal.SIGABRT, signal.SIGFPE)
#: What a worker's exit status says: 0, "exit" (> 0), a signal by number, "crash" (_CRASHES), "signal" (any other).
_ENDED = {
    0: "{who} exited cleanly (exit code 0) while the main process still waited for its batches: code in the data "
    "set, collate_fn or worker_init_fn ended the process (os._exit(), sys.exit()), or a Ctrl-C reached the worker "
    "while it started. What to check: exit calls in that code; run with num_workers=0 to see where it happens.",
    "exit": "{who} exited with code {code} without a Python error reaching the main process. Under spawn or "
    "forkserver (the default on macOS and Windows, and on Linux from Python 3.14) the usual cause is a worker that "
    "could not import the data set, collate_fn or worker_init_fn: a class or function defined in a notebook or in "
    "__main__. Its error went to the worker's stderr (the terminal that runs Jupyter), not here; define them in a "
    "module you import. Otherwise sys.exit({code}) or os._exit() in that code, or a native library that called "
    "exit(): run with num_workers=0 to see where it happens.",
    signal.SIGKILL: "{who} was killed (SIGKILL), most often by the out-of-memory killer. What to check: `dmesg | "
    "tail` or `journalctl -k | grep -i oom` names the killed pid; use fewer workers, a smaller batch_size or "
    "prefetch_factor.",
    signal.SIGBUS: "{who} was killed by SIGBUS (Bus error), usually a full /dev/shm, where workers put their "
    "batches. What to check: `df -h /dev/shm`; in Docker start the container with --shm-size=2g or --ipc=host; "
    "or use fewer workers, a smaller batch_size or prefetch_factor.",
    "crash": "{who} crashed ({name}: a segfault or abort in native code) - an image decoder, OpenCV or another "
    "library used by the data set, or one not safe after fork. What to check: run with num_workers=0 to see the "
    "crash in the main process; try multiprocessing_context='spawn'.",
    "signal": "{who} was ended by {name}, sent from outside the loader (another program, a job scheduler's time "
    "or memory limit, a user). What to check: what sends it; then run again.",
}


def ended_in_words(worker: int | None, pid: int | str | None, code: int) -> str:
    """One line for a worker that ended with exit status ``code`` (``multiprocessing``'s: ``-N`` = signal N)."""
    sig = -code
    try:
        name = signal.Signals(sig).name
    except ValueError:
        name = f"signal {sig}"
    kind = "exit" if code > 0 else sig if sig in _ENDED else "crash" if sig in _CRASHES else "signal"  # 0: clean
    who = (
        f"Worker {worker} (pid {pid})"
        if worker is not None
        else "A worker" + (f" (pid {pid})" if pid is not None else "")
    )
    return _ENDED[kind].format(who=who, code=code, name=name)


def raised_in_worker(exc: BaseException) -> re.Match[str] | None:
    """torch's re-raised worker exception (``Caught ValueError in DataLoader worker process 0. Original ...``)."""
    return re.match(r"Caught (\w+) in DataLoader worker process (\d+)", str(exc))


def _worker_error_in_words(exc: BaseException, m: re.Match[str]) -> str:
    etype, worker = m.group(1), m.group(2)
    lines = [ln.rstrip() for ln in str(exc).splitlines()]
    note = next((ln[len(ITEM_NOTE) :].strip() for ln in lines if ln.startswith(ITEM_NOTE)), None)
    pat = re.compile(rf"^(?:[\w.]+\.)?{re.escape(etype)}(?::\s*(.*))?$")
    said = [mm.group(1) or "" for mm in map(pat.match, lines) if mm]
    what = f"{etype}: {said[-1]}" if said and said[-1] else etype
    if note is None:
        where, check = "a batch", "run the loader with num_workers=0 to see the full traceback in the main process"
    elif note.startswith("none"):
        where, check = "a batch whose items each load on their own", "the collate_fn (run it on that batch)"
    else:
        where = f"item {note}"
        check = f"the data set's __getitem__ for that item: run dataset[{note}] in the main process to see it"
    return f"Worker {worker} raised {what} while loading {where}. What to check: {check} (details below)."


def explain_loader_error(exc: BaseException) -> str | None:
    """One line of plain words (what happened, which worker and item where known, what to check) for a known
    DataLoader failure: a timeout, a dead worker, the data set's exception in a worker, a dead pin-memory
    thread; ``None`` for anything else."""
    text = str(exc)
    m = re.search(r"DataLoader timed out after ([\d.]+) seconds", text)
    if m:
        return (
            f"No batch arrived from the worker processes within {float(m.group(1)):g} s, so the run was stopped "
            "and its workers ended. A worker is frozen (stopped with SIGSTOP or Ctrl-Z, deadlocked) or extremely "
            "slow (network storage, an item that takes minutes). Check with `top` or `ps` that the workers use "
            "CPU; run with num_workers=0 to time one item in the main process."
        )
    raised = raised_in_worker(exc)
    if raised:
        return _worker_error_in_words(exc, raised)
    killed = re.search(r"DataLoader worker \(pid ?([^)]*)\) is killed by signal: ([^.\n]+)", text)
    if killed:
        sig = _SIGNAL_BY_TEXT.get(killed.group(2).strip())
        if sig is not None:
            return ended_in_words(None, killed.group(1).strip(), -int(sig))
        return f"A worker was killed by a signal ({killed.group(2).strip()}). " + _DEAD_WORKER_ADVICE
    if "exited unexpectedly" in text:
        ours = re.search(r"worker (\d+) \(pid (\d+)\): exit code (-?\d+)", text)  # _WatchedIter's suffix
        if ours:
            return ended_in_words(int(ours.group(1)), ours.group(2), int(ours.group(3)))
        code = re.search(r"\(pid ?([^)]*)\) exited unexpectedly with exit code (-?\d+)", text)  # torch's SIGCHLD
        if code:
            return ended_in_words(None, code.group(1).strip(), int(code.group(2)))
        return _DEAD_WORKER_ADVICE
    if "Pin memory thread exited unexpectedly" in text:
        return (
            "The loader's pin-memory thread died. Pinning needs page-locked host memory: check free memory "
            "and the locked-memory limit (`ulimit -l`), or run with pin_memory=False."
        )
    return None
