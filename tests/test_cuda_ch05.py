"""Chapter 05's CUDA-only helpers, run on a CPU with the CUDA stand-ins of :mod:`tests.cuda_standin`:
the hazards' fixes wait on an event recorded on the stream their copy went to (on ``cuda:1`` while
``cuda:0`` is current too), and the sync counter synchronises the device it counts. No time made by
a stand-in is asserted or shown.
"""

from __future__ import annotations

import contextlib
import functools
import json
import types
from typing import Any

import pytest
import torch
from cuda_standin import fake_cuda

from helpers.chapters.ch05 import feeding, hazards, overlap
from helpers.pipeline import data
from helpers.ui import codecells

CUDA1 = torch.device("cuda", 1)


def test_d2h_fix_waits_for_its_copy_on_the_copys_device() -> None:
    with fake_cuda(devices=2, current=0) as cuda:
        x_gpu = torch.ones(16).to(CUDA1)
        out = torch.full((16,), -1.0)
        assert hazards._d2h_fix(x_gpu, out) == 0
    copy = [op for op in cuda.ops("copy") if op["direction"] == "d2h"]
    assert len(copy) == 1 and copy[0].stream is cuda.default[1] and copy[0]["non_blocking"]
    (record,) = cuda.ops("record")
    assert record.stream is copy[0].stream, "the event must follow the D2H copy on cuda:1's stream"
    (wait,) = cuda.host_syncs()
    assert wait["event"] is record["event"] and cuda.log.index(wait) > cuda.log.index(record)


def test_mutation_fix_waits_for_the_copy_before_refilling_its_source() -> None:
    with fake_cuda(devices=2, current=0) as cuda:
        dst = torch.zeros(8).to(CUDA1)
        src = torch.ones(8).pin_memory()
        hazards._mutation_fix(src, dst)
        assert torch.equal(dst.cpu(), torch.ones(8))  # the copy read the ones, not the refill's twos
    kinds = [op.kind for op in cuda.log if op.kind in ("copy", "record", "host_sync", "fill_pinned")]
    assert kinds[:4] == ["copy", "copy", "record", "host_sync"]  # zeros -> dst, then src -> dst, event, wait
    copy, record = cuda.log[[op.kind for op in cuda.log].index("record") - 1], cuda.ops("record")[0]
    assert copy.kind == "copy" and copy.stream is record.stream is cuda.default[1]


def test_sync_counter_synchronises_the_device_it_counts() -> None:
    with fake_cuda(devices=2, current=0) as cuda:
        hazards._count_syncs(lambda: None, CUDA1)
    syncs = cuda.host_syncs()
    assert len(syncs) == 2 and all(op["device"] == 1 for op in syncs)  # before and after fn, on cuda:1
    assert hazards.hazard_hidden_syncs("cpu", steps=2).bug["synchronisations"] == "not counted: no CUDA device"


# -- "Does it pay?": what a timed pass runs ----------------------------------------------------------

DOES_IT_PAY = ("c5a1e0b1", "5e1c7a11", "fa095624")  # chapter 04 restated, in_line, the measuring cell


class _CountingLoader(list):
    """A loader that counts how often it is iterated (each iteration would decode a batch of images)."""

    iterations = 0

    def __iter__(self):  # type: ignore[override]
        self.iterations += 1
        return super().__iter__()


