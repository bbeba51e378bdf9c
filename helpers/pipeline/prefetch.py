"""A side-stream prefetcher (copy batch i+1 while batch i computes), and the check of the reader's own.

``Prefetcher(loader, device)`` yields ``loader``'s batches, in order, already on ``device``. On CUDA it queues the
next batch's copy on its own stream before handing out the current one; that overlaps only from **pinned** memory,
on a **non-default** stream. Every tensor handed out gets ``record_stream(compute_stream)``: made on the side
stream, its block would otherwise go to the next side-stream allocation while the compute stream still reads it
(safe however long a batch is kept; freed blocks return a little later). One stream per prefetcher, made once: a
new ``torch.cuda.Stream`` per epoch leaks reserved memory in the caching allocator (timm issue #2781).
``normalize=(mean, std)`` turns uint8 images into floats after the copy, on the device (a quarter of the bytes
cross the link). Without CUDA batches pass through, normalised all the same.

:func:`check_pipeline_prefetcher` checks chapter 05's exercise under the stream test doubles of
:mod:`helpers.pipeline.streamcheck` (re-exported here) and, on a GPU, for real.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch

from ..core.config import require_gpu
from .data import MEAN, STD, normalization_stats, to_float_normalized
from .streamcheck import (  # noqa: F401 (re-exported: chapter 05 and its tests call them as prefetch.<name>)
    PairProbeLoader,
    _delay_behind_copy,
    check_pipeline_race,
    check_protocol,
    format_protocol,
    prefetch_overlap_ratio,
    stream_doubles,
    stream_protocol,
)

__all__ = [
    "Prefetcher",
    "map_tensors",
    "iter_tensors",
    "move_batch",
    "normalize_uint8",
    "PrefetcherCheck",
    "check_pipeline_prefetcher",
    "check_pipeline_race",
    "stream_doubles",
    "stream_protocol",
    "format_protocol",
    "check_protocol",
]

_END = object()  # the end of a loader (a batch may be None)
_PLAIN = (str, bytes, int, float, bool, type(None))


# -- Walking nested batch structures --


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
    """Tensors (and objects ``stop`` picks, not walked into) reachable in ``batch``: containers,
    dataclasses, object attributes; 8 levels deep at most (a cycle ends there)."""
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
    """Yield every tensor reachable in ``batch`` (containers, dataclasses, object attributes)."""
    return _walk(batch, lambda obj: False)


def _protects_itself(obj: Any) -> bool:
    """A custom batch object with its own ``record_stream(stream)`` method."""
    return not isinstance(obj, (list, tuple, dict)) and callable(getattr(obj, "record_stream", None))


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
    """``(x / 255 - mean) / std`` for a uint8 ``...CHW`` tensor: :func:`helpers.pipeline.data.to_float_normalized`
    for any leading dims, ``mean``/``std`` also as tensors."""
    if not isinstance(x, torch.Tensor) or x.dtype != torch.uint8:
        got = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"x must be a uint8 tensor, got {got}")
    m, s = _as_stats("mean", mean), _as_stats("std", std)
    if x.dim() < 3 or x.shape[-3] != len(m):
        raise ValueError(
            f"normalize has {len(m)} channels but the uint8 tensor has shape {tuple(x.shape)}"
            " (expected ...CHW with that many channels)"
        )
    if x.dim() == 4:
        return to_float_normalized(x, m, s, dtype=dtype)
    return to_float_normalized(x.reshape(-1, *x.shape[-3:]), m, s, dtype=dtype).view(x.shape)


def move_batch(batch: Any, device: torch.device | str, *, non_blocking: bool = True) -> Any:
    """Move every tensor in ``batch`` to ``device`` (custom objects via their ``.to()``); ``non_blocking``
    applies to CUDA only (from pinned memory it returns at once; the copy runs on the current stream)."""
    dev = torch.device(device)
    non_blocking = non_blocking and dev.type == "cuda"

    def move_obj(obj: Any) -> Any:
        if not hasattr(obj, "to"):
            return obj
        try:
            return obj.to(dev, non_blocking=non_blocking)
        except TypeError:
            return obj.to(dev)

    return map_tensors(lambda t: t.to(dev, non_blocking=non_blocking), batch, obj_fn=move_obj)


# -- The prefetcher --


class Prefetcher:
    """Batches of a re-iterable ``loader`` on ``device`` (``None``: CUDA if present), copied one step ahead;
    ``normalize=(mean, std)`` makes uint8 ``...CHW`` tensors ``dtype`` floats on the device. ``stream``: the one
    side stream (``None`` without CUDA). ``Prefetcher.made`` counts instances: the exercise check refuses this one.
    """

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
        self.loader, self.normalize, self.dtype = loader, _check_normalize(normalize), dtype
        # ONE side stream per prefetcher (never one per epoch).
        self.stream: torch.cuda.Stream | None = None
        if self.device.type == "cuda":
            self.stream = torch.cuda.Stream(self.device)
        if self.normalize is not None:  # built (or found) now, once: no host copy per batch
            normalization_stats(*self.normalize, self.device, dtype)
        Prefetcher.made += 1

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
        return f"Prefetcher(device={str(self.device)!r}, {mode}, normalize={self.normalize is not None})"

    def _normalize(self, t: torch.Tensor) -> torch.Tensor:
        if self.normalize is None or t.dtype != torch.uint8:
            return t
        return normalize_uint8(t, *self.normalize, self.dtype)

    def __iter__(self) -> Iterator[Any]:
        if self.stream is not None:
            return self._iter_cuda(self.stream)
        if self.device.type == "cpu":
            return (map_tensors(self._normalize, b) for b in self.loader)
        return (map_tensors(self._normalize, move_batch(b, self.device, non_blocking=False)) for b in self.loader)

    # -- CUDA: copy the next batch on the side stream ----------------------

    def _issue(self, batch: Any, side: torch.cuda.Stream) -> tuple[Any, torch.cuda.Event]:
        """Queue the copy (and the normalisation) of ``batch`` on the side stream; an event marks its end."""
        with torch.cuda.stream(side):  # the side stream is current on its device (and that device)
            moved = map_tensors(self._normalize, move_batch(batch, self.device, non_blocking=True))
            ready = torch.cuda.Event()
            ready.record(side)
        return moved, ready

    def _hand_over(self, batch: Any, ready: torch.cuda.Event) -> Any:
        """The compute stream waits for ``batch``'s copy, and record_stream keeps its memory until that stream
        is done with it: freed, a block made on the side stream would go at once to the next copy."""
        consumer = torch.cuda.current_stream(self.device)
        consumer.wait_event(ready)
        for obj in _walk(batch, _protects_itself):
            if not isinstance(obj, torch.Tensor) or obj.device.type == "cuda":  # a CPU tensor has no stream
                obj.record_stream(consumer)
        return batch

    def _iter_cuda(self, side: torch.cuda.Stream) -> Iterator[Any]:
        # Work queued on the compute stream before this epoch (the normaliser's statistics, ...) comes first.
        side.wait_stream(torch.cuda.current_stream(self.device))
        it = iter(self.loader)
        first = next(it, _END)
        pending = None if first is _END else self._issue(first, side)
        while pending is not None:
            current = self._hand_over(*pending)
            following = next(it, _END)
            pending = None if following is _END else self._issue(following, side)  # i+1 copies while i computes
            yield current
            del current


# -- The check of chapter 05's exercise: the reader's Prefetcher of (uint8 x, y) pairs --


@dataclasses.dataclass
class PrefetcherCheck:
    """The verdict of :func:`check_pipeline_prefetcher`."""

    correct: bool
    messages: list[str]
    overlap_checked: bool = False
    overlap_ratio: float | None = None

    def __bool__(self) -> bool:
        return self.correct

    def __str__(self) -> str:
        return ("PASS" if self.correct else "FAIL") + ":\n  " + "\n  ".join(self.messages)


_REFUSED = (
    "this is (or uses) helpers.pipeline.prefetch.Prefetcher, the chapter's reference: "
    "hand in the Prefetcher you wrote in the chapter"
)


def _gpu_error(exc: BaseException, dev: torch.device) -> bool:
    """A CUDA error on a strict GPU run (``WORKBOOK_REQUIRE_GPU=1``): it must propagate, not become a FAIL."""
    if dev.type != "cuda" or not require_gpu():
        return False
    accel = getattr(torch, "AcceleratorError", None)
    return (accel is not None and isinstance(exc, accel)) or (isinstance(exc, RuntimeError) and "CUDA" in str(exc))


def _pair_reference(loader: Iterable[Any], device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """What a prefetcher of ``(uint8, labels)`` batches must hand over: the reference :class:`Prefetcher`'s."""
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


