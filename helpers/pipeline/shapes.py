"""The workbook's data set, drawn here (nothing can be downloaded): shapes and textures on noisy, shaded backgrounds,
as JPEG files in ImageFolder class folders that decode like real photos of the same size and that a small CNN learns
in a few epochs. :func:`make_shapes_dataset` generates it once (deterministic from ``seed``) or reuses a verified copy.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import json
import math
import multiprocessing as mp
import os
import shutil
import time
import uuid
import warnings
import zlib
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

from ..core.config import CACHE_ENV, cache_dir, sized
from ..core.progress import progress_bar
from ..core.validate import check_choice, check_int, human_bytes

#: Class names, in drawing order: ``num_classes=k`` draws the first ``k``. A loader numbers the class folders in
#: sorted order (as ``ImageFolder`` does): :attr:`DatasetInfo.classes` lists them that way.
SHAPE_CLASSES: tuple[str, ...] = ("disc", "ring", "square", "stripes", "dots", "checker", "triangle", "cross")
#: Bump when the drawing code changes, so cached copies are regenerated.
GENERATOR_VERSION = 2
MANIFEST = "manifest.json"
_SPLIT_CODE = {"train": 0, "val": 1}
#: errno values that mean "this folder cannot be written here" (not a bug, a setup).
_UNWRITABLE = (errno.EACCES, errno.EPERM, errno.EROFS)
#: Work (pixels drawn) below which one process generates faster than a pool that must start first.
_POOL_MIN_PIXELS = 100_000_000


def default_sizes(tier: str | None = None) -> dict[str, int]:
    """Problem sizes for the tier in force, or ``tier``. Quick: seconds to generate on 2 cores; laptop (no GPU): an
    epoch of chapter 01's model in tens of seconds; full (a GPU): 224 px crops of ~30 KiB files, like small photos."""
    if tier is not None:
        check_choice("tier", tier, ("quick", "laptop", "full"))

    def pick(**by_tier: int) -> int:
        return sized(**by_tier) if tier is None else by_tier[tier]

    return {
        "n_train": pick(quick=640, full=9600, laptop=1600),
        "n_val": pick(quick=256, full=2400, laptop=400),
        "image_size": pick(quick=80, full=256, laptop=112),
        "crop_size": pick(quick=64, full=224, laptop=96),
        "num_classes": 6,
        "batch_size": pick(quick=32, full=64, laptop=32),
    }


# -- drawing (the order of the random draws is the data set: changing it needs a new GENERATOR_VERSION) ----------


def _regular_polygon(n: int, cx: float, cy: float, r: float, angle: float) -> list[tuple[float, float]]:
    steps = [angle + 2 * math.pi * k / n for k in range(n)]
    return [(cx + r * math.cos(a), cy + r * math.sin(a)) for a in steps]


def _cross(cx: float, cy: float, r: float, angle: float) -> list[tuple[float, float]]:
    t = r * 0.36  # half arm thickness
    pts = [(t, r), (t, t), (r, t), (r, -t), (t, -t), (t, -r), (-t, -r), (-t, -t), (-r, -t), (-r, t), (-t, t), (-t, r)]
    c, s = math.cos(angle), math.sin(angle)
    return [(cx + x * c - y * s, cy + x * s + y * c) for x, y in pts]


