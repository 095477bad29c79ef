"""Triton kernels of `coded_attention` (`@triton.jit` only; the launcher and validation are in `ops.py`, the math in
README.md).

Split-history (flash-decoding) attention of `Q` new tokens over one cell's stored view. The grid is
`(NS + NT, B * H_kv, row blocks)`: programs `0 .. NS-1` each read a contiguous range of history pages straight from
the stored codes (INT4 / INT2) or BF16 tensors; programs `NS .. NS+NT-1` read the dense tail (sink, window, new
tokens), the window split into `NT` ranges of slots (`NT = 1` unless the window is longer than a split). Rows
are the `G * Q` queries that share one KV head (GQA: K/V are read once per row block). Each program writes a partial
`(o, lse)`; `_coded_attention_merge_kernel` combines them by log-sum-exp. Scores are kept in log2 units
(`qk * scale * log2(e)`), so the V-precision margin `tau * ln 2` becomes `tau`. When a KV head has one query row
(decode without GQA) the history programs of coded cells run `_codes_history_row1` (elementwise, no dots).
"""

from __future__ import annotations

import triton
import triton.language as tl

_LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _cmask(m, ok, PAD: tl.constexpr):
    """A load mask `m` with `ok` (the channels, words or value groups inside the head dim) when the tile is padded
    (`PAD`: a head dim that is no power of two, e.g. Huginn-0125's 96, read in tiles of 128 whose columns past it
    load 0); `m` itself otherwise, so a power-of-two head dim compiles to the same loads as without padding."""
    if PAD:
        return m & ok
    else:
        return m


@triton.jit
def _online_update(b_s, b_m, b_l, b_acc):
    """One flash step: new running max, rescaled `l` / `acc`, and the probabilities `p` of the tile `b_s` (log2)."""
    b_mn = tl.maximum(b_m, tl.max(b_s, axis=1))  # [BR]
    b_ms = tl.where(b_mn == float("-inf"), 0.0, b_mn)  # rows that see nothing yet stay at p = 0
    b_alpha = tl.exp2(b_m - b_ms)
    b_p = tl.exp2(b_s - b_ms[:, None])  # [BR, BT]
    b_l = b_l * b_alpha + tl.sum(b_p, axis=1)
    b_acc = b_acc * b_alpha[:, None]
    return b_mn, b_l, b_acc, b_p


@triton.jit
def _store_partial(o_ptr, lse_ptr, o_part, b_m, b_l, b_acc, o_cols, m_row, D: tl.constexpr):
    """A program's partial output normalised by its own `l` (columns `o_cols`) and its lse in log2 units
    (-inf when the program saw no key)."""
    b_lse = tl.where(b_l > 0, b_m + tl.log2(tl.where(b_l > 0, b_l, 1.0)), float("-inf"))
    tl.store(lse_ptr + o_part, b_lse, mask=m_row)
    b_o = b_acc / tl.where(b_l > 0, b_l, 1.0)[:, None]
    tl.store(o_ptr + o_part[:, None] * D + o_cols[None, :], b_o, mask=m_row[:, None])


@triton.jit
def _codes_scores(
    b_s, b_qj, b_pk, p_ks, p_kz, m_c, SHIFT: tl.constexpr, QMAX: tl.constexpr, IEEE: tl.constexpr, PAD: tl.constexpr
):
    """Add the scores of one bit lane of packed key codes `b_pk` [P, DK]: `k = c * scale + zero` per channel, so the
    page's scale folds into the queries `b_qj` [BR, DK] of the lane's channels and its zero into a row bias. `PAD`:
    scale and zero load 0 outside the lane's channels `m_c` [DK] (a head dim that is no power of two)."""
    b_c = ((b_pk >> SHIFT) & QMAX).to(b_qj.dtype)  # [P, DK], exact small integers
    if PAD:
        b_ks = tl.load(p_ks, mask=m_c, other=0.0).to(tl.float32)  # [DK]
        b_kz = tl.load(p_kz, mask=m_c, other=0.0).to(tl.float32)
    else:
        b_ks = tl.load(p_ks).to(tl.float32)  # [DK]
        b_kz = tl.load(p_kz).to(tl.float32)
    b_qf = b_qj.to(tl.float32)
    b_s += _dot((b_qf * b_ks[None, :]).to(b_qj.dtype), tl.trans(b_c), IEEE)
    b_s += tl.sum(b_qf * b_kz[None, :], axis=1)[:, None]
    return b_s


@triton.jit
def _codes_values(
    b_acc, b_p, b_ph, b_hi, b_lo, b_vs, b_vz, SHIFT: tl.constexpr, NBITS: tl.constexpr, USE_VPREC: tl.constexpr,
    IEEE: tl.constexpr,
):
    """Add `p @ v` for one bit lane of the packed value planes ([P, DV] bytes) into its accumulator [BR, DV]."""
    b_h = ((b_hi >> SHIFT) & 3).to(tl.float32)
    if NBITS == 2:
        b_acc += _dot(b_p, (b_h * b_vs + b_vz).to(b_p.dtype), IEEE)
    else:
        b_l = ((b_lo >> SHIFT) & 3).to(tl.float32)
        if USE_VPREC:
            b_acc += _dot(b_p, ((b_h * 4.0 + 1.5) * b_vs + b_vz).to(b_p.dtype), IEEE)
            b_acc += _dot(b_ph, ((b_l - 1.5) * b_vs).to(b_p.dtype), IEEE)
        else:
            b_acc += _dot(b_p, ((b_h * 4.0 + b_l) * b_vs + b_vz).to(b_p.dtype), IEEE)
    return b_acc


