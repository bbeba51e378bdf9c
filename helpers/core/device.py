"""Which device to use, and the hardware facts that bound a data pipeline (notebook 00's report and checks).
An unreadable :class:`HardwareReport` field is ``None`` and ``report.missing[field]`` says why. Link figures here
are **theoretical** (PCIe generation and width), never measurements.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import os
import platform
import re
import shutil
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from .config import REQUIRE_GPU_ENV, require_gpu
from .validate import check_int, human_bytes, wrap

# Per-lane, per-direction payload GB/s after line encoding (Gen1/2: 8b/10b; Gen3-5: 128b/130b; Gen6: PAM4 + FLIT).
_PCIE_GBPS_PER_LANE = {1: 0.25, 2: 0.5, 3: 8 * 128 / 130 / 8, 4: 16 * 128 / 130 / 8, 5: 32 * 128 / 130 / 8}
_PCIE_GBPS_PER_LANE[6] = 64 * 242 / 256 / 8


def torch_at_least(major: int, minor: int) -> bool:
    """True when the installed torch is ``major.minor`` or newer (``2.7.0+cu126`` is 2.7)."""
    parts = re.findall(r"\d+", str(torch.__version__).split("+")[0])[:2]
    return tuple(int(p) for p in parts) >= (major, minor)


def has_cuda() -> bool:
    """``torch.cuda.is_available()``; a broken driver is False, except under ``WORKBOOK_REQUIRE_GPU=1``."""
    try:
        return bool(torch.cuda.is_available())
    except Exception:  # a broken driver must not crash a notebook...
        if require_gpu():  # ...unless a strict GPU run asked to see every failure
            raise
        return False


def _present_kinds() -> dict[str, int]:
    """Device types usable here, with how many devices of each (one CPU)."""
    kinds = {"cpu": 1}
    if has_cuda():
        kinds["cuda"] = int(torch.cuda.device_count())
    try:  # current_accelerator() answers 'cuda' even without a GPU: ask is_available() first
        dev = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
        if dev is not None and dev.type != "cuda":
            kinds[dev.type] = int(torch.accelerator.device_count())
    except RuntimeError:  # an accelerator backend that cannot answer is not present
        pass
    return kinds


def resolve_device(device: Any, kinds: tuple[str, ...] = ("cpu", "cuda"), *, name: str = "device") -> torch.device:
    """``device`` (a string, a ``torch.device`` or a CUDA index) as a ``torch.device`` of a type in ``kinds``
    (empty: any) that exists here, else a ValueError naming ``name``; None: CUDA if present, else CPU."""
    if device is None:
        return torch.device("cuda" if has_cuda() else "cpu")
    try:
        if isinstance(device, bool):
            raise TypeError
        dev = device if isinstance(device, torch.device) else torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise ValueError(f"{name} must be a device such as 'cpu', 'cuda' or 'cuda:0', got {device!r}") from None
    if kinds and dev.type not in kinds:
        raise ValueError(f"{name} must be one of {list(kinds)}, got {str(device)!r}")
    present = _present_kinds()
    here = ", ".join(
        f"{k!r}" + (f" ({n} device{'s' if n != 1 else ''})" if k != "cpu" else "") for k, n in present.items()
    )
    if dev.type not in present:
        problem = (cuda_driver_problem() or "").split(". ")[0] if dev.type == "cuda" else ""
        extra = " (no CUDA device is present" + (f"; {problem}" if problem else "") + ")" if dev.type == "cuda" else ""
        raise ValueError(
            f"{name}={str(dev)!r} is not available on this machine{extra}; devices here: {here}. "
            f"Use {name}='cpu', or None to choose automatically"
        )
    if dev.type == "cpu" and dev.index not in (None, 0):  # torch accepts 'cpu:7'; there is one CPU device
        raise ValueError(f"{name}={str(device)!r}: the CPU has no device {dev.index}; use {name}='cpu'")
    if dev.index is not None and dev.index >= present[dev.type]:
        raise ValueError(
            f"{name}={str(dev)!r}: there is no {dev.type} device with index {dev.index}; "
            f"this machine has {present[dev.type]} (indices 0-{present[dev.type] - 1})"
        )
    return dev


def pick_device(prefer: str | None = None) -> torch.device:
    """The device a chapter runs on: ``prefer`` (``"cuda:1"``, a CUDA index, ``"cpu"``) or automatic. Under
    ``WORKBOOK_REQUIRE_GPU=1`` no CUDA is a RuntimeError, so a GPU check never passes on CPU fallbacks."""
    if require_gpu() and not has_cuda():
        raise RuntimeError(
            f"{REQUIRE_GPU_ENV}=1 (a strict GPU run, as the GPU check sets) but no CUDA device is present; "
            f"unset {REQUIRE_GPU_ENV} to run on the CPU with reference results instead"
        )
    if prefer is not None:
        return resolve_device(prefer, (), name="prefer")
    if has_cuda():
        return torch.device("cuda")
    for kind in _present_kinds():
        if kind not in ("cpu", "cuda"):
            return torch.device(kind)
    return torch.device("cpu")


def no_cuda_message(what: str) -> str:
    """The one plain sentence every GPU-only cell prints without CUDA (with the fix, when a driver is unusable)."""
    problem = cuda_driver_problem()
    text = (
        f"No CUDA device is {'usable' if problem else 'present'} on this machine, so {what} cannot be measured "
        "here. Reference results recorded on a real GPU are shown instead, when available."
    )
    if problem:
        text += " " + problem
    return wrap(text)


def cuda_driver_problem(rep: HardwareReport | None = None) -> str | None:
    """Why torch, without CUDA, cannot use an NVIDIA GPU that seems installed (NVML's driver facts from ``rep``, read
    now if None), and the fix; ``None`` if no such case. The usual case: a CUDA 13 wheel and a driver for 12.x,
    where every chapter would silently run on the CPU."""
    if rep is None:
        if has_cuda():
            return None
        rep = HardwareReport()
        _fill_nvml(rep, None)
    torch_cuda, torch_version = torch.version.cuda, rep.torch_version
    driver_cuda, driver = rep.driver_cuda_version, rep.driver_version
    if driver_cuda is None and shutil.which("nvidia-smi") is None:
        return None
    try:
        tv: str | None = importlib.metadata.version("torchvision").split("+")[0]
    except Exception:  # torchvision not installed: the command names it without a version
        tv = None
    pins = f"torch=={torch_version.split('+')[0]} " + (f"torchvision=={tv}" if tv else "torchvision")
    if not torch_cuda:
        return (
            f"An NVIDIA GPU driver is installed, but this torch ({torch_version}) is a CPU-only build, "
            "so every chapter runs on the CPU. Install a CUDA build, e.g. "
            f"`.venv/bin/python -m pip install --force-reinstall {pins} --index-url "
            "https://download.pytorch.org/whl/cu128`."
        )
    need = int(torch_cuda.split(".")[0])
    have = tuple(int(x) for x in driver_cuda.split(".")[:2]) if driver_cuda else None  # NVML's, formatted "12.4"
    if have is not None and have[0] < need:
        index = next((tag for major, minor, tag in _CUDA12_INDEXES if have >= (major, minor)), None)
        update = f"the NVIDIA driver (CUDA {need} needs driver 580 or newer)"
        fix = (
            f"Either update {update}, or install the torch build for CUDA {have[0]}.x: `.venv/bin/python -m pip "
            f"install --force-reinstall {pins} --index-url https://download.pytorch.org/whl/{index}` "
            "(https://pytorch.org/get-started/locally/ lists the builds each torch version has)."
            if have[0] == 12 and index
            else f"Update {update}; builds of this torch for CUDA {driver_cuda} may not exist "
            "(see https://pytorch.org/get-started/locally/)."
        )
        return (
            f"The GPU cannot be used: {f'driver {driver}' if driver else 'an NVIDIA driver'} supports CUDA up to "
            f"{driver_cuda}, but this torch ({torch_version}) is built for CUDA {torch_cuda}, so "
            f"torch.cuda.is_available() is False and the workbook falls back to the CPU. {fix}"
        )
    return (
        f"{f'NVIDIA driver {driver}' if driver else 'An NVIDIA driver'} is installed"
        + (f" (CUDA up to {driver_cuda})" if driver_cuda else "")
        + f", but torch ({torch_version}, CUDA {torch_cuda}) cannot use the GPU, so the workbook falls back "
        "to the CPU. Run `nvidia-smi` to see whether the GPU is visible (in a container: start it with "
        "--gpus all), and check CUDA_VISIBLE_DEVICES."
    )


#: The PyTorch wheel index that holds builds for each CUDA 12.x level (see https://pytorch.org/get-started/locally/).
_CUDA12_INDEXES = ((12, 8, "cu128"), (12, 6, "cu126"))


def pcie_bandwidth_gbps(generation: int, width: int) -> float:
    """Theoretical per-direction payload bandwidth of a PCIe link, in GB/s (10**9 B/s): Gen4 x16 is 31.5."""
    check_int("generation", generation, 1, 6)
    check_int("width", width, 1, 32)
    return _PCIE_GBPS_PER_LANE[generation] * width


def link_ceiling(
    gen_now: int | None, width_now: int | None, gen_max: int | None, width_max: int | None
) -> tuple[float | None, str | None, str | None]:
    """``(GB/s, description, basis)`` of a PCIe link's theoretical ceiling, or three Nones. ``basis``: ``"max"``
    (a link trained lower *now* is idling) or ``"current"`` (a maximum below it: a VM's virtual root port)."""

    def gbps(gen: Any, width: Any) -> float | None:
        try:
            return pcie_bandwidth_gbps(int(gen), int(width))
        except (TypeError, ValueError):  # unknown (None) or out of range: no figure
            return None

    now, top = gbps(gen_now, width_now), gbps(gen_max, width_max)
    tail = "(theoretical, per direction)"
    if top is not None and (now is None or now <= top):
        note = ", its maximum" if now is None else ""
        if now is not None and now < top:
            note = f", its maximum; Gen{gen_now} x{width_now} now, idling"
        return top, f"PCIe Gen{gen_max} x{width_max}{note} {tail}", "max"
    if now is not None:
        note = " as trained now"
        if top is not None:
            note += f"; NVML's maximum, Gen{gen_max} x{width_max}, is below that, which real hardware cannot do"
            note += " (a VM's virtual root port?)"
        return now, f"PCIe Gen{gen_now} x{width_now}{note} {tail}", "current"
    return None, None, None


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

    def describe(self) -> str:
        """A plain-text table of the facts; unknown values say why."""

        def show(name: str, fmt: Any = str) -> str:
            value = getattr(self, name)
            return f"not available ({self.missing.get(name, 'unknown')})" if value is None else fmt(value)

        def link(gname: str, wname: str) -> str:
            gen, width = getattr(self, gname), getattr(self, wname)
            if gen is None or width is None:
                return f"not available ({self.missing.get(gname) or self.missing.get(wname, 'unknown')})"
            return f"Gen{gen} x{width}"

        def pair(a: str, b: str) -> str:
            return f"{show(a, human_bytes)} / {show(b, human_bytes)}"

        versions = f"{self.python_version} / {self.torch_version} / {self.torchvision_version or '?'}"
        cores = " / ".join(show(n) for n in ("cpu_cores_logical", "cpu_cores_physical", "cpu_affinity"))
        drv_cuda = f" (CUDA {self.driver_cuda_version})" if self.driver_cuda_version else ""
        rows = [
            ("Python / torch / torchvision", versions),
            ("Device chosen", self.device),
            ("CPU", show("cpu_model")),
            ("CPU cores (logical / physical / usable)", cores),
            ("RAM total / available", pair("ram_total_bytes", "ram_available_bytes")),
            ("/dev/shm total / free", pair("shm_total_bytes", "shm_free_bytes")),
            ("GPU", show("gpu_name")),
            ("GPU memory", show("gpu_memory_bytes", human_bytes)),
            ("Compute capability", show("gpu_compute_capability")),
            ("Driver (newest CUDA it supports)", show("driver_version") + drv_cuda),
            ("CUDA runtime (torch build)", show("cuda_runtime_version")),
            ("Copy engines", show("copy_engines")),
            ("PCIe link now", link("pcie_generation", "pcie_width")),
            ("PCIe link max", link("pcie_generation_max", "pcie_width_max")),
            ("Link ceiling per direction (theoretical)",
             show("link_bandwidth_gbps", lambda v: f"{v:.1f} GB/s, from {self.link_description}")),
        ]  # fmt: skip
        width = max(len(k) for k, _ in rows)
        return "\n".join(wrap(f"{k:<{width}}  {v}", width=110, indent=" " * (width + 2)) for k, v in rows)


def _read(rep: HardwareReport, names: str, fn: Any, why: str) -> None:
    """Fields ``names`` from ``fn()`` (a tuple for several); if it raises, each says ``why`` (``{exc}``: the error)."""
    keys = names.split()
    try:
        got = fn()
    except Exception as exc:
        rep.missing.update(dict.fromkeys(keys, why.format(exc=exc)))
        return
    for key, value in zip(keys, got if len(keys) > 1 else (got,)):
        setattr(rep, key, value.decode() if isinstance(value, bytes) else value)
        rep.missing.pop(key, None)


def _psutil_facts() -> tuple[int | None, int, int]:
    import psutil

    vm = psutil.virtual_memory()
    return psutil.cpu_count(logical=False), int(vm.total), int(vm.available)


def _fill_host(rep: HardwareReport) -> None:
    with contextlib.suppress(OSError), open("/proc/cpuinfo", encoding="utf-8") as fh:
        rep.cpu_model = next((ln.split(":", 1)[1].strip() for ln in fh if ln.lower().startswith("model name")), None)
    rep.cpu_model = rep.cpu_model or platform.processor() or None
    if rep.cpu_model is None:
        rep.missing["cpu_model"] = "neither /proc/cpuinfo nor platform.processor() named it"
    rep.cpu_cores_logical = os.cpu_count()
    _read(rep, "cpu_affinity", lambda: len(os.sched_getaffinity(0)), "os.sched_getaffinity is not available on this OS")
    _read(rep, "cpu_cores_physical ram_total_bytes ram_available_bytes", _psutil_facts, "psutil failed: {exc}")
    if rep.cpu_cores_physical is None:
        rep.missing.setdefault("cpu_cores_physical", "psutil could not count physical cores")
    shm = "/dev/shm does not exist on this OS"
    _read(rep, "shm_total_bytes shm_free_bytes", lambda: shutil.disk_usage("/dev/shm")[::2], shm)  # total, free
    tv = "torchvision_version"
    _read(rep, tv, lambda: importlib.import_module("torchvision").__version__, "import failed: {exc}")


_NO_GPU_FIELDS = (
    "gpu_name gpu_memory_bytes gpu_compute_capability driver_version copy_engines pcie_generation pcie_width "
    "pcie_generation_max pcie_width_max link_bandwidth_gbps link_basis driver_cuda_version"
).split()


def _fill_gpu(rep: HardwareReport, index: int) -> None:
    if torch.version.cuda:
        rep.cuda_runtime_version = str(torch.version.cuda)
    else:
        rep.missing["cuda_runtime_version"] = "this torch build has no CUDA support"
    rep.cuda_available = has_cuda()
    if not rep.cuda_available:
        for name in _NO_GPU_FIELDS:
            rep.missing[name] = "no CUDA device is usable"
        _fill_nvml(rep, None)  # a driver torch cannot use still says which CUDA it supports
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
    """``(count, how it was read)`` of the GPU's copy engines, else ``(None, reason)``. torch 2.14's properties
    lack ``async_engine_count``: then the CUDA runtime is asked through ``cuda.bindings`` (torch's Linux wheels)."""
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
    "driver_version driver_cuda_version pcie_generation pcie_width pcie_generation_max pcie_width_max "
    "link_bandwidth_gbps"
).split()


