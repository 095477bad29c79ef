"""Self-speculative decoding for looped models: the acceptance rule (pure functions) and the draft/verify decoder."""

from hf_loopcache.generation.acceptance import greedy_accept, sample_from_uniform, speculative_accept
from hf_loopcache.generation.self_speculative import SpeculativeStats, self_speculative, self_speculative_generate

__all__ = [
    "SpeculativeStats",
    "greedy_accept",
    "sample_from_uniform",
    "self_speculative",
    "self_speculative_generate",
    "speculative_accept",
]
