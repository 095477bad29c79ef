"""Self-speculative decoding for looped models: draft with `d` loops, verify with all `R` in one pass (RIPE Alg. 1).

One step, per row of the batch (gpt-fast's shape, in small named functions):

1. `draft_block`: `gamma` forwards of one token each with `d` loops (Ouro: `num_loops=d`, exit at loop `d`; Huginn:
   `num_steps=d`) from the row's last emitted token; they write planes `< d` (and prelude/coda) of the draft positions.
2. `cache.rollback(n)`: drop the draft's positions from every cell (cells of the planes `>= d` never had them).
3. `verify_block`: one forward of `[last, y_1 .. y_gamma]` with all loops: the target distributions `p_0 .. p_gamma`.
4. `acceptance.greedy_accept` / `speculative_accept`: row `b` accepts `k_b` drafts and emits `k_b + 1` tokens.
5. `commit_block`: keep the block's positions up to `n + 1 + max_b k_b`; row `b`'s rejected positions below that become
   *holes* (`attention_mask` False). Position ids count a row's real tokens (the cumsum of the mask, as for left
   padding), and windowed cells (RIPE, LoopKV) count their read boundary in each row's *effective* positions (holes
   left out, `attention.effective_positions`), so a row's window holds its own last `W` tokens. No row waits or
   re-prefills. The call ends when every row has stopped; a row that stopped earlier stays in the batch (its share
   of each forward is spent, its outputs are dropped), so over a call of `n` tokens per row the batch advances at its
   slowest row's pace: about `n / E[max_b T_b]` tokens per row per verification, `T_b` the verifications row `b` needs
   (`benchmarks/bench_selfspec.py`, `batch_tokens_per_verification`). No per-block rule can shorten that tail (the
   slowest row decides when the call ends; dropping stopped rows would only make the remaining forwards cheaper,
   which at memory-bound batch sizes is little); a server that refills stopped rows gets Eq. (7)'s tau per row.

Host work per block: one host read of device values (the accepted lengths and tokens, one `.tolist()` after the
verification), none in the drafts; the rollbacks and the commit are host bookkeeping plus a few device writes.

Why holes are exact (full cache; RIPE with `W >= gamma`): a hole is a masked key, so it gets zero attention weight, and
every real key keeps its position id and, in effective positions, its distance to every later query. Each real key is
therefore read with the same plane and the same rotary phase as in sequential decoding of that row alone, and the
block pass equals token-by-token decoding (RIPE Proposition 1 needs `W >= gamma`: the block's own earlier tokens lie in
every block query's window). The deepest-plane cache (`W = 0`) breaks the premise (verification then reads plane `r`
of earlier block tokens, which sequential decoding reads at plane `R`): allowed, approximate (RIPE Sec. 4, 5.2).
LoopKV caches run (their pages are coded by storage position, so a page may hold holes, left out of its key scales) and
are approximate too. A static cache gives the tokens of the growable cache with the same plan, batched and captured
(every static cell, LoopKV's coded and shared cells included, counts boundaries in effective positions on the device).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers.generation import GenerationConfig, LogitsProcessorList, StoppingCriteriaList
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria
from transformers.utils import logging

from hf_loopcache._compat import CACHE_KWARG, OUTPUT_CACHE_FIELD
from hf_loopcache.generation.acceptance import greedy_accept, sample_from_uniform, speculative_accept
from hf_loopcache.generation.speedup import AdaptiveBlockSize, _check_max_block_size, layer_cost_ratio

logger = logging.get_logger(__name__)

__all__ = ["DEFAULT_MAX_BLOCK_SIZE", "SpeculativeStats", "self_speculative", "self_speculative_generate"]

DEFAULT_MAX_BLOCK_SIZE = 4
"""The largest block `block_size="auto"` (the default) takes unless `max_block_size` says otherwise: the rollback
reserve the fixed default of 4 had, so a cache's memory is what it was (a batch's rings grow with the reserve). On an
H100 (`benchmarks/results/selfspec_h100_graph_s40_auto_ouro.json`, Ouro-1.4B's shape, every cache, batch 1 and 8)
`auto` up to 4 ran 0.92-0.97 of Eq. (8) at its best block and faster than a fixed 4 in every row."""


@dataclass
class SpeculativeStats:
    """Statistics of a self-speculative run; pass one as `speculative_stats=` and it is filled in place.

    Counts are per row-verification of rows still generating. Phase timing (`draft_time_s`, `verify_time_s`,
    `prefill_time_s`) synchronises the device around each phase, so it is only measured when a stats object with
    `phase_timing=True` (the default) is passed. `decode_time_s` needs no extra sync per block: it runs from the host
    read of the prefill's token (the decoder's first sync: the prefill is done) to the end of the last block (one
    sync after the loop), so `SpeculativeStats(phase_timing=False)` times the decode as it runs without stats, at one
    sync per call more. Without a stats object the decoder reads the device once per verification (the accepted
    lengths and tokens) and once after the prefill.

    Attributes:
        verifications (`int`): verification passes (whole batch).
        draft_forwards (`int`): draft passes (whole batch; `gamma` per verification, fewer near `max_new_tokens`).
        row_verifications (`int`): verifications summed over the rows still generating at each.
        accepted_tokens (`int`): accepted draft tokens over those rows.
        reached (`list[int]`): per draft position `i`, how often it was tested (every earlier draft accepted).
        accepted (`list[int]`): per draft position `i`, how often it was accepted.
        draft_time_s / verify_time_s (`float`): wall time of drafting (incl. the rollback) and verification (incl.
            acceptance and commit); `prefill_time_s` the first pass (0 unless `phase_timing`).
        decode_time_s (`float`): wall time from the prefill's token on the host to the end of decoding.
        row_tokens (`list[int]`): tokens each row generated (the prefill's included).
        row_verifications / row_accepted (`list[int]`): per row, verifications it took part in while generating and
            draft tokens it accepted; `row_reached` draft tokens it tested (`row_accepted / row_reached` is the
            row's acceptance; rows of a batch decode independently, so they accept different lengths).
        block_sizes (`dict[int, int]`): verifications per block size (`block_size="auto"` varies it; the last
            blocks of a call are shortened to the longest row's remaining budget).
        phase_timing (`bool`, defaults to True): time the phases (a sync around each); False times `decode_time_s`
            only.
    """

    phase_timing: bool = True
    verifications: int = 0
    draft_forwards: int = 0
    row_verifications: int = 0
    accepted_tokens: int = 0
    reached: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    draft_time_s: float = 0.0
    verify_time_s: float = 0.0
    prefill_time_s: float = 0.0
    decode_time_s: float = 0.0
    row_tokens: list[int] = field(default_factory=list)
    row_verifications_by_row: list[int] = field(default_factory=list)
    row_accepted: list[int] = field(default_factory=list)
    row_reached: list[int] = field(default_factory=list)
    block_sizes: dict[int, int] = field(default_factory=dict)

    @property
    def row_acceptance(self) -> list[float]:
        """Each row's acceptance `alpha_b` (accepted over tested draft tokens; nan for a row that tested none)."""
        return [a / r if r else float("nan") for a, r in zip(self.row_accepted, self.row_reached)]

    @property
    def tokens_per_verification(self) -> float:
        """Mean tokens a row gets from one verification (`k + 1`), RIPE's tau (Eq. 7)."""
        return (self.accepted_tokens + self.row_verifications) / max(1, self.row_verifications)

    @property
    def acceptance_by_position(self) -> list[float]:
        """Acceptance at each draft position given that all earlier ones were accepted (RIPE Fig. 5a)."""
        return [a / r if r else float("nan") for a, r in zip(self.accepted, self.reached)]

    @property
    def acceptance_rate(self) -> float:
        """Pooled conditional acceptance `alpha` (accepted over tested draft tokens)."""
        return sum(self.accepted) / max(1, sum(self.reached))

    @property
    def draft_cost_ratio(self) -> float:
        """A draft forward's time over a verification's, `(draft_time_s / draft_forwards) / (verify_time_s /
        verifications)` (nan without phase timing, drafts or verifications): the `cost_ratio` that, with
        `acceptance_rate`, `generation.best_block_size` takes (a verification in place of a sequential step)."""
        if not (self.draft_forwards and self.verifications and self.draft_time_s > 0 and self.verify_time_s > 0):
            return float("nan")
        return (self.draft_time_s / self.draft_forwards) / (self.verify_time_s / self.verifications)

    def to_dict(self) -> dict[str, Any]:
        return {
            "verifications": self.verifications,
            "draft_forwards": self.draft_forwards,
            "row_verifications": self.row_verifications,
            "accepted_tokens": self.accepted_tokens,
            "tokens_per_verification": self.tokens_per_verification,
            "acceptance_rate": self.acceptance_rate,
            "acceptance_by_position": self.acceptance_by_position,
            "draft_cost_ratio": self.draft_cost_ratio,
            "reached": list(self.reached),
            "accepted": list(self.accepted),
            "draft_time_s": self.draft_time_s,
            "verify_time_s": self.verify_time_s,
            "prefill_time_s": self.prefill_time_s,
            "decode_time_s": self.decode_time_s,
            "row_tokens": list(self.row_tokens),
            "verifications_by_row": list(self.row_verifications_by_row),
            "row_accepted": list(self.row_accepted),
            "row_reached": list(self.row_reached),
            "row_acceptance": self.row_acceptance,
            "block_sizes": dict(sorted(self.block_sizes.items())),
        }

    def _record(self, accept_length: list[int], gamma: int, active: list[bool]) -> None:
        if len(self.reached) < gamma:
            self.reached += [0] * (gamma - len(self.reached))
            self.accepted += [0] * (gamma - len(self.accepted))
        if len(self.row_accepted) < len(active):
            grow = [0] * (len(active) - len(self.row_accepted))
            self.row_accepted += grow
            self.row_reached += grow
            self.row_verifications_by_row += grow
        self.verifications += 1
        self.draft_forwards += gamma
        self.block_sizes[gamma] = self.block_sizes.get(gamma, 0) + 1
        for b, (k, live) in enumerate(zip(accept_length, active)):
            if not live:
                continue
            self.row_verifications += 1
            self.row_verifications_by_row[b] += 1
            self.accepted_tokens += k
            self.row_accepted[b] += k
            self.row_reached[b] += min(k + 1, gamma)
            for i in range(min(k + 1, gamma)):
                self.reached[i] += 1
            for i in range(k):
                self.accepted[i] += 1


# --------------------------------------------------------------------------------------------- the decoding state
@dataclass
class _Rows:
    """Per-row bookkeeping on the host: generated tokens (incl. the last, not yet cached one) and who is done."""

    prompt: torch.Tensor  # [B, P] the (left-padded) prompt, on the model's device
    generated: list[list[int]]
    finished: list[bool]

    def prefix(self, row: int) -> torch.Tensor:
        """`input_ids` `[1, P + generated]` of one row, as plain `generate` would hold them for it."""
        gen = torch.tensor(self.generated[row], dtype=torch.long, device=self.prompt.device)
        return torch.cat([self.prompt[row], gen])[None]


class _Timer:
    """Accumulates wall time of a phase into a `SpeculativeStats` field, syncing only when stats are requested. A timed
    phase is also a `torch.profiler` range, `self_speculative::<field>` (e.g. `self_speculative::draft_time_s`):
    between its syncs, so a profile can tell the kernels of drafts from those of verifications by their time."""

    def __init__(self, stats: SpeculativeStats | None, name: str, device: torch.device) -> None:
        self.stats, self.name, self.device = stats, name, device
        self.range: Any = None

    def __enter__(self) -> None:
        if self.stats is not None and self.stats.phase_timing:
            _sync(self.device)
            self.range = torch.profiler.record_function(f"self_speculative::{self.name}")
            self.range.__enter__()
            self.t0 = time.perf_counter()

    def __exit__(self, *exc: Any) -> None:
        if self.stats is not None and self.stats.phase_timing:
            _sync(self.device)
            setattr(self.stats, self.name, getattr(self.stats, self.name) + time.perf_counter() - self.t0)
            self.range.__exit__(*exc)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _process(
    logits_processor: LogitsProcessorList, rows: _Rows, scores: torch.Tensor, extra: torch.Tensor | None
) -> torch.Tensor:
    """Logits processors and warpers on `scores` `[B, V]`, each row with the `input_ids` plain `generate` would pass:
    its prompt, its generated tokens and `extra` `[B, i]` (draft tokens before this position).

    Processors see the whole batch in every call (some keep per-row state, e.g. a repetition penalty's prompt
    lengths). When rows have generated different numbers of tokens, the batch is processed once per length, each
    time keeping the rows of that length (the other rows get their sequence cut or left-filled to it, and their
    outputs are discarded); at batch 1, or when all rows are level, that is one call."""
    if not logits_processor:
        return scores
    lengths = [len(gen) for gen in rows.generated]
    extra_len = extra.shape[1] if extra is not None else 0
    out: torch.Tensor | None = None
    for length in sorted(set(lengths)):
        seqs = []
        for b, gen in enumerate(rows.generated):
            seq = torch.cat(
                [rows.prompt[b], torch.tensor(gen, dtype=torch.long, device=scores.device)]
                + ([extra[b]] if extra_len else [])
            )
            want = rows.prompt.shape[1] + length + extra_len
            seq = seq[-want:] if seq.shape[0] >= want else torch.cat([seq.new_zeros(want - seq.shape[0]), seq])
            seqs.append(seq)
        processed = logits_processor(torch.stack(seqs), scores.clone())
        if len(set(lengths)) == 1:
            return processed
        if out is None:
            out = torch.empty_like(scores)
        members = torch.tensor([b for b, n in enumerate(lengths) if n == length], device=scores.device)
        out[members] = processed[members]
    return out  # type: ignore[return-value]


def _choose(scores: torch.Tensor, do_sample: bool, generator: torch.Generator | None) -> tuple[torch.Tensor, Any]:
    """Token per row from processed scores `[B, V]`: argmax, or a draw from the softmax (returns the probs too)."""
    if not do_sample:
        return scores.argmax(dim=-1), None
    probs = torch.softmax(scores, dim=-1)
    uniform = torch.rand(scores.shape[0], device=scores.device, generator=generator)
    return sample_from_uniform(probs, uniform), probs


@dataclass
class _Step:
    """Inputs every forward of the decoder shares.

    `call` runs a forward: the model, or for a static cache its captured-step runner (`model.get_compiled_call`: on
    CUDA every draft and verification after the prefill replays a CUDA graph per batch, depth and block length). A
    static cache keeps key validity on the device, so its forwards after the prefill pass no mask (every new token is
    real) and a verification's rejected positions become holes by `LoopCache.write_key_valid`."""

    model: Any
    cache: Any
    forward_kwargs: dict[str, Any]  # the caller's model kwargs (e.g. Huginn's `init_scale`), verify depth included
    draft_kwargs: dict[str, Any]  # the same with the draft depth
    logits_processor: LogitsProcessorList
    do_sample: bool
    generator: torch.Generator | None
    call: Any = None  # defaults to the model

    @property
    def static(self) -> bool:
        return bool(getattr(self.cache, "static", False))

    def forward(self, tokens: torch.Tensor, mask: torch.Tensor, *, draft: bool, keep: int) -> torch.Tensor:
        kwargs = self.draft_kwargs if draft else self.forward_kwargs
        out = (self.call or self.model)(
            input_ids=tokens,
            attention_mask=mask,
            use_cache=True,
            logits_to_keep=keep,
            **{CACHE_KWARG: self.cache},
            **kwargs,
        )
        return out.logits.float().to(tokens.device)  # the head may sit on another device than the inputs (device_map)

    def grow(self, mask: torch.Tensor, q: int) -> tuple[torch.Tensor, Any]:
        """The decoder's mask after `q` new real tokens, and the mask the forward of those tokens gets (a static
        cache: None, its key validity lives on the device)."""
        if self.static:
            return mask, None
        grown = torch.cat([mask, mask.new_ones(mask.shape[0], q)], dim=1)
        return grown, grown


def draft_block(
    step: _Step, rows: _Rows, last: torch.Tensor, mask: torch.Tensor, gamma: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`gamma` one-token forwards with the draft depth from `last` `[B]`: draft tokens `[B, gamma]` (and, when
    sampling, their distributions `[B, gamma, V]`). Writes the draft positions into planes `< d`; the caller rolls
    them back."""
    tokens = last[:, None]
    drafts: list[torch.Tensor] = []
    probs: list[torch.Tensor] = []
    for _ in range(gamma):
        mask, forward_mask = step.grow(mask, 1)
        logits = step.forward(tokens, forward_mask, draft=True, keep=1)[:, -1]
        extra = torch.stack(drafts, dim=1) if drafts else None
        token, p = _choose(_process(step.logits_processor, rows, logits, extra), step.do_sample, step.generator)
        drafts.append(token)
        if p is not None:
            probs.append(p)
        tokens = token[:, None]
    draft_tokens = torch.stack(drafts, dim=1) if drafts else last.new_zeros(last.shape[0], 0)
    return draft_tokens, (torch.stack(probs, dim=1) if probs else None)


def verify_block(step: _Step, rows: _Rows, last: torch.Tensor, draft_tokens: torch.Tensor, mask: torch.Tensor):
    """One full-depth forward of `[last, y_1 .. y_gamma]`: processed target scores `[B, gamma + 1, V]`."""
    block = torch.cat([last[:, None], draft_tokens], dim=1)
    q = block.shape[1]
    logits = step.forward(block, step.grow(mask, q)[1], draft=False, keep=q)
    if not step.logits_processor:
        return logits
    return torch.stack(
        [_process(step.logits_processor, rows, logits[:, i], draft_tokens[:, :i]) for i in range(q)], dim=1
    )


def accept_block(
    step: _Step,
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_scores: torch.Tensor,
    forced_acceptance: float | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`accept_length` `[B]` and the emitted token after it `[B]`, by the greedy or the sampling rule (or, for speed
    measurements on random weights only, by coin flips of probability `forced_acceptance`)."""
    b, gamma = draft_tokens.shape
    if forced_acceptance is not None:
        coins = torch.rand(b, gamma, device=draft_tokens.device, generator=step.generator) < forced_acceptance
        accept_length = coins.long().cumprod(dim=-1).sum(dim=-1)
        next_token = target_scores.argmax(-1).gather(1, accept_length[:, None]).squeeze(1)
        return accept_length, next_token
    if not step.do_sample:
        return greedy_accept(draft_tokens, target_scores.argmax(dim=-1))
    uniforms = torch.rand(b, gamma + 1, device=draft_tokens.device, generator=step.generator)
    target_probs = torch.softmax(target_scores, dim=-1)
    if draft_probs is None:  # gamma = 0: nothing drafted, the emitted token is drawn from p_0
        draft_probs = target_probs[:, :0]
    return speculative_accept(draft_probs, target_probs, draft_tokens, uniforms)


def commit_block(
    cache: Any, mask: torch.Tensor, start: int, accept_length: torch.Tensor, max_accept: int, block: int | None = None
):
    """Keep the verified block's positions `[start, start + 1 + max_accept)`; for row `b` the ones beyond its
    `1 + k_b` become holes. Returns the new `attention_mask` `[B, start + 1 + max_accept]` (a static cache: the
    holes are written into its device-side key validity, and `mask` is returned as it is). `block`: positions the
    verification wrote (`gamma + 1`); when the longest row accepted every draft there is nothing to cut and the
    cache is left as it is (every cell already holds `start + block`; a static cache's device lengths too)."""
    if block is None or 1 + max_accept < block:
        cache.rollback(start + 1 + max_accept)
    kept = torch.arange(1 + max_accept, device=accept_length.device)[None] <= accept_length[:, None]
    if getattr(cache, "static", False):
        cache.write_key_valid(start, kept)
        return mask
    return torch.cat([mask, kept.to(mask.device, mask.dtype)], dim=1)


# --------------------------------------------------------------------------------------------- the decoder
def _stop_rules(stopping_criteria: StoppingCriteriaList) -> tuple[int | None, set[int], list[Any]]:
    """Split the criteria into the ones the decoder applies natively (max length, EOS) and the rest (called per row)."""
    max_length, eos, other = None, set(), []
    for criterion in stopping_criteria:
        if isinstance(criterion, MaxLengthCriteria):
            max_length = criterion.max_length if max_length is None else min(max_length, criterion.max_length)
        elif isinstance(criterion, EosTokenCriteria):
            eos |= {int(t) for t in torch.as_tensor(criterion.eos_token_id).flatten().tolist()}
        else:
            other.append(criterion)
    return max_length, eos, other


def _emit(rows: _Rows, emitted: list[list[int]], rules: tuple[int | None, set[int], list[Any]], streamer: Any) -> None:
    """Append each row's emitted tokens one at a time, stopping a row exactly where plain `generate` would."""
    max_length, eos, other = rules
    prompt_len = rows.prompt.shape[1]
    for b, tokens in enumerate(emitted):
        if rows.finished[b]:
            continue
        for token in tokens:
            rows.generated[b].append(token)
            if streamer is not None:
                streamer.put(torch.tensor([token]))
            done = token in eos or (max_length is not None and prompt_len + len(rows.generated[b]) >= max_length)
            if not done and other:
                ids = rows.prefix(b)
                done = any(bool(torch.as_tensor(c(ids, None)).any()) for c in other)
            if done:
                rows.finished[b] = True
                break


@torch.no_grad()  # as `generate`: the plain function too (autograd would record every op of every forward)
def _speculative_decode(
    model: Any,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    cache: Any,
    *,
    draft_loops: int,
    block_size: int,
    logits_processor: LogitsProcessorList,
    stopping_criteria: StoppingCriteriaList,
    do_sample: bool,
    pad_token_id: int | None,
    forward_kwargs: dict[str, Any],
    block_rule: AdaptiveBlockSize | None = None,
    streamer: Any = None,
    speculative_stats: SpeculativeStats | None = None,
    forced_acceptance: float | None = None,
    generator: torch.Generator | None = None,
    disable_compile: bool = False,
) -> torch.Tensor:
    """The decoding loop both entry points share. Returns the sequences `[B, P + max generated]` (pad after a row's
    end, as plain `generate`). `block_size` is every block's size, or with `block_rule` the largest one (the rule
    picks each block's)."""
    device = input_ids.device
    b = input_ids.shape[0]
    mask = attention_mask.bool() if attention_mask is not None else torch.ones_like(input_ids, dtype=torch.bool)
    draft_kwargs = {**forward_kwargs, **model.draft_kwargs(draft_loops)}
    call = model.get_compiled_call(None) if _captures_speculation(cache) and not disable_compile else model
    step = _Step(model, cache, forward_kwargs, draft_kwargs, logits_processor, do_sample, generator, call)
    rows = _Rows(prompt=input_ids, generated=[[] for _ in range(b)], finished=[False] * b)
    rules = _stop_rules(stopping_criteria)
    max_length = rules[0]
    cache.set_max_rollback(max(cache.max_rollback, block_size))

    with _Timer(speculative_stats, "prefill_time_s", device):
        logits = step.forward(input_ids, mask, draft=False, keep=1)[:, -1]
        last, _ = _choose(_process(logits_processor, rows, logits, None), do_sample, generator)
    _emit(rows, [[t] for t in last.tolist()], rules, streamer)  # a host read: the prefill has run
    decode_start = time.perf_counter()

    # the prefill reads as `generate` does; the forwards after it as a self-speculative decode's
    # (`LoopCache.speculating`: LoopKV's verification blocks at both planes unless `VPrecision.blocks` says otherwise)
    budget = None if max_length is None else max_length - input_ids.shape[1]  # new tokens a row may take
    with cache.speculating():
        while not all(rows.finished):
            start = cache.get_seq_length()
            gamma = block_size if block_rule is None else block_rule.block_size()
            if max_length is not None:  # a block never needs to reach beyond the longest row's remaining budget
                room = max(budget - len(g) for g, f in zip(rows.generated, rows.finished) if not f)
                gamma = max(0, min(gamma, room - 1))
            with _Timer(speculative_stats, "draft_time_s", device):
                draft_tokens, draft_probs = draft_block(step, rows, last, mask, gamma)
                if gamma:
                    cache.rollback(start)
            with _Timer(speculative_stats, "verify_time_s", device):
                target_scores = verify_block(step, rows, last, draft_tokens, mask)
                accept_length, next_token = accept_block(
                    step, draft_tokens, draft_probs, target_scores, forced_acceptance
                )
                host = torch.cat([accept_length[:, None], draft_tokens, next_token[:, None]], dim=1).tolist()  # a sync
                accepted = [r[0] for r in host]
                max_accept = max(k for k, f in zip(accepted, rows.finished) if not f)
                if any(rows.finished):  # finished rows keep no more than the others
                    accept_length = accept_length.clamp(max=max_accept)
                mask = commit_block(cache, mask, start, accept_length, max_accept, block=gamma + 1)
                last = next_token
            active = [not f for f in rows.finished]
            if block_rule is not None:
                block_rule.update(accepted, gamma, active)
            if speculative_stats is not None:
                speculative_stats._record(accepted, gamma, active)
            emitted = [r[1 : 1 + r[0]] + [r[-1]] for r in host]
            _emit(rows, emitted, rules, streamer)

    if speculative_stats is not None:
        _sync(device)  # the last commit's writes
        speculative_stats.decode_time_s += time.perf_counter() - decode_start
        speculative_stats.row_tokens = [len(g) for g in rows.generated]
    if streamer is not None:
        streamer.end()
    longest = max(len(g) for g in rows.generated)
    if any(len(g) < longest for g in rows.generated) and pad_token_id is None:
        raise ValueError("rows stopped at different lengths and no `pad_token_id` is set to fill the shorter ones")
    fill = pad_token_id if pad_token_id is not None else 0
    out = torch.tensor([g + [fill] * (longest - len(g)) for g in rows.generated], dtype=torch.long, device=device)
    return torch.cat([input_ids, out], dim=1)


def _captures_speculation(cache: Any) -> bool:
    """Whether drafts and verifications over `cache` replay captured steps: a static cache (every plan: its cells
    read and write by device-side positions, lengths and key validity, holes included)."""
    return bool(getattr(cache, "static", False))


# --------------------------------------------------------------------------------------------- validation
def _check_args(
    model: Any,
    cache: Any,
    draft_loops: Any,
    block_size: Any,
    forced_acceptance: Any,
    verify_loops: int,
    max_block_size: Any = None,
    draft_cost_ratio: Any = None,
) -> tuple[int, AdaptiveBlockSize | None]:
    """Refuse what the decoder cannot take; return `(largest block, rule)`: `block_size` and no rule for an int, and
    for `"auto"` `max_block_size` (default `DEFAULT_MAX_BLOCK_SIZE`) and the `AdaptiveBlockSize` at
    `draft_cost_ratio` (default: `layer_cost_ratio` of the model's layout)."""
    if not hasattr(model, "draft_kwargs") or not hasattr(model, "loop_layout"):
        raise TypeError(
            f"self-speculative decoding needs a native looped model (hf_loopcache OuroForCausalLM or "
            f"HuginnForCausalLM), got {type(model).__name__}"
        )
    if not getattr(cache, "is_loop_cache", False):
        raise TypeError(
            f"self-speculative decoding needs a LoopCache (FullLoopCache, RIPECache, DeepestPlaneCache, "
            f"LoopKVCache), got {type(cache).__name__}"
        )
    if isinstance(draft_loops, bool) or not isinstance(draft_loops, int) or not 1 <= draft_loops < verify_loops:
        raise ValueError(
            f"`draft_loops` must be an int in [1, {verify_loops - 1}] (fewer than the {verify_loops} verify loops), "
            f"got {draft_loops!r}"
        )
    if block_size == "auto":
        if max_block_size is None:
            max_block_size = DEFAULT_MAX_BLOCK_SIZE
        _check_max_block_size(max_block_size, " (the largest block `block_size='auto'` takes)")
        if draft_cost_ratio is not None and (
            isinstance(draft_cost_ratio, bool)
            or not isinstance(draft_cost_ratio, (int, float))
            or draft_cost_ratio <= 0
        ):
            raise ValueError(f"`draft_cost_ratio` must be None or a positive number, got {draft_cost_ratio!r}")
    elif isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 0:
        raise ValueError(
            f"`block_size` must be a non-negative int (draft tokens per verification; 0 decodes sequentially) or "
            f"'auto', got {block_size!r}"
        )
    else:
        for name, value in (("max_block_size", max_block_size), ("draft_cost_ratio", draft_cost_ratio)):
            if value is not None:
                raise ValueError(
                    f"`{name}` is for `block_size='auto'` (the default), got it with block_size={block_size!r}; "
                    f"leave `{name}` out or pass block_size='auto'"
                )
    if forced_acceptance is not None and not (
        isinstance(forced_acceptance, (int, float)) and 0.0 <= forced_acceptance <= 1.0
    ):
        raise ValueError(f"`forced_acceptance` must be None or a float in [0, 1], got {forced_acceptance!r}")
    if cache.layout.num_loops < verify_loops:
        raise ValueError(
            f"the cache holds {cache.layout.num_loops} loops but verification runs {verify_loops}; build the cache "
            f"with `num_loops={verify_loops}`"
        )
    largest = max_block_size if block_size == "auto" else block_size  # what the window must cover
    window = cache.plan.window if any(o != "bf16" for o in cache.plan.options.values()) else None
    if window is not None and window < largest:
        logger.warning_once(
            f"self-speculative decoding over a windowed cache with window {window} < the largest block {largest} is "
            f"approximate: verifying a block reads planes that sequential decoding would not (RIPE Proposition 1 "
            f"needs window >= block_size; the deepest-plane cache has window 0)."
        )
    if block_size != "auto":
        return block_size, None
    if draft_cost_ratio is None:
        draft_cost_ratio = layer_cost_ratio(model.loop_layout, draft_loops, verify_loops)
    return max_block_size, AdaptiveBlockSize(draft_cost_ratio, max_block_size)


def _verify_loops(model: Any, forward_kwargs: dict[str, Any]) -> int:
    loops = forward_kwargs.get(model.loop_kwarg)
    return int(loops) if isinstance(loops, int) else model.loop_layout.num_loops


_UNSUPPORTED = {
    "num_beams": (1, "beam search"),
    "num_beam_groups": (1, "group beam search"),
    "penalty_alpha": (None, "contrastive search"),
    "dola_layers": (None, "DoLa decoding"),
    "prompt_lookup_num_tokens": (None, "prompt lookup decoding"),
    "output_scores": (False, "returning scores"),
    "output_logits": (False, "returning logits"),
    "output_attentions": (False, "returning attentions"),
    "output_hidden_states": (False, "returning hidden states"),
}


def _check_generation_config(generation_config: GenerationConfig) -> None:
    for name, (allowed, mode) in _UNSUPPORTED.items():
        value = getattr(generation_config, name, allowed)
        if value is not None and value != allowed and not (allowed is None and value is False):
            raise ValueError(
                f"self-speculative decoding supports greedy decoding and sampling only; {mode} "
                f"(`{name}={value!r}`) is not supported (allowed: {allowed!r})"
            )


# --------------------------------------------------------------------------------------------- entry points
def self_speculative(
    model: Any,
    input_ids: torch.LongTensor,
    logits_processor: LogitsProcessorList,
    stopping_criteria: StoppingCriteriaList,
    generation_config: GenerationConfig,
    synced_gpus: bool = False,
    streamer: Any = None,
    draft_loops: int | None = None,
    block_size: int | str = "auto",
    max_block_size: int | None = None,
    draft_cost_ratio: float | None = None,
    speculative_stats: SpeculativeStats | None = None,
    forced_acceptance: float | None = None,
    tokenizer: Any = None,
    **model_kwargs: Any,
) -> Any:
    """Self-speculative decoding as a `generate` strategy:
    `model.generate(..., custom_generate=hf_loopcache.self_speculative, draft_loops=d, block_size=gamma)`.

    `generate` prepares the inputs, the cache (a `FullLoopCache` unless one is passed), the logits processors and
    warpers (applied to draft and target alike) and the stopping criteria, then calls this function. Greedy output
    equals plain greedy `generate` with the same cache where the math says so (full cache; RIPE with
    `window >= block_size`); sampling draws every token from the same distribution as plain sampling.

    Args:
        draft_loops (`int`): `d`, loops (Ouro) or recurrent steps (Huginn) of a draft, `1 <= d < R`.
        block_size (`int` or `"auto"`, *optional*, defaults to `"auto"`): `gamma`, draft tokens per verification
            (0: sequential); `"auto"`: before each verification the size RIPE Eq. (8) favours at the acceptance seen
            so far (`generation.AdaptiveBlockSize`), at most `max_block_size`.
        max_block_size (`int`, *optional*, defaults to 4): with `block_size="auto"`, the largest block (the cache's
            rollback reserve, and with RIPE the window exactness needs, follow it: a batch's rings grow with it;
            Huginn-0125 gains up to 8 and beyond at batch 1). Refused with an int `block_size`.
        draft_cost_ratio (`float`, *optional*): with `block_size="auto"`, `c`, a draft forward's cost over a
            full-depth step's (default: `generation.layer_cost_ratio`, layer passes; a measured
            `SpeculativeStats.draft_cost_ratio` of an earlier run is closer on a given machine).
        speculative_stats (`SpeculativeStats`, *optional*): filled with acceptance and timing statistics.
        forced_acceptance (`float`, *optional*): benchmarks on random weights only: accept each draft token with this
            probability regardless of the tokens (the output is then meaningless; the cost is real).
        tokenizer: taken by `generate` for `stop_strings` (listed here so that `generate` hands it over).
        model_kwargs: passed to every forward (e.g. Huginn's `init_scale=0` for a deterministic state; use the same
            in the sequential run you compare with). `num_loops` / `num_steps` set the verification depth `R`.

    Returns:
        `torch.LongTensor` `[B, prompt + generated]`, or with `return_dict_in_generate=True` a
        `GenerateDecoderOnlyOutput` holding `sequences` and the cache.
    """
    from transformers.generation.utils import GenerateDecoderOnlyOutput

    if draft_loops is None:
        raise ValueError("self-speculative decoding needs `draft_loops` (loops of a draft, fewer than the model's)")
    if synced_gpus:
        raise ValueError("self-speculative decoding does not support `synced_gpus=True`")
    _check_generation_config(generation_config)
    if streamer is not None and input_ids.shape[0] != 1:
        raise ValueError(f"a streamer is supported at batch size 1 only, got batch size {input_ids.shape[0]}")
    cache = model_kwargs.pop(CACHE_KWARG, None)
    if cache is None:
        cache = model_kwargs.pop("past_key_values", None)
    attention_mask = model_kwargs.pop("attention_mask", None)
    for name in ("position_ids", "use_cache", "logits_to_keep", "cache_position", "return_dict"):
        model_kwargs.pop(name, None)
    verify_loops = _verify_loops(model, model_kwargs)
    block_size, block_rule = _check_args(
        model, cache, draft_loops, block_size, forced_acceptance, verify_loops, max_block_size, draft_cost_ratio
    )
    pad = generation_config._pad_token_tensor
    sequences = _speculative_decode(
        model,
        input_ids,
        attention_mask,
        cache,
        draft_loops=draft_loops,
        block_size=block_size,
        logits_processor=logits_processor,
        stopping_criteria=stopping_criteria,
        do_sample=bool(generation_config.do_sample),
        pad_token_id=int(pad) if pad is not None else None,
        forward_kwargs=model_kwargs,
        block_rule=block_rule,
        streamer=streamer,
        speculative_stats=speculative_stats,
        forced_acceptance=forced_acceptance,
        disable_compile=bool(getattr(generation_config, "disable_compile", False)),
    )
    if generation_config.return_dict_in_generate:
        return GenerateDecoderOnlyOutput(sequences=sequences, **{OUTPUT_CACHE_FIELD: cache})
    return sequences


def self_speculative_generate(
    model: Any,
    input_ids: torch.Tensor,
    *,
    draft_loops: int,
    block_size: int | str = "auto",
    max_block_size: int | None = None,
    draft_cost_ratio: float | None = None,
    max_new_tokens: int = 32,
    attention_mask: torch.Tensor | None = None,
    cache: Any = None,
    do_sample: bool = False,
    eos_token_id: int | list[int] | None = None,
    pad_token_id: int | None = None,
    logits_processor: LogitsProcessorList | None = None,
    stopping_criteria: StoppingCriteriaList | None = None,
    streamer: Any = None,
    speculative_stats: SpeculativeStats | None = None,
    forced_acceptance: float | None = None,
    generator: torch.Generator | None = None,
    disable_compile: bool = False,
    **model_kwargs: Any,
) -> torch.Tensor:
    """Self-speculative decoding as a plain function (no `generate` preparation around it).

    Args:
        model: a native looped model (`OuroForCausalLM`, `HuginnForCausalLM`).
        input_ids (`torch.LongTensor` of shape `[B, P]`): the prompts, left-padded.
        draft_loops (`int`): `d`, loops of a draft. block_size (`int` or `"auto"`): `gamma` (0: sequential decoding
            through the same loop, the fair baseline for speed-ups); `max_block_size`, `draft_cost_ratio`: see
            `self_speculative`.
        max_new_tokens (`int`): tokens to generate per row at most.
        attention_mask (`torch.Tensor` of shape `[B, P]`, *optional*): 1 for real tokens.
        cache (`LoopCache`, *optional*): defaults to a `FullLoopCache` of the model.
        do_sample (`bool`): sample (from the processed logits) instead of greedy.
        eos_token_id / pad_token_id: a row stops at EOS; shorter rows are filled with `pad_token_id` (defaults: the
            model's `generation_config`, as `generate`; pad falls back to EOS).
        logits_processor / stopping_criteria: extra processors (applied to draft and target) and criteria.
        streamer, speculative_stats, forced_acceptance: see `self_speculative`.
        generator (`torch.Generator`, *optional*): the random source of sampling and forced acceptance.
        disable_compile (`bool`, *optional*, defaults to False): with a static cache on CUDA, run every forward
            eagerly instead of replaying captured drafts and verifications (as `generate(..., disable_compile=True)`).
        model_kwargs: passed to every forward (e.g. `init_scale=0` for Huginn).

    Returns:
        `torch.LongTensor` `[B, P + generated]`.
    """
    from hf_loopcache.cache import FullLoopCache

    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"`max_new_tokens` must be a positive int, got {max_new_tokens!r}")
    if cache is None:
        cache = FullLoopCache(model, num_loops=_verify_loops(model, model_kwargs))
    if streamer is not None and input_ids.shape[0] != 1:
        raise ValueError(f"a streamer is supported at batch size 1 only, got batch size {input_ids.shape[0]}")
    verify_loops = _verify_loops(model, model_kwargs)
    block_size, block_rule = _check_args(
        model, cache, draft_loops, block_size, forced_acceptance, verify_loops, max_block_size, draft_cost_ratio
    )
    # as `generate` does: empty cells allocate `max_new_tokens` positions past the prompt at their first write, so
    # that at batch 1 no cell regrows (copying its history) mid-decoding (the decoder shortens the last blocks; in a
    # batch, holes can take the cache past that, and it grows as usual)
    cache.reserve(input_ids.shape[1] + max_new_tokens)
    if eos_token_id is None:
        eos_token_id = model.generation_config.eos_token_id
    if pad_token_id is None:
        pad_token_id = model.generation_config.pad_token_id
    criteria = StoppingCriteriaList([MaxLengthCriteria(input_ids.shape[1] + max_new_tokens)])
    if eos_token_id is not None:
        criteria.append(EosTokenCriteria(eos_token_id))
        if pad_token_id is None:
            pad_token_id = eos_token_id if isinstance(eos_token_id, int) else eos_token_id[0]
    criteria.extend(stopping_criteria or [])
    if streamer is not None:
        streamer.put(input_ids.cpu())
    return _speculative_decode(
        model,
        input_ids,
        attention_mask,
        cache,
        draft_loops=draft_loops,
        block_size=block_size,
        logits_processor=logits_processor or LogitsProcessorList(),
        stopping_criteria=criteria,
        do_sample=do_sample,
        pad_token_id=pad_token_id,
        forward_kwargs=model_kwargs,
        block_rule=block_rule,
        streamer=streamer,
        speculative_stats=speculative_stats,
        forced_acceptance=forced_acceptance,
        generator=generator,
        disable_compile=disable_compile,
    )
