"""Chapter 06, the capstone: the reader's finished pipeline, timed one step at a time.

Chapter 06 defines the whole pipeline in its cells (the same lines as
``examples/fast_pipeline.py``): ``make_loader(dataset, batch_size, workers=, pin=,
prefetch_factor=, persistent=)``, ``normalize(x)``, ``class Prefetcher``,
``batches(loader, prefetch=, float_on_host=)`` and ``train_step(model, optimizer, x, y)``.
This module times **those functions** (:class:`Pipeline`): each configuration of the
waterfall is one call of the reader's ``make_loader`` and ``batches`` with other keyword
arguments (:data:`STEPS`, data, not code; :meth:`Settings.calls` prints the call):

====  ==============================  ==================================================  =========
#     step                            the call changes                                    chapter
====  ==============================  ==================================================  =========
0     baseline                        ``workers=0, pin=False``; ``prefetch=False,         01
                                      float_on_host=True``
1     + pinned memory                 ``pin=True``                                        02, 03
2     + workers                       ``workers=N, prefetch_factor=2, persistent=False``  04
3     + persistent, prefetch 4        ``prefetch_factor=4, persistent=True``              04
4     + uint8, device normalise       ``float_on_host=False``                             05
5     + side-stream prefetcher        ``prefetch=True`` (the defaults: the fast pipeline) 05
====  ==============================  ==================================================  =========

(GPU JPEG decoding is not in the list: chapter 05's helpers do not provide it.) Without the
reader's functions (``tools.bench``, the unit tests) the take-home pipeline is timed
(:func:`reference_pipeline`: :mod:`helpers.chapters.ch06.fast_pipeline`, the pipeline block of
``examples/fast_pipeline.py`` in the package): tests keep it identical to the script and the chapter's cells.

What stays here is the plumbing: the data set (:func:`train_items`: workers import it from
this module under spawn and forkserver), the job, the clocks, the checks and the plots.

Same job, same answer. Every configuration uses the same seed, the same initial weights, the
same data order (:func:`seed_order` seeds the loader's shuffling generator before every pass)
and the **same augmentation crops** (the random crop of an item is drawn from a generator
seeded by (seed, item), not from whichever worker process happens to load it:
:class:`SeededItems`). Every configuration normalises with the reader's one ``normalize``
(float configurations on the host, uint8 ones on the device), and cuDNN runs deterministic
algorithms during the job (:func:`same_numerics`). On a CPU the configurations are then
bit-identical (same loss, same accuracy). On a GPU they are too if ``normalize`` gives the
same bits there as on the CPU (:func:`normalizer_device_exact`, measured); otherwise the
accuracy tolerance grows to the measured seed-to-seed spread (:func:`accuracy_tolerance`,
:func:`seed_spread`).

Measured per configuration (:func:`run_config` -> :class:`ConfigResult`): the time of one
epoch (including worker start-up, which is what persistent workers remove), throughput,
validation accuracy, the span trace of every step (the wait for ``batches``' next batch, and
``train_step``), the *compute-busy* share (GPU busy on a GPU) and the *data-stall* share.
And, per configuration, each stage **alone** (:func:`stage_alone`): the reader's loader
alone, the copy alone (CUDA only; on a CPU there is no copy), the reader's ``train_step``
alone on a batch already on the device; the **pipeline efficiency** is the pipeline's
throughput divided by that of its slowest stage alone, never shown above 1
(:func:`pipeline_efficiency`, :class:`Efficiency`).

Two regimes from the model's size (:data:`REGIMES`): a tiny model (1 channel at full resolution,
4 stages) is **data-bound** (the loader is the slowest stage, even on a CPU), a wide one
**compute-bound**. "Wide" depends on the device: :func:`calibrate` times the loader alone
and the model alone on the device in use and picks a model whose step takes 2-3.5x the
loader's batch (:func:`choose_model`, bounded in time), and says so when a regime cannot
be reached.

Waterfalls are measured in alternating rounds (:func:`run_waterfall`): each step's gain is
the median of per-round ratios between neighbours run back to back, and its verdict comes from
the rounds' spread: 'gain', 'slower', 'within noise' or 'no effect' (:meth:`Waterfall.verdicts`);
:func:`expected_within_noise` says beforehand which steps should be within noise on this device.
Without CUDA only the steps that can act are run: pinning, uint8 normalised on the device and the
prefetcher are labelled 'needs CUDA', with figures of the same experiment published by others
(:func:`cuda_step_evidence`), never a ratio. (The workers send uint8 batches in every configuration,
so on a CPU the uint8 step changes only where the float image is made: the same process.)

Threads. Every configuration of a waterfall, and every stage measured alone, runs with the
same number of intra-op threads in the main process, ``JobSpec.threads`` =
:func:`compute_threads` (the usable cores minus the workers of the ``workers`` step, at
least 1), set by :func:`main_threads` and restored afterwards. So each step changes one
thing only; and the model's threads do not fight the worker processes for the same cores
(oversubscription; :func:`compare_threads` measures what that costs).

The chapter's live panel and its headless benchmark (records ``ch06.*``) are in :mod:`helpers.chapters.ch06`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import statistics
import textwrap
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import torch
from torch.utils.data import DataLoader, Dataset

from ...core import agreement, evidence
from ...core.config import sized
from ...core.device import intraop_threads
from ...core.evidence import Evidence
from ...core.progress import scaled
from ...core.reference import no_published_sentence
from ...core.timing import SpanRecorder, SpanTrace, synchronize
from ...core.validate import check_choice, check_float, check_int
from ...pipeline.data import ShapesDataset, default_sizes, make_shapes_dataset, to_float_normalized
from ...pipeline.loaders import (
    LoaderFailure,
    explain_loader_error,
    guard,
    require_shm,
    shm_needed_bytes,
    worker_processes,
)
from ...pipeline.models import build_model
from ...pipeline.prefetch import move_batch
from ...pipeline.train import COMPUTE_LANE_CPU, COMPUTE_LANE_GPU, make_optimizer
from . import fast_pipeline as take_home
from .doctor import usable_cores

__all__ = [
    "Step",
    "STEPS",
    "STEP_NAMES",
    "Settings",
    "Pipeline",
    "reference_pipeline",
    "seed_order",
    "train_items",
    "REGIMES",
    "JobSpec",
    "job_spec",
    "default_workers",
    "compute_threads",
    "main_threads",
    "compare_threads",
    "STEP_REQUIRES",
    "settings_for",
    "configurations",
    "SeededItems",
    "ConfigResult",
    "run_config",
    "dataset_info",
    "val_size",
    "stage_alone",
    "pipeline_efficiency",
    "Efficiency",
    "EFFICIENCY_NOISE",
    "Waterfall",
    "run_waterfall",
    "accuracy_tolerance",
    "seed_spread",
    "check_accuracies",
    "chance_level",
    "job_sizes",
    "normalizer_device_exact",
    "same_numerics",
    "MODEL_LADDER",
    "model_flops",
    "probe_bytes",
    "device_memory_check",
    "release_pinned_host_memory",
    "Calibration",
    "choose_model",
    "calibrate",
    "expected_within_noise",
    "step_answers",
    "effective_on",
    "cuda_step_evidence",
    "VERDICTS",
    "NO_EFFECT_FLOOR",
    "plot_waterfall",
    "plot_shares",
    "step_rows_from_records",
    "reference_waterfall",
    "plot_reference_waterfall",
    "reference_efficiency",
    "efficiency_lines",
    "reference_timeline",
]

#: Span names of a timed step: the wait for ``next(batches(loader))`` (load, copy and normalise, as the
#: reader's ``batches`` does them), then the reader's ``train_step``.
DATA_PHASES = ("batch",)
COMPUTE_PHASES = ("train_step",)
DATA_LANE = "data (CPU)"


# ---------------------------------------------------------------------------
# The steps, as data
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Step:
    """One step of the stack.

    Attributes:
        name: short id (used as a record parameter and a panel control).
        label: the bar label.
        change: the settings it changes (see :class:`Settings`).
        chapter: the chapter that measured it.
        needs_cuda: True if it can only have an effect with a CUDA device.
        why: one sentence: what it changes and why it can help.
        published_key: for a step that needs CUDA, the record key of the experiment that measures it,
            whose published figures (``helpers/core/published_experiments.json``) stand in for it without
            CUDA (:func:`cuda_step_evidence`); "" for the others.
    """

    name: str
    label: str
    change: Mapping[str, Any]
    chapter: str
    needs_cuda: bool
    why: str
    published_key: str = ""


#: The steps in stacking order. ``num_workers="auto"`` becomes :func:`default_workers`.
#: Each step is a call of the reader's ``make_loader`` and ``batches`` with other keyword arguments
#: (:meth:`Settings.loader_kwargs`, :meth:`Settings.batches_kwargs`).
STEPS: tuple[Step, ...] = (
    Step(
        "baseline",
        "baseline",
        {},
        "01",
        False,
        "load, decode and augment in the training loop's process; float32 made on the CPU; pageable copies",
    ),
    Step(
        "pinned",
        "+ pinned memory",
        {"pin_memory": True},
        "02-03",
        True,
        "page-locked batches and copies that do not make the host wait; on a CPU there is no copy",
        "ch03.pin_ms_per_batch",
    ),
    Step(
        "workers",
        "+ workers",
        {"num_workers": "auto"},
        "04",
        False,
        "load in worker processes, in parallel with the training step (DataLoader's prefetch_factor=2)",
    ),
    Step(
        "persistent",
        "+ persistent, prefetch 4",
        {"persistent_workers": True, "prefetch_factor": 4},
        "04",
        False,
        "keep the workers alive between epochs (no start-up per epoch) and queue 4 batches per worker",
    ),
    Step(
        "uint8",
        "+ uint8, device normalise",
        {"output": "uint8"},
        "05",
        True,
        "uint8 crosses the link (4x fewer bytes), float is made on the device; on a CPU host and device are one",
        "ch02.wire_time",
    ),
    Step(
        "prefetcher",
        "+ side-stream prefetcher",
        {"prefetcher": True},
        "05",
        True,
        "copy batch i+1 on a side CUDA stream while batch i trains; on a CPU batches() copies nothing",
        "ch05.prefetch.batch_time",
    ),
)
STEP_NAMES: tuple[str, ...] = tuple(s.name for s in STEPS)

#: Steps that need another step switched on first (persistent workers need workers; :func:`settings_for`
#: refuses them alone, and chapter 06's panel ticks and unticks its checkboxes accordingly).
STEP_REQUIRES: dict[str, tuple[str, ...]] = {"persistent": ("workers",)}


@dataclass(frozen=True)
class Settings:
    """Loader and transfer settings of one configuration: the keyword arguments of its calls of the pipeline.

    ``output="float"``: ``batches(..., float_on_host=True)`` (float32 made on the host); ``"uint8"``: on the device.
    """

    num_workers: int = 0
    pin_memory: bool = False
    persistent_workers: bool = False
    prefetch_factor: int | None = None
    output: str = "float"
    prefetcher: bool = False

    def describe(self) -> str:
        parts = [f"workers={self.num_workers}"]
        if self.num_workers:
            parts.append(f"persistent={self.persistent_workers}, prefetch={self.prefetch_factor or 2}")
        parts += [f"pin={self.pin_memory}", f"batches={self.output}", f"prefetcher={self.prefetcher}"]
        return ", ".join(parts)

    def loader_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of the reader's ``make_loader`` for these settings.

        Without workers only ``workers`` and ``pin`` are passed: ``prefetch_factor`` and
        ``persistent`` mean nothing there (the pipeline's ``make_loader`` ignores them).
        """
        kw: dict[str, Any] = {"workers": self.num_workers, "pin": self.pin_memory}
        if self.num_workers:
            kw.update(prefetch_factor=self.prefetch_factor or 2, persistent=self.persistent_workers)
        return kw

    def batches_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of the reader's ``batches`` for these settings."""
        return {"prefetch": self.prefetcher, "float_on_host": self.output == "float"}

    def calls(self, sep: str = " · ") -> str:
        """The two calls this configuration makes, as the reader would type them (joined by ``sep``)."""
        lk = ", ".join(f"{k}={v!r}" for k, v in self.loader_kwargs().items())
        bk = ", ".join(f"{k}={v!r}" for k, v in self.batches_kwargs().items())
        return f"make_loader(dataset, batch_size, {lk}){sep}batches(loader, {bk})"


def default_workers() -> int:
    """Workers used by the ``workers`` step: the usable cores, at most 8."""
    return max(1, min(8, usable_cores()))


def compute_threads(workers: int | None = None) -> int:
    """Intra-op threads for the main process: the usable cores minus the workers, at least 1."""
    nw = default_workers() if workers is None else check_int("workers", workers, 0, 64)
    return max(1, usable_cores() - nw)


def main_threads(n: int) -> contextlib.AbstractContextManager[int]:
    """Run the block with ``torch.set_num_threads(n)`` in this process; the previous count is restored.

    (:func:`helpers.core.device.intraop_threads`, under the name this chapter uses.)
    """
    return intraop_threads(n)


def settings_for(enabled: Iterable[str], workers: int | None = None) -> Settings:
    """Settings with the named steps switched on (any subset, in any order).

    Raises:
        ValueError: an unknown step, or persistent workers without workers.
    """
    names = list(enabled)
    for n in names:
        check_choice("step", n, STEP_NAMES)
    nw = default_workers() if workers is None else check_int("workers", workers, 1, 64)
    values: dict[str, Any] = {}
    for step in STEPS:
        if step.name in names:
            for k, v in step.change.items():
                values[k] = nw if v == "auto" else v
    if values.get("persistent_workers") and not values.get("num_workers"):
        raise ValueError("persistent workers need workers: switch on the 'workers' step too")
    if not values.get("num_workers"):
        values.pop("prefetch_factor", None)
    return Settings(**values)


