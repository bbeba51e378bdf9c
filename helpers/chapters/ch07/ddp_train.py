"""The script torchrun starts once per rank (chapter 07; :func:`.distributed.launch_ddp` runs it).

A rank reads who it is from torchrun's environment (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``), joins the group
(``nccl`` with one GPU per rank, after ``torch.cuda.set_device(LOCAL_RANK)`` so the pin thread and the prefetcher's
stream are this rank's; else ``gloo``), trains the chapter-01 model with DDP through the chapter-06 pipeline over
a ``DistributedSampler``, scores held-out images (each rank its share, counts summed) and writes ``rank<R>.json``:
the indices it loaded per epoch, items/s, loss, accuracy and a checksum of its parameters. A failing rank writes
``rank<R>.error.json`` first, so the launcher can name the root cause; ``--fail-rank K`` makes rank K fail.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import hashlib
import json
import os
import socket
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Sequence

import psutil
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import Dataset
from torch.utils.data.distributed import DistributedSampler

from ...pipeline.data import (
    MEAN,
    STD,
    ShapesDataset,
    default_sizes,
    make_shapes_dataset,
    seed_worker,
    to_float_normalized,
)
from ...pipeline.loaders import LoaderConfig, build_loader
from ...pipeline.models import build_model
from ...pipeline.prefetch import Prefetcher


class InjectedFailure(RuntimeError):
    """The error ``--fail-rank`` raises on purpose (the failure-handling demo)."""


class IndexedDataset(Dataset):
    """``(*item, index)`` for ``size`` items spread evenly over ``base`` (item ``i`` is ``i * len(base) // size``:
    a class-sorted folder keeps every class); the index lets the coverage check count what the ranks loaded."""

    def __init__(self, base: Any, size: int | None = None) -> None:
        self.base = base
        self.size = len(base) if size is None else max(0, min(int(size), len(base)))

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[Any, ...]:
        if not 0 <= index < self.size:
            raise IndexError(f"index {index} out of range for {self.size} items")
        item = self.base[index * len(self.base) // self.size]
        return (*(item if isinstance(item, tuple) else (item,)), index)


def params_checksum(model: torch.nn.Module) -> str:
    """SHA-256 (first 16 hex digits) of all parameters' bytes: equal replicas give equal sums."""
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


@torch.no_grad()
def evaluate_shared(
    model: torch.nn.Module,
    dataset: Any,
    device: torch.device,
    *,
    rank: int = 0,
    world: int = 1,
    batch_size: int = 64,
    reduce: bool = True,
) -> tuple[int, int]:
    """Top-1 ``(correct, total)`` on ``dataset`` (items ``(uint8 image, label, ...)``), this rank scoring items
    ``rank, rank + world, ...``: every item once, no padding. With ``reduce`` the counts are summed over the ranks."""
    was_training = model.training
    model.eval()
    counts = torch.zeros(2, dtype=torch.int64, device=device)  # on the device: nccl reduces CUDA tensors
    mine = list(range(rank, len(dataset), world))
    try:
        for start in range(0, len(mine), batch_size):
            items = [dataset[i] for i in mine[start : start + batch_size]]
            images = torch.stack([it[0] for it in items]).to(device)
            labels = torch.tensor([int(it[1]) for it in items], device=device)
            counts[0] += (model(to_float_normalized(images)).argmax(1) == labels).sum()
            counts[1] += len(items)
    finally:
        model.train(was_training)
    if reduce and world > 1:
        dist.all_reduce(counts)  # sums over ranks
    return int(counts[0]), int(counts[1])


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command-line options (``python -m helpers.chapters.ch07.ddp_train --help``)."""
    p = argparse.ArgumentParser(prog="python -m helpers.chapters.ch07.ddp_train", description=__doc__.split("\n")[0])
    add = p.add_argument
    add("--out", required=True, help="folder for rank<R>.json result files")
    add("--data-dir", default=None, help="class-folder root (default: generate the chapter-01 train set)")
    add("--limit", type=int, default=None, help="use N training images spread evenly over the set (every class)")
    add("--val-dir", default=None, help="held-out class-folder root (default: the chapter-01 validation set)")
    add("--val-limit", type=int, default=None, help="score N validation images spread evenly over the set")
    add("--no-val", action="store_true", help="skip the validation pass")
    add("--epochs", type=int, default=2)
    add("--batch-size", type=int, default=32, help="per rank (the global batch is this x world size)")
    add("--workers", type=int, default=0, help="DataLoader worker processes per rank")
    add("--crop-size", type=int, default=None)
    add("--width", type=int, default=8, help="SmallCNN width (compute knob)")
    add("--lr", type=float, default=0.05)
    add("--seed", type=int, default=0)
    add("--no-set-epoch", action="store_true", help="forget sampler.set_epoch (the bug)")
    add("--drop-last", action="store_true", help="DistributedSampler(drop_last=True)")
    add("--fail-rank", type=int, default=-1, help="this rank raises InjectedFailure at its second step (demo)")
    args = p.parse_args(argv)
    lowest = {"epochs": 1, "batch_size": 1, "workers": 0, "width": 1, "limit": 1, "val_limit": 1}
    for name, lo in lowest.items():
        if getattr(args, name) is not None and getattr(args, name) < lo:
            p.error(f"--{name.replace('_', '-')} must be >= {lo}, got {getattr(args, name)}")
    return args


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    return int(raw) if raw else default


def _write_json(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)  # atomic: the launcher never reads half a file


_last_progress = [0.0]


def _progress(out: Path, rank: int, done: int, total: int, epoch: int) -> None:
    """Rank 0 reports its step for the launcher's progress bar (at most 10 times a second)."""
    now = time.time()
    if rank == 0 and (done in (1, total) or now - _last_progress[0] >= 0.1):
        _last_progress[0] = now
        _write_json(out / "progress.json", {"done": done, "total": total, "epoch": epoch, "time": now})


