"""`hf-loopcache`: an lm-eval model (an `HFLM` subclass) that answers every request through a looped-model cache.

    lm_eval --model hf-loopcache --model_args pretrained=tiny-huginn,cache=ripe,window=64 --tasks ...
    hf-loopcache-eval --model hf-loopcache --model_args pretrained=DIR,cache=loopkv:kivi4-share --tasks ...

model_args (everything else goes to `HFLM` unchanged: `dtype`, `max_length`, `add_bos_token`, `tokenizer`, ...; a key
that is neither an HFLM argument nor a field of the model's config is refused):

| key                      | meaning                                                                                   |
|--------------------------|-------------------------------------------------------------------------------------------|
| `pretrained`             | a fixture name (`tiny-ouro`, `tiny-huginn`), a model folder, or a Hub id                   |
| `cache`                  | `hf_loopcache.build_cache` spec: `full` (default), `ripe`, `deepest`, `loopkv:<preset>`, a plan folder, a Hub id |
| `window`, `sink`, `tau`, `page_size`, `group_size`, `max_rollback`, `plan_revision` | the spec's options (`cache=ripe,window=64`; `v_precision_blocks`: True or left out, not False) |
| `num_loops`              | loops of every forward (Ouro `num_loops`, Huginn `num_steps`) and of the cache           |
| `draft_loops`, `block_size` | self-speculative decoding (`hf_loopcache.self_speculative`) for `generate_until`; `block_size` an int or `auto` (the default) |
| `max_block_size`         | with `block_size=auto` (each block at RIPE Eq. 8's best for the acceptance seen): the largest (default 4) |
| `max_gen_toks`           | new tokens for tasks that set none (default 1024; HFLM's 256 cuts GSM8K / MATH reasoning) |
| `allow_short_generation` | let GSM8K / MATH tasks generate fewer than 512 new tokens                               |

Every request gets a fresh cache. `generate_until` passes it to `generate` (batched, left padded). `loglikelihood`
prefills the context through the cache in one forward (as `generate` prefills a prompt), then feeds the continuation
in blocks the cache reads exactly as decoding would: one block for the full cache, blocks of at most `window + 1`
tokens for a windowed plan (RIPE Proposition 1: a block of `W + 1` tokens over a window of `W` equals decoding them one
at a time). Data-parallel runs (`accelerate launch -m lm_eval ...`) shard requests by the process rank on CPUs too.
"""

from __future__ import annotations

import atexit
import inspect
import os
from typing import Any

import torch
import torch.nn.functional as F
from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM
from lm_eval.models.utils import Collator, has_bos_prefix, normalize_gen_kwargs
from tqdm import tqdm

import hf_loopcache
from eval_tasks.guards import check_generation_length, configuration, configuration_slug, stamp_response_cache
from hf_loopcache import build_cache
from hf_loopcache._compat import CACHE_KWARG
from hf_loopcache.cache import CACHE_OPTIONS, cache_options
from hf_loopcache.fixtures import FIXTURES, fixture_path, tokenizer_folder

__all__ = ["LoopCacheLM"]

OWN_ARGS = (
    "cache",
    "num_loops",
    "draft_loops",
    "block_size",
    "max_block_size",
    "max_gen_toks",
    "allow_short_generation",
)
DEFAULT_MAX_GEN_TOKS = 1024
_HFLM_ARGS = frozenset(inspect.signature(HFLM.__init__).parameters) - {"self", "kwargs"}


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"model_args `{name}` must be a positive int, got {value!r}")
    return value


