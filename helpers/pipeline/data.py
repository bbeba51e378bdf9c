"""The workbook's data set: real JPEG files on disk, and a Dataset that decodes them.

Nothing can be downloaded, so the workbook draws its own images: coloured shapes
and textures on noisy, shaded backgrounds, saved as JPEG files in class folders
that :class:`torchvision.datasets.ImageFolder` can read. Decoding and augmenting
them costs what it costs for real photos of the same size, and a small CNN can
learn the classes in a few epochs, so accuracy visibly rises above chance.

Public API (stable; later chapters rely on it):

``make_shapes_dataset(..., progress=None) -> DatasetInfo``
    Generate the data set once into ``<cache_dir()>/<name>/{train,val}/<class>/*.jpg``
    (deterministic from ``seed``), or reuse and verify a cached copy (also from a
    read-only cache folder). ``progress(fraction, text)`` follows the generation.
``default_sizes() -> dict``
    Image counts and resolution for the size tier in force (quick, laptop or full).
``verify_dataset(root, level="quick") -> list[str]``
    Integrity problems of a generated folder (empty list: intact).
``ShapesDataset(root, crop_size=..., augment=True, output="float", on_error="raise")``
    Decode (Pillow) and augment (torchvision.transforms.v2) one image per
    item; returns ``(image, label)``. ``output="uint8"`` returns uint8 tensors for
    the bytes-on-the-wire lesson. Picklable: works with any worker start method.
``to_float_normalized(batch_uint8) -> float tensor``
    Convert and normalise a uint8 batch where it lies (e.g. on the GPU).
``TimedCollate`` / ``seed_worker``
    A collate function that remembers when it ran, and a worker_init_fn.
    (The loader built from them is :func:`helpers.pipeline.loaders.timed_loader`.)

Random augmentation draws from torch's global generator, which the DataLoader
seeds differently in every worker (base seed + worker id), so workers never
repeat each other's crops, whatever the start method. No generator is created
in ``__init__`` (that is the classic bug chapter 04 demonstrates).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import json
import math
import operator
import os
import shutil
import time
import uuid
import warnings
import zlib
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import torch
from torch.utils.data import Dataset, default_collate

from ..core.config import CACHE_ENV, cache_dir, sized
from ..core.progress import progress_bar
from ..core.validate import check_choice, check_int, human_bytes

__all__ = [
    "SHAPE_CLASSES",
    "MEAN",
    "STD",
    "GENERATOR_VERSION",
    "DatasetInfo",
    "ImageDecodeError",
    "default_sizes",
    "dataset_name",
    "make_shapes_dataset",
    "verify_dataset",
    "render_image",
    "ShapesDataset",
    "to_float_normalized",
    "normalization_stats",
    "TimedCollate",
    "seed_worker",
]

#: Class names, in label order. ``num_classes=k`` uses the first ``k``.
SHAPE_CLASSES: tuple[str, ...] = (
    "disc",
    "ring",
    "square",
    "stripes",
    "dots",
    "checker",
    "triangle",
    "cross",
)

#: Per-channel mean and standard deviation used to normalise images (0-1 scale).
MEAN: tuple[float, float, float] = (0.5, 0.5, 0.5)
STD: tuple[float, float, float] = (0.25, 0.25, 0.25)

#: Bump when the drawing code changes, so cached copies are regenerated.
GENERATOR_VERSION = 2

MANIFEST = "manifest.json"
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png")
_SPLIT_CODE = {"train": 0, "val": 1}


# ---------------------------------------------------------------------------
# Sizes
# ---------------------------------------------------------------------------


def default_sizes(tier: str | None = None) -> dict[str, int]:
    """Problem sizes for the size tier in force (:func:`helpers.core.config.size_tier`), or for ``tier``
    (``"quick"``, ``"laptop"`` or ``"full"``: what another tier would use, e.g. for an estimate).

    Quick mode (``WORKBOOK_QUICK=1``): 640 training and 256 validation images of
    80x80 pixels, cropped to 64 (about 4 KiB per file, 3.7 MiB in all; generated
    in a few seconds on 2 cores). Laptop tier (no CUDA GPU, the default there):
    1,600 training and 400 validation images of 112x112 pixels, cropped to 96
    (about 2 ms per image to generate; chapter 01's model computes about
    0.05 GFLOP per image forward, so an epoch takes tens of seconds on 2 cores).
    Full (a CUDA GPU, or ``WORKBOOK_FULL=1``):
    9,600 training and 2,400 validation images of 256x256 pixels, cropped to 224
    (about 30 KiB per file, decoding cost like a small photo; about 7 ms per
    image to generate, spread over the cores).

    Each size set is its own cached data set (the folder name encodes the sizes,
    see :func:`dataset_name`), so switching tiers never mixes files.

    Returns:
        ``{"n_train", "n_val", "image_size", "crop_size", "num_classes", "batch_size"}``.
    """
    if tier is None:
        pick: Callable[..., int] = sized
    else:
        check_choice("tier", tier, ("quick", "laptop", "full"))

        def pick(quick: int, full: int, laptop: int) -> int:
            return {"quick": quick, "full": full, "laptop": laptop}[tier]

    return {
        "n_train": pick(quick=640, full=9600, laptop=1600),
        "n_val": pick(quick=256, full=2400, laptop=400),
        "image_size": pick(quick=80, full=256, laptop=112),
        "crop_size": pick(quick=64, full=224, laptop=96),
        "num_classes": 6,
        "batch_size": pick(quick=32, full=64, laptop=32),
    }


# ---------------------------------------------------------------------------
# Drawing
# ---------------------------------------------------------------------------


def _regular_polygon(n: int, cx: float, cy: float, r: float, angle: float) -> list[tuple[float, float]]:
    return [
        (cx + r * math.cos(angle + 2 * math.pi * k / n), cy + r * math.sin(angle + 2 * math.pi * k / n))
        for k in range(n)
    ]


def _star(cx: float, cy: float, r: float, angle: float, points: int = 5) -> list[tuple[float, float]]:
    out = []
    for k in range(2 * points):
        rr = r if k % 2 == 0 else r * 0.42
        a = angle + math.pi * k / points
        out.append((cx + rr * math.cos(a), cy + rr * math.sin(a)))
    return out


def _cross(cx: float, cy: float, r: float, angle: float) -> list[tuple[float, float]]:
    t = r * 0.36  # half arm thickness
    pts = [(t, r), (t, t), (r, t), (r, -t), (t, -t), (t, -r), (-t, -r), (-t, -t), (-r, -t), (-r, t), (-t, t), (-t, r)]
    c, s = math.cos(angle), math.sin(angle)
    return [(cx + x * c - y * s, cy + x * s + y * c) for x, y in pts]


def _colour_pair(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """A background and a foreground colour with a clear luminance difference."""
    weights = np.array([0.299, 0.587, 0.114])
    while True:
        bg = rng.integers(0, 256, size=3)
        fg = rng.integers(0, 256, size=3)
        if abs(float(weights @ bg) - float(weights @ fg)) >= 70:
            return bg.astype(np.float32), fg.astype(np.float32)


def render_image(label: int, size: int, rng: np.random.Generator) -> np.ndarray:
    """Draw one image of class ``label`` as an ``(size, size, 3)`` uint8 array.

    Shapes (disc, ring, square, triangle, cross, star) vary in position, size,
    rotation and colour; the textures (stripes, dots, checker) vary in period,
    angle and colour. Every image
    gets a shaded background, a few thin distractor lines and Gaussian noise.
    """
    from PIL import Image, ImageDraw

    name = SHAPE_CLASSES[label]
    bg, fg = _colour_pair(rng)
    # Shaded background: base colour plus a random linear gradient.
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float32) / max(size - 1, 1)
    gdir = rng.uniform(-1, 1, size=2)
    grad = (gdir[0] * (xx - 0.5) + gdir[1] * (yy - 0.5))[..., None] * rng.uniform(20, 60)
    base = np.clip(bg[None, None, :] + grad, 0, 255).astype(np.uint8)
    img = Image.fromarray(base, "RGB")
    draw = ImageDraw.Draw(img)
    fg_t = tuple(int(v) for v in fg)

    # Distractor lines in a colour between background and foreground.
    mid = tuple(int(v) for v in (0.6 * bg + 0.4 * fg))
    for _ in range(int(rng.integers(1, 4))):
        x0, y0, x1, y1 = (float(v) for v in rng.uniform(0, size, size=4))
        draw.line([(x0, y0), (x1, y1)], fill=mid, width=max(1, size // 64))

    r = float(rng.uniform(0.22, 0.38)) * size
    cx = float(rng.uniform(r, size - r))
    cy = float(rng.uniform(r, size - r))
    angle = float(rng.uniform(0, 2 * math.pi))
    if name == "disc":
        draw.ellipse([cx - r, cy - r, cx + r, cy + r], fill=fg_t)
    elif name == "square":
        draw.polygon(_regular_polygon(4, cx, cy, r * 1.1, angle), fill=fg_t)
    elif name == "triangle":
        draw.polygon(_regular_polygon(3, cx, cy, r * 1.2, angle), fill=fg_t)
    elif name == "cross":
        draw.polygon(_cross(cx, cy, r * 1.1, angle), fill=fg_t)
    elif name == "ring":
        draw.ellipse([cx - r, cy - r, cx + r, cy + r], outline=fg_t, width=max(2, int(r * 0.3)))
    elif name == "star":
        draw.polygon(_star(cx, cy, r * 1.25, angle), fill=fg_t)
    elif name == "checker":
        cell = float(rng.uniform(0.12, 0.2)) * size
        c, s_ = math.cos(angle), math.sin(angle)
        cells = int(size * 1.5 / cell) + 2
        for i in range(-cells, cells):
            for j in range(-cells, cells):
                if (i + j) % 2:
                    continue
                corners = [(i, j), (i + 1, j), (i + 1, j + 1), (i, j + 1)]
                pts = [(size / 2 + cell * (a * c - b * s_), size / 2 + cell * (a * s_ + b * c)) for a, b in corners]
                if all(-cell <= px <= size + cell and -cell <= py <= size + cell for px, py in pts):
                    draw.polygon(pts, fill=fg_t)
    elif name == "stripes":
        period = float(rng.uniform(0.12, 0.22)) * size
        width = max(1, int(period * 0.45))
        c, s = math.cos(angle), math.sin(angle)
        span = size * 1.5
        k = -span
        while k <= span:
            px, py = size / 2 + k * c, size / 2 + k * s
            draw.line([(px - span * s, py + span * c), (px + span * s, py - span * c)], fill=fg_t, width=width)
            k += period
    elif name == "dots":
        period = float(rng.uniform(0.14, 0.24)) * size
        rad = period * 0.25
        off = rng.uniform(0, period, size=2)
        y = off[1] - period
        while y < size + period:
            x = off[0] - period
            while x < size + period:
                draw.ellipse([x - rad, y - rad, x + rad, y + rad], fill=fg_t)
                x += period
            y += period
    else:  # pragma: no cover - guarded by num_classes checks
        raise ValueError(f"unknown class {name!r}")

    arr = np.asarray(img, dtype=np.float32)
    arr += rng.normal(0.0, float(rng.uniform(6, 18)), size=arr.shape).astype(np.float32)
    return np.clip(arr, 0, 255).astype(np.uint8)


def _encode_jpeg(arr: np.ndarray, quality: int) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(arr, "RGB").save(buf, format="JPEG", quality=quality)
    return buf.getvalue()


def _file_rel(split: str, label: int, index: int) -> str:
    return f"{split}/{SHAPE_CLASSES[label]}/{index:05d}.jpg"


def _write_chunk(args: tuple[str, str, int, int, int, int, int, int]) -> list[dict[str, Any]]:
    """Render and write images ``[start, stop)`` of one split; return manifest rows.

    Module-level so a process pool (any start method) can run it.
    """
    folder, split, start, stop, num_classes, image_size, seed, quality = args
    rows = []
    for index in range(start, stop):
        label = index % num_classes
        rng = np.random.default_rng(np.random.SeedSequence([seed, _SPLIT_CODE[split], index]))
        data = _encode_jpeg(render_image(label, image_size, rng), quality)
        rel = _file_rel(split, label, index)
        (Path(folder) / rel).write_bytes(data)
        rows.append(
            {
                "path": rel,
                "label": label,
                "size": len(data),
                "crc32": zlib.crc32(data),
                "sha256": hashlib.sha256(data).hexdigest(),
            }
        )
    return rows


# ---------------------------------------------------------------------------
# Generation, cache and integrity
# ---------------------------------------------------------------------------


@dataclass
class DatasetInfo:
    """Where a generated data set lives and what it holds.

    Attributes:
        root: the data set's folder (holds ``train/``, ``val/`` and ``manifest.json``).
        train_dir / val_dir: class-folder roots for :class:`ShapesDataset` or ImageFolder.
        classes: class names in label order.
        n_train / n_val: image counts.
        image_size: stored resolution (pixels, square).
        total_bytes: bytes of all JPEG files.
        generated: True if this call generated the files, False if it reused a cached copy.
        seconds: time this call spent (generating or verifying).
        params: the generation parameters recorded in the manifest.
    """

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

    @property
    def mean_file_bytes(self) -> float:
        """Average JPEG file size in bytes."""
        n = self.n_train + self.n_val
        return self.total_bytes / n if n else 0.0

    def __str__(self) -> str:
        how = "generated" if self.generated else "reused (verified)"
        return (
            f"{self.n_train} train + {self.n_val} val JPEGs, {self.image_size}x{self.image_size} px, "
            f"{len(self.classes)} classes, {self.total_bytes / 2**20:.1f} MiB "
            f"(mean {self.mean_file_bytes / 1024:.1f} KiB/file), {how},\n  in {self.root}"
        )


def dataset_name(n_train: int, n_val: int, image_size: int, num_classes: int, seed: int, quality: int) -> str:
    """Folder name that encodes the generation parameters (so sizes never collide)."""
    return f"shapes-v{GENERATOR_VERSION}-c{num_classes}-{image_size}px-{n_train}x{n_val}-q{quality}-seed{seed}"


def _params(n_train: int, n_val: int, image_size: int, num_classes: int, seed: int, quality: int) -> dict[str, Any]:
    return {
        "generator_version": GENERATOR_VERSION,
        "n_train": n_train,
        "n_val": n_val,
        "image_size": image_size,
        "num_classes": num_classes,
        "classes": list(SHAPE_CLASSES[:num_classes]),
        "seed": seed,
        "quality": quality,
    }


def _manifest_rows(manifest: Any) -> tuple[list[dict[str, Any]], str]:
    """The manifest's file rows, or ``([], why)`` when it is not shaped as :func:`_generate` writes it."""
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), list):
        return [], "it is not an object with a 'files' list"
    rows = manifest["files"]
    for i, row in enumerate(rows):
        if not (
            isinstance(row, dict)
            and isinstance(row.get("path"), str)
            and isinstance(row.get("size"), int)
            and isinstance(row.get("sha256"), str)
            and isinstance(row.get("crc32", 0), int)
        ):
            return [], f"files[{i}] lacks a path, size or sha256 of the right type"
        parts = Path(row["path"]).parts
        if Path(row["path"]).is_absolute() or ".." in parts or not parts or parts[0] not in _SPLIT_CODE:
            return [], f"files[{i}] has the path {row['path']!r}, outside train/ and val/"
    return rows, ""