def _colour_pair(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    weights = np.array([0.299, 0.587, 0.114])
    while True:
        bg = rng.integers(0, 256, size=3)
        fg = rng.integers(0, 256, size=3)
        if abs(float(weights @ bg) - float(weights @ fg)) >= 70:
            return bg.astype(np.float32), fg.astype(np.float32)


def _checker(draw: Any, size: int, angle: float, fill: Any, rng: np.random.Generator) -> None:
    cell = float(rng.uniform(0.12, 0.2)) * size
    c, s = math.cos(angle), math.sin(angle)
    cells = int(size * 1.5 / cell) + 2
    for i in range(-cells, cells):
        for j in range(-cells, cells):
            if (i + j) % 2:
                continue
            corners = [(i, j), (i + 1, j), (i + 1, j + 1), (i, j + 1)]
            pts = [(size / 2 + cell * (a * c - b * s), size / 2 + cell * (a * s + b * c)) for a, b in corners]
            if all(-cell <= px <= size + cell and -cell <= py <= size + cell for px, py in pts):
                draw.polygon(pts, fill=fill)


def _stripes(draw: Any, size: int, angle: float, fill: Any, rng: np.random.Generator) -> None:
    period = float(rng.uniform(0.12, 0.22)) * size
    width = max(1, int(period * 0.45))
    c, s = math.cos(angle), math.sin(angle)
    span = size * 1.5
    k = -span
    while k <= span:
        px, py = size / 2 + k * c, size / 2 + k * s
        draw.line([(px - span * s, py + span * c), (px + span * s, py - span * c)], fill=fill, width=width)
        k += period


def _dots(draw: Any, size: int, angle: float, fill: Any, rng: np.random.Generator) -> None:
    period = float(rng.uniform(0.14, 0.24)) * size
    rad = period * 0.25
    off = rng.uniform(0, period, size=2)
    y = off[1] - period
    while y < size + period:
        x = off[0] - period
        while x < size + period:
            draw.ellipse([x - rad, y - rad, x + rad, y + rad], fill=fill)
            x += period
        y += period


_TEXTURES = {"checker": _checker, "stripes": _stripes, "dots": _dots}


def render_image(label: int, size: int, rng: np.random.Generator) -> np.ndarray:
    """One ``(size, size, 3)`` uint8 image of class ``label``, with distractor lines and Gaussian noise."""
    from PIL import Image, ImageDraw

    name = SHAPE_CLASSES[label]
    bg, fg = _colour_pair(rng)
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float32) / max(size - 1, 1)
    gdir = rng.uniform(-1, 1, size=2)
    grad = (gdir[0] * (xx - 0.5) + gdir[1] * (yy - 0.5))[..., None] * rng.uniform(20, 60)
    img = Image.fromarray(np.clip(bg[None, None, :] + grad, 0, 255).astype(np.uint8), "RGB")
    draw = ImageDraw.Draw(img)
    fill = tuple(int(v) for v in fg)
    mid = tuple(int(v) for v in (0.6 * bg + 0.4 * fg))  # distractor lines, between background and foreground
    for _ in range(int(rng.integers(1, 4))):
        x0, y0, x1, y1 = (float(v) for v in rng.uniform(0, size, size=4))
        draw.line([(x0, y0), (x1, y1)], fill=mid, width=max(1, size // 64))
    r = float(rng.uniform(0.22, 0.38)) * size
    cx = float(rng.uniform(r, size - r))
    cy = float(rng.uniform(r, size - r))
    angle = float(rng.uniform(0, 2 * math.pi))
    if name == "disc":
        draw.ellipse([cx - r, cy - r, cx + r, cy + r], fill=fill)
    elif name == "ring":
        draw.ellipse([cx - r, cy - r, cx + r, cy + r], outline=fill, width=max(2, int(r * 0.3)))
    elif name in ("square", "triangle"):
        n, scale = (4, 1.1) if name == "square" else (3, 1.2)
        draw.polygon(_regular_polygon(n, cx, cy, r * scale, angle), fill=fill)
    elif name == "cross":
        draw.polygon(_cross(cx, cy, r * 1.1, angle), fill=fill)
    else:
        _TEXTURES[name](draw, size, angle, fill, rng)
    arr = np.asarray(img, dtype=np.float32)
    arr += rng.normal(0.0, float(rng.uniform(6, 18)), size=arr.shape).astype(np.float32)
    return np.clip(arr, 0, 255).astype(np.uint8)


def _encode_jpeg(arr: np.ndarray, quality: int) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(arr, "RGB").save(buf, format="JPEG", quality=quality)
    return buf.getvalue()


def _write_chunk(args: tuple[str, str, int, int, int, int, int, int]) -> list[dict[str, Any]]:
    """Images ``[start, stop)`` of one split written; their manifest rows (module level: pool workers)."""
    folder, split, start, stop, num_classes, image_size, seed, quality = args
    rows = []
    for index in range(start, stop):
        label = index % num_classes
        rng = np.random.default_rng(np.random.SeedSequence([seed, _SPLIT_CODE[split], index]))
        data = _encode_jpeg(render_image(label, image_size, rng), quality)
        rel = f"{split}/{SHAPE_CLASSES[label]}/{index:05d}.jpg"
        (Path(folder) / rel).write_bytes(data)
        crc, sha = zlib.crc32(data), hashlib.sha256(data).hexdigest()
        rows.append({"path": rel, "label": label, "size": len(data), "crc32": crc, "sha256": sha})
    return rows


# -- the cache -------------------------------------------------------------------------------------------------


@dataclass
class DatasetInfo:
    """Where a generated data set lives and what it holds; ``classes`` in label order (``classes[y]`` names label
    ``y``); ``generated`` False: a reused cached copy."""

    root: Path
    train_dir: Path
    val_dir: Path
    classes: list[str]
    n_train: int
    n_val: int
    image_size: int
    total_bytes: int
    generated: bool
    seconds: float
    params: dict[str, Any] = field(default_factory=dict)

    def __str__(self) -> str:
        how = "generated" if self.generated else "reused (verified)"
        mean_kib = self.total_bytes / max(1, self.n_train + self.n_val) / 1024
        return (
            f"{self.n_train} train + {self.n_val} val JPEGs, {self.image_size}x{self.image_size} px, "
            f"{len(self.classes)} classes, {self.total_bytes / 2**20:.1f} MiB "
            f"(mean {mean_kib:.1f} KiB/file), {how},\n  in {self.root}"
        )


def dataset_name(n_train: int, n_val: int, image_size: int, num_classes: int, seed: int, quality: int) -> str:
    return f"shapes-v{GENERATOR_VERSION}-c{num_classes}-{image_size}px-{n_train}x{n_val}-q{quality}-seed{seed}"


def _manifest_rows(manifest: Any) -> tuple[list[dict[str, Any]], str]:
    """The manifest's file rows, or ``([], why)`` when it is not shaped as written."""
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), list):
        return [], "it is not an object with a 'files' list"
    for i, row in enumerate(manifest["files"]):
        types = {"path": str, "size": int, "sha256": str, "crc32": int}
        if not isinstance(row, dict) or not all(
            isinstance(row.get(k, 0 if k == "crc32" else None), t) for k, t in types.items()
        ):
            return [], f"files[{i}] lacks a path, size or sha256 of the right type"
        parts = Path(row["path"]).parts
        if Path(row["path"]).is_absolute() or ".." in parts or not parts or parts[0] not in _SPLIT_CODE:
            return [], f"files[{i}] has the path {row['path']!r}, outside train/ and val/"
    return manifest["files"], ""


