"""Beyond one GPU: per-rank data loading and torchrun runs from a notebook (chapter 07).

Two halves.

**Sampler lessons that need no process group.** A
:class:`~torch.utils.data.distributed.DistributedSampler` takes its place in
the world as plain arguments (``num_replicas``, ``rank``), so its sharding can
be studied in one process:

``shard_table(n, world_size, ...) -> {rank: [indices]}``
    What each rank loads in one epoch (the real sampler, not a re-implementation).
``format_shard_table(table, n)``
    The same, as text, padded (repeated) samples marked with ``*``.
``rank_share(n, world_size, drop_last) -> RankShare``
    Samples per rank, padding and dropped samples, in closed form.
``batches_per_rank(n, world_size, batch_size, ...)``
    Optimizer steps per rank and epoch.
``epoch_orders(n, world_size, rank, epochs, call_set_epoch=...)``
    One rank's order in successive epochs: the same every epoch when
    ``set_epoch`` is forgotten.
``coverage(indices_by_rank, n) -> Coverage``
    Did the ranks together see every sample exactly once?

**A real multi-process run.** :func:`launch_ddp` starts torchrun,
``python -m helpers.chapters.ch07.distributed --local-addr=127.0.0.1 --standalone --nproc-per-node N \
-m helpers.chapters.ch07.ddp_train ...``
(``python -m torch.distributed.run`` with every store it serves bound to
127.0.0.1, see :func:`loopback_torchrun`), as a subprocess (the reader's own
interpreter, ``sys.executable``), with a timeout and captured output, follows
rank 0's progress, and collects the per-rank JSON files from a temporary folder
into a :class:`DistributedRun` (per-rank and total items/s, coverage per epoch,
replica checksums, and every socket the job listened on).

**Nothing listens beyond this machine.** c10d's TCPStore server binds the
wildcard address (``::``) whatever host it is given, unless it is handed a
socket that is already bound; plain torchrun therefore exposes its rendezvous
store on every interface. The launcher hands it sockets bound to 127.0.0.1,
tells the ranks to meet there (``--local-addr``, ``MASTER_ADDR``), and puts
gloo and NCCL on the loopback interface (``GLOO_SOCKET_IFNAME``/``NCCL_SOCKET_IFNAME``).

It cleans up after itself. Every process the run starts is tracked: torchrun,
the ranks (each in its own process group) and their DataLoader workers. On a
failure, a timeout or ``KeyboardInterrupt``, they are all terminated, then
killed. A failing rank becomes a :class:`DistributedRunError` whose message
names the rank and its exception in plain words.

The backend is ``gloo`` on a CPU (any machine, CI included) and ``nccl`` with
one process per GPU when CUDA is present. Runs on several machines use the same
worker script with torchrun's rendezvous arguments; see :func:`multi_node_command`.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from ...core.validate import check_float, check_int

__all__ = [
    "shard_indices",
    "shard_table",
    "format_shard_table",
    "RankShare",
    "rank_share",
    "batches_per_rank",
    "epoch_orders",
    "Coverage",
    "coverage",
    "DistributedRunError",
    "DistributedRun",
    "max_processes",
    "torchrun_command",
    "loopback_torchrun",
    "loopback_env",
    "loopback_interface",
    "listening_sockets",
    "multi_node_command",
    "launch_ddp",
    "process_alive",
    "plot_run",
    "throughput_rows",
    "throughput_rows_from_records",
    "throughput_table",
]

#: Upper bound on DataLoader workers per rank accepted by the launcher.
MAX_WORKERS_PER_RANK = 8


# ---------------------------------------------------------------------------
# Sharding without a process group
# ---------------------------------------------------------------------------


class _Sized:
    """A stand-in data set of ``n`` items: all a DistributedSampler asks for is ``len()``."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n


def _check_world(n: int, world_size: int) -> tuple[int, int]:
    n = check_int("n", n, 1, 10_000_000)
    world_size = check_int("world_size", world_size, 1, 4096)
    return n, world_size


def shard_indices(
    n: int,
    world_size: int,
    rank: int,
    *,
    shuffle: bool = True,
    seed: int = 0,
    epoch: int | None = 0,
    drop_last: bool = False,
) -> list[int]:
    """The indices rank ``rank`` of ``world_size`` loads in one epoch.

    Uses torch's own ``DistributedSampler(num_replicas=world_size, rank=rank)``,
    so no process group is needed. ``epoch=None`` means ``set_epoch`` is never
    called (the sampler then behaves as in epoch 0, every epoch).

    Raises:
        ValueError: ``n``, ``world_size``, ``rank``, ``seed`` or ``epoch`` out of range.
    """
    from torch.utils.data.distributed import DistributedSampler

    n, world_size = _check_world(n, world_size)
    rank = check_int("rank", rank, 0, world_size - 1)
    seed = check_int("seed", seed, 0, 2**63 - 1)
    if drop_last and n < world_size:
        raise ValueError(f"with drop_last=True, n must be >= world_size ({world_size}), got {n}")
    # torch annotates the data set as a Dataset; DistributedSampler only calls len() on it.
    sampler: DistributedSampler[int] = DistributedSampler(
        _Sized(n),  # type: ignore[arg-type]
        num_replicas=world_size,
        rank=rank,
        shuffle=shuffle,
        seed=seed,
        drop_last=drop_last,
    )
    if epoch is not None:
        sampler.set_epoch(check_int("epoch", epoch, 0, 10**9))
    return list(iter(sampler))


def shard_table(
    n: int,
    world_size: int,
    *,
    shuffle: bool = False,
    seed: int = 0,
    epoch: int | None = 0,
    drop_last: bool = False,
) -> dict[int, list[int]]:
    """``{rank: indices}`` for every rank of a world of ``world_size`` (see :func:`shard_indices`).

    ``shuffle`` defaults to False here so the interleaving (rank ``r`` takes
    positions ``r, r + W, r + 2W, ...``) is easy to see.
    """
    n, world_size = _check_world(n, world_size)
    return {
        r: shard_indices(n, world_size, r, shuffle=shuffle, seed=seed, epoch=epoch, drop_last=drop_last)
        for r in range(world_size)
    }


