"""Chapter 05 (optional): JPEG bytes to decoded batches, on the CPU or on the GPU.

The usual pipeline decodes JPEG files on the CPU (in DataLoader workers) and
sends pixels across the host-to-device link: ``3 * H * W`` bytes per image as
uint8, four times that as float32. The alternative here sends the *compressed*
file bytes, usually several times fewer, and decodes them on the GPU with nvJPEG; the
resize and centre crop then run on the GPU too. Workers only read files.

Public API:

``EncodedJpegDataset(root)``
    Map-style dataset over chapter 01's class folders; an item is ``(bytes, label)``
    with the file's bytes as a 1-D uint8 tensor. Picklable (any start method).
``collate_encoded(items) -> (list of byte tensors, label tensor)``
    The collate function for it (the byte tensors have different lengths, so
    they cannot be stacked).
``decode_batch(encoded, device, crop_size) -> uint8 (N, 3, crop, crop) on device``
    Batched nvJPEG decode on CUDA, the same call on the CPU otherwise, then a
    resize of the shorter side and a centre crop where the pixels are.
``compare_decode(dataset, device, ...) -> DecodeComparison``
    (a) decode on the CPU and send uint8, against (b) send the JPEG bytes and
    decode on the device: time per batch, and the bytes each form puts on the link.
``gpu_reference_rows`` / ``gpu_decode_lines``
    what the notebook shows of the GPU path: measured here, or a GPU's reference recording
    (an :class:`~helpers.core.evidence.Evidence`). The ``ch05.decode.*`` records are made by
    :func:`helpers.chapters.ch05.record_decode` (run by chapter 05's benchmark on a GPU).

torchvision facts this module relies on (torchvision 0.29.1, ``torchvision/io/image.py``
and ``torchvision/csrc/io/image/cuda/decode_jpegs_cuda.cpp``):

* ``torchvision.io.decode_jpeg(input, mode, device)`` takes one 1-D uint8 tensor or a
  **list** of them. The inputs must be **CPU tensors whatever ``device`` says**: nvJPEG
  parses the headers on the host and copies the bitstreams to the GPU itself. With
  ``device="cuda"`` and a list, one batched call (``nvjpegDecodeBatched``, on the hardware
  JPEG engines of A100/H100-class GPUs where the image allows it) decodes them all; the
  docs say a list is "more efficient than repeated individual calls" on CUDA and
  equivalent on the CPU, and that "this function does not return partial results in
  case of an error".
* The CUDA decoder (``decode_jpegs_cuda.cpp``) allocates its output tensors with
  ``torch::empty`` on the target device, that is from PyTorch's caching allocator **on
  the caller's current stream**, and then decodes into them on **its own** stream (one
  taken from the stream pool), without ordering that stream after the caller's. The
  allocator hands out a block as soon as it is freed on the caller's stream, while
  kernels queued earlier on that stream may still read it; nvJPEG's hardware engine
  then overwrites it (pytorch/vision PR #9606 reproduces the corruption on an H100:
  NaNs and arbitrary values in tensors that never touched the decoder; torchcodec PR
  #1634 fixes its own decoder with a host synchronisation before the batched decode).
  :func:`decode_batch` therefore **synchronises the caller's current stream before
  decoding** (``torch.cuda.current_stream(device).synchronize()``). It costs little:
  the decoder synchronises the host with its own stream anyway.
* After decoding, the decoder **synchronises its stream with the host before
  returning** (``cudaStreamSynchronize``), then makes a current stream wait on an event.
  So when the call returns the pixels are written: work queued afterwards on any stream
  sees them, and nothing more is needed after the call. The call is blocking for the
  host, and the input bytes (and the pinned staging buffer) may be reused as soon as it
  returns.
* Since torchvision 0.29 every ``torchvision.io`` image decoder and encoder calls
  ``warnings.warn(..., DeprecationWarning)`` on every call: "The image decoding and
  encoding capabilities of TorchVision are deprecated since torchvision 0.29 and will be
  removed in a future release. They are superseded by the more complete decoders and
  encoders of TorchCodec (from torchcodec 0.16)." The warning is attributed to
  ``torchvision/io/image.py``, so Python's default filters hide it in scripts and
  notebooks; pytest shows it once per test, and ``-W error::DeprecationWarning`` (or
  ``PYTHONWARNINGS=error``) turns it into an exception that would break decoding. The
  recommended replacement is ``torchcodec.decoders.decode_jpeg(..., device="cuda")``
  (torchcodec >= 0.16; see its torchvision migration guide). This workbook pins
  torchvision 0.29 and does not depend on torchcodec, so we keep torchvision's decoder
  (still shipped, with nvJPEG bundled in the CUDA wheel) and silence exactly that
  warning, matched by message and category, only around our own calls
  (:func:`_quiet_torchvision_io`). Every other warning still shows. When torchvision
  removes these decoders, :func:`decode_batch` is the one place to switch to torchcodec.

Pixels are equal on the CPU to chapter 01's Pillow pipeline (both use libjpeg-turbo,
and the same ``v2`` resize and centre crop). On a GPU two things differ, and
:func:`compare_decode` measures them apart: the **decode** (nvJPEG's IDCT and chroma
upsampling are its own: :attr:`DecodeComparison.decode_mean_abs_diff`, full-size images
before any resize) and the **resize** (torchvision resizes uint8 images in integer
arithmetic on the CPU but in float on CUDA, rounding back to uint8:
:attr:`DecodeComparison.resize_mean_abs_diff`, the CPU's decoded pixels resized on the
device against the same pixels resized on the CPU). :attr:`DecodeComparison.mean_abs_diff`
is what a reader gets, both together; chapter 05's benchmark records all three.
"""

