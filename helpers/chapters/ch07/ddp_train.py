"""The worker script that ``torchrun`` starts once per rank (chapter 07).

Run it through the launcher, never directly::

    python -m torch.distributed.run --standalone --nproc-per-node 2 \\
        -m helpers.chapters.ch07.ddp_train --out /tmp/run --epochs 2 --batch-size 32

:func:`helpers.chapters.ch07.distributed.launch_ddp` builds that command, runs it and reads
the results. Each rank:

1. reads its identity from the environment torchrun sets (``RANK``,
   ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT``);
2. joins the process group: ``nccl`` with one GPU per rank when CUDA is
   present (``torch.cuda.set_device(LOCAL_RANK)`` *first*, so the DataLoader's
   pin-memory thread and the prefetcher's stream belong to this rank's GPU),
   else ``gloo`` on the CPU;
3. builds the chapter-01 data set and model, and the chapter-06 pipeline:
   uint8 images, DataLoader workers, ``pin_memory`` only with CUDA, and the
   chapter-05 :class:`~helpers.pipeline.prefetch.Prefetcher` normalising on the device
   (it passes batches through on a CPU);
4. shards the data with :class:`~torch.utils.data.DistributedSampler` and calls
   ``sampler.set_epoch(epoch)`` before every epoch (``--no-set-epoch`` leaves it
   out, to show the bug);
5. trains a :class:`~torch.nn.parallel.DistributedDataParallel` model;
6. measures validation accuracy on held-out images (``--val-dir``; each rank
   scores its own share, the counts are summed across ranks), so a run shows
   that the job **learns**, beside the chance level ``1 / classes``;
7. writes ``rank<R>.json`` into ``--out``: the sample indices it saw in every
   epoch, items/s, loss, the validation accuracy, and a checksum of its
   parameters (equal on every rank if DDP kept the replicas in sync).

``--limit`` and ``--val-limit`` keep a subset spread evenly over the data set
(:class:`IndexedDataset`): the class folders are listed in order, so the
*first* N images would hold only the first classes, and the model could not
beat chance.

If a rank fails, it writes ``rank<R>.error.json`` (exception type, message,
traceback, time) before exiting non-zero, so the launcher can name the root
cause in plain words. ``--fail-rank K`` makes rank ``K`` raise on purpose.
"""

from __future__ import annotations

import argparse
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

import torch
import torch.distributed as dist
from torch.utils.data import Dataset

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

__all__ = ["IndexedDataset", "InjectedFailure", "parse_args", "main", "params_checksum", "evaluate_shared"]


class InjectedFailure(RuntimeError):
    """The error ``--fail-rank`` raises on purpose (the failure-handling demo)."""


