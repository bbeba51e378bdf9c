"""Chapter 05 (optional): JPEG bytes to decoded batches, decoded on the CPU (libjpeg-turbo, the pixels of chapter 01's
Pillow pipeline) or on the GPU (nvJPEG, torchvision 0.29's ``decode_jpeg(list, device="cuda")``: CPU byte tensors
in, one call for the batch); :func:`compare_decode` measures both, chapter 05's benchmark records it.
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
from ...core.progress import no_progress
from ...core.results import Record, ResultSet
from ...core.rounds import table
from ...core.timing import Timing, time_calls
from ...core.validate import check_int, human_bytes
from ...pipeline.data import ImageDecodeError, _scan_class_folders

#: The start of the message every torchvision.io image codec warns with since 0.29.
TORCHVISION_DEPRECATION = "The image decoding and encoding capabilities of TorchVision are deprecated"
#: The forms a batch can cross the link in, smallest first (for this data set).
FORMS = ("jpeg", "uint8", "float32")
#: The pixel differences :func:`compare_decode` measures: what a reader gets, the decode alone, the resize alone.
STAGES = ("decode+resize", "decode", "resize")
EOI_SEARCH_BYTES = 4096  # how many bytes at the end of a file are searched for the end-of-image marker FF D9
_CPU_LABEL = "decode on the CPU, send uint8"
_DEVICE_LABEL = "send JPEG bytes, decode on the device"
_SAME_PATH_LABEL = "CPU decode, same code path"


@contextlib.contextmanager
def _quiet_torchvision_io() -> Iterator[None]:
    """torchvision 0.29's codecs warn (superseded by torchcodec): that warning alone silenced, around our calls."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=TORCHVISION_DEPRECATION, category=DeprecationWarning)
        yield


def _item_name(index: int, names: Sequence[str] | None) -> str:
    return f"item {index} of the batch" + (f" ({names[index]})" if names is not None and index < len(names) else "")


def check_jpeg(data: torch.Tensor, name: str = "the data") -> None:
    """The markers ``FF D8`` at the start and ``FF D9`` near the end: a truncated file or a non-JPEG fails here,
    named (a batched GPU decode names no item)."""
    if not isinstance(data, torch.Tensor) or (data.dtype, data.dim(), data.device.type) != (torch.uint8, 1, "cpu"):
        got = type(data).__name__
        if isinstance(data, torch.Tensor):
            got = f"a {data.dtype} tensor of shape {tuple(data.shape)} on {data.device}"
        raise ValueError(
            f"encoded: {name} must be a 1-D uint8 CPU tensor of file bytes (nvJPEG reads host memory), got {got}"
        )
    n, tail = data.numel(), data[-EOI_SEARCH_BYTES:]
    why = None
    if n < 4:
        why = f"{n} bytes is too short to be a JPEG"
    elif (int(data[0]), int(data[1])) != (0xFF, 0xD8):
        why = (
            f"it does not start with the JPEG marker FF D8 (starts with {int(data[0]):02X} {int(data[1]):02X}); "
            "it is not a JPEG file"
        )
    elif not bool(((tail[:-1] == 0xFF) & (tail[1:] == 0xD9)).any()):
        why = (
            f"no JPEG end marker FF D9 near the end of its {n} bytes; the file is truncated or damaged "
            "(delete the data set folder and regenerate it)"
        )
    if why is not None:
        raise ImageDecodeError(f"could not decode {name}: {why}")


class EncodedJpegDataset(Dataset):
    """A class-folder tree's JPEG files as raw bytes, ``(uint8 1-D tensor, label)``, checked (:func:`check_jpeg`)."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        self.classes, self.samples = _scan_class_folders(self.root)

    def __len__(self) -> int:
        return len(self.samples)

    def path(self, index: int) -> str:
        return self.samples[index][0]

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        path, label = self.samples[index]
        try:  # the file's bytes, not decoded
            raw = Path(path).read_bytes()
        except OSError as exc:
            raise ImageDecodeError(f"could not read image file {path}: {exc}") from None
        if not raw:
            raise ImageDecodeError(f"could not read image file {path}: the file is empty")
        data = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        check_jpeg(data, f"image file {path}")  # in the worker, so the error names the file
        return data, label

    def __repr__(self) -> str:
        return f"EncodedJpegDataset({len(self)} files, {len(self.classes)} classes, root={str(self.root)!r})"


def collate_encoded(items: Sequence[tuple[torch.Tensor, int]]) -> tuple[list[torch.Tensor], torch.Tensor]:
    """``(bytes, label)`` items as ``(list of byte tensors, int64 labels)``: unstacked, each its own length."""
    if len(items) == 0:
        raise ValueError("items: collate_encoded needs at least one (bytes, label) item, got none")
    for i, item in enumerate(items):
        if not (isinstance(item, (tuple, list)) and len(item) == 2 and isinstance(item[0], torch.Tensor)):
            raise ValueError(f"items: item {i} must be a (uint8 tensor, label) pair, got {type(item).__name__}")
    return [item[0] for item in items], torch.tensor([int(item[1]) for item in items], dtype=torch.int64)


def _staged(encoded: list[torch.Tensor]) -> list[torch.Tensor]:
    """The bytes in one pinned buffer, as 1-D views, for nvJPEG's DMA."""
    if all(t.is_pinned() for t in encoded):
        return encoded
    sizes = [t.numel() for t in encoded]
    buf = torch.empty(sum(sizes), dtype=torch.uint8, pin_memory=True)
    return list(torch.cat(encoded, out=buf).split(sizes))  # `out` of the same size: written in place, stays pinned


