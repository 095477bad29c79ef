"""`@triton.jit` kernels of the fused layer ops (launchers in `ops.py`). Each reproduces `reference.py`'s roundings.

`USE_PDL` (programmatic dependent launch, `triton_ops._dispatch.PDL`): a program waits for the previous kernel
(`gdc_wait`) before it reads or writes anything, then lets the next kernel launch."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, before_ptr, after_ptr, out_ptr, w2_ptr, out2_ptr, N, eps, eps2,
                     HAS_BEFORE: tl.constexpr, HAS_AFTER: tl.constexpr, HAS_NEXT: tl.constexpr, BLOCK: tl.constexpr,
                     USE_PDL: tl.constexpr):
    """One program per row: `out = after + w * norm(x + before)`; with `HAS_NEXT` also `out2 = w2 * norm(out)` (the
    next norm of the same row, read from registers: a layer's residual norm and the norm after it in one launch).

    At a decode step's few rows the kernel is latency: every load (the norm weights too) is issued before the first
    reduction, so no memory round trip waits behind a reduction (H200, Ouro-1.4B's step at batch 1: 6.70 -> 6.55
    ms against loading each operand where it is first used)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    keep = cols < N
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    w = tl.load(w_ptr + cols, mask=keep, other=0.0)
    if HAS_NEXT:
        w2 = tl.load(w2_ptr + cols, mask=keep, other=0.0)
    x = tl.load(x_ptr + row * N + cols, mask=keep, other=0.0)
    if HAS_BEFORE:
        b = tl.load(before_ptr + row * N + cols, mask=keep, other=0.0)
    if HAS_AFTER:
        res = tl.load(after_ptr + row * N + cols, mask=keep, other=0.0)
    if HAS_BEFORE:  # the sum rounds to the activations' dtype before the norm reads it
        x = (x.to(tl.float32) + b.to(tl.float32)).to(x.dtype)
    x32 = x.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(x32 * x32, axis=0) / N + eps)
    normed = (x32 * inv).to(x.dtype)
    out = (w.to(tl.float32) * normed.to(tl.float32)).to(x.dtype)
    if HAS_AFTER:
        out = (res.to(tl.float32) + out.to(tl.float32)).to(x.dtype)
    tl.store(out_ptr + row * N + cols, out, mask=keep)
    if HAS_NEXT:  # masked columns of `out` are 0 (w and res load 0 there), so the sum is the row's
        y32 = out.to(tl.float32)
        inv2 = 1.0 / tl.sqrt(tl.sum(y32 * y32, axis=0) / N + eps2)
        out2 = (w2.to(tl.float32) * (y32 * inv2).to(x.dtype).to(tl.float32)).to(x.dtype)
        tl.store(out2_ptr + row * N + cols, out2, mask=keep)


