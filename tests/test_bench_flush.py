"""`benchmarks/bench_flush.py` on the CPU with a micro shape: the three flush paths run over every coded cell of a
static kivi4 cache, write the same bytes, and the rows carry the timings, the decode step's time and the flush fraction
(numbers mean nothing here; on CUDA the flushes are replayed from a CUDA graph)."""

from __future__ import annotations

import json

import pytest

from benchmarks import bench_flush, common
from hf_loopcache.cache.layers import StaticCodedLayer
from hf_loopcache.cache.layers.static_coded import FlushGroup


def test_flush_rows_for_every_path(tmp_path, monkeypatch):
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    slots, group = StaticCodedLayer._coded_slots, FlushGroup.flush
    bench_flush.main(["--shape", "micro-ouro", "--batches", "2", "--context", "400", "--new-tokens", "4", "--device",
                      "cpu", "--caches", "kivi4", "--paths", *bench_flush.PATHS, "--out", "flush"])  # fmt: skip
    rows = json.loads((tmp_path / "flush.json").read_text())["rows"]
    assert [(r["cache"], r["path"], r["batch"]) for r in rows] == [("kivi4", p, 2) for p in bench_flush.PATHS]
    assert all(r["bytes_equal"] and r["coded_cells"] == 8 and r["pages_due"] == 8 for r in rows)
    assert all(r["step_status"] == "ok" and r["step_ms"] > 0 and r["flush_fraction"] > 0 for r in rows)
    assert all(r[k] > 0 for r in rows for k in ("graph_ms", "graph_warm_ms", "eager_ms"))
    assert rows[-1]["mean_step_flush_ms"] > 0 and rows[-1]["mean_flush_fraction"] > 0
    # the path switches are undone
    assert StaticCodedLayer.flush is not bench_flush.unfused_flush and StaticCodedLayer._coded_slots is slots
    assert FlushGroup.flush is group


def test_flush_path_rejects_unknown():
    with pytest.raises(ValueError, match="`path` must be one of"), bench_flush.flush_path("fast"):
        pass
