"""Static `LoopCache`: preallocated storage and device-side lengths, so a decode step can be compiled and captured.

Static greedy tokens equal the growable cache's (fp32, both architectures, batch 1 and a left-padded batch); the decode
forward compiles with `fullgraph=True` (no graph break: no host read of a device value); crop, reset, row selection
and self-speculative decoding work inside the static storage; on CUDA, `generate` replays a captured step.
"""

from __future__ import annotations

import functools

import pytest
import torch

import hf_loopcache
from hf_loopcache import DeepestPlaneCache, FullLoopCache, RIPECache, build_cache
from tests.helpers import call_kwargs, make_model, stand_in_graphs

ARCHS = ["ouro", "huginn"]
#: each cache's constructor, growable with no options and static with them; RIPE's window is short enough that the
#: tests read the deepest plane, the ring and the window boundary
CACHES = {
    "full": lambda model, **kw: FullLoopCache(model, **kw),
    "ripe3": lambda model, **kw: RIPECache(model, window=3, **kw),
    "deepest": lambda model, **kw: DeepestPlaneCache(model, **kw),
}


def _prompt(batch: int, padded: bool, length: int = 9, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 64, (batch, length), generator=g)
    mask = torch.ones_like(ids)
    if padded:
        mask[-1, :4] = 0
        ids[-1, :4] = 0
    return ids, mask


def _generate(model, arch, ids, mask, cache, new=8, **kwargs):
    return model.generate(
        ids, attention_mask=mask, cache=cache, max_new_tokens=new, min_new_tokens=new, do_sample=False,
        pad_token_id=0, **call_kwargs(arch), **kwargs,
    )


@pytest.mark.parametrize("name", sorted(CACHES))
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("batch,padded", [pytest.param(1, False, id="B1"), pytest.param(3, True, id="B3-leftpad")])
def test_static_greedy_equals_dynamic(arch, batch, padded, name):
    model = make_model(arch).float()
    ids, mask = _prompt(batch, padded)
    expected = _generate(model, arch, ids, mask, CACHES[name](model))
    cache = CACHES[name](model, static=True, max_batch_size=4, max_cache_len=24)
    assert cache.is_compileable
    got = _generate(model, arch, ids, mask, cache)
    assert torch.equal(got, expected)
    assert cache.get_seq_length() == ids.shape[1] + 7
    assert int(cache._length_t) == cache.get_seq_length()


def test_build_cache_static_option_and_storage():
    model = make_model("ouro").float()
    cache = build_cache(model, "full", static=True, max_batch_size=2, max_cache_len=16)
    assert cache.static and cache.get_max_cache_shape() == 16
    ids, mask = _prompt(2, True)
    _generate(model, "ouro", ids, mask, cache, new=3)
    layout = model.loop_layout
    k = cache.cells[0].k
    assert k.shape == (2, layout.num_kv_heads, 16, layout.head_dim)
    ptr = k.data_ptr()
    cache.reset()
    assert cache.get_seq_length() == 0 and int(cache._length_t) == 0
    again = _generate(model, "ouro", ids, mask, cache, new=3)  # a reset static cache keeps its storage
    assert cache.cells[0].k.data_ptr() == ptr
    assert torch.equal(again, _generate(model, "ouro", ids, mask, FullLoopCache(model), new=3))


@pytest.mark.parametrize(
    "arch,name,backend",
    [
        ("ouro", "full", "eager"),
        ("huginn", "full", "eager"),
        ("ouro", "ripe3", "aot_eager"),
        ("huginn", "deepest", "eager"),
    ],
)
def test_static_decode_step_compiles_fullgraph(arch, name, backend):
    """One decode forward under `torch.compile(fullgraph=True)`: any `.item()`, host branch on a device value or
    data-dependent shape would be a graph break (an error here); the logits equal the growable cache's."""
    torch._dynamo.reset()
    model = make_model(arch).float()
    ids, mask = _prompt(2, True)
    static = CACHES[name](model, static=True, max_batch_size=2, max_cache_len=16)
    ref = CACHES[name](model)
    kwargs = call_kwargs(arch)
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, cache=static, **kwargs)
        model(input_ids=ids, attention_mask=mask, cache=ref, **kwargs)
        step = torch.compile(model.forward, fullgraph=True, backend=backend)
        token = torch.tensor([[5], [7]])
        grown = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        out = step(input_ids=token, attention_mask=grown[:, -1:], cache=static, **kwargs)
        expected = model(input_ids=token, attention_mask=grown, cache=ref, **kwargs)
    torch.testing.assert_close(out.logits, expected.logits, rtol=1e-5, atol=1e-5)
    assert int(static._length_t) == ids.shape[1] + 1


