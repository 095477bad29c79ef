"""`benchmarks/profile_selfspec.py` and `benchmarks/profile_verify.py` (issue #16: where a block's time goes): CPU dry
runs of both command lines (no CUDA events on the CPU, so the kernel tables are empty and only the structure and the
host-side ranges are checked) and the phase attribution of `profile_selfspec._events` on synthetic events."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from torch.autograd import DeviceType

from benchmarks import bench_selfspec, profile_selfspec, profile_verify
from hf_loopcache.cache.base import LoopCache


def _event(name, start, end, cuda=False, self_cpu=0.0):
    return SimpleNamespace(
        name=name, device_type=DeviceType.CUDA if cuda else DeviceType.CPU, self_cpu_time_total=self_cpu,
        time_range=SimpleNamespace(start=start, end=end),
    )  # fmt: skip


def test_events_give_each_kernel_the_phase_it_starts_in():
    """A kernel belongs to the phase range it starts in (drafts, verification, prefill), else to `other`; the
    profiler's GPU-side copy of a range is no kernel (counting it doubled a phase's GPU time); times per block."""
    events = [
        _event("self_speculative::prefill_time_s", 0, 10),
        _event("self_speculative::draft_time_s", 10, 40),
        _event("self_speculative::verify_time_s", 40, 60),
        _event("self_speculative::draft_time_s", 60, 90),
        _event("self_speculative::verify_time_s", 90, 110),
        _event("self_speculative::verify_time_s", 90, 110, cuda=True),  # the range as the profiler shows it on the GPU
        _event("gemm", 1, 9, cuda=True),
        _event("attn", 12, 20, cuda=True),
        _event("attn", 62, 70, cuda=True),
        _event("attn", 41, 51, cuda=True),
        _event("attn", 95, 101, cuda=True),
        _event("fill", 111, 112, cuda=True),
        _event("cudaGraphLaunch", 12, 13),
        _event("aten::argmax", 50, 52, self_cpu=2.0),
    ]
    out = profile_selfspec._events(SimpleNamespace(events=lambda: events), blocks=2)
    phases = out["phases"]
    assert set(phases) == {"prefill_time_s", "draft_time_s", "verify_time_s", "other"}
    assert phases["draft_time_s"]["kernels"] == [("attn", 8.0, 1.0)]
    assert phases["verify_time_s"]["kernels"] == [("attn", 8.0, 1.0)]
    assert phases["prefill_time_s"]["kernels"] == [("gemm", 4.0, 0.5)]
    assert phases["other"]["kernels"] == [("fill", 0.5, 0.5)]
    assert phases["draft_time_s"]["wall_ms"] == pytest.approx(0.03)  # (30 + 30) us over 2 blocks
    assert phases["verify_time_s"]["gpu_ms"] == pytest.approx(0.008)
    assert out["gpu_sum_ms"] == round(41 / 2 / 1000, 3)
    assert out["runtime"] == [("cudaGraphLaunch", 0.5, 0.5)] and out["aten"] == [("aten::argmax", 1.0, 0.5)]


def test_profile_selfspec_on_the_cpu(tmp_path, monkeypatch):
    acceptance = str(profile_selfspec.RESULTS / "selfspec_acceptance.json")
    monkeypatch.setattr(profile_selfspec, "RESULTS", tmp_path)
    profile_selfspec.main(
        ["--shape", "micro-ouro", "--caches", "full", "loopkv-kivi4-share-verify-int4", "--batch", "2", "--prompt", "64",
         "--new-tokens", "6", "--device", "cpu", "--out", "p", "--acceptance-file", acceptance]
    )  # fmt: skip
    data = json.loads((tmp_path / "p.json").read_text())
    assert data["draft_loops"] == 2
    measured = bench_selfspec.load_acceptance(acceptance, 4)
    # a cache named in `ACCEPTANCE_AS` takes its other name's row
    assert measured[("tiny-ouro", "loopkv-kivi4-share-vprec-blocks")] == measured[("tiny-ouro", "loopkv-kivi4-share")]
    for name, row in data["rows"].items():
        assert row["alpha"] == measured[("tiny-ouro", name)]  # the fixture's acceptance with the same cache
        assert row["blocks"] > 0 and row["wall_ms"] > 0
        assert {"prefill_time_s", "draft_time_s", "verify_time_s"} <= set(row["phases"])
        assert all(row["phases"][p]["wall_ms"] > 0 and row["phases"][p]["kernels"] == [] for p in row["phases"])
    with pytest.raises(ValueError, match="--alpha"):
        profile_selfspec.main(["--shape", "micro-ouro", "--alpha", "1.5", "--device", "cpu"])
    with pytest.raises(ValueError, match="no measured acceptance.*--alpha"):
        profile_selfspec.main(["--shape", "micro-ouro", "--block-size", "5", "--device", "cpu",
                               "--acceptance-file", acceptance])  # fmt: skip


def test_profile_verify_through_the_captured_step_runner_on_the_cpu(tmp_path, monkeypatch):
    """`--graph` goes through `model.get_compiled_call` (eager on the CPU), `--capacity` sizes the static cache,
    `--rollback` sets its rollback reserve; the three forwards (step, draft, verification block) per cache, each
    run as the decoder runs it (`cache.speculating()`), the prefill not."""
    monkeypatch.setattr(profile_verify, "RESULTS", tmp_path)
    seen = []
    begin = LoopCache.begin_forward

    def spy(self, layout, num_loops, query_length):
        seen.append((query_length, self.is_speculating))
        return begin(self, layout, num_loops, query_length)

    monkeypatch.setattr(LoopCache, "begin_forward", spy)
    profile_verify.main(
        ["--shape", "micro-ouro", "--caches", "loopkv-kivi4-share-verify-int4", "--batch", "2", "--prompt", "64",
         "--capacity", "100", "--rollback", "4", "--graph", "--device", "cpu", "--out", "v"]
    )  # fmt: skip
    data = json.loads((tmp_path / "v.json").read_text())
    assert (data["capacity"], data["graph"], data["draft_loops"], data["rollback"]) == (100, True, 2, 4)
    assert set(data["rows"]) == {f"loopkv-kivi4-share-verify-int4 {k}" for k in ("q1", "draft2", "q5")}
    assert data["forwards"]["draft2"]["new_tokens"] == 1 and data["forwards"]["draft2"]["num_loops"] == 2
    assert seen[0] == (64, False) and {s for _, s in seen[1:]} == {True} and {q for q, _ in seen[1:]} == {1, 5}
    with pytest.raises(ValueError, match="--rollback"):
        profile_verify.main(["--shape", "micro-ouro", "--rollback", "-1", "--device", "cpu"])
    with pytest.raises(ValueError, match="--capacity"):
        profile_verify.main(["--shape", "micro-ouro", "--prompt", "64", "--capacity", "65", "--device", "cpu"])
