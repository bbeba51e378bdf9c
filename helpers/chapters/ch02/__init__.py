"""Chapter 02 · Pageable vs pinned memory: the GPU copy curves (measured, or rebuilt from a reference file), the
agreement lines (a fit against its points, two runs of one copy), the live panel "Copy one batch" and the benchmark.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Any, Sequence

import ipywidgets as W
import torch

from ...core import agreement, evidence
from ...core.config import sized
from ...core.device import hardware_report, pcie_bandwidth_gbps, resolve_device
from ...core.evidence import Evidence, provenance_line
from ...core.progress import ProgressFn, no_progress, scaled
from ...core.results import ResultSet
from ...core.rounds import intraop_threads
from ...core.timing import summarize
from ...core.validate import check_choice, check_float, check_int, human_bytes, human_seconds
from ...pipeline import transfer
from ...ui import published
from ...ui.published import PublishedFigure
from . import copies, figures, model, pin_costs
from .copies import DIRECTIONS, MEMORY_KINDS, CopyFn, Sweep, TransferPoint
from .model import DTYPES, LatencyBandwidthFit, MiB

NUMBER = "02"
TITLE = "host-to-device transfers"
BENCH_WEIGHT = 2.0
PANEL_TITLE = "Copy one batch"
PANEL_FIGSIZE = (9.5, 4.2)

PANEL_SIZES_MIB = (0.25, 1, 4, 16, 64, 256)  # MiB of images *as uint8*; float32 moves 4x the bytes


@dataclass(frozen=True)
class CopySweeps:
    """The GPU copy curves of one machine, its link's theoretical ceiling ``(GB/s, label)`` (or None, and
    ``ceiling_note`` says why) and the GPU's name."""

    sweeps: dict[tuple[str, str], Sweep]
    ceiling: tuple[float, str] | None = None
    ceiling_note: str = ""
    gpu: str = ""

    def lines(self) -> list[str]:
        out = [
            f"  {sw.label}: {len(sw.points)} sizes, {human_bytes(min(sw.sizes()))} to {human_bytes(max(sw.sizes()))}"
            for sw in self.sweeps.values()
            if sw.points
        ]
        c, why = self.ceiling, self.ceiling_note or "not recorded"
        return out + [f"  link ceiling: {c[0]:.1f} GB/s, {c[1]}" if c else f"  Link ceiling unknown: {why}"]


def _ceiling(gbps: Any, label: Any) -> tuple[float, str] | None:
    text = str(label or "link ceiling")
    return (float(gbps), text if "theoretical" in text else f"{text} (theoretical)") if gbps else None


def measure_sweeps(
    copy_fn: CopyFn,
    sizes: Sequence[int] | None = None,
    *,
    device: torch.device | str,
    repeats: int | None = None,
    rounds: int = 2,
    progress: ProgressFn | None = None,
) -> CopySweeps:
    """The chapter's GPU curves, measured here (CUDA only): H2D by the reader's ``copy_fn`` in alternating rounds;
    D2H, which ``time_copy`` does not do, by :func:`~.copies.transfer_sweep`; the link's theoretical ceiling."""
    dev = resolve_device(device)
    ok, reason = transfer.cuda_status(dev)
    if not ok:
        raise ValueError(f"device: {reason}")
    progress = progress or no_progress
    reps = sized(5, 15) if repeats is None else repeats  # checked by copies.sweep, and rounds by its alternate()
    sweeps = copies.sweep(
        copy_fn, sizes, device=dev, repeats=reps, rounds=rounds, progress=scaled(progress, 0.0, 0.6, "H2D: ")
    )
    for i, memory in enumerate(MEMORY_KINDS):
        part = scaled(progress, 0.6 + 0.2 * i, 0.8 + 0.2 * i, f"D2H {memory}: ")
        sweeps[("d2h", memory)] = copies.transfer_sweep(
            "d2h", memory, sizes, device=dev, repeats=rounds * reps, progress=part
        )
    report = hardware_report(dev)
    ceiling = _ceiling(report.link_bandwidth_gbps, report.link_description)
    why = "" if ceiling else str(report.missing.get("link_bandwidth_gbps", "not read"))
    return CopySweeps(sweeps, ceiling, why, sweeps[("h2d", "pinned")].device)  # the GPU's name, as sweep read it


