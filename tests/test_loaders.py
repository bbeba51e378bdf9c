"""Unit tests for helpers.pipeline.loaders (CPU only; no speed is asserted)."""

from __future__ import annotations

import sys
import time

import psutil
import pytest
import torch

from helpers.chapters.ch03 import pinning
from helpers.chapters.ch04 import datasets as D
from helpers.chapters.ch04 import pitfalls, speedup, sweeps
from helpers.chapters.ch04.datasets import CheapDataset, SpinDataset
from helpers.pipeline import loaders as L


def _factory(ds, bs):
    """A loader factory of num_workers (persistent workers when there are any)."""
    return lambda w: L.build_loader(ds, batch_size=bs, num_workers=w, persistent_workers=w > 0)


def _children() -> set[int]:
    return {
        p.pid
        for p in psutil.Process().children(recursive=True)
        if p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    }


def _wait_children_back_to(before: set[int], timeout: float = 10.0) -> set[int]:
    deadline = time.time() + timeout
    extra = _children() - before
    while extra and time.time() < deadline:
        time.sleep(0.1)
        extra = _children() - before
    # multiprocessing's own helpers (resource tracker, forkserver) are per-process singletons, not leaks
    return {pid for pid in extra if pid in {p.pid for p in L.worker_processes()}}


# -- knobs -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "knobs, name",
    [
        ({"num_workers": -1}, "num_workers"),
        ({"num_workers": L.MAX_WORKERS + 1}, "num_workers"),
        ({"batch_size": 0}, "batch_size"),
        ({"num_workers": 2, "prefetch_factor": 0}, "prefetch_factor"),
        ({"num_workers": 0, "prefetch_factor": 2}, "prefetch_factor"),
        ({"num_workers": 0, "persistent_workers": True}, "persistent_workers"),
        ({"num_workers": 0, "timeout": 5.0}, "timeout"),
        ({"num_workers": 1, "multiprocessing_context": "thread"}, "multiprocessing_context"),
        ({"pin_memory": 1}, "pin_memory"),
        ({"in_order": "no"}, "in_order"),
    ],
)
def test_bad_knobs_name_the_parameter(knobs, name):
    with pytest.raises(ValueError, match=name):
        L.build_loader(CheapDataset(8, 4), **knobs)


def test_unknown_knob_is_refused():
    with pytest.raises(ValueError, match="unknown loader knob"):
        L.LoaderConfig().replace(workers=2)


def test_label_mentions_knobs():
    lab = L.LoaderConfig(num_workers=2, persistent_workers=True, prefetch_factor=4).label()
    assert "workers=2" in lab and "prefetch=4" in lab and "persistent" in lab


# -- measuring ---------------------------------------------------------------------


def test_measure_counts_items_across_epochs_and_releases_workers():
    before = _children()
    ds = CheapDataset(40, image_size=4)
    res = L.measure_config(
        ds, L.LoaderConfig(batch_size=8, num_workers=2, persistent_workers=True), batches=12, warmup=2
    )
    assert res.batches == 12 and res.items == 12 * 8
    assert res.epochs_started >= 3  # 5 batches per epoch
    assert len(res.wait_s) == 12 and res.items_per_s > 0
    assert res.batch_bytes == 8 * 3 * 4 * 4 * 4 + 8 * 8  # float images + int64 labels
    assert not _wait_children_back_to(before)


def test_measure_without_workers():
    res = L.measure_config(CheapDataset(16, 4), L.LoaderConfig(batch_size=4), batches=5, warmup=1)
    assert res.items == 20 and res.config["num_workers"] == 0


def test_keyboard_interrupt_releases_workers():
    before = _children()
    loader = L.build_loader(CheapDataset(64, 4), batch_size=4, num_workers=2, persistent_workers=True)
    calls = []

    def consume(_batch):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        L.measure_throughput(loader, batches=10, warmup=1, consume=consume)
    assert loader._iterator is None
    assert not _wait_children_back_to(before)


