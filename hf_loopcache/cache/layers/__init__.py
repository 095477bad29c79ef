"""Per-cell storage: the `CacheLayerMixin` subclasses a `LoopCache` holds, one per cell, one storage kind each.

- `DenseLayer`: every position at full precision (option `bf16`).
- `CodedLayer`: full-precision sink and window, own KIVI code pages in between (`int4`, `int2`).
- `SharedLayer`: full-precision sink and window, the history read from a source cell's storage (`share`).
- `StaticDenseLayer`: `bf16` cells of a static cache (preallocated storage, writes and reads at device-side
  positions, so a decode step can be captured).
- `StaticCodedLayer`, `StaticCodedSharedLayer`: `int4` / `int2` cells and `share` cells of a static cache (BF16 sink,
  a ring window, preallocated codes or the source's storage read in place, the page flush inside the step; rows with
  holes read by their effective positions).

`WindowedLayer` is what coded and shared cells share (sink, window, the reading rule); `LoopLayerBase` the contract.
"""

from hf_loopcache.cache.layers.base import LoopLayerBase
from hf_loopcache.cache.layers.coded import CodedLayer
from hf_loopcache.cache.layers.dense import DenseLayer
from hf_loopcache.cache.layers.shared import SharedLayer
from hf_loopcache.cache.layers.static import StaticDenseLayer
from hf_loopcache.cache.layers.static_coded import StaticCodedLayer, StaticCodedSharedLayer
from hf_loopcache.cache.layers.windowed import WindowedLayer

__all__ = [
    "CodedLayer",
    "DenseLayer",
    "LoopLayerBase",
    "SharedLayer",
    "StaticCodedLayer",
    "StaticCodedSharedLayer",
    "StaticDenseLayer",
    "WindowedLayer",
]
