"""Shared test setup.

- NaN poisoning (STYLE 16): `torch.empty`, `torch.empty_like` and `Tensor.new_empty` called from `hf_loopcache` or
  `triton_ops` return NaN-filled floating tensors, so a cache slot that is read before it is written fails loudly.
- `arch`: parametrizes a test over both looped architectures (models from `tests/helpers.py`).
- Threads: torch runs on `HF_LOOPCACHE_TEST_THREADS` threads (default 1; 0 keeps torch's default). The tests' tensors
  are tiny, so more threads only add synchronisation, and on a loaded machine they oversubscribe the cores.
- `gpu`-marked tests are skipped without a CUDA device.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

_THREADS = int(os.environ.get("HF_LOOPCACHE_TEST_THREADS", "1"))
if _THREADS > 0:
    torch.set_num_threads(_THREADS)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)

_OURS = ("hf_loopcache", "triton_ops")


def _from_our_code() -> bool:
    frame = sys._getframe(2)
    return frame.f_globals.get("__name__", "").startswith(_OURS)


def _poison(t: torch.Tensor) -> torch.Tensor:
    if t.is_floating_point():
        t.fill_(float("nan"))
    return t


@pytest.fixture(autouse=True)
def nan_poison_empty(monkeypatch):
    empty, empty_like, new_empty = torch.empty, torch.empty_like, torch.Tensor.new_empty

    def poisoned_empty(*args, **kwargs):
        out = empty(*args, **kwargs)
        return _poison(out) if _from_our_code() else out

    def poisoned_empty_like(*args, **kwargs):
        out = empty_like(*args, **kwargs)
        return _poison(out) if _from_our_code() else out

    def poisoned_new_empty(self, *args, **kwargs):
        out = new_empty(self, *args, **kwargs)
        return _poison(out) if _from_our_code() else out

    monkeypatch.setattr(torch, "empty", poisoned_empty)
    monkeypatch.setattr(torch, "empty_like", poisoned_empty_like)
    monkeypatch.setattr(torch.Tensor, "new_empty", poisoned_new_empty)
    yield


@pytest.fixture(params=["ouro", "huginn"])
def arch(request):
    return request.param
