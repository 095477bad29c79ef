"""`hf-loopcache` command line (also `python -m hf_loopcache`).

    hf-loopcache demo     [--model tiny-ouro] [--prompt TEXT] [--max-new-tokens N] [--cache loopkv:kivi4-share|ripe|PLAN]
    hf-loopcache info     --model NAME_OR_PATH
    hf-loopcache profile  --model NAME_OR_PATH [--documents FILE] --out profile.json [storage and replay options]
    hf-loopcache plan     --profile profile.json --damage-budget 1.19x [--storage-budget 156KiB] --out DIR
    hf-loopcache compare  RUN_A RUN_B [RUN_C ...] [--margin 0.03] [--json FILE] [--markdown FILE] [--plot FILE.png]

`--model` takes a local folder, else a fixture name (`tiny-ouro`, `tiny-huginn`), else a Hub repository id, in
that order. A mistake in an argument ends in one line naming it (exit status 2).
"""

from __future__ import annotations

import argparse
import difflib
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

from hf_loopcache.cache import build_cache
from hf_loopcache.fixtures import FIXTURES

__all__ = ["UsageError", "main"]

DTYPES = ("float32", "bfloat16", "float16")
PROFILE_OPTIONS = ("int4", "int2", "share")
PLAN_OPTIONS = ("bf16", "int4", "int2", "share")


class UsageError(Exception):
    """An argument that cannot work, found after parsing (a missing file, a model that cannot be found, a budget no
    plan meets). `main` reports it like argparse: `hf-loopcache CMD: error: argument OPTION: MESSAGE`, exit 2."""

    def __init__(self, option: str, message: str) -> None:
        super().__init__(f"argument {option}: {message}")
        self.option = option


class _Formatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Keeps the description's layout and appends every option's default to its help."""


def _int_at_least(low: int):  # noqa: ANN202  (an argparse `type`)
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer >= {low}, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be an integer >= {low}, got {value}")
        return value

    parse.__name__ = f"int >= {low}"
    return parse


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text!r}")
    return value


def _check_device(device: str, option: str = "--device") -> None:
    """A device torch can parse and this machine has (checked before any model is loaded)."""
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        raise UsageError(option, f"must be a torch device such as cpu, cuda or cuda:1, got {device!r}") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            build = "a CPU-only build" if torch.version.cuda is None else f"CUDA {torch.version.cuda}, but no GPU is visible"
            raise UsageError(option, f"{device!r} is not available: this torch {torch.__version__} is {build}; use cpu")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise UsageError(option, f"{device!r} does not exist: {torch.cuda.device_count()} CUDA device(s) visible")
    elif dev.type == "mps" and not torch.backends.mps.is_available():
        raise UsageError(option, f"{device!r} is not available on this machine; use cpu")
    elif dev.type not in ("cpu", "cuda", "mps", "xpu"):
        raise UsageError(option, f"must be cpu, cuda[:N] or mps, got {device!r}")


def _existing_file(path: str, option: str) -> Path:
    p = Path(path).expanduser()
    if not p.exists():
        raise UsageError(option, f"no such file: {path!r}")
    if not p.is_file():
        raise UsageError(option, f"{path!r} is a folder, not a file")
    return p


def _writable_parent(path: str, option: str) -> None:
    parent = Path(path).expanduser().resolve().parent
    if not parent.is_dir():
        raise UsageError(option, f"cannot write {path!r}: folder {str(parent)!r} does not exist")


def _fixture_hint(name: str) -> str:
    near = difflib.get_close_matches(name, FIXTURES, n=1, cutoff=0.5)
    return f"did you mean the fixture {near[0]!r}?" if near else f"fixtures: {', '.join(FIXTURES)}"


def _in_hub_cache(repo_id: str) -> bool:
    """Whether the local Hub cache holds the repository's config.json (checked without any network request)."""
    from huggingface_hub import try_to_load_from_cache

    try:
        return isinstance(try_to_load_from_cache(repo_id, "config.json"), str)
    except Exception:  # an id the cache cannot even name
        return False