@pytest.mark.parametrize("name", sorted(CACHES))
@pytest.mark.parametrize("arch", ARCHS)
def test_static_crop_then_continue(arch, name):
    """Crop inside the static storage (within the rollback reserve), then decode on: the same tokens as a growable
    cache cropped the same way."""
    model = make_model(arch).float()
    ids, mask = _prompt(2, True)
    outs = []
    make = CACHES[name] if name == "full" else (lambda model, **kw: CACHES[name](model, max_rollback=3, **kw))
    for cache in (make(model), make(model, static=True, max_batch_size=2, max_cache_len=32)):
        first = _generate(model, arch, ids, mask, cache, new=6)
        cache.crop(-3)
        assert cache.get_seq_length() == ids.shape[1] + 5 - 3
        keep = first[:, : cache.get_seq_length() + 1]
        grown = torch.cat([mask, torch.ones(2, keep.shape[1] - ids.shape[1], dtype=mask.dtype)], dim=1)
        outs.append(_generate(model, arch, keep, grown, cache, new=5))
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("arch,name", [("ouro", "full"), ("ouro", "ripe3"), ("huginn", "ripe3")])
def test_static_self_speculative_lossless(arch, name):
    """Draft with fewer loops, roll back, verify a block, leave holes: inside the static storage, token-identical to
    greedy decoding (RIPE with `W >= gamma`: Proposition 1)."""
    model = make_model(arch).float()
    ids, mask = _prompt(2, True)
    expected = _generate(model, arch, ids, mask, CACHES[name](model), new=10)
    cache = CACHES[name](model, static=True, max_batch_size=2, max_cache_len=40)
    got = _generate(
        model, arch, ids, mask, cache, new=10, custom_generate=hf_loopcache.self_speculative, draft_loops=1,
        block_size=3,
    )
    assert torch.equal(got, expected)


def test_static_beam_search_rows_in_place():
    model = make_model("ouro").float()
    ids, mask = _prompt(1, False)
    kw = dict(num_beams=3, max_new_tokens=5, do_sample=False, pad_token_id=0, attention_mask=mask)
    expected = model.generate(ids, cache=FullLoopCache(model), **kw)
    cache = FullLoopCache(model, static=True, max_batch_size=3, max_cache_len=16)
    assert torch.equal(model.generate(ids, cache=cache, **kw), expected)


def test_static_errors():
    model = make_model("ouro").float()
    with pytest.raises(ValueError, match="max_cache_len"):
        FullLoopCache(model, static=True, max_batch_size=2)
    with pytest.raises(ValueError, match="with `static=True`"):
        FullLoopCache(model, max_cache_len=16)
    with pytest.raises(ValueError, match="max_batch_size"):
        build_cache(model, "loopkv:kivi4", group_size=8, static=True, max_cache_len=16)
    ids, mask = _prompt(3, False)
    with pytest.raises(ValueError, match="max_batch_size=2"):
        _generate(model, "ouro", ids, mask, FullLoopCache(model, static=True, max_batch_size=2, max_cache_len=32))
    ids, mask = _prompt(1, False)
    with pytest.raises(ValueError, match="max_cache_len >= 16"):
        _generate(model, "ouro", ids, mask, FullLoopCache(model, static=True, max_batch_size=1, max_cache_len=12))


@pytest.mark.gpu
@pytest.mark.parametrize("read_method", ["sdpa", "kernel", "auto"])
@pytest.mark.parametrize("name", sorted(CACHES))
@pytest.mark.parametrize("arch", ARCHS)
def test_captured_decode_equals_eager_cuda(arch, name, read_method, monkeypatch):
    """On CUDA, `generate` replays a captured one-token step (per batch size) with the same greedy tokens as eager
    decoding of the static cache and of the growable cache (fp32), with either dense read (SDPA with the mask, or the
    Triton kernel up to the device-side length)."""
    from hf_loopcache.cache.layers.static import StaticDenseLayer

    monkeypatch.setattr(StaticDenseLayer, "read_method", read_method)
    model = make_model(arch).float().cuda()
    ids, mask = (t.cuda() for t in _prompt(3, True))
    expected = _generate(model, arch, ids, mask, CACHES[name](model), new=12)
    cache = CACHES[name](model, static=True, max_batch_size=4, max_cache_len=32)
    eager = _generate(model, arch, ids, mask, cache, new=12, disable_compile=True)
    assert not cache.captured_steps()
    cache.reset()
    captured = _generate(model, arch, ids, mask, cache, new=12)
    assert [step["batch"] for step in cache.captured_steps()] == [3]
    cache.reset()
    again = _generate(model, arch, ids, mask, cache, new=12)  # replays the graph captured above
    assert len(cache.captured_steps()) == 1
    assert torch.equal(eager, expected) and torch.equal(captured, expected) and torch.equal(again, expected)


