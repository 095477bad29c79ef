"""Host side of `coded_attention`: validation, dispatch (Triton on CUDA, the reference elsewhere), the launcher of
the split-history kernel and of the merge kernel.

`_coded_attention_fwd` reads every tensor of the `CellView` in place through its strides (only the last dim must have
stride 1) and never copies or decodes a cache tensor.
"""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from triton_ops._dispatch import (
    announce_once,
    check_same_device,
    launch_device,
    next_pow2,
    pdl_options,
    several_gpus,
    use_triton,
)
from triton_ops.coded_attention.reference import _check_query, reference_coded_attention

if TYPE_CHECKING:
    from triton_ops.coded_attention.view import CellView


__all__ = ["coded_attention"]

_LOG2E = 1.4426950408889634

SPLIT_COST_PAGES = 4
"""`ROW1_TUNING["vprec_waves"]`'s fixed cost of a history split, in pages (the query, the seed from the sink and the
earlier splits' page maxima, the partial and its merge): fitted to session 34's H100 sweep of V precision's decode."""

ROW1_TUNING = {
    "enabled": True, "pages": 1, "num_warps": 2, "num_stages": 1, "programs_per_sm": 8, "words": True,
    "vprec": "scores", "vprec_fill": 4, "vprec_unroll": False, "sub": 1, "sub_stages": 0, "maxnreg": None,
    "sub_auto_pages": 16, "rows_max": 16, "mma": False, "mma_rows_min": 3, "mma_vprec": True, "mma_stages": 1,
    "mma_warps": 1, "mma_programs_per_sm": 8, "vprec_lookback": False, "vprec_optimistic": True, "mma_one_wave": True,
    "row1_one_wave": False, "vprec_waves": 6, "mma_lo_ahead": False,
}  # fmt: skip
"""Launch settings of the one-row coded path (decode without GQA): history pages per loop step, warps per program,
software-pipelining depth, the programs per SM the split count aims at when the batch alone does not fill the
device, and `words`: read codes as 32-bit words with the next step's tiles loaded ahead (`kernels._codes_history_row1w`,
v4) instead of bytes (v3). v4 default: words, 1 page per step, 2 warps (fewest SASS instructions per code element for
sm_90: 4.4 against v3's 7.0 with bytes, 2 pages, 2 warps, which `{"words": False, "pages": 2}` restores; H200 sweeps
and counts: `benchmarks/notes_coded_attention.md`).

`vprec` picks how the word path runs V precision (INT4 history, one query row per KV head; see `VPREC_MODES`):
`"v4"`, `"pipe"` or `"scores"` (v5, the default: on the H200 at 80% cold, 8K / 32K, it took V precision from 58 /
190 / 352 us to 55 / 134 / 217 us at batch 1 / 8 / 16 and from 628 to 431 us at 32K x 8,
`benchmarks/results/coded_attention_h200_v5_vprec.json`); `vprec_fill`: with `"scores"`, the row blocks per SM from
which V precision keeps one split per row block, and then runs v4's loop (at 8K x 64 `pipe`'s loop took 1,068 us,
v4's 969);
`vprec_unroll`: v5's loop with two steps per iteration (key inputs loaded a step further ahead; not yet timed).

v6 (session 13, occupancy; H200 sweep in `benchmarks/notes_coded_attention.md`, v6): `sub`: steps per page (1, 2,
4; > 1 needs `pages` 1) of the word path without V precision (`kernels._codes_history_row1s`): a step reads
`PAGE // sub` tokens, so one warp holds per thread what two warps hold at one page per step; `sub_auto_pages`:
splits of at most this many pages (0: never) take `sub` 2 at one warp when `pages` is 1, `num_warps` 2 and `sub` 1
(H200, INT4: 8K x 1 / x 2 / x 4 and 32K x 1, 4-16 pages per split: 22.2 / 33.8 / 74.8 / 51.7 us against v4's 30.7 /
43.6 / 76.9 / 62.7; at 32K x 2, 31 pages per split, 127.1 against 118.1, and 5-9% slower at batch >= 8);
`sub_stages`: 0 (the next step's tiles prefetched in registers), or 2..4: that path's steps load their own tiles in a
`tl.range(num_stages=sub_stages)` loop (asynchronous copies through shared memory; `sub` 1 included); `maxnreg`:
ptxas's register cap per thread (None: Triton's default), e.g. 168 for 6 two-warp programs per SM instead of 4
(measured within 5% of v4 at batch >= 8).

v7 (session 14, on since session 15): `rows_max` (0..16; 0: off): a block of `1 < rows <= rows_max` query rows per
KV head (a verification block) runs the word loop once per (split, row) instead of the general path's 16-row blocks
(H200, INT4, 5 tokens at 8K x 8: 413 against 505 us; 2 tokens 187 against 502; slower only for 5 tokens at batch 1,
79 against 70 us; `benchmarks/results/coded_attention_h200_v7_q5.json`).

v8 (session 15): coded history of 1..16 query rows per KV head (decode, GQA, verification blocks) without V
precision read on tensor cores (`kernels._codes_history_mma`: one page per step, `tl.dot` over code words dequantized
to fp16 in registers); it replaces v4 / v7 and the general path for those calls. `mma_rows_min` (0..16; 0: off;
default 3) takes it, at one warp per program, for every call of at least that many rows per KV head; `mma` takes it
at any row count with this dict's `num_warps` / `num_stages`. H200 (bf16, graph replay, L2 flushed;
`benchmarks/results/coded_attention_h200_v8_q5.json`, `_q1.json`): a 5-token INT4 block at 8K x 1 / 8 / 16 in 38.8 /
271.5 / 479.3 us at one warp, against v7's 78.5 / 413.1 / 803.8 (32K: 95.6 / 971.1 / 1736.2 against 234.1 / 1575.8 /
3147.8); v7's 2-token block (30.5 / 187.1 / 361.7 us) is faster than v8's cost, which hardly depends on the rows,
hence 4 until session 38: LoopKV's 3-token verification blocks (self-speculation at gamma 2, Ouro-1.4B's shape,
1,024-1,280 cached, static, batch 8, H100) cost 1.01 sequential steps on v8 against 1.20 on v7
(`benchmarks/results/selfspec_h100_graph_s38_loopkv_mma3.json`), so 3; decode (one row) 32.5 / 267.5 / 472.8 us
against v4 / v6's 22.1 / 117.7 / 197.1, so decode keeps those.
Offline sm_90 SASS: 5.5 instructions per code element at 2 warps (v4: 4.4), 1.1 per element per row for a 5-row
block (the general path 3.2; `benchmarks/notes_coded_attention.md`, v8).

v9 (session 16; `benchmarks/notes_coded_attention.md`, v9; H200 at 8K x 1 / 8 / 16, 5 tokens,
`benchmarks/results/coded_attention_h200_v9_q5.json`): `mma_vprec` (default True) runs V precision on v8 too
(`kernels._codes_history_mma`: the `hi` plane for every token, `lo` dots only where a row reads the token hot; v8's
own page-maxima pass): 76.6 / 538.1 / 956.0 us against v7's 130.3 / 636.9 / 986.2 (80% cold); False restores v7 for
those calls. `mma_stages` (1..4, default 1): v8's page loop as `tl.range(num_stages=...)` (within 2% of 1: 316.5 /
544.4 at 2 against 322.4 / 558.4 at 8K x 8 / 16); `mma_warps` (1, 2, 4; default 1): the warps of the default v8
launch (2 warps with stages 3: 277.9 / 485.1 at 8 / 16 but 55.0 against 40.2 at batch 1); `mma_programs_per_sm`
(default 8): the split count v8 aims at (7, one wave of programs: slower, 340.8 / 670.0).

`vprec_lookback` (session 28, default False: timed on the H200 in session 31, 9% faster at 8K x 1 with 5 queries,
level to 12% slower from batch 8 on, level with two launches for 5-token blocks at 1,280 x 8: README, "V precision in one
launch"): V
precision over a split history in one launch instead of two. Every split but the last computes its pages' maxima
first and publishes them (a flag per split, release), then waits for the earlier splits' flags (acquire) and runs
the value pass seeded with their maxima; a program takes its (split, row, row block) from a ticket drawn as it
starts, so a split waits only on splits already running (no deadlock whatever order the GPU starts programs in).
Its own pages' key codes are read twice, the second time soon after the first (from L2 where they still fit), and
the last split skips the first pass (but with v5's `scores`, whose value pass reads the scores the first pass
stores). It applies to v9 (`mma_vprec`) and to the one-row word loops (v4, v5's modes); v7's per-row programs keep
two launches. One zeroed int32 buffer per call (a memset). Where it applies it goes first: `vprec_optimistic` is then
not used.

`vprec_optimistic` (session 32, default True; v9, and v4's one-row loop when `vprec` is "v4"): V precision over a
split history without the page-maxima pass. The first launch runs every split's value pass seeded with the sink's
maximum alone (the earlier splits' maxima unknown), storing its page maxima and each row's lowest score it read hot;
the second starts the history programs again, and each computes its split's true running maximum from the earlier
splits' stored maxima and reruns the split only if that maximum turns a token it read hot cold (some row's lowest
hot score below the maximum less tau); otherwise its partial and counts stand. Exact (same cold set, output and
counts as the two-launch path: a larger maximum only turns hot tokens cold). Where the sink's score leads the
history's, as in trained models, nothing reruns and the key codes are read once. Where it runs, V precision splits
the history as plain INT4 does. H100 (torch 2.11.0+cu130, Triton 3.6.0, bf16, 80% cold, graph replay, L2 flushed):
a 5-token block at 1,280 x 8 in 97.0 us against 109.5 with the page-maxima pass; at 8K x 1 / 8 / 16 / 64, 63.9 /
381.5 / 642.3 / 2,159.4 against 72.8 / 481.7 / 844.6 / 2,702.2; plain INT4 35.7 / 243.0 / 417.7 / 1,478.3. v4's
one-row loop with it against v5's `scores` (the one-row default, left as it is): 59.0 against 52.3 us at 1,280 x 8,
46.4 / 149.1 / 248.7 / 879.5 against 45.9 / 144.1 / 236.3 / 968.6 at 8K x 1 / 8 / 16 / 64
(`benchmarks/results/coded_attention_h100_s32_optimistic_*.json`).

`mma_one_wave` (session 33, default True): v9's split count keeps the history and tail programs of a call in one
wave. Its programs hold 255 registers at one warp, so an SM runs `mma_programs_per_sm` (8) of them at once; the
plain rule fills every slot with history programs and the tail programs then push whole splits into a second wave
(Nsight Compute, H200, a 5-token INT4 block at 1,280 x 8: grid 13 x 128 for 1,056 slots, 1.58 waves, 10% of the
warp slots occupied). With it on the launcher takes the most splits, at most the plain rule's, whose history and
tail programs fit in `mma_programs_per_sm` per SM, where any do (batch 64 at 8K: none; the plain count stands).
`num_splits` given, it does nothing. `row1_one_wave` (default False) applies the same rule to the one-row word
loops (decode without GQA; not v7's per-row programs) at `programs_per_sm` per SM: Nsight Compute found v6's
one-warp decode programs at 1.58 waves and v5's value pass at 2.10 at 1,280 x 8 (the SM runs 8 and 6 of them).
Timed in session 34 (H100, `coded_attention_h100_s34_q1_row1_one_wave_ab.json`): mixed by shape (INT4 -11% at
1,280 x 8 and 8K x 8, +4% at 8K x 16; V precision at 6 per SM -13% / -21% / -13% at 1,280 x 8, 8K x 1, 8K x 8, +9%
at 8K x 16), so it stays off. `vprec_waves` (session 34; default 6 since session 35, 0: off) picks V precision's
one-row decode split count (v5's score and value passes) from a cost model instead, `ceil(waves) * (pages per split
+ SPLIT_COST_PAGES)` with the value pass at that many programs per SM (6: 168 registers at 2 warps), over 1 .. the
plain count (`_vprec_waves_split`): on the H100's timed shapes it picks the fastest count at each (1,280 x 8: 4, 8K
x 1: 42, 8K x 8: 5, 8K x 16: 5, the plain one, where the one-wave count at 6 was 9% slower). Timed in session 35
(H100, `coded_attention_h100_s35_q1_vprec_waves_ab.json`): 46.1 -> 35.9 / 143.8 -> 124.3 / 234.4 -> 233.1 us at 8K
x 1 / 8 / 16; in the model LoopKV's 2-loop drafts 0.567 -> 0.522 of a step at batch 1.
`mma_lo_ahead` (session 34, default False): v9's V-precision value pass loads every token's `lo` words with its `hi`
words instead of after the page's hot set is known (`kernels._codes_history_mma`): the same dots and results, one
dependent global load less per page on a latency-bound program's path, at the price of reading the cold tokens'
`lo` bytes (what plain INT4 reads). Timed in session 35 (H100, a 5-token block at 1,280 x 8: 87.4 us off, 88.6 on,
`coded_attention_h100_s35_q5_lo_ahead_ab.json`): no gain, so it stays off. H100 sweep of the split count (programs
per SM 8 / 6 / 4, the fitting count in bold): 5 tokens at 1,280 x 8, INT4 54.6 / 59.7 / **46.1** us, V precision
96.7 / 89.2 / **87.0**; at 8K x 8, INT4 241.6 / **168.1** / 207.4, V precision 380.9 / **267.1** / 325.2
(`benchmarks/results/coded_attention_h100_s33_*`)."""

