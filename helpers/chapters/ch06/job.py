"""Chapter 06's job: the steps as data (:data:`STEPS`), the job (:class:`JobSpec`), its data and its loader. A
configuration is one call of the reader's ``make_loader`` and ``batches`` with other keyword arguments; every one
has the same seed, weights, data order, crops (seeded per item), ``normalize``, cuDNN settings and threads."""

from __future__ import annotations

import contextlib
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Collection, Iterable, Iterator, Mapping, Sequence

import torch
from torch.utils.data import DataLoader, Dataset, default_collate

from ...core.config import sized
from ...core.rounds import intraop_threads
from ...core.validate import check_choice, check_int
from ...pipeline.data import ShapesDataset, default_sizes, make_shapes_dataset, to_float_normalized
from ...pipeline.loaders import guard
from ...pipeline.workers import plain_failure, released, require_shm, shm_needed_bytes
from . import fast_pipeline as take_home
from .doctor import usable_cores


@dataclass(frozen=True)
class Step:
    """One step of the stack: ``change``, the settings it switches on; ``published_key``, figures standing in for a
    step that ``needs_cuda`` on a machine without."""

    name: str
    label: str
    change: Mapping[str, Any]
    chapter: str
    needs_cuda: bool
    why: str
    published_key: str = ""


#: The steps in stacking order. ``num_workers="auto"`` becomes :func:`default_workers`.
STEPS: tuple[Step, ...] = (
    Step("baseline", "baseline", {}, "01", False,
         "load, decode and augment in the training loop's process; float32 made on the CPU; pageable copies"),
    Step("pinned", "+ pinned memory", {"pin_memory": True}, "02-03", True,
         "page-locked batches and copies that do not make the host wait; on a CPU there is no copy",
         "ch03.pin_ms_per_batch"),
    Step("workers", "+ workers", {"num_workers": "auto"}, "04", False,
         "load in worker processes, in parallel with the training step (DataLoader's prefetch_factor=2)"),
    Step("persistent", "+ persistent, prefetch 4", {"persistent_workers": True, "prefetch_factor": 4}, "04", False,
         "keep the workers alive between epochs (no start-up per epoch) and queue 4 batches per worker"),
    Step("uint8", "+ uint8, device normalise", {"output": "uint8"}, "05", True,
         "uint8 crosses the link (4x fewer bytes), float is made on the device; on a CPU host and device are one",
         "ch02.wire_time"),
    Step("prefetcher", "+ side-stream prefetcher", {"prefetcher": True}, "05", True,
         "copy batch i+1 on a side CUDA stream while batch i trains; on a CPU batches() copies nothing",
         "ch05.prefetch.batch_time"),
)  # fmt: skip
STEP_NAMES: tuple[str, ...] = tuple(s.name for s in STEPS)

#: Steps that need another step first (:func:`settings_for` refuses them alone; the panel ticks accordingly).
STEP_REQUIRES: dict[str, tuple[str, ...]] = {"persistent": ("workers",)}


@dataclass(frozen=True)
class Settings:
    """One configuration: the keyword arguments of its pipeline calls."""

    num_workers: int = 0
    pin_memory: bool = False
    persistent_workers: bool = False
    prefetch_factor: int | None = None
    output: str = "float"
    prefetcher: bool = False

    def loader_kwargs(self) -> dict[str, Any]:  # prefetch_factor and persistent only with workers
        kw: dict[str, Any] = {"workers": self.num_workers, "pin": self.pin_memory}
        if self.num_workers:
            kw.update(prefetch_factor=self.prefetch_factor or 2, persistent=self.persistent_workers)
        return kw

    def batches_kwargs(self) -> dict[str, Any]:
        return {"prefetch": self.prefetcher, "float_on_host": self.output == "float"}

    def calls(self, sep: str = " · ") -> str:
        lk = ", ".join(f"{k}={v!r}" for k, v in self.loader_kwargs().items())
        bk = ", ".join(f"{k}={v!r}" for k, v in self.batches_kwargs().items())
        return f"make_loader(dataset, batch_size, {lk}){sep}batches(loader, {bk})"


