"""The data-set cache refuses or repairs every damaged state in one line (issue 25.5, 25.7, 25.4).

Each test builds a tiny data set under ``tmp_path``; nothing here needs a GPU.
"""

from __future__ import annotations

import errno
import json
import math
import pathlib
import shutil
import warnings
from pathlib import Path

import pytest

from helpers.pipeline import data, shapes

TINY = dict(n_train=24, n_val=12, image_size=32, num_classes=4, seed=5)


def _fresh(tmp_path: Path) -> data.DatasetInfo:
    return data.make_shapes_dataset(root=tmp_path, **TINY)


def _regenerated(tmp_path: Path) -> data.DatasetInfo:
    with pytest.warns(RuntimeWarning, match="regenerating"):
        again = data.make_shapes_dataset(root=tmp_path, **TINY)
    assert again.generated and data.verify_dataset(again.root, "full") == []
    return again


def test_flipped_byte_of_the_same_size_is_caught_by_default_and_regenerated(tmp_path: Path) -> None:
    info = _fresh(tmp_path)
    victim = next(info.train_dir.rglob("*.jpg"))
    raw = bytearray(victim.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    victim.write_bytes(bytes(raw))
    problems = data.verify_dataset(info.root)  # the default level
    assert len(problems) == 1 and str(victim) in problems[0] and "CRC-32" in problems[0]
    with pytest.raises(RuntimeError) as err:
        data.make_shapes_dataset(root=tmp_path, on_corrupt="raise", **TINY)
    assert "\n" not in str(err.value) and "delete the folder" in str(err.value)
    _regenerated(tmp_path)


def test_manifest_without_checksums_falls_back_to_sha256(tmp_path: Path) -> None:
    info = _fresh(tmp_path)
    mpath = info.root / "manifest.json"
    manifest = json.loads(mpath.read_text())
    for row in manifest["files"]:
        del row["crc32"]  # a manifest written before checksums were recorded
    mpath.write_text(json.dumps(manifest))
    assert data.verify_dataset(info.root) == []
    victim = info.root / manifest["files"][0]["path"]
    raw = bytearray(victim.read_bytes())
    raw[-3] ^= 0x01
    victim.write_bytes(bytes(raw))
    assert any("SHA-256" in p for p in data.verify_dataset(info.root))


@pytest.mark.parametrize(
    "manifest",
    [
        [],
        {"files": {"a": 1}},
        {"files": [1, 2]},
        {"files": [{"path": "train/x.jpg"}]},
        {"files": [{"path": "../../etc/passwd", "size": 1, "sha256": "00"}]},
        {"files": [{"path": "/etc/passwd", "size": 1, "sha256": "00"}]},
    ],
    ids=["list", "files-dict", "files-ints", "row-lacks-size", "path-escapes", "path-absolute"],
)
def test_wrong_shaped_manifest_is_one_problem_and_regenerated(tmp_path: Path, manifest: object) -> None:
    info = _fresh(tmp_path)
    (info.root / "manifest.json").write_text(json.dumps(manifest))
    problems = data.verify_dataset(info.root)
    assert len(problems) == 1 and "not a data-set manifest" in problems[0]
    _regenerated(tmp_path)


def test_manifest_shape_is_checked_even_without_verification(tmp_path: Path) -> None:
    info = _fresh(tmp_path)
    (info.root / "manifest.json").write_text(json.dumps({"files": [1]}))
    with pytest.warns(RuntimeWarning, match="regenerating"):
        again = data.make_shapes_dataset(root=tmp_path, verify="none", **TINY)
    assert again.generated


def test_class_folder_replaced_by_a_file_is_a_problem_not_a_traceback(tmp_path: Path) -> None:
    info = _fresh(tmp_path)
    folder = info.val_dir / info.classes[1]
    shutil.rmtree(folder)
    folder.write_bytes(b"not a folder")
    problems = data.verify_dataset(info.root)
    assert problems and all("\n" not in p for p in problems)
    assert any(str(folder) in p for p in problems)
    _regenerated(tmp_path)


def test_stale_temporaries_of_a_killed_generation_are_removed(tmp_path: Path) -> None:
    info = _fresh(tmp_path)
    own = tmp_path / f".{info.root.name}.tmp-999999-deadbeef"
    other = tmp_path / ".shapes-v2-other.tmp-999998-cafecafe"
    for t in (own, other):
        (t / "train" / "disc").mkdir(parents=True)
        (t / "train" / "disc" / "00000.jpg").write_bytes(b"half")
    again = data.make_shapes_dataset(root=tmp_path, **TINY)  # a reuse also cleans
    assert not again.generated
    assert not own.exists() and not other.exists()


def test_stale_temporary_of_a_running_generation_is_kept(tmp_path: Path) -> None:
    import fcntl

    _fresh(tmp_path)
    busy = tmp_path / ".shapes-v2-busy.tmp-1-abcdef01"
    busy.mkdir()
    with open(tmp_path / ".shapes-v2-busy.lock", "a+") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)  # another generation holds that data set's lock
        data.make_shapes_dataset(root=tmp_path, **TINY)
        assert busy.exists()
        fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def test_full_disk_is_one_line_and_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = pathlib.Path.write_bytes
    calls = {"n": 0}

    def write_bytes(self: pathlib.Path, payload: bytes) -> int:
        calls["n"] += 1
        if calls["n"] > 5:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, payload)

    monkeypatch.setattr(pathlib.Path, "write_bytes", write_bytes)
    with pytest.raises(OSError) as err:
        data.make_shapes_dataset(root=tmp_path, workers=1, progress=lambda f, t="": None, **TINY)
    assert err.value.errno == errno.ENOSPC
    msg = str(err.value)
    assert "\n" not in msg and "full" in msg and "WORKBOOK_CACHE" in msg
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]


