"""Pure-PyTorch reference of coded attention: the contract of the Triton kernels and the CPU fallback.

Attention of `q` new tokens over one cell's stored view (`CellView`): BF16 sink, history as KIVI codes or a borrowed
BF16 plane, BF16 window, the new tokens, with per-(row, query) history boundaries, padding, GQA and LoopKV's
read-time V precision. Computed in fp32 (fp64 for fp64 inputs), in the order a split (flash-decoding) kernel computes
it, so a kernel can be checked piece by piece:

1. scores of every stretch (`s = q . k * scaling`, masked to -inf where a key is not read);
2. with V precision on INT4 history: the maximum visible score of every history page, the prefix maximum over pages
   seeded with the sink's maximum score, and the cold set `s < running_max(page) - tau * ln 2`;
3. per stretch (and per split of `split_pages` history pages): a partial softmax `(m, l, acc)`; cold tokens read
   only the `hi` value plane (`4 * hi + 1.5`), hot ones both;
4. the partials merged by log-sum-exp: `out = sum exp(m_i - M) acc_i / L`, `lse = M + log L`.

History is decoded one split at a time (the fallback never holds a decoded copy of the whole history). See
`README.md` next to this file for the math and the layout.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from triton_ops.coded_attention.view import CellView
from triton_ops.quant import dequantize_keys, dequantize_values

__all__ = ["reference_coded_attention"]

DEFAULT_SPLIT_PAGES = 32
"""History pages per split (1,024 tokens at pages of 32). BF16 history splits by `32 * DEFAULT_SPLIT_PAGES` tokens."""

_KEEP_SCORES = 1 << 22
"""With V precision, history scores of up to this many elements (16 MiB in fp32) are kept between the page-maximum
pass and the softmax pass instead of being recomputed from the codes."""


def _check_query(query: object, view: CellView) -> Tensor:
    if not isinstance(view, CellView):
        raise TypeError(f"`view` must be a CellView, got {type(view).__name__}")
    if not isinstance(query, Tensor) or query.ndim != 4:
        raise ValueError(f"`query` must be a [B, H_q, q, D] tensor, got {getattr(query, 'shape', type(query))}")
    b, hkv, q, d = view.new_key.shape
    if query.shape[0] != b or query.shape[2] != q or query.shape[3] != d or query.shape[1] % hkv:
        raise ValueError(
            f"`query` must have shape [B, H_q, q, D] = [{b}, k * {hkv}, {q}, {d}] for this view, got {tuple(query.shape)}"
        )
    if query.dtype != view.new_key.dtype:
        raise TypeError(f"`query` must have the dtype of the view's keys ({view.new_key.dtype}), got {query.dtype}")
    return query


def _check_bounds(view: CellView, outside: bool = False) -> None:
    """`history_end` must keep every position read exactly once (see `CellView`); one host sync (none with
    device-side lengths: those views are not checked). `outside`: the history below it is read elsewhere (`prior`),
    so it may reach past the view's history."""
    if view.query_length == 0 or view.device_lengths:
        return
    lo = max(view.history_start, view.window_start) if view.length > view.history_start else view.length
    hi = view.length if outside else min(view.history_start + view.history_length, view.length)
    hi = max(hi, lo)
    he = view.history_end
    got_lo, got_hi = int(he.min()), int(he.max())
    if got_lo < lo or got_hi > hi:
        raise ValueError(
            f"`history_end` must lie in [{lo}, {hi}] (history [{view.history_start}, "
            f"{view.history_start + view.history_length}), window [{view.window_start}, {view.length})), "
            f"got values in [{got_lo}, {got_hi}]"
        )


