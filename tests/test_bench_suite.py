"""`benchmarks/suite.py` and what it relies on, on the CPU with micro shapes (numbers mean nothing here): every part's
command lines parse, the parts share the budget and touch the release file, the peers wait for it after compiling,
a static cache that does not fit and a missing quantization backend are rows, late rows are `deadline` rows, the
capacity row's captured-step throughput steps down out of memory, and the tables and plots read the rows."""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch

from benchmarks import bench_capacity, bench_generate, common, plot_suite, suite, tables
from benchmarks.common import build

MICRO = ["--device", "cpu", "--dtype", "float32"]


@pytest.mark.parametrize("tiny", [False, True])
@pytest.mark.parametrize("part", ["generate", "capacity", "contexts", "peers"])
def test_every_part_command_line_parses(part, tiny):
    runs = suite.commands(part, "p", 100.0, tiny=tiny, peers_after="/tmp/go")
    assert sum(share for *_, share in runs) == pytest.approx(1.0)
    for _, module, argv, _ in runs:
        args = module.build_parser().parse_args([*argv, "--deadline-s", "5"])
        assert args.out.startswith("p_") and args.deadline_s == 5
    if part == "peers":
        assert args.peers_only and args.peers == ["dynamic", "static", "quantized"] and args.peers_after == "/tmp/go"
    if part == "capacity" and not tiny:  # the rows: Ouro at 8K and 32K, Huginn at 8K, throughput captured
        ouro = [a for _, _, a, _ in runs if "ouro-1.4b" in a]
        assert {a[a.index("--contexts") + 1] for a in ouro} == {"8192", "32768"}
        assert all("graph" in a for _, _, a, _ in runs)
        assert [a[a.index("--budget-gib") + 1] for _, _, a, _ in runs] == ["24.0", "32.0", "32.0"]
    if part == "contexts" and not tiny:
        assert args.context == [16384, 32768] and args.batches == [1, 8] and args.modes == ["graph"]


def test_a_part_splits_its_budget_touches_the_release_file_and_writes_a_manifest(tmp_path, monkeypatch):
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    seen = []
    monkeypatch.setattr(bench_capacity, "main", lambda argv: seen.append(argv))
    release = tmp_path / "go"
    suite.main(["--part", "capacity", "--budget-s", "100", "--prefix", "t", "--release", str(release), "--tiny"])
    assert release.exists() and len(seen) == 3
    deadlines = [float(a[a.index("--deadline-s") + 1]) for a in seen]
    assert deadlines[0] == pytest.approx(34, abs=1) and deadlines[1] == pytest.approx(70, abs=1)  # cumulative shares
    manifest = json.loads((tmp_path / "t_suite_capacity.json").read_text())
    assert [r["name"] for r in manifest["runs"]] == ["capacity_ouro_8k", "capacity_huginn_8k", "capacity_ouro_32k"]
    assert [a[a.index("--budget-gib") + 1] for a in seen] == ["0.02"] * 3
    assert manifest["runs"][0]["command"].startswith("python -m benchmarks.run capacity --shapes micro-ouro")
    with pytest.raises(SystemExit, match="--budget-s must be > 0"):
        suite.main(["--part", "all", "--budget-s", "0"])


def test_peers_compile_first_then_wait_for_the_file(tmp_path, monkeypatch):
    """`--peers-only --peers-after FILE`: the static peer is built and its step run (compiled on a GPU) before the
    wait; the timed rows start once FILE exists and keep the compile's seconds apart from the row's own warm-up."""
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    go = tmp_path / "go"
    order = []
    real_compile, real_wait = bench_generate.precompile_static_peer, bench_generate.wait_for

    def compile_(*args, **kwargs):
        order.append("compile")
        return real_compile(*args, **kwargs)

    def wait(path, timeout_s):
        order.append("wait")
        threading.Timer(1.0, go.touch).start()  # the other rows end a second after the wait begins
        return real_wait(path, timeout_s)

    monkeypatch.setattr(bench_generate, "precompile_static_peer", compile_)
    monkeypatch.setattr(bench_generate, "wait_for", wait)
    start = time.perf_counter()
    bench_generate.main(["--shapes", "micro-ouro", "--peers-only", "--peers", "static", "dynamic", "--peers-after",
                         str(go), "--batches", "2", "--context", "40", "--new-tokens", "4", "--timing", "steps",
                         "--warmup-prompt", "8", *MICRO, "--out", "peers"])
    assert time.perf_counter() - start >= 1.0 and order == ["compile", "wait"]
    rows = json.loads((tmp_path / "peers.json").read_text())["rows"]
    assert [r["cache"] for r in rows] == ["static", "dynamic"] and all(r["status"] == "ok" for r in rows)
    assert all(r["waited_s"] >= 0.9 and r["model"] == "plain Qwen2 peer" for r in rows)
    static = rows[0]
    assert static["compile_warmup_s"] >= 0 and static["rewarm_s"] >= 0 and static["warmup_prompt"] == 8
    assert static["compile_config"] == {"fullgraph": True, "dynamic": False, "mode": "reduce-overhead"}
    assert rows[1]["warmup_prompt"] == 36  # only static caches warm up from the short prompt
    assert static["timing"] == "steps" and static["generated"] == 4 and static["ms_per_decode_step"] > 0


