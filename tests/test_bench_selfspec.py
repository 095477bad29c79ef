"""`benchmarks/bench_selfspec.py --mode graph` (issue #16, item 5): both ways through the static cache's captured
steps; a CPU dry run (static caches decode eagerly on the CPU; the numbers mean nothing here)."""

from __future__ import annotations

import json

from benchmarks import bench_selfspec as bench
from benchmarks import common


def test_graph_mode_runs_both_ways_over_static_caches(tmp_path, monkeypatch):
    acceptance = str(common.RESULTS / "selfspec_acceptance.json")  # the fixtures' measured acceptance drives the row
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    monkeypatch.setattr(bench, "RESULTS", tmp_path)
    bench.main(
        [
            "--shapes", "micro-huginn", "--caches", "full", "loopkv-kivi4-share", "--batches", "2", "--prompt", "32",
            "--new-tokens", "8", "--seq-tokens", "4", "--mode", "graph", "--device", "cpu", "--out", "smoke",
            "--acceptance-file", acceptance,
        ]
    )
    rows = json.loads((tmp_path / "smoke.json").read_text())["rows"]
    ok = [r for r in rows if r["status"] == "ok"]
    assert [(r["mode"], r["cache"], r["batch"]) for r in ok] == [("graph", "full", 2)]
    assert ok[0]["predicted_speedup_eq8"] > 0 and ok[0]["cost_ratio_verify"] > 0
    assert [r["status"] for r in rows if r["cache"] == "loopkv-kivi4-share"] == ["unsupported"]  # no static LoopKV yet


def test_graph_mode_sizes_the_static_cache_for_holes():
    """A static cache for a row holds the prompt and every block's `gamma + 1` positions (holes included)."""
    from tests.helpers import make_model

    model = make_model("ouro")
    cache = bench.make_cache("ripe64", model, 4, "graph", 8, 100)
    assert cache.static and (cache.max_batch_size, cache.max_cache_len) == (8, 100)
    assert not bench.make_cache("full", model, 4, "eager", 8, 100).static
