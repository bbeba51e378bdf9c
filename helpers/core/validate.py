"""Argument checks at the entry points a notebook or the command line calls (``batch_size must be an integer in
[1, 4096], got 0``, not a traceback from deep inside torch; internal functions trust them), and number formatting.
"""

from __future__ import annotations

import numbers
import textwrap
from typing import Any, Iterable


def check_int(name: str, value: Any, lo: int, hi: int | None = None) -> int:
    """``value`` as an int if ``lo <= value <= hi`` (a bool is not: ``True`` is no batch size); else ValueError."""
    upper = "inf" if hi is None else str(hi)
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an integer in [{lo}, {upper}], got {value!r}")
    value = int(value)
    if value < lo or (hi is not None and value > hi):
        raise ValueError(f"{name} must be an integer in [{lo}, {upper}], got {value}")
    return value


def check_float(name: str, value: Any, lo: float, hi: float | None = None) -> float:
    """``value`` as a float if ``lo <= value <= hi`` (not NaN, not a bool); else ValueError."""
    upper = "inf" if hi is None else f"{hi:g}"
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a number in [{lo:g}, {upper}], got {value!r}")
    value = float(value)
    if value != value or value < lo or (hi is not None and value > hi):  # NaN check first
        raise ValueError(f"{name} must be a number in [{lo:g}, {upper}], got {value}")
    return value


def check_choice(name: str, value: Any, choices: Iterable[Any]) -> Any:
    options = list(choices)
    if value not in options:
        raise ValueError(f"{name} must be one of {options}, got {value!r}")
    return value


def check_fields(where: str, data: Any, types: dict[str, Any], required: tuple[str, ...]) -> None:
    """A JSON object read from a file, checked: a ValueError naming ``where`` and the field when it is not an
    object, lacks a ``required`` field, or holds one of the wrong type (``types``: name -> type(s))."""
    if not isinstance(data, dict):
        raise ValueError(f"{where} must be an object, got {type(data).__name__}")
    missing = [k for k in required if k not in data]
    if missing:
        raise ValueError(f"{where}: missing field(s) {', '.join(missing)}")
    for name, kind in types.items():
        if name in data and (not isinstance(data[name], kind) or isinstance(data[name], bool)):
            kind_name = getattr(kind, "__name__", "number")
            raise ValueError(f"{where}: field {name!r} must be a {kind_name}, got {data[name]!r}")


def wrap(text: str, width: int = 100, indent: str = "") -> str:
    """Wrap printed text at word boundaries (never inside a word, never inside a `command` or 'data-bound')."""
    return "\n".join(
        textwrap.fill(para, width=width, subsequent_indent=indent, break_long_words=False, break_on_hyphens=False)
        for para in text.split("\n")
    )


def human_bytes(n: float) -> str:
    """Format a byte count with binary units: ``human_bytes(3 * 2**20) == '3.0 MiB'``."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"


def human_seconds(s: float) -> str:
    """Format a duration: ``human_seconds(0.0012) == '1.20 ms'``."""
    s = float(s)
    if s != s:
        return "nan"
    a = abs(s)
    if a >= 1:
        return f"{s:.2f} s"
    if a >= 1e-3:
        return f"{s * 1e3:.2f} ms"
    if a >= 1e-6:
        return f"{s * 1e6:.1f} µs"
    return f"{s * 1e9:.0f} ns"
