"""Chapter 07: who loads what under a ``DistributedSampler`` (torch's sampler takes ``num_replicas`` and ``rank``
as plain arguments, so one process asks it for every rank), and :func:`launch_ddp`, a real torchrun job of
:mod:`.ddp_train` read into a :class:`DistributedRun`.
"""

from __future__ import annotations

import ipaddress
import itertools
import math
import os
import textwrap
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch
from torch.utils.data.distributed import DistributedSampler

from ...core import rounds
from ...core.config import usable_cpu_cores
from ...core.validate import check_float, check_int
from ...pipeline.data import make_shapes_dataset
from . import torchrun
from .torchrun import process_alive as process_alive  # the notebook checks with it that no process is left

MAX_WORKERS_PER_RANK = 8


# -- sharding without a process group ----------------------------------------------------------------------------


def shard_indices(
    n: int, world_size: int, rank: int, *, shuffle: bool = True, epoch: int | None = 0, drop_last: bool = False
) -> list[int]:
    """The indices rank ``rank`` of ``world_size`` loads in one epoch, from torch's own sampler (seed 0);
    ``epoch=None``: ``set_epoch`` never called (every epoch then shuffles as epoch 0)."""
    n, world_size = check_int("n", n, 1, 10_000_000), check_int("world_size", world_size, 1, 4096)
    if drop_last and n < world_size:
        raise ValueError(f"with drop_last=True, n must be >= world_size ({world_size}), got {n}")
    sampler: DistributedSampler[int] = DistributedSampler(
        range(n),  # type: ignore[arg-type]  # torch annotates a Dataset; the sampler only calls len()
        num_replicas=world_size,
        rank=check_int("rank", rank, 0, world_size - 1),
        shuffle=shuffle,
        drop_last=drop_last,
    )
    if epoch is not None:
        sampler.set_epoch(check_int("epoch", epoch, 0, 10**9))
    return list(sampler)


def shard_table(
    n: int, world_size: int, *, shuffle: bool = False, epoch: int | None = 0, drop_last: bool = False
) -> dict[int, list[int]]:
    """``{rank: indices}`` for every rank; unshuffled by default, so the interleaving (``r, r + W, ...``) shows."""
    ranks = range(check_int("world_size", world_size, 1, 4096))
    return {r: shard_indices(n, world_size, r, shuffle=shuffle, epoch=epoch, drop_last=drop_last) for r in ranks}


def format_shard_table(table: Mapping[int, Sequence[int]], n: int, max_items: int = 20) -> str:
    """A shard table as text: padding marked ``*``, then what no rank loads."""
    counts = Counter(i for idx in table.values() for i in idx)

    def shown(idx: Sequence[int]) -> str:
        more = f" ... (+{len(idx) - max_items})" if len(idx) > max_items else ""
        return "[" + ", ".join(f"{i}*" if counts[i] > 1 else str(i) for i in idx[:max_items]) + more + "]"

    lines = rounds.table(
        ["rank", "samples", "indices"], [[r, len(table[r]), shown(table[r])] for r in sorted(table)], left=3
    )
    dropped = [i for i in range(n) if counts[i] == 0]
    if dropped:
        lines.append(f"never loaded (dropped): {dropped[:max_items]}{' ...' if len(dropped) > max_items else ''}")
    if any(c > 1 for c in counts.values()):
        lines.append("* = padding: a sample repeated so every rank gets the same number of samples")
    return "\n".join(lines)


@dataclass(frozen=True)
class RankShare:
    """How ``n`` samples split over ``world_size`` ranks in one epoch."""

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
    """Each rank's share as ``DistributedSampler`` computes it: ``ceil(n / W)`` padded, or ``floor(n / W)``."""
    n, world_size = check_int("n", n, 1, 10_000_000), check_int("world_size", world_size, 1, 4096)
    per = n // world_size if drop_last else math.ceil(n / world_size)
    total = per * world_size
    return RankShare(n, world_size, bool(drop_last), per, total, max(0, total - n), max(0, n - total))


