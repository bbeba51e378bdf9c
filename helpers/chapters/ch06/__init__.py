"""Chapter 06, the capstone: the chapter interface (:mod:`helpers.ui.chapter`). The panel runs the job once through
the reader's functions with the steps the reader ticks; the benchmark records both regimes' waterfalls."""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ...core import evidence
from ...core.device import resolve_device
from ...core.evidence import Evidence
from ...core.progress import ProgressFn, no_progress, scaled
from ...core.results import ResultSet
from ...core.validate import check_choice
from . import capstone
from .calibration import calibrate
from .job import REGIMES, STEP_NAMES, STEP_REQUIRES, STEPS, JobSpec, Pipeline, job_spec, settings_for
from .run import ConfigResult, run_config

__all__ = [
    "NUMBER", "TITLE", "BENCH_WEIGHT", "PANEL_TITLE", "benchmark", "panel_controls", "panel_run", "panel_summary",
    "panel_plot",
]  # fmt: skip

NUMBER = "06"
TITLE = "capstone pipeline"
BENCH_WEIGHT = 2.5
PANEL_TITLE = "Stack the steps yourself"

#: How a panel run is measured (the Evidence's method).
METHOD = "one timed epoch after warm-up, through the pipeline's functions; stages alone for the efficiency"


def panel_controls(**context: Any) -> dict[str, Any]:
    """A regime toggle and a checkbox per step after the baseline; ticking a step ticks the steps it needs,
    unticking one unticks the steps that need it (:data:`~.job.STEP_REQUIRES`)."""
    from ...ui.widgets import W  # optional/heavy: ipywidgets

    controls: dict[str, Any] = {
        "regime": W.ToggleButtons(options=list(REGIMES), value="data-bound", description="regime"),
    }

    def tick(name: str, change: dict[str, Any]) -> None:
        if change.get("new"):
            for need in STEP_REQUIRES.get(name, ()):
                controls[need].value = True
        else:
            for other in (o for o, needs in STEP_REQUIRES.items() if name in needs):
                controls[other].value = False

    for step in STEPS[1:]:
        controls[step.name] = W.Checkbox(value=False, description=step.label, indent=False)
        controls[step.name].observe(functools.partial(tick, step.name), names="value")
    return controls


def panel_run(
    progress: ProgressFn | None,
    *,
    device: torch.device | str,
    regime: str = "data-bound",
    specs: Mapping[str, JobSpec] | None = None,
    pipeline: Pipeline | None = None,
    **toggles: bool,
) -> Evidence[ConfigResult]:
    """Run the job once in ``regime`` with the steps whose toggles (keyword per step name) are True, through
    ``pipeline`` (default the take-home one), with ``specs[regime]`` (default :func:`~.job.job_spec`)."""
    check_choice("regime", regime, tuple(REGIMES))
    for k, v in toggles.items():
        check_choice("step", k, STEP_NAMES)
        if not isinstance(v, bool):  # "yes", 1, None: a toggle is on or off, nothing else
            raise ValueError(f"{k} must be True or False (tick the box or not), got {v!r}")
    enabled = [k for k, v in toggles.items() if v and k != "baseline"]
    s = settings_for(enabled)
    name = "+".join(enabled) if enabled else "baseline"
    spec = (specs or {}).get(regime)
    if spec is not None and spec.regime != regime:
        raise ValueError(f"specs[{regime!r}] is for the {spec.regime!r} regime; pass each regime's own spec")
    dev = resolve_device(device)
    result = run_config(s, spec or job_spec(regime), dev, name=name, label=name, stages=True,
                                 progress=progress, pipeline=pipeline)  # fmt: skip
    return evidence.measured(f"the {regime} job, {name}", result, dev, method=METHOD)


