"""Reference results recorded on real GPUs (``reference/*.json``, committed by ``make gpu-check``), and the honest
fallback when none holds a key: figures of the *same experiment* others published (``published_experiments.json``,
each with the quoted sentence holding its number), or which experiment would produce one. Nothing is made up.
"""

from __future__ import annotations

import fnmatch
import functools
import json
import os
import re
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from .results import ResultSet
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
