"""Ouro, written for transformers 5: the official math and parameter names, a call-time loop count, exact padding.

Math (official `modeling_ouro.py`): token embedding once; then `total_ut_steps` loops over all layers, each layer a
"sandwich" block `h = x + norm_in2(attn(norm_in(x)))`, `out = h + norm_post2(mlp(norm_post(h)))`; the final norm is
applied after *every* loop and its output feeds the next loop. An exit gate `sigmoid(early_exit_gate(h_t))` gives
each loop an exit probability; outputs come from `exit_at_step`, else from the first loop whose cumulative exit
probability reaches `exit_threshold` (per token), else (with `use_weighted_exit`) the exit-weighted average of all
loops' logits, else from the last loop. With `labels`, the loss is taken on the exit-weighted expected logits.

Cache slot of loop `r`, layer `l`: `r * num_hidden_layers + l` (see `hf_loopcache.LoopLayout`).

As a transformers model: `hidden_states` has `1 + R * L` entries (the embedding output, then every layer call of the
unrolled loops in execution order), `attentions` one `[B, H, q, T]` map per layer call, and the cache holds one
layer per (loop, layer) cell, `R * L` in all (see the README's model section).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn
from transformers import initialization as init
from transformers.activations import ACT2FN
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.modeling_utils import PreTrainedModel

from hf_loopcache._compat import OUTPUT_CACHE_FIELD, cache_argument
from hf_loopcache.layout import LoopLayout
from hf_loopcache.models._common import (
    LoopForward,
    LoopGenerationMixin,
    OutputFlags,
    RMSNorm,
    by_token_chunks,
    check_num_loops,
    check_prefill_rows,
    default_cache,
    linear,
    one_piece,
    row_groups,
    row_slice,
    run_row_groups,
    sandwich_layer,
    silu_linear,
    stacked_linear,
    stacked_projection,
    stacked_rope_projection,
)
from hf_loopcache.models.ouro.configuration_ouro import OuroConfig
from triton_ops import fused

__all__ = ["OuroForCausalLM", "OuroModel", "OuroModelOutput", "OuroPreTrainedModel"]


class OuroRotaryEmbedding(nn.Module):
    """Default (unscaled) RoPE, rotate-half convention, cos/sin computed in fp32 and cast to the activations' dtype."""

    inv_freq: torch.Tensor

    def __init__(self, config: OuroConfig):
        super().__init__()
        dim = config.head_dim
        exponent = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
        self.register_buffer("inv_freq", 1.0 / (config.rope_theta**exponent), persistent=False)

    @torch.no_grad()
    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        inv = self.inv_freq.float().to(x.device)
        freqs = position_ids.float()[..., None] * inv  # [B, q, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


