"""Peak memory follows stored bytes: a prefill holds the cache's storage plus one layer call's activations (not every
layer's output, not every loop's state, not every cell's prompt keys and values), and a decode step holds at most one
cell's keys and values beyond the cache. Measured as live tensor bytes (`benchmarks.memtrack.LiveBytes`) on small
models of both architectures; the bounds are written in the model's shape, so they scale to real sizes."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import hf_loopcache.models._common as common
from benchmarks.bench_generate import CACHES
from benchmarks.memtrack import LiveBytes
from hf_loopcache.cache.layers import WindowedLayer
from tests.helpers import call_kwargs, tiny_huginn, tiny_ouro

B, T, STEPS = 2, 1024, 3
CHUNK = 256  # `TOKEN_CHUNK` for these tests: B * T tokens run in 8 pieces
#: hidden states per prompt token that a layer call's attention half holds: the layer's input, the normed input, q, k,
#: v, the attention output and its projection (7); Huginn adds the injected embeddings (kept for every step) and the
#: part of its fused q/k/v projection that outlives q and k (3 per token, alive until RoPE has read q and k)
ACTIVATION_STATES = {"ouro": 7, "huginn_raven": 9}

def _model(arch: str):
    if arch == "ouro":
        return tiny_ouro(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=4,
                         max_position_embeddings=4096)
    return tiny_huginn(n_embd=128, n_heads=4, intermediate_size=256, block_size=4096)


def _hidden(model) -> int:
    cfg = model.config
    return getattr(cfg, "hidden_size", None) or cfg.n_embd


def _transient_bound(model, batch: int, length: int, elem: int) -> int:
    """One layer call over the prompt: `ACTIVATION_STATES` hidden states per token, RoPE tables (fp32 cos and sin per
    position), and one `TOKEN_CHUNK` piece of the token-wise half (norm, MLP of 3 intermediate activations, norm)."""
    cfg, layout = model.config, model.loop_layout
    hidden = _hidden(model)
    states = ACTIVATION_STATES[layout.name] * batch * length * hidden * elem
    rope = 2 * batch * length * layout.head_dim * 4
    piece = CHUNK * (3 * cfg.intermediate_size + 4 * hidden) * elem
    return states + rope + piece


def _window_slack(cache, batch: int, elem: int) -> int:
    """Full-precision positions a windowed cell may allocate beyond its window: the page that has not left it yet, and
    dead room of a quarter of what it holds (at least a page) so it compacts in place instead of holding twice its
    size. (Written out here, not read from the library, so that a change there fails this test.)"""
    plan, cell_token = cache.plan, cache.layout.num_kv_heads * cache.layout.head_dim * 2 * elem
    cells = sum(isinstance(layer, WindowedLayer) for layer in cache.cells)
    live = plan.window + plan.page_size
    return cells * batch * cell_token * (plan.page_size + max(plan.page_size, live // 4))


@pytest.fixture
def small_chunks(monkeypatch):
    monkeypatch.setattr(common, "TOKEN_CHUNK", CHUNK)


@pytest.mark.parametrize("arch", ["ouro", "huginn"])
@pytest.mark.parametrize("name", ["full", "ripe64", "deepest", "kivi4", "kivi4-share", "hand"])
@torch.no_grad()
def test_prefill_and_decode_peaks_follow_stored_bytes(arch, name, small_chunks):
    model = _model(arch)
    elem = next(model.parameters()).element_size()
    ids = torch.randint(3, model.config.vocab_size, (B, T))
    cache = CACHES[name](model)
    cache.reserve(T + STEPS)  # as `generate` does
    mem = LiveBytes()
    with mem:
        model(ids, cache=cache, use_cache=True, logits_to_keep=1, **call_kwargs(arch))
        prefill_peak = mem.peak
        mem.reset_peak()
        before = mem.live
        for _ in range(STEPS):
            model(ids[:, :1], cache=cache, use_cache=True, **call_kwargs(arch))
        decode_peak = mem.peak - before
    # what the plan says it stores, its full-precision parts in the model's dtype
    plan = dataclasses.replace(cache.plan, layout=dataclasses.replace(cache.layout, bytes_per_element=elem))
    expected = plan.expected_stored_bytes(T + STEPS) * B
    assert cache.stored_bytes() == expected
    allocated_bound = expected + _window_slack(cache, B, elem)
    assert cache.nbytes() <= allocated_bound, (
        f"{name}: allocates {cache.nbytes()} bytes for {expected} stored (bound with the windows' slack: "
        f"{allocated_bound})"
    )
    bound = allocated_bound + _transient_bound(model, B, T, elem)
    assert prefill_peak <= bound, (
        f"{name}: prefill peak {prefill_peak} bytes > stored {expected} + window slack + one layer call "
        f"({bound - expected}); at the peak: {mem.peak_where}"
    )
    # a decode step: at most one cell's keys and values of the context beyond the cache (the CPU reference of coded
    # attention decodes one cell's history at a time; the CUDA kernel reads the codes), plus the logits
    cell_kv = B * (T + STEPS) * cache.layout.num_kv_heads * cache.layout.head_dim * 2 * elem
    step_bound = (cell_kv * 3) // 2 + 4 * B * model.config.vocab_size * 4 + 64 * B * _hidden(model) * elem
    assert decode_peak <= step_bound, f"{name}: a decode step holds {decode_peak} bytes above the cache"


@pytest.mark.parametrize("arch", ["ouro", "huginn"])
@torch.no_grad()
def test_token_chunks_leave_the_logits_unchanged(arch, monkeypatch):
    """The token-wise half of a layer computed in pieces (`by_token_chunks`) gives the same logits as in one piece."""
    model = _model(arch)
    ids = torch.randint(3, model.config.vocab_size, (2, 300))
    whole = model(ids, use_cache=False, **call_kwargs(arch)).logits
    monkeypatch.setattr(common, "TOKEN_CHUNK", 128)
    pieces = model(ids, use_cache=False, **call_kwargs(arch)).logits
    torch.testing.assert_close(pieces, whole, rtol=1e-5, atol=1e-5)


def test_live_bytes_counts_new_storages_and_frees_them():
    """The tracker counts a storage once from the op that makes it until it is freed; views and in-place results of
    existing storages add nothing."""
    existing = torch.zeros(1000)
    with LiveBytes() as mem:
        view = existing[10:]  # a view of a storage from before: nothing new
        existing.add_(1)  # in place: nothing new
        a = torch.ones(256)  # 1 KiB
        b = a * 2  # 1 KiB
        assert mem.live == 2048
        del a
        assert mem.live == 1024
        c = torch.cat([b, b])  # 2 KiB
        del b, c, view
        assert mem.live == 0
    assert mem.peak == 3072
