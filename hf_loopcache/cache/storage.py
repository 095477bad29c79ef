"""Growable storage of one cell: a full-precision stretch of positions (`SeqBuffer`) and KIVI code pages
(`PageStore`). Reads are views of the live part; writes copy only what is new; capacity grows by an eighth (at least
`min_growth`), so a long cache never holds much more than it needs and regrows rarely (or never, after `reserve`)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from triton_ops.quant import QuantizedKeys, QuantizedValues, quantize_keys, quantize_values

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch

__all__ = ["PageStore", "SeqBuffer", "quantize_pages"]


def _grown(live: int, need: int, min_growth: int) -> int:
    return max(need, live + max(live // 8, min_growth))


def quantize_pages(
    key: torch.Tensor,
    value: torch.Tensor,
    nbits: int,
    *,
    page_size: int,
    group_size: int,
    valid: torch.Tensor | None,
    check_finite: bool = True,
) -> tuple[QuantizedKeys, QuantizedValues]:
    """Codes of whole pages `[B, H, n * page_size, D]` (the flush and on-demand coding both go through here): keys per
    channel over pages (padding left out of each page's min/max), values per token in channel groups.
    `check_finite=False` skips the finite check of the scales (a host read; a static cell's captured flush)."""
    qk = quantize_keys(key, nbits, group_size=page_size, valid=valid, check_finite=check_finite)
    qv = quantize_values(value, nbits, group_size=group_size, check_finite=check_finite)
    return qk, qv


class SeqBuffer:
    """Keys and values of the contiguous positions `[start, end)`, `[B, H, capacity, D]`, growing at the end and
    dropping at the front with amortised O(1) copying (compaction in place, or growth)."""

    def __init__(self, *, min_growth: int = 256) -> None:
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.lo = 0  # buffer index of position `start`
        self.start = 0
        self.end = 0
        self.min_growth = min_growth
        self.reserve = 0  # capacity to allocate at the first write (see `LoopCache.reserve`)

    def __len__(self) -> int:
        return self.end - self.start

    def reset(self, start: int = 0) -> None:
        """Empty, starting at `start` (keeps no tensors)."""
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
            if n + q <= cap:  # enough dead room at the front: compact in place
                # in pieces of at most `lo` positions, front to back: no piece overlaps its own source, and no source
                # is overwritten before it is copied (a buffer sized a little above its live part needs no copy of it)
                for a in range(0, n, self.lo):
                    b = min(a + self.lo, n)
                    self.k[:, :, a:b] = self.k[:, :, self.lo + a : self.lo + b]
                    self.v[:, :, a:b] = self.v[:, :, self.lo + a : self.lo + b]
            else:
                new_cap = _grown(n, n + q, self.min_growth)
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
        """Views of positions `[start, end)`."""
        if not self.start <= start <= end <= self.end:
            raise IndexError(f"positions [{start}, {end}) are not in this buffer's [{self.start}, {self.end})")
        if self.k is None or self.v is None:
            raise IndexError("the buffer is empty")
        a, b = self.lo + start - self.start, self.lo + end - self.start
        return self.k[:, :, a:b], self.v[:, :, a:b]

    def drop_front(self, new_start: int) -> None:
        """Forget positions below `new_start`; if that is past the end, the buffer restarts empty at `new_start`."""
        if new_start >= self.end:
            self.lo, self.start, self.end = 0, new_start, new_start
            return
        new_start = max(new_start, self.start)
        self.lo += new_start - self.start
        self.start = new_start

    def truncate(self, new_end: int) -> None:
        self.end = max(min(new_end, self.end), self.start)

    def map_batch(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        if self.k is not None and self.v is not None:
            self.k, self.v = fn(self.k), fn(self.v)

    @property
    def batch_size(self) -> int | None:
        return None if self.k is None else self.k.shape[0]

    @property
    def allocated_bytes(self) -> int:
        if self.k is None or self.v is None:
            return 0
        return self.k.numel() * self.k.element_size() + self.v.numel() * self.v.element_size()

    @property
    def live_bytes(self) -> int:
        if self.k is None or self.v is None:
            return 0
        return self.allocated_bytes // self.k.shape[2] * len(self)


class PageStore:
    """Code pages of one coded cell: `QuantizedKeys` / `QuantizedValues` whose tensors are capacity buffers, and the
    number of live pages. Reads (`keys`, `values`) are views of the first pages; appends write only the new pages."""

    def __init__(self, *, page_size: int, min_growth_pages: int = 8) -> None:
        self.page_size = page_size
        self.min_growth_pages = min_growth_pages
        self.reserve_pages = 0  # capacity to allocate at the first write (see `LoopCache.reserve`)
        self.qk: QuantizedKeys | None = None
        self.qv: QuantizedValues | None = None
        self.pages = 0

    @property
    def tokens(self) -> int:
        return self.pages * self.page_size

    def reset(self) -> None:
        self.qk = self.qv = None
        self.pages = 0

    def truncate(self, pages: int) -> None:
        self.pages = max(0, min(self.pages, pages))

    def keys(self, pages: int | None = None) -> QuantizedKeys:
        """Views of the first `pages` live pages (all by default)."""
        pages = self.pages if pages is None else pages
        if self.qk is None or not 0 <= pages <= self.pages:
            raise IndexError(f"{pages} pages requested, {self.pages} stored")
        return self.qk.select_pages(0, pages)

    def values(self, pages: int | None = None) -> QuantizedValues:
        pages = self.pages if pages is None else pages
        if self.qv is None or not 0 <= pages <= self.pages:
            raise IndexError(f"{pages} pages requested, {self.pages} stored")
        return self.qv.select_tokens(0, pages * self.page_size)

    def append(self, qk: QuantizedKeys, qv: QuantizedValues) -> None:
        new = qk.num_pages
        if new == 0:
            return
        need = self.pages + new
        if self.qk is None or self.qv is None:
            self.qk, self.qv = self._allocate(qk, qv, max(need, self.reserve_pages))
        elif need > self.qk.num_pages:
            old_k, old_v = self.qk, self.qv
            self.qk, self.qv = self._allocate(qk, qv, _grown(self.pages, need, self.min_growth_pages))
            self._write(0, old_k.select_pages(0, self.pages), old_v.select_tokens(0, self.tokens))
        self._write(self.pages, qk, qv)
        self.pages = need

    def _allocate(self, qk: QuantizedKeys, qv: QuantizedValues, pages: int) -> tuple[QuantizedKeys, QuantizedValues]:
        tokens = pages * self.page_size

        def like(t: torch.Tensor, length: int) -> torch.Tensor:
            return t.new_empty((*t.shape[:2], length, *t.shape[3:]))

        keys = QuantizedKeys(
            codes=like(qk.codes, tokens),
            scale=like(qk.scale, pages),
            zero=like(qk.zero, pages),
            nbits=qk.nbits,
            group_size=qk.group_size,
        )
        values = QuantizedValues(
            hi=like(qv.hi, tokens),
            lo=None if qv.lo is None else like(qv.lo, tokens),
            scale=like(qv.scale, tokens),
            zero=like(qv.zero, tokens),
            nbits=qv.nbits,
            group_size=qv.group_size,
        )
        return keys, values

    def _write(self, page: int, qk: QuantizedKeys, qv: QuantizedValues) -> None:
        assert self.qk is not None and self.qv is not None  # noqa: S101 - internal invariant, set by the caller
        p0, p1 = page, page + qk.num_pages
        t0, t1 = p0 * self.page_size, p1 * self.page_size
        self.qk.codes[:, :, t0:t1] = qk.codes
        self.qk.scale[:, :, p0:p1] = qk.scale
        self.qk.zero[:, :, p0:p1] = qk.zero
        self.qv.hi[:, :, t0:t1] = qv.hi
        if self.qv.lo is not None and qv.lo is not None:
            self.qv.lo[:, :, t0:t1] = qv.lo
        self.qv.scale[:, :, t0:t1] = qv.scale
        self.qv.zero[:, :, t0:t1] = qv.zero

    def select_batch(self, index: torch.Tensor) -> None:
        if self.qk is not None and self.qv is not None:
            index = index.to(self.qk.codes.device)
            self.qk, self.qv = self.qk.index_select_batch(index), self.qv.index_select_batch(index)

    @property
    def batch_size(self) -> int | None:
        return None if self.qk is None else self.qk.codes.shape[0]

    @property
    def allocated_bytes(self) -> int:
        return 0 if self.qk is None or self.qv is None else self.qk.nbytes + self.qv.nbytes

    @property
    def live_bytes(self) -> int:
        if self.qk is None or self.qv is None or self.pages == 0:
            return 0
        return self.keys().nbytes + self.values().nbytes


def page_floor(position: int, *, start: int, page_size: int) -> int:
    """The largest page boundary `start + k * page_size` at or below `position` (`start` when below it)."""
    return start + page_size * max(0, (position - start) // page_size)


def page_ceil(position: int, *, start: int, page_size: int) -> int:
    """The smallest page boundary at or above `position` (`start` when below it)."""
    return start + page_size * max(0, math.ceil((position - start) / page_size))
