"""Chapter 06: the capstone times the reader's pipeline functions (make_loader, batches, train_step).

What ``helpers.chapters.ch06.capstone`` adds for the reader-built pipeline: :class:`Pipeline`, the take-home
script as the reference pipeline, one call per step (``Settings.loader_kwargs`` /
``batches_kwargs``), the same shuffling order with and without persistent workers
(``seed_order``), and clear errors.
"""

from __future__ import annotations

import inspect

import pytest
import torch
from _ch06_support import quick_data_set, tiny  # noqa: F401  (quick_data_set: autouse, for this module)
from torch.utils.data import DataLoader

from helpers.chapters.ch06 import capstone as C
from helpers.chapters.ch06 import job
from helpers.pipeline.loaders import release


def test_the_last_step_calls_the_pipeline_with_its_defaults() -> None:
    """The full stack is the pipeline as written: make_loader's and batches' defaults (workers aside)."""
    ref = job.reference_pipeline("cpu", workers=3)
    last = C.configurations(workers=3)[-1][1]
    loader_defaults = {
        k: p.default
        for k, p in inspect.signature(ref.make_loader).parameters.items()
        if p.default is not inspect.Parameter.empty
    }
    batches_defaults = {
        k: p.default
        for k, p in inspect.signature(ref.batches).parameters.items()
        if p.default is not inspect.Parameter.empty
    }
    assert {k: v for k, v in last.loader_kwargs().items() if k != "workers"} == {
        k: v for k, v in loader_defaults.items() if k != "workers"
    }
    assert last.batches_kwargs() == batches_defaults
    base = C.configurations(workers=3)[0][1]
    assert base.loader_kwargs() == {"workers": 0, "pin": False}
    assert base.batches_kwargs() == {"prefetch": False, "float_on_host": True}
    assert base.calls() == (
        "make_loader(dataset, batch_size, workers=0, pin=False) · batches(loader, prefetch=False, float_on_host=True)"
    )


def test_reference_pipeline_is_the_script_with_its_globals_set() -> None:
    ref = job.reference_pipeline("cpu", seed=5, workers=2)
    g = ref.make_loader.__globals__  # the script's module globals, which its pipeline reads
    assert ref.source == "examples/fast_pipeline.py"
    assert (g["DEVICE"], g["SEED"], g["WORKERS"]) == (torch.device("cpu"), 5, 2)
    assert ref.make_loader(list(range(10)), 2, workers=0, pin=True).pin_memory is False  # pinning needs CUDA


def _script_module(name: str):
    import importlib.util

    from helpers.core.config import repo_root

    spec = importlib.util.spec_from_file_location(name, repo_root() / "examples" / "fast_pipeline.py")
    mod = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    return mod


@pytest.mark.parametrize("prefetch,float_on_host", [(True, False), (False, True), (False, False)])
def test_the_packages_take_home_pipeline_behaves_as_the_script(prefetch: bool, float_on_host: bool) -> None:
    """reference_pipeline's functions (helpers.chapters.ch06.fast_pipeline) and examples/fast_pipeline.py's give the
    same batches, in the same order, and the same losses, bit for bit, on a tiny data set (same source:
    tests/test_pipeline_cells.py)."""
    script = _script_module("fast_pipeline_equivalence")
    script.DEVICE, script.SEED, script.WORKERS = torch.device("cpu"), 7, 0
    ref = job.reference_pipeline("cpu", seed=7, workers=0)
    assert script.MEAN == job.take_home.MEAN and script.STD == job.take_home.STD
    g = torch.Generator().manual_seed(0)
    items = [(torch.randint(0, 256, (3, 8, 8), dtype=torch.uint8, generator=g), i % 3) for i in range(12)]
    losses = []
    for p in (ref, script):
        loader = p.make_loader(items, 4, workers=0, pin=True, prefetch_factor=2, persistent=False)
        got = list(p.batches(loader, prefetch=prefetch, float_on_host=float_on_host))
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 8 * 8, 3))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        losses.append(([p.train_step(model, opt, x, y) for x, y in got], got))
    (ref_loss, ref_batches), (script_loss, script_batches) = losses
    assert len(ref_batches) == len(script_batches) == 3
    for (xa, ya), (xb, yb) in zip(ref_batches, script_batches):
        assert xa.dtype == xb.dtype == torch.float32 and torch.equal(xa, xb) and torch.equal(ya, yb)
    assert [float(v) for v in ref_loss] == [float(v) for v in script_loss]
    assert torch.equal(ref.normalize(items[0][0][None]), script.normalize(items[0][0][None]))


