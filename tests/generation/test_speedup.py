"""RIPE Eq. (7) and Eq. (8) (`hf_loopcache.generation.speedup`): the expected tokens per verification against the
distribution it is the mean of, the speed-up against the paper's own numbers, and the best block size."""

from __future__ import annotations

import pytest

from hf_loopcache.generation import best_block_size, expected_block_tokens, expected_speedup

#: RIPE Sec. 3.4 on Huginn-0125: c(d) = n_pre + d n_core + n_coda layer passes, 2 + 4 d + 2; R = 32 steps
HUGINN_C4 = (2 + 4 * 4 + 2) / (2 + 4 * 32 + 2)


@pytest.mark.parametrize("alpha", [0.0, 0.3, 0.81, 0.97, 1.0])
@pytest.mark.parametrize("gamma", [0, 1, 4, 9])
def test_eq7_is_the_mean_of_the_tokens_a_verification_emits(alpha, gamma):
    """k accepted drafts with P(k) = alpha^k (1 - alpha) below gamma and alpha^gamma at gamma; k + 1 tokens emitted."""
    pmf = [alpha**k * (1 - alpha) for k in range(gamma)] + [alpha**gamma]
    assert sum(pmf) == pytest.approx(1.0)
    mean = sum((k + 1) * p for k, p in enumerate(pmf))
    assert expected_block_tokens(alpha, gamma) == pytest.approx(mean, rel=1e-12)


def test_eq8_reproduces_the_papers_huginn_figures():
    """RIPE Sec. 3.4 (d = 4 of 32 steps, eta = 1.07): the full cache (alpha 0.81) peaks at gamma 5, about 1.98x; the
    deepest plane (alpha 0.93) is still rising at gamma 8, about 2.87x; with eta = 1 and d = gamma = 4 the paper's
    Eq. (8) gives 2.24x and 2.80x from its measured block counts (tau 3.40 and 4.33 predicted from the alphas)."""
    full = [expected_speedup(0.81, g, HUGINN_C4, overhead=1.07) for g in range(1, 13)]
    deep = [expected_speedup(0.93, g, HUGINN_C4, overhead=1.07) for g in range(1, 13)]
    assert max(full) == full[4] and full[4] == pytest.approx(1.98, rel=0.02)
    assert deep[7] > deep[6] and deep[7] == pytest.approx(2.87, rel=0.02)
    assert expected_block_tokens(0.81, 4) == pytest.approx(3.40, abs=0.05)
    assert expected_speedup(0.81, 4, HUGINN_C4) == pytest.approx(3.43 / (4 * HUGINN_C4 + 1), rel=0.01)
    assert expected_speedup(0.81, 4, HUGINN_C4, overhead=2.0) == pytest.approx(expected_speedup(0.81, 4, HUGINN_C4) / 2)