def test_space_refusal_says_real_sizes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shapes.shutil, "disk_usage", lambda p: usage._replace(free=5 * 2**20))
    with pytest.raises(ValueError) as err:
        data.make_shapes_dataset(root=tmp_path, n_train=4000, n_val=10, image_size=64)
    msg = str(err.value)
    assert "0.0 GiB" not in msg and "5.0 MiB free" in msg, msg


@pytest.mark.parametrize("root", ["", "   "])
def test_empty_root_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, root: str) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="root must be a folder path"):
        data.make_shapes_dataset(root=root, **TINY)
    assert list(tmp_path.iterdir()) == []  # nothing written into the current folder


def test_root_that_is_a_file_is_refused(tmp_path: Path) -> None:
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(ValueError, match="is a file"):
        data.make_shapes_dataset(root=f, **TINY)


@pytest.mark.parametrize("where", ["file", "under-file"])
def test_cache_variable_pointing_at_a_file_is_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    f = tmp_path / "file"
    f.write_text("x")
    monkeypatch.setenv("WORKBOOK_CACHE", str(f if where == "file" else f / "sub"))
    with pytest.raises(ValueError) as err:
        data.make_shapes_dataset(**TINY)
    assert "WORKBOOK_CACHE" in str(err.value) and "\n" not in str(err.value)


def test_cache_folder_that_takes_no_files_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    # Root may write anywhere a chmod forbids, so use a folder that truly takes no new files: /proc.
    if not Path("/proc").is_dir():  # pragma: no cover - Linux only
        pytest.skip("needs /proc")
    monkeypatch.setenv("WORKBOOK_CACHE", "/proc")
    with pytest.raises(PermissionError) as err:
        data.make_shapes_dataset(**TINY)
    assert "WORKBOOK_CACHE" in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(std=(math.nan, 0.25, 0.25)),
        dict(std=(0.25, math.inf, 0.25)),
        dict(mean=(0.5, math.nan, 0.5)),
        dict(std=("a", 0.2, 0.2)),
    ],
)
def test_shapes_dataset_refuses_non_finite_statistics(tmp_path: Path, kwargs: dict) -> None:
    info = _fresh(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ValueError, match="mean and std"):
            data.ShapesDataset(info.train_dir, **kwargs)
