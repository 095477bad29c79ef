"""benchmarks/bench_capacity.py without a GPU: the search over batch sizes (a fake probe), a row on a micro model with
out-of-memory raised above a batch, and the command line."""

from __future__ import annotations

import json

import pytest
import torch

import benchmarks.common as common
from benchmarks import bench_capacity
from benchmarks.bench_capacity import run_cache, search
from benchmarks.common import build


def _fits_up_to(k: int, calls: list[int]):
    def try_batch(b: int) -> dict:
        calls.append(b)
        return {"batch": b, "status": "ok" if b <= k else "oom", "peak_gib": 0.1 * b}

    return try_batch


@pytest.mark.parametrize("k", [1, 5, 17, 40, 100])
@pytest.mark.parametrize("start", [1, 7, 20, 64])
def test_search_finds_the_largest_batch_that_fits(k, start):
    calls: list[int] = []
    largest, probes = search(_fits_up_to(k, calls), start, resolution=0.0, max_probes=50)
    assert largest == k
    assert calls[0] == start  # the prediction is probed first
    assert len(calls) == len(set(calls)) == len(probes)  # no batch probed twice
    assert any(p["status"] == "oom" and p["batch"] == k + 1 for p in probes)  # the boundary is shown from both sides


def test_search_with_nothing_fitting_returns_zero():
    calls: list[int] = []
    assert search(_fits_up_to(0, calls), 9, resolution=0.0)[0] == 0
    assert calls[-1] == 1


def test_search_stops_at_the_resolution_the_probe_limit_and_the_deadline():
    calls: list[int] = []
    largest, _ = search(_fits_up_to(1000, calls), 100, resolution=0.05)
    assert 1000 * 0.95 <= largest <= 1000
    calls = []
    largest, probes = search(_fits_up_to(1000, calls), 100, resolution=0.0, max_probes=3)
    assert len(probes) == 3 and largest == max(b for b in calls if b <= 1000)
    calls = []
    assert search(_fits_up_to(1000, calls), 100, out_of_time=lambda b: True) == (0, [])
    assert search(_fits_up_to(9, calls), 4, known={4: {"batch": 4, "status": "ok"}})[0] == 9
    assert 4 not in calls  # a known probe is not repeated


@torch.no_grad()
def test_a_row_on_a_micro_model_with_out_of_memory_above_a_batch(monkeypatch):
    """Real generates at batches 1..3 on the CPU; above 3, `generate` raises `torch.OutOfMemoryError` (as CUDA would):
    the row reports 3, the probes on both sides, the prediction from batch 1's stored bytes, and decode tok/s."""
    model = build("micro-ouro", torch.float32, "cpu")
    real = model.generate

    def generate(ids, *args, **kwargs):
        if ids.shape[0] > 3:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB (fake)")
        return real(ids, *args, **kwargs)

    calls: list[int] = []
    monkeypatch.setattr(model, "generate", lambda ids, *a, **kw: calls.append(ids.shape[0]) or generate(ids, *a, **kw))
    row = run_cache(
        model, "micro-ouro", "ripe64", 96, budget_bytes=2**30, weights_bytes=0, new_tokens=4, device="cpu",
        resolution=0.0,
    )
    assert row["largest_batch"] == 3 and row["smallest_failing_batch"] == 4
    assert row["predicted_batch"] > 3  # 1 GiB budget: the prediction is far above, the search comes down
    # the per-row brackets lie below the bytes-only prediction; the modelled one counts less than all of batch 1's
    assert row["predicted_batch_workspace_per_row"] <= row["predicted_batch_row_workspace"] <= row["predicted_batch"]
    assert {p["status"] for p in row["probes"]} == {"ok", "oom"}
    assert row["probes"][0]["batch"] == 1 and row["stored_gib_per_row"] > 0
    assert row["stored_bytes_per_token"] == pytest.approx(row["stored_bytes_per_token_model"], rel=0.25)
    assert row["decode_tokens_per_s_at_largest"] > 0
    assert row["fit_per_row_gib"] is not None
    assert calls[:2] == [1, 1] and row["warmup_s"] >= 0  # an untimed batch-1 warm-up (compiles), then the probe
    written: list[dict] = []
    late = run_cache(
        model, "micro-ouro", "full", 96, budget_bytes=2**30, weights_bytes=0, new_tokens=4, device="cpu",
        out_of_time=lambda seconds: seconds > 0, progress=written.append,
    )  # no time for a probe after batch 1's: the row says so and keeps batch 1
    assert late["largest_batch"] == 1 and late["status"].startswith("deadline: the search stopped before a probe")
    assert [p["batch"] for p in late["probes"]] == [1] and written == []


