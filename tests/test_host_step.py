"""The host side of a decode step: what transformers' `generate` loop reads from our cache and processor at every step
answers as transformers' own code would, only faster (`benchmarks/bench_host_step.py --generate` times it)."""

from __future__ import annotations

import inspect

import pytest
import torch
from transformers.cache_utils import Cache
from transformers.generation import LogitsProcessorList

from hf_loopcache import DeepestPlaneCache, FullLoopCache, LoopKVCache, RIPECache
from hf_loopcache.cache import loopkv_preset
from hf_loopcache.models._common import _NonFiniteLogits
from tests.helpers import call_kwargs, make_model


def _kivi4(model):
    return loopkv_preset(model.loop_layout, "kivi4-share", sink=2, window=4, page_size=4, group_size=8)


CACHES = {
    "full": lambda model, **kw: FullLoopCache(model, **kw),
    "ripe3": lambda model, **kw: RIPECache(model, window=3, **kw),
    "deepest": lambda model, **kw: DeepestPlaneCache(model, **kw),
    "kivi4": lambda model, **kw: LoopKVCache(model, _kivi4(model), tau=14.0, **kw),
}


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("name", sorted(CACHES))
@pytest.mark.parametrize("arch", ["ouro", "huginn"])
def test_is_linear_is_transformers_answer(arch, name, static):
    """`LoopCache.is_linear` (a list of `False`) equals transformers' `Cache.is_linear` (every layer tested against
    the linear-attention classes), before and after a forward."""
    model = make_model(arch)
    kw = {"static": True, "max_batch_size": 1, "max_cache_len": 16} if static else {}
    cache = CACHES[name](model, **kw)
    assert cache.is_linear == Cache.is_linear.fget(cache)
    with torch.no_grad():
        model(torch.randint(3, 60, (1, 5)), past_key_values=cache, use_cache=True, **call_kwargs(arch))
    assert cache.is_linear == Cache.is_linear.fget(cache)
    assert len(cache.is_linear) == len(cache.layers)


def test_non_finite_monitor_one_sum_per_step_across_blocks():
    """The monitor names the first step whose scores held NaN or +inf, past the first block of slots; -inf alone is
    not reported; the processor list reads its two-parameter signature and calls it."""
    monitor = _NonFiniteLogits()
    params = inspect.signature(monitor.__call__).parameters
    assert list(params) == ["input_ids", "scores"]
    processors = LogitsProcessorList([monitor])
    scores = torch.zeros(2, 8)
    scores[:, 0] = float("-inf")
    for step in range(monitor.SLOTS + 5):
        bad = scores.clone()
        if step in (monitor.SLOTS + 2, monitor.SLOTS + 4):
            bad[1, 3] = float("nan") if step == monitor.SLOTS + 2 else float("inf")
        assert processors(None, bad) is bad
        if step == monitor.SLOTS:
            assert monitor.first_bad() == -1
    assert len(monitor.blocks) == 2
    assert monitor.first_bad() == monitor.SLOTS + 2
    with pytest.raises(FloatingPointError, match=f"at generation step {monitor.SLOTS + 2} of {monitor.SLOTS + 5}"):
        monitor.check()
    inf = _NonFiniteLogits()
    inf(None, torch.tensor([[1.0, float("inf")]]))
    assert inf.first_bad() == 0
    _NonFiniteLogits().check()  # no step: nothing to report


@pytest.mark.parametrize("arch", ["ouro", "huginn"])
def test_device_and_dtype_are_transformers_answer(arch):
    """The models' `device` and `dtype` (read by `prepare_inputs_for_generation` at every step) equal transformers'
    `ModuleUtilsMixin` properties: after a cast, with new input embeddings, and with a non-floating parameter first."""
    from torch import nn
    from transformers.modeling_utils import ModuleUtilsMixin

    def same(model):
        assert model.device == ModuleUtilsMixin.device.fget(model)
        assert model.dtype == ModuleUtilsMixin.dtype.fget(model)

    model = make_model(arch)
    same(model)
    model.to(torch.bfloat16)
    same(model)
    assert model.dtype == torch.bfloat16
    old = model.get_input_embeddings()
    model.set_input_embeddings(nn.Embedding(old.num_embeddings, old.embedding_dim, dtype=torch.float64))
    same(model)
    assert model.dtype == torch.float64
    model.register_parameter("counter", nn.Parameter(torch.zeros(2, dtype=torch.long), requires_grad=False))
    same(model)
    assert model.dtype == torch.float64
