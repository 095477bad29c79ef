"""The state a cell's read depends on, passed down as an argument (never read back from the container).

`LoopCache.begin_forward` declares what a forward is (how many loops it runs); `LoopCache.attend` combines that with
the forward's `AttentionInputs` into one `ReadState` and hands it to the cell. The cell's read and write depend on
nothing else: not on the container, not on other cells (a shared cell reads its source's buffers, nothing more).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from collections.abc import Iterator

__all__ = ["ReadState", "VPrecisionStats", "effective_positions"]


class VPrecisionStats(Mapping[str, float]):
    """Counts of INT4 history value reads (`"history"`) and of those read cold (`"cold"`), per (row, query head,
    query, token), accumulated on the device without a sync; reading a count syncs once.

    A model split over devices (`device_map`) has cells on several devices: each device accumulates into its own
    counter (no transfer on the read path) and reading a count sums them."""

    def __init__(self) -> None:
        # int64 [cold, history], one per device read on, keyed by the device's name (a cache stays a pytree)
        self.device_counts: dict[str, torch.Tensor] = {}

    def tensor(self, device: torch.device | str) -> torch.Tensor:
        """The accumulator `coded_attention` adds to in place, on `device` (the reading cell's)."""
        name = str(torch.device(device))
        if name not in self.device_counts:
            self.device_counts[name] = torch.zeros(2, dtype=torch.int64, device=device)
        return self.device_counts[name]

    @property
    def counts(self) -> torch.Tensor | None:
        """`[cold, history]` summed over devices (on the CPU when several), or None before the first read."""
        if not self.device_counts:
            return None
        if len(self.device_counts) == 1:
            return next(iter(self.device_counts.values()))
        return sum(c.cpu() for c in self.device_counts.values())  # type: ignore[return-value]

    def __getitem__(self, key: str) -> float:
        index = {"cold": 0, "history": 1}[key]
        counts = self.counts
        return 0.0 if counts is None else float(counts[index])

    def __iter__(self) -> Iterator[str]:
        return iter(("cold", "history"))

    def __len__(self) -> int:
        return 2

    def __repr__(self) -> str:
        return f"VPrecisionStats(cold={self['cold']:.0f}, history={self['history']:.0f})"


@dataclass(frozen=True)
class ReadState:
    """What every cell read and write of one forward depends on.

    Args:
        key_valid (`torch.BoolTensor` of shape `[B, length + q]`, *optional*): True where the position holds a real
            token; None when every position is real.
        scaling (`float`): softmax scale.
        draft_loops (`int`, *optional*): the loop count of a partial-depth forward (a draft with fewer loops than the
            cache holds); None when the forward runs every loop. In a draft the final loop's cells are not written,
            so a shared cell keeps at full precision every position its source does not hold.
        v_precision_tau (`float`, *optional*): LoopKV's V-precision threshold for INT4 history; None reads every
            low plane.
        v_precision_blocks (`bool`): whether reads of more than one new token apply it too (`VPrecision.blocks`);
            False: they read every low plane. Cells take the threshold from `tau_for`.
        v_precision_stats (`VPrecisionStats`, *optional*): where cold / history read counts go.
        home (`ReadState`, *optional*): the same forward's state on the device the mask was built on, when this one
            is a copy for another device (a model split by `device_map`): `effective` is computed there once (one host
            sync per forward) and copied here.
        positions, static_valid, static_mask, length: a static cache's device-side write positions `[q]`, key
            validity `[B, max_cache_len]` and visibility `[B, 1, q, max_cache_len]`, and its host length before the
            forward (see `AttentionInputs`); None for a growable cache.
        source_length (`torch.LongTensor` of shape `[1]`, *optional*): a static cache's final-loop length on the
            device (a draft's shared cells read their sources up to it).

    Attributes:
        effective (`torch.LongTensor` of shape `[B, length + q + 1]` or None): per row, the position each stored
            position has once the row's holes are left out (`effective_positions(key_valid)`, computed on first use,
            so forwards that only touch dense cells never inspect the mask); None when no row has a hole. Column
            `length + q` is the position the next token will have.
    """

    key_valid: torch.Tensor | None
    scaling: float
    draft_loops: int | None = None
    v_precision_tau: float | None = None
    v_precision_blocks: bool = True
    v_precision_stats: VPrecisionStats | None = None
    home: ReadState | None = None
    positions: torch.Tensor | None = None
    static_valid: torch.Tensor | None = None
    static_mask: torch.Tensor | None = None
    length: int | None = None
    source_length: torch.Tensor | None = None
    memo: dict = field(default_factory=dict, compare=False, repr=False)  # per-forward values cells share (masks)

    @cached_property
    def effective(self) -> torch.Tensor | None:
        if self.home is not None and self.key_valid is not None:
            effective = self.home.effective
            return None if effective is None else effective.to(self.key_valid.device)
        return effective_positions(self.key_valid)

    def tau_for(self, query_length: int) -> float | None:
        """The V-precision threshold a read of `query_length` new tokens uses (None: both planes of every token)."""
        return self.v_precision_tau if query_length == 1 or self.v_precision_blocks else None

    @property
    def complete(self) -> bool:
        """The forward runs every loop (every cell, sources included, is written in it)."""
        return self.draft_loops is None


def effective_positions(key_valid: torch.Tensor | None) -> torch.Tensor | None:
    """Per row, the position of each stored position with the row's *holes* left out, or None without holes.

    A hole is a padded position after the row's first real token (a rejected draft token of one row in a batched
    verification, kept in storage because other rows accepted more); left padding is not a hole, so without holes
    positions are storage indices (the usual positional rule, left padding included). Column `T` (one past the
    mask) is the position the next token gets.

    Args:
        key_valid (`torch.BoolTensor` of shape `[B, T]`, *optional*).

    Returns:
        `torch.LongTensor` of shape `[B, T + 1]`, non-decreasing along positions, or None.
    """
    if key_valid is None:
        return None
    seen = key_valid.long().cummax(dim=1).values.bool()  # True from the row's first real token on
    holes = seen & ~key_valid
    if not bool(holes.any()):
        return None
    before = torch.nn.functional.pad(holes.long().cumsum(1), (1, 0))  # [B, T + 1]: holes before each position
    positions = torch.arange(key_valid.shape[1] + 1, device=key_valid.device)
    return positions[None] - before
