"""Tests for helpers.pipeline.prefetch: order, exhaustion, re-iteration, batch structures, normalisation.

Everything runs on CPU (pass-through); the CUDA tests run only where a GPU exists.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, NamedTuple

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from helpers.pipeline.prefetch import (
    Pair,
    Prefetcher,
    Sample,
    _same,
    check_order,
    check_prefetcher,
    example_loaders,
    iter_tensors,
    map_tensors,
    move_batch,
    normalize_uint8,
)

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


def _loader(n: int = 10, batch_size: int = 3) -> DataLoader:
    ds = TensorDataset(torch.arange(n * 2, dtype=torch.float32).view(n, 2), torch.arange(n))
    return DataLoader(ds, batch_size=batch_size, shuffle=False)


def test_cpu_passes_through_in_order_and_exhausts() -> None:
    loader = _loader()
    pf = Prefetcher(loader, "cpu")
    assert pf.stream is None and not pf.overlaps
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
    torch.testing.assert_close(normalize_uint8(imgs, MEAN, STD), ref, rtol=0, atol=1e-6)


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
        ({"safety": "hope"}, "safety"),
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


# -- the exercise checker ------------------------------------------------------


def _reads_ahead_moves_late(loader: Any, device: Any) -> Any:
    """Requests batch i+1 before handing over batch i, but moves each batch only as it hands it over."""
    it = iter(loader)
    nxt = next(it, None)
    while nxt is not None:
        cur, nxt = nxt, next(it, None)
        yield move_batch(cur, device)


def _reader_style(loader: Any, device: Any) -> Any:
    """What a reader writes: two stages, the next batch fetched and moved before the current one is handed over.

    On a GPU the copy runs on one side stream; the consumer's stream waits for it and the
    batch is protected with record_stream. On a CPU the same structure, without streams.
    """
    device = torch.device(device)
    side = torch.cuda.Stream(device) if device.type == "cuda" else None

    def issue(batch: Any) -> Any:
        if side is None:
            return move_batch(batch, device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            return move_batch(batch, device)

    it = iter(loader)
    first = next(it, None)
    if first is None:
        return
    nxt = issue(first)
    while nxt is not None:
        if side is not None:
            consumer = torch.cuda.current_stream(device)
            consumer.wait_stream(side)
            for t in iter_tensors(nxt):
                if t.is_cuda:
                    t.record_stream(consumer)
        cur = nxt
        following = next(it, None)
        nxt = issue(following) if following is not None else None
        yield cur
        del cur


class _ReaderStyleClass:
    """The same, as a class (re-iterable)."""

    def __init__(self, loader: Any, device: Any) -> None:
        self.loader, self.device = loader, device

    def __iter__(self) -> Any:
        return _reader_style(self.loader, self.device)


class _Dropper:
    def __init__(self, loader: Any, device: Any) -> None:
        self.loader = loader

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(list(self.loader)[:-1])


def test_checker_accepts_a_reader_style_prefetcher_on_cpu() -> None:
    for candidate in (_reader_style, _ReaderStyleClass):
        res = check_prefetcher(candidate, "cpu")
        assert res.correct, str(res)
        assert not res.overlap_checked
        assert "requested and moved before" in str(res)


def test_checker_refuses_a_pass_through_on_cpu() -> None:
    res = check_prefetcher(lambda loader, device: (b for b in loader), "cpu")
    assert not res.correct and "pass-through" in str(res)
    res = check_prefetcher(lambda loader, device: (move_batch(b, device) for b in loader), "cpu")
    assert not res.correct and "pass-through" in str(res)


def test_checker_refuses_moving_late_and_reading_the_whole_epoch() -> None:
    res = check_prefetcher(_reads_ahead_moves_late, "cpu")
    assert not res.correct and "only after it" in str(res)

    def everything_first(loader: Any, device: Any) -> Any:
        return [move_batch(b, device) for b in loader]

    res = check_prefetcher(everything_first, "cpu")
    assert not res.correct and "read ahead" in str(res)


def test_checker_refuses_the_reference_prefetcher() -> None:
    class Mine(Prefetcher):
        pass

    for candidate in (Prefetcher, Mine, lambda loader, device: Prefetcher(loader, device)):
        res = check_prefetcher(candidate, "cpu")
        assert not res.correct and "reference" in str(res), candidate

    def hidden(loader: Any, device: Any) -> Any:
        yield from Prefetcher(loader, device)

    res = check_prefetcher(hidden, "cpu")
    assert not res.correct and "reference" in str(res)


def test_order_check_logs_requests_moves_and_hand_overs() -> None:
    assert check_order(_reader_style, "cpu") == []
    problems = check_order(lambda loader, device: iter(loader), "cpu")
    assert len(problems) == 1 and "batch 1 was requested" in problems[0]
    # the reference implementation passes through on a CPU (nothing to overlap there), and the order shows it
    assert "pass-through" in check_order(Prefetcher, "cpu")[0]


def test_checker_rejects_wrong_answers_without_crashing() -> None:
    assert check_prefetcher(None).correct is False
    assert check_prefetcher(42).correct is False
    res = check_prefetcher(_Dropper, "cpu")
    assert not res.correct and "gave 5 batches of 6" in str(res)

    def boom(loader: Any, device: Any) -> Any:
        raise RuntimeError("oops")

    assert "RuntimeError" in str(check_prefetcher(boom, "cpu"))


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
    assert pf.pinned_batches == 8 and pf.pageable_batches == 0


@cuda
@pytest.mark.parametrize("safety", ["record_stream", "event"])
def test_cuda_normalise_and_structures(safety: str) -> None:
    imgs = torch.randint(0, 256, (2, 3, 4, 4), dtype=torch.uint8)
    loader = [{"img": imgs, "c": Custom(torch.ones(2), "t"), "p": Pair(imgs, torch.zeros(2))}]
    (b,) = list(Prefetcher(loader, "cuda", normalize=(MEAN, STD), pin_memory=True, safety=safety))
    torch.testing.assert_close(b["img"].cpu(), normalize_uint8(imgs, MEAN, STD), rtol=0, atol=1e-6)
    assert b["c"].x.is_cuda and b["p"].images.is_cuda


@cuda
def test_checker_measures_overlap_on_gpu() -> None:
    res = check_prefetcher(_reader_style, "cuda")
    assert res.correct, str(res)
    assert res.overlap_checked and res.overlap_ratio is not None


def _no_wait(loader: Any, device: Any) -> Any:
    """BUG: copies on a side stream but never makes the consuming stream wait for it."""
    side = torch.cuda.Stream(device)
    it = iter(loader)
    with torch.cuda.stream(side):
        nxt = move_batch(next(it), device)
    for batch in it:
        cur = nxt
        with torch.cuda.stream(side):
            nxt = move_batch(batch, device)
        yield cur
        del cur
    yield nxt


def _no_record_stream(loader: Any, device: Any) -> Any:
    """BUG: waits for the copy, but never protects the batch's memory with record_stream."""
    side = torch.cuda.Stream(device)
    consumer = torch.cuda.current_stream(device)
    it = iter(loader)
    with torch.cuda.stream(side):
        nxt = move_batch(next(it), device)
    for batch in it:
        consumer.wait_stream(side)
        cur = nxt
        with torch.cuda.stream(side):
            nxt = move_batch(batch, device)
        yield cur
        del cur
    consumer.wait_stream(side)
    yield nxt


