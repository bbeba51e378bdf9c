"""Tests for helpers.chapters.ch06.doctor: the pure decision, and real pipelines built to be each kind of bound."""

from __future__ import annotations

import time

import pytest
import torch
from torch.utils.data import DataLoader

from helpers.chapters.ch06 import diagnosis
from helpers.chapters.ch06 import doctor as D


class SyntheticImages(torch.utils.data.Dataset):
    """``n`` random float images of ``size x size``, each costing ``delay_s`` seconds of busy CPU work to "load"
    (busy, like decoding, so workers would compete for cores as real loading does)."""

    def __init__(self, n: int = 256, size: int = 32, delay_s: float = 0.0) -> None:
        self.n, self.size, self.delay_s = n, size, delay_s

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        _busy(self.delay_s)
        g = torch.Generator().manual_seed(int(index))
        img = torch.randint(0, 256, (3, self.size, self.size), dtype=torch.uint8, generator=g)
        return img.float().div_(255).sub_(0.5).div_(0.25), int(index) % 4


def _busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


class BusyStep:
    """A step function that spends ``seconds`` of busy CPU time per call (and counts calls)."""

    def __init__(self, seconds: float = 0.0) -> None:
        self.seconds, self.calls = seconds, 0

    def __call__(self, batch: object) -> None:
        self.calls += 1
        _busy(self.seconds)


def facts(**kw):
    base = dict(
        loader_type="DataLoader",
        num_workers=0,
        pin_memory=False,
        persistent_workers=False,
        cpu_count=8,
        device_type="cpu",
        batch_bytes=3 * 2**20,
        batch_dtype="float32",
        batch_shape=(64, 3, 64, 64),
        float_image_batch=True,
        batch_pinned=False,
    )
    base.update(kw)
    return D.PipelineFacts(**base)


def m(wait, h2d, compute, **kw):
    f = kw.pop("facts", facts())
    return D.Measurements(steps=10, wait_s=wait, h2d_s=h2d, compute_s=compute, facts=f, **kw)


# -- the pure decision -------------------------------------------------------------


def test_data_bound_in_process_ranks_raise_workers_first_with_concrete_numbers() -> None:
    d = D.decide(m(0.040, 0.0, 0.010))
    assert d.verdict == "data-bound"
    top = d.recommendations[0]
    assert top.action == "raise num_workers from 0 to 4"  # ceil(40 / 10) = 4, 8 cores
    assert "8 usable cores" in top.evidence and top.gain_s == pytest.approx(0.040)


def test_worker_suggestion_is_capped_by_cores() -> None:
    d = D.decide(m(0.100, 0.0, 0.010, facts=facts(cpu_count=3)))
    assert d.recommendations[0].action == "raise num_workers from 0 to 3"


def test_compute_bound_verdict_and_advice() -> None:
    d = D.decide(m(0.0005, 0.0, 0.050))
    assert d.verdict == "compute-bound"
    assert d.recommendations[0].stage == "compute"
    assert any("would not speed" in n for n in d.notes)


def test_transfer_bound_from_injected_cuda_measurements() -> None:
    # A CPU cannot show a transfer-bound loop: inject measured phase times from a CUDA-like case.
    f = facts(device_type="cuda", num_workers=8, persistent_workers=True, prefetch_factor=2)
    d = D.decide(m(0.001, 0.030, 0.010, facts=f, pinned_h2d_s=0.012))
    assert d.verdict == "transfer-bound"
    actions = [r.action for r in d.recommendations]
    assert actions[0].startswith("pin memory")  # saves 18 ms, measured
    assert d.recommendations[0].gain_s == pytest.approx(0.018)
    assert any(a.startswith("send uint8") for a in actions)
    assert any("prefetcher" in a for a in actions)


def test_pinned_uint8_prefetched_pipeline_gets_no_transfer_advice() -> None:
    f = facts(
        device_type="cuda",
        num_workers=8,
        pin_memory=True,
        persistent_workers=True,
        prefetch_factor=2,
        float_image_batch=False,
        batch_dtype="uint8",
        uses_prefetcher=True,
    )
    d = D.decide(m(0.0002, 0.001, 0.050, facts=f))
    assert d.verdict == "compute-bound"
    assert all(r.stage != "transfer" for r in d.recommendations)


def test_workers_hide_loading_below_the_threshold() -> None:
    f = facts(num_workers=4, persistent_workers=True, prefetch_factor=2)
    d = D.decide(m(0.0005, 0.0, 0.020, facts=f))
    assert d.stage_times["data"] is None and d.verdict == "compute-bound"
    f = facts(num_workers=2, persistent_workers=True, prefetch_factor=2)
    d = D.decide(m(0.020, 0.0, 0.010, facts=f))
    assert d.verdict == "data-bound" and d.stage_times["data"] == pytest.approx(0.030)
    assert d.recommendations[0].action == "raise num_workers from 2 to 6"  # 2 x 30 ms per batch / 10 ms


