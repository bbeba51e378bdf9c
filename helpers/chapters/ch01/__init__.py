"""Chapter 01 · The baseline pipeline: its live panel, its benchmark and its recorded GPU breakdown.

The measuring is in :mod:`helpers.pipeline.train` (:func:`~helpers.chapters.ch01.anatomy.record_steps` times the
reader's own functions phase by phase, :func:`~helpers.chapters.ch01.anatomy.step_anatomy` runs a few steps of a
fresh model); this module puts it together for the one chapter interface (:mod:`helpers.ui.chapter`):

- the live panel trains a fresh model for a few steps of the reader's pipeline at the batch size, image
  size and model width the reader picks, and plots every run so far as stacked phase bars;
- :func:`benchmark` records the anatomy of a baseline step (keys ``ch01.*``), headless;
- :func:`reference_anatomy` is the breakdown such a benchmark recorded on a GPU, for a machine without one;
- :func:`step_verdict` and :func:`regimes_verdict` say whether the bottleneck model's prediction for the naive
  loop agrees with the measured steps (section 5), and which to trust when it does not.

>>> panel = widgets.Panel.for_chapter(ch01, device=DEVICE, **PIPELINE,
...                                   defaults=dict(batch_size=BATCH_SIZE, crop_size=CROP, width=WIDTH))

``PIPELINE`` is the reader's ``make_loader``, ``to_device`` and ``train_step``; ``defaults`` the controls'
starting values.
"""

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
from ...core.validate import check_int
from ...pipeline.data import default_sizes
from ...pipeline.train import Prediction
from ...ui import plots
from .anatomy import PHASES, Anatomy, StepFn, ToDevice, step_anatomy

__all__ = [
    "NUMBER",
    "TITLE",
    "BENCH_WEIGHT",
    "PANEL_TITLE",
    "PANEL_FIGSIZE",
    "BENCH_WIDTHS",
    "benchmark",
    "panel_controls",
    "panel_run",
    "panel_summary",
    "panel_plot",
    "ReferenceAnatomy",
    "anatomy_from_records",
    "reference_anatomy",
    "plot_reference_anatomy",
    "step_verdict",
    "regimes_verdict",
]

NUMBER = "01"
TITLE = "anatomy of a training step"
BENCH_WEIGHT = 1.0
PANEL_TITLE = "Anatomy of a baseline step"
PANEL_FIGSIZE = (9.0, 3.4)

#: Method line of a panel run's Evidence.
METHOD = "anatomy.record_steps over your pipeline: host clock for load/collate, CUDA events for GPU phases"

#: Model widths the benchmark measures: the baseline model, and a 4x wider one (about 14x the compute).
BENCH_WIDTHS: tuple[int, ...] = (16, 64)


# ---------------------------------------------------------------------------
# The headless benchmark
# ---------------------------------------------------------------------------


