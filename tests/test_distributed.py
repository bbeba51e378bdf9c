"""Tests for helpers.chapters.ch07 (distributed, torchrun, ddp_train), on CPU.

The sharding tests need no process group. The slow tests start real torchrun
jobs (gloo, 2 processes) and check coverage, replica sync, the readable error
of a failing rank, and that no process is left behind (psutil).
"""

from __future__ import annotations

import os
import socket
import sys
import time
from typing import Any

import psutil
import pytest
import torch

from helpers.chapters import ch07
from helpers.chapters.ch07 import distributed as D
from helpers.chapters.ch07 import torchrun as T
from helpers.chapters.ch07.ddp_train import IndexedDataset, params_checksum, parse_args

# ---------------------------------------------------------------------------
# Sharding without a process group
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 7, 10, 16, 101])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("shuffle", [False, True])
def test_shard_table_agrees_with_rank_share(n: int, world: int, drop_last: bool, shuffle: bool) -> None:
    if drop_last and n < world:
        with pytest.raises(ValueError, match="n must be >= world_size"):
            D.shard_table(n, world, drop_last=drop_last)
        return
    table = D.shard_table(n, world, drop_last=drop_last, shuffle=shuffle, epoch=3)
    share = D.rank_share(n, world, drop_last)
    assert set(table) == set(range(world))
    assert all(len(idx) == share.per_rank for idx in table.values())
    cov = D.coverage(table, n)
    assert cov.seen == share.total
    assert len(cov.missing) == share.dropped
    assert cov.extra == share.padded
    if share.padded == 0 and share.dropped == 0:
        assert cov.exactly_once


def test_no_shuffle_interleaves_and_pads_from_the_start() -> None:
    table = D.shard_table(10, 4, shuffle=False)
    assert table[0] == [0, 4, 8]
    assert table[1] == [1, 5, 9]
    assert table[2] == [2, 6, 0]  # padding repeats the first indices
    assert table[3] == [3, 7, 1]
    text = D.format_shard_table(table, 10)
    assert "0*" in text and "padding" in text
    dropped = D.shard_table(10, 4, shuffle=False, drop_last=True)
    assert dropped == {0: [0, 4], 1: [1, 5], 2: [2, 6], 3: [3, 7]}
    assert "never loaded (dropped): [8, 9]" in D.format_shard_table(dropped, 10)


def test_rank_share_closed_form() -> None:
    s = D.rank_share(10, 4)
    assert (s.per_rank, s.total, s.padded, s.dropped) == (3, 12, 2, 0)
    s = D.rank_share(10, 4, drop_last=True)
    assert (s.per_rank, s.total, s.padded, s.dropped) == (2, 8, 0, 2)
    assert "per rank" in str(s)


def test_batches_per_rank() -> None:
    assert D.batches_per_rank(1000, 3, 32) == 11  # 334 per rank -> 10 full + 1 short
    assert D.batches_per_rank(1000, 3, 32, loader_drop_last=True) == 10
    assert D.batches_per_rank(1000, 3, 32, drop_last=True) == 11  # 333 per rank


def test_missing_set_epoch_repeats_the_order() -> None:
    without = [D.shard_indices(40, 2, 0, epoch=None) for _ in range(3)]  # set_epoch never called
    with_ = [D.shard_indices(40, 2, 0, epoch=e) for e in range(3)]
    assert without[0] == without[1] == without[2]
    assert len({tuple(o) for o in with_}) == 3
    assert without[0] == with_[0]  # epoch 0 is the same either way
    # Every epoch the two ranks still split the data exactly (same seed + epoch on every rank).
    for e in range(3):
        table = {r: D.shard_indices(40, 2, r, epoch=e) for r in range(2)}
        assert D.coverage(table, 40).exactly_once


def test_coverage_reports_problems() -> None:
    cov = D.coverage({0: [0, 1, 2], 1: [2, 3, 9]}, 5)
    assert not cov.exactly_once
    assert cov.missing == [4]
    assert cov.repeated == {2: 2}
    assert cov.out_of_range == [9]
    assert cov.overlap == {(0, 1): 1}
    assert "never seen" in str(cov)
    assert D.coverage({0: [0, 2], 1: [1, 3]}, 4).exactly_once


