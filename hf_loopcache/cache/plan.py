"""`CachePlan`: a per-cell storage plan over time, as data.

A plan names, for every cell of a `LoopLayout`, how positions that left the full-precision recent window are stored:

| option | history storage                                           | stored / read per history token (16 heads x 128) |
|--------|-----------------------------------------------------------|-----------------------------------------------|
| `bf16` | own keys and values at full precision (every position)    | 8 / 8 KiB                                     |
| `int4` | own KIVI codes, 4 bits (values as two 2-bit planes)       | 2.5 / 2.5 KiB                                 |
| `int2` | own KIVI codes, 2 bits                                    | 1.5 / 1.5 KiB                                 |
| `share`| nothing: reads the final loop's cell of the same layer    | 0 / the source's                              |

plus the sink (`sink` first positions) and the recent window (`window` last positions) at full precision, and the
page size in which positions leave the window. Plans serialise to JSON (`save_pretrained` / `from_pretrained` /
`push_to_hub`, schema in `docs` of `to_dict`).
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from hf_loopcache.layout import Cell, LoopLayout, equal_assignment_allowed
from triton_ops.quant import kivi_bytes_per_token

if TYPE_CHECKING:
    from collections.abc import Mapping

__all__ = ["LOOPKV_PRESETS", "OPTIONS", "PLAN_FILE", "SCHEMA_VERSION", "CachePlan", "loopkv_preset", "window_boundary"]

OPTIONS = ("bf16", "int4", "int2", "share")
PLAN_FILE = "loopcache_plan.json"
SCHEMA_VERSION = 1


def window_boundary(position: int, *, sink: int, window: int, page_size: int) -> int:
    """`H(t) = S + P * floor(max(0, t - S - W) / P)`: positions `[S, H(t))` are history for the query at `t` (and
    `H(length - rollback)` is where a cell's full-precision window starts)."""
    return sink + page_size * (max(0, position - sink - window) // page_size)


@equal_assignment_allowed
@dataclass(frozen=True)
class CachePlan:
    """A storage option per cell, plus sink, window and page sizes.

    Args:
        layout (`LoopLayout`): the model's cells; `layout.num_loops` is the loop count the plan is for.
        options (`Mapping[Cell, str]`): history option of every cell, one of `OPTIONS`. Only core cells of loops
            before the final one may `share`.
        sink (`int`, *optional*, defaults to 0): first positions kept at full precision.
        window (`int`, *optional*, defaults to 0): recent positions every query reads at full precision.
        page_size (`int`, *optional*, defaults to 1): positions leave the window in pages of this size; for coded
            cells it is also the token group of the per-channel key codes.
        group_size (`int`, *optional*, defaults to 32): channel group of the per-token value codes.
        metadata (`dict`, *optional*): free-form provenance (model id, revision, budgets, predicted damage, profile).
    """

    layout: LoopLayout
    options: Mapping[Cell, str]
    sink: int = 0
    window: int = 0
    page_size: int = 1
    group_size: int = 32
    metadata: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("sink", "window"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"`{name}` must be a non-negative int, got {value!r}")
        for name in ("page_size", "group_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"`{name}` must be a positive int, got {value!r}")
        cells = set(self.layout.cells())
        given = set(self.options)
        if given != cells:
            missing, extra = sorted(cells - given), sorted(given - cells)
            raise ValueError(
                f"`options` must name every cell of the layout exactly once; missing {[str(c) for c in missing][:8]}"
                f"{'...' if len(missing) > 8 else ''}, unknown {[str(c) for c in extra][:8]}"
            )
        final = self.layout.final_loop
        for cell, option in self.options.items():
            if option not in OPTIONS:
                raise ValueError(f"option of cell {cell} must be one of {OPTIONS}, got {option!r}")
            if option == "share" and (cell.stage != "core" or cell.loop == final):
                raise ValueError(
                    f"cell {cell} cannot `share`: only core cells of loops 0..{final - 1} can read the final loop's "
                    f"cell (loop {final}) of their layer"
                )
            if option in ("int4", "int2") and self.layout.head_dim % self.group_size:
                raise ValueError(
                    f"`group_size` ({self.group_size}) must divide head_dim ({self.layout.head_dim}) for coded cells"
                )
        object.__setattr__(self, "options", {c: self.options[c] for c in self.layout.cells()})

    # ------------------------------------------------------------------------------ presets
    @classmethod
    def uniform(cls, layout: LoopLayout, option: str = "bf16", **kwargs: Any) -> CachePlan:
        """Every cell `option` (core cells of the final loop keep `int4` when `option == "share"`)."""
        return cls.from_rule(layout, lambda cell: option, **kwargs)

    @classmethod
    def from_rule(cls, layout: LoopLayout, rule: Any, **kwargs: Any) -> CachePlan:
        """Build from `rule(cell) -> option`."""
        return cls(layout, {cell: rule(cell) for cell in layout.cells()}, **kwargs)

    @classmethod
    def full(cls, layout: LoopLayout) -> CachePlan:
        """Every cell stores every position at full precision."""
        return cls.uniform(layout, "bf16", metadata={"preset": "full"})

    @classmethod
    def ripe(cls, layout: LoopLayout, window: int, sink: int = 0) -> CachePlan:
        """RIPE(W): core cells of loops < R share the deepest plane outside the last `window` positions."""
        final = layout.final_loop

        def rule(cell: Cell) -> str:
            return "share" if cell.stage == "core" and cell.loop < final else "bf16"

        return cls.from_rule(
            layout, rule, sink=sink, window=window, page_size=1, metadata={"preset": f"ripe-w{window}"}
        )

    # ------------------------------------------------------------------------------ queries
    @property
    def is_full(self) -> bool:
        return all(o == "bf16" for o in self.options.values())

    def option(self, cell: Cell) -> str:
        return self.options[cell]

    def counts(self) -> dict[str, int]:
        out = dict.fromkeys(OPTIONS, 0)
        for option in self.options.values():
            out[option] += 1
        return out

    def coded_bytes_per_token(self, nbits: int) -> int:
        """Stored (= read) bytes of one history token of one coded cell: codes plus fp16 scales and zeros (keys per
        channel per page, values per token per channel group); LoopKV Appendix C, `triton_ops.quant`'s byte model."""
        return int(
            kivi_bytes_per_token(
                self.layout.num_kv_heads,
                self.layout.head_dim,
                nbits,
                group_size=self.group_size,
                page_size=self.page_size,
            )
        )

    def own_bytes_per_token(self, cell: Cell) -> int:
        """Stored bytes of one history token of `cell`."""
        option = self.options[cell]
        if option == "bf16":
            return self.layout.bytes_per_cell_token
        if option == "share":
            return 0
        return self.coded_bytes_per_token(4 if option == "int4" else 2)

    def read_bytes_per_token(self, cell: Cell) -> int:
        """Bytes read for one history token when `cell` attends (a shared cell reads its source)."""
        if self.options[cell] == "share":
            return self.own_bytes_per_token(self.layout.source_cell(cell))
        return self.own_bytes_per_token(cell)

    def bytes_per_token(self) -> tuple[int, int]:
        """(stored, read) bytes per history token over all cells: LoopKV's "KiB per token" (all loops)."""
        cells = self.layout.cells()
        return sum(self.own_bytes_per_token(c) for c in cells), sum(self.read_bytes_per_token(c) for c in cells)

    def keep_boundary(self, length: int, rollback: int = 0) -> int:
        """First position kept at full precision in the recent window of a windowed cell at `length` positions."""
        return window_boundary(length - rollback, sink=self.sink, window=self.window, page_size=self.page_size)

    def expected_stored_bytes(self, length: int, rollback: int = 0) -> int:
        """Bytes a cache following this plan stores (live, excluding allocator slack) at `length` positions: a windowed
        cell holds its sink and `[H(length - rollback), length)` at full precision and, if coded, the pages
        `[S, H(length))` as codes (the rollback reserve is held both ways)."""
        b = self.layout.bytes_per_cell_token
        keep = max(self.sink, self.keep_boundary(length, rollback))
        coded_end = max(self.sink, self.keep_boundary(length))
        total = 0
        for cell, option in self.options.items():
            if option == "bf16":
                total += b * length
                continue
            full_precision = min(self.sink, length) + max(0, length - keep)
            coded = max(0, min(coded_end, length) - self.sink)
            total += b * full_precision + self.own_bytes_per_token(cell) * coded
        return total

    def summary(self) -> str:
        stored, read = self.bytes_per_token()
        counts = ", ".join(f"{k} {v}" for k, v in self.counts().items() if v)
        return (
            f"{counts}; sink {self.sink}, window {self.window}, page {self.page_size}; "
            f"{stored / 1024:.1f} KiB stored / {read / 1024:.1f} KiB read per history token at "
            f"{self.layout.bytes_per_element} B per full-precision element"
        )

    # ------------------------------------------------------------------------------ serialisation
    def to_dict(self) -> dict[str, Any]:
        """JSON-able form (schema version 1):

        `{"schema_version": 1, "layout": {LoopLayout fields}, "sink", "window", "page_size", "group_size",
        "cells": {"loop0.layer0": "int4", "prelude.layer0": "bf16", ...}, "bytes_per_token": {"stored", "read"},
        "metadata": {...}}`; `bytes_per_token` is derived and only informative.
        """
        stored, read = self.bytes_per_token()
        return {
            "schema_version": SCHEMA_VERSION,
            "layout": self.layout.to_dict(),
            "sink": self.sink,
            "window": self.window,
            "page_size": self.page_size,
            "group_size": self.group_size,
            "cells": {str(cell): option for cell, option in self.options.items()},
            "bytes_per_token": {"stored": stored, "read": read},
            "metadata": self.metadata,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> CachePlan:
        version = data.get("schema_version")
        if version != SCHEMA_VERSION:
            raise ValueError(f"`schema_version` must be {SCHEMA_VERSION}, got {version!r}")
        allowed = {
            "schema_version",
            "layout",
            "sink",
            "window",
            "page_size",
            "group_size",
            "cells",
            "bytes_per_token",
            "metadata",
        }
        unknown = set(data) - allowed
        if unknown:
            raise ValueError(f"unknown plan fields {sorted(unknown)}; allowed: {sorted(allowed)}")
        layout = LoopLayout.from_dict(dict(data["layout"]))
        options = {Cell.parse(name): option for name, option in data["cells"].items()}
        return cls(
            layout,
            options,
            sink=data.get("sink", 0),
            window=data.get("window", 0),
            page_size=data.get("page_size", 1),
            group_size=data.get("group_size", 32),
            metadata=dict(data.get("metadata", {})),
        )

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_json(cls, text: str) -> CachePlan:
        return cls.from_dict(json.loads(text))

    def save_pretrained(self, save_directory: str | os.PathLike) -> str:
        """Write `loopcache_plan.json` into `save_directory` (created if needed); returns the file path."""
        os.makedirs(save_directory, exist_ok=True)
        path = os.path.join(save_directory, PLAN_FILE)
        with open(path, "w", encoding="utf-8") as f:
            f.write(self.to_json() + "\n")
        return path

    @classmethod
    def from_pretrained(
        cls, path_or_repo_id: str | os.PathLike, *, revision: str | None = None, **hub_kwargs: Any
    ) -> CachePlan:
        """Load from a local folder (or the JSON file itself) or a Hugging Face Hub repository id.

        A missing path that cannot be a Hub repository id (`./plan`, `/abs/plan`, `plan.json`) raises
        `FileNotFoundError` at once; a Hub download goes through `huggingface_hub.hf_hub_download`, and offline it
        reads only the local Hub cache, else raises `hf_loopcache._hub.HubUnreachableError` (an `OSError`) at once.
        """
        path = os.fspath(path_or_repo_id)
        if os.path.isdir(path):
            path = os.path.join(path, PLAN_FILE)
            if not os.path.isfile(path):
                raise FileNotFoundError(f"no {PLAN_FILE} in folder {os.fspath(path_or_repo_id)!r}")
        elif not os.path.isfile(path):
            from hf_loopcache._hub import hub_download, looks_like_local_path

            if looks_like_local_path(path_or_repo_id):
                raise FileNotFoundError(
                    f"no plan folder or file {path!r} (it is not a Hub repository id either); pass a folder written "
                    f"by CachePlan.save_pretrained, its {PLAN_FILE}, or a Hub repository id"
                )
            path = hub_download(path, PLAN_FILE, what="plan", revision=revision, **hub_kwargs)
        with open(path, encoding="utf-8") as f:
            return cls.from_json(f.read())

    def push_to_hub(self, repo_id: str, *, commit_message: str = "Upload hf_loopcache plan", **hub_kwargs: Any) -> Any:
        """Upload `loopcache_plan.json` to a Hub repository (created if missing).

        Raises:
            HubUnreachableError (an `OSError`): the Hub cannot be reached; nothing is uploaded.
        """
        import tempfile

        from huggingface_hub import HfApi

        from hf_loopcache._hub import HubUnreachableError, hub_offline_reason

        offline = hub_offline_reason()
        if offline is not None:
            raise HubUnreachableError(
                f"cannot push the plan to {repo_id!r}: the Hugging Face Hub cannot be reached ({offline})"
            )
        api = HfApi()
        api.create_repo(
            repo_id, exist_ok=True, **{k: v for k, v in hub_kwargs.items() if k in ("private", "token", "repo_type")}
        )
        with tempfile.TemporaryDirectory() as tmp:
            path = self.save_pretrained(tmp)
            return api.upload_file(
                path_or_fileobj=path,
                path_in_repo=PLAN_FILE,
                repo_id=repo_id,
                commit_message=commit_message,
                **{k: v for k, v in hub_kwargs.items() if k in ("token", "repo_type", "revision")},
            )

    def with_metadata(self, **metadata: Any) -> CachePlan:
        return dataclasses.replace(self, metadata={**self.metadata, **metadata})


def loopkv_preset(
    layout: LoopLayout, name: str, *, sink: int = 32, window: int = 256, page_size: int = 32, group_size: int = 32
) -> CachePlan:
    """Named LoopKV baselines over one engine (LoopKV Sec. 5):

    - `kivi4` / `kivi2`: every cell INT4 / INT2 (KIVI-style codes, BF16 sink and window).
    - `kivi4-share`: INT4 everywhere, the loop before the last shares the final loop ("KIVI-4 + loop-3 sharing").
    - `hand`: the best hand-made per-loop plan of the paper generalised to R loops: INT4 in the first loop, INT2 in
      the middle loops, sharing in the loop before the last, INT4 in the final loop (prelude/coda INT4).
    """
    final = layout.final_loop

    def rule(cell: Cell) -> str:
        if name in ("kivi4", "kivi2"):
            return name.replace("kivi", "int")
        if cell.stage != "core" or cell.loop == final:
            return "int4"
        if name == "kivi4-share":
            return "share" if cell.loop == final - 1 else "int4"
        if name == "hand":
            if cell.loop == final - 1 and final >= 1:
                return "share"
            return "int4" if cell.loop == 0 else "int2"
        raise ValueError(f"`name` must be one of {LOOPKV_PRESETS}, got {name!r}")

    if name not in LOOPKV_PRESETS:
        raise ValueError(f"`name` must be one of {LOOPKV_PRESETS}, got {name!r}")
    return CachePlan.from_rule(
        layout, rule, sink=sink, window=window, page_size=page_size, group_size=group_size, metadata={"preset": name}
    )


LOOPKV_PRESETS = ("kivi4", "kivi2", "kivi4-share", "hand")
