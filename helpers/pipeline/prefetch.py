"""The reference side-stream prefetcher (chapters 05-07): batch i+1 is copied on its own CUDA stream while batch i
computes. It overlaps only from pinned memory, on a non-default stream; one stream per prefetcher (a new one per epoch
leaks reserved memory: timm issue #2781); every tensor handed out is ``record_stream``-ed to the compute stream.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch

from .data import check_stats, normalization_stats, to_float_normalized

_END = object()  # the end of a loader (a batch may be None)
_PLAIN = (str, bytes, int, float, bool, type(None))


def map_tensors(fn: Callable[[torch.Tensor], Any], batch: Any, *, obj_fn: Callable[[Any], Any] | None = None) -> Any:
    """Apply ``fn`` to every tensor in ``batch`` (lists, tuples, namedtuples, dicts, dataclasses), same structure;
    other objects go to ``obj_fn`` (e.g. their ``.to()``) or come back unchanged."""
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, _PLAIN):
        return batch
    if isinstance(batch, (list, tuple)):
        items = [map_tensors(fn, b, obj_fn=obj_fn) for b in batch]
        if hasattr(type(batch), "_fields"):  # a namedtuple
            return type(batch)(*items)
        return tuple(items) if isinstance(batch, tuple) else items
    if isinstance(batch, dict):
        pairs = [(k, map_tensors(fn, v, obj_fn=obj_fn)) for k, v in batch.items()]
        try:
            return type(batch)(pairs)
        except TypeError:
            return dict(pairs)
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        fields = dataclasses.fields(batch)
        moved = {f.name: map_tensors(fn, getattr(batch, f.name), obj_fn=obj_fn) for f in fields}
        new = dataclasses.replace(batch, **{f.name: moved[f.name] for f in fields if f.init})
        for f in fields:
            if not f.init:
                object.__setattr__(new, f.name, moved[f.name])
        return new
    return obj_fn(batch) if obj_fn is not None else batch


def _walk(batch: Any, stop: Callable[[Any], bool], depth: int = 0) -> Iterator[Any]:
    """Tensors (and objects ``stop`` picks) reachable in ``batch``, attributes too; 8 levels at most (cycles)."""
    if depth > 8 or isinstance(batch, _PLAIN):
        return
    if isinstance(batch, torch.Tensor) or stop(batch):
        yield batch
        return
    if isinstance(batch, dict):
        children: Iterable[Any] = batch.values()
    elif isinstance(batch, (list, tuple)):
        children = batch
    elif dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        children = [getattr(batch, f.name) for f in dataclasses.fields(batch)]
    elif hasattr(batch, "__dict__") and not isinstance(batch, type):
        children = vars(batch).values()
    else:
        return
    for c in children:
        yield from _walk(c, stop, depth + 1)


def iter_tensors(batch: Any) -> Iterator[torch.Tensor]:
    """Every tensor reachable in ``batch`` (containers, dataclasses, object attributes)."""
    return _walk(batch, lambda obj: False)


def _protects_itself(obj: Any) -> bool:
    return not isinstance(obj, (list, tuple, dict)) and callable(getattr(obj, "record_stream", None))


def move_batch(batch: Any, device: torch.device | str, *, non_blocking: bool = True) -> Any:
    """Every tensor in ``batch`` (custom objects via their ``.to()``) on ``device``; ``non_blocking`` on CUDA only."""
    dev = torch.device(device)
    non_blocking = non_blocking and dev.type == "cuda"

    def move(obj: Any) -> Any:  # a tensor, or a custom object with a tensor's ``.to(device, non_blocking=)``
        return obj.to(dev, non_blocking=non_blocking) if hasattr(obj, "to") else obj

    return map_tensors(move, batch, obj_fn=move)


class Prefetcher:
    """Batches of a re-iterable ``loader`` on ``device`` (``None``: CUDA if present), copied one step ahead;
    ``normalize=(mean, std)`` makes uint8 ``...CHW`` tensors ``dtype`` floats after the copy (a quarter of the bytes
    cross the link). Without CUDA, each batch is moved (CPU tensors stay) and normalised in turn. ``made`` counts
    instances: the exercise check refuses this one."""

    made: int = 0

    def __init__(
        self,
        loader: Iterable[Any],
        device: torch.device | str | None = None,
        *,
        normalize: tuple[Sequence[float], Sequence[float]] | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        if not hasattr(loader, "__iter__"):
            raise ValueError(f"loader must be an iterable of batches, got {type(loader).__name__}")
        if isinstance(loader, Iterator):
            raise ValueError(
                "loader must be re-iterable (a DataLoader, list, ...), not a one-shot iterator or generator"
            )
        if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise ValueError(f"dtype must be a floating torch dtype, got {dtype!r}")
        self.device = torch.device(device if device is not None else "cuda" if torch.cuda.is_available() else "cpu")
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("device is 'cuda' but no CUDA device is available; use device='cpu' or None")
        if normalize is not None and (not isinstance(normalize, (tuple, list)) or len(normalize) != 2):
            raise ValueError(
                f"normalize must be None or a pair (mean, std) of per-channel sequences, got {normalize!r}"
            )
        self.normalize = None if normalize is None else check_stats(*normalize, what="normalize mean and std")
        self.loader, self.dtype = loader, dtype
        # ONE side stream per prefetcher (never one per epoch).
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        if self.normalize is not None:  # built (or found) now, once: no host copy per batch
            normalization_stats(*self.normalize, self.device, dtype)
        Prefetcher.made += 1

    def __len__(self) -> int:
        try:
            return len(self.loader)  # type: ignore[arg-type]
        except TypeError:
            raise TypeError(f"the wrapped loader ({type(self.loader).__name__}) has no len()") from None

    def __repr__(self) -> str:
        mode = "side stream" if self.stream is not None else "pass-through"
        return f"Prefetcher(device={str(self.device)!r}, {mode}, normalize={self.normalize is not None})"

    def _normalize(self, t: torch.Tensor) -> torch.Tensor:
        if self.normalize is None or t.dtype != torch.uint8:
            return t
        if t.dim() < 3 or t.shape[-3] != len(self.normalize[0]):
            raise ValueError(
                f"normalize has {len(self.normalize[0])} channels but the uint8 tensor has shape {tuple(t.shape)}"
                " (expected ...CHW with that many channels)"
            )
        return to_float_normalized(t.reshape(-1, *t.shape[-3:]), *self.normalize, dtype=self.dtype).view(t.shape)

    def __iter__(self) -> Iterator[Any]:
        if self.stream is not None:
            return self._iter_cuda(self.stream)
        return (map_tensors(self._normalize, move_batch(b, self.device, non_blocking=False)) for b in self.loader)

    def _iter_cuda(self, side: torch.cuda.Stream) -> Iterator[Any]:
        def issue(batch: Any) -> tuple[Any, torch.cuda.Event]:  # the copy (and normalisation) on the side stream
            with torch.cuda.stream(side):  # the side stream is current on its device (and that device)
                moved = map_tensors(self._normalize, move_batch(batch, self.device, non_blocking=True))
                ready = torch.cuda.Event()  # marks the copy's end
                ready.record(side)
            return moved, ready

        # Work queued on the compute stream before this epoch (the normaliser's statistics, ...) comes first.
        side.wait_stream(torch.cuda.current_stream(self.device))
        it = iter(self.loader)
        first = next(it, _END)
        pending = None if first is _END else issue(first)
        while pending is not None:
            current, ready = pending
            consumer = torch.cuda.current_stream(self.device)
            consumer.wait_event(ready)  # the compute stream waits for the copy
            # record_stream keeps the memory until the compute stream is done with it (freed, a block made on the
            # side stream would go at once to the next copy); a CPU tensor has no stream.
            for obj in _walk(current, _protects_itself):
                if not isinstance(obj, torch.Tensor) or obj.device.type == "cuda":
                    obj.record_stream(consumer)
            following = next(it, _END)
            pending = None if following is _END else issue(following)  # i+1 copies while i computes
            yield current
            del current
