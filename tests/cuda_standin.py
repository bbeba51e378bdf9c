"""Stand-ins (test doubles) for the CUDA API, for tests only: CUDA-only code paths run on a CPU and log
what they asked of the GPU, so a test can check it.

``with fake_cuda(devices=2, current=0) as cuda:`` makes ``torch.cuda.is_available()`` true and replaces,
for the block only, the parts of the API the workbook's CUDA paths use:

* devices: ``torch.cuda.device_count/current_device/set_device/device(...)`` and ``torch.accelerator``'s
  ``is_available/current_device_index/set_device_index``; ``current`` is the current device's index.
* streams and events: ``torch.cuda.Stream``, ``torch.cuda.stream(s)``, ``current_stream(device)``,
  ``default_stream(device)``, ``torch.cuda.Event``; they follow torch's rules as written in
  ``torch/cuda/streams.py`` and ``torch/cuda/__init__.py`` (torch 2.14): ``Event.record()`` with no
  stream records on ``torch.cuda.current_stream()``, the *current device's* stream, whatever device the
  copy went to; ``current_stream(None)`` is the current device's; a ``torch.device("cuda")`` without an
  index means the current device.
* host syncs: ``torch.cuda.synchronize``, ``torch.accelerator.synchronize``, ``Event.synchronize``,
  ``Stream.synchronize`` are logged as ``host_sync`` (a test counts them inside a timed loop); the two
  device-wide ones log the ``device`` index they waited for (the current one when given none).
* tensors: ``Tensor.pin_memory`` returns a copy marked pinned (``is_pinned()`` says so);
  ``Tensor.to(cuda device)`` logs a ``copy`` on the current stream *of the destination device* (ATen's
  ``copy_kernel_cuda`` sets a guard to the CUDA side's device, then takes ``getCurrentCUDAStream()``) and
  returns a CPU copy whose ``.device`` / ``.is_cuda`` say where it went; ``copy_`` into such a tensor (or
  into a pinned buffer) is logged too; ``.cpu()`` of a placed tensor returns an unplaced copy;
  ``record_stream`` is logged; ``torch.cuda._sleep`` logs a ``kernel`` on the current device's current stream;
  ``torch.empty/zeros/ones/...(device=cuda)`` and ``*_like`` make such placed tensors, ``pin_memory=True``
  pinned ones; ``mem_get_info`` says 8 of 16 GiB are free and ``get_device_name`` names a stand-in.

Every call lands in ``cuda.log`` as an :class:`Op`, in order. Times (``Event.elapsed_time``) are a fixed
stand-in value: they check that code runs and reads them, never a speed, and no number made here
reaches a reader.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any, Iterator
from unittest import mock

import torch

_TensorBase = torch._C.TensorBase
_REAL_TO = _TensorBase.to
_REAL_COPY = _TensorBase.copy_
_REAL_CPU = _TensorBase.cpu
_REAL_DEVICE = _TensorBase.device
_REAL_IS_CUDA = _TensorBase.is_cuda

#: Tensor factories that take ``device=`` (and ``pin_memory=``), replaced inside :func:`fake_cuda`.
FACTORIES = ("empty", "zeros", "ones", "full", "rand", "randn", "randint", "arange", "tensor")
LIKE_FACTORIES = ("empty_like", "zeros_like", "ones_like", "full_like")

#: What ``Event.elapsed_time`` answers (ms): a stand-in value, never a measurement.
STANDIN_MS = 1.0


class FakeStream:
    """A CUDA stream on device ``index``: its calls are logged by its :class:`FakeCuda`."""

    def __init__(self, cuda: FakeCuda, index: int, name: str) -> None:
        self.cuda, self.index, self.name = cuda, index, name
        self.device = torch.device("cuda", index)
        self.device_index = index

    def __repr__(self) -> str:
        return f"<stream {self.name}>"

    def wait_stream(self, other: FakeStream) -> None:
        self.cuda._op("wait_stream", self, other=other)

    def wait_event(self, event: FakeEvent) -> None:
        self.cuda._op("wait_event", self, event=event)

    def record_event(self, event: FakeEvent | None = None) -> FakeEvent:
        event = event or FakeEvent(self.cuda)
        event.record(self)
        return event

    def synchronize(self) -> None:
        self.cuda._op("host_sync", self, what="stream.synchronize")

    def query(self) -> bool:
        return True


class FakeEvent:
    """A CUDA event: remembers the stream it was last recorded on."""

    def __init__(self, cuda: FakeCuda, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False):
        self.cuda, self.enable_timing = cuda, enable_timing
        self.stream: FakeStream | None = None
        self.at: int | None = None  # its place in the log when last recorded

    def record(self, stream: FakeStream | None = None) -> None:
        if stream is None:  # torch/cuda/streams.py, Event.record: stream = torch.cuda.current_stream()
            stream = self.cuda.current_stream()
        self.stream = stream
        self.at = self.cuda._op("record", stream, event=self)

    def wait(self, stream: FakeStream | None = None) -> None:
        (stream or self.cuda.current_stream()).wait_event(self)

    def synchronize(self) -> None:
        self.cuda._op("host_sync", self.stream, what="event.synchronize", event=self)

    def query(self) -> bool:
        return True

    def elapsed_time(self, end: FakeEvent) -> float:
        assert self.enable_timing and end.enable_timing, "elapsed_time needs Event(enable_timing=True)"
        assert self.stream is not None and end.stream is not None, "elapsed_time of an event never recorded"
        assert self.stream.index == end.stream.index, "elapsed_time of events on two devices"
        return STANDIN_MS


@dataclass(eq=False)  # two calls are two ops, even with the same details: log.index(op) finds this one
class Op:
    """One logged call: ``kind`` (copy, record, host_sync, wait_stream, ...), the stream it went to, details."""

    kind: str
    stream: FakeStream | None
    detail: dict[str, Any] = field(default_factory=dict)
    thread: str = ""

    def __getitem__(self, key: str) -> Any:
        return self.detail[key]


class FakeCuda:
    """The state behind :func:`fake_cuda`: devices, their current streams, pinned and placed tensors, the log."""

    def __init__(self, devices: int, current: int) -> None:
        self.devices, self.current = devices, current
        self.log: list[Op] = []
        self._lock = threading.Lock()
        self._made = 0
        self.default = [FakeStream(self, i, f"cuda:{i} default") for i in range(devices)]
        self._current_stream = list(self.default)
        self._pinned: dict[int, weakref.ref] = {}
        self._placed: dict[int, tuple[weakref.ref, torch.device]] = {}

    # -- devices and streams ---------------------------------------------------------------
    def index(self, device: Any = None) -> int:
        """torch's rule: None, "cuda" or torch.device("cuda") without an index means the current device."""
        if device is None:
            return self.current
        if isinstance(device, int):
            i = device
        else:
            d = torch.device(device)
            assert d.type == "cuda", f"a CUDA call was given a {d.type} device"
            i = self.current if d.index is None else d.index
        assert 0 <= i < self.devices, f"cuda:{i} does not exist ({self.devices} stand-in devices)"
        return i

    def current_stream(self, device: Any = None) -> FakeStream:
        return self._current_stream[self.index(device)]

    def new_stream(self, device: Any = None, priority: int = 0, **_: Any) -> FakeStream:
        self._made += 1
        return FakeStream(self, self.index(device), f"cuda:{self.index(device)} side {self._made}")

    @contextlib.contextmanager
    def use_stream(self, stream: FakeStream | None) -> Iterator[None]:
        if stream is None:
            yield
            return
        # torch.cuda.stream(s): s becomes current on its device, and its device becomes current
        before, before_dev = self._current_stream[stream.index], self.current
        self._current_stream[stream.index], self.current = stream, stream.index
        try:
            yield
        finally:
            self._current_stream[stream.index], self.current = before, before_dev

    @contextlib.contextmanager
    def use_device(self, device: Any) -> Iterator[None]:
        before = self.current
        if device is not None and not (isinstance(device, int) and device < 0):
            self.current = self.index(device)
        try:
            yield
        finally:
            self.current = before

    # -- the log ---------------------------------------------------------------------------
    def _op(self, kind: str, stream: FakeStream | None, **detail: Any) -> int:
        with self._lock:
            self.log.append(Op(kind, stream, detail, threading.current_thread().name))
            return len(self.log) - 1

    def ops(self, kind: str) -> list[Op]:
        return [op for op in self.log if op.kind == kind]

    def host_syncs(self, start: int = 0, end: int | None = None) -> list[Op]:
        return [op for op in self.log[start:end] if op.kind == "host_sync"]

    # -- tensors ---------------------------------------------------------------------------
    def is_pinned(self, t: torch.Tensor) -> bool:
        ref = self._pinned.get(id(t))
        return ref is not None and ref() is t

    def placed_on(self, t: torch.Tensor) -> torch.device | None:
        entry = self._placed.get(id(t))
        return entry[1] if entry is not None and entry[0]() is t else None

    def _place(self, t: torch.Tensor, device: torch.device) -> torch.Tensor:
        self._placed[id(t)] = (weakref.ref(t), device)
        return t

    def pin(self, t: torch.Tensor, device: Any = None) -> torch.Tensor:
        out = t.clone()
        self._pinned[id(out)] = weakref.ref(out)
        self._op("pin", None, nbytes=t.nbytes, shape=tuple(t.shape), dtype=t.dtype)
        return out


