"""Chapter 04's pipeline: the reader's own ``make_loader`` (a tagged cell), measured by the helpers it is handed to.

The measuring helpers take a loader factory (``lambda w: make_loader(ds, 8, workers=w)``) and give the
reader's loaders the workbook's safety (``loaders.guard``: /dev/shm, timeout, signal reset in workers,
leak-proof start, freeze watchdog). CPU only; no speed is asserted.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import psutil
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from helpers.chapters import ch04
from helpers.chapters.ch04 import datasets as D
from helpers.chapters.ch04 import speedup, sweeps
from helpers.chapters.ch04.datasets import CheapDataset, SpinDataset
from helpers.core import evidence
from helpers.pipeline import data
from helpers.pipeline import loaders as L
from helpers.ui import codecells

SEED = 0


def make_loader(
    dataset: Any,
    batch_size: int,
    workers: int = 2,
    persistent: bool = True,
    prefetch_factor: int = 2,
    in_order: bool = True,
) -> DataLoader:
    """Chapter 04's make_loader, as a reader writes it (plain DataLoader, nothing from the workbook)."""
    return DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=True,
        drop_last=True,
        generator=torch.Generator().manual_seed(SEED),
        pin_memory=False,
        num_workers=workers,
        persistent_workers=persistent and workers > 0,
        prefetch_factor=prefetch_factor if workers > 0 else None,
        worker_init_fn=data.seed_worker,
        in_order=in_order,
    )


def _live_workers() -> list[int]:
    return [p.pid for p in L.worker_processes() if p.status() != psutil.STATUS_ZOMBIE]


def _settle(timeout_s: float = 10.0) -> list[int]:
    deadline = time.monotonic() + timeout_s
    left = _live_workers()
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = _live_workers()
    return left


@pytest.fixture(autouse=True)
def _no_workers_left() -> Any:
    yield
    assert not _settle(10.0), "a test left worker processes behind"


# -- the notebook's pipeline cell ----------------------------------------------------


def _notebook_make_loader(workers: int = 2, prefetch: int = 4) -> Any:
    """``make_loader`` as chapter 04's tagged cell defines it, run with the globals its setup cell defines."""
    (cell,) = [c for c in codecells.pipeline_cells("04") if "def make_loader" in c]
    ns: dict[str, Any] = {
        "DataLoader": DataLoader,
        "torch": torch,
        "data": data,
        "SEED": 0,
        "DEVICE": torch.device("cpu"),
        "WORKERS": workers,
        "PREFETCH": prefetch,
    }
    exec(compile(cell, "<chapter 04 pipeline cell>", "exec"), ns)
    return ns["make_loader"]


def test_the_chapters_make_loader_sets_every_knob_it_teaches() -> None:
    mk = _notebook_make_loader(workers=2, prefetch=4)
    dl = mk(CheapDataset(64, 4), 8)
    assert (dl.num_workers, dl.persistent_workers, dl.prefetch_factor, dl.in_order) == (2, True, 4, True)
    assert dl.worker_init_fn is data.seed_worker  # a module function: spawn/forkserver workers import it
    assert dl.worker_init_fn.__module__ == "helpers.pipeline.data"
    assert dl.drop_last and not dl.pin_memory  # no CUDA here: pinning stays off
    single = mk(CheapDataset(64, 4), 8, workers=0)  # the knobs that need workers drop out with workers=0
    assert (single.num_workers, single.persistent_workers, single.prefetch_factor) == (0, False, None)
    assert not mk(CheapDataset(64, 4), 8, in_order=False).in_order


def test_the_chapters_make_loader_runs_in_the_helpers() -> None:
    mk = _notebook_make_loader(workers=1, prefetch=2)
    sw = sweeps.sweep_workers(lambda w: mk(CheapDataset(64, 4), 8, workers=w), [0, 1], batches=3, warmup=1)
    assert [r.config["num_workers"] for r in sw.results] == [0, 1]


# -- guard: the workbook's safety on the reader's loader ---------------------------------


