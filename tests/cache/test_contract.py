"""The transformers Cache contract on every preset: lengths, mask sizes, crop conventions, batch operations, reset."""

from __future__ import annotations

import pytest
import torch

from hf_loopcache import CachePlan, FullLoopCache, LoopCache, LoopKVCache, RIPECache
from tests.helpers import call_kwargs, make_model


def _caches(model):
    plan = CachePlan.from_rule(
        model.loop_layout,
        lambda c: "share" if c.stage == "core" and c.loop == 0 else "int4",
        sink=2,
        window=4,
        page_size=4,
        group_size=8,
    )
    return {
        "full": FullLoopCache(model),
        "ripe": RIPECache(model, window=3),
        "loopkv": LoopKVCache(model, plan),
    }


@pytest.fixture(params=["full", "ripe", "loopkv"])
def kind(request):
    return request.param


@torch.no_grad()
def test_lengths_mask_sizes_and_flags(arch, kind):
    model = make_model(arch)
    cache = _caches(model)[kind]
    assert cache.get_seq_length() == 0 and cache.batch_size == -1
    model(torch.randint(3, 60, (2, 11)), cache=cache, use_cache=True, **call_kwargs(arch))
    assert cache.get_seq_length() == 11 and cache.batch_size == 2
    assert cache.get_mask_sizes(3, 0) == (14, 0)
    assert cache.get_mask_sizes(torch.arange(11, 14), 0) == (14, 0)  # transformers <= 5.0 passed cache_position
    assert cache.is_croppable and not cache.is_compileable
    assert cache.get_max_length() == -1
    assert not any(cache.is_sliding)
    cache.activate_past_recording()  # accepted, nothing to do


@torch.no_grad()
def test_batch_operations_match_a_cache_built_for_the_selected_rows(arch, kind):
    model = make_model(arch)
    kw = call_kwargs(arch)
    ids = torch.randint(3, 60, (3, 13), generator=torch.Generator().manual_seed(0))
    nxt = torch.randint(3, 60, (3, 1), generator=torch.Generator().manual_seed(1))

    def logits_after(op, rows):
        cache = _caches(model)[kind]
        model(ids, cache=cache, use_cache=True, **kw)
        op(cache)
        return model(nxt[rows], cache=cache, use_cache=True, **kw).logits

    def fresh(rows):
        cache = _caches(model)[kind]
        model(ids[rows], cache=cache, use_cache=True, **kw)
        return model(nxt[rows], cache=cache, use_cache=True, **kw).logits

    rows = torch.tensor([2, 0])
    torch.testing.assert_close(
        logits_after(lambda c: c.batch_select_indices(rows), rows), fresh(rows), atol=1e-5, rtol=1e-5
    )
    rows = torch.tensor([1, 1, 0, 2])
    torch.testing.assert_close(logits_after(lambda c: c.reorder_cache(rows), rows), fresh(rows), atol=1e-5, rtol=1e-5)
    rows = torch.tensor([0, 0, 1, 1, 2, 2])
    torch.testing.assert_close(
        logits_after(lambda c: c.batch_repeat_interleave(2), rows), fresh(rows), atol=1e-5, rtol=1e-5
    )


@torch.no_grad()
def test_reset_empties_every_cell(arch, kind):
    model = make_model(arch)
    cache = _caches(model)[kind]
    ids = torch.randint(3, 60, (1, 9))
    first = model(ids, cache=cache, use_cache=True, **call_kwargs(arch)).logits
    cache.reset()
    assert cache.get_seq_length() == 0 and cache.stored_bytes() == 0
    again = model(ids, cache=cache, use_cache=True, **call_kwargs(arch)).logits
    torch.testing.assert_close(first, again)


def test_crop_conventions():
    model = make_model("ouro")
    cache = LoopCache(model)
    with torch.no_grad():
        model(torch.randint(3, 60, (1, 10)), cache=cache, use_cache=True)
    cache.crop(0)
    assert cache.get_seq_length() == 10
    cache.crop(-3)  # transformers >= 5.16: remove 3
    assert cache.get_seq_length() == 7
    cache.crop(5)  # older releases: keep 5
    assert cache.get_seq_length() == 5
    assert all(layer.get_seq_length() == 5 for layer in cache.cells)