def verify_dataset(
    root: str | os.PathLike[str], level: str = "quick", params: dict[str, Any] | None = None
) -> list[str]:
    """Check a generated data set against its manifest.

    Args:
        root: the data set folder (holding ``manifest.json``).
        level: ``"quick"`` (default) checks that every listed file exists with the
            recorded size and CRC-32 checksum (recorded at generation; a manifest
            written before checksums were recorded is checked with SHA-256), and
            that no extra images are present: a same-size change of content is
            caught. Measured on a busy 2-core machine: 0.07 s for the quick-tier data
            set (896 files) and about 2 s for the full tier (12,000 files, 0.35 GB). ``"full"`` checks
            every file's SHA-256 instead (a few times slower).
        params: if given, the manifest's parameters must equal these.

    Returns:
        A list of problems, one line each, empty when the data set is intact.
    """
    check_choice("level", level, ("quick", "full"))
    root = Path(root)
    mpath = root / MANIFEST
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
    listed = set()
    for row in files:
        path = root / row["path"]
        listed.add(row["path"])
        try:
            content = path.read_bytes()  # one read per file: its length, then its checksum
            if len(content) != row["size"]:
                problems.append(f"{path} has {len(content)} bytes, the manifest says {row['size']}")
            elif level == "quick" and "crc32" in row:
                if zlib.crc32(content) != row["crc32"]:
                    problems.append(f"{path} content differs from the manifest (CRC-32 mismatch)")
            elif hashlib.sha256(content).hexdigest() != row["sha256"]:
                problems.append(f"{path} content differs from the manifest (SHA-256 mismatch)")
        except FileNotFoundError:
            problems.append(f"missing file {path}")
        except OSError as exc:  # e.g. a class folder replaced by a file (NotADirectoryError), unreadable
            problems.append(f"cannot read {path}: {exc.strerror or type(exc).__name__}")
        if len(problems) > 20:
            problems.append("... (more problems not listed)")
            return problems
    for split in ("train", "val"):
        folder = root / split
        if not folder.is_dir():
            problems.append(f"{folder} is not a folder")
            continue
        for p in sorted(folder.rglob("*")):
            if p.is_file() and p.relative_to(root).as_posix() not in listed:
                problems.append(f"unexpected file {p}")
                if len(problems) > 20:
                    return problems
    return problems


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """Exclusive lock on ``path`` between processes (no-op where fcntl is missing).

    Raises:
        OSError: the lock file cannot be opened (e.g. a read-only folder); the
            caller decides what that means (see :func:`make_shapes_dataset`).
    """
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows: the atomic rename still protects the cache
        yield
        return
    with open(path, "a+") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


