"""Chapter 06, the capstone: the reader's pipeline timed one step at a time (the waterfall), its verdicts on speed
and accuracy, and its plots. Each step's gain is the median of per-round ratios between neighbours run back to back
(:func:`helpers.core.rounds.alternate`); without CUDA only the steps that can act run, the others are 'needs CUDA'.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import statistics
import textwrap
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from ...core import agreement, evidence
from ...core.config import sized
from ...core.evidence import Evidence, no_published_sentence
from ...core.progress import scaled
from ...core.rounds import alternate, table
from ...core.validate import check_choice, check_float, check_int
from .calibration import Calibration
from .doctor import Diagnosis, MeasuredStep, usable_cores
from .job import (
    REGIMES,
    STEP_NAMES,
    STEPS,
    JobSpec,
    Pipeline,
    Settings,
    Step,
    _pipeline,
    configurations,
    effective_on,
    job_spec,
)
from .run import EFFICIENCY_NOISE, ConfigResult, Efficiency, pipeline_efficiency, run_config

#: The largest run-to-run variation (:meth:`Waterfall.noise_floor`) under which a step within noise can be
#: called 'no effect' rather than 'within noise': a noisier run cannot rule out a change of that size.
NO_EFFECT_FLOOR = 0.10

#: Every verdict :meth:`Waterfall.verdicts` gives a step (the baseline gets '').
VERDICTS: tuple[str, ...] = ("gain", "slower", "no effect", "within noise", "one round", "needs CUDA")

_STEPS = {st.name: st for st in STEPS}


@dataclass
class Waterfall:
    """One regime's configurations in stacking order (each from the first round, ``epoch_s`` the median over
    rounds); ``not_measured``: the steps left out because they need CUDA."""

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

    def speedups(self) -> list[float]:  # over the baseline
        return [self.baseline.epoch_s / r.epoch_s for r in self.results]

    def _round_gains(self) -> list[list[float]]:  # per step after the baseline: its per-round gains
        times = [r.round_epoch_s or [r.epoch_s] for r in self.results]
        return [[x / y for x, y in zip(a, b)] for a, b in zip(times, times[1:])]

    def gains(self) -> list[float]:
        """Speedup over the configuration before (1.0 first): the median of per-round ratios."""
        return [1.0] + [statistics.median(g) for g in self._round_gains()]

    def gain_ranges(self) -> list[tuple[float, float] | None]:
        """(lowest, highest) per-round gain over the configuration before; None with one round."""
        return [None] + [(min(g), max(g)) if len(g) > 1 else None for g in self._round_gains()]

    def noise_floor(self) -> float | None:
        """Median over configurations of (slowest - fastest) / median round; ``None`` with one round."""
        spreads = [
            (max(r.round_epoch_s) - min(r.round_epoch_s)) / statistics.median(r.round_epoch_s)
            for r in self.results
            if len(r.round_epoch_s) > 1
        ]
        return statistics.median(spreads) if spreads else None

    def ratio_noise(self) -> float | None:
        """The scatter of the per-round gains (a slower round slows both neighbours and leaves their ratio)."""
        return agreement.ratio_noise(self._round_gains())

    def no_effect(self) -> list[bool]:
        return [
            i > 0 and r.name in _STEPS and not effective_on(_STEPS[r.name], self.device)
            for i, r in enumerate(self.results)
        ]

    def best_steps(self) -> list[str]:
        """The step with the largest gain over its predecessor (among steps that can act here), then every other
        step that can act whose gain range overlaps the best one's."""
        g, idle, ranges = self.gains(), self.no_effect(), self.gain_ranges()
        cands = [i for i in range(1, len(g)) if not idle[i]] or list(range(1, len(g)))
        b = max(cands, key=g.__getitem__, default=0)
        top = ranges[b]
        return [self.results[b].name] + [
            r.name
            for i, r in enumerate(self.results[1:], 1)
            if i != b and top is not None and not idle[i] and (rng := ranges[i]) is not None and rng[1] >= top[0]
        ]

    def best_step(self) -> str:
        return self.best_steps()[0]

    def verdicts(self) -> list[str]:
        """Per configuration, one of :data:`VERDICTS` ('' for the baseline); :meth:`_notes` says what each means."""
        floor, noise, out = self.noise_floor() or 0.0, self.ratio_noise() or 0.0, [""]
        for g, ratios, idle in zip(self.gains()[1:], self._round_gains(), self.no_effect()[1:]):
            if idle:
                out.append("needs CUDA")
            elif len(ratios) < 2:
                out.append("one round")
            elif not (agreement.ratios_split_on_direction(ratios) or agreement.within_noise_floor(g, noise)):
                out.append("gain" if g > 1 else "slower")
            else:
                quiet = floor <= NO_EFFECT_FLOOR and 1 - floor <= min(ratios) <= 1.0 <= max(ratios) <= 1 + floor
                out.append("no effect" if quiet else "within noise")
        return out

    def step_verdicts(self) -> dict[str, str]:
        """Step name -> verdict, the steps left out included: what the doctor takes as ``measured``."""
        out = {r.name: v for r, v in zip(self.results[1:], self.verdicts()[1:])}
        out.update(dict.fromkeys(self.not_measured, "needs CUDA"))
        return out

    def measured_steps(self) -> dict[str, MeasuredStep]:
        """Step name -> seconds per step at the baseline and in the configuration with that step (and those before
        it): what the doctor takes as ``measured_steps``, to show beside its estimates."""
        base = self.baseline.step_s
        return {r.name: MeasuredStep(r.label, base, r.step_s) for r in self.results[1:]}

    def table(self) -> str:
        """A row per configuration, the notes, the steps left out (lines <= 110 characters)."""

        def num(v: float) -> str:  # three significant digits from x10 on: the column keeps its width
            return f"{v:.2f}" if v < 9.995 else f"{v:.1f}"

        rows = [["configuration", "epoch", "speedup", "step gain", "", "busy", "stall", "efficiency", "accuracy"]]
        for r, s, g, rng, v, idle in zip(self.results, self.speedups(), self.gains(), self.gain_ranges(),
                                         self.verdicts(), self.no_effect()):  # fmt: skip
            band = f" ({num(rng[0])}-{num(rng[1])})" if rng else ""
            gain = "" if r is self.results[0] or idle else f"x{num(g)}{band}"
            eff = r.efficiency.short() if r.efficiency is not None else "n/a"  # a step that cannot act: no ratio
            rows.append([r.label, f"{r.epoch_s:.2f}s", f"{s:.2f}x", gain, v, f"{r.compute_busy:.0%}",
                         f"{r.data_stall:.0%}", eff, f"{r.accuracy:.1%}"])  # fmt: skip
        lines = table(["", "", "", "", "", "compute", "data", "", ""], rows, gap=1)
        for note in self._notes():  # a verdict of two words ('within noise') stays on one line
            for v in VERDICTS:
                note = note.replace(f"'{v}'", f"'{v}'".replace(" ", "\0"))
            lines += [ln.replace("\0", " ") for ln in textwrap.wrap(note, 105, break_on_hyphens=False)]
        return "\n".join(lines + self.cuda_lines())

    def _notes(self) -> list[str]:
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
            "on this device: no ratio",
            "efficiency: the configuration's throughput over its own slowest stage alone, so a step that speeds "
            "up a stage alone (persistent workers make the loader alone faster) can lower it while the epoch "
            "gets faster: compare epochs for speed, efficiency for how much of the slowest stage is used",
        ]
        if any(r.efficiency is not None and r.efficiency.verdict for r in self.results):
            notes.append(
                "efficiency: never above 1 (a pipeline cannot beat its slowest stage alone); '(noise)': "
                "measured above 1 within the noise, shown as 1.00, at the bottleneck; 'out of range': measured "
                "further above 1, so the stages-alone figures were taken under other conditions (no value)"
            )
        return notes

    def cuda_lines(self) -> list[str]:
        out: list[str] = []

        def wrap(text: str) -> list[str]:
            return textwrap.wrap(text, 105, initial_indent="    ", subsequent_indent="      ",
                                 break_on_hyphens=False, break_long_words=False)  # fmt: skip

        for st in (_STEPS[name] for name in self.not_measured):
            dev = torch.device(self.device).type
            out.append(f"{st.label:<28}needs CUDA: not measured on {dev} (no ratio); chapter {st.chapter}")
            cited = evidence.published_elsewhere(f"the '{st.label}' step", st.published_key).cited
            for fig in cited:
                out += wrap(f"published: {fig.what}: {fig.compared} (GPU: {fig.gpu}; {fig.url})")
            if not cited:
                out += wrap(
                    no_published_sentence(st.published_key) or "No published figure of this experiment was found."
                )
        return out

    def expectations(self) -> list[str]:
        """The steps expected within noise here: one that needs CUDA, or, compute-bound, a loading step (pinning,
        uint8, the prefetcher) that has little left to remove once loading hides behind the step."""
        cal, out = self.calibration, []
        hidden = self.regime == "compute-bound" and cal is not None and cal.reached
        for r, v, g, idle in zip(self.results[1:], self.verdicts()[1:], self.gains()[1:], self.no_effect()[1:]):
            if idle:
                why = "needs CUDA: no effect on this device"
                v = f"run anyway: x{g:.2f} is this run's noise, not the step's effect"
            elif hidden and cal is not None and r.name in ("uint8", "prefetcher", "pinned"):
                why = f"compute-bound: the step takes {cal.ratio:.1f}x the loader's batch, so loading is already "
                why += "hidden behind it (or, before workers, this step does not shorten it)"
                v = f"measured: {v}"
            else:
                continue
            out.append(f"{r.label}: expected within noise ({why}); {v}")
        return out


