"""`coded_attention` with device-side lengths (a static cache's decode step): the same view as the host-length one,
stored the static way (the whole sink buffer, every preallocated page, the window as a ring, `length` a tensor),
gives the same output, log-sum-exp and V-precision counts; the reference reads no device value on the host; the
Triton kernel (CUDA, or the CPU under `TRITON_INTERPRET=1`: `test_triton_interpreter.py`) matches the reference on
the same codes, with the same launch grid whatever the length.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from tests.ops.conftest import record_launches
from tests.ops.test_coded_attention_kernels import ATOL, LSE_ATOL, Case, _build, _view
from triton_ops.coded_attention import CellView, reference_coded_attention
from triton_ops.quant import naive

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_kernel = pytest.mark.skipif(
    not (torch.cuda.is_available() or INTERPRET), reason="needs CUDA or TRITON_INTERPRET=1 (see test_triton_interpreter)"
)

CASES = [
    Case(B=2, Hq=2, Hkv=1, D=64, S=4, hist=40, Wn=9, Q=1, fmt=4, vprec=True, pad=True),
    Case(B=2, Hq=2, Hkv=1, D=64, S=4, hist=33, Wn=5, Q=1, fmt=4, vprec=False),
    Case(B=1, Hq=4, Hkv=2, D=64, S=2, hist=31, Wn=7, Q=1, fmt=2, vprec=False, pad=True),
    Case(B=2, Hq=2, Hkv=1, D=64, S=4, hist=64, Wn=6, Q=3, fmt=4, vprec=True, pad=True),
    Case(B=2, Hq=2, Hkv=1, D=32, S=0, hist=20, Wn=4, Q=1, fmt=0, vprec=False, pad=True),
    Case(B=2, Hq=2, Hkv=2, D=64, S=4, hist=70, Wn=6, Q=1, fmt=4, vprec=True, pad=True),  # one row per KV head: ROW1
    Case(B=1, Hq=1, Hkv=1, D=64, S=4, hist=50, Wn=3, Q=1, fmt=2, vprec=False),  # ROW1, INT2
    Case(B=2, Hq=2, Hkv=2, D=96, S=4, hist=70, Wn=6, Q=1, fmt=4, vprec=True, pad=True),  # Huginn-0125's head dim
    Case(B=2, Hq=2, Hkv=1, D=96, S=4, hist=64, Wn=6, Q=3, fmt=2, vprec=False),  # padded tiles, several rows
]


def _static_view(data, dtype, device="cpu", extra_pages=2, extra_slots=5, seed=1):
    """The host-length view's contents stored as a static cell stores them: `extra_pages` preallocated pages past
    the history (random codes nobody may read), the window in a ring of `W + extra_slots` slots (the other slots hold
    random older positions, which the bounds hide)."""
    g = torch.Generator().manual_seed(seed)
    host = _view(data, dtype)
    case, n = data["case"], data["n"]
    hk, hv = data["history"]
    b, hkv, d = case.B, case.Hkv, case.D
    junk_k = torch.randn(b, hkv, extra_pages * 32, d, generator=g) * 3
    junk_v = torch.randn(b, hkv, extra_pages * 32, d, generator=g) * 3
    if case.fmt:
        jk, jv = naive.quantize_keys(junk_k, case.fmt, group_size=32), naive.quantize_values(junk_v, case.fmt)
        cat = lambda x, y: torch.cat([x, y], dim=2).to(device)  # noqa: E731
        hk = naive.QuantizedKeys(cat(hk.codes, jk.codes), cat(hk.scale, jk.scale), cat(hk.zero, jk.zero), hk.nbits, 32)
        hv = naive.QuantizedValues(
            cat(hv.hi, jv.hi), None if hv.lo is None else cat(hv.lo, jv.lo), cat(hv.scale, jv.scale),
            cat(hv.zero, jv.zero), hv.nbits, hv.group_size,
        )  # fmt: skip
    else:
        hk = torch.cat([hk, junk_k], dim=2).to(device=device, dtype=dtype)
        hv = torch.cat([hv, junk_v], dim=2).to(device=device, dtype=dtype)
    w_len = n - data["w_start"]
    cap = w_len + extra_slots
    ring_k = torch.randn(b, hkv, cap, d, generator=g) * 3
    ring_v = torch.randn(b, hkv, cap, d, generator=g) * 3
    slots = torch.arange(data["w_start"], n) % cap
    ring_k[:, :, slots] = host.window_key.float()
    ring_v[:, :, slots] = host.window_value.float()
    conv = lambda t: None if t is None else t.to(device=device, dtype=dtype)  # noqa: E731
    return CellView(
        new_key=conv(host.new_key), new_value=conv(host.new_value), length=torch.tensor(n, device=device),
        history_end=host.history_end.to(device), sink_key=conv(host.sink_key), sink_value=conv(host.sink_value),
        history_start=case.S, history_key=hk, history_value=hv, window_key=conv(ring_k), window_value=conv(ring_v),
        key_valid=None if host.key_valid is None else host.key_valid.to(device),
    )  # fmt: skip


def _ref(data, view, dtype):
    tau = data["tau"] if data["case"].vprec else None
    stats = torch.zeros(2, dtype=torch.int64)
    out, lse = reference_coded_attention(
        data["q"].to(dtype), view, scaling=data["scaling"], v_precision_tau=tau, v_precision_stats=stats
    )
    return out, lse, stats


def _assert_matches(data, out, lse, stats=None, extra_pages=2):
    """The kernel's fp32 output against the reference in fp64 on the same static view, within twice the fp32
    reference's own error plus `ATOL` (STYLE 14, as `test_coded_attention_kernels._check`: a split changes the fp32
    summation order, so the kernel may differ from fp64 by as much as the fp32 reference does); V-precision counts
    equal."""
    ref, ref_lse, ref_stats = _ref(data, _static_view(data, torch.float64, extra_pages=extra_pages), torch.float64)
    low = _ref(data, _static_view(data, torch.float32, extra_pages=extra_pages), torch.float32)[0]
    err_ref = (low.double() - ref).abs().max().item()
    err = (out.double().cpu() - ref).abs().max().item()
    assert err <= 2 * err_ref + ATOL[torch.float32], f"kernel err {err:.3e}, fp32 reference err {err_ref:.3e}"
    torch.testing.assert_close(lse.double().cpu(), ref_lse, rtol=0, atol=LSE_ATOL[torch.float32])
    if stats is not None and data["case"].vprec and data["case"].fmt == 4:
        assert stats.cpu().tolist() == ref_stats.tolist()


@pytest.mark.parametrize("case", [pytest.param(c, id=c.id()) for c in CASES])
def test_device_lengths_read_what_host_lengths_read(case):
    data = _build(case, torch.float32)  # inputs drawn in fp32; both views read in fp64
    out, lse, stats = _ref(data, _view(data, torch.float64), torch.float64)
    s_out, s_lse, s_stats = _ref(data, _static_view(data, torch.float64), torch.float64)
    torch.testing.assert_close(s_out, out, rtol=0, atol=1e-12)
    torch.testing.assert_close(s_lse, lse, rtol=0, atol=1e-12)
    assert s_stats.tolist() == stats.tolist()


def test_device_lengths_short_sink_and_empty_history():
    """A cell holding fewer positions than its sink (a short prompt): the static sink buffer is read up to `length`
    only, the history not at all (bounds at `S`)."""
    g = torch.Generator().manual_seed(3)
    b, h, d, s, n = 2, 1, 64, 8, 5
    sk, sv = torch.randn(b, h, s, d, generator=g, dtype=torch.float64), torch.randn(b, h, s, d, generator=g, dtype=torch.float64)
    nk, nv = torch.randn(b, h, 1, d, generator=g, dtype=torch.float64), torch.randn(b, h, 1, d, generator=g, dtype=torch.float64)
    q = torch.randn(b, 2, 1, d, generator=g, dtype=torch.float64)
    hist = naive.quantize_keys(torch.randn(b, h, 64, d, generator=g), 4), naive.quantize_values(torch.randn(b, h, 64, d, generator=g), 4)
    ring = torch.randn(b, h, 6, d, generator=g, dtype=torch.float64)
    static = CellView(
        new_key=nk, new_value=nv, length=torch.tensor([n]), history_end=torch.full((b, 1), s), sink_key=sk,
        sink_value=sv, history_start=s, history_key=hist[0], history_value=hist[1], window_key=ring, window_value=ring,
    )  # fmt: skip
    host = CellView(
        new_key=nk, new_value=nv, length=n, history_end=torch.full((b, 1), n), sink_key=sk[:, :, :n],
        sink_value=sv[:, :, :n], history_start=s,
    )  # fmt: skip
    got = reference_coded_attention(q, static, scaling=0.125, v_precision_tau=4.0)
    want = reference_coded_attention(q, host, scaling=0.125)
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=1e-12)


def test_device_lengths_view_errors():
    k = torch.zeros(1, 1, 1, 64)
    with pytest.raises(ValueError, match="window_start"):
        CellView(new_key=k, new_value=k, length=torch.tensor(3), history_end=torch.zeros(1, 1, dtype=torch.long),
                 window_start=1)  # fmt: skip
    with pytest.raises(TypeError, match="one integer"):
        CellView(new_key=k, new_value=k, length=torch.tensor([1.0]), history_end=torch.zeros(1, 1, dtype=torch.long))
    with pytest.raises(ValueError, match="sink"):
        CellView(new_key=k, new_value=k, length=torch.tensor(3), history_end=torch.zeros(1, 1, dtype=torch.long),
                 history_start=2)  # fmt: skip
    for reach in (-1, True, 2.0):
        with pytest.raises(ValueError, match="window_reach"):
            CellView(new_key=k, new_value=k, length=torch.tensor(3), history_end=torch.zeros(1, 1, dtype=torch.long),
                     window_reach=reach)  # fmt: skip
    with pytest.raises(ValueError, match="window_reach.*device-side"):
        CellView(new_key=k, new_value=k, length=3, history_end=torch.zeros(1, 1, dtype=torch.long), window_reach=4)


VERIFY_CASES = [
    # v7 (`ROW1_TUNING["rows_max"]`): verification blocks on the word path, one program per (split, row)
    Case(B=2, Hq=2, Hkv=2, D=64, S=4, hist=70, Wn=6, Q=4, fmt=4, vprec=True, pad=True, spread=40),
    Case(B=2, Hq=4, Hkv=2, D=64, S=4, hist=64, Wn=6, Q=2, fmt=2, vprec=False, spread=33),
    Case(B=1, Hq=2, Hkv=2, D=96, S=4, hist=50, Wn=6, Q=3, fmt=4, vprec=False, pad=True, spread=30),
]


@needs_kernel
@pytest.mark.parametrize("case", [pytest.param(c, id=c.id()) for c in CASES + VERIFY_CASES])
@pytest.mark.parametrize("tail", [None, 3], ids=["tail-auto", "tail3"])
def test_kernel_with_device_lengths_matches_reference(case, tail, launches):
    """The kernel reads the static view (length from the device, ring window, every page in the grid) as the
    reference does, fp32, on the same codes; V-precision counts equal. `tail3`: the ring spread over tail programs
    of 3 slots each (slot ranges cut across the ring's wrap). v7's verification blocks (`spread`) take the word
    path per (split, row) with `ROW1_TUNING["rows_max"]` 16 (the launches are recorded)."""
    from triton_ops.coded_attention.ops import _coded_attention_fwd

    data = _build(case, torch.float32)
    view = _static_view(data, torch.float32, DEVICE)
    tau = data["tau"] if case.vprec else None
    stats = torch.zeros(2, dtype=torch.int64, device=DEVICE)
    out, lse = _coded_attention_fwd(
        data["q"].to(DEVICE), view, scaling=data["scaling"], v_precision_tau=tau, v_precision_stats=stats,
        num_splits=3 if case.fmt else None,
        tuning={"tail_chunk": tail, "rows_max": 16 if case.spread else 0, "mma_rows_min": 0},  # v8: below
    )  # fmt: skip
    _assert_matches(data, out, lse, stats)
    assert all(x[0] == bool(case.spread) for x in launches) and launches, launches


@needs_kernel
def test_static_block_of_four_rows_takes_v8(launches):
    """v8 (`ROW1_TUNING["mma_rows_min"]` 3) reads a static view too: GQA 2 x 2 new tokens (4 rows per KV head) over
    INT2 codes with the length on the device and a ring window, against the reference on the same codes."""
    from triton_ops.coded_attention.ops import _coded_attention_fwd

    case = VERIFY_CASES[1]
    data = _build(case, torch.float32)
    out, lse = _coded_attention_fwd(
        data["q"].to(DEVICE), _static_view(data, torch.float32, DEVICE), scaling=data["scaling"], v_precision_tau=None,
        num_splits=3,
    )
    _assert_matches(data, out, lse)
    assert [x[4] for x in launches] == [True], launches


@needs_kernel
@pytest.mark.parametrize("splits", [2, 6])
@pytest.mark.parametrize(
    "case", [pytest.param(c, id=c.id()) for c in (CASES[0], CASES[3], CASES[5], VERIFY_CASES[0], VERIFY_CASES[1])]
)
def test_static_splits_share_the_live_pages(case, splits):
    """A static cell preallocates far more pages than it holds (a cache built for 32K decoding a short prompt): the
    captured step's splits share out the pages the bounds reach, not the preallocated ones. With 7 spare pages and 2
    or 6 splits, every path (row blocks, one row per KV head with V precision's score pass, v7, v8 / v9) still reads
    what the reference reads, every live page once: outputs, log-sum-exp and V-precision counts (red when a split
    count that does not divide the live pages drops the last ones)."""
    from triton_ops.coded_attention.ops import _coded_attention_fwd

    data = _build(case, torch.float32)
    tau = data["tau"] if case.vprec else None
    stats = torch.zeros(2, dtype=torch.int64, device=DEVICE)
    out, lse = _coded_attention_fwd(
        data["q"].to(DEVICE), _static_view(data, torch.float32, DEVICE, extra_pages=7), scaling=data["scaling"],
        v_precision_tau=tau, v_precision_stats=stats, num_splits=splits,
        tuning={"rows_max": 16 if case.spread else 0},
    )  # fmt: skip
    _assert_matches(data, out, lse, stats, extra_pages=7)


@needs_kernel
@pytest.mark.parametrize("splits", [2, 6])
@pytest.mark.parametrize(
    "case, tune",
    [
        pytest.param(CASES[5], {}, id="row1"),
        pytest.param(Case(B=2, Hq=2, Hkv=2, D=64, S=4, hist=90, Wn=6, Q=5, fmt=4, vprec=True, pad=True, spread=40,
                          lean=0.3), {"mma": True}, id="v9"),
    ],
)  # fmt: skip
def test_static_vprec_lookback_shares_the_live_pages(case, tune, splits, launches):
    """V precision in one launch (`vprec_lookback`) over a static view with 7 spare pages: the splits share out the
    live pages on the device, the earlier splits' page maxima seed the later ones within the launch, and the output,
    log-sum-exp and cold counts are the reference's."""
    from triton_ops.coded_attention.ops import _coded_attention_fwd

    data = _build(case, torch.float32)
    stats = torch.zeros(2, dtype=torch.int64, device=DEVICE)
    out, lse = _coded_attention_fwd(
        data["q"].to(DEVICE), _static_view(data, torch.float32, DEVICE, extra_pages=7), scaling=data["scaling"],
        v_precision_tau=data["tau"], v_precision_stats=stats, num_splits=splits,
        tuning={**tune, "vprec_lookback": True},
    )  # fmt: skip
    _assert_matches(data, out, lse, stats, extra_pages=7)
    assert len(launches) == 1, launches


@needs_kernel
@pytest.mark.parametrize("splits", [2, 6])
@pytest.mark.parametrize(
    "case, tune",
    [
        pytest.param(CASES[5], {"vprec": "v4"}, id="v4"),
        pytest.param(Case(B=2, Hq=2, Hkv=2, D=64, S=4, hist=90, Wn=6, Q=5, fmt=4, vprec=True, pad=True, spread=40,
                          lean=0.3), {"mma": True}, id="v9"),
    ],
)  # fmt: skip
def test_static_vprec_optimistic_shares_the_live_pages(case, tune, splits, launches):
    """V precision's optimistic pass (`vprec_optimistic`) over a static view with 7 spare pages: both launches share
    out the live pages on the device alike, the check reads the page maxima the first launch stored for the earlier
    splits, and the output, log-sum-exp and cold counts are the reference's."""
    from triton_ops.coded_attention.ops import _coded_attention_fwd

    data = _build(case, torch.float32)
    stats = torch.zeros(2, dtype=torch.int64, device=DEVICE)
    out, lse = _coded_attention_fwd(
        data["q"].to(DEVICE), _static_view(data, torch.float32, DEVICE, extra_pages=7), scaling=data["scaling"],
        v_precision_tau=data["tau"], v_precision_stats=stats, num_splits=splits,
        tuning=tune,  # `vprec_optimistic` is on by default
    )  # fmt: skip
    _assert_matches(data, out, lse, stats, extra_pages=7)
    assert len(launches) == 2, launches


@needs_kernel
@pytest.mark.parametrize("splits", [1, 4])
@pytest.mark.parametrize(
    "case",
    [
        pytest.param(Case(B=1, Hq=2, Hkv=2, D=64, S=4, hist=100, Wn=70, Q=1, fmt=4, vprec=True, lean=0.0), id="row1-vprec"),
        pytest.param(Case(B=2, Hq=2, Hkv=1, D=64, S=4, hist=100, Wn=70, Q=2, fmt=2, vprec=False, pad=True, lean=0.0), id="rows"),
    ],
)
def test_static_tail_chunks_follow_the_live_pages(case, splits, launches):
    """A static view's tail programs size their window chunks on the device from the pages the splits share out
    (`TAIL_DEV`): the launcher starts `ceil(ring / tail_min)` tail programs (here 10 of 8 slots for a ring of 75 or 76)
    and the kernel gives each half a split's positions, at least `tail_min` (32 or 64 slots for 1 or 4 live pages per
    split), so most exit at once. Every ring slot is still read exactly once: outputs, log-sum-exp and counts as the
    reference's (red when a program's start and its range use different chunks, or chunks leave a gap)."""
    from triton_ops.coded_attention.ops import _coded_attention_fwd

    data = _build(case, torch.float32)
    tau = data["tau"] if case.vprec else None
    stats = torch.zeros(2, dtype=torch.int64, device=DEVICE)
    view = _static_view(data, torch.float32, DEVICE, extra_pages=7)
    ring = view.window_key.shape[2]
    out, lse = _coded_attention_fwd(
        data["q"].to(DEVICE), view, scaling=data["scaling"], v_precision_tau=tau, v_precision_stats=stats,
        num_splits=splits, tuning={"tail_min": 8, "mma_rows_min": 0},
    )  # fmt: skip
    _assert_matches(data, out, lse, stats, extra_pages=7)
    rowx, *_ = launches[-1]  # v7: a history program per (split, row)
    n_hist = splits * (case.Hq // case.Hkv * case.Q if rowx else 1)
    assert ring >= 75 and launches[-1][3] == n_hist + -(-ring // 8), (ring, launches)


@needs_kernel
@pytest.mark.parametrize("reach", [1, 8, 20])
@pytest.mark.parametrize(
    "case",
    [
        pytest.param(Case(B=1, Hq=2, Hkv=2, D=64, S=4, hist=100, Wn=70, Q=1, fmt=4, vprec=True, lean=0.0), id="row1-vprec"),
        pytest.param(Case(B=2, Hq=2, Hkv=1, D=64, S=4, hist=100, Wn=70, Q=2, fmt=2, vprec=False, pad=True, lean=0.0), id="rows"),
        pytest.param(VERIFY_CASES[0], id="verify"),
    ],
)
def test_static_ring_longer_than_its_reach(case, reach, launches):
    """A view's `window_reach` (a self-speculative cell's: what a read without holes takes from its ring) plans the
    tail programs (`ceil(reach / tail_min)` of them, here with `tail_min` 8), and a row whose stretch is longer (up
    to 70 positions here: holes) is still read whole: each tail program strides over the ring's chunks by the
    program count. Outputs, log-sum-exp and counts as the reference's (red when a program reads one chunk only, or
    strides by a chunk: every position read by every program)."""
    from triton_ops.coded_attention.ops import _coded_attention_fwd

    data = _build(case, torch.float32)
    tau = data["tau"] if case.vprec else None
    stats = torch.zeros(2, dtype=torch.int64, device=DEVICE)
    view = dataclasses.replace(_static_view(data, torch.float32, DEVICE), window_reach=reach)
    out, lse = _coded_attention_fwd(
        data["q"].to(DEVICE), view, scaling=data["scaling"], v_precision_tau=tau, v_precision_stats=stats,
        num_splits=2, tuning={"tail_min": 8, "mma_rows_min": 0, "rows_max": 16 if case.spread else 0},
    )  # fmt: skip
    _assert_matches(data, out, lse, stats)
    rowx, *_ = launches[-1]
    n_hist = 2 * (case.Hq // case.Hkv * case.Q if rowx else 1)
    assert launches[-1][3] == n_hist + -(-reach // 8), launches


PRIOR_CASES = [  # sinks that do not outweigh the history (lean 0.3), so that the prior's weight shows
    Case(B=2, Hq=2, Hkv=2, D=64, S=4, hist=70, Wn=6, Q=1, fmt=0, vprec=False, pad=True, lean=0.3),  # RIPE: MHA, a sink
    Case(B=2, Hq=4, Hkv=2, D=32, S=0, hist=40, Wn=9, Q=1, fmt=0, vprec=False, pad=True),  # no sink, GQA
    Case(B=1, Hq=2, Hkv=2, D=96, S=2, hist=33, Wn=3, Q=1, fmt=0, vprec=False, lean=0.3),  # Huginn-0125's head dim
]


def _history_part(data, view, dtype):
    """Attention of the queries over the history positions `[S, history_end)` alone (what cuDNN computes for a
    static shared cell over a BF16 source), as `(out, natural-log lse)` on the CPU: the view's history keys (on any
    device), padding hidden."""
    q = data["q"].to(dtype)
    b, hq, _, d = q.shape
    hk, hv = view.history_key.to("cpu", dtype), view.history_value.to("cpu", dtype)
    g = hq // hk.shape[1]
    hk, hv = hk.repeat_interleave(g, 1), hv.repeat_interleave(g, 1)
    pos = view.history_start + torch.arange(hk.shape[2])
    seen = pos[None, :] < view.history_end[:, :1].cpu()
    if view.key_valid is not None:
        seen = seen & view.key_valid.cpu()[:, pos.clamp(max=view.key_valid.shape[1] - 1)]
    s = (q @ hk.transpose(-1, -2) * data["scaling"]).masked_fill(~seen[:, None, None, :], float("-inf"))
    lse = torch.logsumexp(s, -1)
    out = torch.softmax(s, -1).nan_to_num(0.0) @ hv
    return out, lse


@pytest.mark.parametrize("reach", [None, 2], ids=["ring", "reach"])
@pytest.mark.parametrize("final", [True, False], ids=["one-launch", "tail-and-merge"])
@pytest.mark.parametrize("case", [pytest.param(c, id=c.id()) for c in PRIOR_CASES])
def test_prior_merges_history_read_elsewhere(monkeypatch, case, final, reach):
    """`prior`: the history read by someone else (cuDNN over a RIPE source's plane) and the rest of the view by the op
    give, merged by log-sum-exp, what the op gives over the whole view (the reference in fp64; the kernel in fp32 on
    CUDA or under `TRITON_INTERPRET=1`, within twice the fp32 reference's error); and a row whose prior read
    nothing (lse -inf, its out NaN) takes none of it. The kernel merges the prior in its one tail program (`FINAL`,
    the default for a ring this short) or, with `final_slots` 0, in the merge launch after the tail programs.
    `reach`: a ring of 200 slots more (a self-speculative cell's, longer than `final_slots`) whose `window_reach`
    keeps the one-launch read."""
    from triton_ops.coded_attention.ops import _coded_attention_fwd

    finals = record_launches(monkeypatch, "_coded_attention_fwd_kernel", lambda grid, kw: kw["FINAL"])

    data = _build(case, torch.float32)
    full = _static_view(data, torch.float64)
    ref, ref_lse, _ = _ref(data, full, torch.float64)
    rest = dataclasses.replace(full, history_key=None, history_value=None)
    out, lse = reference_coded_attention(
        data["q"].double(), rest, scaling=data["scaling"], prior=_history_part(data, full, torch.float64)
    )
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    torch.testing.assert_close(lse, ref_lse, rtol=0, atol=1e-12)
    # nothing read elsewhere for row 0: its prior's out is NaN, its lse -inf
    p_out, p_lse = _history_part(data, full, torch.float64)
    p_out[0], p_lse[0] = float("nan"), float("-inf")
    alone = reference_coded_attention(data["q"].double(), rest, scaling=data["scaling"])[0]
    merged = reference_coded_attention(data["q"].double(), rest, scaling=data["scaling"], prior=(p_out, p_lse))[0]
    torch.testing.assert_close(merged[0], alone[0], rtol=0, atol=1e-12)
    if not (torch.cuda.is_available() or INTERPRET):
        return
    view = _static_view(data, torch.float32, device=DEVICE, extra_slots=205 if reach else 5)
    rest = dataclasses.replace(view, history_key=None, history_value=None, window_reach=reach)
    p_out, p_lse = (t.to(DEVICE) for t in _history_part(data, view, torch.float32))
    q = data["q"].to(DEVICE)
    kw = dict(scaling=data["scaling"], v_precision_tau=None, tuning=None if final else {"final_slots": 0})
    out, lse = _coded_attention_fwd(q, rest, prior=(p_out, p_lse), **kw)
    assert finals == [final]
    _assert_matches(data, out, lse)
    p_out[0], p_lse[0] = float("nan"), float("-inf")
    merged = _coded_attention_fwd(q, rest, prior=(p_out, p_lse), **kw)[0]
    torch.testing.assert_close(merged[0], _coded_attention_fwd(q, rest, **kw)[0][0], rtol=0, atol=1e-6)


def test_prior_is_validated():
    from triton_ops.coded_attention import coded_attention

    data = _build(PRIOR_CASES[0], torch.float32)
    view = _static_view(data, torch.float32)
    q = data["q"]
    with pytest.raises(ValueError, match=r"`prior` must be None or a tuple \(out \[B, H_q, q, D\]"):
        coded_attention(q, view, scaling=data["scaling"], prior=(q, q))
    with pytest.raises(ValueError, match="`prior` must be None or a tuple .*got Tensor$"):
        coded_attention(q, view, scaling=data["scaling"], prior=q)
