"""The gate of programmatic dependent launch (`triton_ops._dispatch.PDL`, `pdl_options`): every condition on its own
turns it off, so the CPU, the interpreter and older GPUs or Tritons launch as before; and the launchers pass the
options it gives."""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import pytest
import torch

from triton_ops import _dispatch
from triton_ops._dispatch import PDL, pdl_options, pdl_supported

ON = {"USE_PDL": True, "launch_pdl": True}
OFF = {"USE_PDL": False}


def _cuda_like(index=0):
    return SimpleNamespace(is_cuda=True, device=SimpleNamespace(index=index))


@pytest.fixture
def all_on(monkeypatch):
    """Every condition met, as on an H200 with a Triton that has the feature."""
    monkeypatch.setitem(PDL, "enabled", True)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(_dispatch, "pdl_supported", lambda: True)
    monkeypatch.setattr(_dispatch, "_hopper_or_newer", lambda index: True)
    return monkeypatch


def test_on_only_when_every_condition_holds(all_on):
    assert pdl_options(_cuda_like()) == ON
    assert pdl_options(torch.zeros(1)) == OFF  # a CPU tensor (the interpreter tests' too)
    all_on.setitem(PDL, "enabled", False)
    assert pdl_options(_cuda_like()) == OFF  # the switch
    all_on.setitem(PDL, "enabled", True)
    all_on.setenv("TRITON_INTERPRET", "1")
    assert pdl_options(_cuda_like()) == OFF  # the interpreter runs no gdc op
    all_on.delenv("TRITON_INTERPRET")
    all_on.setattr(_dispatch, "_hopper_or_newer", lambda index: False)
    assert pdl_options(_cuda_like()) == OFF  # compute capability < 9
    all_on.setattr(_dispatch, "_hopper_or_newer", lambda index: True)
    all_on.setattr(_dispatch, "pdl_supported", lambda: False)
    assert pdl_options(_cuda_like()) == OFF  # a Triton without it


def test_default_is_off():
    """Off until it measures faster (the H200 numbers in `PDL`'s docstring)."""
    assert PDL["enabled"] is False


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_triton_feature_check():
    """This Triton (3.3 on has both the launch option and the ops) is recognised; the check is cached."""
    import triton

    major, minor = (int(p) for p in triton.__version__.split(".")[:2])
    assert pdl_supported() is ((major, minor) >= (3, 3))
    assert pdl_supported.cache_info().hits + pdl_supported.cache_info().misses >= 1


def test_fused_launchers_pass_the_options(all_on, monkeypatch):
    """The fused ops' launches carry `USE_PDL` and `launch_pdl` as the gate gives them (recorded, not run)."""
    from triton_ops.fused import kernels, ops

    seen = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **kw: seen.append((kw.get("USE_PDL"), kw.get("launch_pdl")))

    for name in ("_rms_norm_kernel", "_silu_mul_kernel", "_rotate_kernel", "_write_kv_kernel"):
        monkeypatch.setattr(kernels, name, Recorder())
    monkeypatch.setattr(ops, "use_triton", lambda op, *tensors: True)
    monkeypatch.setattr(ops, "pdl_options", lambda t: ON)
    x, w = torch.randn(2, 8), torch.ones(8)
    ops.rms_norm(x, w, 1e-6)
    ops.silu_mul(x, x)
    ops.rotate_half(torch.randn(1, 1, 2, 8), torch.randn(1, 1, 8), torch.randn(1, 1, 8))
    k = torch.zeros(1, 2, 4, 8)
    ops.write_kv(k, k.clone(), torch.randn(1, 2, 1, 8), torch.randn(1, 2, 1, 8), torch.tensor([1]))
    assert seen == [(True, True)] * 4
    seen.clear()
    monkeypatch.setattr(ops, "pdl_options", lambda t: OFF)
    ops.silu_mul(x, x)
    assert seen == [(False, None)]  # off: no launch option at all, as before


def test_no_pdl_turns_it_off_in_the_block(all_on):
    from triton_ops._dispatch import no_pdl

    with no_pdl():
        assert pdl_options(_cuda_like()) == OFF
        with no_pdl():
            pass
        assert pdl_options(_cuda_like()) == OFF
    assert pdl_options(_cuda_like()) == ON


def test_a_freshly_stacked_weight_is_read_without_pdl(monkeypatch):
    """The first stacked projection's GEMV follows the kernel that wrote the stacked buffer: it must not read weights
    before waiting for it, so it runs outside PDL; later calls (the buffer cached) run with it."""
    from torch import nn

    from hf_loopcache.models import _common

    seen = []
    monkeypatch.setattr(_common.gemv, "linear",
                        lambda x, w: seen.append(_dispatch._pdl_state.__dict__.get("off", False)) or x @ w.T)
    owner = nn.Module()
    owner.a, owner.b = nn.Linear(8, 4, bias=False), nn.Linear(8, 6, bias=False)
    x = torch.randn(1, 1, 8)
    with torch.no_grad():
        first = _common.stacked_projection(owner, ("a", "b"), x)
        again = _common.stacked_projection(owner, ("a", "b"), x)
    assert seen == [True, False] and torch.equal(first, again)
