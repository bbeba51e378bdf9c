"""Every chapter, the way a reader meets it: JupyterLab in a real (headless) browser.

For each notebook in ``notebooks/`` (a temporary copy, in quick mode) the test

1. opens it in JupyterLab and waits for the kernel (``Python 3 (ipykernel) | Idle``);
2. runs all cells from the **Run** menu and waits until every code cell has an
   execution count and the kernel is idle again; or, when ``make test``'s nbval run
   has just run the notebook to completion (the lab serves its copy with the outputs
   of that run, see ``conftest.py``), runs only the cells the live panel needs (the
   panel's cell and, transitively, the cells that define the names it uses: see
   ``panel_cells``), one by one as a reader would (click, Ctrl+Enter), and shows
   every other cell with the outputs nbval checked, so each notebook runs to
   completion once per ``make test``;
3. asserts that no cell shows an error (no traceback, no error output);
4. operates the chapter's live panel like a reader: changes one control
   (a slider by keyboard, else a dropdown, else a checkbox), clicks **Run**, and
   asserts that the status reports the new run, and that the panel's text and
   plot changed;
5. checks what a reader would trip over: a panel wider than the notebook, an
   output collapsed into a scroll box or trimmed, a plot scaled down a lot;
6. saves screenshots at a laptop viewport (1366x768):
   ``artifacts/screenshots/<chapter>.png`` (the panel after the reader's run)
   and ``artifacts/screenshots/<chapter>/page-NN.png`` (the whole notebook, one
   screen at a time), plus ``artifacts/screenshots/report.json`` with timings
   and findings.

Run only these: ``make test-browser`` (or ``pytest -m browser tests/browser``).
"""

from __future__ import annotations

import ast
import builtins
import json
import re
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

pytestmark = pytest.mark.browser

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"
CHAPTERS = sorted(p.name for p in NOTEBOOKS.glob("*.ipynb"))
KERNEL_IDLE = "Python 3 (ipykernel) | Idle"
OPEN_TIMEOUT_MS = 120_000  # page load + kernel start
RUN_ALL_TIMEOUT_MS = 300_000  # a chapter in quick mode: ~60-90 s on 2 cores; generous
PANEL_RUN_TIMEOUT_MS = 180_000  # one panel run
MAX_PAGES = 60  # screens per chapter walkthrough
IMG_MIN_SCALE = 0.75  # a plot shown at less than this fraction of its size is hard to read

_REPORT: dict[str, Any] = {}

# -- JavaScript run in the page --------------------------------------------------
# (JavaScript source: its long selector and message lines are exempted from E501 at each closing quote)

JS_PROMPTS = """() => [...document.querySelectorAll('.jp-NotebookPanel:not(.lm-mod-hidden) .jp-CodeCell .jp-InputArea-prompt')]
    .map(e => e.textContent.trim())"""  # noqa: E501

JS_DONE = """() => {
  const prompts = [...document.querySelectorAll('.jp-NotebookPanel:not(.lm-mod-hidden) .jp-CodeCell .jp-InputArea-prompt')]
      .map(e => e.textContent.trim());
  if (prompts.length === 0) return false;
  if (prompts.some(p => p.includes('*'))) return false;
  const errors = document.querySelectorAll('.jp-OutputArea-output[data-mime-type="application/vnd.jupyter.stderr"]');
  const hasError = [...errors].some(e => /Traceback|Error/.test(e.textContent));
  return hasError || prompts.every(p => /\\[\\d+\\]/.test(p));
}"""  # noqa: E501

JS_STDERR = """() => [...document.querySelectorAll('.jp-NotebookPanel:not(.lm-mod-hidden) .jp-OutputArea-output[data-mime-type="application/vnd.jupyter.stderr"]')]
    .filter(e => !e.closest('.widget-output'))
    .map(e => {
       const cell = e.closest('.jp-Cell');
       const cells = [...document.querySelectorAll('.jp-NotebookPanel:not(.lm-mod-hidden) .jp-Cell')];
       return {cell: cells.indexOf(cell), text: e.textContent.slice(0, 2000)};
    })"""  # noqa: E501