def format_shard_table(table: Mapping[int, Sequence[int]], n: int, max_items: int = 20) -> str:
    """Text table of a shard table; indices a rank sees more than once in total are marked ``*`` (padding).

    Also lists the samples no rank sees (dropped by ``drop_last``).
    """
    check_int("n", n, 1)
    counts = Counter(i for idx in table.values() for i in idx)
    lines = []
    for r in sorted(table):
        idx = list(table[r])
        shown = [f"{i}*" if counts[i] > 1 else str(i) for i in idx[:max_items]]
        more = f" ... (+{len(idx) - max_items})" if len(idx) > max_items else ""
        lines.append(f"rank {r}: {len(idx):>4} samples  [{', '.join(shown)}{more}]")
    dropped = [i for i in range(n) if counts[i] == 0]
    if dropped:
        lines.append(f"never loaded (dropped): {dropped[:max_items]}{' ...' if len(dropped) > max_items else ''}")
    if any(c > 1 for c in counts.values()):
        lines.append("* = padding: a sample repeated so every rank gets the same number of samples")
    return "\n".join(lines)


@dataclass(frozen=True)
class RankShare:
    """How ``n`` samples split over ``world_size`` ranks in one epoch.

    Attributes:
        per_rank: samples each rank loads (the same on every rank).
        total: samples loaded by all ranks together (``per_rank * world_size``).
        padded: repeated samples added to fill the last round (``drop_last=False``).
        dropped: samples no rank loads this epoch (``drop_last=True``).
    """

    n: int
    world_size: int
    drop_last: bool
    per_rank: int
    total: int
    padded: int
    dropped: int

    def __str__(self) -> str:
        how = f"{self.dropped} dropped" if self.drop_last else f"{self.padded} padded (repeated)"
        return (
            f"{self.n} samples over {self.world_size} ranks, drop_last={self.drop_last}: "
            f"{self.per_rank} per rank, {self.total} in total, {how}"
        )


def rank_share(n: int, world_size: int, drop_last: bool = False) -> RankShare:
    """Each rank's share of ``n`` samples, as ``DistributedSampler`` computes it.

    ``drop_last=False``: ``ceil(n / W)`` per rank, the shortfall filled by
    repeating samples from the start of the (shuffled) order. ``drop_last=True``:
    ``floor(n / W)`` per rank; the remainder is left out this epoch (a different
    remainder every epoch when shuffling with ``set_epoch``).
    """
    n, world_size = _check_world(n, world_size)
    per = n // world_size if drop_last else math.ceil(n / world_size)
    total = per * world_size
    return RankShare(
        n=n,
        world_size=world_size,
        drop_last=bool(drop_last),
        per_rank=per,
        total=total,
        padded=max(0, total - n),
        dropped=max(0, n - total),
    )


def batches_per_rank(
    n: int, world_size: int, batch_size: int, *, drop_last: bool = False, loader_drop_last: bool = False
) -> int:
    """Optimizer steps per rank and epoch: the sampler's share, then the DataLoader's batching.

    ``drop_last`` belongs to the sampler (samples), ``loader_drop_last`` to the
    DataLoader (a final short batch): two different settings.
    """
    batch_size = check_int("batch_size", batch_size, 1, 1 << 20)
    per = rank_share(n, world_size, drop_last).per_rank
    return per // batch_size if loader_drop_last else math.ceil(per / batch_size)


def epoch_orders(
    n: int,
    world_size: int = 2,
    rank: int = 0,
    epochs: int = 3,
    *,
    seed: int = 0,
    call_set_epoch: bool = True,
) -> list[list[int]]:
    """Rank ``rank``'s sample order in each of ``epochs`` epochs (shuffle on).

    With ``call_set_epoch=False`` the sampler is never told the epoch, so it
    shuffles with the same seed every time: every epoch repeats the first
    epoch's order (and each rank keeps the same subset of the data for ever).
    """
    epochs = check_int("epochs", epochs, 1, 10_000)
    return [
        shard_indices(n, world_size, rank, shuffle=True, seed=seed, epoch=e if call_set_epoch else None)
        for e in range(epochs)
    ]


@dataclass
class Coverage:
    """Which samples the ranks saw in one epoch, counted together.

    Attributes:
        n: data set size.
        seen: total samples loaded by all ranks.
        missing: indices no rank loaded.
        repeated: ``{index: times}`` for indices loaded more than once.
        out_of_range: indices outside ``[0, n)`` (a bug if any).
        overlap: pairs of ranks that loaded a common index: ``{(r1, r2): count}``.
    """

    n: int
    seen: int
    missing: list[int]
    repeated: dict[int, int]
    out_of_range: list[int]
    overlap: dict[tuple[int, int], int] = field(default_factory=dict)

    @property
    def exactly_once(self) -> bool:
        """True when every sample was loaded by exactly one rank, once."""
        return not self.missing and not self.repeated and not self.out_of_range and self.seen == self.n

    @property
    def extra(self) -> int:
        """Loads beyond the first of each sample (padding shows up here)."""
        return sum(c - 1 for c in self.repeated.values())

    def __str__(self) -> str:
        if self.exactly_once:
            return f"every one of the {self.n} samples seen exactly once ({self.seen} loads)"
        parts = [f"{self.seen} loads for {self.n} samples"]
        if self.missing:
            parts.append(f"{len(self.missing)} never seen (e.g. {self.missing[:5]})")
        if self.repeated:
            parts.append(f"{len(self.repeated)} seen more than once ({self.extra} extra loads)")
        if self.out_of_range:
            parts.append(f"{len(self.out_of_range)} out-of-range indices")
        return ", ".join(parts)


def coverage(indices_by_rank: Mapping[int, Sequence[int]] | Sequence[Sequence[int]], n: int) -> Coverage:
    """Count how often each of ``n`` samples was loaded across ranks in one epoch.

    Args:
        indices_by_rank: ``{rank: indices}`` or a list indexed by rank.
        n: data set size.
    """
    n = check_int("n", n, 1)
    if not isinstance(indices_by_rank, Mapping):
        indices_by_rank = dict(enumerate(indices_by_rank))
    counts: Counter[int] = Counter()
    owners: dict[int, set[int]] = {}
    for r, idx in indices_by_rank.items():
        for raw in idx:
            i = int(raw)
            counts[i] += 1
            owners.setdefault(i, set()).add(int(r))
    overlap: Counter[tuple[int, int]] = Counter()
    for rs in owners.values():
        rs_sorted = sorted(rs)
        for a in range(len(rs_sorted)):
            for b in range(a + 1, len(rs_sorted)):
                overlap[(rs_sorted[a], rs_sorted[b])] += 1
    return Coverage(
        n=n,
        seen=sum(counts.values()),
        missing=[i for i in range(n) if counts[i] == 0],
        repeated={i: c for i, c in sorted(counts.items()) if c > 1 and 0 <= i < n},
        out_of_range=sorted(i for i in counts if not 0 <= i < n),
        overlap=dict(overlap),
    )


