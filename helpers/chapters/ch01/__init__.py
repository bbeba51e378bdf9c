"""Chapter 01 · The baseline pipeline: its live panel (a fresh model trained a few steps through the reader's
functions), its benchmark (``ch01.*``), the breakdown recorded on a GPU, and the verdicts on the bottleneck
model's prediction against the measured steps."""

from __future__ import annotations

import textwrap
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Sequence

import ipywidgets as W
import torch

from ...core import agreement, evidence
from ...core.config import sized
from ...core.device import resolve_device
from ...core.evidence import Evidence
from ...core.progress import ProgressFn, no_progress, scaled
from ...core.results import Record, ResultSet
from ...pipeline.data import default_sizes
from ...ui import plots
from .anatomy import PHASES, Anatomy, Prediction, StepFn, ToDevice, step_anatomy

NUMBER = "01"
TITLE = "anatomy of a training step"
BENCH_WEIGHT = 1.0
PANEL_TITLE = "Anatomy of a baseline step"
PANEL_FIGSIZE = (9.0, 3.4)

METHOD = "anatomy.record_steps over your pipeline: host clock for load/collate, CUDA events for GPU phases"

#: The baseline model's width, and a 4x wider one (about 14x the compute).
BENCH_WIDTHS: tuple[int, ...] = (16, 64)


# -- the headless benchmark ------------------------------------------------------------------------------


def benchmark(
    results: ResultSet,
    device: torch.device | str | None,
    *,
    progress: ProgressFn | None = None,
    widths: Iterable[int] = BENCH_WIDTHS,
    steps: int | None = None,
    warmup: int = 3,
) -> None:
    """The baseline step's anatomy per model width: ``ch01.step.phase_time`` {phase}, ``.step_time``,
    ``.predicted_serial`` / ``.predicted_overlapped`` (the bottleneck model's sum / max), ``.samples_per_s``,
    ``.gflop_per_step`` (all with batch_size, crop_size, width, depth, num_workers, steps) and the span trace as
    artifact ``ch01.timeline.width<W>``."""
    dev = resolve_device(device)
    report = progress or no_progress
    sizes = default_sizes()
    n_steps = steps if steps is not None else sized(6, 20)
    widths = [int(w) for w in widths]
    for i, width in enumerate(widths):
        p: dict[str, Any] = {"batch_size": sizes["batch_size"], "crop_size": sizes["crop_size"], "width": width}
        part = scaled(report, i / len(widths), (i + 1) / len(widths))
        a = step_anatomy(**p, depth=3, steps=n_steps, warmup=warmup, device=dev, progress=part)
        p.update(depth=3, num_workers=0, steps=n_steps)
        for phase, t in a.phase_means.items():
            results.add("ch01.step.phase_time", t, "s", phase=phase, **p)
        for key, value, unit in (
            ("step_time", a.step_time, "s"),
            ("predicted_serial", a.prediction.serial, "s"),
            ("predicted_overlapped", a.prediction.overlapped, "s"),
            ("samples_per_s", a.samples_per_s, "items/s"),
            ("gflop_per_step", a.gflop_per_step, "GFLOP"),
        ):
            results.add(f"ch01.step.{key}", value, unit, **p)
        trace = a.trace.to_dict()
        trace["metadata"]["label"] = f"baseline step, width {width}, batch {sizes['batch_size']}"
        results.artifacts[f"ch01.timeline.width{width}"] = trace
    report(1.0, "done")


# -- the live panel --------------------------------------------------------------------------------------


def panel_controls(**context: Any) -> dict[str, Any]:
    """Batch size, image size and model width, starting at ``context["defaults"]``."""
    sizes = default_sizes()
    start = {"batch_size": sizes["batch_size"], "crop_size": sizes["crop_size"], "width": 16}
    start.update(context.get("defaults") or {})
    crops = sized(quick=[32, 48, 64, 96, 128], full=[96, 128, 160, 224, 256], laptop=[64, 80, 96, 112])
    options = {
        "batch_size": ([8, 16, 32, 64, 128], "batch size"),
        "crop_size": (crops, "image size"),
        "width": ([4, 8, 16, 32, 64], "model width"),
    }
    return {
        name: W.Dropdown(options=sorted(set(values) | {start[name]}), value=start[name], description=label)
        for name, (values, label) in options.items()
    }


