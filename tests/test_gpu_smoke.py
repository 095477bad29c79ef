"""GPU smoke test (`make test-gpu`, `pytest -m gpu`): both native models generate on CUDA through the full cache and a
compressed one, with the full cache equal to no cache; skipped without a CUDA device (tests/conftest.py)."""

from __future__ import annotations

import pytest
import torch

from hf_loopcache import FullLoopCache, LoopKVCache, RIPECache
from hf_loopcache.cache import loopkv_preset
from tests.helpers import call_kwargs, make_model

DEVICE = "cuda"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_generate_on_cuda(arch, dtype):
    model = make_model(arch).to(DEVICE, dtype)
    ids = torch.randint(3, 60, (2, 37), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, **call_kwargs(arch))
    plain = model.generate(ids, use_cache=False, **kw)
    full_cache = FullLoopCache(model)
    full = model.generate(ids, cache=full_cache, **kw)
    if dtype == torch.float32:
        assert torch.equal(full, plain)
    plan = loopkv_preset(model.loop_layout, "kivi4-share", sink=4, window=8, page_size=8, group_size=8)
    for cache in (RIPECache(model, window=4), LoopKVCache(model, plan)):
        out = model.generate(ids, cache=cache, **kw)
        assert out.shape == plain.shape and out.device.type == DEVICE
        assert cache.get_seq_length() == full_cache.get_seq_length() == 42
        assert cache.stored_bytes() < full_cache.stored_bytes()