def test_too_many_workers_warning_is_captured_not_printed(capfd):
    res = L.measure_config(CheapDataset(16, 4), batch_size=4, num_workers=L.cpu_cores() + 1, batches=2, warmup=1)
    assert any("worker" in w for w in res.warnings)
    assert "UserWarning" not in capfd.readouterr().err


# -- chapter 03 --------------------------------------------------------------------


def test_pin_memory_on_cpu_only_warns():
    if torch.accelerator.is_available():
        pytest.skip("this machine has an accelerator")
    rows = pinning.pin_memory_experiment(CheapDataset(32, 4), workers=(0, 1), batch_size=4, batches=3, warmup=1)
    assert [(r.num_workers, r.pin_memory) for r in rows] == [(0, False), (0, True), (1, False), (1, True)]
    assert not any(r.pin_active for r in rows)
    assert all(r.pin_ms_per_batch is None for r in rows)
    assert any("pin_memory" in w for w in rows[1].result.warnings)
    assert not pinning.pin_thread_alive()


def test_pinnable_batch_is_what_the_loader_pin_step_calls(monkeypatch):
    from torch.utils.data._utils.pin_memory import pin_memory as loader_pin

    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self, *a, **k: self.clone())
    b = pinning.collate_pinnable([(torch.ones(3, 2, 2), 1), (torch.zeros(3, 2, 2), 0)])
    assert isinstance(b, pinning.PinnableBatch) and len(b) == 2 and b.labels.tolist() == [1, 0]
    out = loader_pin(b)
    assert isinstance(out, pinning.PinnableBatch)
    assert out.pin_seconds is not None and out.pin_seconds >= 0
    assert out.pin_thread == "MainThread"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_pin_thread_pins_with_workers():  # pragma: no cover - GPU only
    rows = pinning.pin_memory_experiment(CheapDataset(64, 8), workers=(0, 2), batch_size=8, batches=4, warmup=1)
    by = {(r.num_workers, r.pin_memory): r for r in rows}
    assert by[(0, True)].pin_thread == "MainThread"
    assert by[(2, True)].pin_thread == "pt_data_pin"  # torch's Python name is "Thread-N (_pin_memory_loop)"
    loader = L.build_loader(CheapDataset(64, 8), batch_size=8, num_workers=2, pin_memory=True)
    with L.open_iterator(loader) as it:
        next(it)
        assert pinning.pin_thread_alive()  # found by its target, _pin_memory_loop
    assert not pinning.pin_thread_alive()


def test_batch_copy_seconds_positive():
    assert pinning.batch_copy_seconds(1 << 16, repeats=3) > 0
    with pytest.raises(ValueError, match="nbytes"):
        pinning.batch_copy_seconds(0)


# -- chapter 04 --------------------------------------------------------------------


