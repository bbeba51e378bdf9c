"""Tests for helpers.chapters.ch05.gpudecode: JPEG bytes to decoded batches (CPU here; GPU tests skip without CUDA)."""

from __future__ import annotations

import io
import pickle
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from cuda_standin import fake_cuda

from helpers.chapters.ch05 import gpudecode as G
from helpers.core.timing import Timing
from helpers.pipeline.data import ImageDecodeError, ShapesDataset, make_shapes_dataset

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="module")
def info(tmp_path_factory):
    """A tiny generated data set: 48 + 24 JPEGs of 40x40 pixels."""
    return make_shapes_dataset(n_train=48, n_val=24, image_size=40, root=tmp_path_factory.mktemp("shapes"))


def _jpeg(h: int, w: int, seed: int = 0, quality: int = 90) -> torch.Tensor:
    from PIL import Image

    rng = np.random.default_rng(seed)
    arr = rng.integers(0, 256, size=(h, w, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr, "RGB").save(buf, format="JPEG", quality=quality)
    return torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)


def _pillow(t: torch.Tensor) -> torch.Tensor:
    from PIL import Image

    with Image.open(io.BytesIO(t.numpy().tobytes())) as im:
        return torch.from_numpy(np.array(im.convert("RGB"))).permute(2, 0, 1).contiguous()


# -- dataset and collate ---------------------------------------------------------------


def test_dataset_returns_the_file_bytes_and_labels(info):
    ds = G.EncodedJpegDataset(info.val_dir)
    ref = ShapesDataset(info.val_dir, augment=False)
    assert len(ds) == info.n_val == len(ref)
    assert ds.samples == ref.samples and ds.classes == ref.classes
    data, label = ds[3]
    assert data.dtype == torch.uint8 and data.dim() == 1
    assert data.numpy().tobytes() == Path(ds.path(3)).read_bytes()
    assert label == ref.samples[3][1]
    assert "EncodedJpegDataset(24 files" in repr(ds)
    with pytest.raises(IndexError):
        ds[len(ds)]


def test_dataset_pickles(info):
    ds = G.EncodedJpegDataset(info.val_dir)
    ds2 = pickle.loads(pickle.dumps(ds))
    assert ds2.samples == ds.samples
    assert torch.equal(ds2[5][0], ds[5][0])


def test_collate():
    a, b = _jpeg(8, 8), _jpeg(16, 8, seed=1)
    enc, labels = G.collate_encoded([(a, 2), (b, 5)])
    assert isinstance(enc, list) and enc[0] is a and enc[1] is b
    assert labels.dtype == torch.int64 and labels.tolist() == [2, 5]
    with pytest.raises(ValueError, match="items"):
        G.collate_encoded([])
    with pytest.raises(ValueError, match="item 0"):
        G.collate_encoded([a])


@pytest.mark.timeout(180)
def test_loader_with_a_spawned_worker(info):
    ds = G.EncodedJpegDataset(info.val_dir)
    loader = torch.utils.data.DataLoader(
        ds, batch_size=8, num_workers=1, multiprocessing_context="spawn", collate_fn=G.collate_encoded
    )
    batches = list(loader)
    assert len(batches) == 3
    enc, labels = batches[0]
    assert len(enc) == 8 and labels.tolist() == [ds[i][1] for i in range(8)]
    assert all(torch.equal(enc[i], ds[i][0]) for i in range(8))


# -- decode_batch ------------------------------------------------------------------------


def test_decode_batch_matches_the_pillow_pipeline(info):
    ds = G.EncodedJpegDataset(info.val_dir)
    enc = [ds[i][0] for i in range(6)]
    x = G.decode_batch(enc, "cpu", 32)
    assert x.shape == (6, 3, 32, 32) and x.dtype == torch.uint8 and x.device.type == "cpu"
    assert x.is_contiguous()
    ref = torch.stack(
        [ShapesDataset(info.val_dir, crop_size=32, augment=False, output="uint8")[i][0] for i in range(6)]
    )
    diff = (x.int() - ref.int()).abs()
    assert diff.max() <= 3 and diff.float().mean() < 0.5  # libjpeg-turbo both ways; 0 when the builds agree


