"""The one place that knows how `transformers` releases differ (supported: >=5.17,<5.25).

| what                                  | 5.17 - 5.23          | 5.24                         |
|---------------------------------------|----------------------|------------------------------|
| cache keyword of forward / generate   | `past_key_values`    | `cache` (`past_key_values` deprecated) |
| cache field of `ModelOutput`s         | `past_key_values`    | `cache`                      |
| `Cache.get_max_cache_shape`           | present              | removed (`get_max_length`)   |
| `generate(cache=...)`                 | unknown: forwarded to `forward` beside a default `past_key_values` | the keyword (`past_key_values=` deprecated) |

`prepare_inputs_for_generation` of a decode step is built directly (`decode_step_inputs`), checked against
transformers' own at the first step of each model class.

`generate`'s greedy and sampling loop (`_sample`) decides whether to read its stop flag one step late
(`DeferredStopCheck.is_supported`, the same in 5.17-5.24); transformers enables it on `mps` only. Inside
`deferred_stop_check(True)` it is enabled on CUDA for a cache that can take the extra step back exactly
(`LoopCache.exact_crop`).

Everything else the package touches (`Cache(layers=...)`, `CacheLayerMixin`, `get_mask_sizes(query_length, layer_idx)`,
`crop(tokens_to_remove <= 0)`, `transformers.initialization`) is the same in the whole supported range.
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import torch
from transformers.generation import GenerationMixin
from transformers.generation import utils as _generation_utils
from transformers.generation.utils import MULTIMODAL_INPUTS_TO_DROP_OUTSIDE_PREFILL
from transformers.modeling_outputs import CausalLMOutputWithPast

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

__all__ = [
    "CACHE_KWARG",
    "OUTPUT_CACHE_FIELD",
    "cache_argument",
    "causal_lm_output",
    "decode_step_inputs",
    "deferred_stop_check",
    "generate_cache",
    "generate_cache_kwargs",
]

#: name under which `generate` hands the cache to `forward` and keeps it in `model_kwargs`
CACHE_KWARG: str = (
    "cache"
    if "cache" in inspect.signature(GenerationMixin.prepare_inputs_for_generation).parameters
    else "past_key_values"
)
#: name of the cache field of `CausalLMOutputWithPast` and friends
OUTPUT_CACHE_FIELD: str = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


def _causal_lm_output_fast(logits: Any, cache: Any) -> CausalLMOutputWithPast:
    out = CausalLMOutputWithPast.__new__(CausalLMOutputWithPast)
    for name in _OUTPUT_FIELDS:
        object.__setattr__(out, name, None)
    for name, value in (("logits", logits), (OUTPUT_CACHE_FIELD, cache)):  # the items in field order, as __post_init__
        OrderedDict.__setitem__(out, name, value)
        object.__setattr__(out, name, value)
    return out


def _same_output(a: CausalLMOutputWithPast, b: CausalLMOutputWithPast) -> bool:
    return list(a.items()) == list(b.items()) and vars(a) == vars(b)


_OUTPUT_FIELDS = tuple(CausalLMOutputWithPast.__dataclass_fields__)
_fast_output: bool | None = None  # checked against the dataclass constructor at the first call


def causal_lm_output(logits: Any, cache: Any) -> CausalLMOutputWithPast:
    """`CausalLMOutputWithPast(logits=logits, <cache field>=cache)` in about a microsecond: the dataclass constructor
    of `ModelOutput` costs tens of microseconds (`fields()` per attribute), a replayed decode step's largest host cost.
    The fast object is built as `__post_init__` builds it (items in field order, every field an attribute) and is
    compared with the constructor's at the first call; a release that builds it otherwise takes the constructor."""
    global _fast_output
    if _fast_output is None:
        slow = CausalLMOutputWithPast(logits=logits, **{OUTPUT_CACHE_FIELD: cache})
        try:
            _fast_output = _same_output(_causal_lm_output_fast(logits, cache), slow)
        except Exception:  # noqa: BLE001 - any difference means the constructor
            _fast_output = False
        return slow
    if _fast_output:
        return _causal_lm_output_fast(logits, cache)
    return CausalLMOutputWithPast(logits=logits, **{OUTPUT_CACHE_FIELD: cache})