@pytest.mark.parametrize("name", ["full", "ripe3"])
def test_static_read_methods_agree(monkeypatch, name):
    """Static reads as `scaled_dot_product_attention` with an additive mask (a shared cell over its source and ring
    concatenated), as `coded_attention` over the dense buffer up to its device-side length, and as `masked_attention`
    over the segments in place give the growable cache's tokens."""
    from hf_loopcache.cache.layers.static import StaticDenseLayer

    model = make_model("ouro").float()
    ids, mask = _prompt(3, True)
    expected = _generate(model, "ouro", ids, mask, CACHES[name](model))
    for method in ("sdpa", "kernel", "matmul", "auto"):
        monkeypatch.setattr(StaticDenseLayer, "read_method", method)
        cache = CACHES[name](model, static=True, max_batch_size=3, max_cache_len=24)
        assert torch.equal(_generate(model, "ouro", ids, mask, cache), expected)


def test_auto_dense_read_follows_how_full_the_storage_is(monkeypatch):
    """`read_method = "auto"` (the default) reads with the kernel on CUDA while the storage holds at most
    `LIVE_READ_SHARE` (2/3) of its positions after the forward, with cuDNN's SDPA beyond and on the CPU; a static
    cache's step mode, which keys its captured steps, says which, from the host length before the forward. A cell
    decides from the same inputs (its read's host length)."""
    from hf_loopcache.cache.layers import static
    from hf_loopcache.cache.layers.static import LIVE_READ_SHARE, StaticDenseLayer, dense_read

    assert StaticDenseLayer.read_method == "auto" and abs(LIVE_READ_SHARE - 2 / 3) < 1e-12
    assert dense_read("auto", 59, 1, 90, cuda=True) == "kernel"  # 60 of 90 held after the forward
    assert dense_read("auto", 60, 1, 90, cuda=True) == "sdpa"
    assert dense_read("auto", 55, 5, 90, cuda=True) == "kernel" and dense_read("auto", 56, 5, 90, cuda=True) == "sdpa"
    assert dense_read("auto", 1, 1, 90, cuda=False) == "sdpa"
    assert all(dense_read(m, 89, 1, 90, cuda=True) == m for m in ("sdpa", "kernel", "matmul"))
    model = make_model("ouro").float()
    ids, mask = _prompt(3, True)
    cache = FullLoopCache(model, static=True, max_batch_size=3, max_cache_len=15)
    model(ids, attention_mask=mask, cache=cache, use_cache=True)  # 9 positions held
    assert cache._step_mode(1, cuda=True) == (False, "kernel") and cache._step_mode(2, cuda=True) == (False, "sdpa")
    assert cache._step_mode(1, cuda=False) == (False, "sdpa")
    with cache.speculating():
        assert cache._step_mode(1, cuda=True) == (True, "kernel")
    seen = []
    monkeypatch.setattr(static, "dense_read", lambda *args: seen.append(args) or "sdpa")
    model(ids[:, :1], cache=cache, use_cache=True)
    assert {args[1:4] for args in seen} == {(9, 1, 15)}  # every dense cell: held before, new tokens, storage
    seen.clear()
    assert cache._step_mode(1, cuda=True) == (False, "sdpa") and seen == [("auto", 10, 1, 15, True)]  # asks a cell
    coded = build_cache(model, "loopkv:kivi4", static=True, max_batch_size=3, max_cache_len=15, group_size=8)
    assert coded._step_mode(1, cuda=True) == (False, "none")  # no dense cell: one mode whatever the length


@pytest.mark.parametrize("arch", ARCHS)
def test_static_ripe_ring_grows_with_the_rollback_reserve(arch):
    """`set_max_rollback` on a static RIPE cache that holds positions resizes every ring and keeps what it holds:
    decoding on, and cropping within the new reserve, match a growable RIPE cache given the same reserve."""
    from hf_loopcache.cache.layers.static import ring_capacity
    from hf_loopcache.cache.layers.static_coded import StaticCodedSharedLayer

    model = make_model(arch).float()
    ids, mask = _prompt(2, True)
    outs = []
    for cache in (RIPECache(model, window=3), RIPECache(model, window=3, static=True, max_batch_size=2, max_cache_len=40)):
        first = _generate(model, arch, ids, mask, cache, new=5)
        cache.set_max_rollback(4)
        keep = first
        grown = torch.cat([mask, torch.ones(2, keep.shape[1] - ids.shape[1], dtype=mask.dtype)], dim=1)
        second = _generate(model, arch, keep, grown, cache, new=6)
        cache.crop(-4)
        keep = second[:, : cache.get_seq_length() + 1]
        grown = torch.cat([mask, torch.ones(2, keep.shape[1] - ids.shape[1], dtype=mask.dtype)], dim=1)
        outs.append(_generate(model, arch, keep, grown, cache, new=4))
    rings = [layer for layer in cache.cells if isinstance(layer, StaticCodedSharedLayer)]
    assert rings and all(layer.capacity == ring_capacity(3, 1, 4) for layer in rings)
    assert torch.equal(outs[0], outs[1])


