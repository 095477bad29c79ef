"""Sweep of the one-row coded-attention path's launch settings on the GPU (v3 tuning; notes_coded_attention.md).

Standalone (torch, triton and `triton_ops` only): random stored codes at Ouro's head shape (16 x 128, sink 32, window
256, pages of 32, value groups of 32), one new token. For each setting of `ops.ROW1_TUNING` it first checks the kernel
against the reference on the same codes (bf16, batch 2, padding, 2K context; V precision with its cold count), then
times the call captured in a CUDA graph (`triton.testing.do_bench`, L2 flushed, median) and prints a table of
microseconds and TB/s of bytes read (the same byte count as `bench_coded_attention.py`).

    python -m benchmarks.tune_coded_attention --out /tmp/sweep.json \\
        --configs '4,4,1,4' '2,4,1,4' --batches 1 8 32 --contexts 8192 32768

A sixth field picks V precision's mode (`ops.VPREC_MODES`, v5; `scores+unroll` / `pipe+unroll` add
`vprec_unroll`): `--configs 1,2,1,8,1,scores 1,2,1,8,1,v4 --providers int4 int4-vprec` times int4 once and V
precision in both modes. Fields `key=value` set any other `ROW1_TUNING` key (v6, session 13):
`--configs 1,2,1,8,1 1,1,1,8,1,sub=2 1,2,1,8,1,maxnreg=168` times v4, half-page steps at one warp, and v4 capped at
168 registers per thread. `splits=N` forces N history splits (the op's `num_splits`; session 17: short histories).
`--static-capacity N` times static views instead (a captured step's: the length on the device, every page of N
positions preallocated, the window as a ring; the same contents as the host-length view; session 18).

v7 (verification blocks): `--queries 5` times a block of 5 new tokens per row (Ouro's MHA: 5 query rows per KV head;
query i's history ends `queries - 1 - i` positions before the last one's, RIPE Eq. 9); `rows_max=16` switches the
word path per (split, row) on (`ROW1_TUNING["rows_max"]`, off by default: the general path):

    python -m benchmarks.tune_coded_attention --queries 5 --configs 1,2,1,8,1 1,2,1,8,1,rows_max=16 \
        --providers int4 int2 int4-vprec --batches 1 8 16 --contexts 8192 32768 --out /tmp/v7.json

`--plot FILE.json` draws a results file as bars of microseconds per call (one group per context x batch, one bar per
setting and provider, `--baseline`'s rows included) into `FILE.png`, and exits.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import time

import torch
import torch.nn.functional as F

from triton_ops.coded_attention.ops import tuning_value

HEADS, D, SINK, WINDOW, PAGE, GROUP = 16, 128, 32, 256, 32, 32
E = HEADS * D


QMAX = 16  # new tokens the data holds (`--queries` up to this)


def _data(bmax, tmax, dev, gen):
    """Random codes and scales (timing does not depend on the values; the scales keep scores in a sane range)."""
    hist = tmax - SINK - WINDOW
    hist -= hist % PAGE
    pages = hist // PAGE

    def rn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, device=dev) * scale).to(
            torch.bfloat16 if dev == "cuda" else torch.float32
        )

    def codes(*shape):
        return torch.randint(0, 256, shape, generator=gen, device=dev, dtype=torch.uint8)

    q = rn(bmax, HEADS, QMAX, D, scale=2.0)
    d = dict(
        q=q,
        sk=rn(bmax, HEADS, SINK, D) + 3 * q[:, :, :1], sv=rn(bmax, HEADS, SINK, D),
        wk=rn(bmax, HEADS, WINDOW + PAGE + QMAX, D), wv=rn(bmax, HEADS, WINDOW + PAGE + QMAX, D),
        nk=rn(bmax, HEADS, QMAX, D), nv=rn(bmax, HEADS, QMAX, D),
        kc4=codes(bmax, HEADS, hist, D // 2), kc2=codes(bmax, HEADS, hist, D // 4),
        ks=(torch.rand(bmax, HEADS, pages, D, generator=gen, device=dev) * 0.25 + 0.05).half(),
        kz=(torch.randn(bmax, HEADS, pages, D, generator=gen, device=dev) * 0.5 - 1.0).half(),
        vh=codes(bmax, HEADS, hist, D // 4), vl=codes(bmax, HEADS, hist, D // 4),
        vs=(torch.rand(bmax, HEADS, hist, D // GROUP, generator=gen, device=dev) * 0.25 + 0.05).half(),
        vz=(torch.randn(bmax, HEADS, hist, D // GROUP, generator=gen, device=dev) * 0.5 - 1.0).half(),
    )  # fmt: skip
    return d


def _view(d, b, ctx, nbits, valid=None, queries=1, capacity=None):
    """The view of `ctx` positions; `capacity` (a static cell's `max_cache_len`): stored as a static cache's captured
    step stores it (the length on the device, every page of `capacity` preallocated, the window as a ring)."""
    from triton_ops.coded_attention import CellView
    from triton_ops.quant import naive

    n_hist = ctx - SINK - WINDOW
    n_hist -= n_hist % PAGE
    if capacity is not None:  # the same contents: the history's codes in the first pages of the preallocated ones,
        host, _ = _view(d, b, ctx, nbits, valid, queries)  # the window's positions in their ring slots
        full, _ = _view(d, b, capacity, nbits, valid, queries)
        slots = torch.arange(host.window_start, ctx, device=d["q"].device) % d["wk"].shape[2]
        ring_k, ring_v = d["wk"][:b].clone(), d["wv"][:b].clone()
        ring_k[:, :, slots], ring_v[:, :, slots] = host.window_key, host.window_value
        return CellView(
            new_key=host.new_key, new_value=host.new_value, length=torch.tensor(ctx, device=d["q"].device),
            history_end=host.history_end, sink_key=host.sink_key, sink_value=host.sink_value, history_start=SINK,
            history_key=full.history_key, history_value=full.history_value, window_key=ring_k, window_value=ring_v,
            key_valid=valid,
        ), n_hist  # fmt: skip
    if nbits:
        kc = d["kc4"] if nbits == 4 else d["kc2"]
        hk = naive.QuantizedKeys(
            kc[:b, :, :n_hist], d["ks"][:b, :, : n_hist // PAGE], d["kz"][:b, :, : n_hist // PAGE], nbits, PAGE
        )
        hv = naive.QuantizedValues(
            d["vh"][:b, :, :n_hist], d["vl"][:b, :, :n_hist] if nbits == 4 else None, d["vs"][:b, :, :n_hist],
            d["vz"][:b, :, :n_hist], nbits, GROUP,
        )  # fmt: skip
    else:
        hk = hv = None
    # query i reads the history up to `queries - 1 - i` positions before the last query's end, the window from there
    back = torch.arange(queries - 1, -1, -1, dtype=torch.int32, device=d["q"].device)
    bound = (SINK + n_hist - back).expand(b, queries).contiguous()
    w0 = SINK + n_hist - (queries - 1)
    view = CellView(
        new_key=d["nk"][:b, :, :queries], new_value=d["nv"][:b, :, :queries], length=ctx, history_end=bound,
        sink_key=d["sk"][:b], sink_value=d["sv"][:b], history_start=SINK, history_key=hk, history_value=hv,
        window_start=w0, window_key=d["wk"][:b, :, : ctx - w0], window_value=d["wv"][:b, :, : ctx - w0], key_valid=valid,
    )  # fmt: skip
    return view, n_hist


def _tau_for_cold(d, view, n_hist, target=0.8):
    """tau (natural-log margin / ln 2) at which `target` of batch row 0's history tokens are cold."""
    from triton_ops.quant import naive

    hk = view.history_key
    k = naive.dequantize_keys(naive.QuantizedKeys(hk.codes[:1], hk.scale[:1], hk.zero[:1], 4, PAGE)).float()
    s = torch.einsum("hd,htd->ht", d["q"][0, :, 0].float(), k[0]) * D**-0.5
    seed = (torch.einsum("hd,htd->ht", d["q"][0, :, 0].float(), d["sk"][0].float()) * D**-0.5).amax(-1)
    pm = s.unflatten(-1, (n_hist // PAGE, PAGE)).amax(-1)
    run = torch.maximum(torch.cummax(pm, -1).values, seed[:, None]).repeat_interleave(PAGE, -1)
    gap = (run - s).flatten()
    margin = float(torch.quantile(gap[: 2**24], 1 - target))
    return margin / math.log(2.0), float((gap > margin).float().mean())


def _graph_ms(fn):
    """Median ms of replaying `fn` captured in a CUDA graph (the benchmark's own timing, L2 flushed)."""
    from benchmarks.bench_coded_attention import _graph_bench

    return _graph_bench(fn)[0]


def check(d, tune, nbits, vprec, queries=1, splits=None):
    """Max |kernel - reference| of out (and lse) at batch 2, 2K context, left padding; cold counts with V prec."""
    from triton_ops.coded_attention import reference_coded_attention
    from triton_ops.coded_attention.ops import _coded_attention_fwd

    ctx = 2048
    valid = torch.ones(2, ctx + queries, dtype=torch.bool, device=d["q"].device)
    valid[0, :3] = False
    valid[1, SINK + 100 : SINK + 400] = False
    view, n_hist = _view(d, 2, ctx, nbits, valid, queries)
    # a random sink (the timing data's sink leans on the query and would hide the history)
    view = dataclasses.replace(view, sink_key=d["wk"][:2, :, :SINK], sink_value=d["wv"][:2, :, :SINK])
    tau = 0.5 if vprec else None  # a mix of cold and hot tokens at these scores
    q = d["q"][:2, :, :queries] * 0.5
    sk, sr = (torch.zeros(2, dtype=torch.int64, device=q.device) for _ in range(2))
    out, lse = _coded_attention_fwd(
        q, view, scaling=D**-0.5, v_precision_tau=tau, v_precision_stats=sk, num_splits=splits, tuning=tune
    )
    ref, rlse = reference_coded_attention(
        q.float(), _cast(view), scaling=D**-0.5, v_precision_tau=tau, v_precision_stats=sr
    )
    return dict(
        err=(out.float() - ref).abs().max().item(), lse_err=(lse - rlse).abs().max().item(),
        ref_scale=ref.abs().max().item(), cold=sk.tolist(), cold_ref=sr.tolist(),
    )  # fmt: skip


def _cast(view):
    f = {}
    for name in ("new_key", "new_value", "sink_key", "sink_value", "window_key", "window_value"):
        t = getattr(view, name)
        f[name] = None if t is None else t.float()
    return dataclasses.replace(view, **f)


def _write(path, dev, rows):
    with open(path, "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name() if dev == "cuda" else dev, torch=torch.__version__, rows=rows), f)


def plot(path, out=None):
    """Bars of microseconds per call, one group per (context, batch) and one bar per (setting, provider), from a
    results file of this tool (`rows`, as `--out` writes it or several runs combined with a `run` field)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(path) as f:
        data = json.load(f)
    rows = [r for r in data["rows"] if "us" in r]
    if not rows:
        raise SystemExit(f"{path}: no timed rows to plot")
    shapes = sorted({(r["context"], r["batch"]) for r in rows})
    series = list(dict.fromkeys((r["config"], r["provider"]) for r in rows))
    fig, ax = plt.subplots(figsize=(max(6.0, 1.6 * len(shapes) + 2), 4.2))
    width = 0.8 / len(series)
    for k, (cfg, prov) in enumerate(series):
        got = {(r["context"], r["batch"]): r["us"] for r in rows if (r["config"], r["provider"]) == (cfg, prov)}
        xs = [i + (k - (len(series) - 1) / 2) * width for i, sh in enumerate(shapes) if sh in got]
        ax.bar(xs, [got[sh] for sh in shapes if sh in got], width, label=cfg if cfg == prov else f"{prov} {cfg}")
    ax.set_xticks(range(len(shapes)), [f"{c:,} x {b}" for c, b in shapes])
    ax.set_xlabel("context x batch")
    ax.set_ylabel("us per call (graph replay, L2 flushed)")
    ax.set_yscale("log")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=6, ncol=2)
    env = data.get("environment", {"gpu_name": data.get("device"), "torch": data.get("torch")})
    q = {r.get("queries", 1) for r in rows}
    ax.set_title(f"coded_attention, {max(q)} new token(s) per row, 16 x 128 heads; {env.get('gpu_name')}, torch "
                 f"{env.get('torch')}, triton {env.get('triton', '?')}", fontsize=8)  # fmt: skip
    fig.tight_layout()
    out = out or str(path).rsplit(".", 1)[0] + ".png"
    fig.savefig(out, dpi=110)
    print("wrote", out)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--plot", default=None, metavar="JSON", help="plot a results file (bars of us per call) and exit")
    p.add_argument(
        "--configs", nargs="+", default=["4,4,1,4"],
        help="pages,num_warps,num_stages,programs_per_sm[,words[,vprec]][,key=value...] (vprec: v4 / pipe / scores;"
        " key=value: any other ROW1_TUNING key, e.g. sub=2,maxnreg=168,tail_chunk=64)",
    )  # fmt: skip
    p.add_argument("--batches", nargs="+", type=int, default=[1, 8, 16, 32, 64])
    p.add_argument("--contexts", nargs="+", type=int, default=[8192, 32768])
    p.add_argument("--providers", nargs="+", default=["int4"])
    p.add_argument("--baseline", action="store_true", help="also time v2 (ROW1 off) and SDPA over BF16")
    p.add_argument("--queries", type=int, default=1, help=f"new tokens per row (v7 verification blocks; <= {QMAX})")
    p.add_argument(
        "--static-capacity", type=int, default=None,
        help="time static views (a captured step's: device length, ring window) preallocated for this many positions",
    )  # fmt: skip
    p.add_argument("--out", default=None)
    p.add_argument("--device", default="cuda", help="cpu: only the checks, under TRITON_INTERPRET=1 (bf16 -> fp32)")
    args = p.parse_args(argv)
    if args.plot:
        plot(args.plot)
        return
    if not 1 <= args.queries <= QMAX:
        raise ValueError(f"`--queries` must be in [1, {QMAX}], got {args.queries}")
    nq = args.queries
    from benchmarks.bench_coded_attention import vprec_pass_bytes, vprec_reads_cold_lo
    from triton_ops.coded_attention.ops import _coded_attention_fwd

    dev = args.device
    gen = torch.Generator(device=dev).manual_seed(0)
    # (the check reads batch 2 at a 2K context whatever is timed)
    bmax, tmax = max(args.batches + [2]), max(args.contexts + [args.static_capacity or 0, 2048])
    t0 = time.time()
    d = _data(bmax, tmax, dev, gen)
    if dev == "cuda":
        torch.cuda.synchronize()
    print(f"data {time.time() - t0:.1f}s", flush=True)
    configs = []
    for c in args.configs:
        fields = [f for f in c.split(",") if "=" not in f]
        extras = [f.partition("=")[::2] for f in c.split(",") if "=" in f]  # v6: any ROW1_TUNING key, `sub=2`
        pg, nw, st, ps, *wd = (int(x) for x in fields[:5])
        tune = dict(enabled=True, pages=pg, num_warps=nw, num_stages=st, programs_per_sm=ps, words=bool(wd and wd[0]))
        if len(fields) > 5:  # ops.VPREC_MODES, "+unroll" for `vprec_unroll`; changes only the int4-vprec provider
            mode, _, extra = fields[5].partition("+")
            tune["vprec"] = mode
            tune["vprec_unroll"] = extra == "unroll"
        for k, v in extras:
            tune[k] = tuning_value(v)
        configs.append((c, tune))
    if args.baseline:
        configs.insert(0, ("v2", dict(enabled=False)))
    rows = []
    taus = {}
    done = set()  # (provider, settings it depends on): configs that differ only in `vprec` time int4 / int2 once
    for name, tune in configs:
        for prov in args.providers:
            nbits = 2 if prov == "int2" else 4
            vprec = prov == "int4-vprec"
            key = (prov, tuple(sorted((k, v) for k, v in tune.items() if vprec or not k.startswith("vprec"))))
            if key in done:
                continue
            done.add(key)
            t1 = time.time()
            splits = tune.get("splits") or None  # `splits=N`: force N history splits (`num_splits`; 0: auto)
            op_tune = {k: v for k, v in tune.items() if k != "splits"}
            try:
                chk = check(d, op_tune, nbits, vprec, nq, splits)
            except Exception as exc:  # a setting that does not compile is a result, not a crash
                print(f"{name} {prov}: check failed: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
                rows.append(dict(config=name, provider=prov, error=str(exc)[:300]))
                continue
            print(f"{name} {prov}: check {chk} ({time.time() - t1:.1f}s)", flush=True)
            if dev != "cuda":
                continue
            for ctx in args.contexts:
                for b in args.batches:
                    view, n_hist = _view(d, b, ctx, nbits, queries=nq, capacity=args.static_capacity)
                    per_tok = E * (nbits / 8 * 2 + 4 / PAGE + 4 / GROUP)
                    hist_bytes = n_hist * per_tok
                    tau = None
                    row = dict(config=name, provider=prov, batch=b, context=ctx, queries=nq, **tune)
                    if args.static_capacity:
                        row["static_capacity"] = args.static_capacity
                    if vprec:
                        if (ctx, b) not in taus:
                            taus[(ctx, b)] = _tau_for_cold(d, _view(d, b, ctx, nbits, queries=nq)[0], n_hist)
                        tau, cold = taus[(ctx, b)]
                        row.update(tau=tau, cold_fraction=cold)
                        if not vprec_reads_cold_lo(tune, nq):
                            hist_bytes -= n_hist * cold * E / 4
                        hist_bytes += vprec_pass_bytes(b, n_hist, tune, queries=nq)
                    nbytes = b * (hist_bytes + (SINK + ctx - SINK - n_hist + nq) * 2 * E * 2)
                    q = d["q"][:b, :, :nq]

                    def fn(q=q, v=view, t=tau, tn=op_tune, ns=splits):
                        return _coded_attention_fwd(q, v, scaling=D**-0.5, v_precision_tau=t, num_splits=ns, tuning=tn)

                    ms = _graph_ms(fn)
                    row.update(us=ms * 1e3, tb_s=nbytes / ms / 1e9, bytes_read=int(nbytes), check_err=chk["err"])
                    rows.append(row)
            print(f"  timed in {time.time() - t1:.1f}s", flush=True)
            if args.out:  # after every setting, so that a call stopped by its time limit keeps what it measured
                _write(args.out, dev, rows)
    if args.baseline and dev == "cuda":
        for ctx in args.contexts:
            for b in args.batches:
                kk = torch.cat([d["sk"][:b], d["wk"][:b].repeat(1, 1, (ctx + 1) // (WINDOW + PAGE) + 1, 1)], 2)[
                    :, :, : ctx + 1
                ]
                vv = torch.cat([d["sv"][:b], d["wv"][:b].repeat(1, 1, (ctx + 1) // (WINDOW + PAGE) + 1, 1)], 2)[
                    :, :, : ctx + 1
                ]
                kk, vv = kk.contiguous(), vv.contiguous()
                ms = _graph_ms(
                    lambda q=d["q"][:b, :, :nq], kk=kk, vv=vv: F.scaled_dot_product_attention(q, kk, vv, scale=D**-0.5)
                )
                rows.append(dict(config="sdpa-bf16", provider="sdpa-bf16", batch=b, context=ctx, us=ms * 1e3,
                                 tb_s=b * (ctx + 1) * 4 * E / ms / 1e9))  # fmt: skip
                del kk, vv
    if args.out:
        _write(args.out, dev, rows)
    cells = sorted({(r["context"], r["batch"]) for r in rows if "us" in r})
    keys = sorted({(r["config"], r["provider"]) for r in rows if "us" in r}, key=lambda k: (k[1], k[0]))
    print("us (TB/s) per config x provider; columns: " + ", ".join(f"{c}:{b}" for c, b in cells))
    by = {(r["config"], r["provider"], r["context"], r["batch"]): r for r in rows if "us" in r}
    for k in keys:
        vals = [by.get((*k, c, b)) for c, b in cells]
        print(
            f"{k[0]:>10} {k[1]:>10} "
            + " ".join(f"{v['us']:7.1f}({v['tb_s']:.2f})" if v else "      -      " for v in vals)
        )


if __name__ == "__main__":
    main()