def _target_device(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.device | None:
    dev = kwargs.get("device")
    if dev is None and args and isinstance(args[0], (str, torch.device)):
        dev = args[0]
    return None if dev is None else torch.device(dev)


@contextlib.contextmanager
def fake_cuda(devices: int = 2, current: int = 0) -> Iterator[FakeCuda]:
    """Stand-ins for the CUDA API on ``devices`` devices, ``current`` being the current one (see the module doc)."""
    cuda = FakeCuda(devices, current)

    def to(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        dst = _target_device(args, kwargs)
        src_dev = cuda.placed_on(self)
        if dst is None or dst.type != "cuda":
            if src_dev is not None and dst is not None and dst.type == "cpu":
                return self.cpu()
            out = _REAL_TO(self, *args, **kwargs)
            return cuda._place(out.clone(), src_dev) if src_dev is not None and out is not self else out
        i = cuda.index(dst)
        rest = tuple(a for a in args if not isinstance(a, (str, torch.device)))
        kw = {k: v for k, v in kwargs.items() if k != "device"}
        out = _REAL_TO(self, *rest, **kw).clone()  # dtype conversions, on the CPU
        stream = cuda.current_stream(i)  # the copy goes to the destination device's current stream
        cuda._op(
            "copy",
            stream,
            direction="h2d" if src_dev is None else "d2d",
            device=torch.device("cuda", i),
            non_blocking=bool(kwargs.get("non_blocking", False)),
            src_pinned=cuda.is_pinned(self),
            shape=tuple(out.shape),
            dtype=out.dtype,
            src=id(self),
            out=id(out),
        )
        return cuda._place(out, torch.device("cuda", i))

    def copy_(self: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
        dst_dev, src_dev = cuda.placed_on(self), cuda.placed_on(src)
        if dst_dev is not None or src_dev is not None:
            cuda_side = dst_dev if dst_dev is not None else src_dev
            assert cuda_side is not None
            cuda._op(
                "copy",
                cuda.current_stream(cuda_side),
                direction="h2d" if src_dev is None else ("d2h" if dst_dev is None else "d2d"),
                device=cuda_side,
                non_blocking=non_blocking,
                src_pinned=cuda.is_pinned(src),
                dst_pinned=cuda.is_pinned(self),
                shape=tuple(self.shape),
                dtype=self.dtype,
                src=id(src),
                out=id(self),
            )
        elif cuda.is_pinned(self):
            cuda._op("fill_pinned", None, buffer=id(self), shape=tuple(self.shape))
        return _REAL_COPY(self, src, non_blocking=non_blocking)

    def cpu(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        where = cuda.placed_on(self)
        if where is None:
            return _REAL_CPU(self, *args, **kwargs)
        cuda._op("copy", cuda.current_stream(where), direction="d2h", device=where, non_blocking=False)
        cuda._op("host_sync", cuda.current_stream(where), what="blocking D2H copy")
        return self.clone()

    def device(self: torch.Tensor) -> torch.device:
        where = cuda.placed_on(self)
        return where if where is not None else _REAL_DEVICE.__get__(self)

    def is_cuda(self: torch.Tensor) -> bool:
        return cuda.placed_on(self) is not None or _REAL_IS_CUDA.__get__(self)

    def factory(real: Any, like: bool = False) -> Any:
        """torch.empty/zeros/ones/... with ``device=cuda``: a CPU tensor that says it is on that device;
        with ``pin_memory=True``: a pinned (stand-in) one. ``*_like`` keeps the device of its model."""

        def make(*args: Any, **kwargs: Any) -> torch.Tensor:
            pin = kwargs.pop("pin_memory", False)
            dev = kwargs.get("device")
            if dev is None and like and args and isinstance(args[0], torch.Tensor):
                dev = cuda.placed_on(args[0])
            if dev is not None and torch.device(dev).type == "cuda":
                kwargs["device"] = "cpu"
                return cuda._place(real(*args, **kwargs), torch.device("cuda", cuda.index(dev)))
            if like:
                kwargs.setdefault("device", "cpu")
            out = real(*args, **kwargs)
            return cuda.pin(out) if pin else out

        return make

    def synchronize(device: Any = None) -> None:
        cuda._op("host_sync", None, what="torch.cuda.synchronize", device=cuda.index(device))

    def accelerator_synchronize(device: Any = None) -> None:
        cuda._op("host_sync", None, what="torch.accelerator.synchronize", device=cuda.index(device))

    def set_device(device: Any) -> None:
        cuda.current = cuda.index(device)

    def set_device_index(device: Any) -> None:
        cuda._op("set_device_index", None, device=cuda.index(device))  # the pin thread's own device

    def sleep(cycles: int) -> None:
        cuda._op("kernel", cuda.current_stream(), what="_sleep", cycles=cycles)

    patches = [
        mock.patch.object(torch.cuda, "is_available", lambda: True),
        mock.patch.object(torch.cuda, "is_initialized", lambda: True),
        mock.patch.object(torch.cuda, "device_count", lambda: devices),
        mock.patch.object(torch.cuda, "current_device", lambda: cuda.current),
        mock.patch.object(torch.cuda, "set_device", set_device),
        mock.patch.object(torch.cuda, "device", cuda.use_device),
        mock.patch.object(torch.cuda, "current_stream", cuda.current_stream),
        mock.patch.object(torch.cuda, "default_stream", lambda device=None: cuda.default[cuda.index(device)]),
        mock.patch.object(torch.cuda, "Stream", cuda.new_stream),
        mock.patch.object(torch.cuda, "stream", cuda.use_stream),
        mock.patch.object(torch.cuda, "Event", lambda *a, **k: FakeEvent(cuda, *a, **k)),
        mock.patch.object(torch.cuda, "synchronize", synchronize),
        mock.patch.object(torch.cuda, "_sleep", sleep, create=True),
        mock.patch.object(torch.cuda, "mem_get_info", lambda device=None: (8 << 30, 16 << 30)),
        mock.patch.object(torch.cuda, "get_device_name", lambda device=None: "a stand-in GPU (no numbers)"),
        mock.patch.object(torch.cuda, "empty_cache", lambda: None),
        *[mock.patch.object(torch, name, factory(getattr(torch, name))) for name in FACTORIES],
        *[mock.patch.object(torch, name, factory(getattr(torch, name), like=True)) for name in LIKE_FACTORIES],
        mock.patch.object(torch.accelerator, "is_available", lambda: True),
        mock.patch.object(torch.accelerator, "current_accelerator", lambda *a, **k: torch.device("cuda")),
        mock.patch.object(torch.accelerator, "current_device_index", lambda: cuda.current),
        mock.patch.object(torch.accelerator, "set_device_index", set_device_index),
        mock.patch.object(torch.accelerator, "synchronize", accelerator_synchronize),
        mock.patch.object(torch.Tensor, "pin_memory", lambda self, device=None: cuda.pin(self)),
        mock.patch.object(torch.Tensor, "is_pinned", lambda self, device=None: cuda.is_pinned(self)),
        mock.patch.object(torch.Tensor, "to", to),
        mock.patch.object(torch.Tensor, "copy_", copy_),
        mock.patch.object(torch.Tensor, "cpu", cpu),
        mock.patch.object(torch.Tensor, "device", property(device)),
        mock.patch.object(torch.Tensor, "is_cuda", property(is_cuda)),
        mock.patch.object(torch.Tensor, "record_stream", lambda self, s: cuda._op("record_stream", s, tensor=id(self))),
    ]
    with contextlib.ExitStack() as stack:
        for p in patches:
            stack.enter_context(p)
        yield cuda
