"""`benchmarks/bench_selfspec.py --mode graph` (issue #16, item 5): both ways through the static cache's captured
steps; a CPU dry run (static caches decode eagerly on the CPU; the numbers mean nothing here)."""

from __future__ import annotations

import json

from benchmarks import bench_selfspec as bench
from benchmarks import common
from hf_loopcache.generation import expected_block_tokens


def test_graph_mode_runs_both_ways_over_static_caches(tmp_path, monkeypatch):
    acceptance = str(common.RESULTS / "selfspec_acceptance.json")  # the fixtures' measured acceptance drives the row
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    monkeypatch.setattr(bench, "RESULTS", tmp_path)
    bench.main(
        [
            "--shapes", "micro-huginn", "--caches", "full", "loopkv-kivi4-share", "--batches", "2", "--prompt", "32",
            "--new-tokens", "8", "--mode", "graph", "--device", "cpu", "--out", "smoke",
            "--acceptance-file", acceptance,
        ]
    )
    rows = json.loads((tmp_path / "smoke.json").read_text())["rows"]
    ok = [r for r in rows if r["status"] == "ok"]
    assert [(r["mode"], r["cache"], r["batch"]) for r in ok] == [("graph", "full", 2)]
    assert ok[0]["predicted_speedup_eq8"] > 0 and ok[0]["cost_ratio_verify"] > 0
    # both ways timed directly over every token of every row (no scaled or subtracted decode time)
    assert ok[0]["sequential_decode_s"] > 0 and ok[0]["speculative_decode_s"] > 0
    assert ok[0]["sequential_tokens"] == ok[0]["speculative_tokens"] == 2 * 7 == ok[0]["sequential_steps_measured"] * 2
    assert len(ok[0]["row_acceptance"]) == len(ok[0]["row_verifications"]) == 2
    assert max(ok[0]["row_verifications"]) == ok[0]["verifications"]
    assert ok[0]["predicted_speedup_eq8_batch"] > 0 and ok[0]["predicted_speedup_eq8_batch_pooled"] > 0
    assert [r["status"] for r in rows if r["cache"] == "loopkv-kivi4-share"] == ["unsupported"]  # no static LoopKV yet


def test_graph_mode_sizes_the_static_cache_for_holes():
    """A static cache for a row holds the prompt and every block's `gamma + 1` positions (holes included)."""
    from tests.helpers import make_model

    model = make_model("ouro")
    cache = bench.make_cache("ripe64", model, 4, "graph", 8, 100)
    assert cache.static and (cache.max_batch_size, cache.max_cache_len) == (8, 100)
    assert not bench.make_cache("full", model, 4, "eager", 8, 100).static


def test_batch_tokens_per_verification_is_n_over_the_expected_slowest_row():
    """The batch prediction behind `predicted_speedup_eq8_batch`: exact at alpha 0 and 1, Eq. 7 for long runs at batch
    1, lower for the slowest of several rows, and equal to a simulation of rows that each accept drafts
    independently (what batched verification with per-row lengths does) and finish when their `n` tokens are in."""
    import random

    gamma = 4
    assert bench.batch_tokens_per_verification([1.0], gamma, 20) == 20 / 4  # ceil(20 / 5) verifications
    assert bench.batch_tokens_per_verification([0.0] * 8, gamma, 20) == 1.0
    long_run = bench.batch_tokens_per_verification([0.7], gamma, 400)
    assert abs(long_run - expected_block_tokens(0.7, gamma)) < 0.01 * long_run
    one, eight = (bench.batch_tokens_per_verification([0.7] * b, gamma, 30) for b in (1, 8))
    assert eight < 0.9 * one
    rng = random.Random(0)
    alphas, n, trials, total = [0.5, 0.7, 0.9], 12, 4000, 0
    for _ in range(trials):
        worst = 0
        for a in alphas:
            have = t = 0
            while have < n:
                k = 0
                while k < gamma and rng.random() < a:
                    k += 1
                have, t = have + k + 1, t + 1
            worst = max(worst, t)
        total += worst
    assert abs(bench.batch_tokens_per_verification(alphas, gamma, n) - n / (total / trials)) < 0.02 * n / (total / trials)


