"""Fixtures of the kernel tests."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from collections.abc import Callable


def record_launches(
    monkeypatch: Any, kernel: str, pick: Callable[[tuple, dict], Any], alter: Callable[[dict], dict] | None = None
) -> list:
    """Replace `triton_ops.coded_attention.kernels.<kernel>` by a recorder that appends `pick(grid, kwargs)` for
    each launch, then launches the real kernel; returns the list it appends to. `alter`: the launch's kwargs are
    replaced by `alter(kwargs)` first (what `pick` sees and the kernel gets)."""
    from triton_ops.coded_attention import kernels

    real, seen = getattr(kernels, kernel), []

    class Recorder:
        def __getitem__(self, grid):
            def launch(**kw):
                if alter is not None:
                    kw = alter(kw)
                seen.append(pick(grid, kw))
                return real[grid](**kw)

            return launch

    monkeypatch.setattr(kernels, kernel, Recorder())
    return seen


@pytest.fixture
def launches(monkeypatch):
    """The history launch's `(ROWX, ROW1, SUB, grid[0], MMA, num_warps)`, recorded per call of the split kernel."""
    return record_launches(
        monkeypatch, "_coded_attention_fwd_kernel",
        lambda grid, kw: (kw["ROWX"], kw["ROW1"], kw["SUB"], grid[0], kw["MMA"], kw.get("num_warps")),
    )  # fmt: skip
