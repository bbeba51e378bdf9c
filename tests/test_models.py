"""Unit tests for helpers.pipeline.models."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from helpers.chapters.ch01 import anatomy
from helpers.pipeline import models


def test_forward_shape_and_any_size() -> None:
    m = models.SmallCNN(num_classes=5, width=4, depth=3)
    for size in (8, 33, 64):
        assert m(torch.randn(2, 3, size, size)).shape == (2, 5)


def test_build_model_is_seeded_and_leaves_global_rng_alone() -> None:
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    a = models.build_model(width=4, seed=7)
    after = torch.rand(1)
    b = models.build_model(width=4, seed=7)
    c = models.build_model(width=4, seed=8)
    assert torch.equal(before, after)
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)
    assert not all(torch.equal(pa, pc) for pa, pc in zip(a.parameters(), c.parameters()))


def test_flops_match_hand_count() -> None:
    m = models.SmallCNN(num_classes=2, width=2, depth=1)
    # conv 3->2 at 8x8: 2*(3*9)*2*64 = 6912; linear 2->2: 2*2*2 = 8
    assert models.flops_per_sample(m, 8) == 6912 + 8


def test_width_scales_compute_quadratically() -> None:
    f8 = models.flops_per_sample(models.SmallCNN(width=8), 64)
    f16 = models.flops_per_sample(models.SmallCNN(width=16), 64)
    f64 = models.flops_per_sample(models.SmallCNN(width=64), 64)
    assert 3.0 < f16 / f8 < 4.1
    assert f64 / f8 > 30  # more than an order of magnitude
    assert models.flops_per_sample(models.SmallCNN(width=8, convs_per_stage=2), 64) > 1.5 * f8


def test_flops_does_not_change_mode_or_weights() -> None:
    m = models.SmallCNN(width=4)
    m.train()
    state = {k: v.clone() for k, v in m.state_dict().items()}
    models.flops_per_sample(m, 32)
    assert m.training
    for k, v in m.state_dict().items():
        assert torch.equal(v, state[k]), k


def test_describe_and_parameters() -> None:
    m = models.build_model(width=8, depth=2, num_classes=3)
    expected = sum(p.numel() for p in m.parameters())
    text = models.describe_model(m, 32)
    assert "width=8" in text and "GFLOP" in text and f" {expected / 1e3:.1f} k parameters" in text


@pytest.mark.parametrize(
    "kwargs", [dict(width=0), dict(depth=7), dict(num_classes=1), dict(convs_per_stage=0), dict(width=1.5)]
)
def test_bad_arguments(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        models.SmallCNN(**kwargs)


def test_the_one_normaliser_is_in_data_only() -> None:
    from helpers.pipeline import data

    assert not hasattr(models, "to_float_normalized")  # one normaliser, one name (issue 17)
    x = torch.full((1, 3, 2, 2), 255, dtype=torch.uint8)
    out = data.to_float_normalized(x)
    assert out.dtype == torch.float32 and torch.allclose(out, torch.full_like(out, 2.0))


def test_trains_on_a_trivial_problem() -> None:
    torch.manual_seed(0)
    m = models.build_model(width=4, depth=2, num_classes=2)
    x = torch.randn(32, 3, 16, 16)
    y = (x.mean(dim=(1, 2, 3)) > 0).long()
    x = x + (y.float() * 2 - 1).view(-1, 1, 1, 1)  # separable
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    for _ in range(30):
        loss = nn.functional.cross_entropy(m(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert (m(x).argmax(1) == y).float().mean() > 0.9


def test_training_memory_is_checked_against_what_is_free() -> None:
    """Issue 15.10: sizes are checked against memory, not one at a time."""
    m = models.build_model(width=8, depth=3)
    small = anatomy.check_training_memory(m, 32, 4, available_bytes=10**12)  # the estimate, when it fits
    assert small > 4 * 3 * 32 * 32 * 4  # at least the batch itself
    assert anatomy.check_training_memory(m, 32, 8, available_bytes=10**12) == 2 * small
    assert anatomy.check_training_memory(m, 64, 4, available_bytes=10**12) > 3 * small  # grows with the pixels
    with pytest.raises(ValueError, match="batch_size/crop_size/width.*GiB"):
        anatomy.check_training_memory(m, 32, 4, available_bytes=small)


@pytest.mark.parametrize("image_size, batch_size", [(32, -5), (32, 0), (0, 8)])
def test_size_estimates_refuse_impossible_sizes(image_size: int, batch_size: int) -> None:
    m = models.SmallCNN(num_classes=4, width=4, depth=2)
    with pytest.raises(ValueError, match="image_size|batch_size"):
        anatomy.check_training_memory(m, image_size, batch_size, available_bytes=10**12)
    if image_size < 1:
        with pytest.raises(ValueError, match="image_size"):
            models.flops_per_sample(m, image_size)
