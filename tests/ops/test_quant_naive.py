"""Tests of the pure-PyTorch KIVI reference codecs (`triton_ops.quant.naive`): the contract of the Triton kernels."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from triton_ops.quant import (
    QuantizedKeys,
    QuantizedValues,
    cold_value_error_bound,
    dequantize_keys,
    dequantize_values,
    fake_quantize_keys,
    fake_quantize_values,
    kivi_bytes_per_token,
    pack_codes,
    quantize_keys,
    quantize_values,
    unpack_codes,
)

# (B, H, T, D, group_size); every case is valid for keys (T % gs == 0) and values (D % gs == 0).
CASES = [(1, 1, 32, 32, 32), (2, 3, 64, 64, 32), (2, 2, 32, 48, 16)]
CASE_IDS = [f"B{b}-H{h}-T{t}-D{d}-gs{g}" for b, h, t, d, g in CASES]
NBITS = [2, 4]
NBITS_IDS = [f"bits{n}" for n in NBITS]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DTYPE_IDS = ["fp32", "fp16", "bf16"]


def _randn(shape, dtype=torch.float32, seed=0, scale=1.0, offset=0.0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=gen) * scale + offset).to(dtype)


def _qmax(nbits):
    return 2**nbits - 1


# ---------------------------------------------------------------------------------------------------------------------
# helpers: group statistics in float64, tolerance of the round trip
# ---------------------------------------------------------------------------------------------------------------------


def _key_minmax(x, gs, valid=None):
    """fp64 min/max of every (page, channel) group over valid tokens -> [B, H, G, D] each (0 for empty groups)."""
    b, h, t, d = x.shape
    x64 = x.double().reshape(b, h, t // gs, gs, d)
    if valid is None:
        return x64.amin(3), x64.amax(3)
    m = valid.reshape(b, 1, t // gs, gs, 1)
    mn = torch.where(m, x64, torch.inf).amin(3)
    mx = torch.where(m, x64, -torch.inf).amax(3)
    anyv = m.any(3)
    return torch.where(anyv, mn, 0.0), torch.where(anyv, mx, 0.0)


def _value_minmax(x, gs):
    b, h, t, d = x.shape
    x64 = x.double().reshape(b, h, t, d // gs, gs)
    return x64.amin(4), x64.amax(4)


def _tolerance(mn, mx, scale16, zero16, nbits):
    """Per-group bound on |x - x_hat|: half a step + what fp16 rounding of zero/scale can add + fp32 slack.

    Codes use the fp16 scale/zero, so a value can fall just outside [zero16, zero16 + qmax * scale16] and be clamped:
    that costs at most |zero16 - mn| at the bottom and |zero16 - mn| + qmax * |scale16 - scale_exact| at the top.
    """
    qmax = _qmax(nbits)
    s, z = scale16.double(), zero16.double()
    exact = (mx - mn) / qmax
    slack = 1e-6 * (mn.abs() + mx.abs() + qmax * s) + 1e-30
    return s / 2 + (z - mn).abs() + qmax * (s - exact).abs() + slack


def _numpy_reference(x32: np.ndarray, nbits: int, valid: np.ndarray | None = None):
    """Independent NumPy statement of the contract, groups along the LAST axis of `x32` (float32).

    Returns (codes uint8 like x32, scale float16, zero float16) with scale/zero of shape x32.shape[:-1].
    """
    qmax = np.float32(_qmax(nbits))
    if valid is None:
        valid = np.ones(x32.shape, dtype=bool)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        mn = np.where(valid, x32, np.float32(np.inf)).min(-1)
        mx = np.where(valid, x32, np.float32(-np.inf)).max(-1)
        anyv = valid.any(-1)
        mn = np.where(anyv, mn, np.float32(0)).astype(np.float32)
        mx = np.where(anyv, mx, np.float32(0)).astype(np.float32)
        scale16 = ((mx - mn) / qmax).astype(np.float16)  # float32 IEEE division, then round to nearest even
        zero16 = mn.astype(np.float16)
        scale16[scale16 == 0] = 0  # canonical +0.0
        zero16[zero16 == 0] = 0
        s = scale16.astype(np.float32)[..., None]
        z = zero16.astype(np.float32)[..., None]
        q = (x32 - z) / s
        q = np.where(s == 0, np.float32(0), q)
        q = np.rint(q)  # half to even
        q = np.nan_to_num(q, nan=0.0, posinf=float(qmax), neginf=0.0)
        codes = np.clip(q, 0, qmax).astype(np.uint8)
    return codes, scale16, zero16


# ---------------------------------------------------------------------------------------------------------------------
# packing
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("nbits", NBITS, ids=NBITS_IDS)
@pytest.mark.parametrize("shape", [(1, 1, 1, 8), (2, 3, 5, 64), (7, 12)], ids=lambda s: "x".join(map(str, s)))
def test_pack_unpack_round_trip(shape, nbits):
    gen = torch.Generator().manual_seed(1)
    codes = torch.randint(0, 2**nbits, shape, generator=gen, dtype=torch.uint8)
    packed = pack_codes(codes, nbits)
    assert packed.dtype == torch.uint8
    assert packed.shape == (*shape[:-1], shape[-1] * nbits // 8)
    assert torch.equal(unpack_codes(packed, nbits, shape[-1]), codes)


def test_pack_bit_order_is_little_end_first():
    # 4-bit: element 2i in the low nibble, 2i+1 in the high nibble.
    four = torch.tensor([0x3, 0xA, 0xF, 0x0], dtype=torch.uint8)
    assert pack_codes(four, 4).tolist() == [0xA3, 0x0F]
    # 2-bit: element 4i + j in bits 2j..2j+1.
    two = torch.tensor([1, 2, 3, 0, 3, 3, 3, 3, 0, 0, 0, 1], dtype=torch.uint8)
    assert pack_codes(two, 2).tolist() == [0b00_11_10_01, 0xFF, 0b01_00_00_00]


# ---------------------------------------------------------------------------------------------------------------------
# exact contract against an independent NumPy statement
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("nbits", NBITS, ids=NBITS_IDS)
def test_keys_bit_exact_against_numpy(nbits, dtype):
    b, h, t, d, gs = 2, 2, 32, 16, 8
    x = _randn((b, h, t, d), dtype, seed=2, scale=3.0, offset=0.5)
    valid = torch.ones(b, t, dtype=torch.bool)
    valid[1, :5] = False  # left padding of row 1 ...
    valid[1, 8:16] = False  # ... and one fully padded page
    x = x.clone()
    x[1, :, :5] = 1e4  # huge padding
    qk = quantize_keys(x, nbits, group_size=gs, valid=valid)

    # groups along the last axis: [B, H, G, D, gs]
    x_np = x.float().reshape(b, h, t // gs, gs, d).transpose(3, 4).numpy()
    v_np = valid.reshape(b, 1, t // gs, gs, 1).expand(b, h, t // gs, gs, d).transpose(3, 4).numpy()
    codes, scale16, zero16 = _numpy_reference(x_np, nbits, v_np)
    codes = torch.from_numpy(codes).transpose(3, 4).reshape(b, h, t, d)
    assert torch.equal(unpack_codes(qk.codes, nbits, d), codes)
    assert torch.equal(qk.scale, torch.from_numpy(scale16))
    assert torch.equal(qk.zero, torch.from_numpy(zero16))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("nbits", NBITS, ids=NBITS_IDS)
def test_values_bit_exact_against_numpy(nbits, dtype):
    b, h, t, d, gs = 2, 2, 8, 32, 16
    x = _randn((b, h, t, d), dtype, seed=3, scale=2.0, offset=-1.0)
    qv = quantize_values(x, nbits, group_size=gs)
    codes, scale16, zero16 = _numpy_reference(x.float().reshape(b, h, t, d // gs, gs).numpy(), nbits)
    codes = torch.from_numpy(codes).reshape(b, h, t, d)
    assert torch.equal(qv.codes(), codes)
    assert torch.equal(qv.scale, torch.from_numpy(scale16))
    assert torch.equal(qv.zero, torch.from_numpy(zero16))


def test_round_half_to_even():
    # One page, one channel: min 0, max 3 -> scale 1 (exact in fp16) for 2 bits; 0.5 -> 0, 1.5 -> 2, 2.5 -> 2.
    x = torch.tensor([0.0, 3.0, 0.5, 1.5, 2.5, 1.0, 2.0, 0.0]).reshape(1, 1, 8, 1).expand(1, 1, 8, 4).contiguous()
    qk = quantize_keys(x, 2, group_size=8)
    assert unpack_codes(qk.codes, 2, 4)[0, 0, :, 0].tolist() == [0, 3, 0, 2, 2, 1, 2, 0]


def test_signed_zero_is_canonical():
    # min is -0.0 for some groups, +0.0 for others, and a tiny negative that rounds to -0.0 in fp16
    x = torch.tensor([[-0.0, 1.0, 0.0, 2.0], [0.0, -0.0, 0.0, -0.0], [-1e-9, 1.0, 2.0, 3.0], [0.0] * 4])
    x = x.reshape(1, 1, 4, 4)
    for nbits in NBITS:
        qk = quantize_keys(x.transpose(2, 3).contiguous(), nbits, group_size=4)
        qv = quantize_values(x, nbits, group_size=4)
        for t in (qk.scale, qk.zero, qv.scale, qv.zero):
            assert not torch.signbit(t[t == 0]).any()


# ---------------------------------------------------------------------------------------------------------------------
# round-trip error, code range, bit planes
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("nbits", NBITS, ids=NBITS_IDS)
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_keys_round_trip_error_within_half_step(case, nbits, dtype):
    b, h, t, d, gs = case
    x = _randn((b, h, t, d), dtype, seed=4, scale=2.0, offset=1.0)
    qk = quantize_keys(x, nbits, group_size=gs)
    assert qk.codes.shape == (b, h, t, d * nbits // 8) and qk.codes.dtype == torch.uint8
    assert qk.scale.shape == qk.zero.shape == (b, h, t // gs, d)
    assert qk.scale.dtype == qk.zero.dtype == torch.float16
    x_hat = dequantize_keys(qk)
    assert x_hat.dtype == torch.float32 and x_hat.shape == x.shape
    tol = _tolerance(*_key_minmax(x, gs), qk.scale, qk.zero, nbits).repeat_interleave(gs, dim=2)
    assert ((x_hat.double() - x.double()).abs() <= tol).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("nbits", NBITS, ids=NBITS_IDS)
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_values_round_trip_error_within_half_step(case, nbits, dtype):
    b, h, t, d, gs = case
    x = _randn((b, h, t, d), dtype, seed=5, scale=0.5, offset=-0.25)
    qv = quantize_values(x, nbits, group_size=gs)
    assert qv.hi.shape == (b, h, t, d // 4) and qv.hi.dtype == torch.uint8
    assert (qv.lo is None) == (nbits == 2)
    assert qv.scale.shape == qv.zero.shape == (b, h, t, d // gs)
    x_hat = dequantize_values(qv)
    assert x_hat.dtype == torch.float32 and x_hat.shape == x.shape
    tol = _tolerance(*_value_minmax(x, gs), qv.scale, qv.zero, nbits).repeat_interleave(gs, dim=3)
    assert ((x_hat.double() - x.double()).abs() <= tol).all()


@pytest.mark.parametrize("nbits", NBITS, ids=NBITS_IDS)
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_codes_in_range_and_span_it(case, nbits):
    b, h, t, d, gs = case
    x = _randn((b, h, t, d), seed=6)
    qmax = _qmax(nbits)
    kc = unpack_codes(quantize_keys(x, nbits, group_size=gs).codes, nbits, d).reshape(b, h, t // gs, gs, d)
    vc = quantize_values(x, nbits, group_size=gs).codes().reshape(b, h, t, d // gs, gs)
    for codes, dim in ((kc, 3), (vc, 4)):
        assert int(codes.max()) <= qmax
        # every group's min maps to 0 and its max to qmax
        assert (codes.amin(dim) == 0).all() and (codes.amax(dim) == qmax).all()


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_int4_value_bit_planes(case):
    b, h, t, d, gs = case
    x = _randn((b, h, t, d), seed=7)
    qv = quantize_values(x, 4, group_size=gs)
    hi, lo = unpack_codes(qv.hi, 2, d), unpack_codes(qv.lo, 2, d)
    codes = qv.codes()
    assert int(codes.max()) <= 15
    assert torch.equal(codes, 4 * hi + lo)
    assert torch.equal(hi, codes // 4) and torch.equal(lo, codes % 4)
    # the planes decode to the same values as an unsplit 4-bit code would
    expected = codes.float().reshape(b, h, t, d // gs, gs) * qv.scale.float()[..., None] + qv.zero.float()[..., None]
    assert torch.equal(dequantize_values(qv), expected.reshape(b, h, t, d))


# ---------------------------------------------------------------------------------------------------------------------
# V precision (cold reads)
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_cold_decode_is_bucket_midpoint_and_within_bound(case):
    b, h, t, d, gs = case
    x = _randn((b, h, t, d), seed=8)
    qv = quantize_values(x, 4, group_size=gs)
    hi = unpack_codes(qv.hi, 2, d).float().reshape(b, h, t, d // gs, gs)
    s, z = qv.scale.float()[..., None], qv.zero.float()[..., None]
    cold_expected = ((4 * hi + 1.5) * s + z).reshape(b, h, t, d)

    full = dequantize_values(qv)
    all_cold = dequantize_values(qv, hot=torch.zeros(b, h, t, dtype=torch.bool))
    assert torch.equal(all_cold, cold_expected)
    assert torch.equal(dequantize_values(qv, hot=torch.ones(b, h, t, dtype=torch.bool)), full)

    bound = cold_value_error_bound(qv)
    assert bound.shape == (b, h, t, d // gs) and bound.dtype == torch.float32
    bound = bound.repeat_interleave(gs, dim=-1)
    assert torch.equal(bound, 1.5 * qv.scale.float().repeat_interleave(gs, dim=-1))
    slack = 1e-6 * (full.abs() + all_cold.abs())
    assert ((full - all_cold).abs() <= bound + slack).all()
    # relative to the original value: 1.5 scale + the half step of the full read (+ fp16 rounding)
    tol = _tolerance(*_value_minmax(x, gs), qv.scale, qv.zero, 4).repeat_interleave(gs, dim=3)
    assert ((all_cold.double() - x.double()).abs() <= bound.double() + tol).all()

    # per-token mask broadcast from [T]: hot tokens full, cold tokens midpoint
    hot_t = torch.arange(t) % 3 == 0
    mixed = dequantize_values(qv, hot=hot_t)
    assert torch.equal(mixed[:, :, hot_t], full[:, :, hot_t])
    assert torch.equal(mixed[:, :, ~hot_t], cold_expected[:, :, ~hot_t])


def test_per_query_hot_mask():
    b, h, q, t, d, gs = 2, 2, 3, 32, 32, 16
    x = _randn((b, h, t, d), seed=9)
    gen = torch.Generator().manual_seed(10)
    hot = torch.rand((b, h, q, t), generator=gen) < 0.3
    for nbits in NBITS:
        qv = quantize_values(x, nbits, group_size=gs)
        out = dequantize_values(qv, hot=hot, dtype=torch.float16)
        assert out.shape == (b, h, q, t, d) and out.dtype == torch.float16
        for i in range(q):
            assert torch.equal(out[:, :, i], dequantize_values(qv, hot=hot[:, :, i], dtype=torch.float16))
        # a [1, 1, Q, T] mask broadcasts over batch and heads
        shared = dequantize_values(qv, hot=hot[:1, :1])
        assert shared.shape == (b, h, q, t, d)
        assert torch.equal(shared[1, 1, 2], dequantize_values(qv, hot=hot[0, 0, 2])[1, 1])


def test_int2_values_ignore_hot():
    b, h, t, d = 1, 2, 8, 32
    qv = quantize_values(_randn((b, h, t, d), seed=11), 2)
    full = dequantize_values(qv)
    assert torch.equal(dequantize_values(qv, hot=torch.zeros(b, h, t, dtype=torch.bool)), full)
    assert torch.equal(cold_value_error_bound(qv), torch.zeros(b, h, t, d // 32))


# ---------------------------------------------------------------------------------------------------------------------
# special inputs: constants, padding
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("nbits", NBITS, ids=NBITS_IDS)
def test_constant_input_dequantizes_exactly(nbits):
    b, h, t, d = 1, 2, 64, 32
    # each channel constant over tokens (keys see scale 0), each token constant over channels (values see scale 0)
    per_channel = torch.linspace(-3.0, 3.0, d).to(torch.float16).float().expand(b, h, t, d).contiguous()
    per_token = torch.linspace(-7.5, 2.0, t).to(torch.float16).float()[:, None].expand(b, h, t, d).contiguous()
    qk = quantize_keys(per_channel, nbits)
    qv = quantize_values(per_token, nbits)
    assert (qk.scale == 0).all() and (qv.scale == 0).all()
    assert int(unpack_codes(qk.codes, nbits, d).max()) == 0 and int(qv.codes().max()) == 0
    assert torch.equal(dequantize_keys(qk), per_channel)
    assert torch.equal(dequantize_values(qv), per_token)
    assert torch.equal(fake_quantize_values(per_token.half(), nbits), per_token.half())


@pytest.mark.parametrize("nbits", NBITS, ids=NBITS_IDS)
def test_masked_keys_ignore_padding(nbits):
    b, h, t, d, gs = 2, 2, 64, 32, 32
    x = _randn((b, h, t, d), seed=12)
    valid = torch.ones(b, t, dtype=torch.bool)
    valid[0, :7] = False  # left padding inside the first page
    valid[1, 40:50] = False  # a hole in the second page
    x_pad = x.clone()
    x_pad[0, :, :7] = 1e30  # far outside fp16: would overflow the scale if it were not masked
    x_pad[1, :, 40:45] = -torch.inf
    x_pad[1, :, 45:50] = torch.nan
    qk = quantize_keys(x_pad, nbits, valid=valid)
    x_hat = dequantize_keys(qk)

    # scale/zero come from the valid tokens only: same result as filling the padding with a valid token's value
    x_fill = x.clone()
    x_fill[0, :, :7] = x[0, :, 7:8]
    x_fill[1, :, 40:50] = x[1, :, 39:40]
    ref = quantize_keys(x_fill, nbits)
    assert torch.equal(qk.scale, ref.scale) and torch.equal(qk.zero, ref.zero)

    tol = _tolerance(*_key_minmax(x, gs, valid), qk.scale, qk.zero, nbits).repeat_interleave(gs, dim=2)
    err = (x_hat.double() - x.double()).abs()
    keep = valid[:, None, :, None].expand_as(err)
    assert (err[keep] <= tol[keep]).all()
    # padding codes are still produced: clamped (+huge -> qmax, -inf -> 0, NaN -> 0)
    codes = unpack_codes(qk.codes, nbits, d)
    assert (codes[0, :, :7] == _qmax(nbits)).all()
    assert (codes[1, :, 40:50] == 0).all()


@pytest.mark.parametrize("nbits", NBITS, ids=NBITS_IDS)
def test_all_padding_page(nbits):
    b, h, t, d, gs = 2, 1, 64, 16, 32
    x = _randn((b, h, t, d), seed=13)
    x[0, :, :gs] = 5e5  # page 0 of row 0 is all padding
    valid = torch.ones(b, t, dtype=torch.bool)
    valid[0, :gs] = False
    qk = quantize_keys(x, nbits, group_size=gs, valid=valid)
    assert (qk.scale[0, :, 0] == 0).all() and (qk.zero[0, :, 0] == 0).all()
    assert (unpack_codes(qk.codes, nbits, d)[0, :, :gs] == 0).all()
    assert (dequantize_keys(qk)[0, :, :gs] == 0).all()
    # the other pages and rows are unaffected: same as quantizing them alone
    assert torch.equal(qk.select_pages(1, 2).index_select_batch([0]).codes, quantize_keys(x[:1, :, gs:], nbits).codes)
    assert torch.equal(qk.index_select_batch([1]).scale, quantize_keys(x[1:], nbits).scale)


# ---------------------------------------------------------------------------------------------------------------------
# byte model
# ---------------------------------------------------------------------------------------------------------------------


def test_byte_model_paper_numbers():
    # LoopKV Appendix C: Ouro-1.4B, 16 KV heads x 128, groups of 32.
    assert kivi_bytes_per_token(16, 128, 4) == 2560.0  # 2.5 KiB per token and layer
    assert kivi_bytes_per_token(16, 128, 2) == 1536.0  # 1.5 KiB
    assert kivi_bytes_per_token(16, 128, 4) * 24 * 4 / 1024 == 240.0  # INT4 on every loop: 240 KiB per token
    assert isinstance(kivi_bytes_per_token(16, 128, 4), float)


@pytest.mark.parametrize("nbits", NBITS, ids=NBITS_IDS)
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_byte_model_matches_nbytes(case, nbits):
    b, h, t, d, gs = case
    x = _randn((b, h, t, d), seed=14)
    qk, qv = quantize_keys(x, nbits, group_size=gs), quantize_values(x, nbits, group_size=gs)
    per_token = (qk.nbytes + qv.nbytes) / (b * t)
    assert per_token == kivi_bytes_per_token(h, d, nbits, group_size=gs)
    assert qk.num_tokens == qv.num_tokens == t and qk.num_pages == t // gs
    assert qk.head_dim == qv.head_dim == d


# ---------------------------------------------------------------------------------------------------------------------
# determinism, page independence, cache operations
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("nbits", NBITS, ids=NBITS_IDS)
def test_deterministic(nbits):
    x = _randn((2, 2, 64, 64), torch.bfloat16, seed=15)
    a, b = quantize_keys(x, nbits), quantize_keys(x.clone(), nbits)
    assert torch.equal(a.codes, b.codes) and torch.equal(a.scale, b.scale) and torch.equal(a.zero, b.zero)
    va, vb = quantize_values(x, nbits), quantize_values(x.clone(), nbits)
    for ta, tb in ((va.hi, vb.hi), (va.lo, vb.lo), (va.scale, vb.scale), (va.zero, vb.zero)):
        assert (ta is None and tb is None) or torch.equal(ta, tb)
    assert torch.equal(dequantize_values(va), dequantize_values(vb))


def _assert_keys_equal(a: QuantizedKeys, b: QuantizedKeys):
    assert (a.nbits, a.group_size) == (b.nbits, b.group_size)
    assert torch.equal(a.codes, b.codes) and torch.equal(a.scale, b.scale) and torch.equal(a.zero, b.zero)


def _assert_values_equal(a: QuantizedValues, b: QuantizedValues):
    assert (a.nbits, a.group_size) == (b.nbits, b.group_size)
    assert torch.equal(a.hi, b.hi) and torch.equal(a.scale, b.scale) and torch.equal(a.zero, b.zero)
    assert (a.lo is None and b.lo is None) or torch.equal(a.lo, b.lo)


@pytest.mark.parametrize("nbits", NBITS, ids=NBITS_IDS)
def test_pages_are_independent(nbits):
    b, h, d, gs = 2, 2, 32, 32
    x = _randn((b, h, 3 * gs, d), torch.float16, seed=16)
    valid = torch.ones(b, 3 * gs, dtype=torch.bool)
    valid[0, :3] = False
    whole = quantize_keys(x, nbits, valid=valid)
    parts = [quantize_keys(x[:, :, :gs], nbits, valid=valid[:, :gs]), quantize_keys(x[:, :, gs:], nbits)]
    _assert_keys_equal(whole.select_pages(0, 1), parts[0])
    _assert_keys_equal(whole.select_pages(1, 3), parts[1])

    vwhole = quantize_values(x, nbits)
    vparts = [quantize_values(x[:, :, :5], nbits), quantize_values(x[:, :, 5:], nbits)]
    _assert_values_equal(vwhole.select_tokens(0, 5), vparts[0])
    _assert_values_equal(vwhole.select_tokens(5, 3 * gs), vparts[1])
    assert vwhole.select_tokens(2, 2).num_tokens == 0


@pytest.mark.parametrize("nbits", NBITS, ids=NBITS_IDS)
def test_index_select_batch(nbits):
    x = _randn((3, 2, 32, 32), seed=17)
    idx = torch.tensor([2, 0, 0])
    _assert_keys_equal(quantize_keys(x, nbits).index_select_batch(idx), quantize_keys(x[idx], nbits))
    _assert_values_equal(quantize_values(x, nbits).index_select_batch([2, 0, 0]), quantize_values(x[idx], nbits))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_fake_quantize_dtypes(dtype):
    x = _randn((1, 2, 32, 32), dtype, seed=18)
    assert fake_quantize_keys(x, 4).dtype == dtype
    assert fake_quantize_values(x, 2).dtype == dtype
    out = fake_quantize_keys(x, 4, dtype=torch.float32)
    assert out.dtype == torch.float32 and torch.equal(out, dequantize_keys(quantize_keys(x, 4)))
    cold = fake_quantize_values(x, 4, hot=torch.zeros(32, dtype=torch.bool), dtype=torch.float32)
    assert torch.equal(cold, dequantize_values(quantize_values(x, 4), hot=torch.zeros(32, dtype=torch.bool)))


# ---------------------------------------------------------------------------------------------------------------------
# validation
# ---------------------------------------------------------------------------------------------------------------------

_X = torch.zeros(1, 2, 32, 32)
_QV4 = quantize_values(_X, 4)

INVALID_CALLS = [
    ("nbits3", lambda: quantize_keys(_X, 3), ValueError, r"`nbits` must be one of \(2, 4\)"),
    ("nbits8", lambda: quantize_values(_X, 8), ValueError, "`nbits`"),
    ("nbits-float", lambda: quantize_keys(_X, 4.0), TypeError, "`nbits`"),
    ("x-3d", lambda: quantize_keys(_X[0], 4), ValueError, r"\[B, H, T, D\]"),
    ("x-int", lambda: quantize_values(_X.long(), 4), TypeError, "floating-point"),
    ("x-not-tensor", lambda: quantize_keys([[1.0]], 4), TypeError, "torch.Tensor"),
    ("keys-T", lambda: quantize_keys(_X[:, :, :20], 4), ValueError, r"`T` \(20\).*`group_size` \(32\)"),
    ("values-D", lambda: quantize_values(_X[..., :16], 4), ValueError, r"`D` \(16\).*`group_size` \(32\)"),
    ("keys-D-pack", lambda: quantize_keys(_X[..., :6], 2), ValueError, r"`D` \(6\)"),
    ("group_size0", lambda: quantize_keys(_X, 4, group_size=0), ValueError, "`group_size`"),
    ("valid-shape", lambda: quantize_keys(_X, 4, valid=torch.ones(1, 31, dtype=torch.bool)), ValueError, "`valid`"),
    ("valid-dtype", lambda: quantize_keys(_X, 4, valid=torch.ones(1, 32)), TypeError, "`valid`"),
    ("keys-overflow", lambda: quantize_keys(_X + 1e5, 4), ValueError, "float16 range"),
    ("values-nan", lambda: quantize_values(_X + torch.nan, 4), ValueError, "non-finite"),
    ("dtype-int", lambda: dequantize_values(_QV4, dtype=torch.int32), TypeError, "`dtype`"),
    ("hot-float", lambda: dequantize_values(_QV4, hot=torch.ones(32)), TypeError, "`hot`"),
    ("hot-shape", lambda: dequantize_values(_QV4, hot=torch.ones(3, 32, dtype=torch.bool)), ValueError, "`hot`"),
    ("hot-5d", lambda: dequantize_values(_QV4, hot=torch.ones(1, 1, 1, 1, 32, dtype=torch.bool)), ValueError, "`hot`"),
    ("pack-dtype", lambda: pack_codes(torch.zeros(8, dtype=torch.int64), 4), TypeError, "uint8"),
    ("pack-range", lambda: pack_codes(torch.full((8,), 4, dtype=torch.uint8), 2), ValueError, r"\[0, 3\]"),
    ("pack-width", lambda: pack_codes(torch.zeros(6, dtype=torch.uint8), 2), ValueError, "multiple of 4"),
    ("unpack-D", lambda: unpack_codes(torch.zeros(4, dtype=torch.uint8), 4, 9), ValueError, "`D`"),
    ("bytes-head_dim", lambda: kivi_bytes_per_token(16, 48, 4), ValueError, "`head_dim`"),
    ("bytes-nbits", lambda: kivi_bytes_per_token(16, 128, 3), ValueError, "`nbits`"),
    ("select-range", lambda: _QV4.select_tokens(0, 33), ValueError, "`end`"),
    ("dequant-type", lambda: dequantize_keys(_QV4), TypeError, "QuantizedKeys"),
]


@pytest.mark.parametrize(("call", "exc", "match"), [c[1:] for c in INVALID_CALLS], ids=[c[0] for c in INVALID_CALLS])
def test_validation_errors(call, exc, match):
    with pytest.raises(exc, match=match):
        call()