# Things a reader trips over. Returns a list of {kind, cell, detail}.
JS_LAYOUT = """(minScale) => {
  const out = [];
  const nb = document.querySelector('.jp-NotebookPanel:not(.lm-mod-hidden)');
  const cells = [...nb.querySelectorAll('.jp-Cell')];
  const idx = e => cells.indexOf(e.closest('.jp-Cell'));
  for (const o of nb.querySelectorAll('.jp-Cell .jp-OutputArea')) {
    if (o.closest('.widget-output')) continue;
    if (o.scrollHeight > o.clientHeight + 4 && getComputedStyle(o).overflowY !== 'visible')
      out.push({kind: 'output collapsed into a scroll box', cell: idx(o), detail: `${o.scrollHeight}px of content in ${o.clientHeight}px`});
  }
  for (const o of nb.querySelectorAll('.jp-OutputArea-output')) {
    if (o.scrollWidth > o.clientWidth + 4)
      out.push({kind: 'output wider than the notebook (horizontal scroll)', cell: idx(o), detail: `${o.scrollWidth}px in ${o.clientWidth}px`});
  }
  for (const t of nb.querySelectorAll('.jp-TrimmedOutputs'))
    out.push({kind: 'outputs trimmed (Show more outputs)', cell: idx(t), detail: t.textContent.trim().slice(0, 120)});
  for (const p of nb.querySelectorAll('.jp-OutputPlaceholder'))
    out.push({kind: 'output collapsed', cell: idx(p), detail: ''});
  for (const img of nb.querySelectorAll('.jp-OutputArea img')) {
    if (!img.naturalWidth) continue;
    const scale = img.clientWidth / img.naturalWidth;
    if (scale < minScale)
      out.push({kind: 'plot scaled down', cell: idx(img), detail: `${img.naturalWidth}px image shown at ${img.clientWidth}px (${Math.round(scale * 100)}%)`});
  }
  for (const l of nb.querySelectorAll('.jp-OutputArea .widget-label, .jp-OutputArea .widget-inline-hbox > label')) {
    if (l.scrollWidth > l.clientWidth + 1 && l.textContent.trim())
      out.push({kind: 'control label cut off (use style={"description_width": "initial"})', cell: idx(l), detail: l.textContent.trim()});
  }
  for (const w of nb.querySelectorAll('.jp-OutputArea .widget-vbox, .jp-OutputArea .widget-hbox, .jp-OutputArea .widget-box')) {
    if (w.parentElement && w.parentElement.closest('.widget-vbox, .widget-hbox, .widget-box')) continue;  // top-level widgets only
    const host = w.closest('.jp-OutputArea-output') || w.parentElement;
    const wr = w.getBoundingClientRect(), hr = host.getBoundingClientRect();
    if (w.scrollWidth > w.clientWidth + 4 || wr.right > hr.right + 4)
      out.push({kind: 'panel wider than the notebook', cell: idx(w), detail: `content ${w.scrollWidth}px, box ${w.clientWidth}px, output ${Math.round(hr.width)}px`});
  }
  return out;
}"""  # noqa: E501

JS_SCROLL_TO = """(y) => {
  const nb = document.querySelector('.jp-NotebookPanel:not(.lm-mod-hidden) .jp-Notebook');
  if (!nb) return [0, 0, 0];
  // JupyterLab 4 scrolls the notebook in .jp-WindowedPanel-outer (a child of .jp-Notebook).
  const cands = [...nb.querySelectorAll('.jp-WindowedPanel-outer'), nb];
  let e = nb.parentElement;
  while (e && e !== document.body) { cands.push(e); e = e.parentElement; }
  for (const c of cands) {
    const s = getComputedStyle(c);
    if ((s.overflowY === 'auto' || s.overflowY === 'scroll') && c.scrollHeight > c.clientHeight) {
      c.scrollTop = y;
      return [c.scrollTop, c.scrollHeight, c.clientHeight];
    }
  }
  return [0, 0, 0];
}"""


def _record(chapter: str, **kv: Any) -> None:
    _REPORT.setdefault(chapter, {}).update(kv)


def _write_report(directory: Path) -> None:
    path = directory / "report.json"
    old: dict[str, Any] = {}
    if path.is_file():
        try:
            old = json.loads(path.read_text())
        except ValueError:
            old = {}
    old.update(_REPORT)
    path.write_text(json.dumps(old, indent=2, sort_keys=True))


# -- steps -----------------------------------------------------------------------


