"""Chapter 06: the regimes calibrated on this device. "Wide" depends on the device (a model wide on a laptop may be
fast on a large GPU), so :func:`calibrate` times the loader alone and the model alone here and picks a model whose
step takes 2-3.5x the loader's batch (:func:`choose_model`)."""

from __future__ import annotations

import dataclasses
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from ...core.config import sized
from ...core.progress import no_progress
from ...pipeline.models import SmallCNN, flops_per_sample, output_numels
from .job import _CACHE, REGIMES, Pipeline, Settings, _pipeline, dataset_info, job_spec
from .run import _loader_alone, _step_times

#: Models the compute-bound search may pick, as (width, depth): the last stage has at most 8,192 channels.
MODEL_LADDER: tuple[tuple[int, int], ...] = tuple(
    (w, d)
    for d in (3, 4, 5)
    for w in (8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)
    if w * 2 ** (d - 1) <= 8192
)
#: The compute-bound step takes MARGIN to UPPER times the loader's batch; the data-bound one MARGIN x less.
MARGIN, UPPER = 2.0, 3.5


def _on_meta(width: int, depth: int, num_classes: int = 6) -> SmallCNN:
    """The model on the meta device: its shapes without memory, so the ladder's 8,192-channel end costs nothing."""
    with torch.device("meta"):
        return SmallCNN(num_classes, width, depth)


