"""Static LoopKV caches: coded (`int4` / `int2`) and shared cells with a sink in preallocated storage, lengths and
boundaries on the device, the page flush inside the decode step.

Greedy tokens and logits equal the growable LoopKV cache's (fp64 to 1e-10, both architectures, V precision on, flush
boundaries crossed every 4 tokens, a left-padded batch), the codes are the growable cache's bit for bit, a decode step
reads no device value on the host and runs the same operations on the same shapes whether or not it flushes a page,
crop within the rollback reserve and a replayed (captured) step give the growable cache's tokens; on CUDA `generate`
replays a captured step.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import hf_loopcache
from hf_loopcache import LoopKVCache, RIPECache
from hf_loopcache.cache.layers import StaticCodedLayer, StaticCodedSharedLayer
from hf_loopcache.cache.plan import loopkv_preset
from tests.helpers import call_kwargs, make_model, stand_in_graphs

ARCHS = ["ouro", "huginn"]
PRESETS = ["kivi4", "kivi4-share", "kivi2", "hand"]
NEW = 20  # new tokens: with a 9-token prompt, sink 2, window 4 and pages of 4, about five page flushes


def _model(arch):
    return make_model(arch, **({"hidden_size": 64} if arch == "ouro" else {"n_embd": 64})).float()


def _cache(model, name, tau=1.0, **kwargs):
    plan = loopkv_preset(model.loop_layout, name, sink=2, window=4, page_size=4, group_size=8)
    return LoopKVCache(model, plan, tau=tau, **kwargs)


def _prompt(batch, padded, length=9, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 64, (batch, length), generator=g)
    mask = torch.ones_like(ids)
    if padded:
        mask[-1, :4] = 0
        ids[-1, :4] = 0
    return ids, mask


def _generate(model, arch, ids, mask, cache, new=NEW, **kwargs):
    return model.generate(
        ids, attention_mask=mask, cache=cache, max_new_tokens=new, min_new_tokens=new, do_sample=False,
        pad_token_id=0, output_logits=True, return_dict_in_generate=True, **call_kwargs(arch), **kwargs,
    )  # fmt: skip


def _same(got, expected, atol=1e-2):
    """Same tokens; logits within `atol` (fp32: the static read sums the same terms in another order, plus zeros for
    the preallocated pages and ring slots it masks, and V precision (tau = 1 here) may flip a token at the threshold;
    in fp64 the logits agree to 1e-10, `test_static_loopkv_logits_equal_growable_fp64`)."""
    assert torch.equal(got.sequences, expected.sequences)
    for a, b in zip(got.logits, expected.logits):
        torch.testing.assert_close(a, b, rtol=0, atol=atol)


@pytest.mark.parametrize("name", PRESETS)
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("batch,padded", [pytest.param(1, False, id="B1"), pytest.param(3, True, id="B3-leftpad")])
def test_static_loopkv_greedy_equals_growable(arch, batch, padded, name):
    """fp64 (as every static-against-growable comparison through codes here): in fp32 the two caches' forwards round
    differently wherever the CPU's matmul kernels depend on the shapes (a static cache of 4 rows against 3), and a key
    or value that rounds across a code boundary moves later logits by up to ~0.15 (seen on a CPU with AVX512-FP16)."""
    model = _model(arch).double()
    ids, mask = _prompt(batch, padded)
    expected = _generate(model, arch, ids, mask, _cache(model, name))
    cache = _cache(model, name, static=True, max_batch_size=4, max_cache_len=32)
    assert cache.is_compileable
    assert any(isinstance(layer, StaticCodedLayer) for layer in cache.cells)
    _same(_generate(model, arch, ids, mask, cache), expected, atol=1e-10)
    assert int(cache._length_t) == cache.get_seq_length() == ids.shape[1] + NEW - 1


@pytest.mark.parametrize("name", PRESETS)
@pytest.mark.parametrize("arch", ARCHS)
def test_static_loopkv_logits_equal_growable_fp64(arch, name):
    """In fp64 every logit of every step equals the growable cache's (a left-padded batch, V precision on)."""
    model = _model(arch).double()
    ids, mask = _prompt(3, True)
    expected = _generate(model, arch, ids, mask, _cache(model, name), new=14)
    got = _generate(model, arch, ids, mask, _cache(model, name, static=True, max_batch_size=3, max_cache_len=24), new=14)
    _same(got, expected, atol=1e-10)


