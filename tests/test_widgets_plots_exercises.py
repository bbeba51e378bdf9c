from __future__ import annotations

import time

import ipywidgets as W
import matplotlib
import pytest

matplotlib.use("Agg")

from helpers.chapters import ch01  # noqa: E402
from helpers.chapters.ch02 import figures  # noqa: E402
from helpers.core import config  # noqa: E402
from helpers.core.timing import SpanRecorder  # noqa: E402
from helpers.ui import exercises, plots, widgets  # noqa: E402


def _panel(run=None, **kw) -> widgets.Panel:
    def default_run(progress, n, kind):
        progress(0.5, "half way")
        if n == 13:
            raise ValueError("13 is unlucky")
        return {"value": n * 2, "kind": kind}

    def plot(history, ax):
        plots.history_bars([r.short_label() for r in history], [r.result["value"] for r in history], ax, ylabel="value")

    return widgets.Panel(
        "test",
        {"n": W.IntSlider(value=1, min=1, max=20), "kind": W.Dropdown(options=["a", "b"], value="a")},
        run or default_run,
        summarize=lambda r: f"value {r['value']}",
        plot=plot,
        **kw,
    )


def test_panel_runs_and_keeps_history() -> None:
    p = _panel()
    rec = p.click()
    assert rec is not None and rec.result == {"value": 2, "kind": "a"} and p.error is None
    p.set(n=5, kind="b")
    p.click()
    assert [r.result["value"] for r in p.history] == [2, 10]
    assert p.last.values == {"n": 5, "kind": "b"} and p.bar.value == 1.0
    outs = p.out.outputs
    assert outs[0]["output_type"] == "stream" and "value 10" in outs[0]["text"]
    assert "image/png" in outs[1]["data"]
    assert not p.busy and not p.button.disabled
    assert "done" in p.status.value


def test_panel_history_bound() -> None:
    p = _panel(max_history=3)
    for i in range(5):
        p.set(n=i + 1)
        p.click()
    assert [r.index for r in p.history] == [3, 4, 5]


def test_panel_refuses_bad_values() -> None:
    p = _panel()
    with pytest.raises(ValueError, match="unknown control"):
        p.set(size=3)
    with pytest.raises(ValueError, match=r"kind must be one of \['a', 'b'\]"):
        p.set(kind="z")
    with pytest.raises(ValueError, match=r"n must be in \[1, 20\]"):
        p.set(n=500)
    p.set(n=13)
    assert p.click() is None
    assert p.error == "Can't run with these settings: 13 is unlucky" and "unlucky" in p.status.value
    assert not p.button.disabled


def test_panel_unexpected_error_in_plain_words() -> None:
    def run(progress, n, kind):
        raise ZeroDivisionError("division by zero")

    p = _panel(run=run)
    p.click()
    assert p.error.startswith("The run failed: ZeroDivisionError")
    details = [o for o in p.out.outputs if o.get("metadata", {}).get("workbook_details")]
    assert len(details) == 1 and "<details>" in details[0]["data"]["text/html"]
    assert "Traceback" in details[0]["data"]["text/plain"] and "ZeroDivisionError" in details[0]["data"]["text/plain"]
    p.click()  # details replace earlier details
    assert len([o for o in p.out.outputs if o.get("metadata", {}).get("workbook_details")]) == 1


def test_panel_status_is_one_line_and_known_failures_become_advice() -> None:
    import helpers.pipeline.loaders  # noqa: F401  (the panel asks it to explain torch's loader errors)

    def run(progress, n, kind):
        if kind == "a":
            raise RuntimeError("DataLoader worker (pid(s) 4242) exited unexpectedly")
        raise RuntimeError("line one of a long error\n" + "\n".join(f"  frame {i}" for i in range(32)))

    p = _panel(run=run)
    p.click()
    assert "out-of-memory" in p.error and "/dev/shm" in p.error and "\n" not in p.error
    assert "\n" not in p.status.value and "<br" not in p.status.value
    tb = [o for o in p.out.outputs if o.get("metadata", {}).get("workbook_details")][0]["data"]["text/plain"]
    assert "exited unexpectedly" in tb  # the original error, in the output area
    p.set(kind="b")
    p.click()
    assert p.error == "The run failed: RuntimeError: line one of a long error"
    assert (
        "frame 31"
        in [o for o in p.out.outputs if o.get("metadata", {}).get("workbook_details")][0]["data"]["text/plain"]
    )
    assert widgets.one_line("a\nb  c", limit=4) == "a b…"


