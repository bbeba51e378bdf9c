"""pyproject.toml is the one source of dependencies; environment.yml must not drift from it."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.version import Version

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parent.parent
# conda-forge names that differ from the PyPI names
CONDA_TO_PYPI = {"pytorch": "torch"}


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _pypi_requirements() -> dict[str, str]:
    meta = _pyproject()["project"]
    reqs = list(meta["dependencies"]) + list(meta["optional-dependencies"]["test"])
    out = {}
    for line in reqs:
        r = Requirement(line)
        out[r.name.lower()] = str(r.specifier)
    return out


def _conda_requirements() -> dict[str, str]:
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    out = {}
    for dep in env["dependencies"]:
        if not isinstance(dep, str):
            continue
        m = re.match(r"^([A-Za-z0-9_.\-]+)\s*(.*)$", dep.strip())
        assert m, f"cannot parse environment.yml entry {dep!r}"
        name, spec = m.group(1).lower(), m.group(2).replace(" ", "")
        if name in ("python", "pip"):
            continue
        out[CONDA_TO_PYPI.get(name, name)] = str(Requirement(f"x{spec}").specifier)
    return out


def test_same_packages_and_ranges() -> None:
    pypi, conda = _pypi_requirements(), _conda_requirements()
    assert set(pypi) == set(conda), (
        f"only in pyproject: {sorted(set(pypi) - set(conda))}; "
        f"only in environment.yml: {sorted(set(conda) - set(pypi))}"
    )
    for name in pypi:
        assert pypi[name] == conda[name], f"{name}: pyproject says {pypi[name]!r}, environment.yml says {conda[name]!r}"


def test_python_floor_agrees() -> None:
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    py = [d for d in env["dependencies"] if isinstance(d, str) and d.startswith("python")]
    assert py == [f"python{_pyproject()['project']['requires-python']}"]


def test_constraints_pin_within_ranges() -> None:
    """The tested pins (constraints.txt) must satisfy the metadata's ranges."""
    pypi = _pypi_requirements()
    for extra in _pyproject()["project"]["optional-dependencies"].values():
        for line in extra:
            r = Requirement(line)
            pypi.setdefault(r.name.lower(), str(r.specifier))
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            r = Requirement(line)
            pins[r.name.lower()] = next(iter(r.specifier)).version
    assert pins.get("torch") == "2.14.1" and pins.get("torchvision") == "0.29.1"
    for name, version in pins.items():
        if name not in pypi:  # a pinned dependency of a dependency (e.g. greenlet for playwright)
            continue
        assert Version(version) in Requirement(f"x{pypi[name]}").specifier, (
            f"pin {name}=={version} outside {pypi[name]}"
        )
