"""Layer 3, pipeline: the data pipeline the chapters build and measure. Imports core and ui.

What two or more chapters use lives here, and what must live in a module (worker processes import data
sets, collate and worker-init functions by name), with the measuring plumbing each step needs:

    data        the generated JPEG data set, its Dataset classes, seed_worker
    models      the small CNN whose compute per batch scales
    train       step anatomy: timing the reader's loader, copy and step phase by phase
    transfer    pageable vs pinned copies, pinning cost, the caching host allocator
    loaders     DataLoader knobs, workers, pitfalls, throughput, leak-proof start and stop
    prefetch    the reference side-stream prefetcher and the checks for the reader's
"""
