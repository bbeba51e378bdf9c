"""Helpers for the GPU data-pipeline workbook, in four layers (one folder each).

Each layer imports only its own and lower layers, with no import cycle (the table in
docs/CONTRIBUTING.md, checked by tests/test_layers.py):

    core       settings, checks, hardware facts, timers, result files     helpers.core.config, ...
    ui         what the reader sees: plots, panels, exercise checks       helpers.ui.widgets, ...
    pipeline   the data pipeline the chapters build and measure           helpers.pipeline.loaders, ...
    chapters   what puts it together: one module per chapter              helpers.chapters.ch06.capstone, ...

Chapters import what they need, e.g. ``from helpers.core import device, timing``. Importing a
layer is cheap: nothing imports torch until a module that needs it is imported. Each layer's
``__init__`` lists its modules.

The maintainer's command-line tools (the bench, the GPU check) are not part of this package: they live
in the checkout's ``tools/`` folder (``python -m tools.bench`` from its root) and nothing here imports them.
"""

__version__ = "0.1.0"
