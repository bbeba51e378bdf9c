"""Check the floor venv (``make test-floor``): pip kept the requested torch pair, and it has what the workbook uses.

Usage: ``python tools/check_floor.py --torch 2.7.0 --torchvision 0.22.0`` (run by the venv's own python).

The workbook is installed there *after* torch, without ``constraints.txt``, as a reader who already has torch
installs it; if pip had replaced the reader's torch with a newer one, the floor run would test the wrong release.
Exits 1 with one line per problem.
"""

from __future__ import annotations

import argparse
import inspect
import sys


def _release(version: str) -> str:
    return version.split("+")[0]


def problems(torch_wanted: str, torchvision_wanted: str) -> list[str]:
    """What is wrong with this interpreter's torch for the floor run (empty when all is well)."""
    import torch
    import torchvision
    from torch.utils.data import DataLoader

    out = []
    for name, have, want in (
        ("torch", torch.__version__, torch_wanted),
        ("torchvision", torchvision.__version__, torchvision_wanted),
    ):
        if _release(have) != want:
            out.append(
                f"{name} {have} is installed, not the floor {want}: pip replaced it (was -c constraints.txt used?)"
            )
    if not hasattr(torch, "accelerator"):
        out.append(f"torch {torch.__version__} has no torch.accelerator (the workbook needs torch >= 2.7)")
    if "in_order" not in inspect.signature(DataLoader.__init__).parameters:
        out.append(f"torch {torch.__version__}'s DataLoader has no in_order (chapter 04 needs torch >= 2.7)")
    from torch.utils.data import dataloader

    if "no accelerator is found" not in inspect.getsource(dataloader._BaseDataLoaderIter.__init__):
        out.append(
            f"torch {torch.__version__}'s DataLoader does not warn about pin_memory=True without an accelerator "
            "(chapter 03 shows that warning; torch >= 2.7)"
        )
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--torch", required=True, help="the floor torch release, e.g. 2.7.0")
    ap.add_argument("--torchvision", required=True, help="its torchvision release, e.g. 0.22.0")
    args = ap.parse_args(argv)
    found = problems(args.torch, args.torchvision)
    for line in found:
        print(f"check_floor: {line}", file=sys.stderr)
    if not found:
        import torch

        print(f"check_floor: torch {torch.__version__} kept after installing the workbook; ok")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
