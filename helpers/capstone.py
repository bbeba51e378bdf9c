"""Chapter 06, the capstone: every step of the workbook stacked on one training job.

The job (chapter 01's) is trained once per *configuration*; each configuration
adds one step to the one before it (:data:`STEPS`, data, not code):

====  ==============================  ====================================  =========
#     step                            what changes                          chapter
====  ==============================  ====================================  =========
0     baseline                        nothing: in-process loading, float     01
1     + pinned memory                 ``pin_memory=True``, non-blocking copy 02, 03
2     + workers                       ``num_workers = N``                    04
3     + persistent, prefetch 4        ``persistent_workers``, ``prefetch``   04
4     + uint8, device normalise       uint8 batches, normalised after copy   05
5     + side-stream prefetcher        :class:`helpers.prefetch.Prefetcher`   05
====  ==============================  ====================================  =========

(GPU JPEG decoding is not in the list: chapter 05's helpers do not provide it.)

Same job, same answer. Every configuration uses the same seed, the same
initial weights, the same data order and the **same augmentation crops**: the
random crop of an item is drawn from a generator seeded by (seed, epoch, item),
not from whichever worker process happens to load it (:class:`SeededItems`,
:class:`EpochSampler`). So configurations see identical data, and their
accuracies may differ only by floating-point rounding (:func:`accuracy_tolerance`).

Measured per configuration (:func:`run_config` -> :class:`ConfigResult`): the
time of one epoch (including worker start-up, which is what persistent workers
remove), throughput, validation accuracy, the span trace of every step, the
*compute-busy* share (GPU busy on a GPU) and the *data-stall* share. And, per
configuration, each stage **alone** (:func:`stage_alone`): the loader alone, the
copy alone (CUDA only; on a CPU there is no copy), the compute alone; the
**pipeline efficiency** is the pipeline's throughput divided by that of its
slowest stage alone.

Two regimes from the model's size (:data:`REGIMES`): a tiny model (width 2,
one stage) is **data-bound** (the loader is the slowest stage, even on a CPU),
a wide one **compute-bound**.

Threads. Every configuration of a waterfall, and every stage measured alone,
runs with the same number of intra-op threads in the main process,
``JobSpec.threads`` = :func:`compute_threads` (the usable cores minus the
workers of the ``workers`` step, at least 1), set by :func:`main_threads` and
restored afterwards. So each step changes one thing only; and the model's
threads do not fight the worker processes for the same cores
(oversubscription; :func:`compare_threads` measures what that costs).

``benchmark(results, device)`` records both regimes under ``ch06.*``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import torch
from torch.utils.data import Dataset, Sampler

from .config import sized
from .timing import SpanRecorder, SpanTrace, synchronize
from .validate import check_choice, check_int

__all__ = [
    "Step",
    "STEPS",
    "STEP_NAMES",
    "Settings",
    "REGIMES",
    "JobSpec",
    "job_spec",
    "default_workers",
    "compute_threads",
    "main_threads",
    "compare_threads",
    "panel_controls",
    "STEP_REQUIRES",
    "settings_for",
    "configurations",
    "SeededItems",
    "EpochSampler",
    "ConfigResult",
    "run_config",
    "dataset_info",
    "val_size",
    "stage_alone",
    "pipeline_efficiency",
    "Waterfall",
    "run_waterfall",
    "accuracy_tolerance",
    "check_accuracies",
    "effective_on",
    "plot_waterfall",
    "plot_shares",
    "reference_waterfall",
    "plot_reference_waterfall",
    "panel_run",
    "panel_summary",
    "panel_plot",
    "benchmark",
]

COMPUTE_PHASES = ("normalize", "forward", "backward", "optimizer")
DATA_PHASES = ("load", "collate")


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
    """

    name: str
    label: str
    change: Mapping[str, Any]
    chapter: str
    needs_cuda: bool
    why: str


#: The steps in stacking order. ``num_workers="auto"`` becomes :func:`default_workers`.
STEPS: tuple[Step, ...] = (
    Step("baseline", "baseline", {}, "01", False,
         "load, decode and augment in the training loop's process; float batches; blocking pageable copies"),
    Step("pinned", "+ pinned memory", {"pin_memory": True}, "02-03", True,
         "page-locked batches (pinned by the loader's thread) and non-blocking copies; on a CPU there is no copy"),
    Step("workers", "+ workers", {"num_workers": "auto"}, "04", False,
         "load in worker processes, in parallel with the training step"),
    Step("persistent", "+ persistent, prefetch 4", {"persistent_workers": True, "prefetch_factor": 4}, "04", False,
         "keep the workers alive between epochs (no start-up per epoch) and queue 4 batches per worker"),
    Step("uint8", "+ uint8, device normalise", {"output": "uint8"}, "05", False,
         "workers send uint8 images (4x fewer bytes to collate, pass and copy); normalise after the copy"),
    Step("prefetcher", "+ side-stream prefetcher", {"prefetcher": True}, "05", True,
         "copy batch i+1 on a side CUDA stream while batch i computes; on a CPU it passes batches through"),
)
STEP_NAMES: tuple[str, ...] = tuple(s.name for s in STEPS)