def test_prefill_row_bytes_of_the_real_shapes():
    """The per-row prefill workspace the modelled bracket uses, in the real shapes (bf16, 8K): Ouro-1.4B holds its input
    and output and one cell's keys and values (2,048 wide each) plus RoPE tables; Huginn-0125 also its injected
    embeddings (5,280 wide; 55 heads of 96, fp32 RoPE angles)."""
    with torch.device("meta"):
        ouro = common.SHAPES["ouro-1.4b"]().to(torch.bfloat16)
        huginn = common.SHAPES["huginn-0125"]().to(torch.bfloat16)
    assert bench_capacity.prefill_row_bytes(ouro, 8192) == ((2 * 2048 + 2 * 2048) * 2 + 2 * 128 * 2) * 8192
    assert bench_capacity.prefill_row_bytes(huginn, 8192) == ((3 * 5280 + 2 * 5280) * 2 + 96 * 4) * 8192
    assert round(bench_capacity.prefill_row_bytes(ouro, 8192) / 2**20) == 132
    assert round(bench_capacity.prefill_row_bytes(huginn, 8192) / 2**20) == 416


def test_command_line_writes_rows_and_names_bad_arguments(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    bench_capacity.main(
        ["--shapes", "micro-ouro", "--caches", "full", "--contexts", "64", "--new-tokens", "3", "--device", "cpu",
         "--dtype", "float32", "--budget-gib", "0.01", "--out", "cap", "--max-probes", "4"]
    )
    rows = json.loads((tmp_path / "cap.json").read_text())["rows"]
    assert [r["cache"] for r in rows] == ["full"] and rows[0]["largest_batch"] >= 1
    limit = 0.01 - rows[0]["weights_gib"]  # off CUDA the budget is emulated: a peak above it counts as out of memory
    assert all(p["peak_gib"] <= limit + 1e-3 for p in rows[0]["probes"] if p["status"] == "ok")
    assert all(p["peak_gib"] > limit - 1e-3 for p in rows[0]["probes"] if p["status"] == "oom")
    with pytest.raises(SystemExit, match="--new-tokens must be >= 2"):
        bench_capacity.main(["--new-tokens", "1", "--device", "cpu", "--budget-gib", "1"])
    with pytest.raises(SystemExit, match="--budget-gib is required off CUDA"):
        bench_capacity.main(["--device", "cpu"])
    with pytest.raises(SystemExit, match="--contexts must each exceed --new-tokens"):
        bench_capacity.main(["--device", "cpu", "--budget-gib", "1", "--contexts", "4"])


def test_prefill_rows_reaches_every_probe_and_the_model(monkeypatch):
    """`prefill_rows` goes to every probe's `generate` and into the row; the modelled bracket then counts the per-row
    prefill workspace for one group (a generate's prefill holds nothing else per row)."""
    model = build("micro-ouro", torch.float32, "cpu")
    real = model.generate
    seen: list = []
    monkeypatch.setattr(model, "generate", lambda *a, **kw: seen.append(kw.get("prefill_rows")) or real(*a, **kw))
    common_kwargs = dict(budget_bytes=2**23, weights_bytes=0, new_tokens=4, device="cpu", max_probes=2)
    whole = run_cache(model, "micro-ouro", "ripe64", 96, **common_kwargs)
    assert whole["prefill_rows"] is None and set(seen) == {None}
    seen.clear()
    grouped = run_cache(model, "micro-ouro", "ripe64", 96, prefill_rows=2, **common_kwargs)
    assert grouped["prefill_rows"] == 2 and set(seen) == {2}
    assert grouped["predicted_batch_row_workspace"] > whole["predicted_batch_row_workspace"]
    with pytest.raises(SystemExit, match="--prefill-rows must be a positive int"):
        bench_capacity.main(["--device", "cpu", "--budget-gib", "1", "--prefill-rows", "0"])