def benchmark(
    results: ResultSet,
    device: torch.device | str | None,
    *,
    progress: ProgressFn | None = None,
    widths: Iterable[int] = BENCH_WIDTHS,
    steps: int | None = None,
    warmup: int = 3,
) -> None:
    """Record chapter 01's measurement, the anatomy of a baseline step, into ``results``.

    The baseline: ``num_workers=0``, pageable memory, blocking ``x.to(device)``,
    float batches, the default data set and sizes of the current mode
    (:func:`helpers.pipeline.data.default_sizes`), one run per model width. It runs headless, so it has
    no reader's cells to time: :func:`helpers.chapters.ch01.anatomy.step_anatomy` with its defaults runs chapter 01's
    pipeline (:func:`helpers.chapters.ch01.anatomy.baseline_train_step`, the same lines as the chapter's
    ``train_step``) through :func:`helpers.chapters.ch01.anatomy.record_steps`, the helper that times the reader's
    functions in the chapter.

    Records (key: unit; params ``batch_size``, ``crop_size``, ``width``, ``depth``,
    ``num_workers``, ``steps``; ``phase_time`` also has ``phase``):

    - ``ch01.step.phase_time``: s per step, one record per phase (load, collate,
      h2d, forward, backward, optimizer).
    - ``ch01.step.step_time``: s per step, measured (wall time of the timed steps / steps).
    - ``ch01.step.predicted_serial``: s, sum of the phases (the bottleneck model, no overlap).
    - ``ch01.step.predicted_overlapped``: s, slowest stage (the bottleneck model, perfect overlap).
    - ``ch01.step.samples_per_s``: items/s.
    - ``ch01.step.gflop_per_step``: GFLOP (forward + backward, estimated), the compute per step.

    Artifacts: ``ch01.timeline.width<W>`` (:meth:`SpanTrace.to_dict`) for each width.

    On the CPU it measures too (the h2d phase is then a no-op). ``progress(fraction, text)`` is told
    after every step.
    """
    dev = resolve_device(device)
    report = progress or no_progress
    sizes = default_sizes()
    n_steps = check_int("steps", steps, 1, 1000) if steps is not None else sized(6, 20)
    widths = [int(w) for w in widths]
    for i, width in enumerate(widths):
        a = step_anatomy(
            batch_size=sizes["batch_size"],
            crop_size=sizes["crop_size"],
            width=width,
            depth=3,
            steps=n_steps,
            warmup=warmup,
            device=dev,
            progress=scaled(report, i / len(widths), (i + 1) / len(widths)),
        )
        p: dict[str, Any] = {
            "batch_size": sizes["batch_size"],
            "crop_size": sizes["crop_size"],
            "width": width,
            "depth": 3,
            "num_workers": 0,
            "steps": n_steps,
        }
        for phase, t in a.phase_means.items():
            results.add("ch01.step.phase_time", t, "s", phase=phase, **p)
        results.add("ch01.step.step_time", a.step_time, "s", **p)
        results.add("ch01.step.predicted_serial", a.prediction.serial, "s", **p)
        results.add("ch01.step.predicted_overlapped", a.prediction.overlapped, "s", **p)
        results.add("ch01.step.samples_per_s", a.samples_per_s, "items/s", **p)
        results.add("ch01.step.gflop_per_step", a.gflop_per_step, "GFLOP", **p)
        trace = a.trace.to_dict()
        trace["metadata"]["label"] = f"baseline step, width {width}, batch {sizes['batch_size']}"
        results.artifacts[f"ch01.timeline.width{width}"] = trace
    report(1.0, "done")


# ---------------------------------------------------------------------------
# The live panel
# ---------------------------------------------------------------------------


def _options(values: list[int], default: int) -> list[int]:
    """``values`` with ``default`` added (a reader's setting the list lacks stays selectable)."""
    return sorted(set(values) | {default})


def panel_controls(**context: Any) -> dict[str, Any]:
    """Batch size, image size (the crop the model sees) and model width.

    ``context["defaults"]`` (optional) sets their starting values: ``batch_size``, ``crop_size``, ``width``
    (default: :func:`helpers.pipeline.data.default_sizes` and width 16).
    """
    sizes = default_sizes()
    start = {"batch_size": sizes["batch_size"], "crop_size": sizes["crop_size"], "width": 16}
    start.update(context.get("defaults") or {})
    crops = sized(quick=[32, 48, 64, 96, 128], full=[96, 128, 160, 224, 256], laptop=[64, 80, 96, 112])
    return {
        "batch_size": W.Dropdown(
            options=_options([8, 16, 32, 64, 128], start["batch_size"]),
            value=start["batch_size"],
            description="batch size",
        ),
        "crop_size": W.Dropdown(
            options=_options(crops, start["crop_size"]), value=start["crop_size"], description="image size"
        ),
        "width": W.Dropdown(
            options=_options([4, 8, 16, 32, 64], start["width"]), value=start["width"], description="model width"
        ),
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
    """Run a few steps of a fresh model at the panel's settings: measured here, on any device.

    ``steps`` defaults to 4 in quick mode, 5 at the laptop tier and 10 in full mode, after one untimed step.
    ``make_loader``, ``to_device``, ``train_step``: the reader's pipeline functions (the notebook passes them
    to ``Panel.for_chapter``), timed by :func:`helpers.chapters.ch01.anatomy.record_steps`; without them, the
    baseline of :func:`helpers.chapters.ch01.anatomy.step_anatomy`. Other ``context`` (``defaults``) is not used here.
    """
    report = progress or no_progress
    report(0.1, "building data set, loader and model")
    dev = resolve_device(device)
    n = check_int("steps", steps, 1, 1000) if steps is not None else sized(quick=4, full=10, laptop=5)
    a = step_anatomy(
        batch_size=batch_size,
        crop_size=crop_size,
        width=width,
        depth=3,
        steps=n,
        warmup=1,
        device=dev,
        progress=scaled(report, 0.1, 1.0),
        make_loader=make_loader,
        to_device=to_device,
        train_step=train_step,
    )
    report(1.0, "done")
    what = f"a baseline step (batch {batch_size}, {crop_size} px, width {width}; {n} steps)"
    return evidence.measured(what, a, dev, method=METHOD)


def panel_summary(result: Evidence[Anatomy]) -> str:
    """One line: measured step time, the two predictions, the dominant phase and the bottleneck."""
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
    """Stacked phase bars of every panel run so far, with the measured step time as a black tick."""
    runs = [rec for rec in history if rec.result.value is not None]
    data = {_run_label(rec): rec.result.value.phase_means for rec in runs}
    devices = sorted({str(rec.result.value.settings.get("device", "?")) for rec in runs})
    plots.stacked_phases(
        data,
        ax,
        title=f"Baseline step by phase, one bar per run (measured now on {', '.join(devices) or 'this machine'})",
        unit="ms",
    )
    for i, rec in enumerate(runs):
        ax.plot(
            [i - 0.4, i + 0.4],
            [rec.result.value.step_time * 1e3] * 2,
            color="black",
            linewidth=2,
            label="measured step" if i == 0 else None,
        )
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)


