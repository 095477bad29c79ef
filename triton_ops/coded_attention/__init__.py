"""Coded attention: attention of new tokens over one cache cell's stored view, reading KIVI codes as codes.

- `CellView`: what a cell stores (sink, history codes or a borrowed BF16 plane, window, new tokens, boundaries).
- `coded_attention(query, view, *, scaling, v_precision_tau=None, v_precision_stats=None) -> (out, lse)`: the
  public entry the cache calls: the Triton split-history kernel on CUDA (`ops.py`, `kernels.py`), the reference
  elsewhere.
- `reference_coded_attention`: the pure-PyTorch reference (the contract of the kernels, and the CPU fallback).

See `README.md` in this folder for the math, the stored layout and the limits.
"""

from triton_ops.coded_attention.ops import coded_attention
from triton_ops.coded_attention.reference import reference_coded_attention
from triton_ops.coded_attention.view import CellView

__all__ = ["CellView", "coded_attention", "reference_coded_attention"]