VPREC_MODES = ("v4", "pipe", "scores")
"""V precision on the word path: `v4`: the `lo` plane of a step is loaded after that step's scores (its latency
exposed), one split per row block once the batch fills the SMs, else a page-maxima pass over the key codes before
the value pass (K read twice); `pipe` (v5): the same launches with the loop software-pipelined (a step's scores and
hot set one step ahead of its value sums, so `lo` is loaded a step ahead, `kernels._codes_history_row1p`);
`scores` (v5): below `vprec_fill` row blocks per SM, the split count of plain INT4, the first pass writes every
token's score (fp32) with the page maxima and the value pass reads those scores instead of the key codes (`pipe`'s
loop without key work); from `vprec_fill` row blocks per SM on, or with a single split, it runs `pipe`. Every mode
gives the reference's cold set and output."""

TAIL_BLOCK = 32
"""Positions per loop step of the dense tail (sink, window, new tokens)."""

TAIL_MIN = 64
"""Fewest window slots a tail program reads when the launcher spreads the window (`tuning["tail_min"]` overrides it,
`tuning["tail_chunk"]` sets the slots per tail program outright)."""

TAIL_TUNING = {"final_slots": 128, "final_block": TAIL_BLOCK}
"""The one-launch read (`FINAL`): a call with no history pages to split (a shared cell whose history is read
elsewhere and merged in as `prior`, RIPE's and the deepest plane's one-token step; a cell that holds no history yet)
and at most `final_slots` window slots runs one tail program per (batch row, KV head, row block) that reads the sink,
the window and the new tokens, merges the prior and writes `out` and `lse` itself: no partial buffers and no merge
launch (0: never). `final_block`: its positions per loop step (a power of two in 16..128). `tuning` overrides
either."""