@dataclass(frozen=True)
class Settings:
    """Loader and transfer settings of one configuration."""

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


def default_workers() -> int:
    """Workers used by the ``workers`` step: the usable cores, at most 8."""
    from .doctor import usable_cores

    return max(1, min(8, usable_cores()))


def compute_threads(workers: int | None = None) -> int:
    """Intra-op threads for the main process: the usable cores minus the workers, at least 1."""
    from .doctor import usable_cores

    nw = default_workers() if workers is None else check_int("workers", workers, 0, 64)
    return max(1, usable_cores() - nw)


def main_threads(n: int) -> contextlib.AbstractContextManager[int]:
    """Run the block with ``torch.set_num_threads(n)`` in this process; the previous count is restored.

    (:func:`helpers.device.intraop_threads`, under the name this chapter uses.)
    """
    from .device import intraop_threads

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


def effective_on(step: Step, device: torch.device | str) -> bool:
    """Whether ``step`` can change anything on ``device`` (pinning and the prefetcher need CUDA)."""
    return not step.needs_cuda or torch.device(device).type == "cuda"


# ---------------------------------------------------------------------------
# The job
# ---------------------------------------------------------------------------

#: The two regimes: the model's size (``quick_width``: the width in quick mode).
#: The data-bound model is tiny so that even a CPU computes a batch faster than one process loads it.
REGIMES: dict[str, dict[str, Any]] = {
    "data-bound": {"width": 2, "quick_width": 2, "depth": 1,
                   "about": "a tiny CNN (2 channels, one stage): the step is cheap, so the loader sets the pace"},
    "compute-bound": {"width": 96, "quick_width": 12, "depth": 3,
                      "about": "a wide CNN (3 stages): the step is expensive, so the loader has time to spare"},
}


@dataclass(frozen=True)
class JobSpec:
    """The training job every configuration runs."""

    regime: str
    width: int
    depth: int = 3
    batch_size: int = 32
    crop_size: int = 64
    train_items: int = 640
    warm_steps: int = 2
    epochs: int = 1
    seed: int = 0
    lr: float = 2e-3
    threads: int = 1

    @property
    def steps_per_epoch(self) -> int:
        return self.train_items // self.batch_size


def job_spec(regime: str, **overrides: Any) -> JobSpec:
    """The default job for ``regime`` in the current mode (quick: tiny; full: the chapter's sizes)."""
    check_choice("regime", regime, tuple(REGIMES))
    from .data import default_sizes

    sizes = default_sizes()
    r = REGIMES[regime]
    base = dict(
        regime=regime,
        width=sized(quick=r["quick_width"], full=r["width"]),
        depth=r["depth"],
        threads=compute_threads(),
        batch_size=sizes["batch_size"],
        crop_size=sizes["crop_size"],
        train_items=sizes["n_train"],
        epochs=1,
    )
    base.update(overrides)
    spec = JobSpec(**base)
    check_int("width", spec.width, 1, 512)
    check_int("depth", spec.depth, 1, 6)
    check_int("threads", spec.threads, 1, 1024)
    check_int("batch_size", spec.batch_size, 1, 4096)
    check_int("train_items", spec.train_items, spec.batch_size, 10_000_000)
    check_int("epochs", spec.epochs, 1, 100)
    check_int("warm_steps", spec.warm_steps, 0, 1000)
    return spec


class EpochSampler(Sampler[int]):
    """Shuffled indices of the first ``limit`` items, encoded as ``epoch * n + index``.

    The order of epoch ``e`` comes from a generator seeded with ``(seed, e)``, so
    it is the same in every configuration; the epoch travels inside the index so
    that workers (persistent or not) know which epoch an item belongs to.
    """

    def __init__(self, n: int, limit: int, seed: int = 0) -> None:
        self.n = check_int("n", n, 1)
        self.limit = min(check_int("limit", limit, 1), n)
        self.seed = seed
        self.epoch = 0

    def __iter__(self) -> Iterator[int]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        perm = torch.randperm(self.n, generator=g)[: self.limit].tolist()
        base = self.epoch * self.n
        self.epoch += 1
        return iter([base + i for i in perm])

    def __len__(self) -> int:
        return self.limit