def verify_dataset(
    root: str | os.PathLike[str], level: str = "quick", params: dict[str, Any] | None = None
) -> list[str]:
    """Problems of a generated data set against its manifest, one line each (empty: intact). ``"quick"``: each
    file's size and CRC-32 (~2 s for 12,000 files), no extra files; ``"full"``: SHA-256; ``"none"``: the manifest's
    shape only. ``params``, if given, must equal the manifest's."""
    check_choice("level", level, ("quick", "full", "none"))
    mpath = Path(root) / MANIFEST
    try:
        if not mpath.is_file():
            return [f"no {MANIFEST} in {root} (generation was interrupted or this is not a generated data set)"]
        manifest = json.loads(mpath.read_text())
    except (OSError, ValueError) as exc:
        return [f"{mpath} is unreadable: {exc}"]
    files, why = _manifest_rows(manifest)
    if why:
        return [f"{mpath} is not a data-set manifest: {why}"]
    problems: list[str] = []
    if params is not None and manifest.get("params") != params:
        problems.append(f"manifest parameters {manifest.get('params')} differ from the requested {params}")
    if level == "none":
        return problems
    listed = {row["path"] for row in files}
    found: list[tuple[Path, dict[str, Any] | None]] = [(Path(root) / row["path"], row) for row in files]
    for split in ("train", "val"):
        folder = Path(root) / split
        if not folder.is_dir():
            problems.append(f"{folder} is not a folder")
            continue
        found += [
            (p, None) for p in sorted(folder.rglob("*")) if p.is_file() and p.relative_to(root).as_posix() not in listed
        ]
    for path, row in found:
        try:
            content = path.read_bytes() if row is not None else b""
        except FileNotFoundError:
            problems.append(f"missing file {path}")
        except OSError as exc:  # e.g. a class folder replaced by a file (NotADirectoryError), unreadable
            problems.append(f"cannot read {path}: {exc.strerror or type(exc).__name__}")
        else:
            if row is None:
                problems.append(f"unexpected file {path}")
            elif len(content) != row["size"]:
                problems.append(f"{path} has {len(content)} bytes, the manifest says {row['size']}")
            elif level == "quick" and "crc32" in row and zlib.crc32(content) != row["crc32"]:
                problems.append(f"{path} content differs from the manifest (CRC-32 mismatch)")
            elif (level == "full" or "crc32" not in row) and hashlib.sha256(content).hexdigest() != row["sha256"]:
                problems.append(f"{path} content differs from the manifest (SHA-256 mismatch)")
        if len(problems) > 20:
            return problems + ["... (more problems not listed)"]
    return problems


