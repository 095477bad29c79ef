"""`LoopLayerBase`: what every cell layer of a `LoopCache` offers beyond transformers' `CacheLayerMixin`."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from transformers.cache_utils import CacheLayerMixin

if TYPE_CHECKING:
    from collections.abc import Callable

    from hf_loopcache.cache.read import ReadState

__all__ = ["LoopLayerBase"]


class LoopLayerBase(CacheLayerMixin):
    """One cell's storage. Subclasses are one storage kind each (`DenseLayer`, `CodedLayer`, `SharedLayer`).

    Beyond the transformers contract (`update`, `get_seq_length`, `get_mask_sizes`, `crop`, `reorder_cache`,
    `batch_*`, `reset`), a cell layer offers `attend` (the native read path: attention over what it stores, through
    `triton_ops.coded_attention`, with the forward's `ReadState` as an argument), `full_states` (inspection) and its
    byte counts. A cell that other cells may read from (a *source*: dense or coded) also offers `history_view`,
    `readable_limit` and `decoded`.
    """

    is_compileable = False
    is_croppable = True
    is_sliding = False

    def __init__(self) -> None:
        super().__init__()
        self.length = 0
        self.rows = 0
        self.num_heads: int | None = None
        self.head_dim: int | None = None

    # ------------------------------------------------------------------ CacheLayerMixin
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.num_heads, self.head_dim = key_states.shape[1], key_states.shape[3]
        self.rows = key_states.shape[0]
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
        self.rows = int(index.shape[0])

    def exact_crop(self, positions: int) -> bool:
        """Whether cutting the last `positions` positions right after a forward gives back exactly the state before
        them (`LoopCache.exact_crop`): always for a cell without a window, within the rollback reserve for a windowed
        one (a cut past it restores a page from the history)."""
        return getattr(self, "rollback", positions) >= positions

    # ------------------------------------------------------------------ to implement
    def truncate(self, length: int) -> None:
        """Keep positions `[0, length)`."""
        raise NotImplementedError

    def _map_batch(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        raise NotImplementedError

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, read: ReadState) -> torch.Tensor:
        """Attention of the new tokens (`query` `[B, H_q, q, D]`, `key`/`value` `[B, H_kv, q, D]`) over what the cell
        stores and themselves, then store the new keys and values. Returns `[B, H_q, q, D]`."""
        raise NotImplementedError

    def full_states(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every position as the next query (at position `length`) reads it, `[B, H, length, D]` in the keys' dtype
        (history decoded: for inspection and tests, not the read path)."""
        raise NotImplementedError

    def allocated_bytes(self) -> int:
        raise NotImplementedError

    def stored_bytes(self) -> int:
        raise NotImplementedError

    def reserve(self, max_length: int) -> None:
        """Allocate storage for `max_length` positions at the first write (only while the cell is empty)."""

    @property
    def _batch(self) -> int:
        return self.rows if self.is_initialized else 0

    # ------------------------------------------------------------------ source side (dense and coded cells)
    def readable_limit(self, length: int | None = None) -> int:
        """Positions `< readable_limit(length)` can be read from this cell's history when it holds `length`
        positions (now, by default)."""
        raise NotImplementedError(f"{type(self).__name__} cannot be a source")

    def history_view(self, start: int, end: int) -> tuple[object, object]:
        """What a reader of positions `[start, end)` gets: `(QuantizedKeys, QuantizedValues)` codes whose first page
        starts at `start`, or full-precision `[B, H, >= end - start, D]` views. No copy of stored data."""
        raise NotImplementedError(f"{type(self).__name__} cannot be a source")

    def decoded(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions `[start, end)` as this cell will hold them after `truncate(end)` (full precision where it keeps
        them, else decoded codes), in the keys' dtype."""
        raise NotImplementedError(f"{type(self).__name__} cannot be a source")