@cuda
@pytest.mark.parametrize("buggy, word", [(_no_wait, "wait_stream"), (_no_record_stream, "record_stream")])
def test_race_check_catches_a_missing_wait_or_record_stream(buggy: Any, word: str) -> None:
    from helpers.pipeline.prefetch import check_race

    assert check_race(_reader_style, "cuda") == []
    found = [p for _ in range(3) for p in check_race(buggy, "cuda")]  # a race need not show every time
    assert any(word in p for p in found), found


# -- the one normaliser: cached statistics, no hidden synchronisation ------------------------


def test_one_normaliser_bit_exact_with_torchvision_and_statistics_cached(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import torchvision.transforms.v2.functional as tv

    from helpers.pipeline import data

    imgs = torch.randint(0, 256, (3, 3, 6, 6), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    ref = tv.normalize(tv.to_dtype(imgs, torch.float32, scale=True), list(MEAN), list(STD))
    assert torch.equal(data.to_float_normalized(imgs, MEAN, STD), ref)  # bit for bit, not just close
    assert torch.equal(normalize_uint8(imgs, MEAN, STD), ref)  # delegates to it
    assert torch.equal(normalize_uint8(imgs[0], MEAN, STD), ref[0])  # a single CHW image
    assert torch.equal(normalize_uint8(imgs.view(1, 3, 3, 6, 6), MEAN, STD), ref.view(1, 3, 3, 6, 6))

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
    normalize_uint8(imgs, MEAN, STD)
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
        "prefetcher uint8 event",
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
        source = iter(
            Prefetcher(loader, dev, normalize=norm, safety="event" if "event" in pipeline else "record_stream")
        )
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

    from helpers.chapters.ch05.overlap import _loop_hidden_syncs

    x = torch.randn(64, 64, device="cuda")
    with _syncs_are_errors(), pytest.raises(RuntimeError, match="synchroniz"):
        _loop_hidden_syncs(x, x, 1, _io.StringIO())


def test_checker_lets_cuda_errors_through_on_a_strict_gpu_run(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """WORKBOOK_REQUIRE_GPU=1: a CUDA error inside the checked code propagates instead of becoming a FAIL line."""
    from helpers.pipeline import prefetch

    cuda_dev, cpu = torch.device("cuda"), torch.device("cpu")
    err = RuntimeError("CUDA error: an illegal memory access was encountered")
    monkeypatch.setenv("WORKBOOK_REQUIRE_GPU", "1")
    assert prefetch._gpu_error(err, cuda_dev)
    assert not prefetch._gpu_error(RuntimeError("oops"), cuda_dev)  # the reader's own mistake stays a FAIL
    assert not prefetch._gpu_error(err, cpu)
    monkeypatch.setenv("WORKBOOK_REQUIRE_GPU", "0")
    assert not prefetch._gpu_error(err, cuda_dev)
