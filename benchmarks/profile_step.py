"""Per-kernel GPU time of a looped model's decode step, and the gap between the kernels and the step.

Method: `torch.profiler` (CUDA activity) around a greedy `generate` of `n + 1` tokens and one of 1 token with the
same static cache (`reset()` between runs, so a captured step is replayed, not captured again); the decode step's
kernels are the difference divided by `n` (the prefill cancels). Per kernel name: GPU microseconds and launches per
step. `busy_us`: the union of the kernels' intervals per step (kernels that overlap, as programmatic dependent
launch lets them, count once), `sum_us` their plain sum; `step_ms`: the median decode step of an unprofiled run
(`StepClock`, one device sync per step), so `step_ms - busy_us` is the time the GPU ran no kernel of the step
(launch, ramp and drain gaps, the host). Modes: `graph` (the captured step: kernels inside graph replays, where the
profiler sees them) and `static` (the same step eagerly; launch gaps of the host included).

`--check`: greedy tokens and logits of the captured step with programmatic dependent launch off, on, off, on
(`triton_ops._dispatch.PDL`), per cache and batch, on a short prompt: each setting twice (a race shows as two runs
of one setting that differ), and the settings against each other.

    python -m benchmarks.profile_step --caches full kivi4 --pdl off on --out step_profile
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch
from transformers import LogitsProcessorList

from benchmarks.bench_generate import CACHES
from benchmarks.common import StepClock, build, environment
from triton_ops._dispatch import PDL, pdl_options


def _generate(model: Any, cache: Any, ids: torch.Tensor, tokens: int, mode: str, **extra: Any) -> Any:
    cache.reset()
    return model.generate(ids, cache=cache, attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=0,
                          max_new_tokens=tokens, min_new_tokens=tokens, disable_compile=mode == "static", **extra)


def _kernels(fn: Any) -> tuple[dict[str, list[float]], float, float]:
    """Per kernel name `[us, count]`, the union of the kernels' intervals (us) and their sum (us), over `fn()`."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    with profile(activities=[ProfilerActivity.CUDA] if torch.cuda.is_available() else [ProfilerActivity.CPU]) as prof:
        fn()
        sync()
    per: dict[str, list[float]] = {}
    spans = []
    for e in prof.events():
        if e.device_type != DeviceType.CUDA:
            continue
        a, b = e.time_range.start, e.time_range.end
        spans.append((a, b))
        slot = per.setdefault(e.name[:90], [0.0, 0.0])
        slot[0] += b - a
        slot[1] += 1
    busy, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b > end:
            busy += b - max(a, end)
            end = b
    return per, busy, sum(b - a for a, b in spans)


def profile_step(model: Any, cache_name: str, batch: int, context: int, steps: int, mode: str,
                 device: str = "cuda") -> dict[str, Any]:
    torch.manual_seed(batch)
    ids = torch.randint(1, model.config.vocab_size, (batch, context - steps - 1), device=device)
    cache = CACHES[cache_name](model, static=True, max_batch_size=batch, max_cache_len=context)
    _generate(model, cache, ids[:, :64], 4, mode)  # compiles, captures
    clock = StepClock(device)
    _generate(model, cache, ids, steps + 1, mode, logits_processor=LogitsProcessorList([clock]))
    long_, busy_l, sum_l = _kernels(lambda: _generate(model, cache, ids, steps + 1, mode))
    short, busy_s, sum_s = _kernels(lambda: _generate(model, cache, ids, 1, mode))
    per = {k: [round((v[0] - short.get(k, [0, 0])[0]) / steps, 1), round((v[1] - short.get(k, [0, 0])[1]) / steps, 1)]
           for k, v in long_.items()}
    top = sorted(((k, v) for k, v in per.items() if v[0] > 0.5), key=lambda kv: -kv[1][0])[:20]
    busy, total = (busy_l - busy_s) / steps, (sum_l - sum_s) / steps
    step_ms = 1000 * clock.median_step_s()
    return {"cache": cache_name, "mode": mode, "batch": batch, "context": context, "pdl": PDL["enabled"],
            "pdl_launch": pdl_options(ids)["USE_PDL"], "step_ms": round(step_ms, 3), "busy_us": round(busy, 1),
            "sum_us": round(total, 1), "gap_us": round(1000 * step_ms - busy, 1),
            "kernels_per_step": round(sum(v[1] for v in per.values()), 1), "top": top}