def batches_per_rank(
    n: int, world_size: int, batch_size: int, *, drop_last: bool = False, loader_drop_last: bool = False
) -> int:
    """Optimizer steps per rank and epoch; ``drop_last`` is the sampler's, ``loader_drop_last`` the DataLoader's."""
    batch_size = check_int("batch_size", batch_size, 1, 1 << 20)
    per = rank_share(n, world_size, drop_last).per_rank
    return per // batch_size if loader_drop_last else math.ceil(per / batch_size)


@dataclass
class Coverage:
    """What the ranks loaded of ``n`` samples in one epoch (``overlap``: ``{(r1, r2): samples both loaded}``)."""

    n: int
    seen: int
    missing: list[int]
    repeated: dict[int, int]
    out_of_range: list[int]
    overlap: dict[tuple[int, int], int] = field(default_factory=dict)

    @property
    def exactly_once(self) -> bool:
        return not self.missing and not self.repeated and not self.out_of_range and self.seen == self.n

    @property
    def extra(self) -> int:
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


def coverage(by_rank: Mapping[int, Sequence[int]], n: int) -> Coverage:
    """How often each of ``n`` samples was loaded across ranks in one epoch (``{rank: indices}``)."""
    n = check_int("n", n, 1)
    counts: Counter[int] = Counter()
    owners: dict[int, set[int]] = {}
    for r, idx in by_rank.items():
        for i in map(int, idx):
            counts[i] += 1
            owners.setdefault(i, set()).add(int(r))
    overlap = Counter(pair for rs in owners.values() for pair in itertools.combinations(sorted(rs), 2))
    return Coverage(
        n=n,
        seen=sum(counts.values()),
        missing=[i for i in range(n) if counts[i] == 0],
        repeated={i: c for i, c in sorted(counts.items()) if c > 1 and 0 <= i < n},
        out_of_range=sorted(i for i in counts if not 0 <= i < n),
        overlap=dict(overlap),
    )


# -- a torchrun job and what it did ------------------------------------------------------------------------------


class DistributedRunError(RuntimeError):
    """A torchrun job failed or timed out (every process stopped by then): the first failing ``rank`` (None if
    unknown), its ``error_type``, ``error_message``, ``rank_traceback``, and the :class:`DistributedRun`'s fields."""

    def __init__(self, message: str, run: DistributedRun) -> None:
        super().__init__(message)
        vars(self).update(vars(run), **run.cause)


