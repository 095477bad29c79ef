"""Ring sizes of static windowed caches under a rollback reserve, from the constructed caches (no weights, no GPU).

A static windowed cell (RIPE, the deepest plane, LoopKV) keeps its recent positions in a ring sized for the reserve
self-speculation sets (`gamma`) and for holes: `gamma + 1` storage positions per real token in a batch, one in a cache
of one row (`hf_loopcache.cache.layers.static.hole_span`). This builds each cache on the `meta` device (nothing is
allocated), sets the reserve and reads every ring's `capacity`; bytes are slots x KV heads x head dim x 2 (keys and
values) x 2 (bf16) x rows.

    python -m benchmarks.ring_sizes --out ring_sizes      # benchmarks/results/ring_sizes.json, and a table
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.bench_selfspec import make_cache
from benchmarks.common import build, write_rows


def ring_rows(shapes: list[str], caches: list[str], batches: list[int], gammas: list[int]) -> list[dict]:
    rows = []
    for shape in shapes:
        model = build(shape, torch.bfloat16, "meta")
        layout = model.loop_layout
        per_slot = layout.num_kv_heads * layout.head_dim * 2 * 2
        for name in caches:
            for batch in batches:
                for gamma in gammas:
                    cache = make_cache(name, model, gamma, "graph", batch, 4096)
                    cache.set_max_rollback(gamma)
                    slots = [cell.capacity for cell in cache.cells if hasattr(cell, "holes")]
                    rows.append(
                        dict(shape=shape, cache=name, batch=batch, block_size=gamma, rings=len(slots),
                             slots=sorted(set(slots)), ring_gib=round(sum(slots) * per_slot * batch / 2**30, 3))
                    )  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=["ouro-1.4b", "huginn-0125"])
    parser.add_argument("--caches", nargs="+", default=["ripe64", "loopkv-kivi4-share"])
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    parser.add_argument("--block-sizes", nargs="+", type=int, default=[0, 4, 8])
    parser.add_argument("--out", default=None, help="write benchmarks/results/OUT.json")
    args = parser.parse_args(argv)
    rows = ring_rows(args.shapes, args.caches, args.batches, args.block_sizes)
    print("| shape | cache | batch | gamma | ring slots | ring GiB |\n|---|---|---|---|---|---|")
    for r in rows:
        slots = " / ".join(map(str, r["slots"]))
        print(f"| {r['shape']} | {r['cache']} | {r['batch']} | {r['block_size']} | {slots} | {r['ring_gib']:.2f} |")
    if args.out:
        print("wrote", write_rows(args.out, rows))


if __name__ == "__main__":
    main()