def test_persistent_workers_advice_uses_the_first_batch_time() -> None:
    f = facts(num_workers=2, persistent_workers=False, prefetch_factor=2, batches_per_epoch=10)
    d = D.decide(m(0.0, 0.0, 0.010, facts=f, first_batch_s=0.5))
    rec = [r for r in d.recommendations if r.action == "set persistent_workers=True"]
    assert rec and rec[0].gain_s == pytest.approx(0.05)


def test_decide_rejects_bad_measurements() -> None:
    with pytest.raises(ValueError, match="wait_s"):
        D.decide(m(-1.0, 0.0, 0.01))
    with pytest.raises(ValueError, match="nothing was timed"):
        D.decide(m(0.0, 0.0, 0.0))


# -- real pipelines on this machine ------------------------------------------------


def test_real_data_bound_pipeline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(D, "usable_cores", lambda: 4)  # a multi-core machine, whatever CI has
    loader = DataLoader(SyntheticImages(64, 16, delay_s=0.004), batch_size=8)  # 32 ms per batch
    step = BusyStep(0.001)
    diag = D.diagnose(loader, step, "cpu", steps=4, warmup=1)
    assert diag.verdict == "data-bound"
    assert diag.recommendations[0].action.startswith("raise num_workers from 0 to ")
    assert diag.shares["wait"] > 0.5 and step.calls == 5
    assert "DATA-BOUND" in str(diag) and str(diag).startswith("Verdict")
    assert max(len(line) for line in str(diag).splitlines()) <= diagnosis.LINE_WIDTH  # long lines wrapped at words
    assert "raise num_workers from 0 to " in " ".join(str(diag).split())
    from IPython.lib.pretty import pretty

    assert pretty(diag) == str(diag)  # a bare ``diag`` in a notebook shows the report (chapter 06's text says so)
    assert repr(diag) == "Diagnosis(verdict='data-bound', recommendations=%d)" % len(diag.recommendations)


def test_real_compute_bound_pipeline() -> None:
    loader = DataLoader(SyntheticImages(64, 8), batch_size=8)
    diag = D.diagnose(loader, BusyStep(0.03), "cpu", steps=4, warmup=1)
    assert diag.verdict == "compute-bound"
    assert diag.measurements.compute_s * 1e3 >= 30


def test_works_on_a_plain_list_and_a_step_that_copies_itself() -> None:
    batches = [(torch.randn(4, 3, 8, 8), torch.zeros(4, dtype=torch.long)) for _ in range(3)]
    diag = D.diagnose(batches, BusyStep(0.01), "cpu", steps=5, warmup=1, transfer="none")
    assert diag.verdict == "compute-bound"
    assert diag.measurements.facts.num_workers is None
    assert any("restarted" in n for n in diag.notes)


def test_time_limit_stops_a_hanging_step() -> None:
    loader = [torch.zeros(2)] * 4
    with pytest.raises(D.DoctorTimeout, match="step_fn"):
        D.diagnose(loader, BusyStep(5.0), "cpu", steps=3, warmup=0, time_limit_s=0.5)


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="steps"):
        D.diagnose([1], BusyStep(), steps=0)
    with pytest.raises(ValueError, match="transfer"):
        D.diagnose([1], BusyStep(), transfer="fast")
    with pytest.raises(ValueError, match="no batches"):
        D.diagnose([], BusyStep())


# -- strict GPU runs (WORKBOOK_REQUIRE_GPU=1) never swallow a CUDA error ------------------


def _broken_cuda(*args, **kwargs):
    raise RuntimeError("CUDA error: an illegal memory access was encountered")


