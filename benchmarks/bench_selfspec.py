"""Self-speculative decoding against sequential decoding through the same decode loop, with RIPE Eq. (7)-(8) beside.

Two modes:

- `--acceptance-only` (CPU is enough): real greedy acceptance of the trained fixtures (`tiny-ouro`, `tiny-huginn`) on
  held-out prompts, per cache and draft depth; writes `results/<out>.json` (`selfspec_acceptance` by default).
- default (GPU): per shape x cache x batch, sequential decoding (`block_size=0`: one full-depth one-token forward per
  step, the same loop, cache and host sync per step as the speculative run) and self-speculative decoding
  (`draft_loops=d`, `block_size=gamma`), each with the same prompt, the same number of new tokens per row (EOS off)
  and a fresh cache. Fixtures decode with their real acceptance; the real-size random-weight shapes (Ouro-1.4B,
  Huginn-0125) cannot agree with their drafts, so their verifier outcome is forced (`forced_acceptance=alpha`: each
  draft token accepted with probability alpha, independently, as Eq. 7 assumes) at the acceptance the same-family
  fixture measured with the same cache earlier in the same call (pooled over its batches; else from
  `--acceptance-file`, by default the fixtures' fp32 acceptance in `results/selfspec_acceptance.json`); the drafts,
  verifications, rollbacks and commits they run are the real ones. Default shapes: Huginn-0125 (d = 4 of 32) and
  Ouro-1.4B (d = 2 of 4), over the full cache, RIPE(64), the deepest plane and LoopKV `kivi4-share`, batches 1 and 8.

One call fits a wall-time budget (`--budget-s`, default 240 s): rows run shape by shape, batch 1 first, and a row
whose estimated time (the longest finished row of its shape and batch, else twice the warm-up's step time per token)
does not fit what is left is written as skipped, with its estimate. The sequential baseline decodes `--seq-tokens`
tokens (default 12) and its mean step time is scaled to `--new-tokens` (a decode step is flat over a few dozen
tokens); the speculative run decodes all `--new-tokens`. With CUDA, a probe of one dense cell's attention comes first
per shape and batch (`probe_attention`: host and GPU time per call and SDPA's backend, the key length growing per
call): it shows what each attention form a decoder uses costs on the machine.

`--mode graph` measures both ways through the static cache's captured steps instead (issue #16: a launch-bound eager
step flatters speculation): each cache is built `static=True` for the row's batch and `prompt + (new_tokens + 1) *
(gamma + 1)` positions (holes included), sequential decoding replays the captured one-token step and
self-speculation the captured drafts (one token, `d` loops) and verifications (`gamma + 1` tokens, every loop). Per
row and way, one run captures every step the timed runs replay (the same prompt and forced-acceptance seed), then the
cache is reset (it keeps storage and graphs) and decoded twice more: once with a `SpeculativeStats` (phase timing, so
synchronised per phase: gives `c` and `v`) and once without (one sync per block: gives the speed-up). LoopKV plans
are not captured for self-speculation yet (a row says so).

Per row: decode time (total minus prefill, CUDA synchronised), tokens/s, the measured speed-up, tokens per
verification `tau` (per row, and `tau_eff` = new tokens / verifications, what the slowest row of a batch allows), the
acceptance at each draft position, the cost ratios `c = t(draft forward) / t(sequential step)` and
`v = t(verification) / t(sequential step)`, RIPE Eq. (8)'s prediction `S = tau(alpha, gamma) / (gamma c + 1)` (eta = 1,
tau from Eq. 7 at the measured alpha) and the accounting `tau_eff / (gamma c + v)`. Timing phases needs syncs, so the
speculative run passes a `SpeculativeStats` (the step already syncs once per verification for the acceptance).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import RESULTS, build, peak_gib, reset_peak, timed, write_rows
from hf_loopcache import (
    DeepestPlaneCache,
    FullLoopCache,
    LoopKVCache,
    RIPECache,
    SpeculativeStats,
    self_speculative_generate,
)
from hf_loopcache.fixtures import heldout_documents, load_fixture

CACHES = {
    "full": lambda model, gamma, **kw: FullLoopCache(model, **kw),
    "ripe64": lambda model, gamma, **kw: RIPECache(model, window=max(64, gamma), **kw),
    "deepest": lambda model, gamma, **kw: DeepestPlaneCache(model, **kw),
    "loopkv-kivi4-share": lambda model, gamma, **kw: LoopKVCache(model, "kivi4-share", **kw),
}


def make_cache(name: str, model: Any, gamma: int, mode: str, batch: int, length: int) -> Any:
    """A fresh cache of the row: growable (`eager`), or static for `batch` rows and `length` positions (`graph`)."""
    if mode == "graph":
        return CACHES[name](model, gamma, static=True, max_batch_size=batch, max_cache_len=length)
    return CACHES[name](model, gamma)
FIXTURES = ("tiny-ouro", "tiny-huginn")
#: draft depth per shape (Huginn-0125: RIPE's d = 4 of 32; the fixtures' acceptance is measured at these depths).
#: Ouro: d = 2 of 4, where Eq. (8) at gamma 4 and the tiny-ouro fixture's acceptance is highest with d = 3 about
#: equal (full cache: alpha 0.50 / 0.83 / 0.97 at d = 1 / 2 / 3 gives 0.97x / 1.18x / 1.17x with c = d / 4); d = 2
#: drafts at half the cost, so it loses less when acceptance falls (RIPE(64): alpha 0.66 at d = 2).
DRAFT_LOOPS = {"tiny-ouro": 2, "ouro-1.4b": 2, "tiny-huginn": 4, "huginn-0125": 4, "micro-ouro": 2, "micro-huginn": 2}
#: the fixture whose measured acceptance drives a random-weight shape
FAMILY = {
    "ouro-1.4b": "tiny-ouro",
    "micro-ouro": "tiny-ouro",
    "huginn-0125": "tiny-huginn",
    "micro-huginn": "tiny-huginn",
}


def tau_eq7(alpha: float, gamma: int) -> float:
    """RIPE Eq. (7): expected tokens per verification at flat acceptance `alpha`."""
    return float(gamma + 1) if alpha >= 1.0 else (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def speedup_eq8(alpha: float, gamma: int, cost_ratio: float) -> float:
    """RIPE Eq. (8) with eta = 1: `tau(alpha, gamma) / (gamma c(d)/c(R) + 1)`."""
    return tau_eq7(alpha, gamma) / (gamma * cost_ratio + 1.0)


def _model(shape: str, dtype: torch.dtype, device: str):
    if shape in FIXTURES:
        model, tok = load_fixture(shape, dtype=dtype, device=device)
    else:
        model, tok = build(shape, dtype, device), None
    model.generation_config.eos_token_id = None  # every row decodes exactly `new_tokens`
    return model, tok


def _prompts(shape: str, model: Any, tok: Any, batch: int, length: int, device: str) -> torch.Tensor:
    if tok is None:
        gen = torch.Generator().manual_seed(0)
        return torch.randint(1, model.config.vocab_size, (batch, length), generator=gen).to(device)
    rows = []
    for text in heldout_documents():
        ids = tok(text, return_tensors="pt")["input_ids"][0]
        if ids.shape[0] >= length:
            rows.append(ids[:length])
        if len(rows) == batch:
            break
    if len(rows) < batch:
        raise ValueError(f"only {len(rows)} held-out documents have {length} tokens; lower --prompt")
    return torch.stack(rows).to(device)


def _decode(model, ids, cache, *, draft, gamma, new_tokens, alpha, kwargs, mode="eager") -> tuple[SpeculativeStats, float]:
    """Decode once and return the stats and the decode time (total minus prefill). `graph`: on a static cache, a run
    that captures every step first, then (after `cache.reset()`) a timed run with stats and one without; the decode
    time is the one without (no phase syncs), minus the prefill the stats run measured."""

    def run(stats: SpeculativeStats | None) -> float:
        gen = torch.Generator(device=ids.device).manual_seed(0)
        _, total = timed(
            lambda: self_speculative_generate(
                model,
                ids,
                draft_loops=draft,
                block_size=gamma,
                max_new_tokens=new_tokens,
                cache=cache,
                speculative_stats=stats,
                forced_acceptance=alpha,
                generator=gen,
                **kwargs,
            ),
            str(ids.device),
        )
        return total

    stats = SpeculativeStats()
    if mode != "graph":
        return stats, run(stats) - stats.prefill_time_s
    run(None)  # captures
    cache.reset()
    run(stats)
    cache.reset()
    return stats, run(None) - stats.prefill_time_s


def run_row(model, shape, cache_name, batch, ids, args, alpha) -> dict[str, Any]:
    gamma, draft, device = args.block_size, DRAFT_LOOPS[shape], args.device
    kwargs = {"init_scale": 0.0} if "huginn" in shape else {}
    new = args.new_tokens
    seq_new = min(new, args.seq_tokens) if args.seq_tokens else new
    length = ids.shape[1] + (new + 1) * (gamma + 1)  # static storage: every block may leave up to gamma holes
    make = lambda: make_cache(cache_name, model, gamma, args.mode, ids.shape[0], length)  # noqa: E731
    row: dict[str, Any] = {
        "mode": args.mode,
        "shape": shape,
        "cache": cache_name,
        "batch": batch,
        "prompt": ids.shape[1],
        "new_tokens": new,
        "dtype": args.dtype,
        "layout": model.loop_layout.describe(),
        "draft_loops": draft,
        "block_size": gamma,
        "acceptance": "real" if alpha is None else f"forced at {alpha:.4f}",
    }
    try:
        make()  # a plan this shape cannot take raises here
    except ValueError as err:  # e.g. a coded plan whose group size does not divide this shape's head dim
        row.update(status="unsupported", error=str(err)[:200])
        return row
    try:
        reset_peak(device)
        seq_cache = make()
        seq_stats, t_seq = _decode(
            model, ids, seq_cache, draft=draft, gamma=0, new_tokens=seq_new, alpha=None, kwargs=kwargs, mode=args.mode
        )
        captured = seq_cache.captured_steps() if args.mode == "graph" else []
        del seq_cache
        seq_peak = peak_gib(device)
        reset_peak(device)
        spec_cache = make()
        stats, t_spec = _decode(
            model, ids, spec_cache, draft=draft, gamma=gamma, new_tokens=new, alpha=alpha, kwargs=kwargs, mode=args.mode
        )
        if args.mode == "graph":
            captured += spec_cache.captured_steps()
            row["captured_steps"] = len(captured)
            row["capture_s"] = round(sum(step["capture_s"] for step in captured), 3)
        del spec_cache
    except torch.OutOfMemoryError as err:
        row.update(status="oom", error=str(err).splitlines()[0][:200])
        return row
    steps = new - 1  # tokens after the one the prefill gives
    t_step = t_seq / (seq_new - 1)  # the sequential step is flat over a few dozen tokens: measure fewer, scale
    t_seq = t_step * steps
    t_draft = stats.draft_time_s / max(1, stats.draft_forwards)
    t_verify = stats.verify_time_s / max(1, stats.verifications)
    c, v = t_draft / t_step, t_verify / t_step
    alpha_hat = stats.acceptance_rate
    tau_eff = steps / max(1, stats.verifications)
    row.update(
        status="ok",
        sequential_decode_s=round(t_seq, 4),
        speculative_decode_s=round(t_spec, 4),
        sequential_tokens_per_s=round(batch * steps / t_seq, 2),
        speculative_tokens_per_s=round(batch * steps / t_spec, 2),
        speedup=round(t_seq / t_spec, 3),
        acceptance_rate=round(alpha_hat, 4),
        acceptance_by_position=[round(a, 4) for a in stats.acceptance_by_position],
        accepted=list(stats.accepted),
        reached=list(stats.reached),
        tokens_per_verification=round(stats.tokens_per_verification, 3),
        tau_eq7=round(tau_eq7(alpha_hat, gamma), 3),
        tau_eff=round(tau_eff, 3),
        verifications=stats.verifications,
        ms_sequential_step=round(1000 * t_step, 3),
        ms_draft_forward=round(1000 * t_draft, 3),
        ms_verification=round(1000 * t_verify, 3),
        cost_ratio_draft=round(c, 4),
        cost_ratio_verify=round(v, 4),
        cost_ratio_layer_passes=round(_passes(model, draft) / _passes(model, model.loop_layout.num_loops), 4),
        sequential_steps_measured=seq_new - 1,
        predicted_speedup_eq8=round(speedup_eq8(alpha_hat, gamma, c), 3),
        predicted_speedup_eq8_measured_verify=round(tau_eq7(alpha_hat, gamma) / (gamma * c + v), 3),
        predicted_speedup_accounting=round(tau_eff / (gamma * c + v), 3),
        speedup_over_eq8=round((t_seq / t_spec) / speedup_eq8(alpha_hat, gamma, c), 3),
        peak_memory_gib_sequential=seq_peak,
        peak_memory_gib_speculative=peak_gib(device),
    )
    return row


def _passes(model, loops: int) -> int:
    """RIPE's c(d) = n_pre + d n_core + n_coda, in layer passes."""
    layout = model.loop_layout
    return layout.n_prelude + loops * layout.n_core + layout.n_coda


