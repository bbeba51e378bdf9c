"""Layer 1, core: settings, argument checks, hardware facts, timers and result files.

No plots, no chapters, nothing above: every other layer may import these.

    config      quick/laptop/full sizes (``WORKBOOK_QUICK``), folders, expected run times
    validate    argument checks with clear messages
    progress    the one progress convention: progress(fraction, text), tqdm bars for cells
    device      device choice and hardware facts (CPU, RAM, /dev/shm, GPU, link)
    nocuda      why torch cannot use an installed NVIDIA driver, and the fix
    timing      benchmark timer, CUDA events, span recorder for step phases, GPU work of known length
    rounds      the one alternating-rounds runner (alternate) and the one table renderer (table)
    results     JSON result files with provenance; comparisons as ratios
    reference   reference results recorded on real GPUs, and the honest fallback
    failures    DataLoader worker failures in plain words (LoaderFailure): the loaders raise them, panels show them
"""