#: errno values that mean "this folder cannot be written here" (not a bug, a setup).
_UNWRITABLE = (errno.EACCES, errno.EPERM, errno.EROFS)


def _not_writable_message(folder: Path, exc: OSError, what: str) -> str:
    reason = exc.strerror or type(exc).__name__
    return (
        f"{what}: the cache folder {folder} is not writable ({reason}). Point the cache at a "
        f"writable folder with the environment variable {CACHE_ENV} (for example "
        f"`export {CACHE_ENV}=$HOME/workbook-cache` before starting Jupyter), or pass "
        f"root=<a writable folder> to make_shapes_dataset()."
    )


def _estimated_bytes(n_images: int, image_size: int) -> int:
    """A generous estimate of the JPEG bytes of ``n_images`` (measured: about 0.45 byte per pixel at q90)."""
    return int(n_images * image_size * image_size * 0.8) + 64 * 1024


def _check_disk(parent: Path, n_images: int, image_size: int) -> None:
    """Refuse a generation that cannot fit on the disk holding ``parent`` (with a fix)."""
    need = 2 * _estimated_bytes(n_images, image_size)  # a temporary copy exists while regenerating
    try:
        free = shutil.disk_usage(parent).free
    except OSError:  # pragma: no cover - unknown: let the write itself fail
        return
    if need > free:
        raise ValueError(
            f"n_train/n_val/image_size: {n_images} images of {image_size}x{image_size} px need about "
            f"{human_bytes(need)} on disk, but {parent} has {human_bytes(free)} free. Use fewer or "
            f"smaller images, or point {CACHE_ENV} at a folder with more space."
        )


