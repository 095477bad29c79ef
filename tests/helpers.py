"""Tiny random models of both architectures (fp32, CPU), built from configs, never downloaded."""

from __future__ import annotations

import torch

from hf_loopcache import HuginnConfig, HuginnForCausalLM, OuroConfig, OuroForCausalLM


def tiny_ouro(seed: int = 0, **overrides) -> OuroForCausalLM:
    torch.manual_seed(seed)
    kwargs = dict(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        total_ut_steps=3,
        max_position_embeddings=512,
        rope_theta=10000.0,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        initializer_range=0.2,
    )
    kwargs.update(overrides)
    return OuroForCausalLM(OuroConfig(**kwargs)).eval()


def tiny_huginn(seed: int = 0, **overrides) -> HuginnForCausalLM:
    torch.manual_seed(seed)
    kwargs = dict(
        n_embd=32,
        n_heads=4,
        n_layers_in_prelude=2,
        n_layers_in_recurrent_block=2,
        n_layers_in_coda=2,
        intermediate_size=48,
        vocab_size=64,
        mean_recurrence=4,
        block_size=64,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    kwargs.update(overrides)
    model = HuginnForCausalLM(HuginnConfig(**kwargs)).eval()
    with torch.no_grad():  # the official init is tiny; larger weights make every test more sensitive
        for name, p in model.named_parameters():
            if "norm" in name or "ln_f" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
            else:
                p.copy_(0.15 * torch.randn_like(p))
    return model


def make_model(arch: str, seed: int = 0, **overrides):
    return tiny_ouro(seed, **overrides) if arch == "ouro" else tiny_huginn(seed, **overrides)


def call_kwargs(arch: str) -> dict:
    """Extra forward/generate kwargs that make a model deterministic (Huginn: zero initial state)."""
    return {} if arch == "ouro" else {"init_scale": 0.0}


@torch.no_grad()
def teacher_forced_logprob(model, sequence: torch.Tensor, prompt_length: int, cache, **kwargs) -> float:
    """Sum of log p(token) of `sequence[0, prompt_length:]` when it is fed through `cache` one token at a time: the
    score beam search must report for that beam (`length_penalty=0`) if its cache rows followed the beam."""
    logits = model(sequence[:, :prompt_length], past_key_values=cache, use_cache=True, **kwargs).logits[:, -1]
    total = 0.0
    for t in range(prompt_length, sequence.shape[1]):
        total += float(torch.log_softmax(logits.double(), -1)[0, sequence[0, t]])
        if t + 1 < sequence.shape[1]:
            logits = model(sequence[:, t : t + 1], past_key_values=cache, use_cache=True, **kwargs).logits[:, -1]
    return total
