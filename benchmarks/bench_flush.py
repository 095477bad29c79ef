"""The page flush of a static LoopKV decode step: the time of one step's flushes over every coded cell, with the
fused kernel (`triton_ops.quant.flush_page`, one launch per cell) and with the op-by-op path it replaces, beside the
captured decode step's time (issue #14: "the flush step that quantizes every cell's page under 5% of a decode step").

Method, per batch size (Ouro-1.4B's shape, random weights, bf16, a static `kivi4` cache of `--context` positions;
sink 32, window 256, pages of 32; the prompt fills it to `context - new_tokens`):

- `flush_ms`: one decode step's flushes, as the step runs them (the shared geometry once, then every coded cell's
  flush), captured in a CUDA graph and replayed by `triton.testing.do_bench` (L2 flushed before every replay; median,
  p20, p80), as `bench_coded_attention.py` times its graph rows. A flush writes the same page every time, so replays
  are idempotent. `kernels_per_step_flush`: CUDA kernels in that graph's eager run (`torch.profiler`).
- `step_ms`: the decode step of the same cache and shape through `generate`'s captured one-token step
  (`bench_generate.run_one(mode="graph")`: (full - prefill-only) / steps), with the same flush path.
- `flush_fraction = flush_ms / step_ms`.
- `bytes_equal`: the page each cell's flush wrote holds the same bytes on both paths (checked, not timed).

Paths (`--paths`): `unfused`, the flush as it was before `flush_page` (ring `index_select`, the Triton quantize kernels
for keys and values, the destination page with `torch.where`, seven `index_copy_`; about a dozen launches per cell);
`fused`, `StaticCodedLayer.flush` (one launch per cell on CUDA).

GPU: `python -m benchmarks.run flush --out flush_h200` (batches 1 8 at context 8192 by default). CPU smoke run (checks
the code path, numbers mean nothing; the fused path is the reference there unless `TRITON_INTERPRET=1`):
`python -m benchmarks.run flush --device cpu --shape micro-ouro --batches 2 --context 400 --new-tokens 4`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from typing import Any

import torch

from benchmarks.common import build, write_rows
from hf_loopcache import LoopKVCache
from hf_loopcache.cache.layers import StaticCodedLayer
from hf_loopcache.cache.read import ReadState
from hf_loopcache.cache.storage import quantize_pages

PATHS = ("unfused", "fused")


def unfused_flush(cell: StaticCodedLayer, read: ReadState, positions: torch.Tensor) -> None:
    """`StaticCodedLayer.flush` before the fused kernel, op by op (the baseline; the same bytes)."""
    geo = cell._geometry(read, positions)
    ring_k, ring_v = cell._views()
    k, v = ring_k.index_select(2, geo["slots"]), ring_v.index_select(2, geo["slots"])
    mask = geo["valid"]
    qk, qv = quantize_pages(k, v, cell.nbits, page_size=cell.page, group_size=cell.group,
                            valid=None if mask is None else mask[: cell.rows], check_finite=False)  # fmt: skip
    page = torch.where(geo["due"] & (geo["start"] >= cell.floor_t), geo["page"], cell.num_pages)
    own_k, own_v = cell._codes(cell.num_pages + 1)
    tokens = (page[:, None] * cell.page + torch.arange(cell.page, device=page.device)).flatten()  # [K * P]
    own_k.codes.index_copy_(2, tokens, qk.codes)
    own_k.scale.index_copy_(2, page, qk.scale)
    own_k.zero.index_copy_(2, page, qk.zero)
    own_v.hi.index_copy_(2, tokens, qv.hi)
    own_v.scale.index_copy_(2, tokens, qv.scale)
    own_v.zero.index_copy_(2, tokens, qv.zero)
    if qv.lo is not None and own_v.lo is not None:
        own_v.lo.index_copy_(2, tokens, qv.lo)


@contextlib.contextmanager
def flush_path(path: str):
    """Every `StaticCodedLayer` flushes by `path` inside the block (`fused` is the library's own `flush`)."""
    if path not in PATHS:
        raise ValueError(f"`path` must be one of {PATHS}, got {path!r}")
    original = StaticCodedLayer.flush
    if path == "unfused":
        StaticCodedLayer.flush = unfused_flush  # type: ignore[method-assign]
    try:
        yield
    finally:
        StaticCodedLayer.flush = original  # type: ignore[method-assign]


def _step_flushes(cells: list[StaticCodedLayer], positions: torch.Tensor, valid: torch.Tensor, length: int):
    """One decode step's flushes: a fresh per-forward state (the shared geometry is computed once, in the first
    cell's flush, as in a forward), then every coded cell's flush."""
    read = ReadState(key_valid=None, scaling=1.0, positions=positions, static_valid=valid, length=length)
    for cell in cells:
        cell.flush(read, positions)


def _written_pages(cells, positions, valid, length) -> list[int]:
    """The (last) page each cell's flush writes at this step (host; outside every timing)."""
    read = ReadState(key_valid=None, scaling=1.0, positions=positions, static_valid=valid, length=length)
    pages = []
    for cell in cells:
        geo = cell._geometry(read, positions)
        due = bool(geo["due"][-1]) and int(geo["start"][-1]) >= int(cell.floor_t)
        pages.append(int(geo["page"][-1]) if due else cell.num_pages)
    return pages


def _page_views(cell: StaticCodedLayer, page: int) -> list[torch.Tensor]:
    keys, values = cell._codes(cell.num_pages + 1)
    t0, t1 = page * cell.page, (page + 1) * cell.page
    parts = [keys.codes[:, :, t0:t1], keys.scale[:, :, page], keys.zero[:, :, page], values.hi[:, :, t0:t1],
             values.scale[:, :, t0:t1], values.zero[:, :, t0:t1]]  # fmt: skip
    return parts + ([] if values.lo is None else [values.lo[:, :, t0:t1]])


def _clear(cells, pages) -> None:
    """Zero the pages the flushes write, so that each path's bytes are its own."""
    for cell, page in zip(cells, pages):
        for t in _page_views(cell, page):
            t.zero_()


def _time(fn, device: str) -> tuple[float, float, float]:
    """Median / p20 / p80 ms: a CUDA graph of `fn` replayed (L2 flushed by do_bench) on CUDA; one timed eager call
    elsewhere."""
    if device.startswith("cuda"):
        from benchmarks.bench_coded_attention import _graph_bench

        return tuple(_graph_bench(fn))  # type: ignore[return-value]
    fn()
    start = time.perf_counter()
    fn()
    ms = 1000 * (time.perf_counter() - start)
    return ms, ms, ms


def _count_kernels(fn) -> int | None:
    if not torch.cuda.is_available():
        return None
    from benchmarks.bench_generate import _count_kernels as count

    return count(fn)


def flush_rows(model, shape: str, batch: int, context: int, new_tokens: int, device: str,
               paths: tuple[str, ...]) -> list[dict[str, Any]]:  # fmt: skip
    """Time one step's flushes on every path for one batch size (the cache filled by a prefill)."""
    prompt = context - new_tokens
    cache = LoopKVCache(model, "kivi4", tau=None, static=True, max_batch_size=batch, max_cache_len=context)
    torch.manual_seed(batch)
    ids = torch.randint(1, model.config.vocab_size, (batch, prompt), device=device)
    with torch.no_grad():  # the prefill codes the prompt's pages; the logits of its last position only
        model(input_ids=ids, attention_mask=torch.ones_like(ids), past_key_values=cache, use_cache=True,
              logits_to_keep=1)  # fmt: skip
    cells = [c for c in cache.cells if isinstance(c, StaticCodedLayer)]
    positions = torch.tensor([prompt], device=device)
    valid = cache._valid_t[:batch]
    pages = _written_pages(cells, positions, valid, prompt)
    rows, written = [], {}
    for path in paths:
        _clear(cells, pages)
        with flush_path(path):
            fn = lambda: _step_flushes(cells, positions, valid, prompt)  # noqa: E731
            with torch.no_grad():
                ms, p20, p80 = _time(fn, device)
                kernels = _count_kernels(fn)
        written[path] = [t.clone() for cell, page in zip(cells, pages) for t in _page_views(cell, page)]
        rows.append({
            "shape": shape, "cache": "kivi4", "path": path, "batch": batch, "context": context, "prompt": prompt,
            "dtype": str(next(model.parameters()).dtype).replace("torch.", ""), "coded_cells": len(cells),
            "flush_impl": ("triton" if device.startswith("cuda") else "reference") if path == "fused" else "op-by-op",
            "flush_ms": round(ms, 4), "flush_ms_p20": round(p20, 4), "flush_ms_p80": round(p80, 4),
            "flush_us_per_cell": round(1000 * ms / max(1, len(cells)), 2), "kernels_per_step_flush": kernels,
            "pages_due": sum(p < c.num_pages for p, c in zip(pages, cells)),
        })  # fmt: skip
    if len(written) == 2:
        same = all(torch.equal(a, b) for a, b in zip(*written.values()))
        for row in rows:
            row["bytes_equal"] = same
    del cache
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="ouro-1.4b")
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--new-tokens", type=int, default=64, help="decode steps of the step-time run")
    parser.add_argument("--paths", nargs="+", choices=PATHS, default=list(PATHS))
    parser.add_argument("--no-step", action="store_true", help="skip the decode-step runs (flush times only)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 elsewhere")
    parser.add_argument("--out", default="flush_h200")
    args = parser.parse_args(argv)
    from benchmarks.bench_generate import run_one

    device = args.device
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if device.startswith("cuda") else torch.float32)
    model = build(args.shape, dtype, device)
    rows: list[dict[str, Any]] = []
    for batch in args.batches:
        batch_rows = flush_rows(model, args.shape, batch, args.context, args.new_tokens, device, tuple(args.paths))
        for row in batch_rows:
            if not args.no_step:
                with flush_path(row["path"]):  # the step with the same flush path
                    step = run_one(model, args.shape, "kivi4", batch, args.context, args.new_tokens, device,
                                   mode="graph" if device.startswith("cuda") else "static")  # fmt: skip
                row.update(step_mode=step["mode"], step_ms=step.get("ms_per_decode_step"), step_status=step["status"])
                if row["step_ms"]:
                    row["flush_fraction"] = round(row["flush_ms"] / row["step_ms"], 4)
            rows.append(row)
            print(json.dumps(row), flush=True)
            write_rows(args.out, rows)  # rewritten after every row: a stopped run keeps what finished
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    path = write_rows(args.out, rows)
    print("wrote", path)
    _summary(rows)


def _summary(rows: list[dict[str, Any]]) -> None:
    print("batch  path      flush ms (p20-p80)      us/cell  kernels  step ms  flush/step  bytes equal")
    for r in rows:
        frac = f"{100 * r['flush_fraction']:6.2f}%" if r.get("flush_fraction") is not None else "     -"
        step = f"{r['step_ms']:8.3f}" if r.get("step_ms") else "       -"
        print(f"{r['batch']:5d}  {r['path']:8s} {r['flush_ms']:8.4f} ({r['flush_ms_p20']:.4f}-{r['flush_ms_p80']:.4f})"
              f"  {r['flush_us_per_cell']:7.2f}  {r['kernels_per_step_flush']!s:>7}  {step}  {frac}  "
              f"{r.get('bytes_equal', '-')}")  # fmt: skip


if __name__ == "__main__":
    main()
