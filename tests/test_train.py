"""Unit tests for helpers.pipeline.train: the instrumented loop, evaluation and the bottleneck model."""

from __future__ import annotations

import pytest
import torch

from helpers.chapters import ch01
from helpers.chapters.ch01 import anatomy, training
from helpers.core.timing import SpanRecorder
from helpers.pipeline import data, loaders, models, train

TINY = dict(n_train=48, n_val=24, image_size=32, num_classes=4, seed=5)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> data.DatasetInfo:
    return data.make_shapes_dataset(root=tmp_path_factory.mktemp("cache"), **TINY)


def _setup(info: data.DatasetInfo, output: str = "float") -> tuple:
    ds = data.ShapesDataset(info.train_dir, crop_size=24, output=output)
    loader = loaders.timed_loader(ds, 8, seed=0)
    model = models.build_model(width=4, depth=2, num_classes=4)
    return loader, model, train.make_optimizer(model)


def _record(loader: object, model: torch.nn.Module, opt: torch.optim.Optimizer, rec: SpanRecorder, steps: int) -> int:
    """Chapter 01's recorded steps with the baseline step and a copy that leaves the batch where it is."""
    return anatomy.record_steps(loader, lambda x, y: (x, y), anatomy.baseline_train_step, model, opt, rec, steps=steps)


def test_workers_record_load_without_collate(tiny: data.DatasetInfo) -> None:
    ds = data.ShapesDataset(tiny.train_dir, crop_size=16)
    loader = loaders.timed_loader(ds, 8, num_workers=1)
    model = models.build_model(width=4, depth=2, num_classes=4)
    rec = SpanRecorder("cpu")
    _record(loader, model, train.make_optimizer(model), rec, steps=2)
    assert "collate" not in rec.finish().phase_totals()


def test_evaluate(tiny: data.DatasetInfo) -> None:
    ds = data.ShapesDataset(tiny.val_dir, crop_size=24, augment=False)
    loader = loaders.timed_loader(ds, 10, shuffle=False)
    model = models.build_model(width=4, depth=2, num_classes=4)
    model.train()
    acc = training.evaluate(model, loader, "cpu")
    assert 0.0 <= acc <= 1.0 and model.training
    assert training.evaluate(model, loader, "cpu") == acc  # deterministic
    u = loaders.timed_loader(
        data.ShapesDataset(tiny.val_dir, crop_size=24, augment=False, output="uint8"), 10, shuffle=False
    )
    assert training.evaluate(model, u, "cpu") == pytest.approx(acc)
    with pytest.raises(ValueError, match="no samples"):
        training.evaluate(model, [], "cpu")


def test_predict_step_time() -> None:
    times = {"load": 3.0, "collate": 1.0, "h2d": 0.5, "forward": 1.0, "backward": 2.0, "optimizer": 0.5}
    p = anatomy.predict_step_time(times)
    assert p.serial == pytest.approx(8.0)
    assert p.overlapped == pytest.approx(4.0) and p.bottleneck == "data (CPU)"
    assert p.stage_times["compute (device)"] == pytest.approx(3.5)
    assert p.speedup_bound() == pytest.approx(2.0)
    q = anatomy.predict_step_time({"load": 1.0, "mystery": 5.0})
    assert q.bottleneck == "mystery" and q.serial == pytest.approx(6.0)
    with pytest.raises(ValueError):
        anatomy.predict_step_time({"load": -1.0})


def test_one_step_overlap_prediction() -> None:
    """The naive loop on a GPU: data overlaps compute by one step, the copy overlaps nothing."""
    times = {"load": 3.0, "collate": 1.0, "h2d": 0.5, "forward": 1.0, "backward": 2.0, "optimizer": 0.5}
    p = anatomy.predict_step_time(times)
    assert p.one_step_overlap == pytest.approx(0.5 + max(4.0, 3.5))
    assert p.overlapped <= p.one_step_overlap <= p.serial


def _span(name: str, step: int, lane: str, a: float, b: float):
    from helpers.core.timing import Span

    return Span(name, step, lane, a, b, a, b)


def test_lane_overlap() -> None:
    from helpers.core.timing import SpanTrace

    d, c = train.DATA_LANE, train.COMPUTE_LANE_GPU
    serial = SpanTrace([_span("load", 0, d, 0, 1), _span("forward", 0, c, 1, 2), _span("load", 1, d, 2, 3)])
    assert anatomy.lane_overlap(serial, d, c) == 0.0
    # GPU-like: the CPU loads batch 1 (1.2-2.0) while the GPU still computes step 0 (1.0-2.5)
    gpu = SpanTrace(
        [
            _span("load", 0, d, 0, 1),
            _span("forward", 0, c, 1, 1.5),
            _span("backward", 0, c, 1.5, 2.5),
            _span("load", 1, d, 1.2, 2.0),
            _span("forward", 1, c, 2.6, 3.0),
        ]
    )
    assert anatomy.lane_overlap(gpu, d, c) == pytest.approx(0.8)
    assert anatomy.lane_overlap(gpu, c, d) == pytest.approx(0.8)
    assert anatomy.lane_overlap(gpu, d, "nothing") == 0.0