# ---------------------------------------------------------------------------
# Launching torchrun
# ---------------------------------------------------------------------------


def _wrap_args(parts: list[str], width: int) -> list[str]:
    """Group command-line words into lines of at most ``width`` characters (a word is never split)."""
    lines: list[str] = []
    for word in parts:
        if lines and len(lines[-1]) + 1 + len(word) <= width:
            lines[-1] += " " + word
        else:
            lines.append(word)
    return lines


class DistributedRunError(RuntimeError):
    """A torchrun job failed, timed out or was interrupted.

    The message says which rank failed first and with what exception, in plain
    words; the full output is kept on the object.

    Attributes:
        rank: the first rank that failed (``None`` if unknown).
        error_type / error_message: that rank's exception, as it raised it.
        rank_traceback: that rank's traceback text ('' if unknown).
        returncode: torchrun's exit status (``None`` after a timeout or interrupt).
        timed_out / interrupted: why the job was stopped, if it was.
        stdout / stderr: torchrun's captured output (all ranks).
        tracked_pids: every process id the run started (torchrun, ranks, workers).
        leftover_pids: those still alive after clean-up (should be empty).
    """

    def __init__(
        self,
        message: str,
        *,
        rank: int | None = None,
        error_type: str = "",
        error_message: str = "",
        rank_traceback: str = "",
        returncode: int | None = None,
        timed_out: bool = False,
        interrupted: bool = False,
        stdout: str = "",
        stderr: str = "",
        tracked_pids: Sequence[int] = (),
        leftover_pids: Sequence[int] = (),
    ) -> None:
        super().__init__(message)
        self.rank = rank
        self.error_type = error_type
        self.error_message = error_message
        self.rank_traceback = rank_traceback
        self.returncode = returncode
        self.timed_out = timed_out
        self.interrupted = interrupted
        self.stdout = stdout
        self.stderr = stderr
        self.tracked_pids = list(tracked_pids)
        self.leftover_pids = list(leftover_pids)


@dataclass
class DistributedRun:
    """The outcome of one torchrun job (see :func:`launch_ddp`).

    Attributes:
        nproc: processes (ranks) started.
        command: the command line that was run.
        ranks: the per-rank records written by :mod:`helpers.chapters.ch07.ddp_train`, sorted by rank.
        wall_s: seconds from launch to exit, including process start-up (imports).
        stdout / stderr: torchrun's captured output.
        settings: the launch settings (workers, batch size, ...).
        tracked_pids / leftover_pids: processes started, and those alive after clean-up.
        listening: ``(pid, address, port)`` of every TCP socket the job's processes
            were seen listening on (sampled twice a second while it ran).
    """

    nproc: int
    command: list[str]
    ranks: list[dict[str, Any]]
    wall_s: float
    stdout: str = ""
    stderr: str = ""
    settings: dict[str, Any] = field(default_factory=dict)
    tracked_pids: list[int] = field(default_factory=list)
    leftover_pids: list[int] = field(default_factory=list)
    listening: list[tuple[int, str, int]] = field(default_factory=list)

    def non_loopback_listeners(self) -> list[tuple[int, str, int]]:
        """Sockets of the job that listened on an address other machines could reach (should be none)."""
        import ipaddress

        return [
            (pid, ip, port)
            for pid, ip, port in self.listening
            if not ipaddress.ip_address(ip.split("%")[0]).is_loopback
        ]

    @property
    def backend(self) -> str:
        return str(self.ranks[0]["backend"]) if self.ranks else "?"

    @property
    def world_size(self) -> int:
        return int(self.ranks[0]["world_size"]) if self.ranks else 0

    @property
    def n_epochs(self) -> int:
        return len(self.ranks[0]["epochs"]) if self.ranks else 0

    @property
    def dataset_size(self) -> int:
        return int(self.ranks[0]["dataset_size"]) if self.ranks else 0

    def timed_epochs(self) -> list[int]:
        """Epochs that count for throughput: all but the first (warm-up) when there are two or more."""
        e = self.n_epochs
        return list(range(1, e)) if e >= 2 else list(range(e))

    def per_rank_items_per_s(self) -> list[float]:
        """Each rank's items/s over the timed epochs (its own items / its own seconds)."""
        out = []
        for r in self.ranks:
            eps = [r["epochs"][e] for e in self.timed_epochs()]
            items = sum(e["n_items"] for e in eps)
            secs = sum(e["seconds"] for e in eps)
            out.append(items / secs if secs > 0 else 0.0)
        return out

    def total_items_per_s(self) -> float:
        """All ranks' items over the timed epochs / the slowest rank's time (ranks step together)."""
        items = sum(r["epochs"][e]["n_items"] for r in self.ranks for e in self.timed_epochs())
        secs = max((sum(r["epochs"][e]["seconds"] for e in self.timed_epochs()) for r in self.ranks), default=0.0)
        return items / secs if secs > 0 else 0.0

    def indices(self, epoch: int) -> dict[int, list[int]]:
        """``{rank: indices loaded in epoch}``, as recorded from the batches themselves."""
        check_int("epoch", epoch, 0, max(0, self.n_epochs - 1))
        return {int(r["rank"]): list(r["epochs"][epoch]["indices"]) for r in self.ranks}

    def coverage(self, epoch: int) -> Coverage:
        """Coverage of the data set by all ranks together in ``epoch``."""
        return coverage(self.indices(epoch), self.dataset_size)

    def exactly_once_every_epoch(self) -> bool:
        """True when every epoch covered every sample exactly once."""
        return self.n_epochs > 0 and all(self.coverage(e).exactly_once for e in range(self.n_epochs))

    def replicas_in_sync(self) -> bool:
        """True when every rank ended with bit-identical parameters (what DDP guarantees)."""
        return len({r["params_checksum"] for r in self.ranks}) == 1

    def losses(self) -> list[list[float]]:
        """Per rank, the mean training loss of each epoch."""
        return [[e["loss"] for e in r["epochs"]] for r in self.ranks]

    @property
    def num_classes(self) -> int:
        """Classes of the training set (0 when the ranks did not say)."""
        return int(self.ranks[0].get("num_classes") or 0) if self.ranks else 0

    @property
    def chance(self) -> float | None:
        """The chance level, ``1 / classes``: the accuracy of guessing (None when the classes are unknown)."""
        return 1.0 / self.num_classes if self.num_classes else None

    @property
    def val_accuracy(self) -> float | None:
        """Top-1 accuracy of the trained model on the held-out images (all ranks' shares summed), or None.

        Every rank reports the same figure (the counts are all-reduced); rank 0's is returned.
        """
        v = self.ranks[0].get("val_accuracy") if self.ranks else None
        return None if v is None else float(v)

    @property
    def val_items(self) -> int:
        """Held-out images scored (0 without a validation pass)."""
        return int(self.ranks[0].get("val_items") or 0) if self.ranks else 0

    def learning(self) -> str:
        """One line: the validation accuracy beside the chance level, both from this run."""
        if self.val_accuracy is None or self.chance is None:
            return "validation accuracy: not measured (no validation pass in this run)"
        return (
            f"validation accuracy {self.val_accuracy:.1%} on {self.val_items} held-out images "
            f"(chance: 1/{self.num_classes} = {self.chance:.1%})"
        )

    def command_line(self) -> str:
        """The command that was run, for reading: ``python`` for the interpreter, folders shortened."""
        parts = ["python"] + list(self.command[1:])
        short = {
            "--out=": "--out=<tmp>/results",
            "--log-dir=": "--log-dir=<tmp>/logs",
            "--data-dir=": "--data-dir=<data>",
            "--val-dir=": "--val-dir=<data>",
        }
        for i, a in enumerate(parts):
            for prefix, repl in short.items():
                if a.startswith(prefix):
                    parts[i] = repl
        return " \\\n    ".join(_wrap_args(parts, 96))

    def table(self) -> str:
        """Per-rank text table: device, workers, samples, steady items/s, loss."""
        rates = self.per_rank_items_per_s()
        rows = [f"{'rank':>4}  {'device':<8} {'workers':>7} {'samples/epoch':>13} {'items/s':>9} {'last loss':>9}"]
        for r, rate in zip(self.ranks, rates):
            rows.append(
                f"{r['rank']:>4}  {r['device']:<8} {r['workers']:>7} {r['samples_per_rank']:>13} "
                f"{rate:>9.0f} {r['epochs'][-1]['loss']:>9.3f}"
            )
        rows.append(
            f"{'all':>4}  {'':<8} {'':>7} {sum(r['samples_per_rank'] for r in self.ranks):>13} "
            f"{self.total_items_per_s():>9.0f}"
        )
        return "\n".join(rows)

    def startup_s(self) -> float:
        """Longest time any rank spent from its process start to its first batch (imports, setup)."""
        return max((float(r.get("startup_s", float("nan"))) for r in self.ranks), default=float("nan"))

    def train_s(self) -> float:
        """Longest time any rank spent in its training loop (all epochs)."""
        return max((float(r.get("train_s", float("nan"))) for r in self.ranks), default=float("nan"))

    def summary(self) -> str:
        """Processes, backend, total items/s and times; then per-rank items/s, wrapped to 100 characters."""
        per = ", ".join(f"{v:.0f}" for v in self.per_rank_items_per_s())
        head = (
            f"{self.nproc} process(es), {self.backend}: total {self.total_items_per_s():.0f} items/s; "
            f"wall time {self.wall_s:.1f} s, of which training {self.train_s():.1f} s"
        )
        ranks = textwrap.fill(f"items/s per rank: {per}", width=100, subsequent_indent="  ")
        return f"{head}\n{ranks}"


