"""The maintainer's tools, outside the reader's package (``helpers`` never imports them).

Run from the checkout's root, so that ``tools`` and the checkout's ``helpers`` are importable:

bench           ``python -m tools.bench`` (``make bench``): every chapter's measurements, headless
gpucheck        ``python -m tools.gpucheck`` (``make gpu-check``): the GPU check that records reference results
cuda_coverage   ``python tools/cuda_coverage.py`` (``make coverage``): how much of helpers/ the tests run
check_floor     ``python tools/check_floor.py`` (``make test-floor``): the floor venv has the requested torch
time_chapters   ``python tools/time_chapters.py``: each chapter's Run All time, for the setup cells
published_table ``python tools/published_table.py``: the README's "Published elsewhere" block, printed
"""
