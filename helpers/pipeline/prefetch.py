"""A side-stream prefetcher: copy batch i+1 while batch i computes.

``Prefetcher(loader, device)`` wraps any iterable of batches (usually a
``DataLoader``) and yields the same batches, in the same order, already on
``device``. On a CUDA device it issues the host-to-device copy of the *next*
batch on its own CUDA stream before handing out the current one, so the copy
runs on a copy engine while the model's kernels for the current batch run on
the compute (current) stream. Three conditions make that overlap real:

1. the source is in **pinned** (page-locked) host memory — a copy from pageable
   memory is staged by the driver and blocks the host;
2. the copy is on a **non-default stream** — work on one stream runs in order;
3. a **copy engine is free** — every current NVIDIA GPU has at least one.

Memory safety across streams
----------------------------
A tensor created on the side stream belongs, for PyTorch's caching allocator, to
that stream. When your code drops it, the allocator may hand its block to the
next allocation *on the side stream* at once — while kernels queued on the
compute stream may still be reading it. Two ways to prevent that:

``safety="record_stream"`` (default)
    Call ``tensor.record_stream(compute_stream)`` on every tensor handed out.
    The allocator then records an event on the compute stream when the tensor is
    freed and reuses the block only after that event has passed. It is safe
    however long you keep a batch, and needs no fixed shapes. Its cost: freed
    blocks come back a little later, so peak memory can be slightly higher.
``safety="event"``
    No ``record_stream``. Instead, each time you ask for the next batch the
    prefetcher records an event on the compute stream and makes the side stream
    wait for it before it allocates the following batch. Everything you queued
    on earlier batches is then finished before their memory can be reused. The
    contract: a batch is valid until you ask for the batch after next, and you
    queue no new work on a batch after that (``.clone()`` it to keep it).

We default to ``record_stream`` because it is safe without a contract and works
for any batch structure whose tensors we can reach. Custom objects are moved
with their own ``.to()``; the prefetcher reaches their tensors through their
attributes (``vars(obj)``) or calls their ``record_stream(stream)`` method if
they have one.

One stream per prefetcher, created once: a new ``torch.cuda.Stream`` per epoch
leaks reserved memory in the caching allocator (timm issue #2781), so the stream
lives as long as the prefetcher.

``normalize=(mean, std)`` turns ``uint8`` image tensors (``...CHW``) into
normalised floats *after* the copy, on the device: ``(x / 255 - mean) / std``, by
the workbook's one normaliser (:func:`helpers.pipeline.data.to_float_normalized`, statistics
cached per device and dtype, so no step copies them from the host again).
A uint8 batch is a quarter of the bytes of a float32 one, so four times fewer
bytes cross the link. Other tensors (labels, floats) are left alone.

Without CUDA the prefetcher passes batches through unchanged (normalisation
still applied, so the training loop is the same code on every machine).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import statistics
import time
from typing import Any, Callable, Iterable, Iterator, NamedTuple, Sequence
from unittest import mock

import torch

from ..core.config import require_gpu
from ..core.device import resolve_device
from ..core.timing import GpuDelay, calibrated_compute
from ..core.validate import check_choice, check_int
from .data import MEAN, STD, normalization_stats, to_float_normalized

__all__ = [
    "Prefetcher",
    "map_tensors",
    "iter_tensors",
    "move_batch",
    "normalize_uint8",
    "check_prefetcher",
    "check_order",
    "order_log",
    "check_race",
    "ProbeBatch",
    "ProbeLoader",
    "PrefetcherCheck",
    "example_loaders",
    "Pair",
    "Sample",
    "stream_doubles",
    "stream_protocol",
    "format_protocol",
    "check_protocol",
    "check_pipeline_prefetcher",
    "check_pipeline_race",
    "PairProbeLoader",
    "prefetch_overlap_ratio",
]

SAFETY_MODES = ("record_stream", "event")
MiB = 1 << 20


# ---------------------------------------------------------------------------
# Walking nested batch structures
# ---------------------------------------------------------------------------


def _is_namedtuple(obj: Any) -> bool:
    return isinstance(obj, tuple) and hasattr(type(obj), "_fields")


def map_tensors(fn: Callable[[torch.Tensor], Any], batch: Any, *, obj_fn: Callable[[Any], Any] | None = None) -> Any:
    """Apply ``fn`` to every tensor inside ``batch``; rebuild the same structure.

    Handles tensors, lists, tuples, namedtuples, dicts (any ``dict`` subclass
    that can be rebuilt from items) and dataclass instances. Any other object is
    passed to ``obj_fn`` when given (e.g. to call its ``.to()``), else returned
    unchanged. Strings, numbers and ``None`` are returned unchanged.
    """
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, (str, bytes, int, float, bool, type(None))):
        return batch
    if _is_namedtuple(batch):
        return type(batch)(*(map_tensors(fn, b, obj_fn=obj_fn) for b in batch))
    if isinstance(batch, tuple):
        return tuple(map_tensors(fn, b, obj_fn=obj_fn) for b in batch)
    if isinstance(batch, list):
        return [map_tensors(fn, b, obj_fn=obj_fn) for b in batch]
    if isinstance(batch, dict):
        items = [(k, map_tensors(fn, v, obj_fn=obj_fn)) for k, v in batch.items()]
        try:
            return type(batch)(items)
        except TypeError:
            return dict(items)
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        fields = dataclasses.fields(batch)
        moved = {f.name: map_tensors(fn, getattr(batch, f.name), obj_fn=obj_fn) for f in fields}
        new = dataclasses.replace(batch, **{f.name: moved[f.name] for f in fields if f.init})
        for f in fields:
            if not f.init:
                object.__setattr__(new, f.name, moved[f.name])
        return new
    if obj_fn is not None:
        return obj_fn(batch)
    return batch


def iter_tensors(batch: Any, _depth: int = 0) -> Iterator[torch.Tensor]:
    """Yield every tensor reachable in ``batch`` (containers, dataclasses, object attributes)."""
    if _depth > 8:
        return
    if isinstance(batch, torch.Tensor):
        yield batch
    elif isinstance(batch, (str, bytes, int, float, bool, type(None))):
        return
    elif isinstance(batch, (list, tuple)):
        for b in batch:
            yield from iter_tensors(b, _depth + 1)
    elif isinstance(batch, dict):
        for b in batch.values():
            yield from iter_tensors(b, _depth + 1)
    elif dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        for f in dataclasses.fields(batch):
            yield from iter_tensors(getattr(batch, f.name), _depth + 1)
    elif hasattr(batch, "__dict__"):
        for b in vars(batch).values():
            yield from iter_tensors(b, _depth + 1)


def _as_stats(name: str, values: Any) -> tuple[float, ...]:
    if isinstance(values, torch.Tensor):
        values = values.flatten().tolist()
    try:
        out = tuple(float(v) for v in values)
    except (TypeError, ValueError):
        raise ValueError(f"normalize {name} must be a sequence of numbers (one per channel), got {values!r}") from None
    if not out:
        raise ValueError(f"normalize {name} must hold at least one value, got an empty sequence")
    return out


def _check_normalize(normalize: Any) -> tuple[tuple[float, ...], tuple[float, ...]] | None:
    if normalize is None:
        return None
    if not isinstance(normalize, (tuple, list)) or len(normalize) != 2:
        raise ValueError(f"normalize must be None or a pair (mean, std) of per-channel sequences, got {normalize!r}")
    mean, std = _as_stats("mean", normalize[0]), _as_stats("std", normalize[1])
    if len(mean) != len(std):
        raise ValueError(f"normalize mean and std must have the same length, got {len(mean)} and {len(std)}")
    if any(s <= 0 for s in std):
        raise ValueError(f"normalize std values must all be > 0, got {std}")
    return mean, std


def normalize_uint8(
    x: torch.Tensor,
    mean: torch.Tensor | Sequence[float],
    std: torch.Tensor | Sequence[float],
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``(x / 255 - mean) / std`` for a uint8 tensor whose last three dims are C, H, W.

    Delegates to the workbook's one normaliser, :func:`helpers.pipeline.data.to_float_normalized`
    (torchvision's ``ToDtype(float32, scale=True)`` then ``Normalize(mean, std)``, bit for
    bit), whose statistics are cached per device and dtype: after the first call nothing
    is copied from the host, so a training step pays no hidden synchronisation here.

    Why it exists beside the one normaliser: ``to_float_normalized`` takes exactly one
    ``(N, C, H, W)`` batch, while the :class:`Prefetcher` normalises whatever uint8 tensors a
    batch holds. This adds only that job: a single image ``(C, H, W)`` and any leading dims
    ``(..., C, H, W)`` (flattened to ``(N, C, H, W)`` and viewed back), ``mean``/``std`` given
    as tensors, and its own error messages. For a plain ``(N, C, H, W)`` batch call
    ``to_float_normalized`` directly.
    """
    if not isinstance(x, torch.Tensor) or x.dtype != torch.uint8:
        got = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"x must be a uint8 tensor, got {got}")
    m, s = _as_stats("mean", mean), _as_stats("std", std)
    if x.dim() < 3 or x.shape[-3] != len(m):
        raise ValueError(
            f"normalize has {len(m)} channels but the uint8 tensor has shape {tuple(x.shape)}"
            " (expected ...CHW with that many channels)"
        )
    flat = x.reshape(-1, *x.shape[-3:])
    return to_float_normalized(flat, m, s, dtype=dtype).view(x.shape)


