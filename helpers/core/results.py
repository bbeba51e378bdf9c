"""One JSON format for measurements (:class:`ResultSet`: records and artifacts), with provenance (hardware,
versions, date, method, size tier). Ratios only between sets from the same hardware: an H100 over a laptop says
nothing about either."""

from __future__ import annotations

import copy
import datetime as _dt
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable

from .config import mode_name
from .validate import check_fields

SCHEMA = "gpu-data-workbook/results"
SCHEMA_VERSION = 1
BENCHMARK_VERSION = "2"  # bumped when a method changes (2: ch04.speedup in alternating rounds)


class NotComparableError(ValueError):
    """Two result sets measured on different hardware."""


@dataclass
class Record:
    """One value (the median, for timings) at ``params``, with optional ``spread`` (``{"iqr": 0.1, "n": 30}``)
    and ``flags``: why it cannot be right (not written when empty)."""

    key: str
    value: float
    unit: str
    params: dict[str, Any] = field(default_factory=dict)
    spread: dict[str, Any] = field(default_factory=dict)
    flags: list[str] = field(default_factory=list)

    def flag(self, why: str) -> None:
        if why not in self.flags:
            self.flags.append(why)

    def ident(self) -> tuple[str, str]:
        return self.key, json.dumps(self.params, sort_keys=True, default=str)