@pytest.mark.parametrize("name", ["kivi4", "kivi2"])
def test_static_codes_are_the_growable_codes(name):
    """Every page the growable cell coded holds the same bytes in the static cell (codes, scales, zero points, both
    INT4 value planes), padding left out of the key pages the same way. (fp64, so that the keys themselves are equal:
    in fp32 the reads' rounding moves later layers' keys by an ulp, which may move an fp16 scale.)"""
    model = _model("ouro").double()
    ids, mask = _prompt(3, True)
    grown, static = _cache(model, name), _cache(model, name, static=True, max_batch_size=3, max_cache_len=32)
    _generate(model, "ouro", ids, mask, grown, new=14)
    _generate(model, "ouro", ids, mask, static, new=14)
    checked = 0
    for g, s in zip(grown.cells, static.cells):
        s.full_states()  # the page of the last step's boundary is coded at the next step: inspection codes it now
        pages = g.pages.pages
        assert pages >= 3
        keys, values = s._history()
        pairs = [
            (g.pages.keys().codes, keys.codes), (g.pages.keys().scale, keys.scale),
            (g.pages.keys().zero, keys.zero), (g.pages.values().hi, values.hi),
            (g.pages.values().scale, values.scale), (g.pages.values().zero, values.zero),
        ]  # fmt: skip
        if values.lo is not None:
            pairs.append((g.pages.values().lo, values.lo))
        for want, got in pairs:
            assert torch.equal(got[:, :, : want.shape[2]], want)
        checked += 1
    assert checked == len(static.cells)


@torch.no_grad()
@pytest.mark.parametrize("name", ["kivi4", "kivi2"])
def test_static_codes_with_holes_are_the_growable_codes(name):
    """Batched self-speculation leaves holes (rows accept different numbers of draft tokens): every page the growable
    cell coded holds the same bytes in the static cell, holes left out of the key pages as the growable cell leaves
    them out (a hole coded as a real token moves its page's key scales). fp64, a left-padded batch of 3."""
    model = _model("ouro").double()
    ids, mask = _prompt(3, True, length=9, seed=1)
    options = dict(attention_mask=mask, draft_loops=2, block_size=3, max_new_tokens=16, eos_token_id=None,
                   pad_token_id=0)  # fmt: skip
    grown, static = _cache(model, name), _cache(model, name, static=True, max_batch_size=3, max_cache_len=80)
    expected = hf_loopcache.self_speculative_generate(model, ids, cache=grown, **options)
    assert torch.equal(hf_loopcache.self_speculative_generate(model, ids, cache=static, **options), expected)
    valid = static._valid_t[:3, : static.get_seq_length()]
    assert hf_loopcache.cache.read.effective_positions(valid) is not None  # holes
    checked = 0
    for g, s in zip(grown.cells, static.cells):
        s.full_states()  # the pages of the last boundary are coded by the next forward: inspection codes them now
        keys, values = s._history()
        held = g.pages.keys()
        pairs = [
            (held.codes, keys.codes), (held.scale, keys.scale), (held.zero, keys.zero),
            (g.pages.values().hi, values.hi), (g.pages.values().scale, values.scale),
            (g.pages.values().zero, values.zero),
        ]  # fmt: skip
        if values.lo is not None:
            pairs.append((g.pages.values().lo, values.lo))
        for want, got in pairs:
            assert torch.equal(got[:, :, : want.shape[2]], want)
        checked += g.pages.pages
    assert checked >= 3 * len(static.cells)


class _HostReads(TorchDispatchMode):
    """Records every operator a forward runs with its argument shapes, and every read of a device value on the host
    (`.item()`, `int()`, `bool()`, `.tolist()` dispatch `aten._local_scalar_dense`; a boolean index or `nonzero`
    makes a shape out of device data)."""

    SYNCS = ("aten._local_scalar_dense", "aten.nonzero", "aten.masked_select", "aten.unique", "aten.equal")

    def __init__(self):
        super().__init__()
        self.ops: list[tuple] = []
        self.reads: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        if name.startswith(self.SYNCS):
            self.reads.append(name)
        shapes = tuple(tuple(a.shape) for a in args if isinstance(a, torch.Tensor))
        self.ops.append((name, shapes))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("name", ["kivi4", "kivi4-share", "hand"])
