"""`WindowedLayer`: the part coded and shared cells have in common: a full-precision sink and recent window around a
history that the subclass provides (own codes: `CodedLayer`; a source cell's storage: `SharedLayer`).

Reading rule (the same for every windowed cell, so block verification matches sequential decoding): the query at
position `t` reads position `j < t` from the history iff `S <= j < H(t)`, with the window boundary
`H(t) = S + P * floor(max(0, t - S - W) / P)` (`P` = page size; `P = 1` gives RIPE's `t - j > W`, Eq. 9), clipped
to what the history can be read up to and never below the cell's own window. Positions of the same forward are read
at full precision (prefill computes every loop's own keys and values). Every page that a query reads from the history
is coded before the read, exactly as the flush codes it, so a block of up to `W + 1` tokens read in one pass equals
reading them one at a time (RIPE Proposition 1). With holes (`ReadState.effective`), `H` applies to each row's
effective positions.

State: `sink` holds `[0, min(S, length))`; `recent` holds `[recent.start, length)` at full precision, where
`recent.start` is the keep boundary `H(length - rollback)` (the rollback reserve stays exact, so `crop` by up to
`rollback` positions restores what sequential decoding holds); the history covers `[S, ...)` up to where queries read.
"""

from __future__ import annotations

import torch

from hf_loopcache.attention import dense_attention
from hf_loopcache.cache.layers.base import LoopLayerBase
from hf_loopcache.cache.plan import window_boundary
from hf_loopcache.cache.read import ReadState
from hf_loopcache.cache.storage import SeqBuffer, page_floor
from triton_ops.coded_attention import CellView, coded_attention
from triton_ops.quant import QuantizedKeys, QuantizedValues, dequantize_keys, dequantize_values

__all__ = ["WindowedLayer", "window_capacity"]


