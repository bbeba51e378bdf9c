"""The GPU check's full-tier estimate, its serial smoke tests and its path checks (issues 24.3, 25.4, 25.7).

No GPU needed: the estimate's arithmetic runs with a stand-in per-item cost (and once with the real
measurement on tiny images), the smoke order is checked on the commands the check builds and runs.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from _support import ROOT

from helpers.core import config
from tools import gpucheck


@pytest.fixture()
def times_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "chapter_times.json"
    path.write_text(
        json.dumps(
            {
                "chapters": {
                    "00": {"laptop": {"seconds": 5.0}},
                    "01": {"laptop": {"seconds": 10.0}},
                    "04": {"laptop": {"seconds": 3.0}, "full": {"seconds": 77.0}},
                }
            }
        )
    )
    monkeypatch.setattr(config, "_chapter_times_file", lambda: path)
    return path


def _nbs(*prefixes: str) -> list[Path]:
    return [p for p in gpucheck.notebooks(ROOT) if p.name[:2] in prefixes]


def test_estimate_arithmetic(times_file: Path) -> None:
    costs = {256: 0.010, 112: 0.002}  # seconds per item at the full and laptop image sizes (a stand-in)
    seen: list[tuple[int, int]] = []

    def cost(image_size: int, crop_size: int) -> float:
        seen.append((image_size, crop_size))
        return costs[image_size]

    est = gpucheck.estimate_notebooks(_nbs("00", "01", "02", "04"), "full", cost=cost)
    assert sorted(seen) == [(112, 96), (256, 224)], "each tier's image and crop sizes, from default_sizes"
    assert est.items == {"full": 9600 + 2400, "laptop": 1600 + 400}
    assert est.ratio == pytest.approx((12000 * 0.010) / (2000 * 0.002))  # 30
    by = {k[:2]: v for k, v in est.seconds.items()}
    assert by["01"] == pytest.approx(10.0 * 30)  # reads the data set: scaled
    assert by["00"] == pytest.approx(5.0)  # reads no data set: its laptop time as it is
    assert by["04"] == pytest.approx(77.0)  # recorded at full: used as it is
    assert by["02"] is None  # nothing recorded
    assert est.total_s == pytest.approx(382.0)
    assert [n[:2] for n in est.over(100)] == ["01"]
    line = est.line(450)
    assert "about 382 s" in line and "limit is 450 s" in line
    assert "x 30.0 = (12000 items x 10.00 ms at full) / (2000 items x 2.00 ms at laptop)" in line
    assert "measured here" in line and "no recorded time: 02" in line


def test_which_notebooks_read_the_data_set() -> None:
    found = {nb.name[:2]: gpucheck.reads_data_set(nb) for nb in gpucheck.notebooks(ROOT)}
    assert found["00"] is False
    assert found["04"] is True and found["06"] is True  # 06 through its capstone module


def test_item_cost_is_measured_here() -> None:
    t0 = time.perf_counter()
    cost = gpucheck.measure_item_cost(32, 24, n=3, rounds=2)
    assert 0 < cost < time.perf_counter() - t0


def test_estimate_is_printed_before_any_step_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], times_file: Path
) -> None:
    monkeypatch.setenv("WORKBOOK_ARTIFACTS", str(tmp_path / "artifacts"))
    monkeypatch.setattr(gpucheck, "_check_imports", lambda: [])
    monkeypatch.setattr(gpucheck, "torch_api_gaps", lambda root=None: [])
    monkeypatch.setattr(gpucheck, "measure_item_cost", lambda size, crop, **kw: {256: 0.01, 112: 0.002}[size])
    printed_before: list[str] = []

    def run_group(group, steps, *args, **kwargs) -> None:
        printed_before.append(capsys.readouterr().out)
        assert steps[0].extra["estimate_s"] == pytest.approx(300.0), "the share follows the estimate"
        for s in steps:
            s.status = "passed"

    monkeypatch.setattr(gpucheck, "_run_group", run_group)
    code = gpucheck.main(["--allow-cpu", "--steps", "notebooks", "--notebooks", "01", "--logs", str(tmp_path / "l")])
    assert code == 0 and len(printed_before) == 1
    out = printed_before[0]
    assert "estimate: the notebooks at full sizes need about 300 s" in out and "method:" in out


def test_smoke_runs_the_cuda_only_tests_alone_before_the_notebooks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = gpucheck.checkout()
    nbs = gpucheck.notebooks(root)[:3]
    steps = gpucheck.plan(
        root,
        nbs,
        steps=["smoke"],
        cell_timeout=600,
        notebook_timeout=900,
        reference=False,
        strict=True,
        quick=False,
        workdir=tmp_path,
    )
    unit = steps[0]
    assert "--cuda-only" in unit.argv and unit.extra.get("alone") is True
    assert not any("-n" == a or a.startswith("--numprocesses") for a in unit.argv), "one pytest process"
    assert unit.timeout_s == round(gpucheck.STEPS["smoke"] * gpucheck.SMOKE_SERIAL_SHARE)
    assert not any(s.extra.get("alone") for s in steps[1:])
    spans: dict[str, tuple[float, float]] = {}

    def fake_run_step(step, root, env, log_path, timeout, prefix="") -> None:
        t0 = time.monotonic()
        time.sleep(0.3)
        spans[step.name] = (t0, time.monotonic())
        step.status = "passed"

    monkeypatch.setattr(gpucheck, "_run_step", fake_run_step)
    gpucheck._run_group("smoke", steps, root, {}, tmp_path, 60, jobs=4)
    unit_end = spans[unit.name][1]
    starts = [spans[s.name][0] for s in steps[1:]]
    assert all(start >= unit_end for start in starts), "a notebook started while the CUDA-only tests ran"
    assert max(starts) - min(starts) < 0.25, "the notebooks still run side by side"


def _refusal(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    code = gpucheck.main(["--allow-cpu", "--dry-run", *argv])
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error:"), err
    return lines[0]


def test_empty_notebooks_option_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert "--notebooks is empty" in _refusal(capsys, ["--steps", "notebooks", "--notebooks", ""])
    assert "--notebooks is empty" in _refusal(capsys, ["--steps", "smoke", "--notebooks", " , "])


def test_logs_on_a_file_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "file"
    f.write_text("x")
    assert "--logs" in _refusal(capsys, ["--steps", "unit", "--logs", str(f)])
    code = gpucheck.main(["--allow-cpu", "--steps", "unit", "--logs", "/proc/gpucheck-logs"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: --logs") and "Traceback" not in err


@pytest.mark.parametrize("var", ["WORKBOOK_ARTIFACTS", "WORKBOOK_CACHE"])
def test_folder_variables_are_checked_before_work(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, var: str
) -> None:
    f = tmp_path / "file"
    f.write_text("x")
    monkeypatch.setenv(var, str(f))
    assert var in _refusal(capsys, ["--steps", "unit"])


# ---------------------------------------------------------------------------
# The tier each notebook runs at: the largest whose estimate fits its share (issue 24.3)
# ---------------------------------------------------------------------------


def test_tier_choice_per_notebook_from_estimates_and_shares() -> None:
    full = {"00_a.ipynb": 10.0, "04_b.ipynb": 1450.0, "05_c.ipynb": 60.0, "06_d.ipynb": None}
    laptop = {"00_a.ipynb": 10.0, "04_b.ipynb": 95.0, "05_c.ipynb": 45.0, "06_d.ipynb": None}
    how = {"00_a.ipynb": "laptop", "04_b.ipynb": "scaled", "05_c.ipynb": "scaled", "06_d.ipynb": "unknown"}
    choices = gpucheck.choose_tiers(full, laptop, 300.0, how=how)
    by = {c.notebook[:2]: c for c in choices}
    # a share: the laptop estimate (the mean, 50 s, for the notebook with none) + an equal part of the rest
    assert [c.notebook for c in choices] == list(full)
    assert sum(c.share_s for c in choices) == pytest.approx(300.0, abs=0.5)
    assert {k: c.share_s for k, c in by.items()} == {"00": 35.0, "04": 120.0, "05": 70.0, "06": 75.0}
    assert {k: c.tier for k, c in by.items()} == {"00": "full", "04": "laptop", "05": "full", "06": "laptop"}
    assert by["05"].estimate_s == 60.0 and by["04"].estimate_s == 95.0
    line = by["04"].line(30.0)
    assert line.startswith("04: full ~1,450 s (recorded laptop 95 s x 30.0, the work ratio from per-item costs")
    assert "measured on this machine" in line and line.endswith(
        "> share 120 s -> laptop ~95 s (the recorded laptop Run All time)"
    )
    assert by["00"].line(30.0) == "00: full ~10 s (reads no data set: its recorded laptop time) <= share 35 s -> full"
    assert by["06"].line(30.0).startswith("06: full: no estimate") and "-> laptop" in by["06"].line(30.0)
    # a per-notebook cap shrinks the share: 05's full estimate no longer fits
    capped = {c.notebook[:2]: c for c in gpucheck.choose_tiers(full, laptop, 300.0, per_notebook_s=50, how=how)}
    assert capped["05"].share_s == 50 and capped["05"].tier == "laptop"
    # laptop estimates above the limit: shares in proportion to them, and the line says so
    tight = {c.notebook[:2]: c for c in gpucheck.choose_tiers(full, laptop, 100.0, how=how)}
    assert tight["04"].share_s == 47.5 and tight["04"].tier == "laptop"
    assert tight["04"].line(30.0).endswith("; above its share too: it may be stopped")
    # a long enough limit gives 04 its full sizes
    assert {c.notebook[:2]: c.tier for c in gpucheck.choose_tiers(full, laptop, 10_000.0)}["04"] == "full"


def test_each_notebook_runs_with_its_tier_and_the_summary_names_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], times_file: Path
) -> None:
    """00 (5 s, reads no data set) fits its share at full; 01 (10 s laptop x 30 = 300 s at full) does not.
    Each notebook's run gets the variables of its tier, and the tier they select is the one reported."""
    import subprocess
    import sys

    monkeypatch.setenv("WORKBOOK_ARTIFACTS", str(tmp_path / "artifacts"))
    monkeypatch.setattr(gpucheck, "_check_imports", lambda: [])
    monkeypatch.setattr(gpucheck, "torch_api_gaps", lambda root=None: [])
    monkeypatch.setattr(gpucheck, "measure_item_cost", lambda size, crop, **kw: {256: 0.01, 112: 0.002}[size])
    real_popen = subprocess.Popen
    seen: dict[str, dict[str, str]] = {}

    def fake_popen(argv, **kwargs):  # the notebook's run, replaced by a child that reports the tier it gets
        seen[Path(argv[-1]).name[:2]] = kwargs["env"]
        probe = "from helpers.core import config; print('TIER', config.size_tier())"
        return real_popen([sys.executable, "-c", probe], **kwargs)

    monkeypatch.setattr(gpucheck.subprocess, "Popen", fake_popen)
    logs = tmp_path / "logs"
    code = gpucheck.main(
        [
            "--allow-cpu",
            "--steps",
            "notebooks",
            "--notebooks",
            "00,01",
            "--notebooks-timeout",
            "101",
            "--logs",
            str(logs),
        ]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    before = out.split("=== ")[0]  # printed before the first notebook starts
    assert "00: full ~5 s (reads no data set: its recorded laptop time) <= share 48 s -> full" in before
    assert "01: full ~300 s (recorded laptop 10 s x 30.0" in before and "> share 53 s -> laptop ~10 s" in before
    assert "measured here, on this machine" in before and "recorded laptop Run All time" in before
    assert {k: (e["WORKBOOK_QUICK"], e["WORKBOOK_FULL"]) for k, e in seen.items()} == {
        "00": ("0", "1"),
        "01": ("0", "0"),
    }
    logged = {p.name[:30]: p.read_text() for p in (logs / "logs").glob("notebook-*.log")}
    assert any("00_setup" in k and "TIER full" in v for k, v in logged.items()), logged
    assert any("01_baseline" in k and "TIER laptop" in v for k, v in logged.items()), logged
    summary = (logs / "summary.txt").read_text()
    assert "notebook 00_setup_and_measuring (full sizes)" in summary
    assert "notebook 01_baseline_pipeline (laptop sizes)" in summary
    assert "notebooks 00 full, 01 laptop" in summary and "LAPTOP sizes, not full: 01" in summary
    data = json.loads((logs / "summary.json").read_text())
    assert data["notebook_tiers"] == {"00_setup_and_measuring.ipynb": "full", "01_baseline_pipeline.ipynb": "laptop"}


@pytest.mark.parametrize("tool", ["tools.gpucheck", "tools.bench"])
def test_a_yes_no_variable_it_cannot_read_is_refused_not_ignored(
    tool: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue #25.7: `WORKBOOK_QUICK=banana` was silently replaced by the tool's own setting."""
    import importlib

    monkeypatch.setenv("WORKBOOK_QUICK", "banana")
    module = importlib.import_module(tool)
    args = ["--dry-run", "--allow-cpu"] if tool.endswith("gpucheck") else ["--quick", "--chapters", "00"]
    assert module.main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: WORKBOOK_QUICK='banana'"), err
