"""Chapter 04's pitfalls, shown live: duplicated random draws across workers, a data set defined in the notebook
under spawn, an exception raised inside a worker (their data sets are in :mod:`.datasets`)."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import re
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Callable, Iterator, Mapping, Sequence

from torch.utils.data import Dataset

from ...core.validate import check_choice, check_float, check_int
from ...pipeline.loaders import LoaderConfig, LoaderFailure, build_loader
from ...pipeline.workers import MAX_WORKERS, open_iterator
from .datasets import FailingDataset


def rng_draws(dataset: Dataset, *, num_workers: int = 2, batch_size: int = 4) -> dict[int, list[float]]:
    """Draws per worker id (-1: the main process) of ``dataset``'s items ``(index, worker_id, draw)``."""
    loader = build_loader(dataset, batch_size=batch_size, num_workers=num_workers, shuffle=False)
    out: dict[int, list[float]] = {}
    with open_iterator(loader) as it:
        for _idx, wid, draw in it:
            for w, d in zip(wid.tolist(), draw.tolist()):
                out.setdefault(int(w), []).append(float(d))
    return out


def rng_duplicates(draws: Mapping[int, Sequence[float]]) -> float:
    """Fraction of draws made by workers other than the first that repeat one of worker 0's draws."""
    if len(draws) < 2:
        return 0.0
    ids = sorted(draws)
    first = set(draws[ids[0]])
    others = [d for w in ids[1:] for d in draws[w]]
    return sum(d in first for d in others) / len(others) if others else 0.0


@contextlib.contextmanager
def _capture_fd2() -> Iterator[Callable[[], str]]:
    """File descriptor 2, which child processes inherit, into a temporary file; yields a reader of it."""
    with tempfile.TemporaryFile(mode="w+b") as tmp:
        with contextlib.suppress(Exception):
            sys.stderr.flush()
        saved = os.dup(2)
        os.dup2(tmp.fileno(), 2)
        text: list[str] = []
        try:
            yield lambda: "".join(text)
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            text.append(tmp.read().decode("utf-8", "replace"))


@dataclass
class SpawnOutcome:
    """What happened when a loader ran with a given start method (``child_error``: the worker's own last error)."""

    context: str
    ok: bool
    error_type: str | None
    message: str
    child_error: str | None
    seconds: float


def spawn_failure_demo(dataset: Dataset, *, context: str = "spawn", timeout_s: float = 30.0) -> SpawnOutcome:
    """One batch from ``dataset`` with one worker started by ``context``, within ``timeout_s``; never hangs or leaks.
    A class defined in a notebook cell lives in ``__main__``, which a spawn/forkserver worker cannot import: it dies
    unpickling the data set, and its own error (on its stderr) is captured as ``child_error``."""
    check_choice("context", context, mp.get_all_start_methods())  # what LoaderConfig accepts, None aside
    timeout_s = check_float("timeout_s", timeout_s, 1.0, 600.0)
    cfg = LoaderConfig(batch_size=2, num_workers=1, shuffle=False, timeout=timeout_s, multiprocessing_context=context)
    loader = build_loader(dataset, cfg)
    t0 = time.perf_counter()
    err: BaseException | None = None
    with _capture_fd2() as captured:
        try:
            with open_iterator(loader) as it:
                next(it)
        except Exception as exc:  # the failure is the point of the demo
            err = exc
        time.sleep(0.05)  # a dying child flushes its traceback
    found = re.findall(r"^(\w+(?:Error|Exception)): (.*)$", captured(), flags=re.M)
    child_error = f"{found[-1][0]}: {found[-1][1]}" if found else None
    message = str(err).strip() if err else "one batch loaded fine"
    kind = type(err).__name__ if err else None
    return SpawnOutcome(context, err is None, kind, message, child_error, time.perf_counter() - t0)


def worker_error_demo(dataset: Dataset | None = None, *, num_workers: int = 2) -> tuple[str, str]:
    """Torch's ``(exception type, message)`` for a data set whose item raises in a worker: the worker's exception
    re-raised here with its traceback, the cause of :func:`open_iterator`'s plain-words :class:`LoaderFailure`."""
    ds = dataset if dataset is not None else FailingDataset()
    cfg = LoaderConfig(batch_size=4, num_workers=check_int("num_workers", num_workers, 1, MAX_WORKERS), shuffle=False)
    loader = build_loader(ds, cfg)
    try:
        with open_iterator(loader) as it:
            for _ in it:
                pass
    except Exception as exc:
        raw = exc.__cause__ if isinstance(exc, LoaderFailure) and exc.__cause__ is not None else exc
        return type(raw).__name__, str(raw)
    return "none", "no worker raised"
