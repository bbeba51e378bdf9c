"""Chapter 00's warm-up demo gets a verdict from its own timings, and section 4 shows no unrelated published figure.

A laptop-size review: on a loaded 2-core CPU the demo printed a 25 ms first call against 0.060 ms later (415x),
and on other runs 0.9-1.1x, every call taking about 24 ms, while the text told a warm-up story either way. The
demo now runs on one intra-op thread, reads the thread's CPU time on a CPU, and
:func:`helpers.chapters.ch00.hygiene.warmup_verdict` calls the gap warm-up only when its three rules hold; else it
says that this run cannot tell warm-up from load. Synthetic timings below, except where a test says it times.
"""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from helpers.chapters.ch00 import hygiene  # noqa: E402
from helpers.core import evidence, results  # noqa: E402
from helpers.core.timing import Timing, summarize  # noqa: E402

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "00_setup_and_measuring.ipynb"


def _warm(ms: list[float], cpu_ms: list[float] | None = None) -> Timing:
    """A warm-up run as :func:`hygiene.warmup_demo` returns it, from per-call times in ms (in call order)."""
    meta = {} if cpu_ms is None else {"cpu_times_s": [v / 1e3 for v in cpu_ms]}
    return summarize("fresh conv2d, no warm-up", [v / 1e3 for v in ms], **meta)


def _flat(text: str) -> str:
    return " ".join(text.split())


QUIET = [1.64] + [0.080, 0.081, 0.079, 0.082, 0.080, 0.083, 0.081, 0.080, 0.079, 0.081, 0.082]
QUIET_CPU = [1.63] + [0.079, 0.080, 0.078, 0.081, 0.079, 0.082, 0.080, 0.079, 0.078, 0.080, 0.081]


def test_a_quiet_run_is_called_warm_up_with_its_numbers() -> None:
    v = hygiene.warmup_verdict(_warm(QUIET, QUIET_CPU))
    text = _flat(v.text)
    assert v.warm_up and not v.reasons
    assert "first call: 1.640 ms" in text and "median of the later 11 calls: 0.081 ms" in text
    assert f"ratio {1.64 / 0.081:.1f}x" in text
    assert "CPU time (one intra-op thread; waiting adds none): 1.630 ms of its 1.640 ms" in text
    assert "Verdict: warm-up." in text and "cannot tell" not in text
    assert str(v) == v.text


def test_every_call_slow_under_a_cpu_quota_cannot_be_told_from_load() -> None:
    # The review's loaded runs: every call about 24 ms, quantised at 20/24/28 ms (a CPU quota's slices).
    loaded = [25.0, 24.0, 20.0, 28.0, 24.0, 24.0, 20.0, 24.0, 28.0, 24.0, 24.0, 24.0]
    v = hygiene.warmup_verdict(_warm(loaded, [12.0] + [11.0] * 11))
    text = _flat(v.text)
    assert not v.warm_up and "Verdict: cannot tell." in text
    assert "warm-up cannot be told apart from the machine's load" in text and "Re-run the cell" in text
    assert "the first call took only 1.0x their median (the rule asks for 3x)" in text
    assert "This run shows warm-up" not in text


def test_a_first_call_held_off_the_cpu_is_load_not_warm_up() -> None:
    # The review's 415x: the first call's 25 ms, but the thread ran on the CPU for only 1.6 ms of it.
    first_waited = [25.0] + [0.060] * 11
    v = hygiene.warmup_verdict(_warm(first_waited, [1.6] + [0.059] * 11))
    text = _flat(v.text)
    assert v.ratio > 400 and not v.warm_up
    assert "the thread ran on the CPU for only 6% of the first call (the rule asks for 50%)" in text
    assert "for the rest it waited, for other programs or for the disk" in text
    assert len(v.reasons) == 1  # the ratio and the later calls' spread were fine


def test_scattered_later_calls_cannot_be_told_from_load() -> None:
    scattered = [2.0, 0.06, 0.5, 0.07, 2.0, 0.1, 0.9, 0.06, 1.5, 0.08, 0.4, 0.07]
    v = hygiene.warmup_verdict(_warm(scattered))
    text = _flat(v.text)
    assert not v.warm_up and "the later calls scatter (their IQR is" in text and "the rule allows 50%" in text


def test_the_thresholds_are_inclusive_and_each_rule_alone_decides() -> None:
    # 9 later calls: median 1.0 ms, quartiles 0.75 and 1.25 ms (inclusive method): IQR exactly half the median.
    later = [0.5, 0.7, 0.75, 0.9, 1.0, 1.1, 1.25, 1.3, 1.5]
    at_limits = hygiene.warmup_verdict(_warm([3.0, *later], [1.5, *later]))
    assert at_limits.warm_up, at_limits.text  # ratio 3.0x, spread 50%, on the CPU 50%: all at their limit
    assert not hygiene.warmup_verdict(_warm([2.99, *later], [2.99, *later])).warm_up
    assert not hygiene.warmup_verdict(_warm([3.0, *later], [1.49, *later])).warm_up
    wider = [0.5, 0.7, 0.74, 0.9, 1.0, 1.1, 1.26, 1.3, 1.5]
    assert not hygiene.warmup_verdict(_warm([30.0, *wider], [30.0, *wider])).warm_up


def test_without_a_thread_clock_only_the_two_timing_rules_apply() -> None:
    # On a GPU (or without a per-thread clock) no CPU time is read: no CPU line, no CPU rule.
    v = hygiene.warmup_verdict(_warm([250.0] + [0.05] * 9))
    assert v.warm_up and v.first_cpu_s is None and "CPU time" not in v.text and "ran on the CPU" not in v.text


