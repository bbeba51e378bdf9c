"""Helpers for the GPU data-pipeline workbook.

One module per job; chapters import what they need, e.g.
``from helpers import device, timing``. Importing this package is cheap: it
does not import torch until a submodule that needs it is imported.

Modules:
    config      quick mode (``WORKBOOK_QUICK``) and folders
    validate    argument checks with clear messages
    device      device choice and hardware facts (CPU, RAM, /dev/shm, GPU, link)
    timing      benchmark timer, CUDA events, span recorder for step phases
    results     JSON result files with provenance; comparisons as ratios
    reference   reference results recorded on real GPUs, and honest fallbacks
    widgets     the live-panel toolkit
    plots       shared plots (timelines, stacked phases, sweeps, run history)
    exercises   automatic checks for the exercises
"""

__version__ = "0.1.0"
