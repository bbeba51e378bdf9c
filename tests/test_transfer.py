"""CPU unit tests for chapter 02's copies, model and pin costs, and helpers.pipeline.transfer."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

from helpers.chapters.ch02 import copies, figures, model, pin_costs
from helpers.chapters.ch02.model import GiB, KiB, MiB
from helpers.core.results import ResultSet
from helpers.pipeline import transfer as T

NO_CUDA = not torch.cuda.is_available()


# -- size grids -----------------------------------------------------------------


def _grid(lo, hi, factor):
    return [n for n in (lo * factor**i for i in range(40)) if n <= hi]


def test_copy_sizes_cover_the_issue_range(monkeypatch):
    monkeypatch.setenv("WORKBOOK_QUICK", "0")
    full = model.copy_sizes()
    assert full[0] == 4 * KiB and full[-1] == 256 * MiB  # geometric and inclusive of the largest size
    assert all(b == 2 * a for a, b in zip(full, full[1:]))
    monkeypatch.setenv("WORKBOOK_QUICK", "1")
    quick = model.copy_sizes()
    assert quick == [4 * KiB, 16 * KiB, 64 * KiB, 256 * KiB, MiB, 4 * MiB, 16 * MiB] and len(quick) < len(full)


# -- the latency + bandwidth fit ----------------------------------------------


def test_fit_recovers_exact_synthetic_parameters():
    sizes = _grid(4 * KiB, 256 * MiB, 2)
    lat, bw = 9e-6, 24e9
    times = [lat + n / bw for n in sizes]
    fit = model.fit_latency_bandwidth(sizes, times)
    assert fit.latency_s == pytest.approx(lat, rel=1e-6)
    assert fit.bandwidth_Bps == pytest.approx(bw, rel=1e-6)
    assert fit.gbps == pytest.approx(24.0, rel=1e-6)
    assert fit.max_rel_error < 1e-9 and not fit.latency_clamped
    assert fit.predict_s(1 * MiB) == pytest.approx(lat + MiB / bw)
    assert fit.half_bandwidth_bytes() == pytest.approx(lat * bw)


def test_fit_with_multiplicative_noise_is_close():
    rng = np.random.default_rng(0)
    sizes = np.array(_grid(4 * KiB, 256 * MiB, 2), dtype=float)
    lat, bw = 15e-6, 12e9
    times = (lat + sizes / bw) * rng.lognormal(0.0, 0.03, sizes.size)
    fit = model.fit_latency_bandwidth(sizes, times)
    assert fit.latency_s == pytest.approx(lat, rel=0.1)
    assert fit.bandwidth_Bps == pytest.approx(bw, rel=0.05)


def test_fit_weights_small_sizes_not_only_large_ones():
    # An ordinary least-squares fit would be dominated by the 256 MiB point and get the latency
    # wrong by far; the relative-error fit gets the small-size times right.
    sizes = _grid(4 * KiB, 256 * MiB, 4)
    times = [5e-6 + n / 20e9 for n in sizes]
    times[-1] *= 1.02  # 2 % noise on the largest copy
    fit = model.fit_latency_bandwidth(sizes, times)
    assert fit.predict_s(4 * KiB) == pytest.approx(times[0], rel=0.05)


def test_fit_clamps_negative_latency():
    sizes = [1 * MiB, 2 * MiB, 4 * MiB]
    times = [n / 10e9 - 5e-6 for n in sizes]  # impossible: negative intercept
    fit = model.fit_latency_bandwidth(sizes, times)
    assert fit.latency_clamped and fit.latency_s == 0.0 and fit.bandwidth_Bps > 0
    assert "clamped" in str(fit)


@pytest.mark.parametrize(
    "sizes, times",
    [
        ([1024], [1e-6]),  # one point
        ([1024, 1024], [1e-6, 2e-6]),  # one distinct size
        ([1024, 2048], [1e-6]),  # length mismatch
        ([1024, 2048], [1e-6, -1.0]),  # negative time
        ([1024, 2048], [1e-6, float("nan")]),
        ([0, 2048], [1e-6, 2e-6]),
        ([1024, 4096], [4e-6, 1e-6]),  # time shrinks with size: no bandwidth
        ([], []),
    ],
)
def test_fit_rejects_bad_data(sizes, times):
    with pytest.raises(ValueError):
        model.fit_latency_bandwidth(sizes, times)


def test_sweep_fit_and_labels():
    pts = [copies.TransferPoint(n, "h2d", "pinned", 2e-6 + n / 25e9) for n in (4096, 65536, MiB)]
    sw = copies.Sweep("h2d", "pinned", pts)
    assert sw.label == "H2D pinned"
    assert sw.fit().gbps == pytest.approx(25.0, rel=1e-6)
    assert pts[2].gbps == pytest.approx(MiB / pts[2].median_s / 1e9)
    assert copies.Sweep("h2h", "pageable", pts).label.startswith("host memcpy")


# -- pinned allocator rounding and the safe limit -----------------------------


@pytest.mark.parametrize(
    "n, block",
    [(0, 0), (1, 1), (2, 2), (3, 4), (4096, 4096), (4097, 8192), (300 * MiB, 512 * MiB), (256 * MiB, 256 * MiB)],
)
def test_predict_pinned_block_rounds_up_to_power_of_two(n, block):
    assert model.predict_pinned_block(n) == block


def test_predict_pinned_block_rejects_negative():
    with pytest.raises(ValueError, match="nbytes"):
        model.predict_pinned_block(-1)


def _ram(monkeypatch, total, available):
    monkeypatch.setattr(T, "_memory_now", lambda: (total, available))


def test_safe_pin_limit_uses_smaller_of_total_and_available(monkeypatch):
    assert model.safe_pin_limit() > 0  # psutil on this machine
    _ram(monkeypatch, 16 * GiB, 8 * GiB)
    assert model.safe_pin_limit(0.25) == 2 * GiB
    _ram(monkeypatch, 4 * GiB, 8 * GiB)
    assert model.safe_pin_limit(0.5) == 2 * GiB


def test_check_pin_size_refuses_with_clear_message(monkeypatch):
    _ram(monkeypatch, 16 * GiB, 16 * GiB)  # limit: 4 GiB
    assert model.check_pin_size(1 * GiB) == 1 * GiB
    assert model.check_pin_size(3 * GiB) == 4 * GiB  # rounds to a 4 GiB block: fits exactly
    with pytest.raises(ValueError) as err:
        model.check_pin_size(5 * GiB)
    msg = str(err.value)
    assert "refusing to pin" in msg and "limit is 4.0 GiB" in msg and "25%" in msg and "reuse" in msg


def test_check_pin_size_counts_rounding(monkeypatch):
    _ram(monkeypatch, 16 * GiB, 16 * GiB)
    with pytest.raises(ValueError, match="8.0 GiB block"):
        model.check_pin_size(4 * GiB + 1)  # 4 GiB + 1 byte takes an 8 GiB block


@pytest.mark.parametrize("share", [0.0, 0.95, -1, "a"])
def test_safe_pin_limit_rejects_bad_share(share, monkeypatch):
    _ram(monkeypatch, GiB, GiB)
    with pytest.raises(ValueError, match="share"):
        model.safe_pin_limit(share)


# -- bytes on the wire, break-even, the 30-50 % claim -------------------------


def test_images_nbytes_uint8_vs_float32():
    u8 = model.images_nbytes(256, 3, 224, 224, "uint8")
    f32 = model.images_nbytes(256, 3, 224, 224, "float32")
    assert u8 == 256 * 3 * 224 * 224 and f32 == 4 * u8
    with pytest.raises(ValueError, match="dtype"):
        model.images_nbytes(1, 3, 8, 8, "float16")
    with pytest.raises(ValueError, match="batch"):
        model.images_nbytes(0, 3, 8, 8)


def test_break_even_and_pinning_pays():
    # pin 10 ms, pageable copy 3 ms, pinned 1 ms: saves 2 ms per copy, pays after 5 copies
    assert model.break_even_uses(10e-3, 3e-3, 1e-3) == pytest.approx(5.0)
    assert not model.pinning_pays(1, 10e-3, 3e-3, 1e-3)  # pin once, copy once: slower
    assert not model.pinning_pays(5, 10e-3, 3e-3, 1e-3)  # exactly break-even: no gain
    assert model.pinning_pays(6, 10e-3, 3e-3, 1e-3)
    assert math.isinf(model.break_even_uses(1e-3, 1e-3, 2e-3))  # pinned copies not faster
    assert model.break_even_uses(0.0, 2e-3, 1e-3) == 0.0
    with pytest.raises(ValueError, match="uses"):
        model.pinning_pays(0, 1.0, 1.0, 1.0)


def test_speedup_by_size_and_claim_verdict():
    pageable = copies.Sweep(
        "h2d", "pageable", [copies.TransferPoint(n, "h2d", "pageable", t) for n, t in [(1, 2.0), (2, 3.0), (4, 4.0)]]
    )
    pinned = copies.Sweep(
        "h2d", "pinned", [copies.TransferPoint(n, "h2d", "pinned", t) for n, t in [(1, 1.0), (4, 3.0)]]
    )
    assert copies.speedup_by_size(pageable, pinned) == [(1, 2.0), (4, pytest.approx(4 / 3))]
    assert [model.claim_verdict(r) for r in (0.9, 1.3, 1.4, 1.5, 2.0)] == [
        "below",
        "within",
        "within",
        "within",
        "above",
    ]
    with pytest.raises(ValueError, match="direction"):
        copies.speedup_by_size(pageable, copies.Sweep("d2h", "pinned", []))


# -- records round trip (the reference-file format) ----------------------------


def _records(*rows):
    rs = ResultSet.new("test", "unit test")
    for k, v, u, p in rows:
        rs.add(k, v, u, **p)
    return rs.records


def test_records_convert_back_into_what_the_measurements_return():
    pin = [
        (f"ch02.pin.{f}", t, "s", {"nbytes": MiB})
        for f, t in (
            ("cold", 4e-3),
            ("cached", 1e-4),
            ("pageable_copy", 1e-4),
            ("pinned_copy", 5e-5),
            ("plain_to", 2e-4),
            ("pin_then_copy", 4e-3),
        )
    ]
    rows = pin_costs.pin_costs_from_records(None, _records(*pin, ("ch02.pin.cold", 1.0, "s", {"nbytes": 2 * MiB})))
    assert [r.nbytes for r in rows] == [MiB] and rows[0].break_even_cold == pytest.approx(80)
    assert "pays after" in pin_costs.pin_cost_table(rows)
    assert pin_costs.pin_costs_from_records(None, _records(pin[0])) is None  # incomplete: nothing to show

    held = pin_costs.host_blocking_from_records(
        None,
        _records(
            ("ch02.host_held", 0.05, "s", {"case": "pageable", "nbytes": 64 * MiB, "gpu_work_s": 0.05}),
            (
                "ch02.host_held",
                1e-5,
                "s",
                {"case": "pinned, non_blocking=True", "nbytes": 64 * MiB, "gpu_work_s": 0.05},
            ),
        ),
    )
    assert held.held_s == {"pageable": 0.05, "pinned, non_blocking=True": 1e-5} and held.gpu_work_s == 0.05
    lines = held.lines()
    assert "GPU work queued ahead of the copy: 50.0 ms" in lines[0] and "CPU held for   50.000 ms" in lines[1]
    assert pin_costs.host_blocking_from_records(None, []) is None

    blocks = pin_costs.pinned_blocks_from_records(
        None,
        _records(
            ("ch02.pinned_block", 8 * MiB, "bytes", {"requested": 5 * MiB}),
            ("ch02.pinned_block", 4 * MiB, "bytes", {"requested": 3 * MiB}),
        ),
    )
    assert blocks.rows == [(3 * MiB, 4 * MiB), (5 * MiB, 8 * MiB)]
    assert blocks.lines()[0] == "  requested 3 MiB: pool grew by 4 MiB (predicted 4 MiB)"
    assert blocks.lines()[1] == "  requested 5 MiB: pool grew by 8 MiB (predicted 8 MiB)"
    assert "unknown" in pin_costs.PinnedBlocks([(MiB, None)]).lines()[0]

    wire = copies.wire_from_records(
        None,
        _records(
            ("ch02.wire_time", 1e-3, "s", {"dtype": "uint8", "nbytes": MiB}),
            ("ch02.wire_time", 4e-3, "s", {"dtype": "float32", "nbytes": 4 * MiB}),
        ),
    )
    assert wire.byte_ratio == 4 and wire.time_ratio == 4
    assert wire.lines()[-1] == "bytes ratio 4x, time ratio 4.0x — pinned H2D copy"
    assert (
        copies.wire_from_records(None, _records(("ch02.wire_time", 1e-3, "s", {"dtype": "uint8", "nbytes": MiB})))
        is None
    )


def test_sweeps_from_records_rebuilds_curves():
    rs = ResultSet.new("test", "unit test")
    for n in (MiB, 4096, 65536):
        rs.add(
            "ch02.copy_time", 2e-6 + n / 20e9, "s", {"iqr_s": 1e-7, "n": 10}, direction="h2d", memory="pinned", nbytes=n
        )
    rs.add("ch02.fit.latency", 1.0, "s", direction="h2d", memory="pinned")  # another key: not a point
    from helpers.chapters import ch02
    from helpers.core.evidence import provenance_line

    sweeps = ch02.recorded_sweeps(rs, rs.find("ch02.copy_time")).sweeps
    sw = sweeps[("h2d", "pinned")]
    assert list(sweeps) == [("h2d", "pinned")]
    assert sw.sizes() == [4096, 65536, MiB] and sw.source == provenance_line(rs) and sw.points[0].n == 10
    assert ch02.recorded_sweeps(rs, []) is None  # no curve recorded
    assert sw.fit().gbps == pytest.approx(20.0, rel=1e-6)


# -- what runs on this CPU-only machine ---------------------------------------


def test_host_copy_is_real_and_labelled():
    p = copies.measure_host_copy(64 * KiB)
    assert p.direction == "h2h" and p.memory == "pageable" and p.median_s > 0 and p.gbps > 0
    assert "CPU memcpy" in p.method
    sw = copies.sweep(lambda src, *a: [1e-6], [4 * KiB, 16 * KiB], device="cpu")[("h2h", "pageable")]
    assert sw.sizes() == [4 * KiB, 16 * KiB] and "CPU" in sw.label + sw.source
    with pytest.raises(ValueError, match="multiple of 4"):
        copies.measure_host_copy(6, dtype="float32")


@pytest.mark.skipif(not NO_CUDA, reason="checks the no-GPU path")
def test_gpu_measurements_return_unavailable_without_cuda():
    results = [
        pin_costs.pin_cost(MiB),
        pin_costs.host_blocking_probe(),
        T.host_allocator_stats(),
        pin_costs.pinned_rounding_demo([3 * MiB]),
    ]
    for r in results:
        assert isinstance(r, T.Unavailable) and not r
        assert "No CUDA device" in " ".join(str(r).split())
    assert "Found no NVIDIA driver" in results[0].reason  # the driver's own words are shown


@pytest.mark.skipif(not NO_CUDA, reason="checks the no-GPU path")
def test_pinning_status_reports_the_driver_error():
    ok, msg = copies.pinning_status()
    assert not ok and "Found no NVIDIA driver" in msg and "driver" in msg


def test_gpu_measurements_validate_before_checking_hardware():
    from helpers.chapters import ch02

    panel = dict(
        size_mib=1, direction="h2d", memory="pinned", dtype="uint8", copy_fn=lambda *a: [1e-6]
    )  # the panel picks the copy
    with pytest.raises(ValueError, match="direction"):
        ch02.panel_run(lambda *a: None, device="cpu", **{**panel, "direction": "sideways"})
    with pytest.raises(ValueError, match="memory"):
        ch02.panel_run(lambda *a: None, device="cpu", **{**panel, "memory": "locked"})
    with pytest.raises(ValueError, match="device"):  # the GPU curves: CUDA only
        ch02.measure_sweeps(lambda *a: [1e-6], [MiB], device="cpu")
    with pytest.raises(ValueError, match=r"sizes\[i\]"):  # sizes are checked where the notebook passes them
        copies.sweep(lambda *a: [1e-6], [0])
    with pytest.raises(ValueError, match="multiple of 4"):
        copies.sweep(lambda *a: [1e-6], [6], dtype="float32")
    with pytest.raises(ValueError, match="gpu_work_s"):
        pin_costs.host_blocking_probe(gpu_work_s=0)
    with pytest.raises(ValueError, match="nbytes"):
        pin_costs.host_blocking_probe(nbytes=0)
    with pytest.raises(ValueError, match="memory"):
        ch02.panel_run(lambda *a: None, device="cpu", **{**panel, "memory": "gpu"})


def test_cuda_status_for_a_cpu_device():
    ok, reason = T.cuda_status("cpu")
    assert not ok and reason


@pytest.mark.skipif(not NO_CUDA, reason="checks the no-GPU path")
def test_cuda_status_checks_the_spelling_and_answers_cuda_without_raising():
    assert T.cuda_status("cuda") == (False, T.NO_CUDA_REASON)  # absent here, not wrong
    assert isinstance(pin_costs.pin_cost(MiB, device="cuda"), T.Unavailable)
    for bad, match in (("gpu", "such as 'cpu'"), ("mps", "one of")):
        with pytest.raises(ValueError, match=match):
            T.cuda_status(bad)


def test_transfer_sweep_is_the_sweep_loop_with_the_helpers_copy():
    # No GPU needed: the CUDA stand-ins log each copy; their times are a fixed value, never shown.
    from cuda_standin import fake_cuda

    seen = []
    with fake_cuda(devices=1) as cuda:
        sw = copies.transfer_sweep(
            "d2h", "pinned", [4 * KiB, 64 * KiB], device="cuda", repeats=4, progress=lambda f, t="": seen.append(f)
        )
    d2h = [(op["shape"], op["dst_pinned"]) for op in cuda.ops("copy") if op["direction"] == "d2h"]
    assert d2h == [((4 * KiB,), True)] * 7 + [((64 * KiB,), True)] * 7  # one round, one kind: 3 warm-up + 4 timed
    assert (sw.direction, sw.memory, sw.label, sw.device, sw.source) == (
        "d2h",
        "pinned",
        "D2H pinned",
        "a stand-in GPU (no numbers)",
        "measured here",
    )
    assert sw.method == "CUDA events on a side stream, 3 warm-up copies, median of 4"
    assert [p.n for p in sw.points] == [4, 4] and seen[-1] == pytest.approx(1.0)


def test_wire_comparison_on_this_machine():
    w = copies.wire_comparison(2, 3, 32, 32)
    assert w.byte_ratio == 4.0 and w.nbytes["uint8"] == 2 * 3 * 32 * 32
    assert all(s > 0 for s in w.seconds.values())
    if NO_CUDA:
        assert "not a GPU transfer" in w.what


# -- plots ----------------------------------------------------------------------


def test_plots_draw_without_error():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = figures.copy_paths_diagram()
    assert fig.axes
    plt.close(fig)
    pts = [copies.TransferPoint(n, "h2d", "pinned", 2e-6 + n / 25e9) for n in (4096, 65536, MiB)]
    ax = figures.plot_sweeps(
        [copies.Sweep("h2d", "pinned", pts)],
        ceiling=(31.5, "PCIe Gen4 x16 (theoretical)"),
        points=[(pts[1], "panel run")],
    )
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert "H2D pinned" in labels and any("theoretical" in s for s in labels) and "panel run" in labels
    assert any(s.startswith("H2D pinned fit") for s in labels)
    plt.close(ax.figure)
    ax = figures.plot_speedup({"H2D": [(4096, 1.1), (MiB, 1.6)]}, source="test")
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert "H2D: pageable time / pinned time" in labels and "the claim: 1.3x-1.5x" in labels
    assert ax.get_yscale() == "linear" and ax.get_xscale() == "log"
    plt.close(ax.figure)
    cost = pin_costs.PinCost(MiB, 4e-3, 1e-4, 1e-4, 5e-5, 2e-4, 4e-3)
    ax = figures.plot_pin_costs([cost, dataclasses.replace(cost, nbytes=4 * MiB)])
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert len(labels) == 3 and ax.get_xlabel().startswith("buffer size") and ax.get_yscale() == "log"
    plt.close(ax.figure)


# -- sizes checked against memory, strict GPU runs (issues 14, 15) ---------------------------------


def test_check_host_bytes_against_available_ram(monkeypatch):
    monkeypatch.setattr(T, "_memory_now", lambda: (4000, 1000))
    assert T.check_host_bytes("nbytes", 100) == 100
    with pytest.raises(ValueError, match=r"nbytes: .*needs 600 B of host RAM, more than 50% of the 1000 B"):
        T.check_host_bytes("nbytes", 600)


def test_measure_host_copy_refuses_64_gib_at_once(monkeypatch):
    import time

    monkeypatch.setattr(T, "_memory_now", lambda: (32 * GiB, 4 * GiB))
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match="host RAM"):
        copies.measure_host_copy(64 * GiB)
    with pytest.raises(ValueError, match="host RAM"):
        copies.sweep(lambda *a: [1e-6], [4 * GiB], device="cpu")  # two 4 GiB buffers
    assert time.perf_counter() - t0 < 5


def test_predict_pinned_block_names_the_real_allocator_option():
    doc = model.predict_pinned_block.__doc__ or ""
    assert "pinned_max_round_threshold_mb" in doc and "PYTORCH_ALLOC_CONF" in doc


@pytest.mark.skipif(not NO_CUDA, reason="checks the no-GPU path")
def test_pinning_status_raises_under_require_gpu(monkeypatch):
    monkeypatch.setenv("WORKBOOK_REQUIRE_GPU", "1")
    with pytest.raises(RuntimeError, match="NVIDIA driver"):
        copies.pinning_status()


def test_measure_host_copy_cuts_blocks_for_slow_copies(monkeypatch):
    import types

    seen = {}
    real = __import__("helpers.core.timing", fromlist=["measure"]).measure

    def spy(fn, **kw):
        seen.update(kw)
        return real(fn, **kw)

    def copies_taking(seconds):  # the host clock advances `seconds` per call: each copy takes that long
        ticks = iter(range(0, 100_000, seconds))
        monkeypatch.setattr(copies, "time", types.SimpleNamespace(perf_counter=lambda: float(next(ticks))))

    monkeypatch.setattr(copies, "measure", spy)  # the name copies looks up
    copies_taking(1)  # 20 s allow 20 one-second copies: more than 15 blocks
    copies.measure_host_copy(64 * KiB)
    assert seen["blocks"] == 15
    copies_taking(2)
    copies.measure_host_copy(64 * KiB)
    assert seen["blocks"] == 6  # 10 two-second copies fit in 20 s, 4 of them untimed
    copies_taking(20)
    copies.measure_host_copy(64 * KiB)
    assert seen["blocks"] == 3  # never fewer than 3 samples


def test_cuda_status_and_the_allocator_counters_on_the_standin_gpu(monkeypatch):
    """With CUDA (the stand-ins): a present GPU is usable, a CPU device is not, and the allocator's counters
    are read from torch.cuda.memory.host_memory_stats under their short names (the value is never shown)."""
    from cuda_standin import fake_cuda

    raw = {"allocated_bytes.current": 4096, "active_bytes.current": 1024, "allocations.current": 2}
    raw.update({"allocated_bytes.peak": 8192, "num_host_alloc": 3, "num_host_free": 1})
    with fake_cuda(devices=2, current=0):
        assert T.cuda_status("cuda:1") == (True, "")
        assert T.cuda_status(None) == (True, "")
        ok, why = T.cuda_status("cpu")
        assert not ok and "not a CUDA device" in why
        with pytest.raises(ValueError):
            T.cuda_status("cuda:2")  # not there
        monkeypatch.setattr(torch.cuda, "init", lambda: None)
        monkeypatch.setattr(torch.cuda.memory, "host_memory_stats", lambda: raw)
        assert T.host_allocator_stats() == {
            "allocated_bytes": 4096,
            "active_bytes": 1024,
            "allocations": 2,
            "num_host_alloc": 3,
            "num_host_free": 1,
        }
        monkeypatch.delattr(torch.cuda.memory, "host_memory_stats")
        assert "has no torch.cuda.memory.host_memory_stats" in T.host_allocator_stats().reason
