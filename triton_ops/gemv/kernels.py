"""Triton kernels of `gemv` (`@triton.jit` only; launcher, tuning and dispatch in `ops.py`, the math in README.md).

`y [M, N] = x [M, K] @ W [N, K]^T` for a few rows (decode steps): the grid is `(cdiv(N, BLOCK_N), SPLIT)`; program
`(i_n, i_s)` reads the `BLOCK_N` rows of `W` over the `i_s`-th range of `K` once and every row of `x` with it. With
one split it writes the output (plus bias, in `x`'s dtype); with several it writes fp32 partial sums into a workspace
`[SPLIT, M, N]` that `_gemv_reduce_kernel` adds in split order (deterministic: no atomics).

`USE_PDL` (programmatic dependent launch, `triton_ops._dispatch.PDL`): every program waits for the previous kernel
(`gdc_wait`) before it reads `x` or writes, then lets the next kernel launch; with `PRELOAD` (the FMA path) it loads its
first weight tile before the wait (weights are no kernel's output), and each next tile one iteration ahead.

`GATED` (a gated MLP's down projection): each row of `x` is `[gate | up]`, `2K` values, and the kernel reads
`silu(gate) * up` (rounded as `triton_ops.fused.silu_mul` rounds it) as its input: no separate activation kernel.

`ROPE` (a stacked q/k/v projection, `linear_rope`): each program computes channel pairs `(c, c + D/2)` of one head
and applies rotate-half RoPE to the query and key features before its store: no separate rotation kernel. With `KV`
it also stores the key and value features of its row into a static cache cell's storage at the step's position (read
from the device): no separate cache-write kernel.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _x_tile(p, m, K, GATED: tl.constexpr):
    """The input tile at pointers `p` (masked by `m`, 0 outside): `x`, or with `GATED` `silu(gate) * up` of the gate at
    `p` and the up projection `K` values further (fp32 math, the activation and the product each rounded to the
    input dtype, as `_silu_mul_kernel`)."""
    if GATED:
        b_g = tl.load(p, mask=m, other=0.0)
        b_u = tl.load(p + K, mask=m, other=0.0)
        b_g32 = b_g.to(tl.float32)
        b_a = (b_g32 / (1.0 + tl.exp(-b_g32))).to(b_g.dtype)
        return (b_a.to(tl.float32) * b_u.to(tl.float32)).to(b_g.dtype)
    else:
        return tl.load(p, mask=m, other=0.0)


@triton.jit(do_not_specialize=["M"])  # one compile for every row count of a block
def _gemv_fwd_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, M, N, K, K_SPLIT, stride_xm, stride_wn, stride_om, stride_os,
                     cos_ptr, sin_ptr, stride_cs, ROT,
                     k_ptr, v_ptr, pos_ptr, KV_START, stride_kb, stride_kh, stride_kt,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_DOT: tl.constexpr,
                     IEEE: tl.constexpr, PARTIAL: tl.constexpr, HAS_BIAS: tl.constexpr, PRELOAD: tl.constexpr,
                     GATED: tl.constexpr, ROPE: tl.constexpr, HALF: tl.constexpr, KV: tl.constexpr,
                     USE_PDL: tl.constexpr):
    """`x` `[M, K]` (GATED: `[M, 2K]`) and `W` `[N, K]` (last axes contiguous); `out` `[M, N]` at row stride
    `stride_om` (PARTIAL: fp32 `[SPLIT, M, N]`, split stride `stride_os`). `K_SPLIT` is a multiple of `BLOCK_K`.

    `ROPE` (one split; heads of `2 * HALF` features, `HALF` a multiple of `BLOCK_N / 2`): program `i_n` computes the
    channels `c .. c + BLOCK_N / 2` and their partners `HALF` further of one head, and rotates the output features
    below `ROT` (rotate-half RoPE, `cos` / `sin` one row of `2 * HALF` values per row of `x` at stride `stride_cs`)
    with `triton_ops.fused`'s `_rotate_kernel` roundings after rounding the projection to the output dtype.

    `KV` (with `ROPE`): the features `[KV_START, ROT)` (keys, rotated) and `[ROT, N)` (values) of row `m` are also
    stored at `k` / `v` `[m, head, pos, d]` (strides `stride_kb`, `stride_kh`, `stride_kt`, `d` contiguous; heads of
    `2 * HALF` features), `pos` the integer at `pos_ptr`: what `triton_ops.fused.write_kv` writes for a one-token
    step."""
    i_n = tl.program_id(0).to(tl.int64)
    i_s = tl.program_id(1).to(tl.int64)
    o_m = tl.arange(0, BLOCK_M)
    if ROPE:  # a block of channel pairs (c, c + HALF) of one head
        pairs: tl.constexpr = BLOCK_N // 2
        o_b = tl.arange(0, BLOCK_N)
        chunks: tl.constexpr = HALF // pairs
        o_d = (i_n % chunks) * pairs + o_b % pairs + (o_b // pairs) * HALF  # channel within the head
        o_n = (i_n // chunks) * (2 * HALF) + o_d
    else:
        o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    o_k = tl.arange(0, BLOCK_K)
    m_m = o_m < M
    m_n = o_n < N
    k_start = i_s * K_SPLIT
    k_end = tl.minimum(k_start + K_SPLIT, K)
    p_x = x_ptr + o_m[:, None] * stride_xm
    if USE_DOT:  # tensor cores, rows padded to 16: x [BM, BK] @ W^T [BK, BN]
        if USE_PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        p_w = w_ptr + o_n[None, :] * stride_wn
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k in range(k_start, k_end, BLOCK_K):
            m_k = (k + o_k) < K  # (splits end on BLOCK_K multiples: only K cuts a tile)
            b_x = _x_tile(p_x + (k + o_k)[None, :], m_m[:, None] & m_k[None, :], K, GATED)  # [BM, BK]
            b_w = tl.load(p_w + (k + o_k)[:, None], mask=m_k[:, None] & m_n[None, :], other=0.0)  # [BK, BN]
            if IEEE:
                acc = tl.dot(b_x, b_w, acc, input_precision="ieee")
            else:
                acc = tl.dot(b_x, b_w, acc)
        b_y = acc
    elif PRELOAD:  # FMA, each weight tile loaded one iteration ahead: the first before the wait for `x`
        p_w = w_ptr + o_n[:, None] * stride_wn
        acc3 = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], dtype=tl.float32)
        b_w = tl.load(p_w + (k_start + o_k)[None, :], mask=m_n[:, None] & ((k_start + o_k) < k_end)[None, :],
                      other=0.0)  # [BN, BK]
        if USE_PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        for k in range(k_start, k_end, BLOCK_K):
            m_k = (k + o_k) < k_end
            b_x = _x_tile(p_x + (k + o_k)[None, :], m_m[:, None] & m_k[None, :], K, GATED)  # [BM, BK]
            acc3 += b_x.to(tl.float32)[:, None, :] * b_w.to(tl.float32)[None, :, :]
            m_next = (k + BLOCK_K + o_k) < k_end  # (all false after the last tile: no bytes read)
            b_w = tl.load(p_w + (k + BLOCK_K + o_k)[None, :], mask=m_n[:, None] & m_next[None, :], other=0.0)
        b_y = tl.sum(acc3, axis=2)  # [BM, BN]
    else:  # FMA: products kept per K lane in fp32, reduced across lanes once at the end
        if USE_PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        p_w = w_ptr + o_n[:, None] * stride_wn
        acc3 = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], dtype=tl.float32)
        for k in range(k_start, k_end, BLOCK_K):
            m_k = (k + o_k) < K  # (splits end on BLOCK_K multiples: only K cuts a tile)
            b_x = _x_tile(p_x + (k + o_k)[None, :], m_m[:, None] & m_k[None, :], K, GATED)  # [BM, BK]
            b_w = tl.load(p_w + (k + o_k)[None, :], mask=m_n[:, None] & m_k[None, :], other=0.0)  # [BN, BK]
            acc3 += b_x.to(tl.float32)[:, None, :] * b_w.to(tl.float32)[None, :, :]
        b_y = tl.sum(acc3, axis=2)  # [BM, BN]
    m_y = m_m[:, None] & m_n[None, :]
    o_y = o_m[:, None] * stride_om + o_n[None, :]
    if PARTIAL:
        tl.store(out_ptr + i_s * stride_os + o_y, b_y, mask=m_y)
    else:
        if HAS_BIAS:
            b_y += tl.load(bias_ptr + o_n, mask=m_n, other=0.0).to(tl.float32)[None, :]
        b_o = b_y.to(out_ptr.dtype.element_ty)
        if ROPE:  # x * cos + rotate_half(x) * sin on the rounded output, each product and the sum rounded
            pairs2: tl.constexpr = BLOCK_N // 2
            b_c, b_p = tl.split(tl.permute(tl.reshape(b_o, [BLOCK_M, 2, pairs2]), [0, 2, 1]))  # channel, partner
            b_r = tl.reshape(tl.permute(tl.join(-b_p, b_c), [0, 2, 1]), [BLOCK_M, BLOCK_N])  # rotate_half(x)
            m_r = (o_n < ROT)[None, :]
            p_cs = o_m[:, None] * stride_cs + o_d[None, :]
            b_cos = tl.load(cos_ptr + p_cs, mask=m_m[:, None] & m_r, other=0.0).to(tl.float32)
            b_sin = tl.load(sin_ptr + p_cs, mask=m_m[:, None] & m_r, other=0.0).to(tl.float32)
            b_a = (b_o.to(tl.float32) * b_cos).to(b_o.dtype)
            b_b = (b_r.to(tl.float32) * b_sin).to(b_o.dtype)
            b_o = tl.where(m_r, (b_a.to(tl.float32) + b_b.to(tl.float32)).to(b_o.dtype), b_o)
            if KV:  # the key and value features into the cell's storage at the step's position
                pos = tl.load(pos_ptr).to(tl.int64)
                is_v = o_n >= ROT
                c_kv = tl.where(is_v, o_n - ROT, o_n - KV_START)  # (negative for queries: never stored)
                o_kv = (c_kv // (2 * HALF)) * stride_kh + pos * stride_kt + c_kv % (2 * HALF)
                p_kv = o_m[:, None] * stride_kb + o_kv[None, :]
                tl.store(k_ptr + p_kv, b_o, mask=m_y & ((o_n >= KV_START) & (o_n < ROT))[None, :])
                tl.store(v_ptr + p_kv, b_o, mask=m_y & is_v[None, :])
        tl.store(out_ptr + o_y, b_o, mask=m_y)


@triton.jit(do_not_specialize=["MN"])
def _gemv_reduce_kernel(ws_ptr, bias_ptr, out_ptr, MN, N, SPLIT, stride_os, HAS_BIAS: tl.constexpr,
                        BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    """`out [M, N] = sum_s ws[s] (+ bias)`, the splits added in order 0, 1, ...; `out` contiguous."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    o_y = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m_y = o_y < MN
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in range(0, SPLIT):
        acc += tl.load(ws_ptr + s * stride_os + o_y, mask=m_y, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + o_y % N, mask=m_y, other=0.0).to(tl.float32)
    tl.store(out_ptr + o_y, acc.to(out_ptr.dtype.element_ty), mask=m_y)