def _resize_crop(images: list[torch.Tensor], crop_size: int) -> torch.Tensor:
    """``ShapesDataset(augment=False)``'s resize and centre crop, on the images' device."""
    from torchvision.transforms.v2 import functional as F

    n = len(images)
    out = torch.empty((n, 3, crop_size, crop_size), dtype=torch.uint8, device=images[0].device)
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, im in enumerate(images):
        groups.setdefault(tuple(im.shape), []).append(i)
    for idx in groups.values():
        group = [images[i] for i in idx]
        if all(im.permute(1, 2, 0).is_contiguous() for im in group):
            # The CPU decoder returns (3, H, W) views of (H, W, 3) pixels: stacking the views is a slow strided
            # copy. Stack the (H, W, 3) pixels and view them as a channels-last (N, 3, H, W) batch, also the fast
            # layout for uint8 antialiased resizing on the CPU.
            x = torch.stack([im.permute(1, 2, 0) for im in group]).permute(0, 3, 1, 2)
        else:
            x = torch.stack(group)
        x = F.center_crop(F.resize(x, [crop_size], antialias=True), [crop_size, crop_size])
        if len(idx) == n:
            out.copy_(x)
        else:
            out[torch.tensor(idx, device=out.device)] = x
    return out


def _reason(exc: BaseException) -> str:
    """The first line of the decoder's message, without the C++ source location."""
    line = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return re.sub(r"^.*\.(?:cpp|h):\d+,\s*", "", line)[-200:]


def decode_batch(
    encoded: Sequence[torch.Tensor],
    device: torch.device | str | None,
    crop_size: int,
    *,
    pin: bool | None = None,
    names: Sequence[str] | None = None,
) -> torch.Tensor:
    """JPEG byte tensors to a uint8 ``(N, 3, crop, crop)`` batch on ``device`` (on CUDA the bytes staged in one pinned
    buffer unless ``pin=False``, one nvJPEG call). A bad item fails named."""
    dev = resolve_device(device)
    crop_size = check_int("crop_size", crop_size, 8, 1024)
    if isinstance(encoded, torch.Tensor) or not isinstance(encoded, Sequence) or len(encoded) == 0:
        got = "an empty sequence" if isinstance(encoded, Sequence) else f"a {type(encoded).__name__}"
        raise ValueError(f"encoded: expected a non-empty list of 1-D uint8 tensors (one per JPEG file), got {got}")
    return _resize_crop(_decode_images(list(encoded), dev, pin=pin, names=names), crop_size)


def _decode_images(
    items: list[torch.Tensor], dev: torch.device, *, pin: bool | None = None, names: Sequence[str] | None = None
) -> list[torch.Tensor]:
    """Full-size uint8 ``(3, H, W)`` images on ``dev``."""
    from torchvision.io import ImageReadMode, decode_jpeg

    for i, t in enumerate(items):
        check_jpeg(t, _item_name(i, names))
    if dev.type != "cuda":
        with _quiet_torchvision_io():
            images = []
            for i, t in enumerate(items):
                try:
                    images.append(decode_jpeg(t, mode=ImageReadMode.RGB))
                except RuntimeError as exc:
                    raise ImageDecodeError(f"could not decode {_item_name(i, names)}: {_reason(exc)}") from None
        return images
    src = _staged(items) if (pin is None or pin) else items
    # The decoder allocates its outputs on our current stream but writes them from its own: let what is queued
    # on ours finish first, so no block a queued kernel still reads is handed to it (PR #9606).
    torch.cuda.current_stream(dev).synchronize()
    try:
        with _quiet_torchvision_io():
            return list(decode_jpeg(src, mode=ImageReadMode.RGB, device=dev))
    except RuntimeError as exc:  # one batched call names no item: the CPU decodes them to find the culprit
        try:
            _decode_images(items, torch.device("cpu"), names=names)
        except ImageDecodeError as bad:  # the data is bad (it fails on the CPU too); keep the CUDA error on strict runs
            culprit = str(bad).removeprefix("could not decode ")
            raise ImageDecodeError(f"could not decode {culprit}. The batched GPU decode failed on it.") from (
                exc if require_gpu() else None
            )
        raise ImageDecodeError(
            f"the batched GPU JPEG decode failed, although every item decodes on the CPU: {_reason(exc)}"
        ) from exc


