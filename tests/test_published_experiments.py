"""Every GPU section has evidence without a GPU: a cited published figure, or a plain 'none was found'.

The call sites are found in the sources (the notebooks, the helpers package), not listed by hand, so a
new GPU section without a published figure or a 'none found' sentence fails here.
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest

from helpers.chapters.ch05 import hazards, overlap
from helpers.core import evidence

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "helpers" / "core" / "published_experiments.json"

#: A record key (or artifact name) passed to measure_or_recall / recorded / recorded_artifact.
_KEY_ARG = re.compile(r"""key\s*=\s*f?["'](ch\d\d\.[^"']+)["']""")
_RECORDED_CALL = re.compile(
    r"""evidence\.recorded(?:_artifact)?\(\s*(?:f?"[^"]*"|f?'[^']*'|[\w.]+(?:\([^()]*\))?)\s*,\s*f?["'](ch\d\d\.[^"']+)["']""",
    re.S,
)

#: Keys the walker must find (a guard: a walker that finds nothing would pass vacuously).
KNOWN = {
    "ch00.matmul_time_s",
    "ch01.step.phase_time",
    "ch02.copy_time",
    "ch02.pin",
    "ch02.host_held",
    "ch02.pinned_block",
    "ch02.wire_time",
    "ch03.pin_ms_per_batch",
    "ch05.overlap.step_time",
    "ch05.prefetch.batch_time",
    "ch05.decode.ms_per_batch",
    "ch05.hazard.d2h_wrong",
    "ch05.hazard.mutation_wrong",
    "ch05.hazard.syncs",
    "ch06.waterfall.step_time",
    "ch06.efficiency",
    "ch06.trace.x.x",
    "ch07.ddp.total_items_per_s",
}


def _sources() -> list[tuple[str, str]]:
    out = []
    for nb in sorted((ROOT / "notebooks").glob("*.ipynb")):
        cells = json.loads(nb.read_text())["cells"]
        out.append((nb.name, "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")))
    for py in sorted((ROOT / "helpers").rglob("*.py")):
        out.append((str(py.relative_to(ROOT)), py.read_text()))
    return out


def call_site_keys() -> dict[str, str]:
    """record key -> where it is used; an f-string's fields become 'x' (e.g. ch06.trace.x.x)."""
    keys: dict[str, str] = {}
    for where, text in _sources():
        for m in [*_KEY_ARG.finditer(text), *_RECORDED_CALL.finditer(text)]:
            keys.setdefault(re.sub(r"\{[^}]*\}", "x", m.group(1)), where)
    for memory, stream in overlap.CELLS:  # the 2x2 timelines: recorded_artifact(artifact_name(memory, stream))
        keys.setdefault(overlap.artifact_name(memory, stream), "helpers/chapters/ch05/overlap.py")
    for key in hazards.RECORDED_AS:  # HazardResult.show(): evidence.recorded(RECORDED_AS[key], key)
        keys.setdefault(key, "helpers/chapters/ch05/hazards.py")
    return keys


def test_the_walker_finds_every_known_gpu_section() -> None:
    found = call_site_keys()
    assert KNOWN <= set(found), f"not found in the sources: {sorted(KNOWN - set(found))}"


@pytest.mark.parametrize("key", sorted(call_site_keys()))
def test_every_gpu_section_has_a_published_figure_or_says_none_was_found(key: str) -> None:
    figs = evidence.cited_for(key)
    none = evidence.no_published_sentence(key)
    assert figs or none, (
        f"{key} ({call_site_keys()[key]}): add a published figure of this experiment to "
        f"{DATA.name}, or a 'none_found' entry naming the experiment that would produce one"
    )
    assert not (figs and none), f"{key}: both cited figures and 'none found'"