def open_notebook(page: Any, lab: Any, name: str) -> None:
    # ?reset: a fresh workspace, so tabs from the previous chapter are not restored.
    page.goto(f"{lab.url}/lab/tree/{name}?reset", wait_until="domcontentloaded", timeout=OPEN_TIMEOUT_MS)
    page.locator(".jp-NotebookPanel .jp-Notebook .jp-Cell").first.wait_for(timeout=OPEN_TIMEOUT_MS)
    # If JupyterLab asks which kernel to use, take the proposed one (the notebook's python3).
    dialog = page.locator(".jp-Dialog .jp-mod-accept")
    try:
        dialog.wait_for(timeout=3000)
        dialog.click()
    except Exception:
        pass
    page.get_by_text(KERNEL_IDLE).first.wait_for(timeout=OPEN_TIMEOUT_MS)
    _dismiss_toasts(page)


def _dismiss_toasts(page: Any) -> None:
    """Close any notification toast that could cover the notebook."""
    for btn in page.locator(".Toastify__toast .Toastify__close-button, .jp-toast-button:has-text('No')").all():
        try:
            btn.click(timeout=1000)
        except Exception:
            pass


def run_all(page: Any) -> float:
    page.locator(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-Notebook").first.click(position={"x": 5, "y": 5})
    page.locator(".lm-MenuBar-itemLabel", has_text=re.compile(r"^Run$")).click()
    page.locator(".lm-Menu-item[data-command='runmenu:run-all']").click()
    t0 = time.monotonic()
    # Run All marks every queued cell with [*] at once; done when none is left.
    page.wait_for_function(
        "() => [...document.querySelectorAll('.jp-CodeCell .jp-InputArea-prompt')]"
        ".some(e => e.textContent.includes('*'))",
        timeout=30_000,
        polling=200,
    )
    page.wait_for_function(JS_DONE, timeout=RUN_ALL_TIMEOUT_MS, polling=500)
    page.get_by_text(KERNEL_IDLE).first.wait_for(timeout=60_000)
    return time.monotonic() - t0


# -- which cells the live panel needs ------------------------------------------------

PANEL_CELL = re.compile(r"\bPanel(\.for_chapter)?\(")  # the cell that builds the live panel (widgets.Panel.for_chapter)


_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)


def _free_in_scope(node: ast.AST) -> set[str]:
    """Names a function, lambda or comprehension reads but does not bind itself (nor its inner scopes)."""
    bound: set[str] = set()
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
        a = node.args
        bound.update(x.arg for x in a.posonlyargs + a.args + a.kwonlyargs + [a.vararg, a.kwarg] if x is not None)
        todo: list[ast.AST] = list(node.body) if isinstance(node.body, list) else [node.body]
    else:
        todo = list(ast.iter_child_nodes(node))
    loads: set[str] = set()
    while todo:
        n = todo.pop()
        if isinstance(n, _SCOPES):
            loads |= _free_in_scope(n)
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
                bound.add(n.name)
            continue
        if isinstance(n, ast.Name):
            (bound if isinstance(n.ctx, (ast.Store, ast.Del)) else loads).add(n.id)
        elif isinstance(n, (ast.Import, ast.ImportFrom)):
            bound.update((x.asname or x.name).split(".")[0] for x in n.names)
        elif isinstance(n, ast.ExceptHandler) and n.name:
            bound.add(n.name)
        todo.extend(ast.iter_child_nodes(n))
    return loads - bound


