"""Which device to use, and the hardware facts that bound a data pipeline.

``pick_device()`` chooses CUDA when present, else another accelerator torch
reports (MPS, XPU, ...), else the CPU. ``hardware_report()`` gathers what
limits a pipeline: CPU cores, RAM, ``/dev/shm`` (DataLoader workers pass
batches through it), the GPU, its driver, copy engines, and the PCIe link.

No field ever raises: a value that cannot be read is ``None`` and
``report.missing[field]`` says why.

Link bandwidth figures here are **theoretical** (from the PCIe generation and
width), never measurements; chapter 02 measures the real thing.
"""

from __future__ import annotations

import contextlib
import os
import platform
import shutil
import sys
import textwrap
from dataclasses import asdict, dataclass, field
from typing import Any, Iterator

import torch

from .validate import check_int, human_bytes

__all__ = [
    "pick_device",
    "resolve_device",
    "intraop_threads",
    "has_cuda",
    "no_cuda_message",
    "pcie_bandwidth_gbps",
    "HardwareReport",
    "hardware_report",
    "environment_check",
    "CheckLine",
]

# Per-lane, per-direction payload rate in GB/s after line encoding
# (Gen1/2: 8b/10b; Gen3-5: 128b/130b; Gen6: PAM4 + FLIT, approx.).
_PCIE_GBPS_PER_LANE: dict[int, float] = {
    1: 0.25,
    2: 0.5,
    3: 8.0 * 128 / 130 / 8,
    4: 16.0 * 128 / 130 / 8,
    5: 32.0 * 128 / 130 / 8,
    6: 64.0 * 242 / 256 / 8,
}


def has_cuda() -> bool:
    """True when a CUDA device is usable (``torch.cuda.is_available()``)."""
    try:
        return bool(torch.cuda.is_available())
    except Exception:  # a broken driver must not crash a notebook
        return False


def pick_device(prefer: str | None = None) -> torch.device:
    """Choose the device a chapter runs on.

    Args:
        prefer: ``None`` (automatic), ``"cuda"``, ``"cpu"``, or another
            accelerator type torch knows. Asking for ``"cuda"`` on a machine
            without one raises a ValueError that says so, instead of failing
            later inside torch.

    With ``WORKBOOK_REQUIRE_GPU=1`` (set by the GPU check) a machine without
    CUDA raises RuntimeError, so a GPU check can never pass on CPU fallbacks.
    """
    from .config import REQUIRE_GPU_ENV, require_gpu

    if require_gpu() and not has_cuda():
        raise RuntimeError(
            f"{REQUIRE_GPU_ENV}=1 (a strict GPU run, as the GPU check sets) but no CUDA device is present; "
            f"unset {REQUIRE_GPU_ENV} to run on the CPU with reference results instead"
        )
    if prefer is not None:
        if prefer == "cpu":
            return torch.device("cpu")
        if prefer == "cuda" and not has_cuda():
            raise ValueError(
                "prefer='cuda' but no CUDA device is present on this machine; "
                "use prefer=None to fall back to the CPU"
            )
        return torch.device(prefer)
    if has_cuda():
        return torch.device("cuda")
    acc = getattr(torch, "accelerator", None)
    try:
        # current_accelerator() answers 'cuda' even without a GPU: ask is_available() first.
        if acc is not None and acc.is_available():
            dev = acc.current_accelerator()
            if dev is not None and dev.type != "cuda":
                return torch.device(dev.type)
    except Exception:
        pass
    return torch.device("cpu")


