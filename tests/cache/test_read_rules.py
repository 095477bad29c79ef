"""The read path against hand-computed answers: which positions a query reads from where, and what it reads.

Every case here is built so that the answer is known in closed form, without running the engine's own helpers:
hand-built keys and values that the KIVI codec represents exactly (so a coded history decodes to what was written),
a query that picks one key channel (so a score is a number written in the test), and cold sets listed by hand from
LoopKV's rule (Sec. 3.3, Appendix: "the seed m0 is the largest score over the row's exact sink keys"). The tests talk
to the cache only through its public surface (`LoopKVCache` / `RIPECache` / `LoopCache.attend`, `crop`), so they hold
for any implementation of the read path.

Rules covered (paper -> test):
- LoopKV V precision: cold iff `s_j < m - tau * ln 2`, `m` the running maximum of the pages up to and including
  `j`'s page, seeded with the largest *sink* score (not the window's); a cold value decodes to `4 * hi + 1.5`
  -> `test_v_precision_reads_the_hand_computed_cold_set`.
- LoopKV page rule: positions leave the window in pages, `H(t) = S + P * floor((t - S - W) / P)`
  -> `test_loopkv_history_boundary_moves_in_pages`.
- A shared cell reads the final loop's cell of the same layer (and keeps its own sink and window)
  -> the `share` case of the V-precision test and `test_ripe_reads_the_deepest_plane_iff_older_than_the_window`.
- RIPE Eq. 9: loop `r` reads plane `R` of position `j` iff `t - j > W` -> `test_ripe_reads_...`.
- Preset defaults: LoopKV sink 32, window 256, page 32, group 32, tau 14 (LoopKV Sec. 2.3, 3.3); RIPE W = 64, no
  sink (RIPE Sec. 4, Table 4) -> `test_preset_defaults_follow_the_papers`.
"""

from __future__ import annotations

import inspect
import math

import pytest
import torch

from hf_loopcache import CachePlan, LoopKVCache, LoopLayout, RIPECache
from hf_loopcache.attention import AttentionInputs, VPrecision
from hf_loopcache.cache.plan import loopkv_preset
from hf_loopcache.planner import profile_cells
from triton_ops.quant import fake_quantize_keys, fake_quantize_values

pytestmark = pytest.mark.usefixtures("pin_threads")


@pytest.fixture
def pin_threads():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _forward(cache, layout, per_cell, query_length):
    """One forward pass over every cell in model order; `per_cell[(loop, layer)] = (q, k, v)`. Returns the outputs."""
    cache.begin_forward(layout, layout.num_loops, query_length)
    outs = {}
    for loop in range(layout.num_loops):
        for layer in range(layout.n_core):
            q, k, v = per_cell[(loop, layer)]
            slot = layout.slot(layout.cells()[layout.n_prelude + loop * layout.n_core + layer])
            outs[(loop, layer)] = cache.attend(slot, q, k, v, AttentionInputs(key_valid=None, scaling=1.0))
    return outs


