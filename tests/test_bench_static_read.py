"""`benchmarks.bench_static_read --live` on the CPU: the script's rows (the timings are smoke values there)."""

from __future__ import annotations

import json

import pytest

from benchmarks import bench_static_read
from hf_loopcache.cache.layers.static import StaticDenseLayer


def test_live_reads_on_the_cpu(tmp_path):
    bench_static_read.main(["--device", "cpu", "--length", "64", "--live", "8", "64", "--out-dir", str(tmp_path)])
    rows = json.loads((tmp_path / "static_read_live.json").read_text())
    keys = {(r["shape"], r["batch"], r["live"], r["read"]) for r in rows}
    assert keys == {
        (shape, batch, live, read)
        for shape in ("ouro-1.4b", "huginn-0125")
        for batch in (1, 8)
        for live in (8, 64)
        for read in ("sdpa", "kernel")
    }
    assert all(r["capacity"] == 64 and r["us"] > 0 for r in rows)
    assert StaticDenseLayer.read_method == "auto"  # put back
    with pytest.raises(ValueError, match="`--live` counts must be in"):
        bench_static_read.main(["--device", "cpu", "--length", "64", "--live", "65"])