class SeededItems(Dataset):
    """Wrap a data set so item ``epoch * n + i`` is item ``i`` augmented with a generator seeded by (seed, epoch, i).

    The random crop then does not depend on which process (main or worker) loads
    the item, so every configuration trains on identical batches. Picklable.
    """

    def __init__(self, base: Dataset, seed: int = 0) -> None:
        self.base = base
        self.n = len(base)  # type: ignore[arg-type]
        self.seed = seed

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> Any:
        torch.default_generator.manual_seed((self.seed * 1_000_003 + int(index)) % (2**63))
        return self.base[int(index) % self.n]


def _identity_transfer(batch: Any, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Batches from the prefetcher are already on the device (and normalised)."""
    return batch[0], batch[1]


_CACHE: dict[Any, Any] = {}


def _dataset_info() -> Any:
    from .data import make_shapes_dataset

    if "info" not in _CACHE:
        _CACHE["info"] = make_shapes_dataset()
    return _CACHE["info"]


def dataset_info() -> Any:
    """The generated data set the job trains on (:func:`helpers.data.make_shapes_dataset`, cached)."""
    return _dataset_info()


def val_size(spec: JobSpec) -> int:
    """Number of validation images the job's accuracy is measured on."""
    return sum(int(y.shape[0]) for _, y in _val_batches(spec))


def _val_batches(spec: JobSpec) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The validation set, decoded once (float, centre crop), as a list of batches."""
    from .data import ShapesDataset

    key = ("val", spec.crop_size, spec.batch_size)
    if key not in _CACHE:
        ds = ShapesDataset(_dataset_info().val_dir, crop_size=spec.crop_size, augment=False, output="float")
        batches = []
        for s in range(0, len(ds), spec.batch_size):
            items = [ds[i] for i in range(s, min(len(ds), s + spec.batch_size))]
            batches.append((torch.stack([x for x, _ in items]), torch.tensor([y for _, y in items])))
        _CACHE[key] = batches
    return _CACHE[key]


def _train_items(spec: JobSpec, output: str) -> SeededItems:
    from .data import ShapesDataset

    base = ShapesDataset(_dataset_info().train_dir, crop_size=spec.crop_size, augment=True, output=output)
    return SeededItems(base, seed=spec.seed)


def _build_loader(spec: JobSpec, s: Settings, device: torch.device) -> Any:
    from .data import make_loader

    ds = _train_items(spec, s.output)
    sampler = EpochSampler(len(ds), spec.train_items, seed=spec.seed)
    kw: dict[str, Any] = {}
    if s.num_workers > 0:
        kw["persistent_workers"] = s.persistent_workers
        kw["prefetch_factor"] = s.prefetch_factor or 2
    return make_loader(ds, spec.batch_size, shuffle=False, sampler=sampler, num_workers=s.num_workers,
                       seed=spec.seed, pin_memory=s.pin_memory and device.type == "cuda", drop_last=True, **kw)


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


def _release(loader: Any) -> None:
    try:
        from .loaders import release
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
        trace: spans of every timed step (load, collate, h2d, normalize, forward, backward, optimizer).
        compute_busy: share of the epoch the compute phases were running (GPU busy, on a GPU).
        data_stall: share of the epoch the loop waited for data (start-up included).
        stages: items/s of each stage alone ("loader", "copy", "compute"; ``None``: no such stage here).
        efficiency: throughput / slowest stage alone (``None`` if not measured).
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
    efficiency: float | None = None

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


def run_config(
    settings: Settings,
    spec: JobSpec,
    device: torch.device | str = "cpu",
    *,
    name: str = "custom",
    label: str | None = None,
    stages: bool = True,
    progress: Callable[[float, str], None] | None = None,
) -> ConfigResult:
    """Train the job once with ``settings`` and measure it (see the module docstring).

    The model is built from ``spec.seed``; ``spec.warm_steps`` untimed steps
    (lazy initialisation, first worker start-up; with persistent workers the
    rest of that pass is drained, see :func:`_warm_batches`) come first, then ``spec.epochs``
    timed epochs, then evaluation on the validation set. Workers are released
    on return, also on errors and interrupts. The main process uses
    ``spec.threads`` intra-op threads meanwhile (:func:`main_threads`). The
    reader's global RNG state and thread count are restored afterwards.
    """
    from .models import build_model
    from .prefetch import Prefetcher
    from .train import evaluate, make_optimizer, train_epoch

    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device is 'cuda' but no CUDA device is available; use device='cpu'")
    report = progress or (lambda f, t="": None)
    from .data import MEAN, STD

    info = _dataset_info()
    model = build_model(width=spec.width, depth=spec.depth, num_classes=len(info.classes), seed=spec.seed).to(dev)
    opt = make_optimizer(model, lr=spec.lr)
    loader = _build_loader(spec, settings, dev)
    source: Any = Prefetcher(loader, dev, normalize=(MEAN, STD)) if settings.prefetcher else loader
    if settings.prefetcher:
        transfer: Any = _identity_transfer
    else:
        transfer = "non_blocking" if settings.pin_memory and dev.type == "cuda" else "blocking"
    epochs: list[tuple[float, float]] = []
    try:
        with main_threads(spec.threads), torch.random.fork_rng(devices=[]):
            torch.manual_seed(spec.seed)
            report(0.05, f"{name}: warm-up")
            if spec.warm_steps:
                warm = _warm_batches(source, spec.warm_steps, drain=settings.persistent_workers)
                train_epoch(model, warm, dev, opt, transfer=transfer)
                del warm
            rec = SpanRecorder(dev, config=name, regime=spec.regime, settings=settings.describe())
            total_s, steps, samples, loss = 0.0, 0, 0, 0.0
            for e in range(spec.epochs):
                report(0.1 + 0.7 * e / spec.epochs, f"{name}: epoch {e + 1}/{spec.epochs}")
                t_begin = rec.now()
                st = train_epoch(model, source, dev, opt, recorder=rec, transfer=transfer, start_step=steps)
                epochs.append((t_begin, rec.now()))
                total_s += st.seconds
                steps += st.steps
                samples += st.samples
                loss += st.loss * st.samples
            trace = rec.finish()
            report(0.85, f"{name}: evaluating")
            acc = evaluate(model, _val_batches(spec), dev)
    finally:
        _release(loader)
    if steps == 0:
        raise ValueError(f"train_items={spec.train_items} gives no full batch of {spec.batch_size}; raise train_items")
    busy, stall = _shares(trace, epochs, total_s)
    trace.metadata.update({"epoch_s": total_s / spec.epochs, "compute_busy": busy, "data_stall": stall})
    result = ConfigResult(
        name=name, label=label or name, settings=settings, regime=spec.regime, spec=spec, device=str(dev),
        epoch_s=total_s / spec.epochs, steps=steps // spec.epochs, samples=samples // spec.epochs,
        accuracy=acc, train_loss=loss / max(1, samples), trace=trace, compute_busy=busy, data_stall=stall,
    )
    if stages:
        report(0.9, f"{name}: stages alone")
        result.stages = stage_alone(settings, spec, dev)
        result.efficiency = pipeline_efficiency(result.throughput, result.stages)
    report(1.0, f"{name}: done")
    return result


# ---------------------------------------------------------------------------
# Stages alone and pipeline efficiency
# ---------------------------------------------------------------------------


def _loader_alone(spec: JobSpec, s: Settings, dev: torch.device) -> float:
    """Items/s of the DataLoader alone, measured like the job's epoch.

    Same loader, same sampler, same warm-up batches, then one whole epoch
    (worker start-up included, as in the job's epoch), with the job's threads
    in the main process. It does not depend on the model, so it is measured
    once for both regimes.
    """
    key = ("loader", spec.train_items, spec.batch_size, spec.crop_size, s.num_workers, s.persistent_workers,
           s.prefetch_factor, s.output, s.pin_memory and dev.type == "cuda", spec.threads, spec.warm_steps)
    if key in _CACHE:
        return _CACHE[key]
    loader = _build_loader(spec, s, dev)
    try:
        with main_threads(spec.threads), torch.random.fork_rng(devices=[]):
            _warm_batches(loader, spec.warm_steps, drain=s.persistent_workers)
            t0 = time.perf_counter()
            n = 0
            for x, _y in loader:
                n += int(x.shape[0])
            seconds = time.perf_counter() - t0
    finally:
        _release(loader)
    _CACHE[key] = n / seconds if seconds > 0 else float("nan")
    return _CACHE[key]


def _sample_batch(spec: JobSpec, output: str) -> tuple[torch.Tensor, torch.Tensor]:
    key = ("sample", spec.batch_size, spec.crop_size, output, spec.seed)
    if key not in _CACHE:
        from torch.utils.data import default_collate

        ds = _train_items(spec, output)
        with torch.random.fork_rng(devices=[]):
            _CACHE[key] = default_collate([ds[i] for i in range(spec.batch_size)])
    return _CACHE[key]


def _copy_alone(spec: JobSpec, s: Settings, dev: torch.device, repeats: int = 10) -> float | None:
    """Items/s of host-to-device copies of one batch (``None`` without CUDA: there is no copy)."""
    if dev.type != "cuda":
        return None
    x, y = _sample_batch(spec, s.output)
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


def _compute_alone(spec: JobSpec, s: Settings, dev: torch.device) -> float:
    """Items/s of training steps on one batch already on the device (normalise included for uint8).

    Same model, batch size and threads as the job; two warm-up steps, then as
    many timed steps as an epoch has (4 to 20), each synchronised. Throughput
    is the batch size over the **lower-quartile** step: the stage's own pace
    when nothing else disturbs it, not counting steps slowed by other programs
    (such hiccups slow the pipeline's epoch too, so they count against its
    efficiency, never for it).
    """
    key = ("compute", spec.width, spec.depth, spec.batch_size, spec.crop_size, s.output, str(dev), spec.threads,
           spec.train_items)
    if key in _CACHE:
        return _CACHE[key]
    from .data import to_float_normalized
    from .models import build_model
    from .train import make_optimizer

    x, y = _sample_batch(spec, s.output)
    x, y = x.to(dev), y.to(dev)
    model = build_model(width=spec.width, depth=spec.depth, num_classes=int(_dataset_info().params["num_classes"]),
                        seed=spec.seed).to(dev)
    opt = make_optimizer(model, lr=spec.lr)
    n = max(4, min(spec.steps_per_epoch, 20))

    def step() -> None:
        xx = to_float_normalized(x) if x.dtype == torch.uint8 else x
        loss = torch.nn.functional.cross_entropy(model(xx), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    times = []
    with main_threads(spec.threads):
        for _ in range(2):
            step()
        synchronize(dev)
        for _ in range(n):
            t0 = time.perf_counter()
            step()
            synchronize(dev)
            times.append(time.perf_counter() - t0)
    _CACHE[key] = spec.batch_size / statistics.quantiles(times, n=4, method="inclusive")[0]
    return _CACHE[key]


def stage_alone(settings: Settings, spec: JobSpec, device: torch.device | str = "cpu") -> dict[str, float | None]:
    """Throughput (items/s) of each stage run alone: ``loader``, ``copy`` (CUDA only) and ``compute``.

    Each stage runs as it does in the job: same batch size, same warm-up, same
    threads (``spec.threads``). Results are cached per stage settings: stages
    that a configuration does not change (the loader in both regimes, the
    compute across loader settings) are measured once.
    """
    dev = torch.device(device)
    return {
        "loader": _loader_alone(spec, settings, dev),
        "copy": _copy_alone(spec, settings, dev),
        "compute": _compute_alone(spec, settings, dev),
    }


def pipeline_efficiency(throughput: float, stages: Mapping[str, float | None]) -> float | None:
    """Pipeline throughput divided by the throughput of its slowest stage alone.

    1.0 means the stages overlap perfectly: the pipeline runs as fast as its
    bottleneck allows; it cannot honestly exceed 1, so a value above 1 is
    measurement noise between separate runs (the table marks it). Stages given
    as ``None`` (absent, e.g. the copy on a CPU) are ignored; ``None`` if no
    stage is known.

    >>> pipeline_efficiency(900.0, {"loader": 1000.0, "copy": None, "compute": 3000.0})
    0.9
    """
    known = [float(v) for v in stages.values() if v is not None and v > 0 and math.isfinite(v)]
    if not known or not (throughput > 0):
        return None
    return float(throughput) / min(known)


def compare_threads(
    spec: JobSpec,
    step: str = "persistent",
    device: torch.device | str = "cpu",
    threads: Sequence[int] | None = None,
) -> list[ConfigResult]:
    """Run the cumulative configuration ``step`` of ``spec`` once per main-process thread count, back to back.

    ``threads`` defaults to ``(spec.threads, all usable cores)``: what the
    capstone uses while workers run, and PyTorch's default. Stages alone are
    not measured. Each result's ``trace.metadata["threads"]`` says which count it had.
    """
    from .doctor import usable_cores

    check_choice("step", step, STEP_NAMES)
    counts = list(threads) if threads is not None else sorted({spec.threads, usable_cores()})
    settings = dict((st.name, s) for st, s in configurations())[step]
    label = next(st.label for st in STEPS if st.name == step)
    out = []
    for n in counts:
        r = run_config(settings, dataclasses.replace(spec, threads=check_int("threads", n, 1, 1024)), device,
                       name=step, label=f"{label}, {n} thread{'s' if n > 1 else ''}", stages=False)
        r.trace.metadata["threads"] = n
        out.append(r)
    return out


# ---------------------------------------------------------------------------
# The waterfall: every configuration in one regime
# ---------------------------------------------------------------------------


@dataclass
class Waterfall:
    """All configurations of one regime, in stacking order."""

    regime: str
    spec: JobSpec
    device: str
    results: list[ConfigResult]

    @property
    def baseline(self) -> ConfigResult:
        return self.results[0]

    def speedups(self) -> list[float]:
        """Cumulative speedup of each configuration over the first (epoch-time ratio)."""
        b = self.baseline.epoch_s
        return [b / r.epoch_s for r in self.results]

    def gains(self) -> list[float]:
        """Speedup of each configuration over the one before it (1.0 for the first)."""
        return [1.0] + [a.epoch_s / b.epoch_s for a, b in zip(self.results, self.results[1:])]

    def best_step(self) -> str:
        """The name of the step with the largest gain over its predecessor."""
        g = self.gains()
        return self.results[max(range(1, len(g)), key=lambda i: g[i])].name if len(g) > 1 else self.results[0].name

    def table(self) -> str:
        lines = [f"{'configuration':<28}{'epoch':>9}{'speedup':>9}{'compute busy':>14}{'data stall':>12}"
                 f"{'efficiency':>12}{'accuracy':>10}"]
        noisy = False
        for r, s in zip(self.results, self.speedups()):
            eff = f"{r.efficiency:.2f}" if r.efficiency is not None else "n/a"
            if r.efficiency is not None and r.efficiency > 1.0:
                eff, noisy = eff + "*", True
            lines.append(f"{r.label:<28}{r.epoch_s:>8.2f}s{s:>8.2f}x{r.compute_busy:>13.0%}{r.data_stall:>12.0%}"
                         f"{eff:>12}{r.accuracy:>10.1%}")
        if noisy:
            lines.append("* above 1: the pipeline cannot beat its slowest stage alone; this is noise between "
                         "separate measurements")
        return "\n".join(lines)


def run_waterfall(
    regime: str,
    device: torch.device | str = "cpu",
    *,
    names: Sequence[str] | None = None,
    spec: JobSpec | None = None,
    workers: int | None = None,
    stages: bool = True,
    progress: Callable[[float, str], None] | None = None,
) -> Waterfall:
    """Run the cumulative configurations (all of :data:`STEPS`, or ``names``) of one regime."""
    spec = spec or job_spec(regime)
    configs = configurations(workers, names)
    out = []
    for i, (step, s) in enumerate(configs):
        if progress is not None:
            progress(i / len(configs), f"{regime}: {step.label}")
        out.append(run_config(s, spec, device, name=step.name, label=step.label, stages=stages))
    return Waterfall(regime=regime, spec=spec, device=str(torch.device(device)), results=out)


def accuracy_tolerance(n_val: int, p: float = 0.5) -> float:
    """The tolerance for "same accuracy within noise": two binomial standard errors of a val accuracy.

    Configurations see identical data, weights and order, so only rounding
    differs; we still allow the difference a *fresh* validation set of
    ``n_val`` images could show by chance, ``2 * sqrt(p (1 - p) / n_val)``
    (at ``p = 0.5``, the widest): anything larger is a real change of the job.
    """
    check_int("n_val", n_val, 1)
    return 2.0 * math.sqrt(p * (1 - p) / n_val)


def check_accuracies(results: Sequence[ConfigResult], num_classes: int, n_val: int,
                     above_chance: bool = True) -> tuple[bool, str]:
    """(ok, message): the accuracies' spread within :func:`accuracy_tolerance`, and (if asked) all above chance.

    Quick mode trains a handful of steps, too few to learn the task: there the
    notebook checks only that the configurations agree.
    """
    tol = accuracy_tolerance(n_val)
    chance = 1.0 / num_classes
    accs = [r.accuracy for r in results]
    spread = max(accs) - min(accs)
    ok = spread <= tol and (min(accs) > chance or not above_chance)
    msg = (f"accuracies {', '.join(f'{a:.1%}' for a in accs)}: spread {spread:.1%} (tolerance {tol:.1%}), "
           f"lowest {min(accs):.1%} vs chance {chance:.1%}")
    return ok, msg


# ---------------------------------------------------------------------------
# Plots
# ---------------------------------------------------------------------------


def plot_waterfall(wf: Waterfall, ax: Any = None, *, title: str | None = None, source: str | None = None) -> Any:
    """Bars of time per epoch per configuration, annotated with the cumulative speedup.

    Steps that cannot have an effect on this device (pinning and the prefetcher
    on a CPU) are drawn hatched and grey: their bar differs from the previous
    one only by noise.
    """
    from .plots import label_source, new_axes

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
        ax.text(i, v, f"{s:.2f}x", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(vals)))
    ax.set_xticklabels([r.label for r in wf.results], rotation=25, ha="right", fontsize=8)
    ax.set_ylabel("time per epoch (s)")
    ax.set_ylim(0, max(vals) * 1.18)
    ax.grid(axis="y", alpha=0.3)
    dev = torch.device(wf.device).type
    ax.set_title(title or f"{wf.regime}: width {wf.spec.width}, depth {wf.spec.depth}, {wf.results[0].steps} "
                          f"steps/epoch on {dev} (measured now; labels: cumulative speedup)", fontsize=9)
    if any(h for h in hatches):
        ax.bar([0], [0], color="#d3d3d3", hatch="//", edgecolor="#555", label="needs CUDA: no effect here (noise only)")
        ax.legend(fontsize=7, loc="upper right")
    label_source(ax, source)
    return ax


def plot_shares(wf: Waterfall, ax: Any = None) -> Any:
    """Compute-busy and data-stall percentages per configuration (grouped bars), efficiency as a line."""
    from .plots import new_axes

    ax = ax if ax is not None else new_axes((8.0, 3.2))
    n = len(wf.results)
    xs = list(range(n))
    busy_name = "GPU busy" if torch.device(wf.device).type == "cuda" else "compute busy"
    ax.bar([x - 0.2 for x in xs], [r.compute_busy * 100 for r in wf.results], 0.4, color="#59a14f", label=busy_name)
    ax.bar([x + 0.2 for x in xs], [r.data_stall * 100 for r in wf.results], 0.4, color="#4e79a7", label="data stall")
    effs = [(x, r.efficiency * 100) for x, r in zip(xs, wf.results) if r.efficiency is not None]
    if effs:
        ax.plot([x for x, _ in effs], [e for _, e in effs], "o-", color="#e15759", label="pipeline efficiency")
    ax.set_xticks(xs)
    ax.set_xticklabels([r.label for r in wf.results], rotation=25, ha="right", fontsize=8)
    ax.set_ylabel("% of epoch time (efficiency: %)")
    ax.set_ylim(0, max([115.0] + [e + 10 for _, e in effs]))
    ax.axhline(90, color="#e15759", linestyle=":", linewidth=1)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=7, ncol=3, loc="upper left")
    ax.set_title(f"{wf.regime}: where the epoch went (measured now)", fontsize=9)
    return ax


def reference_waterfall(regime: str) -> list[tuple[Any, list[tuple[str, float]]]]:
    """Recorded GPU waterfalls for ``regime``: [(ResultSet, [(stage label, seconds per step), ...])]."""
    from .reference import find

    out = []
    for rs, recs in find("ch06.waterfall.step_time", regime=regime):
        rows = sorted(recs, key=lambda r: r.params.get("order", 0))
        out.append((rs, [(str(r.params.get("label", r.params.get("stage"))), r.value) for r in rows]))
    return out


def plot_reference_waterfall(regime: str, ax: Any = None) -> Any:
    """The newest recorded GPU waterfall of ``regime`` beside the live one, labelled; or a plain 'none recorded'."""
    from .plots import label_source, new_axes
    from .reference import missing_message, provenance_line

    ax = ax if ax is not None else new_axes((5.0, 3.6))
    hits = reference_waterfall(regime)
    if not hits:
        ax.axis("off")
        import textwrap

        text = textwrap.fill(missing_message(f"the {regime} waterfall"), 48)
        ax.text(0.5, 0.5, f"Reference GPU waterfall ({regime}):\n\n{text}",
                ha="center", va="center", wrap=True, fontsize=8, transform=ax.transAxes)
        return ax
    rs, rows = hits[0]
    vals = [v * 1e3 for _, v in rows]
    ax.bar(range(len(vals)), vals, color="#f28e2b")
    for i, v in enumerate(vals):
        ax.text(i, v, f"{vals[0] / v:.2f}x", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(vals)))
    ax.set_xticklabels([s for s, _ in rows], rotation=25, ha="right", fontsize=8)
    ax.set_ylabel("time per step (ms)")
    ax.set_title(f"REFERENCE, {regime} (recorded, not this machine)", fontsize=9)
    label_source(ax, provenance_line(rs))
    return ax


# ---------------------------------------------------------------------------
# Live panel
# ---------------------------------------------------------------------------


#: Steps that need another step switched on first (persistent workers need workers).
STEP_REQUIRES: dict[str, tuple[str, ...]] = {"persistent": ("workers",)}


def panel_controls() -> dict[str, Any]:
    """The live panel's controls: a regime toggle and one checkbox per step after the baseline.

    The checkboxes stay consistent: ticking a step ticks the steps it needs
    (:data:`STEP_REQUIRES`), and unticking a step unticks the steps that need
    it, so the panel can never hold settings that :func:`settings_for` refuses.
    """
    from .widgets import W

    controls: dict[str, Any] = {
        "regime": W.ToggleButtons(options=list(REGIMES), value="data-bound", description="regime"),
    }
    for step in STEPS[1:]:
        controls[step.name] = W.Checkbox(value=False, description=step.label, indent=False)

    def on_change(name: str) -> Callable[[dict[str, Any]], None]:
        def handler(change: dict[str, Any]) -> None:
            if change.get("new"):
                for need in STEP_REQUIRES.get(name, ()):
                    controls[need].value = True
            else:
                for other, needs in STEP_REQUIRES.items():
                    if name in needs:
                        controls[other].value = False
        return handler

    for step in STEPS[1:]:
        controls[step.name].observe(on_change(step.name), names="value")
    return controls


def panel_run(progress: Callable[[float, str], None] | None = None, *, regime: str = "data-bound",
              device: torch.device | str = "cpu", **toggles: bool) -> ConfigResult:
    """Run the job with the steps whose toggles are True (keyword per step name), in ``regime``.

    ``baseline`` is always part of the job; unknown toggles raise ValueError.
    """
    for k in toggles:
        check_choice("step", k, STEP_NAMES)
    enabled = [k for k, v in toggles.items() if v and k != "baseline"]
    s = settings_for(enabled)
    name = "+".join(enabled) if enabled else "baseline"
    return run_config(s, job_spec(regime), device, name=name, label=name, stages=True, progress=progress)


def panel_summary(r: ConfigResult) -> str:
    eff = f"{r.efficiency:.2f}" if r.efficiency is not None else "n/a"
    return (f"{r.regime}, {r.label}: {r.epoch_s:.2f} s/epoch, {r.throughput:.0f} img/s, compute busy "
            f"{r.compute_busy:.0%}, data stall {r.data_stall:.0%}, efficiency {eff}, accuracy {r.accuracy:.1%}")


def panel_plot(history: Sequence[Any], ax: Any) -> None:
    """Epoch time of every panel run so far (bars), for comparing toggles."""
    from .plots import history_bars

    labels = [f"#{h.index} {h.result.regime[:4]} {h.result.label}"[:40] for h in history]
    history_bars(labels, [h.result.epoch_s for h in history], ax, ylabel="time per epoch (s)",
                 title="Panel runs (measured now)")


# ---------------------------------------------------------------------------
# Benchmark records
# ---------------------------------------------------------------------------


def benchmark(results: Any, device: torch.device | str | None = None) -> Any:
    """Run both regimes, every configuration, and add the records to ``results``.

    Records (key: unit; params ``regime``, ``stage`` (step name), ``label``, ``order``, ``width``,
    ``steps``, ``batch_size``, ``device``):

    - ``ch06.waterfall.step_time``: s per step (epoch time / steps) — the waterfall bars;
    - ``ch06.epoch_time``: s; ``ch06.throughput``: items/s; ``ch06.speedup``: ratio (vs baseline);
    - ``ch06.accuracy``: ratio (validation); ``ch06.compute_busy``, ``ch06.data_stall``: ratio (0-1);
    - ``ch06.efficiency``: ratio (throughput / slowest stage alone);
    - ``ch06.stage_alone``: items/s, with ``part`` = loader / copy / compute (copy only with CUDA).

    Artifacts: ``ch06.trace.<regime>.<stage>``: each configuration's span trace
    (:meth:`SpanTrace.to_dict`), for reference timelines. Returns ``results``.
    """
    from .device import pick_device

    dev = torch.device(device) if device is not None else pick_device()
    for regime in REGIMES:
        wf = run_waterfall(regime, dev)
        for i, (r, sp) in enumerate(zip(wf.results, wf.speedups())):
            p = dict(regime=regime, stage=r.name, label=r.label, order=i, width=wf.spec.width, steps=r.steps,
                     batch_size=wf.spec.batch_size, device=str(dev))
            results.add("ch06.waterfall.step_time", r.step_s, "s", **p)
            results.add("ch06.epoch_time", r.epoch_s, "s", **p)
            results.add("ch06.throughput", r.throughput, "items/s", **p)
            results.add("ch06.speedup", sp, "ratio", **p)
            results.add("ch06.accuracy", r.accuracy, "ratio", **p)
            results.add("ch06.compute_busy", r.compute_busy, "ratio", **p)
            results.add("ch06.data_stall", r.data_stall, "ratio", **p)
            if r.efficiency is not None:
                results.add("ch06.efficiency", r.efficiency, "ratio", **p)
            for part, v in r.stages.items():
                if v is not None:
                    results.add("ch06.stage_alone", v, "items/s", part=part, **p)
            results.artifacts[f"ch06.trace.{regime}.{r.name}"] = r.trace.to_dict()
    return results
