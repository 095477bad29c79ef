"""Static windowed cells: `StaticCodedLayer` (options `int4`, `int2`) and `StaticCodedSharedLayer` (option `share`:
RIPE, the deepest plane and LoopKV sharing, over a coded or a BF16 source), so that every forward after the prefill
over any plan has the same shapes and addresses every time and can be captured in a CUDA graph.

Storage, allocated once for `max_batch_size` rows and `max_cache_len` positions: the BF16 sink `[B, H, S, D]`, a ring
of `C` recent positions at full precision (position `p` in slot `p % C`; `coded_ring_capacity`, `ring_capacity`), and,
for a coded cell, the codes of every page of `[S, max_cache_len)`. The reading rule is `WindowedLayer`'s: the query at
`t` reads `[0, S)` from the sink, `[S, history_end)` from the history (its own codes, or its source's codes or BF16
storage) and `[history_end, t]` from the ring, where `history_end` counts, per row, the stored positions whose
*effective* position (the row's holes left out, `effective_storage`) lies below `H` of the query's effective position,
`H(e) = S + P * floor(max(0, e - S - W) / P)` (RIPE Eq. 9 for `P = 1`), clipped to what the history can serve: exactly
the growable cells' boundaries, computed on the device once per forward from its positions and key validity.
`triton_ops.coded_attention` reads the cell with device-side lengths (`CellView`).

**Page flush inside the forward.** Every forward after the prefill (a decode step, a draft, a verification block)
first codes, from the ring, the `K = flush_pages(P, R)` pages that end at the page boundary at or above its largest
history end. A forward moves that boundary by at most `K - 1` pages (one page a step without a rollback reserve; with
holes a row's effective positions span more storage), so every page below was coded by an earlier forward, and coding
a page again from the same positions and validity gives the same codes. Page indices are device values, the writes
`index_copy_`, and a page not due (below the sink, or no longer held by the ring, e.g. after a crop deeper than the
rollback reserve) goes to a scratch page past the last one: no host branch, nothing allocated that depends on the
length. A page is coded once, in the forward where it becomes due: the cell keeps, on the device, per row, head and
plane the page last coded in each of `K` slots (`coded_t`, page `n` in slot `n % K`, `flush_page`'s `coded`), and
a page its slot already holds is skipped (its codes were made from the same positions and final validity), so the
`P - 1` forwards in `P` in which no page becomes due code nothing. The slots are forgotten from the page holding
the new length on by a crop that may reach a coded page (`_coded_reach`; none within a reserve well inside the
window), entirely by `reset`, a new prefill, `select_batch` and `resize`. In a complete forward the first coded cell
to prepare flushes every coded cell of its code format in one launch (`FlushGroup`); drafts flush cell by cell. Pages are coded by storage position with the forward's key validity, so a hole (a rejected draft token of one
row) is left out of its page's key scales, as the growable `CodedLayer` codes it; with `W >= gamma` no page is coded
before its positions' holes are known. A shared cell asks its source for those pages before it reads (once per
forward: the source's own attend comes later in a complete forward, and never in a draft).

The prefill and deep crops run on the host (`code_range`, host lengths); nothing after the prefill reads a host length
or a device value on the host.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from hf_loopcache.attention import dense_attention, fixed_shape_attention_lse, fixed_shape_attention_takes
from hf_loopcache.cache.layers.static import (
    StaticDenseLayer,
    _StaticStorage,
    additive_bias,
    effective_storage,
    hole_span,
    ring_capacity,
)
from hf_loopcache.cache.plan import window_boundary
from hf_loopcache.cache.storage import page_floor, quantize_pages
from triton_ops import fused
from triton_ops.coded_attention import CellView, coded_attention
from triton_ops.quant import (
    FlushTable,
    QuantizedKeys,
    QuantizedValues,
    dequantize_keys,
    dequantize_values,
    flush_page,
    flush_page_table,
)

if TYPE_CHECKING:
    from hf_loopcache.cache.read import ReadState

__all__ = ["FlushGroup", "StaticCodedLayer", "StaticCodedSharedLayer", "coded_ring_capacity"]

_CODE_CHUNK_PAGES = 32
"""Pages coded per call on the host path (a prefill): bounds the fp32 transient."""


def flush_pages(page_size: int, rollback: int, holes: bool = True) -> int:
    """Pages a static coded cell codes per forward: `K = 1` without a rollback reserve (decoding: the boundary moves
    by at most one page a step), else `ceil((R + P) h / P) + 2`, `h = hole_span(R, holes)`. A row's boundary `H`
    moves in its effective positions: by up to `R + P` of them in one forward (a verification of `R + 1` tokens),
    each of which spans up to `h` storage positions (with holes a real token and the holes a rejected draft leaves
    after it), so the largest boundary over the rows moves by at most `K - 1` storage pages (one more for the page
    it ends in)."""
    if rollback == 0:
        return 1
    return -(-(rollback + page_size) * hole_span(rollback, holes) // page_size) + 2


def coded_ring_capacity(window: int, page_size: int, rollback: int, holes: bool = True) -> int:
    """Ring slots of a static coded cell. Without a rollback reserve `W + 2P`: a read at `t` needs `[H(t), t)` (up to
    `W + P - 1` positions), the flush of the step the page below `H(t)` (`P` more), and one slot more keeps that page
    after a crop of the position just written (the step `generate` takes back after a deferred stop: `exact_crop`;
    one position in a ring of `W + 2P`, e.g. 320 slots for LoopKV's 256 and 32). With a reserve `R`
    (self-speculation), rows may hold holes: a row's `W + P - 1` real positions before `t` span up to
    `(W + P - 1) h + R` storage positions (`h = hole_span(R, holes)`: `R + 1` with holes, 1 for a cache of one row),
    the `K = flush_pages(P, R, holes)` pages coded per forward end within a page of the largest boundary, and a crop
    of up to `R` positions must find all of it still held: `(W + P - 1) h + 2R + (K + 1)P - 1`."""
    if rollback == 0:
        return window + 2 * page_size
    k = flush_pages(page_size, rollback, holes)
    return (window + page_size - 1) * hole_span(rollback, holes) + 2 * rollback + (k + 1) * page_size - 1


def page_floor_t(t: torch.Tensor, sink: int, page_size: int) -> torch.Tensor:
    """`page_floor` of device positions: the page boundary at or below `t` (positions up to the sink are their own)."""
    return torch.where(t > sink, sink + page_size * ((t - sink).clamp(min=0) // page_size), t)


class _StaticWindowed(_StaticStorage):
    """Sink, ring and the reading rule of a static windowed cell; the history comes from the subclass."""

    is_compileable = True

    def __init__(
        self, *, sink: int, window: int, page_size: int, rollback: int, max_batch_size: int, max_cache_len: int
    ) -> None:
        super().__init__()
        self.sink, self.window, self.page, self.rollback = sink, window, page_size, rollback
        self.max_rows, self.max_positions = max_batch_size, max_cache_len
        self.capacity = self._capacity(rollback)
        self.k: torch.Tensor | None = None  # the ring
        self.v: torch.Tensor | None = None
        self.sink_k: torch.Tensor | None = None
        self.sink_v: torch.Tensor | None = None
        self.high = 0  # one past the highest position written since the last reset (host)
        self.floor = sink  # ring positions below this are not read (host mirror of `floor_t`)
        self.held_from = 0  # the ring holds no position below this (a resize dropped them)
        # where the growable cell's full-precision window starts (`H(length - rollback)`, never moving back but for a
        # deep crop): a crop below it restores the straddling page from the history, as the growable cell does
        self.keep_start = sink
        # the key validity of the last forward (`ReadState.static_valid`: a view of the cache's device mask), for the
        # pages coded outside a forward (inspection, a deep crop)
        self.valid: torch.Tensor | None = None
        self.floor_t: torch.Tensor | None = None

    # ------------------------------------------------------------------ storage
    def _storage_positions(self) -> int:
        return self.capacity

    def _storage_allocated(self, device: torch.device) -> None:
        assert self.k is not None  # noqa: S101 - allocated by the caller
        # one scratch slot past the sink: a decode step writes its token there when it is not a sink position
        shape = (self.max_rows, self.k.shape[1], self.sink + 1, self.k.shape[3])
        self.sink_k, self.sink_v = self.k.new_zeros(shape), self.k.new_zeros(shape)
        self.floor_t = torch.full((), self.floor, dtype=torch.long, device=device)

    def _max_positions(self) -> int:
        return self.max_positions

    def _live_positions(self) -> int:
        return min(max(0, self.length - self.sink), self.capacity) + min(self.length, self.sink)

    def allocated_bytes(self) -> int:
        sink = 0 if self.sink_k is None else 2 * self.sink_k.numel() * self.sink_k.element_size()
        return super().allocated_bytes() + sink

    def stored_bytes(self) -> int:
        if self.k is None:
            return 0
        per_position = self.k[: self.rows, :, :1].numel() * self.k.element_size() * 2
        return per_position * self._live_positions()

    def boundary(self, t: torch.Tensor) -> torch.Tensor:
        """`H(t)` of positions `t` (a long tensor of any shape), on the device."""
        return self.sink + self.page * ((t - self.sink - self.window).clamp(min=0) // self.page)

    # ------------------------------------------------------------------ writes
    def _positions(self, q: int, read: ReadState) -> torch.Tensor:
        self.valid = read.static_valid
        return super()._positions(q, read)

    def _store(
        self, key: torch.Tensor, value: torch.Tensor, positions: torch.Tensor, also: tuple | None = None
    ) -> None:
        """Write the new positions into the sink (those below `S`) and the ring (every one); `also` `(k, v)`: into
        that storage too, at the same positions, in the same launch (a cell without a sink)."""
        q, rows = key.shape[2], self.rows
        if self.length + q > self.max_positions:
            raise ValueError(
                f"this static cache holds at most `max_cache_len={self.max_positions}` positions; writing {q} more "
                f"after {self.length} would overflow it (build it with a larger `max_cache_len`)"
            )
        ring_k, ring_v = self._views()
        sink = None
        if self.sink and self.length == 0:  # the prefill (eager): host slices
            n = min(self.sink, q)
            self.sink_k[:rows, :, :n] = key[:, :, :n]  # type: ignore[index]
            self.sink_v[:rows, :, :n] = value[:, :, :n]  # type: ignore[index]
        elif self.sink:  # a step or block after it: a short prompt's sink fills here, the scratch slot takes the rest
            sink = (self.sink_k[:rows], self.sink_v[:rows], self.sink)  # type: ignore[index]
        if also is not None:
            if self.sink:
                raise ValueError("`also` is for a cell without a sink")
            sink = (also[0], also[1], also[0].shape[2] - 1)  # every position in range: slot = position
        # the ring keeps the last `capacity` positions; with the sink, one launch on CUDA writes all four
        fused.write_kv(ring_k, ring_v, key, value, positions, modulo=self.capacity, sink=sink)
        self.length += q
        self._moved()

    def advance(self, query_length: int) -> None:
        """Host bookkeeping of a replayed step that wrote `query_length` positions."""
        self.length += query_length
        self._moved()

    def _moved(self) -> None:
        self.high = max(self.high, self.length)
        keep = window_boundary(self.length - self.rollback, sink=self.sink, window=self.window, page_size=self.page)
        self.keep_start = max(self.keep_start, keep)

    def _ring_states(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Ring positions `[start, end)` (host; all must be held)."""
        k, v = self._views()
        slots = torch.arange(start, end, device=k.device) % self.capacity
        return k.index_select(2, slots), v.index_select(2, slots)

    def _ring_holds(self, position: int) -> bool:
        return position >= max(self.floor, self.held_from, self.high - self.capacity)

    def _positions_tag(self, read: ReadState, positions: torch.Tensor) -> object:
        """`read.memo`'s key for a forward's new positions (`_positions`): the forward's own, shared by every cell, or
        the `q` after this cell's length. A tag, not the tensor's address or identity: `torch.compile` can hash
        neither `data_ptr()` (torch 2.11) nor the `id()` of a tensor made inside the graph."""
        return "forward" if positions is read.positions else ("own", self.length, positions.shape[0])

    # ------------------------------------------------------------------ reads
    def _history(self) -> tuple[object, object]:
        """Codes or a BF16 plane of every history page `[S, ...)` (fixed shapes)."""
        raise NotImplementedError

    def _capacity(self, rollback: int) -> int:
        """Ring slots for a rollback reserve of `rollback` positions."""
        raise NotImplementedError

    @property
    def holes(self) -> bool:
        """Whether rows may hold holes (sizes the ring and the pages coded per forward): a cache of one row never
        does."""
        return self.max_rows > 1

    def _row_ends(self, read: ReadState, positions: torch.Tensor) -> torch.Tensor:
        """`[B, q]`: per row, the stored positions below `length` that the queries at `positions` read from the
        history, before any clamp: those whose effective position (the row's holes left out, `effective_storage`) is
        below `H` of the query's effective position, as the growable `WindowedLayer` counts them. Without holes this
        is `H(t)`. The same for every windowed cell of the forward with this sink, window and page (`read.memo`)."""
        key = ("static-row-ends", self.sink, self.window, self.page, self.rows, self._positions_tag(read, positions))
        ends = read.memo.get(key)
        if ends is None:
            if read.static_valid is None:
                raise ValueError("a static cell read needs the forward's key validity (`ReadState.static_valid`)")
            eff_key = ("static-effective", self.rows)  # (the forward's one validity: `read.memo` is per forward)
            eff = read.memo.get(eff_key)
            if eff is None:
                eff = read.memo[eff_key] = effective_storage(read.static_valid[: self.rows])  # [B, L], non-decreasing
            h = self.boundary(eff.index_select(1, positions))  # [B, q], in effective positions
            ends = read.memo[key] = torch.minimum(torch.searchsorted(eff, h), positions[:1])
        return ends

    def _ring_low(self, held: torch.Tensor) -> torch.Tensor:
        """The oldest position past the sink that the ring surely holds while the cell holds `held` positions (`[1]`,
        device): the ring keeps the last `C` positions written, and up to `R` of those may have been cut by a crop
        since; positions below `S` are the sink's."""
        return (held - (self.capacity - self.rollback)).clamp(min=self.sink)

    def _history_end(
        self, read: ReadState, positions: torch.Tensor, limit: torch.Tensor, held: torch.Tensor
    ) -> torch.Tensor:
        """`history_end` `[B, q]` of the queries at `positions` (before this cell's `floor`): `_row_ends` clamped, as
        `WindowedLayer.history_ends` clamps them, to what the history can serve (`limit`, a device value) and never
        below what the ring no longer holds (`_ring_low` of the `held` positions) nor below the sink (the cell's
        floor while no crop has moved it: `_floored`)."""
        return torch.maximum(torch.minimum(self._row_ends(read, positions), limit), self._ring_low(held))

    def _view(self, key, value, read, positions, history_end: torch.Tensor, history: bool = True) -> CellView:
        """The cell as `coded_attention` reads it; `history=False` leaves the history out (read elsewhere: `prior`)."""
        hk, hv = self._history() if history else (None, None)
        rows = self.rows
        sk = self.sink_k[:rows, :, : self.sink] if self.sink else None  # type: ignore[index]
        sv = self.sink_v[:rows, :, : self.sink] if self.sink else None  # type: ignore[index]
        ring_k, ring_v = self._views()
        valid = read.static_valid
        return CellView(
            new_key=key,
            new_value=value,
            length=positions[:1],
            history_end=history_end,
            sink_key=sk,
            sink_value=sv,
            history_start=self.sink,
            history_key=hk,
            history_value=hv,
            window_key=ring_k,
            window_value=ring_v,
            key_valid=None if valid is None else valid[:rows],
            # what a read without holes takes from the ring: at most the ring of a cell with no rollback reserve
            window_reach=self._capacity(0),
        )

    def _read(self, query, key, value, read, positions, history_end):
        stats, tau = read.v_precision_stats, read.tau_for(query.shape[2])
        out, _ = coded_attention(
            query,
            self._view(key, value, read, positions, history_end),
            scaling=read.scaling,
            v_precision_tau=tau,
            v_precision_stats=None if stats is None or tau is None else stats.tensor(query.device),
        )
        return out

    def _prefill(self, query, key, value, read, positions):
        """A first write into an empty cell: causal attention over the new tokens (as every cell computes it)."""
        out = dense_attention(query, key, value, key_valid=read.key_valid, scaling=read.scaling)
        self._store(key, value, positions)
        return out

    # ------------------------------------------------------------------ the plain path and inspection
    def _history_decoded(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        hk, hv = self._history()
        a, b = start - self.sink, end - self.sink
        if isinstance(hk, QuantizedKeys) and isinstance(hv, QuantizedValues):
            p1 = math.ceil(b / self.page)
            k = dequantize_keys(hk.select_pages(0, p1), dtype=self.dtype)[:, :, a:b]
            v = dequantize_values(hv.select_tokens(0, p1 * self.page), dtype=self.dtype)[:, :, a:b]
            return k, v
        return hk[:, :, a:b], hv[:, :, a:b]  # type: ignore[index]

    def _code_for(self, end: int) -> int:
        """Make the history readable below `end` (host); returns how far it can be read (subclasses)."""
        raise NotImplementedError

    def _states(self, t: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Stored positions `[0, length)` as the query at `t >= length` reads them (host; decoded history)."""
        n, s = self.length, self.sink
        parts_k, parts_v = [], []
        if s:
            parts_k.append(self.sink_k[: self.rows, :, : min(s, n)])  # type: ignore[index]
            parts_v.append(self.sink_v[: self.rows, :, : min(s, n)])  # type: ignore[index]
        if n > s:
            end = min(max(window_boundary(t, sink=s, window=self.window, page_size=self.page), self.floor), n)
            end = max(s, min(end, self._code_for(end)))  # what the history can serve
            if end > s:
                k, v = self._history_decoded(s, end)
                parts_k.append(k)
                parts_v.append(v)
            if end < n:
                k, v = self._ring_states(end, n)
                parts_k.append(k)
                parts_v.append(v)
        return torch.cat(parts_k, dim=2), torch.cat(parts_v, dim=2)

    def full_states(self):
        if self.length == 0:
            raise ValueError("this cell holds no positions yet")
        return self._states(self.length)

    def update(self, key_states, value_states, *args, **kwargs):
        """Plain path for foreign models: every position as the last new token reads it (history decoded)."""
        if not self.is_initialized or self.length == 0:
            self.lazy_initialization(key_states, value_states)
        q = key_states.shape[2]
        if self.length:
            k, v = self._states(self.length + q - 1)
        else:
            k, v = key_states[:, :, :0], value_states[:, :, :0]
        self._store(key_states, value_states, torch.arange(self.length, self.length + q, device=self.device))
        return torch.cat([k, key_states], dim=2), torch.cat([v, value_states], dim=2)

    # ------------------------------------------------------------------ crop, batch, reset
    def _floored(self, hist: torch.Tensor) -> torch.Tensor:
        """The history ends `hist` (at least `S`) raised to the cell's floor, which is above `S` only after a crop past
        the ring: a per-cell launch then only (a captured step holds this host branch, so its graph key holds which
        cells' floors are above their sinks: `LoopCache._floor_groups`)."""
        return torch.maximum(hist, self.floor_t) if self.floor > self.sink else hist  # type: ignore[arg-type]

    def _set_floor(self, floor: int) -> None:
        self.floor = floor
        if self.floor_t is not None:
            self.floor_t.fill_(floor)

    def truncate(self, length: int) -> None:
        """Keep `[0, length)`. Within the rollback reserve the ring still holds what the next reads and flushes
        need. Below the growable cell's window start (`keep_start`), as there: the positions from the last history
        boundary at or below `length` go back to the ring as the history holds them (decoded), and the ring is read
        from there on."""
        if length >= self.length:
            return
        length = max(0, length)
        if length <= self.sink:
            self.length = self.high = length
            self.keep_start = self.sink
            self._set_floor(self.sink)
            return
        need = window_boundary(length, sink=self.sink, window=self.window, page_size=self.page) - self._flush_reach
        if length < self.keep_start or not self._ring_holds(max(self.sink, need)):
            self._deep_truncate(length)
        self.length = length

    _flush_reach = 0
    """Positions below the next read's boundary `H` that the next forward takes from the ring besides its read: none
    for a shared cell (its history is its source's), the page a coded cell codes from it (`P`)."""

    def exact_crop(self, positions: int) -> bool:
        """Within the rollback reserve, as every windowed cell; past it, where `truncate` keeps the ring: a cut of at
        most `W` positions (the window's start stays below the new length) and a ring that still holds, after it, all
        that the next forward reads or codes from it: `[H(t) - F, t)` with `F = _flush_reach`, up to `W + P - 1 + F`
        positions before `t`, so `C >= positions + W + P - 1 + F`. A coded cell's ring of `W + 2P` has that for one
        position (`coded_ring_capacity`; the pages the cut step coded are those the next step codes, from the same
        positions), RIPE's shared ring of `W + 2` (pages of one position, `ring_capacity`) and LoopKV's of `W + P + 1`
        for two."""
        if positions <= self.rollback:
            return True
        reach = self.window + self.page - 1 + self._flush_reach
        return positions <= self.window and self.capacity >= positions + reach

    def _served(self, length: int) -> int:
        """The history boundary at or below `length` that the history can serve (a page boundary for codes)."""
        return page_floor(length, start=self.sink, page_size=self.page)

    def _deep_truncate(self, length: int) -> None:
        served = self._served(length)
        if served < length:
            k, v = self._decoded_history(served, length)
            ring_k, ring_v = self._views()
            slots = torch.arange(served, length, device=ring_k.device) % self.capacity
            ring_k.index_copy_(2, slots, k.to(ring_k.dtype))
            ring_v.index_copy_(2, slots, v.to(ring_v.dtype))
        self.high, self.keep_start, self.held_from = length, served, 0
        self._set_floor(served)

    def _decoded_history(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def reset(self) -> None:
        self.length = self.high = self.held_from = 0
        self.keep_start = self.sink
        self._set_floor(self.sink)

    def select_batch(self, index: torch.Tensor) -> None:
        super().select_batch(index)  # the ring, in place
        rows = int(index.shape[0])
        for t in self._row_tensors():
            index = index.to(t.device)
            t[:rows].copy_(t[: self._selected_from].index_select(0, index))

    def _row_tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.sink_k, self.sink_v) if t is not None]

    @property
    def _selected_from(self) -> int:
        return self.max_rows

    def resize(self, rollback: int) -> None:
        """A ring for another rollback reserve, keeping the positions it holds that fit."""
        capacity = self._capacity(rollback)
        self.rollback = rollback
        if capacity == self.capacity:
            return
        old_k, old_v, old_capacity = self.k, self.v, self.capacity
        self.capacity = capacity
        if old_k is None or old_v is None or self.length == 0:
            return
        self.k = old_k.new_zeros((*old_k.shape[:2], capacity, old_k.shape[3]))
        self.v = old_v.new_zeros((*old_v.shape[:2], capacity, old_v.shape[3]))
        first = max(self.held_from, self.high - old_capacity, self.length - capacity, 0)
        held = torch.arange(first, self.length, device=old_k.device)
        self.k.index_copy_(2, held % capacity, old_k.index_select(2, held % old_capacity))
        self.v.index_copy_(2, held % capacity, old_v.index_select(2, held % old_capacity))
        self.high, self.held_from = self.length, first


class StaticCodedLayer(_StaticWindowed):
    """A coded cell (option `int4` / `int2`) of a static cache: BF16 sink and ring, and the KIVI codes of every page of
    `[S, max_cache_len)` preallocated (keys per channel over a page, values per token in channel groups; INT4 values
    as `hi`/`lo` planes). A decode step codes the page ending at `H(t)` on the device before its read (see the
    module docstring), so the codes equal the growable `CodedLayer`'s.

    Args:
        nbits (`int`): 4 or 2.
        sink, window, page_size (`int`): `S`, `W`, `P` of the plan.
        group_size (`int`): channel group of the value codes.
        rollback (`int`): positions a crop may remove exactly (sizes the ring, `coded_ring_capacity`).
        max_batch_size, max_cache_len (`int`): rows and positions of the storage.
    """

    def __init__(
        self,
        nbits: int,
        *,
        sink: int,
        window: int,
        page_size: int,
        group_size: int,
        rollback: int,
        max_batch_size: int,
        max_cache_len: int,
    ) -> None:
        super().__init__(
            sink=sink, window=window, page_size=page_size, rollback=rollback, max_batch_size=max_batch_size,
            max_cache_len=max_cache_len,
        )  # fmt: skip
        if nbits not in (2, 4):
            raise ValueError(f"`nbits` must be one of (2, 4), got {nbits!r}")
        self.nbits, self.group = nbits, group_size
        self.num_pages = max(1, math.ceil(max(0, max_cache_len - sink) / page_size))  # + a scratch page (`flush`)
        self.qk: QuantizedKeys | None = None
        self.qv: QuantizedValues | None = None
        # `flush_page`'s `coded` slots ([rows, heads, 2, K] int32, page n in slot n % K, -1: none): the pages the
        # device flush has coded, so that a page is coded in the forward where it becomes due and skipped after
        self.coded_t: torch.Tensor | None = None
        self.flush_group: FlushGroup | None = None  # the cache's coded cells, flushed in one launch (`FlushGroup`)

    @property
    def option(self) -> str:
        return f"int{self.nbits}"

    @property
    def _flush_reach(self) -> int:
        return self.page

    def _capacity(self, rollback: int) -> int:
        return coded_ring_capacity(self.window, self.page, rollback, self.holes)

    def _storage_allocated(self, device: torch.device) -> None:
        super()._storage_allocated(device)
        assert self.k is not None  # noqa: S101 - allocated by the caller
        rows, heads, _, d = self.k.shape
        tokens, pages = (self.num_pages + 1) * self.page, self.num_pages + 1
        u8, f16 = dict(dtype=torch.uint8, device=device), dict(dtype=torch.float16, device=device)
        self.qk = QuantizedKeys(
            codes=torch.zeros(rows, heads, tokens, d * self.nbits // 8, **u8),
            scale=torch.zeros(rows, heads, pages, d, **f16),
            zero=torch.zeros(rows, heads, pages, d, **f16),
            nbits=self.nbits,
            group_size=self.page,
        )
        self.qv = QuantizedValues(
            hi=torch.zeros(rows, heads, tokens, d // 4, **u8),
            lo=torch.zeros(rows, heads, tokens, d // 4, **u8) if self.nbits == 4 else None,
            scale=torch.zeros(rows, heads, tokens, d // self.group, **f16),
            zero=torch.zeros(rows, heads, tokens, d // self.group, **f16),
            nbits=self.nbits,
            group_size=self.group,
        )
        k = flush_pages(self.page, self.rollback, self.holes)
        self.coded_t = torch.full((rows, heads, 2, k), -1, dtype=torch.int32, device=device)

    def _forget(self, first_page: int = 0) -> None:
        """The flush codes pages from `first_page` on again when they are due (their positions change: a crop into
        them, a reset, a new prefill, rows reordered)."""
        if self.coded_t is None:
            return
        if first_page <= 0:
            self.coded_t.fill_(-1)
        else:
            self.coded_t.masked_fill_(self.coded_t >= first_page, -1)

    def _coded_slots(self) -> torch.Tensor | None:
        """The `coded` slots for `flush_page`, or None (code every due page every forward) when the rollback reserve
        exceeds the window: a page could then be coded before its positions' holes are known, and only the re-coding
        of the following forwards, while the page is among the `K`, would correct it."""
        return self.coded_t if self.rollback <= self.window else None

    def _history(self):
        assert self.qk is not None and self.qv is not None  # noqa: S101 - allocated by the first write
        return self._codes(self.num_pages)

    def _codes(self, pages: int) -> tuple[QuantizedKeys, QuantizedValues]:
        """Views of the first `pages` pages of the live rows (`num_pages + 1` includes the scratch page)."""
        assert self.qk is not None and self.qv is not None  # noqa: S101 - allocated by the first write
        rows, t = self.rows, pages * self.page
        qk, qv = self.qk, self.qv
        keys = QuantizedKeys(qk.codes[:rows, :, :t], qk.scale[:rows, :, :pages], qk.zero[:rows, :, :pages], qk.nbits,
                             qk.group_size)  # fmt: skip
        values = QuantizedValues(
            qv.hi[:rows, :, :t], None if qv.lo is None else qv.lo[:rows, :, :t], qv.scale[:rows, :, :t],
            qv.zero[:rows, :, :t], qv.nbits, qv.group_size,
        )  # fmt: skip
        return keys, values

    def _row_tensors(self):
        extra = []
        if self.qk is not None and self.qv is not None:
            extra = [self.qk.codes, self.qk.scale, self.qk.zero, self.qv.hi, self.qv.scale, self.qv.zero]
            extra += [] if self.qv.lo is None else [self.qv.lo]
        return super()._row_tensors() + extra

    def allocated_bytes(self) -> int:
        codes = 0 if self.qk is None or self.qv is None else self.qk.nbytes + self.qv.nbytes
        return super().allocated_bytes() + codes

    def stored_bytes(self) -> int:
        if self.qk is None or self.qv is None:
            return 0
        coded = max(0, window_boundary(self.length, sink=self.sink, window=self.window, page_size=self.page) - self.sink)
        pages = coded // self.page
        keys, values = self._history()
        return super().stored_bytes() + keys.select_pages(0, pages).nbytes + values.select_tokens(0, coded).nbytes

    # ---------------------------------------------------------------- codes
    def _put(self, page: int, qk: QuantizedKeys, qv: QuantizedValues) -> None:
        """Codes of `qk.num_pages` pages from page `page` (host path; the decode step's flush writes in `flush`)."""
        p = self.page
        own_k, own_v = self._codes(self.num_pages + 1)
        n = qk.num_pages
        t0, t1 = page * p, (page + n) * p
        own_k.codes[:, :, t0:t1] = qk.codes
        own_k.scale[:, :, page : page + n] = qk.scale
        own_k.zero[:, :, page : page + n] = qk.zero
        pairs = [(own_v.hi, qv.hi), (own_v.scale, qv.scale), (own_v.zero, qv.zero)]
        pairs += [] if qv.lo is None else [(own_v.lo, qv.lo)]
        for dst, src in pairs:
            dst[:, :, t0:t1] = src

    def _quantize(self, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor | None, check_finite: bool = True):
        return quantize_pages(
            k, v, self.nbits, page_size=self.page, group_size=self.group, valid=valid, check_finite=check_finite
        )

    def flush(self, read: ReadState, positions: torch.Tensor) -> None:
        """Code the forward's `K` pages (`_geometry`: those ending at the page boundary at or above its largest history
        end) from the ring, on the device. A page not due (below the sink, or no longer held by the ring: below
        `floor`) is not written (the reference's torch ops send it to the scratch page past the last one, which nothing
        reads): the forward is the same either way. `triton_ops.quant.flush_page` does it all in one kernel launch on
        CUDA (gather, quantize, pick the pages, write; the device-side geometry read in the kernel, whose programs exit
        at once for a page that is not due), with the reference's torch ops elsewhere; the bytes of every page a
        reader reads are the same. With the `coded` slots (`_coded_slots`) a page is coded only in the forward where
        it becomes due (see the module docstring)."""
        geo = self._geometry(read, positions)
        ring_k, ring_v = self._views()
        mask = geo["valid"]
        keys, values = self._codes(self.num_pages + 1)
        flush_page(
            ring_k, ring_v, keys, values, slots=geo["slots"], page=geo["page"], due=geo["due"], start=geo["start"],
            floor=self.floor_t, scratch_page=self.num_pages, valid=None if mask is None else mask[: self.rows],
            coded=self._coded_slots(),
        )  # fmt: skip

    def code_range(self, start: int, end: int, valid: torch.Tensor | None, new=None) -> None:
        """Code the pages of `[start, end)` (page aligned) on the host path: positions below `length` from the ring,
        the others from `new = (key, value)` (the forward's new tokens, from position `length`)."""
        step = _CODE_CHUNK_PAGES * self.page
        for a in range(start, end, step):
            b = min(a + step, end)
            m = min(max(self.length - a, 0), b - a)  # positions [a, a + m) are cached
            parts_k, parts_v = [], []
            if m:
                k, v = self._ring_states(a, a + m)
                parts_k.append(k)
                parts_v.append(v)
            if m < b - a:
                assert new is not None  # noqa: S101 - the caller passes the new tokens when they are needed
                lo, hi = a + m - self.length, b - self.length
                parts_k.append(new[0][:, :, lo:hi])
                parts_v.append(new[1][:, :, lo:hi])
            k = parts_k[0] if len(parts_k) == 1 else torch.cat(parts_k, dim=2)
            v = parts_v[0] if len(parts_v) == 1 else torch.cat(parts_v, dim=2)
            mask = None if valid is None else valid[: self.rows, a:b]
            qk, qv = self._quantize(k, v, mask)
            self._put((a - self.sink) // self.page, qk, qv)

    def _held(self, read: ReadState, positions: torch.Tensor) -> tuple[torch.Tensor, object]:
        """Positions this cell holds before the forward's write, on the device (`[1]`): the forward's first position
        when the forward writes the cell, the cache's final-loop length in a draft that does not (the cell is then a
        source whose readers run); and which of those it is, for `read.memo`'s keys (a tag, not the tensor's
        address: `torch.compile` cannot hash `data_ptr()` on torch 2.11)."""
        if read.complete or read.length is None or self.length == read.length:
            return positions[:1], "first"
        if read.source_length is None:
            return torch.full((1,), self.length, dtype=torch.long, device=positions.device), ("host", self.length)
        return read.source_length, "source"

    def _geometry(self, read: ReadState, positions: torch.Tensor) -> dict[str, torch.Tensor]:
        """Device values of one forward for this cell's reads and its flush, shared by every coded cell with the same
        sink, window, page, ring and holding (`read.memo`): `hist` (`_history_end` `[B, q]` with the limit
        `page_floor(held)`), and the `K = flush_pages(P, R)` pages that end at the page boundary at or above the
        largest `hist` (`target`): their starts, ring slots, page indices, whether each is due (a page of the history
        the ring still holds) and the key validity of their positions."""
        held, held_tag = self._held(read, positions)
        key = ("static-coded-geometry", self.sink, self.window, self.page, self.capacity, self.rollback, self.rows,
               self._positions_tag(read, positions), held_tag)  # fmt: skip
        geo = read.memo.get(key)
        if geo is None:
            limit = page_floor_t(held, self.sink, self.page)
            hist = self._history_end(read, positions, limit, held)  # [B, q]
            pages = torch.div(hist.amax() - self.sink + self.page - 1, self.page, rounding_mode="floor")
            target = self.sink + self.page * pages.clamp(min=0)  # the page boundary at or above the largest end
            k = flush_pages(self.page, self.rollback, self.holes)
            start = target - self.page * torch.arange(k, 0, -1, device=positions.device)  # [K], ascending
            pos = (start[:, None] + torch.arange(self.page, device=positions.device)).flatten()  # [K * P]
            valid = read.static_valid
            geo = read.memo[key] = dict(
                hist=hist,
                start=start,
                slots=pos % self.capacity,
                page=((start - self.sink) // self.page).clamp(min=0),
                due=(start >= self.sink) & (start >= self._ring_low(held)),
                valid=valid if valid is None else valid.index_select(1, pos.clamp(min=0, max=valid.shape[1] - 1)),
            )
        return geo

    def prepare(self, read: ReadState, positions: torch.Tensor) -> None:
        """Make the codes readable for this forward, on the device (once per forward: shared cells call it on their
        source before their read): `flush` the `K` pages below the largest history end of the forward's queries.
        Every page below those was coded by an earlier forward (the boundary moves by at most `K - 1` pages a
        forward, `flush_pages`), and coding a page again would give the same codes: the `coded` slots skip it."""
        key = ("static-coded-flush", id(self))
        if key not in read.memo:
            group = self.flush_group
            if group is None or not group.flush(self, read, positions):
                self.flush(read, positions)
            read.memo[key] = True

    # ---------------------------------------------------------------- read and write
    def attend(self, query, key, value, read):
        if not self.is_initialized or self.length == 0:  # a fresh start may have another row count
            self.lazy_initialization(key, value)
        q = key.shape[2]
        positions = self._positions(q, read)
        if self.length == 0:
            n = q
            self._forget()  # a new prefill: every page is new
            out = self._prefill(query, key, value, read, positions)
            h = window_boundary(n, sink=self.sink, window=self.window, page_size=self.page)
            if h > self.sink:  # the prompt's pages, straight from its keys and values
                self.length = 0
                self.code_range(self.sink, h, read.static_valid if read.key_valid is not None else None, (key, value))
                self.length = n
            return out
        self.prepare(read, positions)
        hist = self._floored(self._geometry(read, positions)["hist"])
        out = self._read(query, key, value, read, positions, hist)
        self._store(key, value, positions)
        return out

    def _code_for(self, end: int) -> int:
        first = max(self.sink, window_boundary(self.length, sink=self.sink, window=self.window, page_size=self.page)
                    - self.page, self.floor)  # fmt: skip
        end = min(end, page_floor(self.length, start=self.sink, page_size=self.page))
        if end > first:
            self.code_range(first, end, self.valid)
        return end

    # ---------------------------------------------------------------- crop, batch, reset: the coded slots
    def truncate(self, length: int) -> None:
        """`_StaticWindowed.truncate`, and the pages from the one holding `length` on are coded again when due (their
        positions from `length` on will be written anew). Only when a coded page may reach `length`
        (`_coded_reach`): a crop within a rollback reserve well inside the window issues no device op."""
        old, high = self.length, self.high
        super().truncate(length)
        if length < old and length < self._coded_reach(high):
            self._forget(max(0, length - self.sink) // self.page)

    def _coded_reach(self, high: int) -> int:
        """A bound (host) on the end of every page the device flush may have coded while the cell held at most `high`
        positions: a page ends at the page boundary at or above a history end, which lies at most `W` before the
        query (storage positions; holes only widen the gap), or at the ring's low end `high - (C - R)`; a draft's
        queries run up to `R - 1` positions past what a source holds."""
        reach = max(high + self.rollback - 1 - self.window, high - (self.capacity - self.rollback), self.sink)
        return self.sink + self.page * -(-(reach - self.sink) // self.page)

    def reset(self) -> None:
        super().reset()
        self._forget()

    def select_batch(self, index: torch.Tensor) -> None:
        super().select_batch(index)
        self._forget()  # the rows' pages moved (they are coded; the slots need only not claim a page wrongly)

    def resize(self, rollback: int) -> None:
        super().resize(rollback)
        k = flush_pages(self.page, rollback, self.holes)
        if self.coded_t is not None and self.coded_t.shape[-1] != k:
            self.coded_t = torch.full((*self.coded_t.shape[:-1], k), -1, dtype=torch.int32, device=self.coded_t.device)
        else:
            self._forget()  # `_coded_reach` assumes the reserve the pages were coded under

    # ---------------------------------------------------------------- the source side
    def readable_limit(self, length: int | None = None) -> int:
        length = self.length if length is None else length
        return page_floor(length, start=self.sink, page_size=self.page) if length > self.sink else length

    def decoded(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions `[start, end)` as this cell holds them (ring where it holds them, else decoded codes)."""
        if start >= end:
            k, _ = self._views()
            empty = k[:, :, :0]
            return empty, empty
        if start >= self.keep_start and self._ring_holds(start):
            return self._ring_states(start, end)
        return self._decoded_history(start, end)

    def _decoded_history(self, start, end):
        """History positions `[start, end)` decoded from the codes (coded first where the ring still holds them)."""
        self._code_for(page_floor(end - 1, start=self.sink, page_size=self.page) + self.page)
        return self._history_decoded(start, end)


class FlushGroup:
    """The coded cells of one static cache (`LoopCache` attaches it to each as `flush_group`): in a complete forward
    (every cell written in it, so every cell's flush has the same device geometry) the first coded cell that prepares
    flushes every cell of its code format (`nbits`, value group) in **one launch** (`flush_page_table`, over a device
    table of the cells' storage addresses, built once and rebuilt only when a cell's storage moves) and marks them
    flushed for the forward; the same bytes and slots as one `flush` per cell. Drafts, and a forward in which the cells
    do not all hold the same positions, flush cell by cell.

    Args:
        cells (`list` of `StaticCodedLayer`): the cache's coded cells.
    """

    def __init__(self, cells: list[StaticCodedLayer]) -> None:
        self.cells = list(cells)
        self._tables: dict[tuple, tuple[tuple, FlushTable]] = {}

    def _peers(self, cell: StaticCodedLayer) -> list[StaticCodedLayer]:
        """The cells flushed with `cell`: its code format, on its device (a model split by `device_map` flushes one
        table per device)."""
        device = None if cell.k is None else cell.k.device
        return [c for c in self.cells if c.nbits == cell.nbits and c.group == cell.group and c.k is not None
                and c.k.device == device]  # fmt: skip

    def flush(self, cell: StaticCodedLayer, read: ReadState, positions: torch.Tensor) -> bool:
        """Flush every cell of `cell`'s format in one launch when the forward allows it; returns whether it did."""
        if not read.complete:
            return False
        peers = self._peers(cell)
        if len(peers) < 2 or any(c.qk is None or c.length != cell.length or c.rows != cell.rows for c in peers):
            return False
        rows = cell.rows
        signature = tuple((c.k.data_ptr(), c.v.data_ptr(), c.qk.codes.data_ptr(),  # type: ignore[union-attr]
                           None if c.coded_t is None else c.coded_t.data_ptr(), c._coded_slots() is None)
                          for c in peers)  # fmt: skip
        key = (cell.nbits, cell.group, rows, cell.k.device)  # type: ignore[union-attr]
        entry = self._tables.get(key)
        if entry is None or entry[0] != signature:
            stores = []
            for c in peers:
                ring_k, ring_v = c._views()
                keys, values = c._codes(c.num_pages + 1)
                stores.append((ring_k, ring_v, keys, values, c.floor_t, c._coded_slots()))
            entry = self._tables[key] = (signature, FlushTable(stores, scratch_page=cell.num_pages))
        geo = cell._geometry(read, positions)
        mask = geo["valid"]
        flush_page_table(entry[1], slots=geo["slots"], page=geo["page"], due=geo["due"], start=geo["start"],
                         valid=None if mask is None else mask[:rows])  # fmt: skip
        for c in peers:
            read.memo[("static-coded-flush", id(c))] = True
        return True


class StaticCodedSharedLayer(_StaticWindowed):
    """A shared cell (option `share`) of a static cache: its own sink (if the plan has one) and ring,
    its history read from the source's storage in place (a `StaticCodedLayer`'s codes, or a `StaticDenseLayer`'s
    BF16 buffer), through `coded_attention` with device-side lengths. It stores no history of its own. Before its
    read it has the source code the page it needs (`StaticCodedLayer.prepare`, once per forward).

    In a draft (`ReadState.draft_loops`) the source is not written; the cell reads the history up to what the source
    holds (the cache's device-side final-loop length, `ReadState.source_length`) and the rest from its ring. A RIPE
    shared cell reads its BF16 source in place this way (no copy of the source per step); a row position its ring no
    longer holds (holes spanning more than the ring, a crop deeper than the reserve) is read from the source.

    Args:
        source (`StaticCodedLayer` or `StaticDenseLayer`): the final loop's cell of the same layer.
        sink, window, page_size, rollback, max_batch_size, max_cache_len: as `StaticCodedLayer`.
    """

    option = "share"

    #: how a one-token step over a BF16 source (RIPE, the deepest plane) reads the history: `"sdpa"` (cuDNN's SDPA over
    #: the source's storage to each row's history end, merged with the kernel's read of the sink, ring and new token:
    #: `coded_attention`'s `prior`; the kernel where cuDNN cannot run it, or where the source's own read would take
    #: the kernel: `StaticDenseLayer.read_kind`, which under `"auto"` does while the storage is at most 2/3 full) or
    #: `"kernel"` (all of it in the kernel)
    history_read = "sdpa"

    #: whether the deepest plane's full forwards (a one-token step, a verification block) are read by the source's
    #: own read, the new keys and values written into the source's storage too (`_reads_whole_source`; with
    #: `history_read = "sdpa"`); False: as RIPE's cells, cuDNN over the source's history merged with the kernel's read
    #: of the ring and the new token, and a block through the kernel over the source's history, ring and block
    whole_source = True

    def __init__(
        self,
        source: StaticCodedLayer | StaticDenseLayer,
        *,
        sink: int,
        window: int,
        page_size: int,
        rollback: int,
        max_batch_size: int,
        max_cache_len: int,
    ) -> None:
        if not isinstance(source, (StaticCodedLayer, StaticDenseLayer)):
            raise TypeError(
                f"`source` of a static shared cell must be a StaticCodedLayer or StaticDenseLayer, got "
                f"{type(source).__name__}"
            )
        super().__init__(
            sink=sink, window=window, page_size=page_size, rollback=rollback, max_batch_size=max_batch_size,
            max_cache_len=max_cache_len,
        )  # fmt: skip
        self.source = source

    def _history(self):
        if isinstance(self.source, StaticCodedLayer):
            return self.source._history()
        k, v = self.source._views()
        return k[:, :, self.sink :], v[:, :, self.sink :]

    def _source_limit(self) -> int:
        """History positions the source can serve now (host)."""
        if isinstance(self.source, StaticCodedLayer):
            return self.source.readable_limit()
        return self.source.length

    def _capacity(self, rollback: int) -> int:
        return ring_capacity(self.window, self.page, rollback, self.holes)

    def exact_crop(self, positions: int) -> bool:
        """`_StaticWindowed.exact_crop` (its history is the source's storage, read in place: whether the source's cut is
        exact is the source cell's answer), and always when the ring serves no history (`W = 0`, `P = 1`: the deepest
        plane, every earlier position read from the source)."""
        return (self.window == 0 and self.page == 1) or super().exact_crop(positions)

    def attend(self, query, key, value, read):
        if not self.is_initialized or self.length == 0:
            self.lazy_initialization(key, value)
        q = key.shape[2]
        positions = self._positions(q, read)
        if self.length == 0:
            return self._prefill(query, key, value, read, positions)
        if self._reads_whole_source(query, read):
            # the deepest plane in a full forward: every earlier position is the source's, so the new keys and values
            # go into the source's storage at their positions too (in the ring's launch; the source writes its own
            # there later in this forward) and the source's own read serves this cell: a one-token step by cuDNN over
            # the storage, no read of the ring, no merge (H200, README, session 26); a verification block by the
            # kernel over the storage up to the block and the block itself, as the source's own block (session 27)
            k, v = self.source._views()
            self._store(key, value, positions, also=(k, v))
            return self.source.read_storage(query, key, value, read, positions)
        coded = isinstance(self.source, StaticCodedLayer)
        if coded:
            self.source.prepare(read, positions)  # the source codes the pages its readers need
        hist = self._floored(self._hist(read, positions, coded))
        out = self._read(query, key, value, read, positions, hist)
        self._store(key, value, positions)
        return out

    def _reads_whole_source(self, query: torch.Tensor, read: ReadState) -> bool:
        """Whether this forward's read is the source's read with this cell's new tokens in it: no window and no sink
        (the deepest plane: `W = 0`, `P = 1`: a query at `e` reads every position below the forward's first from the
        source and the forward's own up to `e`, as the source's own query does), a BF16 source, a full forward (a
        one-token step or a verification block: every loop runs, so the source holds every earlier position and
        writes the forward's after this cell, at the same slots), and `history_read = "sdpa"` with `whole_source`.
        Drafts (the source does not run) read as before."""
        return (self.window == 0 and self.page == 1 and self.sink == 0 and isinstance(self.source, StaticDenseLayer)
                and read.complete and self.history_read == "sdpa" and self.whole_source)  # fmt: skip

    def _read(self, query, key, value, read, positions, history_end):
        """A one-token step over a BF16 source: cuDNN over the source's storage to each row's history end (one
        fixed-shape call, as a dense cell's own read: `fixed_shape_attention_lse`) and the kernel over the rest of
        the view, merged by log-sum-exp. H200, Ouro-1.4B's shape, 8K: cuDNN reads a cell's 8K positions in 20 / 123 us
        at batch 1 / 8, the kernel's BF16 history path in 32 / 172 (README, session 25): a full storage. The kernel
        where the source's own one-token read would take it (`read_kind`: under `"auto"`, a storage at most 2/3
        full; the kernel reads only the positions held, cuDNN all of the storage), and otherwise."""
        src = self.source
        if (
            self.history_read == "sdpa"
            and isinstance(src, StaticDenseLayer)
            and query.shape[2] == 1
            and src.read_kind(read, 1, query.is_cuda) != "kernel"
        ):
            k, v = src._views()
            if fixed_shape_attention_takes(query, k):
                bias = self._history_bias(read, positions, history_end, k)
                prior = fixed_shape_attention_lse(query, k, v, bias, scaling=read.scaling)
                view = self._view(key, value, read, positions, history_end, history=False)
                return coded_attention(query, view, scaling=read.scaling, prior=prior)[0]
        return super()._read(query, key, value, read, positions, history_end)

    def _history_bias(self, read: ReadState, positions: torch.Tensor, history_end: torch.Tensor, k: torch.Tensor):
        """`[B, 1, 1, L]` additive bias over the source's `L` stored positions: 0 where a row reads the position from
        the history (`[S, history_end)`, a real token), -inf elsewhere; the same for every shared cell of the forward
        with this geometry and floor (`read.memo`; a captured step keeps it for the cells that shared a floor at its
        recording, so its graph key holds which cells do: `LoopCache._floor_groups`)."""
        key = ("static-shared-history-bias", self._hist_key(read, positions, False), self.floor, k.shape[2], k.dtype)
        bias = read.memo.get(key)
        if bias is None:
            j = torch.arange(k.shape[2], device=k.device)
            seen = (j >= self.sink) & (j < history_end[:, :1])  # [B, L]
            if read.static_valid is not None:
                seen = seen & read.static_valid[: self.rows, : k.shape[2]]
            bias = read.memo[key] = additive_bias(seen, k.dtype)[:, None, None]
        return bias

    def _hist_key(self, read: ReadState, positions: torch.Tensor, coded: bool) -> tuple:
        """`read.memo`'s key for `_hist`: what the history ends of the forward's queries depend on."""
        return ("static-shared-hist", self.sink, self.window, self.page, self.capacity, self.rollback, self.rows,
                self._positions_tag(read, positions), read.complete, coded)  # fmt: skip

    def _hist(self, read: ReadState, positions: torch.Tensor, coded: bool) -> torch.Tensor:
        """`_history_end` of the forward's queries (before `floor`), the same for every shared cell of the forward with
        this sink, window, page, ring and kind of source (`read.memo`). The history can serve what the source holds,
        on the device: all `length` positions in a complete forward (it is written later in it), its own in a draft
        (the cache's final-loop length, so a captured draft reads no host length); page aligned for codes."""
        key = self._hist_key(read, positions, coded)
        hist = read.memo.get(key)
        if hist is None:
            if read.complete:
                held = positions[:1]
            elif read.source_length is not None:
                held = read.source_length
            else:
                held = torch.full((1,), self.source.length, dtype=torch.long, device=positions.device)
            if coded:
                held = page_floor_t(held, self.sink, self.page)
            limit = torch.minimum(held, positions[:1])
            hist = read.memo[key] = self._history_end(read, positions, limit, positions[:1])
        return hist

    def _code_for(self, end: int) -> int:
        end = min(end, self._source_limit())
        if isinstance(self.source, StaticCodedLayer):
            return min(end, self.source._code_for(end))
        return end

    def _decoded_history(self, start, end):
        return self.source.decoded(start, end)

    def _served(self, length: int) -> int:
        return self.source.readable_limit(length)
