"""One result type for every figure a chapter shows: measured here, recorded on a named GPU (``reference/*.json``,
committed by ``make gpu-check``), published by others (``published_experiments.json``, each with the quoted sentence
holding its number), theoretical, or missing. A chapter's measuring function returns an :class:`Evidence` whichever
path ran and the notebook shows it with one call (``ev.show(fmt)``), provenance included, so a number never reads as
more than it is. Nothing is made up.
"""

from __future__ import annotations

import fnmatch
import functools
import json
import os
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Generic, Literal, TypeVar

import torch

from .device import no_cuda_message
from .results import Record, ResultSet
from .validate import check_fields, wrap

REFERENCE_ENV = "WORKBOOK_REFERENCE_DIR"


def reference_dir() -> Path:
    """``$WORKBOOK_REFERENCE_DIR`` (tests), else the packaged folder."""
    raw = os.environ.get(REFERENCE_ENV)
    return Path(raw) if raw else Path(__file__).resolve().parent / "reference"


def references() -> list[ResultSet]:
    """Every reference result set, newest first; an unreadable file is skipped with a warning line."""
    out: list[ResultSet] = []
    for path in sorted(reference_dir().glob("*.json")):  # no folder: none
        try:
            out.append(ResultSet.load(path))
        except (OSError, ValueError) as exc:
            print(f"warning: skipping reference file {path.name}: {exc}")
    out.sort(key=lambda r: r.created, reverse=True)
    return out


def provenance_line(rs: ResultSet) -> str:
    return f"Recorded on {rs.label()}; method: {rs.method}"


def missing_message(what: str) -> str:
    """The plain sentence shown when no reference holds ``what``."""
    return wrap(
        f"No reference results for {what} have been recorded on a real GPU yet. "
        "They are recorded by running `make gpu-check` on a machine with a CUDA GPU (see README); "
        "nothing is shown rather than a made-up number."
    )


_PUBLISHED = Path(__file__).resolve().parent / "published_experiments.json"
_DATE = re.compile(r"^\d{4}-\d{2}-\d{2}$")


@dataclass(frozen=True)
class CitedFigure:
    """A figure of a workbook experiment published by someone else, as published: ``quote`` is the source's
    sentence holding the number (verbatim), ``compared`` what was set against what."""

    id: str
    experiment: tuple[str, ...]  # record keys (glob patterns) this figure is evidence for
    what: str
    value: float
    unit: str
    compared: str
    gpu: str
    software: str
    method: str
    url: str
    where: str
    quote: str
    published: str
    date_read: str
    notes: str

    def matches(self, key: str) -> bool:
        return any(fnmatch.fnmatchcase(key, pattern) for pattern in self.experiment)

    def lines(self) -> list[str]:
        rows = [
            ("  ", f"{self.what}: {_number_text(self.value)} {self.unit}"),
            ("    ", f"compared: {self.compared}"),
            ("    ", f"on: {self.gpu}; {self.software}"),
            ("    ", f"method: {self.method}"),
            ("    ", f'the source says: "{" ".join(self.quote.split())}"'),
            ("    ", f"source: {self.where}, {self.url} (read {self.date_read})"),
        ]
        if self.notes:
            rows.append(("    ", f"note: {self.notes}"))
        return [wrap(pad + text, indent=pad + "  ") for pad, text in rows]


_CITED_FIELDS = tuple(f.name for f in fields(CitedFigure))
_CITED_TYPES: dict[str, Any] = {**dict.fromkeys(_CITED_FIELDS, str), "value": (int, float), "experiment": list}
_NOT_EMPTY_EXEMPT = ("url", "date_read", "notes")  # checked on their own terms; notes may be ''


def _number_text(value: float) -> str:
    return f"{value:g}" if float(value).is_integer() else repr(float(value))