class _Partial:
    """Running partial softmaxes `(m, l, acc)` of disjoint key sets, merged by log-sum-exp at the end."""

    def __init__(self) -> None:
        self.parts: list[tuple[Tensor, Tensor, Tensor]] = []

    def add(self, scores: Tensor, values: Tensor | None, mixed: tuple[Tensor, Tensor, Tensor] | None = None) -> None:
        """`scores` `[B, Hkv, G, q, L]` (-inf = not read), `values` `[B, Hkv, L, D]`; or `mixed = (cold, v_hot,
        v_cold)` for V precision (cold `[B, Hkv, G, q, L]` bool)."""
        if scores.shape[-1] == 0:
            return
        m = scores.amax(-1)  # [B, Hkv, G, q]
        m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        p = torch.exp(scores - m_safe[..., None])
        denom = p.sum(-1)
        if mixed is None:
            acc = torch.einsum("bhgql,bhld->bhgqd", p, values)
        else:
            cold, v_hot, v_cold = mixed
            acc = torch.einsum("bhgql,bhld->bhgqd", p * ~cold, v_hot) + torch.einsum(
                "bhgql,bhld->bhgqd", p * cold, v_cold
            )
        self.parts.append((m, denom, acc))

    def merge(self) -> tuple[Tensor, Tensor]:
        ms = torch.stack([m for m, _, _ in self.parts])  # [n, B, Hkv, G, q]
        big_m = ms.amax(0)
        w = torch.exp(ms - big_m)  # 0 for a part that reads nothing (m = -inf)
        total = sum(wi * den for wi, (_, den, _) in zip(w, self.parts))
        out = sum(wi[..., None] * acc for wi, (_, _, acc) in zip(w, self.parts))
        return out / total[..., None], big_m + torch.log(total)


def _scores(q: Tensor, k: Tensor, scaling: float) -> Tensor:
    """`q` `[B, Hkv, G, q, D]`, `k` `[B, Hkv, L, D]` (accumulation dtype) -> `[B, Hkv, G, q, L]`."""
    return torch.einsum("bhgqd,bhld->bhgql", q, k) * scaling