def max_processes() -> int:
    """Most ranks worth starting on this machine: one per GPU, else one per CPU core."""
    try:
        import torch

        if torch.cuda.is_available():
            return max(1, torch.cuda.device_count())
    except Exception:  # a broken driver: fall back to cores
        pass
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - not Linux
        return max(1, os.cpu_count() or 1)


def torchrun_command(
    nproc: int,
    script_args: Sequence[str],
    *,
    module: str = "helpers.chapters.ch07.ddp_train",
    rdzv_endpoint: str | None = None,
    log_dir: str | os.PathLike[str] | None = None,
    loopback: bool = True,
) -> list[str]:
    """The torchrun command line for one machine.

    ``--standalone`` starts a c10d rendezvous store on a free port of this machine.
    With ``rdzv_endpoint="127.0.0.1:PORT"`` the store is at that address instead.

    ``loopback=True`` (the default) runs torchrun through
    ``python -m helpers.chapters.ch07.distributed``: the same launcher, but every TCP store it
    serves listens on 127.0.0.1 only, and ``--local-addr=127.0.0.1`` makes the
    ranks meet there (see :func:`loopback_torchrun`). Plain torchrun's stores
    listen on every interface (``::``) whatever host they are given, because
    c10d's TCPStore server binds the wildcard address unless it is handed a
    socket that is already bound. ``loopback=False`` gives the plain
    ``python -m torch.distributed.run`` line.
    """
    nproc = check_int("nproc", nproc, 1, 4096)
    if loopback:
        if rdzv_endpoint and not _is_loopback_host(rdzv_endpoint.rsplit(":", 1)[0]):
            raise ValueError(
                f"rdzv_endpoint: {rdzv_endpoint!r} is not a loopback address; a single-machine run listens "
                "on 127.0.0.1 only (pass loopback=False for a store other machines can reach)"
            )
        cmd = [sys.executable, "-m", "helpers.chapters.ch07.distributed", "--local-addr=127.0.0.1"]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run"]
    if rdzv_endpoint:
        cmd += ["--rdzv-backend=c10d", f"--rdzv-endpoint={rdzv_endpoint}", "--rdzv-id=workbook", "--nnodes=1"]
    else:
        cmd += ["--standalone"]
    cmd += [f"--nproc-per-node={nproc}", "--max-restarts=0"]
    if log_dir is not None:
        cmd += [f"--log-dir={log_dir}"]
    cmd += ["-m", module, *script_args]
    return cmd


# -- keeping a single-machine job on the loopback interface -----------------------