def _measured_configs(
    device: torch.device | str, workers: int | None, names: Sequence[str] | None, cuda_steps: bool | None
) -> tuple[list[tuple[Step, Settings]], list[str]]:
    """The configurations to run (cumulative over the steps run here), and the steps left out (they need CUDA)."""
    dev_type = torch.device(device).type
    run_all = cuda_steps if cuda_steps is not None else dev_type == "cuda"
    idle = set() if run_all else {st.name for st in STEPS if not effective_on(st, device)}
    kept = configurations(workers, names, skip=idle)
    skipped = [n for n in STEP_NAMES if n in idle and (names is None or n in names)]
    if not kept:
        raise ValueError(f"names: none of {', '.join(skipped)} can act on {dev_type} (they need CUDA); "
                         "name a step that can, e.g. 'baseline' or 'workers'")  # fmt: skip
    return kept, skipped


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
    pipeline: Pipeline | None = None,
    cuda_steps: bool | None = None,
) -> Waterfall:
    """Run one regime's cumulative configurations through ``pipeline`` in alternating rounds (default 1 quick, 5
    laptop, 2 full), only the steps that can act on ``device`` (``cuda_steps=True``: all); stages alone in the
    first round; with several rounds an untimed run first."""
    spec = spec or job_spec(regime)
    pipe = _pipeline(pipeline, device, spec.seed)
    n_rounds = check_int("rounds", rounds if rounds is not None else sized(quick=1, laptop=5, full=2), 1, 100)
    configs, skipped = _measured_configs(device, workers, names, cuda_steps)
    warm = 1 / (n_rounds * len(configs) + 1) if n_rounds > 1 else 0.0
    if n_rounds > 1:  # one untimed run first: the first run of a job pays one-off costs (allocations, kernels)
        step, s = configs[0]
        run_config(s, spec, device, name=step.name, label=step.label, stages=False, pipeline=pipe,
                   progress=scaled(progress, 0.0, warm, f"{regime}, warm-up run: "))  # fmt: skip
    firsts: dict[str, ConfigResult] = {}

    def run(step: Step, s: Settings, progress: Callable[[float, str], None]) -> float:
        r = run_config(s, spec, device, name=step.name, label=step.label, progress=progress, pipeline=pipe,
                       stages=stages and step.name not in firsts)  # fmt: skip
        firsts.setdefault(step.name, r)
        return r.epoch_s

    times = alternate({st.label: functools.partial(run, st, s) for st, s in configs}, n_rounds,
                      progress=scaled(progress, warm, 1.0, f"{regime}, "))  # fmt: skip
    out = [
        dataclasses.replace(firsts[st.name], epoch_s=times.median(st.label), round_epoch_s=times.values[st.label])
        for st, _ in configs
    ]
    wf = Waterfall(regime, spec, str(torch.device(device)), out, n_rounds, calibration, skipped)
    noise = max(EFFICIENCY_NOISE, wf.noise_floor() or 0.0)  # this run's own spread, when larger
    for r in out:
        if r.stages:
            r.efficiency = pipeline_efficiency(r.throughput, r.stages, noise)
    if progress is not None:
        progress(1.0, f"{regime}: done")
    return wf


