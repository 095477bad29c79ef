"""`benchmarks.bench_head_dim` on the CPU (the kernels under `TRITON_INTERPRET=1`, in a subprocess: the interpreter is
chosen at import): every (queries, head dim, provider) row, the bytes it reads, and the argument check."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_rows_and_bytes_under_the_interpreter(tmp_path):
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    out = tmp_path / "hd"
    args = ["--device", "cpu", "--heads", "2", "--batch", "1", "--history", "32", "--head-dims", "64", "96"]
    args += ["--queries", "1", "2", "--out", str(out)]
    subprocess.run([sys.executable, "-m", "benchmarks.bench_head_dim", *args], env=env, cwd=ROOT, check=True)
    rows = json.loads(out.with_suffix(".json").read_text())["rows"]
    assert [(r["queries"], r["head_dim"], r["provider"]) for r in rows] == [
        (q, d, p) for q in (1, 2) for d in (64, 96) for p in ("int4", "bf16")
    ]
    for r in rows:
        dense = 2 * r["head_dim"] * 2 * 2 * (4 + 256 + r["queries"])  # sink 4, window 256, new tokens
        per_token = r["head_dim"] * (1 + 8 / 32) if r["provider"] == "int4" else r["head_dim"] * 4
        assert r["bytes_read"] == int(2 * 32 * per_token + dense) and r["us"] > 0


def test_history_must_be_whole_pages():
    from benchmarks import bench_head_dim

    with pytest.raises(SystemExit):
        bench_head_dim.main(["--device", "cpu", "--history", "40"])
