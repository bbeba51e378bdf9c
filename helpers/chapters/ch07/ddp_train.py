"""The script torchrun starts once per rank (chapter 07): DDP training of the chapter-01 model on the chapter-06
pipeline over a ``DistributedSampler``, then ``rank<R>.json`` (indices loaded per epoch, items/s, loss, accuracy,
a parameter checksum), or ``rank<R>.error.json`` first if it fails, so the launcher can name the root cause.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import hashlib
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Sequence

import psutil
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import Dataset
from torch.utils.data.distributed import DistributedSampler

from ...pipeline.data import MEAN, STD, ShapesDataset, default_sizes, make_shapes_dataset, to_float_normalized
from ...pipeline.loaders import build_loader
from ...pipeline.models import build_model
from ...pipeline.prefetch import Prefetcher

SEED, LR = 0, 0.05  # the data order and the model (every rank alike); SGD with momentum 0.9


class InjectedFailure(RuntimeError):
    """The error ``--fail-rank`` raises on purpose (the failure-handling demo)."""


class IndexedDataset(Dataset):
    """``(*item, index)`` for ``size`` items strided over ``base`` (a class-sorted folder keeps every class);
    the index lets the coverage check count what the ranks loaded."""

    def __init__(self, base: Any, size: int | None = None) -> None:
        self.base, self.size = base, len(base) if size is None else max(0, min(int(size), len(base)))

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[Any, ...]:
        if not 0 <= index < self.size:
            raise IndexError(f"index {index} out of range for {self.size} items")
        return (*self.base[index * len(self.base) // self.size], index)


def params_checksum(model: torch.nn.Module) -> str:
    """SHA-256 (16 hex digits) of all parameters' bytes."""
    flat = torch.nn.utils.parameters_to_vector(model.parameters()).detach().to("cpu", torch.float32)
    return hashlib.sha256(flat.numpy().tobytes()).hexdigest()[:16]


@torch.no_grad()
def evaluate_shared(
    model: torch.nn.Module, dataset: Any, device: torch.device, *, rank: int = 0, world: int = 1, batch_size: int = 64
) -> tuple[int, int]:
    """Top-1 ``(correct, total)`` on items ``rank, rank + world, ...`` of ``dataset`` (each once over the ranks)."""
    was_training = model.training
    model.eval()
    mine, correct = list(range(rank, len(dataset), world)), 0
    try:
        for start in range(0, len(mine), batch_size):
            items = [dataset[i] for i in mine[start : start + batch_size]]
            images = torch.stack([it[0] for it in items]).to(device)
            labels = torch.tensor([int(it[1]) for it in items], device=device)
            correct += int((model(to_float_normalized(images)).argmax(1) == labels).sum())
    finally:
        model.train(was_training)
    return correct, len(mine)


def _at_least(lo: int) -> Callable[[str], int]:
    """An argparse type: an integer >= ``lo`` (the script is also run by hand, on several machines)."""

    def parse(text: str) -> int:
        if int(text) < lo:
            raise argparse.ArgumentTypeError(f"must be >= {lo}, got {text}")
        return int(text)

    return parse


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m helpers.chapters.ch07.ddp_train", description=__doc__.split(":")[0])
    add = p.add_argument
    add("--out", required=True, help="folder for rank<R>.json result files")
    add("--data-dir", default=None, help="class-folder root (default: generate the chapter-01 train set)")
    add("--limit", type=_at_least(1), default=None, help="use N training images spread over the set (every class)")
    add("--val-dir", default=None, help="held-out class-folder root (default: the chapter-01 one, without --data-dir)")
    add("--epochs", type=_at_least(1), default=2)
    add("--batch-size", type=_at_least(1), default=32, help="per rank (the global batch is this x world size)")
    add("--workers", type=_at_least(0), default=0, help="DataLoader worker processes per rank")
    add("--crop-size", type=int, default=None)
    add("--width", type=_at_least(1), default=8, help="SmallCNN width (compute knob)")
    add("--fail-rank", type=int, default=-1, help="this rank raises InjectedFailure at its second step (demo)")
    return p.parse_args(argv)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)  # atomic: the launcher never reads half a file


def _epoch(
    args: argparse.Namespace, me: dict[str, Any], ddp: Any, opt: Any, batches: Any, epoch: int
) -> dict[str, Any]:
    device, seen = me["device"], []
    # Sums stay on the device: no .item() in the step loop, so the CPU never waits for the GPU (chapter 05).
    loss_sum, n_items, t0 = torch.zeros((), device=device), 0, time.perf_counter()
    for images, labels, idx in batches:
        labels = labels.to(device, non_blocking=True)  # images: moved and normalised by the prefetcher
        if me["rank"] == args.fail_rank and me["step"] >= 1:
            raise InjectedFailure(f"rank {me['rank']} failed on purpose at step {me['step']} (--fail-rank)")
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(ddp(images), labels)
        loss.backward()  # DDP all-reduces (averages) gradients across ranks here
        opt.step()
        seen.append(idx)
        loss_sum += loss.detach() * len(labels)
        n_items += len(labels)
        me["step"] += 1
        done, total = me["step"], me["total_steps"]
        if me["rank"] == 0 and (done == total or time.time() - me["shown"] >= 0.1):  # for the launcher's progress
            me["shown"] = time.time()  # (10 times a second at most)
            _write_json(Path(args.out) / "progress.json", {"done": done, "total": total, "epoch": epoch})
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds, mean_loss = time.perf_counter() - t0, float(loss_sum) / max(n_items, 1)
    indices = torch.cat(seen).tolist() if seen else []
    return {"epoch": epoch, "indices": indices, "n_items": n_items, "seconds": seconds, "loss": mean_loss}


