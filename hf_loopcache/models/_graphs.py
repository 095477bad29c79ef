"""The fast decode path of a static `LoopCache`: forwards after the prefill captured in CUDA graphs, one per batch size,
query length and forward options (loop count, logits kept).

transformers' `generate` decodes through `model.get_compiled_call(compile_config)` when the cache says
`is_compileable` and the model is on CUDA (5.24 does so by itself; older releases too). The native looped models return
a `DecodeGraphs` there, and self-speculative decoding calls it for its drafts (one token, `d` loops) and verifications
(`gamma + 1` tokens, every loop). The first call of a kind runs eagerly (it is the warm-up and a real step), then the
same forward is captured into a CUDA graph; every later call copies its inputs into the graph's input buffers, replays
it, and advances the host-side length of each cell the forward wrote (recorded at the warm-up: a draft writes the
cells of its `d` loops only). Everything else (prefill, CPU, growable caches, calls with tensors among the keyword
arguments) runs the model eagerly.

The graphs live on the cache (`LoopCache._graphs`), so they are freed with it, and `cache.reset()` keeps them valid (a
static cache keeps its storage). A captured step reads the cache's device-side length and key validity and the
storage addresses, which is why the forward must not read device values on the host (see `LoopCache.static_inputs`).
"""

from __future__ import annotations

import operator
import time
from dataclasses import dataclass
from typing import Any

import torch
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.utils import logging

from hf_loopcache._compat import OUTPUT_CACHE_FIELD, causal_lm_output, generate_cache

__all__ = ["DecodeGraphs"]

logger = logging.get_logger(__name__)

_SCALARS = (bool, int, float, str, type(None))
_INPUTS = frozenset(("input_ids", "attention_mask", "position_ids", "cache", "past_key_values", "cache_position"))
_MISSING = object()


@dataclass
class _Captured:
    graph: Any
    input_ids: torch.Tensor
    attention_mask: torch.Tensor | None
    position_ids: torch.Tensor | None
    logits: torch.Tensor | None = None
    capture_s: float = 0.0  # the eager warm-up step plus the capture
    written: list[int] | None = None  # positions the forward writes into each cell (flat index)
    written_cells: Any = None  # `operator.itemgetter` of the cells it writes (a tuple of their host lengths)
    writes_all: bool = False  # it writes every cell (a full decode step): they agree when all lengths are equal
    advances: list | None = None  # `(cell.advance, n)` of those cells (`LoopCache._host_advances`)