# ------------------------------------------------------------------------------------------------------ V precision
# One head of width 32 (= one value group), sink S = 2, window W = 4, page P = 4, tau = 4 (margin 4 ln 2 = 2.77).
# The query is e_0 and the softmax scale 1, so a score is channel 0 of the key. At t = 19 the history is the three
# pages [2, 6), [6, 10), [10, 14) (H(19) = 2 + 4 * floor(13 / 4) = 14) and the window is [14, 19).
S, W, P, TAU, D, T = 2, 4, 4, 4.0, 32, 19
HIST_SCORES = [5.0, 5.0, 6.875, 5.0, 7.0, 12.0, 9.5, 4.5, 9.0, 9.0, 9.0, 9.0]  # positions 2..13, on the key grid
SOURCE_SINK, SOURCE_WINDOW = [8.0, 1.0], [3.0, 10.0, 0.0, 2.0, 1.0]
SHARE_SINK, SHARE_WINDOW = [9.0, 2.0], [1.0, 4.0, 0.0, 2.0, 3.0]
# Cold sets by hand (positions), with the running maximum m of each page:
# source cell (sink max 8): page A m = max(8, 6.875) = 8    -> 5.0 (gap 3 > 2.77) cold, 6.875 (gap 1.125) hot
#                           page B m = 12                   -> 7 (gap 5) and 4.5 (gap 7.5) cold; 12, 9.5 (gap 2.5) hot
#                           page C m = 12                   -> 9 (gap 3) cold
#   (the window's 10 > 8 must not seed m: with it page A would be all cold; position 14's 3 would be cold if it were
#    history, which it is not)
# share cell (its own sink max 9, the source's history): page A m = 9 -> 5.0 (gap 4) cold, 6.875 (gap 2.125) hot;
#                           pages B, C as above
COLD = {"own": [2, 3, 5, 6, 9, 10, 11, 12, 13], "share": [2, 3, 5, 6, 9, 10, 11, 12, 13]}
# A second query head of the same KV head (GQA) with query e_0 / 2 halves every score: sink max 4 (share: 4.5), page
# A m = 4 (4.5): gaps <= 1.5, hot; page B m = 6: only 2.25 (gap 3.75) cold; page C 4.5 (gap 1.5) hot.
COLD_HALF = {"own": [9], "share": [9]}
# Faults this case separates from the rule (each changes the cold set, hence the output):
# - no V precision: nothing cold;           - margin tau instead of tau ln 2: 5.0 (gap 3) and 9 (gap 3) hot
# - seed not taken from the sink: page A m = 6.875 -> all hot;     - seed from the window (10): page A all cold
# - token-wise instead of page-wise running maximum: 7 at position 6 has gap 1 to max(8, 7) -> hot
# - global row maximum instead of the running one: 6.875 (gap 5.125 to 12) and 9.5 -> cold


def _values(generator: torch.Generator, length: int) -> torch.Tensor:
    """Integer codes 0..15 with a 0 and a 15 in every token, so a per-token INT4 group has scale 1 and zero 0."""
    v = torch.randint(0, 16, (1, 1, length, D), generator=generator).float()
    v[..., 0], v[..., 1] = 0.0, 15.0
    return v


def _keys(scores: list[float]) -> torch.Tensor:
    k = torch.zeros(1, 1, len(scores), D)
    k[0, 0, :, 0] = torch.tensor(scores)
    return k


def _closed_form(scores, values, cold):
    """softmax(scores) @ values with the listed positions read from the hi plane only (code 4 * hi + 1.5), fp64."""
    read = values.double().clone()
    for j in cold:
        read[..., j, :] = 4 * torch.div(read[..., j, :], 4, rounding_mode="floor") + 1.5
    weights = torch.softmax(torch.tensor(scores, dtype=torch.float64), -1)
    return weights @ read[0, 0]