class OuroMLP(nn.Module):
    def __init__(self, config: OuroConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.act_fn = ACT2FN[config.hidden_act]
        self.config = config

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.config.hidden_act == "silu":
            gate_up = stacked_projection(self, ("gate_proj", "up_proj"), x)
            if gate_up is not None:  # a short input: the activation read by the down projection's kernel on CUDA
                return silu_linear(self.down_proj, gate_up)
            return linear(self.down_proj, fused.silu_mul(self.gate_proj(x), self.up_proj(x)))  # one kernel on CUDA
        gate, up = stacked_linear(self, ("gate_proj", "up_proj"), x)
        return linear(self.down_proj, self.act_fn(gate) * up)


class OuroAttention(nn.Module):
    """The projections of Ouro's attention; the decoder layer runs them through `attention_half` (query pieces in a
    long prefill, one call otherwise), the attention itself through the cell (`LoopForward.attend`)."""

    def __init__(self, config: OuroConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)

    def project(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_out: tuple[torch.Tensor, ...] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, bool]:
        """Queries `[B, H, q, D]`, keys and values `[B, H_kv, q, D]` of the normed input `x` `[B, q, hidden]`, RoPE
        (`cos` / `sin` `[B, q, D]`) applied to queries and keys, and whether the keys and values were also stored at
        `kv_out` (a static cell's storage and the step's positions: `triton_ops.gemv.linear_rope`) by the projection's
        kernel."""
        b, q_len, _ = x.shape
        d, hq, hk = self.head_dim, self.num_heads, self.num_kv_heads
        found = stacked_rope_projection(
            self, ("q_proj", "k_proj", "v_proj"), x, cos.to(x.dtype), sin.to(x.dtype), (hq + hk) * d, kv_out
        )
        if found is not None:  # a short input: one GEMM, queries and keys rotated in it or by one launch after it
            qkv, rotated, stored = found
            if rotated:
                query = qkv[..., : hq * d].view(b, q_len, hq, d).transpose(1, 2)
                key = qkv[..., hq * d : (hq + hk) * d].view(b, q_len, hk, d).transpose(1, 2)
            else:
                cos, sin = cos.to(qkv.dtype), sin.to(qkv.dtype)
                qk = fused.rotate_half(qkv[..., : (hq + hk) * d].view(b, q_len, hq + hk, d), cos, sin)
                query, key = qk[:, :, :hq].transpose(1, 2), qk[:, :, hq:].transpose(1, 2)
            value = qkv[..., (hq + hk) * d :].view(b, q_len, hk, d).transpose(1, 2)
            return query, key, value, stored
        query = self.q_proj(x).view(b, q_len, -1, d)
        key = self.k_proj(x).view(b, q_len, -1, d)
        value = self.v_proj(x).view(b, q_len, -1, d).transpose(1, 2)
        cos, sin = cos.to(query.dtype), sin.to(query.dtype)
        query = fused.rotate_half(query, cos, sin).transpose(1, 2)
        key = fused.rotate_half(key, cos, sin).transpose(1, 2)
        return query, key, value, False


class OuroDecoderLayer(nn.Module):
    def __init__(self, config: OuroConfig, layer_idx: int):
        super().__init__()
        self.self_attn = OuroAttention(config, layer_idx)
        self.mlp = OuroMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.input_layernorm_2 = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm_2 = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        state: LoopForward,
        slot: int,
        next_norm: RMSNorm | None = None,
    ) -> torch.Tensor:
        """The layer's output `[B, q, hidden]`. With `next_norm` and an input of one piece (`b * q <= TOKEN_CHUNK`),
        `next_norm(out)` comes from the same kernel as `out` (on CUDA) and is left in `state` for its reader
        (`LoopForward.pass_normed`); the input norm takes what the previous call left for `x`."""
        return sandwich_layer(
            state, slot, x, rope, project=self.self_attn.project, out_proj=self.self_attn.o_proj, mlp=self.mlp,
            norms=(self.input_layernorm, self.input_layernorm_2, self.post_attention_layernorm,
                   self.post_attention_layernorm_2),
            residual="after", next_norm=next_norm,
        )  # fmt: skip


class OuroPreTrainedModel(PreTrainedModel):
    config_class = OuroConfig
    config: OuroConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = False
    _no_split_modules = ["OuroDecoderLayer"]
    _supports_sdpa = True
    _can_compile_fullgraph = False

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        std = self.config.initializer_range
        if isinstance(module, nn.Linear):
            init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, RMSNorm):
            init.ones_(module.weight)
        elif isinstance(module, OuroRotaryEmbedding):
            dim = self.config.head_dim
            exponent = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
            init.copy_(module.inv_freq, 1.0 / (self.config.rope_theta**exponent))

    @property
    def loop_layout(self) -> LoopLayout:
        """The model's cache layout at its default loop count (`total_ut_steps`)."""
        return LoopLayout.from_config(self.config)


@dataclass
class OuroModelOutput(BaseModelOutputWithPast):
    """`BaseModelOutputWithPast` plus, per loop run, the normed hidden state and the exit gate's logit."""

    loop_hidden_states: tuple[torch.Tensor, ...] | None = None
    exit_gate_logits: tuple[torch.Tensor, ...] | None = None