def test_decode_batch_mixed_sizes_equals_pillow_plus_resize_crop():
    from torchvision.transforms import v2

    enc = [_jpeg(48, 64, seed=0), _jpeg(40, 40, seed=1), _jpeg(48, 64, seed=2), _jpeg(70, 30, seed=3)]
    x = G.decode_batch(enc, "cpu", 24)
    tf = v2.Compose([v2.Resize(24, antialias=True), v2.CenterCrop(24)])
    for i, t in enumerate(enc):
        diff = (x[i].int() - tf(_pillow(t)).int()).abs()
        assert diff.max() <= 3, i


def test_decode_batch_bad_arguments():
    enc = [_jpeg(16, 16)]
    with pytest.raises(ValueError, match="crop_size"):
        G.decode_batch(enc, "cpu", 4)
    with pytest.raises(ValueError, match="encoded"):
        G.decode_batch([], "cpu", 16)
    with pytest.raises(ValueError, match="encoded"):
        G.decode_batch(enc[0], "cpu", 16)  # a tensor, not a list of them
    with pytest.raises(ValueError, match="1-D uint8"):
        G.decode_batch([torch.zeros(4, 4, dtype=torch.uint8)], "cpu", 16)
    with pytest.raises(ValueError, match="device"):
        G.decode_batch(enc, "meta", 16)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA device"):
            G.decode_batch(enc, "cuda", 16)


def test_corrupt_items_are_named(tmp_path):
    info = make_shapes_dataset(n_train=8, n_val=8, image_size=32, root=tmp_path)
    ds = G.EncodedJpegDataset(info.val_dir)
    victim = Path(ds.path(2))
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])  # truncated
    with pytest.raises(ImageDecodeError, match=str(victim.name)):
        ds[2]  # the worker-side check names the file
    names = [ds.path(i) for i in range(4)]  # the bytes as read, past the data set's own check
    enc = [torch.frombuffer(bytearray(Path(n).read_bytes()), dtype=torch.uint8) for n in names]
    with pytest.raises(ImageDecodeError, match=r"item 2 of the batch .*" + victim.name + ".*truncated"):
        G.decode_batch(enc, "cpu", 16, names=names)
    with pytest.raises(ImageDecodeError, match="item 2 of the batch"):
        G.decode_batch(enc, "cpu", 16)
    # Not a JPEG at all
    with pytest.raises(ImageDecodeError, match="FF D8"):
        G.decode_batch([torch.tensor(list(b"\x89PNG\r\n\x1a\n0000"), dtype=torch.uint8)], "cpu", 16)
    # Markers intact but the header damaged: the decoder itself fails, and the item is named
    bad = enc[0].clone()
    bad[2:40] = 7
    with pytest.raises(ImageDecodeError, match="item 1 of the batch"):
        G.decode_batch([enc[1], bad], "cpu", 16)
    # An empty file
    victim.write_bytes(b"")
    with pytest.raises(ImageDecodeError, match="empty"):
        ds[2]


def test_check_jpeg_tolerates_bytes_after_the_end_marker():
    t = _jpeg(16, 16)
    G.check_jpeg(torch.cat([t, torch.zeros(100, dtype=torch.uint8)]))
    with pytest.raises(ImageDecodeError, match="FF D9"):
        G.check_jpeg(t[:-2])


