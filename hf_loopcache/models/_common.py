"""Pieces both native looped models share: the norm, positions and masks, cell-addressed attention, generate glue."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn
from transformers.cache_utils import Cache
from transformers.generation import GenerationMixin, LogitsProcessor, LogitsProcessorList

from hf_loopcache._compat import (
    CACHE_KWARG,
    OUTPUT_CACHE_FIELD,
    decode_step_inputs,
    deferred_stop_check,
    generate_cache,
    generate_cache_kwargs,
)
from hf_loopcache.attention import AttentionInputs, LoopAttentionCache, dense_attention, eager_attention
from triton_ops import fused, gemv
from triton_ops._dispatch import no_pdl

if TYPE_CHECKING:
    from hf_loopcache.layout import LoopLayout

__all__ = [
    "MIN_QUERY_PIECE",
    "TOKEN_CHUNK",
    "one_piece",
    "LoopForward",
    "LoopGenerationMixin",
    "OutputFlags",
    "RMSNorm",
    "STACK_TOKENS",
    "attention_half",
    "by_token_chunks",
    "check_num_loops",
    "check_prefill_rows",
    "default_cache",
    "linear",
    "rope_span",
    "row_groups",
    "row_slice",
    "run_row_groups",
    "sandwich_layer",
    "silu_linear",
    "stacked_linear",
    "stacked_projection",
    "stacked_rope_projection",
]


class RMSNorm(nn.Module):
    """RMS norm computed in fp32, cast back, then scaled (the math of both official codes; no +1 offset)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(
        self, x: torch.Tensor, *, add_before: torch.Tensor | None = None, add_after: torch.Tensor | None = None
    ) -> torch.Tensor:
        """`add_after + norm(x + add_before)`: a layer's residual folded into the norm's one kernel on CUDA
        (`triton_ops.fused.rms_norm`; the eager math op for op elsewhere)."""
        return fused.rms_norm(x, self.weight, self.eps, add_before=add_before, add_after=add_after)

    def then(
        self,
        x: torch.Tensor,
        after: RMSNorm,
        *,
        add_before: torch.Tensor | None = None,
        add_after: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`(h, after(h))` with `h = self(x, add_before=add_before, add_after=add_after)`: both norms in one kernel on
        CUDA (`triton_ops.fused.rms_norm_pair`; the two eager norms elsewhere, bit for bit)."""
        return fused.rms_norm_pair(
            x, self.weight, self.eps, after.weight, after.eps, add_before=add_before, add_after=add_after
        )

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"


TOKEN_CHUNK = 4096
"""Tokens (rows x positions) per piece of a forward of more tokens than this: the token-wise half of a layer (norm,
MLP, norm, residual; `by_token_chunks`) and the queries of a prefill's attention half (`attention_half`)."""


def one_piece(batch: int, length: int) -> bool:
    """Whether a layer call over `batch x length` new tokens runs in one piece: `by_token_chunks` and `attention_half`
    take none (decode steps, short prompts, blocks); read at call time, as those read `TOKEN_CHUNK`."""
    return batch * length <= TOKEN_CHUNK


MIN_QUERY_PIECE = 64
"""Fewest positions per query piece of `attention_half` (a batch of more than `TOKEN_CHUNK / 64` rows takes pieces of
64 positions of every row rather than ever shorter ones)."""


def by_token_chunks(fn: Any, *xs: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """`fn(*xs)` for an `fn` that acts on each token alone (`[B, T, ...]` in, `[B, T, ...]` out), computed
    `TOKEN_CHUNK` tokens at a time into one output. A long prefill then holds one piece's intermediates instead of the
    whole prompt's (the MLP's `3 x intermediate` per token: 11 hidden states of every prompt token on Ouro-1.4B, 96 MiB
    per 8K row in bf16 of each); the math of every token is unchanged. The pieces depend on the shape only (never on
    free memory); a decode step (fewer tokens) is one piece.

    `out` (`[B, T, ...]`, *optional*): the tensor the pieces are written into, which may be an input (each piece is
    computed before it is written): the caller's own temporary, so the token-wise half holds no second copy of it. It
    is used only when pieces are taken and no gradient flows through it (an in-place write would break autograd)."""
    x = xs[0]
    b, t = x.shape[:2]
    chunk = TOKEN_CHUNK
    if b * t <= chunk:
        return fn(*xs)
    flats = [y.reshape(b * t, *y.shape[2:]) for y in xs]
    if out is not None and (torch.is_grad_enabled() and out.requires_grad or not out.is_contiguous()):
        out = None
    flat_out = None if out is None else out.view(b * t, *out.shape[2:])
    for a in range(0, b * t, chunk):
        piece = fn(*(y[a : a + chunk][None] for y in flats))[0]
        if flat_out is None or (a == 0 and (piece.dtype, piece.shape[1:]) != (flat_out.dtype, flat_out.shape[1:])):
            flat_out = piece.new_empty((b * t, *piece.shape[1:]))  # (an `out` of another dtype is not used)
        flat_out[a : a + chunk] = piece
        del piece
    return cast("torch.Tensor", flat_out).view(b, t, *flat_out.shape[1:])  # type: ignore[union-attr]


def attention_half(
    state: LoopForward,
    slot: int,
    x: torch.Tensor,
    project: Any,
    finish: Any,
) -> torch.Tensor:
    """The attention half of a layer call, `finish(attention(project(x)), x)`, over query pieces in a long prefill.

    Args:
        state (`LoopForward`): the forward's state (`state.query_piece` decides whether pieces are taken).
        slot (`int`): the cell the layer call writes.
        x (`torch.Tensor` of shape `[B, T, hidden]`): the layer's input.
        project: `project(x_piece, start, end, kv_out) -> (q, k, v, written)`: the queries `[B, H_q, p, D]`, keys
            and values `[B, H_kv, p, D]` of positions `[start, end)` of the new tokens (norm, projections and RoPE),
            and whether the projection also stored the keys and values where `kv_out` (the cell's
            `LoopForward.write_target`, or None) said.
        finish: `finish(o, x_piece) -> [B, p, hidden]`: the output projection of the heads' outputs `o` `[B, p, H_q *
            D]`, and the norm and residual with the layer's input.

    In one call (a decode step, a short prompt, a block after cached positions) this is the plain composition. In a
    long prefill (`LoopForward.query_piece`) the queries run `p` positions of every row at a time (about `TOKEN_CHUNK`
    tokens): each piece's keys and values are written into the whole prompt's (which the cell needs once: every loop
    computes its own for the whole prompt), its queries attend over the keys up to its end, and its output projection,
    norm and residual are written into the output. So the layer call holds the input, the output, and the prompt's
    keys and values for every row, plus one piece's temporaries (normed input, q, RoPE, attention output, projection)
    that do not grow with the batch; before, all of these were held for every row at once (7 hidden states per token
    on Ouro-1.4B's shape, 224 MiB per 8K row). The last piece goes through the cell (`LoopForward.attend`), which
    stores every new key and value, as a one-call prefill stores them. The attention of every query is the same
    causal attention over the same keys, so the result is the one-call result up to the kernels' summation order.
    """
    b, t = x.shape[:2]
    span = state.query_piece(slot, b, t)
    if span is None:
        q, k, v, written = project(x, 0, t, state.write_target(slot, b, t, x.device))
        o = state.attend(slot, q, k, v, written=written)
        del q, k, v
        o = o.transpose(1, 2).reshape(b, t, -1)
        return finish(o, x)
    keys = values = out = None
    for a in range(0, t, span):
        e = min(a + span, t)
        q, k, v, _ = project(x[:, a:e], a, e, None)
        if keys is None or values is None:
            keys = k.new_empty(b, k.shape[1], t, k.shape[3])
            values = v.new_empty(b, v.shape[1], t, v.shape[3])
        keys[:, :, a:e] = k
        values[:, :, a:e] = v
        del k, v
        if e < t:  # the keys up to the piece's end, at full precision, as a one-call prefill reads them
            inputs = state.inputs
            o = dense_attention(q, keys[:, :, :e], values[:, :, :e], key_valid=inputs.key_valid, scaling=inputs.scaling)
        else:  # the cell stores the prompt's keys and values and attends the last piece over them
            o = state.attend(slot, q, keys, values)
        del q
        o = o.transpose(1, 2).reshape(b, e - a, -1)
        piece = finish(o, x[:, a:e])
        del o
        if out is None:
            out = piece.new_empty(b, t, *piece.shape[2:])
        out[:, a:e] = piece
        del piece
    return cast("torch.Tensor", out)


def sandwich_layer(
    state: LoopForward,
    slot: int,
    x: torch.Tensor,
    rope: tuple[torch.Tensor, ...],
    *,
    project: Any,
    out_proj: nn.Module,
    mlp: Any,
    norms: tuple[RMSNorm, RMSNorm, RMSNorm, RMSNorm],
    residual: str,
    next_norm: RMSNorm | None = None,
) -> torch.Tensor:
    """A "sandwich" layer call of both native models: `h = x (+) norm_2(out_proj(attn(norm_1(x))))`, then
    `out = h (+) norm_4(mlp(norm_3(h)))`, where `(+)` adds the residual before the norm (`residual="before"`,
    Huginn's blocks: `norm(a + r)`) or after it (`"after"`, Ouro's layers: `r + norm(a)`).

    With an input of one piece (`one_piece`: decode steps, short inputs) each residual norm runs as one kernel with the
    norm that reads its output (`RMSNorm.then`: `norm_2` with `norm_3`, and `norm_4` with `next_norm`, whose output is
    left in `state` for its reader: `LoopForward.pass_normed`); `norm_1` takes what the previous call left for `x`
    (`LoopForward.take_normed`). A longer input runs the attention half over query pieces (`attention_half`) and the
    MLP half by token chunks, each norm on its own.

    Args:
        project: `project(normed, cos, sin, kv_out) -> (q, k, v, written)` of the layer's attention (norm applied by
            the caller; `kv_out` and `written` as in `attention_half`).
        out_proj (`nn.Module`): the attention's output projection (run through `linear`).
        mlp: the MLP (normed input -> output).
        norms: `(norm_1, norm_2, norm_3, norm_4)` in the order the layer runs them.
        residual (`str`): `"before"` or `"after"`.
        next_norm (`RMSNorm`, *optional*): the norm that reads this call's output (the next layer's `norm_1`, the model
            norm after the last), chained when the input is of one piece.
    """
    norm_1, norm_2, norm_3, norm_4 = norms
    key = {"before": "add_before", "after": "add_after"}[residual]

    def project_piece(piece: torch.Tensor, a: int, e: int, kv_out: Any) -> tuple[torch.Tensor, ...]:
        normed = state.take_normed(piece)
        return project(norm_1(piece) if normed is None else normed, *rope_span(rope, a, e), kv_out)

    b, t = x.shape[:2]
    if one_piece(b, t):
        h, normed = attention_half(
            state, slot, x, project_piece, lambda o, piece: norm_2.then(linear(out_proj, o), norm_3, **{key: piece})
        )
        if next_norm is not None:
            return state.pass_normed(*norm_4.then(mlp(normed), next_norm, **{key: h}))
        return norm_4(mlp(normed), **{key: h})
    h = attention_half(state, slot, x, project_piece, lambda o, piece: norm_2(linear(out_proj, o), **{key: piece}))
    return by_token_chunks(lambda t: norm_4(mlp(norm_3(t)), **{key: t}), h, out=h)


def rope_span(rope: tuple[torch.Tensor, ...], start: int, end: int) -> tuple[torch.Tensor, ...]:
    """The RoPE tables (`[B, q, ...]` each) of new positions `[start, end)`: views, or the tables themselves when the
    span is all of them (a decode step slices nothing)."""
    if start == 0 and end == rope[0].shape[1]:
        return rope
    return tuple(t[:, start:end] for t in rope)


STACK_TOKENS = 256
"""Most tokens (rows x positions) of an input that `stacked_linear` runs as one GEMM (decode steps, verification
blocks); a longer input (a prefill) runs the projections one by one."""


def _stackable(owner: nn.Module, linears: list[nn.Linear], x: torch.Tensor) -> bool:
    if x.numel() > STACK_TOKENS * x.shape[-1] or torch.compiler.is_compiling():
        return False
    for module in (owner, *linears):
        if module._forward_hooks or module._forward_pre_hooks:  # e.g. accelerate's device and offload hooks
            return False
    for lin in linears:
        w = lin.weight
        if type(lin) is not nn.Linear or lin.bias is not None or w.device != x.device or w.is_meta:
            return False
        if w.requires_grad and torch.is_grad_enabled():  # the stacked buffer is no leaf: gradients stay per weight
            return False
    return len({lin.weight.dtype for lin in linears}) == 1


def _stacked_weight(owner: nn.Module, names: tuple[str, ...], x: torch.Tensor) -> tuple[torch.Tensor, bool] | None:
    """The buffer holding `owner.<name>.weight` for every name, stacked (built on first use, see `stacked_linear`),
    and whether it was built by this call; None when the input is not short or the projections cannot be stacked."""
    linears = [getattr(owner, name) for name in names]
    if not _stackable(owner, linears, x):
        return None
    cached = owner.__dict__.get("_stacked_weights", {}).get(names)
    if cached is not None and cached[1] == [lin.weight.data_ptr() for lin in linears]:
        return cached[0], False
    with torch.no_grad():
        buffer = torch.cat([lin.weight.detach() for lin in linears])
        for lin, part in zip(linears, buffer.split([lin.out_features for lin in linears])):
            lin.weight.data = part
    owner.__dict__.setdefault("_stacked_weights", {})[names] = (buffer, [lin.weight.data_ptr() for lin in linears])
    return buffer, True


def stacked_projection(owner: nn.Module, names: tuple[str, ...], x: torch.Tensor) -> torch.Tensor | None:
    """`torch.cat([owner.<name>(x) for name in names], -1)` as one GEMM over the weights stacked in one buffer, or None
    when the input is not short or the projections cannot be stacked (see `stacked_linear`)."""
    found = _stacked_weight(owner, names, x)
    if found is None:
        return None
    # (a buffer built just now was written by the kernel before: no weight read before waiting for it)
    with no_pdl() if found[1] else contextlib.nullcontext():
        return gemv.linear(x, found[0])


def stacked_rope_projection(
    owner: nn.Module,
    names: tuple[str, ...],
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    rotated: int,
    kv_out: tuple[torch.Tensor, ...] | None = None,
) -> tuple[torch.Tensor, bool, bool] | None:
    """`stacked_projection` of a q/k/v projection whose first `rotated` output features (queries and keys, heads of
    `cos.shape[-1]` channels) take rotate-half RoPE: `(y, True, stored)` with them rotated in the GEMV kernel
    (`triton_ops.gemv.linear_rope`, the same bits as `fused.rotate_half` after the projection), `stored` whether that
    kernel also stored the keys and values at `kv_out` (with `GEMV_TUNING["fuse_kv"]`); `(y, False, False)` with them
    not rotated where that kernel is not launched (the caller rotates them); None where `stacked_projection` gives
    None."""
    found = _stacked_weight(owner, names, x)
    if found is None:
        return None
    with no_pdl() if found[1] else contextlib.nullcontext():
        kv_out = kv_out if gemv.GEMV_TUNING["fuse_kv"] else None
        y = gemv.linear_rope(x, found[0], cos, sin, rotated, kv_out=kv_out)
        return (y, True, kv_out is not None) if y is not None else (gemv.linear(x, found[0]), False, False)


def stacked_linear(owner: nn.Module, names: tuple[str, ...], x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """`owner.<name>(x)` for each name, as one GEMM over the weights stacked in one buffer when the input is short (a
    decode step reads every weight once either way; three small GEMMs cost three launches and reach a fraction of the
    bandwidth one larger GEMM reaches: H200, Ouro-1.4B's shape, batch 1). The stacked buffer is not a copy: the
    first stacked call moves the weights into one buffer and points each `weight` at its slice (same values, same
    `Parameter` objects, same state dict); a weight replaced afterwards (`load_state_dict(assign=True)`, `.to()`) is
    seen by its address and the buffer is rebuilt. Falls back to the projections one by one for long inputs,
    gradients, hooks (accelerate's device maps and offload), `torch.compile` tracing, or anything but plain bias-free
    `nn.Linear`s."""
    y = stacked_projection(owner, names, x)
    if y is None:
        return tuple(getattr(owner, name)(x) for name in names)
    return y.split([getattr(owner, name).out_features for name in names], dim=-1)


def _plain_linear(module: nn.Module) -> bool:
    """Whether `module` is a plain `nn.Linear` that the projection kernels may take: no hooks (accelerate's device maps
    and offload), no replaced forward, no `torch.compile` tracing (anything else is called as it is)."""
    return (
        type(module) is nn.Linear
        and not module._forward_hooks
        and not module._forward_pre_hooks
        and "forward" not in module.__dict__
        and not torch.compiler.is_compiling()
    )


def silu_linear(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`module(silu(gate) * up)` of `x = [gate | up]` `[..., 2K]` (a gated MLP's stacked gate/up output): a plain
    `nn.Linear` without hooks goes through `triton_ops.gemv.silu_linear` (one kernel reading the activation as its
    input where the projection takes the GEMV kernel, else `fused.silu_mul` then `linear`); anything else is called on
    `fused.silu_mul` of the two halves."""
    if not _plain_linear(module):
        k = x.shape[-1] // 2
        return module(fused.silu_mul(x[..., :k], x[..., k:]))
    return gemv.silu_linear(x, module.weight, module.bias)


def linear(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`module(x)` for a projection of the models: a plain `nn.Linear` without hooks goes through
    `triton_ops.gemv.linear` (the skinny-GEMM kernel for decode-sized CUDA inputs when `GEMV_TUNING["enabled"]`,
    `F.linear` otherwise); anything else (hooks, accelerate's wrapped forwards, quantized or other subclasses) is
    called as it is."""
    if not _plain_linear(module):
        return module(x)
    return gemv.linear(x, module.weight, module.bias)


def check_num_loops(value: Any, name: str) -> int:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = int(value.item())
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"`{name}` must be a positive int, got {value!r}")
    return value


@dataclass
class LoopForward:
    """Per-forward state: the cache, the masks and positions, and cell-addressed attention.

    `attend(slot, q, k, v)` is the one attention entry point of both models. With a `LoopAttentionCache` the cache
    computes attention over its own storage; with any other `transformers.Cache` the keys and values go through
    `update(k, v, flat_index)` and plain causal attention; without a cache, plain causal attention.

    With `output_attentions`, every call computes its output with `eager_attention` and appends the softmax weights
    `[B, H_q, q, T]` to `attentions`, from keys and values at full precision (the new ones, a foreign cache's, or a
    loop cache cell's `cell_states` after its write); a loop-cache cell not stored at full precision raises.
    """

    cache: Any
    inputs: AttentionInputs
    layout: LoopLayout
    attentions: list[torch.Tensor] | None = None
    #: `(out, norm(out))` a layer call left for the norm that reads its output (`pass_normed` / `take_normed`)
    normed: tuple[torch.Tensor, torch.Tensor] | None = None

    def pass_normed(self, out: torch.Tensor, normed: torch.Tensor) -> torch.Tensor:
        """Keep `normed` (the next norm of `out`, computed with `out` in one kernel) for the reader of `out`; returns
        `out`."""
        self.normed = (out, normed)
        return out

    def take_normed(self, x: torch.Tensor) -> torch.Tensor | None:
        """The normed `x` a `pass_normed` left, if it was left for this very tensor (a forward hook that replaced the
        output gets None: its norm is computed anew); released either way."""
        kept, self.normed = self.normed, None
        return kept[1] if kept is not None and kept[0] is x else None

    @classmethod
    def begin(
        cls,
        *,
        layout: LoopLayout,
        num_loops: int,
        cache: Any,
        attention_mask: torch.Tensor | None,
        position_ids: torch.Tensor | None,
        batch_size: int,
        query_length: int,
        device: torch.device,
        scaling: float,
        output_attentions: bool = False,
        keep_mask: bool = False,
    ) -> tuple[LoopForward, torch.Tensor]:
        """Validate the cache, derive key validity and positions. Returns the state and `position_ids` `[B, q]`.

        An `attention_mask` without padding is dropped (attention takes its unmasked path) unless `keep_mask` (a group
        of a prefill in row groups whose batch has padding in another group: each row computes as in the batch)."""
        if query_length < 1:
            raise ValueError(
                "the input is empty (0 tokens): `input_ids` / `inputs_embeds` must hold at least one token; for a "
                "prompt that is only a start token, pass the tokenizer's bos token (e.g. `tokenizer.bos_token + text`)"
            )
        if cache is not None and not isinstance(cache, Cache):
            raise TypeError(
                f"the cache must be a `transformers.Cache` (e.g. `hf_loopcache.FullLoopCache(model)`), "
                f"got {type(cache).__name__}"
            )
        if getattr(cache, "is_loop_cache", False):  # a LoopAttentionCache
            cast("LoopAttentionCache", cache).begin_forward(layout, num_loops, query_length)
        elif cache is not None:
            _check_foreign_cache(cache, layout.with_loops(num_loops))
        if getattr(cache, "static", False):  # device-side positions and masks: a step with fixed shapes and addresses
            if output_attentions:
                raise ValueError("`output_attentions=True` is not supported with a static cache; pass `static=False`")
            inputs, position_ids = cache.static_inputs(
                attention_mask,
                position_ids,
                batch_size=batch_size,
                query_length=query_length,
                device=device,
                scaling=scaling,
                keep_mask=keep_mask,
            )
            return cls(cache, inputs, layout, None), position_ids
        past = cache.get_seq_length() if cache is not None else 0

        key_valid = None
        if attention_mask is not None:
            if attention_mask.dim() != 2:
                raise ValueError(
                    f"`attention_mask` must be a 2-D padding mask [batch, past + new tokens], got shape "
                    f"{tuple(attention_mask.shape)}"
                )
            if attention_mask.shape[1] < past + query_length:
                raise ValueError(
                    f"`attention_mask` has {attention_mask.shape[1]} positions but the cache holds {past} and the "
                    f"input adds {query_length}; it must cover all of them"
                )
            attention_mask = attention_mask[:, : past + query_length].to(device)
            # an all-ones mask is dropped so attention takes its unmasked fast path; a traced forward (torch.export,
            # torch.compile) keeps the mask instead, since the test reads tensor data (the result is the same)
            if keep_mask or torch.compiler.is_compiling() or not bool(attention_mask.all()):
                key_valid = attention_mask.bool()
        if position_ids is None:
            if key_valid is not None:
                position_ids = (key_valid.long().cumsum(-1) - 1).clamp(min=0)[:, past:]
            else:
                position_ids = torch.arange(past, past + query_length, device=device)[None].expand(batch_size, -1)
        elif position_ids.dim() == 1:
            position_ids = position_ids[None].expand(batch_size, -1)
        inputs = AttentionInputs(key_valid=key_valid, scaling=scaling)
        return cls(cache, inputs, layout, [] if output_attentions else None), position_ids

    def query_piece(self, slot: int, batch: int, length: int) -> int | None:
        """Positions per query piece of `attention_half` for `length` new tokens in `batch` rows written into cell
        `slot`, or None for one call.

        Pieces are taken when the forward has more tokens than `TOKEN_CHUNK` and every key a query reads is a new one
        at full precision: no cache, or a growable loop cache whose cell is empty (a prefill; a cell's attention over
        nothing cached is causal attention over the new keys and values), without attention maps, gradients or
        tracing. A piece is `TOKEN_CHUNK // batch` positions (at least `MIN_QUERY_PIECE`): a function of the shape
        only, never of free memory. Decode steps, short prompts and blocks after cached positions are one call."""
        if batch * length <= TOKEN_CHUNK or self.attentions is not None or torch.is_grad_enabled():
            return None
        span = max(MIN_QUERY_PIECE, TOKEN_CHUNK // batch)
        if length <= span or torch.compiler.is_compiling():
            return None
        cache = self.cache
        if cache is not None and (
            not getattr(cache, "is_loop_cache", False)
            or getattr(cache, "static", False)
            or cache.get_seq_length(self.layout.slot_to_flat(slot)) != 0
        ):
            return None
        return span

    def write_target(self, slot: int, batch: int, query_length: int, device: torch.device) -> Any:
        """Where cell `slot` stores this forward's new keys and values when a projection kernel can store them itself
        (`LoopCache.write_target`: a static dense cell in a one-token step), else None (no loop cache, attention
        weights asked for, or another cell or step)."""
        target = getattr(self.cache, "write_target", None) if getattr(self.cache, "is_loop_cache", False) else None
        if target is None or self.attentions is not None:
            return None
        return target(slot, batch, query_length, self.inputs, device)

    def attend(
        self, slot: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, written: bool = False
    ) -> torch.Tensor:
        """Attention of the new tokens' queries over cell `slot`'s stored keys and the new keys and values (which the
        cell stores, unless the projection already stored them where `write_target` said: `written`). `query`
        `[B, H_q, p, D]`, `key` / `value` `[B, H_kv, q, D]`; `p < q` only in a prefill into an empty cell (the last
        query piece of `attention_half`: the queries of the last `p` new tokens)."""
        if self.cache is None:
            if self.attentions is not None:
                return self._eager(query, key, value)
            return dense_attention(query, key, value, key_valid=self.inputs.key_valid, scaling=self.inputs.scaling)
        if getattr(self.cache, "is_loop_cache", False):
            # (`written` only when set: a loop cache without `write_target` never sees it)
            out = self.cache.attend(slot, query, key, value, self.inputs, **({"written": True} if written else {}))
            if self.attentions is not None:
                return self._eager(query, *_full_precision_states(self.cache, slot))
            return out
        key, value = self.cache.update(key, value, self.layout.slot_to_flat(slot))
        if self.attentions is not None:
            return self._eager(query, key, value)
        return dense_attention(query, key, value, key_valid=self.inputs.key_valid, scaling=self.inputs.scaling)

    def _eager(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        out, weights = eager_attention(query, key, value, key_valid=self.inputs.key_valid, scaling=self.inputs.scaling)
        cast("list", self.attentions).append(weights)
        return out


def check_prefill_rows(value: Any, labels: Any = None) -> int | None:
    """`prefill_rows` as given: None, or a positive int; anything else raises naming the allowed values, and so does
    a grouped forward with `labels` (a loss over the batch is computed in one forward)."""
    if value is None:
        return None
    if labels is not None:
        raise ValueError(
            "`prefill_rows` runs a prefill in groups of rows; a loss over the batch (`labels`) is computed in one "
            "forward: pass `prefill_rows=None`"
        )
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = int(value.item())
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(
            f"`prefill_rows` must be None (the whole batch in one forward) or a positive int (rows per group of a "
            f"prefill), got {value!r}"
        )
    return value


def row_slice(t: Any, start: int, end: int) -> Any:
    """Rows `[start, end)` of a batched forward argument (a tensor of two or more dims); anything else as it is."""
    return t[start:end] if isinstance(t, torch.Tensor) and t.dim() >= 2 else t


def row_groups(prefill_rows: Any, cache: Any, batch: int, query_length: int) -> list[tuple[int, int]] | None:
    """The groups of rows `[(start, end), ...]` that a forward of `batch` rows and `query_length` new tokens runs one
    after the other with `prefill_rows`, or None when it runs in one call.

    Groups are taken for a prefill (more than one new token) into an empty `LoopCache`, or without a cache, when the
    batch has more rows than `prefill_rows`; a forward after cached positions (decode steps, verification blocks, a
    continued prompt) runs in one call. A cache other than a `LoopCache` raises: its rows cannot be written by
    group."""
    rows = check_prefill_rows(prefill_rows)
    if rows is None or batch <= rows or query_length < 2:
        return None
    if cache is not None:
        if not getattr(cache, "is_loop_cache", False):
            raise ValueError(
                f"`prefill_rows` writes a prefill's rows group by group into an hf_loopcache `LoopCache` (FullLoopCache, "
                f"RIPECache, DeepestPlaneCache, LoopKVCache), got {type(cache).__name__}; pass `prefill_rows=None`"
            )
        if cache.get_seq_length() != 0:
            return None
    return [(a, min(a + rows, batch)) for a in range(0, batch, rows)]


def _put_rows(whole: Any, part: Any, start: int, end: int, batch: int) -> Any:
    """An output field of the batch (`whole`, None before the first group) with a group's (`part`) in rows `[start,
    end)`: tensors are allocated for the batch at the first group and written in place (a join at the end would
    hold every row's output twice)."""
    if part is None:
        return whole
    if isinstance(part, torch.Tensor):
        if whole is None:
            whole = part.new_empty((batch, *part.shape[1:]))
        whole[start:end] = part
        return whole
    if isinstance(part, tuple):
        whole = (None,) * len(part) if whole is None else whole
        return tuple(_put_rows(w, p, start, end, batch) for w, p in zip(whole, part))
    raise TypeError(f"a grouped prefill cannot join output fields of type {type(part).__name__}")


def run_row_groups(cache: Any, groups: list[tuple[int, int]], batch: int, run: Any) -> Any:
    """A forward of `batch` rows as one forward per group of rows (`row_groups`): `run(start, end, group_cache)` is the
    model's forward over rows `[start, end)` into `group_cache` (`LoopCache.row_group`; None without a cache),
    returning a `ModelOutput`. The groups' cells land in their rows of `cache`, so that it holds what the forward of
    the whole batch stores; the output is the groups' joined along the batch, with `cache`.

    Each group runs the whole model (every layer, every loop) for its rows, so a prefill's activations, the part of
    its memory that grows with the batch (the layer's input and output, a cell's keys and values for the prompt,
    Huginn's injected embeddings), are one group's. Rows are independent, so each row is computed as in the batch.
    What the forward returns for every row is still held for every row (the logits where they are taken; Huginn's
    `latent_states`, one hidden state per prompt token, unless `output_details={"return_latents": False}`, which
    `generate`'s prefill passes)."""
    joined: dict[str, Any] = {}
    kind = None
    for start, end in groups:
        part = None if cache is None else cache.row_group(start, end, batch)
        out = run(start, end, part)
        kind = type(out)
        for f in dataclasses.fields(out):  # the group's cache is not kept: its rows are in `cache` after the merge
            if f.name != OUTPUT_CACHE_FIELD:
                joined[f.name] = _put_rows(joined.get(f.name), getattr(out, f.name), start, end, batch)
        del out
        if cache is not None:
            cache.merge_row_group(part, start, end, batch)
        del part
    return cast("Any", kind)(**joined, **{OUTPUT_CACHE_FIELD: cache})


def _full_precision_states(cache: Any, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of cell `slot` of a loop cache, after its write; raises unless the cell stores full precision."""
    plan, layout = getattr(cache, "plan", None), getattr(cache, "layout", None)
    option = plan.option(layout.cell(slot)) if plan is not None and layout is not None else None
    if option != "bf16" or not hasattr(cache, "cell_states"):
        where = f"cell {layout.cell(slot)} as {option!r}" if option is not None else "its cells in its own format"
        raise ValueError(
            f"`output_attentions=True` needs every attended key at full precision, but this {type(cache).__name__} "
            f"stores {where}, so the attention weights it applies cannot be returned. Use `use_cache=False` or a "
            f"`hf_loopcache.FullLoopCache` for attention maps."
        )
    return cache.cell_states(slot)


def default_cache(model: Any, cache: Any, *, use_cache: bool | None, num_loops: int, labels: Any = None) -> Any:
    """The cache a forward uses: the given one; or, with `use_cache`, a new `FullLoopCache` for `num_loops` loops.

    `use_cache=False` drops any cache. When `use_cache` is not given it is `config.use_cache`, but then no cache is
    built in training mode or when `labels` are passed (a loss needs none); `use_cache=True` always gets one.
    """
    explicit = use_cache is True
    use_cache = model.config.use_cache if use_cache is None else use_cache
    if not use_cache:
        return None
    if cache is not None:
        return cache
    if not explicit and (model.training or labels is not None):
        return None
    from hf_loopcache.cache import FullLoopCache  # the model layer only names the default; see DESIGN.md

    return FullLoopCache(model, num_loops=max(model.loop_layout.num_loops, num_loops))


@dataclass(frozen=True)
class OutputFlags:
    """What a forward returns beyond the logits: the call's flags, else the config's (transformers' convention)."""

    attentions: bool
    hidden_states: bool
    return_dict: bool

    @classmethod
    def resolve(
        cls, config: Any, output_attentions: bool | None, output_hidden_states: bool | None, return_dict: bool | None
    ) -> OutputFlags:
        pick = lambda given, name: bool(getattr(config, name, False) if given is None else given)  # noqa: E731
        return cls(
            pick(output_attentions, "output_attentions"),
            pick(output_hidden_states, "output_hidden_states"),
            pick(return_dict, "return_dict"),
        )

    def finish(self, output: Any) -> Any:
        """The `ModelOutput`, or with `return_dict=False` its tuple (non-None fields in declaration order)."""
        return output if self.return_dict else output.to_tuple()


def _check_foreign_cache(cache: Cache, layout: LoopLayout) -> None:
    """A plain `transformers` cache works if it can hold one layer per cell; otherwise fail before any write."""
    grows = getattr(cache, "layer_class_to_replicate", None) is not None
    if not grows and len(cache.layers) < layout.num_cells:
        raise ValueError(
            f"{type(cache).__name__} has {len(cache.layers)} layers, but this looped model writes {layout.num_cells} "
            f"cells ({layout.describe()}). Pass `hf_loopcache.FullLoopCache(model)` (or RIPECache / LoopKVCache), or "
            f"a growable `DynamicCache()` built without `config`."
        )


#: the tokens a cache was filled with by `generate` (cache -> `[batch, positions]` ids), to check a reused cache
_CACHE_TOKENS: weakref.WeakKeyDictionary[Any, torch.Tensor] = weakref.WeakKeyDictionary()


def check_reused_cache(cache: Any, input_ids: torch.Tensor | None, attention_mask: torch.Tensor | None) -> None:
    """A cache that already holds positions continues a generation only if it holds a prefix of the input.

    transformers' continue-from-cache: `input_ids` is either the whole sequence so far (the cache holds its first
    positions, generate feeds the rest), or only the new tokens with an `attention_mask` covering cache and new
    tokens. Anything else would attend to a context that is not the input's, so it raises. When the cache was filled
    by `generate`, the tokens it holds are also compared with the input's first tokens.
    """
    if cache is None or input_ids is None or input_ids.dim() != 2:
        return
    past = cache.get_seq_length()
    if past == 0:
        return
    length = input_ids.shape[1]
    if attention_mask is not None and attention_mask.shape[-1] == past + length:
        return  # only the new tokens, with a mask over cache and new tokens
    if length <= past:
        raise ValueError(
            f"the cache passed to `generate` already holds {past} positions, but the input has {length} tokens: a "
            f"reused cache must hold a prefix of the input. Pass the whole sequence so far (the earlier input and "
            f"what was generated, longer than {past} tokens), or a fresh cache for a new prompt."
        )
    seen = _CACHE_TOKENS.get(cache)
    if seen is None or seen.shape[0] != input_ids.shape[0]:
        return
    common = min(past, seen.shape[1])
    if not torch.equal(seen[:, :common].to(input_ids.device), input_ids[:, :common]):
        raise ValueError(
            f"the cache passed to `generate` holds {past} positions of a different sequence: its tokens are not the "
            f"first {common} tokens of the input. Pass a fresh cache for a new prompt (or `cache.reset()`)."
        )


class _NonFiniteLogits(LogitsProcessor):
    """A logits processor that records, on the device, the sum of each step's scores, so that the first step whose
    scores hold NaN or +inf can be named after `generate` returns.

    A step costs one launch (the sum, written into a preallocated slot) and no host synchronisation:
    `LoopGenerationMixin.generate` reads the record once per call (`check`), after `generate` returns, when generate's
    own last stop check has already waited for the device, so the read waits for nothing. The sum is NaN or +inf
    exactly when a score is NaN or +inf (-inf alone sums to -inf; -inf is a legitimate mask value of other processors
    and is not reported). `transformers`' `LogitsProcessorList` reads every processor's signature at every step
    (`inspect.signature(processor.__call__)`, about 10 us); the instance carries its signature, so that read is a
    lookup. Measured on CPU (one torch thread, a busy 2-core machine, `[1, 64]` scores): 3 us per step, from 25 us
    with seven scalar ops and the signature read (`benchmarks/bench_host_step.py --generate`).
    """

    SLOTS = 1024  # sums per preallocated block (one block more each time these are full)

    def __init__(self) -> None:
        self.step = 0
        self.blocks: list[torch.Tensor] = []
        # `inspect.signature` returns an object's `__signature__` as it is: the bound `__call__`'s, read once here
        call = functools.partial(type(self).__call__, self)
        call.__signature__ = inspect.signature(self.__call__)  # type: ignore[attr-defined]
        self.__call__ = call  # type: ignore[method-assign]  # what the list inspects; calls still go to the class's

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        block, slot = divmod(self.step, self.SLOTS)
        if block == len(self.blocks):
            self.blocks.append(torch.empty(self.SLOTS, dtype=torch.float32, device=scores.device))
        torch.sum(scores, (0, 1), dtype=torch.float32, out=self.blocks[block][slot])  # scores: [batch, vocab]
        self.step += 1
        return scores

    def first_bad(self, steps: int | None = None) -> int:
        """The first of the first `steps` steps (default: all) whose scores held NaN or +inf, or -1 (one host read)."""
        steps = self.step if steps is None else min(max(steps, 0), self.step)
        if not steps:
            return -1
        sums = torch.cat(self.blocks)[:steps]
        bad = (torch.isnan(sums) | (sums == float("inf"))).nonzero()
        return int(bad[0, 0]) if bad.numel() else -1

    def check(self, steps: int | None = None) -> None:
        """Raise if one of the first `steps` steps (those whose tokens `generate` returned; default: all) held NaN or
        +inf. A deferred stop check runs one step more than it keeps; that step's scores are not judged."""
        steps = self.step if steps is None else min(max(steps, 0), self.step)
        step = self.first_bad(steps)
        if step >= 0:
            raise FloatingPointError(
                f"the model produced non-finite logits (NaN or +inf) at generation step {step} of {steps} "
                f"(step 0 is the prompt): the output after that step is meaningless. Check the weights and inputs for "
                f"NaN/inf, or run in float32/bfloat16 if float16 overflowed."
            )


def _first_parameter(module: nn.Module, *, floating: bool) -> nn.Parameter | None:
    """The first parameter (the first floating one with `floating`) in `module.parameters()`' order: each module's own
    parameters, then its children's, depth first in registration order; None if there is none."""
    for p in module._parameters.values():
        if p is not None and (not floating or p.is_floating_point()):
            return p
    for child in module._modules.values():
        if child is not None and (p := _first_parameter(child, floating=floating)) is not None:
            return p
    return None


class LoopGenerationMixin(GenerationMixin):
    """`generate` glue: when no cache is given, build a `FullLoopCache` sized for the call's loop count.

    transformers' default, `DynamicCache(config=...)`, has one layer per *model* layer and cannot hold a looped
    model's cells; it is never silently replaced, so generate must not build it for these models.

    `generate` also takes the cache as `cache=` or `past_key_values=` on every supported transformers, refuses an
    empty prompt and a reused cache that does not hold a prefix of the input, and raises `FloatingPointError` if a
    step produced NaN logits (checked once per call, after generate's last stop check).

    On CUDA, greedy decoding and sampling with a looped-model cache read generate's stop flag one step late
    (`defer_stop=True`, the default; transformers' `DeferredStopCheck`, which transformers itself enables on `mps`
    only): the host queues the next step while the GPU runs this one, instead of waiting for the GPU at every step.
    The tokens are the same; after an end-of-sequence stop one extra step has run, and its token and cache position
    are taken back (used only where that crop is exact: `LoopCache.exact_crop`). `defer_stop=False` waits at every
    step, as transformers does on CUDA; a streamer then gets each token one step later than with it off.
    """

    loop_kwarg: str = "num_loops"

    @property
    def device(self) -> torch.device:
        """transformers' `ModuleUtilsMixin.device` (the first parameter's device), found by a walk that stops at the
        first parameter instead of through `parameters()`' generators (4 us on a busy CPU): `prepare_inputs_for_generation`
        reads it twice per step, between the step's host sync and its graph replay."""
        first = _first_parameter(cast("nn.Module", self), floating=False)
        return super().device if first is None else first.device  # type: ignore[misc]  # (raises as it does)

    @property
    def dtype(self) -> torch.dtype:
        """transformers' `ModuleUtilsMixin.dtype` (the first floating parameter's dtype), found as `device` is."""
        first = _first_parameter(cast("nn.Module", self), floating=True)
        return super().dtype if first is None else first.dtype  # type: ignore[misc]

    def prepare_inputs_for_generation(self, input_ids: torch.Tensor, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """transformers' inputs of a generate step; a one-token decode step into a static cache builds them directly
        (`_compat.decode_step_inputs`: the host work between a step's sync and its graph replay, which the GPU waits
        for), checked against transformers' own at the first such step."""
        if args:
            return super().prepare_inputs_for_generation(input_ids, *args, **kwargs)  # type: ignore[misc]
        return decode_step_inputs(
            self, input_ids, kwargs, lambda: super(LoopGenerationMixin, self).prepare_inputs_for_generation(
                input_ids, **kwargs)
        )

    def draft_kwargs(self, loops: int) -> dict[str, Any]:
        """Forward keyword arguments of a self-speculative draft that runs `loops` loops (fewer than the model's)."""
        return {self.loop_kwarg: check_num_loops(loops, self.loop_kwarg)}

    def _extract_generation_mode_kwargs(
        self, custom_generate: Any, kwargs: dict, synced_gpus: Any, assistant_model: Any, streamer: Any
    ) -> dict[str, Any]:
        """transformers (5.17-5.24) hands a `custom_generate` callable only the keywords `_sample` lacks, so a callable
        never gets the `streamer` (into which `generate` already streamed the prompt) nor the `tokenizer` (which
        `stop_strings` need). Hand them to a callable that declares them."""
        handed = {"streamer": streamer, "tokenizer": kwargs.get("tokenizer")}
        out = super()._extract_generation_mode_kwargs(  # type: ignore[misc]
            custom_generate, kwargs, synced_gpus, assistant_model, streamer
        )
        if callable(custom_generate):
            takes = inspect.signature(custom_generate).parameters
            out.update({k: v for k, v in handed.items() if v is not None and k in takes})
        return out

    def generate(self, inputs: torch.Tensor | None = None, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        kwargs = generate_cache_kwargs(kwargs)
        input_ids = inputs if inputs is not None else kwargs.get("input_ids")
        if (
            isinstance(input_ids, torch.Tensor)
            and input_ids.dim() == 2
            and input_ids.shape[1] == 0
            and kwargs.get("inputs_embeds") is None
        ):
            raise ValueError(
                "the prompt is empty (`input_ids` has 0 tokens): pass at least one token, e.g. the tokenizer's bos "
                "token (`tokenizer(tokenizer.bos_token + text)`)"
            )
        cache = generate_cache(kwargs)
        if isinstance(input_ids, torch.Tensor) and input_ids.dtype == torch.long:
            check_reused_cache(cache, input_ids, kwargs.get("attention_mask"))
        defer_stop = kwargs.pop("defer_stop", True)
        if not isinstance(defer_stop, bool):
            raise ValueError(f"`defer_stop` must be True or False, got {defer_stop!r}")
        monitor = _NonFiniteLogits()
        if not args:  # `logits_processor` is generate's third positional parameter; leave positional calls alone
            kwargs["logits_processor"] = LogitsProcessorList([monitor, *(kwargs.get("logits_processor") or [])])
        with deferred_stop_check(defer_stop):
            out = super().generate(inputs, *args, **kwargs)
        sequences = out if isinstance(out, torch.Tensor) else getattr(out, "sequences", None)
        prompt = input_ids.shape[1] if isinstance(input_ids, torch.Tensor) and input_ids.dim() == 2 else 0
        monitor.check(sequences.shape[1] - prompt if isinstance(sequences, torch.Tensor) else None)
        if cache is not None:
            past = cache.get_seq_length()
            if isinstance(sequences, torch.Tensor) and sequences.shape[1] >= past:
                _CACHE_TOKENS[cache] = sequences[:, :past].detach()
            else:
                _CACHE_TOKENS.pop(cache, None)
        return out

    def get_compiled_call(self, compile_config: Any) -> Any:
        """The decode call `generate` uses when the cache is compileable (a static `LoopCache`) on CUDA: CUDA graphs
        of the one-token step per batch size (`DecodeGraphs`), the eager forward for everything else. The decode step
        is captured, not compiled with `torch.compile`, so `compile_config` is not used (it can still turn the path
        off: `generate(..., disable_compile=True)` decodes eagerly)."""
        from hf_loopcache.models._graphs import DecodeGraphs

        return DecodeGraphs(self)

    def create_masks_for_generate(self, *args: Any, attention_mask: Any = None, **kwargs: Any) -> Any:
        """transformers turns the 2-D padding mask into 4-D masks for a compileable cache; these models take the 2-D
        mask (a static `LoopCache` builds its own device-side read mask), so it is handed over as it is."""
        return attention_mask

    def _prepare_cache_for_generation(
        self, generation_config: Any, model_kwargs: dict, generation_mode: Any, batch_size: int, max_cache_length: int
    ) -> Any:
        wants_default = (
            model_kwargs.get(CACHE_KWARG) is None
            and generation_config.use_cache is not False
            and generation_config.cache_implementation is None
        )
        if wants_default:
            from hf_loopcache.cache import FullLoopCache  # the model layer only names the default; see DESIGN.md

            loops = model_kwargs.get(self.loop_kwarg)
            if isinstance(loops, (tuple, list)):
                loops = sum(int(x) for x in loops)
            layout = self.loop_layout  # type: ignore[attr-defined]
            num_loops = max(layout.num_loops, check_num_loops(loops, self.loop_kwarg)) if loops is not None else None
            model_kwargs[CACHE_KWARG] = FullLoopCache(self, num_loops=num_loops)
            model_kwargs[CACHE_KWARG].reserve(max_cache_length)
            return None
        user_cache = model_kwargs.get(CACHE_KWARG)
        if user_cache is not None and getattr(user_cache, "is_loop_cache", False):
            user_cache.reserve(max_cache_length)
        if model_kwargs.get(CACHE_KWARG) is None and generation_config.cache_implementation is not None:
            raise ValueError(
                f"`cache_implementation={generation_config.cache_implementation!r}` builds a cache with one layer per "
                f"model layer, which cannot hold a looped model's cells. Pass a cache instead, e.g. "
                f"`cache=hf_loopcache.FullLoopCache(model)` or `hf_loopcache.RIPECache(model, window=64)`."
            )
        return super()._prepare_cache_for_generation(  # type: ignore[misc]  # the mixin is only used on models
            generation_config, model_kwargs, generation_mode, batch_size, max_cache_length
        )
