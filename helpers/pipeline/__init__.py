"""Layer 3, pipeline: the data pipeline the chapters build and measure. Imports core and ui.

What two or more chapters use lives here, and what workers import by name (data sets, collate and init functions):
shapes (the JPEG data set drawn, cached, verified), data (its Dataset, the normaliser, TimedCollate, seed_worker),
models (the small CNN), train (the timeline's phases, make_optimizer, the bottleneck model), transfer (copy facts,
host-RAM guards, pinning arithmetic), workers (leak-proof worker processes, failures in plain words, /dev/shm),
demo (chapters 03-04's data sets and collate functions), loaders (building and timing loaders; re-exports workers
and demo) and prefetch (the reference side-stream prefetcher). Each chapter's own experiments are in
helpers/chapters/chNN/.
"""
