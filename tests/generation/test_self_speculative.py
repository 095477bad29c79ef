"""Self-speculative decoding end to end: greedy output equals plain greedy `generate` with the same cache where the
math says so (full cache; RIPE with W >= gamma), per row of a left-padded batch whose rows accept different lengths;
`generate` semantics (EOS, max_new_tokens, processors, streamers) and refusals; sampling's distribution."""

from __future__ import annotations

import math

import pytest
import torch
from transformers.generation import LogitsProcessorList, TemperatureLogitsWarper

from hf_loopcache import (
    DeepestPlaneCache,
    FullLoopCache,
    LoopKVCache,
    RIPECache,
    SpeculativeStats,
    self_speculative,
    self_speculative_generate,
)
from hf_loopcache.cache import loopkv_preset
from hf_loopcache.generation import DEFAULT_MAX_BLOCK_SIZE
from tests.helpers import call_kwargs, make_model

_CACHES = {
    "full": lambda m, g: FullLoopCache(m),
    "ripe-W=gamma": lambda m, g: RIPECache(m, window=g),
    "ripe-W=gamma+3": lambda m, g: RIPECache(m, window=g + 3),
}


def _batch(left_pad: bool):
    if not left_pad:
        return torch.tensor([[5, 9, 17, 33, 12, 8, 40, 7]]), None
    ids = torch.tensor([[5, 9, 17, 33, 12, 8, 40, 7], [0, 0, 0, 21, 3, 44, 6, 50], [0, 11, 29, 4, 60, 13, 8, 31]])
    return ids, (ids != 0).long()


def _draft(model) -> int:
    """Draft depth R - 1: random tiny models accept 20-40% of such drafts (fewer loops: almost none)."""
    return model.loop_layout.num_loops - 1


def _greedy_pair(model, arch, cache_name, gamma, draft, ids, mask, new_tokens, **extra):
    kw = dict(max_new_tokens=new_tokens, do_sample=False, pad_token_id=0, **call_kwargs(arch), **extra)
    if mask is not None:
        kw["attention_mask"] = mask
    ref = model.generate(ids, past_key_values=_CACHES[cache_name](model, gamma), **kw)
    stats = SpeculativeStats()
    out = model.generate(
        ids,
        past_key_values=_CACHES[cache_name](model, gamma),
        custom_generate=self_speculative,
        draft_loops=draft,
        block_size=gamma,
        speculative_stats=stats,
        **kw,
    )
    return ref, out, stats


@torch.no_grad()
@pytest.mark.parametrize("cache_name", list(_CACHES))
@pytest.mark.parametrize("left_pad", [False, True], ids=["B1", "B3-left-padded"])
def test_greedy_equals_sequential_generate_fp64(arch, cache_name, left_pad):
    """fp64 random tiny models (drafts disagree often, so rows of a batch accept different lengths and leave holes)."""
    model = make_model(arch).double()
    ids, mask = _batch(left_pad)
    ref, out, stats = _greedy_pair(model, arch, cache_name, 3, _draft(model), ids, mask, 20)
    assert torch.equal(out, ref)
    assert stats.verifications > 0 and 0 < stats.acceptance_rate < 1  # both outcomes happened


@torch.no_grad()
@pytest.mark.parametrize(
    "fixture, cache_name, batch",
    [("tiny-ouro", "full", 2), ("tiny-ouro", "ripe-W=gamma", 1), ("tiny-huginn", "ripe-W=gamma", 2)],
    ids=["ouro-full-B2-left-padded", "ouro-ripe-B1", "huginn-ripe-B2-left-padded"],
)
def test_greedy_equals_sequential_generate_on_trained_fixtures_fp32(fixture, cache_name, batch):
    from hf_loopcache import load_fixture

    model, tok = load_fixture(fixture)
    model = model.float()
    arch = "ouro" if "ouro" in fixture else "huginn"
    tok.padding_side = "left"
    enc = tok(["The capital of the old kingdom was", "Once upon a time"][:batch], return_tensors="pt", padding=True)
    draft = model.loop_layout.num_loops // 2
    ref, out, stats = _greedy_pair(model, arch, cache_name, 4, draft, enc["input_ids"], enc["attention_mask"], 12)
    assert torch.equal(out, ref)
    assert stats.tokens_per_verification > 1.5  # a trained model's drafts agree


