"""`stacked_linear`: short inputs run several projections of one input as one GEMM over the weights moved into one
buffer (no copy kept), with the model's outputs, parameters and checkpoints unchanged."""

import torch
from torch import nn

from hf_loopcache.models._common import STACK_TOKENS, stacked_linear
from tests.helpers import tiny_ouro

torch.set_num_threads(1)
QKV = ("q_proj", "k_proj", "v_proj")


def _attn(model):
    return model.model.layers[0].self_attn


def _stacked(attn) -> bool:
    """The three weights are slices of one buffer, in order."""
    w = [getattr(attn, n).weight for n in QKV]
    base = w[0].untyped_storage().data_ptr()
    return all(t.untyped_storage().data_ptr() == base for t in w) and w[1].data_ptr() == w[0].data_ptr() + w[0].nbytes


def test_stacked_matches_separate_projections_and_keeps_parameters():
    model = tiny_ouro()
    attn = _attn(model)
    params = [getattr(attn, n).weight for n in QKV]
    before = [p.detach().clone() for p in params]
    x = torch.randn(2, 3, model.config.hidden_size)
    with torch.no_grad():
        want = [getattr(attn, n)(x) for n in QKV]
        got = stacked_linear(attn, QKV, x)
    assert _stacked(attn)
    assert [getattr(attn, n).weight for n in QKV] == params  # the same Parameter objects
    for p, b in zip(params, before):
        assert torch.equal(p, b)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)


def test_model_outputs_unchanged_by_stacking():
    model = tiny_ouro()
    ids = torch.randint(1, model.config.vocab_size, (2, 5))
    with torch.no_grad():
        ref = model(input_ids=ids[:, :1], use_cache=False).logits  # stacks (one token a row)
        assert _stacked(_attn(model))
    fresh = tiny_ouro()
    with torch.enable_grad():  # gradients on: the projections run one by one
        plain = fresh(input_ids=ids[:, :1], use_cache=False).logits
    assert not _stacked(_attn(fresh))
    torch.testing.assert_close(ref, plain.detach(), rtol=1e-5, atol=1e-5)


def test_replaced_weights_rebuild_the_buffer():
    model = tiny_ouro()
    attn = _attn(model)
    x = torch.randn(1, 1, model.config.hidden_size)
    with torch.no_grad():
        stacked_linear(attn, QKV, x)
        model.to(torch.float64)  # every weight replaced
        assert not _stacked(attn)
        new = torch.randn_like(attn.k_proj.weight)
        attn.k_proj.weight = nn.Parameter(new)  # a weight replaced by assignment
        got = stacked_linear(attn, QKV, x.double())
    assert _stacked(attn)
    torch.testing.assert_close(got[1], x.double() @ new.T)


def test_gradients_long_inputs_and_hooks_run_one_by_one():
    model = tiny_ouro()
    attn = _attn(model)
    h = model.config.hidden_size
    out = stacked_linear(attn, QKV, torch.randn(1, 2, h))  # grad mode, weights require grad
    sum(o.sum() for o in out).backward()
    assert attn.k_proj.weight.grad is not None and not _stacked(attn)
    with torch.no_grad():
        stacked_linear(attn, QKV, torch.randn(1, STACK_TOKENS + 1, h))
        assert not _stacked(attn)
        handle = attn.q_proj.register_forward_hook(lambda *a: None)
        stacked_linear(attn, QKV, torch.randn(1, 1, h))
        assert not _stacked(attn)
        handle.remove()
        stacked_linear(attn, QKV, torch.randn(1, 1, h))
        assert _stacked(attn)


def test_checkpoint_round_trip_after_stacking(tmp_path):
    model = tiny_ouro()
    with torch.no_grad():
        model(input_ids=torch.tensor([[3]]), use_cache=False)
    assert _stacked(_attn(model))
    model.save_pretrained(tmp_path)
    loaded = type(model).from_pretrained(tmp_path).eval()
    for (name, p), (name2, q) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert name == name2
        assert torch.equal(p, q), name
