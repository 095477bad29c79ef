"""`hf-loopcache` command line (also `python -m hf_loopcache`).

    hf-loopcache demo     [--model tiny-ouro] [--prompt TEXT] [--max-new-tokens N] [--cache full|ripe|kivi4|...]
    hf-loopcache info     --model NAME_OR_PATH
    hf-loopcache profile  --model NAME_OR_PATH [--documents FILE] --out profile.json [storage and replay options]
    hf-loopcache plan     --profile profile.json --damage-budget 1.19x [--storage-budget 156KiB] --out DIR

`--model` takes a fixture name (`tiny-ouro`, `tiny-huginn`), a local folder or a Hub repository id.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

from hf_loopcache.fixtures import FIXTURES

__all__ = ["main"]

CACHE_CHOICES = ("full", "ripe", "deepest", "kivi4", "kivi2", "kivi4-share", "hand")


def _load_model(name: str, dtype: str = "float32", device: str = "cpu") -> tuple[Any, Any]:
    from hf_loopcache.fixtures import load_fixture

    torch_dtype = getattr(torch, dtype)
    if name in FIXTURES:
        return load_fixture(name, dtype=torch_dtype, device=device)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import hf_loopcache  # noqa: F401  (registers the native classes)

    model = AutoModelForCausalLM.from_pretrained(name, dtype=torch_dtype).to(device).eval()  # type: ignore[arg-type]
    return model, AutoTokenizer.from_pretrained(name)


def _forward_kwargs(model: Any) -> dict[str, Any]:
    """Deterministic inference for Huginn (zero initial state); nothing for Ouro."""
    return {"init_scale": 0.0} if model.config.model_type == "huginn_raven" else {}


def _make_cache(model: Any, name: str, window: int) -> Any:
    from hf_loopcache import DeepestPlaneCache, FullLoopCache, LoopKVCache, RIPECache

    if name == "full":
        return FullLoopCache(model)
    if name == "ripe":
        return RIPECache(model, window=window)
    if name == "deepest":
        return DeepestPlaneCache(model)
    return LoopKVCache(model, name)


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} GiB"


def cmd_demo(args: argparse.Namespace) -> int:
    model, tokenizer = _load_model(args.model, args.dtype, args.device)
    layout = model.loop_layout
    cache = _make_cache(model, args.cache, args.window)
    # the fixtures saw every document after their separator token, so prompts start with it
    text = (tokenizer.bos_token or "") + args.prompt if args.model in FIXTURES else args.prompt
    inputs = tokenizer(text, return_tensors="pt").to(args.device)
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(
            **inputs,
            max_new_tokens=args.max_new_tokens,
            do_sample=False,
            repetition_penalty=args.repetition_penalty,
            pad_token_id=tokenizer.pad_token_id,
            cache=cache,
            **_forward_kwargs(model),
        )
    elapsed = time.perf_counter() - start
    tokens = cache.get_seq_length()
    element = next(model.parameters()).element_size()
    print(f"model:  {args.model} ({layout.describe()}, {model.num_parameters() / 1e6:.1f}M parameters, {model.dtype})")
    print(f"cache:  {cache!r}")
    print(f"prompt: {args.prompt!r}")
    print(f"output: {tokenizer.decode(out[0, inputs['input_ids'].shape[1] :], skip_special_tokens=True)!r}")
    print(f"generated {out.shape[1] - inputs['input_ids'].shape[1]} tokens in {elapsed:.2f} s")
    formula = layout.full_bytes_per_token() * element // layout.bytes_per_element
    print(
        f"KV bytes per token: full-cache formula {_fmt_bytes(formula)} ({layout.num_cells} cells x "
        f"2 x {layout.num_kv_heads} heads x {layout.head_dim} x {element} B); this cache stores "
        f"{_fmt_bytes(cache.stored_bytes() / max(tokens, 1))} per token ({tokens} tokens), "
        f"allocated {_fmt_bytes(cache.nbytes())} in all"
    )
    return 0


def cmd_info(args: argparse.Namespace) -> int:
    from hf_loopcache.cache import CachePlan, loopkv_preset

    model, _ = _load_model(args.model)
    layout = model.loop_layout
    print(layout.describe())
    print(f"cells: {layout.num_cells}; bytes per cell and token (bf16): {layout.bytes_per_cell_token}")
    rows = [
        ("full", CachePlan.full(layout)),
        ("deepest plane", CachePlan.ripe(layout, 0)),
        (f"RIPE W={args.window}", CachePlan.ripe(layout, args.window)),
        ("KIVI-4", loopkv_preset(layout, "kivi4")),
        ("KIVI-2", loopkv_preset(layout, "kivi2")),
        ("KIVI-4 + sharing", loopkv_preset(layout, "kivi4-share")),
        ("hand-made", loopkv_preset(layout, "hand")),
    ]
    length = args.length
    full = CachePlan.full(layout).expected_stored_bytes(length)
    print(
        f"{'cache':20s} {'stored/token (history)':>24s} {'read/token':>12s} {f'stored at L={length}':>18s} {'fraction':>9s}"
    )
    for name, plan in rows:
        stored, read = plan.bytes_per_token()
        total = plan.expected_stored_bytes(length)
        print(
            f"{name:20s} {_fmt_bytes(stored):>24s} {_fmt_bytes(read):>12s} {_fmt_bytes(total):>18s} {total / full:9.1%}"
        )
    return 0


def _read_documents(
    path: str | None, tokenizer: Any, num: int, tokens: int, model_name: str
) -> tuple[list[torch.Tensor], str]:
    if path is None:
        from hf_loopcache.fixtures import heldout_documents

        if model_name not in FIXTURES:
            raise SystemExit("--documents is required for models other than the fixtures")
        texts = heldout_documents(model_name)
        source = f"fixture {model_name} held-out documents"
    else:
        p = Path(path)
        if p.suffix == ".jsonl":
            texts = [json.loads(line)["text"] for line in p.read_text(encoding="utf-8").splitlines() if line.strip()]
        else:
            texts = [p.read_text(encoding="utf-8")]
        source = str(p)
    ids = torch.tensor(tokenizer("\n\n".join(texts))["input_ids"])
    docs = [ids[i : i + tokens] for i in range(0, ids.numel() - tokens + 1, tokens)][:num]
    if not docs:
        raise SystemExit(f"the documents hold {ids.numel()} tokens, fewer than --doc-tokens {tokens}")
    return docs, source


def cmd_profile(args: argparse.Namespace) -> int:
    from hf_loopcache.planner import profile_cells

    model, tokenizer = _load_model(args.model, args.dtype, args.device)
    docs, source = _read_documents(args.documents, tokenizer, args.num_docs, args.doc_tokens, args.model)
    kwargs = _forward_kwargs(model)
    profile = profile_cells(
        model,
        docs,
        options=args.options,
        sink=args.sink,
        window=args.window,
        page_size=args.page_size,
        group_size=args.group_size,
        prefix=args.prefix,
        out_path=args.out,
        progress=True,
        source={"model": args.model, "revision": args.revision, "documents": source},
        **kwargs,
    )
    print(f"wrote {args.out}: {sum(map(len, profile.damage.values()))} damages, KL_share = {profile.kl_share:.3e}")
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    from hf_loopcache.planner import CellProfile, plan_from_profile

    profile = CellProfile.load(args.profile)
    plan = plan_from_profile(
        profile,
        damage_budget=args.damage_budget,
        storage_budget=args.storage_budget,
        options=args.options,
        final_option=args.final_option,
        model_id=args.model_id or profile.settings.get("source", {}).get("model"),
        revision=args.revision,
        profile_path=args.profile,
    )
    path = plan.save_pretrained(args.out)
    print(f"wrote {path}: {plan.summary()}")
    print(
        f"predicted damage {plan.metadata['predicted_damage']:.3e}"
        + (f" = {plan.metadata['predicted_damage_in_kl_share']:.2f} x KL_share" if profile.kl_share else "")
    )
    if args.push_to_hub:
        plan.push_to_hub(args.push_to_hub)
        print(f"pushed to https://huggingface.co/{args.push_to_hub}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hf-loopcache", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="generate with a looped-model cache and report its bytes")
    demo.add_argument("--model", default="tiny-ouro")
    demo.add_argument("--prompt", default="And the LORD spake unto Moses, saying,")
    demo.add_argument("--max-new-tokens", type=int, default=40)
    demo.add_argument("--repetition-penalty", type=float, default=1.2)
    demo.add_argument("--cache", choices=CACHE_CHOICES, default="full")
    demo.add_argument("--window", type=int, default=64, help="RIPE window")
    demo.add_argument("--dtype", default="float32")
    demo.add_argument("--device", default="cpu")
    demo.set_defaults(func=cmd_demo)

    info = sub.add_parser("info", help="cache layout and bytes per token of each preset")
    info.add_argument("--model", default="tiny-ouro")
    info.add_argument("--window", type=int, default=64)
    info.add_argument("--length", type=int, default=1024)
    info.set_defaults(func=cmd_info)

    prof = sub.add_parser("profile", help="measure the per-cell damage of int4 / int2 / share (LoopKV profile)")
    prof.add_argument("--model", required=True)
    prof.add_argument("--revision", default=None)
    prof.add_argument(
        "--documents", default=None, help=".txt or .jsonl ({'text': ...}); default: the fixture's held-out text"
    )
    prof.add_argument("--num-docs", type=int, default=8)
    prof.add_argument("--doc-tokens", type=int, default=1024)
    prof.add_argument("--prefix", type=float, default=0.5)
    prof.add_argument("--options", nargs="+", default=["int4", "int2", "share"])
    prof.add_argument("--sink", type=int, default=32)
    prof.add_argument("--window", type=int, default=256)
    prof.add_argument("--page-size", type=int, default=32)
    prof.add_argument("--group-size", type=int, default=32)
    prof.add_argument("--dtype", default="float32")
    prof.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    prof.add_argument("--out", required=True)
    prof.set_defaults(func=cmd_profile)

    plan = sub.add_parser("plan", help="choose a per-cell plan from a profile (exact knapsack)")
    plan.add_argument("--profile", required=True)
    plan.add_argument("--damage-budget", required=True, help="a KL (2e-4) or a multiple of KL_share ('1.19x')")
    plan.add_argument(
        "--storage-budget", default=None, help="stored bytes per token, e.g. 156KiB (memory-optimised plan)"
    )
    plan.add_argument("--options", nargs="+", default=["int4", "int2", "share"])
    plan.add_argument("--final-option", default="int4")
    plan.add_argument("--model-id", default=None)
    plan.add_argument("--revision", default=None)
    plan.add_argument("--out", required=True)
    plan.add_argument("--push-to-hub", default=None, metavar="REPO_ID")
    plan.set_defaults(func=cmd_plan)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