def measure_acceptance(args) -> None:
    """Real greedy acceptance of the fixtures at batch 1 over several held-out prompts (fp32, CPU is enough)."""
    rows = []
    for shape in args.shapes:
        model, tok = _model(shape, getattr(torch, args.dtype), args.device)
        ids_all = _prompts(shape, model, tok, args.prompts, args.prompt, args.device)
        kwargs = {"init_scale": 0.0} if "huginn" in shape else {}
        for cache_name in args.caches:
            for draft in sorted({DRAFT_LOOPS[shape], *args.extra_draft_loops}):
                if not 1 <= draft < model.loop_layout.num_loops:
                    continue
                total = SpeculativeStats()
                for i in range(ids_all.shape[0]):
                    stats = SpeculativeStats()
                    self_speculative_generate(
                        model,
                        ids_all[i : i + 1],
                        draft_loops=draft,
                        block_size=args.block_size,
                        max_new_tokens=args.new_tokens,
                        cache=CACHES[cache_name](model, args.block_size),
                        speculative_stats=stats,
                        **kwargs,
                    )
                    _merge(total, stats)
                row = {
                    "shape": shape,
                    "cache": cache_name,
                    "draft_loops": draft,
                    "num_loops": model.loop_layout.num_loops,
                    "block_size": args.block_size,
                    "prompts": ids_all.shape[0],
                    "prompt": args.prompt,
                    "new_tokens": args.new_tokens,
                    "dtype": args.dtype,
                    "device": args.device,
                    "acceptance_rate": round(total.acceptance_rate, 4),
                    "acceptance_by_position": [round(a, 4) for a in total.acceptance_by_position],
                    "tokens_per_verification": round(total.tokens_per_verification, 3),
                    "tau_eq7": round(tau_eq7(total.acceptance_rate, args.block_size), 3),
                    "verifications": total.verifications,
                }
                print(row, flush=True)
                rows.append(row)
    print("wrote", write_rows(args.out, rows))


