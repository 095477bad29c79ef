"""A prefill in groups of rows: each group of the batch runs the whole forward alone and its cells' state lands in the
group's rows of one `LoopCache`, which then holds what a prefill of the whole batch at once stores.

Rows of a prefill are independent (each attends to its own positions only; `key_valid` is per row), so a model can run
its forward over rows `[start, end)` at a time (`prefill_rows`, `hf_loopcache.models._common.run_row_groups`): its
activations, the prefill's transient, are then one group's, not the batch's. The cache side is here:

- the first group writes the cache itself; `widen_rows` then gives every growable cell storage for the whole batch
  (the group's rows copied to the front; a static cell's storage already holds `max_batch_size` rows);
- every later group writes a cache of its own (`group_cache`: the same plan and options, for the group's rows), whose
  largest buffers are views of the whole cache's rows of the group, so the forward writes them in place: a dense
  cell's buffer (the full cache, RIPE's deepest plane, prelude and coda), a windowed cell's sink and window and a
  coded cell's code pages; a static dense cell's buffer. What is not a view (a static coded cell's rings and codes,
  the key validity a forward keeps) is copied into the rows by `merge_group`, which also checks that the group's cells
  hold the same positions, capacities and boundaries as the whole cache's (they depend on the prompt's shape and the
  batch's padding, never on a row's values).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import torch

from hf_loopcache.cache.layers import CodedLayer, DenseLayer, WindowedLayer
from hf_loopcache.cache.layers.static import StaticDenseLayer
from hf_loopcache.cache.storage import PageStore, SeqBuffer

if TYPE_CHECKING:
    from collections.abc import Callable

    from hf_loopcache.cache.base import LoopCache

__all__ = ["group_cache", "merge_group", "widen_rows"]

#: attributes that point at other cells or at the cache's shared objects (paired through the cells themselves)
_LINKS = frozenset({"source", "flush_group", "valid"})  # `valid`: a static cell's view of the cache's validity
#: attributes that count rows: the whole cache's and a group's differ by design
_ROW_COUNTS = frozenset({"rows", "max_rows"})
_SCALARS = (bool, int, float, str, torch.dtype, torch.device)


def _map_tensors(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """`obj` with `fn` applied to every tensor it holds (objects changed in place, dataclasses and tuples rebuilt)."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if obj is None or isinstance(obj, _SCALARS):
        return obj
    if isinstance(obj, (list, tuple)):
        return type(obj)(_map_tensors(x, fn) for x in obj)
    if isinstance(obj, dict):
        return {k: _map_tensors(v, fn) for k, v in obj.items()}
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changes = {f.name: _map_tensors(getattr(obj, f.name), fn) for f in dataclasses.fields(obj)}
        return dataclasses.replace(obj, **changes)
    if hasattr(obj, "__dict__"):
        for name, value in vars(obj).items():
            if name not in _LINKS:
                setattr(obj, name, _map_tensors(value, fn))
        return obj
    raise TypeError(f"a cell holds a {type(obj).__name__}, which a grouped prefill cannot widen")