def _does_it_pay_namespace(cuda, n: int = 3) -> tuple[dict[str, Any], list[tuple[int, Any]]]:
    import torch.nn.functional as F
    from torch.utils.data import DataLoader

    from helpers.core import config
    from helpers.core.progress import no_progress

    steps: list[tuple[int, Any]] = []  # (place in the log, x) of every training step
    g = torch.Generator().manual_seed(0)
    u8 = [(torch.randint(0, 256, (4, 3, 8, 8), dtype=torch.uint8, generator=g), torch.arange(4)) for _ in range(n)]
    ns: dict[str, Any] = {
        "torch": torch,
        "functools": functools,
        "F": F,
        "DataLoader": DataLoader,
        "data": data,
        "config": config,
        "overlap": overlap,
        "feeding": feeding,
        "DEVICE": torch.device("cuda", 0),
        "SEED": 0,
        "WORKERS": 0,
        "loader_u8": _CountingLoader(u8),
        "loader_f32": _CountingLoader([(data.to_float_normalized(x), y) for x, y in u8]),
        "progress_bar": lambda what: contextlib.nullcontext(no_progress),
        "info": types.SimpleNamespace(classes=["a", "b"]),
        "models": types.SimpleNamespace(build_model=lambda num_classes: _Model()),
    }
    cells = {c: _cell05(c) for c in DOES_IT_PAY}
    exec(compile(cells["c5a1e0b1"], "<chapter 05: chapter 04 restated>", "exec"), ns)
    ns["batches_04"] = ns["batches"]
    exec(compile("\n\n".join(codecells.pipeline_cells("05")), "<chapter 05 pipeline>", "exec"), ns)
    mean, std = (torch.tensor(v).view(1, 3, 1, 1) for v in (data.MEAN, data.STD))
    ns["stats"] = lambda device: (mean, std)  # the statistics, made once per device, as host tensors here
    ns["train_step"] = lambda model, optimizer, x, y: steps.append((len(cuda.log), x))
    exec(compile(cells["5e1c7a11"], "<chapter 05: in_line>", "exec"), ns)
    measuring = cells["fa095624"].split("\ntimes = ")[0]  # the function; the cell's evidence call shows it
    exec(compile(measuring, "<chapter 05: time_your_pipeline>", "exec"), ns)
    return ns, steps


class _Model(torch.nn.Linear):
    def __init__(self) -> None:
        super().__init__(1, 1)

    def to(self, *args: Any, **kwargs: Any) -> _Model:  # type: ignore[override]
        return self  # its parameters are not what this test checks


def _cell05(cell_id: str) -> str:
    nb = json.loads(codecells.notebook_path("05").read_text(encoding="utf-8"))
    return next("".join(c["source"]) for c in nb["cells"] if c.get("id") == cell_id)


def test_does_it_pay_times_the_copy_on_preloaded_pinned_batches_not_the_loader() -> None:
    """#24.2: every timed pass restarted the loader, whose load dwarfs the copy. Now each loader is read once,
    into pinned memory, and each way's pass runs copy (or none) + normalise + step, and nothing else."""
    n = 3
    with fake_cuda(devices=1, current=0) as cuda:
        ns, steps = _does_it_pay_namespace(cuda, n)
        times = ns["time_your_pipeline"]()
    assert ns["loader_u8"].iterations == 1 and ns["loader_f32"].iterations == 1, "a timed pass ran the loader"
    assert len(cuda.ops("pin")) == 2 * 2 * n  # x and y of every batch of both loaders, pinned once
    ways = ["chapter 04: float32, copied in line", feeding.IN_LINE, feeding.PREFETCHED, feeding.NO_COPY]
    assert list(times.values) == ways
    rounds = len(times.values[feeding.IN_LINE])
    # The passes: between the device syncs time_batches makes before and after each one.
    syncs = [i for i, op in enumerate(cuda.log) if op.kind == "host_sync"]
    assert all(cuda.log[i]["what"] == "torch.cuda.synchronize" and cuda.log[i]["device"] == 0 for i in syncs)
    passes = [(a, b) for a, b in zip(syncs, syncs[1:]) if any(a < at <= b for at, _ in steps)]
    assert len(passes) == len(ways) * (rounds + 1)  # one warm-up pass per way, then the rounds
    seen: dict[str, int] = {}
    for a, b in passes:
        ops = cuda.log[a + 1 : b]
        pass_steps = [x for at, x in steps if a < at <= b]
        assert len(pass_steps) == n and all(x.dtype == torch.float32 and x.shape == (4, 3, 8, 8) for x in pass_steps)
        assert not [op for op in ops if op.kind in ("host_sync", "pin")], "a timed pass waited or pinned"
        copies = [op for op in ops if op.kind == "copy"]
        if not copies:
            way = feeding.NO_COPY
        elif all(c.stream is not cuda.default[0] for c in copies):
            way = feeding.PREFETCHED
            assert [op.kind for op in ops].count("wait_stream") == n + 1 and len(cuda.ops("record_stream")) > 0
        elif copies[0]["dtype"] == torch.float32:
            way = ways[0]
        else:
            way = feeding.IN_LINE
        assert len(copies) == (0 if way == feeding.NO_COPY else 2 * n)
        assert all(c["src_pinned"] and c["non_blocking"] and c["device"] == torch.device("cuda", 0) for c in copies)
        seen[way] = seen.get(way, 0) + 1
    assert seen == dict.fromkeys(ways, rounds + 1)
    assert "hidden" in times.report() or "spread" in times.report()  # the copy-hidden line is there


