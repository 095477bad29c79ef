"""Attention math shared by the native models and the cache engine (the pure-torch reference path).

Two entry points:

- `dense_attention`: causal attention of `q` new tokens over one contiguous key/value tensor whose last `q`
  positions are the new tokens. Used without a cache, with foreign `transformers` caches, and by cells that keep
  every position at full precision. Dispatches to SDPA with the cheapest mask that is exact.
- `segmented_attention`: one softmax over several key/value segments with their own masks, e.g. a sink, a
  decoded history, a recent window and the new tokens, in fp32, with LoopKV's read-time V precision. It takes
  decoded tensors, so it is no longer the cache's read path (cells hand their stored codes to
  `triton_ops.coded_attention`); it stays as an independent statement of the same read for tests.

`eager_attention` is `dense_attention` written out (scores, mask, softmax in fp32, weights times values) and also
returns the weights; models use it only when `output_attentions=True`, on keys and values held at full precision.

All take `key_valid` (bool `[B, T]`, True for real tokens, None when every position is real) so left-padded
batches are exact: a padded key is never attended and a padded query attends to itself only (its output is
never read by a real token).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import CausalBias, causal_lower_right

from hf_loopcache._compat import dispatch_mode_active

if TYPE_CHECKING:
    from collections.abc import Sequence

    from hf_loopcache.layout import LoopLayout

__all__ = [
    "AttentionInputs",
    "LoopAttentionCache",
    "Segment",
    "VPrecision",
    "causal_padding_mask",
    "dense_attention",
    "eager_attention",
    "fixed_shape_attention_lse",
    "segmented_attention",
]


@dataclass(frozen=True)
class AttentionInputs:
    """What every attention call of one forward pass shares.

    Args:
        key_valid (`torch.BoolTensor` of shape `[batch, total_length]`, *optional*): True where the position holds a
            real token; None when all positions are real. `total_length` covers the cached positions plus the new ones.
        scaling (`float`): softmax scale, usually `head_dim ** -0.5`.
        positions (`torch.LongTensor` of shape `[q]`, *optional*): with a static cache, the storage positions the new
            tokens are written at, on the device (the same tensor shape and address every decode step).
        static_valid (`torch.BoolTensor` of shape `[B, max_cache_len]`, *optional*): with a static cache, key validity
            over its whole storage (positions past the new tokens are masked by causality, not by this).
        static_mask (`torch.BoolTensor` of shape `[B, 1, q, max_cache_len]`, *optional*): with a static cache, the
            visibility of every storage position to the new tokens (`static_mask(positions, static_valid)`).
        length (`int`, *optional*): with a static cache, the positions it held before this forward (host side).
        source_length (`torch.LongTensor` of shape `[1]`, *optional*): with a static cache, the positions its final
            loop's cells hold, on the device (what a partial-depth draft's shared cells may read from their sources).
    """

    key_valid: torch.Tensor | None
    scaling: float
    positions: torch.Tensor | None = None
    static_valid: torch.Tensor | None = None
    static_mask: torch.Tensor | None = None
    length: int | None = None
    source_length: torch.Tensor | None = None


@runtime_checkable
class LoopAttentionCache(Protocol):
    """A cache that computes attention over its own storage (implemented by `hf_loopcache.cache.LoopCache`).

    Native models call `begin_forward` once per forward pass and then `attend` once per cell, instead of
    `update` + SDPA. This lets a cell read keys and values that are stored compressed, borrowed from another cell,
    or split across a window without materialising a plain tensor first (`triton_ops.coded_attention`).
    """

    is_loop_cache: bool

    def begin_forward(self, layout: LoopLayout, num_loops: int, query_length: int) -> None: ...

    def write_target(
        self, slot: int, batch: int, query_length: int, inputs: AttentionInputs, device: torch.device
    ) -> tuple[torch.Tensor, ...] | None: ...

    def attend(
        self,
        slot: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        inputs: AttentionInputs,
        written: bool = False,
    ) -> torch.Tensor: ...


def causal_padding_mask(
    query_positions: torch.Tensor, key_positions: torch.Tensor, key_valid: torch.Tensor | None
) -> torch.Tensor:
    """Boolean mask `[B or 1, 1, q, k]`: key `j` is visible to query `i` if it is causal and real, or if it is `i` itself.

    Args:
        query_positions (`torch.LongTensor` of shape `[q]`): absolute positions of the queries.
        key_positions (`torch.LongTensor` of shape `[k]`): absolute positions of the keys.
        key_valid (`torch.BoolTensor` of shape `[B, T]`, *optional*): validity by absolute position.
    """
    visible = key_positions[None, :] <= query_positions[:, None]
    if key_valid is not None:
        visible = visible & key_valid[:, key_positions][:, None, :]
        own = key_positions[None, :] == query_positions[:, None]
        visible = visible | own
    return visible[:, None] if visible.dim() == 3 else visible[None, None]


def _repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    if groups == 1:
        return x
    b, h, t, d = x.shape
    return x[:, :, None].expand(b, h, groups, t, d).reshape(b, h * groups, t, d)


def dense_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    key_valid: torch.Tensor | None,
    scaling: float,
    memo: dict | None = None,
) -> torch.Tensor:
    """Causal attention of the last `q` positions of `key`/`value` (the new tokens) over all of them.

    Without `key_valid` SDPA gets no mask tensor: no mask for one token, `is_causal` for a prefill, and a lower-right
    `CausalBias` for a block after cached positions (on CUDA the flash kernel). Only real padding or holes build a
    boolean mask. On CUDA, calls with cached positions never use the cuDNN backend (see `_backends_without_cudnn`).

    Args:
        query (`torch.Tensor` of shape `[B, H_q, q, D]`): queries of the new tokens.
        key (`torch.Tensor` of shape `[B, H_kv, T, D]`): keys of positions `0..T-1`; the new tokens are the last `q`.
        value (`torch.Tensor` of shape `[B, H_kv, T, D]`): values, same layout.
        key_valid (`torch.BoolTensor` of shape `[B, >=T]`, *optional*): real-token mask by position.
        scaling (`float`): softmax scale.
        memo (`dict`, *optional*): per-forward store (`ReadState.memo`): the boolean mask built from `key_valid` is
            kept there and reused by every cell of the forward with the same shape (a batch with holes would
            otherwise build it once per cell: about 10% more ops per forward, issue #16).

    Returns:
        `torch.Tensor` of shape `[B, H_q, q, D]`.
    """
    q_len, total = query.shape[2], key.shape[2]
    past = total - q_len
    if past < 0:
        raise ValueError(f"`key` holds {total} positions but `query` has {q_len} new tokens")
    groups = query.shape[1] // key.shape[1]
    mask: torch.Tensor | CausalBias | None = None
    is_causal = False
    if key_valid is None:
        if q_len > 1 and past == 0:
            is_causal = True
        elif q_len > 1 and not torch.compiler.is_compiling() and not dispatch_mode_active():
            # a block after cached positions (self-speculative verification, chunked prefill, a query piece of a
            # prefill): the causal diagonal aligned to the bottom right, with no mask tensor, so SDPA runs the kernel a
            # one-token decode step runs (flash on CUDA); a bool mask would send every such call to a masked backend
            mask = causal_lower_right(q_len, total)
        elif q_len > 1:  # traced (torch.export / torch.compile), or under a dispatch mode (a tensor subclass such as
            # `CausalBias` cannot be built there, e.g. `benchmarks.memtrack.LiveBytes`): a plain tensor mask, the same
            # math
            positions = torch.arange(total, device=query.device)
            mask = causal_padding_mask(positions[past:], positions, None)
    else:
        memo_key = f"dense-mask {q_len} {total} {query.device}"  # str keys: a cache holding its last read is a pytree
        mask = memo.get(memo_key) if memo is not None else None
        if mask is None:
            positions = torch.arange(total, device=query.device)
            # the mask lives on the model's first device; a layer on another (`device_map`) reads a copy
            mask = causal_padding_mask(positions[past:], positions, key_valid[:, :total].to(query.device))
            if memo is not None:
                memo[memo_key] = mask
    key, value = _repeat_kv(key, groups), _repeat_kv(value, groups)
    if past > 0 and query.is_cuda and not torch.compiler.is_compiling() and torch.backends.cuda.cudnn_sdp_enabled():
        with sdpa_kernel(_backends_without_cudnn()):
            return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, is_causal=is_causal, scale=scaling)
    return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, is_causal=is_causal, scale=scaling)


def fixed_shape_attention_lse(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, bias: torch.Tensor, *, scaling: float
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """cuDNN's SDPA of `query` `[B, H, q, D]` over `key` / `value` `[B, H, L, D]` with an additive `bias`
    `[B, 1, q, L]` (-inf: not read), and its natural-log log-sum-exp `[B, H, q]` (-inf, with a zero output, for a row
    that reads nothing), for a merge with attention over other keys (`coded_attention`'s `prior`). For a static cache's
    storage, whose shapes and addresses do not change between calls: cuDNN builds its execution graph once per shape
    (see `_backends_without_cudnn`), and a CUDA graph replays it. None where it cannot run (not CUDA, cuDNN's SDPA off
    or absent, another dtype than fp16 / bf16, GQA)."""
    if not fixed_shape_attention_takes(query, key):
        return None
    out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(query, key, value, bias, True, scale=scaling)[:2]
    return out, lse.reshape(query.shape[:3])


def fixed_shape_attention_takes(query: torch.Tensor, key: torch.Tensor) -> bool:
    """Whether `fixed_shape_attention_lse` runs for these tensors (a caller checks before it builds the bias)."""
    return (
        hasattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention")
        and query.is_cuda
        and query.dtype in (torch.float16, torch.bfloat16)
        and query.shape[1] == key.shape[1]
        and torch.backends.cuda.cudnn_sdp_enabled()
    )


def _backends_without_cudnn() -> list[SDPBackend]:
    """The SDPA backends the caller has enabled, cuDNN left out.

    Calls with cached positions (a decode step, a draft, a verification block) leave cuDNN out: PyTorch prefers it on
    Hopper and Blackwell (CUDA 13 builds), and it builds an execution graph for every new key length, mask shape and
    stride, so a decoder, whose key length grows by one per call, rebuilds a graph in every forward (tens to
    hundreds of milliseconds) and a verification with its mask never finds one. Flash (no mask) and memory-efficient
    attention (a mask) take any length. A prefill keeps every backend."""
    cuda = torch.backends.cuda
    enabled = [
        (SDPBackend.FLASH_ATTENTION, cuda.flash_sdp_enabled()),
        (SDPBackend.EFFICIENT_ATTENTION, cuda.mem_efficient_sdp_enabled()),
        (SDPBackend.MATH, cuda.math_sdp_enabled()),
    ]
    return [backend for backend, on in enabled if on] or [SDPBackend.CUDNN_ATTENTION]


def eager_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    key_valid: torch.Tensor | None,
    scaling: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`dense_attention` computed step by step (softmax in fp32, or fp64 for fp64 inputs), with its weights.

    Args: as `dense_attention`.

    Returns:
        `(output, weights)`: `[B, H_q, q, D]` and `[B, H_q, q, T]`, both in the dtype of `query`; masked positions
        have weight exactly 0 and the output is `weights @ value` (so gradients reach the weights).
    """
    q_len, total = query.shape[2], key.shape[2]
    past = total - q_len
    if past < 0:
        raise ValueError(f"`key` holds {total} positions but `query` has {q_len} new tokens")
    acc = torch.promote_types(query.dtype, torch.float32)
    groups = query.shape[1] // key.shape[1]
    key, value = _repeat_kv(key, groups), _repeat_kv(value, groups)
    scores = torch.matmul(query.to(acc), key.to(acc).transpose(-1, -2)) * scaling
    positions = torch.arange(total, device=query.device)
    valid = key_valid[:, :total].to(query.device) if key_valid is not None else None
    mask = causal_padding_mask(positions[past:], positions, valid)
    weights = torch.softmax(scores.masked_fill(~mask, -math.inf), dim=-1)
    return torch.matmul(weights, value.to(acc)).to(query.dtype), weights.to(query.dtype)


@dataclass
class VPrecision:
    """LoopKV read-time value precision (paper Sec. 3.3).

    A history token is *cold* for a query row when its score is below the running maximum minus `tau * ln 2`; the
    running maximum is seeded with the largest sink score and updated page by page in position order. Cold tokens
    read only the high 2-bit plane of their INT4 value code and decode to the bucket midpoint.

    `blocks`: whether the rule also applies to forwards of more than one new token. True: per query row, in every such
    forward (verification blocks of self-speculative decoding, teacher-forced replay in blocks), so a block reads what
    token-by-token decoding reads. False: such forwards read both planes of every history token (plain INT4; V
    precision stays on one-token forwards: decoding and drafts). None (the default): True, except in the forwards of
    a self-speculative decode (`LoopCache.speculating`), whose blocks read both planes. A token read hot that the rule
    would leave cold costs bytes, never precision (LoopKV Sec. 3.3), so every row of a block read at both planes reads
    at least its own hot set at full precision, and on the GPU the block runs the plain INT4 kernel, which is faster
    than V precision's (README, "Self-speculative decoding"); self-speculation over LoopKV is approximate either way
    (its pages are coded by storage position, so a page may hold holes).
    """

    tau: float = 14.0
    page_size: int = 32  # pages of the running maximum in `segmented_attention`; the cache uses its code pages
    blocks: bool | None = None

    def __post_init__(self) -> None:
        if self.blocks is not None and not isinstance(self.blocks, bool):
            raise TypeError(f"`VPrecision.blocks` must be True, False or None, got {self.blocks!r}")

    def in_blocks(self, speculating: bool) -> bool:
        """Whether forwards of several new tokens apply the rule, in a self-speculative decode (`speculating`) or
        not."""
        return (not speculating) if self.blocks is None else self.blocks

    @property
    def margin(self) -> float:
        return self.tau * math.log(2.0)


@dataclass
class Segment:
    """One stretch of keys and values for `segmented_attention`.

    Args:
        keys (`torch.Tensor` of shape `[B, H_kv, L, D]`).
        values (`torch.Tensor` of shape `[B, H_kv, L, D]`): the values a hot token reads.
        mask (`torch.BoolTensor` broadcastable to `[B, 1, q, L]`, *optional*): visibility; None = all visible.
        is_sink (`bool`): its scores seed the V-precision running maximum.
        cold_delta (`torch.Tensor` of shape `[B, H_kv, L, D]`, *optional*): value of a cold token minus its hot
            value (INT4 history read with V precision). Only segments with it take part in the cold test.
    """

    keys: torch.Tensor
    values: torch.Tensor
    mask: torch.Tensor | None = None
    is_sink: bool = False
    cold_delta: torch.Tensor | None = None


def _running_page_max(scores: torch.Tensor, seed: torch.Tensor, page_size: int) -> torch.Tensor:
    """For each token, max(seed, max score of all pages up to and including the token's page). scores [..., L]."""
    length = scores.shape[-1]
    pages = math.ceil(length / page_size)
    padded = F.pad(scores, (0, pages * page_size - length), value=-math.inf)
    page_max = padded.unflatten(-1, (pages, page_size)).amax(-1)
    running = torch.maximum(torch.cummax(page_max, dim=-1).values, seed[..., None])
    return running.repeat_interleave(page_size, dim=-1)[..., :length]


def segmented_attention(
    query: torch.Tensor,
    segments: Sequence[Segment],
    *,
    scaling: float,
    v_precision: VPrecision | None = None,
    stats: dict[str, float] | None = None,
) -> torch.Tensor:
    """One softmax over several key/value segments, in fp32 (fp64 for fp64 inputs).

    Args:
        query (`torch.Tensor` of shape `[B, H_q, q, D]`).
        segments (`Sequence[Segment]`): the key/value stretches; every query must see at least one key.
        scaling (`float`): softmax scale.
        v_precision (`VPrecision`, *optional*): apply LoopKV's cold-token rule to segments with `cold_delta`.
        stats (`dict`, *optional*): if given, `cold` and `history` token-read counts are accumulated into it.

    Returns:
        `torch.Tensor` of shape `[B, H_q, q, D]` in the dtype of `query`.
    """
    b, hq, q_len, d = query.shape
    hkv = segments[0].keys.shape[1]
    groups = hq // hkv
    acc = torch.promote_types(query.dtype, torch.float32)  # fp32, or fp64 for fp64 models
    q32 = query.to(acc).reshape(b, hkv, groups * q_len, d)
    scores = []
    for seg in segments:
        s = torch.matmul(q32, seg.keys.to(acc).transpose(-1, -2)) * scaling  # [B, Hkv, G*q, L]
        if seg.mask is not None:
            m = seg.mask
            m = m.expand(m.shape[0], 1, q_len, m.shape[-1])  # [B|1, 1, q, L]
            m = (
                m[:, :, None]
                .expand(m.shape[0], 1, groups, q_len, m.shape[-1])
                .reshape(m.shape[0], 1, groups * q_len, -1)
            )
            s = s.masked_fill(~m, -math.inf)
        scores.append(s)
    row_max = torch.stack([s.amax(-1) for s in scores], dim=-1).amax(-1)  # [B, Hkv, G*q]
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))

    seed = None
    if v_precision is not None:
        sink_scores = [s for s, seg in zip(scores, segments) if seg.is_sink and s.shape[-1] > 0]
        seed = (
            torch.stack([s.amax(-1) for s in sink_scores], -1).amax(-1)
            if sink_scores
            else torch.full_like(row_max, -math.inf)
        )

    denom = torch.zeros_like(row_max)
    out = torch.zeros(b, hkv, groups * q_len, d, dtype=acc, device=query.device)
    for s, seg in zip(scores, segments):
        if s.shape[-1] == 0:
            continue
        p = torch.exp(s - row_max[..., None])
        denom = denom + p.sum(-1)
        out = out + torch.matmul(p, seg.values.to(acc))
        if v_precision is not None and seg.cold_delta is not None:
            running = _running_page_max(s, seed, v_precision.page_size)  # type: ignore[arg-type]
            cold = (s < running - v_precision.margin) & torch.isfinite(s)
            out = out + torch.matmul(p * cold, seg.cold_delta.to(acc))
            if stats is not None:
                stats["cold"] = stats.get("cold", 0.0) + float(cold.sum())
                stats["history"] = stats.get("history", 0.0) + float(torch.isfinite(s).sum())
    out = out / denom[..., None]
    return out.reshape(b, hq, q_len, d).to(query.dtype)