def test_best_block_size():
    """The argmax of Eq. (8) over 1 .. max_block_size: 5 and 10 for the paper's Huginn alphas (eta does not move it),
    2 for the tiny-ouro fixture's (0.83 at 2 of 4 loops, a draft at half a step: 1.25x against 1.23x at 3 and
    1.18x at 4), 1 when drafting costs as much as a step; bounded by `max_block_size`."""
    assert best_block_size(0.81, HUGINN_C4) == 5
    assert best_block_size(0.93, HUGINN_C4) == 10 and best_block_size(0.93, HUGINN_C4, max_block_size=8) == 8
    assert best_block_size(0.8265, 0.5) == 2
    assert expected_speedup(0.8265, 2, 0.5) > expected_speedup(0.8265, 3, 0.5) > expected_speedup(0.8265, 4, 0.5)
    assert best_block_size(0.9, 1.0) == 1 and best_block_size(1.0, 0.01, max_block_size=6) == 6


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: expected_block_tokens(1.2, 4), "`acceptance` must be a number in \\[0, 1\\], got 1.2"),
        (lambda: expected_block_tokens(True, 4), "`acceptance`"),
        (lambda: expected_block_tokens(0.5, -1), "`block_size` must be a non-negative int"),
        (lambda: expected_speedup(0.5, 4, 0.0), "`cost_ratio` must be a positive number"),
        (lambda: expected_speedup(0.5, 4, 0.5, overhead=0), "`overhead` must be a positive number"),
        (lambda: best_block_size(0.5, 0.5, max_block_size=0), "`max_block_size` must be a positive int"),
    ],
)
def test_bad_arguments_are_named(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_layer_cost_ratio_counts_layer_passes():
    """RIPE Sec. 3.4's count: Huginn-0125 (2 + 4 x 32 + 2 layers) drafting 4 steps is 20 / 132; Ouro-1.4B (24 layers
    x 4 loops, nothing outside the loop) drafting 2 loops is one half; the verification depth defaults to the
    layout's."""
    from hf_loopcache import LoopLayout
    from hf_loopcache.generation import layer_cost_ratio

    huginn = LoopLayout(n_core=4, num_loops=32, num_kv_heads=55, head_dim=96, n_prelude=2, n_coda=2)
    ouro = LoopLayout(n_core=24, num_loops=4, num_kv_heads=16, head_dim=128)
    assert layer_cost_ratio(huginn, 4) == pytest.approx(HUGINN_C4, rel=1e-12)
    assert layer_cost_ratio(huginn, 4, 16) == pytest.approx(20 / 68, rel=1e-12)
    assert layer_cost_ratio(ouro, 2) == 0.5 and layer_cost_ratio(ouro, 1, 3) == pytest.approx(1 / 3)
    with pytest.raises(ValueError, match="`draft_loops` must be a positive int, got 0"):
        layer_cost_ratio(ouro, 0)


def _blocks(rule, alpha: float, rows: int, blocks: int, seed: int = 0) -> list[int]:
    """Drive `rule` with blocks drawn from Eq. 7's model at `alpha` (rows i.i.d.); the block sizes it took."""
    import random

    rng = random.Random(seed)
    taken = []
    for _ in range(blocks):
        gamma = rule.block_size()
        taken.append(gamma)
        accepted = []
        for _ in range(rows):
            k = 0
            while k < gamma and rng.random() < alpha:
                k += 1
            accepted.append(k)
        rule.update(accepted, gamma, [True] * rows)
    return taken


@pytest.mark.parametrize("alpha", [0.3, 0.6, 0.83, 0.95])
def test_adaptive_block_size_estimates_alpha_whatever_the_block_sizes(alpha):
    """Accepted over tested drafts is the maximum-likelihood alpha of Eq. 7's model, unbiased across block sizes: a
    rule driven by blocks at `alpha` settles within 0.02 of it (4,000 rows-blocks, prior weight 8), and its
    choice is then `best_block_size` at the estimate."""
    from hf_loopcache.generation import AdaptiveBlockSize

    rule = AdaptiveBlockSize(0.3, 8)
    _blocks(rule, alpha, rows=8, blocks=500)
    assert rule.acceptance == pytest.approx(alpha, abs=0.02)
    assert rule.block_size() == best_block_size(rule.acceptance, 0.3, 8)


def test_adaptive_block_size_follows_eq8():
    """Before any block: Eq. (8)'s best at the prior (0.8). Then: the tiny-ouro fixture's rate at half a step settles
    on 2 (Eq. 8's best); the paper's deepest-plane Huginn rate on the largest block allowed; drafts that are never
    accepted on 1; rows marked finished and blocks of 0 drafts do not count."""
    from hf_loopcache.generation import AdaptiveBlockSize

    assert AdaptiveBlockSize(0.5, 8).block_size() == best_block_size(0.8, 0.5, 8) == 2
    assert AdaptiveBlockSize(HUGINN_C4, 6).block_size() == best_block_size(0.8, HUGINN_C4, 6) == 5
    assert _blocks(AdaptiveBlockSize(0.5, 8), 0.8265, 8, 300)[-100:] == [2] * 100
    assert _blocks(AdaptiveBlockSize(HUGINN_C4, 8), 0.93, 8, 300)[-100:] == [8] * 100
    assert _blocks(AdaptiveBlockSize(HUGINN_C4, 8), 0.0, 1, 100)[-50:] == [1] * 50
    rule = AdaptiveBlockSize(0.5, 8, prior_acceptance=0.5, prior_tokens=2)
    rule.update([3, 0], 3, [True, False])  # row 1 finished: its 0 is not a rejection
    assert (rule.accepted, rule.tested) == (3, 3) and rule.acceptance == pytest.approx(4 / 5)
    rule.update([0], 0, [True])
    assert (rule.accepted, rule.tested) == (3, 3)
    rule.update([1, 4], 4, [True, True])  # 1 of 2 tested, then 4 of 4 (nothing rejected at a full block)
    assert (rule.accepted, rule.tested) == (8, 9)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(cost_ratio=0.0, max_block_size=4), "`cost_ratio` must be a positive number"),
        (dict(cost_ratio=0.5, max_block_size=0), "`max_block_size` must be a positive int"),
        (dict(cost_ratio=0.5, max_block_size=4, prior_acceptance=1.5), "`prior_acceptance` must be a number in"),
        (dict(cost_ratio=0.5, max_block_size=4, prior_tokens=0), "`prior_tokens` must be a positive number"),
    ],
)
def test_adaptive_block_size_arguments_are_named(kwargs, match):
    from hf_loopcache.generation import AdaptiveBlockSize

    with pytest.raises(ValueError, match=match):
        AdaptiveBlockSize(**kwargs)
