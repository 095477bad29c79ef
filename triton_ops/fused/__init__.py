"""Fused layer ops of the native models: RMS norm (with a residual before or after; `rms_norm_pair`: a residual norm
and the norm that reads its output), RoPE (rotate-half and pairs) and the gated MLP's `silu(gate) * up`, each one
Triton kernel on CUDA instead of the 4-10 small kernels of the eager code; and `write_kv`, a static cell's key and value
writes in one launch (two `index_copy_` otherwise).

A decode step of a looped model runs every layer R times per token, so its small kernels dominate a captured step at
small batch; `reference.py` is the models' eager math (the contract and the CPU path). `disabled()` turns the kernels
off in a block (comparisons, benchmarks). See `README.md`.
"""

from triton_ops.fused.ops import (
    NORM_TUNING,
    disabled,
    enabled,
    rms_norm,
    rms_norm_pair,
    rotate_half,
    rotate_pairs,
    silu_mul,
    write_kv,
)

__all__ = [
    "NORM_TUNING",
    "disabled",
    "enabled",
    "rms_norm",
    "rms_norm_pair",
    "rotate_half",
    "rotate_pairs",
    "silu_mul",
    "write_kv",
]
