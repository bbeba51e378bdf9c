"""Chapter 05's "Does it pay?": seconds per batch of a few ways to feed one training step, in alternating rounds (the
reader's pipeline on preloaded batches; the reference Prefetcher, for the reference files)."""

from __future__ import annotations

import functools
import math
import textwrap
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

import torch

from ...core.device import resolve_device
from ...core.progress import no_progress
from ...core.results import Record
from ...core.rounds import Rounds, alternate, table
from ...core.timing import cuda_event_time, time_calls
from ...core.validate import check_int
from ...pipeline.data import to_float_normalized
from ...pipeline.prefetch import Prefetcher

#: The three ways that say how much of the copy the prefetcher hides.
IN_LINE = "uint8, copied and normalised in line"
PREFETCHED = "uint8, through your Prefetcher"
NO_COPY = "uint8, already on the GPU (no copy)"


def preload(loader: Iterable[Any], device: torch.device | str | None = None) -> list[tuple[Any, ...]]:
    """One pass of ``loader`` held in host memory (pinned for CUDA): a pass over it times no decoding."""
    dev = resolve_device(device)
    out: list[tuple[Any, ...]] = []
    for i, batch in enumerate(loader):
        if not isinstance(batch, (tuple, list)) or not all(isinstance(t, torch.Tensor) for t in batch):
            raise ValueError(f"batch {i} of the loader is {type(batch).__name__}, not a tuple of tensors (x, y)")
        if dev.type == "cuda":
            batch = tuple(t if t.is_pinned() else t.pin_memory() for t in batch)
        out.append(tuple(batch))
    if not out:
        raise ValueError("the loader gave no batch to preload: give it at least batch_size items (drop_last=True)")
    return out


@dataclass
class BatchTimes(Rounds):
    """Seconds per batch of each way (``values``, one per round) on ``device``."""

    device: str = ""

    def report(self) -> str:
        first = next(iter(self.values), "")
        rows = [
            [name, f"{self.median(name) * 1e3:.3f}", f"{min(v) * 1e3:.3f}-{max(v) * 1e3:.3f}",
             "" if name == first else f"{self.median(first) / self.median(name):.2f}x"]
            for name, v in self.values.items()
        ]  # fmt: skip
        lines = [f"ms per batch on {self.device}, median of {self.n} alternating rounds:"]
        lines += ["  " + ln for ln in table(["way", "ms per batch", "min-max", "first / this"], rows)]
        hidden = self.copy_hidden()
        return "\n".join(lines + (textwrap.wrap(hidden, 105) if hidden else []))

    def copy_hidden(self) -> str | None:
        """How much of the copy (in line - no copy) the prefetcher saved (in line - prefetched), or noise, or None."""
        if not all(k in self.values for k in (IN_LINE, PREFETCHED, NO_COPY)):
            return None
        inline, pf, floor = self.median(IN_LINE), self.median(PREFETCHED), self.median(NO_COPY)
        cost = inline - floor
        spread = max(max(v) - min(v) for k, v in self.values.items() if k in (IN_LINE, NO_COPY))
        if cost <= spread:
            return (
                f"The copy's cost per batch ({cost * 1e3:.3f} ms, in line minus no copy) is within the rounds' "
                f"spread ({spread * 1e3:.3f} ms): too small to say how much of it the prefetcher hides here."
            )
        return (
            f"The copy costs {cost * 1e3:.3f} ms per batch in line (in line minus no copy); the prefetcher "
            f"saves {(inline - pf) * 1e3:.3f} ms of it: {(inline - pf) / cost:.0%} hidden."
        )


def time_batches(
    variants: dict[str, Callable[[], Iterable[Any]]],
    step: Callable[..., Any],
    device: torch.device | str | None = None,
    *,
    rounds: int = 3,
    progress: Callable[[float, str], None] | None = None,
) -> BatchTimes:
    """Each of ``variants`` (label -> a fresh iterable of ``(x, y)`` device batches) feeds ``step(x, y)`` for one
    synchronised pass: one untimed pass each (reversed), then ``rounds`` alternating rounds."""
    dev = resolve_device(device)
    rounds = check_int("rounds", rounds, 1, 50)
    if not variants:
        raise ValueError("variants must name at least one way to feed the step, e.g. {'mine': lambda: batches(loader)}")

    def one_pass(name: str) -> float:  # seconds per batch of one synchronised pass
        fed = [0]

        def run() -> None:
            for x, y in variants[name]():
                step(x, y)
                fed[0] += 1

        seconds = time_calls(run, repeats=1, device=dev).median_s
        if fed[0] == 0:
            raise ValueError(f"variant {name!r} gave no batches")
        return seconds / fed[0]

    (progress or no_progress)(0.0, "warm-up: one untimed pass of each way")
    for name in reversed(variants):
        one_pass(name)
    r = alternate({n: functools.partial(one_pass, n) for n in variants}, rounds, progress=progress)
    return BatchTimes(r.labels, r.values, device=str(dev))


