"""Self-speculative decoding for looped models: the acceptance rule (pure functions), the draft/verify decoder, and
RIPE's Eq. (7) / (8) for what it should gain and the block size that gains most."""

from hf_loopcache.generation.acceptance import greedy_accept, sample_from_uniform, speculative_accept
from hf_loopcache.generation.self_speculative import (
    DEFAULT_MAX_BLOCK_SIZE,
    SpeculativeStats,
    self_speculative,
    self_speculative_generate,
)
from hf_loopcache.generation.speedup import (
    AdaptiveBlockSize,
    best_block_size,
    expected_block_tokens,
    expected_speedup,
    layer_cost_ratio,
)

__all__ = [
    "DEFAULT_MAX_BLOCK_SIZE",
    "AdaptiveBlockSize",
    "SpeculativeStats",
    "best_block_size",
    "expected_block_tokens",
    "expected_speedup",
    "greedy_accept",
    "layer_cost_ratio",
    "sample_from_uniform",
    "self_speculative",
    "self_speculative_generate",
    "speculative_accept",
]
