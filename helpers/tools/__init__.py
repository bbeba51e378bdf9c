"""Layer 5, tools: command-line tools over everything.

bench       ``python -m helpers.tools.bench``: every chapter's measurements, headless
gpucheck    ``python -m helpers.tools.gpucheck``: the GPU check that records reference results
"""