def widen_rows(cache: LoopCache, batch: int) -> None:
    """After the first group (`rows` rows) wrote `cache`: give every growable cell storage for `batch` rows, the
    group's in the first rows (one tensor at a time, so this holds the whole cache and one tensor of the group). A
    tensor several cells share (the key validity of a forward) stays shared. A static cell already holds
    `max_batch_size` rows."""
    if cache.static:
        return
    widened: dict[int, torch.Tensor] = {}

    def widen(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in widened:
            out = t.new_empty((batch, *t.shape[1:]))
            out[: t.shape[0]] = t
            widened[id(t)] = out
        return widened[id(t)]

    for layer in cache.cells:
        if layer.is_initialized:
            _map_tensors(layer, widen)
            layer.rows = batch


def _rows_of(buffer: Any, main: Any, start: int, end: int) -> None:
    """Give an empty `SeqBuffer` of a group the whole cache's buffer rows `[start, end)` as its storage (views), when
    the whole cache's buffer starts at its storage's front (a prefill into empty cells leaves it so)."""
    if main.k is not None and main.v is not None and main.lo == 0:
        buffer.k, buffer.v = main.k[start:end], main.v[start:end]


def _seed_views(group: LoopCache, cache: LoopCache, start: int, end: int) -> None:
    """Let the group's cells write the whole cache's storage in place where the storage kind allows it."""
    for mine, whole in zip(group.cells, cache.cells):
        if not whole.is_initialized:
            continue
        if type(mine) is DenseLayer and isinstance(whole, DenseLayer):
            _rows_of(mine.buf, whole.buf, start, end)
        elif isinstance(mine, WindowedLayer) and isinstance(whole, WindowedLayer):
            _rows_of(mine.sink_buf, whole.sink_buf, start, end)
            _rows_of(mine.recent, whole.recent, start, end)
            if isinstance(mine, CodedLayer) and isinstance(whole, CodedLayer) and whole.pages.qk is not None:
                rows = lambda t: t[start:end]  # noqa: E731
                mine.pages.qk = _map_tensors(whole.pages.qk, rows)
                mine.pages.qv = _map_tensors(whole.pages.qv, rows)
        elif type(mine) is StaticDenseLayer and isinstance(whole, StaticDenseLayer) and whole.k is not None:
            mine.k, mine.v = whole.k[start:end], whole.v[start:end]  # kept by its first write: same shape and dtype


def group_cache(cache: LoopCache, start: int, end: int) -> LoopCache:
    """An empty cache for rows `[start, end)` of a grouped prefill after the first group: `cache`'s plan and options
    (a static one with `max_batch_size=end - start`), reserved as `cache` is, its largest buffers views of `cache`'s
    rows (see the module docstring)."""
    from hf_loopcache.cache.base import LoopCache

    group = LoopCache(
        cache.layout,
        cache.plan,
        max_rollback=cache.max_rollback,
        v_precision=cache.v_precision,
        static=cache.static,
        max_batch_size=end - start if cache.static else None,
        max_cache_len=cache.max_cache_len if cache.static else None,
    )
    group._v_precision_stats = cache._v_precision_stats
    _copy_reserves(group, cache)
    _seed_views(group, cache, start, end)
    return group


def _copy_reserves(group: LoopCache, cache: LoopCache) -> None:
    """Each storage of the group's cells sized as the whole cache's was at its first write: the capacity `reserve`
    gave it (`LoopCache.reserve`, with the rollback reserve of that time; `set_max_rollback` may have changed it
    since), which a prefill's allocations, and with them the cells' state, depend on."""
    for mine, whole in zip(group.cells, cache.cells):
        for name, store in vars(whole).items():
            if isinstance(store, SeqBuffer):
                getattr(mine, name).reserve = store.reserve
            elif isinstance(store, PageStore):
                getattr(mine, name).reserve_pages = store.reserve_pages


def _aliases(view: torch.Tensor, whole: torch.Tensor) -> bool:
    return (
        view.data_ptr() == whole.data_ptr()
        and view.shape == whole.shape
        and view.stride() == whole.stride()
        and view.dtype == whole.dtype
    )


def _merge(whole: Any, mine: Any, path: str, start: int, end: int, copied: set[int]) -> None:
    if isinstance(whole, torch.Tensor) and isinstance(mine, torch.Tensor):
        rows = end - start
        if mine.dim() > 0 and mine.shape[0] == rows and whole.shape[0] >= end and whole.shape[1:] == mine.shape[1:]:
            target = whole[start:end]
            if not _aliases(mine, target) and id(whole) not in copied:
                target.copy_(mine)
            copied.add(id(whole))
        elif whole.shape != mine.shape or not torch.equal(whole, mine):
            raise RuntimeError(f"grouped prefill: {path} differs from the whole cache's ({whole.shape} vs {mine.shape})")
        return
    if whole is None or mine is None or isinstance(whole, _SCALARS):
        if whole != mine or type(whole) is not type(mine):
            raise RuntimeError(f"grouped prefill: {path} is {mine!r} in the group but {whole!r} in the whole cache")
        return
    if type(whole) is not type(mine):
        raise RuntimeError(f"grouped prefill: {path} is a {type(mine).__name__}, not a {type(whole).__name__}")
    if isinstance(whole, (list, tuple)):
        if len(whole) != len(mine):
            raise RuntimeError(f"grouped prefill: {path} has {len(mine)} entries, not {len(whole)}")
        for i, (w, m) in enumerate(zip(whole, mine)):
            _merge(w, m, f"{path}[{i}]", start, end, copied)
        return
    if isinstance(whole, dict):
        if whole.keys() != mine.keys():
            raise RuntimeError(f"grouped prefill: {path} holds keys {sorted(mine)}, not {sorted(whole)}")
        for key in whole:
            _merge(whole[key], mine[key], f"{path}[{key!r}]", start, end, copied)
        return
    if dataclasses.is_dataclass(whole):
        for f in dataclasses.fields(whole):
            _merge(getattr(whole, f.name), getattr(mine, f.name), f"{path}.{f.name}", start, end, copied)
        return
    for name, value in vars(whole).items():
        if name not in _LINKS and name not in _ROW_COUNTS:
            _merge(value, vars(mine).get(name), f"{path}.{name}", start, end, copied)


def merge_group(cache: LoopCache, group: LoopCache, start: int, end: int) -> None:
    """Rows `[start, end)` of `cache` take what `group` stored (copies where the group did not write in place); raises
    `RuntimeError` if a group's cell differs from the whole cache's in anything but its rows (positions, capacities,
    boundaries: an internal invariant of rows being independent)."""
    copied: set[int] = set()
    for flat, (whole, mine) in enumerate(zip(cache.cells, group.cells)):
        _merge(whole, mine, f"cell {cache.layout.cell_at(flat)}", start, end, copied)
    if cache.static and group._valid_t is not None and cache._valid_t is not None:
        cache._valid_t[start:end].copy_(group._valid_t[: end - start])
