"""The cache engine (`LoopCache`), its per-cell layers, plans, and presets."""

from hf_loopcache.cache.base import LoopCache
from hf_loopcache.cache.layers import CodedLayer, DenseLayer, LoopLayerBase, SharedLayer, WindowedLayer
from hf_loopcache.cache.plan import LOOPKV_PRESETS, OPTIONS, CachePlan, loopkv_preset
from hf_loopcache.cache.presets import DeepestPlaneCache, FullLoopCache, LoopKVCache, RIPECache
from hf_loopcache.cache.read import ReadState

__all__ = [
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
    "loopkv_preset",
]