def move_batch(
    batch: Any,
    device: torch.device | str,
    *,
    non_blocking: bool = True,
    pin: bool = False,
) -> Any:
    """Move every tensor in ``batch`` to ``device`` (custom objects via their ``.to()``).

    With ``pin=True`` tensors that are not pinned yet are copied into pinned
    memory first (CUDA only); that costs a host copy, so prefer
    ``DataLoader(pin_memory=True)``, which pins in a background thread.
    """
    dev = torch.device(device)
    cuda = dev.type == "cuda"

    def move(t: torch.Tensor) -> torch.Tensor:
        if pin and cuda and t.device.type == "cpu" and not t.is_pinned():
            t = t.pin_memory()
        return t.to(dev, non_blocking=non_blocking and cuda)

    def move_obj(obj: Any) -> Any:
        if pin and cuda and hasattr(obj, "pin_memory"):
            obj = obj.pin_memory()
        if hasattr(obj, "to"):
            try:
                return obj.to(dev, non_blocking=non_blocking and cuda)
            except TypeError:
                return obj.to(dev)
        return obj

    return map_tensors(move, batch, obj_fn=move_obj)


# ---------------------------------------------------------------------------
# The prefetcher
# ---------------------------------------------------------------------------


class Prefetcher:
    """Wrap ``loader`` so that batches arrive on ``device``, copied one step ahead.

    Args:
        loader: any re-iterable of batches (a ``DataLoader``, a list, ...). Each
            ``iter(prefetcher)`` starts a fresh ``iter(loader)``.
        device: target device; ``None`` picks CUDA when available, else CPU.
        normalize: ``None`` or ``(mean, std)``: uint8 ``...CHW`` tensors become
            ``(x / 255 - mean) / std`` in ``dtype`` on the device (after the copy,
            so only the uint8 bytes cross the link).
        dtype: floating dtype produced by ``normalize``.
        pin_memory: pin tensors the loader did not pin (main thread, costs a host
            copy; ``DataLoader(pin_memory=True)`` is cheaper). CUDA only.
        safety: ``"record_stream"`` (default) or ``"event"``; see the module docstring.

    Attributes:
        stream: the one side stream (``None`` without CUDA).
        pinned_batches / pageable_batches: batches whose tensors were all pinned
            / not all pinned when the copy was issued (a pageable copy blocks the
            host and cannot overlap).
        wait_s: host seconds spent waiting for the underlying loader.
        made: (class attribute) how many prefetchers this process has created; the
            exercise check uses it to refuse this reference implementation as an answer.
    """

    made: int = 0

    def __init__(
        self,
        loader: Iterable[Any],
        device: torch.device | str | None = None,
        *,
        normalize: tuple[Sequence[float], Sequence[float]] | None = None,
        dtype: torch.dtype = torch.float32,
        pin_memory: bool = False,
        safety: str = "record_stream",
    ) -> None:
        if not hasattr(loader, "__iter__"):
            raise ValueError(f"loader must be an iterable of batches, got {type(loader).__name__}")
        if isinstance(loader, Iterator):
            raise ValueError(
                "loader must be re-iterable (a DataLoader, list, ...), not a one-shot iterator or generator"
            )
        if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise ValueError(f"dtype must be a floating torch dtype, got {dtype!r}")
        check_choice("safety", safety, SAFETY_MODES)
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("device is 'cuda' but no CUDA device is available; use device='cpu' or None")
        self.loader = loader
        self.normalize = _check_normalize(normalize)
        self.dtype = dtype
        self.pin_memory = bool(pin_memory)
        self.safety = safety
        self.cuda = self.device.type == "cuda"
        # ONE side stream per prefetcher (never one per epoch).
        self.stream: torch.cuda.Stream | None = torch.cuda.Stream(self.device) if self.cuda else None
        if self.normalize is not None:  # built (or found) now, once: no host copy per batch
            normalization_stats(*self.normalize, self.device, dtype)
        self.pinned_batches = 0
        self.pageable_batches = 0
        self.wait_s = 0.0
        Prefetcher.made += 1

    # -- helpers -------------------------------------------------------------

    @property
    def overlaps(self) -> bool:
        """True when copies can run on a side stream (a CUDA device)."""
        return self.stream is not None

    def __len__(self) -> int:
        try:
            return len(self.loader)  # type: ignore[arg-type]
        except TypeError:
            raise TypeError(f"the wrapped loader ({type(self.loader).__name__}) has no len()") from None

    def __repr__(self) -> str:
        mode = "side stream" if self.overlaps else "pass-through"
        return (
            f"Prefetcher(device={str(self.device)!r}, {mode}, normalize={self.normalize is not None},"
            f" pin_memory={self.pin_memory}, safety={self.safety!r})"
        )

    def _normalize(self, t: torch.Tensor) -> torch.Tensor:
        if self.normalize is None or t.dtype != torch.uint8:
            return t
        mean, std = self.normalize
        if t.dim() < 3 or t.shape[-3] != len(mean):
            raise ValueError(
                f"normalize has {len(mean)} channels but a uint8 tensor in the batch has shape"
                f" {tuple(t.shape)} (expected ...CHW with that many channels)"
            )
        return normalize_uint8(t, mean, std, self.dtype)

    def _count_pinned(self, batch: Any) -> None:
        tensors = [t for t in iter_tensors(batch) if t.device.type == "cpu"]
        if not tensors:
            return
        if self.pin_memory or all(t.is_pinned() for t in tensors):
            self.pinned_batches += 1
        else:
            self.pageable_batches += 1

    def _next_from(self, it: Iterator[Any]) -> tuple[bool, Any]:
        t0 = time.perf_counter()
        try:
            batch = next(it)
        except StopIteration:
            return False, None
        finally:
            self.wait_s += time.perf_counter() - t0
        return True, batch

    # -- CPU (and other non-CUDA devices): pass through --------------------

    def _iter_passthrough(self) -> Iterator[Any]:
        it = iter(self.loader)
        while True:
            ok, batch = self._next_from(it)
            if not ok:
                return
            if self.device.type != "cpu":
                batch = move_batch(batch, self.device, non_blocking=False)
            yield map_tensors(self._normalize, batch)

    # -- CUDA: copy the next batch on the side stream ----------------------

    def _issue(self, batch: Any) -> tuple[Any, torch.cuda.Event]:
        """Enqueue the copy (+ normalise) of ``batch`` on the side stream."""
        assert self.stream is not None
        self._count_pinned(batch)
        with torch.cuda.stream(self.stream):
            moved = move_batch(batch, self.device, non_blocking=True, pin=self.pin_memory)
            moved = map_tensors(self._normalize, moved)
            ready = torch.cuda.Event()
            ready.record(self.stream)
        return moved, ready

    def _hand_over(self, batch: Any, ready: torch.cuda.Event) -> Any:
        """Make the compute stream wait for ``batch`` and protect its memory."""
        consumer = torch.cuda.current_stream(self.device)
        consumer.wait_event(ready)
        if self.safety == "record_stream":
            seen: set[int] = set()

            def visit(obj: Any, depth: int = 0) -> None:
                if depth > 8 or id(obj) in seen:
                    return
                seen.add(id(obj))
                if isinstance(obj, torch.Tensor):
                    if obj.device.type == "cuda":
                        obj.record_stream(consumer)
                    return
                if not isinstance(obj, (list, tuple, dict, str, bytes)) and callable(
                    getattr(obj, "record_stream", None)
                ):
                    obj.record_stream(consumer)
                    return
                if isinstance(obj, dict):
                    children: Iterable[Any] = obj.values()
                elif isinstance(obj, (list, tuple)):
                    children = obj
                elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
                    children = [getattr(obj, f.name) for f in dataclasses.fields(obj)]
                elif hasattr(obj, "__dict__") and not isinstance(obj, type):
                    children = vars(obj).values()
                else:
                    return
                for c in children:
                    visit(c, depth + 1)

            visit(batch)
        return batch

    def _iter_cuda(self) -> Iterator[Any]:
        assert self.stream is not None
        consumer = torch.cuda.current_stream(self.device)
        # Tensors made on the compute stream before this epoch (mean/std, model
        # inputs) must be ready before the side stream reads them.
        self.stream.wait_stream(consumer)
        it = iter(self.loader)
        ok, batch = self._next_from(it)
        if not ok:
            return
        pending: tuple[Any, torch.cuda.Event] | None = self._issue(batch)
        while pending is not None:
            current, ready = pending
            self._hand_over(current, ready)
            ok, batch = self._next_from(it)
            if ok:
                if self.safety == "event":
                    # Everything queued on batches handed out earlier finishes
                    # before the side stream allocates the next batch.
                    freed = torch.cuda.Event()
                    freed.record(torch.cuda.current_stream(self.device))
                    self.stream.wait_event(freed)
                pending = self._issue(batch)  # batch i+1 copies while batch i computes
            else:
                pending = None
            yield current
            del current

    def __iter__(self) -> Iterator[Any]:
        if self.cuda:
            return self._iter_cuda()
        return self._iter_passthrough()