from __future__ import annotations

import contextlib
import os
import re
import statistics
import textwrap
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch
from torch.utils.data import Dataset

from ...core import agreement
from ...core.config import require_gpu
from ...core.device import resolve_device
from ...core.results import Record, ResultSet
from ...core.timing import Timing, time_calls
from ...core.validate import check_int, human_bytes
from ...pipeline.data import ImageDecodeError, _scan_class_folders, to_float_normalized

__all__ = [
    "TORCHVISION_DEPRECATION",
    "FORMS",
    "EncodedJpegDataset",
    "read_encoded",
    "check_jpeg",
    "collate_encoded",
    "decode_batch",
    "batch_bytes",
    "DecodeComparison",
    "compare_decode",
    "same_path_verdict",
    "gpu_reference_rows",
    "gpu_decode_lines",
    "plot_comparison",
]

#: The start of the message every torchvision.io image codec warns with since 0.29.
TORCHVISION_DEPRECATION = "The image decoding and encoding capabilities of TorchVision are deprecated"
#: The forms a batch can cross the link in, smallest first (for this data set).
FORMS = ("jpeg", "uint8", "float32")
_SOI = (0xFF, 0xD8)  # start-of-image marker: the first two bytes of every JPEG
_EOI = (0xFF, 0xD9)  # end-of-image marker: the last marker of a complete JPEG
#: How many bytes at the end of a file are searched for the end-of-image marker.
EOI_SEARCH_BYTES = 4096
_CPU_LABEL = "decode on the CPU, send uint8"
_DEVICE_LABEL = "send JPEG bytes, decode on the device"
_SAME_PATH_LABEL = "CPU decode, same code path"


