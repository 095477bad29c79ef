"""`StaticDenseLayer`: a dense cell (option `bf16`) in preallocated storage, written by device-side index, so that a
decode step has the same shapes and addresses every step (the storage of a static `LoopCache`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from hf_loopcache.attention import dense_attention
from hf_loopcache.cache.layers.base import LoopLayerBase
from triton_ops import fused
from triton_ops.coded_attention import CellView, coded_attention

if TYPE_CHECKING:
    from hf_loopcache.cache.read import ReadState

__all__ = ["StaticDenseLayer", "effective_storage", "hole_span", "ring_capacity", "static_mask"]


def hole_span(rollback: int, holes: bool) -> int:
    """Storage positions a real token may span in a row's window: `R + 1` when rows may hold holes (a batch of
    several rows under self-speculation: a row that accepts fewer drafts than another keeps its rejected positions
    as holes, up to `R` after a real token), else 1 (one row never holds a hole: a verification keeps exactly the
    positions it accepted)."""
    return rollback + 1 if holes else 1


def ring_capacity(window: int, page_size: int, rollback: int, holes: bool = True) -> int:
    """Ring positions of a static shared cell (`StaticCodedSharedLayer`): `(W + P) h + R + 1` with `R = rollback`
    and `h = hole_span(R, holes)`. Decoding (`R = 0`) needs `W + P`; a verified block of `R + 1` tokens and a crop of
    up to `R` need `W + P - 1 + (R + 1)`; a row whose rejected draft tokens left holes in its window spans up to
    `h` storage positions per real token."""
    return (window + page_size) * hole_span(rollback, holes) + rollback + 1


#: With `StaticDenseLayer.read_method = "auto"` (the default), a static dense cell's read on CUDA runs the kernel (to
#: the device-side length) while the positions the storage holds after the forward are at most this share of it, and
#: cuDNN's SDPA over the whole storage beyond. One-token reads on an H100 (bf16, replayed in a CUDA graph; Ouro-1.4B's
#: 16 x 128 and Huginn-0125's 55 x 96 heads, batch 1 and 8, storage of 2,309 and 8,192): the kernel takes 0.17-0.78x
#: cuDNN's time at a half or less of the storage, 0.83-1.10x at three quarters, 0.96-1.39x when full
#: (`benchmarks/results/static_read_live_h100_s37.json`); cuDNN's time follows the storage, not the positions held.
LIVE_READ_SHARE = 2 / 3


def dense_read(method: str, length: int, query_length: int, capacity: int, cuda: bool) -> str:
    """The read a static dense cell of `capacity` positions holding `length` runs for `query_length` new tokens under
    `read_method` `method`: `"auto"` is `"kernel"` on CUDA while `length + query_length <= LIVE_READ_SHARE *
    capacity`, else `"sdpa"`; other methods are themselves. A captured step is keyed by it (`LoopCache._step_mode`,
    through `StaticDenseLayer.read_kind_at`)."""
    if method != "auto":
        return method
    return "kernel" if cuda and length + query_length <= LIVE_READ_SHARE * capacity else "sdpa"


def masked_attention(
    query: torch.Tensor, segments: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], *, scaling: float
) -> torch.Tensor:
    """One softmax over key/value segments, each with its own visibility; scores and softmax in fp32.

    Args:
        query (`torch.Tensor` of shape `[B, H_q, q, D]`).
        segments: `(keys, values, mask)` with keys/values `[B, H_kv, n, D]` and mask `[B, 1, G * q, n]` bool
            (`G = H_q / H_kv`, rows ordered group-major as `query.reshape(B, H_kv, G * q, D)`); every query must see
            at least one key.

    Returns:
        `torch.Tensor` of shape `[B, H_q, q, D]` in the dtype of `query`.
    """
    b, hq, q_len, d = query.shape
    hkv = segments[0][0].shape[1]
    acc = torch.promote_types(query.dtype, torch.float32)
    q_rows = query.reshape(b, hkv, hq // hkv * q_len, d)
    scores = [
        (torch.matmul(q_rows, k.transpose(-1, -2)).to(acc) * scaling).masked_fill(~m, float("-inf"))
        for k, _, m in segments
    ]
    peak = torch.stack([s.amax(-1) for s in scores], dim=-1).amax(-1, keepdim=True)
    probs = [torch.exp(s - peak) for s in scores]
    denom = sum(p.sum(-1, keepdim=True) for p in probs)
    out = sum(torch.matmul(p.to(v.dtype), v).to(acc) for p, (_, v, _) in zip(probs, segments))
    return (out / denom).reshape(b, hq, q_len, d).to(query.dtype)


def group_rows(mask: torch.Tensor, groups: int) -> torch.Tensor:
    """`[B, 1, q, n]` -> `[B, 1, G * q, n]`, the row order of `masked_attention`."""
    if groups == 1:
        return mask
    b, _, q_len, n = mask.shape
    return mask[:, :, None].expand(b, 1, groups, q_len, n).reshape(b, 1, groups * q_len, n)


def static_mask(positions: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Visibility `[B, 1, q, max_len]` of every storage position to the queries at storage `positions` `[q]`: causal
    and real (`valid` `[B, max_len]`), or the query's own position (a padded query attends to itself only)."""
    j = torch.arange(valid.shape[1], device=valid.device)
    causal = j[None, :] <= positions[:, None]  # [q, max_len]
    own = j[None, :] == positions[:, None]
    return ((causal[None] & valid[:, None, :]) | own[None])[:, None]