@pytest.mark.parametrize(
    ("call", "name"),
    [
        (lambda: D.shard_indices(10, 0, 0), "world_size"),
        (lambda: D.shard_indices(10, 2, 2), "rank"),
        (lambda: D.shard_indices(0, 2, 0), "n"),
        (lambda: D.rank_share(10, 0), "world_size"),
        (lambda: D.batches_per_rank(10, 2, 0), "batch_size"),
        (lambda: D.shard_indices(10, 2, 0, epoch=-1), "epoch"),
        (lambda: D.launch_ddp(0), "nproc"),
        (lambda: D.launch_ddp(D.max_processes() + 1), "nproc"),
        (lambda: D.launch_ddp(1, workers=99), "workers"),
        (lambda: D.launch_ddp(1, batch_size=0), "batch_size"),  # the rank script trusts the launcher's checks
        (lambda: D.launch_ddp(1, epochs=0), "epochs"),
        (lambda: D.launch_ddp(1, width=0), "width"),
        (lambda: D.launch_ddp(1, workers=-1), "workers"),
        (lambda: D.launch_ddp(1, timeout_s=0), "timeout_s"),
        (lambda: D.launch_ddp(1, fail_rank=1), "fail_rank"),
        (lambda: D.multi_node_command(2, 8, "nohost"), "rdzv_endpoint"),
    ],
)
def test_bad_input_names_the_parameter(call, name: str) -> None:
    with pytest.raises(ValueError, match=name):
        call()


