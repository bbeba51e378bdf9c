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
import re
import shutil
import sys
import textwrap
from dataclasses import asdict, dataclass, field
from typing import Any, Iterator

import torch

from . import config
from .config import REQUIRE_GPU_ENV, require_gpu
from .validate import check_int, human_bytes

__all__ = [
    "pick_device",
    "resolve_device",
    "check_device_present",
    "cuda_driver_problem",
    "diagnose_no_cuda",
    "link_ceiling",
    "ceiling_share",
    "copy_engine_count",
    "wrap",
    "intraop_threads",
    "has_cuda",
    "torch_at_least",
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


def torch_at_least(major: int, minor: int) -> bool:
    """True when the installed torch is release ``major.minor`` or newer (``2.7.0+cu126`` counts as 2.7).

    The workbook supports torch 2.7 and newer (``pyproject.toml``; ``make test-floor`` runs every chapter on
    2.7.0). Code that needs a newer API asks here first and says plainly what the older release lacks.

    >>> torch_at_least(2, 7)
    True
    """
    parts = re.findall(r"\d+", str(torch.__version__).split("+")[0])[:2]
    return tuple(int(p) for p in parts) >= (major, minor)


def has_cuda() -> bool:
    """True when a CUDA device is usable (``torch.cuda.is_available()``).

    A broken driver answers False, except under ``WORKBOOK_REQUIRE_GPU=1``, where its error propagates.
    """
    try:
        return bool(torch.cuda.is_available())
    except Exception:  # a broken driver must not crash a notebook...
        if require_gpu():  # ...unless a strict GPU run asked to see every failure
            raise
        return False


def _present_kinds() -> dict[str, int]:
    """Device types usable here, with how many devices of each (the CPU counts as one)."""
    kinds = {"cpu": 1}
    if has_cuda():
        kinds["cuda"] = int(torch.cuda.device_count())
    acc = getattr(torch, "accelerator", None)
    try:
        # current_accelerator() answers 'cuda' even without a GPU: ask is_available() first.
        if acc is not None and acc.is_available():
            dev = acc.current_accelerator()
            if dev is not None and dev.type != "cuda":
                kinds[dev.type] = int(acc.device_count())
    except (RuntimeError, AttributeError):  # an accelerator backend that cannot answer is not present
        pass
    return kinds


def check_device_present(device: Any, name: str = "device", *, present: dict[str, int] | None = None) -> torch.device:
    """``device`` (a string, a ``torch.device`` or a CUDA index) as a ``torch.device`` that exists here.

    Args:
        device: what the caller asked for, e.g. ``"cuda"``, ``"cuda:1"``, ``0`` or ``"cpu"``.
        name: the parameter's name, for the message.
        present: ``{type: count}`` of usable devices (default: what torch reports on this machine).

    Raises:
        ValueError: an unknown device string, a device type not present on this machine (``"mps"``
            on Linux, ``"cuda"`` without a GPU), or an index beyond the devices present.
    """
    if isinstance(device, bool):
        raise ValueError(f"{name} must be a device such as 'cpu' or 'cuda', got {device!r}")
    try:
        dev = device if isinstance(device, torch.device) else torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise ValueError(f"{name} must be a device such as 'cpu', 'cuda' or 'cuda:0', got {device!r}") from None
    kinds = _present_kinds() if present is None else present
    here = ", ".join(
        f"{k!r}" + (f" ({n} device{'s' if n != 1 else ''})" if k != "cpu" else "") for k, n in kinds.items()
    )
    if dev.type not in kinds:
        extra = ""
        if dev.type == "cuda":
            problem = _short_problem()
            extra = " (no CUDA device is present" + (f"; {problem}" if problem else "") + ")"
        raise ValueError(
            f"{name}={str(dev)!r} is not available on this machine{extra}; devices here: {here}. "
            f"Use {name}='cpu', or None to choose automatically"
        )
    if dev.index is not None and dev.type != "cpu" and dev.index >= kinds[dev.type]:
        raise ValueError(
            f"{name}={str(dev)!r}: there is no {dev.type} device with index {dev.index}; "
            f"this machine has {kinds[dev.type]} (indices 0-{kinds[dev.type] - 1})"
        )
    return dev


def _short_problem() -> str:
    problem = cuda_driver_problem()
    return problem.split(". ")[0] if problem else ""


def pick_device(prefer: str | None = None) -> torch.device:
    """Choose the device a chapter runs on.

    Args:
        prefer: ``None`` (automatic), ``"cuda"``, ``"cuda:1"``, a CUDA index,
            ``"cpu"``, or another accelerator type present here. A device this
            machine does not have (``"cuda"`` without a GPU, ``"cuda:7"`` on a
            machine with one GPU, ``"mps"`` on Linux) raises a ValueError that
            says so, instead of failing later inside torch.

    With ``WORKBOOK_REQUIRE_GPU=1`` (set by the GPU check) a machine without
    CUDA raises RuntimeError, so a GPU check can never pass on CPU fallbacks.
    """
    if require_gpu() and not has_cuda():
        raise RuntimeError(
            f"{REQUIRE_GPU_ENV}=1 (a strict GPU run, as the GPU check sets) but no CUDA device is present; "
            f"unset {REQUIRE_GPU_ENV} to run on the CPU with reference results instead"
        )
    if prefer is not None:
        return check_device_present(prefer, "prefer")
    if has_cuda():
        return torch.device("cuda")
    for kind in _present_kinds():
        if kind not in ("cpu", "cuda"):
            return torch.device(kind)
    return torch.device("cpu")


def resolve_device(device: torch.device | str | None, kinds: tuple[str, ...] = ("cpu", "cuda")) -> torch.device:
    """A helper's ``device`` argument as a ``torch.device``: ``None`` = CUDA when present, else the CPU.

    Raises:
        ValueError: a device type outside ``kinds``, or one this machine does not have
            (``'cuda'`` without CUDA, ``'cuda:3'`` with one GPU): see :func:`check_device_present`;
            an indexed CPU other than ``'cpu:0'`` (``'cpu:1'``: there is one CPU device).
    """
    if device is None:
        return torch.device("cuda" if has_cuda() else "cpu")
    if isinstance(device, (str, torch.device)):
        try:
            kind = torch.device(device).type
        except (RuntimeError, TypeError, ValueError):
            kind = None
        if kind is not None and kind not in kinds:
            raise ValueError(f"device must be one of {list(kinds)}, got {str(device)!r}")
    dev = check_device_present(device, "device")
    if dev.type not in kinds:
        raise ValueError(f"device must be one of {list(kinds)}, got {dev.type!r}")
    if dev.type == "cpu" and dev.index not in (None, 0):  # torch accepts 'cpu:7'; there is one CPU device
        raise ValueError(f"device={str(device)!r}: the CPU has no device {dev.index}; use device='cpu'")
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
    """The one plain sentence every GPU-only cell prints without CUDA.

    When an NVIDIA driver is installed but torch cannot use it (see :func:`cuda_driver_problem`),
    the message says so and how to fix it, instead of letting the CPU fallback run silently.
    """
    problem = cuda_driver_problem()
    text = (
        f"No CUDA device is {'usable' if problem else 'present'} on this machine, so {what} cannot be measured "
        "here. Reference results recorded on a real GPU are shown instead, when available."
    )
    if problem:
        text += " " + problem
    return wrap(text)


def wrap(text: str, width: int = 100, indent: str = "") -> str:
    """Wrap printed text at word boundaries (never inside a word, never inside a `command`)."""
    return "\n".join(
        textwrap.fill(para, width=width, subsequent_indent=indent, break_long_words=False, break_on_hyphens=False)
        for para in text.split("\n")
    )


#: The PyTorch wheel index that holds builds for each CUDA 12.x level (see https://pytorch.org/get-started/locally/).
_CUDA12_INDEXES = ((12, 8, "cu128"), (12, 6, "cu126"))


def _version_tuple(text: str | None) -> tuple[int, int] | None:
    try:
        parts = str(text).split(".")
        return int(parts[0]), int(parts[1]) if len(parts) > 1 else 0
    except (ValueError, IndexError):
        return None


def diagnose_no_cuda(
    *,
    cuda_available: bool,
    torch_cuda: str | None,
    driver_cuda: str | None,
    driver_version: str | None = None,
    nvidia_smi: bool = False,
    torch_version: str = torch.__version__,
) -> str | None:
    """Why torch cannot use an NVIDIA GPU that seems to be installed, and how to fix it; ``None`` if no such case.

    Pure logic (every input passed in), so it is tested on any machine; :func:`cuda_driver_problem`
    feeds it this machine's facts.

    Args:
        cuda_available: ``torch.cuda.is_available()``.
        torch_cuda: ``torch.version.cuda`` (``None`` for a CPU-only torch build).
        driver_cuda: the newest CUDA version the installed driver supports, e.g. ``"12.4"``
            (NVML's ``nvmlSystemGetCudaDriverVersion``), ``None`` if no driver answered.
        driver_version: the driver's own version, e.g. ``"550.54.15"``, for the message.
        nvidia_smi: whether ``nvidia-smi`` is on the PATH (a sign an NVIDIA driver is installed).
    """
    if cuda_available or (driver_cuda is None and not nvidia_smi):
        return None
    base = torch_version.split("+")[0]
    pins = f"torch=={base} " + (f"torchvision=={_torchvision_base()}" if _torchvision_base() else "torchvision")
    drv = f"driver {driver_version}" if driver_version else "an NVIDIA driver"
    if not torch_cuda:
        return (
            f"An NVIDIA GPU driver is installed, but this torch ({torch_version}) is a CPU-only build, "
            "so every chapter runs on the CPU. Install a CUDA build, e.g. "
            f"`.venv/bin/python -m pip install --force-reinstall {pins} --index-url "
            "https://download.pytorch.org/whl/cu128`."
        )
    need, have = _version_tuple(torch_cuda), _version_tuple(driver_cuda)
    if need is not None and have is not None and have < (need[0], 0):
        index = next((tag for major, minor, tag in _CUDA12_INDEXES if have >= (major, minor)), None)
        if have[0] == 12 and index:
            fix = (
                f"Either update the NVIDIA driver (CUDA {need[0]} needs driver 580 or newer), or install "
                f"the torch build for CUDA {have[0]}.x: `.venv/bin/python -m pip install --force-reinstall "
                f"{pins} --index-url https://download.pytorch.org/whl/{index}` "
                "(https://pytorch.org/get-started/locally/ lists the builds each torch version has)."
            )
        else:
            fix = (
                f"Update the NVIDIA driver (CUDA {need[0]} needs driver 580 or newer); builds of this torch for "
                f"CUDA {driver_cuda} may not exist (see https://pytorch.org/get-started/locally/)."
            )
        return (
            f"The GPU cannot be used: {drv} supports CUDA up to {driver_cuda}, but this torch "
            f"({torch_version}) is built for CUDA {torch_cuda}, so torch.cuda.is_available() is False and "
            f"the workbook falls back to the CPU. {fix}"
        )
    subject = f"NVIDIA driver {driver_version}" if driver_version else "An NVIDIA driver"
    return (
        f"{subject} is installed"
        + (f" (CUDA up to {driver_cuda})" if driver_cuda else "")
        + f", but torch ({torch_version}, CUDA {torch_cuda}) cannot use the GPU, so the workbook falls back "
        "to the CPU. Run `nvidia-smi` to see whether the GPU is visible (in a container: start it with "
        "--gpus all), and check CUDA_VISIBLE_DEVICES."
    )


def _torchvision_base() -> str | None:
    try:
        from importlib.metadata import version

        return version("torchvision").split("+")[0]
    except Exception:  # torchvision not installed: the command names it without a version
        return None


def _driver_facts() -> tuple[str | None, str | None]:
    """``(driver_cuda, driver_version)`` from NVML, ``(None, None)`` when no driver answers."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # no NVML library, or no driver: nothing to report
        return None, None
    try:
        raw = int(pynvml.nvmlSystemGetCudaDriverVersion())  # e.g. 12040 for CUDA 12.4
        cuda = f"{raw // 1000}.{(raw % 1000) // 10}"
        try:
            version = pynvml.nvmlSystemGetDriverVersion()
            version = version.decode() if isinstance(version, bytes) else str(version)
        except Exception:  # the version string is only for the message
            version = None
        return cuda, version
    except Exception:  # an NVML that cannot answer is no evidence of a driver
        return None, None
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:  # shutting NVML down cannot fail in a way that matters here
            pass


def cuda_driver_problem() -> str | None:
    """A plain explanation when an NVIDIA driver is installed but torch cannot use the GPU, else ``None``.

    Typical case: the pinned torch wheel is a CUDA 13 build and the driver supports only
    CUDA 12.x; torch then reports no GPU and every chapter would silently run its CPU fallback.
    """
    if has_cuda():
        return None
    driver_cuda, driver_version = _driver_facts()
    return diagnose_no_cuda(
        cuda_available=False,
        torch_cuda=torch.version.cuda,
        driver_cuda=driver_cuda,
        driver_version=driver_version,
        nvidia_smi=shutil.which("nvidia-smi") is not None,
    )


def pcie_bandwidth_gbps(generation: int, width: int) -> float:
    """Theoretical per-direction payload bandwidth of a PCIe link, in GB/s (10**9 B/s).

    >>> round(pcie_bandwidth_gbps(4, 16), 1)
    31.5
    """
    check_int("generation", generation, 1, 6)
    check_int("width", width, 1, 32)
    return _PCIE_GBPS_PER_LANE[generation] * width


def _link_ok(gen: Any, width: Any) -> bool:
    try:
        return 1 <= int(gen) <= 6 and 1 <= int(width) <= 32
    except (TypeError, ValueError):
        return False


def link_ceiling(
    gen_now: int | None, width_now: int | None, gen_max: int | None, width_max: int | None
) -> tuple[float | None, str | None, str | None]:
    """The theoretical per-direction ceiling of a PCIe link: ``(GB/s, description, basis)``.

    ``basis`` says which of NVML's readings was used: ``"max"`` (the link's maximum; a link
    trained lower *now* is usually idling to save power and trains up under load) or ``"current"``
    (used when the reported maximum is *below* the current link, which real hardware cannot do:
    in a VM the maximum may describe a virtual root port). ``(None, None, None)`` when neither
    reading is a valid PCIe link.

    >>> link_ceiling(4, 16, 4, 16)[2]
    'max'
    >>> link_ceiling(4, 16, 1, 1)[2]
    'current'
    """
    now = pcie_bandwidth_gbps(int(gen_now), int(width_now)) if _link_ok(gen_now, width_now) else None  # type: ignore[arg-type]
    top = pcie_bandwidth_gbps(int(gen_max), int(width_max)) if _link_ok(gen_max, width_max) else None  # type: ignore[arg-type]
    tail = "(theoretical, per direction)"
    if top is not None and (now is None or now <= top):
        if now is not None and now < top:
            note = f", its maximum; Gen{gen_now} x{width_now} now, idling"
        else:
            note = "" if now is not None else ", its maximum"
        return top, f"PCIe Gen{gen_max} x{width_max}{note} {tail}", "max"
    if now is not None:
        if top is not None:
            note = (
                f" as trained now; NVML's maximum, Gen{gen_max} x{width_max}, is below that, which real "
                "hardware cannot do (a VM's virtual root port?)"
            )
        else:
            note = " as trained now"
        return now, f"PCIe Gen{gen_now} x{width_now}{note} {tail}", "current"
    return None, None, None


def ceiling_share(measured_gbps: float, ceiling_gbps: float | None, *, tolerance: float = 0.03) -> str:
    """Words for a measured bandwidth against a theoretical ceiling: ``"62% of the theoretical ceiling"``.

    A measurement above the ceiling (by more than ``tolerance``, for rounding) is impossible on
    that link, so it is flagged as such instead of being printed as ``110%``: the ceiling is then
    wrong for this machine (NVML may describe a virtual root port in a VM, or the copy does not
    cross PCIe at all, e.g. NVLink-C2C or memory shared with the CPU).
    """
    measured_gbps = float(measured_gbps)
    if not ceiling_gbps or ceiling_gbps <= 0 or measured_gbps != measured_gbps:
        return "no theoretical ceiling is known for this link"
    share = measured_gbps / float(ceiling_gbps)
    if share > 1.0 + tolerance:
        return (
            f"ABOVE the theoretical ceiling ({measured_gbps:.1f} > {float(ceiling_gbps):.1f} GB/s), which that "
            "link cannot carry: the ceiling is wrong for this machine (NVML may describe a virtual root port "
            "in a VM, or the copy does not cross PCIe)"
        )
    return f"{share:.0%} of the theoretical ceiling"


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
    link_basis: str | None = None
    driver_cuda_version: str | None = None
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
            (
                "Python / torch / torchvision",
                f"{self.python_version} / {self.torch_version} / {self.torchvision_version or '?'}",
            ),
            ("Device chosen", self.device),
            ("CPU", show("cpu_model", self.cpu_model)),
            (
                "CPU cores (logical / physical / usable)",
                f"{show('cpu_cores_logical', self.cpu_cores_logical)} / "
                f"{show('cpu_cores_physical', self.cpu_cores_physical)} / {show('cpu_affinity', self.cpu_affinity)}",
            ),
            (
                "RAM total / available",
                f"{show('ram_total_bytes', self.ram_total_bytes, human_bytes)} / "
                f"{show('ram_available_bytes', self.ram_available_bytes, human_bytes)}",
            ),
            (
                "/dev/shm total / free",
                f"{show('shm_total_bytes', self.shm_total_bytes, human_bytes)} / "
                f"{show('shm_free_bytes', self.shm_free_bytes, human_bytes)}",
            ),
            ("GPU", show("gpu_name", self.gpu_name)),
            ("GPU memory", show("gpu_memory_bytes", self.gpu_memory_bytes, human_bytes)),
            ("Compute capability", show("gpu_compute_capability", self.gpu_compute_capability)),
            (
                "Driver (newest CUDA it supports)",
                f"{show('driver_version', self.driver_version)}"
                + (f" (CUDA {self.driver_cuda_version})" if self.driver_cuda_version else ""),
            ),
            ("CUDA runtime (torch build)", show("cuda_runtime_version", self.cuda_runtime_version)),
            ("Copy engines", show("copy_engines", self.copy_engines)),
            ("PCIe link now", link(self.pcie_generation, self.pcie_width, "pcie_generation", "pcie_width")),
            (
                "PCIe link max",
                link(self.pcie_generation_max, self.pcie_width_max, "pcie_generation_max", "pcie_width_max"),
            ),
            (
                "Link ceiling per direction (theoretical)",
                show(
                    "link_bandwidth_gbps",
                    self.link_bandwidth_gbps,
                    lambda v: f"{v:.1f} GB/s, from {self.link_description}",
                ),
            ),
        ]
        return rows

    def describe(self) -> str:
        """A plain-text table of :meth:`lines`."""
        rows = self.lines()
        width = max(len(k) for k, _ in rows)
        return "\n".join(wrap(f"{k:<{width}}  {v}", width=110, indent=" " * (width + 2)) for k, v in rows)

    def _repr_html_(self) -> str:
        body = "".join(
            f"<tr><td style='text-align:left'>{k}</td><td style='text-align:left'>{v}</td></tr>"
            for k, v in self.lines()
        )
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
    "link_basis",
    "driver_cuda_version",
)


def _fill_gpu(rep: HardwareReport, index: int) -> None:
    if torch.version.cuda:
        rep.cuda_runtime_version = str(torch.version.cuda)
    else:
        rep.missing["cuda_runtime_version"] = "this torch build has no CUDA support"
    rep.cuda_available = has_cuda()
    if not rep.cuda_available:
        for name in _NO_GPU_FIELDS:
            rep.missing[name] = "no CUDA device is usable"
        driver_cuda, driver_version = _driver_facts()  # a driver torch cannot use still says which CUDA it supports
        if driver_cuda is not None:
            rep.driver_cuda_version, rep.driver_version = driver_cuda, driver_version
            rep.missing.pop("driver_cuda_version", None)
            if driver_version is not None:
                rep.missing.pop("driver_version", None)
        return
    try:
        rep.gpu_count = torch.cuda.device_count()
        props = torch.cuda.get_device_properties(index)
        rep.gpu_name = props.name
        rep.gpu_memory_bytes = int(props.total_memory)
        rep.gpu_compute_capability = f"{props.major}.{props.minor}"
    except Exception as exc:
        if require_gpu():
            raise
        rep.missing["gpu_name"] = f"torch.cuda.get_device_properties failed: {exc}"
        props = None
    rep.copy_engines, why = copy_engine_count(index, props)
    if rep.copy_engines is None:
        rep.missing["copy_engines"] = why
    _fill_nvml(rep, index)


def copy_engine_count(index: int, props: Any = None) -> tuple[int | None, str]:
    """``(count, how it was read)`` of the GPU's copy engines (``cudaDevAttrAsyncEngineCount``).

    torch's device properties have no ``async_engine_count`` (not in torch 2.14), so this
    asks the CUDA runtime through ``cuda.bindings`` (installed with torch's Linux wheels),
    and returns ``(None, reason)`` when neither can say.
    """
    engines = getattr(props, "async_engine_count", None) if props is not None else None
    if engines is not None:
        return int(engines), "torch device properties"
    try:
        from cuda.bindings import runtime as cudart
    except Exception as exc:  # an optional package: unknown, with the reason
        return None, f"torch does not expose asyncEngineCount and cuda.bindings is not importable ({exc})"
    try:
        err, value = cudart.cudaDeviceGetAttribute(cudart.cudaDeviceAttr.cudaDevAttrAsyncEngineCount, int(index))
    except Exception as exc:
        if require_gpu():  # the CUDA runtime failing on a GPU path must be seen in a strict run
            raise
        return None, f"cudaDeviceGetAttribute(cudaDevAttrAsyncEngineCount) failed: {exc}"
    if err != cudart.cudaError_t.cudaSuccess or value is None:
        return None, f"cudaDeviceGetAttribute(cudaDevAttrAsyncEngineCount) answered {err}"
    return int(value), "cudaDeviceGetAttribute (cuda.bindings)"


_NVML_FIELDS = (
    "driver_version",
    "driver_cuda_version",
    "pcie_generation",
    "pcie_width",
    "pcie_generation_max",
    "pcie_width_max",
    "link_bandwidth_gbps",
)


def _fill_nvml(rep: HardwareReport, index: int) -> None:
    try:
        import pynvml
    except Exception as exc:
        for name in _NVML_FIELDS:
            rep.missing.setdefault(name, f"nvidia-ml-py is not importable: {exc}")
        return
    try:
        pynvml.nvmlInit()
    except Exception as exc:
        for name in _NVML_FIELDS:
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
        cuda_raw = read("driver_cuda_version", pynvml.nvmlSystemGetCudaDriverVersion)
        if cuda_raw is not None:
            rep.driver_cuda_version = f"{int(cuda_raw) // 1000}.{(int(cuda_raw) % 1000) // 10}"
        gbps, description, basis = link_ceiling(
            rep.pcie_generation, rep.pcie_width, rep.pcie_generation_max, rep.pcie_width_max
        )
        if gbps is not None:
            rep.link_bandwidth_gbps, rep.link_description, rep.link_basis = gbps, description, basis
        else:
            rep.missing["link_bandwidth_gbps"] = (
                "PCIe generation/width unknown (NVML could not read them; NVLink-C2C systems report none)"
            )
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
        return wrap(f"[{'ok' if self.ok else 'warning'}] {self.name}: {self.detail}", indent="    ")


_PACKAGES = ("torch", "torchvision", "numpy", "matplotlib", "ipywidgets", "psutil", "pynvml", "tqdm", "PIL")


def environment_check(report: HardwareReport | None = None, shm_min_bytes: int = 1 << 30) -> list[CheckLine]:
    """An ok/warning line per package, the device (and why a GPU that is installed cannot be used),
    the size tier in force, and /dev/shm. Never raises."""
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
        problem = (
            cuda_driver_problem()
            if report is None
            else diagnose_no_cuda(
                cuda_available=False,
                torch_cuda=torch.version.cuda,
                driver_cuda=rep.driver_cuda_version,
                driver_version=rep.driver_version,
                nvidia_smi=shutil.which("nvidia-smi") is not None,
            )
        )
        if problem:
            lines.append(CheckLine("device", False, f"running on {rep.device}, not on the GPU. {problem}"))
        else:
            lines.append(
                CheckLine(
                    "device",
                    False,
                    f"no CUDA device; running on {rep.device}. Every chapter still runs: CPU parts are measured live, "
                    "GPU parts show reference results recorded on a real GPU",
                )
            )

    try:
        tier = config.size_tier()
        lines.append(CheckLine("sizes", True, f"{tier} tier: {config.tier_reason(tier)}"))
    except ValueError as exc:  # a WORKBOOK_* variable with an unknown value
        lines.append(CheckLine("sizes", False, str(exc)))
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
