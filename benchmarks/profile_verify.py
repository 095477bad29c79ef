"""Per-kernel GPU time of a verification block against a decode step: one forward of 1 new token and one of 5 (every
loop, as self-speculative decoding verifies `gamma = 4` drafts) over a static cache after a prefill, each rolled back
by `crop` (so every forward sees the same cache).

Method: `torch.profiler` (CUDA activity) around 3 eager forwards of each size after 2 warm-up forwards of each; the
eager static forward launches the kernels the captured graphs replay. Per cache and size: the GPU microseconds and
launches per forward, in total and per kernel name (the 30 largest; CUDA kernels only, so a CPU run checks the
script and records none). `benchmarks.profile_step` profiles decode steps inside `generate` (its `_kernels` does the
counting here too); this script isolates the block a verification adds.

    python -m benchmarks.profile_verify --shape ouro-1.4b --batch 8 --prompt 1024 \\
        --caches loopkv-kivi4-share full --out profile_verify
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import torch

from benchmarks.bench_selfspec import CACHES, make_cache
from benchmarks.common import RESULTS, build, environment
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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shape", default="ouro-1.4b")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=1024)
    parser.add_argument("--caches", nargs="+", default=["loopkv-kivi4-share", "full"], choices=sorted(CACHES))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", default="profile_verify")
    args = parser.parse_args(argv)
    dev, b = args.device, args.batch
    model = build(args.shape, torch.bfloat16 if dev.startswith("cuda") else torch.float32, dev)
    vocab = min(1000, model.config.vocab_size)
    rows: dict[str, Any] = {}
    for name in args.caches:
        cache = make_cache(name, model, 4, "graph", b, args.prompt + 64)
        with torch.no_grad():
            model(input_ids=torch.randint(0, vocab, (b, args.prompt), device=dev), cache=cache, logits_to_keep=1)
            length = cache.get_seq_length()

            def forward(q: int, cache: Any = cache, length: int = length) -> None:
                model(input_ids=torch.randint(0, vocab, (b, q), device=dev), cache=cache)
                cache.crop(length)

            for q in (1, 5, 1, 5):
                forward(q)
            for q in (1, 5):
                rows[f"{name} q{q}"] = _per_forward(lambda q=q: forward(q), 3)
                print(name, q, rows[f"{name} q{q}"]["total_us"], rows[f"{name} q{q}"]["launches"], flush=True)
    path = RESULTS / f"{args.out}.json"
    header = dict(shape=args.shape, batch=b, prompt=args.prompt, new_tokens_per_forward=[1, 5])
    path.write_text(json.dumps(dict(environment=environment(), **header, rows=rows), indent=1))
    print("wrote", path)


if __name__ == "__main__":
    main()
