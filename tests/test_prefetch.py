"""Tests for helpers.pipeline.prefetch: order, exhaustion, re-iteration, batch structures, normalisation; and for
chapter 05's check of a reader's prefetcher (helpers.chapters.ch05.prefetch) on the CUDA stand-ins.

Everything runs on CPU (pass-through); the CUDA tests run only where a GPU exists.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, NamedTuple

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from helpers.pipeline.prefetch import Prefetcher, iter_tensors, map_tensors, move_batch

MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


class Custom:
    """A custom batch type with its own ``.to()``."""

    def __init__(self, x: torch.Tensor, tag: str) -> None:
        self.x = x
        self.tag = tag

    def to(self, device: Any, non_blocking: bool = False) -> "Custom":
        return Custom(self.x.to(device, non_blocking=non_blocking), self.tag)


class XY(NamedTuple):
    x: torch.Tensor
    y: torch.Tensor


@dataclasses.dataclass(frozen=True)
class Frozen:
    x: torch.Tensor
    n: int = dataclasses.field(default=0, init=False)


class Pair(NamedTuple):
    images: torch.Tensor
    labels: torch.Tensor


@dataclasses.dataclass
class Sample:
    """A dataclass batch with a tensor, a nested dict and a plain field."""

    x: torch.Tensor
    extra: dict[str, torch.Tensor]
    name: str = "sample"


def example_loaders(n_batches: int = 5, seed: int = 0) -> dict[str, list[Any]]:
    """Lists of distinct batches with different structures (order mistakes show)."""
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


def _loader(n: int = 10, batch_size: int = 3) -> DataLoader:
    ds = TensorDataset(torch.arange(n * 2, dtype=torch.float32).view(n, 2), torch.arange(n))
    return DataLoader(ds, batch_size=batch_size, shuffle=False)


def test_cpu_passes_through_in_order_and_exhausts() -> None:
    loader = _loader()
    pf = Prefetcher(loader, "cpu")
    assert pf.stream is None and "pass-through" in repr(pf)
    got = list(pf)
    want = list(loader)
    assert len(got) == len(want) == len(pf) == 4
    for g, w in zip(got, want):
        assert isinstance(g, list) and torch.equal(g[0], w[0]) and torch.equal(g[1], w[1])
    it = iter(pf)
    for _ in range(4):
        next(it)
    with pytest.raises(StopIteration):
        next(it)
    with pytest.raises(StopIteration):
        next(it)


def test_reiteration_gives_a_fresh_epoch_and_survives_a_break() -> None:
    loader = _loader()
    pf = Prefetcher(loader, "cpu")
    first = [b[1].tolist() for b in pf]
    for i, _ in enumerate(pf):
        if i == 1:
            break
    again = [b[1].tolist() for b in pf]
    assert first == again == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]


def test_shuffled_loader_order_is_the_loaders_order() -> None:
    ds = TensorDataset(torch.arange(20))
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    a = [b[0].tolist() for b in DataLoader(ds, batch_size=4, shuffle=True, generator=g1)]
    b = [x[0].tolist() for x in Prefetcher(DataLoader(ds, batch_size=4, shuffle=True, generator=g2), "cpu")]
    assert a == b


@pytest.mark.parametrize("name", list(example_loaders()))
def test_structures_are_preserved(name: str) -> None:
    loader = example_loaders()[name]
    got = list(Prefetcher(loader, "cpu"))
    assert len(got) == len(loader)
    assert all(_same(g, w) for g, w in zip(got, loader))
    assert type(got[0]) is type(loader[0])


def test_custom_types_frozen_dataclasses_and_plain_values() -> None:
    loader = [
        {"c": Custom(torch.ones(2), "a"), "f": Frozen(torch.zeros(3)), "s": "text", "n": None, "i": 7},
        (XY(torch.ones(1), torch.zeros(1)), [1.5, "x"]),
    ]
    got = list(Prefetcher(loader, "cpu"))
    assert got[0]["c"].tag == "a" and torch.equal(got[0]["c"].x, torch.ones(2))
    assert isinstance(got[0]["f"], Frozen) and got[0]["f"].n == 0
    assert got[0]["s"] == "text" and got[0]["n"] is None and got[0]["i"] == 7
    assert isinstance(got[1][0], XY) and got[1][1] == [1.5, "x"]


def test_move_batch_calls_custom_to_and_map_tensors_rebuilds() -> None:
    moved = move_batch({"c": Custom(torch.ones(2), "t"), "p": Pair(torch.ones(1), torch.zeros(1))}, "cpu")
    assert isinstance(moved["c"], Custom) and isinstance(moved["p"], Pair)
    doubled = map_tensors(lambda t: t * 2, Sample(x=torch.ones(2), extra={"y": torch.ones(1)}, name="s"))
    assert isinstance(doubled, Sample) and doubled.name == "s"
    assert torch.equal(doubled.x, torch.full((2,), 2.0)) and torch.equal(doubled.extra["y"], torch.full((1,), 2.0))
    assert len(list(iter_tensors({"a": [Custom(torch.ones(1), "z")], "b": (torch.ones(1),)}))) == 2


def test_uint8_normalisation_matches_the_reference() -> None:
    tv = pytest.importorskip("torchvision.transforms.v2.functional")
    g = torch.Generator().manual_seed(0)
    imgs = torch.randint(0, 256, (4, 3, 8, 8), dtype=torch.uint8, generator=g)
    labels = torch.arange(4)
    pf = Prefetcher([(imgs, labels)], "cpu", normalize=(MEAN, STD))
    ((x, y),) = list(pf)
    ref = tv.normalize(tv.to_dtype(imgs, torch.float32, scale=True), list(MEAN), list(STD))
    assert x.dtype == torch.float32 and x.shape == imgs.shape
    torch.testing.assert_close(x, ref, rtol=0, atol=1e-6)
    assert torch.equal(y, labels)  # labels are not touched


def test_normalisation_matches_the_chapter_01_dataset_helper() -> None:
    data = pytest.importorskip("helpers.pipeline.data")
    imgs = torch.randint(0, 256, (2, 3, 5, 5), dtype=torch.uint8)
    (x,) = list(Prefetcher([imgs], "cpu", normalize=(data.MEAN, data.STD)))
    assert torch.equal(x, data.to_float_normalized(imgs))


def test_float_tensors_are_not_normalised_and_dtype_is_respected() -> None:
    f = torch.rand(2, 3, 4, 4)
    u = torch.randint(0, 256, (3, 4, 4), dtype=torch.uint8)  # a single CHW image works too
    ((a, b),) = list(Prefetcher([(f, u)], "cpu", normalize=(MEAN, STD), dtype=torch.float64))
    assert a is f
    assert b.dtype == torch.float64


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"normalize": (MEAN,)}, "normalize"),
        ({"normalize": (MEAN, STD[:2])}, "same length"),
        ({"normalize": (MEAN, (0.2, 0.0, 0.1))}, "> 0"),
        ({"normalize": ("abc", STD)}, "normalize mean"),
        ({"dtype": torch.int64}, "dtype"),
    ],
)
def test_bad_arguments_raise_value_error(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        Prefetcher([torch.ones(1)], "cpu", **kwargs)


def test_one_shot_iterators_and_non_iterables_are_refused() -> None:
    with pytest.raises(ValueError, match="re-iterable"):
        Prefetcher(iter([torch.ones(1)]), "cpu")
    with pytest.raises(ValueError, match="iterable"):
        Prefetcher(42, "cpu")  # type: ignore[arg-type]


def _normalized(x: torch.Tensor) -> torch.Tensor:
    """``x`` normalised by a CPU prefetcher (the one path that turns uint8 ...CHW tensors into floats)."""
    (out,) = list(Prefetcher([x], "cpu", normalize=(MEAN, STD)))
    return out


def test_channel_mismatch_is_a_clear_error() -> None:
    pf = Prefetcher([torch.zeros(1, 1, 4, 4, dtype=torch.uint8)], "cpu", normalize=(MEAN, STD))
    with pytest.raises(ValueError, match="3 channels"):
        list(pf)


def test_len_without_len_is_a_type_error() -> None:
    class NoLen:
        def __iter__(self):  # type: ignore[no-untyped-def]
            return iter([torch.ones(1)])

    pf = Prefetcher(NoLen(), "cpu")
    assert len(list(pf)) == 1
    with pytest.raises(TypeError, match="no len"):
        len(pf)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA error")
def test_asking_for_cuda_without_cuda_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="no CUDA"):
        Prefetcher([torch.ones(1)], "cuda")


def test_default_device() -> None:
    pf = Prefetcher([torch.ones(1)])
    assert pf.device.type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert "Prefetcher" in repr(pf)


def test_workers_loader_passes_through() -> None:
    ds = TensorDataset(torch.arange(12))
    loader = DataLoader(ds, batch_size=4, num_workers=2, persistent_workers=False)
    assert [b[0].tolist() for b in Prefetcher(loader, "cpu")] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]


# -- CUDA only ------------------------------------------------------------------


@cuda
def test_cuda_prefetcher_moves_batches_on_one_stream() -> None:
    loader = DataLoader(TensorDataset(torch.randn(64, 8), torch.arange(64)), batch_size=16, pin_memory=True)
    pf = Prefetcher(loader, "cuda")
    stream = pf.stream
    for _ in range(2):
        got = list(pf)
        assert pf.stream is stream  # one stream per prefetcher, not per epoch
        assert all(x.is_cuda and y.is_cuda for x, y in got)
        for (x, y), (wx, wy) in zip(got, loader):
            assert torch.equal(x.cpu(), wx) and torch.equal(y.cpu(), wy)


@cuda
def test_cuda_normalise_and_structures() -> None:
    imgs = torch.randint(0, 256, (2, 3, 4, 4), dtype=torch.uint8)
    loader = [{"img": imgs, "c": Custom(torch.ones(2), "t"), "p": Pair(imgs, torch.zeros(2))}]
    (b,) = list(Prefetcher(loader, "cuda", normalize=(MEAN, STD)))
    torch.testing.assert_close(b["img"].cpu(), _normalized(imgs), rtol=0, atol=1e-6)
    assert b["c"].x.is_cuda and b["p"].images.is_cuda


# -- the one normaliser: cached statistics, no hidden synchronisation ------------------------


def test_one_normaliser_bit_exact_with_torchvision_and_statistics_cached(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import torchvision.transforms.v2.functional as tv

    from helpers.pipeline import data

    imgs = torch.randint(0, 256, (3, 3, 6, 6), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    ref = tv.normalize(tv.to_dtype(imgs, torch.float32, scale=True), list(MEAN), list(STD))
    assert torch.equal(data.to_float_normalized(imgs, MEAN, STD), ref)  # bit for bit, not just close
    assert torch.equal(_normalized(imgs), ref)  # the prefetcher delegates to it
    assert torch.equal(_normalized(imgs[0]), ref[0])  # a single CHW image
    assert torch.equal(_normalized(imgs.view(1, 3, 3, 6, 6)), ref.view(1, 3, 3, 6, 6))

    # Built once per (values, device, dtype), then reused: no torch.tensor(...) per batch.
    m, s = data.normalization_stats(MEAN, STD, "cpu")
    assert data.normalization_stats(list(MEAN), STD, torch.device("cpu")) == (m, s)
    assert m.shape == (3, 1, 1) and m.dtype == torch.float32
    m64, _ = data.normalization_stats(MEAN, STD, "cpu", torch.float64)
    assert m64.dtype == torch.float64 and m64 is not m
    made = []
    real = torch.tensor
    monkeypatch.setattr(torch, "tensor", lambda *a, **k: made.append(a) or real(*a, **k))
    pf = Prefetcher([(imgs, torch.arange(3))] * 4, "cpu", normalize=(MEAN, STD))
    for _ in range(2):
        for x, _y in pf:
            assert torch.equal(x, ref)
    data.to_float_normalized(imgs, MEAN, STD)
    _normalized(imgs[0])
    assert made == []  # every call found its statistics in the cache


def test_normalisation_statistics_key_names_the_cuda_device(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """ "cuda" and "cuda:0" must find the same cache entry (else the prefetcher, made with "cuda",
    would copy the statistics again on its first batch, which lives on "cuda:0")."""
    from helpers.pipeline import data

    sentinel = (torch.zeros(3, 1, 1), torch.ones(3, 1, 1))
    key = ((0.1, 0.2, 0.3), (1.0, 1.0, 1.0), torch.device("cuda", 0), torch.float32)
    monkeypatch.setitem(data._STATS_CACHE, key, sentinel)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert data.normalization_stats((0.1, 0.2, 0.3), (1, 1, 1), "cuda") is sentinel
    assert data.normalization_stats((0.1, 0.2, 0.3), (1, 1, 1), "cuda:0") is sentinel


@contextlib.contextmanager
def _syncs_are_errors():  # type: ignore[no-untyped-def]
    old = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(old)


@cuda
@pytest.mark.parametrize(
    "pipeline",
    [
        "plain float32",
        "plain uint8",
        "prefetcher float32",
        "prefetcher uint8",
        "DataLoader pinned + prefetcher uint8",
    ],
)
def test_one_training_step_of_each_ch05_pipeline_has_no_hidden_sync(pipeline: str) -> None:
    """Chapter 05 says these pipelines never make the host wait: one training step under
    torch.cuda.set_sync_debug_mode("error") (which raises at any synchronising call) proves it."""
    import torch.nn.functional as F

    from helpers.pipeline import data, models

    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(0)
    u8 = [torch.randint(0, 256, (8, 3, 32, 32), dtype=torch.uint8, generator=g) for _ in range(3)]
    ys = [torch.randint(0, 6, (8,), generator=g) for _ in range(3)]
    f32 = [data.to_float_normalized(b) for b in u8]
    use_u8 = "uint8" in pipeline
    batches = [(b.pin_memory(), y.pin_memory()) for b, y in zip(u8 if use_u8 else f32, ys)]
    if pipeline.startswith("plain"):

        def plain() -> Any:
            for b, y in batches:
                x = b.to(dev, non_blocking=True)
                yield (data.to_float_normalized(x) if use_u8 else x), y.to(dev, non_blocking=True)

        source: Any = plain()
    else:
        loader: Any = batches
        if pipeline.startswith("DataLoader"):
            loader = DataLoader(TensorDataset(torch.cat(u8), torch.cat(ys)), batch_size=8, pin_memory=True)
        norm = (data.MEAN, data.STD) if use_u8 else None
        source = iter(Prefetcher(loader, dev, normalize=norm))
    model = models.build_model().to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss.detach()

    step(*next(source))  # warm-up: cuDNN handles, optimizer state, the normaliser's statistics
    torch.cuda.synchronize()
    with _syncs_are_errors():
        x, y = next(source)  # includes queuing the copy of the following batch
        step(x, y)
    torch.cuda.synchronize()


@cuda
def test_the_hidden_syncs_loop_does_synchronise() -> None:
    """The chapter's buggy loop is caught by the same debug mode (so the test above can see syncs)."""
    import io as _io

    from helpers.chapters.ch05.hazards import _loop_hidden_syncs

    x = torch.randn(64, 64, device="cuda")
    with _syncs_are_errors(), pytest.raises(RuntimeError, match="synchroniz"):
        _loop_hidden_syncs(x, x, 1, _io.StringIO())


