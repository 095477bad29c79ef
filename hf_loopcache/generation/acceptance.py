"""The acceptance rule of speculative decoding, as pure functions of tensors (no model, no cache, no randomness inside).

Greedy: accept the longest prefix of the draft that agrees with the verifier's argmax, then emit the verifier's token
at the first disagreement (or after the last draft token): `k + 1` tokens per verification, `0 <= k <= gamma`.

Sampling (Leviathan et al., 2023; Chen et al., 2023): draft token `x_i ~ q_i` is accepted with probability
`min(1, p_i(x_i) / q_i(x_i))`, in order, until the first rejection at `k`; the emitted token there is drawn from the
residual `norm(max(0, p_k - q_k))`, or from `p_gamma` when all `gamma` drafts were accepted. Every emitted token is
then distributed exactly as the target `p` (given the tokens before it).
"""

from __future__ import annotations

import torch

__all__ = ["greedy_accept", "sample_from_uniform", "speculative_accept"]


def _check_block(draft_tokens: torch.Tensor, target: torch.Tensor, name: str) -> None:
    if draft_tokens.dim() != 2:
        raise ValueError(f"`draft_tokens` must be [batch, gamma], got shape {tuple(draft_tokens.shape)}")
    b, gamma = draft_tokens.shape
    if target.shape[0] != b or target.shape[1] != gamma + 1:
        raise ValueError(
            f"`{name}` must be [batch={b}, gamma + 1={gamma + 1}, ...] for draft_tokens {tuple(draft_tokens.shape)}, "
            f"got shape {tuple(target.shape)}"
        )


def greedy_accept(draft_tokens: torch.Tensor, target_tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy acceptance: longest agreeing prefix plus one verifier token.

    Args:
        draft_tokens (`torch.LongTensor` of shape `[B, gamma]`): the drafted tokens `y_1 .. y_gamma`.
        target_tokens (`torch.LongTensor` of shape `[B, gamma + 1]`): the verifier's argmax after the committed
            context and after each draft prefix (`z_0 .. z_gamma`; `z_i` is what follows `y_1 .. y_i`).

    Returns:
        `accept_length` (`[B]`, long): `k`, the number of draft tokens accepted; `next_token` (`[B]`, long): `z_k`.
        A row emits `y_1 .. y_k, z_k`.
    """
    _check_block(draft_tokens, target_tokens, "target_tokens")
    agree = draft_tokens == target_tokens[:, :-1]
    accept_length = agree.long().cumprod(dim=-1).sum(dim=-1)
    next_token = target_tokens.gather(1, accept_length[:, None]).squeeze(1)
    return accept_length, next_token


def sample_from_uniform(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw of one token per row: the first token whose cumulative probability exceeds `uniform * total`.

    Args:
        probs (`torch.Tensor` of shape `[B, V]`): non-negative weights (need not sum to 1).
        uniform (`torch.Tensor` of shape `[B]`): values in `[0, 1)`.
    """
    cdf = probs.cumsum(dim=-1)
    threshold = (uniform.to(cdf.dtype) * cdf[:, -1])[:, None]
    token = torch.searchsorted(cdf, threshold, right=True).squeeze(1)
    return token.clamp(max=probs.shape[-1] - 1)  # u * total rounding up to the total


def speculative_accept(
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    draft_tokens: torch.Tensor,
    uniforms: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative-sampling acceptance (rejection sampling against the draft distribution).

    Args:
        draft_probs (`torch.Tensor` of shape `[B, gamma, V]`): `q_i`, the distributions the drafts were drawn from.
        target_probs (`torch.Tensor` of shape `[B, gamma + 1, V]`): `p_0 .. p_gamma`, the verifier's distributions
            (after the same logits processors and warpers as the draft's).
        draft_tokens (`torch.LongTensor` of shape `[B, gamma]`): `x_i ~ q_i`.
        uniforms (`torch.Tensor` of shape `[B, gamma + 1]`): independent U[0, 1) draws; `uniforms[:, i]` decides draft
            `i`, `uniforms[:, gamma]` draws the emitted token at the first rejection (or the bonus token).

    Returns:
        `accept_length` (`[B]`, long): `k`; `next_token` (`[B]`, long): the token emitted after the `k` accepted drafts.
    """
    _check_block(draft_tokens, target_probs, "target_probs")
    b, gamma = draft_tokens.shape
    if draft_probs.shape != (b, gamma, target_probs.shape[-1]):
        raise ValueError(
            f"`draft_probs` must be [batch, gamma, vocab] = {(b, gamma, target_probs.shape[-1])}, got "
            f"{tuple(draft_probs.shape)}"
        )
    if uniforms.shape != (b, gamma + 1):
        raise ValueError(f"`uniforms` must be [batch, gamma + 1] = {(b, gamma + 1)}, got {tuple(uniforms.shape)}")
    idx = draft_tokens[..., None]
    p_x = target_probs[:, :gamma].gather(2, idx).squeeze(2)  # p_i(x_i)
    q_x = draft_probs.gather(2, idx).squeeze(2)  # q_i(x_i)
    # accept x_i iff u_i < p_i(x_i) / q_i(x_i), written without the division (q_i(x_i) > 0 for a drawn token)
    accepted = uniforms[:, :gamma].to(p_x.dtype) * q_x < p_x
    accept_length = accepted.long().cumprod(dim=-1).sum(dim=-1)
    # the emitted token: from norm(max(0, p_k - q_k)) at a rejection, from p_gamma after gamma acceptances
    pad = draft_probs.new_zeros(b, 1, draft_probs.shape[-1])
    q_k = torch.cat([draft_probs, pad], dim=1).gather(1, accept_length[:, None, None].expand(-1, 1, pad.shape[-1]))
    p_k = target_probs.gather(1, accept_length[:, None, None].expand(-1, 1, pad.shape[-1]))
    residual = (p_k - q_k).clamp(min=0).squeeze(1)
    # p_k == q_k leaves no residual mass; then no rejection can happen there (p/q = 1), so p_k itself is drawn
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p_k.squeeze(1))
    next_token = sample_from_uniform(residual, uniforms[:, gamma])
    return accept_length, next_token