def batch_time_lines(times: BatchTimes | list[Record]) -> list[str]:
    """A :class:`BatchTimes` measured here (its report), or the ``ch05.prefetch.batch_time`` records, introduced."""
    if isinstance(times, BatchTimes):
        return times.report().splitlines()
    what = (
        "Reference figures, recorded with the workbook's reference prefetcher (helpers.pipeline.prefetch.Prefetcher) "
        "on pre-loaded pinned batches and a synthetic compute per batch, not with your cells:"
    )
    lines = textwrap.wrap(what, 105)
    p = [(str(r.params.get("dtype")), bool(r.params.get("prefetcher")), r.value) for r in times]
    return lines + [f"  {dtype:>8}, prefetcher={pf}: {sec * 1e3:.3f} ms per batch" for dtype, pf, sec in p]


def _in_line(loader: list[tuple[torch.Tensor, torch.Tensor]], dev: torch.device, norm: Any) -> Iterator[Any]:
    for x, y in loader:
        x = x.to(dev, non_blocking=True)
        yield (to_float_normalized(x, *norm) if norm else x), y.to(dev, non_blocking=True)


def prefetch_step_times(
    dev: torch.device, *, batch: int = 256, image: int = 128, n_batches: int = 8
) -> dict[tuple[str, bool], float]:
    """``ch05.prefetch.batch_time`` (CUDA): float32 or uint8 pinned batches feeding a compute of about 1.2 copies,
    through the reference Prefetcher or copied in line."""
    mean, std = (0.5, 0.5, 0.5), (0.25, 0.25, 0.25)
    g = torch.Generator().manual_seed(0)
    y = torch.zeros(batch, dtype=torch.int64).pin_memory()
    shape = (batch, 3, image, image)
    u8 = [(torch.randint(0, 256, shape, dtype=torch.uint8, generator=g).pin_memory(), y) for _ in range(n_batches)]
    f32 = [(to_float_normalized(x, mean, std).pin_memory(), y) for x, _ in u8]
    f32[0][0].to(dev)  # warm-up
    copy = cuda_event_time(lambda: f32[0][0].to(dev, non_blocking=True), repeats=1, warmup=0, device=dev)
    compute = calibrated_compute(dev, 1.2 * copy.median_s)
    ways: dict[tuple[str, bool], Callable[[], Iterable[Any]]] = {}
    for dtype_name, loader, norm in (("float32", f32, None), ("uint8", u8, (mean, std))):
        ways[(dtype_name, False)] = functools.partial(_in_line, loader, dev, norm)
        ways[(dtype_name, True)] = functools.partial(iter, Prefetcher(loader, dev, normalize=norm))
    times = time_batches({f"{d}, prefetcher={p}": w for (d, p), w in ways.items()}, lambda x, y: compute(x), dev)
    return {(d, p): times.median(f"{d}, prefetcher={p}") for d, p in ways}


def calibrated_compute(dev: torch.device, target_s: float) -> Callable[[torch.Tensor], torch.Tensor]:
    """A function of a batch taking about ``target_s`` of GPU time on ``dev``'s current stream (CUDA only); its
    result, ``batch.float().sum()`` plus one element of the product, depends on the batch."""
    a = torch.randn(2048, 2048, device=dev).div_(math.sqrt(2048))
    c = torch.empty_like(a)

    def five() -> None:
        for _ in range(5):
            torch.mm(a, a, out=c)

    one = max(cuda_event_time(five, repeats=1, warmup=1, device=dev).median_s / 5, 1e-6)
    k = max(1, round(target_s / one))

    def compute(batch: torch.Tensor) -> torch.Tensor:
        for _ in range(k):
            torch.mm(a, a, out=c)
        return batch.float().sum() + c[0, 0]

    return compute
