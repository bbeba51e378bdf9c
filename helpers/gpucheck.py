"""The GPU check: one command that proves the workbook's GPU paths on a real CUDA GPU.

Run it on a machine with a CUDA GPU, from the workbook folder::

    python -m helpers.gpucheck                    # the unit tests, every notebook (full mode, nbval), the bench
    python -m helpers.gpucheck --steps unit       # only the unit tests (their CUDA-only tests run here)
    python -m helpers.gpucheck --steps bench      # only the benchmark (records a reference file)
    python -m helpers.gpucheck --steps notebooks --notebooks 02,05
    python -m helpers.gpucheck --dry-run          # print what it would run

What it does, in order:

1. Refuses, with exit code 2 and a plain message, when no CUDA device is
   present (``--allow-cpu`` runs it anyway, for testing the check itself).
2. Checks that the packages it needs import (nbval, nbformat, nbclient,
   jupyter_client, ipykernel, ipywidgets, pytest, pytest-timeout, tqdm,
   matplotlib); on a bare machine they travel as wheels (``tools/carry_wheels.sh``).
3. Runs the unit tests (``tests/``, quick sizes; not the browser suite, nor the
   environment-file check): on a GPU, the tests marked "needs CUDA", which CI
   always skips, run for real. ``-rs`` lists whatever still skipped, and why.
4. Runs every notebook in FULL mode (``WORKBOOK_QUICK=0``) under nbval
   (``pytest --nbval-lax --nbval-current-env``, a per-cell timeout and a
   per-notebook timeout), one pytest process per notebook, with
   ``WORKBOOK_REQUIRE_GPU=1`` so that a chapter raises in a GPU path instead
   of falling back to the CPU or to reference results.
5. Runs ``python -m helpers.bench --full --strict --reference``: every
   chapter's measurements, a results file, a PNG summary, and a reference
   file under ``helpers/reference/`` to commit.
6. Prints a summary (one line per step), writes it to ``summary.txt`` and
   ``summary.json`` beside the logs, and exits 0 only if every step passed.

A time budget (``--budget-s``) stops it from starting a step it cannot
finish; the steps not run are listed and the exit code is 1. Nothing here
installs anything: torch is whatever the machine has.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import importlib
import json
import os
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

__all__ = ["NEEDED_MODULES", "Step", "main", "plan", "repo_root", "notebooks"]

#: (import name, distribution name) of what the check needs beyond torch.
NEEDED_MODULES: tuple[tuple[str, str], ...] = (
    ("pytest", "pytest"),
    ("pytest_timeout", "pytest-timeout"),
    ("nbval", "nbval"),
    ("nbformat", "nbformat"),
    ("nbclient", "nbclient"),
    ("jupyter_client", "jupyter_client"),
    ("ipykernel", "ipykernel"),
    ("ipywidgets", "ipywidgets"),
    ("tqdm", "tqdm"),
    ("matplotlib", "matplotlib"),
    ("PIL", "pillow"),
    ("psutil", "psutil"),
    ("torchvision", "torchvision"),
)

NO_CUDA_EXIT = 2


def repo_root() -> Path:
    """The workbook checkout this module lives in."""
    return Path(__file__).resolve().parent.parent


def notebooks(root: Path, spec: str | None = None) -> list[Path]:
    """Notebooks under ``root/notebooks`` (``spec``: comma-separated prefixes such as ``00,02``)."""
    found = sorted(p for p in (root / "notebooks").glob("*.ipynb") if not p.name.startswith("."))
    if not spec:
        return found
    wanted = [s.strip() for s in spec.split(",") if s.strip()]
    chosen = [p for p in found if any(p.name.startswith(w.zfill(2) if w.isdigit() else w) for w in wanted)]
    missing = [w for w in wanted if not any(p.name.startswith(w.zfill(2) if w.isdigit() else w) for p in found)]
    if missing:
        raise ValueError(f"--notebooks: no notebook starts with {', '.join(missing)}; "
                         f"found {', '.join(p.name for p in found) or 'none'}")
    return chosen


@dataclass
class Step:
    """One step of the check: a command, its log, and how it went."""

    name: str
    argv: list[str]
    timeout_s: float
    log: str = ""
    status: str = "not run"  # "passed" | "failed" | "timed out" | "not run"
    returncode: int | None = None
    seconds: float = 0.0
    detail: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)  # overrides of the check's environment for this step


def _check_imports() -> list[str]:
    missing = []
    for mod, dist in NEEDED_MODULES:
        try:
            importlib.import_module(mod)
        except Exception as exc:
            missing.append(f"{dist} (import {mod}: {exc})")
    return missing


def _env(root: Path, quick: bool) -> dict[str, str]:
    env = dict(os.environ)
    paths = [str(root)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))  # `import helpers` from the notebooks' folder
    env["WORKBOOK_QUICK"] = "1" if quick else "0"
    env["WORKBOOK_REQUIRE_GPU"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("MPLBACKEND", "Agg")
    return env


def plan(
    root: Path,
    nbs: Sequence[Path],
    *,
    steps: Sequence[str],
    cell_timeout: int,
    notebook_timeout: int,
    bench_timeout: int,
    reference: bool,
    strict: bool,
    quick: bool,
    workdir: Path,
) -> list[Step]:
    """The commands the check runs, in order."""
    py = sys.executable
    out: list[Step] = []
    if "unit" in steps:
        argv = [py, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-o", "addopts=", "--timeout=900",
                "--ignore=tests/browser", "--ignore=tests/test_environment_sync.py", "--durations=10", "tests"]
        # quick sizes; no WORKBOOK_REQUIRE_GPU: some tests check the CPU fallbacks on purpose
        out.append(Step(name="unit tests", argv=argv, timeout_s=notebook_timeout,
                        env={"WORKBOOK_QUICK": "1", "WORKBOOK_REQUIRE_GPU": "0"}))
    if "notebooks" in steps:
        sanitize = root / "tests" / "nbval_sanitize.cfg"
        for nb in nbs:
            argv = [py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--nbval-lax", "--nbval-current-env",
                    f"--nbval-cell-timeout={cell_timeout}", f"--timeout={cell_timeout + 60}", "-o", "addopts=",
                    "--durations=5"]
            if sanitize.is_file():
                argv += ["--nbval-sanitize-with", str(sanitize)]
            argv.append(str(nb.relative_to(root)))
            out.append(Step(name=f"notebook {nb.stem}", argv=argv, timeout_s=notebook_timeout))
    if "bench" in steps:
        argv = [py, "-m", "helpers.bench", "--quick" if quick else "--full", "--no-progress",
                "--out", str(workdir / "bench.json"), "--png", str(workdir / "bench.png")]
        if strict:
            argv.append("--strict")
        if reference:
            argv.append("--reference")
        out.append(Step(name="bench", argv=argv, timeout_s=bench_timeout))
    return out


def _run_step(step: Step, root: Path, env: dict[str, str], log_path: Path, deadline: float | None) -> None:
    step.log = str(log_path)
    timeout = step.timeout_s
    if deadline is not None:
        left = deadline - time.monotonic()
        if left < 30:
            step.status, step.detail = "not run", "time budget used up (--budget-s)"
            return
        timeout = min(timeout, left)
    print(f"\n=== {step.name}: {shlex.join(step.argv)}  (timeout {timeout:.0f} s)", flush=True)
    t0 = time.monotonic()
    with open(log_path, "w", encoding="utf-8") as log:
        log.write(f"$ {shlex.join(step.argv)}\n\n")
        log.flush()
        proc = subprocess.Popen(step.argv, cwd=root, env={**env, **step.env}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, errors="replace", start_new_session=True, bufsize=1)
        reader = threading.Thread(target=_tee, args=(proc, log), daemon=True)
        reader.start()
        try:
            proc.wait(timeout=timeout)  # a silent hang is caught too: the reader thread does the output
        except subprocess.TimeoutExpired:
            _kill(proc)
            step.status, step.detail = "timed out", f"stopped after {timeout:.0f} s"
        except KeyboardInterrupt:
            _kill(proc)
            step.status, step.detail = "failed", "interrupted"
            raise
        finally:
            step.seconds = round(time.monotonic() - t0, 1)
            if proc.poll() is None:
                _kill(proc)
            reader.join(timeout=10)
            if step.status == "timed out":
                log.write(f"\n[gpucheck] TIMED OUT after {timeout:.0f} s: the step was stopped\n")
    step.returncode = proc.returncode
    if step.status == "not run":
        step.status = "passed" if proc.returncode == 0 else "failed"
        if proc.returncode != 0:
            step.detail = f"exit code {proc.returncode}; see {log_path.name}"


def _tee(proc: subprocess.Popen, log: Any) -> None:
    """Copy a step's output to the console and its log, line by line."""
    assert proc.stdout is not None
    for line in proc.stdout:
        sys.stdout.write(line)
        sys.stdout.flush()
        log.write(line)
    log.flush()