@functools.cache
def _fixture(name: str):
    model, tok = hf_loopcache.load_fixture(name)
    return model.float(), tok


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CACHES))
@pytest.mark.parametrize("fixture", ["tiny-ouro", "tiny-huginn"])
def test_static_greedy_equals_dynamic_on_the_fixtures(fixture, name):
    """The shipped (trained) fixtures, fp32, real text: a batch of one and a left-padded batch of three, 12 new
    tokens; RIPE's window (3) is short enough that the history is read from the deepest plane."""
    model, tok = _fixture(fixture)
    # Huginn at 4 recurrent steps (a call-time loop count; the caches are built for it) to keep the test short
    kwargs, loops = ({"init_scale": 0.0, "num_steps": 4}, {"num_loops": 4}) if fixture == "tiny-huginn" else ({}, {})
    tok.padding_side = "left"
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    for texts in (["The cat sat on the"], ["The cat sat on the", "Once upon a time there was a", "In the"]):
        enc = tok(texts, return_tensors="pt", padding=True)
        gen = dict(max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=pad, **kwargs)
        expected = model.generate(**enc, cache=CACHES[name](model, **loops), **gen)
        length = enc["input_ids"].shape[1] + 12
        cache = CACHES[name](model, static=True, max_batch_size=3, max_cache_len=length, **loops)
        assert torch.equal(model.generate(**enc, cache=cache, **gen), expected)


@pytest.mark.parametrize("name", ["full", "ripe3"])
@pytest.mark.parametrize("arch", ARCHS)
def test_decode_graphs_runner_with_a_replay_stand_in(monkeypatch, arch, name):
    """`generate`'s compiled call (`DecodeGraphs`) on the CPU with recording and replay stood in for: one recording
    per batch size, replays for every later step, a reset cache reuses its recordings, and the tokens equal eager
    decoding; the recording itself leaves the cache as it was."""
    from transformers import CompileConfig

    stand_in_graphs(monkeypatch)
    model = make_model(arch).float()
    config = CompileConfig()
    config._compile_all_devices = True  # transformers' switch to take the compiled call off CUDA
    cache = CACHES[name](model, static=True, max_batch_size=3, max_cache_len=32)
    for batch, padded in ((3, True), (1, False), (3, True)):
        ids, mask = _prompt(batch, padded, seed=batch)
        expected = _generate(model, arch, ids, mask, CACHES[name](model), new=9)
        cache.reset()
        got = _generate(model, arch, ids, mask, cache, new=9, compile_config=config)
        assert torch.equal(got, expected)
    assert sorted(step["batch"] for step in cache.captured_steps()) == [1, 3]
    replays = sorted(entry.graph.replays for entry in cache._graphs.values())
    assert replays == [7, 15]  # 9 tokens: prefill + 8 steps (the first recorded, 7 replays); B3 again: 8 replays


