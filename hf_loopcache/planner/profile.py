"""One-time per-cell damage profile (LoopKV Sec. 3.1, "Profiling").

For every cell `c` and storage option `o`, the damage `d(c, o)` is the mean fp32 `KL(p_exact || p_{c <- o})` over the
replayed positions of the profiling documents, with only cell `c` stored as `o` and every other cell exact.

A shared cell reads its source *as coded*: LoopKV's Proposition 2 writes a shared cell's error as `Q(x_s) - x_c`, the
source's codes minus the cell's own exact keys and values, because a shared cell reads the final loop's codes, which
every plan stores in the final loop's option (`share_source`, INT4 as in the paper). The engine has no cell that reads
codes while its source reads exactly, so `d(c, share)` is measured as the damage sharing *adds* to the coded source:
`KL(c shares, source coded, rest exact) - KL(source coded, rest exact)` (the second term is the source's own
`d(s, share_source)`, which the profile measures anyway). To second order this is Proposition 2's `D_c` plus the
interaction of `c` with its source, which every plan that shares `c` also has (the source is always coded); a negative
increment (noise, or a negative interaction) is recorded as 0, since the knapsack needs non-negative damages.

The profile also measures `KL_share`, the whole-loop unit of the paper: the loop before the last reads the final
loop's *exact* keys and values in every layer (LoopKV footnote 4: "naively letting loop 3 reuse loop 4's BF16 KV").

Schema version 2 (this scoring of `share`); a version-1 profile, which scored `share` against the exact source, is
refused with an error rather than reused.

The profile is resumable: results are written to `out_path` after every cell and reused when the settings match (the
same documents, storage settings, dtype and weights: a fingerprint of the state dict is part of the settings).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from hf_loopcache.cache import CachePlan, LoopCache
from hf_loopcache.fidelity import kl_per_position, reference_logits, replay_logits
from hf_loopcache.layout import Cell, LoopLayout

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

__all__ = ["PROFILE_SCHEMA_VERSION", "CellProfile", "max_positions", "profile_cells"]

PROFILE_SCHEMA_VERSION = 2
CODED = ("int4", "int2")
SHARE_SOURCES = ("int4", "int2", "bf16")


@dataclass
class CellProfile:
    """Measured damage of every (cell, option), plus the `KL_share` reference and the settings it was measured with."""

    layout: LoopLayout
    damage: dict[Cell, dict[str, float]]
    kl_share: float | None = None
    settings: dict[str, Any] = field(default_factory=dict)

    def options_of(self, cell: Cell) -> dict[str, float]:
        return {"bf16": 0.0, **self.damage.get(cell, {})}

    def is_complete(self, options: Sequence[str]) -> bool:
        return all(
            set(_options_for(self.layout, c, options)) <= set(self.damage.get(c, {})) for c in self.layout.cells()
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema_version": PROFILE_SCHEMA_VERSION,
            "layout": self.layout.to_dict(),
            "kl_share": self.kl_share,
            "settings": self.settings,
            "damage": {str(c): d for c, d in self.damage.items()},
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CellProfile:
        if not isinstance(data, dict) or "damage" not in data or "layout" not in data:
            what = "a cache plan (loopcache_plan.json)" if isinstance(data, dict) and "cells" in data else "not one"
            raise ValueError(
                f"a cell profile (written by `profile_cells` / `hf-loopcache profile`) holds `layout` and `damage`; "
                f"this is {what}"
            )
        version = data.get("schema_version")
        if version != PROFILE_SCHEMA_VERSION:
            hint = (
                " (version 1 scored a shared cell against the exact source; version 2 scores it against the source as "
                "coded, LoopKV Proposition 2): profile again with this version"
                if version == 1
                else ""
            )
            raise ValueError(f"profile `schema_version` must be {PROFILE_SCHEMA_VERSION}, got {version!r}{hint}")
        return cls(
            LoopLayout.from_dict(data["layout"]),
            {Cell.parse(k): dict(v) for k, v in data["damage"].items()},
            data.get("kl_share"),
            dict(data.get("settings", {})),
        )

    def save(self, path: str | os.PathLike) -> None:
        tmp = f"{os.fspath(path)}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(self.to_dict(), f, indent=1)
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str | os.PathLike) -> CellProfile:
        """Read a profile JSON file. Raises `FileNotFoundError`, or `ValueError` for a file that is not a profile."""
        with open(path, encoding="utf-8") as f:
            try:
                data = json.load(f)
            except json.JSONDecodeError as err:
                raise ValueError(f"{os.fspath(path)!r} is not JSON ({err}), so not a cell profile") from None
        try:
            return cls.from_dict(data)
        except ValueError as err:
            raise ValueError(f"{os.fspath(path)!r}: {err}") from None


def max_positions(config: Any) -> int | None:
    """The longest context a model config says it was trained for (`max_position_embeddings`, Huginn's
    `block_size`), or None if it names none."""
    for name in ("max_position_embeddings", "block_size"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def _options_for(layout: LoopLayout, cell: Cell, options: Sequence[str]) -> list[str]:
    """Sharing only exists for core cells before the final loop."""
    can_share = cell.stage == "core" and cell.loop < layout.final_loop
    return [o for o in options if o != "bf16" and (o != "share" or can_share)]


def _documents_hash(documents: Sequence[torch.Tensor]) -> str:
    h = hashlib.sha256()
    for d in documents:
        h.update(d.cpu().to(torch.int64).numpy().tobytes())
        h.update(b"|")
    return h.hexdigest()[:16]


def _weights_hash(model: Any) -> str:
    """Fingerprint of the model's weights: a profile resumes only on the weights it measured (a retrained model of
    the same name and layout must not reuse another's damages)."""
    h = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def profile_cells(
    model: Any,
    documents: Sequence[torch.Tensor],
    *,
    options: Sequence[str] = ("int4", "int2", "share"),
    sink: int = 32,
    window: int = 256,
    page_size: int = 32,
    group_size: int = 32,
    share_source: str = "int4",
    prefix: int | float = 0.5,
    out_path: str | os.PathLike | None = None,
    progress: bool = True,
    log: Callable[[str], None] = print,
    source: dict[str, Any] | None = None,
    **forward_kwargs: Any,
) -> CellProfile:
    """Measure `d(c, o)` for every cell and option on `documents` (token id tensors `[T]`).

    Args:
        model: a native looped model; profile in fp32 (bf16 rounding alone produces KL comparable to the effects).
        documents: the profiling token sequences; each is prefilled up to `prefix` and replayed after it.
        options: options to measure, from `("int4", "int2", "share")`.
        sink, window, page_size, group_size: the storage the plans will use (LoopKV: 32, 256, 32, 32).
        share_source: option the final loop's cells (the sharing sources) are stored in when a cell's `share` is
            scored, one of `("int4", "int2", "bf16")`; plan with the same `final_option` (LoopKV: INT4).
        prefix: prefilled tokens per document (a float in (0, 1) is a fraction of its length).
        out_path: JSON file to write after every cell and to resume from.
        progress: show a progress bar (tqdm) and print the cost estimate.
        source: provenance stored in the profile's settings (model id, revision, where the documents came from).
        forward_kwargs: passed to every forward (Huginn: `num_steps=..., init_scale=0.0`).
    """
    bad = [o for o in options if o not in ("int4", "int2", "share")]
    if bad:
        raise ValueError(f"`options` must be drawn from ('int4', 'int2', 'share'), got {bad}")
    if share_source not in SHARE_SOURCES:
        raise ValueError(f"`share_source` must be one of {SHARE_SOURCES}, got {share_source!r}")
    if not documents:
        raise ValueError("`documents` must hold at least one token sequence")
    layout: LoopLayout = model.loop_layout
    docs = [d.reshape(-1) for d in documents]
    positions = max_positions(model.config)
    longest = max(int(d.numel()) for d in docs)
    if positions is not None and longest > positions:
        raise ValueError(
            f"`documents` must be at most the model's {positions} positions long (its trained context), got a "
            f"document of {longest} tokens"
        )
    settings = {
        "sink": sink,
        "window": window,
        "page_size": page_size,
        "group_size": group_size,
        "share_source": share_source,
        "prefix": prefix,
        "documents": len(docs),
        "tokens": [int(d.numel()) for d in docs],
        "documents_sha256_16": _documents_hash(docs),
        "weights_sha256_16": _weights_hash(model),
        "dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
        "forward_kwargs": _jsonable(forward_kwargs),
        "source": source or {},
    }
    profile = CellProfile(layout, {}, None, settings)
    if out_path is not None and os.path.exists(out_path):
        previous = CellProfile.load(out_path)
        same = {k: v for k, v in previous.settings.items() if k != "elapsed_s"} == {
            k: v for k, v in settings.items() if k != "elapsed_s"
        }
        if previous.layout == layout and same:
            profile = previous
            log(f"resuming from {out_path}: {sum(map(len, previous.damage.values()))} measurements already done")
        else:
            raise ValueError(
                f"{out_path} holds a profile with other settings or another layout; remove it or pick another path"
            )

    device = next(model.parameters()).device
    refs = reference_logits(model, docs, **forward_kwargs)
    cuts = [int(prefix * d.numel()) if isinstance(prefix, float) else prefix for d in docs]

    def arm_damage(plan: CachePlan) -> float:
        total, count = 0.0, 0
        for doc, ref, cut in zip(docs, refs, cuts):
            cache = LoopCache(model, plan)
            logits = replay_logits(model, doc[None].to(device), cache, prefix=cut, block=window + 1, **forward_kwargs)[
                0
            ]
            kl = kl_per_position(ref[cut:], logits)
            total += float(kl.double().sum())
            count += kl.numel()
        return total / count

    def single(cell: Cell, option: str) -> CachePlan:
        """Only `cell` stored as `option`; a shared cell's source coded as `share_source` (what the cell reads)."""
        source = layout.source_cell(cell) if option == "share" else None
        return CachePlan.from_rule(
            layout,
            lambda c: option if c == cell else (share_source if c == source else "bf16"),
            sink=sink,
            window=window,
            page_size=page_size,
            group_size=group_size,
        )

    todo = [
        (c, o) for c in layout.cells() for o in _options_for(layout, c, options) if o not in profile.damage.get(c, {})
    ]
    need_share_ref = profile.kl_share is None and layout.num_loops >= 2
    arms = len(todo) + int(need_share_ref)
    if progress and arms:  # cost estimate before starting: time one replay of the first document
        tick = time.perf_counter()
        with torch.no_grad():
            replay_logits(
                model, docs[0][None].to(device), LoopCache(model), prefix=cuts[0], block=window + 1, **forward_kwargs
            )
        per = time.perf_counter() - tick
        log(
            f"profiling {arms} arms (cell x option) x {len(docs)} documents on {device}: about "
            f"{per * arms * len(docs) / 60:.1f} min ({per:.2f} s per arm and document)"
        )
    start = time.perf_counter()
    bar = _progress(arms, enabled=progress)
    if need_share_ref:
        share_loop = layout.final_loop - 1
        plan = CachePlan.from_rule(
            layout,
            lambda c: "share" if c.stage == "core" and c.loop == share_loop else "bf16",
            sink=sink,
            window=window,
            page_size=page_size,
            group_size=group_size,
        )
        profile.kl_share = arm_damage(plan)
        bar.update(1)

    def source_damage(source: Cell) -> float:
        """`d(source, share_source)`: the baseline a share arm's KL is measured against (measured once, kept)."""
        if share_source == "bf16":
            return 0.0
        if share_source not in profile.damage.get(source, {}):
            profile.damage.setdefault(source, {})[share_source] = arm_damage(single(source, share_source))
        return profile.damage[source][share_source]
    for i, (cell, option) in enumerate(todo):
        if option not in profile.damage.get(cell, {}):  # a source's coded damage may already be measured
            damage = arm_damage(single(cell, option))
            if option == "share":
                base = source_damage(layout.source_cell(cell))
                if damage < base:
                    log(f"{cell} share: KL {damage:.3e} is below its coded source's alone ({base:.3e}); recorded as 0")
                damage = max(0.0, damage - base)
            profile.damage.setdefault(cell, {})[option] = damage
        bar.update(1)
        last_of_cell = i + 1 == len(todo) or todo[i + 1][0] != cell
        if out_path is not None and last_of_cell:
            profile.settings["elapsed_s"] = round(
                profile.settings.get("elapsed_s", 0.0) + time.perf_counter() - start, 1
            )
            start = time.perf_counter()
            profile.save(out_path)
    bar.close()
    if out_path is not None:
        profile.save(out_path)
    return profile


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, torch.Tensor):
        return value.tolist()
    return value


class _NoBar:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


def _progress(total: int, enabled: bool) -> Any:
    if not enabled or total == 0:
        return _NoBar()
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="profile", unit="arm")
