"""`build_cache(model, spec, **options)`: one cache grammar for every door (CLI `--cache`, lm-eval `model_args`,
benchmarks, examples).

`spec` is resolved in this order:

| spec                 | cache                                                                 | options it takes                  |
|----------------------|-----------------------------------------------------------------------|-----------------------------------|
| `full`               | `FullLoopCache`: every loop's K/V at full precision                    | num_loops                         |
| `ripe`               | `RIPECache(window=64)`: deepest plane + the last `window` at full depth | window, sink, num_loops, max_rollback |
| `deepest`            | `DeepestPlaneCache`: the deepest plane only (RIPE with window 0)       | num_loops, max_rollback           |
| `loopkv:<preset>`    | `LoopKVCache` with a preset of `LOOPKV_PRESETS` (`loopkv:kivi4-share`) | tau, v_precision_blocks, sink, window, page_size, group_size, num_loops, max_rollback |
| a local plan folder  | `LoopKVCache` with the folder's `loopcache_plan.json` (or that file)  | tau, v_precision_blocks, max_rollback |
| a Hub id `owner/name`| `LoopKVCache` with the repository's `loopcache_plan.json`            | tau, v_precision_blocks, max_rollback, plan_revision |

`build_cache` also takes `static`, `max_batch_size` and `max_cache_len` for every spec: `static=True` builds the cache with preallocated
storage and device-side lengths, so a decode step can be captured (`LoopCache`; full, ripe
and deepest for now: LoopKV's coded cells are refused).

Options are separate keywords, so lm-eval reads `cache=ripe,window=64` and the CLI `--cache ripe --window 64`. An
option the spec does not take is refused (ValueError naming the allowed ones), never ignored.
"""

from __future__ import annotations

import os
from typing import Any

from hf_loopcache._hub import looks_like_local_path
from hf_loopcache.cache.base import LoopCache, resolve_layout
from hf_loopcache.cache.plan import LOOPKV_PRESETS, PLAN_FILE, CachePlan, loopkv_preset
from hf_loopcache.cache.presets import (
    DeepestPlaneCache,
    FullLoopCache,
    LoopKVCache,
    RIPECache,
    check_v_precision_blocks,
)

__all__ = ["CACHE_OPTIONS", "CACHE_SPECS", "build_cache", "cache_options"]

CACHE_SPECS = ("full", "ripe", "deepest", *(f"loopkv:{p}" for p in LOOPKV_PRESETS))
"""The named specs; a local plan folder or a Hub id `owner/name` are accepted too."""

_OPTIONS: dict[str, tuple[str, ...]] = {
    "full": ("num_loops",),
    "ripe": ("window", "sink", "num_loops", "max_rollback"),
    "deepest": ("num_loops", "max_rollback"),
    "loopkv": ("tau", "v_precision_blocks", "sink", "window", "page_size", "group_size", "num_loops", "max_rollback"),
    "folder": ("tau", "v_precision_blocks", "max_rollback"),
    "hub": ("tau", "v_precision_blocks", "max_rollback", "plan_revision"),
}
CACHE_OPTIONS: tuple[str, ...] = tuple(sorted({name for names in _OPTIONS.values() for name in names}))
"""Every option name some spec takes (callers such as the lm-eval model use it to tell cache options apart)."""

_ALLOWED = (
    f"{', '.join(CACHE_SPECS[:3])}, loopkv:<preset> (preset one of {', '.join(LOOPKV_PRESETS)}), "
    f"a local plan folder holding {PLAN_FILE}, or a Hub id 'owner/name'"
)


def _kind(spec: Any) -> tuple[str, str | None]:
    """(kind, preset) of `spec`, resolved in the documented order."""
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"`spec` must be {_ALLOWED}; got {spec!r}")
    if spec in ("full", "ripe", "deepest"):
        return spec, None
    if spec.startswith("loopkv:") or spec == "loopkv":
        preset = spec.partition(":")[2]
        if preset not in LOOPKV_PRESETS:
            raise ValueError(
                f"`spec` {spec!r} names an unknown LoopKV preset {preset!r}; presets: "
                f"{', '.join(f'loopkv:{p}' for p in LOOPKV_PRESETS)}"
            )
        return "loopkv", preset
    if os.path.exists(spec):
        return "folder", None
    if looks_like_local_path(spec):
        raise ValueError(
            f"`spec` {spec!r} looks like a local path, but nothing exists there; `spec` must be {_ALLOWED}"
        )
    if spec.count("/") == 1:  # a Hub id `owner/name`; a bare name is a misspelt spec, not a repository
        return "hub", None
    raise ValueError(f"`spec` must be {_ALLOWED}; got {spec!r}")