def test_preload_reads_one_pass_and_pins_only_for_cuda() -> None:
    loader = _CountingLoader([(torch.zeros(2, 3), torch.zeros(2)) for _ in range(2)])
    held = feeding.preload(loader, "cpu")
    assert loader.iterations == 1 and len(held) == 2 and all(isinstance(b, tuple) for b in held)
    assert held[0][0] is loader[0][0]  # on a CPU: the loader's own tensors, nothing pinned or copied
    with fake_cuda(devices=1) as cuda:
        pinned = feeding.preload(loader, "cuda")
        assert all(t.is_pinned() for b in pinned for t in b)
        again = feeding.preload(pinned, "cuda")
        assert all(a is b for x, y in zip(pinned, again) for a, b in zip(x, y))  # pinned already: kept
    assert len(cuda.ops("pin")) == 4
    with pytest.raises(ValueError, match="no batch"):
        feeding.preload([], "cpu")
    with pytest.raises(ValueError, match="not a tuple of tensors"):
        feeding.preload([torch.zeros(2)], "cpu")


def test_copy_hidden_reads_the_three_ways_and_names_noise() -> None:
    ms = 1e-3
    ways = {
        feeding.IN_LINE: [3 * ms, 3.1 * ms],
        feeding.PREFETCHED: [2 * ms, 2 * ms],
        feeding.NO_COPY: [1 * ms, 1 * ms],
    }
    t = feeding.BatchTimes(tuple(ways), ways, device="cuda:0")
    assert t.copy_hidden() is not None and "51% hidden" in t.copy_hidden()  # (3.05 - 2) / (3.05 - 1)
    assert "51% hidden" in t.report()
    noisy = feeding.BatchTimes(t.labels, {k: [1 * ms, 2 * ms] for k in t.values}, device="cuda:0")
    assert "too small" in (noisy.copy_hidden() or "")
    assert feeding.BatchTimes(("a",), {"a": [1.0]}, device="cpu").copy_hidden() is None


# -- the 2x2 experiment: which stream each copy, each compute and each event goes to -----------------


