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


@pytest.mark.parametrize("padded", [True, False])
@pytest.mark.parametrize("name", ["full", "kivi4"])
def test_decode_step_inputs_are_transformers_own_at_every_step(arch, name, padded, monkeypatch):
    """A decode step into a static cache builds its inputs directly (`_compat.decode_step_inputs`); at every step of
    a greedy generate, left-padded or not, they equal what transformers' `prepare_inputs_for_generation` builds, and
    the tokens equal those of a generate that takes transformers' inputs throughout."""
    from transformers.generation import GenerationMixin

    from hf_loopcache import _compat

    monkeypatch.setattr(_compat, "_fast_inputs", {})
    model = make_model(arch)
    ids = torch.randint(3, 60, (2, 9), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0 if padded else 1  # (transformers 5.24 hands an all-ones mask on as None)
    steps = {"fast": 0, "transformers": 0}
    inner = _compat.decode_step_inputs

    def checked(model_, input_ids, kwargs, transformers_inputs):
        out = inner(model_, input_ids, kwargs, transformers_inputs)
        if _compat._fast_inputs.get(type(model_)) and kwargs.get("next_sequence_length") == 1:
            own = GenerationMixin.prepare_inputs_for_generation(model_, input_ids, **kwargs)
            assert _compat._same_inputs(out, own)
            steps["fast"] += 1
        else:
            steps["transformers"] += 1
        return out

    def run(fast: bool) -> torch.Tensor:
        _compat._fast_inputs.clear()
        if not fast:
            _compat._fast_inputs[type(model)] = False
        cache = CACHES[name](model, static=True, max_batch_size=2, max_cache_len=32)
        return model.generate(ids, attention_mask=mask, cache=cache, max_new_tokens=8, do_sample=False,
                              pad_token_id=0, **call_kwargs(arch))

    monkeypatch.setattr(_compat, "decode_step_inputs", checked)
    from hf_loopcache.models import _common

    monkeypatch.setattr(_common, "decode_step_inputs", checked)
    fast = run(True)
    assert _compat._fast_inputs[type(model)] is True
    assert steps["fast"] == 7  # 8 tokens: the prefill's, then 7 decode steps (the first also builds transformers')
    slow = run(False)
    assert torch.equal(fast, slow)


def test_decode_step_inputs_keep_transformers_own_where_they_differ(monkeypatch):
    """A release whose inputs differ from the direct ones keeps its own from the first step on; a step with inputs
    transformers pops (token types), a longer or first step or a growable cache never takes the direct path."""
    from hf_loopcache import _compat

    monkeypatch.setattr(_compat, "_fast_inputs", {})
    model = make_model("ouro")
    cache = FullLoopCache(model, static=True, max_batch_size=1, max_cache_len=16)
    ids = torch.randint(3, 60, (1, 6))
    model(ids, cache=cache)
    kwargs = {_compat.CACHE_KWARG: cache, "attention_mask": torch.ones(1, 7, dtype=torch.long), "use_cache": True,
              "next_sequence_length": 1}
    calls = []

    def other():
        calls.append(1)
        return {"input_ids": ids[:, -1:], "extra": 1}

    step = torch.cat([ids, ids[:, :1]], 1)
    assert _compat.decode_step_inputs(model, step, kwargs, other) == other()
    assert _compat._fast_inputs[type(model)] is False
    calls.clear()
    assert "extra" in _compat.decode_step_inputs(model, step, kwargs, other) and calls  # its own from then on

    _compat._fast_inputs.clear()
    for changed in ({"token_type_ids": torch.zeros(1, 7, dtype=torch.long)}, {"next_sequence_length": 2},
                    {"is_first_iteration": True}, {_compat.CACHE_KWARG: FullLoopCache(model)}):
        calls.clear()
        _compat.decode_step_inputs(model, step, {**kwargs, **changed}, other)
        assert calls, changed
    assert type(model) not in _compat._fast_inputs
    same = {"input_ids": step[:, -1:].clone(memory_format=torch.contiguous_format), _compat.CACHE_KWARG: cache,
            "attention_mask": kwargs["attention_mask"], "use_cache": True}
    assert _compat.decode_step_inputs(model, step, kwargs, lambda: same) is same  # the first: transformers' own
    fast = _compat.decode_step_inputs(model, step, kwargs, other)  # then the direct one
    assert _compat._fast_inputs[type(model)] is True and torch.equal(fast["input_ids"], step[:, -1:])


@pytest.mark.gpu
def test_the_gap_and_launch_benchmarks_run_on_a_gpu():
    """`profile_step --gaps` times a captured step's host timeline; `bench_graph_launch` replays chunked graphs and
    checks that every kernel ran."""
    from benchmarks import bench_graph_launch, profile_step
    from benchmarks.common import build

    row = bench_graph_launch.measure(40, 4, reps=3)
    assert row["chunks"] == 4 and row["back_to_back_us"] > 0
    model = build("micro-ouro", torch.float32, "cuda").to("cuda")
    gaps = profile_step.host_gaps(model, "full", 1, 256, 4, "cuda")
    assert all(v is not None and v > 0 for v in gaps["host_us"].values())
    assert gaps["replay_back_to_back_ms"] > 0 and gaps["profiled_steps"] == 4