# ---------------------------------------------------------------------------
# The breakdown recorded on a GPU
# ---------------------------------------------------------------------------


@dataclass
class ReferenceAnatomy:
    """A baseline-step breakdown recorded by :func:`benchmark` on a real GPU.

    Attributes:
        phases: bar label (e.g. ``"width 16, batch 64, 224 px"``) -> phase -> seconds per step.
        step_time: same labels -> measured seconds per step.
        traces: same labels -> span trace (``SpanTrace.to_dict()`` form), when recorded.
    """

    phases: dict[str, dict[str, float]]
    step_time: dict[str, float]
    traces: dict[str, Any]


def anatomy_from_records(rs: ResultSet, records: list[Record]) -> ReferenceAnatomy | None:
    """``ch01.step.phase_time`` records of one result set as a :class:`ReferenceAnatomy` (an evidence ``convert``).

    Only a result set recorded on a CUDA GPU counts: None otherwise, which
    :func:`helpers.core.evidence.recorded` reads as missing.
    """
    if not rs.hardware.get("gpu_name"):
        return None
    phases: dict[str, dict[str, float]] = {}
    steps: dict[str, float] = {}
    traces: dict[str, Any] = {}
    for r in records:
        p = r.params
        label = f"width {p.get('width')}, batch {p.get('batch_size')}, {p.get('crop_size')} px"
        phases.setdefault(label, {})[str(p.get("phase"))] = r.value
        if label not in steps:
            match = rs.find(
                "ch01.step.step_time",
                width=p.get("width"),
                batch_size=p.get("batch_size"),
                crop_size=p.get("crop_size"),
            )
            if match:
                steps[label] = match[0].value
            art = rs.artifacts.get(f"ch01.timeline.width{p.get('width')}")
            if art is not None:
                traces[label] = art
    order = {name: i for i, name in enumerate(PHASES)}
    phases = {k: dict(sorted(v.items(), key=lambda kv: order.get(kv[0], 99))) for k, v in phases.items()}
    return ReferenceAnatomy(phases=phases, step_time=steps, traces=traces)


def reference_anatomy(note: str = "") -> Evidence[ReferenceAnatomy]:
    """The newest breakdown of a baseline step recorded on a GPU (``ch01.step.phase_time``), or missing.

    Nothing is ever made up: no reference file recorded on a CUDA GPU, no figure. ``note`` is shown
    before it (e.g. the no-CUDA sentence).
    """
    return evidence.recorded(
        "the baseline step's phases on a GPU", "ch01.step.phase_time", convert=anatomy_from_records, note=note
    )


def plot_reference_anatomy(ref: Evidence[ReferenceAnatomy]) -> None:
    """The recorded breakdown as stacked phase bars, and the first recorded timeline, labelled with its source."""
    r = ref.value
    if r is None:
        return
    ax = plots.new_axes((8, 0.9 + 0.5 * len(r.phases)))
    plots.stacked_phases(
        r.phases,
        ax,
        horizontal=True,
        unit="ms",
        source=ref.source,
        title="Baseline step by phase on a GPU (recorded elsewhere, not this machine)",
    )
    for label, tr in list(r.traces.items())[:1]:
        ax = plots.new_axes((9, 2.4))
        plots.timeline(tr, ax, max_steps=4, source=ref.source, title=f"Recorded timeline on a GPU: {label}")


