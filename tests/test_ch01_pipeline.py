"""Chapter 01's pipeline is the reader's: the cells define it, and the measuring helpers time those functions.

- ``anatomy.record_steps`` runs the reader's loader, ``to_device`` and ``train_step`` (no copy of them), and
  leaves no hook and no timed collate function behind, whatever happens;
- ``anatomy.step_anatomy`` and ``ch01.panel_run`` (the live panel) take the reader's functions;
- the functions of chapter 01's cells tagged ``pipeline`` are the contract's baseline, and
  ``anatomy.baseline_train_step`` (what the headless benchmark runs) trains exactly like the cell's ``train_step``.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from helpers.chapters import ch01
from helpers.chapters.ch01 import anatomy
from helpers.core.timing import SpanRecorder
from helpers.pipeline import data, models, train
from helpers.ui import codecells

TINY = dict(n_train=48, n_val=24, image_size=32, num_classes=4, seed=5)
PHASES = ["load", "collate", "h2d", "forward", "backward", "optimizer"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> data.DatasetInfo:
    return data.make_shapes_dataset(root=tmp_path_factory.mktemp("cache"), **TINY)


def _chapter_pipeline(device: str = "cpu", seed: int = 0) -> dict[str, Any]:
    """Execute chapter 01's pipeline cells with the globals its setup cell defines."""
    ns: dict[str, Any] = {
        "torch": torch,
        "F": F,
        "DataLoader": DataLoader,
        "DEVICE": torch.device(device),
        "SEED": seed,
    }
    for cell in codecells.pipeline_cells("01"):
        exec(compile(cell, "<chapter 01 pipeline cell>", "exec"), ns)  # noqa: S102 - our own notebook
    return ns


class _Spy:
    """Counts the calls of a reader's function and passes them through."""

    def __init__(self, fn: Any) -> None:
        self.fn, self.calls = fn, 0

    def __call__(self, *args: Any) -> Any:
        self.calls += 1
        return self.fn(*args)


def _model_and_optimizer() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = models.build_model(width=4, depth=2, num_classes=4, seed=0)
    return model, train.make_optimizer(model)


def test_chapter_01_defines_the_baseline_pipeline(tiny: data.DatasetInfo) -> None:
    ns = _chapter_pipeline()
    assert {"make_loader", "to_device", "batches", "train_step"} <= set(ns)
    ds = data.ShapesDataset(tiny.train_dir, crop_size=24)
    loader = ns["make_loader"](ds, 8)
    assert isinstance(loader, DataLoader)
    assert loader.num_workers == 0 and loader.pin_memory is False and loader.drop_last is True
    assert loader.batch_size == 8 and len(loader) == 6
    got = list(ns["batches"](loader))
    assert len(got) == 6 and all(x.shape == (8, 3, 24, 24) and y.shape == (8,) for x, y in got)
    # the same seed shuffles the same way: two loaders from make_loader give the same labels
    again = [y for _, y in ns["make_loader"](ds, 8)]
    first = [y for _, y in ns["make_loader"](ds, 8)]
    assert all(torch.equal(a, b) for a, b in zip(again, first))


def test_baseline_train_step_trains_like_the_chapter_cell(tiny: data.DatasetInfo) -> None:
    ns = _chapter_pipeline()
    ds = data.ShapesDataset(tiny.train_dir, crop_size=24, augment=False)
    x, y = next(iter(DataLoader(ds, batch_size=8)))
    weights = []
    losses = []
    for step in (ns["train_step"], anatomy.baseline_train_step):
        model, opt = _model_and_optimizer()
        losses.append([step(model, opt, x, y) for _ in range(2)])
        weights.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*weights))
    assert all(torch.equal(a, b) and not a.requires_grad for a, b in zip(*losses))


def test_record_steps_times_the_readers_functions(tiny: data.DatasetInfo) -> None:
    ns = _chapter_pipeline()
    loader = ns["make_loader"](data.ShapesDataset(tiny.train_dir, crop_size=24), 8)
    original_collate = loader.collate_fn
    to_device, step = _Spy(ns["to_device"]), _Spy(ns["train_step"])
    model, opt = _model_and_optimizer()
    before = [p.detach().clone() for p in model.parameters()]
    rec = SpanRecorder("cpu")
    assert anatomy.record_steps(loader, to_device, step, model, opt, rec, steps=4, start_step=3) == 4
    trace = rec.finish()
    assert to_device.calls == step.calls == 4
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert list(trace.phase_means()) == PHASES
    assert {s.step for s in trace.spans} == {3, 4, 5, 6}
    for k in range(3, 7):  # the phases of one step come in order and, on a CPU, never overlap
        spans = sorted((s for s in trace.spans if s.step == k), key=lambda s: s.start)
        assert [s.name for s in spans] == PHASES
        for a, b in zip(spans, spans[1:]):
            assert a.end <= b.start + 1e-6
    lanes = {s.name: s.lane for s in trace.spans}
    assert lanes["load"] == lanes["collate"] == train.DATA_LANE and lanes["h2d"] == train.COPY_LANE
    assert lanes["forward"] == lanes["backward"] == lanes["optimizer"] == train.COMPUTE_LANE_CPU
    # nothing is left behind: the loader's own collate function, no hooks
    assert loader.collate_fn is original_collate
    assert not model._forward_hooks and not opt._optimizer_step_pre_hooks


