"""Presets over the one engine: the full cache, RIPE and the deepest plane."""

from __future__ import annotations

import os
from typing import Any

from hf_loopcache.attention import VPrecision
from hf_loopcache.cache.base import LoopCache, resolve_layout
from hf_loopcache.cache.plan import LOOPKV_PRESETS, CachePlan, loopkv_preset

__all__ = ["DeepestPlaneCache", "FullLoopCache", "LoopKVCache", "RIPECache"]


def check_v_precision_blocks(value: object) -> None:
    """`LoopKVCache`'s `v_precision_blocks` must be True, False or None (`build_cache` checks it before it fetches a
    plan)."""
    if value is not None and not isinstance(value, bool):
        raise ValueError(f"`v_precision_blocks` must be True, False or None, got {value!r}")


class FullLoopCache(LoopCache):
    """Every loop's keys and values at full precision: the BF16 per-loop baseline (RIPE Eq. 3, `M_full`).

    Args:
        model_or_layout: a native looped model, its config, or a `LoopLayout`.
        num_loops (`int`, *optional*): most loops a forward may run; defaults to the model's.
        static, max_batch_size, max_cache_len: a static cache (preallocated storage, device-side lengths, a decode
            step `generate` captures in a CUDA graph); see `LoopCache`.

    Example (static; `generate` on CUDA replays a captured decode step per batch size):

    ```python
    >>> cache = FullLoopCache(model, static=True, max_batch_size=8, max_cache_len=8192)
    >>> out = model.generate(**inputs, cache=cache, max_new_tokens=128)
    ```
    """

    def __init__(
        self,
        model_or_layout: Any,
        *,
        num_loops: int | None = None,
        static: bool = False,
        max_batch_size: int | None = None,
        max_cache_len: int | None = None,
    ) -> None:
        super().__init__(
            model_or_layout,
            CachePlan.full(resolve_layout(model_or_layout, num_loops)),
            static=static,
            max_batch_size=max_batch_size,
            max_cache_len=max_cache_len,
        )


class RIPECache(LoopCache):
    """RIPE(W): the deepest plane for every position, all planes for the `window` most recent (RIPE Eq. 9-10).

    Core cells of loops before the last read the final loop's keys and values of their layer for positions older
    than `window` (and keep only the window themselves); prelude, coda and the final loop store everything. With
    `window >= gamma`, verifying a block of `gamma + 1` tokens in one pass equals decoding them one at a time
    (RIPE Proposition 1).

    Args:
        model_or_layout: a native looped model, its config, or a `LoopLayout`.
        window (`int`, *optional*, defaults to 64): `W`, recent positions kept at full depth.
        sink (`int`, *optional*, defaults to 0): first positions kept at full depth.
        num_loops (`int`, *optional*): loop count (the final loop is the deepest plane); defaults to the model's.
        max_rollback (`int`, *optional*, defaults to 0): extra positions kept at full depth so `crop` by up to this
            many stays exact (self-speculative verification uses the block size).
        static, max_batch_size, max_cache_len: a static cache (preallocated storage, device-side lengths, a decode
            step `generate` captures in a CUDA graph); see `LoopCache`.
    """

    def __init__(
        self,
        model_or_layout: Any,
        window: int = 64,
        *,
        sink: int = 0,
        num_loops: int | None = None,
        max_rollback: int = 0,
        static: bool = False,
        max_batch_size: int | None = None,
        max_cache_len: int | None = None,
    ) -> None:
        plan = CachePlan.ripe(resolve_layout(model_or_layout, num_loops), window=window, sink=sink)
        super().__init__(
            model_or_layout,
            plan,
            max_rollback=max_rollback,
            static=static,
            max_batch_size=max_batch_size,
            max_cache_len=max_cache_len,
        )

    @property
    def window(self) -> int:
        return self.plan.window