# ---------------------------------------------------------------------------
# Section 5: the prediction against the measured steps
# ---------------------------------------------------------------------------

_WHY = (
    "it is what the loop pays. The prediction adds phase means and leaves out what "
    "runs between the phases (the loop's own Python, the hooks that mark them, a progress update)"
)
_TRUST_GPU = ", and it assumes data overlaps compute by exactly one step."


def _against_steps(pred: Prediction, step_times_s: Sequence[float], cuda: bool) -> tuple[str, float, bool, str]:
    """The naive loop's prediction on this device, and where it lies against the measured steps' range.

    Returns (what is predicted, the prediction in seconds, whether it lies within the range
    (:func:`helpers.core.agreement.within_range`), "within" / "below" / "above").
    """
    name, value = ("copy + max(data, compute)", pred.one_step_overlap) if cuda else ("sum", pred.serial)
    inside = agreement.within_range(value, step_times_s)
    where = "within" if inside else ("below" if value < min(step_times_s) else "above")
    return name, value, inside, where


def _span_ms(step_times_s: Sequence[float]) -> str:
    return f"{min(step_times_s) * 1e3:.2f}-{max(step_times_s) * 1e3:.2f} ms"


def step_verdict(
    pred: Prediction, step_times_s: Sequence[float], *, device: torch.device | str, width: int = 100
) -> str:
    """Whether the bottleneck model's prediction for the naive loop agrees with the measured steps.

    The prediction for this device's naive loop (on a CPU the sum of the phases, on a GPU copy + max(data,
    compute), :attr:`helpers.pipeline.train.Prediction.one_step_overlap`) has no spread of its own; it
    agrees when it lies within the range of the measured steps' wall times (``step_times_s``, from
    :func:`helpers.chapters.ch01.anatomy.step_times`; :func:`helpers.core.agreement.within_range`). When it does
    not, the measured step is the one to trust: the prediction leaves out what runs between the phases
    (and on a GPU assumes one step of overlap). Wrapped at ``width`` characters.

    Raises:
        ValueError: no step times, or one that is not a finite number.
    """
    cuda = torch.device(device).type == "cuda"
    name, value, inside, where = _against_steps(pred, step_times_s, cuda)
    loop = "a GPU pays copy + max(data, compute)" if cuda else "a CPU pays the sum of the phases"
    text = (
        f"Prediction vs measurement: the naive loop on {loop}, {value * 1e3:.2f} ms, which lies {where} the range "
        f"of the {len(step_times_s)} measured steps ({_span_ms(step_times_s)}): "
    )
    if inside:
        text += "they agree within their spread."
    else:
        text += f"they do NOT agree within their spread. Trust the measured step: {_WHY}{_TRUST_GPU if cuda else '.'}"
    return textwrap.fill(text, width, break_long_words=False, break_on_hyphens=False)


def regimes_verdict(
    runs: Mapping[str, tuple[Prediction, Sequence[float]]], *, device: torch.device | str, width: int = 100
) -> str:
    """:func:`step_verdict` for each row of section 5's table (label -> (prediction, step times)), in one sentence.

    Raises:
        ValueError: no rows, or a row with no step times.
    """
    if not runs:
        raise ValueError("regimes_verdict needs at least one (prediction, step times) row")
    cuda = torch.device(device).type == "cuda"
    parts, agree = [], True
    for label, (pred, times) in runs.items():
        name, value, inside, where = _against_steps(pred, times, cuda)
        word = "agree" if inside else "do NOT agree"
        parts.append(f"{label}: {word} ({value * 1e3:.2f} ms {where} {_span_ms(times)})")
        agree = agree and inside
    text = f"Each row's prediction ({name}) against the range of that model's measured steps: {'; '.join(parts)}"
    if agree:
        text += ": they agree within their spread."
    else:
        text += f". Where they do NOT agree, trust the measured step: {_WHY}{_TRUST_GPU if cuda else '.'}"
    return textwrap.fill(text, width, break_long_words=False, break_on_hyphens=False)