def window_capacity(window: int, page_size: int, rollback: int) -> int:
    """Positions a windowed cell's full-precision window allocates: the most it holds (`W + P - 1 + rollback` after a
    write, one more while a token arrives) plus a quarter of that (at least a page) of dead room, so that the window
    is compacted in place every few tokens by a few copies instead of holding twice its size."""
    live = window + page_size + rollback
    return live + max(page_size, live // 4)


class WindowedLayer(LoopLayerBase):
    """Sink and recent window at full precision; the history in between comes from `_history_view`.

    Args:
        sink (`int`): `S`, full-precision positions at the start.
        window (`int`): `W`, full-precision recent positions every query reads.
        page_size (`int`): `P`, positions leave the window in pages of `P`.
        rollback (`int`, *optional*, defaults to 0): extra recent positions kept at full precision so `crop` by up to
            this many positions stays exact.
    """

    def __init__(self, *, sink: int, window: int, page_size: int, rollback: int = 0) -> None:
        super().__init__()
        self.sink, self.window, self.page, self.rollback = sink, window, page_size, rollback
        self.sink_buf = SeqBuffer()
        self.recent = SeqBuffer()
        self.recent.reset(sink)
        self._valid: torch.Tensor | None = None  # [B, length] key validity once any padding was seen

    @property
    def window_start(self) -> int:
        """First position of the own full-precision window (`recent`)."""
        return self.recent.start

    # ---------------------------------------------------------------- boundaries
    def read_boundary(self, t: int) -> int:
        """`H(t)`: the query at position `t` reads positions `[S, H(t))` from the history."""
        return window_boundary(t, sink=self.sink, window=self.window, page_size=self.page)

    def _row_boundaries(self, first: int, count: int, read: ReadState, stored: int) -> tuple[torch.Tensor, int, int]:
        """Storage boundaries `[B, count]` of the queries at storage positions `[first, first + count)` per row (the
        number of stored positions `j < stored` whose effective position is below `H(effective position of the
        query)`), with their minimum and maximum on the host. The same for every cell of the forward with this sink,
        window and page, so computed once per forward (`read.memo`: one host read per forward, not per cell)."""
        key = f"row-boundaries {self.sink} {self.window} {self.page} {first} {count} {stored}"  # str: a pytree
        hit = read.memo.get(key)
        if hit is None:
            effective = read.effective
            assert effective is not None  # noqa: S101 - callers check
            positions = torch.arange(first, first + count, device=effective.device)
            e = effective[:, positions]  # [B, k]
            h = self.sink + self.page * ((e - self.sink - self.window).clamp(min=0) // self.page)
            rows = torch.searchsorted(effective[:, :stored].contiguous(), h)
            low, high = torch.stack([rows.min(), rows.max()]).tolist()
            hit = read.memo[key] = (rows, int(low), int(high))
        return hit

    def history_ends(self, length: int, q: int, read: ReadState) -> tuple[torch.Tensor, int]:
        """`history_end` `[B, q]` of the queries at `[length, length + q)` and its maximum."""
        low = min(self.recent.start, length)  # below the own window only the history holds positions
        limit = max(low, self._history_limit(length, read))
        if read.effective is None:
            ends = [max(low, min(self.read_boundary(t), limit)) for t in range(length, length + q)]
            end_t = torch.tensor(ends, dtype=torch.int32, device=self.device)[None].expand(self._batch, q)
            return end_t, max(ends)
        rows, _, high = self._row_boundaries(length, q, read, length)
        return rows.clamp(min=low, max=limit).to(torch.int32), max(low, min(high, limit))

    def _keep_boundary(self, length: int, read: ReadState) -> int:
        """First position the own window keeps at `length` positions: `H(length - rollback)` (the smallest over rows
        with holes, page aligned), never below what it keeps now."""
        p = max(0, length - self.rollback)
        if read.effective is None:
            keep = self.read_boundary(p)
        else:
            keep = page_floor(self._row_boundaries(p, 1, read, length)[1], start=self.sink, page_size=self.page)
        return max(self.recent.start, keep)

    def _code_boundary(self, length: int, read: ReadState) -> int:
        """End of the history every later query reads at least: `H(length)` (the largest over rows with holes, page
        aligned and never past the last whole page)."""
        if read.effective is None:
            return self.read_boundary(length)
        high = self._row_boundaries(length, 1, read, length)[2]
        return min(
            page_floor(high, start=self.sink, page_size=self.page),
            page_floor(length, start=self.sink, page_size=self.page),
        )

    # ---------------------------------------------------------------- what subclasses provide
    def _history_limit(self, length: int, read: ReadState) -> int:
        """Positions below this can be read from the history now (the cell holds `length` positions)."""
        raise NotImplementedError

    def _history_view(self, end: int) -> tuple[object, object]:
        """Codes or a full-precision plane of the history, covering `[S, >= end)` (no copy)."""
        raise NotImplementedError

    def _history_decoded(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """History positions `[start, end)` as a query reads them, decoded to the keys' dtype (the plain path and
        inspection only; attention reads the codes)."""
        hk, hv = self._history_view(end)
        a, b = start - self.sink, end - self.sink
        if isinstance(hk, QuantizedKeys) and isinstance(hv, QuantizedValues):
            return dequantize_keys(hk, dtype=self.dtype)[:, :, a:b], dequantize_values(hv, dtype=self.dtype)[:, :, a:b]
        return hk[:, :, a:b], hv[:, :, a:b]  # type: ignore[index]

    def _store(self, key: torch.Tensor, value: torch.Tensor, first: int, new_len: int, read: ReadState) -> int:
        """Move what leaves the window into the history; `key`/`value` hold positions `[first, new_len)`. Returns the
        new keep boundary (the own window's first position)."""
        raise NotImplementedError

    # ---------------------------------------------------------------- read
    def view(self, key: torch.Tensor, value: torch.Tensor, read: ReadState) -> CellView:
        """The stored view the new tokens (`key`/`value` `[B, H, q, D]`) read, for `triton_ops.coded_attention`."""
        n, q = self.length, key.shape[2]
        ends, max_end = self.history_ends(n, q, read)
        sink_len = min(self.sink, n)
        sink_k, sink_v = self.sink_buf.view(0, sink_len) if sink_len else (None, None)
        hist_k, hist_v = self._history_view(max_end) if max_end > self.sink else (None, None)
        win_start = min(self.recent.start, n)
        win_k, win_v = self.recent.view(win_start, n) if n > win_start else (None, None)
        return CellView(
            new_key=key,
            new_value=value,
            length=n,
            history_end=ends,
            sink_key=sink_k,
            sink_value=sink_v,
            history_start=self.sink,
            history_key=hist_k,
            history_value=hist_v,
            window_start=win_start,
            window_key=win_k,
            window_value=win_v,
            key_valid=read.key_valid,
        )

    def attend(self, query, key, value, read):
        if not self.is_initialized:
            self.lazy_initialization(key, value)
        # the forward's key validity before its read: a page coded for the read (`ensure_codes`) leaves out the holes
        # a verification made since this cell's last write (a deep cell is not written by the drafts in between)
        self._track_valid(read, self.length + key.shape[2])
        if self.length == 0:  # nothing cached: plain causal attention over the new tokens (as every cell computes it)
            out = dense_attention(query, key, value, key_valid=read.key_valid, scaling=read.scaling)
        else:
            stats, tau = read.v_precision_stats, read.tau_for(query.shape[2])
            out, _ = coded_attention(
                query,
                self.view(key, value, read),
                scaling=read.scaling,
                v_precision_tau=tau,
                v_precision_stats=None if stats is None or tau is None else stats.tensor(query.device),
            )
        self._write(key, value, read)
        return out

    # ---------------------------------------------------------------- write
    def _write(self, key: torch.Tensor, value: torch.Tensor, read: ReadState) -> None:
        """Append `q` new positions: the sink first, then the history takes what leaves the window."""
        if not self.is_initialized:
            self.lazy_initialization(key, value)
        n, q = self.length, key.shape[2]
        new_len = n + q
        self._track_valid(read, new_len)
        n_sink = max(0, min(self.sink, new_len) - n)
        if n_sink:
            self.sink_buf.append(key[:, :, :n_sink], value[:, :, :n_sink])
            key, value = key[:, :, n_sink:], value[:, :, n_sink:]
        first = n + n_sink
        if first < new_len:
            keep = self._store(key, value, first, new_len, read)
            self.recent.drop_front(keep)
            skip = max(0, keep - first)
            self.recent.append(key[:, :, skip:], value[:, :, skip:])
        self.length = new_len

    def _track_valid(self, read: ReadState, new_len: int) -> None:
        """Keep the key validity of positions `[0, new_len)` (this forward's, which covers its new positions)."""
        n = self.length
        if read.key_valid is not None:  # one copy per forward, which every cell of it keeps (never written in place)
            memo_key = f"windowed-valid {new_len} {read.key_valid.device}"  # str keys: the cache stays a pytree
            if memo_key not in read.memo:
                read.memo[memo_key] = read.key_valid[:, :new_len].clone()
            self._valid = read.memo[memo_key]
        elif self._valid is not None and self._valid.shape[1] < new_len:
            self._valid = torch.cat([self._valid[:, :n], self._valid.new_ones(self._valid.shape[0], new_len - n)], dim=1)

    def update(self, key_states, value_states, *args, **kwargs):
        """Plain path for foreign models: every position as the last new token reads it (cached positions by the
        reading rule, history decoded, new positions at full precision), then store the new positions."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        read = ReadState(key_valid=None, scaling=1.0)
        q = key_states.shape[2]
        parts_k, parts_v = self._cached_parts(self.history_ends(self.length, q, read)[1] if self.length else 0)
        k = torch.cat([*parts_k, key_states], dim=2)
        v = torch.cat([*parts_v, value_states], dim=2)
        self._write(key_states, value_states, read)
        return k, v

    def _cached_parts(self, boundary: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Sink, history up to `boundary` (decoded) and the window from it, in the keys' dtype."""
        parts_k, parts_v = [], []
        if len(self.sink_buf):
            k, v = self.sink_buf.view(0, self.sink_buf.end)
            parts_k.append(k)
            parts_v.append(v)
        if boundary > self.sink:
            k, v = self._history_decoded(self.sink, boundary)
            parts_k.append(k)
            parts_v.append(v)
        start = max(boundary, min(self.recent.start, self.length))
        if start < self.length:
            k, v = self.recent.view(start, self.length)
            parts_k.append(k)
            parts_v.append(v)
        return parts_k, parts_v

    def full_states(self):
        """Every position as the next query (at position `length`) reads it."""
        if self.length == 0:
            raise ValueError("this cell holds no positions yet")
        read = ReadState(key_valid=None, scaling=1.0)
        parts_k, parts_v = self._cached_parts(self.history_ends(self.length, 1, read)[1])
        return torch.cat(parts_k, dim=2), torch.cat(parts_v, dim=2)

    # ---------------------------------------------------------------- crop and batch
    def _truncate_sink(self, length: int) -> None:
        self.sink_buf.truncate(length)
        self.recent.reset(self.sink)

    def _finish_truncate(self, length: int) -> None:
        self.length = length
        if self._valid is not None:
            self._valid = self._valid[:, :length]

    def reset(self) -> None:
        self.sink_buf.reset()
        self.recent.reset(self.sink)
        self.length = 0
        self._valid = None

    def reserve(self, max_length: int) -> None:
        if self.length == 0:
            self.recent.reserve = min(int(max_length), window_capacity(self.window, self.page, self.rollback))

    def _map_batch(self, fn):
        self.sink_buf.map_batch(fn)
        self.recent.map_batch(fn)
        if self._valid is not None:
            self._valid = fn(self._valid)

    def allocated_bytes(self) -> int:
        return self.sink_buf.allocated_bytes + self.recent.allocated_bytes

    def stored_bytes(self) -> int:
        return self.sink_buf.live_bytes + self.recent.live_bytes