def probe_bytes(width: int, depth: int, batch_size: int, crop_size: int, num_classes: int = 6) -> int:
    """Device memory one training step of :class:`~helpers.pipeline.models.SmallCNN` needs, from its shapes: per
    output element the conv's and BatchNorm's outputs and gradients, the max-pool's (a quarter as many, with their
    indices); 16 bytes per parameter (with Adam's moments); the uint8 and float batch; then 25% for the allocator's
    rounding and cuDNN's workspace."""
    model = _on_meta(width, depth, num_classes)
    convs = [batch_size * n for m, n in output_numels(model, crop_size) if isinstance(m, nn.Conv2d)]
    total = sum(e * 16 + (e // 4) * 16 for e in convs) + 16 * sum(p.numel() for p in model.parameters())
    return int((total + batch_size * 3 * crop_size * crop_size * 5) * 1.25)


def device_memory_check(device: torch.device | str, need_bytes: int) -> str | None:
    """``None`` when ``need_bytes`` fits in 80% of the device's free memory (after ``empty_cache()``), else why not."""
    share = 0.8
    dev = torch.device(device)
    if dev.type != "cuda":
        return None
    torch.cuda.empty_cache()  # first: cached blocks of earlier probes are free memory for this one
    free, total = torch.cuda.mem_get_info(dev)
    if need_bytes <= share * free:
        return None
    held, gib = torch.cuda.memory_allocated(dev), 2.0**30
    return (
        f"it would need about {need_bytes / gib:.1f} GiB of device memory, more than {share:.0%} of the "
        f"{free / gib:.1f} GiB free of {total / gib:.1f} GiB after empty_cache() (this process's tensors hold "
        f"{held / gib:.1f} GiB; other processes and the CUDA context hold the rest)"
    )


def release_pinned_host_memory(device: torch.device | str) -> str:
    """One line: the pinned host memory PyTorch's caching host allocator holds, and what
    :func:`~helpers.pipeline.transfer.empty_host_cache` gave back."""
    from ...pipeline import transfer  # optional: only after a waterfall

    if torch.device(device).type != "cuda":
        return "pinned host memory: none (no CUDA device: nothing was pinned, so the host allocator holds nothing)"
    before = transfer.host_allocator_stats()
    if not isinstance(before, dict):
        return f"pinned host memory: not measured ({before})"
    mib = 2.0**20
    line = (
        f"pinned host memory cached by PyTorch's host allocator: {before['allocated_bytes'] / mib:.0f} MiB "
        f"({before['active_bytes'] / mib:.0f} MiB of it in use)"
    )
    used = transfer.empty_host_cache()
    if used is None:
        return line + f"; torch {torch.__version__} has no call to release it: it stays held"
    after = transfer.host_allocator_stats()
    if not isinstance(after, dict):
        return line + f"; released with {used}, not measured after ({after})"
    freed = before["allocated_bytes"] - after["allocated_bytes"]
    return line + f"; {used} released {freed / mib:.0f} MiB, {after['allocated_bytes'] / mib:.0f} MiB still held"


@dataclass
class Calibration:
    """What :func:`choose_model` chose for one regime, and why; seconds per batch of the loader and the model alone."""

    regime: str
    width: int
    depth: int
    loader_s: float
    compute_s: float
    reached: bool
    reason: str = ""
    seconds: float = 0.0

    @property
    def ratio(self) -> float:  # compute time over loader time per batch (> 1: the compute is slower)
        return self.compute_s / self.loader_s if self.loader_s > 0 else float("inf")

    def describe(self) -> str:
        return (
            f"{self.regime}: width {self.width}, depth {self.depth}: compute alone {self.compute_s * 1e3:.1f} ms "
            f"per batch vs loader alone {self.loader_s * 1e3:.1f} ms (x{self.ratio:.2f}); {self.reason}"
        )


def _next_model(
    order: list[tuple[int, int]], flops: dict[tuple[int, int], int], seen: dict[tuple[int, int], float],
    current: tuple[int, int], ratio: float, loader_s: float,
) -> tuple[int, int] | None:  # fmt: skip
    """The smallest unmeasured model predicted (time scales with FLOPs) to land in range, in the direction needed,
    else the furthest that way; never a smaller one than a model already measured too fast."""
    f, target = flops, flops[current] * (MARGIN + UPPER) / 2 / max(ratio, 1e-9)
    if ratio < MARGIN:
        cands = [m for m in order if f[m] > f[current] and m not in seen]
    else:
        cands = [m for m in order if f[m] < f[current] and m not in seen
                 and not any(f[m] <= f[k] and v < MARGIN * loader_s for k, v in seen.items())]  # fmt: skip
    return next((m for m in cands if f[m] >= target), cands[-1] if cands else None)


def _choice(seen: dict[tuple[int, int], float], flops: dict[tuple[int, int], int], start: tuple[int, int],
            loader_s: float, stop: str) -> tuple[tuple[int, int], float, bool, str]:  # fmt: skip
    """(model, seconds per step, reached, why): the smallest model that reached the regime, else the largest."""
    fast_enough = {m: v for m, v in seen.items() if v >= MARGIN * loader_s}
    if fast_enough:
        best = min(fast_enough, key=lambda m: flops[m])
        return best, fast_enough[best], True, (
            f"the smallest model measured whose step takes at least {MARGIN:.0f}x the loader's batch "
            f"({len(seen)} model(s) measured)")  # fmt: skip
    if not seen:
        return start, float("nan"), False, f"nothing could be measured: {stop}"
    best = max(seen, key=lambda m: flops[m])
    return best, seen[best], False, (
        f"compute-bound regime NOT reached: the largest model measured takes only {seen[best] / loader_s:.2f}x the "
        f"loader's batch ({stop}); its loading steps are expected to gain as in the data-bound regime")  # fmt: skip


def _data_bound_reason(compute_s: float, loader_s: float, reached: bool) -> str:
    """Why the tiny model was kept: the loader slower by the margin, by less (loading steps can still gain), or not."""
    if compute_s <= 0:
        return "no time measured"
    if reached:
        return f"the tiny model computes a batch {loader_s / compute_s:.1f}x faster than the loader loads one"
    if compute_s < loader_s:
        return (
            f"the loader is the slower stage ({loader_s / compute_s:.2f}x the tiny model's step), but by less than "
            f"the {MARGIN:.0f}x margin asked for (the data-bound margin is not reached): loading steps can still gain"
        )
    return (
        f"even the tiny model computes a batch no faster than the loader loads one here (data-bound regime not "
        f"reached: its step takes {compute_s / loader_s:.2f}x the loader's batch): loading steps are expected to "
        "gain less, as in the compute-bound regime"
    )


def choose_model(
    regime: str,
    measure: Callable[[int, int], float],
    loader_s: float,
    *,
    start: tuple[int, int],
    crop_size: int,
    budget_s: float = 30.0,
    max_probes: int = 6,
    clock: Callable[[], float] = time.perf_counter,
    fits: Callable[[int, int], str | None] | None = None,
) -> Calibration:
    """Pick ``regime``'s model. **data-bound**: ``start`` must compute a batch :data:`MARGIN` x faster than the loader
    loads one. **compute-bound**: the step must take :data:`MARGIN` to :data:`UPPER` x the loader's batch; each probe
    predicts the size needed until in range, or the ladder, memory (``fits``), ``max_probes`` or ``budget_s`` run
    out."""
    t0 = clock()
    if regime == "data-bound":
        c = measure(*start)
        ok = c * MARGIN <= loader_s
        return Calibration(regime, *start, loader_s, c, ok, _data_bound_reason(c, loader_s, ok), clock() - t0)
    flops = {m: flops_per_sample(_on_meta(*m), crop_size) for m in set(MODEL_LADDER) | {start}}
    order = sorted(flops, key=flops.__getitem__)
    seen: dict[tuple[int, int], float] = {}
    current: tuple[int, int] | None = start
    stop = ""
    while current is not None:
        w, d = current
        too_big = fits(w, d) if fits is not None else None
        if too_big is not None:  # not measured: the probe would not fit in the device's memory
            stop = f"width {w}, depth {d} was not tried: {too_big}"
            break
        try:
            seen[current] = measure(w, d)
        except torch.OutOfMemoryError:
            stop = f"width {w}, depth {d} ran out of device memory"
            torch.cuda.empty_cache()  # a no-op unless CUDA was initialised
            break
        ratio = seen[current] / loader_s if loader_s > 0 else float("inf")
        if MARGIN <= ratio <= UPPER:
            break
        if len(seen) >= max_probes or clock() - t0 > budget_s:
            stop = f"{max_probes} models measured" if len(seen) >= max_probes else (
                f"the calibration's time budget ({budget_s:.0f} s) is spent")  # fmt: skip
            break
        current = _next_model(order, flops, seen, current, ratio, loader_s)
        stop = "" if current else "no other model on the ladder"
    (width, depth), compute_s, reached, why = _choice(seen, flops, start, loader_s, stop)
    return Calibration(regime, width, depth, loader_s, compute_s, reached, why, clock() - t0)


def calibrate(
    device: torch.device | str = "cpu", *, progress: Callable[..., None] | None = None, pipeline: Pipeline | None = None
) -> dict[str, Calibration]:
    """Each regime's model for ``device`` from the pipeline's loader and ``train_step`` alone (cached)."""
    dev = torch.device(device)
    budget = sized(quick=10.0, laptop=30.0, full=60.0)
    base = job_spec("data-bound")
    pipe = _pipeline(pipeline, dev, base.seed)
    key = ("calibration", str(dev), base.batch_size, base.crop_size, base.threads,
           str(dataset_info().train_dir), id(pipe.make_loader), id(pipe.train_step))  # fmt: skip
    if key in _CACHE:
        return _CACHE[key]
    report = progress or no_progress
    report(0.0, "timing the loader alone")
    loader_s = base.batch_size / _loader_alone(pipe, base, Settings(), dev)  # cached: the waterfall's baseline
    n_steps = sized(quick=3, laptop=4, full=5)
    classes = int(dataset_info().params["num_classes"])

    def measure(width: int, depth: int) -> float:
        report(0.3, f"timing train_step alone: width {width}, depth {depth}")
        spec = dataclasses.replace(base, width=width, depth=depth)
        return statistics.median(_step_times(spec, dev, n_steps, pipe.train_step, warm=1))

    def fits(width: int, depth: int) -> str | None:  # bounded by the memory free now, not by the card's size
        return device_memory_check(dev, probe_bytes(width, depth, base.batch_size, base.crop_size, classes))

    out = {}
    for regime, r in REGIMES.items():
        start = (sized(quick=r["quick_width"], full=r["width"]), r["depth"])
        out[regime] = choose_model(regime, measure, loader_s, start=start, crop_size=base.crop_size, budget_s=budget,
                                   fits=fits)  # fmt: skip
    report(1.0, "calibrated")
    _CACHE[key] = out
    return out
