"""The native read path: a cell hands `coded_attention` views of what it stores (its own codes, its source's codes
or BF16 plane), never decoded history; the read state is an argument (drafts, holes, V-precision counts)."""

from __future__ import annotations

import pytest
import torch

import hf_loopcache.cache.layers.windowed as windowed
from hf_loopcache import DeepestPlaneCache, LoopKVCache, RIPECache
from hf_loopcache.cache import CodedLayer, DenseLayer, SharedLayer
from hf_loopcache.cache.plan import loopkv_preset
from hf_loopcache.cache.read import effective_positions
from tests.helpers import call_kwargs, make_model
from triton_ops.quant import QuantizedKeys

PLAN = {"sink": 4, "window": 8, "page_size": 8, "group_size": 16}


@pytest.fixture(autouse=True)
def _threads():
    torch.set_num_threads(1)


def _model(arch, dtype=torch.float32):
    return make_model(arch, **({"hidden_size": 64} if arch == "ouro" else {"n_embd": 64})).to(dtype)


def _ids(length, seed=0):
    return torch.randint(3, 60, (1, length), generator=torch.Generator().manual_seed(seed))


def _loops(arch, n):
    return {"num_loops": n} if arch == "ouro" else {"num_steps": n}


def _storage(layer):
    """Data pointers of the buffers a cell's history lives in (its own pages, or its source's pages or buffer)."""
    owner = layer.source if isinstance(layer, SharedLayer) else layer
    if isinstance(owner, CodedLayer):
        return owner.pages.qk.codes.untyped_storage().data_ptr(), owner.pages.qv.hi.untyped_storage().data_ptr()
    return owner.buf.k.untyped_storage().data_ptr(), owner.buf.v.untyped_storage().data_ptr()


def _spy_views(monkeypatch):
    """Record every (cell layer, CellView, storage pointers at the time) that reaches coded_attention."""
    seen = []
    real_view = windowed.WindowedLayer.view

    def view(self, key, value, read):
        v = real_view(self, key, value, read)
        seen.append((self, v, _storage(self)))
        return v

    monkeypatch.setattr(windowed.WindowedLayer, "view", view)
    return seen


@torch.no_grad()
@pytest.mark.parametrize("preset", ["kivi4-share", "hand"])
def test_cells_hand_over_stored_codes_and_never_decode_history(arch, preset, monkeypatch):
    model = _model(arch)
    cache = LoopKVCache(model, loopkv_preset(model.loop_layout, preset, **PLAN))
    kw = call_kwargs(arch)
    model(_ids(50), past_key_values=cache, use_cache=True, **kw)
    seen = _spy_views(monkeypatch)

    def no_decode(*args, **kwargs):
        raise AssertionError("the read path decoded history codes")

    monkeypatch.setattr(windowed, "dequantize_keys", no_decode)
    monkeypatch.setattr(windowed, "dequantize_values", no_decode)
    model(_ids(1, seed=1), past_key_values=cache, use_cache=True, **kw)
    kinds = set()
    for layer, view, storage in seen:
        assert isinstance(view.history_key, QuantizedKeys)  # every windowed cell of a LoopKV plan reads codes
        owner = layer.source if isinstance(layer, SharedLayer) else layer
        assert isinstance(owner, CodedLayer)
        # the codes are the owner's page buffers themselves (a shared cell passes its source's), not a copy
        assert (
            view.history_key.codes.untyped_storage().data_ptr(),
            view.history_value.hi.untyped_storage().data_ptr(),
        ) == storage
        assert view.history_nbits == owner.nbits
        kinds.add((type(layer).__name__, owner.nbits))
    assert ("SharedLayer", 4) in kinds and ("CodedLayer", 4) in kinds
    if preset == "hand" and model.loop_layout.num_loops > 3:  # INT2 in the middle loops
        assert ("CodedLayer", 2) in kinds


@torch.no_grad()
def test_ripe_shared_cells_read_the_deepest_plane_in_place(arch, monkeypatch):
    model = _model(arch)
    cache = RIPECache(model, window=3)
    kw = call_kwargs(arch)
    model(_ids(20), past_key_values=cache, use_cache=True, **kw)
    seen = _spy_views(monkeypatch)
    model(_ids(1, seed=1), past_key_values=cache, use_cache=True, **kw)
    assert seen
    for layer, view, storage in seen:
        assert isinstance(layer, SharedLayer) and isinstance(layer.source, DenseLayer)
        assert isinstance(view.history_key, torch.Tensor) and view.history_key.dtype == torch.float32
        # a view of the source's buffer (no copy, no fp32 upcast of a bf16 plane)
        assert (
            view.history_key.untyped_storage().data_ptr(),
            view.history_value.untyped_storage().data_ptr(),
        ) == storage
        assert int(view.history_end.max()) == 20 - 3  # RIPE Eq. 9: the query at 20 reads j < 20 - W from history