def _kill(proc: subprocess.Popen) -> None:
    """Stop a step and the processes it started (its own session, e.g. a notebook kernel)."""
    import signal

    try:
        os.killpg(proc.pid, signal.SIGTERM)  # the bench saves a partial file on SIGTERM
        proc.wait(timeout=30)
    except (ProcessLookupError, subprocess.TimeoutExpired, PermissionError):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m helpers.gpucheck",
        description="Run every notebook in full mode under nbval and the headless benchmark on a CUDA GPU; "
        "fail loudly on any error in a GPU path.",
    )
    ap.add_argument("--steps", default="unit,notebooks,bench",
                    help="which steps, in order: unit,notebooks,bench (default all three)")
    ap.add_argument("--notebooks", metavar="LIST", help="only notebooks starting with these prefixes, e.g. 00,02")
    ap.add_argument("--logs", metavar="DIR", help="folder for logs, results and the summary "
                    "(default: artifacts/gpucheck-<time>)")
    ap.add_argument("--bundle", action="store_true", help="put the per-step logs in one gpucheck-logs.tar.gz inside "
                    "--logs (few files: for machines that return a limited number of files)")
    ap.add_argument("--cell-timeout", type=int, default=900, help="seconds per notebook cell (default 900)")
    ap.add_argument("--notebook-timeout", type=int, default=1800, help="seconds per notebook (default 1800)")
    ap.add_argument("--bench-timeout", type=int, default=3600, help="seconds for the benchmark (default 3600)")
    ap.add_argument("--budget-s", type=float, help="stop starting steps when this many seconds have passed "
                    "(for leased machines with a per-command limit)")
    ap.add_argument("--no-reference", action="store_true", help="do not save the bench results as a reference file")
    ap.add_argument("--allow-cpu", action="store_true", help="run without CUDA (to test the check itself; "
                    "no reference file is written, and strict GPU checks are off)")
    ap.add_argument("--quick", action="store_true", help="quick mode instead of full (to test the check itself)")
    ap.add_argument("--dry-run", action="store_true", help="print the plan and exit")
    return ap