def _defines_and_uses(source: str) -> tuple[set[str], set[str]]:
    """Global names a cell defines (assignments, defs, classes, imports at its top level) and the globals it
    reads that it has not bound before (also inside its functions, which run later: a pipeline cell's
    ``def`` reads the setup cell's globals; a function's own parameters and locals are not globals)."""
    defines: set[str] = set()
    uses: set[str] = set()
    for stmt in ast.parse(source).body:
        # names this statement reads, in source order; a name bound earlier in the cell is the cell's own
        reads: set[str] = set()
        stores: list[str] = []
        targets: set[str] = set()  # for/with targets: bound before the block that reads them
        todo: list[ast.AST] = [stmt]
        while todo:
            n = todo.pop()
            if isinstance(n, (ast.For, ast.AsyncFor)):
                targets.update(x.id for x in ast.walk(n.target) if isinstance(x, ast.Name))
            elif isinstance(n, (ast.With, ast.AsyncWith)):
                targets.update(
                    x.id
                    for i in n.items
                    if i.optional_vars is not None
                    for x in ast.walk(i.optional_vars)
                    if isinstance(x, ast.Name)
                )
            if isinstance(n, _SCOPES):
                reads |= _free_in_scope(n)
                if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    stores.append(n.name)
                    todo.extend(n.decorator_list)
                    todo.extend(d for d in n.args.defaults + n.args.kw_defaults if d is not None)
                continue
            if isinstance(n, ast.Name):
                if isinstance(n.ctx, (ast.Store, ast.Del)):
                    stores.append(n.id)
                else:
                    reads.add(n.id)
            elif isinstance(n, ast.ClassDef):
                stores.append(n.name)
            elif isinstance(n, (ast.Import, ast.ImportFrom)):
                stores.extend((x.asname or x.name).split(".")[0] for x in n.names)
            elif isinstance(n, ast.ExceptHandler) and n.name:
                stores.append(n.name)
            todo.extend(ast.iter_child_nodes(n))
        # a name the cell bound in an earlier statement is its own; so is a for/with target in this one
        uses |= reads - defines - targets
        defines.update(stores)
    return defines, uses - set(dir(builtins))


def panel_cells(code_sources: list[str]) -> list[int] | None:
    """Code-cell indices to run so that the first live panel works: its cell, and for every name a needed
    cell reads, the latest earlier cell that defines it (transitively). None when no cell builds a panel."""
    target = next((i for i, src in enumerate(code_sources) if PANEL_CELL.search(src)), None)
    if target is None:
        return None
    names = [_defines_and_uses(src) for src in code_sources]
    need, todo = {target}, [target]
    while todo:
        i = todo.pop()
        for name in names[i][1]:
            j = next((j for j in range(i - 1, -1, -1) if name in names[j][0]), None)
            if j is not None and j not in need:
                need.add(j)
                todo.append(j)
    return sorted(need)


JS_CELLS_DONE = """(idx) => {
  const prompts = [...document.querySelectorAll('.jp-NotebookPanel:not(.lm-mod-hidden) .jp-CodeCell .jp-InputArea-prompt')]
      .map(e => e.textContent.trim());
  if (idx.every((i, k) => prompts[i] !== undefined && prompts[i].replace(/:$/, '') === `[${k + 1}]`)) return true;
  if (prompts.some(p => p.includes('*'))) return false;
  const errors = document.querySelectorAll('.jp-OutputArea-output[data-mime-type="application/vnd.jupyter.stderr"]');
  return [...errors].some(e => /Traceback|Error/.test(e.textContent));   // an error stops the queue: report it
}"""  # noqa: E501


