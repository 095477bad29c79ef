"""The acceptance rule as pure functions: greedy prefix matching and speculative sampling's output distribution."""

from __future__ import annotations

import pytest
import torch

from hf_loopcache.generation import greedy_accept, sample_from_uniform, speculative_accept

# chi-square critical values at significance 1e-4 (df = vocab - 1), so a seeded test fails only on a wrong rule
_CHI2_CRIT_1E4 = {5: 25.74, 7: 29.88}


@pytest.mark.parametrize(
    "draft, target, k, nxt",
    [
        pytest.param([4, 5, 6], [4, 5, 6, 7], 3, 7, id="all-accepted-bonus"),
        pytest.param([4, 5, 6], [9, 5, 6, 7], 0, 9, id="first-rejected"),
        pytest.param([4, 5, 6], [4, 8, 6, 7], 1, 8, id="middle-rejected"),
        pytest.param([4, 5, 6], [4, 5, 1, 7], 2, 1, id="last-rejected"),
        pytest.param([4, 9, 6], [4, 5, 6, 7], 1, 5, id="later-agreement-ignored"),
    ],
)
def test_greedy_accept_longest_agreeing_prefix_plus_one(draft, target, k, nxt):
    accept_length, next_token = greedy_accept(torch.tensor([draft]), torch.tensor([target]))
    assert accept_length.tolist() == [k] and next_token.tolist() == [nxt]


def test_greedy_accept_rows_are_independent():
    draft = torch.tensor([[1, 2], [1, 2], [3, 3]])
    target = torch.tensor([[1, 2, 5], [1, 0, 5], [0, 3, 3]])
    accept_length, next_token = greedy_accept(draft, target)
    assert accept_length.tolist() == [2, 1, 0] and next_token.tolist() == [5, 0, 0]


def test_acceptance_rejects_bad_shapes():
    with pytest.raises(ValueError, match="target_tokens"):
        greedy_accept(torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="draft_probs"):
        speculative_accept(
            torch.rand(1, 2, 5), torch.rand(1, 3, 4), torch.zeros(1, 2, dtype=torch.long), torch.rand(1, 3)
        )
    with pytest.raises(ValueError, match="uniforms"):
        speculative_accept(
            torch.rand(1, 2, 4), torch.rand(1, 3, 4), torch.zeros(1, 2, dtype=torch.long), torch.rand(1, 2)
        )


def test_sample_from_uniform_is_the_inverse_cdf():
    probs = torch.tensor([[0.1, 0.0, 0.6, 0.3]]).expand(5, -1)
    u = torch.tensor([0.0, 0.099, 0.1, 0.69, 0.999999])
    assert sample_from_uniform(probs, u).tolist() == [0, 0, 2, 2, 3]
    assert sample_from_uniform(torch.tensor([[2.0, 2.0]]), torch.tensor([0.6])).tolist() == [1]  # unnormalised


def _chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a token of probability 0 was emitted"
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


@pytest.mark.parametrize("vocab, gamma, seed", [(6, 3, 0), (8, 2, 1)], ids=["V6-gamma3", "V8-gamma2"])
def test_speculative_sampling_emits_the_target_distribution(vocab, gamma, seed):
    """Every emitted token, at every block index, is distributed as the target `p` (chi-square over 200k draws), and
    draft `i` is accepted with probability `sum_x min(p_i(x), q_i(x))` (Leviathan et al. Thm. 1 / Cor.)."""
    gen = torch.Generator().manual_seed(seed)
    n = 200_000
    p = torch.softmax(2 * torch.randn(gamma + 1, vocab, generator=gen, dtype=torch.float64), -1)
    p[0, 0] = 0.0  # a token the target never emits, the draft often proposes
    p = p / p.sum(-1, keepdim=True)
    q = torch.softmax(2 * torch.randn(gamma, vocab, generator=gen, dtype=torch.float64), -1)
    q[0, 0] += 0.5
    q = q / q.sum(-1, keepdim=True)
    draft_tokens = torch.stack([torch.multinomial(q[i], n, replacement=True, generator=gen) for i in range(gamma)], 1)
    uniforms = torch.rand(n, gamma + 1, generator=gen, dtype=torch.float64)
    accept_length, next_token = speculative_accept(
        q[None].expand(n, -1, -1), p[None].expand(n, -1, -1), draft_tokens, uniforms
    )
    for j in range(gamma + 1):  # the token emitted at block index j exists iff accept_length >= j
        rows = accept_length >= j
        emitted = torch.where(accept_length[rows] > j, draft_tokens[rows, j] if j < gamma else -1, next_token[rows])
        counts = torch.bincount(emitted, minlength=vocab).double()
        assert _chi2(counts, p[j]) < _CHI2_CRIT_1E4[vocab - 1], f"block index {j}"
    for i in range(gamma):  # acceptance rate of draft i given that it is tested
        tested = accept_length >= i
        rate = float((accept_length[tested] > i).double().mean())
        expected = float(torch.minimum(p[i], q[i]).sum())
        assert abs(rate - expected) < 5 * (expected * (1 - expected) / int(tested.sum())) ** 0.5 + 1e-9


def test_speculative_sampling_with_equal_distributions_accepts_everything():
    probs = torch.softmax(torch.randn(1, 4, 5, generator=torch.Generator().manual_seed(0)), -1).expand(64, -1, -1)
    drafts = torch.randint(0, 5, (64, 3), generator=torch.Generator().manual_seed(1))
    uniforms = torch.rand(64, 4, generator=torch.Generator().manual_seed(2))
    accept_length, _ = speculative_accept(probs[:, :3], probs, drafts, uniforms)
    assert accept_length.tolist() == [3] * 64


def test_one_hot_distributions_reduce_to_the_greedy_rule():
    target_tokens = torch.tensor([[3, 1, 4, 1], [3, 2, 0, 0]])
    draft_tokens = torch.tensor([[3, 1, 2], [3, 1, 2]])
    p = torch.nn.functional.one_hot(target_tokens, 6).double()
    q = torch.nn.functional.one_hot(draft_tokens, 6).double()
    uniforms = torch.rand(2, 4, generator=torch.Generator().manual_seed(0))
    assert [t.tolist() for t in speculative_accept(q, p, draft_tokens, uniforms)] == [
        t.tolist() for t in greedy_accept(draft_tokens, target_tokens)
    ]
