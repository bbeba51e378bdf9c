"""Every test module must leave no child process behind.

After each test module, any process this pytest process started (directly or not) during the module,
and not through a service that was already running (a session-wide browser), that is still running
5 s later is named in the run's summary and killed, so that a leak is found by the module that
caused it and never outlives the run as an orphan.

Under pytest-xdist (``make test-unit`` runs ``-n 2``) each worker is its own process, so the check
watches that worker's own children, and each worker hands its findings to the controller, which
prints them in the same summary.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import psutil
import pytest

_LEAKS: list[str] = []
GRACE_S = 5.0
# Helpers that multiprocessing and torch start once and keep for the life of the process, by design.
SERVICES = ("multiprocessing.resource_tracker", "multiprocessing.forkserver", "torch_shm_manager")


def _alive_children(me: psutil.Process, before: set[int]) -> list[psutil.Process]:
    out = []
    for c in me.children(recursive=True):
        try:
            if c.pid not in before and c.status() != psutil.STATUS_ZOMBIE:
                # A process started by one that was already running (a session-wide browser or server)
                # belongs to that service, not to this module.
                if any(p.pid in before for p in c.parents()):
                    continue
                if not any(s in " ".join(c.cmdline()) for s in SERVICES):
                    out.append(c)
        except psutil.Error:
            pass
    return out


@pytest.fixture(autouse=True, scope="module")
def _no_leaked_processes(request: pytest.FixtureRequest) -> Iterator[None]:
    me = psutil.Process()
    before = {c.pid for c in me.children(recursive=True)}
    yield
    deadline = time.monotonic() + GRACE_S
    left = _alive_children(me, before)
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = _alive_children(me, before)
    for c in left:
        try:
            desc = f"pid {c.pid} ({c.status()}, {c.num_threads()} threads): {' '.join(c.cmdline())[:160]}"
            c.kill()
        except psutil.Error:
            continue
        _LEAKS.append(f"{request.node.nodeid}: {desc}")


def pytest_sessionfinish(session: pytest.Session) -> None:
    """An xdist worker sends what it found to the controller (``workeroutput`` travels back with it)."""
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:
        workeroutput["leaked_processes"] = list(_LEAKS)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: object, error: object) -> None:
    """The controller collects each xdist worker's findings (this hook exists only with xdist)."""
    _LEAKS.extend(getattr(node, "workeroutput", {}).get("leaked_processes", []))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if _LEAKS:
        terminalreporter.section("child processes left behind (killed)")
        for line in _LEAKS:
            terminalreporter.write_line(line)
