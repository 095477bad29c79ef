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