@contextlib.contextmanager
def _file_lock(path: Path, wait: bool = True) -> Iterator[None]:
    """Exclusive lock on ``path`` between processes (no-op without fcntl); OSError for a read-only folder, or
    (``wait=False``) when another process holds it."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows: the atomic rename still protects the cache
        yield
        return
    with open(path, "a+") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        yield


def _unwritable(folder: Path, exc: OSError, what: str) -> PermissionError:
    return PermissionError(
        f"{what}: the cache folder {folder} is not writable ({exc.strerror or type(exc).__name__}). Point the "
        f"cache at a writable folder with the environment variable {CACHE_ENV} (for example "
        f"`export {CACHE_ENV}=$HOME/workbook-cache` before starting Jupyter), or pass "
        f"root=<a writable folder> to make_shapes_dataset()."
    )


def _remove_stale_temporaries(parent: Path, held: str) -> None:
    """Remove the temporary folders of generations killed outright: ``held``'s (its lock is ours), another's when
    its lock is free."""
    with contextlib.suppress(OSError):
        for tmp in [p for p in parent.iterdir() if p.name.startswith(".") and ".tmp-" in p.name]:
            name = tmp.name[1:].split(".tmp-", 1)[0]
            if name == held:
                shutil.rmtree(tmp, ignore_errors=True)
            elif os.name == "posix":  # without fcntl (Windows) other data sets' temporaries are left alone
                with contextlib.suppress(OSError), _file_lock(parent / f".{name}.lock", wait=False):
                    shutil.rmtree(tmp, ignore_errors=True)  # OSError above: that generation runs now


def _cache_parent(root: str | os.PathLike[str] | None) -> Path:
    if root is not None and (not isinstance(root, (str, os.PathLike)) or str(root).strip() == ""):
        raise ValueError(
            f"root must be a folder path (a str or pathlib.Path), got {root!r}; leave it out to use the "
            f"cache folder ({CACHE_ENV})"
        )
    env = os.environ.get(CACHE_ENV)
    what = f"root={str(root)!r}" if root is not None else f"{CACHE_ENV}={env!r}" if env else "the cache folder"
    parent = Path(root if root is not None else env or ".").expanduser()
    try:
        if root is None:
            return cache_dir()
        parent.mkdir(parents=True, exist_ok=True)
        return parent
    except OSError as exc:
        if exc.errno in _UNWRITABLE:
            raise _unwritable(parent, exc, "cannot create the data set folder") from None
        why = "it is a file, not a folder" if exc.errno == errno.EEXIST else exc.strerror or exc
        raise ValueError(
            f"{what} cannot be used as the data-set folder ({why}): pass root=<another folder>, "
            f"or point {CACHE_ENV} at a writable folder (for example `export {CACHE_ENV}=$HOME/workbook-cache`)"
        ) from None


def _write_all(tmp: Path, params: dict[str, Any], workers: int, progress: Callable[..., None] | None) -> list[Any]:
    """Every image written into ``tmp`` in chunks (a bar without ``progress``: seconds to minutes); the rows."""
    total, size = params["n_train"] + params["n_val"], params["image_size"]
    chunk = max(16, min(256, math.ceil(total / (8 * workers))))
    jobs = [
        (str(tmp), split, start, min(start + chunk, n), params["num_classes"], size, params["seed"], params["quality"])
        for split, n in (("train", params["n_train"]), ("val", params["n_val"]))
        for start in range(0, n, chunk)
    ]
    pool = workers > 1 and len(jobs) > 1
    processes = f"{workers} process{'es' if workers > 1 else ''}"
    rows: list[dict[str, Any]] = []
    executor = ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) if pool else None
    bar: Any = progress_bar(f"generating {total} JPEG files (once; reused after)") if progress is None else None
    with executor or contextlib.nullcontext(), bar or contextlib.nullcontext(progress) as report:
        report(
            0.0, f"drawing and encoding {total} JPEGs of {size}x{size} px" + f" (starting {workers} processes)" * pool
        )
        for part in (executor.map if executor else map)(_write_chunk, jobs):
            rows.extend(part)
            done = f"{len(rows)} of {total} written ({processes})"
            report(len(rows) / total, f"drawing and encoding {size}x{size} JPEGs: {done}")
    return rows


def _generate(final: Path, params: dict[str, Any], workers: int, progress: Callable[..., None] | None) -> None:
    """Refused if it can't fit (0.45 byte/pixel at q90 measured, 0.8 assumed, twice); written into a temporary sibling,
    the manifest last (it marks a complete set), then renamed into place; nothing kept on failure."""
    n_images, size = params["n_train"] + params["n_val"], params["image_size"]
    need, free = 2 * (int(n_images * size * size * 0.8) + 64 * 1024), shutil.disk_usage(final.parent).free
    if need > free:
        raise ValueError(
            f"n_train/n_val/image_size: {n_images} images of {size}x{size} px need about {human_bytes(need)} on "
            f"disk, but {final.parent} has {human_bytes(free)} free. Use fewer or smaller images, or point "
            f"{CACHE_ENV} at a folder with more space."
        )
    tmp = final.parent / f".{final.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        for split in ("train", "val"):
            for name in params["classes"]:
                (tmp / split / name).mkdir(parents=True, exist_ok=True)
        rows = _write_all(tmp, params, workers, progress)
        manifest = {"params": params, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "files": rows}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=0))
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise OSError(
                exc.errno,
                f"the disk holding {final.parent} is full ({exc.strerror}): the data set {final.name} could not "
                f"be written (nothing was kept). Free some space, or point {CACHE_ENV} at a folder on a disk with "
                f"more space.",
            ) from None
        if exc.errno in _UNWRITABLE:
            raise _unwritable(final.parent, exc, "cannot write the data set") from None
        raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _reuse_or_generate(final: Path, check: Callable[[], list[str]], generate: Callable[[], None], raise_: bool) -> bool:
    """Reuse a verified copy (a read-only one too) or (re)generate it under the data set's lock; True: generated."""
    with contextlib.ExitStack() as stack:
        refused = None
        try:
            stack.enter_context(_file_lock(final.parent / f".{final.name}.lock"))
            _remove_stale_temporaries(final.parent, final.name)
        except OSError as exc:  # a read-only folder, or one that takes no new files (ENOENT: /proc)
            if exc.errno not in _UNWRITABLE + (errno.ENOENT,):
                raise
            refused = exc
        problems = check() if (final / MANIFEST).is_file() else None
        if problems == []:
            return False
        if refused is not None:
            what = f"cannot generate the data set {final.name}"
            if problems:
                what = f"the cached data set in {final} is damaged ({problems[0]}) and cannot be regenerated in place"
            raise _unwritable(final.parent, refused, what) from None
        if problems:
            what = f"cached data set in {final} is damaged ({len(problems)} problem(s), first: {problems[0]})"
            if raise_:
                raise RuntimeError(
                    f"the {what}; delete the folder or call make_shapes_dataset(on_corrupt='regenerate')"
                )
            warnings.warn(f"{what}; regenerating it", RuntimeWarning, stacklevel=3)
        generate()
        return True


