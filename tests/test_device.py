from __future__ import annotations

import pytest
import torch

from helpers import device


def test_pick_device_without_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert device.pick_device().type in ("cpu", "mps", "xpu")
    assert device.pick_device("cpu") == torch.device("cpu")
    with pytest.raises(ValueError, match="no CUDA device is present"):
        device.pick_device("cuda")


def test_has_cuda_never_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken() -> bool:
        raise RuntimeError("driver exploded")

    monkeypatch.setattr(torch.cuda, "is_available", broken)
    assert device.has_cuda() is False


@pytest.mark.parametrize("gen,width,expected", [(3, 16, 15.75), (4, 16, 31.5), (5, 16, 63.0), (4, 8, 15.75)])
def test_pcie_bandwidth(gen: int, width: int, expected: float) -> None:
    assert device.pcie_bandwidth_gbps(gen, width) == pytest.approx(expected, rel=0.01)


@pytest.mark.parametrize("gen,width", [(0, 16), (7, 16), (4, 0), (4, 64), ("4", 16)])
def test_pcie_bandwidth_bad_input(gen, width) -> None:
    with pytest.raises(ValueError, match="must be an integer"):
        device.pcie_bandwidth_gbps(gen, width)


def test_hardware_report_on_this_machine() -> None:
    rep = device.hardware_report()
    assert rep.torch_version == torch.__version__
    assert rep.cpu_cores_logical and rep.cpu_cores_logical >= 1
    assert rep.ram_total_bytes and rep.ram_total_bytes > 0
    # every unknown field explains itself
    for name, value in rep.to_dict().items():
        if value is None:
            assert name in rep.missing, f"{name} is None without a reason"
    text = rep.describe()
    assert "Link ceiling per direction (theoretical)" in text
    if not torch.cuda.is_available():
        assert rep.gpu_name is None and "no CUDA device" in rep.missing["gpu_name"]
        assert rep.link_bandwidth_gbps is None
    assert set(rep.fingerprint()) >= {"gpu_name", "cpu_model"}
    assert "<table>" in rep._repr_html_()


def test_hardware_report_survives_broken_psutil(monkeypatch: pytest.MonkeyPatch) -> None:
    import psutil

    def broken(*a, **k):
        raise OSError("no /proc")

    monkeypatch.setattr(psutil, "virtual_memory", broken)
    rep = device.hardware_report("cpu")
    assert rep.ram_total_bytes is None and "psutil failed" in rep.missing["ram_total_bytes"]
    assert "not available (psutil failed" in rep.describe()


def test_environment_check_lines() -> None:
    lines = device.environment_check()
    names = [l.name for l in lines]
    assert {"python", "torch", "torchvision", "device", "/dev/shm"} <= set(names)
    assert all(l.ok for l in lines if l.name in ("torch", "torchvision", "matplotlib", "ipywidgets"))
    assert all(str(l).startswith(("[ok]", "[warning]")) for l in lines)


def test_environment_check_flags_small_shm() -> None:
    rep = device.hardware_report("cpu")
    rep.shm_free_bytes, rep.shm_total_bytes = 64 << 20, 64 << 20
    shm = [l for l in device.environment_check(rep) if l.name == "/dev/shm"][0]
    assert not shm.ok and "--shm-size" in shm.detail


def test_no_cuda_message() -> None:
    msg = device.no_cuda_message("the bandwidth")
    assert msg.startswith("No CUDA device is present") and "the bandwidth" in msg


def test_require_gpu_refuses_cpu_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("WORKBOOK_REQUIRE_GPU", "1")
    with pytest.raises(RuntimeError, match="no CUDA device is present"):
        device.pick_device()
    monkeypatch.setenv("WORKBOOK_REQUIRE_GPU", "perhaps")
    with pytest.raises(ValueError, match="WORKBOOK_REQUIRE_GPU"):
        device.pick_device()
    monkeypatch.setenv("WORKBOOK_REQUIRE_GPU", "0")
    assert device.pick_device().type == "cpu"


def test_resolve_device():
    from helpers.device import has_cuda, resolve_device

    assert resolve_device("cpu").type == "cpu"
    assert resolve_device(None).type == ("cuda" if has_cuda() else "cpu")
    with pytest.raises(ValueError, match="device must be one of"):
        resolve_device("meta")
    if not has_cuda():
        with pytest.raises(ValueError, match="no CUDA device"):
            resolve_device("cuda")


def test_intraop_threads_sets_and_restores():
    import torch

    from helpers.device import intraop_threads

    before = torch.get_num_threads()
    with intraop_threads(1) as n:
        assert n == 1 and torch.get_num_threads() == 1
    assert torch.get_num_threads() == before
    with pytest.raises(ValueError, match="threads"):
        with intraop_threads(0):
            pass
    with pytest.raises(KeyError):
        with intraop_threads(1):
            raise KeyError("x")
    assert torch.get_num_threads() == before
