"""Tests for the GPU check (tools.gpucheck), on CPU: its plan, its time limits, its refusals."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from _support import HAS_CUDA, ROOT
from _support import workbook_env as _env

# ---------------------------------------------------------------------------


@pytest.mark.skipif(HAS_CUDA, reason="checks the refusal on a machine without CUDA")
def test_gpucheck_refuses_plainly_without_cuda(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "tools.gpucheck"],
        cwd=ROOT,
        env=_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "no CUDA GPU is usable here" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_gpucheck_dry_run_plans_bench_then_notebooks_then_cuda_tests(tmp_path: Path) -> None:
    from tools import gpucheck

    proc = subprocess.run(
        [sys.executable, "-m", "tools.gpucheck", "--allow-cpu", "--dry-run", "--logs", str(tmp_path / "logs")],
        cwd=ROOT,
        env=_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    lines = [ln for ln in proc.stdout.splitlines() if "would run" in ln]
    n_nb = len(gpucheck.notebooks(ROOT))
    assert len(lines) == 1 + n_nb + 1
    assert "[bench]" in lines[0] and "tools.bench --full" in lines[0] and "--budget-s" in lines[0]
    assert all("--nbval-lax" in ln and "--nbval-current-env" in ln for ln in lines[1 : n_nb + 1])
    for ln in lines[1 : n_nb + 1]:  # each notebook names its tier, and its environment selects that tier
        assert ("(full sizes)" in ln and "WORKBOOK_QUICK=0 WORKBOOK_FULL=1" in ln) or (
            "(laptop sizes)" in ln and "WORKBOOK_QUICK=0 WORKBOOK_FULL=0" in ln
        ), ln
    assert "--cuda-only" in lines[-1] and "-p tools.gpucheck" in lines[-1] and "--ignore=tests/browser" in lines[-1]
    assert "WORKBOOK_REQUIRE_GPU" in proc.stdout and "WORKBOOK_FULL=1" in proc.stdout


def test_gpucheck_smoke_plan_is_quick_and_cuda_only(tmp_path: Path) -> None:
    from tools import gpucheck

    root = gpucheck.checkout()
    nbs = gpucheck.notebooks(root)
    steps = gpucheck.plan(
        root,
        nbs,
        steps=["smoke"],
        cell_timeout=600,
        notebook_timeout=900,
        reference=True,
        strict=True,
        quick=False,
        workdir=tmp_path,
    )
    assert len(steps) == 1 + len(nbs) and {s.group for s in steps} == {"smoke"}
    assert all(s.env == {"WORKBOOK_QUICK": "1", "WORKBOOK_FULL": "0"} for s in steps)
    assert "--cuda-only" in steps[0].argv and "not slow and not browser" in steps[0].argv
    assert all(s.timeout_s <= gpucheck.STEPS["smoke"] for s in steps)
    assert sum(gpucheck.STEPS.values()) <= 25 * 60, "the documented procedure fits 25 minutes of commands"
    assert gpucheck.STEPS["smoke"] <= 6 * 60 and gpucheck.STEPS["bench"] <= 8 * 60


def test_gpucheck_fits_inner_limits_to_the_time_left(tmp_path: Path) -> None:
    from tools import gpucheck

    root = gpucheck.checkout()
    nb = gpucheck.notebooks(root)[:1]
    bench_step, nb_step = gpucheck.plan(
        root,
        nb,
        steps=["bench", "notebooks"],
        cell_timeout=600,
        notebook_timeout=900,
        reference=False,
        strict=False,
        quick=True,
        workdir=tmp_path,
    )
    assert bench_step.argv[bench_step.argv.index("--budget-s") + 1] == str(450 - gpucheck.BENCH_MARGIN_S)
    argv = gpucheck._fit_argv(bench_step, 200)
    assert argv[argv.index("--budget-s") + 1] == str(200 - gpucheck.BENCH_MARGIN_S)
    argv = gpucheck._fit_argv(nb_step, 100)
    assert "--nbval-cell-timeout=85" in argv and "--timeout=95" in argv


def test_gpucheck_groups_keep_their_time_limits(tmp_path: Path) -> None:
    import time as _time

    from tools import gpucheck

    def step(name: str, seconds: float, group: str) -> "gpucheck.CheckStep":
        return gpucheck.CheckStep(
            name=name, group=group, timeout_s=900, argv=[sys.executable, "-c", f"import time; time.sleep({seconds})"]
        )

    env = dict(os.environ)
    # notebooks: fair shares; a hanging one is stopped at its share and the next still runs
    steps = [step("hangs", 300, "notebooks"), step("quick", 0.1, "notebooks")]
    t0 = _time.monotonic()
    gpucheck._run_group("notebooks", steps, ROOT, env, tmp_path, 24, jobs=1)
    assert _time.monotonic() - t0 < 40
    assert [s.status for s in steps] == ["timed out", "passed"]
    assert 10 <= steps[0].seconds <= 20
    # smoke: side by side
    steps = [step(f"s{i}", 2, "smoke") for i in range(3)]
    t0 = _time.monotonic()
    gpucheck._run_group("smoke", steps, ROOT, env, tmp_path, 60, jobs=3)
    assert [s.status for s in steps] == ["passed"] * 3 and _time.monotonic() - t0 < 5.5


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_gpucheck_unit_step_end_to_end_on_cpu(tmp_path: Path) -> None:
    """--allow-cpu tests the check itself: the CUDA-only selection runs (and skips here), files are bundled."""
    logs = tmp_path / "out"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "tools.gpucheck",
            "--allow-cpu",
            "--steps",
            "unit",
            "--logs",
            str(logs),
            "--bundle",
        ],
        cwd=ROOT,
        env=_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=580,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert sorted(p.name for p in logs.iterdir()) == ["gpucheck-logs.tar.gz", "summary.json", "summary.txt"]
    summary = json.loads((logs / "summary.json").read_text())
    assert summary["passed"] and summary["torch_api_gaps"] == []
    (step,) = summary["steps"]
    assert step["group"] == "unit" and "--cuda-only" in step["argv"] and step["status"] == "passed"
    assert "deselected" in proc.stdout and "needs" in proc.stdout  # -rs lists the CUDA-only tests skipped here


def test_cuda_only_plugin_selects_tests_that_need_cuda(tmp_path: Path) -> None:
    (tmp_path / "test_sel.py").write_text(
        "import pytest\n"
        "@pytest.mark.skipif(True, reason='needs a CUDA device')\n"
        "def test_gpu(): pass\n"
        "@pytest.mark.skipif(False, reason='checks the no-CUDA error')\n"
        "def test_fallback(): pass\n"
        "def test_plain(): pass\n"
    )
    env = _env(tmp_path)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "tools.gpucheck",
            "--cuda-only",
            "--collect-only",
            "-q",
            "-p",
            "no:cacheprovider",
            "-o",
            "addopts=",
            str(tmp_path / "test_sel.py"),
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "test_gpu" in proc.stdout and "test_fallback" not in proc.stdout and "test_plain" not in proc.stdout
    assert "2 deselected" in proc.stdout


def test_torch_api_gaps_names_what_the_machine_lacks(tmp_path: Path) -> None:
    from tools import gpucheck

    (tmp_path / "helpers").mkdir()
    t = "torch"  # built at run time, so that the scan of this very file finds nothing missing
    (tmp_path / "helpers" / "x.py").write_text(
        f"import {t}\n"
        f"from {t}.utils.data import DataLoader, NoSuchLoader42\n"
        f"{t}.cuda.synchronize\n"
        f"{t}.cuda.no_such_api_42()\n"
        f"{t}.no_such_module_42.thing\n"
        f'"""A docstring may name {t}.cuda.X, a placeholder, and {t}.no_such_in_docs_42."""\n'
        f"# and so may a comment: {t}.no_such_in_a_comment_42\n"
    )
    gaps = gpucheck.torch_api_gaps(tmp_path)
    assert gaps == [
        f"{t}.cuda.no_such_api_42 (used in helpers/x.py)",
        f"{t}.no_such_module_42 (used in helpers/x.py)",
        f"{t}.utils.data.NoSuchLoader42 (used in helpers/x.py)",
    ]


def test_gpucheck_rejects_bad_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    from tools import gpucheck

    assert gpucheck.main(["--allow-cpu", "--steps", "lint"]) == 2
    assert "--steps" in capsys.readouterr().err
    assert gpucheck.main(["--allow-cpu", "--notebooks", "99", "--dry-run"]) == 2