class OuroModel(OuroPreTrainedModel):
    def __init__(self, config: OuroConfig):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.layers = nn.ModuleList([OuroDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = OuroRotaryEmbedding(config)
        self.early_exit_gate = nn.Linear(config.hidden_size, 1)
        self.post_init()

    def get_input_embeddings(self) -> nn.Module:
        return self.embed_tokens

    def set_input_embeddings(self, value: nn.Module) -> None:
        self.embed_tokens = cast("nn.Embedding", value)

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        past_key_values: Any = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        num_loops: int | None = None,
        use_early_exit_gate: bool = True,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        cache: Any = None,
        cache_position: torch.Tensor | None = None,
        loop_states_to_keep: int | torch.Tensor = 0,
        keep_mask: bool = False,
        **kwargs: Any,
    ) -> OuroModelOutput | tuple:
        r"""
        Args:
            num_loops (`int`, *optional*): loops to run; defaults to `config.total_ut_steps`. A draft runs fewer.
            loop_states_to_keep (`int` or `torch.Tensor`, *optional*, defaults to 0): positions at which
                `loop_hidden_states` and `exit_gate_logits` are kept, as `logits_to_keep` selects them (the last `n`,
                or a 1-D tensor of indices; 0 keeps all). `OuroForCausalLM` passes its `logits_to_keep`, so a prefill
                does not hold every loop's state of the whole prompt until the exit is taken (`R - 1` hidden states
                of the prompt; 96 MiB per 8K row on Ouro-1.4B in bf16).
            past_key_values / cache (`transformers.Cache`, *optional*): the cache; both names are accepted. With
                `use_cache=True` (or `config.use_cache` outside training) and none given, a `FullLoopCache` is built.
            output_hidden_states (`bool`, *optional*): return `hidden_states`, `1 + R * L` tensors `[B, q, hidden]`:
                the embedding output, then the output of every layer call in execution order (loop 0 layers
                `0..L-1`, loop 1, ...). The entry that ends a loop is taken after the model norm (the state the next
                loop and the exit gate read); the other entries are raw layer outputs.
            output_attentions (`bool`, *optional*): return `attentions`, one `[B, H, q, T]` softmax map per layer call
                in the same order (computed eagerly; needs the attended keys at full precision).
            cache_position: accepted and ignored (positions come from the cache and `attention_mask`).
            keep_mask (`bool`, *optional*, defaults to False): keep an `attention_mask` without padding (the masked
                attention path) instead of dropping it; a prefill in row groups sets it for every group when any row
                of the batch is padded, so that each row is computed as in the whole batch.
        """
        cache = cache_argument(past_key_values, cache)
        flags = OutputFlags.resolve(self.config, output_attentions, output_hidden_states, return_dict)
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("Pass exactly one of `input_ids` or `inputs_embeds`.")
        num_loops = check_num_loops(self.config.total_ut_steps if num_loops is None else num_loops, "num_loops")
        cache = default_cache(self, cache, use_cache=use_cache, num_loops=num_loops)
        hidden = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        b, q_len = hidden.shape[:2]
        state, position_ids = LoopForward.begin(
            layout=self.loop_layout,
            num_loops=num_loops,
            cache=cache,
            attention_mask=attention_mask,
            position_ids=position_ids,
            batch_size=b,
            query_length=q_len,
            device=hidden.device,
            scaling=self.config.head_dim**-0.5,
            output_attentions=flags.attentions,
            keep_mask=keep_mask,
        )
        rope = self.rotary_emb(hidden, position_ids)
        n_layers = self.config.num_hidden_layers
        # every layer's output is kept only when asked for: at 8K tokens they would hold 3.2 GiB per row (Ouro-1.4B)
        all_hidden: list[torch.Tensor] | None = [hidden] if flags.hidden_states else None
        loop_hidden: list[torch.Tensor] = []
        gate_logits: list[torch.Tensor] = []
        keep = _positions(loop_states_to_keep)
        # an input of one piece chains the norms: each layer's last norm returns the next layer's input norm (the last
        # layer's, the model norm) from one kernel on CUDA; a norm on another device (a `device_map`) breaks the chain
        chain = _norm_chain(self) if one_piece(b, q_len) else [None] * n_layers
        for loop in range(num_loops):
            for layer_idx, layer in enumerate(self.layers):
                hidden = layer(hidden, rope, state, loop * n_layers + layer_idx, next_norm=chain[layer_idx])
                if all_hidden is not None:
                    all_hidden.append(hidden)
            normed = state.take_normed(hidden)  # the last layer's chained norm is the model norm
            # (else in pieces: the eager norm's fp32 copies are per piece)
            hidden = normed if normed is not None else by_token_chunks(self.norm, hidden)
            if all_hidden is not None:
                all_hidden[-1] = hidden
            kept = keep(hidden)
            loop_hidden.append(kept)
            if use_early_exit_gate:
                gate_logits.append(self.early_exit_gate(kept))
        output = OuroModelOutput(
            last_hidden_state=hidden,
            hidden_states=tuple(all_hidden) if all_hidden is not None else None,
            attentions=tuple(state.attentions) if state.attentions is not None else None,
            loop_hidden_states=tuple(loop_hidden),
            exit_gate_logits=tuple(gate_logits) if use_early_exit_gate else None,
            **{OUTPUT_CACHE_FIELD: cache},
        )
        return flags.finish(output)


def _norm_chain(model: OuroModel) -> list[RMSNorm | None]:
    """For each layer, the norm that reads its output (the next layer's `input_layernorm`, the last layer's the model
    norm) when it sits on the layer's device, else None (that norm runs on its own)."""
    nexts = [layer.input_layernorm for layer in model.layers[1:]] + [model.norm]
    return [
        nxt if nxt.weight.device == layer.post_attention_layernorm_2.weight.device else None
        for layer, nxt in zip(model.layers, nexts)
    ]


def _positions(to_keep: int | torch.Tensor) -> Any:
    """`t[:, positions]` as `logits_to_keep` names them (an int: the last n, 0 for all; a tensor: indices)."""
    if isinstance(to_keep, int):  # a copy: a view would keep the whole state alive
        return lambda t: t[:, -to_keep:].clone() if 0 < to_keep < t.shape[1] else t
    return lambda t: t.index_select(1, to_keep.to(t.device))


def exit_distribution(gate_logits: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """Per-token exit pdf over loops `[B, T, R]`: `p_t = lambda_t prod_{j<t} (1 - lambda_j)`, the last takes the rest."""
    remaining = torch.ones_like(gate_logits[0].squeeze(-1))
    pdf = []
    for i, logit in enumerate(gate_logits):
        lam = torch.sigmoid(logit.squeeze(-1))
        if i < len(gate_logits) - 1:
            pdf.append(lam * remaining)
            remaining = remaining * (1.0 - lam)
        else:
            pdf.append(remaining)
    return torch.stack(pdf, dim=2)


class OuroForCausalLM(LoopGenerationMixin, OuroPreTrainedModel):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: OuroConfig):
        super().__init__(config)
        self.model = OuroModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def draft_kwargs(self, loops: int) -> dict[str, Any]:
        """A draft runs `loops` loops and exits at its last one (whatever the config's exit rule)."""
        return {**super().draft_kwargs(loops), "exit_at_step": loops - 1}

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def set_output_embeddings(self, new_embeddings: nn.Linear) -> None:
        self.lm_head = new_embeddings

    def get_decoder(self) -> OuroModel:
        return self.model

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        past_key_values: Any = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        num_loops: int | None = None,
        use_early_exit_gate: bool = True,
        use_weighted_exit: bool | None = False,
        exit_at_step: int | None = None,
        exit_threshold: float | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        cache: Any = None,
        cache_position: torch.Tensor | None = None,
        prefill_rows: int | None = None,
        keep_mask: bool = False,
        **kwargs: Any,
    ) -> CausalLMOutputWithPast | tuple:
        r"""
        Args:
            num_loops (`int`, *optional*): loops to run (default `config.total_ut_steps`); only these loops' cells
                are written. Drafts of self-speculative decoding run fewer loops.
            exit_at_step (`int`, *optional*): take the outputs of this loop (0-based, `< num_loops`); defaults to
                `config.early_exit_step`.
            exit_threshold (`float`, *optional*): per token, take the first loop whose cumulative exit probability
                reaches it; defaults to `config.early_exit_threshold`. Ignored when `exit_at_step` is set.
            use_weighted_exit (`bool`, *optional*): without a step or threshold, average the loops' logits by the
                exit distribution.
            labels (`torch.LongTensor`, *optional*): targets in transformers' convention (shifted inside; `-100` is
                ignored; a pre-shifted `shift_labels=` is honoured); the loss is taken on the exit-weighted logits.
            output_hidden_states, output_attentions, past_key_values / cache, use_cache: as in `OuroModel.forward`
                (`hidden_states` has `1 + R * L` entries; the per-loop normed states are in `OuroModel`'s
                `loop_hidden_states`). No cache is built when `labels` are given unless `use_cache=True`.
            return_dict (`bool`, *optional*): False returns a tuple (`loss`, `logits`, cache, `hidden_states`,
                `attentions`, leaving out those that are None).
            prefill_rows (`int`, *optional*, defaults to None): run a prefill (a forward of more than one new token
                into an empty cache, or without a cache) over groups of at most this many rows, one after the other,
                each group's cells written into its rows of the one cache: the activations that grow with the batch
                are one group's (see `hf_loopcache.models._common.run_row_groups`). The cache holds, and the forward
                returns, what the whole batch at once gives (rows are independent). None runs the batch in one
                forward; decode steps and forwards after cached positions always do. `generate(...,
                prefill_rows=N)` hands it to every forward. Not with `labels` (a loss over the batch).
            keep_mask: see `OuroModel.forward`.
        """
        cache = cache_argument(past_key_values, cache)
        flags = OutputFlags.resolve(self.config, output_attentions, output_hidden_states, return_dict)
        if labels is not None and use_cache is None and cache is None:
            use_cache = False  # a loss needs no new cache (a cache passed in is still used)
        if check_prefill_rows(prefill_rows, labels) is not None:
            rows_in = input_ids if input_ids is not None else inputs_embeds
            b, q_len = rows_in.shape[:2] if rows_in is not None else (0, 0)
            loops = check_num_loops(self.config.total_ut_steps if num_loops is None else num_loops, "num_loops")
            cache = default_cache(self, cache, use_cache=use_cache, num_loops=loops)
            groups = row_groups(prefill_rows, cache, b, q_len)
            if groups is not None:
                padded = attention_mask is not None and not bool(attention_mask.all())

                def run(a: int, e: int, part: Any) -> Any:
                    return self.forward(
                        input_ids=row_slice(input_ids, a, e), attention_mask=row_slice(attention_mask, a, e),
                        position_ids=row_slice(position_ids, a, e), inputs_embeds=row_slice(inputs_embeds, a, e),
                        use_cache=use_cache if part is None else True, logits_to_keep=logits_to_keep, num_loops=loops,
                        use_early_exit_gate=use_early_exit_gate, use_weighted_exit=use_weighted_exit,
                        exit_at_step=exit_at_step, exit_threshold=exit_threshold,
                        output_attentions=flags.attentions, output_hidden_states=flags.hidden_states,
                        return_dict=True, cache=part, keep_mask=keep_mask or padded, **kwargs,
                    )  # fmt: skip

                return flags.finish(run_row_groups(cache, groups, b, run))
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            num_loops=num_loops,
            use_early_exit_gate=use_early_exit_gate,
            output_attentions=flags.attentions,
            output_hidden_states=flags.hidden_states,
            return_dict=True,
            loop_states_to_keep=logits_to_keep,  # the loops' states only where logits are taken
            keep_mask=keep_mask,
        )
        loop_hidden = outputs.loop_hidden_states
        exit_at_step = exit_at_step if exit_at_step is not None else self.config.early_exit_step
        exit_threshold = exit_threshold if exit_threshold is not None else self.config.early_exit_threshold
        if exit_at_step is not None and not -len(loop_hidden) <= exit_at_step < len(loop_hidden):
            raise ValueError(
                f"`exit_at_step` must be in [0, {len(loop_hidden) - 1}] for {len(loop_hidden)} loops, got {exit_at_step}"
            )
        gates = outputs.exit_gate_logits
        pdf = exit_distribution(gates) if gates else None

        def expected_logits() -> torch.Tensor:
            total = None
            for r, h in enumerate(loop_hidden):
                logits_r = self.lm_head(h)  # on the head's device, the exit pdf on the gate's (`device_map`)
                term = logits_r * pdf[..., r : r + 1].to(logits_r.device, h.dtype)  # type: ignore[index]
                total = term if total is None else total + term
            return total  # type: ignore[return-value]

        loss = None
        if labels is not None:
            logits = expected_logits() if pdf is not None else self.lm_head(loop_hidden[-1])
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        elif pdf is not None and exit_at_step is not None:
            logits = self.lm_head(loop_hidden[exit_at_step])
        elif pdf is not None and exit_threshold is not None:
            reached = torch.cumsum(pdf, dim=2) >= exit_threshold
            steps = torch.argmax(reached.float(), dim=2)
            steps = torch.where(reached.any(dim=2), steps, pdf.shape[2] - 1)  # no boolean indexing: no host sync
            stacked = torch.stack(loop_hidden, dim=2)
            index = steps[..., None, None].expand(-1, -1, 1, stacked.shape[-1]).to(stacked.device)
            logits = self.lm_head(torch.gather(stacked, 2, index).squeeze(2))
        elif pdf is not None and use_weighted_exit:
            logits = expected_logits()
        else:
            logits = self.lm_head(loop_hidden[-1])
        output = CausalLMOutputWithPast(
            loss=loss,
            logits=logits,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
            **{OUTPUT_CACHE_FIELD: getattr(outputs, OUTPUT_CACHE_FIELD)},
        )
        return flags.finish(output)
