"""The cache engine (`LoopCache`), its per-cell layers, plans, presets, and `build_cache` (one spec grammar)."""

from hf_loopcache.cache.base import LoopCache
from hf_loopcache.cache.factory import CACHE_OPTIONS, CACHE_SPECS, build_cache, cache_options
from hf_loopcache.cache.layers import CodedLayer, DenseLayer, LoopLayerBase, SharedLayer, WindowedLayer
from hf_loopcache.cache.plan import LOOPKV_PRESETS, OPTIONS, CachePlan, loopkv_preset
from hf_loopcache.cache.presets import DeepestPlaneCache, FullLoopCache, LoopKVCache, RIPECache
from hf_loopcache.cache.read import ReadState

__all__ = [
    "CACHE_OPTIONS",
    "CACHE_SPECS",
    "LOOPKV_PRESETS",
    "OPTIONS",
    "CachePlan",
    "CodedLayer",
    "DeepestPlaneCache",
    "DenseLayer",
    "FullLoopCache",
    "LoopCache",
    "LoopKVCache",
    "LoopLayerBase",
    "ReadState",
    "RIPECache",
    "SharedLayer",
    "WindowedLayer",
    "build_cache",
    "cache_options",
    "loopkv_preset",
]