@contextlib.contextmanager
def _quiet_torchvision_io() -> Iterator[None]:
    """Silence torchvision 0.29's deprecation warning for its image decoders, and only it.

    ``warnings.catch_warnings`` restores the previous filters on exit. It changes
    process-wide state, so it is used only around our own short decode calls in the
    calling thread (the main process, or a worker process that owns its filters).
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=TORCHVISION_DEPRECATION, category=DeprecationWarning)
        yield


# ---------------------------------------------------------------------------
# Reading and checking bytes
# ---------------------------------------------------------------------------


def read_encoded(path: str | os.PathLike[str]) -> torch.Tensor:
    """Read a file into a new 1-D uint8 tensor (no decoding, one copy: straight into the tensor).

    Raises:
        ImageDecodeError: naming the file, if it cannot be read or is empty.
    """
    path = Path(path)
    try:
        size = path.stat().st_size
        if size == 0:
            raise ValueError("the file is empty")
        out = torch.empty(size, dtype=torch.uint8)
        view = out.numpy().data  # a writable memoryview of the tensor's bytes
        got = 0
        with open(path, "rb") as f:
            while got < size:
                n = f.readinto(view[got:])
                if not n:
                    raise ValueError(f"the file shrank while being read ({got} of {size} bytes)")
                got += n
        return out
    except (OSError, ValueError) as exc:
        raise ImageDecodeError(f"could not read image file {path}: {exc}") from None


def _item_name(index: int, names: Sequence[str] | None) -> str:
    if names is not None and index < len(names):
        return f"item {index} of the batch ({names[index]})"
    return f"item {index} of the batch"


def check_jpeg(data: torch.Tensor, name: str = "the data") -> None:
    """Cheap structural check of one encoded JPEG: start and end markers, without decoding.

    A complete JPEG starts with the SOI marker ``FF D8`` and ends with the EOI
    marker ``FF D9`` (searched in the last :data:`EOI_SEARCH_BYTES` bytes, so a few
    trailing bytes after it are tolerated). A truncated file loses its EOI marker;
    a PNG or a text file has no SOI marker. This catches both before a batched GPU
    decode, which names no item when it fails.

    What no marker check (and no decoder) reliably catches: damage *inside* the
    compressed data. libjpeg-turbo then prints "Corrupt JPEG data: ..." on stderr and
    returns wrong pixels without an error. Only a checksum finds that
    (:func:`helpers.pipeline.data.verify_dataset` with ``level="full"``).

    Raises:
        ValueError: ``data`` is not a non-empty 1-D uint8 CPU tensor.
        ImageDecodeError: naming ``name``, if a marker is missing.
    """
    if not isinstance(data, torch.Tensor) or data.dtype != torch.uint8 or data.dim() != 1:
        got = (
            f"{data.dtype} tensor of shape {tuple(data.shape)}"
            if isinstance(data, torch.Tensor)
            else type(data).__name__
        )
        raise ValueError(f"encoded: {name} must be a 1-D uint8 tensor of file bytes, got {got}")
    if data.device.type != "cpu":
        raise ValueError(
            f"encoded: {name} must be a CPU tensor (nvJPEG reads the bytes from host memory), got one on {data.device}"
        )
    n = data.numel()
    if n < 4:
        raise ImageDecodeError(f"could not decode {name}: {n} bytes is too short to be a JPEG")
    if (int(data[0]), int(data[1])) != _SOI:
        raise ImageDecodeError(
            f"could not decode {name}: it does not start with the JPEG marker FF D8 "
            f"(starts with {int(data[0]):02X} {int(data[1]):02X}); it is not a JPEG file"
        )
    tail = data[-min(n, EOI_SEARCH_BYTES) :]
    if not bool(((tail[:-1] == _EOI[0]) & (tail[1:] == _EOI[1])).any()):
        raise ImageDecodeError(
            f"could not decode {name}: no JPEG end marker FF D9 near the end of its {n} bytes; "
            f"the file is truncated or damaged (delete the data set folder and regenerate it)"
        )


# ---------------------------------------------------------------------------
# Dataset and collate
# ---------------------------------------------------------------------------


class EncodedJpegDataset(Dataset):
    """The JPEG files of a class-folder tree, as raw bytes: ``(uint8 1-D tensor, label)``.

    Same folders, classes and sample order as :class:`helpers.pipeline.data.ShapesDataset`
    (``info.train_dir`` or ``info.val_dir`` from :func:`helpers.pipeline.data.make_shapes_dataset`).
    A worker only reads the file, so what travels from the workers to the main
    process, and later across the link, is the compressed bytes.

    Picklable under any start method (it holds paths and labels only).

    Args:
        root: folder holding one sub-folder per class.
        check: run :func:`check_jpeg` on every item as it is read (two marker
            lookups, no decoding), so a truncated file fails in the worker with its
            path in the message.

    Attributes:
        classes, samples, targets: as in ``torchvision.datasets.ImageFolder``.

    Raises:
        FileNotFoundError / ValueError: as :class:`helpers.pipeline.data.ShapesDataset` for a bad ``root``.
    """

    def __init__(self, root: str | os.PathLike[str], *, check: bool = True) -> None:
        self.root = Path(root)
        self.check = bool(check)
        self.classes, self.samples = _scan_class_folders(self.root)
        self.targets = [t for _, t in self.samples]

    def __len__(self) -> int:
        return len(self.samples)

    def path(self, index: int) -> str:
        """The file behind item ``index``."""
        return self.samples[index][0]

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        n = len(self.samples)
        if not -n <= index < n:
            raise IndexError(f"index {index} out of range for a data set of {n} items")
        path, label = self.samples[index]
        data = read_encoded(path)
        if self.check:
            check_jpeg(data, f"image file {path}")
        return data, label

    def __repr__(self) -> str:
        return f"EncodedJpegDataset({len(self)} files, {len(self.classes)} classes, root={str(self.root)!r})"


def collate_encoded(items: Sequence[tuple[torch.Tensor, int]]) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Collate ``(bytes, label)`` items into ``(list of byte tensors, int64 label tensor)``.

    The byte tensors keep their own lengths (they cannot be stacked). With
    ``pin_memory=True`` a DataLoader pins each of them; :func:`decode_batch` then
    uses them as they are.

    Raises:
        ValueError: for an empty batch or items that are not ``(tensor, label)`` pairs.
    """
    if len(items) == 0:
        raise ValueError("items: collate_encoded needs at least one (bytes, label) item, got none")
    encoded: list[torch.Tensor] = []
    labels: list[int] = []
    for i, item in enumerate(items):
        if not (isinstance(item, (tuple, list)) and len(item) == 2 and isinstance(item[0], torch.Tensor)):
            raise ValueError(f"items: item {i} must be a (uint8 tensor, label) pair, got {type(item).__name__}")
        encoded.append(item[0])
        labels.append(int(item[1]))
    return encoded, torch.tensor(labels, dtype=torch.int64)


# ---------------------------------------------------------------------------
# Decoding
# ---------------------------------------------------------------------------


def _staged(encoded: list[torch.Tensor]) -> list[torch.Tensor]:
    """The batch's bytes in one pinned host buffer, as 1-D views (already pinned: unchanged).

    nvJPEG copies the bitstreams from these host addresses; from page-locked
    memory that copy can be a direct DMA. The buffer comes from PyTorch's caching
    host allocator, so after the first batches packing costs one memcpy. It is
    safe to let it go when :func:`decode_batch` returns, because torchvision's CUDA
    decoder synchronises its own stream with the host before returning (see the module
    docstring), so nvJPEG has read the bytes by then.
    """
    if all(t.is_pinned() for t in encoded):
        return encoded
    total = sum(t.numel() for t in encoded)
    buf = torch.empty(total, dtype=torch.uint8, pin_memory=True)
    views = []
    off = 0
    for t in encoded:
        n = t.numel()
        buf[off : off + n].copy_(t)
        views.append(buf[off : off + n])
        off += n
    return views


