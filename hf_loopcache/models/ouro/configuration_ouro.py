"""`OuroConfig`: reads the official Ouro `config.json` unchanged (`model_type="ouro"`)."""

from __future__ import annotations

from typing import Any

from transformers import PretrainedConfig

__all__ = ["OuroConfig"]


class OuroConfig(PretrainedConfig):
    r"""Configuration of an Ouro looped language model (ByteDance Ouro-1.4B / 2.6B and their Thinking variants).

    The field names and defaults are those of the official `configuration_ouro.py`, so a Hub `config.json` loads as
    is. Ouro runs all `num_hidden_layers` layers `total_ut_steps` times per token with one shared set of weights.

    Args:
        vocab_size (`int`, *optional*, defaults to 49152): vocabulary size.
        hidden_size (`int`, *optional*, defaults to 2048): residual width.
        intermediate_size (`int`, *optional*, defaults to 5632): SwiGLU width.
        num_hidden_layers (`int`, *optional*, defaults to 24): layers in the looped block.
        num_attention_heads (`int`, *optional*, defaults to 16): query heads.
        num_key_value_heads (`int`, *optional*, defaults to 16): key/value heads (Ouro uses MHA).
        head_dim (`int`, *optional*): head width; defaults to `hidden_size // num_attention_heads`.
        hidden_act (`str`, *optional*, defaults to `"silu"`): MLP activation.
        max_position_embeddings (`int`, *optional*, defaults to 65536): longest context trained for.
        initializer_range (`float`, *optional*, defaults to 0.02): std of the normal weight init.
        rms_norm_eps (`float`, *optional*, defaults to 1e-6): RMSNorm epsilon.
        use_cache (`bool`, *optional*, defaults to `True`): whether forward returns a cache by default.
        tie_word_embeddings (`bool`, *optional*, defaults to `False`): tie `lm_head` to the embeddings.
        rope_theta (`float`, *optional*, defaults to 1000000.0): RoPE base.
        rope_scaling (`dict`, *optional*): only `None` or `{"rope_type": "default"}` is supported.
        use_sliding_window, sliding_window, max_window_layers, layer_types: kept for config compatibility; released
            checkpoints use full attention everywhere and sliding windows are not supported.
        attention_dropout (`float`, *optional*, defaults to 0.0): kept for compatibility; inference only.
        total_ut_steps (`int`, *optional*, defaults to 4): loops per token (the model's default loop count).
        early_exit_threshold (`float`, *optional*, defaults to 1.0): cumulative exit probability at which a token's
            output is taken from an earlier loop (1.0 = the last loop in exact arithmetic).
        early_exit_step (`int`, *optional*): if set, outputs always come from this loop (0-based).
    """

    model_type = "ouro"
    keys_to_ignore_at_inference = ["past_key_values"]

    def __init__(
        self,
        vocab_size: int = 49152,
        hidden_size: int = 2048,
        intermediate_size: int = 5632,
        num_hidden_layers: int = 24,
        num_attention_heads: int = 16,
        num_key_value_heads: int | None = 16,
        head_dim: int | None = None,
        hidden_act: str = "silu",
        max_position_embeddings: int = 65536,
        initializer_range: float = 0.02,
        rms_norm_eps: float = 1e-6,
        use_cache: bool = True,
        tie_word_embeddings: bool = False,
        rope_theta: float = 1000000.0,
        rope_scaling: dict[str, Any] | None = None,
        use_sliding_window: bool = False,
        sliding_window: int | None = None,
        max_window_layers: int | None = None,
        layer_types: list[str] | None = None,
        attention_dropout: float = 0.0,
        total_ut_steps: int = 4,
        early_exit_threshold: float | None = 1.0,
        early_exit_step: int | None = None,
        bos_token_id: int | None = None,
        eos_token_id: int | list[int] | None = None,
        pad_token_id: int | None = None,
        **kwargs: Any,
    ):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads if num_key_value_heads is not None else num_attention_heads
        self.head_dim = head_dim if head_dim is not None else hidden_size // num_attention_heads
        self.hidden_act = hidden_act
        self.max_position_embeddings = max_position_embeddings
        self.initializer_range = initializer_range
        self.rms_norm_eps = rms_norm_eps
        self.use_cache = use_cache
        self.rope_theta = rope_theta
        # `rope_scaling` is a deprecated alias property of the base config in transformers 5; only the default
        # (unscaled) RoPE of the released checkpoints is supported, so it is validated and not stored
        rope_type = (rope_scaling or {}).get("rope_type", (rope_scaling or {}).get("type", "default"))
        if rope_type != "default":
            raise ValueError(f"`rope_scaling` must be None or of rope_type 'default', got {rope_scaling!r}")
        self.use_sliding_window = use_sliding_window
        self.sliding_window = sliding_window if use_sliding_window else None
        self.max_window_layers = max_window_layers if max_window_layers is not None else num_hidden_layers
        self.layer_types = layer_types if layer_types is not None else ["full_attention"] * num_hidden_layers
        self.attention_dropout = attention_dropout
        self.total_ut_steps = total_ut_steps
        self.early_exit_threshold = early_exit_threshold
        self.early_exit_step = early_exit_step
        super().__init__(  # type: ignore[call-arg]  # the base accepts these through **kwargs at runtime
            tie_word_embeddings=tie_word_embeddings,
            bos_token_id=bos_token_id,
            eos_token_id=eos_token_id,
            pad_token_id=pad_token_id,
            **kwargs,
        )
        self.validate_loop_fields()

    def validate_loop_fields(self) -> None:
        if self.total_ut_steps is None or self.total_ut_steps < 1:
            raise ValueError(f"`total_ut_steps` must be a positive int, got {self.total_ut_steps!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"`num_attention_heads` ({self.num_attention_heads}) must be a multiple of `num_key_value_heads` "
                f"({self.num_key_value_heads})"
            )
        if self.use_sliding_window or any(t != "full_attention" for t in self.layer_types):
            raise ValueError(
                "sliding-window layers are not supported (hf_loopcache's looped models attend over the full context in "
                "every (loop, layer) cell; see the README's native-models section): `use_sliding_window` must be "
                "False and every `layer_types` "
                f"entry 'full_attention', got use_sliding_window={self.use_sliding_window}, layer_types={self.layer_types}"
            )
