"""Worker processes that can't hang, leak or lose a Ctrl-C: started with signals held, watched (an ended or frozen
worker noticed), stopped (:func:`release`, :func:`_finish`), failures in one plain line, ``/dev/shm`` and core limits.
torch has no public way to close an iterator, watch its workers or name a failing item: each private name says why.
"""

from __future__ import annotations

import contextlib
import gc
import multiprocessing as mp
import os
import re
import shutil
import signal
import sys
import threading
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import psutil
import torch
from torch.utils.data import DataLoader
from torch.utils.data._utils import MP_STATUS_CHECK_INTERVAL
from torch.utils.data.dataloader import _MultiProcessingDataLoaderIter

from ..core.config import usable_cpu_cores as cpu_cores  # the one core count
from ..core.failures import ITEM_NOTE, LoaderFailure, ended_in_words, explain_loader_error
from ..core.validate import check_int, human_bytes, wrap

#: Upper bound accepted for ``num_workers`` (beyond this a typo is more likely than intent).
MAX_WORKERS = 64

#: Seconds a shutdown waits for worker or pool processes before it kills them.
SHUTDOWN_GRACE_S = 3.0
#: Seconds between two checks that every worker is alive while the main process waits for a batch.
_ALIVE_CHECK_S = 0.25
#: torch's SIGCHLD handler's words for a worker that ended (``_error_if_any_worker_fails``).
_TORCH_WORKER_DIED = re.compile(r"DataLoader worker \(pid[^)]*\) (is killed by signal|exited unexpectedly)")
#: The same handler's words for one worker a signal ended, its pid captured.
_KILLED_BY_SIGNAL = re.compile(r"DataLoader worker \(pid (\d+)\) is killed by signal")


def reset_child_signals() -> None:
    """In a child: SIGTERM default, SIGINT ignored. Inherited, the parent's SIGTERM handler would raise
    ``KeyboardInterrupt`` inside a pool worker holding a queue lock: a hang."""
    for sig, handler in ((signal.SIGTERM, signal.SIG_DFL), (signal.SIGINT, signal.SIG_IGN)):
        with contextlib.suppress(ValueError, OSError):  # not the main thread of the child
            signal.signal(sig, handler)


def _name_failing_items() -> None:
    """In a worker: a data set's exception gets a note naming the item (torch's fetcher patched: no public hook;
    tests/test_loader_failure_words.py's ``value`` case)."""
    from torch.utils.data._utils import fetch

    cls = fetch._MapDatasetFetcher
    if getattr(cls.fetch, "_workbook", False):
        return
    original = cls.fetch

    def fetch_naming_the_item(self: Any, index: Any) -> Any:
        try:
            return original(self, index)
        except Exception as exc:
            if not hasattr(exc, "add_note"):  # Python 3.10: no notes, so no item is looked for
                raise
            with contextlib.suppress(Exception):  # naming the item never replaces the data set's own error
                batch = list(index)[:1024] if self.auto_collation else []
                item = "none (each item loads on its own: the collate function raised)" if batch else repr(index)
                for idx in batch:  # the first item of the batch that fails on its own
                    try:
                        self.dataset[idx]
                    except Exception:
                        item = repr(idx)
                        break
                exc.add_note(f"{ITEM_NOTE} {item}")
            raise

    fetch_naming_the_item._workbook = True  # type: ignore[attr-defined]
    cls.fetch = fetch_naming_the_item  # type: ignore[method-assign]


class _WorkerInit:
    """Every loader's ``worker_init_fn``: signal handlers reset, failing items named, then ``fn`` (picklable)."""

    def __init__(self, fn: Callable[[int], None] | None) -> None:
        self.fn = fn

    def __call__(self, worker_id: int) -> None:
        reset_child_signals()
        _name_failing_items()
        if self.fn is not None:
            self.fn(worker_id)