def test_static_shared_cell_reads_what_its_ring_lost_from_the_source():
    """A row whose window holds holes spans more storage positions than the ring: its real positions the ring no
    longer holds are read from the source (the deepest plane), the rest from the ring; checked against attention
    written out over exactly those keys."""
    from hf_loopcache.cache.layers.static import StaticDenseLayer, ring_capacity, static_mask
    from hf_loopcache.cache.layers.static_coded import StaticCodedSharedLayer
    from hf_loopcache.cache.read import ReadState

    torch.manual_seed(0)
    heads, dim, t = 2, 4, 20
    source = StaticDenseLayer(1, 32)
    cell = StaticCodedSharedLayer(source, sink=0, window=3, page_size=1, rollback=0, max_batch_size=1, max_cache_len=32)
    assert cell.capacity == ring_capacity(3, 1, 0) == 5
    src_k, src_v, own_k, own_v = (torch.randn(1, heads, t + 1, dim, dtype=torch.float64) for _ in range(4))
    source.attend(own_k[:, :, :t], src_k[:, :, :t], src_v[:, :, :t], ReadState(key_valid=None, scaling=1.0))
    cell.attend(own_k[:, :, :t], own_k[:, :, :t], own_v[:, :, :t], ReadState(key_valid=None, scaling=1.0))
    valid = torch.ones(1, 32, dtype=torch.bool)
    valid[0, [12, 13, 15, 16, 18, 19]] = False  # holes: the window's real positions 11, 14, 17 span 10 positions
    query = torch.randn(1, heads, 1, dim, dtype=torch.float64)
    positions = torch.tensor([t])
    read = ReadState(key_valid=valid, scaling=0.5, positions=positions, static_valid=valid,
                     static_mask=static_mask(positions, valid), length=t)
    out = cell.attend(query, own_k[:, :, t:], own_v[:, :, t:], read)
    # H = 11 in effective positions: storage 0..10 from the source; the ring (5 positions) holds 15..19 (and the new
    # token is 20), so the window's real 11 and 14 come from the source too, 17 and 20 from the ring
    keys = torch.cat([src_k[:, :, :16], own_k[:, :, 16:]], dim=2)
    values = torch.cat([src_v[:, :, :16], own_v[:, :, 16:]], dim=2)
    seen = valid[0, : t + 1].clone()
    seen[t] = True
    weights = torch.softmax((query @ keys.transpose(-1, -2) * 0.5).masked_fill(~seen, float("-inf")), dim=-1)
    torch.testing.assert_close(out, weights @ values)


def _cpu_fixed_shape_attention_lse(query, key, value, bias, *, scaling):
    """`fixed_shape_attention_lse` on the CPU (what cuDNN computes: SDPA with an additive bias, and its log-sum-exp)."""
    scores = (query @ key.transpose(-1, -2)).float() * scaling + bias.float()
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.softmax(scores, dim=-1).nan_to_num(0.0) @ value.float()
    return out.to(query.dtype), lse


def _wide_cuda_model(arch):
    """A random model on CUDA with heads of 128 (what cuDNN's SDPA and the kernel's tiles take), in fp32."""
    wide = {"hidden_size": 256, "num_attention_heads": 2, "num_key_value_heads": 2} if arch == "ouro" else {
        "n_embd": 256, "n_heads": 2}  # fmt: skip
    return make_model(arch, **wide).cuda()


def _split_floors_logits(model, arch, device, steps, draft=True):
    """Logits of a RIPE(3) static cache's one-token steps before and after a crop past the rings, run by `steps` (the
    model eagerly, or `DecodeGraphs`); also the cache. `draft`: the crop follows a one-loop draft, and the drafted
    plane's floors move to the cut while the others' stay at the sink; else every plane's floor moves."""
    from hf_loopcache.cache.layers import StaticCodedSharedLayer

    ids, mask = (t.to(device) for t in _prompt(2, True))
    kw = call_kwargs(arch)
    tokens = torch.randint(3, 64, (2, 12), generator=torch.Generator().manual_seed(3)).to(device)
    cache = RIPECache(model, window=3, static=True, max_batch_size=2, max_cache_len=40)
    model(input_ids=ids, attention_mask=mask, cache=cache, **kw)
    out = []

    def forward(i, **extra):
        nonlocal mask
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
        return steps(input_ids=tokens[:, i : i + 1], attention_mask=mask, past_key_values=cache, **extra, **kw)

    for i in range(4):
        out.append(forward(i).logits.float())
    length = cache.get_seq_length()
    for i in range(4, 7):  # drafts through the first loop only, or full steps
        forward(i, **({model.loop_kwarg: 1} if draft else {}))
    cut = length - 1 if draft else length - 2
    cache.rollback(cut)
    mask = mask[:, :cut]
    floors = {cell.floor for cell in cache.cells if isinstance(cell, StaticCodedSharedLayer)}
    assert floors == ({0, cut} if draft else {cut})  # a draft: its plane's rings were cut, the others' were not
    for i in range(7, 12):
        out.append(forward(i).logits.float())
    return torch.cat(out, 1), cache