def resolve_device(device: torch.device | str | None, kinds: tuple[str, ...] = ("cpu", "cuda")) -> torch.device:
    """A helper's ``device`` argument as a ``torch.device``: ``None`` = CUDA when present, else the CPU.

    Raises:
        ValueError: ``'cuda'`` asked for on a machine without CUDA, or a device type outside ``kinds``.
    """
    if device is None:
        return torch.device("cuda" if has_cuda() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not has_cuda():
        raise ValueError("device is 'cuda' but no CUDA device is present; use device='cpu' or None")
    if dev.type not in kinds:
        raise ValueError(f"device must be one of {list(kinds)}, got {dev.type!r}")
    return dev


@contextlib.contextmanager
def intraop_threads(n: int) -> Iterator[int]:
    """``with intraop_threads(n):`` - torch uses ``n`` intra-op threads in this process; the count is restored after.

    Every DataLoader worker (and the loader's pin thread) runs with one thread; the
    chapters give the main process a deliberate count too, so that comparisons are fair.
    """
    check_int("threads", n, 1, 1024)
    prev = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield n
    finally:
        torch.set_num_threads(prev)


def no_cuda_message(what: str) -> str:
    """The one plain sentence every GPU-only cell prints without CUDA."""
    return textwrap.fill(
        f"No CUDA device is present on this machine, so {what} cannot be measured here. "
        "Reference results recorded on a real GPU are shown instead, when available.",
        width=100,
    )


def pcie_bandwidth_gbps(generation: int, width: int) -> float:
    """Theoretical per-direction payload bandwidth of a PCIe link, in GB/s (10**9 B/s).

    >>> round(pcie_bandwidth_gbps(4, 16), 1)
    31.5
    """
    check_int("generation", generation, 1, 6)
    check_int("width", width, 1, 32)
    return _PCIE_GBPS_PER_LANE[generation] * width


@dataclass
class HardwareReport:
    """Hardware and software facts. ``None`` means unknown; ``missing`` says why."""

    python_version: str = platform.python_version()
    platform: str = platform.platform()
    torch_version: str = torch.__version__
    torchvision_version: str | None = None
    device: str = "cpu"
    cpu_model: str | None = None
    cpu_cores_logical: int | None = None
    cpu_cores_physical: int | None = None
    cpu_affinity: int | None = None
    ram_total_bytes: int | None = None
    ram_available_bytes: int | None = None
    shm_total_bytes: int | None = None
    shm_free_bytes: int | None = None
    cuda_available: bool = False
    gpu_count: int = 0
    gpu_name: str | None = None
    gpu_memory_bytes: int | None = None
    gpu_compute_capability: str | None = None
    driver_version: str | None = None
    cuda_runtime_version: str | None = None
    copy_engines: int | None = None
    pcie_generation: int | None = None
    pcie_width: int | None = None
    pcie_generation_max: int | None = None
    pcie_width_max: int | None = None
    link_bandwidth_gbps: float | None = None
    link_description: str | None = None
    missing: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def fingerprint(self) -> dict[str, Any]:
        """The fields that decide whether two measurements are comparable."""
        return {
            "gpu_name": self.gpu_name,
            "gpu_count": self.gpu_count,
            "cpu_model": self.cpu_model,
            "cpu_cores_logical": self.cpu_cores_logical,
            "pcie_generation_max": self.pcie_generation_max,
            "pcie_width_max": self.pcie_width_max,
        }

    def lines(self) -> list[tuple[str, str]]:
        """(label, value) rows for display; unknown values say why."""

        def show(name: str, value: Any, fmt: Any = str) -> str:
            if value is None:
                return f"not available ({self.missing.get(name, 'unknown')})"
            return fmt(value)

        def link(gen: Any, width: Any, gname: str, wname: str) -> str:
            if gen is None or width is None:
                return f"not available ({self.missing.get(gname) or self.missing.get(wname, 'unknown')})"
            return f"Gen{gen} x{width}"

        rows = [
            ("Python / torch / torchvision", f"{self.python_version} / {self.torch_version} / {self.torchvision_version or '?'}"),
            ("Device chosen", self.device),
            ("CPU", show("cpu_model", self.cpu_model)),
            ("CPU cores (logical / physical / usable)", f"{show('cpu_cores_logical', self.cpu_cores_logical)} / "
             f"{show('cpu_cores_physical', self.cpu_cores_physical)} / {show('cpu_affinity', self.cpu_affinity)}"),
            ("RAM total / available", f"{show('ram_total_bytes', self.ram_total_bytes, human_bytes)} / "
             f"{show('ram_available_bytes', self.ram_available_bytes, human_bytes)}"),
            ("/dev/shm total / free", f"{show('shm_total_bytes', self.shm_total_bytes, human_bytes)} / "
             f"{show('shm_free_bytes', self.shm_free_bytes, human_bytes)}"),
            ("GPU", show("gpu_name", self.gpu_name)),
            ("GPU memory", show("gpu_memory_bytes", self.gpu_memory_bytes, human_bytes)),
            ("Compute capability", show("gpu_compute_capability", self.gpu_compute_capability)),
            ("Driver", show("driver_version", self.driver_version)),
            ("CUDA runtime (torch build)", show("cuda_runtime_version", self.cuda_runtime_version)),
            ("Copy engines", show("copy_engines", self.copy_engines)),
            ("PCIe link now", link(self.pcie_generation, self.pcie_width, "pcie_generation", "pcie_width")),
            ("PCIe link max", link(self.pcie_generation_max, self.pcie_width_max, "pcie_generation_max", "pcie_width_max")),
            ("Link ceiling per direction (theoretical)", show("link_bandwidth_gbps", self.link_bandwidth_gbps, lambda v: f"{v:.1f} GB/s")),
        ]
        return rows

    def describe(self) -> str:
        """A plain-text table of :meth:`lines`."""
        rows = self.lines()
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)

    def _repr_html_(self) -> str:
        body = "".join(f"<tr><td style='text-align:left'>{k}</td><td style='text-align:left'>{v}</td></tr>" for k, v in self.lines())
        return f"<table>{body}</table>"


