"""Peak memory follows stored bytes: a prefill holds the cache's storage plus, per row, the layer's input and output and
one cell's prompt keys and values (queries, attention, projections and the MLP run in pieces of a fixed number of
tokens: not every layer's output, not every loop's state, not every cell's prompt keys and values), and a decode step
holds at most one cell's keys and values beyond the cache. Measured as live tensor bytes
(`benchmarks.memtrack.LiveBytes`) on small models of both architectures; the bounds are written in the model's shape, so
they scale to real sizes."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import hf_loopcache.cache.layers.coded as coded
import hf_loopcache.models._common as common
from benchmarks.bench_generate import CACHES
from benchmarks.memtrack import LiveBytes
from hf_loopcache.cache.layers import CodedLayer, WindowedLayer
from tests.helpers import call_kwargs, tiny_huginn, tiny_ouro

B, T, STEPS = 2, 1024, 3
CHUNK = 256  # `TOKEN_CHUNK` for these tests: B * T tokens run in 8 pieces
CODE_PAGES = 4  # `_CODE_CHUNK_PAGES` for these tests: 128 of 1,024 positions per coding call (1,024 of 8K in the library)
#: hidden states per row and prompt token that a prefill's layer call holds beyond one cell's prompt keys and values:
#: the layer's input and output; Huginn adds the injected embeddings (kept for every core step; in the coda, the
#: latent state returned beside the logits takes their place). Before the queries ran in pieces, the attention half
#: also held the normed input, q, the attention output and its projection for every row (Ouro: 7 in all, Huginn: 9).
ROW_STATES = {"ouro": 2, "huginn_raven": 3}
#: hidden states per token of one piece (the piece's normed input, q, k, v, RoPE's temporaries, the attention output,
#: its reshaped copy and projection, the norm's fp32 copies of the eager path; the MLP piece is counted apart)
PIECE_STATES = 12


def _model(arch: str):
    if arch == "ouro":
        return tiny_ouro(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=4,
                         max_position_embeddings=4096)
    return tiny_huginn(n_embd=128, n_heads=4, intermediate_size=256, block_size=4096)


def _hidden(model) -> int:
    cfg = model.config
    return getattr(cfg, "hidden_size", None) or cfg.n_embd


def _row_bound(model, length: int, elem: int, cache) -> int:
    """Bytes a prefill of `length` tokens holds per row beyond the cache: `ROW_STATES` hidden states and one cell's
    keys and values per token, the RoPE tables (fp32 cos and sin: `head_dim` each on Ouro, `head_dim / 2` on Huginn), and
    for coded cells the eager quantizer's fp32 copies (three) of one coding call's keys (`CODE_PAGES` pages)."""
    layout = model.loop_layout
    kv = layout.num_kv_heads * layout.head_dim
    rope = 2 * layout.head_dim * 4 if layout.name == "ouro" else layout.head_dim * 4
    per_token = (ROW_STATES[layout.name] * _hidden(model) + 2 * kv) * elem + rope
    coded = any(isinstance(layer, CodedLayer) for layer in cache.cells)
    coding = 3 * min(length, CODE_PAGES * cache.plan.page_size) * kv * 4 if coded else 0
    return per_token * length + coding


def _transient_bound(model, batch: int, length: int, elem: int, cache) -> int:
    """One layer call over the prompt: `_row_bound` per row, and one piece: `TOKEN_CHUNK` tokens (at least
    `MIN_QUERY_PIECE` positions of every row) of the attention half (`PIECE_STATES` hidden states per token, and off
    CUDA the piece's fp32 and bool masks over the keys up to its end) or of the token-wise half (norm, MLP of 3
    intermediate activations, norm)."""
    hidden = _hidden(model)
    positions = max(common.MIN_QUERY_PIECE, CHUNK // batch)
    tokens = positions * batch
    attention_piece = tokens * PIECE_STATES * hidden * elem + positions * length * (4 + 1)
    mlp_piece = CHUNK * (3 * model.config.intermediate_size + 4 * hidden) * elem
    return batch * _row_bound(model, length, elem, cache) + max(attention_piece, mlp_piece)


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
    monkeypatch.setattr(coded, "_CODE_CHUNK_PAGES", CODE_PAGES)


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
    bound = allocated_bound + _transient_bound(model, B, T, elem, cache)
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
@pytest.mark.parametrize("name", ["full", "ripe64", "kivi4-share"])
@torch.no_grad()
def test_prefill_workspace_per_row(arch, name, small_chunks):
    """What a prefill holds beyond its cache grows by `_row_bound` per row, no more: the batch slope that the capacity
    search meets (two batch sizes whose pieces hold the same number of tokens, so everything else cancels)."""
    model = _model(arch)
    elem = next(model.parameters()).element_size()
    held = {}
    for batch in (2, 4):
        ids = torch.randint(3, model.config.vocab_size, (batch, T))
        cache = CACHES[name](model)
        cache.reserve(T + STEPS)
        with LiveBytes() as mem:
            model(ids, cache=cache, use_cache=True, logits_to_keep=1, **call_kwargs(arch))
        held[batch] = mem.peak - cache.nbytes()
    per_row = (held[4] - held[2]) / 2
    bound = _row_bound(model, T, elem, cache)
    state = T * _hidden(model) * elem
    assert per_row <= bound, (
        f"{name}: a prefill holds {per_row / state:.2f} hidden states per row and prompt token beyond the cache, bound "
        f"{bound / state:.2f} (input, output, one cell's keys and values, RoPE tables)"
    )


def _decode_after_prefill(model, arch: str, name: str | None, ids: torch.Tensor, mask: torch.Tensor) -> list:
    """Prefill logits, then (with a cache) the logits of two greedy decode steps and the bytes the cache stores."""
    cache = CACHES[name](model) if name is not None else None
    out = model(ids, attention_mask=mask, cache=cache, use_cache=cache is not None, **call_kwargs(arch))
    results = [out.logits]
    if cache is not None:
        token = out.logits[:, -1:].argmax(-1)
        for _ in range(2):
            mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
            logits = model(token, attention_mask=mask, cache=cache, use_cache=True, **call_kwargs(arch)).logits
            results.append(logits)
            token = logits[:, -1:].argmax(-1)
        results.append(torch.tensor(cache.stored_bytes()))
    return results


@pytest.mark.parametrize("arch", ["ouro", "huginn"])
@pytest.mark.parametrize("name", [None, "full", "ripe64", "deepest", "kivi4", "kivi4-share", "hand"])
@torch.no_grad()
def test_query_pieces_give_the_one_call_result(arch, name, monkeypatch):
    """A prefill whose attention half runs in query pieces (and the token-wise half and Huginn's adapter in token
    pieces) computes the one-call math: the same logits in float64 (in fp32 only the kernels' summation order differs,
    which a random looped model amplifies to 1e-4 .. 1e-2), left padding included; each cache then decodes the same
    steps from what it stored, and stores as many bytes."""
    model = _model(arch).double()
    ids = torch.randint(3, model.config.vocab_size, (2, 300))
    mask = torch.ones_like(ids)
    mask[1, :37] = 0
    monkeypatch.setattr(common, "TOKEN_CHUNK", 1 << 20)
    whole = _decode_after_prefill(model, arch, name, ids, mask)
    monkeypatch.setattr(common, "TOKEN_CHUNK", 128)  # pieces of 64 positions of both rows: 5 pieces
    pieces = _decode_after_prefill(model, arch, name, ids, mask)
    assert len(pieces) == len(whole)
    for got, want in zip(pieces, whole):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-10)


@torch.no_grad()
def test_query_pieces_only_in_a_long_prefill(monkeypatch):
    """Pieces are taken for a long prefill into empty cells, with a piece size that depends on the shape only; decode
    steps, short prompts, blocks after cached positions, static and foreign caches, attention maps and gradients keep
    the one-call path."""
    from transformers import DynamicCache

    from hf_loopcache import FullLoopCache

    monkeypatch.setattr(common, "TOKEN_CHUNK", 256)
    model = tiny_ouro()

    def piece(cache=None, batch=2, length=1024, slot=0, **kwargs):
        state, _ = common.LoopForward.begin(
            layout=model.loop_layout, num_loops=3, cache=cache, attention_mask=None, position_ids=None,
            batch_size=batch, query_length=length, device=torch.device("cpu"), scaling=1.0, **kwargs
        )
        return state.query_piece(slot, batch, length)

    assert piece() == 128  # TOKEN_CHUNK // batch positions of every row
    assert piece(batch=16) == common.MIN_QUERY_PIECE  # never fewer positions than this
    assert piece(FullLoopCache(model)) == 128
    assert piece(length=1) is None  # a decode step
    assert piece(batch=64, length=1) is None
    assert piece(length=128) is None  # 256 tokens: one piece
    assert piece(batch=16, length=64) is None  # one piece of 64 positions
    assert piece(output_attentions=True) is None
    assert piece(DynamicCache()) is None  # a foreign cache returns its keys and values through `update`
    static = FullLoopCache(model, static=True, max_batch_size=2, max_cache_len=2048)
    assert piece(static) is None
    cache = FullLoopCache(model)
    model(torch.randint(3, 60, (2, 8)), cache=cache, use_cache=True)
    assert piece(cache) is None  # a block after cached positions reads the cells' history
    with torch.enable_grad():
        assert piece() is None
    layout = cache.layout  # the cache's side: the queries of the last new tokens alone only into an empty cell
    query = torch.zeros(2, layout.num_kv_heads, 4, layout.head_dim)
    key = torch.zeros(2, layout.num_kv_heads, 8, layout.head_dim)
    state, _ = common.LoopForward.begin(
        layout=model.loop_layout, num_loops=3, cache=cache, attention_mask=None, position_ids=None, batch_size=2,
        query_length=8, device=torch.device("cpu"), scaling=1.0,
    )
    with pytest.raises(ValueError, match="only a prefill into an empty growable cell"):
        cache.attend(0, query, key, key, state.inputs)


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
