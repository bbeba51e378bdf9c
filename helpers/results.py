"""One JSON format for measurements, with provenance.

A :class:`ResultSet` is a list of :class:`Record` s (a named value with a unit
and the parameters it was measured at, plus optional spread) and free-form
``artifacts`` (e.g. span traces for timelines), together with the provenance
that makes it trustworthy: the hardware, driver and library versions, the
date, the method, a benchmark version and quick/full mode.

Comparisons are ratios within matching records, and only between result sets
taken on the same hardware: :func:`compare` refuses otherwise, because a ratio
between an H100 and a laptop says nothing about either.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable

from .config import mode_name

__all__ = [
    "SCHEMA",
    "SCHEMA_VERSION",
    "BENCHMARK_VERSION",
    "Record",
    "ResultSet",
    "Comparison",
    "NotComparableError",
    "comparable",
    "compare",
    "collect_provenance",
]

SCHEMA = "gpu-data-workbook/results"
SCHEMA_VERSION = 1
#: Bump when a benchmark's method changes so old and new figures are not mixed up.
BENCHMARK_VERSION = "2"  # 2: ch04.speedup measured in alternating rounds


class NotComparableError(ValueError):
    """Raised when two result sets were measured on different hardware."""


@dataclass
class Record:
    """One measured value.

    Attributes:
        key: what was measured, dotted, prefixed by chapter, e.g. ``"ch02.h2d_bandwidth"``.
        value: the number (median, for timings).
        unit: its unit, e.g. ``"GB/s"``, ``"s"``, ``"items/s"``, ``"ratio"``.
        params: the settings it was measured at, e.g. ``{"bytes": 4096, "memory": "pinned"}``.
        spread: optional spread, e.g. ``{"iqr": 0.1, "n": 30}``.
    """

    key: str
    value: float
    unit: str
    params: dict[str, Any] = field(default_factory=dict)
    spread: dict[str, Any] = field(default_factory=dict)

    def ident(self) -> tuple[str, str]:
        """Identity used to match records across result sets (key + params)."""
        return self.key, json.dumps(self.params, sort_keys=True, default=str)


def collect_provenance(device: Any = None) -> dict[str, Any]:
    """Hardware and software facts for a result file (see :mod:`helpers.device`)."""
    from .device import hardware_report

    rep = hardware_report(device)
    return {
        "hardware": rep.fingerprint(),
        "report": rep.to_dict(),
        "driver_version": rep.driver_version,
        "cuda_runtime_version": rep.cuda_runtime_version,
        "torch_version": rep.torch_version,
        "torchvision_version": rep.torchvision_version,
        "python_version": rep.python_version,
        "platform": rep.platform,
    }


@dataclass
class ResultSet:
    """Measurements plus their provenance. Build one with :meth:`new`."""

    name: str
    method: str
    provenance: dict[str, Any]
    created: str
    mode: str
    benchmark_version: str = BENCHMARK_VERSION
    records: list[Record] = field(default_factory=list)
    artifacts: dict[str, Any] = field(default_factory=dict)
    notes: str = ""

    @classmethod
    def new(cls, name: str, method: str, device: Any = None, notes: str = "") -> "ResultSet":
        """A fresh, empty result set with provenance collected from this machine now."""
        if not name or not isinstance(name, str):
            raise ValueError("name must be a non-empty string")
        return cls(
            name=name,
            method=method,
            provenance=collect_provenance(device),
            created=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            mode=mode_name(),
            notes=notes,
        )

    # -- records -------------------------------------------------------------
    def add(self, key: str, value: float, unit: str, spread: dict[str, Any] | None = None, **params: Any) -> Record:
        """Append a record; returns it. ``value`` must be a finite number."""
        if not isinstance(key, str) or not key:
            raise ValueError("key must be a non-empty string such as 'ch02.h2d_bandwidth'")
        try:
            v = float(value)
        except (TypeError, ValueError):
            raise ValueError(f"value for {key!r} must be a number, got {value!r}") from None
        if not math.isfinite(v):
            raise ValueError(f"value for {key!r} must be finite, got {value!r}")
        rec = Record(key=key, value=v, unit=str(unit), params=dict(params), spread=dict(spread or {}))
        self.records.append(rec)
        return rec

    def find(self, key: str, **params: Any) -> list[Record]:
        """Records whose key equals ``key`` (or starts with ``key + '.'``) and whose params include ``params``."""
        out = []
        for r in self.records:
            if r.key != key and not r.key.startswith(key + "."):
                continue
            if all(r.params.get(k) == v for k, v in params.items()):
                out.append(r)
        return out

    def keys(self) -> list[str]:
        return sorted({r.key for r in self.records})

    # -- provenance ------------------------------------------------------------
    @property
    def hardware(self) -> dict[str, Any]:
        return dict(self.provenance.get("hardware", {}))

    def label(self) -> str:
        """A one-line provenance label for plots and tables."""
        hw = self.hardware
        gpu = hw.get("gpu_name") or "no GPU"
        p = self.provenance
        return (
            f"{gpu}, driver {p.get('driver_version') or 'n/a'}, torch {p.get('torch_version')}, "
            f"{self.created[:10]}, {self.mode} mode"
        )

    # -- files -----------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["schema"] = SCHEMA
        data["schema_version"] = SCHEMA_VERSION
        return data

    def save(self, path: str | Path) -> Path:
        """Write JSON (atomically: a reader never sees half a file)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=1, sort_keys=True, default=str) + "\n", encoding="utf-8")
        tmp.replace(path)
        return path

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ResultSet":
        if data.get("schema") != SCHEMA:
            raise ValueError(f"not a workbook result file (schema is {data.get('schema')!r}, expected {SCHEMA!r})")
        if int(data.get("schema_version", 0)) > SCHEMA_VERSION:
            raise ValueError(
                f"result file has schema_version {data.get('schema_version')}, newer than this workbook "
                f"understands ({SCHEMA_VERSION}); update the workbook"
            )
        missing = [k for k in ("name", "method", "provenance", "created", "mode") if k not in data]
        if missing:
            raise ValueError(f"result file lacks required fields: {', '.join(missing)}")
        return cls(
            name=data["name"],
            method=data["method"],
            provenance=data["provenance"],
            created=data["created"],
            mode=data["mode"],
            benchmark_version=str(data.get("benchmark_version", "?")),
            records=[Record(**r) for r in data.get("records", [])],
            artifacts=dict(data.get("artifacts", {})),
            notes=data.get("notes", ""),
        )

    @classmethod
    def load(cls, path: str | Path) -> "ResultSet":
        """Read a result file; a clear ValueError if it is not one."""
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"no result file at {path}")
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path} is not valid JSON ({exc}); was the run interrupted while writing?") from None
        return cls.from_dict(data)