def _resize_crop(images: list[torch.Tensor], crop_size: int) -> torch.Tensor:
    """Resize each image's shorter side to ``crop_size`` and centre-crop a square, on its device.

    The same operations as ``ShapesDataset(augment=False)`` (``v2.Resize(crop, antialias=True)``
    then ``v2.CenterCrop(crop)``). Images of equal size are stacked and resized in one call.
    """
    from torchvision.transforms.v2 import functional as F

    n = len(images)
    out = torch.empty((n, 3, crop_size, crop_size), dtype=torch.uint8, device=images[0].device)
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, im in enumerate(images):
        groups.setdefault(tuple(im.shape), []).append(i)
    for idx in groups.values():
        group = [images[i] for i in idx]
        if all(im.permute(1, 2, 0).is_contiguous() for im in group):
            # The CPU decoder returns (3, H, W) views of (H, W, 3) pixels. Stacking those views
            # as they are is a slow strided copy; stack the (H, W, 3) pixels instead and view the
            # result as a channels-last (N, 3, H, W) batch, which is also the fast layout for
            # uint8 antialiased resizing on the CPU.
            x = torch.stack([im.permute(1, 2, 0) for im in group]).permute(0, 3, 1, 2)
        else:
            x = torch.stack(group)
        x = F.resize(x, [crop_size], antialias=True)
        x = F.center_crop(x, [crop_size, crop_size])
        if len(idx) == n:
            out.copy_(x)
        else:
            out[torch.tensor(idx, device=out.device)] = x
    return out


def _reason(exc: BaseException) -> str:
    """The decoder's own words: the first line of its message, without the C++ source location."""
    line = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return re.sub(r"^.*\.(?:cpp|h):\d+,\s*", "", line)[-200:]


def _culprit_on_cpu(encoded: list[torch.Tensor], names: Sequence[str] | None) -> str | None:
    """After a batched GPU decode failed: decode each item on the CPU and name the first that fails."""
    from torchvision.io import ImageReadMode, decode_jpeg

    with _quiet_torchvision_io():
        for i, t in enumerate(encoded):
            try:
                decode_jpeg(t, mode=ImageReadMode.RGB)
            except RuntimeError as exc:
                return f"{_item_name(i, names)}: {_reason(exc)}"
    return None


def decode_batch(
    encoded: Sequence[torch.Tensor],
    device: torch.device | str | None,
    crop_size: int,
    *,
    pin: bool | None = None,
    names: Sequence[str] | None = None,
) -> torch.Tensor:
    """Decode a batch of JPEG byte tensors into a uint8 ``(N, 3, crop, crop)`` batch on ``device``.

    On CUDA: the bytes are packed into one pinned host buffer (``pin``, default on;
    skipped when they are pinned already, e.g. by a DataLoader with
    ``pin_memory=True``), the caller's current stream is synchronised with the host
    (torchvision's decoder writes its outputs from its own stream without waiting for
    ours; see the module docstring), the batch is decoded by **one** batched nvJPEG call
    (``torchvision.io.decode_jpeg(list, device=...)``, which returns only when the
    pixels are written), and resized and centre-cropped on the GPU, on the current
    stream. The call blocks the host: it is not a way to overlap decoding with compute.
    On the CPU: the same decoder on the CPU (libjpeg-turbo), the same
    resize and crop; same interface, same result up to decoder rounding.

    Every item first passes :func:`check_jpeg`, so a truncated or non-JPEG item
    fails with its position (and its name, if ``names`` is given) before any decode.
    If the batched GPU call still fails, each item is decoded on the CPU to find
    the culprit and the error names it.

    Args:
        encoded: non-empty sequence of 1-D uint8 CPU tensors holding JPEG files.
        device: ``"cpu"``, ``"cuda"`` (or ``"cuda:N"``), or ``None`` for CUDA when present.
        crop_size: output side in pixels (8-1024).
        pin: stage the bytes in pinned memory on CUDA (``None``: yes); ignored on the CPU.
        names: optional names (e.g. file paths) used in error messages.

    Raises:
        ValueError: bad arguments (naming the parameter).
        ImageDecodeError: an item is not a decodable JPEG; the message names it.
    """
    dev = resolve_device(device)
    crop_size = check_int("crop_size", crop_size, 8, 1024)
    return _resize_crop(_decode_images(encoded, dev, pin=pin, names=names), crop_size)


