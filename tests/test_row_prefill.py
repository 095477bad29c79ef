"""A prefill in groups of rows (`prefill_rows`) stores and returns what a prefill of the whole batch at once does, for
every cache of the engine (growable and static) on both native models, with left padding and a group size that does
not divide the batch; each group's forward sees only its rows (the prefill's activations are one group's)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from benchmarks.bench_generate import CACHES
from hf_loopcache import FullLoopCache, LoopCache
from hf_loopcache.cache.layers import WindowedLayer
from tests.helpers import call_kwargs, tiny_huginn, tiny_ouro

B, T, NEW = 5, 160, 4  # 160 positions: every group (>= 2 rows) and the batch take the same paths (> STACK_TOKENS)
NAMES = ["full", "ripe64", "deepest", "kivi4", "kivi4-share", "hand"]


def make_model(arch: str):
    """Head dim 32 (a coded cell's value group)."""
    if arch == "ouro":
        return tiny_ouro(hidden_size=128, intermediate_size=128, num_attention_heads=4, num_key_value_heads=4)
    return tiny_huginn(n_embd=128, n_heads=4, intermediate_size=128, block_size=256)


def _inputs(model, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, model.config.vocab_size, (B, T), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, :37] = 0  # left padding in the first group and in the last (a row of its own)
    mask[4, :90] = 0
    ids[mask == 0] = 0
    return ids, mask


def _cache(name: str, model, static: bool):
    """The preset's plan; LoopKV's sink and window shrunk (4 and 32) so that the prompt's pages are coded."""
    plan = CACHES[name](model).plan
    if plan.window > 64:
        plan = dataclasses.replace(plan, sink=4, window=32)
    kwargs = dict(static=True, max_batch_size=B + 1, max_cache_len=T + NEW + 8) if static else {}
    return LoopCache(model, plan, **kwargs)


def _contents(cache) -> list[torch.Tensor]:
    """What every cell holds, as the next query reads it (codes decoded), its key validity, and the byte counts."""
    out: list[torch.Tensor] = [torch.tensor([cache.get_seq_length(), cache.stored_bytes(), cache.nbytes()])]
    for flat, layer in enumerate(cache.cells):
        if layer.get_seq_length() == 0:
            continue
        k, v = cache.cell_states(cache.layout.cell_at(flat))
        out += [k[:B], v[:B]]
        if isinstance(layer, WindowedLayer) and layer._valid is not None:
            out.append(layer._valid[:B])
    if cache.static:
        out.append(cache._valid_t[:B])
    return out


def _assert_same(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.shape == w.shape, f"entry {i}: {tuple(g.shape)} vs {tuple(w.shape)}"
        assert torch.equal(g, w), f"entry {i} differs by {(g.float() - w.float()).abs().max()}"


@pytest.mark.parametrize("static", [False, True], ids=["growable", "static"])
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("arch", ["ouro", "huginn"])
@torch.no_grad()
def test_groups_store_and_return_what_the_batch_does(arch, name, static):
    """Groups of 2 rows (2 + 2 + 1) against the whole batch: the same logits and the same cache contents bit for bit
    (fp32 on the CPU: every op of a row's forward is computed the same way whatever the other rows), then the same
    greedy tokens when `generate` decodes from each cache."""
    model = make_model(arch)
    ids, mask = _inputs(model)
    kwargs = call_kwargs(arch)
    whole_cache, group_cache = _cache(name, model, static), _cache(name, model, static)
    for cache in (whole_cache, group_cache):
        cache.reserve(T + NEW)  # as `generate` does
    whole = model(ids, attention_mask=mask, cache=whole_cache, use_cache=True, **kwargs)
    grouped = model(ids, attention_mask=mask, cache=group_cache, use_cache=True, prefill_rows=2, **kwargs)
    assert grouped.logits.shape == whole.logits.shape
    assert torch.equal(grouped.logits, whole.logits)
    _assert_same(_contents(group_cache), _contents(whole_cache))

    outs = []
    for rows in (None, 2):
        cache = _cache(name, model, static)
        outs.append(
            model.generate(ids, attention_mask=mask, cache=cache, max_new_tokens=NEW, do_sample=False,
                           prefill_rows=rows, pad_token_id=0, **kwargs)  # fmt: skip
        )
    assert torch.equal(outs[1], outs[0])


@pytest.mark.parametrize("arch", ["ouro", "huginn"])
@torch.no_grad()
def test_each_group_forward_sees_only_its_rows(arch):
    """Every block call of a grouped prefill runs at most `prefill_rows` rows (the transient is one group's); decode
    steps run the whole batch; the default (None) runs the batch at once."""
    model = make_model(arch)
    ids, mask = _inputs(model)
    seen: list[tuple[int, int]] = []
    blocks = model.model.layers if arch == "ouro" else model.transformer["core_block"]
    hooks = [b.register_forward_pre_hook(lambda m, args: seen.append(tuple(args[0].shape[:2]))) for b in blocks]
    try:
        model.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False, prefill_rows=3, pad_token_id=0,
                       **call_kwargs(arch))  # fmt: skip
        prefill = [rows for rows, q in seen if q == T]
        decode = [rows for rows, q in seen if q == 1]
        assert prefill and max(prefill) <= 3 and sorted(set(prefill)) == [2, 3]  # groups of 3 and 2 rows
        assert decode and set(decode) == {B}
        seen.clear()
        model.generate(ids, attention_mask=mask, max_new_tokens=1, do_sample=False, pad_token_id=0, **call_kwargs(arch))
        assert {rows for rows, q in seen if q == T} == {B}
    finally:
        for h in hooks:
            h.remove()


@pytest.mark.parametrize("value", [0, -1, 1.5, True, "2"])
def test_bad_prefill_rows_are_rejected(value):
    model = make_model("ouro")
    ids = torch.randint(3, 60, (3, 8))
    with pytest.raises(ValueError, match=r"`prefill_rows` must be None .* or a positive int"):
        model(ids, prefill_rows=value)


@torch.no_grad()
def test_grouped_prefill_needs_a_loop_cache_and_no_labels():
    from transformers import DynamicCache

    model = make_model("huginn")
    ids = torch.randint(3, 60, (3, 8))
    with pytest.raises(ValueError, match="LoopCache"):
        model(ids, cache=DynamicCache(), use_cache=True, prefill_rows=1)
    with pytest.raises(ValueError, match="labels"):
        model(ids, labels=ids, prefill_rows=1)


@pytest.mark.parametrize("arch", ["ouro", "huginn"])
@torch.no_grad()
def test_grouped_prefill_without_cache_and_after_cached_positions(arch):
    """Without a cache the groups' outputs are joined (hidden states too); a forward after cached positions (a
    continued prompt) runs in one call and gives the same result."""
    model = make_model(arch)
    kwargs = call_kwargs(arch)
    ids, mask = _inputs(model)
    whole = model(ids, attention_mask=mask, use_cache=False, output_hidden_states=True, **kwargs)
    grouped = model(ids, attention_mask=mask, use_cache=False, output_hidden_states=True, prefill_rows=4, **kwargs)
    assert torch.equal(grouped.logits, whole.logits)
    assert len(grouped.hidden_states) == len(whole.hidden_states)
    assert all(torch.equal(g, w) for g, w in zip(grouped.hidden_states, whole.hidden_states))
    caches = [FullLoopCache(model), FullLoopCache(model)]
    for cache, rows in zip(caches, (None, 2)):
        model(ids[:, :100], attention_mask=mask[:, :100], cache=cache, use_cache=True, prefill_rows=rows, **kwargs)
    more = [
        model(ids[:, 100:], attention_mask=mask, cache=cache, use_cache=True, prefill_rows=rows, **kwargs).logits
        for cache, rows in zip(caches, (None, 2))
    ]
    assert torch.equal(more[1], more[0])


@pytest.mark.parametrize("arch", ["ouro", "huginn"])
@torch.no_grad()
def test_grouped_prefill_workspace_does_not_grow_with_the_batch(arch, monkeypatch):
    """Live tensor bytes beyond the cache (`benchmarks.memtrack.LiveBytes`) of a `generate` whose prefill runs in
    groups of one row, at 2 and 4 rows: per row, about nothing (the logits of one position); the whole batch at once
    holds 3-5 hidden states per row and prompt token more."""
    import hf_loopcache.models._common as common
    from benchmarks.memtrack import LiveBytes

    monkeypatch.setattr(common, "TOKEN_CHUNK", 256)
    model = make_model(arch)
    length, hidden = 512, 128
    state = length * hidden * 4
    held: dict = {}
    for rows in (None, 1):
        for batch in (2, 4):
            ids = torch.randint(3, model.config.vocab_size, (batch, length))
            cache = CACHES["ripe64"](model)
            with LiveBytes() as mem:
                model.generate(ids, attention_mask=torch.ones_like(ids), cache=cache, max_new_tokens=2,
                               do_sample=False, pad_token_id=0, prefill_rows=rows, **call_kwargs(arch))  # fmt: skip
            held[rows, batch] = (mem.peak - cache.nbytes()) / state
    grouped = (held[1, 4] - held[1, 2]) / 2
    whole = (held[None, 4] - held[None, 2]) / 2
    assert grouped <= 0.1, f"a grouped prefill holds {grouped:.2f} hidden states per row"
    assert whole >= grouped + 2.5, f"the whole batch holds {whole:.2f} hidden states per row, grouped {grouped:.2f}"


@torch.no_grad()
def test_huginn_generate_prefill_computes_no_latent_states():
    """`generate` returns no latent states, so its prefill does not compute them (one hidden state per prompt token and
    row); a forward still returns them by default, and decode steps keep their inputs as they are."""
    model = make_model("huginn")
    ids = torch.randint(3, 60, (2, 12))
    calls: list = []
    handle = model.register_forward_pre_hook(
        lambda m, args, kwargs: calls.append((kwargs["input_ids"].shape[1], kwargs.get("output_details"))),
        with_kwargs=True,
    )
    try:
        model.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=0, init_scale=0.0)
    finally:
        handle.remove()
    assert calls[0] == (12, {"return_latents": False})
    assert all(details is None for _, details in calls[1:]) and len(calls) == 3
    assert model(ids, init_scale=0.0).latent_states.shape == (2, 12, 128)


