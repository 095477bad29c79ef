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

How the time is measured. Both ways decode all `--new-tokens` tokens per row (default 64) and are timed directly:
`SpeculativeStats(phase_timing=False).decode_time_s`, from the host read of the prefill's token (the decoder's first
sync, so the prefill is done and not counted) to the end of the last block (one sync after the loop), with no sync
added per block: the decode as it runs without stats. (Before session 12 the decode time was the call's total minus a
separately timed prefill, and the sequential way decoded 12 tokens and was scaled: at batch 8 that difference came out
negative.) A second speculative run with `SpeculativeStats()` times the draft and verification phases (a sync around
each) for the cost ratios `c = t(draft forward) / t(sequential step)` and `v = t(verification) / t(sequential step)`;
its total is not used. Throughput counts the tokens committed after the prefill's, of every row, over the decode time
(`sequential_tokens_per_s`, `speculative_tokens_per_s`); the speed-up is their ratio.

`--mode graph` measures both ways through the static cache's captured steps (issue #16: a launch-bound eager step
flatters speculation): each cache is built `static=True` for the row's batch and `prompt + (new_tokens + 1) *
(gamma + 1)` positions (holes included); sequential decoding replays the captured one-token step and self-speculation
the captured drafts (one token, `d` loops) and verifications (`gamma + 1` tokens, every loop). A run that captures
every step the timed runs replay comes first (the same prompt and forced-acceptance seed, so the same blocks), then
the cache is reset (it keeps storage and graphs) before each timed run. A row during which a `triton_ops` op fell back
to its reference (`triton_ops._dispatch.fallback_counts`, e.g. a head dim the coded-attention kernel does not take)
gets `status: "fallback..."` and its messages, and is left out of the table's measurements and the plot; the check
runs after each way's first runs (the captures), so such a row is refused before its timed runs.

Predictions. Per row: the pooled acceptance `alpha` (accepted over tested drafts), each row's own acceptance
(`row_acceptance`) and verifications, `tau` per row-verification, `tau_eff` = tokens per row / verifications of the
batch, and RIPE Eq. (8) `S = tau(alpha, gamma) / (gamma c + 1)` (eta = 1, `tau` from Eq. 7 at the measured alpha):
the steady state, what a decoder that refills finished rows gets. A batch decodes its rows independently (each row
advances by its own `k_b + 1` per verification; the shorter rows' positions become holes: no row waits within a
block), but a call of fixed length ends when its slowest row has its `n` tokens, and the rows done earlier ride along
in every forward. So this call's prediction is `predicted_speedup_eq8_batch = (n / E[max_b T_b]) / (gamma c + 1)`,
`T_b` the verifications row `b` needs for `n` tokens at its measured acceptance under Eq. 7's model
(`batch_tokens_per_verification`; `_pooled`: every row at the pooled alpha, what forced acceptance draws). At batch 1
it is below Eq. 8 by the last block's rounding only (small for n = 64); at batch 8 with n = 64 and alpha = 0.66 the
slowest of 8 rows costs about 16 % (0.84 of the steady state; 0.74 at n = 24). The sequential way has no such tail
(every row takes exactly `n` steps). `predicted_speedup_accounting = tau_eff / (gamma c + v)` is what the measured
block cost and the realised tokens per verification give; `ms_block_timed` against `ms_block_phases` shows the
host and sync time per block the phase syncs add.

One call fits a wall-time budget (`--budget-s`, default 240 s): rows run shape by shape, batch 1 first, and a row
whose estimated time (the longest finished row of its shape and batch, else from the warm-up's step time) does not
fit what is left is written as skipped, with its estimate. With CUDA and `--mode eager`, a probe of one dense cell's
attention comes first per shape and batch (`probe_attention`: host and GPU time per call and SDPA's backend).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import RESULTS, apply_row1_tuning, build, environment, peak_gib, reset_peak, write_rows
from hf_loopcache import (
    DeepestPlaneCache,
    FullLoopCache,
    LoopKVCache,
    RIPECache,
    SpeculativeStats,
    self_speculative_generate,
)
from hf_loopcache.fixtures import heldout_documents, load_fixture
from hf_loopcache.generation import best_block_size, expected_block_tokens, expected_speedup, layer_cost_ratio
from triton_ops._dispatch import fallback_counts

CACHES = {
    "full": lambda model, gamma, **kw: FullLoopCache(model, **kw),
    "ripe64": lambda model, gamma, **kw: RIPECache(model, window=max(64, gamma), **kw),
    "deepest": lambda model, gamma, **kw: DeepestPlaneCache(model, **kw),
    # the default (`v_precision_blocks=None`): verification blocks read both planes of every token (the plain INT4
    # kernel); one-token forwards (decode, drafts) keep V precision. Until session 37 the default read blocks with V
    # precision per row: this name's rows in results before then are the "-vprec-blocks" cache
    "loopkv-kivi4-share": lambda model, gamma, **kw: LoopKVCache(model, "kivi4-share", **kw),
    # the same read in every block (`v_precision_blocks=False`)
    "loopkv-kivi4-share-verify-int4": lambda model, gamma, **kw: LoopKVCache(
        model, "kivi4-share", v_precision_blocks=False, **kw
    ),
    # V precision per query row in verification blocks too (`v_precision_blocks=True`)
    "loopkv-kivi4-share-vprec-blocks": lambda model, gamma, **kw: LoopKVCache(
        model, "kivi4-share", v_precision_blocks=True, **kw
    ),
}
# caches whose acceptance the acceptance file holds under another name: its "loopkv-kivi4-share" rows were measured
# with V precision in blocks (before session 37; "-verify-int4" rows, with both planes, came out identical)
ACCEPTANCE_AS = {"loopkv-kivi4-share-vprec-blocks": "loopkv-kivi4-share"}


def storage_length(prompt: int, new_tokens: int, gamma: int) -> int:
    """Positions a static cache of a row allocates: the prompt and `gamma + 1` per block for up to `new_tokens + 1`
    blocks (every block may leave up to `gamma` holes)."""
    return prompt + (new_tokens + 1) * (gamma + 1)


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


class FellBack(RuntimeError):
    """A row's first run used a `triton_ops` reference (see `mark_fallbacks`): it is not timed further."""


def _refuse_fallbacks(before: dict[str, int]) -> None:
    now = fallback_counts()
    new = [msg for msg, n in now.items() if n > before.get(msg, 0)]
    if new:
        raise FellBack("; ".join(new))


def _decode(
    model, ids, cache, *, draft, gamma, new_tokens, alpha, kwargs, mode="eager", phases=True, fallbacks=None, auto=False
) -> tuple[SpeculativeStats | None, SpeculativeStats]:
    """Decode `ids` and return `(phase stats, timed stats)`.

    The timed run passes `SpeculativeStats(phase_timing=False)`: its `decode_time_s` runs from the host read of the
    prefill's token (the prefill is done) to the end of the last block, with no sync added per block, so it is the
    decode as it runs without stats. With `phases`, a run before it passes a `SpeculativeStats()` that times the draft
    and verification phases (a sync around each: gives `c` and `v`; its own total is not used). `graph`: on a static
    cache a run that captures every step comes first (the same prompt and seed, so the same blocks; the whole length
    both ways: a static dense read changes mode once the storage is 2/3 full, `layers.static.dense_read`, and the
    step of each mode is its own graph, which a shorter capture run would leave to the timed run), and the cache is
    reset (it keeps storage and graphs) before each later run. Eager runs reset the (growable) cache between runs as
    well. `auto`: `block_size="auto"` with `gamma` the largest block (its choices follow the accepted lengths, which
    the seed fixes, so every run takes the same blocks and the capture run records each block length)."""
    blocks = dict(block_size="auto", max_block_size=gamma) if auto else dict(block_size=gamma)

    def run(stats: SpeculativeStats | None) -> None:
        gen = torch.Generator(device=ids.device).manual_seed(0)
        self_speculative_generate(
            model,
            ids,
            draft_loops=draft,
            **blocks,
            max_new_tokens=new_tokens,
            cache=cache,
            speculative_stats=stats,
            forced_acceptance=alpha,
            generator=gen,
            **kwargs,
        )
        cache.reset()

    if mode == "graph":
        run(None)  # captures
    phase = None
    if phases:
        phase = SpeculativeStats()
        run(phase)
    if fallbacks is not None:  # the row's forwards have all run once: stop here if one used a reference op
        _refuse_fallbacks(fallbacks)
    timed_stats = SpeculativeStats(phase_timing=False)
    captured = len(cache.captured_steps()) if mode == "graph" else 0
    run(timed_stats)
    if mode == "graph" and len(cache.captured_steps()) != captured:
        raise RuntimeError(f"the timed run captured {len(cache.captured_steps()) - captured} step(s): not a replay")
    return phase, timed_stats


def row_completion_pmf(alpha: float, gamma: int, n: int, t_max: int) -> list[float]:
    """`P(T <= t)` for `t = 0 .. t_max`: `T` the verifications a row needs for `n` tokens when each verification gives
    it `k + 1` tokens, `k` the accepted drafts of `gamma`, each accepted with probability `alpha` independently
    (Eq. 7's model, which forced acceptance draws). The decoder shortens the last blocks to the longest row's
    remaining budget; that does not change when a row reaches `n` (a row with `r` tokens left still needs `r - 1`
    accepted drafts), so `T` is the same as without it."""
    step = [alpha ** (j - 1) * (1 - alpha) for j in range(1, gamma + 1)] + [alpha**gamma]  # P(k + 1 = j)
    dist = [0.0] * (n + 1)  # tokens so far, capped at n (absorbing)
    dist[0] = 1.0
    done = [0.0 if n > 0 else 1.0]
    for _ in range(t_max):
        nxt = [0.0] * (n + 1)
        nxt[n] = dist[n]
        for have in range(n):
            if dist[have]:
                for j, p in enumerate(step, start=1):
                    nxt[min(n, have + j)] += dist[have] * p
        dist = nxt
        done.append(dist[n])
    return done


def batch_tokens_per_verification(alphas: list[float], gamma: int, n: int) -> float:
    """Expected tokens per row per verification of a batch that decodes `n` tokens per row, rows at acceptance
    `alphas` (one per row): `n / E[max_b T_b]`. Batched verification advances every row by its own `k_b + 1`
    (no row waits within a block: the shorter rows' positions become holes), but the call ends when its slowest row
    has its `n` tokens, and the rows done before it ride along (their share of each forward is spent). At batch 1
    it is `n / E[T]`, below Eq. 7's `tau` by the last block's rounding; for `n -> inf` it tends to the mean of Eq. 7
    over the rows (what a server that refills finished rows gets)."""
    if n <= 0:
        return 0.0
    t_max = n  # a verification gives every row at least one token
    cdfs = [row_completion_pmf(a, gamma, n, t_max) for a in alphas]
    expected = 0.0
    for t in range(t_max):
        all_done = 1.0
        for cdf in cdfs:
            all_done *= cdf[t]
        expected += 1.0 - all_done  # E[max T] = sum_t P(max T > t)
    return n / expected


def run_row(model, shape, cache_name, batch, ids, args, alpha) -> dict[str, Any]:
    gamma, draft, device = args.block_size, DRAFT_LOOPS[shape], args.device
    kwargs = {"init_scale": 0.0} if "huginn" in shape else {}
    new = args.new_tokens
    length = storage_length(ids.shape[1], new, gamma)
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
    if args.auto_block:
        row["block_rule"] = "auto"
    try:
        make()  # a plan this shape cannot take raises here
    except ValueError as err:  # e.g. a coded plan whose group size does not divide this shape's head dim
        row.update(status="unsupported", error=str(err)[:200])
        return row
    before = fallback_counts()
    try:
        reset_peak(device)
        seq_cache = make()
        _, seq = _decode(
            model, ids, seq_cache, draft=draft, gamma=0, new_tokens=new, alpha=None, kwargs=kwargs, mode=args.mode,
            phases=False, fallbacks=before,
        )
        captured = seq_cache.captured_steps() if args.mode == "graph" else []
        del seq_cache
        seq_peak = peak_gib(device)
        reset_peak(device)
        spec_cache = make()
        phase, spec = _decode(
            model, ids, spec_cache, draft=draft, gamma=gamma, new_tokens=new, alpha=alpha, kwargs=kwargs,
            mode=args.mode, fallbacks=before, auto=args.auto_block,
        )
        if args.mode == "graph":
            captured += spec_cache.captured_steps()
            row["captured_steps"] = len(captured)
            row["capture_s"] = round(sum(step["capture_s"] for step in captured), 3)
        del spec_cache
    except torch.OutOfMemoryError as err:
        row.update(status="oom", error=str(err).splitlines()[0][:200])
        return row
    except FellBack:  # `main` records the messages (`mark_fallbacks`)
        row.update(status="fallback (not timed: a reference op ran where the kernel was meant to)")
        return row
    row.update(_accounting(model, seq, phase, spec, gamma, draft, batch, auto=args.auto_block))
    row.update(peak_memory_gib_sequential=seq_peak, peak_memory_gib_speculative=peak_gib(device))
    return row


def _accounting(
    model, seq: SpeculativeStats, phase: Any, spec: SpeculativeStats, gamma: int, draft: int, batch: int, auto=False
):
    """A row's numbers from the sequential run's and the speculative runs' stats (see the module docstring). With
    `auto` (`block_size="auto"` up to `gamma`) the predictions are Eq. (8)'s at its best block for the measured
    alpha and c (`gamma_eq8_best`: what the best fixed block would gain), and the accounting's drafts per block are
    the measured mean."""
    seq_tokens = sum(seq.row_tokens) - batch  # committed after the prefill's token, all rows
    spec_tokens = sum(spec.row_tokens) - batch
    t_seq, t_spec = seq.decode_time_s, spec.decode_time_s
    t_step = t_seq / max(1, seq.verifications)  # one full-depth one-token forward per sequential step
    t_draft = phase.draft_time_s / max(1, phase.draft_forwards)
    t_verify = phase.verify_time_s / max(1, phase.verifications)
    c, v = t_draft / t_step, t_verify / t_step
    alpha_hat = spec.acceptance_rate
    largest, gamma = gamma, (best_block_size(alpha_hat, c, gamma) if auto else gamma)
    drafts = spec.draft_forwards / max(1, spec.verifications) if auto else gamma  # per block
    n = spec_tokens // batch  # tokens per row after the prefill's
    row_alpha = spec.row_acceptance
    tau_rows = [expected_block_tokens(a, gamma) for a in row_alpha]
    tau_steady = sum(tau_rows) / len(tau_rows)
    tau_batch = batch_tokens_per_verification(row_alpha, gamma, n)
    tau_pooled = batch_tokens_per_verification([alpha_hat] * batch, gamma, n)  # rows i.i.d. (forced acceptance)
    tau_eff = n / max(1, spec.verifications)
    seq_rate, spec_rate = seq_tokens / t_seq, spec_tokens / t_spec
    speedup = spec_rate / seq_rate
    eq8 = expected_speedup(alpha_hat, gamma, c)
    eq8_batch = tau_batch / (gamma * c + 1.0)
    phase_block_s = (phase.draft_time_s + phase.verify_time_s) / max(1, phase.verifications)
    return dict(
        status="ok",
        sequential_decode_s=round(t_seq, 4),
        speculative_decode_s=round(t_spec, 4),
        sequential_tokens=seq_tokens,
        speculative_tokens=spec_tokens,
        sequential_tokens_per_s=round(seq_rate, 2),
        speculative_tokens_per_s=round(spec_rate, 2),
        speedup=round(speedup, 3),
        acceptance_rate=round(alpha_hat, 4),
        acceptance_by_position=[round(a, 4) for a in spec.acceptance_by_position],
        accepted=list(spec.accepted),
        reached=list(spec.reached),
        row_acceptance=[round(a, 4) for a in row_alpha],
        row_verifications=list(spec.row_verifications_by_row),
        tokens_per_verification=round(spec.tokens_per_verification, 3),
        tau_eq7=round(expected_block_tokens(alpha_hat, gamma), 3),
        tau_rows_eq7_mean=round(tau_steady, 3),
        tau_batch_predicted=round(tau_batch, 3),
        tau_eff=round(tau_eff, 3),
        verifications=spec.verifications,
        ms_sequential_step=round(1000 * t_step, 3),
        ms_draft_forward=round(1000 * t_draft, 3),
        ms_verification=round(1000 * t_verify, 3),
        ms_block_timed=round(1000 * t_spec / max(1, spec.verifications), 3),
        ms_block_phases=round(1000 * phase_block_s, 3),
        cost_ratio_draft=round(c, 4),
        cost_ratio_verify=round(v, 4),
        cost_ratio_layer_passes=round(layer_cost_ratio(model.loop_layout, draft), 4),
        sequential_steps_measured=seq.verifications,
        predicted_speedup_eq8=round(eq8, 3),
        predicted_speedup_eq8_measured_verify=round(expected_block_tokens(alpha_hat, gamma) / (gamma * c + v), 3),
        predicted_speedup_eq8_batch=round(eq8_batch, 3),
        predicted_speedup_eq8_batch_pooled=round(tau_pooled / (gamma * c + 1.0), 3),
        tau_batch_predicted_pooled=round(tau_pooled, 3),
        predicted_speedup_accounting=round(tau_eff / (drafts * c + v), 3),
        speedup_over_eq8=round(speedup / eq8, 3),
        speedup_over_eq8_batch=round(speedup / eq8_batch, 3),
        **(
            dict(gamma_eq8_best=gamma, max_block_size=largest, block_sizes=dict(sorted(spec.block_sizes.items())))
            if auto
            else {}
        ),
    )


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
                    "tau_eq7": round(expected_block_tokens(total.acceptance_rate, args.block_size), 3),
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


def load_acceptance(path: str | Path, block_size: int) -> dict[Any, Any]:
    """`{(fixture, cache): acceptance}` from an acceptance file's rows at each fixture's draft depth and this block
    size (a cache of `ACCEPTANCE_AS` takes its other name's row where it has none), with the file's name under
    `"__file__"`; empty if the file does not exist."""
    if not Path(path).exists():
        return {}
    acceptance: dict[Any, Any] = {
        (r["shape"], r["cache"]): r["acceptance_rate"]
        for r in json.loads(Path(path).read_text())["rows"]
        if r["draft_loops"] == DRAFT_LOOPS[r["shape"]] and r["block_size"] == block_size
    }
    for (shape, cache), alpha in list(acceptance.items()):
        for alias in (a for a, source in ACCEPTANCE_AS.items() if source == cache):
            acceptance.setdefault((shape, alias), alpha)
    acceptance["__file__"] = str(path)
    return acceptance


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


def plot(rows: list[dict[str, Any]], path: Path, gpu: str | None = None) -> None:
    """Measured speed-up against Eq. (8) per row (marker: cache, color: batch); points are labelled with their
    shape only when the rows hold several. `gpu` goes into the title."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if r.get("status") == "ok"]
    fig, ax = plt.subplots(figsize=(6.5, 5))
    markers = {"full": "o", "ripe64": "s", "deepest": "^", "loopkv-kivi4-share": "D"}
    markers["loopkv-kivi4-share-verify-int4"] = "P"
    markers["loopkv-kivi4-share-vprec-blocks"] = "X"
    colors = {1: "tab:blue", 8: "tab:orange"}
    top = max([1.0] + [max(r["speedup"], r["predicted_speedup_eq8"]) for r in ok]) * 1.1
    ax.plot([0, top], [0, top], color="grey", lw=0.8, label="measured = Eq. (8)")
    ax.plot([0, top], [0, 0.9 * top], color="grey", lw=0.8, ls="--", label="0.9 x Eq. (8)")
    several = len({r["shape"] for r in ok}) > 1
    for r in ok:
        ax.scatter(
            r["predicted_speedup_eq8"],
            r["speedup"],
            marker=markers.get(r["cache"], "x"),
            color=colors.get(r["batch"], "tab:green"),
            s=40,
        )
        text = " ".join(t for t in (r["shape"] if several else "", r.get("label") or "") if t)
        if text:
            ax.annotate(
                text, (r["predicted_speedup_eq8"], r["speedup"]), fontsize=6, xytext=(3, 2), textcoords="offset points"
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
    title = "Self-speculative decoding (same decode loop both ways)"
    shapes = ", ".join(sorted({r["shape"] for r in ok}))
    ax.set_title(f"{title}\n{shapes}" + (f", {gpu}" if gpu else ""), fontsize=9)
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
    parser.add_argument("--new-tokens", type=int, default=64, help="tokens per row, both ways (timed directly)")
    parser.add_argument("--block-size", type=int, default=4)
    parser.add_argument("--auto-block", action="store_true",
                        help="self-speculate with block_size='auto' up to --block-size (each row's predictions at "
                             "Eq. 8's best block for its measured alpha and c)")  # fmt: skip
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
    parser.add_argument("--row1-tuning", nargs="*", default=[], metavar="KEY=VALUE",
                        help="overrides of coded attention's ROW1_TUNING for the run (recorded in the header), "
                             "e.g. vprec_lookback=true")  # fmt: skip
    parser.add_argument("--out", default=None)
    parser.add_argument("--replot", nargs="+", default=None, metavar="JSON",
                        help="no run: the plot (`--out`.png) and table of these result files together, rows labelled "
                             "with their block size where the files hold several")  # fmt: skip
    args = parser.parse_args(argv)
    if args.replot:
        replot(args.replot, args.out or "selfspec_replot")
        return
    apply_row1_tuning(args.row1_tuning)
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    if args.acceptance_only:
        args.shapes = args.shapes or list(FIXTURES)
        args.out = args.out or "selfspec_acceptance"
        measure_acceptance(args)
        return
    args.shapes = args.shapes or ["huginn-0125", "ouro-1.4b"]
    args.out = args.out or "selfspec"
    acceptance = load_acceptance(args.acceptance_file, args.block_size)
    start, rows = time.perf_counter(), []
    left = lambda: args.budget_s - (time.perf_counter() - start)  # noqa: E731
    models: dict[str, tuple[Any, Any, float]] = {}  # shape -> (model, tokenizer, warm-up step time in s)
    for shape in args.shapes:  # every model up front (all fit on one H200), so rows can run batch 1 first
        model, tok = _model(shape, getattr(torch, args.dtype), args.device)
        warm = _prompts(shape, model, tok, 1, 64, args.device)
        kwargs = {"init_scale": 0.0} if "huginn" in shape else {}
        step_s = 0.0
        # warm-up: kernels, allocator, both loop depths; the step time comes from a second sequential pass, after
        # Triton's compiles (the first pass's, compiles included, skipped LoopKV rows that fitted the budget)
        for gamma in (0, args.block_size, 0):
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
    done: dict[tuple, float] = {}  # (shape, batch) -> longest row so far, (shape, cache, batch) -> its row (s)
    for batch in args.batches:
        for shape in args.shapes:
            model, tok, step_s = models[shape]
            for cache_name in args.caches:
                estimate = _estimate(done, shape, cache_name, batch, step_s, args.new_tokens)
                if estimate > left():
                    rows.append(
                        {
                            "shape": shape,
                            "mode": args.mode,
                            "cache": cache_name,
                            "batch": batch,
                            "status": f"skipped (budget: needs about {estimate:.0f} s, {max(0.0, left()):.0f} s left)",
                        }
                    )
                    continue
                ids = _prompts(shape, model, tok, batch, args.prompt, args.device)
                alpha, source = _alpha(shape, cache_name, rows, acceptance)
                t0 = time.perf_counter()
                before = fallback_counts()
                try:
                    row = run_row(model, shape, cache_name, batch, ids, args, alpha)
                except Exception as err:  # noqa: BLE001 - one device call makes the table: record, go on
                    row = {"shape": shape, "mode": args.mode, "cache": cache_name, "batch": batch, "status": "error"}
                    row["error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else ''}"
                mark_fallbacks(row, before, fallback_counts())
                row["acceptance_source"] = source
                row["row_wall_s"] = round(time.perf_counter() - t0, 1)
                done[(shape, batch)] = max(done.get((shape, batch), 0.0), row["row_wall_s"])
                done[(shape, cache_name, batch)] = row["row_wall_s"]
                print(row, flush=True)
                rows.append(row)
                write_rows(args.out, rows)  # after every row: a call cut short keeps what it measured
                reset_peak(args.device)
    models.clear()
    print("wrote", write_rows(args.out, rows), f"({time.perf_counter() - start:.0f} s)")
    png = RESULTS / f"{args.out}.png"
    plot(rows, png, environment().get("gpu_name"))
    print("wrote", png)
    print(summary(rows))


def _estimate(done: dict[tuple, float], shape: str, cache: str, batch: int, step_s: float, new_tokens: int) -> float:
    """Seconds a row will take, to skip what does not fit the budget: the same shape and cache at a smaller batch
    (x 2: a batch-8 step costs about twice a batch-1 step on the H200), else the longest row of this shape and batch,
    else from the warm-up's step time (an eager step including the prefill: an upper bound) for the sequential run's
    steps and about twice as many step-equivalents for the speculative runs, with a margin."""
    smaller = [b for (s, c, b) in (k for k in done if len(k) == 3) if s == shape and c == cache and b < batch]
    if smaller:
        return 1.1 * 2 * done[(shape, cache, max(smaller))]
    if (shape, batch) in done:
        return 1.1 * done[(shape, batch)]
    return 1.5 * step_s * 3 * new_tokens * (1 + batch / 8)


def mark_fallbacks(row: dict[str, Any], before: dict[str, int], after: dict[str, int]) -> None:
    """A row during which a `triton_ops` op ran its reference instead of its kernel (`announce_once` calls between
    the two `fallback_counts()` copies) is no measurement of the kernel path: its status becomes `fallback`, and it
    keeps the messages and how often each was announced (the sums and plot leave it out)."""
    new = {msg: n - before.get(msg, 0) for msg, n in after.items() if n > before.get(msg, 0)}
    if new:
        row["fallbacks"] = new
        if row.get("status") == "ok":
            row["status"] = "fallback"


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def plot_blocks(rows: list[dict[str, Any]], path: Path, gpu: str | None = None) -> None:
    """Measured speed-up (solid) and Eq. (8) at the row's measured alpha and c (dashed) against the block size, one
    panel per batch, one line per cache and `--row1-tuning` (`tuning`); of two rows of one line and block size the
    later one. `block_size="auto"` rows (no one block size) are left out."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if r.get("status") == "ok" and r.get("block_rule") != "auto"]
    batches = sorted({r["batch"] for r in ok})
    fig, axes = plt.subplots(1, len(batches), figsize=(5 * len(batches), 4.2), squeeze=False)
    for ax, batch in zip(axes[0], batches):
        series: dict[str, dict[int, dict[str, Any]]] = {}
        for r in ok:
            if r["batch"] == batch:
                series.setdefault(", ".join(t for t in (r["cache"], r.get("tuning")) if t), {})[r["block_size"]] = r
        lines = sorted((name, [by[g] for g in sorted(by)]) for name, by in series.items())
        for i, (name, got) in enumerate(lines):
            gammas = [r["block_size"] for r in got]
            line = ax.plot(gammas, [r["speedup"] for r in got], marker="o", color=f"C{i}", label=name)[0]
            ax.plot(gammas, [r["predicted_speedup_eq8"] for r in got], ls="--", color=line.get_color(), lw=0.8)
        ax.axhline(1.0, color="grey", lw=0.6)
        ax.set_xticks(sorted({r["block_size"] for r in ok}))
        ax.set_xlabel("block size gamma (drafts per verification)")
        ax.set_ylabel("speed-up over sequential decoding")
        ax.set_title(f"batch {batch} (dashed: Eq. (8) at the row's alpha and c)", fontsize=9)
        ax.legend(fontsize=7)
    shapes = ", ".join(sorted({r["shape"] for r in ok}))
    fig.suptitle(f"Self-speculation by block size, {shapes}" + (f", {gpu}" if gpu else ""), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def replot(paths: list[str], out: str) -> None:
    """`--replot`: the rows of committed result files in one plot (`RESULTS/<out>.png`, the files' GPUs in its title:
    `plot_blocks` where they hold several block sizes, else `plot`) and one table, each row labelled with its block
    size where there are several and with its file's `--row1-tuning` overrides."""
    rows: list[dict[str, Any]] = []
    gpus: set[str] = set()
    for path in paths:
        data = json.loads(Path(path).read_text())
        env = data.get("environment", {})
        tuned = ", ".join(f"{k}={v}" for k, v in (env.get("row1_tuning") or {}).items())
        rows += [{**r, "tuning": tuned} for r in data["rows"]]
        gpus.add(env.get("gpu_name") or "")
    # (a `block_size="auto"` row's block size is its largest: it is plotted against Eq. (8) at its best block)
    several = len({r.get("block_size") for r in rows if r.get("status") == "ok" and r.get("block_rule") != "auto"}) > 1
    png, gpu = RESULTS / f"{out}.png", ", ".join(sorted(g for g in gpus if g)) or None
    if several:
        plot_blocks(rows, png, gpu)
    for r in rows:
        fixed = several and r.get("status") == "ok" and r.get("block_rule") != "auto"
        parts = [f"gamma {r['block_size']}" if fixed else "", r.pop("tuning")]
        if any(parts):
            r["label"] = ", ".join(p for p in parts if p)
    if not several:
        plot(rows, png, gpu)
    print("wrote", png)
    print(summary(rows))


def summary(rows: list[dict[str, Any]]) -> str:
    """The README's table (Markdown): per row alpha, the measured cost ratios, Eq. (8) and the measured speed-up
    with its share of Eq. (8); skipped rows with their note."""
    lines = [
        "| model | mode | cache | batch | alpha (rows) | c (draft) | v (verify) | Eq. (8) | Eq. (8), this batch and n | "
        "measured speed-up | seq. tok/s | spec. tok/s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r.get("status") == "probe":
            continue
        if r.get("status") != "ok":
            note = r.get("status")
            if r.get("fallbacks"):
                note = f"fallback: {'; '.join(r['fallbacks'])}"[:160]
            lines.append(f"| {r['shape']} | {r.get('mode', 'eager')} | {r['cache']} | {r['batch']} | {note} | | | | | | | |")
            continue
        rows_alpha = r.get("row_acceptance", [])
        spread = f" ({min(rows_alpha):.2f}-{max(rows_alpha):.2f})" if len(rows_alpha) > 1 else ""
        cache = f"{r['cache']}, {r['label']}" if r.get("label") else r["cache"]
        if r.get("block_rule") == "auto":
            took = ", ".join(f"{g}: {n}" for g, n in r["block_sizes"].items())
            cache += f", auto up to {r['max_block_size']} (blocks {took}; Eq. 8's best {r['gamma_eq8_best']})"
        lines.append(
            f"| {r['shape']} | {r.get('mode', 'eager')} | {cache} | {r['batch']} | {r['acceptance_rate']:.3f}"
            f"{spread} | {r['cost_ratio_draft']:.3f} | {r['cost_ratio_verify']:.2f} | {r['predicted_speedup_eq8']:.2f}x | "
            f"{r['predicted_speedup_eq8_batch']:.2f}x | {r['speedup']:.2f}x ({r['speedup_over_eq8']:.2f} / "
            f"{r['speedup_over_eq8_batch']:.2f}) | {r['sequential_tokens_per_s']:.1f} | {r['speculative_tokens_per_s']:.1f} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