def test_a_run_without_later_calls_is_refused() -> None:
    with pytest.raises(ValueError, match="at least one later call"):
        hygiene.warmup_verdict(_warm([1.0]))
    assert hygiene.warmup_verdict(_warm([1.0, 0.1])).warm_up  # one later call: no spread to judge


@pytest.mark.parametrize("scale", [1e-3, 1.0, 1e3])
def test_every_printed_line_fits(scale: float) -> None:
    for ms, cpu in ((QUIET, QUIET_CPU), ([25.0] + [0.060] * 11, [1.6] + [0.059] * 11)):
        text = hygiene.warmup_verdict(_warm([v * scale for v in ms], [v * scale for v in cpu])).text
        assert max(len(line) for line in text.splitlines()) <= 110, text


def test_the_demo_times_on_one_thread_and_restores_the_count() -> None:  # times a real (tiny) convolution
    before = torch.get_num_threads()
    warm = hygiene.warmup_demo("cpu", repeats=5)
    assert torch.get_num_threads() == before
    assert warm.n == 5 and warm.metadata["num_threads"] == 1 and warm.metadata["warmup"] == 0
    assert "one intra-op thread" in warm.metadata["method"]
    cpu = warm.metadata.get("cpu_times_s")
    if hygiene._THREAD_CLOCK is not None:  # Linux, macOS: the thread's CPU time, never above the wall time
        assert cpu is not None and len(cpu) == 5
        assert all(0 <= c <= w + 1e-4 for c, w in zip(cpu, warm.times_s))
    else:
        assert cpu is None
    assert hygiene.warmup_verdict(warm).text.startswith("first call: ")


def test_the_plot_numbers_calls_with_whole_numbers_and_draws_the_cpu_time() -> None:
    ax = hygiene.plot_warmup(_warm(QUIET, QUIET_CPU))
    ax.figure.canvas.draw()
    ticks = [t for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
    assert ticks and all(float(t).is_integer() for t in ticks), ticks
    assert [line.get_label() for line in ax.get_lines()] == ["wall clock", "this thread's CPU time"]
    plt.close(ax.figure)
    ax = hygiene.plot_warmup(_warm([250.0] + [0.05] * 9))
    assert [line.get_label() for line in ax.get_lines()] == ["wall clock"]
    plt.close(ax.figure)


def test_the_notebook_prints_the_verdict_and_no_fixed_story() -> None:
    cells = ["".join(c["source"]) for c in json.loads(NOTEBOOK.read_text(encoding="utf-8"))["cells"]]
    (cell,) = [c for c in cells if "hygiene.warmup_demo(" in c]
    assert "hygiene.warmup_verdict(warm)" in cell and "hygiene.plot_warmup(warm)" in cell
    text = "\n".join(cells)
    assert "On a busy CPU the difference is smaller" not in text
    assert "cannot tell warm-up from load" in text
    # The chapter names the thresholds in words: they must be the ones the verdict applies.
    assert (hygiene.WARMUP_MIN_RATIO, hygiene.WARMUP_MAX_SPREAD, hygiene.WARMUP_MIN_ON_CPU) == (3.0, 0.5, 0.5)
    assert "at least 3x the median of the later calls" in text and "at most half their median" in text
    assert "at least half of the first call" in text


# --- section 4: CUDA events vs wall clock ---------------------------------------------------------------------


def test_without_a_gpu_or_a_recording_section_4_shows_no_unrelated_published_figure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if torch.cuda.is_available():
        pytest.skip("checks the no-GPU path")
    monkeypatch.setenv(evidence.REFERENCE_ENV, str(tmp_path))
    ev = hygiene.clocks_evidence("cpu", n=32, repeats=3)
    text = _flat(str(ev))
    assert ev.kind == "missing" and not ev and not ev.cited
    assert text.startswith("No CUDA device") and "CUDA events vs wall clock" in text
    assert "No published figure of this comparison is shown" in text and "section 2" in text
    assert "closely related" not in text and "mlx-benchmark" not in text


def test_section_4_shows_a_gpu_recording_of_both_clocks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if torch.cuda.is_available():
        pytest.skip("checks the no-GPU path")
    monkeypatch.setenv(evidence.REFERENCE_ENV, str(tmp_path))
    rs = results.ResultSet.new("t", "m")
    rs.provenance["hardware"] = {**rs.hardware, "gpu_name": "Test GPU"}
    for clock, ms in (("no sync", 0.03), ("sync", 1.3)):
        rs.add("ch00.matmul_time_s", ms / 1e3, "s", spread={"iqr": 1e-5, "n": 3}, n=512, clock=clock)
    rs.save(tmp_path / "sync-only.json")
    assert hygiene.clocks_evidence("cpu", n=32, repeats=3).kind == "missing"  # no CUDA-event timing recorded
    for clock, ms in (("CUDA events", 1.2), ("wall clock + sync", 1.25)):
        rs.add("ch00.matmul_time_s", ms / 1e3, "s", spread={"iqr": 1e-5, "n": 3}, n=512, clock=clock)
    rs.save(tmp_path / "with-events.json")
    ev = hygiene.clocks_evidence("cpu", n=32, repeats=3)
    assert ev.kind == "recorded" and [r.clock for r in ev.value] == list(hygiene.EVENT_CLOCKS)
    assert "CUDA events, n=512: median 1.200 ms" in "\n".join(hygiene.clock_table(ev.value))


def test_the_notebook_builds_section_4_from_the_helper() -> None:
    cells = ["".join(c["source"]) for c in json.loads(NOTEBOOK.read_text(encoding="utf-8"))["cells"]]
    (cell,) = [c for c in cells if "hygiene.clocks_evidence(" in c]
    assert "clocks.show(hygiene.clock_table)" in cell
    assert not [c for c in cells if "measure_or_recall" in c and "CUDA events" in c]
