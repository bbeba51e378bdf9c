"""A Ctrl-C while the first optimizer imports torch._dynamo is held until the import is done.

The first ``torch.optim.Adam`` of a process imports ``torch._dynamo`` (about a second, sympy included). A
``KeyboardInterrupt`` raised inside that import left sympy half-imported, and every later run in the
kernel failed (the interrupt battery's scenario d, chapter 06's panel). ``train.make_optimizer`` holds
the press and raises it once the optimizer exists.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import os, signal, sys
    import torch
    from helpers.pipeline import train

    signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a kernel (a test runner's worker may ignore it)
    real = torch.optim.Adam

    def pressed_during_construction(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGINT)  # the press lands as the import starts
        return real(*args, **kwargs)

    torch.optim.Adam = pressed_during_construction
    assert "torch._dynamo" not in sys.modules
    model = torch.nn.Linear(2, 2)
    try:
        train.make_optimizer(model)
    except KeyboardInterrupt:
        print("interrupted after the import:", "torch._dynamo" in sys.modules)
    torch.optim.Adam = real
    opt = train.make_optimizer(model)  # the kernel still works
    model(torch.randn(3, 2)).sum().backward()
    opt.step()
    print("next run ok")
    """
)


def test_a_press_during_the_first_optimizer_is_raised_after_it() -> None:
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "interrupted after the import: True" in done.stdout
    assert "next run ok" in done.stdout
