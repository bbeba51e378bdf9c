"""The rule of tools/cuda_coverage.py: which lines of a module run only with CUDA."""

from __future__ import annotations

import importlib.util
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("cuda_coverage", ROOT / "tools" / "cuda_coverage.py")
assert _spec is not None and _spec.loader is not None
cc = importlib.util.module_from_spec(_spec)
sys.modules["cuda_coverage"] = cc  # dataclasses look their module up
_spec.loader.exec_module(cc)

SAMPLE = textwrap.dedent(
    """
    import torch

    def copy(x, dev):
        if dev.type != "cuda":          # 5
            return x                    # 6
        s = torch.cuda.current_stream(dev)   # 7: after an early return on "no CUDA"
        return x.to(dev)                # 8

    def probe(dev):
        ok, why = cuda_status(dev)      # 11
        if not ok:
            return why                  # 13
        return 1                        # 14

    def timed():
        torch.cuda.synchronize()        # 17: the whole function needs a device
        return 2

    def either(x):
        if torch.cuda.is_available():
            y = 1                       # 22
        else:
            y = 2                       # 24
        on_gpu = x.device.type == "cuda"
        if on_gpu and y:
            y += 1                      # 27
        if x.device.type == "cpu":
            y -= 1                      # 29
        else:
            y -= 2                      # 31
        return y

    def marked():  # cuda-only
        return 3                        # 35

    def plain(dev):
        if torch.cuda.is_available() or dev:
            return 4                    # 39
        return torch.cuda.device_count()

    def maybe(on):
        s = torch.cuda.Stream() if on else None   # 43: a conditional expression is not unconditional
        f = lambda: torch.cuda.synchronize()      # 44: runs when called
        return s, f
    """
)


def test_the_three_rules_find_the_cuda_only_lines() -> None:
    lines = cc.cuda_only_lines(SAMPLE)
    assert {7, 8, 14, 16, 17, 18, 22, 27, 31, 34, 35} <= lines
    assert not {5, 6, 11, 13, 24, 29, 37, 38, 39, 40, 42, 43, 44, 45} & lines


def test_report_counts_cuda_only_lines_apart() -> None:
    figs = [cc.ModuleFigures("helpers/a.py", 10, 8, 4, 1), cc.ModuleFigures("helpers/b.py", 10, 10, 0, 0)]
    text = cc.report(figs, ["tests/test_a.py"])
    assert "helpers/ line coverage: 90.0% (18 of 20 statements)" in text
    assert "CUDA-only lines run: 25.0% (1 of 4;" in text
    assert "Not counted: notebook cells" in text