def check(model: Any, cache_name: str, batch: int, context: int, tokens: int, device: str = "cuda") -> dict[str, Any]:
    """Greedy tokens and logits of the captured step, PDL off, on, off, on (a fresh cache and capture each): the two
    runs of one setting must agree bit for bit (no race), and the tokens across settings."""
    torch.manual_seed(batch + 7)
    ids = torch.randint(1, model.config.vocab_size, (batch, context - tokens), device=device)
    runs = []
    before = PDL["enabled"]
    try:
        for on in (False, True, False, True):
            PDL["enabled"] = on
            cache = CACHES[cache_name](model, static=True, max_batch_size=batch, max_cache_len=context)
            _generate(model, cache, ids[:, :64], 3, "graph")
            res = _generate(model, cache, ids, tokens, "graph", return_dict_in_generate=True, output_logits=True)
            runs.append((res.sequences.cpu(), torch.stack(res.logits, 1).float().cpu()))
            del cache
    finally:
        PDL["enabled"] = before
    (s0, l0), (s1, l1), (s2, l2), (s3, l3) = runs
    return {"cache": cache_name, "batch": batch, "context": context, "new_tokens": tokens,
            "tokens_equal": bool(torch.equal(s0, s1)), "logits_max_abs_diff": float((l0 - l1).abs().max()),
            "logits_max_abs": float(l0.abs().max()), "logits_bitwise_equal": bool(torch.equal(l0, l1)),
            "off_runs_bitwise_equal": bool(torch.equal(l0, l2) and torch.equal(s0, s2)),
            "on_runs_bitwise_equal": bool(torch.equal(l1, l3) and torch.equal(s1, s3))}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="ouro-1.4b")
    parser.add_argument("--caches", nargs="+", default=["full", "kivi4"], choices=sorted(CACHES))
    parser.add_argument("--batches", nargs="+", type=int, default=[1])
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=16, help="decode steps profiled")
    parser.add_argument("--modes", nargs="+", default=["graph"], choices=("graph", "static"))
    parser.add_argument("--pdl", nargs="+", default=["off", "on"], choices=("off", "on"))
    parser.add_argument("--check", action="store_true", help="also compare tokens and logits, PDL off and on")
    parser.add_argument("--check-only", action="store_true", help="the comparison alone, no profile")
    parser.add_argument("--check-context", type=int, default=1024)
    parser.add_argument("--check-batches", nargs="+", type=int, default=[1])
    parser.add_argument("--out", default="step_profile.json", help="JSON file written")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args(argv)
    model = build(args.shape, getattr(torch, args.dtype), args.device)
    result: dict[str, Any] = {"environment": environment(), "shape": args.shape, "profiles": [], "checks": []}

    def save() -> None:
        Path(args.out).write_text(json.dumps(result) + "\n")

    t0 = time.perf_counter()
    if args.check or args.check_only:
        for cache_name in args.caches:
            for batch in args.check_batches:
                row = check(model, cache_name, batch, args.check_context, 8, args.device)
                print(row, flush=True)
                result["checks"].append(row)
                save()
    if args.check_only:
        return
    before = PDL["enabled"]
    for cache_name in args.caches:
        for batch in args.batches:
            modes = list(args.modes)
            for mode in modes:
                for pdl in args.pdl:
                    PDL["enabled"] = pdl == "on"
                    try:
                        row = profile_step(model, cache_name, batch, args.context, args.steps, mode, args.device)
                    finally:
                        PDL["enabled"] = before
                    row["elapsed_s"] = round(time.perf_counter() - t0, 1)
                    print({k: v for k, v in row.items() if k != "top"}, flush=True)
                    for name, (us, n) in row["top"][:12]:
                        print(f"    {us:8.1f} us {n:6.1f}x  {name}", flush=True)
                    result["profiles"].append(row)
                    save()
                    if mode == "graph" and row["kernels_per_step"] < 10 and "static" not in modes:
                        modes.append("static")  # the profiler does not see kernels inside graph replays here


if __name__ == "__main__":
    main()
