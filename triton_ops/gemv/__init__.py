"""Skinny GEMM ("GEMV") for decode steps: `y = x @ W^T` for inputs of at most a few rows, reading `W` once with
enough programs to fill the SMs (K split into ranges added in a fixed order when the output is narrow).

- `gemv(x, weight, bias=None)`: the Triton kernel on CUDA (`ops.py`, `kernels.py`), `ref_gemv` (`F.linear`)
  elsewhere.
- `linear(x, weight, bias=None)`: the models' projection: `gemv` when `GEMV_TUNING["enabled"]` and the call is a
  decode-sized one on CUDA (`routes`), `F.linear` otherwise. Off by default.
- `silu_linear(x, weight, bias=None)`: a gated MLP's down projection of `x = [gate | up]`, the activation read in the
  kernel's input load where the projection takes the kernel (`GEMV_TUNING["fuse_silu"]`).
- `linear_rope(x, weight, cos, sin, rotated)`: a stacked q/k/v projection with rotate-half RoPE applied to its
  queries and keys in the kernel (`GEMV_TUNING["fuse_rope"]`), or None where `linear` would not launch the kernel
  with settings that allow it (the caller rotates with `triton_ops.fused.rotate_half`); with `kv_out`, a one-token
  step's keys and values are also stored into a static cache cell (`GEMV_TUNING["fuse_kv"]` gates the models' use).
- `GEMV_TUNING`, `GEMV_CONFIGS`: the switch and defaults, and the measured settings per `(N, K)` and row class.

See `README.md`.
"""

from triton_ops.gemv.ops import (
    GEMV_CONFIGS,
    GEMV_TUNING,
    default_config,
    gemv,
    gemv_config,
    linear,
    linear_rope,
    routes,
    silu_linear,
)
from triton_ops.gemv.reference import ref_gemv

__all__ = [
    "GEMV_CONFIGS",
    "GEMV_TUNING",
    "default_config",
    "gemv",
    "gemv_config",
    "linear",
    "linear_rope",
    "ref_gemv",
    "routes",
    "silu_linear",
]