def configurations(workers: int | None = None, names: Sequence[str] | None = None) -> list[tuple[Step, Settings]]:
    """The cumulative configurations: step k switches on steps 0..k. ``names`` picks a subset (in order)."""
    out = []
    for i, step in enumerate(STEPS):
        if names is not None and step.name not in names:
            continue
        out.append((step, settings_for(STEP_NAMES[: i + 1], workers)))
    return out


def step_answers(name: str) -> set[str]:
    """Every way a reader may name step ``name``: its name, its label as the tables print it, the label without '+'."""
    check_choice("step", name, STEP_NAMES)
    label = next(st.label for st in STEPS if st.name == name)
    return {name, label, label.lstrip("+ ").strip()}


def effective_on(step: Step, device: torch.device | str) -> bool:
    """Whether ``step`` can change anything on ``device``: pinning, uint8 normalised on the device and the
    prefetcher need CUDA.

    The uint8 step changes only *where* the float image is made (``batches(..., float_on_host=False)``): the
    workers send uint8 batches in every configuration (:func:`train_items` yields uint8 crops, and
    ``normalize`` runs in the main process either way), so on a CPU, where host and device are one, the
    step runs the same work in the same process as the configuration before it.
    """
    return not step.needs_cuda or torch.device(device).type == "cuda"


def cuda_step_evidence(step: Step) -> Evidence[Any]:
    """What stands in for ``step``'s measurement where it cannot act (no CUDA): figures of the same experiment
    published by others (cited, falsy: no value of this workbook's), or a ``missing`` Evidence saying that
    none was found and which experiment would produce one."""
    key = step.published_key or "ch06.waterfall.step_time"
    return evidence.published_elsewhere(f"the '{step.label}' step", key)


# ---------------------------------------------------------------------------
# The job
# ---------------------------------------------------------------------------

#: The two regimes: the model's size (``quick_width``: the width in quick mode), the learning rate and
#: ``warm_passes``, the number of times the job trains on the loader's first pass before its timed epoch.
#: The data-bound model is tiny so that even a CPU computes a batch faster than one process loads it:
#: one channel in its first stage, where most of its compute is (64x64 pixels), and 4 stages (1, 2, 4, 8
#: channels), whose receptive field spans the shapes (a one-stage model sees 3x3 pixels and stays at
#: chance; width 2 costs about 1.5x more per step than width 1 at the same depth). Measured on this
#: workbook's loaded 2-core machine (quick size, CPU, one thread): a training step on a batch of 32 takes
#: 5.5-11 ms (the former width-2, one-stage model: 3.7-7.3 ms), loading that batch in one process 9-13 ms:
#: ``calibrate`` checks it on every device (margin 2) and says when the regime is not reached.
#: Neither model learns in one epoch of 10 steps (both scored about chance), so each job first trains
#: on the loader's first pass, loaded once and kept, ``warm_passes`` times (untimed: no loading; see
#: :func:`run_config`); then the timed epoch. Accuracy after that: ``tests/test_ch06_learns.py``.
REGIMES: dict[str, dict[str, Any]] = {
    "data-bound": {
        "width": 1,
        "quick_width": 1,
        "depth": 4,
        "lr": 2e-2,
        "warm_passes": 5,
        "about": "a tiny CNN (1 channel at full resolution, 4 stages): the step is cheap, so the loader sets the pace",
    },
    "compute-bound": {
        "width": 96,
        "quick_width": 12,
        "depth": 3,
        "lr": 5e-3,
        "warm_passes": 3,
        "about": "a wide CNN (3 stages): the step is expensive, so the loader has time to spare",
    },
}


@dataclass(frozen=True)
class JobSpec:
    """The training job every configuration runs.

    ``warm_steps`` batches of the loader's first pass are trained ``warm_passes`` times, untimed
    (:func:`run_config`), then ``epochs`` epochs are timed; ``lr``: Adam's learning rate.
    """

    regime: str
    width: int
    depth: int = 3
    batch_size: int = 32
    crop_size: int = 64
    train_items: int = 640
    warm_steps: int = 2
    warm_passes: int = 1
    epochs: int = 1
    seed: int = 0
    lr: float = 2e-3
    threads: int = 1

    @property
    def steps_per_epoch(self) -> int:
        return self.train_items // self.batch_size


def job_sizes() -> dict[str, int]:
    """The data set and job sizes of the tier in force (:func:`helpers.core.config.sized`).

    quick and laptop use the small generated data set (640 training and 256
    validation images of 80x80, crops of 64: generated in seconds, shared with
    the other chapters' quick mode); laptop and quick train on 320 images per
    epoch (10 steps: with 15, the '+ workers' step sat at x1.00 on a quiet 2-core
    machine and its verdict changed from run to run). full (a GPU, or
    ``WORKBOOK_FULL=1``) uses chapter 01's data set (224-pixel crops) and 1,280
    images per epoch (20 steps: with the calibrated compute-bound model each step
    takes 2-3.5x a batch of in-process loading, so the chapter stays within a
    short GPU booking).

    One epoch (10 or 20 steps) is too short to learn the task: each job first
    trains untimed on the loader's first pass, loaded once, ``REGIMES[...]["warm_passes"]``
    times (:func:`job_spec` sets ``warm_steps`` to the whole pass), then times one epoch.
    So every job sees (1 + warm_passes) x ``train_items`` images before its accuracy is taken,
    and loads only two passes of them.
    """
    if sized(quick=False, laptop=True, full=False):
        small = {"n_train": 640, "n_val": 256, "image_size": 80, "crop_size": 64, "batch_size": 32}
        return {**small, "train_items": 320}
    sizes = dict(default_sizes())
    sizes["train_items"] = min(sizes["n_train"], sized(quick=320, full=1280))
    return sizes


