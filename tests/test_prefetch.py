"""Tests for helpers.prefetch: order, exhaustion, re-iteration, batch structures, normalisation.

Everything runs on CPU (pass-through); the CUDA tests run only where a GPU exists.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from helpers.prefetch import (
    CUDAPrefetcher,
    Pair,
    Prefetcher,
    Sample,
    _same,
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
    (x, y), = list(pf)
    ref = tv.normalize(tv.to_dtype(imgs, torch.float32, scale=True), list(MEAN), list(STD))
    assert x.dtype == torch.float32 and x.shape == imgs.shape
    torch.testing.assert_close(x, ref, rtol=0, atol=1e-6)
    assert torch.equal(y, labels)  # labels are not touched
    torch.testing.assert_close(normalize_uint8(imgs, MEAN, STD), ref, rtol=0, atol=1e-6)


def test_normalisation_matches_the_chapter_01_dataset_helper() -> None:
    data = pytest.importorskip("helpers.data")
    imgs = torch.randint(0, 256, (2, 3, 5, 5), dtype=torch.uint8)
    (x,) = list(Prefetcher([imgs], "cpu", normalize=(data.MEAN, data.STD)))
    assert torch.equal(x, data.to_float_normalized(imgs))


def test_float_tensors_are_not_normalised_and_dtype_is_respected() -> None:
    f = torch.rand(2, 3, 4, 4)
    u = torch.randint(0, 256, (3, 4, 4), dtype=torch.uint8)  # a single CHW image works too
    (a, b), = list(Prefetcher([(f, u)], "cpu", normalize=(MEAN, STD), dtype=torch.float64))
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


def test_default_device_and_alias() -> None:
    pf = CUDAPrefetcher([torch.ones(1)])
    assert pf.device.type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert "Prefetcher" in repr(pf)


def test_workers_loader_passes_through() -> None:
    ds = TensorDataset(torch.arange(12))
    loader = DataLoader(ds, batch_size=4, num_workers=2, persistent_workers=False)
    assert [b[0].tolist() for b in Prefetcher(loader, "cpu")] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]


# -- the exercise checker ------------------------------------------------------


def _two_stage(loader: Any, device: Any) -> Any:
    it = iter(loader)
    nxt = next(it, None)
    while nxt is not None:
        cur, nxt = nxt, next(it, None)
        yield move_batch(cur, device)


class _Dropper:
    def __init__(self, loader: Any, device: Any) -> None:
        self.loader = loader

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(list(self.loader)[:-1])


def test_checker_accepts_the_helper_and_a_generator_function() -> None:
    assert check_prefetcher(Prefetcher, "cpu").correct
    res = check_prefetcher(_two_stage, "cpu")
    assert res.correct and not res.overlap_checked


def test_checker_rejects_wrong_answers_without_crashing() -> None:
    assert check_prefetcher(None).correct is False
    assert check_prefetcher(42).correct is False
    res = check_prefetcher(_Dropper, "cpu")
    assert not res.correct and "gave 4 batches" in str(res)

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
    res = check_prefetcher(Prefetcher, "cuda")
    assert res.overlap_checked and res.overlap_ratio is not None