# keys transformers' `prepare_inputs_for_generation` treats apart from "forward the rest": a step with any of them set
# is left to transformers; unset (None), the ones it pops or drops in a decode step are not forwarded
_POPPED = frozenset(("position_ids", "token_type_ids", "mm_token_type_ids", "moe_mm_token_type_ids"))
_SPECIAL_INPUTS = frozenset(
    (_POPPED - {"position_ids"}) | {"decoder_attention_mask", "decoder_position_ids", "cache_position"}
    | set(MULTIMODAL_INPUTS_TO_DROP_OUTSIDE_PREFILL)
)
_NOT_FORWARDED = frozenset(
    _POPPED | {"labels", "next_sequence_length", "is_first_iteration", "inputs_embeds", "attention_mask", CACHE_KWARG}
    | set(MULTIMODAL_INPUTS_TO_DROP_OUTSIDE_PREFILL)
)
_fast_inputs: dict[type, bool] = {}  # per model class: whether the fast inputs equalled transformers' at a first step


def _same_inputs(a: dict[str, Any], b: dict[str, Any]) -> bool:
    if a.keys() != b.keys():
        return False
    for key, x in a.items():
        y = b[key]
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and x.shape == y.shape
                    and x.dtype == y.dtype and x.device == y.device and x.stride() == y.stride() and torch.equal(x, y)):
                return False
        elif x is not y and x != y:
            return False
    return True


def decode_step_inputs(
    model: Any, input_ids: Any, kwargs: dict[str, Any], transformers_inputs: Callable[[], dict[str, Any]]
) -> dict[str, Any]:
    """`prepare_inputs_for_generation`'s result for a one-token decode step into a static `LoopCache`, built directly.

    transformers' generic version (5.17 - 5.24) runs between a step's host sync (the stop check) and the next graph
    replay, so the GPU waits for it: six config reads through `PretrainedConfig.__getattribute__`, the cache's
    `is_compileable` / `is_linear`, the mask function (which these models turn into the 2-D mask as it is) and the
    model's `device`. For such a step it returns the new token's ids and position (contiguous copies of the last
    ones), the cache, the 2-D mask and every other keyword as given (those it pops or drops in a decode step, unset,
    left out); so does this. A step with an input set that transformers slices, converts or drops
    (`_SPECIAL_INPUTS`), an embedded or first step, a mask that is not a contiguous 2-D tensor, or ids on another
    device goes to `transformers_inputs()`. The first fast step of each model class also runs `transformers_inputs()`
    and compares the two (keys; tensors' shapes, strides and values; other values): a release whose result differs
    keeps transformers' from then on."""
    ok = _fast_inputs.get(type(model))
    cache = kwargs.get(CACHE_KWARG)
    mask = kwargs.get("attention_mask")
    if (
        ok is False
        or kwargs.get("next_sequence_length") != 1
        or kwargs.get("is_first_iteration")
        or not kwargs.get("use_cache", True)
        or not getattr(cache, "static", False)
        or getattr(cache, "_length_t", None) is None  # nothing cached yet: a prefill
        or not isinstance(input_ids, torch.Tensor)
        or input_ids.dim() != 2
        or (mask is not None and (not isinstance(mask, torch.Tensor) or mask.dim() != 2 or not mask.is_contiguous()))
        or any(value is not None and key in _SPECIAL_INPUTS for key, value in kwargs.items())
        or input_ids.device != model.device
    ):
        return transformers_inputs()
    out: dict[str, Any] = {"input_ids": input_ids[:, -1:].clone(memory_format=torch.contiguous_format)}
    out[CACHE_KWARG] = cache
    pos = kwargs.get("position_ids")  # (5.24 keeps every position in the kwargs: the step's is the last)
    if pos is not None:
        out["position_ids"] = pos if pos.shape[-1] == 1 else pos[..., -1:].clone(memory_format=torch.contiguous_format)
    if mask is not None:
        out["attention_mask"] = mask
    for key, value in kwargs.items():
        if key not in out and key not in _NOT_FORWARDED:
            out[key] = value
    if ok is None:
        slow = transformers_inputs()
        _fast_inputs[type(model)] = _same_inputs(out, slow)
        return slow
    return out