@dataclass
class DecodeComparison:
    """(a) decode on the CPU, send uint8, against (b) send JPEG bytes, decode on ``device``: bytes per batch, the
    synchronised wall clock per batch ((a) is CPU work, which CUDA events miss), and ``diffs`` of (b)'s pixels."""

    device: str
    on_gpu: bool
    batch_size: int
    crop_size: int
    image_size: int
    n_batches: int
    bytes_per_batch: dict[str, list[int]]
    cpu_path: Timing
    device_path: Timing
    pinned: bool
    diffs: dict[str, tuple[int, float]] = field(default_factory=lambda: dict.fromkeys(STAGES, (0, 0.0)))

    @property
    def bytes(self) -> dict[str, float]:
        """Mean bytes per batch of each form."""
        return {f: statistics.fmean(v) for f, v in self.bytes_per_batch.items()}

    @property
    def speedup(self) -> float:
        return self.cpu_path.median_s / self.device_path.median_s

    def report(self) -> str:
        b = self.bytes
        forms = [[form, human_bytes(b[form]), f"{b[form] / b['float32']:.1%}"] for form in FORMS]
        device_label = _DEVICE_LABEL + (" (nvJPEG)" if self.on_gpu else f" ({_SAME_PATH_LABEL})")
        timed = ((_CPU_LABEL, self.cpu_path), (device_label, self.device_path))
        paths = [[label, f"{t.median_s * 1e3:.2f}", f"{t.iqr_s * 1e3:.2f}"] for label, t in timed]
        lines = [
            f"{self.n_batches} batches of {self.batch_size} images ({self.image_size}x{self.image_size} JPEG "
            f"files, cropped to {self.crop_size}), measured now on {self.device}:",
            *("  " + ln for ln in table(["form on the link", "bytes per batch", "vs float32"], forms)),
            *("  " + ln for ln in table(["path", "ms per batch", "IQR"], paths)),
        ]
        if not self.on_gpu:
            note = (
                f"no CUDA device: path (b) decodes on the CPU too ({_SAME_PATH_LABEL}); GPU figures come from a "
                "GPU's recording or, without one, from figures others published"
            )
            for text in (f"note: {note}", f"verdict: {self.verdict}"):
                lines.append(textwrap.fill("  " + text, 105, subsequent_indent="    "))
        return "\n".join(lines)

    @property
    def verdict(self) -> str:
        """On a CPU, (a) and (b) are the same code: they agree when their quartile ranges overlap; else the gap is
        warm-up or load, and the faster is trusted (those only ever add time)."""
        if self.on_gpu:
            return f"two different paths: CPU path / GPU path = {self.speedup:.2f}"
        first, second = self.cpu_path, self.device_path
        (a_lo, a_hi), (b_lo, b_hi) = first.quartiles_s, second.quartiles_s
        a_ms, b_ms = first.median_s * 1e3, second.median_s * 1e3
        pair = f"{a_ms:.2f} ms (a, timed first) and {b_ms:.2f} ms (b, timed second)"
        spread = f"quartiles {a_lo * 1e3:.2f}-{a_hi * 1e3:.2f} and {b_lo * 1e3:.2f}-{b_hi * 1e3:.2f} ms"
        if agreement.spreads_overlap(first.quartiles_s, second.quartiles_s):
            return (
                f"the same CPU code timed twice, {pair} per batch, agree within their spread ({spread} overlap): "
                f"the gap is noise."
            )
        which = "(b), timed second" if b_ms <= a_ms else "(a), timed first"
        return (
            f"the same CPU code timed twice, {pair} per batch, do NOT agree within their spread ({spread} do "
            f"not overlap). Same code, so the gap is warm-up or load on this machine, not the path: trust the "
            f"faster, {which}, {min(a_ms, b_ms):.2f} ms per batch (load and warm-up only ever add time), or re-run "
            "the cell."
        )