def test_cpu_naive_loop_does_not_overlap(tiny: data.DatasetInfo) -> None:
    """On a CPU the data and compute rows take turns: the recorded overlap is (almost) nil."""
    a = anatomy.step_anatomy(batch_size=8, crop_size=24, width=4, depth=2, steps=3, warmup=0, data_root=tiny.train_dir)
    assert anatomy.lane_overlap(a.trace, train.DATA_LANE, train.COMPUTE_LANE_CPU) <= 0.01 * a.trace.wall_time()


def test_progress_of_the_anatomy(tiny: data.DatasetInfo) -> None:
    seen: list[tuple[float, str]] = []
    anatomy.step_anatomy(
        batch_size=8,
        crop_size=24,
        width=4,
        depth=2,
        steps=3,
        warmup=1,
        data_root=tiny.train_dir,
        progress=lambda f, t="": seen.append((f, t)),
    )
    fractions = [f for f, _ in seen]
    assert fractions[0] == 0.0 and fractions[-1] == pytest.approx(1.0) and fractions == sorted(fractions)
    assert any("timed" in t for _, t in seen) and any("warm-up" in t for _, t in seen)


def test_step_anatomy(tiny: data.DatasetInfo) -> None:
    a = anatomy.step_anatomy(batch_size=8, crop_size=24, width=4, depth=2, steps=3, warmup=1, data_root=tiny.train_dir)
    assert list(a.phase_means) == ["load", "collate", "h2d", "forward", "backward", "optimizer"]
    assert a.trace.steps() == 3 and a.step_time > 0 and a.samples_per_s > 0
    assert a.step_time >= 0.9 * a.prediction.overlapped
    assert a.dominant_phase in a.phase_means
    assert a.gflop_per_step > 0
    with pytest.raises(ValueError, match="batch_size"):
        anatomy.step_anatomy(batch_size=0, data_root=tiny.train_dir)
    with pytest.raises(ValueError, match="fewer than"):
        anatomy.step_anatomy(batch_size=64, crop_size=24, width=4, steps=1, warmup=0, data_root=tiny.train_dir)


