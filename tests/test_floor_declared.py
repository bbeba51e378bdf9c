"""The oldest supported torch is declared once and tested as declared (issue #24.4).

pyproject.toml's lower bounds, environment.yml's, the Makefile's ``make test-floor`` pair and the README
must name the same floor; ``tools/check_floor.py`` (run by ``make test-floor``) must notice when pip has
replaced the floor torch, and when a torch lacks what the chapters use.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch
import torchvision
from packaging.requirements import Requirement
from packaging.version import Version

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parent.parent


def _makefile_var(name: str) -> str:
    m = re.search(rf"^{name}\s*\??=\s*(\S+)\s*$", (ROOT / "Makefile").read_text(), re.M)
    assert m, f"the Makefile sets no {name}"
    return m.group(1)


def _lower_bound(name: str) -> Version:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (req,) = [Requirement(d) for d in deps if Requirement(d).name == name]
    (spec,) = list(req.specifier)
    assert spec.operator == ">=", f"{name}: the floor is a lower bound, got {spec}"
    return Version(spec.version)


def _check_floor() -> ModuleType:
    spec = importlib.util.spec_from_file_location("check_floor", ROOT / "tools" / "check_floor.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("dist,var", [("torch", "FLOOR_TORCH"), ("torchvision", "FLOOR_TORCHVISION")])
def test_makefile_floor_is_the_declared_floor(dist: str, var: str) -> None:
    floor, bound = Version(_makefile_var(var)), _lower_bound(dist)
    assert floor.release[:2] == bound.release[:2], f"make test-floor tests {dist} {floor}, pyproject says >={bound}"


def test_floor_is_torch_2_6_with_its_torchvision() -> None:
    """2.6 brought torch.accelerator and DataLoader(in_order=); 2.7 the DataLoader's no-accelerator pin warning
    (chapter 03 shows it). torch 2.7.0 came out in April 2025: more than 18 months before 2026-11."""
    assert _lower_bound("torch") == Version("2.7") and _lower_bound("torchvision") == Version("0.22")
    readme = (ROOT / "README.md").read_text()
    assert "torch 2.7.0 + torchvision 0.22.0" in readme and "make test-floor" in readme
    assert ".venv-floor/" in (ROOT / ".gitignore").read_text().split()


def test_floor_run_installs_the_workbook_without_constraints() -> None:
    make = (ROOT / "Makefile").read_text()
    recipe = make[make.index("$(FLOOR_STAMP):") : make.index("test-floor: $(FLOOR_STAMP)")]
    lines = [ln.strip() for ln in recipe.splitlines()]
    torch_at = next(i for i, ln in enumerate(lines) if "torch==$(FLOOR_TORCH)" in ln)
    workbook_at = next(i for i, ln in enumerate(lines) if "-e '.[test]'" in ln)
    check_at = next(i for i, ln in enumerate(lines) if "tools/check_floor.py" in ln)
    assert torch_at < workbook_at < check_at
    assert "constraints" not in recipe


def test_check_floor_accepts_this_torch_and_refuses_another() -> None:
    mod = _check_floor()
    here_torch, here_tv = torch.__version__.split("+")[0], torchvision.__version__.split("+")[0]
    assert mod.problems(here_torch, here_tv) == []
    found = mod.problems("2.7.0", "0.22.0") if here_torch != "2.7.0" else mod.problems("9.9.9", "9.9.9")
    assert len(found) == 2 and all("pip replaced it" in line for line in found)


def test_check_floor_names_the_missing_api(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch 2.4/2.5: no torch.accelerator, no DataLoader(in_order=); 2.6: no pin warning without an accelerator."""
    import torch.utils.data as tud

    mod = _check_floor()
    monkeypatch.delattr(torch, "accelerator")

    class OldLoader:
        def __init__(self, dataset: object, batch_size: int = 1) -> None: ...

    class OldIter:
        def __init__(self, loader: object) -> None:
            self._pin_memory = False  # torch 2.6: loader.pin_memory and torch.cuda.is_available(), no warning

    monkeypatch.setattr(tud, "DataLoader", OldLoader)
    monkeypatch.setattr(tud.dataloader, "_BaseDataLoaderIter", OldIter)
    found = mod.problems(torch.__version__.split("+")[0], torchvision.__version__.split("+")[0])
    assert len(found) == 3, found
    assert "torch.accelerator" in found[0] and "in_order" in found[1] and "pin_memory=True" in found[2]
