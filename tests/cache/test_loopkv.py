"""LoopKV on the engine: codes against the codec, error by bit width, V precision and its bound, presets, bytes."""

from __future__ import annotations

import contextlib
import math

import pytest
import torch

from hf_loopcache import CachePlan, Cell, FullLoopCache, LoopKVCache, LoopLayout
from hf_loopcache.attention import Segment, VPrecision, segmented_attention
from hf_loopcache.cache.plan import loopkv_preset
from tests.helpers import call_kwargs, make_model, teacher_forced_logprob
from triton_ops.quant import dequantize_values, fake_quantize_keys, fake_quantize_values, quantize_values

OURO_14B = LoopLayout(n_core=24, num_loops=4, num_kv_heads=16, head_dim=128, name="ouro")


def _small_plan(layout, name, **kw):
    return loopkv_preset(layout, name, **{"sink": 4, "window": 8, "page_size": 8, "group_size": 16, **kw})


def _model(arch, dtype=torch.float32):
    return make_model(arch, **({"hidden_size": 64} if arch == "ouro" else {"n_embd": 64})).to(dtype)


def _ids(length, seed=0):
    return torch.randint(3, 60, (1, length), generator=torch.Generator().manual_seed(seed))


def test_byte_model_matches_loopkv_appendix_c():
    kivi4 = loopkv_preset(OURO_14B, "kivi4")
    assert kivi4.coded_bytes_per_token(4) == 2560 and kivi4.coded_bytes_per_token(2) == 1536
    assert kivi4.bytes_per_token() == (240 * 1024, 240 * 1024)
    assert loopkv_preset(OURO_14B, "kivi4-share").bytes_per_token() == (180 * 1024, 240 * 1024)
    assert loopkv_preset(OURO_14B, "kivi2").bytes_per_token() == (144 * 1024, 144 * 1024)
    assert CachePlan.full(OURO_14B).bytes_per_token() == (768 * 1024, 768 * 1024)


