"""The one interface every chapter module (``helpers/chapters/chNN/__init__.py``) offers, so that a live panel
is three lines in a notebook and the headless bench needs no list of chapters:

>>> from helpers.chapters import ch03
>>> panel = widgets.Panel.for_chapter(ch03, device=DEVICE, make_loader=make_loader, to_device=to_device)
>>> panel

What a chapter module defines (``helpers/chapters/_template.py`` is a working example):

``NUMBER: str``           its two digits, the same as its notebook's (``"03"``)
``TITLE: str``            what it measures, for the bench's report
``BENCH_WEIGHT: float``   its share of a bench time budget (an estimate of its cost, not a measurement)
``PANEL_TITLE: str``      the live panel's heading
``benchmark(results, device, *, progress=None) -> None``   its measurements, headless, added to a ResultSet
``panel_controls(**context) -> dict[str, widget]``        the panel's knobs, named as ``panel_run``'s keywords
``panel_run(progress, *, device, **values_and_context) -> Evidence``   one run (``context``: what the notebook
    passed to ``for_chapter``: the reader's functions, the data set, sizes), an Evidence whichever path ran
``panel_summary(result: Evidence) -> str``   the line shown after a run
``panel_plot(history, ax) -> None``          draws every run so far (``history[i].result`` is an Evidence)

Optional: ``panel_validate(values) -> None`` (raise ValueError to refuse settings before anything runs) and
``PANEL_FIGSIZE: tuple[float, float]``.
"""

from __future__ import annotations

import inspect
import re
from types import ModuleType

__all__ = ["CONSTANTS", "FUNCTIONS", "OPTIONAL", "MODULE_NAME", "problems", "require"]

CONSTANTS: dict[str, type | tuple[type, ...]] = {"NUMBER": str, "TITLE": str, "BENCH_WEIGHT": (int, float)}
CONSTANTS["PANEL_TITLE"] = str

#: Functions and the parameters each must accept (a name in parentheses: keyword-only).
FUNCTIONS: dict[str, tuple[str, ...]] = {
    "benchmark": ("results", "device", "(progress)"),
    "panel_controls": (),
    "panel_run": ("progress", "(device)"),
    "panel_summary": ("result",),
    "panel_plot": ("history", "ax"),
}

OPTIONAL: tuple[str, ...] = ("panel_validate", "PANEL_FIGSIZE")

#: Names of chapter folders (their `__init__` is the chapter module): ch00 ... ch99.
MODULE_NAME = re.compile(r"^ch(\d\d)$")


def problems(module: ModuleType) -> list[str]:
    """What ``module`` lacks or gets wrong against the interface (empty: it conforms)."""
    name = module.__name__.rsplit(".", 1)[-1]
    out: list[str] = []
    match = MODULE_NAME.match(name)
    for const, kind in CONSTANTS.items():
        value = getattr(module, const, None)
        if not isinstance(value, kind):
            out.append(f"{const} is missing or not a {kind}")
    if match and getattr(module, "NUMBER", None) != match.group(1):
        out.append(f"NUMBER is {getattr(module, 'NUMBER', None)!r} but the module is {name}")
    for fn_name, params in FUNCTIONS.items():
        fn = getattr(module, fn_name, None)
        if not callable(fn):
            out.append(f"{fn_name}() is missing")
            continue
        sig = inspect.signature(fn)
        has_var_kw = any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values())
        positional = [p.name for p in sig.parameters.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        for want in params:
            if want.startswith("("):
                if want.strip("()") not in sig.parameters and not has_var_kw:
                    out.append(f"{fn_name}() does not accept the keyword {want.strip('()')}")
            elif want not in positional:
                out.append(f"{fn_name}() must take {want!r} as a positional parameter (takes {positional})")
        if fn_name in ("panel_controls", "panel_run") and not has_var_kw:
            out.append(f"{fn_name}() must accept **context (what the notebook passes to Panel.for_chapter)")
    return out


def require(module: ModuleType) -> ModuleType:
    """``module``, or a ValueError that lists what it lacks."""
    found = problems(module)
    if found:
        raise ValueError(
            f"{module.__name__} does not follow the chapter interface (helpers/ui/chapter.py): " + "; ".join(found)
        )
    return module
