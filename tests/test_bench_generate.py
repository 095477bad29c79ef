"""`benchmarks/bench_generate.py` on the CPU with micro shapes: every row runs, the plain peer is built for both
architectures, static rows decode the growable cache's tokens, and `--fused` labels its rows (numbers mean nothing
here)."""

from __future__ import annotations

import json

import pytest

from benchmarks import bench_generate, common


@pytest.mark.parametrize("shape", ["micro-ouro", "micro-huginn"])
def test_rows_for_every_mode_and_the_peer(shape, tmp_path, monkeypatch):
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    bench_generate.main(["--shapes", shape, "--caches", "full", "ripe64", "--modes", "eager", "static", "--peers",
                         "dynamic", "--fused", "on", "off", "--batches", "2", "--context", "40", "--new-tokens", "4",
                         "--device", "cpu", "--dtype", "float32", "--out", "gen"])
    rows = json.loads((tmp_path / "gen.json").read_text())["rows"]
    looped = [r for r in rows if r["model"] == "looped"]
    assert len(looped) == 2 * 2 * 2 and all(r["status"] == "ok" for r in rows)
    assert {(r["cache"], r["mode"], r["fused_ops"]) for r in looped} == {
        (c, m, f) for c in ("full", "ripe64") for m in ("eager", "static") for f in (True, False)
    }
    assert all(r["tokens_equal_eager"] for r in looped if r["mode"] == "static")
    peer = [r for r in rows if r["model"] != "looped"]
    assert [r["cache"] for r in peer] == ["dynamic"] and peer[0]["generated"] == 4
    assert all("warmup_s" in r for r in rows)


def test_static_loopkv_rows(tmp_path, monkeypatch):
    """`--caches kivi4 kivi4-share hand --modes eager static`: static LoopKV rows run and decode the growable cache's
    tokens (micro shape, the presets' sink 32 and window 256: a 326-token prompt codes one page)."""
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    bench_generate.main(["--shapes", "micro-ouro", "--caches", "kivi4", "kivi4-share", "hand", "--modes", "eager",
                         "static", "--batches", "2", "--context", "330", "--new-tokens", "4", "--device", "cpu",
                         "--dtype", "float32", "--out", "gen"])
    rows = json.loads((tmp_path / "gen.json").read_text())["rows"]
    assert {(r["cache"], r["mode"]) for r in rows} == {
        (c, m) for c in ("kivi4", "kivi4-share", "hand") for m in ("eager", "static")
    }
    assert all(r["status"] == "ok" for r in rows)
    assert all(r["tokens_equal_eager"] for r in rows if r["mode"] == "static")


def test_pdl_rows_compare_with_pdl_off(tmp_path, monkeypatch):
    """`--pdl off on`: a row per setting, the switch restored after each; on the CPU no launch takes it (`pdl` False
    in both rows, so no `tokens_equal_pdl_off`), and with the gate simulated on, the second row compares its tokens
    with the first's."""
    from triton_ops._dispatch import PDL

    monkeypatch.setattr(common, "RESULTS", tmp_path)
    before = PDL["enabled"]
    argv = ["--shapes", "micro-ouro", "--caches", "full", "--modes", "static", "--pdl", "off", "on", "--batches", "1",
            "--context", "24", "--new-tokens", "3", "--device", "cpu", "--dtype", "float32", "--out", "gen"]
    bench_generate.main(argv)
    rows = json.loads((tmp_path / "gen.json").read_text())["rows"]
    assert [r["pdl"] for r in rows] == [False, False] and PDL["enabled"] is before
    assert not any("tokens_equal_pdl_off" in r for r in rows)
    monkeypatch.setattr(bench_generate, "pdl_options", lambda t: {"USE_PDL": PDL["enabled"]})
    bench_generate.main(argv)
    rows = json.loads((tmp_path / "gen.json").read_text())["rows"]
    assert [r["pdl"] for r in rows] == [False, True] and rows[1]["tokens_equal_pdl_off"] is True
    assert rows[1]["first_mismatch_pdl_off"] is None and PDL["enabled"] is before


def test_defer_stop_rows_compare_with_it_off(tmp_path, monkeypatch):
    """`--defer-stop off on`: a row per setting, each `generate` called with it, and the second row compares its
    tokens with the first's."""
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    seen = []
    original = bench_generate.run_one

    def run_one(*args, **kwargs):
        seen.append(kwargs["defer_stop"])
        return original(*args, **kwargs)

    monkeypatch.setattr(bench_generate, "run_one", run_one)
    bench_generate.main(["--shapes", "micro-ouro", "--caches", "full", "--modes", "static", "--defer-stop", "off",
                         "on", "--batches", "1", "--context", "24", "--new-tokens", "3", "--device", "cpu", "--dtype",
                         "float32", "--out", "gen"])
    rows = json.loads((tmp_path / "gen.json").read_text())["rows"]
    assert seen == [False, True] and [r["defer_stop"] for r in rows] == [False, True]
    assert rows[1]["tokens_equal_defer_stop_off"] is True and "tokens_equal_defer_stop_off" not in rows[0]