@pytest.mark.slow
def test_reference_pipeline_needs_no_file_outside_the_package(tmp_path) -> None:
    """Issue #27: reference_pipeline executed examples/fast_pipeline.py by path, so an installed helpers (no checkout
    around it) could not time the take-home pipeline. A copy of the package alone, outside any checkout, can."""
    import os
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    import helpers

    shutil.copytree(Path(helpers.__file__).parent, tmp_path / "helpers", ignore=shutil.ignore_patterns("__pycache__"))
    code = (
        "from helpers.core.config import repo_root\n"
        "assert repo_root() is None, repo_root()\n"
        "from helpers.chapters.ch06 import job\n"
        "p = job.reference_pipeline('cpu', seed=3, workers=0)\n"
        "loader = p.make_loader(list(range(8)), 4, workers=0, pin=False)\n"
        "assert [b.tolist() for b in loader] and p.source == 'examples/fast_pipeline.py'\n"
        "print('ok')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


def _orders(persistent: bool, workers: int, passes: int = 3) -> list[list[int]]:
    loader = DataLoader(
        list(range(24)),
        batch_size=4,
        shuffle=True,
        drop_last=True,
        num_workers=workers,
        persistent_workers=persistent,
        generator=torch.Generator().manual_seed(0),
    )
    out = []
    try:
        for e in range(passes):
            job.seed_order(loader, 7, e, fresh=e == 0)
            out.append([int(i) for b in loader for i in b])
    finally:
        release(loader)
    return out


def test_seed_order_gives_the_same_order_with_and_without_persistent_workers() -> None:
    """A persistent loader skips the base-seed draw after its first pass; seed_order makes up for it."""
    plain = _orders(False, 0)
    assert plain == _orders(False, 2) == _orders(True, 2)
    assert plain[0] != plain[1] and sorted(plain[0]) == list(range(24))
    gen = torch.Generator()
    loader = DataLoader(list(range(24)), batch_size=4, shuffle=True, generator=gen)
    job.seed_order(loader, 7, 1, fresh=True)
    assert gen.initial_seed() == 7 * 1_000_003 + 1


def test_run_waterfall_times_the_functions_it_is_given() -> None:
    ref = job.reference_pipeline("cpu")
    made: list[dict] = []
    iterated: list[dict] = []
    steps = [0]

    def make_loader(dataset, batch_size, **kw):
        made.append(kw)
        return ref.make_loader(dataset, batch_size, **kw)

    def batches(loader, **kw):
        iterated.append(kw)
        return ref.batches(loader, **kw)

    def train_step(model, optimizer, x, y):
        steps[0] += 1
        return ref.train_step(model, optimizer, x, y)

    wf = C.run_waterfall(
        "data-bound",
        "cpu",
        names=["baseline", "workers", "uint8"],
        spec=tiny(),
        workers=1,
        rounds=1,
        stages=False,
        cuda_steps=True,  # uint8 cannot act on a CPU: run it anyway, to check the plumbing
        pipeline=C.Pipeline(make_loader, batches, train_step),
    )
    assert [r.name for r in wf.results] == ["baseline", "workers", "uint8"]
    assert made == [s.loader_kwargs() for _, s in C.configurations(1, ["baseline", "workers", "uint8"])]
    assert {"prefetch": False, "float_on_host": True} in iterated and {
        "prefetch": False,
        "float_on_host": False,
    } in iterated
    assert {} in iterated  # evaluation: batches(val_batches), the defaults
    assert steps[0] == 3 * (1 + 3)  # per configuration: one warm-up step, then 24 / 8 timed steps
    assert len({r.train_loss for r in wf.results}) == 1  # float on the host vs on the "device": the same bits


def test_pipeline_arguments_are_checked() -> None:
    ref = job.reference_pipeline("cpu")
    with pytest.raises(ValueError, match="train_step must be a function"):
        C.Pipeline(ref.make_loader, ref.batches, None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="pipeline must be"):
        C.run_waterfall("data-bound", "cpu", spec=tiny(), pipeline=(ref.make_loader, ref.batches))
    with pytest.raises(ValueError, match="pipeline must be"):
        C.run_config(C.Settings(), tiny(), "cpu", pipeline=(ref.make_loader, ref.batches, ref.train_step))


def test_a_batch_on_another_device_is_a_clear_error() -> None:
    ref = job.reference_pipeline("cpu")

    def batches(loader, **kw):
        for x, y in ref.batches(loader, **kw):
            yield x.to("meta"), y.to("meta")

    with pytest.raises(ValueError, match="reads DEVICE"):
        C.run_config(
            C.Settings(), tiny(), "cpu", stages=False, pipeline=C.Pipeline(ref.make_loader, batches, ref.train_step)
        )


def test_train_items_live_in_helpers_and_stop_at_the_job_size() -> None:
    ds = job.train_items(tiny(train_items=16))
    assert type(ds).__module__ == "helpers.chapters.ch06.job" and len(ds) == 16  # workers import it from there
    assert ds[3][0].dtype == torch.uint8 and torch.equal(ds[3][0], ds[3][0])
    with pytest.raises(IndexError):
        ds[16]
