"""`HuginnConfig`: reads the official Huginn-0125 / Raven `config.json` unchanged (`model_type="huginn_raven"`)."""

from __future__ import annotations

import math
from typing import Any

from transformers import PretrainedConfig

__all__ = ["HuginnConfig"]


class HuginnConfig(PretrainedConfig):
    r"""Configuration of a Huginn / Raven recurrent-depth model (tomg-group-umd/huginn-0125).

    Field names and defaults are those of the official `raven_config_minimal.py`. A prelude of
    `n_layers_in_prelude` blocks embeds the tokens, a core of `n_layers_in_recurrent_block` blocks runs
    `num_steps` times (default `mean_recurrence`) on a state re-injected with the prelude output every step, and a
    coda of `n_layers_in_coda` blocks produces the logits.

    Args:
        n_embd (`int`, *optional*, defaults to 5280): residual width (`hidden_size`).
        n_heads (`int`, *optional*, defaults to 55): attention heads (MHA; `num_attention_heads`).
        n_layers (`int`, *optional*): prelude + core + coda blocks (`num_hidden_layers`); derived when omitted.
        block_size (`int`, *optional*, defaults to 4096): context the official code precomputes RoPE for; this
            implementation computes RoPE for any position.
        vocab_size (`int`, *optional*, defaults to 65536): vocabulary size.
        intermediate_size (`int`, *optional*, defaults to 17920): gated MLP width.
        norm_eps (`float`, *optional*, defaults to 1e-6): RMSNorm epsilon.
        n_layers_in_recurrent_block, n_layers_in_prelude, n_layers_in_coda (`int`): stage sizes (4, 2, 2).
        mean_recurrence (`int`, *optional*, defaults to 32): default number of core steps at inference.
        mean_backprop_depth (`int`, *optional*, defaults to 8): steps with gradient in training's depth sampler.
        qk_bias (`bool`, *optional*, defaults to `True`): learned additive bias on queries and keys before RoPE.
        tie_embeddings (`bool`, *optional*, defaults to `True`): tie `lm_head` to `transformer.wte`.
        rope_base (`float`, *optional*, defaults to 50000): RoPE base.
        test_time_noise (`float`, *optional*, defaults to 0): must be 0 (noise injection is not implemented).
        init_scale (`float`, *optional*, defaults to 0.0): inference default of `forward`'s `init_scale` (scale of the
            random initial core state). 0 gives a zero state: deterministic outputs, the same in `generate`,
            scoring and self-speculative drafts. The official code draws a random state (`init_scale=1.0`) on every
            call; set 1.0 here (or pass `init_scale=1.0`) for that. Training mode keeps the official random state.
        Other official fields (`architecture_class_name`, `block_class_name`, `init_strategy`, ...) are kept as is;
        values other than the released ones raise.
    """

    model_type = "huginn_raven"
    keys_to_ignore_at_inference = ["past_key_values"]
    attribute_map = {"num_attention_heads": "n_heads", "hidden_size": "n_embd", "num_hidden_layers": "n_layers"}

    def __init__(
        self,
        n_embd: int | None = None,
        n_heads: int | None = None,
        n_layers: int | None = None,
        block_size: int = 4096,
        vocab_size: int = 65536,
        padding_multiple: int = 4096,
        tie_embeddings: bool | None = None,
        intermediate_size: int = 17920,
        bias: bool = False,
        architecture_class_name: str = "RecurrentGPT",
        block_class_name: str = "SandwichBlock",
        norm_class_name: str = "RMSNorm_llama",
        norm_eps: float = 1e-6,
        mlp_class_name: str = "GatedMLP",
        nonlin_name: str = "SiLU",
        init_strategy: str = "takase",
        init_orthogonal: bool = False,
        state_init: str = "like-init",
        injection_type: str = "linear",
        n_layers_in_recurrent_block: int = 4,
        mean_recurrence: int = 32,
        sampling_scheme: str = "poisson-lognormal-filling",
        mean_backprop_depth: int = 8,
        n_layers_in_prelude: int = 2,
        n_layers_in_coda: int = 2,
        qk_bias: bool = True,
        activation_checkpoint_impl: str = "per-iteration",
        rope_base: float = 50_000,
        test_time_noise: float = 0.0,
        test_time_noise_type: str = "fixed",
        use_cache: bool = True,
        init_scale: float = 0.0,
        **kwargs: Any,
    ):
        # the official config.json spells some fields by their standard names; the rest are derived below
        n_embd = n_embd if n_embd is not None else kwargs.pop("hidden_size", 5280)
        n_heads = n_heads if n_heads is not None else kwargs.pop("num_attention_heads", 55)
        n_layers = n_layers if n_layers is not None else kwargs.pop("num_hidden_layers", None)
        tie_word_embeddings = kwargs.pop("tie_word_embeddings", True)
        tie_embeddings = tie_embeddings if tie_embeddings is not None else tie_word_embeddings
        for key in (
            "hidden_size",
            "num_attention_heads",
            "num_hidden_layers",
            "num_key_value_heads",
            "head_dim",
            "init_values",
            "effective_expected_depth",
        ):
            kwargs.pop(key, None)
        self.n_embd = n_embd
        self.n_heads = n_heads
        self.n_layers = (
            n_layers if n_layers is not None else n_layers_in_prelude + n_layers_in_recurrent_block + n_layers_in_coda
        )
        self.block_size = block_size
        self.vocab_size = self.padded_vocab_size = vocab_size
        self.padding_multiple = padding_multiple
        self.tie_embeddings = tie_embeddings
        self.intermediate_size = intermediate_size
        self.bias = bias
        self.architecture_class_name = architecture_class_name
        self.block_class_name = block_class_name
        self.norm_class_name = norm_class_name
        self.norm_eps = norm_eps
        self.mlp_class_name = mlp_class_name
        self.nonlin_name = nonlin_name
        self.init_strategy = init_strategy
        self.init_orthogonal = init_orthogonal
        self.state_init = state_init
        self.injection_type = injection_type
        self.n_layers_in_recurrent_block = n_layers_in_recurrent_block
        self.mean_recurrence = mean_recurrence
        self.sampling_scheme = sampling_scheme
        self.mean_backprop_depth = mean_backprop_depth
        self.n_layers_in_prelude = n_layers_in_prelude
        self.n_layers_in_coda = n_layers_in_coda
        self.qk_bias = qk_bias
        self.activation_checkpoint_impl = activation_checkpoint_impl
        self.rope_base = rope_base
        self.test_time_noise = test_time_noise
        self.test_time_noise_type = test_time_noise_type
        self.num_key_value_heads = n_heads
        self.head_dim = n_embd // n_heads
        self.use_cache = use_cache
        self.init_scale = init_scale
        super().__init__(tie_word_embeddings=tie_embeddings, **kwargs)  # type: ignore[call-arg]
        self._validate()

    @property
    def effective_expected_depth(self) -> int:
        return (
            self.n_layers_in_prelude + self.n_layers_in_coda + self.n_layers_in_recurrent_block * self.mean_recurrence
        )

    @property
    def init_values(self) -> dict[str, float]:
        """The official initialisation scales (also the embedding scale `sqrt(n_embd)`)."""
        std = math.sqrt(2 / (5 * self.n_embd))
        return {
            "std": std,
            "out_proj": std / math.sqrt(2 * self.effective_expected_depth),
            "embedding": std,
            "embed_scale": math.sqrt(self.n_embd),
        }

    def _validate(self) -> None:
        if self.n_embd % self.n_heads:
            raise ValueError(f"`n_embd` ({self.n_embd}) must be a multiple of `n_heads` ({self.n_heads})")
        if self.n_layers != self.n_layers_in_prelude + self.n_layers_in_recurrent_block + self.n_layers_in_coda:
            raise ValueError(
                f"`n_layers` ({self.n_layers}) must equal n_layers_in_prelude + n_layers_in_recurrent_block + "
                f"n_layers_in_coda ({self.n_layers_in_prelude} + {self.n_layers_in_recurrent_block} + {self.n_layers_in_coda})"
            )
        fixed = {
            "block_class_name": "SandwichBlock",
            "norm_class_name": "RMSNorm_llama",
            "mlp_class_name": "GatedMLP",
            "nonlin_name": "SiLU",
            "injection_type": "linear",
            "state_init": "like-init",
        }
        for name, allowed in fixed.items():
            if getattr(self, name) != allowed:
                raise ValueError(
                    f"`{name}` must be {allowed!r} (the released architecture), got {getattr(self, name)!r}"
                )
        if self.test_time_noise:
            raise ValueError(
                f"`test_time_noise` must be 0 (noise injection is not implemented), got {self.test_time_noise}"
            )
        if isinstance(self.init_scale, bool) or not isinstance(self.init_scale, (int, float)) or self.init_scale < 0:
            raise ValueError(f"`init_scale` must be a non-negative number, got {self.init_scale!r}")
        if self.mean_recurrence < 1:
            raise ValueError(f"`mean_recurrence` must be a positive int, got {self.mean_recurrence}")
