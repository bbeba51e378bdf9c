"""Unit tests for helpers.train: the instrumented loop, evaluation and the bottleneck model."""

from __future__ import annotations

import pytest
import torch

from helpers import data, models, train
from helpers.timing import SpanRecorder

TINY = dict(n_train=48, n_val=24, image_size=32, num_classes=4, seed=5)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> data.DatasetInfo:
    return data.make_shapes_dataset(root=tmp_path_factory.mktemp("cache"), **TINY)


def _setup(info: data.DatasetInfo, output: str = "float") -> tuple:
    ds = data.ShapesDataset(info.train_dir, crop_size=24, output=output)
    loader = data.make_loader(ds, 8, seed=0)
    model = models.build_model(width=4, depth=2, num_classes=4)
    return loader, model, train.make_optimizer(model)


def test_train_epoch_records_every_phase(tiny: data.DatasetInfo) -> None:
    loader, model, opt = _setup(tiny)
    rec = SpanRecorder("cpu")
    stats = train.train_epoch(model, loader, "cpu", opt, recorder=rec, start_step=10)
    trace = rec.finish()
    assert stats.steps == 6 and stats.samples == 48
    assert 0.0 <= stats.accuracy <= 1.0 and stats.loss > 0 and stats.samples_per_s > 0
    assert list(trace.phase_totals()) == ["load", "collate", "h2d", "forward", "backward", "optimizer"]
    assert {s.step for s in trace.spans} == set(range(10, 16))
    for s in trace.spans:
        assert s.end >= s.start
    # phases of one step come in order and do not overlap (nothing runs concurrently here)
    step0 = sorted((s for s in trace.spans if s.step == 10), key=lambda s: s.start)
    assert [s.name for s in step0] == ["load", "collate", "h2d", "forward", "backward", "optimizer"]
    for a, b in zip(step0, step0[1:]):
        assert a.end <= b.start + 1e-6


def test_train_epoch_changes_weights_and_respects_max_steps(tiny: data.DatasetInfo) -> None:
    loader, model, opt = _setup(tiny)
    before = [p.detach().clone() for p in model.parameters()]
    stats = train.train_epoch(model, loader, "cpu", opt, max_steps=2)
    assert stats.steps == 2 and stats.samples == 16
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_uint8_batches_get_a_normalize_phase(tiny: data.DatasetInfo) -> None:
    loader, model, opt = _setup(tiny, output="uint8")
    rec = SpanRecorder("cpu")
    train.train_epoch(model, loader, "cpu", opt, recorder=rec, max_steps=2)
    assert "normalize" in rec.finish().phase_totals()


def test_custom_transfer_and_no_recorder(tiny: data.DatasetInfo) -> None:
    loader, model, opt = _setup(tiny)
    calls = []

    def move(batch: tuple, device: torch.device) -> tuple:
        calls.append(device)
        return batch[0].to(device), batch[1].to(device)

    stats = train.train_epoch(model, loader, "cpu", opt, transfer=move, max_steps=3)
    assert stats.steps == 3 and len(calls) == 3
    with pytest.raises(ValueError, match="transfer"):
        train.train_epoch(model, loader, "cpu", opt, transfer="teleport")


def test_workers_record_load_without_collate(tiny: data.DatasetInfo) -> None:
    ds = data.ShapesDataset(tiny.train_dir, crop_size=16)
    loader = data.make_loader(ds, 8, num_workers=1)
    model = models.build_model(width=4, depth=2, num_classes=4)
    rec = SpanRecorder("cpu")
    train.train_epoch(model, loader, "cpu", train.make_optimizer(model), recorder=rec, max_steps=2)
    assert "collate" not in rec.finish().phase_totals()


def test_evaluate(tiny: data.DatasetInfo) -> None:
    ds = data.ShapesDataset(tiny.val_dir, crop_size=24, augment=False)
    loader = data.make_loader(ds, 10, shuffle=False)
    model = models.build_model(width=4, depth=2, num_classes=4)
    model.train()
    acc = train.evaluate(model, loader, "cpu")
    assert 0.0 <= acc <= 1.0 and model.training
    assert train.evaluate(model, loader, "cpu") == acc  # deterministic
    u = data.make_loader(data.ShapesDataset(tiny.val_dir, crop_size=24, augment=False, output="uint8"), 10, shuffle=False)
    assert train.evaluate(model, u, "cpu") == pytest.approx(acc)
    with pytest.raises(ValueError, match="no samples"):
        train.evaluate(model, [], "cpu")


def test_predict_step_time() -> None:
    times = {"load": 3.0, "collate": 1.0, "h2d": 0.5, "forward": 1.0, "backward": 2.0, "optimizer": 0.5}
    p = train.predict_step_time(times)
    assert p.serial == pytest.approx(8.0)
    assert p.overlapped == pytest.approx(4.0) and p.bottleneck == "data (CPU)"
    assert p.stage_times["compute (device)"] == pytest.approx(3.5)
    assert p.speedup_bound() == pytest.approx(2.0)
    q = train.predict_step_time({"load": 1.0, "mystery": 5.0})
    assert q.bottleneck == "mystery" and q.serial == pytest.approx(6.0)
    with pytest.raises(ValueError):
        train.predict_step_time({"load": -1.0})
    with pytest.raises(ValueError):
        train.predict_step_time({}, stages={})


def test_step_anatomy(tiny: data.DatasetInfo) -> None:
    a = train.step_anatomy(batch_size=8, crop_size=24, width=4, depth=2, steps=3, warmup=1, data_root=tiny.train_dir)
    assert list(a.phase_means) == ["load", "collate", "h2d", "forward", "backward", "optimizer"]
    assert a.trace.steps() == 3 and a.step_time > 0 and a.samples_per_s > 0
    assert a.step_time >= 0.9 * a.prediction.overlapped
    assert a.dominant_phase in a.phase_means
    assert a.gflop_per_step > 0
    with pytest.raises(ValueError, match="batch_size"):
        train.step_anatomy(batch_size=0, data_root=tiny.train_dir)
    with pytest.raises(ValueError, match="fewer than"):
        train.step_anatomy(batch_size=64, crop_size=24, width=4, steps=1, warmup=0, data_root=tiny.train_dir)
