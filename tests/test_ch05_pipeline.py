"""Chapter 05's pipeline cells, run here as the notebook runs them, and the helpers that check and time them.

The chapter's ``pipeline`` cells (``stats``, ``normalize``, ``side_stream``, ``copy_on``,
``Prefetcher``, ``batches``) are read from the committed notebook and executed on the CPU:
the ``Prefetcher`` through the stream test doubles of :mod:`helpers.chapters.ch05.prefetch`, ``batches``
through its plain path. Broken copies of the ``Prefetcher`` (a line removed) must fail the
exercise check with a message that names the missing line. The chapter module
(:mod:`helpers.chapters.ch05`: the live panel and the benchmark) is tested at the end.
CUDA-only tests are skipped here.
"""

from __future__ import annotations

import functools
import json
import linecache
from typing import Any

import pytest
import torch

from helpers.chapters import ch05
from helpers.chapters.ch05 import feeding, overlap, prefetch
from helpers.core import evidence
from helpers.core.results import ResultSet
from helpers.pipeline import data
from helpers.ui import chapter, codecells, widgets

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
RESTATED_CELL = "c5a1e0b1"  # chapter 05's restatement of chapter 04's pipeline (untagged)


def _cell(cell_id: str) -> str:
    nb = json.loads(codecells.notebook_path("05").read_text(encoding="utf-8"))
    return next("".join(c["source"]) for c in nb["cells"] if c.get("id") == cell_id)


def _namespace(device: str = "cpu") -> dict[str, Any]:
    dev = torch.device(device)

    def to_device(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)

    return {"torch": torch, "functools": functools, "data": data, "DEVICE": dev, "to_device": to_device}


def _pipeline(source: str | None = None, device: str = "cpu") -> dict[str, Any]:
    ns = _namespace(device)
    exec(
        compile(
            source if source is not None else "\n\n".join(codecells.pipeline_cells("05")),
            "<chapter 05 pipeline>",
            "exec",
        ),
        ns,
    )
    return ns


def test_the_pipeline_cells_define_what_the_chapter_teaches() -> None:
    names = set(codecells.pipeline_after("05")) - set(codecells.pipeline_after("04"))
    assert {"stats", "normalize", "side_stream", "copy_on", "Prefetcher", "batches"} <= names | {"batches"}
    code = "\n".join(codecells.pipeline_cells("05"))
    for token in ("torch.cuda.Stream", "wait_stream", "record_stream", "non_blocking=True", "torch.cuda.stream("):
        assert token in code, token


