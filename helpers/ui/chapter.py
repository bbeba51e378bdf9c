"""The one interface every chapter module (``helpers/chapters/chNN/__init__.py``) offers, so that a live panel is
``widgets.Panel.for_chapter(chNN, device=DEVICE, <the reader's functions>)`` in a notebook and the headless bench
needs no list of chapters. ``helpers/chapters/_template.py`` is a working example; docs/CONTRIBUTING.md the guide.

``panel_run(progress, *, device, **values_and_context) -> Evidence`` gets the controls' values and what the notebook
passed to ``for_chapter``; ``panel_plot(history, ax)`` draws every run so far (``history[i].result``, an Evidence);
``benchmark(results, device, *, progress=None)`` adds its headless measurements to a ResultSet. Optional:
``panel_validate(values)`` (ValueError refuses settings before anything runs) and ``PANEL_FIGSIZE``.
"""

from __future__ import annotations

import inspect
import re
from types import ModuleType

#: NUMBER: its notebook's two digits; TITLE: what it measures, for the bench; BENCH_WEIGHT: its share of a bench
#: time budget (an estimate of its cost); PANEL_TITLE: the live panel's heading.
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
