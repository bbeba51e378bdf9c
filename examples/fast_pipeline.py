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
(a test keeps them identical, and the same lines in the workbook's package are what its benchmark
times without the chapter). They read three globals, ``DEVICE``, ``WORKERS`` and ``SEED``,
which ``main()`` sets before it builds anything; the rest is the data set, the model, the
command line and the report.

It behaves as a command-line tool should: a bad argument or a bad data folder (one class folder, an
unreadable image: the line names the file) exits with status 2 and one line saying what to do; a worker
process that sleeps or is stopped for ``--timeout`` seconds ends the run with one line (status 1);
Ctrl-C stops the workers and exits with status 130. No worker process outlives the run.
"""

from __future__ import annotations

import os
import signal

if __name__ == "__main__":  # Ctrl-C while torch loads (seconds): one line and status 130, not a traceback
    signal.signal(signal.SIGINT, lambda *_: (os.write(2, b"\ninterrupted\n"), os._exit(130)))

import argparse
import functools
import math
import multiprocessing
import re
import sys
import threading
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F
from PIL import Image  # torchvision reads images with Pillow
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


class ImageError(OSError):
    """An image file that cannot be read; the message names the file."""


def load_rgb(path: str) -> Image.Image:
    """Open one image as 8-bit RGB. 16-bit greyscale (a 16-bit PNG) is scaled to 0-255, not clipped at 255."""
    try:
        with Image.open(path) as img:
            if img.mode.startswith("I"):                        # "I;16", "I": integer pixels, 0-65535
                img = img.convert("I").point(lambda v: v / 257).convert("L")
            return img.convert("RGB")
    except (OSError, ValueError, SyntaxError) as exc:         # not an image, truncated, unsupported
        raise ImageError(f"cannot read image {path}: {exc}") from None


class ImageFiles(datasets.ImageFolder):
    """``ImageFolder`` that visits each real folder once: a symlink loop is not followed round and round."""

    @staticmethod
    def make_dataset(directory, class_to_idx, extensions=None, is_valid_file=None, allow_empty=False):
        valid = is_valid_file or (lambda path: datasets.folder.has_file_allowed_extension(path, extensions))
        samples, seen = [], set()
        for name in sorted(class_to_idx):
            found = 0
            for root, dirs, files in os.walk(os.path.join(directory, name), followlinks=True):
                if os.path.realpath(root) in seen:              # a loop, or a folder linked twice
                    dirs[:] = []
                    continue
                seen.add(os.path.realpath(root))
                dirs.sort()
                paths = [os.path.join(root, f) for f in sorted(files)]
                samples += [(p, class_to_idx[name]) for p in paths if valid(p)]
                found += sum(1 for p in paths if valid(p))
            if not found and not allow_empty:
                raise FileNotFoundError(f"no image files in the class folder {os.path.join(directory, name)}")
        return samples


def image_folder(root: Path, crop: int) -> datasets.ImageFolder:
    """The images of ``root`` as uint8 CHW crops (1 byte per pixel on the link); ``normalize`` makes them float."""
    transform = v2.Compose([v2.PILToTensor(), v2.RandomResizedCrop(crop, antialias=True), v2.RandomHorizontalFlip()])
    return ImageFiles(str(root), transform=transform, loader=load_rgb)


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


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:                     # one line, exit status 2 (argparse's convention)
        sys.stderr.write(f"{self.prog}: error: {message} (--help for usage)\n")
        sys.exit(2)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, every value checked: a bad one exits with status 2 and one line saying what to do."""
    p = Parser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
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
    p.add_argument("--timeout", type=float, default=120.0,
                   help="seconds to wait for a batch from the workers (or for a stopped worker) before giving up")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if not args.data.is_dir():
        p.error(f"{args.data} is not a folder; give an ImageFolder (one subfolder of images per class)")
    cores = usable_cores()
    for name, low, high in (("epochs", 1, 10_000), ("batch_size", 1, 65_536), ("crop", 8, 2048), ("width", 1, 512),
                            ("prefetch_factor", 1, 64), ("workers", 0, max(8, 4 * cores)), ("max_steps", 0, None),
                            ("seed", 0, 2**63 - 1)):
        value = getattr(args, name)
        if value < low or (high is not None and value > high):
            where = f" ({cores} usable CPU cores here)" if name == "workers" else ""
            p.error(f"--{name.replace('_', '-')} {value}: give {low} to {high}{where}" if high is not None
                    else f"--{name.replace('_', '-')} {value}: give {low} or more")
    if not (math.isfinite(args.lr) and 0 < args.lr <= 10):
        p.error(f"--lr {args.lr}: give a learning rate above 0 and at most 10, e.g. 0.05")
    if not (math.isfinite(args.timeout) and 1 <= args.timeout <= 86_400):
        p.error(f"--timeout {args.timeout}: give 1 to 86400 seconds")
    if args.workers > cores:
        print(f"warning: --workers {args.workers} is more than the {cores} usable CPU cores; extra workers only "
              "add memory (measure: chapter 04)", file=sys.stderr)
    args.device = pick_device(args.device, p)
    return args


