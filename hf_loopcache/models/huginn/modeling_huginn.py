"""Huginn-0125 / Raven, written for transformers 5: the official math and parameter names, exact padding, any context.

Math (official `raven_modeling_minimal.py`): `e = wte(ids) * sqrt(n_embd)`; prelude blocks; a state `s0` (random
truncated normal scaled like the embeddings, zeros with `init_scale=0`, or `input_states`); each of `num_steps` core
steps computes `s = adapter([s, e])` and runs the core blocks; then `ln_f`, the coda blocks and `ln_f` again; logits
in fp32. Blocks are sandwich blocks `x = norm_2(attn(norm_1(x)) + x); x = norm_4(mlp(norm_3(x)) + x)`; attention
adds a learned bias to queries and keys before an interleaved-pair ("complex-like") RoPE.

Cache slots: prelude `0..P-1`, core step `s` layer `j` at `P + n_core * s + j`, coda `-1, -2, ...` (see `LoopLayout`).

As a transformers model: `hidden_states` has `1 + P + R * C + D` entries (the scaled embeddings, then every block
call in execution order: prelude, core step by step, coda), `attentions` one map per block call, and the cache holds
one layer per cell, `P + R * C + D` in all. There is no base model: the parts live under `transformer`, as in the
official checkpoints (see the README's model section). `labels` follow transformers' convention (shifted inside),
unlike the official code, whose unshifted loss is `unshifted_loss=True`.

Differences from the official code, all deliberate: padding masks and per-row positions are honoured (the official
forward ignores `attention_mask`); RoPE is computed for any position (the official buffer stops at `block_size`);
a cache it does not know is never replaced; `test_time_noise` must be 0; in eval mode the initial state defaults to
`config.init_scale` (0.0: zeros, deterministic) where the official code draws a random one (`init_scale=1.0`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn
from transformers import initialization as init
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.modeling_utils import PreTrainedModel

from hf_loopcache._compat import OUTPUT_CACHE_FIELD, cache_argument, generate_cache
from hf_loopcache.layout import LoopLayout
from hf_loopcache.models._common import (
    STACK_TOKENS,
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
)
from hf_loopcache.models.huginn.configuration_huginn import HuginnConfig
from triton_ops import fused

__all__ = ["HuginnCausalLMOutput", "HuginnForCausalLM", "HuginnPreTrainedModel"]


def _rope_angles(position_ids: torch.Tensor, head_dim: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (
        base ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=position_ids.device) / head_dim)
    )
    freqs = position_ids.float()[..., None] * inv_freq  # [B, q, D/2]
    return freqs.cos()[:, :, None], freqs.sin()[:, :, None]  # [B, q, 1, D/2]


class CausalSelfAttention(nn.Module):
    """The projections of Huginn's attention; the block runs them through `attention_half` (query pieces in a long
    prefill, one call otherwise), the attention itself through the cell (`LoopForward.attend`)."""

    def __init__(self, config: HuginnConfig):
        super().__init__()
        self.n_head = config.n_heads
        self.n_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.chunks = [config.n_embd, self.n_kv_heads * self.head_dim, self.n_kv_heads * self.head_dim]
        self.Wqkv = nn.Linear(config.n_embd, sum(self.chunks), bias=False)
        if config.qk_bias:
            self.qk_bias = nn.Parameter(torch.zeros(2, 1, self.n_head, self.head_dim))
        self.proj = nn.Linear(config.n_embd, config.n_embd, bias=False)

    def project(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_out: object = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, bool]:
        """Queries `[B, H, q, D]`, keys and values `[B, H_kv, q, D]` of the normed input `x` `[B, q, n_embd]`: the
        fused projection, the learned bias and the pair-wise RoPE (`cos` / `sin` fp32 `[B, q, 1, D/2]`); False: the
        projection stores nothing at `kv_out` (the cell stores the keys and values)."""
        b, q_len, _ = x.shape
        h, hk, d = self.n_head, self.n_kv_heads, self.head_dim
        qkv = linear(self.Wqkv, x)
        q, k, v = qkv.split(self.chunks, dim=2)
        v = v.view(b, q_len, hk, d)
        bias = getattr(self, "qk_bias", None)
        if hk == h and b * q_len <= STACK_TOKENS:  # a short input: queries and keys (adjacent) rotated by one launch
            qk_bias = bias.reshape(1, 2 * h, d) if bias is not None else None
            qk = fused.rotate_pairs(qkv[..., : 2 * h * d].view(b, q_len, 2 * h, d), cos, sin, bias=qk_bias)
            q, k = qk[:, :, :h], qk[:, :, h:]
        else:
            q, k = q.view(b, q_len, h, d), k.view(b, q_len, hk, d)
            q_bias, k_bias = bias.split(1, dim=0) if bias is not None else (None, None)
            q, k = fused.rotate_pairs(q, cos, sin, bias=q_bias), fused.rotate_pairs(k, cos, sin, bias=k_bias)
        if q_len > 1:  # own the values, so the fused projection's output (3 hidden states a token) is freed here
            v = v.contiguous()
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), False


class GatedMLP(nn.Module):
    def __init__(self, config: HuginnConfig):
        super().__init__()
        self.fc = nn.Linear(config.n_embd, config.intermediate_size * 2, bias=False)
        self.proj = nn.Linear(config.intermediate_size, config.n_embd, bias=False)
        self.nonlin = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = linear(self.fc, x).chunk(2, dim=-1)
        return linear(self.proj, fused.silu_mul(gate, up))  # one kernel on CUDA (`triton_ops.fused`)


class SandwichBlock(nn.Module):
    def __init__(self, config: HuginnConfig):
        super().__init__()
        self.norm_1 = RMSNorm(config.n_embd, eps=config.norm_eps)
        self.attn = CausalSelfAttention(config)
        self.norm_2 = RMSNorm(config.n_embd, eps=config.norm_eps)
        self.mlp = GatedMLP(config)
        self.norm_3 = RMSNorm(config.n_embd, eps=config.norm_eps)
        self.norm_4 = RMSNorm(config.n_embd, eps=config.norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        state: LoopForward,
        slot: int,
        next_norm: RMSNorm | None = None,
    ) -> torch.Tensor:
        """The block's output `[B, q, n_embd]`. With `next_norm` and an input of one piece (`b * q <= TOKEN_CHUNK`),
        `next_norm(out)` comes from the same kernel as `out` (on CUDA) and is left in `state` for its reader
        (`LoopForward.pass_normed`); `norm_1` takes what the previous call left for `x`."""
        return sandwich_layer(
            state, slot, x, rope, project=self.attn.project, out_proj=self.attn.proj, mlp=self.mlp,
            norms=(self.norm_1, self.norm_2, self.norm_3, self.norm_4), residual="before", next_norm=next_norm,
        )  # fmt: skip


def _norm_chain(blocks: Any, last: RMSNorm | None, short: bool) -> list[RMSNorm | None]:
    """For each block of a run, the norm that reads its output (the next block's `norm_1`, the last block's `last`)
    when the input is of one piece (`short`) and it sits on the block's device, else None (that norm runs alone)."""
    nexts = [block.norm_1 for block in list(blocks)[1:]] + [last]
    return [
        nxt if short and nxt is not None and nxt.weight.device == block.norm_4.weight.device else None
        for block, nxt in zip(blocks, nexts)
    ]


