"""Every pair of measurements of one thing that a chapter shows carries an agreement verdict (issue 28, item 3).

:data:`PAIRS` is the registry: one row per pair the notebooks show (chapter, what is measured twice, the
notebook code that makes the second measurement, the code that prints the verdict, the function whose sentence
states it, and the agreement rule in ``helpers/core/agreement.py`` it rests on). Rows without a verdict are
pairs found in the chapters that print none today (``missing`` says why; they are reported, not hidden).

Three checks:

(a) for each row, the notebook's code cell that shows the pair, or the next code cell, calls the verdict
    (``call``), and each function of ``chain`` names the next in its source, from what the notebook calls down
    to the kernel rule;
(b) each verdict function, on synthetic agreeing and disagreeing inputs, says "agree" / "within noise" for the
    first and "NOT agree" / "disagree" / a real difference for the second, and which to trust where the two
    contradict each other;
(c) a scan of the notebooks' code for calls known to make a second measurement of something already measured
    (:data:`HEURISTICS`) finds no pair that is not in the registry, or whose verdict call is gone. A notebook
    copy with a verdict call removed, or with a new pair-making cell, fails the scan (checked on copies under
    ``tmp_path``; the real notebooks are only read).
"""

from __future__ import annotations

import importlib
import inspect
import json
import re
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

import pytest

from helpers.chapters.ch03 import pinning
from helpers.chapters.ch04 import speedup, sweeps

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"
KERNEL = "helpers.core.agreement"


@dataclass(frozen=True)
class Pair:
    """One pair of measurements of one thing that a chapter shows.

    Attributes:
        chapter: "00" ... "07" (the notebook ``notebooks/<chapter>_*.ipynb``).
        what: the thing measured twice, and the two measurements.
        shown_by: text of the code cell that makes the second measurement (finds the cell).
        call: text, in that cell or the next code cell, that prints the verdict ("" when ``missing``).
        verdict: dotted name of the function whose sentence states the agreement ("" when ``missing``).
        chain: dotted names from what the notebook calls down to the rule; each names the next in its source.
        rule: the rule in helpers/core/agreement.py, and the spread it is applied to.
        trust: what the sentence says to trust when the two contradict each other ("" for a setting against a
            reference, where a difference is a result, not a contradiction).
        missing: why no verdict is printed today (a pair found, reported, not yet fixed); "" when it has one.
    """

    chapter: str
    what: str
    shown_by: str
    call: str = ""
    verdict: str = ""
    chain: tuple[str, ...] = ()
    rule: str = ""
    trust: str = ""
    missing: str = ""


CH02, CH03, CH04 = "helpers.chapters.ch02", "helpers.chapters.ch03", "helpers.chapters.ch04.speedup"
GPUDECODE, CAPSTONE = "helpers.chapters.ch05.gpudecode", "helpers.chapters.ch06.capstone"
HYGIENE, CH01 = "helpers.chapters.ch00.hygiene", "helpers.chapters.ch01"

