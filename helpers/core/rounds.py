"""The one way to compare configurations (alternating rounds) and the one table renderer (:func:`table`).

All of A then all of B is at the mercy of the machine's speed at the time (a shared or turbo-boosting CPU moves by a
third within seconds): :func:`alternate` runs each once per round, the order reversed every other round, so drift
hits all alike; ratios are taken within a round.
"""

from __future__ import annotations

import contextlib
import inspect
import statistics
from dataclasses import dataclass, field
from typing import Callable, Iterator, Mapping, Sequence

import torch

from .progress import ProgressFn, scaled
from .validate import check_int

Measure = Callable[..., float]  # one figure (seconds, items/s, ...); given progress= if it takes one


@dataclass
class Rounds:
    labels: tuple[str, ...]
    values: dict[str, list[float]] = field(default_factory=dict)

    @property
    def n(self) -> int:
        """How many rounds ran to the end."""
        return min((len(v) for v in self.values.values()), default=0)

    def median(self, label: str) -> float:
        return statistics.median(self.values[label])

    def ratios(self, label: str, base: str) -> list[float]:
        """``label / base`` within each round (figures taken seconds apart)."""
        return [a / b for a, b in zip(self.values[label], self.values[base]) if b]

    def ratio(self, label: str, base: str) -> float:
        return statistics.median(self.ratios(label, base))


def _takes_progress(fn: Callable[..., float]) -> bool:
    try:
        return "progress" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def alternate(measures: Mapping[str, Measure], rounds: int, *, progress: ProgressFn | None = None) -> Rounds:
    """Run each of ``measures`` (label -> a function returning one figure, given ``progress=`` if it takes one)
    once per round, the order reversed every other round; ``progress`` is told which round and label runs."""
    rounds = check_int("rounds", rounds, 1, 1000)
    if not measures:
        raise ValueError("alternate() needs at least one configuration to measure")
    labels = tuple(measures)
    out = Rounds(labels, {k: [] for k in labels})
    total = rounds * len(labels)
    for r in range(rounds):
        order = labels if r % 2 == 0 else labels[::-1]
        for k, label in enumerate(order):
            done = r * len(labels) + k
            fn = measures[label]
            part = scaled(progress, done / total, (done + 1) / total, f"round {r + 1}/{rounds}, {label}: ")
            part(0.0)
            value = fn(progress=part) if _takes_progress(fn) else fn()
            out.values[label].append(float(value))
    if progress is not None:
        progress(1.0, "done")
    return out


def table(headers: Sequence[str], rows: Sequence[Sequence[object]], *, left: int = 1, gap: int = 2) -> list[str]:
    """A fixed-width text table, the first ``left`` columns left-aligned; format numbers before (``str()`` only).

    >>> table(["workers", "items/s"], [[0, "1,204"], [2, "2,310"]])
    ['workers  items/s', '0          1,204', '2          2,310']
    """
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    if any(len(row) != len(headers) for row in cells):
        raise ValueError(f"every row needs {len(headers)} cells, one per header {list(headers)}")
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    pad = " " * gap
    return [
        pad.join(c.ljust(w) if i < left else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))).rstrip()
        for row in cells
    ]


@contextlib.contextmanager
def intraop_threads(n: int) -> Iterator[int]:
    """``with intraop_threads(n):`` torch uses ``n`` intra-op threads here, restored after (fair comparisons)."""
    check_int("threads", n, 1, 1024)
    prev = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield n
    finally:
        torch.set_num_threads(prev)
