"""Progress for anything over about ten seconds: one callback, ``progress(fraction, text="")``, that long helpers
take; a panel hands them its bar, a cell ``with progress_bar("what") as progress:``."""

from __future__ import annotations

import contextlib
import sys
from typing import Any, Callable, Iterator

ProgressFn = Callable[..., None]


def no_progress(fraction: float, text: str = "") -> None:
    """Shows nothing (the default of long helpers)."""


class TqdmProgress:
    """A ``progress`` callback driving a tqdm bar counted in percent."""

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
def progress_bar(desc: str, *, enabled: bool = True) -> Iterator[TqdmProgress]:
    """A tqdm bar in percent (a widget in a notebook, text elsewhere), closed at the end."""
    from tqdm.auto import tqdm

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
    """A callback for one part of a job: its 0..1 maps onto ``start..stop`` of ``progress``; text gets ``prefix``."""
    if progress is None:
        return no_progress

    def part(fraction: float, text: str = "") -> None:
        try:
            f = min(1.0, max(0.0, float(fraction)))
        except (TypeError, ValueError):
            return
        progress(start + (stop - start) * f, prefix + text if text else prefix.rstrip(": "))

    return part
