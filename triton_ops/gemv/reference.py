"""The contract of `gemv`: `torch.nn.functional.linear` (the models' eager projection; the CPU path)."""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["ref_gemv"]


def ref_gemv(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """`x @ weight.T (+ bias)`: `x` `[..., K]`, `weight` `[N, K]` (`nn.Linear` layout), `bias` `[N]`; `[..., N]`."""
    return torch.nn.functional.linear(x, weight, bias)
