"""Per-op time and achieved bandwidth of `coded_attention` (one cell, one decode step) on the GPU.

Ouro's head shape (16 query / 16 KV heads x 128), LoopKV's cell layout (sink 32, window 256, pages of 32, value
groups of 32), one new token, random data; history = context - sink - window. Providers:

- `int4`: INT4 codes, both value planes read; `int4-vprec`: V precision on, tau chosen so that ~80% of the history
  tokens are cold; `int2`; `bf16`: the same kernel over a BF16 history (RIPE's deepest plane, dense cells);
- `sdpa-bf16`: `F.scaled_dot_product_attention` over the whole context in BF16 (what a full cache reads);
- `dequant-sdpa`: dequantize the INT4 history to BF16 (`triton_ops.quant.naive`), then SDPA (the old read path).

Times come from `triton.testing.do_bench` (L2 flushed before every call, launch overhead included, median and
p20 / p80 of the calls). Bytes read count every pass over the stored K and V: codes, scales, zeros, the BF16 sink /
window / new token, and for `int4-vprec` the low plane of hot tokens only (plus the second pass over K when the
kernel needs page maxima first). The flush rows time quantizing one page (32 tokens) of one cell's K and V.

`python -m benchmarks.run coded-attention --out coded_attention_h200` (GPU; batches 1 8 16 32 64 x contexts 8K / 32K
by default, about 40 s on the H200); `--tuning JSON` overrides `ops.ROW1_TUNING` (recorded in each coded row);
`--plot FILE.json` draws the PNG from a result file (any machine with matplotlib).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.common import write_rows

HEADS, HEAD_DIM, SINK, WINDOW, PAGE, GROUP = 16, 128, 32, 256, 32, 32


def _tuned(tune):
    from triton_ops.coded_attention.ops import ROW1_TUNING

    return {**ROW1_TUNING, **(tune or {})}


def _mma(tune, queries):
    """Whether the launcher reads `queries` new tokens per row on v8 / v9's tensor-core loop under `tune` (merged)."""
    return bool(tune["mma"]) or 0 < tune["mma_rows_min"] <= queries


def vprec_reads_cold_lo(tune, queries=1):
    """Whether V precision reads the `lo` plane of cold tokens too: v9 with `mma_lo_ahead` loads every token's `lo`
    words with the `hi` ones (the byte count then keeps them)."""
    tune = _tuned(tune)
    return bool(tune["mma_lo_ahead"]) and _mma(tune, queries)


def vprec_pass_bytes(b, n_hist, tune, sms=132, queries=1):
    """Bytes per batch row V precision reads besides the codes: v4 / `pipe` split below one row block per SM and
    then read the key codes (and scales, zeros) twice; `scores` splits below `vprec_fill` row blocks per SM and
    writes and reads one fp32 score per token and head instead (`ops.VPREC_MODES`); the optimistic pass
    (`vprec_optimistic`: v9's blocks of `queries >= mma_rows_min`, or `vprec` "v4") reads nothing more unless its
    check reruns a split."""
    tune = _tuned(tune)
    if tune.get("vprec_optimistic") and (_mma(tune, queries) or tune.get("vprec") == "v4"):
        return 0  # no first pass (a split the check reruns reads its codes again: not counted)
    if tune.get("vprec") == "scores":
        return n_hist * HEADS * 8 if b * HEADS < tune["vprec_fill"] * sms else 0
    return n_hist * HEADS * HEAD_DIM * (1 / 2 + 4 / PAGE) if b * HEADS < sms else 0