@torch.no_grad()
@pytest.mark.parametrize("query_heads", [1, 2], ids=["MHA", "GQA2"])
@pytest.mark.parametrize("reader", ["own", "share"])
def test_v_precision_reads_the_hand_computed_cold_set(reader, query_heads):
    """LoopKV Sec. 3.3 on a case whose cold set and output are known in closed form, for an INT4 cell and for a cell
    that shares the final loop's INT4 history (it reads the source's codes with its own query, sink and window); with
    GQA the second query head reads the same KV head with half the scores, hence its own cold set."""
    layout = LoopLayout(n_core=2, num_loops=2, num_kv_heads=1, head_dim=D, name="toy")
    plan = CachePlan.from_rule(
        layout, lambda c: "share" if c.loop == 0 else "int4", sink=S, window=W, page_size=P, group_size=D
    )
    cache = LoopKVCache(layout, plan, tau=TAU)
    g = torch.Generator().manual_seed(0)
    source_keys = _keys(SOURCE_SINK + HIST_SCORES + SOURCE_WINDOW)
    share_keys = _keys(SHARE_SINK + [0.5] * len(HIST_SCORES) + SHARE_WINDOW)  # its own history is never read
    assert torch.equal(fake_quantize_keys(source_keys[:, :, S:14], 4, group_size=P), source_keys[:, :, S:14])
    values = {cell: _values(g, T) for cell in [(0, 0), (0, 1), (1, 0), (1, 1)]}
    assert torch.equal(fake_quantize_values(values[(1, 1)], 4, group_size=D), values[(1, 1)])
    keys = {(0, 0): -source_keys, (1, 0): 2 * source_keys.flip(2), (0, 1): share_keys, (1, 1): source_keys}
    zero_q = torch.zeros(1, 1, T, D)
    _forward(cache, layout, {c: (zero_q, keys[c], values[c]) for c in keys}, T)

    query = torch.zeros(1, query_heads, 1, D)
    query[:, 0, :, 0] = 1.0
    query[:, 1:, :, 0] = 0.5
    new_values = {c: _values(g, 1) for c in keys}
    new_key = torch.zeros(1, 1, 1, D)  # score 0
    outs = _forward(cache, layout, {c: (query, new_key, new_values[c]) for c in keys}, 1)

    cell = (1, 1) if reader == "own" else (0, 1)
    sink, window = (SOURCE_SINK, SOURCE_WINDOW) if reader == "own" else (SHARE_SINK, SHARE_WINDOW)
    scores = sink + HIST_SCORES + window + [0.0]
    # sink and window are the reading cell's own, the history [2, 14) the final loop's of the same layer
    read_values = torch.cat(
        [values[cell][:, :, :S], values[(1, 1)][:, :, S:14], values[cell][:, :, 14:], new_values[cell]], dim=2
    )
    expected = _closed_form(scores, read_values, COLD[reader])
    torch.testing.assert_close(outs[cell][0, 0, 0].double(), expected, atol=2e-5, rtol=1e-5)
    if query_heads == 2:
        half = _closed_form([x / 2 for x in scores], read_values, COLD_HALF[reader])
        torch.testing.assert_close(outs[cell][0, 1, 0].double(), half, atol=2e-5, rtol=1e-5)
        assert (half - _closed_form([x / 2 for x in scores], read_values, [])).abs().max() > 1e-3
    # the case separates V precision from the plain INT4 read by far more than the tolerance
    assert (expected - _closed_form(scores, read_values, [])).abs().max() > 1e-2


@torch.no_grad()
def test_v_precision_off_reads_both_planes():
    """`tau=None` is the plain INT4 reader: the same case reads every value exactly (nothing cold)."""
    layout = LoopLayout(n_core=1, num_loops=1, num_kv_heads=1, head_dim=D, name="toy")
    plan = CachePlan.uniform(layout, "int4", sink=S, window=W, page_size=P, group_size=D)
    cache = LoopKVCache(layout, plan, tau=None)
    g = torch.Generator().manual_seed(1)
    keys, values = _keys(SOURCE_SINK + HIST_SCORES + SOURCE_WINDOW), _values(g, T)
    _forward(cache, layout, {(0, 0): (torch.zeros(1, 1, T, D), keys, values)}, T)
    query = torch.zeros(1, 1, 1, D)
    query[..., 0] = 1.0
    new_value = _values(g, 1)
    out = _forward(cache, layout, {(0, 0): (query, torch.zeros(1, 1, 1, D), new_value)}, 1)[(0, 0)]
    scores = SOURCE_SINK + HIST_SCORES + SOURCE_WINDOW + [0.0]
    expected = _closed_form(scores, torch.cat([values, new_value], 2), [])
    torch.testing.assert_close(out[0, 0, 0].double(), expected, atol=2e-5, rtol=1e-5)


def test_v_precision_margin_is_tau_bits():
    """`tau` is in bits: the score margin is `tau * ln 2` (weight below 2**-tau of the row's largest)."""
    assert VPrecision(tau=14.0).margin == pytest.approx(14.0 * math.log(2.0), rel=1e-12)
    assert VPrecision(tau=1.0).margin == pytest.approx(0.6931471805599453, rel=1e-12)