@torch.no_grad()
@pytest.mark.parametrize("kind", ["ripe", "deepest", "kivi4-share"])
def test_a_partial_depth_draft_rolled_back_leaves_the_cache_as_if_it_never_ran(arch, kind):
    """Draft `k` tokens with fewer loops, roll back, verify the block at full depth: the logits and every cell's
    states equal a cache that only verified (fp64). The draft's shared cells keep what their source lacks."""
    model = _model(arch, torch.float64)
    layout = model.loop_layout
    kw = call_kwargs(arch)

    def build():
        if kind == "ripe":
            return RIPECache(model, window=4, max_rollback=5)
        if kind == "deepest":  # W = 0: the drafting shared cells must keep what the final loop has not written
            return DeepestPlaneCache(model)
        return LoopKVCache(model, loopkv_preset(layout, kind, **PLAN), max_rollback=5)

    ids = _ids(40 + 5, seed=2)
    drafted, plain = build(), build()
    for cache in (drafted, plain):
        model(ids[:, :40], past_key_values=cache, use_cache=True, **kw)
    for t in range(40, 44):  # four draft tokens with two loops
        model(ids[:, t : t + 1], past_key_values=drafted, use_cache=True, **kw, **_loops(arch, 2))
        assert drafted.draft_loops == 2
    deep = drafted.layer_for(layout.source_cell(next(c for c in layout.core_cells() if c.loop == 0)))
    assert deep.get_seq_length() == 40  # the final loop was not written by the draft
    drafted.rollback(40)
    a = model(ids[:, 40:45], past_key_values=drafted, use_cache=True, **kw).logits
    b = model(ids[:, 40:45], past_key_values=plain, use_cache=True, **kw).logits
    assert drafted.draft_loops is None
    torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)
    for cell in layout.cells():
        for x, y in zip(drafted.cell_states(cell), plain.cell_states(cell)):
            torch.testing.assert_close(x, y, atol=1e-10, rtol=1e-10)
    assert drafted.stored_bytes() == plain.stored_bytes()


def test_effective_positions_leave_holes_out_but_not_left_padding():
    valid = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 0, 1, 1], [1, 1, 1, 1, 1]], dtype=torch.bool)
    eff = effective_positions(valid)
    assert eff.tolist() == [[0, 1, 2, 3, 4, 5], [0, 1, 2, 2, 3, 4], [0, 1, 2, 3, 4, 5]]
    assert effective_positions(valid[[0, 2]]) is None  # left padding only: positions are storage indices
    assert effective_positions(None) is None


@torch.no_grad()
def test_a_row_with_a_hole_reads_like_the_row_without_it(arch):
    """Batched verification leaves holes (rejected tokens of one row, kept in storage); with per-row boundaries in
    effective positions, RIPE reads a row with a hole exactly as the same row without it (fp64)."""
    model = _model(arch, torch.float64)
    kw = call_kwargs(arch)
    x = _ids(20, seed=5)[0]
    junk = torch.tensor([7])
    row_a = torch.cat([torch.tensor([0]), x])  # left padded by one
    row_b = torch.cat([x[:18], junk, x[18:]])  # a hole at storage position 18, inside the window of what follows
    ids = torch.stack([row_a, row_b])
    mask = torch.ones_like(ids)
    mask[0, 0] = 0
    mask[1, 18] = 0
    cache = RIPECache(model, window=3)
    out = model(ids, attention_mask=mask, past_key_values=cache, use_cache=True, **kw).logits
    torch.testing.assert_close(out[0, 1:], out[1, torch.arange(21) != 18], atol=1e-10, rtol=1e-10)
    for step, tok in enumerate([11, 12, 13, 14, 15]):
        mask = torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], 1)
        new = torch.full((2, 1), tok)
        out = model(new, attention_mask=mask, past_key_values=cache, use_cache=True, **kw).logits
        torch.testing.assert_close(out[0], out[1], atol=1e-10, rtol=1e-10, msg=f"decode step {step}")


@torch.no_grad()
def test_v_precision_counts_accumulate_on_the_device(arch):
    model = _model(arch)
    kw = call_kwargs(arch)
    cache = LoopKVCache(model, loopkv_preset(model.loop_layout, "kivi4", **PLAN), tau=1.0)
    counts = cache.track_v_precision()
    model(_ids(40), past_key_values=cache, use_cache=True, **kw)
    assert counts["history"] == 0  # a prefill reads no history
    model(_ids(1, seed=1), past_key_values=cache, use_cache=True, **kw)
    layout = model.loop_layout
    history = (40 - PLAN["sink"] - PLAN["window"]) // PLAN["page_size"] * PLAN["page_size"] - PLAN["sink"] + 4
    heads = model.config.num_attention_heads if arch == "ouro" else model.config.n_heads
    assert counts["history"] == layout.num_cells * heads * history
    assert 0 < counts["cold"] < counts["history"]
    assert dict(counts) == {"cold": counts["cold"], "history": counts["history"]}