def run_cells(page: Any, indices: list[int]) -> float:
    """Run these code cells, in order, as a reader does: click the cell's prompt, press Ctrl+Enter.

    The kernel is fresh, so the k-th cell run here must end with the prompt ``[k+1]:`` (the cells shown
    with nbval's outputs keep that run's numbers): the wait ends when each of them shows its own number.
    """
    cells = page.locator(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-CodeCell")
    page.locator(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-Notebook").first.click(position={"x": 5, "y": 5})
    t0 = time.monotonic()
    for i in indices:
        cells.nth(i).locator(".jp-InputArea-prompt").click()
        page.keyboard.press("Control+Enter")
    page.wait_for_function(JS_CELLS_DONE, arg=indices, timeout=RUN_ALL_TIMEOUT_MS, polling=500)
    page.get_by_text(KERNEL_IDLE).first.wait_for(timeout=60_000)
    return time.monotonic() - t0


def find_panel(page: Any) -> Any | None:
    """The first live panel: the widget box that holds a 'Run' button and an output widget."""
    buttons = page.locator("button.jupyter-button", has_text=re.compile(r"^\s*Run\s*$"))
    if buttons.count() == 0:
        return None
    return buttons.first.locator(
        "xpath=ancestor::div[contains(concat(' ', normalize-space(@class), ' '), ' widget-vbox ')]"
        "[.//div[contains(@class, 'widget-output')]][1]"
    )


def _status_text(panel: Any) -> str:
    return panel.locator(":scope > .widget-html").nth(1).inner_text()


def _img_src(panel: Any) -> str | None:
    imgs = panel.locator(".widget-output img")
    return imgs.last.get_attribute("src") if imgs.count() else None


def _control_changes(page: Any, panel: Any) -> Iterator[Callable[[], str | None]]:
    """Ways a reader can change one control: sliders by keyboard, dropdowns, toggle buttons, checkboxes.

    Each item, when called, changes one control and returns what it did (None if it could not).
    """

    def slider_change(slider: Any) -> Callable[[], str | None]:
        def go() -> str | None:
            readout = slider.locator(".widget-readout")
            before = readout.first.inner_text() if readout.count() else None
            handle = slider.locator(".noUi-handle").first
            for key in ("ArrowRight", "ArrowLeft"):  # ArrowLeft when the slider sits at its maximum
                handle.focus()
                handle.press(key)
                page.wait_for_timeout(300)
                after = readout.first.inner_text() if readout.count() else None
                if after != before:
                    label = (
                        slider.locator(".widget-label").first.inner_text()
                        if slider.locator(".widget-label").count()
                        else "slider"
                    )
                    return f"slider '{label}': {before} -> {after} ({key})"
            return None

        return go

    def dropdown_change(dd: Any) -> Callable[[], str | None]:
        def go() -> str | None:
            options = dd.locator("option").all_inner_texts()
            current = dd.evaluate("e => e.options[e.selectedIndex] ? e.options[e.selectedIndex].text : null")
            others = [o for o in options if o != current]
            if not others:
                return None
            dd.select_option(label=others[0])
            return f"dropdown: {current} -> {others[0]}"

        return go

    def toggle_change(group: Any) -> Callable[[], str | None]:
        def go() -> str | None:
            buttons = group.locator("button")
            for i in range(buttons.count()):
                b = buttons.nth(i)
                if "mod-active" not in (b.get_attribute("class") or ""):
                    b.click()
                    return f"toggle buttons: -> {b.inner_text().strip()}"
            return None

        return go

    def checkbox_change(cb: Any) -> Callable[[], str | None]:
        def go() -> str | None:
            cb.click()
            return "checkbox toggled"

        return go

    for slider in panel.locator(".widget-slider").all():
        if slider.locator(".noUi-handle").count():
            yield slider_change(slider)
    for dd in panel.locator(".widget-dropdown select").all():
        yield dropdown_change(dd)
    for group in panel.locator(".widget-toggle-buttons").all():
        yield toggle_change(group)
    for cb in panel.locator(".widget-checkbox input[type=checkbox]").all():
        yield checkbox_change(cb)


def _click_run_and_wait(panel: Any, expected: int) -> tuple[str, float]:
    run_btn = panel.locator("button.jupyter-button", has_text=re.compile(r"^\s*Run\s*$")).first
    t0 = time.monotonic()
    run_btn.click()
    status_el = panel.locator(":scope > .widget-html").nth(1)
    status_el.locator(f"text=/Run #{expected} done|Can't run|The run failed|Interrupted|Out of memory/").wait_for(
        timeout=PANEL_RUN_TIMEOUT_MS
    )
    seconds = time.monotonic() - t0
    assert run_btn.is_enabled(), "the Run button stayed disabled after the run"
    return _status_text(panel), seconds


def operate_panel(page: Any, panel: Any) -> dict[str, Any]:
    """Change a control, press Run; repeat with the next control until the plot changes (at most 4 tries).

    Some controls only matter on a GPU (a chapter without CUDA may draw the same
    schematic for every size), so the first control need not change the plot; one must.
    """
    m = re.search(r"Run #(\d+)", _status_text(panel))
    expected = int(m.group(1)) + 1 if m else 1
    src_prev = _img_src(panel)
    attempts: list[dict[str, Any]] = []
    for change in _control_changes(page, panel):
        if len(attempts) >= 4:
            break
        what = change()
        if what is None:
            continue
        status, seconds = _click_run_and_wait(panel, expected)
        assert f"Run #{expected} done" in status, f"after changing {what} and clicking Run, the panel says: {status!r}"
        # The kernel redraws the plot before it sets the status; give the front-end a moment to show it.
        try:
            page.wait_for_function(
                "([el, old]) => { const i = [...el.querySelectorAll('.widget-output img')].pop();"
                " return !!i && i.getAttribute('src') !== old; }",
                arg=[panel.element_handle(), src_prev],
                timeout=5_000,
                polling=200,
            )
        except Exception:
            pass
        src = _img_src(panel)
        text = panel.locator(".widget-output").first.inner_text()
        assert f"#{expected}" in text or not text.strip(), (
            f"the panel's result text does not show run #{expected}: {text!r}"
        )
        plot_changed = bool(src) and src != src_prev
        attempts.append(
            {
                "changed": what,
                "panel_run_s": round(seconds, 2),
                "status": status,
                "output_text": text[:300],
                "plot_changed": plot_changed,
            }
        )
        expected += 1
        src_prev = src
        if plot_changed:
            break
    assert attempts, "the panel has no slider, dropdown, toggle or checkbox a reader could change"
    assert attempts[-1]["plot_changed"], (
        f"the panel's plot did not change after changing a control and pressing Run: {attempts}"
    )
    return {"panel_attempts": attempts, "panel_run_s": attempts[-1]["panel_run_s"], "changed": attempts[-1]["changed"]}


def screenshot_walkthrough(page: Any, directory: Path) -> int:
    """One screenshot per screen of the notebook, top to bottom."""
    directory.mkdir(parents=True, exist_ok=True)
    for old in directory.glob("page-*.png"):
        old.unlink()
    y, n = 0, 0
    while n < MAX_PAGES:
        top, height, client = page.evaluate(JS_SCROLL_TO, y)
        page.wait_for_timeout(150)
        n += 1
        page.screenshot(path=str(directory / f"page-{n:02d}.png"))
        if client == 0 or top + client >= height - 2:
            break
        y = top + int(client * 0.9)
    return n


# -- the test ----------------------------------------------------------------------


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_chapter_in_jupyterlab(chapter: str, page: Any, lab: Any, screenshot_dir: Path) -> None:
    stem = Path(chapter).stem
    t_start = time.monotonic()
    open_notebook(page, lab, chapter)
    _record(stem, open_s=round(time.monotonic() - t_start, 2))
    try:
        needed = panel_cells(lab.prefilled[chapter]) if chapter in lab.prefilled else None
        if needed is None:
            run_s = run_all(page)
            _record(stem, run_all_s=round(run_s, 2), ran="all cells")
        else:  # nbval ran every cell of this notebook and checked it; its outputs are on the page
            run_s = run_cells(page, needed)
            _record(
                stem,
                run_cells_s=round(run_s, 2),
                run_all_s=None,
                ran=f"code cells {needed} (what the panel needs); the rest show nbval's outputs",
            )

        prompts = page.evaluate(JS_PROMPTS)
        stderr = page.evaluate(JS_STDERR)
        errors = [s for s in stderr if re.search(r"Traceback|^\w*Error\b|\w+Error:", s["text"], re.M)]
        warnings = [s for s in stderr if s not in errors]
        _record(stem, stderr_warnings=warnings, errors=errors)
        assert not errors, f"{chapter}: cell(s) show an error:\n" + "\n---\n".join(
            f"cell {e['cell']}: {e['text'][:1500]}" for e in errors
        )
        not_run = [p for p in prompts if not re.search(r"\[\d+\]", p)]
        assert not not_run, f"{chapter}: {len(not_run)} code cell(s) did not run: {not_run}"

        panel = find_panel(page)
        assert panel is not None, f"{chapter}: no live panel (a 'Run' button) found"
        panel.scroll_into_view_if_needed()
        _record(stem, **operate_panel(page, panel))

        layout = page.evaluate(JS_LAYOUT, IMG_MIN_SCALE)
        _record(stem, layout_findings=layout)

        # The panel as a reader sees it after their run: its top at the top of the screen.
        panel.evaluate("e => e.scrollIntoView({block: 'start'})")
        page.wait_for_timeout(300)
        page.screenshot(path=str(screenshot_dir / f"{stem}.png"))
        pages = screenshot_walkthrough(page, screenshot_dir / stem)
        _record(stem, screens=pages, total_s=round(time.monotonic() - t_start, 2))

        overflow = [f for f in layout if f["kind"] == "panel wider than the notebook"]
        assert not overflow, f"{chapter}: the panel overflows the notebook at 1366x768: {overflow}"
    except BaseException:
        try:  # what the reader would have seen when it went wrong
            page.screenshot(path=str(screenshot_dir / f"{stem}-failure.png"))
        except Exception:
            pass
        raise
    finally:
        _write_report(screenshot_dir)