@torch.no_grad()
@pytest.mark.parametrize("name", ["kivi4", "kivi2"])
def test_history_holds_the_codec_of_the_exact_keys_and_values(arch, name):
    model = _model(arch)
    ids = _ids(45)
    full, coded = FullLoopCache(model), LoopKVCache(model, _small_plan(model.loop_layout, name), tau=None)
    model(ids, cache=full, use_cache=True, **call_kwargs(arch))
    model(ids, cache=coded, use_cache=True, **call_kwargs(arch))
    nbits = 4 if name == "kivi4" else 2
    sink, hist_end = 4, 4 + 8 * ((45 - 4 - 8) // 8)  # 36: pages [4, 36) left the window
    for cell in model.loop_layout.cells():
        k, v = full.cell_states(cell)
        kc, vc = coded.cell_states(cell)
        torch.testing.assert_close(kc[:, :, :sink], k[:, :, :sink], atol=0, rtol=0)  # sink exact
        torch.testing.assert_close(kc[:, :, hist_end:], k[:, :, hist_end:], atol=0, rtol=0)  # window exact
        torch.testing.assert_close(
            kc[:, :, sink:hist_end], fake_quantize_keys(k[:, :, sink:hist_end], nbits, group_size=8)
        )
        torch.testing.assert_close(
            vc[:, :, sink:hist_end], fake_quantize_values(v[:, :, sink:hist_end], nbits, group_size=16)
        )


@torch.no_grad()
def test_error_against_the_uncached_model_grows_as_bits_fall(arch):
    model = _model(arch)
    ids = _ids(80, seed=1)
    with torch.no_grad():
        exact = model(ids, **call_kwargs(arch)).logits[0, 40:]
    errors = {}
    for name in ("kivi4", "kivi2"):
        cache = LoopKVCache(model, _small_plan(model.loop_layout, name), tau=None)
        model(ids[:, :40], cache=cache, use_cache=True, **call_kwargs(arch))
        logits = torch.cat(
            [
                model(ids[:, t : t + 9], cache=cache, use_cache=True, **call_kwargs(arch)).logits
                for t in range(40, 80, 9)
            ],
            dim=1,
        )[0]
        errors[name] = (logits - exact).abs().max().item()
    assert 0 < errors["kivi4"] < errors["kivi2"]


@torch.no_grad()
def test_v_precision_off_equals_infinite_tau(arch):
    model = _model(arch)
    ids = _ids(60, seed=2)
    outs = []
    for tau in (None, math.inf):
        cache = LoopKVCache(model, _small_plan(model.loop_layout, "kivi4-share"), tau=tau)
        model(ids[:, :30], cache=cache, use_cache=True, **call_kwargs(arch))
        outs.append(model(ids[:, 30:], cache=cache, use_cache=True, **call_kwargs(arch)).logits)
    torch.testing.assert_close(outs[0], outs[1], atol=0, rtol=0)


@pytest.mark.parametrize("tau", [1.0, 2.0, 4.0])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_v_precision_error_bound(tau, seed):
    """LoopKV Proposition 1: |o_vp - o_int4|_inf <= 1.5 sum_{j cold} a_j sigma_j <= 1.5 sigma_max |C| 2^-tau a_max."""
    g = torch.Generator().manual_seed(seed)
    b, h, q, d, length, group = 1, 2, 1, 32, 64, 16
    query = torch.randn(b, h, q, d, generator=g) * 2
    sink_k, sink_v = torch.randn(b, h, 4, d, generator=g), torch.randn(b, h, 4, d, generator=g)
    hist_k = torch.randn(b, h, length, d, generator=g) * 2
    qv = quantize_values(torch.randn(b, h, length, d, generator=g), 4, group_size=group)
    hot_v = dequantize_values(qv)
    cold_delta = dequantize_values(qv, hot=torch.zeros(b, h, length, dtype=torch.bool)) - hot_v
    segments = [Segment(sink_k, sink_v, is_sink=True), Segment(hist_k, hot_v, cold_delta=cold_delta)]
    vp = VPrecision(tau=tau, page_size=8)
    out_vp = segmented_attention(query, segments, scaling=d**-0.5, v_precision=vp)
    out_full = segmented_attention(query, segments, scaling=d**-0.5)
    # the same cold rule, written out: running page maximum seeded with the sink maximum
    s_sink = (query @ sink_k.transpose(-1, -2)) * d**-0.5
    s_hist = (query @ hist_k.transpose(-1, -2)) * d**-0.5
    page_max = s_hist.unflatten(-1, (length // 8, 8)).amax(-1)
    running = torch.maximum(page_max.cummax(-1).values, s_sink.amax(-1, keepdim=True)).repeat_interleave(8, -1)
    cold = s_hist < running - tau * math.log(2)
    weights = torch.softmax(torch.cat([s_sink, s_hist], -1), -1)[..., 4:]
    sigma = qv.scale.float().repeat_interleave(group, dim=-1)  # [B, H, T, D] scale of each element's group
    bound = 1.5 * ((weights * cold)[..., None] * sigma[:, :, None]).sum(-2)  # [B, H, q, D]
    assert ((out_vp - out_full).abs() <= bound + 1e-6).all()
    loose = 1.5 * sigma.amax() * cold.sum() * 2 ** (-tau) * weights.amax()
    assert (out_vp - out_full).abs().max() <= loose + 1e-6


@torch.no_grad()
@pytest.mark.parametrize("name", ["kivi4-share", "hand"])
def test_block_reads_equal_sequential_reads_for_coded_plans(arch, name):
    """The engine's reading rule makes a block of <= W + 1 tokens read exactly what sequential decoding reads,
    pages that leave the window inside the block included (fp64)."""
    model = _model(arch, torch.float64)
    plan = _small_plan(model.loop_layout, name)
    ids = _ids(40 + 9, seed=3)
    seq, blk = LoopKVCache(model, plan), LoopKVCache(model, plan)
    kw = call_kwargs(arch)
    model(ids[:, :40], cache=seq, use_cache=True, **kw)
    model(ids[:, :40], cache=blk, use_cache=True, **kw)
    one = torch.cat(
        [model(ids[:, t : t + 1], cache=seq, use_cache=True, **kw).logits for t in range(40, 49)], 1
    )
    at_once = model(ids[:, 40:49], cache=blk, use_cache=True, **kw).logits
    torch.testing.assert_close(at_once, one, atol=1e-9, rtol=1e-9)
    assert seq.stored_bytes() == blk.stored_bytes()


@torch.no_grad()
def test_crop_into_the_coded_history_and_decode_again(arch):
    """Cropping below the coded history decodes the straddling page back to full precision; decoding on restores the
    plan's layout (same stored bytes as a cache that never went further). What every cell holds is compared with the
    codec of the exact model's keys and values (`tests/cache/test_read_rules.py` checks what a query reads after such
    a crop against a closed form)."""
    model = _model(arch)
    plan = _small_plan(model.loop_layout, "kivi4")
    cache, fresh, full = LoopKVCache(model, plan, tau=None), LoopKVCache(model, plan), FullLoopCache(model)
    ids = _ids(60, seed=4)
    kw = call_kwargs(arch)
    model(ids[:, :50], cache=cache, use_cache=True, **kw)
    model(ids[:, :50], cache=full, use_cache=True, **kw)
    cache.crop(-25)  # length 25, inside the coded history [4, 36): page [20, 28) straddles the cut
    assert cache.get_seq_length() == 25
    for cell in model.loop_layout.cells():
        k, v = (x[:, :, :28] for x in full.cell_states(cell))  # the exact states (causal: the same at any length)
        kc, vc = cache.cell_states(cell)
        torch.testing.assert_close(kc[:, :, :4], k[:, :, :4], atol=0, rtol=0)  # sink exact
        torch.testing.assert_close(kc[:, :, 4:25], fake_quantize_keys(k[:, :, 4:28], 4, group_size=8)[:, :, :21])
        torch.testing.assert_close(vc[:, :, 4:25], fake_quantize_values(v[:, :, 4:28], 4, group_size=16)[:, :, :21])
    before = [cache.cell_states(cell) for cell in model.loop_layout.cells()]
    model(ids[:, 25:30], cache=cache, use_cache=True, **kw)
    for cell, (k, v) in zip(model.loop_layout.cells(), before):  # decoding on keeps what the crop left
        for a, b in zip(cache.cell_states(cell), (k, v)):
            torch.testing.assert_close(a[:, :, :25], b, atol=0, rtol=0)
    model(ids[:, :30], cache=fresh, use_cache=True, **kw)
    assert cache.get_seq_length() == 30
    assert cache.stored_bytes() == fresh.stored_bytes()
    assert cache.layer_for(Cell("core", 1, 1)).window_start == fresh.layer_for(Cell("core", 1, 1)).window_start == 20


@torch.no_grad()
def test_generate_with_loopkv_presets(arch):
    model = _model(arch)
    ids = torch.tensor([[5, 9, 17, 33, 12, 8, 40] * 6])
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    kw = call_kwargs(arch)
    for name in ("kivi4", "kivi2", "kivi4-share", "hand"):
        plan = _small_plan(model.loop_layout, name)
        out = model.generate(
            ids,
            attention_mask=mask,
            cache=LoopKVCache(model, plan),
            max_new_tokens=20,
            min_new_tokens=20,
            do_sample=False,
            pad_token_id=0,
            output_logits=True,
            return_dict_in_generate=True,
            **kw,
        )
        assert out.sequences.shape == (1, ids.shape[1] + 20)
        # reference: the same cache fed the generated tokens one forward at a time (teacher forcing)
        cache, seq = LoopKVCache(model, plan), out.sequences
        full_mask = torch.cat([mask, torch.ones(1, 20, dtype=mask.dtype)], dim=1)
        logits = [model(ids, attention_mask=mask, past_key_values=cache, use_cache=True, **kw).logits[:, -1]]
        for t in range(ids.shape[1], seq.shape[1] - 1):
            step = model(
                seq[:, t : t + 1], attention_mask=full_mask[:, : t + 1], past_key_values=cache, use_cache=True, **kw
            )
            logits.append(step.logits[:, -1])
        for a, b in zip(out.logits, logits):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
        greedy = torch.stack(logits, 1).index_fill(-1, torch.tensor([2]), -math.inf).argmax(-1)  # EOS 2: min tokens
        assert torch.equal(seq[:, ids.shape[1] :], greedy)
    # beams in fp64: in fp32 the 3-row beam forwards and the 1-row teacher forcing round differently (the CPU's
    # matmul kernels depend on the shapes), and a key or value that rounds across a code boundary moves a
    # log-probability by ~1e-3 (seen on a CPU with AVX512-FP16)
    model = model.double()
    plan = _small_plan(model.loop_layout, "hand")
    prompt = ids[:, :20]  # 30 new tokens: pages of generated tokens, which differ between beams, get coded
    beams = model.generate(
        prompt,
        cache=LoopKVCache(model, plan),
        num_beams=3,
        max_new_tokens=30,
        min_new_tokens=30,
        do_sample=False,
        pad_token_id=0,
        length_penalty=0.0,
        output_scores=True,
        return_dict_in_generate=True,
        **kw,
    )
    assert beams.sequences.shape == (1, prompt.shape[1] + 30)
    # the best beam's score is its log-probability under a fresh cache fed its tokens: the reordered rows (sink,
    # window and codes) followed the beam
    expected = teacher_forced_logprob(model, beams.sequences, prompt.shape[1], LoopKVCache(model, plan), **kw)
    assert float(beams.sequences_scores[0]) == pytest.approx(expected, rel=1e-5, abs=1e-4)  # fp32 sums


def test_loopkv_cache_errors():
    with pytest.raises(ValueError, match="LOOPKV_PRESETS|one of"):
        LoopKVCache(OURO_14B, "kivi3")
    plan = _small_plan(OURO_14B, "kivi4")
    other = LoopLayout(n_core=24, num_loops=4, num_kv_heads=8, head_dim=128, name="ouro")
    with pytest.raises(ValueError, match="plan is for"):
        LoopKVCache(other, plan)
    with pytest.raises(ValueError, match="share"):
        CachePlan(OURO_14B, {**plan.options, Cell("core", 3, 0): "share"})


@torch.no_grad()
@pytest.mark.parametrize("static", [False, True], ids=["growable", "static"])
def test_v_precision_blocks_off_reads_both_planes_in_blocks_only(arch, static):
    """`v_precision_blocks=False`: a forward of several new tokens reads both planes of every history token (as
    `tau=None`) and counts nothing; a one-token forward keeps V precision (as `v_precision_blocks=True`)."""
    model = _model(arch)
    ids = _ids(40, seed=3)
    kw = dict(static=True, max_batch_size=1, max_cache_len=48) if static else {}

    def cache(tau, blocks=True):
        plan = _small_plan(model.loop_layout, "kivi4-share")
        return LoopKVCache(model, plan, tau=tau, v_precision_blocks=blocks, **kw)

    def run(c, chunks):
        model(ids[:, :30], cache=c, use_cache=True, **call_kwargs(arch))  # prefill: coded pages, no coded read
        stats = c.track_v_precision() if c.v_precision is not None else None
        logits = [model(ids[:, a:b], cache=c, use_cache=True, **call_kwargs(arch)).logits for a, b in chunks]
        return torch.cat(logits, dim=1), stats

    block = [(30, 35)]  # five new tokens over two coded pages (sink 4, window 8, pages of 8)
    off, off_stats = run(cache(1.0, blocks=False), block)
    both, _ = run(cache(None), block)
    rows, rows_stats = run(cache(1.0), block)
    torch.testing.assert_close(off, both, atol=0, rtol=0)
    assert (off - rows).abs().max() > 1e-4  # at tau = 1 bit V precision moves this block's logits
    assert off_stats["history"] == 0 and rows_stats["history"] > 0 and rows_stats["cold"] > 0

    step = [(30, 31), (31, 32)]  # one token at a time
    off, off_stats = run(cache(1.0, blocks=False), step)
    rows, rows_stats = run(cache(1.0), step)
    both, _ = run(cache(None), step)
    torch.testing.assert_close(off, rows, atol=0, rtol=0)
    assert (off - both).abs().max() > 1e-4
    assert off_stats["cold"] == rows_stats["cold"] > 0 and off_stats["history"] == rows_stats["history"]


@torch.no_grad()
@pytest.mark.parametrize("static", [False, True], ids=["growable", "static"])
def test_v_precision_blocks_default_reads_both_planes_only_while_speculating(arch, static):
    """`v_precision_blocks=None` (the default): a block reads with V precision per row (as True) outside a
    self-speculative decode and at both planes (as False) inside `cache.speculating()`; a one-token forward keeps V
    precision either way, and `True` keeps it in blocks inside too."""
    model = _model(arch)
    ids = _ids(40, seed=3)
    kw = dict(static=True, max_batch_size=1, max_cache_len=48) if static else {}

    def run(chunks, speculating, **options):
        plan = _small_plan(model.loop_layout, "kivi4-share")
        c = LoopKVCache(model, plan, tau=1.0, **options, **kw)
        model(ids[:, :30], cache=c, use_cache=True, **call_kwargs(arch))  # prefill: coded pages, no coded read
        stats = c.track_v_precision()
        with c.speculating() if speculating else contextlib.nullcontext():
            assert c.is_speculating is speculating
            logits = [model(ids[:, a:b], cache=c, use_cache=True, **call_kwargs(arch)).logits for a, b in chunks]
        assert not c.is_speculating
        return torch.cat(logits, dim=1), stats["history"]

    block = [(30, 35)]
    rows, rows_read = run(block, False, v_precision_blocks=True)
    both, both_read = run(block, False, v_precision_blocks=False)
    assert (rows - both).abs().max() > 1e-4 and rows_read > 0 and both_read == 0
    for speculating, (want, read) in ((False, (rows, rows_read)), (True, (both, both_read))):
        got, got_read = run(block, speculating)
        torch.testing.assert_close(got, want, atol=0, rtol=0)
        assert got_read == read
    got, got_read = run(block, True, v_precision_blocks=True)
    torch.testing.assert_close(got, rows, atol=0, rtol=0)
    step = [(30, 31), (31, 32)]
    rows, rows_read = run(step, False, v_precision_blocks=True)
    got, got_read = run(step, True)
    torch.testing.assert_close(got, rows, atol=0, rtol=0)
    assert got_read == rows_read > 0


def test_speculating_is_restored_after_an_error():
    cache = LoopKVCache(OURO_14B, "kivi4")
    with pytest.raises(RuntimeError, match="boom"), cache.speculating():
        raise RuntimeError("boom")
    assert not cache.is_speculating
    assert VPrecision().blocks is None and VPrecision().in_blocks(False) and not VPrecision().in_blocks(True)
    assert VPrecision(blocks=True).in_blocks(True) and not VPrecision(blocks=False).in_blocks(False)


def test_v_precision_blocks_must_be_a_bool():
    with pytest.raises(ValueError, match=r"`v_precision_blocks` must be True, False or None, got 1"):
        LoopKVCache(OURO_14B, "kivi4", v_precision_blocks=1)
    with pytest.raises(TypeError, match=r"`VPrecision.blocks` must be True, False or None"):
        VPrecision(tau=14.0, blocks="no")
