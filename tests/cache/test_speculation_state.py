"""The cache state a draft and a rollback need, as explicit API: draft depth, per-loop lengths, rollback and the
rollback reserve (effective positions of rows with holes: tests/cache/test_read_path.py)."""

from __future__ import annotations

import pytest
import torch

from hf_loopcache import DeepestPlaneCache, FullLoopCache, LoopKVCache, RIPECache
from hf_loopcache.cache import loopkv_preset
from tests.helpers import call_kwargs, make_model

_SMALL_LOOPKV = dict(sink=2, window=4, page_size=4, group_size=16)
_CACHES = {
    "full": FullLoopCache,
    "ripe-W4": lambda m: RIPECache(m, window=4),
    "deepest-plane": DeepestPlaneCache,
    "loopkv-kivi4-share": lambda m: LoopKVCache(m, loopkv_preset(m.loop_layout, "kivi4-share", **_SMALL_LOOPKV)),
}


@torch.no_grad()
@pytest.mark.parametrize("cache_name", list(_CACHES))
def test_a_partial_depth_draft_shows_in_depth_and_loop_lengths_and_rolls_back_exactly(arch, cache_name):
    """Draft 3 tokens with d = 1 loop, roll back, then decode: the same logits as a cache that never drafted."""
    model = make_model(arch, **({"hidden_size": 64} if arch == "ouro" else {"n_embd": 64})).double()
    kw = call_kwargs(arch)
    loop_kw = model.draft_kwargs(1)
    ids = torch.randint(3, 60, (2, 14), generator=torch.Generator().manual_seed(0))
    spec, plain = _CACHES[cache_name](model), _CACHES[cache_name](model)
    spec.set_max_rollback(3)
    model(ids[:, :10], past_key_values=spec, use_cache=True, **kw)
    model(ids[:, :10], past_key_values=plain, use_cache=True, **kw)
    assert spec.draft_loops is None and spec.loop_lengths() == [10] * model.loop_layout.num_loops
    for t in range(10, 13):
        model(ids[:, t : t + 1], past_key_values=spec, use_cache=True, **loop_kw, **kw)
    assert spec.draft_loops == 1
    assert spec.loop_lengths() == [13] + [10] * (model.loop_layout.num_loops - 1)
    spec.rollback(10)
    assert spec.loop_lengths() == [10] * model.loop_layout.num_loops and spec.get_seq_length() == 10
    a = model(ids[:, 10:14], past_key_values=spec, use_cache=True, **kw).logits
    b = model(ids[:, 10:14], past_key_values=plain, use_cache=True, **kw).logits
    assert spec.draft_loops is None
    torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)


@torch.no_grad()
def test_rollback_beyond_the_reserve_is_not_exact_and_the_reserve_makes_it_exact():
    """RIPE W=1: a block of 4 rolled back by 3 needs the reserve (`set_max_rollback`), or the shallow planes of the
    kept positions were already dropped for the deepest plane's."""
    model = make_model("ouro").double()
    ids = torch.randint(3, 60, (1, 20), generator=torch.Generator().manual_seed(1))
    outs = {}
    for reserve in (0, 3):
        cache = RIPECache(model, window=1)
        cache.set_max_rollback(reserve)
        model(ids[:, :12], past_key_values=cache, use_cache=True)
        model(ids[:, 12:16], past_key_values=cache, use_cache=True)
        cache.rollback(13)
        outs[reserve] = model(ids[:, 13:16], past_key_values=cache, use_cache=True).logits
    seq = RIPECache(model, window=1)
    model(ids[:, :12], past_key_values=seq, use_cache=True)  # a prefill reads its own positions at full depth
    ref = torch.cat([model(ids[:, t : t + 1], past_key_values=seq, use_cache=True).logits for t in range(12, 16)], 1)
    ref = ref[:, 1:]
    torch.testing.assert_close(outs[3][:, :1], ref[:, :1], atol=1e-10, rtol=1e-10)
    assert (outs[0][:, :1] - ref[:, :1]).abs().max() > 1e-6


def test_rollback_and_reserve_validate_their_arguments():
    cache = FullLoopCache(make_model("ouro"))
    with pytest.raises(ValueError, match="`length` must be a non-negative int"):
        cache.rollback(-1)
    with pytest.raises(ValueError, match="max_rollback"):
        cache.set_max_rollback(-1)
