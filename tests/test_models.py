"""Native models on CPU, fp32, tiny random configs: cached generation against recomputation, padding, chunking,
cropping, beam search, sampling, loop-count arguments and the errors a user can hit."""

from __future__ import annotations

import contextlib

import pytest
import torch
from transformers import DynamicCache

from hf_loopcache import FullLoopCache, LoopLayout
from tests.helpers import call_kwargs, make_model

PROMPTS = [[5, 9, 17, 33, 12, 8, 40], [7, 3, 22], [11, 14, 6, 29, 31]]


def left_pad(prompts: list[list[int]], pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, prompts))
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


def generate(model, arch, ids, **kwargs):
    kwargs.setdefault("max_new_tokens", 6)
    kwargs.setdefault("do_sample", False)
    return model.generate(ids, pad_token_id=0, **call_kwargs(arch), **kwargs)


@torch.no_grad()
def test_cached_greedy_equals_recomputation(arch):
    model = make_model(arch)
    ids = torch.tensor([PROMPTS[0]])
    cached = generate(model, arch, ids, output_logits=True, return_dict_in_generate=True)
    plain = generate(model, arch, ids, use_cache=False, output_logits=True, return_dict_in_generate=True)
    assert torch.equal(cached.sequences, plain.sequences)
    for a, b in zip(cached.logits, plain.logits):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


@torch.no_grad()
def test_left_padded_batch_equals_each_row_alone(arch):
    model = make_model(arch)
    ids, mask = left_pad(PROMPTS)
    batch = generate(model, arch, ids, attention_mask=mask, output_logits=True, return_dict_in_generate=True)
    width = ids.shape[1]
    for row, prompt in enumerate(PROMPTS):
        alone = generate(model, arch, torch.tensor([prompt]), output_logits=True, return_dict_in_generate=True)
        assert batch.sequences[row, width:].tolist() == alone.sequences[0, len(prompt) :].tolist()
        for a, b in zip(batch.logits, alone.logits):
            torch.testing.assert_close(a[row], b[0], atol=1e-4, rtol=1e-4)


@torch.no_grad()
def test_chunked_prefill_equals_one_shot(arch):
    model = make_model(arch)
    ids = torch.randint(3, 60, (2, 23), generator=torch.Generator().manual_seed(1))
    one = FullLoopCache(model)
    full = model(ids, cache=one, use_cache=True, **call_kwargs(arch)).logits
    chunked = FullLoopCache(model)
    parts = [
        model(ids[:, a:b], cache=chunked, use_cache=True, **call_kwargs(arch)).logits
        for a, b in [(0, 5), (5, 6), (6, 17), (17, 23)]
    ]
    torch.testing.assert_close(torch.cat(parts, dim=1), full, atol=1e-5, rtol=1e-5)
    for cell in model.loop_layout.cells():
        for x, y in zip(one.cell_states(cell), chunked.cell_states(cell)):
            torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_crop_then_decode_equals_fresh_prefill(arch):
    model = make_model(arch)
    ids = torch.randint(3, 60, (1, 16), generator=torch.Generator().manual_seed(2))
    cache = FullLoopCache(model)
    model(ids[:, :12], cache=cache, use_cache=True, **call_kwargs(arch))
    model(ids[:, 12:15], cache=cache, use_cache=True, **call_kwargs(arch))
    cache.crop(-5)  # back to 10 positions
    assert cache.get_seq_length() == 10
    after = model(ids[:, 10:11], cache=cache, use_cache=True, **call_kwargs(arch)).logits
    fresh_cache = FullLoopCache(model)
    model(ids[:, :10], cache=fresh_cache, use_cache=True, **call_kwargs(arch))
    fresh = model(ids[:, 10:11], cache=fresh_cache, use_cache=True, **call_kwargs(arch)).logits
    torch.testing.assert_close(after, fresh, atol=1e-5, rtol=1e-5)
    cache.crop(8)  # the older absolute-length convention
    assert cache.get_seq_length() == 8


@torch.no_grad()
def test_beam_search_matches_uncached(arch):
    model = make_model(arch)
    ids = torch.tensor([PROMPTS[2]])
    cached = generate(model, arch, ids, num_beams=3, num_return_sequences=2)
    plain = generate(model, arch, ids, num_beams=3, num_return_sequences=2, use_cache=False)
    assert torch.equal(cached, plain)


@torch.no_grad()
def test_sampling_is_seeded_and_cache_independent(arch):
    model = make_model(arch)
    ids, mask = left_pad(PROMPTS[:2])
    runs = []
    for use_cache in (True, True, False):
        torch.manual_seed(7)
        runs.append(generate(model, arch, ids, attention_mask=mask, do_sample=True, top_k=20, use_cache=use_cache))
    assert torch.equal(runs[0], runs[1])
    if arch == "ouro":  # Huginn draws its initial state from the RNG for every token a forward sees, as officially
        assert torch.equal(runs[0], runs[2])


@torch.no_grad()
def test_generate_takes_the_cache_under_this_versions_name(arch):
    model = make_model(arch)
    ids = torch.tensor([PROMPTS[1]])
    cache = FullLoopCache(model)
    out = generate(model, arch, ids, cache=cache)
    assert cache.get_seq_length() == out.shape[1] - 1
    assert torch.equal(out, generate(model, arch, ids))