def test_commands(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    seen, env = [], {}

    def fake_popen(cmd: list[str], **kw: Any) -> None:
        seen.append(cmd)
        env.update(kw["env"])
        raise RuntimeError("stop here")

    monkeypatch.setattr(T.subprocess, "Popen", fake_popen)
    with pytest.raises(RuntimeError, match="stop here"):
        D.launch_ddp(1, epochs=1, data_dir=tmp_path)
    (cmd,) = seen
    # torchrun, with every store it serves bound to 127.0.0.1 and the ranks told to meet there
    assert cmd[:4] == [sys.executable, "-m", "helpers.chapters.ch07.torchrun", "--local-addr=127.0.0.1"]
    assert "--standalone" in cmd and "--nproc-per-node=1" in cmd and any(a.startswith("--log-dir=") for a in cmd)
    script = cmd.index("helpers.chapters.ch07.ddp_train")
    assert cmd[script - 1] == "-m" and "--epochs=1" in cmd[script + 1 :]
    # the ranks meet on 127.0.0.1, and gloo's and NCCL's own sockets use the loopback interface
    assert env["MASTER_ADDR"] == "127.0.0.1"
    if "lo" in [name for _, name in socket.if_nameindex()]:  # Linux
        assert env["GLOO_SOCKET_IFNAME"] == "lo" and env["NCCL_SOCKET_IFNAME"] == "lo"
    text = D.multi_node_command(2, 8, "node0.example:29400")
    for part in (
        "--nnodes=2",
        "--nproc-per-node=8",
        "--rdzv-backend=c10d",
        "--rdzv-endpoint=node0.example:29400",
        "--rdzv-id=",
    ):
        assert part in text


def test_indexed_dataset_and_args() -> None:
    ds = IndexedDataset([(10, 0), (11, 1), (12, 0), (13, 1)], size=2)
    assert len(ds) == 2 and ds[0] == (10, 0, 0) and ds[1] == (12, 0, 1)  # spread over the base
    assert IndexedDataset([(10, 0), (11, 1)])[1] == (11, 1, 1)
    with pytest.raises(IndexError):
        ds[2]
    a = parse_args(["--out", "x", "--fail-rank", "1"])
    assert a.fail_rank == 1 and a.epochs == 2
    for bad in (["--batch-size", "0"], ["--limit", "0"], ["--epochs", "0"], ["--width", "0"], ["--workers", "-1"]):
        with pytest.raises(SystemExit):  # the script is also run by hand (multi_node_command): it checks its options
            parse_args(["--out", "x", *bad])
    m1, m2 = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    m2.load_state_dict(m1.state_dict())
    assert params_checksum(m1) == params_checksum(m2)


def test_loopback_names() -> None:
    assert T._is_loopback_host("127.0.0.1") and T._is_loopback_host("localhost") and T._is_loopback_host("::1")
    assert not T._is_loopback_host("0.0.0.0") and not T._is_loopback_host("8.8.8.8")
    assert not T._is_loopback_host("no-such-host.invalid")


def _listening() -> list[tuple[str, int]]:
    """``(address, port)`` of every TCP socket this process listens on."""
    return [tuple(c.laddr) for c in psutil.Process().net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN]


def test_loopback_store_listens_on_loopback_only() -> None:
    """The store class torchrun gets binds 127.0.0.1; plain c10d binds the wildcard address."""
    import datetime

    import torch.distributed as dist

    store_cls = T._loopback_tcpstore(dist.TCPStore)
    for kwargs in ({"multi_tenant": False}, {"multi_tenant": True}):
        store = store_cls("localhost", 0, None, True, datetime.timedelta(seconds=10), False, **kwargs)
        try:
            store.set("k", "v")
            assert store.get("k") == b"v"
            mine = [(ip, port) for ip, port in _listening() if port == store.port]
            assert mine and all(ip == "127.0.0.1" for ip, _ in mine), mine
            client = dist.TCPStore("127.0.0.1", store.port, None, False, datetime.timedelta(seconds=10))
            assert client.get("k") == b"v"
            del client
        finally:
            del store
    # a host that is not a loopback name is left to c10d as it is (a multi-machine store)
    wild = store_cls("0.0.0.0", 0, None, True, datetime.timedelta(seconds=10), False)
    try:
        found = [ip for ip, port in _listening() if port == wild.port]
        assert found and all(ip in ("::", "0.0.0.0") for ip in found), found
    finally:
        del wild


# ---------------------------------------------------------------------------
# Real torchrun jobs (gloo on CPU, or nccl where CUDA is present)
# ---------------------------------------------------------------------------

NPROC = 2


def _no_children_left() -> list[psutil.Process]:
    """Live children, less multiprocessing's per-process helpers (resource tracker, forkserver).

    An earlier test that used spawn workers leaves one resource tracker behind, by design.
    """
    from helpers.pipeline.loaders import worker_processes

    return [p for p in worker_processes() if p.status() != psutil.STATUS_ZOMBIE]


def _need_two_ranks() -> None:
    if D.max_processes() < NPROC:
        pytest.skip(f"needs {NPROC} CPU cores (or GPUs) for {NPROC} ranks")


@pytest.mark.slow
def test_real_run_sees_every_sample_exactly_once() -> None:
    _need_two_ranks()
    steps = []
    run = D.launch_ddp(
        NPROC, epochs=2, limit=96, batch_size=16, width=4, timeout_s=240, progress=lambda f, t: steps.append(f)
    )
    assert run.world_size == NPROC and len(run.ranks) == NPROC
    assert run.backend == ("nccl" if torch.cuda.is_available() else "gloo")
    for e in range(run.n_epochs):
        cov = run.coverage(e)
        assert cov.exactly_once, str(cov)
        assert cov.overlap == {}  # no sample on two ranks
    # set_epoch: a new order every epoch on each rank
    for r in run.ranks:
        assert r["epochs"][0]["indices"] != r["epochs"][1]["indices"]
        assert r["pin_memory"] == torch.cuda.is_available()
    assert run.replicas_in_sync()
    assert all(v > 0 for v in run.per_rank_items_per_s()) and run.total_items_per_s() > 0
    assert "total" in run.summary() and "rank" in run.table()
    assert steps and steps[-1] == pytest.approx(1.0)
    # issue 15.13: the rendezvous stores and the collectives listen on loopback only
    assert run.listening, "no listening socket was seen: the check would prove nothing"
    assert run.non_loopback_listeners() == [], run.listening
    assert run.leftover_pids == []
    assert not any(D.process_alive(p) for p in run.tracked_pids)
    assert _no_children_left() == []


@pytest.mark.slow
def test_failing_rank_gives_readable_error_and_no_orphans() -> None:
    _need_two_ranks()
    with pytest.raises(D.DistributedRunError) as info:
        D.launch_ddp(NPROC, epochs=2, limit=96, batch_size=16, width=4, workers=1, fail_rank=1, timeout_s=240)
    err = info.value
    assert err.rank == 1
    assert err.error_type == "InjectedFailure"
    assert "rank 1 of 2 failed: InjectedFailure" in str(err)
    assert "InjectedFailure" in err.rank_traceback
    assert err.returncode not in (0, None)
    assert len(err.tracked_pids) >= 1 + NPROC  # torchrun + ranks (+ their workers)
    assert err.leftover_pids == []
    time.sleep(0.2)
    assert not any(D.process_alive(p) for p in err.tracked_pids)
    assert _no_children_left() == []


@pytest.mark.slow
def test_interrupt_stops_every_process() -> None:
    """A KeyboardInterrupt while the ranks train (with DataLoader workers) stops them all."""
    _need_two_ranks()

    def interrupt_when_training(fraction: float, text: str) -> None:
        if text.startswith("rank 0: step"):
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt, match="stopped") as info:
        D.launch_ddp(
            NPROC, epochs=3, limit=96, batch_size=8, width=4, workers=1, timeout_s=240, progress=interrupt_when_training
        )
    pids = info.value.tracked_pids
    assert len(pids) >= 1 + 2 * NPROC  # torchrun, the ranks and one worker each
    assert info.value.leftover_pids == []
    time.sleep(0.2)
    assert not any(D.process_alive(p) for p in pids)
    assert _no_children_left() == []