def _is_loopback_host(host: str) -> bool:
    """True when every address ``host`` resolves to is a loopback address (127.0.0.0/8, ::1)."""
    import ipaddress
    import socket

    host = host.strip("[]")
    try:
        infos = socket.getaddrinfo(host, None)
    except (OSError, UnicodeError):
        return False
    try:
        return bool(infos) and all(ipaddress.ip_address(str(i[4][0]).split("%")[0]).is_loopback for i in infos)
    except ValueError:
        return False


def loopback_interface() -> str | None:
    """The name of this machine's loopback network interface (``lo`` on Linux), if any."""
    import socket

    try:
        names = [name for _, name in socket.if_nameindex()]
    except (OSError, AttributeError):  # pragma: no cover - no interface list on this OS
        return None
    for name in ("lo", "lo0"):
        if name in names:
            return name
    return next((n for n in names if n.startswith("lo")), None)


def loopback_env() -> dict[str, str]:
    """Environment for the ranks of a single-machine job: collectives on loopback only.

    ``MASTER_ADDR=127.0.0.1``, and the interface gloo and NCCL bind their own
    sockets to (``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME``): without them they
    pick the interface the host name resolves to, which may face the network.
    """
    env = {"MASTER_ADDR": "127.0.0.1"}
    lo = loopback_interface()
    if lo is not None:
        env.update(GLOO_SOCKET_IFNAME=lo, NCCL_SOCKET_IFNAME=lo)
    return env


_LOOPBACK_PORTS: set[int] = set()


def _listen_on_loopback(port: int) -> tuple[int, int]:
    """A TCP socket listening on 127.0.0.1:``port`` (0: any free port); returns ``(port, fd)``.

    The caller takes over the file descriptor (c10d's TCPStore closes it).
    """
    import socket

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", int(port)))
        sock.listen(512)
        bound = int(sock.getsockname()[1])
        return bound, sock.detach()
    except BaseException:
        sock.close()
        raise


def _loopback_tcpstore(base: type) -> type:
    """A TCPStore class whose servers listen on 127.0.0.1 when their host is a loopback name."""

    class LoopbackTCPStore(base):
        """``torch.distributed.TCPStore``, but a server for a loopback host binds 127.0.0.1 only.

        c10d's store server binds the wildcard address (``::``) whatever ``host_name``
        says, unless it is given ``master_listen_fd``: a socket already bound and
        listening. This class hands it one bound to 127.0.0.1.
        """

        def __init__(
            self,
            host_name: str,
            port: int,
            world_size: int | None = None,
            is_master: bool = False,
            timeout: Any = None,
            wait_for_workers: bool = True,
            multi_tenant: bool = False,
            master_listen_fd: int | None = None,
            use_libuv: bool = True,
        ) -> None:
            import datetime

            from ...core.device import torch_at_least as _torch_at_least  # heavy: imports torch, as this class needs

            if timeout is None:
                timeout = datetime.timedelta(seconds=300)
            port = int(port)
            reuse = multi_tenant and port in _LOOPBACK_PORTS  # c10d shares the server already running there
            if is_master and master_listen_fd is None and not reuse and _is_loopback_host(str(host_name)):
                try:
                    port, master_listen_fd = _listen_on_loopback(port)
                except OSError as exc:  # same type as c10d's own bind failure, which callers catch
                    raise RuntimeError(f"cannot listen on 127.0.0.1:{port}: {exc}") from exc
                _LOOPBACK_PORTS.add(port)
            super().__init__(
                host_name,
                port,
                world_size,
                is_master,
                timeout,
                wait_for_workers,
                multi_tenant,
                master_listen_fd,
                use_libuv and (master_listen_fd is None or _torch_at_least(2, 8)),  # libuv takes a listen fd from 2.8
            )

    return LoopbackTCPStore


def loopback_torchrun(argv: Sequence[str] | None = None) -> None:
    """Run torchrun (``torch.distributed.run``) with every store it serves bound to 127.0.0.1.

    This is ``python -m helpers.chapters.ch07.distributed [torchrun options] -m module ...``: it
    replaces ``TCPStore`` in torchrun's rendezvous modules with a class that binds
    its server to the loopback address, then calls torchrun's own ``main``. Use it
    with ``--standalone`` (or a ``127.0.0.1`` endpoint) and ``--local-addr=127.0.0.1``
    (the address the ranks are told to meet at) on a single machine only: other
    machines cannot reach a loopback store.
    """
    import torch.distributed as dist
    import torch.distributed.elastic.rendezvous.c10d_rendezvous_backend as c10d_backend
    import torch.distributed.elastic.rendezvous.dynamic_rendezvous  # noqa: F401  (uses dist.TCPStore)
    import torch.distributed.elastic.rendezvous.static_tcp_rendezvous as static_backend
    import torch.distributed.rendezvous as rendezvous
    from torch.distributed import run as torchrun

    base = dist.TCPStore
    patched = _loopback_tcpstore(base)
    for module in (dist, c10d_backend, static_backend, rendezvous):
        if getattr(module, "TCPStore", None) is base:
            module.TCPStore = patched  # type: ignore[attr-defined]
    torchrun.main(list(sys.argv[1:] if argv is None else argv))


def multi_node_command(
    nnodes: int,
    nproc_per_node: int,
    rdzv_endpoint: str,
    *,
    node_rank: int | None = None,
    rdzv_id: str = "job42",
    script: str = "-m helpers.chapters.ch07.ddp_train --out results/",
) -> str:
    """The command to type on *each* of ``nnodes`` machines (shown, never run here).

    Every machine runs the same line; they meet at ``rdzv_endpoint`` (``host:port``
    of one of them, reachable by all), under the job id ``rdzv_id``. With the
    c10d backend ranks are assigned at rendezvous, so ``--node-rank`` is optional;
    pass it to pin machine order (and with the static ``--master-addr`` setup).
    """
    check_int("nnodes", nnodes, 1, 100_000)
    check_int("nproc_per_node", nproc_per_node, 1, 4096)
    if ":" not in rdzv_endpoint:
        raise ValueError(f"rdzv_endpoint must be 'host:port', got {rdzv_endpoint!r}")
    parts = [
        "torchrun",
        f"--nnodes={nnodes}",
        f"--nproc-per-node={nproc_per_node}",
    ]
    if node_rank is not None:
        parts.append(f"--node-rank={check_int('node_rank', node_rank, 0, nnodes - 1)}")
    parts += ["--rdzv-backend=c10d", f"--rdzv-endpoint={rdzv_endpoint}", f"--rdzv-id={rdzv_id}", script]
    return " \\\n    ".join(parts)


