"""`CodedLayer`: a windowed cell whose history is its own KIVI codes (options `int4`, `int2`)."""

from __future__ import annotations

import math

import torch

from hf_loopcache.cache.layers.windowed import WindowedLayer
from hf_loopcache.cache.storage import PageStore, page_floor, quantize_pages
from triton_ops.quant import dequantize_keys, dequantize_values

__all__ = ["CodedLayer"]

_CODE_CHUNK_PAGES = 32
"""Pages quantized per call when many leave the window at once (a prefill): bounds the fp32 transient."""


class CodedLayer(WindowedLayer):
    """Sink and window at full precision; the pages in between as own codes (keys per channel over the page, values
    per token in channel groups, fp16 scale and zero; INT4 values as `hi`/`lo` 2-bit planes).

    A page is coded once, when the first query reads it from the history or when it leaves the window, whichever
    comes first; its codes are a function of its stored keys and values only, so coding early changes nothing.
    Codes cover `[S, code_end)`; the window `[recent.start, length)` overlaps them by the rollback reserve.

    Args:
        nbits (`int`): 4 or 2.
        sink, window, page_size, rollback: see `WindowedLayer`.
        group_size (`int`): channel group of the value codes.
    """

    def __init__(
        self, nbits: int, *, sink: int, window: int, page_size: int, group_size: int, rollback: int = 0
    ) -> None:
        super().__init__(sink=sink, window=window, page_size=page_size, rollback=rollback)
        if nbits not in (2, 4):
            raise ValueError(f"`nbits` must be one of (2, 4), got {nbits!r}")
        self.nbits, self.group = nbits, group_size
        self.pages = PageStore(page_size=page_size)

    @property
    def option(self) -> str:
        return f"int{self.nbits}"

    @property
    def code_end(self) -> int:
        """Codes cover positions `[S, code_end)`."""
        return self.sink + self.pages.tokens

    # ---------------------------------------------------------------- codes
    def _code(self, key: torch.Tensor, value: torch.Tensor, start: int) -> None:
        """Append the codes of whole pages `key`/`value` `[B, H, k * P, D]` of positions `[start, ...)`, a few pages
        at a time (a long prefill never holds an fp32 copy of all its keys)."""
        step = _CODE_CHUNK_PAGES * self.page
        for a in range(0, key.shape[2], step):
            b = min(a + step, key.shape[2])
            valid = None if self._valid is None else self._valid[:, start + a : start + b]
            qk, qv = quantize_pages(
                key[:, :, a:b], value[:, :, a:b], self.nbits, page_size=self.page, group_size=self.group, valid=valid
            )
            self.pages.append(qk, qv)

    def ensure_codes(self, end: int) -> None:
        """Code every page below `end` (rounded up to a page) that is not coded yet, from the window."""
        target = self.sink + self.page * math.ceil(max(0, end - self.sink) / self.page)
        if target > self.code_end:
            k, v = self.recent.view(self.code_end, target)
            self._code(k, v, self.code_end)

    # ---------------------------------------------------------------- source side
    def readable_limit(self, length=None):
        length = self.length if length is None else length
        return page_floor(length, start=self.sink, page_size=self.page) if length > self.sink else length

    def history_view(self, start, end):
        if start != self.sink:
            raise ValueError(f"coded history starts at the sink ({self.sink}), got start={start}")
        self.ensure_codes(end)
        pages = math.ceil((end - self.sink) / self.page)
        return self.pages.keys(pages), self.pages.values(pages)

    def decoded(self, start, end):
        if end <= start:
            empty = torch.zeros(
                (self._batch, self.num_heads or 0, 0, self.head_dim or 0), dtype=self.dtype, device=self.device
            )
            return empty, empty
        if start >= self.recent.start:
            return self.recent.view(start, end)
        p0 = (start - self.sink) // self.page
        p1 = math.ceil((end - self.sink) / self.page)
        qk = self.pages.keys(p1).select_pages(p0, p1)
        qv = self.pages.values(p1).select_tokens(p0 * self.page, p1 * self.page)
        a, b = start - self.sink - p0 * self.page, end - self.sink - p0 * self.page
        k = dequantize_keys(qk, dtype=self.dtype)[:, :, a:b]
        v = dequantize_values(qv, dtype=self.dtype)[:, :, a:b]
        return k, v

    # ---------------------------------------------------------------- WindowedLayer hooks
    def _history_limit(self, length, read):
        return self.readable_limit(length)

    def _history_view(self, end):
        return self.history_view(self.sink, end)

    def _store(self, key, value, first, new_len, read):
        code_to = max(self.code_end, self._code_boundary(new_len, read))
        keep = min(self._keep_boundary(new_len, read), code_to)
        if code_to > self.code_end:
            parts_k, parts_v = [], []
            start = self.code_end
            if start < first:  # the window's part
                k, v = self.recent.view(start, min(first, code_to))
                parts_k.append(k)
                parts_v.append(v)
            if code_to > first:  # the new positions' part
                a = max(start, first) - first
                parts_k.append(key[:, :, a : code_to - first])
                parts_v.append(value[:, :, a : code_to - first])
            k = parts_k[0] if len(parts_k) == 1 else torch.cat(parts_k, dim=2)
            v = parts_v[0] if len(parts_v) == 1 else torch.cat(parts_v, dim=2)
            self._code(k, v, start)
        return keep

    # ---------------------------------------------------------------- crop and batch
    def truncate(self, length: int) -> None:
        if length >= self.length:
            return
        if length <= self.sink:
            self._truncate_sink(length)
            self.pages.reset()
        elif length >= self.recent.start:
            self.recent.truncate(length)
            keep_codes = max(self.recent.start, self.read_boundary(length))
            self.pages.truncate((keep_codes - self.sink) // self.page)
        else:  # below the rollback reserve: the page that straddles `length` goes back to the window, decoded
            page_start = page_floor(length, start=self.sink, page_size=self.page)
            k, v = self.decoded(page_start, length) if length > page_start else (None, None)
            self.pages.truncate((page_start - self.sink) // self.page)
            self.recent.reset(page_start)
            if k is not None and v is not None:
                self.recent.append(k, v)
        self._finish_truncate(length)

    def reset(self) -> None:
        super().reset()
        self.pages.reset()

    def reserve(self, max_length: int) -> None:
        super().reserve(max_length)
        if self.length == 0:  # codes end at the read boundary `H(max_length)`: the window's positions are never coded
            self.pages.reserve_pages = max(0, (int(max_length) - self.sink - self.window) // self.page)

    def select_batch(self, index: torch.Tensor) -> None:
        super().select_batch(index)
        self.pages.select_batch(index)

    def allocated_bytes(self) -> int:
        return super().allocated_bytes() + self.pages.allocated_bytes

    def stored_bytes(self) -> int:
        return super().stored_bytes() + self.pages.live_bytes
