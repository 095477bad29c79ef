"""The pure-torch math of the fused layer ops: the models' own eager code, op for op (the contract and CPU path).

Every intermediate rounds to the activations' dtype exactly where the eager code rounds, so the kernels can match it
to the last bit where the arithmetic allows (`README.md`).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["ref_rms_norm", "ref_rms_norm_pair", "ref_rotate_half", "ref_rotate_pairs", "ref_silu_mul", "ref_write_kv"]


def ref_rms_norm(x: Tensor, weight: Tensor, eps: float, *, add_before: Tensor | None = None,
                 add_after: Tensor | None = None) -> Tensor:
    """`add_after + weight * norm(x + add_before)`: the RMS norm in fp32, cast back, then scaled (both official codes);
    `add_before` is added to `x` in its dtype first (Huginn's sandwich), `add_after` to the result (Ouro's residual)."""
    if add_before is not None:
        x = x + add_before
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * x32.to(x.dtype)
    return out if add_after is None else add_after + out


def ref_rms_norm_pair(x: Tensor, weight: Tensor, eps: float, next_weight: Tensor, next_eps: float, *,
                      add_before: Tensor | None = None, add_after: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """`(h, next_weight * norm(h))` with `h = add_after + weight * norm(x + add_before)`: two `ref_rms_norm` calls."""
    h = ref_rms_norm(x, weight, eps, add_before=add_before, add_after=add_after)
    return h, ref_rms_norm(h, next_weight, next_eps)


def _rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def ref_rotate_half(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """RoPE in the rotate-half convention (Ouro) in `x`'s dtype: `x * cos + rotate_half(x) * sin`; `x` `[B, q, H, D]`,
    `cos` / `sin` `[B, q, D]` in `x`'s dtype."""
    cos, sin = cos[:, :, None], sin[:, :, None]
    return x * cos + _rotate_half(x) * sin


def ref_rotate_pairs(x: Tensor, cos: Tensor, sin: Tensor, bias: Tensor | None = None) -> Tensor:
    """RoPE on consecutive pairs (Huginn) in fp32, cast back once; `x` `[B, q, H, D]`, `cos` / `sin` fp32
    `[B, q, 1, D/2]`; `bias` (`[1, H, D]`, Huginn's `qk_bias`) is added first and rounded to `x`'s dtype."""
    if bias is not None:
        x = (x + bias).to(x.dtype)
    pairs = x.float().unflatten(-1, (-1, 2))
    re, im = pairs[..., 0], pairs[..., 1]
    out = torch.stack([re * cos - im * sin, im * cos + re * sin], dim=-1).flatten(-2)
    return out.type_as(x)


def ref_silu_mul(gate: Tensor, up: Tensor) -> Tensor:
    """`silu(gate) * up` in the inputs' dtype (the gated MLP's activation)."""
    return torch.nn.functional.silu(gate) * up


def ref_write_kv(k: Tensor, v: Tensor, key: Tensor, value: Tensor, positions: Tensor, *, modulo: int | None = None,
                 sink: tuple[Tensor, Tensor, int] | None = None) -> None:
    """The static cells' write of new keys and values, in place, cast to the storage's dtype (`index_copy_` along the
    position axis): `k[:, :, slot] = key`, `v[:, :, slot] = value` at `slot = positions % modulo` (of the last `N`
    positions only when there are more: a ring keeps those), and with `sink = (sink_k, sink_v, clamp)` the same into
    the sink at `min(positions, clamp)` first (its scratch slot `clamp` takes the positions past it)."""
    if sink is not None:
        sink_k, sink_v, clamp = sink
        slots = positions.clamp(max=clamp)
        sink_k.index_copy_(2, slots, key.to(sink_k.dtype))
        sink_v.index_copy_(2, slots, value.to(sink_v.dtype))
    n = k.shape[2]
    if positions.shape[0] > n:
        key, value, positions = key[:, :, -n:], value[:, :, -n:], positions[-n:]
    slots = positions if modulo is None else positions % modulo
    k.index_copy_(2, slots, key.to(k.dtype))
    v.index_copy_(2, slots, value.to(v.dtype))