@pytest.mark.parametrize("arch", ARCHS)
def test_static_decode_step_reads_nothing_on_the_host(arch, name):
    """One decode forward over a static LoopKV cache (V precision counting) reads no device value on the host, and
    a step that flushes a page runs the same operators on the same shapes as one that does not: what a CUDA graph
    needs. The growable cache's step, for contrast, does read back."""
    model = _model(arch)
    ids, mask = _prompt(2, True)
    kwargs = call_kwargs(arch)
    cache = _cache(model, name, static=True, max_batch_size=2, max_cache_len=32)
    stats = cache.track_v_precision()
    grown = _cache(model, name)
    records = []
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, cache=cache, **kwargs)
        model(input_ids=ids, attention_mask=mask, cache=grown, **kwargs)
        for step in range(6):  # positions 9..14: the boundary H(t) moves (a page is flushed) at t = 10 and 14
            token = torch.full((2, 1), 5 + step)
            with _HostReads() as mode:
                model(input_ids=token, attention_mask=torch.ones(2, 1, dtype=torch.long), cache=cache, **kwargs)
            records.append(mode)
        with _HostReads() as growable:
            model(input_ids=torch.full((2, 1), 5), attention_mask=torch.ones(2, ids.shape[1] + 1), cache=grown, **kwargs)
    assert all(not r.reads for r in records), records[0].reads[:5]
    # (the first decode step also allocates the V-precision counter: in `generate` it is the eager warm-up step)
    assert all(r.ops == records[1].ops for r in records[1:])
    assert growable.reads
    assert stats["history"] > 0


@pytest.mark.parametrize("name", ["kivi4-share", "hand"])
@pytest.mark.parametrize("arch", ARCHS)
def test_replayed_static_loopkv_step_equals_growable(monkeypatch, arch, name):
    """`generate` through `DecodeGraphs` with the recording and replay stood in for: every step after the first is a
    replay whose host lengths are those of the recording, across page flushes; the tokens are the growable cache's."""
    from transformers import CompileConfig

    stand_in_graphs(monkeypatch)
    model = _model(arch).double()  # fp64: see `test_static_loopkv_greedy_equals_growable`
    config = CompileConfig()
    config._compile_all_devices = True  # transformers' switch to take the compiled call off CUDA
    ids, mask = _prompt(3, True)
    expected = _generate(model, arch, ids, mask, _cache(model, name))
    cache = _cache(model, name, static=True, max_batch_size=3, max_cache_len=32)
    got = _generate(model, arch, ids, mask, cache, compile_config=config)
    assert [entry.graph.replays for entry in cache._graphs.values()] == [NEW - 2]
    _same(got, expected, atol=1e-10)


@pytest.mark.parametrize("name", ["kivi4", "kivi4-share"])
@pytest.mark.parametrize("arch", ARCHS)
def test_static_loopkv_crop_then_continue(arch, name):
    """Crop within the rollback reserve (3 positions, across a page boundary), then decode on: the growable cache's
    tokens."""
    model = _model(arch)
    ids, mask = _prompt(2, True)
    outs = []
    for cache in (_cache(model, name, max_rollback=3),
                  _cache(model, name, max_rollback=3, static=True, max_batch_size=2, max_cache_len=40)):  # fmt: skip
        first = _generate(model, arch, ids, mask, cache, new=8).sequences
        cache.crop(-3)
        keep = first[:, : cache.get_seq_length() + 1]
        grown = torch.cat([mask, torch.ones(2, keep.shape[1] - ids.shape[1], dtype=mask.dtype)], dim=1)
        outs.append(_generate(model, arch, keep, grown, cache, new=10))
    _same(outs[1], outs[0])


@pytest.mark.parametrize("name", ["kivi4", "kivi4-share", "hand"])
@pytest.mark.parametrize("arch", ARCHS)
def test_static_loopkv_deep_crop_restores_what_the_growable_cache_restores(arch, name):
    """A crop of 9 positions with a rollback reserve of 1 (below the growable cell's window and the ring): the page
    that straddles the new length comes back from the codes, as the growable cache restores it; decoding on gives
    its logits (fp64: equal to 1e-10)."""
    model = _model(arch).double()
    ids, mask = _prompt(2, True)
    outs = []
    for cache in (_cache(model, name, max_rollback=1),
                  _cache(model, name, max_rollback=1, static=True, max_batch_size=2, max_cache_len=48)):  # fmt: skip
        first = _generate(model, arch, ids, mask, cache, new=16).sequences
        cache.crop(-9)
        keep = first[:, : cache.get_seq_length() + 1]
        grown = torch.cat([mask, torch.ones(2, keep.shape[1] - ids.shape[1], dtype=mask.dtype)], dim=1)
        outs.append(_generate(model, arch, keep, grown, cache, new=10))
    _same(outs[1], outs[0], atol=1e-10)