def test_guard_gives_a_plain_loader_the_workbooks_safety_and_keeps_its_knobs() -> None:
    dl = make_loader(CheapDataset(64, 4), 8, workers=2, prefetch_factor=3)
    assert dl.timeout == 0 and type(dl) is DataLoader
    assert L.guard(dl) is dl
    assert type(dl).__name__ == "_WorkbookLoader" and isinstance(dl, DataLoader)
    assert dl.timeout == L.WORKER_TIMEOUT_S
    assert dl.worker_init_fn.fn is data.seed_worker  # the reader's function still runs, wrapped
    assert (dl.num_workers, dl.batch_size, dl.prefetch_factor, dl.persistent_workers, dl.drop_last) == (
        2,
        8,
        3,
        True,
        True,
    )
    init = dl.worker_init_fn
    assert L.guard(dl) is dl and dl.worker_init_fn is init  # guarding twice changes nothing
    own = make_loader(CheapDataset(64, 4), 8, workers=1)
    own.timeout = 5.0
    assert L.guard(own, timeout=9.0).timeout == 5.0  # a timeout of the reader's own is kept
    assert L.guard(make_loader(CheapDataset(64, 4), 8, workers=1), timeout=9.0).timeout == 9.0
    single = L.guard(make_loader(CheapDataset(64, 4), 8, workers=0))
    assert single.timeout == 0 and single.worker_init_fn is data.seed_worker
    built = L.build_loader(CheapDataset(64, 4), num_workers=1)
    assert L.guard(built) is built
    with pytest.raises(ValueError, match="DataLoader"):
        L.guard([1, 2, 3])  # type: ignore[arg-type]


def test_guard_checks_dev_shm_before_any_worker_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    class Usage:
        total, used, free = 64 << 20, 63 << 20, 1 << 20

    monkeypatch.setattr(L.shutil, "disk_usage", lambda path: Usage)
    ds = CheapDataset(4096, 64)
    with pytest.raises(ValueError, match="--shm-size"):
        L.guard(make_loader(ds, 256, workers=2))
    with pytest.raises(ValueError, match="/dev/shm"):
        sweeps.sweep_workers(lambda w: make_loader(ds, 256, workers=w), [0, 2], batches=1, warmup=0)
    with pytest.raises(ValueError, match="/dev/shm"):
        speedup.knob_rounds(
            lambda w: make_loader(ds, 256, workers=w), "num_workers", [0, 2], rounds=1, batches=1, warmup=0
        )
    L.guard(make_loader(ds, 256, workers=0))  # no workers: nothing goes through /dev/shm
    assert L.guard(make_loader(ds, 256, workers=2), check_shm=False).num_workers == 2


class _Handlers(Dataset):
    def __len__(self) -> int:
        return 2

    def __getitem__(self, i: int) -> tuple[int, int]:
        return int(signal.getsignal(signal.SIGTERM)), int(signal.getsignal(signal.SIGINT))


def test_guarded_workers_drop_the_parents_signal_handlers() -> None:
    old = signal.signal(signal.SIGTERM, lambda *a: None)
    try:
        loader = L.guard(make_loader(_Handlers(), 1, workers=1))
        with L.open_iterator(loader) as it:
            term, intr = next(it)
    finally:
        signal.signal(signal.SIGTERM, old)
    assert (int(term), int(intr)) == (int(signal.SIG_DFL), int(signal.SIG_IGN))


def test_interrupt_while_a_readers_loader_starts_workers_stops_them(monkeypatch: pytest.MonkeyPatch) -> None:
    from torch.utils.data.dataloader import _MultiProcessingDataLoaderIter

    real_reset = _MultiProcessingDataLoaderIter._reset

    def interrupted_reset(self: Any, loader: Any, first_iter: bool = False) -> None:
        if first_iter:
            raise KeyboardInterrupt  # workers are up; the iterator is never returned
        real_reset(self, loader, first_iter)

    monkeypatch.setattr(_MultiProcessingDataLoaderIter, "_reset", interrupted_reset)
    with pytest.raises(KeyboardInterrupt):
        L.measure_throughput(
            sweeps.build_from_factory(lambda w: make_loader(CheapDataset(64, 4), 4, workers=w), 3),
            batches=4,
            warmup=1,
        )
    assert not _settle(5.0)


def test_interrupt_during_a_measurement_releases_the_readers_workers() -> None:
    seen: list[int] = []

    def on_batch(_batch: Any) -> None:
        seen.append(1)
        if len(seen) == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        L.measure_throughput(
            sweeps.build_from_factory(lambda w: make_loader(CheapDataset(64, 4), 4, workers=w), 2),
            batches=10,
            warmup=1,
            on_batch=on_batch,
        )
    assert not _settle(5.0)


class _PauseAll:
    def __init__(self) -> None:
        self.n = 0

    def __call__(self, batch: Any) -> None:
        self.n += 1
        if self.n == 1:
            for p in L.worker_processes():
                os.kill(p.pid, signal.SIGSTOP)