def _remove_stale_temporaries(parent: Path, held: str) -> list[Path]:
    """Remove temporary generation folders that no running generation owns; returns those removed.

    A generation killed outright (SIGKILL, power loss) leaves ``.<name>.tmp-<pid>-<id>``.
    The caller holds the lock of data set ``held``, so every temporary of that name is stale;
    one of another name is stale when its own lock can be taken at once (no generation holds it).
    """
    removed: list[Path] = []
    try:
        candidates = [p for p in parent.iterdir() if p.name.startswith(".") and ".tmp-" in p.name]
    except OSError:
        return removed
    for tmp in candidates:
        name = tmp.name[1:].split(".tmp-", 1)[0]
        if name != held:
            try:
                import fcntl
            except ImportError:  # pragma: no cover - Windows: leave other data sets' temporaries alone
                continue
            try:
                with open(parent / f".{name}.lock", "a+") as fh:
                    try:
                        fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                    except OSError:
                        continue  # a generation of that data set is running now
                    try:
                        shutil.rmtree(tmp, ignore_errors=True)
                    finally:
                        fcntl.flock(fh.fileno(), fcntl.LOCK_UN)
            except OSError:
                continue
        else:
            shutil.rmtree(tmp, ignore_errors=True)
        if not tmp.exists():
            removed.append(tmp)
    return removed


def _cache_parent(root: str | os.PathLike[str] | None) -> Path:
    """The folder the data set goes in: ``root`` or the cache folder, checked (one-line errors)."""
    if root is not None:
        if not isinstance(root, (str, os.PathLike)) or str(root).strip() == "":
            raise ValueError(
                f"root must be a folder path (a str or pathlib.Path), got {root!r}; leave it out to use the "
                f"cache folder ({CACHE_ENV})"
            )
        parent = Path(root).expanduser()
        what = f"root={str(root)!r}"
    else:
        what = f"{CACHE_ENV}={os.environ.get(CACHE_ENV, '')!r}" if os.environ.get(CACHE_ENV) else "the cache folder"
        try:
            return cache_dir()
        except OSError as exc:
            raw = Path(os.environ.get(CACHE_ENV) or ".").expanduser()
            if exc.errno in _UNWRITABLE:
                raise PermissionError(_not_writable_message(raw, exc, "cannot create the data set folder")) from None
            raise ValueError(
                f"{what} cannot be used as the data-set cache folder ({exc.strerror or exc}): point {CACHE_ENV} at "
                f"a writable folder (for example `export {CACHE_ENV}=$HOME/workbook-cache`)"
            ) from None
    if parent.exists() and not parent.is_dir():
        raise ValueError(f"{what} is a file, not a folder; pass a folder for the data set")
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        if exc.errno in _UNWRITABLE:
            raise PermissionError(_not_writable_message(parent, exc, "cannot create the data set folder")) from None
        raise ValueError(f"{what} cannot be created as a folder ({exc.strerror or exc}); pass another folder") from None
    return parent


