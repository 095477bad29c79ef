"""The cache engine (`LoopCache`), its per-cell layers, plans, and presets."""

from hf_loopcache.cache.base import LoopCache
from hf_loopcache.cache.layers import DenseLayer, WindowedLayer
from hf_loopcache.cache.plan import OPTIONS, CachePlan
from hf_loopcache.cache.presets import DeepestPlaneCache, FullLoopCache, RIPECache

__all__ = [
    "OPTIONS",
    "CachePlan",
    "DeepestPlaneCache",
    "DenseLayer",
    "FullLoopCache",
    "LoopCache",
    "RIPECache",
    "WindowedLayer",
]
