"""What one self-speculative forward costs, counted structurally on the CPU (no timing): the eager decode step is
launch-bound on a GPU, so the aten ops a forward dispatches are its cost there.

- A verification forward (`gamma + 1` tokens after cached positions, all loops) dispatches about as many ops as a
  one-token decode forward: no per-query loop, no prefill-style or reference fallback for `q > 1`.
- Without holes, dense-cell attention of a verification hands SDPA no mask tensor (a lower-right `CausalBias`), so on
  CUDA it runs the flash kernel a decode step runs; a bool mask sent every dense verification call to a masked
  backend and made a FullLoopCache verification cost 3.9 decode steps on an H200 (issue #16).
- A draft forward with `d` of `R` loops costs at most its share of layer passes (RIPE Eq. 8's `c(d)/c(R)`) plus a
  small margin: no fixed per-forward overhead beyond the layers.
"""

from __future__ import annotations

import collections
import types

import pytest
import torch
from torch.nn.attention.bias import CausalBias
from torch.profiler import ProfilerActivity, profile

from hf_loopcache import FullLoopCache, RIPECache, attention
from tests.helpers import call_kwargs, make_model

GAMMA = 4
_CACHES = {
    "full": lambda m: FullLoopCache(m),
    "ripe-W=gamma": lambda m: RIPECache(m, window=GAMMA),
}


def _setup(arch: str, cache_name: str, loops: int):
    loop_kwarg = {"mean_recurrence": loops} if arch == "huginn" else {"total_ut_steps": loops}
    model = make_model(arch, **loop_kwarg)
    cache = _CACHES[cache_name](model)
    ids = torch.randint(3, 60, (1, 24), generator=torch.Generator().manual_seed(0))
    kwargs = call_kwargs(arch)
    model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1, **kwargs)
    return model, cache, ids, kwargs


def _forward(model, cache, ids, kwargs, q: int, loops: int | None = None):
    n = cache.get_seq_length()
    mask = torch.ones(1, n + q, dtype=torch.long)
    extra = model.draft_kwargs(loops) if loops is not None else {}
    model(
        input_ids=ids[:, :q],
        attention_mask=mask,
        past_key_values=cache,
        use_cache=True,
        logits_to_keep=q,
        **kwargs,
        **extra,
    )
    cache.rollback(n)


def _aten_ops(fn) -> int:
    fn()  # warm: lazy allocations and first-call paths stay out of the count
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return sum(1 for e in prof.events() if e.name.startswith("aten::"))


@torch.no_grad()
@pytest.mark.parametrize("cache_name", list(_CACHES))
@pytest.mark.parametrize("arch", ["huginn", "ouro"])
def test_verification_forward_costs_about_one_decode_forward(arch, cache_name):
    model, cache, ids, kwargs = _setup(arch, cache_name, loops=8)
    decode = _aten_ops(lambda: _forward(model, cache, ids, kwargs, 1))
    verify = _aten_ops(lambda: _forward(model, cache, ids, kwargs, GAMMA + 1))
    assert verify <= 1.15 * decode, f"a verification forward dispatches {verify} aten ops, a decode forward {decode}"


@torch.no_grad()
@pytest.mark.parametrize("cache_name", list(_CACHES))
@pytest.mark.parametrize("arch", ["huginn", "ouro"])
def test_draft_forward_costs_its_share_of_layer_passes(arch, cache_name):
    loops, draft = 8, 2
    model, cache, ids, kwargs = _setup(arch, cache_name, loops=loops)
    layout = model.loop_layout
    passes = lambda r: layout.n_prelude + r * layout.n_core + layout.n_coda  # noqa: E731
    full = _aten_ops(lambda: _forward(model, cache, ids, kwargs, 1))
    partial = _aten_ops(lambda: _forward(model, cache, ids, kwargs, 1, loops=draft))
    share = passes(draft) / passes(loops)
    assert partial <= (share + 0.1) * full, f"draft {partial} ops, decode {full} ops, layer-pass share {share:.3f}"


@torch.no_grad()
@pytest.mark.parametrize("arch", ["huginn", "ouro"])
def test_dense_verification_hands_sdpa_no_mask_tensor(arch, monkeypatch):
    model, cache, ids, kwargs = _setup(arch, "full", loops=4)
    masks: collections.Counter[str] = collections.Counter()
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(query, key, value, attn_mask=None, *args, **kw):
        if attn_mask is None:
            masks["none"] += 1
        elif isinstance(attn_mask, CausalBias):
            masks["causal-bias"] += 1
        else:
            masks["tensor"] += 1
        return sdpa(query, key, value, attn_mask, *args, **kw)

    # patch the name `hf_loopcache.attention` calls, not torch's own (CausalBias dispatches on torch's function)
    monkeypatch.setattr(attention, "F", types.SimpleNamespace(scaled_dot_product_attention=spy))
    _forward(model, cache, ids, kwargs, GAMMA + 1)
    assert masks["tensor"] == 0 and masks["causal-bias"] == model.loop_layout.num_cells, dict(masks)
    masks.clear()
    _forward(model, cache, ids, kwargs, 1)
    assert masks == {"none": model.loop_layout.num_cells}, dict(masks)