def _load_model(name: str, dtype: str = "float32", device: str = "cpu", option: str = "--model") -> tuple[Any, Any]:
    """A model and its tokenizer from a local folder, else a shipped fixture, else the Hub (in that order).

    Every way this fails because of `name` raises `UsageError` (a missing local folder, a folder without a model,
    a near miss of a fixture name, a Hub id offline); the Hub step fails at once when the Hub is out of reach.
    """
    from hf_loopcache._hub import hub_offline_reason, looks_like_local_path
    from hf_loopcache.fixtures import load_fixture

    torch_dtype = getattr(torch, dtype)
    local = Path(name).expanduser()
    if local.exists():
        if not (local / "config.json").is_file():
            raise UsageError(option, f"{name!r} is not a model folder (no config.json in it)")
        source = str(local)
    elif name in FIXTURES:
        return load_fixture(name, dtype=torch_dtype, device=device)
    elif looks_like_local_path(name):
        raise UsageError(option, f"no such local folder {name!r} ({_fixture_hint(Path(name).name)})")
    else:
        source = name
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import hf_loopcache  # noqa: F401  (registers the native classes)

    offline = None if local.exists() else hub_offline_reason()
    if offline is not None and not _in_hub_cache(name):
        raise UsageError(
            option,
            f"{name!r} is not a local folder or a fixture ({_fixture_hint(name)}), and the Hugging Face Hub cannot be "
            f"reached ({offline}) nor holds it in the local cache",
        )
    try:
        model = AutoModelForCausalLM.from_pretrained(source, dtype=torch_dtype, local_files_only=offline is not None)
        tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=offline is not None)
    except (OSError, ValueError) as err:
        if offline is not None:
            raise UsageError(
                option,
                f"{name!r} is not a local folder or a fixture ({_fixture_hint(name)}), and the Hugging Face Hub "
                f"cannot be reached ({offline}) nor holds it in the local cache",
            ) from None
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise UsageError(option, f"cannot load {name!r} ({_fixture_hint(name)}): {first}") from None
    return model.to(device).eval(), tokenizer  # type: ignore[arg-type]


def _forward_kwargs(model: Any) -> dict[str, Any]:
    """Deterministic inference for Huginn (zero initial state); nothing for Ouro."""
    return {"init_scale": 0.0} if model.config.model_type == "huginn_raven" else {}


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} GiB"


DEMO_PROMPT_TOKENS = 1024
"""Default prompt length of the demo: long enough that a compressed cache's history (past its full-precision sink and
window of 32 + 256 positions for the LoopKV presets) dominates what it stores."""


def _demo_prompt(args: argparse.Namespace, tokenizer: Any) -> tuple[list[int], str]:
    """(prompt token ids, how to describe them): `--prompt`, else the start of a held-out fixture document."""
    is_fixture = args.model in FIXTURES and not Path(args.model).exists()
    prefix = (tokenizer.bos_token or "") if is_fixture else ""  # the fixtures saw every document after it
    if args.prompt is not None:
        if not args.prompt:
            raise UsageError("--prompt", "must not be empty")
        return tokenizer(prefix + args.prompt, verbose=False)["input_ids"], repr(args.prompt)
    from hf_loopcache.fixtures import heldout_documents, list_fixtures

    if not list_fixtures() and not is_fixture:
        raise UsageError("--prompt", "is required: the default prompt is held-out text of hf-loopcache-fixtures")
    text = heldout_documents()[0]
    ids = tokenizer(prefix + text, verbose=False)["input_ids"][: args.prompt_tokens]
    return ids, f"the first {len(ids)} tokens of a held-out document ({text.splitlines()[0]!r} ...)"