def _diff_stats(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> tuple[int, float]:
    """(largest, mean) absolute difference in 0-255 levels over pairs of uint8 tensors."""
    largest, total, count = 0, 0.0, 0
    for x, y in zip(a, b):
        d = (x.to(torch.int16) - y.to(torch.int16)).abs()
        largest = max(largest, int(d.max()))
        total += float(d.sum(dtype=torch.float64))
        count += d.numel()
    return largest, total / max(count, 1)


def _pixel_diffs(
    raw_cpu: list[torch.Tensor],
    enc: list[torch.Tensor],
    names: list[str],
    dev: torch.device,
    crop: int,
    pin: bool | None,
) -> dict[str, tuple[int, float]]:
    """(largest, mean) difference of (b)'s pixels from (a)'s per :data:`STAGES`: what ``decode_batch`` returns, the
    decode alone (full-size images), the resize alone (the CPU's decoded pixels resized on ``dev``)."""
    raw_dev = _decode_images(enc, dev, pin=pin, names=names)
    x_cpu = _resize_crop(raw_cpu, crop)
    return {
        "decode+resize": _diff_stats([x_cpu], [_resize_crop(raw_dev, crop).cpu()]),
        "decode": _diff_stats(raw_cpu, [im.cpu() for im in raw_dev]),
        "resize": _diff_stats([x_cpu], [_resize_crop([im.to(dev) for im in raw_cpu], crop).cpu()]),
    }


def _batches(dataset: EncodedJpegDataset, batch_size: int, n_batches: int) -> list[tuple[list[Any], list[str]]]:
    """The first ``n_batches`` whole batches of file bytes, with their paths."""
    n = min(len(dataset), batch_size * n_batches)
    if n < batch_size:
        raise ValueError(f"batch_size: the data set holds {len(dataset)} files, fewer than one batch of {batch_size}")
    starts = range(0, n - batch_size + 1, batch_size)
    return [
        ([dataset[i][0] for i in range(s, s + batch_size)], [dataset.path(i) for i in range(s, s + batch_size)])
        for s in starts
    ]


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
    """Both ways onto ``device`` from the same bytes (read first): (a) ``decode_batch(b, "cpu", crop).to(device)``,
    (b) ``decode_batch(b, device, crop, pin=pin)``; ``repeats`` passes after one untimed batch (nvJPEG's handle)."""
    if not isinstance(dataset, EncodedJpegDataset):
        raise ValueError(f"dataset: expected an EncodedJpegDataset, got {type(dataset).__name__}")
    dev = resolve_device(device)
    batch_size = check_int("batch_size", batch_size, 1, 4096)
    crop_size = check_int("crop_size", crop_size, 8, 1024)
    n_batches = check_int("n_batches", n_batches, 1, 1000)
    repeats = check_int("repeats", repeats, 1, 100)
    batches = _batches(dataset, batch_size, n_batches)
    uint8 = batch_size * 3 * crop_size**2  # the bytes one batch puts on the link in each form: from the shapes
    per_form = {"jpeg": [sum(t.numel() for t in enc) for enc, _ in batches], "uint8": [uint8] * len(batches)}
    per_form["float32"] = [4 * uint8] * len(batches)  # to_float_normalized's float32
    raw = _decode_images(batches[0][0], torch.device("cpu"), names=batches[0][1])  # the first batch, full size
    diffs, image_size = _pixel_diffs(raw, *batches[0], dev, crop_size, pin), int(raw[0].shape[-1])
    pinned = dev.type == "cuda" and (pin is None or bool(pin))
    paths = {
        _CPU_LABEL: lambda enc, names: decode_batch(enc, "cpu", crop_size, names=names).to(dev),
        _DEVICE_LABEL: lambda enc, names: decode_batch(enc, dev, crop_size, pin=pin, names=names),
    }
    say, timings = progress or no_progress, []
    for j, (label, fn) in enumerate(paths.items()):
        say(j / 2, f"timing path {'ab'[j]} ({j + 1} of 2): {repeats * len(batches)} batches")
        cycle = iter(batches * (repeats + 1))  # one untimed warm-up batch, then `repeats` passes
        call = lambda fn=fn, cycle=cycle: fn(*next(cycle))  # noqa: E731
        timings.append(time_calls(call, repeats=repeats * len(batches), label=label, device=dev, warmup=1))
    say(1.0, "timed both paths")
    return DecodeComparison(
        str(dev), dev.type == "cuda", batch_size, crop_size, image_size, len(batches),
        per_form, timings[0], timings[1], pinned, diffs,
    )  # fmt: skip


def cuda_records(rs: ResultSet, records: list[Record]) -> list[Record] | None:
    """The ``ch05.decode.ms_per_batch`` records of runs that ended on CUDA (None: none)."""
    return [r for r in records if r.params.get("device") == "cuda"] or None


def gpu_decode_lines(value: DecodeComparison | list[Record]) -> list[str]:
    """A comparison measured on CUDA (the ratio, the pixel differences), or :func:`cuda_records`, one line each."""
    if isinstance(value, DecodeComparison):
        names = {
            "decode": "decode alone (nvJPEG vs libjpeg-turbo, full-size images)",
            "resize": "resize alone (same pixels, float resize on the GPU vs integer on the CPU)",
            "decode+resize": "both (what decode_batch returns)",
        }
        return [
            f"CPU path / GPU path = {value.speedup:.2f} "
            "(above 1: decoding on the GPU is faster at this image and batch size)",
            "pixels of (b) against (a), in 0-255 levels, first batch:",
            *(
                f"  {text:<76} largest {value.diffs[k][0]:>3}, mean {value.diffs[k][1]:.3f}"
                for k, text in names.items()
            ),
        ]
    lines: list[str] = []
    for r in sorted(value, key=lambda r: (r.params.get("where") != "cpu", not r.params.get("pinned"))):
        p, iqr = r.params, r.spread.get("iqr")
        label = _CPU_LABEL if p.get("where") == "cpu" else _DEVICE_LABEL + (
            " (nvJPEG, pinned bytes)" if p.get("pinned") else " (nvJPEG, pageable bytes)"
        )  # fmt: skip
        row = f"{label} · batch {p.get('batch_size')}, {p.get('image_size')} px -> {p.get('crop_size')}: "
        row += f"{r.value:.2f} ms per batch" + (f" (IQR {float(iqr):.2f})" if iqr is not None else "")
        lines += textwrap.wrap(row, 105, initial_indent="  ", subsequent_indent="    ", break_long_words=False)
    return lines


def plot_comparison(cmp: DecodeComparison) -> Any:
    """Two panels: bytes per batch in each form, ms per batch of each path (quartile whiskers)."""
    import matplotlib.pyplot as plt  # optional/heavy: matplotlib

    _, (ax_b, ax_t) = plt.subplots(1, 2, figsize=(11, 3.2))
    vals = [cmp.bytes[f] / 1024 for f in FORMS]
    bars = ax_b.barh(["JPEG file bytes", "uint8 crop", "float32 crop"], vals, color=["#4e79a7", "#f28e2b", "#e15759"])
    ax_b.invert_yaxis()
    ax_b.set_xlabel("KiB per batch (mean over the batches)")
    ax_b.set_title(
        f"On the link: {cmp.batch_size} images, {cmp.image_size} px files, {cmp.crop_size} px crops\n"
        "counted from the files and the crop shapes, not timed",
        fontsize=10,
    )
    ax_b.set_xlim(0, max(vals) * 1.25)
    for bar, v in zip(bars, vals):
        ax_b.text(v + max(vals) * 0.02, bar.get_y() + bar.get_height() / 2, f"{v:,.0f} KiB", va="center", fontsize=8)
    t = [cmp.cpu_path, cmp.device_path]
    med = [x.median_s * 1e3 for x in t]
    xerr = [[m - x.quartiles_s[0] * 1e3 for m, x in zip(med, t)], [x.quartiles_s[1] * 1e3 - m for m, x in zip(med, t)]]
    ys = [
        "(a) CPU decode,\nsend uint8",
        "(b) send JPEG bytes,\n" + ("nvJPEG decode" if cmp.on_gpu else "CPU decode (same code)"),
    ]
    ax_t.barh(ys, med, xerr=xerr, color=["#f28e2b", "#4e79a7"], capsize=3)
    ax_t.invert_yaxis()
    ax_t.set_xlabel("ms per batch (median; whiskers: quartiles)")
    agree = "agree within their quartiles" if agreement.spreads_overlap(*(x.quartiles_s for x in t)) else (
        "do NOT agree: see the verdict"
    )  # fmt: skip
    where = "" if cmp.on_gpu else f" (no GPU)\nsame code timed twice: {agree}"
    ax_t.set_title(f"Time per decoded batch, measured now on {cmp.device}{where}", fontsize=10)
    ax_b.figure.tight_layout()
    return ax_b.figure