def test_panel_interrupt_restores_state() -> None:
    def run(progress, n, kind):
        raise KeyboardInterrupt

    p = _panel(run=run)
    p.click()
    assert "Interrupted" in p.error and not p.busy and not p.button.disabled


def test_double_click_starts_one_run() -> None:
    calls = []

    def run(progress, n, kind):
        calls.append(n)
        time.sleep(0.05)
        return {"value": n}

    p = _panel(run=run, debounce_s=0.5)
    p.button.click()
    p.button.click()  # queued behind the first: arrives right after it ends
    assert calls == [1]  # the queued click was ignored
    p.click()  # a deliberate click from Python is not a double click
    assert calls == [1, 1]


def test_click_while_busy_is_ignored() -> None:
    p, calls = None, []

    def run(progress, n, kind):
        calls.append(n)
        p.button.click()  # a click arriving during the run
        return {"value": n}

    p = _panel(run=run)
    p.click()
    assert len(p.history) == 1 and calls == [1]  # the click during the run was ignored


def test_timeline_and_stacked_plots() -> None:
    from matplotlib.figure import Figure

    rec = SpanRecorder("cpu")
    rec.add("load", 0, 0.0, 0.01)
    rec.add("compute", 0, 0.01, 0.03, lane="gpu")
    trace = rec.finish()
    ax = Figure().add_subplot()
    plots.timeline(trace, ax, source="Recorded on test")
    assert ax.get_xlabel() == "time since first span (ms)"
    assert [t.get_text() for t in ax.get_yticklabels()] == ["gpu", "host"]
    ax2 = Figure().add_subplot()
    plots.timeline(trace.to_dict(), ax2, max_steps=1)  # dict form, as stored in result files
    ax3 = Figure().add_subplot()
    ch01.stacked_phases({"a": {"load": 0.001, "h2d": 0.002}, "b": {"load": 0.003}}, ax3)
    assert ax3.get_ylabel() == "time per step (ms)"
    ax4 = Figure().add_subplot()
    figures.sweep_plot({"pinned": ([1, 10], [1, 2])}, ax4, xlabel="bytes", ylabel="GB/s", ceiling=(31.5, "theoretical"))
    assert ax4.get_xscale() == "log" and len(ax4.get_lines()) == 2
    assert plots.phase_color("load") == plots.PHASE_COLORS["load"]
    assert plots.phase_color("mystery") == plots.phase_color("mystery")