def panel_run(
    progress: ProgressFn | None,
    *,
    device: torch.device | str | None,
    batch_size: int,
    crop_size: int,
    width: int,
    steps: int | None = None,
    make_loader: Callable[[Any, int], Iterable[Any]] | None = None,
    to_device: ToDevice | None = None,
    train_step: StepFn | None = None,
    **context: Any,
) -> Evidence[Anatomy]:
    """A few steps of a fresh model through the reader's ``make_loader``, ``to_device`` and ``train_step``."""
    report = progress or no_progress
    report(0.1, "building data set, loader and model")
    dev = resolve_device(device)
    n = steps if steps is not None else sized(quick=4, full=10, laptop=5)  # step_anatomy checks it
    pipeline: dict[str, Any] = {"make_loader": make_loader, "to_device": to_device, "train_step": train_step}
    sizes: dict[str, Any] = {"batch_size": batch_size, "crop_size": crop_size, "width": width, "depth": 3}
    a = step_anatomy(**sizes, steps=n, warmup=1, device=dev, progress=scaled(report, 0.1, 1.0), **pipeline)
    report(1.0, "done")
    what = f"a baseline step (batch {batch_size}, {crop_size} px, width {width}; {n} steps)"
    return evidence.measured(what, a, dev, method=METHOD)


def panel_summary(result: Evidence[Anatomy]) -> str:
    a = result.value
    if a is None:
        return result.header()
    ms = 1e3
    return (
        f"step {a.step_time * ms:.1f} ms measured; predicted {a.prediction.serial * ms:.1f} ms if nothing overlaps, "
        f"{a.prediction.overlapped * ms:.1f} ms with perfect overlap; largest phase: {a.dominant_phase}; "
        f"bottleneck stage: {a.prediction.bottleneck}; {a.samples_per_s:.0f} img/s — {result.source}"
    )


def _run_label(rec: Any) -> str:
    v = rec.values
    if {"batch_size", "crop_size", "width"} <= set(v):
        return f"#{rec.index}: batch {v['batch_size']}\n{v['crop_size']} px, width {v['width']}"
    return str(rec.short_label())


def panel_plot(history: list[Any], ax: Any) -> None:
    """Stacked phase bars of every run so far, with the measured step time as a black tick."""
    runs = [rec for rec in history if rec.result.value is not None]
    data = {_run_label(rec): rec.result.value.phase_means for rec in runs}
    devices = ", ".join(sorted({str(rec.result.value.settings.get("device", "?")) for rec in runs}))
    title = f"Baseline step by phase, one bar per run (measured now on {devices or 'this machine'})"
    stacked_phases(data, ax, title=title, unit="ms")
    for i, rec in enumerate(runs):
        label = "measured step" if i == 0 else None
        ax.plot([i - 0.4, i + 0.4], [rec.result.value.step_time * 1e3] * 2, color="black", linewidth=2, label=label)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)


def stacked_phases(
    data: Mapping[str, Mapping[str, float]],
    ax: Any = None,
    *,
    title: str = "Time per step, by phase",
    unit: str = "ms",
    source: str | None = None,
    horizontal: bool = False,
) -> Any:
    """One stacked bar per configuration, one segment per phase (seconds in, ``unit`` shown)."""
    factor = {"s": 1.0, "ms": 1e3, "µs": 1e6, "us": 1e6}[unit]
    ax = ax if ax is not None else plots.new_axes((8.0, 3.5))
    configs = list(data)
    phases = list(dict.fromkeys(p for c in configs for p in data[c]))
    bottoms = [0.0] * len(configs)
    for p in phases:
        vals = [data[c].get(p, 0.0) * factor for c in configs]
        if horizontal:
            ax.barh(configs, vals, left=bottoms, color=plots.phase_color(p), label=p)
        else:
            ax.bar(configs, vals, bottom=bottoms, color=plots.phase_color(p), label=p)
        bottoms = [b + v for b, v in zip(bottoms, vals)]
    if horizontal:
        ax.set_xlabel(f"time per step ({unit})")
        ax.invert_yaxis()
    else:
        ax.set_ylabel(f"time per step ({unit})")
        if len(configs) > 3:
            for lab in ax.get_xticklabels():
                lab.set_rotation(20)
                lab.set_ha("right")
    ax.set_title(title)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    plots.label_source(ax, source)
    return ax


# -- the breakdown recorded on a GPU ---------------------------------------------------------------------


@dataclass
class ReferenceAnatomy:
    """A baseline-step breakdown recorded on a GPU, per bar label: phase -> s per step, step time, span trace."""

    phases: dict[str, dict[str, float]]
    step_time: dict[str, float]
    traces: dict[str, Any]


