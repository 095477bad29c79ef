"""`benchmarks/bench_flush.py` on the CPU with a micro shape: both flush paths run over every coded cell of a static
kivi4 cache, write the same bytes, and the rows carry the decode step's time and the flush fraction (numbers mean
nothing here; on CUDA the flushes are replayed from a CUDA graph)."""

from __future__ import annotations

import json

import pytest

from benchmarks import bench_flush, common
from hf_loopcache.cache.layers import StaticCodedLayer


def test_flush_rows_for_both_paths(tmp_path, monkeypatch):
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    bench_flush.main(["--shape", "micro-ouro", "--batches", "2", "--context", "400", "--new-tokens", "4", "--device",
                      "cpu", "--out", "flush"])  # fmt: skip
    rows = json.loads((tmp_path / "flush.json").read_text())["rows"]
    assert [(r["path"], r["batch"]) for r in rows] == [("unfused", 2), ("fused", 2)]
    assert all(r["bytes_equal"] and r["coded_cells"] == 8 and r["pages_due"] == 8 for r in rows)
    assert all(r["step_status"] == "ok" and r["step_ms"] > 0 and r["flush_fraction"] > 0 for r in rows)
    assert StaticCodedLayer.flush is not bench_flush.unfused_flush  # the path switch is undone


def test_flush_path_rejects_unknown():
    with pytest.raises(ValueError, match="`path` must be one of"), bench_flush.flush_path("fast"):
        pass
