"""Chapter 06's calibration bounds its probes by the device memory free now (issue 24, item 3).

No GPU here: ``torch.cuda.empty_cache``, ``torch.cuda.mem_get_info`` and ``torch.cuda.memory_allocated`` are
replaced by stand-ins that log their calls and report a 15 GB card (a T4) with 11 GiB free once the cache is
emptied. The check must empty the cache *before* it reads the free memory, and the search must not measure a
model that would not fit.
"""

from __future__ import annotations

import pytest
import torch
from _ch06_support import flops

from helpers.chapters.ch06 import calibration as K

GIB = 2**30


@pytest.fixture
def t4(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    calls: list[str] = []
    state = {"cached": 3 * GIB}

    def empty_cache() -> None:
        calls.append("empty_cache")
        state["cached"] = 0

    def mem_get_info(device: object = None) -> tuple[int, int]:
        calls.append("mem_get_info")
        return 11 * GIB - state["cached"], 15 * GIB

    monkeypatch.setattr(torch.cuda, "empty_cache", empty_cache)
    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 1 * GIB)
    return calls


def test_the_estimate_grows_with_the_model_and_matches_a_t4_report() -> None:
    """Issue 24: on a T4, probes past (96, 3) at 224-pixel crops needed about 12-13 GiB."""
    need = K.probe_bytes(96, 3, 64, 224)
    assert 10 * GIB < need < 16 * GIB and need == 13_564_233_720  # the figure of the shape-by-shape formula it replaced
    assert K.probe_bytes(48, 3, 64, 224) < need < K.probe_bytes(128, 3, 64, 224) < K.probe_bytes(128, 4, 64, 224)


def test_free_memory_is_read_after_empty_cache(t4: list[str]) -> None:
    assert K.device_memory_check("cuda", 5 * GIB) is None  # fits in 80% of 11 GiB, once the cache is emptied
    assert t4 == ["empty_cache", "mem_get_info"]
    why = K.device_memory_check("cuda", 10 * GIB)
    assert why is not None and "11.0 GiB free of 15.0 GiB after empty_cache()" in why and "hold 1.0 GiB" in why
    assert K.device_memory_check("cpu", 10**15) is None and t4.count("mem_get_info") == 2  # no CUDA call on a CPU


def test_the_search_never_measures_a_model_that_would_not_fit(t4: list[str]) -> None:
    measured: list[tuple[int, int]] = []
    need = {m: K.probe_bytes(m[0], m[1], 64, 224) for m in K.MODEL_LADDER}

    def measure(width: int, depth: int) -> float:
        measured.append((width, depth))
        return 1e-9 * flops(width, depth, 224) / 1e3  # a fast GPU: every model is quick

    cal = K.choose_model(
        "compute-bound",
        measure,
        loader_s=1.0,
        start=(48, 3),
        crop_size=224,
        max_probes=20,
        budget_s=1e9,
        fits=lambda w, d: K.device_memory_check("cuda", K.probe_bytes(w, d, 64, 224)),
    )
    assert measured, "the start model fits and is measured"
    assert all(need[m] <= 0.8 * 11 * GIB for m in measured if m in need), measured
    assert not cal.reached and "was not tried" in cal.reason and "after empty_cache()" in cal.reason
    assert t4[:2] == ["empty_cache", "mem_get_info"]


@pytest.fixture
def pinned_cache(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """A stand-in host allocator: 1 GiB of pinned blocks cached (64 MiB in use) until emptied; calls logged."""
    from helpers.pipeline import transfer

    calls: list[str] = []
    state = {"held": GIB}

    def stats() -> dict[str, int]:
        calls.append("stats")
        return {"allocated_bytes": state["held"], "active_bytes": 64 * 2**20}

    def empty_host_cache() -> None:
        calls.append("empty_host_cache")
        state["held"] = 64 * 2**20  # the blocks in use stay

    monkeypatch.setattr(transfer, "host_allocator_stats", stats)
    monkeypatch.setattr(torch.accelerator, "empty_host_cache", empty_host_cache, raising=False)  # torch 2.7 has none
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append(f"sync {device}"))
    return calls


def test_pinned_host_memory_is_reported_then_released(pinned_cache: list[str]) -> None:
    """After the waterfall on CUDA: one line with what the host allocator holds, then what releasing it gave back.

    Order checked: stats, every device synchronised (a queued copy pins its block), release, stats again.
    """
    line = K.release_pinned_host_memory("cuda")
    assert pinned_cache == ["stats", "sync 0", "sync 1", "empty_host_cache", "stats"]
    assert "\n" not in line
    assert "1024 MiB (64 MiB of it in use)" in line and "released 960 MiB, 64 MiB still held" in line


def test_pinned_host_memory_says_what_it_cannot_do(pinned_cache: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    assert K.release_pinned_host_memory("cpu").startswith("pinned host memory: none (no CUDA device")
    assert pinned_cache == []  # nothing asked of CUDA on a CPU
    monkeypatch.delattr(torch.accelerator, "empty_host_cache")  # an older torch: the private call the public one wraps
    monkeypatch.setattr(torch._C, "_host_emptyCache", lambda: pinned_cache.append("_host_emptyCache"), raising=False)
    line = K.release_pinned_host_memory("cuda")
    assert pinned_cache == ["stats", "sync 0", "sync 1", "_host_emptyCache", "stats"]
    assert "torch._C._host_emptyCache() released" in line
    pinned_cache.clear()
    monkeypatch.delattr(torch._C, "_host_emptyCache")  # neither call
    line = K.release_pinned_host_memory("cuda")
    assert "has no call to release it: it stays held" in line and "1024 MiB" in line
    assert pinned_cache == ["stats"]