class DecodeGraphs:
    """`generate`'s decode call for a static `LoopCache`: replays a CUDA graph of the one-token forward per batch size
    and forward options; falls back to the eager forward wherever a step cannot be captured.

    The seconds each capture took (its eager warm-up step plus the capture) are kept with the graph:
    `LoopCache.captured_steps()`.
    """

    def __init__(self, model: Any) -> None:
        self.model = model

    # ---------------------------------------------------------------- the device side (CUDA graphs)
    def _capturable(self, ids: torch.Tensor) -> bool:
        return ids.is_cuda

    def _warm_up(self, fn: Any) -> Any:
        """Run `fn` eagerly on a side stream (as CUDA graph capture wants it) and return its result."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            out = fn()
        torch.cuda.current_stream().wait_stream(stream)
        return out

    def _record(self, fn: Any, cache: Any) -> tuple[Any, Any]:
        """Capture `fn` (recorded, not run: the cache is unchanged) into a CUDA graph; returns the graph and `fn`'s
        output, which every replay overwrites."""
        if getattr(cache, "_graph_pool", None) is None:
            cache._graph_pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=cache._graph_pool):
            out = fn()
        torch.cuda.synchronize()
        return graph, out

    # ---------------------------------------------------------------- the host side
    def _key(self, cache: Any, kwargs: dict[str, Any], low: int, high: int) -> tuple | None:
        """The graph key of a call to a static cache, or None if the call must run eagerly (`low`, `high`: the fewest
        and most positions a cell holds, host side)."""
        ids = kwargs.get("input_ids")
        mask, pos = kwargs.get("attention_mask"), kwargs.get("position_ids")
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or not self._capturable(ids):
            return None
        q = ids.shape[1]
        if kwargs.get("inputs_embeds") is not None or kwargs.get("output_attentions") or kwargs.get(
            "output_hidden_states"
        ):
            return None
        if mask is not None and (not isinstance(mask, torch.Tensor) or mask.dim() != 2):
            return None
        if pos is not None and (not isinstance(pos, torch.Tensor) or pos.shape[-1] != q):
            return None
        if cache._length_t is None or low == 0 or high + q > cache.max_cache_len:
            return None  # before the prefill or at the end of the storage: eager (raises there)
        rest = tuple(sorted((k, v) for k, v in kwargs.items() if k not in _INPUTS))
        if not all(isinstance(v, _SCALARS) for _, v in rest):
            return None
        storage = cache.cells[0].k.data_ptr() if getattr(cache.cells[0], "k", None) is not None else 0
        mode = cache._step_mode(q, ids.is_cuda)  # what reads depend on besides shapes (V precision in blocks, dense reads)
        return (ids.shape[0], q, mask is not None, pos is not None, storage, cache._floor_groups(), mode, rest)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        cache = generate_cache(kwargs)
        if args or not getattr(cache, "static", False):
            return self.model(*args, **kwargs)
        lengths = cache._host_lengths()
        low, high = min(lengths), max(lengths)
        key = self._key(cache, kwargs, low, high)
        if key is None:
            return self.model(*args, **kwargs)
        q = key[1]
        mask = kwargs.get("attention_mask")
        if mask is not None and mask.shape[1] > q:  # earlier columns may have changed (holes of a verification)
            width = min(mask.shape[1] - q, cache.max_cache_len)
            cache._valid_t[: mask.shape[0], :width].copy_(mask[:, :width])  # one kernel: `copy_` casts to bool
        entry = cache._graphs.get(key, _MISSING)
        if entry is None:  # capture failed before: eager
            return self.model(*args, **kwargs)
        if entry is _MISSING:
            return self._capture(key, cache, kwargs)
        # the cells it writes must agree (they do not after a draft that was not rolled back: eager raises)
        if entry.writes_all:
            if low != high:
                return self.model(*args, **kwargs)
        else:
            written = entry.written_cells(lengths) if entry.written_cells is not None else (0, 1)
            if min(written) != max(written):
                return self.model(*args, **kwargs)
        entry.input_ids.copy_(kwargs["input_ids"])
        if entry.attention_mask is not None:
            entry.attention_mask.copy_(mask[:, -q:])
        if entry.position_ids is not None:
            entry.position_ids.copy_(kwargs["position_ids"].reshape(entry.position_ids.shape))
        entry.graph.replay()
        for advance, n in entry.advances:  # type: ignore[union-attr]
            advance(n)
        return causal_lm_output(entry.logits.clone(), cache)

    def _forward(self, entry: _Captured, cache: Any, kwargs: dict[str, Any]) -> Any:
        rest = {k: v for k, v in kwargs.items() if k not in ("input_ids", "attention_mask", "position_ids", "cache",
                                                               "past_key_values", "cache_position")}
        return self.model(
            input_ids=entry.input_ids,
            attention_mask=entry.attention_mask,
            position_ids=entry.position_ids,
            cache=cache,
            **rest,
        )

    def _capture(self, key: tuple, cache: Any, kwargs: dict[str, Any]) -> Any:
        start = time.perf_counter()
        ids, mask, pos = kwargs["input_ids"], kwargs.get("attention_mask"), kwargs.get("position_ids")
        q = ids.shape[1]
        entry = _Captured(
            graph=None,
            input_ids=ids.clone(),
            attention_mask=None if mask is None else mask[:, -q:].clone(),
            position_ids=None if pos is None else pos.reshape(ids.shape[0], q).clone(),
        )
        # the warm-up is this step, run eagerly (it writes the cache)
        before = cache._host_lengths()
        logits = self._warm_up(lambda: self._forward(entry, cache, kwargs).logits.clone())
        lengths, host = cache._host_lengths(), cache._host_state()
        entry.written = [after - earlier for after, earlier in zip(lengths, before)]
        entry.advances = cache._host_advances(entry.written)
        cells = [i for i, n in enumerate(entry.written) if n]
        if cells:  # (the first one twice: a tuple for a single cell too)
            entry.written_cells = operator.itemgetter(*cells, cells[0])
            entry.writes_all = len(cells) == len(entry.written)
        try:
            entry.graph, entry.logits = self._record(lambda: self._forward(entry, cache, kwargs).logits, cache)
        except RuntimeError as err:  # an op that cannot be captured: this batch size decodes eagerly from now on
            logger.warning_once(f"the decode step could not be captured in a CUDA graph ({err}); decoding eagerly")
            cache._graphs[key] = None
            return CausalLMOutputWithPast(logits=logits, **{OUTPUT_CACHE_FIELD: cache})
        finally:
            cache._restore_host_state(host)  # the recording ran the host side of the step once more
        cache._graphs[key] = entry
        entry.capture_s = time.perf_counter() - start
        return CausalLMOutputWithPast(logits=logits, **{OUTPUT_CACHE_FIELD: cache})
