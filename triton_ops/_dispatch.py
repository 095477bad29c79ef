"""Where a `triton_ops` function runs: its Triton kernel on CUDA tensors when Triton imports, its pure-torch reference
everywhere else (announced once per op through `logging`). Nothing here queries a device at import time."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.util
import logging
import os
import threading
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from collections.abc import Iterator

__all__ = [
    "announce_once",
    "check_same_device",
    "fallback_counts",
    "launch_device",
    "PDL",
    "next_pow2",
    "no_pdl",
    "pdl_options",
    "pdl_supported",
    "several_gpus",
    "triton_available",
    "use_triton",
]

logger = logging.getLogger("triton_ops")
_announced: set[str] = set()
#: every call of `announce_once` by message (each fallback call counts, not only the first): benchmarks read it to
#: refuse a row that ran a reference where it meant to measure a kernel (`fallback_counts`)
_fallbacks: dict[str, int] = {}


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
    """Log `message` as a warning the first time it is seen (a fallback to the reference is worth saying once); every
    call is counted (`fallback_counts`)."""
    _fallbacks[message] = _fallbacks.get(message, 0) + 1
    if message not in _announced:
        _announced.add(message)
        logger.warning(message)


def fallback_counts() -> dict[str, int]:
    """A copy of how often each fallback message was announced since import (diff two copies around a run)."""
    return dict(_fallbacks)


def next_pow2(n: int) -> int:
    """The least power of two >= `n` (Triton block sizes); 1 for `n <= 1`."""
    return 1 << max(0, (n - 1).bit_length())


@functools.cache
def several_gpus() -> bool:
    """More than one CUDA device is visible (checked once, at the first launch, never at import)."""
    return torch.cuda.device_count() > 1


def launch_device(t: torch.Tensor) -> contextlib.AbstractContextManager[Any]:
    """The context a kernel reading `t` is launched in: `t`'s CUDA device made current (Triton launches on the
    current device, which is not the tensor's when a model is split over GPUs by `device_map`); a no-op elsewhere and
    with a single GPU."""
    return torch.cuda.device(t.device) if t.is_cuda and several_gpus() else contextlib.nullcontext()


PDL: dict[str, Any] = {"enabled": False}
"""Programmatic dependent launch of the step's Triton kernels (gemv, the fused layer ops, the static cells' page
flush, coded attention): `enabled` launches them with `launch_pdl=True` on GPUs of compute capability >= 9 under a
Triton that has it (`pdl_supported`). A kernel so launched may start while the previous kernel of the stream still
runs: it waits (`gdc_wait`) before it reads what an earlier kernel wrote or writes anything, and loads only what no
kernel writes (a GEMV's weights) before that; it lets the next kernel start once all its programs have waited
(`gdc_launch_dependents`). `enabled` is read at each launch (a captured CUDA graph keeps the setting it was captured
with); `no_pdl()` turns it off in a block of one thread.

Off by default: measured on the H200 (benchmarks/results/generate_h200_s16_pdl.json; Ouro-1.4B's shape, 8K, captured
step) it gains nothing at batch 1 (full 7.60 -> 7.63 ms, kivi4 9.01 -> 8.82 ms, within the 2-3% between two runs) and
loses up to 3% at batch 8; the kernels' union on the GPU grew (6.78 -> 7.54 ms per step, full, batch 1).

A GEMV so launched reads its weights before that wait: a weight written by the kernel launched just before it (not
one kernel earlier: that one has completed by the time the previous kernel passed its own wait) must be read
without it (`no_pdl()`, or `gemv(..., config={"preload": False})`)."""

_pdl_state = threading.local()


@contextlib.contextmanager
def no_pdl() -> Iterator[None]:
    """Launch without programmatic dependent launch inside the block (this thread), whatever `PDL["enabled"]` says:
    e.g. the first GEMV over a weight buffer that the kernel before it has just written."""
    before = getattr(_pdl_state, "off", False)
    _pdl_state.off = True
    try:
        yield
    finally:
        _pdl_state.off = before


@functools.cache
def pdl_supported() -> bool:
    """Whether this Triton can launch with programmatic dependent launch: the `launch_pdl` launch option of its CUDA
    backend and the `gdc_wait` / `gdc_launch_dependents` ops (Triton 3.3 on); checked once, lazily, here only."""
    if not triton_available():
        return False
    try:
        import triton.language as tl
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return False
    cuda = getattr(getattr(tl, "extra", None), "cuda", None)
    fields = getattr(CUDAOptions, "__dataclass_fields__", {})
    return "launch_pdl" in fields and all(hasattr(cuda, op) for op in ("gdc_wait", "gdc_launch_dependents"))


@functools.cache
def _hopper_or_newer(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def pdl_options(t: torch.Tensor) -> dict[str, bool]:
    """The launch keywords of a kernel reading `t` with a `USE_PDL` constexpr: `{"USE_PDL": True, "launch_pdl":
    True}` when `PDL["enabled"]` (and not inside `no_pdl()`), `t` is on a CUDA device of compute capability >= 9, Triton supports it and the
    interpreter is off (it runs no `gdc_*` op); `{"USE_PDL": False}` (the launch as before) otherwise."""
    on = (
        bool(PDL["enabled"])
        and not getattr(_pdl_state, "off", False)
        and t.is_cuda
        and os.environ.get("TRITON_INTERPRET") != "1"
        and pdl_supported()
        and _hopper_or_newer(t.device.index if t.device.index is not None else torch.cuda.current_device())
    )
    return {"USE_PDL": True, "launch_pdl": True} if on else {"USE_PDL": False}


def _tensors(obj: object) -> Iterator[tuple[str, torch.Tensor]]:
    for field in dataclasses.fields(obj):  # type: ignore[arg-type]
        value = getattr(obj, field.name)
        if isinstance(value, torch.Tensor):
            yield field.name, value
        elif dataclasses.is_dataclass(value) and not isinstance(value, type):
            yield from ((f"{field.name}.{name}", t) for name, t in _tensors(value))


def check_same_device(ref: torch.Tensor, ref_name: str, container: object) -> None:
    """Raise if a tensor field of the dataclass `container` (nested dataclasses included) is not on `ref`'s device: a
    kernel takes raw pointers and would read another device's memory instead of failing."""
    for name, t in _tensors(container):
        if t.device != ref.device:
            raise ValueError(
                f"`{name}` is on {t.device} but `{ref_name}` is on {ref.device}; a kernel reads one device"
            )
