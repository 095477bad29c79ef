"""The host side of a replayed decode step (`DecodeGraphs.__call__`): the output it builds, the key validity it
copies from a full mask, and the host lengths it advances, on the CPU with the stand-in graphs of `tests.helpers`."""

from __future__ import annotations

import pytest
import torch
from transformers.modeling_outputs import CausalLMOutputWithPast

import hf_loopcache._compat as compat
from hf_loopcache import FullLoopCache
from hf_loopcache.models._graphs import DecodeGraphs
from tests.helpers import stand_in_graphs, tiny_ouro


def test_causal_lm_output_equals_the_constructor():
    logits = torch.randn(2, 1, 8)
    slow = CausalLMOutputWithPast(logits=logits, **{compat.OUTPUT_CACHE_FIELD: "cache"})
    compat.causal_lm_output(logits, "cache")  # the first call checks the fast build against the constructor
    assert compat._fast_output is True  # on the supported releases the fast build is taken
    fast = compat.causal_lm_output(logits, "cache")
    assert type(fast) is CausalLMOutputWithPast
    assert list(fast.items()) == list(slow.items()) and vars(fast) == vars(slow)
    assert fast.to_tuple() == slow.to_tuple() and fast[0] is logits and fast["logits"] is logits
    assert fast.loss is None and getattr(fast, compat.OUTPUT_CACHE_FIELD) == "cache"


def test_causal_lm_output_takes_the_constructor_when_the_fast_build_differs(monkeypatch):
    monkeypatch.setattr(compat, "_fast_output", None)
    monkeypatch.setattr(compat, "_causal_lm_output_fast", lambda logits, cache: CausalLMOutputWithPast(logits=logits))
    logits = torch.randn(1, 1, 4)
    for _ in range(2):
        out = compat.causal_lm_output(logits, "cache")
        assert getattr(out, compat.OUTPUT_CACHE_FIELD) == "cache"
    assert compat._fast_output is False


def _decode(model, cache, ids, masks, call):
    out = []
    with torch.no_grad():
        model(ids, attention_mask=masks[0][:, : ids.shape[1]], cache=cache, use_cache=True)
        for mask in masks:
            step = torch.full((ids.shape[0], 1), 5)
            out.append(call(input_ids=step, attention_mask=mask, cache=cache, use_cache=True).logits)
    return out


def test_replayed_steps_copy_a_full_masks_holes_and_advance_every_cell(monkeypatch):
    """A full mask with a hole in an earlier column (as a caller's batched verification hands it) reaches the key
    validity of a replayed step: the logits equal an eager decode's with the same masks, and every cell's host length
    advances by one per step."""
    stand_in_graphs(monkeypatch)
    model = tiny_ouro()
    ids = torch.randint(3, 60, (2, 6), generator=torch.Generator().manual_seed(0))
    masks, mask = [], torch.ones(2, 6, dtype=torch.long)
    for t in range(6):
        mask = torch.cat([mask, mask.new_ones(2, 1)], 1)
        if t == 3:
            mask = mask.clone()
            mask[1, 7] = 0  # an earlier position of row 1 becomes a hole
        masks.append(mask)
    cache = FullLoopCache(model, static=True, max_batch_size=2, max_cache_len=16)
    replayed = _decode(model, cache, ids, masks, DecodeGraphs(model))
    assert [e.graph.replays for e in cache._graphs.values()] == [5]  # a warm-up, then replays
    assert cache._host_lengths() == [12] * len(cache.cells)
    assert torch.equal(cache._valid_t[:, :12], masks[-1].bool())
    eager = _decode(model, FullLoopCache(model, static=True, max_batch_size=2, max_cache_len=16), ids, masks, model)
    for a, b in zip(replayed, eager):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    solid = [m.clone().fill_(1) for m in masks]  # (the hole changes row 1's logits: the test can see a lost copy)
    plain = _decode(model, FullLoopCache(model, static=True, max_batch_size=2, max_cache_len=16), ids, solid, model)
    assert torch.equal(plain[3][0], eager[3][0]) and not torch.allclose(plain[3][1], eager[3][1])


def test_a_full_step_with_cells_that_disagree_is_not_replayed(monkeypatch):
    """A captured step that writes every cell replays only while all cells hold the same positions; after a draft
    that was not rolled back (the deeper loops' cells hold fewer) the call runs eagerly, which names the problem."""
    stand_in_graphs(monkeypatch)
    model = tiny_ouro()
    ids = torch.randint(3, 60, (1, 6), generator=torch.Generator().manual_seed(0))
    cache = FullLoopCache(model, static=True, max_batch_size=1, max_cache_len=16)
    call = DecodeGraphs(model)
    _decode(model, cache, ids, [torch.ones(1, 7 + t, dtype=torch.long) for t in range(3)], call)
    (entry,) = cache._graphs.values()
    assert entry.writes_all and entry.graph.replays == 2
    eager, replays = [], []
    monkeypatch.setattr(call, "model", lambda *a, **kw: eager.append(kw) or model(*a, **kw))
    monkeypatch.setattr(entry.graph, "replay", lambda replay=entry.graph.replay: replays.append(1) or replay())
    deepest = model.loop_layout.num_loops - 1
    for layer in (cache.layer_for(cell) for cell in model.loop_layout.core_cells(deepest)):
        layer.length -= 1  # as a one-token draft of the shallower loops leaves them
    with pytest.raises(ValueError, match="roll a partial-depth draft back"):
        call(input_ids=torch.full((1, 1), 5), attention_mask=torch.ones(1, 10, dtype=torch.long), cache=cache, use_cache=True)
    assert not replays and len(eager) == 1
