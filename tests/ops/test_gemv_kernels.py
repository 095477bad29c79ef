"""`triton_ops.gemv` against its reference (`F.linear`), its sm_90 compile, its dispatch switch and the models' use
of it.

The kernel tests run on CUDA, or on the CPU under `TRITON_INTERPRET=1` (started by
`tests/ops/test_triton_interpreter.py`); the dispatch rules run on any machine.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.helpers import compile_for_sm90
from triton_ops import gemv as gemv_pkg
from triton_ops.gemv import GEMV_TUNING, gemv, ops, ref_gemv

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
kernels = pytest.mark.skipif(
    not (torch.cuda.is_available() or INTERPRET), reason="needs CUDA or TRITON_INTERPRET=1 (see test_triton_interpreter)"
)
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if torch.cuda.is_available() else [])

#: launch settings that cover both paths, one and several K splits, tiles that do not divide N or K
CONFIGS = {
    "default": None,
    "fma-split3": {"block_n": 8, "block_k": 32, "dot": False, "num_warps": 4, "num_stages": 2, "split": 3},
    "fma-bn4": {"block_n": 4, "block_k": 64, "dot": False, "num_warps": 2, "num_stages": 2, "split": 1},
    "dot-split2": {"block_n": 16, "block_k": 32, "dot": True, "num_warps": 4, "num_stages": 2, "split": 2},
    "dot-bn32": {"block_n": 32, "block_k": 64, "dot": True, "num_warps": 4, "num_stages": 3, "split": 1},
    # the PDL launch's loop (weights one tile ahead, the first before the wait), runnable without PDL
    "preload-split3": {"block_n": 8, "block_k": 32, "dot": False, "num_warps": 4, "num_stages": 2, "split": 3,
                       "preload": True},
    "preload-bn4": {"block_n": 4, "block_k": 64, "dot": False, "num_warps": 2, "num_stages": 2, "split": 1,
                    "preload": True},
}


@pytest.fixture
def on_cpu(monkeypatch):
    """Under the interpreter the kernels take CPU tensors: let the dispatch send them there."""
    if INTERPRET and not torch.cuda.is_available():
        monkeypatch.setattr(ops, "use_triton", lambda op, *tensors: True)


def _rand(shape, dtype, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale).to(dtype).to(DEVICE)


def _check_close(out, x, w, b=None):
    """STYLE 14: the kernel's error against the fp64 product is at most twice the error of `F.linear` run in the
    kernel's dtype, plus a small atol."""
    exact = torch.nn.functional.linear(x.double(), w.double(), None if b is None else b.double())
    same_dtype = ref_gemv(x, w, b) if x.dtype != torch.bfloat16 or x.is_cuda else ref_gemv(x.float(), w.float(), b)
    ref_err = (same_dtype.double() - exact).abs().max().item()
    err = (out.double() - exact).abs().max().item()
    atol = 1e-5 if x.dtype == torch.float32 else 1e-3
    assert err <= 2 * ref_err + atol, (err, ref_err)


@kernels
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("config", list(CONFIGS), ids=str)
@pytest.mark.parametrize(
    ("m", "n", "k"),
    [pytest.param(*c, id="M{}-N{}-K{}".format(*c)) for c in [(1, 70, 200), (3, 33, 100), (16, 70, 200), (2, 48, 96)]],
)
def test_gemv_matches_reference(on_cpu, m, n, k, config, dtype):
    x, w = _rand((m, k), dtype, 0), _rand((n, k), dtype, 1, k**-0.5)
    out = gemv(x, w, config=CONFIGS[config])
    assert out.shape == (m, n) and out.dtype == dtype
    _check_close(out, x, w)


def _eager_gated(gate_up, w):
    """The models' eager math: `silu(gate) * up` in the input dtype, then the projection."""
    k = w.shape[1]
    return ref_gemv(torch.nn.functional.silu(gate_up[..., :k]) * gate_up[..., k:], w)