def _fill_nvml(rep: HardwareReport, index: int | None) -> None:
    """The driver's facts from NVML, and the PCIe link of GPU ``index`` (None: the driver's facts only)."""
    step = "nvidia-ml-py is not importable"
    try:
        import pynvml

        step = "NVML could not start"
        pynvml.nvmlInit()
    except Exception as exc:
        for name in _NVML_FIELDS:
            rep.missing.setdefault(name, f"{step}: {exc}")
        return
    try:
        why, cuda = "NVML: {exc}", pynvml.nvmlSystemGetCudaDriverVersion  # e.g. 12040 for CUDA 12.4
        _read(rep, "driver_version", pynvml.nvmlSystemGetDriverVersion, why)
        _read(rep, "driver_cuda_version", lambda: "{}.{}".format(*divmod(int(cuda()) // 10, 100)), why)
        if index is None:
            return
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        _read(rep, "pcie_generation", lambda: pynvml.nvmlDeviceGetCurrPcieLinkGeneration(handle), why)
        _read(rep, "pcie_width", lambda: pynvml.nvmlDeviceGetCurrPcieLinkWidth(handle), why)
        _read(rep, "pcie_generation_max", lambda: pynvml.nvmlDeviceGetMaxPcieLinkGeneration(handle), why)
        _read(rep, "pcie_width_max", lambda: pynvml.nvmlDeviceGetMaxPcieLinkWidth(handle), why)
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
        with contextlib.suppress(Exception):
            pynvml.nvmlShutdown()


def hardware_report(device: torch.device | str | None = None) -> HardwareReport:
    """Collect the hardware facts; never raises for an unreadable field."""
    dev = torch.device(device) if device is not None else pick_device()
    rep = HardwareReport(device=str(dev))
    _fill_host(rep)
    index = dev.index if (dev.type == "cuda" and dev.index is not None) else 0
    _fill_gpu(rep, index)
    if rep.link_description is None:
        rep.missing.setdefault("link_description", rep.missing.get("link_bandwidth_gbps", "link not identified"))
    for name, value in asdict(rep).items():  # every unknown field must say why
        if value is None:
            rep.missing.setdefault(name, "could not be read on this machine")
    return rep
