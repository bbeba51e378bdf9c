"""Layer 2, ui: what the reader sees. Imports core only.

plots       shared plots (timelines, stacked phases, sweeps, run history)
widgets     the live-panel toolkit
exercises   automatic checks for the exercises
codecells   the pipeline cells of the chapters, and their diffs
published   host<->GPU copy figures published elsewhere (cited), beside ours and the theory
"""