@torch.no_grad()
@pytest.mark.parametrize("draft", [True, False], ids=["split", "moved"])
@pytest.mark.parametrize("arch", ARCHS)
def test_captured_shared_reads_after_a_crop_that_splits_the_floors(arch, draft, monkeypatch):
    """A shared cell's cuDNN read builds one history bias per forward for the cells of one geometry and floor
    (`_history_bias`, `read.memo`), so a captured step holds its bias for the cells whose floors were equal when it was
    recorded. A crop past the rings after a partial-depth draft moves the drafted plane's floors and not the others':
    the captured full step must then not replay one floor for both (the graph key holds which cells share a floor,
    `LoopCache._floor_groups`: a second step is recorded). A crop past every ring moves every floor above the sink,
    which a step recorded before skips (`_floored`): recorded again too. On the CPU with cuDNN's read and the graph
    replay stood in for: every step's logits equal the same cache run eagerly (without the key: 0.37 off)."""
    from hf_loopcache.cache.layers import static_coded
    from hf_loopcache.models._graphs import DecodeGraphs

    stand_in_graphs(monkeypatch)
    monkeypatch.setattr(static_coded, "fixed_shape_attention_takes", lambda query, key: True)
    monkeypatch.setattr(static_coded, "fixed_shape_attention_lse", _cpu_fixed_shape_attention_lse)
    model = make_model(arch).float()
    eager, _ = _split_floors_logits(model, arch, "cpu", functools.partial(model, **call_kwargs(arch)), draft)
    captured, cache = _split_floors_logits(model, arch, "cpu", DecodeGraphs(model), draft)
    split = [entry.graph.replays for key, entry in cache._graphs.items() if key[1] == 1 and key[5]]
    assert split and split[0] >= 3  # the full step recorded again for the split floors, and replayed
    torch.testing.assert_close(captured, eager, rtol=0, atol=0)


@torch.no_grad()
@pytest.mark.gpu
@pytest.mark.parametrize("arch", ARCHS)
def test_captured_shared_reads_after_a_crop_that_splits_the_floors_cuda(arch):
    """The same on CUDA in bf16 with cuDNN's read and real CUDA graphs: captured logits equal eager ones."""
    from hf_loopcache.models._graphs import DecodeGraphs

    model = _wide_cuda_model(arch).bfloat16()
    eager, _ = _split_floors_logits(model, arch, "cuda", functools.partial(model, **call_kwargs(arch)))
    captured, cache = _split_floors_logits(model, arch, "cuda", DecodeGraphs(model))
    assert any(key[5] for key in cache._graphs)
    torch.testing.assert_close(captured, eager, rtol=0, atol=0)


@pytest.mark.parametrize("arch", ARCHS)
def test_deepest_plane_step_reads_the_source_storage(arch, monkeypatch):
    """In a full forward (a one-token step, a verification block) a deepest-plane cell writes its new keys and values
    into its source's storage as well as its ring (one write) and is read by the source's own read
    (`StaticCodedSharedLayer._reads_whole_source`): every shared cell takes it at every decode step and block, and
    the logits equal, in fp64 over a left-padded batch, those of the read it replaces (`history_read = "kernel"`: the
    source's history and the ring and new tokens through `coded_attention`), with a hole in a row too; the source's
    own positions are what it wrote; drafts read as before."""
    from hf_loopcache.cache.layers.static_coded import StaticCodedSharedLayer

    model = make_model(arch).double()
    ids, mask = _prompt(3, True)
    taken = []
    real = StaticCodedSharedLayer._reads_whole_source
    monkeypatch.setattr(StaticCodedSharedLayer, "_reads_whole_source",
                        lambda self, q, read: taken.append(real(self, q, read)) or taken[-1])  # fmt: skip

    def run(history_read):
        monkeypatch.setattr(StaticCodedSharedLayer, "history_read", history_read)
        cache = DeepestPlaneCache(model, static=True, max_batch_size=3, max_cache_len=24)
        out = _generate(model, arch, ids, mask, cache, output_logits=True, return_dict_in_generate=True)
        return out, cache

    slow, slow_cache = run("kernel")
    assert not any(taken)
    taken.clear()
    fast, fast_cache = run("sdpa")
    shared = sum(isinstance(c, StaticCodedSharedLayer) for c in fast_cache.cells)
    assert shared > 0 and taken.count(True) == shared * 7  # 7 one-token steps after the prefill, every shared cell
    assert torch.equal(fast.sequences, slow.sequences)
    for a, b in zip(fast.logits, slow.logits):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-10)
    for a, b in zip(fast_cache.cells, slow_cache.cells):
        if not isinstance(a, StaticCodedSharedLayer):  # the sources: the same positions stored
            n = a.get_seq_length()
            torch.testing.assert_close(a._views()[0][:, :, :n], b._views()[0][:, :, :n], rtol=0, atol=1e-10)
    # drafts (two loops: the source does not run) read as before: their source holds no new position
    taken.clear()
    logits = {}
    for history_read in ("kernel", "sdpa"):
        monkeypatch.setattr(StaticCodedSharedLayer, "history_read", history_read)
        cache = DeepestPlaneCache(model, static=True, max_batch_size=3, max_cache_len=24)
        cache.set_max_rollback(3)
        with torch.no_grad():
            model(ids, attention_mask=mask, past_key_values=cache, use_cache=True, **call_kwargs(arch))
            grown, steps = mask, []
            for t in range(3):
                grown = torch.cat([grown, torch.ones_like(grown[:, :1])], dim=1)
                out = model(ids[:, t : t + 1], attention_mask=grown, past_key_values=cache, use_cache=True,
                            **model.draft_kwargs(2), **call_kwargs(arch))  # fmt: skip
                steps.append(out.logits)
        logits[history_read] = torch.cat(steps, dim=1)
    assert not any(taken)
    torch.testing.assert_close(logits["sdpa"], logits["kernel"], rtol=0, atol=1e-10)
    # verification blocks (full forwards of 3 tokens, the second with a hole in a row): read by the source's read too
    for history_read in ("kernel", "sdpa"):
        monkeypatch.setattr(StaticCodedSharedLayer, "history_read", history_read)
        taken.clear()
        logits[history_read] = _deepest_block_logits(model, arch, ids, mask)
        assert taken.count(True) == (2 * shared if history_read == "sdpa" else 0)
    torch.testing.assert_close(logits["sdpa"], logits["kernel"], rtol=0, atol=1e-10)