def recorded_sweeps(result_set: ResultSet, records: list[Any]) -> CopySweeps | None:
    """A ``convert``: a reference file's ``ch02.copy_time`` curves (sizes ascending), with its own hardware report's
    ceiling."""
    found: dict[tuple[str, str], list[TransferPoint]] = {}
    for r in records:
        d, m, spread = r.params.get("direction"), r.params.get("memory"), r.spread or {}
        if d in DIRECTIONS and m in MEMORY_KINDS:
            n, iqr, k = int(r.params["nbytes"]), float(spread.get("iqr_s", 0.0)), int(spread.get("n", 1))
            found.setdefault((d, m), []).append(TransferPoint(n, d, m, r.value, iqr, k, method="reference record"))
    if not found:
        return None
    source = provenance_line(result_set)
    sweeps = {(d, m): Sweep(d, m, sorted(v, key=lambda p: p.nbytes), source) for (d, m), v in found.items()}
    report = result_set.provenance.get("report", {}) or {}
    ceiling = _ceiling(report.get("link_bandwidth_gbps"), report.get("link_description"))
    gpu = str(result_set.hardware.get("gpu_name") or "a GPU")
    return CopySweeps(sweeps, ceiling, "" if ceiling else "not in the reference file", gpu)


def sweeps_caption(gpu: Evidence[CopySweeps]) -> str:
    if gpu:
        return f"GPU curves: {gpu.source}. Host memcpy: measured now on this machine's CPU."
    return "Host memcpy measured now on this machine's CPU. No GPU curves: none measured here and none recorded yet."


# -- section 3: published figures, paired and keyed ---------------------------------------------------------

#: What :func:`pairs` pairs: the attribute that differs, its two values, and the attributes both must share.
_PAIRS = {
    "direction": ("direction", "h2d", "d2h", ("url", "gpu", "memory", "transfer_size_bytes", "numa", "method")),
    "numa": ("numa_side", "near", "far", ("url", "gpu", "direction", "memory", "transfer_size_bytes", "tool")),
    "memory": ("memory", "pageable", "pinned", ("url", "gpu", "direction", "transfer_size_bytes", "numa")),
}


def pairs(what: str) -> list[tuple[PublishedFigure, PublishedFigure]]:
    """Published figures that differ in one thing only, from one source and run: ``"direction"`` gives (H2D, D2H)
    pairs (same GPU, memory kind, size, NUMA placement), ``"numa"`` (near socket, far socket) pairs (same GPU,
    direction and copy), ``"memory"`` (pageable, pinned) pairs (same GPU, direction, size and NUMA placement)."""
    field, a, b, same = _PAIRS[check_choice("what", what, _PAIRS)]
    figs = published.published_figures()
    xs, ys = [x for x in figs if getattr(x, field) == a], [y for y in figs if getattr(y, field) == b]
    return [(x, y) for x in xs for y in ys if all(getattr(x, s) == getattr(y, s) for s in same)]


def published_claim_lines() -> list[str]:
    """Section 3 without a GPU pair: the claim "30-50% faster" against the published (pageable, pinned) pairs of
    :func:`pairs`, labelled as published; pinned GB/s / pageable GB/s at one size is pageable time / pinned time."""
    found = pairs("memory")
    if not found:
        return ["No pageable-vs-pinned pair to compare: none measured, recorded or published."]
    ratios = [pinned.gbps / pageable.gbps for pageable, pinned in found]
    head = f"No GPU pair measured or recorded here. Pairs {published.KIND_PUBLISHED} (not this machine), as pageable"
    out = [f"{head} time / pinned time at one size:"]
    for (_, pinned), r in zip(found, ratios):
        what = f"{pinned.short_label().replace(' pinned', '')}, {published.size_text(pinned.transfer_size_bytes)}"
        out += [f"  {r:5.2f}x ({model.claim_verdict(r)})  {what}", f"         [{published.short_source(pinned.url)}]"]
    return out + [f"Verdict on the published pairs: {model.claim_check(ratios)}"]


