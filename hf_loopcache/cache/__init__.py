"""The cache engine (`LoopCache`), its per-cell layers, plans, and presets."""

from hf_loopcache.cache.base import LoopCache
from hf_loopcache.cache.layers import DenseLayer, WindowedLayer
from hf_loopcache.cache.plan import LOOPKV_PRESETS, OPTIONS, CachePlan, loopkv_preset
from hf_loopcache.cache.presets import DeepestPlaneCache, FullLoopCache, LoopKVCache, RIPECache

__all__ = [
    "LOOPKV_PRESETS",
    "OPTIONS",
    "CachePlan",
    "DeepestPlaneCache",
    "DenseLayer",
    "FullLoopCache",
    "LoopCache",
    "LoopKVCache",
    "RIPECache",
    "WindowedLayer",
    "loopkv_preset",
]
