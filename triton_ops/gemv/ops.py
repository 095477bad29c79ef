"""Launcher, tuning and dispatch of `gemv`: a skinny GEMM `y = x @ W^T` for inputs of a few rows (decode steps).

cuBLAS picks tiles for such shapes that leave most SMs idle or split K with an extra reduce kernel (H200, Ouro-1.4B's
`o_proj` 2048 -> 2048: 32 programs on 132 SMs). This op reads `W` once with at least one program per SM: narrow
blocks of output features, and K split only when the feature blocks are too few (the partial sums added in a fixed
order by a second kernel, never by atomics: the result does not depend on scheduling). No host sync, no persistent
workspace (a split's fp32 partials are a temporary of the call), so it can be captured in a CUDA graph.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import Tensor

from triton_ops._dispatch import launch_device, next_pow2, pdl_options, use_triton
from triton_ops.gemv.reference import ref_gemv

__all__ = [
    "GEMV_CONFIGS",
    "GEMV_TUNING",
    "default_config",
    "gemv",
    "gemv_config",
    "linear",
    "linear_rope",
    "routes",
    "silu_linear",
]

GEMV_TUNING: dict[str, Any] = {
    "enabled": True,
    "listed_only": True,
    "max_rows": 16,
    "programs_per_sm": 1,
    "min_split_k": 512,
    "fuse_silu": True,
    "fuse_rope": True,
    "fuse_kv": True,
}
"""The models' switch and the defaults: `enabled` sends the decode projections of the native models (`linear`,
`hf_loopcache.models._common`) to the kernel on CUDA (on: `GEMV_CONFIGS` holds the H200's measured wins); with `listed_only`
only the shapes and row classes that `GEMV_CONFIGS` lists with settings take it (the measured wins), otherwise every
shape does (`default_config` where none is listed); `max_rows` is the most rows (all leading dims flattened) that
take it; `programs_per_sm` is the programs the default split aims at per SM; `min_split_k` the fewest K values one
split reads; `fuse_silu` lets `silu_linear` read a gated MLP's activation in the down projection's kernel (one launch
less per layer call) where that projection takes the kernel; `fuse_rope` lets `linear_rope` rotate the queries and
keys of a stacked q/k/v projection in its kernel (one launch less per layer call); `fuse_kv` lets the models hand
that kernel a static dense cell's storage (`kv_out`), so it stores the step's keys and values itself (one cache-write
launch less per layer call)."""

GEMV_CONFIGS: dict[tuple[int, int], dict[int, dict[str, Any] | None]] = {
    # H200 (torch 2.11, Triton 3.6, bf16; `python -m benchmarks.run gemv`, benchmarks/results/gemv_h200.json): the
    # sweep's fastest settings where they beat cuBLAS, None where cuBLAS won; Ouro-1.4B's q/k/v (6144, 2048) and down
    # (2048, 5632) projections at one row from the in-step sweep instead (session 22,
    # `benchmarks/results/step_projections_h200_s22.json`: -0.77 and -0.37 us per layer against the isolated sweep's
    # settings, the projections replayed back to back as in a step)
    (2048, 2048): {
        1: {"block_n": 2, "block_k": 2048, "split": 1, "dot": False, "num_warps": 4, "num_stages": 2},
        2: {"block_n": 4, "block_k": 1024, "split": 1, "dot": False, "num_warps": 4, "num_stages": 2},
        4: None,
        8: None,
        16: None,
    },
    (2048, 5632): {
        1: {"block_n": 8, "block_k": 2048, "split": 1, "dot": False, "num_warps": 8, "num_stages": 2},
        2: {"block_n": 4, "block_k": 1024, "split": 1, "dot": False, "num_warps": 4, "num_stages": 2},
        4: None,
        8: None,
        16: None,
    },
    (5280, 5280): {
        1: {"block_n": 2, "block_k": 2048, "split": 1, "dot": False, "num_warps": 4, "num_stages": 2},
        2: None,
        4: None,
        8: None,
        16: None,
    },
    (5280, 10560): {
        1: {"block_n": 8, "block_k": 512, "split": 1, "dot": False, "num_warps": 4, "num_stages": 2},
        2: None,
        4: None,
        8: None,
        16: None,
    },
    (5280, 17920): {
        1: {"block_n": 2, "block_k": 2048, "split": 1, "dot": False, "num_warps": 4, "num_stages": 2},
        2: {"block_n": 64, "block_k": 128, "split": 2, "dot": True, "num_warps": 4, "num_stages": 4},
        4: {"block_n": 64, "block_k": 128, "split": 2, "dot": True, "num_warps": 4, "num_stages": 4},
        8: {"block_n": 64, "block_k": 128, "split": 2, "dot": True, "num_warps": 4, "num_stages": 4},
        16: {"block_n": 64, "block_k": 128, "split": 2, "dot": True, "num_warps": 4, "num_stages": 4},
    },
    (6144, 2048): {
        1: {"block_n": 4, "block_k": 512, "split": 1, "dot": False, "num_warps": 2, "num_stages": 2},
        2: None,
        4: None,
        8: None,
        16: None,
    },
    (11264, 2048): {
        1: None,
        2: None,
        4: None,
        8: None,
        16: None,
    },
    (15840, 5280): {
        1: None,
        2: None,
        4: None,
        8: None,
        16: None,
    },
    (35840, 5280): {
        1: {"block_n": 8, "block_k": 512, "split": 1, "dot": False, "num_warps": 4, "num_stages": 2},
        2: None,
        4: None,
        8: None,
        16: None,
    },
}
"""Measured launch settings per `(N, K)` and row class (`next_pow2(M)`: 1, 2, 4, 8, 16), pasted from the
`*_configs.py` that `python -m benchmarks.run gemv` writes on the H200: `block_n`, `block_k`, `split` (K ranges; None
for the default rule's), `dot` (tensor cores on rows padded to 16, else FMA), `num_warps`, `num_stages`; None where
cuBLAS was faster (`linear` keeps `F.linear` there). `gemv` itself takes `default_config` where nothing is listed."""

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@functools.cache
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _sms(x: Tensor) -> int:
    return _num_sms(x.device.index if x.device.index is not None else torch.cuda.current_device()) if x.is_cuda else 8


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def default_config(m: int, n: int, k: int, sms: int) -> dict[str, Any]:
    """Settings for `M` rows of an `[N, K]` weight on `sms` SMs when `GEMV_CONFIGS` has none: FMA on narrow blocks for
    1-2 rows, tensor cores on 16-row tiles above; K split only when the feature blocks cannot fill the SMs."""
    cfg: dict[str, Any]
    if m <= 2:
        cfg = {"block_n": 8, "block_k": 512, "dot": False, "num_warps": 4, "num_stages": 2}
    else:
        cfg = {"block_n": 16, "block_k": 256, "dot": True, "num_warps": 4, "num_stages": 3}
    cfg["split"] = None
    return cfg


def _split(cfg: dict[str, Any], n: int, k: int, sms: int) -> tuple[int, int]:
    """`(splits, K values per split)`: the configured split, or the fewest splits that give `programs_per_sm`
    programs per SM, each at least `min_split_k` long; every split but the last reads a multiple of `block_k`."""
    block_k = cfg["block_k"]
    split = cfg.get("split")
    if split is None:
        blocks = _cdiv(n, cfg["block_n"])
        want = _cdiv(int(GEMV_TUNING["programs_per_sm"]) * sms, blocks)
        split = max(1, min(want, k // max(int(GEMV_TUNING["min_split_k"]), block_k)))
    k_split = _cdiv(_cdiv(k, max(1, int(split))), block_k) * block_k
    return _cdiv(k, k_split), k_split


def _launch_blocks(cfg: dict[str, Any]) -> dict[str, Any]:
    """`cfg` with the block sizes a launch uses: tensor-core tiles are at least 16 wide."""
    if not cfg["dot"]:
        return cfg
    return {**cfg, "block_n": max(16, cfg["block_n"]), "block_k": max(16, cfg["block_k"])}


def gemv_config(m: int, n: int, k: int, sms: int) -> dict[str, Any]:
    """The settings a call of `M` rows on an `[N, K]` weight runs with (`GEMV_CONFIGS`, else `default_config`)."""
    found = GEMV_CONFIGS.get((n, k), {}).get(next_pow2(m))
    return {**default_config(m, n, k, sms), **found} if found else default_config(m, n, k, sms)


def _gemv_fwd(x2: Tensor, weight: Tensor, bias: Tensor | None, cfg: dict[str, Any], sms: int,
              gated: bool = False, rope: tuple[Tensor, Tensor, int] | None = None,
              kv_out: tuple[Tensor, Tensor, Tensor, int] | None = None) -> Tensor:
    """Launch on `x2` `[M, K]` (`gated`: `[M, 2K]`, gate then up; last axis contiguous); returns `[M, N]` in `x2`'s
    dtype. `rope`: `(cos, sin, rotated)`, `cos` / `sin` `[M, D]` (last axis contiguous, one row stride), the first
    `rotated` output features rotated in the kernel (one K split; blocks `_rope_blocks` accepts). `kv_out` (with
    `rope`): `(k, v, positions, kv_start)`, features `[kv_start, rotated)` and `[rotated, N)` of each row also stored
    at `k` / `v` `[row, head, positions[0], :]` (checked by `linear_rope`)."""
    from triton_ops.gemv.kernels import _gemv_fwd_kernel, _gemv_reduce_kernel

    m = x2.shape[0]
    n, k = weight.shape
    out = torch.empty(m, n, dtype=x2.dtype, device=x2.device)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_() if bias is None else out.copy_(bias.expand(m, n))
    dot = bool(cfg["dot"])
    block_m = max(16, next_pow2(m)) if dot else next_pow2(m)
    blocks = _launch_blocks(cfg)
    block_n, block_k = blocks["block_n"], blocks["block_k"]
    split, k_split = _split(blocks, n, k, sms)
    grid = (_cdiv(n, block_n), split)
    partial = split > 1
    if rope is not None and (partial or not _rope_blocks(block_n, rope[0].shape[-1], n, rope[2])):
        raise ValueError(f"RoPE in the kernel needs one K split and channel pairs of one head per block; got split "
                         f"{split}, block_n {block_n}, head dim {rope[0].shape[-1]}, N {n}, rotated {rope[2]}")
    cos, sin, rotated = rope if rope is not None else (out, out, 0)
    if kv_out is not None and rope is None:
        raise ValueError("`kv_out` is stored by the RoPE epilogue: pass `rope` too")
    k_store, v_store, positions, kv_start = kv_out if kv_out is not None else (out, out, out, 0)
    kv_strides = k_store.stride()[:3] if kv_out is not None else (0, 0, 0)
    ws = torch.empty(split, m, n, dtype=torch.float32, device=x2.device) if partial else out
    bias_arg = bias if bias is not None else out
    pdl = pdl_options(x2)
    preload = cfg.get("preload")
    preload = not dot and (pdl["USE_PDL"] if preload is None else bool(preload))
    launch = dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    with launch_device(x2):
        _gemv_fwd_kernel[grid](
            x2, weight, bias_arg, ws, m, n, k, k_split, x2.stride(0), weight.stride(0), n, m * n, cos, sin,
            cos.stride(0), rotated, k_store, v_store, positions, kv_start, *kv_strides, BLOCK_M=block_m,
            BLOCK_N=block_n, BLOCK_K=block_k, USE_DOT=dot, IEEE=x2.dtype == torch.float32, PARTIAL=partial,
            HAS_BIAS=bias is not None and not partial, PRELOAD=preload, GATED=gated, ROPE=rope is not None,
            HALF=max(1, cos.shape[-1] // 2) if rope else 1, KV=kv_out is not None, **pdl, **launch)  # fmt: skip
        if partial:
            block = 1024
            _gemv_reduce_kernel[(_cdiv(m * n, block),)](ws, bias_arg, out, m * n, n, split, m * n,
                                                        HAS_BIAS=bias is not None, BLOCK=block, **pdl, num_warps=4)
    return out


def _check(x: Tensor, weight: Tensor, bias: Tensor | None, gated: bool = False) -> None:
    if weight.dim() != 2:
        raise ValueError(f"`weight` must be 2-D [N, K] (nn.Linear layout); got shape {tuple(weight.shape)}")
    width = 2 * weight.shape[1] if gated else weight.shape[1]
    if x.dim() < 1 or x.shape[-1] != width:
        what = "2 K, gate and up," if gated else "K"
        raise ValueError(f"`x` must end in {what} = {width} (K: the `weight`'s in_features); got shape "
                         f"{tuple(x.shape)}")
    if x.dtype not in _DTYPES or weight.dtype != x.dtype:
        raise ValueError(f"`x` and `weight` must share one dtype of float16, bfloat16, float32; got {x.dtype} and "
                         f"{weight.dtype}")
    if bias is not None and (bias.shape != (weight.shape[0],) or bias.dtype != x.dtype):
        raise ValueError(f"`bias` must be [{weight.shape[0]}] in {x.dtype}; got {tuple(bias.shape)} {bias.dtype}")


def gemv(x: Tensor, weight: Tensor, bias: Tensor | None = None, *, config: dict[str, Any] | None = None,
         gated: bool = False) -> Tensor:
    """`x @ weight.T (+ bias)` for inputs of a few rows, reading `weight` once (fp32 accumulation); with `gated`,
    `silu(gate) * up @ weight.T` of `x = [gate | up]` (a gated MLP's down projection, the activation read in the
    kernel's input load: `triton_ops.fused.silu_mul`'s roundings, no separate launch).

    Args:
        x (`torch.Tensor` of shape `[..., K]`): fp16 / bf16 (fp32 for tests); all leading dims are rows.
        weight (`torch.Tensor` of shape `[N, K]`): `nn.Linear` layout, same dtype, last axis contiguous (rows at any
            stride: a slice of a stacked buffer is read in place).
        bias (`torch.Tensor` of shape `[N]`, *optional*): added to the fp32 sums before the cast.
        gated (`bool`, *optional*, defaults to `False`): `x` is `[..., 2K]`, the gate's `K` values then the up
            projection's (one stacked projection's output).
        config (`dict`, *optional*): launch settings overriding `gemv_config`'s (benchmarks, tests): `block_n`,
            `block_k`, `split`, `dot`, `num_warps`, `num_stages`, and `preload` (FMA path: each weight tile loaded
            one iteration ahead, the first before the wait for the previous kernel; default: with programmatic
            dependent launch, `triton_ops._dispatch.PDL`).

    Returns:
        `torch.Tensor` of shape `[..., N]` in `x`'s dtype: the Triton kernel for CUDA tensors, `ref_gemv`
        (`F.linear`) elsewhere. Deterministic: the same inputs give the same bits on every run.

    Example:
        >>> y = gemv(torch.randn(1, 1, 64), torch.randn(96, 64))  # CPU: F.linear
        >>> y.shape
        torch.Size([1, 1, 96])
    """
    _check(x, weight, bias, gated)
    k, n = weight.shape[1], weight.shape[0]
    if not use_triton("gemv", x, weight, *([bias] if bias is not None else [])):
        if gated:
            from triton_ops.fused.reference import ref_silu_mul

            return ref_gemv(ref_silu_mul(x[..., :k], x[..., k:]), weight, bias)
        return ref_gemv(x, weight, bias)
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    w = weight if weight.stride(-1) == 1 else weight.contiguous()
    sms = _sms(x)
    cfg = {**gemv_config(x2.shape[0], n, k, sms), **(config or {})}
    return _gemv_fwd(x2, w, bias.contiguous() if bias is not None else None, cfg, sms, gated).view(*x.shape[:-1], n)


def routes(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> bool:
    """Whether `linear` sends this call to the kernel: switched on (`GEMV_TUNING["enabled"]`), at most
    `max_rows` rows, a shape and row class `GEMV_CONFIGS` does not give to cuBLAS (and lists, with `listed_only`),
    fp16 / bf16 inputs and weight of one dtype on CUDA with Triton, no gradient and no tracing."""
    if not GEMV_TUNING["enabled"] or torch.compiler.is_compiling():
        return False
    if x.dtype not in (torch.float16, torch.bfloat16) or weight.dtype != x.dtype or weight.dim() != 2:
        return False
    if bias is not None and bias.dtype != x.dtype:
        return False
    k = weight.shape[1]
    if x.dim() < 1 or x.shape[-1] != k or k == 0 or not 0 < x.numel() // k <= int(GEMV_TUNING["max_rows"]):
        return False
    listed = GEMV_CONFIGS.get((weight.shape[0], k), {})
    row_class = next_pow2(x.numel() // k)
    if listed.get(row_class, ...) is None or (GEMV_TUNING["listed_only"] and not listed.get(row_class)):
        return False  # cuBLAS measured faster, or not measured
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return False  # the kernel has no backward
    return use_triton("gemv", x, weight)


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """`F.linear(x, weight, bias)`, through `gemv` when `routes` says so (the models' decode projections)."""
    if routes(x, weight, bias):
        return gemv(x, weight, bias)
    return torch.nn.functional.linear(x, weight, bias)


def silu_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """`F.linear(silu(gate) * up, weight, bias)` of `x = [gate | up]` `[..., 2K]` (a gated MLP's stacked gate/up
    output and its down projection `weight` `[N, K]`): one `gemv(..., gated=True)` launch when `GEMV_TUNING["fuse_silu"]`
    and `routes` sends the projection to the kernel; `triton_ops.fused.silu_mul` then `linear` otherwise."""
    k = weight.shape[-1]
    if x.shape[-1] != 2 * k:
        raise ValueError(f"`x` must end in 2 K = {2 * k} (gate and up; K: the `weight`'s in_features); got shape "
                         f"{tuple(x.shape)}")
    gate, up = x[..., :k], x[..., k:]
    if GEMV_TUNING["fuse_silu"] and x.stride(-1) == 1 and routes(gate, weight, bias):
        return gemv(x, weight, bias, gated=True)
    from triton_ops import fused

    return linear(fused.silu_mul(gate, up), weight, bias)


def _rope_blocks(block_n: int, d: int, n: int, rotated: int) -> bool:
    """Whether blocks of `block_n` output features can each hold channel pairs `(c, c + d/2)` of one head of `d`
    channels (`n` and `rotated` whole heads)."""
    return (block_n >= 2 and block_n % 2 == 0 and d >= 2 and d % 2 == 0 and (d // 2) % (block_n // 2) == 0
            and n % d == 0 and rotated % d == 0 and 0 <= rotated <= n)


def linear_rope(x: Tensor, weight: Tensor, cos: Tensor, sin: Tensor, rotated: int, *,
                kv_out: tuple[Tensor, Tensor, Tensor] | None = None) -> Tensor | None:
    """`linear(x, weight)` with rotate-half RoPE applied to its first `rotated` output features (heads of `D =
    cos.shape[-1]` channels: a stacked q/k/v projection's queries and keys) in the GEMV kernel, or None where that
    kernel is not what `linear` launches here (the caller then rotates with `triton_ops.fused.rotate_half`).

    The kernel rotates the projection rounded to the output dtype with `rotate_half`'s roundings, so the result is
    bit for bit `linear` then `rotate_half` on the same settings. It is taken when `GEMV_TUNING["fuse_rope"]`,
    `routes` sends the call to the kernel, its settings run one K split and blocks of channel pairs of one head
    (`block_n` even, `D / 2` a multiple of `block_n / 2`), and `cos` / `sin` are `[..., D]` in `x`'s dtype with
    `x`'s leading shape.

    Args:
        x (`torch.Tensor` of shape `[..., K]`): the normed input.
        weight (`torch.Tensor` of shape `[N, K]`): the stacked projection (`N` whole heads).
        cos, sin (`torch.Tensor` of shape `[..., D]`): RoPE tables per row of `x`.
        rotated (`int`): how many leading output features are rotated (a multiple of `D`).
        kv_out (`tuple`, *optional*): `(k, v, positions)` of a static cache cell for a one-token step: storage `k` /
            `v` `[B', H_kv, T, D]` (`B' >=` the rows of `x`, `D` contiguous) and `positions` (an integer tensor on
            the device, the step's position first). The kernel also stores the keys (the `H_kv * D` features before
            `rotated`, rotated) and the values (the `H_kv * D` after it) of every row there, as
            `triton_ops.fused.write_kv` would: they are written exactly when the result is not None.
    """
    n, k = weight.shape
    d = cos.shape[-1]
    if kv_out is not None:
        _check_kv_out(kv_out, x, n, d, rotated)
    if not GEMV_TUNING["fuse_rope"] or cos.shape != sin.shape or cos.shape[:-1] != x.shape[:-1]:
        return None
    if cos.dtype != x.dtype or sin.dtype != x.dtype or x.stride(-1) != 1 or not routes(x, weight):
        return None
    x2 = x.reshape(-1, k)
    sms = _sms(x)
    cfg = gemv_config(x2.shape[0], n, k, sms)
    blocks = _launch_blocks(cfg)
    if _split(blocks, n, k, sms)[0] != 1 or not _rope_blocks(blocks["block_n"], d, n, rotated):
        return None
    cos2, sin2 = cos.reshape(-1, d).contiguous(), sin.reshape(-1, d).contiguous()
    w = weight if weight.stride(-1) == 1 else weight.contiguous()
    kv = None if kv_out is None else (*kv_out, rotated - (n - rotated))
    return _gemv_fwd(x2, w, None, cfg, sms, rope=(cos2, sin2, rotated), kv_out=kv).view(*x.shape[:-1], n)


def _check_kv_out(kv_out: Any, x: Tensor, n: int, d: int, rotated: int) -> None:
    """`linear_rope`'s `kv_out`: one-token rows, storage that holds them, keys and values of whole heads."""
    if not isinstance(kv_out, tuple) or len(kv_out) != 3:
        raise ValueError("`kv_out` must be a tuple (k, v, positions)")
    k, v, positions = kv_out
    rows = x.reshape(-1, x.shape[-1]).shape[0]
    width = n - rotated  # the values' features (and the keys')
    if x.dim() != 3 or x.shape[1] != 1:
        raise ValueError(f"`kv_out` stores a one-token step: `x` must be [B, 1, K], got {tuple(x.shape)}")
    if k.dim() != 4 or k.shape != v.shape or k.stride() != v.stride() or k.stride(-1) != 1:
        raise ValueError(f"`kv_out`'s k and v must be one [B, H_kv, T, D] layout with D contiguous; got "
                         f"{tuple(k.shape)} / {tuple(v.shape)}")
    if k.shape[0] < rows or k.shape[1] * k.shape[3] != width or k.shape[3] != d or width <= 0 or rotated < 2 * width:
        raise ValueError(f"`kv_out`'s storage {tuple(k.shape)} must hold {rows} rows of {width} key and value "
                         f"features in heads of {d}")
    if k.dtype != x.dtype or v.dtype != x.dtype or k.device != x.device or v.device != x.device:
        raise ValueError(f"`kv_out`'s storage must be {x.dtype} on {x.device}; got {k.dtype} on {k.device}")
    if positions.numel() < 1 or positions.dtype.is_floating_point or positions.device != x.device:
        raise ValueError(f"`kv_out`'s positions must be an integer tensor on {x.device}; got {positions.dtype} on "
                         f"{positions.device}")
