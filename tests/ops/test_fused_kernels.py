"""The fused layer ops' Triton kernels against `triton_ops.fused.reference` (the models' eager math).

Runs on CUDA, or on the CPU under `TRITON_INTERPRET=1` (started by `tests/ops/test_triton_interpreter.py`); the
dispatch rules and errors run on any machine.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.helpers import compile_for_sm90
from triton_ops import fused
from triton_ops.fused import ops, reference

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
kernels = pytest.mark.skipif(
    not (torch.cuda.is_available() or INTERPRET), reason="needs CUDA or TRITON_INTERPRET=1 (see test_triton_interpreter)"
)
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if torch.cuda.is_available() else [])


@pytest.fixture(autouse=True)
def _kernels_on_cpu(monkeypatch):
    """Under the interpreter the kernels take CPU tensors: let the dispatch send them there."""
    if INTERPRET and not torch.cuda.is_available():
        monkeypatch.setattr(ops, "use_triton", lambda op, *tensors: True)


def _rand(shape, dtype, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale).to(dtype).to(DEVICE)


def _within_style(out: torch.Tensor, ref: torch.Tensor, exact: torch.Tensor) -> None:
    """STYLE.md's bound for a low-precision kernel: its error against the same math done in fp32 (`exact`) is at most
    twice the reference's own error in that dtype. Units of the output do not bound a sum that cancels (`r + y` with
    `r ~ -y`): a unit of `y` there is many units of the sum, and the sign may flip (the H200 failed those bounds in
    fp16 / bf16)."""
    own = (ref.double() - exact.double()).abs().max().item()
    err = (out.double() - exact.double()).abs().max().item()
    assert err <= 2 * own + 1e-6, f"kernel error {err:.3e} against fp32, the reference's own {own:.3e}"


def _ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """Largest distance in units of the last place of `a`'s dtype (same-sign values)."""
    if a.dtype == torch.float32:
        ia, ib = a.contiguous().view(torch.int32).long(), b.contiguous().view(torch.int32).long()
    else:
        ia, ib = a.contiguous().view(torch.int16).long(), b.contiguous().view(torch.int16).long()
    return int((ia - ib).abs().max()) if a.numel() else 0


@kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [64, 80, 2048])
@pytest.mark.parametrize("residual", [None, "before", "after"])
def test_rms_norm_matches_reference(dtype, n, residual):
    x, w = _rand((3, 2, n), dtype, 0, 3.0), _rand((n,), dtype, 1)
    r = _rand((3, 2, n), dtype, 2)
    kw = {} if residual is None else {f"add_{residual}": r}
    out = fused.rms_norm(x, w, 1e-6, **kw)
    ref = reference.ref_rms_norm(x, w, 1e-6, **kw)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    # one reduction in another order: the normed value may move by a unit of its dtype, then the scale and the
    # residual round it again
    if dtype == torch.float32:  # (the sum's order and the square root's rounding: a few fp32 units)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    else:
        exact = reference.ref_rms_norm(x.double(), w.double(), 1e-6, **{k: t.double() for k, t in kw.items()})
        _within_style(out, ref, exact)
    if residual is not None:  # the residual is really applied where it belongs
        other = reference.ref_rms_norm(x, w, 1e-6, **{("add_after" if residual == "before" else "add_before"): r})
        assert not torch.allclose(out.float(), other.float(), atol=1e-2)


@kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1, 16, 128), (2, 3, 5, 64), (2, 4, 20, 32)])
def test_rotate_half_equals_reference(dtype, shape):
    b, q, h, d = shape
    x = _rand(shape, dtype, 3)
    angles = _rand((b, q, d // 2), torch.float32, 4, 3.0)
    emb = torch.cat([angles, angles], -1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    out = fused.rotate_half(x, cos, sin)
    ref = reference.ref_rotate_half(x, cos, sin)
    assert out.is_contiguous()
    strided = _rand((b, q, h * d * 2), dtype, 5)[..., : h * d].view(b, q, h, d)  # a slice of a wider projection
    got_s, ref_s = fused.rotate_half(strided, cos, sin), reference.ref_rotate_half(strided, cos, sin)
    if INTERPRET:  # elementwise, rounded where the eager code rounds: bit for bit
        assert torch.equal(out, ref) and torch.equal(got_s, ref_s)
    else:  # compiled, a multiply-add may be fused (the H200 parted by a unit in bf16 and in fp32): STYLE's bound
        for o, r, t in ((out, ref, x), (got_s, ref_s, strided)):
            _within_style(o, r, reference.ref_rotate_half(t.double(), cos.double(), sin.double()))


@kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [False, True])
def test_rotate_pairs_matches_reference(dtype, bias):
    b, q, h, d = 2, 3, 5, 64
    wide = _rand((b, q, (h + 2) * d), dtype, 6)
    x = wide[..., : h * d].view(b, q, h, d)  # Huginn's q: a slice of the fused qkv projection
    angles = _rand((b, q, 1, d // 2), torch.float32, 7, 3.0)
    cos, sin = angles.cos(), angles.sin()
    bias_t = _rand((1, h, d), dtype, 8) if bias else None
    out = fused.rotate_pairs(x, cos, sin, bias=bias_t)
    ref = reference.ref_rotate_pairs(x, cos, sin, bias_t)
    # fp32 inside, one rounding at the end; a fused multiply-add may move the fp32 value by a unit, so the result
    # may differ by one unit of its dtype
    assert _ulps(out, ref) <= 1
    assert (out != ref).float().mean() < 0.05
    if bias:
        assert not torch.equal(out, reference.ref_rotate_pairs(x, cos, sin))


@kernels
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_matches_reference(dtype):
    both = _rand((2, 3, 2 * 300), dtype, 9, 4.0)
    gate, up = both.chunk(2, dim=-1)  # two halves of one projection (Huginn's GatedMLP)
    out = fused.silu_mul(gate, up)
    ref = reference.ref_silu_mul(gate, up)
    assert out.is_contiguous() and out.shape == ref.shape
    torch.testing.assert_close(out.float(), ref.float(), rtol=2 * torch.finfo(dtype).eps, atol=1e-6)
    if INTERPRET:
        assert _ulps(out, ref) <= 1 or dtype == torch.float32
    else:  # compiled: the exponential and the multiply-add may round elsewhere (STYLE's bound)
        _within_style(out, ref, reference.ref_silu_mul(gate.double(), up.double()))


@kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [80, 2048])
@pytest.mark.parametrize("residual", [None, "before", "after"])
def test_rms_norm_pair_matches_reference(dtype, n, residual):
    """A residual norm and the norm after it in one kernel (Huginn's residual before, Ouro's after): both outputs within
    the reference's rounding."""
    x, w, w2 = _rand((3, 2, n), dtype, 0, 3.0), _rand((n,), dtype, 1), _rand((n,), dtype, 3)
    kw = {} if residual is None else {f"add_{residual}": _rand((3, 2, n), dtype, 2)}
    h, normed = fused.rms_norm_pair(x, w, 1e-6, w2, 1e-5, **kw)
    ref_h, ref_normed = reference.ref_rms_norm_pair(x, w, 1e-6, w2, 1e-5, **kw)
    exact = reference.ref_rms_norm_pair(x.double(), w.double(), 1e-6, w2.double(), 1e-5,
                                        **{k: t.double() for k, t in kw.items()})  # fmt: skip
    for out, ref, ex in ((h, ref_h, exact[0]), (normed, ref_normed, exact[1])):
        assert out.shape == ref.shape and out.dtype == ref.dtype
        if dtype == torch.float32:
            torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
        else:
            _within_style(out, ref, ex)
    # the second norm reads the first's output with its own weight (not `x`, not `w`)
    assert not torch.allclose(normed.float(), reference.ref_rms_norm(x, w2, 1e-5).float(), atol=1e-2)
    assert not torch.allclose(normed.float(), reference.ref_rms_norm(ref_h, w, 1e-5).float(), atol=1e-2)
    if residual is not None:  # the residual is really applied where it belongs
        other = reference.ref_rms_norm(x, w, 1e-6, **{("add_after" if residual == "before" else "add_before"): kw[
            f"add_{residual}"]})
        assert not torch.allclose(h.float(), other.float(), atol=1e-2)


def _storage(dtype, rows, heads, n, d, seed):
    """Storage views of the first `rows` rows of a larger buffer (as a static cell writes them), NaN-free."""
    return _rand((rows + 1, heads, n, d), dtype, seed)[:rows]


@kernels
@pytest.mark.parametrize(
    "dtype, src_dtype, d, q, n, mode",
    [
        pytest.param(torch.float32, torch.float32, 16, 1, 12, None, id="fp32-D16-q1"),
        pytest.param(torch.float16, torch.float16, 96, 3, 12, None, id="fp16-D96-q3"),
        pytest.param(torch.float16, torch.float32, 32, 2, 12, None, id="fp32-into-fp16-D32-q2"),
        pytest.param(torch.float16, torch.float16, 32, 3, 7, "ring", id="fp16-D32-q3-ring"),
        pytest.param(torch.float32, torch.float32, 16, 6, 4, "ring", id="fp32-D16-q6-ring-of-4"),
        pytest.param(torch.float32, torch.float32, 16, 4, 7, "sink", id="fp32-D16-q4-ring-and-sink"),
        pytest.param(torch.float16, torch.float16, 96, 1, 7, "sink", id="fp16-D96-q1-ring-and-sink"),
    ],
)
def test_write_kv_equals_reference(dtype, src_dtype, d, q, n, mode):
    """Every write of a static cell's step in one launch (the dense storage; a ring; a ring and its sink): the same
    bytes as the `index_copy_` of the reference, from keys and values at the strides a model hands them over
    (heads-major views of a token-major projection)."""
    b, h = 2, 3
    kv = _rand((b, q, 2 * h, d), src_dtype, 5)  # token-major, keys and values side by side
    key, value = kv[:, :, :h].transpose(1, 2), kv[:, :, h:].transpose(1, 2)
    positions = torch.tensor([5, 9, 2, 7, 11, 12][:q] if mode is None else list(range(10 - q, 10))[:q], device=DEVICE)
    if mode == "sink" and q > 1:
        positions = torch.tensor([1, 2, 3, 4][:q], device=DEVICE)  # 3 and 4 share the scratch slot 3
    k, v = _storage(dtype, b, h, n, d, 6), _storage(dtype, b, h, n, d, 7)
    sk, sv = _storage(dtype, b, h, 4, d, 8), _storage(dtype, b, h, 4, d, 9)
    ref = [t.clone() for t in (k, v, sk, sv)]
    kw: dict = {} if mode is None else {"modulo": n}
    if mode == "sink":
        kw["sink"], ref_kw = (sk, sv, 3), {**kw, "sink": (ref[2], ref[3], 3)}
    else:
        ref_kw = kw
    fused.write_kv(k, v, key, value, positions, **kw)
    reference.ref_write_kv(ref[0], ref[1], key, value, positions, **ref_kw)
    for t in (sk, sv, ref[2], ref[3]):  # the scratch slot's bytes are unspecified
        t[:, :, 3] = 0
    for got, want in zip((k, v, sk, sv), ref):
        assert torch.equal(got, want)
    slot = int(positions[-1]) % n
    assert not torch.equal(k[:, :, slot], _storage(dtype, b, h, n, d, 6)[:, :, slot])  # (something was written)
    if mode == "sink":
        first = min(int(positions[0]), 3)
        assert torch.equal(sk[:, :, first], key[:, :, 0].to(dtype)) or first == 3


def test_write_kv_bad_arguments_are_named():
    k = v = torch.zeros(2, 3, 8, 4)
    one = torch.zeros(2, 3, 1, 4)
    with pytest.raises(ValueError, match="`value` must have shape"):
        fused.write_kv(k, v, one, torch.zeros(2, 3, 2, 4), torch.tensor([0]))
    with pytest.raises(ValueError, match="`k` and `v` must be one storage shape"):
        fused.write_kv(k, v[:1], one, one, torch.tensor([0]))
    with pytest.raises(ValueError, match="`sink` storage must be two tensors"):
        fused.write_kv(k, v, one, one, torch.tensor([0]), sink=(k, v[:, :2], 3))
    with pytest.raises(ValueError, match="scratch slot `clamp` must be in"):
        fused.write_kv(k, v, one, one, torch.tensor([0]), sink=(k, v, 8))


def test_rms_norm_pair_off_cuda_is_the_two_norms_bit_for_bit():
    x, w, w2, r = torch.randn(2, 3, 40), torch.randn(40), torch.randn(40), torch.randn(2, 3, 40)
    for side in ("add_before", "add_after"):
        h, normed = fused.rms_norm_pair(x, w, 1e-6, w2, 1e-5, **{side: r})
        first = fused.rms_norm(x, w, 1e-6, **{side: r})
        assert torch.equal(h, first) and torch.equal(normed, fused.rms_norm(first, w2, 1e-5))


@pytest.mark.skipif(INTERPRET, reason="compiles with Triton's compiler, not the interpreter")
@pytest.mark.parametrize("pdl", [False, True], ids=["plain", "pdl"])
@pytest.mark.parametrize("kernel", ["rms_norm_pair", "write_kv", "rotate_half", "silu_mul"])
def test_fused_kernels_compile_for_sm90(kernel, pdl):
    """The interpreter runs Python, not Triton's compiler: compile the kernels for sm_90 as a decode step launches them
    (bf16, Ouro's hidden 2048 and 128 channels; Huginn's 96 in a ring), with no GPU; with programmatic dependent
    launch the wait and the trigger are there, neither without it."""
    from triton_ops.fused import kernels

    floats: tuple[str, ...] = ()
    if kernel == "rms_norm_pair":
        fn = kernels._rms_norm_kernel
        consts = dict(HAS_BEFORE=False, HAS_AFTER=True, HAS_NEXT=True, BLOCK=2048)
        floats = ("eps", "eps2")
    elif kernel == "write_kv":
        fn = kernels._write_kv_kernel
        consts = dict(D=96, BLOCK_D=128, HAS_MODULO=True, HAS_SINK=True)
    elif kernel == "rotate_half":
        fn = kernels._rotate_kernel
        consts = dict(D=128, PAIRS=False, HAS_BIAS=False, BLOCK_H=16)
    else:
        fn = kernels._silu_mul_kernel
        consts = dict(BLOCK=2048)
    ptr = {a: "i64" if a == "pos_ptr" else "bf16" for a in fn.arg_names if a.endswith("_ptr")}
    compiled = compile_for_sm90(fn, {**consts, "USE_PDL": pdl}, ptr, floats=floats,
                                **({"launch_pdl": True} if pdl else {}))
    assert compiled.asm.get("cubin")
    ptx = compiled.asm["ptx"]
    assert ("griddepcontrol.wait" in ptx) == pdl and ("griddepcontrol.launch_dependents" in ptx) == pdl
    if pdl:  # nothing read before the wait
        assert ptx.index("griddepcontrol.wait") < ptx.index("ld.global")


@pytest.mark.skipif(INTERPRET, reason="compiles with Triton's compiler, not the interpreter")
@pytest.mark.parametrize("num_warps", [1, 4, 8])
@pytest.mark.parametrize("side", ["HAS_BEFORE", "HAS_AFTER"])
def test_norm_kernel_issues_every_load_before_its_first_reduction(side, num_warps):
    """A decode step's norm is one program per row and its time is latency: every global load (the row, the residual,
    both norms' weights) comes before the first cross-lane reduction in the sm_90 PTX, so no memory round trip waits
    behind a reduction (loading each operand where it is first used cost 0.15 ms of Ouro-1.4B's 6.7 ms step)."""
    from triton_ops.fused import kernels

    fn = kernels._rms_norm_kernel
    consts = dict(HAS_BEFORE=side == "HAS_BEFORE", HAS_AFTER=side == "HAS_AFTER", HAS_NEXT=True, BLOCK=2048,
                  USE_PDL=False)  # fmt: skip
    compiled = compile_for_sm90(fn, consts, {a: "bf16" for a in fn.arg_names if a.endswith("_ptr")},
                                floats=("eps", "eps2"), num_warps=num_warps)  # fmt: skip
    lines = compiled.asm["ptx"].splitlines()
    first_reduction = next(i for i, line in enumerate(lines) if "shfl.sync" in line or "bar.sync" in line)
    loads = [i for i, line in enumerate(lines) if "ld.global" in line]
    assert loads and max(loads) < first_reduction


def test_norm_warps_follow_the_rule_unless_norm_tuning_sets_them(monkeypatch):
    """The norm launch runs 4 warps below 4,096 columns and 8 from there, or `NORM_TUNING["num_warps"]` when set (the
    benchmarks' sweep); recorded, not run."""
    from triton_ops.fused import NORM_TUNING, kernels

    seen = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **kw: seen.append(kw["num_warps"])

    monkeypatch.setattr(kernels, "_rms_norm_kernel", Recorder())
    monkeypatch.setattr(ops, "use_triton", lambda op, *tensors: True)
    w = torch.ones(2048)
    ops.rms_norm(torch.randn(1, 2048), w, 1e-6)
    ops.rms_norm_pair(torch.randn(1, 5280), torch.ones(5280), 1e-6, torch.ones(5280), 1e-6)
    monkeypatch.setitem(NORM_TUNING, "num_warps", 2)
    ops.rms_norm_pair(torch.randn(1, 2048), w, 1e-6, w, 1e-6)
    assert seen == [4, 8, 2]


def test_dispatch_takes_the_reference_off_cuda_under_autograd_and_when_disabled(monkeypatch):
    calls = []
    monkeypatch.setattr(ops, "use_triton", lambda op, *tensors: calls.append(op) or False)
    x, w = torch.randn(2, 8), torch.ones(8)
    torch.testing.assert_close(fused.rms_norm(x, w, 1e-6), reference.ref_rms_norm(x, w, 1e-6), rtol=0, atol=0)
    assert calls == ["rms_norm"]
    with fused.disabled():
        assert not fused.enabled()
        fused.rms_norm(x, w, 1e-6)
    assert fused.enabled() and calls == ["rms_norm"]  # disabled: never asked
    fused.rms_norm(x, w.requires_grad_(), 1e-6)
    assert calls == ["rms_norm"]  # gradients: the reference, which autograd can differentiate


def test_bad_arguments_are_named():
    x = torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match="`cos` and `sin` must have shape"):
        fused.rotate_half(x, torch.randn(1, 2, 4), torch.randn(1, 2, 4))
    with pytest.raises(ValueError, match="`add_after` must have the shape"):
        fused.rms_norm(x, torch.ones(8), 1e-6, add_after=torch.randn(8))
    with pytest.raises(ValueError, match="`up` must have the shape"):
        fused.silu_mul(x, x.half())
    with pytest.raises(ValueError, match="`bias` must hold 4 x 8"):
        fused.rotate_pairs(x, torch.randn(1, 2, 1, 4), torch.randn(1, 2, 1, 4), bias=torch.randn(3, 8))


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["ouro", "huginn"])
def test_models_give_the_same_tokens_with_and_without_the_fused_kernels(arch):
    """On CUDA the models' norms, RoPE and gated activation run the fused kernels: fp32 greedy tokens equal the op-by-op
    path's, and bf16 logits stay within bf16 rounding of it."""
    from tests.helpers import call_kwargs, make_model

    ids = torch.randint(3, 60, (2, 17), generator=torch.Generator().manual_seed(0)).cuda()
    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 0.1)):
        model = make_model(arch).to("cuda", dtype)
        kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True,
                  **call_kwargs(arch))
        with torch.no_grad():
            fast = model.generate(ids, **kw)
            with fused.disabled():
                slow = model.generate(ids, **kw)
        if dtype == torch.float32:
            assert torch.equal(fast.sequences, slow.sequences)
        torch.testing.assert_close(fast.logits[0], slow.logits[0], atol=tol, rtol=tol)