def _under_the_doubles(candidate: Any, n_batches: int) -> tuple[list[str], list[list[Any]]]:
    """Problems in the protocol under the stream doubles (two epochs of one object), and the batches handed over."""
    try:
        log, handed, _ = stream_protocol(candidate, n_batches, epochs=2)
    except Exception as exc:  # the reader's code may raise anything
        return [f"under the stream test doubles it raised {type(exc).__name__}: {exc}"], []
    return check_protocol(log, handed, n_batches), handed


def _on_the_gpu(candidate: Any, dev: torch.device, n_batches: int) -> list[str] | None:
    """Problems with real streams (the reference's batches, then the race check); None: it made a Prefetcher."""
    try:
        loader = [(x.pin_memory(), y.pin_memory()) for x, y in PairProbeLoader(n_batches).batches]
        want = _pair_reference(loader, dev)
        made_before = Prefetcher.made
        problems = _pair_problems([tuple(b) for b in candidate(loader, dev)], want, 1)
        problems += check_pipeline_race(candidate, dev)
        return problems if Prefetcher.made == made_before else None
    except Exception as exc:  # the reader's code may raise anything
        if _gpu_error(exc, dev):
            raise
        return [f"on {dev}: raised {type(exc).__name__}: {exc}"]


_PASSED = [
    "order: batch i+1 is requested and copied before batch i is handed over",
    "streams: copies with non_blocking=True on one side stream, made once, which first waits for the "
    "current stream; the current stream waits before each hand-over; record_stream on every tensor "
    "handed over (checked with test doubles of the CUDA stream API)",
    "values: the reference prefetcher's batches (normalised with data.MEAN and data.STD), in order, twice",
]