def compare_threads(
    wf: Waterfall, step: str = "persistent", threads: Sequence[int] | None = None, *, pipeline: Pipeline | None = None
) -> list[str]:
    """``wf``'s configuration ``step`` per main-process thread count (default: the job's and all usable cores), a line
    each saying what its figure is: the waterfall's own run at the job's count (a median of rounds with their range),
    else the same job run once more; then a verdict per other count (:func:`thread_verdict`)."""
    ran = {r.name: r for r in wf.results}
    if step not in ran:
        raise ValueError(f"step {step!r} was not measured in this waterfall; choose one of {', '.join(ran)}")
    out, others = [f"{wf.regime}, {_STEPS[step].label}:"], []
    for n in threads if threads is not None else sorted({wf.spec.threads, usable_cores()}):
        r = ran[step]
        if n != wf.spec.threads:
            spec = dataclasses.replace(wf.spec, threads=n)
            r = run_config(r.settings, spec, wf.device, name=step, stages=False, pipeline=pipeline)
            others.append((n, r.epoch_s))
        rounds = r.round_epoch_s
        how = (f"the waterfall's median of {len(rounds)} rounds, range {min(rounds):.2f}-{max(rounds):.2f} s"
               if len(rounds) > 1 else "one run")  # fmt: skip
        out.append(f"    {n} thread(s): {r.epoch_s:.2f} s/epoch ({how})")
    own = ran[step]  # the waterfall's run at the job's thread count
    for n, sec in others:  # wrapped: a notebook wraps a longer line mid-word
        out += textwrap.wrap(thread_verdict(n, sec, wf.spec.threads, own.epoch_s, own.round_epoch_s), 105,
                             initial_indent="    ", subsequent_indent="        ", break_on_hyphens=False)  # fmt: skip
    return out


