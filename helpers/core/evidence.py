"""One result type for every figure a chapter shows: measured here, recorded on a named GPU, published (cited),
theoretical, or missing. A chapter's measuring function returns an :class:`Evidence` whichever path ran and the
notebook shows it with one call (``ev.show(fmt)``), provenance included, so a number never reads as more than it is.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Generic, Literal, TypeVar

import torch

from .device import no_cuda_message
from .reference import CitedFigure, cited_for, missing_message, no_published_sentence, provenance_line, references
from .results import Record, ResultSet
from .validate import wrap

T = TypeVar("T")
Kind = Literal["measured", "recorded", "published", "theoretical", "missing"]

#: Each kind and the tag that opens its provenance line.
KINDS: dict[str, str] = {"measured": "measured here", "recorded": "recorded elsewhere", "published": "published"}
KINDS.update(theoretical="theoretical", missing="missing")


@dataclass(frozen=True)
class Evidence(Generic[T]):
    """A figure (``value``; None exactly when missing, or when it only cites others' figures, which are text,
    never drawn: ``if ev: plot(ev.value)`` stays right) with its provenance line ``source`` and a ``note``."""

    what: str
    kind: Kind
    value: T | None = None
    source: str = ""
    note: str = ""
    cited: tuple[CitedFigure, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if self.cited and (self.kind != "published" or self.value is not None):
            raise ValueError("cited figures belong to a 'published' Evidence without a value of its own")
        if (self.value is None) != (self.kind == "missing" or bool(self.cited)):
            raise ValueError("an Evidence has a value exactly when its kind is not 'missing' (or it only cites)")
        if not self.what:
            raise ValueError("what must say what the figure is")

    def __bool__(self) -> bool:
        return self.value is not None

    @property
    def here(self) -> bool:
        return self.kind == "measured"

    def header(self) -> str:
        return f"[{KINDS[self.kind]}] {self.what}: {self.source}"

    def lines(self, fmt: Callable[[T], str | Iterable[str]] | None = None) -> list[str]:
        """The printed form: the note, the header, then ``fmt(value)`` (a string or lines), if any."""
        out = [self.note] if self.note else []
        out.append(wrap(" ".join(self.header().split())))  # a source may come pre-wrapped: wrap it once, here
        if self.value is not None and fmt is not None:
            body = fmt(self.value)
            out.extend([body] if isinstance(body, str) else list(body))
        for fig in self.cited:
            out.extend(fig.lines())
        return out

    def show(self, fmt: Callable[[T], str | Iterable[str]] | None = None) -> None:
        print("\n".join(self.lines(fmt)))

    def __str__(self) -> str:
        return "\n".join(self.lines())


def measured(what: str, value: T, device: torch.device | str | None = None, method: str = "") -> Evidence[T]:
    dev = torch.device(device) if device is not None else None
    if dev is not None and dev.type == "cuda" and torch.cuda.is_available():
        where = f"{torch.cuda.get_device_name(dev)} ({dev})"
    else:
        where = str(dev) if dev is not None else "this machine"
    source = f"measured now on {where}, torch {torch.__version__}" + (f"; method: {method}" if method else "")
    return Evidence(what, "measured", value, source)


def recorded(
    what: str,
    key: str,
    convert: Callable[[ResultSet, list[Record]], T] | None = None,
    note: str = "",
    **params: Any,
) -> Evidence[Any]:
    """The newest reference file's records for ``key`` (and ``params``) through ``convert(rs, records)``
    (None: missing); else :func:`published_elsewhere`."""
    hits = [(rs, recs) for rs in references() if (recs := rs.find(key, **params))]
    return _newest(what, hits, convert, note) or published_elsewhere(what, key, note)


def recorded_artifact(
    what: str, name: str, convert: Callable[[ResultSet, Any], T] | None = None, note: str = ""
) -> Evidence[Any]:
    """The newest reference file's artifact ``name`` (a span trace), converted; else published elsewhere."""
    hits = [(rs, rs.artifacts[name]) for rs in references() if name in rs.artifacts]
    return _newest(what, hits, convert, note) or published_elsewhere(what, name, note, f"artifact {name}")


def _newest(what: str, hits: Iterable[tuple[ResultSet, Any]], convert: Any, note: str) -> Evidence[Any] | None:
    for rs, raw in hits:
        value = convert(rs, raw) if convert is not None else raw
        if value is not None:
            return Evidence(what, "recorded", value, provenance_line(rs) + " (not this machine)", note)
    return None


def theoretical(what: str, value: T, basis: str) -> Evidence[T]:
    if not basis:
        raise ValueError("a theoretical figure needs its basis")
    return Evidence(what, "theoretical", value, f"theoretical: {basis}")


def published_elsewhere(what: str, key: str, note: str = "", label: str | None = None) -> Evidence[Any]:
    """Figures of the experiment behind ``key`` published elsewhere (falsy: no value of its own); else missing."""
    figs = cited_for(key)
    if figs:
        source = (
            f"No reference results for {what} ({label or key}) have been recorded by this workbook on a real "
            "GPU yet (`make gpu-check` records them); shown instead: figures of the same experiment "
            "published by others (not this machine, not this workbook's setup)"
        )
        return Evidence(what, "published", None, source, note, cited=figs)
    reason = missing_message(f"{what} ({label or key})")
    none = no_published_sentence(key)
    if none is None:
        none = "No published figure of this experiment was found either; running the chapter on a GPU produces one."
    return missing(what, note=note, reason=f"{reason} {none}")


def missing(what: str, reason: str | None = None, note: str = "") -> Evidence[Any]:
    return Evidence(what, "missing", None, reason or missing_message(what), note)


def measure_or_recall(
    what: str,
    device: torch.device | str,
    measure: Callable[[], T],
    key: str,
    convert: Callable[[ResultSet, list[Record]], Any] | None = None,
    method: str = "",
    **params: Any,
) -> Evidence[Any]:
    """Measure on a CUDA ``device``; without one, :func:`recorded` for ``key`` with the no-CUDA sentence as note."""
    dev = torch.device(device)
    if dev.type == "cuda":
        return measured(what, measure(), dev, method)
    return recorded(what, key, convert, note=no_cuda_message(what), **params)