@torch.no_grad()
def test_holes_count_in_effective_positions_for_ripe(arch):
    """Rows accept different lengths, so later blocks read windows across holes: with W = gamma the window must count
    a row's own positions. Decoding the rows one by one (no holes) gives the same tokens as the batch."""
    model = make_model(arch, seed=1).double()
    ids, mask = _batch(True)
    kw = dict(
        max_new_tokens=24, pad_token_id=0, custom_generate=self_speculative, draft_loops=_draft(model), block_size=3
    )
    batch = model.generate(
        ids, attention_mask=mask, past_key_values=RIPECache(model, window=3), **kw, **call_kwargs(arch)
    )
    for b in range(ids.shape[0]):
        row = ids[b : b + 1, int((mask[b] == 0).sum()) :]
        alone = model.generate(row, past_key_values=RIPECache(model, window=3), **kw, **call_kwargs(arch))
        new = alone[0, row.shape[1] :]
        assert torch.equal(new, batch[b, ids.shape[1] : ids.shape[1] + new.shape[0]])


@torch.no_grad()
def test_eos_and_max_new_tokens_inside_a_block(arch):
    model = make_model(arch).double()
    ids, mask = _batch(True)
    ref, _, _ = _greedy_pair(model, arch, "full", 4, _draft(model), ids, mask, 12)
    eos = int(ref[1, ids.shape[1] + 5])  # row 1's sixth token: EOS lands inside a block for that row
    for new_tokens in (12, 7):  # 7 = prompt budget ends inside the second block
        ref, out, _ = _greedy_pair(model, arch, "full", 4, _draft(model), ids, mask, new_tokens, eos_token_id=eos)
        assert torch.equal(out, ref)
        assert (ref[1, ids.shape[1] :] == eos).any()


@torch.no_grad()
def test_logits_processors_apply_to_draft_and_target():
    model = make_model("ouro").double()
    ids, mask = _batch(True)
    extra = dict(repetition_penalty=1.5, no_repeat_ngram_size=2, min_new_tokens=6, eos_token_id=int(ids[0, 3]))
    ref, out, stats = _greedy_pair(model, "ouro", "ripe-W=gamma", 3, _draft(model), ids, mask, 14, **extra)
    assert torch.equal(out, ref)


@torch.no_grad()
def test_stop_string_inside_a_block():
    from hf_loopcache import load_fixture

    model, tok = load_fixture("tiny-ouro")
    model = model.float()
    enc = tok(["Once upon a time"], return_tensors="pt")
    plain = model.generate(**enc, max_new_tokens=10, do_sample=False)
    stop = tok.decode(plain[0, enc["input_ids"].shape[1] + 4])  # the text of the fifth token ends a block's middle
    assert stop.strip()
    kw = dict(max_new_tokens=10, do_sample=False, stop_strings=[stop], tokenizer=tok)
    ref = model.generate(**enc, **kw)
    out = model.generate(**enc, custom_generate=self_speculative, draft_loops=2, block_size=4, **kw)
    assert torch.equal(out, ref) and ref.shape[1] < plain.shape[1]


class _Collect:
    def __init__(self):
        self.chunks = []

    def put(self, value):
        self.chunks.append(value.tolist())

    def end(self):
        self.chunks.append("end")


@torch.no_grad()
def test_streamer_sees_what_plain_generate_streams(arch):
    model = make_model(arch).double()
    ids = torch.tensor([[5, 9, 17, 33]])
    a, b = _Collect(), _Collect()
    kw = dict(max_new_tokens=9, do_sample=False, pad_token_id=0, **call_kwargs(arch))
    model.generate(ids, streamer=a, **kw)
    model.generate(ids, streamer=b, custom_generate=self_speculative, draft_loops=_draft(model), block_size=3, **kw)
    assert a.chunks == b.chunks


@torch.no_grad()
def test_plain_function_and_sequential_baseline_match_generate(arch):
    model = make_model(arch).double()
    ids, mask = _batch(True)
    kw = call_kwargs(arch)
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0, **kw)
    for gamma in (0, 2):  # 0: sequential decoding through the same loop
        out = self_speculative_generate(
            model, ids, attention_mask=mask, draft_loops=_draft(model), block_size=gamma, max_new_tokens=10, **kw
        )
        assert torch.equal(out, ref)