def _check_figure(raw: Any, where: str) -> CitedFigure:
    check_fields(where, raw, _CITED_TYPES, required=_CITED_FIELDS)
    where, value, exp = f"{where} ({raw['id']})", raw["value"], raw["experiment"]
    empty = [n for n, kind in _CITED_TYPES.items() if kind is str and n not in _NOT_EMPTY_EXEMPT and not raw[n].strip()]
    if empty:
        raise ValueError(f"{where}: field {empty[0]!r} must be a non-empty string")
    if not raw["url"].startswith("https://"):
        raise ValueError(f"{where}: url must be an https address, got {raw['url']!r}")
    if not _DATE.match(raw["date_read"]):
        raise ValueError(f"{where}: date_read must be YYYY-MM-DD, got {raw['date_read']!r}")
    if value <= 0:
        raise ValueError(f"{where}: value must be a positive number, got {value!r}")
    if _number_text(value) not in raw["quote"].replace(",", ""):
        raise ValueError(
            f"{where}: the quote must contain the value {_number_text(value)} as published "
            "(copy the sentence or table row that holds it)"
        )
    if not exp or not all(isinstance(e, str) and e.startswith("ch") for e in exp):
        raise ValueError(f"{where}: experiment must list record keys like 'ch05.decode.ms_per_batch'")
    return CitedFigure(**{**{k: raw[k] for k in _CITED_FIELDS}, "experiment": tuple(exp), "value": float(value)})


def load_published_experiments(path: Path | str | None = None) -> tuple[tuple[CitedFigure, ...], dict[str, str]]:
    """The cited figures and 'none found' sentences of ``path`` (default: the packaged file), checked: a ValueError
    names the entry and the field when one is missing or bad, or a quote does not hold its value."""
    p = Path(path) if path is not None else _PUBLISHED
    data = json.loads(p.read_text(encoding="utf-8"))
    figures = tuple(_check_figure(raw, f"{p.name} figure {i}") for i, raw in enumerate(data.get("figures", [])))
    ids = [f.id for f in figures]
    if len(set(ids)) != len(ids):
        raise ValueError(f"{p.name}: duplicate figure ids")
    none_found = data.get("none_found", {})
    if not isinstance(none_found, dict) or not all(isinstance(v, str) and v.strip() for v in none_found.values()):
        raise ValueError(f"{p.name}: none_found maps a record key (pattern) to the experiment that would give one")
    return figures, dict(none_found)


_cached = functools.cache(load_published_experiments)


def cited_for(key: str) -> tuple[CitedFigure, ...]:
    """The published figures of the experiment behind record key (or artifact name) ``key``."""
    figures, _ = _cached()
    return tuple(f for f in figures if f.matches(key))


def no_published_sentence(key: str) -> str | None:
    """'No published figure of this experiment was found; <what would produce one>', or None if not listed."""
    _, none_found = _cached()
    for pattern, experiment in none_found.items():
        if fnmatch.fnmatchcase(key, pattern):
            return (
                f"No published figure of this experiment was found; one would come from this experiment: {experiment}"
            )
    return None


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
    no_published: str | None = None,
    **params: Any,
) -> Evidence[Any]:
    """The newest reference file's records for ``key`` (and ``params``) through ``convert(rs, records)``
    (None: missing); else :func:`published_elsewhere`, or, given ``no_published`` (why the figures cited for ``key``
    do not show this), missing with that sentence."""
    hits = [(rs, recs) for rs in references() if (recs := rs.find(key, **params))]
    found = _newest(what, hits, convert, note)
    if found is not None:
        return found
    if no_published is not None:
        return missing(what, reason=f"{missing_message(f'{what} ({key})')} {no_published}", note=note)
    return published_elsewhere(what, key, note)


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
            "GPU yet (`make gpu-check` records them); shown instead: figures others published on this experiment "
            "or a closely related one, each saying what it measured (not this machine, not this workbook's setup)"
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
    no_published: str | None = None,
    **params: Any,
) -> Evidence[Any]:
    """Measure on a CUDA ``device``; without one, :func:`recorded` for ``key`` (``no_published``: see there) with the
    no-CUDA sentence as note."""
    dev = torch.device(device)
    if dev.type == "cuda":
        return measured(what, measure(), dev, method)
    return recorded(what, key, convert, note=no_cuda_message(what), no_published=no_published, **params)