def test_deprecation_warning_is_silenced_only_inside():
    enc = [_jpeg(16, 16)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        G.decode_batch(enc, "cpu", 8)
    assert not [w for w in caught if G.TORCHVISION_DEPRECATION in str(w.message)]
    from torchvision.io import decode_jpeg

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        decode_jpeg(enc[0])  # outside our calls the warning is untouched
    import torchvision

    if tuple(int(v) for v in torchvision.__version__.split("+")[0].split(".")[:2]) >= (0, 29):
        assert any(G.TORCHVISION_DEPRECATION in str(w.message) for w in caught)


def test_cuda_branch_with_a_stand_in_decoder(monkeypatch):
    """The CUDA branch's logic (one batched call, culprit search), with torchvision's decoder standing in for nvJPEG."""
    import torchvision.io as tio

    real = tio.decode_jpeg
    calls: list[tuple[int, torch.device]] = []
    events: list[str] = []
    fail_always = {"on": False}

    class FakeStream:
        def __init__(self, device):
            self.device = device

        def synchronize(self):
            events.append(f"sync {self.device}")

    def stand_in(inp, mode=tio.ImageReadMode.UNCHANGED, device="cpu", apply_exif_orientation=False):
        if torch.device(device).type != "cuda":
            return real(inp, mode=mode)
        assert isinstance(inp, list) and all(t.device.type == "cpu" for t in inp)  # the documented contract
        calls.append((len(inp), torch.device(device)))
        events.append("decode")
        if fail_always["on"]:
            raise RuntimeError("decode_jpegs_cuda.cpp:42, simulated nvJPEG failure")
        return [real(t, mode=mode) for t in inp]  # like nvJPEG: one bad item fails the whole call

    def patch():
        monkeypatch.setattr(tio, "decode_jpeg", stand_in)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: FakeStream(device))

    patch()
    enc = [_jpeg(16, 16, seed=i) for i in range(3)]
    x = G.decode_batch(enc, "cuda", 8, pin=False)
    assert calls == [(3, torch.device("cuda"))]  # one batched call for the whole batch
    # The caller's stream is synchronised before the decoder writes (pytorch/vision PR #9606).
    assert len(events) == 2 and events[0].startswith("sync cuda") and events[1] == "decode", events
    monkeypatch.undo()
    assert torch.equal(x, G.decode_batch(enc, "cpu", 8))

    patch()
    bad = enc[1].clone()
    bad[2:40] = 7
    with pytest.raises(ImageDecodeError, match=r"item 1 of the batch \(b\.jpg\).*batched GPU decode failed on it"):
        G.decode_batch([enc[0], bad, enc[2]], "cuda", 8, pin=False, names=["a.jpg", "b.jpg", "c.jpg"])
    fail_always["on"] = True
    with pytest.raises(ImageDecodeError, match="every item decodes on the CPU: simulated nvJPEG failure"):
        G.decode_batch(enc, "cuda", 8, pin=False)


# -- bytes and the comparison --------------------------------------------------------


def test_batch_bytes_are_exact(info):
    ds = G.EncodedJpegDataset(info.val_dir)
    cmp = G.compare_decode(ds, "cpu", batch_size=5, crop_size=24, n_batches=2, repeats=1)
    for k in range(2):
        files = sum(Path(ds.path(i)).stat().st_size for i in range(5 * k, 5 * k + 5))
        assert cmp.bytes_per_batch["jpeg"][k] == files
        assert cmp.bytes_per_batch["uint8"][k] == 5 * 3 * 24 * 24
        assert cmp.bytes_per_batch["float32"][k] == 4 * cmp.bytes_per_batch["uint8"][k]


def test_compare_decode_on_cpu(info):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ds = G.EncodedJpegDataset(info.val_dir)
    cmp = G.compare_decode(ds, "cpu", batch_size=8, crop_size=32, n_batches=2, repeats=1)
    assert cmp.n_batches == 2 and cmp.image_size == 40 and not cmp.on_gpu and not cmp.pinned
    assert set(cmp.bytes) == set(G.FORMS) and all(len(v) == 2 for v in cmp.bytes_per_batch.values())
    assert cmp.bytes["uint8"] == 8 * 3 * 32 * 32 and cmp.bytes["float32"] == 4 * cmp.bytes["uint8"]
    assert cmp.diffs["decode+resize"][0] == 0  # both paths are the same CPU decode here
    assert (cmp.diffs["decode"][0], cmp.diffs["resize"][0]) == (0, 0)
    assert cmp.cpu_path.n == 2 and cmp.device_path.n == 2
    assert "send JPEG bytes, decode on the device (CPU decode, same code path)" in cmp.report()
    fig = G.plot_comparison(cmp)
    assert len(fig.axes) == 2
    plt.close(fig)
    with pytest.raises(ValueError, match="batch_size"):
        G.compare_decode(ds, "cpu", batch_size=100, crop_size=32)
    with pytest.raises(ValueError, match="dataset"):
        G.compare_decode(ShapesDataset(info.val_dir), "cpu")