def cache_argument(past_key_values: Any, cache: Any) -> Any:
    """The cache passed to a forward under either name (`past_key_values=` or `cache=`); both at once is an error."""
    if past_key_values is not None and cache is not None:
        raise ValueError("Pass the cache as either `past_key_values=` or `cache=`, not both.")
    return past_key_values if past_key_values is not None else cache


#: the cache keyword `generate` does not know under this release (`cache` before 5.24, `past_key_values` after)
_OTHER_CACHE_KWARG = "past_key_values" if CACHE_KWARG == "cache" else "cache"


def generate_cache_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """`generate`'s keyword arguments with the cache under the name this release's `generate` knows.

    Before 5.24 `generate` does not know `cache=`: it would forward it to `forward` untouched and build its own
    default cache beside it. From 5.24 on, `generate` renames `past_key_values=` itself but warns that the name is
    deprecated. The native looped models take both names on every supported release (as their `forward` does), so
    the other name is renamed here, without a warning; both at once is an error.
    """
    if kwargs.get(_OTHER_CACHE_KWARG) is None:
        return kwargs
    kwargs = dict(kwargs)
    cache = kwargs.pop(_OTHER_CACHE_KWARG)
    kwargs[CACHE_KWARG] = cache_argument(cache, kwargs.get(CACHE_KWARG))
    return kwargs


def generate_cache(kwargs: dict[str, Any]) -> Any:
    """The cache a `generate` call was given, under either name."""
    return kwargs.get("cache") if kwargs.get("cache") is not None else kwargs.get("past_key_values")


def dispatch_mode_active() -> bool:
    """Whether a `TorchDispatchMode` is active (e.g. `benchmarks.memtrack.LiveBytes`): a tensor subclass such as
    torch's `CausalBias` cannot be built under one. torch keeps the mode stack behind a private function (present
    from torch 2.0 to 2.13)."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    return _get_current_dispatch_mode() is not None


#: whether the `generate` call running in this context may defer its stop check (`deferred_stop_check`)
_DEFER_STOP: contextvars.ContextVar[bool] = contextvars.ContextVar("hf_loopcache_defer_stop", default=False)
#: device types where it does (transformers' check records `torch.Event`s, which the CPU has not got)
_DEFER_DEVICES = frozenset({"cuda"})


def _defers_on_cuda(original: Callable[..., bool]) -> Callable[..., bool]:
    def is_supported(device: torch.device, cache: Any, cache_is_returned: bool, is_assistant: bool) -> bool:
        exact_crop = getattr(cache, "exact_crop", None)
        if _DEFER_STOP.get() and device.type in _DEFER_DEVICES and not is_assistant and exact_crop is not None:
            return not cache_is_returned or bool(exact_crop(1))
        return original(device, cache, cache_is_returned, is_assistant)

    is_supported.__wrapped__ = original  # type: ignore[attr-defined]
    return is_supported


_DEFERRED = getattr(_generation_utils, "DeferredStopCheck", None)
if _DEFERRED is not None and not hasattr(_DEFERRED.is_supported, "__wrapped__"):
    _DEFERRED.is_supported = staticmethod(_defers_on_cuda(_DEFERRED.is_supported))


@contextlib.contextmanager
def deferred_stop_check(enabled: bool) -> Iterator[None]:
    """Within the block, `generate` on CUDA with a looped-model cache reads its stop flag one step late (transformers'
    `DeferredStopCheck`): the host queues the next step before the GPU has finished this one, instead of waiting for
    it at every step. When a stop criterion other than the length fires, one extra step has run; transformers drops
    its token and crops the cache by one position, so this is used where that crop is exact (`LoopCache.exact_crop`)
    or the cache is not handed back. Caches that are not `LoopCache`s keep transformers' choice (`mps` only)."""
    token = _DEFER_STOP.set(bool(enabled) and _DEFERRED is not None)
    try:
        yield
    finally:
        _DEFER_STOP.reset(token)
