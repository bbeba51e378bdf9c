"""The one interface every chapter module (``helpers/chapters/chNN/__init__.py``) offers, so that a live panel is
``widgets.Panel.for_chapter(chNN, device=DEVICE, <the reader's functions>)`` in a notebook and the headless bench
needs no list of chapters. ``helpers/chapters/_template.py`` is a working example; docs/CONTRIBUTING.md the guide.

``panel_run(progress, *, device, **values_and_context) -> Evidence`` gets the controls' values and what the notebook
passed to ``for_chapter``; ``panel_plot(history, ax)`` draws every run so far (``history[i].result``, an Evidence);
``benchmark(results, device, *, progress=None)`` adds its headless measurements to a ResultSet (``panel_run``
refuses settings that can't run with a ValueError in plain words). Optional: ``PANEL_FIGSIZE``.
"""

from __future__ import annotations

import inspect
import re
from types import ModuleType

#: NUMBER: its notebook's two digits; TITLE: what it measures, for the bench; BENCH_WEIGHT: its share of a bench
#: time budget (an estimate of its cost); PANEL_TITLE: the live panel's heading.
CONSTANTS: dict[str, type | tuple[type, ...]] = {"NUMBER": str, "TITLE": str, "BENCH_WEIGHT": (int, float)}
CONSTANTS["PANEL_TITLE"] = str

#: Functions and the parameters each must accept (a name in parentheses: keyword-only; "**": any keyword too).
FUNCTIONS: dict[str, tuple[str, ...]] = {
    "benchmark": ("results", "device", "(progress)"),
    "panel_controls": ("**",),
    "panel_run": ("progress", "(device)", "**"),
    "panel_summary": ("result",),
    "panel_plot": ("history", "ax"),
}

#: Names of chapter folders (their `__init__` is the chapter module): ch00 ... ch99.
MODULE_NAME = re.compile(r"^ch(\d\d)$")


def problems(module: ModuleType) -> list[str]:
    """What ``module`` lacks or gets wrong against the interface (empty: it conforms)."""
    name = module.__name__.rsplit(".", 1)[-1]
    out = [f"{c} is missing or not a {t}" for c, t in CONSTANTS.items() if not isinstance(getattr(module, c, None), t)]
    match = MODULE_NAME.match(name)
    if match and getattr(module, "NUMBER", None) != match.group(1):
        out.append(f"NUMBER is {getattr(module, 'NUMBER', None)!r} but the module is {name}")
    for fn_name, params in FUNCTIONS.items():
        fn = getattr(module, fn_name, None)
        if not callable(fn):
            out.append(f"{fn_name}() is missing")
            continue
        sig = inspect.signature(fn).parameters.values()
        has_var_kw = any(p.kind is p.VAR_KEYWORD for p in sig)
        positional = [p.name for p in sig if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        for want in params:
            if want == "**" and not has_var_kw:
                out.append(f"{fn_name}() must accept **context (what the notebook passes to Panel.for_chapter)")
            elif want.startswith("(") and want.strip("()") not in {p.name for p in sig} and not has_var_kw:
                out.append(f"{fn_name}() does not accept the keyword {want.strip('()')}")
            elif want[0] not in "(*" and want not in positional:
                out.append(f"{fn_name}() must take {want!r} as a positional parameter (takes {positional})")
    return out


def require(module: ModuleType) -> ModuleType:
    """``module``, or a ValueError that lists what it lacks."""
    found = problems(module)
    if found:
        raise ValueError(
            f"{module.__name__} does not follow the chapter interface (helpers/ui/chapter.py): " + "; ".join(found)
        )
    return module
