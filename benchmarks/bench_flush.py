"""The page flush of a static LoopKV decode step: what one forward's flushes over every coded cell cost as a captured
step pays them, with the library's flush (`triton_ops.quant.flush_page_table`: one launch per code format in a
complete forward, coding a page only in the forward where it becomes due), the same without the `coded` slots
(re-coding every due page every forward: what a forward in which a page becomes due costs), both with one launch per
cell (`flush_page`; without slots, the flush before this change), and the op-by-op path the kernel replaced, beside
the captured decode step's time (issue #14: "the flush step that quantizes every cell's page under 5% of a decode
step").

Method, per cache (`--caches`: kivi4, kivi4-share, hand) and batch size (Ouro-1.4B's shape, random weights, bf16, a
static cache of `--context` positions; sink 32, window 256, pages of 32; the prompt fills it to
`context - new_tokens`, so a page is due):

- The flushes of one forward, exactly what a replayed step runs for them: a fresh per-forward state, the shared
  device geometry (computed once, memoized across cells, as in a forward) and every coded cell's `flush`.
  `graph_ms`: those captured in one CUDA graph, replayed by `triton.testing.do_bench` (L2 flushed before every
  replay: the ring pages a flush codes were last touched a step ago, after gigabytes of weights, so cold, as in a
  step; median, p20, p80). `graph_warm_ms`: the same graph replayed back to back (CUDA events around 50 replays: L2
  warm, a lower bound). `eager_ms`: the same flushes called eagerly (CUDA events around 20 calls: Python and launch
  cost included; NOT what a captured step pays). `kernels_per_step_flush` / `kernel_us_per_step_flush`: the CUDA
  kernels of one eager call (after one more, so that the slots are in the state the timings see) and the sum of
  their own GPU time (`torch.profiler`): the flush's work without launch gaps.
- `step_ms`: the captured decode step of the same cache, batch and context through `generate`
  (`bench_generate.run_one(mode="graph", timing="steps")`: one run, timed from the first generated token to the
  last by a synchronising logits processor; one run per cache and batch, with the library's flush). `flush_fraction = graph_ms / step_ms`.
- Paths (`--paths`): `table`, the library's flush (in a complete forward one launch per code format over a device
  table of the cells' storage, `FlushGroup`; each page coded once: the graph replays after the first find the page
  coded, so this is the cost of the `P - 1` forwards in `P` in which no page becomes due); `table-every`, the same
  launch without the `coded` slots (every due page coded every forward: the cost of the forward in which a page
  becomes due); `percell` and `percell-every`, the same with one launch per cell (`percell-every` is the flush before
  this change); `unfused`, op by op per cell (ring `index_select`, the Triton quantizers, `torch.where`, seven
  `index_copy_`). `mean_step_flush_ms` (on the `table` and `percell` rows) = ((P - 1) * idle + due) / P, the flush's
  average per decode step.
- `bytes_equal`: the page each cell's flush writes holds the same bytes on every path (checked, not timed).

GPU: `python -m benchmarks.run flush --out flush_h200_v2` (kivi4, kivi4-share, hand at batches 1 and 8, context
8192). CPU smoke run (checks the code path, numbers mean nothing; the fused paths run the reference there unless
`TRITON_INTERPRET=1`): `python -m benchmarks.run flush --device cpu --shape micro-ouro --batches 2 --context 400
--new-tokens 4`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from typing import Any

import torch

from benchmarks.common import build, write_rows
from hf_loopcache.cache.layers import StaticCodedLayer
from hf_loopcache.cache.layers.static_coded import FlushGroup
from hf_loopcache.cache.read import ReadState
from hf_loopcache.cache.storage import quantize_pages

PATHS = ("unfused", "percell-every", "percell", "table-every", "table")
_SWITCHES = {  # path: (one launch per code format (`FlushGroup`), the `coded` slots)
    "percell-every": (False, False), "percell": (False, True), "table-every": (True, False), "table": (True, True),
}  # fmt: skip
CACHES = ("kivi4", "kivi4-share", "hand")


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
    """Every `StaticCodedLayer` flushes by `path` inside the block: `table` is the library's own (one launch per code
    format in a complete forward, each page coded once); `-every` without the `coded` slots (every due page coded every
    forward), `percell` one launch per cell, `unfused` op by op per cell."""
    if path not in PATHS:
        raise ValueError(f"`path` must be one of {PATHS}, got {path!r}")
    original, slots, group = StaticCodedLayer.flush, StaticCodedLayer._coded_slots, FlushGroup.flush
    table, coded = _SWITCHES.get(path, (False, False))
    if path == "unfused":
        StaticCodedLayer.flush = unfused_flush  # type: ignore[method-assign]
    if not coded:
        StaticCodedLayer._coded_slots = lambda self: None  # type: ignore[method-assign]
    if not table:
        FlushGroup.flush = lambda self, cell, read, positions: False  # type: ignore[method-assign]
    try:
        yield
    finally:
        StaticCodedLayer.flush, StaticCodedLayer._coded_slots = original, slots  # type: ignore[method-assign]
        FlushGroup.flush = group  # type: ignore[method-assign]


def _step_flushes(cells: list[StaticCodedLayer], positions: torch.Tensor, valid: torch.Tensor, length: int):
    """One decode step's flushes, as a complete forward runs them: a fresh per-forward state (the shared geometry is
    computed once, memoized), then every coded cell's `prepare` (the first flushes its whole `FlushGroup` in one
    launch on the `table` paths; the others find themselves flushed)."""
    read = ReadState(key_valid=None, scaling=1.0, positions=positions, static_valid=valid, length=length)
    for cell in cells:
        cell.prepare(read, positions)


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
    """Zero the pages the flushes write and forget the slots, so that each path's bytes are its own."""
    for cell, page in zip(cells, pages):
        for t in _page_views(cell, page):
            t.zero_()
        cell._forget()


