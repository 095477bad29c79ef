"""`hf_loopcache.compare`: paired bootstrap of two lm-eval runs, on synthetic runs with known answers."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from hf_loopcache.cli import main
from hf_loopcache.compare import (
    compare_runs,
    exact_mcnemar_p,
    forest_plot,
    load_run,
    paired_bootstrap,
    short_label,
    stratified_bootstrap,
    to_markdown,
)

STAMP = "2026-12-01T12-00-00.000001"


def write_run(folder, tasks, *, stamp=STAMP, model_args="pretrained=tiny-ouro,cache=full", higher_is_better=None):
    """An lm-eval output folder: `tasks` maps a task name to its records `[(doc_id, {metric: value}), ...]` (filter
    "none") or `[(doc_id, filter, {metric: value}), ...]`."""
    sub = folder / "tiny-ouro"
    sub.mkdir(parents=True, exist_ok=True)
    results = {"results": {}, "config": {"model_args": model_args}, "higher_is_better": higher_is_better or {}}
    for task, items in tasks.items():
        results["results"][task] = {"alias": task}
        with open(sub / f"samples_{task}_{stamp}.jsonl", "w") as f:
            for item in items:
                doc_id, filt, metrics = item if len(item) == 3 else (item[0], "none", item[1])
                record = {
                    "doc_id": doc_id,
                    "doc": {"question": f"q{doc_id}"},
                    "target": "1",
                    "filter": filt,
                    "metrics": list(metrics),
                    "doc_hash": f"d{doc_id}",
                    "prompt_hash": f"p{doc_id}",
                    "target_hash": f"t{doc_id}",
                    "filtered_resps": [str(metrics)],
                    **metrics,
                }
                f.write(json.dumps(record) + "\n")
    (sub / f"results_{stamp}.json").write_text(json.dumps(results))
    return folder


def binary_runs(tmp_path, n, down, up, *, base_correct=None, task="gsm8k"):
    """A baseline with `base_correct` right answers out of `n` and a candidate with `down` of them wrong and `up` of
    the baseline's wrong ones right."""
    base_correct = n // 2 if base_correct is None else base_correct
    a = [1] * base_correct + [0] * (n - base_correct)
    b = list(a)
    for i in range(down):
        b[i] = 0
    for i in range(up):
        b[base_correct + i] = 1
    run_a = write_run(tmp_path / "a", {task: [(i, {"exact_match": v}) for i, v in enumerate(a)]})
    run_b = write_run(tmp_path / "b", {task: [(i, {"exact_match": v}) for i, v in enumerate(b)]})
    return load_run(run_a), load_run(run_b)


def test_identical_runs_show_no_difference(tmp_path):
    a, b = binary_runs(tmp_path, 120, 0, 0)
    report = compare_runs(a, b, iters=2000)
    (row,) = report["rows"]
    assert (row["delta"], row["low"], row["high"]) == (0.0, 0.0, 0.0)
    assert row["p_value"] == 1.0 and row["p_exact"] == 1.0
    assert (row["flips_down"], row["flips_up"], row["answers_changed"]) == (0, 0, 0)
    assert row["verdict"] == "non-inferior"


def test_a_run_against_itself(tmp_path):
    run = write_run(
        tmp_path / "a",
        {"t": [(i, {"exact_match": i % 3 == 0, "score": (i % 7) / 7}) for i in range(50)]},
    )
    report = compare_runs(load_run(run), load_run(run), iters=500)
    assert [r["metric"] for r in report["rows"]] == ["exact_match", "score"]
    for row in report["rows"]:
        assert row["delta"] == 0.0 and row["p_value"] == 1.0 and row["flips_down"] == row["flips_up"] == 0


@pytest.mark.parametrize("down,up", [(7, 0), (3, 9), (12, 12)], ids=["7-down", "3-down-9-up", "12-each"])
def test_known_flips_and_delta(tmp_path, down, up):
    n = 200
    a, b = binary_runs(tmp_path, n, down, up)
    (row,) = compare_runs(a, b, iters=2000)["rows"]
    assert (row["flips_down"], row["flips_up"], row["answers_changed"]) == (down, up, down + up)
    assert row["delta"] == pytest.approx((up - down) / n)
    assert row["mean_a"] == pytest.approx(0.5) and row["mean_b"] == pytest.approx(0.5 + (up - down) / n)
    assert row["low"] <= row["delta"] <= row["high"]