def _close_process_group() -> None:
    """Destroy the process group `accelerate` set up, before the interpreter exits: left to the C++ static destructors,
    gloo's threads were sometimes still joinable at exit on a CPU run and one rank aborted after the evaluation had
    finished ("terminate called without an active exception", exit -6)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


@register_model("hf-loopcache")
class LoopCacheLM(HFLM):
    """lm-eval model for hf_loopcache's native looped models; see the module docstring for its model_args."""

    def __init__(self, pretrained: Any, **kwargs: Any) -> None:
        received = {"pretrained": pretrained, **kwargs}
        self.cache_spec = kwargs.pop("cache", "full")
        num_loops = kwargs.pop("num_loops", None)  # the forwards' loop count, and the cache's where its spec takes it
        self.cache_options = {k: kwargs.pop(k) for k in CACHE_OPTIONS if k in kwargs}
        if self.cache_options.get("v_precision_blocks") is False:
            raise ValueError(
                "model_args `v_precision_blocks` must be True or None here (None, the default, reads V precision in "
                "blocks except self-speculative verification): loglikelihood scores continuations in blocks that "
                "must read what decoding reads, V precision per row included; "
                f"got {self.cache_options['v_precision_blocks']!r}"
            )
        draft_loops = kwargs.pop("draft_loops", None)
        block_size = kwargs.pop("block_size", None)
        max_block_size = kwargs.pop("max_block_size", None)
        self._default_max_gen_toks = _positive_int("max_gen_toks", kwargs.pop("max_gen_toks", DEFAULT_MAX_GEN_TOKS))
        self.allow_short_generation = bool(kwargs.pop("allow_short_generation", False))
        self.num_loops = None if num_loops is None else _positive_int("num_loops", num_loops)
        self.speculative: dict[str, Any] = {}
        if max_block_size is not None and block_size not in (None, "auto"):
            raise ValueError(
                f"model_args `max_block_size` needs `block_size=auto` (the default), got block_size={block_size!r}"
            )
        if max_block_size is not None and draft_loops is None and block_size is None:
            raise ValueError("model_args `max_block_size` is for self-speculative decoding: pass `draft_loops` too")
        if draft_loops is not None or block_size is not None:
            strategy = getattr(hf_loopcache, "self_speculative", None)
            if strategy is None:
                raise ValueError(
                    "model_args `draft_loops` / `block_size` need self-speculative decoding "
                    "(`hf_loopcache.self_speculative`), which this installation of hf_loopcache does not provide"
                )
            self.speculative = {"custom_generate": strategy}
            if draft_loops is not None:
                self.speculative["draft_loops"] = _positive_int("draft_loops", draft_loops)
            if block_size == "auto":
                self.speculative["block_size"] = "auto"
            elif block_size is not None:
                if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
                    raise ValueError(f"model_args `block_size` must be a positive int or auto, got {block_size!r}")
                self.speculative["block_size"] = block_size
            if max_block_size is not None:  # (with `auto`, or the default block size: `auto`)
                self.speculative["max_block_size"] = _positive_int("max_block_size", max_block_size)
        allowed = cache_options(self.cache_spec)  # checks the spec's grammar before any weights load
        if "num_loops" in allowed and self.num_loops is not None:
            self.cache_options.setdefault("num_loops", self.num_loops)
        if isinstance(pretrained, str) and pretrained in FIXTURES and not os.path.isdir(pretrained):
            pretrained = str(fixture_path(pretrained))
            kwargs.setdefault("tokenizer", str(tokenizer_folder(pretrained)))
            kwargs.setdefault("add_bos_token", True)  # the fixtures saw <|endoftext|> before every document (below)
        kwargs.setdefault("backend", "causal")  # HFLM cannot tell from transformers' tables (our model types)
        if isinstance(pretrained, str):
            self._check_extra_args(pretrained, kwargs)
        self._configuration = configuration(received)
        self._slug = configuration_slug(received)
        super().__init__(pretrained=pretrained, **kwargs)
        if not hasattr(self.model, "loop_layout"):
            raise TypeError(
                f"--model hf-loopcache evaluates hf_loopcache's native looped models (Ouro, Huginn); "
                f"{type(self.model).__name__} is not one (use --model hf for other models)"
            )
        self._prepend_bos = self._needs_manual_bos()
        self._resolve_hub_plan()
        probe = self.make_cache()  # refuses options the spec does not take, before any request
        self.score_block = None if probe.plan.is_full else probe.plan.window + 1
        accelerator = getattr(self, "accelerator", None)
        if accelerator is not None and accelerator.num_processes > 1:
            # HFLM 0.4.13 shards only when it sees more than one GPU; data parallelism on CPUs (or one GPU per host)
            # needs the rank and world size too
            self._rank = accelerator.process_index
            self._world_size = accelerator.num_processes
            atexit.register(_close_process_group)

    # ------------------------------------------------------------------------------------------------ set-up
    @staticmethod
    def _check_extra_args(pretrained: str, kwargs: dict[str, Any]) -> None:
        extra = sorted(set(kwargs) - _HFLM_ARGS)
        if not extra:
            return
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(pretrained, revision=kwargs.get("revision") or "main")
        unknown = [k for k in extra if not hasattr(config, k)]
        if unknown:
            raise ValueError(
                f"unknown model_args {unknown}: not an hf-loopcache argument ({', '.join(OWN_ARGS + CACHE_OPTIONS)}), "
                f"an HFLM argument, or a field of the model's config. Data locations (data_dir, ruler_dir, ...) go in "
                f"--metadata, not in model_args."
            )

    def _needs_manual_bos(self) -> bool:
        """`add_bos_token=True` only asks the tokenizer for its special tokens; the fixtures' tokenizer adds none, so
        the BOS token (`<|endoftext|>`, which the fixtures saw before every document) is prepended here."""
        bos = self.tokenizer.bos_token_id
        if not self.add_bos_token or bos is None:
            return False
        return self.tokenizer("a", add_special_tokens=True)["input_ids"][:1] != [bos]

    def tok_encode(self, string: str, add_special_tokens: Any = None, left_truncate_len: Any = None, **kwargs):
        ids = super().tok_encode(string, add_special_tokens=add_special_tokens, **kwargs)
        bos = self.tokenizer.bos_token_id
        if (
            self._prepend_bos
            and add_special_tokens is not False
            and ids[:1] != [bos]
            and not has_bos_prefix(string, self.tokenizer.bos_token)
        ):
            ids = [bos, *ids]
        return ids[-left_truncate_len:] if left_truncate_len else ids

    def tok_batch_encode(
        self, strings: list[str], padding_side: str = "left", left_truncate_len: Any = None, truncation: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self._prepend_bos:
            return super().tok_batch_encode(strings, padding_side, left_truncate_len, truncation)
        rows = [self.tok_encode(s, left_truncate_len=left_truncate_len) for s in strings]
        width = max(len(r) for r in rows)
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.eot_token_id
        ids = torch.full((len(rows), width), pad, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):
            span = slice(width - len(r), width) if padding_side == "left" else slice(0, len(r))
            ids[i, span], mask[i, span] = torch.tensor(r), 1
        return ids, mask

    def _resolve_hub_plan(self) -> None:
        """A Hub plan is downloaded once; every request then reads the local copy."""
        if "plan_revision" not in cache_options(self.cache_spec):
            return
        from huggingface_hub import hf_hub_download

        from hf_loopcache.cache.plan import PLAN_FILE

        revision = self.cache_options.pop("plan_revision", None)
        self.cache_spec = hf_hub_download(self.cache_spec, PLAN_FILE, revision=revision)

    def make_cache(self) -> Any:
        """A fresh cache of the configured spec (one per request batch)."""
        return build_cache(self.model, self.cache_spec, **self.cache_options)

    @property
    def forward_kwargs(self) -> dict[str, Any]:
        return {} if self.num_loops is None else {getattr(self.model, "loop_kwarg", "num_loops"): self.num_loops}

    @property
    def max_gen_toks(self) -> int:
        return self._default_max_gen_toks

    @property
    def max_length(self) -> int:
        if self._max_length:
            return self._max_length
        config = self.model.config
        for name in ("max_position_embeddings", "block_size"):  # Huginn states its context as `block_size`
            if getattr(config, name, None):
                return int(getattr(config, name))
        return super().max_length

    # ------------------------------------------------------------------------------------------------ guard rails
    def set_cache_hook(self, cache_hook: Any) -> None:
        dbdict = getattr(cache_hook, "dbdict", None)
        if dbdict is not None:
            stamp_response_cache(dbdict, self._configuration, str(getattr(dbdict, "filename", "")))
        super().set_cache_hook(cache_hook)

    def get_model_info(self) -> dict:
        if isinstance(self.pretrained, str) and os.path.isdir(self.pretrained):
            info = {
                "model_num_parameters": self._model.num_parameters(),
                "model_dtype": str(self._model.dtype),
                "model_revision": self.revision,
                "model_sha": "",
            }
        else:
            info = super().get_model_info()
        info["hf_loopcache"] = {
            "version": hf_loopcache.__version__,
            "configuration": self._configuration,
            "slug": self._slug,
            "cache": repr(self.make_cache()),
            "score_block": self.score_block,
        }
        return info

    # ------------------------------------------------------------------------------------------------ generation
    def generate_until(self, requests: list, disable_tqdm: bool = False) -> list[str]:
        for request in requests:
            budget = normalize_gen_kwargs(request.args[1], self.max_gen_toks)["max_gen_toks"]
            check_generation_length(request.task_name, budget, allow_short=self.allow_short_generation)
        return super().generate_until(requests, disable_tqdm=disable_tqdm)

    def _model_generate(self, context: torch.Tensor, max_length: int, stop: list[str], **generation_kwargs: Any):
        for key in ("past_key_values", "cache", "cache_implementation"):
            if key in generation_kwargs:
                raise ValueError(f"gen_kwargs `{key}` is not allowed: the cache is chosen by model_args `cache=`")
        generation_kwargs[CACHE_KWARG] = self.make_cache()
        generation_kwargs.update(self.forward_kwargs)
        generation_kwargs.update(self.speculative)
        return super()._model_generate(context, max_length, stop, **generation_kwargs)

    # ------------------------------------------------------------------------------------------------ scoring
    def _model_call(self, inps: torch.Tensor, attn_mask: Any = None, labels: Any = None) -> torch.Tensor:
        """One prefill through a fresh cache (used by `batch_size=auto` to probe memory)."""
        with torch.no_grad():
            return self.model(inps, use_cache=True, **{CACHE_KWARG: self.make_cache()}, **self.forward_kwargs).logits

    @torch.no_grad()
    def _score_batch(self, rows: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """(sum of log-probabilities, all greedy) of each continuation after its context, through one fresh cache:
        the left-padded contexts in one forward, then the continuations in blocks of `score_block` tokens."""
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.eot_token_id
        width = max(len(ctx) for ctx, _ in rows)
        ids = torch.full((len(rows), width), pad, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for r, (ctx, _) in enumerate(rows):
            ids[r, width - len(ctx) :] = torch.tensor(ctx)
            mask[r, width - len(ctx) :] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        cache = self.make_cache()
        kwargs = {CACHE_KWARG: cache, "use_cache": True, **self.forward_kwargs}
        logits = [self.model(input_ids=ids, attention_mask=mask, logits_to_keep=1, **kwargs).logits]
        # the continuations minus their last token, right padded (a pad only ever precedes its own row's pads)
        feed_len = max(len(cont) for _, cont in rows) - 1
        feed = torch.full((len(rows), max(feed_len, 0)), pad, dtype=torch.long, device=self.device)
        for r, (_, cont) in enumerate(rows):
            feed[r, : len(cont) - 1] = torch.tensor(cont[:-1], device=self.device)
        block = self.score_block or max(feed_len, 1)
        for start in range(0, feed_len, block):
            piece = feed[:, start : start + block]
            mask = torch.cat([mask, torch.ones_like(piece)], dim=1)
            logits.append(self.model(input_ids=piece, attention_mask=mask, **kwargs).logits)
        logprobs = F.log_softmax(torch.cat(logits, dim=1).float(), dim=-1)
        out = []
        for r, (_, cont) in enumerate(rows):
            lp = logprobs[r, : len(cont)]
            target = torch.tensor(cont, device=lp.device)
            out.append((float(lp.gather(-1, target[:, None]).sum()), bool((lp.argmax(-1) == target).all())))
        return out

    def _loglikelihood_tokens(self, requests: list, disable_tqdm: bool = False, override_bs: Any = None) -> list:
        collator = Collator(requests, sort_fn=lambda req: (-len(req[1] + req[2]), tuple(req[1] + req[2])))
        batch_size = self.batch_size if self.batch_size != "auto" else override_bs
        if batch_size in (None, "auto"):
            batch_size = self._detect_batch_size(collator.get_reordered()) if len(requests) else 1
        res = []
        pbar = tqdm(
            total=len(requests), disable=disable_tqdm or self.rank != 0, desc="Running loglikelihood (hf-loopcache)"
        )
        for chunk in collator.get_batched(n=int(batch_size)):
            rows = []
            for _, context_enc, continuation_enc in chunk:
                if not context_enc or not continuation_enc:
                    raise ValueError("loglikelihood requests need a non-empty context and continuation")
                if len(continuation_enc) > self.max_length:
                    raise ValueError(
                        f"a continuation of {len(continuation_enc)} tokens is longer than max_length {self.max_length}"
                    )
                full = (context_enc + continuation_enc)[-(self.max_length + 1) :]
                rows.append((full[: len(full) - len(continuation_enc)], continuation_enc))
            for (request_str, _, _), answer in zip(chunk, self._score_batch(rows)):
                res.append(answer)
                if request_str is not None:
                    self.cache_hook.add_partial("loglikelihood", request_str, answer)
                pbar.update(1)
        pbar.close()
        return collator.get_original(res)
