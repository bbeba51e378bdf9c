"""torchrun on this machine, bound to loopback, with every process it starts stopped after.

c10d's TCPStore server binds the wildcard address whatever host it is given, unless handed a socket already bound:
:func:`loopback_torchrun` hands its stores sockets bound to 127.0.0.1.
"""

from __future__ import annotations

import contextlib
import ctypes
import ipaddress
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

import psutil

# -- keeping a single-machine job on the loopback interface ------------------------------------------------------


def _is_loopback_host(host: str) -> bool:
    try:
        infos = socket.getaddrinfo(host.strip("[]"), None)
        return bool(infos) and all(ipaddress.ip_address(str(i[4][0]).split("%")[0]).is_loopback for i in infos)
    except (OSError, UnicodeError, ValueError):
        return False


_STORE_ARGS = "host_name port world_size is_master timeout wait_for_workers multi_tenant master_listen_fd use_libuv"


def _loopback_tcpstore(base: type) -> type:
    """``TCPStore`` whose server, for a loopback host, is handed a socket bound to 127.0.0.1 (``master_listen_fd``).
    torchrun --standalone asks for port 0 (any free port) for each store, so no two of them share a port."""

    class LoopbackTCPStore(base):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            from ...core.device import torch_at_least  # heavy: imports torch, as this class needs

            a = {**dict(zip(_STORE_ARGS.split(), args)), **kwargs}
            if a.get("is_master") and a.get("master_listen_fd") is None and _is_loopback_host(str(a["host_name"])):
                try:
                    sock = socket.create_server(("127.0.0.1", int(a["port"])), backlog=512)
                except OSError as exc:  # same type as c10d's own bind failure, which callers catch
                    raise RuntimeError(f"cannot listen on 127.0.0.1:{a['port']}: {exc}") from exc
                a["port"], a["master_listen_fd"] = sock.getsockname()[1], sock.detach()  # c10d takes the fd
                a["use_libuv"] = a.get("use_libuv") is not False and torch_at_least(2, 8)  # libuv takes an fd from 2.8
            super().__init__(**{k: v for k, v in a.items() if v is not None})  # None: c10d's default

    return LoopbackTCPStore


def loopback_torchrun(argv: Sequence[str] | None = None) -> None:
    """torchrun's own ``main`` with ``TCPStore`` replaced in its rendezvous modules (one machine only)."""
    import torch.distributed as dist
    import torch.distributed.elastic.rendezvous.c10d_rendezvous_backend as c10d_backend
    import torch.distributed.elastic.rendezvous.dynamic_rendezvous  # noqa: F401  (uses dist.TCPStore)
    import torch.distributed.elastic.rendezvous.static_tcp_rendezvous as static_backend
    import torch.distributed.rendezvous as rendezvous
    from torch.distributed import run

    base = dist.TCPStore
    patched = _loopback_tcpstore(base)
    for module in (dist, c10d_backend, static_backend, rendezvous):
        if getattr(module, "TCPStore", None) is base:
            module.TCPStore = patched  # type: ignore[attr-defined]
    run.main(list(sys.argv[1:] if argv is None else argv))


# -- every process the job starts ------------------------------------------------------------------------------


def process_alive(p: int | psutil.Process) -> bool:
    """True if the process runs (a psutil.Process is checked for pid reuse); zombies are gone."""
    try:
        proc = p if isinstance(p, psutil.Process) else psutil.Process(p)
        return bool(proc.is_running()) and proc.status() != psutil.STATUS_ZOMBIE
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False


class _Tracker:
    """Every process the job started, remembered, so none is left behind."""

    def __init__(self, pid: int) -> None:
        self.root = psutil.Process(pid)  # our child: it stays (as a zombie) until we wait for it
        self.procs = {pid: self.root}
        self.listening: set[tuple[int, str, int]] = set()

    def scan(self) -> None:
        """The root's descendants, processes left in their process groups, and the TCP sockets they listen on. Each
        rank has its own session (torchrun starts it so), which its DataLoader workers keep when re-parented."""
        with contextlib.suppress(psutil.NoSuchProcess):
            for c in self.root.children(recursive=True):
                self.procs.setdefault(c.pid, c)
        groups = set(self.procs) - {os.getpgid(0)}  # the root and each rank lead a group (new sessions)
        for p in psutil.process_iter():
            with contextlib.suppress(OSError):
                if p.pid not in self.procs and os.getpgid(p.pid) in groups:
                    self.procs[p.pid] = p
        for proc in list(self.procs.values()):
            with contextlib.suppress(psutil.Error):
                conns = proc.net_connections(kind="tcp")
                self.listening |= {(proc.pid, c.laddr.ip, c.laddr.port) for c in conns if c.status == "LISTEN"}

    def stop_all(self, grace_s: float = 3.0) -> list[int]:
        """SIGTERM torchrun (it stops its ranks), then terminate, then kill the rest. Returns pids still alive."""
        self.scan()
        with contextlib.suppress(psutil.NoSuchProcess, psutil.TimeoutExpired):
            if self.root.is_running():
                self.root.send_signal(signal.SIGTERM)
                self.root.wait(timeout=grace_s)
        self.scan()
        for stop in (psutil.Process.terminate, psutil.Process.kill):
            rest = [p for p in self.procs.values() if process_alive(p)]
            for p in rest:
                with contextlib.suppress(psutil.NoSuchProcess):
                    stop(p)
            psutil.wait_procs(rest, timeout=grace_s)
        return [p.pid for p in self.procs.values() if process_alive(p)]


# -- one job -------------------------------------------------------------------------------------------------------

_WORK_PREFIX = "workbook-ddp-"