def test_accounting_counts_every_row_over_the_decode_time():
    """Throughput is committed tokens of all rows (after the prefill's) over the directly timed decode; the
    speed-up is the ratio of the two throughputs; the cost ratios come from the phase run."""
    from hf_loopcache import SpeculativeStats
    from tests.helpers import make_model

    seq = SpeculativeStats(phase_timing=False, verifications=9, decode_time_s=0.9, row_tokens=[10, 10])
    spec = SpeculativeStats(phase_timing=False, verifications=3, decode_time_s=0.45, row_tokens=[10, 10])
    spec.reached, spec.accepted = [6, 5, 4, 3], [5, 4, 3, 3]
    spec.row_reached, spec.row_accepted, spec.row_verifications_by_row = [9, 9], [8, 7], [3, 3]
    phase = SpeculativeStats(verifications=3, draft_forwards=12, draft_time_s=0.12, verify_time_s=0.33)
    row = bench._accounting(make_model("ouro"), seq, phase, spec, 4, 2, 2)
    assert row["sequential_tokens"] == row["speculative_tokens"] == 18
    assert row["sequential_tokens_per_s"] == 20.0 and row["speculative_tokens_per_s"] == 40.0
    assert row["speedup"] == 2.0
    assert row["ms_sequential_step"] == 100.0 and row["cost_ratio_draft"] == 0.1 and row["cost_ratio_verify"] == 1.1
    assert row["tau_eff"] == 3.0 and row["row_acceptance"] == [round(8 / 9, 4), round(7 / 9, 4)]


def test_a_row_that_fell_back_to_a_reference_is_marked():
    """Every `announce_once` call counts (not only the first), so a row that ran a reference op is caught even when
    an earlier row announced the same fallback."""
    from triton_ops._dispatch import announce_once, fallback_counts

    announce_once("test: kernel refused this shape")
    before = fallback_counts()
    announce_once("test: kernel refused this shape")
    row = {"status": "ok"}
    bench.mark_fallbacks(row, before, fallback_counts())
    assert row["status"] == "fallback" and row["fallbacks"] == {"test: kernel refused this shape": 1}
    clean = {"status": "ok"}
    bench.mark_fallbacks(clean, fallback_counts(), fallback_counts())
    assert clean == {"status": "ok"}


def test_a_row_whose_kernel_falls_back_is_refused_before_it_is_timed(tmp_path, monkeypatch):
    """A reference op announced during a row's first runs stops the row (no timed runs) and marks it."""
    import triton_ops.coded_attention.ops as ops
    from triton_ops._dispatch import announce_once

    acceptance = str(common.RESULTS / "selfspec_acceptance.json")
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    monkeypatch.setattr(bench, "RESULTS", tmp_path)
    real = ops.coded_attention

    def refusing(query, view, **kw):  # as on CUDA with a shape the kernel does not take
        announce_once("coded_attention: the Triton kernel does not take head_dim 96 (test); using the reference")
        return real(query, view, **kw)

    for module in ("hf_loopcache.cache.layers.static", "hf_loopcache.cache.layers.static_coded"):
        monkeypatch.setattr(f"{module}.coded_attention", refusing)
    monkeypatch.setattr("hf_loopcache.cache.layers.static.StaticDenseLayer.read_method", "kernel", raising=False)
    timed = []
    monkeypatch.setattr(bench, "_accounting", lambda *a, **k: timed.append(1) or {"status": "ok"})
    bench.main(
        ["--shapes", "micro-ouro", "--caches", "ripe64", "--batches", "1", "--prompt", "16", "--new-tokens", "6",
         "--mode", "graph", "--device", "cpu", "--out", "refused", "--acceptance-file", acceptance]
    )
    rows = json.loads((tmp_path / "refused.json").read_text())["rows"]
    assert rows[0]["status"].startswith("fallback") and not timed
    assert any("head_dim 96 (test)" in msg for msg in rows[0]["fallbacks"])