def cache_options(spec: str) -> tuple[str, ...]:
    """The option keywords `build_cache` accepts for `spec` (checks `spec` like `build_cache`, without loading)."""
    return _OPTIONS[_kind(spec)[0]]


def build_cache(
    model: Any,
    spec: str,
    *,
    static: bool = False,
    max_batch_size: int | None = None,
    max_cache_len: int | None = None,
    **options: Any,
) -> LoopCache:
    """Build a fresh cache for `model` from a spec string and keyword options (table in the module docstring).

    Args:
        model: a native looped model (`OuroForCausalLM`, `HuginnForCausalLM`), its config, or a `LoopLayout`.
        spec (`str`): `full`, `ripe`, `deepest`, `loopkv:<preset>`, a local plan folder, or a Hub id, resolved in this
            order.
        static (`bool`, *optional*, defaults to False), max_batch_size (`int`), max_cache_len (`int`): build a static
            cache (preallocated storage, device-side lengths: a decode step `generate` captures; see `LoopCache`).
            Every spec takes them; plans with coded cells are refused for now. They are not among `CACHE_OPTIONS`.
        **options: `window`, `sink`, `tau`, `v_precision_blocks`, `page_size`, `group_size`, `num_loops`,
            `max_rollback`, `plan_revision`, as the spec takes them (`window` defaults to 64 for `ripe` and to 256 for
            LoopKV presets; `tau` to 14.0, None turns V precision off; `v_precision_blocks` to None (V precision in blocks
            except a self-speculative decode's), True or False: `LoopKVCache`).

    Returns:
        `LoopCache`: a new, empty cache (one per request: caches hold one sequence batch's history).

    Raises:
        ValueError: unknown spec or preset, an option the spec does not take, or a bad option value.
        OSError: a Hub id whose plan cannot be downloaded (offline: pass a local folder).

    Example:

    ```python
    >>> from hf_loopcache import build_cache, load_fixture
    >>> model, tok = load_fixture("tiny-ouro")
    >>> build_cache(model, "ripe", window=64)
    >>> build_cache(model, "loopkv:kivi4-share", tau=None)
    ```
    """
    kind, preset = _kind(spec)
    allowed = _OPTIONS[kind]
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise ValueError(
            f"cache spec {spec!r} does not take option(s) {', '.join(unknown)}; it takes: "
            f"{', '.join(allowed) if allowed else 'none'}"
        )
    tau = options.pop("tau", 14.0)
    if tau is not None and (isinstance(tau, bool) or not isinstance(tau, (int, float))):
        raise ValueError(f"`tau` must be a number of bits or None (V precision off), got {tau!r}")
    tau = None if tau is None else float(tau)
    blocks = options.pop("v_precision_blocks", None)
    check_v_precision_blocks(blocks)
    static_options = dict(static=static, max_batch_size=max_batch_size, max_cache_len=max_cache_len)
    if kind == "full":
        return FullLoopCache(model, **options, **static_options)
    if kind == "ripe":
        return RIPECache(model, **options, **static_options)
    if kind == "deepest":
        return DeepestPlaneCache(model, **options, **static_options)
    max_rollback = options.pop("max_rollback", 0)
    if kind == "loopkv":
        assert preset is not None
        layout = resolve_layout(model, options.pop("num_loops", None))
        plan = loopkv_preset(layout, preset, **options)
    elif kind == "folder":
        plan = CachePlan.from_pretrained(spec)
    else:
        plan = CachePlan.from_pretrained(spec, revision=options.pop("plan_revision", None))
    return LoopKVCache(model, plan, tau=tau, v_precision_blocks=blocks, max_rollback=max_rollback, **static_options)