# One rule for the whole chapter: a measured figure is its median with a band of one IQR either side. A model's
# prediction agrees with a point when it lies in that band; two measurements agree when their bands overlap.
# A point recorded with an IQR of 0 (one sample) has no band: any difference is a miss.


@dataclass(frozen=True)
class FitCheck:
    """A fit against its points: ``misses`` holds ``(nbytes, |prediction / median - 1|, IQR / median)`` for each
    size where the fit lies outside the point's band."""

    n_points: int
    misses: tuple[tuple[int, float, float], ...]

    @property
    def agrees(self) -> bool:
        return not self.misses

    def verdict(self) -> str:
        if self.agrees:
            return f"fit within the points' spread (±1 IQR) at every size ({self.n_points} sizes): fit and points agree"
        worst = max(self.misses, key=lambda m: m[1])
        sizes = ", ".join(human_bytes(n) for n, _, _ in self.misses)
        return (
            f"fit misses {len(self.misses)} of {self.n_points} sizes by more than their spread ({sizes}; largest "
            f"miss beyond the spread at {human_bytes(worst[0])}: {worst[1]:.0%} off, IQR {worst[2]:.0%}): "
            "trust the points, not the fit, there"
        )


def fit_check(sweep: Sweep, fit: LatencyBandwidthFit | None = None) -> FitCheck:
    """``fit`` (default ``sweep.fit()``) against the sweep's points: a miss where the prediction lies outside the
    point's band median ± IQR."""
    fit = sweep.fit() if fit is None else fit
    misses = []
    for p in sweep.points:
        predicted = fit.predict_s(p.nbytes)
        if not agreement.within_range(predicted, agreement.median_band(p.median_s, p.iqr_s)):
            misses.append((p.nbytes, abs(predicted - p.median_s) / p.median_s, p.iqr_s / p.median_s))
    return FitCheck(len(sweep.points), tuple(misses))


def runs_agree(first: str, seconds: Sequence[float], second: str, point: TransferPoint) -> str:
    """Whether raw ``seconds`` (one run) and a sweep ``point`` (another run of the same copy) agree: one line."""
    t = summarize(first, list(seconds))
    one = TransferPoint(point.nbytes, point.direction, point.memory, t.median_s, t.iqr_s, n=t.n)
    return points_agree(first, one, second, point)


def points_agree(first: str, a: TransferPoint, second: str, b: TransferPoint) -> str:
    """Whether two measurements of one copy agree (their bands median ± IQR overlap); if not, trust ``second``."""
    one = f"{first} {human_seconds(a.median_s)} (IQR {human_seconds(a.iqr_s)}, n={a.n})"
    two = f"{second} {human_seconds(b.median_s)} (IQR {human_seconds(b.iqr_s)}, n={b.n})"
    band_a, band_b = agreement.median_band(a.median_s, a.iqr_s), agreement.median_band(b.median_s, b.iqr_s)
    if agreement.spreads_overlap(band_a, band_b):  # the medians differ by at most the sum of the IQRs
        return f"{one} vs {two}: they agree within their spread."
    ratio = max(a.median_s, b.median_s) / min(a.median_s, b.median_s)
    return (
        f"{one} vs {two}: they do NOT agree within their spread ({ratio:.2f}x apart, more than their noise: "
        f"something differed between the runs, e.g. other load or cache state). Trust the {second}: more "
        "samples, in alternating rounds."
    )


def largest_copy(host: Sweep) -> TransferPoint:
    """The sweep's largest copy: the one the chapter prints and the cap check uses."""
    if not host.points:
        raise ValueError("the host memcpy sweep has no points: run the sweep cell first")
    return max(host.points, key=lambda p: p.nbytes)


