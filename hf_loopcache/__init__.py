"""hf_loopcache: fast, small key/value caches for looped (recurrent-depth) language models in transformers.

`import hf_loopcache` registers the native Ouro and Huginn models with transformers' Auto classes (see
`hf_loopcache.models`); it has no other side effects.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from hf_loopcache.cache import (
    CachePlan,
    DeepestPlaneCache,
    FullLoopCache,
    LoopCache,
    LoopKVCache,
    RIPECache,
    build_cache,
)
from hf_loopcache.generation import SpeculativeStats, self_speculative, self_speculative_generate
from hf_loopcache.layout import Cell, LoopLayout
from hf_loopcache.models import HuginnConfig, HuginnForCausalLM, OuroConfig, OuroForCausalLM, register

__version__ = "0.1.0"

_LAZY = {
    "load_fixture": "hf_loopcache.fixtures",
    "list_fixtures": "hf_loopcache.fixtures",
}

__all__ = [
    "CachePlan",
    "Cell",
    "DeepestPlaneCache",
    "FullLoopCache",
    "HuginnConfig",
    "HuginnForCausalLM",
    "LoopCache",
    "LoopKVCache",
    "LoopLayout",
    "OuroConfig",
    "OuroForCausalLM",
    "RIPECache",
    "SpeculativeStats",
    "__version__",
    "build_cache",
    "list_fixtures",
    "load_fixture",
    "register",
    "self_speculative",
    "self_speculative_generate",
]

if TYPE_CHECKING:
    from hf_loopcache.fixtures import list_fixtures, load_fixture


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'hf_loopcache' has no attribute {name!r}")
