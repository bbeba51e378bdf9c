"""The live panel every chapter uses: controls wired to a run, a Run button, a progress bar, a history plot, and
errors shown inside it (one line in the status, the traceback folded below). It writes its output widget from the
kernel side (``out.outputs = ...``, never ``with out: print()``), so it behaves the same in JupyterLab, nbclient
and nbval; tests drive it from Python: ``panel.set(batch_size=64); record = panel.click()``.
"""

from __future__ import annotations

import base64
import html
import io
import textwrap
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import ipywidgets as W

from ..core.evidence import Evidence
from ..core.failures import LoaderFailure, explain_loader_error, raised_in_worker
from . import chapter as chapter_api


def one_line(text: str, limit: int = 400) -> str:
    """``text`` as one line for a status bar: whitespace (newlines included) collapsed, cut at ``limit``."""
    flat = " ".join(str(text).split())
    return flat if len(flat) <= limit else flat[: limit - 1].rstrip() + "…"


@dataclass
class RunRecord:
    index: int
    values: dict[str, Any]
    result: Any
    seconds: float
    summary: str = ""

    def short_label(self) -> str:
        return f"#{self.index} " + ", ".join(f"{k}={v}" for k, v in self.values.items())


PlotFn = Callable[[list[RunRecord], Any], None]


