"""Launchers and dispatch of the fused layer ops: the Triton kernel for CUDA tensors outside autograd and tracing,
`reference.py` everywhere else (CPU, gradients, `torch.compile`, or `disabled()`)."""

from __future__ import annotations

import contextlib
import threading
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from triton_ops._dispatch import launch_device, next_pow2, pdl_options, use_triton
from triton_ops.fused import reference

if TYPE_CHECKING:
    from collections.abc import Iterator

__all__ = [
    "NORM_TUNING",
    "disabled",
    "enabled",
    "rms_norm",
    "rms_norm_pair",
    "rotate_half",
    "rotate_pairs",
    "silu_mul",
    "write_kv",
]

_state = threading.local()

NORM_TUNING: dict[str, int | None] = {"num_warps": None}
"""Launch settings of the norm kernel (`rms_norm`, `rms_norm_pair`): `num_warps` per program (one program per row),
None for the rule `_norm_warps` (benchmarks set it to sweep)."""


def _norm_warps(block: int) -> int:
    found = NORM_TUNING["num_warps"]
    if found is not None:
        return int(found)
    return 8 if block >= 4096 else 4


def enabled() -> bool:
    """Whether CUDA tensors take the fused kernels in this thread (True unless inside `disabled()`)."""
    return getattr(_state, "on", True)


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """Run the models' layer ops op by op (the reference) inside the block, on every device: for comparisons."""
    before = enabled()
    _state.on = False
    try:
        yield
    finally:
        _state.on = before


def _fused(op: str, *tensors: Tensor) -> bool:
    if not enabled() or torch.compiler.is_compiling():
        return False  # a compiled graph fuses the reference itself
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return False  # the kernels have no backward
    return use_triton(op, *tensors)


def _check_rows(name: str, t: Tensor | None, like: Tensor) -> None:
    if t is not None and (t.shape != like.shape or t.dtype != like.dtype):
        raise ValueError(f"`{name}` must have the shape {tuple(like.shape)} and dtype {like.dtype} of `x`; got "
                         f"{tuple(t.shape)} {t.dtype}")


def _rms_norm(x: Tensor, weight: Tensor, eps: float, add_before: Tensor | None, add_after: Tensor | None,
              then: tuple[Tensor, float] | None) -> tuple[Tensor, Tensor | None]:
    from triton_ops.fused.kernels import _rms_norm_kernel

    n = x.shape[-1]
    xc = x.contiguous()
    out = torch.empty_like(xc)
    out2 = torch.empty_like(xc) if then is not None else None
    rows = xc.numel() // n if n else 0
    if rows:
        before = add_before.contiguous() if add_before is not None else xc
        after = add_after.contiguous() if add_after is not None else xc
        w2, eps2 = (then[0].contiguous(), float(then[1])) if then is not None else (weight, 0.0)
        block = next_pow2(n)
        with launch_device(x):
            _rms_norm_kernel[(rows,)](xc, weight.contiguous(), before, after, out, w2, out2 if out2 is not None else out,
                                      n, float(eps), eps2, HAS_BEFORE=add_before is not None,
                                      HAS_AFTER=add_after is not None, HAS_NEXT=then is not None, BLOCK=block,
                                      **pdl_options(x), num_warps=_norm_warps(block))
    return out, out2


def rms_norm(x: Tensor, weight: Tensor, eps: float, *, add_before: Tensor | None = None,
             add_after: Tensor | None = None) -> Tensor:
    """`add_after + weight * norm(x + add_before)` over the last axis (see `reference.ref_rms_norm`): one kernel."""
    _check_rows("add_before", add_before, x)
    _check_rows("add_after", add_after, x)
    extra = [t for t in (add_before, add_after) if t is not None]
    if not _fused("rms_norm", x, weight, *extra) or weight.dtype != x.dtype:
        return reference.ref_rms_norm(x, weight, eps, add_before=add_before, add_after=add_after)
    return _rms_norm(x, weight, eps, add_before, add_after, None)[0]