def _decode_images(
    encoded: Sequence[torch.Tensor],
    dev: torch.device,
    *,
    pin: bool | None = None,
    names: Sequence[str] | None = None,
) -> list[torch.Tensor]:
    """The decode step of :func:`decode_batch`: full-size uint8 ``(3, H, W)`` images on ``dev``."""
    from torchvision.io import ImageReadMode, decode_jpeg

    if isinstance(encoded, torch.Tensor) or not isinstance(encoded, Sequence) or len(encoded) == 0:
        raise ValueError(
            "encoded: expected a non-empty list of 1-D uint8 tensors (one per JPEG file), got "
            + (
                f"a {type(encoded).__name__}"
                if not isinstance(encoded, Sequence) or isinstance(encoded, torch.Tensor)
                else "an empty sequence"
            )
        )
    items = list(encoded)
    for i, t in enumerate(items):
        check_jpeg(t, _item_name(i, names))
    if dev.type == "cuda":
        src = _staged(items) if (pin is None or pin) else items
        # torchvision allocates the outputs on our current stream but writes them from its own
        # stream, unordered with ours: let everything already queued on ours finish first, so
        # no block still being read by a queued kernel can be handed to the decoder (module
        # docstring; pytorch/vision PR #9606). The decoder syncs its stream before returning,
        # so the pixels are complete when the call returns: no wait is needed afterwards.
        torch.cuda.current_stream(dev).synchronize()
        try:
            with _quiet_torchvision_io():
                images = decode_jpeg(src, mode=ImageReadMode.RGB, device=dev)
        except RuntimeError as exc:
            culprit = _culprit_on_cpu(items, names)
            if culprit is not None:  # the data is bad (it fails on the CPU too); keep the CUDA error on strict runs
                raise ImageDecodeError(f"could not decode {culprit}. The batched GPU decode failed on it.") from (
                    exc if require_gpu() else None
                )
            raise ImageDecodeError(
                f"the batched GPU JPEG decode failed, although every item decodes on the CPU: {_reason(exc)}"
            ) from exc
    else:
        images = []
        with _quiet_torchvision_io():
            for i, t in enumerate(items):
                try:
                    images.append(decode_jpeg(t, mode=ImageReadMode.RGB))
                except RuntimeError as exc:
                    raise ImageDecodeError(f"could not decode {_item_name(i, names)}: {_reason(exc)}") from None
    return list(images)


def batch_bytes(encoded: Sequence[torch.Tensor], decoded: torch.Tensor) -> dict[str, int]:
    """Bytes one batch puts on the link in each form, counted from the tensors themselves.

    ``jpeg``: the sum of the encoded tensors' sizes (the files' sizes);
    ``uint8``: ``decoded.nbytes``; ``float32``: the ``nbytes`` of the float32
    batch :func:`helpers.pipeline.data.to_float_normalized` makes from it.
    """
    if decoded.dtype != torch.uint8:
        raise ValueError(f"decoded: expected the uint8 batch decode_batch returns, got {decoded.dtype}")
    return {
        "jpeg": int(sum(t.numel() * t.element_size() for t in encoded)),
        "uint8": int(decoded.nbytes),
        "float32": int(to_float_normalized(decoded).nbytes),
    }


# ---------------------------------------------------------------------------
# The measurement
# ---------------------------------------------------------------------------


@dataclass
class DecodeComparison:
    """(a) decode on the CPU and send uint8, against (b) send JPEG bytes and decode on the device.

    Attributes:
        device: where the batches end up (``"cpu"`` or ``"cuda:0"``...).
        on_gpu: whether (b) decoded on a GPU. Without one, (b) is the same CPU
            decode as (a): labelled "CPU decode, same code path".
        batch_size / crop_size / image_size / n_batches: what was measured.
        bytes: per form (:data:`FORMS`), the mean bytes per batch over the batches.
        bytes_per_batch: per form, the exact count for each batch.
        cpu_path / device_path: per-batch times (:class:`helpers.core.timing.Timing`,
            synchronised wall clock: (a) is mostly CPU work, which CUDA events would miss).
        pinned: whether (b) staged the bytes in pinned memory.
        max_abs_diff / mean_abs_diff: (b)'s pixels against (a)'s, on the first batch
            (0-255 levels; 0 on the CPU). On a GPU this is decode and resize together:
        decode_max_abs_diff / decode_mean_abs_diff: the decode alone: (b)'s full-size
            decoded images against (a)'s, before any resize (nvJPEG against libjpeg-turbo).
        resize_max_abs_diff / resize_mean_abs_diff: the resize alone: (a)'s decoded
            images resized and cropped on the device (float arithmetic on CUDA) against
            the same images resized on the CPU (integer arithmetic for uint8).
    """

    device: str
    on_gpu: bool
    batch_size: int
    crop_size: int
    image_size: int
    n_batches: int
    bytes: dict[str, float]
    bytes_per_batch: dict[str, list[int]]
    cpu_path: Timing
    device_path: Timing
    pinned: bool
    max_abs_diff: int
    mean_abs_diff: float
    notes: list[str] = field(default_factory=list)
    decode_max_abs_diff: int = 0
    decode_mean_abs_diff: float = 0.0
    resize_max_abs_diff: int = 0
    resize_mean_abs_diff: float = 0.0

    def diff_report(self) -> str:
        """Where (b)'s pixels differ from (a)'s: the decode alone, the resize alone, and both (what you get)."""
        if not self.on_gpu:
            return (
                "pixels: path (b) ran the same CPU code as (a): identical (largest difference "
                f"{self.max_abs_diff} of 255 levels)"
            )
        rows = [
            (
                "decode alone (nvJPEG vs libjpeg-turbo, full-size images)",
                self.decode_max_abs_diff,
                self.decode_mean_abs_diff,
            ),
            (
                "resize alone (same pixels, float resize on the GPU vs integer on the CPU)",
                self.resize_max_abs_diff,
                self.resize_mean_abs_diff,
            ),
            ("both (what decode_batch returns)", self.max_abs_diff, self.mean_abs_diff),
        ]
        return "\n".join(
            ["pixels of (b) against (a), in 0-255 levels, first batch:"]
            + [f"  {name:<76} largest {mx:>3}, mean {mean:.3f}" for name, mx, mean in rows]
        )

    @property
    def labels(self) -> tuple[str, str]:
        """(label of path a, label of path b) for tables and plots."""
        b = _DEVICE_LABEL + (" (nvJPEG)" if self.on_gpu else f" ({_SAME_PATH_LABEL})")
        return _CPU_LABEL, b

    @property
    def speedup(self) -> float:
        """Median time of (a) over median time of (b): above 1, decoding on the device is faster."""
        return self.cpu_path.median_s / self.device_path.median_s

    def report(self) -> str:
        """A small table: bytes per batch in each form, then the time per batch of each path."""
        a, b = self.labels
        f32 = self.bytes["float32"]
        lines = [
            f"{self.n_batches} batches of {self.batch_size} images ({self.image_size}x{self.image_size} JPEG "
            f"files, cropped to {self.crop_size}), measured now on {self.device}:",
            f"  {'form on the link':<18}{'bytes per batch':>18}{'vs float32':>12}",
        ]
        for form in FORMS:
            v = self.bytes[form]
            lines.append(f"  {form:<18}{human_bytes(v):>18}{v / f32:>11.1%}")
        w = max(len(a), len(b)) + 2
        lines.append(f"  {'path':<{w}}{'ms per batch':>13}{'IQR':>9}")
        for label, t in ((a, self.cpu_path), (b, self.device_path)):
            lines.append(f"  {label:<{w}}{t.median_s * 1e3:>13.2f}{t.iqr_s * 1e3:>9.2f}")
        lines.extend(textwrap.fill(f"  note: {n}", 105, subsequent_indent="    ") for n in self.notes)
        if not self.on_gpu:
            lines.append(textwrap.fill(f"  verdict: {self.verdict}", 105, subsequent_indent="    "))
        return "\n".join(lines)

    @property
    def verdict(self) -> str:
        """Without a GPU: whether the two runs of the same CPU code agree (:func:`same_path_verdict`).
        On a GPU the two paths are different code, compared by :attr:`speedup`."""
        if self.on_gpu:
            return f"two different paths: CPU path / GPU path = {self.speedup:.2f}"
        return same_path_verdict(self.cpu_path, self.device_path)