def job_spec(regime: str, **overrides: Any) -> JobSpec:
    """The default job for ``regime`` at the tier in force (:func:`job_sizes`).

    The model's width and depth, the learning rate and ``warm_passes`` default to
    :data:`REGIMES`; the warm-up keeps the loader's whole first pass (``warm_steps``);
    the chapter passes the width and depth :func:`calibrate` chose for this device.
    """
    check_choice("regime", regime, tuple(REGIMES))
    sizes = job_sizes()
    r = REGIMES[regime]
    base = dict(
        regime=regime,
        width=sized(quick=r["quick_width"], full=r["width"]),
        depth=r["depth"],
        threads=compute_threads(),
        batch_size=sizes["batch_size"],
        crop_size=sizes["crop_size"],
        train_items=sizes["train_items"],
        warm_passes=r["warm_passes"],
        lr=r["lr"],
        epochs=1,
    )
    base.update(overrides)
    base.setdefault("warm_steps", base["train_items"] // max(1, base["batch_size"]))  # the whole first pass
    spec = JobSpec(**base)
    check_int("width", spec.width, 1, 512)
    check_int("depth", spec.depth, 1, 6)
    check_int("threads", spec.threads, 1, 1024)
    check_int("batch_size", spec.batch_size, 1, 4096)
    check_int("train_items", spec.train_items, spec.batch_size, 10_000_000)
    check_int("epochs", spec.epochs, 1, 100)
    check_int("warm_steps", spec.warm_steps, 0, 1000)
    check_int("warm_passes", spec.warm_passes, 1, 100)
    return spec


@dataclass(frozen=True)
class Pipeline:
    """The pipeline functions the capstone times: the reader's, from chapter 06's pipeline cells.

    Attributes:
        make_loader: ``make_loader(dataset, batch_size, workers=, pin=, prefetch_factor=, persistent=)``
            returns a re-iterable loader of ``(x, y)`` host batches (x uint8, ``(N, 3, H, W)``).
        batches: ``batches(loader, prefetch=, float_on_host=)`` yields ``(x, y)`` on the device, x
            float and normalised; ``batches(loader)`` (the defaults) is the fast pipeline.
        train_step: ``train_step(model, optimizer, x, y)`` trains one step and returns the loss tensor.
        normalize: ``normalize(x)``, uint8 to float on x's device (optional: for
            :func:`normalizer_device_exact`).
        source: where the functions come from, for messages.
    """

    make_loader: Callable[..., Any]
    batches: Callable[..., Iterable[Any]]
    train_step: Callable[..., Any]
    normalize: Callable[[torch.Tensor], torch.Tensor] | None = None
    source: str = "your pipeline cells"

    def __post_init__(self) -> None:
        for name in ("make_loader", "batches", "train_step"):
            if not callable(getattr(self, name)):
                raise ValueError(
                    f"{name} must be a function (run the pipeline cell that defines it), "
                    f"got {type(getattr(self, name)).__name__}"
                )
        if self.normalize is not None and not callable(self.normalize):
            raise ValueError(f"normalize must be a function or None, got {type(self.normalize).__name__}")


def reference_pipeline(device: torch.device | str = "cpu", *, seed: int = 0, workers: int | None = None) -> Pipeline:
    """The take-home pipeline (torch and torchvision only), for runs without the chapter's cells.

    Its functions are :mod:`helpers.chapters.ch06.fast_pipeline`'s: the pipeline block of ``examples/fast_pipeline.py``,
    line for line, in the package (tests keep it identical to the script and to chapter 06's pipeline cells), so
    an installed ``helpers`` needs no file outside it. ``tools.bench`` and the unit tests time these functions.
    The module's globals ``DEVICE``, ``SEED`` and ``WORKERS`` (what the pipeline reads) are set to ``device``,
    ``seed`` and ``workers`` (default :func:`default_workers`). The pipeline's ``source`` says
    ``examples/fast_pipeline.py``: the lines a reader can open and take home.
    """
    take_home.DEVICE = torch.device(device)
    take_home.SEED = check_int("seed", seed, 0, 2**62)
    take_home.WORKERS = default_workers() if workers is None else check_int("workers", workers, 0, 64)
    return Pipeline(
        take_home.make_loader,
        take_home.batches,
        take_home.train_step,
        take_home.normalize,
        source="examples/fast_pipeline.py",
    )


def _pipeline(
    pipeline: Pipeline | None,
    device: torch.device | str,
    seed: int = 0,
    *,
    make_loader: Callable[..., Any] | None = None,
    batches: Callable[..., Any] | None = None,
    train_step: Callable[..., Any] | None = None,
) -> Pipeline:
    """``pipeline``; or one made of the three functions (all three, or none); else :func:`reference_pipeline`."""
    given = {"make_loader": make_loader, "batches": batches, "train_step": train_step}
    if any(v is not None for v in given.values()):
        missing = [k for k, v in given.items() if v is None]
        if missing or pipeline is not None:
            raise ValueError(
                "pass make_loader, batches and train_step together (missing: "
                f"{', '.join(missing) or 'none'}), or pipeline=Pipeline(...), not both"
            )
        return Pipeline(make_loader, batches, train_step)  # type: ignore[arg-type]
    if pipeline is not None:
        if not isinstance(pipeline, Pipeline):
            raise ValueError(f"pipeline must be a capstone.Pipeline, got {type(pipeline).__name__}")
        return pipeline
    return reference_pipeline(device, seed=seed)


class SeededItems(Dataset):
    """``limit`` items of ``base`` spread evenly over it, item ``i`` augmented with a generator seeded by (seed, i).

    Item ``i`` of a subset of ``n`` is item ``i * len(base) // n`` of ``base`` (as
    :class:`helpers.chapters.ch07.ddp_train.IndexedDataset` strides): the generated data set lists its
    images class by class, so the *first* ``n`` items would be a few classes only (at full size
    all of class 0), and the job would train on them and score chance on the others.

    The random crop then does not depend on which process (main or worker) loads the item,
    so every configuration trains on identical batches. An item gets the same crop in every
    pass (the job times one epoch after a short warm-up). Picklable: workers import this
    class from ``helpers.chapters.ch06.capstone`` under spawn and forkserver (a class defined in a notebook
    cell could not be imported there).

    With ``normalize=True`` the base's uint8 image is turned into a normalised float image by the
    workbook's one normaliser, :func:`helpers.pipeline.data.to_float_normalized` (the capstone's job
    does not use it: its batches stay uint8 and the pipeline's ``batches`` normalises them).
    """

    def __init__(self, base: Dataset, seed: int = 0, normalize: bool = False, limit: int | None = None) -> None:
        self.base = base
        self.total = len(base)  # type: ignore[arg-type]
        self.n = self.total if limit is None else min(self.total, check_int("limit", limit, 1))
        self.seed = seed
        self.normalize = bool(normalize)

    def __len__(self) -> int:
        return self.n

    def base_index(self, index: int) -> int:
        """The index in ``base`` of item ``index``: evenly strided over the whole of ``base``."""
        return index * self.total // self.n

    def __getitem__(self, index: int) -> Any:
        index = int(index)
        if not 0 <= index < self.n:
            raise IndexError(f"index {index} out of range for {self.n} items")
        torch.default_generator.manual_seed((self.seed * 1_000_003 + index) % (2**63))
        img, label = self.base[self.base_index(index)]
        if self.normalize:
            img = to_float_normalized(img.unsqueeze(0))[0]
        return img, label


def seed_order(loader: Any, seed: int, epoch: int, *, fresh: bool) -> None:
    """Seed the shuffling of ``loader``'s next pass: the same order in every configuration.

    A ``DataLoader`` with ``shuffle=True`` draws its order from ``loader.generator`` (the
    global generator when it has none), after one draw for the workers' base seed that
    every new iterator makes. A loader with persistent workers makes a new iterator only
    for its first pass (``fresh``); later passes reuse it and skip that draw, so here it is
    drawn and dropped: the permutation of pass ``epoch`` is then the same with and without
    persistent workers. ``tests/test_ch06_pipeline.py`` checks this against torch.
    """
    gen = getattr(loader, "generator", None)
    gen = gen if isinstance(gen, torch.Generator) else torch.default_generator
    gen.manual_seed((int(seed) * 1_000_003 + int(epoch)) % (2**63))
    if not fresh and getattr(loader, "persistent_workers", False) and getattr(loader, "num_workers", 0) > 0:
        torch.empty((), dtype=torch.int64).random_(generator=gen)


def normalizer_device_exact(
    device: torch.device | str, normalize: Callable[[torch.Tensor], torch.Tensor] | None = None
) -> bool:
    """Whether ``normalize`` gives the same bits on ``device`` as on the CPU, for all 256 levels.

    ``normalize``: the pipeline's (the chapter passes its own), default the workbook's one normaliser,
    :func:`helpers.pipeline.data.to_float_normalized`.
    On a CPU trivially True. On CUDA it depends on the arithmetic: dividing by a Python
    scalar runs as a multiplication by its reciprocal there (one bit may differ from a true
    division on the CPU), so float configurations (normalised on the CPU) and uint8 ones
    (normalised on the GPU) would not see identical inputs. Measured, not assumed.
    """
    fn = normalize or to_float_normalized
    dev = torch.device(device)
    levels = torch.arange(256, dtype=torch.uint8).repeat(3, 1).view(1, 3, 16, 16)
    on_cpu = fn(levels)
    if dev.type == "cpu":
        return True
    return bool(torch.equal(fn(levels.to(dev)).cpu(), on_cpu))


@contextlib.contextmanager
def same_numerics() -> Iterator[None]:
    """Deterministic cuDNN for the block (``deterministic=True``, ``benchmark=False``); restored after.

    cuDNN may otherwise pick convolution algorithms whose backward pass adds in a
    varying order (atomics), and the auto-tuner may pick different algorithms
    in different runs: two runs of the same job would then differ by rounding.
    ``torch.use_deterministic_algorithms(True)`` is not used: it raises for
    ``adaptive_avg_pool2d_backward_cuda``, which the model needs. TF32 is left
    at PyTorch's setting: it is deterministic, so it does not make configurations
    differ (and mixing its legacy and new switches raises in torch >= 2.9).
    No effect without CUDA (the flags are only read by cuDNN).
    """
    cudnn = torch.backends.cudnn
    before = (cudnn.deterministic, cudnn.benchmark)
    cudnn.deterministic, cudnn.benchmark = True, False
    try:
        yield
    finally:
        cudnn.deterministic, cudnn.benchmark = before


_CACHE: dict[Any, Any] = {}


def _dataset_info() -> Any:
    sizes = job_sizes()
    key = ("info", sizes["n_train"], sizes["n_val"], sizes["image_size"])
    if key not in _CACHE:
        _CACHE[key] = make_shapes_dataset(
            n_train=sizes["n_train"], n_val=sizes["n_val"], image_size=sizes["image_size"]
        )
    return _CACHE[key]


def dataset_info() -> Any:
    """The generated data set the job trains on (:func:`helpers.pipeline.data.make_shapes_dataset`, cached)."""
    return _dataset_info()


def val_size(spec: JobSpec) -> int:
    """Number of validation images the job's accuracy is measured on."""
    return sum(int(y.shape[0]) for _, y in _val_batches(spec))


def _val_batches(spec: JobSpec) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The validation set, decoded once (uint8, centre crop), as a list of host batches.

    The job evaluates through the pipeline's ``batches(...)`` with its defaults, so the
    validation images are normalised by the same ``normalize`` as the training ones.
    """
    key = ("val", str(_dataset_info().val_dir), spec.crop_size, spec.batch_size)
    if key not in _CACHE:
        ds = ShapesDataset(_dataset_info().val_dir, crop_size=spec.crop_size, augment=False, output="uint8")
        batches = []
        for s in range(0, len(ds), spec.batch_size):
            items = [ds[i] for i in range(s, min(len(ds), s + spec.batch_size))]
            batches.append((torch.stack([x for x, _ in items]), torch.tensor([y for _, y in items])))
        _CACHE[key] = batches
    return _CACHE[key]


def chance_level(spec: JobSpec) -> float:
    """The accuracy of always answering the validation set's most frequent class (measured from its labels).

    What a model that learned nothing scores at best; a job's accuracy means something only clearly above it.
    """
    counts: dict[int, int] = {}
    for _, y in _val_batches(spec):
        for v in y.tolist():
            counts[int(v)] = counts.get(int(v), 0) + 1
    return max(counts.values()) / sum(counts.values())


def train_items(spec: JobSpec) -> SeededItems:
    """The job's training set: ``spec.train_items`` generated images spread evenly over every class
    (:class:`SeededItems`), uint8 crops seeded per item.

    It lives in this module so that DataLoader workers can import it (spawn, forkserver).
    """
    base = ShapesDataset(_dataset_info().train_dir, crop_size=spec.crop_size, augment=True, output="uint8")
    return SeededItems(base, seed=spec.seed, limit=spec.train_items)


def _build_loader(pipeline: Pipeline, spec: JobSpec, s: Settings) -> Any:
    """The pipeline's ``make_loader`` called with ``s``'s keyword arguments on :func:`train_items`.

    With workers, ``/dev/shm`` is checked first (:func:`helpers.pipeline.loaders.require_shm`): a worker
    that runs out of shared memory dies of a bus error, so the run refuses to start instead.
    """
    ds = train_items(spec)
    kw = s.loader_kwargs()
    if s.num_workers > 0:
        batch_bytes = 3 * spec.crop_size * spec.crop_size * spec.batch_size
        require_shm(shm_needed_bytes(batch_bytes, s.num_workers, kw["prefetch_factor"]))
    loader = pipeline.make_loader(ds, spec.batch_size, **kw)
    if isinstance(loader, DataLoader):  # chapter 04's protection: a frozen or sleeping worker ends in an error
        guard(loader, check_shm=False)
    return loader


def _worker_pids() -> set[int]:
    """Pids of this process's DataLoader workers now (:func:`helpers.pipeline.loaders.worker_processes`)."""
    return {p.pid for p in worker_processes()}


def _stop_new_workers(before: set[int], grace_s: float = 2.0) -> None:
    """End every worker started since ``before`` that is still alive (SIGTERM, then SIGKILL after ``grace_s``).

    The last line of defence of a run: the loaders are released first (:func:`_release`); a worker of an
    iterator the reader's ``batches`` held, and that an error or an interrupt left behind, ends here.
    """
    import psutil  # optional/heavy: only when a run ends

    new = [p for p in worker_processes() if p.pid not in before]
    for p in new:
        with contextlib.suppress(psutil.Error):
            p.terminate()
    _gone, alive = psutil.wait_procs(new, timeout=grace_s)
    for p in alive:
        with contextlib.suppress(psutil.Error):
            p.kill()
    psutil.wait_procs(alive, timeout=1.0)


def _failed(exc: BaseException, loader: Any) -> LoaderFailure | None:
    """What a run that failed with ``exc`` raises instead: a worker failure in plain words (None: ``exc`` itself).

    The traceback's frames are cleared first: a frame of the pipeline's ``batches`` generator (ended by the
    error) would otherwise keep its loader iterator, and with it the workers, alive for as long as the
    traceback lives (in a notebook: until the next error).
    """
    traceback.clear_frames(exc.__traceback__)
    return _plain_error(exc, loader) if isinstance(exc, RuntimeError) else None


def _plain_error(exc: BaseException, loader: Any) -> LoaderFailure | None:
    """A worker failure of ``loader`` in plain words (:class:`~helpers.pipeline.loaders.LoaderFailure`), or None."""
    frozen = list(getattr(loader, "_workbook_frozen", None) or [])
    if frozen:
        timeout = getattr(loader, "timeout", 0)
        text = (
            f"A DataLoader worker was stopped (SIGSTOP or Ctrl-Z) for more than {timeout:g} s, so the run was "
            f"stopped and its workers ended (pid(s) {', '.join(map(str, frozen))}). Run it again; with "
            "workers=0 everything loads in this process."
        )
    else:
        text = explain_loader_error(exc) or ""
    if not text or isinstance(exc, LoaderFailure):
        return None
    return LoaderFailure(text)


def _warm_batches(source: Any, steps: int, drain: bool) -> list[Any]:
    """The first ``steps`` batches of a fresh pass over ``source`` (the warm-up), then end that pass.

    With persistent workers (``drain=True``) the rest of the pass is read and
    dropped: otherwise the batches the workers already queued for it would be
    loaded, and thrown away, at the start of the next (timed) epoch, which
    would charge persistent workers for the warm-up's leftovers.
    """
    it = iter(source)
    batches = [b for _, b in zip(range(steps), it)]
    if drain:
        for _ in it:
            pass
    del it
    return batches


def _close(it: Any) -> None:
    """End a pass: close the pipeline's generator, so the loader iterator inside it is let go now."""
    close = getattr(it, "close", None)
    if close is not None:
        close()


def _release(loader: Any) -> None:
    try:
        from ...pipeline.loaders import release  # optional: a missing module is tolerated (ImportError)
    except ImportError:  # pragma: no cover - chapter 04's module missing
        return
    release(loader)


def _union(intervals: list[tuple[float, float]]) -> float:
    total, cur_s, cur_e = 0.0, None, None
    for a, b in sorted(intervals):
        if cur_e is None or a > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s  # type: ignore[operator]
            cur_s, cur_e = a, b
        else:
            cur_e = max(cur_e, b)
    if cur_e is not None:
        total += cur_e - cur_s  # type: ignore[operator]
    return total


@dataclass
class ConfigResult:
    """One configuration's run of the job.

    Attributes:
        name / label: the step that made this configuration (see :data:`STEPS`).
        settings: the loader and transfer settings.
        regime / spec: the job.
        device: where it ran.
        epoch_s: seconds per timed epoch (mean), worker start-up included.
        steps / samples: per timed epoch.
        accuracy: validation accuracy after training (0-1).
        trace: spans of every timed step: ``batch`` (the wait for the pipeline's next batch) and ``train_step``.
        compute_busy: share of the epoch the compute phases were running (GPU busy, on a GPU).
        data_stall: share of the epoch the loop waited for data (start-up included).
        stages: items/s of each stage alone ("loader", "copy", "compute"; ``None``: no such stage here).
        efficiency: :func:`pipeline_efficiency` (value at most 1, or a verdict; ``None`` if not measured).
        round_epoch_s: in a waterfall measured in rounds, the epoch time of every round
            (``epoch_s`` is then their median).
    """

    name: str
    label: str
    settings: Settings
    regime: str
    spec: JobSpec
    device: str
    epoch_s: float
    steps: int
    samples: int
    accuracy: float
    train_loss: float
    trace: SpanTrace
    compute_busy: float
    data_stall: float
    stages: dict[str, float | None] = field(default_factory=dict)
    efficiency: Efficiency | None = None
    round_epoch_s: list[float] = field(default_factory=list)

    @property
    def throughput(self) -> float:
        """Training samples per second."""
        return self.samples / self.epoch_s if self.epoch_s > 0 else float("nan")

    @property
    def step_s(self) -> float:
        return self.epoch_s / max(1, self.steps)

    @property
    def slowest_stage(self) -> str | None:
        known = {k: v for k, v in self.stages.items() if v}
        return min(known, key=lambda k: known[k]) if known else None


def _shares(trace: SpanTrace, epochs: list[tuple[float, float]], epoch_total: float) -> tuple[float, float]:
    compute = _union([(s.start, s.end) for s in trace.spans if s.name in COMPUTE_PHASES])
    data = sum(s.host_end - s.host_start for s in trace.spans if s.name in DATA_PHASES)
    # Start-up before each epoch's first span (iterator creation, worker start-up) is a data stall too.
    startup = 0.0
    for t_begin, _ in epochs:
        firsts = [s.host_start for s in trace.spans if s.host_start >= t_begin]
        if firsts:
            startup += max(0.0, min(firsts) - t_begin)
    return min(1.0, compute / epoch_total), min(1.0, (data + startup) / epoch_total)


def _on_device(x: torch.Tensor, dev: torch.device, pipeline: Pipeline) -> None:
    if x.device.type != dev.type:
        raise ValueError(
            f"batches() put the batch on {x.device}, but the job runs on {dev}: the pipeline "
            f"({pipeline.source}) reads DEVICE; run the job on DEVICE (device=DEVICE)"
        )


def _warm_up(
    pipeline: Pipeline, model: Any, opt: Any, loader: Any, s: Settings, spec: JobSpec, dev: torch.device
) -> None:
    """Untimed training before the timed epoch: the first ``spec.warm_steps`` batches of pass 0, trained
    ``spec.warm_passes`` times.

    The batches come from the pipeline's ``batches`` (loaded once, kept on the device); the first
    pass trains them in the loader's order, each later one in an order drawn from ``spec.seed`` and
    the pass (the same in every configuration). With persistent workers the rest of pass 0 is
    drained (:func:`_warm_batches`). :func:`job_spec` keeps all of pass 0 (at full size 20 batches of
    64 float crops of 224 pixels: about 0.8 GB on the device, freed before the timed epoch).
    """
    seed_order(loader, spec.seed, 0, fresh=True)
    it = pipeline.batches(loader, **s.batches_kwargs())
    try:
        warm = _warm_batches(it, spec.warm_steps, drain=s.persistent_workers and s.num_workers > 0)
    finally:
        _close(it)
    for x, _y in warm:
        _on_device(x, dev, pipeline)
    order = torch.Generator().manual_seed(spec.seed)
    for p in range(spec.warm_passes):
        for i in range(len(warm)) if p == 0 else torch.randperm(len(warm), generator=order).tolist():
            pipeline.train_step(model, opt, *warm[i])
    del warm


def _timed_epoch(
    pipeline: Pipeline,
    model: Any,
    opt: Any,
    loader: Any,
    s: Settings,
    spec: JobSpec,
    dev: torch.device,
    rec: SpanRecorder,
    epoch: int,
    start_step: int,
    fresh: bool = False,
) -> tuple[int, int, float, float]:
    """One pass of ``for x, y in batches(loader, ...): train_step(model, optimizer, x, y)``, recorded.

    Spans: ``batch`` (host time waiting for the next batch from the pipeline's ``batches``:
    loading, and on a GPU the copy and normalisation as ``batches`` issues them) and
    ``train_step`` (CUDA events on a GPU). The loss is summed on the device: nothing in the
    loop waits for the GPU. Returns (steps, samples, seconds, mean training loss).
    """
    lane = COMPUTE_LANE_GPU if rec.cuda else COMPUTE_LANE_CPU
    total = torch.zeros((), device=dev)
    steps = samples = 0
    seed_order(loader, spec.seed, epoch, fresh=fresh)
    t0 = time.perf_counter()
    it = iter(pipeline.batches(loader, **s.batches_kwargs()))
    try:
        while True:
            step = start_step + steps
            h0 = rec.now()
            try:
                x, y = next(it)
            except StopIteration:
                break
            rec.add("batch", step, h0, rec.now(), lane=DATA_LANE)
            if steps == 0:
                _on_device(x, dev, pipeline)
            with rec.span("train_step", step, gpu=True, lane=lane):
                loss = pipeline.train_step(model, opt, x, y)
            total += loss.detach().float() * y.shape[0]
            samples += int(y.shape[0])
            steps += 1
    finally:
        _close(it)
    synchronize(dev)
    seconds = time.perf_counter() - t0
    return steps, samples, seconds, float(total.item()) / max(1, samples)


@torch.no_grad()
def _evaluate(pipeline: Pipeline, model: Any, spec: JobSpec) -> float:
    """Top-1 accuracy on the validation set, through ``batches(val_batches)`` (the pipeline's defaults)."""
    was = model.training
    model.eval()
    correct, seen = None, 0
    try:
        for x, y in pipeline.batches(_val_batches(spec)):
            hit = (model(x).argmax(1) == y).sum()
            correct = hit if correct is None else correct + hit
            seen += int(y.shape[0])
    finally:
        model.train(was)
    if not seen:
        raise ValueError("the validation set yielded no batch")
    return float(correct.item()) / seen  # type: ignore[union-attr]


def run_config(
    settings: Settings,
    spec: JobSpec,
    device: torch.device | str = "cpu",
    *,
    name: str = "custom",
    label: str | None = None,
    stages: bool = True,
    progress: Callable[[float, str], None] | None = None,
    pipeline: Pipeline | None = None,
) -> ConfigResult:
    """Train the job once with ``settings`` through the pipeline's functions and measure it.

    ``pipeline``: the functions to time (the chapter passes the reader's; default
    :func:`reference_pipeline`). The loader is ``pipeline.make_loader(train_items(spec),
    spec.batch_size, **settings.loader_kwargs())``; every pass iterates
    ``pipeline.batches(loader, **settings.batches_kwargs())`` and calls
    ``pipeline.train_step(model, optimizer, x, y)``. The model is built from ``spec.seed``;
    an untimed warm-up comes first: the first ``spec.warm_steps`` batches of pass 0 (lazy
    initialisation, first worker start-up; with persistent workers the rest of that pass is
    drained, see :func:`_warm_batches`), loaded once and trained ``spec.warm_passes`` times
    (:func:`_warm_up`: the job learns there, without loading); then ``spec.epochs`` timed epochs,
    then evaluation on the validation set.
    Workers are released on return, also on errors and interrupts. The main process uses
    ``spec.threads`` intra-op threads meanwhile (:func:`main_threads`). The reader's global
    RNG state and thread count are restored afterwards.
    """
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device is 'cuda' but no CUDA device is available; use device='cpu'")
    pipe = _pipeline(pipeline, dev, spec.seed)
    report: Callable[..., None] = progress or (lambda f, t="": None)

    info = _dataset_info()
    model = build_model(width=spec.width, depth=spec.depth, num_classes=len(info.classes), seed=spec.seed).to(dev)
    opt = make_optimizer(model, lr=spec.lr)
    epochs: list[tuple[float, float]] = []
    loader = None
    before = _worker_pids()
    try:
        with main_threads(spec.threads), same_numerics(), torch.random.fork_rng(devices=[]):
            torch.manual_seed(spec.seed)
            loader = _build_loader(pipe, spec, settings)
            report(0.05, f"{name}: warm-up")
            if spec.warm_steps:
                _warm_up(pipe, model, opt, loader, settings, spec, dev)
            rec = SpanRecorder(
                dev,
                config=name,
                regime=spec.regime,
                settings=settings.describe(),
                calls=settings.calls(),
                pipeline=pipe.source,
            )
            total_s, steps, samples, loss = 0.0, 0, 0, 0.0
            for e in range(spec.epochs):
                report(0.1 + 0.7 * e / spec.epochs, f"{name}: epoch {e + 1}/{spec.epochs}")
                t_begin = rec.now()
                n, k, sec, mean_loss = _timed_epoch(
                    pipe,
                    model,
                    opt,
                    loader,
                    settings,
                    spec,
                    dev,
                    rec,
                    e + 1,
                    steps,
                    fresh=not spec.warm_steps and e == 0,
                )
                epochs.append((t_begin, rec.now()))
                total_s += sec
                steps += n
                samples += k
                loss += mean_loss * k
            trace = rec.finish()
            report(0.85, f"{name}: evaluating")
            acc = _evaluate(pipe, model, spec)
    except BaseException as exc:  # a worker that froze, slept past the timeout or died: plain words
        plain = _failed(exc, loader)
        if plain is None:
            raise
        raise plain from exc
    finally:
        if loader is not None:
            _release(loader)
        _stop_new_workers(before)
    if steps == 0:
        raise ValueError(f"train_items={spec.train_items} gives no full batch of {spec.batch_size}; raise train_items")
    busy, stall = _shares(trace, epochs, total_s)
    trace.metadata.update({"epoch_s": total_s / spec.epochs, "compute_busy": busy, "data_stall": stall})
    result = ConfigResult(
        name=name,
        label=label or name,
        settings=settings,
        regime=spec.regime,
        spec=spec,
        device=str(dev),
        epoch_s=total_s / spec.epochs,
        steps=steps // spec.epochs,
        samples=samples // spec.epochs,
        accuracy=acc,
        train_loss=loss / max(1, samples),
        trace=trace,
        compute_busy=busy,
        data_stall=stall,
    )
    if stages:
        report(0.9, f"{name}: stages alone")
        result.stages = stage_alone(settings, spec, dev, pipeline=pipe)
        result.efficiency = pipeline_efficiency(result.throughput, result.stages)
    report(1.0, f"{name}: done")
    return result


# ---------------------------------------------------------------------------
# Stages alone and pipeline efficiency
# ---------------------------------------------------------------------------


def _loader_alone(pipeline: Pipeline, spec: JobSpec, s: Settings, dev: torch.device) -> float:
    """Items/s of the pipeline's loader alone (``make_loader`` with ``s``), measured like the job's epoch.

    Same loader, same order, a warm-up of at most 2 batches of pass 0 (worker start-up;
    with persistent workers the rest of that pass is drained, as in the job; the job's longer
    warm-up trains from memory and does not change how the loader runs its next pass), then
    one whole pass (worker start-up included, as in the job's epoch), with the job's threads
    in the main process; nothing is copied or normalised. It does not depend on the model, so it is measured once for
    both regimes.
    """
    key = (
        "loader",
        id(pipeline.make_loader),
        spec.train_items,
        spec.batch_size,
        spec.crop_size,
        s.num_workers,
        s.persistent_workers,
        s.prefetch_factor,
        s.pin_memory and dev.type == "cuda",
        spec.threads,
        min(spec.warm_steps, 2),
    )
    if key in _CACHE:
        return _CACHE[key]
    loader = None
    before = _worker_pids()
    try:
        with main_threads(spec.threads), torch.random.fork_rng(devices=[]):
            loader = _build_loader(pipeline, spec, s)
            seed_order(loader, spec.seed, 0, fresh=True)
            _warm_batches(loader, min(spec.warm_steps, 2), drain=s.persistent_workers and s.num_workers > 0)
            seed_order(loader, spec.seed, 1, fresh=False)
            t0 = time.perf_counter()
            n = 0
            for x, _y in loader:
                n += int(x.shape[0])
            seconds = time.perf_counter() - t0
    except BaseException as exc:  # a worker that froze, slept past the timeout or died: plain words
        plain = _failed(exc, loader)
        if plain is None:
            raise
        raise plain from exc
    finally:
        if loader is not None:
            _release(loader)
        _stop_new_workers(before)
    _CACHE[key] = n / seconds if seconds > 0 else float("nan")
    return _CACHE[key]


def _sample_batch(spec: JobSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``spec.batch_size`` training items, collated (uint8)."""
    key = ("sample", spec.batch_size, spec.crop_size, spec.seed, spec.train_items)
    if key not in _CACHE:
        from torch.utils.data import default_collate

        ds = train_items(spec)
        with torch.random.fork_rng(devices=[]):
            _CACHE[key] = default_collate([ds[i] for i in range(min(spec.batch_size, len(ds)))])
    return _CACHE[key]


def _copy_alone(spec: JobSpec, s: Settings, dev: torch.device, repeats: int = 10) -> float | None:
    """Items/s of host-to-device copies of one batch as the configuration sends it (``None`` without CUDA).

    float32 for ``float_on_host`` configurations (4 bytes per pixel), uint8 otherwise; pinned
    and ``non_blocking=True`` with ``pin=True``, as ``batches`` copies.
    """
    if dev.type != "cuda":
        return None
    x, y = _sample_batch(spec)
    if s.output == "float":
        x = x.float()  # the bytes a float batch moves (the values do not change a copy's time)
    if s.pin_memory:
        x, y = x.pin_memory(), y.pin_memory()
    nb = s.pin_memory
    times = []
    for _ in range(repeats + 2):
        synchronize(dev)
        t0 = time.perf_counter()
        x.to(dev, non_blocking=nb), y.to(dev, non_blocking=nb)
        synchronize(dev)
        times.append(time.perf_counter() - t0)
    return spec.batch_size / statistics.median(times[2:])


def _compute_alone(pipeline: Pipeline, spec: JobSpec, dev: torch.device) -> float:
    """Items/s of the pipeline's ``train_step`` on one float batch already on the device.

    Same model, batch size and threads as the job; two warm-up steps, then as
    many timed steps as an epoch has (4 to 20), each synchronised. Throughput
    is the batch size over the **lower-quartile** step: the stage's own pace
    when nothing else disturbs it, not counting steps slowed by other programs
    (such hiccups slow the pipeline's epoch too, so they count against its
    efficiency, never for it).
    """
    key = (
        "compute",
        id(pipeline.train_step),
        spec.width,
        spec.depth,
        spec.batch_size,
        spec.crop_size,
        str(dev),
        spec.threads,
        spec.train_items,
    )
    if key in _CACHE:
        return _CACHE[key]
    times = _step_times(spec, dev, max(4, min(spec.steps_per_epoch, 20)), pipeline.train_step)
    _CACHE[key] = spec.batch_size / statistics.quantiles(times, n=4, method="inclusive")[0]
    return _CACHE[key]


def _plain_step(model: Any, optimizer: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """A training step (chapter 01's train_step), for calibrations run without the reader's pipeline."""
    loss = torch.nn.functional.cross_entropy(model(x), y)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return loss.detach()


def _step_times(
    spec: JobSpec, dev: torch.device, n: int, train_step: Callable[..., Any] | None = None, warm: int = 2
) -> list[float]:
    """Seconds of ``n`` synchronised ``train_step`` calls with ``spec``'s model on one float batch on ``dev``."""
    step = train_step or _plain_step
    x, y = move_batch(_sample_batch(spec), dev, non_blocking=False)
    x = to_float_normalized(x)
    model = build_model(
        width=spec.width, depth=spec.depth, num_classes=int(_dataset_info().params["num_classes"]), seed=spec.seed
    ).to(dev)
    opt = make_optimizer(model, lr=spec.lr)
    times = []
    with main_threads(spec.threads), same_numerics():
        for _ in range(warm):
            step(model, opt, x, y)
        synchronize(dev)
        for _ in range(n):
            t0 = time.perf_counter()
            step(model, opt, x, y)
            synchronize(dev)
            times.append(time.perf_counter() - t0)
    return times


def stage_alone(
    settings: Settings, spec: JobSpec, device: torch.device | str = "cpu", *, pipeline: Pipeline | None = None
) -> dict[str, float | None]:
    """Throughput (items/s) of each stage run alone: ``loader``, ``copy`` (CUDA only) and ``compute``.

    ``loader``: the pipeline's ``make_loader`` alone; ``copy``: one batch as the configuration
    sends it; ``compute``: the pipeline's ``train_step`` on a batch already on the device.
    Each stage runs as it does in the job: same batch size, same warm-up, same threads
    (``spec.threads``). Results are cached per stage settings: stages that a configuration
    does not change (the loader in both regimes, the compute across loader settings) are
    measured once.
    """
    dev = torch.device(device)
    pipe = _pipeline(pipeline, dev, spec.seed)
    return {
        "loader": _loader_alone(pipe, spec, settings, dev),
        "copy": _copy_alone(spec, settings, dev),
        "compute": _compute_alone(pipe, spec, dev),
    }


EFFICIENCY_NOISE = 0.10
"""Relative noise allowed between the pipeline's run and its stages' separate runs (10%): a pipeline
measured faster than its slowest stage alone by no more than this is 'at the bottleneck'."""


@dataclass(frozen=True)
class Efficiency:
    """A pipeline efficiency as shown to a reader: a ``value`` never above 1, or none and a verdict why.

    ratio: the raw measurement, throughput / slowest stage alone (what is recorded).
    value: ``ratio`` when at most 1; 1.0 when above 1 within the noise; ``None`` when out of range.
    verdict: '' when ``value`` is the ratio, else why it is not ('at the bottleneck (within noise)',
        or 'out of range: ...' with the reason).
    """

    ratio: float
    value: float | None
    verdict: str = ""

    @classmethod
    def of_ratio(cls, ratio: float, noise: float = EFFICIENCY_NOISE) -> Efficiency:
        """The one rule: a pipeline cannot beat its slowest stage, so above 1 is noise or a bad measurement.

        >>> Efficiency.of_ratio(1.05).value, Efficiency.of_ratio(1.49).value
        (1.0, None)
        """
        if ratio <= 1.0:
            return cls(ratio, ratio)
        if ratio <= 1.0 + noise:
            return cls(ratio, 1.0, "at the bottleneck (within noise)")
        return cls(
            ratio,
            None,
            f"out of range: the pipeline ran {ratio:.2f}x its slowest stage alone, beyond the {noise:.0%} "
            "noise; the stages-alone figures were measured under other conditions (a pipeline cannot beat "
            "its bottleneck)",
        )

    def short(self) -> str:
        """For a table column: '0.90', '1.00 (noise)' or 'out of range'."""
        if self.value is None:
            return "out of range"
        return f"{self.value:.2f}" + (" (noise)" if self.verdict else "")

    def __str__(self) -> str:
        """For a sentence: '0.90', '1.00, at the bottleneck (within noise)' or 'out of range: <why>'."""
        if self.value is None:
            return self.verdict
        return f"{self.value:.2f}" + (f", {self.verdict}" if self.verdict else "")


def pipeline_efficiency(
    throughput: float, stages: Mapping[str, float | None], noise: float = EFFICIENCY_NOISE
) -> Efficiency | None:
    """Pipeline throughput divided by the throughput of its slowest stage alone, never shown above 1.

    1.0 means the stages overlap perfectly: the pipeline runs as fast as its
    bottleneck allows; it cannot honestly exceed 1. A ratio above 1 by no more
    than ``noise`` is shown as 1.0, 'at the bottleneck (within noise)'; further
    above, no value is shown, only the verdict 'out of range' and why
    (:meth:`Efficiency.of_ratio`). Stages given as ``None`` (absent, e.g. the
    copy on a CPU) are ignored; ``None`` if no stage is known.

    >>> pipeline_efficiency(900.0, {"loader": 1000.0, "copy": None, "compute": 3000.0}).value
    0.9
    """
    known = [float(v) for v in stages.values() if v is not None and v > 0 and math.isfinite(v)]
    if not known or not (throughput > 0):
        return None
    return Efficiency.of_ratio(float(throughput) / min(known), noise)


def compare_threads(
    spec: JobSpec,
    step: str = "persistent",
    device: torch.device | str = "cpu",
    threads: Sequence[int] | None = None,
    *,
    pipeline: Pipeline | None = None,
) -> list[ConfigResult]:
    """Run the cumulative configuration ``step`` of ``spec`` once per main-process thread count, back to back.

    ``threads`` defaults to ``(spec.threads, all usable cores)``: what the
    capstone uses while workers run, and PyTorch's default. Stages alone are
    not measured, and the warm-up is 2 steps (``warm_steps=2, warm_passes=1``): this
    compares the timed epoch, whose length does not depend on what the model has
    learned, and no accuracy of it is reported (a longer warm-up would only lengthen
    the chapter: run with PyTorch's default threads beside busy workers, each of its
    steps is slowed by the very oversubscription this measures). Each result's
    ``trace.metadata["threads"]`` says which count it had. ``pipeline``: as in :func:`run_config`.
    """
    check_choice("step", step, STEP_NAMES)
    counts = list(threads) if threads is not None else sorted({spec.threads, usable_cores()})
    settings = dict((st.name, s) for st, s in configurations())[step]
    label = next(st.label for st in STEPS if st.name == step)
    out = []
    for n in counts:
        r = run_config(
            settings,
            dataclasses.replace(
                spec, threads=check_int("threads", n, 1, 1024), warm_steps=min(spec.warm_steps, 2), warm_passes=1
            ),
            device,
            name=step,
            label=f"{label}, {n} thread{'s' if n > 1 else ''}",
            stages=False,
            pipeline=pipeline,
        )
        r.trace.metadata["threads"] = n
        out.append(r)
    return out


# ---------------------------------------------------------------------------
# Calibrating the regimes on this device
# ---------------------------------------------------------------------------

#: Models the compute-bound search may pick, as (width, depth): the last stage has at most 8,192 channels
#: (the largest, width 512 and depth 5, holds about 400 M parameters: a probe that runs out of memory ends the search).
MODEL_LADDER: tuple[tuple[int, int], ...] = tuple(
    (w, d)
    for d in (3, 4, 5)
    for w in (8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)
    if w * 2 ** (d - 1) <= 8192
)


def model_flops(width: int, depth: int, crop_size: int, num_classes: int = 6) -> int:
    """Forward FLOPs per image of :class:`helpers.pipeline.models.SmallCNN` (one conv per stage), from its shapes.

    The same count as :func:`helpers.pipeline.models.flops_per_sample`, without building the model
    (2 FLOPs per multiply-add; 3x3 convolutions with padding 1, each stage halving the side).
    """
    check_int("width", width, 1, 512)
    check_int("depth", depth, 1, 6)
    check_int("crop_size", crop_size, 1, 8192)
    total, c_in, side = 0, 3, crop_size
    for stage in range(depth):
        c_out = width * 2**stage
        total += 2 * 9 * c_in * c_out * side * side
        c_in, side = c_out, side // 2
    return total + 2 * c_in * num_classes


def probe_bytes(width: int, depth: int, batch_size: int, crop_size: int, num_classes: int = 6) -> int:
    """Device memory one training step of :class:`helpers.pipeline.models.SmallCNN` needs, estimated from its shapes.

    Per stage, per element of the batch's convolution output: the convolution's and BatchNorm's outputs kept
    for the backward pass and their gradients (16 bytes; the ReLU works in place), the max-pool's output,
    its int64 indices and its gradient (a quarter as many elements, 16 bytes); per parameter 16 bytes
    (weights, gradients and Adam's two moments); the input batch (uint8 and float); then 25% for the
    allocator's rounding and cuDNN's workspace. For width 96, depth 3, 64 crops of 224 pixels: about 13 GiB.
    """
    check_int("width", width, 1, 512)
    check_int("depth", depth, 1, 6)
    total, c_in, side, params = 0, 3, crop_size, 0
    for stage in range(depth):
        c_out = width * 2**stage
        elems = batch_size * c_out * side * side
        total += elems * 16 + (elems // 4) * 16
        params += 9 * c_in * c_out + 2 * c_out
        c_in, side = c_out, max(1, side // 2)
    params += c_in * num_classes + num_classes
    total += params * 16 + batch_size * 3 * crop_size * crop_size * 5
    return int(total * 1.25)


def device_memory_check(device: torch.device | str, need_bytes: int, share: float = 0.8) -> str | None:
    """``None`` when ``need_bytes`` fits in ``share`` of the device's free memory, else why not (CUDA only).

    The free memory is measured by ``torch.cuda.mem_get_info`` *after* ``torch.cuda.empty_cache()``: blocks
    this process's caching allocator keeps but no tensor uses count as free only once they are returned.
    The reason says what is held: the device's free and total memory, and what this process's tensors hold.
    """
    dev = torch.device(device)
    if dev.type != "cuda":
        return None
    torch.cuda.empty_cache()  # first: cached blocks of earlier probes are free memory for this one
    free, total = torch.cuda.mem_get_info(dev)
    if need_bytes <= share * free:
        return None
    held = torch.cuda.memory_allocated(dev)
    gib = 2.0**30
    return (
        f"it would need about {need_bytes / gib:.1f} GiB of device memory, more than {share:.0%} of the "
        f"{free / gib:.1f} GiB free of {total / gib:.1f} GiB after empty_cache() (this process's tensors hold "
        f"{held / gib:.1f} GiB; other processes and the CUDA context hold the rest)"
    )


def release_pinned_host_memory(device: torch.device | str) -> str:
    """One line: the pinned host memory PyTorch's caching host allocator holds, and what releasing it gave back.

    Every pinned batch (``pin=True``: the loader's uint8 batches, and the float ones ``batches`` pins
    again) is taken from PyTorch's caching host allocator, and stays cached there after use, for the
    kernel's lifetime: batches x workers x prefetch of them, each rounded up to a power of two. The
    held bytes are read from ``torch.cuda.host_memory_stats()`` (``allocated_bytes.current``: active and
    cached; ``active_bytes.current``: in use; through
    :func:`helpers.pipeline.transfer.host_allocator_stats`), then every device is synchronised (a
    block whose copy is still queued cannot be freed) and the unused blocks are returned with
    ``torch.accelerator.empty_host_cache()`` (public in the torch this workbook pins; looked up, not assumed), and
    the stats read again.
    Without CUDA, or with a torch that lacks either function, the line says so; nothing is invented.
    """
    from ...pipeline import transfer  # optional: only after a waterfall

    dev = torch.device(device)
    if dev.type != "cuda":
        return "pinned host memory: none (no CUDA device: nothing was pinned, so the host allocator holds nothing)"
    before = transfer.host_allocator_stats()
    if not isinstance(before, dict):
        return f"pinned host memory: not measured ({before})"
    mib = 2.0**20
    line = (
        f"pinned host memory cached by PyTorch's host allocator: {before['allocated_bytes'] / mib:.0f} MiB "
        f"({before['active_bytes'] / mib:.0f} MiB of it in use)"
    )
    empty = getattr(getattr(torch, "accelerator", None), "empty_host_cache", None)
    if empty is None:
        return line + f"; torch {torch.__version__} has no torch.accelerator.empty_host_cache(): it stays held"
    for i in range(torch.cuda.device_count()):  # copies from pinned blocks may still be queued on any device
        torch.cuda.synchronize(i)
    empty()
    after = transfer.host_allocator_stats()
    if not isinstance(after, dict):
        return line + f"; released with torch.accelerator.empty_host_cache(), not measured after ({after})"
    freed = before["allocated_bytes"] - after["allocated_bytes"]
    return (
        line + f"; torch.accelerator.empty_host_cache() released {freed / mib:.0f} MiB, "
        f"{after['allocated_bytes'] / mib:.0f} MiB still held"
    )


@dataclass
class Calibration:
    """What :func:`choose_model` chose for one regime on one device, and why.

    Attributes:
        regime: ``"data-bound"`` or ``"compute-bound"``.
        width / depth: the model chosen.
        loader_s: seconds per batch of the baseline loader alone (``make_loader(..., workers=0, pin=False)``).
        compute_s: seconds per training step of the chosen model alone (median).
        reached: whether the regime holds: data-bound: ``compute_s * margin <= loader_s``;
            compute-bound: ``compute_s >= margin * loader_s``.
        margin: the factor asked for between the two stages.
        tried: ``(width, depth, seconds per step)`` of every model measured, in order.
        reason: one sentence: what was chosen and why (or why the regime was not reached).
        seconds: time the calibration took.
    """

    regime: str
    width: int
    depth: int
    loader_s: float
    compute_s: float
    reached: bool
    margin: float
    tried: list[tuple[int, int, float]] = field(default_factory=list)
    reason: str = ""
    seconds: float = 0.0

    @property
    def ratio(self) -> float:
        """Compute time over loader time per batch (> 1: the compute is slower)."""
        return self.compute_s / self.loader_s if self.loader_s > 0 else float("inf")

    def describe(self) -> str:
        return (
            f"{self.regime}: width {self.width}, depth {self.depth}: compute alone {self.compute_s * 1e3:.1f} ms "
            f"per batch vs loader alone {self.loader_s * 1e3:.1f} ms (x{self.ratio:.2f}); {self.reason}"
        )


def choose_model(
    regime: str,
    measure: Callable[[int, int], float],
    loader_s: float,
    *,
    start: tuple[int, int],
    crop_size: int,
    margin: float = 2.0,
    upper: float = 3.5,
    budget_s: float = 30.0,
    max_probes: int = 6,
    ladder: Sequence[tuple[int, int]] = MODEL_LADDER,
    clock: Callable[[], float] = time.perf_counter,
    fits: Callable[[int, int], str | None] | None = None,
) -> Calibration:
    """Pick the model of ``regime`` from measured stage times (a pure function of ``measure`` and ``loader_s``).

    ``measure(width, depth)`` returns seconds per training step of that model
    alone; ``loader_s`` is seconds per batch of the loader alone.

    * **data-bound**: the ``start`` model (the tiny one) must compute a batch at
      least ``margin`` times faster than the loader loads one; nothing smaller
      is tried, so if it is not, the regime is reported as not reached.
    * **compute-bound**: the model's step must take ``margin`` to ``upper``
      times as long as the loader's batch. From ``start``, each probe predicts
      the needed size from the last measurement (time scales with
      :func:`model_flops`) and measures the smallest model of ``ladder`` that
      should get there; it stops when the ratio is in range, the ladder ends,
      a probe runs out of device memory or would not fit in it (``fits(width, depth)`` returns why not,
      e.g. :func:`device_memory_check`), ``max_probes`` models were measured, or
      ``budget_s`` is spent. It keeps the smallest model measured that reached
      the regime, else the largest measured (and says the regime was not reached).
    """
    check_choice("regime", regime, tuple(REGIMES))
    check_float("loader_s", loader_s, 0.0)
    check_float("margin", margin, 1.0, 1000.0)
    check_float("upper", upper, margin, 1e6)
    t0 = clock()
    tried: list[tuple[int, int, float]] = []

    def done(width: int, depth: int, compute_s: float, reached: bool, reason: str) -> Calibration:
        return Calibration(regime, width, depth, loader_s, compute_s, reached, margin, tried, reason, clock() - t0)

    if regime == "data-bound":
        c = measure(*start)
        tried.append((start[0], start[1], c))
        ok = c * margin <= loader_s
        why = (
            (
                f"the tiny model computes a batch {loader_s / c:.1f}x faster than the loader loads one"
                if ok
                else f"even the tiny model is not {margin:.0f}x faster than the loader here "
                "(data-bound regime not reached: loading steps may gain little)"
            )
            if c > 0
            else "no time measured"
        )
        return done(start[0], start[1], c, ok, why)

    order = sorted(set(ladder) | {start}, key=lambda m: model_flops(m[0], m[1], crop_size))
    flops = {m: model_flops(m[0], m[1], crop_size) for m in order}
    current = start
    stop = ""
    seen: dict[tuple[int, int], float] = {}
    while True:
        too_big = fits(*current) if fits is not None else None
        if too_big is not None:  # not measured: the probe would not fit in the device's memory
            stop = f"width {current[0]}, depth {current[1]} was not tried: {too_big}"
            break
        try:
            c = measure(*current)
        except torch.OutOfMemoryError:
            stop = f"width {current[0]}, depth {current[1]} ran out of device memory"
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            break
        seen[current] = c
        tried.append((current[0], current[1], c))
        ratio = c / loader_s if loader_s > 0 else float("inf")
        if margin <= ratio <= upper:
            break
        if len(tried) >= max_probes:
            stop = f"{max_probes} models measured"
            break
        if clock() - t0 > budget_s:
            stop = f"the calibration's time budget ({budget_s:.0f} s) is spent"
            break
        target = flops[current] * (margin + upper) / 2 / max(ratio, 1e-9)
        if ratio < margin:
            bigger = [m for m in order if flops[m] > flops[current] and m not in seen]
            nxt = next((m for m in bigger if flops[m] >= target), bigger[-1] if bigger else None)
        else:
            smaller = [
                m
                for m in order
                if flops[m] < flops[current]
                and m not in seen
                and not any(flops[m] <= flops[k] and v < margin * loader_s for k, v in seen.items())
            ]
            nxt = next((m for m in smaller if flops[m] >= target), smaller[-1] if smaller else None)
        if nxt is None:
            stop = "no other model on the ladder"
            break
        current = nxt
    fast_enough = {m: v for m, v in seen.items() if v >= margin * loader_s}
    if fast_enough:
        best = min(fast_enough, key=lambda m: flops[m])
        c = fast_enough[best]
        why = (
            f"the smallest model measured whose step takes at least {margin:.0f}x the loader's batch "
            f"({len(tried)} model(s) measured)"
        )
        return done(best[0], best[1], c, True, why)
    if not seen:
        return done(start[0], start[1], float("nan"), False, f"nothing could be measured: {stop}")
    best = max(seen, key=lambda m: flops[m])
    why = (
        f"compute-bound regime NOT reached: the largest model measured takes only {seen[best] / loader_s:.2f}x the "
        f"loader's batch ({stop}); its loading steps are expected to gain as in the data-bound regime"
    )
    return done(best[0], best[1], seen[best], False, why)


def _loader_batch_s(pipeline: Pipeline, spec: JobSpec, dev: torch.device, batches: int = 4) -> float:
    """Median seconds per batch of the baseline loader alone (``make_loader(..., workers=0, pin=False)``),
    after one warm-up batch."""
    times = []
    loader = None
    before = _worker_pids()
    try:
        with main_threads(spec.threads), torch.random.fork_rng(devices=[]):
            loader = _build_loader(pipeline, spec, Settings())
            seed_order(loader, spec.seed, 0, fresh=True)
            it = iter(loader)
            next(it)
            for _ in range(batches):
                t0 = time.perf_counter()
                if next(it, None) is None:
                    break
                times.append(time.perf_counter() - t0)
            del it
    except BaseException as exc:  # a worker that froze, slept past the timeout or died: plain words
        plain = _failed(exc, loader)
        if plain is None:
            raise
        raise plain from exc
    finally:
        if loader is not None:
            _release(loader)
        _stop_new_workers(before)
    if not times:
        raise ValueError(
            f"train_items={spec.train_items} gives too few batches of {spec.batch_size} to time the loader"
        )
    return statistics.median(times)


def calibrate(
    device: torch.device | str = "cpu",
    *,
    margin: float = 2.0,
    budget_s: float | None = None,
    progress: Callable[..., None] | None = None,
    pipeline: Pipeline | None = None,
) -> dict[str, Calibration]:
    """Choose each regime's model for ``device`` from measured stage times (cached per device and sizes).

    The loader alone (the pipeline's ``make_loader`` at the baseline: in the main process,
    the job's threads) is timed for a few batches; then :func:`choose_model` times the
    pipeline's ``train_step`` with the tiny model (it must be ``margin`` x faster:
    data-bound) and searches for a model at least ``margin`` x slower (compute-bound),
    within ``budget_s`` seconds (default: 10 quick, 30 laptop, 60 full). On an H200 the wide
    model of a CPU would compute a batch in a few milliseconds, faster than the loader: both
    regimes would then be data-bound, which the search prevents. ``pipeline``: as in
    :func:`run_config`.
    """
    dev = torch.device(device)
    budget = budget_s if budget_s is not None else sized(quick=10.0, laptop=30.0, full=60.0)
    base = job_spec("data-bound")
    pipe = _pipeline(pipeline, dev, base.seed)
    key = (
        "calibration",
        str(dev),
        base.batch_size,
        base.crop_size,
        base.threads,
        margin,
        str(_dataset_info().train_dir),
        id(pipe.make_loader),
        id(pipe.train_step),
    )
    if key in _CACHE:
        return _CACHE[key]
    report: Callable[..., None] = progress or (lambda f, t="": None)
    report(0.0, "timing the loader alone")
    loader_s = _loader_batch_s(pipe, base, dev, batches=sized(quick=3, laptop=5, full=8))
    n_steps = sized(quick=3, laptop=4, full=5)

    def measure(width: int, depth: int) -> float:
        report(0.3, f"timing train_step alone: width {width}, depth {depth}")
        spec = dataclasses.replace(base, width=width, depth=depth)
        return statistics.median(_step_times(spec, dev, n_steps, pipe.train_step, warm=1))

    classes = int(_dataset_info().params["num_classes"])

    def fits(width: int, depth: int) -> str | None:  # bounded by the memory free now, not by the card's size
        return device_memory_check(dev, probe_bytes(width, depth, base.batch_size, base.crop_size, classes))

    out = {}
    for regime in REGIMES:
        r = REGIMES[regime]
        start = (sized(quick=r["quick_width"], full=r["width"]), r["depth"])
        out[regime] = choose_model(
            regime,
            measure,
            loader_s,
            start=start,
            crop_size=base.crop_size,
            margin=margin,
            budget_s=budget,
            fits=fits,
        )
    report(1.0, "calibrated")
    _CACHE[key] = out
    return out


def expected_within_noise(
    step: Step, regime: str, device: torch.device | str, cal: Calibration | None = None
) -> str | None:
    """Why ``step``'s gain over the configuration before it is expected to be within noise here, or None.

    From the bottleneck model and the calibration's stage times: a step that
    needs CUDA does nothing on a CPU; in a compute-bound regime (the step takes
    ``ratio`` x the loader's batch), only the workers step can remove the
    in-process loading from each step (an expected gain of about
    ``1 + 1 / ratio``, less the workers' start-up, paid in every epoch); once
    workers hide loading, the later loading steps, and pinning, have little to
    remove. Persistent workers are not expected within noise in either regime:
    the start-up they remove is a stall before the first batch of each epoch,
    which no amount of compute hides.
    """
    if not effective_on(step, device):
        return "needs CUDA: no effect on this device"
    if regime == "compute-bound" and cal is not None and cal.reached:
        if step.name == "workers":
            return None
        if step.name in ("uint8", "prefetcher", "pinned"):
            return (
                f"compute-bound: the step takes {cal.ratio:.1f}x the loader's batch, so loading is already "
                "hidden behind it (or, before workers, this step does not shorten it)"
            )
    return None


# ---------------------------------------------------------------------------
# The waterfall: every configuration in one regime
# ---------------------------------------------------------------------------


#: The largest run-to-run variation (:meth:`Waterfall.noise_floor`) under which a step within noise can be
#: called 'no effect' rather than 'within noise': a noisier run cannot rule out a change of that size.
NO_EFFECT_FLOOR = 0.10

#: Every verdict :meth:`Waterfall.verdicts` gives a step (the baseline gets '').
VERDICTS: tuple[str, ...] = ("gain", "slower", "no effect", "within noise", "one round", "needs CUDA")


@dataclass
class Waterfall:
    """All configurations of one regime, in stacking order, measured in alternating rounds.

    Attributes:
        regime / spec / device: the job and where it ran.
        results: one :class:`ConfigResult` per configuration (trace, shares and
            accuracy from the first round; ``epoch_s``: the median over rounds).
        rounds: how many rounds measured every configuration.
        calibration: how the regime's model was chosen (:func:`calibrate`), if it was.
        not_measured: the names of the steps left out because they cannot act on this device (they need
            CUDA): the table labels them so, with their published figures (:func:`cuda_step_evidence`),
            and gives them no ratio.
    """

    regime: str
    spec: JobSpec
    device: str
    results: list[ConfigResult]
    rounds: int = 1
    calibration: Calibration | None = None
    not_measured: list[str] = field(default_factory=list)

    @property
    def baseline(self) -> ConfigResult:
        return self.results[0]

    def speedups(self) -> list[float]:
        """Cumulative speedup of each configuration over the first (ratio of median epoch times)."""
        b = self.baseline.epoch_s
        return [b / r.epoch_s for r in self.results]

    def _round_gains(self, i: int) -> list[float]:
        a, b = self.results[i - 1], self.results[i]
        ta = a.round_epoch_s or [a.epoch_s]
        tb = b.round_epoch_s or [b.epoch_s]
        return [x / y for x, y in zip(ta, tb)]

    def gains(self) -> list[float]:
        """Speedup of each configuration over the one before it (1.0 for the first): the median of the
        per-round ratios, each taken between two runs measured back to back."""
        return [1.0] + [statistics.median(self._round_gains(i)) for i in range(1, len(self.results))]

    def gain_ranges(self) -> list[tuple[float, float] | None]:
        """(lowest, highest) per-round gain of each configuration over the one before it; None with one round."""
        out: list[tuple[float, float] | None] = [None]
        for i in range(1, len(self.results)):
            g = self._round_gains(i)
            out.append((min(g), max(g)) if len(g) > 1 else None)
        return out

    def noise_floor(self) -> float | None:
        """How much the same configuration's epoch time varied between rounds here: the median over
        configurations of (slowest - fastest) / median round. ``None`` with one round."""
        spreads = [
            (max(r.round_epoch_s) - min(r.round_epoch_s)) / statistics.median(r.round_epoch_s)
            for r in self.results
            if len(r.round_epoch_s) > 1
        ]
        return statistics.median(spreads) if spreads else None

    def ratio_noise(self) -> float | None:
        """How much a step's per-round gain scattered here: the interquartile range of every step's per-round
        gains, each divided by its step's median gain (:func:`helpers.core.agreement.ratio_noise`). ``None``
        with one round.

        The noise of the *ratio* the verdicts judge, not of the epoch times (:meth:`noise_floor`): a round in
        which the machine was slower slows both neighbours measured back to back, and leaves their ratio as it
        was. It settles as rounds are added (a range keeps widening)."""
        return agreement.ratio_noise([self._round_gains(i) for i in range(1, len(self.results))])

    def within_noise(self) -> list[bool | None]:
        """Per configuration: True when its gain cannot be told from noise: its per-round gains do not agree on
        a direction (every round, or all but a quarter of them rounded down:
        :func:`~helpers.core.agreement.ratios_split_on_direction`), or the median gain differs from 1 by no
        more than :meth:`ratio_noise` (:func:`~helpers.core.agreement.within_noise_floor`). False when the
        rounds agree on a change larger than that; None with one round (no range)."""
        noise = self.ratio_noise() or 0.0
        out: list[bool | None] = [None]
        for i, g in enumerate(self.gains()[1:], 1):
            ratios = self._round_gains(i)
            split = agreement.ratios_split_on_direction(ratios)
            out.append(None if len(ratios) < 2 else (split or agreement.within_noise_floor(g, noise)))
        return out

    def no_effect(self) -> list[bool]:
        """Per configuration: True when its step cannot change anything on this device (it then runs the
        same configuration as the one before it, so its gain is a direct sample of the noise)."""
        steps = {st.name: st for st in STEPS}
        return [
            i > 0 and r.name in steps and not effective_on(steps[r.name], self.device)
            for i, r in enumerate(self.results)
        ]

    def best_step(self) -> str:
        """The name of the step with the largest gain over its predecessor (among steps that can act here)."""
        g = self.gains()
        idle = self.no_effect()
        cands = [i for i in range(1, len(g)) if not idle[i]] or list(range(1, len(g)))
        return self.results[max(cands, key=lambda i: g[i])].name if len(g) > 1 else self.results[0].name

    def best_steps(self) -> list[str]:
        """The best step, and every step whose gain range overlaps the best one's (not told apart by this run)."""
        if len(self.results) < 2:
            return [self.results[0].name]
        best = self.best_step()
        ranges = self.gain_ranges()
        i_best = next(i for i, r in enumerate(self.results) if r.name == best)
        if ranges[i_best] is None:
            return [best]
        lo = ranges[i_best][0]  # type: ignore[index]
        idle = self.no_effect()
        return [
            r.name
            for i, r in enumerate(self.results[1:], 1)
            if r.name == best or (not idle[i] and ranges[i] is not None and ranges[i][1] >= lo)  # type: ignore[index]
        ]

    def verdicts(self) -> list[str]:
        """Per configuration, what its rounds say about its step (one of :data:`VERDICTS`); '' for the baseline.

        - 'gain': faster beyond the noise: every round faster (all but a quarter of them, rounded down), and
          the median gain above 1 by more than :meth:`ratio_noise` (not :meth:`within_noise`);
        - 'slower': slower beyond the noise, by the same rule (kept apart from 'gain': the doctor and the
          reader must not be told to add a step this machine measured slower);
        - 'no effect': within noise, the range includes 1 and every round's ratio lies within the run-to-run
          variation of 1 (``1 - floor`` to ``1 + floor``), in a run quiet enough to rule out a change larger
          than :data:`NO_EFFECT_FLOOR` (floor at most that): the step changed nothing measurable;
        - 'within noise': within noise, with a range wider than that: this run cannot tell;
        - 'one round': no spread measured (quick mode), so no verdict;
        - 'needs CUDA': the step cannot act on this device (it is only measured here when asked for,
          :func:`run_waterfall`'s ``cuda_steps``); its ratio is noise and is not a verdict.
        """
        out = [""]
        floor = self.noise_floor() or 0.0
        rows = zip(self.gains()[1:], self.gain_ranges()[1:], self.within_noise()[1:], self.no_effect()[1:])
        for g, rng, n, idle in rows:
            if idle:
                out.append("needs CUDA")
            elif n is None or rng is None:
                out.append("one round")
            elif not n:
                out.append("gain" if g > 1 else "slower")
            else:
                quiet = floor <= NO_EFFECT_FLOOR and 1 - floor <= rng[0] <= 1.0 <= rng[1] <= 1 + floor
                out.append("no effect" if quiet else "within noise")
        return out

    def step_verdicts(self) -> dict[str, str]:
        """Step name -> verdict, for every step of this waterfall: the measured ones (:meth:`verdicts`) and the
        ones left out here ('needs CUDA'). What :func:`helpers.chapters.ch06.doctor.diagnose` takes as ``measured``."""
        out = {r.name: v for r, v in zip(self.results[1:], self.verdicts()[1:])}
        out.update({name: "needs CUDA" for name in self.not_measured})
        return out

    def table(self) -> str:
        """The waterfall as text, at most 110 characters a line: one row per configuration, then the footnotes.

        Columns: epoch (median time per epoch), speedup (over the baseline), step gain (over the
        configuration before, with its range across rounds, then the verdict), compute busy, data stall,
        efficiency and accuracy. The two-word percentage headers take two header lines."""

        def num(v: float) -> str:  # three significant digits from x10 on: the column keeps its width
            return f"{v:.2f}" if v < 9.995 else f"{v:.1f}"

        gains = [
            "" if r is self.results[0] or idle else (f"x{num(g)}" + (f" ({num(rng[0])}-{num(rng[1])})" if rng else ""))
            for r, g, rng, idle in zip(self.results, self.gains(), self.gain_ranges(), self.no_effect())
        ]  # a step that cannot act here gets no ratio: its bar is noise
        lw = max([len("configuration")] + [len(r.label) for r in self.results]) + 1
        gw = max([len("step gain")] + [len(g) for g in gains]) + 1

        def row(
            label: str, epoch: str, speedup: str, gain: str, verdict: str, busy: str, stall: str, eff: str, acc: str
        ) -> str:
            return (
                f"{label:<{lw}}{epoch:>7}{speedup:>9}{gain:>{gw}} {verdict:<12}{busy:>7}{stall:>6}{eff:>14}{acc:>10}"
            ).rstrip()

        lines = [
            row("", "", "", "", "", "compute", "data", "", ""),
            row("configuration", "epoch", "speedup", "step gain", "", "busy", "stall", "efficiency", "accuracy"),
        ]
        flagged = any(r.efficiency is not None and r.efficiency.verdict for r in self.results)
        for r, s, gain, v in zip(self.results, self.speedups(), gains, self.verdicts()):
            eff = r.efficiency.short() if r.efficiency is not None else "n/a"
            lines.append(
                row(
                    r.label,
                    f"{r.epoch_s:.2f}s",
                    f"{s:.2f}x",
                    gain,
                    v,
                    f"{r.compute_busy:.0%}",
                    f"{r.data_stall:.0%}",
                    eff,
                    f"{r.accuracy:.1%}",
                )
            )
        floor, noise = self.noise_floor(), self.ratio_noise()
        notes = [
            f"epoch: median of {self.rounds} round(s), configurations run in alternating order; step gain: "
            "median over rounds of the ratio to the configuration before (range across rounds); "
            "'gain' / 'slower': every round agrees on the direction (with 4 or more rounds, all but a quarter) "
            "and the change exceeds the scatter of a step gain across rounds (its interquartile range"
            + (f", {noise:.0%} here" if noise is not None else "")
            + "); 'within noise': the range includes 1 or the change is within that scatter; 'no effect': "
            "the range includes 1, every round within the run-to-run variation of the epoch times"
            + (f" ({floor:.0%} here)" if floor is not None else "")
            + f" of x1.00, and that variation {NO_EFFECT_FLOOR:.0%} or less; 'needs CUDA': the step cannot act "
            "on this device: no ratio"
        ]
        notes.append(
            "efficiency: the configuration's throughput over its own slowest stage alone, so a step that speeds "
            "up a stage alone (persistent workers make the loader alone faster) can lower it while the epoch "
            "gets faster: compare epochs for speed, efficiency for how much of the slowest stage is used"
        )
        if flagged:
            notes.append(
                "efficiency: never above 1 (a pipeline cannot beat its slowest stage alone); '(noise)': "
                "measured above 1 within the noise, shown as 1.00, at the bottleneck; 'out of range': measured "
                "further above 1, so the stages-alone figures were taken under other conditions (no value)"
            )
        for note in notes:  # a verdict of two words ('within noise') stays on one line: the reader looks it up
            for v in VERDICTS:
                note = note.replace(f"'{v}'", f"'{v}'".replace(" ", "\0"))
            wrapped = textwrap.wrap(note, 105, break_on_hyphens=False, break_long_words=False)
            lines += [line.replace("\0", " ") for line in wrapped]
        lines += self.cuda_lines()
        return "\n".join(lines)

    def cuda_lines(self) -> list[str]:
        """The steps left out here because they need CUDA (:attr:`not_measured`): one line each saying so, then
        the figures of the same experiment published by others (cited), or that none was found. No ratio."""
        steps = {st.name: st for st in STEPS}
        out: list[str] = []
        dev = torch.device(self.device).type
        for name in self.not_measured:
            st = steps[name]
            ev = cuda_step_evidence(st)
            out.append(f"{st.label:<28}needs CUDA: not measured on {dev} (no ratio); chapter {st.chapter}")
            if ev.cited:
                for fig in ev.cited:
                    text = f"published: {fig.what}: {fig.compared} (GPU: {fig.gpu}; {fig.url})"
                    out += textwrap.wrap(
                        text,
                        105,
                        initial_indent="    ",
                        subsequent_indent="      ",
                        break_on_hyphens=False,
                        break_long_words=False,
                    )
            else:
                none = no_published_sentence(st.published_key) if st.published_key else None
                out += textwrap.wrap(
                    none or "No published figure of this experiment was found.",
                    105,
                    initial_indent="    ",
                    subsequent_indent="      ",
                    break_on_hyphens=False,
                    break_long_words=False,
                )
        return out

    def expectations(self) -> list[str]:
        """One line per step whose gain is expected to be within noise here, and what the measurement said."""
        steps = {st.name: st for st in STEPS}
        out = []
        for r, v, g in zip(self.results[1:], self.verdicts()[1:], self.gains()[1:]):
            st = steps.get(r.name)
            why = expected_within_noise(st, self.regime, self.device, self.calibration) if st else None
            if why:
                if v == "needs CUDA":
                    said = f"run anyway: x{g:.2f} is this run's noise, not the step's effect"
                else:
                    said = f"measured: {v}"
                out.append(f"{r.label}: expected within noise ({why}); {said}")
        return out


def run_waterfall(
    regime: str,
    device: torch.device | str = "cpu",
    *,
    names: Sequence[str] | None = None,
    spec: JobSpec | None = None,
    workers: int | None = None,
    stages: bool = True,
    rounds: int | None = None,
    calibration: Calibration | None = None,
    progress: Callable[[float, str], None] | None = None,
    make_loader: Callable[..., Any] | None = None,
    batches: Callable[..., Any] | None = None,
    train_step: Callable[..., Any] | None = None,
    pipeline: Pipeline | None = None,
    cuda_steps: bool | None = None,
) -> Waterfall:
    """Run the cumulative configurations (all of :data:`STEPS`, or ``names``) of one regime, in rounds.

    Only the steps that can act on ``device`` are measured (``cuda_steps=None``, the default: all of them on
    a CUDA device; elsewhere pinning, uint8 on the device and the prefetcher are left out, listed in
    :attr:`Waterfall.not_measured`, and each configuration switches on the measured steps so far).
    ``cuda_steps=True`` runs them anyway (a test of the plumbing): their rows then get the verdict
    'needs CUDA' and no ratio.

    The functions timed are the reader's: ``make_loader``, ``batches`` and ``train_step`` (all
    three), or ``pipeline=Pipeline(...)``; without them, :func:`reference_pipeline`. Each
    configuration calls them with its step's keyword arguments (:meth:`Settings.calls`).

    Every round runs each configuration once, in alternating order (forwards,
    then backwards), so that two neighbouring configurations are measured back
    to back and drift in the machine's speed cancels out of their ratio
    (chapter 04's method). ``rounds`` defaults to 1 quick, 5 laptop, 2 full: on a
    shared 2-core machine one round in a few is disturbed by other programs, and
    with 4 or more rounds the verdict allows one disturbed round in four
    (:meth:`Waterfall.within_noise`).
    Stages alone are measured in the first round only. With more than one
    round, one untimed run of the first configuration comes first, so that no
    configuration is charged for the one-off costs of the first run.
    """
    spec = spec or job_spec(regime)
    pipe = _pipeline(pipeline, device, spec.seed, make_loader=make_loader, batches=batches, train_step=train_step)
    n_rounds = check_int("rounds", rounds if rounds is not None else sized(quick=1, laptop=5, full=2), 1, 100)
    dev_type = torch.device(device).type
    configs = configurations(workers, names)
    skipped: list[str] = []
    if not (cuda_steps if cuda_steps is not None else dev_type == "cuda"):
        skipped = [st.name for st, _ in configs if not effective_on(st, device)]
        kept = [st.name for st, _ in configs if st.name not in skipped]
        idle = {st.name for st in STEPS if not effective_on(st, device)}
        configs = [  # cumulative over the steps measured here: no pin=True where it cannot pin
            (st, settings_for([n for n in STEP_NAMES[: STEP_NAMES.index(st.name) + 1] if n not in idle], workers))
            for st, _ in configs
            if st.name in kept
        ]
        if not configs:
            raise ValueError(
                f"names: none of {', '.join(skipped)} can act on {dev_type} (they need CUDA); "
                "name a step that can, e.g. 'baseline' or 'workers'"
            )
    runs: list[list[ConfigResult]] = [[] for _ in configs]
    total = n_rounds * len(configs) + (1 if n_rounds > 1 else 0)
    done = 0
    if n_rounds > 1:  # one untimed run first: the first run of a job pays one-off costs (allocations, kernels)
        step, s = configs[0]
        run_config(
            s,
            spec,
            device,
            name=step.name,
            label=step.label,
            stages=False,
            pipeline=pipe,
            progress=scaled(progress, 0.0, 1 / total, f"{regime}, warm-up run: "),
        )
        done = 1
    for rnd in range(n_rounds):
        order = list(range(len(configs)))
        if rnd % 2:
            order.reverse()
        for i in order:
            step, s = configs[i]
            part = scaled(
                progress, done / total, (done + 1) / total, f"{regime}, round {rnd + 1}/{n_rounds}, {step.label}: "
            )
            runs[i].append(
                run_config(
                    s,
                    spec,
                    device,
                    name=step.name,
                    label=step.label,
                    stages=stages and rnd == 0,
                    progress=part,
                    pipeline=pipe,
                )
            )
            done += 1
    out = []
    for rs in runs:
        times = [r.epoch_s for r in rs]
        out.append(dataclasses.replace(rs[0], epoch_s=statistics.median(times), round_epoch_s=times))
    wf = Waterfall(
        regime=regime,
        spec=spec,
        device=str(torch.device(device)),
        results=out,
        rounds=n_rounds,
        calibration=calibration,
        not_measured=skipped,
    )
    noise = max(EFFICIENCY_NOISE, wf.noise_floor() or 0.0)  # this run's own spread, when larger
    for r in out:
        if r.stages:
            r.efficiency = pipeline_efficiency(r.throughput, r.stages, noise)
    if progress is not None:
        progress(1.0, f"{regime}: done")
    return wf


def accuracy_tolerance(n_val: int, p: float = 0.5, seed_spread: float | None = None) -> float:
    """The tolerance for "same accuracy within noise".

    Two binomial standard errors of a validation accuracy, ``2 * sqrt(p (1 - p) / n_val)``
    (at ``p = 0.5``, the widest): the difference a *fresh* validation set of
    ``n_val`` images could show by chance. Where configurations cannot be
    bit-identical (:func:`normalizer_device_exact` False on a GPU), rounding
    differences grow during training like a change of seed, so the tolerance is
    at least the measured seed-to-seed spread (:func:`seed_spread`), if given.
    """
    check_int("n_val", n_val, 1)
    tol = 2.0 * math.sqrt(p * (1 - p) / n_val)
    if seed_spread is not None:
        tol = max(tol, check_float("seed_spread", seed_spread, 0.0, 1.0))
    return tol


def seed_spread(
    spec: JobSpec,
    device: torch.device | str = "cpu",
    seeds: Sequence[int] = (1, 2),
    step: str = "prefetcher",
    *,
    pipeline: Pipeline | None = None,
) -> tuple[list[float], float]:
    """Accuracies of the cumulative configuration ``step`` trained with ``spec.seed`` and each of ``seeds``.

    A new seed changes the initial weights, the data order and the crops: the
    spread of these accuracies (max - min) is what "the same job, trained
    again" varies by on this device. Returns ``(accuracies, spread)``.
    """
    check_choice("step", step, STEP_NAMES)
    settings = dict((st.name, s) for st, s in configurations())[step]
    accs = []
    for sd in [spec.seed, *[check_int("seed", x, 0, 2**31) for x in seeds]]:
        r = run_config(settings, dataclasses.replace(spec, seed=sd), device, name=step, stages=False, pipeline=pipeline)
        accs.append(r.accuracy)
    return accs, max(accs) - min(accs)


def check_accuracies(
    results: Sequence[ConfigResult],
    num_classes: int,
    n_val: int,
    above_chance: bool = True,
    seed_spread: float | None = None,
    chance: float | None = None,
    chance_margin: float = 2.0,
) -> tuple[bool, str]:
    """(ok, message): the accuracies' spread within :func:`accuracy_tolerance`, and (if asked) all clearly
    above chance: at least ``chance_margin`` x the chance level.

    ``seed_spread``: see :func:`accuracy_tolerance`. ``chance``: the chance level measured on the validation
    set (:func:`chance_level`); default ``1 / num_classes``. The default margin, 2, is several seed-to-seed
    spreads under what the chapter's jobs score at quick size (``tests/test_ch06_learns.py``). The message
    also says whether the final training losses are bit-identical (what identical inputs and deterministic
    kernels give).
    """
    tol = accuracy_tolerance(n_val, seed_spread=seed_spread)
    chance = 1.0 / num_classes if chance is None else check_float("chance", chance, 0.0, 1.0)
    check_float("chance_margin", chance_margin, 1.0, 100.0)
    accs = [r.accuracy for r in results]
    spread = max(accs) - min(accs)
    ok = spread <= tol and (min(accs) >= chance_margin * chance or not above_chance)
    same = len({r.train_loss for r in results}) == 1
    why = (
        f"at least the measured seed-to-seed spread {seed_spread:.1%}"
        if seed_spread is not None
        else "two binomial standard errors"
    )
    msg = (
        f"accuracies {', '.join(f'{a:.1%}' for a in accs)}: spread {spread:.1%} (tolerance {tol:.1%}: {why}), "
        f"lowest {min(accs):.1%} vs chance {chance:.1%}"
        + (f" (needs {chance_margin:g}x chance: {chance_margin * chance:.1%})" if above_chance else "")
        + "; training losses "
        + ("bit-identical" if same else "differ by rounding")
    )
    return ok, msg


# ---------------------------------------------------------------------------
# Plots
# ---------------------------------------------------------------------------


def plot_waterfall(wf: Waterfall, ax: Any = None, *, title: str | None = None, source: str | None = None) -> Any:
    """Bars of time per epoch per configuration, annotated with the cumulative speedup.

    Steps left out because they need CUDA (:attr:`Waterfall.not_measured`) get a labelled slot with no bar
    and no ratio; one measured anyway (``cuda_steps=True``) is drawn hatched and grey: its bar differs from
    the previous one only by noise.
    """
    from ...ui.plots import label_source, new_axes  # optional/heavy: matplotlib

    ax = ax if ax is not None else new_axes((8.0, 3.6))
    steps = {s.name: s for s in STEPS}
    vals = [r.epoch_s for r in wf.results]
    colors, hatches = [], []
    for i, r in enumerate(wf.results):
        st = steps.get(r.name)
        idle = st is not None and not effective_on(st, wf.device)
        colors.append("#d3d3d3" if idle else ("#bab0ac" if i == 0 else "#4e79a7"))
        hatches.append("//" if idle else "")
    bars = ax.bar(range(len(vals)), vals, color=colors, edgecolor="#555", linewidth=0.5)
    for b, h in zip(bars, hatches):
        b.set_hatch(h)
    for i, (v, s) in enumerate(zip(vals, wf.speedups())):
        ax.text(i, v, "needs CUDA" if hatches[i] else f"{s:.2f}x", ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("time per epoch (s)")
    ax.set_ylim(0, max(vals) * 1.18)
    ax.grid(axis="y", alpha=0.3)
    dev = torch.device(wf.device).type
    ax.set_title(
        title
        or f"{wf.regime}: width {wf.spec.width}, depth {wf.spec.depth}, {wf.results[0].steps} "
        f"steps/epoch on {dev} (measured now; labels: cumulative speedup)",
        fontsize=9,
    )
    labels = [r.label for r in wf.results]
    for k, name in enumerate(wf.not_measured):  # left out here: a labelled empty slot, no bar, no ratio
        x = len(vals) + k
        ax.text(x, 0, "needs CUDA:\nnot measured\nhere", ha="center", va="bottom", fontsize=7, color="#555")
        labels.append(steps[name].label)
    ax.set_xticks(range(len(labels)))
    ax.set_xticklabels(labels, rotation=25, ha="right", fontsize=8)
    ax.set_xlim(-0.6, len(labels) - 0.4)  # the slots of the steps left out, too
    if any(h for h in hatches):
        ax.bar([0], [0], color="#d3d3d3", hatch="//", edgecolor="#555", label="needs CUDA: no effect here (noise only)")
        ax.legend(fontsize=7, loc="upper right")
    label_source(ax, source)
    return ax


def plot_shares(wf: Waterfall, ax: Any = None) -> Any:
    """Compute-busy and data-stall percentages per configuration (grouped bars), efficiency as a line."""
    from ...ui.plots import new_axes  # optional/heavy: matplotlib

    ax = ax if ax is not None else new_axes((8.0, 3.2))
    n = len(wf.results)
    xs = list(range(n))
    busy_name = "GPU busy" if torch.device(wf.device).type == "cuda" else "compute busy"
    ax.bar([x - 0.2 for x in xs], [r.compute_busy * 100 for r in wf.results], 0.4, color="#59a14f", label=busy_name)
    ax.bar([x + 0.2 for x in xs], [r.data_stall * 100 for r in wf.results], 0.4, color="#4e79a7", label="data stall")
    shown = [(x, r.efficiency.value) for x, r in zip(xs, wf.results) if r.efficiency is not None]
    effs = [(x, v * 100) for x, v in shown if v is not None]  # never above 100%
    if effs:
        ax.plot([x for x, _ in effs], [e for _, e in effs], "o-", color="#e15759", label="pipeline efficiency")
    for x, r in zip(xs, wf.results):  # no point above 100%: the verdict instead
        if r.efficiency is not None and r.efficiency.value is None:
            ax.text(x, 100, "efficiency:\nout of range", ha="center", va="bottom", fontsize=6, color="#e15759")
    ax.set_xticks(xs)
    ax.set_xticklabels([r.label for r in wf.results], rotation=25, ha="right", fontsize=8)
    ax.set_ylabel("% of epoch time (efficiency: %)")
    ax.set_ylim(0, 115.0)
    ax.axhline(90, color="#e15759", linestyle=":", linewidth=1)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=7, ncol=3, loc="upper left")
    ax.set_title(f"{wf.regime}: where the epoch went (measured now)", fontsize=9)
    return ax


def step_rows_from_records(rs: Any, recs: list[Any]) -> list[tuple[str, float]]:
    """Records of one regime, one per configuration (``ch06.waterfall.step_time``, ``ch06.efficiency``, ...), as
    [(configuration label, value), ...] in stacking order (the evidence's ``convert``)."""
    rows = sorted(recs, key=lambda r: r.params.get("order", 0))
    return [(str(r.params.get("label", r.params.get("stage"))), r.value) for r in rows]


def reference_waterfall(regime: str) -> Evidence[list[tuple[str, float]]]:
    """The newest recorded waterfall of ``regime`` (recorded elsewhere, with its provenance), or missing."""
    check_choice("regime", regime, tuple(REGIMES))
    return evidence.recorded(
        f"the {regime} waterfall", "ch06.waterfall.step_time", convert=step_rows_from_records, regime=regime
    )


def plot_reference_waterfall(regime: str, ax: Any = None) -> Any:
    """The newest recorded GPU waterfall of ``regime`` beside the live one, labelled; or a plain 'none recorded'."""
    from ...ui.plots import label_source, new_axes  # optional/heavy: matplotlib

    ax = ax if ax is not None else new_axes((5.0, 3.6))
    ref = reference_waterfall(regime)
    if ref.value is None:
        ax.axis("off")
        text = textwrap.fill(ref.source, 48)
        ax.text(
            0.5,
            0.5,
            f"Reference GPU waterfall ({regime}):\n\n{text}",
            ha="center",
            va="center",
            wrap=True,
            fontsize=8,
            transform=ax.transAxes,
        )
        return ax
    rows = ref.value
    vals = [v * 1e3 for _, v in rows]
    ax.bar(range(len(vals)), vals, color="#f28e2b")
    for i, v in enumerate(vals):
        ax.text(i, v, f"{vals[0] / v:.2f}x", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(vals)))
    ax.set_xticklabels([s for s, _ in rows], rotation=25, ha="right", fontsize=8)
    ax.set_ylabel("time per step (ms)")
    ax.set_title(f"REFERENCE, {regime} (recorded, not this machine)", fontsize=9)
    label_source(ax, ref.source)
    return ax


def reference_efficiency(regime: str) -> Evidence[list[tuple[str, float]]]:
    """The newest recorded pipeline efficiencies of ``regime``, every configuration (recorded elsewhere), or missing."""
    check_choice("regime", regime, tuple(REGIMES))
    return evidence.recorded(
        f"the {regime} pipeline efficiency", "ch06.efficiency", convert=step_rows_from_records, regime=regime
    )


def efficiency_lines(rows: list[tuple[str, float]]) -> list[str]:
    """'    baseline 0.52 · + pinned memory 0.55 · ...', wrapped: recorded ratios shown as :class:`Efficiency`
    (never above 1: '1.00 (noise)' or 'out of range'), one regime."""
    text = " · ".join(f"{label} {Efficiency.of_ratio(eff).short()}" for label, eff in rows)
    return textwrap.wrap(text, 100, initial_indent="    ", subsequent_indent="    ", break_on_hyphens=False)


def reference_timeline(regime: str, stage: str) -> Evidence[dict[str, Any]]:
    """The newest recorded span trace of one configuration (artifact ``ch06.trace.<regime>.<stage>``), or missing.

    The value is the trace's stored form (:meth:`~helpers.core.timing.SpanTrace.to_dict`), which
    :func:`helpers.ui.plots.timeline` draws.
    """
    check_choice("regime", regime, tuple(REGIMES))
    check_choice("stage", stage, STEP_NAMES)
    return evidence.recorded_artifact(f"the {regime} timeline, {stage}", f"ch06.trace.{regime}.{stage}")