def _chunk_size(n_images: int, workers: int) -> int:
    """Images per job: small enough for a progress bar to move, large enough to amortise the calls."""
    return max(16, min(256, math.ceil(n_images / (8 * workers))))


def _generate(final: Path, params: dict[str, Any], workers: int, progress: Callable[..., None] | None = None) -> None:
    """Write the data set into a temporary sibling folder, then rename it into place."""
    report = progress or _no_progress
    tmp = final.parent / f".{final.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        for split in ("train", "val"):
            for name in params["classes"]:
                (tmp / split / name).mkdir(parents=True, exist_ok=True)
        jobs = []
        total = params["n_train"] + params["n_val"]
        chunk = _chunk_size(total, workers)
        for split, n in (("train", params["n_train"]), ("val", params["n_val"])):
            for start in range(0, n, chunk):
                jobs.append(
                    (
                        str(tmp),
                        split,
                        start,
                        min(start + chunk, n),
                        params["num_classes"],
                        params["image_size"],
                        params["seed"],
                        params["quality"],
                    )
                )
        rows: list[dict[str, Any]] = []
        size = params["image_size"]

        def done(part: list[dict[str, Any]]) -> None:
            rows.extend(part)
            report(
                len(rows) / total,
                f"drawing and encoding {size}x{size} JPEGs: {len(rows)} of {total} "
                f"written ({workers} process{'es' if workers > 1 else ''})",
            )

        report(
            0.0,
            f"drawing and encoding {total} JPEGs of {size}x{size} px"
            + (f" (starting {workers} processes)" if workers > 1 and len(jobs) > 1 else ""),
        )
        if workers > 1 and len(jobs) > 1:
            import multiprocessing as mp

            with ProcessPoolExecutor(max_workers=workers, mp_context=mp.get_context("spawn")) as pool:
                for part in pool.map(_write_chunk, jobs):
                    done(part)
        else:
            for job in jobs:
                done(_write_chunk(job))
        manifest = {
            "params": params,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "files": rows,
        }
        # The manifest is written last: its presence marks a complete data set.
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
            raise PermissionError(_not_writable_message(final.parent, exc, "cannot write the data set")) from None
        raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _no_progress(fraction: float, text: str = "") -> None:
    return None


#: Work (pixels drawn) below which one process generates faster than a pool that must start first.
_POOL_MIN_PIXELS = 100_000_000


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
    """Generate the shapes data set, or reuse a verified cached copy.

    The same parameters always give byte-identical files. The data set lives in
    ``<root>/<dataset_name(...)>/`` with ``train/<class>/NNNNN.jpg``,
    ``val/<class>/NNNNN.jpg`` and a ``manifest.json`` (parameters, and size and
    SHA-256 of every file) written last. Generation happens in a temporary folder
    renamed into place, under a file lock, so two processes asking at once never
    see a half-written data set.

    A verified copy in a read-only cache folder is reused without the lock (a
    read-only copy cannot change under us); when there is none, or it is damaged,
    the error says which variable (``WORKBOOK_CACHE``) points the cache elsewhere.

    Args:
        n_train / n_val / image_size: image counts and stored resolution; ``None``
            takes :func:`default_sizes` for the current size tier.
        num_classes: how many of :data:`SHAPE_CLASSES` to use (2-8). Labels are balanced.
        seed: generation seed.
        quality: JPEG quality (50-100).
        root: parent folder (not ``""``); default :func:`helpers.core.config.cache_dir`.
            Temporary folders left by a generation that was killed are removed here.
        verify: integrity check of a cached copy: ``"quick"`` (file count, sizes and each
            file's CRC-32: a changed byte is caught; about 2 s at full size), ``"full"``
            (SHA-256 of every file) or ``"none"`` (the manifest's shape only).
        on_corrupt: what to do when a cached copy fails the check: ``"regenerate"``
            (with a warning) or ``"raise"`` (RuntimeError listing the problems).
        workers: processes used to generate; default 1 for small data sets (a pool
            costs seconds to start), else the CPU count (capped at 8).
        progress: ``progress(fraction, text)`` (see :mod:`helpers.core.progress`), told
            how many images are written, or that a cached copy is being verified.
            ``None``: a tqdm bar is shown while files are generated (never when reused).

    Raises:
        ValueError: for out-of-range arguments, a ``root`` or ``WORKBOOK_CACHE`` that is not a
            usable folder, or a data set that cannot fit on the disk.
        OSError: the disk filled up while generating (``errno.ENOSPC``; one line, nothing kept).
        PermissionError: the cache folder is not writable and holds no usable copy
            (the message names ``WORKBOOK_CACHE``).
        RuntimeError: if the cached copy is damaged and ``on_corrupt="raise"``.
    """
    sizes = default_sizes()
    n_train = check_int("n_train", sizes["n_train"] if n_train is None else n_train, 1, 1_000_000)
    n_val = check_int("n_val", sizes["n_val"] if n_val is None else n_val, 1, 1_000_000)
    image_size = check_int("image_size", sizes["image_size"] if image_size is None else image_size, 16, 1024)
    num_classes = check_int("num_classes", num_classes, 2, len(SHAPE_CLASSES))
    seed = check_int("seed", seed, 0, 2**31 - 1)
    quality = check_int("quality", quality, 50, 100)
    check_choice("verify", verify, ("quick", "full", "none"))
    check_choice("on_corrupt", on_corrupt, ("regenerate", "raise"))
    if workers is None:
        small = (n_train + n_val) * image_size * image_size < _POOL_MIN_PIXELS
        workers = 1 if small else min(8, os.cpu_count() or 1)
    workers = check_int("workers", workers, 1, 256)
    report = progress or _no_progress

    params = _params(n_train, n_val, image_size, num_classes, seed, quality)
    parent = _cache_parent(root)
    final = parent / dataset_name(n_train, n_val, image_size, num_classes, seed, quality)

    def check_cached() -> list[str]:
        report(0.0, f"verifying the cached data set ({n_train + n_val} files)")
        if verify != "none":
            return verify_dataset(final, verify, params)
        try:
            _, why = _manifest_rows(json.loads((final / MANIFEST).read_text()))
        except (OSError, ValueError) as exc:
            why = str(exc)
        return [f"{final / MANIFEST} is not a data-set manifest: {why}"] if why else []

    def generate() -> None:
        _check_disk(parent, n_train + n_val, image_size)
        if progress is not None:
            _generate(final, params, workers, report)
            return
        # Generation takes seconds to minutes: with no progress callback given, show a bar anyway.

        with progress_bar(f"generating {n_train + n_val} JPEG files (once; reused after)") as bar:
            _generate(final, params, workers, bar)

    t0 = time.perf_counter()
    generated = False
    with contextlib.ExitStack() as stack:
        try:
            stack.enter_context(_file_lock(parent / f".{final.name}.lock"))
        except OSError as exc:
            # A lock file cannot be made here: a read-only folder, or one that takes no new files (ENOENT: /proc).
            if exc.errno not in _UNWRITABLE + (errno.ENOENT,):
                raise
            # A read-only cache: a verified copy is used as it is; nothing can be written here.
            if not (final / MANIFEST).is_file():
                raise PermissionError(
                    _not_writable_message(parent, exc, f"cannot generate the data set {final.name}")
                ) from None
            problems = check_cached()
            if problems:
                raise PermissionError(
                    _not_writable_message(
                        parent,
                        exc,
                        f"the cached data set in {final} is damaged ({problems[0]}) and cannot be regenerated in place",
                    )
                ) from None
        else:
            _remove_stale_temporaries(parent, final.name)
            if (final / MANIFEST).is_file():
                problems = check_cached()
                if problems:
                    if on_corrupt == "raise":
                        raise RuntimeError(
                            f"the cached data set in {final} is damaged ({len(problems)} problem(s), first: "
                            f"{problems[0]}); delete the folder or call make_shapes_dataset(on_corrupt='regenerate')"
                        )
                    warnings.warn(
                        f"cached data set in {final} is damaged ({len(problems)} problem(s), first: "
                        f"{problems[0]}); regenerating it",
                        RuntimeWarning,
                        stacklevel=2,
                    )
                    generate()
                    generated = True
            else:
                generate()
                generated = True
    manifest = json.loads((final / MANIFEST).read_text())
    total = sum(int(r["size"]) for r in manifest["files"])
    report(1.0, ("generated " if generated else "reused ") + f"{n_train} + {n_val} images")
    return DatasetInfo(
        root=final,
        train_dir=final / "train",
        val_dir=final / "val",
        classes=list(params["classes"]),
        n_train=n_train,
        n_val=n_val,
        image_size=image_size,
        total_bytes=total,
        generated=generated,
        seconds=time.perf_counter() - t0,
        params=params,
    )