class IndexedDataset(Dataset):
    """Wrap a map-style dataset so each item also carries its index: ``(*item, index)``.

    The training loop records these indices, so the coverage check counts what
    the ranks really loaded, not what the sampler promised. Picklable (workers).

    ``size`` keeps a subset of ``size`` items spread evenly over the base data
    set (so a class-sorted folder keeps every class); item ``i`` of the subset
    is base item ``i * len(base) // size``.
    """

    def __init__(self, base: Any, size: int | None = None) -> None:
        self.base = base
        n = len(base)
        self.size = n if size is None else max(0, min(int(size), n))

    def __len__(self) -> int:
        return self.size

    def base_index(self, index: int) -> int:
        """The base data set's index of subset item ``index``."""
        return index * len(self.base) // self.size

    def __getitem__(self, index: int) -> tuple[Any, ...]:
        if not 0 <= index < self.size:
            raise IndexError(f"index {index} out of range for {self.size} items")
        item = self.base[self.base_index(index)]
        if not isinstance(item, tuple):
            item = (item,)
        return (*item, index)


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
    """Top-1 ``(correct, total)`` of ``model`` on ``dataset``, this rank scoring items ``rank, rank + world, ...``.

    The shares are disjoint and cover every item once (no padding, unlike ``DistributedSampler``), and with
    ``reduce`` the two counts are summed over all ranks (``all_reduce``), so every rank returns the same,
    whole-set figures. Items are ``(uint8 image, label, ...)``; the images are normalised on ``device``.
    The model is put in eval mode and restored after.
    """
    was_training = model.training
    model.eval()
    counts = torch.zeros(2, dtype=torch.int64, device=device)
    mine = list(range(rank, len(dataset), world))
    try:
        for start in range(0, len(mine), batch_size):
            items = [dataset[i] for i in mine[start : start + batch_size]]
            images = torch.stack([it[0] for it in items]).to(device)
            labels = torch.tensor([int(it[1]) for it in items], device=device)
            logits = model(to_float_normalized(images))
            counts[0] += (logits.argmax(1) == labels).sum()
            counts[1] += len(items)
    finally:
        model.train(was_training)
    if reduce and world > 1:
        dist.all_reduce(counts)  # sums over ranks
    return int(counts[0]), int(counts[1])


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command-line options (see ``python -m helpers.chapters.ch07.ddp_train --help``)."""
    p = argparse.ArgumentParser(prog="python -m helpers.chapters.ch07.ddp_train", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="folder for rank<R>.json result files")
    p.add_argument("--data-dir", default=None, help="class-folder root (default: generate the chapter-01 train set)")
    p.add_argument(
        "--limit", type=int, default=None, help="use N training images spread evenly over the set (every class)"
    )
    p.add_argument(
        "--val-dir", default=None, help="held-out class-folder root (default: the chapter-01 validation set)"
    )
    p.add_argument("--val-limit", type=int, default=None, help="score N validation images spread evenly over the set")
    p.add_argument("--no-val", action="store_true", help="skip the validation pass")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=32, help="per rank (the global batch is this x world size)")
    p.add_argument("--workers", type=int, default=0, help="DataLoader worker processes per rank")
    p.add_argument("--prefetch-factor", type=int, default=2)
    p.add_argument("--crop-size", type=int, default=None)
    p.add_argument("--width", type=int, default=8, help="SmallCNN width (compute knob)")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--backend", choices=("auto", "gloo", "nccl"), default="auto")
    p.add_argument("--no-set-epoch", action="store_true", help="forget sampler.set_epoch (the bug)")
    p.add_argument("--drop-last", action="store_true", help="DistributedSampler(drop_last=True)")
    p.add_argument("--no-shuffle", action="store_true")
    p.add_argument("--no-prefetcher", action="store_true", help="move batches without the chapter-05 prefetcher")
    p.add_argument("--fail-rank", type=int, default=-1, help="this rank raises InjectedFailure (demo)")
    p.add_argument("--fail-step", type=int, default=1, help="at this step of the first epoch")
    p.add_argument("--pg-timeout-s", type=float, default=60.0, help="process-group collective timeout")
    args = p.parse_args(argv)
    for name, lo in (("epochs", 1), ("batch_size", 1), ("workers", 0), ("prefetch_factor", 1), ("width", 1)):
        if getattr(args, name) < lo:
            p.error(f"--{name.replace('_', '-')} must be >= {lo}, got {getattr(args, name)}")
    for name in ("limit", "val_limit"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    return args


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    return int(raw) if raw not in (None, "") else default


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


def train(args: argparse.Namespace) -> dict[str, Any]:
    """One rank's whole job; returns the record written to ``rank<R>.json``."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data.distributed import DistributedSampler

    rank = _env_int("RANK", 0)
    world = _env_int("WORLD_SIZE", 1)
    local_rank = _env_int("LOCAL_RANK", 0)
    out = Path(args.out)

    cuda = torch.cuda.is_available()
    backend = args.backend if args.backend != "auto" else ("nccl" if cuda else "gloo")
    if cuda:
        torch.cuda.set_device(local_rank)  # before anything touches CUDA: pins, streams, NCCL
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    t_start = time.perf_counter()
    dist.init_process_group(backend, timeout=_dt.timedelta(seconds=args.pg_timeout_s))
    t_joined = time.perf_counter()

    sizes = default_sizes()
    crop = args.crop_size or sizes["crop_size"]
    if args.data_dir:
        root, val_root = Path(args.data_dir), Path(args.val_dir) if args.val_dir else None
    else:
        info = make_shapes_dataset()
        root, val_root = info.train_dir, Path(args.val_dir) if args.val_dir else info.val_dir
    base = ShapesDataset(root, crop_size=crop, augment=True, output="uint8")
    dataset = IndexedDataset(base, args.limit)  # spread over every class, never the first N (class-sorted)
    sampler: DistributedSampler[int] = DistributedSampler(
        dataset, num_replicas=world, rank=rank, shuffle=not args.no_shuffle, seed=args.seed, drop_last=args.drop_last
    )
    # Built like every worker loader of the workbook (helpers.pipeline.loaders.build_loader: validated
    # knobs, the /dev/shm check and a worker timeout). seed + rank: different worker seeds per rank.
    workers_kw: dict[str, Any] = {}
    if args.workers > 0:
        workers_kw.update(persistent_workers=True, prefetch_factor=args.prefetch_factor)
    config = LoaderConfig(
        batch_size=args.batch_size,
        num_workers=args.workers,
        pin_memory=cuda,  # only with CUDA; the pin thread pins for this rank's current device
        shuffle=False,  # the sampler shuffles; the loader's own shuffle must stay off
        seed=args.seed + rank,
        **workers_kw,
    )
    loader = build_loader(dataset, config, sampler=sampler, worker_init_fn=seed_worker if args.workers > 0 else None)
    prefetcher_used = False
    batches: Any = loader
    if not args.no_prefetcher:
        try:
            from ...pipeline.prefetch import Prefetcher  # optional: a missing module is tolerated (ImportError)
        except ImportError:  # chapter 05's helper missing: move batches by hand
            Prefetcher = None  # type: ignore[assignment,misc]
        if Prefetcher is not None:
            batches = Prefetcher(loader, device, normalize=(MEAN, STD))
            prefetcher_used = True

    model = build_model(width=args.width, num_classes=len(base.classes), seed=args.seed).to(device)
    ddp = DDP(model, device_ids=[local_rank] if cuda else None)
    opt = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()
    total_steps = len(loader) * args.epochs
    # Augmentation in the main process (workers=0) draws from the global generator:
    # seed it per rank, so a run is repeatable and ranks draw different crops.
    torch.manual_seed(args.seed + 1000 * (rank + 1))

    epochs: list[dict[str, Any]] = []
    step = 0
    train_start = time.time()
    try:
        for epoch in range(args.epochs):
            if not args.no_set_epoch:
                sampler.set_epoch(epoch)  # a new shuffle every epoch, the same on every rank
            ddp.train()
            seen: list[torch.Tensor] = []
            # Sums stay on the device: no .item()/float() in the step loop, so the CPU
            # never waits for the GPU there (chapter 05's hidden-sync hazard).
            loss_sum = torch.zeros((), device=device)
            correct = torch.zeros((), dtype=torch.int64, device=device)
            n_items = 0
            t0 = time.perf_counter()
            for batch in batches:
                images, labels, idx = batch
                if not prefetcher_used:
                    images = to_float_normalized(images.to(device, non_blocking=cuda))
                labels = labels.to(device, non_blocking=cuda)
                if rank == args.fail_rank and epoch == 0 and step >= args.fail_step:
                    raise InjectedFailure(
                        f"rank {rank} failed on purpose at step {step} (--fail-rank {args.fail_rank})"
                    )
                opt.zero_grad(set_to_none=True)
                logits = ddp(images)
                loss = loss_fn(logits, labels)
                loss.backward()  # DDP all-reduces (averages) gradients across ranks here
                opt.step()
                seen.append(idx)
                loss_sum += loss.detach() * len(labels)
                correct += (logits.argmax(1) == labels).sum()
                n_items += len(labels)
                step += 1
                _progress(out, rank, step, total_steps, epoch)
            if cuda:
                torch.cuda.synchronize(device)
            seconds = time.perf_counter() - t0
            indices = torch.cat(seen).tolist() if seen else []
            epochs.append(
                {
                    "epoch": epoch,
                    "indices": indices,
                    "n_items": n_items,
                    "seconds": seconds,
                    "items_per_s": n_items / seconds if seconds > 0 else 0.0,
                    "loss": float(loss_sum) / max(n_items, 1),
                    "accuracy": int(correct) / max(n_items, 1),
                }
            )
    finally:
        # Stop this rank's DataLoader workers now (persistent workers live as long as the iterator).
        del batches, loader
    train_end = time.time()
    val: dict[str, Any] = {"val_accuracy": None, "val_items": 0}
    if val_root is not None and not args.no_val:
        # Running BatchNorm statistics are each rank's own (DDP broadcasts them from rank 0 before every
        # forward, then each rank updates them): score the model rank 0 holds, on every rank.
        for buf in model.buffers():
            dist.broadcast(buf, 0)
        val_set = IndexedDataset(ShapesDataset(val_root, crop_size=crop, augment=False, output="uint8"), args.val_limit)
        hits, scored = evaluate_shared(model, val_set, device, rank=rank, world=world, batch_size=2 * args.batch_size)
        val = {"val_accuracy": hits / scored if scored else None, "val_items": scored}
    dist.barrier()
    t_end = time.perf_counter()
    try:
        import psutil

        started = psutil.Process().create_time()
    except Exception:  # psutil missing: start-up unknown
        started = float("nan")
    return {
        "rank": rank,
        "local_rank": local_rank,
        "world_size": world,
        "backend": backend,
        "device": str(device),
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "workers": args.workers,
        "batch_size": args.batch_size,
        "pin_memory": cuda,
        "prefetcher": prefetcher_used,
        "set_epoch": not args.no_set_epoch,
        "drop_last": args.drop_last,
        "dataset_size": len(dataset),
        "num_classes": len(base.classes),
        **val,
        "samples_per_rank": len(sampler),
        "batches_per_epoch": len(sampler) // args.batch_size + (len(sampler) % args.batch_size > 0),
        "epochs": epochs,
        "join_s": t_joined - t_start,
        "startup_s": train_start - started,  # process start -> first batch asked for (imports, setup)
        "train_s": train_end - train_start,
        "total_s": t_end - t_start,
        "params_checksum": params_checksum(model),
        "torch": torch.__version__,
        "omp_threads": torch.get_num_threads(),
    }


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point for one rank: train, write ``rank<R>.json`` (or ``rank<R>.error.json``)."""
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rank = _env_int("RANK", 0)
    try:
        record = train(args)
        _write_json(out / f"rank{rank}.json", record)
        return 0
    except BaseException as exc:  # record the root cause for the launcher, then fail loudly
        if not isinstance(exc, (KeyboardInterrupt, SystemExit)):
            _write_json(
                out / f"rank{rank}.error.json",
                {
                    "rank": rank,
                    "type": type(exc).__name__,
                    "message": str(exc),
                    "traceback": traceback.format_exc(),
                    "time": time.time(),
                    "pid": os.getpid(),
                },
            )
        raise
    finally:
        if dist.is_available() and dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # a broken group can't be torn down cleanly; the process exits anyway
                pass


if __name__ == "__main__":
    from torch.distributed.elastic.multiprocessing.errors import record

    sys.exit(record(main)())