#: Every pair of measurements of one thing that the chapters show.
PAIRS: tuple[Pair, ...] = (
    Pair("02", "one 1 MiB copy: one call of your time_copy, and the sweep's 1 MiB point (section 2)",
         shown_by="cpu_sweep = copies.sweep(time_copy", call="ch02.runs_agree(", verdict=f"{CH02}.runs_agree",
         chain=(f"{CH02}.runs_agree", f"{CH02}.points_agree", f"{KERNEL}.spreads_overlap"),
         rule="spreads_overlap on median ± IQR", trust="Trust the"),
    Pair("02", "each copy curve: the latency + bandwidth fit, and the points it was fitted to (section 2)",
         shown_by="fits[sw.label] = fit = sw.fit()", call="ch02.fit_check(sw, fit).verdict()",
         verdict=f"{CH02}.FitCheck.verdict", chain=(f"{CH02}.fit_check", f"{KERNEL}.within_range"),
         rule="within_range: the prediction within the point's median ± IQR", trust="trust the points"),
    Pair("02", "exercise 02.1's FIT, and the points it was fitted to", shown_by="FIT = fits[FIT_NAME]",
         call="ch02.fit_check(", verdict=f"{CH02}.FitCheck.verdict",
         chain=(f"{CH02}.fit_check", f"{KERNEL}.within_range"),
         rule="within_range: the prediction within the point's median ± IQR", trust="trust the points"),
    Pair("02", "the live panel's copy, and the sweep's point of the same size (the panel is handed the sweep)",
         shown_by="widgets.Panel.for_chapter(ch02", call="host=host", verdict=f"{CH02}.points_agree",
         chain=(f"{CH02}.panel_run", f"{CH02}.points_agree", f"{KERNEL}.spreads_overlap"),
         rule="spreads_overlap on median ± IQR", trust="Trust the"),
    Pair("03", "your loader with pin_memory False and True in alternating rounds (without CUDA: the same work)",
         shown_by="pinning.pin_pair_rounds(", call="ch03.pin_pair_verdict(rows)", verdict=f"{CH03}.pin_pair_verdict",
         chain=(f"{CH03}.pin_pair_verdict", f"{KERNEL}.ratios_straddle_one"),
         rule="ratios_straddle_one on the per-round ratios", trust="Trust the faster figure"),
    Pair("04", "the 2-worker speed-up: the one-pass sweep (section 1), and alternating rounds (section 1b)",
         shown_by="ROUNDS = speedup.knob_rounds(", call="speedup.sweep_vs_rounds(sweep, ROUNDS)",
         verdict=f"{CH04}.sweep_vs_rounds",
         chain=(f"{CH04}.sweep_vs_rounds", f"{KERNEL}.within_range"),
         rule="within_range: the one-pass figure within the rounds' range", trust="trust the alternating rounds"),
    Pair("04", "prefetch_factor 1 and 4 against the default 2, in alternating rounds (section 2)",
         shown_by="pf = speedup.knob_rounds(", call="pf.verdicts()", verdict=f"{CH04}.LoaderRounds.verdicts",
         chain=(f"{CH04}.LoaderRounds.verdicts", f"{KERNEL}.ratios_straddle_one"),
         rule="ratios_straddle_one on the per-round ratios"),
    Pair("05", "without CUDA: the same CPU decode code path timed twice, (a) then (b) (section 5)",
         shown_by="gpudecode.compare_decode(", call="cmp.report()",
         verdict=f"{GPUDECODE}.DecodeComparison.verdict",
         chain=(f"{GPUDECODE}.DecodeComparison.report", f"{GPUDECODE}.DecodeComparison.verdict",
                f"{KERNEL}.spreads_overlap"),
         rule="spreads_overlap on the quartiles", trust="trust the faster"),
    Pair("06", "data-bound waterfall: each configuration against the one before it, in alternating rounds",
         shown_by='wf["data-bound"] = capstone.run_waterfall(', call='wf["data-bound"].table()',
         verdict=f"{CAPSTONE}.Waterfall.verdicts",
         chain=(f"{CAPSTONE}.Waterfall.table", f"{CAPSTONE}.Waterfall.verdicts", f"{KERNEL}.within_noise_floor"),
         rule="ratios_split_on_direction, or within_noise_floor of the per-round ratios' ratio_noise"),
    Pair("06", "compute-bound waterfall: each configuration against the one before it, in alternating rounds",
         shown_by='wf["compute-bound"] = capstone.run_waterfall(', call='wf["compute-bound"].table()',
         verdict=f"{CAPSTONE}.Waterfall.verdicts",
         chain=(f"{CAPSTONE}.Waterfall.table", f"{CAPSTONE}.Waterfall.verdicts", f"{KERNEL}.within_noise_floor"),
         rule="ratios_split_on_direction, or within_noise_floor of the per-round ratios' ratio_noise"),
    Pair("00", "without CUDA: one matmul timed with and without synchronize(), the same work on the same clock",
         shown_by="demo = hygiene.sync_demo(", call='hygiene.sync_verdict(demo["no sync"], demo["sync"])',
         verdict=f"{HYGIENE}.sync_verdict", chain=(f"{HYGIENE}.sync_verdict", f"{KERNEL}.spreads_overlap"),
         rule="spreads_overlap on the quartiles", trust="trust the faster"),
    Pair("01", "the baseline step: predicted for the naive loop (the sum of its phases on a CPU), and measured "
               "over the steps (section 5)",
         shown_by="pred = anatomy.predict_step_time(", call="ch01.step_verdict(pred, anatomy.step_times(trace)",
         verdict=f"{CH01}.step_verdict",
         chain=(f"{CH01}.step_verdict", f"{CH01}._against_steps", f"{KERNEL}.within_range"),
         rule="within_range: the prediction within the measured steps' range", trust="Trust the measured step"),
    Pair("01", "thin and wide models: predicted sum of phases, and measured step time (section 5's table)",
         shown_by="p.serial * 1e3", call="ch01.regimes_verdict(runs", verdict=f"{CH01}.regimes_verdict",
         chain=(f"{CH01}.regimes_verdict", f"{CH01}._against_steps", f"{KERNEL}.within_range"),
         rule="within_range: each row's prediction within its measured steps' range",
         trust="trust the measured step"),
    Pair("06", "the same job's validation accuracy under every configuration of a waterfall (section 4)",
         shown_by="capstone.check_accuracies(w.results", call='print(textwrap.fill(f"{regime}: {msg}"',
         verdict=f"{CAPSTONE}.accuracy_verdict",
         chain=(f"{CAPSTONE}.check_accuracies", f"{CAPSTONE}.accuracy_verdict", f"{KERNEL}.spreads_overlap"),
         rule="spreads_overlap on each accuracy +- half the tolerance (two binomial standard errors, or the "
              "seed-to-seed spread)", trust="trust the baseline"),
    Pair("06", "the baseline's bottleneck: slowest stage alone in the waterfall (section 5), and the doctor (9)",
         shown_by="doctor.diagnose(", call="capstone.bottleneck_verdict(", verdict=f"{CAPSTONE}.bottleneck_verdict",
         chain=(f"{CAPSTONE}.bottleneck_verdict", f"{KERNEL}.within_noise_floor"),
         rule="within_noise_floor: the two stages' ratio, in either measurement, within the waterfall's noise",
         trust="trust the waterfall's stages alone"),
)  # fmt: skip