@pytest.mark.parametrize(("memory", "stream"), overlap.CELLS)
def test_run_cell_puts_copy_compute_and_events_on_the_measured_devices_streams(memory: str, stream: str) -> None:
    steps = 2
    with fake_cuda(devices=2, current=0) as cuda:
        cell = overlap.run_cell(memory, stream, device=CUDA1, copy_mib=1, matmul_n=16, steps=steps)
    assert cell.on_gpu and cell.expected == overlap.expected_label(memory, stream)
    default = cuda.default[1]
    used = {op.stream.index for op in cuda.log if op.stream is not None}
    assert used == {1}, "an event or a copy went to the current device (cuda:0), not the measured one"
    assert all(op["device"] == 1 for op in cuda.host_syncs() if "device" in op.detail)
    copies = [op for op in cuda.ops("copy") if op["direction"] == "h2d" and op["shape"] == ((1 << 20) // 4,)]
    assert len(copies) == steps + 1  # a warm-up copy, then one per step
    for op in copies:
        assert op["src_pinned"] == (memory == "pinned") and op["non_blocking"]
        assert (op.stream is not default) == (stream == "side")
    if stream == "side":  # the side stream starts after the warm-up's work on the compute stream
        waits = cuda.ops("wait_stream")
        assert waits and waits[0].stream is copies[0].stream and waits[0]["other"] is default
    # In each step the copy is bracketed by events on ITS stream, and the step ends with one host sync.
    log = cuda.log
    for op in copies[1:]:
        i = log.index(op)
        assert log[i - 1].kind == "record" and log[i - 1].stream is op.stream
        assert log[i + 1].kind == "record" and log[i + 1].stream is op.stream
    first = log.index(copies[1]) - 1
    syncs = [op for op in cuda.host_syncs(first) if op["what"] == "torch.cuda.synchronize"]
    assert len(syncs) == steps + 2  # one per step, then finish() and the final one


def test_the_race_checks_delay_queues_on_the_checked_device() -> None:
    """prefetch's race checks queue do-nothing GPU work before a check: on the device checked, not the current one."""
    from helpers.chapters.ch05 import prefetch

    with fake_cuda(devices=2, current=0) as cuda:
        delay = prefetch._delay_behind_copy(torch.ones(64).pin_memory(), CUDA1)
        start = len(cuda.log)
        delay()
    assert cuda.ops("kernel") and all(op.stream is cuda.default[1] for op in cuda.ops("kernel"))
    assert [op.kind for op in cuda.log[start:]] == ["kernel"]  # the delay itself never waits on the host
    assert all(op.stream.index == 1 for op in cuda.ops("record"))


def test_the_panel_runs_the_cell_on_the_chosen_device() -> None:
    from helpers.chapters import ch05

    with fake_cuda(devices=2, current=0) as cuda:
        ev = ch05.panel_run(None, device=CUDA1, copy_mib=1, matmul_n=16, memory="pinned", stream="side")
    assert ev.here and ev.value.on_gpu and ev.value.expected == "overlapped"
    assert {op.stream.index for op in cuda.log if op.stream is not None} == {1}
    assert any(op.stream is not cuda.default[1] for op in cuda.ops("copy"))  # the side stream copied


def test_the_reference_prefetch_figures_copy_in_line_or_ahead_on_the_measured_device(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """ch05.prefetch.batch_time: four ways, each pass between two syncs of the device measured; without the
    prefetcher every copy goes to the device's current stream, with it to its side stream; all from pinned memory."""
    calibrated: list[float] = []

    def cheap_compute(dev: torch.device, target_s: float) -> Any:  # the product's size is not what is checked
        calibrated.append(target_s)
        return lambda x: x.float().sum()

    monkeypatch.setattr(feeding, "calibrated_compute", cheap_compute)
    with fake_cuda(devices=2, current=0) as cuda:
        times = feeding.prefetch_step_times(CUDA1, batch=2, image=4, n_batches=2)
    assert set(times) == {(d, p) for d in ("float32", "uint8") for p in (False, True)}
    assert calibrated and all(t > 0 for t in times.values())
    assert all(op["device"] == 1 for op in cuda.host_syncs() if "device" in op.detail)
    batches = [op for op in cuda.ops("copy") if op["direction"] == "h2d" and op["shape"] in ((2, 3, 4, 4), (2,))]
    assert batches and all(op["src_pinned"] and op.stream.index == 1 for op in batches)
    assert len([op for op in batches if not op["non_blocking"]]) == 1  # the calibration's warm-up copy
    batches = [op for op in batches if op["non_blocking"]]
    assert {op.stream is cuda.default[1] for op in batches} == {True, False}  # in line, and ahead on a side stream
    assert {op["dtype"] for op in batches if op["shape"] == (2, 3, 4, 4)} == {torch.uint8, torch.float32}


def test_the_hazards_gpu_branches_give_what_the_benchmark_records() -> None:
    """Each hazard's CUDA branch, on cuda:1 while cuda:0 is current: its copies and events on cuda:1's stream,
    and the counts the benchmark records (ch05.hazard.*) under their keys. No count made here is asserted."""
    with fake_cuda(devices=2, current=0) as cuda:
        d2h = hazards.hazard_d2h_read_before_sync(CUDA1)
        mutation = hazards.hazard_pinned_source_mutation(CUDA1)
        syncs = hazards.hazard_hidden_syncs(CUDA1, steps=2)
    assert d2h.on_gpu and mutation.on_gpu and syncs.on_gpu
    assert {op.stream.index for op in cuda.log if op.stream is not None} == {1}
    assert len(cuda.ops("kernel")) >= 4  # the GPU is kept busy before each version of hazards 1 and 2
    for h, key in ((d2h, "wrong elements when read"), (mutation, "elements that arrived wrong")):
        assert all(isinstance(v[key], int) and v["elements copied"] == 4 * 2**20 for v in (h.bug, h.fix))
    assert isinstance(syncs.bug["synchronisations"], int) and isinstance(syncs.fix["synchronisations"], int)
    assert [k for k in syncs.bug if k.endswith(" alone")] == [".item() alone", "print(loss) alone", ".cpu() alone"]
    assert "masked_select" in syncs.explanation and "not counted" not in str(syncs.bug)
