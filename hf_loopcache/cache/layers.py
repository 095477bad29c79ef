"""Per-cell storage: the `CacheLayerMixin` subclasses the `LoopCache` container holds, one per cell.

Two kinds:

- `DenseLayer`: every position at full precision (option `bf16`, in the dtype of the keys). The full cache, RIPE's
  deepest plane, prelude and coda use it.
- `WindowedLayer`: a full-precision sink (first `S` positions) and recent window (last `W` positions, plus up to a page
  and the rollback reserve), and a *history* for the positions in between that is either own KIVI codes (`int4`,
  `int2`) or borrowed from the final loop's cell of the same layer (`share`, which stores nothing).

Reading rule (the same for every cell, so block verification matches sequential decoding): the query at absolute
position `t` reads position `j < t` from the history iff `S <= j < H(t)`, with the window boundary
`H(t) = S + P * floor(max(0, t - S - W) / P)` (`P` = page size; `P = 1` gives RIPE's `t - j > W`). Positions of the
same forward pass are always read at full precision (prefill computes every loop's own keys and values). History
positions that have not been flushed yet (inside a multi-token block) are represented exactly as a flush would
represent them, so decoding a block of up to `W + 1` tokens in one pass equals decoding them one at a time.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any

import torch
from transformers.cache_utils import CacheLayerMixin

from hf_loopcache.attention import (
    AttentionInputs,
    Segment,
    VPrecision,
    causal_padding_mask,
    dense_attention,
    segmented_attention,
)
from hf_loopcache.cache.plan import window_boundary
from triton_ops.quant import (
    dequantize_keys,
    dequantize_values,
    quantize_keys,
    quantize_values,
)

if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = ["DenseLayer", "LoopLayerBase", "WindowedLayer"]


class _SeqBuffer:
    """Keys and values of the contiguous positions `[start, end)`, `[B, H, capacity, D]`, growing at the end and
    dropping at the front with amortised O(1) copying (compaction or growth by at least the live size)."""

    def __init__(self, doubling: bool = True) -> None:
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.lo = 0  # buffer index of position `start`
        self.start = 0
        self.end = 0
        # windows double (they are small and slide); whole-history buffers grow by 1/8 (at least 256 positions) so a
        # long cache never holds much more than it needs, at an amortised 8 copies per position
        self.doubling = doubling
        self.reserve = 0  # capacity to allocate up front (see `LoopCache.reserve`)

    def __len__(self) -> int:
        return self.end - self.start

    def reset(self, start: int = 0) -> None:
        self.k = self.v = None
        self.lo = 0
        self.start = self.end = start

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        n, q = len(self), k.shape[2]
        if q == 0:
            return
        if self.k is None or self.v is None:
            cap = max(q, self.reserve)
            self.k = k.new_empty((*k.shape[:2], cap, k.shape[3]))
            self.v = v.new_empty((*v.shape[:2], cap, v.shape[3]))
            self.lo = 0
        elif self.lo + n + q > self.k.shape[2]:
            cap = self.k.shape[2]
            if n + q <= cap and self.lo >= n:  # enough dead room at the front: compact in place (no overlap)
                self.k[:, :, :n] = self.k[:, :, self.lo : self.lo + n]
                self.v[:, :, :n] = self.v[:, :, self.lo : self.lo + n]
            else:
                spare = n if self.doubling else max(n // 8, 256)
                new_cap = max(n + q, n + spare)
                new_k = self.k.new_empty((*self.k.shape[:2], new_cap, self.k.shape[3]))
                new_v = self.v.new_empty((*self.v.shape[:2], new_cap, self.v.shape[3]))
                new_k[:, :, :n] = self.k[:, :, self.lo : self.lo + n]
                new_v[:, :, :n] = self.v[:, :, self.lo : self.lo + n]
                self.k, self.v = new_k, new_v
            self.lo = 0
        self.k[:, :, self.lo + n : self.lo + n + q] = k
        self.v[:, :, self.lo + n : self.lo + n + q] = v
        self.end += q

    def view(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.start <= start <= end <= self.end:
            raise IndexError(f"positions [{start}, {end}) are not in this buffer's [{self.start}, {self.end})")
        if self.k is None or self.v is None:
            raise IndexError("the buffer is empty")
        a, b = self.lo + start - self.start, self.lo + end - self.start
        return self.k[:, :, a:b], self.v[:, :, a:b]

    def drop_front(self, new_start: int) -> None:
        new_start = min(max(new_start, self.start), self.end)
        self.lo += new_start - self.start
        self.start = new_start
        if self.start == self.end:
            self.lo = 0

    def truncate(self, new_end: int) -> None:
        self.end = max(min(new_end, self.end), self.start)

    def map_batch(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        if self.k is not None and self.v is not None:
            self.k, self.v = fn(self.k), fn(self.v)

    @property
    def allocated_bytes(self) -> int:
        if self.k is None or self.v is None:
            return 0
        return self.k.numel() * self.k.element_size() + self.v.numel() * self.v.element_size()

    @property
    def live_bytes(self) -> int:
        if self.k is None or self.v is None:
            return 0
        per_pos = (self.k.numel() * self.k.element_size() + self.v.numel() * self.v.element_size()) // self.k.shape[2]
        return per_pos * len(self)


class _CodeStore:
    """History codes (`QuantizedKeys` or `QuantizedValues`) appended in place: buffers grow by doubling, reads are
    views of the live part, so a flush copies only the new page, not the whole history."""

    def __init__(self) -> None:
        self.buf: Any = None  # the container whose tensors are the capacity buffers
        self.tokens = 0

    def __bool__(self) -> bool:
        return self.tokens > 0

    @staticmethod
    def _tensors(item: Any) -> dict[str, torch.Tensor]:
        return {
            f.name: getattr(item, f.name)
            for f in dataclasses.fields(item)
            if isinstance(getattr(item, f.name), torch.Tensor)
        }

    def append(self, item: Any) -> None:
        if self.buf is None or self.tokens == 0:
            self.buf, self.tokens = item, item.num_tokens
            return
        new = self._tensors(item)
        ratio = {k: v.shape[2] / item.num_tokens for k, v in new.items()}
        need = self.tokens + item.num_tokens
        capacity = self.buf.num_tokens
        if need > capacity:
            grown = max(need, 2 * capacity)
            fields = {}
            for k, old in self._tensors(self.buf).items():
                t = old.new_empty((*old.shape[:2], int(grown * ratio[k]), *old.shape[3:]))
                live = int(self.tokens * ratio[k])
                t[:, :, :live] = old[:, :, :live]
                fields[k] = t
            self.buf = dataclasses.replace(self.buf, **fields)
        for k, t in new.items():
            start = int(self.tokens * ratio[k])
            getattr(self.buf, k)[:, :, start : start + t.shape[2]] = t
        self.tokens = need

    def view(self) -> Any:
        if self.buf is None or self.tokens == 0:
            return None
        if self.tokens == self.buf.num_tokens:
            return self.buf
        ratio = {k: v.shape[2] / self.buf.num_tokens for k, v in self._tensors(self.buf).items()}
        return dataclasses.replace(
            self.buf, **{k: v[:, :, : int(self.tokens * ratio[k])] for k, v in self._tensors(self.buf).items()}
        )

    def truncate(self, tokens: int) -> None:
        self.tokens = min(self.tokens, tokens)

    def select_batch(self, index: torch.Tensor) -> None:
        if self.buf is not None:
            self.buf = self.buf.index_select_batch(index.to(next(iter(self._tensors(self.buf).values())).device))

    def reset(self) -> None:
        self.buf, self.tokens = None, 0

    @property
    def allocated_bytes(self) -> int:
        return self.buf.nbytes if self.buf is not None else 0

    @property
    def live_bytes(self) -> int:
        view = self.view()
        return view.nbytes if view is not None else 0


class LoopLayerBase(CacheLayerMixin):
    """What every cell layer offers beyond `CacheLayerMixin`: cache-aware attention and history representation."""

    is_compileable = False
    is_croppable = True
    is_sliding = False

    def __init__(self) -> None:
        super().__init__()
        self.length = 0
        self.num_heads: int | None = None
        self.head_dim: int | None = None

    # ------------------------------------------------------------------ CacheLayerMixin
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.num_heads, self.head_dim = key_states.shape[1], key_states.shape[3]
        self.is_initialized = True

    def get_seq_length(self) -> int:
        return self.length

    def get_mask_sizes(self, query_length: int | torch.Tensor) -> tuple[int, int]:
        if isinstance(query_length, torch.Tensor):  # transformers <= 5.0 passed cache_position
            query_length = query_length.shape[0]
        return self.length + int(query_length), 0

    def get_max_length(self) -> int:
        return -1

    def get_max_cache_shape(self) -> int:
        return -1

    @property
    def batch_size(self) -> int | None:
        return self._batch if self.is_initialized else None

    def crop(self, tokens_to_remove: int) -> None:
        """Remove `-tokens_to_remove` positions (<= 0; transformers >= 5.16); a positive value is an absolute length."""
        target = self.length + tokens_to_remove if tokens_to_remove <= 0 else tokens_to_remove
        self.truncate(max(0, min(target, self.length)))

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.is_initialized:
            self.select_batch(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            self.select_batch(torch.arange(self._batch).repeat_interleave(repeats))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.is_initialized:
            if indices.dtype == torch.bool:
                indices = indices.nonzero().flatten()
            self.select_batch(indices)

    def select_batch(self, index: torch.Tensor) -> None:
        """Keep rows `index` (a LongTensor; repeats allowed) of every tensor, in that order."""
        self._map_batch(lambda t: t.index_select(0, index.to(t.device)))

    # ------------------------------------------------------------------ to implement
    def truncate(self, length: int) -> None:
        raise NotImplementedError

    def _map_batch(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        raise NotImplementedError

    def attend(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        inputs: AttentionInputs,
        v_precision: VPrecision | None = None,
    ) -> torch.Tensor:
        raise NotImplementedError

    def represent(
        self, start: int, end: int, with_cold: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Keys, values (and, for INT4 values, cold-minus-hot deltas) of positions `[start, end)` as this cell's history
        stores them, `[B, H, end - start, D]` (stored dtype, or fp32 when decoded from codes). Positions not yet
        flushed are represented as a flush would."""
        raise NotImplementedError

    def represent_limit(self) -> int:
        """Positions `< represent_limit()` can be represented."""
        return self.length

    def full_states(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every position as this cell would read it from its history (sink and window exact), in the keys' dtype."""
        raise NotImplementedError

    def allocated_bytes(self) -> int:
        raise NotImplementedError

    def stored_bytes(self) -> int:
        raise NotImplementedError

    @property
    def _batch(self) -> int:
        raise NotImplementedError


class DenseLayer(LoopLayerBase):
    """Every position of the cell at full precision (option `bf16`)."""

    def __init__(self) -> None:
        super().__init__()
        self.buf = _SeqBuffer(doubling=False)

    @property
    def _batch(self) -> int:
        return self.buf.k.shape[0] if self.buf.k is not None else 0

    def _append(self, key: torch.Tensor, value: torch.Tensor) -> None:
        if not self.is_initialized:
            self.lazy_initialization(key, value)
        self.buf.append(key, value)
        self.length = self.buf.end

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        self._append(key_states, value_states)
        return self.buf.view(0, self.length)

    # transformers' `CacheLayerMixin` attributes, read by code written for its own layers: every stored position
    @property
    def keys(self) -> torch.Tensor | None:  # type: ignore[override]
        return self.buf.view(0, self.length)[0] if self.length else None

    @keys.setter
    def keys(self, value: torch.Tensor | None) -> None:
        if value is not None:
            raise AttributeError("a DenseLayer's `keys` are its storage; write them with `update`")

    @property
    def values(self) -> torch.Tensor | None:  # type: ignore[override]
        return self.buf.view(0, self.length)[1] if self.length else None

    @values.setter
    def values(self, value: torch.Tensor | None) -> None:
        if value is not None:
            raise AttributeError("a DenseLayer's `values` are its storage; write them with `update`")

    def attend(self, query, key, value, inputs, v_precision=None):
        self._append(key, value)
        k, v = self.buf.view(0, self.length)
        return dense_attention(query, k, v, key_valid=inputs.key_valid, scaling=inputs.scaling)

    def represent(self, start, end, with_cold=False):
        k, v = self.buf.view(start, end)
        return k, v, None

    def full_states(self):
        if self.length == 0:
            raise ValueError("this cell holds no positions yet")
        return self.buf.view(0, self.length)

    def truncate(self, length: int) -> None:
        self.buf.truncate(length)
        self.length = self.buf.end

    def reset(self) -> None:
        self.buf.reset()
        self.length = 0

    def _map_batch(self, fn):
        self.buf.map_batch(fn)

    def allocated_bytes(self) -> int:
        return self.buf.allocated_bytes

    def stored_bytes(self) -> int:
        return self.buf.live_bytes


class WindowedLayer(LoopLayerBase):
    """Sink + recent window at full precision, history as own KIVI codes or borrowed from a source cell.

    Args:
        option (`str`): `"int4"`, `"int2"` or `"share"`.
        sink (`int`): `S`, full-precision positions at the start.
        window (`int`): `W`, full-precision recent positions every query reads.
        page_size (`int`): `P`, positions leave the window in pages of `P` (the key quantization group).
        group_size (`int`): channel group of the value codes.
        rollback (`int`): extra recent positions kept at full precision so `crop` by up to this many stays exact.
        source (`LoopLayerBase`, *optional*): for `share`, the cell whose history this one reads.
    """

    def __init__(
        self,
        option: str,
        *,
        sink: int,
        window: int,
        page_size: int,
        group_size: int,
        rollback: int = 0,
        source: LoopLayerBase | None = None,
    ) -> None:
        super().__init__()
        if option not in ("int4", "int2", "share"):
            raise ValueError(f"`option` must be one of ('int4', 'int2', 'share'), got {option!r}")
        if (option == "share") != (source is not None):
            raise ValueError("a `share` layer needs a `source` layer, and only a `share` layer takes one")
        self.option = option
        self.nbits: int = {"int4": 4, "int2": 2, "share": 0}[option]  # 0: no own codes
        self.owner: Any = None  # the LoopCache, set by it (tells whether a forward runs every loop)
        self.sink, self.window, self.page, self.group, self.rollback = sink, window, page_size, group_size, rollback
        self.source = source
        self.sink_buf = _SeqBuffer()
        self.recent = _SeqBuffer()  # positions [self.hist_end, self.length)
        self.hist_end = sink  # history holds [sink, hist_end)
        self.recent.reset(sink)
        self.codes_k = _CodeStore()  # QuantizedKeys of the pages [sink, hist_end)
        self.codes_v = _CodeStore()  # QuantizedValues of the same positions
        self._valid: torch.Tensor | None = None  # [B, length] key validity once any padding was seen

    @property
    def _batch(self) -> int:
        return (
            self.sink_buf.k.shape[0]
            if self.sink_buf.k is not None
            else (self.recent.k.shape[0] if self.recent.k is not None else 0)
        )

    # ---------------------------------------------------------------- boundaries
    def read_boundary(self, t: int) -> int:
        """`H(t)`: the query at position `t` reads positions `[S, H(t))` from the history."""
        return window_boundary(t, sink=self.sink, window=self.window, page_size=self.page)

    def keep_boundary(self, length: int) -> int:
        """History boundary to keep after reaching `length` positions (the rollback reserve stays at full precision)."""
        return self.read_boundary(length - self.rollback)

    def history_boundary(self, t: int) -> int:
        """Positions `[S, history_boundary(t))` are read from the history by the query at position `t >= length`:
        `H(t)`, but never below what is already flushed, beyond the cached positions, or beyond what can be
        represented (a shared cell's source may hold fewer positions during a partial-depth draft)."""
        return max(self.hist_end, min(self.read_boundary(t), self.length, self.represent_limit()))

    # ---------------------------------------------------------------- history representation
    def represent_limit(self) -> int:
        if self.source is not None:
            return min(self.length, self.source.represent_limit())
        return self.length

    def represent(self, start, end, with_cold=False):
        if self.source is not None:
            return self.source.represent(start, end, with_cold)
        if end <= start:
            empty = self._empty(0)
            return empty, empty, (empty if with_cold and self.nbits == 4 else None)
        parts_k, parts_v, parts_c = [], [], []
        stored_end = min(end, self.hist_end)
        if start < stored_end:
            p0, p1 = (start - self.sink) // self.page, math.ceil((stored_end - self.sink) / self.page)
            qk = self.codes_k.view().select_pages(p0, p1)
            qv = self.codes_v.view().select_tokens(p0 * self.page, p1 * self.page)
            lo = start - (self.sink + p0 * self.page)
            hi = lo + stored_end - start
            k, v, c = self._decode(qk, qv, with_cold)
            parts_k.append(k[:, :, lo:hi])
            parts_v.append(v[:, :, lo:hi])
            parts_c.append(c[:, :, lo:hi] if c is not None else None)
        pend_start = max(start, self.hist_end)
        if pend_start < end:
            k, v, c = self._pending(pend_start, end, with_cold)
            parts_k.append(k)
            parts_v.append(v)
            parts_c.append(c)
        cold = None
        if with_cold and self.nbits == 4:
            cold = torch.cat([c for c in parts_c if c is not None], dim=2)
        return torch.cat(parts_k, dim=2), torch.cat(parts_v, dim=2), cold

    def _decode(self, qk, qv, with_cold):
        k = dequantize_keys(qk)
        v = dequantize_values(qv)
        cold = None
        if with_cold and self.nbits == 4:
            all_cold = torch.zeros(v.shape[:3], dtype=torch.bool, device=v.device)
            cold = dequantize_values(qv, hot=all_cold) - v
        return k, v, cold

    def _pending(self, start: int, end: int, with_cold: bool):
        """Positions `[start, end)` of the recent window, represented as a flush will represent them."""
        p_start = self.sink + self.page * ((start - self.sink) // self.page)
        p_end = self.sink + self.page * math.ceil((end - self.sink) / self.page)
        if p_end > self.length:  # an incomplete page cannot be coded as a flush would: read it exactly
            k, v = self.recent.view(start, end)
            return (
                k.float(),
                v.float(),
                (torch.zeros_like(v, dtype=torch.float32) if with_cold and self.nbits == 4 else None),
            )
        k, v = self.recent.view(p_start, p_end)
        qk = quantize_keys(k, self.nbits, group_size=self.page, valid=self._valid_slice(p_start, p_end))
        qv = quantize_values(v, self.nbits, group_size=self.group)
        k, v, c = self._decode(qk, qv, with_cold)
        a, b = start - p_start, end - p_start
        return k[:, :, a:b], v[:, :, a:b], (c[:, :, a:b] if c is not None else None)

    def _valid_slice(self, start: int, end: int) -> torch.Tensor | None:
        return None if self._valid is None else self._valid[:, start:end]

    def _empty(self, length: int) -> torch.Tensor:
        return torch.zeros(
            self._batch, self.num_heads or 0, length, self.head_dim or 0, device=getattr(self, "device", None)
        )

    # ---------------------------------------------------------------- writes
    def _write(self, key: torch.Tensor, value: torch.Tensor, key_valid: torch.Tensor | None) -> None:
        """Append `q` new positions, then move everything older than the keep boundary into the history."""
        if not self.is_initialized:
            self.lazy_initialization(key, value)
        n, q = self.length, key.shape[2]
        new_len = n + q
        if key_valid is not None:
            self._valid = key_valid[:, :new_len].clone()
        elif self._valid is not None:
            self._valid = torch.cat([self._valid[:, :n], self._valid.new_ones(self._valid.shape[0], q)], dim=1)
        n_sink = max(0, min(self.sink, new_len) - n)
        if n_sink:
            self.sink_buf.append(key[:, :, :n_sink], value[:, :, :n_sink])
            key, value = key[:, :, n_sink:], value[:, :, n_sink:]
        first_new = n + n_sink
        target = max(self.hist_end, self.keep_boundary(new_len))
        if self.source is not None:  # never drop a position the source will not hold after this forward
            complete = self.owner is None or self.owner._depth_complete
            cap = self.source.represent_limit() + (q if complete else 0)
            target = min(target, max(self.hist_end, cap))
        if target > self.hist_end:
            old_k, old_v = (
                self.recent.view(self.hist_end, min(first_new, target)) if first_new > self.hist_end else (None, None)
            )
            take = max(0, target - first_new)
            moved_k = [t for t in (old_k, key[:, :, :take]) if t is not None and t.shape[2]]
            moved_v = [t for t in (old_v, value[:, :, :take]) if t is not None and t.shape[2]]
            if self.nbits:
                self._flush(torch.cat(moved_k, dim=2), torch.cat(moved_v, dim=2), self.hist_end, target)
            self.recent.drop_front(target)
            if self.recent.start < target:  # the recent buffer was empty below `target`
                self.recent.reset(target)
            key, value = key[:, :, take:], value[:, :, take:]
            self.hist_end = target
        self.recent.append(key, value)
        self.length = new_len

    def _flush(self, k: torch.Tensor, v: torch.Tensor, start: int, end: int) -> None:
        qk = quantize_keys(k, self.nbits, group_size=self.page, valid=self._valid_slice(start, end))
        qv = quantize_values(v, self.nbits, group_size=self.group)
        self.codes_k.append(qk)
        self.codes_v.append(qv)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Plain path for foreign models: every position as the last new token reads it (cached positions by the
        reading rule, new positions at full precision), then store the new positions."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        parts_k, parts_v = self._cached_parts(self.history_boundary(self.length + key_states.shape[2] - 1))
        k = torch.cat([*parts_k, key_states], dim=2)
        v = torch.cat([*parts_v, value_states], dim=2)
        self._write(key_states, value_states, None)
        return k, v

    def _cached_parts(self, boundary: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Sink, history up to `boundary` and the recent window from it, in the keys' dtype."""
        parts_k, parts_v = [], []
        if len(self.sink_buf):
            k, v = self.sink_buf.view(0, self.sink_buf.end)
            parts_k.append(k)
            parts_v.append(v)
        if boundary > self.sink:
            k, v, _ = self.represent(self.sink, boundary)
            parts_k.append(k.to(self.dtype))
            parts_v.append(v.to(self.dtype))
        if boundary < self.length:
            k, v = self.recent.view(boundary, self.length)
            parts_k.append(k)
            parts_v.append(v)
        return parts_k, parts_v

    def full_states(self):
        """Every position as the next query (at position `length`) reads it."""
        if self.length == 0:
            raise ValueError("this cell holds no positions yet")
        parts_k, parts_v = self._cached_parts(self.history_boundary(self.length))
        return torch.cat(parts_k, dim=2), torch.cat(parts_v, dim=2)

    # ---------------------------------------------------------------- attention
    def attend(self, query, key, value, inputs, v_precision=None):
        if not self.is_initialized:
            self.lazy_initialization(key, value)
        n, q = self.length, key.shape[2]
        if n == 0:  # nothing cached: plain causal attention over the new tokens (as every other cell computes it)
            out = dense_attention(query, key, value, key_valid=inputs.key_valid, scaling=inputs.scaling)
            self._write(key, value, inputs.key_valid)
            return out
        device = query.device
        key_valid = inputs.key_valid
        queries = torch.arange(n, n + q, device=device)
        bounds = [self.history_boundary(t) for t in range(n, n + q)]  # per query: history below, own at and above
        hist_max, moving = bounds[-1], bounds[0] != bounds[-1]
        # per-query masks are needed when the boundary moves inside the block or reaches into the own window
        limits = torch.tensor(bounds, device=device)[:, None] if moving or hist_max > self.hist_end else None
        segments: list[Segment] = []
        if len(self.sink_buf):
            k, v = self.sink_buf.view(0, self.sink_buf.end)
            pos = torch.arange(0, self.sink_buf.end, device=device)
            segments.append(Segment(k, v, _padding_only(queries, pos, key_valid), is_sink=True))
        if hist_max > self.sink:
            with_cold = v_precision is not None and self._reads_int4()
            k, v, cold = self.represent(self.sink, hist_max, with_cold)
            pos = torch.arange(self.sink, hist_max, device=device)
            mask = (pos[None, :] < limits)[None, None] if moving and limits is not None else None
            segments.append(Segment(k, v, _and(mask, _padding_only(queries, pos, key_valid)), cold_delta=cold))
        own_start = max(self.sink, self.hist_end)
        if own_start < n:
            k, v = self.recent.view(own_start, n)
            pos = torch.arange(own_start, n, device=device)
            mask = (pos[None, :] >= limits)[None, None] if limits is not None else None
            segments.append(Segment(k, v, _and(mask, _padding_only(queries, pos, key_valid))))
        segments.append(Segment(key, value, causal_padding_mask(queries, queries, key_valid)))
        stats = self.owner.v_precision_stats if self.owner is not None and v_precision is not None else None
        out = segmented_attention(query, segments, scaling=inputs.scaling, v_precision=v_precision, stats=stats)
        self._write(key, value, key_valid)
        return out

    def _reads_int4(self) -> bool:
        layer: LoopLayerBase = self.source if self.source is not None else self
        return isinstance(layer, WindowedLayer) and layer.nbits == 4

    # ---------------------------------------------------------------- crop and batch
    def truncate(self, length: int) -> None:
        if length >= self.length:
            return
        if length <= self.sink:
            self.sink_buf.truncate(length)
            self.recent.reset(self.sink)
            self.hist_end = self.sink
            self.codes_k.reset()
            self.codes_v.reset()
        elif length >= self.hist_end:
            self.recent.truncate(length)
        elif self.source is not None:
            self.recent.reset(length)
            self.hist_end = length
        else:  # un-flush the page that straddles `length` back to full precision (decoded from its codes)
            page = (length - self.sink) // self.page
            page_start = self.sink + page * self.page
            k, v = None, None
            if length > page_start:
                k, v, _ = self.represent(page_start, length)
            self.codes_k.truncate(page * self.page)
            self.codes_v.truncate(page * self.page)
            self.recent.reset(page_start)
            self.hist_end = page_start
            if k is not None and v is not None:
                self.recent.append(k.to(self.dtype), v.to(self.dtype))
        self.length = length
        if self._valid is not None:
            self._valid = self._valid[:, :length]

    def reset(self) -> None:
        self.sink_buf.reset()
        self.recent.reset(self.sink)
        self.hist_end = self.sink
        self.codes_k.reset()
        self.codes_v.reset()
        self.length = 0
        self._valid = None

    def select_batch(self, index: torch.Tensor) -> None:
        super().select_batch(index)
        self.codes_k.select_batch(index)
        self.codes_v.select_batch(index)

    def _map_batch(self, fn):
        self.sink_buf.map_batch(fn)
        self.recent.map_batch(fn)
        if self._valid is not None:
            self._valid = fn(self._valid)

    # ---------------------------------------------------------------- accounting
    def allocated_bytes(self) -> int:
        coded = self.codes_k.allocated_bytes + self.codes_v.allocated_bytes
        return self.sink_buf.allocated_bytes + self.recent.allocated_bytes + coded

    def stored_bytes(self) -> int:
        coded = self.codes_k.live_bytes + self.codes_v.live_bytes
        return self.sink_buf.live_bytes + self.recent.live_bytes + coded


def _padding_only(queries: torch.Tensor, keys: torch.Tensor, key_valid: torch.Tensor | None) -> torch.Tensor | None:
    """Visibility of cached keys (all earlier than every query) under padding only; None when nothing is padded."""
    if key_valid is None:
        return None
    return key_valid[:, keys][:, None, None, :].expand(-1, 1, queries.shape[0], -1)


def _and(a: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor | None:
    if a is None:
        return b
    if b is None:
        return a
    return a & b