@dataclass(kw_only=True)
class DistributedRun:
    """One job of :func:`launch_ddp`: its ``nproc`` and ``settings``, the ranks' records, seconds from launch to
    exit, torchrun's output, every process started and those alive after clean-up, every TCP socket seen listening
    ``(pid, address, port)``, the exit code (None after a timeout), the first failure; then rank 0's facts."""

    nproc: int
    command: list[str]
    ranks: list[dict[str, Any]]
    wall_s: float
    settings: dict[str, Any] = field(default_factory=dict)
    output: str = ""  # torchrun's and the ranks' stdout and stderr, interleaved
    tracked_pids: list[int] = field(default_factory=list)
    leftover_pids: list[int] = field(default_factory=list)
    listening: list[tuple[int, str, int]] = field(default_factory=list)
    returncode: int | None = 0
    timed_out: bool = False
    cause: dict[str, Any] = field(default_factory=dict)
    backend: str = field(init=False)
    world_size: int = field(init=False)
    n_epochs: int = field(init=False)
    dataset_size: int = field(init=False)
    num_classes: int = field(init=False)  # 0 when the ranks did not say
    val_items: int = field(init=False)  # held-out images scored (0 without a validation pass)
    chance: float | None = field(init=False)  # 1 / classes: the accuracy of guessing
    val_accuracy: float | None = field(init=False)  # on the held-out images, all ranks' shares together
    startup_s: float = field(init=False)  # the slowest rank's time from process start to first batch
    train_s: float = field(init=False)  # the slowest rank's time in its training loop

    def __post_init__(self) -> None:
        r0: dict[str, Any] = self.ranks[0] if self.ranks else {}
        self.backend, self.world_size = str(r0.get("backend", "?")), int(r0.get("world_size", 0))
        self.n_epochs, self.dataset_size = len(r0.get("epochs", [])), int(r0.get("dataset_size", 0))
        self.num_classes, self.val_items = int(r0.get("num_classes") or 0), int(r0.get("val_items") or 0)
        self.chance = 1.0 / self.num_classes if self.num_classes else None
        self.val_accuracy = None if r0.get("val_accuracy") is None else float(r0["val_accuracy"])
        self.startup_s, self.train_s = (max((float(r.get(k, math.nan)) for r in self.ranks), default=math.nan)
                                        for k in ("startup_s", "train_s"))  # fmt: skip

    def params(self) -> dict[str, Any]:
        p = {"nproc": self.nproc, "backend": self.backend, "epochs": self.n_epochs, "dataset_size": self.dataset_size}
        return p | {k: self.settings.get(k) for k in ("workers", "batch_size", "width")}

    def non_loopback_listeners(self) -> list[tuple[int, str, int]]:
        return [s for s in self.listening if not ipaddress.ip_address(s[1].split("%")[0]).is_loopback]

    def _timed(self, rank: dict[str, Any]) -> tuple[int, float]:
        """A rank's items and seconds over the epochs after the first (warm-up), if there are two."""
        eps = rank["epochs"][1:] if len(rank["epochs"]) >= 2 else rank["epochs"]
        return sum(e["n_items"] for e in eps), sum(e["seconds"] for e in eps)

    def per_rank_items_per_s(self) -> list[float]:
        return [items / secs if secs > 0 else 0.0 for items, secs in map(self._timed, self.ranks)]

    def total_items_per_s(self) -> float:
        """All ranks' items over the timed epochs / the slowest rank's time (ranks step together)."""
        timed = [self._timed(r) for r in self.ranks]
        secs = max((s for _, s in timed), default=0.0)
        return sum(i for i, _ in timed) / secs if secs > 0 else 0.0

    def coverage(self, epoch: int) -> Coverage:
        """From the indices of the batches the ranks trained on."""
        return coverage({int(r["rank"]): r["epochs"][epoch]["indices"] for r in self.ranks}, self.dataset_size)

    def exactly_once_every_epoch(self) -> bool:
        return self.n_epochs > 0 and all(self.coverage(e).exactly_once for e in range(self.n_epochs))

    def replicas_in_sync(self) -> bool:
        return len({r["params_checksum"] for r in self.ranks}) == 1

    def losses(self) -> list[list[float]]:
        return [[e["loss"] for e in r["epochs"]] for r in self.ranks]

    def learning(self) -> str:
        if self.val_accuracy is None or self.chance is None:
            return "validation accuracy: not measured (no validation pass in this run)"
        return (
            f"validation accuracy {self.val_accuracy:.1%} on {self.val_items} held-out images "
            f"(chance: 1/{self.num_classes} = {self.chance:.1%})"
        )

    def command_line(self) -> str:
        """The command that was run, for reading: ``python`` for the interpreter, folders shortened."""
        short = {"--out=": "<tmp>/results", "--log-dir=": "<tmp>/logs", "--data-dir=": "<data>", "--val-dir=": "<data>"}
        parts = ["python"] + [next((k + v for k, v in short.items() if a.startswith(k)), a) for a in self.command[1:]]
        lines = textwrap.wrap(" ".join(parts), 96, break_long_words=False, break_on_hyphens=False)
        return " \\\n    ".join(lines)

    def table(self) -> str:
        """Per rank: device, workers, samples, steady items/s, last loss; then all ranks."""
        rows: list[list[object]] = [
            [r["rank"], r["device"], r["workers"], r["samples_per_rank"], f"{v:.0f}", f"{r['epochs'][-1]['loss']:.3f}"]
            for r, v in zip(self.ranks, self.per_rank_items_per_s())
        ]
        rows.append(
            ["all", "", "", sum(r["samples_per_rank"] for r in self.ranks), f"{self.total_items_per_s():.0f}", ""]
        )
        headers = ["rank", "device", "workers", "samples/epoch", "items/s", "last loss"]
        return "\n".join(rounds.table(headers, rows, left=2))

    def summary(self) -> str:
        per = ", ".join(f"{v:.0f}" for v in self.per_rank_items_per_s())
        head = (
            f"{self.nproc} process(es), {self.backend}: total {self.total_items_per_s():.0f} items/s; "
            f"wall time {self.wall_s:.1f} s, of which training {self.train_s:.1f} s"
        )
        return head + "\n" + textwrap.fill(f"items/s per rank: {per}", width=100, subsequent_indent="  ")