def memcpy_cap_lines(host: Sweep) -> list[str]:
    """The sweep's own largest copy (staged from RAM, not from the caches that speed up mid-sized copies) against
    PCIe x16 ceilings."""
    big = largest_copy(host)
    out = [
        f"Host memcpy at {human_bytes(big.nbytes)} (the sweep's largest copy, printed above, measured now): "
        f"{big.gbps:.2f} GB/s"
    ]
    for gen in (3, 4, 5):
        link = pcie_bandwidth_gbps(gen, 16)
        side = "the CPU memcpy would cap pageable copies" if big.gbps < link else "the link is the cap either way"
        out.append(f"  PCIe Gen{gen} x16, {link:5.1f} GB/s (theoretical): {side}")
    return out


@dataclass
class PanelReading:
    """One panel run: the copy asked for, what could be shown for it, and the sweeps it is drawn on."""

    nbytes: int
    direction: str
    memory: str
    dtype: str
    measured: TransferPoint | None = None
    reference: TransferPoint | None = None
    host: TransferPoint | None = None
    note: str = ""
    background: tuple[Sweep, ...] = ()
    ceiling: tuple[float, str] | None = None
    caption: str | None = None


def panel_controls(**context: Any) -> dict[str, Any]:
    return {
        "size_mib": W.SelectionSlider(options=list(PANEL_SIZES_MIB), value=4, description="size (MiB of uint8 pixels)"),
        "direction": W.Dropdown(options=list(DIRECTIONS), value="h2d", description="direction"),
        "memory": W.ToggleButtons(options=list(MEMORY_KINDS), value="pinned", description="memory"),
        "dtype": W.Dropdown(options=list(DTYPES), value="uint8", description="dtype"),
    }


def _one_copy(copy_fn: CopyFn, r: PanelReading, device: Any, cuda: bool) -> TransferPoint:
    """One round of the reading's copy, 10 timed copies: with CUDA, H2D by ``copy_fn`` and D2H by the helper's copy;
    without, the host memcpy ``copy_fn`` times on a CPU, on one thread."""
    kw: dict[str, Any] = {"device": device, "repeats": 10, "dtype": r.dtype}
    if cuda and r.direction == "d2h":
        return copies.transfer_sweep("d2h", r.memory, [r.nbytes], **kw).points[0]
    with contextlib.nullcontext() if cuda else intraop_threads(1):
        curves = copies.sweep(copy_fn, [r.nbytes], rounds=1, kinds=(r.memory,), **kw)
    return next(iter(curves.values())).points[0]


def _nearest_recorded(r: PanelReading, recorded: CopySweeps | None) -> TransferPoint | None:
    """The recorded point of ``r``'s copy nearest its size (in log scale), if one is recorded."""
    if recorded is None or (r.direction, r.memory) not in recorded.sweeps:
        return None
    return min(recorded.sweeps[(r.direction, r.memory)].points, key=lambda q: abs(math.log(q.nbytes / r.nbytes)))


def _no_cuda_note(r: PanelReading, recorded: CopySweeps | None) -> str:
    if r.reference is not None and recorded is not None:
        ref = f"Reference point recorded on {recorded.gpu}, not here."
    else:
        ref = "No reference result for this copy is recorded yet (run `make gpu-check` on a GPU machine)."
    pin = " Pinning is impossible without the NVIDIA driver." if r.memory == "pinned" else ""
    host = " The host memcpy is real, but it is a CPU copy, not a transfer to a GPU."
    return f"No CUDA device here: the GPU copy cannot run. {ref}{pin}{host}"