class HeldSignals:
    """``with HeldSignals() as held:`` SIGINT/SIGTERM only noted; ``held.deliver()`` then runs their handler. An
    exception raised in an at-fork callback or a finalizer is printed as "Exception ignored" and the press lost
    (outside a hold, :func:`_resend_dropped_interrupts` sends it again, later).
    ``escape=True``: a second signal is handled at once (ends a slow teardown)."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, *, escape: bool = False) -> None:
        self.saved: dict[int, Callable[..., Any]] = {}
        self.noted: list[int] = []
        self.escape = escape

    def _note(self, signum: int, frame: Any) -> None:
        self.noted.append(signum)
        if self.escape and len(self.noted) > 1 and signum in self.saved:
            self.noted.clear()
            self.saved[signum](signum, frame)

    def __enter__(self) -> "HeldSignals":
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                handler = signal.getsignal(sig)
                if callable(handler):
                    self.saved[sig] = handler
                    signal.signal(sig, self._note)
        return self

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self.saved.items():
            signal.signal(sig, handler)

    def deliver(self) -> None:
        if self.noted:
            sig = self.noted[0]
            self.noted.clear()
            self.saved[sig](sig, None)


#: The line :func:`_resend_dropped_interrupts` writes to stderr (tests/test_interrupt_battery.py counts them).
RESENT = "[workbook] a Ctrl-C that Python dropped in a finalizer was sent again"


def _interrupt_main_thread() -> None:
    """SIGINT to the main thread itself, if Python handles it there: a read or sleep it blocks in ends (EINTR) and
    the handler runs (``_thread.interrupt_main`` only marks it pending, unseen until that call returns)."""
    if callable(signal.getsignal(signal.SIGINT)):
        signal.pthread_kill(threading.main_thread().ident or 0, signal.SIGINT)


def _resend_dropped_interrupts(hook: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """A ``sys.unraisablehook``: Python runs a Ctrl-C's handler wherever the main thread is, a weakref callback or a
    finalizer included, and there its ``KeyboardInterrupt`` is dropped ("Exception ignored in ...", the press lost:
    tests/test_interrupt_battery.py saw it in multiprocessing's ``WeakValueDictionary``). This sends SIGINT to the
    main thread again, so ordinary code raises it; every other unraisable exception goes to ``hook``. A timer thread
    sends it, 50 ms on: sent from here, the handler would run at once, inside this hook, and the press be lost
    again (one that lands in a finalizer again comes back here and is sent once more)."""

    def resend(unraisable: Any) -> None:
        handled = callable(signal.getsignal(signal.SIGINT))  # not where SIGINT is ignored or has its default action
        if unraisable.exc_type is KeyboardInterrupt and handled and not sys.is_finalizing():
            print(RESENT, file=sys.stderr)
            timer = threading.Timer(0.05, _interrupt_main_thread)
            timer.daemon = True
            timer.start()
        else:
            hook(unraisable)

    resend.workbook_resends = True  # type: ignore[attr-defined]
    return resend


if not getattr(sys.unraisablehook, "workbook_resends", False):  # once per interpreter, whatever reloads this module
    sys.unraisablehook = _resend_dropped_interrupts(sys.unraisablehook)


class _FreezeWatch(threading.Thread):
    """Kills a worker stopped (SIGSTOP) longer than the loader's timeout, its pid noted in ``frozen``; ends when no
    worker is left (psutil). ``DataLoader(timeout=...)`` misses the shared-memory hand-over: the main process fetches
    each descriptor from a frozen worker forever (tests/test_loader_failures.py's ``..._frozen_after_handing...``)."""

    def __init__(self, pids: list[int], timeout_s: float, frozen: list[int]) -> None:
        super().__init__(name="workbook-freeze-watch", daemon=True)
        self.procs: list[psutil.Process] = []
        for pid in pids:  # a psutil.Process keeps its start time: a reused pid is never taken for the worker
            with contextlib.suppress(psutil.Error):
                self.procs.append(psutil.Process(pid))
        self.timeout_s, self.frozen = float(timeout_s), frozen

    def run(self) -> None:
        # Python runs handlers in the main thread only: a Ctrl-C the kernel gave this thread would wait there, unseen
        # while the main thread blocks in a read (a worker's batch hand-over), so this thread never takes one.
        signal.pthread_sigmask(signal.SIG_BLOCK, HeldSignals.SIGNALS)
        since: dict[int, float] = {}
        while True:
            time.sleep(min(0.5, self.timeout_s / 2))
            status = {}
            for p in self.procs:
                with contextlib.suppress(psutil.Error):
                    if p.is_running():
                        status[p] = p.status()
            if all(st == psutil.STATUS_ZOMBIE for st in status.values()):
                return
            now = time.monotonic()
            for p, st in status.items():
                if st != psutil.STATUS_STOPPED:
                    since.pop(p.pid, None)
                elif now - since.setdefault(p.pid, now) > self.timeout_s:
                    self.frozen.append(p.pid)
                    with contextlib.suppress(psutil.Error):
                        p.kill()  # psutil checks the pid is still this worker's


class _WatchedIter(_MultiProcessingDataLoaderIter):
    """torch's worker iterator, waiting in slices of :data:`_ALIVE_CHECK_S`: a worker that ended (even with exit
    code 0, which torch's SIGCHLD handler ignores) is noticed at once (``DataLoader(timeout=...)`` alone fails
    tests/test_loader_failures.py's exit-0 case)."""

    _workbook_frozen: list[int]  # the loader's: pids _FreezeWatch killed

    def _try_get_data(self, timeout: float = MP_STATUS_CHECK_INTERVAL) -> tuple[bool, Any]:
        deadline = time.monotonic() + timeout
        while True:
            try:
                ok, data = super()._try_get_data(max(0.0, min(_ALIVE_CHECK_S, deadline - time.monotonic())))
            except RuntimeError as exc:
                if "exited unexpectedly" in str(exc):
                    ws = enumerate(self._workers)
                    exits = [
                        f"worker {i} (pid {w.pid}): exit code {w.exitcode}" for i, w in ws if w.exitcode is not None
                    ]
                    raise RuntimeError(f"{exc} ({'; '.join(exits) or 'no exit status'})") from exc
                raise
            if ok or time.monotonic() >= deadline:
                return ok, data

    def _shutdown_workers(self) -> None:
        try:  # torch's own, whose `finally` ends every worker even when this raises
            super()._shutdown_workers()
        except RuntimeError as exc:  # from __del__, an "Exception ignored" line: torch's SIGCHLD handler, raising for
            killed = _KILLED_BY_SIGNAL.search(str(exc))  # the stopped worker _FreezeWatch ended while torch joined it
            if killed is None or int(killed.group(1)) not in self._workbook_frozen:  # any other worker's: raised
                raise
            for q in getattr(self, "_index_queues", []):  # the rest of torch's shutdown, skipped by the raise
                with contextlib.suppress(Exception):
                    q.cancel_join_thread()
                    q.close()


class _WorkbookLoader(DataLoader):
    """A DataLoader whose worker start can't leak or lose an interrupt: a Ctrl-C during ``_get_iterator`` (where
    torch starts workers; no public hook) is held until all are up, then they are stopped and it is raised
    (tests/test_interrupt_battery.py)."""

    _workbook_frozen: list[int]  # pids _FreezeWatch killed
    _workbook_warnings: list[str]
    _workbook_workers: list[Any]  # the latest iterator's worker processes (worker id = position)

    def _get_iterator(self) -> Any:
        if self.num_workers == 0:
            return super()._get_iterator()
        before = _worker_children()
        self._workbook_frozen = []  # this iterator's (an earlier one's watch and shutdown keep their own list)
        it = None
        held = HeldSignals()
        try:
            with held:
                self.check_worker_number_rationality()
                it = _WatchedIter.__new__(_WatchedIter)
                it._workbook_frozen = self._workbook_frozen
                it.__init__(self)  # type: ignore[misc]
            self._workbook_workers = list(it._workers)
            held.deliver()  # a Ctrl-C that came while the workers started: raised here, with `it` known
            if self.timeout > 0:
                _FreezeWatch([w.pid for w in self._workbook_workers], self.timeout, self._workbook_frozen).start()
            return it
        except BaseException:
            _finish([it] if it is not None else [], before)
            raise


# -- how many workers this machine takes --------------------------------------------------------------------------


#: Workers per CPU core beyond which a reader's request is refused (:func:`check_workers_for_cores`).
WORKERS_PER_CORE = 4


def check_workers_for_cores(num_workers: int) -> int:
    """``num_workers``, or a one-line ValueError above :data:`WORKERS_PER_CORE` per core (at least 8)."""
    cores = cpu_cores()
    limit = max(8, WORKERS_PER_CORE * cores)
    if num_workers > limit:
        raise ValueError(
            f"num_workers={num_workers} is far more than this machine's {cores} CPU cores: each worker is a whole "
            f"process, and beyond a few per core they only add start-up time and memory. Choose at most {limit} "
            f"here ({WORKERS_PER_CORE} per core); the best count is usually near the number of cores."
        )
    return num_workers


def load_note() -> str:
    """How busy this machine is: above one runnable process per core, throughput figures understate."""
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):  # pragma: no cover - Windows
        return "Load average: not available on this platform."
    cores = cpu_cores()
    text = f"Load average (1 min): {load:.1f} on {cores} cores."
    if load > cores:
        text += (
            "\nOther programs compete for the cores right now, so the figures below understate what these "
            "settings\ngive on an idle machine; re-run later to compare."
        )
    return text


# -- /dev/shm, where workers hand batches over ----------------------------------------------------------------


@dataclass
class ShmStatus:
    path: str
    exists: bool
    total_bytes: int | None
    free_bytes: int | None
    sharing_strategy: str

    def explain(self) -> str:
        if not self.exists:
            text = (
                f"{self.path} does not exist here; torch uses the '{self.sharing_strategy}' strategy "
                "for handing batches from workers to the main process."
            )
        else:
            text = (
                f"{self.path}: {human_bytes(self.total_bytes or 0)} in total, {human_bytes(self.free_bytes or 0)} free "
                f"(torch sharing strategy: '{self.sharing_strategy}'). Every batch a worker produces sits there until "
                f"the main process has taken it."
            )
        return wrap(text, 105)


def shm_status(path: str = "/dev/shm") -> ShmStatus:
    strategy = torch.multiprocessing.get_sharing_strategy()
    try:
        usage = shutil.disk_usage(path)
    except OSError:
        return ShmStatus(path, False, None, None, strategy)
    return ShmStatus(path, True, int(usage.total), int(usage.free), strategy)


def shm_needed_bytes(batch_bytes: int, num_workers: int, prefetch_factor: int = 2) -> int:
    """Shared memory a loader may hold at once: workers x prefetch_factor batches, times 2 (a safety margin)."""
    check_int("batch_bytes", batch_bytes, 0, 1 << 50)
    check_int("num_workers", num_workers, 0, MAX_WORKERS)
    check_int("prefetch_factor", prefetch_factor, 1, 64)
    return batch_bytes * max(1, num_workers) * prefetch_factor * 2


def require_shm(needed_bytes: int) -> ShmStatus:
    """ValueError if ``/dev/shm`` has less than ``needed_bytes`` free (Docker's default: 64 MiB): a worker out of
    shared memory dies of SIGBUS and torch says only "exited unexpectedly"."""
    check_int("needed_bytes", needed_bytes, 0, 1 << 50)
    st = shm_status()
    if st.free_bytes is not None and st.free_bytes < needed_bytes:
        raise ValueError(
            f"{st.path} has only {human_bytes(st.free_bytes)} free, but this loader may hold about "
            f"{human_bytes(needed_bytes)} of batches there (workers x prefetch_factor x batch bytes, x2 margin). "
            f"Workers would die with a bus error. Fix: in Docker start the container with --shm-size=2g "
            f"(or --ipc=host); or lower num_workers, prefetch_factor or batch_size; or call "
            f"torch.multiprocessing.set_sharing_strategy('file_system')."
        )
    return st


def require_short_tempdir() -> None:
    """ValueError if the temporary folder's path is too long for workers to hand batches over: with torch's
    'file_descriptor' sharing, a batch's descriptors travel through a Unix socket that Python's multiprocessing makes
    at ``<tempdir>/pymp-XXXXXXXX/listener-XXXXXXXX``, and Linux takes at most 107 bytes there. Past that the worker
    fails to bind it and the loader waits until its timeout (or for ever, without one)."""
    if torch.multiprocessing.get_sharing_strategy() != "file_descriptor":
        return
    from multiprocessing import util

    socket_path = os.path.join(util.get_temp_dir(), "listener-XXXXXXXX")  # as connection.arbitrary_address names it
    if len(os.fsencode(socket_path)) > 107:
        raise ValueError(
            f"the temporary folder {os.path.dirname(util.get_temp_dir())} has too long a path for DataLoader workers: "
            f"they hand batches over through a socket file there ({len(os.fsencode(socket_path))} bytes; Linux "
            "takes 107). Fix: start Jupyter (or Python) with a short TMPDIR, e.g. `TMPDIR=/tmp make lab`; or use "
            "num_workers=0."
        )


# -- processes -----------------------------------------------------------------------------------------------


def worker_processes() -> list[Any]:
    """Live child processes (psutil), recursively, except multiprocessing's resource tracker and forkserver."""
    out = []
    for p in psutil.Process().children(recursive=True):
        try:
            cmd = " ".join(p.cmdline())
        except psutil.Error:
            cmd = ""
        if p.is_running() and "resource_tracker" not in cmd and "forkserver" not in cmd:
            out.append(p)
    return out


def _worker_children() -> set[int]:
    """Pids of live :func:`worker_processes`, from the OS (a worker forked but not yet recorded too)."""
    out = set()
    for p in worker_processes():
        with contextlib.suppress(psutil.Error):
            if p.status() != psutil.STATUS_ZOMBIE:
                out.add(p.pid)
    return out


def stop_processes(procs: Sequence[Any], grace_s: float = SHUTDOWN_GRACE_S) -> None:
    """multiprocessing processes: SIGTERM, wait at most ``grace_s`` in all, then SIGKILL. Through multiprocessing,
    not psutil: a child psutil reaps is one multiprocessing believes alive forever."""
    procs = [p for p in procs if p.is_alive()]
    for p in procs:
        with contextlib.suppress(Exception):
            p.terminate()
    deadline = time.monotonic() + grace_s
    for p in procs:
        with contextlib.suppress(Exception):
            p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            with contextlib.suppress(Exception):
                p.kill()
                p.join(1.0)


# -- teardown ------------------------------------------------------------------------------------------------


def release(obj: Any) -> None:
    """Shut down the workers (and pin thread) behind a loader or iterator, half-started ones too (idempotent);
    a worker not ended within :data:`SHUTDOWN_GRACE_S` (or frozen) is killed."""
    it = getattr(obj, "_iterator", None) if isinstance(obj, DataLoader) else obj  # a persistent loader's iterator
    if it is not None:
        workers = list(getattr(it, "_workers", []) or [])  # this iterator's: psutil's tree can't tell them apart
        if getattr(it, "_worker_pids_set", False):
            # From here on a worker that ends is expected (one killed below, or hit by the Ctrl-C sent to the
            # process group before it dropped the parent's handler): torch's SIGCHLD handler must not raise "killed
            # by signal" into the teardown. torch's own shutdown forgets the pids only at its very end.
            with contextlib.suppress(Exception):
                torch.utils.data._utils.signal_handling._remove_worker_pids(id(it))
                it._worker_pids_set = False
        for w in workers:  # a stopped (SIGSTOP) worker: nothing else ends it, and a shutdown would wait its grace
            with contextlib.suppress(Exception):
                if w.is_alive() and psutil.Process(w.pid).status() == psutil.STATUS_STOPPED:
                    w.kill()
                    w.join(1.0)
        shutdown = getattr(it, "_shutdown_workers", None)  # torch has no public close(): this is what __del__ runs
        if shutdown is not None:
            with contextlib.suppress(Exception):  # a half-started iterator must not block cleanup
                shutdown()
            it._shutdown = True  # a later __del__ has nothing left to do
        stop_processes(workers)
    if isinstance(obj, DataLoader):
        obj._iterator = None


def _finish(objs: Sequence[Any], before: set[int] | None = None) -> None:
    """Release ``objs``, then stop any child started since ``before`` (multiprocessing's own through it, strays
    through psutil), signals held (a ``KeyboardInterrupt`` in a finalizer would be lost: young garbage is collected
    inside the hold); a second press escapes at once."""
    held = HeldSignals(escape=True)
    with held:
        for obj in objs:
            release(obj)
        new = _worker_children() - before if before is not None else set()
        known = {p.pid: p for p in mp.active_children()} if new else {}  # (active_children reaps)
        stop_processes([known[pid] for pid in new if pid in known])
        strays = []
        for pid in new - set(known):
            with contextlib.suppress(psutil.Error):
                strays.append(psutil.Process(pid))
                strays[-1].terminate()
        for p in psutil.wait_procs(strays, timeout=SHUTDOWN_GRACE_S)[1]:
            with contextlib.suppress(psutil.Error):
                p.kill()
                p.wait(1.0)
        gc.collect(1)  # the young generations, where the run's iterator and queues are (< 1 ms; a full one ~0.1 s)
    held.deliver()


@contextlib.contextmanager
def released(objs: list[Any], loader: Any = None) -> Iterator[list[Any]]:
    """``with released([loader]) as objs:`` each loader or iterator in ``objs`` (add more inside) released, and any
    worker started meanwhile stopped, however the block ends; with ``loader``, its workers' failure (timeout, dead
    worker, the data set's error) raised as a one-line :class:`LoaderFailure`."""
    before = _worker_children()
    try:
        yield objs
    except Exception as exc:
        failure = plain_failure(exc, loader) if loader is not None else exc
        if failure is exc:
            raise
        raise failure from exc
    finally:
        _finish(objs, before)


@contextlib.contextmanager
def open_iterator(loader: DataLoader) -> Iterator[Iterator[Any]]:
    """``with open_iterator(loader) as it:`` workers released however the block ends, failures in one line."""
    with released([loader], loader) as objs:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*suggested max number of worker.*")
            warnings.filterwarnings("ignore", message=".*'pin_memory' argument is set as true but no accelerator")
            it = iter(loader)
        objs.insert(0, it)
        yield it


# -- failures in plain words (the words themselves: helpers.core.failures, which the panels reach too) ------------


def plain_failure(exc: BaseException, loader: Any = None) -> BaseException:
    """``LoaderFailure`` with plain words for a known failure (``exc`` its cause), else ``exc`` itself."""
    if isinstance(exc, LoaderFailure):
        return exc
    frozen = getattr(loader, "_workbook_frozen", None)
    text = str(exc)
    # A worker died: torch says so without its number or exit status, or the main process met the broken
    # connection first (EOFError, ConnectionResetError while it fetched a batch's shared memory).
    died = isinstance(exc, (EOFError, ConnectionError)) or (
        isinstance(exc, RuntimeError) and ("exited unexpectedly" in text or "is killed by signal" in text)
    )
    ended: list[tuple[int, Any]] = []
    procs = list(getattr(loader, "_workbook_workers", []) or []) if died and not frozen else []
    deadline = time.monotonic() + 1.0  # the exit status shows a moment after a broken pipe
    while procs and not ended:
        try:
            ended = [(wid, w) for wid, w in enumerate(procs) if w.exitcode is not None]
            if ended or time.monotonic() >= deadline:
                break
            time.sleep(0.05)
        except RuntimeError as err:  # torch's SIGCHLD handler raising for the worker that just ended: look again
            if not _TORCH_WORKER_DIED.search(str(err)):
                raise
    advice = " ".join(ended_in_words(wid, w.pid, int(w.exitcode)) for wid, w in ended[:2]) or explain_loader_error(exc)
    if frozen:
        advice = explain_loader_error(RuntimeError(f"DataLoader timed out after {loader.timeout:g} seconds"))
        advice = f"{advice or ''} (Stopped worker pid(s) {', '.join(map(str, frozen))}: ended by the workbook.)"
        frozen.clear()
    if advice is None:
        return exc
    failure = LoaderFailure(advice)
    failure.__cause__ = exc
    return failure
