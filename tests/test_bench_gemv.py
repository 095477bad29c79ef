"""`benchmarks/bench_gemv.py` on the CPU at tiny shapes: the cuBLAS rows (here `F.linear` on the CPU) of every shape
and row count, with errors against fp32 (the kernel rows need CUDA or `TRITON_INTERPRET=1`; numbers mean nothing)."""

from __future__ import annotations

import json

from benchmarks import bench_gemv, common


def test_gemv_rows_on_cpu(tmp_path, monkeypatch):
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    bench_gemv.main(["--device", "cpu", "--shapes", "tiny", "--rows", "1", "16", "--out", "gemv"])
    rows = json.loads((tmp_path / "gemv.json").read_text())["rows"]
    assert [(r["shape"], r["m"], r["provider"]) for r in rows] == [
        ("tiny.a", 1, "cublas"), ("tiny.a", 16, "cublas"), ("tiny.b", 1, "cublas"), ("tiny.b", 16, "cublas")
    ]  # fmt: skip
    assert all(r["us"] > 0 and r["max_err"] < 1e-4 for r in rows)


def test_model_shapes_are_the_released_ones():
    shapes = bench_gemv.model_shapes()
    assert shapes["ouro.qkv"] == (6144, 2048) and shapes["ouro.o_proj"] == (2048, 2048)
    assert shapes["ouro.gate_up"] == (11264, 2048) and shapes["ouro.down_proj"] == (2048, 5632)
    assert shapes["huginn.Wqkv"] == (15840, 5280) and shapes["huginn.mlp_proj"] == (5280, 17920)