def test_exercise_check(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(config.GRADE_ENV, raising=False)
    r = exercises.check("t.1", None, 3.0, hint="think")
    assert r.status == "unanswered" and "Hint: think" in repr(r)
    assert exercises.check("t.1", 3.1, 3.0).correct  # within 5 %
    w = exercises.check("t.1", 4.0, 3.0)
    assert w.status == "wrong" and "too high" in w.message
    assert exercises.check("t.2", " B ", "b").correct
    assert exercises.check("t.3", "x", {"x", "y"}).correct
    assert not exercises.check("t.4", 1, True).correct
    assert exercises.check("t.5", 7, lambda a: a % 7 == 0).correct
    assert "odd" in exercises.check("t.6", 3, lambda a: "odd" if a % 2 else True).message
    assert not exercises.check("t.7", "three", 3.0).correct


def test_exercise_grade_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(config.GRADE_ENV, "1")
    with pytest.raises(AssertionError, match="not answered"):
        exercises.check("g.1", None, 1.0)
    with pytest.raises(AssertionError, match="not quite"):
        exercises.check("g.1", 2.0, 1.0)
    assert exercises.check("g.1", 1.0, 1.0).correct


def test_check_parts_shows_every_verdict(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(config.GRADE_ENV, raising=False)
    P = exercises.Part
    r = exercises.check_parts("9.9", a=P(True, expected=False, hint="once"), b=P(4.0, expected=4.0, explanation="ok"))
    lines = str(r).splitlines()
    assert len(lines) == 2 and "9.9a: not quite" in lines[0] and "9.9b: correct" in lines[1]
    assert r.status == "wrong" and not r.correct and "9.9a" in r._repr_html_() and "9.9b" in r._repr_html_()
    blank = exercises.check_parts("9.9", a=P(None, expected=False), b=P(None, expected=4.0))
    assert blank.status == "unanswered" and str(blank).count("not answered yet") == 2
    assert exercises.check_parts("9.9", a=P(False, expected=False), b=P(4.0, expected=4.0)).status == "correct"
    with pytest.raises(ValueError, match="at least one part"):
        exercises.check_parts("9.9")
    with pytest.raises(ValueError, match="must be a Part"):
        exercises.check_parts("9.9", a=(1, 1))  # type: ignore[arg-type]


def test_check_parts_grade_mode_names_every_wrong_part(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(config.GRADE_ENV, "1")
    P = exercises.Part
    with pytest.raises(AssertionError) as err:
        exercises.check_parts("9.8", a=P(True, expected=False), b=P(None, expected=4.0), c=P(1.0, expected=1.0))
    assert "9.8a" in str(err.value) and "9.8b" in str(err.value) and "9.8c" not in str(err.value)
    assert exercises.check_parts("9.8", a=P(False, expected=False)).correct


def test_status_names_the_settings_of_a_run_started_from_python() -> None:
    import ipywidgets as W

    from helpers.ui.widgets import Panel

    panel = Panel("demo", {"n": W.IntSlider(value=3, min=1, max=9)}, lambda progress, n: n * 2, debounce_s=0.0)
    panel.set(n=5)
    panel.click()
    assert "n=5" in panel.status.value and "notebook cell" in panel.status.value
    panel.button.click()
    assert "with the settings above" in panel.status.value


def test_strict_gpu_run_lets_a_checkers_cuda_error_through(monkeypatch: pytest.MonkeyPatch) -> None:
    """#24.3: the 05.3 checker re-raises a CUDA error under WORKBOOK_REQUIRE_GPU=1; check() must not swallow it."""
    monkeypatch.delenv(config.GRADE_ENV, raising=False)
    monkeypatch.setenv(config.REQUIRE_GPU_ENV, "1")

    def raises(exc: BaseException):
        def expected(answer: object) -> bool:
            raise exc

        return expected

    cuda_error = RuntimeError("CUDA error: an illegal memory access was encountered")
    with pytest.raises(RuntimeError, match="illegal memory access"):
        exercises.check("05.3", object(), expected=raises(cuda_error))
    with pytest.raises(RuntimeError, match="illegal memory access"):
        exercises.check_parts("05.9", a=exercises.Part(object(), expected=raises(cuda_error)))
    accel = getattr(__import__("torch"), "AcceleratorError", None)
    if accel is not None:  # torch's own class for CUDA errors (torch >= 2.8), matched by name
        with pytest.raises(accel):
            exercises.check("05.3", object(), expected=raises(accel.__new__(accel)))
    # Not a CUDA error: still a verdict naming it, even on a strict GPU run.
    r = exercises.check("05.3", object(), expected=raises(ValueError("odd answer")))
    assert r.status == "wrong" and "ValueError: odd answer" in r.message
    # Without the strict flag, a CUDA error is a verdict too (a reader's notebook never crashes on it).
    monkeypatch.setenv(config.REQUIRE_GPU_ENV, "0")
    r = exercises.check("05.3", object(), expected=raises(cuda_error))
    assert r.status == "wrong" and "CUDA error" in r.message


def test_a_panel_advises_on_a_loader_failure_without_reaching_up_a_layer() -> None:
    """Issue #27: the panel's advice looked ``helpers.pipeline.loaders`` up in ``sys.modules`` (a ui module
    reaching up a layer, unseen by the layer test), so a panel gave no advice unless that module happened to be
    loaded. The words now live in ``helpers.core.failures``: advice in a fresh interpreter that never loads it."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from helpers.ui import widgets\n"
        "from helpers.core.failures import LoaderFailure\n"
        "def advice(exc):\n"
        "    def run(progress):\n"
        "        raise exc\n"
        "    panel = widgets.Panel('t', {}, run)\n"
        "    assert panel.click() is None\n"
        "    return panel.error.removeprefix('The run failed: ')\n"
        "timeout = advice(RuntimeError('DataLoader timed out after 5 seconds'))\n"
        "assert 'within 5 s' in timeout, timeout\n"
        "assert advice(LoaderFailure('say this')) == 'say this'\n"
        "assert advice(RuntimeError('something else')) == 'RuntimeError: something else'\n"
        "assert 'helpers.pipeline.loaders' not in sys.modules, 'the panel imported the pipeline layer'\n"
        "print('ok')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