def cmd_demo(args: argparse.Namespace) -> int:
    if args.window is not None and args.window < 0:
        raise UsageError("--window", f"must be an integer >= 0, got {args.window}")
    _check_device(args.device)
    model, tokenizer = _load_model(args.model, args.dtype, args.device)
    layout = model.loop_layout
    ids, described = _demo_prompt(args, tokenizer)
    inputs = {"input_ids": torch.tensor([ids], device=args.device)}
    inputs["attention_mask"] = torch.ones_like(inputs["input_ids"])
    prompt_len = len(ids)
    runs = []
    for spec in dict.fromkeys(["full", args.cache]):  # the full cache first, as the reference
        options = {"window": args.window} if spec == args.cache and args.window is not None else {}
        try:
            cache = build_cache(model, spec, **options)
        except (ValueError, TypeError, OSError) as err:
            raise UsageError("--cache", str(err)) from None
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
        runs.append((spec, cache, out[0, prompt_len:], time.perf_counter() - start))

    element = next(model.parameters()).element_size()
    formula = layout.full_bytes_per_token() * element // layout.bytes_per_element
    print(f"model:  {args.model} ({layout.describe()}, {model.num_parameters() / 1e6:.1f}M parameters, {model.dtype})")
    print(f"prompt: {described}")
    (_, full_cache, full_new, _) = runs[0]
    for spec, cache, new, elapsed in runs:
        same = int((new[: len(full_new)] == full_new[: len(new)]).long().cumprod(0).sum())
        print(f"\n[{spec}] {type(cache).__name__}: {cache.plan.summary()}")
        print(f"  output ({len(new)} new tokens, {elapsed:.2f} s): {tokenizer.decode(new, skip_special_tokens=True)!r}")
        if cache is not full_cache:
            print(f"  the first {same} of {len(new)} new tokens equal the full cache's (greedy decoding)")
    tokens = full_cache.get_seq_length()
    print(f"\nKV cache bytes after {tokens} positions ({prompt_len} prompt + {tokens - prompt_len} generated):")
    print(f"  {'cache':22s} {'stored':>12s} {'of full':>8s} {'per token':>12s} {'allocated':>12s}")
    for spec, cache, _, _ in runs:
        stored = cache.stored_bytes()
        print(
            f"  {spec:22s} {_fmt_bytes(stored):>12s} {stored / full_cache.stored_bytes():8.0%} "
            f"{_fmt_bytes(stored / max(tokens, 1)):>12s} {_fmt_bytes(cache.nbytes()):>12s}"
        )
    print(
        f"stored: the bytes of keys and values the cache holds for these positions (codes, scales and zeros, and the "
        f"full-precision sink and window); the full cache's per-token figure is the layout formula, {layout.num_cells} "
        f"cells x 2 (K and V) x {layout.num_kv_heads} heads x {layout.head_dim} x {element} B ({model.dtype}) = "
        f"{_fmt_bytes(formula)}."
    )
    print(
        f"per history token (the lines above): what the plan stores and reads for a position past the sink and "
        f"window, counted at 2 B per full-precision element (bf16, as the models ship); this run holds "
        f"{model.dtype}, {element} B."
    )
    print(
        "allocated: the bytes of the cache's tensors, which grow in steps ahead of what they hold (generate reserves "
        "the full cache's whole length up front), so at short lengths it can exceed stored."
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
            raise UsageError("--documents", "is required for models other than the fixtures (a .txt or .jsonl file)")
        texts = heldout_documents(model_name)
        source = f"fixture {model_name} held-out documents"
    else:
        p = _existing_file(path, "--documents")
        if p.suffix == ".jsonl":
            try:
                texts = [json.loads(line)["text"] for line in p.read_text(encoding="utf-8").splitlines() if line.strip()]
            except (json.JSONDecodeError, KeyError, TypeError):
                raise UsageError("--documents", f"{path!r}: every line of a .jsonl file must be {{\"text\": ...}}") from None
        else:
            texts = [p.read_text(encoding="utf-8")]
        source = str(p)
    # verbose=False: the concatenation is longer than the tokenizer's model_max_length by design (cut below)
    ids = torch.tensor(tokenizer("\n\n".join(texts), verbose=False)["input_ids"])
    docs = [ids[i : i + tokens] for i in range(0, ids.numel() - tokens + 1, tokens)][:num]
    if len(docs) < num:
        raise UsageError(
            "--num-docs",
            f"{source} hold {ids.numel()} tokens: {len(docs)} document(s) of --doc-tokens {tokens}, fewer than "
            f"--num-docs {num}; lower either, or pass more text with --documents",
        )
    return docs, source


def cmd_profile(args: argparse.Namespace) -> int:
    from hf_loopcache.planner import profile_cells
    from hf_loopcache.planner.profile import max_positions

    prefix: float | int = args.prefix
    if prefix >= 1:
        if prefix != int(prefix) or prefix >= args.doc_tokens:
            raise UsageError(
                "--prefix", f"must be a fraction in (0, 1) or a whole number of tokens below --doc-tokens, got {prefix}"
            )
        prefix = int(prefix)
    elif not prefix > 0 or not int(prefix * args.doc_tokens) >= 1:
        raise UsageError("--prefix", f"must leave at least one prefilled token (a fraction in (0, 1)), got {prefix}")
    _writable_parent(args.out, "--out")
    if args.documents is not None:
        _existing_file(args.documents, "--documents")
    elif args.model not in FIXTURES:
        raise UsageError("--documents", "is required for models other than the fixtures (a .txt or .jsonl file)")
    _check_device(args.device)
    model, tokenizer = _load_model(args.model, args.dtype, args.device)
    positions = max_positions(model.config)
    if positions is not None and args.doc_tokens > positions:
        raise UsageError("--doc-tokens", f"must be at most the model's {positions} positions, got {args.doc_tokens}")
    docs, source = _read_documents(args.documents, tokenizer, args.num_docs, args.doc_tokens, args.model)
    cut = prefix if isinstance(prefix, int) else int(prefix * args.doc_tokens)
    print(
        f"profile {args.model}: {len(docs)} documents of {args.doc_tokens} tokens from {source} ({cut} prefilled, "
        f"{args.doc_tokens - cut} replayed), options {', '.join(args.options)}, sink {args.sink}, window "
        f"{args.window}, pages of {args.page_size}, {args.dtype} on {args.device}; writes {args.out} after every "
        f"cell and resumes from it"
    )
    kwargs = _forward_kwargs(model)
    profile = profile_cells(
        model,
        docs,
        options=args.options,
        sink=args.sink,
        window=args.window,
        page_size=args.page_size,
        group_size=args.group_size,
        share_source=args.share_source,
        prefix=prefix,
        out_path=args.out,
        progress=True,
        source={"model": args.model, "revision": args.revision, "documents": source},
        **kwargs,
    )
    print(f"wrote {args.out}: {sum(map(len, profile.damage.values()))} damages, KL_share = {profile.kl_share:.3e}")
    return 0


_PLAN_ARGUMENTS = {"damage_budget": "--damage-budget", "storage_budget": "--storage-budget", "options": "--options"}


def cmd_plan(args: argparse.Namespace) -> int:
    from hf_loopcache._hub import hub_offline_reason
    from hf_loopcache.planner import CellProfile, plan_from_profile

    try:
        profile = CellProfile.load(_existing_file(args.profile, "--profile"))
    except ValueError as err:
        raise UsageError("--profile", str(err)) from None
    if Path(args.out).expanduser().is_file():
        raise UsageError("--out", f"{args.out!r} is a file; the plan is written into a folder (created if missing)")
    if args.push_to_hub and (offline := hub_offline_reason()) is not None:
        raise UsageError("--push-to-hub", f"the Hugging Face Hub cannot be reached ({offline}); nothing was written")
    try:
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
    except ValueError as err:  # name the option the message is about (the library names its parameter)
        message = str(err)
        named = [opt for key, opt in _PLAN_ARGUMENTS.items() if f"`{key}`" in message]
        raise UsageError(named[0] if named else "--profile", message) from None
    path = plan.save_pretrained(args.out)
    print(f"wrote {path}: {plan.summary()}")
    print(
        f"predicted damage {plan.metadata['predicted_damage']:.3e}"
        + (f" = {plan.metadata['predicted_damage_in_kl_share']:.2f} x KL_share" if profile.kl_share else "")
    )
    if args.push_to_hub:
        try:
            plan.push_to_hub(args.push_to_hub)
        except Exception as err:  # network and Hub errors: the plan is saved, say so in one line
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise UsageError("--push-to-hub", f"the plan is in {path}, but the upload failed: {first}") from None
        print(f"pushed to https://huggingface.co/{args.push_to_hub}")
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    from hf_loopcache.compare import compare_paths

    text = compare_paths(
        args.run_a, args.run_b, margin=args.margin, iters=args.iters, seed=args.seed, tasks=args.tasks,
        suites=args.suite, json_path=args.json, markdown_path=args.markdown, plot_path=args.plot,
    )  # fmt: skip
    print(text, end="")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from hf_loopcache import __version__

    parser = argparse.ArgumentParser(prog="hf-loopcache", description=__doc__, formatter_class=_Formatter)
    parser.add_argument("--version", action="version", version=f"hf-loopcache {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    model_help = "local model folder, else fixture name (tiny-ouro, tiny-huginn), else Hub repository id"
    dtype_help = "dtype the weights are cast to"

    demo = sub.add_parser("demo", help="one prompt through the full cache and a compressed one; their bytes")
    demo.add_argument("--model", default="tiny-ouro", help=model_help)
    demo.add_argument(
        "--prompt", default=None, help="prompt text (default: the first --prompt-tokens tokens of a held-out document)"
    )
    demo.add_argument(
        "--prompt-tokens", type=_int_at_least(1), default=DEMO_PROMPT_TOKENS, help="length of the default prompt"
    )
    demo.add_argument("--max-new-tokens", type=_int_at_least(1), default=40, help="tokens to generate (greedy)")
    demo.add_argument("--repetition-penalty", type=_positive_float, default=1.2, help="generate's repetition_penalty")
    demo.add_argument(
        "--cache",
        default="loopkv:kivi4-share",
        help="the compressed cache beside full: ripe, deepest, loopkv:<preset> (kivi4, kivi2, kivi4-share, hand), a plan "
        "folder or a Hub id (hf_loopcache.build_cache)",
    )
    demo.add_argument(
        "--window", type=_int_at_least(0), default=None, help="recent positions at full precision (ripe: 64, loopkv: 256)"
    )
    demo.add_argument("--dtype", choices=DTYPES, default="float32", help=dtype_help)
    demo.add_argument("--device", default="cpu", help="torch device: cpu, cuda, cuda:1, mps")
    demo.set_defaults(func=cmd_demo)

    info = sub.add_parser("info", help="cache layout and bytes per token of each preset")
    info.add_argument("--model", default="tiny-ouro", help=model_help)
    info.add_argument("--window", type=_int_at_least(0), default=64, help="RIPE window of the RIPE row")
    info.add_argument("--length", type=_int_at_least(1), default=1024, help="context length of the stored column")
    info.set_defaults(func=cmd_info)

    prof = sub.add_parser("profile", help="measure the per-cell damage of int4 / int2 / share (LoopKV profile)")
    prof.add_argument("--model", required=True, help=model_help)
    prof.add_argument("--revision", default=None, help="model revision recorded in the profile")
    prof.add_argument(
        "--documents", default=None, help=".txt or .jsonl ({'text': ...}); default: the fixture's held-out text"
    )
    prof.add_argument("--num-docs", type=_int_at_least(1), default=8, help="documents to replay")
    prof.add_argument(
        "--doc-tokens", type=_int_at_least(2), default=1024, help="tokens per document (at most the model's positions)"
    )
    prof.add_argument(
        "--prefix", type=float, default=0.5, help="prefilled part of each document: a fraction, or a token count >= 1"
    )
    prof.add_argument(
        "--options", nargs="+", choices=PROFILE_OPTIONS, default=list(PROFILE_OPTIONS), help="options to measure"
    )
    prof.add_argument("--sink", type=_int_at_least(0), default=32, help="full-precision first positions")
    prof.add_argument("--window", type=_int_at_least(0), default=256, help="full-precision recent positions")
    prof.add_argument("--page-size", type=_int_at_least(1), default=32, help="positions leave the window in pages")
    prof.add_argument("--group-size", type=_int_at_least(1), default=32, help="channel group of the value codes")
    prof.add_argument(
        "--share-source", default="int4", help="the final loop's option when scoring `share` (= plan's --final-option)"
    )
    prof.add_argument("--dtype", choices=DTYPES, default="float32", help=dtype_help)
    prof.add_argument(
        "--device", default="cuda" if torch.cuda.is_available() else "cpu", help="torch device: cpu, cuda, cuda:1"
    )
    prof.add_argument("--out", required=True, help="profile JSON, written after every cell (and resumed from)")
    prof.set_defaults(func=cmd_profile)

    plan = sub.add_parser("plan", help="choose a per-cell plan from a profile (exact knapsack)")
    plan.add_argument("--profile", required=True, help="a profile JSON written by `hf-loopcache profile`")
    plan.add_argument("--damage-budget", required=True, help="a KL (2e-4) or a multiple of KL_share ('1.19x')")
    plan.add_argument(
        "--storage-budget", default=None, help="stored bytes per token, e.g. 156KiB (memory-optimised plan)"
    )
    plan.add_argument(
        "--options", nargs="+", choices=PLAN_OPTIONS, default=list(PROFILE_OPTIONS), help="options a cell may take"
    )
    plan.add_argument(
        "--final-option", choices=PLAN_OPTIONS[:3], default="int4", help="option of the final loop (the share source)"
    )
    plan.add_argument("--model-id", default=None, help="model id recorded in the plan (default: the profile's)")
    plan.add_argument("--revision", default=None, help="model revision recorded in the plan")
    plan.add_argument("--out", required=True, help="folder to write loopcache_plan.json into")
    plan.add_argument("--push-to-hub", default=None, metavar="REPO_ID", help="also upload the plan to this Hub repo")
    plan.set_defaults(func=cmd_plan)

    comp = sub.add_parser("compare", help="paired bootstrap of two lm-eval runs (--output_path with --log_samples)")
    comp.add_argument("run_a", help="baseline run: an lm-eval output folder or its results_*.json")
    comp.add_argument("run_b", nargs="+", help="candidate run(s), same documents as RUN_A; each is compared with it")
    comp.add_argument("--margin", type=float, default=0.03, help="non-inferiority margin in metric units")
    comp.add_argument("--iters", type=int, default=10_000, help="bootstrap resamples")
    comp.add_argument("--seed", type=int, default=0, help="bootstrap seed")
    comp.add_argument("--tasks", nargs="+", default=None, help="compare only these tasks")
    comp.add_argument(
        "--suite", action="append", metavar="NAME=PATTERN[,PATTERN]", help="also the mean over matching tasks"
    )
    comp.add_argument("--json", default=None, help="write the report as JSON")
    comp.add_argument("--markdown", default=None, help="write the Markdown table")
    comp.add_argument("--plot", default=None, help="write a PNG forest plot of the deltas")
    comp.set_defaults(func=cmd_compare)
    for name, subparser in sub.choices.items():  # every subcommand: defaults in --help, errors under its own name
        subparser.formatter_class = _Formatter
        subparser.set_defaults(_parser=subparser, command=name)
    return parser


def _one_line(parser: argparse.ArgumentParser, message: str, status: int) -> int:
    """argparse's error format without the usage block: `PROG: error: MESSAGE` on stderr."""
    print(f"{parser.prog}: error: {message}", file=sys.stderr)
    return status


def main(argv: list[str] | None = None) -> int:
    from hf_loopcache._hub import HubUnreachableError
    from hf_loopcache.fixtures import FixturesNotInstalledError

    parser = build_parser()
    args = parser.parse_args(argv)
    command_parser = getattr(args, "_parser", parser)
    try:
        return int(args.func(args) or 0)
    except UsageError as err:
        return _one_line(command_parser, str(err), 2)
    except (FixturesNotInstalledError, HubUnreachableError) as err:  # the environment, not an argument
        return _one_line(command_parser, str(err), 1)


if __name__ == "__main__":
    sys.exit(main())