def panel_summary(result: Evidence[ConfigResult]) -> str:
    """'data-bound, workers: 1.23 s/epoch, ... accuracy 40.0% — [measured here] ...'."""
    r = result.value
    if r is None:
        return result.header()
    eff = str(r.efficiency) if r.efficiency is not None else "n/a"
    return (
        f"{r.spec.regime}, {r.label}: {r.epoch_s:.2f} s/epoch, {r.throughput:.0f} img/s, compute busy "
        f"{r.compute_busy:.0%}, data stall {r.data_stall:.0%}, efficiency {eff}, accuracy {r.accuracy:.1%}"
        f" — {result.header()}"
    )


def panel_plot(history: Sequence[Any], ax: Any) -> None:
    """Epoch time of every panel run so far (bars), labelled with where it was measured."""
    from ...ui.plots import history_bars  # optional/heavy: matplotlib

    runs = [h for h in history if h.result.value is not None]
    labels = [f"#{h.index} {h.result.value.spec.regime[:4]} {h.result.value.label}"[:40] for h in runs]
    where = runs[-1].result.source.split(",")[0] if runs else "measured now"
    history_bars(labels, [h.result.value.epoch_s for h in runs], ax, ylabel="time per epoch (s)",
                 title=f"Panel runs ({where})")  # fmt: skip


def benchmark(results: ResultSet, device: torch.device | str | None, *, progress: ProgressFn | None = None) -> None:
    """Both regimes' waterfalls on ``device`` (``None``: CUDA when present) through the take-home pipeline, only
    the steps that can act there. Records, per configuration (params ``regime``, ``stage``, ``label``, ``order``,
    ...): ``ch06.waterfall.step_time``, ``.epoch_time``, ``.throughput``, ``.speedup``, ``.accuracy``,
    ``.compute_busy``, ``.data_stall``, ``.efficiency`` (the ratio), ``.stage_alone`` (``part``);
    ``ch06.calibration.compute_over_loader``; artifacts ``ch06.trace.<regime>.<stage>`` (span traces)."""
    progress = progress or no_progress
    dev = resolve_device(device)
    cal = calibrate(dev, progress=scaled(progress, 0.0, 0.1, "calibrating: "))
    regimes = list(REGIMES)
    for k, regime in enumerate(regimes):
        spec = job_spec(regime, width=cal[regime].width, depth=cal[regime].depth)
        part = scaled(progress, 0.1 + 0.9 * k / len(regimes), 0.1 + 0.9 * (k + 1) / len(regimes))
        wf = capstone.run_waterfall(regime, dev, spec=spec, calibration=cal[regime], progress=part)
        results.add("ch06.calibration.compute_over_loader", cal[regime].ratio, "ratio", regime=regime,
                    width=spec.width, depth=spec.depth, reached=cal[regime].reached, device=str(dev))  # fmt: skip
        _record(results, wf, str(dev))
    progress(1.0, "done")


def _record(results: ResultSet, wf: capstone.Waterfall, dev: str) -> None:
    """One waterfall's records and traces (see :func:`benchmark`)."""
    for i, (r, sp) in enumerate(zip(wf.results, wf.speedups())):
        p: dict[str, Any] = dict(regime=wf.regime, stage=r.name, label=r.label, order=i, width=wf.spec.width,
                                 depth=wf.spec.depth, steps=r.steps, batch_size=wf.spec.batch_size,
                                 rounds=wf.rounds, device=dev)  # fmt: skip
        values = {"waterfall.step_time": (r.step_s, "s"), "epoch_time": (r.epoch_s, "s"),
                  "throughput": (r.throughput, "items/s"), "speedup": (sp, "ratio"), "accuracy": (r.accuracy, "ratio"),
                  "compute_busy": (r.compute_busy, "ratio"), "data_stall": (r.data_stall, "ratio")}  # fmt: skip
        for key, (value, unit) in values.items():
            results.add(f"ch06.{key}", value, unit, **p)
        if r.efficiency is not None:
            results.add("ch06.efficiency", r.efficiency.ratio, "ratio", **p)
        for stage_part, v in r.stages.items():
            if v is not None:
                results.add("ch06.stage_alone", v, "items/s", part=stage_part, **p)
        results.artifacts[f"ch06.trace.{wf.regime}.{r.name}"] = r.trace.to_dict()
