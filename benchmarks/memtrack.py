"""Live tensor memory on any device, without an allocator: the peak of bytes held by storages that ops create.

`LiveBytes` is a `TorchDispatchMode`: every storage an op returns is counted once (its `nbytes`) from the op that
creates it until the storage is freed (a `weakref.finalize` on the storage object; torch keeps one Python object per
storage while anything, Python or C++, holds it). Storages that existed before the mode was entered (weights, a
cache's earlier buffers) are not counted, and freeing them credits nothing, so a figure is an upper bound of the new
memory a region needs above what it started with. What an op holds inside one kernel and never returns (a fused
kernel's scratch) is not seen; composite ops are seen op by op.

```python
with LiveBytes() as mem:
    with mem.label("prefill"):
        model(ids, cache=cache)
print(mem.peak, mem.peak_where, mem.by_label["prefill"])
```

`track_modules(model, mem)` labels every submodule's forward, so `peak_where` names the module (and the op) at the
peak. CPU measurements of the micro shapes scale to real shapes by the tensors' shapes (see `tests/cache/test_memory.py`
and the README's memory section).
"""

from __future__ import annotations

import contextlib
import weakref
from typing import TYPE_CHECKING, Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

if TYPE_CHECKING:
    from collections.abc import Iterator


__all__ = ["LiveBytes", "track_modules"]


class LiveBytes(TorchDispatchMode):
    """Counts the bytes of live storages created while the mode is active.

    Attributes:
        live (`int`): bytes live now (created inside the mode, not yet freed).
        peak (`int`): the largest `live` seen.
        peak_where (`str`): labels and op at the peak (`"prefill/model.layers.0.mlp: mm"`).
        peak_holders (`list`): with `snapshots=True`, what was live at the peak, grouped by the label and op that
            created it: `(where, storages, bytes)`, largest first (slow: a copy at every new peak; for diagnosis).
        by_label (`dict[str, int]`): per label, the largest `live` seen while that label was open, measured from
            `live` when the label opened (the label's own transient).
    """

    def __init__(self, device: str | torch.device | None = None, *, snapshots: bool = False) -> None:
        super().__init__()
        self.snapshots = snapshots
        self.device = None if device is None else torch.device(device).type
        self.live = 0
        self.peak = 0
        self.peak_where = ""
        self.by_label: dict[str, int] = {}
        self._stack: list[tuple[str, int]] = []
        self._seen: dict[int, int] = {}  # id(storage) -> nbytes while alive
        self._origin: dict[int, str] = {}  # id(storage) -> "label: op" that created it
        self.peak_holders: list[tuple[str, int, int]] = []  # at the peak: (label: op, storages, bytes), largest first

    # ------------------------------------------------------------------ labels
    @contextlib.contextmanager
    def label(self, name: str) -> Iterator[None]:
        """Attribute what happens inside to `name` (nested labels join with `/`)."""
        full = f"{self._stack[-1][0]}/{name}" if self._stack else name
        self._stack.append((full, self.live))
        self.by_label.setdefault(full, 0)
        try:
            yield
        finally:
            self._stack.pop()

    def reset_peak(self) -> None:
        """Start a new peak from what is live now."""
        self.peak, self.peak_where, self.peak_holders = self.live, "", []

    # ------------------------------------------------------------------ counting
    def _free(self, key: int) -> None:
        self.live -= self._seen.pop(key, 0)
        self._origin.pop(key, None)

    def _snapshot(self) -> list[tuple[str, int, int]]:
        groups: dict[str, list[int]] = {}
        for key, size in self._seen.items():
            g = groups.setdefault(self._origin.get(key, "?"), [0, 0])
            g[0] += 1
            g[1] += size
        return sorted(((k, n, b) for k, (n, b) in groups.items()), key=lambda r: -r[2])

    def _count(self, t: torch.Tensor, op: str, inputs: set[int]) -> None:
        if self.device is not None and t.device.type != self.device:
            return
        storage = _storage(t)
        if storage is None:
            return
        key = id(storage)
        if key in self._seen or key in inputs:  # counted already, or a view / in-place result of an input
            return
        size = storage.nbytes()
        self._seen[key] = size
        where = f"{self._stack[-1][0] if self._stack else ''}: {op}"
        self._origin[key] = where
        weakref.finalize(storage, self._free, key)
        self.live += size
        for name, start in self._stack:
            self.by_label[name] = max(self.by_label[name], self.live - start)
        if self.live > self.peak:
            self.peak = self.live
            self.peak_where = where
            if self.snapshots:
                self.peak_holders = self._snapshot()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        inputs = {id(s) for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor) for s in [_storage(t)]}
        out = func(*args, **kwargs)
        op = str(func.overloadpacket.__name__) if hasattr(func, "overloadpacket") else str(func)
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._count(t, op, inputs)
        return out


def _storage(t: torch.Tensor) -> Any:
    try:
        return t.untyped_storage()
    except (NotImplementedError, RuntimeError):  # tensors without storage (sparse, functional wrappers)
        return None


def track_modules(model: torch.nn.Module, mem: LiveBytes) -> list[Any]:
    """Open a label named after each submodule around its forward (returns the hook handles; `.remove()` them)."""
    handles = []
    for name, module in model.named_modules():
        if not name:
            continue
        stack: list[Any] = []

        def pre(_module: Any, _args: Any, name: str = name, stack: list[Any] = stack) -> None:
            ctx = mem.label(name)
            ctx.__enter__()
            stack.append(ctx)

        def post(_module: Any, _args: Any, _out: Any, stack: list[Any] = stack) -> None:
            stack.pop().__exit__(None, None, None)

        handles.append(module.register_forward_pre_hook(pre))
        handles.append(module.register_forward_hook(post))
    return handles
