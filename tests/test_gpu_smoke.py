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


@pytest.mark.gpu
def test_self_speculative_on_cuda_matches_sequential_and_skips_cudnn(arch, monkeypatch):
    """Greedy self-speculation on CUDA (fp64, so both runs agree to the last bit whatever kernels they take; full
    cache, left-padded batch) equals plain greedy `generate`, and no attention call with cached positions (decode,
    draft, verification) may pick the cuDNN backend, which rebuilds its graph for every new key length."""
    from torch.nn.attention import SDPBackend

    from hf_loopcache import attention, self_speculative

    model = make_model(arch).to(DEVICE, torch.float64)
    ids = torch.randint(3, 60, (2, 21), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    ids[1, :4] = 0
    mask = (ids != 0).long()
    kw = dict(max_new_tokens=9, do_sample=False, pad_token_id=0, attention_mask=mask, **call_kwargs(arch))
    chosen: list[list[SDPBackend]] = []
    kernel = attention.sdpa_kernel
    monkeypatch.setattr(attention, "sdpa_kernel", lambda backends: chosen.append(backends) or kernel(backends))
    ref = model.generate(ids, past_key_values=FullLoopCache(model), **kw)
    out = model.generate(
        ids,
        past_key_values=FullLoopCache(model),
        custom_generate=self_speculative,
        draft_loops=model.loop_layout.num_loops - 1,
        block_size=3,
        **kw,
    )
    assert torch.equal(out, ref)
    assert chosen and all(SDPBackend.CUDNN_ATTENTION not in b for b in chosen)