def default_workers() -> int:  # the ``workers`` step's: the usable cores, at most 8
    return max(1, min(8, usable_cores()))


def compute_threads() -> int:  # the main process's: usable cores minus the workers step's, >= 1
    return max(1, usable_cores() - default_workers())


def settings_for(enabled: Iterable[str], workers: int | None = None) -> Settings:
    """Settings with the named steps switched on (any subset, any order; checked by the caller)."""
    names = set(enabled)
    nw = default_workers() if workers is None else check_int("workers", workers, 1, 64)
    values: dict[str, Any] = {}
    for step in STEPS:
        if step.name in names:
            values.update({k: nw if v == "auto" else v for k, v in step.change.items()})
    if values.get("persistent_workers") and not values.get("num_workers"):
        raise ValueError("persistent workers need workers: switch on the 'workers' step too")
    if not values.get("num_workers"):
        values.pop("prefetch_factor", None)
    return Settings(**values)


def configurations(
    workers: int | None = None, names: Sequence[str] | None = None, skip: Collection[str] = ()
) -> list[tuple[Step, Settings]]:
    """The cumulative configurations: step k switches on steps 0..k but those in ``skip``; ``names``: a subset."""
    return [
        (step, settings_for([n for n in STEP_NAMES[: i + 1] if n not in skip], workers))
        for i, step in enumerate(STEPS)
        if (names is None or step.name in names) and step.name not in skip
    ]


def step_answers(name: str) -> set[str]:
    label = STEPS[STEP_NAMES.index(name)].label
    return {name, label, label.lstrip("+ ").strip()}


def effective_on(step: Step, device: torch.device | str) -> bool:
    return not step.needs_cuda or torch.device(device).type == "cuda"


#: The two regimes. The data-bound model is tiny so that even a CPU computes a batch faster than one process
#: loads it: 1 channel in its first stage (where most compute is) and 4 stages, whose receptive field spans the
#: shapes (one stage stays at chance). Measured on the loaded 2-core machine (quick size, one thread): a step on
#: 32 images 5.5-11 ms, loading them in one process 9-13 ms; :func:`calibrate` checks the margin on every device.
#: One epoch of 10 steps learns nothing, so each job first trains ``warm_passes`` times on the loader's first
#: pass, loaded once (untimed; ``tests/test_ch06_learns.py``).
REGIMES: dict[str, dict[str, Any]] = {
    "data-bound": {"width": 1, "quick_width": 1, "depth": 4, "lr": 2e-2, "warm_passes": 5},
    "compute-bound": {"width": 96, "quick_width": 12, "depth": 3, "lr": 5e-3, "warm_passes": 3},  # a wide CNN
}


@dataclass(frozen=True)
class JobSpec:
    """The job: ``warm_steps`` batches of pass 0 trained ``warm_passes`` times (untimed), then ``epochs`` timed."""

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
    """Quick and laptop: the small generated set, 320 images per epoch (10 steps: with 15, '+ workers' sat at x1.00
    on a quiet 2-core machine); full: chapter 01's set, 1,280."""
    if sized(quick=False, laptop=True, full=False):
        return {"n_train": 640, "n_val": 256, "image_size": 80, "crop_size": 64, "batch_size": 32, "train_items": 320}
    sizes = dict(default_sizes())
    sizes["train_items"] = min(sizes["n_train"], sized(quick=320, full=1280))
    return sizes


def job_spec(regime: str, **overrides: Any) -> JobSpec:
    """The job for ``regime`` at the tier in force; the warm-up keeps the loader's whole first pass."""
    check_choice("regime", regime, tuple(REGIMES))
    sizes, r = job_sizes(), REGIMES[regime]
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
    limits = {"width": (1, 512), "depth": (1, 6), "threads": (1, 1024), "batch_size": (1, 4096), "epochs": (1, 100),
              "train_items": (spec.batch_size, 10**7), "warm_steps": (0, 1000), "warm_passes": (1, 100)}  # fmt: skip
    for name, (lo, hi) in limits.items():
        check_int(name, getattr(spec, name), lo, hi)
    return spec