# -- process bookkeeping ------------------------------------------------------


def process_alive(pid: int, create_time: float | None = None) -> bool:
    """True if ``pid`` runs (zombies count as gone; a reused pid with another start time too)."""
    import psutil

    try:
        p = psutil.Process(pid)
        if create_time is not None and abs(p.create_time() - create_time) > 0.01:
            return False
        return p.status() != psutil.STATUS_ZOMBIE
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False


class _Tracker:
    """Remembers every descendant of a launched process, so none is left behind."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        import psutil

        self.procs: dict[int, psutil.Process] = {}
        self.listening: set[tuple[int, str, int]] = set()
        try:
            self.root = psutil.Process(proc.pid)
            self.procs[proc.pid] = self.root
        except psutil.NoSuchProcess:  # pragma: no cover - exited at once
            self.root = None

    def snapshot(self, sockets: bool = False) -> None:
        """Add the current descendants of torchrun (one scan of the process table).

        ``sockets=True`` also records every TCP socket they listen on (:attr:`listening`).
        """
        import psutil

        if self.root is None:
            return
        try:
            for c in self.root.children(recursive=True):
                self.procs.setdefault(c.pid, c)
        except psutil.NoSuchProcess:
            pass
        if sockets:
            self.listening.update(listening_sockets(self.procs.values()))

    def orphans(self) -> None:
        """Add processes left in a tracked process's group after their parent died (re-parented).

        torchrun starts each rank in its own session, so a rank's DataLoader
        workers share the rank's process group even once the rank is gone.
        """
        import psutil

        groups = set()
        for pid in self.procs:
            try:
                groups.add(os.getpgid(pid))
            except (OSError, AttributeError):
                continue
        groups |= set(self.procs)  # a rank's pid is its group id (new session)
        me = os.getpgid(0) if hasattr(os, "getpgid") else None
        groups.discard(me)
        for p in psutil.process_iter(["pid"]):
            if p.pid in self.procs:
                continue
            try:
                if os.getpgid(p.pid) in groups:
                    self.procs[p.pid] = p
            except (OSError, AttributeError):
                continue

    def alive(self) -> list[Any]:
        import psutil

        out = []
        for p in self.procs.values():
            try:
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    out.append(p)
            except psutil.NoSuchProcess:
                continue
        return out

    def pids(self) -> list[int]:
        return sorted(self.procs)

    def stop_all(self, grace_s: float = 3.0) -> list[int]:
        """SIGTERM torchrun (it stops its ranks), then SIGTERM/SIGKILL whatever is left. Returns leftovers."""
        import psutil

        self.snapshot()
        self.orphans()
        if self.root is not None:
            try:
                if self.root.is_running():
                    self.root.send_signal(signal.SIGTERM)
                    self.root.wait(timeout=grace_s)
            except (psutil.NoSuchProcess, psutil.TimeoutExpired):
                pass
        self.snapshot()
        self.orphans()
        rest = self.alive()
        for p in rest:
            try:
                p.terminate()
            except psutil.NoSuchProcess:
                pass
        _, rest = psutil.wait_procs(rest, timeout=grace_s)
        for p in rest:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(rest, timeout=grace_s)
        return [p.pid for p in self.alive()]


def listening_sockets(procs: Any) -> list[tuple[int, str, int]]:
    """``(pid, address, port)`` of every TCP socket in LISTEN state held by ``procs``.

    ``procs`` are pids or :class:`psutil.Process` objects; processes that are gone
    are skipped.
    """
    import psutil

    out = []
    for p in procs:
        try:
            proc = p if isinstance(p, psutil.Process) else psutil.Process(int(p))
            conns = proc.net_connections(kind="tcp")
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        for c in conns:
            if c.status == psutil.CONN_LISTEN and c.laddr:
                out.append((proc.pid, str(c.laddr.ip), int(c.laddr.port)))
    return sorted(set(out))


def _tail(text: str, lines: int = 15) -> str:
    return "\n".join(text.rstrip().splitlines()[-lines:])


_ROOT_CAUSE = re.compile(r"Root Cause.*?rank\s*:\s*(\d+).*?exitcode\s*:\s*(-?\d+)", re.S)


def _root_cause(out_dir: Path, stderr: str) -> dict[str, Any]:
    """The first failure: the earliest ``rank<R>.error.json``, else torchrun's 'Root Cause' summary."""
    errors = []
    for f in out_dir.glob("rank*.error.json"):
        try:
            errors.append(json.loads(f.read_text()))
        except (OSError, ValueError):
            continue
    if errors:
        first = min(errors, key=lambda e: e.get("time", float("inf")))
        return {
            "rank": first.get("rank"),
            "type": first.get("type", ""),
            "message": first.get("message", ""),
            "traceback": first.get("traceback", ""),
        }
    m = _ROOT_CAUSE.search(stderr)
    if m:
        code = int(m.group(2))
        how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
        return {"rank": int(m.group(1)), "type": "", "message": f"the process {how}", "traceback": ""}
    return {"rank": None, "type": "", "message": "", "traceback": ""}


_WORK_PREFIX = "workbook-ddp-"


def _remove_stale_work_dirs() -> None:
    """Delete temporary run folders left by launchers that were killed (their pid is gone)."""
    for d in Path(tempfile.gettempdir()).glob(f"{_WORK_PREFIX}*-*"):
        try:
            pid = int(d.name[len(_WORK_PREFIX) :].split("-", 1)[0])
        except ValueError:
            continue
        if d.is_dir() and not process_alive(pid):
            shutil.rmtree(d, ignore_errors=True)


def _die_with_parent() -> Callable[[], None] | None:
    """A ``preexec_fn`` that makes the child get SIGTERM when its parent dies (Linux only).

    If the notebook kernel is killed or restarted mid-run, torchrun then stops
    too (and stops its ranks) instead of running on as an orphan.
    """
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)  # loaded in the parent: the child only calls it
        prctl = libc.prctl
    except (OSError, AttributeError):  # pragma: no cover - exotic libc
        return None
    pr_set_pdeathsig = 1
    sigterm = int(signal.SIGTERM)

    def preexec() -> None:
        prctl(pr_set_pdeathsig, sigterm, 0, 0, 0)

    return preexec


