"""`StaticDenseLayer`: a dense cell (option `bf16`) in preallocated storage, written by device-side index, so that a
decode step has the same shapes and addresses every step (the storage of a static `LoopCache`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from hf_loopcache.attention import dense_attention
from hf_loopcache.cache.layers.base import LoopLayerBase
from triton_ops.coded_attention import CellView, coded_attention

if TYPE_CHECKING:
    from hf_loopcache.cache.read import ReadState

__all__ = ["StaticDenseLayer", "StaticSharedLayer", "effective_storage", "ring_capacity", "static_mask"]


def ring_capacity(window: int, page_size: int, rollback: int) -> int:
    """Ring positions of a static shared cell: `(W + P) * (R + 1) + R + 1` with `R = rollback`. Decoding (`R = 0`)
    needs `W + P`; a verified block of `R + 1` tokens and a crop of up to `R` need `W + P - 1 + (R + 1)`; a row whose
    rejected draft tokens left holes in its window spans up to `(R + 1)` storage positions per real token."""
    return (window + page_size) * (rollback + 1) + rollback + 1


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
    positions (`ReadState.positions`, a device tensor) with `index_copy_`; a read attends over the whole buffer with
    the forward's device-side mask (`ReadState.static_mask`), so neither depends on a host length. A row count below
    `max_batch_size` uses the first rows (views at the same addresses). A first write into an empty cell (prefill)
    attends causally over the new tokens only, as `DenseLayer` does.

    Args:
        max_batch_size (`int`): rows of the storage.
        max_cache_len (`int`): positions of the storage; a write past it raises.
    """

    is_compileable = True
    #: how a read over the storage is computed: `"sdpa"` (`scaled_dot_product_attention` with the boolean mask),
    #: `"kernel"` (`triton_ops.coded_attention` over the buffer as a BF16 history up to the device-side length: reads
    #: only the live positions) or `"matmul"` (`masked_attention`: two matmuls and an fp32 softmax). With `"sdpa"`,
    #: a block of several queries on CUDA (a self-speculative verification) takes the kernel
    read_method = "sdpa"

    def __init__(self, max_batch_size: int, max_cache_len: int) -> None:
        super().__init__()
        self.max_rows, self.max_positions = max_batch_size, max_cache_len  # not `max_*`: transformers' names
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    # ------------------------------------------------------------------ storage
    def _storage_positions(self) -> int:
        return self.max_positions

    def _write(self, key: torch.Tensor, value: torch.Tensor, positions: torch.Tensor) -> None:
        q = key.shape[2]
        if self.length + q > self.max_positions:
            raise ValueError(
                f"this static cache holds at most `max_cache_len={self.max_positions}` positions; writing {q} more "
                f"after {self.length} would overflow it (build it with a larger `max_cache_len`)"
            )
        k, v = self._views()
        k.index_copy_(2, positions, key.to(k.dtype))
        v.index_copy_(2, positions, value.to(v.dtype))
        self.length += q

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

    def attend(self, query, key, value, read):
        if not self.is_initialized or self.length == 0:  # a fresh start may have another row count
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
        method = self.read_method
        if method == "sdpa" and query.shape[2] > 1 and query.is_cuda:
            # a verification block: cuDNN's path for several queries runs one program per (row, head, 64 queries) over
            # the whole storage (H200, Ouro-1.4B's shape, 8K, 5 queries: 176 us per cell at batch 1 against 20 us for
            # one query), the kernel splits the history
            method = "kernel"
        if method == "kernel":  # the stored plane as a BF16 history, read to a device-side length
            rows, q = query.shape[0], query.shape[2]
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
                bias = read.memo[key] = torch.zeros(mask.shape, dtype=query.dtype, device=mask.device).masked_fill(
                    ~mask, float("-inf")
                )
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