@dataclass(frozen=True)
class Pipeline:
    """The reader's functions the capstone times, with the signatures of chapter 06's cells."""

    make_loader: Callable[..., Any]
    batches: Callable[..., Iterable[Any]]
    train_step: Callable[..., Any]
    normalize: Callable[[torch.Tensor], torch.Tensor] | None = None
    source: str = "your pipeline cells"

    def __post_init__(self) -> None:
        for name in ("make_loader", "batches", "train_step", "normalize"):
            fn = getattr(self, name)
            if not callable(fn) and (fn is not None or name != "normalize"):
                raise ValueError(f"{name} must be a function (run the cell that defines it), got {type(fn).__name__}")


def reference_pipeline(device: torch.device | str = "cpu", *, seed: int = 0, workers: int | None = None) -> Pipeline:
    """The take-home pipeline (:mod:`.fast_pipeline`) with its globals set: what runs without the chapter's cells."""
    take_home.DEVICE, take_home.SEED = torch.device(device), seed
    take_home.WORKERS = default_workers() if workers is None else check_int("workers", workers, 0, 64)
    return Pipeline(
        take_home.make_loader, take_home.batches, take_home.train_step, take_home.normalize, "examples/fast_pipeline.py"
    )


def _pipeline(pipeline: Pipeline | None, device: torch.device | str, seed: int = 0) -> Pipeline:
    if pipeline is None:
        return reference_pipeline(device, seed=seed)
    if not isinstance(pipeline, Pipeline):
        raise ValueError(f"pipeline must be a job.Pipeline, got {type(pipeline).__name__}")
    return pipeline


class SeededItems(Dataset):
    """``limit`` items spread evenly over ``base`` (listed class by class), item ``i``'s crop seeded by (seed, i),
    whichever process loads it. Workers import it from this module by name."""

    def __init__(self, base: Dataset, seed: int, limit: int) -> None:
        self.base, self.seed = base, seed
        self.total = len(base)  # type: ignore[arg-type]
        self.n = min(self.total, limit)

    def __len__(self) -> int:
        return self.n

    def base_index(self, index: int) -> int:
        return index * self.total // self.n

    def __getitem__(self, index: int) -> Any:
        index = int(index)
        if not 0 <= index < self.n:
            raise IndexError(f"index {index} out of range for {self.n} items")
        torch.default_generator.manual_seed((self.seed * 1_000_003 + index) % (2**63))
        return self.base[self.base_index(index)]


def seed_order(loader: Any, seed: int, epoch: int, *, fresh: bool) -> None:
    """Seed the shuffling of ``loader``'s next pass. A new iterator draws the workers' base seed first; a persistent
    loader makes one only for its first pass (``fresh``), so later passes make and drop that draw here."""
    gen = getattr(loader, "generator", None)
    gen = gen if isinstance(gen, torch.Generator) else torch.default_generator
    gen.manual_seed((int(seed) * 1_000_003 + int(epoch)) % (2**63))
    if not fresh and getattr(loader, "persistent_workers", False) and getattr(loader, "num_workers", 0) > 0:
        torch.empty((), dtype=torch.int64).random_(generator=gen)


def normalizer_device_exact(
    device: torch.device | str, normalize: Callable[[torch.Tensor], torch.Tensor] | None = None
) -> bool:
    """Whether ``normalize`` gives the same bits on ``device`` as on the CPU for all 256 levels (measured: CUDA may
    divide as a multiplication by the reciprocal)."""
    fn = normalize or to_float_normalized
    dev = torch.device(device)
    levels = torch.arange(256, dtype=torch.uint8).repeat(3, 1).view(1, 3, 16, 16)
    return dev.type == "cpu" or bool(torch.equal(fn(levels.to(dev)).cpu(), fn(levels)))


