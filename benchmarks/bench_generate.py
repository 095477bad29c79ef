"""End-to-end `model.generate` with a looped-model cache: prefill time, decode tokens/s, peak memory, cache bytes.

Method (gpt-fast style): one warm-up generate, then per configuration a prefill-only run (`max_new_tokens=1`) and a
full run; decode time = full - prefill; CUDA synchronised around every timer; peak memory from
`torch.cuda.max_memory_allocated` (reset before each run). Out-of-memory is recorded as a row, not an error.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

from benchmarks.common import build, peak_gib, reset_peak, timed, write_rows
from hf_loopcache import FullLoopCache, RIPECache

CACHES = {
    "full": lambda model: FullLoopCache(model),
    "ripe64": lambda model: RIPECache(model, window=64),
}


def run_one(
    model, shape: str, cache_name: str, batch: int, context: int, new_tokens: int, device: str
) -> dict[str, Any]:
    layout = model.loop_layout
    vocab = model.config.vocab_size
    prompt_len = context - new_tokens
    ids = torch.randint(1, vocab, (batch, prompt_len), device=device)
    row: dict[str, Any] = {
        "shape": shape,
        "cache": cache_name,
        "batch": batch,
        "context": context,
        "prompt": prompt_len,
        "new_tokens": new_tokens,
        "dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
        "layout": layout.describe(),
        "kv_bytes_per_token_formula": layout.full_bytes_per_token(),
    }
    extra = {"init_scale": 0.0} if shape.startswith("huginn") else {}
    gen = dict(do_sample=False, pad_token_id=0, **extra)

    def generate(tokens: int) -> tuple[torch.Tensor, Any]:
        cache = CACHES[cache_name](model)
        out = model.generate(ids, cache=cache, max_new_tokens=tokens, min_new_tokens=tokens, **gen)
        return out, cache

    try:
        reset_peak(device)
        prefill_only, t_prefill = timed(lambda: generate(1), device)
        del prefill_only  # free its cache before the full run
        reset_peak(device)
        (out, cache), t_total = timed(lambda: generate(new_tokens), device)
        decode = t_total - t_prefill
        row.update(
            status="ok",
            prefill_s=round(t_prefill, 4),
            total_s=round(t_total, 4),
            decode_s=round(decode, 4),
            decode_tokens_per_s=round(batch * (new_tokens - 1) / decode, 2),
            ms_per_decode_step=round(1000 * decode / (new_tokens - 1), 3),
            peak_memory_gib=peak_gib(device),
            cache_allocated_gib=round(cache.nbytes() / 2**30, 3),
            cache_stored_gib=round(cache.stored_bytes() / 2**30, 3),
            cache_stored_bytes_per_token=cache.stored_bytes() / (batch * out.shape[1] - batch),
            generated=int(out.shape[1] - prompt_len),
        )
        del cache, out
    except torch.OutOfMemoryError as err:
        needed = layout.full_bytes(context) * batch if cache_name == "full" else None
        row.update(status="oom", error=str(err).splitlines()[0][:200], kv_bytes_needed_formula=needed)
    reset_peak(device)
    return row


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shapes", nargs="+", default=["ouro-1.4b", "huginn-0125"])
    parser.add_argument("--caches", nargs="+", default=["full"])
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--out", default="generate")
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args(argv)
    device = args.device
    dtype = getattr(torch, args.dtype)
    rows = []
    for shape in args.shapes:
        model = build(shape, dtype, device)
        warm = torch.randint(1, model.config.vocab_size, (1, 64), device=device)
        extra = {"init_scale": 0.0} if shape.startswith("huginn") else {}
        model.generate(warm, max_new_tokens=4, do_sample=False, pad_token_id=0, **extra)
        for cache_name in args.caches:
            for batch in args.batches:
                row = run_one(model, shape, cache_name, batch, args.context, args.new_tokens, device)
                print(row, flush=True)
                rows.append(row)
        del model
        reset_peak(device)
    print("wrote", write_rows(args.out, rows))


if __name__ == "__main__":
    main()