#: Calls known to make a second measurement of something already measured (on a notebook's code cells).
HEURISTICS: dict[str, str] = {
    "alternating rounds: a setting against a reference, or a one-pass figure measured again": (
        r"\b(knob_rounds|pin_pair_rounds|run_waterfall)\("
    ),
    "a sweep that measures again a copy already timed once": r"\bcopies\.sweep\(",
    "a fit set against the points it was fitted to": r"\.fit\(\)|=\s*fits\[",
    "one code path timed twice": r"\bcompare_decode\(",
    "a panel handed an earlier measurement to compare with": r"Panel\.for_chapter\([^\n]*\b(host|gpu|sweep)=",
    "one operation timed with and without a sync": r"=\s*hygiene\.sync_demo\([^\n]*\)\s*$",
    "a model's prediction beside the measured step": r"\bpredict_step_time\(|\.serial\b",
    "a diagnosis of a pipeline a waterfall measured": r"\bdoctor\.diagnose\(",
    "one job's accuracy under several configurations": r"\bcheck_accuracies\(",
}

# --- reading notebooks ------------------------------------------------------------------------------------------


def notebook(chapter: str, folder: Path = NOTEBOOKS) -> Path:
    (path,) = folder.glob(f"{chapter}_*.ipynb")
    return path


