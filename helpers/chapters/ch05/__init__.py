"""Chapter 05 · Overlapped asynchronous transfer: the chapter interface. The panel draws one cell of the 2x2
experiment as a timeline (measured on a GPU, else its reference recording or schematic); the benchmark records the
``ch05.*`` keys on a GPU."""

from __future__ import annotations

import dataclasses
from typing import Any

import ipywidgets as W
import torch

from ...core import config, evidence
from ...core.device import has_cuda, resolve_device
from ...core.evidence import Evidence
from ...core.progress import ProgressFn, no_progress, scaled
from ...core.results import ResultSet
from ...core.validate import check_int
from ...pipeline.data import default_sizes, make_shapes_dataset
from . import feeding, gpudecode, hazards, overlap

NUMBER = "05"
TITLE = "overlapping copies with compute"
BENCH_WEIGHT = 1.0
PANEL_TITLE = "Copy/compute overlap"
PANEL_FIGSIZE = (8.5, 3.2)

#: Steps per cell and hazard-3 steps the benchmark records (part of the records' params).
_BENCH_STEPS = 8
_BENCH_SYNC_STEPS = 50


def benchmark(results: ResultSet, device: torch.device | str | None, *, progress: ProgressFn | None = None) -> None:
    """Record chapter 05's GPU measurements (without CUDA nothing: they are all about streams). Keys:

    - ``ch05.overlap.{step,copy,compute}_time`` (s, median per step), ``.fraction`` (share of the shorter activity
      hidden), ``.agrees`` (1 if measured == expected); params ``memory``, ``stream``, ``copy_bytes``, ``matmul_n``,
      ``steps``; artifacts ``ch05.timeline.<memory>.<stream>``: each cell's trace.
    - ``ch05.hazard.d2h_wrong`` / ``.mutation_wrong`` (count; ``variant`` bug/fix, ``n``); ``.syncs`` (``variant``
      hidden/fixed, ``steps``); ``.syncs_per_line`` (one line of the buggy step alone, ``line``).
    - ``ch05.prefetch.batch_time`` (s per batch; ``dtype``, ``prefetcher``, ``batch``, ``image``); ``ch05.decode.*``.
    """
    progress = progress or no_progress
    dev = resolve_device(device)
    if dev.type != "cuda":
        progress(1.0, "no CUDA device: nothing to record")
        return
    for i, (m, s) in enumerate(overlap.CELLS):
        progress(0.4 * i / len(overlap.CELLS), f"2x2 experiment: {m} + {s} stream")
        r = overlap.run_cell(m, s, device=dev, steps=_BENCH_STEPS)
        p: dict[str, Any] = {"memory": m, "stream": s, "copy_bytes": r.copy_bytes, "matmul_n": r.matmul_n}
        p["steps"] = _BENCH_STEPS
        for key, value in (("step", r.step_s), ("copy", r.copy_s), ("compute", r.compute_s)):
            results.add(f"ch05.overlap.{key}_time", value, "s", **p)
        results.add("ch05.overlap.fraction", r.fraction, "ratio", **p)
        results.add(
            "ch05.overlap.agrees", float(bool(r.agrees)), "ratio", measured=r.measured, expected=r.expected, **p
        )
        results.artifacts[overlap.artifact_name(m, s)] = r.trace.to_dict()
    _record_hazards(results, dev, progress)
    progress(0.55, "the reference prefetcher: seconds per batch")
    for (dtype_name, with_pf), sec in feeding.prefetch_step_times(dev).items():
        results.add("ch05.prefetch.batch_time", sec, "s", dtype=dtype_name, prefetcher=with_pf, batch=256, image=128)
    record_decode(results, dev, progress=scaled(progress, 0.7, 1.0, "JPEG decode: "))
    progress(1.0, "done")


def _record_hazards(results: ResultSet, dev: torch.device, progress: ProgressFn) -> None:
    progress(0.4, "hazard 1: a device-to-host copy read before a sync")
    h = hazards.hazard_d2h_read_before_sync(dev)
    for variant, c in (("bug", h.bug), ("fix", h.fix)):
        results.add(h.key, c["wrong elements when read"], "count", variant=variant, n=c["elements copied"])
    progress(0.45, "hazard 2: a pinned source changed too early")
    h = hazards.hazard_pinned_source_mutation(dev)
    for variant, c in (("bug", h.bug), ("fix", h.fix)):
        results.add(h.key, c["elements that arrived wrong"], "count", variant=variant, n=c["elements copied"])
    progress(0.5, "hazard 3: hidden synchronisations")
    h = hazards.hazard_hidden_syncs(dev, steps=_BENCH_SYNC_STEPS)
    for variant, counts in (("hidden", h.bug), ("fixed", h.fix)):
        results.add(h.key, counts["synchronisations"], "count", variant=variant, steps=_BENCH_SYNC_STEPS)
    for line in (".item()", "print(loss)", ".cpu()"):
        results.add("ch05.hazard.syncs_per_line", h.bug[f"{line} alone"], "count", line=line)