def check_pipeline_prefetcher(
    candidate: Any, device: torch.device | str | None = None, *, check_overlap: bool = True, n_batches: int = 4
) -> PrefetcherCheck:
    """Check the reader's chapter-05 prefetcher: ``candidate(loader, device)`` yields ``(x, y)`` pairs, uint8 in,
    normalised on the device out. Refuses :class:`Prefetcher` itself; everywhere: the protocol under the stream
    doubles (two epochs) and the batches against the reference's; on CUDA: real streams, the race check and
    (``check_overlap``) how much copy time it hides."""
    if candidate is None:
        return PrefetcherCheck(False, ["no answer yet: set answer = Prefetcher (the class you wrote) and run again"])
    if not callable(candidate):
        return PrefetcherCheck(False, [f"expected a class or function, got {type(candidate).__name__}"])
    refused = PrefetcherCheck(False, [_REFUSED])
    if isinstance(candidate, type) and issubclass(candidate, Prefetcher):
        return refused
    dev = torch.device(device if device is not None else "cuda" if torch.cuda.is_available() else "cpu")
    made_before = Prefetcher.made
    problems, handed = _under_the_doubles(candidate, n_batches)
    if Prefetcher.made != made_before:
        return refused
    if not problems:
        want = _pair_reference(PairProbeLoader(n_batches).batches, torch.device("cpu"))
        for epoch, got in enumerate(handed):
            problems += _pair_problems(got, want, epoch + 1)
    result = PrefetcherCheck(not problems, problems or list(_PASSED))
    if dev.type != "cuda":
        if check_overlap:
            result.messages.append("real streams, races and overlap not checked: no CUDA device here")
        return result
    if not torch.cuda.is_available():
        raise ValueError("device is 'cuda' but no CUDA device is available")
    if result.correct:
        gpu = _on_the_gpu(candidate, dev, n_batches)
        if gpu is None:
            return refused
        result.messages.extend(
            gpu
            or [
                f"on {dev}: the same batches with real streams, and each batch right when "
                "read on the current stream, at once and behind queued work"
            ]
        )
        result.correct = not gpu
    if result.correct and check_overlap:
        ratio = prefetch_overlap_ratio(candidate, dev)
        result.overlap_checked, result.overlap_ratio, result.correct = True, ratio, ratio >= 0.3
        verdict = "overlaps" if ratio >= 0.3 else "does NOT overlap"
        result.messages.append(f"overlap on {dev}: {ratio:.0%} of the copy time hidden behind compute -> {verdict}")
    return result
