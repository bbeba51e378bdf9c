"""Layer 3, pipeline: the data pipeline the chapters build and measure. Imports core and ui.

What two or more chapters use lives here, and what must live in a module (worker processes import data
sets, collate and worker-init functions by name), with the measuring plumbing each step needs:

    shapes      the JPEG data set drawn, written, cached and verified
    data        the Dataset that reads it, the normaliser, TimedCollate, seed_worker
    models      the small CNN whose compute per batch scales
    train       the timeline's phases and lanes, make_optimizer, the bottleneck model
    transfer    copy facts: whether CUDA copies can be measured here, host-RAM guards, the pinned
                allocator's counters, the pinning arithmetic
    workers     worker processes: leak-proof start and stop, failures in plain words, /dev/shm
    demo        the demo data sets, the pinnable batch and the collate functions workers import
    loaders     building and measuring loaders (and the names of workers and demo, re-exported)
    prefetch    the reference side-stream prefetcher and the check of the reader's
    streamcheck its stream protocol checked with test doubles of the stream API, and on a GPU

The chapters' own experiments (chapter 01's step anatomy and training loop, 02's copy sweeps, 03's pin
thread, 04's worker sweeps) are in their folders, helpers/chapters/chNN/.
"""
