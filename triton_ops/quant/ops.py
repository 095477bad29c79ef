"""Host side of the KIVI quantize kernels: launchers and the public `quantize_keys` / `quantize_values` that dispatch
to Triton on CUDA tensors and to the pure-torch reference (`naive.py`) everywhere else.

Both paths produce the same bytes (codes, fp16 scales and zero points); `tests/ops/test_quant_kernels.py` checks
it against `naive.py` under `TRITON_INTERPRET=1` on CPU and on the GPU.
"""

from __future__ import annotations

import torch
from torch import Tensor

from triton_ops._dispatch import launch_device, next_pow2, use_triton
from triton_ops.quant import naive
from triton_ops.quant.naive import (
    DEFAULT_GROUP_SIZE,
    QuantizedKeys,
    QuantizedValues,
    _check_codes_width,
    _check_finite_params,
    _check_kv,
    _check_nbits,
    _check_positive_int,
    _check_valid,
)

__all__ = ["quantize_keys", "quantize_values"]


def _quantize_keys_fwd(x: Tensor, nbits: int, group_size: int, valid: Tensor | None) -> QuantizedKeys:
    """Launch `_quantize_keys_fwd_kernel` on `x` `[B, H, T, D]` (any strides); returns contiguous outputs."""
    from triton_ops.quant.kernels import _quantize_keys_fwd_kernel

    b, h, t, d = x.shape
    per_byte = 8 // nbits
    codes = torch.empty(b, h, t, d // per_byte, dtype=torch.uint8, device=x.device)
    scale = torch.empty(b, h, t // group_size, d, dtype=torch.float16, device=x.device)
    zero = torch.empty_like(scale)
    if x.numel():
        valid_arg = valid if valid is not None else codes  # any pointer; unused without USE_VALID
        _quantize_keys_fwd_kernel[(t // group_size, b * h)](
            x_ptr=x,
            valid_ptr=valid_arg,
            codes_ptr=codes,
            scale_ptr=scale,
            zero_ptr=zero,
            H=h,
            T=t,
            stride_xb=x.stride(0),
            stride_xh=x.stride(1),
            stride_xt=x.stride(2),
            stride_xd=x.stride(3),
            stride_vb=valid.stride(0) if valid is not None else 0,
            stride_vt=valid.stride(1) if valid is not None else 0,
            stride_cb=codes.stride(0),
            stride_ch=codes.stride(1),
            stride_ct=codes.stride(2),
            stride_sb=scale.stride(0),
            stride_sh=scale.stride(1),
            stride_sg=scale.stride(2),
            D=d,
            NBITS=nbits,
            GROUP=group_size,
            BLOCK_G=next_pow2(group_size),
            BLOCK_C=next_pow2(d // per_byte),
            USE_VALID=valid is not None,
        )
    return QuantizedKeys(codes=codes, scale=scale, zero=zero, nbits=nbits, group_size=group_size)


def _quantize_values_fwd(x: Tensor, nbits: int, group_size: int) -> QuantizedValues:
    """Launch `_quantize_values_fwd_kernel` on `x` `[B, H, T, D]` (any strides); returns contiguous outputs."""
    from triton_ops.quant.kernels import _quantize_values_fwd_kernel

    b, h, t, d = x.shape
    hi = torch.empty(b, h, t, d // 4, dtype=torch.uint8, device=x.device)
    lo = torch.empty_like(hi) if nbits == 4 else None
    scale = torch.empty(b, h, t, d // group_size, dtype=torch.float16, device=x.device)
    zero = torch.empty_like(scale)
    block_t = 16
    if x.numel():
        _quantize_values_fwd_kernel[(_cdiv(t, block_t), b * h)](
            x_ptr=x,
            hi_ptr=hi,
            lo_ptr=lo if lo is not None else hi,
            scale_ptr=scale,
            zero_ptr=zero,
            H=h,
            T=t,
            stride_xb=x.stride(0),
            stride_xh=x.stride(1),
            stride_xt=x.stride(2),
            stride_xd=x.stride(3),
            stride_cb=hi.stride(0),
            stride_ch=hi.stride(1),
            stride_ct=hi.stride(2),
            stride_sb=scale.stride(0),
            stride_sh=scale.stride(1),
            stride_st=scale.stride(2),
            D=d,
            NBITS=nbits,
            GROUP=group_size,
            BLOCK_T=block_t,
            BLOCK_NG=next_pow2(d // group_size),
            BLOCK_K=next_pow2(group_size // 4),
        )
    return QuantizedValues(hi=hi, lo=lo, scale=scale, zero=zero, nbits=nbits, group_size=group_size)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def quantize_keys(
    x: Tensor,
    nbits: int,
    *,
    group_size: int = DEFAULT_GROUP_SIZE,
    valid: Tensor | None = None,
    check_finite: bool = True,
) -> QuantizedKeys:
    """Quantize keys per channel over pages of `group_size` tokens; same contract and bytes as
    `triton_ops.quant.naive.quantize_keys` (see there and README.md for the math).

    Runs the Triton kernel when `x` is on a CUDA device and Triton is installed (one launch, no copy of `x`: any
    strides), the reference otherwise.

    Args:
        x (`torch.Tensor` of shape `[B, H, T, D]`): keys, fp32 / fp16 / bf16; `T % group_size == 0`,
            `D % (8 // nbits) == 0`.
        nbits (`int`): 2 or 4.
        group_size (`int`, *optional*, defaults to 32): tokens per page.
        valid (`torch.BoolTensor` of shape `[B, T]`, *optional*): False marks padding tokens, which take no part in
            the page minima and maxima.
        check_finite (`bool`, *optional*, defaults to True): raise `ValueError` when a group's scale or zero point is
            not finite (an input outside the fp16 range). The check reads one flag back from the device (a sync);
            a caller that guarantees finite inputs on a hot path may switch it off (both paths).

    Returns:
        `QuantizedKeys` with contiguous `codes` `[B, H, T, D * nbits // 8]` and fp16 `scale` / `zero`
        `[B, H, T // group_size, D]`.

    Example:
        >>> x = torch.randn(1, 2, 64, 128)
        >>> quantize_keys(x, 4).codes.shape
        torch.Size([1, 2, 64, 64])
    """
    x = _check_kv(x)
    nbits = _check_nbits(nbits)
    group_size = _check_positive_int(group_size, "group_size")
    if not use_triton("quantize_keys", x):
        return naive.quantize_keys(x, nbits, group_size=group_size, valid=valid, check_finite=check_finite)
    b, _, t, d = x.shape
    if t % group_size:
        raise ValueError(f"keys are quantized per page: `T` ({t}) must be a multiple of `group_size` ({group_size})")
    _check_codes_width(d, nbits, "keys")
    valid = _check_valid(valid, b, t, x.device)
    with launch_device(x):  # the tensor's GPU, not the current one (multi-GPU `device_map`)
        qk = _quantize_keys_fwd(x, nbits, group_size, valid)
    if check_finite:
        _check_finite_params(qk.scale, qk.zero, "x")
    return qk


def quantize_values(
    x: Tensor,
    nbits: int,
    *,
    group_size: int = DEFAULT_GROUP_SIZE,
    valid: Tensor | None = None,
    check_finite: bool = True,
) -> QuantizedValues:
    """Quantize values per token over groups of `group_size` channels; same contract and bytes as
    `triton_ops.quant.naive.quantize_values` (INT4 as two 2-bit planes `hi`, `lo`; INT2 as `hi` only).

    Runs the Triton kernel when `x` is on a CUDA device and Triton is installed, the reference otherwise.

    Args:
        x (`torch.Tensor` of shape `[B, H, T, D]`): values; `D % group_size == 0` and `D % 4 == 0`.
        nbits (`int`): 2 or 4.
        group_size (`int`, *optional*, defaults to 32): channels per group.
        valid (`torch.BoolTensor` of shape `[B, T]`, *optional*): validated and ignored (values are per token).
        check_finite (`bool`, *optional*, defaults to True): as in `quantize_keys`.

    Returns:
        `QuantizedValues`: `hi` / `lo` `[B, H, T, D // 4]` uint8, `scale` / `zero` `[B, H, T, D // group_size]` fp16.
    """
    x = _check_kv(x)
    nbits = _check_nbits(nbits)
    group_size = _check_positive_int(group_size, "group_size")
    if not use_triton("quantize_values", x):
        return naive.quantize_values(x, nbits, group_size=group_size, valid=valid, check_finite=check_finite)
    b, _, t, d = x.shape
    if d % group_size:
        raise ValueError(
            f"values are quantized per channel group: `D` ({d}) must be a multiple of `group_size` ({group_size})"
        )
    _check_codes_width(d, 2, "values")
    _check_valid(valid, b, t, x.device)
    with launch_device(x):  # the tensor's GPU, not the current one (multi-GPU `device_map`)
        qv = _quantize_values_fwd(x, nbits, group_size)
    if check_finite:
        _check_finite_params(qv.scale, qv.zero, "x")
    return qv
