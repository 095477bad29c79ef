"""`benchmarks/bench_dense_read.py` on the CPU (the kernel under `TRITON_INTERPRET=1`, in a subprocess because Triton
reads the variable at import): a row per provider and setting, the kernel's output checked against SDPA's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import bench_dense_read

ROOT = Path(__file__).resolve().parents[1]


def test_rows_under_the_interpreter(tmp_path):
    out = tmp_path / "dr"
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    subprocess.run(
        [sys.executable, "-m", "benchmarks.bench_dense_read", "--device", "cpu", "--context", "80", "--batches", "1",
         "2", "--cells", "2", "--grid", "tile=16,32", "num_warps=4", "num_stages=2", "programs_per_sm=1", "--out",
         str(out)],
        cwd=ROOT, env=env, check=True, capture_output=True, timeout=600,
    )
    rows = json.loads(out.with_suffix(".json").read_text())["rows"]
    assert [(r["batch"], r["provider"], (r["tuning"] or {}).get("tile")) for r in rows] == [
        (b, p, t) for b in (1, 2) for p, t in (("sdpa", None), ("kernel", 16), ("kernel", 32))
    ]
    assert all(r["status"] == "ok" for r in rows)
    assert all(r["max_abs_err_vs_sdpa"] < 1e-5 for r in rows if r["provider"] == "kernel")
    assert rows[0]["bytes_per_cell"] == 2 * 16 * 80 * 128 * 4  # K and V, fp32 on the CPU


def test_grid_items_are_checked():
    assert bench_dense_read.parse_grid(["tile=64", "num_warps=8"])["tile"] == [64]
    with pytest.raises(SystemExit, match="NAME one of"):
        bench_dense_read.parse_grid(["warps=8"])
