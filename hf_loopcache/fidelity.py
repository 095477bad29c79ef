"""Teacher-forced replay: how far a cache's outputs drift from the exact model's, per position.

For each document, the reference logits come from one forward over the whole document without a cache (what a full
cache gives, exactly). The arm prefills the first `prefix` tokens into a fresh cache (prefill computes every loop's
own keys and values), then feeds the remaining tokens as "decoded" positions in blocks of `block` tokens. For a
windowed plan with `block <= window + 1` the block pass equals token-by-token decoding (the engine's reading rule
depends only on query and key positions), so the replay is exact and fast. At every decoded position we record
`KL(p_full || p_cache)` in fp32 and whether the top-1 tokens agree; the *tail* is the positions with KL > 0.1
(RIPE paper, Table 4; LoopKV Sec. 2.3).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from hf_loopcache.cache import CachePlan, LoopCache

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Sequence

__all__ = [
    "FidelityReport",
    "default_block",
    "kl_per_position",
    "measure_fidelity",
    "reference_logits",
    "replay_logits",
]

TAIL_THRESHOLD = 0.1


@dataclass
class FidelityReport:
    """Per-position KL and top-1 agreement of one cache against the exact model, over several documents."""

    kl: torch.Tensor  # [positions] fp32, all documents concatenated
    top1_agree: torch.Tensor  # [positions] bool
    per_document: list[dict[str, float]] = field(default_factory=list)
    settings: dict[str, Any] = field(default_factory=dict)

    @property
    def positions(self) -> int:
        return int(self.kl.numel())

    @property
    def mean_kl(self) -> float:
        return float(self.kl.double().mean()) if self.positions else math.nan

    @property
    def max_kl(self) -> float:
        return float(self.kl.max()) if self.positions else math.nan

    @property
    def tail(self) -> int:
        """Positions with KL > 0.1."""
        return int((self.kl > TAIL_THRESHOLD).sum())

    @property
    def top1_agreement(self) -> float:
        return float(self.top1_agree.float().mean()) if self.positions else math.nan

    def quantile(self, q: float) -> float:
        return float(torch.quantile(self.kl.double(), q)) if self.positions else math.nan

    def to_dict(self) -> dict[str, Any]:
        return {
            "positions": self.positions,
            "mean_kl": self.mean_kl,
            "median_kl": self.quantile(0.5),
            "p99_kl": self.quantile(0.99),
            "max_kl": self.max_kl,
            "tail_kl_gt_0.1": self.tail,
            "top1_agreement": self.top1_agreement,
            "flips": int((~self.top1_agree).sum()),
            "per_document": self.per_document,
            "settings": self.settings,
        }


def kl_per_position(reference_logits: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """`KL(softmax(reference) || softmax(logits))` per position, computed in fp32. Shapes `[..., vocab]` -> `[...]`."""
    ref = F.log_softmax(reference_logits.float(), dim=-1)
    arm = F.log_softmax(logits.float(), dim=-1)
    return (ref.exp() * (ref - arm)).sum(-1).clamp(min=0.0)


def default_block(cache: LoopCache) -> int:
    """Largest block that replays exactly like token-by-token decoding: `window + 1` (1 for a window of 0); any
    block is exact for the full cache."""
    return 128 if cache.plan.is_full else cache.plan.window + 1


def replay_logits(
    model: Any,
    input_ids: torch.Tensor,
    cache: LoopCache,
    *,
    prefix: int,
    block: int | None = None,
    **forward_kwargs: Any,
) -> torch.Tensor:
    """Logits at positions `prefix..T-1` of `input_ids` `[B, T]` when positions `>= prefix` are fed through `cache`
    in blocks (teacher forcing). Returns `[B, T - prefix, vocab]`."""
    length = input_ids.shape[1]
    if not 0 < prefix < length:
        raise ValueError(f"`prefix` must be in [1, {length - 1}] for a document of {length} tokens, got {prefix}")
    block = default_block(cache) if block is None else block
    if block < 1:
        raise ValueError(f"`block` must be a positive int, got {block}")
    with torch.no_grad():
        model(input_ids[:, :prefix], cache=cache, use_cache=True, **forward_kwargs)
        outs = []
        for start in range(prefix, length, block):
            chunk = input_ids[:, start : start + block]
            outs.append(model(chunk, cache=cache, use_cache=True, **forward_kwargs).logits)
    return torch.cat(outs, dim=1)


def measure_fidelity(
    model: Any,
    documents: Iterable[torch.Tensor] | torch.Tensor,
    cache_factory: Callable[[Any], LoopCache] | CachePlan,
    *,
    prefix: int | float = 0.5,
    block: int | None = None,
    reference: Sequence[torch.Tensor] | None = None,
    **forward_kwargs: Any,
) -> FidelityReport:
    """Replay `documents` through a cache and compare with the exact model.

    Args:
        model: a native looped model (run it in fp32 for measurements: bf16 rounding alone shows up as KL).
        documents: token id tensors `[T]` or `[1, T]` (or a `[N, T]` batch, one document per row).
        cache_factory: a `CachePlan`, or a function `model -> LoopCache` (e.g. `lambda m: RIPECache(m, window=64)`).
        prefix: tokens prefilled before replay; a float in (0, 1) is a fraction of each document's length.
        block: tokens per replay forward; defaults to the exact `window + 1`.
        reference: precomputed full-model logits per document (`[T, vocab]`), to share across several arms.
        forward_kwargs: passed to every forward (e.g. `num_steps=16, init_scale=0.0` for Huginn).
    """
    if isinstance(cache_factory, CachePlan):
        plan = cache_factory

        def cache_factory(m: Any) -> LoopCache:
            return LoopCache(m, plan)

    docs = [
        d.reshape(1, -1)
        for d in (documents if not isinstance(documents, torch.Tensor) or documents.dim() > 1 else [documents])
    ]
    kls, agree, per_doc = [], [], []
    device = next(model.parameters()).device
    for i, doc in enumerate(docs):
        doc = doc.to(device)
        cut = int(prefix * doc.shape[1]) if isinstance(prefix, float) else prefix
        with torch.no_grad():
            ref = reference[i] if reference is not None else model(doc, use_cache=False, **forward_kwargs).logits[0]
        cache = cache_factory(model)
        logits = replay_logits(model, doc, cache, prefix=cut, block=block, **forward_kwargs)[0]
        kl = kl_per_position(ref[cut:].to(logits.device), logits)
        same = ref[cut:].argmax(-1).to(logits.device) == logits.argmax(-1)
        kls.append(kl.cpu())
        agree.append(same.cpu())
        per_doc.append({"positions": int(kl.numel()), "mean_kl": float(kl.double().mean()), "max_kl": float(kl.max())})
    report = FidelityReport(torch.cat(kls), torch.cat(agree), per_doc)
    report.settings = {"prefix": prefix, "block": block, "documents": len(docs)}
    return report


def reference_logits(model: Any, documents: Iterable[torch.Tensor], **forward_kwargs: Any) -> list[torch.Tensor]:
    """Full-model logits `[T, vocab]` per document (to pass as `reference=` when comparing several arms)."""
    device = next(model.parameters()).device
    with torch.no_grad():
        return [model(d.reshape(1, -1).to(device), use_cache=False, **forward_kwargs).logits[0] for d in documents]
