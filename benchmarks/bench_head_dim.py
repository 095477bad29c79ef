"""What a head dim that is no power of two costs coded attention: one cell's verification block over INT4 codes and
over a BF16 history, at head dims 64, 96 and 128 with the same heads (the kernels read 96 in zero-padded tiles of 128).

Huginn-0125's LoopKV cell by default: 55 KV heads (MHA), sink 4, window 256, pages and value groups of 32, a block of 5
new tokens (4 drafts and the last token), batch 8, 1,024 history positions, random data. If 96 costs what 128 costs
over codes and less over BF16, the padded channels' dequantization is the INT4 block's excess (session 37: 121.5 us
per cell against 78.7 for BF16 at 96), and splitting 96 into 64 + 32 could recover up to a quarter of it.

Times: each call replayed in a CUDA graph under `triton.testing.do_bench` (L2 flushed, median and p20 / p80 in us).
`python -m benchmarks.bench_head_dim --out head_dim_h100` (GPU, about 20 s); `--device cpu` checks the script under
`TRITON_INTERPRET=1` on small shapes (one untimed call per case).
"""

from __future__ import annotations

import argparse
import json

import torch

from benchmarks.bench_coded_attention import _call_once, _graph_bench
from benchmarks.common import write_rows

SINK, WINDOW, PAGE, GROUP = 4, 256, 32, 32


def _case(heads: int, d: int, batch: int, hist: int, q: int, provider: str, dev: str, dtype: torch.dtype):
    """`(fn, bytes read)` of one cell's read: `q` new tokens over `SINK` + `hist` history + `WINDOW` positions."""
    from triton_ops.coded_attention import CellView
    from triton_ops.coded_attention.ops import _coded_attention_fwd
    from triton_ops.quant.ops import quantize_keys, quantize_values

    gen = torch.Generator(device=dev).manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=dev).to(dtype)

    b, h = batch, heads
    length = SINK + hist + WINDOW
    query = randn(b, h, q, d)
    bound = torch.full((b, q), SINK + hist, dtype=torch.int32, device=dev)
    k_hist, v_hist = randn(b, h, hist, d), randn(b, h, hist, d)
    common = dict(
        new_key=randn(b, h, q, d), new_value=randn(b, h, q, d), length=length, history_end=bound,
        sink_key=randn(b, h, SINK, d), sink_value=randn(b, h, SINK, d), history_start=SINK,
        window_start=SINK + hist, window_key=randn(b, h, WINDOW, d), window_value=randn(b, h, WINDOW, d),
    )  # fmt: skip
    dense = b * h * d * 2 * 2 * (SINK + WINDOW + q)  # sink, window and new tokens: K and V, 16-bit
    if provider == "int4":
        hk = quantize_keys(k_hist, 4, group_size=PAGE, check_finite=False)
        hv = quantize_values(v_hist, 4, group_size=GROUP, check_finite=False)
        view = CellView(history_key=hk, history_value=hv, **common)
        hist_bytes = b * h * hist * d * (4 / 8 + 4 / 8 + 4 / PAGE + 4 / GROUP)
    elif provider == "bf16":
        view = CellView(history_key=k_hist, history_value=v_hist, **common)
        hist_bytes = b * h * hist * d * 2 * 2
    else:
        raise ValueError(f"`provider` must be one of ['int4', 'bf16'], got {provider!r}")
    scaling = d**-0.5
    return (lambda: _coded_attention_fwd(query, view, scaling=scaling, v_precision_tau=None)), int(hist_bytes + dense)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--heads", type=int, default=55)
    parser.add_argument("--head-dims", nargs="+", type=int, default=[64, 96, 128])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--history", type=int, default=1024, help="history positions (a multiple of the page, 32)")
    parser.add_argument("--queries", nargs="+", type=int, default=[1, 5], help="new tokens per read")
    parser.add_argument("--providers", nargs="+", default=["int4", "bf16"], choices=["int4", "bf16"])
    parser.add_argument("--out", default="head_dim")
    parser.add_argument("--device", default="cuda", help="cpu: check the script under TRITON_INTERPRET=1 (untimed)")
    args = parser.parse_args(argv)
    if args.history < PAGE or args.history % PAGE:
        parser.error(f"--history must be a positive multiple of {PAGE}, got {args.history}")
    dev = args.device
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32  # the interpreter has no bf16
    rows = []
    for q in args.queries:
        for d in args.head_dims:
            for prov in args.providers:
                fn, nbytes = _case(args.heads, d, args.batch, args.history, q, prov, dev, dtype)
                ms = _graph_bench(fn) if dev == "cuda" else _call_once(fn, [0.5, 0.2, 0.8], 0, 0)
                row = dict(
                    provider=prov, heads=args.heads, head_dim=d, batch=args.batch, history=args.history, queries=q,
                    us=round(ms[0] * 1e3, 2), us_p20=round(ms[1] * 1e3, 2), us_p80=round(ms[2] * 1e3, 2),
                    bytes_read=nbytes, tb_s=round(nbytes / ms[0] / 1e9, 3),
                )  # fmt: skip
                rows.append(row)
                print(json.dumps(row), flush=True)
    print("wrote", write_rows(args.out, rows))


if __name__ == "__main__":
    main()