def test_checker_lets_cuda_errors_through_on_a_strict_gpu_run(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """WORKBOOK_REQUIRE_GPU=1: a CUDA error inside the checked code on the GPU propagates instead of becoming a FAIL
    line; the reader's own mistake, an error under the stream doubles, or a relaxed run stay a FAIL."""
    from cuda_standin import fake_cuda

    from helpers.chapters.ch05 import prefetch
    from helpers.pipeline import data

    monkeypatch.setattr(data, "_STATS_CACHE", {})
    cuda_error = "CUDA error: an illegal memory access was encountered"

    def raising(message: str, on: str) -> Any:
        def candidate(loader: Any, device: Any) -> Any:
            if torch.device(device).type == on:
                raise RuntimeError(message)
            return _ReaderPrefetcher(loader, device)

        return candidate

    monkeypatch.setenv("WORKBOOK_REQUIRE_GPU", "1")
    with fake_cuda(devices=1, current=0):
        with pytest.raises(RuntimeError, match="illegal memory access"):
            prefetch.check_pipeline_prefetcher(raising(cuda_error, "cuda"), "cuda")
        oops = prefetch.check_pipeline_prefetcher(raising("oops", "cuda"), "cuda")
        assert not oops.correct and "raised RuntimeError: oops" in str(oops)
        on_cpu = prefetch.check_pipeline_prefetcher(raising(cuda_error, "cpu"), "cuda")
        assert not on_cpu.correct and "illegal memory access" in str(on_cpu)
        monkeypatch.setenv("WORKBOOK_REQUIRE_GPU", "0")
        relaxed = prefetch.check_pipeline_prefetcher(raising(cuda_error, "cuda"), "cuda")
        assert not relaxed.correct and "illegal memory access" in str(relaxed)


# -- the CUDA path, on the stand-ins of tests/cuda_standin.py (what is asked of streams, events and copies) ----


class _SelfProtecting:
    """A custom batch object that moves itself and protects its own memory (``record_stream``)."""

    def __init__(self, x: torch.Tensor, log: list[Any]) -> None:
        self.x, self.log = x, log

    def to(self, device: Any, non_blocking: bool = False) -> "_SelfProtecting":
        return _SelfProtecting(self.x.to(device, non_blocking=non_blocking), self.log)

    def record_stream(self, stream: Any) -> None:
        self.log.append(stream)


@pytest.mark.parametrize("current", [0, 1])
def test_cuda_path_copies_one_ahead_on_one_side_stream_and_protects_what_it_hands_over(current: int) -> None:
    from cuda_standin import fake_cuda

    n = 3
    with fake_cuda(devices=2, current=current) as cuda:
        loader = [(torch.full((2, 4), i).pin_memory(), torch.full((2,), i).pin_memory()) for i in range(n)]
        pf = Prefetcher(loader, "cuda:1")
        assert "side stream" in repr(pf) and pf.stream is not None and pf.stream.index == 1
        epochs = [[(len(cuda.log), b) for b in pf] for _ in range(2)]  # (place in the log, batch) per hand-over
        side, consumer, log = pf.stream, cuda.default[1], cuda.log
        assert cuda._made == 1  # one side stream for both epochs
        assert cuda.current == current  # the side stream's device was current only while copies were queued
        copies = cuda.ops("copy")
        assert len(copies) == 2 * 2 * n
        assert all(op.stream is side and op["non_blocking"] and op["src_pinned"] for op in copies)
        waits = [i for i, op in enumerate(log) if op.kind == "wait_stream" and op.stream is side]
        assert len(waits) == 2 and all(log[i]["other"] is consumer for i in waits)  # once per epoch, first
        for w, handed in zip(waits, epochs):
            assert [int(y[0]) for _, (x, y) in handed] == list(range(n))
            assert w < min(log.index(op) for op in copies if op["out"] in {id(t) for t in handed[0][1]})
            for k, (at, batch) in enumerate(handed):
                ids = {id(t) for t in batch}
                last_copy = max(i for i, op in enumerate(log[:at]) if op.kind == "copy" and op["out"] in ids)
                ready = next(op for op in log[last_copy:at] if op.kind == "record" and op.stream is side)
                assert any(
                    op.kind == "wait_event" and op.stream is consumer and op["event"] is ready["event"]
                    for op in log[log.index(ready) : at]
                )  # the compute stream waits for batch k's copy before it is handed over
                recorded = {op["tensor"] for op in log[last_copy:at] if op.kind == "record_stream"}
                assert ids <= recorded and all(op.stream is consumer for op in cuda.ops("record_stream"))
                if k < n - 1:  # batch k+1's copy is queued before batch k is handed over
                    nxt = {id(t) for t in handed[k + 1][1]}
                    assert sum(op.kind == "copy" and op["out"] in nxt for op in log[:at]) == 2
        assert not cuda.host_syncs()  # the prefetcher never makes the host wait


def test_cuda_path_moves_custom_objects_and_normalises_with_statistics_copied_once(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from cuda_standin import fake_cuda

    from helpers.pipeline import data

    monkeypatch.setattr(data, "_STATS_CACHE", {})  # the stand-in's tensors stay out of the real cache
    protected: list[Any] = []
    imgs = [torch.randint(0, 256, (2, 3, 4, 4), dtype=torch.uint8) for _ in range(3)]
    with fake_cuda(devices=1, current=0) as cuda:
        loader = [{"img": im, "obj": _SelfProtecting(torch.ones(2), protected)} for im in imgs]
        pf = Prefetcher(loader, "cuda", normalize=(MEAN, STD))
        got = list(pf)
        stats = [op for op in cuda.ops("copy") if op["shape"] == (3, 1, 1)]
        assert len(stats) == 2 and all(op.stream is cuda.default[0] for op in stats)  # at __init__, not per batch
        assert [b["obj"].x.is_cuda for b in got] == [True] * 3  # moved by its own .to()
    for b, im in zip(got, imgs):
        assert torch.equal(b["img"], data.to_float_normalized(im, MEAN, STD))
    assert protected == [cuda.default[0]] * 3  # its own record_stream, with the compute stream


def _reference_pairs(loader: Any, device: Any) -> Prefetcher:
    from helpers.pipeline import data

    return Prefetcher(loader, device, normalize=(data.MEAN, data.STD))


class _ReaderPrefetcher:
    """What chapter 05's reader writes: (uint8 x, y) pairs, copied on one side stream, normalised there."""

    def __init__(self, loader: Any, device: Any) -> None:
        self.loader, self.device = loader, torch.device(device)
        self.side = torch.cuda.Stream(self.device)  # made once (on a CPU only under the stream doubles)

    def _issue(self, batch: Any) -> Any:
        from helpers.pipeline import data

        x, y = batch
        with torch.cuda.stream(self.side):
            x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
            return data.to_float_normalized(x), y

    def __iter__(self) -> Any:
        current = torch.cuda.current_stream(self.device)
        self.side.wait_stream(current)
        it = iter(self.loader)
        nxt = self._issue(next(it))
        while nxt is not None:
            current.wait_stream(self.side)
            for t in nxt:
                t.record_stream(current)
            batch = next(it, None)
            out, nxt = nxt, (self._issue(batch) if batch is not None else None)
            yield out


def _small_gpu_checks(monkeypatch, prefetch) -> tuple[list[torch.Size], list[torch.device]]:  # type: ignore[no-untyped-def]
    """The GPU checks at stand-in sizes, their compute replaced by one that logs the shapes it was given."""
    from helpers.pipeline import data

    monkeypatch.setattr(data, "_STATS_CACHE", {})
    monkeypatch.setattr(prefetch, "RACE_BATCHES", (1, 3))
    monkeypatch.setattr(prefetch, "OVERLAP_BATCHES", (1, 2))
    monkeypatch.setattr(prefetch, "OVERLAP_ROUNDS", 2)
    computed: list[torch.Size] = []
    calibrated: list[torch.device] = []

    def calibrated_compute(dev: torch.device, seconds: float) -> Any:
        calibrated.append(dev)
        return lambda batch: computed.append(batch.shape)

    monkeypatch.setattr(prefetch, "calibrated_compute", calibrated_compute)
    return computed, calibrated


def _on_gpu_only(bad: Any) -> Any:
    """The reader's prefetcher under the stream doubles (the protocol passes), ``bad`` with real streams."""
    return lambda loader, device: _ReaderPrefetcher(loader, device) if device.type == "cpu" else bad(loader, device)


def test_the_race_check_runs_on_the_checked_device_and_names_what_is_missing(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """On the stand-ins (no race can show there): the check's batches, delay and comparisons go to cuda:1; stale
    batches and batches left on the host are named."""
    from cuda_standin import fake_cuda

    from helpers.chapters.ch05 import prefetch

    _small_gpu_checks(monkeypatch, prefetch)
    with fake_cuda(devices=2, current=0) as cuda:

        def stale(loader: Any, device: Any) -> Any:  # hands batch 0 over again and again: wrong values
            first = next(iter(_ReaderPrefetcher(loader, device)))
            return (first for _ in loader)

        ok = prefetch.check_pipeline_prefetcher(_ReaderPrefetcher, "cuda:1")
        assert "on cuda:1: with real streams, each batch right" in str(ok) and "race check" not in str(ok), str(ok)
        assert {op.stream.index for op in cuda.ops("kernel")} == {1}  # the delay queued on the checked device
        assert all(op["device"] == torch.device("cuda", 1) for op in cuda.ops("copy"))
        wrong = prefetch.check_pipeline_prefetcher(_on_gpu_only(stale), "cuda:1")
        races = [m for m in wrong.messages if m.startswith("race check")]
        assert not wrong.correct and len(races) == 2 and "batch 1 had" in races[0] and "wait_stream" in races[0]
        assert "record_stream" in races[1] and "overlap on" not in str(wrong)
        host = prefetch.check_pipeline_prefetcher(_on_gpu_only(lambda loader, device: iter(loader)), "cuda:1")
        assert not host.correct and "race check: batch 0 came back on cpu, not on the CUDA device" in host.messages


def test_the_overlap_ratio_times_the_candidate_on_the_device_and_stays_between_0_and_1(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """On the stand-ins the ratio means nothing (never shown); the test checks what runs where and the bounds."""
    import re

    from cuda_standin import fake_cuda

    from helpers.chapters.ch05 import prefetch

    computed, calibrated = _small_gpu_checks(monkeypatch, prefetch)
    with fake_cuda(devices=2, current=0) as cuda:
        res = prefetch.check_pipeline_prefetcher(_ReaderPrefetcher, "cuda:1")
        found = re.search(r"overlap on cuda:1: (\d+)% of the copy time hidden", str(res))
        assert found and 0 <= int(found[1]) <= 100, str(res)
        assert calibrated == [torch.device("cuda", 1)]
        assert len(computed) == (2 + 1) * (2 + 2) and all(len(s) == 4 for s in computed)  # each batch, each pass
        assert {op["device"] for op in cuda.host_syncs() if "device" in op.detail} == {1}
        assert {op["device"] for op in cuda.ops("copy")} == {torch.device("cuda", 1)}


def test_the_exercise_check_passes_a_reader_prefetcher_on_the_standin_gpu_and_refuses_the_reference(
    monkeypatch,  # type: ignore[no-untyped-def]
) -> None:
    """The GPU branch of check_pipeline_prefetcher on the stand-ins: the race check runs, the overlap ratio's
    verdict (replaced here: its own test is above), the reference is refused."""
    from cuda_standin import fake_cuda

    from helpers.chapters.ch05 import prefetch

    _small_gpu_checks(monkeypatch, prefetch)
    monkeypatch.setattr(prefetch, "prefetch_overlap_ratio", lambda c, dev: 0.5)
    with fake_cuda(devices=1, current=0):
        assert prefetch.check_pipeline_prefetcher(_ReaderPrefetcher, "cpu").correct  # the protocol, on the doubles
        res = prefetch.check_pipeline_prefetcher(_ReaderPrefetcher, "cuda")
        assert res.correct, str(res)
        assert "on cuda: with real streams" in str(res)
        assert "50% of the copy time hidden" in str(res)
        monkeypatch.setattr(prefetch, "prefetch_overlap_ratio", lambda c, dev: 0.1)
        late = prefetch.check_pipeline_prefetcher(_ReaderPrefetcher, "cuda")
        assert not late.correct and "does NOT overlap" in str(late)

        def stale(loader: Any, device: Any) -> Any:
            first = next(iter(_ReaderPrefetcher(loader, device)))
            return (first for _ in loader)

        res = prefetch.check_pipeline_prefetcher(_on_gpu_only(stale), "cuda")
        assert not res.correct and "race check" in str(res) and "overlap on" not in str(res)
        assert "reference" in str(prefetch.check_pipeline_prefetcher(_on_gpu_only(_reference_pairs), "cuda"))