def _adapt(adapter: nn.Module) -> Any:
    """The core step's input: `adapter([state, injected])` for each token."""
    return lambda state, injected: adapter(torch.cat([state, injected], dim=-1))


class HuginnPreTrainedModel(PreTrainedModel):
    config_class = HuginnConfig
    config: HuginnConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = False
    _no_split_modules = ["SandwichBlock"]
    _supports_sdpa = True
    _can_compile_fullgraph = False
    _keys_to_ignore_on_load_unexpected = [r"freqs_cis"]

    def _trunc_normal(self, tensor: torch.Tensor, std: float) -> None:
        init.trunc_normal_(tensor, mean=0.0, std=std, a=-3 * std, b=3 * std)

    def _init_role(self, module: nn.Module) -> str | None:
        """Which official init a leaf module gets, from its name (computed once per model)."""
        roles = self.__dict__.get("_init_roles")
        if roles is None:
            roles = {}
            for name, sub in self.named_modules():
                leaf = name.rsplit(".", 1)[-1]
                if leaf in ("Wqkv", "adapter", "lm_head"):
                    roles[id(sub)] = "std"
                elif leaf == "proj":
                    roles[id(sub)] = "out_proj"
                elif leaf == "fc":
                    roles[id(sub)] = "glu"
                elif leaf == "wte":
                    roles[id(sub)] = "embedding"
            self.__dict__["_init_roles"] = roles
        return roles.get(id(module))

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        """The official ("takase") init: scaled truncated normals; RMSNorm weights one; qk bias zero."""
        scales = self.config.init_values
        if isinstance(module, RMSNorm):
            init.ones_(module.weight)
        elif isinstance(module, CausalSelfAttention) and hasattr(module, "qk_bias"):
            init.zeros_(cast("torch.Tensor", module.qk_bias))
        elif isinstance(module, (nn.Linear, nn.Embedding)):
            role = self._init_role(module)
            weight = module.weight
            if role == "glu":  # gate half at std, up half at the output-projection std (official `init_glu`)
                if not getattr(weight, "_is_hf_initialized", False):
                    half = weight.shape[0] // 2
                    self._trunc_normal(weight[:half], scales["std"])
                    self._trunc_normal(weight[half:], scales["out_proj"])
            elif role is not None:
                self._trunc_normal(weight, scales[role])
            bias = getattr(module, "bias", None)
            if isinstance(bias, torch.Tensor):
                init.zeros_(bias)

    @property
    def loop_layout(self) -> LoopLayout:
        """The model's cache layout at its default loop count (`mean_recurrence`)."""
        return LoopLayout.from_config(self.config)