def _agree(first: Timing, second: Timing) -> bool:
    """Whether two timings' interquartile ranges overlap (:func:`helpers.core.agreement.spreads_overlap`)."""
    return agreement.spreads_overlap(first.quartiles_s, second.quartiles_s)


def same_path_verdict(first: Timing, second: Timing) -> str:
    """One sentence on two timings of the same code, ``first`` timed before ``second``.

    They agree when their interquartile ranges (per-call quartiles, :attr:`Timing.quartiles_s`)
    overlap: the gap between the medians is then within their spread, noise. When they do not
    overlap the gap is still not the code's (it is the same code): it is warm-up or load on this
    machine, and the faster run is the one to trust, since load and warm-up only ever add time.
    """
    (a_lo, a_hi), (b_lo, b_hi) = first.quartiles_s, second.quartiles_s
    a_ms, b_ms = first.median_s * 1e3, second.median_s * 1e3
    pair = f"{a_ms:.2f} ms (a, timed first) and {b_ms:.2f} ms (b, timed second)"
    spread = f"quartiles {a_lo * 1e3:.2f}-{a_hi * 1e3:.2f} and {b_lo * 1e3:.2f}-{b_hi * 1e3:.2f} ms"
    if _agree(first, second):
        return (
            f"the same CPU code timed twice, {pair} per batch, agree within their spread ({spread} overlap): "
            f"the gap is noise."
        )
    which = "(b), timed second" if b_ms <= a_ms else "(a), timed first"
    return (
        f"the same CPU code timed twice, {pair} per batch, do NOT agree within their spread ({spread} do "
        f"not overlap). Same code, so the gap is warm-up or load on this machine, not the path: trust the faster, "
        f"{which}, {min(a_ms, b_ms):.2f} ms per batch (load and warm-up only ever add time), or re-run the cell."
    )


def _batches(
    dataset: EncodedJpegDataset, batch_size: int, n_batches: int
) -> list[tuple[list[torch.Tensor], list[str]]]:
    """The first ``n_batches`` whole batches of file bytes, with their paths (read now, not timed)."""
    n = min(len(dataset), batch_size * n_batches)
    if n < batch_size:
        raise ValueError(f"batch_size: the data set holds {len(dataset)} files, fewer than one batch of {batch_size}")
    out = []
    for start in range(0, n - batch_size + 1, batch_size):
        idx = range(start, start + batch_size)
        out.append(([dataset[i][0] for i in idx], [dataset.path(i) for i in idx]))
    return out