def test_a_row_estimate_scales_the_same_cache_at_a_smaller_batch():
    """The budget estimate of a batch-8 row comes from the same shape and cache at batch 1 (not from the slowest
    row of batch 1, e.g. a coded plan's kernel compilation), else from this batch's longest row, else the warm-up."""
    done = {("s", 1): 20.0, ("s", "full", 1): 5.0, ("s", "kivi", 1): 20.0}
    assert bench._estimate(done, "s", "full", 8, 0.1, 64) == 1.1 * 2 * 5.0
    assert bench._estimate(done, "s", "ripe64", 1, 0.1, 64) == 1.1 * 20.0
    assert bench._estimate({}, "s", "full", 8, 0.1, 64) == 1.5 * 0.1 * 3 * 64 * 2


def test_huginn_loopkv_reads_are_ones_the_kernel_takes(monkeypatch):
    """Huginn-0125's head dim is 96 (no power of two): the coded-attention kernel used to refuse every coded read of
    it, so on CUDA each `loopkv-kivi4-share` row announced a fallback and was refused here. Every `coded_attention`
    call of a Huginn LoopKV cache of head dim 96 (INT4 history with V precision, share cells; a decode step and a
    5-token block) is now one the kernel takes (`_kernel_supports` gives no reason, so nothing is announced)."""
    import torch

    import hf_loopcache.cache.layers.windowed as windowed
    from hf_loopcache import LoopKVCache
    from tests.helpers import tiny_huginn
    from triton_ops.coded_attention.ops import _kernel_supports

    model = tiny_huginn(n_embd=192, n_heads=2, block_size=512)  # head dim 96, as Huginn-0125
    seen = []
    real = windowed.coded_attention

    def checking(query, view, **kw):
        reason = _kernel_supports(query, view, kw.get("v_precision_tau"))
        seen.append((view.head_dim, view.is_coded, query.shape[2], reason))
        return real(query, view, **kw)

    monkeypatch.setattr(windowed, "coded_attention", checking)
    cache = LoopKVCache(model, "kivi4-share")
    ids = torch.randint(3, 64, (1, 340), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(ids, past_key_values=cache, use_cache=True, init_scale=0.0)  # past sink + window: coded pages
        model(ids[:, :1], past_key_values=cache, use_cache=True, init_scale=0.0)
        model(ids[:, :5], past_key_values=cache, use_cache=True, init_scale=0.0)
    coded = [s for s in seen if s[1]]
    assert coded and {s[0] for s in coded} == {96} and {s[2] for s in coded} == {1, 5}
    assert [s for s in seen if s[3] is not None] == []


def test_row1_tuning_overrides_are_applied_and_recorded(monkeypatch):
    """`--row1-tuning KEY=VALUE` (an A/B of coded attention's settings inside the model, one process per side): the
    values are parsed (bool, int, string), set in `ROW1_TUNING` and recorded in every result file's header; a key the
    dict does not have is refused in one line naming the allowed keys."""
    import pytest

    from triton_ops.coded_attention.ops import ROW1_TUNING

    monkeypatch.setattr(common, "_ROW1_OVERRIDES", {})
    for key in ("vprec_lookback", "mma_programs_per_sm", "vprec"):
        monkeypatch.setitem(ROW1_TUNING, key, ROW1_TUNING[key])
    assert "row1_tuning" not in common.environment()
    got = common.apply_row1_tuning(["vprec_lookback=true", "mma_programs_per_sm=4", "vprec=v4"])
    assert got == {"vprec_lookback": True, "mma_programs_per_sm": 4, "vprec": "v4"}
    assert ROW1_TUNING["vprec_lookback"] is True and ROW1_TUNING["mma_programs_per_sm"] == 4
    assert common.environment()["row1_tuning"] == got
    with pytest.raises(SystemExit, match=r"--row1-tuning takes KEY=VALUE with KEY one of \[.*'vprec_lookback'"):
        common.apply_row1_tuning(["lookback=1"])


def test_replot_joins_result_files_by_block_size(tmp_path, monkeypatch, capsys):
    """`--replot`: the rows of several result files in one table, labelled with their block size where the files
    hold several and with a file's `--row1-tuning`, and one plot of speed-up against the block size."""
    monkeypatch.setattr(bench, "RESULTS", tmp_path)

    def row(cache, gamma, speedup):
        return {
            "shape": "ouro-1.4b", "mode": "graph", "cache": cache, "batch": 8, "status": "ok", "block_size": gamma,
            "acceptance_rate": 0.8, "row_acceptance": [0.7, 0.9], "cost_ratio_draft": 0.5, "cost_ratio_verify": 1.0,
            "predicted_speedup_eq8": 1.2, "predicted_speedup_eq8_batch": 1.1, "speedup": speedup,
            "speedup_over_eq8": round(speedup / 1.2, 3), "speedup_over_eq8_batch": round(speedup / 1.1, 3),
            "sequential_tokens_per_s": 800.0, "speculative_tokens_per_s": 800.0 * speedup,
        }  # fmt: skip

    files = []
    for name, env, rows in (
        ("a", {"gpu_name": "GPU X"}, [row("full", 2, 1.13), row("full", 4, 1.06)]),
        ("b", {"gpu_name": "GPU X", "row1_tuning": {"mma_rows_min": 3}}, [row("loopkv-kivi4-share", 2, 1.11)]),
    ):
        files.append(tmp_path / f"{name}.json")
        files[-1].write_text(json.dumps({"environment": env, "rows": rows}))
    bench.main(["--replot", *map(str, files), "--out", "joined"])
    table = capsys.readouterr().out
    assert "| full, gamma 2 | 8 |" in table and "| full, gamma 4 | 8 |" in table
    assert "| loopkv-kivi4-share, gamma 2, mma_rows_min=3 | 8 |" in table and "1.13x (0.94 / 1.03)" in table
    assert (tmp_path / "joined.png").stat().st_size > 0
    # `block_size="auto"` rows of different largest blocks have no one block size: measured against Eq. (8) at their
    # best block (`plot`), not placed on the block-size axis, and not labelled with a fixed gamma
    drawn = []
    monkeypatch.setattr(bench, "plot", lambda rows, *a: drawn.append(("plot", len(rows))))
    monkeypatch.setattr(bench, "plot_blocks", lambda rows, *a: drawn.append(("blocks", len(rows))))
    auto = [
        {**row("full", largest, 1.2), "block_rule": "auto", "max_block_size": largest, "gamma_eq8_best": 2,
         "block_sizes": {"2": 9, "1": 1}}
        for largest in (4, 8)
    ]  # fmt: skip
    (tmp_path / "auto.json").write_text(json.dumps({"environment": {}, "rows": auto}))
    bench.main(["--replot", str(tmp_path / "auto.json"), "--out", "auto"])
    table = capsys.readouterr().out
    assert drawn == [("plot", 2)] and "gamma 4" not in table and "gamma 8" not in table
    assert "| full, auto up to 4 (blocks 2: 9, 1: 1; Eq. 8's best 2) | 8 |" in table


def test_auto_block_rows_predict_at_eq8s_best_block(tmp_path, monkeypatch, capsys):
    """`--auto-block`: self-speculation with `block_size="auto"` up to `--block-size`, through the captured steps
    (the capture run records every block length the timed run takes); the row's Eq. (8) is at its best block for the
    measured alpha and c, and the table names the blocks taken."""
    from hf_loopcache.generation import best_block_size, expected_speedup

    acceptance = str(common.RESULTS / "selfspec_acceptance.json")
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    monkeypatch.setattr(bench, "RESULTS", tmp_path)
    bench.main(
        [
            "--shapes", "micro-ouro", "--caches", "full", "--batches", "2", "--prompt", "32", "--new-tokens", "12",
            "--mode", "graph", "--device", "cpu", "--out", "auto", "--acceptance-file", acceptance,
            "--auto-block", "--block-size", "4",
        ]
    )  # fmt: skip
    row = next(r for r in json.loads((tmp_path / "auto.json").read_text())["rows"] if r.get("status") == "ok")
    assert row["block_rule"] == "auto" and row["max_block_size"] == 4
    assert sum(row["block_sizes"].values()) == row["verifications"] and max(map(int, row["block_sizes"])) <= 4
    best = best_block_size(row["acceptance_rate"], row["cost_ratio_draft"], 4)
    assert row["gamma_eq8_best"] == best
    expected = expected_speedup(row["acceptance_rate"], best, row["cost_ratio_draft"])
    assert abs(row["predicted_speedup_eq8"] - expected) < 0.01
    assert "auto up to 4 (blocks " in capsys.readouterr().out