def _join(args: argparse.Namespace) -> dict[str, Any]:
    """This rank's identity and device, after joining the process group."""
    me: dict[str, Any] = {
        "rank": _env_int("RANK", 0),
        "local_rank": _env_int("LOCAL_RANK", 0),
        "world_size": _env_int("WORLD_SIZE", 1),
    }
    cuda = torch.cuda.is_available()
    me["backend"] = "nccl" if cuda else "gloo"
    if cuda:
        torch.cuda.set_device(me["local_rank"])  # before anything touches CUDA: pins, streams, NCCL
    me["device"] = torch.device("cuda", me["local_rank"]) if cuda else torch.device("cpu")
    dist.init_process_group(me["backend"], timeout=_dt.timedelta(seconds=60))
    return me


def _loader(args: argparse.Namespace, me: dict[str, Any], dataset: Dataset) -> tuple[Any, DistributedSampler[int]]:
    """The rank's DataLoader over its DistributedSampler, built like every worker loader of the workbook."""
    # the rank and world size come from the process group; it shuffles by default, the same on every rank
    sampler: DistributedSampler[int] = DistributedSampler(dataset, seed=args.seed, drop_last=args.drop_last)
    with_workers: dict[str, Any] = {"persistent_workers": True, "prefetch_factor": 2} if args.workers else {}
    config = LoaderConfig(
        batch_size=args.batch_size,
        num_workers=args.workers,
        pin_memory=me["device"].type == "cuda",  # the pin thread pins for this rank's current device
        shuffle=False,  # the sampler shuffles; the loader's own shuffle must stay off
        seed=args.seed + me["rank"],  # different worker seeds per rank
        **with_workers,
    )
    return build_loader(dataset, config, sampler=sampler, worker_init_fn=seed_worker if args.workers else None), sampler


def _epoch(
    args: argparse.Namespace, me: dict[str, Any], ddp: Any, opt: Any, batches: Any, epoch: int
) -> dict[str, Any]:
    """One epoch of DDP training; the step count so far is ``me["step"]``."""
    device, cuda = me["device"], me["device"].type == "cuda"
    seen: list[torch.Tensor] = []
    # Sums stay on the device: no .item() in the step loop, so the CPU never waits for the GPU (chapter 05).
    loss_sum = torch.zeros((), device=device)
    n_items, t0 = 0, time.perf_counter()
    for images, labels, idx in batches:
        labels = labels.to(device, non_blocking=cuda)  # images: moved and normalised by the prefetcher
        if me["rank"] == args.fail_rank and epoch == 0 and me["step"] >= 1:
            raise InjectedFailure(
                f"rank {me['rank']} failed on purpose at step {me['step']} (--fail-rank {args.fail_rank})"
            )
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(ddp(images), labels)
        loss.backward()  # DDP all-reduces (averages) gradients across ranks here
        opt.step()
        seen.append(idx)
        loss_sum += loss.detach() * len(labels)
        n_items += len(labels)
        me["step"] += 1
        _progress(Path(args.out), me["rank"], me["step"], me["total_steps"], epoch)
    if cuda:
        torch.cuda.synchronize(device)
    seconds, mean_loss = time.perf_counter() - t0, float(loss_sum) / max(n_items, 1)
    indices = torch.cat(seen).tolist() if seen else []
    return {"epoch": epoch, "indices": indices, "n_items": n_items, "seconds": seconds, "loss": mean_loss}