# ---------------------------------------------------------------------------
# Exercise checker: "write your own two-stage prefetcher"
# ---------------------------------------------------------------------------


@dataclasses.dataclass
class PrefetcherCheck:
    """The verdict of :func:`check_prefetcher`."""

    correct: bool
    messages: list[str]
    overlap_checked: bool = False
    overlap_ratio: float | None = None

    def __bool__(self) -> bool:
        return self.correct

    def __str__(self) -> str:
        head = "PASS" if self.correct else "FAIL"
        return head + ":\n  " + "\n  ".join(self.messages)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return False
        a, b = a.cpu(), b.cpu()
        return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)
    if type(a) is not type(b):
        return False
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if dataclasses.is_dataclass(a):
        return all(_same(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a))
    return a == b


class Pair(NamedTuple):
    """A namedtuple batch (images, labels), used by the checks and tests."""

    images: torch.Tensor
    labels: torch.Tensor


@dataclasses.dataclass
class Sample:
    """A dataclass batch with a tensor, a nested dict and a plain field."""

    x: torch.Tensor
    extra: dict[str, torch.Tensor]
    name: str = "sample"


def example_loaders(n_batches: int = 5, seed: int = 0) -> dict[str, list[Any]]:
    """Small re-iterable 'loaders' (lists of batches) with different structures, on CPU.

    Keys: ``"tensor"``, ``"tuple"``, ``"dict"``, ``"namedtuple"``, ``"dataclass"``,
    ``"uint8 images"``. Each batch is distinct, so order mistakes are caught.
    """
    g = torch.Generator().manual_seed(seed)
    out: dict[str, list[Any]] = {k: [] for k in ("tensor", "tuple", "dict", "namedtuple", "dataclass", "uint8 images")}
    for i in range(n_batches):
        x = torch.randn(4, 3, generator=g) + i
        y = torch.full((4,), i, dtype=torch.int64)
        img = torch.randint(0, 256, (2, 3, 4, 4), dtype=torch.uint8, generator=g)
        out["tensor"].append(x)
        out["tuple"].append((x, y))
        out["dict"].append({"x": x, "y": y, "meta": [y + 1, "tag"]})
        out["namedtuple"].append(Pair(img, y))
        out["dataclass"].append(Sample(x=x, extra={"y": y}, name=f"b{i}"))
        out["uint8 images"].append((img, y))
    return out


def _check_loaders() -> dict[str, list[Any]]:
    return example_loaders()


class ProbeBatch:
    """A batch that writes into a shared log when it is moved (its ``.to()`` is called).

    Used by :class:`ProbeLoader` to watch, on any machine, *when* a prefetcher asks
    for a batch and moves it, relative to when it hands the previous one over.
    """

    def __init__(self, index: int, x: torch.Tensor, log: list[tuple[str, int]]) -> None:
        self.index = index
        self.x = x
        self.log = log

    def to(self, *args: Any, **kwargs: Any) -> "ProbeBatch":
        """Log ``("move", index)`` and return a new probe holding the moved tensor."""
        self.log.append(("move", self.index))
        return ProbeBatch(self.index, self.x.to(*args, **kwargs), self.log)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ProbeBatch) and other.index == self.index and torch.equal(other.x.cpu(), self.x.cpu())

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"ProbeBatch({self.index}, on {self.x.device})"


class ProbeLoader:
    """A re-iterable loader of :class:`ProbeBatch` es that logs ``("request", i)`` when batch i is asked for."""

    def __init__(self, n_batches: int = 6) -> None:
        self.n = n_batches
        self.log: list[tuple[str, int]] = []

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Iterator[ProbeBatch]:
        for i in range(self.n):
            self.log.append(("request", i))
            yield ProbeBatch(i, torch.full((4,), float(i)), self.log)


#: A prefetcher keeps one batch in flight (two-stage); this many ahead is still accepted.
MAX_AHEAD = 2


def order_log(
    candidate: Any, device: torch.device | str = "cpu", n_batches: int = 6
) -> tuple[list[tuple[str, int]], list[Any]]:
    """Run ``candidate(loader, device)`` on a :class:`ProbeLoader`; return (the event log, the batches handed over).

    The log is one sequence of ``("request", i)`` (the loader was asked for batch i),
    ``("move", i)`` (batch i's ``.to()`` was called) and ``("handed", i)`` (the
    candidate handed batch i to the loop), in the order they happened.
    """
    loader = ProbeLoader(n_batches)
    handed: list[Any] = []
    for k, b in enumerate(candidate(loader, torch.device(device))):
        loader.log.append(("handed", k))
        handed.append(b)
    return loader.log, handed