def code_cells(path: Path) -> list[str]:
    """The notebook's code cells, in order (markdown left out: a verdict is printed by code)."""
    cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
    return ["".join(c["source"]) for c in cells if c["cell_type"] == "code"]


def chapters(folder: Path = NOTEBOOKS) -> list[str]:
    return sorted(p.name[:2] for p in folder.glob("[0-9][0-9]_*.ipynb"))


def verdict_present(row: Pair, cells: list[str], i: int) -> bool:
    """Whether ``row``'s verdict call is in code cell ``i`` (the one that shows the pair) or the next one."""
    return bool(row.call) and any(row.call in c for c in cells[i : i + 2])


def scan(chapter: str, cells: list[str]) -> list[str]:
    """Pairs the heuristics find in one notebook that the registry does not cover with a printed verdict.

    A hit is covered by a row of the chapter whose ``shown_by`` is in the hit's cell, and whose verdict call is in
    that cell or the next; a row marked ``missing`` covers it too (a known pair without a verdict, reported).
    """
    problems = []
    rows = [r for r in PAIRS if r.chapter == chapter]
    for i, cell in enumerate(cells):
        for kind, pattern in HEURISTICS.items():
            if not re.search(pattern, cell, re.MULTILINE):
                continue
            mine = [r for r in rows if r.shown_by in cell]
            where = f"chapter {chapter}, code cell {i}: {kind}"
            if not mine:
                problems.append(f"{where}: a pair not in the registry (add it to PAIRS, with its verdict)")
            elif not any(r.missing or verdict_present(r, cells, i) for r in mine):
                calls = " / ".join(r.call for r in mine)
                problems.append(f"{where}: its verdict ({calls}) is not printed in this cell or the next")
    return problems


def resolve(dotted: str) -> Any:
    """The object a dotted name means: the longest importable module, then attributes."""
    parts = dotted.split(".")
    for k in range(len(parts), 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:k]))
        except ModuleNotFoundError:
            continue
        for name in parts[k:]:
            obj = inspect.getattr_static(obj, name) if isinstance(obj, type) else getattr(obj, name)
        return obj
    raise ImportError(dotted)


def source(dotted: str) -> str:
    obj = resolve(dotted)
    if isinstance(obj, property):
        obj = obj.fget
    return inspect.getsource(obj)


# --- (a) the registry against the notebooks and the code ------------------------------------------------------

WITH_VERDICT = [r for r in PAIRS if not r.missing]


@pytest.mark.parametrize("row", WITH_VERDICT, ids=lambda r: f"{r.chapter}:{r.shown_by[:30]}")
def test_the_cell_that_shows_the_pair_or_the_next_prints_its_verdict(row: Pair) -> None:
    cells = code_cells(notebook(row.chapter))
    shows = [i for i, c in enumerate(cells) if row.shown_by in c]
    assert shows, f"chapter {row.chapter}: no code cell contains {row.shown_by!r}: update the registry"
    for i in shows:
        assert verdict_present(row, cells, i), f"chapter {row.chapter}, code cell {i}: {row.call!r} is not printed"


@pytest.mark.parametrize("row", WITH_VERDICT, ids=lambda r: f"{r.chapter}:{r.shown_by[:30]}")
def test_the_verdict_reaches_its_rule(row: Pair) -> None:
    assert row.chain and resolve(row.verdict) is not None and row.rule
    for caller, callee in zip(row.chain, row.chain[1:]):
        name = callee.rsplit(".", 1)[1]
        assert re.search(rf"\b{re.escape(name)}\b", source(caller)), f"{caller} does not call {name}"
    name = row.verdict.rsplit(".", 1)[1]
    cells = "\n".join(code_cells(notebook(row.chapter)))
    reached = row.verdict in row.chain or any(re.search(rf"\b{name}\b", source(c)) for c in row.chain)
    assert reached or f".{name}(" in cells, f"{row.verdict}: neither the chain nor the notebook calls it"
    on_kernel = row.chain[-1].startswith(KERNEL + ".")
    assert on_kernel or "not yet calling the kernel" in row.rule, f"{row.chain[-1]}: name its rule in the kernel"
    if on_kernel:
        assert row.chain[-1].rsplit(".", 1)[1] in resolve(KERNEL).__all__


