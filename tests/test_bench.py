"""Tests for the headless benchmark (tools.bench), on CPU (the GPU check: tests/test_gpucheck.py).

The end-to-end test runs ``python -m tools.bench --quick`` in a subprocess, as a
user would, and validates the file it writes. The failure path is tested in
process with fake chapter modules injected into ``sys.modules``. Plot and
table tests use a small *synthetic* result set (test data, never shown as a
measurement) so that the GPU-only panels are exercised without a GPU.
"""

from __future__ import annotations

import importlib.machinery
import json
import math
import os
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest
from _support import HAS_CUDA, ROOT
from _support import workbook_env as _env

from helpers.core.results import BENCHMARK_VERSION, SCHEMA, ResultSet
from tools import bench

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


# ---------------------------------------------------------------------------
# End to end: python -m tools.bench --quick
# ---------------------------------------------------------------------------


QUICK_TIMEOUT_S = 1100


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    tmp = tmp_path_factory.mktemp("bench")
    out, png = tmp / "bench.json", tmp / "bench.png"
    argv = [
        sys.executable,
        "-m",
        "tools.bench",
        "--quick",
        "--no-progress",
        "--out",
        str(out),
        "--png",
        str(png),
    ]
    proc = subprocess.Popen(argv, cwd=ROOT, env=_env(tmp), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = proc.communicate(timeout=QUICK_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.terminate()  # the bench saves a partial file on SIGTERM
        stdout, stderr = proc.communicate(timeout=120)
        done = "no partial file"
        if out.is_file():
            chapters = ResultSet.load(out).provenance["bench"]["chapters"]
            done = ", ".join(f"{c['chapter']} {c['status']} {c['seconds']:.0f} s" for c in chapters)
        pytest.fail(f"python -m tools.bench --quick took over {QUICK_TIMEOUT_S} s; chapters done: {done}")
    return {
        "proc": subprocess.CompletedProcess(argv, proc.returncode, stdout, stderr),
        "out": out,
        "png": png,
        "tmp": tmp,
    }


@pytest.mark.slow
@pytest.mark.timeout(1200)  # every chapter's quick benchmark, on 2 CPU cores
def test_quick_bench_writes_a_valid_results_file(quick_run: dict) -> None:
    proc, out = quick_run["proc"], quick_run["out"]
    assert out.is_file(), f"no results file; stderr:\n{proc.stderr[-4000:]}"
    raw = json.loads(out.read_text(encoding="utf-8"))
    assert raw["schema"] == SCHEMA
    rs = ResultSet.load(out)
    assert rs.name == "bench"
    assert rs.mode == "quick"
    assert rs.benchmark_version == BENCHMARK_VERSION
    assert "tools.bench" in rs.method
    assert re.match(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d", rs.created)
    prov = rs.provenance
    for key in ("hardware", "report", "torch_version", "python_version", "platform", "bench"):
        assert key in prov, f"provenance lacks {key}"
    info = prov["bench"]
    for key in ("command", "started", "finished", "seconds", "versions", "chapters", "strict", "device", "ok"):
        assert key in info, f"provenance['bench'] lacks {key}"
    assert info["versions"]["torch"]
    labels = [c["chapter"] for c in info["chapters"]]
    assert labels == [c.label for c in bench.CHAPTERS]
    for c in info["chapters"]:
        assert c["status"] in ("ok", "failed", "skipped")
    assert rs.records, "the quick bench recorded nothing"
    for r in rs.records:
        assert re.match(r"ch0\d\.", r.key), r.key
        assert math.isfinite(r.value) and r.unit
    # chapter 02's host copy sweep runs on any machine
    assert rs.find("ch02.host_copy_time")


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_quick_bench_succeeds_and_draws_a_png(quick_run: dict) -> None:
    proc = quick_run["proc"]
    rs = ResultSet.load(quick_run["out"])
    failed = [
        f"{c['chapter']} ({c['module']}): {c['reason']}"
        for c in rs.provenance["bench"]["chapters"]
        if c["status"] == "failed"
    ]
    assert proc.returncode == 0, f"bench failed for {failed}; stderr tail:\n{proc.stderr[-3000:]}"
    assert rs.provenance["bench"]["ok"] is True
    assert quick_run["png"].read_bytes()[:8] == PNG_MAGIC
    assert "results file:" in proc.stdout


# ---------------------------------------------------------------------------
# Failure path, with fake chapter modules
# ---------------------------------------------------------------------------


def _fake_module(name: str, benchmark=None) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__spec__ = importlib.machinery.ModuleSpec(name, None)
    if benchmark is not None:
        mod.benchmark = benchmark
    return mod


def _ok_benchmark(results, device, *, progress=None) -> None:
    results.add("ch98.items_per_s", 123.0, "items/s", workers=0)
    results.add("ch98.items_per_s", 456.0, "items/s", workers=2)
    results.artifacts["ch98.note"] = {"device": str(device)}


def _bad_benchmark(results, device, *, progress=None) -> None:
    results.add("ch99.partial", 1.0, "s")
    raise RuntimeError("simulated failure inside a GPU path")


@pytest.fixture()
def fake_chapters(monkeypatch: pytest.MonkeyPatch) -> list[bench.Chapter]:
    monkeypatch.setitem(sys.modules, "fake_ch98", _fake_module("fake_ch98", _ok_benchmark))
    monkeypatch.setitem(sys.modules, "fake_ch99", _fake_module("fake_ch99", _bad_benchmark))
    monkeypatch.setitem(sys.modules, "fake_ch97", _fake_module("fake_ch97"))  # no benchmark() yet
    return [
        bench.Chapter(("97",), "fake_ch97", "no benchmark function"),
        bench.Chapter(("98",), "fake_ch98", "works"),
        bench.Chapter(("99",), "fake_ch99", "raises"),
        bench.Chapter(("96",), "fake_module_that_does_not_exist", "missing module"),
    ]


def test_failing_chapter_is_loud_and_does_not_hide_others(
    fake_chapters: list[bench.Chapter],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("WORKBOOK_QUICK", "1")
    monkeypatch.setenv("WORKBOOK_REFERENCE_DIR", str(tmp_path / "ref"))
    code, rs, paths = bench.run(
        chapters=fake_chapters,
        device="cpu",
        out=tmp_path / "r.json",
        png=tmp_path / "r.png",
        progress=False,
        argv=["--test"],
    )
    assert code == 1
    status = {o["chapter"]: o["status"] for o in paths["outcomes"]}
    assert status == {"ch97": "skipped", "ch98": "ok", "ch99": "failed", "ch96": "skipped"}
    saved = ResultSet.load(tmp_path / "r.json")
    assert [r.value for r in saved.find("ch98.items_per_s")] == [123.0, 456.0]
    assert saved.find("ch99.partial"), "records added before the failure are kept"
    assert saved.artifacts["ch98.note"] == {"device": "cpu"}
    bad = next(c for c in saved.provenance["bench"]["chapters"] if c["chapter"] == "ch99")
    assert "RuntimeError: simulated failure" in bad["reason"]
    assert "Traceback" in bad["error"]
    assert saved.provenance["bench"]["ok"] is False
    err = capsys.readouterr().err
    assert "ch99 (fake_ch99.benchmark) FAILED" in err and "simulated failure" in err
    assert (tmp_path / "r.png").read_bytes()[:8] == PNG_MAGIC
    assert not (tmp_path / "ref").exists(), "no reference file without --reference"


def test_strict_mode_fails_a_chapter_that_records_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "fake_empty", _fake_module("fake_empty", lambda results, device: None))
    ch = [bench.Chapter(("95",), "fake_empty", "records nothing")]
    rs = ResultSet.new("t", "test", device="cpu")
    assert bench.run_benchmarks(rs, "cpu", ch, strict=False, progress=False)[0].status == "ok"
    assert bench.run_benchmarks(rs, "cpu", ch, strict=True, progress=False)[0].status == "failed"


@pytest.mark.skipif(HAS_CUDA, reason="checks the refusal on a machine without CUDA")
def test_strict_and_reference_refuse_without_cuda(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORKBOOK_REFERENCE_DIR", str(tmp_path / "ref"))
    code, rs, _ = bench.run(chapters=[], device="cpu", out=tmp_path / "a.json", strict=True, progress=False)
    assert code == 2 and rs is None and not (tmp_path / "a.json").exists()
    code, rs, _ = bench.run(chapters=[], device="cpu", out=tmp_path / "b.json", reference=True, progress=False)
    assert code == 2 and not (tmp_path / "ref").exists()


def test_cli_rejects_bad_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench.main(["--chapters", "42"]) == 2
    assert "--chapters" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.main(["--quick", "--full"])


def test_select_chapters() -> None:
    assert [c.module for c in bench.select_chapters("2,ch05")] == ["helpers.chapters.ch02", "helpers.chapters.ch05"]
    assert [c.module for c in bench.select_chapters("03,04")] == ["helpers.chapters.ch03", "helpers.chapters.ch04"]
    assert len(bench.select_chapters(None)) == len(bench.CHAPTERS)
    with pytest.raises(ValueError, match="--chapters"):
        bench.select_chapters("98")


def test_chapters_are_found_by_file_name_without_importing_them(tmp_path: Path) -> None:
    notebooks = sorted(p.name[:2] for p in (ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
    assert [c.ids[0] for c in bench.CHAPTERS] == notebooks  # one chapter module per notebook
    for name in ("ch08", "ch09", "ch10"):
        (tmp_path / name).mkdir()
    (tmp_path / "ch08" / "__init__.py").write_text(
        'raise RuntimeError("imported")\nNUMBER = "08"\nTITLE: str = "a new chapter"\nBENCH_WEIGHT = 0.5\n'
    )
    (tmp_path / "_template.py").write_text('NUMBER = "99"\n')
    (tmp_path / "ch09" / "__init__.py").write_text("x = 1\n")  # no constants: named from the folder
    (tmp_path / "ch10" / "other.py").write_text('NUMBER = "10"\n')  # a folder without __init__: no chapter
    found = bench.discover_chapters(tmp_path)
    assert found == (
        bench.Chapter(("08",), "helpers.chapters.ch08", "a new chapter", 0.5),
        bench.Chapter(("09",), "helpers.chapters.ch09", "ch09", 1.0),
    )


def test_require_gpu_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(bench.REQUIRE_GPU_ENV, "1")
    assert bench.require_gpu() is True
    monkeypatch.setenv(bench.REQUIRE_GPU_ENV, "0")
    assert bench.require_gpu() is False
    monkeypatch.setenv(bench.REQUIRE_GPU_ENV, "maybe")
    with pytest.raises(ValueError, match=bench.REQUIRE_GPU_ENV):
        bench.require_gpu()


# ---------------------------------------------------------------------------
# The PNG summary and the README table, on synthetic test data
# ---------------------------------------------------------------------------


def synthetic_gpu_results() -> ResultSet:
    """A result set shaped like a GPU run. SYNTHETIC TEST DATA: the values are made up for the plot code."""
    rs = ResultSet.new("synthetic", "synthetic test data (not a measurement)", device="cpu")
    rs.provenance["hardware"] = dict(rs.provenance["hardware"], gpu_name="Test GPU 1000", gpu_count=1)
    rs.provenance["report"] = dict(
        rs.provenance.get("report", {}),
        link_bandwidth_gbps=63.0,
        link_description="PCIe Gen5 x16 (theoretical, per direction)",
    )
    for d in ("h2d", "d2h"):
        for m, bw in (("pinned", 50.0), ("pageable", 20.0)):
            for k in range(12, 29, 2):
                n = 2**k
                rs.add("ch02.copy_time", 1e-5 + n / (bw * 1e9), "s", direction=d, memory=m, nbytes=n)
            rs.add("ch02.fit.latency", 1e-5, "s", direction=d, memory=m)
            rs.add("ch02.fit.bandwidth", bw, "GB/s", direction=d, memory=m)
    for n in (2**20, 2**24):
        for name, v in (("cold", 2e-3), ("cached", 1e-5), ("pin_then_copy", 3e-3), ("plain_to", 1e-3)):
            rs.add(f"ch02.pin.{name}", v * n / 2**20, "s", nbytes=n)
    for regime in ("input-bound", "compute-bound"):
        for i, stage in enumerate(("baseline", "workers", "pinned", "prefetch")):
            rs.add("ch06.waterfall", 100.0 * (i + 1), "items/s", stage=stage, regime=regime, order=i)
    rs.add("ch04.items_per_s", 900.0, "items/s", num_workers=2)
    rs.add("ch04.items_per_s", 500.0, "items/s", num_workers=0)
    spans = [
        {
            "name": name,
            "step": s,
            "lane": lane,
            "start": s + o,
            "end": s + o + 0.4,
            "host_start": s + o,
            "host_end": s + o + 0.4,
            "on_gpu": lane != "host",
        }
        for s in range(3)
        for name, lane, o in (("load", "host", 0.0), ("h2d", "copy stream", 0.3), ("compute", "compute stream", 0.6))
    ]
    rs.artifacts["ch05.trace.overlapped"] = {"spans": spans, "metadata": {"synthetic": True}}
    return rs


def test_summary_figure_draws_every_panel_from_synthetic_records(tmp_path: Path) -> None:
    rs = synthetic_gpu_results()
    path, drawn, skipped = bench.summary_figure(rs, tmp_path / "s.png")
    assert path.read_bytes()[:8] == PNG_MAGIC
    titles = " | ".join(drawn)
    for needle in ("bandwidth", "pinning", "timeline", "waterfall (input-bound)", "waterfall (compute-bound)", "ch04"):
        assert needle in titles, f"panel {needle!r} missing; drawn: {drawn}; skipped: {skipped}"
    assert skipped == []


def test_summary_figure_skips_missing_panels_and_says_why(tmp_path: Path) -> None:
    rs = ResultSet.new("empty", "test", device="cpu")
    _, drawn, skipped = bench.summary_figure(rs, tmp_path / "e.png")
    assert drawn == []
    assert any("ch02 bandwidth" in s for s in skipped) and any("waterfall" in s for s in skipped)


def test_plot_only_redraws_an_existing_file(tmp_path: Path) -> None:
    rs = synthetic_gpu_results()
    rs.save(tmp_path / "x.json")
    assert bench.main(["--plot-only", str(tmp_path / "x.json"), "--png", str(tmp_path / "x.png")]) == 0
    assert (tmp_path / "x.png").read_bytes()[:8] == PNG_MAGIC


def test_readme_table_keeps_measured_and_theoretical_apart() -> None:
    table = bench.readme_table([synthetic_gpu_results()])
    header, _, row = table.splitlines()
    assert "theoretical, not measured" in header
    assert "Test GPU 1000" in row
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[4] == "50.0" and cells[6] == "20.0"  # H2D pinned / pageable fits
    assert cells[12] == "‖" and cells[13].startswith("63.0")
    assert "input-bound: 100 → 400 items/s" in row
    empty = bench.readme_table([])
    assert "no reference results recorded yet" in empty
    block = bench.readme_block([])
    assert block.index("**Measured**") < block.index("**Theoretical**")
    assert "| PCIe Gen4 x16 | 31.5 |" in block


def test_reference_path_names_the_gpu_and_date(tmp_path: Path) -> None:
    rs = synthetic_gpu_results()
    p1 = bench.reference_path(rs, tmp_path)
    assert p1.name == f"test-gpu-1000-{rs.created[:10]}.json"
    p1.write_text("{}")
    assert bench.reference_path(rs, tmp_path).name == f"test-gpu-1000-{rs.created[:10]}-2.json"


def test_reference_table_doc_matches_committed_reference_files(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WORKBOOK_REFERENCE_DIR", raising=False)
    doc = (ROOT / "README.md").read_text(encoding="utf-8")
    start, end = doc.index(bench.TABLE_START) + len(bench.TABLE_START), doc.index(bench.TABLE_END)
    assert doc[start:end].strip() == bench.readme_block().strip(), (
        "the README's reference tables are out of date: run `python -m tools.bench --readme-table --update README.md`"
    )


def test_update_table_file(tmp_path: Path) -> None:
    f = tmp_path / "t.md"
    f.write_text(f"intro\n{bench.TABLE_START}\nold\n{bench.TABLE_END}\nafter\n")
    bench.update_table_file(f, "NEW")
    assert f.read_text() == f"intro\n{bench.TABLE_START}\nNEW\n{bench.TABLE_END}\nafter\n"
    g = tmp_path / "g.md"
    g.write_text("no markers")
    with pytest.raises(ValueError, match="markers"):
        bench.update_table_file(g, "x")


# ---------------------------------------------------------------------------
# The GPU check
def test_compare_gives_ratios_only_on_matching_hardware(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ref = synthetic_gpu_results()
    same = ResultSet.from_dict(ref.to_dict())
    for r in same.records:
        r.value *= 2
    lines = bench.compare_lines(same, [ref])
    assert "same hardware" in lines[0] and any("(x2.00)" in ln for ln in lines[1:])
    other = ResultSet.new("cpu run", "test", device="cpu")
    lines = bench.compare_lines(other, [ref])
    assert len(lines) == 1 and "not compared" in lines[0] and "Test GPU 1000" in lines[0]
    ref.save(tmp_path / "ref.json")
    other.save(tmp_path / "mine.json")
    assert bench.main(["--compare", str(tmp_path / "mine.json"), "--against", str(tmp_path / "ref.json")]) == 0
    assert "not compared" in capsys.readouterr().out


def test_interrupt_keeps_what_was_measured(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def interrupted(results, device, *, progress=None) -> None:
        saved = ResultSet.load(tmp_path / "p.json")  # the checkpoint after the previous chapter
        assert saved.find("ch98.items_per_s") and saved.provenance["bench"]["partial"] is True
        raise KeyboardInterrupt

    monkeypatch.setitem(sys.modules, "fake_ok", _fake_module("fake_ok", _ok_benchmark))
    monkeypatch.setitem(sys.modules, "fake_int", _fake_module("fake_int", interrupted))
    chapters = [bench.Chapter(("98",), "fake_ok", "works"), bench.Chapter(("94",), "fake_int", "interrupted")]
    code, rs, paths = bench.run(chapters=chapters, device="cpu", out=tmp_path / "p.json", png=False, progress=False)
    assert code == 130
    saved = ResultSet.load(tmp_path / "p.json")
    assert saved.provenance["bench"]["interrupted"] is True and "partial" not in saved.provenance["bench"]
    assert [c["status"] for c in saved.provenance["bench"]["chapters"]] == ["ok", "failed"]
    assert saved.find("ch98.items_per_s")


def test_reference_subset_drops_failed_chapters(fake_chapters: list[bench.Chapter], tmp_path: Path) -> None:
    rs = ResultSet.new("t", "test", device="cpu")
    outcomes = bench.run_benchmarks(rs, "cpu", fake_chapters, progress=False, log=lambda s: None)
    ref = bench.reference_subset(rs, outcomes)
    assert {r.key for r in ref.records} == {"ch98.items_per_s"}
    assert set(ref.artifacts) == {"ch98.note"}
    assert any(x.startswith("ch99") for x in ref.provenance["bench"]["reference_excludes"])
    assert len(rs.records) == 3, "the full result set is untouched"


def test_reference_from_a_partial_gpu_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("WORKBOOK_REFERENCE_DIR", str(tmp_path / "ref"))
    rs = synthetic_gpu_results()
    rs.mode = "full"
    n = len(rs.records)
    rs.provenance["bench"] = {
        "chapters": [
            {
                "chapter": "ch02",
                "module": "m",
                "status": "ok",
                "first_record": 0,
                "records": n - 2,
                "artifact_names": [],
            },
            {
                "chapter": "ch04",
                "module": "m",
                "status": "failed",
                "first_record": n - 2,
                "records": 2,
                "artifact_names": [],
            },
        ]
    }
    rs.save(tmp_path / "partial.json")
    assert bench.main(["--reference-from", str(tmp_path / "partial.json")]) == 0
    (ref,) = list((tmp_path / "ref").glob("*.json"))
    saved = ResultSet.load(ref)
    assert len(saved.records) == n - 2 and not saved.find("ch04")
    assert "reference file:" in capsys.readouterr().out
    cpu = ResultSet.new("cpu", "test", device="cpu")
    cpu.save(tmp_path / "cpu.json")
    assert bench.main(["--reference-from", str(tmp_path / "cpu.json")]) == 2


# ---------------------------------------------------------------------------
# Issue 15: bad input ends in one `error:` line; the figure hides nothing; flags
# ---------------------------------------------------------------------------


def _run_cli(tmp_path: Path, *args: str, env_extra: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    env = _env(tmp_path)
    env.update(env_extra or {})
    return subprocess.run(
        [sys.executable, "-m", "tools.bench", "--no-progress", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def _one_error_line(proc: subprocess.CompletedProcess, start: str = "error:") -> str:
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr + proc.stdout
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith(start), proc.stderr
    return lines[0]


def test_cli_bad_input_prints_one_error_line(tmp_path: Path) -> None:
    assert "--chapters is empty" in _one_error_line(_run_cli(tmp_path, "--chapters", ""))
    assert "--chapters is empty" in _one_error_line(_run_cli(tmp_path, "--chapters", " , "))
    line = _one_error_line(_run_cli(tmp_path, "--chapters", "00", "--out", str(tmp_path / "no" / "dir" / "x.json")))
    assert "--out" in line and "does not exist" in line
    assert not (tmp_path / "no").exists(), "the bench must never create the --out folder"
    assert "--png" in _one_error_line(_run_cli(tmp_path, "--chapters", "00", "--png", str(tmp_path / "no" / "x.png")))
    if not HAS_CUDA:
        assert "no CUDA device" in _one_error_line(_run_cli(tmp_path, "--chapters", "00", "--device", "cuda:7"))
    assert "cpu or cuda" in _one_error_line(_run_cli(tmp_path, "--chapters", "00", "--device", "meta"))
    # --compare on files that are not result files
    good = synthetic_gpu_results().to_dict()
    bad_files = {
        "list.json": [1, 2],
        "missing.json": dict(good, records=[{"key": "ch02.x", "unit": "s"}]),
        "string.json": dict(good, records=[{"key": "ch02.x", "value": "1.5", "unit": "s"}]),
        "params.json": dict(good, records=[{"key": "ch02.x", "value": 1.5, "unit": "s", "params": "a"}]),
        "recordlist.json": dict(good, records={"a": 1}),
    }
    for name, data in bad_files.items():
        (tmp_path / name).write_text(json.dumps(data))
        line = _one_error_line(_run_cli(tmp_path, "--compare", str(tmp_path / name)))
        assert line.startswith("error: --compare"), (name, line)


@pytest.mark.skipif(HAS_CUDA, reason="checks the refusal on a machine without CUDA")
def test_strict_run_without_gpu_is_refused_in_one_line(tmp_path: Path) -> None:
    for args, extra in (
        (["--strict", "--chapters", "00"], {}),
        (["--chapters", "00"], {"WORKBOOK_REQUIRE_GPU": "1"}),
        (["--reference", "--chapters", "00"], {}),
    ):
        proc = _run_cli(tmp_path, *args, env_extra=extra)
        assert "needs a CUDA device" in _one_error_line(proc, "refusing") or "CUDA GPU" in proc.stderr


def test_full_and_quick_flags_set_the_tier(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from helpers.core import config

    seen: dict[str, str] = {}

    def fake_run(**kwargs):
        seen["tier"] = config.size_tier()
        return 0, None, {}

    monkeypatch.setattr(bench, "run", fake_run)
    monkeypatch.setattr(config, "_cuda_present", lambda: False)
    monkeypatch.delenv("WORKBOOK_QUICK", raising=False)
    monkeypatch.delenv("WORKBOOK_FULL", raising=False)
    assert bench.main(["--full", "--chapters", "00"]) == 0 and seen["tier"] == "full"
    assert os.environ["WORKBOOK_FULL"] == "1"
    assert bench.main(["--quick", "--chapters", "00"]) == 0 and seen["tier"] == "quick"
    assert bench.main(["--chapters", "00"]) == 0 and seen["tier"] == "quick"  # as the last flag left it
    monkeypatch.delenv("WORKBOOK_QUICK")
    monkeypatch.delenv("WORKBOOK_FULL")
    assert bench.main(["--chapters", "00"]) == 0 and seen["tier"] == "laptop"


def test_reference_is_refused_outside_full_mode(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from helpers.core import device

    monkeypatch.setenv("WORKBOOK_REFERENCE_DIR", str(tmp_path / "ref"))
    monkeypatch.setattr(device, "has_cuda", lambda: True)
    for env, tier in (({"WORKBOOK_QUICK": "1"}, "quick"), ({"WORKBOOK_QUICK": "0", "WORKBOOK_FULL": "0"}, "laptop")):
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        monkeypatch.setattr("helpers.core.config._cuda_present", lambda: False)  # the laptop tier
        code, rs, _ = bench.run(chapters=[], device="cuda", out=tmp_path / "a.json", reference=True, progress=False)
        assert code == 2 and rs is None
        assert f"refusing --reference in {tier} mode" in capsys.readouterr().err
    assert not (tmp_path / "ref").exists()


def _ch03_ch04_records() -> ResultSet:
    """SYNTHETIC TEST DATA shaped like chapters 03-04 on a machine without CUDA (values made up)."""
    rs = ResultSet.new("synthetic", "synthetic test data (not a measurement)", device="cpu")
    for w in (0, 2):
        for pin, v in ((False, 1000.0), (True, 1200.0)):
            rs.add("ch03.items_per_s", v + w, "items/s", num_workers=w, pin_memory=pin, pin_active=False, device="cpu")
    for w in range(0, 19):
        rs.add("ch04.items_per_s", 500.0 + 10 * w, "items/s", num_workers=w, persistent=w > 0, output="float")
    rs.add("ch04.best_num_workers", 0, "workers", cores=2)
    rs.add("ch04.speedup", 1.63, "ratio", spread={"min": 1.4, "max": 1.8, "n": 7}, num_workers=2, output="float")
    rs.add("ch04.parallel_ceiling", 1.3, "ratio", processes=2, output="float")
    rs.add("ch04.share_of_ceiling", 1.27, "fraction", num_workers=2, output="float")
    return rs


def test_sanity_flags_mark_impossible_and_contradictory_figures() -> None:
    from helpers.core.results import sanity_flags

    flag_lines = bench.flag_lines  # the bench checks what only chapters 02 and 04 know
    rs = _ch03_ch04_records()
    share = rs.find("ch04.share_of_ceiling")[0]
    assert share.flags and "fraction outside 0..1" in share.flags[0], "flagged where it is recorded"
    assert len(flag_lines(rs)) == 3
    best, up = rs.find("ch04.best_num_workers")[0], rs.find("ch04.speedup")[0]
    assert best.flags and up.flags and "contradictory" in best.flags[0]
    assert not rs.find("ch04.parallel_ceiling")[0].flags
    tie = rs.add("ch04.share_of_ceiling", 1.01, "fraction", num_workers=2, output="uint8")
    assert not tie.flags, "a share of 1.01 is noise around a tie, not an impossible figure"
    assert sanity_flags(rs.records) == [], "checking again adds nothing"
    assert len(flag_lines(rs)) == 3
    rs.records.remove(tie)
    saved = ResultSet.from_dict(json.loads(json.dumps(rs.to_dict())))
    assert saved.find("ch04.share_of_ceiling")[0].flags == share.flags
    assert "flags" not in json.dumps(rs.to_dict()["records"][0]), "ordinary records keep their file format"
    gpu = synthetic_gpu_results()  # 50 GB/s on a 63 GB/s link: nothing to flag
    assert flag_lines(gpu) == []
    gpu.add("ch02.fit.bandwidth", 70.0, "GB/s", direction="h2d", memory="pinned", extra=True)
    assert any("above the theoretical link ceiling" in f for f in flag_lines(gpu))


def test_summary_draws_ratios_pages_and_no_effect_notes(tmp_path: Path) -> None:
    rs = _ch03_ch04_records()
    panels, skipped = bench.summary_panels(rs)
    titles = [t for t, _ in panels]
    assert "ch04 · measured ratios" in titles, titles
    rates = [t for t in titles if t.startswith("ch04 · measured rates")]
    assert rates == ["ch04 · measured rates (1/2)", "ch04 · measured rates (2/2)"], "19 records: two pages, none cut"
    labels = bench._varying_labels(rs.find("ch03.items_per_s"))
    assert all("[no effect]" in lb for lb, r in zip(labels, rs.find("ch03.items_per_s")) if r.params["pin_memory"])
    assert bench._inactive_settings(rs.find("ch03.items_per_s")[1].params) == [
        "pin_memory=True had no effect (pin_active=False)"
    ]
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    dict(panels)["ch03 · measured rates"](ax)
    assert "NO EFFECT: pin_memory=True had no effect (pin_active=False)" in ax.get_title()
    plt.close(fig)
    # more records than MAX_PAGES pages hold: the rest are counted, not dropped silently
    many = ResultSet.new("synthetic", "synthetic test data", device="cpu")
    for i in range(bench.BARS_PER_PANEL * bench.MAX_PAGES + 5):
        many.add("ch04.cheap.items_per_s", 100.0 + i, "items/s", items=i)
    panels, skipped = bench.summary_panels(many)
    assert len([t for t, _ in panels if t.startswith("ch04")]) == bench.MAX_PAGES
    assert any("5 more record(s) not drawn" in s for s in skipped)
    path, drawn, _ = bench.summary_figure(rs, tmp_path / "s.png")
    assert path.read_bytes()[:8] == PNG_MAGIC and "ch04 · measured ratios" in drawn


# ---------------------------------------------------------------------------
# Issue 15 item 6: the SIGTERM handler acts only in the bench's own process
# ---------------------------------------------------------------------------


def _sleep_forever(_: int) -> int:
    import time as _time

    _time.sleep(60)
    return 0


def _exit_with_sigterm_disposition() -> None:
    import signal

    os._exit(0 if signal.getsignal(signal.SIGTERM) == signal.SIG_DFL else 3)


def test_sigterm_handler_acts_only_in_its_own_process() -> None:
    import multiprocessing as mp
    import signal

    before = signal.getsignal(signal.SIGTERM)
    ctx = mp.get_context("fork")
    with bench.signal_raises(signal.SIGTERM, lambda n: KeyboardInterrupt(f"signal {n}")) as installed:
        assert installed
        child = ctx.Process(target=_sleep_forever, args=(0,))
        child.start()
        try:
            child.join(0.5)
            os.kill(child.pid, signal.SIGTERM)
            child.join(10)
            # the inherited handler restored the default action: killed by SIGTERM, no KeyboardInterrupt
            assert child.exitcode == -signal.SIGTERM
        finally:
            if child.is_alive():
                child.kill()
                child.join(5)
        probe = ctx.Process(target=_exit_with_sigterm_disposition)
        probe.start()
        probe.join(10)
        assert probe.exitcode == 0, "a forked child starts with the default SIGTERM action"
        with pytest.raises(KeyboardInterrupt, match="signal"):
            os.kill(os.getpid(), signal.SIGTERM)
            import time as _time

            _time.sleep(5)  # the handler raises here
    assert signal.getsignal(signal.SIGTERM) == before, "the previous handler is restored"


@pytest.mark.timeout(120)
def test_pool_terminate_never_hangs_with_the_handler_installed() -> None:
    """The pattern that hung (issue 15): pool workers busy, then terminate(), in a loop, handler installed."""
    import multiprocessing as mp
    import signal
    import time as _time

    ctx = mp.get_context("fork")
    with bench.signal_raises(signal.SIGTERM, lambda n: KeyboardInterrupt(f"signal {n}")):
        for i in range(16):
            pool = ctx.Pool(2)
            try:
                pool.map_async(_sleep_forever if i % 2 else abs, range(4))  # busy workers, then idle ones
                _time.sleep(0.05)
            finally:
                t0 = _time.monotonic()
                pool.terminate()
                pool.join()
                assert _time.monotonic() - t0 < 20


def test_a_chapter_that_outruns_its_share_is_stopped_and_the_next_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import time as _time

    def slow(results, device, *, progress=None) -> None:
        results.add("ch93.partial", 1.0, "s")
        _time.sleep(60)

    monkeypatch.setitem(sys.modules, "fake_slow", _fake_module("fake_slow", slow))
    monkeypatch.setitem(sys.modules, "fake_ok", _fake_module("fake_ok", _ok_benchmark))
    monkeypatch.setenv("WORKBOOK_QUICK", "1")
    chapters = [bench.Chapter(("93",), "fake_slow", "slow", 1.0), bench.Chapter(("98",), "fake_ok", "ok", 1.0)]
    t0 = _time.monotonic()
    code, rs, paths = bench.run(
        chapters=chapters, device="cpu", out=tmp_path / "t.json", png=False, progress=False, budget_s=4.0
    )
    assert _time.monotonic() - t0 < 30
    assert code == 1
    status = {o["chapter"]: (o["status"], o["budget_s"]) for o in paths["outcomes"]}
    assert status["ch93"][0] == "timed out" and status["ch93"][1] == pytest.approx(2.0, abs=0.5)
    assert status["ch98"][0] == "ok"
    saved = ResultSet.load(tmp_path / "t.json")
    assert saved.find("ch93.partial") and saved.find("ch98.items_per_s"), "partial results are kept"
    assert (
        bench.reference_subset(
            saved, [bench.ChapterOutcome(**{k: v for k, v in c.items()}) for c in saved.provenance["bench"]["chapters"]]
        ).find("ch93")
        == []
    )
    weights = [c.weight for c in bench.CHAPTERS]
    assert bench.chapter_shares(bench.CHAPTERS, 110.0)[0] == pytest.approx(110.0 * weights[0] / sum(weights))


def test_notebook_shares_follow_recorded_times(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from helpers.core import config
    from tools import gpucheck

    times = tmp_path / "chapter_times.json"
    times.write_text(
        json.dumps(
            {
                "machine": "test",
                "chapters": {
                    "00": {"laptop": {"seconds": 30}},
                    "01": {"full": {"seconds": 90}, "laptop": {"seconds": 10}},
                },
            }
        )
    )
    monkeypatch.setattr(config, "_chapter_times_file", lambda: times)
    nbs = [Path("00_a.ipynb"), Path("01_b.ipynb"), Path("02_c.ipynb")]
    assert gpucheck.notebook_weights(nbs, "full") == [30.0, 90.0, 60.0]
    monkeypatch.setattr(config, "_chapter_times_file", lambda: tmp_path / "missing.json")
    assert gpucheck.notebook_weights(nbs, "full") == [1.0, 1.0, 1.0]


def test_a_chapter_that_swallows_its_timeout_is_still_marked_timed_out(monkeypatch: pytest.MonkeyPatch) -> None:
    import time as _time

    def converts(results, device, *, progress=None) -> None:
        try:
            _time.sleep(60)
        except KeyboardInterrupt:
            raise RuntimeError("interrupted while loading") from None

    def swallows(results, device, *, progress=None) -> None:
        try:
            _time.sleep(60)
        except KeyboardInterrupt:
            return

    monkeypatch.setitem(sys.modules, "fake_conv", _fake_module("fake_conv", converts))
    monkeypatch.setitem(sys.modules, "fake_swal", _fake_module("fake_swal", swallows))
    rs = ResultSet.new("t", "test", device="cpu")
    chapters = [bench.Chapter(("91",), "fake_conv", "converts"), bench.Chapter(("92",), "fake_swal", "swallows")]
    outcomes = bench.run_benchmarks(rs, "cpu", chapters, progress=False, log=lambda s: None, budget_s=3.0)
    assert [o.status for o in outcomes] == ["timed out", "timed out"]


def test_readme_sections_keep_measured_and_theoretical_apart() -> None:
    heads = [h for h, _ in bench.readme_sections([])]
    assert heads[0].startswith("**Measured**") and heads[-1].startswith("**Theoretical**") and len(heads) == 2
