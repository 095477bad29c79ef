"""One static cell's read at Ouro-1.4B's shape (16 KV heads of 128, 8K positions, one query per row, bf16), and bf16
logits of the captured decode step.

Rows: the static dense read by `StaticDenseLayer.read_method` (`sdpa`, `matmul`); SDPA with the same additive mask on
cuDNN only and on memory-efficient attention only; the growable cache's unmasked SDPA; a RIPE(64) shared cell. CUDA
events, median of 50; host time is included (eager calls, not a captured step). Then, on tiny models in bf16, the
logits of the first four decode steps of the growable cache (eager) against the static cache (captured on CUDA).
Writes `static_read.json` under `--out-dir`.

`--live N ...` times instead one static dense cell's one-token read when the storage (`--length` positions) holds
only N of them, as a generous `max_cache_len` leaves it, for each `StaticDenseLayer.read_method` that reads on the GPU
(`sdpa`: cuDNN over the whole storage with the step's mask; `kernel`: `coded_attention` up to the device-side
length), at batch 1 and 8, at Ouro-1.4B's head shape and Huginn-0125's (55 heads of 96): GPU time of the read
replayed in a CUDA graph, as the captured step runs it (`triton.testing.do_bench_cudagraph`, median). Writes
`static_read_live.json`.

    python -m benchmarks.bench_static_read                      # on a GPU
    python -m benchmarks.bench_static_read --device cpu --length 300   # a smoke run of the code on the CPU
    python -m benchmarks.bench_static_read --length 8192 --live 1024 4096 8191
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from hf_loopcache import FullLoopCache, RIPECache
from hf_loopcache.cache.layers.static import StaticDenseLayer, static_mask
from hf_loopcache.cache.layers.static_coded import StaticCodedSharedLayer
from hf_loopcache.cache.read import ReadState


def _median_us(fn, device: str, n: int = 50) -> float:
    if device == "cpu":
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e6
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(n):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1000)
    return sorted(times)[len(times) // 2]


def cell_reads(device: str, length: int, heads: int = 16, dim: int = 128) -> list[dict[str, Any]]:
    dtype = torch.bfloat16 if device != "cpu" else torch.float32
    rows: list[dict[str, Any]] = []
    default = StaticDenseLayer.read_method
    for batch in (1, 8):
        source = StaticDenseLayer(batch, length)
        keys = torch.randn(batch, heads, length - 1, dim, device=device, dtype=dtype)
        source.lazy_initialization(keys, keys)
        source.k[:, :, : length - 1] = keys
        source.v[:, :, : length - 1] = keys
        valid = torch.ones(batch, length, dtype=torch.bool, device=device)
        positions = torch.tensor([length - 1], device=device)
        mask = static_mask(positions, valid)
        query = torch.randn(batch, heads, 1, dim, device=device, dtype=dtype)

        def read(valid=valid, positions=positions, mask=mask) -> ReadState:
            return ReadState(key_valid=valid, scaling=dim**-0.5, positions=positions, static_valid=valid,
                             static_mask=mask, length=length - 1)

        def dense_step(source=source, query=query, read=read) -> torch.Tensor:
            source.length = length - 1
            return source.attend(query, query, query, read())

        for method in ("sdpa", "matmul"):
            StaticDenseLayer.read_method = method
            rows.append({"cell": "static dense", "read": method, "batch": batch,
                         "us": round(_median_us(dense_step, device), 1)})
        StaticDenseLayer.read_method = default
        k, v = source.k, source.v
        bias = torch.zeros(mask.shape, dtype=dtype, device=device).masked_fill(~mask, float("-inf"))
        if device != "cpu":
            from torch.nn.attention import SDPBackend, sdpa_kernel

            for label, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("efficient", SDPBackend.EFFICIENT_ATTENTION)):
                with sdpa_kernel([backend]):
                    us = _median_us(
                        lambda q=query, k=k, v=v, bias=bias: F.scaled_dot_product_attention(q, k, v, attn_mask=bias),
                        device,
                    )
                rows.append({"cell": f"masked SDPA, {label} only", "batch": batch, "us": round(us, 1)})
        us = _median_us(lambda q=query, k=k, v=v: F.scaled_dot_product_attention(q, k, v), device)
        rows.append({"cell": "growable: unmasked SDPA", "batch": batch, "us": round(us, 1)})
        shared = StaticCodedSharedLayer(source, sink=0, window=64, page_size=1, rollback=0, max_batch_size=batch,
                                        max_cache_len=length)
        shared.lazy_initialization(keys[:, :, :1], keys[:, :, :1])

        def shared_step(shared=shared, query=query, read=read) -> torch.Tensor:
            shared.length = shared.high = length - 1
            return shared.attend(query, query, query, read())  # a fresh ReadState: the geometry is made in the call

        rows.append({"cell": "static shared (RIPE 64)", "read": "coded_attention in place", "batch": batch,
                     "us": round(_median_us(shared_step, device), 1)})
    return rows


def live_reads(device: str, capacity: int, lives: list[int]) -> list[dict[str, Any]]:
    """One-token reads of a static dense cell of `capacity` positions holding `live` of them (see the docstring)."""
    dtype = torch.bfloat16 if device != "cpu" else torch.float32
    rows: list[dict[str, Any]] = []
    default = StaticDenseLayer.read_method
    for shape, heads, dim in (("ouro-1.4b", 16, 128), ("huginn-0125", 55, 96)):
        for batch in (1, 8):
            cell = StaticDenseLayer(batch, capacity)
            stored = torch.randn(batch, heads, capacity, dim, device=device, dtype=dtype)
            cell.lazy_initialization(stored[:, :, :1], stored[:, :, :1])
            cell.k.copy_(stored)
            cell.v.copy_(stored)
            query = torch.randn(batch, heads, 1, dim, device=device, dtype=dtype)
            for live in lives:
                valid = torch.arange(capacity, device=device)[None].expand(batch, capacity) < live
                valid = valid.contiguous()
                positions = torch.tensor([live - 1], device=device)
                read = ReadState(key_valid=None, scaling=dim**-0.5, positions=positions, static_valid=valid,
                                 static_mask=static_mask(positions, valid), length=live - 1)  # fmt: skip
                new = stored[:, :, live - 1 : live]
                for method in ("sdpa", "kernel"):
                    StaticDenseLayer.read_method = method
                    us = _graph_us(functools.partial(cell.read_storage, query, new, new, read, positions), device)
                    rows.append({"cell": "static dense, live", "shape": shape, "read": method, "batch": batch,
                                 "capacity": capacity, "live": live, "us": us})  # fmt: skip
                    print(rows[-1], flush=True)
                StaticDenseLayer.read_method = default
    return rows


def _graph_us(fn, device: str) -> float:
    """Median GPU microseconds of `fn` replayed in a CUDA graph (on the CPU: one timed call, a smoke value)."""
    if device == "cpu":
        start = time.perf_counter()
        fn()
        return round((time.perf_counter() - start) * 1e6, 1)
    import triton

    fn()  # compile and warm up outside the capture
    torch.cuda.synchronize()
    return round(triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median") * 1000, 1)


def bf16_logits(device: str) -> list[dict[str, Any]]:
    from tests.helpers import tiny_huginn, tiny_ouro

    rows = []
    for build, extra in ((tiny_ouro, {}), (tiny_huginn, {"init_scale": 0.0})):
        model = build().to(device, torch.bfloat16)
        ids = torch.randint(3, 64, (3, 20), device=device)
        mask = torch.ones_like(ids)
        mask[-1, :5] = 0
        for name in ("full", "ripe4"):
            def make(model=model, name=name, **kw):
                return FullLoopCache(model, **kw) if name == "full" else RIPECache(model, window=4, **kw)

            gen = dict(attention_mask=mask, max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0,
                       output_logits=True, return_dict_in_generate=True, **extra)
            eager = model.generate(ids, cache=make(), **gen)
            cache = make(static=True, max_batch_size=3, max_cache_len=40)
            static = model.generate(ids, cache=cache, **gen)
            diffs = [
                float((a.float() - b.float()).abs().max() / a.float().abs().max())
                for a, b in zip(eager.logits[:4], static.logits[:4])
            ]
            rows.append({"model": type(model).__name__, "cache": name, "captured": cache.captured_steps(),
                         "rel_max_logit_diff_steps_0_3": [round(d, 4) for d in diffs],
                         "tokens_equal": bool(torch.equal(eager.sequences, static.sequences))})
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--length", type=int, default=8192, help="positions of the storage")
    parser.add_argument("--live", nargs="+", type=int, default=None,
                        help="time one-token reads of a storage holding these many positions (see the docstring)")
    parser.add_argument("--out-dir", default="benchmarks/results")
    args = parser.parse_args(argv)
    if args.live is not None:
        if not all(1 <= n <= args.length for n in args.live):
            raise ValueError(f"`--live` counts must be in [1, --length={args.length}], got {args.live}")
        rows = live_reads(args.device, args.length, args.live)
        path = Path(args.out_dir) / "static_read_live.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(rows, indent=1) + "\n")
        print("wrote", path)
        return
    rows = cell_reads(args.device, args.length)
    if args.device != "cpu":
        rows += bf16_logits(args.device)
    for row in rows:
        print(row, flush=True)
    path = Path(args.out_dir) / "static_read.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(rows, indent=1) + "\n")
    print("wrote", path)


if __name__ == "__main__":
    main()