def check_order(candidate: Any, device: torch.device | str = "cpu", n_batches: int = 6) -> list[str]:
    """Problems (empty: none) in *when* ``candidate(loader, device)`` requests and moves batches.

    Runs it on a :class:`ProbeLoader` and logs, in one sequence, when batch ``i`` is
    requested from the loader, when it is moved (``.to()``), and when the candidate
    hands it over. A prefetcher must, before handing over batch ``i`` (all but the
    last), already have requested **and moved** batch ``i + 1``, and it must not read
    more than :data:`MAX_AHEAD` batches ahead (it streams; it does not load the epoch).
    A pass-through (``(b for b in loader)``) requests batch ``i + 1`` only after handing
    over batch ``i``, and moves nothing: it fails. Works on every device.
    """
    log, handed = order_log(candidate, device, n_batches)
    problems: list[str] = []
    if len(handed) != n_batches:
        return [f"order check: gave {len(handed)} batches of {n_batches}"]
    if [getattr(b, "index", None) for b in handed] != list(range(n_batches)):
        return ["order check: the batches did not come back in the loader's order"]
    for i in range(n_batches - 1):
        at = log.index(("handed", i))
        before = log[:at]
        if ("request", i + 1) not in before:
            problems.append(
                f"batch {i + 1} was requested from the loader only after batch {i} was handed over: "
                "nothing is prefetched (a pass-through). Fetch and move the next batch before you "
                "yield the current one."
            )
            break
        if ("move", i + 1) not in before:
            moved = any(e[0] == "move" for e in log)
            problems.append(
                f"batch {i + 1} was requested before batch {i} was handed over, but "
                + (
                    "moved (.to(device)) only after it: queue the copy of the next batch before you yield "
                    "the current one"
                    if moved
                    else "no batch was ever moved with its own .to(device) (this loader's batches are a custom type: "
                    "use prefetch.move_batch(batch, device), which calls it)"
                )
            )
            break
        ahead = sum(1 for e in before if e[0] == "request") - (i + 1)
        if ahead > MAX_AHEAD:
            problems.append(
                f"{ahead} batches were read ahead of batch {i}: a prefetcher keeps one batch in flight "
                f"(it streams the epoch, it does not load it all first)"
            )
            break
    return problems


def _is_reference(candidate: Any) -> bool:
    return isinstance(candidate, type) and issubclass(candidate, Prefetcher)


def _gpu_error(exc: BaseException, dev: torch.device) -> bool:
    """A CUDA error on a strict GPU run (``WORKBOOK_REQUIRE_GPU=1``): it must propagate, not become a FAIL."""
    if dev.type != "cuda" or not require_gpu():
        return False
    accel = getattr(torch, "AcceleratorError", None)
    return (accel is not None and isinstance(exc, accel)) or (isinstance(exc, RuntimeError) and "CUDA" in str(exc))


def _delay_behind_copy(src: torch.Tensor, dev: torch.device) -> GpuDelay:
    """Queued do-nothing GPU work lasting about three copies of ``src`` (measured once with CUDA events), so
    that a consumer which forgets to wait for the copy reads the batch before it has arrived."""
    probe = torch.empty_like(src, device=dev)
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record(torch.cuda.current_stream(dev))  # on the copy's stream (no argument: the current device's)
    probe.copy_(src, non_blocking=True)
    e.record(torch.cuda.current_stream(dev))
    torch.cuda.synchronize(dev)
    return GpuDelay(dev, seconds=max(3 * s.elapsed_time(e) / 1e3, 0.002))  # it queues on dev, whatever is current


def check_race(
    candidate: Any, device: torch.device | str = "cuda", *, batch_mib: int = 64, n_batches: int = 8
) -> list[str]:
    """Problems (empty: none) seen when each batch is checked **on the consuming stream** as it arrives (CUDA).

    Batch ``i`` of a loader of large pinned batches holds the value ``i + 1`` everywhere.
    As soon as the candidate yields a batch, a check ``(x != i + 1).sum()`` is queued on
    the current (consuming) stream, and the batch is dropped at once. Two passes:

    1. the check runs at once: a prefetcher that forgets
       ``current_stream.wait_stream(side)`` (or an event wait) lets it read the batch
       before the side-stream copy has written it;
    2. the check is queued behind about three copies' worth of GPU work: a prefetcher
       that forgets ``record_stream`` (or an event wait before reusing memory) lets the
       allocator give the dropped batch's block to the next copy, which overwrites it
       before the check reads it.

    The counts are read after a final synchronisation. A correct prefetcher gives zero
    wrong elements in both passes, always; a racy one shows non-zero counts with these
    batch sizes (a race is not guaranteed to show on every run, so zero is necessary,
    not proof).
    """
    dev = torch.device(device)
    if dev.type != "cuda":
        raise ValueError("check_race needs a CUDA device")
    n = batch_mib * (1 << 20) // 4
    loader = [torch.full((n,), float(i + 1)).pin_memory() for i in range(n_batches)]
    delay = _delay_behind_copy(loader[0], dev)
    problems: list[str] = []
    for label, wait in (("checked at once", False), ("checked behind queued work", True)):
        counts: list[torch.Tensor] = []
        got = 0
        for i, x in enumerate(candidate(loader, dev)):
            if not isinstance(x, torch.Tensor) or x.device.type != "cuda":
                problems.append(
                    f"race check: batch {i} came back as {type(x).__name__} on "
                    f"{getattr(x, 'device', '?')}, not a CUDA tensor"
                )
                return problems
            if wait:
                delay()
            counts.append((x != float(i + 1)).sum())
            got += 1
            del x  # the consumer drops the batch at once: its memory may now be reused
        torch.cuda.synchronize(dev)
        wrong = [int(c) for c in counts]
        if got != n_batches:
            problems.append(f"race check ({label}): gave {got} batches of {n_batches}")
        elif any(wrong):
            first = next(i for i, w in enumerate(wrong) if w)
            why = (
                "the consuming stream read a batch before its copy had finished (make the current stream wait "
                "for the side stream, wait_stream or wait_event, before handing the batch over), or after its "
                "memory had been reused (record_stream)"
                if not wait
                else "a batch's memory was reused while the compute stream still had to read it: call "
                "x.record_stream(torch.cuda.current_stream(DEVICE)) on each batch you hand over"
            )
            problems.append(
                f"race check ({label}): batch {first} had {wrong[first]:,} wrong elements of {n:,} "
                f"when read on the consuming stream: {why}"
            )
    return problems


def _not_an_answer(candidate: Any, what_to_do: str, refused: "PrefetcherCheck") -> "PrefetcherCheck | None":
    """The verdict for a candidate that is no answer yet, not callable, or the reference; else None."""
    if candidate is None:
        return PrefetcherCheck(False, [f"no answer yet: {what_to_do}"])
    if not callable(candidate):
        return PrefetcherCheck(False, [f"expected a class or function, got {type(candidate).__name__}"])
    if _is_reference(candidate):
        return refused
    return None