# ---------------------------------------------------------------------------------------------- history boundary
# S = 2, W = 4, P = 4: H(t) = 2 + 4 * floor(max(0, t - 6) / 4), written out by hand
HAND_BOUNDARY = {6: 2, 7: 2, 9: 2, 10: 6, 11: 6, 13: 6, 14: 10, 17: 10, 18: 14, 21: 14, 22: 18}


@torch.no_grad()
@pytest.mark.parametrize("option", ["int4", "int2"])
def test_loopkv_history_boundary_moves_in_pages(option):
    """LoopKV: positions leave the BF16 window a page at a time. Keys are 0 (uniform attention, exact codes) and every
    value holds 0.3 in channel 2, which a coded history rounds to 0 (per-token group with scale 1 (INT4) or 5 (INT2)
    and zero 0), so channel 2 of the output counts the positions read exactly: `0.3 * (t + 1 - (H(t) - S)) / (t + 1)`."""
    layout = LoopLayout(n_core=1, num_loops=1, num_kv_heads=1, head_dim=D, name="toy")
    plan = CachePlan.uniform(layout, option, sink=S, window=W, page_size=P, group_size=D)
    cache = LoopKVCache(layout, plan, tau=None)
    value = torch.zeros(1, 1, 1, D)
    value[..., 1] = 15.0
    value[..., 2] = 0.3
    zeros = torch.zeros(1, 1, 1, D)
    _forward(cache, layout, {(0, 0): (zeros.expand(1, 1, 6, D), zeros.expand(1, 1, 6, D), value.expand(1, 1, 6, D))}, 6)
    for t in range(6, 23):
        out = _forward(cache, layout, {(0, 0): (zeros, zeros, value)}, 1)[(0, 0)]
        if t in HAND_BOUNDARY:
            exact = t + 1 - (HAND_BOUNDARY[t] - S)
            assert out[0, 0, 0, 2].item() == pytest.approx(0.3 * exact / (t + 1), abs=1e-6), f"t = {t}"


# ------------------------------------------------------------------------------------------------------------ RIPE
@torch.no_grad()
@pytest.mark.parametrize("window, sink", [(3, 0), (2, 2), (0, 0), (5, 1)], ids=["W3", "W2-S2", "W0", "W5-S1"])
@pytest.mark.parametrize("block", [1, 3], ids=["decode", "block3"])
def test_ripe_reads_the_deepest_plane_iff_older_than_the_window(window, sink, block):
    """RIPE Eq. 9: loop r's query at t reads plane r of position j if t - j <= W (or j < sink), else the final loop's
    plane of the same layer. Keys are 0 (uniform attention) and every cell's values are a one-hot of the cell, so the
    output is the share of positions read from each plane: own `1 - h/(t+1)`, deepest `h/(t+1)`, `h = max(0, t-W-S)`."""
    if block > window + 1:
        pytest.skip("block verification needs W >= gamma (RIPE Proposition 1)")
    layout = LoopLayout(n_core=2, num_loops=3, num_kv_heads=1, head_dim=8, name="toy")
    cache = RIPECache(layout, window=window, sink=sink)
    cells = [(loop, layer) for loop in range(3) for layer in range(2)]

    def step(length):
        zeros = torch.zeros(1, 1, length, 8)
        per_cell = {}
        for loop, layer in cells:
            v = torch.zeros(1, 1, length, 8)
            v[..., loop * 2 + layer] = 1.0
            per_cell[(loop, layer)] = (zeros, zeros, v)
        return _forward(cache, layout, per_cell, length)

    step(7)
    t0 = 7
    while t0 < 16:
        outs = step(block)
        for row in range(block):
            t = t0 + row
            deep = max(0, t - window - sink)
            for loop, layer in cells:
                expected = torch.zeros(8)
                own = 1.0 if loop == 2 else 1.0 - deep / (t + 1)
                expected[loop * 2 + layer] = own
                expected[2 * 2 + layer] += 1.0 - own
                torch.testing.assert_close(outs[(loop, layer)][0, 0, row], expected, atol=1e-6, rtol=1e-6)
        t0 += block


