"""Triton kernels of the KIVI codecs (`@triton.jit` only; launchers and validation live in `ops.py`).

They reproduce `naive.py` bit for bit (see README "Contract for kernels"): fp32 min/max, IEEE divisions
(`tl.math.div_rn`), round-to-nearest-even casts to fp16, round-half-even codes. The rounding of the codes uses the
fp32 "magic number" `(q + 1.5 * 2**23) - 1.5 * 2**23`, which is round-half-even for `|q| < 2**22`; `q` is clamped to
`[-1, qmax + 1]` first (clamping there and after rounding gives the same code), and the interpreter has no `rint`.
"""

from __future__ import annotations

import triton
import triton.language as tl

_RNE_MAGIC = tl.constexpr(12582912.0)  # 1.5 * 2**23


@triton.jit
def _encode(x, s32, z32, QMAX: tl.constexpr):
    """`clamp(round_half_even((x - z) / s), 0, qmax)` with `s == 0` and NaN giving 0, as int32 (naive `_encode`)."""
    num = x - z32
    den = tl.broadcast_to(s32, num.shape)  # div_rn does not broadcast
    q = tl.math.div_rn(num, den)
    q = tl.where(den == 0.0, 0.0, q)
    q = tl.where(q != q, 0.0, q)
    q = tl.minimum(tl.maximum(q, -1.0), QMAX + 1.0)
    q = (q + _RNE_MAGIC) - _RNE_MAGIC
    q = tl.minimum(tl.maximum(q, 0.0), QMAX)
    return q.to(tl.int32)


@triton.jit
def _affine_params(mn, mx, QMAX: tl.constexpr):
    """fp32 group min/max -> fp16 scale and zero (`-0.0` stored as `+0.0`), as naive `_affine_params`."""
    scale = tl.math.div_rn(mx - mn, tl.full(mx.shape, QMAX, tl.float32)).to(tl.float16)
    zero = mn.to(tl.float16)
    scale = tl.where(scale == 0.0, 0.0, scale).to(tl.float16)
    zero = tl.where(zero == 0.0, 0.0, zero).to(tl.float16)
    return scale, zero


@triton.jit
def _key_group_codes(
    p_x, stride_xd, m_x, m_use, any_valid, p_scale, p_zero, o_c, m_c,
    NBITS: tl.constexpr, USE_VALID: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    """Per-channel affine codes of one key group (rows `p_x` `[BR, 1]`, channels `o_c * PER_BYTE + j`): each channel's
    min and max over the rows `m_use` (0 / 0 when no row is valid), its scale and zero stored at `p_scale` / `p_zero`
    plus the channel, the codes packed `PER_BYTE` channels a byte; returns the packed `[BR, BC]` int32 bytes. Shared
    by the page quantizer and the static flush, so both code a page the same way."""
    PER_BYTE: tl.constexpr = 8 // NBITS
    QMAX: tl.constexpr = 2**NBITS - 1
    b_packed = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.int32)
    for j in tl.static_range(PER_BYTE):
        o_d = o_c * PER_BYTE + j
        b_x = tl.load(p_x + o_d[None, :] * stride_xd, mask=m_x, other=0.0).to(tl.float32)  # [BR, BC]
        b_mn = tl.min(tl.where(m_use, b_x, float("inf")), axis=0)  # [BC]
        b_mx = tl.max(tl.where(m_use, b_x, float("-inf")), axis=0)
        if USE_VALID:
            b_mn = tl.where(any_valid, b_mn, 0.0)
            b_mx = tl.where(any_valid, b_mx, 0.0)
        b_s, b_z = _affine_params(b_mn, b_mx, QMAX)
        tl.store(p_scale + o_d, b_s, mask=m_c)
        tl.store(p_zero + o_d, b_z, mask=m_c)
        b_q = _encode(b_x, b_s.to(tl.float32)[None, :], b_z.to(tl.float32)[None, :], QMAX)
        b_packed = b_packed | (b_q << (NBITS * j))
    return b_packed


