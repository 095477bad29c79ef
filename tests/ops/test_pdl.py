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


@pytest.mark.gpu
def test_pdl_chain_in_a_cuda_graph_matches_plain_launches():
    """On a GPU that has it: a decode-like chain (norm pair, stacked GEMV with preloaded weights, RoPE, gated down
    projection) captured in a CUDA graph with PDL gives the bits of the same chain launched without it, on fresh
    inputs over several replays (a missing wait shows as a difference)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    if not (pdl_supported() and torch.cuda.get_device_capability()[0] >= 9):
        pytest.skip("needs compute capability >= 9 and a Triton with programmatic dependent launch")
    from triton_ops import fused
    from triton_ops.gemv import gemv

    g = torch.Generator(device="cuda").manual_seed(0)
    h, inter, heads, d = 256, 512, 2, 64
    w_norm, w_next = (torch.randn(h, device="cuda", generator=g).bfloat16() for _ in range(2))
    w_qk = (torch.randn(2 * heads * d, h, device="cuda", generator=g) * h**-0.5).bfloat16()
    w_gu = (torch.randn(2 * inter, h, device="cuda", generator=g) * h**-0.5).bfloat16()
    w_down = (torch.randn(h, inter, device="cuda", generator=g) * inter**-0.5).bfloat16()
    x = torch.empty(1, 1, h, device="cuda", dtype=torch.bfloat16)
    res = torch.empty_like(x)
    cos = torch.empty(1, 1, d, device="cuda", dtype=torch.bfloat16)
    sin = torch.empty_like(cos)

    def chain():
        hid, normed = fused.rms_norm_pair(x, w_norm, 1e-6, w_next, 1e-6, add_after=res)
        qk = fused.rotate_half(gemv(normed, w_qk).view(1, 1, 2 * heads, d), cos, sin)
        return hid + gemv(gemv(normed, w_gu), w_down, gated=True), qk

    def fill(seed):
        gen = torch.Generator(device="cuda").manual_seed(seed)
        for t in (x, res, cos, sin):
            t.copy_(torch.randn(t.shape, device="cuda", generator=gen))

    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(PDL, "enabled", False)
        fill(1)
        plain = [t.clone() for t in chain()]
        mp.setitem(PDL, "enabled", True)
        assert pdl_options(x) == ON
        fill(1)
        chain()  # compile the PDL variants outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = chain()
        for seed in (1, 2, 3):
            fill(seed)
            graph.replay()
            torch.cuda.synchronize()
            if seed == 1:
                assert all(torch.equal(a, b) for a, b in zip(out, plain))
            mp.setitem(PDL, "enabled", False)
            again = chain()
            mp.setitem(PDL, "enabled", True)
            assert all(torch.equal(a, b) for a, b in zip(out, again))