def panel_run(
    progress: ProgressFn,
    *,
    device: torch.device | str,
    size_mib: float,
    direction: str,
    memory: str,
    dtype: str,
    copy_fn: CopyFn,
    gpu: Evidence[CopySweeps] | None = None,
    host: Sweep | None = None,
    **context: Any,
) -> Evidence[PanelReading]:
    """Copy one batch (``size_mib``: MiB *as uint8*) by the reader's ``copy_fn``: with CUDA a real copy; without, the
    nearest recorded point of ``gpu`` and a live host memcpy, saying why; either set against the sweep's point of
    that size (``host``)."""
    size_mib = check_float("size_mib", size_mib, 1 / 256, 1024)
    direction = check_choice("direction", direction, DIRECTIONS)
    memory = check_choice("memory", memory, MEMORY_KINDS)
    dtype = check_choice("dtype", dtype, DTYPES)
    nbytes = int(round(size_mib * MiB)) * torch.empty((), dtype=DTYPES[dtype]).element_size()
    progress(0.1, "measuring…")
    recorded = gpu.value if gpu is not None else None
    background = tuple(recorded.sweeps.values() if recorded else ()) + ((host,) if host else ())
    caption = sweeps_caption(gpu) if gpu is not None else None
    r = PanelReading(nbytes, direction, memory, dtype, background=background, caption=caption)
    r.ceiling, name = (recorded.ceiling if recorded else None), getattr(copy_fn, "__name__", "copy_fn")
    if transfer.cuda_status(device)[0]:
        r.measured = mine = _one_copy(copy_fn, r, device, True)
        d2h, where = direction == "d2h", device
        r.note = (
            "D2H: timed by copies.transfer_sweep (your copy function does H2D)." if d2h else f"Timed by your {name}()."
        )
        method = "copies.transfer_sweep, CUDA events" if d2h else f"your {name}()"
        here = recorded is not None and gpu is not None and gpu.here  # measured here too: the same copy, twice
        against = recorded.sweeps.get((direction, memory)) if here and recorded else None
        what = f"a {direction.upper()} {memory} {dtype} copy of {human_bytes(nbytes)}"
    else:
        r.reference = _nearest_recorded(r, recorded)
        r.note, where, against = _no_cuda_note(r, recorded), "cpu", host
        r.host = mine = _one_copy(copy_fn, r, "cpu", False)
        method, what = f"your {name}() on one CPU thread", f"a host memcpy of {human_bytes(nbytes)} (not a GPU copy)"
    same = [q for q in against.points if q.nbytes == nbytes] if against is not None else []
    if same:
        r.note += " " + points_agree("This run", mine, f"sweep's {human_bytes(nbytes)} point", same[0])
    progress(1.0, "done")
    return evidence.measured(what, r, where, method)


def panel_summary(result: Evidence[PanelReading]) -> str:
    r = result.value
    if r is None:
        return result.header()
    ref = f", {human_bytes(r.reference.nbytes)} recorded" if r.reference else ""
    shown = [(r.measured, "measured here", ""), (r.reference, "reference", ref)]
    shown.append((r.host, "host memcpy of the same bytes", ""))
    parts = [f"{what} {human_seconds(p.median_s)} ({p.gbps:.2f} GB/s{x})" for p, what, x in shown if p is not None]
    head = f"{r.direction.upper()} {r.memory} {r.dtype}, {human_bytes(r.nbytes)}: "
    return head + "; ".join(parts) + (". " + r.note if r.note else "")


def panel_plot(history: list[Any], ax: Any) -> None:
    """The runs as stars on the sweep plot; the last six in colour."""
    readings = [r.result.value for r in history if r.result.value is not None]
    last = readings[-1] if readings else None
    pts: list[tuple[TransferPoint, str]] = []
    for i, r in enumerate(readings, 1):
        for p, what in ((r.measured, "measured now"), (r.reference, "reference"), (r.host, "host memcpy now")):
            if p is not None:
                pts.append((p, f"run {i}: {r.direction.upper()} {r.memory} {r.dtype}, {what}"))
    background, ceiling, caption = (list(last.background), last.ceiling, last.caption) if last else ([], None, None)
    title = "Panel runs on the sweep"
    ax = figures.plot_sweeps(background, ax, ceiling=ceiling, source=caption, fits=False, points=pts[-6:], title=title)
    for p, _ in pts[:-6]:
        ax.plot([p.nbytes], [p.gbps], marker="*", color="#bbbbbb", linestyle="", markersize=10)


