"""The data set as the chapters read it: :class:`ShapesDataset` decodes and augments the JPEGs :mod:`.shapes` draws
(re-exported here), :func:`to_float_normalized` the one normaliser, :class:`TimedCollate` and :func:`seed_worker`
(module level: workers import them by name). Augmentation draws from torch's global generator, which the DataLoader
seeds per worker (a generator made in ``__init__`` is chapter 04's classic bug)."""

from __future__ import annotations

import io
import math
import operator
import os
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch
from torch.utils.data import Dataset, default_collate

from ..core.validate import check_choice, check_int
from .shapes import DatasetInfo as DatasetInfo  # re-exported: chapters and notebooks read them as data.*
from .shapes import default_sizes as default_sizes
from .shapes import make_shapes_dataset as make_shapes_dataset
from .shapes import verify_dataset as verify_dataset

#: Per-channel mean and standard deviation used to normalise images (0-1 scale).
MEAN: tuple[float, float, float] = (0.5, 0.5, 0.5)
STD: tuple[float, float, float] = (0.25, 0.25, 0.25)
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png")


def check_stats(
    mean: Any, std: Any, *, channels: int | None = None, what: str = "mean and std"
) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per-channel normalisation statistics as floats: as many finite values each (``channels`` if given), std > 0."""
    try:
        m, s = (
            tuple(float(v) for v in (x.flatten().tolist() if isinstance(x, torch.Tensor) else x)) for x in (mean, std)
        )
        ok = len(m) == len(s) == (channels or len(m)) > 0 and min(s) > 0 and all(math.isfinite(v) for v in m + s)
    except (TypeError, ValueError):
        ok = False
    if not ok:
        n = f"{channels}" if channels else "the same number of"
        raise ValueError(f"{what} must hold {n} finite values each (same length, std > 0), got {mean!r} and {std!r}")
    return m, s


class ImageDecodeError(RuntimeError):
    """An image file could not be read or decoded (the message names it)."""


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


class ShapesDataset(Dataset):
    """``(image, label)`` items of an ImageFolder tree, decoded by Pillow (torchvision.io's decoders are deprecated
    since 0.29): float32 normalised, or uint8 with ``output="uint8"`` (4x fewer bytes). ``augment``: random resized
    crop and flip, else resize and centre crop. ``on_error="skip"``: the next readable file (in :attr:`skipped`)."""

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
        self.mean, self.std = check_stats(mean, std, channels=3)
        self.classes, self.samples = _scan_class_folders(self.root)
        self.class_to_idx = {c: i for i, c in enumerate(self.classes)}
        self.targets = [t for _, t in self.samples]
        self.skipped: list[str] = []

        if self.augment:
            resize = v2.RandomResizedCrop(self.crop_size, scale=(0.6, 1.0), ratio=(0.8, 1.25), antialias=True)
            steps: list[Any] = [resize, v2.RandomHorizontalFlip()]
        else:
            steps = [v2.Resize(self.crop_size, antialias=True), v2.CenterCrop(self.crop_size)]
        if self.output == "float":
            steps += [v2.ToDtype(torch.float32, scale=True), v2.Normalize(self.mean, self.std)]
        self.transform = v2.Compose(steps)

    def __len__(self) -> int:
        return len(self.samples)

    def decode(self, index: int) -> torch.Tensor:
        """File ``index`` as a uint8 ``(3, H, W)`` tensor."""
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

    def _check_index(self, index: Any) -> int:
        n = len(self.samples)
        try:  # ints, numpy integers, 0-d integer tensors (what samplers hand a data set); not bools
            if isinstance(index, bool):
                raise TypeError
            index = operator.index(index)
        except TypeError:
            digits = isinstance(index, str) and index.strip().lstrip("-").isdigit()
            raise TypeError(
                f"ShapesDataset indices must be integers from 0 to {n - 1} (or -{n} to -1), "
                f"got {type(index).__name__} {index!r}" + " (convert it with int(...))" * digits
            ) from None
        if not -n <= index < n:
            raise IndexError(f"index {index} out of range for a data set of {n} items")
        return index % n

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        n, index = len(self.samples), self._check_index(index)
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

    def __repr__(self) -> str:
        knobs = (
            f"crop_size={self.crop_size}, augment={self.augment}, output={self.output!r}, on_error={self.on_error!r}"
        )
        return f"ShapesDataset({len(self)} images, {len(self.classes)} classes, root={str(self.root)!r}, {knobs})"

    def __str__(self) -> str:  # what print() shows: the folder on its own line
        root = f"root={str(self.root)!r}"
        return repr(self).replace(f"{root}, ", "") + f"\n  {root}"


#: Per-channel statistics already on a device, keyed by (mean, std, device, dtype): built once (a blocking copy).
_STATS_CACHE: dict[tuple[Any, ...], tuple[torch.Tensor, torch.Tensor]] = {}


def normalization_stats(
    mean: Sequence[float], std: Sequence[float], device: torch.device | str, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(mean, std)`` as ``(C, 1, 1)`` tensors on ``device``, built once (``torch.tensor(..., device="cuda")`` is a
    blocking copy); never freed, so any stream may read them."""
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:  # "cuda" and "cuda:0" must find the same entry
        dev = torch.device("cuda", torch.cuda.current_device())
    key = (tuple(float(v) for v in mean), tuple(float(v) for v in std), dev, dtype)
    if key not in _STATS_CACHE:
        m, s = (torch.tensor(v, dtype=dtype).view(-1, 1, 1).to(dev) for v in key[:2])
        _STATS_CACHE[key] = (m, s)
    return _STATS_CACHE[key]


def to_float_normalized(
    batch: torch.Tensor,
    mean: Sequence[float] = MEAN,
    std: Sequence[float] = STD,
    *,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """A uint8 ``(N, C, H, W)`` batch as normalised floats on its device: torchvision's ``ToDtype(scale=True)`` then
    ``Normalize``, so bit for bit what ``ShapesDataset(output="float")`` gives on CPU and GPU (``div_(255)`` would
    not: CUDA multiplies by the reciprocal)."""
    if not isinstance(batch, torch.Tensor) or batch.dtype != torch.uint8:
        got = batch.dtype if isinstance(batch, torch.Tensor) else type(batch).__name__
        raise ValueError(f"batch must be a uint8 tensor, got {got}")
    if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(f"dtype must be a floating torch dtype, got {dtype!r}")
    m, s = normalization_stats(mean, std, batch.device, dtype)
    if batch.dim() != 4 or batch.shape[1] != m.shape[0]:
        raise ValueError(f"batch must have shape (N, {m.shape[0]}, H, W), got {tuple(batch.shape)}")
    return batch.to(dtype).mul_(1.0 / 255).sub_(m).div_(s)


class TimedCollate:
    """A picklable ``collate_fn`` that remembers when it last ran (:attr:`last`: ``perf_counter`` start, end), so
    chapter 01 splits "load" into "load" and "collate" (``num_workers=0``)."""

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
    """``worker_init_fn``: numpy and ``random`` seeded from the worker's torch seed (torch's is already)."""
    import random

    seed = torch.initial_seed() % 2**32
    np.random.seed(seed)
    random.seed(seed)