def make_shapes_dataset(
    *,
    n_train: int | None = None,
    n_val: int | None = None,
    image_size: int | None = None,
    num_classes: int = 6,
    seed: int = 0,
    quality: int = 90,
    root: str | os.PathLike[str] | None = None,
    verify: str = "quick",
    on_corrupt: str = "regenerate",
    workers: int | None = None,
    progress: Callable[..., None] | None = None,
) -> DatasetInfo:
    """The shapes data set generated, or a verified cached copy: ``<root>/<dataset_name(...)>/`` holding
    ``train/<class>/NNNNN.jpg``, ``val/...`` and ``manifest.json`` (sizes, checksums); same parameters, same bytes.
    ``None`` sizes: :func:`default_sizes`; ``root``: the cache folder; ``workers``: 1 for small sets (a pool costs
    seconds to start), else up to 8. Errors are one line each (ValueError, OSError for a full disk,
    PermissionError for a read-only cache naming ``WORKBOOK_CACHE``, RuntimeError with ``on_corrupt="raise"``).
    """
    check_choice("verify", verify, ("quick", "full", "none"))
    check_choice("on_corrupt", on_corrupt, ("regenerate", "raise"))
    given, sizes = {"n_train": n_train, "n_val": n_val, "image_size": image_size}, default_sizes()
    n_train, n_val, size = (sizes[k] if v is None else v for k, v in given.items())
    params: dict[str, Any] = {
        "generator_version": GENERATOR_VERSION,
        "n_train": check_int("n_train", n_train, 1, 1_000_000),
        "n_val": check_int("n_val", n_val, 1, 1_000_000),
        "image_size": check_int("image_size", size, 16, 1024),
        "num_classes": check_int("num_classes", num_classes, 2, len(SHAPE_CLASSES)),
        "classes": list(SHAPE_CLASSES[:num_classes]),
        "seed": check_int("seed", seed, 0, 2**31 - 1),
        "quality": check_int("quality", quality, 50, 100),
    }
    n_train, n_val, size = params["n_train"], params["n_val"], params["image_size"]  # as ints
    n_images = n_train + n_val
    if workers is None:
        workers = 1 if n_images * size * size < _POOL_MIN_PIXELS else min(8, os.cpu_count() or 1)
    workers = check_int("workers", workers, 1, 256)
    report = progress or (lambda fraction, text="": None)
    names = ("n_train", "n_val", "image_size", "num_classes", "seed", "quality")
    final = _cache_parent(root) / dataset_name(*(params[k] for k in names))

    def check() -> list[str]:
        report(0.0, f"verifying the cached data set ({n_images} files)")
        return verify_dataset(final, verify, params)

    t0 = time.perf_counter()
    generated = _reuse_or_generate(
        final, check, lambda: _generate(final, params, workers, progress), on_corrupt == "raise"
    )
    total = sum(int(r["size"]) for r in json.loads((final / MANIFEST).read_text())["files"])
    report(1.0, ("generated " if generated else "reused ") + f"{n_train} + {n_val} images")
    counts = (sorted(params["classes"]), n_train, n_val, size, total)  # in label order, as loaders number them
    return DatasetInfo(final, final / "train", final / "val", *counts, generated, time.perf_counter() - t0, params)