def anatomy_from_records(rs: ResultSet, records: list[Record]) -> ReferenceAnatomy | None:
    """``ch01.step.phase_time`` records made on a GPU; else None."""
    if not rs.hardware.get("gpu_name"):
        return None
    phases: dict[str, dict[str, float]] = {}
    steps: dict[str, float] = {}
    traces: dict[str, Any] = {}
    order = {name: i for i, name in enumerate(PHASES)}
    for r in sorted(records, key=lambda r: order.get(str(r.params.get("phase")), 99)):  # phases in step order
        at = {k: r.params.get(k) for k in ("width", "batch_size", "crop_size")}
        label = f"width {at['width']}, batch {at['batch_size']}, {at['crop_size']} px"
        phases.setdefault(label, {})[str(r.params.get("phase"))] = r.value
        if match := rs.find("ch01.step.step_time", **at):
            steps[label] = match[0].value
        if (art := rs.artifacts.get(f"ch01.timeline.width{at['width']}")) is not None:
            traces[label] = art
    return ReferenceAnatomy(phases=phases, step_time=steps, traces=traces)


def reference_anatomy(note: str = "") -> Evidence[ReferenceAnatomy]:
    what = "the baseline step's phases on a GPU"
    return evidence.recorded(what, "ch01.step.phase_time", convert=anatomy_from_records, note=note)


def plot_reference_anatomy(ref: Evidence[ReferenceAnatomy]) -> None:
    """The recorded breakdown as stacked phase bars, and the first recorded timeline."""
    r = ref.value
    if r is None:
        return
    ax = plots.new_axes((8, 0.9 + 0.5 * len(r.phases)))
    title = "Baseline step by phase on a GPU (recorded elsewhere, not this machine)"
    stacked_phases(r.phases, ax, horizontal=True, unit="ms", source=ref.source, title=title)
    for label, tr in list(r.traces.items())[:1]:
        ax = plots.new_axes((9, 2.4))
        plots.timeline(tr, ax, max_steps=4, source=ref.source, title=f"Recorded timeline on a GPU: {label}")


# -- section 5: the prediction against the measured steps ------------------------------------------------

_WHY = (
    "it is what the loop pays. The prediction adds phase means and leaves out what "
    "runs between the phases (the loop's own Python, the hooks that mark them, a progress update)"
)
_TRUST_GPU = ", and it assumes data overlaps compute by exactly one step."


def _against_steps(pred: Prediction, step_times_s: Sequence[float], cuda: bool) -> tuple[str, float, bool, str]:
    """The naive loop's prediction on this device: (its name, seconds, inside the steps' range, where)."""
    name, value = ("copy + max(data, compute)", pred.one_step_overlap) if cuda else ("sum", pred.serial)
    inside = agreement.within_range(value, step_times_s)
    where = "within" if inside else ("below" if value < min(step_times_s) else "above")
    return name, value, inside, where


def _span_ms(step_times_s: Sequence[float]) -> str:
    return f"{min(step_times_s) * 1e3:.2f}-{max(step_times_s) * 1e3:.2f} ms"


def _verdict(text: str, agree: bool, miss: str, cuda: bool, width: int) -> str:
    text += "they agree within their spread." if agree else f"{miss}{_WHY}{_TRUST_GPU if cuda else '.'}"
    return textwrap.fill(text, width, break_long_words=False, break_on_hyphens=False)


def step_verdict(
    pred: Prediction, step_times_s: Sequence[float], *, device: torch.device | str, width: int = 100
) -> str:
    """Whether the prediction for this device's naive loop (a CPU: the sum of the phases; a GPU: copy + max(data,
    compute)) lies within the measured steps' range; if not, trust the measured step."""
    cuda = torch.device(device).type == "cuda"
    name, value, inside, where = _against_steps(pred, step_times_s, cuda)
    loop = "a GPU pays copy + max(data, compute)" if cuda else "a CPU pays the sum of the phases"
    text = (
        f"Prediction vs measurement: the naive loop on {loop}, {value * 1e3:.2f} ms, which lies {where} the range "
        f"of the {len(step_times_s)} measured steps ({_span_ms(step_times_s)}): "
    )
    return _verdict(text, inside, "they do NOT agree within their spread. Trust the measured step: ", cuda, width)


def regimes_verdict(
    runs: Mapping[str, tuple[Prediction, Sequence[float]]], *, device: torch.device | str, width: int = 100
) -> str:
    """:func:`step_verdict` for each row of section 5's table (label -> (prediction, step times)), in one sentence."""
    if not runs:
        raise ValueError("regimes_verdict needs at least one (prediction, step times) row")
    cuda = torch.device(device).type == "cuda"
    parts, agree = [], True
    for label, (pred, times) in runs.items():
        name, value, inside, where = _against_steps(pred, times, cuda)
        parts.append(
            f"{label}: {'agree' if inside else 'do NOT agree'} ({value * 1e3:.2f} ms {where} {_span_ms(times)})"
        )
        agree = agree and inside
    text = f"Each row's prediction ({name}) against the range of that model's measured steps: {'; '.join(parts)}"
    return _verdict(
        text + (": " if agree else ""), agree, ". Where they do NOT agree, trust the measured step: ", cuda, width
    )