def test_a_compile_that_breaks_the_graph_falls_back_once(monkeypatch):
    """`fullgraph=True` failing (a graph break raises a RuntimeError) is retried with `fullgraph=False`; the options
    used and the failed attempt are returned."""
    peer = bench_generate.peer_model(build("micro-ouro", torch.float32, "meta"), torch.float32, "cpu")
    real = peer.generate
    asked = []

    def generate(*args, compile_config=None, **kwargs):
        asked.append(compile_config.fullgraph)
        if compile_config.fullgraph:
            raise RuntimeError("Unsupported: graph break (fake)")
        return real(*args, **kwargs)

    monkeypatch.setattr(peer, "generate", generate)
    done = bench_generate.precompile_static_peer(peer, "micro-ouro", [2], [40], "cpu", warmup_prompt=8,
                                                compile_config={"fullgraph": True, "dynamic": False})
    assert asked == [True, False]
    assert done[(2, 40)]["compile_config"] == {"fullgraph": False, "dynamic": False}
    assert done["fallback"][0]["error"].startswith("RuntimeError: Unsupported")


def test_missing_backend_oom_and_deadline_are_rows(tmp_path, monkeypatch):
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    bench_generate.main(["--shapes", "micro-ouro", "--peers-only", "--peers", "quantized", "--quantized-backends",
                         "no-such-backend", "--batches", "1", "--context", "24", "--new-tokens", "2", *MICRO,
                         "--out", "q"])
    (row,) = json.loads((tmp_path / "q.json").read_text())["rows"]
    assert row["status"] == "unavailable" and "no-such-backend" in row["error"]

    real = bench_generate.CACHES["full"]

    def full(model, **kw):
        if kw.get("static") and kw["max_batch_size"] > 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 192.00 GiB (fake)")
        return real(model, **kw)

    monkeypatch.setitem(bench_generate.CACHES, "full", full)
    bench_generate.main(["--shapes", "micro-ouro", "--caches", "full", "--modes", "graph", "--batches", "2", "1",
                         "--context", "24", "--new-tokens", "2", "--timing", "steps", *MICRO, "--out", "o"])
    rows = json.loads((tmp_path / "o.json").read_text())["rows"]
    assert [(r["batch"], r["status"]) for r in rows] == [(2, "oom"), (1, "ok")]
    assert rows[0]["kv_bytes_needed_formula"] > 0 and "192.00 GiB" in rows[0]["error"]
    bench_generate.main(["--shapes", "micro-ouro", "--caches", "full", "--batches", "1", "2", "--context", "24",
                         "--new-tokens", "2", "--deadline-s", "1e-6", *MICRO, "--out", "d"])
    rows = json.loads((tmp_path / "d.json").read_text())["rows"]
    # past the deadline no row starts; each is recorded as such
    assert [(r["batch"], r["status"]) for r in rows] == [(1, "deadline"), (2, "deadline")]


@torch.no_grad()
def test_graph_throughput_at_the_largest_batch_steps_down_out_of_memory(monkeypatch):
    model = build("micro-ouro", torch.float32, "cpu")
    real = model.generate
    calls = []

    def generate(ids, *args, **kwargs):
        calls.append(ids.shape[0])
        if ids.shape[0] > 3:
            raise torch.OutOfMemoryError("CUDA out of memory (fake)")
        return real(ids, *args, **kwargs)

    monkeypatch.setattr(model, "generate", generate)
    out = bench_capacity.graph_throughput(model, "micro-ouro", "hand", 5, 48, 4, "cpu")
    assert out["tried"] == [5, 4, 3] and out["status"] == "ok" and out["batch"] == 3
    assert out["decode_tokens_per_s"] > 0 and out["captured"] is False  # nothing is captured on the CPU
    row = bench_capacity.run_cache(model, "micro-ouro", "full", 48, budget_bytes=2**30, weights_bytes=0, new_tokens=3,
                                   device="cpu", search_out_of_time=lambda s: True, throughput="graph")
    # the row's share of time was spent before the search: the throughput still runs at the largest batch known
    assert row["status"].startswith("deadline") and row["largest_batch"] == 1
    assert row["graph_at_largest"]["status"] == "ok" and row["graph_at_largest"]["batch"] == 1