@torch.no_grad()
def test_growable_dynamic_cache_works_and_fixed_one_fails_loudly(arch):
    model = make_model(arch)
    ids = torch.tensor([PROMPTS[0]])
    assert torch.equal(generate(model, arch, ids, cache=DynamicCache()), generate(model, arch, ids))
    with pytest.raises(ValueError, match="cannot hold|writes"):
        generate(model, arch, ids, cache=DynamicCache(config=model.config))
    with pytest.raises(ValueError, match="cache_implementation"):
        generate(model, arch, ids, cache_implementation="static")


@torch.no_grad()
def test_loop_count_is_a_call_argument():
    model = make_model("ouro")
    ids = torch.tensor([PROMPTS[0]])
    two = model(ids, num_loops=2, exit_at_step=-1).logits
    assert torch.allclose(two, model(ids, exit_at_step=1).logits, atol=1e-5)
    cache = FullLoopCache(model)
    model(ids, num_loops=2, cache=cache)
    assert [cache.layer_for(c).get_seq_length() for c in model.loop_layout.core_cells(2)] == [0, 0]
    out = model.generate(ids, max_new_tokens=3, do_sample=False, num_loops=5)  # default cache sized for 5 loops
    assert out.shape[1] == ids.shape[1] + 3
    huginn = make_model("huginn")
    assert huginn(ids, num_steps=2, init_scale=0.0).logits.shape == (1, ids.shape[1], 64)


@torch.no_grad()
@pytest.mark.parametrize("bad", [0, -1, 2.5, True])
def test_loop_count_out_of_range(arch, bad):
    model = make_model(arch)
    ids = torch.tensor([PROMPTS[1]])
    kw = {"num_loops": bad} if arch == "ouro" else {"num_steps": bad, "init_scale": 0.0}
    with pytest.raises(ValueError, match="num_loops|num_steps"):
        model(ids, **kw)


@torch.no_grad()
def test_more_loops_than_the_cache_holds(arch):
    model = make_model(arch)
    ids = torch.tensor([PROMPTS[1]])
    kw = {"num_loops": 5} if arch == "ouro" else {"num_steps": 6, "init_scale": 0.0}
    with pytest.raises(ValueError, match="holds"):
        model(ids, cache=FullLoopCache(model), use_cache=True, **kw)
    cache = FullLoopCache(model, num_loops=6)
    model(ids, cache=cache, use_cache=True, **kw)


@torch.no_grad()
def test_cache_of_another_layout_fails_at_first_use():
    ouro, huginn = make_model("ouro"), make_model("huginn")
    ids = torch.tensor([PROMPTS[1]])
    with pytest.raises(ValueError, match="built for"):
        huginn(ids, cache=FullLoopCache(ouro), use_cache=True, init_scale=0.0)
    wide = make_model("ouro", num_attention_heads=2, num_key_value_heads=2)
    with pytest.raises(ValueError, match="built for"):
        wide(ids, cache=FullLoopCache(ouro), use_cache=True)


def test_unknown_slot_index_on_plain_update():
    cache = FullLoopCache(LoopLayout(n_core=2, num_loops=3, num_kv_heads=4, head_dim=8))
    k = torch.zeros(1, 4, 2, 8)
    with pytest.raises(IndexError, match="unknown slot index"):
        cache.update(k, k, 6)
    with pytest.raises(IndexError, match="unknown slot index"):
        cache.update(k, k, -1)
    with pytest.raises(ValueError, match="built for"):
        cache.update(torch.zeros(1, 3, 2, 8), torch.zeros(1, 3, 2, 8), 0)


def test_config_validation_errors():
    with pytest.raises(ValueError, match="rope_scaling"):
        make_model("ouro", rope_scaling={"rope_type": "yarn", "factor": 2.0})
    with pytest.raises(ValueError, match="num_key_value_heads"):
        make_model("ouro", num_attention_heads=4, num_key_value_heads=3)
    with pytest.raises(ValueError, match="test_time_noise"):
        make_model("huginn", test_time_noise=0.1)
    with pytest.raises(ValueError, match="exit_at_step"):
        make_model("ouro")(torch.tensor([[3, 4]]), exit_at_step=3)


@torch.no_grad()
@pytest.mark.parametrize("keep", [False, True])
def test_layer_outputs_are_freed_unless_hidden_states_are_asked_for(arch, keep):
    """Without `output_hidden_states` a forward holds no layer's output beyond the next layers: kept, every (loop,
    layer) output of the prompt stays alive to the forward's end (3.2 GiB per 8K row on Ouro-1.4B, 11 GiB on
    Huginn-0125)."""
    import weakref

    model = make_model(arch)
    outputs: list[weakref.ref] = []
    most_alive = [0]

    def hook(mod, args, out):
        most_alive[0] = max(most_alive[0], sum(ref() is not None for ref in outputs))
        outputs.append(weakref.ref(out))

    blocks = [m for m in model.modules() if type(m).__name__.endswith(("DecoderLayer", "Block"))]
    assert blocks, "no decoder blocks found"
    hooks = [b.register_forward_hook(hook) for b in blocks]
    ids = torch.randint(3, 60, (1, 12), generator=torch.Generator().manual_seed(0))
    out = model(ids, use_cache=False, output_hidden_states=keep, **call_kwargs(arch))
    for handle in hooks:
        handle.remove()
    calls = len(outputs)
    assert calls > len(blocks) >= 2  # the loops re-ran the blocks
    if keep:
        assert len(out.hidden_states) >= calls
        assert most_alive[0] >= calls // 2  # (Ouro keeps each loop's last output after its norm)
    else:
        assert most_alive[0] <= 2, f"{most_alive[0]} of {calls} layer outputs were alive at once"


