"""Sweep of `ops.DENSE_TUNING`, the launch settings of `coded_attention`'s dense (BF16) history path (GPU only).

A static dense cell's read at Ouro-1.4B's head shape (16 x 128 heads, an 8,256-slot buffer, a device-side length, 8K
positions read) for one new token (decode) and a block of 5 (a self-speculative verification), batch 1 / 8 / 16. Every
setting of tile x warps x stages x programs per SM is checked against the fp32 reference at batch 1, then timed as a
CUDA-graph replay with the L2 cache flushed (`bench_coded_attention._graph_bench`, median). Beside it: SDPA with the
static cell's additive mask over the whole buffer (what a dense decode read runs by default).

    python -m benchmarks.sweep_dense_read OUT.json
"""

from __future__ import annotations

import itertools
import json
import sys
import time

import torch
import torch.nn.functional as F

from benchmarks.bench_coded_attention import _graph_bench
from benchmarks.common import environment
from triton_ops.coded_attention import CellView
from triton_ops.coded_attention.ops import _coded_attention_fwd
from triton_ops.coded_attention.reference import reference_coded_attention

H, D, L, BUF = 16, 128, 8192, 8256
SETTINGS = [
    dict(tile=t, num_warps=w, num_stages=s, programs_per_sm=p)
    for t, w, s, p in itertools.product((32, 64, 128), (4, 8), (2, 3, 4), (1, 2, 4))
    if not (t == 128 and w == 4 and s == 4)  # more shared memory than an SM has
]


def _reference(query, nk, nv, k, v, length):
    b, q = query.shape[0], query.shape[2]
    view = CellView(
        new_key=nk.float(), new_value=nv.float(), length=length, history_end=torch.full((b, q), length, device=k.device),
        history_key=k[:, :, :length].float(), history_value=v[:, :, :length].float(),
    )  # fmt: skip
    return reference_coded_attention(query.float(), view, scaling=D**-0.5)[0]


def main(out: str) -> None:
    dev, dt = "cuda", torch.bfloat16
    gen = torch.Generator(device=dev).manual_seed(0)
    rows: list[dict] = []
    start = time.time()
    for b in (1, 8, 16):
        k = torch.randn(b, H, BUF, D, device=dev, dtype=dt, generator=gen)
        v = torch.randn(b, H, BUF, D, device=dev, dtype=dt, generator=gen)
        for q in (1, 5):
            query, nk, nv = (torch.randn(b, H, q, D, device=dev, dtype=dt, generator=gen) for _ in range(3))
            length = torch.tensor([L - q], device=dev)
            view = CellView(new_key=nk, new_value=nv, length=length, history_end=length.expand(b, q),
                            history_key=k, history_value=v)  # fmt: skip
            ref = _reference(query, nk, nv, k, v, L - q) if b == 1 else None
            for cfg in SETTINGS:

                def fn(cfg=cfg, query=query, view=view):
                    return _coded_attention_fwd(
                        query, view, scaling=D**-0.5, v_precision_tau=None, tuning={"dense": cfg}
                    )

                err = float((fn()[0].float() - ref).abs().max()) if ref is not None else None
                rows.append(dict(batch=b, q=q, **cfg, us=round(_graph_bench(fn)[0] * 1e3, 2), err=err))
            pos = torch.arange(L - q, L, device=dev)
            seen = (torch.arange(BUF, device=dev)[None, :] <= pos[:, None])[None, None].expand(b, 1, q, BUF)
            bias = torch.zeros(seen.shape, dtype=dt, device=dev).masked_fill(~seen, float("-inf"))
            kk, vv = k.clone(), v.clone()
            kk[:, :, L - q : L], vv[:, :, L - q : L] = nk, nv

            def sdpa(kk=kk, vv=vv, bias=bias, query=query):
                return F.scaled_dot_product_attention(query, kk, vv, attn_mask=bias, scale=D**-0.5)

            rows.append(dict(batch=b, q=q, provider="sdpa-mask", us=round(_graph_bench(sdpa)[0] * 1e3, 2)))
            del kk, vv
            print(b, q, f"{time.time() - start:.0f}s", flush=True)
    with open(out, "w") as f:
        json.dump(dict(environment=environment(), rows=rows), f)


if __name__ == "__main__":
    main(sys.argv[1])