def thread_verdict(threads: int, epoch_s: float, job_threads: int, job_epoch_s: float, rounds: Sequence[float]) -> str:
    """One run at ``threads`` against the waterfall's run at ``job_threads`` (median ``job_epoch_s`` of ``rounds``):
    inside the rounds' range, within noise; outside it, slower or faster beyond it; one round: no range to judge."""
    head = f"verdict, {threads} thread(s) against {job_threads}:"
    if len(rounds) < 2:
        return (f"{head} no range to judge: the waterfall ran one round, so x{epoch_s / job_epoch_s:.2f} its "
                "epoch time may be noise")  # fmt: skip
    lo, hi = min(rounds), max(rounds)
    if lo <= epoch_s <= hi:
        return (f"{head} within noise ({epoch_s:.2f} s is inside the waterfall's range {lo:.2f}-{hi:.2f} s): no "
                "cost of sharing the cores was measured")  # fmt: skip
    if epoch_s > hi:
        return (f"{head} slower beyond the waterfall's range ({epoch_s:.2f} s, above {lo:.2f}-{hi:.2f} s; "
                f"x{epoch_s / job_epoch_s:.2f} its median): sharing the cores cost time here")  # fmt: skip
    return (f"{head} faster beyond the waterfall's range ({epoch_s:.2f} s, below {lo:.2f}-{hi:.2f} s; "
            f"x{epoch_s / job_epoch_s:.2f} its median): no cost of sharing the cores was measured")  # fmt: skip


def timeline_lines(results: Sequence[ConfigResult]) -> list[str]:
    """Per configuration, from its timed epoch's spans: the first wait for a batch and the median one, the median
    ``train_step`` and the epoch's data stall, so the text can point at what this run measured."""
    out = []
    for r in results:
        waits = [s.duration for s in sorted(r.trace.spans, key=lambda s: s.start) if s.name == "batch"]
        steps = [s.duration for s in r.trace.spans if s.name == "train_step"]
        if not waits or not steps:
            out.append(f"{r.label}: no spans recorded")
            continue
        out.append(
            f"{r.label}: wait for a batch: first {waits[0] * 1e3:.1f} ms, median {statistics.median(waits) * 1e3:.1f} "
            f"ms · train_step: median {statistics.median(steps) * 1e3:.1f} ms · data stall {r.data_stall:.0%} of "
            f"the epoch ({len(steps)} steps, measured now)"
        )
    return out


def accuracy_tolerance(n_val: int, seed_spread: float | None = None) -> float:
    """Two binomial standard errors at p = 0.5, ``2 sqrt(0.25 / n_val)``: what a fresh validation set could show by
    chance; at least the measured seed-to-seed spread where configurations cannot be bit-identical."""
    check_int("n_val", n_val, 1)
    tol = 2.0 * math.sqrt(0.25 / n_val)
    if seed_spread is not None:
        tol = max(tol, check_float("seed_spread", seed_spread, 0.0, 1.0))
    return tol