def _cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    name = platform.processor()
    return name or None


def _fill_host(rep: HardwareReport) -> None:
    rep.cpu_model = _cpu_model()
    if rep.cpu_model is None:
        rep.missing["cpu_model"] = "neither /proc/cpuinfo nor platform.processor() named it"
    rep.cpu_cores_logical = os.cpu_count()
    try:
        rep.cpu_affinity = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        rep.missing["cpu_affinity"] = "os.sched_getaffinity is not available on this OS"
    try:
        import psutil

        rep.cpu_cores_physical = psutil.cpu_count(logical=False)
        if rep.cpu_cores_physical is None:
            rep.missing["cpu_cores_physical"] = "psutil could not count physical cores"
        vm = psutil.virtual_memory()
        rep.ram_total_bytes = int(vm.total)
        rep.ram_available_bytes = int(vm.available)
    except Exception as exc:  # psutil missing or broken
        for name in ("cpu_cores_physical", "ram_total_bytes", "ram_available_bytes"):
            rep.missing[name] = f"psutil failed: {exc}"
    try:
        usage = shutil.disk_usage("/dev/shm")
        rep.shm_total_bytes, rep.shm_free_bytes = int(usage.total), int(usage.free)
    except OSError:
        rep.missing["shm_total_bytes"] = rep.missing["shm_free_bytes"] = "/dev/shm does not exist on this OS"
    try:
        import torchvision

        rep.torchvision_version = torchvision.__version__
    except Exception as exc:
        rep.missing["torchvision_version"] = f"import failed: {exc}"


_NO_GPU_FIELDS = (
    "gpu_name",
    "gpu_memory_bytes",
    "gpu_compute_capability",
    "driver_version",
    "copy_engines",
    "pcie_generation",
    "pcie_width",
    "pcie_generation_max",
    "pcie_width_max",
    "link_bandwidth_gbps",
)


def _fill_gpu(rep: HardwareReport, index: int) -> None:
    if torch.version.cuda:
        rep.cuda_runtime_version = str(torch.version.cuda)
    else:
        rep.missing["cuda_runtime_version"] = "this torch build has no CUDA support"
    rep.cuda_available = has_cuda()
    if not rep.cuda_available:
        for name in _NO_GPU_FIELDS:
            rep.missing[name] = "no CUDA device is present"
        return
    try:
        rep.gpu_count = torch.cuda.device_count()
        props = torch.cuda.get_device_properties(index)
        rep.gpu_name = props.name
        rep.gpu_memory_bytes = int(props.total_memory)
        rep.gpu_compute_capability = f"{props.major}.{props.minor}"
        engines = getattr(props, "async_engine_count", None)
        if engines is None:
            rep.missing["copy_engines"] = "this torch version does not expose asyncEngineCount"
        else:
            rep.copy_engines = int(engines)
    except Exception as exc:
        rep.missing["gpu_name"] = f"torch.cuda.get_device_properties failed: {exc}"
    _fill_nvml(rep, index)