def rms_norm_pair(x: Tensor, weight: Tensor, eps: float, next_weight: Tensor, next_eps: float, *,
                  add_before: Tensor | None = None, add_after: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """`h = add_after + weight * norm(x + add_before)` and `next_weight * norm(h)`, both over the last axis, in one
    kernel on CUDA (see `reference.ref_rms_norm_pair`): a layer's residual norm and the norm that reads its output
    (Ouro's `input_layernorm_2` and `post_attention_layernorm`, Huginn's `norm_2` and `norm_3`). Returns
    `(h, normed)`, each shaped like `x`."""
    _check_rows("add_before", add_before, x)
    _check_rows("add_after", add_after, x)
    if next_weight.shape != weight.shape:
        raise ValueError(f"`next_weight` must have the shape {tuple(weight.shape)} of `weight`; got "
                         f"{tuple(next_weight.shape)}")
    extra = [t for t in (add_before, add_after) if t is not None]
    if (not _fused("rms_norm", x, weight, next_weight, *extra) or weight.dtype != x.dtype
            or next_weight.dtype != x.dtype):
        return reference.ref_rms_norm_pair(x, weight, eps, next_weight, next_eps, add_before=add_before,
                                           add_after=add_after)
    out, out2 = _rms_norm(x, weight, eps, add_before, add_after, (next_weight, next_eps))
    return out, out2  # type: ignore[return-value]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _rotate(x: Tensor, cos: Tensor, sin: Tensor, bias: Tensor | None, pairs: bool) -> Tensor:
    from triton_ops.fused.kernels import _rotate_kernel

    b, q, h, d = x.shape
    xs = x if x.stride(-1) == 1 else x.contiguous()
    out = torch.empty(b, q, h, d, dtype=x.dtype, device=x.device)
    width = d // 2 if pairs else d
    cos, sin = cos.reshape(b * q, width).contiguous(), sin.reshape(b * q, width).contiguous()
    bias_arg = bias.reshape(h, d).contiguous() if bias is not None else out
    block_h = min(next_pow2(h), 16)
    if out.numel():
        with launch_device(x):
            _rotate_kernel[(b * q, _cdiv(h, block_h))](
                xs, cos, sin, bias_arg, out, q, h, xs.stride(0), xs.stride(1), xs.stride(2), cos.stride(0),
                D=d, PAIRS=pairs, HAS_BIAS=bias is not None, BLOCK_H=block_h, **pdl_options(x))
    return out


def rotate_half(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """RoPE, rotate-half convention (Ouro): `x` `[B, q, H, D]`, `cos` / `sin` `[B, q, D]` in `x`'s dtype; returns a
    contiguous `[B, q, H, D]`."""
    b, q, _, d = x.shape
    if cos.shape != (b, q, d) or sin.shape != (b, q, d):
        raise ValueError(f"`cos` and `sin` must have shape {(b, q, d)}; got {tuple(cos.shape)} and {tuple(sin.shape)}")
    if not _fused("rotate_half", x, cos, sin) or cos.dtype != x.dtype or d & (d - 1):
        return reference.ref_rotate_half(x, cos, sin)
    return _rotate(x, cos, sin, None, pairs=False)


def rotate_pairs(x: Tensor, cos: Tensor, sin: Tensor, bias: Tensor | None = None) -> Tensor:
    """RoPE on consecutive pairs (Huginn), fp32 inside: `x` `[B, q, H, D]`, `cos` / `sin` fp32 `[B, q, 1, D/2]`,
    `bias` `[1, H, D]` added first (Huginn's `qk_bias`)."""
    b, q, h, d = x.shape
    if cos.shape != (b, q, 1, d // 2) or sin.shape != (b, q, 1, d // 2):
        raise ValueError(f"`cos` and `sin` must have shape {(b, q, 1, d // 2)}; got {tuple(cos.shape)} and "
                         f"{tuple(sin.shape)}")
    if bias is not None and bias.numel() != h * d:
        raise ValueError(f"`bias` must hold {h} x {d} values (one per head and channel); got {tuple(bias.shape)}")
    extra = [bias] if bias is not None else []
    if (not _fused("rotate_pairs", x, cos, sin, *extra) or cos.dtype != torch.float32 or d & (d - 1)
            or (bias is not None and bias.dtype != x.dtype)):
        return reference.ref_rotate_pairs(x, cos, sin, bias)
    return _rotate(x, cos, sin, bias, pairs=True)


def silu_mul(gate: Tensor, up: Tensor) -> Tensor:
    """`silu(gate) * up` in one kernel (same shape and dtype; the last axis contiguous, rows at any stride, as two
    halves of one projection are); returns a contiguous tensor."""
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(f"`up` must have the shape {tuple(gate.shape)} and dtype {gate.dtype} of `gate`; got "
                         f"{tuple(up.shape)} {up.dtype}")
    if not _fused("silu_mul", gate, up):
        return reference.ref_silu_mul(gate, up)
    from triton_ops.fused.kernels import _silu_mul_kernel

    n = gate.shape[-1]
    g, u = (t if t.stride(-1) == 1 else t.contiguous() for t in (gate, up))
    g2, u2 = g.reshape(-1, n), u.reshape(-1, n)  # views for rows at one stride (two halves of a projection)
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    rows = out.numel() // n if n else 0
    if rows:
        block = min(next_pow2(n), 2048)
        with launch_device(gate):
            _silu_mul_kernel[(rows, _cdiv(n, block))](g2, u2, out, n, g2.stride(0), u2.stride(0), BLOCK=block,
                                                      **pdl_options(gate))
    return out


def write_kv(k: Tensor, v: Tensor, key: Tensor, value: Tensor, positions: Tensor, *, modulo: int | None = None,
             sink: tuple[Tensor, Tensor, int] | None = None) -> None:
    """Write new keys and values into a static cell's storage in place: every write of the step in one kernel on
    CUDA (two or four `index_copy_` and the slot arithmetic otherwise; see `reference.ref_write_kv`).

    Args:
        k, v (`torch.Tensor` of shape `[B, H, N, D]`): the storage (views of it: the first rows), the same strides,
            the last axis contiguous.
        key, value (`torch.Tensor` of shape `[B, H, Q, D]`): the new keys and values (any strides with the last axis
            contiguous; cast to the storage's dtype).
        positions (`torch.LongTensor` of shape `[Q]`): where each new position goes, on the storage's device.
        modulo (`int`, *optional*): slots wrap around it (a ring; of more than `N` positions the last `N` are kept).
        sink (`(sink_k, sink_v, clamp)`, *optional*): also write every position into the sink storage `[B, H, S + 1,
            D]` at slot `min(position, clamp)` (positions past the sink go to its scratch slot `clamp`).

    Slots must be distinct (except the sink's scratch slot, whose bytes are then unspecified) and in range.
    """
    if k.dim() != 4 or v.shape != k.shape:
        raise ValueError(f"`k` and `v` must be one storage shape [B, H, N, D]; got {tuple(k.shape)} and "
                         f"{tuple(v.shape)}")
    b, h, n, d = k.shape
    q = positions.shape[0] if positions.dim() == 1 else -1
    for name, t in (("key", key), ("value", value)):
        if t.shape != (b, h, q, d):
            raise ValueError(f"`{name}` must have shape {(b, h, q, d)} (the storage's rows, heads and width, one "
                             f"position per entry of `positions` {tuple(positions.shape)}); got {tuple(t.shape)}")
    extra: list[Tensor] = []
    if sink is not None:
        sink_k, sink_v, clamp = sink
        if sink_v.shape != sink_k.shape or sink_k.shape[:2] != (b, h) or sink_k.shape[3] != d:
            raise ValueError(f"`sink` storage must be two tensors [{b}, {h}, S + 1, {d}]; got {tuple(sink_k.shape)} "
                             f"and {tuple(sink_v.shape)}")
        if not 0 <= clamp < sink_k.shape[2]:
            raise ValueError(f"the sink's scratch slot `clamp` must be in [0, {sink_k.shape[2]}); got {clamp}")
        extra = [sink_k, sink_v]
    if (not _fused("write_kv", k, v, key, value, positions, *extra) or k.stride() != v.stride()
            or (sink is not None and extra[0].stride() != extra[1].stride())
            or any(t.stride(-1) != 1 for t in (k, v, key, value, *extra)) or positions.dtype != torch.long):
        reference.ref_write_kv(k, v, key, value, positions, modulo=modulo, sink=sink)
        return
    _write_kv(k, v, key, value, positions, modulo, sink)


def _write_kv(k: Tensor, v: Tensor, key: Tensor, value: Tensor, positions: Tensor, modulo: int | None,
              sink: tuple[Tensor, Tensor, int] | None) -> None:
    from triton_ops.fused.kernels import _write_kv_kernel

    b, h, n, d = k.shape
    q = positions.shape[0]
    if not key.numel():
        return
    sk, sv, clamp = sink if sink is not None else (k, v, 0)
    with launch_device(k):
        _write_kv_kernel[(b * h, q)](
            key, value, positions, k, v, sk, sv, h, 1 if modulo is None else int(modulo), max(0, q - n), int(clamp),
            key.stride(0), key.stride(1), key.stride(2), value.stride(0), value.stride(1), value.stride(2),
            k.stride(0), k.stride(1), k.stride(2), sk.stride(0), sk.stride(1), sk.stride(2),
            D=d, BLOCK_D=next_pow2(d), HAS_MODULO=modulo is not None, HAS_SINK=sink is not None, **pdl_options(k),
            num_warps=1 if d <= 128 else 2)
