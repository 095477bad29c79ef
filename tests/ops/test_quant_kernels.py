"""The Triton quantize kernels (the flush) against `triton_ops.quant.naive`: identical codes, scales and zero points.

Runs on CUDA, or on the CPU under `TRITON_INTERPRET=1` (started by `tests/ops/test_triton_interpreter.py`).
"""

from __future__ import annotations

import os

import pytest
import torch

from triton_ops.quant import naive

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() or INTERPRET), reason="needs CUDA or TRITON_INTERPRET=1 (see test_triton_interpreter)"
)

# (B, H, T, D, group_size)
CASES = [(1, 1, 32, 32, 32), (2, 3, 64, 64, 32), (2, 2, 32, 48, 16), (1, 2, 32, 128, 32), (1, 1, 96, 8, 32), (2, 2, 64, 96, 32)]
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if torch.cuda.is_available() else [])


def _same_bits(a, b):
    """Bytes equal (fp16 compared as int16 so that -0.0 != +0.0 and NaN payloads count)."""
    if a is None or b is None:
        return a is None and b is None
    if a.dtype == torch.float16:
        a, b = a.view(torch.int16), b.view(torch.int16)
    return torch.equal(a.cpu(), b.cpu())


# fp32 group ranges [0, r] whose `r / qmax` rounds to another fp16 than `r * fp32(1 / qmax)` does: a kernel that
# multiplies by a reciprocal instead of dividing gets a different scale byte (README "Contract for kernels" 2)
_RECIPROCAL_TRAPS = {4: 1.851654052734375, 2: 6.372069835662842}


def _data(shape, dtype, seed, nbits=4, group_size=32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g) * 3 + torch.randn(*shape[:2], 1, shape[3], generator=g)
    x[..., 0, : min(3, shape[3])] = 0.0  # exact zeros, -0.0 and ties to even
    x[..., 1, :1] = -0.0
    x[..., 2, :] = 0.5  # a constant channel group / page row
    x[..., 3, :] = torch.arange(shape[3]) * 0.25  # codes exactly half-way
    trap = _RECIPROCAL_TRAPS[nbits]
    if shape[3] > 1:  # key channel 1 of page 0 spans [0, trap]
        x[..., 1] = x[..., 1].clamp(0, trap)
        x[..., 0, 1], x[..., 1, 1] = 0.0, trap
    x[..., 5, :group_size] = x[..., 5, :group_size].clamp(0, trap)  # value group 0 of token 5 spans [0, trap]
    x[..., 5, 0], x[..., 5, 1] = 0.0, trap
    return x.to(dtype)


@pytest.mark.parametrize("case", [pytest.param(c, id="B{}-H{}-T{}-D{}-gs{}".format(*c)) for c in CASES])
@pytest.mark.parametrize("nbits", [2, 4], ids=["bits2", "bits4"])
@pytest.mark.parametrize("dtype", DTYPES, ids=[str(d).split(".")[1] for d in DTYPES])
def test_quantize_keys_bit_exact(case, nbits, dtype):
    from triton_ops.quant.ops import _quantize_keys_fwd

    b, h, t, d, gs = case
    if d % (8 // nbits):
        pytest.skip("D does not pack")
    x = _data((b, h, t, d), dtype, 0, nbits, gs)
    ref = naive.quantize_keys(x, nbits, group_size=gs)
    got = _quantize_keys_fwd(x.to(DEVICE), nbits, gs, None)
    for name in ("codes", "scale", "zero"):
        assert _same_bits(getattr(got, name), getattr(ref, name)), name
    # padding: masked tokens hold garbage (NaN, inf) and take no part; a page with no valid token gives 0 / 0
    valid = torch.rand(b, t, generator=torch.Generator().manual_seed(1)) > 0.4
    valid[0, :gs] = False
    x_pad = x.clone()
    x_pad[~valid[:, None, :, None].expand_as(x)] = float("nan")
    x_pad[..., 5, :] = torch.where(valid[:, None, 5, None], x_pad[..., 5, :], float("inf"))
    ref = naive.quantize_keys(x_pad, nbits, group_size=gs, valid=valid)
    got = _quantize_keys_fwd(x_pad.to(DEVICE), nbits, gs, valid.to(DEVICE))
    for name in ("codes", "scale", "zero"):
        assert _same_bits(getattr(got, name), getattr(ref, name)), f"{name} with padding"


@pytest.mark.parametrize("case", [pytest.param(c, id="B{}-H{}-T{}-D{}-gs{}".format(*c)) for c in CASES if c[3] % c[4] == 0])
@pytest.mark.parametrize("nbits", [2, 4], ids=["bits2", "bits4"])
@pytest.mark.parametrize("dtype", DTYPES, ids=[str(d).split(".")[1] for d in DTYPES])
def test_quantize_values_bit_exact(case, nbits, dtype):
    from triton_ops.quant.ops import _quantize_values_fwd

    b, h, t, d, gs = case
    x = _data((b, h, t, d), dtype, 2, nbits, gs)
    strided = x.transpose(2, 3).contiguous().transpose(2, 3).to(DEVICE)  # a non-contiguous input is read in place
    ref = naive.quantize_values(x, nbits, group_size=gs)
    got = _quantize_values_fwd(strided, nbits, gs)
    for name in ("hi", "lo", "scale", "zero"):
        assert _same_bits(getattr(got, name), getattr(ref, name)), name


@pytest.mark.skipif(not torch.cuda.is_available(), reason="dispatch to Triton needs CUDA")
def test_public_quantize_dispatches_to_triton_on_cuda(monkeypatch):
    from triton_ops.quant import ops, quantize_keys, quantize_values

    calls = []
    monkeypatch.setattr(ops, "_quantize_keys_fwd", lambda *a: calls.append("k") or naive.quantize_keys(a[0], a[1], group_size=a[2], valid=a[3]))
    monkeypatch.setattr(ops, "_quantize_values_fwd", lambda *a: calls.append("v") or naive.quantize_values(a[0], a[1], group_size=a[2]))
    x = torch.randn(1, 2, 32, 64, device="cuda")
    quantize_keys(x, 4)
    quantize_values(x, 4)
    assert calls == ["k", "v"]
    with pytest.raises(ValueError, match="float16 range"):
        quantize_keys(x * 1e6, 4)