def test_normalize_is_the_workbooks_normaliser_bit_for_bit_and_builds_stats_once() -> None:
    ns = _pipeline()
    x = torch.randint(0, 256, (4, 3, 8, 8), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    assert torch.equal(ns["normalize"](x), data.to_float_normalized(x))
    ns["normalize"](x)
    assert ns["stats"].cache_info().misses == 1  # made once per device, then cached


def test_batches_plain_path_on_cpu_matches_the_float_pipeline() -> None:
    ns = _pipeline()
    g = torch.Generator().manual_seed(1)
    loader = [
        (torch.randint(0, 256, (2, 3, 4, 4), dtype=torch.uint8, generator=g), torch.tensor([i, i])) for i in range(3)
    ]
    got = list(ns["batches"](loader))
    assert len(got) == 3
    for (x, y), (xu, yu) in zip(got, loader):
        assert x.dtype == torch.float32 and torch.equal(x, data.to_float_normalized(xu)) and torch.equal(y, yu)


def test_the_chapters_prefetcher_passes_the_exercise_check_on_cpu() -> None:
    ns = _pipeline()
    for _ in range(2):  # twice: the reader's cached side stream (a test double) must not break a re-run
        res = prefetch.check_pipeline_prefetcher(ns["Prefetcher"], "cpu")
        assert res.correct, str(res)
    log, handed = prefetch.stream_protocol(ns["Prefetcher"], 3)
    assert prefetch.check_protocol(log, handed, 3) == []
    assert "hand over batch 2" in prefetch.format_protocol(log)
    assert all(len(line) <= 105 for line in prefetch.format_protocol(log).splitlines())


BREAKS = {
    "side waits first": ("        self.side.wait_stream(current)", "wait for the current stream before its first copy"),
    "current waits": ("            current.wait_stream(self.side)", "before the current stream waited"),
    "record_stream": ("                t.record_stream(current)", "record_stream"),
}


@pytest.mark.parametrize("what", sorted(BREAKS))
def test_a_prefetcher_with_a_line_removed_fails_and_the_message_names_it(what: str) -> None:
    line, words = BREAKS[what]
    source = "\n\n".join(codecells.pipeline_cells("05"))
    assert line + " " in source or line + "\n" in source, line
    lines = source.splitlines()
    k = next(i for i, ln in enumerate(lines) if ln.startswith(line))
    if what == "record_stream":  # the loop body goes with its `for`
        lines[k - 1 : k + 1] = []
    else:
        lines[k : k + 1] = []
    ns = _pipeline("\n".join(lines))
    res = prefetch.check_pipeline_prefetcher(ns["Prefetcher"], "cpu")
    assert not res.correct and words in str(res), str(res)


def test_the_check_refuses_the_reference_a_pass_through_and_non_answers() -> None:
    assert "reference" in str(prefetch.check_pipeline_prefetcher(prefetch.Prefetcher, "cpu"))
    assert "reference" in str(
        prefetch.check_pipeline_prefetcher(
            lambda loader, device: prefetch.Prefetcher(loader, device, normalize=(data.MEAN, data.STD)), "cpu"
        )
    )
    res = prefetch.check_pipeline_prefetcher(lambda loader, device: iter(loader), "cpu")
    assert not res.correct and "pass-through" in str(res)
    assert not prefetch.check_pipeline_prefetcher(None).correct
    assert not prefetch.check_pipeline_prefetcher(3).correct

    def boom(loader: Any, device: Any) -> Any:
        raise RuntimeError("oops")

    assert "RuntimeError" in str(prefetch.check_pipeline_prefetcher(boom, "cpu"))


def test_stream_doubles_restore_the_torch_api_even_after_an_error() -> None:
    before = (
        torch.cuda.Stream,
        torch.cuda.stream,
        torch.cuda.current_stream,
        torch.Tensor.to,
        torch.Tensor.record_stream,
    )
    with pytest.raises(ValueError), prefetch.stream_doubles():
        assert torch.cuda.Stream is not before[0]
        raise ValueError("inside")
    after = (
        torch.cuda.Stream,
        torch.cuda.stream,
        torch.cuda.current_stream,
        torch.Tensor.to,
        torch.Tensor.record_stream,
    )
    assert after == before
    assert "to" not in vars(torch.Tensor) or vars(torch.Tensor)["to"] is before[3]
    x = torch.ones(2)
    assert x.to(torch.float64).dtype == torch.float64


def test_time_batches_runs_every_way_in_alternating_rounds() -> None:
    order: list[str] = []
    data_ = [(torch.ones(2), torch.zeros(2)) for _ in range(3)]

    def way(name: str) -> Any:
        order.append(name)
        return iter(data_)

    stepped: list[torch.Tensor] = []
    times = feeding.time_batches(
        {"a": lambda: way("a"), "b": lambda: way("b")}, lambda x, y: stepped.append(x), "cpu", rounds=3
    )
    assert order == ["b", "a", "a", "b", "b", "a", "a", "b"]  # warm-up (reversed), then a b, b a, a b
    assert len(stepped) == 3 * len(order) and all(len(v) == 3 for v in times.values.values())  # 3 batches a pass
    assert "median of 3 alternating rounds" in times.report()
    with pytest.raises(ValueError, match="variants"):
        feeding.time_batches({}, lambda x, y: None, "cpu")
    with pytest.raises(ValueError, match="no batches"):
        feeding.time_batches({"empty": lambda: iter([])}, lambda x, y: None, "cpu")
    with pytest.raises(ValueError, match="rounds"):
        feeding.time_batches({"a": lambda: iter(data_)}, lambda x, y: None, "cpu", rounds=0)


def test_show_diff_finds_a_class_defined_in_a_cell_without_input_history() -> None:
    """nbval runs cells with store_history=False: a class is found through its methods' cell file."""
    filename = "<ipython-input-ch05-test>"
    source = "class Prefetcher:\n    def __iter__(self):\n        yield 1\n"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    try:
        ns: dict[str, Any] = {}
        exec(compile(source, filename, "exec"), ns)
        assert codecells.current_source("Prefetcher", ns) == source.rstrip("\n")
    finally:
        del linecache.cache[filename]


def test_the_restated_chapter_04_pipeline_is_chapter_04s() -> None:
    """Chapter 05 restates chapter 04's pipeline so that it runs on its own: it must stay chapter 04's code."""
    before = codecells.pipeline_after("04")
    if not before:
        pytest.skip("chapters 01-04 have no pipeline cells yet (converted in parallel)")
    restated = codecells.definitions(_cell(RESTATED_CELL))
    for name, src in restated.items():
        assert before.get(name) == src, (
            f"chapter 05 restates {name} differently from chapters 01-04: copy it from there into cell {RESTATED_CELL}"
        )


@cuda
def test_the_chapters_prefetcher_on_a_gpu_is_right_race_free_and_overlaps() -> None:
    ns = _pipeline(device="cuda")
    res = prefetch.check_pipeline_prefetcher(ns["Prefetcher"], "cuda")
    assert res.correct, str(res)
    assert "of the copy time hidden behind compute -> overlaps" in str(res)


@cuda
def test_the_pair_race_check_catches_a_missing_wait() -> None:
    source = "\n\n".join(codecells.pipeline_cells("05")).replace(
        "            current.wait_stream(self.side)", "            pass"
    )
    ns = _pipeline(source, device="cuda")
    found = [p for _ in range(3) for p in prefetch.check_pipeline_race(ns["Prefetcher"], "cuda")]
    assert any("wait_stream" in p or "record_stream" in p for p in found), found


@cuda
def test_time_batches_times_the_chapters_pipeline_on_a_gpu() -> None:
    import torch.nn.functional as F

    from helpers.pipeline import models

    ns = _pipeline(device="cuda")
    model = models.build_model().cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    stepped: list[torch.Tensor] = []

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        stepped.append(y)
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss.detach()

    loader = [
        (torch.randint(0, 256, (8, 3, 32, 32), dtype=torch.uint8).pin_memory(), torch.randint(0, 6, (8,)).pin_memory())
        for _ in range(4)
    ]
    times = feeding.time_batches({"prefetcher": lambda: ns["batches"](loader)}, step, "cuda", rounds=2)
    assert len(stepped) == 4 * (1 + 2) and len(times.values["prefetcher"]) == 2  # 4 batches a pass: warm-up, 2 rounds


@cuda
def test_a_step_of_the_chapters_batches_hides_no_synchronisation() -> None:
    """After the first batch (which builds the cached statistics), handing over a batch and queuing
    the next copy never makes the host wait: torch.cuda.set_sync_debug_mode("error") raises if it does."""
    ns = _pipeline(device="cuda")
    g = torch.Generator().manual_seed(0)
    loader = [
        (
            torch.randint(0, 256, (8, 3, 32, 32), dtype=torch.uint8, generator=g).pin_memory(),
            torch.randint(0, 6, (8,), generator=g).pin_memory(),
        )
        for _ in range(4)
    ]
    it = iter(ns["batches"](loader))
    next(it)  # warm-up: stats() copies the mean and std to the device once
    torch.cuda.synchronize()
    old = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        x, y = next(it)
        (x.sum() + y.sum()).detach()
    finally:
        torch.cuda.set_sync_debug_mode(old)
    torch.cuda.synchronize()


# -- the chapter module: live panel and benchmark ---------------------------------


def test_the_chapter_module_follows_the_interface() -> None:
    assert chapter.problems(ch05) == []


def test_panel_without_gpu_shows_reference_or_a_labelled_schematic(monkeypatch, tmp_path) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("WORKBOOK_REFERENCE_DIR", str(tmp_path))
    out = ch05.panel_run(None, device="cpu", memory="pageable", stream="side", copy_mib=2, matmul_n=128)
    assert isinstance(out, evidence.Evidence) and out.kind == "theoretical" and not out.here
    assert "not measured" in out.source and out.value.metadata["kind"] == "schematic, not measured"
    summary = ch05.panel_summary(out)
    assert "no reference recording yet" in summary and "[theoretical]" in summary
    with pytest.raises(ValueError, match="stream"):
        ch05.panel_run(None, device="cpu", memory="pageable", stream="sideways")
    with pytest.raises(ValueError, match="copy_mib"):
        ch05.panel_run(None, device="cpu", copy_mib=0)


def test_panel_without_gpu_shows_the_reference_recording_of_the_cell(monkeypatch, tmp_path) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("WORKBOOK_REFERENCE_DIR", str(tmp_path))
    r = overlap.run_cell("pinned", "side", copy_mib=1, matmul_n=32, steps=2, device="cpu")
    rs = ResultSet(
        name="t",
        method="test",
        provenance={"hardware": {"gpu_name": "TestGPU"}},
        created="2026-01-01T00:00:00+00:00",
        mode="quick",
    )
    rs.artifacts[overlap.artifact_name("pinned", "side")] = r.trace.to_dict()
    rs.save(tmp_path / "ref.json")
    out = ch05.panel_run(None, device="cpu", memory="pinned", stream="side", copy_mib=3, matmul_n=64)
    assert out.kind == "recorded" and "TestGPU" in out.source and "not 3 MiB / n=64" in out.note
    assert "TestGPU" in ch05.panel_summary(out)


def test_the_panel_runs_from_python_as_the_notebook_drives_it(monkeypatch, tmp_path) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("WORKBOOK_REFERENCE_DIR", str(tmp_path))
    panel = widgets.Panel.for_chapter(ch05, device=torch.device("cpu"), copy=2, compute=128)
    assert panel.controls["copy_mib"].value == 2 and panel.controls["matmul_n"].value == 128
    if not torch.cuda.is_available():
        assert panel.controls["copy_mib"].disabled and panel.controls["matmul_n"].disabled
    panel.set(memory="pageable", stream="side", copy_mib=2, matmul_n=128)
    panel.click()
    assert panel.error is None, panel.error
    assert isinstance(panel.last.result, evidence.Evidence) and panel.last.result.kind == "theoretical"
    assert "schematic" in panel.last.summary


def test_benchmark_records_nothing_without_cuda() -> None:
    seen: list[float] = []
    rs = ResultSet(name="t", method="m", provenance={}, created="x", mode="quick")
    ch05.benchmark(rs, "cpu", progress=lambda f, t="": seen.append(f))
    assert rs.records == [] and seen[-1] == 1.0


@cuda
def test_panel_on_a_gpu_is_measured_here() -> None:
    out = ch05.panel_run(None, device="cuda", memory="pinned", stream="side", copy_mib=8, matmul_n=1024)
    assert out.here and isinstance(out.value, overlap.CellResult) and out.value.on_gpu
    assert out.value.summary() in ch05.panel_summary(out)


@cuda
def test_benchmark_on_gpu() -> None:
    rs = ResultSet(name="t", method="m", provenance={}, created="x", mode="quick")
    seen: list[float] = []
    ch05.benchmark(rs, "cuda", progress=lambda f, t="": seen.append(f))
    assert all(k.startswith("ch05.") for k in rs.keys())
    assert {overlap.artifact_name(m, s) for m, s in overlap.CELLS} <= set(rs.artifacts)
    assert seen == sorted(seen) and seen[-1] == 1.0
    want = {
        "ch05.overlap.step_time",
        "ch05.overlap.copy_time",
        "ch05.overlap.compute_time",
        "ch05.overlap.fraction",
        "ch05.overlap.agrees",
        "ch05.hazard.d2h_wrong",
        "ch05.hazard.mutation_wrong",
        "ch05.hazard.syncs",
        "ch05.hazard.syncs_per_line",
        "ch05.prefetch.batch_time",
        "ch05.decode.bytes_per_batch",
        "ch05.decode.ms_per_batch",
        "ch05.decode.speedup",
        "ch05.decode.mean_abs_diff",
        "ch05.decode.max_abs_diff",
    }
    assert set(rs.keys()) == want
