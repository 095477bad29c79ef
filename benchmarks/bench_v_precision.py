"""LoopKV's read-time V precision on a trained model (LoopKV Sec. 3.3, Table 14): the KL cost of reading cold tokens'
values at 2 bits, and the share of INT4 history value reads that still read the low plane, against tau.

Teacher-forced replay (`hf_loopcache.fidelity`) of held-out documents, fp32, for INT4 plans with V precision at each
tau and without it; reports the KL ratio to the plan without V precision, the hot fraction of INT4 history value
reads, and the resulting read bytes per history token (a cold token skips its 2-bit low plane).
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.bench_ripe_windows import documents
from benchmarks.common import write_rows
from hf_loopcache import LoopKVCache, load_fixture
from hf_loopcache.cache.plan import loopkv_preset
from hf_loopcache.fidelity import measure_fidelity, reference_logits


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="tiny-ouro")
    parser.add_argument("--plans", nargs="+", default=["kivi4", "kivi4-share"])
    parser.add_argument("--taus", nargs="+", type=float, default=[14.0, 10.0, 6.0])
    parser.add_argument("--num-docs", type=int, default=8)
    parser.add_argument("--doc-tokens", type=int, default=1024)
    parser.add_argument("--prefix", type=float, default=0.5)
    parser.add_argument("--window", type=int, default=128)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", default="v_precision_tiny_ouro")
    args = parser.parse_args(argv)

    model, tokenizer = load_fixture(args.model, dtype=torch.float32, device=args.device)
    kwargs = {"init_scale": 0.0} if model.config.model_type == "huginn_raven" else {}
    docs = documents(tokenizer, args.model, args.num_docs, args.doc_tokens)[-args.num_docs :]
    refs = reference_logits(model, docs, **kwargs)
    layout = model.loop_layout
    rows = []
    for name in args.plans:
        plan = loopkv_preset(layout, name, window=args.window)
        base = measure_fidelity(
            model, docs, lambda m, p=plan: LoopKVCache(m, p, tau=None), prefix=args.prefix, reference=refs, **kwargs
        )
        stored, read = plan.bytes_per_token()
        lo_plane = layout.num_kv_heads * layout.head_dim // 4  # bytes of one token's 2-bit low value plane, one cell

        def reads_int4(cell, p=plan):
            own = p.option(cell)
            return (p.option(layout.source_cell(cell)) if own == "share" else own) == "int4"

        int4_reads = sum(map(reads_int4, layout.cells()))  # cells whose history values are INT4 codes
        for tau in args.taus:
            counters: list[dict[str, float]] = []

            def factory(m, p=plan, t=tau, counters=counters):
                cache = LoopKVCache(m, p, tau=t)
                counters.append(cache.track_v_precision())
                return cache

            report = measure_fidelity(model, docs, factory, prefix=args.prefix, reference=refs, **kwargs)
            cold = sum(c["cold"] for c in counters) / max(sum(c["history"] for c in counters), 1.0)
            row = {
                "model": args.model,
                "plan": name,
                "tau": tau,
                "mean_kl": report.mean_kl,
                "mean_kl_without_vp": base.mean_kl,
                "kl_ratio": report.mean_kl / base.mean_kl,
                "hot_fraction_of_int4_history_value_reads": 1 - cold,
                "read_bytes_per_token_without_vp": read,
                "read_bytes_per_token_with_vp": read - cold * lo_plane * int4_reads,
                "top1_agreement": report.top1_agreement,
                "conditions": {
                    "dtype": "float32",
                    "device": args.device,
                    "documents": args.num_docs,
                    "doc_tokens": args.doc_tokens,
                    "prefix": args.prefix,
                    "window": args.window,
                    "sink": 32,
                    "page_size": 32,
                },
            }
            print({k: v for k, v in row.items() if k != "conditions"}, flush=True)
            rows.append(row)
    print("wrote", write_rows(args.out, rows))


if __name__ == "__main__":
    main()
