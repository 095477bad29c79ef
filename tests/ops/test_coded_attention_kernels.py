"""The Triton kernel of `coded_attention` against the pure-torch reference on the same stored codes.

Runs on CUDA, or on the CPU under `TRITON_INTERPRET=1` (then only fp32 / fp16 and small shapes:
`tests/ops/test_triton_interpreter.py` starts this module in a subprocess with the variable set, because Triton reads
it when the kernels are decorated). bf16 and the long histories carry the `gpu` mark.

Tolerance (STYLE 14): the kernel's error against the reference in fp64 is at most twice the error of the same
reference fed the kernel's dtype (inputs and dequantized codes rounded to it), plus a small atol.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass

import pytest
import torch

from tests.ops.conftest import record_launches
from triton_ops.coded_attention import CellView, reference_coded_attention
from triton_ops.quant import naive

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() or INTERPRET), reason="needs CUDA or TRITON_INTERPRET=1 (see test_triton_interpreter)"
)
PAGE = 32
ATOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
LSE_ATOL = {torch.float32: 1e-5, torch.float16: 2e-2, torch.bfloat16: 1e-1}
# V-precision threshold: fp32 runs use a small tau so that cold and hot tokens mix near the threshold; in 16 bits
# a score rounding can flip a token that close to it (a legitimate difference of up to p * 1.5 * scale), so those
# runs keep LoopKV's tau = 14, where a flipped token weighs at most 2**-14 of the row's largest probability.
TAU = {torch.float32: 4.0, torch.float16: 14.0, torch.bfloat16: 14.0}


@dataclass
class Case:
    """One cell's stored view: sink [0, S), history [S, S + T_h) as codes / dense, window [w_start, n), Q new tokens
    at n .., per-query history bound (history < bound <= window)."""

    B: int = 1
    Hq: int = 2
    Hkv: int = 1
    D: int = 32
    S: int = 4
    hist: int = 64  # history tokens the last query reads
    Wn: int = 12  # window positions past the history end
    Q: int = 1
    fmt: int = 4  # 4 / 2 codes, 0 dense
    vprec: bool = True
    pad: bool = False
    splits: int | None = None
    moving: bool = True  # per-query bounds differ inside a block
    strided: bool = False  # history borrowed as a view into a larger buffer (a share cell's source)
    lean: float = 2.0  # sink keys lean towards the first H_kv query heads by this much (a sink maximum exists)
    vgroup: int = 32  # value channel group of the codes
    guard: bool = False  # every tensor a view into a buffer whose columns past the head dim hold NaN / 0xFF
    spread: int = 0  # > 0: the window starts this many positions before the history end (bounds cross pages)

    def id(self) -> str:
        fmt = {4: "int4", 2: "int2", 0: "bf16"}[self.fmt]
        extra = "-vprec" if self.vprec and self.fmt == 4 else ""
        extra += "-pad" if self.pad else ""
        extra += f"-ns{self.splits}" if self.splits else ""
        extra += "-strided" if self.strided else ""
        extra += f"-lean{self.lean:g}" if self.lean != 2.0 else ""
        extra += f"-G{self.vgroup}" if self.vgroup != 32 else ""
        extra += "-guard" if self.guard else ""
        extra += f"-spread{self.spread}" if self.spread else ""
        return f"B{self.B}-Hq{self.Hq}-Hkv{self.Hkv}-D{self.D}-S{self.S}-T{self.hist}-W{self.Wn}-Q{self.Q}-{fmt}{extra}"


def _build(case: Case, dtype: torch.dtype, seed: int = 0):
    """Random stored pieces of one cell; returns the CellView (codes / plane as stored, full-precision parts in
    `dtype`) and what the tests need to rebuild it in other dtypes."""
    g = torch.Generator().manual_seed(seed)
    b, hkv, d, s = case.B, case.Hkv, case.D, case.S

    def r(*shape, scale=1.0):
        return torch.randn(*shape, generator=g) * scale

    pages = max(1, math.ceil(case.hist / PAGE))
    t_codes = pages * PAGE
    hist_end = s + case.hist  # the last query's bound
    # the window starts where the first query's history ends (bounds move by up to Q - 1 inside a block)
    w_start = max(s, hist_end - (case.spread or (case.Q - 1 if case.moving else 0)))
    n = hist_end + case.Wn
    q = r(b, case.Hq, case.Q, d, scale=1.5)
    parts = dict(
        sk=r(b, hkv, s, d) + case.lean * q[:, :hkv, :1], sv=r(b, hkv, s, d),
        wk=r(b, hkv, n - w_start, d), wv=r(b, hkv, n - w_start, d), nk=r(b, hkv, case.Q, d), nv=r(b, hkv, case.Q, d),
    )  # fmt: skip
    hk = r(b, hkv, t_codes, d) + r(b, hkv, 1, d, scale=2.0)
    hv = r(b, hkv, t_codes, d)
    bounds = torch.full((b, case.Q), hist_end, dtype=torch.int32)
    if case.moving and case.Q > 1:
        for row in range(b):
            inner = sorted(int(x) for x in torch.randint(w_start, hist_end + 1, (case.Q - 2,), generator=g))
            bounds[row] = torch.tensor([w_start, *inner, hist_end][: case.Q] if case.Q > 1 else [hist_end])
    valid = None
    if case.pad:
        valid = torch.ones(b, n + case.Q, dtype=torch.bool)
        valid[0, : min(3, n)] = False  # left padding of row 0, the sink included
        valid[-1, s + 1 : s + 1 + max(1, case.hist // 2)] = False  # a padded stretch in the history
        if case.Q > 1:
            valid[-1, n] = False  # a padded new token (it still attends to itself)
    if case.fmt:
        history = (
            naive.quantize_keys(hk, case.fmt, group_size=PAGE),
            naive.quantize_values(hv, case.fmt, group_size=case.vgroup),
        )
    else:
        history = (hk.to(dtype), hv.to(dtype))
    return dict(
        case=case, q=q, parts=parts, history=history, bounds=bounds, valid=valid, n=n, w_start=w_start,
        scaling=d**-0.5, tau=TAU[dtype], dtype=dtype,
    )  # fmt: skip


def _widen(x, device):
    """The same bytes inside a larger buffer: a strided view (as a borrowed source buffer or a capacity slice)."""
    big = torch.zeros(x.shape[0] + 1, x.shape[1] + 2, x.shape[2] + 5, x.shape[3], dtype=x.dtype, device=device)
    big[1:, 2:, 3 : 3 + x.shape[2]] = x
    return big[1:, 2:, 3 : 3 + x.shape[2]]


def _guard(t):
    """The same values as a view into a buffer 8 columns wider whose extra columns hold NaN (floats) or 0xFF (codes):
    a kernel that reads past the head dim (its padded tile) sees them in the scores or in the sums."""
    fill = float("nan") if t.is_floating_point() else 255
    big = torch.full((*t.shape[:-1], t.shape[-1] + 8), fill, dtype=t.dtype, device=t.device)
    big[..., : t.shape[-1]] = t
    return big[..., : t.shape[-1]]


def _view(data, dtype, device="cpu", plane=False):
    """The CellView in `dtype` on `device`; `plane=True` replaces coded history by its decoded values (fp32 decode,
    then rounded to `dtype`), a plane the reference reads without V precision."""
    case, p = data["case"], data["parts"]
    conv = {k: v.to(device=device, dtype=dtype) for k, v in p.items()}
    hk, hv = data["history"]
    if isinstance(hk, naive.QuantizedKeys):
        if plane:
            hk, hv = naive.dequantize_keys(hk).to(dtype), naive.dequantize_values(hv).to(dtype)
        elif device != "cpu" or case.strided:
            move = (lambda t: _widen(t.to(device), device)) if case.strided else (lambda t: t.to(device))
            hk = naive.QuantizedKeys(move(hk.codes), move(hk.scale), move(hk.zero), hk.nbits, hk.group_size)
            hv = naive.QuantizedValues(
                move(hv.hi), None if hv.lo is None else move(hv.lo), move(hv.scale), move(hv.zero), hv.nbits,
                hv.group_size,
            )  # fmt: skip
    if isinstance(hk, torch.Tensor):
        hk, hv = hk.to(device=device, dtype=dtype), hv.to(device=device, dtype=dtype)
        if case.strided:
            hk, hv = _widen(hk, device), _widen(hv, device)
    if case.guard:
        conv = {k: _guard(v) for k, v in conv.items()}
        if isinstance(hk, naive.QuantizedKeys):
            hk = naive.QuantizedKeys(_guard(hk.codes), _guard(hk.scale), _guard(hk.zero), hk.nbits, hk.group_size)
            hv = naive.QuantizedValues(
                _guard(hv.hi), None if hv.lo is None else _guard(hv.lo), _guard(hv.scale), _guard(hv.zero), hv.nbits,
                hv.group_size,
            )  # fmt: skip
        else:
            hk, hv = _guard(hk), _guard(hv)
    s_len = min(case.S, data["n"])
    return CellView(
        new_key=conv["nk"], new_value=conv["nv"], length=data["n"], history_end=data["bounds"].to(device),
        sink_key=conv["sk"] if s_len else None, sink_value=conv["sv"] if s_len else None, history_start=case.S,
        history_key=hk, history_value=hv, window_start=data["w_start"],
        window_key=conv["wk"] if data["n"] > data["w_start"] else None,
        window_value=conv["wv"] if data["n"] > data["w_start"] else None,
        key_valid=None if data["valid"] is None else data["valid"].to(device),
    )  # fmt: skip


def _reference(data, stats=None):
    """The contract in fp64 (codes decoded as stored)."""
    tau = data["tau"] if data["case"].vprec else None
    return reference_coded_attention(
        data["q"].double(), _view(data, torch.float64), scaling=data["scaling"], v_precision_tau=tau,
        v_precision_stats=stats,
    )  # fmt: skip


def _reference_error(data, dtype):
    """The reference's own error in `dtype`: every input, decoded history included, rounded to `dtype` (plane,
    both value planes), against the same plane in fp64."""
    exact = reference_coded_attention(data["q"].double(), _view(data, torch.float64, plane=True), scaling=data["scaling"])
    q_low = data["q"].to(dtype)
    low = reference_coded_attention(q_low, _view(data, dtype, plane=True), scaling=data["scaling"])
    return (low[0].double() - exact[0]).abs().max().item()


def _run_kernel(data, device=DEVICE, vprec=None, stats=None, tuning=None):
    from triton_ops.coded_attention.ops import _coded_attention_fwd, _kernel_supports

    case, dtype = data["case"], data["dtype"]
    use_vprec = case.vprec if vprec is None else vprec
    query, view = data["q"].to(device=device, dtype=dtype), _view(data, dtype, device)
    if case.guard:
        query = _guard(query)
    reason = _kernel_supports(query, view, data["tau"] if use_vprec else None)
    if reason is not None and not INTERPRET:  # coded_attention sends such shapes to the reference
        pytest.skip(f"the compiled kernel does not take {reason}")
    return _coded_attention_fwd(
        query, view, scaling=data["scaling"],
        v_precision_tau=data["tau"] if use_vprec else None, v_precision_stats=stats, num_splits=case.splits,
        tuning=tuning,
    )  # fmt: skip


def _check(case: Case, dtype: torch.dtype, seed: int = 0, tuning: dict | None = None):
    data = _build(case, dtype, seed)
    stats_k = torch.zeros(2, dtype=torch.int64, device=DEVICE)
    out, lse = _run_kernel(data, stats=stats_k, tuning=tuning)
    assert out.dtype == dtype and out.shape == (case.B, case.Hq, case.Q, case.D)
    assert lse.shape == (case.B, case.Hq, case.Q) and lse.dtype == torch.float32
    stats_r = torch.zeros(2, dtype=torch.int64)
    ref, ref_lse = _reference(data, stats=stats_r)
    err = (out.double().cpu() - ref).abs().max().item()
    err_ref = _reference_error(data, dtype) if dtype != torch.float32 else 0.0
    assert torch.isfinite(out).all()
    assert err <= 2 * err_ref + ATOL[dtype], f"{case.id()} {dtype}: kernel err {err:.3e}, reference err {err_ref:.3e}"
    torch.testing.assert_close(lse.double().cpu(), ref_lse, atol=LSE_ATOL[dtype], rtol=0)
    if case.vprec and case.fmt == 4:  # same cold set (up to tokens at the threshold, whose score rounds across it)
        assert stats_k[1].item() == stats_r[1].item()
        slack = 0 if dtype == torch.float32 else max(2, int(2e-3 * stats_r[1].item()))
        assert abs(stats_k[0].item() - stats_r[0].item()) <= slack, (stats_k.tolist(), stats_r.tolist())
    else:
        assert stats_k.tolist() == [0, 0]
    return data, out, lse


CPU_CASES = [
    Case(hist=1, S=4),
    Case(hist=31),
    Case(hist=32, splits=1),
    Case(hist=33, splits=2),
    Case(hist=100, splits=3, S=0),
    Case(hist=100, splits=3, pad=True, B=2),
    Case(hist=64, Q=9, Hq=4, Hkv=2, Wn=8, splits=2),  # verification block of W + 1 tokens, GQA 2
    Case(hist=64, Q=5, Hq=8, Hkv=2, pad=True, B=2, splits=2),
    Case(hist=70, fmt=2, Hq=4, Hkv=1, splits=2),
    Case(hist=70, fmt=4, vprec=False, splits=2),
    Case(hist=70, fmt=0, Q=3, splits=2, pad=True, B=2),
    Case(hist=64, strided=True, splits=2, Q=2),
    Case(hist=64, strided=True, fmt=0, splits=2),
    Case(hist=65, Wn=0, Q=1, S=1),  # nothing in the window: the bound is the cached length
    Case(hist=40, Q=9, Hq=8, Hkv=1, Wn=8, splits=2, pad=True),  # 72 rows: two row blocks
    # one row per KV head (decode without GQA): the elementwise path, several pages per loop step
    # (the sink leans less on the query, so that the history carries weight)
    Case(hist=1, Hq=1, Hkv=1),
    Case(hist=100, Hq=2, Hkv=2, splits=3, pad=True, B=2, lean=0.3),
    Case(hist=300, Hq=1, Hkv=1, S=0),  # the launcher's own split count
    Case(hist=200, Hq=2, Hkv=2, fmt=2, pad=True, B=2, lean=0.0),
    Case(hist=150, Hq=2, Hkv=2, fmt=4, vprec=False, strided=True, splits=2, lean=0.0),
    Case(hist=250, Hq=2, Hkv=2, fmt=4, Q=1, lean=0.5),
]


@pytest.mark.parametrize("case", [pytest.param(c, id=c.id()) for c in CPU_CASES])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_kernel_matches_reference(case, dtype):
    _check(case, dtype)


ROW1_CASES = [c for c in CPU_CASES if c.Hq == c.Hkv and c.Q == 1 and c.fmt]


ROW1_SETTINGS = {
    "v3-bytes-np2": {"words": False, "pages": 2}, "v4-words-np2": {"words": True, "pages": 2},
    "v4-words-np1": {"sub_auto_pages": 0},  # v4's loop where the default takes v6's half-page steps (short splits)
}  # fmt: skip


@pytest.mark.parametrize("case", [pytest.param(c, id=c.id()) for c in ROW1_CASES])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("setting", list(ROW1_SETTINGS))
def test_row1_settings_match_reference(case, dtype, setting):
    """The one-row path in its other `ROW1_TUNING` settings (the cases above run the default: v4 words with one page
    per step, or v6's half-page steps at one warp where splits hold <= 8 pages): v3's byte reads, v4 with two pages
    per step (the next step's tiles loaded ahead), and v4 with one page per step everywhere."""
    _check(case, dtype, tuning=ROW1_SETTINGS[setting])


OCC_SETTINGS = {
    "v6-sub2-w1": {"sub": 2, "num_warps": 1}, "v6-sub4-w1": {"sub": 4, "num_warps": 1},
    "v6-sub2-maxnreg": {"sub": 2, "num_warps": 1, "maxnreg": 168}, "v6-maxnreg": {"maxnreg": 168},
    "v6-stages3": {"sub_stages": 3}, "v6-sub2-stages3-w1": {"sub": 2, "sub_stages": 3, "num_warps": 1},
}  # fmt: skip
OCC_CASES = list({c.id(): c for c in (dataclasses.replace(c, vprec=False) for c in ROW1_CASES)}.values())


@pytest.mark.parametrize("case", [pytest.param(c, id=c.id()) for c in OCC_CASES])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("setting", list(OCC_SETTINGS))
def test_row1_occupancy_settings_match_reference(case, dtype, setting):
    """v6 (`ROW1_TUNING["sub"]`, `["sub_stages"]`, `["maxnreg"]`): the word path without V precision in steps of half
    or a quarter page (`kernels._codes_history_row1s`: splits of 1-4 pages, odd page counts, padding, INT2, a borrowed
    history), its loop loading each step's own tiles (`tl.range` stages), and with a register cap (a launch option;
    the interpreter runs the same code)."""
    _check(case, dtype, tuning=OCC_SETTINGS[setting])


@pytest.mark.parametrize(
    "splits, vprec, tune, want",
    [(5, False, {}, (2, 1)), (1, False, {"sub_auto_pages": 8}, (1, 2)), (5, False, {"sub_auto_pages": 0}, (1, 2)),
     (5, True, {}, (1, 2)), (5, False, {"num_warps": 4}, (1, 4))],
    ids=["short-splits", "long-split", "auto-off", "vprec", "warps-set"],
)  # fmt: skip
def test_short_splits_take_half_page_steps_at_one_warp(monkeypatch, splits, vprec, tune, want):
    """v6 `ROW1_TUNING["sub_auto_pages"]` (16): splits of at most that many pages (here 10 pages in 5 splits) run the
    word path in half-page steps at one warp; one split of 10 pages with the setting at 8, the setting at 0, V
    precision and warps other than the default's keep v4's loop. The launch's `SUB` and `num_warps` are read from the call; the output is checked."""
    seen = record_launches(monkeypatch, "_coded_attention_fwd_kernel", lambda grid, kw: (kw["SUB"], kw["num_warps"]))
    _check(Case(hist=300, Hq=1, Hkv=1, S=0, splits=splits, vprec=vprec, lean=0.3), torch.float32, tuning=tune)
    assert seen[-1] == want, seen


NO_HISTORY_CASES = [
    Case(hist=0, Wn=20, Q=1, Hq=2, Hkv=2, D=64, S=4, fmt=0),  # decode, MHA, a sink
    Case(hist=0, Wn=40, Q=3, Hq=4, Hkv=2, D=64, S=0, fmt=0, pad=True, B=2),  # a block, GQA 2, padding, no sink
    Case(hist=0, Wn=9, Q=2, Hq=2, Hkv=1, D=96, S=2, fmt=0, guard=True),  # padded head dim, NaN past it
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", [pytest.param(c, id=c.id()) for c in NO_HISTORY_CASES])
def test_one_launch_read_without_history(monkeypatch, case, dtype):
    """A view with no history (a cell that has coded nothing yet: every position in the sink, window and new
    tokens) and a short window is one launch (`TAIL_TUNING`, `FINAL`): one tail program per row block writes the
    output and lse itself, no merge kernel runs; with `final_slots` 0, or a `final_block` of 16 positions per step,
    the same output; against the reference on the same view."""
    from triton_ops.coded_attention.ops import _coded_attention_fwd

    data = _build(case, dtype)
    view = dataclasses.replace(_view(data, dtype, DEVICE), history_key=None, history_value=None)
    query = data["q"].to(device=DEVICE, dtype=dtype)
    if case.guard:
        query = _guard(query)
    fwd = record_launches(monkeypatch, "_coded_attention_fwd_kernel", lambda grid, kw: (grid[0], kw["FINAL"]))
    merge = record_launches(monkeypatch, "_coded_attention_merge_kernel", lambda grid, kw: grid[0])
    ref, ref_lse = reference_coded_attention(
        data["q"].double(), dataclasses.replace(_view(data, torch.float64), history_key=None, history_value=None),
        scaling=data["scaling"],
    )  # fmt: skip
    low = reference_coded_attention(
        data["q"].to(dtype), dataclasses.replace(_view(data, dtype), history_key=None, history_value=None),
        scaling=data["scaling"],
    )[0]  # fmt: skip
    err_ref = (low.double() - ref).abs().max().item() if dtype != torch.float32 else 0.0
    for tuning, want in (
        (None, ([(1, True)], [])),
        ({"final_block": 16}, ([(1, True)], [])),
        ({"final_slots": 0}, ([(-(-case.Wn // 64), False)], [case.B * case.Hq * case.Q])),
    ):
        fwd.clear()
        merge.clear()
        out, lse = _coded_attention_fwd(query, view, scaling=data["scaling"], v_precision_tau=None, tuning=tuning)
        assert (fwd, merge) == want, (tuning, fwd, merge)
        assert out.dtype == dtype and out.shape == (case.B, case.Hq, case.Q, case.D)
        err = (out.double().cpu() - ref).abs().max().item()
        assert err <= 2 * err_ref + ATOL[dtype], f"{tuning}: kernel err {err:.3e}, reference err {err_ref:.3e}"
        torch.testing.assert_close(lse.double().cpu(), ref_lse, atol=LSE_ATOL[dtype], rtol=0)


def test_one_launch_settings_are_validated():
    data = _build(Case(hist=64, Hq=1, Hkv=1, vprec=False), torch.float32)
    for bad in (-1, 1.5, True, "8"):
        with pytest.raises(ValueError, match=r"tuning\['final_slots'\]` must be a non-negative int \(0: never\)"):
            _run_kernel(data, tuning={"final_slots": bad})
    for bad in (8, 48, 256, True):
        with pytest.raises(ValueError, match=r"tuning\['final_block'\]` must be 16, 32, 64 or 128"):
            _run_kernel(data, tuning={"final_block": bad})


def test_row1_occupancy_settings_are_validated():
    data = _build(Case(hist=64, Hq=1, Hkv=1, vprec=False), torch.float32)
    for bad in ({"sub": 3}, {"sub": 8}, {"sub": 2, "pages": 2}):
        with pytest.raises(ValueError, match=r"tuning\['sub'\]"):
            _run_kernel(data, tuning=bad)
    for bad in (1, 5, "3"):
        with pytest.raises(ValueError, match=r"tuning\['sub_stages'\]"):
            _run_kernel(data, tuning={"sub_stages": bad})
    for bad in (16, 300, 168.0):
        with pytest.raises(ValueError, match=r"tuning\['maxnreg'\]"):
            _run_kernel(data, tuning={"maxnreg": bad})


VERIFY_CASES = [
    # v7: verification blocks over coded history on the word path, one program per (split, query row); `spread`:
    # the per-query history bounds of a block (and of each batch row) differ by up to that many positions, across
    # pages, so a row's query reads fewer pages than its neighbours'
    Case(hist=100, Q=2, Hq=2, Hkv=2, D=64, vprec=False, spread=40, splits=2, B=2, lean=0.3),
    Case(hist=130, Q=5, Hq=2, Hkv=2, D=64, vprec=False, spread=70, splits=3, B=2, pad=True, lean=0.3),  # holes
    Case(hist=90, Q=3, Hq=4, Hkv=2, D=64, fmt=2, spread=50, splits=2, lean=0.3),  # GQA 2: rows g * Q + i
    Case(hist=70, Q=4, Hq=1, Hkv=1, D=128, vprec=False, spread=33, strided=True, lean=0.3),  # a share cell's codes
    Case(hist=100, Q=5, Hq=2, Hkv=2, D=96, vprec=False, spread=40, splits=2, B=2, pad=True, guard=True, lean=0.3),
    Case(hist=64, Q=9, Wn=8, Hq=2, Hkv=2, D=64, fmt=2, splits=2, lean=0.3),  # a block of W + 1 tokens
    Case(hist=80, Q=2, Hq=8, Hkv=2, D=64, vprec=False, spread=45, B=2, pad=True, lean=0.3),  # GQA 4, 8 rows
    # V precision (v4's loop per row): each row's running maximum from the sink and, across splits, from its own
    # page maxima (the first pass runs per (split, row) too); the cold counts equal the reference's
    Case(hist=130, Q=5, Hq=2, Hkv=2, D=64, spread=70, splits=3, B=2, pad=True, lean=0.3),
    Case(hist=100, Q=3, Hq=4, Hkv=2, D=96, spread=40, splits=2, guard=True, lean=0.3),
    Case(hist=100, Q=2, Hq=2, Hkv=2, D=64, spread=40, splits=1, lean=0.3),
]
VERIFY_SETTINGS = {
    # `mma_rows_min` 0: blocks of 3 rows and more take v8 by default
    "v7": {"rows_max": 16, "mma_rows_min": 0},  # short splits: the half-page steps at one warp (v6) where allowed
    "v7-v4": {"rows_max": 16, "sub_auto_pages": 0, "mma_rows_min": 0},  # v4's loop (one page per step, prefetched)
}


@pytest.mark.parametrize("case", [pytest.param(c, id=c.id()) for c in VERIFY_CASES])
@pytest.mark.parametrize(
    "setting, dtype",
    [("v7", torch.float32), ("v7", torch.float16), ("v7-v4", torch.float32)],  # v4's loop: one dtype (CI's time)
    ids=["v7-fp32", "v7-fp16", "v7-v4-fp32"],
)
def test_verification_blocks_take_the_word_path(case, dtype, setting, launches):
    """v7 (`ROW1_TUNING["rows_max"]`): a verification block of `G * Q` rows per KV head (MHA and GQA, INT4 / INT2,
    borrowed codes, padding holes, head dims 64 / 128 / 96, V precision) reads coded history on the one-row word
    path, one program per (split, row), each with its own query's history bound; the partials merge to the
    reference. The launch is checked: `ROWX` on, `NS * rows` history programs ahead of the tail's."""
    _check(case, dtype, tuning=VERIFY_SETTINGS[setting])
    rows = case.Hq // case.Hkv * case.Q
    two = case.vprec and case.fmt == 4 and (case.splits or 1) > 1  # V precision across splits: page maxima first
    assert [x[:2] for x in launches] == [(True, True)] * (2 if two else 1), launches
    # `_codes_history_row1s` reads power-of-two head dims without V precision
    half = setting == "v7" and not case.D & (case.D - 1) and not (case.vprec and case.fmt == 4)
    assert launches[0][2] == (2 if half else 1), launches
    assert launches[0][3] >= rows + 1, launches  # a history program per (split, row), then the tail's


def test_verification_block_rows_read_their_own_bounds(launches):
    """Bounds that fall, rise and differ between the batch rows (query 0 of row 1 reads the most history, its last
    query the least; a query of row 0 reads no history page at all): each (split, row) program reads its own query's
    pages; the kernel matches the reference, and with the word path off (the general path) too."""
    case = Case(hist=128, Q=4, Hq=2, Hkv=2, D=64, vprec=False, spread=128, splits=3, B=2, S=4, lean=0.3)
    data = _build(case, torch.float32)
    lo, hi = data["w_start"], case.S + case.hist
    data["bounds"] = torch.tensor([[hi, lo, lo + 40, hi - 1], [hi, hi - 70, lo + 3, lo + 33]], dtype=torch.int32)
    ref, ref_lse = _reference(data)
    for tune in ({"rows_max": 16}, {"rows_max": 16, "sub_auto_pages": 0}, {"rows_max": 0}):
        tune["mma_rows_min"] = 0  # 4 rows: v8's by default
        out, lse = _run_kernel(data, tuning=tune)
        assert (out.double().cpu() - ref).abs().max() <= ATOL[torch.float32], tune
        torch.testing.assert_close(lse.double().cpu(), ref_lse, atol=LSE_ATOL[torch.float32], rtol=0)
    assert [x[0] for x in launches] == [True, True, False], launches


@pytest.mark.parametrize(
    "case, tune",
    [
        (Case(hist=64, Q=5, Hq=2, Hkv=2, D=64, vprec=False, splits=2), {"rows_max": 4, "mma_rows_min": 0}),  # 5 > 4
        (Case(hist=64, Q=5, Hq=2, Hkv=2, D=64, vprec=False, splits=2), {"rows_max": 0, "mma_rows_min": 0}),  # v7 off
        (Case(hist=64, Q=5, Hq=2, Hkv=2, D=64, vprec=False, splits=2), {"rows_max": 16, "words": False, "mma_rows_min": 0}),
        (Case(hist=64, Q=5, Hq=2, Hkv=2, D=32, fmt=0, splits=2), {"rows_max": 16}),  # dense history
    ],
    ids=["rows-over-max", "off", "bytes", "dense"],
)
def test_verification_blocks_keep_the_general_path(case, tune, launches):
    """Where v7 does not apply (more rows than `rows_max`, `rows_max` 0, the byte path, a dense history) the block
    takes the general path (row blocks of tl.dot), and still matches the reference."""
    _check(case, torch.float32, tuning=tune)
    assert all(x[:2] == (False, False) for x in launches), launches


@pytest.mark.parametrize(
    "case, path",
    [
        (Case(hist=64, Q=2, Hq=2, Hkv=2, D=64, vprec=False, splits=2), "v7"),  # 2 rows per KV head
        (Case(hist=64, Q=3, Hq=2, Hkv=2, D=64, vprec=False, splits=2), "v8"),  # 3 rows
        (Case(hist=64, Q=2, Hq=4, Hkv=2, D=64, vprec=False, splits=2), "v8"),  # GQA 2 x 2 tokens: 4 rows
        (Case(hist=64, Q=5, Hq=2, Hkv=2, D=64, splits=2), "v8"),  # V precision: v8 too (v9, `mma_vprec`)
        (Case(hist=64, Q=2, Hq=2, Hkv=2, D=64, splits=2), "v7"),  # V precision, 2 rows: v7
        (Case(hist=64, Q=1, Hq=2, Hkv=2, D=64, vprec=False, splits=2), "decode"),
    ],
    ids=["2-rows", "3-rows", "4-rows", "vprec", "vprec-2-rows", "decode"],
)
def test_default_paths_by_rows(case, path, launches):
    """The H200 / H100 runs set the defaults (`ROW1_TUNING`): a block of 2 rows per KV head takes v7 (`rows_max` 16;
    2 tokens at 8K x 8 in 187 against the general path's 502 us), of 3 rows or more v8 at one warp (`mma_rows_min`
    3; 5 tokens in 272 against v7's 413, session 15; 3-token blocks of LoopKV's self-speculation at batch 8 cost 1.01
    sequential steps against v7's 1.20, session 38), with V precision too (v9, `mma_vprec`; session 16), decode v4 /
    v6. V precision across splits runs v8's page-maxima pass first (two launches, both v8)."""
    from triton_ops.coded_attention import ops

    assert ops.ROW1_TUNING["rows_max"] == 16 and ops.ROW1_TUNING["mma_rows_min"] == 3
    assert ops.ROW1_TUNING["mma_vprec"] is True
    _check(case, torch.float32)
    rowx, row1, _, _, mma, warps = launches[-1]
    assert (rowx, mma) == {"v7": (True, False), "v8": (False, True), "decode": (False, False)}[path], launches
    assert row1 == (path != "v8"), launches
    if path == "v8":
        assert warps == ops.ROW1_TUNING["mma_warps"], launches  # whatever `num_warps` the one-row path uses
        assert all(x[4] for x in launches), launches  # the page-maxima pass too


def test_rows_max_is_validated():
    data = _build(Case(hist=40, Q=2, Hq=2, Hkv=2, vprec=False), torch.float32)
    for bad in (-1, 17, 2.0, True, "4"):
        with pytest.raises(ValueError, match=r"tuning\['rows_max'\]"):
            _run_kernel(data, tuning={"rows_max": bad})


MMA_CASES = [
    # decode (one row per KV head): MHA, batch rows with left padding and a hole in the history, several splits
    Case(hist=100, Hq=2, Hkv=2, D=64, vprec=False, splits=3, pad=True, B=2, lean=0.3),
    Case(hist=70, Hq=4, Hkv=1, D=64, fmt=2, vprec=False, splits=2, lean=0.3),  # GQA 4, INT2
    # verification blocks: per-query bounds across pages, a share cell's borrowed codes, head dims 128 / 96
    Case(hist=64, Q=5, Hq=2, Hkv=2, D=64, vprec=False, spread=40, splits=2, B=2, pad=True, strided=True, lean=0.3),
    Case(hist=70, Q=2, Hq=4, Hkv=2, D=128, vprec=False, spread=33, lean=0.3),
    Case(hist=100, Q=3, Hq=2, Hkv=2, D=96, vprec=False, spread=40, splits=2, guard=True, lean=0.3),
    Case(hist=64, Q=4, Hq=4, Hkv=1, D=96, fmt=2, vprec=False, spread=45, splits=2, pad=True, lean=0.3),  # 16 rows
]


@pytest.mark.parametrize("case", [pytest.param(c, id=c.id()) for c in MMA_CASES])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_mma_history_matches_reference(case, dtype, launches):
    """v8 (`ROW1_TUNING["mma"]`): 1..16 query rows per KV head over INT4 / INT2 codes (decode, GQA, verification
    blocks with per-query bounds, padding holes, borrowed codes, head dims 64 / 128 / 96) read on the tensor-core
    loop (codes dequantized in registers: fp16 operands for 16-bit inputs, fp32 IEEE dots for fp32) match the
    reference on the same codes; the launch is checked (`MMA` on, the one-row paths off)."""
    _check(case, dtype, tuning={"mma": True})
    assert launches and all(x[4] and not x[0] and not x[1] for x in launches), launches


@pytest.mark.parametrize(
    "case, tune",
    [
        (Case(hist=64, Q=3, Hq=2, Hkv=2, D=64, spread=40, splits=2, lean=0.3), {"mma": True, "mma_vprec": False}),
        (Case(hist=40, Q=9, Hq=4, Hkv=2, D=64, vprec=False, splits=2), {"mma": True}),  # 18 rows > 16
        (Case(hist=64, Q=2, Hq=2, Hkv=2, D=32, fmt=0, splits=2), {"mma": True}),  # dense history
        (Case(hist=64, Q=2, Hq=2, Hkv=2, D=64, vprec=False, splits=2), {"mma": True, "enabled": False}),
    ],
    ids=["vprec-off", "rows-over-16", "dense", "disabled"],
)
def test_mma_history_leaves_other_calls_alone(case, tune, launches):
    """Where v8 does not apply (V precision with `mma_vprec` off: v7, the pre-v9 path; more than 16 rows per KV
    head, a dense history, the coded fast paths disabled) the call takes the path it takes without `mma`, and
    matches the reference."""
    _check(case, torch.float32, tuning=tune)
    assert launches and not any(x[4] for x in launches), launches


def test_mma_rows_read_their_own_bounds(launches):
    """Bounds that fall, rise and differ between batch rows (a query of row 0 reads no history page at all): the
    tensor-core loop masks each row of its block by its own query's bound."""
    case = Case(hist=128, Q=4, Hq=2, Hkv=2, D=64, vprec=False, spread=128, splits=3, B=2, S=4, lean=0.3)
    data = _build(case, torch.float32)
    lo, hi = data["w_start"], case.S + case.hist
    data["bounds"] = torch.tensor([[hi, lo, lo + 40, hi - 1], [hi, hi - 70, lo + 3, lo + 33]], dtype=torch.int32)
    ref, ref_lse = _reference(data)
    out, lse = _run_kernel(data, tuning={"mma": True})
    assert (out.double().cpu() - ref).abs().max() <= ATOL[torch.float32]
    torch.testing.assert_close(lse.double().cpu(), ref_lse, atol=LSE_ATOL[torch.float32], rtol=0)
    assert [x[4] for x in launches] == [True], launches


MMA_VPREC_CASES = [
    # v9: V precision on v8. A 5-token block over INT4 codes, padding holes, per-query bounds across pages, two
    # splits (v8's page-maxima pass first); hot and cold tokens mix inside pages (fp32's tau 4: ~70% cold)
    Case(hist=100, Q=5, Hq=2, Hkv=2, D=64, spread=40, splits=2, B=2, pad=True, lean=0.3),
    # GQA 2 x 3 tokens at a padded head dim (96, guard columns), one split (the sink alone seeds the maximum)
    Case(hist=80, Q=3, Hq=4, Hkv=2, D=96, spread=40, splits=1, guard=True, lean=0.3),
]


@pytest.mark.parametrize("case", [pytest.param(c, id=c.id()) for c in MMA_VPREC_CASES])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_mma_vprec_matches_reference(case, dtype, launches):
    """v9 (`ROW1_TUNING["mma_vprec"]`): V precision on the tensor-core loop: `P @ Vcold` from the `hi` plane for every
    token plus `P_hot @ (lo - 1.5) * scale` where a row reads the token hot, the cold set from the running maximum
    seeded by the sink and the page maxima (the earlier splits' from v8's own first pass) equals the reference's
    output, lse and cold counts on the same codes; every launch runs v8."""
    _check(case, dtype, tuning={"mma": True})
    two = (case.splits or 1) > 1
    assert [(x[4], x[0], x[1]) for x in launches] == [(True, False, False)] * (2 if two else 1), launches


@pytest.mark.parametrize("case", [pytest.param(c, id=c.id()) for c in MMA_VPREC_CASES])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_mma_lo_ahead_matches_reference(monkeypatch, case, dtype):
    """`mma_lo_ahead` (default off): v9's V-precision value pass loads every token's `lo` words with the `hi` ones
    instead of after the hot set; the hot dots still weigh only hot tokens, so output, lse and cold counts are the
    reference's (the optimistic pass's two launches and one split alike); INT4 without V precision and the page-maxima
    pass ignore it."""
    from triton_ops.coded_attention.ops import ROW1_TUNING

    assert ROW1_TUNING["mma_lo_ahead"] is False
    seen = record_launches(
        monkeypatch, "_coded_attention_fwd_kernel", lambda grid, kw: (kw.get("OPT", 0), kw.get("LO_AHEAD", False))
    )
    _check(case, dtype, tuning={"mma": True, "mma_lo_ahead": True})
    two = (case.splits or 1) > 1
    assert seen == ([(1, True), (2, True)] if two else [(0, True)]), seen
    seen.clear()
    _check(dataclasses.replace(case, vprec=False), dtype, tuning={"mma": True, "mma_lo_ahead": True})
    assert seen and not any(x[1] for x in seen), seen
    seen.clear()
    _check(case, dtype, tuning={"mma": True, "mma_lo_ahead": True, "vprec_optimistic": False})
    assert seen == ([(0, False), (0, True)] if two else [(0, True)]), seen  # the page-maxima pass, then the values
    with pytest.raises(ValueError, match=r"tuning\['mma_lo_ahead'\]"):
        _run_kernel(_build(case, torch.float32), tuning={"mma": True, "mma_lo_ahead": "yes"})


def test_mma_vprec_all_cold_reads_hi_only(launches):
    """A sink holding a key along every query (q itself: its score towers over every history score, tau 0.5): every
    history token is cold for every row, no page loads `lo` (the kernel skips the hot dots) and the output is the
    reference's `hi`-plane-only read; with tau 0 and a flat sink the page maxima themselves are hot. The counts
    match the reference."""
    for tower, tau, all_cold in ((True, 0.5, True), (False, 0.0, False)):
        case = Case(hist=100, Q=5, Hq=2, Hkv=2, D=64, S=5, spread=40, splits=2, lean=0.0)
        data = _build(case, torch.float32)
        if tower:
            data["parts"]["sk"] = data["q"][:, :, :5].clone()
        data["tau"] = tau
        stats_k = torch.zeros(2, dtype=torch.int64, device=DEVICE)
        out, lse = _run_kernel(data, stats=stats_k, tuning={"mma": True})
        stats_r = torch.zeros(2, dtype=torch.int64)
        ref, ref_lse = _reference(data, stats=stats_r)
        assert (out.double().cpu() - ref).abs().max() <= ATOL[torch.float32], (tower, tau)
        # the sink's score makes lse ~20: fp32 rounding of it is ~2e-6 (the H200 gave 1.06e-5 at lse ~45)
        torch.testing.assert_close(lse.double().cpu(), ref_lse, atol=LSE_ATOL[torch.float32], rtol=1e-6)
        assert stats_k.tolist() == stats_r.tolist(), (stats_k, stats_r)
        assert (stats_r[0] == stats_r[1]).item() == all_cold and stats_r[1] > 0, stats_r
    assert all(x[4] for x in launches), launches


def test_mma_pipelined_settings_match_reference(launches):
    """v9 settings `mma_stages` (the page loop as `tl.range(num_stages=...)`), `mma_warps` (warps of the default v8
    launch) and `mma_programs_per_sm`: the same results (the interpreter runs the same code; the launch options and
    the split count are checked)."""
    case = Case(hist=100, Q=5, Hq=2, Hkv=2, D=64, spread=40, splits=2, B=2, pad=True, lean=0.3)
    _check(case, torch.float16, tuning={"mma_stages": 3, "mma_warps": 2})
    assert launches and all(x[4] and x[5] == 2 for x in launches), launches
    # `mma_programs_per_sm`: the split count v8 aims at (the interpreter counts 4 SMs): 1 per SM over 2 KV heads
    # gives 2 splits of the 10 pages, then the tail program (`mma_one_wave` off: on, it would fit them in one wave)
    launches.clear()
    _check(Case(hist=300, Q=5, Hq=2, Hkv=2, D=64, vprec=False, lean=0.3), torch.float32,
           tuning={"mma_programs_per_sm": 1, "mma_one_wave": False})  # fmt: skip
    assert [(x[4], x[3]) for x in launches] == [(True, 3)], launches


@pytest.mark.parametrize("vprec", [False, True], ids=["int4", "int4-vprec"])
def test_mma_split_count_fits_one_wave(monkeypatch, vprec):
    """`mma_one_wave` (default on): v9's split count leaves the history and tail programs one wave of
    `mma_programs_per_sm` per SM (the interpreter counts 4 SMs). 2 per SM over 2 KV heads is 4 programs per row
    block: the plain rule's 4 splits of 2 pages bring 4 tail programs of 32 window slots (8 in all); 2 splits of 4
    pages bring 2 tail programs of 64 slots (4), the most splits that fit. Same output, lse and cold counts either
    way; a split count asked for (`num_splits`) stands."""
    from triton_ops.coded_attention.ops import ROW1_TUNING

    assert ROW1_TUNING["mma_one_wave"] is True
    seen = record_launches(
        monkeypatch, "_coded_attention_fwd_kernel", lambda grid, kw: (kw["MMA"], grid[0], kw["NS"], kw.get("OPT", 0))
    )
    case = Case(hist=256, Q=5, Hq=2, Hkv=2, D=64, Wn=100, vprec=vprec, lean=0.3)
    tune = {"mma_programs_per_sm": 2, "tail_min": 32}
    _check(case, torch.float32, tuning={**tune, "mma_one_wave": False})
    plain = [x[:3] for x in seen if x[3] != 2]  # (the optimistic pass's second launch starts history programs only)
    seen.clear()
    _check(case, torch.float32, tuning=tune)
    fit = [x[:3] for x in seen if x[3] != 2]
    assert plain == [(True, 8, 4)] and fit == [(True, 4, 2)], (plain, fit)
    seen.clear()
    _check(dataclasses.replace(case, splits=4), torch.float32, tuning=tune)
    assert [x[:3] for x in seen if x[3] != 2] == [(True, 8, 4)], seen
    with pytest.raises(ValueError, match=r"tuning\['mma_one_wave'\]"):
        _run_kernel(_build(case, torch.float32), tuning={"mma_one_wave": 2})


@pytest.mark.parametrize("vprec", [False, True], ids=["int4", "int4-vprec"])
def test_row1_one_wave_is_opt_in(monkeypatch, vprec):
    """`row1_one_wave` (default off) fits the one-row loops' history and tail programs in one wave of
    `programs_per_sm` the same way (decode of 2 KV heads over 8 pages, 2 per SM on the interpreter's 4 SMs: 4 splits
    + 4 tail programs by default, 2 + 2 with it); results as the reference's either way."""
    from triton_ops.coded_attention.ops import ROW1_TUNING

    assert ROW1_TUNING["row1_one_wave"] is False
    seen = record_launches(monkeypatch, "_coded_attention_fwd_kernel", lambda grid, kw: (kw["ROW1"], grid[0], kw["NS"]))
    case = Case(hist=256, Q=1, Hq=2, Hkv=2, D=64, Wn=100, vprec=vprec, lean=0.3)
    tune = {"programs_per_sm": 2, "tail_min": 32}
    got = []
    for flag in (False, True):
        seen.clear()
        _check(case, torch.float32, tuning={**tune, "row1_one_wave": flag})
        got.append(seen[-1])  # the value pass (V precision's first pass, if any, comes before it)
    assert got == [(True, 8, 4), (True, 4, 2)], got
    with pytest.raises(ValueError, match=r"tuning\['row1_one_wave'\]"):
        _run_kernel(_build(case, torch.float32), tuning={"row1_one_wave": "yes"})


class _Planned(Exception):
    pass


def _plans_at_ouro_shapes(monkeypatch, ctx, batch, capacity, vprec, queries, tunings):
    """The launcher's (splits, first launch's programs per row block) for each of `tunings`, at Ouro's 16 x 128 heads
    with the tune tool's layout and 132 SMs. Planned only (the launch is intercepted), so any device runs it."""
    from benchmarks import tune_coded_attention as tune_tool
    from triton_ops.coded_attention import ops

    heads, d = tune_tool.HEADS, tune_tool.D
    t = max(ctx, capacity or 0)
    base = dict(
        q=(1, heads, queries, d), sk=(1, heads, tune_tool.SINK, d), sv=(1, heads, tune_tool.SINK, d),
        wk=(1, heads, tune_tool.WINDOW + PAGE + 16, d), wv=(1, heads, tune_tool.WINDOW + PAGE + 16, d),
        nk=(1, heads, 16, d), nv=(1, heads, 16, d), ks=(1, heads, t // PAGE, d), kz=(1, heads, t // PAGE, d),
        kc4=(1, heads, t, d // 2), vh=(1, heads, t, d // 4), vl=(1, heads, t, d // 4),
        vs=(1, heads, t, d // 32), vz=(1, heads, t, d // 32),
    )  # fmt: skip
    data = {
        k: torch.zeros(shape, dtype=torch.uint8 if k in ("kc4", "vh", "vl") else torch.float16).expand(batch, *shape[1:])
        for k, shape in base.items()
    }
    monkeypatch.setattr(ops, "_num_sms", lambda device: 132)
    got = []

    def plan_only(grid, kw):  # recorded, then the launch is stopped before the kernel runs
        got.append((kw["NS"], grid[0]))
        raise _Planned

    record_launches(monkeypatch, "_coded_attention_fwd_kernel", plan_only)
    view, _ = tune_tool._view(data, batch, ctx, 4, queries=queries, capacity=capacity)
    for tuning in tunings:
        with pytest.raises(_Planned):
            ops._coded_attention_fwd(
                data["q"], view, scaling=d**-0.5, v_precision_tau=0.5 if vprec else None, tuning=tuning
            )  # fmt: skip
    return got


@pytest.mark.parametrize(
    "ctx, batch, capacity, vprec, plain, fit",
    [
        (1280, 8, 1536, False, (8, 13), (5, 8)),  # the host-sized tail: 3 programs of 128 slots, not 5 of 64
        (1280, 8, 1536, True, (8, 12), (5, 8)),
        (8192, 1, None, False, (62, 67), (50, 53)),
        (8192, 8, None, True, (9, 10), (7, 8)),
        (8192, 64, None, False, (2, 3), (2, 3)),  # 1,024 row blocks: nothing fits, the plain count stands
    ],
)  # fmt: skip
def test_mma_one_wave_split_counts_at_the_swept_shapes(monkeypatch, ctx, batch, capacity, vprec, plain, fit):
    """The launcher's (splits, programs per row block) at the shapes of session 33's sweep (Ouro's 16 x 128 heads,
    5-token blocks, 132 SMs): with `mma_one_wave` the counts that ran fastest there at batch 8 (`mma_programs_per_sm`
    4 at 1,280 x 8, 6 at 8K; at 8K x 1, 6's count, level with the plain one for INT4), the plain rule's without it."""
    tunings = [{"mma_one_wave": False}, {"mma_one_wave": True}]
    got = _plans_at_ouro_shapes(monkeypatch, ctx, batch, capacity, vprec, 5, tunings)
    assert got == [plain, fit], got


@pytest.mark.parametrize(
    "ctx, batch, capacity, plain, waves",
    [
        (1280, 8, 1536, 8, 4),  # 4 splits + 2 tail programs x 128 row blocks: one wave of 6 x 132
        (8192, 1, None, 62, 42),
        (8192, 8, None, 9, 5),
        (8192, 16, None, 5, 5),  # 2 waves of 50 pages cost less than one of 124 (the one-wave count, 9% slower)
        (8192, 64, None, 1, 1),  # the row blocks alone fill the device: one split
    ],
)  # fmt: skip
def test_vprec_waves_split_counts_at_the_swept_shapes(monkeypatch, ctx, batch, capacity, plain, waves):
    """`vprec_waves` 6, the default (V precision's one-token decode, v5's score and value passes; 132 SMs): the split
    counts that ran fastest in session 34's H100 sweep at each shape (`programs_per_sm` 6 with `row1_one_wave` at all
    but 8K x 16, where the plain count was), the plain rule's with 0."""
    tunings = [{"vprec_waves": 0}, {}]
    got = _plans_at_ouro_shapes(monkeypatch, ctx, batch, capacity, True, 1, tunings)
    assert [ns for ns, _ in got] == [plain, waves], got


def test_vprec_waves_ties_take_more_splits():
    """Equal costs go to the larger split count: 4 pages over 4 row blocks and 3 slots, one window slot; 2 splits of 2
    pages (3 programs per row block, 4 waves, cost 4 * (2 + 4)) tie with 1 split of 4 (2 programs, 3 waves, 3 * 8)."""
    from triton_ops.coded_attention.ops import SPLIT_COST_PAGES, _vprec_waves_split

    assert SPLIT_COST_PAGES == 4
    assert _vprec_waves_split(4, 2, 1, 4, 3, 1, 32, 64, None) == (2, 2)
    assert _vprec_waves_split(4, 2, 1, 4, 2, 1, 32, 64, None) == (1, 4)  # 6 waves * 6 against 4 * 8: one split


def test_vprec_waves_rule(monkeypatch):
    """`vprec_waves` (default 6; 0: off): V precision's one-row decode takes its split count from the cost model
    `ceil(waves) * (pages per split + SPLIT_COST_PAGES)` at that many value-pass programs per SM (the interpreter
    counts 4 SMs); the result, lse and cold counts are the reference's either way, and it leaves INT4 and a split
    count asked for alone."""
    from triton_ops.coded_attention.ops import ROW1_TUNING

    assert ROW1_TUNING["vprec_waves"] == 6
    seen = record_launches(
        monkeypatch, "_coded_attention_fwd_kernel", lambda grid, kw: (kw["SCORES"], grid[0], kw["NS"])
    )
    case = Case(hist=256, Q=1, Hq=2, Hkv=2, D=64, Wn=100, lean=0.3)
    tune = {"programs_per_sm": 2, "tail_min": 32}
    got = []
    for per_sm in (0, 2, 1):
        seen.clear()
        _check(case, torch.float32, tuning={**tune, "vprec_waves": per_sm})
        got.append(seen[-1])  # the value pass (the score pass comes before it)
    # 4 splits of 2 pages + 4 tail programs over 2 row blocks: 2 waves of 2 x 4 slots, cost 2 * (2 + 4); 2 splits of 4
    # + 2 tail programs: one wave, cost 4 + 4. At 1 per SM one split of 8 pages (cost 8 + 4; then v4's loop, no
    # score pass) beats 2 (two waves, 2 * 8)
    assert got == [(True, 8, 4), (True, 4, 2), (False, 2, 1)], got
    for c in (dataclasses.replace(case, vprec=False), dataclasses.replace(case, splits=4)):
        plans = []
        for per_sm in (0, 2):
            seen.clear()
            _check(c, torch.float32, tuning={**tune, "vprec_waves": per_sm})
            plans.append(seen[-1])
        assert plans[0] == plans[1], (c, plans)
    for bad in (True, -1, "6"):
        with pytest.raises(ValueError, match=r"tuning\['vprec_waves'\]"):
            _run_kernel(_build(case, torch.float32), tuning={"vprec_waves": bad})


LOOKBACK_CASES = [
    # v9 (5-token blocks over INT4, per-query bounds across pages, padding holes): 2 and 3 splits, and the
    # launcher's own count; GQA 2 x 3 tokens at a padded head dim (guard columns)
    (Case(hist=100, Q=5, Hq=2, Hkv=2, D=64, spread=40, splits=2, B=2, pad=True, lean=0.3), {"mma": True}),
    (Case(hist=200, Q=5, Hq=2, Hkv=2, D=64, spread=40, splits=3, lean=0.3), {"mma": True}),
    (Case(hist=300, Q=5, Hq=2, Hkv=2, D=64, spread=40, lean=0.3), {"mma": True}),
    (Case(hist=80, Q=3, Hq=4, Hkv=2, D=96, spread=40, splits=3, guard=True, lean=0.3), {"mma": True}),
    # the one-row word loops (decode without GQA): v5's score pass (the default), v5's pipelined loop and v4's, 3
    # splits with padding, and the launcher's own count
    (Case(hist=100, Hq=2, Hkv=2, splits=3, pad=True, B=2, lean=0.3), {}),
    (Case(hist=100, Hq=2, Hkv=2, splits=3, pad=True, B=2, lean=0.3), {"vprec": "pipe"}),
    (Case(hist=100, Hq=2, Hkv=2, splits=3, pad=True, B=2, lean=0.3), {"vprec": "v4"}),
    (Case(hist=250, Hq=2, Hkv=2, Q=1, lean=0.5), {}),
]


@pytest.mark.parametrize(
    "case, tune", [pytest.param(c, t, id=c.id() + "-" + ("mma" if "mma" in t else t.get("vprec", "scores"))) for c, t in LOOKBACK_CASES]
)  # fmt: skip
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_vprec_lookback_matches_reference(monkeypatch, case, tune, dtype):
    """`ROW1_TUNING["vprec_lookback"]`: V precision over a split history in one launch (every split but the last
    writes its page maxima and publishes a flag, every split awaits the earlier ones' flags before its value pass)
    gives the reference's output, lse and cold counts on the same codes, on v9 and on the one-row word loops (v5's
    score pass: the value pass reads the scores its own program stored, the last split's included); there is one
    history launch and no first pass."""
    seen = record_launches(
        monkeypatch, "_coded_attention_fwd_kernel",
        lambda grid, kw: (kw.get("LOOKBACK", False), kw["PAGE_MAX_ONLY"], kw["MMA"], kw["ROW1"], kw["VPIPE"],
                          kw["SCORES"]),
    )  # fmt: skip
    _check(case, dtype, tuning={**tune, "vprec_lookback": True})
    mma, mode = "mma" in tune, tune.get("vprec", "scores")
    want = (True, False, mma, not mma, not mma and mode != "v4", not mma and mode == "scores")
    assert len(seen) == 1 and seen[0] == want, seen


def test_vprec_lookback_is_validated_and_applies_only_where_it_can(monkeypatch):
    """A bad `vprec_lookback` names the setting; where it cannot apply (one split, V precision off, v7's per-row
    programs) the call launches as it does without it, and still matches the reference."""
    data = _build(Case(hist=40, Hq=1, Hkv=1), torch.float32)
    with pytest.raises(ValueError, match=r"tuning\['vprec_lookback'\]"):
        _run_kernel(data, tuning={"vprec_lookback": "yes"})
    seen = record_launches(
        monkeypatch, "_coded_attention_fwd_kernel", lambda grid, kw: (kw.get("LOOKBACK", False), kw["PAGE_MAX_ONLY"])
    )
    for case, tune, want in [
        (Case(hist=100, Hq=2, Hkv=2, splits=1, lean=0.3), {}, [(False, False)]),
        (Case(hist=100, Hq=2, Hkv=2, splits=3, vprec=False, lean=0.3), {}, [(False, False)]),
        (Case(hist=100, Q=3, Hq=2, Hkv=2, D=64, spread=40, splits=2, lean=0.3), {"mma_vprec": False},
         [(False, True), (False, False)]),
    ]:  # fmt: skip
        seen.clear()
        _check(case, torch.float32, tuning={**tune, "vprec_lookback": True})
        assert seen == want, (case.id(), seen)


OPTIMISTIC_CASES = [(c, t) for c, t in LOOKBACK_CASES if "mma" in t] + [
    # v4's one-row loop (`vprec` "v4"): 3 splits with padding, and the launcher's own count
    (Case(hist=100, Hq=2, Hkv=2, splits=3, pad=True, B=2, lean=0.3), {"vprec": "v4"}),
    (Case(hist=250, Hq=2, Hkv=2, Q=1, lean=0.5), {"vprec": "v4"}),
]


@pytest.mark.parametrize(
    "case, tune", [pytest.param(c, t, id=c.id() + "-" + ("mma" if "mma" in t else "v4")) for c, t in OPTIMISTIC_CASES]
)  # fmt: skip
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_vprec_optimistic_matches_reference(monkeypatch, case, tune, dtype):
    """`ROW1_TUNING["vprec_optimistic"]`: V precision over a split history without a page-maxima pass first: every
    split's value pass runs seeded with the sink's maximum alone and stores its page maxima and lowest hot score,
    then a second launch reruns the splits whose hot set the earlier splits' maxima change. Output, lse and cold
    counts are the reference's (these cases' weak sinks make later splits rerun), on v9 and on v4's one-row loop;
    no page-maxima pass, and the second launch starts history programs only."""
    seen = record_launches(
        monkeypatch, "_coded_attention_fwd_kernel",
        lambda grid, kw: (kw.get("OPT", 0), kw["PAGE_MAX_ONLY"], kw["READ_PREFIX"], kw["MMA"], kw["VPIPE"], grid[0],
                          kw["NS"]),
    )  # fmt: skip
    _check(case, dtype, tuning={**tune, "vprec_optimistic": True})
    mma = "mma" in tune
    assert [x[:5] for x in seen] == [(1, False, False, mma, False), (2, False, True, mma, False)], seen
    assert seen[0][5] == seen[0][6] + 1 and seen[1][5] == seen[1][6] > 1, seen  # the tail program in the first only


def _own_count_slots(kw: dict) -> dict:
    """The second optimistic launch's kwargs with V-precision count slots of its own, filled with -1: the slots of
    the splits it reruns (and only those) get written."""
    return {**kw, "stats_ptr": torch.full_like(kw["stats_ptr"], -1)} if kw.get("OPT") == 2 else kw


def _optimistic_reruns(data, tune, slots):
    """Output of the optimistic launches and a bool per split: did the second launch rerun it (`slots`: the list
    `record_launches` fills with the second launch's own count slots, `_own_count_slots`)."""
    slots.clear()
    out, _ = _run_kernel(data, stats=torch.zeros(2, dtype=torch.int64, device=DEVICE), tuning=tune)
    second = [s for s in slots if s is not None]
    assert len(slots) == 2 and len(second) == 1, slots
    return out, (second[0].reshape(data["case"].splits, -1) >= 0).any(1).tolist()


@pytest.mark.parametrize("tune", [{"vprec": "v4"}, {"mma": True}], ids=["v4", "mma"])
def test_vprec_optimistic_reruns_only_where_the_hot_set_changes(monkeypatch, tune):
    """The second launch's check is exact both ways. A sink whose score leads every history token's (the common
    case in trained models): hot tokens exist, yet no split reruns, and the output is the reference's. The largest
    history score in page 0 and no sink: every later split, whose own maxima left tokens hot that page 0 makes
    cold, reruns; the first never can."""
    tune = {**tune, "vprec_optimistic": True}
    slots = record_launches(
        monkeypatch, "_coded_attention_fwd_kernel",
        lambda grid, kw: kw["stats_ptr"] if kw.get("OPT") == 2 else None, alter=_own_count_slots,
    )  # fmt: skip
    q_len = 5 if "mma" in tune else 1
    data = _build(Case(hist=128, S=4, Q=q_len, Hq=2, Hkv=2, D=64, splits=4, lean=0.5), torch.float32)
    data["tau"] = 16.0  # margin enough for some hot tokens; the sink's score still leads the history's
    stats = torch.zeros(2, dtype=torch.int64)
    ref, _ = _reference(data, stats=stats)
    assert 0 < stats[0].item() < stats[1].item(), stats
    out, reran = _optimistic_reruns(data, tune, slots)
    assert (out.double().cpu() - ref).abs().max() <= ATOL[torch.float32]
    assert reran == [False] * 4, reran
    # history-led: page 0 holds the maximum, so the later splits' hot sets shrink
    data = _build(Case(hist=128, S=0, Q=q_len, Hq=2, Hkv=2, D=64, splits=4), torch.float32)
    qk, qv = data["history"]
    k = naive.dequantize_keys(qk)
    k[:, :, 3] = data["q"][:, :, 0] * 6  # a key aligned with each head's first query (H_q = H_kv)
    data["history"] = (naive.quantize_keys(k, 4, group_size=PAGE), qv)
    out, reran = _optimistic_reruns(data, tune, slots)
    assert reran == [False, True, True, True], reran
    assert (out.double().cpu() - _reference(data)[0]).abs().max() <= ATOL[torch.float32]


def test_vprec_optimistic_is_validated_and_applies_only_where_it_can(monkeypatch):
    """`vprec_optimistic` is on by default; a bad value names the setting. Where it does not apply the call launches
    as it does without it: one split, V precision off, v7's per-row programs, v5's `scores` / `pipe` loops (the
    one-row default), and `vprec_lookback`, which goes first."""
    from triton_ops.coded_attention.ops import ROW1_TUNING

    assert ROW1_TUNING["vprec_optimistic"] is True
    data = _build(Case(hist=40, Hq=1, Hkv=1), torch.float32)
    with pytest.raises(ValueError, match=r"tuning\['vprec_optimistic'\]"):
        _run_kernel(data, tuning={"vprec_optimistic": "yes"})
    seen = record_launches(
        monkeypatch, "_coded_attention_fwd_kernel",
        lambda grid, kw: (kw.get("OPT", 0), kw["PAGE_MAX_ONLY"], kw.get("LOOKBACK", False)),
    )  # fmt: skip
    mma5 = Case(hist=100, Q=5, Hq=2, Hkv=2, D=64, spread=40, splits=2, lean=0.3)
    for case, tune, want in [
        (Case(hist=100, Hq=2, Hkv=2, splits=1, lean=0.3), {"vprec": "v4"}, [(0, False, False)]),
        (Case(hist=100, Hq=2, Hkv=2, splits=3, vprec=False, lean=0.3), {"vprec": "v4"}, [(0, False, False)]),
        (Case(hist=100, Q=3, Hq=2, Hkv=2, D=64, spread=40, splits=2, lean=0.3), {"mma_vprec": False},
         [(0, True, False), (0, False, False)]),
        (Case(hist=100, Hq=2, Hkv=2, splits=3, lean=0.3), {}, [(0, True, False), (0, False, False)]),
        (Case(hist=100, Hq=2, Hkv=2, splits=3, lean=0.3), {"vprec": "pipe"}, [(0, True, False), (0, False, False)]),
        (mma5, {"vprec_lookback": True}, [(0, False, True)]),
        (mma5, {}, [(1, False, False), (2, False, False)]),
        (mma5, {"vprec_optimistic": False}, [(0, True, False), (0, False, False)]),
    ]:  # fmt: skip
        seen.clear()
        _check(case, torch.float32, tuning=tune)
        assert seen == want, (case.id(), tune, seen)


def test_mma_is_validated():
    from triton_ops.coded_attention.ops import ROW1_TUNING

    assert ROW1_TUNING["mma"] is False
    data = _build(Case(hist=40, Q=2, Hq=2, Hkv=2, vprec=False), torch.float32)
    for bad in (2, -1, 1.0, "1", None):
        with pytest.raises(ValueError, match=r"tuning\['mma'\]"):
            _run_kernel(data, tuning={"mma": bad})
    for bad in (17, -1, 1.0, True, None):
        with pytest.raises(ValueError, match=r"tuning\['mma_rows_min'\]"):
            _run_kernel(data, tuning={"mma_rows_min": bad})
    for bad in (2, 1.0, "1", None):
        with pytest.raises(ValueError, match=r"tuning\['mma_vprec'\]"):
            _run_kernel(data, tuning={"mma_vprec": bad})
    for bad in (0, 5, 2.0, True):
        with pytest.raises(ValueError, match=r"tuning\['mma_stages'\]"):
            _run_kernel(data, tuning={"mma_stages": bad})
    for bad in (0, 3, 2.0, True):
        with pytest.raises(ValueError, match=r"tuning\['mma_warps'\]"):
            _run_kernel(data, tuning={"mma_warps": bad})
    for bad in (0, 33, 7.0, True):
        with pytest.raises(ValueError, match=r"tuning\['mma_programs_per_sm'\]"):
            _run_kernel(data, tuning={"mma_programs_per_sm": bad})


DENSE_CASES = [c for c in CPU_CASES if not c.fmt]


@pytest.mark.parametrize(
    "case",
    [
        pytest.param(c, id=c.id())
        for c in (
            Case(hist=70, Hq=2, Hkv=1, D=48, fmt=0, Q=3, pad=True, B=2, splits=2),
            Case(hist=100, Hq=2, Hkv=2, D=96, fmt=0, S=0),
        )
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_dense_head_dims_that_are_no_power_of_two(case, dtype):
    """A dense history with a head dim that is no power of two (Huginn-0125's 96) is read in zero-padded tiles of the
    next power of two: the padded columns add nothing to the scores and are not written to the output."""
    _check(case, dtype)


CODED_NPOW2_CASES = [
    # one query row per KV head (the word path; Huginn-0125's 96 = 3 value groups of 32, read as 4)
    Case(hist=1, D=96, Hq=2, Hkv=2, lean=0.3, guard=True),
    Case(hist=31, D=96, Hq=2, Hkv=2, fmt=2, lean=0.3, guard=True),
    Case(hist=33, D=96, Hq=2, Hkv=2, vprec=False, splits=2, lean=0.3, guard=True),
    Case(hist=100, D=96, Hq=2, Hkv=2, splits=3, pad=True, B=2, lean=0.3, guard=True),  # V precision across splits
    Case(hist=200, D=96, Hq=2, Hkv=2, splits=1, lean=0.3, guard=True),  # 7 pages in one split: v5's pipeline fills
    # borrowed codes (a share cell reads its source's buffer)
    Case(hist=100, D=96, Hq=2, Hkv=2, fmt=4, vprec=False, strided=True, splits=2, lean=0.0, guard=True),
    # several query rows per KV head (GQA, verification blocks with per-query bounds): the per-lane dot path
    Case(hist=64, D=96, Q=5, Hq=4, Hkv=2, pad=True, B=2, splits=2, guard=True),
    Case(hist=33, D=96, Q=3, Hq=2, Hkv=1, fmt=2, strided=True, guard=True),
    Case(hist=100, D=96, Q=1, Hq=4, Hkv=1, vprec=False, splits=3, guard=True),
    # other head dims that are no power of two: 80 (5 groups of 16, read as 8), 48 (3 groups of 16, read as 4)
    Case(hist=100, D=80, Hq=2, Hkv=2, vgroup=16, splits=2, pad=True, B=2, lean=0.3, guard=True),
    Case(hist=31, D=80, Q=4, Hq=2, Hkv=1, fmt=2, vgroup=16, guard=True),
    Case(hist=70, D=48, Hq=2, Hkv=2, fmt=2, vgroup=16, lean=0.3, guard=True),
    Case(hist=70, D=48, Q=3, Hq=4, Hkv=2, vgroup=16, pad=True, B=2, splits=2, guard=True),
]


@pytest.mark.parametrize("case", [pytest.param(c, id=c.id()) for c in CODED_NPOW2_CASES])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_coded_head_dims_that_are_no_power_of_two(case, dtype):
    """Coded history (INT4 / INT2, own or borrowed codes, V precision on and off) with a head dim that is no power of
    two (Huginn-0125's 96): key words, scale / zero tiles and value groups past the head dim load 0 in tiles of the
    next power of two, on the one-row word path, the multi-row path, across splits and with padding."""
    _check(case, dtype)


DENSE_SETTINGS = {"tile16": {"tile": 16, "programs_per_sm": 2}, "tile64": {"tile": 64, "num_warps": 8, "num_stages": 2}}


@pytest.mark.parametrize("case", [pytest.param(c, id=c.id()) for c in DENSE_CASES])
@pytest.mark.parametrize("setting", list(DENSE_SETTINGS))
def test_dense_settings_match_reference(case, setting):
    """The dense (fp16 / bf16 history) path with other `DENSE_TUNING` tiles: a tile is not a page, so the history's
    split boundaries, tails and bounds must land anywhere inside one."""
    _check(case, torch.float32, tuning={"dense": DENSE_SETTINGS[setting]})


TAIL_CASES = [
    Case(hist=64, Wn=70, S=4, Q=1, Hq=2, Hkv=2, lean=0.3),  # one row per KV head (INT4 + V precision)
    Case(hist=64, Wn=45, S=4, Q=5, Hq=4, Hkv=2, pad=True, B=2, splits=2),  # a verification block, moving bounds
    Case(hist=40, Wn=40, S=0, fmt=2, Hq=2, Hkv=1, splits=1),
    Case(hist=70, Wn=66, fmt=0, Q=3, splits=2, pad=True, B=2),  # dense history (RIPE's borrowed plane)
]


@pytest.mark.parametrize("case", [pytest.param(c, id=c.id()) for c in TAIL_CASES])
@pytest.mark.parametrize("chunk", [5, 32], ids=["chunk5", "chunk32"])
def test_split_tail_matches_reference(case, chunk):
    """The window spread over several tail programs (`tuning["tail_chunk"]` slots each; the sink and the new tokens in
    the first): chunks that end inside a loop step (5) and on one (32), a window cut across a query's history bound,
    padding; the partials merge to the reference."""
    from triton_ops.coded_attention import ops

    nt = -(-(case.Wn + (case.Q - 1 if case.moving else 0)) // chunk)
    assert nt >= 2  # the case really splits its window
    _check(case, torch.float32, tuning={"tail_chunk": chunk})
    with pytest.raises(ValueError, match=r"tuning\['tail_chunk'\]"):
        _run_kernel(_build(case, torch.float32), tuning={"tail_chunk": -1})
    assert ops.TAIL_BLOCK == 32


VPREC_SETTINGS = {
    "v5-pipe": {"vprec": "pipe"},
    "v5-pipe-np2": {"vprec": "pipe", "pages": 2},
    "v5-scores": {"vprec": "scores"},
    "v5-scores-np2": {"vprec": "scores", "pages": 2},
    "v5-pipe-unroll": {"vprec": "pipe", "vprec_unroll": True},
    "v5-scores-unroll": {"vprec": "scores", "vprec_unroll": True},
}
"""`ROW1_TUNING["vprec"]` modes of v5 (`ops.VPREC_MODES`): they change only V precision on INT4 history."""


@pytest.mark.parametrize("case", [pytest.param(c, id=c.id()) for c in ROW1_CASES if c.vprec and c.fmt == 4])
@pytest.mark.parametrize(
    "dtype, setting",
    [(torch.float32, k) for k in VPREC_SETTINGS] + [(torch.float16, k) for k in ("v5-pipe", "v5-scores")],
    ids=[f"fp32-{k}" for k in VPREC_SETTINGS] + ["fp16-v5-pipe", "fp16-v5-scores"],
)  # fmt: skip
def test_vprec_modes_match_reference(case, dtype, setting):
    """v5's V precision: the pipelined loop (a step's hot set one step ahead, its `lo` words loaded a step ahead) and
    the score pass (the value pass reads the first pass's scores, not the key codes) give the reference's output,
    lse and cold count (fp32: exactly the reference's cold set, tau = 4 mixes cold and hot tokens; fp16: the
    shifted-field reads, at 1 page per step)."""
    _check(case, dtype, tuning=VPREC_SETTINGS[setting])


NPOW2_ROW1_SETTINGS = {**ROW1_SETTINGS, **{k: VPREC_SETTINGS[k] for k in ("v5-pipe", "v5-scores", "v5-pipe-unroll")}}


@pytest.mark.parametrize(
    "case, setting",
    [
        pytest.param(c, k, id=f"{c.id()}-{k}")
        for c in CODED_NPOW2_CASES
        if c.Q == 1 and c.Hq == c.Hkv
        for k in NPOW2_ROW1_SETTINGS
        if k in ROW1_SETTINGS or (c.fmt == 4 and c.vprec)  # v5's modes change only V precision
    ],
)
def test_coded_head_dims_that_are_no_power_of_two_row1_settings(case, setting):
    """The one-row path's other settings at those head dims: v3's bytes, two pages per step, and v5's V precision
    (the pipelined loop, the score pass, two steps per iteration)."""
    _check(case, torch.float32, tuning=NPOW2_ROW1_SETTINGS[setting])


@pytest.mark.parametrize(
    "dtype, mode", [(torch.float32, "pipe"), (torch.float32, "scores"), (torch.float16, "pipe"), (torch.float16, "scores")]
)  # fmt: skip
def test_vprec_unroll_odd_steps_and_padding(dtype, mode):
    """`vprec_unroll` (two steps per iteration, two alternating buffers of key inputs): an odd number of steps (5
    pages, one split: the last iteration's second step reads nothing) and padding inside the history."""
    _check(Case(hist=160, Hq=2, Hkv=2, B=2, splits=1, pad=True, lean=0.3), dtype, tuning={"vprec": mode, "vprec_unroll": 1})


def test_vprec_mode_is_validated():
    data = _build(Case(hist=40, Hq=1, Hkv=1), torch.float32)
    with pytest.raises(ValueError, match=r"tuning\['vprec'\]"):
        _run_kernel(data, tuning={"vprec": "fast"})


def test_word_path_falls_back_to_bytes_on_unaligned_codes():
    """Codes whose token stride is not a multiple of 4 bytes cannot be read as 32-bit words: the launcher takes the
    byte path (reading them as words would mix rows)."""
    data = _build(Case(hist=100, Hq=2, Hkv=2, vprec=False, lean=0.3), torch.float32)
    qk, qv = data["history"]

    def pad(t):  # the same bytes, rows 2 bytes apart more (a token stride of 18 / 10 bytes)
        big = torch.zeros(*t.shape[:-1], t.shape[-1] + 2, dtype=t.dtype)
        big[..., : t.shape[-1]] = t
        return big[..., : t.shape[-1]]

    data["history"] = (
        naive.QuantizedKeys(pad(qk.codes), qk.scale, qk.zero, qk.nbits, qk.group_size),
        naive.QuantizedValues(pad(qv.hi), pad(qv.lo), qv.scale, qv.zero, qv.nbits, qv.group_size),
    )
    ref, _ = _reference(data)
    out, _ = _run_kernel(data, tuning={"words": True})
    assert (out.double().cpu() - ref).abs().max() <= ATOL[torch.float32]


def test_v_precision_is_applied():
    """With V precision off, the kernel leaves the reference with V precision by far more than the tolerance, so
    the comparisons above would see it missing (LoopKV Sec. 3.3); the counts give a real mix of cold and hot."""
    data = _build(Case(hist=96, splits=3, Q=2, Hq=2), torch.float32)
    stats = torch.zeros(2, dtype=torch.int64)
    ref, _ = _reference(data, stats=stats)
    assert 0.3 < stats[0].item() / stats[1].item() < 0.95
    out_off, _ = _run_kernel(data, vprec=False)
    assert (out_off.double().cpu() - ref).abs().max() > 100 * ATOL[torch.float32]


def test_running_max_crosses_splits():
    """The largest history score sits in page 0: the later splits must inherit it through the prefix of page maxima
    (a running maximum kept per split would leave their tokens hot). Same output and cold count for 1 and 4 splits."""
    data = _build(Case(hist=128, S=0, Q=1, Hq=1, Hkv=1), torch.float32)
    qk, qv = data["history"]
    k = naive.dequantize_keys(qk)
    k[:, :, 3] = data["q"][:, :1, 0] * 6  # a key aligned with the query
    data["history"] = (naive.quantize_keys(k, 4, group_size=PAGE), qv)
    stats = torch.zeros(2, dtype=torch.int64)
    ref, _ = _reference(data, stats=stats)
    assert stats[0].item() > 0
    settings = [(1, {"words": False}), (2, {"words": False}), (4, {"words": False}), (1, {}), (4, {})]
    settings += [(ns, {"vprec": m, "vprec_unroll": u}) for ns in (1, 4) for m in ("pipe", "scores") for u in (0, 1)]
    settings += [(None, {"vprec": "scores"})]  # the launcher's own split count (4 pages: 4 splits here)
    settings += [(ns, {"vprec_lookback": True, "vprec": m}) for ns in (2, 4) for m in ("v4", "pipe", "scores")]
    settings += [(2, {"vprec_lookback": True, "vprec": "v4", "pages": 2})]  # one launch
    settings += [(ns, {"vprec": "v4", "pages": p}) for ns in (2, 4) for p in (1, 2)]  # optimistic: reruns
    settings += [(4, {"vprec": "v4", "vprec_optimistic": False})]  # v4's two launches
    for ns, tune in settings:
        data["case"].splits = ns
        got = torch.zeros(2, dtype=torch.int64, device=DEVICE)
        out, _ = _run_kernel(data, stats=got, tuning=tune)
        assert (out.double().cpu() - ref).abs().max() <= ATOL[torch.float32], ns
        assert got.tolist() == stats.tolist(), ns


@pytest.mark.parametrize(
    "tune",
    [{"words": False}, {"words": True}, {"vprec": "pipe"}, {"vprec": "scores"}, {"vprec": "pipe", "vprec_unroll": 1},
     {"sub": 2, "num_warps": 1}, {"sub": 4}, {"sub_stages": 3}],
    ids=["bytes", "words", "v5-pipe", "v5-scores", "v5-pipe-unroll", "v6-sub2", "v6-sub4", "v6-stages3"],
)  # fmt: skip
@pytest.mark.parametrize("vprec", [False, True], ids=["both-planes", "vprec"])
def test_late_maximum_moves_the_softmax_reference(vprec, tune):
    """One row per KV head (the elementwise path keeps a lazy softmax reference): a key aligned with the query in the
    last page forces the reference to move after two steps of pages were accumulated; the output must not change."""
    data = _build(Case(hist=320, S=0, Q=1, Hq=1, Hkv=1, splits=1, vprec=vprec), torch.float32)
    qk, qv = data["history"]
    k = naive.dequantize_keys(qk)
    k[:, :, 300] = data["q"][:, :1, 0] * 6
    data["history"] = (naive.quantize_keys(k, 4, group_size=PAGE), qv)
    ref, ref_lse = _reference(data)
    out, lse = _run_kernel(data, tuning=tune)
    assert (out.double().cpu() - ref).abs().max() <= ATOL[torch.float32]
    torch.testing.assert_close(lse.double().cpu(), ref_lse, atol=LSE_ATOL[torch.float32], rtol=0)


def test_public_coded_attention_validates_and_falls_back():
    from triton_ops.coded_attention import coded_attention

    data = _build(Case(hist=40, Q=2), torch.float32)
    view = _view(data, torch.float32)
    out, lse = coded_attention(data["q"], view, scaling=data["scaling"], v_precision_tau=4.0)
    ref, ref_lse = reference_coded_attention(data["q"], view, scaling=data["scaling"], v_precision_tau=4.0)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)  # CPU tensors: the reference
    with pytest.raises(TypeError, match="dtype"):
        coded_attention(data["q"].half(), view, scaling=1.0)
    with pytest.raises(ValueError, match="scaling"):
        coded_attention(data["q"], view, scaling=float("nan"))


GPU_SWEEP = [
    Case(B=2, Hq=16, Hkv=16, D=128, S=32, hist=h, Wn=256, Q=1, fmt=f, vprec=v)
    for h in (1, 31, 32, 33, 1000, 8192)
    for f, v in ((4, True), (4, False), (2, False), (0, False))
]
GPU_SPECIAL = [
    Case(B=3, Hq=16, Hkv=2, D=128, S=32, hist=1000, Wn=64, Q=65, fmt=4, vprec=True, pad=True),  # W + 1, GQA 8
    Case(B=1, Hq=16, Hkv=4, D=128, S=0, hist=8192, Wn=64, Q=5, fmt=4, vprec=True),
    Case(B=2, Hq=32, Hkv=8, D=64, S=4, hist=333, Wn=64, Q=17, fmt=0, pad=True),
    Case(B=2, Hq=16, Hkv=16, D=128, S=32, hist=2000, Wn=64, Q=1, fmt=4, strided=True),
    Case(B=2, Hq=16, Hkv=16, D=128, S=32, hist=2000, Wn=64, Q=4, fmt=2, strided=True, pad=True),
    Case(B=2, Hq=8, Hkv=2, D=64, S=4, hist=300, Wn=64, Q=3, fmt=2, pad=True),  # the smallest coded head dim
    Case(B=2, Hq=8, Hkv=2, D=64, S=4, hist=300, Wn=64, Q=3, fmt=4, vprec=True, splits=3),
]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("case", [pytest.param(c, id=c.id()) for c in GPU_SWEEP])
def test_kernel_matches_reference_gpu_sweep(case):
    _check(case, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("case", [pytest.param(c, id=c.id()) for c in GPU_SPECIAL])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_kernel_matches_reference_gpu(case, dtype):
    _check(case, dtype)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("case", [pytest.param(c, id=c.id()) for c in GPU_SWEEP if c.fmt] + [GPU_SPECIAL[3]])
@pytest.mark.parametrize("setting", list(ROW1_SETTINGS))
def test_row1_settings_gpu_sweep(case, setting):
    _check(case, torch.bfloat16, tuning=ROW1_SETTINGS[setting])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("case", [pytest.param(c, id=c.id()) for c in GPU_SWEEP if c.fmt == 4 and c.vprec])
@pytest.mark.parametrize("setting", list(VPREC_SETTINGS))
def test_vprec_modes_gpu_sweep(case, setting):
    _check(case, torch.bfloat16, tuning=VPREC_SETTINGS[setting])


GPU_NPOW2 = [
    Case(B=2, Hq=8, Hkv=8, D=96, S=32, hist=h, Wn=256, Q=1, fmt=f, vprec=v)
    for h in (1, 33, 1000, 8192)
    for f, v in ((4, True), (4, False), (2, False))
] + [
    Case(B=2, Hq=8, Hkv=8, D=96, S=32, hist=8192, Wn=256, Q=5, fmt=4, vprec=True, pad=True),  # verification block
    Case(B=2, Hq=8, Hkv=8, D=96, S=32, hist=2000, Wn=64, Q=1, fmt=4, strided=True, guard=True),  # borrowed codes
    Case(B=2, Hq=8, Hkv=2, D=80, S=4, hist=1000, Wn=64, Q=3, fmt=2, vgroup=16, pad=True),
]
"""Huginn-0125's head dim 96 (and 80) over coded history on the GPU, bf16: decode and a verification block."""


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("case", [pytest.param(c, id=c.id()) for c in GPU_NPOW2])
def test_coded_head_dims_that_are_no_power_of_two_gpu(case):
    _check(case, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("case", [pytest.param(c, id=c.id()) for c in GPU_NPOW2 if c.fmt == 4 and c.vprec and c.Q == 1])
@pytest.mark.parametrize("setting", list(VPREC_SETTINGS))
def test_coded_head_dims_that_are_no_power_of_two_vprec_modes_gpu(case, setting):
    _check(case, torch.bfloat16, tuning=VPREC_SETTINGS[setting])


def test_kernel_refuses_shapes_it_cannot_take():
    """Shapes the compiled kernel cannot take go to the reference (announced), never to a wrong launch."""
    from triton_ops.coded_attention.ops import _kernel_supports

    data = _build(Case(hist=40, D=32), torch.float32)
    assert "head_dim 32" in _kernel_supports(data["q"], _view(data, torch.float32))
    data = _build(Case(hist=40, D=64, fmt=0), torch.float32)
    assert _kernel_supports(data["q"], _view(data, torch.float32)) is None
    data = _build(Case(hist=40, D=96, fmt=0), torch.float32)  # dense: padded tiles
    assert _kernel_supports(data["q"], _view(data, torch.float32)) is None
    data = _build(Case(hist=40, D=96), torch.float32)  # codes too (Huginn-0125): padded tiles of 128
    assert _kernel_supports(data["q"], _view(data, torch.float32)) is None
    data = _build(Case(hist=40, D=48, vgroup=16), torch.float32)  # tiles of 64
    assert _kernel_supports(data["q"], _view(data, torch.float32)) is None
    data = _build(Case(hist=40, D=24, vgroup=8), torch.float32)  # tiles of 32: too narrow for the per-lane dots
    assert "head_dim 24 with coded history" in _kernel_supports(data["q"], _view(data, torch.float32))
    data = _build(Case(hist=40, D=12, fmt=0), torch.float32)
    assert "head_dim 12 (the kernel needs >= 16)" in _kernel_supports(data["q"], _view(data, torch.float32))
    data = _build(Case(hist=40, D=64), torch.float32)
    assert _kernel_supports(data["q"].double(), _view(data, torch.float64)) is not None
    # V precision over more than 16 query rows per KV head goes to the reference (not validated on the GPU)
    data = _build(Case(hist=40, D=64, Hq=4, Q=5), torch.float32)
    view = _view(data, torch.float32)
    assert "V precision over 20 query rows" in _kernel_supports(data["q"], view, data["tau"])
    assert _kernel_supports(data["q"], view, None) is None


@pytest.mark.parametrize("ns", [0, 5, 200])
def test_merge_of_split_partials(ns):
    """The merge of `NS + 1` split partials (more than one `BLOCK_S` load when NS + 1 > 128) against logsumexp in
    torch, GQA rows and channels split over programs."""
    import triton

    from triton_ops.coded_attention.kernels import _coded_attention_merge_kernel

    b, hkv, g, q, d = 2, 2, 2, 3, 64
    rows = b * hkv * g * q
    gen = torch.Generator().manual_seed(ns)
    o_part = torch.randn(ns + 1, b * hkv, g * q, d, generator=gen).to(DEVICE)
    lse_part = (torch.randn(ns + 1, b * hkv, g * q, generator=gen) * 3).to(DEVICE)
    if ns:
        lse_part[0, 0, 0] = float("-inf")  # an empty split (a row always has its new token somewhere)
    out = torch.empty(b, hkv * g, q, d, device=DEVICE)
    lse = torch.empty(b, hkv * g, q, device=DEVICE)
    _coded_attention_merge_kernel[(rows, d // 32)](
        o_part, lse_part, out, lse, out.stride(0), out.stride(1), out.stride(2), lse.stride(0), lse.stride(1),
        H_KV=hkv, G=g, Q=q, NS=ns, n_bh_rows=rows, D=d, DH=d, BLOCK_S=min(128, triton.next_power_of_2(ns + 1)), BLOCK_D=32,
    )  # fmt: skip
    w = torch.softmax(lse_part * math.log(2), dim=0)  # partials' lse in log2 units, the output's in natural units
    want = (w[..., None] * o_part).sum(0).view(b, hkv, g, q, d).reshape(b, hkv * g, q, d)
    want_lse = torch.logsumexp(lse_part * math.log(2), dim=0).view(b, hkv * g, q)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-5)
