"""examples/fast_pipeline.py: the take-home pipeline runs on the generated data set, imports no helpers.

It imports torch, torchvision and Pillow (which torchvision reads images with) only. Its command-line checks,
worker failures and Ctrl-C are tested in tests/test_example_cli.py.
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers.pipeline import data

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "fast_pipeline.py"
ALLOWED = {"torch", "torchvision", "PIL", "__future__"} | set(sys.stdlib_module_names)  # PIL: torchvision's reader


def _run(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT
    )


def test_imports_torch_and_torchvision_only() -> None:
    tree = ast.parse(SCRIPT.read_text())
    roots = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            roots.add((node.module or "").split(".")[0])
    assert roots <= ALLOWED, f"the take-home script must not import {sorted(roots - ALLOWED)}"


def test_pipeline_markers_frame_the_pipeline() -> None:
    lines = SCRIPT.read_text().splitlines()
    start, end = lines.index("# --- pipeline: start ---"), lines.index("# --- pipeline: end ---")
    body = "\n".join(lines[start:end])
    code = [ln for ln in lines[start + 1 : end] if ln.strip() and not ln.strip().startswith("#")]
    assert len(code) <= 55 and end - start <= 75, "the pipeline itself stays short enough to read at once"
    for token in (
        "DataLoader(",
        "pin_memory=pin",
        "persistent_workers",
        "prefetch_factor",
        "non_blocking=True",
        "torch.cuda.Stream",
        "wait_stream",
        "record_stream",
    ):
        assert token in body, token


@pytest.mark.slow
def test_trains_on_the_generated_data_set() -> None:
    info = data.make_shapes_dataset()
    out = _run(
        str(info.train_dir), "--epochs", "2", "--max-steps", "3", "--workers", "2", "--crop", "32", "--batch-size", "16"
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "epoch 2: 3 steps" in out.stdout
    assert f"{info.n_train} images in {len(info.classes)} classes" in out.stdout


def test_main_sets_the_globals_the_pipeline_reads_and_every_knob_runs(capsys: pytest.CaptureFixture[str]) -> None:
    """DEVICE, WORKERS and SEED are module globals the pipeline block reads; main() sets DEVICE and SEED.

    The slowest knobs (float on the host, no prefetcher, no persistence, no pinning) run in-process, workers=0.
    """
    import importlib.util

    info = data.make_shapes_dataset()
    spec = importlib.util.spec_from_file_location("fast_pipeline_under_test", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    assert mod.DEVICE.type == "cpu" and mod.SEED == 0 and mod.WORKERS >= 1
    rc = mod.main(
        [
            str(info.train_dir),
            "--epochs",
            "1",
            "--max-steps",
            "2",
            "--workers",
            "0",
            "--crop",
            "16",
            "--batch-size",
            "8",
            "--device",
            "cpu",
            "--seed",
            "3",
            "--float-on-host",
            "--no-prefetcher",
            "--no-persistent",
            "--no-pin",
        ]
    )
    assert rc == 0 and mod.SEED == 3 and mod.DEVICE == torch.device("cpu")
    out = capsys.readouterr().out
    assert "epoch 1: 2 steps" in out and "pin_memory False" in out and "prefetcher False" in out
    x = torch.arange(256, dtype=torch.uint8).view(1, 1, 16, 16).expand(1, 3, 16, 16)
    assert torch.allclose(mod.normalize(x), (x.float() / 255 - 0.5) / 0.25, atol=1e-6)  # MEAN, STD: 0-1 scale


def test_bad_input_gets_one_clear_error(tmp_path: Path) -> None:
    out = _run(str(tmp_path / "missing"))
    assert out.returncode == 2 and "is not a folder" in out.stderr and "Traceback" not in out.stderr
    out = _run(str(tmp_path), "--device", "cuda:7")
    assert out.returncode == 2 and "Traceback" not in out.stderr


@pytest.mark.slow
def test_corrupt_image_is_named(tmp_path: Path) -> None:
    info = data.make_shapes_dataset()
    root = tmp_path / "imgs"
    for cls in info.classes[:2]:
        src = sorted((info.train_dir / cls).iterdir())[:4]
        (root / cls).mkdir(parents=True)
        for f in src:
            shutil.copy(f, root / cls / f.name)
    bad = next((root / info.classes[0]).iterdir())
    bad.write_bytes(b"not a jpeg")
    out = _run(str(root), "--epochs", "1", "--workers", "0", "--batch-size", "8", "--crop", "16")
    assert out.returncode != 0
    assert f"cannot read image {bad}" in out.stderr and "Traceback" not in out.stderr and out.returncode == 2