@dataclass
class HuginnCausalLMOutput(CausalLMOutputWithPast):
    """`CausalLMOutputWithPast` plus the official extras: `latent_states` (core output after `ln_f`) and `log_ppl`."""

    log_ppl: torch.Tensor | None = None
    latent_states: torch.Tensor | None = None


class HuginnForCausalLM(LoopGenerationMixin, HuginnPreTrainedModel):
    _tied_weights_keys = {"lm_head.weight": "transformer.wte.weight"}
    loop_kwarg = "num_steps"

    def __init__(self, config: HuginnConfig):
        super().__init__(config)
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.vocab_size, config.n_embd),
                prelude=nn.ModuleList(SandwichBlock(config) for _ in range(config.n_layers_in_prelude)),
                adapter=nn.Linear(config.n_embd * 2, config.n_embd, bias=config.bias),
                core_block=nn.ModuleList(SandwichBlock(config) for _ in range(config.n_layers_in_recurrent_block)),
                coda=nn.ModuleList(SandwichBlock(config) for _ in range(config.n_layers_in_coda)),
                ln_f=RMSNorm(config.n_embd, eps=config.norm_eps),
            )
        )
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.post_init()

    def _part(self, name: str) -> Any:
        """A part of the official `transformer` ModuleDict (`wte`, `prelude`, `adapter`, `core_block`, `coda`, `ln_f`)."""
        return cast("Any", self.transformer[name])

    def get_input_embeddings(self) -> nn.Module:
        return self._part("wte")

    def set_input_embeddings(self, value: nn.Module) -> None:
        self.transformer["wte"] = value

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def set_output_embeddings(self, new_embeddings: nn.Linear) -> None:
        self.lm_head = new_embeddings

    @property
    def emb_scale(self) -> float:
        return self.config.init_values["embed_scale"]

    def initialize_state(self, input_embeds: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        """The official random state: truncated normal (std `init_values.std * scale`, +-3 std) times the embedding
        scale, drawn with the same RNG calls as the official code; zeros when `scale == 0`."""
        x = torch.randn_like(input_embeds)
        std = self.config.init_values["std"] * scale
        if std > 0:
            nn.init.trunc_normal_(x, mean=0.0, std=std, a=-3 * std, b=3 * std)
            if self.emb_scale != 1:
                x = x * self.emb_scale
        else:
            x.zero_()
        return x

    def randomized_iteration_sampler(self) -> tuple[int, int]:
        """Steps without and with gradient. Training: the official Poisson-lognormal sampler; eval: (mean, 0).
        Draws from the global RNG exactly as the official sampler does (one `torch.rand(1)` first)."""
        torch.rand((1,))
        if not self.training:
            return self.config.mean_recurrence, 0
        t = max(self.config.mean_recurrence - self.config.mean_backprop_depth, 0)
        s = self.config.mean_backprop_depth
        sigma = 0.5
        mu = math.log(t + s) - sigma**2 / 2
        rate = torch.zeros((1,)).log_normal_(mean=mu, std=sigma)
        p = int(torch.poisson(rate.float()).item()) + 1
        return max(p - s, 0), min(s, p)

    def _resolve_steps(self, num_steps: Any) -> tuple[int, int]:
        if num_steps is None:
            return self.randomized_iteration_sampler()
        if isinstance(num_steps, torch.Tensor) and num_steps.numel() > 1:
            num_steps = tuple(int(x) for x in num_steps.flatten())
        if isinstance(num_steps, (tuple, list)):
            if len(num_steps) != 2:
                raise ValueError(
                    f"`num_steps` as a pair must be (steps_without_grad, steps_with_grad), got {num_steps!r}"
                )
            no_grad, with_grad = (int(x) for x in num_steps)
            if no_grad < 0 or with_grad < 0 or no_grad + with_grad < 1:
                raise ValueError(f"`num_steps` pair must be non-negative with a positive sum, got {num_steps!r}")
            return no_grad, with_grad
        return check_num_loops(num_steps, "num_steps"), 0

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        input_embeds: torch.Tensor | None = None,
        input_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        num_steps: int | tuple[int, int] | torch.Tensor | None = None,
        past_key_values: Any = None,
        output_details: dict[str, bool] | None = None,
        use_cache: bool | None = None,
        cache_position: torch.Tensor | None = None,
        init_scale: float | None = None,
        inputs_embeds: torch.Tensor | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        cache: Any = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        unshifted_loss: bool = False,
        prefill_rows: int | None = None,
        keep_mask: bool = False,
        **kwargs: Any,
    ) -> HuginnCausalLMOutput | tuple:
        r"""
        Args:
            input_embeds / inputs_embeds (`torch.Tensor`, *optional*): token embeddings instead of `input_ids`
                (scaled by `sqrt(n_embd)` like the official code does).
            input_states (`torch.Tensor` of shape `[B, T, n_embd]`, *optional*): the initial core state.
            labels (`torch.LongTensor`, *optional*): targets in transformers' convention: shifted inside (the logits
                at position `t` are scored against `labels[t + 1]`), `-100` ignored, a pre-shifted `shift_labels=`
                honoured. `log_ppl` is the same loss, detached.
            unshifted_loss (`bool`, *optional*, defaults to False): the official code's loss instead:
                `cross_entropy(logits, labels, ignore_index=-100)` with `labels` already aligned with the logits
                (not shifted), so `labels=input_ids` scores each position against its own token.
            num_steps (`int` or `(int, int)`, *optional*): core steps; a pair is (steps without, with gradient);
                defaults to `mean_recurrence` in eval mode and to the official random sampler in training mode.
            init_scale (`float`, *optional*): scale of the random initial state; 0 gives zeros. Defaults to
                `config.init_scale` (0.0 unless the config says otherwise) in eval mode and to the official 1.0 in
                training mode.
            output_details (`dict`, *optional*): official switches `return_logits`, `return_latents`, `return_head`.
            past_key_values / cache (`transformers.Cache`, *optional*): the cache; both names are accepted.
            cache_position: accepted and ignored (positions come from the cache and `attention_mask`).
            use_cache (`bool`, *optional*): with `use_cache=True` (or `config.use_cache` outside training and without
                `labels`) and no cache given, a `FullLoopCache` sized for the call's steps is built.
            output_hidden_states (`bool`, *optional*): return `hidden_states`, `1 + P + R * C + D` tensors
                `[B, q, n_embd]`: the embeddings (times `sqrt(n_embd)`), then the output of every block call in
                execution order (prelude, core step 0 layers `0..C-1`, step 1, ..., coda). Only the last entry is
                normalised (after `ln_f`, the state the head reads); the core's last entry is before `ln_f`.
            output_attentions (`bool`, *optional*): return `attentions`, one `[B, H, q, T]` softmax map per block call
                in the same order (computed eagerly; needs the attended keys at full precision).
            return_dict (`bool`, *optional*): False returns a tuple (`loss`, `logits`, cache, `hidden_states`,
                `attentions`, `log_ppl`, `latent_states`, leaving out those that are None). `output_details`'
                `return_head` puts the final normed state, one tensor, in `hidden_states` unless `output_hidden_states`
                asks for the tuple.
            prefill_rows (`int`, *optional*, defaults to None): run a prefill (a forward of more than one new token
                into an empty cache, or without a cache) over groups of at most this many rows, one after the other,
                each group's cells written into its rows of the one cache: the activations that grow with the batch
                (the state, the injected embeddings, a block's output, a cell's prompt keys and values) are one
                group's (`hf_loopcache.models._common.run_row_groups`). The cache holds, and the forward returns, what
                the whole batch at once gives: rows are independent, and what the batch draws from the RNG (the
                initial state, the step sampler) is drawn once for the batch, in the official order. A random initial
                state (`init_scale > 0`) is then held for the whole batch; the default zero state is not. None runs
                the batch in one forward; decode steps and forwards after cached positions always do.
                `generate(..., prefill_rows=N)` hands it to every forward. Not with `labels`.
            keep_mask (`bool`, *optional*, defaults to False): keep an `attention_mask` without padding (the masked
                attention path) instead of dropping it; a prefill in row groups sets it for every group when any row
                of the batch is padded, so that each row is computed as in the whole batch.
        """
        cache = cache_argument(past_key_values, cache)
        if check_prefill_rows(prefill_rows, labels) is not None:
            grouped = self._row_grouped(
                prefill_rows, cache, input_ids=input_ids, input_embeds=input_embeds, inputs_embeds=inputs_embeds,
                input_states=input_states, attention_mask=attention_mask, position_ids=position_ids, labels=labels,
                num_steps=num_steps, output_details=output_details, use_cache=use_cache, init_scale=init_scale,
                logits_to_keep=logits_to_keep, output_attentions=output_attentions,
                output_hidden_states=output_hidden_states, return_dict=return_dict, unshifted_loss=unshifted_loss,
                keep_mask=keep_mask, **kwargs,
            )  # fmt: skip
            if grouped is not None:
                return grouped
        flags = OutputFlags.resolve(self.config, output_attentions, output_hidden_states, return_dict)
        details = {"return_logits": True, "return_latents": True, "return_head": False, **(output_details or {})}
        if details.get("return_stats"):
            raise ValueError("`output_details['return_stats']` is not supported by hf_loopcache's Huginn model")
        embeds = input_embeds if input_embeds is not None else inputs_embeds
        if (input_ids is None) == (embeds is None):
            raise ValueError("Pass exactly one of `input_ids` or `input_embeds`/`inputs_embeds`.")
        if embeds is None:
            embeds = self._part("wte")(input_ids)
        if self.emb_scale != 1:
            embeds = embeds * self.emb_scale
        if init_scale is None:
            init_scale = 1.0 if self.training else self.config.init_scale
        # RNG order of the official code: the initial state is drawn first, then the depth sampler runs
        x = input_states.clone() if input_states is not None else self.initialize_state(embeds, scale=init_scale)
        steps_no_grad, steps_with_grad = self._resolve_steps(num_steps)
        cache = default_cache(
            self, cache, use_cache=use_cache, num_loops=steps_no_grad + steps_with_grad, labels=labels
        )
        b, q_len = embeds.shape[:2]
        state, position_ids = LoopForward.begin(
            layout=self.loop_layout,
            num_loops=steps_no_grad + steps_with_grad,
            cache=cache,
            attention_mask=attention_mask,
            position_ids=position_ids,
            batch_size=b,
            query_length=q_len,
            device=embeds.device,
            scaling=self.config.head_dim**-0.5,
            output_attentions=flags.attentions,
            keep_mask=keep_mask,
        )
        rope = _rope_angles(position_ids, self.config.head_dim, self.config.rope_base)
        n_pre, n_core = self.config.n_layers_in_prelude, self.config.n_layers_in_recurrent_block
        # every block's output is kept only when asked for: at 8K tokens they would hold 11 GiB per row (Huginn-0125)
        all_hidden: list[torch.Tensor] | None = [embeds] if flags.hidden_states else None
        short = one_piece(b, q_len)  # an input of one piece chains each block's last norm with the next one's first
        prelude_chain = _norm_chain(self._part("prelude"), None, short)
        core_chain = _norm_chain(self._part("core_block"), None, short)
        for i, block in enumerate(self._part("prelude")):
            embeds = block(embeds, rope, state, i, next_norm=prelude_chain[i])
            if all_hidden is not None:
                all_hidden.append(embeds)

        injected = embeds  # the prelude's output, copied once to the adapter's device when a device_map splits them
        for step in range(steps_no_grad + steps_with_grad):
            with torch.set_grad_enabled(torch.is_grad_enabled() and step >= steps_no_grad):
                # token by token in pieces: the concatenation holds two hidden states a token
                x = by_token_chunks(_adapt(self._part("adapter")), x.to(injected.device), injected)
                adapter_device = x.device
                for j, block in enumerate(self._part("core_block")):
                    x = block(x, rope, state, n_pre + n_core * step + j, next_norm=core_chain[j])
                    if all_hidden is not None:
                        all_hidden.append(x)
            if injected.device != adapter_device:  # the adapter runs elsewhere: later steps meet it there
                injected = embeds.to(adapter_device)  # (in the caller's grad mode: the prelude still gets gradients)
        del injected, embeds  # the coda reads neither (`hidden_states` keeps its own reference)
        x = by_token_chunks(self._part("ln_f"), x)  # in pieces: the eager norm's fp32 copies are per piece
        latent_states = x.clone().detach()
        coda_chain = _norm_chain(self._part("coda"), self._part("ln_f"), short)
        for c, block in enumerate(self._part("coda")):
            x = block(x, rope, state, -(c + 1), next_norm=coda_chain[c])
            if all_hidden is not None:
                all_hidden.append(x)
        normed = state.take_normed(x)  # the last coda block's chained norm is `ln_f`
        x = normed if normed is not None else by_token_chunks(self._part("ln_f"), x)
        if all_hidden is not None:
            all_hidden[-1] = x

        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        head_in = x[:, keep] if isinstance(keep, slice) else x.index_select(1, keep.to(x.device))
        logits = self.lm_head(head_in).float()
        loss = log_ppl = None
        if labels is not None and unshifted_loss:
            loss = nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1), ignore_index=-100)
        elif labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        if loss is not None:
            log_ppl = loss.clone().detach()
        hidden_states: Any = tuple(all_hidden) if all_hidden is not None else (x if details["return_head"] else None)
        output = HuginnCausalLMOutput(
            loss=loss,
            log_ppl=log_ppl,
            logits=logits if details["return_logits"] else None,
            latent_states=latent_states if details["return_latents"] else None,
            hidden_states=hidden_states,
            attentions=tuple(state.attentions) if state.attentions is not None else None,
            **{OUTPUT_CACHE_FIELD: cache},
        )
        return flags.finish(output)

    def prepare_inputs_for_generation(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """transformers' inputs of a generate step; the prefill (a step into an empty cache) does not compute
        `latent_states` unless the call asks for `output_details`: `generate` returns no latent states, and they are
        one hidden state per prompt token held for every row to the prefill's end (82.5 MiB per 8K row on
        Huginn-0125). Decode steps keep their inputs as they are (a captured step's key reads only scalar inputs)."""
        inputs = super().prepare_inputs_for_generation(*args, **kwargs)
        cache = generate_cache(inputs)
        if inputs.get("output_details") is None and (cache is None or cache.get_seq_length() == 0):
            inputs["output_details"] = {"return_latents": False}
        return inputs

    def _row_grouped(self, prefill_rows: int, cache: Any, **inputs: Any) -> HuginnCausalLMOutput | tuple | None:
        """`forward` over groups of rows (`prefill_rows`), or None when the call runs in one forward. What the whole
        batch draws from the RNG is drawn here, once, in the official order (the initial state, then the step
        sampler), and handed to each group: a zero state (`init_scale=0`, eval's default) as zeros of the group's
        rows, a random one as its rows of the batch's."""
        ids, embeds = inputs["input_ids"], inputs["input_embeds"]
        embeds = embeds if embeds is not None else inputs["inputs_embeds"]
        given = ids if ids is not None else embeds
        if given is None or given.dim() < 2 or given.shape[0] <= prefill_rows or given.shape[1] < 2:
            return None
        b, q_len = given.shape[:2]
        init_scale = inputs["init_scale"]
        if init_scale is None:
            init_scale = 1.0 if self.training else self.config.init_scale
        like = embeds if embeds is not None else self._part("wte").weight

        def zeros(n: int) -> torch.Tensor:
            return like.new_zeros((n, q_len, self.config.n_embd))

        states = inputs["input_states"]
        if states is None:  # the batch's draw (`forward` draws it from embeddings of this shape and dtype)
            states = self.initialize_state(like.new_empty((b, q_len, self.config.n_embd)), scale=init_scale)
            if not self.config.init_values["std"] * init_scale > 0:
                states = None  # zeros: each group gets zeros of its own rows, the batch's are not held
        no_grad, with_grad = self._resolve_steps(inputs["num_steps"])
        cache = default_cache(self, cache, use_cache=inputs["use_cache"], num_loops=no_grad + with_grad)
        groups = row_groups(prefill_rows, cache, b, q_len)
        if groups is None:  # one forward after all (a cache with cached positions): with the batch's draws
            return self.forward(**{**inputs, "input_states": zeros(b) if states is None else states,
                                 "num_steps": (no_grad, with_grad), "cache": cache})
        mask = inputs["attention_mask"]
        padded = mask is not None and not bool(mask.all())
        flags = OutputFlags.resolve(
            self.config, inputs["output_attentions"], inputs["output_hidden_states"], inputs["return_dict"]
        )

        def run(a: int, e: int, part: Any) -> Any:
            group_states = zeros(e - a) if states is None else states[a:e]
            return self.forward(**{
                **inputs, "input_ids": row_slice(ids, a, e), "input_embeds": row_slice(embeds, a, e), "inputs_embeds": None,
                "input_states": group_states, "attention_mask": row_slice(mask, a, e),
                "position_ids": row_slice(inputs["position_ids"], a, e), "num_steps": (no_grad, with_grad),
                "use_cache": inputs["use_cache"] if part is None else True, "cache": part, "return_dict": True,
                "keep_mask": inputs["keep_mask"] or padded,
            })  # fmt: skip

        return flags.finish(run_row_groups(cache, groups, b, run))