def _fill_nvml(rep: HardwareReport, index: int) -> None:
    try:
        import pynvml
    except Exception as exc:
        for name in ("driver_version", "pcie_generation", "pcie_width", "pcie_generation_max", "pcie_width_max", "link_bandwidth_gbps"):
            rep.missing.setdefault(name, f"nvidia-ml-py is not importable: {exc}")
        return
    try:
        pynvml.nvmlInit()
    except Exception as exc:
        for name in ("driver_version", "pcie_generation", "pcie_width", "pcie_generation_max", "pcie_width_max", "link_bandwidth_gbps"):
            rep.missing.setdefault(name, f"NVML could not start: {exc}")
        return
    try:
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)

        def read(name: str, fn: Any, *args: Any) -> Any:
            try:
                value = fn(*args)
                return value.decode() if isinstance(value, bytes) else value
            except Exception as exc:
                rep.missing[name] = f"NVML: {exc}"
                return None

        rep.driver_version = read("driver_version", pynvml.nvmlSystemGetDriverVersion)
        rep.pcie_generation = read("pcie_generation", pynvml.nvmlDeviceGetCurrPcieLinkGeneration, handle)
        rep.pcie_width = read("pcie_width", pynvml.nvmlDeviceGetCurrPcieLinkWidth, handle)
        rep.pcie_generation_max = read("pcie_generation_max", pynvml.nvmlDeviceGetMaxPcieLinkGeneration, handle)
        rep.pcie_width_max = read("pcie_width_max", pynvml.nvmlDeviceGetMaxPcieLinkWidth, handle)
        gen, width = rep.pcie_generation_max, rep.pcie_width_max
        if gen and width and 1 <= int(gen) <= 6 and 1 <= int(width) <= 32:
            rep.link_bandwidth_gbps = pcie_bandwidth_gbps(int(gen), int(width))
            rep.link_description = f"PCIe Gen{gen} x{width} (theoretical, per direction; the link may train lower at idle)"
        else:
            rep.missing["link_bandwidth_gbps"] = "PCIe generation/width unknown (NVML could not read them; NVLink-C2C systems report none)"
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass


def hardware_report(device: torch.device | str | None = None) -> HardwareReport:
    """Collect the hardware facts. Never raises for an unreadable field."""
    dev = torch.device(device) if device is not None else pick_device()
    rep = HardwareReport(device=str(dev))
    _fill_host(rep)
    index = dev.index if (dev.type == "cuda" and dev.index is not None) else 0
    _fill_gpu(rep, index)
    if rep.link_description is None:
        rep.missing.setdefault("link_description", rep.missing.get("link_bandwidth_gbps", "link not identified"))
    for name, value in rep.to_dict().items():  # every unknown field must say why
        if value is None:
            rep.missing.setdefault(name, "could not be read on this machine")
    return rep


@dataclass
class CheckLine:
    """One line of the environment check."""

    name: str
    ok: bool
    detail: str

    def __str__(self) -> str:
        return f"[{'ok' if self.ok else 'warning'}] {self.name}: {self.detail}"


_PACKAGES = ("torch", "torchvision", "numpy", "matplotlib", "ipywidgets", "psutil", "pynvml", "tqdm", "PIL")


def environment_check(report: HardwareReport | None = None, shm_min_bytes: int = 1 << 30) -> list[CheckLine]:
    """An ok/warning line per package, the device, and /dev/shm. Never raises."""
    import importlib

    lines: list[CheckLine] = []
    ok_v = sys.version_info >= (3, 10)
    lines.append(CheckLine("python", ok_v, platform.python_version() + ("" if ok_v else " (3.10 or newer is needed)")))
    for mod in _PACKAGES:
        try:
            m = importlib.import_module(mod)
            version = getattr(m, "__version__", "installed")
            lines.append(CheckLine(mod, True, str(version)))
        except Exception as exc:
            lines.append(CheckLine(mod, False, f"cannot import ({exc}); run `make setup` from the workbook folder"))
    rep = report or hardware_report()
    if rep.cuda_available:
        lines.append(CheckLine("device", True, f"CUDA: {rep.gpu_name}, driver {rep.driver_version or 'unknown'}"))
    else:
        lines.append(
            CheckLine(
                "device",
                False,
                f"no CUDA device; running on {rep.device}. Every chapter still runs: CPU parts are measured live, "
                "GPU parts show reference results recorded on a real GPU",
            )
        )
    if rep.shm_free_bytes is None:
        lines.append(CheckLine("/dev/shm", False, rep.missing.get("shm_free_bytes", "unknown")))
    else:
        ok = rep.shm_free_bytes >= shm_min_bytes
        detail = f"{human_bytes(rep.shm_free_bytes)} free of {human_bytes(rep.shm_total_bytes or 0)}"
        if not ok:
            detail += (
                f" — below {human_bytes(shm_min_bytes)}: DataLoader workers may die with a bus error. "
                "In Docker, start the container with --shm-size=2g (or --ipc=host)"
            )
        lines.append(CheckLine("/dev/shm", ok, detail))
    return lines
