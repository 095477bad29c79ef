"""Fixtures of the kernel tests."""

from __future__ import annotations

import pytest


@pytest.fixture
def launches(monkeypatch):
    """The history launch's `(ROWX, ROW1, SUB, grid[0], MMA, num_warps)`, recorded per call of the split kernel."""
    from triton_ops.coded_attention import kernels

    real, seen = kernels._coded_attention_fwd_kernel, []

    class Recorder:
        def __getitem__(self, grid):
            def launch(**kw):
                seen.append((kw["ROWX"], kw["ROW1"], kw["SUB"], grid[0], kw["MMA"], kw.get("num_warps")))
                return real[grid](**kw)

            return launch

    monkeypatch.setattr(kernels, "_coded_attention_fwd_kernel", Recorder())
    return seen
