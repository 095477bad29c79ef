"""The fused layer ops' Triton kernels against `triton_ops.fused.reference` (the models' eager math).

Runs on CUDA, or on the CPU under `TRITON_INTERPRET=1` (started by `tests/ops/test_triton_interpreter.py`); the
dispatch rules and errors run on any machine.
"""

from __future__ import annotations

import os

import pytest
import torch

from triton_ops import fused
from triton_ops.fused import ops, reference

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
kernels = pytest.mark.skipif(
    not (torch.cuda.is_available() or INTERPRET), reason="needs CUDA or TRITON_INTERPRET=1 (see test_triton_interpreter)"
)
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if torch.cuda.is_available() else [])


@pytest.fixture(autouse=True)
def _kernels_on_cpu(monkeypatch):
    """Under the interpreter the kernels take CPU tensors: let the dispatch send them there."""
    if INTERPRET and not torch.cuda.is_available():
        monkeypatch.setattr(ops, "use_triton", lambda op, *tensors: True)


def _rand(shape, dtype, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale).to(dtype).to(DEVICE)


def _ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """Largest distance in units of the last place of `a`'s dtype (same-sign values)."""
    if a.dtype == torch.float32:
        ia, ib = a.contiguous().view(torch.int32).long(), b.contiguous().view(torch.int32).long()
    else:
        ia, ib = a.contiguous().view(torch.int16).long(), b.contiguous().view(torch.int16).long()
    return int((ia - ib).abs().max()) if a.numel() else 0


@kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [64, 80, 2048])
@pytest.mark.parametrize("residual", [None, "before", "after"])
def test_rms_norm_matches_reference(dtype, n, residual):
    x, w = _rand((3, 2, n), dtype, 0, 3.0), _rand((n,), dtype, 1)
    r = _rand((3, 2, n), dtype, 2)
    kw = {} if residual is None else {f"add_{residual}": r}
    out = fused.rms_norm(x, w, 1e-6, **kw)
    ref = reference.ref_rms_norm(x, w, 1e-6, **kw)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    # one reduction in another order: the normed value may move by a unit of its dtype, then the scale and the
    # residual round it again
    if dtype == torch.float32:  # (the sum's order and the square root's rounding: a few fp32 units)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    else:
        assert _ulps(out, ref) <= 2
        assert (out != ref).float().mean() < 0.05
    if residual is not None:  # the residual is really applied where it belongs
        other = reference.ref_rms_norm(x, w, 1e-6, **{("add_after" if residual == "before" else "add_before"): r})
        assert not torch.allclose(out.float(), other.float(), atol=1e-2)


@kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1, 16, 128), (2, 3, 5, 64), (2, 4, 20, 32)])
def test_rotate_half_equals_reference(dtype, shape):
    b, q, h, d = shape
    x = _rand(shape, dtype, 3)
    angles = _rand((b, q, d // 2), torch.float32, 4, 3.0)
    emb = torch.cat([angles, angles], -1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    out = fused.rotate_half(x, cos, sin)
    ref = reference.ref_rotate_half(x, cos, sin)
    assert out.is_contiguous()
    assert torch.equal(out, ref)  # elementwise, rounded where the eager code rounds: bit for bit
    strided = _rand((b, q, h * d * 2), dtype, 5)[..., : h * d].view(b, q, h, d)  # a slice of a wider projection
    assert torch.equal(fused.rotate_half(strided, cos, sin), reference.ref_rotate_half(strided, cos, sin))


@kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [False, True])
def test_rotate_pairs_matches_reference(dtype, bias):
    b, q, h, d = 2, 3, 5, 64
    wide = _rand((b, q, (h + 2) * d), dtype, 6)
    x = wide[..., : h * d].view(b, q, h, d)  # Huginn's q: a slice of the fused qkv projection
    angles = _rand((b, q, 1, d // 2), torch.float32, 7, 3.0)
    cos, sin = angles.cos(), angles.sin()
    bias_t = _rand((1, h, d), dtype, 8) if bias else None
    out = fused.rotate_pairs(x, cos, sin, bias=bias_t)
    ref = reference.ref_rotate_pairs(x, cos, sin, bias_t)
    # fp32 inside, one rounding at the end; a fused multiply-add may move the fp32 value by a unit, so the result
    # may differ by one unit of its dtype
    assert _ulps(out, ref) <= 1
    assert (out != ref).float().mean() < 0.05
    if bias:
        assert not torch.equal(out, reference.ref_rotate_pairs(x, cos, sin))


@kernels
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_matches_reference(dtype):
    both = _rand((2, 3, 2 * 300), dtype, 9, 4.0)
    gate, up = both.chunk(2, dim=-1)  # two halves of one projection (Huginn's GatedMLP)
    out = fused.silu_mul(gate, up)
    ref = reference.ref_silu_mul(gate, up)
    assert out.is_contiguous() and out.shape == ref.shape
    torch.testing.assert_close(out.float(), ref.float(), rtol=2 * torch.finfo(dtype).eps, atol=1e-6)
    assert _ulps(out, ref) <= 1 or dtype == torch.float32


def test_dispatch_takes_the_reference_off_cuda_under_autograd_and_when_disabled(monkeypatch):
    calls = []
    monkeypatch.setattr(ops, "use_triton", lambda op, *tensors: calls.append(op) or False)
    x, w = torch.randn(2, 8), torch.ones(8)
    torch.testing.assert_close(fused.rms_norm(x, w, 1e-6), reference.ref_rms_norm(x, w, 1e-6), rtol=0, atol=0)
    assert calls == ["rms_norm"]
    with fused.disabled():
        assert not fused.enabled()
        fused.rms_norm(x, w, 1e-6)
    assert fused.enabled() and calls == ["rms_norm"]  # disabled: never asked
    fused.rms_norm(x, w.requires_grad_(), 1e-6)
    assert calls == ["rms_norm"]  # gradients: the reference, which autograd can differentiate


def test_bad_arguments_are_named():
    x = torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match="`cos` and `sin` must have shape"):
        fused.rotate_half(x, torch.randn(1, 2, 4), torch.randn(1, 2, 4))
    with pytest.raises(ValueError, match="`add_after` must have the shape"):
        fused.rms_norm(x, torch.ones(8), 1e-6, add_after=torch.randn(8))
    with pytest.raises(ValueError, match="`up` must have the shape"):
        fused.silu_mul(x, x.half())
    with pytest.raises(ValueError, match="`bias` must hold 4 x 8"):
        fused.rotate_pairs(x, torch.randn(1, 2, 1, 4), torch.randn(1, 2, 1, 4), bias=torch.randn(3, 8))


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["ouro", "huginn"])
def test_models_give_the_same_tokens_with_and_without_the_fused_kernels(arch):
    """On CUDA the models' norms, RoPE and gated activation run the fused kernels: fp32 greedy tokens equal the op-by-op
    path's, and bf16 logits stay within bf16 rounding of it."""
    from tests.helpers import call_kwargs, make_model

    ids = torch.randint(3, 60, (2, 17), generator=torch.Generator().manual_seed(0)).cuda()
    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 0.1)):
        model = make_model(arch).to("cuda", dtype)
        kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True,
                  **call_kwargs(arch))
        with torch.no_grad():
            fast = model.generate(ids, **kw)
            with fused.disabled():
                slow = model.generate(ids, **kw)
        if dtype == torch.float32:
            assert torch.equal(fast.sequences, slow.sequences)
        torch.testing.assert_close(fast.logits[0], slow.logits[0], atol=tol, rtol=tol)