class DeepestPlaneCache(RIPECache):
    """Only the deepest plane for every cached position (RIPE with `window=0`; Huginn's `compress-s4`)."""

    def __init__(
        self,
        model_or_layout: Any,
        *,
        num_loops: int | None = None,
        max_rollback: int = 0,
        static: bool = False,
        max_batch_size: int | None = None,
        max_cache_len: int | None = None,
    ) -> None:
        super().__init__(
            model_or_layout,
            window=0,
            num_loops=num_loops,
            max_rollback=max_rollback,
            static=static,
            max_batch_size=max_batch_size,
            max_cache_len=max_cache_len,
        )


class LoopKVCache(LoopCache):
    """LoopKV: per-cell INT4 / INT2 / share history with a BF16 sink and window, and read-time V precision.

    Positions leave the window in pages of 32 and are coded KIVI-style (keys per channel over the page, values per
    token in groups of 32 channels, fp16 scale and zero; INT4 values as two 2-bit planes). A shared cell reads the
    final loop's codes of its layer. With V precision, a history token whose score is below the running maximum
    (seeded with the sink's) minus `tau * ln 2` reads only the high plane of its INT4 value (LoopKV Sec. 3.3); the
    output then moves by at most `1.5 * sum_{cold j} a_j * scale_j` (LoopKV Proposition 1).

    Args:
        model_or_layout: a native looped model, its config, or a `LoopLayout`.
        plan (`CachePlan`, `str` or `os.PathLike`, *optional*, defaults to `"kivi4"`): a plan (e.g. from the planner
            or `CachePlan.from_pretrained`), a preset name (one of `LOOPKV_PRESETS`), or a local folder / JSON file
            written by `CachePlan.save_pretrained`.
        tau (`float`, *optional*, defaults to 14.0): V-precision threshold in bits; None reads every low plane.
        v_precision_blocks (`bool`, *optional*): V precision in forwards of several new tokens too, per query row as
            decoding reads. True: in every such forward (verification blocks, replay in blocks); False: those read
            both planes of every history token; None (the default): V precision in blocks except a self-speculative
            decode's verification blocks, which read both planes (faster; `VPrecision.blocks`).
        max_rollback (`int`, *optional*, defaults to 0): see `LoopCache`.
        num_loops (`int`, *optional*): loop count for a preset plan; defaults to the model's.
        static, max_batch_size, max_cache_len: a static cache (preallocated storage, device-side lengths, a decode
            step `generate` captures in a CUDA graph); see `LoopCache`.
    """

    def __init__(
        self,
        model_or_layout: Any,
        plan: CachePlan | str | os.PathLike = "kivi4",
        *,
        tau: float | None = 14.0,
        v_precision_blocks: bool | None = None,
        max_rollback: int = 0,
        num_loops: int | None = None,
        static: bool = False,
        max_batch_size: int | None = None,
        max_cache_len: int | None = None,
    ) -> None:
        if isinstance(plan, str) and plan in LOOPKV_PRESETS:
            plan = loopkv_preset(resolve_layout(model_or_layout, num_loops), plan)
        elif isinstance(plan, (str, os.PathLike)):
            if not os.path.exists(plan):
                raise ValueError(
                    f"`plan` must be a CachePlan, one of {LOOPKV_PRESETS}, or a folder / JSON file saved by "
                    f"`CachePlan.save_pretrained`; got {os.fspath(plan)!r}, which is none of these (no such path)"
                )
            plan = CachePlan.from_pretrained(plan)
        elif not isinstance(plan, CachePlan):
            raise TypeError(
                f"`plan` must be a CachePlan, one of {LOOPKV_PRESETS}, or a plan folder; got {type(plan).__name__}"
            )
        check_v_precision_blocks(v_precision_blocks)
        v_precision = None if tau is None else VPrecision(tau=tau, page_size=plan.page_size, blocks=v_precision_blocks)
        super().__init__(
            model_or_layout,
            plan,
            max_rollback=max_rollback,
            v_precision=v_precision,
            static=static,
            max_batch_size=max_batch_size,
            max_cache_len=max_cache_len,
        )