def seed_spread(spec: JobSpec, device: torch.device | str, *, pipeline: Pipeline | None) -> tuple[list[float], float]:
    """``(accuracies, max - min)`` of the full stack trained with ``spec.seed``, 1 and 2."""
    settings = configurations()[-1][1]
    accs = []
    for sd in (spec.seed, 1, 2):
        r = run_config(
            settings, dataclasses.replace(spec, seed=sd), device, name="prefetcher", stages=False, pipeline=pipeline
        )
        accs.append(r.accuracy)
    return accs, max(accs) - min(accs)


def accuracy_verdict(accuracies: Sequence[float], tolerance: float) -> str:
    """Whether the accuracies (the baseline's first) agree: the lowest's band of ± half the ``tolerance`` overlaps
    the highest's (:func:`helpers.core.agreement.spreads_overlap`). If not, trust the baseline's."""
    lo, hi, half = min(accuracies), max(accuracies), tolerance / 2
    if agreement.spreads_overlap((lo - half, lo + half), (hi - half, hi + half)):
        return (
            f"the {len(accuracies)} accuracies agree within their spread (each ±{half:.1%}): the steps changed "
            "the speed, not what the job learned"
        )
    return (
        f"the accuracies do NOT agree within their spread (lowest {lo:.1%}, highest {hi:.1%}, each ±{half:.1%}): "
        f"a step changed what the job learned; trust the baseline's {accuracies[0]:.1%} and look for what the "
        "others changed (data order, crops, normalize)"
    )


def check_accuracies(
    results: Sequence[ConfigResult],
    num_classes: int,
    n_val: int,
    above_chance: bool = True,
    seed_spread: float | None = None,
    chance: float | None = None,
) -> tuple[bool, str]:
    """(ok, message): the accuracies agree (:func:`accuracy_verdict`) and, if asked, all reach twice ``chance``
    (default ``1 / num_classes``): clearly above it."""
    tol = accuracy_tolerance(n_val, seed_spread=seed_spread)
    chance = 1.0 / num_classes if chance is None else check_float("chance", chance, 0.0, 1.0)
    accs = [r.accuracy for r in results]
    verdict = accuracy_verdict(accs, tol)
    ok = "do NOT agree" not in verdict and (min(accs) >= 2 * chance or not above_chance)
    same = len({r.train_loss for r in results}) == 1
    why = f"at least the measured seed-to-seed spread {seed_spread:.1%}" if seed_spread is not None else (
        "two binomial standard errors")  # fmt: skip
    msg = (
        f"accuracies {', '.join(f'{a:.1%}' for a in accs)}: spread {max(accs) - min(accs):.1%} (tolerance "
        f"{tol:.1%}: {why}), lowest {min(accs):.1%} vs chance {chance:.1%}"
        + (f" (needs 2x chance: {2 * chance:.1%})" if above_chance else "")
        + f"; training losses {'bit-identical' if same else 'differ by rounding'}; {verdict}"
    )
    return ok, msg


#: The doctor's stages (:attr:`helpers.chapters.ch06.doctor.Diagnosis.stage_times`) as the waterfall names them.
_WATERFALL_STAGE = {"data": "loader", "transfer": "copy", "compute": "compute"}


def bottleneck_verdict(diagnosis: Diagnosis, wf: Waterfall) -> str:
    """Whether the doctor's bottleneck and the waterfall baseline's slowest stage alone agree: named alike, or
    named apart with the two stages' ratio, in either measurement, within the waterfall's noise of 1
    (:func:`helpers.core.agreement.within_noise_floor`). Otherwise trust the waterfall's stages alone."""
    speeds = {k: v for k, v in wf.baseline.stages.items() if v}
    times = {_WATERFALL_STAGE[k]: v for k, v in diagnosis.stage_times.items() if v}
    named = _WATERFALL_STAGE[diagnosis.verdict.split("-")[0]]
    slowest = wf.baseline.slowest_stage
    head = f"{wf.regime}: the doctor names the {named} ({diagnosis.verdict}, {times[named] * 1e3:.1f} ms per step)"
    if slowest is None:
        return f"{head}; the waterfall measured no stage alone here, so the two cannot be compared"
    alone = f"the waterfall's slowest stage alone is the {slowest} ({speeds[slowest]:,.0f} img/s"
    if named == slowest:
        return f"{head} and {alone}): they agree"
    noise = max(EFFICIENCY_NOISE, wf.noise_floor() or 0.0)
    ratios = [speeds[named] / speeds[slowest] if named in speeds else math.inf,
              times[named] / times[slowest] if slowest in times and times[slowest] > 0 else math.inf]  # fmt: skip
    alone += f", the {named} alone {ratios[0]:.2f}x as fast)" if math.isfinite(ratios[0]) else ")"
    if any(agreement.within_noise_floor(r, noise) for r in ratios if math.isfinite(r)):
        return f"{head}, {alone}: they agree within the noise ({noise:.0%}): either stage may set the pace"
    return f"{head}, {alone}: they do NOT agree beyond the noise ({noise:.0%}); trust the waterfall's stages alone"


