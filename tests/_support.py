"""What several test modules share: the checkout, whether CUDA is here, and the environment a subprocess needs.

Imported as ``_support`` (pytest puts ``tests/`` on ``sys.path`` for its test modules).
"""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

HAS_CUDA = False
try:
    import torch

    HAS_CUDA = torch.cuda.is_available()
except Exception:  # pragma: no cover
    pass


def workbook_env(tmp: Path) -> dict[str, str]:
    """The environment for ``python -m helpers...`` in a subprocess: this checkout first on PYTHONPATH, and
    artifacts and reference files under ``tmp`` (never the real ones); no strict-GPU flag inherited."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env["WORKBOOK_ARTIFACTS"] = str(tmp / "artifacts")
    env["WORKBOOK_REFERENCE_DIR"] = str(tmp / "reference")
    env["MPLBACKEND"] = "Agg"
    env.pop("WORKBOOK_REQUIRE_GPU", None)
    return env
