"""Generate with the full, RIPE and LoopKV caches on a shipped fixture and compare what each stores.

python examples/quickstart.py [--model tiny-ouro|tiny-huginn] [--max-new-tokens 48]
"""

from __future__ import annotations

import argparse

import torch

from hf_loopcache import FullLoopCache, LoopKVCache, RIPECache, load_fixture
from hf_loopcache.fixtures import heldout_documents


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny-ouro")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    args = parser.parse_args()

    model, tokenizer = load_fixture(args.model)
    extra = {"init_scale": 0.0} if model.config.model_type == "huginn_raven" else {}
    prompt = tokenizer.bos_token + heldout_documents()[3][:2500]  # a long held-out prompt (~600 tokens)
    inputs = tokenizer(prompt, return_tensors="pt")
    caches = {
        "full": FullLoopCache(model),
        "RIPE W=64": RIPECache(model, window=64),
        "LoopKV kivi4-share": LoopKVCache(model, "kivi4-share"),
        "LoopKV hand-made": LoopKVCache(model, "hand"),
    }
    reference = None
    for name, cache in caches.items():
        with torch.no_grad():
            out = model.generate(
                **inputs,
                max_new_tokens=args.max_new_tokens,
                do_sample=False,
                pad_token_id=tokenizer.pad_token_id,
                cache=cache,
                **extra,
            )
        new = out[0, inputs["input_ids"].shape[1] :]
        reference = new if reference is None else reference
        same = int((new[: len(reference)] == reference[: len(new)]).sum())
        print(
            f"{name:20s} stores {cache.stored_bytes() / 2**20:6.2f} MiB for {cache.get_seq_length()} tokens; "
            f"{same}/{len(new)} tokens equal to the full cache's; {tokenizer.decode(new[:24])!r}"
        )


if __name__ == "__main__":
    main()