@kernels
@pytest.mark.parametrize("config", ["default", "fma-split3", "preload-split3", "preload-bn4", "dot-split2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_gated_gemv_is_silu_mul_then_gemv(on_cpu, config, dtype, monkeypatch):
    """`gated=True` reads `silu(gate) * up` of `x = [gate | up]` as its input: the same bits as the activation
    kernel's output fed to the plain kernel (the same roundings), close to the eager math; and a seeded fault (the
    halves swapped, as a kernel reading them the wrong way round would) is caught by the same comparison."""
    from triton_ops import fused
    from triton_ops.fused import ops as fused_ops

    if INTERPRET and not torch.cuda.is_available():  # the activation kernel too, not its reference
        monkeypatch.setattr(fused_ops, "use_triton", lambda op, *tensors: True)

    m, n, k = 3, 40, 100
    gate_up = _rand((1, m, 2 * k), dtype, 5)
    w = _rand((n, k), dtype, 6, k**-0.5)
    out = gemv(gate_up, w, config=CONFIGS[config], gated=True)
    assert out.shape == (1, m, n)
    act = fused.silu_mul(gate_up[..., :k], gate_up[..., k:])
    assert torch.equal(out, gemv(act.contiguous(), w, config=CONFIGS[config]))
    ref = _eager_gated(gate_up, w)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol)
    swapped = gemv(torch.cat([gate_up[..., k:], gate_up[..., :k]], -1), w, config=CONFIGS[config], gated=True)
    assert not torch.allclose(swapped, ref, rtol=tol, atol=tol)


def test_silu_linear_fuses_only_where_the_projection_takes_the_kernel(monkeypatch):
    """`silu_linear`: one gated launch when `fuse_silu` and `routes` hold; the activation kernel then `linear`
    otherwise (CPU, switched off, a shape that cuBLAS takes); every path is the eager math."""
    calls = []
    real = ops.gemv
    monkeypatch.setattr(ops, "gemv", lambda *a, **kw: calls.append(kw.get("gated", False)) or real(*a, **kw))
    x, w = torch.randn(1, 1, 2 * 64, dtype=torch.float32), torch.randn(32, 64, dtype=torch.float32)
    torch.testing.assert_close(ops.silu_linear(x, w), _eager_gated(x, w))
    assert calls == []  # CPU: not routed
    monkeypatch.setitem(GEMV_TUNING, "enabled", True)
    monkeypatch.setattr(ops, "routes", lambda x, w, b=None: True)
    torch.testing.assert_close(ops.silu_linear(x, w), _eager_gated(x, w))
    assert calls == [True]  # routed: the gated kernel (its CPU reference here)
    monkeypatch.setitem(GEMV_TUNING, "fuse_silu", False)
    ops.silu_linear(x, w)
    assert calls == [True, False]  # off: silu_mul, then the plain projection
    with pytest.raises(ValueError, match="`x` must end in 2 K = 128"):
        ops.silu_linear(torch.randn(1, 64), w)
    with pytest.raises(ValueError, match="`x` must end in 2 K, gate and up, = 128"):
        gemv(torch.randn(1, 64), w, gated=True)


@kernels
@pytest.mark.parametrize("config", ["fma-split3", "dot-split2"])
def test_gemv_bias_leading_dims_and_determinism(on_cpu, config):
    """Leading dims flatten into rows, the bias is added once (also after a split), and two calls give the same
    bits (the splits are added in a fixed order)."""
    x, w, b = _rand((2, 3, 100), torch.float16, 0), _rand((40, 100), torch.float16, 1, 0.1), _rand((40,), torch.float16, 2)
    out = gemv(x, w, b, config=CONFIGS[config])
    assert out.shape == (2, 3, 40)
    _check_close(out.reshape(6, 40), x.reshape(6, 100), w, b)
    assert torch.equal(out, gemv(x, w, b, config=CONFIGS[config]))


@kernels
def test_gemv_reads_a_slice_of_a_stacked_weight(on_cpu):
    """A weight whose rows are a slice of a larger buffer (a stacked projection's part) is read in place."""
    stacked = _rand((96, 64), torch.float32, 3, 0.1)
    part = stacked[32:80]
    x = _rand((2, 64), torch.float32, 4)
    _check_close(gemv(x, part, config=CONFIGS["fma-split3"]), x, part.contiguous())


@kernels
def test_gemv_split_rule_fills_the_sms(on_cpu):
    """The default rule splits K when the feature blocks are fewer than the SMs, never below `min_split_k`."""
    cfg = {"block_n": 16, "block_k": 256, "split": None}
    assert ops._split(cfg, 2048, 2048, 132) == (2, 1024)  # 128 blocks on 132 SMs: two halves of K
    assert ops._split(cfg, 11264, 2048, 132) == (1, 2048)  # 704 blocks: no split
    assert ops._split(cfg, 2048, 5632, 132)[0] == 2
    assert ops._split({**cfg, "split": 3}, 70, 200, 132) == (1, 256)  # a split is at least one K block


@pytest.mark.skipif(INTERPRET, reason="compiles with Triton's compiler, not the interpreter")
@pytest.mark.parametrize("pdl", [False, True], ids=["plain", "pdl"])
@pytest.mark.parametrize("dot", [False, True], ids=["fma", "dot"])
@pytest.mark.parametrize("partial", [False, True], ids=["one-split", "splits"])
def test_gemv_kernel_compiles_for_sm90(dot, partial, pdl):
    """The interpreter runs Python, not Triton's compiler: compile both paths for sm_90 as a bf16 decode step
    launches them (aligned pointers and sizes: vectorized loads), and the reduce kernel, with no GPU; with
    programmatic dependent launch (the FMA path preloading, and reading a gated input as Ouro's down projection does)
    the wait and the trigger are there, the first weight load before the wait, and neither without it."""
    from triton_ops.gemv.kernels import _gemv_fwd_kernel, _gemv_reduce_kernel

    consts = dict(BLOCK_M=16 if dot else 1, BLOCK_N=16 if dot else 8, BLOCK_K=256 if dot else 512, USE_DOT=dot,
                  IEEE=False, PARTIAL=partial, HAS_BIAS=not partial, PRELOAD=pdl and not dot,
                  GATED=pdl and not dot, USE_PDL=pdl, ROPE=False, HALF=1, KV=False)  # fmt: skip
    ptr = dict(x_ptr="bf16", w_ptr="bf16", bias_ptr="bf16", out_ptr="fp32" if partial else "bf16", ws_ptr="fp32",
               cos_ptr="bf16", sin_ptr="bf16", k_ptr="bf16", v_ptr="bf16", pos_ptr="i64")  # fmt: skip
    aligned = {"x_ptr", "w_ptr", "bias_ptr", "out_ptr", "ws_ptr", "N", "K", "K_SPLIT", "stride_xm", "stride_wn",
               "stride_om", "stride_os"}  # fmt: skip
    opts = {"launch_pdl": True} if pdl else {}
    kernel = compile_for_sm90(_gemv_fwd_kernel, consts, ptr, aligned=aligned, num_warps=4, num_stages=3, **opts)
    reduce = compile_for_sm90(_gemv_reduce_kernel, dict(HAS_BIAS=True, BLOCK=1024, USE_PDL=pdl),
                              {**ptr, "out_ptr": "bf16"}, aligned=aligned, num_warps=4, **opts)  # fmt: skip
    assert kernel.asm.get("cubin") and reduce.asm.get("cubin")
    ptx = kernel.asm["ptx"]
    assert ("mma" in ptx) == dot
    assert "ld.global.v4" in ptx or "cp.async" in ptx  # W is read in 16-byte pieces
    for code in (ptx, reduce.asm["ptx"]):
        assert ("griddepcontrol.wait" in code) == pdl and ("griddepcontrol.launch_dependents" in code) == pdl
    if pdl and not dot:  # the weight tile is requested before the wait, `x` after it
        assert ptx.index("ld.global") < ptx.index("griddepcontrol.wait")


@pytest.mark.skipif(INTERPRET, reason="compiles with Triton's compiler, not the interpreter")
@pytest.mark.parametrize("kv", [False, True], ids=["rope", "rope-kv"])
@pytest.mark.parametrize("block_n", [2, 4])
def test_rope_epilogue_compiles_for_sm90(block_n, kv):
    """RoPE in the projection's store (`linear_rope`) at Ouro-1.4B's q/k/v settings for one row (the table's 4 x 512,
    2 warps, and 2 x 2048), with and without the cache store (`kv_out`): the tables are loaded after the product,
    nothing spills."""
    from triton_ops.gemv.kernels import _gemv_fwd_kernel

    consts = dict(BLOCK_M=1, BLOCK_N=block_n, BLOCK_K=512 if block_n == 4 else 2048, USE_DOT=False, IEEE=False,
                  PARTIAL=False, HAS_BIAS=False, PRELOAD=False, GATED=False, USE_PDL=False, ROPE=True, HALF=64, KV=kv)
    ptr = dict(x_ptr="bf16", w_ptr="bf16", bias_ptr="bf16", out_ptr="bf16", cos_ptr="bf16", sin_ptr="bf16",
               k_ptr="bf16", v_ptr="bf16", pos_ptr="i64")
    aligned = {"x_ptr", "w_ptr", "out_ptr", "N", "K", "K_SPLIT", "stride_xm", "stride_wn", "stride_om", "cos_ptr",
               "sin_ptr", "stride_cs"}  # fmt: skip
    kernel = compile_for_sm90(_gemv_fwd_kernel, consts, ptr, aligned=aligned, num_warps=2 if block_n == 4 else 4,
                              num_stages=2)  # fmt: skip
    assert kernel.asm.get("cubin") and ".local" not in kernel.asm["ptx"]


@kernels
@pytest.mark.parametrize("config", ["fma-bn4", "dot-bn32", "preload-bn4", "fma-bn2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("m", [1, 3])
def test_linear_rope_is_the_projection_then_rotate_half(on_cpu, monkeypatch, config, dtype, m):
    """`linear_rope` rotates the queries and keys of a stacked q/k/v projection in the GEMV kernel: the bits of the
    projection at the same settings followed by `rotate_half`'s kernel, and the values (past `rotated`) unrotated;
    a kernel that paired a channel with the wrong partner, took the sign the wrong way round or read another row's
    angles would differ. Heads of 32 channels, 2 query and 1 key / value heads."""
    from triton_ops.fused import ops as fused_ops

    if INTERPRET and not torch.cuda.is_available():  # the rotation kernel too, not its reference
        monkeypatch.setattr(fused_ops, "use_triton", lambda op, *tensors: True)
    cfg = CONFIGS.get(config, {"block_n": 2, "block_k": 64, "dot": False, "num_warps": 4, "num_stages": 2, "split": 1})
    monkeypatch.setattr(ops, "routes", lambda *a, **kw: True)
    monkeypatch.setattr(ops, "gemv_config", lambda *a: {**ops.default_config(*a), **cfg})
    d, hq, hk, k = 32, 2, 1, 80
    n, rotated = (hq + 2 * hk) * d, (hq + hk) * d
    x = _rand((m, 1, k), dtype, 0)
    w = _rand((n, k), dtype, 1, k**-0.5)
    angles = _rand((m, 1, d // 2), torch.float32, 2, 3.0)
    cos, sin = torch.cat([angles, angles], -1).cos().to(dtype), torch.cat([angles, angles], -1).sin().to(dtype)
    y = ops.linear_rope(x, w, cos, sin, rotated)
    plain = gemv(x, w, config=cfg)
    qk = fused_ops.rotate_half(plain[..., :rotated].reshape(m, 1, hq + hk, d), cos, sin)
    assert y is not None and y.shape == (m, 1, n)
    assert torch.equal(y[..., :rotated].reshape(qk.shape), qk) and torch.equal(y[..., rotated:], plain[..., rotated:])
    assert not torch.equal(y[..., :rotated], plain[..., :rotated])  # (the rotation did something)


@kernels
@pytest.mark.parametrize("config", ["fma-bn4", "dot-bn32", "fma-bn2"])
@pytest.mark.parametrize("m", [1, 3])
def test_linear_rope_stores_keys_and_values_where_write_kv_would(on_cpu, monkeypatch, config, m):
    """With `kv_out`, the RoPE epilogue also stores each row's rotated keys and its values into a static cell's
    storage at the step's position (read on the device): the storage equals, bit for bit, `fused.write_kv` of the
    result's keys and values into a copy, every other position untouched; the result itself is unchanged. A kernel
    that wrote the queries, swapped keys and values, took another head's or row's features or ignored the position
    would differ. Heads of 32 channels, 2 query and 2 key / value heads, storage of 4 rows and 6 positions."""
    from triton_ops.fused import ops as fused_ops

    if INTERPRET and not torch.cuda.is_available():
        monkeypatch.setattr(fused_ops, "use_triton", lambda op, *tensors: True)
    cfg = CONFIGS.get(config, {"block_n": 2, "block_k": 64, "dot": False, "num_warps": 4, "num_stages": 2, "split": 1})
    monkeypatch.setattr(ops, "routes", lambda *a, **kw: True)
    monkeypatch.setattr(ops, "gemv_config", lambda *a: {**ops.default_config(*a), **cfg})
    d, hq, hk, k, dtype = 32, 2, 2, 80, torch.float16
    n, rotated = (hq + 2 * hk) * d, (hq + hk) * d
    x = _rand((m, 1, k), dtype, 0)
    w = _rand((n, k), dtype, 1, k**-0.5)
    angles = _rand((m, 1, d // 2), torch.float32, 2, 3.0)
    cos, sin = torch.cat([angles, angles], -1).cos().to(dtype), torch.cat([angles, angles], -1).sin().to(dtype)
    k_store, v_store = _rand((4, hk, 6, d), dtype, 3), _rand((4, hk, 6, d), dtype, 4)
    k_want, v_want = k_store.clone(), v_store.clone()
    positions = torch.tensor([4], device=DEVICE)
    y = ops.linear_rope(x, w, cos, sin, rotated, kv_out=(k_store, v_store, positions))
    assert y is not None and torch.equal(y, ops.linear_rope(x, w, cos, sin, rotated))
    key = y[..., hq * d : rotated].reshape(m, 1, hk, d).transpose(1, 2)
    value = y[..., rotated:].reshape(m, 1, hk, d).transpose(1, 2)
    fused_ops.write_kv(k_want[:m], v_want[:m], key, value, positions)
    assert torch.equal(k_store, k_want) and torch.equal(v_store, v_want)
    assert not torch.equal(k_store[:m, :, 4], _rand((4, hk, 6, d), dtype, 3)[:m, :, 4])  # (it wrote something)


def test_linear_rope_kv_out_is_checked():
    """`kv_out` that the epilogue cannot store is an error naming it: more than one token, storage of another layout,
    dtype or width, fewer rows, positions that are not integers."""
    x, w = torch.randn(2, 1, 64, dtype=torch.float16), torch.randn(128, 64, dtype=torch.float16)
    kv = torch.zeros(2, 2, 8, 16, dtype=torch.float16)
    pos = torch.tensor([3])
    bad = [
        (torch.randn(1, 2, 64, dtype=torch.float16), (kv, kv, pos), "one-token step"),
        (x, (kv, kv.transpose(2, 3), pos), "one \\[B, H_kv, T, D\\] layout"),
        (x, (kv[:1], kv[:1], pos), "must hold 2 rows"),
        (x, (kv.float(), kv.float(), pos), "must be torch.float16"),
        (x, (kv, kv, pos.float()), "integer tensor"),
        (x, (kv, kv), "tuple \\(k, v, positions\\)"),
    ]
    for xx, kv_out, match in bad:
        with pytest.raises(ValueError, match=f"`kv_out`.*{match}|{match}"):
            table = torch.ones(*xx.shape[:-1], 16, dtype=torch.float16)
            ops.linear_rope(xx, w, table, table, 96, kv_out=kv_out)


def test_linear_rope_declines_where_the_kernel_cannot_rotate(monkeypatch):
    """None (the caller rotates after the projection) off CUDA, with `fuse_rope` off, a K split, blocks of one feature
    or of pairs that do not divide a half head, or tables in another dtype."""
    x, w = torch.randn(1, 1, 64, dtype=torch.float16), torch.randn(128, 64, dtype=torch.float16)
    cos = sin = torch.ones(1, 1, 32, dtype=torch.float16)
    assert ops.linear_rope(x, w, cos, sin, 64) is None  # CPU: `linear` takes F.linear
    monkeypatch.setattr(ops, "routes", lambda *a, **kw: True)
    monkeypatch.setattr(ops, "_gemv_fwd", lambda *a, **kw: torch.zeros(1, 128, dtype=torch.float16))
    base = {"block_n": 4, "block_k": 64, "dot": False, "num_warps": 2, "num_stages": 2, "split": 1}
    monkeypatch.setattr(ops, "gemv_config", lambda *a: dict(base))
    assert ops.linear_rope(x, w, cos, sin, 64) is not None
    assert ops.linear_rope(x, w, cos.float(), sin.float(), 64) is None
    assert ops.linear_rope(x, w, cos, sin, 48) is None  # not whole heads
    monkeypatch.setitem(GEMV_TUNING, "fuse_rope", False)
    assert ops.linear_rope(x, w, cos, sin, 64) is None
    monkeypatch.setitem(GEMV_TUNING, "fuse_rope", True)
    for bad in ({"block_n": 1}, {"block_n": 64}, {"block_n": 6}, {"split": 2, "block_k": 32}):
        monkeypatch.setattr(ops, "gemv_config", lambda *a, bad=bad: {**base, **bad})
        assert ops.linear_rope(x, w, cos, sin, 64) is None, bad


def _tiny_ouro_on_the_kernel(monkeypatch, keyword):
    """A tiny fp16 Ouro (seed 0) whose projections take the GEMV kernel (the interpreter's fused ops too), and the list
    into which every launch appends whether it was given `keyword` (`rope`, `kv_out`)."""
    from triton_ops.fused import ops as fused_ops

    if INTERPRET and not torch.cuda.is_available():
        monkeypatch.setattr(fused_ops, "use_triton", lambda op, *tensors: True)
    torch.manual_seed(0)
    model, _ = _tiny("ouro")
    monkeypatch.setitem(GEMV_TUNING, "enabled", True)
    monkeypatch.setitem(GEMV_TUNING, "listed_only", False)
    launches = []
    real = ops._gemv_fwd
    monkeypatch.setattr(ops, "_gemv_fwd", lambda *a, **kw: launches.append(kw.get(keyword) is not None)
                        or real(*a, **kw))  # fmt: skip
    return model.to(DEVICE, torch.float16).eval(), launches


@kernels
def test_tiny_ouro_rotates_in_the_projection_kernel_bit_for_bit(on_cpu, monkeypatch):
    """A tiny fp16 Ouro prompt and decode step with the projections on the kernel: the q/k/v launches carry RoPE
    (`linear_rope`; strided query and key views downstream), and the logits equal those of the rotation run as its
    own kernel (`fuse_rope` off), bit for bit."""
    from hf_loopcache import FullLoopCache

    model, rope_launches = _tiny_ouro_on_the_kernel(monkeypatch, "rope")
    ids = torch.randint(1, 64, (1, 5), device=DEVICE)

    def decode():
        cache = FullLoopCache(model)
        with torch.no_grad():
            model(ids[:, :4], cache=cache)
            return model(ids[:, 4:], cache=cache).logits

    fused_rope = decode()
    assert sum(rope_launches) == 2 * 2  # q/k/v of the prompt and the decode step, in each of the 2 loops
    rope_launches.clear()
    monkeypatch.setitem(GEMV_TUNING, "fuse_rope", False)
    assert torch.equal(decode(), fused_rope) and not any(rope_launches)


@kernels
@pytest.mark.parametrize("cache_name", ["full", "ripe"])
def test_tiny_ouro_stores_keys_and_values_in_the_projection_kernel(on_cpu, monkeypatch, cache_name):
    """A tiny fp16 Ouro, prompt of 2 rows and 3 decode steps into a static cache, projections on the kernel: every
    decode step's q/k/v launch of a static dense cell stores its keys and values (`kv_out`; RIPE: the deepest plane's
    cells, not the windowed ones), and the logits and the stored cells equal, bit for bit, those with the cell writing
    them itself (`fuse_kv` off)."""
    from hf_loopcache import FullLoopCache, RIPECache
    from hf_loopcache.cache.layers.static import StaticDenseLayer

    model, stores = _tiny_ouro_on_the_kernel(monkeypatch, "kv_out")
    ids = torch.randint(1, 64, (2, 7), device=DEVICE)
    make = {"full": lambda: FullLoopCache(model, static=True, max_batch_size=2, max_cache_len=8),
            "ripe": lambda: RIPECache(model, window=2, static=True, max_batch_size=2, max_cache_len=8)}[cache_name]

    def decode():
        cache = make()
        with torch.no_grad():
            logits = [model(ids[:, :4], cache=cache).logits]
            logits += [model(ids[:, t : t + 1], cache=cache).logits for t in range(4, 7)]
        return torch.cat(logits, 1), [layer.full_states() for layer in cache.cells]

    logits, cells = decode()
    dense = sum(isinstance(layer, StaticDenseLayer) for layer in make().cells) if cache_name == "ripe" else 2
    assert 0 < sum(stores) == 3 * dense  # one store per decode step and static dense cell (1 layer x 2 loops)
    stores.clear()
    monkeypatch.setitem(GEMV_TUNING, "fuse_kv", False)
    plain_logits, plain_cells = decode()
    assert not any(stores) and torch.equal(logits, plain_logits)
    for (k, v), (pk, pv) in zip(cells, plain_cells):
        assert torch.equal(k, pk) and torch.equal(v, pv)


# ---- dispatch (any machine) ----


def test_switch_is_on_for_measured_wins_only():
    """On by default since the H200 sweep filled `GEMV_CONFIGS`, and only for the listed wins: CPU tensors, and a
    shape the table does not list, stay on F.linear."""
    assert GEMV_TUNING["enabled"] is True and GEMV_TUNING["listed_only"] is True
    x, w = torch.randn(1, 64, dtype=torch.float16), torch.randn(32, 64, dtype=torch.float16)
    assert not ops.routes(x, w)  # CPU
    assert (2048, 2048) in ops.GEMV_CONFIGS and ops.GEMV_CONFIGS[(11264, 2048)][1] is None  # cuBLAS won gate/up


def test_switch_on_routes_cuda_only(monkeypatch):
    """On: CPU tensors stay on F.linear (the real device check); a CUDA call (simulated) of at most `max_rows` fp16 /
    bf16 rows without gradient takes the kernel, anything else cuBLAS."""
    monkeypatch.setitem(GEMV_TUNING, "enabled", True)
    monkeypatch.setitem(GEMV_TUNING, "listed_only", False)
    h = torch.float16
    w = torch.randn(32, 64, dtype=h)
    assert not ops.routes(torch.randn(1, 64, dtype=h), w)  # CPU
    monkeypatch.setattr(ops, "use_triton", lambda op, *tensors: True)  # as on CUDA with Triton
    assert ops.routes(torch.randn(1, 64, dtype=h), w)
    assert ops.routes(torch.randn(2, 8, 64, dtype=h), w)  # 16 rows
    assert not ops.routes(torch.randn(17, 64, dtype=h), w)  # M > 16: cuBLAS
    assert not ops.routes(torch.randn(3, 6, 64, dtype=h), w)  # 18 rows
    assert not ops.routes(torch.randn(1, 64), w.float())  # fp32
    assert not ops.routes(torch.randn(1, 64, dtype=h), w.bfloat16())  # mixed dtypes
    assert not ops.routes(torch.randn(1, 64, dtype=h, requires_grad=True), w)  # autograd
    monkeypatch.setitem(GEMV_TUNING, "enabled", False)
    assert not ops.routes(torch.randn(1, 64, dtype=h), w)


def test_table_decides_per_shape_and_row_class(monkeypatch):
    """`GEMV_CONFIGS`: None keeps cuBLAS for that row class; with `listed_only` (the default) an unlisted shape or row
    class keeps cuBLAS too; a listed one takes the kernel with its settings."""
    monkeypatch.setitem(GEMV_TUNING, "enabled", True)
    monkeypatch.setattr(ops, "use_triton", lambda op, *tensors: True)
    fma = {"block_n": 8, "block_k": 512, "dot": False, "num_warps": 4, "num_stages": 2, "split": 1}
    monkeypatch.setitem(ops.GEMV_CONFIGS, (32, 64), {1: fma, 8: None})
    w = torch.randn(32, 64, dtype=torch.float16)
    assert ops.routes(torch.randn(1, 64, dtype=torch.float16), w)
    assert not ops.routes(torch.randn(8, 64, dtype=torch.float16), w)  # cuBLAS measured faster
    assert not ops.routes(torch.randn(6, 64, dtype=torch.float16), w)  # class 8
    assert not ops.routes(torch.randn(2, 64, dtype=torch.float16), w)  # not measured
    assert not ops.routes(torch.randn(1, 32, dtype=torch.float16), torch.randn(32, 32, dtype=torch.float16))
    monkeypatch.setitem(GEMV_TUNING, "listed_only", False)
    assert ops.routes(torch.randn(2, 64, dtype=torch.float16), w)
    assert not ops.routes(torch.randn(8, 64, dtype=torch.float16), w)  # None still means cuBLAS
    assert ops.gemv_config(1, 32, 64, 132) == fma
    assert ops.gemv_config(8, 32, 64, 132) == ops.default_config(8, 32, 64, 132)


def test_linear_calls_the_kernel_only_when_routed(monkeypatch):
    calls = []
    monkeypatch.setattr(ops, "gemv", lambda x, w, b=None: calls.append(x.shape) or torch.nn.functional.linear(x, w, b))
    x, w = torch.randn(2, 64, dtype=torch.float16), torch.randn(32, 64, dtype=torch.float16)
    torch.testing.assert_close(gemv_pkg.linear(x, w), torch.nn.functional.linear(x, w))
    assert calls == []
    monkeypatch.setitem(GEMV_TUNING, "enabled", True)
    monkeypatch.setitem(GEMV_TUNING, "listed_only", False)
    monkeypatch.setattr(ops, "use_triton", lambda op, *tensors: True)
    gemv_pkg.linear(x, w)
    gemv_pkg.linear(torch.randn(20, 64, dtype=torch.float16), w)
    assert calls == [(2, 64)]


def test_models_linear_leaves_hooked_modules_alone(monkeypatch):
    """`_common.linear` calls a module with hooks (or a replaced forward) as it is, never the kernel."""
    from hf_loopcache.models._common import linear

    monkeypatch.setitem(GEMV_TUNING, "enabled", True)
    monkeypatch.setattr(ops, "use_triton", lambda op, *tensors: True)
    monkeypatch.setattr(ops, "gemv", lambda *a, **k: pytest.fail("the kernel ran for a hooked module"))
    lin = torch.nn.Linear(64, 32, bias=False).half()
    seen = []
    lin.register_forward_hook(lambda mod, args, out: seen.append(out.shape))
    linear(lin, torch.randn(1, 64, dtype=torch.float16))
    assert seen == [(1, 32)]


def test_gemv_validates_its_arguments():
    with pytest.raises(ValueError, match="`x` must end in K = 64"):
        gemv(torch.randn(1, 63), torch.randn(8, 64))
    with pytest.raises(ValueError, match="one dtype"):
        gemv(torch.randn(1, 64, dtype=torch.float16), torch.randn(8, 64))
    with pytest.raises(ValueError, match="`bias` must be"):
        gemv(torch.randn(1, 64), torch.randn(8, 64), torch.randn(7))


# ---- the models, switch on, under the interpreter ----


def _tiny(family):
    from hf_loopcache import HuginnConfig, HuginnForCausalLM, OuroConfig, OuroForCausalLM

    if family == "ouro":  # per layer call: q/k/v stacked, o_proj, gate/up stacked, down_proj; 1 layer x 2 loops
        cfg = OuroConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, total_ut_steps=2, bos_token_id=0,
                         eos_token_id=0, pad_token_id=0)  # fmt: skip
        return OuroForCausalLM(cfg), 4 * 2
    # per block: Wqkv, attn.proj, fc, mlp proj; prelude 1 + core 1 x 2 steps + coda 1
    cfg = HuginnConfig(n_embd=32, n_heads=2, n_layers_in_prelude=1, n_layers_in_recurrent_block=1, n_layers_in_coda=1,
                       intermediate_size=48, vocab_size=64, mean_recurrence=2, bos_token_id=0, eos_token_id=0,
                       pad_token_id=0)  # fmt: skip
    return HuginnForCausalLM(cfg), 4 * 4


@kernels
@pytest.mark.parametrize("family", ["ouro", "huginn"])
def test_tiny_model_decode_matches_with_the_switch_on(on_cpu, monkeypatch, family):
    """A tiny fp16 model: a prompt, then one decode step; with the switch on every projection of the blocks runs the
    kernel (counted) and the logits match the switch off within fp16 tolerance."""
    from hf_loopcache import FullLoopCache

    torch.manual_seed(0)
    model, per_forward = _tiny(family)
    model = model.to(DEVICE, torch.float16).eval()
    ids = torch.randint(1, 64, (1, 5), device=DEVICE)
    launched = []
    real = ops._gemv_fwd
    monkeypatch.setattr(ops, "_gemv_fwd", lambda *a, **kw: launched.append(a[0].shape) or real(*a, **kw))

    def decode():
        cache = FullLoopCache(model)
        with torch.no_grad():
            model(ids[:, :4], cache=cache)
            return model(ids[:, 4:], cache=cache).logits.float()

    off = decode()
    assert launched == []
    monkeypatch.setitem(GEMV_TUNING, "enabled", True)
    monkeypatch.setitem(GEMV_TUNING, "listed_only", False)  # (tiny shapes are not in the table)
    monkeypatch.setitem(GEMV_TUNING, "max_rows", 4)  # the 4-token prompt takes the kernel too
    on = decode()
    assert len(launched) == 2 * per_forward
    torch.testing.assert_close(on, off, rtol=2e-2, atol=2e-2)