@torch.no_grad()
def _deepest_block_logits(model, arch, ids, mask):
    """Logits of two verification blocks of 3 tokens over a static deepest-plane cache after the prompt; in the second
    block row 1 has rejected the first block's last token (a hole)."""
    cache = DeepestPlaneCache(model, static=True, max_batch_size=3, max_cache_len=24)
    cache.set_max_rollback(3)
    model(ids, attention_mask=mask, past_key_values=cache, use_cache=True, **call_kwargs(arch))
    grown, steps = torch.cat([mask, torch.ones_like(mask[:, :3])], dim=1), []
    steps.append(model(ids[:, 2:5], attention_mask=grown, past_key_values=cache, **call_kwargs(arch)).logits)
    grown = torch.cat([grown, torch.ones_like(mask[:, :3])], dim=1)
    grown[1, -4] = 0  # row 1 rejected the last token of the first block
    steps.append(model(ids[:, 5:8], attention_mask=grown, past_key_values=cache, **call_kwargs(arch)).logits)
    return torch.cat(steps, dim=1).float()


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ARCHS)
def test_deepest_plane_blocks_read_the_source_storage_cuda(arch, monkeypatch):
    """On CUDA, a deepest-plane verification block read by the source's read (the kernel over the source's storage
    and the block) against the read it replaces: equal within fp32 rounding in fp32, and in bf16 no further from
    the fp32 result than twice the replaced read's error."""
    from hf_loopcache.cache.layers.static_coded import StaticCodedSharedLayer

    model = _wide_cuda_model(arch)
    ids, mask = (t.cuda() for t in _prompt(3, True))
    logits = {}
    for dtype in (torch.float32, torch.bfloat16):
        model.to(dtype)
        for whole in (False, True):
            monkeypatch.setattr(StaticCodedSharedLayer, "whole_source", whole)
            logits[dtype, whole] = _deepest_block_logits(model, arch, ids, mask)
    exact = logits[torch.float32, False]
    torch.testing.assert_close(logits[torch.float32, True], exact, rtol=0, atol=1e-4)
    err = {whole: (logits[torch.bfloat16, whole] - exact).abs().max().item() for whole in (False, True)}
    assert err[True] <= 2 * err[False] + 1e-3, err


def test_decode_graphs_fall_back_to_eager_when_capture_fails(monkeypatch):
    """A step that cannot be captured (an op CUDA graphs refuse) decodes eagerly, with the same tokens, and is not
    tried again for that batch size."""
    from transformers import CompileConfig

    from hf_loopcache.models._graphs import DecodeGraphs

    tries = []

    def refuse(self, fn, cache):
        tries.append(1)  # a failed recording has run nothing on the device
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(DecodeGraphs, "_capturable", lambda self, ids: True)
    monkeypatch.setattr(DecodeGraphs, "_warm_up", lambda self, fn: fn())
    monkeypatch.setattr(DecodeGraphs, "_record", refuse)
    model = make_model("ouro").float()
    config = CompileConfig()
    config._compile_all_devices = True
    ids, mask = _prompt(2, True)
    cache = FullLoopCache(model, static=True, max_batch_size=2, max_cache_len=24)
    got = _generate(model, "ouro", ids, mask, cache, new=6, compile_config=config)
    assert torch.equal(got, _generate(model, "ouro", ids, mask, FullLoopCache(model), new=6))
    assert tries == [1] and cache.captured_steps() == []


