"""`benchmarks/bench_step_projections.py` on the CPU at tiny shapes: the rows it writes (numbers mean nothing here;
the GEMV rows need CUDA or `TRITON_INTERPRET=1` and are recorded as errors without them)."""

from __future__ import annotations

import json

from benchmarks import bench_step_projections as bench
from benchmarks import common


def test_rows_on_cpu(tmp_path, monkeypatch):
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(bench, "ouro_shapes", lambda: {"qkv": (96, 32), "o_proj": (32, 32), "gate_up": (128, 32),
                                                        "down_proj": (32, 64)})  # fmt: skip
    bench.main(["--device", "cpu", "--layers", "2", "--replays", "1", "--quick", "--only", "o_proj", "--out", "sp"])
    rows = json.loads((tmp_path / "sp.json").read_text())["rows"]
    assert rows[0]["variant"] == "step" and rows[0]["us_per_layer"] > 0
    assert rows[1]["variant"] == "cublas" and rows[1]["projection"] == "o_proj"
    gemv = rows[2:]
    assert len(gemv) == len(bench.fma_candidates(1, quick=True)) and all(r["variant"] == "gemv" for r in gemv)


def test_norm_warps_rows_and_the_setting_restored(tmp_path, monkeypatch):
    """`--norm-warps` adds one `norm` row per setting after the step row, `--only` with no projection sweeps none, and
    `NORM_TUNING` is what it was after the run."""
    from triton_ops.fused import NORM_TUNING

    monkeypatch.setattr(common, "RESULTS", tmp_path)
    monkeypatch.setattr(bench, "ouro_shapes", lambda: {"qkv": (96, 32), "o_proj": (32, 32), "gate_up": (128, 32),
                                                        "down_proj": (32, 64)})  # fmt: skip
    seen = []
    real = bench.time_plan
    monkeypatch.setattr(bench, "time_plan", lambda *a: seen.append(NORM_TUNING["num_warps"]) or real(*a))
    bench.main(["--device", "cpu", "--layers", "1", "--replays", "1", "--only", "--norm-warps", "1", "8", "--out", "n"])
    rows = json.loads((tmp_path / "n.json").read_text())["rows"]
    assert [(r["variant"], r["config"]) for r in rows] == [("step", None), ("norm", {"num_warps": 1}),
                                                           ("norm", {"num_warps": 8})]  # fmt: skip
    assert seen == [None, 1, 8] and NORM_TUNING["num_warps"] is None


def test_candidates_keep_the_accumulator_in_registers():
    """At most 64 fp32 products per thread (`rows x block_n x block_k / (32 x warps)`), fewer settings for more rows,
    and the in-step sweep's winners among them."""
    for m in (1, 2, 4):
        for c in bench.fma_candidates(m):
            assert m * c["block_n"] * c["block_k"] <= 64 * 32 * c["num_warps"], c
    assert len(bench.fma_candidates(4)) < len(bench.fma_candidates(1))
    picks = [(c["block_n"], c["block_k"], c["num_warps"]) for c in bench.fma_candidates(1)]
    assert (4, 512, 2) in picks and (8, 2048, 8) in picks
    assert bench.ouro_shapes() == {"qkv": (6144, 2048), "o_proj": (2048, 2048), "gate_up": (11264, 2048),
                                   "down_proj": (2048, 5632)}  # fmt: skip