@torch.no_grad()
def test_reserved_storage_is_never_regrown(arch):
    model = _model(arch)
    kw = call_kwargs(arch)
    cache = LoopKVCache(model, loopkv_preset(model.loop_layout, "kivi4-share", **PLAN))
    cache.reserve(64)
    model(_ids(30), past_key_values=cache, use_cache=True, **kw)
    coded = next(layer for layer in cache.cells if isinstance(layer, CodedLayer))
    pointers = (coded.pages.qk.codes.data_ptr(), coded.recent.k.data_ptr())
    allocated = cache.nbytes()
    for t in range(30, 64):
        model(_ids(1, seed=t), past_key_values=cache, use_cache=True, **kw)
    assert (coded.pages.qk.codes.data_ptr(), coded.recent.k.data_ptr()) == pointers
    assert cache.nbytes() == allocated


@torch.no_grad()
@pytest.mark.parametrize("rollback", [0, 5, 13])
def test_stored_bytes_with_a_rollback_reserve_follow_the_plan(arch, rollback):
    """A coded cell holds the pages that left the window as codes and its last `W + rollback` positions at full
    precision (the reserve is held both ways); `CachePlan.expected_stored_bytes(length, rollback)` says so."""
    model = _model(arch, torch.bfloat16)  # the plan counts 2 bytes per full-precision element
    plan = loopkv_preset(model.loop_layout, "kivi4-share", **PLAN)
    cache = LoopKVCache(model, plan, max_rollback=rollback)
    kw = call_kwargs(arch)
    model(_ids(30), past_key_values=cache, use_cache=True, **kw)
    for t in range(30, 70):
        model(_ids(1, seed=t), past_key_values=cache, use_cache=True, **kw)
        assert cache.stored_bytes() == plan.expected_stored_bytes(t + 1, rollback), t
    model(_ids(6, seed=99), past_key_values=cache, use_cache=True, **kw)  # a block
    assert cache.stored_bytes() == plan.expected_stored_bytes(76, rollback)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@torch.no_grad()
@pytest.mark.parametrize("kind", ["ripe", "kivi4", "kivi4-share", "hand"])
def test_the_cuda_read_path_equals_the_reference_op(arch, kind, monkeypatch):
    """On CUDA the cells hand their views to `coded_attention` (the Triton kernels). Every call of a run (prefill,
    decode steps with V precision, a verification block, a crop within the rollback reserve and a block after it) is
    checked against the reference op on the same view (fp32, no TF32), and the kernels must have taken the calls.
    (Whole-run logits are not compared: a random tiny model amplifies the ops' fp32 rounding through its loops to
    about 1e-3 at the last position, on the kernels' CPU interpreter as on the GPU.)"""
    from triton_ops.coded_attention import coded_attention, reference_coded_attention
    from triton_ops.coded_attention.ops import _kernel_supports

    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    kw = call_kwargs(arch)
    ids = _ids(70, seed=6).cuda()
    # head_dim 64 and pages of 16: shapes the kernels take (smaller ones fall back to the reference)
    model = make_model(arch, **({"hidden_size": 256} if arch == "ouro" else {"n_embd": 256})).cuda()
    plan_sizes = {"sink": 4, "window": 16, "page_size": 16, "group_size": 16}
    kernel_calls = []

    def checked(query, view, *, scaling, v_precision_tau=None, v_precision_stats=None):
        out, lse = coded_attention(
            query, view, scaling=scaling, v_precision_tau=v_precision_tau, v_precision_stats=v_precision_stats
        )
        ref, ref_lse = reference_coded_attention(query, view, scaling=scaling, v_precision_tau=v_precision_tau)
        torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(lse, ref_lse, atol=1e-4, rtol=1e-4)
        kernel_calls.append(_kernel_supports(query, view, v_precision_tau) is None)
        return out, lse

    monkeypatch.setattr(windowed, "coded_attention", checked)
    if kind == "ripe":
        cache = RIPECache(model, window=4, max_rollback=5)
    else:
        cache = LoopKVCache(model, loopkv_preset(model.loop_layout, kind, **plan_sizes), tau=2.0, max_rollback=5)
    model(ids[:, :50], past_key_values=cache, use_cache=True, **kw)
    for t in range(50, 60):
        model(ids[:, t : t + 1], past_key_values=cache, use_cache=True, **kw)
    model(ids[:, 60:66], past_key_values=cache, use_cache=True, **kw)
    cache.crop(-3)
    model(ids[:, 63:70], past_key_values=cache, use_cache=True, **kw)
    assert kernel_calls and all(kernel_calls)