@pytest.mark.parametrize("name", ["full", "ripe3"])
def test_static_cache_builds_where_transformers_has_read_only_max_properties(monkeypatch, name):
    """transformers 5.17's `Cache` has read-only `max_batch_size` / `max_cache_len` properties (gone in 5.24): a static
    cache and its layers must not assign attributes of those names (seen on the GPU machine)."""
    from transformers.cache_utils import Cache, CacheLayerMixin

    for cls in (Cache, CacheLayerMixin):
        for attr in ("max_batch_size", "max_cache_len"):
            monkeypatch.setattr(cls, attr, property(lambda self: None), raising=False)
    model = make_model("ouro").float()
    ids, mask = _prompt(2, True)
    cache = CACHES[name](model, static=True, max_batch_size=2, max_cache_len=24)
    assert (cache.max_batch_size, cache.max_cache_len) == (2, 24)
    assert torch.equal(_generate(model, "ouro", ids, mask, cache), _generate(model, "ouro", ids, mask, CACHES[name](model)))


def _teacher_forced_logits(model, arch, cache, ids, mask, tokens):
    """Logits of the prefill and of one-token steps that feed `tokens` (the same inputs whatever the cache reads)."""
    kw = call_kwargs(arch)
    with torch.no_grad():
        out = [model(input_ids=ids, attention_mask=mask, cache=cache, **kw).logits[:, -1:]]
        for i in range(tokens.shape[1]):
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
            out.append(model(input_ids=tokens[:, i : i + 1], attention_mask=mask, cache=cache, **kw).logits)
    return torch.cat(out, 1).float()


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["ripe3", "deepest", "deepest-whole"])
@pytest.mark.parametrize("arch", ARCHS)
def test_shared_cells_read_a_bf16_source_through_cudnn_cuda(arch, kind, monkeypatch):
    """On CUDA in bf16, a static RIPE / deepest-plane cache's shared cells read their source's history with cuDNN
    (`StaticCodedSharedLayer.history_read = "sdpa"`: `fixed_shape_attention_lse`, merged into the kernel's read of
    the sink, ring and new token by `coded_attention`'s `prior`; `deepest-whole`: the deepest plane's one-token steps
    read by the source's own read instead, `whole_source`, and never that merge): against the same cache in fp32
    (the kernel path), its logits err at most twice as much as the all-kernel path's in bf16, over a left-padded
    batch and a window that moves; and `generate`'s captured steps take that path and give its eager tokens. The
    source reads by cuDNN (`read_method = "sdpa"`): under `"auto"` these 33 of 64 positions are the kernel's (below)."""
    from hf_loopcache.cache.layers import StaticCodedSharedLayer, StaticDenseLayer, static_coded

    monkeypatch.setattr(StaticCodedSharedLayer, "whole_source", kind == "deepest-whole")
    monkeypatch.setattr(StaticDenseLayer, "read_method", "sdpa")
    merged = kind != "deepest-whole"

    model = _wide_cuda_model(arch)
    ids, mask = (t.cuda() for t in _prompt(2, True, length=21))
    tokens = torch.randint(3, 64, (2, 12), generator=torch.Generator().manual_seed(5)).cuda()
    kw = dict(static=True, max_batch_size=2, max_cache_len=64)

    def make():
        return RIPECache(model, window=3, **kw) if kind == "ripe3" else DeepestPlaneCache(model, **kw)

    calls, wrapped = [], static_coded.fixed_shape_attention_lse

    def counted(*args, **kwargs):  # the cuDNN reads that ran (None: not taken)
        got = wrapped(*args, **kwargs)
        calls.extend([] if got is None else [1])
        return got

    monkeypatch.setattr(static_coded, "fixed_shape_attention_lse", counted)
    exact = _teacher_forced_logits(model.float(), arch, make(), ids, mask, tokens)
    assert not calls  # fp32: the kernel path
    logits = {}
    for read in ("kernel", "sdpa"):
        monkeypatch.setattr(StaticCodedSharedLayer, "history_read", read)
        logits[read] = _teacher_forced_logits(model.bfloat16(), arch, make(), ids, mask, tokens)
    assert bool(calls) == merged
    err = {read: (got - exact).abs().max().item() for read, got in logits.items()}
    assert err["sdpa"] <= 2 * err["kernel"] + 1e-3, err
    calls.clear()
    eager = _generate(model, arch, ids, mask, make(), new=12, disable_compile=True)
    cache = make()
    captured = _generate(model, arch, ids, mask, cache, new=12)
    assert cache.captured_steps() and bool(calls) == merged
    assert torch.equal(captured, eager)
    monkeypatch.setattr(StaticDenseLayer, "read_method", "auto")  # a storage at most 2/3 full: the kernel, no merge
    calls.clear()
    _teacher_forced_logits(model, arch, make(), ids, mask, tokens)
    assert not calls