def test_exact_mcnemar_matches_the_binomial_test():
    stats = pytest.importorskip("scipy.stats")
    for down, up in [(0, 0), (5, 0), (30, 12), (10, 11), (1, 40)]:
        expected = 1.0 if down + up == 0 else stats.binomtest(min(down, up), down + up, 0.5).pvalue
        assert exact_mcnemar_p(down, up) == pytest.approx(expected, rel=1e-9)
    # a hand value: 6 flips all one way, p = 2 / 2**6
    assert exact_mcnemar_p(6, 0) == pytest.approx(2 / 64)


@pytest.mark.parametrize("down,up", [(30, 12), (25, 10), (20, 20)], ids=["30v12", "25v10", "20v20"])
def test_bootstrap_p_value_agrees_with_exact_mcnemar(tmp_path, down, up):
    """For 0/1 metrics the bootstrap p approximates the exact sign test on the discordant pairs (to within the
    normal approximation and resampling noise)."""
    a, b = binary_runs(tmp_path, 400, down, up, base_correct=200)
    (row,) = compare_runs(a, b, iters=20_000)["rows"]
    assert row["p_exact"] == pytest.approx(exact_mcnemar_p(down, up))
    if down == up:
        assert row["p_value"] > 0.9
    else:
        assert 0.5 * row["p_exact"] < row["p_value"] < 1.6 * row["p_exact"]


def test_interval_matches_the_normal_approximation():
    rng = np.random.default_rng(1)
    a = rng.random(2000)
    b = a + rng.normal(0.02, 0.1, size=2000)
    out = paired_bootstrap(a, b, iters=20_000, seed=3)
    d = b - a
    se = d.std(ddof=1) / math.sqrt(d.size)
    assert out["low"] == pytest.approx(d.mean() - 1.96 * se, abs=0.2 * se)
    assert out["high"] == pytest.approx(d.mean() + 1.96 * se, abs=0.2 * se)
    assert out["p_value"] < 1e-3


def test_bootstrap_is_seeded():
    rng = np.random.default_rng(0)
    a, b = rng.random(300), rng.random(300)
    assert paired_bootstrap(a, b, seed=5, iters=1000) == paired_bootstrap(a, b, seed=5, iters=1000)
    assert paired_bootstrap(a, b, seed=5, iters=1000) != paired_bootstrap(a, b, seed=6, iters=1000)


def test_rows_do_not_depend_on_other_tasks(tmp_path):
    items = [(i, {"exact_match": int(i % 2 == 0)}) for i in range(40)]
    worse = [(i, {"exact_match": int(i % 4 == 0)}) for i in range(40)]
    one_a = load_run(write_run(tmp_path / "1a", {"t1": items}))
    one_b = load_run(write_run(tmp_path / "1b", {"t1": worse}))
    two_a = load_run(write_run(tmp_path / "2a", {"t0": items, "t1": items}))
    two_b = load_run(write_run(tmp_path / "2b", {"t0": items, "t1": worse}))
    row1 = compare_runs(one_a, one_b, iters=500)["rows"][0]
    row2 = [r for r in compare_runs(two_a, two_b, iters=500)["rows"] if r["task"] == "t1"][0]
    for key in ("delta", "low", "high", "p_value"):
        assert row1[key] == row2[key]


@pytest.mark.parametrize(
    "down,up,margin,verdict",
    [
        (0, 0, 0.03, "non-inferior"),
        (200, 0, 0.03, "inferior"),
        (12, 0, 0.03, "inconclusive"),
        (12, 0, 0.1, "non-inferior"),
    ],
    ids=["equal", "large-drop", "small-drop-3pt", "small-drop-10pt"],
)
def test_non_inferiority_verdict(tmp_path, down, up, margin, verdict):
    a, b = binary_runs(tmp_path, 400, down, up, base_correct=300)
    (row,) = compare_runs(a, b, iters=4000, margin=margin)["rows"]
    assert row["verdict"] == verdict
    # the rule itself: non-inferior exactly when the lower end is above -margin
    assert (row["verdict"] == "non-inferior") == (row["low"] > -margin)


def test_lower_is_better_metrics_flip_the_verdict(tmp_path):
    items_a = [(i, {"loss": 1.0}) for i in range(100)]
    items_b = [(i, {"loss": 1.5}) for i in range(100)]
    hib = {"t": {"loss": False}}
    a = load_run(write_run(tmp_path / "a", {"t": items_a}, higher_is_better=hib))
    b = load_run(write_run(tmp_path / "b", {"t": items_b}, higher_is_better=hib))
    (row,) = compare_runs(a, b, iters=500)["rows"]
    assert row["delta"] == pytest.approx(0.5) and row["verdict"] == "inferior"
    (back,) = compare_runs(b, a, iters=500)["rows"]
    assert back["verdict"] == "non-inferior"


