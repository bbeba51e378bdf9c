"""Unit tests for helpers.pipeline.data: generation, cache integrity, the Dataset and the loader."""

from __future__ import annotations

import hashlib
import pickle
import threading
import warnings
from pathlib import Path

import pytest
import torch
from torchvision.datasets import ImageFolder

from helpers.pipeline import data, loaders, shapes

TINY = dict(n_train=24, n_val=12, image_size=32, num_classes=4, seed=3)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> data.DatasetInfo:
    return data.make_shapes_dataset(root=tmp_path_factory.mktemp("cache"), **TINY)


def _digest(folder: Path) -> dict[str, str]:
    return {
        p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*.jpg"))
    }


def test_default_sizes_follow_quick_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORKBOOK_QUICK", "1")
    quick = data.default_sizes()
    monkeypatch.setenv("WORKBOOK_QUICK", "0")
    full = data.default_sizes()
    assert set(quick) == {"n_train", "n_val", "image_size", "crop_size", "num_classes", "batch_size"}
    assert quick["n_train"] < full["n_train"] and quick["image_size"] < full["image_size"]
    assert quick["crop_size"] <= quick["image_size"] and full["crop_size"] <= full["image_size"]


def test_laptop_tier_is_smaller_than_full_and_cached_apart(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 19: without a GPU the default sizes fit a 2-core laptop; each size set is its own folder."""
    from helpers.core import config

    monkeypatch.delenv("WORKBOOK_QUICK", raising=False)
    monkeypatch.setenv("WORKBOOK_FULL", "1")
    full = data.default_sizes()
    monkeypatch.delenv("WORKBOOK_FULL")
    monkeypatch.setattr(config, "_cuda_present", lambda: False)
    assert config.size_tier() == "laptop"
    laptop = data.default_sizes()
    monkeypatch.setenv("WORKBOOK_QUICK", "1")
    quick = data.default_sizes()
    for key in ("n_train", "n_val", "image_size", "crop_size"):
        assert quick[key] <= laptop[key] < full[key], key
    assert laptop["crop_size"] <= laptop["image_size"]
    names = {shapes.dataset_name(s["n_train"], s["n_val"], s["image_size"], 6, 0, 90) for s in (quick, laptop, full)}
    assert len(names) == 3


def test_generation_reports_progress(tmp_path: Path) -> None:
    seen: list[tuple[float, str]] = []
    info = data.make_shapes_dataset(root=tmp_path, progress=lambda f, t="": seen.append((f, t)), **TINY)
    fractions = [f for f, _ in seen]
    assert info.generated and fractions[0] == 0.0 and fractions[-1] == 1.0
    assert fractions == sorted(fractions) and len(fractions) >= 4
    assert any("36 written" in t or "of 36" in t for _, t in seen)  # says what is done and what is left
    seen.clear()
    again = data.make_shapes_dataset(root=tmp_path, progress=lambda f, t="": seen.append((f, t)), **TINY)
    assert not again.generated and seen[-1][0] == 1.0 and any("verifying" in t for _, t in seen)


def _read_only_lock(monkeypatch: pytest.MonkeyPatch, err: int) -> None:
    """Simulate a read-only cache folder: opening the lock file fails as it would there.

    (Tests run as root here, where chmod does not stop writes.)
    """
    import contextlib
    import errno as errno_mod
    import os

    @contextlib.contextmanager
    def refuse(path: Path):
        raise OSError(err, os.strerror(err), str(path))
        yield  # pragma: no cover

    assert err in (errno_mod.EROFS, errno_mod.EACCES)
    monkeypatch.setattr(shapes, "_file_lock", refuse)


@pytest.mark.parametrize("err", ["EROFS", "EACCES"])
def test_read_only_cache_reuses_a_verified_copy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, err: str) -> None:
    """Issue 15.9: a data set in a read-only cache is usable; a missing or damaged one names WORKBOOK_CACHE."""
    import errno as errno_mod

    made = data.make_shapes_dataset(root=tmp_path, **TINY)
    _read_only_lock(monkeypatch, getattr(errno_mod, err))
    info = data.make_shapes_dataset(root=tmp_path, **TINY)
    assert not info.generated and info.root == made.root and info.n_train == TINY["n_train"]
    with pytest.raises(PermissionError, match="WORKBOOK_CACHE"):
        data.make_shapes_dataset(root=tmp_path, **{**TINY, "seed": 99})  # not there: cannot be generated here
    victim = next(made.train_dir.rglob("*.jpg"))
    victim.write_bytes(victim.read_bytes()[:-10])
    with pytest.raises(PermissionError, match="damaged.*WORKBOOK_CACHE"):
        data.make_shapes_dataset(root=tmp_path, **TINY)


def test_read_only_lock_other_errors_still_raise(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import errno as errno_mod

    data.make_shapes_dataset(root=tmp_path, **TINY)
    _read_only_lock(monkeypatch, errno_mod.EROFS)
    monkeypatch.setattr(shapes, "_UNWRITABLE", ())  # an OSError that is not about permissions
    with pytest.raises(OSError):
        data.make_shapes_dataset(root=tmp_path, **TINY)


def test_generation_checks_disk_space(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import shutil
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**6, 10**6 - 1000, 1000))
    with pytest.raises(ValueError, match="1000 B free"):
        data.make_shapes_dataset(root=tmp_path, **TINY)
    assert not any(tmp_path.glob("shapes-*"))


def test_layout_is_imagefolder_readable(tiny: data.DatasetInfo) -> None:
    assert tiny.generated
    # in label order: classes[y] names label y, as ImageFolder and the workbook's data set number the folders
    assert tiny.classes == sorted(shapes.SHAPE_CLASSES[:4])
    assert (tiny.root / "manifest.json").is_file()
    folder = ImageFolder(str(tiny.train_dir))
    assert len(folder) == 24 and folder.classes == tiny.classes
    img, label = folder[0]
    assert img.size == (32, 32) and 0 <= label < 4
    assert len(list(tiny.val_dir.rglob("*.jpg"))) == 12
    # balanced labels
    counts = [len(list((tiny.train_dir / c).glob("*.jpg"))) for c in tiny.classes]
    assert counts == [6, 6, 6, 6]
    assert tiny.total_bytes > 0 and "24 train + 12 val" in str(tiny)


def test_the_classes_are_listed_in_label_order(tmp_path: Path) -> None:
    """``info.classes[y]`` names label ``y``: the default six classes are drawn in another order than sorted."""
    info = data.make_shapes_dataset(root=tmp_path, n_train=12, n_val=6, image_size=16, num_classes=6, seed=3)
    assert list(shapes.SHAPE_CLASSES[:6]) != sorted(shapes.SHAPE_CLASSES[:6])  # else this test shows nothing
    ds = data.ShapesDataset(info.train_dir)
    assert info.classes == ds.classes == ImageFolder(str(info.train_dir)).classes
    assert all(info.classes[y] == Path(p).parent.name for p, y in ds.samples)


def test_generation_is_deterministic_and_reused(tiny: data.DatasetInfo, tmp_path: Path) -> None:
    other = data.make_shapes_dataset(root=tmp_path, **TINY)
    assert _digest(other.root) == _digest(tiny.root)
    again = data.make_shapes_dataset(root=tmp_path, **TINY)
    assert not again.generated and again.root == other.root
    different = data.make_shapes_dataset(root=tmp_path, **{**TINY, "seed": 4})
    assert different.root != other.root and _digest(different.root) != _digest(other.root)


def test_damaged_cache_is_detected(tmp_path: Path) -> None:
    info = data.make_shapes_dataset(root=tmp_path, **TINY)
    victim = next(info.train_dir.rglob("*.jpg"))
    victim.write_bytes(victim.read_bytes()[:50])  # truncated
    problems = data.verify_dataset(info.root)
    assert any(str(victim) in p for p in problems)
    with pytest.raises(RuntimeError, match="damaged"):
        data.make_shapes_dataset(root=tmp_path, on_corrupt="raise", **TINY)
    with pytest.warns(RuntimeWarning, match="regenerating"):
        fixed = data.make_shapes_dataset(root=tmp_path, **TINY)
    assert fixed.generated and data.verify_dataset(fixed.root, "full") == []


def test_full_verify_catches_same_size_change(tmp_path: Path) -> None:
    info = data.make_shapes_dataset(root=tmp_path, **TINY)
    victim = next(info.val_dir.rglob("*.jpg"))
    raw = bytearray(victim.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    victim.write_bytes(bytes(raw))
    assert any("CRC-32" in p for p in data.verify_dataset(info.root, "quick"))  # checked by default
    assert any("SHA-256" in p for p in data.verify_dataset(info.root, "full"))
    extra = info.val_dir / info.classes[0] / "extra.jpg"
    extra.write_bytes(b"x")
    assert any("unexpected" in p for p in data.verify_dataset(info.root, "quick"))


def test_missing_manifest_is_regenerated(tmp_path: Path) -> None:
    info = data.make_shapes_dataset(root=tmp_path, **TINY)
    (info.root / "manifest.json").unlink()  # e.g. an interrupted copy
    assert data.verify_dataset(info.root) and "no manifest.json" in data.verify_dataset(info.root)[0]
    again = data.make_shapes_dataset(root=tmp_path, **TINY)
    assert again.generated and data.verify_dataset(again.root) == []


def test_concurrent_generation_is_safe(tmp_path: Path) -> None:
    results: list[data.DatasetInfo] = []
    errors: list[BaseException] = []

    def work() -> None:
        try:
            results.append(data.make_shapes_dataset(root=tmp_path, **TINY))
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert sum(r.generated for r in results) == 1
    assert data.verify_dataset(results[0].root, "full") == []
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]


@pytest.mark.parametrize(
    "kwargs",
    [dict(n_train=0), dict(image_size=8), dict(num_classes=9), dict(quality=10), dict(verify="maybe")],
)
def test_generation_rejects_bad_arguments(tmp_path: Path, kwargs: dict) -> None:
    with pytest.raises(ValueError):
        data.make_shapes_dataset(root=tmp_path, **{**TINY, **kwargs})


def test_dataset_items(tiny: data.DatasetInfo) -> None:
    ds = data.ShapesDataset(tiny.train_dir, crop_size=24)
    assert len(ds) == 24 and ds.classes == sorted(tiny.classes)
    x, y = ds[0]
    assert x.shape == (3, 24, 24) and x.dtype == torch.float32 and isinstance(y, int)
    assert -3 < float(x.mean()) < 3
    u = data.ShapesDataset(tiny.train_dir, crop_size=24, output="uint8")
    xu, _ = u[0]
    assert xu.dtype == torch.uint8 and xu.shape == (3, 24, 24)
    assert xu.numel() * xu.element_size() * 4 == x.numel() * x.element_size()  # uint8: 4x fewer bytes to move
    assert ds.targets == [t for _, t in ds.samples]


def test_augmentation_is_random_and_seedable(tiny: data.DatasetInfo) -> None:
    ds = data.ShapesDataset(tiny.train_dir, crop_size=24)
    torch.manual_seed(0)
    a = [ds[0][0] for _ in range(4)]
    torch.manual_seed(0)
    b = [ds[0][0] for _ in range(4)]
    assert all(torch.equal(p, q) for p, q in zip(a, b))
    assert not all(torch.equal(a[0], p) for p in a[1:])
    ev = data.ShapesDataset(tiny.val_dir, crop_size=24, augment=False)
    assert torch.equal(ev[1][0], ev[1][0])


def test_uint8_then_normalize_equals_float(tiny: data.DatasetInfo) -> None:
    f = data.ShapesDataset(tiny.val_dir, crop_size=24, augment=False)
    u = data.ShapesDataset(tiny.val_dir, crop_size=24, augment=False, output="uint8")
    batch = torch.stack([u[i][0] for i in range(3)])
    expected = torch.stack([f[i][0] for i in range(3)])
    torch.testing.assert_close(data.to_float_normalized(batch), expected, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="uint8"):
        data.to_float_normalized(expected)
    with pytest.raises(ValueError, match="shape"):
        data.to_float_normalized(batch[0])


def test_missing_and_empty_folders(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="make_shapes_dataset"):
        data.ShapesDataset(tmp_path / "nope")
    with pytest.raises(ValueError, match="no class folders"):
        data.ShapesDataset(tmp_path)
    (tmp_path / "cat").mkdir()
    (tmp_path / "cat" / "notes.txt").write_text("hi")
    with pytest.raises(ValueError, match="no image files"):
        data.ShapesDataset(tmp_path)


def test_bad_arguments(tiny: data.DatasetInfo) -> None:
    with pytest.raises(ValueError, match="output"):
        data.ShapesDataset(tiny.train_dir, output="half")
    with pytest.raises(ValueError, match="on_error"):
        data.ShapesDataset(tiny.train_dir, on_error="ignore")
    with pytest.raises(ValueError, match="crop_size"):
        data.ShapesDataset(tiny.train_dir, crop_size=0)
    with pytest.raises(IndexError):
        data.ShapesDataset(tiny.train_dir)[1000]


def test_root_and_index_errors_are_clear(tiny: data.DatasetInfo) -> None:
    """Issue 15.11: ShapesDataset(root=None) and ds['3'] say what is wrong."""
    import numpy as np

    for bad in (None, 3, ""):
        with pytest.raises(ValueError, match="root must be a folder path"):
            data.ShapesDataset(bad)  # type: ignore[arg-type]
    ds = data.ShapesDataset(tiny.train_dir, crop_size=24)
    with pytest.raises(TypeError, match=r"integers from 0 to 23.*int\(\.\.\.\)"):
        ds["3"]  # type: ignore[index]
    for bad_index in (1.5, True, None):
        with pytest.raises(TypeError, match="indices must be integers"):
            ds[bad_index]  # type: ignore[index]
    assert ds[np.int64(3)][1] == ds[3][1] == ds[torch.tensor(3)][1]


def _copy_tree(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_corrupt_file_raises_naming_it_or_is_skipped(tiny: data.DatasetInfo, tmp_path: Path) -> None:
    root = _copy_tree(tiny.train_dir, tmp_path / "train")
    ds = data.ShapesDataset(root, crop_size=24)
    bad = Path(ds.samples[2][0])
    bad.write_bytes(b"this is not a jpeg")
    with pytest.raises(data.ImageDecodeError, match=bad.name):
        ds[2]
    empty = Path(ds.samples[5][0])
    empty.write_bytes(b"")
    with pytest.raises(data.ImageDecodeError, match="empty"):
        ds[5]
    cut = Path(ds.samples[7][0])
    cut.write_bytes(cut.read_bytes()[:120])  # truncated JPEG
    with pytest.raises(data.ImageDecodeError, match=cut.name):
        ds[7]
    skip = data.ShapesDataset(root, crop_size=24, on_error="skip")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        items = [skip[i] for i in range(len(skip))]
    assert len(items) == len(skip)
    assert len(skip.skipped) == 3 and str(bad) in skip.skipped and str(cut) in skip.skipped
    assert items[2][1] == skip.samples[3][1]  # replaced by the next readable file
    assert sum("skipped" in str(w.message) for w in caught) == 3


def test_loader_is_reproducible(tiny: data.DatasetInfo) -> None:
    ds = data.ShapesDataset(tiny.train_dir, crop_size=16, output="uint8")

    def labels(seed: int) -> list[int]:
        torch.manual_seed(0)
        return [int(t) for _, y in loaders.timed_loader(ds, 8, seed=seed) for t in y]

    assert labels(1) == labels(1)
    assert sorted(labels(1)) == sorted(ds.targets)
    loader = loaders.timed_loader(ds, 8)
    assert isinstance(loader.collate_fn, data.TimedCollate)
    next(iter(loader))
    assert loader.collate_fn.last is not None
    assert pickle.loads(pickle.dumps(loader.collate_fn)).last is None


def test_dataset_pickles(tiny: data.DatasetInfo) -> None:
    ds = data.ShapesDataset(tiny.train_dir, crop_size=16)
    clone = pickle.loads(pickle.dumps(ds))
    torch.manual_seed(1)
    a = ds[3][0]
    torch.manual_seed(1)
    assert torch.equal(a, clone[3][0])


@pytest.mark.slow
@pytest.mark.parametrize("context", ["spawn"])
def test_workers_with_spawn(tiny: data.DatasetInfo, context: str) -> None:
    ds = data.ShapesDataset(tiny.train_dir, crop_size=16)
    loader = loaders.timed_loader(ds, 6, num_workers=1, multiprocessing_context=context)
    batches = list(loader)
    assert sum(len(y) for _, y in batches) == len(ds)
    assert batches[0][0].shape == (6, 3, 16, 16)


def test_worker_error_names_the_file(tiny: data.DatasetInfo, tmp_path: Path) -> None:
    root = _copy_tree(tiny.train_dir, tmp_path / "train")
    ds = data.ShapesDataset(root, crop_size=16)
    bad = Path(ds.samples[0][0])
    bad.write_bytes(b"garbage")
    loader = loaders.timed_loader(ds, 4, shuffle=False, num_workers=1)
    with pytest.raises(data.ImageDecodeError, match=bad.name):
        list(loader)


@pytest.mark.slow
def test_parallel_generation_gives_identical_files(tmp_path: Path) -> None:
    kw = dict(n_train=300, n_val=20, image_size=24, num_classes=3, seed=1)
    one = data.make_shapes_dataset(root=tmp_path / "a", workers=1, **kw)
    two = data.make_shapes_dataset(root=tmp_path / "b", workers=2, **kw)
    assert _digest(one.root) == _digest(two.root)
    assert data.verify_dataset(two.root, "full") == []


def test_timed_loader_is_build_loader_with_validated_knobs():
    from helpers.chapters.ch04.datasets import CheapDataset
    from helpers.pipeline import loaders

    ds = CheapDataset(16, 4)
    loader = loaders.timed_loader(ds, 4, shuffle=False)
    assert isinstance(loader.collate_fn, data.TimedCollate) and hasattr(loader, "_workbook_warnings")
    with pytest.raises(ValueError, match="prefetch_factor"):
        loaders.timed_loader(ds, 4, prefetch_factor=2)  # needs workers
    with pytest.raises(ValueError, match="unknown loader knob"):
        loaders.timed_loader(ds, 4, workers=2)
    with pytest.raises(ValueError, match="shuffle=False"):
        loaders.timed_loader(ds, 4, sampler=range(16))
    assert [int(t) for _, y in loaders.timed_loader(ds, 4, shuffle=False, sampler=list(range(15, -1, -1))) for t in y][
        :2
    ] == [ds[15][1], ds[14][1]]
