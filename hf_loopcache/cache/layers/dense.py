"""`DenseLayer`: every position of the cell at full precision (option `bf16`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from hf_loopcache.attention import dense_attention
from hf_loopcache.cache.layers.base import LoopLayerBase
from hf_loopcache.cache.storage import SeqBuffer

if TYPE_CHECKING:
    import torch

__all__ = ["DenseLayer"]


class DenseLayer(LoopLayerBase):
    """Every position at full precision, in the dtype of the keys. The full cache, RIPE's deepest plane, prelude and
    coda use it. Attention is `dense_attention` (SDPA); a shared cell reads this cell's buffer in place."""

    def __init__(self) -> None:
        super().__init__()
        self.buf = SeqBuffer()

    def _append(self, key, value) -> None:
        if not self.is_initialized:
            self.lazy_initialization(key, value)
        self.buf.append(key, value)
        self.length = self.buf.end

    def update(self, key_states, value_states, *args, **kwargs):
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

    def attend(self, query, key, value, read):
        self._append(key, value)
        k, v = self.buf.view(0, self.length)
        return dense_attention(query, k, v, key_valid=read.key_valid, scaling=read.scaling, memo=read.memo)

    def full_states(self):
        if self.length == 0:
            raise ValueError("this cell holds no positions yet")
        return self.buf.view(0, self.length)

    def readable_limit(self, length=None):
        return self.length if length is None else length

    def history_view(self, start, end):
        return self.buf.view(start, end)

    def decoded(self, start, end):
        return self.buf.view(start, end)

    def truncate(self, length: int) -> None:
        self.buf.truncate(length)
        self.length = self.buf.end

    def reset(self) -> None:
        self.buf.reset()
        self.length = 0

    def reserve(self, max_length: int) -> None:
        if self.length == 0:
            self.buf.reserve = int(max_length)

    def _map_batch(self, fn):
        self.buf.map_batch(fn)

    def allocated_bytes(self) -> int:
        return self.buf.allocated_bytes

    def stored_bytes(self) -> int:
        return self.buf.live_bytes