def test_ruler_length_placeholders_are_left_out(tmp_path):
    items = [(i, {"2048": float(i % 2), "4096": -1.0}) for i in range(10)]
    items += [(10 + i, {"2048": -1.0, "4096": 1.0}) for i in range(6)]
    run = load_run(write_run(tmp_path / "a", {"niah_single_1": items}))
    rows = {r["metric"]: r for r in compare_runs(run, run, iters=200)["rows"]}
    assert rows["2048"]["n"] == 10 and rows["2048"]["mean_a"] == 0.5
    assert rows["4096"]["n"] == 6 and rows["4096"]["mean_a"] == 1.0


def test_filters_are_compared_apart(tmp_path):
    items = [(i, "strict-match", {"exact_match": 0}) for i in range(20)]
    items += [(i, "flexible-extract", {"exact_match": 1}) for i in range(20)]
    run = load_run(write_run(tmp_path / "a", {"gsm8k": items}))
    rows = compare_runs(run, run, iters=200)["rows"]
    assert [(r["filter"], r["n"], r["mean_a"]) for r in rows] == [
        ("flexible-extract", 20, 1.0),
        ("strict-match", 20, 0.0),
    ]


def test_refuses_runs_whose_items_differ(tmp_path):
    a = load_run(write_run(tmp_path / "a", {"t": [(i, {"acc": 1}) for i in range(10)]}))
    fewer = load_run(write_run(tmp_path / "b", {"t": [(i, {"acc": 1}) for i in range(9)]}))
    with pytest.raises(ValueError, match="different items"):
        compare_runs(a, fewer)
    other_task = load_run(write_run(tmp_path / "c", {"u": [(i, {"acc": 1}) for i in range(10)]}))
    with pytest.raises(ValueError, match="different tasks"):
        compare_runs(a, other_task)
    # same ids, other content: edit one prompt hash
    folder = write_run(tmp_path / "d", {"t": [(i, {"acc": 1}) for i in range(10)]})
    file = folder / "tiny-ouro" / f"samples_t_{STAMP}.jsonl"
    lines = file.read_text().splitlines()
    record = json.loads(lines[3])
    record["prompt_hash"] = "changed"
    lines[3] = json.dumps(record)
    file.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match="document 3 .*different content"):
        compare_runs(a, load_run(folder))


def test_load_run_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no results"):
        load_run(tmp_path)
    folder = write_run(tmp_path / "two", {"t": [(0, {"acc": 1})]})
    write_run(folder, {"t": [(0, {"acc": 1})]}, stamp="2026-12-01T13-00-00.000001")
    with pytest.raises(ValueError, match="holds 2 lm-eval runs"):
        load_run(folder)
    # one results file chosen explicitly
    assert load_run(folder / "tiny-ouro" / f"results_{STAMP}.json").samples["t"][0]["acc"] == 1
    (folder / "tiny-ouro" / f"samples_t_{STAMP}.jsonl").unlink()
    with pytest.raises(FileNotFoundError, match="--log_samples"):
        load_run(folder / "tiny-ouro" / f"results_{STAMP}.json")


def test_argument_errors():
    with pytest.raises(ValueError, match="`iters`"):
        paired_bootstrap(np.zeros(3), np.zeros(3), iters=0)
    with pytest.raises(ValueError, match="same positive length"):
        paired_bootstrap(np.zeros(3), np.zeros(4))
    with pytest.raises(ValueError, match="`down` and `up`"):
        exact_mcnemar_p(-1, 2)