DENSE_TUNING = {"tile": 32, "num_warps": 4, "num_stages": 3, "programs_per_sm": 2}
"""Launch settings of the dense (fp16 / bf16) history path (a static dense cell's kernel read, RIPE's borrowed
deepest plane): history positions per loop step (a power of two >= 16), warps per program, software-pipelining depth,
and the programs per SM the split count aims at. `tuning={"dense": {...}}` overrides them (benchmarks)."""


def _share(n_pages: int, ns: int, step: int) -> tuple[int, int]:
    """(splits, pages per split) when `n_pages` pages are shared out among `ns` splits of whole `step`-page steps."""
    pps = -(-n_pages // ns)
    pps = -(-pps // step) * step
    return -(-n_pages // pps), pps


def _host_tail_chunk(pps: int, page: int, tail_min: int, tail_opt: int | None) -> int:
    """Window slots per tail program when the host sizes them: `tuning["tail_chunk"]` if given, else half a split's
    positions in whole `TAIL_BLOCK`s, at least `tail_min` (the rule at its call in `_coded_attention_fwd`)."""
    if tail_opt is not None:
        return tail_opt
    return max(tail_min, -(-max(pps, 1) * page // (2 * TAIL_BLOCK)) * TAIL_BLOCK)


@functools.lru_cache(maxsize=4096)
def _vprec_waves_split(
    n_pages: int, ns: int, step: int, base: int, slots: int, w_len: int, page: int, tail_min: int, tail_opt: int | None
) -> tuple[int, int]:
    """`ROW1_TUNING["vprec_waves"]`: (splits, pages per split) of V precision's one-row decode, the smallest
    `ceil(waves) * (pages per split + SPLIT_COST_PAGES)` over 1 .. `ns` splits (ties: more splits), where waves count
    the history and host-sized tail programs of `base` row blocks against `slots` value-pass programs on the device
    (168 registers at 2 warps: 6 per SM on an H100 or H200). It reproduces the fastest of the counts timed on the H100
    at 1,280 x 8 and 8K x 1 / 8 / 16 / 64 (`benchmarks/notes_coded_attention.md`, session 34). Cached: a decode step
    plans the same shapes for every cell (eager callers plan on the host every call; up to `ns` candidates)."""

    def cost(cand: int) -> tuple[int, int, int, int]:
        ns_c, pps_c = _share(n_pages, cand, step)
        tail = max(1, -(-w_len // _host_tail_chunk(pps_c, page, tail_min, tail_opt)))
        return -(-(ns_c + tail) * base // slots) * (pps_c + SPLIT_COST_PAGES), -ns_c, ns_c, pps_c

    _, _, ns_best, pps_best = min(cost(cand) for cand in range(ns, 0, -1))
    return ns_best, pps_best


@functools.cache
def tuning_value(raw: str) -> object:
    """A `ROW1_TUNING` value written on a command line (`KEY=VALUE`): `none`, `true` / `false`, an int, else the
    string (a mode such as `scores`). The benchmarks' `--configs` and `--row1-tuning` both read values this way."""
    low = raw.lower()
    if low == "none":
        return None
    if low in ("true", "false"):
        return low == "true"
    return int(raw) if raw.lstrip("-").isdigit() else raw


def _num_sms(device: torch.device) -> int:
    """The SMs the split counts aim at: the GPU's, or 4 elsewhere (the interpreter; tests pin other counts here)."""
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device.index or 0).multi_processor_count


def _strides(t: Tensor | None, n: int = 3) -> list[int]:
    return list(t.stride()[:n]) if t is not None else [0] * n


def _word_aligned(*codes: Tensor | None) -> bool:
    """Whether the code tensors (None: absent, e.g. INT2's `lo`) can be read as 32-bit words: 4-byte aligned at their
    start and in every stride but the last (v4's word path and v8)."""
    return all(
        t.data_ptr() % 4 == 0 and all(st % 4 == 0 for st in t.stride()[:-1]) for t in codes if t is not None
    )


def _coded_attention_fwd(
    query: Tensor,
    view: CellView,
    *,
    scaling: float,
    v_precision_tau: float | None,
    v_precision_stats: Tensor | None = None,
    num_splits: int | None = None,
    tuning: dict | None = None,
    prior: tuple[Tensor, Tensor] | None = None,
) -> tuple[Tensor, Tensor]:
    """Launch the split-history kernel (after the page-maxima pass when V precision needs it across splits) and the
    merge; returns `(out [B, H_q, Q, D], lse [B, H_q, Q] fp32)`. `num_splits` forces the number of history splits
    (tests); by default it follows the device's SM count. `tuning` overrides `ROW1_TUNING` (benchmarks), and
    `tuning["tail_chunk"]` the window slots per tail program (by default about a history split's positions). No host
    sync, no copy of any view tensor."""
    from triton_ops.coded_attention.kernels import _coded_attention_fwd_kernel, _coded_attention_merge_kernel

    b, hq, q_len, d = query.shape
    new_k, new_v = view.new_key, view.new_value
    hkv = view.num_kv_heads
    groups = hq // hkv
    rows = groups * q_len
    block_r = max(16, min(64, next_pow2(rows)))
    n_rblocks = -(-rows // block_r)
    dev = query.device
    dummy = new_k
    dense = {**DENSE_TUNING, **(tuning or {}).get("dense", {})}
    static = view.device_lengths  # a static cache's step: lengths on the device, shapes fixed
    s_len = view.sink_length
    sk, sv = (view.sink_key, view.sink_value) if s_len else (dummy, dummy)
    w_len = view.ring_capacity if static else view.length - view.window_start
    # the window positions the tail programs are planned for: a ring's reach where the view gives one (they loop
    # over the rest of the ring where a row's stretch is longer, `kernels._coded_attention_fwd_kernel`)
    w_plan = w_len if view.window_reach is None else min(w_len, view.window_reach)  # (a ring's: the view checks)
    wk, wv = (view.window_key, view.window_value) if w_len else (dummy, dummy)
    hk_, hv_ = view.history_key, view.history_value
    fmt = view.history_nbits or 0
    if fmt:
        page, vgroup = hk_.group_size, hv_.group_size
        hk, hks, hkz = hk_.codes, hk_.scale, hk_.zero
        hv, hvl, hvs, hvz = hv_.hi, hv_.lo, hv_.scale, hv_.zero
    else:
        page = vgroup = dense["tile"]
        hk, hks, hkz = (hk_, None, None) if hk_ is not None else (dummy, None, None)
        hv, hvl, hvs, hvz = (hv_, None, None, None) if hv_ is not None else (dummy, None, None, None)
    # history positions any query may read: [S, min(S + T_hist, length))
    # (static: every preallocated page; the kernel shares the pages the device-side bounds reach among the splits)
    if static:
        hist_tokens = view.history_length
    else:
        hist_tokens = max(0, min(view.history_length, view.length - view.history_start))
    n_pages = -(-hist_tokens // page)
    base = b * hkv * n_rblocks
    use_vprec = v_precision_tau is not None and fmt == 4
    count = use_vprec and v_precision_stats is not None
    tune = {**ROW1_TUNING, **(tuning or {})}
    dp = next_pow2(d)  # the kernels' tile width: a head dim that is no power of two is read zero-padded
    # one query row per KV head and power-of-two value groups: the elementwise path (kernels._codes_history_row1;
    # a head dim that is no power of two, e.g. 96 = 3 groups of 32, reads its groups padded to dp / vgroup = 4)
    n_groups = dp // vgroup if fmt else 0
    rows_max = tune.get("rows_max", 0)
    if isinstance(rows_max, bool) or not isinstance(rows_max, int) or not 0 <= rows_max <= 16:
        raise ValueError(f"`tuning['rows_max']` must be an int in [0, 16] (0: off), got {rows_max!r}")
    mma = tune.get("mma", False)
    if mma not in (0, 1) or not isinstance(mma, (bool, int)):
        raise ValueError(f"`tuning['mma']` must be a bool (or 0 / 1), got {mma!r}")
    mma_rows_min = tune.get("mma_rows_min", 0)
    if isinstance(mma_rows_min, bool) or not isinstance(mma_rows_min, int) or not 0 <= mma_rows_min <= 16:
        raise ValueError(f"`tuning['mma_rows_min']` must be an int in [0, 16] (0: off), got {mma_rows_min!r}")
    # v8 by default from `mma_rows_min` rows per KV head on (at one warp: the H200's fastest v8 setting); `mma`
    # asks for it at any row count with the configured warps
    mma_vprec = tune.get("mma_vprec", False)
    if mma_vprec not in (0, 1) or not isinstance(mma_vprec, (bool, int)):
        raise ValueError(f"`tuning['mma_vprec']` must be a bool (or 0 / 1), got {mma_vprec!r}")
    mma_stages = tune.get("mma_stages", 1)
    if isinstance(mma_stages, bool) or not isinstance(mma_stages, int) or mma_stages not in (1, 2, 3, 4):
        raise ValueError(f"`tuning['mma_stages']` must be 1, 2, 3 or 4, got {mma_stages!r}")
    mma_warps = tune.get("mma_warps", 1)
    if isinstance(mma_warps, bool) or not isinstance(mma_warps, int) or mma_warps not in (1, 2, 4):
        raise ValueError(f"`tuning['mma_warps']` must be 1, 2 or 4, got {mma_warps!r}")
    mma_per_sm = tune.get("mma_programs_per_sm", tune["programs_per_sm"])
    if isinstance(mma_per_sm, bool) or not isinstance(mma_per_sm, int) or not 1 <= mma_per_sm <= 32:
        raise ValueError(f"`tuning['mma_programs_per_sm']` must be an int in [1, 32], got {mma_per_sm!r}")
    mma_auto = not mma and 0 < mma_rows_min <= rows
    mma = mma or mma_auto
    # v8: 1..16 rows per KV head over coded history on tensor cores (value groups and the groups per padded head dim
    # powers of two: the value words are read as a [page, groups, group / 16] tile); V precision with `mma_vprec` (v9)
    mma = bool(mma) and bool(fmt) and rows <= 16 and (not use_vprec or bool(mma_vprec)) and not vgroup & (vgroup - 1)
    mma = mma and dp % vgroup == 0 and not (dp // vgroup) & (dp // vgroup - 1) and bool(tune["enabled"])
    mma = mma and vgroup % 16 == 0 and _word_aligned(hk, hv, hvl)  # v8 reads codes as 32-bit words too
    rows_max = 0 if mma else rows_max
    # v7: a verification block of 1 < rows <= `rows_max` query rows per KV head runs the word path once per row
    # (`rowx`: the history programs are (split, row) pairs; V precision in v4's loop); the general path otherwise
    rowx = 1 < rows <= rows_max and bool(tune.get("words"))
    row1 = bool(fmt) and (rows == 1 or rowx) and n_groups > 0 and d % vgroup == 0 and not n_groups & (n_groups - 1)
    row1 = row1 and not (vgroup // 4) & (vgroup // 4 - 1) and bool(tune["enabled"]) and not mma
    # v4: codes read as 32-bit words (value groups of 16k channels; every code tensor 4-byte aligned in all dims)
    words = row1 and bool(tune.get("words")) and vgroup % 16 == 0 and not (vgroup // 16) & (vgroup // 16 - 1)
    words = words and _word_aligned(hk, hv, hvl)
    rowx = rowx and words
    row1 = row1 and (rows == 1 or rowx)  # rows > 1 without the word path: the general path
    base_h = b * hkv * rows if rowx else base  # history programs per split
    vmode = tune.get("vprec", "v4")
    if vmode not in VPREC_MODES:
        raise ValueError(f"`tuning['vprec']` must be one of {VPREC_MODES}, got {vmode!r}")
    lookback = tune.get("vprec_lookback", False)
    if lookback not in (0, 1) or not isinstance(lookback, (bool, int)):
        raise ValueError(f"`tuning['vprec_lookback']` must be a bool (or 0 / 1), got {lookback!r}")
    optimistic = tune.get("vprec_optimistic", False)
    if optimistic not in (0, 1) or not isinstance(optimistic, (bool, int)):
        raise ValueError(f"`tuning['vprec_optimistic']` must be a bool (or 0 / 1), got {optimistic!r}")
    lookback = bool(lookback) and use_vprec and (mma or (words and not rowx))  # v9, or the one-row word loops
    # the optimistic pass extends v9's loop and v4's one-row loop (`vprec` "v4"); `vprec_lookback` goes first.
    # Where it runs, V precision splits the history as plain INT4 does
    optimistic = bool(optimistic) and use_vprec and (mma or (words and not rowx and vmode == "v4")) and not lookback
    vpipe = use_vprec and words and vmode in ("pipe", "scores") and not rowx  # v5 reads one row per KV head
    sub = tune.get("sub", 1)
    if sub not in (1, 2, 4) or (sub > 1 and tune["pages"] != 1):
        raise ValueError(f"`tuning['sub']` must be 1, 2 or 4 (more than 1 with `tuning['pages']` 1), got {sub!r}")
    sub_stages = tune.get("sub_stages", 0)
    if sub_stages not in (0, 2, 3, 4):
        raise ValueError(f"`tuning['sub_stages']` must be 0, 2, 3 or 4, got {sub_stages!r}")
    maxnreg = tune.get("maxnreg")
    if maxnreg is not None and (not isinstance(maxnreg, int) or not 24 <= maxnreg <= 255):
        raise ValueError(f"`tuning['maxnreg']` must be None or an int in [24, 255], got {maxnreg!r}")
    step = tune["pages"] if row1 else 1  # pages per loop step: a split holds whole steps where it can
    if vpipe and tune.get("vprec_unroll"):
        step *= 2  # two steps per iteration (`kernels._codes_history_row1p`, VUNROLL)
    sms = _num_sms(dev)
    per_sm = tune["programs_per_sm"] if row1 else mma_per_sm if mma else (4 if fmt else dense["programs_per_sm"])
    if n_pages == 0:
        ns = 0
    elif num_splits is not None:
        ns = min(num_splits, n_pages)
    else:
        # V precision: one split per row block keeps the running maximum exact without a first pass over K; v5's
        # score pass splits whenever the row blocks alone leave SMs short of `vprec_fill` programs each
        fill = tune.get("vprec_fill", 4) if vpipe and vmode == "scores" else 1
        if mma:  # v9: v8's split count unless the row blocks alone fill the SMs at its programs per SM
            fill = per_sm
        if use_vprec and base_h >= fill * sms and not optimistic:
            ns = 1
        else:
            ns = max(1, min(-(-n_pages // step), -(-per_sm * sms // base_h)))

    def share(ns: int) -> tuple[int, int]:
        return _share(n_pages, ns, step if num_splits is None else 1)

    ns, pps = share(ns) if ns else (0, 0)
    tail_min = tune.get("tail_min", TAIL_MIN)
    if isinstance(tail_min, bool) or not isinstance(tail_min, int) or tail_min < 1:
        raise ValueError(f"`tuning['tail_min']` must be a positive int, got {tail_min!r}")
    tail_opt = tune.get("tail_chunk") or None
    if tail_opt is not None and (isinstance(tail_opt, bool) or not isinstance(tail_opt, int) or tail_opt < 1):
        raise ValueError(f"`tuning['tail_chunk']` must be a positive int or None, got {tail_opt!r}")

    for key in ("mma_one_wave", "row1_one_wave", "mma_lo_ahead"):
        if tune[key] not in (0, 1) or not isinstance(tune[key], (bool, int)):
            raise ValueError(f"`tuning['{key}']` must be a bool (or 0 / 1), got {tune[key]!r}")
    # the split count below: v9's by default; the one-row loops' (not v7's per-row programs) only if asked
    one_wave = bool(tune["mma_one_wave"]) if mma else bool(tune["row1_one_wave"]) and row1 and not rowx
    one_wave = one_wave and num_splits is None and ns > 1
    per_vp = tune["vprec_waves"]
    if isinstance(per_vp, bool) or not isinstance(per_vp, int) or per_vp < 0:
        raise ValueError(f"`tuning['vprec_waves']` must be a non-negative int (0: off), got {per_vp!r}")
    vp_waves = bool(per_vp) and vpipe and vmode == "scores" and num_splits is None and ns > 1 and not one_wave

    def tail_plan(n_hist: int, pps: int, read_prefix: bool) -> tuple[int, bool, int]:
        """(window slots per tail program, whether the kernel sizes them from the live pages, tail programs) for
        `n_hist` history programs per row block of `pps` pages each (the rule in the comment below)."""
        grid_dev = (n_hist + -(-w_plan // tail_min)) * b * hkv * n_rblocks
        dev_sized = static and tail_opt is None and grid_dev <= 2 * per_sm * sms
        dev_sized = dev_sized and not (mma and read_prefix) and not one_wave and not vp_waves
        chunk = tail_min if dev_sized and tail_opt is None else _host_tail_chunk(pps, page, tail_min, tail_opt)
        return chunk, dev_sized, max(1, -(-w_plan // chunk))

    if one_wave:
        # v9 (session 33): one wave. A program holds 255 registers, so `mma_programs_per_sm` (8) is also what an SM
        # runs at once; the split count above fills those slots with history programs alone, and the tail programs
        # then push whole splits into a second wave (H200, INT4, 5 tokens at 1,280 x 8: grid 13 x 128 for 1,056
        # slots, 1.58 waves). Take the most splits whose history and tail programs fit in one wave, where some do
        # (a static view's tail is then sized on the host: the device-sized one starts a program per `tail_min`
        # slots of the ring, which is what takes the slots). `row1_one_wave` asks the same of the one-row loops at
        # `programs_per_sm` (session 33, off: not timed yet)
        slots = per_sm * sms
        for cand in range(ns, 0, -1):
            ns_c, pps_c = share(cand)
            if (ns_c + tail_plan(ns_c, pps_c, use_vprec and ns_c > 1)[2]) * base <= slots:
                ns, pps = ns_c, pps_c
                break
    if vp_waves:
        # v5 (session 34; default since session 35): the split count of V precision's one-row score and value
        # passes from a cost model (`_vprec_waves_split`). A static view's tail is sized on the host then, as with the
        # one-wave rules
        ns, pps = _vprec_waves_split(n_pages, ns, step, base, per_vp * sms, w_plan, page, tail_min, tail_opt)
    num_warps = tune["num_warps"]
    # v6: short splits (<= 16 pages: batch 1-4 at 8K, batch 1 at 32K) run in half-page steps at one warp per program,
    # twice the programs per SM at the same registers (H200, INT4, 8K x 1: 22.2 us against 30.7, 32K x 1: 51.7 against
    # 62.7; 5-9% slower where splits hold ~30 pages: benchmarks/notes_coded_attention.md, v6)
    auto = tune.get("sub_auto_pages", 0)
    v6 = words and not use_vprec and not d & (d - 1)  # `_codes_history_row1s` reads power-of-two head dims only
    if v6 and sub == 1 and tune["pages"] == 1 and num_warps == 2 and 0 < pps <= auto:
        sub, num_warps = 2, 1
    read_prefix = use_vprec and ns > 1
    lookback = lookback and read_prefix  # one split: one pass already
    optimistic = optimistic and read_prefix
    if vpipe and vmode == "scores" and not read_prefix:
        vpipe = False  # one split per row block: v4's loop (H200, 8K x 64: 969 us against the pipelined 1,068)
    scores = read_prefix and vpipe and vmode == "scores"  # v5: the first pass also writes every token's score
    # the window's slots per tail program: half a split's positions, at least `TAIL_MIN`, so that a long window
    # (LoopKV's 256 + a ring page) is not the one program every other one waits for when the history is split finely
    # (H200, INT4 at 8K, the ring of 319 slots: batch 1 42.9 us in one tail program, 33.9 over a split's positions
    # (3 programs), 30.4 over 64-slot ones; batch 2 50.4 / 45.5; batch >= 8 one program either way)
    # A static cell's captured step (session 19) knows the pages its splits share out only on the device: it starts
    # the tail programs of `tail_min`-slot chunks, and the kernel sizes the chunks by the same rule from the live pages
    # (those past the ring exit at once), while the grid stays within twice the programs per SM the splits aim at
    # (beyond, the idle tail programs push split programs into a second wave: H200, INT4 decode at 4K of 8K
    # preallocated x 16, 140.3 us against 113.4 with the chunk from every preallocated page) and not for v9's two
    # launches (V precision on v8: 3-4% slower at batch 8; README.md's kernel section has the rows)
    n_hist = ns * rows if rowx else ns  # v7: a history program per (split, row), split-major (`ROWX`)
    tail, tail_dev, nt = tail_plan(n_hist, pps, read_prefix)
    final_slots = tune.get("final_slots", TAIL_TUNING["final_slots"])
    if isinstance(final_slots, bool) or not isinstance(final_slots, int) or final_slots < 0:
        raise ValueError(f"`tuning['final_slots']` must be a non-negative int (0: never), got {final_slots!r}")
    final_block = tune.get("final_block", TAIL_TUNING["final_block"])
    if final_block not in (16, 32, 64, 128) or isinstance(final_block, bool):
        raise ValueError(f"`tuning['final_block']` must be 16, 32, 64 or 128, got {final_block!r}")
    # no history split and a short window: one tail program per row block, whose part is the output (`TAIL_TUNING`)
    final = ns == 0 and w_plan <= final_slots
    if final:
        tail, tail_dev, nt = max(w_plan, final_block), False, 1
    bound = view.history_end
    key_valid = view.key_valid
    if final:  # the kernel writes the output: contiguous, so that a row's flat index is its partial's
        out = o_part = torch.empty(b, hq, q_len, d, dtype=query.dtype, device=dev)
        lse = lse_part = torch.empty(b, hq, q_len, dtype=torch.float32, device=dev)
    else:
        o_part = torch.empty(ns + nt, b * hkv, rows, dp, dtype=torch.float32, device=dev)
        lse_part = torch.empty(ns + nt, b * hkv, rows, dtype=torch.float32, device=dev)
    pmax = torch.empty(b * hkv, rows, max(n_pages, 1), dtype=torch.float32, device=dev) if read_prefix else lse_part
    sc = torch.empty(b * hkv, n_pages * page, dtype=torch.float32, device=dev) if scores else lse_part
    valid = key_valid if key_valid is not None else bound
    slots = rows if rowx else n_rblocks  # V-precision count slots per (split, b * h_kv)
    count = count and not final  # no history: nothing to count
    stats_part = torch.zeros(max(ns, 1) * b * hkv * slots, 2, dtype=torch.int32, device=dev) if count else lse_part
    # the ticket, then a flag per (row block, b * h_kv, split)
    flags = torch.zeros(1 + ns * b * hkv * n_rblocks, dtype=torch.int32, device=dev) if lookback else None
    hmin = torch.empty(ns, b * hkv, rows, dtype=torch.float32, device=dev) if optimistic else None

    def args(page_max_only: bool, opt: int = 0) -> dict:
        return dict(
            q_ptr=query,
            o_ptr=o_part,
            lse_ptr=lse_part,
            pmax_ptr=pmax,
            sc_ptr=sc,
            bound_ptr=bound,
            valid_ptr=valid,
            len_ptr=view.length if static else bound,
            sk_ptr=sk,
            sv_ptr=sv,
            wk_ptr=wk,
            wv_ptr=wv,
            nk_ptr=new_k,
            nv_ptr=new_v,
            hk_ptr=hk,
            hks_ptr=hks if hks is not None else hk,
            hkz_ptr=hkz if hkz is not None else hk,
            hv_ptr=hv,
            hvl_ptr=hvl if hvl is not None else hv,
            hvs_ptr=hvs if hvs is not None else hv,
            hvz_ptr=hvz if hvz is not None else hv,
            stats_ptr=stats_part,
            stride_qb=query.stride(0),
            stride_qh=query.stride(1),
            stride_qq=query.stride(2),
            stride_bb=bound.stride(0),
            stride_bq=bound.stride(1),
            stride_validb=key_valid.stride(0) if key_valid is not None else 0,
            stride_validt=key_valid.stride(1) if key_valid is not None else 0,
            **dict(zip(("stride_skb", "stride_skh", "stride_skt"), _strides(sk if s_len else None))),
            **dict(zip(("stride_svb", "stride_svh", "stride_svt"), _strides(sv if s_len else None))),
            **dict(zip(("stride_wkb", "stride_wkh", "stride_wkt"), _strides(wk if w_len else None))),
            **dict(zip(("stride_wvb", "stride_wvh", "stride_wvt"), _strides(wv if w_len else None))),
            **dict(zip(("stride_nkb", "stride_nkh", "stride_nkt"), _strides(new_k))),
            **dict(zip(("stride_nvb", "stride_nvh", "stride_nvt"), _strides(new_v))),
            **dict(zip(("stride_hkb", "stride_hkh", "stride_hkt"), _strides(hk))),
            **dict(zip(("stride_hksb", "stride_hksh", "stride_hksp"), _strides(hks))),
            **dict(zip(("stride_hvb", "stride_hvh", "stride_hvt"), _strides(hv))),
            **dict(zip(("stride_hvsb", "stride_hvsh", "stride_hvst"), _strides(hvs))),
            H_KV=hkv,
            G=groups,
            Q=q_len,
            S=s_len,
            W=w_len,
            w_start=0 if static else view.window_start,
            n_start=0 if static else view.length,
            hist_start=view.history_start,
            n_pages=n_pages,
            pages_per_split=max(pps, 1),
            NS=ns,
            tail_chunk=tail,
            tail_min=tail_min,
            tail_programs=nt,
            qk_scale=scaling * _LOG2E,
            margin=(v_precision_tau or 0.0),  # tau * ln 2 in natural units is tau in log2 units
            D=dp,
            DH=d,
            PAGE=page,
            VGROUP=vgroup,
            KV_FMT=fmt,
            BLOCK_R=block_r,
            BLOCK_T=final_block if final else TAIL_BLOCK,
            BLOCK_PM=64,
            USE_VALID=key_valid is not None,
            USE_VPREC=use_vprec,
            COUNT=count,
            READ_PREFIX=read_prefix and opt != 1,
            PAGE_MAX_ONLY=page_max_only,
            IEEE=query.dtype == torch.float32,
            ROW1=row1,
            NP=tune["pages"],
            WORDS=words,
            DEV_LEN=static,
            TAIL_DEV=tail_dev,
            VPIPE=vpipe,
            SCORES=scores,
            VUNROLL=vpipe and bool(tune.get("vprec_unroll")) and not page_max_only,
            SUB=sub if v6 else 1,
            SUB_STAGES=sub_stages if v6 else 0,
            ROWX=rowx,
            MMA=mma,
            MMA_STAGES=mma_stages if mma else 1,
            FINAL=final,
            **(_prior_args(prior) if final else {}),
            **({"lb_ptr": flags, "LOOKBACK": True} if lookback else {}),
            **({"hmin_ptr": hmin, "OPT": opt} if opt else {}),
            **({"LO_AHEAD": True} if mma and use_vprec and tune["mma_lo_ahead"] and not page_max_only else {}),
        )

    if row1 or mma:
        launch = {"num_warps": mma_warps if mma_auto and mma else num_warps, "num_stages": tune["num_stages"]}
        if maxnreg is not None:
            launch["maxnreg"] = maxnreg  # v6: more programs per SM by registers (`ROW1_TUNING`)
    elif not fmt:
        launch = {"num_warps": dense["num_warps"], "num_stages": dense["num_stages"]}
    else:
        launch = {}
    # v7: `ns * rows` history programs (split-major, the rows of a split adjacent: they read the same codes)
    pdl = pdl_options(query)
    if optimistic:
        # V precision, optimistic: every split's value pass seeded with the sink's maximum alone (and the tail),
        # then a launch that reruns only the splits whose hot set the earlier splits' page maxima change
        _coded_attention_fwd_kernel[(n_hist + nt, b * hkv, n_rblocks)](**args(False, 1), **pdl, **launch)
        _coded_attention_fwd_kernel[(n_hist, b * hkv, n_rblocks)](**args(False, 2), **pdl, **launch)
    else:
        if read_prefix and not lookback:
            _coded_attention_fwd_kernel[(n_hist, b * hkv, n_rblocks)](**args(True), **pdl, **launch)
        _coded_attention_fwd_kernel[(n_hist + nt, b * hkv, n_rblocks)](**args(False), **pdl, **launch)
    if final:
        return out, lse
    out = torch.empty_like(query)
    lse = torch.empty(b, hq, q_len, dtype=torch.float32, device=dev)
    block_d = min(dp, 32)
    _coded_attention_merge_kernel[(b * hkv * rows, dp // block_d)](
        o_part_ptr=o_part,
        lse_part_ptr=lse_part,
        out_ptr=out,
        lse_ptr=lse,
        stride_ob=out.stride(0),
        stride_oh=out.stride(1),
        stride_oq=out.stride(2),
        stride_lb=lse.stride(0),
        stride_lh=lse.stride(1),
        H_KV=hkv,
        G=groups,
        Q=q_len,
        NS=ns + nt - 1,  # partials, less one
        n_bh_rows=b * hkv * rows,
        D=dp,
        DH=d,
        BLOCK_S=min(128, next_pow2(ns + nt)),
        BLOCK_D=block_d,
        **pdl,
        **_prior_args(prior),
    )
    if count:
        v_precision_stats += stats_part.sum(0).to(v_precision_stats.dtype)
    return out, lse


def _prior_args(prior: tuple[Tensor, Tensor] | None) -> dict:
    """The merge kernel's arguments for a `prior` part (`out` `[B, H_q, q, D]`, `lse` `[B, H_q, q]`, natural log)."""
    if prior is None:
        return {}
    out, lse = prior
    return dict(
        px_o_ptr=out, px_lse_ptr=lse, **dict(zip(("stride_xob", "stride_xoh", "stride_xoq"), out.stride()[:3])),
        **dict(zip(("stride_xlb", "stride_xlh", "stride_xlq"), lse.stride())), PRIOR=True,
    )  # fmt: skip


def _check_prior(prior: object, query: Tensor) -> tuple[Tensor, Tensor] | None:
    if prior is None:
        return None
    shape = tuple(query.shape)
    if (
        not isinstance(prior, tuple)
        or len(prior) != 2
        or not all(isinstance(t, Tensor) for t in prior)
        or tuple(prior[0].shape) != shape
        or tuple(prior[1].shape) != shape[:3]
    ):
        raise ValueError(
            f"`prior` must be None or a tuple (out [B, H_q, q, D] = {list(shape)}, lse [B, H_q, q] = {list(shape[:3])}), "
            f"got {[tuple(getattr(t, 'shape', ())) for t in prior] if isinstance(prior, tuple) else type(prior).__name__}"
        )
    out, lse = prior
    if out.device != query.device or lse.device != query.device:
        raise ValueError(f"`prior` must be on the query's device ({query.device}), got {out.device} / {lse.device}")
    if out.stride(-1) != 1:
        raise ValueError(f"`prior`'s out must have stride 1 in its last dim, got strides {out.stride()}")
    return out, lse


def _kernel_supports(query: Tensor, view: CellView, v_precision_tau: float | None = None) -> str | None:
    """Why the kernel cannot take this call (None when it can)."""
    d = view.head_dim
    rows = query.shape[1] // view.num_kv_heads * query.shape[2]
    if v_precision_tau is not None and view.history_nbits == 4 and rows > 16:
        # seen on the H200 (Triton 3.6): a 65-token GQA-8 verification block with V precision failed its check
        return f"V precision over {rows} query rows per KV head (validated on the GPU up to 16)"
    if query.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"dtype {query.dtype}"
    if d < 16:
        return f"head_dim {d} (the kernel needs >= 16)"
    if view.is_coded:
        page = view.history_key.group_size
        if page < 16 or page & (page - 1):
            return f"key page size {page} (the kernel needs a power of two >= 16)"
        if next_pow2(d) < 64:
            return f"head_dim {d} with coded history (the kernel's per-bit-lane dots need next_pow2(D) / 4 >= 16)"
        if view.history_value.group_size % 4:
            return f"value group size {view.history_value.group_size} (the kernel needs a multiple of 4)"
    return None


def coded_attention(
    query: Tensor,
    view: CellView,
    *,
    scaling: float,
    v_precision_tau: float | None = None,
    v_precision_stats: Tensor | None = None,
    prior: tuple[Tensor, Tensor] | None = None,
) -> tuple[Tensor, Tensor]:
    """Attention of the view's new tokens over what one cache cell stores, reading history codes as codes.

    Same contract as `reference_coded_attention` (see there and README.md): on CUDA tensors with Triton installed it
    runs the split-history kernel (one launch, plus a page-maxima launch when V precision spans several splits, plus
    the log-sum-exp merge; a view with no history pages and a short window is one launch, `TAIL_TUNING`); elsewhere,
    and for shapes the kernel does not take (a head dim below 16, or below 33 over coded history; a key page size that is not a power of two >= 16; fp64), the reference; a head dim that is
    no power of two (Huginn-0125's 96) is read in zero-padded tiles of the next power of two. The kernel path reads
    every view tensor in place through its strides (no `.contiguous()`, no decoded copy) and never reads a value
    back to the host, so it does not re-check `history_end` against the view (the reference does).

    With device-side lengths (`view.length` a device tensor: a static cache's decode step), the launch grid is sized
    for every preallocated page and the split programs past the pages the bounds reach exit at once (the merge weighs
    their empty partials by zero); the sink and the ring window are masked by the device length. Every launch then
    has the same grid, arguments and addresses from step to step, so a CUDA graph can replay it; neither path reads a
    device value on the host.

    Args:
        query (`torch.Tensor` of shape `[B, H_q, q, D]`): queries of the new tokens, in the view's dtype; `H_q` a
            multiple of `H_kv`. `q` is 1 for decoding, up to `W + 1` for a verification block.
        view (`CellView`): the cell's sink, history (INT4 / INT2 codes or a BF16 plane), window, new tokens,
            per-(row, query) history boundaries and padding.
        scaling (`float`): softmax scale.
        v_precision_tau (`float`, *optional*): LoopKV's read-time V precision on INT4 history (cold iff
            `score < running max - tau * ln 2`; cold tokens read only the `hi` plane). None reads both planes.
        v_precision_stats (`torch.Tensor` of shape `[2]`, *optional*): `[cold reads, INT4 history reads]`,
            accumulated in place on the device.
        prior (`tuple` of `torch.Tensor`, *optional*): `(out [B, H_q, q, D], lse [B, H_q, q])`, attention of the same
            queries over keys the view does not hold (e.g. cuDNN's SDPA over a source cell's plane up to
            `history_end`, with the view's history left out), `lse` in natural log (-inf: no key); merged in with the
            view's own parts by log-sum-exp, so the result is attention over both. Then `history_end` may exceed
            what the view's history holds (those positions are the prior's).

    Returns:
        `(out, lse)`: `out` `[B, H_q, q, D]` in the query's dtype, `lse` `[B, H_q, q]` fp32 natural-log sum of
        `exp(score)` over every key each query reads.

    Example:
        >>> out, lse = coded_attention(q, view, scaling=128**-0.5, v_precision_tau=14.0)  # doctest: +SKIP
    """
    _check_query(query, view)
    if not isinstance(scaling, (int, float)) or isinstance(scaling, bool) or not math.isfinite(scaling):
        raise ValueError(f"`scaling` must be a finite float, got {scaling!r}")
    prior = _check_prior(prior, query)
    reason = _kernel_supports(query, view, v_precision_tau)
    if not use_triton("coded_attention", query) or reason is not None:
        if reason is not None and query.is_cuda:
            announce_once(f"coded_attention: the Triton kernel does not take {reason}; using the reference")
        return reference_coded_attention(
            query, view, scaling=scaling, v_precision_tau=v_precision_tau, v_precision_stats=v_precision_stats,
            prior=prior,
        )  # fmt: skip
    if v_precision_tau is not None and (
        isinstance(v_precision_tau, bool) or not isinstance(v_precision_tau, (int, float)) or v_precision_tau < 0
    ):
        raise ValueError(f"`v_precision_tau` must be a non-negative float or None, got {v_precision_tau!r}")
    if v_precision_stats is not None and (
        not isinstance(v_precision_stats, Tensor) or tuple(v_precision_stats.shape) != (2,)
    ):
        raise ValueError(f"`v_precision_stats` must be a tensor of shape [2] (cold, history), got {v_precision_stats!r}")
    if query.stride(-1) != 1:
        raise ValueError(f"`query` must have stride 1 in its last dim, got strides {query.stride()}")
    if several_gpus():  # multi-GPU (`device_map`): every tensor on the query's device, and the launch there
        check_same_device(query, "query", view)
        if v_precision_stats is not None and v_precision_stats.device != query.device:
            raise ValueError(f"`v_precision_stats` is on {v_precision_stats.device} but `query` is on {query.device}")
    with launch_device(query):
        return _coded_attention_fwd(
            query, view, scaling=float(scaling), v_precision_tau=v_precision_tau, v_precision_stats=v_precision_stats,
            prior=prior,
        )  # fmt: skip
