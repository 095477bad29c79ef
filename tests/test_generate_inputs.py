"""The Python API's sharp edges (issue #18): the cache keyword on every transformers, empty prompts, reused caches,
plans given by folder, non-finite logits, and fast, one-line failures for missing plans."""

from __future__ import annotations

import warnings

import pytest
import torch

from hf_loopcache import CachePlan, FullLoopCache, LoopKVCache, RIPECache
from hf_loopcache._compat import CACHE_KWARG, generate_cache_kwargs
from hf_loopcache._hub import HubUnreachableError, hub_offline_reason, looks_like_local_path
from hf_loopcache.cache import loopkv_preset
from tests.helpers import call_kwargs, make_model


def _generate(model, arch, ids, **kwargs):
    kwargs = {"max_new_tokens": 4, "do_sample": False, "pad_token_id": 0, **call_kwargs(arch), **kwargs}
    return model.generate(ids, **kwargs)


def _prompt(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 60, (1, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("keyword", ["cache", "past_key_values"])
def test_both_cache_keywords_work_without_warnings(arch, keyword):
    model = make_model(arch)
    ids = _prompt(9)
    reference = _generate(model, arch, ids, use_cache=False)
    cache = RIPECache(model, window=64)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = _generate(model, arch, ids, **{keyword: cache})
    assert torch.equal(out, reference)
    assert cache.get_seq_length() == out.shape[1] - 1  # the cache given is the one generate used
    assert [str(w.message) for w in caught if issubclass(w.category, (FutureWarning, DeprecationWarning))] == []


def test_generate_cache_kwargs_renames_to_this_release_and_refuses_both():
    cache = object()
    other = "past_key_values" if CACHE_KWARG == "cache" else "cache"
    assert generate_cache_kwargs({other: cache, "x": 1}) == {CACHE_KWARG: cache, "x": 1}
    assert generate_cache_kwargs({CACHE_KWARG: cache}) == {CACHE_KWARG: cache}
    with pytest.raises(ValueError, match="either `past_key_values=` or `cache=`, not both"):
        generate_cache_kwargs({other: cache, CACHE_KWARG: object()})


def test_empty_prompt_raises_value_error(arch):
    model = make_model(arch)
    empty = torch.zeros(1, 0, dtype=torch.long)
    with pytest.raises(ValueError, match="prompt is empty"):
        _generate(model, arch, empty, cache=FullLoopCache(model))
    with pytest.raises(ValueError, match="input is empty"):
        model(empty, **call_kwargs(arch))


def test_reused_cache_continues_a_prefix_like_one_call(arch):
    model = make_model(arch)
    ids = _prompt(5)
    once = _generate(model, arch, ids, cache=FullLoopCache(model), max_new_tokens=7)
    cache = FullLoopCache(model)
    first = _generate(model, arch, ids, cache=cache, max_new_tokens=3)
    assert cache.get_seq_length() == 7
    again = _generate(model, arch, first, cache=cache, max_new_tokens=4)
    assert torch.equal(again, once)


def test_reused_cache_takes_only_new_tokens_with_a_full_mask(arch):
    model = make_model(arch)
    ids = _prompt(5)
    once = _generate(model, arch, ids, cache=FullLoopCache(model), max_new_tokens=7)
    cache = FullLoopCache(model)
    first = _generate(model, arch, ids, cache=cache, max_new_tokens=3)
    new = first[:, cache.get_seq_length() :]
    mask = torch.ones(1, first.shape[1], dtype=torch.long)
    again = _generate(model, arch, new, cache=cache, attention_mask=mask, max_new_tokens=4)
    assert torch.equal(again[:, -4:], once[:, -4:])


def test_reused_cache_holding_more_than_the_prompt_raises(arch):
    """The issue's case: a cache holding 7 positions and a new 5-token prompt would attend to the old context."""
    model = make_model(arch)
    cache = FullLoopCache(model)
    _generate(model, arch, _prompt(5), cache=cache, max_new_tokens=3)
    assert cache.get_seq_length() == 7
    with pytest.raises(ValueError, match="already holds 7 positions, but the input has 5 tokens"):
        _generate(model, arch, _prompt(5, seed=1), cache=cache)
    with pytest.raises(ValueError, match="already holds 7 positions, but the input has 7 tokens"):
        _generate(model, arch, _prompt(7, seed=1), cache=cache)


def test_reused_cache_of_another_sequence_raises(arch):
    model = make_model(arch)
    cache = FullLoopCache(model)
    _generate(model, arch, _prompt(5), cache=cache, max_new_tokens=3)
    other = _prompt(12, seed=1)
    with pytest.raises(ValueError, match="holds 7 positions of a different sequence"):
        _generate(model, arch, other, cache=cache)
    cache.reset()
    assert _generate(model, arch, other, cache=cache).shape[1] == 16  # after a reset it starts afresh


def test_non_finite_logits_are_reported(arch):
    model = make_model(arch)
    head = model.lm_head if hasattr(model, "lm_head") else model.get_output_embeddings()
    ids = _prompt(6)
    _generate(model, arch, ids, do_sample=True, top_k=3)  # -inf from top-k masking is not reported
    with torch.no_grad():
        head.weight[5].fill_(float("nan"))
    with pytest.raises(FloatingPointError, match="non-finite logits .* at generation step 0 of 4"):
        _generate(model, arch, ids, cache=FullLoopCache(model))


def test_loopkv_cache_plan_argument(tmp_path):
    model = make_model("ouro")
    with pytest.raises(TypeError, match="`plan` must be a CachePlan, one of .* got NoneType"):
        LoopKVCache(model, None)
    with pytest.raises(TypeError, match="got int"):
        LoopKVCache(model, 4)
    with pytest.raises(ValueError, match="got 'kivi5', which is none of these"):
        LoopKVCache(model, "kivi5")
    plan = loopkv_preset(model.loop_layout, "kivi2", sink=4, window=8, page_size=8, group_size=8)
    plan.save_pretrained(tmp_path / "plan")
    for given in (tmp_path / "plan", str(tmp_path / "plan"), str(tmp_path / "plan" / "loopcache_plan.json")):
        assert LoopKVCache(model, given).plan == plan


def test_loop_cache_plan_must_be_a_plan():
    from hf_loopcache import LoopCache

    with pytest.raises(TypeError, match="`plan` must be a CachePlan or None"):
        LoopCache(make_model("ouro"), "kivi4")


@pytest.mark.parametrize("name", ["./my_plan_dir", "/no/such/plan", "plan.json", "a/b/c"])
def test_plan_from_a_missing_local_path_fails_at_once(name, monkeypatch):
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", _no_network)
    assert looks_like_local_path(name)
    with pytest.raises(FileNotFoundError, match="no plan folder or file"):
        CachePlan.from_pretrained(name)


def _no_network(*args, **kwargs):
    if not kwargs.get("local_files_only"):
        raise AssertionError("a network request was made")
    raise FileNotFoundError("not in the local cache")


def _offline_by_dns(monkeypatch):
    import socket

    from huggingface_hub import constants

    def fail(*args, **kwargs):
        raise socket.gaierror(-2, "Name or service not known")

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    for key in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setattr(socket, "getaddrinfo", fail)


def test_offline_hub_fails_at_once_in_one_line(monkeypatch):
    import huggingface_hub

    _offline_by_dns(monkeypatch)
    assert "cannot be resolved" in hub_offline_reason()
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", _no_network)
    assert not looks_like_local_path("my_plan_dir")
    with pytest.raises(HubUnreachableError, match="'my_plan_dir' is not a local path, and the Hugging Face Hub") as err:
        CachePlan.from_pretrained("my_plan_dir")
    assert "\n" not in str(err.value)


def test_hub_offline_env(monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert hub_offline_reason() == "HF_HUB_OFFLINE is set"


def test_push_to_hub_offline_fails_in_one_line(monkeypatch):
    import huggingface_hub

    _offline_by_dns(monkeypatch)

    class NoApi:
        def __init__(self, *args, **kwargs):
            raise AssertionError("the Hub API was used offline")

    monkeypatch.setattr(huggingface_hub, "HfApi", NoApi)
    plan = CachePlan.full(make_model("ouro").loop_layout)
    with pytest.raises(HubUnreachableError, match="cannot push the plan to 'me/plan': the Hugging Face Hub cannot"):
        plan.push_to_hub("me/plan")
