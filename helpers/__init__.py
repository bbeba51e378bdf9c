"""Helpers for the GPU data-pipeline workbook.

One module per job; chapters import what they need, e.g.
``from helpers import device, timing``. Importing this package is cheap: it
does not import torch until a submodule that needs it is imported.
The modules stand in layers, each importing only its own and lower ones, with no
import cycle: core, ui, pipeline, chapters, tools (the table in docs/CONTRIBUTING.md,
checked by tests/test_layers.py).

Modules:
    config      quick mode (``WORKBOOK_QUICK``) and folders
    validate    argument checks with clear messages
    device      device choice and hardware facts (CPU, RAM, /dev/shm, GPU, link)
    timing      benchmark timer, CUDA events, span recorder for step phases, GPU work of known length
    results     JSON result files with provenance; comparisons as ratios
    reference   reference results recorded on real GPUs, and honest fallbacks
    widgets     the live-panel toolkit
    plots       shared plots (timelines, stacked phases, sweeps, run history)
    exercises   automatic checks for the exercises
    hygiene     chapter 00: warm-up, synchronisation and clock experiments
    data        chapter 01: the generated JPEG data set and its Dataset class
    models      chapter 01: the small CNN whose compute per batch scales
    train       chapter 01: the instrumented training loop and step anatomy
    transfer    chapter 02: pageable vs pinned copies, pinning cost, allocator
    loaders     chapters 03-04: DataLoader knobs, workers, pitfalls, throughput
    prefetch    chapter 05: the side-stream prefetcher
    overlap     chapter 05: the 2x2 overlap experiment and the async hazards
    progress    the one progress convention: progress(fraction, text), tqdm bars for cells
    published   host<->GPU copy figures published elsewhere (cited), beside ours and the theory
    gpudecode   chapter 05 (optional): JPEG bytes to decoded batches, on the CPU or the GPU (nvJPEG)
    capstone    chapter 06: every step stacked on one job, in two regimes
    doctor      chapter 06: diagnose any pipeline (data-, transfer- or compute-bound)
    distributed chapter 07: DistributedSampler demos and the torchrun launcher
    ddp_train   chapter 07: the per-rank training script torchrun runs
    bench       ``python -m helpers.bench``: every chapter's measurements, headless
    gpucheck    ``python -m helpers.gpucheck``: the GPU check that records reference results
"""

__version__ = "0.1.0"