def test_record_steps_without_recorder_and_across_epochs(tiny: data.DatasetInfo) -> None:
    ns = _chapter_pipeline()
    loader = ns["make_loader"](data.ShapesDataset(tiny.train_dir, crop_size=24), 16)  # 3 batches per epoch
    step = _Spy(ns["train_step"])
    model, opt = _model_and_optimizer()
    seen: list[float] = []
    assert (
        anatomy.record_steps(
            loader, ns["to_device"], step, model, opt, steps=7, progress=lambda f, t="": seen.append(f)
        )
        == 7
    )
    assert step.calls == 7 and seen == pytest.approx([k / 7 for k in range(1, 8)])
    assert anatomy.record_steps(loader, ns["to_device"], step, model, opt, steps=0) == 0 and step.calls == 7
    with pytest.raises(ValueError, match="no batch"):
        anatomy.record_steps([], ns["to_device"], step, model, opt, steps=1)
    with pytest.raises(ValueError, match="steps"):
        anatomy.record_steps(loader, ns["to_device"], step, model, opt, steps=-1)


def test_record_steps_any_iterable_and_cleanup_on_error(tiny: data.DatasetInfo) -> None:
    ns = _chapter_pipeline()
    ds = data.ShapesDataset(tiny.train_dir, crop_size=24)
    plain = list(DataLoader(ds, batch_size=8))[:2]  # an iterable without a collate function: load only
    model, opt = _model_and_optimizer()
    rec = SpanRecorder("cpu")
    anatomy.record_steps(plain, ns["to_device"], ns["train_step"], model, opt, rec, steps=2)
    assert list(rec.finish().phase_means()) == ["load", "h2d", "forward", "backward", "optimizer"]

    loader = ns["make_loader"](ds, 8)
    original_collate = loader.collate_fn

    def broken_step(model: Any, optimizer: Any, x: Any, y: Any) -> None:
        model(x)
        raise RuntimeError("a bug in the reader's step")

    with pytest.raises(RuntimeError, match="reader's step"):
        anatomy.record_steps(loader, ns["to_device"], broken_step, model, opt, SpanRecorder("cpu"), steps=2)
    assert loader.collate_fn is original_collate
    assert not model._forward_hooks and not opt._optimizer_step_pre_hooks


def test_uint8_batches_from_the_readers_copy_get_a_normalize_phase(tiny: data.DatasetInfo) -> None:
    ns = _chapter_pipeline()
    loader = ns["make_loader"](data.ShapesDataset(tiny.train_dir, crop_size=24, output="uint8"), 8)
    model, opt = _model_and_optimizer()
    rec = SpanRecorder("cpu")
    anatomy.record_steps(loader, ns["to_device"], ns["train_step"], model, opt, rec, steps=2)
    assert list(rec.finish().phase_means()) == [
        "load",
        "collate",
        "h2d",
        "normalize",
        "forward",
        "backward",
        "optimizer",
    ]


def test_step_anatomy_and_panel_run_time_the_readers_functions(
    tiny: data.DatasetInfo, monkeypatch: pytest.MonkeyPatch
) -> None:
    ns = _chapter_pipeline()
    make, move, step = _Spy(ns["make_loader"]), _Spy(ns["to_device"]), _Spy(ns["train_step"])
    a = anatomy.step_anatomy(
        batch_size=8,
        crop_size=24,
        width=4,
        depth=2,
        steps=3,
        warmup=1,
        data_root=tiny.train_dir,
        make_loader=make,
        to_device=move,
        train_step=step,
    )
    assert make.calls == 1 and move.calls == step.calls == 4
    assert list(a.phase_means) == PHASES and a.trace.steps() == 3
    assert a.settings["pipeline"] == "yours" and a.settings["num_workers"] == 0
    assert (
        anatomy.step_anatomy(
            batch_size=8, crop_size=24, width=4, depth=2, steps=1, warmup=0, data_root=tiny.train_dir
        ).settings["pipeline"]
        == "helpers"
    )
    with pytest.raises(ValueError, match="num_workers"):
        anatomy.step_anatomy(
            batch_size=8, crop_size=24, width=4, steps=1, num_workers=2, data_root=tiny.train_dir, make_loader=make
        )

    real, seen = anatomy.step_anatomy, {}

    def tiny_anatomy(**kwargs: Any) -> anatomy.Anatomy:
        seen.update(kwargs)
        return real(**{**kwargs, "data_root": tiny.train_dir, "depth": 2})

    monkeypatch.setattr(ch01, "step_anatomy", tiny_anatomy)
    r = ch01.panel_run(
        None,
        batch_size=8,
        crop_size=24,
        width=4,
        steps=2,
        device="cpu",
        make_loader=make,
        to_device=move,
        train_step=step,
    )
    assert seen["make_loader"] is make and seen["to_device"] is move and seen["train_step"] is step
    assert r.here and r.value.settings["pipeline"] == "yours" and step.calls == 4 + 3


def _code_cells() -> list[str]:
    nb = json.loads(codecells.notebook_path("01").read_text(encoding="utf-8"))
    return ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code"]


def test_chapter_01_runs_and_times_its_own_cells() -> None:
    """The loop, the anatomy, the regimes and the panel use the functions the cells define, not a hidden copy."""
    code = "\n".join(_code_cells())
    assert "for x, y in batches(train_loader):" in code
    assert "loss = train_step(model, optimizer, x, y)" in code
    assert "train_loader = make_loader(train_ds, BATCH_SIZE)" in code
    assert "anatomy.record_steps(train_loader, to_device, train_step, model, optimizer" in code
    assert "PIPELINE = dict(make_loader=make_loader, to_device=to_device, train_step=train_step)" in code
    assert "widgets.Panel.for_chapter(ch01, device=DEVICE, **PIPELINE," in code
    assert "train_epoch" not in code and "timed_loader" not in code