@pytest.mark.parametrize("arch", ARCHS)
def test_static_ripe_with_a_sink_equals_growable(arch):
    """RIPE with a sink (its shared cells read a BF16 source through the static windowed cell)."""
    model = make_model(arch).float()
    ids, mask = _prompt(3, True)
    expected = _generate(model, arch, ids, mask, RIPECache(model, window=3, sink=2), new=12)
    cache = RIPECache(model, window=3, sink=2, static=True, max_batch_size=3, max_cache_len=24)
    assert any(isinstance(layer, StaticCodedSharedLayer) for layer in cache.cells)
    _same(_generate(model, arch, ids, mask, cache, new=12), expected)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("blocks", [None, True], ids=["default", "vprec-blocks"])
def test_static_loopkv_self_speculative_lossless(arch, blocks):
    """Self-speculative decoding (drafts with fewer loops, rollback, verification blocks) over a static LoopKV cache
    at batch 1 (no holes): token-identical to greedy decoding. With `v_precision_blocks=True` the blocks read as
    decoding with V precision reads, so the tokens are those of greedy decoding over the same cache; by default
    (None) they read both planes, so the tokens are those of greedy decoding with V precision off (`tau=None`): only
    the drafts read with it."""
    model = _model(arch)
    ids, mask = _prompt(1, False)
    tau = 1.0 if blocks else None
    expected = _generate(model, arch, ids, mask, _cache(model, "kivi4-share", tau=tau), new=12).sequences
    cache = _cache(model, "kivi4-share", static=True, max_batch_size=1, max_cache_len=40, v_precision_blocks=blocks)
    got = model.generate(
        ids, attention_mask=mask, cache=cache, max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=0,
        custom_generate=hf_loopcache.self_speculative, draft_loops=1, block_size=3, **call_kwargs(arch),
    )  # fmt: skip
    assert torch.equal(got, expected)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["kivi4", "kivi4-share", "hand"])
@pytest.mark.parametrize("arch", ARCHS)
def test_captured_loopkv_decode_equals_eager_cuda(arch, name):
    """On CUDA, `generate` replays a captured one-token step of a static LoopKV cache (the Triton coded-attention
    kernel with device-side lengths, the page flush inside the graph, V precision counting): the same greedy tokens
    and logits as eager decoding of the same static cache (fp32, 40 new tokens: two page flushes of pages of 16), and
    the same V-precision counts. (Against the growable cache the fp32 logits differ by the reads' rounding, which a
    random model of this width amplifies; that equality is checked in fp64 on the CPU.)"""
    model = make_model(arch, **({"hidden_size": 256, "num_attention_heads": 2, "num_key_value_heads": 2} if arch == "ouro"
                                else {"n_embd": 256, "n_heads": 2})).float().cuda()  # fmt: skip
    layout = model.loop_layout
    assert layout.head_dim == 128  # the kernel's coded path needs D >= 64
    plan = loopkv_preset(layout, name, sink=4, window=8, page_size=16, group_size=32)
    ids, mask = (t.cuda() for t in _prompt(3, True, length=21))
    cache = LoopKVCache(model, plan, tau=14.0, static=True, max_batch_size=4, max_cache_len=96)
    stats = cache.track_v_precision()
    eager = _generate(model, arch, ids, mask, cache, new=40, disable_compile=True)
    eager_counts = stats.counts.clone()
    assert not cache.captured_steps()
    cache.reset()
    stats = cache.track_v_precision()
    captured = _generate(model, arch, ids, mask, cache, new=40)
    assert [step["batch"] for step in cache.captured_steps()] == [3]
    assert torch.equal(captured.sequences, eager.sequences)
    for a, b in zip(captured.logits, eager.logits):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-4)
    assert torch.equal(stats.counts, eager_counts)


