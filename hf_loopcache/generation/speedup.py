"""What self-speculation should gain, and the block size that gains most: RIPE's Eq. (7) and Eq. (8).

With flat acceptance `alpha` (each draft token accepted with the same probability, given the earlier ones were; RIPE
Sec. 3.4 found it flat within 0.06 across positions), a verification of `gamma` drafts emits `k + 1` tokens, `k` the
accepted drafts: `P(k) = alpha^k (1 - alpha)` for `k < gamma` and `alpha^gamma` for `k = gamma`. Eq. (7) is its
mean, `tau(alpha, gamma) = (1 - alpha^(gamma + 1)) / (1 - alpha)`. A block costs `gamma` drafts of `c` sequential
steps each (`c = c(d) / c(R)`, a draft forward's cost over a full-depth step's) and one verification of about one
step, times an overhead `eta`; Eq. (8): `S = tau(alpha, gamma) / (eta (gamma c + 1))`. Longer blocks emit more per
verification but pay for drafts that are rejected more often: `best_block_size` is the `gamma` that maximises Eq. (8)
(`eta` does not move it).

These are the steady state of one row. A batch decoding a fixed number of tokens per row ends with its slowest row,
which costs a few percent more at batch 8 (`benchmarks/bench_selfspec.py`, `batch_tokens_per_verification`).
"""

from __future__ import annotations

__all__ = ["best_block_size", "expected_block_tokens", "expected_speedup"]


def _check(acceptance: float, block_size: int | None = None, cost_ratio: float | None = None) -> None:
    if isinstance(acceptance, bool) or not isinstance(acceptance, (int, float)) or not 0.0 <= acceptance <= 1.0:
        raise ValueError(f"`acceptance` must be a number in [0, 1], got {acceptance!r}")
    if block_size is not None and (isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 0):
        raise ValueError(f"`block_size` must be a non-negative int (draft tokens per verification), got {block_size!r}")
    if cost_ratio is not None and (
        isinstance(cost_ratio, bool) or not isinstance(cost_ratio, (int, float)) or not cost_ratio > 0.0
    ):
        raise ValueError(f"`cost_ratio` must be a positive number (a draft forward over a full step), got {cost_ratio!r}")


def expected_block_tokens(acceptance: float, block_size: int) -> float:
    """RIPE Eq. (7): tokens a verification emits on average, `(1 - alpha^(gamma + 1)) / (1 - alpha)` (`gamma + 1` at
    `alpha = 1`), for per-token acceptance `acceptance` and `block_size` drafts."""
    _check(acceptance, block_size)
    if acceptance >= 1.0:
        return float(block_size + 1)
    return (1.0 - acceptance ** (block_size + 1)) / (1.0 - acceptance)


def expected_speedup(acceptance: float, block_size: int, cost_ratio: float, overhead: float = 1.0) -> float:
    """RIPE Eq. (8): speed-up over sequential decoding, `tau(alpha, gamma) / (eta (gamma c + 1))`, with `cost_ratio`
    `c` a draft forward's cost over a full-depth step's and `overhead` `eta` (1: a verification costs one step)."""
    _check(acceptance, block_size, cost_ratio)
    if isinstance(overhead, bool) or not isinstance(overhead, (int, float)) or not overhead > 0.0:
        raise ValueError(f"`overhead` must be a positive number, got {overhead!r}")
    return expected_block_tokens(acceptance, block_size) / (overhead * (block_size * cost_ratio + 1.0))


def best_block_size(acceptance: float, cost_ratio: float, max_block_size: int = 16) -> int:
    """The `block_size` in `1 .. max_block_size` with the largest Eq. (8) speed-up (the smaller on a tie). E.g. at
    the tiny-ouro fixture's acceptance with 2 of 4 loops (0.83, a draft at half a step) it is 2; at RIPE's Huginn
    numbers (4 of 32 steps, c = 20 / 132) 5 for the full cache's acceptance 0.81 and beyond 8 for the deepest
    plane's 0.93 (RIPE Fig. 5b)."""
    _check(acceptance, None, cost_ratio)
    if isinstance(max_block_size, bool) or not isinstance(max_block_size, int) or max_block_size < 1:
        raise ValueError(f"`max_block_size` must be a positive int, got {max_block_size!r}")
    gains = [expected_speedup(acceptance, g, cost_ratio) for g in range(1, max_block_size + 1)]
    return 1 + gains.index(max(gains))