@triton.jit
def _value_group_codes(
    p_x, stride_xd, m_x, m_s, o_col, p_scale, p_zero, o_s, p_hi, p_lo, o_c,
    NBITS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_NG: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """Per-token affine codes of value groups (rows `p_x` `[BR, 1, 1]`, a group is `GROUP` consecutive channels of one
    row held as a `[BR, NG, GROUP // 4]` tile per 2-bit lane j: channel `4 * o_col + j`): each group's min and max over
    its channels (`m_x`; 0 / 0 for the rows and groups outside `m_s`), its scale and zero stored at `p_scale` /
    `p_zero` plus `o_s`, the codes packed four channels a byte into `hi` (INT4: the high bits, the low bits into `lo`)
    at `p_hi` / `p_lo` plus `o_c`. Shared by the token quantizer and the static flush, so both code a page the same
    way."""
    QMAX: tl.constexpr = 2**NBITS - 1
    b_mn = tl.full([BLOCK_R, BLOCK_NG], float("inf"), dtype=tl.float32)
    b_mx = tl.full([BLOCK_R, BLOCK_NG], float("-inf"), dtype=tl.float32)
    for j in tl.static_range(4):
        b_x = tl.load(p_x + (o_col * 4 + j) * stride_xd, mask=m_x, other=0.0).to(tl.float32)  # [BR, NG, K]
        b_mn = tl.minimum(b_mn, tl.min(tl.where(m_x, b_x, float("inf")), axis=2))
        b_mx = tl.maximum(b_mx, tl.max(tl.where(m_x, b_x, float("-inf")), axis=2))
    b_mn = tl.where(m_s, b_mn, 0.0)
    b_mx = tl.where(m_s, b_mx, 0.0)
    b_s, b_z = _affine_params(b_mn, b_mx, QMAX)  # [BR, NG]
    tl.store(p_scale + o_s, b_s, mask=m_s)
    tl.store(p_zero + o_s, b_z, mask=m_s)
    b_s32 = b_s.to(tl.float32)[:, :, None]
    b_z32 = b_z.to(tl.float32)[:, :, None]
    b_hi = tl.zeros([BLOCK_R, BLOCK_NG, BLOCK_K], dtype=tl.int32)
    b_lo = tl.zeros([BLOCK_R, BLOCK_NG, BLOCK_K], dtype=tl.int32)
    for j in tl.static_range(4):
        b_x = tl.load(p_x + (o_col * 4 + j) * stride_xd, mask=m_x, other=0.0).to(tl.float32)
        b_q = _encode(b_x, b_s32, b_z32, QMAX)
        if NBITS == 4:
            b_hi = b_hi | ((b_q >> 2) << (2 * j))
            b_lo = b_lo | ((b_q & 3) << (2 * j))
        else:
            b_hi = b_hi | (b_q << (2 * j))
    tl.store(p_hi + o_c, b_hi.to(tl.uint8), mask=m_x)
    if NBITS == 4:
        tl.store(p_lo + o_c, b_lo.to(tl.uint8), mask=m_x)


@triton.jit(do_not_specialize=["T"])
def _quantize_keys_fwd_kernel(
    x_ptr,
    valid_ptr,
    codes_ptr,
    scale_ptr,
    zero_ptr,
    H,
    T,
    stride_xb,
    stride_xh,
    stride_xt,
    stride_xd,
    stride_vb,
    stride_vt,
    stride_cb,
    stride_ch,
    stride_ct,
    stride_sb,
    stride_sh,
    stride_sg,
    D: tl.constexpr,
    NBITS: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_C: tl.constexpr,
    USE_VALID: tl.constexpr,
):
    # one program per (page, b * h): per-channel min/max over the page's (valid) tokens
    i_g, i_bh = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
    i_b, i_h = i_bh // H, i_bh % H
    PER_BYTE: tl.constexpr = 8 // NBITS
    o_t = i_g * GROUP + tl.arange(0, BLOCK_G)
    m_t = tl.arange(0, BLOCK_G) < GROUP
    o_c = tl.arange(0, BLOCK_C)
    m_c = o_c < D // PER_BYTE
    m_x = m_t[:, None] & m_c[None, :]
    if USE_VALID:
        b_valid = tl.load(valid_ptr + i_b * stride_vb + o_t * stride_vt, mask=m_t, other=0) != 0  # [BG]
        m_use = m_x & b_valid[:, None]
        any_valid = tl.max(b_valid.to(tl.int32), axis=0) > 0
    else:
        m_use = m_x
        any_valid = True
    p_x = x_ptr + i_b * stride_xb + i_h * stride_xh + o_t[:, None] * stride_xt
    o_s = i_b * stride_sb + i_h * stride_sh + i_g * stride_sg
    b_packed = _key_group_codes(p_x, stride_xd, m_x, m_use, any_valid, scale_ptr + o_s, zero_ptr + o_s, o_c, m_c,
                                NBITS, USE_VALID, BLOCK_G, BLOCK_C)  # fmt: skip
    p_c = codes_ptr + i_b * stride_cb + i_h * stride_ch + o_t[:, None] * stride_ct + o_c[None, :]
    tl.store(p_c, b_packed.to(tl.uint8), mask=m_x)


@triton.jit(do_not_specialize=["T"])
def _quantize_values_fwd_kernel(
    x_ptr,
    hi_ptr,
    lo_ptr,
    scale_ptr,
    zero_ptr,
    H,
    T,
    stride_xb,
    stride_xh,
    stride_xt,
    stride_xd,
    stride_cb,
    stride_ch,
    stride_ct,
    stride_sb,
    stride_sh,
    stride_st,
    D: tl.constexpr,
    NBITS: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_NG: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # one program per (token block, b * h); a group is GROUP consecutive channels of one token, held as a
    # [BT, NG, GROUP // 4] tile per 2-bit lane j (channel g * GROUP + 4 * k + j, packed column g * GROUP // 4 + k)
    i_t, i_bh = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
    i_b, i_h = i_bh // H, i_bh % H
    o_t = i_t * BLOCK_T + tl.arange(0, BLOCK_T)
    o_g = tl.arange(0, BLOCK_NG)
    o_k = tl.arange(0, BLOCK_K)
    m_x = (o_t < T)[:, None, None] & (o_g < D // GROUP)[None, :, None] & (o_k < GROUP // 4)[None, None, :]
    o_col = o_g[None, :, None] * (GROUP // 4) + o_k[None, None, :]  # [1, NG, K] packed column
    p_x = x_ptr + i_b * stride_xb + i_h * stride_xh + o_t[:, None, None] * stride_xt
    m_s = (o_t < T)[:, None] & (o_g < D // GROUP)[None, :]
    o_s = i_b * stride_sb + i_h * stride_sh + o_t[:, None] * stride_st + o_g[None, :]
    o_c = i_b * stride_cb + i_h * stride_ch + o_t[:, None, None] * stride_ct + o_col
    _value_group_codes(p_x, stride_xd, m_x, m_s, o_col, scale_ptr, zero_ptr, o_s, hi_ptr, lo_ptr, o_c,
                       NBITS, BLOCK_T, BLOCK_NG, BLOCK_K)  # fmt: skip


@triton.jit
def _flush_key_page(
    k_ptr, valid_ptr, codes_ptr, kscale_ptr, kzero_ptr, i_b, i_h, i_p, b_slot, o_p, o_m, m_p,
    stride_kb, stride_kh, stride_kt, stride_kd, stride_mb, stride_mt, stride_cb, stride_ch, stride_ct,
    stride_sb, stride_sh, stride_sg,
    D: tl.constexpr, NBITS: tl.constexpr, PAGE: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr,
    USE_VALID: tl.constexpr,
):  # fmt: skip
    """The key page of row (i_b, i_h): per channel over the page's (valid) positions, as `_quantize_keys_fwd_kernel`."""
    PER_BYTE: tl.constexpr = 8 // NBITS
    o_c = tl.arange(0, BLOCK_C)
    m_c = o_c < D // PER_BYTE
    m_x = m_p[:, None] & m_c[None, :]
    if USE_VALID:
        b_valid = tl.load(valid_ptr + i_b * stride_mb + o_m * stride_mt, mask=m_p, other=0) != 0  # [BP]
        m_use = m_x & b_valid[:, None]
        any_valid = tl.max(b_valid.to(tl.int32), axis=0) > 0
    else:
        m_use = m_x
        any_valid = True
    p_x = k_ptr + i_b * stride_kb + i_h * stride_kh + b_slot[:, None] * stride_kt
    o_s = i_b * stride_sb + i_h * stride_sh + i_p * stride_sg
    b_packed = _key_group_codes(p_x, stride_kd, m_x, m_use, any_valid, kscale_ptr + o_s, kzero_ptr + o_s, o_c, m_c,
                                NBITS, USE_VALID, BLOCK_P, BLOCK_C)  # fmt: skip
    o_t = i_p * PAGE + o_p  # [BP] destination token rows
    p_c = codes_ptr + i_b * stride_cb + i_h * stride_ch + o_t[:, None] * stride_ct + o_c[None, :]
    tl.store(p_c, b_packed.to(tl.uint8), mask=m_x)


@triton.jit
def _flush_value_page(
    v_ptr, hi_ptr, lo_ptr, vscale_ptr, vzero_ptr, i_b, i_h, i_p, b_slot, o_p, m_p,
    stride_vb, stride_vh, stride_vt, stride_vd, stride_hb, stride_hh, stride_ht, stride_wb, stride_wh, stride_wt,
    D: tl.constexpr, NBITS: tl.constexpr, PAGE: tl.constexpr, GROUP: tl.constexpr, BLOCK_P: tl.constexpr,
    BLOCK_NG: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """The page's values of row (i_b, i_h): per position over groups of GROUP channels, as
    `_quantize_values_fwd_kernel` ([BP, NG, GROUP // 4] tiles per 2-bit lane j)."""
    o_g = tl.arange(0, BLOCK_NG)
    o_k = tl.arange(0, BLOCK_K)
    m_g = o_g < D // GROUP
    m_x = m_p[:, None, None] & m_g[None, :, None] & (o_k < GROUP // 4)[None, None, :]
    o_col = o_g[None, :, None] * (GROUP // 4) + o_k[None, None, :]  # [1, NG, K] packed column
    p_x = v_ptr + i_b * stride_vb + i_h * stride_vh + b_slot[:, None, None] * stride_vt
    m_s = m_p[:, None] & m_g[None, :]
    o_t = i_p * PAGE + o_p  # [BP] destination token rows
    o_s = i_b * stride_wb + i_h * stride_wh + o_t[:, None] * stride_wt + o_g[None, :]
    o_c = i_b * stride_hb + i_h * stride_hh + o_t[:, None, None] * stride_ht + o_col
    _value_group_codes(p_x, stride_vd, m_x, m_s, o_col, vscale_ptr, vzero_ptr, o_s, hi_ptr, lo_ptr, o_c,
                       NBITS, BLOCK_P, BLOCK_NG, BLOCK_K)  # fmt: skip


@triton.jit
def _flush_page_fwd_kernel(
    k_ptr,
    v_ptr,
    slots_ptr,
    valid_ptr,
    coded_ptr,
    table_ptr,
    due_ptr,
    start_ptr,
    floor_ptr,
    page_ptr,
    codes_ptr,
    kscale_ptr,
    kzero_ptr,
    hi_ptr,
    lo_ptr,
    vscale_ptr,
    vzero_ptr,
    H,
    stride_kb,
    stride_kh,
    stride_kt,
    stride_kd,
    stride_vb,
    stride_vh,
    stride_vt,
    stride_vd,
    stride_mb,
    stride_mt,
    stride_cb,
    stride_ch,
    stride_ct,
    stride_sb,
    stride_sh,
    stride_sg,
    stride_hb,
    stride_hh,
    stride_ht,
    stride_wb,
    stride_wh,
    stride_wt,
    D: tl.constexpr,
    NBITS: tl.constexpr,
    PAGE: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_NG: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_VALID: tl.constexpr,
    USE_CODED: tl.constexpr,
    TABLE: tl.constexpr,
    USE_PDL: tl.constexpr,  # programmatic dependent launch: wait for the previous kernel before anything else
):
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    # one program per (b * h, keys | values, page k of the K): when the device-side geometry says the page is due
    # and the ring still holds it, gather its PAGE positions from the ring slots, quantize them and write its page;
    # otherwise exit at once. With USE_CODED a page is coded only where this program's slot does not hold it yet (it
    # becomes due once, so most steps code nothing). The same arguments every step, no host read
    i_bh, i_kv, i_k = tl.program_id(0).to(tl.int64), tl.program_id(1), tl.program_id(2).to(tl.int64)
    i_b, i_h = i_bh // H, i_bh % H
    if TABLE:  # one launch for many cells of one shape: axis 1 is (cell, plane); the cell's storage from the table
        i_cell = (i_kv // 2).to(tl.int64)
        i_kv = i_kv % 2
        p_row = table_ptr + i_cell * 11  # ring k / v, codes, key scale / zero, hi, lo, value scale / zero, floor, coded
        k_ptr = tl.load(p_row).to(k_ptr.dtype, bitcast=True)
        v_ptr = tl.load(p_row + 1).to(v_ptr.dtype, bitcast=True)
        codes_ptr = tl.load(p_row + 2).to(codes_ptr.dtype, bitcast=True)
        kscale_ptr = tl.load(p_row + 3).to(kscale_ptr.dtype, bitcast=True)
        kzero_ptr = tl.load(p_row + 4).to(kzero_ptr.dtype, bitcast=True)
        hi_ptr = tl.load(p_row + 5).to(hi_ptr.dtype, bitcast=True)
        lo_ptr = tl.load(p_row + 6).to(lo_ptr.dtype, bitcast=True)
        vscale_ptr = tl.load(p_row + 7).to(vscale_ptr.dtype, bitcast=True)
        vzero_ptr = tl.load(p_row + 8).to(vzero_ptr.dtype, bitcast=True)
        floor_ptr = tl.load(p_row + 9).to(floor_ptr.dtype, bitcast=True)
        coded_ptr = tl.load(p_row + 10).to(coded_ptr.dtype, bitcast=True)
    i_p = tl.load(page_ptr + i_k).to(tl.int64)  # >= 0 (the geometry clamps it), whether due or not
    b_go = (tl.load(due_ptr + i_k) != 0) & (tl.load(start_ptr + i_k) >= tl.load(floor_ptr))
    if USE_CODED:  # this program's slot (row, head, plane) of the page: [B', H, 2, K] int32, page n in slot n % K
        n_k = tl.num_programs(2)
        p_coded = coded_ptr + (i_bh * 2 + i_kv) * n_k + i_p % n_k
        b_go = b_go & (tl.load(p_coded) != i_p)
    if b_go:
        o_p = tl.arange(0, BLOCK_P)
        m_p = o_p < PAGE
        o_m = i_k * PAGE + o_p  # [BP] the page's positions among the K * P gathered ones
        b_slot = tl.load(slots_ptr + o_m, mask=m_p, other=0).to(tl.int64)  # [BP] ring slots of the page's positions
        if i_kv == 0:
            _flush_key_page(
                k_ptr, valid_ptr, codes_ptr, kscale_ptr, kzero_ptr, i_b, i_h, i_p, b_slot, o_p, o_m, m_p,
                stride_kb, stride_kh, stride_kt, stride_kd, stride_mb, stride_mt, stride_cb, stride_ch, stride_ct,
                stride_sb, stride_sh, stride_sg, D, NBITS, PAGE, BLOCK_P, BLOCK_C, USE_VALID,
            )  # fmt: skip
        else:
            _flush_value_page(
                v_ptr, hi_ptr, lo_ptr, vscale_ptr, vzero_ptr, i_b, i_h, i_p, b_slot, o_p, m_p,
                stride_vb, stride_vh, stride_vt, stride_vd, stride_hb, stride_hh, stride_ht, stride_wb, stride_wh,
                stride_wt, D, NBITS, PAGE, GROUP, BLOCK_P, BLOCK_NG, BLOCK_K,
            )  # fmt: skip
        if USE_CODED:  # only this program reads or writes its slot in this launch
            tl.store(p_coded, i_p.to(tl.int32))
