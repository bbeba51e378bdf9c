from __future__ import annotations

import pytest

from helpers.core import config
from helpers.core.validate import check_choice, check_float, check_int, human_bytes, human_seconds


@pytest.mark.parametrize("raw,expected", [("1", True), ("true", True), ("0", False), ("", False), ("no", False)])
def test_quick_mode_values(monkeypatch: pytest.MonkeyPatch, raw: str, expected: bool) -> None:
    monkeypatch.setenv(config.QUICK_ENV, raw)
    assert config.quick_mode() is expected
    monkeypatch.delenv(config.FULL_ENV, raising=False)
    monkeypatch.setattr(config, "_cuda_present", lambda: False)
    assert config.sized(1, 2) == (1 if expected else 2)
    assert config.sized(1, 2, laptop=3) == (1 if expected else 3)
    assert config.mode_name() == ("quick" if expected else "laptop")


@pytest.mark.parametrize("cuda,full,tier", [(False, "", "laptop"), (True, "", "full"), (False, "1", "full")])
def test_size_tiers(monkeypatch: pytest.MonkeyPatch, cuda: bool, full: str, tier: str) -> None:
    monkeypatch.setenv(config.QUICK_ENV, "0")
    monkeypatch.setenv(config.FULL_ENV, full)
    monkeypatch.setattr(config, "_cuda_present", lambda: cuda)
    monkeypatch.setattr(
        config, "usable_cpu_cores", lambda: 8
    )  # enough for the full tier (tests/test_tier_cpu.py: too few)
    assert config.size_tier() == tier
    assert config.sized(quick=1, full=2, laptop=3) == {"laptop": 3, "full": 2}[tier]
    assert tier in config.decide_tier()[1]


def test_quick_and_full_together_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(config.QUICK_ENV, "1")
    monkeypatch.setenv(config.FULL_ENV, "1")
    with pytest.raises(ValueError, match="contradict"):
        config.size_tier()


_READERS = {
    "WORKBOOK_QUICK": config.quick_mode,
    "WORKBOOK_FULL": config.full_requested,
    "WORKBOOK_GRADE": config.grade_mode,
    "WORKBOOK_REQUIRE_GPU": config.require_gpu,
}


@pytest.mark.parametrize("env", list(_READERS))
@pytest.mark.parametrize("raw", ["banana", "2", "on", "off", "y", "-1"])
def test_every_flag_refuses_unknown_values(monkeypatch: pytest.MonkeyPatch, env: str, raw: str) -> None:
    """One line naming the variable, the value and the accepted values (issue #25.7)."""
    monkeypatch.setenv(env, raw)
    for read in (_READERS[env], config.check_environment):
        with pytest.raises(ValueError) as err:
            read()
        msg = str(err.value)
        assert "\n" not in msg and msg.startswith(f"{env}={raw!r} is not understood")
        assert "1/true/yes/0/false/no" in msg


@pytest.mark.parametrize("env", list(_READERS))
@pytest.mark.parametrize(
    "raw,value",
    [("1", True), ("TRUE", True), (" Yes ", True), ("0", False), ("False", False), ("NO", False), ("", False)],
)
def test_every_flag_accepts_yes_no_in_any_case(
    monkeypatch: pytest.MonkeyPatch, env: str, raw: str, value: bool
) -> None:
    for other in _READERS:
        monkeypatch.delenv(other, raising=False)
    monkeypatch.setenv(env, raw)
    assert _READERS[env]() is value
    config.check_environment()


def test_check_environment_refuses_quick_and_full(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(config.QUICK_ENV, "yes")
    monkeypatch.setenv(config.FULL_ENV, "true")
    with pytest.raises(ValueError, match="contradict"):
        config.check_environment()


def test_quick_mode_rejects_garbage(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(config.QUICK_ENV, "maybe")
    with pytest.raises(ValueError, match="WORKBOOK_QUICK"):
        config.quick_mode()


def test_folders_follow_env(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setenv(config.CACHE_ENV, str(tmp_path / "c"))
    monkeypatch.setenv(config.ARTIFACTS_ENV, str(tmp_path / "a"))
    assert config.cache_dir() == tmp_path / "c" and (tmp_path / "c").is_dir()
    assert config.artifacts_dir() == tmp_path / "a" and (tmp_path / "a").is_dir()


def test_check_int() -> None:
    assert check_int("n", 3, 1, 5) == 3
    with pytest.raises(ValueError, match=r"batch_size must be an integer in \[1, 64\], got 0"):
        check_int("batch_size", 0, 1, 64)
    for bad in (True, 2.5, "3", None):
        with pytest.raises(ValueError, match="n must be an integer"):
            check_int("n", bad, 1, 5)
    assert check_int("n", 10**9, 1) == 10**9


def test_check_float_and_choice() -> None:
    assert check_float("x", 0.5, 0.0, 1.0) == 0.5
    for bad in (float("nan"), -1, 2, "a", True):
        with pytest.raises(ValueError, match="x must be a number"):
            check_float("x", bad, 0.0, 1.0)
    assert check_choice("kind", "a", ["a", "b"]) == "a"
    with pytest.raises(ValueError, match=r"kind must be one of \['a', 'b'\]"):
        check_choice("kind", "c", ["a", "b"])


def test_human_formats() -> None:
    assert human_bytes(512) == "512 B"
    assert human_bytes(3 * 2**20) == "3.0 MiB"
    assert human_seconds(0.0012) == "1.20 ms"
    assert human_seconds(2.5) == "2.50 s"
    assert human_seconds(3e-6) == "3.0 µs"
    assert human_seconds(float("nan")) == "nan"


def test_strict_gpu_error_lets_only_cuda_errors_of_a_strict_run_through(monkeypatch: pytest.MonkeyPatch) -> None:
    """The one rule the exercise checker and ch05's prefetcher check share: on a strict GPU run
    (``WORKBOOK_REQUIRE_GPU=1``) a CUDA error propagates instead of becoming a verdict; anything else does not."""

    class AcceleratorError(RuntimeError):  # torch's class, matched by name (the rule imports no torch)
        pass

    cuda, other = RuntimeError("CUDA error: an illegal memory access was encountered"), RuntimeError("shape")
    monkeypatch.delenv("WORKBOOK_REQUIRE_GPU", raising=False)
    assert not any(config.strict_gpu_error(e) for e in (cuda, AcceleratorError("x"), other))
    monkeypatch.setenv("WORKBOOK_REQUIRE_GPU", "1")
    assert config.strict_gpu_error(cuda) and config.strict_gpu_error(AcceleratorError("x"))
    assert not config.strict_gpu_error(other) and not config.strict_gpu_error(ValueError("CUDA"))
