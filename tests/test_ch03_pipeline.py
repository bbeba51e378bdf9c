"""Chapter 03's measurements time the reader's own pipeline: ``make_loader`` and ``to_device`` from the cells;
its chapter module (helpers/chapters/ch03/__init__.py) drives the panel and records the benchmark.

CPU only (a CUDA-only test is skipped here); no speed is asserted.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader

from helpers.chapters import ch03
from helpers.chapters.ch03 import pinning
from helpers.chapters.ch04.datasets import CheapDataset
from helpers.core import evidence
from helpers.core.results import ResultSet
from helpers.pipeline import loaders as L

DEVICE = torch.device("cpu")


def make_loader(dataset: Any, batch_size: int, pin_memory: bool = DEVICE.type == "cuda") -> DataLoader:
    """Chapter 03's make_loader, as the reader writes it (SEED = 0)."""
    return DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=True,
        drop_last=True,
        generator=torch.Generator().manual_seed(0),
        pin_memory=pin_memory,
    )


def to_device(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return x.to(DEVICE, non_blocking=True), y.to(DEVICE, non_blocking=True)


def test_measure_throughput_times_next_and_the_readers_copy() -> None:
    calls: list[int] = []

    def copy(x: torch.Tensor, y: torch.Tensor) -> Any:
        calls.append(x.shape[0])
        return to_device(x, y)

    ds = CheapDataset(24, image_size=4)
    res = L.measure_throughput(make_loader(ds, 8), to_device=copy, batches=7, warmup=2, label="mine")
    assert res.label == "mine" and res.batches == 7 and res.items == 56
    assert len(res.wait_s) == 7 and len(res.extra["copy_s"]) == 7
    assert len(calls) == 9  # warm-up batches go through the copy too, untimed
    assert res.epochs_started == 3  # 3 batches per epoch: the window crosses epoch ends
    assert res.extra["pinned_batches"] == 0 and res.extra["on_cuda"] is False
    assert res.batch_bytes == 8 * 3 * 4 * 4 * 4 + 8 * 8
    assert res.config["pin_memory"] is False and res.items_per_s > 0


def test_measure_throughput_takes_any_iterable_and_refuses_bad_input() -> None:
    batches = [(torch.zeros(4, 2), torch.zeros(4)) for _ in range(3)]
    res = L.measure_throughput(batches, batches=5, warmup=0)
    assert res.items == 20 and res.config == {"loader": "list"}
    with pytest.raises(ValueError, match="no batches"):
        L.measure_throughput([], batches=1)
    with pytest.raises(ValueError, match="iterable"):
        L.measure_throughput(3, batches=1)
    with pytest.raises(ValueError, match="to_device"):
        L.measure_throughput(batches, to_device="copy", batches=1)
    with pytest.raises(ValueError, match="batches"):
        L.measure_throughput(batches, batches=0)


def test_measure_throughput_releases_workers_when_the_copy_fails() -> None:
    def broken(x: torch.Tensor, y: torch.Tensor) -> Any:
        raise RuntimeError("boom")

    loader = DataLoader(CheapDataset(32, image_size=4), batch_size=4, num_workers=1)
    with pytest.raises(RuntimeError, match="boom"):
        L.measure_throughput(loader, to_device=broken, batches=2, warmup=0)
    assert not L.worker_processes()


def test_pin_pair_rounds_builds_the_readers_loader_in_alternating_order() -> None:
    asked: list[bool] = []

    def mine(dataset: Any, batch_size: int, pin_memory: bool = False) -> DataLoader:
        asked.append(pin_memory)
        return make_loader(dataset, batch_size, pin_memory=pin_memory)

    seen: list[float] = []
    rows = pinning.pin_pair_rounds(
        mine,
        CheapDataset(32, image_size=4),
        4,
        to_device=to_device,
        batches=3,
        warmup=1,
        rounds=3,
        progress=lambda f, text="": seen.append(f),
    )
    assert asked == [False, True, True, False, False, True]
    assert [(r.num_workers, r.pin_memory) for r in rows] == [(0, False), (0, True)]
    assert all(len(r.round_items_per_s) == 3 for r in rows)
    assert not any(r.pin_active for r in rows) or torch.accelerator.is_available()
    assert seen[-1] == 1.0 and seen == sorted(seen)
    verdict = ch03.pin_pair_verdict(rows)
    assert "3 alternating rounds" in verdict
    if not torch.accelerator.is_available():
        assert "nothing was pinned" in verdict
        assert any("pin_memory" in w for w in rows[1].result.warnings)  # captured, not printed


def test_pin_pair_rounds_reports_pinned_batches(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(L, "_is_pinned", lambda batch: bool(getattr(batch, "pinned", False)))

    class Batch(tuple):
        pinned = False

    def fake(dataset: Any, batch_size: int, pin_memory: bool = False) -> list[Any]:
        b = Batch((torch.zeros(batch_size, 2), torch.zeros(batch_size)))
        b.pinned = pin_memory
        return [b, b]

    rows = pinning.pin_pair_rounds(fake, None, 2, batches=2, warmup=0, rounds=2)  # type: ignore[arg-type]
    assert [r.pin_active for r in rows] == [False, True]
    assert "rounds" in ch03.pin_pair_verdict(rows)


def test_pin_pair_rounds_refuses_a_make_loader_without_the_keyword() -> None:
    def old(dataset: Any, batch_size: int) -> DataLoader:
        return make_loader(dataset, batch_size)

    with pytest.raises(ValueError, match="pin_memory"):
        pinning.pin_pair_rounds(old, CheapDataset(8, image_size=2), 2, batches=1, rounds=1)
    with pytest.raises(ValueError, match="make_loader"):
        pinning.pin_pair_rounds(None, CheapDataset(8, image_size=2), 2)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="rounds"):
        pinning.pin_pair_rounds(make_loader, CheapDataset(8, image_size=2), 2, rounds=0)


def test_is_pinned_reads_every_tensor() -> None:
    assert not L._is_pinned((torch.zeros(2), torch.zeros(2)))
    assert not L._is_pinned(("no tensors",))
    assert [t.shape[0] for t in L._batch_tensors({"a": torch.zeros(1), "b": [torch.zeros(2)]})] == [1, 2]


def test_pin_step_seconds_times_the_loaders_pin_step(monkeypatch: pytest.MonkeyPatch) -> None:
    if not torch.cuda.is_available():
        assert pinning.pin_step_seconds((torch.zeros(4), torch.zeros(4))) is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    calls: list[int] = []

    def fake_pin(self: torch.Tensor, *a: Any, **k: Any) -> torch.Tensor:
        calls.append(1)
        return self.clone()

    monkeypatch.setattr(torch.Tensor, "pin_memory", fake_pin)
    s = pinning.pin_step_seconds((torch.zeros(4), torch.zeros(4)), repeats=3)
    assert s is not None and s >= 0
    assert len(calls) == 2 * (1 + 3)  # both tensors, one untimed call first
    with pytest.raises(ValueError, match="repeats"):
        pinning.pin_step_seconds(torch.zeros(1), repeats=0)


def test_chapter_panel_runs_the_readers_functions() -> None:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    from helpers.ui.widgets import Panel

    copied: list[int] = []

    def copy(x: torch.Tensor, y: torch.Tensor) -> Any:
        copied.append(1)
        return to_device(x, y)

    ds = CheapDataset(64, image_size=4)
    panel = Panel.for_chapter(
        ch03, device=DEVICE, make_loader=make_loader, to_device=copy, dataset=ds, batch=8, batches=2, warmup=1
    )
    assert panel.controls["batch_size"].value == 8
    assert panel.controls["pin_memory"].value is False  # make_loader's default on this CPU
    for pin in (False, True):
        panel.set(pin_memory=pin)
        rec = panel.click()
        assert panel.error is None, panel.error
        assert "items/s" in rec.summary and "to_device" in rec.summary and "[measured here]" in rec.summary
    assert isinstance(rec.result, evidence.Evidence) and rec.result.here
    assert len(copied) == 6 and rec.result.value.config["pin_memory"] is True
    if not torch.accelerator.is_available():
        assert "nothing was pinned" in rec.summary
    ax = Figure().add_subplot()
    ch03.panel_plot(panel.history, ax)
    assert ax.get_ylabel() == "throughput (items/s)" and "measured now on cpu" in ax.get_title()
    run = {"device": DEVICE, "make_loader": make_loader, "dataset": ds, "batches": 1, "warmup": 0}
    with pytest.raises(ValueError, match="pin_memory"):
        ch03.panel_run(None, pin_memory="yes", **run)
    with pytest.raises(ValueError, match="batch_size"):
        ch03.panel_run(None, batch_size=0, **run)
    with pytest.raises(ValueError, match="make_loader"):
        ch03.panel_run(None, **{**run, "make_loader": "make_loader"})


def test_pin_rows_measured_and_recorded() -> None:
    def row(pin: bool, wait_ms: float) -> pinning.PinRow:
        res = L.Throughput(
            "t",
            {},
            items=8,
            batches=1,
            seconds=1.0,
            startup_s=0.0,
            warmup_batches=0,
            epochs_started=1,
            wait_s=[wait_ms / 1e3],
        )
        return pinning.PinRow(0, pin, res, pin, None, None, [8.0])

    rows = ch03.pin_step_rows(0.002, [row(False, 1.0), row(True, 1.5)])
    assert [ms for _, ms in rows] == pytest.approx([2.0, 0.5])
    assert all(line.endswith("ms per batch") for line in ch03.pin_row_lines(rows))
    with pytest.raises(ValueError, match="CUDA"):
        ch03.pin_step_rows(None, [])
    rs = ResultSet.new("t", "test")
    rs.add("ch03.pin_ms_per_batch", 0.25, "ms", num_workers=2, thread="pt_data_pin")
    got = ch03.pin_rows_from_records(rs, rs.find("ch03.pin_ms_per_batch"))
    assert got == [("workers=2, pinned in pt_data_pin", 0.25)]
    assert ch03.pin_rows_from_records(rs, []) is None


def test_benchmark_records_chapter_03_keys_only(tmp_path: Any) -> None:
    from helpers.pipeline.data import make_shapes_dataset

    info = make_shapes_dataset(n_train=64, n_val=16, image_size=32, root=tmp_path)
    rs = ResultSet.new("t", "test")
    seen: list[float] = []
    ch03.benchmark(
        rs,
        "cpu",
        progress=lambda f, t="": seen.append(f),
        info=info,
        sizes={"crop_size": 24, "batch_size": 8},
        batches=3,
        warmup=1,
    )
    keys = rs.keys()
    assert keys and all(k.startswith("ch03.") for k in keys)
    assert {"ch03.items_per_s", "ch03.main_wait_ms", "ch03.copy_ms_per_batch"} <= set(keys)
    assert seen[-1] == 1.0 and seen == sorted(seen)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_pinned_batches_and_non_blocking_copies_on_cuda() -> None:  # pragma: no cover - GPU only
    dev = torch.device("cuda")

    def mine(dataset: Any, batch_size: int, pin_memory: bool = True) -> DataLoader:
        return DataLoader(
            dataset,
            batch_size=batch_size,
            shuffle=True,
            drop_last=True,
            generator=torch.Generator().manual_seed(0),
            pin_memory=pin_memory,
        )

    def copy(x: torch.Tensor, y: torch.Tensor) -> Any:
        return x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)

    rows = pinning.pin_pair_rounds(mine, CheapDataset(64, 8), 8, to_device=copy, batches=4, warmup=1, rounds=2)
    assert [r.pin_active for r in rows] == [False, True]
    assert all(r.result.extra["on_cuda"] for r in rows)
    assert pinning.pin_step_seconds(next(iter(mine(CheapDataset(16, 8), 8, pin_memory=False)))) > 0


def test_measure_throughput_sets_and_restores_intraop_threads() -> None:
    seen: list[int] = []

    def copy(x: torch.Tensor, y: torch.Tensor) -> Any:
        seen.append(torch.get_num_threads())
        return x, y

    before = torch.get_num_threads()
    L.measure_throughput([(torch.zeros(2), torch.zeros(2))], to_device=copy, batches=2, warmup=0, threads=1)
    assert seen == [1, 1] and torch.get_num_threads() == before
    with pytest.raises(ValueError, match="threads"):
        L.measure_throughput([(torch.zeros(2), torch.zeros(2))], batches=1, threads=0)
