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

`AdaptiveBlockSize` applies `best_block_size` while decoding (`self_speculative(..., block_size="auto")`): the
acceptance is estimated from the blocks verified so far (under Eq. 7's model a row that accepts `k` of `gamma` drafts
tested `min(k + 1, gamma)` of them, so accepted over tested is the maximum-likelihood `alpha`, whatever the block
sizes), and the cost ratio is `layer_cost_ratio` (layer passes of a draft over a full-depth step's) unless given.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Sequence

__all__ = ["AdaptiveBlockSize", "best_block_size", "expected_block_tokens", "expected_speedup", "layer_cost_ratio"]


def _real(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_rate(name: str, value: Any) -> None:
    if not _real(value) or not 0.0 <= value <= 1.0:
        raise ValueError(f"`{name}` must be a number in [0, 1], got {value!r}")


def _check_positive(name: str, value: Any, what: str = "") -> None:
    if not _real(value) or not value > 0.0:
        raise ValueError(f"`{name}` must be a positive number{what}, got {value!r}")


def _check_max_block_size(value: Any, what: str = "") -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"`max_block_size` must be a positive int{what}, got {value!r}")


def _check(acceptance: float, block_size: int | None = None, cost_ratio: float | None = None) -> None:
    _check_rate("acceptance", acceptance)
    if block_size is not None and (isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 0):
        raise ValueError(f"`block_size` must be a non-negative int (draft tokens per verification), got {block_size!r}")
    if cost_ratio is not None:
        _check_positive("cost_ratio", cost_ratio, " (a draft forward over a full step)")


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
    _check_positive("overhead", overhead)
    return expected_block_tokens(acceptance, block_size) / (overhead * (block_size * cost_ratio + 1.0))


def best_block_size(acceptance: float, cost_ratio: float, max_block_size: int = 16) -> int:
    """The `block_size` in `1 .. max_block_size` with the largest Eq. (8) speed-up (the smaller on a tie). E.g. at
    the tiny-ouro fixture's acceptance with 2 of 4 loops (0.83, a draft at half a step) it is 2; at RIPE's Huginn
    numbers (4 of 32 steps, c = 20 / 132) 5 for the full cache's acceptance 0.81 and beyond 8 for the deepest
    plane's 0.93 (RIPE Fig. 5b)."""
    _check(acceptance, None, cost_ratio)
    _check_max_block_size(max_block_size)
    gains = [expected_speedup(acceptance, g, cost_ratio) for g in range(1, max_block_size + 1)]
    return 1 + gains.index(max(gains))


def layer_cost_ratio(layout: Any, draft_loops: int, verify_loops: int | None = None) -> float:
    """`c` counted in layer passes: a draft runs the prelude, `draft_loops` passes of the looped block and the coda,
    a full-depth step `verify_loops` passes (default: the layout's `num_loops`), `(n_pre + d n_core + n_coda) /
    (n_pre + R n_core + n_coda)` (RIPE Sec. 3.4's count; Huginn-0125 at 4 of 32 steps: 20 / 132). A decode step
    reads its layers' weights and the keys and values of the loops it runs, both in proportion to the layer passes;
    the embedding and the output head are left out (a few percent of a step on Ouro-1.4B: 0.50 here, 0.51 measured)."""
    loops = layout.num_loops if verify_loops is None else verify_loops
    for name, value in (("draft_loops", draft_loops), ("verify_loops", loops)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"`{name}` must be a positive int, got {value!r}")
    once = layout.n_prelude + layout.n_coda
    return (once + draft_loops * layout.n_core) / (once + loops * layout.n_core)


class AdaptiveBlockSize:
    """The block size Eq. (8) favours at the acceptance seen so far: `best_block_size(acceptance, cost_ratio,
    max_block_size)` before every verification, with `acceptance` the pooled maximum-likelihood estimate over the
    verified blocks of the rows still generating (accepted drafts over tested drafts), started from
    `prior_acceptance` with the weight of `prior_tokens` tested drafts.

    It is host arithmetic on the accepted lengths the decoder reads anyway (no device work, no sync). Its choices
    depend only on those lengths, so a run with the same prompts and seed takes the same block sizes. A block size
    changes how tokens are grouped into verifications, not which tokens greedy decoding emits over an exact cache
    (full; RIPE with `window >= max_block_size`), nor the distribution sampling draws from.

    Args:
        cost_ratio (`float`): `c`, a draft forward's cost over a full-depth step's (`layer_cost_ratio`, or a measured
            `SpeculativeStats.draft_cost_ratio`).
        max_block_size (`int`): the largest block (the cache's rollback reserve is sized for it).
        prior_acceptance (`float`, *optional*, defaults to 0.8): the acceptance assumed before any block.
        prior_tokens (`float`, *optional*, defaults to 8): its weight, in tested draft tokens.
    """

    def __init__(
        self, cost_ratio: float, max_block_size: int, prior_acceptance: float = 0.8, prior_tokens: float = 8.0
    ) -> None:
        _check_positive("cost_ratio", cost_ratio, " (a draft forward over a full step)")
        _check_rate("prior_acceptance", prior_acceptance)
        _check_max_block_size(max_block_size)
        _check_positive("prior_tokens", prior_tokens)
        self.cost_ratio = float(cost_ratio)
        self.max_block_size = max_block_size
        self.prior_acceptance = float(prior_acceptance)
        self.prior_tokens = float(prior_tokens)
        self.accepted = 0
        self.tested = 0

    @property
    def acceptance(self) -> float:
        """`(accepted + prior_acceptance * prior_tokens) / (tested + prior_tokens)`."""
        return (self.accepted + self.prior_acceptance * self.prior_tokens) / (self.tested + self.prior_tokens)

    def block_size(self) -> int:
        """The next block's size."""
        return best_block_size(self.acceptance, self.cost_ratio, self.max_block_size)

    def update(self, accept_length: Sequence[int], block_size: int, active: Sequence[bool]) -> None:
        """Count a verified block of `block_size` drafts: row `b` (if `active[b]`) accepted `accept_length[b]`."""
        for k, live in zip(accept_length, active):
            if live and block_size:
                self.accepted += int(k)
                self.tested += min(int(k) + 1, block_size)
