"""`StaticDenseLayer`: a dense cell (option `bf16`) in preallocated storage, written by device-side index, so that a
decode step has the same shapes and addresses every step (the storage of a static `LoopCache`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from hf_loopcache.attention import dense_attention
from hf_loopcache.cache.layers.base import LoopLayerBase

if TYPE_CHECKING:
    from hf_loopcache.cache.read import ReadState

__all__ = ["StaticDenseLayer", "static_mask"]


def static_mask(positions: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Visibility `[B, 1, q, max_len]` of every storage position to the queries at storage `positions` `[q]`: causal
    and real (`valid` `[B, max_len]`), or the query's own position (a padded query attends to itself only)."""
    j = torch.arange(valid.shape[1], device=valid.device)
    causal = j[None, :] <= positions[:, None]  # [q, max_len]
    own = j[None, :] == positions[:, None]
    return ((causal[None] & valid[:, None, :]) | own[None])[:, None]


class StaticDenseLayer(LoopLayerBase):
    """Every position at full precision, in `[max_batch_size, H, max_cache_len, D]` buffers allocated at the first
    write (zeros, so masked positions hold finite values) and never reallocated. Writes go to the forward's storage
    positions (`ReadState.positions`, a device tensor) with `index_copy_`; a read attends over the whole buffer with
    the forward's device-side mask (`ReadState.static_mask`), so neither depends on a host length. A row count below
    `max_batch_size` uses the first rows (views at the same addresses). A first write into an empty cell (prefill)
    attends causally over the new tokens only, as `DenseLayer` does.

    Args:
        max_batch_size (`int`): rows of the storage.
        max_cache_len (`int`): positions of the storage; a write past it raises.
    """

    is_compileable = True

    def __init__(self, max_batch_size: int, max_cache_len: int) -> None:
        super().__init__()
        self.max_batch_size, self.max_cache_len = max_batch_size, max_cache_len
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    # ------------------------------------------------------------------ storage
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        rows = key_states.shape[0]
        if rows > self.max_batch_size:
            raise ValueError(
                f"the batch has {rows} rows but this static cache was built with `max_batch_size={self.max_batch_size}`"
            )
        super().lazy_initialization(key_states, value_states)
        shape = (self.max_batch_size, key_states.shape[1], self.max_cache_len, key_states.shape[3])
        k = self.k
        if k is None or k.shape != shape or k.dtype != key_states.dtype or k.device != key_states.device:
            self.k = key_states.new_zeros(shape)
            self.v = value_states.new_zeros(shape)

    def _views(self) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.k is not None and self.v is not None  # noqa: S101 - allocated by the first write
        return self.k[: self.rows], self.v[: self.rows]

    def _write(self, key: torch.Tensor, value: torch.Tensor, positions: torch.Tensor) -> None:
        q = key.shape[2]
        if self.length + q > self.max_cache_len:
            raise ValueError(
                f"this static cache holds at most `max_cache_len={self.max_cache_len}` positions; writing {q} more "
                f"after {self.length} would overflow it (build it with a larger `max_cache_len`)"
            )
        k, v = self._views()
        k.index_copy_(2, positions, key.to(k.dtype))
        v.index_copy_(2, positions, value.to(v.dtype))
        self.length += q

    def _positions(self, q: int, read: ReadState) -> torch.Tensor:
        if read.positions is not None:
            if read.length is not None and read.length != self.length:
                raise ValueError(
                    f"a static cache writes every cell of a forward at the same positions, but this cell holds "
                    f"{self.length} positions and the cache {read.length}; roll a partial-depth draft back "
                    f"(`cache.rollback`) before a forward that runs deeper loops"
                )
            return read.positions
        return torch.arange(self.length, self.length + q, device=self.device)

    # ------------------------------------------------------------------ read and write
    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        q = key_states.shape[2]
        self._write(key_states, value_states, torch.arange(self.length, self.length + q, device=self.device))
        k, v = self._views()
        return k[:, :, : self.length], v[:, :, : self.length]

    def attend(self, query, key, value, read):
        if not self.is_initialized:
            self.lazy_initialization(key, value)
        first = self.length == 0
        positions = self._positions(key.shape[2], read)
        self._write(key, value, positions)
        if first:  # prefill into an empty cell: causal attention over the new tokens (fast kernels, no full mask)
            return dense_attention(query, key, value, key_valid=read.key_valid, scaling=read.scaling)
        k, v = self._views()
        mask = read.static_mask
        if mask is None:
            if read.static_valid is None:
                raise ValueError("a static cell read needs the forward's key validity (`ReadState.static_valid`)")
            mask = static_mask(positions, read.static_valid[: self.rows])
        groups = query.shape[1] // k.shape[1]
        return F.scaled_dot_product_attention(
            query, k, v, attn_mask=mask, scale=read.scaling, enable_gqa=groups > 1
        ).to(query.dtype)

    # ------------------------------------------------------------------ inspection and the source side
    @property
    def keys(self) -> torch.Tensor | None:  # type: ignore[override]
        return self._views()[0][:, :, : self.length] if self.length else None

    @keys.setter
    def keys(self, value: torch.Tensor | None) -> None:
        if value is not None:
            raise AttributeError("a StaticDenseLayer's `keys` are its storage; write them with `update`")

    @property
    def values(self) -> torch.Tensor | None:  # type: ignore[override]
        return self._views()[1][:, :, : self.length] if self.length else None

    @values.setter
    def values(self, value: torch.Tensor | None) -> None:
        if value is not None:
            raise AttributeError("a StaticDenseLayer's `values` are its storage; write them with `update`")

    def full_states(self):
        if self.length == 0:
            raise ValueError("this cell holds no positions yet")
        k, v = self._views()
        return k[:, :, : self.length], v[:, :, : self.length]

    def readable_limit(self, length=None):
        return self.length if length is None else length

    def history_view(self, start, end):
        k, v = self._views()
        return k[:, :, start:end], v[:, :, start:end]

    def decoded(self, start, end):
        return self.history_view(start, end)

    # ------------------------------------------------------------------ crop, batch, bytes
    def truncate(self, length: int) -> None:
        self.length = max(0, min(length, self.length))

    def reset(self) -> None:
        """Empty the cell and keep its storage (the addresses a captured decode step uses)."""
        self.length = 0

    def get_mask_sizes(self, query_length: int | torch.Tensor) -> tuple[int, int]:
        return self.max_cache_len, 0

    def get_max_length(self) -> int:
        return self.max_cache_len

    def get_max_cache_shape(self) -> int:
        return self.max_cache_len

    def select_batch(self, index: torch.Tensor) -> None:
        """Keep rows `index` in place (the storage keeps its addresses); at most `max_batch_size` rows."""
        rows = int(index.shape[0])
        if rows > self.max_batch_size:
            raise ValueError(
                f"selecting {rows} rows, but this static cache was built with `max_batch_size={self.max_batch_size}`"
            )
        if self.k is not None and self.v is not None:
            index = index.to(self.k.device)
            k, v = self.k[: self.rows].index_select(0, index), self.v[: self.rows].index_select(0, index)
            self.k[:rows].copy_(k)
            self.v[:rows].copy_(v)
        self.rows = rows

    def _map_batch(self, fn):
        raise NotImplementedError("a static cell changes rows with `select_batch` only (in place)")

    def allocated_bytes(self) -> int:
        if self.k is None or self.v is None:
            return 0
        return self.k.numel() * self.k.element_size() + self.v.numel() * self.v.element_size()

    def stored_bytes(self) -> int:
        if self.k is None:
            return 0
        per_position = self.k[: self.rows, :, :1].numel() * self.k.element_size() * 2
        return per_position * self.length
