"""The size tier looks at the CPU side too: CUDA alone does not buy the full sizes (issue #24.4).

A hosted T4 has 2 vCPUs; the data-loading chapters are CPU-bound, so full sizes there would take about
10 minutes per chapter. CUDA presence and core counts are monkeypatched: nothing here needs a GPU.
"""

from __future__ import annotations

import pytest

from helpers.core import config, setup


@pytest.fixture
def auto_tier(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """No variable decides the tier: the machine does."""
    monkeypatch.delenv(config.QUICK_ENV, raising=False)
    monkeypatch.delenv(config.FULL_ENV, raising=False)
    return monkeypatch


@pytest.mark.parametrize(
    "cuda,cores,tier",
    [(True, 2, "laptop"), (True, 3, "laptop"), (True, 4, "full"), (True, 64, "full"), (False, 64, "laptop")],
)
def test_full_tier_needs_cuda_and_enough_cores(
    auto_tier: pytest.MonkeyPatch, cuda: bool, cores: int, tier: str
) -> None:
    auto_tier.setattr(config, "_cuda_present", lambda: cuda)
    auto_tier.setattr(config, "usable_cpu_cores", lambda: cores)
    assert config.size_tier() == tier
    assert config.sized(quick=1, full=2, laptop=3) == {"laptop": 3, "full": 2}[tier]


def test_few_cores_with_cuda_says_why(auto_tier: pytest.MonkeyPatch) -> None:
    auto_tier.setattr(config, "_cuda_present", lambda: True)
    auto_tier.setattr(config, "usable_cpu_cores", lambda: 2)
    reason = config.decide_tier()[1]
    assert reason.startswith("laptop sizes (CUDA present, but 2 CPU cores: full sizes would take up to ~10 min")
    assert f"{config.FULL_ENV}=1" in reason
    auto_tier.setattr(config, "usable_cpu_cores", lambda: 16)
    assert "a CUDA GPU and 16 CPU cores are present" in config.decide_tier()[1]


def test_full_requested_wins_over_few_cores(auto_tier: pytest.MonkeyPatch) -> None:
    auto_tier.setenv(config.FULL_ENV, "1")
    auto_tier.setattr(config, "_cuda_present", lambda: True)
    auto_tier.setattr(config, "usable_cpu_cores", lambda: 2)
    assert config.size_tier() == "full" and f"{config.FULL_ENV}=1 asks" in config.decide_tier()[1]


def test_setup_line_prints_the_reason(auto_tier: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    auto_tier.setattr(config, "_cuda_present", lambda: True)
    auto_tier.setattr(config, "usable_cpu_cores", lambda: 2)
    setup.chapter("04", prefer="cpu")
    out = " ".join(capsys.readouterr().out.split())
    assert "04 · laptop mode" in out and "CUDA present, but 2 CPU cores" in out


def test_cpu_cores_reads_affinity_and_cgroup_quota(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    assert config.usable_cpu_cores() >= 1
    monkeypatch.setattr(config.os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    real_path = config.Path

    def fake_path(*parts: object) -> object:
        if parts == ("/sys/fs/cgroup/cpu.max",):
            return real_path(tmp_path / "cpu.max")
        return real_path(*parts)

    monkeypatch.setattr(config, "Path", fake_path)
    assert config.usable_cpu_cores() == 16  # no cgroup file
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert config.usable_cpu_cores() == 16
    (tmp_path / "cpu.max").write_text("200000 100000\n")  # a container capped at 2 CPUs
    assert config.usable_cpu_cores() == 2
    (tmp_path / "cpu.max").write_text("150000 100000\n")
    assert config.usable_cpu_cores() == 2
    # one count for the whole workbook: the loaders' (chapters 03, 04, 06) is this one, the quota included
    from helpers.pipeline import loaders

    assert loaders.cpu_cores() == 2


@pytest.mark.parametrize("value", ["0", "false", "No"])
def test_explicit_full_0_gives_laptop_even_with_cuda(auto_tier: pytest.MonkeyPatch, value: str) -> None:
    """The GPU check runs a notebook at laptop sizes on a CUDA host with WORKBOOK_FULL=0 (issue #24.3)."""
    auto_tier.setattr(config, "_cuda_present", lambda: True)
    auto_tier.setattr(config, "usable_cpu_cores", lambda: 16)
    assert config.size_tier() == "full"  # unset: the machine decides
    auto_tier.setenv(config.FULL_ENV, "")
    assert config.size_tier() == "full"  # empty is unset
    auto_tier.setenv(config.FULL_ENV, value)
    assert config.size_tier() == "laptop" and config.sized(quick=1, full=2, laptop=3) == 3
    assert config.decide_tier()[1].startswith(f"laptop sizes ({config.FULL_ENV}=0 asks for them")
    auto_tier.setenv(config.QUICK_ENV, "1")
    assert config.size_tier() == "quick"  # quick with full=0 is the quick tier (the smoke and unit steps)
