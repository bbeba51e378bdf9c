#!/usr/bin/env python3
"""The workbook's finished data pipeline, as one file to take home.

Trains a small CNN on any folder of images in the usual class-per-subfolder layout
(``torchvision.datasets.ImageFolder``: ``DIR/cat/1.jpg``, ``DIR/dog/2.jpg``, ...), on a CUDA
GPU when there is one, else on the CPU. It imports torch and torchvision only, never the
workbook's ``helpers``, so you can copy it into your own project.

Every step the chapters measured is a command-line knob (the defaults are the fast pipeline):

=====================  ==========================================================  =======
knob                   what it does                                                chapter
=====================  ==========================================================  =======
``--workers N``        decode and augment in N worker processes                    04
``--no-pin``           turn off ``pin_memory=True`` (pinned host batches)           02, 03
``--prefetch-factor``  batches each worker keeps ready                             04
``--no-persistent``    restart the workers every epoch                             04
``--float-on-host``    normalise on the CPU and send float32 (4x the bytes)        05
``--no-prefetcher``    copy on the default stream instead of a side stream         05
=====================  ==========================================================  =======

Example::

    python examples/fast_pipeline.py ~/data/my-images/train --epochs 3 --workers 4

The lines between ``# --- pipeline: start ---`` and ``# --- pipeline: end ---`` are the
pipeline the chapters build, step by step: they are chapter 06's pipeline cells, line for line
(a test keeps them identical). They read three globals, ``DEVICE``, ``WORKERS`` and ``SEED``,
which ``main()`` sets before it builds anything; the rest is the data set, the model, the
command line and the report.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader
from torchvision import datasets
from torchvision.transforms import v2

MEAN = (0.5, 0.5, 0.5)  # per-channel statistics of the images (0-1 scale); use your data set's own
STD = (0.25, 0.25, 0.25)


def usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


# The pipeline reads these three globals; main() sets them from the command line before building anything.
DEVICE = torch.device("cpu")   # where the model trains (--device)
WORKERS = min(8, usable_cores())  # make_loader's default number of worker processes (--workers)
SEED = 0                        # the shuffling order (--seed)


def image_folder(root: Path, crop: int) -> datasets.ImageFolder:
    """The images of ``root`` as uint8 CHW crops (1 byte per pixel on the link); ``normalize`` makes them float."""
    transform = v2.Compose([v2.PILToTensor(), v2.RandomResizedCrop(crop, antialias=True), v2.RandomHorizontalFlip()])
    return datasets.ImageFolder(str(root), transform=transform)


def small_cnn(num_classes: int, width: int = 16, depth: int = 3) -> nn.Module:
    """A plain CNN: ``depth`` stages of conv3x3-BN-ReLU + 2x2 max-pool, then a linear head."""
    layers: list[nn.Module] = []
    channels = 3
    for stage in range(depth):
        out = width * 2**stage
        layers += [nn.Conv2d(channels, out, 3, padding=1, bias=False), nn.BatchNorm2d(out), nn.ReLU(inplace=True),
                   nn.MaxPool2d(2)]
        channels = out
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, num_classes))


# --- pipeline: start ---
def make_loader(dataset, batch_size, workers=WORKERS, pin=True, prefetch_factor=4, persistent=True):
    return DataLoader(dataset, batch_size=batch_size, shuffle=True, drop_last=True,
                      generator=torch.Generator().manual_seed(SEED),      # 01: the same order in every run
                      num_workers=workers,                                # 04: load in worker processes
                      pin_memory=pin and DEVICE.type == "cuda",           # 03: page-locked batches (CUDA only)
                      persistent_workers=persistent and workers > 0,      # 04: keep the workers between epochs
                      prefetch_factor=prefetch_factor if workers > 0 else None)  # 04: batches queued per worker


@functools.lru_cache(maxsize=None)
def stats(device):                                        # made once per device: a new one would copy and sync
    return (torch.tensor(MEAN, device=device).view(1, 3, 1, 1) * 255,
            torch.tensor(STD, device=device).view(1, 3, 1, 1) * 255)


def normalize(x):                                         # 05: uint8 -> float, on the tensor's device
    mean, std = stats(x.device)
    return (x.float() - mean) / std


@functools.lru_cache(maxsize=None)
def side_stream(device):                                  # 05: one side stream per device, made once
    return torch.cuda.Stream(device)                      # (batches() makes a Prefetcher every epoch)


class Prefetcher:                                         # 05: copy batch i+1 on a side stream while i trains
    def __init__(self, loader):
        self.loader, self.stream = loader, side_stream(DEVICE)  # the device's one side stream, every epoch

    def __iter__(self):
        main = torch.cuda.current_stream(DEVICE)
        self.stream.wait_stream(main)                     # the side stream starts after earlier work
        it = iter(self.loader)
        nxt = self._send(next(it, None))
        while nxt is not None:
            main.wait_stream(self.stream)                 # batch i's copy is done before main uses it
            x, y = nxt
            x.record_stream(main)                         # its memory is not reused while main needs it
            y.record_stream(main)
            nxt = self._send(next(it, None))              # queue batch i+1's copy now
            yield x, y

    def _send(self, batch):
        if batch is None:
            return None
        with torch.cuda.stream(self.stream):              # pinned batches: the copy runs beside compute
            return batch[0].to(DEVICE, non_blocking=True), batch[1].to(DEVICE, non_blocking=True)


def batches(loader, prefetch=True, float_on_host=False):
    if prefetch and DEVICE.type == "cuda" and not float_on_host:
        for x, y in Prefetcher(loader):
            yield normalize(x), y                         # 05: uint8 crossed the link; float made on the GPU
        return
    for x, y in loader:
        if float_on_host:                                 # float32 crosses the link: 4x the bytes
            x = normalize(x).pin_memory() if x.is_pinned() else normalize(x)  # pinned, as the loader's was
        x, y = x.to(DEVICE, non_blocking=True), y.to(DEVICE, non_blocking=True)  # 03: async from pinned memory
        yield (x if float_on_host else normalize(x)), y


def train_step(model, optimizer, x, y):
    loss = F.cross_entropy(model(x), y)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return loss.detach()                                  # no .item(): reading it would sync every step
# --- pipeline: end ---


def _bar(done: int, total: int, epoch: int, epochs: int, started: float, images: int) -> None:
    """A one-line progress bar on stderr (no dependency beyond the standard library)."""
    width = 30
    filled = int(width * done / max(total, 1))
    rate = images / max(time.perf_counter() - started, 1e-9)
    sys.stderr.write(f"\repoch {epoch}/{epochs} [{'#' * filled}{'.' * (width - filled)}] "
                     f"{done}/{total} steps, {rate:,.0f} img/s ")
    sys.stderr.flush()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("data", type=Path, help="an ImageFolder: one subfolder of images per class")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--crop", type=int, default=64, help="training crop, in pixels")
    p.add_argument("--width", type=int, default=16, help="channels of the model's first stage (compute knob)")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--workers", type=int, default=WORKERS,
                   help="DataLoader worker processes (measure yours: chapter 04)")
    p.add_argument("--prefetch-factor", type=int, default=4)
    p.add_argument("--no-pin", dest="pin", action="store_false", help="pageable batches (no pin_memory)")
    p.add_argument("--no-persistent", dest="persistent", action="store_false",
                   help="start the workers again every epoch")
    p.add_argument("--float-on-host", action="store_true", help="normalise on the CPU, send float32")
    p.add_argument("--no-prefetcher", dest="prefetcher", action="store_false",
                   help="copy on the default stream, no side-stream prefetcher")
    p.add_argument("--device", default="auto", help="auto (CUDA when present), cpu, cuda or cuda:N")
    p.add_argument("--max-steps", type=int, default=0, help="stop each epoch after this many steps (0 = all)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if not args.data.is_dir():
        p.error(f"{args.data} is not a folder; give an ImageFolder (one subfolder of images per class)")
    for name, low in (("epochs", 1), ("batch_size", 1), ("crop", 8), ("width", 1), ("prefetch_factor", 1)):
        if getattr(args, name) < low:
            p.error(f"--{name.replace('_', '-')} must be at least {low}")
    if args.workers < 0 or args.max_steps < 0:
        p.error("--workers and --max-steps must be 0 or more")
    return args


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: --device cuda, but torch finds no CUDA device here (try --device cpu)")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise SystemExit(f"error: {name}: only {torch.cuda.device_count()} CUDA device(s) here")
    if device.type not in ("cpu", "cuda"):
        raise SystemExit(f"error: --device {name}: this script runs on cpu or cuda")
    return device


def main(argv: list[str] | None = None) -> int:
    global DEVICE, SEED
    args = parse_args(argv)
    DEVICE, SEED = pick_device(args.device), args.seed
    torch.manual_seed(args.seed)
    try:
        dataset = image_folder(args.data, args.crop)
    except (FileNotFoundError, RuntimeError) as exc:             # e.g. a folder with no images in it
        raise SystemExit(f"error: cannot read {args.data} as an ImageFolder: {exc}") from None
    if len(dataset) < args.batch_size:
        raise SystemExit(f"error: {len(dataset)} images is fewer than one batch of {args.batch_size}")
    loader = make_loader(dataset, args.batch_size, workers=args.workers, pin=args.pin,
                         prefetch_factor=args.prefetch_factor, persistent=args.persistent)
    model = small_cnn(len(dataset.classes), width=args.width).to(DEVICE)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    cuda = DEVICE.type == "cuda"
    print(f"{len(dataset)} images in {len(dataset.classes)} classes · device {DEVICE} · workers {args.workers} · "
          f"pin_memory {loader.pin_memory} · prefetcher {args.prefetcher and cuda and not args.float_on_host}")
    try:
        train(args, loader, model, optimizer)
    except OSError as exc:                                       # an unreadable or corrupt image file
        raise SystemExit(f"\nerror: an image could not be read: {exc}") from None
    return 0


def train(args: argparse.Namespace, loader: DataLoader, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """``args.epochs`` epochs, each timed, with a progress bar and one line per epoch."""
    steps_per_epoch = min(len(loader), args.max_steps or len(loader))
    for epoch in range(1, args.epochs + 1):
        model.train()
        started, images, total_loss, step = time.perf_counter(), 0, torch.zeros((), device=DEVICE), 0
        for step, (x, y) in enumerate(batches(loader, prefetch=args.prefetcher, float_on_host=args.float_on_host),
                                      start=1):
            total_loss += train_step(model, optimizer, x, y)
            images += x.shape[0]
            if step % 5 == 0 or step == steps_per_epoch:
                _bar(step, steps_per_epoch, epoch, args.epochs, started, images)
            if step >= steps_per_epoch:
                break
        if DEVICE.type == "cuda":
            torch.cuda.synchronize(DEVICE)                       # finish the epoch's GPU work before the clock
        seconds = time.perf_counter() - started
        sys.stderr.write("\n")
        print(f"epoch {epoch}: {step} steps, {images / seconds:,.0f} images/s, "
              f"mean loss {total_loss.item() / max(step, 1):.3f}")


if __name__ == "__main__":  # workers may re-import this file: keep the entry point behind this guard
    sys.exit(main())