@pytest.mark.parametrize("key", sorted(call_site_keys()))
def test_without_cuda_or_a_recording_no_section_shows_a_bare_missing(
    key: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(evidence.REFERENCE_ENV, str(tmp_path))  # no reference recorded
    ev = evidence.measure_or_recall("the figure", "cpu", measure=lambda: pytest.fail("measured on a CPU"), key=key)
    text = " ".join(str(ev).split())
    assert not ev  # nothing in the chapter's own format: the cells' `if ev: plot(ev.value)` skip it
    assert text.startswith("No CUDA device")
    if ev.kind == "published":
        assert ev.cited and all(f.url in text and f.date_read in text for f in ev.cited)
    else:
        assert ev.kind == "missing" and "No published figure of this experiment was found" in text
    artifact = evidence.recorded_artifact("the trace", key)
    assert artifact.kind in ("published", "missing") and not artifact


def test_every_figure_is_evidence_for_some_call_site() -> None:
    keys = call_site_keys()
    figures, none_found = evidence.load_published_experiments(DATA)
    for fig in figures:
        assert any(fig.matches(k) for k in keys), f"{fig.id}: its experiment {fig.experiment} matches no call site"
    assert len(figures) >= 10 and len({f.url for f in figures}) >= 8
    for pattern in none_found:
        assert any(re.fullmatch(pattern.replace(".", r"\.").replace("*", ".*"), k) for k in keys), pattern


def test_a_derived_ratio_is_never_the_value() -> None:
    figures, _ = evidence.load_published_experiments(DATA)
    for fig in figures:
        assert fig.unit.lower() not in ("x", "ratio", "speedup"), f"{fig.id}: a ratio is a note, marked derived"
        if re.search(r"\d\s*/\s*\d", fig.notes):
            assert "derived" in fig.notes.lower(), f"{fig.id}: a computed ratio must say it is derived"


def _write(tmp_path: Path, mutate) -> Path:
    data = json.loads(DATA.read_text())
    entry = copy.deepcopy(data["figures"][0])
    mutate(entry)
    data["figures"] = [entry]
    path = tmp_path / "figs.json"
    path.write_text(json.dumps(data))
    return path


@pytest.mark.parametrize("field", ["url", "quote", "date_read", "where", "gpu", "experiment"])
def test_the_loader_refuses_an_entry_without_its_provenance(tmp_path: Path, field: str) -> None:
    path = _write(tmp_path, lambda e: e.pop(field))
    with pytest.raises(ValueError, match=f"missing field.*{field}"):
        evidence.load_published_experiments(path)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"url": "http://example.com/x"}, "https"),
        ({"url": ""}, "https"),
        ({"quote": ""}, "quote"),
        ({"quote": "a sentence without the number"}, "quote must contain the value"),
        ({"date_read": "24 Nov 2026"}, "YYYY-MM-DD"),
        ({"date_read": ""}, "YYYY-MM-DD"),
        ({"value": 0}, "positive"),
        ({"experiment": []}, "experiment"),
    ],
)
def test_the_loader_refuses_bad_provenance(tmp_path: Path, change: dict, match: str) -> None:
    path = _write(tmp_path, lambda e: e.update(change))
    with pytest.raises(ValueError, match=match):
        evidence.load_published_experiments(path)


def test_the_packaged_file_loads_and_every_quote_holds_its_value() -> None:
    figures, none_found = evidence.load_published_experiments()
    assert figures and none_found
    for fig in figures:
        assert fig.url.startswith("https://") and fig.date_read == "2026-11-24"
        assert fig.lines()[0].lstrip().startswith(fig.what.split()[0])
        too_long = [
            line for line in "\n".join(fig.lines()).splitlines() if len(line) > 110
        ]  # JupyterLab would wrap them mid-word
        assert not too_long, f"{fig.id}: printed lines over 110 characters (a shorter URL?): {too_long}"


def test_a_section_that_the_cited_figures_do_not_show_says_so_instead(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``no_published``: the figures cited for a key time something else (ch05's copy call, ch00's CUDA events), so
    the section is missing with the reason, never shown with those figures."""
    monkeypatch.setenv(evidence.REFERENCE_ENV, str(tmp_path))  # no reference recorded
    key = "ch05.overlap.step_time"
    assert evidence.cited_for(key)  # figures exist: without no_published they would be shown
    ev = evidence.measure_or_recall(
        "the copy call", "cpu", measure=lambda: pytest.fail("measured on a CPU"), key=key, no_published="None fits."
    )
    text = " ".join(str(ev).split())
    assert ev.kind == "missing" and not ev.cited and text.startswith("No CUDA device") and "None fits." in text