def max_processes() -> int:
    """Most ranks worth starting on this machine: one per GPU, else one per CPU core."""
    return max(1, torch.cuda.device_count()) if torch.cuda.is_available() else usable_cpu_cores()


def multi_node_command(nnodes: int, nproc_per_node: int, rdzv_endpoint: str, *, rdzv_id: str = "job42") -> str:
    """The command to type on *each* of ``nnodes`` machines (shown, never run here), meeting at ``rdzv_endpoint``
    (``host:port`` of one of them)."""
    check_int("nnodes", nnodes, 1, 100_000)
    check_int("nproc_per_node", nproc_per_node, 1, 4096)
    if ":" not in rdzv_endpoint:
        raise ValueError(f"rdzv_endpoint must be 'host:port', got {rdzv_endpoint!r}")
    parts = ["torchrun", f"--nnodes={nnodes}", f"--nproc-per-node={nproc_per_node}"]
    parts += ["--rdzv-backend=c10d", f"--rdzv-endpoint={rdzv_endpoint}", f"--rdzv-id={rdzv_id}"]
    parts.append("-m helpers.chapters.ch07.ddp_train --out results/")
    return " \\\n    ".join(parts)


def launch_ddp(
    nproc: int = 2,
    *,
    workers: int = 0,
    batch_size: int = 32,
    epochs: int = 2,
    limit: int | None = None,
    width: int = 8,
    data_dir: str | os.PathLike[str] | None = None,
    val_dir: str | os.PathLike[str] | None = None,
    fail_rank: int | None = None,
    extra_args: Sequence[str] = (),
    timeout_s: float = 300.0,
    progress: Callable[[float, str], None] | None = None,
) -> DistributedRun:
    """Train the chapter-01 model with DDP on ``nproc`` ranks started by torchrun (``batch_size`` per rank).

    ``data_dir`` / ``val_dir`` default to the chapter-01 sets (``data_dir`` alone: no validation); ``extra_args``
    go to :mod:`.ddp_train`. Raises :class:`DistributedRunError` (a rank failed, or ``timeout_s`` passed) or the
    reader's ``KeyboardInterrupt``, once every process is stopped.
    """
    settings = {
        "nproc": check_int("nproc", nproc, 1, max_processes()),
        "workers": check_int("workers", workers, 0, MAX_WORKERS_PER_RANK),
        "batch_size": check_int("batch_size", batch_size, 1, 4096),
        "epochs": check_int("epochs", epochs, 1, 100),
        "limit": None if limit is None else check_int("limit", limit, nproc, 10_000_000),
        "width": check_int("width", width, 1, 256),
        "fail_rank": None if fail_rank is None else check_int("fail_rank", fail_rank, 0, nproc - 1),
    }
    timeout_s = check_float("timeout_s", timeout_s, 1.0, 3600.0)
    if data_dir is None:
        info = make_shapes_dataset()  # generated once here, not by every rank
        data_dir, val_dir = info.train_dir, info.val_dir if val_dir is None else val_dir
    args = [f"--data-dir={data_dir}"] + ([] if val_dir is None else [f"--val-dir={val_dir}"])
    args += [f"--{k.replace('_', '-')}={v}" for k, v in settings.items() if k != "nproc" and v is not None]
    with torchrun.work_dir() as work:
        args = [f"--out={work / 'results'}", *args, *extra_args]
        if progress is not None:
            progress(0.0, f"starting {nproc} process(es) (each imports torch)")
        job = torchrun.run_job(nproc, args, work, timeout_s, progress)
    run, cause = DistributedRun(**job, nproc=nproc, settings=settings), job["cause"]
    if run.timed_out:
        raise DistributedRunError(
            f"the torchrun job did not finish within timeout_s={timeout_s:g} s and was stopped "
            f"({len(run.tracked_pids)} process(es) terminated). Raise timeout_s or make the run smaller.",
            run,
        )
    if run.returncode != 0 or len(run.ranks) != nproc:
        tail = "\n".join(run.output.rstrip().splitlines()[-15:])
        msg = f"torchrun exited with code {run.returncode} and {len(run.ranks)} of {nproc} ranks reported results."
        msg += f" Last lines of its output:\n{tail}"
        if cause["rank"] is not None:  # the earliest error a rank wrote (a rank killed by a signal writes none)
            what = f"rank {cause['rank']} of {nproc} failed: {cause['error_type']}: {cause['error_message']}"
            msg = f"{what}. torchrun then stopped the other rank(s) and exited with code {run.returncode}."
        raise DistributedRunError(msg, run)
    return run