def test_pinned_probe_falls_back_only_outside_a_strict_gpu_run(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(D, "map_tensors", _broken_cuda)  # doctor's name for helpers.pipeline.prefetch.map_tensors
    batch = (torch.zeros(2, 3, 4, 4), torch.zeros(2, dtype=torch.long))
    cuda = torch.device("cuda")
    monkeypatch.delenv("WORKBOOK_REQUIRE_GPU", raising=False)
    assert D._pinned_probe(batch, cuda) is None  # a reader's run: the diagnosis goes on without the figure
    monkeypatch.setenv("WORKBOOK_REQUIRE_GPU", "1")
    with pytest.raises(RuntimeError, match="illegal memory access"):
        D._pinned_probe(batch, cuda)
    loader = DataLoader(SyntheticImages(16, 8), batch_size=8)  # on a CPU the doctor takes no CUDA path at all
    assert D.diagnose(loader, BusyStep(), "cpu", steps=2, warmup=0).measurements.pinned_h2d_s is None


def test_time_calls_times_n_calls_after_the_warm_ones() -> None:
    """The one phase timer the doctor's probe and the waterfall's stages alone share: the kernel's time_calls."""
    from helpers.core.timing import time_calls

    calls: list[int] = []
    times = time_calls(lambda: calls.append(1), repeats=3, device=torch.device("cpu"), warmup=2).times_s
    assert len(times) == 3 and len(calls) == 5 and all(t >= 0 for t in times)


def test_is_pinned_error_is_raised_in_a_strict_gpu_run(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.Tensor, "is_pinned", _broken_cuda)
    batch = (torch.zeros(2, 3, 4, 4), torch.zeros(2, dtype=torch.long))
    monkeypatch.delenv("WORKBOOK_REQUIRE_GPU", raising=False)
    f = facts(device_type="cuda", batch_pinned=False)
    D._describe_batch(batch, f)
    assert f.batch_pinned is None
    monkeypatch.setenv("WORKBOOK_REQUIRE_GPU", "1")
    with pytest.raises(RuntimeError, match="illegal memory access"):
        D._describe_batch(batch, facts(device_type="cuda"))


def test_the_advice_agrees_with_the_waterfall_it_follows() -> None:
    """Issue #28.2: the doctor ran after a waterfall that measured workers slower must not recommend them."""
    from helpers.chapters.ch06 import capstone as C
    from helpers.core.timing import SpanTrace

    spec = C.job_spec("data-bound")

    def _result(name: str, times: list[float]) -> C.ConfigResult:  # one configuration's rounds, made up
        return C.ConfigResult(
            name=name,
            label=name,
            settings=C.Settings(),
            spec=spec,
            epoch_s=sorted(times)[1],
            steps=3,
            samples=24,
            accuracy=0.5,
            train_loss=1.0,
            trace=SpanTrace(spans=[], metadata={}),
            compute_busy=0.5,
            data_stall=0.5,
            round_epoch_s=times,
        )

    wf = C.Waterfall(
        "data-bound",
        spec,
        "cpu",
        [
            _result("baseline", [1.0, 1.01, 1.0]),
            _result("workers", [1.2, 1.22, 1.21]),  # slower than the baseline in every round, beyond the noise
            _result("persistent", [1.2, 1.3, 1.1]),  # within noise
        ],
        rounds=3,
        not_measured=["pinned", "uint8", "prefetcher"],
    )
    measured = wf.step_verdicts()
    assert measured["workers"] == "slower" and measured["persistent"] == "within noise"
    alone = D.decide(m(0.040, 0.0, 0.010))
    assert any(r.step == "workers" for r in alone.recommendations)  # the measured phase times alone: add workers
    d = D.decide(m(0.040, 0.0, 0.010), measured=measured)
    assert d.verdict == "data-bound"
    assert not any(r.step == "workers" or "num_workers" in r.action for r in d.recommendations)
    assert any("Not recommended here" in n and "'workers'" in n for n in d.notes)
    with_workers = D.decide(m(0.002, 0.0, 0.010, first_batch_s=0.5, facts=facts(num_workers=2)), measured=measured)
    (persist,) = [r for r in with_workers.recommendations if r.step == "persistent"]
    assert persist.gain_s is None and "within noise" in persist.evidence  # no saving the measurement did not see
    kept = D.decide(m(0.040, 0.0, 0.010), measured={"workers": "slower", "persistent": "gain"})
    top = kept.recommendations[0]  # workers that restart each epoch measured slower, persistent ones a gain
    assert top.step == "persistent" and top.action.endswith("with persistent_workers=True")
    gained = D.decide(m(0.040, 0.0, 0.010), measured={"workers": "gain"})
    assert gained.recommendations[0].step == "workers" and "measured this step ('workers'): gain" in (
        gained.recommendations[0].evidence
    )
    with pytest.raises(ValueError, match="measured"):
        D.decide(m(0.040, 0.0, 0.010), measured={"workers": 1.2})  # type: ignore[dict-item]


@pytest.mark.parametrize("pin", [True, False])
def test_copy_seconds_sends_the_batch_as_the_caller_asks(pin: bool) -> None:
    """The one copy timer of the doctor's pinned probe and the waterfall's copy alone (CUDA stand-in): every timed
    call copies each tensor host-to-device, from pinned memory and non-blocking when ``pin``, plain otherwise."""
    from cuda_standin import fake_cuda

    batch = (torch.zeros(2, 3, 4, 4, dtype=torch.uint8), torch.zeros(2, dtype=torch.long))
    with fake_cuda(devices=1) as cuda:
        seconds = D.copy_seconds(batch, torch.device("cuda"), pin=pin, repeats=3, warmup=1)
    copies = cuda.ops("copy")
    assert seconds > 0 and len(copies) == 2 * (3 + 1)  # two tensors, three timed calls and one warm-up
    assert all(c["direction"] == "h2d" and c["src_pinned"] is pin and c["non_blocking"] is pin for c in copies)
