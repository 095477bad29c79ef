"""RIPE windows on a trained model, in the style of RIPE Table 4: the KL tail against the window W.

Teacher-forced replay (`hf_loopcache.fidelity`) of held-out documents through RIPE(W) for W in {0, 16, 64, 256},
fp32, against the exact model. Reports per arm: positions with KL > 0.1 (tail), max KL, top-1 flips, mean KL, and the
memory over the deepest-plane cache at L = 1024 on this model's layout and on Huginn-0125's (RIPE Eq. 10).
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

from benchmarks.common import write_rows
from hf_loopcache import FullLoopCache, LoopLayout, RIPECache, load_fixture
from hf_loopcache.fidelity import measure_fidelity, reference_logits
from hf_loopcache.fixtures import heldout_documents

HUGINN_0125 = LoopLayout(
    n_core=4, num_loops=32, num_kv_heads=55, head_dim=96, n_prelude=2, n_coda=2, name="huginn_raven"
)


def documents(tokenizer: Any, model_name: str, num: int, tokens: int) -> list[torch.Tensor]:
    ids = torch.tensor(tokenizer("\n\n".join(heldout_documents(model_name)))["input_ids"])
    docs = [ids[i : i + tokens] for i in range(0, ids.numel() - tokens + 1, tokens)][:num]
    if len(docs) < num:
        raise SystemExit(f"held-out text gives only {len(docs)} documents of {tokens} tokens")
    return docs


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="tiny-huginn")
    parser.add_argument("--windows", nargs="*", type=int, default=[0, 16, 64, 256])
    parser.add_argument("--num-docs", type=int, default=16)
    parser.add_argument("--doc-tokens", type=int, default=1024)
    parser.add_argument("--prefix", type=int, default=768, help="prefilled tokens; the rest is replayed as decoded")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--floor",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also replay the full cache, the fp32 rounding floor",
    )
    parser.add_argument("--out", default="ripe_windows_tiny_huginn")
    args = parser.parse_args(argv)

    model, tokenizer = load_fixture(args.model, dtype=torch.float32, device=args.device)
    kwargs = {"init_scale": 0.0} if model.config.model_type == "huginn_raven" else {}
    docs = documents(tokenizer, args.model, args.num_docs, args.doc_tokens)
    refs = reference_logits(model, docs, **kwargs)
    layout = model.loop_layout
    rows = []
    if args.floor:  # the numerical floor: the exact full cache replayed the same way (differences are rounding only)
        report = measure_fidelity(model, docs, FullLoopCache, prefix=args.prefix, block=17, reference=refs, **kwargs)
        summary = report.to_dict()
        summary.pop("per_document")
        rows.append({"model": args.model, "cache": "full cache (fp32 floor)", "window": None, **summary})
        print(rows[-1], flush=True)
    for window in args.windows:
        report = measure_fidelity(
            model, docs, lambda m, w=window: RIPECache(m, window=w), prefix=args.prefix, reference=refs, **kwargs
        )
        summary = report.to_dict()
        summary.pop("per_document")
        row = {
            "model": args.model,
            "cache": "deepest plane (W=0)" if window == 0 else f"RIPE W={window}",
            "window": window,
            **summary,
            "extra_bytes_over_deepest_at_1024_this_layout": layout.ripe_bytes(1024, window)
            - layout.deepest_plane_bytes(1024),
            "fraction_of_full_at_1024_this_layout": layout.ripe_bytes(1024, window) / layout.full_bytes(1024),
            "extra_MB_over_deepest_at_1024_huginn_0125": (
                HUGINN_0125.ripe_bytes(1024, window) - HUGINN_0125.deepest_plane_bytes(1024)
            )
            / 1e6,
            "fraction_of_full_at_1024_huginn_0125": HUGINN_0125.ripe_bytes(1024, window) / HUGINN_0125.full_bytes(1024),
            "conditions": {
                "dtype": "float32",
                "device": args.device,
                "documents": args.num_docs,
                "doc_tokens": args.doc_tokens,
                "prefix": args.prefix,
                "replayed_positions_per_doc": args.doc_tokens - args.prefix,
                "num_steps": model.config.mean_recurrence if kwargs else model.config.total_ut_steps,
                "block": window + 1,
                "init_scale": kwargs.get("init_scale"),
            },
        }
        print({k: v for k, v in row.items() if k != "conditions"}, flush=True)
        rows.append(row)
    print("wrote", write_rows(args.out, rows))


if __name__ == "__main__":
    main()