@torch.no_grad()
@pytest.mark.parametrize("cache_name", ["deepest-plane", "loopkv-kivi4"])
def test_approximate_caches_run_and_decode_sequentially_exactly(cache_name):
    """DeepestPlaneCache (W = 0) and LoopKV are allowed (approximate under speculation); through the same loop with
    gamma = 0 they give plain generate's tokens."""
    model = make_model("ouro", hidden_size=64).double()
    ids, mask = _batch(True)
    small = dict(sink=2, window=4, page_size=4, group_size=16)
    build = {
        "deepest-plane": DeepestPlaneCache,
        "loopkv-kivi4": lambda m: LoopKVCache(m, loopkv_preset(m.loop_layout, "kivi4-share", **small), tau=14.0),
    }[cache_name]
    kw = dict(attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
    ref = model.generate(ids, past_key_values=build(model), **kw)
    seq = self_speculative_generate(
        model, ids, attention_mask=mask, draft_loops=1, block_size=0, max_new_tokens=12, cache=build(model)
    )
    assert torch.equal(seq, ref)
    spec = model.generate(
        ids, past_key_values=build(model), custom_generate=self_speculative, draft_loops=2, block_size=3, **kw
    )
    assert spec.shape == ref.shape and torch.equal(spec[:, : ids.shape[1]], ids)


@torch.no_grad()
def test_loopkv_verification_reads_both_planes_unless_told_otherwise():
    """Over a default LoopKV cache (`v_precision_blocks=None`) the decoder's verification blocks read both planes of
    every history token, as with `v_precision_blocks=False` (the same tokens and the same V-precision read count:
    only the one-token drafts count), while `True` keeps V precision per row in the blocks (more reads counted). The
    cache leaves the decode no longer speculating."""
    model = make_model("ouro", hidden_size=64).double()
    ids, mask = _batch(True)
    small = dict(sink=2, window=4, page_size=4, group_size=16)

    def run(**options):
        cache = LoopKVCache(model, loopkv_preset(model.loop_layout, "kivi4-share", **small), tau=1.0, **options)
        stats = cache.track_v_precision()
        out = self_speculative_generate(
            model, ids, attention_mask=mask, draft_loops=2, block_size=3, max_new_tokens=16, cache=cache
        )
        assert not cache.is_speculating
        return out, stats["history"]

    default, default_read = run()
    both, both_read = run(v_precision_blocks=False)
    rows, rows_read = run(v_precision_blocks=True)
    assert torch.equal(default, both) and default_read == both_read > 0
    assert rows_read > both_read


def test_unsupported_modes_and_bad_arguments_are_refused():
    model = make_model("ouro")
    ids = torch.tensor([[5, 9, 17]])
    base = dict(custom_generate=self_speculative, max_new_tokens=4, pad_token_id=0)
    with pytest.raises(ValueError, match="beam search"):
        model.generate(ids, num_beams=2, draft_loops=1, **base)
    with pytest.raises(ValueError, match="draft_loops"):
        model.generate(ids, draft_loops=3, **base)
    with pytest.raises(ValueError, match="draft_loops"):
        model.generate(ids, **base)
    with pytest.raises(ValueError, match="block_size"):
        model.generate(ids, draft_loops=1, block_size=-1, **base)
    with pytest.raises(ValueError, match="returning scores"):
        model.generate(ids, draft_loops=1, output_scores=True, return_dict_in_generate=True, **base)
    with pytest.raises(ValueError, match="streamer"):
        model.generate(torch.cat([ids, ids]), draft_loops=1, streamer=_Collect(), **base)


@torch.no_grad()
def test_sampling_draws_the_target_distribution():
    """Token 2 (the first from a verification) over 2000 sampled rows against its exact marginal
    `sum_t1 p(t1) p(t2 | t1)` under the same temperature (chi-square, significance 1e-4)."""
    model = make_model("ouro", vocab_size=8, initializer_range=0.5, eos_token_id=None).double()
    prompt = torch.tensor([[5, 3, 6]])
    warp = LogitsProcessorList([TemperatureLogitsWarper(1.5)])
    n = 2000
    out = self_speculative_generate(
        model,
        prompt.expand(n, -1),
        draft_loops=1,
        block_size=3,
        max_new_tokens=3,
        do_sample=True,
        logits_processor=warp,
        generator=torch.Generator().manual_seed(0),
    )
    p1 = torch.softmax(model(prompt).logits[0, -1] / 1.5, -1)
    firsts = torch.cat([prompt.expand(8, -1), torch.arange(8)[:, None]], 1)
    p2 = (p1[:, None] * torch.softmax(model(firsts).logits[:, -1] / 1.5, -1)).sum(0)
    for j, p in ((0, p1), (1, p2)):
        counts = torch.bincount(out[:, 3 + j], minlength=8).double()
        chi2 = float(((counts - n * p) ** 2 / (n * p)).sum())
        assert chi2 < 29.88, f"token {j + 1}: chi2 {chi2:.1f}"


@torch.no_grad()
def test_return_dict_in_generate_returns_sequences_and_the_cache():
    from hf_loopcache._compat import OUTPUT_CACHE_FIELD

    model = make_model("ouro").double()
    ids = torch.tensor([[5, 9, 17, 33]])
    cache = RIPECache(model, window=3)
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    ref = model.generate(ids, past_key_values=RIPECache(model, window=3), **kw)
    out = model.generate(
        ids,
        past_key_values=cache,
        custom_generate=self_speculative,
        draft_loops=2,
        block_size=3,
        return_dict_in_generate=True,
        **kw,
    )
    assert torch.equal(out.sequences, ref) and getattr(out, OUTPUT_CACHE_FIELD) is cache
    assert cache.get_seq_length() >= ref.shape[1] - 1  # the last token is emitted, not cached


@torch.no_grad()
def test_timed_phases_are_profiler_ranges():
    """With phase timing, the prefill, every draft phase and every verification are `torch.profiler` ranges
    (`self_speculative::<stats field>`, which `benchmarks.profile_selfspec` splits a block's kernels by): one per
    phase and block; without stats, or with `phase_timing=False`, none."""
    from torch.profiler import ProfilerActivity, profile

    model = make_model("ouro")
    ids = torch.tensor([[5, 9, 17, 33, 12, 8, 40, 7]])

    def ranges(stats):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            self_speculative_generate(model, ids, draft_loops=1, block_size=2, max_new_tokens=7,
                                      speculative_stats=stats)  # fmt: skip
        names = [e.name for e in prof.events() if e.name.startswith("self_speculative::")]
        return {n: names.count(n) for n in set(names)}

    stats = SpeculativeStats()
    seen = ranges(stats)
    assert seen == {
        "self_speculative::prefill_time_s": 1,
        "self_speculative::draft_time_s": stats.verifications,
        "self_speculative::verify_time_s": stats.verifications,
    }
    assert stats.verifications >= 2
    assert ranges(None) == {} and ranges(SpeculativeStats(phase_timing=False)) == {}


def test_draft_cost_ratio_feeds_best_block_size():
    """`SpeculativeStats.draft_cost_ratio` is a draft forward's mean time over a verification's (nan without phase
    timing); with `acceptance_rate` it is what `best_block_size` takes."""
    from hf_loopcache.generation import best_block_size

    stats = SpeculativeStats(verifications=10, draft_forwards=40, draft_time_s=2.0, verify_time_s=1.0)
    assert stats.draft_cost_ratio == pytest.approx((2.0 / 40) / (1.0 / 10))
    assert stats.to_dict()["draft_cost_ratio"] == stats.draft_cost_ratio
    assert math.isnan(SpeculativeStats(verifications=3, draft_forwards=6).draft_cost_ratio)  # no phase timing
    model = make_model("ouro")
    run = SpeculativeStats()
    self_speculative_generate(model, torch.tensor([[5, 9, 17, 33, 12, 8, 40, 7]]), draft_loops=1, block_size=2,
                              max_new_tokens=9, speculative_stats=run)  # fmt: skip
    assert run.draft_cost_ratio > 0 and 1 <= best_block_size(run.acceptance_rate, run.draft_cost_ratio) <= 16
    timed_off = SpeculativeStats(phase_timing=False)
    self_speculative_generate(model, torch.tensor([[5, 9, 17, 33, 12, 8, 40, 7]]), draft_loops=1, block_size=2,
                              max_new_tokens=9, speculative_stats=timed_off)  # fmt: skip
    assert math.isnan(timed_off.draft_cost_ratio)


@torch.no_grad()
@pytest.mark.parametrize("cache_name", ["full", "ripe-W=gamma"])
@pytest.mark.parametrize("left_pad", [False, True], ids=["B1", "B3-left-padded"])
def test_auto_block_size_equals_sequential_generate_fp64(arch, cache_name, left_pad):
    """`block_size="auto"`: each block takes `AdaptiveBlockSize`'s choice (here between 1 and 5 on a random model's
    acceptance, `draft_cost_ratio` low so that longer blocks pay); greedy output still equals plain greedy
    `generate` (RIPE's window covers the largest block), and the blocks taken are the rule's, replayed from the
    accepted lengths."""
    from hf_loopcache.generation import AdaptiveBlockSize

    model = make_model(arch).double()
    ids, mask = _batch(left_pad)
    kw = dict(max_new_tokens=24, do_sample=False, pad_token_id=0, **call_kwargs(arch))
    if mask is not None:
        kw["attention_mask"] = mask
    ref = model.generate(ids, past_key_values=_CACHES[cache_name](model, 5), **kw)
    stats = _AutoStats()
    out = model.generate(
        ids, past_key_values=_CACHES[cache_name](model, 5), custom_generate=self_speculative,
        draft_loops=_draft(model), block_size="auto", max_block_size=5, draft_cost_ratio=0.05,
        speculative_stats=stats, **kw,
    )  # fmt: skip
    assert torch.equal(out, ref)
    assert len(stats.block_sizes) > 1 and max(stats.block_sizes) <= 5  # the rule moved
    replay = AdaptiveBlockSize(0.05, 5)
    for accepted, gamma, active in stats.blocks[:-2]:  # the last blocks are shortened to the remaining budget
        assert gamma == replay.block_size()
        replay.update(accepted, gamma, active)


class _AutoStats(SpeculativeStats):
    """Stats that also keep every block's accepted lengths, size and live rows."""

    def __init__(self):
        super().__init__()
        self.blocks = []

    def _record(self, accept_length, gamma, active):
        self.blocks.append((list(accept_length), gamma, list(active)))
        super()._record(accept_length, gamma, active)


@torch.no_grad()
def test_auto_block_size_follows_forced_acceptance():
    """Forced acceptance 1 takes the auto rule to `max_block_size`, 0 to blocks of one draft (Eq. 8 at the layer
    cost ratio, 1 of 3 loops here: 1/3); the cache's rollback reserve is the largest block."""
    model = make_model("ouro")
    ids = torch.tensor([[5, 9, 17, 33, 12, 8, 40, 7]])
    for forced, expect in ((1.0, 6), (0.0, 1)):
        stats, cache = SpeculativeStats(), FullLoopCache(model)
        self_speculative_generate(model, ids, draft_loops=1, block_size="auto", max_block_size=6, max_new_tokens=90,
                                  cache=cache, speculative_stats=stats, forced_acceptance=forced)  # fmt: skip
        assert max(stats.block_sizes, key=stats.block_sizes.get) == expect, stats.block_sizes
        assert cache.max_rollback == 6


@torch.no_grad()
def test_the_default_block_size_is_auto_up_to_four():
    """Without `block_size` the decoder takes the auto rule's blocks up to `DEFAULT_MAX_BLOCK_SIZE` (4, the reserve
    the fixed default had): forced acceptance 1 settles on 4 and 0 on 1, through `generate` and the plain function;
    `max_block_size` alone raises the cap."""
    assert DEFAULT_MAX_BLOCK_SIZE == 4
    model = make_model("ouro")
    ids = torch.tensor([[5, 9, 17, 33, 12, 8, 40, 7]])
    for forced, expect in ((1.0, 4), (0.0, 1)):
        stats, cache = SpeculativeStats(), FullLoopCache(model)
        model.generate(ids, past_key_values=cache, custom_generate=self_speculative, draft_loops=1, max_new_tokens=60,
                       min_new_tokens=60, pad_token_id=0, speculative_stats=stats, forced_acceptance=forced)  # fmt: skip
        assert max(stats.block_sizes, key=stats.block_sizes.get) == expect and max(stats.block_sizes) <= 4
        assert cache.max_rollback == 4
    stats = SpeculativeStats()
    self_speculative_generate(model, ids, draft_loops=1, max_block_size=7, max_new_tokens=60, speculative_stats=stats,
                              forced_acceptance=1.0)  # fmt: skip
    assert max(stats.block_sizes, key=stats.block_sizes.get) == 7


def test_auto_block_size_arguments_are_refused_by_name():
    model = make_model("ouro")
    ids = torch.tensor([[5, 9, 17]])
    base = dict(custom_generate=self_speculative, max_new_tokens=4, pad_token_id=0, draft_loops=1)
    with pytest.raises(ValueError, match="`block_size` must be a non-negative int .* or 'auto', got 'fast'"):
        model.generate(ids, block_size="fast", **base)
    with pytest.raises(ValueError, match="`max_block_size` must be a positive int .* got 0"):
        model.generate(ids, block_size="auto", max_block_size=0, **base)
    with pytest.raises(ValueError, match="`draft_cost_ratio` must be None or a positive number, got -1"):
        self_speculative_generate(model, ids, draft_loops=1, block_size="auto", draft_cost_ratio=-1)
    # the auto rule's options with a fixed block size would be ignored: refused by name
    for_auto = r"`max_block_size` is for `block_size='auto'` \(the default\), got it with block_size=3"
    with pytest.raises(ValueError, match=for_auto):
        model.generate(ids, block_size=3, max_block_size=6, **base)
    with pytest.raises(ValueError, match="`draft_cost_ratio` is for `block_size='auto'`"):
        self_speculative_generate(model, ids, draft_loops=1, block_size=2, draft_cost_ratio=0.5)
