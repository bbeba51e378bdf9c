"""examples/fast_pipeline.py: the take-home pipeline runs on the generated data set, imports no helpers."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import data

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "fast_pipeline.py"
ALLOWED = {"torch", "torchvision", "__future__"} | set(sys.stdlib_module_names)


def _run(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout,
                          cwd=ROOT)


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
    assert end - start <= 60, "the pipeline itself stays short enough to read at once"
    for token in ("DataLoader(", "pin_memory=pin", "persistent_workers", "prefetch_factor", "non_blocking=True",
                  "torch.cuda.Stream", "wait_stream", "record_stream"):
        assert token in body, token


@pytest.mark.slow
def test_trains_on_the_generated_data_set() -> None:
    info = data.make_shapes_dataset()
    out = _run(str(info.train_dir), "--epochs", "2", "--max-steps", "3", "--workers", "2", "--crop", "32",
               "--batch-size", "16")
    assert out.returncode == 0, out.stderr[-2000:]
    assert "epoch 2: 3 steps" in out.stdout
    assert f"{info.n_train} images in {len(info.classes)} classes" in out.stdout


def test_bad_input_gets_one_clear_error(tmp_path: Path) -> None:
    out = _run(str(tmp_path / "missing"))
    assert out.returncode == 2 and "is not a folder" in out.stderr and "Traceback" not in out.stderr
    out = _run(str(tmp_path), "--device", "cuda:7")
    assert out.returncode != 0 and "Traceback" not in out.stderr


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
    assert "an image could not be read" in out.stderr and "Traceback" not in out.stderr