@pytest.mark.slow
def test_timeout_stops_every_process() -> None:
    _need_two_ranks()
    t0 = time.perf_counter()
    with pytest.raises(D.DistributedRunError, match="timeout_s=2") as info:
        D.launch_ddp(NPROC, epochs=1, limit=32, width=4, timeout_s=2)
    assert info.value.timed_out
    assert time.perf_counter() - t0 < 30
    assert info.value.leftover_pids == []
    assert _no_children_left() == []


_PARENT = """
from helpers.chapters.ch07 import distributed as D

def report(fraction, text):
    if text.startswith("rank 0: step"):
        print("TRAINING", flush=True)

D.launch_ddp(2, workers=1, epochs=50, limit=256, width=4, batch_size=8, timeout_s=300, progress=report)
"""


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signal is Linux only")
def test_killed_parent_leaves_no_orphans(tmp_path, monkeypatch: pytest.MonkeyPatch, request) -> None:
    """A kernel killed mid-run (SIGKILL: no clean-up code runs) still takes torchrun and the ranks with it."""
    import subprocess

    _need_two_ranks()
    script = tmp_path / "parent.py"
    script.write_text(_PARENT)
    # A temporary folder of its own: another test's launch (another xdist worker) would clean up the stale folder.
    # Short (not under tmp_path): sockets made in TMPDIR must fit the 108-byte limit of a Unix socket path.
    import shutil
    import tempfile
    from pathlib import Path

    tmp = Path(tempfile.mkdtemp(prefix="wb-"))
    request.addfinalizer(lambda: shutil.rmtree(tmp, ignore_errors=True))
    env = {**os.environ, "TMPDIR": str(tmp)}
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert parent.stdout is not None
        assert parent.stdout.readline().strip() == "TRAINING"
        job = psutil.Process(parent.pid).children(recursive=True)
        assert len(job) >= 1 + 2 * NPROC  # torchrun, ranks, workers
    finally:
        parent.kill()
        parent.wait()
    gone, alive = psutil.wait_procs(job, timeout=30)
    alive = [p for p in alive if p.status() != psutil.STATUS_ZOMBIE]
    assert alive == [], [p.cmdline() for p in alive]
    # The killed launcher could not delete its temporary folder; the next launch does.
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    stale = list(tmp.glob(f"workbook-ddp-{parent.pid}-*"))
    assert stale
    with T.work_dir() as fresh:  # deletes the folders of launchers that are gone, then makes its own
        assert (fresh / "results").is_dir()
    assert not fresh.exists() and not any(p.exists() for p in stale)