def _merge(total: SpeculativeStats, stats: SpeculativeStats) -> None:
    n = max(len(total.reached), len(stats.reached))
    total.reached = [a + b for a, b in zip(total.reached + [0] * n, stats.reached + [0] * n)][:n]
    total.accepted = [a + b for a, b in zip(total.accepted + [0] * n, stats.accepted + [0] * n)][:n]
    total.verifications += stats.verifications
    total.draft_forwards += stats.draft_forwards
    total.row_verifications += stats.row_verifications
    total.accepted_tokens += stats.accepted_tokens


def _alpha(shape: str, cache_name: str, rows: list[dict[str, Any]], acceptance: dict[tuple[str, str], float]):
    """The acceptance that drives a random-weight shape: pooled over this run's rows of the same-family fixture with
    the same cache (same dtype, prompt and block size), else from the acceptance file. Returns (alpha, source)."""
    if shape in FIXTURES:
        return None, "real"
    family = FAMILY[shape]
    same = [r for r in rows if r.get("status") == "ok" and r["shape"] == family and r["cache"] == cache_name]
    if same:
        accepted = sum(sum(r["accepted"]) for r in same)
        reached = sum(sum(r["reached"]) for r in same)
        return accepted / max(1, reached), f"{family} in this run, batches {[r['batch'] for r in same]}"
    key = (family, cache_name)
    if key not in acceptance:
        raise ValueError(
            f"no measured acceptance for {key}: run the fixture in the same call or pass --acceptance-file"
        )
    return acceptance[key], f"{family} from {Path(acceptance['__file__']).name}"  # type: ignore[index]


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if r.get("status") == "ok"]
    fig, ax = plt.subplots(figsize=(6.5, 5))
    markers = {"full": "o", "ripe64": "s", "deepest": "^", "loopkv-kivi4-share": "D"}
    colors = {1: "tab:blue", 8: "tab:orange"}
    top = max([1.0] + [max(r["speedup"], r["predicted_speedup_eq8"]) for r in ok]) * 1.1
    ax.plot([0, top], [0, top], color="grey", lw=0.8, label="measured = Eq. (8)")
    ax.plot([0, top], [0, 0.9 * top], color="grey", lw=0.8, ls="--", label="0.9 x Eq. (8)")
    for r in ok:
        ax.scatter(
            r["predicted_speedup_eq8"],
            r["speedup"],
            marker=markers.get(r["cache"], "x"),
            color=colors.get(r["batch"], "tab:green"),
            s=40,
        )
        ax.annotate(
            r["shape"],
            (r["predicted_speedup_eq8"], r["speedup"]),
            fontsize=6,
            xytext=(3, 2),
            textcoords="offset points",
        )
    for cache, m in markers.items():
        ax.scatter([], [], marker=m, color="black", label=cache)
    for batch, col in colors.items():
        ax.scatter([], [], marker="o", color=col, label=f"batch {batch}")
    ax.set_xlabel("RIPE Eq. (8) prediction (measured alpha and draft cost ratio, eta = 1)")
    ax.set_ylabel("measured speed-up over sequential decoding")
    ax.set_xlim(0, top)
    ax.set_ylim(0, top)
    ax.legend(fontsize=7)
    ax.set_title("Self-speculative decoding (same decode loop both ways)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=130)


def probe_attention(model, batch: int, length: int, gamma: int, device: str) -> dict[str, Any]:
    """Host and GPU time per call, and the SDPA backend, of one dense cell's attention in the forms a decoder hands
    SDPA, the key length growing by one per call as in decoding (so a backend that builds a graph per shape, cuDNN,
    pays it on every call): a decode step (`q = 1`, no mask), a verification without holes (`q = gamma + 1`: the
    lower-right `CausalBias` it uses now, and the bool mask it had), and a step of a batch with holes (bool mask),
    each with PyTorch's default choice and as `dense_attention` calls it (cuDNN left out). Shape: the model's KV
    heads and head dim after `length` cached positions."""
    from torch.nn.attention import sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    from hf_loopcache.attention import _backends_without_cudnn, causal_padding_mask

    layout = model.loop_layout
    heads, dim = layout.num_kv_heads, layout.head_dim
    dtype = next(model.parameters()).dtype
    calls = 12
    room = length + gamma + 1 + 2 * calls
    k = torch.randn(batch, heads, room, dim, device=device, dtype=dtype)
    v = torch.randn_like(k)
    valid = torch.ones(batch, room, dtype=torch.bool, device=device)
    valid[:, length // 2 : length // 2 + 3] = False  # a few holes
    pos = torch.arange(room, device=device)
    forms: dict[str, Any] = {}
    for name, q_len, kind, no_cudnn in (
        ("decode_q1_default", 1, None, False),
        ("decode_q1_no_cudnn", 1, None, True),
        ("verify_bool_mask_default", gamma + 1, "bool", False),
        ("verify_lower_right_no_cudnn", gamma + 1, "bias", True),
        ("holes_q1_mask_default", 1, "holes", False),
        ("holes_q1_mask_no_cudnn", 1, "holes", True),
        ("holes_verify_mask_no_cudnn", gamma + 1, "holes", True),
    ):
        q = torch.randn(batch, heads, q_len, dim, device=device, dtype=dtype)

        def call(i: int, q=q, q_len=q_len, kind=kind, no_cudnn=no_cudnn, choice=False):
            total = length + q_len + i  # a new key length on every call
            kk, vv = k[:, :, :total], v[:, :, :total]
            if kind == "bias":
                mask: Any = causal_lower_right(q_len, total)
            elif kind == "bool":
                mask = causal_padding_mask(pos[total - q_len : total], pos[:total], None)
            elif kind == "holes":
                mask = causal_padding_mask(pos[total - q_len : total], pos[:total], valid[:, :total])
            else:
                mask = None
            if choice:  # the backend SDPA picks (SDPBackend value: 0 math, 1 flash, 2 efficient, 3 cuDNN)
                if kind == "bias":
                    return "CausalBias: flash if it can, else efficient"
                with sdpa_kernel(_backends_without_cudnn()) if no_cudnn else contextlib.nullcontext():
                    return int(torch._fused_sdp_choice(q, kk, vv, mask, 0.0, False))
            with sdpa_kernel(_backends_without_cudnn()) if no_cudnn else contextlib.nullcontext():
                return torch.nn.functional.scaled_dot_product_attention(q, kk, vv, attn_mask=mask)

        try:
            backend: Any = call(0, choice=True)
        except Exception as err:  # noqa: BLE001 - a private op; the timing below is what matters
            backend = f"unknown ({type(err).__name__})"
        call(calls)  # first call of the form (module load), at a length the timed calls do not use
        _sync(device)
        gpu, host = [], []
        for i in range(calls):
            if device.startswith("cuda"):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                t0 = time.perf_counter()
                start.record()
                call(i)
                end.record()
                host.append(time.perf_counter() - t0)
                end.synchronize()
                gpu.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                call(i)
                host.append(time.perf_counter() - t0)
        forms[name] = {
            "sdpa_backend": backend,
            "gpu_ms_median": round(sorted(gpu)[calls // 2], 4) if gpu else None,
            "host_ms_median": round(1000 * sorted(host)[calls // 2], 4),
            "host_ms_max": round(1000 * max(host), 4),
        }
    return {
        "status": "probe",
        "kind": "dense attention, key length +1 per call",
        "batch": batch,
        "cached": length,
        "forms": forms,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--acceptance-only", action="store_true", help="measure the fixtures' real acceptance only")
    parser.add_argument("--shapes", nargs="+", default=None, help="default: huginn-0125 ouro-1.4b (fixtures optional)")
    parser.add_argument(
        "--caches", nargs="+", default=["full", "ripe64", "deepest", "loopkv-kivi4-share"], choices=sorted(CACHES)
    )
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    parser.add_argument("--prompt", type=int, default=1024, help="prompt tokens per row")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument(
        "--seq-tokens",
        type=int,
        default=12,
        help="tokens the sequential baseline decodes; its mean step time is scaled to --new-tokens (0: all of them)",
    )
    parser.add_argument("--block-size", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=8, help="--acceptance-only: held-out prompts per fixture")
    parser.add_argument("--extra-draft-loops", nargs="*", type=int, default=[], help="--acceptance-only: more d")
    parser.add_argument(
        "--acceptance-file",
        default=str(RESULTS / "selfspec_acceptance.json"),
        help="fallback acceptance for random-weight shapes whose fixture is not in the same call",
    )
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--budget-s",
        "--max-seconds",
        dest="budget_s",
        type=float,
        default=240.0,
        help="wall-time budget of the whole run: a row whose estimated time does not fit is skipped with a note",
    )
    parser.add_argument("--no-probe", action="store_true", help="skip the dense-attention probe (CUDA only)")
    parser.add_argument(
        "--mode",
        choices=["eager", "graph"],
        default="eager",
        help="decode path of both ways: eager forwards over growable caches, or the static cache's captured steps",
    )
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    if args.acceptance_only:
        args.shapes = args.shapes or list(FIXTURES)
        args.out = args.out or "selfspec_acceptance"
        measure_acceptance(args)
        return
    args.shapes = args.shapes or ["huginn-0125", "ouro-1.4b"]
    args.out = args.out or "selfspec"
    acceptance: dict[Any, Any] = {}
    if Path(args.acceptance_file).exists():
        acceptance = {
            (r["shape"], r["cache"]): r["acceptance_rate"]
            for r in json.loads(Path(args.acceptance_file).read_text())["rows"]
            if r["draft_loops"] == DRAFT_LOOPS[r["shape"]] and r["block_size"] == args.block_size
        }
        acceptance["__file__"] = args.acceptance_file
    start, rows = time.perf_counter(), []
    left = lambda: args.budget_s - (time.perf_counter() - start)  # noqa: E731
    models: dict[str, tuple[Any, Any, float]] = {}  # shape -> (model, tokenizer, warm-up step time in s)
    for shape in args.shapes:  # every model up front (all fit on one H200), so rows can run batch 1 first
        model, tok = _model(shape, getattr(torch, args.dtype), args.device)
        warm = _prompts(shape, model, tok, 1, 64, args.device)
        kwargs = {"init_scale": 0.0} if "huginn" in shape else {}
        step_s = 0.0
        for gamma in (0, args.block_size):  # warm-up: kernels, allocator, both loop depths
            t0 = time.perf_counter()
            self_speculative_generate(
                model,
                warm,
                draft_loops=DRAFT_LOOPS[shape],
                block_size=gamma,
                max_new_tokens=6,
                forced_acceptance=None if shape in FIXTURES else 0.5,
                **kwargs,
            )
            _sync(args.device)
            if gamma == 0:
                step_s = (time.perf_counter() - t0) / 6  # a full-depth step at batch 1 (prefill included: upper bound)
        models[shape] = (model, tok, step_s)
        if args.device.startswith("cuda") and not args.no_probe and args.mode == "eager":
            for batch in args.batches:
                probe = probe_attention(model, batch, args.prompt, args.block_size, args.device)
                probe["shape"] = shape
                print(probe, flush=True)
                rows.append(probe)
    done: dict[tuple[str, int], float] = {}  # (shape, batch) -> longest row so far (s)
    for batch in args.batches:
        for shape in args.shapes:
            model, tok, step_s = models[shape]
            for cache_name in args.caches:
                # before the first row of this shape and batch: the sequential baseline's steps and about as many
                # step-equivalents for the speculative run, from the warm-up step, with a margin; then the longest row
                first = 1.5 * step_s * (args.seq_tokens + args.new_tokens) * (1 + batch / 8)
                estimate = 1.1 * done[(shape, batch)] if (shape, batch) in done else first
                if estimate > left():
                    rows.append(
                        {
                            "shape": shape,
                            "cache": cache_name,
                            "batch": batch,
                            "status": f"skipped (budget: needs about {estimate:.0f} s, {max(0.0, left()):.0f} s left)",
                        }
                    )
                    continue
                ids = _prompts(shape, model, tok, batch, args.prompt, args.device)
                alpha, source = _alpha(shape, cache_name, rows, acceptance)
                t0 = time.perf_counter()
                try:
                    row = run_row(model, shape, cache_name, batch, ids, args, alpha)
                except Exception as err:  # noqa: BLE001 - one device call makes the table: record, go on
                    row = {"shape": shape, "cache": cache_name, "batch": batch, "status": "error"}
                    row["error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else ''}"
                row["acceptance_source"] = source
                row["row_wall_s"] = round(time.perf_counter() - t0, 1)
                done[(shape, batch)] = max(done.get((shape, batch), 0.0), row["row_wall_s"])
                print(row, flush=True)
                rows.append(row)
                write_rows(args.out, rows)  # after every row: a call cut short keeps what it measured
                reset_peak(args.device)
    models.clear()
    print("wrote", write_rows(args.out, rows), f"({time.perf_counter() - start:.0f} s)")
    png = RESULTS / f"{args.out}.png"
    plot(rows, png)
    print("wrote", png)
    print(summary(rows))


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def summary(rows: list[dict[str, Any]]) -> str:
    """The README's table (Markdown): per row alpha, the measured cost ratios, Eq. (8) and the measured speed-up
    with its share of Eq. (8); skipped rows with their note."""
    lines = [
        "| model | mode | cache | batch | alpha | c (draft) | v (verify) | Eq. (8) | measured speed-up | seq. tok/s | "
        "spec. tok/s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r.get("status") == "probe":
            continue
        if r.get("status") != "ok":
            lines.append(f"| {r['shape']} | {r.get('mode', 'eager')} | {r['cache']} | {r['batch']} | {r.get('status')} | | | | | | |")
            continue
        lines.append(
            f"| {r['shape']} | {r.get('mode', 'eager')} | {r['cache']} | {r['batch']} | {r['acceptance_rate']:.3f} | "
            f"{r['cost_ratio_draft']:.3f} | "
            f"{r['cost_ratio_verify']:.2f} | {r['predicted_speedup_eq8']:.2f}x | {r['speedup']:.2f}x "
            f"({r['speedup_over_eq8']:.2f} of Eq. 8) | {r['sequential_tokens_per_s']:.1f} | "
            f"{r['speculative_tokens_per_s']:.1f} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