def test_sweep_and_derived_figures():
    sw = sweeps.sweep_workers(_factory(CheapDataset(64, 4), 8), [0, 1], batches=4, warmup=1)
    assert sw.workers == [0, 1] and len(sw.results) == 2
    assert sw.speedup(0) == pytest.approx(1.0)
    assert sw.best_workers in (0, 1)
    assert sw.rule_of_thumb() == max(1, L.cpu_cores() // 2)
    assert len(sw.table()) == 3
    with pytest.raises(ValueError, match="workers"):
        sweeps.sweep_workers(_factory(CheapDataset(8, 4), 4), [1, 1])


def test_plot_sweep_draws_two_panels():
    import matplotlib

    matplotlib.use("Agg")
    sw = sweeps.sweep_workers(_factory(CheapDataset(64, 4), 8), [0, 1], batches=3, warmup=1)
    ax1, ax2 = sw.plot()
    assert ax1.get_ylabel().startswith("throughput") and "efficiency" in ax2.get_ylabel()


def test_persistent_experiment_shapes():
    pr = sweeps.persistent_experiment(
        lambda p: L.build_loader(CheapDataset(16, 4), batch_size=8, num_workers=1, persistent_workers=p), epochs=2
    )
    assert len(pr.epoch_s[True]) == 2 and len(pr.first_batch_s[False]) == 2
    assert isinstance(pr.restart_cost_s(), float)


def test_in_order_false_may_reorder_uneven_items():
    ds = D.UnevenDataset(24, fast_ms=0.5, slow_ms=30, slow_every=9)
    io = sweeps.in_order_experiment(
        lambda flag: L.build_loader(ds, batch_size=2, num_workers=2, shuffle=False, in_order=flag)
    )
    assert io.out_of_order[True] == 0.0  # in_order=True always delivers in sampler order
    assert set(io.results) == {True, False}


def test_getitems_batched_fetch_gives_same_batches():
    ds = D.BatchedCheapDataset(32, image_size=4, output="uint8")
    images, labels = ds.__getitems__([0, 5, 3])
    ref = CheapDataset(32, image_size=4, output="uint8")
    assert torch.equal(images[1], ref[5][0]) and labels.tolist() == [ref[i][1] for i in (0, 5, 3)]
    out = sweeps.getitems_experiment(
        D.BatchedCheapDataset(64, image_size=4, output="uint8"), workers=(0,), batch_size=8, batches=3, warmup=1
    )
    assert set(out) == {("per-item", 0), ("batched", 0)}
    assert out[("batched", 0)].items == 24


def test_light_collate_and_cheap_rows():
    imgs, labels = D.light_uint8_collate([(torch.zeros(3, 2, 2, dtype=torch.uint8), 1)] * 3)
    assert imgs.shape == (3, 3, 2, 2) and labels == [1, 1, 1]
    rows = sweeps.cheap_vs_expensive({}, n_cheap=64, image_size=4, workers=(0,), batch_size=8, batches=2, warmup=1)
    assert [(r["output"], r["collate"]) for r in rows] == [
        ("float", "default"),
        ("uint8", "default"),
        ("uint8", "light"),
    ]


def test_main_limit_verdicts_read_the_main_threads_load_not_a_fixed_story():
    """Section 6's lines: a direction only beyond 10% (one run each), and 'the main process is the limit' only with its
    thread near 100% busy (a reader's run showed 37-41% with workers 10x slower: that is not the main process)."""
    from types import SimpleNamespace as T

    def rows(busy: float, ratio: float) -> list[dict]:
        base = {"items": "cheap ", "output": "uint8", "collate": "light"}
        return [{**base, "num_workers": 0, "result": T(items_per_s=1000.0, main_busy=0.99)},
                {**base, "num_workers": 2, "result": T(items_per_s=1000.0 * ratio, main_busy=busy)}]  # fmt: skip

    (idle,) = sweeps.main_limit_verdicts(rows(busy=0.4, ratio=0.1))
    assert idle.startswith("cheap uint8 (light collate): 2 workers give 0.10x") and "(slower)" in idle
    assert "the main process is not the limit (not running 60% of the time" in idle
    (full,) = sweeps.main_limit_verdicts(rows(busy=0.95, ratio=1.5))
    assert "(faster)" in full and "near 100%: the main process is the limit" in full
    (same,) = sweeps.main_limit_verdicts(rows(busy=0.5, ratio=1.05))
    assert "within 10%: no clear difference" in same
    assert sweeps.main_limit_verdicts(rows(0.5, 1.0)[1:]) == []  # no num_workers=0 row: nothing to compare with


def test_the_restart_cost_is_given_both_ways_and_noise_is_not_a_cost():
    r = sweeps.PersistentResult(
        epoch_s={False: [0.30, 0.18, 0.19, 0.17], True: [0.30, 0.10, 0.11, 0.10]},
        first_batch_s={False: [0.08, 0.06, 0.06, 0.05], True: [0.08, 0.005, 0.006, 0.004]},
        num_workers=2,
    )
    assert r.restart_cost_s() == pytest.approx(0.055) and r.epoch_cost_s() == pytest.approx(0.08)
    text = r.summary()
    assert "about 55 ms per epoch in the time to the first batch" in text and "about 80 ms in the epoch time" in text
    assert text.endswith("medians of epochs 2-4.")
    quiet = sweeps.PersistentResult({False: [0.1, 0.1], True: [0.1, 0.12]}, {False: [0.0, 0.01], True: [0.0, 0.01]}, 2)
    assert "nothing above the noise (-20 ms) in the epoch time" in quiet.summary() and "from epoch 2" in quiet.summary()


def test_spin_dataset_adds_cpu_time():
    ds = SpinDataset(CheapDataset(4, 4), extra_ms=5)
    t0 = time.thread_time()
    ds[0]
    assert time.thread_time() - t0 >= 0.0049
    with pytest.raises(ValueError, match="extra_ms"):
        SpinDataset(ds, -1)


# -- pitfalls -----------------------------------------------------------------------


def test_bad_rng_duplicates_across_workers_and_fix():
    bad = pitfalls.rng_draws(D.BadRNGDataset(16), num_workers=2, batch_size=2)
    assert set(bad) == {0, 1}
    assert pitfalls.rng_duplicates(bad) == 1.0
    good = pitfalls.rng_draws(D.FixedRNGDataset(16), num_workers=2, batch_size=2)
    assert pitfalls.rng_duplicates(good) == 0.0


def test_worker_exception_surfaces_with_traceback():
    before = _children()
    kind, msg = pitfalls.worker_error_demo()
    assert kind == "ValueError"
    assert "DataLoader worker process" in msg and "Original Traceback" in msg and "item 13 is damaged" in msg
    assert not _wait_children_back_to(before)


def test_shm_status_and_refusal(monkeypatch):
    st = L.shm_status()
    assert isinstance(st.explain(), str)
    assert L.shm_status("/no/such/dir").exists is False
    assert L.shm_needed_bytes(1000, 2, 2) == 8000

    class Usage:
        total, used, free = 64 << 20, 60 << 20, 4 << 20

    monkeypatch.setattr(L.shutil, "disk_usage", lambda path: Usage)
    with pytest.raises(ValueError, match="--shm-size"):
        L.require_shm(1 << 30)
    before = _children()
    with pytest.raises(ValueError, match="/dev/shm"):  # refused before any worker starts
        L.measure_config(CheapDataset(4096, 64), batch_size=512, num_workers=2, batches=2)
    assert not _wait_children_back_to(before, timeout=2)


class _MainOnly(torch.utils.data.Dataset):
    """Pretends to be defined in a notebook cell (module __main__)."""

    def __len__(self):
        return 4

    def __getitem__(self, i):
        return torch.zeros(2), i


def test_spawn_fails_for_main_module_class_and_works_for_helpers(monkeypatch):
    before = _children()
    _MainOnly.__module__ = "__main__"
    monkeypatch.setattr(sys.modules["__main__"], "_MainOnly", _MainOnly, raising=False)
    bad = pitfalls.spawn_failure_demo(_MainOnly(), context="spawn", timeout_s=60)
    assert not bad.ok
    assert bad.child_error is not None and "AttributeError" in bad.child_error and "_MainOnly" in bad.child_error
    good = pitfalls.spawn_failure_demo(CheapDataset(8, 4), context="spawn", timeout_s=60)
    assert good.ok, good
    assert not _wait_children_back_to(before)


def test_spawn_workers_measure_helpers_dataset():
    res = L.measure_config(
        D.FixedRNGDataset(16),
        batch_size=4,
        num_workers=1,
        multiprocessing_context="spawn",
        batches=3,
        warmup=1,
        timeout=60.0,
    )
    assert res.items == 12


def test_load_note_mentions_cores():
    assert "cores" in L.load_note() or "not available" in L.load_note()


# -- interleaved speed-up and the measured ceiling ----------------------------------


def test_parallel_ceiling_counts_items_and_closes_its_pool():
    before = _children()
    rate = speedup.parallel_ceiling(SpinDataset(CheapDataset(16, 4), extra_ms=1.0), processes=2, seconds=0.2)
    assert rate > 0
    assert not _wait_children_back_to(before)
    assert not (_children() - before)  # the pool's processes are gone too


def test_parallel_ceiling_refuses_bad_arguments():
    with pytest.raises(ValueError, match="processes"):
        speedup.parallel_ceiling(CheapDataset(8, 4), processes=0)
    with pytest.raises(ValueError, match="seconds"):
        speedup.parallel_ceiling(CheapDataset(8, 4), seconds=0.0)


def test_worker_speedup_rounds_and_cleanup():
    before = _children()
    threads = torch.get_num_threads()
    ds = SpinDataset(CheapDataset(64, 4), extra_ms=0.5)
    sr = speedup.knob_rounds(_factory(ds, 8), "num_workers", [0, 2], rounds=3, batches=3, warmup=1)
    assert len(sr.rates[0]) == len(sr.rates[2]) == len(sr.ceiling) == 3
    assert all(x > 0 for x in sr.rates[0] + sr.rates[2] + sr.ceiling)
    assert sr.speedup == pytest.approx(sorted(sr.ratios())[1])
    lo, hi = sr.spread
    assert lo <= sr.speedup <= hi
    assert sr.ceiling_speedup > 0 and sr.share_of_ceiling > 0
    assert len(sr.table()) == 5 and "median of 3 rounds" in sr.summary()  # header, 3 rounds, medians
    assert torch.get_num_threads() == threads  # the one-thread setting is restored
    assert not [p for p in L.worker_processes() if p.pid not in before]  # gone when it returns
    assert not _wait_children_back_to(before)


def test_speedup_rounds_without_ceiling():
    sr = speedup.LoaderRounds("num_workers", {0: [100.0], 1: [90.0]}, 0)
    assert sr.ceiling == [] and sr.ceiling_speedup != sr.ceiling_speedup  # nan
    assert "ceiling" not in sr.summary()
    assert "ceiling" not in sr.table()[0] and "procs" not in sr.table()[0]


def test_worker_speedup_refuses_bad_arguments():
    with pytest.raises(ValueError, match="num_workers"):
        speedup.knob_rounds(_factory(CheapDataset(8, 4), 4), "num_workers", [0, 0])
    with pytest.raises(ValueError, match="rounds"):
        speedup.knob_rounds(_factory(CheapDataset(8, 4), 4), "num_workers", [0, 2], rounds=0)


def test_plot_rounds_draws_three_series():
    import matplotlib

    matplotlib.use("Agg")
    sr = speedup.LoaderRounds("num_workers", {0: [100.0, 110.0], 2: [180.0, 170.0]}, 0, [200.0, 190.0])
    ax = sr.plot()
    assert len(ax.get_lines()) == 3 and "1.6" in ax.get_title()
    assert sr.speedup == pytest.approx((1.8 + 170 / 110) / 2)


def test_pin_experiment_reads_pin_times_from_pinned_batches_only(monkeypatch):
    """The rows' pin figures come from the batches the loader hands over: a batch never pinned and a batch that is
    not a PinnableBatch add nothing; the pinned ones give the median ms and the thread that pinned most."""
    pinned = pinning.collate_pinnable([(torch.zeros(3), 0), (torch.ones(3), 1)])
    pinned.pin_seconds, pinned.pin_thread = 0.002, "pt_data_pin"
    handed = {
        False: [pinning.collate_pinnable([(torch.zeros(3), 0)]), (torch.zeros(1), torch.zeros(1))],
        True: [pinned],
    }

    def fake_measure(dataset, cfg, *, on_batch, **_):
        for b in handed[cfg.pin_memory]:
            on_batch(b)
        kw = {"startup_s": 0.0, "warmup_batches": 0, "epochs_started": 1}
        return L.Throughput("fake", {}, items=1, batches=1, seconds=1.0, **kw)

    monkeypatch.setattr(pinning, "measure_config", fake_measure)
    off, on = pinning.pin_memory_experiment(CheapDataset(8, 2), workers=(0,), batch_size=2, batches=1, warmup=0)
    assert not off.pin_active and off.pin_ms_per_batch is None and off.pin_thread is None
    assert on.pin_active and on.pin_ms_per_batch == pytest.approx(2.0) and on.pin_thread == "pt_data_pin"