@pytest.mark.timeout(120)
def test_a_frozen_worker_of_a_readers_loader_ends_with_a_plain_message() -> None:
    loader = L.guard(make_loader(CheapDataset(4096, 4), 4, workers=2, prefetch_factor=1), timeout=2.0)
    t0 = time.monotonic()
    with pytest.raises(L.LoaderFailure) as info:
        L.measure_throughput(loader, batches=2000, warmup=0, consume=_PauseAll())
    assert "within 2 s" in str(info.value) and "num_workers=0" in str(info.value)
    assert not _settle(5.0)
    assert time.monotonic() - t0 < 60


# -- the experiments, fed with the reader's loader factory ------------------------------


def test_sweep_times_the_factorys_loaders_and_refuses_one_that_ignores_the_count() -> None:
    steps: list[str] = []
    sw = sweeps.sweep_workers(
        lambda w: make_loader(CheapDataset(64, 4), 8, workers=w),
        [0, 1, 2],
        batches=3,
        warmup=1,
        progress=lambda f, t: steps.append(t),
    )
    assert sw.workers == [0, 1, 2]
    assert [r.config["num_workers"] for r in sw.results] == [0, 1, 2]
    assert [r.config["persistent_workers"] for r in sw.results] == [False, True, True]
    assert all(r.items == 3 * 8 for r in sw.results) and steps[-1] == "done"
    with pytest.raises(ValueError, match="asked for"):
        sweeps.sweep_workers(lambda w: make_loader(CheapDataset(64, 4), 8), [0, 1], batches=1, warmup=0)
    with pytest.raises(ValueError, match="DataLoader"):
        sweeps.sweep_workers(lambda w: CheapDataset(64, 4), [0], batches=1, warmup=0)


def test_sweep_keeps_the_dataloaders_warning_with_the_result(capfd: pytest.CaptureFixture[str]) -> None:
    many = L.cpu_cores() + 1
    sw = sweeps.sweep_workers(lambda w: make_loader(CheapDataset(64, 4), 4, workers=w), [many], batches=2, warmup=1)
    assert any("suggested max" in w for w in sw.results[0].warnings)
    assert "UserWarning" not in capfd.readouterr().err


def test_interleaved_rounds_with_the_readers_loaders() -> None:
    threads = torch.get_num_threads()
    ds = SpinDataset(CheapDataset(64, 4), extra_ms=0.5)
    sr = speedup.knob_rounds(
        lambda w: make_loader(ds, 8, workers=w), "num_workers", [0, 2], rounds=2, batches=3, warmup=1
    )
    assert len(sr.rates[0]) == len(sr.rates[2]) == len(sr.ceiling) == 2
    assert all(x > 0 for x in sr.rates[0] + sr.rates[2] + sr.ceiling)
    assert torch.get_num_threads() == threads
    with pytest.raises(ValueError, match="asked for"):
        speedup.knob_rounds(
            lambda w: make_loader(ds, 8, workers=1), "num_workers", [0, 2], rounds=1, batches=1, warmup=0
        )


def test_persistent_experiment_with_a_factory() -> None:
    pr = sweeps.persistent_experiment(lambda p: make_loader(CheapDataset(32, 4), 8, workers=1, persistent=p), epochs=2)
    assert pr.num_workers == 1 and len(pr.epoch_s[True]) == len(pr.first_batch_s[False]) == 2
    with pytest.raises(ValueError, match="workers"):
        sweeps.persistent_experiment(lambda p: make_loader(CheapDataset(32, 4), 8, workers=0, persistent=p), epochs=1)


def test_sampler_batches_is_the_next_epoch_and_leaves_it_unchanged() -> None:
    ds = D.UnevenDataset(24, fast_ms=0.0, slow_ms=0.0)
    for workers in (0, 2):
        loader = L.guard(make_loader(ds, 4, workers=workers, persistent=False))
        first = sweeps.sampler_batches(loader)
        assert sweeps.sampler_batches(loader) == first  # replaying does not advance the generator
        with L.open_iterator(loader) as it:
            got = [b[1].tolist() for b in it]
        assert got == first and sorted(i for b in got for i in b) == list(range(24))
        assert sweeps.sampler_batches(loader) != first  # the next epoch is shuffled anew


def test_in_order_experiment_with_the_readers_shuffled_loader() -> None:
    ds = D.UnevenDataset(24, fast_ms=0.5, slow_ms=30, slow_every=9)
    io = sweeps.in_order_experiment(lambda flag: make_loader(ds, 2, workers=2, in_order=flag))
    assert io.out_of_order[True] == 0.0  # in sampler order, shuffled or not
    assert set(io.results) == {True, False}
    assert io.results[False].config["in_order"] is False and io.results[True].batches == 24 // 2 - 1
    with pytest.raises(ValueError, match="indices"):
        sweeps.in_order_experiment(lambda flag: make_loader(CheapDataset(24, 4), 2, workers=1, in_order=flag))


