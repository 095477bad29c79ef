"""Per-kernel GPU time of a looped model's decode step, and the gap between the kernels and the step.

Method: `torch.profiler` (CUDA activity) around a greedy `generate` of `n + 1` tokens and one of 1 token with the
same static cache (`reset()` between runs, so a captured step is replayed, not captured again); the decode step's
kernels are the difference divided by `n` (the prefill cancels). Per kernel name: GPU microseconds and launches per
step. `busy_us`: the union of the kernels' intervals per step (kernels that overlap, as programmatic dependent
launch lets them, count once), `sum_us` their plain sum; `step_ms`: the median decode step of an unprofiled run
(`StepClock`, one device sync per step), so `step_ms - busy_us` is the time the GPU ran no kernel of the step
(launch, ramp and drain gaps, the host). Modes: `graph` (the captured step: kernels inside graph replays, where the
profiler sees them) and `static` (the same step eagerly; launch gaps of the host included).

`--gaps` (`host_gaps`): the host side of a captured step instead: the step against its forward replayed back to back
and from an idle GPU, the host timeline from one step's sync to the next replay, and a CPU + CUDA profile of the gaps
(the profiler slows the step: compare its `profiled_step_us` with `step_ms`; it shows where the host works while the
GPU waits, not for how long without it).

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
    return per, busy_us(spans), sum(b - a for a, b in spans)


def busy_us(spans: list[tuple[float, float]]) -> float:
    """The length of the union of `(start, end)` intervals (kernels that overlap count once)."""
    busy, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b > end:
            busy += b - max(a, end)
            end = b
    return busy


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


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 2]


def host_gaps(
    model: Any, cache_name: str, batch: int, context: int, steps: int, device: str = "cuda"
) -> dict[str, Any]:
    """Where a captured `generate` step spends the time its kernels do not.

    - `step_ms`: the median decode step (`StepClock`); `replay_back_to_back_ms`: the captured forward replayed 20
      times in a row (one sync); `replay_from_idle_ms`: one replay with a sync before and after (median of 15);
      `replay_host_us`: the host time of `graph.replay()` itself.
    - `host_us`: the host timeline of a step, medians over the steps of a timed `generate`: from the logits
      processor's sync (the GPU has finished the step) to our decode call (`generate_us`: transformers' work between
      two forwards, its stop check's sync included), from there to the replay (`pre_replay_us`), the replay call
      (`replay_us`) and the rest of our call (`post_replay_us`).
    - From a CPU + CUDA profile of `steps` decode steps (from the first graph launch on): the step's span and its
      kernels' union per step, the GPU's idle intervals of at least 5 us per step, the host events that overlap them
      (the 25 names with the most overlapped time) and the idle time no host event covers (Python between ops)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from hf_loopcache.models._graphs import DecodeGraphs

    if not device.startswith("cuda"):
        raise SystemExit("--gaps times CUDA graph replays: it needs --device cuda")
    torch.manual_seed(batch)
    ids = torch.randint(1, model.config.vocab_size, (batch, context - 64), device=device)
    cache = CACHES[cache_name](model, static=True, max_batch_size=batch, max_cache_len=context)
    _generate(model, cache, ids[:, :64], 4, "graph")  # compiles, captures
    marks: list[tuple[str, float]] = []
    call, replay = DecodeGraphs.__call__, torch.cuda.CUDAGraph.replay

    def timed_call(self: Any, *a: Any, **k: Any) -> Any:
        marks.append(("enter", time.perf_counter()))
        out = call(self, *a, **k)
        marks.append(("exit", time.perf_counter()))
        return out

    def timed_replay(self: Any) -> None:
        marks.append(("replay", time.perf_counter()))
        replay(self)
        marks.append(("replayed", time.perf_counter()))

    class Mark(StepClock):
        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            out = super().__call__(input_ids, scores)
            marks.append(("sync", self.times[-1]))
            return out

    clock = Mark(device, sync=True)  # host times: the GPU has finished the step at each mark
    DecodeGraphs.__call__, torch.cuda.CUDAGraph.replay = timed_call, timed_replay  # type: ignore[method-assign]
    try:
        _generate(model, cache, ids, steps + 1, "graph", logits_processor=LogitsProcessorList([clock]))
    finally:
        DecodeGraphs.__call__, torch.cuda.CUDAGraph.replay = call, replay  # type: ignore[method-assign]
    step_ms = 1000 * clock.median_step_s()
    parts: dict[str, list[float]] = {"generate_us": [], "pre_replay_us": [], "replay_us": [], "post_replay_us": []}
    for i in range(len(marks) - 4):
        names = [m[0] for m in marks[i : i + 5]]
        if names == ["sync", "enter", "replay", "replayed", "exit"]:
            t = [m[1] for m in marks[i : i + 5]]
            for key, a, b in (("generate_us", 0, 1), ("pre_replay_us", 1, 2), ("replay_us", 2, 3),
                              ("post_replay_us", 3, 4)):
                parts[key].append(1e6 * (t[b] - t[a]))
    host_us = {k: round(_median(v), 1) if v else None for k, v in parts.items()}
    entry = next(e for k, e in cache._graphs.items() if e is not None and k[1] == 1)
    sync = torch.cuda.synchronize
    sync()  # the cache holds `context - 64 + steps + 1` positions; the replays below write at most 40 more
    t0 = time.perf_counter()
    for _ in range(20):
        entry.graph.replay()
    sync()
    b2b_ms = 1000 * (time.perf_counter() - t0) / 20
    idle, host = [], []
    for _ in range(15):
        sync()
        t0 = time.perf_counter()
        entry.graph.replay()
        t1 = time.perf_counter()
        sync()
        idle.append(1000 * (time.perf_counter() - t0))
        host.append(1e6 * (t1 - t0))
    cache.reset()
    _generate(model, cache, ids, 2, "graph")
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        _generate(model, cache, ids, steps + 1, "graph")
        sync()
    cuda, cpu = [], []
    for e in prof.events():
        span = (e.time_range.start, e.time_range.end)
        (cuda if e.device_type == DeviceType.CUDA else cpu).append((span, e.name))
    launches = sorted(a for (a, _), name in cpu if name == "cudaGraphLaunch")
    start = launches[0] if launches else 0.0
    cuda = sorted(span for span, _ in cuda if span[0] >= start)
    n = max(1, len(launches))
    gaps, busy, end = [], 0.0, start
    for a, b in cuda:
        if a - end >= 5:
            gaps.append((end, a))
        if b > end:
            busy += b - max(a, end)
            end = b
    over: dict[str, float] = {}
    for (a, b), name in cpu:
        for g0, g1 in gaps:
            o = min(b, g1) - max(a, g0)
            if o > 0:
                over[name[:80]] = over.get(name[:80], 0.0) + o
    top = sorted(over.items(), key=lambda kv: -kv[1])[:25]
    bare = 0.0  # gap time no host event covers: Python between the profiled ops
    for g0, g1 in gaps:
        covered, edge = 0.0, g0
        for a, b in sorted((max(a, g0), min(b, g1)) for (a, b), _ in cpu if a < g1 and b > g0):
            if b > edge:
                covered += b - max(a, edge)
                edge = b
        bare += (g1 - g0) - covered
    return {"cache": cache_name, "batch": batch, "context": context, "step_ms": round(step_ms, 3), "host_us": host_us,
            "replay_back_to_back_ms": round(b2b_ms, 3), "replay_from_idle_ms": round(_median(idle), 3),
            "replay_host_us": round(_median(host), 1), "profiled_steps": len(launches),
            "profiled_step_us": round((end - start) / n, 1), "profiled_busy_us": round(busy / n, 1),
            "gaps_per_step": round(len(gaps) / n, 2), "gap_us_per_step": round(sum(b - a for a, b in gaps) / n, 1),
            "uncovered_us_per_step": round(bare / n, 1), "largest_gaps_us": sorted(
                (round(b - a, 1) for a, b in gaps), reverse=True)[:12],
            "host_in_gaps": [(name, round(us / n, 1)) for name, us in top]}


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
    parser.add_argument("--gaps", action="store_true", help="the host side of a captured step (`host_gaps`) alone")
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
    if args.gaps:
        result["gaps"] = []
        for cache_name in args.caches:
            for batch in args.batches:
                row = host_gaps(model, cache_name, batch, args.context, args.steps, args.device)
                print({k: v for k, v in row.items() if k != "host_in_gaps"}, flush=True)
                for name, us in row["host_in_gaps"]:
                    print(f"    {us:8.1f} us  {name}", flush=True)
                result["gaps"].append(row)
                save()
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