# --------------------------------------------------------------------------------------------------------- crop
@torch.no_grad()
def test_crop_into_the_coded_history_reads_the_codes_of_what_was_written():
    """Crop below the coded history (length 25, inside page [20, 28)): the next query reads the sink exactly, pages
    [4, 20) as their codes, [20, 25) as page [20, 28)'s codes decoded back, and itself. The answer is computed from the
    written keys and values with the codec alone."""
    layout = LoopLayout(n_core=1, num_loops=1, num_kv_heads=2, head_dim=16, name="toy")
    plan = CachePlan.uniform(layout, "int4", sink=4, window=8, page_size=8, group_size=8)
    cache = LoopKVCache(layout, plan, tau=None)
    g = torch.Generator().manual_seed(5)
    k, v = torch.randn(1, 2, 50, 16, generator=g), torch.randn(1, 2, 50, 16, generator=g)
    _forward(cache, layout, {(0, 0): (torch.zeros(1, 2, 50, 16), k, v)}, 50)
    cache.crop(-25)
    assert cache.get_seq_length() == 25
    q, k_new, v_new = (torch.randn(1, 2, 1, 16, generator=g) for _ in range(3))
    out = _forward(cache, layout, {(0, 0): (q, k_new, v_new)}, 1)[(0, 0)]
    read_k = torch.cat(
        [k[:, :, :4], fake_quantize_keys(k[:, :, 4:28], 4, group_size=8)[:, :, :21], k_new], dim=2
    ).double()
    read_v = torch.cat(
        [v[:, :, :4], fake_quantize_values(v[:, :, 4:28], 4, group_size=8)[:, :, :21], v_new], dim=2
    ).double()
    weights = torch.softmax(q.double() @ read_k.transpose(-1, -2), -1)  # softmax scale 1
    torch.testing.assert_close(out.double(), weights @ read_v, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------------------------- defaults
OURO_14B = LoopLayout(n_core=24, num_loops=4, num_kv_heads=16, head_dim=128, name="ouro")


@pytest.mark.parametrize("name", ["kivi4", "kivi2", "kivi4-share", "hand"])
def test_preset_defaults_follow_the_papers(name):
    """LoopKV serves a 32-token BF16 sink, a 256-token BF16 window, 32-token pages, value groups of 32 channels and
    tau = 14 (Sec. 2.3, 3.1, 3.3); RIPE's default window is 64 with no sink (Sec. 4 and 5.1: W = 64; sinks do
    nothing). The profiler measures with the same storage the presets serve."""
    for plan in (loopkv_preset(OURO_14B, name), LoopKVCache(OURO_14B, name).plan):
        assert (plan.sink, plan.window, plan.page_size, plan.group_size) == (32, 256, 32, 32)
    cache = LoopKVCache(OURO_14B, name)
    assert cache.v_precision is not None and cache.v_precision.tau == 14.0 and cache.v_precision.page_size == 32
    ripe = RIPECache(OURO_14B)
    assert (ripe.plan.window, ripe.plan.sink, ripe.plan.page_size) == (64, 0, 1)
    defaults = {k: p.default for k, p in inspect.signature(profile_cells).parameters.items()}
    assert (defaults["sink"], defaults["window"], defaults["page_size"], defaults["group_size"]) == (32, 256, 32, 32)


def test_final_loop_is_int4_in_every_loopkv_preset():
    """Every shared cell reads the final loop, which LoopKV keeps at INT4 (Sec. 3.2, Table 12)."""
    for name in ("kivi4", "kivi4-share", "hand"):
        plan = loopkv_preset(OURO_14B, name)
        assert {plan.option(c) for c in OURO_14B.core_cells(OURO_14B.final_loop)} == {"int4"}, name
    hand = loopkv_preset(OURO_14B, "hand")
    assert [hand.option(OURO_14B.core_cells(loop)[0]) for loop in range(4)] == ["int4", "int2", "share", "int4"]
    share = loopkv_preset(OURO_14B, "kivi4-share")
    assert [share.option(OURO_14B.core_cells(loop)[0]) for loop in range(4)] == ["int4", "int4", "share", "int4"]
