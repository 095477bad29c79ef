"""`LoopCache` as a `torch.utils._pytree` node, so `torch.export` (and transformers' exporters) can take and return it.

The flatten walks the cache's object graph: its tensors become the leaves; everything else becomes a JSON-native
context (plain values, lists, string-keyed dicts, `{"obj": class path, "state": ...}` for objects, references for
objects met twice, e.g. a shared cell's source or a cell's owner). The plan and layout are stored by their
`to_dict()` forms and cells by name, so the context survives `torch.export.save`. Unflatten rebuilds an equal cache
around the given leaves.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch
import torch.utils._pytree as pytree

from hf_loopcache.cache.plan import CachePlan
from hf_loopcache.layout import Cell, LoopLayout

__all__ = ["register_loop_cache_pytree"]


def _class_path(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def _class_at(path: str) -> type:
    module, _, name = path.partition(":")
    obj: Any = importlib.import_module(module)
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


def _to_context(obj: Any, leaves: list[Any], memo: dict[int, int]) -> Any:
    if obj is None or type(obj) in (bool, int, float, str):
        return obj
    if isinstance(obj, (torch.Tensor, torch.SymInt, torch.SymFloat, torch.SymBool)):
        leaves.append(obj)
        return {"leaf": len(leaves) - 1}
    if isinstance(obj, torch.dtype):
        return {"dtype": str(obj).removeprefix("torch.")}
    if isinstance(obj, torch.device):
        return {"device": str(obj)}
    if isinstance(obj, Cell):
        return {"cell": str(obj)}
    if isinstance(obj, LoopLayout):
        return {"layout": obj.to_dict()}
    if isinstance(obj, CachePlan):
        return {"plan": obj.to_dict()}
    if type(obj) in (list, tuple):
        return {"seq": type(obj).__name__, "items": [_to_context(x, leaves, memo) for x in obj]}
    if type(obj) is dict and all(type(k) is str for k in obj):
        return {"dict": {k: _to_context(v, leaves, memo) for k, v in obj.items()}}
    if id(obj) in memo:
        return {"ref": memo[id(obj)]}
    if hasattr(obj, "__dict__") and not callable(obj):
        memo[id(obj)] = len(memo)
        state = {k: _to_context(v, leaves, memo) for k, v in vars(obj).items()}
        return {"obj": _class_path(type(obj)), "id": memo[id(obj)], "state": state}
    raise TypeError(f"cannot flatten a {type(obj).__name__} held by a LoopCache into a pytree context")


def _from_context(ctx: Any, leaves: list[Any], memo: dict[int, Any]) -> Any:
    if ctx is None or type(ctx) in (bool, int, float, str):
        return ctx
    ((tag, value),) = ((k, v) for k, v in ctx.items() if k in _TAGS)
    if tag == "leaf":
        return leaves[value]
    if tag == "dtype":
        return getattr(torch, value)
    if tag == "device":
        return torch.device(value)
    if tag == "cell":
        return Cell.parse(value)
    if tag == "layout":
        return LoopLayout.from_dict(value)
    if tag == "plan":
        return CachePlan.from_dict(value)
    if tag == "seq":
        items = [_from_context(x, leaves, memo) for x in ctx["items"]]
        return tuple(items) if value == "tuple" else items
    if tag == "dict":
        return {k: _from_context(v, leaves, memo) for k, v in value.items()}
    if tag == "ref":
        return memo[value]
    cls = _class_at(value)
    instance = cls.__new__(cls)
    memo[ctx["id"]] = instance  # before the state: a cell's `owner` points back at the cache
    for key, item in ctx["state"].items():
        instance.__dict__[key] = _from_context(item, leaves, memo)
    return instance


_TAGS = ("leaf", "dtype", "device", "cell", "layout", "plan", "seq", "dict", "ref", "obj")


def _flatten(cache: Any) -> tuple[list[Any], Any]:
    leaves: list[Any] = []
    return leaves, _to_context(cache, leaves, {})


def _flatten_with_keys(cache: Any) -> tuple[list[tuple[Any, Any]], Any]:
    leaves, context = _flatten(cache)
    return [(pytree.SequenceKey(i), leaf) for i, leaf in enumerate(leaves)], context


def _unflatten(leaves: Any, context: Any) -> Any:
    return _from_context(context, list(leaves), {})


def register_loop_cache_pytree(cls: type) -> None:
    """Make `cls` (a `LoopCache` class) a pytree node; registering a class twice is a no-op."""
    if cls in pytree.SUPPORTED_NODES:
        return
    pytree.register_pytree_node(
        cls,
        _flatten,
        _unflatten,
        serialized_type_name=_class_path(cls),
        flatten_with_keys_fn=_flatten_with_keys,
    )
