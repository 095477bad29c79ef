"""Per-kernel GPU time of a verification block against a decode step and a draft: one forward of 1 new token (every
loop), one of 1 token with the draft depth (`--draft-loops`), and one of `gamma + 1` = 5 new tokens (every loop, as
self-speculative decoding verifies `gamma = 4` drafts), over a static cache after a prefill, each rolled back by
`crop` (so every forward sees the same cache). They run inside `cache.speculating()`, as the decoder's do (a default
LoopKV cache then reads a block at both planes).

Method: `torch.profiler` (CUDA activity) around 3 forwards of each kind after 2 warm-up forwards of each; by default
eagerly (the eager static forward launches the kernels the captured graphs replay), with `--graph` through the
model's captured-step runner (`model.get_compiled_call`, as `self_speculative_generate` calls it: kernels inside the
graph replays, where the profiler sees them). Per cache and kind: the GPU microseconds and launches per forward, in
total and per kernel name (the 30 largest; CUDA kernels only, so a CPU run checks the script and records none), and
`wall_us`, the median of 10 unprofiled forwards timed from a synced GPU to a sync after the forward (the host and
the crop back included).
`--capacity` sets the static storage (default: the prompt + 64; `benchmarks.bench_selfspec` allocates
`prompt + (new_tokens + 1) * (gamma + 1)`, 2,309 for 1,024 + 256), `--rollback` the cache's rollback reserve
(default 0; self-speculation sets `gamma`, which sizes a windowed cell's ring for holes). `benchmarks.profile_step`
profiles decode steps inside `generate` (its `_kernels` does the counting here too); this script isolates the
forwards of a block.

    python -m benchmarks.profile_verify --shape ouro-1.4b --batch 8 --prompt 1024 --capacity 2309 --rollback 4 \\
        --graph --caches loopkv-kivi4-share full --out profile_verify
"""

from __future__ import annotations

import argparse
import json
import statistics
from typing import Any

import torch

from benchmarks.bench_selfspec import CACHES, DRAFT_LOOPS, make_cache
from benchmarks.common import RESULTS, build, environment, timed
from benchmarks.profile_step import _kernels


def _per_forward(fn: Any, calls: int) -> dict[str, Any]:
    """GPU microseconds and launches per call of `fn`, in total and per kernel name (the 30 largest), over `calls`
    calls (`profile_step._kernels`)."""
    per_name, _, _ = _kernels(lambda: [fn() for _ in range(calls)])
    top = sorted(per_name.items(), key=lambda kv: -kv[1][0])[:30]
    return dict(
        total_us=round(sum(v[0] for v in per_name.values()) / calls, 1),
        launches=round(sum(v[1] for v in per_name.values()) / calls, 1),
        top=[(name, round(us / calls, 1), round(n / calls, 1)) for name, (us, n) in top],
    )


def _wall_us(fn: Any, calls: int = 10) -> float:
    """Median microseconds of `fn()` from a synced GPU to a sync after it (`common.timed`; 0.0 without CUDA)."""
    if not torch.cuda.is_available():
        return 0.0
    return round(1e6 * statistics.median(timed(fn, "cuda")[1] for _ in range(calls)), 1)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shape", default="ouro-1.4b")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=1024)
    parser.add_argument("--capacity", type=int, default=None, help="static storage (default: the prompt + 64)")
    parser.add_argument("--graph", action="store_true", help="through the captured-step runner (CUDA graphs)")
    parser.add_argument("--draft-loops", type=int, default=None, help="the draft depth (default: bench_selfspec's)")
    parser.add_argument("--rollback", type=int, default=0,
                        help="the cache's rollback reserve (`set_max_rollback`; self-speculation sets gamma = 4)")
    parser.add_argument("--caches", nargs="+", default=["loopkv-kivi4-share", "full"], choices=sorted(CACHES))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", default="profile_verify")
    args = parser.parse_args(argv)
    dev, b = args.device, args.batch
    capacity = args.capacity or args.prompt + 64
    if args.rollback < 0:
        raise ValueError(f"`--rollback` must be a non-negative int, got {args.rollback}")
    if capacity < args.prompt + 5:
        raise ValueError(f"`--capacity` must be at least the prompt + 5 ({args.prompt + 5}), got {capacity}")
    model = build(args.shape, torch.bfloat16 if dev.startswith("cuda") else torch.float32, dev)
    draft = args.draft_loops or DRAFT_LOOPS[args.shape]
    call = model.get_compiled_call(None) if args.graph else model
    vocab = min(1000, model.config.vocab_size)
    kinds = {"q1": (1, {}), f"draft{draft}": (1, model.draft_kwargs(draft)), "q5": (5, {})}
    rows: dict[str, Any] = {}
    for name in args.caches:
        cache = make_cache(name, model, 4, "graph", b, capacity)
        cache.set_max_rollback(args.rollback)
        with torch.no_grad():
            model(input_ids=torch.randint(0, vocab, (b, args.prompt), device=dev), cache=cache, logits_to_keep=1)
            length = cache.get_seq_length()

            def forward(q: int, extra: dict, cache: Any = cache, length: int = length) -> None:
                ids = torch.randint(0, vocab, (b, q), device=dev)
                call(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=q, **extra)
                cache.crop(length)

            with cache.speculating():  # the forwards read as self-speculative decoding's (`LoopCache.speculating`)
                for _ in range(2):
                    for q, extra in kinds.values():
                        forward(q, extra)
                for kind, (q, extra) in kinds.items():
                    row = rows[f"{name} {kind}"] = _per_forward(lambda q=q, extra=extra: forward(q, extra), 3)
                    row["wall_us"] = _wall_us(lambda q=q, extra=extra: forward(q, extra))
                    print(name, kind, row["total_us"], row["launches"], row["wall_us"], flush=True)
        del cache
    path = RESULTS / f"{args.out}.json"
    header = dict(
        shape=args.shape, batch=b, prompt=args.prompt, capacity=capacity, graph=args.graph, draft_loops=draft,
        rollback=args.rollback,
        forwards={kind: dict(new_tokens=q, **extra) for kind, (q, extra) in kinds.items()},
    )
    path.write_text(json.dumps(dict(environment=environment(), **header, rows=rows), indent=1))
    print("wrote", path)


if __name__ == "__main__":
    main()