# ---------------------------------------------------------------------------
# Dataset
# ---------------------------------------------------------------------------


class ImageDecodeError(RuntimeError):
    """An image file could not be read or decoded; the message names the file."""


def _scan_class_folders(root: Path) -> tuple[list[str], list[tuple[str, int]]]:
    if not root.exists():
        raise FileNotFoundError(
            f"data folder {root} does not exist. Generate the data set first with "
            f"helpers.pipeline.data.make_shapes_dataset() and pass its .train_dir or .val_dir."
        )
    if not root.is_dir():
        raise NotADirectoryError(f"{root} is a file; pass a folder holding one sub-folder per class")
    classes = sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    if not classes:
        raise ValueError(
            f"{root} holds no class folders. Expected the ImageFolder layout <root>/<class>/<image>.jpg; "
            f"generate it with helpers.pipeline.data.make_shapes_dataset()."
        )
    samples: list[tuple[str, int]] = []
    for idx, name in enumerate(classes):
        for p in sorted((root / name).iterdir()):
            if p.is_file() and p.suffix.lower() in IMAGE_EXTENSIONS:
                samples.append((str(p), idx))
    if not samples:
        raise ValueError(
            f"the class folders in {root} ({', '.join(classes)}) hold no image files "
            f"({', '.join(IMAGE_EXTENSIONS)}). Regenerate with helpers.pipeline.data.make_shapes_dataset()."
        )
    return classes, samples


def _is_integer(value: Any) -> bool:
    """True for ints, numpy integers and 0-d integer tensors (what samplers hand a data set)."""
    try:
        operator.index(value)
    except TypeError:
        return False
    return True