def test_every_row_names_a_chapter_that_exists_and_a_known_pair_kind() -> None:
    known = set(chapters())
    assert {r.chapter for r in PAIRS} <= known
    for r in PAIRS:
        assert bool(r.missing) != bool(r.call and r.verdict), r
        cells = code_cells(notebook(r.chapter))
        hits = [c for c in cells if r.shown_by in c]
        assert hits, f"chapter {r.chapter}: no code cell contains {r.shown_by!r}"
        assert any(re.search(p, c, re.MULTILINE) for c in hits for p in HEURISTICS.values()), (
            f"{r}: the scan would not find this pair: widen HEURISTICS"
        )


def test_the_pairs_without_a_verdict_are_the_reported_ones() -> None:
    missing = {(r.chapter, r.shown_by) for r in PAIRS if r.missing}
    assert missing == set()  # chapter 06's accuracies and bottleneck now print theirs (issue 28)


# --- (b) each verdict function on synthetic agreeing and disagreeing inputs -----------------------------------


def _points_agree() -> tuple[str, str]:
    from helpers.chapters import ch02
    from helpers.chapters.ch02.copies import MiB, TransferPoint

    sweep = TransferPoint(MiB, "h2h", "pageable", 100e-6, 10e-6, n=10)
    near = TransferPoint(MiB, "h2h", "pageable", 112e-6, 5e-6, n=5)
    far = TransferPoint(MiB, "h2h", "pageable", 300e-6, 5e-6, n=5)
    return ch02.points_agree("one call", near, "sweep's point", sweep), ch02.points_agree(
        "one call", far, "sweep's point", sweep
    )


def _runs_agree() -> tuple[str, str]:
    from helpers.chapters import ch02
    from helpers.chapters.ch02.copies import MiB, TransferPoint

    point = TransferPoint(MiB, "h2h", "pageable", 100e-6, 10e-6, n=10)
    return (
        ch02.runs_agree("one call", [95e-6, 104e-6, 110e-6], "sweep's point", point),
        ch02.runs_agree("one call", [300e-6, 305e-6, 310e-6], "sweep's point", point),
    )


def _fit_check() -> tuple[str, str]:
    from helpers.chapters import ch02
    from helpers.chapters.ch02.copies import Sweep, TransferPoint
    from helpers.chapters.ch02.model import KiB, MiB

    sizes = [4 * KiB, 64 * KiB, MiB, 16 * MiB, 64 * MiB]
    model = [(n, 5e-6 + n / 10e9) for n in sizes]
    good = Sweep("h2h", "pageable", [TransferPoint(n, "h2h", "pageable", t, 0.05 * t, n=9) for n, t in model])
    rates = [5e9, 40e9, 42e9, 11e9, 11.5e9]  # cache-resident mid sizes: no line fits
    bad = Sweep("h2h", "pageable", [TransferPoint(n, "h2h", "pageable", n / r, n / r / 100, n=9) for n, r in
                                    zip(sizes, rates)])  # fmt: skip
    return ch02.fit_check(good).verdict(), ch02.fit_check(bad).verdict()


def _pin_pair_verdict() -> tuple[str, str]:
    from helpers.chapters import ch03
    from helpers.pipeline import loaders as L

    def rows(on: list[float], off: list[float]) -> list[pinning.PinRow]:
        def row(pin: bool, rounds: list[float]) -> pinning.PinRow:
            res = L.Throughput(label="t", config={}, items=100, batches=10, seconds=1.0, startup_s=0.0,
                               warmup_batches=0, epochs_started=1)  # fmt: skip
            return pinning.PinRow(0, pin, res, False, None, None, rounds)

        return [row(False, off), row(True, on)]

    return (
        ch03.pin_pair_verdict(rows([104.0, 96.0, 101.0], [100.0, 100.0, 100.0])),
        ch03.pin_pair_verdict(rows([127.0, 140.0, 120.0], [100.0, 110.0, 95.0])),
    )