def compare_decode(
    dataset: EncodedJpegDataset,
    device: torch.device | str | None = None,
    *,
    batch_size: int = 32,
    crop_size: int = 64,
    n_batches: int = 4,
    repeats: int = 3,
    pin: bool | None = None,
    progress: Callable[[float, str], None] | None = None,
) -> DecodeComparison:
    """Measure both ways of getting a decoded batch onto ``device``.

    The first ``batch_size * n_batches`` files are read into memory first (not
    timed), so both paths start from the same bytes and only decoding and moving
    are timed:

    * (a) ``decode_batch(bytes, "cpu", crop).to(device)``: decode on the CPU, send uint8;
    * (b) ``decode_batch(bytes, device, crop)``: send the JPEG bytes, decode on the device.

    Each path is timed per batch with a synchronised wall clock
    (:func:`helpers.core.timing.time_calls`), cycling ``repeats`` times over the
    batches after one untimed warm-up batch (the first nvJPEG call creates its
    handle). Bytes per batch are counted from the tensors (:func:`batch_bytes`).

    Args:
        dataset: an :class:`EncodedJpegDataset`.
        device: where the batches must end up (``None``: CUDA if present, else the CPU).
        batch_size: images per batch (1-4096). crop_size: output side (8-1024).
        n_batches: distinct batches (1-1000). repeats: passes over them (1-100).
        pin: stage (b)'s bytes in pinned memory on CUDA (``None``: yes).
    """
    if not isinstance(dataset, EncodedJpegDataset):
        raise ValueError(f"dataset: expected an EncodedJpegDataset, got {type(dataset).__name__}")
    dev = resolve_device(device)
    on_gpu = dev.type == "cuda"
    batch_size = check_int("batch_size", batch_size, 1, 4096)
    crop_size = check_int("crop_size", crop_size, 8, 1024)
    n_batches = check_int("n_batches", n_batches, 1, 1000)
    repeats = check_int("repeats", repeats, 1, 100)
    batches = _batches(dataset, batch_size, n_batches)
    notes: list[str] = []
    if not on_gpu:
        notes.append(
            f"no CUDA device: path (b) decodes on the CPU too ({_SAME_PATH_LABEL}); the GPU "
            f"figures come from reference results"
        )
    pinned = on_gpu and (pin is None or bool(pin))

    per_form: dict[str, list[int]] = {f: [] for f in FORMS}
    first: dict[str, torch.Tensor] = {}
    split = {"decode": (0, 0.0), "resize": (0, 0.0)}
    for k, (enc, names) in enumerate(batches):
        x = decode_batch(enc, "cpu", crop_size, names=names)
        for form, v in batch_bytes(enc, x).items():
            per_form[form].append(v)
        if k == 0:
            first["a"] = x
            first["b"] = decode_batch(enc, dev, crop_size, pin=pin, names=names).cpu()
            if on_gpu:  # the two sources of difference, measured apart
                raw_a = _decode_images(enc, torch.device("cpu"), names=names)
                raw_b = _decode_images(enc, dev, pin=pin, names=names)
                split["decode"] = _diff_stats(raw_a, [im.cpu() for im in raw_b])
                resized_on_dev = _resize_crop([im.to(dev) for im in raw_a], crop_size).cpu()
                split["resize"] = _diff_stats([x], [resized_on_dev])
    from torchvision.io import ImageReadMode, decode_jpeg

    with _quiet_torchvision_io():  # the stored width of the first file, for the labels
        image_size = int(decode_jpeg(batches[0][0][0], mode=ImageReadMode.RGB).shape[-1])
    diff = (first["a"].to(torch.int16) - first["b"].to(torch.int16)).abs()

    state = {"i": 0}

    def path_a() -> torch.Tensor:
        enc, names = batches[state["i"] % len(batches)]
        state["i"] += 1
        return decode_batch(enc, "cpu", crop_size, names=names).to(dev)

    def path_b() -> torch.Tensor:
        enc, names = batches[state["i"] % len(batches)]
        state["i"] += 1
        return decode_batch(enc, dev, crop_size, pin=pin, names=names)

    timings = []
    for j, (label, fn) in enumerate(((_CPU_LABEL, path_a), (_DEVICE_LABEL, path_b))):
        state["i"] = 0
        if progress is not None:
            progress(j / 2, f"timing path {'ab'[j]} ({j + 1} of 2): {repeats * len(batches)} batches")
        t = time_calls(fn, repeats=repeats * len(batches), label=label, device=dev, sync=True, warmup=1)
        t.metadata.update(batch_size=batch_size, crop_size=crop_size, pinned=pinned if j else False)
        timings.append(t)
        if progress is not None:
            progress((j + 1) / 2, f"timed path {'ab'[j]} ({j + 1} of 2)")
    return DecodeComparison(
        device=str(dev),
        on_gpu=on_gpu,
        batch_size=batch_size,
        crop_size=crop_size,
        image_size=image_size,
        n_batches=len(batches),
        bytes={f: statistics.fmean(v) for f, v in per_form.items()},
        bytes_per_batch=per_form,
        cpu_path=timings[0],
        device_path=timings[1],
        pinned=pinned,
        max_abs_diff=int(diff.max()),
        mean_abs_diff=float(diff.float().mean()),
        notes=notes,
        decode_max_abs_diff=split["decode"][0],
        decode_mean_abs_diff=split["decode"][1],
        resize_max_abs_diff=split["resize"][0],
        resize_mean_abs_diff=split["resize"][1],
    )