@contextlib.contextmanager
def work_dir() -> Iterator[Path]:
    """A temporary folder for one job (``results/`` inside), deleted after, as are those of killed launchers."""
    for d in Path(tempfile.gettempdir()).glob(f"{_WORK_PREFIX}*-*"):
        pid = d.name[len(_WORK_PREFIX) :].split("-", 1)[0]
        if pid.isdigit() and d.is_dir() and not process_alive(int(pid)):
            shutil.rmtree(d, ignore_errors=True)
    with tempfile.TemporaryDirectory(prefix=f"{_WORK_PREFIX}{os.getpid()}-", ignore_cleanup_errors=True) as work:
        (Path(work) / "results").mkdir()
        yield Path(work)


def _die_with_parent() -> Callable[[], None] | None:
    """A ``preexec_fn``: the child gets SIGTERM when its parent dies (Linux), so a killed kernel stops the job."""
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # loaded in the parent: the child only calls it
    return lambda: prctl(1, int(signal.SIGTERM), 0, 0, 0)  # 1: PR_SET_PDEATHSIG


def _read_json(paths: Iterable[Path]) -> list[dict[str, Any]]:
    out = []
    for f in paths:
        with contextlib.suppress(OSError, ValueError):
            out.append(json.loads(f.read_text()))
    return out


_NO_CAUSE = {"rank": None, "error_type": "", "error_message": "", "rank_traceback": ""}


def _follow(proc: subprocess.Popen[bytes], tracker: _Tracker, deadline: float, results: Path, progress: Any) -> bool:
    """Wait for ``proc``, noting its processes and sockets, showing rank 0's step; True if ``deadline`` passed."""
    next_scan, shown = 0.0, -1
    while proc.poll() is None:
        now = time.perf_counter()
        if now >= next_scan:  # new processes (ranks, their workers) and their sockets
            tracker.scan()
            next_scan = now + 0.5
        if now > deadline:
            return True
        step = _read_json([results / "progress.json"]) if progress is not None else []
        if step and step[0]["done"] != shown:
            shown, total = int(step[0]["done"]), max(1, int(step[0]["total"]))
            progress(shown / total, f"rank 0: step {shown}/{total}, epoch {int(step[0]['epoch']) + 1}")
        time.sleep(0.1)
    return False


def run_job(
    nproc: int, script_args: Sequence[str], work: Path, timeout_s: float, progress: Callable[[float, str], None] | None
) -> dict[str, Any]:
    """:mod:`.ddp_train` under this module's torchrun (``--standalone``, every store on 127.0.0.1) in ``work`` for at
    most ``timeout_s``, then every process it started stopped; the fields of a ``DistributedRun``. A
    ``KeyboardInterrupt`` is raised again once they are, with ``tracked_pids`` and ``leftover_pids``."""
    cmd = [sys.executable, "-m", "helpers.chapters.ch07.torchrun", "--local-addr=127.0.0.1", "--standalone"]
    cmd += [f"--nproc-per-node={nproc}", "--max-restarts=0", f"--log-dir={work / 'logs'}"]
    cmd += ["-m", "helpers.chapters.ch07.ddp_train", *script_args]
    t0, results = time.perf_counter(), work / "results"
    lo = next((name for _, name in socket.if_nameindex() if name.startswith("lo")), "")  # lo, lo0: loopback
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "MASTER_ADDR": "127.0.0.1"}
    env |= {"GLOO_SOCKET_IFNAME": lo, "NCCL_SOCKET_IFNAME": lo} if lo else {}  # gloo's and NCCL's own sockets
    root = str(Path(__file__).resolve().parents[3])  # the folder that holds helpers/
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    with open(work / "output.txt", "wb") as out:  # torchrun's and the ranks' output, stdout and stderr
        proc = subprocess.Popen(
            cmd,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            cwd=str(work),
            start_new_session=os.name == "posix",
            preexec_fn=_die_with_parent(),
        )
        tracker, timed_out, interrupted = _Tracker(proc.pid), False, False
        try:
            timed_out = _follow(proc, tracker, t0 + timeout_s, results, progress)
        except KeyboardInterrupt:
            interrupted = True
        finally:
            leftover = tracker.stop_all()
            if proc.poll() is None:  # pragma: no cover - stop_all killed it
                proc.kill()
                proc.wait()
    wall_s = time.perf_counter() - t0  # launch to exit: before the outputs are read
    if interrupted:
        stop = KeyboardInterrupt(
            f"torchrun job interrupted after {wall_s:.1f} s; its {len(tracker.procs)} process(es) were stopped"
        )
        stop.tracked_pids, stop.leftover_pids = sorted(tracker.procs), leftover  # type: ignore[attr-defined]
        raise stop
    output = (work / "output.txt").read_text(errors="replace")
    errors = [] if timed_out else _read_json(results.glob("rank*.error.json"))
    first = min(errors, key=lambda e: e.get("time", math.inf), default={})
    ranks = _read_json(f for f in sorted(results.glob("rank*.json")) if not f.name.endswith(".error.json"))
    return dict(
        command=cmd,
        ranks=sorted(ranks, key=lambda r: r["rank"]),
        wall_s=wall_s,
        output=output,
        tracked_pids=sorted(tracker.procs),
        leftover_pids=leftover,
        listening=sorted(tracker.listening),
        returncode=None if timed_out else proc.returncode,
        timed_out=timed_out,
        cause={k: first.get(k, v) for k, v in _NO_CAUSE.items()},  # the earliest failure (signals write none)
    )


if __name__ == "__main__":  # python -m helpers.chapters.ch07.torchrun: torchrun, bound to 127.0.0.1
    loopback_torchrun()
