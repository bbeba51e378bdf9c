"""Chapter 06's and the take-home script's ``batches()`` under the CUDA stream stand-ins (issue 24, items 2 and 5).

``batches()`` makes a new ``Prefetcher`` every epoch; the side stream must still be made once per device
and reused (chapter 05's protocol check refuses a stream per epoch). No GPU here: the CUDA stream API is
replaced by the logging test doubles of :func:`helpers.chapters.ch05.prefetch.stream_doubles`, ``DEVICE`` is
``cuda`` and ``Tensor.to`` is redirected so that a move to ``cuda`` is recorded (target device, stream,
``non_blocking``) and then made to the CPU. ``normalize`` is replaced by the identity for the run, so the
tensors ``batches()`` hands over are the prefetcher's own (those ``record_stream`` must have been called on).
"""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from helpers.chapters.ch05 import prefetch as streamcheck
from helpers.pipeline import data
from helpers.ui import codecells

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "fast_pipeline.py"
CUDA = torch.device("cuda")


def _script() -> Any:
    spec = importlib.util.spec_from_file_location("fast_pipeline_streams", SCRIPT)
    mod = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    return mod


def _chapter() -> Any:
    """Chapter 06's pipeline cells, executed as the notebook runs them (with the setup cell's globals)."""
    ns: dict[str, Any] = {
        "torch": torch,
        "functools": functools,
        "F": F,
        "DataLoader": DataLoader,
        "MEAN": data.MEAN,
        "STD": data.STD,
        "DEVICE": torch.device("cpu"),
        "WORKERS": 0,
        "SEED": 0,
    }
    exec(compile("\n\n".join(codecells.pipeline_cells("06")), "<chapter 06 pipeline>", "exec"), ns)

    class Namespace:
        def __getattr__(self, name: str) -> Any:
            return ns[name]

        def __setattr__(self, name: str, value: Any) -> None:
            ns[name] = value

    return Namespace()


def _run_two_epochs(mod: Any, n_batches: int = 4) -> tuple[list[Any], list[list[Any]], int, list[Any]]:
    """``for x, y in batches(loader)`` twice, ``DEVICE = cuda``, under the stream doubles."""
    targets: list[Any] = []
    handed: list[list[Any]] = []
    clear = getattr(getattr(mod, "side_stream", None), "cache_clear", lambda: None)
    clear()
    saved = (mod.DEVICE, mod.normalize)
    mod.DEVICE, mod.normalize = CUDA, lambda x: x
    try:
        with streamcheck.stream_doubles() as proto:
            logged_to = torch.Tensor.to

            def to_cpu(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
                target = kwargs.get("device", args[0] if args else None)
                if isinstance(target, (str, torch.device)) and torch.device(target).type == "cuda":
                    if id(self) in proto.probes:
                        targets.append(torch.device(target))
                    args = ("cpu", *args[1:]) if args else args
                    kwargs = {**kwargs, "device": "cpu"} if "device" in kwargs else kwargs
                return logged_to(self, *args, **kwargs)

            loader = streamcheck.PairProbeLoader(n_batches, proto)
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(torch.Tensor, "to", to_cpu)
                for epoch in range(2):
                    streamcheck._log("epoch", epoch)
                    got = []
                    for k, batch in enumerate(mod.batches(loader)):
                        streamcheck._log("handed", epoch, k, [id(t) for t in batch])
                        got.append(batch)
                    handed.append(got)
            return proto.log, handed, sum(1 for e in proto.log if e[0] == "new stream"), targets
    finally:
        mod.DEVICE, mod.normalize = saved
        clear()  # no test double stays cached


@pytest.mark.parametrize("where", ["examples/fast_pipeline.py", "chapter 06's pipeline cells"])
def test_batches_keeps_one_side_stream_and_follows_the_stream_protocol(where: str) -> None:
    mod = _script() if where.startswith("examples") else _chapter()
    n = 4
    log, handed, streams_made, targets = _run_two_epochs(mod, n)
    assert streams_made == 1, f"{where}: {streams_made} side streams made in two epochs; make it once per device"
    problems = streamcheck.check_protocol(log, handed, n)
    assert problems == [], f"{where}:\n" + "\n".join(problems) + "\n" + streamcheck.format_protocol(log)
    # every copy goes to DEVICE, non-blocking, on the side stream; the batches handed over are those copies
    moves = [e for e in log if e[0] == "move"]
    assert len(moves) == 2 * 2 * n and all(e[3] != streamcheck.CONSUMER and e[4] for e in moves)
    assert targets == [CUDA] * (2 * 2 * n)
    for epoch in handed:
        assert [int(y[0]) for _, y in epoch] == list(range(n))
    # the main (current) stream waits for the side stream before every hand-over
    waits = [e for e in log if e[0] == "wait" and e[1] == streamcheck.CONSUMER]
    assert len(waits) >= 2 * n
    assert sum(1 for e in log if e[0] == "record_stream" and e[2] == streamcheck.CONSUMER) == 2 * 2 * n