def test_fuse_kv_rows_compare_with_it_off(tmp_path, monkeypatch):
    """`--fuse-kv off on`: a row per setting of `GEMV_TUNING["fuse_kv"]` (restored after each), the second row
    comparing its tokens with the first's."""
    from triton_ops.gemv import GEMV_TUNING

    monkeypatch.setattr(common, "RESULTS", tmp_path)
    before = GEMV_TUNING["fuse_kv"]
    bench_generate.main(["--shapes", "micro-ouro", "--caches", "full", "--modes", "static", "--fuse-kv", "off", "on",
                         "--batches", "1", "--context", "24", "--new-tokens", "3", "--device", "cpu", "--dtype",
                         "float32", "--out", "gen"])
    rows = json.loads((tmp_path / "gen.json").read_text())["rows"]
    assert [r["fuse_kv"] for r in rows] == [False, True] and GEMV_TUNING["fuse_kv"] is before
    assert rows[1]["tokens_equal_fuse_kv_off"] is True and "tokens_equal_fuse_kv_off" not in rows[0]


def test_vprec_lookback_rows_compare_with_it_off(tmp_path, monkeypatch):
    """`--vprec-lookback off on`: a row per setting of `ROW1_TUNING["vprec_lookback"]` over the V-precision cache
    (restored after each), the second row comparing its tokens with the first's."""
    from triton_ops.coded_attention.ops import ROW1_TUNING

    monkeypatch.setattr(common, "RESULTS", tmp_path)
    bench_generate.main(["--shapes", "micro-ouro", "--caches", "kivi4-vp", "--modes", "static", "--vprec-lookback",
                         "off", "on", "--batches", "1", "--context", "24", "--new-tokens", "3", "--device", "cpu",
                         "--dtype", "float32", "--out", "gen"])  # fmt: skip
    rows = json.loads((tmp_path / "gen.json").read_text())["rows"]
    assert [r["vprec_lookback"] for r in rows] == [False, True] and ROW1_TUNING["vprec_lookback"] is False
    assert rows[1]["tokens_equal_vprec_lookback_off"] is True and "tokens_equal_vprec_lookback_off" not in rows[0]


def test_plot_rows_keep_a_labelled_file_apart(tmp_path):
    """`plot_generate`'s `path=LABEL` (an A/B run as two processes): the labelled file's rows are drawn beside the
    other file's under their own name, where the same configuration in two plain files is drawn once (the later)."""
    import json

    from benchmarks.plot_generate import _rows

    row = {"status": "ok", "shape": "ouro-1.4b", "model": "looped", "cache": "ripe64", "mode": "graph", "batch": 1,
           "context": 8192, "decode_tokens_per_s": 1.0}  # fmt: skip
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps({"rows": [row]}))
    b.write_text(json.dumps({"rows": [{**row, "decode_tokens_per_s": 2.0}]}))
    assert [r["decode_tokens_per_s"] for r in _rows([str(a), str(b)])] == [2.0]
    got = sorted((r["cache"], r["decode_tokens_per_s"]) for r in _rows([f"{a}=patched", str(b)]))
    assert got == [("ripe64", 2.0), ("ripe64, patched", 1.0)]


def test_a_short_warm_up_reads_the_storage_as_the_timed_steps(monkeypatch):
    """A static cache's short warm-up prompt grows, on CUDA, to the shortest one whose decode steps take the dense read
    the timed run's first step takes (`dense_read`: a captured step is keyed by it), so no step is captured inside
    the timed run; elsewhere, or when both already agree, it stays as asked."""
    from hf_loopcache.cache.layers.static import StaticDenseLayer

    assert bench_generate.warmup_length(320, 8176, 8192, cuda=True) == 5461  # 5,462 held > 2/3 of 8,192: cuDNN
    assert bench_generate.warmup_length(320, 8176, 8192, cuda=False) == 320  # the CPU reads by SDPA at every length
    assert bench_generate.warmup_length(320, 4000, 8192, cuda=True) == 320  # both read by the kernel
    monkeypatch.setattr(StaticDenseLayer, "read_method", "sdpa")
    assert bench_generate.warmup_length(320, 8176, 8192, cuda=True) == 320
