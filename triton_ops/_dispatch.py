"""Where a `triton_ops` function runs: its Triton kernel on CUDA tensors when Triton imports, its pure-torch reference
everywhere else (announced once per op through `logging`). Nothing here queries a device at import time."""

from __future__ import annotations

import functools
import importlib.util
import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["announce_once", "next_pow2", "triton_available", "use_triton"]

logger = logging.getLogger("triton_ops")
_announced: set[str] = set()


@functools.cache
def triton_available() -> bool:
    """Whether the `triton` package can be imported (checked once, lazily)."""
    return importlib.util.find_spec("triton") is not None


def use_triton(op: str, *tensors: torch.Tensor) -> bool:
    """True when every tensor is on a CUDA device and Triton is installed; otherwise announce the reference fallback
    of `op` once (CPU tensors are the expected case for the reference and are not announced)."""
    if not all(t.is_cuda for t in tensors):
        return False
    if triton_available():
        return True
    announce_once(f"triton_ops.{op}: Triton is not installed; CUDA tensors use the pure-torch reference")
    return False


def announce_once(message: str) -> None:
    """Log `message` as a warning the first time it is seen (a fallback to the reference is worth saying once)."""
    if message not in _announced:
        _announced.add(message)
        logger.warning(message)


def next_pow2(n: int) -> int:
    """The least power of two >= `n` (Triton block sizes); 1 for `n <= 1`."""
    return 1 << max(0, (n - 1).bit_length())