class StaticSharedLayer(_StaticStorage):
    """A shared cell (option `share`) of a static cache: its history is read from a `StaticDenseLayer` source in place,
    its own recent positions live in a ring of `capacity` positions (position `p` in slot `p % capacity`), so the
    storage never moves. The reading rule is `WindowedLayer`'s: the query at `t` reads `[0, H(t))` from the source
    (`H` in the row's effective positions, clipped to what the source holds) and `[H(t), t]` from the ring, where
    `H(t) = P * floor(max(0, t - W) / P)`; every mask is computed on the device from the forward's positions and key
    validity. A position the ring no longer holds (older than `capacity` positions, or cut by a `crop` deeper than the
    rollback reserve) is read from the source, as the growable `SharedLayer` does after a deep crop.

    Args:
        source (`StaticDenseLayer`): the final loop's cell of the same layer.
        window (`int`), page_size (`int`): `W` and `P` of the plan (no sink).
        capacity (`int`): ring positions, at least `W + P - 1 + max(q, rollback)` for exact reads of `q`-token forwards
            and crops of up to `rollback` positions (`LoopCache` sizes it).
        max_batch_size (`int`): rows of the ring.
        own_start_on_device (`bool`, *optional*, defaults to True): keep a device copy of `own_start`; False when the
            forward hands it over (`ReadState.own_start`: a static `LoopCache` keeps one for every ring).
    """

    is_compileable = True
    #: build the static shared cells of RIPE plans as `StaticCodedSharedLayer`s instead (`coded_attention` reading the
    #: source's BF16 storage in place, no copy), as plans with a sink always are; this class's SDPA read concatenates
    #: the source and the ring, a copy of the source's keys and values per cell and step
    read_in_place = False

    def __init__(
        self,
        source: StaticDenseLayer,
        *,
        window: int,
        page_size: int,
        capacity: int,
        max_batch_size: int,
        own_start_on_device: bool = True,
    ):
        super().__init__()
        self.own_start_on_device = own_start_on_device
        if not isinstance(source, StaticDenseLayer):
            raise TypeError(f"`source` of a static shared cell must be a StaticDenseLayer, got {type(source).__name__}")
        self.source, self.window, self.page = source, window, page_size
        self.capacity, self.max_rows = capacity, max_batch_size
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.high = 0  # one past the highest position written since the last reset (host)
        self.own_start = 0  # ring positions below this are not read (host mirror of `own_start_t`)
        self.own_start_t: torch.Tensor | None = None

    # ------------------------------------------------------------------ storage
    def _storage_positions(self) -> int:
        return self.capacity

    def _storage_allocated(self, device: torch.device) -> None:
        if self.own_start_on_device:
            self.own_start_t = torch.zeros((), dtype=torch.long, device=device)
            self.own_start_t.fill_(self.own_start)

    def boundary(self, effective: torch.Tensor) -> torch.Tensor:
        """`H` of effective positions (any shape)."""
        return self.page * ((effective - self.window).clamp(min=0) // self.page)

    def _write(self, key: torch.Tensor, value: torch.Tensor, positions: torch.Tensor) -> None:
        q = key.shape[2]
        if q > self.capacity:  # a prefill into an empty cell: only the last `capacity` positions are ever read here
            key, value, positions = key[:, :, -self.capacity :], value[:, :, -self.capacity :], positions[-self.capacity :]
        k, v = self._views()
        slots = positions % self.capacity
        k.index_copy_(2, slots, key.to(k.dtype))
        v.index_copy_(2, slots, value.to(v.dtype))
        self.length += q
        self.high = max(self.high, self.length)

    def advance(self, query_length: int) -> None:
        """Host bookkeeping of a replayed step that wrote `query_length` positions."""
        self.length += query_length
        self.high = max(self.high, self.length)

    # ------------------------------------------------------------------ read and write
    def attend(self, query, key, value, read):
        if not self.is_initialized or self.length == 0:  # a fresh start may have another row count
            self.lazy_initialization(key, value)
        length, q = self.length, key.shape[2]
        if length and read.static_valid is None:
            raise ValueError("a static cell read needs the forward's key validity (`ReadState.static_valid`)")
        if length and q > self.capacity - (self.window + self.page - 1):
            raise ValueError(
                f"a static RIPE cell reads blocks of at most {self.capacity - self.window - self.page + 1} tokens after "
                f"the prefill (its ring holds {self.capacity} positions), got {q}; build the cache with a larger "
                f"`max_rollback`"
            )
        positions = self._positions(q, read)
        self._write(key, value, positions)
        if length == 0:  # nothing cached: plain causal attention over the new tokens (as every cell computes it)
            return dense_attention(query, key, value, key_valid=read.key_valid, scaling=read.scaling)
        valid = read.static_valid[: self.rows]  # type: ignore[index]
        # what the source holds: all `length` positions in a complete forward (written later in it), else its own
        # (in a draft: the cache's device-side final-loop length, so a captured draft reads no host length)
        if read.complete:
            src_limit = positions[:1]
        elif read.source_length is not None:
            src_limit = read.source_length
        else:
            src_limit = min(length, self.source.length)
        return self._read(query, positions, valid, src_limit, read)

    def _masks(self, positions, valid, src_limit, own_start) -> tuple[torch.Tensor, torch.Tensor]:
        """Visibility of the source's storage `[B, 1, q, max_len]` and of the ring `[B, 1, q, capacity]` to the
        queries at `positions`; the same for every shared cell of the forward (same window, page, ring size and
        reserve start), so computed once per forward."""
        eff = effective_storage(valid)  # [B, L]
        end = positions[-1:] + 1  # [1]: one past the last position written
        h = self.boundary(eff.index_select(1, positions))  # [B, q]
        stored = (eff[:, None, :] < h[:, :, None]).sum(-1)  # [B, q]: storage boundary (eff is non-decreasing)
        hist_end = torch.minimum(stored, torch.as_tensor(src_limit, device=eff.device))
        hist_end = torch.maximum(hist_end, torch.maximum(own_start, end - self.capacity))  # [B, q]
        j = torch.arange(valid.shape[1], device=valid.device)
        src_mask = (j[None, None, :] < hist_end[..., None]) & valid[:, None, :]  # [B, q, L]
        slots = torch.arange(self.capacity, device=valid.device)
        absolute = end - 1 - (end - 1 - slots) % self.capacity  # [C]: the position each slot holds
        t = positions[None, :, None]
        own_valid = valid.gather(1, absolute.clamp(min=0)[None].expand(valid.shape[0], -1))  # [B, C]
        own_mask = (
            (absolute[None, None, :] >= hist_end[..., None])
            & (absolute[None, None, :] <= t)
            & (own_valid[:, None, :] | (absolute[None, None, :] == t))
            & (absolute >= 0)[None, None, :]
        )  # [B, q, C]
        return src_mask[:, None], own_mask[:, None]

    def _read(self, query, positions, valid, src_limit, read):
        """Attention over the source's storage and the ring. With `StaticDenseLayer.read_method == "sdpa"`: one
        `scaled_dot_product_attention` over both, concatenated (a copy of the source's keys and values per call,
        traded for the fused kernel), with the forward's mask as an additive bias; with `"matmul"`:
        `masked_attention` over the two segments in place."""
        sk, sv = self.source._views()
        rk, rv = self._views()
        groups = query.shape[1] // rk.shape[1]
        where = src_limit if isinstance(src_limit, int) else ("complete" if read.complete else "draft")
        key = ("static-shared", self.window, self.page, self.capacity, where)
        masks = read.memo.get(key)
        if masks is None:
            own_start = read.own_start if read.own_start is not None else self.own_start_t
            if own_start is None:
                own_start = torch.tensor(self.own_start, device=valid.device)
            masks = read.memo[key] = self._masks(positions, valid, src_limit, own_start)
        if StaticDenseLayer.read_method == "matmul":
            segments = [(sk, sv, group_rows(masks[0], groups)), (rk, rv, group_rows(masks[1], groups))]
            return masked_attention(query, segments, scaling=read.scaling)
        bias_key = (*key, "bias", query.dtype)
        bias = read.memo.get(bias_key)
        if bias is None:
            both = torch.cat(masks, dim=-1)
            bias = read.memo[bias_key] = torch.zeros(both.shape, dtype=query.dtype, device=both.device).masked_fill(
                ~both, float("-inf")
            )
        k, v = torch.cat([sk, rk], dim=2), torch.cat([sv, rv], dim=2)
        return F.scaled_dot_product_attention(
            query, k, v, attn_mask=bias, scale=read.scaling, enable_gqa=groups > 1
        ).to(query.dtype)

    # ------------------------------------------------------------------ plain path and inspection
    def _states(self, t: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The stored positions `[0, length)` as the query at `t >= length` (no holes, no new positions) reads them:
        the source up to the history end, the ring after it (the plain path and inspection, not the read path)."""
        n = self.length
        end = max(self.own_start, n + 1 - self.capacity, min(self.page * (max(0, t - self.window) // self.page),
                                                           self.source.length, n))
        end = min(end, n)
        sk, sv = self.source.history_view(0, end)
        rk, rv = self._views()
        slots = torch.arange(end, n, device=rk.device) % self.capacity
        return torch.cat([sk, rk.index_select(2, slots)], dim=2), torch.cat([sv, rv.index_select(2, slots)], dim=2)

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized or self.length == 0:  # a fresh start may have another row count
            self.lazy_initialization(key_states, value_states)
        q = key_states.shape[2]
        k, v = self._states(self.length + q - 1) if self.length else (key_states[:, :, :0], value_states[:, :, :0])
        self._write(key_states, value_states, torch.arange(self.length, self.length + q, device=self.device))
        return torch.cat([k, key_states], dim=2), torch.cat([v, value_states], dim=2)

    def full_states(self):
        if self.length == 0:
            raise ValueError("this cell holds no positions yet")
        return self._states(self.length)

    # ------------------------------------------------------------------ crop, batch, bytes
    def truncate(self, length: int) -> None:
        """Keep `[0, length)`; ring positions from before the last `capacity` written are no longer read (the source
        serves them)."""
        if length >= self.length:
            return
        self.length = max(0, length)
        self.own_start = min(max(self.own_start, self.high - self.capacity), self.length)
        self.high = self.length
        if self.own_start_t is not None:
            self.own_start_t.fill_(self.own_start)

    def set_own_start(self, own_start: int) -> None:
        """Read ring positions from `own_start` on (older ones from the source)."""
        self.own_start = own_start
        if self.own_start_t is not None:
            self.own_start_t.fill_(own_start)

    def resize(self, capacity: int) -> None:
        """A ring of `capacity` positions, keeping the positions it holds that fit (a larger rollback reserve)."""
        if capacity == self.capacity:
            return
        old_k, old_v, old_capacity = self.k, self.v, self.capacity
        self.capacity = capacity
        if old_k is None or old_v is None:
            return
        self.k = old_k.new_zeros((*old_k.shape[:2], capacity, old_k.shape[3]))
        self.v = old_v.new_zeros((*old_v.shape[:2], capacity, old_v.shape[3]))
        first = max(self.own_start, self.length - min(capacity, old_capacity))
        held = torch.arange(first, self.length, device=old_k.device)
        self.k.index_copy_(2, held % capacity, old_k.index_select(2, held % old_capacity))
        self.v.index_copy_(2, held % capacity, old_v.index_select(2, held % old_capacity))
        self.own_start, self.high = first, self.length
        if self.own_start_t is not None:
            self.own_start_t.fill_(first)

    def reset(self) -> None:
        self.length = self.high = self.own_start = 0
        if self.own_start_t is not None:
            self.own_start_t.zero_()

    def _max_positions(self) -> int:
        return self.source.max_positions

    def _live_positions(self) -> int:
        return min(self.length, self.capacity)