class ShapesDataset(Dataset):
    """Decode and augment the JPEG files of a class-folder tree (ImageFolder layout).

    Each item is ``(image, label)``: ``image`` is a ``(3, crop_size, crop_size)``
    tensor, float32 and normalised with :data:`MEAN`/:data:`STD` for
    ``output="float"``, or raw uint8 for ``output="uint8"`` (4x fewer bytes to
    move; normalise later with :func:`to_float_normalized`, e.g. on the GPU).

    Decoding uses Pillow (libjpeg-turbo); torchvision.io's decoders are deprecated
    since torchvision 0.29. With ``augment=True``,
    a RandomResizedCrop and a horizontal flip are applied (random numbers from
    torch's global generator, seeded per worker by the DataLoader); with
    ``augment=False``, a resize and centre crop (deterministic, for evaluation).

    Works with any DataLoader start method (fork, spawn, forkserver): the
    object holds only paths, labels and transform modules, all picklable.

    Args:
        root: folder holding one sub-folder per class (e.g. ``info.train_dir``).
        crop_size: output side length in pixels (8-1024).
        augment: random crop and flip (training) or deterministic centre crop.
        output: ``"float"`` or ``"uint8"``.
        on_error: ``"raise"`` (default): a damaged file raises
            :class:`ImageDecodeError` naming it. ``"skip"``: the item is replaced by
            the next readable one and the file is recorded in :attr:`skipped`
            (per process: with ``num_workers > 0`` each worker keeps its own list,
            and each skip also emits a ``RuntimeWarning`` naming the file).

    Attributes:
        classes, class_to_idx, samples, targets: as in ``torchvision.datasets.ImageFolder``.
        skipped: paths skipped in this process (``on_error="skip"`` only).

    Raises:
        FileNotFoundError: ``root`` does not exist.
        ValueError: no class folders, no image files, or bad arguments.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        crop_size: int = 64,
        augment: bool = True,
        output: str = "float",
        on_error: str = "raise",
        mean: Sequence[float] = MEAN,
        std: Sequence[float] = STD,
    ) -> None:
        from torchvision.transforms import v2

        if not isinstance(root, (str, os.PathLike)) or str(root) == "":
            raise ValueError(
                f"root must be a folder path (a str or pathlib.Path) holding one sub-folder per class, "
                f"got {root!r}. Generate the data set with helpers.pipeline.data.make_shapes_dataset() and pass "
                f"its .train_dir or .val_dir."
            )
        self.root = Path(root)
        self.crop_size = check_int("crop_size", crop_size, 8, 1024)
        self.augment = bool(augment)
        self.output = check_choice("output", output, ("float", "uint8"))
        self.on_error = check_choice("on_error", on_error, ("raise", "skip"))
        try:
            self.mean = tuple(float(m) for m in mean)
            self.std = tuple(float(s) for s in std)
        except (TypeError, ValueError):
            raise ValueError(f"mean and std must hold 3 numbers each, got {mean!r} and {std!r}") from None
        if (
            len(self.mean) != 3
            or len(self.std) != 3
            or not all(math.isfinite(v) for v in self.mean + self.std)
            or min(self.std) <= 0
        ):
            raise ValueError(f"mean and std must hold 3 finite values each (std > 0), got {mean} and {std}")
        self.classes, self.samples = _scan_class_folders(self.root)
        self.class_to_idx = {c: i for i, c in enumerate(self.classes)}
        self.targets = [t for _, t in self.samples]
        self.skipped: list[str] = []

        if self.augment:
            geometric: list[Any] = [
                v2.RandomResizedCrop(self.crop_size, scale=(0.6, 1.0), ratio=(0.8, 1.25), antialias=True),
                v2.RandomHorizontalFlip(),
            ]
        else:
            geometric = [v2.Resize(self.crop_size, antialias=True), v2.CenterCrop(self.crop_size)]
        steps = list(geometric)
        if self.output == "float":
            steps += [v2.ToDtype(torch.float32, scale=True), v2.Normalize(self.mean, self.std)]
        self.transform = v2.Compose(steps)

    def __len__(self) -> int:
        return len(self.samples)

    def decode(self, index: int) -> torch.Tensor:
        """Read and decode file ``index`` into a uint8 ``(3, H, W)`` tensor (no augmentation).

        Raises:
            ImageDecodeError: naming the file, if it is missing, empty or not a decodable image.
        """
        from PIL import Image

        path = self.samples[index][0]
        try:
            data = Path(path).read_bytes()
            if not data:
                raise ValueError("the file is empty")
            with Image.open(io.BytesIO(data)) as im:
                arr = np.array(im.convert("RGB"))  # convert() decodes; truncated files raise here
            return torch.from_numpy(arr).permute(2, 0, 1).contiguous()
        except Exception as exc:  # PIL raises OSError / UnidentifiedImageError; reading can raise OSError
            raise ImageDecodeError(
                f"could not decode image file {path}: {str(exc).splitlines()[0][-160:]}. "
                f"The file is damaged or not an image: delete the data set folder and regenerate it "
                f"(make_shapes_dataset), or pass on_error='skip' to skip such files and count them."
            ) from None

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        n = len(self.samples)
        if isinstance(index, bool) or not _is_integer(index):
            raise TypeError(
                f"ShapesDataset indices must be integers from 0 to {n - 1} (or -{n} to -1), "
                f"got {type(index).__name__} {index!r}"
                + (
                    " (convert it with int(...))"
                    if isinstance(index, str) and index.strip().lstrip("-").isdigit()
                    else ""
                )
            )
        index = operator.index(index)
        if not -n <= index < n:
            raise IndexError(f"index {index} out of range for a data set of {n} items")
        index %= n
        for attempt in range(n):
            i = (index + attempt) % n
            try:
                img = self.decode(i)
            except ImageDecodeError as exc:
                if self.on_error == "raise":
                    raise
                self.skipped.append(self.samples[i][0])
                warnings.warn(
                    f"skipped {self.samples[i][0]}: {str(exc).split(': ', 1)[-1][:120]}", RuntimeWarning, stacklevel=2
                )
                continue
            return self.transform(img), self.samples[i][1]
        raise ImageDecodeError(f"no file in {self.root} could be decoded ({n} tried)")

    @property
    def n_skipped(self) -> int:
        """How many damaged files this process skipped (``on_error="skip"``)."""
        return len(self.skipped)

    def sample_bytes(self) -> int:
        """Bytes of one returned image tensor (what a batch moves per sample)."""
        per = 4 if self.output == "float" else 1
        return 3 * self.crop_size * self.crop_size * per

    def __repr__(self) -> str:
        return (
            f"ShapesDataset({len(self)} images, {len(self.classes)} classes, root={str(self.root)!r}, "
            f"crop_size={self.crop_size}, augment={self.augment}, output={self.output!r}, on_error={self.on_error!r})"
        )

    def __str__(self) -> str:  # what print() shows: the same, with the folder on its own line
        return (
            f"ShapesDataset({len(self)} images, {len(self.classes)} classes, crop_size={self.crop_size}, "
            f"augment={self.augment}, output={self.output!r}, on_error={self.on_error!r})\n"
            f"  root={str(self.root)!r}"
        )


#: Per-channel statistics already on a device, keyed by (mean, std, device, dtype): built once
#: with a blocking copy, then reused, so normalising a batch never copies from the host again.
_STATS_CACHE: dict[
    tuple[tuple[float, ...], tuple[float, ...], torch.device, torch.dtype], tuple[torch.Tensor, torch.Tensor]
] = {}


def normalization_stats(
    mean: Sequence[float], std: Sequence[float], device: torch.device | str, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(mean, std)`` as ``(C, 1, 1)`` tensors on ``device``, built once per (values, device, dtype).

    ``torch.tensor(..., device="cuda")`` is a blocking host-to-device copy: built on every
    step it puts a hidden synchronisation into every step
    (``torch.cuda.set_sync_debug_mode`` reports it). Here the first call per key pays that
    copy and caches the result; the cached tensors are complete when cached and never
    freed, so any stream may read them. Treat them as read-only.
    """
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:  # "cuda" and "cuda:0" must find the same entry
        dev = torch.device("cuda", torch.cuda.current_device())
    key = (tuple(float(v) for v in mean), tuple(float(v) for v in std), dev, dtype)
    hit = _STATS_CACHE.get(key)
    if hit is None:
        m = torch.tensor(key[0], dtype=dtype).view(-1, 1, 1).to(key[2])
        s = torch.tensor(key[1], dtype=dtype).view(-1, 1, 1).to(key[2])
        hit = _STATS_CACHE[key] = (m, s)
    return hit