def additive_bias(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean visibility `mask` (True: read) as SDPA's additive bias in `dtype`: 0 where read, -inf elsewhere."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, float("-inf"))


class _StaticStorage(LoopLayerBase):
    """What both static cells share: preallocated `k` / `v` for `max_rows` rows, rows changed in place, and the cache
    length transformers' mask helpers see (the static storage's, not the live length)."""

    max_rows: int
    rows: int
    k: torch.Tensor | None
    v: torch.Tensor | None

    def _max_positions(self) -> int:
        raise NotImplementedError

    def _live_positions(self) -> int:
        """Positions whose keys and values this cell's own storage holds."""
        raise NotImplementedError

    def _storage_positions(self) -> int:
        """Positions this cell's own `k` / `v` are allocated for."""
        raise NotImplementedError

    def _positions(self, q: int, read: ReadState) -> torch.Tensor:
        """Storage positions of the forward's `q` new tokens: the forward's device-side positions (every cell of a
        forward writes at the same ones), or the next `q` after this cell's own length."""
        if read.positions is not None:
            if read.length is not None and read.length != self.length:
                raise ValueError(
                    f"a static cache writes every cell of a forward at the same positions, but this cell holds "
                    f"{self.length} positions and the cache {read.length}; roll a partial-depth draft back "
                    f"(`cache.rollback`) before a forward that runs deeper loops"
                )
            return read.positions
        return torch.arange(self.length, self.length + q, device=self.device)

    def _storage_allocated(self, device: torch.device) -> None:
        """Called after `k` / `v` were (re)allocated on `device`."""

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        rows = key_states.shape[0]
        if rows > self.max_rows:
            raise ValueError(
                f"the batch has {rows} rows but this static cache was built with `max_batch_size={self.max_rows}`"
            )
        super().lazy_initialization(key_states, value_states)
        shape = (self.max_rows, key_states.shape[1], self._storage_positions(), key_states.shape[3])
        k = self.k
        if k is None or k.shape != shape or k.dtype != key_states.dtype or k.device != key_states.device:
            self.k = key_states.new_zeros(shape)
            self.v = value_states.new_zeros(shape)
            self._storage_allocated(key_states.device)

    def _views(self) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.k is not None and self.v is not None  # noqa: S101 - allocated by the first write
        return self.k[: self.rows], self.v[: self.rows]

    def get_mask_sizes(self, query_length: int | torch.Tensor) -> tuple[int, int]:
        return self._max_positions(), 0

    def get_max_length(self) -> int:
        return self._max_positions()

    def get_max_cache_shape(self) -> int:
        return self._max_positions()

    def select_batch(self, index: torch.Tensor) -> None:
        """Keep rows `index` in place (the storage keeps its addresses); at most `max_batch_size` rows."""
        rows = int(index.shape[0])
        if rows > self.max_rows:
            raise ValueError(
                f"selecting {rows} rows, but this static cache was built with `max_batch_size={self.max_rows}`"
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
        return per_position * self._live_positions()


class StaticDenseLayer(_StaticStorage):
    """Every position at full precision, in `[max_batch_size, H, max_cache_len, D]` buffers allocated at the first
    write (zeros, so masked positions hold finite values) and never reallocated. Writes go to the forward's storage
    positions (`ReadState.positions`, a device tensor) with `triton_ops.fused.write_kv`; a read attends over the whole buffer with
    the forward's device-side mask (`ReadState.static_mask`), so neither depends on a host length. A row count below
    `max_batch_size` uses the first rows (views at the same addresses). A first write into an empty cell (prefill)
    attends causally over the new tokens only, as `DenseLayer` does.

    Args:
        max_batch_size (`int`): rows of the storage.
        max_cache_len (`int`): positions of the storage; a write past it raises.
    """

    is_compileable = True
    #: how a read over the storage is computed: `"sdpa"` (`scaled_dot_product_attention` with the boolean mask: its
    #: cost follows the storage), `"kernel"` (`triton_ops.coded_attention` over the buffer as a BF16 history up to the
    #: device-side length: reads only the positions held), `"matmul"` (`masked_attention`: two matmuls and an fp32
    #: softmax), or `"auto"` (the default: the kernel on CUDA while the storage is at most `LIVE_READ_SHARE` full,
    #: `"sdpa"` beyond and on the CPU; `dense_read`). With `"sdpa"`, a block of several queries on CUDA (a
    #: self-speculative verification) takes the kernel
    read_method = "auto"

    def __init__(self, max_batch_size: int, max_cache_len: int) -> None:
        super().__init__()
        self.max_rows, self.max_positions = max_batch_size, max_cache_len  # not `max_*`: transformers' names
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    # ------------------------------------------------------------------ storage
    def _storage_positions(self) -> int:
        return self.max_positions

    def _write(self, key: torch.Tensor, value: torch.Tensor, positions: torch.Tensor, written: bool = False) -> None:
        q = key.shape[2]
        if self.length + q > self.max_positions:
            raise ValueError(
                f"this static cache holds at most `max_cache_len={self.max_positions}` positions; writing {q} more "
                f"after {self.length} would overflow it (build it with a larger `max_cache_len`)"
            )
        if not written:
            k, v = self._views()
            fused.write_kv(k, v, key, value, positions)  # one launch on CUDA (two `index_copy_` elsewhere)
        self.length += q

    def write_target(self, batch: int, query_length: int, read: ReadState) -> tuple[torch.Tensor, ...] | None:
        """`(k, v, positions)`: the storage rows and the device-side positions where this forward's new keys and values
        go, for a projection kernel that stores them itself (`triton_ops.gemv.linear_rope`'s `kv_out`) in a one-token
        step of `batch` rows after the prefill; None otherwise. The forward then calls `attend(..., written=True)`
        when they were stored."""
        if query_length != 1 or not self.is_initialized or self.length == 0 or batch != self.rows:
            return None
        if self.length + query_length > self.max_positions:
            return None  # (`attend` raises)
        positions = self._positions(query_length, read)
        k, v = self._views()
        return k, v, positions

    def advance(self, query_length: int) -> None:
        """Host bookkeeping of a replayed step that wrote `query_length` positions."""
        self.length += query_length

    # ------------------------------------------------------------------ read and write
    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized or self.length == 0:  # a fresh start may have another row count
            self.lazy_initialization(key_states, value_states)
        q = key_states.shape[2]
        self._write(key_states, value_states, torch.arange(self.length, self.length + q, device=self.device))
        k, v = self._views()
        return k[:, :, : self.length], v[:, :, : self.length]

    def attend(self, query, key, value, read, written=False):
        """`written`: the new keys and values are already in the storage at the forward's positions (a projection
        kernel stored them at the positions `write_target` gave); only the length advances."""
        if not self.is_initialized or self.length == 0:  # a fresh start may have another row count
            if written:
                raise ValueError("keys and values stored by the projection need a cell after its prefill")
            self.lazy_initialization(key, value)
        first = self.length == 0
        positions = self._positions(key.shape[2], read)
        self._write(key, value, positions, written)
        if first:  # prefill into an empty cell: causal attention over the new tokens (fast kernels, no full mask)
            return dense_attention(query, key, value, key_valid=read.key_valid, scaling=read.scaling)
        return self.read_storage(query, key, value, read, positions)

    def read_kind(self, read: ReadState, query_length: int, cuda: bool) -> str:
        """The read `read_storage` runs for `query_length` new tokens: `read_kind_at` the positions held before the
        forward (the forward's host length, `ReadState.length`; else this cell's, less the new tokens it has written
        before it reads)."""
        length = read.length if read.length is not None else self.length - query_length
        return self.read_kind_at(length, query_length, cuda)

    def read_kind_at(self, length: int, query_length: int, cuda: bool) -> str:
        """`dense_read` of `read_method` for `query_length` new tokens after `length` held, in this cell's storage (a
        captured step's key asks it too: `LoopCache._step_mode`)."""
        return dense_read(self.read_method, length, query_length, self.max_positions, cuda)

    def read_storage(self, query, key, value, read, positions):
        """Attention of the forward's queries at `positions` over this cell's storage up to them, the new keys and
        values (`key`, `value`) already written at `positions`: this cell's own read, and that of a shared cell that
        wrote its new position into this storage (`StaticCodedSharedLayer`, the deepest plane's one-token step)."""
        k, v = self._views()
        mask = read.static_mask
        if mask is None:
            if read.static_valid is None:
                raise ValueError("a static cell read needs the forward's key validity (`ReadState.static_valid`)")
            mask = static_mask(positions, read.static_valid[: self.rows])
        groups = query.shape[1] // k.shape[1]
        q = query.shape[2]
        method = self.read_kind(read, q, query.is_cuda)
        if method == "sdpa" and q > 1 and query.is_cuda and k.shape[-1] >= 16:
            # a verification block: cuDNN's path for several queries runs one program per (row, head, 64 queries) over
            # the whole storage (H200, Ouro-1.4B's shape, 8K, 5 queries: 176 us per cell at batch 1 against 20 us for
            # one query), the kernel splits the history
            method = "kernel"
        if method == "kernel":  # the stored plane as a BF16 history, read to a device-side length
            rows = query.shape[0]
            view = CellView(
                new_key=key,
                new_value=value,
                length=positions[:1],
                history_end=positions[:1].expand(rows, q),
                history_key=k,
                history_value=v,
                key_valid=read.static_valid[:rows] if read.static_valid is not None else None,
            )
            return coded_attention(query, view, scaling=read.scaling)[0]
        if method == "matmul":
            return masked_attention(query, [(k, v, group_rows(mask, groups))], scaling=read.scaling)
        if read.static_mask is not None:  # the forward's mask as an additive bias, made once for every dense cell
            key = ("static-dense-bias", query.dtype)
            bias = read.memo.get(key)
            if bias is None:
                bias = read.memo[key] = additive_bias(mask, query.dtype)
            mask = bias
        # every backend, cuDNN included: with the storage's fixed shape it builds its execution graph once (H200, 8K,
        # one query per row: cuDNN 56 us per cell at batch 1, memory-efficient attention 373 us)
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

    def _max_positions(self) -> int:
        return self.max_positions

    def _live_positions(self) -> int:
        return self.length


def effective_storage(valid: torch.Tensor) -> torch.Tensor:
    """`[B, max_len]`: each storage position with the row's holes before it left out (`effective_positions`, on the
    device and without the host test for holes: without holes it is the storage position)."""
    seen = valid.long().cummax(dim=1).values.bool()
    holes = (seen & ~valid).long()
    return torch.arange(valid.shape[1], device=valid.device)[None] - (holes.cumsum(1) - holes)