@pytest.mark.parametrize("arch", ["ouro", "huginn"])
@torch.no_grad()
def test_grouped_prefill_under_self_speculation_and_beam_search(arch):
    """Self-speculative decoding (which sets the cache's rollback reserve after `generate` reserved it: the groups'
    cells are sized as the whole cache's were) and beam search (rows expanded before the prefill) give the tokens of
    a whole-batch prefill."""
    import hf_loopcache
    from hf_loopcache import RIPECache

    model = make_model(arch)
    kwargs = call_kwargs(arch)
    ids, mask = _inputs(model)
    ids, mask = ids[:, -40:], mask[:, -40:]
    spec = [
        model.generate(ids, attention_mask=mask, cache=RIPECache(model, window=8), max_new_tokens=6, do_sample=False,
                       pad_token_id=0, custom_generate=hf_loopcache.self_speculative, draft_loops=1, block_size=3,
                       prefill_rows=rows, **kwargs)  # fmt: skip
        for rows in (None, 2)
    ]
    assert torch.equal(spec[1], spec[0])
    beams = [
        model.generate(ids, attention_mask=mask, num_beams=2, max_new_tokens=4, do_sample=False, pad_token_id=0,
                       prefill_rows=rows, **kwargs)  # fmt: skip
        for rows in (None, 3)
    ]
    assert torch.equal(beams[1], beams[0])


@torch.no_grad()
def test_row_groups_name_what_does_not_fit():
    """The cache side's errors: a static cache with fewer rows than the batch, a first group into a cache that holds
    positions."""
    model = make_model("ouro")
    ids = torch.randint(3, 60, (5, 8))
    static = FullLoopCache(model, static=True, max_batch_size=3, max_cache_len=32)
    with pytest.raises(ValueError, match="max_batch_size=3"):
        model(ids, cache=static, use_cache=True, prefill_rows=2)
    cache = FullLoopCache(model)
    model(ids, cache=cache, use_cache=True)
    with pytest.raises(ValueError, match="fills an empty cache, but this one holds 8 positions"):
        cache.row_group(0, 2, 5)