def test_gpu_reference_none_then_found(tmp_path, monkeypatch):
    from helpers.core import evidence
    from helpers.core.evidence import REFERENCE_ENV
    from helpers.core.results import ResultSet

    def recall():
        return evidence.measure_or_recall(
            "decoding JPEGs on the GPU",
            "cpu",
            measure=lambda: pytest.fail("measured without CUDA"),
            key="ch05.decode.ms_per_batch",
            convert=G.cuda_records,
        )

    monkeypatch.setenv(REFERENCE_ENV, str(tmp_path))
    none = recall()
    assert not none and "No reference results" in str(none) and "ch05.decode.ms_per_batch" in str(none)
    rs = ResultSet.new("ref", "test")
    p = {"batch_size": 64, "crop_size": 224, "image_size": 256}
    rs.add("ch05.decode.ms_per_batch", 5.0, "ms", where="cpu", device="cpu", pinned=False, **p)  # a CPU run
    rs.save(tmp_path / "cpu.json")
    assert not recall()  # a CPU recording is not a GPU's
    rs = ResultSet.new("ref", "test")
    rs.add(
        "ch05.decode.ms_per_batch",
        9.0,
        "ms",
        spread={"iqr": 0.5, "n": 8},
        where="cpu",
        device="cuda",
        pinned=False,
        **p,
    )
    rs.add(
        "ch05.decode.ms_per_batch",
        2.0,
        "ms",
        spread={"iqr": 0.1, "n": 8},
        where="cuda",
        device="cuda",
        pinned=True,
        **p,
    )
    rs.save(tmp_path / "ref.json")
    ev = recall()
    assert ev.kind == "recorded" and ev.source.startswith("Recorded on") and "No CUDA device" in ev.note
    flat = " ".join("\n".join(ev.lines(G.gpu_decode_lines)).split())  # a row may wrap at 105 characters
    assert flat.index("send uint8 · batch 64, 256 px -> 224: 9.00 ms") < flat.index("(nvJPEG, pinned bytes) · batch 64")
    assert "(nvJPEG, pinned bytes) · batch 64, 256 px -> 224: 2.00 ms per batch (IQR 0.10)" in flat


def test_record_decode_keys_are_prefixed(tmp_path):
    from helpers.chapters import ch05
    from helpers.core.results import ResultSet

    info = make_shapes_dataset(n_train=8, n_val=64, image_size=32, root=tmp_path)  # 2 batches at the mode's size
    rs = ResultSet.new("t", "test")
    ch05.record_decode(rs, "cpu", info=info)
    keys = rs.keys()
    assert keys == ["ch05.decode.bytes_per_batch", "ch05.decode.ms_per_batch"]
    forms = {r.params["form"] for r in rs.find("ch05.decode.bytes_per_batch")}
    assert forms == set(G.FORMS)
    (ms,) = rs.find("ch05.decode.ms_per_batch")
    assert ms.params["where"] == "cpu" and ms.unit == "ms" and ms.value > 0


def test_chapter_benchmark_still_records_nothing_on_cpu():
    from helpers.chapters import ch05
    from helpers.core.results import ResultSet

    rs = ResultSet.new("t", "test")
    ch05.benchmark(rs, "cpu")
    assert rs.records == []


def test_diff_stats_and_the_gpu_diff_report():
    a = [torch.tensor([[0, 10]], dtype=torch.uint8), torch.tensor([[255]], dtype=torch.uint8)]
    b = [torch.tensor([[2, 10]], dtype=torch.uint8), torch.tensor([[250]], dtype=torch.uint8)]
    assert G._diff_stats(a, b) == (5, pytest.approx(7 / 3))
    cmp = G.DecodeComparison(
        device="cuda:0",
        on_gpu=True,
        batch_size=1,
        crop_size=8,
        image_size=8,
        n_batches=1,
        bytes_per_batch={},
        cpu_path=Timing("a", 0.002, 0.0, 0.002, 0.002, 0.002, 1),
        device_path=Timing("b", 0.001, 0.0, 0.001, 0.001, 0.001, 1),
        pinned=True,
        diffs={"decode+resize": (4, 0.5), "decode": (3, 0.4), "resize": (1, 0.1)},
    )
    text = "\n".join(G.gpu_decode_lines(cmp))
    assert "CPU path / GPU path = 2.00" in text
    assert "decode alone" in text and "resize alone" in text and "both" in text and "largest   1" in text


# -- GPU ---------------------------------------------------------------------------------