@dataclass
class ResultSet:
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
        from .device import hardware_report  # heavy: torch (this module imports without it)

        if not name or not isinstance(name, str):
            raise ValueError("name must be a non-empty string")
        rep = asdict(hardware_report(device))
        hardware = "gpu_name gpu_count cpu_model cpu_cores_logical pcie_generation_max pcie_width_max"  # comparable?
        versions = "driver_version cuda_runtime_version torch_version torchvision_version python_version platform"
        provenance = {"hardware": {n: rep[n] for n in hardware.split()}, "report": rep}
        return cls(
            name=name,
            method=method,
            provenance=provenance | {n: rep[n] for n in versions.split()},
            created=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            mode=mode_name(),
            notes=notes,
        )

    def add(self, key: str, value: float, unit: str, spread: dict[str, Any] | None = None, **params: Any) -> Record:
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
        sanity_flags([rec])  # a fraction above 1 is flagged where it is recorded
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

    @property
    def hardware(self) -> dict[str, Any]:
        return dict(self.provenance.get("hardware", {}))

    def label(self) -> str:
        gpu, p = self.hardware.get("gpu_name") or "no GPU", self.provenance
        driver = p.get("driver_version") or "n/a"
        return f"{gpu}, driver {driver}, torch {p.get('torch_version')}, {self.created[:10]}, {self.mode} mode"

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        for rec in data["records"]:
            if not rec.get("flags"):
                rec.pop("flags", None)  # files stay as they were for ordinary records
        data["schema"] = SCHEMA
        data["schema_version"] = SCHEMA_VERSION
        return data

    def save(self, path: str | Path) -> Path:
        """Write JSON atomically (a reader never sees half a file)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=1, sort_keys=True, default=str) + "\n", encoding="utf-8")
        tmp.replace(path)
        return path

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ResultSet":
        """A result set from its JSON form, checked: a ValueError names what is wrong (a hand-edited file)."""
        if not isinstance(data, dict) or data.get("schema") != SCHEMA:
            got = data.get("schema") if isinstance(data, dict) else f"a JSON {type(data).__name__}"
            raise ValueError(f"not a workbook result file (schema is {got!r}, expected {SCHEMA!r})")
        if int(data.get("schema_version", 0)) > SCHEMA_VERSION:
            raise ValueError(
                f"result file has schema_version {data.get('schema_version')}, newer than this workbook "
                f"understands ({SCHEMA_VERSION}); update the workbook"
            )
        check_fields("result file", data, _FILE_FIELDS, required=("name", "method", "provenance", "created", "mode"))
        if not isinstance(data["provenance"].get("hardware", {}), dict):
            raise ValueError("result file field 'provenance' must be an object (with 'hardware' an object)")
        fixed = {k: data[k] for k in ("name", "method", "provenance", "created", "mode")}
        records = [_record_from_dict(i, r) for i, r in enumerate(data.get("records", []))]
        version, notes = str(data.get("benchmark_version", "?")), str(data.get("notes", ""))
        return cls(
            **fixed, benchmark_version=version, records=records, artifacts=dict(data.get("artifacts", {})), notes=notes
        )

    @classmethod
    def load(cls, path: str | Path) -> "ResultSet":
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"no result file at {path}")
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path} is not valid JSON ({exc}); was the run interrupted while writing?") from None
        return cls.from_dict(data)


_FILE_FIELDS: dict[str, Any] = dict(name=str, method=str, created=str, mode=str, provenance=dict, records=list)
_FILE_FIELDS["artifacts"] = dict
_RECORD_FIELDS: dict[str, Any] = dict(key=str, value=(int, float), unit=str, params=dict, spread=dict, flags=list)


def _record_from_dict(i: int, r: Any) -> Record:
    where = f"record {i}" + (f" ({r.get('key')!r})" if isinstance(r, dict) and isinstance(r.get("key"), str) else "")
    check_fields(where, r, _RECORD_FIELDS, required=("key", "value", "unit"))
    unknown = sorted(set(r) - set(_RECORD_FIELDS))
    if unknown:
        raise ValueError(f"{where} has unknown fields: {', '.join(unknown)}")
    if not r["key"] or not math.isfinite(r["value"]) or not all(isinstance(f, str) for f in r.get("flags", [])):
        raise ValueError(f"{where}: 'key' must not be empty, 'value' must be finite, 'flags' must be strings")
    return Record(**copy.deepcopy(r) | {"value": float(r["value"])})


#: Tolerance for the fraction check: a share of 1.01 is noise around a tie; 1.27 is not (issue 15).
_SLACK = 0.02


def sanity_flags(records: Iterable[Record]) -> list[str]:
    """Flag each record no honest measurement produces (a ``fraction`` outside [0, 1]); a line per new flag."""
    why = "impossible: a fraction outside 0..1 (noise, or the reference it is a share of was under-measured)"
    new = []
    for rec in records:
        if rec.unit == "fraction" and not -_SLACK <= rec.value <= 1 + _SLACK and why not in rec.flags:
            rec.flag(why)
            new.append(_flag_line(rec, why))
    return new


def flag_lines(rs: ResultSet, records: Iterable[Record] | None = None) -> list[str]:
    """One line per flag on ``records`` (default: all of ``rs``), after :func:`sanity_flags`."""
    todo = list(rs.records if records is None else records)
    sanity_flags(todo)
    return [_flag_line(r, why) for r in todo for why in r.flags]


def _flag_line(rec: Record, why: str) -> str:
    return f"{rec.key} {rec.params}: {rec.value:.4g} {rec.unit} — {why}"


def comparable(a: ResultSet, b: ResultSet) -> tuple[bool, str]:
    """Whether ratios between ``a`` and ``b`` mean anything, and why not if not."""
    ha, hb = a.hardware, b.hardware
    diffs = [f"{k}: {ha.get(k)!r} vs {hb.get(k)!r}" for k in sorted(set(ha) | set(hb)) if ha.get(k) != hb.get(k)]
    if diffs:
        return False, "different hardware (" + "; ".join(diffs) + ")"
    if a.benchmark_version != b.benchmark_version:
        return False, f"different benchmark versions ({a.benchmark_version} vs {b.benchmark_version})"
    return True, "same hardware and benchmark version"


def compare_results(a: ResultSet, b: ResultSet) -> list[str]:
    """One line per record both hold (same key and params): ``a``'s value -> ``b``'s, and the ratio ``b/a``.
    Raises NotComparableError on different hardware."""
    ok, why = comparable(a, b)
    if not ok:
        raise NotComparableError(
            f"refusing to compare {a.name!r} and {b.name!r}: {why}. Show each as 'recorded on ...' instead."
        )
    index_b = {r.ident(): r for r in b.records}
    pairs = [(ra, index_b[ra.ident()]) for ra in a.records if ra.ident() in index_b and ra.value != 0]
    return [
        f"{r.key} {r.params}: {r.value:.4g} -> {rb.value:.4g} {r.unit}  (x{rb.value / r.value:.2f})" for r, rb in pairs
    ]
