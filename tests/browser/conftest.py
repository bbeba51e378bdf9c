"""Fixtures for the end-to-end tests: one JupyterLab server and one headless Chromium per session.

The server runs from this project's ``.venv`` on a free loopback port, with no
token, on a temporary root folder into which the chapter notebooks are copied
(the committed notebooks are never touched). Its kernels run in quick mode
(``WORKBOOK_QUICK=1``). User settings live in a temporary folder too, so the
reader's own JupyterLab settings don't leak in, and the news / update toasts
stay quiet.

Chromium is Debian's ``/usr/bin/chromium`` (``tools/install_browser.sh``),
driven by Playwright's sync API; ``playwright install`` is never needed.

Right after ``make test``'s nbval run (``WORKBOOK_BROWSER_AFTER_NBVAL=1``), a notebook
that nbval ran to completion is served with the outputs of that run
(``artifacts/nbval-outputs/``, written by the root ``conftest.py``) when its code is
the committed notebook's: the chapter test then runs in the browser only the cells
its live panel needs (``test_chapters.py``). Otherwise the clean notebook is served
and the test runs all its cells.

Outside CI a missing browser or Playwright skips these tests with the reason.
In CI (``CI=true``) it fails them: a browser suite that silently skips tests
nothing.
"""

from __future__ import annotations

import http.cookiejar
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import warnings
from pathlib import Path
from typing import Any, Iterator

import pytest

REPO = Path(__file__).resolve().parents[2]
NOTEBOOKS = REPO / "notebooks"
CHROMIUM = Path(os.environ.get("WORKBOOK_CHROMIUM", "/usr/bin/chromium"))
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-quic",
]
VIEWPORT = {"width": 1366, "height": 768}  # a common laptop screen
SCREENSHOTS = REPO / "artifacts" / "screenshots"
NBVAL_OUTPUTS = REPO / "artifacts" / "nbval-outputs"  # written by the root conftest.py after nbval's run
SERVER_START_TIMEOUT_S = 90.0


def in_ci() -> bool:
    """True when running under CI (``CI=true``, as GitHub Actions and most CIs set it)."""
    return os.environ.get("CI", "").strip().lower() in {"1", "true", "yes"}


def _missing(reason: str) -> None:
    """Skip outside CI; fail inside CI."""
    if in_ci():
        pytest.fail(f"{reason} (CI=true, so this is a failure, not a skip)", pytrace=False)
    pytest.skip(reason)


def _jupyter_executable() -> Path:
    """``jupyter`` next to the running interpreter (the project's .venv), else the repo's .venv."""
    for cand in (Path(sys.executable).parent / "jupyter", REPO / ".venv" / "bin" / "jupyter"):
        if cand.is_file():
            return cand
    raise FileNotFoundError("no `jupyter` executable found next to Python or in .venv/bin; run `make setup`")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _write_settings(settings_dir: Path) -> None:
    """User settings for the test server: no news/update toasts, every cell kept in the DOM."""
    files: dict[str, dict[str, Any]] = {
        # "Would you like to receive official Jupyter news?" and update checks: off.
        "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {
            "fetchNews": "false",
            "checkForUpdates": False,
        },
        # Keep every cell rendered, so the test can see all prompts and outputs.
        "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none"},
    }
    for rel, content in files.items():
        path = settings_dir / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(content, indent=2))


def _code_sources(path: Path) -> list[str]:
    cells = json.loads(path.read_text())["cells"]
    return [
        "".join(c["source"]) if isinstance(c["source"], list) else c["source"]
        for c in cells
        if c["cell_type"] == "code"
    ]


def nbval_outputs_for(notebook: Path) -> Path | None:
    """nbval's executed copy of ``notebook``, if asked for (``WORKBOOK_BROWSER_AFTER_NBVAL=1``: ``make test``
    runs this suite right after nbval), nbval ran it in quick mode as the lab's kernels run, and its code
    cells are exactly the committed ones; else None."""
    done = NBVAL_OUTPUTS / notebook.name
    try:
        if os.environ.get("WORKBOOK_BROWSER_AFTER_NBVAL") != "1" or not done.is_file():
            return None
        quick = json.loads(done.read_text())["metadata"]["nbval_outputs"]["WORKBOOK_QUICK"] == "1"  # as the lab
        return done if quick and _code_sources(done) == _code_sources(notebook) else None
    except (OSError, ValueError, KeyError):
        return None