def _validate(me: dict[str, Any], model: torch.nn.Module, val_set: Any, batch_size: int) -> dict[str, Any]:
    # BatchNorm's running statistics are each rank's own (DDP broadcasts them from rank 0 before every forward,
    # then each rank updates them): score the model rank 0 holds, on every rank.
    for buf in model.buffers():
        dist.broadcast(buf, 0)
    counts = evaluate_shared(model, val_set, me["device"], rank=me["rank"], world=me["world"], batch_size=batch_size)
    summed = torch.tensor(counts, device=me["device"])  # on the device: nccl reduces CUDA tensors
    dist.all_reduce(summed)
    hits, scored = summed.tolist()
    return {"val_accuracy": hits / scored if scored else None, "val_items": scored}


def train(args: argparse.Namespace) -> dict[str, Any]:
    rank, local, world = (int(os.environ.get(k) or d) for k, d in (("RANK", 0), ("LOCAL_RANK", 0), ("WORLD_SIZE", 1)))
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(local)  # before anything touches CUDA: pins, streams, NCCL
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo", timeout=_dt.timedelta(seconds=60))
    crop = args.crop_size or default_sizes()["crop_size"]
    info = None if args.data_dir else make_shapes_dataset()
    root = Path(args.data_dir) if info is None else info.train_dir
    val_root = args.val_dir or (info.val_dir if info else None)
    base = ShapesDataset(root, crop_size=crop, augment=True, output="uint8")
    dataset = IndexedDataset(base, args.limit)  # spread over every class, never the first N (class-sorted)
    # the taught lines: each rank its share, the same shuffle (seed + epoch) on every rank
    sampler: DistributedSampler[int] = DistributedSampler(
        dataset, num_replicas=world, rank=rank, shuffle=True, seed=SEED
    )
    loader = build_loader(
        dataset,
        batch_size=args.batch_size,
        num_workers=args.workers,
        persistent_workers=args.workers > 0,
        pin_memory=cuda,
        shuffle=False,
        seed=SEED + rank,
        sampler=sampler,
    )
    batches = Prefetcher(loader, device, normalize=(MEAN, STD))
    model = build_model(width=args.width, num_classes=len(base.classes), seed=SEED).to(device)
    ddp = DistributedDataParallel(model, device_ids=[local] if cuda else None)
    opt = torch.optim.SGD(ddp.parameters(), lr=LR, momentum=0.9)
    me = {"rank": rank, "world": world, "device": device, "step": 0, "total_steps": len(loader) * args.epochs}
    me["shown"] = 0.0  # when rank 0 last wrote its step
    torch.manual_seed(SEED + 1000 * (rank + 1))  # augmentation in the main process (workers=0) draws from it
    train_start = time.time()
    try:
        epochs = []
        for epoch in range(args.epochs):
            sampler.set_epoch(epoch)  # a new shuffle every epoch, the same on every rank
            ddp.train()
            epochs.append(_epoch(args, me, ddp, opt, batches, epoch))
    finally:
        del batches, loader  # stop this rank's workers now (persistent workers live as long as the iterator)
    train_end = time.time()
    val: dict[str, Any] = {"val_accuracy": None, "val_items": 0}
    if val_root is not None:
        val_set = ShapesDataset(Path(val_root), crop_size=crop, augment=False, output="uint8")
        val = _validate(me, model, val_set, 2 * args.batch_size)
    dist.barrier()
    return {
        **{"rank": rank, "world_size": world, "backend": dist.get_backend(), "device": str(device)},
        **{"workers": args.workers, "batch_size": args.batch_size, "pin_memory": cuda, "prefetcher": True},
        **{"dataset_size": len(dataset), "num_classes": len(base.classes), **val, "samples_per_rank": len(sampler)},
        "epochs": epochs,
        "startup_s": train_start - psutil.Process().create_time(),  # process start -> first batch (imports, setup)
        "train_s": train_end - train_start,
        "params_checksum": params_checksum(model),
    }


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    out, rank = Path(args.out), int(os.environ.get("RANK") or 0)
    out.mkdir(parents=True, exist_ok=True)
    try:
        _write_json(out / f"rank{rank}.json", train(args))
        return 0
    except Exception as exc:  # record the root cause for the launcher, then fail loudly
        error = {"rank": rank, "error_type": type(exc).__name__, "error_message": str(exc), "time": time.time()}
        _write_json(out / f"rank{rank}.error.json", {**error, "rank_traceback": traceback.format_exc()})
        raise
    finally:
        if dist.is_initialized():
            with contextlib.suppress(Exception):  # a broken group can't be torn down cleanly; the process exits
                dist.destroy_process_group()


if __name__ == "__main__":
    from torch.distributed.elastic.multiprocessing.errors import record

    sys.exit(record(main)())