@pytest.mark.parametrize("name", ["kivi4-share", "hand"])
def test_decode_step_values_shared_across_cells_once_per_forward(name):
    """The device values a static windowed cell computes for its read and flush (history ends, flush geometry, a
    shared cell's history) are made once per forward for every cell with the same sink, window, page and ring, and
    looked up by the rest (`read.memo`): one entry per kind of cell, not one per cell. The keys are tags of what the
    values depend on, never a tensor's address or identity (which `torch.compile` cannot hash on torch 2.11, and which
    a view made per cell would not share)."""
    model = _model("ouro")
    cache = _cache(model, name, static=True, max_batch_size=2, max_cache_len=32)
    ids, mask = _prompt(2, True)
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, cache=cache, **call_kwargs("ouro"))
        grown = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        model(input_ids=torch.tensor([[5], [7]]), attention_mask=grown, cache=cache, **call_kwargs("ouro"))
    (read,) = cache._read[1].values()
    kinds = {}
    for key in read.memo:
        if isinstance(key, tuple) and str(key[0]).startswith("static-"):
            kinds.setdefault(key[0], []).append(key)
    cells = [c for c in cache.cells if isinstance(c, (StaticCodedLayer, StaticCodedSharedLayer))]
    coded = [c for c in cells if isinstance(c, StaticCodedLayer)]
    assert len(cells) > 2 and len(coded) >= 2
    rings = {(type(c) is StaticCodedLayer, c.capacity) for c in cells}
    assert len(kinds["static-coded-geometry"]) == len({c.capacity for c in coded}) == 1
    assert len(kinds["static-row-ends"]) == 1 and len(kinds["static-effective"]) == 1
    if any(isinstance(c, StaticCodedSharedLayer) for c in cells):
        assert 1 <= len(kinds["static-shared-hist"]) <= len(rings)


@pytest.mark.parametrize("name", ["kivi4", "kivi4-share"])
@pytest.mark.parametrize("arch", ARCHS)
def test_static_loopkv_prompt_shorter_than_the_sink_fp64(arch, name):
    """A one-token prompt with a sink of 2: the first step reads a sink that is not full yet (its history and ring
    hold nothing); every logit of every step equals the growable cache's in fp64."""
    model = _model(arch).double()
    ids, mask = _prompt(2, False, length=1)
    expected = _generate(model, arch, ids, mask, _cache(model, name), new=12)
    got = _generate(model, arch, ids, mask, _cache(model, name, static=True, max_batch_size=2, max_cache_len=16), new=12)
    _same(got, expected, atol=1e-10)


@pytest.mark.parametrize("tau", [None, 1.0], ids=["both-planes", "vprec"])
@pytest.mark.parametrize("arch", ARCHS)
def test_static_loopkv_capacity_under_the_sink_fp64(arch, tau):
    """A static cache whose capacity (16 positions) is under the plan's sink (32): its sink buffer outlasts the
    padding mask, which the read must not index past (it did on the CPU path: `IndexError`); every logit equals the
    growable cache's in fp64, padded batch, with and without V precision."""
    model = _model(arch).double()
    ids, mask = _prompt(2, True, length=6)
    plan = loopkv_preset(model.loop_layout, "kivi4", sink=32, window=4, page_size=4, group_size=8)
    expected = _generate(model, arch, ids, mask, LoopKVCache(model, plan, tau=tau), new=8)
    static = LoopKVCache(model, plan, tau=tau, static=True, max_batch_size=2, max_cache_len=16)
    _same(_generate(model, arch, ids, mask, static, new=8), expected, atol=1e-10)


@torch.no_grad()
@pytest.mark.parametrize("name", ["kivi4-share", "ripe"])
def test_views_plan_the_window_without_the_rollback_reserve(monkeypatch, name):
    """Every static windowed cell hands `coded_attention` its ring with `window_reach` = the ring of a cell without a
    rollback reserve (`_capacity(0)`: LoopKV's coded cells `W + 2P`, shared cells `W + P`), also after
    self-speculation's reserve has grown the ring (for holes) well past it: the launcher plans the tail programs for
    the reach (`triton_ops.coded_attention.ops`), not for the ring."""
    from hf_loopcache.cache.layers import static_coded

    seen = []
    real = static_coded.coded_attention

    def record(query, view, **kwargs):
        seen.append(view)
        return real(query, view, **kwargs)

    monkeypatch.setattr(static_coded, "coded_attention", record)
    model = _model("ouro")
    ids, mask = _prompt(1, False)
    kw = dict(static=True, max_batch_size=1, max_cache_len=40)
    cache = _cache(model, "kivi4-share", **kw) if name != "ripe" else RIPECache(model, window=4, **kw)
    cache.set_max_rollback(3)
    _generate(model, "ouro", ids, mask, cache, new=3)
    cells = [c for c in cache.cells if isinstance(c, (StaticCodedLayer, StaticCodedSharedLayer))]
    assert seen and cells
    reaches = {c._capacity(0) for c in cells}
    assert all(v.window_reach in reaches and v.window_reach < v.ring_capacity for v in seen)
    assert {c.capacity for c in cells} != reaches  # the reserve's rings are longer