def test_the_blocking_copy_is_the_one_batch_mover(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[bool] = []
    real = training.move_batch

    def spy(batch, device, *, non_blocking=True):  # noqa: ANN001, ANN202 - a test double
        seen.append(non_blocking)
        return real(batch, device, non_blocking=non_blocking)

    monkeypatch.setattr(training, "move_batch", spy)
    x, y = torch.zeros(2, 3), torch.ones(2, dtype=torch.long)
    out = training.blocking_copy([x, y, "index"], torch.device("cpu"))
    assert isinstance(out, tuple) and out[0] is x and out[1] is y  # (x, y) only; a no-op on the CPU
    assert seen == [False]


def test_panel_functions(tiny: data.DatasetInfo, monkeypatch: pytest.MonkeyPatch) -> None:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    from helpers.ui.widgets import RunRecord

    monkeypatch.setattr(ch01, "step_anatomy", _tiny_anatomy(tiny))
    calls = []
    r = ch01.panel_run(lambda f, t="": calls.append(f), batch_size=8, crop_size=24, width=4, steps=2, device="cpu")
    assert calls and calls[-1] == 1.0 and r.here and r.value.trace.steps() == 2
    text = ch01.panel_summary(r)
    assert "measured" in text and "bottleneck" in text and "measured now on cpu" in text
    ax = Figure().add_subplot()
    ch01.panel_plot([RunRecord(1, {"width": 4}, r, 0.1), RunRecord(2, {"width": 8}, r, 0.1)], ax)
    assert ax.get_ylabel() == "time per step (ms)" and "measured now on cpu" in ax.get_title()


def _tiny_anatomy(info: data.DatasetInfo):  # noqa: ANN202 - a test double
    real = anatomy.step_anatomy

    def run(**kwargs):  # noqa: ANN003, ANN202
        kwargs["data_root"] = info.train_dir
        return real(**kwargs)

    return run


def _tiny_sizes() -> dict[str, int]:
    return {"n_train": 48, "n_val": 24, "image_size": 32, "crop_size": 24, "num_classes": 4, "batch_size": 8}


def test_benchmark_records(tiny: data.DatasetInfo, tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    from helpers.core.results import ResultSet

    monkeypatch.setattr(ch01, "step_anatomy", _tiny_anatomy(tiny))
    monkeypatch.setattr(ch01, "default_sizes", _tiny_sizes)  # the name ch01.benchmark looks up
    rs = ResultSet.new("test", "unit test", device="cpu")
    told: list[float] = []
    ch01.benchmark(rs, "cpu", widths=(4,), steps=2, warmup=0, progress=lambda f, t="": told.append(f))
    assert told and told[-1] == 1.0
    phases = {r.params["phase"] for r in rs.find("ch01.step.phase_time")}
    assert phases == {"load", "collate", "h2d", "forward", "backward", "optimizer"}
    for key in ("step_time", "predicted_serial", "predicted_overlapped", "samples_per_s", "gflop_per_step"):
        (rec,) = rs.find(f"ch01.step.{key}")
        assert rec.value > 0 and rec.params["width"] == 4
    assert "ch01.timeline.width4" in rs.artifacts

    # A reference file recorded on a GPU is found; one without a GPU is ignored.
    monkeypatch.setenv("WORKBOOK_REFERENCE_DIR", str(tmp_path))
    rs.save(tmp_path / "cpu.json")
    missing = ch01.reference_anatomy()
    assert not missing and missing.kind == "missing" and "ch01.step.phase_time" in missing.source
    rs.provenance["hardware"] = {**rs.hardware, "gpu_name": "Test GPU"}
    rs.save(tmp_path / "gpu.json")
    ref = ch01.reference_anatomy(note="no CUDA here")
    assert ref.kind == "recorded" and "Recorded on" in ref.source and "not this machine" in ref.source
    assert ref.lines()[0] == "no CUDA here"
    (label,) = ref.value.phases
    assert list(ref.value.phases[label])[0] == "load" and label in ref.value.traces and ref.value.step_time[label] > 0

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    before = set(plt.get_fignums())
    ch01.plot_reference_anatomy(ref)  # the phases and one timeline, each labelled with the source
    figs = [plt.figure(n) for n in set(plt.get_fignums()) - before]
    assert len(figs) == 2 and all("Recorded on" in " ".join(t.get_text() for t in f.axes[0].texts) for f in figs)
    plt.close("all")
    ch01.plot_reference_anatomy(missing)  # nothing to draw
    assert set(plt.get_fignums()) == set()


class _PinningLoader:
    """Stands in for a pin_memory=True loader on a CUDA machine: collate, then a pause (the pinning)."""

    num_workers = 0
    pin_memory = True

    def __init__(self, ds: data.ShapesDataset, batches: int) -> None:
        self.ds, self.batches = ds, batches
        self.collate_fn = data.TimedCollate()

    def __iter__(self):  # noqa: ANN204
        import time

        for b in range(self.batches):
            batch = self.collate_fn([self.ds[i] for i in range(4 * b, 4 * b + 4)])
            time.sleep(0.01)
            yield batch


def test_pinning_time_gets_its_own_phase(tiny: data.DatasetInfo, monkeypatch: pytest.MonkeyPatch) -> None:
    _, model, opt = _setup(tiny)
    loader = _PinningLoader(data.ShapesDataset(tiny.train_dir, crop_size=24), batches=2)
    rec = SpanRecorder("cpu")
    monkeypatch.setattr(anatomy, "_can_pin", lambda: True)
    _record(loader, model, opt, rec, steps=2)
    means = rec.finish().phase_means()
    assert list(means)[:3] == ["load", "collate", "pin"] and means["pin"] >= 0.009
    assert "pin" in anatomy.STAGES["data (CPU)"]


def test_step_anatomy_refuses_sizes_beyond_memory(tiny: data.DatasetInfo) -> None:
    """Issue 15.10: a batch of 1024 images of 512 px with a wide model is refused before anything is allocated."""
    with pytest.raises(ValueError, match="GiB"):
        anatomy.step_anatomy(batch_size=1024, crop_size=512, width=64, steps=1, warmup=0, data_root=tiny.train_dir)


def test_a_pause_between_clock_reads_does_not_shift_the_collate_span(monkeypatch: pytest.MonkeyPatch) -> None:
    """A fresh-clone run on a loaded machine recorded a collate span ending 24 ms before it started: the collate
    time was converted to the recorder's clock through two clock reads, and the thread was descheduled between
    them. Here the clock jumps 0.5 s between reads; the spans must still be ordered and within the wait."""
    import itertools
    import time

    rec = SpanRecorder("cpu")
    rec._t0 = 100.0
    reads = itertools.chain([101.0, 101.0, 101.5], (101.5 + 0.01 * i for i in itertools.count(1)))
    timed = data.TimedCollate()
    timed.last = (100.8, 100.9)  # collated 0.8-0.9 s after the recorder started, before next() returned at 1.0 s
    monkeypatch.setattr(time, "perf_counter", lambda: next(reads))
    anatomy._record_wait(rec, 0, 0.5, timed, pinning=False)
    monkeypatch.undo()
    spans = {s.name: s for s in rec.finish().spans}
    assert spans["load"].start == 0.5 and abs(spans["load"].end - 0.8) < 1e-9
    assert abs(spans["collate"].start - 0.8) < 1e-9 and spans["collate"].end == 1.0
    assert all(s.end >= s.start for s in spans.values())