def _validate(
    args: argparse.Namespace, me: dict[str, Any], model: torch.nn.Module, root: Path, crop: int
) -> dict[str, Any]:
    """Validation accuracy of rank 0's model on the held-out images, every rank scoring its share."""
    # BatchNorm's running statistics are each rank's own (DDP broadcasts them from rank 0 before every
    # forward, then each rank updates them): score the model rank 0 holds, on every rank.
    for buf in model.buffers():
        dist.broadcast(buf, 0)
    val_set = IndexedDataset(ShapesDataset(root, crop_size=crop, augment=False, output="uint8"), args.val_limit)
    hits, scored = evaluate_shared(
        model, val_set, me["device"], rank=me["rank"], world=me["world_size"], batch_size=2 * args.batch_size
    )
    return {"val_accuracy": hits / scored if scored else None, "val_items": scored}


def train(args: argparse.Namespace) -> dict[str, Any]:
    """One rank's whole job; returns the record written to ``rank<R>.json``."""
    me = _join(args)
    device, cuda = me["device"], me["device"].type == "cuda"
    crop = args.crop_size or default_sizes()["crop_size"]
    if args.data_dir:
        root, val_root = Path(args.data_dir), Path(args.val_dir) if args.val_dir else None
    else:
        info = make_shapes_dataset()
        root, val_root = info.train_dir, Path(args.val_dir) if args.val_dir else info.val_dir
    base = ShapesDataset(root, crop_size=crop, augment=True, output="uint8")
    dataset = IndexedDataset(base, args.limit)  # spread over every class, never the first N (class-sorted)
    loader, sampler = _loader(args, me, dataset)
    batches = Prefetcher(loader, device, normalize=(MEAN, STD))
    model = build_model(width=args.width, num_classes=len(base.classes), seed=args.seed).to(device)
    ddp = DistributedDataParallel(model, device_ids=[me["local_rank"]] if cuda else None)
    opt = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=0.9)
    me.update(step=0, total_steps=len(loader) * args.epochs)
    # Augmentation in the main process (workers=0) draws from the global generator: seed it per rank.
    torch.manual_seed(args.seed + 1000 * (me["rank"] + 1))
    train_start = time.time()
    try:
        epochs = []
        for epoch in range(args.epochs):
            if not args.no_set_epoch:
                sampler.set_epoch(epoch)  # a new shuffle every epoch, the same on every rank
            ddp.train()
            epochs.append(_epoch(args, me, ddp, opt, batches, epoch))
    finally:
        del batches, loader  # stop this rank's workers now (persistent workers live as long as the iterator)
    train_end = time.time()
    val: dict[str, Any] = {"val_accuracy": None, "val_items": 0}
    if val_root is not None and not args.no_val:
        val = _validate(args, me, model, val_root, crop)
    dist.barrier()
    return {
        **{k: me[k] for k in ("rank", "local_rank", "world_size", "backend")},
        **{k: getattr(args, k) for k in ("workers", "batch_size", "drop_last")},
        **{"device": str(device), "host": socket.gethostname(), "pin_memory": cuda},
        **{"prefetcher": True, "set_epoch": not args.no_set_epoch},
        "dataset_size": len(dataset),
        "num_classes": len(base.classes),
        **val,
        "samples_per_rank": len(sampler),
        "epochs": epochs,
        "startup_s": train_start - psutil.Process().create_time(),  # process start -> first batch (imports, setup)
        "train_s": train_end - train_start,
        "params_checksum": params_checksum(model),
    }


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point for one rank: train, write ``rank<R>.json`` (or ``rank<R>.error.json``)."""
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rank = _env_int("RANK", 0)
    try:
        _write_json(out / f"rank{rank}.json", train(args))
        return 0
    except Exception as exc:  # record the root cause for the launcher, then fail loudly
        error = {"rank": rank, "type": type(exc).__name__, "message": str(exc), "time": time.time()}
        _write_json(out / f"rank{rank}.error.json", {**error, "traceback": traceback.format_exc(), "pid": os.getpid()})
        raise
    finally:
        if dist.is_available() and dist.is_initialized():
            with contextlib.suppress(Exception):  # a broken group can't be torn down cleanly; the process exits
                dist.destroy_process_group()


if __name__ == "__main__":
    from torch.distributed.elastic.multiprocessing.errors import record

    sys.exit(record(main)())
