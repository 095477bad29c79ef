"""Shared test setup.

- NaN poisoning (STYLE 16): `torch.empty`, `torch.empty_like` and `Tensor.new_empty` called from `hf_loopcache` or
  `triton_ops` return NaN-filled floating tensors, so a cache slot that is read before it is written fails loudly.
- `arch`: parametrizes a test over both looped architectures (models from `tests/helpers.py`).
"""

from __future__ import annotations

import sys

import pytest
import torch

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
