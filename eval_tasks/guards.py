"""Guard rails of the lm-eval door (no lm_eval or torch import here; the launcher and the model share them).

1. lm-eval's response cache (`--use_cache PATH`) keys answers on the request alone, not on the model arguments, so one
   database shared by two cache configurations silently replays the first one's answers for the second. The launcher
   gives every configuration its own database (`PATH_<slug>`), and the model stamps its configuration into the
   database and refuses one stamped by another configuration (or holding answers of unknown origin).
2. `--output_path DIR` writes `DIR/<model name>/results_<time>.json` for every configuration of one checkpoint, told
   apart only by the time stamp; the launcher writes to `DIR/<slug>/` instead.
3. Reasoning tasks (GSM8K, MATH) must not be cut by the generation length: the model refuses to generate fewer than
   `MIN_REASONING_TOKENS` new tokens for them unless `allow_short_generation=True`.

The configuration is the model_args (`pretrained`, `cache` and its options, loop counts, dtype, ...), without the keys
that do not change answers (`batch_size`, `max_batch_size`, `device`).
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

__all__ = [
    "MIN_REASONING_TOKENS",
    "RESPONSE_CACHE_STAMP",
    "check_generation_length",
    "configuration",
    "configuration_slug",
    "is_reasoning_task",
    "stamp_response_cache",
]

MIN_REASONING_TOKENS = 512
"""Fewest new tokens a GSM8K / MATH answer may be given (lm-eval's default, 256, cuts long chains of thought)."""

RESPONSE_CACHE_STAMP = "__hf_loopcache_configuration__"
NOT_CONFIGURATION = ("batch_size", "max_batch_size", "device")
_REASONING = re.compile(r"gsm8k|math", re.IGNORECASE)


def configuration(model_args: dict[str, Any] | None) -> dict[str, Any]:
    """The answer-determining model arguments, normalised (`cache` defaults to `full`), as a JSON-able dict."""
    out = {k: v for k, v in (model_args or {}).items() if k not in NOT_CONFIGURATION}
    out.setdefault("cache", "full")
    return json.loads(json.dumps(out, sort_keys=True, default=str))


def _clean(text: Any) -> str:
    return re.sub(r"[^A-Za-z0-9._=+-]+", "-", str(text)).strip("-")[:48] or "x"


def configuration_slug(model_args: dict[str, Any] | None) -> str:
    """A folder-safe name for one configuration: `<model>__<cache>[__key=value...]__<hash8>`, e.g.
    `tiny-ouro__ripe__window=64__1c9e02aa`. The hash covers every answer-determining argument."""
    config = configuration(model_args)
    digest = hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:8]
    pretrained = str(config.get("pretrained", "model")).rstrip("/\\")
    parts = [_clean(re.split(r"[/\\]", pretrained)[-1]), _clean(str(config["cache"]).rstrip("/\\").split("/")[-1])]
    parts += [_clean(f"{k}={v}") for k, v in sorted(config.items()) if k not in ("pretrained", "cache")]
    return "__".join([*parts, digest])


def is_reasoning_task(task_name: str | None) -> bool:
    """GSM8K and MATH tasks (any variant whose name says so), whose chains of thought must not be cut."""
    return bool(task_name) and bool(_REASONING.search(str(task_name)))


def check_generation_length(task_name: str | None, max_gen_toks: int, *, allow_short: bool = False) -> None:
    """Raise ValueError when a reasoning task would be cut at fewer than `MIN_REASONING_TOKENS` new tokens."""
    if allow_short or not is_reasoning_task(task_name) or max_gen_toks >= MIN_REASONING_TOKENS:
        return
    raise ValueError(
        f"task {task_name!r} generates at most {max_gen_toks} new tokens, fewer than {MIN_REASONING_TOKENS}: GSM8K / "
        f"MATH chains of thought would be cut. Raise it (`--gen_kwargs max_gen_toks=1024`, or model_args "
        f"`max_gen_toks=1024` for tasks that set none) or pass `allow_short_generation=True` in model_args."
    )


def stamp_response_cache(dbdict: Any, model_args: dict[str, Any] | None, path: str = "") -> None:
    """Stamp an lm-eval response-cache database with this configuration, or refuse it when it holds another
    configuration's answers (or answers without a stamp: their configuration is unknown)."""
    mine = configuration(model_args)
    if RESPONSE_CACHE_STAMP in dbdict:
        theirs = dbdict[RESPONSE_CACHE_STAMP]
        if theirs != mine:
            raise ValueError(
                f"the lm-eval response cache {path!r} holds the answers of another configuration ({theirs}); this run "
                f"is {mine}. Replaying them would report that configuration's answers as this one's: give every "
                f"configuration its own --use_cache path (hf-loopcache-eval does so by itself)."
            )
        return
    if len(dbdict):
        raise ValueError(
            f"the lm-eval response cache {path!r} holds {len(dbdict)} answers of an unknown configuration (no "
            f"{RESPONSE_CACHE_STAMP} stamp); this run is {mine}. Use a new --use_cache path for it."
        )
    dbdict[RESPONSE_CACHE_STAMP] = mine
    if hasattr(dbdict, "commit"):
        dbdict.commit()
