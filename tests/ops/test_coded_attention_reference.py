"""The coded-attention reference (`triton_ops.coded_attention`) against two independent statements of the same read:

- `segmented_attention` over decoded history (today's read path, the engine's results before the op existed), with
  V precision through its `cold_delta` segments;
- a dense statement: every position decoded, one visibility mask per (row, query), `softmax` / `logsumexp` in fp64.

Shapes are awkward on purpose: history lengths around a page (1, 31, 32, 33) and long (1000), sinks of 0 / 4 / 32,
window edges (the boundary at the window's first position, moving inside a block), MHA and GQA, INT4 / INT2 codes
and a BF16 plane, V precision on and off, left padding, q = 1 up to W + 1.
"""

from __future__ import annotations

import math

import pytest
import torch

from hf_loopcache.attention import Segment, VPrecision, causal_padding_mask, segmented_attention
from triton_ops.coded_attention import CellView, coded_attention, reference_coded_attention
from triton_ops.quant import dequantize_keys, dequantize_values, quantize_keys, quantize_values

PAGE = 32


@pytest.fixture(autouse=True)
def _threads():
    torch.set_num_threads(1)


def _state(case, seed=0):
    """Stored stretches of one cell plus its new tokens, in fp32 (the stored dtype; BF16 is converted in a test)."""
    b, hq, hkv, d, sink, read, q, kind, padded, spread = case
    g = torch.Generator().manual_seed(seed)
    t_hist = PAGE * math.ceil(read / PAGE) if kind != "bf16" else read  # codes hold whole pages
    window_start = sink + read - spread  # the first query's boundary; the window starts there
    length = sink + max(t_hist, read + 1)  # the window holds at least one position
    total = length + q
    keys = torch.randn(b, hkv, total, d, generator=g) * 1.5
    values = torch.randn(b, hkv, total, d, generator=g)
    query = torch.randn(b, hq, q, d, generator=g) * 1.5
    if sink:  # a sink key pointing along the queries makes the sink maximum the V-precision seed for many rows
        keys[:, :, 0] = query.reshape(b, hkv, -1, d).mean(2) * 3
    key_valid = None
    if padded:
        key_valid = torch.ones(b, total, dtype=torch.bool)
        key_valid[0, : min(3, length)] = False  # left padding of row 0
        key_valid[-1, sink + read // 2] = False  # a hole in the history of the last row
        key_valid[-1, length] = False  # a padded new token: it reads itself, later queries never read it
    # boundaries: the first query reads up to `window_start`, the last up to `sink + read`, moving inside the block
    steps = torch.linspace(window_start, sink + read, q).floor().long() if q > 1 else torch.tensor([sink + read])
    history_end = steps[None].expand(b, q).clone()
    if b > 1:
        history_end[1] = window_start  # rows may differ
    return dict(
        keys=keys,
        values=values,
        query=query,
        key_valid=key_valid,
        history_end=history_end,
        sink=sink,
        t_hist=t_hist,
        window_start=window_start,
        length=length,
        kind=kind,
    )


def _view(st, dtype=torch.float32):
    k, v = st["keys"].to(dtype), st["values"].to(dtype)
    s, n, ws, t_hist = st["sink"], st["length"], st["window_start"], st["t_hist"]
    if st["kind"] == "bf16":
        hk, hv = k[:, :, s : s + t_hist], v[:, :, s : s + t_hist]
    else:
        nbits = 4 if st["kind"] == "int4" else 2
        valid = None if st["key_valid"] is None else st["key_valid"][:, s : s + t_hist]
        hk = quantize_keys(k[:, :, s : s + t_hist], nbits, group_size=PAGE, valid=valid)
        hv = quantize_values(v[:, :, s : s + t_hist], nbits, group_size=PAGE)
    return CellView(
        new_key=k[:, :, n:],
        new_value=v[:, :, n:],
        length=n,
        history_end=st["history_end"],
        sink_key=k[:, :, :s] if s else None,
        sink_value=v[:, :, :s] if s else None,
        history_start=s,
        history_key=hk,
        history_value=hv,
        window_start=ws,
        window_key=k[:, :, ws:n],
        window_value=v[:, :, ws:n],
        key_valid=st["key_valid"],
    )


def _decoded_history(view):
    if view.is_coded:
        k, v = dequantize_keys(view.history_key), dequantize_values(view.history_value)
        cold = dequantize_values(view.history_value, hot=torch.zeros(v.shape[:3], dtype=torch.bool)) - v
        return k, v, (cold if view.history_nbits == 4 else None)
    return view.history_key.float(), view.history_value.float(), None


def _segmented(query, view, tau, stats=None):
    """Today's read path: `segmented_attention` over the decoded history, segments built as the engine built them."""
    n, q = view.length, view.query_length
    dev = query.device
    queries = torch.arange(n, n + q)
    kv = view.key_valid
    bound = view.history_end  # [B, q]

    def padding(pos):
        return None if kv is None else kv[:, pos][:, None, None, :].expand(-1, 1, q, -1)

    def both(a, b):
        return a if b is None else (b if a is None else a & b)

    segs = []
    if view.sink_length:
        segs.append(Segment(view.sink_key, view.sink_value, padding(torch.arange(view.sink_length)), is_sink=True))
    hmax = int(bound.max())
    if hmax > view.history_start:
        k, v, cold = _decoded_history(view)
        r = hmax - view.history_start
        pos = torch.arange(view.history_start, hmax, device=dev)
        mask = (pos[None, None, :] < bound[:, :, None])[:, None]
        segs.append(
            Segment(
                k[:, :, :r], v[:, :, :r], both(mask, padding(pos)), cold_delta=None if cold is None else cold[:, :, :r]
            )
        )
    if view.window_key is not None:
        pos = torch.arange(view.window_start, n)
        mask = (pos[None, None, :] >= bound[:, :, None])[:, None]
        segs.append(Segment(view.window_key, view.window_value, both(mask, padding(pos))))
    segs.append(Segment(view.new_key, view.new_value, causal_padding_mask(queries, queries, kv)))
    vp = None if tau is None else VPrecision(tau=tau, page_size=PAGE)
    return segmented_attention(query, segs, scaling=view.head_dim**-0.5, v_precision=vp, stats=stats)


def _dense(query, view):
    """Every position decoded, one mask per (row, query): output and logsumexp in fp64 (no V precision)."""
    n, q, b = view.length, view.query_length, view.batch_size
    s = view.history_start
    hk, hv, _ = _decoded_history(view) if view.history_key is not None else (None, None, None)
    ks, vs, masks = [], [], []
    pos_q = torch.arange(n, n + q)
    bound = view.history_end[:, :, None]  # [B, q, 1]
    if view.sink_length:
        ks.append(view.sink_key)
        vs.append(view.sink_value)
        masks.append(torch.ones(b, q, view.sink_length, dtype=torch.bool))
    if hk is not None:
        pos = torch.arange(s, s + hk.shape[2])
        ks.append(hk)
        vs.append(hv)
        masks.append(pos[None, None, :] < bound)
    if view.window_key is not None:
        pos = torch.arange(view.window_start, n)
        ks.append(view.window_key)
        vs.append(view.window_value)
        masks.append((pos[None, None, :] >= bound).expand(b, q, -1))
    ks.append(view.new_key)
    vs.append(view.new_value)
    masks.append((pos_q[None, :] <= pos_q[:, None])[None].expand(b, q, q))
    positions = torch.cat(
        [torch.arange(view.sink_length)]
        + ([torch.arange(s, s + hk.shape[2])] if hk is not None else [])
        + ([torch.arange(view.window_start, n)] if view.window_key is not None else [])
        + [pos_q]
    )
    k = torch.cat([t.double() for t in ks], 2)
    v = torch.cat([t.double() for t in vs], 2)
    mask = torch.cat(masks, -1)  # [B, q, K]
    if view.key_valid is not None:
        own = positions[None, None, :] == pos_q[None, :, None]
        mask = (mask & view.key_valid[:, positions][:, None, :]) | own
    groups = query.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scores = (query.double() @ k.transpose(-1, -2)) * view.head_dim**-0.5
    scores = scores.masked_fill(~mask[:, None], -math.inf)
    return torch.softmax(scores, -1) @ v, torch.logsumexp(scores, -1)


# (B, H_q, H_kv, D, sink, history read, q, kind, padded, spread)
CASES = [
    (1, 2, 2, 32, 0, 1, 1, "int4", False, 0),
    (2, 4, 2, 32, 4, 31, 1, "int4", True, 0),
    (2, 2, 2, 32, 4, 32, 1, "int2", False, 0),
    (1, 8, 2, 64, 32, 33, 1, "int4", False, 0),
    (2, 4, 1, 32, 32, 1000, 1, "int4", True, 0),
    (2, 4, 4, 32, 0, 1000, 1, "int2", False, 0),
    (1, 2, 2, 32, 4, 32, 4, "int4", False, 0),
    (2, 4, 2, 32, 4, 64, 33, "int4", True, 32),  # a block of W + 1 = 33 tokens, boundary moving by a page
    (2, 8, 2, 32, 32, 96, 33, "int2", False, 64),
    (1, 2, 2, 32, 0, 31, 5, "bf16", False, 7),  # a borrowed BF16 plane (RIPE, page size 1): any boundary
    (2, 4, 2, 32, 4, 1000, 9, "bf16", True, 8),
    (2, 2, 1, 32, 32, 33, 1, "bf16", False, 0),
]


def _case_id(c):
    return "B{}-Hq{}-Hkv{}-D{}-S{}-hist{}-q{}-{}-{}-spread{}".format(*c[:8], "pad" if c[8] else "nopad", c[9])


@pytest.mark.parametrize("case", [pytest.param(c, id=_case_id(c)) for c in CASES])
@pytest.mark.parametrize("tau", [None, 1.0, 14.0], ids=["vp-off", "vp-tau1", "vp-tau14"])
def test_reference_equals_segmented_attention(case, tau):
    st = _state(case)
    view = _view(st)
    stats_old = {"cold": 0.0, "history": 0.0}
    stats_new = torch.zeros(2, dtype=torch.float64)
    out, lse = reference_coded_attention(
        st["query"], view, scaling=view.head_dim**-0.5, v_precision_tau=tau, v_precision_stats=stats_new
    )
    old = _segmented(st["query"], view, tau, stats_old)
    torch.testing.assert_close(out, old, atol=2e-6, rtol=1e-5)
    if tau is not None and view.history_nbits == 4:
        assert stats_new.tolist() == [stats_old["cold"], stats_old["history"]]
    else:
        assert stats_new.tolist() == [0.0, 0.0]
    assert lse.shape == st["query"].shape[:3] and lse.dtype == torch.float32


@pytest.mark.parametrize("case", [pytest.param(c, id=_case_id(c)) for c in CASES])
def test_reference_equals_dense_softmax_and_logsumexp(case):
    st = _state(case, seed=1)
    view = _view(st)
    out, lse = coded_attention(st["query"], view, scaling=view.head_dim**-0.5)
    want_out, want_lse = _dense(st["query"], view)
    torch.testing.assert_close(out.double(), want_out, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(lse.double(), want_lse, atol=2e-5, rtol=1e-6)


@pytest.mark.parametrize("split_pages", [1, 3, 64])
def test_splits_do_not_change_the_result(split_pages):
    st = _state((2, 4, 2, 32, 4, 1000, 3, "int4", True, 40))
    view = _view(st)
    base, base_lse = reference_coded_attention(st["query"], view, scaling=0.2, v_precision_tau=2.0)
    out, lse = reference_coded_attention(st["query"], view, scaling=0.2, v_precision_tau=2.0, split_pages=split_pages)
    torch.testing.assert_close(out, base, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(lse, base_lse, atol=1e-6, rtol=1e-6)


def test_bf16_view_computes_in_fp32_and_returns_bf16():
    st = _state((2, 4, 2, 32, 4, 64, 4, "int4", False, 16))
    view = _view(st, torch.bfloat16)
    out, lse = reference_coded_attention(st["query"].bfloat16(), view, scaling=32**-0.5, v_precision_tau=14.0)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    old = _segmented(st["query"].bfloat16(), view, 14.0)
    torch.testing.assert_close(out.float(), old.float(), atol=1e-2, rtol=0)  # both round an fp32 result to bf16


def test_v_precision_changes_int4_reads_only():
    """Cold tokens read the hi plane only: with tau small, INT4 output moves; INT2 and BF16 history do not."""
    for kind, moves in (("int4", True), ("int2", False), ("bf16", False)):
        st = _state((2, 4, 2, 32, 4, 200, 2, kind, False, 0))
        view = _view(st)
        on, lse_on = reference_coded_attention(st["query"], view, scaling=0.2, v_precision_tau=0.5)
        off, lse_off = reference_coded_attention(st["query"], view, scaling=0.2)
        assert bool((on != off).any()) == moves, kind
        torch.testing.assert_close(lse_on, lse_off, atol=0, rtol=0)  # V precision never changes the scores


def _rules_case():
    return _state((2, 4, 2, 32, 4, 200, 3, "int4", True, 32), seed=3)


def test_bad_views_are_clear_errors():
    st = _rules_case()
    view = _view(st)
    with pytest.raises(ValueError, match="history_end"):
        bad = dict(view.__dict__, history_end=view.history_end + 1000)
        reference_coded_attention(st["query"], CellView(**bad), scaling=0.2)
    with pytest.raises(ValueError, match="history_end"):
        CellView(**dict(view.__dict__, history_end=view.history_end[:, :1]))
    with pytest.raises(TypeError, match="history_end"):
        CellView(**dict(view.__dict__, history_end=view.history_end.float()))
    with pytest.raises(ValueError, match="window_key"):
        CellView(**dict(view.__dict__, window_key=view.window_key[:, :, 1:]))
    with pytest.raises(ValueError, match="sink"):
        CellView(**dict(view.__dict__, sink_key=None, sink_value=None))
    with pytest.raises(TypeError, match="QuantizedValues"):
        CellView(**dict(view.__dict__, history_value=dequantize_values(view.history_value)))
    with pytest.raises(ValueError, match="key_valid"):
        CellView(**dict(view.__dict__, key_valid=st["key_valid"][:, :5]))
    with pytest.raises(ValueError, match="query"):
        reference_coded_attention(st["query"][:, :3], view, scaling=0.2)
    with pytest.raises(TypeError, match="dtype"):
        reference_coded_attention(st["query"].double(), view, scaling=0.2)
    with pytest.raises(ValueError, match="v_precision_tau"):
        reference_coded_attention(st["query"], view, scaling=0.2, v_precision_tau=-1.0)
    with pytest.raises(ValueError, match="v_precision_stats"):
        reference_coded_attention(st["query"], view, scaling=0.2, v_precision_stats=torch.zeros(3))
    with pytest.raises(TypeError, match="CellView"):
        reference_coded_attention(st["query"], "view", scaling=0.2)
