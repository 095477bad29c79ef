"""The one place that knows how `transformers` releases differ (supported: >=5.17,<5.25).

| what                                  | 5.17 - 5.23          | 5.24                         |
|---------------------------------------|----------------------|------------------------------|
| cache keyword of forward / generate   | `past_key_values`    | `cache` (`past_key_values` deprecated) |
| cache field of `ModelOutput`s         | `past_key_values`    | `cache`                      |
| `Cache.get_max_cache_shape`           | present              | removed (`get_max_length`)   |

Everything else the package touches (`Cache(layers=...)`, `CacheLayerMixin`, `get_mask_sizes(query_length, layer_idx)`,
`crop(tokens_to_remove <= 0)`, `transformers.initialization`) is the same in the whole supported range.
"""

from __future__ import annotations

import inspect
from typing import Any

from transformers.generation import GenerationMixin
from transformers.modeling_outputs import CausalLMOutputWithPast

__all__ = ["CACHE_KWARG", "OUTPUT_CACHE_FIELD", "cache_argument"]

#: name under which `generate` hands the cache to `forward` and keeps it in `model_kwargs`
CACHE_KWARG: str = (
    "cache"
    if "cache" in inspect.signature(GenerationMixin.prepare_inputs_for_generation).parameters
    else "past_key_values"
)
#: name of the cache field of `CausalLMOutputWithPast` and friends
OUTPUT_CACHE_FIELD: str = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


def cache_argument(past_key_values: Any, cache: Any) -> Any:
    """The cache passed to a forward under either name (`past_key_values=` or `cache=`); both at once is an error."""
    if past_key_values is not None and cache is not None:
        raise ValueError("Pass the cache as either `past_key_values=` or `cache=`, not both.")
    return past_key_values if past_key_values is not None else cache