def test_cli_writes_markdown_json_and_forest_plot(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    a, b = binary_runs(tmp_path, 60, 5, 2)
    out = tmp_path / "out"
    out.mkdir()
    code = main(
        [
            "compare",
            str(a.path),
            str(b.path),
            "--iters",
            "500",
            "--json",
            str(out / "r.json"),
            "--markdown",
            str(out / "r.md"),
            "--plot",
            str(out / "r.png"),
        ]
    )
    assert code == 0
    printed = capsys.readouterr().out
    assert "| gsm8k | none | exact_match | 60 |" in printed and "5/2" in printed
    assert (out / "r.md").read_text() == printed
    (report,) = json.loads((out / "r.json").read_text())["comparisons"]
    assert report["rows"][0]["flips_down"] == 5 and report["margin"] == 0.03
    assert (out / "r.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # several candidates against one baseline: one report each, one figure
    assert (
        main(["compare", str(a.path), str(b.path), str(a.path), "--iters", "200", "--json", str(out / "m.json")]) == 0
    )
    reports = json.loads((out / "m.json").read_text())["comparisons"]
    assert [r["rows"][0]["flips_down"] for r in reports] == [5, 0]


def test_forest_plot_stacks_comparisons(tmp_path):
    pytest.importorskip("matplotlib")
    a, b = binary_runs(tmp_path, 60, 5, 2)
    report = compare_runs(a, b, iters=200)
    path = forest_plot([("ripe", report), ("kivi4", report)], tmp_path / "f.png")
    assert path.stat().st_size > 1000
    with pytest.raises(ValueError, match="no compared rows"):
        forest_plot([("ripe", {**report, "rows": []})], tmp_path / "g.png")
    assert "delta (B-A)" in to_markdown(report)


def test_short_label_names_what_sets_a_candidate_apart():
    base = "pretrained=tiny-ouro,cache=full,dtype=bfloat16"
    assert short_label(base, "pretrained=tiny-ouro,cache=ripe,window=64,dtype=bfloat16") == "cache=ripe,window=64"
    assert short_label(base, base) == base  # nothing differs: the whole label, never an empty title


def test_library_and_eval_tasks_package_import_no_lm_eval():
    """The library never imports lm_eval (compare reads lm-eval's files as JSON); `import eval_tasks` stays light."""
    import subprocess
    import sys

    code = (
        "import sys, hf_loopcache, hf_loopcache.compare, hf_loopcache.cli, eval_tasks, eval_tasks.synthetic\n"
        "heavy = [m for m in ('lm_eval', 'datasets', 'matplotlib') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr


def test_suites_average_tasks_and_resample_within_each(tmp_path):
    """A suite row is the unweighted mean over its tasks (lm-eval's group average), whatever their sizes."""
    small_a = [(i, {"2048": 1}) for i in range(20)]
    small_b = [(i, {"2048": int(i >= 10)}) for i in range(20)]  # -0.5
    big = [(i, {"2048": 1}) for i in range(200)]  # 0
    a = load_run(write_run(tmp_path / "a", {"loopcache_ruler_x": small_a, "loopcache_ruler_y": big, "other": big}))
    b = load_run(write_run(tmp_path / "b", {"loopcache_ruler_x": small_b, "loopcache_ruler_y": big, "other": big}))
    report = compare_runs(a, b, iters=2000, suites={"ruler": ["loopcache_ruler_*"]})
    (suite,) = [r for r in report["rows"] if r["suite"]]
    assert suite["suite"] == ["loopcache_ruler_x", "loopcache_ruler_y"] and suite["metric"] == "2048"
    assert suite["delta"] == pytest.approx(-0.25) and suite["n"] == 220  # not the pooled -10/220
    assert (suite["flips_down"], suite["flips_up"], suite["p_exact"]) == (10, 0, None)
    # within-task resampling: the suite's spread is half the small task's (the big one has none)
    (x,) = [r for r in report["rows"] if r["task"] == "loopcache_ruler_x"]
    assert suite["high"] - suite["low"] == pytest.approx((x["high"] - x["low"]) / 2, rel=0.25)
    assert "**ruler** (mean of 2 tasks)" in to_markdown(report)
    with pytest.raises(ValueError, match="no compared task matches"):
        compare_runs(a, b, iters=10, suites={"lb": ["loopcache_longbench_*"]})


def test_one_stratum_is_the_paired_bootstrap():
    rng = np.random.default_rng(2)
    a, b = rng.random(50), rng.random(50)
    assert stratified_bootstrap([(a, b)], iters=300, seed=1) == paired_bootstrap(a, b, iters=300, seed=1)


def test_placeholder_in_one_run_only_is_refused(tmp_path):
    a = load_run(write_run(tmp_path / "a", {"niah": [(0, {"2048": 1.0}), (1, {"2048": -1.0})]}))
    b = load_run(write_run(tmp_path / "b", {"niah": [(0, {"2048": -1.0}), (1, {"2048": -1.0})]}))
    with pytest.raises(ValueError, match="placeholder -1 in one run only"):
        compare_runs(a, b, iters=10)


def test_non_numeric_metrics_are_listed_as_skipped(tmp_path):
    run = load_run(write_run(tmp_path / "a", {"t": [(i, {"bleu": ["ref", "pred"], "acc": 1}) for i in range(4)]}))
    report = compare_runs(run, run, iters=10)
    assert [r["metric"] for r in report["rows"]] == ["acc"]
    assert report["skipped"] == [
        {"task": "t", "filter": "none", "metric": "bleu", "reason": "per-item values are not numbers"}
    ]