def _diff_stats(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> tuple[int, float]:
    """(largest, mean) absolute difference in 0-255 levels over pairs of same-shaped uint8 tensors."""
    largest, total, count = 0, 0.0, 0
    for x, y in zip(a, b):
        d = (x.to(torch.int16) - y.to(torch.int16)).abs()
        largest = max(largest, int(d.max()))
        total += float(d.sum(dtype=torch.float64))
        count += d.numel()
    return largest, total / max(count, 1)


# ---------------------------------------------------------------------------
# Reference results and the picture
# ---------------------------------------------------------------------------


def gpu_reference_rows(rs: ResultSet, records: list[Record]) -> list[tuple[str, float, float | None]] | None:
    """``convert`` for ``ch05.decode.ms_per_batch``: a GPU recording's rows, or None if the file has none.

    Rows are ``(label, ms per batch, iqr ms or None)``, the CPU path first, with the batch size and image
    size of the recording in the labels; only records whose batch ended up on CUDA (``device="cuda"``)
    count. Use it with :func:`helpers.core.evidence.measure_or_recall` (and :func:`gpu_decode_lines`).
    """
    rows: list[tuple[str, float, float | None]] = []
    cuda = [r for r in records if r.params.get("device") == "cuda"]
    for r in sorted(cuda, key=lambda r: (r.params.get("where") != "cpu", not r.params.get("pinned"))):
        p = r.params
        if p.get("where") == "cpu":
            label = _CPU_LABEL
        else:
            label = _DEVICE_LABEL + (" (nvJPEG, pinned bytes)" if p.get("pinned") else " (nvJPEG, pageable bytes)")
        label += f" · batch {p.get('batch_size')}, {p.get('image_size')} px -> {p.get('crop_size')}"
        iqr = r.spread.get("iqr")
        rows.append((label, r.value, float(iqr) if iqr is not None else None))
    return rows or None


def gpu_decode_lines(value: DecodeComparison | list[tuple[str, float, float | None]]) -> list[str]:
    """What the GPU decode shows: a comparison measured here on CUDA (the ratio of the two paths and
    :meth:`DecodeComparison.diff_report`), or the reference rows of :func:`gpu_reference_rows`."""
    if isinstance(value, DecodeComparison):
        return [
            f"CPU path / GPU path = {value.speedup:.2f} "
            "(above 1: decoding on the GPU is faster at this image and batch size)",
            *value.diff_report().splitlines(),
        ]
    lines: list[str] = []
    for label, ms, iqr in value:  # wrapped: a label with its batch and image sizes is long
        row = f"{label}: {ms:.2f} ms per batch" + (f" (IQR {iqr:.2f})" if iqr is not None else "")
        lines += textwrap.wrap(row, 105, initial_indent="  ", subsequent_indent="    ", break_long_words=False)
    return lines


def plot_comparison(cmp: DecodeComparison, axes: Sequence[Any] | None = None) -> Any:
    """Two panels: bytes per batch in each form, and ms per batch of each path.

    Everything drawn is measured in ``cmp``; the time panel says where it was measured.
    Returns the figure.
    """
    import matplotlib.pyplot as plt

    if axes is None:
        fig, axes = plt.subplots(1, 2, figsize=(11, 3.2))
    ax_b, ax_t = axes[0], axes[1]
    fig = ax_b.figure
    colors = {"jpeg": "#4e79a7", "uint8": "#f28e2b", "float32": "#e15759"}
    names = {"jpeg": "JPEG file bytes", "uint8": "uint8 crop", "float32": "float32 crop"}
    vals = [cmp.bytes[f] / 1024 for f in FORMS]
    bars = ax_b.barh([names[f] for f in FORMS], vals, color=[colors[f] for f in FORMS])
    ax_b.invert_yaxis()
    ax_b.set_xlabel("KiB per batch (mean over the batches)")
    ax_b.set_title(
        f"On the link: {cmp.batch_size} images, {cmp.image_size} px files, {cmp.crop_size} px crops", fontsize=10
    )
    ax_b.set_xlim(0, max(vals) * 1.25)
    for bar, v in zip(bars, vals):
        ax_b.text(v + max(vals) * 0.02, bar.get_y() + bar.get_height() / 2, f"{v:,.0f} KiB", va="center", fontsize=8)
    t = [cmp.cpu_path, cmp.device_path]
    ys = [
        "(a) CPU decode,\nsend uint8",
        "(b) send JPEG bytes,\n" + ("nvJPEG decode" if cmp.on_gpu else "CPU decode (same code)"),
    ]
    med = [x.median_s * 1e3 for x in t]
    quart = [(x.quartiles_s[0] * 1e3, x.quartiles_s[1] * 1e3) for x in t]
    xerr = [[m - q[0] for m, q in zip(med, quart)], [q[1] - m for m, q in zip(med, quart)]]
    ax_t.barh(ys, med, xerr=xerr, color=["#f28e2b", "#4e79a7"], capsize=3)
    ax_t.invert_yaxis()
    ax_t.set_xlabel("ms per batch (median; whiskers: quartiles)")
    agree = "agree within their quartiles" if _agree(t[0], t[1]) else "do NOT agree: see the verdict"
    where = "" if cmp.on_gpu else f" (no GPU)\nsame code timed twice: {agree}"
    ax_t.set_title(f"Time per decoded batch, measured now on {cmp.device}{where}", fontsize=10)
    fig.tight_layout()
    return fig