def check_prefetcher(
    candidate: Any,
    device: torch.device | str | None = None,
    *,
    check_overlap: bool = True,
) -> PrefetcherCheck:
    """Check a reader's prefetcher: a real prefetcher, the same batches in order, re-iterable;
    safe and overlapped on a GPU.

    ``candidate`` is a class or a function called as ``candidate(loader, device)``
    that returns an iterable of batches on ``device``. The check

    1. refuses :class:`Prefetcher` itself (or anything that makes one): the exercise
       is to write it;
    2. on every device, watches *when* batches are requested and moved
       (:func:`check_order`): the next batch must be requested and moved before the
       current one is handed over, so a pass-through fails on a CPU too;
    3. runs it on several small loaders (tensors, tuples, dicts, namedtuples,
       dataclasses): every batch must equal the loader's batch, in order, with nothing
       missing or extra, and iterating again must give the same batches again;
    4. on a CUDA device: checks each batch on the consuming stream as soon as it is
       yielded, with batches large enough for a race to show (:func:`check_race`), and
       (``check_overlap``) measures how much of the copy time it hides.
    """
    refused = PrefetcherCheck(
        False,
        [
            "this is (or uses) helpers.pipeline.prefetch.Prefetcher, the chapter's reference: "
            "the exercise is to write your own (prefetch.move_batch is allowed)"
        ],
    )
    early = _not_an_answer(candidate, "define your prefetcher and pass it to the check", refused)
    if early is not None:
        return early
    dev = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    messages: list[str] = []
    made_before = Prefetcher.made
    try:
        order = check_order(candidate, dev)
    except Exception as exc:  # the reader's code may raise anything
        if _gpu_error(exc, dev):
            raise
        order = [f"order check: raised {type(exc).__name__}: {exc}"]
    if Prefetcher.made != made_before:
        return refused
    ok = not order
    messages.extend(order or ["order: batch i+1 is requested and moved before batch i is handed over"])
    for name, loader in _check_loaders().items():
        try:
            wrapped = candidate(loader, dev)
            for epoch in (1, 2):
                if epoch == 2 and isinstance(wrapped, Iterator):
                    # A generator (function) is one-shot: a new epoch is a new call.
                    wrapped = candidate(loader, dev)
                got = list(wrapped)
                if len(got) != len(loader):
                    ok = False
                    messages.append(f"{name}: epoch {epoch} gave {len(got)} batches, expected {len(loader)}")
                    break
                bad = [i for i, (g, e) in enumerate(zip(got, loader)) if not _same(g, move_batch(e, dev))]
                if bad:
                    ok = False
                    messages.append(f"{name}: epoch {epoch}: batch {bad[0]} differs (structure, order or values)")
                    break
            else:
                messages.append(f"{name}: same batches, same order, twice")
        except Exception as exc:  # the reader's code may raise anything
            if _gpu_error(exc, dev):
                raise
            ok = False
            messages.append(f"{name}: raised {type(exc).__name__}: {exc}")
    if Prefetcher.made != made_before:
        return refused
    result = PrefetcherCheck(ok, messages)
    if dev.type == "cuda" and torch.cuda.is_available():
        if ok:
            try:
                race = check_race(candidate, dev)
            except Exception as exc:  # the reader's code may raise anything
                if _gpu_error(exc, dev):
                    raise
                race = [f"race check: raised {type(exc).__name__}: {exc}"]
            messages.extend(
                race or ["each batch was right when read on the consuming stream, at once and behind queued work"]
            )
            result.correct = ok = not race
        if ok and check_overlap:
            ratio = prefetch_overlap_ratio(candidate, dev)
            result.overlap_checked = True
            result.overlap_ratio = ratio
            verdict = "overlaps" if ratio >= 0.3 else "does NOT overlap"
            messages.append(f"overlap on {dev}: {ratio:.0%} of the copy time hidden behind compute -> {verdict}")
            result.correct = ratio >= 0.3
    elif check_overlap:
        messages.append(
            "overlap and stream safety not checked: no CUDA device here (order and batches checked on the CPU)"
        )
    return result


# ---------------------------------------------------------------------------
# The chapter's own prefetcher (chapter 05's `pipeline` cells): stream test doubles and its check
# ---------------------------------------------------------------------------
#
# Chapter 05's reader writes ``class Prefetcher`` in a notebook cell: batches are ``(x, y)`` pairs
# (uint8 images, labels), copied on a side stream with ``non_blocking=True`` and normalised there,
# handed over after ``current.wait_stream(side)`` with ``record_stream(current)``. Streams exist only
# on CUDA, so to check that code on *any* machine, :func:`stream_protocol` runs it under test doubles:
# ``torch.cuda.Stream``, ``torch.cuda.stream``, ``torch.cuda.current_stream``, ``torch.cuda.Event`` and
# ``Tensor.record_stream`` are replaced, for the duration of the run only, by objects that write what
# was asked of them into one log, and ``Tensor.to`` logs when a loader's tensor is moved and under
# which stream. No GPU work happens; the log says whether the *protocol* is right. On a GPU,
# :func:`check_pipeline_prefetcher` then also runs the real thing (values, a race check, overlap).

#: The stream a prefetcher's consumer runs on, in the test doubles' logs.
CONSUMER = "current stream"


class _Protocol:
    """The log of one run under the stream doubles (module-global while active, so cached fakes log here)."""

    def __init__(self) -> None:
        self.log: list[tuple[Any, ...]] = []
        self.consumer = _FakeStream(CONSUMER)
        self.current: _FakeStream = self.consumer
        self.streams_made = 0
        self.probes: dict[int, tuple[int, str]] = {}  # id(loader tensor) -> (batch index, "x" or "y")


_ACTIVE: _Protocol | None = None
_STREAM_NUMBERS = itertools.count(1)  # fakes may outlive a run (a reader's cache): names stay unique


def _log(*entry: Any) -> int:
    if _ACTIVE is not None:
        _ACTIVE.log.append(entry)
        return len(_ACTIVE.log) - 1
    return -1


class _FakeStream:
    """A stand-in for ``torch.cuda.Stream``: records waits instead of queuing them."""

    def __init__(self, name: str) -> None:
        self.name = name

    def wait_stream(self, other: "_FakeStream") -> None:
        _log("wait", self.name, getattr(other, "name", repr(other)), len(_ACTIVE.log) if _ACTIVE else -1)

    def wait_event(self, event: "_FakeEvent") -> None:
        event.wait(self)

    def record_event(self, event: "_FakeEvent | None" = None) -> "_FakeEvent":
        event = event if event is not None else _FakeEvent()
        event.record(self)
        return event

    def synchronize(self) -> None:
        _log("synchronize", self.name)

    def query(self) -> bool:
        return True

    def __repr__(self) -> str:
        return f"<test double of a CUDA stream: {self.name}>"