@triton.jit
def _u2f(x):
    """Exact fp32 of a small non-negative int32 (< 2**23) without a conversion instruction (those issue at a quarter
    of the FMA rate on Hopper): the bits of `2**23 + x`, minus `2**23`."""
    return (x | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0


@triton.jit
def _vcode(b_hi, b_lo, SHIFT: tl.constexpr, FAST: tl.constexpr):
    """The 4-bit value code `4 hi + lo` of the 2-bit fields at bit SHIFT of int32 bytes `b_hi`, `b_lo` as fp32;
    FAST: `1 + code / 16` (hi's field to bits 21-22, lo's to 19-20 of 1.0's mantissa)."""
    if FAST:
        b_f = ((b_hi << (21 - SHIFT)) & (3 << 21)) | ((b_lo << (19 - SHIFT)) & (3 << 19)) | 0x3F800000
        return b_f.to(tl.float32, bitcast=True)
    else:
        return _u2f((((b_hi >> SHIFT) & 3) << 2) | ((b_lo >> SHIFT) & 3))


@triton.jit
def _field(b, SHIFT: tl.constexpr, NB: tl.constexpr, FAST: tl.constexpr):
    """The NB-bit field at bit SHIFT (< 8) of int32 bytes `b` as fp32. FAST: `1 + field / 2**NB`, the field shifted
    to the top of the mantissa of 1.0 (one shift, one LOP3; no conversion, no add); else the field itself (exact)."""
    if FAST:
        TGT: tl.constexpr = 23 - NB
        return (((b << (TGT - SHIFT)) & (((1 << NB) - 1) << TGT)) | 0x3F800000).to(tl.float32, bitcast=True)
    else:
        return _u2f((b >> SHIFT) & ((1 << NB) - 1))


@triton.jit
def _codes_history_row1(
    b_q, b_run, q_ptr, o_ptr, lse_ptr, pmax_ptr, p_valid, stride_validt, hk_ptr, hks_ptr, hkz_ptr, hv_ptr, hvl_ptr,
    hvs_ptr, hvz_ptr, stats_ptr, stride_hkt, stride_hksp, stride_hvt, stride_hvst, i_bh, o_part, i_prog, nh,
    hist_start, p_begin, p_end, n_pages, qk_scale, margin,
    D: tl.constexpr, PAGE: tl.constexpr, VGROUP: tl.constexpr, KV_FMT: tl.constexpr, NP: tl.constexpr,
    USE_VALID: tl.constexpr, USE_VPREC: tl.constexpr, COUNT: tl.constexpr, PAGE_MAX_ONLY: tl.constexpr,
    FAST: tl.constexpr, DH: tl.constexpr,
):
    """History pages `[p_begin, p_end)` of codes for ONE query row (decode without GQA, the common case), without
    matrix instructions: `NP` pages per loop step, scores as elementwise products summed over channels, values
    accumulated per bit lane. `b_q` [D] (the row's query, fp32, scaled by `qk_scale`), pointers already at
    (b, h_kv); `nh` the history tokens the row reads; `b_run` the V-precision running-max seed (log2 units).
    Writes the partial `(o, lse)` of row `o_part` (or the page maxima with `PAGE_MAX_ONLY`).

    Instruction economy (the loop is issue-bound, not byte-bound): the sums over tokens (`l`, the value lanes, the
    zero term, the counts) stay per thread in tiles of the step's shape and are reduced once after the loop; the
    softmax reference `b_mr` moves only when a score exceeds it by more than 2**8 (lazy rescaling: p <= 256 in
    fp32 is exact enough, and `lse = b_mr + log2(l)` does not depend on the reference), so the only reduction
    across threads per step is the step's maximum. FAST (16-bit inputs) reads a field as `f = 1 + code / 2**n`
    straight from its bits, sums `a * f` and subtracts `sum a` once (the difference is at most ~3x smaller than the
    terms, so fp32 keeps ~2**-22 relative); fp32 inputs read the exact field."""
    PB: tl.constexpr = 8 // KV_FMT  # channels per key byte
    DK: tl.constexpr = D // PB
    NG: tl.constexpr = D // VGROUP  # value groups per token
    VG4: tl.constexpr = VGROUP // 4  # plane bytes per value group (4 channels per byte)
    T: tl.constexpr = NP * PAGE
    if FAST:
        KSC: tl.constexpr = 2.0**KV_FMT  # code = KSC * (f - 1)
        VSC: tl.constexpr = 16.0 if KV_FMT == 4 else 4.0
    else:
        KSC: tl.constexpr = 1.0
        VSC: tl.constexpr = 1.0
    o_np = tl.arange(0, NP)
    o_pt = tl.arange(0, PAGE)
    o_ck = tl.arange(0, DK)
    o_d = tl.arange(0, D)
    o_tt = tl.arange(0, T)
    o_g = tl.arange(0, NG)
    o_c8 = tl.arange(0, VG4)
    PAD: tl.constexpr = DH < D  # head dim DH < D: key bytes, channels and value groups past DH load 0
    m_gd = o_g < DH // VGROUP
    m_gv, m_gs = m_gd[None, :, None], m_gd[None, :]
    limit = tl.minimum(nh, p_end * PAGE)  # history tokens this program reads
    b_mr = tl.max(tl.full([NP], float("-inf"), dtype=tl.float32), axis=0)  # softmax reference (log2 units)
    b_lv = tl.zeros([NP, PAGE], dtype=tl.float32)
    b_a0 = tl.zeros([T, NG, VG4], dtype=tl.float32)  # value lane j: channel 4 * (g * VG4 + c) + j
    b_a1 = tl.zeros([T, NG, VG4], dtype=tl.float32)
    b_a2 = tl.zeros([T, NG, VG4], dtype=tl.float32)
    b_a3 = tl.zeros([T, NG, VG4], dtype=tl.float32)
    b_az = tl.zeros([T, NG], dtype=tl.float32)  # p * zero (+ 1.5 * p * scale of cold tokens)
    b_wsum = tl.zeros([T, NG], dtype=tl.float32)  # p * scale (FAST: the `1` of every f)
    if COUNT:
        b_cnt_cold = tl.zeros([NP, PAGE], dtype=tl.int32)
        b_cnt_all = tl.zeros([NP, PAGE], dtype=tl.int32)
    for i_p0 in range(p_begin, p_end, NP):
        o_pg = i_p0 + o_np  # [NP] pages
        m_pg = o_pg < p_end
        o_t2 = o_pg[:, None] * PAGE + o_pt[None, :]  # [NP, PAGE] history token index
        m_vis = o_t2 < limit
        o_t3 = o_t2[:, :, None]
        b_pk = tl.load(
            hk_ptr + o_t3 * stride_hkt + o_ck[None, None, :],
            mask=_cmask(o_t3 < limit, (o_ck < DH // PB)[None, None, :], PAD), other=0,
        ).to(tl.int32)
        # scores: page scale folded into the query per lane, page zero into a per-page bias
        b_kz = tl.load(
            hkz_ptr + o_pg[:, None] * stride_hksp + o_d[None, :],
            mask=_cmask(m_pg[:, None], (o_d < DH)[None, :], PAD), other=0.0,
        )
        b_bias = tl.sum(b_kz.to(tl.float32) * b_q[None, :], axis=1)  # [NP]
        b_s = tl.zeros([NP, PAGE], dtype=tl.float32) + b_bias[:, None]
        for j in tl.static_range(PB):
            if PAD:
                b_qj = tl.load(q_ptr + o_ck * PB + j, mask=o_ck * PB + j < DH, other=0.0).to(tl.float32) * qk_scale
            else:
                b_qj = tl.load(q_ptr + o_ck * PB + j).to(tl.float32) * qk_scale  # [DK], from L1
            b_ks = tl.load(
                hks_ptr + o_pg[:, None] * stride_hksp + (o_ck * PB + j)[None, :],
                mask=_cmask(m_pg[:, None], (o_ck * PB + j < DH)[None, :], PAD), other=0.0,
            )
            b_qs = b_ks.to(tl.float32) * b_qj[None, :] * KSC  # [NP, DK]
            if FAST:
                b_s -= tl.sum(b_qs, axis=1)[:, None]
            b_s += tl.sum(_field(b_pk, j * KV_FMT, KV_FMT, FAST) * b_qs[:, None, :], axis=2)
        if USE_VALID:
            b_valid = tl.load(p_valid + (hist_start + o_t2) * stride_validt, mask=m_vis, other=0) != 0
            m_vis = m_vis & b_valid
        b_s = tl.where(m_vis, b_s, float("-inf"))
        b_pm = tl.max(b_s, axis=1)  # [NP] page maxima
        if PAGE_MAX_ONLY:
            tl.store(pmax_ptr + i_bh * n_pages + o_pg, b_pm, mask=m_pg)
        else:
            b_mx = tl.max(b_pm, axis=0)
            if b_mx > b_mr + 8.0:  # move the reference (rare after the first steps)
                b_alpha = tl.exp2(b_mr - b_mx)
                b_lv *= b_alpha
                b_a0 *= b_alpha
                b_a1 *= b_alpha
                b_a2 *= b_alpha
                b_a3 *= b_alpha
                b_az *= b_alpha
                b_wsum *= b_alpha
                b_mr = b_mx
            b_p = tl.exp2(b_s - tl.where(b_mr == float("-inf"), 0.0, b_mr))  # [NP, PAGE], 0 where not read
            b_lv += b_p
            if USE_VPREC:
                # running max of each page: the seed, then the prefix of page maxima up to the page itself
                b_pre = tl.max(tl.where(o_np[None, :] <= o_np[:, None], b_pm[None, :], float("-inf")), axis=1)
                b_runp = tl.maximum(b_pre, b_run)
                b_run = tl.maximum(b_run, b_mx)
                m_hot = m_vis & (b_s >= b_runp[:, None] - margin)
                if COUNT:
                    b_cnt_all += m_vis.to(tl.int32)
                    b_cnt_cold += (m_vis & ~m_hot).to(tl.int32)
                b_pc = tl.reshape(tl.where(m_hot, 0.0, b_p), [T])  # p of cold tokens (0 where not read)
                m_hot1 = tl.reshape(m_hot, [T])
            b_p1 = tl.reshape(b_p, [T])
            o_t1 = i_p0 * PAGE + o_tt  # [T]
            m_t1 = o_t1 < limit
            o_v3 = o_t1[:, None, None] * stride_hvt + (o_g[:, None] * VG4 + o_c8[None, :])[None, :, :]
            b_hi = tl.load(hv_ptr + o_v3, mask=_cmask(m_t1[:, None, None], m_gv, PAD), other=0).to(tl.int32)
            o_s2 = o_t1[:, None] * stride_hvst + o_g[None, :]
            b_vs = tl.load(hvs_ptr + o_s2, mask=_cmask(m_t1[:, None], m_gs, PAD), other=0.0).to(tl.float32)  # [T, NG]
            b_vz = tl.load(hvz_ptr + o_s2, mask=_cmask(m_t1[:, None], m_gs, PAD), other=0.0).to(tl.float32)
            b_w = b_p1[:, None] * b_vs  # [T, NG]: p * scale
            b_az += b_p1[:, None] * b_vz
            if FAST:
                b_wsum += b_w
            b_w3 = b_w[:, :, None]
            if KV_FMT == 4:
                if USE_VPREC:
                    b_az += 1.5 * b_pc[:, None] * b_vs  # cold tokens read the hi bucket's midpoint
                    m_lo = m_t1 & m_hot1
                else:
                    m_lo = m_t1
                b_lo = tl.load(hvl_ptr + o_v3, mask=_cmask(m_lo[:, None, None], m_gv, PAD), other=0).to(tl.int32)
                # the 4-bit code 4 hi + lo of lane j: hi's field next to lo's (FAST: both at the mantissa's top)
                b_a0 += b_w3 * _vcode(b_hi, b_lo, 0, FAST)
                b_a1 += b_w3 * _vcode(b_hi, b_lo, 2, FAST)
                b_a2 += b_w3 * _vcode(b_hi, b_lo, 4, FAST)
                b_a3 += b_w3 * _vcode(b_hi, b_lo, 6, FAST)
            else:
                b_a0 += b_w3 * _field(b_hi, 0, 2, FAST)
                b_a1 += b_w3 * _field(b_hi, 2, 2, FAST)
                b_a2 += b_w3 * _field(b_hi, 4, 2, FAST)
                b_a3 += b_w3 * _field(b_hi, 6, 2, FAST)
    if not PAGE_MAX_ONLY:
        b_l = tl.sum(tl.sum(b_lv, axis=1), axis=0)
        b_lse = tl.where(b_l > 0, b_mr + tl.log2(tl.where(b_l > 0, b_l, 1.0)), float("-inf"))
        tl.store(lse_ptr + o_part, b_lse)
        b_inv = 1.0 / tl.where(b_l > 0, b_l, 1.0)
        o_c4 = (o_g[:, None] * VG4 + o_c8[None, :]) * 4  # [NG, VG4]
        p_o = o_ptr + o_part * D + o_c4
        b_z = tl.sum(b_az, axis=0)[:, None]
        b_ws = tl.sum(b_wsum, axis=0)[:, None]  # 0 unless FAST
        tl.store(p_o, (VSC * (tl.sum(b_a0, axis=0) - b_ws) + b_z) * b_inv)
        tl.store(p_o + 1, (VSC * (tl.sum(b_a1, axis=0) - b_ws) + b_z) * b_inv)
        tl.store(p_o + 2, (VSC * (tl.sum(b_a2, axis=0) - b_ws) + b_z) * b_inv)
        tl.store(p_o + 3, (VSC * (tl.sum(b_a3, axis=0) - b_ws) + b_z) * b_inv)
        if COUNT:
            tl.store(stats_ptr + i_prog * 2, tl.sum(tl.sum(b_cnt_cold, axis=1), axis=0))
            tl.store(stats_ptr + i_prog * 2 + 1, tl.sum(tl.sum(b_cnt_all, axis=1), axis=0))


@triton.jit
def _wfield(w, one, POS: tl.constexpr, NB: tl.constexpr, FAST: tl.constexpr):
    """The NB-bit field at bit POS (0..31) of int32 words `w` as fp32. FAST: `1 + field * 2**(TGT - 23)`: the field
    shifted to bits TGT .. TGT + NB - 1 of 1.0's mantissa and OR-ed into it (one shift, one LOP3; no conversion).
    TGT cycles through 15, 15 + NB, .. 23 - NB over consecutive fields, so the 8 / NB fields of a byte move by the
    same shift (computed once) and each shift serves 8 / NB fields; the lowest sits 2**-8 below 1.0, so fp32 keeps
    ~2**-15 relative of the field's term. `one`: the bits of 1.0 (0x3F800000) as a run-time register value, so that
    the LOP3's one immediate is the field's mask (two constants would be re-materialised before every LOP3). Else
    the field itself (exact)."""
    if FAST:
        TGT: tl.constexpr = 15 + NB * ((POS // NB) % (8 // NB))
        if TGT >= POS:
            x = w << (TGT - POS)
        else:
            x = w >> (POS - TGT)
        return ((x & (((1 << NB) - 1) << TGT)) | one).to(tl.float32, bitcast=True)
    else:
        return _u2f((w >> POS) & ((1 << NB) - 1))


@triton.jit
def _kacc8(b_sa, w, one, q0, q1, q2, q3, q4, q5, q6, q7, POS0: tl.constexpr, STEP: tl.constexpr, NB: tl.constexpr,
           FAST: tl.constexpr):  # fmt: skip
    """`b_sa += field_i(w) * q_i` for the 8 key lanes at bits POS0 + STEP * i of the words `w` [NP, PAGE, DW] (the
    lane queries `q_i` [NP, DW] carry the page's scale): one FFMA per code element, summed over words after."""
    b_sa += _wfield(w, one, POS0, NB, FAST) * q0[:, None, :]
    b_sa += _wfield(w, one, POS0 + STEP, NB, FAST) * q1[:, None, :]
    b_sa += _wfield(w, one, POS0 + 2 * STEP, NB, FAST) * q2[:, None, :]
    b_sa += _wfield(w, one, POS0 + 3 * STEP, NB, FAST) * q3[:, None, :]
    b_sa += _wfield(w, one, POS0 + 4 * STEP, NB, FAST) * q4[:, None, :]
    b_sa += _wfield(w, one, POS0 + 5 * STEP, NB, FAST) * q5[:, None, :]
    b_sa += _wfield(w, one, POS0 + 6 * STEP, NB, FAST) * q6[:, None, :]
    b_sa += _wfield(w, one, POS0 + 7 * STEP, NB, FAST) * q7[:, None, :]
    return b_sa


@triton.jit
def _vacc8(a0, a1, a2, a3, a4, a5, a6, a7, w, one, b_w3, POS0: tl.constexpr, STEP: tl.constexpr, NB: tl.constexpr,
           FAST: tl.constexpr):  # fmt: skip
    """`a_i += w3 * field_i(w)` for 8 value lanes at bits POS0 + STEP * i of the words `w` [T, NG, VW]."""
    a0 += b_w3 * _wfield(w, one, POS0, NB, FAST)
    a1 += b_w3 * _wfield(w, one, POS0 + STEP, NB, FAST)
    a2 += b_w3 * _wfield(w, one, POS0 + 2 * STEP, NB, FAST)
    a3 += b_w3 * _wfield(w, one, POS0 + 3 * STEP, NB, FAST)
    a4 += b_w3 * _wfield(w, one, POS0 + 4 * STEP, NB, FAST)
    a5 += b_w3 * _wfield(w, one, POS0 + 5 * STEP, NB, FAST)
    a6 += b_w3 * _wfield(w, one, POS0 + 6 * STEP, NB, FAST)
    a7 += b_w3 * _wfield(w, one, POS0 + 7 * STEP, NB, FAST)
    return a0, a1, a2, a3, a4, a5, a6, a7


@triton.jit
def _split8(x):
    """The 8 lanes of the last axis of `x` [A, B, 8] as 8 tensors [A, B] (lane order 0..7), by three halvings."""
    A: tl.constexpr = x.shape[0]
    B: tl.constexpr = x.shape[1]
    e, o = tl.split(tl.reshape(x, [A, B, 4, 2]))  # lanes 2j, 2j + 1
    ee, eo = tl.split(tl.reshape(e, [A, B, 2, 2]))  # 4j, 4j + 2
    oe, oo = tl.split(tl.reshape(o, [A, B, 2, 2]))  # 4j + 1, 4j + 3
    l0, l4 = tl.split(ee)
    l2, l6 = tl.split(eo)
    l1, l5 = tl.split(oe)
    l3, l7 = tl.split(oo)
    return l0, l1, l2, l3, l4, l5, l6, l7


@triton.jit
def _wscores(b_kw, b_ksf, b_kz, b_q, b_qk, one, KV_FMT: tl.constexpr, FAST: tl.constexpr):
    """Scores `[NP, PAGE]` (log2 units, unmasked) of one step's key words `b_kw` [NP, PAGE, DW]: the page's key
    scale `b_ksf` [NP, D] folded into the lane queries (`b_qk`: the query with the fields' powers of two folded in,
    `_wfield`), its zero `b_kz` into a per-page bias with the plain query `b_q`; one FFMA per code element into a
    `[NP, PAGE, DW]` tile summed over words once."""
    NP: tl.constexpr = b_kw.shape[0]
    PAGE: tl.constexpr = b_kw.shape[1]
    DW: tl.constexpr = b_kw.shape[2]
    b_bias = tl.sum(b_kz.to(tl.float32) * b_q[None, :], axis=1)  # [NP]
    b_qs = b_ksf.to(tl.float32) * b_qk[None, :]  # [NP, D]: query x the page's key scale
    if FAST:  # the `1` of every f
        b_bias -= tl.sum(b_qs, axis=1)
    b_sa = tl.zeros([NP, PAGE, DW], dtype=tl.float32)
    if KV_FMT == 4:
        l0, l1, l2, l3, l4, l5, l6, l7 = _split8(tl.reshape(b_qs, [NP, DW, 8]))
        b_sa = _kacc8(b_sa, b_kw, one, l0, l1, l2, l3, l4, l5, l6, l7, 0, 4, 4, FAST)
    else:
        b_e, b_o = tl.split(tl.reshape(b_qs, [NP, DW, 8, 2]))  # even lanes 2j, odd lanes 2j + 1
        l0, l1, l2, l3, l4, l5, l6, l7 = _split8(b_e)
        b_sa = _kacc8(b_sa, b_kw, one, l0, l1, l2, l3, l4, l5, l6, l7, 0, 4, 2, FAST)
        l0, l1, l2, l3, l4, l5, l6, l7 = _split8(b_o)
        b_sa = _kacc8(b_sa, b_kw, one, l0, l1, l2, l3, l4, l5, l6, l7, 2, 4, 2, FAST)
    return tl.sum(b_sa, axis=2) + b_bias[:, None]


@triton.jit
def _vstore(p_o, a, b_ws, b_z, b_inv, VSC: tl.constexpr):
    tl.store(p_o, (VSC * (tl.sum(a, axis=0) - b_ws) + b_z) * b_inv)


@triton.jit
def _wfinish(
    o_ptr, lse_ptr, o_part, b_mr, b_lv, b_az, b_wsum, a0, a1, a2, a3, a4, a5, a6, a7, c0, c1, c2, c3, c4, c5, c6, c7,
    D: tl.constexpr, KV_FMT: tl.constexpr, FAST: tl.constexpr,
):
    """The word path's partial `(o, lse)` of row `o_part` from its per-thread sums (`[T, NG, VW]` value lanes: `a_i`
    even lanes 2i, `c_i` odd lanes 2i + 1 of each word; `[T, NG]` zero term and `p * scale` sum; `[NP, PAGE]` l)."""
    NG: tl.constexpr = a0.shape[1]
    VW: tl.constexpr = a0.shape[2]
    # FAST: value code = (f - 1) * VSC per lane (`_wfield`'s TGT): lanes 2i (a_i) / 2i + 1 (c_i), i even / odd
    VA0: tl.constexpr = 256.0 if FAST else 1.0
    VA1: tl.constexpr = 16.0 if FAST else 1.0
    VC0: tl.constexpr = (256.0 if KV_FMT == 4 else 64.0) if FAST else 1.0
    VC1: tl.constexpr = (16.0 if KV_FMT == 4 else 4.0) if FAST else 1.0
    o_g = tl.arange(0, NG)
    o_u = tl.arange(0, VW)
    b_l = tl.sum(tl.sum(b_lv, axis=1), axis=0)
    b_lse = tl.where(b_l > 0, b_mr + tl.log2(tl.where(b_l > 0, b_l, 1.0)), float("-inf"))
    tl.store(lse_ptr + o_part, b_lse)
    b_inv = 1.0 / tl.where(b_l > 0, b_l, 1.0)
    p_o = o_ptr + o_part * D + (o_g[:, None] * VW + o_u[None, :]) * 16  # [NG, VW]: lane 0 of each word
    b_z = tl.sum(b_az, axis=0)[:, None]
    b_ws = tl.sum(b_wsum, axis=0)[:, None]  # 0 unless FAST
    _vstore(p_o, a0, b_ws, b_z, b_inv, VA0)
    _vstore(p_o + 2, a1, b_ws, b_z, b_inv, VA1)
    _vstore(p_o + 4, a2, b_ws, b_z, b_inv, VA0)
    _vstore(p_o + 6, a3, b_ws, b_z, b_inv, VA1)
    _vstore(p_o + 8, a4, b_ws, b_z, b_inv, VA0)
    _vstore(p_o + 10, a5, b_ws, b_z, b_inv, VA1)
    _vstore(p_o + 12, a6, b_ws, b_z, b_inv, VA0)
    _vstore(p_o + 14, a7, b_ws, b_z, b_inv, VA1)
    _vstore(p_o + 1, c0, b_ws, b_z, b_inv, VC0)
    _vstore(p_o + 3, c1, b_ws, b_z, b_inv, VC1)
    _vstore(p_o + 5, c2, b_ws, b_z, b_inv, VC0)
    _vstore(p_o + 7, c3, b_ws, b_z, b_inv, VC1)
    _vstore(p_o + 9, c4, b_ws, b_z, b_inv, VC0)
    _vstore(p_o + 11, c5, b_ws, b_z, b_inv, VC1)
    _vstore(p_o + 13, c6, b_ws, b_z, b_inv, VC0)
    _vstore(p_o + 15, c7, b_ws, b_z, b_inv, VC1)


@triton.jit
def _value_words(b_vh, b_vl, KV_FMT: tl.constexpr):
    """The value words whose lanes `_vsums` reads: INT4's two 2-bit planes merged into 4-bit codes `4 hi + lo` (even
    fields: hi's bits moved up by 2; odd fields: lo's moved down), INT2's plane twice."""
    if KV_FMT == 4:
        return ((b_vh << 2) & ~0x33333333) | (b_vl & 0x33333333), (b_vh & ~0x33333333) | ((b_vl >> 2) & 0x33333333)
    else:
        return b_vh, b_vh


@triton.jit
def _vsums(a0, a1, a2, a3, a4, a5, a6, a7, c0, c1, c2, c3, c4, c5, c6, c7, w_a, w_c, one, b_w3,
           KV_FMT: tl.constexpr, FAST: tl.constexpr):  # fmt: skip
    """A step's value sums of the 16 lanes (`_value_words`' words `w_a`, `w_c`): INT4 even / odd 4-bit fields, INT2
    the 2-bit fields at bits 0, 4, ... and 2, 6, ..."""
    a0, a1, a2, a3, a4, a5, a6, a7 = _vacc8(a0, a1, a2, a3, a4, a5, a6, a7, w_a, one, b_w3, 0, 4, KV_FMT, FAST)
    c0, c1, c2, c3, c4, c5, c6, c7 = _vacc8(c0, c1, c2, c3, c4, c5, c6, c7, w_c, one, b_w3, 4 - KV_FMT, 4, KV_FMT, FAST)
    return a0, a1, a2, a3, a4, a5, a6, a7, c0, c1, c2, c3, c4, c5, c6, c7


@triton.jit
def _key_tiles(
    hk_ptr, hks_ptr, hkz_ptr, o_t3, o_pg, o_w, o_d, limit, p_end, stride_hkt, stride_hksp, m_wd, m_cd,
    PAD: tl.constexpr,
):
    """A step's key inputs on the word paths: the code words `[NP, PAGE, words]` of the tokens before `limit`, and the
    pages' scale and zero tiles `[NP, D]` (0 past the split's last page; past the head dim when the tile is padded)."""
    kw = tl.load(hk_ptr + o_t3 * stride_hkt + o_w[None, None, :], mask=_cmask(o_t3 < limit, m_wd, PAD), other=0)
    ks = tl.load(
        hks_ptr + o_pg[:, None] * stride_hksp + o_d[None, :], mask=_cmask((o_pg < p_end)[:, None], m_cd, PAD), other=0.0
    )
    kz = tl.load(
        hkz_ptr + o_pg[:, None] * stride_hksp + o_d[None, :], mask=_cmask((o_pg < p_end)[:, None], m_cd, PAD), other=0.0
    )
    return kw, ks, kz


@triton.jit
def _move_reference(
    b_mr, b_mx, b_lv, b_az, b_wsum, a0, a1, a2, a3, a4, a5, a6, a7, c0, c1, c2, c3, c4, c5, c6, c7,
):
    """The word loops' lazy softmax reference: moved to the step's maximum `b_mx` only when that exceeds it by more than
    2**8 (rare after the first steps), every per-thread sum rescaled with it; returns the reference and the sums."""
    if b_mx > b_mr + 8.0:
        b_alpha = tl.exp2(b_mr - b_mx)
        b_lv *= b_alpha
        a0, a1, a2, a3, a4, a5, a6, a7 = (
            a0 * b_alpha, a1 * b_alpha, a2 * b_alpha, a3 * b_alpha, a4 * b_alpha, a5 * b_alpha, a6 * b_alpha,
            a7 * b_alpha,
        )  # fmt: skip
        c0, c1, c2, c3, c4, c5, c6, c7 = (
            c0 * b_alpha, c1 * b_alpha, c2 * b_alpha, c3 * b_alpha, c4 * b_alpha, c5 * b_alpha, c6 * b_alpha,
            c7 * b_alpha,
        )  # fmt: skip
        b_az *= b_alpha
        b_wsum *= b_alpha
        b_mr = b_mx
    return b_mr, b_lv, b_az, b_wsum, a0, a1, a2, a3, a4, a5, a6, a7, c0, c1, c2, c3, c4, c5, c6, c7


@triton.jit
def _codes_history_row1w(
    b_q, b_run, q_ptr, qk_scale, o_ptr, lse_ptr, pmax_ptr, p_valid, stride_validt, hk_ptr, hks_ptr, hkz_ptr, hv_ptr,
    hvl_ptr, hvs_ptr, hvz_ptr, stats_ptr, stride_hkt, stride_hksp, stride_hvt, stride_hvst, i_bh, o_part, i_prog, nh,
    hist_start, p_begin, p_end, n_pages, margin, sc_ptr,
    D: tl.constexpr, PAGE: tl.constexpr, VGROUP: tl.constexpr, KV_FMT: tl.constexpr, NP: tl.constexpr,
    USE_VALID: tl.constexpr, USE_VPREC: tl.constexpr, COUNT: tl.constexpr, PAGE_MAX_ONLY: tl.constexpr,
    FAST: tl.constexpr, SCORES: tl.constexpr, DH: tl.constexpr, hmin_ptr=None, OPT: tl.constexpr = 0,
):
    """`_codes_history_row1` reading codes as 32-bit words (v4): key words `[NP, PAGE, D * nbits / 32]`, value
    words `[T, groups, VGROUP / 16]` per plane, each word unpacked in registers by shift + LOP3 per field (no byte
    extraction); the key lanes accumulate with one FFMA per element into a tile summed over words once per step; the
    INT4 value planes are first merged into two words of 4-bit codes (`4 hi + lo`: even and odd fields) with two
    shift + LOP3 per word pair. The next step's codes, scales and zeros are loaded at the top of the step (carried
    into the next), so their latency overlaps this step's arithmetic. Pointers to codes are `int32` pointers already
    at (b, h_kv); strides of code tensors in words. Same contract and results as `_codes_history_row1`. With
    `PAGE_MAX_ONLY and SCORES` the page-maxima pass also stores every token's score at `sc_ptr` (v5's score pass).
    `OPT` 1 (V precision's optimistic pass, `ops._coded_attention_fwd`): the value pass also stores its page maxima
    and the lowest score it read hot at `hmin_ptr + o_part`."""
    LANES: tl.constexpr = 32 // KV_FMT  # key channels per word: lane j of word w is channel LANES * w + j
    DW: tl.constexpr = D // LANES
    NG: tl.constexpr = D // VGROUP  # value groups per token
    VW: tl.constexpr = VGROUP // 16  # plane words per value group; lane j of word u is channel 16 * u + j
    T: tl.constexpr = NP * PAGE
    o_np = tl.arange(0, NP)
    o_pt = tl.arange(0, PAGE)
    o_w = tl.arange(0, DW)
    o_d = tl.arange(0, D)
    o_tt = tl.arange(0, T)
    o_g = tl.arange(0, NG)
    o_u = tl.arange(0, VW)
    o_gu = (o_g[:, None] * VW + o_u[None, :])[None, :, :]  # [1, NG, VW] word of the value plane
    PAD: tl.constexpr = DH < D  # head dim DH < D: key words, channels and value groups past DH load 0
    m_wd, m_cd, m_gd = (o_w < DH // LANES)[None, None, :], (o_d < DH)[None, :], o_g < DH // VGROUP
    m_gv, m_gs = m_gd[None, :, None], m_gd[None, :]
    limit = tl.minimum(nh, p_end * PAGE)  # history tokens this program reads
    b_mr = tl.max(tl.full([NP], float("-inf"), dtype=tl.float32), axis=0)  # softmax reference (log2 units)
    b_lv = tl.zeros([NP, PAGE], dtype=tl.float32)
    z3 = tl.zeros([T, NG, VW], dtype=tl.float32)
    a0, a1, a2, a3, a4, a5, a6, a7 = z3, z3, z3, z3, z3, z3, z3, z3  # even value lanes 0, 2, .., 14
    c0, c1, c2, c3, c4, c5, c6, c7 = z3, z3, z3, z3, z3, z3, z3, z3  # odd value lanes 1, 3, .., 15
    b_az = tl.zeros([T, NG], dtype=tl.float32)  # p * zero (+ 1.5 * p * scale of cold tokens)
    b_wsum = tl.zeros([T, NG], dtype=tl.float32)  # p * scale (FAST: the `1` of every f)
    if COUNT:
        b_cnt_cold = tl.zeros([NP, PAGE], dtype=tl.int32)
        b_cnt_all = tl.zeros([NP, PAGE], dtype=tl.int32)
    if OPT == 1:
        b_hmin = tl.min(tl.full([NP], float("inf"), dtype=tl.float32), axis=0)  # lowest score read hot
    one = (tl.max(b_q * 0.0, axis=0) + 1.0).to(tl.int32, bitcast=True)  # 0x3F800000, not a compile-time constant
    if FAST:  # code = (f - 1) * 2**(23 - TGT) with TGT of the channel's field (`_wfield`): folded into the query
        b_qk = b_q * (1 << (8 - KV_FMT * ((o_d % LANES) % (8 // KV_FMT)))).to(tl.float32)
    else:
        b_qk = b_q
    # the first step's tiles (the loop loads the next step's at its top)
    o_pg = p_begin + o_np
    o_t3 = (o_pg[:, None] * PAGE + o_pt[None, :])[:, :, None]
    n_kw, n_ks, n_kz = _key_tiles(
        hk_ptr, hks_ptr, hkz_ptr, o_t3, o_pg, o_w, o_d, limit, p_end, stride_hkt, stride_hksp, m_wd, m_cd, PAD
    )
    if not PAGE_MAX_ONLY:
        o_t1 = p_begin * PAGE + o_tt
        o_v3 = o_t1[:, None, None] * stride_hvt + o_gu
        n_vh = tl.load(hv_ptr + o_v3, mask=_cmask((o_t1 < limit)[:, None, None], m_gv, PAD), other=0)
        if KV_FMT == 4 and not USE_VPREC:
            n_vl = tl.load(hvl_ptr + o_v3, mask=_cmask((o_t1 < limit)[:, None, None], m_gv, PAD), other=0)
        else:
            n_vl = n_vh
        o_s2 = o_t1[:, None] * stride_hvst + o_g[None, :]
        n_vs = tl.load(hvs_ptr + o_s2, mask=_cmask((o_t1 < limit)[:, None], m_gs, PAD), other=0.0)
        n_vz = tl.load(hvz_ptr + o_s2, mask=_cmask((o_t1 < limit)[:, None], m_gs, PAD), other=0.0)
    for i_p0 in range(p_begin, p_end, NP):
        b_kw, b_ksf, b_kz = n_kw, n_ks, n_kz
        if not PAGE_MAX_ONLY:
            b_vh, b_vl, b_vs, b_vz = n_vh, n_vl, n_vs, n_vz
        # the next step's tiles, in flight while this step computes (masked off past the split's end)
        o_pgn = i_p0 + NP + o_np
        o_t3n = (o_pgn[:, None] * PAGE + o_pt[None, :])[:, :, None]
        n_kw = tl.load(hk_ptr + o_t3n * stride_hkt + o_w[None, None, :], mask=_cmask(o_t3n < limit, m_wd, PAD), other=0)
        m_pgn = (o_pgn < p_end)[:, None]
        n_ks = tl.load(hks_ptr + o_pgn[:, None] * stride_hksp + o_d[None, :], mask=_cmask(m_pgn, m_cd, PAD), other=0.0)
        n_kz = tl.load(hkz_ptr + o_pgn[:, None] * stride_hksp + o_d[None, :], mask=_cmask(m_pgn, m_cd, PAD), other=0.0)
        if not PAGE_MAX_ONLY:
            o_t1n = (i_p0 + NP) * PAGE + o_tt
            m_t1n = o_t1n < limit
            o_v3n = o_t1n[:, None, None] * stride_hvt + o_gu
            n_vh = tl.load(hv_ptr + o_v3n, mask=_cmask(m_t1n[:, None, None], m_gv, PAD), other=0)
            if KV_FMT == 4 and not USE_VPREC:
                n_vl = tl.load(hvl_ptr + o_v3n, mask=_cmask(m_t1n[:, None, None], m_gv, PAD), other=0)
            else:
                n_vl = n_vh
            o_s2n = o_t1n[:, None] * stride_hvst + o_g[None, :]
            n_vs = tl.load(hvs_ptr + o_s2n, mask=_cmask(m_t1n[:, None], m_gs, PAD), other=0.0)
            n_vz = tl.load(hvz_ptr + o_s2n, mask=_cmask(m_t1n[:, None], m_gs, PAD), other=0.0)
        # scores: the page's key scale folded into the lane queries, its zero into a per-page bias
        o_pg = i_p0 + o_np  # [NP] pages
        m_pg = o_pg < p_end
        o_t2 = o_pg[:, None] * PAGE + o_pt[None, :]  # [NP, PAGE] history token index
        m_vis = o_t2 < limit
        b_s = _wscores(b_kw, b_ksf, b_kz, b_q, b_qk, one, KV_FMT, FAST)  # [NP, PAGE]
        if USE_VALID:
            b_valid = tl.load(p_valid + (hist_start + o_t2) * stride_validt, mask=m_vis, other=0) != 0
            m_vis = m_vis & b_valid
        b_s = tl.where(m_vis, b_s, float("-inf"))
        b_pm = tl.max(b_s, axis=1)  # [NP] page maxima
        if PAGE_MAX_ONLY:
            tl.store(pmax_ptr + i_bh * n_pages + o_pg, b_pm, mask=m_pg)
            if SCORES:  # v5: every token's score (-inf where not read), for the V pass (`_codes_history_row1p`)
                tl.store(sc_ptr + o_t2, b_s, mask=m_pg[:, None])
        else:
            b_mx = tl.max(b_pm, axis=0)
            b_mr, b_lv, b_az, b_wsum, a0, a1, a2, a3, a4, a5, a6, a7, c0, c1, c2, c3, c4, c5, c6, c7 = _move_reference(
                b_mr, b_mx, b_lv, b_az, b_wsum, a0, a1, a2, a3, a4, a5, a6, a7, c0, c1, c2, c3, c4, c5, c6, c7
            )
            b_p = tl.exp2(b_s - tl.where(b_mr == float("-inf"), 0.0, b_mr))  # [NP, PAGE], 0 where not read
            b_lv += b_p
            o_t1 = i_p0 * PAGE + o_tt  # [T]
            m_t1 = o_t1 < limit
            if USE_VPREC:
                # running max of each page: the seed, then the prefix of page maxima up to the page itself
                b_pre = tl.max(tl.where(o_np[None, :] <= o_np[:, None], b_pm[None, :], float("-inf")), axis=1)
                b_runp = tl.maximum(b_pre, b_run)
                b_run = tl.maximum(b_run, b_mx)
                m_hot = m_vis & (b_s >= b_runp[:, None] - margin)
                if COUNT:
                    b_cnt_all += m_vis.to(tl.int32)
                    b_cnt_cold += (m_vis & ~m_hot).to(tl.int32)
                if OPT == 1:
                    tl.store(pmax_ptr + i_bh * n_pages + o_pg, b_pm, mask=m_pg)
                    b_hmin = tl.minimum(b_hmin, tl.min(tl.min(tl.where(m_hot, b_s, float("inf")), axis=1), axis=0))
                b_pc = tl.reshape(tl.where(m_hot, 0.0, b_p), [T])  # p of cold tokens (0 where not read)
                m_lo = m_t1 & tl.reshape(m_hot, [T])
                o_v3 = o_t1[:, None, None] * stride_hvt + o_gu
                b_vl = tl.load(hvl_ptr + o_v3, mask=_cmask(m_lo[:, None, None], m_gv, PAD), other=0)  # 0 where cold
            b_p1 = tl.reshape(b_p, [T])
            b_vsf = b_vs.to(tl.float32)
            b_w = b_p1[:, None] * b_vsf  # [T, NG]: p * scale
            b_az += b_p1[:, None] * b_vz.to(tl.float32)
            if FAST:
                b_wsum += b_w
            b_w3 = b_w[:, :, None]
            if KV_FMT == 4 and USE_VPREC:
                b_az += 1.5 * b_pc[:, None] * b_vsf  # cold tokens read the hi bucket's midpoint
            b_wa, b_wc = _value_words(b_vh, b_vl, KV_FMT)
            a0, a1, a2, a3, a4, a5, a6, a7, c0, c1, c2, c3, c4, c5, c6, c7 = _vsums(
                a0, a1, a2, a3, a4, a5, a6, a7, c0, c1, c2, c3, c4, c5, c6, c7, b_wa, b_wc, one, b_w3, KV_FMT, FAST
            )
    if not PAGE_MAX_ONLY:
        _wfinish(
            o_ptr, lse_ptr, o_part, b_mr, b_lv, b_az, b_wsum, a0, a1, a2, a3, a4, a5, a6, a7, c0, c1, c2, c3, c4, c5,
            c6, c7, D, KV_FMT, FAST,
        )  # fmt: skip
        if OPT == 1:
            tl.store(hmin_ptr + o_part, b_hmin)
        if COUNT:
            tl.store(stats_ptr + i_prog * 2, tl.sum(tl.sum(b_cnt_cold, axis=1), axis=0))
            tl.store(stats_ptr + i_prog * 2 + 1, tl.sum(tl.sum(b_cnt_all, axis=1), axis=0))


@triton.jit
def _row1s_tiles(hk_ptr, hks_ptr, hkz_ptr, hv_ptr, hvl_ptr, hvs_ptr, hvz_ptr, stride_hkt, stride_hksp, stride_hvt,
                 stride_hvst, t0, limit, p_end, D: tl.constexpr, PAGE: tl.constexpr, VGROUP: tl.constexpr,
                 KV_FMT: tl.constexpr, TS: tl.constexpr):  # fmt: skip
    """One step's tiles of `_codes_history_row1s` (tokens `t0 .. t0 + TS`, masked at `limit`; the page's key scale /
    zero masked past `p_end`): key words [1, TS, DW], value words [TS, NG, VW] (hi, lo), value scale / zero [TS, NG]."""
    DW: tl.constexpr = D // (32 // KV_FMT)
    NG: tl.constexpr = D // VGROUP
    VW: tl.constexpr = VGROUP // 16
    o_np = tl.arange(0, 1)
    o_t1 = t0 + tl.arange(0, TS)
    m_t1 = o_t1 < limit
    o_pg = t0 // PAGE + o_np
    o_d = tl.arange(0, D)
    o_g = tl.arange(0, NG)
    o_gu = (o_g[:, None] * VW + tl.arange(0, VW)[None, :])[None, :, :]
    b_kw = tl.load(hk_ptr + o_t1[None, :, None] * stride_hkt + tl.arange(0, DW)[None, None, :],
                   mask=m_t1[None, :, None], other=0)  # fmt: skip
    b_ks = tl.load(hks_ptr + o_pg[:, None] * stride_hksp + o_d[None, :], mask=(o_pg < p_end)[:, None], other=0.0)
    b_kz = tl.load(hkz_ptr + o_pg[:, None] * stride_hksp + o_d[None, :], mask=(o_pg < p_end)[:, None], other=0.0)
    o_v3 = o_t1[:, None, None] * stride_hvt + o_gu
    b_vh = tl.load(hv_ptr + o_v3, mask=m_t1[:, None, None], other=0)
    if KV_FMT == 4:
        b_vl = tl.load(hvl_ptr + o_v3, mask=m_t1[:, None, None], other=0)
    else:
        b_vl = b_vh
    o_s2 = o_t1[:, None] * stride_hvst + o_g[None, :]
    b_vs = tl.load(hvs_ptr + o_s2, mask=m_t1[:, None], other=0.0)
    b_vz = tl.load(hvz_ptr + o_s2, mask=m_t1[:, None], other=0.0)
    return b_kw, b_ks, b_kz, b_vh, b_vl, b_vs, b_vz


@triton.jit
def _row1s_step(
    b_kw, b_ksf, b_kz, b_vh, b_vl, b_vs, b_vz, b_q, b_qk, one, p_valid, stride_validt, hist_start, t0, limit, b_mr,
    b_lv, b_az, b_wsum, a0, a1, a2, a3, a4, a5, a6, a7, c0, c1, c2, c3, c4, c5, c6, c7,
    KV_FMT: tl.constexpr, TS: tl.constexpr, USE_VALID: tl.constexpr, FAST: tl.constexpr,
):
    """One step of `_codes_history_row1s` (`_codes_history_row1w`'s plain step): scores, the lazy softmax reference,
    the value sums; returns the updated reference and per-thread sums."""
    o_t2 = (t0 + tl.arange(0, TS))[None, :]  # [1, TS] history token index
    m_vis = o_t2 < limit
    b_s = _wscores(b_kw, b_ksf, b_kz, b_q, b_qk, one, KV_FMT, FAST)  # [1, TS]
    if USE_VALID:
        b_valid = tl.load(p_valid + (hist_start + o_t2) * stride_validt, mask=m_vis, other=0) != 0
        m_vis = m_vis & b_valid
    b_s = tl.where(m_vis, b_s, float("-inf"))
    b_mx = tl.max(tl.max(b_s, axis=1), axis=0)
    b_mr, b_lv, b_az, b_wsum, a0, a1, a2, a3, a4, a5, a6, a7, c0, c1, c2, c3, c4, c5, c6, c7 = _move_reference(
        b_mr, b_mx, b_lv, b_az, b_wsum, a0, a1, a2, a3, a4, a5, a6, a7, c0, c1, c2, c3, c4, c5, c6, c7
    )
    b_p = tl.exp2(b_s - tl.where(b_mr == float("-inf"), 0.0, b_mr))  # [1, TS], 0 where not read
    b_lv += b_p
    b_p1 = tl.reshape(b_p, [TS])
    b_w = b_p1[:, None] * b_vs.to(tl.float32)  # [TS, NG]: p * scale
    b_az += b_p1[:, None] * b_vz.to(tl.float32)
    if FAST:
        b_wsum += b_w
    b_w3 = b_w[:, :, None]
    b_wa, b_wc = _value_words(b_vh, b_vl, KV_FMT)
    a0, a1, a2, a3, a4, a5, a6, a7, c0, c1, c2, c3, c4, c5, c6, c7 = _vsums(
        a0, a1, a2, a3, a4, a5, a6, a7, c0, c1, c2, c3, c4, c5, c6, c7, b_wa, b_wc, one, b_w3, KV_FMT, FAST
    )
    return b_mr, b_lv, b_az, b_wsum, a0, a1, a2, a3, a4, a5, a6, a7, c0, c1, c2, c3, c4, c5, c6, c7


@triton.jit
def _codes_history_row1s(
    b_q, o_ptr, lse_ptr, p_valid, stride_validt, hk_ptr, hks_ptr, hkz_ptr, hv_ptr, hvl_ptr, hvs_ptr, hvz_ptr,
    stride_hkt, stride_hksp, stride_hvt, stride_hvst, o_part, nh, hist_start, p_begin, p_end,
    D: tl.constexpr, PAGE: tl.constexpr, VGROUP: tl.constexpr, KV_FMT: tl.constexpr, TS: tl.constexpr,
    USE_VALID: tl.constexpr, FAST: tl.constexpr, STAGES: tl.constexpr,
):
    """v6 (session 13, `ROW1_TUNING["sub"]`): `_codes_history_row1w`'s loop without V precision over steps of `TS`
    tokens, a part of one page (`PAGE // TS` steps per page; each step reloads its page's key scale / zero, an L1
    hit after the first). A step's tiles and per-thread sums are `TS / PAGE` of a page step's, so one warp per
    program holds what two warps hold at one page per step: every reduction and layout conversion of a step stays in
    one warp (its `bar.sync` waits for no other warp) and the SM holds twice the independent programs at the same
    registers per thread. `STAGES` 0: the next step's tiles are loaded into registers at the top of each step (v4's
    prefetch); >= 2 (`ROW1_TUNING["sub_stages"]`): each step loads its own tiles in a `tl.range(num_stages=STAGES)`
    loop, which Triton's pipeliner may turn into asynchronous copies `STAGES - 1` steps ahead through shared memory
    (bytes in flight without registers). Same field reads and results as `_codes_history_row1w`."""
    LANES: tl.constexpr = 32 // KV_FMT
    NG: tl.constexpr = D // VGROUP
    VW: tl.constexpr = VGROUP // 16
    o_d = tl.arange(0, D)
    limit = tl.minimum(nh, p_end * PAGE)
    t_end = p_end * PAGE
    b_mr = tl.max(tl.full([1], float("-inf"), dtype=tl.float32), axis=0)
    b_lv = tl.zeros([1, TS], dtype=tl.float32)
    z3 = tl.zeros([TS, NG, VW], dtype=tl.float32)
    a0, a1, a2, a3, a4, a5, a6, a7 = z3, z3, z3, z3, z3, z3, z3, z3  # even value lanes 0, 2, .., 14
    c0, c1, c2, c3, c4, c5, c6, c7 = z3, z3, z3, z3, z3, z3, z3, z3  # odd value lanes 1, 3, .., 15
    b_az = tl.zeros([TS, NG], dtype=tl.float32)
    b_wsum = tl.zeros([TS, NG], dtype=tl.float32)
    one = (tl.max(b_q * 0.0, axis=0) + 1.0).to(tl.int32, bitcast=True)
    if FAST:
        b_qk = b_q * (1 << (8 - KV_FMT * ((o_d % LANES) % (8 // KV_FMT)))).to(tl.float32)
    else:
        b_qk = b_q
    if STAGES > 0:
        for t0 in tl.range(p_begin * PAGE, t_end, TS, num_stages=STAGES):
            b_kw, b_ks, b_kz, b_vh, b_vl, b_vs, b_vz = _row1s_tiles(
                hk_ptr, hks_ptr, hkz_ptr, hv_ptr, hvl_ptr, hvs_ptr, hvz_ptr, stride_hkt, stride_hksp, stride_hvt,
                stride_hvst, t0, limit, p_end, D, PAGE, VGROUP, KV_FMT, TS,
            )  # fmt: skip
            b_mr, b_lv, b_az, b_wsum, a0, a1, a2, a3, a4, a5, a6, a7, c0, c1, c2, c3, c4, c5, c6, c7 = _row1s_step(
                b_kw, b_ks, b_kz, b_vh, b_vl, b_vs, b_vz, b_q, b_qk, one, p_valid, stride_validt, hist_start, t0,
                limit, b_mr, b_lv, b_az, b_wsum, a0, a1, a2, a3, a4, a5, a6, a7, c0, c1, c2, c3, c4, c5, c6, c7,
                KV_FMT, TS, USE_VALID, FAST,
            )  # fmt: skip
    else:
        # the first step's tiles (the loop loads the next step's at its top)
        n_kw, n_ks, n_kz, n_vh, n_vl, n_vs, n_vz = _row1s_tiles(
            hk_ptr, hks_ptr, hkz_ptr, hv_ptr, hvl_ptr, hvs_ptr, hvz_ptr, stride_hkt, stride_hksp, stride_hvt,
            stride_hvst, p_begin * PAGE, limit, p_end, D, PAGE, VGROUP, KV_FMT, TS,
        )  # fmt: skip
        for t0 in range(p_begin * PAGE, t_end, TS):
            b_kw, b_ks, b_kz, b_vh, b_vl, b_vs, b_vz = n_kw, n_ks, n_kz, n_vh, n_vl, n_vs, n_vz
            # the next step's tiles, in flight while this step computes (masked off past the split's end)
            n_kw, n_ks, n_kz, n_vh, n_vl, n_vs, n_vz = _row1s_tiles(
                hk_ptr, hks_ptr, hkz_ptr, hv_ptr, hvl_ptr, hvs_ptr, hvz_ptr, stride_hkt, stride_hksp, stride_hvt,
                stride_hvst, t0 + TS, limit, p_end, D, PAGE, VGROUP, KV_FMT, TS,
            )  # fmt: skip
            b_mr, b_lv, b_az, b_wsum, a0, a1, a2, a3, a4, a5, a6, a7, c0, c1, c2, c3, c4, c5, c6, c7 = _row1s_step(
                b_kw, b_ks, b_kz, b_vh, b_vl, b_vs, b_vz, b_q, b_qk, one, p_valid, stride_validt, hist_start, t0,
                limit, b_mr, b_lv, b_az, b_wsum, a0, a1, a2, a3, a4, a5, a6, a7, c0, c1, c2, c3, c4, c5, c6, c7,
                KV_FMT, TS, USE_VALID, FAST,
            )  # fmt: skip
    _wfinish(
        o_ptr, lse_ptr, o_part, b_mr, b_lv, b_az, b_wsum, a0, a1, a2, a3, a4, a5, a6, a7, c0, c1, c2, c3, c4, c5,
        c6, c7, D, KV_FMT, FAST,
    )  # fmt: skip


@triton.jit
def _vprec_classify(b_s, m_vis, b_run, margin):
    """V precision over one step's scores `b_s` [NP, PAGE] (log2 units, -inf where not read): each page's running
    maximum (the carried `b_run`, then the prefix of the step's page maxima up to the page itself) and the hot mask
    `s >= running - margin`. Returns `(m_hot, b_run after the step, the step's maximum)`."""
    NP: tl.constexpr = b_s.shape[0]
    o_np = tl.arange(0, NP)
    b_pm = tl.max(b_s, axis=1)  # [NP] page maxima
    b_mx = tl.max(b_pm, axis=0)
    b_pre = tl.max(tl.where(o_np[None, :] <= o_np[:, None], b_pm[None, :], float("-inf")), axis=1)
    b_runp = tl.maximum(b_pre, b_run)
    m_hot = m_vis & (b_s >= b_runp[:, None] - margin)
    return m_hot, tl.maximum(b_run, b_mx), b_mx


@triton.jit
def _vp_scores_ahead(
    i0, b_q, b_qk, one, hk_ptr, hks_ptr, hkz_ptr, sc_ptr, p_valid, stride_validt, stride_hkt, stride_hksp, hist_start,
    limit, p_end, b_run, margin, kw, ks, kz, vd, sc, cnt_c, cnt_a,
    D: tl.constexpr, PAGE: tl.constexpr, NP: tl.constexpr, USE_VALID: tl.constexpr, COUNT: tl.constexpr,
    SCORES: tl.constexpr, FAST: tl.constexpr, DH: tl.constexpr,
):
    """Unrolled `_codes_history_row1p` (`VUNROLL`), first half of a step: step `k + 1`'s scores (step `k` starts at
    page `i0`) from its inputs `kw, ks, kz, vd` (or `sc` with `SCORES`), its running maxima, hot set and counts;
    then the same buffer reloaded with step `k + 3`'s inputs (two buffers alternate, so the load writes the
    registers the scores just freed and is read two steps later). The key scales / zeros load one 2-byte element
    at a time (offsets whose alignment the compiler cannot prove): loaded 4 bytes at a time, ptxas repacks them
    into the loop-carried registers a few hundred instructions after the load and waits for it there."""
    o_np = tl.arange(0, NP)
    o_pt = tl.arange(0, PAGE)
    o_w = tl.arange(0, D // 8)
    o_d = tl.arange(0, D)
    PAD: tl.constexpr = DH < D  # head dim DH < D: key words and channels past DH load 0
    o_pg = i0 + NP + o_np
    o_t2 = o_pg[:, None] * PAGE + o_pt[None, :]
    if SCORES:
        b_s1 = sc
        m_vis1 = b_s1 > float("-inf")
    else:
        m_vis1 = o_t2 < limit
        if USE_VALID:
            m_vis1 = m_vis1 & (vd != 0)
        b_s1 = tl.where(m_vis1, _wscores(kw, ks, kz, b_q, b_qk, one, 4, FAST), float("-inf"))
    m_hot1, b_run, b_mx1 = _vprec_classify(b_s1, m_vis1, b_run, margin)
    if COUNT:
        cnt_a += m_vis1.to(tl.int32)
        cnt_c += (m_vis1 & ~m_hot1).to(tl.int32)
    o_pg3 = o_pg + 2 * NP  # step k + 3
    o_t23 = o_pg3[:, None] * PAGE + o_pt[None, :]
    if SCORES:
        sc = tl.load(sc_ptr + o_t23, mask=o_t23 < limit, other=float("-inf"))
    else:
        o_t3 = o_t23[:, :, None]
        kw = tl.load(
            hk_ptr + o_t3 * stride_hkt + o_w[None, None, :],
            mask=_cmask(o_t3 < limit, (o_w < DH // 8)[None, None, :], PAD), other=0,
        )
        o_du = o_d + (p_end < 0).to(tl.int32)  # = o_d (p_end >= 0), alignment unknown to the compiler
        m_pg3 = (o_pg3 < p_end)[:, None]
        ks = tl.load(
            hks_ptr + o_pg3[:, None] * stride_hksp + o_du[None, :],
            mask=_cmask(m_pg3, (o_du < DH)[None, :], PAD), other=0.0,
        )
        kz = tl.load(
            hkz_ptr + o_pg3[:, None] * stride_hksp + o_du[None, :],
            mask=_cmask(m_pg3, (o_du < DH)[None, :], PAD), other=0.0,
        )
        if USE_VALID:
            vd = tl.load(p_valid + (hist_start + o_t23) * stride_validt, mask=o_t23 < limit, other=0)
    return b_s1, m_hot1, b_mx1, b_run, cnt_c, cnt_a, kw, ks, kz, vd, sc


@triton.jit
def _vp_values(
    i0, b_s, m_hot, b_mx, b_vh, b_vl, b_vs, b_vz, m_hot1, b_mr, b_lv, b_az, b_wsum, a0, a1, a2, a3, a4, a5, a6, a7,
    c0, c1, c2, c3, c4, c5, c6, c7, one, hv_ptr, hvl_ptr, stride_hvt, limit,
    D: tl.constexpr, PAGE: tl.constexpr, VGROUP: tl.constexpr, NP: tl.constexpr, FAST: tl.constexpr,
    DH: tl.constexpr,
):
    """Unrolled `_codes_history_row1p` (`VUNROLL`), second half of a step: step `k`'s planes merged into 4-bit
    codes, step `k + 1`'s `hi` / `lo` words loaded (`lo` masked by its hot set `m_hot1`), step `k`'s value sums
    (the lazy softmax reference moved on its maximum). Same arithmetic as the loop of `_codes_history_row1p`."""
    NG: tl.constexpr = D // VGROUP
    VW: tl.constexpr = VGROUP // 16
    T: tl.constexpr = NP * PAGE
    o_g = tl.arange(0, NG)
    o_u = tl.arange(0, VW)
    o_gu = (o_g[:, None] * VW + o_u[None, :])[None, :, :]
    m_gd = (o_g < DH // VGROUP)[None, :, None]  # value groups inside the head dim (padding: DH < D)
    b_me, b_mo = _value_words(b_vh, b_vl, 4)
    o_t1 = (i0 + NP) * PAGE + tl.arange(0, T)
    m_t1 = o_t1 < limit
    o_v3 = o_t1[:, None, None] * stride_hvt + o_gu
    n_vh = tl.load(hv_ptr + o_v3, mask=_cmask(m_t1[:, None, None], m_gd, DH < D), other=0)
    n_vl = tl.load(hvl_ptr + o_v3, mask=_cmask((m_t1 & tl.reshape(m_hot1, [T]))[:, None, None], m_gd, DH < D), other=0)
    b_mr, b_lv, b_az, b_wsum, a0, a1, a2, a3, a4, a5, a6, a7, c0, c1, c2, c3, c4, c5, c6, c7 = _move_reference(
        b_mr, b_mx, b_lv, b_az, b_wsum, a0, a1, a2, a3, a4, a5, a6, a7, c0, c1, c2, c3, c4, c5, c6, c7
    )
    b_p = tl.exp2(b_s - tl.where(b_mr == float("-inf"), 0.0, b_mr))  # [NP, PAGE], 0 where not read
    b_lv += b_p
    b_pc = tl.reshape(tl.where(m_hot, 0.0, b_p), [T])  # p of cold tokens (0 where not read)
    b_p1 = tl.reshape(b_p, [T])
    b_vsf = b_vs.to(tl.float32)
    b_w = b_p1[:, None] * b_vsf  # [T, NG]: p * scale
    b_az += b_p1[:, None] * b_vz.to(tl.float32) + 1.5 * b_pc[:, None] * b_vsf  # cold: the hi bucket's midpoint
    if FAST:
        b_wsum += b_w
    b_w3 = b_w[:, :, None]
    a0, a1, a2, a3, a4, a5, a6, a7, c0, c1, c2, c3, c4, c5, c6, c7 = _vsums(
        a0, a1, a2, a3, a4, a5, a6, a7, c0, c1, c2, c3, c4, c5, c6, c7, b_me, b_mo, one, b_w3, 4, FAST
    )
    return (
        b_mr, b_lv, b_az, b_wsum, a0, a1, a2, a3, a4, a5, a6, a7, c0, c1, c2, c3, c4, c5, c6, c7, n_vh, n_vl,
    )  # fmt: skip


@triton.jit
def _codes_history_row1p(
    b_q, b_run, o_ptr, lse_ptr, p_valid, stride_validt, hk_ptr, hks_ptr, hkz_ptr, hv_ptr, hvl_ptr, hvs_ptr, hvz_ptr,
    sc_ptr, stats_ptr, stride_hkt, stride_hksp, stride_hvt, stride_hvst, o_part, i_prog, nh, hist_start, p_begin,
    p_end, margin,
    D: tl.constexpr, PAGE: tl.constexpr, VGROUP: tl.constexpr, NP: tl.constexpr, USE_VALID: tl.constexpr,
    COUNT: tl.constexpr, SCORES: tl.constexpr, FAST: tl.constexpr, VUNROLL: tl.constexpr, DH: tl.constexpr,
):
    """V precision over INT4 words, software-pipelined (v5): the history loop of `_codes_history_row1w` with
    `USE_VPREC`, reordered so that the `lo` plane is loaded one step ahead like every other tile.

    The `lo` load of a step is masked by that step's hot set, which needs its scores. v4 computed a step's scores,
    then loaded its `lo` words and read them ~30 instructions later (the one load per step whose latency was
    exposed). Here iteration `k` (1) loads step `k + 2`'s key scales / zeros (padding; with `SCORES`, its stored
    scores) and step `k + 1`'s value scales / zeros, (2) computes step `k + 1`'s scores from the key words loaded
    one iteration earlier, its running maxima and hot set, (3) loads step `k + 2`'s key words, (4) merges step `k`'s
    planes into 4-bit codes and loads step `k + 1`'s `hi` and `lo` words (`lo` 0 where cold), then (5) accumulates
    step `k`'s values. Every load is thus read about an iteration later (SASS for sm_90: >= 300 instructions of a
    544-instruction step; a load issued while the value it replaces is live makes ptxas copy it into the
    loop-carried registers, and that copy waits for the load, hence the order). The running maximum advances in page
    order (the prologue classifies step 0), so the cold set is v4's; the lazy softmax reference moves at step `k`'s
    accumulation, as in v4.

    `SCORES`: the scores come from `sc_ptr` (the page-maxima pass wrote them, `-inf` where not read), so this pass
    reads no key codes at all (v5's split path: the launcher's second pass over K is gone). Pointers at (b, h_kv)
    (codes as int32 words, strides in words; `sc_ptr` at the row's first history token).

    `VUNROLL`: two steps per iteration with two buffers of step inputs (`_vp_scores_ahead`, `_vp_values`), so the
    key inputs are loaded three steps ahead instead of two without a register copy (opt-in, `vprec_unroll`)."""
    LANES: tl.constexpr = 8  # INT4 key channels per word
    DW: tl.constexpr = D // LANES
    NG: tl.constexpr = D // VGROUP
    VW: tl.constexpr = VGROUP // 16
    T: tl.constexpr = NP * PAGE
    o_np = tl.arange(0, NP)
    o_pt = tl.arange(0, PAGE)
    o_w = tl.arange(0, DW)
    o_d = tl.arange(0, D)
    o_tt = tl.arange(0, T)
    o_g = tl.arange(0, NG)
    o_u = tl.arange(0, VW)
    o_gu = (o_g[:, None] * VW + o_u[None, :])[None, :, :]  # [1, NG, VW] word of the value plane
    PAD: tl.constexpr = DH < D  # head dim DH < D: key words, channels and value groups past DH load 0
    m_wd, m_cd, m_gd = (o_w < DH // LANES)[None, None, :], (o_d < DH)[None, :], o_g < DH // VGROUP
    m_gv, m_gs = m_gd[None, :, None], m_gd[None, :]
    limit = tl.minimum(nh, p_end * PAGE)  # history tokens this program reads
    b_mr = tl.max(tl.full([NP], float("-inf"), dtype=tl.float32), axis=0)  # softmax reference (log2 units)
    b_lv = tl.zeros([NP, PAGE], dtype=tl.float32)
    z3 = tl.zeros([T, NG, VW], dtype=tl.float32)
    a0, a1, a2, a3, a4, a5, a6, a7 = z3, z3, z3, z3, z3, z3, z3, z3  # even value lanes 0, 2, .., 14
    c0, c1, c2, c3, c4, c5, c6, c7 = z3, z3, z3, z3, z3, z3, z3, z3  # odd value lanes 1, 3, .., 15
    b_az = tl.zeros([T, NG], dtype=tl.float32)  # p * zero + 1.5 * p * scale of cold tokens
    b_wsum = tl.zeros([T, NG], dtype=tl.float32)  # p * scale (FAST: the `1` of every f)
    if COUNT:
        b_cnt_cold = tl.zeros([NP, PAGE], dtype=tl.int32)
        b_cnt_all = tl.zeros([NP, PAGE], dtype=tl.int32)
    one = (tl.max(b_q * 0.0, axis=0) + 1.0).to(tl.int32, bitcast=True)  # 0x3F800000, not a compile-time constant
    if FAST:  # code = (f - 1) * 2**(23 - TGT) with TGT of the channel's field (`_wfield`): folded into the query
        b_qk = b_q * (1 << (8 - 4 * ((o_d % LANES) % 2))).to(tl.float32)
    else:
        b_qk = b_q

    # prologue: step 0's scores, hot set and value tiles; step 1's inputs
    o_pg = p_begin + o_np
    o_t2 = o_pg[:, None] * PAGE + o_pt[None, :]
    if SCORES:
        b_s = tl.load(sc_ptr + o_t2, mask=o_t2 < limit, other=float("-inf"))
        m_vis = b_s > float("-inf")
    else:
        o_t3 = o_t2[:, :, None]
        b_kw, b_ks, b_kz = _key_tiles(
            hk_ptr, hks_ptr, hkz_ptr, o_t3, o_pg, o_w, o_d, limit, p_end, stride_hkt, stride_hksp, m_wd, m_cd, PAD
        )
        m_vis = o_t2 < limit
        if USE_VALID:
            m_vis = m_vis & (tl.load(p_valid + (hist_start + o_t2) * stride_validt, mask=m_vis, other=0) != 0)
        b_s = tl.where(m_vis, _wscores(b_kw, b_ks, b_kz, b_q, b_qk, one, 4, FAST), float("-inf"))
    m_hot, b_run, b_mx = _vprec_classify(b_s, m_vis, b_run, margin)
    if COUNT:
        b_cnt_all += m_vis.to(tl.int32)
        b_cnt_cold += (m_vis & ~m_hot).to(tl.int32)
    o_t1 = p_begin * PAGE + o_tt
    m_t1 = o_t1 < limit
    o_v3 = o_t1[:, None, None] * stride_hvt + o_gu
    b_vh = tl.load(hv_ptr + o_v3, mask=_cmask(m_t1[:, None, None], m_gv, PAD), other=0)
    b_vl = tl.load(
        hvl_ptr + o_v3,
        mask=_cmask((m_t1 & tl.reshape(m_hot, [T]))[:, None, None], m_gv, PAD), other=0,
    )  # 0 where cold
    o_s2 = o_t1[:, None] * stride_hvst + o_g[None, :]
    b_vs = tl.load(hvs_ptr + o_s2, mask=_cmask(m_t1[:, None], m_gs, PAD), other=0.0)
    b_vz = tl.load(hvz_ptr + o_s2, mask=_cmask(m_t1[:, None], m_gs, PAD), other=0.0)
    o_pg = p_begin + NP + o_np
    o_t2 = o_pg[:, None] * PAGE + o_pt[None, :]
    if SCORES:
        n_s = tl.load(sc_ptr + o_t2, mask=o_t2 < limit, other=float("-inf"))
    else:
        o_t3 = o_t2[:, :, None]
        n_kw, n_ks, n_kz = _key_tiles(
            hk_ptr, hks_ptr, hkz_ptr, o_t3, o_pg, o_w, o_d, limit, p_end, stride_hkt, stride_hksp, m_wd, m_cd, PAD
        )
        if USE_VALID:
            n_vd = tl.load(p_valid + (hist_start + o_t2) * stride_validt, mask=o_t2 < limit, other=0)

    if VUNROLL:
        # two buffers of step inputs alternate (x: step k + 1, y: step k + 2), each reloaded with the inputs two steps
        # further right after its scores (`_vp_scores_ahead`): no register copy, every load read >= ~500 SASS later
        dz = tl.zeros([NP, PAGE], dtype=tl.int32)  # stands for the inputs a mode does not read
        if not COUNT:
            b_cnt_cold = dz
            b_cnt_all = dz
        o_pg = p_begin + 2 * NP + o_np
        o_t2 = o_pg[:, None] * PAGE + o_pt[None, :]
        if SCORES:
            x_kw, x_ks, x_kz, x_vd, x_s = dz, dz, dz, dz, n_s
            y_kw, y_ks, y_kz, y_vd = dz, dz, dz, dz
            y_s = tl.load(sc_ptr + o_t2, mask=o_t2 < limit, other=float("-inf"))
        else:
            x_kw, x_ks, x_kz, x_vd, x_s = n_kw, n_ks, n_kz, dz, dz.to(tl.float32)
            o_t3 = o_t2[:, :, None]
            y_kw = tl.load(
                hk_ptr + o_t3 * stride_hkt + o_w[None, None, :],
                mask=_cmask(o_t3 < limit, m_wd, PAD), other=0,
            )
            m_pgy = (o_pg < p_end)[:, None]
            y_ks = tl.load(
                hks_ptr + o_pg[:, None] * stride_hksp + o_d[None, :],
                mask=_cmask(m_pgy, m_cd, PAD), other=0.0,
            )
            y_kz = tl.load(
                hkz_ptr + o_pg[:, None] * stride_hksp + o_d[None, :],
                mask=_cmask(m_pgy, m_cd, PAD), other=0.0,
            )
            y_vd, y_s = dz, x_s
            if USE_VALID:
                x_vd = n_vd
                y_vd = tl.load(p_valid + (hist_start + o_t2) * stride_validt, mask=o_t2 < limit, other=0)
        for i_p0 in range(p_begin, p_end, 2 * NP):
            # step k (pages from i_p0): scores of k + 1 from buffer x, values of k
            o_t1 = (i_p0 + NP) * PAGE + o_tt
            o_s2 = o_t1[:, None] * stride_hvst + o_g[None, :]
            n_vs = tl.load(hvs_ptr + o_s2, mask=_cmask((o_t1 < limit)[:, None], m_gs, PAD), other=0.0)
            n_vz = tl.load(hvz_ptr + o_s2, mask=_cmask((o_t1 < limit)[:, None], m_gs, PAD), other=0.0)
            b_s1, m_hot1, b_mx1, b_run, b_cnt_cold, b_cnt_all, x_kw, x_ks, x_kz, x_vd, x_s = _vp_scores_ahead(
                i_p0, b_q, b_qk, one, hk_ptr, hks_ptr, hkz_ptr, sc_ptr, p_valid, stride_validt, stride_hkt,
                stride_hksp, hist_start, limit, p_end, b_run, margin, x_kw, x_ks, x_kz, x_vd, x_s, b_cnt_cold,
                b_cnt_all, D, PAGE, NP, USE_VALID, COUNT, SCORES, FAST, DH,
            )  # fmt: skip
            b_mr, b_lv, b_az, b_wsum, a0, a1, a2, a3, a4, a5, a6, a7, c0, c1, c2, c3, c4, c5, c6, c7, n_vh, n_vl = (
                _vp_values(
                    i_p0, b_s, m_hot, b_mx, b_vh, b_vl, b_vs, b_vz, m_hot1, b_mr, b_lv, b_az, b_wsum, a0, a1, a2, a3,
                    a4, a5, a6, a7, c0, c1, c2, c3, c4, c5, c6, c7, one, hv_ptr, hvl_ptr, stride_hvt, limit, D, PAGE,
                    VGROUP, NP, FAST, DH,
                )
            )  # fmt: skip
            b_s, m_hot, b_mx = b_s1, m_hot1, b_mx1
            b_vh, b_vl, b_vs, b_vz = n_vh, n_vl, n_vs, n_vz
            # step k + 1: scores of k + 2 from buffer y, values of k + 1
            o_t1 = (i_p0 + 2 * NP) * PAGE + o_tt
            o_s2 = o_t1[:, None] * stride_hvst + o_g[None, :]
            n_vs = tl.load(hvs_ptr + o_s2, mask=_cmask((o_t1 < limit)[:, None], m_gs, PAD), other=0.0)
            n_vz = tl.load(hvz_ptr + o_s2, mask=_cmask((o_t1 < limit)[:, None], m_gs, PAD), other=0.0)
            b_s1, m_hot1, b_mx1, b_run, b_cnt_cold, b_cnt_all, y_kw, y_ks, y_kz, y_vd, y_s = _vp_scores_ahead(
                i_p0 + NP, b_q, b_qk, one, hk_ptr, hks_ptr, hkz_ptr, sc_ptr, p_valid, stride_validt, stride_hkt,
                stride_hksp, hist_start, limit, p_end, b_run, margin, y_kw, y_ks, y_kz, y_vd, y_s, b_cnt_cold,
                b_cnt_all, D, PAGE, NP, USE_VALID, COUNT, SCORES, FAST, DH,
            )  # fmt: skip
            b_mr, b_lv, b_az, b_wsum, a0, a1, a2, a3, a4, a5, a6, a7, c0, c1, c2, c3, c4, c5, c6, c7, n_vh, n_vl = (
                _vp_values(
                    i_p0 + NP, b_s, m_hot, b_mx, b_vh, b_vl, b_vs, b_vz, m_hot1, b_mr, b_lv, b_az, b_wsum, a0, a1,
                    a2, a3, a4, a5, a6, a7, c0, c1, c2, c3, c4, c5, c6, c7, one, hv_ptr, hvl_ptr, stride_hvt, limit,
                    D, PAGE, VGROUP, NP, FAST, DH,
                )
            )  # fmt: skip
            b_s, m_hot, b_mx = b_s1, m_hot1, b_mx1
            b_vh, b_vl, b_vs, b_vz = n_vh, n_vl, n_vs, n_vz
    else:
        for i_p0 in range(p_begin, p_end, NP):
            o_pg = i_p0 + NP + o_np  # step k + 1
            o_t2 = o_pg[:, None] * PAGE + o_pt[None, :]
            o_pg2 = o_pg + NP  # step k + 2
            o_t22 = o_pg2[:, None] * PAGE + o_pt[None, :]
            # (1) loads that need no score: step k + 2's key scales, zeros (and padding), step k + 1's value scales,
            # zeros. (The carried values they replace are still live, so ptxas copies the new ones into the carried
            # registers once those die, and the copy waits for the load: issued here, the wait comes after step k + 1's
            # scores (key tiles) or step k's sums (value tiles).)
            if SCORES:
                n_s2 = tl.load(sc_ptr + o_t22, mask=o_t22 < limit, other=float("-inf"))
            else:
                m_pg2 = (o_pg2 < p_end)[:, None]
                n_ks2 = tl.load(
                    hks_ptr + o_pg2[:, None] * stride_hksp + o_d[None, :],
                    mask=_cmask(m_pg2, m_cd, PAD), other=0.0,
                )
                n_kz2 = tl.load(
                    hkz_ptr + o_pg2[:, None] * stride_hksp + o_d[None, :],
                    mask=_cmask(m_pg2, m_cd, PAD), other=0.0,
                )
                if USE_VALID:
                    n_vd2 = tl.load(p_valid + (hist_start + o_t22) * stride_validt, mask=o_t22 < limit, other=0)
            o_t1 = (i_p0 + NP) * PAGE + o_tt
            m_t1 = o_t1 < limit
            o_s2 = o_t1[:, None] * stride_hvst + o_g[None, :]
            n_vs = tl.load(hvs_ptr + o_s2, mask=_cmask(m_t1[:, None], m_gs, PAD), other=0.0)
            n_vz = tl.load(hvz_ptr + o_s2, mask=_cmask(m_t1[:, None], m_gs, PAD), other=0.0)
            # (2) step k + 1's scores (from inputs loaded one iteration ago), running maxima, hot set
            if SCORES:
                b_s1 = n_s
                m_vis1 = b_s1 > float("-inf")
            else:
                m_vis1 = o_t2 < limit
                if USE_VALID:
                    m_vis1 = m_vis1 & (n_vd != 0)
                b_s1 = tl.where(m_vis1, _wscores(n_kw, n_ks, n_kz, b_q, b_qk, one, 4, FAST), float("-inf"))
            m_hot1, b_run, b_mx1 = _vprec_classify(b_s1, m_vis1, b_run, margin)
            if COUNT:
                b_cnt_all += m_vis1.to(tl.int32)
                b_cnt_cold += (m_vis1 & ~m_hot1).to(tl.int32)
            # (3) step k + 2's key words, loaded once step k + 1's are consumed (into the same registers: no copy)
            if SCORES:
                n_s = n_s2
            else:
                o_t3 = o_t22[:, :, None]
                n_kw = tl.load(
                    hk_ptr + o_t3 * stride_hkt + o_w[None, None, :],
                    mask=_cmask(o_t3 < limit, m_wd, PAD), other=0,
                )
                n_ks, n_kz = n_ks2, n_kz2
                if USE_VALID:
                    n_vd = n_vd2
            # (4) step k's 4-bit codes 4 hi + lo (even fields: hi's bits moved up by 2; odd fields: lo's moved down),
            # merged before step k + 1's plane words are loaded (into the same registers, for the same reason):
            # `lo` masked by step k + 1's hot set (0 where cold), in flight until the next iteration's merge
            b_me, b_mo = _value_words(b_vh, b_vl, 4)
            o_v3 = o_t1[:, None, None] * stride_hvt + o_gu
            n_vh = tl.load(hv_ptr + o_v3, mask=_cmask(m_t1[:, None, None], m_gv, PAD), other=0)
            n_vl = tl.load(
                hvl_ptr + o_v3,
                mask=_cmask((m_t1 & tl.reshape(m_hot1, [T]))[:, None, None], m_gv, PAD), other=0,
            )
            # (5) step k's values
            b_mr, b_lv, b_az, b_wsum, a0, a1, a2, a3, a4, a5, a6, a7, c0, c1, c2, c3, c4, c5, c6, c7 = _move_reference(
                b_mr, b_mx, b_lv, b_az, b_wsum, a0, a1, a2, a3, a4, a5, a6, a7, c0, c1, c2, c3, c4, c5, c6, c7
            )
            b_p = tl.exp2(b_s - tl.where(b_mr == float("-inf"), 0.0, b_mr))  # [NP, PAGE], 0 where not read
            b_lv += b_p
            b_pc = tl.reshape(tl.where(m_hot, 0.0, b_p), [T])  # p of cold tokens (0 where not read)
            b_p1 = tl.reshape(b_p, [T])
            b_vsf = b_vs.to(tl.float32)
            b_w = b_p1[:, None] * b_vsf  # [T, NG]: p * scale
            b_az += b_p1[:, None] * b_vz.to(tl.float32) + 1.5 * b_pc[:, None] * b_vsf  # cold: the hi bucket's midpoint
            if FAST:
                b_wsum += b_w
            b_w3 = b_w[:, :, None]
            a0, a1, a2, a3, a4, a5, a6, a7, c0, c1, c2, c3, c4, c5, c6, c7 = _vsums(
                a0, a1, a2, a3, a4, a5, a6, a7, c0, c1, c2, c3, c4, c5, c6, c7, b_me, b_mo, one, b_w3, 4, FAST
            )
            # step k + 1 becomes the current step
            b_s, m_hot, b_mx = b_s1, m_hot1, b_mx1
            b_vh, b_vl, b_vs, b_vz = n_vh, n_vl, n_vs, n_vz
    _wfinish(
        o_ptr, lse_ptr, o_part, b_mr, b_lv, b_az, b_wsum, a0, a1, a2, a3, a4, a5, a6, a7, c0, c1, c2, c3, c4, c5, c6,
        c7, D, 4, FAST,
    )  # fmt: skip
    if COUNT:
        tl.store(stats_ptr + i_prog * 2, tl.sum(tl.sum(b_cnt_cold, axis=1), axis=0))
        tl.store(stats_ptr + i_prog * 2 + 1, tl.sum(tl.sum(b_cnt_all, axis=1), axis=0))


@triton.jit
def _mma_pairs(w, magic, POS: tl.constexpr, NB: tl.constexpr, FAST: tl.constexpr):
    """v8: the NB-bit fields at bits POS and POS + 16 of int32 words `w` as a trailing pair `[..., 2]` (OP dtype).
    FAST: one LOP3 puts both fields into the mantissas of two fp16 `1024` (`0x6400 | field` in each half), so the
    pair is the word's two halves (`1024 + field`; `_mma_deq` takes the 1024 off); else the fields as fp32.
    `magic`: 0x64006400 as a run-time register value, so that the LOP3's one immediate is the field mask (two
    constants would be re-materialised before every LOP3: 41 IMAD.MOV per step)."""
    M2: tl.constexpr = ((1 << NB) - 1) * 0x00010001
    if FAST:
        x = ((w >> POS) & M2) | magic
        return tl.join(x.to(tl.int16), (x >> 16).to(tl.int16)).to(tl.float16, bitcast=True)
    else:
        x = (w >> POS) & M2
        return tl.join(x & 0xFFFF, x >> 16).to(tl.float32)


@triton.jit
def _mma_deq(b_f, b_s, b_z, FAST: tl.constexpr):
    """v8: the dot operand `code * scale + zero` of `_mma_pairs`' fields `b_f`. FAST (16-bit inputs): fp16,
    `(1024 + c) - 1024` (exact) then one fp16 multiply-add with the fp16 scale and zero (the reference in a 16-bit
    dtype rounds every decoded key / value to it the same way); else fp32 (exact codes; IEEE dots)."""
    if FAST:
        return (b_f - 1024.0) * b_s + b_z
    else:
        return b_f * b_s.to(tl.float32) + b_z.to(tl.float32)


@triton.jit
def _mma_vec(p, m, PAD: tl.constexpr):
    """A `[1, K]` row of key scales / zeros or query channels (0 past the head dim when the tile is padded)."""
    if PAD:
        return tl.load(p, mask=m, other=0.0)[None, :]
    else:
        return tl.load(p)[None, :]


@triton.jit
def _mma_keys(b_kw, magic, p_ks, p_kz, o_dim, m_dim, IDX: tl.constexpr, NB: tl.constexpr, PAD: tl.constexpr,
              FAST: tl.constexpr):  # fmt: skip
    """Dot operand `[PAGE, K]` of key dot `I` of a page (`_codes_history_mma`): fields `2I`, `2I + 1` of each half
    of each key word, column `(w, e, h)` (INT4) or `(w, h, e)` (INT2) = channel `o_dim` (`LANES * w + LANES / 2 * h
    + 2I + e`)."""
    T: tl.constexpr = b_kw.shape[0]
    K: tl.constexpr = 4 * b_kw.shape[1]
    b_f = tl.join(_mma_pairs(b_kw, magic, NB * 2 * IDX, NB, FAST), _mma_pairs(b_kw, magic, NB * (2 * IDX + 1), NB, FAST))
    if NB == 4:  # columns (w, e, h): a word's halves adjacent (sm_90 SASS: 5.80 instructions per element, 6.08 without)
        b_f = tl.permute(b_f, (0, 1, 3, 2))
    b_f = tl.reshape(b_f, [T, K])  # INT2: columns (w, h, e) (5.41, 6.15 with the permute)
    return _mma_deq(b_f, _mma_vec(p_ks + o_dim, m_dim, PAD), _mma_vec(p_kz + o_dim, m_dim, PAD), FAST)


@triton.jit
def _mma_values(w_a, w_c, magic, b_vs, b_vz, IDX: tl.constexpr, KV_FMT: tl.constexpr, FAST: tl.constexpr):
    """Dot operand `[PAGE, K]` of value dot `I` of a page: column `(g, u, h, e)` = channel `16 (g VW + u) + 8h + 2I
    + e`; INT4: the 4-bit codes `4 hi + lo` of `_value_words` (`w_a` even channels, `w_c` odd), INT2: the plane."""
    T: tl.constexpr = w_a.shape[0]
    K: tl.constexpr = 4 * w_a.shape[1] * w_a.shape[2]
    if KV_FMT == 4:
        b_f = tl.join(_mma_pairs(w_a, magic, 4 * IDX, 4, FAST), _mma_pairs(w_c, magic, 4 * IDX, 4, FAST))
    else:
        b_f = tl.join(_mma_pairs(w_a, magic, 4 * IDX, 2, FAST), _mma_pairs(w_a, magic, 4 * IDX + 2, 2, FAST))
    return tl.reshape(_mma_deq(b_f, b_vs[:, :, None, None, None], b_vz[:, :, None, None, None], FAST), [T, K])


@triton.jit
def _mma_plane_pairs(w, magic, POS: tl.constexpr, LO: tl.constexpr, FAST: tl.constexpr):
    """v9 (V precision on v8): the 2-bit fields at bits POS and POS + 16 of value plane words `w` as a trailing pair.
    FAST: fp16 in the binade [512, 1024) (mantissa step 0.5; `magic` 0x60036003 for `hi`, 0x60006000 for `lo`), one
    shift + one LOP3 per two fields: `hi` lands at mantissa bits 3-4 over the constant 3, i.e. `512 + 4 hi + 1.5`;
    `lo` at bits 1-2, i.e. `512 + lo`; else the exact fp32 `4 hi + 1.5` / `lo - 1.5`."""
    SH: tl.constexpr = 1 if LO else 3
    if FAST:
        M2: tl.constexpr = (3 << SH) * 0x00010001
        if POS >= SH:
            x = ((w >> (POS - SH)) & M2) | magic
        else:
            x = ((w << (SH - POS)) & M2) | magic
        return tl.join(x.to(tl.int16), (x >> 16).to(tl.int16)).to(tl.float16, bitcast=True)
    else:
        x = (w >> POS) & 0x00030003
        f = tl.join(x & 0xFFFF, x >> 16).to(tl.float32)
        if LO:
            return f - 1.5
        else:
            return f * 4.0 + 1.5


@triton.jit
def _mma_plane_values(w, magic, b_vs, b_vz, IDX: tl.constexpr, LO: tl.constexpr, FAST: tl.constexpr):
    """v9: dot operand `[PAGE, K]` of value dot `I` of a page with V precision, in `_mma_values`' columns `(g, u, h,
    e)` (channel `16 (g VW + u) + 8h + 2I + e`: fields `4I + 2e` of the plane words). `hi` plane (LO False): every
    token read cold, `(4 hi + 1.5) * scale + zero`; `lo` plane: what a hot token adds, `(lo - 1.5) * scale`. One
    rounding of the decoded value in fp16 (the fields and `f - 512`, `f - 513.5` are exact), as the reference's
    `c_hat * scale + zero` rounded to a 16-bit dtype."""
    T: tl.constexpr = w.shape[0]
    K: tl.constexpr = 4 * w.shape[1] * w.shape[2]
    b_f = tl.join(_mma_plane_pairs(w, magic, 4 * IDX, LO, FAST), _mma_plane_pairs(w, magic, 4 * IDX + 2, LO, FAST))
    b_s3 = b_vs[:, :, None, None, None]
    if FAST:
        if LO:
            b_v = (b_f - 513.5) * b_s3
        else:
            b_v = (b_f - 512.0) * b_s3 + b_vz[:, :, None, None, None]
    else:
        if LO:
            b_v = b_f * b_s3.to(tl.float32)
        else:
            b_v = b_f * b_s3.to(tl.float32) + b_vz[:, :, None, None, None].to(tl.float32)
    return tl.reshape(b_v, [T, K])


@triton.jit
def _mma_qlane(p_qrow, o_dim, m_q, OP: tl.constexpr):
    return tl.load(p_qrow + o_dim[None, :], mask=m_q, other=0.0).to(OP)


@triton.jit
def _codes_history_mma(
    p_qrow, b_nh, m_row, o_ptr, lse_ptr, p_valid, stride_validt, hk_ptr, hks_ptr, hkz_ptr, hv_ptr, hvl_ptr, hvs_ptr,
    hvz_ptr, stride_hkt, stride_hksp, stride_hvt, stride_hvst, o_part, hist_start, p_begin, p_end, qk_scale,
    b_run, margin, pmax_ptr, o_pm,
    D: tl.constexpr, DH: tl.constexpr, PAGE: tl.constexpr, VGROUP: tl.constexpr, KV_FMT: tl.constexpr,
    BLOCK_R: tl.constexpr, USE_VALID: tl.constexpr, FAST: tl.constexpr, USE_VPREC: tl.constexpr = False,
    COUNT: tl.constexpr = False, PAGE_MAX_ONLY: tl.constexpr = False, STAGES: tl.constexpr = 1, hmin_ptr=None,
    OPT: tl.constexpr = 0, LO_AHEAD: tl.constexpr = False,
):
    """v8 (session 15, `ROW1_TUNING["mma"]`): history pages `[p_begin, p_end)` of codes for a block of up to
    `BLOCK_R` query rows (decode: 1 row, padded; verification blocks and GQA: `G * Q <= 16`) on tensor cores, the
    codes read as 32-bit words and dequantized in registers. The dot over channels does not care about their order,
    so each dot takes whichever channels a word's fields give in place: key dot `I` (INT4: 2 per page, INT2: 4)
    reads fields `2I`, `2I + 1` of both 16-bit halves of every key word (`S += q_I @ Kdeq_I^T`, the lane query `q_I`
    [BR, K] gathered once before the loop); value dot `I` (4 per page) reads fields `I` of INT4's merged code words
    (even and odd channels, `_value_words`) or fields `2I`, `2I + 1` of INT2's plane (`O_I += P @ Vdeq_I`), with
    a token's group scale / zero broadcast over its group's words. FAST (16-bit inputs): a LOP3 per two fields
    builds two fp16 `1024 + code` at once (`_mma_pairs`), then fp16 `(f - 1024) * scale + zero`; fp16 operands (bf16
    queries are rounded to fp16), fp32 accumulation; else fp32 operands with IEEE dots. The softmax reference of a
    row moves only when a score exceeds it by more than 2**8 (lazy, as `_codes_history_row1w`); `l` stays per
    thread until the end. Pointers to codes are int32 pointers at (b, h_kv), their strides in words.

    v9 (session 16): `STAGES` > 1 software-pipelines the page loop (`tl.range(num_stages=STAGES)`: the next pages'
    code words and scales in flight, through shared memory, while a page computes). V precision (INT4, `USE_VPREC`):
    `b_run` [BR] is each row's running maximum before the split (the sink's maximum and the earlier splits' page
    maxima, log2 units), moved page by page to the page's maximum; a token is hot for a row when its score is at
    least `b_run - margin` (`margin` = tau: tau * ln 2 in natural units). The reference's `p_cold @ v_cold + p_hot @
    v_hot` is computed as `P @ Vcold + P_hot @ Vlo` with `Vcold = (4 hi + 1.5) * scale + zero` from the `hi` plane
    for every token and `Vlo = v_hot - v_cold = (lo - 1.5) * scale`, whose `lo` words are loaded only for tokens
    some row reads hot (skipped, dots included, for a page where no row does). `PAGE_MAX_ONLY`: the first pass of
    a split history, the page maxima of every row stored at `pmax_ptr + o_pm + page` (scores only). `OPT` 1 (V
    precision's optimistic pass, `ops._coded_attention_fwd`): the value pass stores them too, and each row's lowest
    score read hot at `hmin_ptr + o_part`. `LO_AHEAD` (V precision, session 34): a page's `lo` words are loaded
    with its `hi` words, every token's, instead of after the hot set is known (only the hot tokens' then): the dots
    are the same (`P_hot` is zero for cold tokens), the load leaves the chain of dependent loads per page, and the
    cold tokens' `lo` bytes are read too. Returns the V-precision counts `(cold, read)` per row ([BR] int32; zeros
    unless `COUNT`)."""
    LANES: tl.constexpr = 32 // KV_FMT  # key channels per word
    DW: tl.constexpr = D // LANES
    NKD: tl.constexpr = LANES // 4  # key dots per page (each K = 4 DW columns)
    KK: tl.constexpr = 4 * DW
    NG: tl.constexpr = D // VGROUP
    VW: tl.constexpr = VGROUP // 16  # plane words per value group
    KV: tl.constexpr = D // 4  # columns of a value dot
    OP: tl.constexpr = tl.float16 if FAST else tl.float32
    IEEE: tl.constexpr = not FAST
    PAD: tl.constexpr = DH < D
    o_t0 = tl.arange(0, PAGE)
    o_w = tl.arange(0, DW)
    o_m = tl.arange(0, KK)  # key column: INT4 (w, e, h), INT2 (w, h, e)
    if KV_FMT == 4:  # its channel, less 2I (`_mma_keys`' column order)
        o_dk = LANES * (o_m // 4) + (LANES // 2) * (o_m % 2) + (o_m // 2) % 2
    else:
        o_dk = LANES * (o_m // 4) + (LANES // 2) * ((o_m // 2) % 2) + o_m % 2
    o_mv = tl.arange(0, KV)  # value column (g, u, h, e)
    o_dv = 16 * (o_mv // 4) + 8 * ((o_mv // 2) % 2) + o_mv % 2  # its channel, less 2I
    o_g = tl.arange(0, NG)
    o_gw = tl.arange(0, NG * VW)[None, :]  # [1, NG * VW] plane word of a token: group `w // VW`
    m_wd = (o_w < DH // LANES)[None, :]
    m_gd = o_g < DH // VGROUP
    m_gw, m_gs = o_gw // VW < DH // VGROUP, m_gd[None, :]
    m_q = _cmask(m_row[:, None], (o_dk < DH)[None, :], PAD)
    b_q0 = _mma_qlane(p_qrow, o_dk, m_q, OP)  # [BR, KK] the channels of key dot 0
    b_q1 = _mma_qlane(p_qrow, o_dk + 2, m_q, OP)
    if NKD == 4:
        b_q2 = _mma_qlane(p_qrow, o_dk + 4, m_q, OP)
        b_q3 = _mma_qlane(p_qrow, o_dk + 6, m_q, OP)
    m_dk = o_dk < DH
    # 0x64006400 (two fp16 1024) as the bits of an fp32 computed at run time (`_mma_pairs`)
    b_zs = tl.max(tl.zeros([BLOCK_R], dtype=tl.float32) + qk_scale, axis=0) * 0.0  # 0.0, not a constant
    magic = (b_zs + 9.473556003354462e21).to(tl.int32, bitcast=True)
    b_nhr = tl.where(m_row, b_nh, 0)
    limit = tl.minimum(tl.max(b_nhr, axis=0), p_end * PAGE)  # history tokens any row reads
    b_mr = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)  # softmax reference per row (log2 units)
    b_lv = tl.zeros([BLOCK_R, PAGE], dtype=tl.float32)
    b_acc0 = tl.zeros([BLOCK_R, KV], dtype=tl.float32)  # value dot I: channels o_dv + 2I
    b_acc1 = tl.zeros([BLOCK_R, KV], dtype=tl.float32)
    b_acc2 = tl.zeros([BLOCK_R, KV], dtype=tl.float32)
    b_acc3 = tl.zeros([BLOCK_R, KV], dtype=tl.float32)
    b_cnt_cold = tl.zeros([BLOCK_R], dtype=tl.int32)
    b_cnt_all = tl.zeros([BLOCK_R], dtype=tl.int32)
    if OPT == 1:
        b_hmin = tl.full([BLOCK_R], float("inf"), dtype=tl.float32)  # each row's lowest score read hot
    if USE_VPREC:  # 0x60036003 / 0x60006000 (`_mma_plane_pairs`), run-time values as `magic`
        magic_hi = magic - 0x03FD03FD
        magic_lo = magic - 0x04000400
    for i_p in tl.range(p_begin, p_end, num_stages=STAGES):
        o_t = i_p * PAGE + o_t0  # [T] history index
        m_t = o_t < limit
        m_vis = m_row[:, None] & (o_t[None, :] < b_nhr[:, None])  # [BR, T]
        if USE_VALID:
            b_valid = tl.load(p_valid + (hist_start + o_t) * stride_validt, mask=m_t, other=0) != 0
            m_vis = m_vis & b_valid[None, :]
        b_kw = tl.load(hk_ptr + o_t[:, None] * stride_hkt + o_w[None, :], mask=_cmask(m_t[:, None], m_wd, PAD), other=0)
        p_ksp = hks_ptr + i_p * stride_hksp
        p_kzp = hkz_ptr + i_p * stride_hksp
        b_s = _dot(b_q0, tl.trans(_mma_keys(b_kw, magic, p_ksp, p_kzp, o_dk, m_dk, 0, KV_FMT, PAD, FAST)), IEEE)
        b_s += _dot(b_q1, tl.trans(_mma_keys(b_kw, magic, p_ksp + 2, p_kzp + 2, o_dk, m_dk, 1, KV_FMT, PAD, FAST)), IEEE)
        if NKD == 4:
            b_s += _dot(b_q2, tl.trans(_mma_keys(b_kw, magic, p_ksp + 4, p_kzp + 4, o_dk, m_dk, 2, KV_FMT, PAD, FAST)), IEEE)
            b_s += _dot(b_q3, tl.trans(_mma_keys(b_kw, magic, p_ksp + 6, p_kzp + 6, o_dk, m_dk, 3, KV_FMT, PAD, FAST)), IEEE)
        b_s = tl.where(m_vis, b_s * qk_scale, float("-inf"))  # [BR, T] log2 units
        b_mx = tl.max(b_s, axis=1)
        if PAGE_MAX_ONLY:  # V precision's first pass: every row's page maximum
            tl.store(pmax_ptr + o_pm + i_p, b_mx, mask=m_row)
        else:
            if tl.max((b_mx > b_mr + 8.0).to(tl.int32), axis=0) > 0:  # move the references (rare after the first pages)
                b_mn = tl.maximum(b_mr, b_mx)
                b_alpha = tl.exp2(b_mr - tl.where(b_mn == float("-inf"), 0.0, b_mn))[:, None]  # 0 for rows yet unread
                b_lv *= b_alpha
                b_acc0 *= b_alpha
                b_acc1 *= b_alpha
                b_acc2 *= b_alpha
                b_acc3 *= b_alpha
                b_mr = b_mn
            b_pf = tl.exp2(b_s - tl.where(b_mr == float("-inf"), 0.0, b_mr)[:, None])  # 0 where not read
            b_lv += b_pf
            b_p = b_pf.to(OP)
            o_v3 = o_t[:, None] * stride_hvt + o_gw  # [T, NG * VW]: loaded 2-D, split in registers
            m_v3 = _cmask(m_t[:, None], m_gw, PAD)
            b_vh = tl.reshape(tl.load(hv_ptr + o_v3, mask=m_v3, other=0), [PAGE, NG, VW])  # [T, NG, VW] words
            o_s2 = o_t[:, None] * stride_hvst + o_g[None, :]
            b_vs = tl.load(hvs_ptr + o_s2, mask=_cmask(m_t[:, None], m_gs, PAD), other=0.0)  # [T, NG]
            b_vz = tl.load(hvz_ptr + o_s2, mask=_cmask(m_t[:, None], m_gs, PAD), other=0.0)
            if USE_VPREC and LO_AHEAD:  # every token's `lo` words, in flight with the `hi` ones
                b_vla = tl.reshape(tl.load(hvl_ptr + o_v3, mask=m_v3, other=0), [PAGE, NG, VW])
            if USE_VPREC:
                # the running maximum of each row at this page (the reference's prefix maximum seeded by the sink)
                b_run = tl.maximum(b_run, b_mx)
                m_hot = m_vis & (b_s >= b_run[:, None] - margin)  # [BR, T]
                if COUNT:
                    b_cnt_all += tl.sum(m_vis.to(tl.int32), axis=1)
                    b_cnt_cold += tl.sum((m_vis & ~m_hot).to(tl.int32), axis=1)
                if OPT == 1:
                    tl.store(pmax_ptr + o_pm + i_p, b_mx, mask=m_row)
                    b_hmin = tl.minimum(b_hmin, tl.min(tl.where(m_hot, b_s, float("inf")), axis=1))
                b_acc0 += _dot(b_p, _mma_plane_values(b_vh, magic_hi, b_vs, b_vz, 0, False, FAST), IEEE)
                b_acc1 += _dot(b_p, _mma_plane_values(b_vh, magic_hi, b_vs, b_vz, 1, False, FAST), IEEE)
                b_acc2 += _dot(b_p, _mma_plane_values(b_vh, magic_hi, b_vs, b_vz, 2, False, FAST), IEEE)
                b_acc3 += _dot(b_p, _mma_plane_values(b_vh, magic_hi, b_vs, b_vz, 3, False, FAST), IEEE)
                m_lo = m_t & (tl.max(m_hot.to(tl.int32), axis=0) > 0)  # [T] tokens some row reads hot
                if tl.max(m_lo.to(tl.int32), axis=0) > 0:  # a page every row reads cold loads no `lo`
                    if LO_AHEAD:
                        b_vl = b_vla
                    else:
                        b_vl = tl.reshape(tl.load(hvl_ptr + o_v3, mask=_cmask(m_lo[:, None], m_gw, PAD), other=0),
                                          [PAGE, NG, VW])
                    b_ph = tl.where(m_hot, b_pf, 0.0).to(OP)
                    b_acc0 += _dot(b_ph, _mma_plane_values(b_vl, magic_lo, b_vs, b_vz, 0, True, FAST), IEEE)
                    b_acc1 += _dot(b_ph, _mma_plane_values(b_vl, magic_lo, b_vs, b_vz, 1, True, FAST), IEEE)
                    b_acc2 += _dot(b_ph, _mma_plane_values(b_vl, magic_lo, b_vs, b_vz, 2, True, FAST), IEEE)
                    b_acc3 += _dot(b_ph, _mma_plane_values(b_vl, magic_lo, b_vs, b_vz, 3, True, FAST), IEEE)
            else:
                if KV_FMT == 4:
                    b_vl = tl.reshape(tl.load(hvl_ptr + o_v3, mask=m_v3, other=0), [PAGE, NG, VW])
                else:
                    b_vl = b_vh
                w_a, w_c = _value_words(b_vh, b_vl, KV_FMT)
                b_acc0 += _dot(b_p, _mma_values(w_a, w_c, magic, b_vs, b_vz, 0, KV_FMT, FAST), IEEE)
                b_acc1 += _dot(b_p, _mma_values(w_a, w_c, magic, b_vs, b_vz, 1, KV_FMT, FAST), IEEE)
                b_acc2 += _dot(b_p, _mma_values(w_a, w_c, magic, b_vs, b_vz, 2, KV_FMT, FAST), IEEE)
                b_acc3 += _dot(b_p, _mma_values(w_a, w_c, magic, b_vs, b_vz, 3, KV_FMT, FAST), IEEE)
    if not PAGE_MAX_ONLY:
        b_l = tl.sum(b_lv, axis=1)
        _store_partial(o_ptr, lse_ptr, o_part, b_mr, b_l, b_acc0, o_dv, m_row, D)
        _store_partial(o_ptr, lse_ptr, o_part, b_mr, b_l, b_acc1, o_dv + 2, m_row, D)
        _store_partial(o_ptr, lse_ptr, o_part, b_mr, b_l, b_acc2, o_dv + 4, m_row, D)
        _store_partial(o_ptr, lse_ptr, o_part, b_mr, b_l, b_acc3, o_dv + 6, m_row, D)
        if OPT == 1:
            tl.store(hmin_ptr + o_part, b_hmin, mask=m_row)
    return b_cnt_cold, b_cnt_all


@triton.jit
def _dmask(m, o_d, DH: tl.constexpr, D: tl.constexpr):
    """A load mask `m` (`[N, 1]`) with the head-dim mask when the tile is padded (`DH < D`: a head dim that is no
    power of two, e.g. Huginn-0125's 96, read in tiles of 128); `m` itself otherwise (no per-column mask, which
    would cost the loads their vector width)."""
    if DH < D:
        return m & (o_d < DH)[None, :]
    else:
        return m


@triton.jit
def _prior_weight(x_lse, b_mx):
    """A `prior` part merged into parts whose maximum lse is `b_mx` (log2; the view's own parts always read the new
    token, so it is finite): the new maximum and the prior's weight `exp2(lse - max)`, from its natural-log `x_lse`
    (0 for a prior that read nothing, lse -inf, whatever its out holds: callers add `where(w > 0, w * out, 0)`)."""
    x2 = x_lse.to(tl.float32) / _LN2
    mx = tl.maximum(b_mx, x2)
    return mx, tl.exp2(x2 - mx)


@triton.jit
def _prefix_max(b_run, p_pm, m_row, p_seen, BLOCK_PM: tl.constexpr, CG: tl.constexpr):
    """The running maximum `b_run` [BR] moved over the page maxima `[0, p_seen)` of the earlier splits (`p_pm`
    [BR, 1] row pointers). `CG`: loads that bypass L1, for maxima written by other programs of the same launch
    (`LOOKBACK`: an L1 line may hold bytes read before they were written)."""
    for pm0 in range(0, p_seen, BLOCK_PM):
        o_p = pm0 + tl.arange(0, BLOCK_PM)
        m_p = m_row[:, None] & (o_p < p_seen)[None, :]
        if CG:
            b_pm = tl.load(p_pm + o_p[None, :], mask=m_p, other=float("-inf"), cache_modifier=".cg")
        else:
            b_pm = tl.load(p_pm + o_p[None, :], mask=m_p, other=float("-inf"))
        b_run = tl.maximum(b_run, tl.max(b_pm, axis=1))
    return b_run


@triton.jit
def _row1_query(p_q1, o_d, qk_scale, D: tl.constexpr, DH: tl.constexpr):
    """One query row in fp32, scaled; zero past `DH` (a head dim that is no power of two)."""
    if DH < D:
        return tl.load(p_q1, mask=o_d < DH, other=0.0).to(tl.float32) * qk_scale
    else:
        return tl.load(p_q1).to(tl.float32) * qk_scale


@triton.jit
def _publish(p_flag):
    """`LOOKBACK`: this split's page maxima are written: every thread's stores before the flag (release)."""
    tl.debug_barrier()
    tl.atomic_xchg(p_flag, 1, sem="release", scope="gpu")


@triton.jit
def _await_splits(p_flag, n, BLOCK: tl.constexpr = 64):
    """`LOOKBACK`: wait until the `n` earlier splits of this row block have published their page maxima (acquire
    reads of up to `BLOCK` flags at once, one round trip per poll); they started before this program (tickets), so
    they are resident and never wait on it."""
    for j0 in range(0, n, BLOCK):
        o_j = j0 + tl.arange(0, BLOCK)
        m_j = o_j < n
        zero = tl.zeros([BLOCK], dtype=tl.int32)
        f = tl.atomic_add(p_flag + o_j, zero, mask=m_j, sem="acquire", scope="gpu")
        # the count still unpublished, carried as a scalar: a condition that reduces the polled tensor itself fails
        # Triton 3.6's layout pass (TritonGPURemoveLayoutConversions; 3.9 compiles both)
        busy = tl.sum((m_j & (f == 0)).to(tl.int32), axis=0)
        while busy != 0:
            f = tl.atomic_add(p_flag + o_j, zero, mask=m_j, sem="acquire", scope="gpu")
            busy = tl.sum((m_j & (f == 0)).to(tl.int32), axis=0)
    tl.debug_barrier()


@triton.jit
def _live_pages(b_bound, hist_start, m_row, PAGE: tl.constexpr):
    """History pages any row of the block reads (its rows' bounds, less the history's start, in whole pages)."""
    return (tl.maximum(tl.max(tl.where(m_row, b_bound - hist_start, 0), axis=0), 0) + PAGE - 1) // PAGE


@triton.jit
def _attend_dense(
    b_q,
    b_m,
    b_l,
    b_acc,
    k_ptr,
    v_ptr,
    stride_kt,
    stride_vt,
    length,
    t_lo,
    t_hi,
    pos0,
    b_lo,
    b_hi,
    b_own,
    m_row,
    p_valid,
    stride_validt,
    qk_scale,
    D: tl.constexpr,
    BLOCK_T: tl.constexpr,
    USE_VALID: tl.constexpr,
    IEEE: tl.constexpr,
    MAX_ONLY: tl.constexpr,
    RING: tl.constexpr = False,
    DH: tl.constexpr = None,
):
    """Online softmax over slots `[t_lo, min(t_hi, length))` of a dense segment of `length` positions `pos0 ..`; row
    r sees `b_lo[r] <= pos < b_hi[r]` (and, with padding, valid positions or its own). `MAX_ONLY`: only the running
    max `b_m` (V-precision seed). `RING`: the segment is a ring of `length` slots holding the positions below `pos0`
    (position `p` in slot `p mod length`), read from the oldest position a row of the block sees, `first =
    max(min_r b_lo[r], pos0 - length, 0)`: `t_lo, t_hi` count positions from `first` (a program past
    `pos0 - first` reads nothing). A self-speculative batch's ring is sized for holes after every real token (up to
    `R + 1` storage positions each, `coded_ring_capacity`), several times the positions a row reads in practice;
    slots older than every row's boundary are never loaded."""
    o_d = tl.arange(0, D)
    if RING:
        first = tl.maximum(tl.min(tl.where(m_row, b_lo, pos0), axis=0), tl.maximum(pos0 - length, 0))
        t_lo = first + t_lo
        t_end = tl.minimum(first + t_hi, pos0)
    else:
        t_end = tl.minimum(t_hi, length)
    for t0 in range(t_lo, t_end, BLOCK_T):
        o_t = t0 + tl.arange(0, BLOCK_T)
        m_t = o_t < t_end
        if RING:
            o_pos = o_t
            o_t = o_pos % length
        else:
            o_pos = pos0 + o_t
        b_k = tl.load(k_ptr + o_t[:, None] * stride_kt + o_d[None, :], mask=_dmask(m_t[:, None], o_d, DH, D), other=0.0)
        b_s = _dot(b_q, tl.trans(b_k.to(b_q.dtype)), IEEE) * qk_scale  # [BR, BT]
        m_vis = m_t[None, :] & m_row[:, None] & (o_pos[None, :] >= b_lo[:, None]) & (o_pos[None, :] < b_hi[:, None])
        if USE_VALID:
            b_valid = tl.load(p_valid + o_pos * stride_validt, mask=m_t, other=0) != 0
            m_vis = m_vis & (b_valid[None, :] | (o_pos[None, :] == b_own[:, None]))
        b_s = tl.where(m_vis, b_s, float("-inf"))
        if MAX_ONLY:
            b_m = tl.maximum(b_m, tl.max(b_s, axis=1))
        else:
            b_m, b_l, b_acc, b_p = _online_update(b_s, b_m, b_l, b_acc)
            b_v = tl.load(v_ptr + o_t[:, None] * stride_vt + o_d[None, :], mask=_dmask(m_t[:, None], o_d, DH, D), other=0.0)
            b_acc += _dot(b_p.to(b_q.dtype), b_v.to(b_q.dtype), IEEE)
    return b_m, b_l, b_acc


@triton.jit(
    do_not_specialize=[
        "S", "W", "w_start", "n_start", "n_pages", "pages_per_split", "NS", "Q", "tail_chunk", "tail_min", "tail_programs"
    ]
)
def _coded_attention_fwd_kernel(
    q_ptr,
    o_ptr,
    lse_ptr,
    pmax_ptr,
    sc_ptr,  # v5 (SCORES): every history token's score [B * H_kv, n_pages * PAGE] fp32, from the page-maxima pass
    bound_ptr,
    valid_ptr,
    len_ptr,  # DEV_LEN: the cached length, read on the device (else `n_start`)
    # sink [B, H_kv, S, D], window [B, H_kv, W, D] (positions w_start ..), new [B, H_kv, Q, D] (positions n_start ..)
    sk_ptr,
    sv_ptr,
    wk_ptr,
    wv_ptr,
    nk_ptr,
    nv_ptr,
    # history: codes (k codes / scale / zero, v hi / lo / scale / zero) or dense k / v in hk_ptr / hv_ptr
    hk_ptr,
    hks_ptr,
    hkz_ptr,
    hv_ptr,
    hvl_ptr,
    hvs_ptr,
    hvz_ptr,
    stats_ptr,
    stride_qb,
    stride_qh,
    stride_qq,
    stride_bb,
    stride_bq,
    stride_validb,
    stride_validt,
    stride_skb,
    stride_skh,
    stride_skt,
    stride_svb,
    stride_svh,
    stride_svt,
    stride_wkb,
    stride_wkh,
    stride_wkt,
    stride_wvb,
    stride_wvh,
    stride_wvt,
    stride_nkb,
    stride_nkh,
    stride_nkt,
    stride_nvb,
    stride_nvh,
    stride_nvt,
    stride_hkb,
    stride_hkh,
    stride_hkt,
    stride_hksb,
    stride_hksh,
    stride_hksp,
    stride_hvb,
    stride_hvh,
    stride_hvt,
    stride_hvsb,
    stride_hvsh,
    stride_hvst,
    H_KV,
    G,
    Q,
    S,
    W,
    w_start,
    n_start,
    hist_start,
    n_pages,
    pages_per_split,
    NS,
    tail_chunk,  # window slots per tail program (programs NS .. NS + NT - 1; TAIL_DEV: sized here)
    tail_min,  # TAIL_DEV: the fewest window slots a tail program reads
    tail_programs,  # DEV_LEN: the tail programs (NT); program j reads ring chunks j, j + NT, ...
    qk_scale,
    margin,
    D: tl.constexpr,
    DH: tl.constexpr,
    PAGE: tl.constexpr,
    VGROUP: tl.constexpr,
    KV_FMT: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_PM: tl.constexpr,
    USE_VALID: tl.constexpr,
    USE_VPREC: tl.constexpr,
    COUNT: tl.constexpr,
    READ_PREFIX: tl.constexpr,
    PAGE_MAX_ONLY: tl.constexpr,
    IEEE: tl.constexpr,
    ROW1: tl.constexpr = False,
    NP: tl.constexpr = 4,
    WORDS: tl.constexpr = False,
    DEV_LEN: tl.constexpr = False,
    TAIL_DEV: tl.constexpr = False,
    VPIPE: tl.constexpr = False,
    SCORES: tl.constexpr = False,
    VUNROLL: tl.constexpr = False,
    SUB: tl.constexpr = 1,
    SUB_STAGES: tl.constexpr = 0,
    ROWX: tl.constexpr = False,
    MMA: tl.constexpr = False,
    MMA_STAGES: tl.constexpr = 1,
    USE_PDL: tl.constexpr = False,
    px_o_ptr=None,  # FINAL with PRIOR: the prior's out [B, H_q, Q, D] and natural-log lse [B, H_q, Q]
    px_lse_ptr=None,
    stride_xob=0,
    stride_xoh=0,
    stride_xoq=0,
    stride_xlb=0,
    stride_xlh=0,
    stride_xlq=0,
    PRIOR: tl.constexpr = False,
    FINAL: tl.constexpr = False,
    lb_ptr=None,  # LOOKBACK: int32 [1 + NS * B * H_kv * row blocks], zeroed: the ticket, then a flag per split
    LOOKBACK: tl.constexpr = False,
    hmin_ptr=None,  # OPT: fp32 [NS, B * H_kv, G * Q], each history partial's lowest score read hot (log2 units)
    OPT: tl.constexpr = 0,
    LO_AHEAD: tl.constexpr = False,  # v9 with V precision: `lo` words loaded with `hi` (`_codes_history_mma`)
):
    if USE_PDL:  # programmatic dependent launch: wait for the previous kernel before anything else
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    # FINAL (no history split, NS = 0, and one tail program reading the whole window): that program's part is the
    # op's only one, so it merges the prior (if any) itself and writes `out` (o_ptr, [B, H_q, Q, DH] contiguous, the
    # query's dtype) and the natural-log `lse` (lse_ptr, [B, H_q, Q]); no merge launch follows
    # DEV_LEN (a static cache's captured step): the length is read here, the sink buffer holds `S` slots of which
    # `min(S, length)` are read, the window is a ring of `W` slots, and `n_pages` counts every preallocated page
    i_s, i_bh, i_r = tl.program_id(0), tl.program_id(1).to(tl.int64), tl.program_id(2)
    if LOOKBACK:
        # V precision in one launch (`tuning["vprec_lookback"]`): a program takes its (split, row, row block) from a
        # ticket drawn as it starts, so the earlier splits a split waits for (`_await_splits`) are already running
        tk = tl.atomic_add(lb_ptr, 1, sem="relaxed", scope="gpu")
        n0, n1 = tl.num_programs(0), tl.num_programs(1)
        i_s, i_bh, i_r = tk % n0, ((tk // n0) % n1).to(tl.int64), tk // (n0 * n1)
    if ROWX:
        # v7 (verification blocks): `NS * G * Q` history programs, one per (split, row), run the one-row word path
        # on their own query row (row `i_x` of the only row block); then the tail programs. `i_s` becomes the
        # partial's slot: the split of a history program, `NS + j` for tail program j
        R_X = G * Q
        if i_s < NS * R_X:
            i_x = i_s % R_X
            i_s = i_s // R_X
        else:
            i_x = 0
            i_s = i_s - NS * R_X + NS
    if DEV_LEN:
        n_start = tl.load(len_ptr).to(tl.int32)
    i_b, i_hk = i_bh // H_KV, i_bh % H_KV
    R = G * Q
    o_r = i_r * BLOCK_R + tl.arange(0, BLOCK_R)  # row = g * Q + i
    m_row = o_r < R
    o_g, o_i = o_r // Q, o_r % Q
    o_d = tl.arange(0, D)
    p_q = q_ptr + i_b * stride_qb + (i_hk * G + o_g)[:, None] * stride_qh + o_i[:, None] * stride_qq + o_d[None, :]
    b_q = tl.load(p_q, mask=_dmask(m_row[:, None], o_d, DH, D), other=0.0)  # [BR, D] (zero past DH)
    b_bound = tl.load(bound_ptr + i_b * stride_bb + o_i * stride_bq, mask=m_row, other=0).to(tl.int32)  # history positions < bound, window positions >= bound
    b_own = n_start + o_i
    p_valid = valid_ptr + i_b * stride_validb
    b_m = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
    b_l = tl.zeros([BLOCK_R], dtype=tl.float32)
    b_acc = tl.zeros([BLOCK_R, D], dtype=tl.float32)
    b_zero = tl.zeros([BLOCK_R], dtype=tl.int32)
    if i_s >= NS:
        # the dense tail, over programs NS .. NS + NT - 1: program NS + j reads window slots
        # [j * tail_chunk, (j + 1) * tail_chunk) (positions >= bound), and j = 0 also the sink (padding only) and the
        # new tokens (causal); a window longer than a history split is spread so that it does not set the pace
        j = i_s - NS
        chunk = tail_chunk
        if FINAL and PRIOR:  # loaded before the reads below, so that their latency overlaps them (nothing they need)
            p_x = i_b * stride_xlb + (i_hk * G + o_g) * stride_xlh + o_i * stride_xlq
            x_lse = tl.load(px_lse_ptr + p_x, mask=m_row, other=float("-inf"))
            p_xo = i_b * stride_xob + (i_hk * G + o_g)[:, None] * stride_xoh + o_i[:, None] * stride_xoq
            x_o = tl.load(px_o_ptr + p_xo + o_d[None, :], mask=_dmask(m_row[:, None], o_d, DH, D), other=0.0)
        if TAIL_DEV:
            # a static cache's captured step: the launcher's rule for host lengths (half a split's positions, at
            # least `tail_min`), applied to the pages the splits share out now; programs past the ring read nothing
            pps_l = tl.maximum((_live_pages(b_bound, hist_start, m_row, PAGE) + NS - 1) // tl.maximum(NS, 1), 1)
            chunk = tl.maximum(tail_min, (pps_l * PAGE + 2 * BLOCK_T - 1) // (2 * BLOCK_T) * BLOCK_T)
        w_lo = j * chunk
        if j == 0:
            b_m, b_l, b_acc = _attend_dense(
                b_q, b_m, b_l, b_acc, sk_ptr + i_b * stride_skb + i_hk * stride_skh,
                sv_ptr + i_b * stride_svb + i_hk * stride_svh, stride_skt, stride_svt, S, 0, S, 0, b_zero,
                b_zero + tl.minimum(S, n_start), b_own, m_row, p_valid, stride_validt, qk_scale, D, BLOCK_T,
                USE_VALID, IEEE, False,
             DH=DH,)  # fmt: skip
        if DEV_LEN:
            # a ring: chunks count positions from the oldest one a row reads (`_attend_dense`); the launcher plans
            # the tail programs for the view's `window_reach`, so they stride over a longer stretch (holes)
            for c0 in range(w_lo, W, tail_programs * chunk):
                b_m, b_l, b_acc = _attend_dense(
                    b_q, b_m, b_l, b_acc, wk_ptr + i_b * stride_wkb + i_hk * stride_wkh,
                    wv_ptr + i_b * stride_wvb + i_hk * stride_wvh, stride_wkt, stride_wvt, W, c0, c0 + chunk,
                    n_start, b_bound, b_zero + n_start, b_own, m_row, p_valid, stride_validt, qk_scale, D, BLOCK_T,
                    USE_VALID, IEEE, False, True,
                 DH=DH,)  # fmt: skip
        else:
            b_m, b_l, b_acc = _attend_dense(
                b_q, b_m, b_l, b_acc, wk_ptr + i_b * stride_wkb + i_hk * stride_wkh,
                wv_ptr + i_b * stride_wvb + i_hk * stride_wvh, stride_wkt, stride_wvt, W, w_lo, w_lo + chunk,
                w_start, b_bound, b_zero + w_start + W, b_own, m_row, p_valid, stride_validt, qk_scale, D, BLOCK_T,
                USE_VALID, IEEE, False,
             DH=DH,)  # fmt: skip
        if j == 0:
            b_m, b_l, b_acc = _attend_dense(
                b_q, b_m, b_l, b_acc, nk_ptr + i_b * stride_nkb + i_hk * stride_nkh,
                nv_ptr + i_b * stride_nvb + i_hk * stride_nvh, stride_nkt, stride_nvt, Q, 0, Q, n_start,
                b_zero + n_start, b_own + 1, b_own, m_row, p_valid, stride_validt, qk_scale, D, BLOCK_T, USE_VALID,
                IEEE, False,
             DH=DH,)  # fmt: skip
        if FINAL:
            b_tot = tl.where(b_l > 0, b_l, 1.0)
            b_mx = tl.where(b_l > 0, b_m + tl.log2(b_tot), float("-inf"))  # log2 lse (rows past R: -inf, not stored)
            b_acc = b_acc / b_tot[:, None]
            if PRIOR:
                b_mx, x_w = _prior_weight(x_lse, b_mx)
                b_w = tl.exp2(b_m + tl.log2(b_tot) - b_mx)  # the view's own part (reads the new token: finite)
                b_acc = b_w[:, None] * b_acc + tl.where(x_w[:, None] > 0, x_w[:, None] * x_o.to(tl.float32), 0.0)
                b_tot = b_w + x_w
                b_acc = b_acc / tl.where(b_tot > 0, b_tot, 1.0)[:, None]
                b_mx = b_mx + tl.log2(b_tot)
            o_row = i_bh * (G * Q) + o_r  # = (b * H_q + h_q) * Q + i: out and lse are contiguous
            tl.store(o_ptr + o_row[:, None] * DH + o_d[None, :], b_acc.to(o_ptr.dtype.element_ty),
                     mask=m_row[:, None] & (o_d < DH)[None, :])  # fmt: skip
            tl.store(lse_ptr + o_row, b_mx * _LN2, mask=m_row)
        else:
            _store_partial(
                o_ptr, lse_ptr, (i_s * tl.num_programs(1) + i_bh) * (G * Q) + o_r, b_m, b_l, b_acc, o_d, m_row, D
            )
    else:
        b_nh = b_bound - hist_start  # history tokens row r reads
        # pages any row of the block reads: a program past them exits at once (its partial reads nothing)
        n_live = _live_pages(b_bound, hist_start, m_row, PAGE)
        pps = pages_per_split
        if DEV_LEN:
            # a static cache's captured step: the host split every preallocated page, of which the first `n_live`
            # hold history now; those are shared out among the NS splits instead (a first pass, V precision's page
            # maxima or scores, writes every live page before the second reads them, however either splits)
            pps = tl.maximum((n_live + NS - 1) // NS, 1)
        p_begin = i_s * pps
        p_end = tl.minimum(tl.minimum(p_begin + pps, n_pages), n_live)
        if COUNT:
            b_cnt_cold = tl.zeros([BLOCK_R], dtype=tl.int32)
            b_cnt_all = tl.zeros([BLOCK_R], dtype=tl.int32)
        if USE_VPREC and not PAGE_MAX_ONLY:
            # running max seed: the sink maximum, then the page maxima of the earlier splits
            b_run, b_unused, b_acc = _attend_dense(
                b_q, b_m, b_l, b_acc, sk_ptr + i_b * stride_skb + i_hk * stride_skh,
                sv_ptr + i_b * stride_svb + i_hk * stride_svh, stride_skt, stride_svt, S, 0, S, 0, b_zero,
                b_zero + tl.minimum(S, n_start), b_own, m_row, p_valid, stride_validt, qk_scale, D, BLOCK_T, USE_VALID,
                IEEE, True,
             DH=DH,)  # fmt: skip
            p_pm = pmax_ptr + (i_bh * (G * Q) + o_r)[:, None] * n_pages
            p_seen = tl.minimum(p_begin, n_live)  # page maxima written by the earlier splits
            if READ_PREFIX and not LOOKBACK:  # the first launch wrote them
                b_run = _prefix_max(b_run, p_pm, m_row, p_seen, BLOCK_PM, False)
        if LOOKBACK:  # the first pass's page maxima in this launch: splits but the last write theirs, then wait
            p_flag = lb_ptr + 1 + (i_r * tl.num_programs(1) + i_bh) * NS
        o_t0 = tl.arange(0, PAGE)
        o_part = (i_s * tl.num_programs(1) + i_bh) * (G * Q) + o_r
        # V precision's optimistic pass (`ops.ROW1_TUNING["vprec_optimistic"]`): OPT 1 runs the value pass seeded
        # with the sink's maximum alone and stores its page maxima and lowest hot score; OPT 2 then reruns a split
        # only where the earlier splits' maxima turn one of its hot tokens cold (else its partial stands)
        OPT_PASS: tl.constexpr = OPT == 1
        if OPT == 2:
            b_hm = tl.load(hmin_ptr + o_part, mask=m_row, other=float("inf"))
            run = tl.max((b_hm < b_run - margin).to(tl.int32), axis=0) > 0
        else:
            run = True
        # (b, h_kv)'s history: code words as int32 pointers (their strides in words), scales and zeros
        i32p: tl.constexpr = tl.pointer_type(tl.int32)
        p_hkw = (hk_ptr + i_b * stride_hkb + i_hk * stride_hkh).to(i32p)
        p_hvw = (hv_ptr + i_b * stride_hvb + i_hk * stride_hvh).to(i32p)
        p_hvlw = (hvl_ptr + i_b * stride_hvb + i_hk * stride_hvh).to(i32p)
        p_hks = hks_ptr + i_b * stride_hksb + i_hk * stride_hksh
        p_hkz = hkz_ptr + i_b * stride_hksb + i_hk * stride_hksh
        p_hvs = hvs_ptr + i_b * stride_hvsb + i_hk * stride_hvsh
        p_hvz = hvz_ptr + i_b * stride_hvsb + i_hk * stride_hvsh
        if ROW1:
            # one query row per KV head (decode, no GQA): the elementwise path, NP pages per step
            if ROWX:  # v7: this program's row i_x = g * Q + i, its own history bound and pages
                p_q1 = q_ptr + i_b * stride_qb + (i_hk * G + i_x // Q) * stride_qh + (i_x % Q) * stride_qq + o_d
                nh1 = tl.sum(tl.where(o_r == i_x, b_nh, 0), axis=0)
                p_end = tl.minimum(tl.minimum(p_begin + pps, n_pages), (tl.maximum(nh1, 0) + PAGE - 1) // PAGE)
                part1 = (i_s * tl.num_programs(1) + i_bh) * (G * Q) + i_x
            else:
                p_q1 = q_ptr + i_b * stride_qb + (i_hk * G) * stride_qh + o_d
            b_q1 = _row1_query(p_q1, o_d, qk_scale, D, DH)
            if LOOKBACK:  # v4's or v5's loop (not v7's: the launcher keeps two launches for it)
                if SCORES or i_s < NS - 1:  # v5's score pass: the last split's value pass reads its own scores too
                    _codes_history_row1w(
                        b_q1, 0.0, q_ptr + i_b * stride_qb + (i_hk * G) * stride_qh, qk_scale, o_ptr, lse_ptr,
                        pmax_ptr, p_valid, stride_validt, p_hkw, p_hks, p_hkz, p_hvw, p_hvlw, p_hvs, p_hvz,
                        stats_ptr, stride_hkt // 4, stride_hksp, stride_hvt // 4, stride_hvst, i_bh, 0, 0,
                        tl.sum(tl.where(o_r == 0, b_nh, 0), axis=0), hist_start, p_begin, p_end, n_pages, margin,
                        sc_ptr + i_bh * (n_pages * PAGE), D, PAGE, VGROUP, KV_FMT, NP, USE_VALID, USE_VPREC, False, True,
                        not IEEE, SCORES, DH,
                    )  # fmt: skip
                    _publish(p_flag + i_s)
                _await_splits(p_flag, i_s)
                b_run = _prefix_max(b_run, p_pm, m_row, p_seen, BLOCK_PM, True)
                # the value pass's own copy of the query, loaded after the handshake's atomics so that it is not
                # merged with the first pass's: Triton 3.6 reuses a layout conversion of the query made inside the
                # first pass's branch and loop, and fails ("operand does not dominate this use"; 3.9 compiles both)
                b_q1 = _row1_query(p_q1, o_d, qk_scale, D, DH)
            if USE_VPREC and not PAGE_MAX_ONLY:
                b_run1 = tl.max(tl.where(o_r == (i_x if ROWX else 0), b_run, float("-inf")), axis=0)
            else:
                b_run1 = 0.0
            p_sc = sc_ptr + i_bh * (n_pages * PAGE)  # the row's scores (v5; rows = 1)
            if WORDS and VPIPE and USE_VPREC and not PAGE_MAX_ONLY:  # v5: V precision with lo loaded a step ahead
                _codes_history_row1p(
                    b_q1, b_run1, o_ptr, lse_ptr, p_valid, stride_validt,
                    p_hkw, p_hks, p_hkz, p_hvw, p_hvlw, p_hvs, p_hvz,
                    p_sc, stats_ptr, stride_hkt // 4, stride_hksp, stride_hvt // 4, stride_hvst,
                    (i_s * tl.num_programs(1) + i_bh) * (G * Q), (i_s * tl.num_programs(1) + i_bh) * tl.num_programs(2),
                    tl.sum(tl.where(o_r == 0, b_nh, 0), axis=0), hist_start, p_begin, p_end, margin,
                    D, PAGE, VGROUP, NP, USE_VALID, COUNT, SCORES, not IEEE, VUNROLL, DH,
                )  # fmt: skip
            elif WORDS and (SUB > 1 or SUB_STAGES > 0) and not USE_VPREC:  # v6: steps of PAGE // SUB tokens
                _codes_history_row1s(
                    b_q1, o_ptr, lse_ptr, p_valid, stride_validt, p_hkw, p_hks, p_hkz, p_hvw, p_hvlw, p_hvs, p_hvz,
                    stride_hkt // 4, stride_hksp, stride_hvt // 4, stride_hvst,
                    part1 if ROWX else (i_s * tl.num_programs(1) + i_bh) * (G * Q),
                    nh1 if ROWX else tl.sum(tl.where(o_r == 0, b_nh, 0), axis=0),
                    hist_start, p_begin, p_end, D, PAGE, VGROUP, KV_FMT, PAGE // SUB, USE_VALID, not IEEE, SUB_STAGES,
                )  # fmt: skip
            elif WORDS:  # codes as 32-bit words (byte offsets of (b, h_kv) first; strides in words)
                if run:  # OPT 2: only a split whose hot set the earlier splits change
                    _codes_history_row1w(
                        b_q1, b_run1, q_ptr + i_b * stride_qb + (i_hk * G) * stride_qh, qk_scale, o_ptr, lse_ptr,
                        pmax_ptr, p_valid, stride_validt, p_hkw, p_hks, p_hkz, p_hvw, p_hvlw, p_hvs, p_hvz,
                        stats_ptr, stride_hkt // 4, stride_hksp, stride_hvt // 4, stride_hvst,
                        i_bh * (G * Q) + i_x if ROWX else i_bh,  # the row of the page maxima
                        part1 if ROWX else (i_s * tl.num_programs(1) + i_bh) * (G * Q),
                        part1 if ROWX else (i_s * tl.num_programs(1) + i_bh) * tl.num_programs(2),  # V-precision counts' slot
                        nh1 if ROWX else tl.sum(tl.where(o_r == 0, b_nh, 0), axis=0),
                        hist_start, p_begin, p_end, n_pages, margin, p_sc,
                        D, PAGE, VGROUP, KV_FMT, NP, USE_VALID, USE_VPREC, COUNT, PAGE_MAX_ONLY, not IEEE, SCORES, DH,
                        hmin_ptr, OPT_PASS,
                    )  # fmt: skip
            else:
                _codes_history_row1(
                    b_q1, b_run1, q_ptr + i_b * stride_qb + (i_hk * G) * stride_qh, o_ptr, lse_ptr, pmax_ptr, p_valid,
                    stride_validt, hk_ptr + i_b * stride_hkb + i_hk * stride_hkh,
                    p_hks, p_hkz,
                    hv_ptr + i_b * stride_hvb + i_hk * stride_hvh, hvl_ptr + i_b * stride_hvb + i_hk * stride_hvh,
                    p_hvs, p_hvz,
                    stats_ptr, stride_hkt, stride_hksp, stride_hvt, stride_hvst, i_bh,
                    (i_s * tl.num_programs(1) + i_bh) * (G * Q), (i_s * tl.num_programs(1) + i_bh) * tl.num_programs(2),
                    tl.sum(tl.where(o_r == 0, b_nh, 0), axis=0), hist_start, p_begin, p_end, n_pages, qk_scale, margin,
                    D, PAGE, VGROUP, KV_FMT, NP, USE_VALID, USE_VPREC, COUNT, PAGE_MAX_ONLY, not IEEE, DH,
                )  # fmt: skip
        elif MMA:  # v8: up to 16 rows on tensor cores, codes read as words and dequantized in registers
            if LOOKBACK:
                if i_s < NS - 1:
                    _codes_history_mma(
                        q_ptr + i_b * stride_qb + (i_hk * G + o_g)[:, None] * stride_qh + o_i[:, None] * stride_qq, b_nh,
                        m_row, o_ptr, lse_ptr, p_valid, stride_validt,
                        p_hkw, p_hks, p_hkz, p_hvw, p_hvlw, p_hvs, p_hvz,
                        stride_hkt // 4, stride_hksp, stride_hvt // 4, stride_hvst, o_part, hist_start, p_begin, p_end,
                        qk_scale, b_m, margin, pmax_ptr, (i_bh * (G * Q) + o_r) * n_pages,
                        D, DH, PAGE, VGROUP, KV_FMT, BLOCK_R, USE_VALID, not IEEE, USE_VPREC, False, True, MMA_STAGES,
                    )  # fmt: skip
                    _publish(p_flag + i_s)
                _await_splits(p_flag, i_s)
                b_run = _prefix_max(b_run, p_pm, m_row, p_seen, BLOCK_PM, True)
            if USE_VPREC and not PAGE_MAX_ONLY:
                b_runm = b_run
            else:
                b_runm = b_m
            if run:
                b_cnt_mc, b_cnt_ma = _codes_history_mma(
                    q_ptr + i_b * stride_qb + (i_hk * G + o_g)[:, None] * stride_qh + o_i[:, None] * stride_qq, b_nh,
                    m_row, o_ptr, lse_ptr, p_valid, stride_validt, p_hkw, p_hks, p_hkz, p_hvw, p_hvlw, p_hvs, p_hvz,
                    stride_hkt // 4, stride_hksp, stride_hvt // 4, stride_hvst, o_part, hist_start, p_begin, p_end,
                    qk_scale, b_runm, margin, pmax_ptr, (i_bh * (G * Q) + o_r) * n_pages,
                    D, DH, PAGE, VGROUP, KV_FMT, BLOCK_R, USE_VALID, not IEEE, USE_VPREC, COUNT, PAGE_MAX_ONLY, MMA_STAGES,
                    hmin_ptr, OPT_PASS, LO_AHEAD,
                )  # fmt: skip
                if COUNT:
                    b_cnt_cold, b_cnt_all = b_cnt_mc, b_cnt_ma
        elif KV_FMT == 0:
            p_k = hk_ptr + i_b * stride_hkb + i_hk * stride_hkh + o_d[None, :]
            p_v = hv_ptr + i_b * stride_hvb + i_hk * stride_hvh + o_d[None, :]
            for i_p in range(p_begin, p_end):
                o_t = i_p * PAGE + o_t0  # history index of the tile's tokens
                m_vis = m_row[:, None] & (o_t[None, :] < b_nh[:, None])  # [BR, P]
                m_t = tl.max(m_vis.to(tl.int32), axis=0) > 0  # tokens any row reads
                if USE_VALID:
                    b_valid = tl.load(p_valid + (hist_start + o_t) * stride_validt, mask=m_t, other=0) != 0
                    m_vis = m_vis & b_valid[None, :]
                b_k = tl.load(p_k + o_t[:, None] * stride_hkt, mask=_dmask(m_t[:, None], o_d, DH, D), other=0.0)
                b_s = tl.where(m_vis, _dot(b_q, tl.trans(b_k.to(b_q.dtype)), IEEE) * qk_scale, float("-inf"))
                b_m, b_l, b_acc, b_p = _online_update(b_s, b_m, b_l, b_acc)
                b_v = tl.load(p_v + o_t[:, None] * stride_hvt, mask=_dmask(m_t[:, None], o_d, DH, D), other=0.0)
                b_acc += _dot(b_p.to(b_q.dtype), b_v.to(b_q.dtype), IEEE)
            _store_partial(o_ptr, lse_ptr, o_part, b_m, b_l, b_acc, o_d, m_row, D)
        else:
            # codes are read as packed bytes: bit lane j of key byte c holds channel PER_BYTE * c + j and of value
            # byte c channel 4 * c + j, so the scores sum one product per key lane and the output keeps one
            # accumulator per value lane (nothing is interleaved in registers)
            PER_BYTE: tl.constexpr = 8 // KV_FMT
            QMAX: tl.constexpr = 2**KV_FMT - 1
            DK: tl.constexpr = D // PER_BYTE
            DV: tl.constexpr = D // 4
            o_ck = tl.arange(0, DK)
            o_cv = tl.arange(0, DV)
            PAD: tl.constexpr = DH < D  # head dim DH < D: key bytes, channels and value bytes past DH load 0
            m_kb, m_vb = (o_ck < DH // PER_BYTE)[None, :], (o_cv < DH // 4)[None, :]
            p_qrow = q_ptr + i_b * stride_qb + (i_hk * G + o_g)[:, None] * stride_qh + o_i[:, None] * stride_qq
            b_q0 = tl.load(
                p_qrow + (o_ck * PER_BYTE)[None, :],
                mask=_cmask(m_row[:, None], m_kb, PAD), other=0.0,
            )  # [BR, DK]
            b_q1 = tl.load(p_qrow + (o_ck * PER_BYTE + 1)[None, :], mask=_cmask(m_row[:, None], m_kb, PAD), other=0.0)
            if PER_BYTE == 4:
                b_q2 = tl.load(
                    p_qrow + (o_ck * PER_BYTE + 2)[None, :],
                    mask=_cmask(m_row[:, None], m_kb, PAD), other=0.0,
                )
                b_q3 = tl.load(
                    p_qrow + (o_ck * PER_BYTE + 3)[None, :],
                    mask=_cmask(m_row[:, None], m_kb, PAD), other=0.0,
                )
            p_k = hk_ptr + i_b * stride_hkb + i_hk * stride_hkh + o_ck[None, :]
            p_ks = hks_ptr + i_b * stride_hksb + i_hk * stride_hksh + o_ck * PER_BYTE
            p_kz = hkz_ptr + i_b * stride_hksb + i_hk * stride_hksh + o_ck * PER_BYTE
            p_v = hv_ptr + i_b * stride_hvb + i_hk * stride_hvh + o_cv[None, :]
            p_vl = hvl_ptr + i_b * stride_hvb + i_hk * stride_hvh + o_cv[None, :]
            o_vg = ((o_cv * 4) // VGROUP)[None, :]  # value group of channels 4c .. 4c + 3 (VGROUP % 4 == 0)
            p_vs = hvs_ptr + i_b * stride_hvsb + i_hk * stride_hvsh + o_vg
            p_vz = hvz_ptr + i_b * stride_hvsb + i_hk * stride_hvsh + o_vg
            b_acc0 = tl.zeros([BLOCK_R, DV], dtype=tl.float32)
            b_acc1 = tl.zeros([BLOCK_R, DV], dtype=tl.float32)
            b_acc2 = tl.zeros([BLOCK_R, DV], dtype=tl.float32)
            b_acc3 = tl.zeros([BLOCK_R, DV], dtype=tl.float32)
            for i_p in range(p_begin, p_end):
                o_t = i_p * PAGE + o_t0  # history index of the page's tokens
                m_vis = m_row[:, None] & (o_t[None, :] < b_nh[:, None])  # [BR, P]
                m_t = tl.max(m_vis.to(tl.int32), axis=0) > 0  # tokens any row reads
                if USE_VALID:
                    b_valid = tl.load(p_valid + (hist_start + o_t) * stride_validt, mask=m_t, other=0) != 0
                    m_vis = m_vis & b_valid[None, :]
                b_pk = tl.load(
                    p_k + o_t[:, None] * stride_hkt,
                    mask=_cmask(m_t[:, None], m_kb, PAD), other=0,
                )  # [P, DK] uint8
                p_ksp = p_ks + i_p * stride_hksp
                p_kzp = p_kz + i_p * stride_hksp
                b_s = tl.zeros([BLOCK_R, PAGE], dtype=tl.float32)
                m_c = o_ck < DH // PER_BYTE  # the key bytes inside the head dim (PAD)
                b_s = _codes_scores(b_s, b_q0, b_pk, p_ksp, p_kzp, m_c, 0, QMAX, IEEE, PAD)
                b_s = _codes_scores(b_s, b_q1, b_pk, p_ksp + 1, p_kzp + 1, m_c, KV_FMT, QMAX, IEEE, PAD)
                if PER_BYTE == 4:
                    b_s = _codes_scores(b_s, b_q2, b_pk, p_ksp + 2, p_kzp + 2, m_c, 4, QMAX, IEEE, PAD)
                    b_s = _codes_scores(b_s, b_q3, b_pk, p_ksp + 3, p_kzp + 3, m_c, 6, QMAX, IEEE, PAD)
                b_s = tl.where(m_vis, b_s * qk_scale, float("-inf"))  # [BR, P]
                if PAGE_MAX_ONLY:
                    tl.store(pmax_ptr + (i_bh * (G * Q) + o_r) * n_pages + i_p, tl.max(b_s, axis=1), mask=m_row)
                else:
                    b_mn = tl.maximum(b_m, tl.max(b_s, axis=1))
                    b_ms = tl.where(b_mn == float("-inf"), 0.0, b_mn)  # rows that see nothing yet stay at p = 0
                    b_alpha = tl.exp2(b_m - b_ms)
                    b_p = tl.exp2(b_s - b_ms[:, None])
                    b_l = b_l * b_alpha + tl.sum(b_p, axis=1)
                    b_m = b_mn
                    b_acc0 = b_acc0 * b_alpha[:, None]
                    b_acc1 = b_acc1 * b_alpha[:, None]
                    b_acc2 = b_acc2 * b_alpha[:, None]
                    b_acc3 = b_acc3 * b_alpha[:, None]
                    o_vt = o_t[:, None]
                    b_hi = tl.load(
                        p_v + o_vt * stride_hvt,
                        mask=_cmask(m_t[:, None], m_vb, PAD), other=0,
                    )  # [P, DV] uint8
                    b_vs = tl.load(
                        p_vs + o_vt * stride_hvst,
                        mask=_cmask(m_t[:, None], m_vb, PAD), other=0.0,
                    ).to(tl.float32)
                    b_vz = tl.load(
                        p_vz + o_vt * stride_hvst,
                        mask=_cmask(m_t[:, None], m_vb, PAD), other=0.0,
                    ).to(tl.float32)
                    if KV_FMT == 4:
                        if USE_VPREC:
                            # cold rows read the hi plane's bucket midpoint; hot rows add (lo - 1.5) * scale
                            b_run = tl.maximum(b_run, tl.max(b_s, axis=1))
                            m_hot = m_vis & (b_s >= b_run[:, None] - margin)
                            m_lo = tl.max(m_hot.to(tl.int32), axis=0) > 0  # tokens some row reads hot
                            if COUNT:
                                b_cnt_all += tl.sum(m_vis.to(tl.int32), axis=1)
                                b_cnt_cold += tl.sum((m_vis & ~m_hot).to(tl.int32), axis=1)
                        else:
                            m_hot = m_vis
                            m_lo = m_t
                        b_lo = tl.load(p_vl + o_vt * stride_hvt, mask=_cmask(m_lo[:, None], m_vb, PAD), other=0)
                    else:
                        m_hot = m_vis
                        b_lo = b_hi
                    b_p16 = b_p.to(b_q.dtype)
                    b_ph16 = tl.where(m_hot, b_p, 0.0).to(b_q.dtype)
                    b_acc0 = _codes_values(b_acc0, b_p16, b_ph16, b_hi, b_lo, b_vs, b_vz, 0, KV_FMT, USE_VPREC, IEEE)
                    b_acc1 = _codes_values(b_acc1, b_p16, b_ph16, b_hi, b_lo, b_vs, b_vz, 2, KV_FMT, USE_VPREC, IEEE)
                    b_acc2 = _codes_values(b_acc2, b_p16, b_ph16, b_hi, b_lo, b_vs, b_vz, 4, KV_FMT, USE_VPREC, IEEE)
                    b_acc3 = _codes_values(b_acc3, b_p16, b_ph16, b_hi, b_lo, b_vs, b_vz, 6, KV_FMT, USE_VPREC, IEEE)
            if not PAGE_MAX_ONLY:
                _store_partial(o_ptr, lse_ptr, o_part, b_m, b_l, b_acc0, o_cv * 4, m_row, D)
                _store_partial(o_ptr, lse_ptr, o_part, b_m, b_l, b_acc1, o_cv * 4 + 1, m_row, D)
                _store_partial(o_ptr, lse_ptr, o_part, b_m, b_l, b_acc2, o_cv * 4 + 2, m_row, D)
                _store_partial(o_ptr, lse_ptr, o_part, b_m, b_l, b_acc3, o_cv * 4 + 3, m_row, D)
        if COUNT and not PAGE_MAX_ONLY and not ROW1:  # noqa: SIM102 (compile-time, then a run-time branch)
            if run:  # OPT 2: a split not rerun keeps the optimistic pass's counts
                i_prog = (i_s * tl.num_programs(1) + i_bh) * tl.num_programs(2) + i_r
                tl.store(stats_ptr + i_prog * 2, tl.sum(b_cnt_cold, axis=0))
                tl.store(stats_ptr + i_prog * 2 + 1, tl.sum(b_cnt_all, axis=0))


@triton.jit(do_not_specialize=["NS", "Q"])
def _coded_attention_merge_kernel(
    o_part_ptr,
    lse_part_ptr,
    out_ptr,
    lse_ptr,
    stride_ob,
    stride_oh,
    stride_oq,
    stride_lb,
    stride_lh,
    H_KV,
    G,
    Q,
    NS,
    n_bh_rows,
    D: tl.constexpr,
    DH: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
    USE_PDL: tl.constexpr = False,
    px_o_ptr=None,
    px_lse_ptr=None,
    stride_xob=0,
    stride_xoh=0,
    stride_xoq=0,
    stride_xlb=0,
    stride_xlh=0,
    stride_xlq=0,
    PRIOR: tl.constexpr = False,
):
    if USE_PDL:  # programmatic dependent launch: wait for the previous kernel before anything else
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    # one program per (b, h_kv, row) and BLOCK_D channels: out = sum_s exp(lse_s - lse) o_s, lse = logsumexp_s lse_s
    # (NS + 1 parts; with BLOCK_S >= NS + 1 each loop is one load, so the merge waits on two loads, not 2 (NS + 1) / 16)
    i_row = tl.program_id(0).to(tl.int64)
    i_dc = tl.program_id(1)
    R = G * Q
    i_bh, o_r = i_row // R, i_row % R
    i_b, i_hk = i_bh // H_KV, i_bh % H_KV
    i_hq, i_q = i_hk * G + o_r // Q, o_r % Q
    o_d = i_dc * BLOCK_D + tl.arange(0, BLOCK_D)
    b_max = tl.full([BLOCK_S], float("-inf"), dtype=tl.float32)
    for s0 in range(0, NS + 1, BLOCK_S):
        o_s = s0 + tl.arange(0, BLOCK_S)
        b_lse = tl.load(lse_part_ptr + o_s * n_bh_rows + i_row, mask=o_s < NS + 1, other=float("-inf"))
        b_max = tl.maximum(b_max, b_lse)
    b_mx = tl.max(b_max, axis=0)
    b_sum = tl.zeros([BLOCK_S], dtype=tl.float32)
    b_acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    if PRIOR:  # one more part computed elsewhere (`prior`: out and natural-log lse of keys the view does not hold)
        b_mx, x_w = _prior_weight(tl.load(px_lse_ptr + i_b * stride_xlb + i_hq * stride_xlh + i_q * stride_xlq), b_mx)
        x_o = tl.load(px_o_ptr + i_b * stride_xob + i_hq * stride_xoh + i_q * stride_xoq + o_d, mask=o_d < DH, other=0.0)
        b_acc += tl.where(x_w > 0, x_w * x_o.to(tl.float32), 0.0)
        b_sum += tl.where(tl.arange(0, BLOCK_S) == 0, x_w, 0.0)
    for s0 in range(0, NS + 1, BLOCK_S):
        o_s = s0 + tl.arange(0, BLOCK_S)
        m_s = o_s < NS + 1
        b_w = tl.exp2(tl.load(lse_part_ptr + o_s * n_bh_rows + i_row, mask=m_s, other=float("-inf")) - b_mx)
        b_sum += b_w
        b_o = tl.load(o_part_ptr + (o_s * n_bh_rows + i_row)[:, None] * D + o_d[None, :], mask=m_s[:, None], other=0.0)
        b_acc += tl.sum(b_w[:, None] * b_o, axis=0)
    b_total = tl.sum(b_sum, axis=0)
    p_out = out_ptr + i_b * stride_ob + i_hq * stride_oh + i_q * stride_oq + o_d
    tl.store(p_out, (b_acc / b_total).to(out_ptr.dtype.element_ty), mask=o_d < DH)  # partials padded to D columns
    if i_dc == 0:
        tl.store(lse_ptr + i_b * stride_lb + i_hq * stride_lh + i_q, (b_mx + tl.log2(b_total)) * _LN2)