# -- the live panel times the reader's make_loader ---------------------------------------


def test_chapter_panel_calls_the_readers_make_loader() -> None:
    calls: list[dict[str, Any]] = []

    def mine(dataset: Any, batch_size: int, **knobs: Any) -> DataLoader:
        calls.append({"batch_size": batch_size, **knobs})
        return make_loader(dataset, batch_size, **knobs)

    run = {"device": "cpu", "make_loader": mine, "crop_size": 8, "batches": 2, "warmup": 1, "n_cheap": 64}
    cheap = ch04.ITEM_COSTS[0]
    ev = ch04.panel_run(None, num_workers=1, batch_size=8, prefetch_factor=3, persistent=True, item_cost=cheap, **run)
    assert isinstance(ev, evidence.Evidence) and ev.here
    res = ev.value
    assert calls == [{"batch_size": 8, "workers": 1, "persistent": True, "prefetch_factor": 3}]
    assert res.config["num_workers"] == 1 and res.config["prefetch_factor"] == 3 and res.items == 16
    assert res.extra["item_cost"] == cheap and res.label.endswith("cheap")
    assert "items/s" in ch04.panel_summary(ev) and "[measured here]" in ch04.panel_summary(ev)
    res0 = ch04.panel_run(None, num_workers=0, batch_size=8, item_cost=cheap, **run).value
    assert res0.config["num_workers"] == 0
    with pytest.raises(ValueError, match="persistent"):
        ch04.panel_run(None, num_workers=1, persistent=1, item_cost=cheap, **run)
    with pytest.raises(ValueError, match="item_cost"):
        ch04.panel_run(None, num_workers=0, **run)  # no image root: only the cheap items
    with pytest.raises(ValueError, match="make_loader"):
        ch04.panel_run(None, **{**run, "make_loader": None})
    assert not _settle(5.0)


def test_chapter_panel_50_runs_leave_no_stray_processes_and_plot() -> None:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    from helpers.ui.widgets import Panel

    panel = Panel.for_chapter(
        ch04, device="cpu", make_loader=make_loader, crop_size=8, batch=8, batches=2, warmup=1, n_cheap=64
    )
    assert panel.controls["prefetch_factor"].value == 2 and panel.controls["persistent"].value is True
    panel.debounce_s, panel.max_history = 0.0, 100
    for k in range(50):
        panel.set(num_workers=k % 3, persistent=bool(k % 2), item_cost=ch04.ITEM_COSTS[0])
        rec = panel.click()
        assert panel.error is None, panel.error
        assert rec is not None and rec.result.value.items > 0
    assert len(panel.history) == 50
    assert not _settle(10.0)
    ax = Figure().add_subplot()
    ch04.panel_plot(panel.history, ax)
    assert ax.get_ylabel() == "throughput (items/s)" and "measured now on cpu" in ax.get_title()


def test_benchmark_records_chapter_04_keys_only(tmp_path: Any) -> None:
    from helpers.core.results import ResultSet

    info = data.make_shapes_dataset(n_train=64, n_val=16, image_size=32, root=tmp_path)
    rs = ResultSet.new("t", "test")
    seen: list[float] = []
    ch04.benchmark(
        rs,
        "cpu",
        progress=lambda f, t="": seen.append(f),
        info=info,
        sizes={"crop_size": 24, "batch_size": 8},
        batches=3,
        warmup=1,
    )
    keys = rs.keys()
    assert keys and all(k.startswith("ch04.") for k in keys)
    for k in (
        "ch04.items_per_s",
        "ch04.speedup",
        "ch04.parallel_ceiling",
        "ch04.share_of_ceiling",
        "ch04.best_num_workers",
        "ch04.prefetch.items_per_s",
        "ch04.persistent.epoch_s",
        "ch04.persistent.restart_cost_s",
        "ch04.in_order.p95_wait_ms",
        "ch04.getitems.items_per_s",
        "ch04.cheap.items_per_s",
        "ch04.cheap.main_busy",
    ):
        assert k in keys, k
    assert seen[-1] == 1.0 and seen == sorted(seen)
    # the figures measured in rounds keep their spread: median of rounds, lowest/highest, count
    assert {len(r.spread) for r in rs.find("ch04.prefetch")} == {3}
    assert {r.params["prefetch_factor"] for r in rs.find("ch04.prefetch.ratio")} == {1, 4}
    assert {len(r.spread) for r in rs.find("ch04.speedup")} == {3}