def pick_device(name: str, p: argparse.ArgumentParser) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if not re.fullmatch(r"cpu|cuda(:\d+)?", name):
        p.error(f"--device {name}: give auto, cpu, cuda or cuda:N (N = 0, 1, ...)")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error(f"--device {name}, but torch finds no CUDA device here (try --device cpu)")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        p.error(f"--device {name}: only {torch.cuda.device_count()} CUDA device(s) here")
    return device


def fail(message: str, status: int = 2) -> None:
    """Stop with one line on stderr (status 2: bad input or data; 1: the run failed)."""
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(status)


class StoppedWorkerWatch(threading.Thread):
    """Ends a worker process stopped (SIGSTOP, Ctrl-Z) longer than ``timeout`` s: the main process would wait for
    it for ever (a stopped worker still holds the batches it made). Linux only (reads /proc); elsewhere it idles."""

    def __init__(self, timeout: float) -> None:
        super().__init__(name="stopped-worker-watch", daemon=True)
        self.timeout, self.ended, self.done = timeout, [], threading.Event()

    def run(self) -> None:
        since: dict[int, float] = {}
        while not self.done.wait(min(0.5, self.timeout / 2)):
            for proc in multiprocessing.active_children():
                try:
                    stopped = Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in "Tt"
                except (OSError, IndexError):
                    continue
                if not stopped:
                    since.pop(proc.pid, None)
                elif time.monotonic() - since.setdefault(proc.pid, time.monotonic()) > self.timeout:
                    self.ended.append(proc.pid)
                    proc.kill()


class DeferredInterrupt:
    """Ctrl-C handler: KeyboardInterrupt at once, except while a worker process is being forked, the loader's
    iterator is being built, or a batch's shared memory is being handed over by a worker.

    In a fork it would be raised inside ``os.fork``'s callbacks, which swallow it ("Exception ignored") and may
    leave a lock held, so the next worker start hangs. Out of the iterator's ``__init__`` it leaves a half-built
    iterator whose ``__del__`` prints an AttributeError. In a hand-over (multiprocessing's resource_sharer) it
    cuts the worker's connection, and the worker prints a ConnectionResetError traceback. Such an interrupt is
    kept and raised after the step.
    """

    pending = False

    def __call__(self, signum: int, frame) -> None:
        while frame is not None:
            name, path = frame.f_code.co_name, frame.f_code.co_filename
            if (name == "start" and path.endswith("process.py")          # multiprocessing's Process.start()
                    or name == "__init__" and path.endswith("dataloader.py")  # the DataLoader's iterator
                    or path.endswith("resource_sharer.py")):             # a batch's file descriptors
                self.pending = True
                return
            frame = frame.f_back
        raise KeyboardInterrupt

    def check(self) -> None:
        if self.pending:
            raise KeyboardInterrupt


INTERRUPT = DeferredInterrupt()