class Panel:
    """``controls`` named as ``run(progress, **values)``'s keywords; ``run`` raises ValueError in plain words for
    settings that can't run. A click within ``debounce_s`` of a run's end is a double-click queued during the run."""

    def __init__(
        self,
        title: str,
        controls: Mapping[str, W.ValueWidget],
        run: Callable[..., Any],
        *,
        summarize: Callable[[Any], str] | None = None,
        plot: PlotFn | None = None,
        max_history: int = 20,
        debounce_s: float = 0.3,
        figsize: tuple[float, float] = (7.5, 3.2),
    ) -> None:
        self.controls: dict[str, W.ValueWidget] = dict(controls)
        self._run_fn = run
        self._summarize = summarize
        self._plot = plot
        self.max_history = max_history
        self.debounce_s = float(debounce_s)
        self.figsize = figsize

        self.history: list[RunRecord] = []
        self.error: str | None = None
        self.busy = False
        self.runs_done = 0
        self._last_end = float("-inf")
        self.widget = self._layout(title)

    def _layout(self, title: str) -> W.VBox:
        self.button = W.Button(
            description="Run", button_style="primary", icon="play", tooltip="Run with these settings"
        )
        self.bar = W.FloatProgress(value=0.0, min=0.0, max=1.0, layout=W.Layout(width="180px"))
        # An HTML widget wraps a long progress text; a Label would cut it off with an ellipsis.
        self.bar_label = W.HTML(value="", layout=W.Layout(flex="1 1 auto", min_width="0"))
        self.status = W.HTML(value="<i>Set the controls, then press Run.</i>")
        self.out = W.Output(layout=W.Layout(min_height="40px"))
        self.button.on_click(self._on_click)
        head = W.HTML(value=f"<b>{html.escape(title)}</b>")
        for w in self.controls.values():
            if not w.layout.margin:
                w.layout.margin = "2px 16px 2px 0"
            style: Any = getattr(w, "style", None)  # descriptions whole: "prefetch_factor", not "prefetch_f…"
            if getattr(w, "description", "") and getattr(style, "description_width", "set") == "":
                style.description_width = "initial"
        ctl_box = W.Box(
            list(self.controls.values()),
            layout=W.Layout(display="flex", flex_flow="row wrap", max_width="100%"),
        )
        return W.VBox(
            [head, ctl_box, W.HBox([self.button, self.bar, self.bar_label]), self.status, self.out],
            layout=W.Layout(max_width="100%", overflow="hidden"),
        )

    @classmethod
    def for_chapter(cls, chapter: Any, *, device: Any, **context: Any) -> "Panel":
        """The live panel of a chapter module (:mod:`helpers.ui.chapter`). ``context`` (the reader's functions,
        the data set, sizes) reaches ``panel_controls`` and every ``panel_run``, beside the values and ``device``."""
        chapter_api.require(chapter)
        controls = chapter.panel_controls(**context)
        clash = sorted(set(controls) & set(context))  # a context key would silently override the control
        if clash:
            raise ValueError(
                f"Panel.for_chapter: {clash} are both panel controls and context keywords; "
                "pass each setting one way only"
            )

        def run(progress: Any, **values: Any) -> Evidence[Any]:
            result = chapter.panel_run(progress, device=device, **context, **values)
            if not isinstance(result, Evidence):
                raise TypeError(f"{chapter.__name__}.panel_run returned {type(result).__name__}, not an Evidence")
            return result

        return cls(
            chapter.PANEL_TITLE,
            controls,
            run,
            summarize=chapter.panel_summary,
            plot=chapter.panel_plot,
            figsize=getattr(chapter, "PANEL_FIGSIZE", (7.5, 3.2)),
        )

    def _ipython_display_(self) -> None:
        from IPython.display import display

        display(self.widget)

    def values(self) -> dict[str, Any]:
        return {k: w.value for k, w in self.controls.items()}

    def set(self, **values: Any) -> None:
        """Set control values as a reader would. Unknown names or refused values raise ValueError."""
        for k, v in values.items():
            if k not in self.controls:
                raise ValueError(f"unknown control {k!r}; this panel has {sorted(self.controls)}")
            w = self.controls[k]
            options = getattr(w, "options", None)
            if options is not None and not isinstance(w, W.SelectionRangeSlider):
                labels = [o[1] if isinstance(o, tuple) else o for o in options]
                if v not in labels:
                    raise ValueError(f"{k} must be one of {labels}, got {v!r}")
            try:
                w.value = v
            except Exception as exc:  # traitlets.TraitError and friends
                raise ValueError(f"{k}={v!r} refused by the control: {exc}") from None
            lo, hi = getattr(w, "min", None), getattr(w, "max", None)
            if lo is not None and hi is not None and w.value != v:
                raise ValueError(f"{k} must be in [{lo}, {hi}], got {v!r}")

    def click(self) -> RunRecord | None:
        """Press Run from Python: the new record, or None if nothing ran (refused during a run, never taken for
        a double-click as a browser's ``panel.button.click()`` may be)."""
        before = self.runs_done  # not len(history): history is capped at max_history
        self._on_click(force=True)
        return self.history[-1] if self.runs_done > before else None

    @property
    def last(self) -> RunRecord | None:
        return self.history[-1] if self.history else None

    def _progress(self, fraction: float, text: str = "") -> None:
        """The ``progress(fraction, text='')`` callback a run gets."""
        try:
            self.bar.value = min(1.0, max(0.0, float(fraction)))
        except (TypeError, ValueError):
            return
        if text:
            self.bar_label.value = html.escape(str(text))

    def _show_status(self, text: str, kind: str = "info") -> None:
        color = {"info": "#333", "ok": "#1a7f37", "error": "#b00020", "busy": "#7a5a00"}[kind]
        self.status.value = f"<span style='color:{color}'>{html.escape(one_line(text))}</span>"

    def _fail(self, text: str, exc: BaseException | None = None) -> None:
        """``text`` as the error, one line in the status; ``exc``'s traceback, folded, in the output area (replacing
        earlier details, under the last good plot)."""
        self.error = one_line(text)
        self._show_status(self.error, "error")
        if exc is None:
            return
        tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        summary = f"Details: {type(exc).__name__} (traceback, click to unfold)"
        block = {
            "output_type": "display_data",
            "data": {
                "text/html": f"<details><summary>{html.escape(summary)}</summary>"
                f"<pre>{html.escape(tb)}</pre></details>",
                "text/plain": f"{summary}\n{tb}",
            },
            "metadata": {"workbook_details": True},
        }
        old = [o for o in self.out.outputs if o.get("name") != "stderr"]
        self.out.outputs = tuple(o for o in old if not o.get("metadata", {}).get("workbook_details")) + (block,)

    def _on_click(self, _button: Any = None, force: bool = False) -> None:
        now = time.monotonic()
        if self.busy or (not force and (now - self._last_end) < self.debounce_s):
            return
        self.busy = self.button.disabled = True
        self.error, self.bar.value, self.bar_label.value = None, 0.0, ""
        values = self.values()
        self._show_status("Running…", "busy")
        t0 = time.perf_counter()
        try:
            result = self._run_fn(self._progress, **values)
            seconds = time.perf_counter() - t0
            summary = self._summarize(result) if self._summarize else ""
            rec = RunRecord(index=self.runs_done + 1, values=values, result=result, seconds=seconds, summary=summary)
            history = (self.history + [rec])[-self.max_history :]
            # Draw first, commit after: an interrupt or error while drawing leaves the
            # history and the output showing the last complete run (no half-drawn state).
            outputs = self._build_outputs(history)
            self.history[:] = history
            self.runs_done += 1
            self.out.outputs = outputs
            self.bar.value = 1.0
            # Which settings the result belongs to: a run a notebook cell started used values the reader did not choose.
            by_cell = "started by a notebook cell, with the settings the controls now show; change any and press Run"
            origin = f"{by_cell} for your own" if force else "with the settings above"
            self._show_status(f"Run #{rec.index} done in {seconds:.1f} s ({rec.short_label()}), {origin}.", "ok")
        except KeyboardInterrupt:
            self._fail("Interrupted. The run was stopped and its resources released; press Run to start again.")
        except MemoryError:
            self._fail("Out of memory: choose smaller sizes and press Run again.")
        except Exception as exc:  # a refused setting, or plain words for a known failure; the traceback below
            if isinstance(exc, ValueError) and not raised_in_worker(exc):  # a worker's: the data set's own error
                self._fail(f"Can't run with these settings: {exc}")
            else:
                advice = str(exc) if isinstance(exc, LoaderFailure) else explain_loader_error(exc)
                first = (str(exc).strip().splitlines() or [""])[0]
                self._fail("The run failed: " + (advice or f"{type(exc).__name__}: {first}"), exc)
        finally:
            self.busy = self.button.disabled = False
            self._last_end = time.monotonic()

    def _build_outputs(self, history: list[RunRecord]) -> tuple[dict[str, Any], ...]:
        """The output widget's new content (the latest summary and the history plot), not yet shown."""
        outputs: list[dict[str, Any]] = []
        last = history[-1]
        if last.summary:
            # Wrapped at word boundaries: JupyterLab breaks long output lines mid-word.
            text = textwrap.fill(f"Run #{last.index}: {last.summary}", width=110, break_long_words=False)
            outputs.append({"output_type": "stream", "name": "stdout", "text": text + "\n"})
        if self._plot is not None:
            from matplotlib.figure import Figure

            fig = Figure(figsize=self.figsize)
            ax = fig.add_subplot(1, 1, 1)
            self._plot(history, ax)
            fig.tight_layout()
            buf = io.BytesIO()  # a PNG: the same in every front-end (a Figure outside pyplot is never shown twice)
            fig.savefig(buf, format="png", dpi=100, bbox_inches="tight")
            data = {"image/png": base64.b64encode(buf.getvalue()).decode("ascii"), "text/plain": "<Figure>"}
            outputs.append({"output_type": "display_data", "data": data, "metadata": {}})
        return tuple(outputs)
