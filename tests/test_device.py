from __future__ import annotations

import dataclasses

import pytest
import torch

from helpers.chapters import ch00
from helpers.chapters.ch02 import model
from helpers.core import device, results


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
    for name, value in dataclasses.asdict(rep).items():
        if value is None:
            assert name in rep.missing, f"{name} is None without a reason"
    text = rep.describe()
    assert "Link ceiling per direction (theoretical)" in text
    if not torch.cuda.is_available():
        assert rep.gpu_name is None and "no CUDA device" in rep.missing["gpu_name"]
        assert rep.link_bandwidth_gbps is None
    assert set(results.ResultSet.new("x", "m", "cpu").hardware) >= {"gpu_name", "cpu_model"}  # what compares


def test_hardware_report_survives_broken_psutil(monkeypatch: pytest.MonkeyPatch) -> None:
    import psutil

    def broken(*a, **k):
        raise OSError("no /proc")

    monkeypatch.setattr(psutil, "virtual_memory", broken)
    rep = device.hardware_report("cpu")
    assert rep.ram_total_bytes is None and "psutil failed" in rep.missing["ram_total_bytes"]
    assert "not available (psutil failed" in rep.describe()


def test_environment_check_lines() -> None:
    lines = ch00.environment_check()
    names = [line.name for line in lines]
    assert {"python", "torch", "torchvision", "device", "/dev/shm"} <= set(names)
    assert all(line.ok for line in lines if line.name in ("torch", "torchvision", "matplotlib", "ipywidgets"))
    assert all(str(line).startswith(("[ok]", "[warning]")) for line in lines)


def test_environment_check_flags_small_shm() -> None:
    rep = device.hardware_report("cpu")
    rep.shm_free_bytes, rep.shm_total_bytes = 64 << 20, 64 << 20
    shm = [line for line in ch00.environment_check(rep) if line.name == "/dev/shm"][0]
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
    from helpers.core.device import has_cuda, resolve_device

    assert resolve_device("cpu").type == "cpu"
    assert resolve_device(None).type == ("cuda" if has_cuda() else "cpu")
    with pytest.raises(ValueError, match="device must be one of"):
        resolve_device("meta")
    if not has_cuda():
        with pytest.raises(ValueError, match="no CUDA device"):
            resolve_device("cuda")


def test_intraop_threads_sets_and_restores():
    import torch

    from helpers.core.rounds import intraop_threads

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


# --- devices that are not present (issue 15 item 7) ---------------------------------------------


@pytest.mark.parametrize("asked", ["cuda", "cuda:7", 3, "mps", "xpu"])
def test_pick_device_refuses_devices_not_present(monkeypatch: pytest.MonkeyPatch, asked) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(device, "_present_kinds", lambda: {"cpu": 1})
    with pytest.raises(ValueError, match="not available on this machine"):
        device.pick_device(asked)


@pytest.mark.parametrize("asked", ["banana", "cuda:x", True, 2.5])
def test_pick_device_refuses_what_is_not_a_device(asked) -> None:
    with pytest.raises(ValueError, match="must be a device such as"):
        device.pick_device(asked)