def test_decode_shaped_attention_leaves_cudnn_out_and_keeps_the_callers_choices():
    """cuDNN builds a graph per key length; calls with cached positions use the other backends the caller enabled."""
    from torch.nn.attention import SDPBackend

    from hf_loopcache.attention import _backends_without_cudnn

    assert _backends_without_cudnn() == [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    flash = torch.backends.cuda.flash_sdp_enabled()
    try:
        torch.backends.cuda.enable_flash_sdp(False)
        assert _backends_without_cudnn() == [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    finally:
        torch.backends.cuda.enable_flash_sdp(flash)


@torch.no_grad()
def test_plain_function_reserves_the_cache_so_no_cell_regrows(monkeypatch):
    """`self_speculative_generate` reserves the cache as `generate` does: a full-precision cell's storage is
    allocated at the prefill for every position a row can write, so at batch 1 no decode step copies a cell's history
    into a larger buffer (a one-off cost a short sequential baseline would carry more of than a long one). In a batch,
    positions the slowest row lacks (holes) can take the cache past that, and it grows as usual."""
    from hf_loopcache import self_speculative_generate
    from hf_loopcache.cache.storage import SeqBuffer

    allocations: list[int] = []
    append = SeqBuffer.append

    def spy(buf, k, v):
        before = buf.k
        append(buf, k, v)
        if buf.k is not before:
            allocations.append(buf.k.shape[2])

    monkeypatch.setattr(SeqBuffer, "append", spy)
    model = make_model("huginn")
    cache = FullLoopCache(model)
    ids = torch.randint(3, 60, (1, 300), generator=torch.Generator().manual_seed(0))
    self_speculative_generate(
        model,
        ids,
        draft_loops=2,
        block_size=GAMMA,
        max_new_tokens=20,
        cache=cache,
        forced_acceptance=0.7,
        generator=torch.Generator().manual_seed(0),
        **call_kwargs("huginn"),
    )
    assert cache.get_seq_length() >= 300 + 19
    assert allocations == [300 + 20] * len(cache.cells), (len(allocations), len(cache.cells), set(allocations))


@torch.no_grad()
@pytest.mark.parametrize("cache_name", ["full", "ripe-W=gamma"])
@pytest.mark.parametrize("arch", ["huginn", "ouro"])
def test_a_batch_with_holes_builds_its_masks_and_boundaries_once_per_forward(arch, cache_name, monkeypatch):
    """Rows that accepted different lengths leave holes; the hole-aware pieces a forward needs are the same for every
    cell of it, so they are built once per forward, not once per cell: the dense cells' boolean mask, and the
    windowed cells' per-row read boundaries (with their one host read). Per cell they cost a batch-8 verification on
    Huginn-0125's shape about 1.1-1.2 decode steps in the eager path on the H200 (issue #16, `v` of the v2 table)."""
    from hf_loopcache.cache.layers import windowed

    loop_kwarg = {"mean_recurrence": 4} if arch == "huginn" else {"total_ut_steps": 4, "num_hidden_layers": 4}
    model = make_model(arch, **loop_kwarg)
    cache = _CACHES[cache_name](model)
    ids = torch.randint(3, 60, (3, 16), generator=torch.Generator().manual_seed(0))
    kwargs = call_kwargs(arch)
    mask = torch.ones(3, 16 + 3 + GAMMA + 1, dtype=torch.long)
    model(input_ids=ids, attention_mask=mask[:, :16], past_key_values=cache, use_cache=True, **kwargs)
    model(input_ids=ids[:, :3], attention_mask=mask[:, :19], past_key_values=cache, use_cache=True, **kwargs)
    mask[1:, 17:19] = 0  # rows 1 and 2 rejected the last two positions of that block: holes
    calls: collections.Counter[str] = collections.Counter()
    padding_mask, searchsorted = attention.causal_padding_mask, torch.searchsorted

    def count(name, fn):
        def spy(*args, **kw):
            calls[name] += 1
            return fn(*args, **kw)

        return spy

    monkeypatch.setattr(attention, "causal_padding_mask", count("dense mask", padding_mask))
    monkeypatch.setattr(windowed.torch, "searchsorted", count("row boundaries", searchsorted))
    model(input_ids=ids[:, : GAMMA + 1], attention_mask=mask, past_key_values=cache, use_cache=True, **kwargs)
    dense = sum(1 for layer in cache.cells if type(layer).__name__ == "DenseLayer")
    assert dense > 2 and calls["dense mask"] == 1, dict(calls)
    if cache_name != "full":
        shared = sum(1 for layer in cache.cells if type(layer).__name__ == "SharedLayer")
        assert shared > 2 and calls["row boundaries"] <= 3, dict(calls)  # read ends, keep boundary: not per cell