# -- plots and tables (the notebook, the live panel, the benchmark) ----------------------------------------------


def plot_runs(
    runs: Sequence[DistributedRun], ax: Any = None, *, names: Sequence[str] | None = None, title: str = ""
) -> Any:
    """Bars side by side, run after run (``names``, one per run, their label prefixes): each rank's items/s, then
    the total."""
    names = [""] * len(runs) if names is None else names
    if len(names) != len(runs):
        raise ValueError(f"names must hold one label prefix per run: {len(names)} names for {len(runs)} runs")
    from ...ui.plots import history_bars  # optional/heavy: matplotlib

    labels: list[str] = []
    values: list[float] = []
    for name, run in zip(names, runs):
        labels += [f"{name}rank {r['rank']}" for r in run.ranks]
        labels.append(f"{name}total: {run.settings['workers']} wk, bs {run.settings['batch_size']}")
        values += run.per_rank_items_per_s() + [run.total_items_per_s()]
    what = "each rank's items/s, then the job's total (measured now; wk: workers/rank, bs: batch/rank)"
    title = title or f"{runs[-1].backend}: {what}"
    ax = history_bars(labels, values, ax, ylabel="training throughput (items/s)", title=title)
    for i, v in enumerate(values):
        ax.annotate(f"{v:.0f}", (i, v), ha="center", va="bottom", fontsize=8)
    ax.set_ylim(0, max(values, default=0) * 1.15 or 1)
    ax.title.set_fontsize(9)
    return ax


def throughput_table(rows: Sequence[Any]) -> list[str]:
    """The jobs' total items/s: :class:`DistributedRun` s measured here, or ``ch07.ddp.total_items_per_s`` records."""
    figs = [
        (r.params(), r.total_items_per_s(), "items/s") if isinstance(r, DistributedRun) else (r.params, r.value, r.unit)
        for r in rows
    ]
    cells = [[p["nproc"], p["backend"], p["workers"], p["batch_size"], f"{v:.0f} {unit}"] for p, v, unit in figs]
    headers = ["ranks", "backend", "workers/rank", "batch/rank", "total"]
    return ["  " + line for line in rounds.table(headers, cells, left=2)]