def plot_waterfall(wf: Waterfall, ax: Any = None) -> Any:
    """Bars of time per epoch, labelled with the cumulative speedup; a step left out gets an empty slot, one that
    cannot act but was run anyway a hatched grey bar."""
    from ...ui.plots import new_axes  # optional/heavy: matplotlib

    ax = ax if ax is not None else new_axes((8.0, 3.6))
    vals, hatches = [r.epoch_s for r in wf.results], ["//" if idle else "" for idle in wf.no_effect()]
    colors = ["#d3d3d3" if h else "#bab0ac" if i == 0 else "#4e79a7" for i, h in enumerate(hatches)]
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
        f"{wf.regime}: width {wf.spec.width}, depth {wf.spec.depth}, {wf.results[0].steps} "
        f"steps/epoch on {dev} (measured now; labels: cumulative speedup)",
        fontsize=9,
    )
    labels = [r.label for r in wf.results]
    for k, name in enumerate(wf.not_measured):  # left out here: a labelled empty slot, no bar, no ratio
        x = len(vals) + k
        ax.text(x, 0, "needs CUDA:\nnot measured\nhere", ha="center", va="bottom", fontsize=7, color="#555")
        labels.append(_STEPS[name].label)
    ax.set_xticks(range(len(labels)))
    ax.set_xticklabels(labels, rotation=25, ha="right", fontsize=8)
    ax.set_xlim(-0.6, len(labels) - 0.4)  # the slots of the steps left out, too
    if any(h for h in hatches):
        ax.bar([0], [0], color="#d3d3d3", hatch="//", edgecolor="#555", label="needs CUDA: no effect here (noise only)")
        ax.legend(fontsize=7, loc="upper right")
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


def _recorded(regime: str, what: str, key: str) -> Evidence[list[tuple[str, float]]]:
    """The newest records of ``key`` for ``regime`` as [(label, value), ...] in stacking order, or missing."""
    check_choice("regime", regime, tuple(REGIMES))

    def rows(rs: Any, recs: list[Any]) -> list[tuple[str, float]]:
        ordered = sorted(recs, key=lambda r: r.params.get("order", 0))
        return [(str(r.params.get("label", r.params.get("stage"))), r.value) for r in ordered]

    return evidence.recorded(f"the {regime} {what}", key, convert=rows, regime=regime)


def plot_reference_waterfall(regime: str, ax: Any = None) -> Any:
    """The newest recorded GPU waterfall of ``regime``, labelled; or a plain 'none recorded'."""
    from ...ui.plots import label_source, new_axes  # optional/heavy: matplotlib

    ax = ax if ax is not None else new_axes((5.0, 3.6))
    ref = _recorded(regime, "waterfall", key="ch06.waterfall.step_time")
    if ref.value is None:
        ax.axis("off")
        text = textwrap.fill(ref.source, 48)
        ax.text(0.5, 0.5, f"Reference GPU waterfall ({regime}):\n\n{text}", ha="center", va="center", wrap=True,
                fontsize=8, transform=ax.transAxes)  # fmt: skip
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
    return _recorded(regime, "pipeline efficiency", key="ch06.efficiency")


def efficiency_lines(rows: list[tuple[str, float]]) -> list[str]:
    """'    baseline 0.52 · + pinned memory 0.55 · ...', wrapped: recorded ratios shown as :class:`Efficiency`."""
    text = " · ".join(f"{label} {Efficiency.of_ratio(eff).short()}" for label, eff in rows)
    return textwrap.wrap(text, 100, initial_indent="    ", subsequent_indent="    ", break_on_hyphens=False)


def reference_timeline(regime: str, stage: str) -> Evidence[dict[str, Any]]:
    """The newest recorded span trace of one configuration (artifact ``ch06.trace.<regime>.<stage>``), or missing."""
    check_choice("regime", regime, tuple(REGIMES))
    check_choice("stage", stage, STEP_NAMES)
    return evidence.recorded_artifact(f"the {regime} timeline, {stage}", f"ch06.trace.{regime}.{stage}")