def test_benchmark_on_cpu_records_nothing() -> None:
    from helpers.core.results import ResultSet

    rs = ResultSet.new("t", "m")
    if not torch.cuda.is_available():
        seen = []
        ch07.benchmark(rs, "cpu", progress=lambda f, t="": seen.append(f))
        assert rs.records == [] and seen[-1] == 1.0  # nothing to measure without CUDA


def _fake_run(nproc: int = 1) -> D.DistributedRun:
    ranks = [
        {
            "rank": r,
            "world_size": nproc,
            "backend": "gloo",
            "dataset_size": 4,
            "params_checksum": "x",
            "samples_per_rank": 4 // nproc,
            "epochs": [{"indices": list(range(r, 4, nproc)), "n_items": 4 // nproc, "seconds": 1.0, "loss": 1.0}],
        }
        for r in range(nproc)
    ]
    return D.DistributedRun(
        nproc=nproc, command=["python"], ranks=ranks, wall_s=2.0, settings={"workers": 0, "batch_size": 4, "width": 4}
    )


def test_record_run_keys() -> None:
    from helpers.core.results import ResultSet

    run = _fake_run()
    rs = ResultSet.new("t", "m")
    ch07.record_run(rs, run)
    keys = {r.key for r in rs.records}
    assert keys == {
        "ch07.ddp.total_items_per_s",
        "ch07.ddp.rank_items_per_s",
        "ch07.ddp.wall_time",
        "ch07.ddp.exactly_once",
    }
    assert rs.find("ch07.ddp.exactly_once")[0].value == 1.0
    assert run.total_items_per_s() == pytest.approx(4.0)
    # the same figure, measured here or recalled from records, reads the same
    here = D.throughput_table([run])
    recalled = D.throughput_table(rs.find("ch07.ddp.total_items_per_s"))
    assert here == recalled and here == [
        "  ranks  backend  workers/rank  batch/rank      total",
        "  1      gloo                0           4  4 items/s",
    ]


def test_plot_runs_draws_every_run() -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [_fake_run(), _fake_run()]
    ax = D.plot_runs(runs)  # no names: every run still drawn, rank bars then its total
    assert len(ax.patches) == 4
    with pytest.raises(ValueError, match="one label prefix per run"):
        D.plot_runs(runs, names=["#1 "])
    plt.close("all")


def test_panel_for_chapter_returns_evidence(monkeypatch: pytest.MonkeyPatch) -> None:
    """The chapter's panel (helpers.chapters.ch07) wires the launcher; a fake job keeps this test fast."""
    import matplotlib

    matplotlib.use("Agg")
    from helpers.ui import widgets

    calls = []

    def fake_launch(nproc, **kw):
        calls.append((nproc, kw))
        return _fake_run(nproc)

    monkeypatch.setattr(D, "launch_ddp", fake_launch)
    panel = widgets.Panel.for_chapter(
        ch07, device="cpu", nproc=1, workers_per_rank=0, batch=16, epochs=2, limit=8, width=4, timeout_s=30
    )
    assert panel.values() == {"processes": 1, "workers": 0, "batch_size": 16}
    panel.click()
    assert panel.error is None, panel.error
    assert panel.last.result.here and panel.last.result.value.nproc == 1
    assert "measured here" in panel.last.summary and "every sample once per epoch" in panel.last.summary
    assert calls == [
        (1, dict(workers=0, batch_size=16, epochs=2, limit=8, width=4, timeout_s=30, progress=calls[0][1]["progress"]))
    ]
    with pytest.raises(ValueError, match="batch_size"):
        panel.set(batch_size=3)
    for bad in ({"processes": 0}, {"processes": D.max_processes() + 1}, {"workers": D.MAX_WORKERS_PER_RANK + 1}):
        with pytest.raises(ValueError, match=next(iter(bad))):  # the controls refuse what the machine can't run
            panel.set(**bad)