def _files(tmp_path):
    env = {"gpu_name": "NVIDIA H200", "torch": "2.11.0", "transformers": "5.17.0", "triton": "3.6.0",
           "timestamp": "2026-12-02T01:00:00+00:00"}
    gen = [{"shape": "ouro-1.4b", "cache": c, "mode": "graph", "model": "looped", "batch": b, "context": ctx,
            "status": "ok", "ms_per_decode_step": 8.5 * b, "decode_tokens_per_s": 1000 / 8.5, "warmup_s": 2.0,
            "ms_per_decode_step_median": 8.5 * b - 1,
            "cpu_ms_per_decode_step": 1.0, "peak_memory_gib": 9.0, "cache_stored_bytes_per_token": 786432.0}
           for c in ("full", "hand") for b in (1, 8) for ctx in (8192, 16384)]
    gen.append({"shape": "ouro-1.4b", "cache": "full", "mode": "graph", "model": "looped", "batch": 8,
                "context": 32768, "status": "oom", "error": "CUDA out of memory. Tried to allocate 192 GiB"})
    gen.append({"shape": "ouro-1.4b", "cache": "static", "mode": "peer", "model": "plain Qwen2 peer", "batch": 1,
                "context": 8192, "status": "ok", "ms_per_decode_step": 16.2, "decode_tokens_per_s": 61.7,
                "compile_warmup_s": 95.0})
    cap = [{"shape": "ouro-1.4b", "cache": "hand", "context": 8192, "budget_gib": 24.0, "predicted_batch": 17,
            "largest_batch": 16, "measured_over_predicted": 0.941, "stored_bytes_per_token": 159744.0,
            "peak_gib_at_largest": 20.5, "decode_tokens_per_s_at_largest": 120.0, "status": "ok",
            "graph_at_largest": {"status": "ok", "batch": 16, "decode_tokens_per_s": 640.0}}]
    paths = []
    for name, rows in (("gen", gen), ("cap", cap)):
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps({"environment": env, "rows": rows}))
        paths.append(str(path))
    return paths


def test_tables_are_the_rows_of_the_json(tmp_path):
    md = tables.tables(_files(tmp_path))
    assert "`gen.json`: NVIDIA H200, torch 2.11.0, transformers 5.17.0, Triton 3.6.0, 2026-12-02 01:00 UTC" in md
    assert "| ouro-1.4b | full (graph) | 8 | 8,192 | 68.00 | 67.00 | 117.6 | 1.00 | 9.00 | 786,432 | 2.0 | ok |" in md
    assert "| ouro-1.4b | peer: static | 1 | 8,192 | 16.20 | - | 61.7 |" in md and "| 95.0 | ok |" in md
    assert "oom: CUDA out of memory. Tried to allocate 192 GiB" in md
    assert "| ouro-1.4b | hand | 8,192 | 24.0 | 156.0 | 17 | 16 | 0.94 | 20.5 | 120.0 | 16 | 640.0 | ok |" in md


def test_plot_suite_draws_every_panel(tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "suite.png"
    plot_suite.main([*_files(tmp_path), "--out", str(out)])
    assert out.stat().st_size > 10_000
    decode, capacity = plot_suite.load(_files(tmp_path))
    assert len(decode) == 10 and len(capacity) == 1


def test_the_step_clock_counts_steps_on_the_host_clock_off_cuda():
    clock = common.StepClock("cpu")
    for _ in range(4):
        clock(None, torch.zeros(1))
    steps, wall, cpu = clock.decode()
    assert steps == 3 and wall >= 0 and cpu >= 0
    assert clock.median_step_s() >= 0 and len(clock.times) == 4


@pytest.mark.gpu
def test_the_step_clock_adds_no_sync_on_cuda_unless_asked(monkeypatch):
    """A `generate` step keeps its own one host sync: the default clock records events; `sync=True` (the old clock)
    synchronises at each mark."""
    calls = []
    real = torch.cuda.synchronize
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    x = torch.randn(1024, 1024, device="cuda")
    clock = common.StepClock("cuda")
    for _ in range(4):
        x = x @ x / 32.0
        clock(None, x)
    assert not calls
    times = clock.times
    assert len(times) == 4 and times[0] == 0.0 and all(b >= a for a, b in zip(times, times[1:]))
    old = common.StepClock("cuda", sync=True)
    old(None, x)
    assert calls