def test_device_index_checked_against_the_count(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(device, "_present_kinds", lambda: {"cpu": 1, "cuda": 2})
    monkeypatch.setattr(device, "has_cuda", lambda: True)
    assert device.pick_device("cuda:1") == torch.device("cuda:1")
    assert device.pick_device(0) == torch.device("cuda:0")  # a CUDA index
    with pytest.raises(ValueError, match="no cuda device with index 7.*this machine has 2"):
        device.pick_device("cuda:7")
    with pytest.raises(ValueError, match="prefer='mps' is not available"):
        device.pick_device("mps")
    assert device.pick_device("cpu").type == "cpu"


def test_resolve_device_validates_index_and_kind(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(device, "_present_kinds", lambda: {"cpu": 1, "cuda": 1})
    monkeypatch.setattr(device, "has_cuda", lambda: True)
    assert device.resolve_device("cuda:0") == torch.device("cuda:0")
    with pytest.raises(ValueError, match="index 3"):
        device.resolve_device("cuda:3")
    with pytest.raises(ValueError, match="device must be one of"):
        device.resolve_device("mps")


def test_has_cuda_propagates_under_require_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken() -> bool:
        raise RuntimeError("driver exploded")

    monkeypatch.setattr(torch.cuda, "is_available", broken)
    monkeypatch.setenv("WORKBOOK_REQUIRE_GPU", "1")
    with pytest.raises(RuntimeError, match="driver exploded"):
        device.has_cuda()


# --- a driver torch cannot use (issue 14 item 13) ----------------------------------------------


def _diagnose(monkeypatch: pytest.MonkeyPatch, torch_cuda, driver_cuda, nvidia_smi=False, **facts):
    """cuda_driver_problem on the facts given: torch's CUDA, NVML's driver (in a report), nvidia-smi on PATH."""
    monkeypatch.setattr(torch.version, "cuda", torch_cuda)
    monkeypatch.setattr(device.shutil, "which", lambda name: "/usr/bin/nvidia-smi" if nvidia_smi else None)
    return device.cuda_driver_problem(device.HardwareReport(driver_cuda_version=driver_cuda, **facts))


def test_diagnose_old_driver_for_the_cuda13_wheel(monkeypatch: pytest.MonkeyPatch) -> None:
    facts = dict(driver_version="570.86", torch_version="2.14.1+cu130")
    msg = _diagnose(monkeypatch, "13.0", "12.8", nvidia_smi=True, **facts)
    assert "supports CUDA up to 12.8" in msg and "built for CUDA 13.0" in msg
    assert "download.pytorch.org/whl/cu128" in msg and "torch==2.14.1" in msg and "580" in msg
    msg = _diagnose(monkeypatch, "13.0", "12.6", nvidia_smi=True)
    assert "whl/cu126" in msg
    msg = _diagnose(monkeypatch, "13.0", "12.2", nvidia_smi=True)
    assert "Update the NVIDIA driver" in msg and "index-url" not in msg


def test_diagnose_other_cases(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(device, "has_cuda", lambda: True)  # torch uses the GPU: no problem to report
    assert device.cuda_driver_problem() is None
    assert _diagnose(monkeypatch, "13.0", None, nvidia_smi=False) is None
    smi_only = _diagnose(monkeypatch, "13.0", None, nvidia_smi=True)
    assert "cannot use the GPU" in smi_only and "nvidia-smi" in smi_only
    cpu_build = _diagnose(monkeypatch, None, "12.8", nvidia_smi=True)
    assert "CPU-only build" in cpu_build and "index-url" in cpu_build
    same = _diagnose(monkeypatch, "13.0", "13.0", nvidia_smi=True)
    assert "CUDA up to 13.0" in same and "CUDA_VISIBLE_DEVICES" in same


class _FakeNVML:
    """Just enough of pynvml for the device module: an installed driver, a PCIe link."""

    def __init__(self, cuda: int = 12040, now: tuple[int, int] = (4, 16), top: tuple[int, int] = (4, 16)) -> None:
        self.cuda, self.now, self.top = cuda, now, top

    def nvmlInit(self) -> None: ...
    def nvmlShutdown(self) -> None: ...
    def nvmlSystemGetCudaDriverVersion(self) -> int:
        return self.cuda

    def nvmlSystemGetDriverVersion(self) -> bytes:
        return b"550.54.15"

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return i

    def nvmlDeviceGetCurrPcieLinkGeneration(self, h: int) -> int:
        return self.now[0]

    def nvmlDeviceGetCurrPcieLinkWidth(self, h: int) -> int:
        return self.now[1]

    def nvmlDeviceGetMaxPcieLinkGeneration(self, h: int) -> int:
        return self.top[0]

    def nvmlDeviceGetMaxPcieLinkWidth(self, h: int) -> int:
        return self.top[1]


def test_old_driver_is_reported_in_setup_and_env_check(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setitem(sys.modules, "pynvml", _FakeNVML(cuda=12040))
    monkeypatch.setattr(device.shutil, "which", lambda name: "/usr/bin/nvidia-smi" if name == "nvidia-smi" else None)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    problem = device.cuda_driver_problem()
    assert problem and "550.54.15" in problem and "CUDA up to 12.4" in problem
    msg = device.no_cuda_message("copies")
    assert msg.startswith("No CUDA device is usable") and "CUDA up to 12.4" in msg.replace("\n", " ")
    rep = device.hardware_report("cpu")
    assert rep.driver_cuda_version == "12.4" and rep.driver_version == "550.54.15"
    line = [c for c in ch00.environment_check() if c.name == "device"][0]
    assert not line.ok and "built for CUDA 13.0" in line.detail


def test_no_driver_means_no_problem(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    class NoDriver:
        def nvmlInit(self) -> None:
            raise RuntimeError("NVML Shared Library Not Found")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setitem(sys.modules, "pynvml", NoDriver())
    monkeypatch.setattr(device.shutil, "which", lambda name: None)
    assert device.cuda_driver_problem() is None
    assert device.no_cuda_message("x").startswith("No CUDA device is present")


# --- link ceiling (issue 14 item 7) -------------------------------------------------------------


def test_link_ceiling_prefers_max_but_not_a_virtual_port() -> None:
    gbps, text, basis = device.link_ceiling(1, 16, 4, 16)  # idle link trained down
    assert basis == "max" and gbps == pytest.approx(31.5, rel=0.01) and "Gen1 x16 now, idling" in text
    gbps, text, basis = device.link_ceiling(5, 16, 1, 1)  # max below current: a VM's virtual root port
    assert basis == "current" and gbps == pytest.approx(63.0, rel=0.01) and "virtual root port" in text
    assert device.link_ceiling(None, None, 4, 16)[2] == "max"
    assert device.link_ceiling(4, 16, None, None)[2] == "current"
    assert device.link_ceiling(None, None, 0, 99) == (None, None, None)
    assert "theoretical" in device.link_ceiling(4, 16, 4, 16)[1]


def test_ceiling_share_flags_impossible_measurements() -> None:
    assert model.ceiling_share(25.0, 31.5) == "79% of the theoretical ceiling"
    assert model.ceiling_share(32.0, 31.5).endswith("% of the theoretical ceiling")  # rounding tolerance
    above = model.ceiling_share(35.0, 31.5)
    assert above.startswith("ABOVE the theoretical ceiling") and "111%" not in above
    assert "no theoretical ceiling" in model.ceiling_share(10.0, None)


def test_nvml_fill_uses_current_link_when_max_is_impossible(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "pynvml", _FakeNVML(cuda=13000, now=(5, 16), top=(1, 1)))
    rep = device.HardwareReport()
    device._fill_nvml(rep, 0)
    assert rep.link_basis == "current" and rep.driver_cuda_version == "13.0"
    assert rep.link_bandwidth_gbps == pytest.approx(63.0, rel=0.01) and "virtual root port" in rep.link_description


def test_copy_engines_without_the_torch_property(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys
    import types

    assert device.copy_engine_count(0, types.SimpleNamespace(async_engine_count=2)) == (2, "torch device properties")

    class Err:
        cudaSuccess = 0

    runtime = types.SimpleNamespace(
        cudaError_t=Err,
        cudaDeviceAttr=types.SimpleNamespace(cudaDevAttrAsyncEngineCount=40),
        cudaDeviceGetAttribute=lambda attr, index: (0, 3) if attr == 40 else (1, None),
    )
    fake = types.ModuleType("cuda.bindings")
    fake.runtime = runtime  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "cuda.bindings", fake)
    count, how = device.copy_engine_count(0, types.SimpleNamespace())
    assert count == 3 and "cudaDeviceGetAttribute" in how
    runtime.cudaDeviceGetAttribute = lambda attr, index: (35, None)  # cudaErrorInsufficientDriver
    count, how = device.copy_engine_count(0, None)
    assert count is None and "answered 35" in how


def test_environment_check_reports_the_size_tier(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORKBOOK_QUICK", "1")
    line = [c for c in ch00.environment_check(device.hardware_report("cpu")) if c.name == "sizes"][0]
    assert line.ok and line.detail.startswith("quick tier") and "WORKBOOK_QUICK=1" in line.detail


def test_printed_lines_are_wrapped_at_words() -> None:
    rep = device.hardware_report("cpu")
    rep.missing["gpu_name"] = "a very long reason " * 12
    rep.gpu_name = None
    for text in [rep.describe()] + [str(c) for c in ch00.environment_check(rep)]:
        for line in text.splitlines():
            assert len(line) <= 110, line
    gpu_row = rep.describe().split("GPU memory")[0].split("\nGPU ")[1]
    assert set(gpu_row.replace("(", " ").replace(")", " ").split()) <= {
        "not",
        "available",
        "a",
        "very",
        "long",
        "reason",
    }


@pytest.mark.parametrize("name", ["cpu:1", "cpu:7"])
def test_an_indexed_cpu_is_refused_with_what_to_use(name: str) -> None:
    """Issue #25.7: ``cpu:N`` devices were accepted (torch parses them; there is one CPU device)."""
    with pytest.raises(ValueError, match=r"the CPU has no device \d+; use device='cpu'"):
        device.resolve_device(name)
    assert device.resolve_device("cpu:0") == torch.device("cpu:0")