def benchmark(
    results: ResultSet,
    device: torch.device | str | None,
    *,
    progress: ProgressFn | None = None,
    sizes: Sequence[int] | None = None,
) -> None:
    """Records ``ch02.host_copy_time`` {nbytes} (the only one without CUDA); with CUDA ``ch02.copy_time``
    {direction, memory, nbytes} with each curve's ``ch02.fit.latency`` / ``.bandwidth``, ``ch02.pin.<field>``
    {nbytes} (:class:`~.pin_costs.PinCost`), ``ch02.host_held`` {case, nbytes, gpu_work_s}, ``ch02.wire_time``
    {dtype, nbytes} and ``ch02.pinned_block`` {requested}. Spread ``iqr_s``, ``n`` where a median."""
    progress = progress or no_progress
    sizes = [check_int("sizes[i]", n, 1) for n in (model.copy_sizes() if sizes is None else sizes)]
    progress(0.0, "host memcpy sweep")
    for p in map(copies.measure_host_copy, sizes):
        results.add("ch02.host_copy_time", p.median_s, "s", spread={"iqr_s": p.iqr_s, "n": p.n}, nbytes=p.nbytes)
    if not transfer.cuda_status(device)[0]:
        progress(1.0, "no CUDA device: host memcpy only")
        return
    dev = resolve_device(device)
    # the notebook's curves (measure_sweeps), H2D timed by the helper's copy: pageable and pinned in alternating rounds
    curves = measure_sweeps(copies._helper_copy("h2d"), sizes, device=dev, progress=scaled(progress, 0.1, 0.6))
    for (direction, memory), sw in curves.sweeps.items():
        for p in sw.points:
            spread = {"iqr_s": p.iqr_s, "n": p.n}
            results.add("ch02.copy_time", p.median_s, "s", spread, direction=direction, memory=memory, nbytes=p.nbytes)
        fit = sw.fit()
        results.add("ch02.fit.latency", fit.latency_s, "s", direction=direction, memory=memory)
        results.add("ch02.fit.bandwidth", fit.gbps, "GB/s", direction=direction, memory=memory)
    _record_pinning(results, dev, sizes, progress)
    progress(1.0, "done")


def _record_pinning(results: ResultSet, dev: torch.device, sizes: list[int], progress: ProgressFn) -> None:
    pin_sizes = [s for s in (1 * MiB, 16 * MiB, 128 * MiB) if s <= max(sizes)] or [max(sizes)]
    for i, n in enumerate(pin_sizes):
        progress(0.6 + 0.2 * i / len(pin_sizes), f"cost of pinning {human_bytes(n)}")
        pc = pin_costs.pin_cost(n, device=dev)
        for key in pin_costs.RECORD_FIELDS:
            results.add(f"ch02.pin.{key}", getattr(pc, key), "s", nbytes=n)
    progress(0.8, "host-blocking probe")
    hb = pin_costs.host_blocking_probe(device=dev, nbytes=min(64 * MiB, max(sizes)))
    assert isinstance(hb, pin_costs.HostBlocking)  # with CUDA, never Unavailable
    for case, value in hb.held_s.items():
        results.add("ch02.host_held", value, "s", case=case, nbytes=hb.nbytes, gpu_work_s=hb.gpu_work_s)
    progress(0.9, "uint8 vs float32 on the wire")
    wire = copies.wire_comparison(device=dev)
    for d in DTYPES:
        results.add("ch02.wire_time", wire.seconds[d], "s", dtype=d, nbytes=wire.nbytes[d])
    progress(0.95, "pinned block rounding")
    for n, grew in pin_costs.pinned_rounding_demo([3 * MiB, 5 * MiB, 9 * MiB]).rows:  # type: ignore[union-attr]
        if grew is not None:
            results.add("ch02.pinned_block", grew, "bytes", requested=n)
