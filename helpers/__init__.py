"""Helpers for the GPU data-pipeline workbook, in four layers, one folder each: ``core`` (settings, checks, device
facts, timers, result files), ``ui`` (plots, panels, exercise checks), ``pipeline`` (what two or more chapters
use) and ``chapters`` (one folder per chapter). A layer imports only its own and lower ones, and importing a layer
loads no module (docs/CONTRIBUTING.md; tests/test_layers.py). The maintainer's tools live in the checkout's tools/.
"""

__version__ = "0.1.0"