def launch_ddp(
    nproc: int = 2,
    *,
    workers: int = 0,
    batch_size: int = 32,
    epochs: int = 2,
    limit: int | None = None,
    width: int = 8,
    val_dir: str | os.PathLike[str] | None = None,
    val_limit: int | None = None,
    set_epoch: bool = True,
    drop_last: bool = False,
    fail_rank: int | None = None,
    data_dir: str | os.PathLike[str] | None = None,
    extra_args: Sequence[str] = (),
    timeout_s: float = 300.0,
    progress: Callable[[float, str], None] | None = None,
    rdzv_endpoint: str | None = None,
    keep_dir: str | os.PathLike[str] | None = None,
) -> DistributedRun:
    """Train the chapter-01 model with DDP on ``nproc`` processes started by torchrun.

    Runs torchrun bound to loopback (:func:`torchrun_command`, ``--standalone``,
    ``--nproc-per-node=N -m helpers.chapters.ch07.ddp_train``) with ``OMP_NUM_THREADS=1`` and
    :func:`loopback_env`, waits for it (at most ``timeout_s``), and returns the
    per-rank results. Size the job for the machine: each rank computes with one
    thread, so on a CPU a few hundred small images take seconds, and thousands
    of full-size ones take many minutes.

    Args:
        nproc: ranks to start, 1 to :func:`max_processes` (one per GPU, else per core).
        workers: DataLoader workers per rank (0-8).
        batch_size: per-rank batch size (1-4096); the global batch is ``nproc`` times that.
        epochs: 1-100 (throughput leaves out the first epoch when there are two or more).
        limit: train on ``limit`` images spread evenly over the training set, so every class is in
            (``None``: all). The class folders are listed in order: the *first* ``limit`` images would
            hold only the first classes.
        width: SmallCNN width.
        val_dir: held-out class-folder root the trained model is scored on (validation accuracy, beside
            the chance level); default: the chapter-01 validation set when ``data_dir`` is None, else none.
        val_limit: score ``val_limit`` validation images spread evenly over the set (``None``: all).
        set_epoch / drop_last: passed to the worker script (``set_epoch=False`` shows the bug).
        fail_rank: make this rank raise on purpose (the failure demo).
        data_dir: class-folder root; default: the chapter-01 training set (generated here first).
        extra_args: more options for :mod:`helpers.chapters.ch07.ddp_train`.
        timeout_s: stop everything after this many seconds (1-3600).
        progress: ``progress(fraction, text)``, e.g. a Panel's progress bar.
        rdzv_endpoint: ``"127.0.0.1:PORT"`` instead of ``--standalone``.
        keep_dir: copy the result folder (per-rank JSON, torchrun logs) here.

    Raises:
        ValueError: settings out of range (named, with the allowed range).
        DistributedRunError: a rank failed, the job timed out, or it was interrupted;
            every process it started has been stopped by then.
        KeyboardInterrupt: re-raised after clean-up when the reader interrupts the kernel.
    """
    nproc = check_int("nproc", nproc, 1, max_processes())
    workers = check_int("workers", workers, 0, MAX_WORKERS_PER_RANK)
    batch_size = check_int("batch_size", batch_size, 1, 4096)
    epochs = check_int("epochs", epochs, 1, 100)
    width = check_int("width", width, 1, 256)
    timeout_s = check_float("timeout_s", timeout_s, 1.0, 3600.0)
    if limit is not None:
        limit = check_int("limit", limit, nproc, 10_000_000)
    if val_limit is not None:
        val_limit = check_int("val_limit", val_limit, 1, 10_000_000)
    if fail_rank is not None:
        fail_rank = check_int("fail_rank", fail_rank, 0, nproc - 1)

    if data_dir is None:
        from ...pipeline.data import make_shapes_dataset  # heavy: torch (this module imports without it)

        info = make_shapes_dataset()  # generated once here, not by every rank
        data_dir = info.train_dir
        val_dir = info.val_dir if val_dir is None else val_dir
    _remove_stale_work_dirs()
    work = Path(tempfile.mkdtemp(prefix=f"{_WORK_PREFIX}{os.getpid()}-"))
    out_dir, log_dir = work / "results", work / "logs"
    out_dir.mkdir()
    args = [
        f"--out={out_dir}",
        f"--data-dir={data_dir}",
        f"--epochs={epochs}",
        f"--batch-size={batch_size}",
        f"--workers={workers}",
        f"--width={width}",
    ]
    if limit is not None:
        args.append(f"--limit={limit}")
    if val_dir is not None:
        args.append(f"--val-dir={val_dir}")
        if val_limit is not None:
            args.append(f"--val-limit={val_limit}")
    else:
        args.append("--no-val")
    if not set_epoch:
        args.append("--no-set-epoch")
    if drop_last:
        args.append("--drop-last")
    if fail_rank is not None:
        args.append(f"--fail-rank={fail_rank}")
    args += list(extra_args)
    cmd = torchrun_command(nproc, args, rdzv_endpoint=rdzv_endpoint, log_dir=log_dir)

    env = os.environ.copy()
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **loopback_env())
    pkg_parent = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (pkg_parent, env.get("PYTHONPATH", "")) if p)
    settings = {
        "nproc": nproc,
        "workers": workers,
        "batch_size": batch_size,
        "epochs": epochs,
        "limit": limit,
        "val_limit": val_limit,
        "width": width,
        "set_epoch": set_epoch,
        "drop_last": drop_last,
        "fail_rank": fail_rank,
    }

    t0 = time.perf_counter()
    stdout_f = open(work / "stdout.txt", "wb")
    stderr_f = open(work / "stderr.txt", "wb")
    proc: subprocess.Popen[bytes] | None = None
    tracker: _Tracker | None = None
    timed_out = interrupted = False
    leftover: list[int] = []
    try:
        proc = subprocess.Popen(
            cmd,
            stdout=stdout_f,
            stderr=stderr_f,
            stdin=subprocess.DEVNULL,
            env=env,
            cwd=str(work),
            start_new_session=(os.name == "posix"),
            preexec_fn=_die_with_parent(),
        )
        tracker = _Tracker(proc)
        if progress is not None:
            progress(0.0, f"starting {nproc} process(es) (each imports torch)")
        last_done = -1
        next_scan = 0.0
        while proc.poll() is None:
            now = time.perf_counter()
            if now >= next_scan:  # remember new processes (ranks, their workers) and their sockets
                tracker.snapshot(sockets=True)
                next_scan = now + 0.5
            if now - t0 > timeout_s:
                timed_out = True
                break
            if progress is not None:
                last_done = _report_progress(out_dir, progress, last_done)
            time.sleep(0.1)
    except KeyboardInterrupt:
        interrupted = True
    finally:
        if tracker is not None:
            leftover = tracker.stop_all()
        if proc is not None and proc.poll() is None:  # pragma: no cover - stop_all killed it
            proc.kill()
            proc.wait()
        stdout_f.close()
        stderr_f.close()
        wall_s = time.perf_counter() - t0
        stdout = (work / "stdout.txt").read_text(errors="replace")
        stderr = (work / "stderr.txt").read_text(errors="replace")
        ranks = []
        for f in sorted(out_dir.glob("rank*.json")):
            if f.name.endswith(".error.json"):
                continue
            try:
                ranks.append(json.loads(f.read_text()))
            except (OSError, ValueError):
                continue
        ranks.sort(key=lambda r: r["rank"])
        cause = _root_cause(out_dir, stderr)
        if keep_dir is not None:
            shutil.copytree(work, Path(keep_dir), dirs_exist_ok=True)
        shutil.rmtree(work, ignore_errors=True)

    pids = tracker.pids() if tracker is not None else []
    common: dict[str, Any] = dict(stdout=stdout, stderr=stderr, tracked_pids=pids, leftover_pids=leftover)
    if interrupted:
        stop = KeyboardInterrupt(
            f"torchrun job interrupted after {wall_s:.1f} s; its {len(pids)} process(es) were stopped"
        )
        stop.tracked_pids, stop.leftover_pids = pids, leftover  # type: ignore[attr-defined]
        raise stop
    if timed_out:
        raise DistributedRunError(
            f"the torchrun job did not finish within timeout_s={timeout_s:g} s and was stopped "
            f"({len(pids)} process(es) terminated). Raise timeout_s or make the run smaller.",
            timed_out=True,
            **common,
        )
    rc = proc.returncode if proc is not None else None
    if rc != 0 or len(ranks) != nproc:
        if cause["rank"] is not None:
            what = f"{cause['type']}: {cause['message']}" if cause["type"] else cause["message"]
            msg = (
                f"rank {cause['rank']} of {nproc} failed: {what}. torchrun then stopped the other "
                f"rank(s) and exited with code {rc}."
            )
        else:
            msg = (
                f"torchrun exited with code {rc} and {len(ranks)} of {nproc} ranks reported results. "
                f"Last lines of its output:\n{_tail(stderr)}"
            )
        raise DistributedRunError(
            msg,
            rank=cause["rank"],
            error_type=cause["type"],
            error_message=cause["message"],
            rank_traceback=cause["traceback"],
            returncode=rc,
            **common,
        )
    return DistributedRun(
        nproc=nproc,
        command=cmd,
        ranks=ranks,
        wall_s=wall_s,
        settings=settings,
        listening=sorted(tracker.listening) if tracker is not None else [],
        **common,
    )