@contextlib.contextmanager
def same_numerics() -> Iterator[None]:
    """Deterministic cuDNN for the block (not ``use_deterministic_algorithms``: it raises for
    ``adaptive_avg_pool2d_backward_cuda``); TF32 left as is (mixing its two switches raises)."""
    cudnn = torch.backends.cudnn
    before = (cudnn.deterministic, cudnn.benchmark)
    cudnn.deterministic, cudnn.benchmark = True, False
    try:
        yield
    finally:
        cudnn.deterministic, cudnn.benchmark = before


_CACHE: dict[Any, Any] = {}


def dataset_info() -> Any:
    sizes = job_sizes()
    key = ("info", sizes["n_train"], sizes["n_val"], sizes["image_size"])
    if key not in _CACHE:
        _CACHE[key] = make_shapes_dataset(n_train=key[1], n_val=key[2], image_size=key[3])
    return _CACHE[key]


def val_size(spec: JobSpec) -> int:  # validation images the job's accuracy is measured on
    return sum(int(y.shape[0]) for _, y in _val_batches(spec))


def _val_batches(spec: JobSpec) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The validation set, decoded once (uint8, centre crop), as host batches."""
    key, bs = ("val", str(dataset_info().val_dir), spec.crop_size, spec.batch_size), spec.batch_size
    if key not in _CACHE:
        ds = ShapesDataset(dataset_info().val_dir, crop_size=spec.crop_size, augment=False, output="uint8")
        _CACHE[key] = [tuple(default_collate([ds[i] for i in range(s, min(len(ds), s + bs))]))
                       for s in range(0, len(ds), bs)]  # fmt: skip
    return _CACHE[key]


def chance_level(spec: JobSpec) -> float:
    labels = torch.cat([y for _, y in _val_batches(spec)])
    return int(torch.bincount(labels).max()) / int(labels.numel())


def train_items(spec: JobSpec) -> SeededItems:
    base = ShapesDataset(dataset_info().train_dir, crop_size=spec.crop_size, augment=True, output="uint8")
    return SeededItems(base, seed=spec.seed, limit=spec.train_items)


@contextlib.contextmanager
def built_loader(pipeline: Pipeline, spec: JobSpec, s: Settings) -> Iterator[Any]:
    """The pipeline's loader of the job's items, with its threads, numerics and a forked RNG; released on exit (errors
    and interrupts too). A worker failure is re-raised in plain words, the traceback's frames cleared first (a frame
    of ``batches`` would keep its workers alive)."""
    loader = None
    with released([]) as objs:
        try:
            with intraop_threads(spec.threads), same_numerics(), torch.random.fork_rng(devices=[]):
                torch.manual_seed(spec.seed)
                kw = s.loader_kwargs()
                if s.num_workers > 0:
                    batch_bytes = 3 * spec.crop_size * spec.crop_size * spec.batch_size
                    require_shm(shm_needed_bytes(batch_bytes, s.num_workers, kw["prefetch_factor"]))
                loader = pipeline.make_loader(train_items(spec), spec.batch_size, **kw)
                objs.append(loader)
                if isinstance(loader, DataLoader):  # chapter 04's protection: a frozen worker ends in an error
                    guard(loader, check_shm=False)
                yield loader
        except BaseException as exc:
            traceback.clear_frames(exc.__traceback__)
            failure = plain_failure(exc, loader) if isinstance(exc, Exception) else exc
            if failure is exc:
                raise
            raise failure from exc


def _warm_batches(source: Any, steps: int, drain: bool) -> list[Any]:
    """The first ``steps`` batches of a fresh pass; ``drain`` (persistent workers) reads the rest of the pass, so the
    next epoch is not charged for the warm-up's leftovers."""
    it = iter(source)
    batches = [b for _, b in zip(range(steps), it)]
    if drain:
        for _ in it:
            pass
    del it
    return batches