def _time(fn, device: str) -> dict[str, float]:
    """On CUDA: `graph_ms` (p20, p80), a CUDA graph of `fn` replayed with L2 flushed before each replay (do_bench);
    `graph_warm_ms`, back-to-back replays; `eager_ms`, eager calls. Elsewhere one timed eager call for each."""
    if not device.startswith("cuda"):
        fn()
        start = time.perf_counter()
        fn()
        ms = 1000 * (time.perf_counter() - start)
        return dict(graph_ms=ms, graph_ms_p20=ms, graph_ms_p80=ms, graph_warm_ms=ms, eager_ms=ms)
    import triton

    from benchmarks.bench_coded_attention import capture

    graph = capture(fn)
    med, p20, p80 = triton.testing.do_bench(graph.replay, quantiles=[0.5, 0.2, 0.8], warmup=10, rep=40)

    def events(call, n):
        call()
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(n):
            call()
        b.record()
        torch.cuda.synchronize()
        return a.elapsed_time(b) / n

    warm, eager = events(graph.replay, 50), events(fn, 20)
    del graph
    return dict(graph_ms=med, graph_ms_p20=p20, graph_ms_p80=p80, graph_warm_ms=warm, eager_ms=eager)


def _kernels(fn) -> tuple[int | None, float | None]:
    """CUDA kernels of one eager call of `fn` and the sum of their GPU time in us (`torch.profiler`: each kernel's
    own duration, the flush's real work whatever the launch gaps); (None, None) off CUDA."""
    if not torch.cuda.is_available():
        return None, None
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return len(events), round(sum(e.time_range.elapsed_us() for e in events), 1)