def _has_cuda() -> tuple[bool, str]:
    try:
        import torch
    except Exception as exc:
        return False, f"torch cannot be imported ({exc})"
    try:
        if torch.cuda.is_available():
            return True, f"{torch.cuda.get_device_name(0)} (torch {torch.__version__}, CUDA {torch.version.cuda})"
    except Exception as exc:
        return False, f"torch.cuda failed: {exc}"
    why = "this torch build has no CUDA support" if not torch.version.cuda else "no CUDA device or driver is visible"
    return False, f"{why} (torch {torch.__version__})"


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; returns the exit code (0 all passed, 1 a step failed, 2 refused)."""
    args = _parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    root = repo_root()
    steps = [s.strip() for s in args.steps.split(",") if s.strip()]
    bad = [s for s in steps if s not in ("unit", "notebooks", "bench")]
    if bad or not steps:
        print(f"error: --steps: unknown step(s) {', '.join(bad) or '(none)'}; allowed: unit, notebooks, bench",
              file=sys.stderr)
        return 2
    for name in ("cell_timeout", "notebook_timeout", "bench_timeout"):
        if not 1 <= getattr(args, name) <= 86_400:
            print(f"error: --{name.replace('_', '-')} must be between 1 and 86400 seconds", file=sys.stderr)
            return 2
    if args.budget_s is not None and not 60 <= args.budget_s <= 7 * 86_400:
        print("error: --budget-s must be between 60 and 604800 seconds", file=sys.stderr)
        return 2
    start = time.monotonic()
    deadline = start + args.budget_s if args.budget_s else None

    cuda, cuda_line = _has_cuda()
    if not cuda and not args.allow_cpu:
        print(
            "gpucheck refused: no CUDA GPU is usable here — " + cuda_line + ".\n"
            "The GPU check proves the workbook's GPU paths and records reference results, so it needs a machine "
            "with a CUDA GPU (see docs/GPU-CHECK.md). On a machine without one, run `make test` instead; "
            "to test the check itself, add --allow-cpu.",
            file=sys.stderr,
        )
        return NO_CUDA_EXIT
    try:
        nbs = notebooks(root, args.notebooks) if "notebooks" in steps else []
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if "notebooks" in steps and not nbs:
        print(f"error: no notebooks under {root / 'notebooks'}", file=sys.stderr)
        return 2

    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    if args.logs:
        workdir = Path(args.logs).resolve()
    else:
        from .config import artifacts_dir

        workdir = artifacts_dir().resolve() / f"gpucheck-{stamp}"
    reference = cuda and not args.no_reference and not args.quick
    strict = cuda
    the_plan = plan(root, nbs, steps=steps, cell_timeout=args.cell_timeout, notebook_timeout=args.notebook_timeout,
                    bench_timeout=args.bench_timeout, reference=reference, strict=strict, quick=args.quick,
                    workdir=workdir)
    env = _env(root, args.quick)
    if not cuda:
        env["WORKBOOK_REQUIRE_GPU"] = "0"

    print(f"gpucheck: {cuda_line if cuda else 'NO CUDA (--allow-cpu): testing the check itself'}")
    print(f"  workbook: {root}\n  python: {sys.executable}\n  mode: {'quick' if args.quick else 'full'}; "
          f"WORKBOOK_REQUIRE_GPU={env['WORKBOOK_REQUIRE_GPU']}; logs: {workdir}")
    if args.dry_run:
        for s in the_plan:
            print(f"  would run [{s.name}] (timeout {s.timeout_s} s): {shlex.join(s.argv)}")
        return 0

    missing = _check_imports()
    if missing:
        print("gpucheck refused: these packages are missing: " + "; ".join(missing) + ".\n"
              "On a machine without network, carry them as wheels: see tools/carry_wheels.sh and docs/GPU-CHECK.md.",
              file=sys.stderr)
        return 2

    workdir.mkdir(parents=True, exist_ok=True)
    logdir = Path(tempfile.mkdtemp(prefix="gpucheck-logs-")) if args.bundle else workdir / "logs"
    logdir.mkdir(parents=True, exist_ok=True)
    try:
        from .device import hardware_report

        (logdir / "hardware.txt").write_text(hardware_report().describe() + "\n", encoding="utf-8")
    except Exception as exc:
        (logdir / "hardware.txt").write_text(f"hardware_report failed: {exc!r}\n", encoding="utf-8")

    interrupted = False
    try:
        for step in the_plan:
            log_path = logdir / (step.name.replace(" ", "-") + ".log")
            _run_step(step, root, env, log_path, deadline)
    except KeyboardInterrupt:
        interrupted = True
        print("\ngpucheck interrupted", file=sys.stderr)

    # -- what the bench wrote -----------------------------------------------------
    bench_step = next((s for s in the_plan if s.name == "bench"), None)
    ref_file = None
    if bench_step is not None and bench_step.log and Path(bench_step.log).is_file():
        log_text = Path(bench_step.log).read_text(encoding="utf-8", errors="replace")
        if reference and "reference file:" not in log_text and (workdir / "bench.json").is_file():
            # the bench was stopped (timeout) before writing its reference: keep the chapters it completed
            done = subprocess.run([sys.executable, "-m", "helpers.bench", "--reference-from",
                                   str(workdir / "bench.json")], cwd=root, env=env, capture_output=True, text=True,
                                  timeout=300)
            log_text += "\n[gpucheck] --reference-from the partial results:\n" + done.stdout + done.stderr
            with open(bench_step.log, "a", encoding="utf-8") as fh:
                fh.write("\n[gpucheck] --reference-from the partial results:\n" + done.stdout + done.stderr)
            print(done.stdout + done.stderr)
        for line in log_text.splitlines():
            if line.strip().startswith("reference file:"):
                ref_file = line.split("reference file:", 1)[1].split("(")[0].strip()
        if ref_file and Path(ref_file).is_file():
            shutil.copy2(ref_file, workdir / Path(ref_file).name)
            bench_step.extra["reference_file"] = ref_file
        if (workdir / "bench.json").is_file():
            try:
                data = json.loads((workdir / "bench.json").read_text(encoding="utf-8"))
                bench_step.extra["chapters"] = {c["chapter"]: c["status"] for c in data["provenance"]["bench"]["chapters"]}
            except (OSError, ValueError, KeyError, TypeError):
                pass

    # -- summary ----------------------------------------------------------------------
    failed = [s for s in the_plan if s.status != "passed"]
    lines = [
        f"gpucheck {stamp}: {'PASSED' if not failed and not interrupted else 'FAILED'}",
        f"device: {cuda_line if cuda else 'no CUDA (--allow-cpu)'}; mode: {'quick' if args.quick else 'full'}",
        f"total: {time.monotonic() - start:.0f} s",
        "",
    ]
    for s in the_plan:
        lines.append(f"{s.status.upper():<10} {s.name:<40} {s.seconds:>7.1f} s  {s.detail}")
        if s.extra.get("chapters"):
            lines.append("           chapters: " + ", ".join(f"{k} {v}" for k, v in s.extra["chapters"].items()))
    if ref_file:
        lines += ["", f"reference file written: {ref_file}",
                  "commit it (copy it into helpers/reference/ of your checkout if this ran elsewhere); "
                  "then `python -m helpers.bench --readme-table --update README.md`"]
    elif reference and bench_step is not None:
        lines += ["", "no reference file was written (see the bench log)"]
    text = "\n".join(lines)
    print("\n" + "=" * 78 + "\n" + text + "\n" + "=" * 78)
    (workdir / "summary.txt").write_text(text + "\n", encoding="utf-8")
    (workdir / "summary.json").write_text(json.dumps({
        "passed": not failed and not interrupted, "stamp": stamp, "device": cuda_line, "cuda": cuda,
        "mode": "quick" if args.quick else "full", "steps": [asdict(s) for s in the_plan],
        "reference_file": ref_file}, indent=1) + "\n", encoding="utf-8")
    if args.bundle:
        with tarfile.open(workdir / "gpucheck-logs.tar.gz", "w:gz") as tar:
            tar.add(logdir, arcname="gpucheck-logs")
        shutil.rmtree(logdir, ignore_errors=True)
    if failed or interrupted:
        print("\n" + "!" * 78 + "\nGPU CHECK FAILED: " + ", ".join(f"{s.name} ({s.status})" for s in failed)
              + "\n" + "!" * 78, file=sys.stderr)
        return 130 if interrupted else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