def comparable(a: ResultSet, b: ResultSet) -> tuple[bool, str]:
    """Whether ratios between ``a`` and ``b`` mean anything, and why not if not."""
    ha, hb = a.hardware, b.hardware
    diffs = [f"{k}: {ha.get(k)!r} vs {hb.get(k)!r}" for k in sorted(set(ha) | set(hb)) if ha.get(k) != hb.get(k)]
    if diffs:
        return False, "different hardware (" + "; ".join(diffs) + ")"
    if a.benchmark_version != b.benchmark_version:
        return False, f"different benchmark versions ({a.benchmark_version} vs {b.benchmark_version})"
    return True, "same hardware and benchmark version"


@dataclass
class Comparison:
    """Ratios ``b / a`` for every record present in both sets."""

    rows: list[tuple[str, dict[str, Any], float, float, float, str]]
    note: str

    def ratio(self, key: str, **params: Any) -> float | None:
        for k, p, _, _, r, _ in self.rows:
            if k == key and all(p.get(n) == v for n, v in params.items()):
                return r
        return None

    def lines(self) -> list[str]:
        return [f"{k} {p}: {va:.4g} -> {vb:.4g} {unit}  (x{r:.2f})" for k, p, va, vb, r, unit in self.rows]


def compare(a: ResultSet, b: ResultSet, keys: Iterable[str] | None = None) -> Comparison:
    """Ratios ``b/a`` per matching record. Raises NotComparableError on different hardware."""
    ok, why = comparable(a, b)
    if not ok:
        raise NotComparableError(
            f"refusing to compare {a.name!r} and {b.name!r}: {why}. Show each as 'recorded on ...' instead."
        )
    wanted = set(keys) if keys is not None else None
    index_b = {r.ident(): r for r in b.records}
    rows = []
    for ra in a.records:
        if wanted is not None and ra.key not in wanted:
            continue
        rb = index_b.get(ra.ident())
        if rb is None or ra.value == 0:
            continue
        rows.append((ra.key, ra.params, ra.value, rb.value, rb.value / ra.value, ra.unit))
    return Comparison(rows=rows, note=why)