def flush_rows(model, shape: str, cache_name: str, batch: int, context: int, new_tokens: int, device: str,
               paths: tuple[str, ...]) -> list[dict[str, Any]]:  # fmt: skip
    """Time one forward's flushes on every path for one cache and batch size (the cache filled by a prefill)."""
    from benchmarks.bench_generate import CACHES as GENERATE_CACHES

    prompt = context - new_tokens
    cache = GENERATE_CACHES[cache_name](model, static=True, max_batch_size=batch, max_cache_len=context)
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
                times = _time(fn, device)
                kernels, kernel_us = _kernels(fn)
        written[path] = [t.clone() for cell, page in zip(cells, pages) for t in _page_views(cell, page)]
        impl = "op-by-op" if path == "unfused" else "triton" if device.startswith("cuda") else "reference"
        rows.append({
            "shape": shape, "cache": cache_name, "path": path, "batch": batch, "context": context, "prompt": prompt,
            "dtype": str(next(model.parameters()).dtype).replace("torch.", ""), "coded_cells": len(cells),
            "page_size": cells[0].page if cells else None, "flush_impl": impl,
            **{k: round(v, 4) for k, v in times.items()},
            "graph_us_per_cell": round(1000 * times["graph_ms"] / max(1, len(cells)), 2),
            "kernels_per_step_flush": kernels, "kernel_us_per_step_flush": kernel_us, "pages_due": sum(p < c.num_pages for p, c in zip(pages, cells)),
        })  # fmt: skip
    by_path = {r["path"]: r for r in rows}
    for idle, due in (("percell", "percell-every"), ("table", "table-every")):
        if idle in by_path and due in by_path and cells:
            p = cells[0].page
            mean = ((p - 1) * by_path[idle]["graph_ms"] + by_path[due]["graph_ms"]) / p
            by_path[idle]["mean_step_flush_ms"] = round(mean, 4)
    if len(written) > 1:
        first = next(iter(written.values()))
        same = all(torch.equal(a, b) for other in written.values() for a, b in zip(first, other))
        for row in rows:
            row["bytes_equal"] = same
    del cache
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="ouro-1.4b")
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--new-tokens", type=int, default=32, help="decode steps of the step-time run")
    parser.add_argument("--paths", nargs="+", choices=PATHS, default=["percell-every", "percell", "table-every", "table"])
    parser.add_argument("--caches", nargs="+", choices=CACHES, default=list(CACHES))
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
    for cache_name in args.caches:
        for batch in args.batches:
            batch_rows = flush_rows(model, args.shape, cache_name, batch, args.context, args.new_tokens, device,
                                    tuple(args.paths))  # fmt: skip
            if not args.no_step:  # the captured step with the library's flush, once per cache and batch
                step = run_one(model, args.shape, cache_name, batch, args.context, args.new_tokens, device,
                               mode="graph" if device.startswith("cuda") else "static", timing="steps")  # fmt: skip
                for row in batch_rows:
                    row.update(step_mode=step["mode"], step_ms=step.get("ms_per_decode_step"),
                               step_status=step["status"])  # fmt: skip
                    if row["step_ms"]:
                        row["flush_fraction"] = round(row["graph_ms"] / row["step_ms"], 4)
                        if "mean_step_flush_ms" in row:
                            row["mean_flush_fraction"] = round(row["mean_step_flush_ms"] / row["step_ms"], 4)
            for row in batch_rows:
                rows.append(row)
                print(json.dumps(row), flush=True)
            write_rows(args.out, rows)  # rewritten after every batch: a stopped run keeps what finished
            if device.startswith("cuda"):
                torch.cuda.empty_cache()
    path = write_rows(args.out, rows)
    print("wrote", path)
    _summary(rows)


def _summary(rows: list[dict[str, Any]]) -> None:
    print("cache        batch  path           graph ms (p20-p80)        warm ms   eager ms  kernels  kern us  step ms  "
          "flush/step  mean/step  bytes equal")
    for r in rows:
        frac = f"{100 * r['flush_fraction']:6.2f}%" if r.get("flush_fraction") is not None else "     -"
        mean = f"{100 * r['mean_flush_fraction']:6.2f}%" if r.get("mean_flush_fraction") is not None else "     -"
        step = f"{r['step_ms']:8.3f}" if r.get("step_ms") else "       -"
        print(f"{r['cache']:12s} {r['batch']:5d}  {r['path']:13s} {r['graph_ms']:8.4f} ({r['graph_ms_p20']:.4f}-"
              f"{r['graph_ms_p80']:.4f})  {r['graph_warm_ms']:8.4f}  {r['eager_ms']:8.4f}  "
              f"{r['kernels_per_step_flush']!s:>7}  {r['kernel_us_per_step_flush']!s:>7}  {step}  {frac}     {mean}  {r.get('bytes_equal', '-')}")  # fmt: skip


if __name__ == "__main__":
    main()