@cuda
def test_gpu_decode_matches_cpu_decode(info):
    ds = G.EncodedJpegDataset(info.val_dir)
    enc = [ds[i][0] for i in range(8)]
    cpu = G.decode_batch(enc, "cpu", 32)
    for pin in (True, False):
        x = G.decode_batch(enc, "cuda", 32, pin=pin)
        assert x.device.type == "cuda" and x.shape == cpu.shape and x.dtype == torch.uint8
        diff = (x.cpu().int() - cpu.int()).abs().float()
        assert diff.mean() < 6, diff.mean()  # nvJPEG's IDCT and chroma upsampling differ from libjpeg-turbo
    pinned = [t.pin_memory() for t in enc]
    assert torch.equal(G.decode_batch(pinned, "cuda", 32), G.decode_batch(enc, "cuda", 32))


@cuda
def test_gpu_decode_names_a_corrupt_item(info):
    ds = G.EncodedJpegDataset(info.val_dir)
    enc = [ds[i][0] for i in range(4)]
    enc[3] = enc[3][: enc[3].numel() // 2]
    with pytest.raises(ImageDecodeError, match="item 3 of the batch"):
        G.decode_batch(enc, "cuda", 16)
    bad = ds[0][0].clone()
    bad[2:40] = 7
    with pytest.raises(ImageDecodeError, match="item 1 of the batch"):
        G.decode_batch([ds[1][0], bad], "cuda", 16)


@cuda
def test_gpu_record_decode_records_both_paths(tmp_path):
    from helpers.chapters import ch05
    from helpers.core.results import ResultSet

    rs = ResultSet.new("t", "test")
    ch05.record_decode(rs, "cuda", info=make_shapes_dataset(n_train=8, n_val=64, image_size=32, root=tmp_path))
    wheres = {(r.params["where"], r.params["pinned"]) for r in rs.find("ch05.decode.ms_per_batch")}
    assert wheres == {("cpu", False), ("cuda", True), ("cuda", False)}
    for k in ("ch05.decode.speedup", "ch05.decode.mean_abs_diff", "ch05.decode.max_abs_diff"):
        assert rs.find(k), k
    assert {r.params["stage"] for r in rs.find("ch05.decode.mean_abs_diff")} == {"decode", "resize", "decode+resize"}


@cuda
def test_gpu_pixel_difference_is_measured_apart(info):
    ds = G.EncodedJpegDataset(info.val_dir)
    cmp = G.compare_decode(ds, "cuda", batch_size=8, crop_size=32, n_batches=1, repeats=1)
    assert cmp.diffs["decode"][1] < 6  # nvJPEG's IDCT and chroma upsampling against libjpeg-turbo
    assert cmp.diffs["resize"][0] <= 3  # float against integer rounding of the same pixels
    assert "decode alone" in "\n".join(G.gpu_decode_lines(cmp))


@cuda
def test_gpu_decode_does_not_overwrite_memory_the_callers_stream_still_reads(info):
    """pytorch/vision PR #9606's race: a block freed on the caller's stream while a queued kernel
    still reads it must not be handed to the decoder. decode_batch synchronises the caller's
    stream first, so the queued reduction sees its own values."""
    ds = G.EncodedJpegDataset(info.val_dir)
    enc = [ds[i][0] for i in range(8)]
    G.decode_batch(enc, "cuda", 32)  # warm-up: the nvJPEG handle exists
    n_bytes = sum(3 * 40 * 40 for _ in enc)  # at least as large as the decoded images
    wrong = 0
    for _ in range(20):
        victim = torch.full((n_bytes // 4 + 1024,), 1.0, device="cuda")
        torch.cuda._sleep(50_000_000)  # the GPU is busy: the sum below is only queued
        total = victim.sum()
        del victim  # freed on the caller's stream while the sum still has to read it
        G.decode_batch(enc, "cuda", 32)
        wrong += int(total.item() != n_bytes // 4 + 1024)
    assert wrong == 0


def test_the_bytes_are_staged_in_one_pinned_buffer_with_the_cuda_stand_ins():
    """decode_batch's pinned staging (CUDA only), with the CUDA stand-ins: one pinned buffer, one view per file."""
    enc = [_jpeg(8, 8, seed=0), _jpeg(16, 8, seed=1)]
    with fake_cuda(devices=1) as cuda:
        views = G._staged(enc)
        assert [v.tolist() for v in views] == [t.tolist() for t in enc]
        assert views[0]._base is views[1]._base and cuda.is_pinned(views[0]._base)
        pinned = [t.pin_memory() for t in enc]
        assert all(a is b for a, b in zip(G._staged(pinned), pinned))  # pinned already: used as they are
