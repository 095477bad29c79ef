"""Beyond one GPU (issue #20, item 4): a looped model split over several GPUs by a device map, its full cache at a batch
whose cache does not fit one GPU, against RIPE(64) on one GPU; the cost of the device crossing; lm-eval data parallel.

Parts (`--parts`, default all):
- `split`: the model (random weights at a real shape; Huginn-0125 by default) dispatched with a balanced device map
  over `--devices` (Huginn: wte, prelude, adapter and the first half of the core on the first device, the rest of the
  core, coda, ln_f and head on the last, so the core crosses the boundary twice per loop: 64 crossings per token at
  32 steps), generating with the full cache at `--batch` rows; and RIPE(64) on the first device alone at the same
  batch. Each row: decode tokens/s, per-device peak memory (`max_memory_allocated`, reset before the run), the
  cache's allocated bytes and cell count per device (`LoopCache.cell_devices`), and whether the full cache fits one
  device by the byte formula (`LoopLayout.full_bytes`), so no run is spent on a certain out-of-memory error unless
  `--try-one-device` asks for it.
- `crossing`: the device crossing's cost at `--crossing-batch` (small enough for one device): the same cache and
  batch split vs on one device (decode ms per step; the difference is what the crossings cost), next to a timed copy
  of one crossing's hidden state (`[B, 1, hidden]`) between the devices, times the crossings per decode step.
- `eval`: lm-eval on `--eval-tasks` with the fixture model, one process vs `accelerate launch` with one process per
  device (data parallel); rows hold each run's wall time and metrics, and whether the metrics are equal.

Method: one warm-up generate per configuration; CUDA synchronised on every device around each timer; decode time =
full run - prefill-only run (as `bench_generate`). On CPU (`--devices cpu cpu`, a micro shape) the code runs through
accelerate's hooks, which is how its test checks it; the numbers mean nothing there.

    python -m benchmarks.run multi-gpu                       # 2 GPUs: Huginn-0125, 8K context, batch 8
    python -m benchmarks.run multi-gpu --shape micro-huginn --devices cpu cpu --context 96 --new-tokens 4 \\
        --batch 2 --crossing-batch 1 --parts split crossing  # the CPU dry run
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import SHAPES, build, write_rows
from hf_loopcache import FullLoopCache, RIPECache

PARTS = ("split", "crossing", "eval")
CACHES = {"full": lambda m: FullLoopCache(m), "ripe64": lambda m: RIPECache(m, window=64)}


def balanced_device_map(config: Any, devices: list[str]) -> dict[str, str]:
    """A device map (for a model of `config`) that cuts the repeated block (Huginn's core, Ouro's layers) into
    `len(devices)` contiguous runs of layers; what runs before it goes with the first device, what after with the last,
    except a head tied to the input embedding (Huginn-0125's), which stays with the embedding on the first device (one
    weight cannot sit on two devices: the embedding would read it from the head's)."""
    n = len(devices)
    head = devices[0] if getattr(config, "tie_word_embeddings", False) else devices[-1]
    if config.model_type == "ouro":
        layers = config.num_hidden_layers
        device_map = {"model.embed_tokens": devices[0], "model.rotary_emb": devices[0]}
        device_map |= {f"model.layers.{i}": devices[i * n // layers] for i in range(layers)}
        return device_map | {"model.norm": devices[-1], "model.early_exit_gate": devices[-1], "lm_head": head}
    core = config.n_layers_in_recurrent_block
    device_map = {"transformer.wte": devices[0], "transformer.prelude": devices[0], "transformer.adapter": devices[0]}
    device_map |= {f"transformer.core_block.{i}": devices[i * n // core] for i in range(core)}
    return device_map | {"transformer.coda": devices[-1], "transformer.ln_f": devices[-1], "lm_head": head}


def crossings_per_token(device_map: dict[str, str], config: Any) -> int:
    """Device changes along one token's forward (the loops' returns included) of a model of `config`."""
    order = list(device_map.values())
    if config.model_type == "ouro":
        layers = [device_map[f"model.layers.{i}"] for i in range(config.num_hidden_layers)]
        path = [order[0]] + layers * config.total_ut_steps + [device_map["lm_head"]]
    else:
        core = [device_map[f"transformer.core_block.{i}"] for i in range(config.n_layers_in_recurrent_block)]
        adapter = device_map["transformer.adapter"]
        path = [device_map["transformer.prelude"]] + ([adapter] + core) * config.mean_recurrence
        path += [device_map["transformer.coda"], device_map["lm_head"]]
    return sum(a != b for a, b in zip(path, path[1:]))


def _sync(devices: list[str]) -> None:
    for d in dict.fromkeys(devices):
        if d.startswith("cuda"):
            torch.cuda.synchronize(d)


def _reset_peaks(devices: list[str]) -> None:
    for d in dict.fromkeys(devices):
        if d.startswith("cuda"):
            torch.cuda.reset_peak_memory_stats(d)
    if any(d.startswith("cuda") for d in devices):
        torch.cuda.empty_cache()


def _peaks(devices: list[str]) -> dict[str, float | None]:
    return {
        d: round(torch.cuda.max_memory_allocated(d) / 2**30, 3) if d.startswith("cuda") else None
        for d in dict.fromkeys(devices)
    }


def _cache_by_device(cache: Any) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for layer, device in zip(cache.cells, cache.cell_devices()):
        entry = out.setdefault(str(device), {"cells": 0, "allocated_gib": 0.0})
        entry["cells"] += 1
        entry["allocated_gib"] = round(entry["allocated_gib"] + layer.allocated_bytes() / 2**30, 3)
    return out


def generate_row(model, cache_name: str, batch: int, args, devices: list[str], placement: str) -> dict[str, Any]:
    """Decode throughput and per-device memory of one configuration (OOM recorded as a row)."""
    vocab = model.config.vocab_size
    prompt = args.context - args.new_tokens
    ids = torch.randint(1, vocab, (batch, prompt), generator=torch.Generator().manual_seed(batch)).to(devices[0])
    extra = {"init_scale": 0.0} if model.config.model_type == "huginn_raven" else {}
    gen = dict(attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=0, **extra)
    row: dict[str, Any] = {
        "shape": args.shape,
        "cache": cache_name,
        "placement": placement,
        "devices": list(dict.fromkeys(devices)),
        "batch": batch,
        "context": args.context,
        "new_tokens": args.new_tokens,
        "dtype": args.dtype,
        "full_cache_gib_formula": round(model.loop_layout.full_bytes(args.context) * batch / 2**30, 2),
    }

    def run(tokens: int):
        cache = CACHES[cache_name](model)
        out = model.generate(ids, cache=cache, max_new_tokens=tokens, min_new_tokens=tokens, **gen)
        return out, cache

    try:
        _reset_peaks(devices)
        _sync(devices)
        t0 = time.perf_counter()
        prefill = run(1)
        _sync(devices)
        t_prefill = time.perf_counter() - t0
        del prefill
        _reset_peaks(devices)
        t0 = time.perf_counter()
        out, cache = run(args.new_tokens)
        _sync(devices)
        t_total = time.perf_counter() - t0
        steps = args.new_tokens - 1
        decode = t_total - t_prefill
        row.update(
            status="ok",
            prefill_s=round(t_prefill, 4),
            decode_s=round(decode, 4),
            decode_tokens_per_s=round(batch * steps / decode, 2) if decode > 0 else None,
            ms_per_decode_step=round(1000 * decode / steps, 3),
            peak_memory_gib=_peaks(devices),
            cache_by_device=_cache_by_device(cache),
            generated=int(out.shape[1] - prompt),
        )
        del out, cache
    except torch.OutOfMemoryError as err:
        row.update(status="oom", error=str(err).splitlines()[0][:200], peak_memory_gib=_peaks(devices))
    _reset_peaks(devices)
    return row


def _device_total_gib(device: str) -> float | None:
    if not device.startswith("cuda"):
        return None
    return round(torch.cuda.get_device_properties(torch.device(device)).total_memory / 2**30, 1)


def _dispatch(model, device_map: dict[str, str]):
    from accelerate import dispatch_model

    main = next(iter(device_map.values()))
    return dispatch_model(model, device_map=device_map, main_device=main, force_hooks=True)


def _warm(model, device: str) -> None:
    warm = torch.randint(1, model.config.vocab_size, (1, 64)).to(device)
    extra = {"init_scale": 0.0} if model.config.model_type == "huginn_raven" else {}
    model.generate(warm, max_new_tokens=4, do_sample=False, pad_token_id=0, **extra)


def part_split_and_crossing(args, parts: list[str]) -> list[dict[str, Any]]:
    dtype = getattr(torch, args.dtype)
    devices = args.devices
    rows: list[dict[str, Any]] = []
    one = devices[0]
    # one device: RIPE(64) at the big batch (and the crossing baseline); the full cache only if asked to try
    model = build(args.shape, dtype, one)
    _warm(model, one)
    fits = None
    if one.startswith("cuda"):
        fits = model.loop_layout.full_bytes(args.context) * args.batch < torch.cuda.mem_get_info(one)[0]
    if "split" in parts:
        rows.append(
            {
                **generate_row(model, "ripe64", args.batch, args, [one], "one device"),
                "device_gib": _device_total_gib(one),
            }
        )
        if args.try_one_device:
            rows.append(generate_row(model, "full", args.batch, args, [one], "one device"))
        else:
            rows.append({"cache": "full", "placement": "one device", "batch": args.batch, "status": "not run",
                         "fits_free_memory_by_formula": fits})  # fmt: skip
    if "crossing" in parts:
        rows.append(generate_row(model, args.crossing_cache, args.crossing_batch, args, [one], "one device"))
    # split over every device
    device_map = balanced_device_map(model.config, devices)
    split = _dispatch(model, device_map)
    _warm(split, one)
    crossings = crossings_per_token(device_map, split.config)
    if "split" in parts:
        row = generate_row(split, "full", args.batch, args, devices, "split")
        rows.append({**row, "device_map": device_map, "crossings_per_token": crossings})
    if "crossing" in parts:
        row = generate_row(split, args.crossing_cache, args.crossing_batch, args, devices, "split")
        hidden = split.config.hidden_size if hasattr(split.config, "hidden_size") else split.config.n_embd
        x = torch.randn(args.crossing_batch, 1, hidden, dtype=dtype, device=devices[0])
        copy_s = _time_copy(x, devices[-1], devices)
        row.update(
            crossings_per_token=crossings,
            copy_us_per_crossing=round(1e6 * copy_s, 2),
            crossing_ms_per_step_estimate=round(1000 * copy_s * crossings, 3),
        )
        base = next(r for r in rows if r.get("placement") == "one device" and r["batch"] == args.crossing_batch
                    and r["cache"] == args.crossing_cache)  # fmt: skip
        if base.get("status") == "ok" and row.get("status") == "ok":
            row["split_minus_one_device_ms_per_step"] = round(row["ms_per_decode_step"] - base["ms_per_decode_step"], 3)
        rows.append(row)
    return rows


def _time_copy(x: torch.Tensor, target: str, devices: list[str], repeats: int = 200) -> float:
    for _ in range(10):
        x.to(target)
    _sync(devices)
    t0 = time.perf_counter()
    for _ in range(repeats):
        x.to(target)
    _sync(devices)
    return (time.perf_counter() - t0) / repeats


def _scores(results: dict[str, dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Each task's measured metrics (lm-eval's placeholders for lengths not run, -1, and stderr columns left out)."""
    return {
        task: {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and v != -1 and "stderr" not in k}
        for task, metrics in results.items()
    }


def part_eval(args) -> list[dict[str, Any]]:
    """lm-eval with one process, then `accelerate launch` with one process per device; same metrics, wall times.
    Without `--eval-metadata`, the fixtures' synthetic tasks are built first (`python -m eval_tasks.ruler`)."""
    from eval_tasks import TASKS_DIR

    out_dir = Path(args.eval_out)
    metadata = args.eval_metadata
    if metadata is None:
        data = out_dir / "data"
        build = [sys.executable, "-m", "eval_tasks.ruler", "--tokenizer", "tiny-ouro", "--lengths", "1024",
                 "--num-samples", str(args.eval_samples), "--ruler-tasks", "none", "--synth-tasks",
                 "niah_single,vartrack", "--synth-haystacks", "noise", "--out", str(data)]  # fmt: skip
        subprocess.run(build, check=True, capture_output=True, text=True)
        metadata = json.dumps({"ruler_dir": str(data)})
    base = ["-m", "lm_eval", "--model", "hf-loopcache", "--model_args", args.eval_model_args, "--tasks",
            *args.eval_tasks, "--batch_size", "1", "--include_path", str(TASKS_DIR), "--metadata", metadata]  # fmt: skip
    n = len(args.devices)  # one process per listed device (a CPU dry run lists "cpu" twice)
    runs = {
        "1 process": [sys.executable, *base, "--output_path", str(out_dir / "one")],
        f"{n} processes": [
            sys.executable,
            "-m",
            "accelerate.commands.launch",
            "--multi_gpu",
            "--num_processes",
            str(n),
            "--num_machines",
            "1",
            "--mixed_precision",
            "no",
            "--dynamo_backend",
            "no",
            *base,
            "--output_path",
            str(out_dir / "dp"),
        ],  # fmt: skip
    }
    rows, metrics = [], []
    for name, cmd in runs.items():
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ})
        wall = time.perf_counter() - t0
        row: dict[str, Any] = {"part": "eval", "run": name, "wall_s": round(wall, 1), "returncode": proc.returncode}
        if proc.returncode:
            row["stderr_tail"] = proc.stderr[-1500:]
        else:
            (result,) = (out_dir / ("one" if name == "1 process" else "dp")).rglob("results_*.json")
            row["results"] = _scores(json.loads(result.read_text())["results"])
        metrics.append(row.get("results"))
        rows.append(row)
    if all(m is not None for m in metrics):
        rows.append({"part": "eval", "same_metrics": metrics[0] == metrics[1],
                     "wall_ratio": round(rows[1]["wall_s"] / rows[0]["wall_s"], 3)})  # fmt: skip
    return rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="huginn-0125", choices=sorted(SHAPES), help="model shape (random weights)")
    parser.add_argument("--devices", nargs="+", default=["cuda:0", "cuda:1"], help="devices to split over")
    parser.add_argument("--context", type=int, default=8192, help="prompt + new tokens")
    parser.add_argument("--new-tokens", type=int, default=32, help="tokens generated per row")
    parser.add_argument("--batch", type=int, default=8, help="rows: the full cache should not fit one device")
    parser.add_argument("--crossing-batch", type=int, default=1, help="rows of the crossing-cost comparison")
    parser.add_argument("--crossing-cache", default="full", choices=sorted(CACHES), help="cache of that comparison")
    parser.add_argument("--try-one-device", action="store_true", help="also run the full cache on one device")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--parts", nargs="+", default=list(PARTS), choices=PARTS)
    parser.add_argument(
        "--eval-tasks",
        nargs="+",
        default=["loopcache_synth_niah_single_noise", "loopcache_synth_vartrack_noise"],
        help="lm-eval tasks of the eval part",
    )
    parser.add_argument("--eval-samples", type=int, default=200, help="items per synthetic task (built when needed)")
    parser.add_argument(
        "--eval-model-args", default="pretrained=tiny-ouro,cache=ripe,window=64,dtype=float32", help="model_args"
    )
    parser.add_argument("--eval-metadata", default=None, help="lm-eval --metadata JSON (default: build the synth data)")
    parser.add_argument("--eval-out", default="runs/multi-gpu-eval", help="lm-eval output folder")
    parser.add_argument("--out", default="multi_gpu", help="result file name under benchmarks/results/")
    args = parser.parse_args(argv)
    if len(dict.fromkeys(args.devices)) < 2 and args.devices[0].startswith("cuda"):
        parser.error(f"--devices must name at least two GPUs to split over, got {args.devices}")
    if args.new_tokens < 2 or args.context <= args.new_tokens:
        parser.error(f"need --new-tokens >= 2 and --context > --new-tokens, got {args.new_tokens}, {args.context}")
    for name in ("batch", "crossing_batch"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be a positive int, got {getattr(args, name)}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    rows: list[dict[str, Any]] = []
    model_parts = [p for p in args.parts if p != "eval"]
    if model_parts:
        rows += part_split_and_crossing(args, model_parts)
    if "eval" in args.parts:
        rows += part_eval(args)
    for row in rows:
        print(row, flush=True)
    print("wrote", write_rows(args.out, rows))


if __name__ == "__main__":
    main()
