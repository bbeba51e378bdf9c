"""helpers.ui.published: the data file of figures published elsewhere (checked by tools/published_table.py), its
loader and tables, and the chapters' plots of it (ch00's share of the ceiling, ch02's marked points); CPU only."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import pytest

from helpers.chapters import ch00, ch02
from helpers.chapters.ch02 import figures
from helpers.ui import published
from tools import published_table


def _raw() -> dict:
    return json.loads(published.data_file().read_text(encoding="utf-8"))


def test_every_entry_has_every_field_and_valid_values():
    raw = _raw()
    assert raw["kind"] == published.KIND_PUBLISHED
    required = set(published_table.REQUIRED)
    for entry in raw["figures"]:
        assert set(entry) == required, entry.get("id")
        assert entry["url"].startswith("https://"), entry["id"]
        assert entry["value"] > 0 and entry["unit"] in published_table.UNITS, entry["id"]
        assert entry["direction"] in ("h2d", "d2h") and entry["memory"] in ("pinned", "pageable"), entry["id"]
        assert entry["date_read"] == "2026-11-22", entry["id"]
        for key in ("gpu", "link", "product_link", "tool", "method", "numa", "where", "published"):
            assert entry[key].strip(), (entry["id"], key)
    figs = published_table.check_file(published.data_file())
    assert len(figs) == len(raw["figures"]) and figs == published.published_figures()


def test_enough_figures_generations_and_both_kinds():
    figs = published.published_figures()
    assert len(figs) >= 10
    assert len(published.generations()) >= 5
    assert published.published_figures(direction="d2h") and published.published_figures(direction="h2d")
    assert published.published_figures(memory="pageable") and published.published_figures(memory="pinned")
    assert ch02.pairs("numa"), "the NUMA lesson needs a near/far pair"
    assert ch02.pairs("direction") and ch02.pairs("memory")


def test_no_duplicates():
    figs = published_table.check_file(published.data_file())
    assert len({f.id for f in figs}) == len(figs)
    assert len({published_table.same_copy(f) for f in figs}) == len(figs)


def test_units_are_converted_with_the_tools_definition():
    p100 = next(f for f in published.published_figures() if f.unit == "MB/s")
    assert p100.unit_bytes_per_s == 1.024e6
    assert p100.gbps == pytest.approx(p100.value * 1.024e-3)
    gb = next(f for f in published.published_figures() if f.unit == "GB/s")
    assert gb.gbps == pytest.approx(gb.value)


def test_ceilings_are_theoretical_and_shares_below_one():
    assert published.link_ceiling_gbps("PCIe Gen4 x16") == pytest.approx(31.5, rel=0.01)
    assert published.link_ceiling_gbps("NVLink-C2C") == published.NVLINK_C2C_GBPS
    assert published.link_ceiling_gbps("not stated") is None
    for f in published.published_figures():
        assert f.ceiling_gbps is not None, f.id
        assert 0 < f.share_of_ceiling < 1, f.id  # a measurement above its link's ceiling would be a data error


@pytest.mark.parametrize(
    "change, message",
    [
        ({"url": "http://example.com"}, "https://"),
        ({"value": 0}, "> 0"),
        ({"value": -3.0}, "> 0"),
        ({"unit": "GiB/s"}, "unit"),
        ({"unit_bytes_per_s": 1e9}, "unit_bytes_per_s"),
        ({"direction": "both"}, "direction"),
        ({"memory": "managed"}, "memory"),
        ({"date_read": "yesterday"}, "date_read"),
        ({"product_link": "PCIe 4"}, "product_link"),
        ({"transfer_size_bytes": 0}, "transfer_size_bytes"),
    ],
)
def test_bad_entries_are_refused(tmp_path: Path, change: dict, message: str):
    raw = _raw()
    raw["figures"] = [dict(raw["figures"][0], **change)]
    path = tmp_path / "published.json"
    path.write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=message):
        published_table.check_file(path)


def test_missing_field_and_duplicate_are_refused(tmp_path: Path):
    raw = _raw()
    entry = dict(raw["figures"][0])
    del entry["tool"]
    raw["figures"] = [entry]
    path = tmp_path / "missing.json"
    path.write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="lacks field"):
        published_table.check_file(path)
    raw = _raw()
    raw["figures"] = [raw["figures"][0], dict(raw["figures"][0], id="copy")]
    path.write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="duplicates"):
        published_table.check_file(path)


def test_filters_validate_their_arguments():
    with pytest.raises(ValueError, match="direction"):
        published.published_figures(direction="up")
    with pytest.raises(ValueError, match="memory"):
        published.published_figures(memory="cached")
    with pytest.raises(ValueError, match="what"):
        ch02.pairs("socket")
    assert all(f.transfer_size_bytes for f in published.published_figures(sized=True))


def test_markdown_table_and_readme_block_render():
    table = published_table.markdown_table()
    lines = table.splitlines()
    assert len(lines) == 2 + len(published.published_figures())
    assert all(line.count("|") >= 11 for line in lines)
    assert "theoretical" not in table.lower() and "measured here" not in table
    block = published_table.published_block()
    assert block.startswith("### Published elsewhere") and table in block
    assert "https://github.com/NVIDIA/nvbandwidth/issues/24" in block


def test_share_table_keeps_published_and_theoretical_in_separate_columns():
    text = ch00.share_table(published.published_figures())
    header, units = text.splitlines()[:2]
    assert "published" in header and "theoretical" in header and units.split() == ["GB/s", "(product", "spec)", "GB/s"]
    assert max(len(line) for line in text.splitlines()) <= 100


def test_plot_helpers_draw_on_cpu():
    import dataclasses

    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    ax.set_xscale("log")
    ax.set_yscale("log")
    figs = published.published_figures()
    key = figures.add_published(ax, figs)
    marks = [line for line in ax.get_lines() if line.get_marker() not in ("None", "", None)]
    # every figure that states a size is drawn, one series per source and run, each with its [k] line in the key;
    # the figures without a size are left out
    assert sum(len(m.get_xdata()) for m in marks) == len([f for f in figs if f.transfer_size_bytes is not None])
    assert len(marks) == len(published.point_series(figs)) == key.count("\n[") + 1 and key.startswith("[1] ")
    assert any(published.KIND_PUBLISHED in line.get_label() for line in marks)
    # the ceilings: one per known link, none for an unknown one or for one already drawn (skip_gbps)
    links = ["PCIe Gen3 x16", "PCIe Gen4 x16", "bogus"]
    sized = [dataclasses.replace(g[-1], product_link=link) for g, link in zip(published.point_series(figs), links)]
    _, ax1 = plt.subplots()
    figures.add_published(ax1, sized, skip_gbps=[published.link_ceiling_gbps("PCIe Gen3 x16")])
    drawn = [line.get_label() for line in ax1.get_lines() if published.KIND_THEORETICAL in line.get_label()]
    assert [label.split(":")[0] for label in drawn] == ["PCIe Gen4 x16"]
    _, ax3 = plt.subplots()  # a plot with its legend drawn already (notebook 02): the legend shows the new lines too
    ax3.plot([1e6], [1.0], label="measured here")
    ax3.legend()
    figures.add_published(ax3, sized)
    shown = [t.get_text() for t in ax3.get_legend().get_texts()]
    assert "measured here" in shown and any(published.KIND_THEORETICAL in t for t in shown)
    ax2 = ch00.plot_share_of_ceiling(published.published_figures(memory="pinned"))
    assert len(ax2.patches) == len(published.published_figures(memory="pinned"))
    plt.close("all")


def test_readme_published_table_is_current() -> None:
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
    start = readme.index("<!-- published-table:start")
    start = readme.index("-->", start) + len("-->\n")
    end = readme.index("<!-- published-table:end -->")
    assert readme[start:end].rstrip() == published_table.published_block().rstrip(), (
        "README's published table is stale: regenerate it from helpers/ui/published.json"
    )