def _margin_for_cold(q, k_hat, sink_k, scaling, target=0.8):
    """V-precision margin (natural log units) at which `target` of the history tokens are cold under the rule
    `s < max(sink max, prefix page max) - margin` (bisection on the dequantized scores of the first batch row)."""
    s = torch.einsum("hd,htd->ht", q[0, :, 0].float(), k_hat[0].float()) * scaling
    seed = (torch.einsum("hd,htd->ht", q[0, :, 0].float(), sink_k[0].float()) * scaling).amax(-1)
    pages = s.shape[-1] // PAGE
    pm = s[:, : pages * PAGE].unflatten(-1, (pages, PAGE)).amax(-1)
    run = torch.maximum(torch.cummax(pm, -1).values, seed[:, None]).repeat_interleave(PAGE, -1)
    gap = (run - s[:, : pages * PAGE]).flatten()
    return float(torch.quantile(gap.float()[: 2**24], 1 - target))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8, 16, 32, 64])
    parser.add_argument("--contexts", nargs="+", type=int, default=[8192, 32768])
    parser.add_argument(
        "--providers", nargs="+", default=["int4", "int4-vprec", "int2", "bf16", "sdpa-bf16", "dequant-sdpa"]
    )
    parser.add_argument("--dequant-max-batch", type=int, default=8, help="dequant-sdpa only up to this batch (slow)")
    parser.add_argument("--cells", type=int, default=96, help="cells per decode step (Ouro-1.4B: 24 layers x 4)")
    parser.add_argument("--out", default="coded_attention_h200")
    parser.add_argument(
        "--tuning", default=None, help="JSON overriding ops.ROW1_TUNING (launch settings of the one-row coded path)"
    )
    parser.add_argument("--plot", default=None, help="draw the PNG of an existing result JSON and exit")
    parser.add_argument(
        "--table", nargs="+", default=None, metavar="JSON",
        help="print the markdown table of a result JSON (graph time, TB/s; a second JSON's coded rows as `vs`) and exit",
    )  # fmt: skip
    parser.add_argument(
        "--device", default="cuda", help="cpu: check the script itself under TRITON_INTERPRET=1 (one untimed call)"
    )
    args = parser.parse_args(argv)
    if args.plot:
        plot(Path(args.plot))
        return
    if args.table:
        table(*(Path(p) for p in args.table))
        return

    import triton

    from triton_ops.coded_attention import CellView
    from triton_ops.coded_attention.ops import _coded_attention_fwd
    from triton_ops.quant import naive
    from triton_ops.quant.ops import quantize_keys, quantize_values

    tuning = json.loads(args.tuning) if args.tuning else None
    dev = args.device
    bench = triton.testing.do_bench if dev == "cuda" else _call_once
    dt = torch.bfloat16
    scaling = HEAD_DIM**-0.5
    bmax, tmax = max(args.batches), max(args.contexts)
    gen = torch.Generator(device=dev).manual_seed(0)
    if dev != "cuda":
        dt = torch.float32  # the interpreter has no bf16
    hist_max = tmax - SINK - WINDOW
    hist_max -= hist_max % PAGE

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, device=dev) * scale).to(dt)

    # one pool of data at the largest shape; each case reads a [:b, :, :T] view (strided, never copied)
    k_hist = randn(bmax, HEADS, hist_max, HEAD_DIM) + randn(bmax, HEADS, 1, HEAD_DIM, scale=2.0)
    v_hist = randn(bmax, HEADS, hist_max, HEAD_DIM)
    q = randn(bmax, HEADS, 1, HEAD_DIM, scale=2.0)
    sink_k, sink_v = randn(bmax, HEADS, SINK, HEAD_DIM) + 3 * q.float().to(dt), randn(bmax, HEADS, SINK, HEAD_DIM)
    win_k, win_v = randn(bmax, HEADS, WINDOW, HEAD_DIM), randn(bmax, HEADS, WINDOW, HEAD_DIM)
    new_k, new_v = randn(bmax, HEADS, 1, HEAD_DIM), randn(bmax, HEADS, 1, HEAD_DIM)
    codes = {}
    for nbits in (4, 2):
        parts_k = [quantize_keys(k_hist[b0 : b0 + 8], nbits, group_size=PAGE, check_finite=False) for b0 in range(0, bmax, 8)]
        parts_v = [quantize_values(v_hist[b0 : b0 + 8], nbits, group_size=GROUP, check_finite=False) for b0 in range(0, bmax, 8)]
        cat = lambda ts: torch.cat(ts, 0) if ts[0] is not None else None  # noqa: E731  (batch-wise)
        codes[nbits] = (
            naive.QuantizedKeys(*(cat([getattr(p, f) for p in parts_k]) for f in ("codes", "scale", "zero")), nbits, PAGE),
            naive.QuantizedValues(*(cat([getattr(p, f) for p in parts_v]) for f in ("hi", "lo", "scale", "zero")), nbits, GROUP),
        )  # fmt: skip
        del parts_k, parts_v
    full_k = torch.cat([sink_k, k_hist, win_k, new_k], dim=2)  # for SDPA over BF16 (a full cache's storage)
    full_v = torch.cat([sink_v, v_hist, win_v, new_v], dim=2)
    if dev == "cuda":
        torch.cuda.synchronize()

    rows = []
    e = HEADS * HEAD_DIM
    for ctx in args.contexts:
        n_hist = ctx - SINK - WINDOW
        n_hist -= n_hist % PAGE
        w_len = ctx - SINK - n_hist  # window (+ the partial page), the new token is position ctx
        for b in args.batches:
            qb = q[:b]
            bound = torch.full((b, 1), SINK + n_hist, dtype=torch.int32, device=dev)
            common = dict(
                new_key=new_k[:b], new_value=new_v[:b], length=ctx, history_end=bound, sink_key=sink_k[:b],
                sink_value=sink_v[:b], history_start=SINK, window_start=SINK + n_hist,
                window_key=win_k[:b, :, :w_len], window_value=win_v[:b, :, :w_len],
            )  # fmt: skip
            dense_tail = (SINK + w_len + 1) * 2 * e * 2  # K and V, bf16
            for prov in args.providers:
                row = dict(provider=prov, batch=b, context=ctx, history=n_hist, heads=HEADS, head_dim=HEAD_DIM)
                if prov in ("int4", "int4-vprec", "int2"):
                    from triton_ops.coded_attention.ops import ROW1_TUNING

                    row["tuning"] = {**ROW1_TUNING, **(tuning or {})}
                if prov in ("int4", "int4-vprec", "int2"):
                    nbits = 2 if prov == "int2" else 4
                    qk, qv = codes[nbits]
                    hk = naive.QuantizedKeys(
                        qk.codes[:b, :, :n_hist], qk.scale[:b, :, : n_hist // PAGE], qk.zero[:b, :, : n_hist // PAGE],
                        nbits, PAGE,
                    )  # fmt: skip
                    hv = naive.QuantizedValues(
                        qv.hi[:b, :, :n_hist], None if qv.lo is None else qv.lo[:b, :, :n_hist],
                        qv.scale[:b, :, :n_hist], qv.zero[:b, :, :n_hist], nbits, GROUP,
                    )  # fmt: skip
                    view = CellView(history_key=hk, history_value=hv, **common)
                    tau = None
                    per_tok = e * (nbits / 8 + nbits / 8 + 4 / PAGE + 4 / GROUP)
                    hist_bytes = n_hist * per_tok
                    if prov == "int4-vprec":
                        k_hat = naive.dequantize_keys(naive.QuantizedKeys(hk.codes[:1], hk.scale[:1], hk.zero[:1], 4, PAGE))
                        margin = _margin_for_cold(qb, k_hat, sink_k[:1], scaling)
                        tau = margin / math.log(2.0)
                        cold = _cold_fraction(qb, k_hat, sink_k[:1], scaling, margin)
                        row.update(tau=tau, cold_fraction=cold)
                        if not vprec_reads_cold_lo(tuning):
                            hist_bytes -= n_hist * cold * e / 4
                        hist_bytes += vprec_pass_bytes(b, n_hist, tuning)  # a first pass over K, or scores
                    fn = lambda v=view, t=tau, qb=qb: _coded_attention_fwd(qb, v, scaling=scaling, v_precision_tau=t, tuning=tuning)  # noqa: E731
                    nbytes = b * (hist_bytes + dense_tail)
                elif prov == "bf16":
                    view = CellView(history_key=k_hist[:b, :, :n_hist], history_value=v_hist[:b, :, :n_hist], **common)
                    fn = lambda v=view, qb=qb: _coded_attention_fwd(qb, v, scaling=scaling, v_precision_tau=None)  # noqa: E731
                    nbytes = b * (n_hist * 2 * e * 2 + dense_tail)
                elif prov == "sdpa-bf16":
                    kk, vv = full_k[:b, :, : ctx + 1], full_v[:b, :, : ctx + 1]
                    fn = lambda kk=kk, vv=vv, qb=qb: F.scaled_dot_product_attention(qb, kk, vv, scale=scaling)  # noqa: E731
                    nbytes = b * (ctx + 1) * 2 * e * 2
                elif prov == "dequant-sdpa":
                    if b > args.dequant_max_batch:
                        continue
                    qk, qv = codes[4]
                    qk_b = naive.QuantizedKeys(qk.codes[:b, :, :n_hist], qk.scale[:b, :, : n_hist // PAGE], qk.zero[:b, :, : n_hist // PAGE], 4, PAGE)
                    qv_b = naive.QuantizedValues(qv.hi[:b, :, :n_hist], qv.lo[:b, :, :n_hist], qv.scale[:b, :, :n_hist], qv.zero[:b, :, :n_hist], 4, GROUP)
                    sk_b, sv_b, wk_b, wv_b = sink_k[:b], sink_v[:b], win_k[:b, :, :w_len], win_v[:b, :, :w_len]

                    def fn(qk_b=qk_b, qv_b=qv_b, sk_b=sk_b, sv_b=sv_b, wk_b=wk_b, wv_b=wv_b, b=b, qb=qb):
                        kk = torch.cat([sk_b, naive.dequantize_keys(qk_b, dtype=dt), wk_b, new_k[:b]], 2)
                        vv = torch.cat([sv_b, naive.dequantize_values(qv_b, dtype=dt), wv_b, new_v[:b]], 2)
                        return F.scaled_dot_product_attention(qb, kk, vv, scale=scaling)

                    nbytes = b * (n_hist * e * (1 + 4 / PAGE + 4 / GROUP) + dense_tail)
                else:
                    raise ValueError(f"unknown provider {prov!r}")
                try:
                    ms = bench(fn, quantiles=[0.5, 0.2, 0.8], warmup=10, rep=40)
                    gms = _graph_bench(fn) if dev == "cuda" and prov != "dequant-sdpa" else None
                except torch.cuda.OutOfMemoryError:
                    print("OOM", row, flush=True)
                    torch.cuda.empty_cache()
                    continue
                row.update(ms=ms[0], ms_p20=ms[1], ms_p80=ms[2], bytes_read=int(nbytes), tb_s=nbytes / ms[0] / 1e9)
                if gms is not None:
                    row.update(graph_ms=gms[0], graph_ms_p20=gms[1], graph_ms_p80=gms[2], graph_tb_s=nbytes / gms[0] / 1e9)
                rows.append(row)
                print(json.dumps(row), flush=True)
            write_rows(args.out, rows)  # after every cell, so that a run stopped by a time limit keeps its rows
    # the flush: quantize one page of one cell's keys and values (Triton), per batch
    for b in args.batches:
        kp, vp = k_hist[:b, :, :PAGE], v_hist[:b, :, :PAGE]

        def flush(kp=kp, vp=vp):
            quantize_keys(kp, 4, group_size=PAGE, check_finite=False)
            quantize_values(vp, 4, group_size=GROUP, check_finite=False)

        ms = bench(flush, quantiles=[0.5, 0.2, 0.8], warmup=10, rep=40)
        row = dict(provider="flush-int4-page", batch=b, ms=ms[0], ms_p20=ms[1], ms_p80=ms[2], cells=args.cells)
        rows.append(row)
        print(json.dumps(row), flush=True)
    path = write_rows(args.out, rows)
    print("wrote", path)
    _summary(rows, args.cells)


def _graph_bench(fn, warmup=10, rep=40):
    """Median / p20 / p80 ms of replaying `fn` captured in a CUDA graph (GPU time with each kernel's launch on the
    device, without Python's launch overhead; L2 flushed before every replay by do_bench; `warmup` / `rep` in ms)."""
    import triton

    return triton.testing.do_bench(capture(fn).replay, quantiles=[0.5, 0.2, 0.8], warmup=warmup, rep=rep)


def capture(fn) -> torch.cuda.CUDAGraph:
    """`fn` captured in a CUDA graph after two warm-up calls on a side stream (as capture wants them)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def _call_once(fn, quantiles, warmup, rep):
    import time

    start = time.perf_counter()
    fn()
    ms = (time.perf_counter() - start) * 1e3
    return [ms] * len(quantiles)


def _cold_fraction(q, k_hat, sink_k, scaling, margin):
    s = torch.einsum("hd,htd->ht", q[0, :, 0].float(), k_hat[0].float()) * scaling
    seed = (torch.einsum("hd,htd->ht", q[0, :, 0].float(), sink_k[0].float()) * scaling).amax(-1)
    pages = s.shape[-1] // PAGE
    pm = s[:, : pages * PAGE].unflatten(-1, (pages, PAGE)).amax(-1)
    run = torch.maximum(torch.cummax(pm, -1).values, seed[:, None]).repeat_interleave(PAGE, -1)
    return float((s[:, : pages * PAGE] < run - margin).float().mean())


def _summary(rows, cells):
    by = {(r["provider"], r.get("batch"), r.get("context")): r for r in rows}
    print("eager / graph-replay time, graph TB/s")
    print(f"{'ctx':>6} {'B':>3} " + " ".join(f"{p:>22}" for p in ["int4", "int4-vprec", "int2", "bf16", "sdpa-bf16", "dequant-sdpa"]))
    for (prov, b, ctx), _ in sorted(by.items(), key=lambda x: (x[0][2] or 0, x[0][1] or 0)):
        if prov != "int4":
            continue
        cells_txt = []
        for p in ["int4", "int4-vprec", "int2", "bf16", "sdpa-bf16", "dequant-sdpa"]:
            r = by.get((p, b, ctx))
            if r and "graph_ms" in r:
                cells_txt.append(f"{r['ms'] * 1e3:6.0f}/{r['graph_ms'] * 1e3:6.1f}us {r['graph_tb_s']:4.2f}")
            else:
                cells_txt.append(f"{r['ms'] * 1e3:6.0f}us {r['tb_s']:4.2f}" if r else "-")
        print(f"{ctx:>6} {b:>3} " + " ".join(f"{c:>22}" for c in cells_txt))
    for (prov, b, _), r in sorted(by.items(), key=lambda x: x[0][1] or 0):
        if prov == "flush-int4-page":
            step = by.get(("int4", b, 8192))
            ratio = (r["ms"] / (cells * step.get("graph_ms", step["ms"]))) if step else math.nan
            print(f"flush B={b}: {r['ms'] * 1e3:.1f} us per cell; vs {cells} cells x int4 attention at 8K: {ratio:.3%}")


def table(path: Path, versus: Path | None = None) -> None:
    """Markdown table of `path` (graph-replay time and TB/s per provider, the ratios the targets speak of), with the
    coded rows' graph time from `versus` (e.g. the v3 setting) in parentheses; then the targets of issue #14 item 5."""

    def rows_of(p):
        return {(r["provider"], r["batch"], r["context"]): r for r in json.loads(p.read_text())["rows"] if "context" in r}

    cur, old = rows_of(path), rows_of(versus) if versus else {}

    def t(r):
        return r.get("graph_ms", r["ms"]) * 1e3

    def tb(r):
        return r.get("graph_tb_s", r["tb_s"])

    provs = ["int4", "int4-vprec", "int2", "bf16", "sdpa-bf16"]
    print("| ctx | B | INT4 | INT4, V precision (80% cold) | INT2 | BF16 (kernel) | SDPA bf16 | SDPA / INT4 time "
          "| INT4 / V-prec time |")  # fmt: skip
    print("|---" * 9 + "|")
    verdict = {"int4_b16": [], "int4_b1_8k": None, "x_sdpa": [], "vprec": []}
    for ctx, b in sorted({(k[2], k[1]) for k in cur}):
        cells = []
        for p in provs:
            r = cur.get((p, b, ctx))
            o = old.get((p, b, ctx))
            txt = "-" if r is None else f"{t(r):.0f} us, {tb(r):.2f}"
            if r is not None and o is not None and p in ("int4", "int4-vprec", "int2"):
                txt += f" (vs {t(o):.0f})"
            cells.append(txt)
        i4, vp, sd = cur.get(("int4", b, ctx)), cur.get(("int4-vprec", b, ctx)), cur.get(("sdpa-bf16", b, ctx))
        r_sd = f"{t(sd) / t(i4):.2f}" if i4 and sd else "-"
        r_vp = f"{t(i4) / t(vp):.2f}" if i4 and vp else "-"
        print(f"| {ctx // 1024}K | {b} | " + " | ".join(cells) + f" | {r_sd} | {r_vp} |")
        if i4:
            if b >= 16:
                verdict["int4_b16"].append(tb(i4))
            if b == 1 and ctx == 8192:
                verdict["int4_b1_8k"] = tb(i4)
            if b <= 8 and sd:
                verdict["x_sdpa"].append(t(sd) / t(i4))
            if vp:
                verdict["vprec"].append(t(i4) / t(vp))

    def rng(v):
        return f"{min(v):.2f}-{max(v):.2f}" if v else "-"

    print()
    print(f"INT4 >= 3.3 TB/s at batch >= 16: {rng(verdict['int4_b16'])} TB/s")
    print(f"INT4 >= 2 TB/s at batch 1 x 8K: {verdict['int4_b1_8k'] or float('nan'):.2f} TB/s")
    print(f"batch 1-8, INT4 >= 3x faster than SDPA over BF16: {rng(verdict['x_sdpa'])}x")
    print(f"V precision >= 1.1x faster than both planes (80% cold): {rng(verdict['vprec'])}x")


def plot(path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = json.loads(path.read_text())
    rows = [r for r in data["rows"] if "context" in r]
    batches = sorted({r["batch"] for r in rows})
    fig, axes = plt.subplots(1, len(batches), figsize=(4 * len(batches), 3.6), sharey=True)
    for ax, b in zip(axes, batches):
        for prov in sorted({r["provider"] for r in rows}):
            pts = sorted((r["context"], r["tb_s"]) for r in rows if r["batch"] == b and r["provider"] == prov)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=prov)
        ax.set_xscale("log", base=2)
        ax.set_title(f"batch {b}")
        ax.set_xlabel("context")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("bytes read / time (TB/s)")
    axes[-1].legend(fontsize=7)
    env = data["environment"]
    fig.suptitle(f"coded_attention, 16x128 heads, {env.get('gpu_name')}, torch {env['torch']}, triton {env['triton']}")
    fig.tight_layout()
    out = path.with_suffix(".png")
    fig.savefig(out, dpi=110)
    print("wrote", out)


if __name__ == "__main__":
    main()

