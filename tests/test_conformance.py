"""The native models behave like transformers models (issue: conformance): a default cache, per-layer-call hidden
states and attention maps, `return_dict`, transformers' label convention, `torch.export`, and generate's extra
outputs. Tiny random fp32 models on CPU; the architectural differences are named in the README's model section."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import DynamicCache
from transformers.cache_utils import Cache

from hf_loopcache import FullLoopCache, OuroConfig, RIPECache
from hf_loopcache._compat import OUTPUT_CACHE_FIELD
from hf_loopcache.attention import dense_attention, eager_attention
from tests.helpers import call_kwargs, make_model

torch.set_num_threads(1)

IDS = torch.tensor([[5, 9, 17, 33, 12, 8, 40, 21, 3], [7, 3, 22, 11, 14, 6, 29, 31, 44]])
LEFT_PAD = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 1], [1] * 9])


def layer_calls(model, loops: int | None = None) -> int:
    """Layer calls of one forward pass (= cells written): what hidden_states and attentions count."""
    layout = model.loop_layout
    return layout.with_loops(loops).num_cells if loops is not None else layout.num_cells


def cache_of(out):
    return getattr(out, OUTPUT_CACHE_FIELD)


def loops_kwarg(arch: str, n: int) -> dict:
    return {"num_loops": n} if arch == "ouro" else {"num_steps": n}


# ---------------------------------------------------------------------------------------------------- default cache
@torch.no_grad()
def test_use_cache_builds_a_loop_cache_and_a_manual_decode_loop_equals_generate(arch):
    model = make_model(arch)
    kw = call_kwargs(arch)
    out = model(IDS, use_cache=True, **kw)
    cache = cache_of(out)
    assert isinstance(cache, FullLoopCache)
    assert cache.get_seq_length() == IDS.shape[1] and len(cache.layers) == model.loop_layout.num_cells
    tokens = []
    for _ in range(5):
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        tokens.append(nxt)
        out = model(nxt, past_key_values=cache_of(out), use_cache=True, **kw)
    manual = torch.cat([IDS, *tokens], dim=1)
    generated = model.generate(IDS, max_new_tokens=5, do_sample=False, pad_token_id=0, **kw)
    assert torch.equal(manual, generated)


@torch.no_grad()
def test_a_cache_is_built_only_where_it_can_be_used(arch):
    model = make_model(arch)
    kw = call_kwargs(arch)
    assert isinstance(cache_of(model(IDS, **kw)), FullLoopCache)  # config.use_cache, eval mode
    assert cache_of(model(IDS, use_cache=False, **kw)) is None
    assert cache_of(model(IDS, labels=IDS, **kw)) is None  # a loss needs no cache
    assert isinstance(cache_of(model(IDS, labels=IDS, use_cache=True, **kw)), FullLoopCache)
    given = FullLoopCache(model)
    assert cache_of(model(IDS, labels=IDS, past_key_values=given, **kw)) is given  # a cache passed in is used
    assert given.get_seq_length() == IDS.shape[1]
    model.train()
    train_kw = {**kw, **loops_kwarg(arch, 2)}
    assert cache_of(model(IDS, **train_kw)) is None
    assert isinstance(cache_of(model(IDS, use_cache=True, **train_kw)), FullLoopCache)
    model.eval()
    model.config.use_cache = False
    assert cache_of(model(IDS, **kw)) is None


@torch.no_grad()
def test_default_cache_is_sized_for_more_loops_than_the_default(arch):
    model = make_model(arch)
    loops = model.loop_layout.num_loops + 2
    out = model(IDS, use_cache=True, **call_kwargs(arch), **loops_kwarg(arch, loops))
    assert cache_of(out).layout.num_loops == loops


# ---------------------------------------------------------------------------------------------------- hidden states
@torch.no_grad()
def test_hidden_states_are_the_embeddings_then_every_layer_call_in_order(arch):
    model = make_model(arch)
    kw = call_kwargs(arch)
    out = model(IDS, output_hidden_states=True, use_cache=False, **kw)
    states = out.hidden_states
    assert isinstance(states, tuple) and len(states) == 1 + layer_calls(model)
    assert all(s.shape == (*IDS.shape, model.config.hidden_size) for s in states)
    if arch == "ouro":
        torch.testing.assert_close(states[0], model.model.embed_tokens(IDS))
        n_layers = model.config.num_hidden_layers
        loop_ends = model.model(IDS, use_cache=False).loop_hidden_states  # normed: what the next loop reads
        for r, h in enumerate(loop_ends):
            torch.testing.assert_close(states[(r + 1) * n_layers], h)
        torch.testing.assert_close(out.logits, model.lm_head(states[-1]))
    else:
        torch.testing.assert_close(states[0], model.transformer.wte(IDS) * model.emb_scale)
        torch.testing.assert_close(out.logits, model.lm_head(states[-1]).float())
    # execution order: a run with one loop fewer shares every entry up to the end of its loops
    fewer = model(IDS, output_hidden_states=True, use_cache=False, **kw, **loops_kwarg(arch, 2))
    n_shared = 1 + layer_calls(model, 2) - model.loop_layout.n_coda
    for a, b in zip(fewer.hidden_states[: n_shared - 1], states[: n_shared - 1]):
        torch.testing.assert_close(a, b)
    assert len(fewer.hidden_states) == 1 + layer_calls(model, 2)


@torch.no_grad()
def test_hidden_states_and_attentions_follow_the_config_flags(arch):
    model = make_model(arch)
    model.config.output_hidden_states = True
    model.config._attn_implementation = "eager"  # transformers' configs take output_attentions only with eager
    model.config.output_attentions = True
    out = model(IDS, use_cache=False, **call_kwargs(arch))
    assert len(out.hidden_states) == 1 + layer_calls(model) and len(out.attentions) == layer_calls(model)
    out = model(IDS, use_cache=False, output_hidden_states=False, output_attentions=False, **call_kwargs(arch))
    assert out.hidden_states is None and out.attentions is None


# ---------------------------------------------------------------------------------------------------- attentions
@pytest.mark.parametrize("past", [0, 5], ids=["prefill", "past5"])
@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "left-padded"])
def test_eager_attention_equals_dense_attention_and_returns_its_weights(past, padded):
    g = torch.Generator().manual_seed(0)
    q_len, total = 4, 4 + past
    query = torch.randn(2, 6, q_len, 8, generator=g)
    key, value = torch.randn(2, 3, total, 8, generator=g), torch.randn(2, 3, total, 8, generator=g)
    valid = torch.ones(2, total, dtype=torch.bool)
    if padded:
        valid[0, :3] = False
    kv = valid if padded else None
    out, weights = eager_attention(query, key, value, key_valid=kv, scaling=0.3)
    torch.testing.assert_close(out, dense_attention(query, key, value, key_valid=kv, scaling=0.3))
    assert weights.shape == (2, 6, q_len, total)
    torch.testing.assert_close(weights.sum(-1), torch.ones(2, 6, q_len))
    for i in range(q_len):  # causal: query i (absolute position past + i) sees nothing later
        assert (weights[:, :, i, past + i + 1 :] == 0).all()
    if padded:  # padded keys get no weight from the row's real queries
        real_queries = [i for i in range(q_len) if past + i >= 3]
        assert (weights[0][:, real_queries, :3] == 0).all()
    expanded = value.repeat_interleave(2, dim=1)
    torch.testing.assert_close(out, weights @ expanded)


@torch.no_grad()
def test_attentions_are_one_map_per_layer_call_and_the_output_does_not_change(arch):
    model = make_model(arch)
    kw = call_kwargs(arch)
    plain = model(IDS, attention_mask=LEFT_PAD, use_cache=False, **kw).logits
    out = model(IDS, attention_mask=LEFT_PAD, output_attentions=True, use_cache=False, **kw)
    heads = model.config.num_attention_heads
    assert len(out.attentions) == layer_calls(model)
    for w in out.attentions:
        assert w.shape == (2, heads, IDS.shape[1], IDS.shape[1])
        torch.testing.assert_close(w.sum(-1), torch.ones(2, heads, IDS.shape[1]))
        assert (w[0, :, 3:, :3] == 0).all()  # real queries of the padded row never read its pads
        assert (w.triu(1) == 0).all()
    torch.testing.assert_close(out.logits, plain, atol=1e-5, rtol=1e-5)


@torch.no_grad()
@pytest.mark.parametrize("cache_kind", ["full", "dynamic"])
def test_attention_maps_of_a_cached_decode_step_are_the_last_rows_of_the_full_maps(arch, cache_kind):
    model = make_model(arch)
    kw = call_kwargs(arch)
    full = model(IDS, output_attentions=True, use_cache=False, **kw).attentions
    cache = FullLoopCache(model) if cache_kind == "full" else DynamicCache()
    model(IDS[:, :-1], past_key_values=cache, use_cache=True, **kw)
    step = model(IDS[:, -1:], past_key_values=cache, use_cache=True, output_attentions=True, **kw).attentions
    assert len(step) == len(full)
    for a, b in zip(step, full):
        torch.testing.assert_close(a, b[:, :, -1:], atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_a_compressed_cell_refuses_attention_maps_by_name(arch):
    model = make_model(arch)
    cache = RIPECache(model, window=2)
    with pytest.raises(ValueError, match=r"full precision.*RIPECache stores cell loop0\.layer0 as 'share'"):
        model(IDS, past_key_values=cache, use_cache=True, output_attentions=True, **call_kwargs(arch))


@torch.no_grad()
def test_cache_layers_expose_their_keys_and_values(arch):
    model = make_model(arch)
    cache = cache_of(model(IDS, use_cache=True, **call_kwargs(arch)))
    layout = model.loop_layout
    for flat, layer in enumerate(cache.layers):
        keys, values = cache.cell_states(layout.slot(layout.cell_at(flat)))
        assert torch.equal(layer.keys, keys) and torch.equal(layer.values, values)
        assert layer.keys.shape == (2, layout.num_kv_heads, IDS.shape[1], layout.head_dim)
    assert FullLoopCache(model).layers[0].keys is None
    with pytest.raises(AttributeError, match="write them with `update`"):
        cache.layers[0].keys = torch.zeros(1)


# ---------------------------------------------------------------------------------------------------- return_dict
@torch.no_grad()
def test_return_dict_false_gives_transformers_tuple_order(arch):
    model = make_model(arch)
    kw = dict(labels=IDS, use_cache=True, output_hidden_states=True, output_attentions=True, **call_kwargs(arch))
    as_dict = model(IDS, **kw)
    as_tuple = model(IDS, return_dict=False, **kw)
    assert isinstance(as_tuple, tuple)
    loss, logits, cache, hidden, attentions = as_tuple[:5]
    torch.testing.assert_close(loss, as_dict.loss)
    torch.testing.assert_close(logits, as_dict.logits)
    assert isinstance(cache, Cache) and cache.get_seq_length() == IDS.shape[1]
    assert len(hidden) == 1 + layer_calls(model) and len(attentions) == layer_calls(model)
    model.config.return_dict = False
    plain = model(IDS, use_cache=False, **call_kwargs(arch))
    assert isinstance(plain, tuple)
    torch.testing.assert_close(plain[0], as_dict.logits if arch == "huginn" else model(IDS, return_dict=True).logits)


@torch.no_grad()
def test_ouro_base_model_honours_return_dict_and_output_flags():
    model = make_model("ouro").model
    out = model(IDS, return_dict=False, output_hidden_states=True, use_cache=False)
    last, hidden = out[0], out[1]
    assert len(hidden) == 1 + layer_calls(model)
    torch.testing.assert_close(last, hidden[-1])


# ---------------------------------------------------------------------------------------------------- labels
@torch.no_grad()
def test_labels_are_shifted_inside_and_shift_labels_is_honoured(arch):
    model = make_model(arch)
    kw = call_kwargs(arch)
    out = model(IDS, labels=IDS, **kw)
    vocab = out.logits.shape[-1]
    expected = F.cross_entropy(out.logits[:, :-1].reshape(-1, vocab).float(), IDS[:, 1:].reshape(-1))
    torch.testing.assert_close(out.loss, expected)
    targets = torch.randint(3, 60, IDS.shape, generator=torch.Generator().manual_seed(3))
    targets[0, :2] = -100
    shifted = model(IDS, labels=torch.zeros_like(IDS), shift_labels=targets, **kw)
    expected = F.cross_entropy(shifted.logits.reshape(-1, vocab).float(), targets.reshape(-1), ignore_index=-100)
    torch.testing.assert_close(shifted.loss, expected)


@torch.no_grad()
def test_huginn_official_unshifted_loss_is_an_explicit_switch():
    model = make_model("huginn")
    out = model(IDS, labels=IDS, unshifted_loss=True, **call_kwargs("huginn"))
    vocab = out.logits.shape[-1]
    torch.testing.assert_close(out.loss, F.cross_entropy(out.logits.reshape(-1, vocab), IDS.reshape(-1)))
    torch.testing.assert_close(out.log_ppl, out.loss)
    shifted = model(IDS, labels=IDS, **call_kwargs("huginn")).loss
    assert not torch.allclose(shifted, out.loss)


# ---------------------------------------------------------------------------------------------------- export
def test_prefill_with_a_full_cache_exports_with_torch_export(arch):
    model = make_model(arch)
    kw = call_kwargs(arch)
    with torch.no_grad():
        eager = model(IDS, attention_mask=LEFT_PAD, past_key_values=FullLoopCache(model), use_cache=True, **kw)
    inputs = {"input_ids": IDS, "attention_mask": LEFT_PAD, "past_key_values": FullLoopCache(model), **kw}
    program = torch.export.export(model, (), {**inputs, "use_cache": True}, strict=False)
    out = program.module()(**{**inputs, "past_key_values": FullLoopCache(model), "use_cache": True})
    torch.testing.assert_close(out.logits, eager.logits)
    exported_cache, eager_cache = cache_of(out), cache_of(eager)
    assert isinstance(exported_cache, FullLoopCache) and exported_cache.get_seq_length() == IDS.shape[1]
    for a, b in zip(exported_cache.layers, eager_cache.layers):
        torch.testing.assert_close(a.keys, b.keys)
        torch.testing.assert_close(a.values, b.values)


def test_prefill_with_a_full_cache_exports_with_transformers_exporter(arch):
    from transformers.exporters.exporter_dynamo import DynamoConfig, DynamoExporter

    model = make_model(arch)
    kw = call_kwargs(arch)
    inputs = {"input_ids": IDS, "attention_mask": LEFT_PAD, "past_key_values": FullLoopCache(model), **kw}
    with torch.no_grad():
        eager = model(**{**inputs, "past_key_values": FullLoopCache(model)}, use_cache=True).logits
    result = DynamoExporter().export(model, dict(inputs), DynamoConfig())
    program = getattr(result, "program", result)  # 5.24: an ExportedModel; 5.17: the ExportedProgram
    out = program.module()(**{**inputs, "past_key_values": FullLoopCache(model)})
    logits = out.logits if hasattr(out, "logits") else out[0]
    torch.testing.assert_close(logits, eager)


@torch.no_grad()
@pytest.mark.parametrize("kind", ["full", "ripe"])
def test_a_filled_loop_cache_survives_a_pytree_round_trip(arch, kind):
    model = make_model(arch)
    kw = call_kwargs(arch)
    make = (lambda: FullLoopCache(model)) if kind == "full" else (lambda: RIPECache(model, window=2))
    cache, twin = make(), make()
    model(IDS, past_key_values=cache, use_cache=True, **kw)
    model(IDS, past_key_values=twin, use_cache=True, **kw)
    leaves, spec = torch.utils._pytree.tree_flatten(cache)
    assert leaves and all(isinstance(t, torch.Tensor) for t in leaves)
    rebuilt = torch.utils._pytree.tree_unflatten(leaves, spec)
    assert type(rebuilt) is type(cache) and rebuilt.plan == cache.plan
    step = IDS[:, :2]
    torch.testing.assert_close(
        model(step, past_key_values=rebuilt, use_cache=True, **kw).logits,
        model(step, past_key_values=twin, use_cache=True, **kw).logits,
    )
    torch.utils._pytree.treespec_dumps(spec)  # the context is JSON-native: an exported program can be saved


def test_frozen_layout_still_refuses_a_real_change():
    layout = make_model("ouro").loop_layout
    layout.n_core = layout.n_core  # an equal re-assignment (what tensor walkers do) passes
    with pytest.raises(AttributeError):
        layout.n_core = layout.n_core + 1


# ---------------------------------------------------------------------------------------------------- generate
@torch.no_grad()
def test_generate_returns_hidden_states_and_attentions_per_step(arch):
    model = make_model(arch)
    flags = dict(output_hidden_states=True, output_attentions=True, return_dict_in_generate=True)
    out = model.generate(IDS, max_new_tokens=3, do_sample=False, pad_token_id=0, **flags, **call_kwargs(arch))
    assert len(out.hidden_states) == len(out.attentions) == 3
    for step, (hidden, attn) in enumerate(zip(out.hidden_states, out.attentions)):
        q = IDS.shape[1] if step == 0 else 1
        assert len(hidden) == 1 + layer_calls(model) and len(attn) == layer_calls(model)
        assert all(isinstance(h, torch.Tensor) and h.shape[:2] == (2, q) for h in hidden)
        assert all(isinstance(a, torch.Tensor) and a.shape[2:] == (q, IDS.shape[1] + step) for a in attn)


@torch.no_grad()
def test_assisted_decoding_with_hidden_states_and_attentions_equals_greedy(arch):
    model = make_model(arch)
    draft = make_model(arch, seed=1)
    kw = dict(max_new_tokens=4, do_sample=False, pad_token_id=0, **call_kwargs(arch))
    flags = dict(output_hidden_states=True, output_attentions=True, return_dict_in_generate=True)
    greedy = model.generate(IDS[:1], **kw)
    assisted = model.generate(IDS[:1], assistant_model=draft, **flags, **kw)
    assert torch.equal(assisted.sequences, greedy)
    assert all(isinstance(a, torch.Tensor) for step in assisted.attentions for a in step)
    assert all(isinstance(h, torch.Tensor) for step in assisted.hidden_states for h in step)


# ---------------------------------------------------------------------------------------------------- differences
def test_sliding_window_configs_are_refused_by_name():
    with pytest.raises(ValueError, match=r"sliding-window.*every \(loop, layer\) cell"):
        OuroConfig(num_hidden_layers=2, use_sliding_window=True, sliding_window=4)


@torch.no_grad()
def test_crop_takes_a_zero_dim_tensor(arch):
    """transformers 5.17's assisted decoding crops the assistant's cache by a 0-d tensor."""
    model = make_model(arch)
    cache = cache_of(model(IDS, use_cache=True, **call_kwargs(arch)))
    cache.crop(torch.tensor(-2))
    assert all(type(layer.get_seq_length()) is int and layer.get_seq_length() == 7 for layer in cache.layers)