class LabServer:
    """A running JupyterLab server (see the ``lab`` fixture).

    ``prefilled``: the notebooks served with the outputs of nbval's run (see ``nbval_outputs_for``),
    by name, with the source of each of their code cells.
    """

    def __init__(self, root: Path, port: int, proc: subprocess.Popen[bytes], log: Path) -> None:
        self.prefilled: dict[str, list[str]] = {}
        self.root = root
        self.port = port
        self.proc = proc
        self.log = log
        self.url = f"http://127.0.0.1:{port}"
        self._jar = http.cookiejar.CookieJar()
        self._opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(self._jar))
        self._xsrf: str | None = None

    def api(self, path: str, method: str = "GET") -> Any:
        """Call the server's REST API (with the _xsrf cookie that POST/DELETE need)."""
        if self._xsrf is None and method != "GET":
            with self._opener.open(self.url + "/lab", timeout=10) as r:
                r.read()
            self._xsrf = next((c.value for c in self._jar if c.name == "_xsrf"), "")
        headers = {"X-XSRFToken": self._xsrf} if self._xsrf else {}
        req = urllib.request.Request(self.url + path, method=method, headers=headers)
        with self._opener.open(req, timeout=10) as r:
            body = r.read()
        return json.loads(body) if body else None

    def shutdown_kernels(self) -> None:
        """Stop every session and kernel the server runs (frees the CPU and memory between chapters)."""
        try:
            for sess in self.api("/api/sessions"):
                try:
                    self.api(f"/api/sessions/{sess['id']}", method="DELETE")
                except urllib.error.URLError:
                    pass
        except (urllib.error.URLError, OSError):
            pass
        try:
            for k in self.api("/api/kernels"):
                try:
                    self.api(f"/api/kernels/{k['id']}", method="DELETE")
                except urllib.error.URLError:
                    pass
        except (urllib.error.URLError, OSError):
            pass
        try:
            left = self.api("/api/kernels")
        except (urllib.error.URLError, OSError):
            left = None
        if left:
            warnings.warn(
                f"{len(left)} kernel(s) still running after shutdown: {[k['id'] for k in left]}", stacklevel=2
            )

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no server log)"


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """Stop the server (and its kernels) by PID: SIGTERM to its process group, then SIGKILL."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=5)


@pytest.fixture(scope="session")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LabServer]:
    """One JupyterLab server for the whole session, on a temporary copy of the notebooks."""
    try:
        jupyter = _jupyter_executable()
    except FileNotFoundError as exc:
        _missing(str(exc))
    base = tmp_path_factory.mktemp("lab")
    root = base / "root"
    root.mkdir()
    prefilled = {}
    for nb in sorted(NOTEBOOKS.glob("*.ipynb")):
        done = nbval_outputs_for(nb)
        shutil.copy2(done or nb, root / nb.name)
        if done:
            prefilled[nb.name] = _code_sources(nb)
    settings = base / "settings"
    _write_settings(settings)
    env = dict(os.environ)
    env.update(
        WORKBOOK_QUICK="1",
        JUPYTERLAB_SETTINGS_DIR=str(settings),
        JUPYTERLAB_WORKSPACES_DIR=str(base / "workspaces"),
        JUPYTER_RUNTIME_DIR=str(base / "runtime"),
        PYTHONUNBUFFERED="1",
    )
    port = _free_port()
    cmd = [
        str(jupyter),
        "lab",
        "--no-browser",
        "--port",
        str(port),
        "--ip",
        "127.0.0.1",
        "--ServerApp.token=",
        "--ServerApp.password=",
        f"--ServerApp.root_dir={root}",
        "--ServerApp.port_retries=0",
        "--LabApp.news_url=None",
        "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
    ]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        cmd.append("--allow-root")
    log = base / "jupyterlab.log"
    with open(log, "wb") as fh:
        proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
    server = LabServer(root, port, proc, log)
    server.prefilled = prefilled
    deadline = time.monotonic() + SERVER_START_TIMEOUT_S
    while True:
        if proc.poll() is not None:
            pytest.fail(f"jupyter lab exited with code {proc.returncode}:\n{server.log_tail()}", pytrace=False)
        try:
            server.api("/api/status")
            break
        except (urllib.error.URLError, OSError, ValueError):
            if time.monotonic() > deadline:
                _stop(proc)
                pytest.fail(
                    f"jupyter lab did not answer /api/status in {SERVER_START_TIMEOUT_S:.0f} s:\n{server.log_tail()}",
                    pytrace=False,
                )
            time.sleep(0.5)
    try:
        yield server
    finally:
        server.shutdown_kernels()
        _stop(proc)


@pytest.fixture(scope="session")
def browser() -> Iterator[Any]:
    """Headless Debian Chromium driven by Playwright (sync API)."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _missing(
            "the `playwright` Python package is not installed: pip install playwright "
            "(or `make test-browser`, which installs it)"
        )
    if not CHROMIUM.is_file():
        _missing(f"{CHROMIUM} is missing: run tools/install_browser.sh (installs Debian's chromium)")
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS)
        try:
            yield b
        finally:
            b.close()


@pytest.fixture
def page(browser: Any, lab: LabServer) -> Iterator[Any]:
    """A fresh laptop-sized page; the server's kernels are stopped afterwards."""
    context = browser.new_context(viewport=VIEWPORT, device_scale_factor=1)
    pg = context.new_page()
    pg.set_default_timeout(30_000)
    try:
        yield pg
    finally:
        context.close()
        lab.shutdown_kernels()


@pytest.fixture(scope="session")
def screenshot_dir() -> Path:
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    for stale in SCREENSHOTS.glob("*-failure.png"):  # from an earlier session
        stale.unlink()
    return SCREENSHOTS
