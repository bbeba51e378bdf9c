"""Progress for anything that runs longer than about ten seconds.

The workbook's one progress convention is a callback ``progress(fraction, text="")``:
``fraction`` is the share done (0 to 1), ``text`` says what is happening and what is
left. Long helpers (data set generation, training epochs, waterfalls, sweeps) take an
optional ``progress`` argument of that shape; the live panels hand them one that moves
the panel's own bar (:class:`helpers.ui.widgets.Progress`), and a notebook cell or a
script gets one from :func:`progress_bar`::

    with progress_bar("generating JPEGs") as progress:
        data.make_shapes_dataset(progress=progress)

The bar is tqdm's: a widget in a notebook, text on stderr in a terminal.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any, Callable, Iterator

__all__ = ["ProgressFn", "TqdmProgress", "progress_bar", "no_progress", "scaled"]

ProgressFn = Callable[..., None]
"""``progress(fraction, text="")``: the callback every long helper accepts."""


def no_progress(fraction: float, text: str = "") -> None:
    """A ``progress`` callback that shows nothing (the default of long helpers)."""


class TqdmProgress:
    """A ``progress(fraction, text)`` callback that drives a tqdm bar counted in percent."""

    def __init__(self, bar: Any) -> None:
        self.bar = bar

    def __call__(self, fraction: float, text: str = "") -> None:
        try:
            target = int(round(100 * min(1.0, max(0.0, float(fraction)))))
        except (TypeError, ValueError):
            return
        if target > self.bar.n:
            self.bar.update(target - self.bar.n)
        if text:
            self.bar.set_postfix_str(str(text)[:70], refresh=True)


@contextlib.contextmanager
def progress_bar(desc: str, *, enabled: bool = True, notebook: bool | None = None) -> Iterator[TqdmProgress]:
    """``with progress_bar("what") as progress:`` - a tqdm bar in percent, closed at the end.

    Args:
        desc: what runs, shown before the bar.
        enabled: ``False`` gives a bar that draws nothing (same code path).
        notebook: force the widget bar (``True``) or the text bar (``False``); ``None``
            lets ``tqdm.auto`` decide (a widget inside Jupyter).
    """
    if notebook is None:
        from tqdm.auto import tqdm
    elif notebook:
        from tqdm.notebook import tqdm
    else:
        from tqdm import tqdm
    bar = tqdm(
        total=100,
        desc=desc,
        unit="%",
        disable=not enabled,
        file=sys.stderr,
        bar_format="{desc}: {percentage:3.0f}%|{bar}| [{elapsed}<{remaining}{postfix}]",
    )
    try:
        yield TqdmProgress(bar)
    finally:
        bar.close()


def scaled(progress: ProgressFn | None, start: float, stop: float, prefix: str = "") -> ProgressFn:
    """A callback for one part of a longer job: its 0..1 maps onto ``start..stop`` of ``progress``.

    >>> seen = []
    >>> part = scaled(lambda f, t="": seen.append((round(f, 2), t)), 0.5, 1.0, "epoch 2: ")
    >>> part(0.5, "step 3 of 6")
    >>> seen
    [(0.75, 'epoch 2: step 3 of 6')]
    """
    if progress is None:
        return no_progress

    def part(fraction: float, text: str = "") -> None:
        try:
            f = min(1.0, max(0.0, float(fraction)))
        except (TypeError, ValueError):
            return
        progress(start + (stop - start) * f, prefix + text if text else prefix.rstrip(": "))

    return part
