"""`build_cache(model, spec, **options)`: the one cache grammar (names, LoopKV presets, plan folders, Hub ids), its
resolution order, and the errors for unknown specs and options a spec does not take."""

from __future__ import annotations

import pytest
import torch

from hf_loopcache import CachePlan, DeepestPlaneCache, FullLoopCache, LoopKVCache, RIPECache, build_cache
from hf_loopcache.cache import CACHE_OPTIONS, LOOPKV_PRESETS, cache_options, loopkv_preset
from hf_loopcache.layout import LoopLayout
from tests.helpers import make_model

OURO = LoopLayout(n_core=2, num_loops=4, num_kv_heads=2, head_dim=64, name="ouro")


def test_named_specs_build_their_presets():
    full = build_cache(OURO, "full")
    assert type(full) is FullLoopCache and full.plan.is_full
    ripe = build_cache(OURO, "ripe")
    assert type(ripe) is RIPECache and ripe.window == 64  # RIPE's default window
    assert build_cache(OURO, "ripe", window=5, sink=2).plan == CachePlan.ripe(OURO, window=5, sink=2)
    deepest = build_cache(OURO, "deepest", max_rollback=3)
    assert type(deepest) is DeepestPlaneCache and deepest.window == 0 and deepest.max_rollback == 3
    assert build_cache(OURO, "full", num_loops=6).layout.num_loops == 6


@pytest.mark.parametrize("preset", LOOPKV_PRESETS)
def test_loopkv_presets_and_their_options(preset):
    cache = build_cache(OURO, f"loopkv:{preset}")
    assert type(cache) is LoopKVCache and cache.plan == loopkv_preset(OURO, preset)
    assert cache.v_precision is not None and cache.v_precision.tau == 14.0
    tuned = build_cache(OURO, f"loopkv:{preset}", window=64, sink=4, page_size=16, tau=None, num_loops=3)
    assert tuned.plan == loopkv_preset(OURO.with_loops(3), preset, window=64, sink=4, page_size=16)
    assert tuned.v_precision is None
    assert build_cache(OURO, f"loopkv:{preset}", tau=10).v_precision.tau == 10.0


def test_plan_folder_and_file(tmp_path):
    plan = CachePlan.from_rule(OURO, lambda c: "int2" if c.loop == 0 else "int4", sink=8, window=32, page_size=8)
    plan.save_pretrained(tmp_path / "plan")
    for spec in (str(tmp_path / "plan"), str(tmp_path / "plan" / "loopcache_plan.json")):
        cache = build_cache(OURO, spec, max_rollback=2)
        assert type(cache) is LoopKVCache and cache.plan == plan and cache.max_rollback == 2


def test_hub_id_downloads_the_plan_with_its_revision(tmp_path, monkeypatch):
    import huggingface_hub

    path = CachePlan.ripe(OURO, window=16).save_pretrained(tmp_path)
    calls = []

    def fake_download(repo_id, filename, revision=None, **kwargs):
        calls.append((repo_id, filename, revision))
        return path

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake_download)
    cache = build_cache(OURO, "someone/tiny-ouro-plan", plan_revision="v1", tau=None)
    assert cache.plan == CachePlan.ripe(OURO, window=16)
    assert calls == [("someone/tiny-ouro-plan", "loopcache_plan.json", "v1")]


def test_hub_failure_says_so(monkeypatch):
    import huggingface_hub

    def offline(*args, **kwargs):
        raise ConnectionError("offline")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", offline)
    with pytest.raises(OSError, match=r"someone/plan.*(local folder|not a local path)"):
        build_cache(OURO, "someone/plan")


def test_resolution_order_names_before_folders(tmp_path, monkeypatch):
    """A folder called `ripe` in the working directory does not shadow the name; a folder that looks like a Hub id
    is read locally before the Hub is asked."""
    monkeypatch.chdir(tmp_path)
    CachePlan.full(OURO).save_pretrained(tmp_path / "ripe")
    assert type(build_cache(OURO, "ripe")) is RIPECache
    CachePlan.ripe(OURO, window=7).save_pretrained(tmp_path / "owner" / "name")
    assert build_cache(OURO, "owner/name").plan == CachePlan.ripe(OURO, window=7)


@pytest.mark.parametrize(
    ("spec", "options", "message"),
    [
        ("ripee", {}, r"must be full, ripe, deepest, loopkv:<preset> .*got 'ripee'"),
        ("kivi4", {}, r"must be full, ripe, deepest.*got 'kivi4'"),
        ("loopkv:kivi3", {}, r"unknown LoopKV preset 'kivi3'; presets: loopkv:kivi4, loopkv:kivi2"),
        ("loopkv", {}, r"unknown LoopKV preset ''"),
        ("./no/such/plan", {}, r"looks like a local path, but nothing exists"),
        ("", {}, r"`spec` must be"),
        (None, {}, r"`spec` must be"),
        ("full", {"window": 64}, r"'full' does not take option\(s\) window; it takes: num_loops"),
        ("deepest", {"window": 8}, r"does not take option\(s\) window; it takes: num_loops, max_rollback"),
        ("ripe", {"tau": 14.0, "wndow": 3}, r"does not take option\(s\) tau, wndow; it takes: window, sink"),
        ("loopkv:kivi4", {"tau": "high"}, r"`tau` must be a number of bits or None \(V precision off\), got .high."),
        ("ripe", {"window": -1}, r"`window` must be a non-negative int, got -1"),
        ("loopkv:kivi2", {"num_loops": 0}, r"`num_loops` must be a positive int, got 0"),
        ("loopkv:kivi4", {"v_precision_blocks": "no"}, r"`v_precision_blocks` must be True, False or None, got 'no'"),
        ("ripe", {"v_precision_blocks": False}, r"does not take option\(s\) v_precision_blocks"),
    ],
    ids=[
        "typo",
        "bare-preset",
        "unknown-preset",
        "loopkv-without-preset",
        "missing-path",
        "empty",
        "none",
        "full-window",
        "deepest-window",
        "ripe-tau-and-typo",
        "tau-string",
        "negative-window",
        "zero-loops",
        "blocks-string",
        "ripe-blocks",
    ],
)
def test_bad_specs_and_options_are_refused(spec, options, message):
    with pytest.raises(ValueError, match=message):
        build_cache(OURO, spec, **options)


def test_cache_options_lists_what_each_spec_takes(tmp_path):
    assert cache_options("full") == ("num_loops",)
    assert "window" in cache_options("ripe") and "tau" not in cache_options("ripe")
    assert "tau" in cache_options("loopkv:hand")
    CachePlan.full(OURO).save_pretrained(tmp_path)
    assert cache_options(str(tmp_path)) == ("tau", "v_precision_blocks", "max_rollback")
    assert set(CACHE_OPTIONS) == {
        "group_size",
        "max_rollback",
        "num_loops",
        "page_size",
        "plan_revision",
        "sink",
        "tau",
        "v_precision_blocks",
        "window",
    }


@torch.no_grad()
def test_built_cache_decodes_like_the_constructor(arch):
    model = make_model(arch)
    ids = torch.randint(3, 60, (2, 9))
    outs = []
    for cache in (build_cache(model, "ripe", window=3), RIPECache(model, window=3)):
        outs.append(model.generate(ids, past_key_values=cache, max_new_tokens=5, do_sample=False, pad_token_id=0))
    assert outs[0].tolist() == outs[1].tolist()