@pytest.mark.parametrize("arch, cache_kind", [("ouro", "full"), ("huginn", "full"), ("ouro", "ripe")])
def test_decode_step_launches_one_rotation_one_write_and_paired_norms_per_layer_call(monkeypatch, arch, cache_kind):
    """With the fused kernels on (their launchers replaced by counting references, so this runs on the CPU), a decode
    step over a static cache launches per layer call: one RoPE for queries and keys, one write of the cell's keys and
    values, and fewer norms (a residual norm and the norm that reads its output as one), with the same logits as the
    op-by-op path."""
    from hf_loopcache import FullLoopCache, RIPECache
    from triton_ops import fused
    from triton_ops.fused import ops, reference

    launches: list[str] = []

    def count(name, fn):
        return lambda *a, **kw: launches.append(name) or fn(*a, **kw)

    def norm(x, w, eps, before, after, then):
        h = reference.ref_rms_norm(x, w, eps, add_before=before, add_after=after)
        return h, (None if then is None else reference.ref_rms_norm(h, *then))

    def rotate(x, cos, sin, bias, pairs):
        fn = reference.ref_rotate_pairs if pairs else reference.ref_rotate_half
        return (fn(x, cos, sin, bias) if pairs else fn(x, cos, sin)).contiguous()

    def write(k, v, key, value, positions, modulo, sink):
        reference.ref_write_kv(k, v, key, value, positions, modulo=modulo, sink=sink)

    model = make_model(arch)
    ids = torch.randint(3, 60, (2, 6), generator=torch.Generator().manual_seed(0))
    logits = []
    for on in (False, True):
        if cache_kind == "full":
            cache = FullLoopCache(model, static=True, max_batch_size=2, max_cache_len=16)
        else:  # static windowed cells with a sink: ring and sink written by one launch
            cache = RIPECache(model, window=3, sink=2, static=True, max_batch_size=2, max_cache_len=16)
        with torch.no_grad():
            model(ids, cache=cache, use_cache=True, **call_kwargs(arch))
            with monkeypatch.context() as m:
                if on:
                    m.setattr(ops, "_fused", lambda op, *tensors: op != "silu_mul" and ops.enabled())
                    m.setattr(ops, "_rms_norm", count("norm", norm))
                    m.setattr(ops, "_rotate", count("rotate", rotate))
                    m.setattr(ops, "_write_kv", count("write", write))
                launches.clear()
                with contextlib.nullcontext() if on else fused.disabled():
                    logits.append(model(ids[:, :1], cache=cache, use_cache=True, **call_kwargs(arch)).logits)
    calls = len(cache.cells)  # one layer call per cell
    assert launches.count("rotate") == calls and launches.count("write") == calls  # (a shared cell: ring and sink)
    if arch == "ouro":  # each residual norm with the norm after it: the first layer's input norm of a loop alone
        assert launches.count("norm") == 2 * calls + model.config.total_ut_steps
    else:  # the same within each run of blocks (prelude, each core step, coda: its first `norm_1` alone; the last
        # core block's output goes to the adapter), plus `ln_f` after the core (the coda's last block chains the other)
        cfg = model.config
        runs = 2 + (calls - cfg.n_layers_in_prelude - cfg.n_layers_in_coda) // cfg.n_layers_in_recurrent_block
        assert launches.count("norm") == 2 * calls + runs + 1
    torch.testing.assert_close(logits[1], logits[0], rtol=0, atol=0)


def test_ouro_chained_norms_follow_a_hook_that_replaces_a_layer_output(monkeypatch):
    """A layer call hands the next layer its input norm (computed with its output in one kernel); a forward hook that
    replaces the output gets its replacement normed instead, as the unchained forward does."""
    from hf_loopcache.models.ouro import modeling_ouro

    model = make_model("ouro")
    ids = torch.randint(3, 60, (2, 7), generator=torch.Generator().manual_seed(0))
    model.model.layers[0].register_forward_hook(lambda mod, args, out: out * 1.5)
    model.model.layers[-1].register_forward_hook(lambda mod, args, out: out - 0.25)
    with torch.no_grad():
        chained = model(ids, use_cache=False).logits
        monkeypatch.setattr(modeling_ouro, "_norm_chain", lambda m: [None] * len(m.layers))
        plain = model(ids, use_cache=False).logits
    torch.testing.assert_close(chained, plain, rtol=0, atol=0)