def reference_coded_attention(
    query: Tensor,
    view: CellView,
    *,
    scaling: float,
    v_precision_tau: float | None = None,
    v_precision_stats: Tensor | None = None,
    split_pages: int = DEFAULT_SPLIT_PAGES,
    prior: tuple[Tensor, Tensor] | None = None,
) -> tuple[Tensor, Tensor]:
    """Attention of the view's new tokens over what the cell stores, reading history codes as codes.

    Args:
        query (`torch.Tensor` of shape `[B, H_q, q, D]`): queries of the new tokens (positions `length + i`), in
            the view's dtype; `H_q` a multiple of `H_kv` (GQA: query head `h` reads KV head `h // (H_q // H_kv)`).
        view (`CellView`): the cell's stored stretches, the new keys/values, boundaries and padding.
        scaling (`float`): softmax scale, usually `D ** -0.5`.
        v_precision_tau (`float`, *optional*): LoopKV's V precision (Sec. 3.3) on INT4 history: a history token is
            cold for a query row when its score is below the running maximum minus `tau * ln 2`, the running maximum
            being the largest visible score of the sink and of every history page up to the token's own; cold
            tokens read only the `hi` value plane. None reads both planes of every token.
        v_precision_stats (`torch.Tensor` of shape `[2]`, integer or float, *optional*): accumulated in place with
            `[cold reads, INT4 history reads]`, counted per (row, query head, query, visible token). Only with V
            precision on INT4 history.
        split_pages (`int`, *optional*, defaults to 32): history pages decoded at a time (bounds the fallback's
            memory; the result does not depend on it beyond fp32 rounding).
        prior (`tuple` of `torch.Tensor`, *optional*): `(out [B, H_q, q, D], lse [B, H_q, q])` over keys the view
            does not hold, merged in as one more part (`coded_attention`).

    Returns:
        `(out, lse)`: `out` `[B, H_q, q, D]` in the query's dtype; `lse` `[B, H_q, q]` fp32 (fp64 for fp64 inputs),
        the natural-log sum of `exp(score)` over every key the query reads.
    """
    _check_query(query, view)
    if v_precision_tau is not None and (
        isinstance(v_precision_tau, bool) or not isinstance(v_precision_tau, (int, float)) or v_precision_tau < 0
    ):
        raise ValueError(f"`v_precision_tau` must be a non-negative float or None, got {v_precision_tau!r}")
    if isinstance(split_pages, bool) or not isinstance(split_pages, int) or split_pages < 1:
        raise ValueError(f"`split_pages` must be a positive int, got {split_pages!r}")
    if v_precision_stats is not None and (
        not isinstance(v_precision_stats, Tensor) or tuple(v_precision_stats.shape) != (2,)
    ):
        raise ValueError(
            f"`v_precision_stats` must be a tensor of shape [2] (cold, history), got {v_precision_stats!r}"
        )
    _check_bounds(view, outside=prior is not None)

    b, hq, q_len, d = query.shape
    hkv = view.num_kv_heads
    groups = hq // hkv
    acc = torch.promote_types(query.dtype, torch.float32)
    device = query.device
    qf = query.to(acc).reshape(b, hkv, groups, q_len, d)
    static = view.device_lengths  # device-side lengths: masks instead of slices, no host read
    n = view.length.reshape(()).to(device=device, dtype=torch.long) if static else view.length
    q_pos = n + torch.arange(q_len, device=device)  # [q]
    valid = view.key_valid
    bound = view.history_end.to(device=device, dtype=torch.long)  # [B, q]

    def visible(pos: Tensor, extra: Tensor | None = None) -> Tensor | None:
        """[B|1, 1, 1, q|1, L] mask of cached positions `pos` (all before every query): padding (and `extra`)."""
        m = None if valid is None else valid[:, pos][:, None, None, None, :]
        if extra is not None:
            m = extra if m is None else m & extra
        return m

    def masked(s: Tensor, m: Tensor | None) -> Tensor:
        return s if m is None else s.masked_fill(~m, -math.inf)

    parts = _Partial()

    # sink
    seed = None
    if view.sink_length:
        pos = torch.arange(view.sink_length, device=device)
        held = (pos < n)[None, None, None, None, :] if static else None  # a static sink may not be full yet
        if static and valid is not None:  # its buffer may outlast the padding mask (a capacity under the sink)
            pos = pos.clamp(max=valid.shape[1] - 1)
        s = masked(_scores(qf, view.sink_key.to(acc), scaling), visible(pos, held))
        seed = s.amax(-1)  # [B, Hkv, G, q]: seeds the V-precision running maximum
        parts.add(s, view.sink_value.to(acc))

    # history, split by pages
    hist_len = view.history_length
    if static:  # every preallocated page; the bounds mask what is not read
        read_len = hist_len if q_len else 0
    else:
        read_len = min(hist_len, int(bound.max()) - view.history_start) if q_len and hist_len else 0
    if read_len > 0:
        start = view.history_start
        page = view.page_size or 32
        split = split_pages * page
        pages_read = math.ceil(read_len / page)
        use_vp = v_precision_tau is not None and view.history_nbits == 4

        def split_scores(a: int, z: int) -> tuple[Tensor, Tensor | None]:
            """Scores of history tokens `[a, z)` (offsets from `start`) and their mask."""
            if view.is_coded:
                p0, p1 = a // page, math.ceil(z / page)
                k = dequantize_keys(view.history_key.select_pages(p0, p1), dtype=acc)[
                    :, :, a - p0 * page : z - p0 * page
                ]
            else:
                k = view.history_key[:, :, a:z].to(acc)
            pos = torch.arange(start + a, start + z, device=device)
            if static and valid is not None:  # preallocated pages may reach past the mask (the bounds hide them)
                pos = pos.clamp(max=valid.shape[1] - 1)
            m = visible(pos, (pos[None, :] < bound[:, :, None])[:, None, None])  # [B, 1, 1, q, L]
            return masked(_scores(qf, k, scaling), m), m

        running = None
        kept: dict[int, Tensor] = {}  # pass-1 scores of each split, kept while they are small (else recomputed)
        keep = b * hq * q_len * read_len <= _KEEP_SCORES
        if use_vp:
            page_max = []
            for a in range(0, read_len, split):
                s, _ = split_scores(a, min(a + split, read_len))
                if keep:
                    kept[a] = s
                pad = (-s.shape[-1]) % page
                s = torch.nn.functional.pad(s, (0, pad), value=-math.inf)
                page_max.append(s.unflatten(-1, (-1, page)).amax(-1))
            pm = torch.cat(page_max, -1)[..., :pages_read]  # [B, Hkv, G, q, pages]
            running = torch.cummax(pm, dim=-1).values
            if seed is not None:
                running = torch.maximum(running, seed[..., None])
        for a in range(0, read_len, split):
            z = min(a + split, read_len)
            s = kept.pop(a) if a in kept else split_scores(a, z)[0]
            if view.is_coded:
                p0, p1 = a // page, math.ceil(z / page)
                qv = view.history_value.select_tokens(p0 * page, p1 * page)
                lo, hi = a - p0 * page, z - p0 * page
                v_hot = dequantize_values(qv, dtype=acc)[:, :, lo:hi]
            else:
                v_hot = view.history_value[:, :, a:z].to(acc)
            if running is None:
                parts.add(s, v_hot)
                continue
            tok_page = torch.arange(a, z, device=device) // page
            threshold = running[..., tok_page] - v_precision_tau * math.log(2.0)
            finite = torch.isfinite(s)
            cold = (s < threshold) & finite
            all_cold = torch.zeros(qv.hi.shape[:3], dtype=torch.bool, device=device)
            v_cold = dequantize_values(qv, dtype=acc, hot=all_cold)[:, :, lo:hi]
            parts.add(s, None, mixed=(cold, v_hot, v_cold))
            if v_precision_stats is not None:
                counts = torch.stack([cold.sum(), finite.sum()]).to(v_precision_stats.dtype)
                v_precision_stats.add_(counts.to(v_precision_stats.device))

    # window
    if view.window_key is not None and view.window_key.shape[2] and static:  # a ring: slot c holds position `pos[c]`
        cap = view.window_key.shape[2]
        pos = n - 1 - torch.remainder(n - 1 - torch.arange(cap, device=device), cap)
        m = ((pos[None, :] >= bound[:, :, None]) & (pos >= 0)[None, None, :])[:, None, None]
        m = m if valid is None else m & valid.gather(1, pos.clamp(min=0)[None].expand(b, -1))[:, None, None, None, :]
        parts.add(masked(_scores(qf, view.window_key.to(acc), scaling), m), view.window_value.to(acc))
    elif view.window_key is not None and view.window_key.shape[2]:
        pos = torch.arange(view.window_start, n, device=device)
        m = visible(pos, (pos[None, :] >= bound[:, :, None])[:, None, None])
        parts.add(masked(_scores(qf, view.window_key.to(acc), scaling), m), view.window_value.to(acc))

    # new tokens: causal, padded keys hidden, a query always reads itself
    causal = q_pos[None, :] <= q_pos[:, None]  # [q, q]
    own = q_pos[None, :] == q_pos[:, None]
    m = causal[None, None, None] if valid is None else (causal & valid[:, q_pos][:, None, :]) | own
    if m.ndim == 3:
        m = m[:, None, None]
    parts.add(masked(_scores(qf, view.new_key.to(acc), scaling), m), view.new_value.to(acc))
    if prior is not None:  # a part with m = lse, sum exp(s - m) = 1 and acc = out
        p_out, p_lse = (t.to(device=device, dtype=acc).reshape(b, hkv, groups, q_len, -1) for t in prior)
        p_lse = p_lse[..., 0]
        p_out = torch.where(torch.isfinite(p_lse)[..., None], p_out, torch.zeros_like(p_out))
        parts.parts.append((p_lse, torch.ones_like(p_lse), p_out))

    out, lse = parts.merge()  # [B, Hkv, G, q, D], [B, Hkv, G, q]
    return out.reshape(b, hq, q_len, d).to(query.dtype), lse.reshape(b, hq, q_len)