@triton.jit
def _rotate_kernel(x_ptr, cos_ptr, sin_ptr, bias_ptr, out_ptr, Q, H, stride_xb, stride_xq, stride_xh, stride_cs,
                   D: tl.constexpr, PAIRS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_H: tl.constexpr,
                   USE_PDL: tl.constexpr):
    """One program per (token, block of heads): `x` `[B, Q, H, D]` (last axis contiguous), `out` contiguous,
    `cos`/`sin` one row per token (rotate-half: `D` values in `x`'s dtype; pairs: `D/2` values in fp32), `bias`
    `[H, D]` added first (rounded to `x`'s dtype)."""
    tok = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, D)
    keep = (heads < H)[:, None]
    src = (tok // Q) * stride_xb + (tok % Q) * stride_xq + heads[:, None] * stride_xh
    dst = tok * H * D + heads[:, None] * D
    if PAIRS:  # (re, im) = (x[2i], x[2i+1]) rotated in fp32, rounded once
        partner_d = d ^ 1
    else:
        partner_d = (d + D // 2) % D
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    x = tl.load(x_ptr + src + d[None, :], mask=keep, other=0.0)
    partner = tl.load(x_ptr + src + partner_d[None, :], mask=keep, other=0.0)
    if HAS_BIAS:
        x = (x.to(tl.float32) + tl.load(bias_ptr + heads[:, None] * D + d[None, :], mask=keep, other=0.0).to(
            tl.float32)).to(x.dtype)
        partner = (partner.to(tl.float32) + tl.load(bias_ptr + heads[:, None] * D + partner_d[None, :], mask=keep,
                                                    other=0.0).to(tl.float32)).to(x.dtype)
    if PAIRS:
        c = tl.load(cos_ptr + tok * stride_cs + d // 2)[None, :]
        s = tl.load(sin_ptr + tok * stride_cs + d // 2)[None, :]
        sign = tl.where(d % 2 == 0, -1.0, 1.0)[None, :]
        out = x.to(tl.float32) * c + sign * (partner.to(tl.float32) * s)
        tl.store(out_ptr + dst + d[None, :], out.to(x.dtype), mask=keep)
    else:  # x * cos + rotate_half(x) * sin, each product and the sum rounded to x's dtype
        partner = tl.where((d < D // 2)[None, :], -partner, partner)
        c = tl.load(cos_ptr + tok * stride_cs + d)[None, :]
        s = tl.load(sin_ptr + tok * stride_cs + d)[None, :]
        a = (x.to(tl.float32) * c.to(tl.float32)).to(x.dtype)
        b = (partner.to(tl.float32) * s.to(tl.float32)).to(x.dtype)
        tl.store(out_ptr + dst + d[None, :], (a.to(tl.float32) + b.to(tl.float32)).to(x.dtype), mask=keep)


@triton.jit
def _silu_mul_kernel(g_ptr, u_ptr, out_ptr, N, stride_g, stride_u, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    """`out[row] = silu(gate[row]) * up[row]`, rows of `N` values at any row strides; `out` contiguous."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    keep = offs < N
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    g = tl.load(g_ptr + row * stride_g + offs, mask=keep, other=0.0)
    u = tl.load(u_ptr + row * stride_u + offs, mask=keep, other=0.0)
    g32 = g.to(tl.float32)
    act = (g32 / (1.0 + tl.exp(-g32))).to(g.dtype)
    tl.store(out_ptr + row * N + offs, (act.to(tl.float32) * u.to(tl.float32)).to(g.dtype), mask=keep)


@triton.jit
def _write_kv_kernel(key_ptr, value_ptr, pos_ptr, k_ptr, v_ptr, sk_ptr, sv_ptr, H, MODULO, RING_FROM, CLAMP,
                     stride_kb, stride_kh, stride_kq, stride_vb, stride_vh, stride_vq, stride_sb, stride_sh, stride_sn,
                     stride_tb, stride_th, stride_tn,
                     D: tl.constexpr, BLOCK_D: tl.constexpr, HAS_MODULO: tl.constexpr, HAS_SINK: tl.constexpr,
                     USE_PDL: tl.constexpr):
    """One program per (row and head, new position): `key` / `value` `[B, H, Q, D]` (any strides, last axis
    contiguous) into the storage `k` / `v` `[B, H, N, D]` (the same strides) at slot `pos % MODULO` (positions from
    `RING_FROM` on), and with `HAS_SINK` also into `sk` / `sv` at slot `min(pos, CLAMP)`, cast to the storage's dtype:
    every write of a cell's step in one launch."""
    i_bh = tl.program_id(0).to(tl.int64)
    i_q = tl.program_id(1).to(tl.int64)
    i_b, i_h = i_bh // H, i_bh % H
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < D
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    pos = tl.load(pos_ptr + i_q).to(tl.int64)
    b_k = tl.load(key_ptr + i_b * stride_kb + i_h * stride_kh + i_q * stride_kq + o_d, mask=m_d)  # [BLOCK_D]
    b_v = tl.load(value_ptr + i_b * stride_vb + i_h * stride_vh + i_q * stride_vq + o_d, mask=m_d)
    if i_q >= RING_FROM:  # (a ring of N slots keeps the last N positions)
        slot = pos % MODULO if HAS_MODULO else pos
        o_s = i_b * stride_sb + i_h * stride_sh + slot * stride_sn + o_d
        tl.store(k_ptr + o_s, b_k.to(k_ptr.dtype.element_ty), mask=m_d)
        tl.store(v_ptr + o_s, b_v.to(v_ptr.dtype.element_ty), mask=m_d)
    if HAS_SINK:
        o_t = i_b * stride_tb + i_h * stride_th + tl.minimum(pos, CLAMP) * stride_tn + o_d
        tl.store(sk_ptr + o_t, b_k.to(sk_ptr.dtype.element_ty), mask=m_d)
        tl.store(sv_ptr + o_t, b_v.to(sv_ptr.dtype.element_ty), mask=m_d)