def to_float_normalized(
    batch: torch.Tensor,
    mean: Sequence[float] = MEAN,
    std: Sequence[float] = STD,
    *,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Turn a uint8 ``(N, C, H, W)`` batch into normalised floats, on the batch's device.

    The workbook's one normaliser (:func:`helpers.pipeline.prefetch.normalize_uint8` and the
    prefetcher delegate to it). The arithmetic is torchvision's
    ``ToDtype(float32, scale=True)`` then ``Normalize(mean, std)``, in the same order:
    ``x.to(dtype).mul_(1 / 255).sub_(mean).div_(std)``. So it equals, bit for bit, what
    ``ShapesDataset(output="float")`` produces from the same crops, on the CPU and on a
    GPU alike (a multiplication by the same float and a division by a tensor round
    the same way on both; ``div_(255)`` would not: on CUDA, division by a Python
    scalar is done as multiplication by its reciprocal). Moving uint8 and normalising
    on the GPU changes speed, never results. The statistics come from
    :func:`normalization_stats` (cached per device and dtype), so no call after the
    first copies anything from the host: no hidden synchronisation.

    Raises:
        ValueError: if ``batch`` is not a uint8 ``(N, C, H, W)`` tensor with as many
            channels as ``mean``, or ``dtype`` is not a floating dtype.
    """
    if not isinstance(batch, torch.Tensor) or batch.dtype != torch.uint8:
        got = batch.dtype if isinstance(batch, torch.Tensor) else type(batch).__name__
        raise ValueError(f"batch must be a uint8 tensor, got {got}")
    if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(f"dtype must be a floating torch dtype, got {dtype!r}")
    m, s = normalization_stats(mean, std, batch.device, dtype)
    if batch.dim() != 4 or batch.shape[1] != m.shape[0]:
        raise ValueError(f"batch must have shape (N, {m.shape[0]}, H, W), got {tuple(batch.shape)}")
    return batch.to(dtype).mul_(1.0 / 255).sub_(m).div_(s)


# ---------------------------------------------------------------------------
# Loader plumbing
# ---------------------------------------------------------------------------


class TimedCollate:
    """A picklable collate function that remembers when it last ran.

    Wraps ``collate_fn`` (default: ``torch.utils.data.default_collate``). After
    each call, :attr:`last` holds ``(start, end)`` in ``time.perf_counter()``
    seconds *of the process that ran it*: with ``num_workers=0`` that is the main
    process, and :func:`helpers.chapters.ch01.anatomy.record_steps` uses it to split the "load"
    phase into "load" (read, decode, augment) and "collate".
    """

    def __init__(self, collate_fn: Callable[[list[Any]], Any] | None = None) -> None:
        self.collate_fn = collate_fn if collate_fn is not None else default_collate
        self.last: tuple[float, float] | None = None

    def __call__(self, items: list[Any]) -> Any:
        t0 = time.perf_counter()
        out = self.collate_fn(items)
        self.last = (t0, time.perf_counter())
        return out

    def __getstate__(self) -> dict[str, Any]:
        return {"collate_fn": self.collate_fn, "last": None}


def seed_worker(worker_id: int) -> None:
    """``worker_init_fn`` that seeds numpy and ``random`` from the worker's torch seed.

    torch's own generator is already seeded per worker by the DataLoader; this
    makes code that uses numpy or ``random`` in a worker just as safe.
    """
    import random

    seed = torch.initial_seed() % 2**32
    np.random.seed(seed)
    random.seed(seed)