def _report_progress(out_dir: Path, progress: Callable[[float, str], None], last_done: int) -> int:
    try:
        p = json.loads((out_dir / "progress.json").read_text())
    except (OSError, ValueError):
        return last_done
    done, total = int(p.get("done", 0)), max(1, int(p.get("total", 1)))
    if done != last_done:
        progress(done / total, f"rank 0: step {done}/{total}, epoch {int(p.get('epoch', 0)) + 1}")
    return done


# ---------------------------------------------------------------------------
# Plots and tables (the live panel and the benchmark: helpers.chapters.ch07)
# ---------------------------------------------------------------------------


def plot_run(run: DistributedRun, ax: Any = None, *, title: str | None = None) -> Any:
    """Bars: each rank's items/s and the total (measured in ``run``)."""
    from ...ui.plots import new_axes  # optional/heavy: matplotlib

    ax = ax if ax is not None else new_axes((6.5, 3.2))
    per = run.per_rank_items_per_s()
    labels = [f"rank {r['rank']}" for r in run.ranks] + ["total"]
    values = per + [run.total_items_per_s()]
    colors = ["#4e79a7"] * len(per) + ["#f28e2b"]
    bars = ax.bar(range(len(values)), values, color=colors)
    for b, v in zip(bars, values):
        ax.annotate(f"{v:.0f}", (b.get_x() + b.get_width() / 2, v), ha="center", va="bottom", fontsize=8)
    ax.set_ylim(0, max(values) * 1.15 if values and max(values) > 0 else 1)
    ax.set_xticks(range(len(values)))
    ax.set_xticklabels(labels)
    ax.set_ylabel("training throughput (items/s)")
    ax.set_title(
        title
        or f"{run.nproc} rank(s), {run.backend}, {run.settings.get('workers', 0)} worker(s)/rank, "
        f"batch {run.settings.get('batch_size', '?')}/rank"
    )
    ax.grid(axis="y", alpha=0.3)
    return ax


def throughput_rows(run: DistributedRun) -> list[dict[str, Any]]:
    """The job's total throughput as one row of :func:`throughput_table` (for a figure measured here)."""
    return [
        {
            "nproc": run.nproc,
            "backend": run.backend,
            "workers": run.settings.get("workers"),
            "batch_size": run.settings.get("batch_size"),
            "items_per_s": run.total_items_per_s(),
            "unit": "items/s",
        }
    ]


def throughput_rows_from_records(rs: Any, recs: Sequence[Any]) -> list[dict[str, Any]]:
    """``ch07.ddp.total_items_per_s`` records (one per recorded job) as rows of :func:`throughput_table`."""
    return [
        {
            "nproc": r.params.get("nproc"),
            "backend": r.params.get("backend"),
            "workers": r.params.get("workers"),
            "batch_size": r.params.get("batch_size"),
            "items_per_s": r.value,
            "unit": r.unit,
        }
        for r in recs
    ]


def throughput_table(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """'  2 rank(s), nccl, 2 workers/rank, batch 64/rank: 12345 items/s in total', one line per job."""
    return [
        f"  {p['nproc']} rank(s), {p['backend']}, {p['workers']} workers/rank, batch {p['batch_size']}/rank: "
        f"{p['items_per_s']:.0f} {p['unit']} in total"
        for p in rows
    ]


if __name__ == "__main__":  # python -m helpers.chapters.ch07.distributed: torchrun, bound to 127.0.0.1
    loopback_torchrun()