class _FakeEvent:
    """A stand-in for ``torch.cuda.Event``: remembers where in the log it was recorded."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.stream: str | None = None
        self.at = -1

    def record(self, stream: _FakeStream | None = None) -> None:
        stream = stream if stream is not None else (_ACTIVE.current if _ACTIVE else None)
        self.stream = getattr(stream, "name", None)
        self.at = _log("record event", self.stream)

    def wait(self, stream: _FakeStream | None = None) -> None:
        stream = stream if stream is not None else (_ACTIVE.current if _ACTIVE else None)
        if self.stream is not None:
            _log("wait", getattr(stream, "name", None), self.stream, self.at)

    def synchronize(self) -> None:
        _log("synchronize", self.stream)

    def query(self) -> bool:
        return True


class _FakeStreamContext:
    def __init__(self, stream: Any) -> None:
        self.stream = stream
        self.before: _FakeStream | None = None

    def __enter__(self) -> Any:
        if _ACTIVE is not None and self.stream is not None:
            self.before, _ACTIVE.current = _ACTIVE.current, self.stream
        return self.stream

    def __exit__(self, *exc: Any) -> None:
        if _ACTIVE is not None and self.before is not None:
            _ACTIVE.current = self.before


def _make_stream(device: Any = None, priority: int = 0, **kwargs: Any) -> _FakeStream:
    assert _ACTIVE is not None
    _ACTIVE.streams_made += 1
    stream = _FakeStream(f"side stream {next(_STREAM_NUMBERS)}")
    _log("new stream", stream.name)
    return stream


@contextlib.contextmanager
def stream_doubles() -> Iterator[_Protocol]:
    """Replace the CUDA stream API by logging test doubles while the ``with`` block runs (any machine).

    Inside, ``torch.cuda.Stream(...)`` makes a fake side stream, ``torch.cuda.current_stream()``
    is :data:`CONSUMER` (or the stream of an enclosing ``torch.cuda.stream(s)``),
    ``wait_stream`` / ``wait_event`` / ``Event.record`` and ``Tensor.record_stream`` are logged,
    and ``Tensor.to`` logs a move when it is called on a tensor registered in ``probes``.
    Everything is restored on exit, also after an exception.
    """
    global _ACTIVE
    if _ACTIVE is not None:
        raise RuntimeError("stream_doubles() is already active (it does not nest)")
    proto = _Protocol()
    original_to = torch.Tensor.to

    def logged_to(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        hit = proto.probes.get(id(self))
        target = kwargs.get("device", args[0] if args else None)
        if hit is not None and isinstance(target, (str, int, torch.device)):  # a move, not x.to(torch.float32)
            _log("move", hit[0], hit[1], proto.current.name, bool(kwargs.get("non_blocking", False)))
        return original_to(self, *args, **kwargs)

    def record_stream(self: torch.Tensor, stream: Any) -> None:
        _log("record_stream", id(self), getattr(stream, "name", repr(stream)))

    patches: list[contextlib.AbstractContextManager[Any]] = [
        mock.patch.object(torch.cuda, "Stream", _make_stream),
        mock.patch.object(torch.cuda, "Event", _FakeEvent),
        mock.patch.object(torch.cuda, "stream", _FakeStreamContext),
        mock.patch.object(torch.cuda, "current_stream", lambda device=None: proto.current),
        mock.patch.object(torch.cuda, "default_stream", lambda device=None: proto.consumer),
        mock.patch.object(torch.cuda, "synchronize", lambda device=None: _log("synchronize", "device")),
        mock.patch.object(torch.Tensor, "to", logged_to),
        mock.patch.object(torch.Tensor, "record_stream", record_stream),
    ]
    with contextlib.ExitStack() as stack:
        for p in patches:
            stack.enter_context(p)
        _ACTIVE = proto
        try:
            yield proto
        finally:
            _ACTIVE = None


class PairProbeLoader:
    """A re-iterable loader of ``(uint8 images, labels)`` batches that logs ``("request", i)`` per batch.

    Batch ``i``'s images are ``(2, 3, 4, 4)`` uint8 values derived from ``i`` and its labels are
    ``i``, so order mistakes show. Its tensors are registered with an active :func:`stream_doubles`
    so that their ``.to()`` calls are logged as moves.
    """

    def __init__(self, n_batches: int = 4, proto: _Protocol | None = None) -> None:
        g = torch.Generator().manual_seed(5)
        self.batches = [
            (
                torch.randint(0, 256, (2, 3, 4, 4), dtype=torch.uint8, generator=g),
                torch.full((2,), i, dtype=torch.int64),
            )
            for i in range(n_batches)
        ]
        self.proto = proto
        if proto is not None:
            for i, (x, y) in enumerate(self.batches):
                proto.probes[id(x)], proto.probes[id(y)] = (i, "x"), (i, "y")

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for i, batch in enumerate(self.batches):
            _log("request", i)
            yield batch


def stream_protocol(
    candidate: Any, n_batches: int = 4, epochs: int = 1
) -> tuple[list[tuple[Any, ...]], list[list[Any]], int]:
    """Run ``candidate(loader, "cpu")`` under :func:`stream_doubles` on a :class:`PairProbeLoader`.

    Returns ``(log, handed, streams_made)``: the log of requests, moves, new streams, waits,
    events and ``record_stream`` calls, with ``("handed", epoch, i, ids of the batch's tensors)``
    each time the candidate hands batch ``i`` to the loop; the batches handed over, per epoch;
    and how many side streams were made. The same object is iterated ``epochs`` times (a
    generator function is called again per epoch).
    """
    handed: list[list[Any]] = []
    with stream_doubles() as proto:
        loader = PairProbeLoader(n_batches, proto)
        wrapped = candidate(loader, torch.device("cpu"))
        for epoch in range(epochs):
            if epoch and isinstance(wrapped, Iterator):
                wrapped = candidate(loader, torch.device("cpu"))
            _log("epoch", epoch)
            got: list[Any] = []
            for k, batch in enumerate(wrapped):
                ids = [id(t) for t in iter_tensors(batch)]
                _log("handed", epoch, k, ids)
                got.append(batch)
            handed.append(got)
        return proto.log, handed, proto.streams_made


def format_protocol(log: Sequence[tuple[Any, ...]], width: int = 100) -> str:
    """The protocol log, wrapped, one block per hand-over: what was asked of the stream API since the previous one."""
    import textwrap

    def where(name: str) -> str:
        return "the current stream" if name == CONSUMER else name

    def says(e: tuple[Any, ...]) -> str | None:
        kind = e[0]
        if kind == "request":
            return f"request {e[1]}"
        if kind == "move":
            return f"copy {e[2]}{e[1]} on {where(e[3])}" + (" (non_blocking)" if e[4] else " (blocking)")
        if kind == "new stream":
            return f"make {e[1]}"
        if kind == "wait":
            return f"{where(e[1])} waits for {where(e[2])}"
        if kind == "record event":
            return f"event on {where(e[1])}"
        if kind == "record_stream":
            return f"record_stream({where(e[2])})"
        if kind == "synchronize":
            return f"synchronize {e[1]}"
        return None

    blocks: list[str] = []
    pending: list[str] = []
    for e in log:
        if e[0] == "handed":
            head = f"hand over batch {e[2]} after: "
            blocks.append(head + (", ".join(pending) if pending else "nothing"))
            pending = []
        else:
            text = says(e)
            if text is not None:
                pending.append(text)
    if pending:
        blocks.append("after the last hand-over: " + ", ".join(pending))
    out = []
    for block in blocks:
        block = _count_repeats(block)
        out.append(textwrap.fill(block, width=width, initial_indent="  ", subsequent_indent="      "))
    return "\n".join(out)


def _count_repeats(block: str) -> str:
    """``a, a, b`` -> ``a (x2), b``."""
    head, _, rest = block.partition(": ")
    items = rest.split(", ")
    out: list[str] = []
    counts: list[int] = []
    for it in items:
        if out and out[-1] == it:
            counts[-1] += 1
        else:
            out.append(it)
            counts.append(1)
    return head + ": " + ", ".join(f"{it} (x{n})" if n > 1 else it for it, n in zip(out, counts))


def check_protocol(log: Sequence[tuple[Any, ...]], handed: Sequence[Sequence[Any]], n_batches: int) -> list[str]:
    """Problems (empty: none) in a :func:`stream_protocol` log of a side-stream prefetcher of ``(x, y)`` batches.

    A prefetcher that overlaps safely: (1) requests **and moves** batch ``i + 1`` before it hands
    over batch ``i``, reading at most :data:`MAX_AHEAD` ahead; (2) moves every tensor with
    ``non_blocking=True`` under ``torch.cuda.stream(side)``, a side stream made once (not per
    epoch); (3) makes the side stream wait for the current stream before its first copy;
    (4) before handing batch ``i`` over, makes the current stream wait for the side stream
    (``wait_stream``, or ``wait_event`` on an event recorded after batch ``i``'s copy); and (5)
    calls ``record_stream(current)`` on every tensor it hands over.
    """
    problems: list[str] = []
    events = list(log)
    if [len(h) for h in handed] != [n_batches] * len(handed):
        return [f"gave {[len(h) for h in handed]} batches per epoch, expected {n_batches}"]
    moves = [(k, e) for k, e in enumerate(events) if e[0] == "move"]
    at_handed = {(e[1], e[2]): k for k, e in enumerate(events) if e[0] == "handed"}
    # (1) order, epoch 0
    for i in range(n_batches - 1):
        before = events[: at_handed[(0, i)]]
        if ("request", i + 1) not in before:
            problems.append(
                f"batch {i + 1} was requested only after batch {i} was handed over: nothing is "
                "prefetched (a pass-through). Request and copy the next batch before you yield the "
                "current one."
            )
            break
        if not any(e[0] == "move" and e[1] == i + 1 for e in before):
            problems.append(
                f"batch {i + 1} was requested before batch {i} was handed over but moved only after it: "
                "queue its copy before you yield the current batch"
                if moves
                else "no batch was moved with .to(device): copy x and y with .to(device, non_blocking=True)"
            )
            break
        ahead = sum(1 for e in before if e[0] == "request") - (i + 1)
        if ahead > MAX_AHEAD:
            problems.append(f"{ahead} batches were read ahead of batch {i}: keep one batch in flight")
            break
    if not moves:
        return problems or ["no batch was moved with .to(device): copy x and y with .to(device, non_blocking=True)"]
    # (2) where and how the copies are queued
    on_current = [e for _, e in moves if e[3] == CONSUMER]
    if on_current:
        problems.append(
            f"batch {on_current[0][1]}'s {on_current[0][2]} was moved on the current stream: queue the "
            "copies inside `with torch.cuda.stream(side):` so they can overlap with compute"
        )
    blocking = [e for _, e in moves if not e[4]]
    if blocking:
        problems.append(
            f"batch {blocking[0][1]}'s {blocking[0][2]} was moved without non_blocking=True: the copy "
            "call would hold the CPU until the copy is done"
        )
    second = [k for k, e in enumerate(events) if e == ("epoch", 1)]
    if second and any(e[0] == "new stream" for e in events[second[0] :]):
        problems.append(
            "a new side stream was made for the second epoch: make it once (in __init__, or cached "
            "per device) and reuse it; a stream per epoch makes the caching allocator keep memory for "
            "each of them"
        )
    # (3) the side stream waits for the current stream before its first copy
    side_moves = [(k, e) for k, e in moves if e[3] != CONSUMER]
    if side_moves:
        k0, e0 = side_moves[0]
        if not any(e[0] == "wait" and e[1] == e0[3] and e[2] == CONSUMER for e in events[:k0]):
            problems.append(
                "the side stream did not wait for the current stream before its first copy: call "
                "side.wait_stream(torch.cuda.current_stream(device)) at the start of __iter__ "
                "(work queued earlier on the current stream must come first)"
            )
    # (4) the current stream waits for batch i's copy before batch i is handed over; (5) record_stream
    for (_epoch, i), at in sorted(at_handed.items()):
        mine = [(k, e) for k, e in side_moves if e[1] == i and k < at]
        if not mine:
            continue
        last_move = max(k for k, _ in mine)
        streams = {e[3] for _, e in mine}
        waited = any(
            e[0] == "wait" and e[1] == CONSUMER and e[2] in streams and e[3] > last_move for e in events[last_move:at]
        )
        if not waited:
            problems.append(
                f"batch {i} was handed over before the current stream waited for its copy: call "
                "torch.cuda.current_stream(device).wait_stream(side) before you hand a batch over"
            )
            break
        ids = events[at][3]
        first_move = min(k for k, _ in mine)
        recorded = {e[1] for e in events[first_move:at] if e[0] == "record_stream" and e[2] == CONSUMER}
        if any(t not in recorded for t in ids):
            problems.append(
                f"batch {i} was handed over without record_stream(current) on each of its tensors: "
                "they were made on the side stream, so the caching allocator could give their memory "
                "to the next copy while the current stream still reads them"
            )
            break
    return problems


def _pair_reference(loader: Iterable[Any], device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """What a prefetcher of ``(uint8, labels)`` batches must hand over: the reference :class:`Prefetcher`'s batches."""
    return [tuple(b) for b in Prefetcher(loader, device, normalize=(MEAN, STD))]


def _pair_problems(got: Sequence[Any], want: Sequence[tuple[torch.Tensor, torch.Tensor]], epoch: int) -> list[str]:
    if len(got) != len(want):
        return [f"epoch {epoch}: gave {len(got)} batches, expected {len(want)}"]
    for i, (g, (x_ref, y_ref)) in enumerate(zip(got, want)):
        if not (isinstance(g, (tuple, list)) and len(g) == 2 and all(isinstance(t, torch.Tensor) for t in g)):
            return [f"epoch {epoch}: batch {i} is a {type(g).__name__}, not an (x, y) pair of tensors"]
        x, y = g
        if x.dtype != x_ref.dtype or x.shape != x_ref.shape or x.device.type != x_ref.device.type:
            return [
                f"epoch {epoch}: batch {i}'s x is {x.dtype} {tuple(x.shape)} on {x.device}, expected "
                f"{x_ref.dtype} {tuple(x_ref.shape)} on {x_ref.device.type} (normalise the uint8 images)"
            ]
        if not torch.allclose(x.cpu(), x_ref.cpu(), rtol=0, atol=1e-5) or not torch.equal(y.cpu(), y_ref.cpu()):
            return [
                f"epoch {epoch}: batch {i} differs from the reference's (order, or normalisation: use "
                "data.MEAN and data.STD as helpers.pipeline.data.to_float_normalized does)"
            ]
    return []


def check_pipeline_race(
    candidate: Any, device: torch.device | str = "cuda", *, batch_mib: int = 64, n_batches: int = 8
) -> list[str]:
    """:func:`check_race` for a prefetcher of ``(uint8 images, labels)`` batches that normalises them (CUDA).

    Batch ``i`` holds the value ``10 + 20 i`` in every pixel and the label ``i``; each handed
    batch is compared, on the consuming stream, with the normalised value, at once and behind
    queued GPU work, then dropped. Zero wrong elements is necessary (a race need not show on
    every run), non-zero is a bug: a missing ``wait_stream`` or ``record_stream``.
    """
    dev = torch.device(device)
    if dev.type != "cuda":
        raise ValueError("check_pipeline_race needs a CUDA device")
    side = max(8, int((batch_mib * (1 << 20) / (3 * 64)) ** 0.5))
    shape = (64, 3, side, side)
    loader = [
        (
            torch.full(shape, 10 + 20 * i, dtype=torch.uint8).pin_memory(),
            torch.full((64,), i, dtype=torch.int64).pin_memory(),
        )
        for i in range(n_batches)
    ]
    refs = [
        to_float_normalized(torch.full((1, 3, 1, 1), 10 + 20 * i, dtype=torch.uint8, device=dev))
        for i in range(n_batches)
    ]
    delay = _delay_behind_copy(loader[0][0], dev)
    problems: list[str] = []
    for label, wait in (("checked at once", False), ("checked behind queued work", True)):
        counts: list[torch.Tensor] = []
        for i, batch in enumerate(candidate(loader, dev)):
            x, y = batch
            if x.device.type != "cuda":
                return [f"race check: batch {i} came back on {x.device}, not on the CUDA device"]
            if wait:
                delay()
            counts.append(((x - refs[i]).abs() > 1e-3).sum() + (y != i).sum())
            del batch, x, y  # the consumer drops the batch at once: its memory may now be reused
        torch.cuda.synchronize(dev)
        wrong = [int(c) for c in counts]
        if len(wrong) != n_batches:
            problems.append(f"race check ({label}): gave {len(wrong)} batches of {n_batches}")
        elif any(wrong):
            first = next(i for i, w in enumerate(wrong) if w)
            why = (
                "the current stream read a batch before its copy had finished: call "
                "current.wait_stream(side) before handing it over"
                if not wait
                else "a batch's memory was reused while the current stream still had to read it: call "
                "t.record_stream(current) on each tensor you hand over"
            )
            problems.append(
                f"race check ({label}): batch {first} had {wrong[first]:,} wrong elements when read "
                f"on the current stream: {why}"
            )
    return problems


def check_pipeline_prefetcher(
    candidate: Any, device: torch.device | str | None = None, *, check_overlap: bool = True, n_batches: int = 4
) -> PrefetcherCheck:
    """Check the reader's chapter-05 ``Prefetcher`` (``(uint8 x, y)`` batches in, normalised on the device out).

    ``candidate(loader, device)`` must return an iterable of ``(x, y)`` pairs. The check

    1. refuses :class:`Prefetcher` itself (or anything that makes one): it is the reference;
    2. on every machine, runs the candidate under the stream test doubles
       (:func:`stream_protocol`, two epochs of one object) and checks the protocol
       (:func:`check_protocol`): prefetching order, copies on a side stream made once with
       ``non_blocking=True``, the side stream waiting for the current one first, the current
       stream waiting before each hand-over, ``record_stream`` on what is handed over; and
       compares every batch with the reference :class:`Prefetcher`'s (normalised with
       ``data.MEAN`` and ``data.STD``);
    3. on a CUDA device: the same comparison with real streams, :func:`check_pipeline_race`,
       and (``check_overlap``) how much of the copy time it hides
       (:func:`prefetch_overlap_ratio` with pairs).
    """
    refused = PrefetcherCheck(
        False,
        [
            "this is (or uses) helpers.pipeline.prefetch.Prefetcher, the chapter's reference: "
            "hand in the Prefetcher you wrote in the chapter"
        ],
    )
    early = _not_an_answer(candidate, "set answer = Prefetcher (the class you wrote) and run again", refused)
    if early is not None:
        return early
    dev = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    made_before = Prefetcher.made
    messages: list[str] = []
    try:
        log, handed, _ = stream_protocol(candidate, n_batches, epochs=2)
        problems = check_protocol(log, handed, n_batches)
    except Exception as exc:  # the reader's code may raise anything
        problems = [f"under the stream test doubles it raised {type(exc).__name__}: {exc}"]
        handed = []
    if Prefetcher.made != made_before:
        return refused
    if not problems:
        want = _pair_reference(PairProbeLoader(n_batches).batches, torch.device("cpu"))
        for epoch, got in enumerate(handed):
            problems += _pair_problems(got, want, epoch + 1)
    messages.extend(
        problems
        or [
            "order: batch i+1 is requested and copied before batch i is handed over",
            "streams: copies with non_blocking=True on one side stream, made once, which first waits for the "
            "current stream; the current stream waits before each hand-over; record_stream on every tensor "
            "handed over (checked with test doubles of the CUDA stream API)",
            "values: the reference prefetcher's batches (normalised with data.MEAN and data.STD), in order, twice",
        ]
    )
    result = PrefetcherCheck(not problems, messages)
    if dev.type != "cuda":
        if check_overlap:
            messages.append("real streams, races and overlap not checked: no CUDA device here")
        return result
    if not torch.cuda.is_available():
        raise ValueError("device is 'cuda' but no CUDA device is available")
    if result.correct:
        try:
            loader = [(x.pin_memory(), y.pin_memory()) for x, y in PairProbeLoader(n_batches).batches]
            want = _pair_reference(loader, dev)
            made_before = Prefetcher.made
            real = _pair_problems([tuple(b) for b in candidate(loader, dev)], want, 1)
            race = check_pipeline_race(candidate, dev)
            if Prefetcher.made != made_before:
                return refused
        except Exception as exc:  # the reader's code may raise anything
            if _gpu_error(exc, dev):
                raise
            real, race = [f"on {dev}: raised {type(exc).__name__}: {exc}"], []
        messages.extend(
            real + race
            or [
                f"on {dev}: the same batches with real streams, and each batch right when "
                "read on the current stream, at once and behind queued work"
            ]
        )
        result.correct = not (real or race)
    if result.correct and check_overlap:
        ratio = prefetch_overlap_ratio(candidate, dev, pairs=True)
        result.overlap_checked, result.overlap_ratio = True, ratio
        messages.append(
            f"overlap on {dev}: {ratio:.0%} of the copy time hidden behind compute -> "
            + ("overlaps" if ratio >= 0.3 else "does NOT overlap")
        )
        result.correct = ratio >= 0.3
    return result


# ---------------------------------------------------------------------------
# How much of the copy a prefetcher hides (GPU) — for the checkers above (and _loop_time for overlap)
# ---------------------------------------------------------------------------


def _first_tensor(batch: Any) -> torch.Tensor:
    for t in iter_tensors(batch):
        return t
    raise ValueError("the prefetcher yielded a batch with no tensor in it")


def _loop_time(batches: Iterable[Any], compute: Callable[[torch.Tensor], torch.Tensor], dev: torch.device) -> float:
    torch.cuda.synchronize(dev)
    t0 = time.perf_counter()
    for b in batches:
        compute(_first_tensor(b))
    torch.cuda.synchronize(dev)
    return time.perf_counter() - t0


def prefetch_overlap_ratio(
    candidate: Any,
    device: torch.device | str = "cuda",
    *,
    batch_mib: int = 32,
    n_batches: int = 8,
    repeats: int = 3,
    pairs: bool = False,
) -> float:
    """Share (0-1) of the copy time a prefetcher hides behind compute (CUDA only).

    Times, with a synchronised wall clock: copying all batches alone (``t_copy``),
    computing on device-resident batches alone (``t_compute``, calibrated to about
    1.5x one copy), and iterating ``candidate(loader, device)`` while computing
    (``t_both``). Ratio = ``(t_copy + t_compute - t_both) / min(t_copy, t_compute)``,
    clipped to [0, 1]; the median of ``repeats`` runs. The loader holds pinned batches:
    float32 tensors, or with ``pairs=True`` chapter 05's ``(uint8 images, labels)`` pairs,
    whose "copy" is the copy plus the normalisation on the device (what the chapter's
    prefetcher queues on its side stream).
    """
    dev = resolve_device(device)
    if dev.type != "cuda":
        raise ValueError("prefetch_overlap_ratio needs a CUDA device")
    n = check_int("batch_mib", batch_mib, 1, 1024) * MiB // 4
    n_batches = check_int("n_batches", n_batches, 2, 256)
    if pairs:
        side = max(8, int((4 * n / (3 * 64)) ** 0.5))  # 64 uint8 images of batch_mib MiB in all
        loader: list[Any] = [
            (
                torch.full((64, 3, side, side), i, dtype=torch.uint8).pin_memory(),
                torch.full((64,), i, dtype=torch.int64).pin_memory(),
            )
            for i in range(n_batches)
        ]

        def copy_all() -> None:
            for x, y in loader:
                to_float_normalized(x.to(dev, non_blocking=True))
                y.to(dev, non_blocking=True)

        resident: list[Any] = [(to_float_normalized(x.to(dev)), y.to(dev)) for x, y in loader]
    else:
        loader = [torch.full((n,), float(i)).pin_memory() for i in range(n_batches)]
        dst = torch.empty(n, device=dev)

        def copy_all() -> None:
            for b in loader:
                dst.copy_(b, non_blocking=True)

        resident = [b.to(dev) for b in loader]
    copy_all()  # warm-up
    torch.cuda.synchronize(dev)
    t0 = time.perf_counter()
    copy_all()
    torch.cuda.synchronize(dev)
    with torch.cuda.device(dev):  # calibrated_compute's events are recorded with no stream: make them dev's
        compute = calibrated_compute(dev, 1.5 * (time.perf_counter() - t0) / n_batches)
    ratios = []
    list(candidate(loader, dev))  # warm-up
    for _ in range(check_int("repeats", repeats, 1, 20)):
        torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        copy_all()
        torch.cuda.synchronize(dev)
        t_copy = time.perf_counter() - t0
        t_compute = _loop_time(resident, compute, dev)
        t_both = _loop_time(candidate(loader, dev), compute, dev)
        ratios.append((t_copy + t_compute - t_both) / max(min(t_copy, t_compute), 1e-9))
    return max(0.0, min(1.0, statistics.median(ratios)))
