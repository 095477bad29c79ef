"""`benchmarks/bench_multi_gpu.py` (issue #20, item 4): its arguments, device map and crossing count, and a CPU dry run
of the split and crossing parts through accelerate's hooks (the numbers mean nothing on a CPU)."""

from __future__ import annotations

import json

import pytest

from benchmarks import bench_multi_gpu as bench
from benchmarks import common
from benchmarks.run import REGISTRY
from hf_loopcache import HuginnConfig, OuroConfig


def test_registered_with_its_gate():
    assert REGISTRY["multi-gpu"] == ("benchmarks.bench_multi_gpu", "tests/cache/test_device_map.py")


def test_arguments_are_checked():
    args = bench.parse_args([])
    assert (args.shape, args.devices, args.batch, args.context) == ("huginn-0125", ["cuda:0", "cuda:1"], 8, 8192)
    with pytest.raises(SystemExit):
        bench.parse_args(["--devices", "cuda:0"])
    with pytest.raises(SystemExit):
        bench.parse_args(["--new-tokens", "1"])
    with pytest.raises(SystemExit):
        bench.parse_args(["--batch", "0"])


def test_huginn_0125_map_splits_the_core_and_crosses_twice_per_loop():
    config = HuginnConfig(bos_token_id=65504, eos_token_id=65505, pad_token_id=65509)  # the released shape
    device_map = bench.balanced_device_map(config, ["cuda:0", "cuda:1"])
    assert [device_map[f"transformer.core_block.{i}"] for i in range(4)] == ["cuda:0", "cuda:0", "cuda:1", "cuda:1"]
    assert device_map["transformer.prelude"] == "cuda:0" and device_map["transformer.coda"] == "cuda:1"
    # its head is tied to the embedding: one weight, so the head stays with the embedding (on the H200 pair a head
    # mapped to the last device left the embedding reading its weight there: "index is on cuda:0, ... cuda:1")
    assert config.tie_word_embeddings and device_map["lm_head"] == device_map["transformer.wte"] == "cuda:0"
    # 32 steps: core 1 -> core 2 and core 3 -> adapter each step, minus the last return (core 3 -> coda stays), and
    # the coda's output back to the head
    assert bench.crossings_per_token(device_map, config) == 2 * 32 - 1 + 1
    untied = HuginnConfig(bos_token_id=65504, eos_token_id=65505, pad_token_id=65509, tie_embeddings=False)
    assert bench.balanced_device_map(untied, ["cuda:0", "cuda:1"])["lm_head"] == "cuda:1"


def test_ouro_map_cuts_the_layers_into_contiguous_runs():
    config = OuroConfig(num_hidden_layers=24, total_ut_steps=4, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    device_map = bench.balanced_device_map(config, ["cuda:0", "cuda:1"])
    assert [device_map[f"model.layers.{i}"] for i in (0, 11, 12, 23)] == ["cuda:0", "cuda:0", "cuda:1", "cuda:1"]
    assert bench.crossings_per_token(device_map, config) == 2 * 4 - 1


def test_cpu_dry_run(tmp_path, monkeypatch):
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    argv = [
        "--shape",
        "micro-huginn",
        "--devices",
        "cpu",
        "cpu",
        "--context",
        "80",
        "--new-tokens",
        "3",
        "--batch",
        "2",
    ]
    bench.main([*argv, "--dtype", "float32", "--parts", "split", "crossing", "--out", "dry"])
    rows = json.loads((tmp_path / "dry.json").read_text())["rows"]
    ok = [r for r in rows if r.get("status") == "ok"]
    assert {(r["cache"], r["placement"], r["batch"]) for r in ok} == {
        ("ripe64", "one device", 2),
        ("full", "one device", 1),
        ("full", "split", 2),
        ("full", "split", 1),
    }
    split = next(r for r in ok if r["placement"] == "split" and r["batch"] == 2)
    assert split["cache_by_device"]["cpu"]["cells"] == 1 + 2 * 4 + 1 and split["generated"] == 3
    assert "crossings_per_token" in split