def record_decode(
    results: ResultSet,
    device: torch.device | str | None = None,
    *,
    info: Any = None,
    progress: ProgressFn | None = None,
) -> ResultSet:
    """Record :func:`.gpudecode.compare_decode` on the validation split at the mode's sizes into ``results``:
    ``ch05.decode.bytes_per_batch`` (``form``), ``.ms_per_batch`` (``where`` it decoded, ``device`` it ends on,
    ``pinned``; on CUDA with pinned and pageable bytes); CUDA, pinned: ``.speedup`` (CPU path / GPU path),
    ``.mean_abs_diff`` / ``.max_abs_diff`` (0-255 levels against the CPU path, per ``stage``)."""
    dev = resolve_device(device)
    sizes = default_sizes()
    ds = gpudecode.EncodedJpegDataset((info if info is not None else make_shapes_dataset()).val_dir)
    pins = (True, False) if dev.type == "cuda" else (False,)
    for k, pin in enumerate(pins):
        part = scaled(progress, k / len(pins), (k + 1) / len(pins), "pinned bytes: " if pin else "")
        cmp = gpudecode.compare_decode(
            ds, dev, batch_size=sizes["batch_size"], crop_size=sizes["crop_size"], n_batches=8, pin=pin, progress=part
        )
        p: dict[str, Any] = {"batch_size": cmp.batch_size, "crop_size": cmp.crop_size, "image_size": cmp.image_size}
        if k == 0:  # the CPU path and the bytes: the same code in every run
            for form, v in cmp.bytes_per_batch.items():
                spread = {"min": min(v), "max": max(v), "n": len(v)}
                results.add("ch05.decode.bytes_per_batch", cmp.bytes[form], "bytes", spread, form=form, **p)
        timed = [(cmp.cpu_path, "cpu", dev.type, False)] if k == 0 else []
        for t, where, on, pinned in timed + ([(cmp.device_path, "cuda", "cuda", cmp.pinned)] if cmp.on_gpu else []):
            ms = {"iqr": t.iqr_s * 1e3, "n": t.n}
            results.add(
                "ch05.decode.ms_per_batch", t.median_s * 1e3, "ms", ms, where=where, device=on, pinned=pinned, **p
            )
        if cmp.on_gpu and cmp.pinned:
            results.add("ch05.decode.speedup", cmp.speedup, "ratio", pinned=True, **p)
            for stage, (mx, mean) in cmp.diffs.items():
                results.add("ch05.decode.mean_abs_diff", mean, "levels", vs="cpu", stage=stage, **p)
                results.add("ch05.decode.max_abs_diff", mx, "levels", vs="cpu", stage=stage, **p)
    return results


def panel_controls(**context: Any) -> dict[str, Any]:
    """Bytes copied and compute (matrix side) per step, from ``copy=`` and ``compute=``; memory kind, stream."""
    no_gpu = "disabled: no CUDA device, so there is no copy or compute to size here"
    gpu = {"disabled": not has_cuda(), "tooltip": "" if has_cuda() else no_gpu}
    copy, compute = context.get("copy", 64), context.get("compute", 4096)
    return {
        "copy_mib": W.IntSlider(value=copy, min=1, max=config.sized(64, 256), description="copy MiB", **gpu),
        "matmul_n": W.IntSlider(value=compute, min=64, max=8192, step=64, description="compute n", **gpu),
        "memory": W.Dropdown(options=list(overlap.MEMORY_KINDS), value="pinned", description="memory"),
        "stream": W.ToggleButtons(options=list(overlap.STREAM_KINDS), value="side", description="stream"),
    }


def panel_run(
    progress: ProgressFn | None,
    *,
    device: torch.device | str | None,
    copy_mib: int = 64,
    matmul_n: int = 4096,
    memory: str = "pinned",
    stream: str = "side",
    **context: Any,
) -> Evidence[Any]:
    """One cell as an Evidence: measured on CUDA (a CellResult), else its reference recording or its schematic."""
    progress = progress or no_progress
    expected = overlap.expected_label(memory, stream)  # checks memory and stream
    dev = resolve_device(device)
    if dev.type == "cuda":
        res = overlap.run_cell(memory, stream, copy_mib=copy_mib, matmul_n=matmul_n, device=dev, progress=progress)
        return overlap.timeline_evidence(res)
    check_int("copy_mib", copy_mib, 1, 4096)
    check_int("matmul_n", matmul_n, 16, 16384)
    progress(1.0, "no GPU: nothing to run")
    ref, cell = overlap.reference_cell(memory, stream), f"{memory} + {stream} stream"
    if ref:
        sizes = f"recorded at its own sizes, not {copy_mib} MiB / n={matmul_n}"
        return dataclasses.replace(ref, note=f"No CUDA device: showing the reference recording of {cell} ({sizes}).")
    why = f"{overlap.SCHEMATIC}; no reference recording of this cell exists yet"
    note = (
        f"No CUDA device and no reference recording yet: showing a schematic of {cell} "
        f"(expected: {expected}). The sizes are not used without a GPU."
    )
    return dataclasses.replace(evidence.theoretical(ref.what, overlap.schematic_trace(memory, stream), why), note=note)


def panel_summary(result: Evidence[Any]) -> str:
    """The cell's summary (when measured here) or the note, then the provenance header."""
    if isinstance(result.value, overlap.CellResult):
        return f"{result.value.summary()} — {result.header()}"
    return " ".join(part for part in (result.note, result.header()) if part)


def panel_plot(history: list[Any], ax: Any) -> None:
    """The latest run's timeline, labelled with its source."""
    if history:
        overlap.draw_cell(history[-1].result, ax)