def _sweep_vs_rounds() -> tuple[str, str]:

    def sweep(two: float) -> sweeps.WorkerSweep:
        results: list[Any] = [SimpleNamespace(items_per_s=r) for r in (100.0, 90.0, two)]
        return sweeps.WorkerSweep(workers=[0, 1, 2], results=results, cores=2)

    rounds = speedup.LoaderRounds("num_workers", {0: [100.0] * 3, 2: [130.0, 144.0, 160.0]}, 0)
    (agree,) = speedup.sweep_vs_rounds(sweep(150.0), rounds)
    (disagree,) = speedup.sweep_vs_rounds(sweep(96.0), rounds)
    return agree, disagree


def _knob_verdicts() -> tuple[str, str]:

    def knob(one: list[float]) -> str:
        kr = speedup.LoaderRounds("prefetch_factor", {1: one, 2: [100.0, 100.0, 100.0]}, reference=2)
        (line,) = kr.verdicts()
        return line

    return knob([95.0, 104.0, 99.0]), knob([60.0, 55.0, 70.0])


def _same_path_verdict() -> tuple[str, str]:
    from helpers.chapters.ch05 import gpudecode
    from helpers.core.timing import Timing

    def t(ms: list[float]) -> Timing:
        s = sorted(v / 1e3 for v in ms)
        return Timing("t", s[len(s) // 2], 0.0, sum(s) / len(s), s[0], s[-1], len(s), times_s=s)

    def verdict(a: list[float], b: list[float]) -> str:
        return gpudecode.DecodeComparison("cpu", False, 4, 8, 16, 1, {}, t(a), t(b), pinned=False).verdict

    same = verdict([28, 30, 32, 40, 45], [27, 29, 31, 33, 35])
    apart = verdict([100, 105, 109.57, 112, 120], [27, 28, 28.71, 29, 30])
    return same, apart


def _waterfall_verdicts() -> tuple[str, str]:
    from helpers.chapters.ch06 import capstone as C

    def wf(times: list[float]) -> str:
        res = [SimpleNamespace(name=n, epoch_s=sorted(r)[1], round_epoch_s=r)
               for n, r in (("baseline", [1.0, 1.02, 0.99]), ("workers", times))]  # fmt: skip
        return C.Waterfall("data-bound", None, "cpu", res, rounds=3).verdicts()[1]  # type: ignore[arg-type]

    return wf([0.99, 1.03, 1.0]), wf([0.5, 0.52, 0.5])


def _accuracy_verdict() -> tuple[str, str]:
    from helpers.chapters.ch06 import capstone as C

    tol = C.accuracy_tolerance(256)  # 6.25%: two binomial standard errors of 256 images
    return C.accuracy_verdict([0.50, 0.52, 0.47], tol), C.accuracy_verdict([0.50, 0.52, 0.35], tol)


def _bottleneck_verdict() -> tuple[str, str]:
    from helpers.chapters.ch06 import capstone as C
    from helpers.chapters.ch06 import doctor as D

    def diagnosis(wait_ms: float, compute_ms: float) -> Any:
        m = D.Measurements(steps=10, wait_s=wait_ms / 1e3, h2d_s=0.0, compute_s=compute_ms / 1e3)
        return D.decide(m)

    def wf(loader: float, compute: float) -> Any:
        base = SimpleNamespace(name="baseline", epoch_s=1.0, round_epoch_s=[1.0, 1.01, 0.99],
                               stages={"loader": loader, "copy": None, "compute": compute})  # fmt: skip
        base.slowest_stage = min(("loader", "compute"), key=lambda k: base.stages[k])
        return C.Waterfall("data-bound", None, "cpu", [base], rounds=3)  # type: ignore[arg-type]

    agree = C.bottleneck_verdict(diagnosis(12.0, 5.0), wf(2600.0, 6300.0))  # both: the loader
    near = C.bottleneck_verdict(diagnosis(5.2, 5.0), wf(6300.0, 6100.0))  # named apart, within the noise
    apart = C.bottleneck_verdict(diagnosis(20.0, 5.0), wf(9000.0, 2000.0))  # named apart, far beyond it
    assert "they agree" in near and "either stage may set the pace" in near, near
    return _flat(agree), _flat(apart)


def _flat(text: str) -> str:
    """A wrapped sentence on one line (the verdicts are wrapped for print; a phrase may straddle a line end)."""
    return " ".join(text.split())


def _sync_verdict() -> tuple[str, str]:
    from helpers.chapters.ch00 import hygiene
    from helpers.core.timing import Timing

    def t(ms: list[float]) -> Timing:
        s = sorted(v / 1e3 for v in ms)
        return Timing("t", s[len(s) // 2], 0.0, sum(s) / len(s), s[0], s[-1], len(s), times_s=s)

    same = hygiene.sync_verdict(t([10.0, 10.4, 10.8, 11.5]), t([10.2, 10.6, 11.0, 12.0]))
    apart = hygiene.sync_verdict(t([10.0, 10.2, 10.4, 10.6]), t([14.0, 14.2, 14.4, 14.6]))
    return _flat(same), _flat(apart)


def _step_predictions() -> tuple[Any, list[float], list[float]]:
    from helpers.chapters.ch01 import anatomy

    pred = anatomy.predict_step_time({"load": 4e-3, "collate": 1e-3, "h2d": 0.0, "forward": 3e-3, "backward": 4e-3,
                                    "optimizer": 1e-3})  # fmt: skip
    return pred, [12.8e-3, 13.1e-3, 13.5e-3], [13.8e-3, 14.1e-3, 14.5e-3]  # the sum, 13 ms: inside, then below


def _step_verdict() -> tuple[str, str]:
    from helpers.chapters import ch01

    pred, inside, slower = _step_predictions()
    return _flat(ch01.step_verdict(pred, inside, device="cpu")), _flat(ch01.step_verdict(pred, slower, device="cpu"))


def _regimes_verdict() -> tuple[str, str]:
    from helpers.chapters import ch01

    pred, inside, slower = _step_predictions()
    agree = ch01.regimes_verdict({"width 2": (pred, inside), "width 64": (pred, inside)}, device="cpu")
    disagree = ch01.regimes_verdict({"width 2": (pred, inside), "width 64": (pred, slower)}, device="cpu")
    return _flat(agree), _flat(disagree)


#: verdict -> (synthetic agreeing and disagreeing sentences, words that say "agree", words that say "not").
SYNTHETIC: dict[str, tuple[Callable[[], tuple[str, str]], tuple[str, ...], tuple[str, ...]]] = {
    f"{CH02}.points_agree": (_points_agree, ("they agree within their spread",), ("do NOT agree",)),
    f"{CH02}.runs_agree": (_runs_agree, ("they agree within their spread",), ("do NOT agree",)),
    f"{CH02}.FitCheck.verdict": (_fit_check, ("fit and points agree",), ("fit misses",)),
    f"{CH03}.pin_pair_verdict": (_pin_pair_verdict, ("within noise",), ("beyond the rounds' spread",)),
    f"{CH04}.sweep_vs_rounds": (_sweep_vs_rounds, ("agree within their spread",), ("disagree",)),
    f"{CH04}.LoaderRounds.verdicts": (_knob_verdicts, ("within the noise",), ("a real difference",)),
    f"{GPUDECODE}.DecodeComparison.verdict": (_same_path_verdict, (", agree within their spread",), ("do NOT agree",)),
    f"{CAPSTONE}.Waterfall.verdicts": (_waterfall_verdicts, ("within noise", "no effect"), ("gain", "slower")),
    f"{CAPSTONE}.accuracy_verdict": (_accuracy_verdict, ("accuracies agree within their spread",), ("do NOT agree",)),
    f"{CAPSTONE}.bottleneck_verdict": (_bottleneck_verdict, ("they agree",), ("do NOT agree",)),
    f"{HYGIENE}.sync_verdict": (_sync_verdict, (") agree within their spread",), ("do NOT agree",)),
    f"{CH01}.step_verdict": (_step_verdict, ("they agree within their spread",), ("do NOT agree",)),
    f"{CH01}.regimes_verdict": (_regimes_verdict, ("they agree within their spread",), ("do NOT agree",)),
}


def test_every_verdict_in_the_registry_has_a_synthetic_check() -> None:
    assert {r.verdict for r in WITH_VERDICT} == set(SYNTHETIC)


@pytest.mark.parametrize("row", WITH_VERDICT, ids=lambda r: f"{r.chapter}:{r.verdict.rsplit('.', 1)[1]}")
def test_the_verdict_says_agree_or_not_and_which_to_trust(row: Pair) -> None:
    make, agree_words, not_words = SYNTHETIC[row.verdict]
    agree, disagree = make()
    assert any(w in agree for w in agree_words), agree
    assert not any(w in agree for w in not_words), agree
    assert any(w in disagree for w in not_words), disagree
    assert not any(w in disagree for w in agree_words), disagree
    if row.trust:  # two measurements that contradict each other: the sentence says which one to believe
        assert row.trust in disagree, disagree
        assert row.trust not in agree, agree


# --- (c) the scan: no pair unregistered, none with its verdict gone -------------------------------------------


@pytest.mark.parametrize("chapter", chapters())
def test_the_scan_finds_no_pair_without_a_verdict(chapter: str) -> None:
    assert scan(chapter, code_cells(notebook(chapter))) == []


def _copy(chapter: str, tmp_path: Path, edit: Callable[[list[dict[str, Any]]], None]) -> list[str]:
    nb = json.loads(notebook(chapter).read_text(encoding="utf-8"))
    edit(nb["cells"])
    path = tmp_path / notebook(chapter).name
    path.write_text(json.dumps(nb, indent=1), encoding="utf-8")
    return code_cells(path)


@pytest.mark.parametrize("row", WITH_VERDICT, ids=lambda r: f"{r.chapter}:{r.call[:30]}")
def test_the_scan_fails_on_a_copy_without_the_verdict_call(row: Pair, tmp_path: Path) -> None:
    def drop_call(cells: list[dict[str, Any]]) -> None:
        for c in cells:
            if c["cell_type"] == "code":
                c["source"] = "".join(c["source"]).replace(row.call, "").splitlines(keepends=True)

    problems = scan(row.chapter, _copy(row.chapter, tmp_path, drop_call))
    assert any("is not printed" in p for p in problems), problems


def test_the_scan_fails_on_a_copy_with_a_new_pair(tmp_path: Path) -> None:
    new_cell = {"cell_type": "code", "metadata": {}, "execution_count": None, "outputs": [],
                "source": ["again = copies.sweep(time_copy, SIZES, device='cpu')\n", "print(again)"]}  # fmt: skip
    problems = scan("05", _copy("05", tmp_path, lambda cells: cells.append(new_cell)))
    assert problems == [
        f"chapter 05, code cell {len(code_cells(notebook('05')))}: a sweep that measures again a copy already "
        "timed once: a pair not in the registry (add it to PAIRS, with its verdict)"
    ]
    rounds_again = {**new_cell, "source": ['ROUNDS = speedup.knob_rounds(factory, "num_workers", [0, 3])\n']}
    problems = scan("04", _copy("04", tmp_path, lambda cells: cells.append(rounds_again)))
    assert len(problems) == 1 and "is not printed" in problems[0], problems
