"""A static dense cell's one-token read, as the captured decode step runs it: cuDNN SDPA with the cell's additive mask
(`StaticDenseLayer.read_method = "sdpa"`, the default) against the split-history kernel over the BF16 storage
(`"kernel"`, `triton_ops.coded_attention`) at a grid of its launch settings (`ops.DENSE_TUNING`).

Ouro-1.4B's cell (16 query / 16 KV heads of 128), a full storage of `--context` positions (the new token written at
the last), bf16, one query per row. Each provider reads `--cells` cells of distinct storage back to back in one
CUDA graph (as a step reads its 96 cells: no cell's keys are in L2 when its read starts); time per cell is the
replay's median (`triton.testing.do_bench`, L2 flushed before each replay) over the cells. Bytes: every stored K and V.

    python -m benchmarks.bench_dense_read --out dense_read_h200            # H200: the grid below, batch 1 and 8
    python -m benchmarks.bench_dense_read --device cpu --context 96 --batches 1 --cells 2 --grid tile=16   # smoke
"""

from __future__ import annotations

import argparse
import itertools
import json
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks.common import write_rows

HEADS, HEAD_DIM = 16, 128
GRID = {"tile": [32, 64, 128], "num_warps": [4, 8], "num_stages": [2, 3], "programs_per_sm": [1, 2, 4]}


def parse_grid(items: list[str] | None) -> dict[str, list[int]]:
    """`name=v1,v2` items over `GRID`'s names (the rest keep `GRID`'s values)."""
    grid = dict(GRID)
    for item in items or []:
        name, _, values = item.partition("=")
        if name not in GRID or not values:
            raise SystemExit(f"--grid: expected NAME=V1,V2 with NAME one of {sorted(GRID)}, got {item!r}")
        grid[name] = [int(v) for v in values.split(",")]
    return grid


def _cells(batch: int, context: int, cells: int, device: str, dtype: torch.dtype) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator(device=device).manual_seed(batch)
    out = []
    for _ in range(cells):
        k = torch.randn(batch, HEADS, context, HEAD_DIM, generator=gen, device=device).to(dtype)
        v = torch.randn(batch, HEADS, context, HEAD_DIM, generator=gen, device=device).to(dtype)
        q = torch.randn(batch, HEADS, 1, HEAD_DIM, generator=gen, device=device).to(dtype)
        out.append({"q": q, "k": k, "v": v})
    return out


def _readers(cells: list[dict[str, torch.Tensor]], context: int, device: str) -> dict[str, Any]:
    """Per provider, a function reading every cell once (the storage holds `context` positions, the new token at the
    last one: as `StaticDenseLayer` reads it)."""
    from triton_ops.coded_attention import CellView
    from triton_ops.coded_attention.ops import _coded_attention_fwd

    batch = cells[0]["q"].shape[0]
    scaling = HEAD_DIM**-0.5
    pos = torch.full((1,), context - 1, dtype=torch.int64, device=device)
    valid = torch.ones(batch, context, dtype=torch.bool, device=device)
    bias = torch.zeros(batch, 1, 1, context, dtype=cells[0]["q"].dtype, device=device)

    def sdpa() -> None:
        for c in cells:
            F.scaled_dot_product_attention(c["q"], c["k"], c["v"], attn_mask=bias, scale=scaling)

    views = [
        CellView(new_key=c["k"][:, :, -1:], new_value=c["v"][:, :, -1:], length=pos, history_end=pos.expand(batch, 1),
                 history_key=c["k"], history_value=c["v"], key_valid=valid)
        for c in cells
    ]

    def kernel(tuning: dict[str, int]) -> Any:
        def run() -> None:
            for c, view in zip(cells, views):
                _coded_attention_fwd(c["q"], view, scaling=scaling, v_precision_tau=None, tuning={"dense": tuning})

        return run

    def error(tuning: dict[str, int]) -> float:
        """Largest |kernel - SDPA| over the first cell's output."""
        c = cells[0]
        got = _coded_attention_fwd(c["q"], views[0], scaling=scaling, v_precision_tau=None, tuning={"dense": tuning})[0]
        want = F.scaled_dot_product_attention(c["q"], c["k"], c["v"], attn_mask=bias, scale=scaling)
        return float((got.float() - want.float()).abs().max())

    return {"sdpa": sdpa, "kernel": kernel, "error": error}


def _time_ms(fn: Any, device: str) -> float:
    if device != "cuda":
        fn()
        return float("nan")
    import triton

    from benchmarks.bench_coded_attention import capture

    median = triton.testing.do_bench(capture(fn).replay, quantiles=[0.5], warmup=10, rep=40)
    return float(median[0] if isinstance(median, (list, tuple)) else median)  # one quantile: a float in Triton 3.6


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    parser.add_argument("--context", type=int, default=8192, help="positions of each cell's storage")
    parser.add_argument("--cells", type=int, default=8, help="cells of distinct storage read per replay")
    parser.add_argument("--grid", nargs="*", default=None, help="NAME=V1,V2 overriding the kernel grid's values")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", default="dense_read", help="result file name under benchmarks/results/")
    args = parser.parse_args(argv)
    grid = parse_grid(args.grid)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32  # the interpreter has no bf16
    rows: list[dict[str, Any]] = []
    for batch in args.batches:
        cells = _cells(batch, args.context, args.cells, args.device, dtype)
        readers = _readers(cells, args.context, args.device)
        nbytes = 2 * batch * HEADS * args.context * HEAD_DIM * cells[0]["k"].element_size()
        base = dict(batch=batch, context=args.context, cells=args.cells, bytes_per_cell=nbytes)
        configs: list[tuple[str, dict[str, int] | None]] = [("sdpa", None)]
        configs += [("kernel", dict(zip(grid, values))) for values in itertools.product(*grid.values())]
        for provider, tuning in configs:
            fn = readers["sdpa"] if tuning is None else readers["kernel"](tuning)
            try:
                err = None if tuning is None else readers["error"](tuning)
            except Exception as exc:  # noqa: BLE001 - a setting the compiler rejects is a row, not the end of the grid
                rows.append({**base, "provider": provider, "tuning": tuning, "status": f"error: {str(exc)[:160]}"})
                continue
            ms = _time_ms(fn, args.device)
            us = 1000 * ms / args.cells
            row = {**base, "provider": provider, "tuning": tuning, "status": "ok", "us_per_cell": round(us, 2),
                   "tb_s": round(nbytes / us / 1e6, 3), "max_abs_err_vs_sdpa": err}
            rows.append(row)
            print(json.dumps(row), flush=True)
        del cells, readers
        write_rows(args.out, rows)
    best = {}
    for row in rows:
        if row["status"] == "ok" and row["provider"] == "kernel":
            b = row["batch"]
            if b not in best or row["us_per_cell"] < best[b]["us_per_cell"]:
                best[b] = row
    for b, row in best.items():
        sdpa = next(r for r in rows if r["batch"] == b and r["provider"] == "sdpa")
        print(f"batch {b}: sdpa {sdpa['us_per_cell']} us, best kernel {row['us_per_cell']} us {row['tuning']}")


if __name__ == "__main__":
    main()