def end_workers(grace: float = 2.0) -> None:
    """Stop every worker process still running (SIGTERM, then SIGKILL after ``grace`` s): none outlives the run."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)              # workers ending now are expected (torch's check off)
    children = multiprocessing.active_children()
    for proc in children:
        proc.terminate()
    deadline = time.monotonic() + grace
    for proc in children:
        proc.join(max(0.0, deadline - time.monotonic()))
        if proc.is_alive():
            proc.kill()
            proc.join(1.0)


def explain(exc: BaseException, watch: StoppedWorkerWatch, timeout: float) -> tuple[str, int] | None:
    """One line (and the exit status) for a failure of the data or of the workers; None for anything else."""
    text = str(exc)
    image = re.findall(r"cannot read image .*", text)           # the last one: a worker's error quotes the source
    if image:
        return image[-1].strip(), 2
    if watch.ended:
        return (f"a worker process was stopped (SIGSTOP or Ctrl-Z) for more than {timeout:g} s; it was ended "
                f"(pid {', '.join(map(str, watch.ended))}) and the run stopped"), 1
    if "timed out after" in text:
        return (f"no batch came from the worker processes in {timeout:g} s: one is stopped (SIGSTOP, Ctrl-Z), "
                "frozen or very slow (check with top; --workers 0 loads in this process; --timeout sets the wait)"), 1
    if "DataLoader worker" in text:
        return ("a worker process died (the out-of-memory killer, a full /dev/shm: df -h /dev/shm, or a crash in "
                "an image decoder; --workers 0 shows the error in this process)"), 1
    return None


def main(argv: list[str] | None = None) -> int:
    global DEVICE, SEED
    args = parse_args(argv)
    DEVICE, SEED = args.device, args.seed
    torch.manual_seed(args.seed)
    try:
        dataset = image_folder(args.data, args.crop)
    except (FileNotFoundError, RuntimeError) as exc:             # e.g. a folder with no images in it
        fail(f"cannot read {args.data} as an ImageFolder: {exc}")
    if len(dataset.classes) < 2:
        fail(f"{args.data} has {len(dataset.classes)} class folder ({', '.join(dataset.classes)}): a classifier "
             "needs at least 2, one subfolder of images per class")
    if len(dataset) < args.batch_size:
        fail(f"{len(dataset)} images is fewer than one batch of {args.batch_size} (use a smaller --batch-size)")
    loader = make_loader(dataset, args.batch_size, workers=args.workers, pin=args.pin,
                         prefetch_factor=args.prefetch_factor, persistent=args.persistent)
    loader.timeout = args.timeout if args.workers > 0 else 0   # a frozen worker ends in an error, not a hang
    model = small_cnn(len(dataset.classes), width=args.width).to(DEVICE)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    cuda = DEVICE.type == "cuda"
    print(f"{len(dataset)} images in {len(dataset.classes)} classes · device {DEVICE} · workers {args.workers} · "
          f"pin_memory {loader.pin_memory} · prefetcher {args.prefetcher and cuda and not args.float_on_host}",
          flush=True)
    watch = StoppedWorkerWatch(args.timeout)
    watch.start()
    signal.signal(signal.SIGINT, INTERRUPT)
    status, message = 0, None
    try:
        train(args, loader, model, optimizer)
    except KeyboardInterrupt as exc:                            # Ctrl-C: stop the workers, one line, status 130
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        traceback.clear_frames(exc.__traceback__)
        status, message = 130, "interrupted; the worker processes were stopped"
    except (RuntimeError, OSError) as exc:                      # a bad image file, a frozen or dead worker
        traceback.clear_frames(exc.__traceback__)               # lets go of the loader's iterator in those frames
        found = explain(exc, watch, args.timeout)
        if found is None:
            raise
        message, status = found
    finally:
        watch.done.set()
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        del loader
        end_workers()
    if message is not None:
        print(f"\n{'error: ' if status != 130 else ''}{message}", file=sys.stderr)
    return status


def train(args: argparse.Namespace, loader: DataLoader, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """``args.epochs`` epochs, each timed, with a progress bar and one line per epoch."""
    steps_per_epoch = min(len(loader), args.max_steps or len(loader))
    for epoch in range(1, args.epochs + 1):
        model.train()
        started, images, total_loss, step = time.perf_counter(), 0, torch.zeros((), device=DEVICE), 0
        for step, (x, y) in enumerate(batches(loader, prefetch=args.prefetcher, float_on_host=args.float_on_host),
                                      start=1):
            INTERRUPT.check()                                    # a Ctrl-C that came while a worker started
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
    try:
        sys.exit(main())
    except KeyboardInterrupt:                                   # Ctrl-C before or after training
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        end_workers()
        print("\ninterrupted", file=sys.stderr)
        sys.exit(130)
