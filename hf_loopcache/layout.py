"""`LoopLayout`: which cache slot is which cell of a looped model, and how many bytes the cells store.

A looped LM runs a prelude of `n_prelude` layers once, a core of `n_core` layers `num_loops` times and a coda of
`n_coda` layers once per token. Every (loop, core layer) pair and every prelude/coda layer writes its own keys and
values: a **cell**. All cells of loop `r` together are **plane r**; the last loop's plane is the deepest one.

Models address cells by a *slot index*, the number they pass to `Cache.update`:

| stage   | cell                      | slot                          | flat index (position in `cache.layers`) |
|---------|---------------------------|-------------------------------|-----------------------------------------|
| prelude | layer `p`                 | `p`                           | `p`                                     |
| core    | loop `r`, layer `j`       | `n_prelude + n_core * r + j`  | same as the slot                        |
| coda    | layer `c` (0 = first)     | `-(c + 1)`                    | `n_prelude + n_core * num_loops + c`    |

Ouro has no prelude or coda (`slot = loop * n_layers + layer`); Huginn-0125 has a prelude of 2, a core of 4 and a
coda of 2 whose slots are -1 and -2, exactly the indices the official code uses.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

__all__ = ["Cell", "LoopLayout", "Stage"]

Stage = Literal["prelude", "core", "coda"]
_STAGES = ("prelude", "core", "coda")

_T = TypeVar("_T")


def equal_assignment_allowed(cls: type[_T]) -> type[_T]:
    """Keep a frozen dataclass frozen, but let assigning a field the value it already holds pass as a no-op.

    Generic tensor walkers re-assign every attribute of the objects they visit (transformers' exporters map tensors
    in place over `vars(obj)` of a cache passed to `torch.export`); a real change still raises `FrozenInstanceError`.
    """
    frozen_setattr = cls.__setattr__

    def __setattr__(self: Any, name: str, value: Any) -> None:
        current = self.__dict__.get(name, _MISSING)
        if current is value or (type(current) is type(value) and _equal(current, value)):
            return
        frozen_setattr(self, name, value)

    cls.__setattr__ = __setattr__  # type: ignore[assignment,method-assign]
    return cls


_MISSING = object()


def _equal(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except (RuntimeError, TypeError, ValueError):  # e.g. a tensor of several elements
        return False


@equal_assignment_allowed
@dataclass(frozen=True, order=True)
class Cell:
    """One (stage, loop, layer) cell. `loop` is 0 for prelude and coda cells, which run once."""

    stage: Stage
    loop: int
    layer: int

    def __post_init__(self) -> None:
        if self.stage not in _STAGES:
            raise ValueError(f"`stage` must be one of {_STAGES}, got {self.stage!r}")
        if self.stage != "core" and self.loop != 0:
            raise ValueError(f"`loop` must be 0 for a {self.stage} cell, got {self.loop}")
        if self.loop < 0 or self.layer < 0:
            raise ValueError(f"`loop` and `layer` must be >= 0, got loop={self.loop}, layer={self.layer}")

    def __str__(self) -> str:
        if self.stage == "core":
            return f"loop{self.loop}.layer{self.layer}"
        return f"{self.stage}.layer{self.layer}"

    @classmethod
    def parse(cls, name: str) -> Cell:
        """Inverse of `str(cell)`: `"loop2.layer5"`, `"prelude.layer0"`, `"coda.layer1"`."""
        head, _, tail = name.partition(".")
        if not tail.startswith("layer"):
            raise ValueError(f"cannot parse cell name {name!r}; expected e.g. 'loop2.layer5' or 'coda.layer0'")
        layer = int(tail[len("layer") :])
        if head.startswith("loop"):
            return cls("core", int(head[len("loop") :]), layer)
        if head in ("prelude", "coda"):
            return cls(head, 0, layer)  # type: ignore[arg-type]
        raise ValueError(f"cannot parse cell name {name!r}; expected e.g. 'loop2.layer5' or 'coda.layer0'")


@equal_assignment_allowed
@dataclass(frozen=True)
class LoopLayout:
    """Shape of a looped model's key/value cache.

    Args:
        n_core (`int`): layers in the looped block (Ouro: all its layers).
        num_loops (`int`): how many times the block runs by default (Ouro: `total_ut_steps`; Huginn:
            `mean_recurrence`). A call may run fewer loops; a cache built for this layout holds at most this many.
        num_kv_heads (`int`): key/value heads per layer.
        head_dim (`int`): width of one head.
        n_prelude (`int`, *optional*, defaults to 0): layers run once before the loop.
        n_coda (`int`, *optional*, defaults to 0): layers run once after the loop.
        bytes_per_element (`int`, *optional*, defaults to 2): storage width of one key or value element (bf16).
        name (`str`, *optional*): a label for messages ("ouro", "huginn_raven", ...).

    Example:

    ```python
    >>> from hf_loopcache import LoopLayout
    >>> ouro = LoopLayout(n_core=24, num_loops=4, num_kv_heads=16, head_dim=128, name="ouro")
    >>> ouro.cell(30), ouro.slot(ouro.cell(30))
    (Cell(stage='core', loop=1, layer=6), 30)
    >>> ouro.full_bytes_per_token() // 1024
    768
    ```
    """

    n_core: int
    num_loops: int
    num_kv_heads: int
    head_dim: int
    n_prelude: int = 0
    n_coda: int = 0
    bytes_per_element: int = 2
    name: str = "looped"

    def __post_init__(self) -> None:
        for field in ("n_core", "num_loops", "num_kv_heads", "head_dim", "bytes_per_element"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"`{field}` must be a positive int, got {value!r}")
        for field in ("n_prelude", "n_coda"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"`{field}` must be a non-negative int, got {value!r}")

    # ----------------------------------------------------------------------------------------- construction
    @classmethod
    def from_config(cls, config: Any, num_loops: int | None = None) -> LoopLayout:
        """Layout of an Ouro (`model_type="ouro"`) or Huginn/Raven (`model_type="huginn_raven"`) config."""
        model_type = getattr(config, "model_type", None)
        if model_type == "ouro":
            heads = config.num_attention_heads
            head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
            layout = cls(
                n_core=config.num_hidden_layers,
                num_loops=config.total_ut_steps,
                num_kv_heads=config.num_key_value_heads or heads,
                head_dim=head_dim,
                name="ouro",
            )
        elif model_type == "huginn_raven":
            layout = cls(
                n_core=config.n_layers_in_recurrent_block,
                num_loops=config.mean_recurrence,
                num_kv_heads=config.num_key_value_heads,
                head_dim=config.n_embd // config.n_heads,
                n_prelude=config.n_layers_in_prelude,
                n_coda=config.n_layers_in_coda,
                name="huginn_raven",
            )
        else:
            raise ValueError(
                f"`config.model_type` must be one of ('ouro', 'huginn_raven') to derive a LoopLayout, got {model_type!r}"
            )
        return layout if num_loops is None else layout.with_loops(num_loops)

    def with_loops(self, num_loops: int) -> LoopLayout:
        """The same architecture with another loop count."""
        return dataclasses.replace(self, num_loops=num_loops)

    def same_architecture(self, other: LoopLayout) -> bool:
        """True when `other` differs from this layout at most in `num_loops` and `name`."""
        fields = ("n_prelude", "n_core", "n_coda", "num_kv_heads", "head_dim", "bytes_per_element")
        return all(getattr(self, f) == getattr(other, f) for f in fields)

    # ---------------------------------------------------------------------------------------------- cells
    @property
    def num_cells(self) -> int:
        return self.n_prelude + self.n_core * self.num_loops + self.n_coda

    @property
    def final_loop(self) -> int:
        return self.num_loops - 1

    def cells(self) -> list[Cell]:
        """All cells in flat order: prelude, core loop by loop, coda."""
        return [self.cell_at(i) for i in range(self.num_cells)]

    def core_cells(self, loop: int | None = None) -> list[Cell]:
        loops = range(self.num_loops) if loop is None else [self._check_loop(loop)]
        return [Cell("core", r, j) for r in loops for j in range(self.n_core)]

    def cell_at(self, flat_index: int) -> Cell:
        """The cell at position `flat_index` of the flat order."""
        if not 0 <= flat_index < self.num_cells:
            raise IndexError(f"flat index {flat_index} is out of range for {self.num_cells} cells ({self.describe()})")
        if flat_index < self.n_prelude:
            return Cell("prelude", 0, flat_index)
        core = flat_index - self.n_prelude
        if core < self.n_core * self.num_loops:
            return Cell("core", core // self.n_core, core % self.n_core)
        return Cell("coda", 0, core - self.n_core * self.num_loops)

    def flat_index(self, cell: Cell) -> int:
        self._check_cell(cell)
        if cell.stage == "prelude":
            return cell.layer
        if cell.stage == "core":
            return self.n_prelude + self.n_core * cell.loop + cell.layer
        return self.n_prelude + self.n_core * self.num_loops + cell.layer

    def cell(self, slot: int) -> Cell:
        """The cell a model addresses by `slot` (see the module docstring)."""
        if isinstance(slot, bool) or not isinstance(slot, int):
            raise TypeError(f"`slot` must be an int, got {type(slot).__name__}")
        if slot < 0:
            if -slot > self.n_coda:
                raise IndexError(
                    f"unknown slot index {slot}: this layout has {self.n_coda} coda slots (-1..-{self.n_coda}); "
                    f"{self.describe()}"
                )
            return Cell("coda", 0, -slot - 1)
        if slot < self.n_prelude:
            return Cell("prelude", 0, slot)
        core = slot - self.n_prelude
        if core >= self.n_core * self.num_loops:
            raise IndexError(
                f"unknown slot index {slot}: the core of this layout has {self.num_loops} loops x {self.n_core} "
                f"layers (slots {self.n_prelude}..{self.n_prelude + self.n_core * self.num_loops - 1}); "
                f"{self.describe()}"
            )
        return Cell("core", core // self.n_core, core % self.n_core)

    def slot(self, cell: Cell) -> int:
        self._check_cell(cell)
        if cell.stage == "coda":
            return -(cell.layer + 1)
        return self.flat_index(cell)

    def slot_to_flat(self, slot: int) -> int:
        return self.flat_index(self.cell(slot))

    def source_cell(self, cell: Cell) -> Cell:
        """The cell a `share`d cell reads: the final loop's cell of the same core layer."""
        self._check_cell(cell)
        if cell.stage != "core":
            raise ValueError(f"only core cells have a sharing source, got {cell}")
        return Cell("core", self.final_loop, cell.layer)

    def _check_loop(self, loop: int) -> int:
        if not 0 <= loop < self.num_loops:
            raise ValueError(f"`loop` must be in [0, {self.num_loops - 1}], got {loop}")
        return loop

    def _check_cell(self, cell: Cell) -> None:
        limit = {"prelude": self.n_prelude, "core": self.n_core, "coda": self.n_coda}[cell.stage]
        if cell.layer >= limit or (cell.stage == "core" and cell.loop >= self.num_loops):
            raise IndexError(f"cell {cell} does not exist in this layout ({self.describe()})")

    # --------------------------------------------------------------------------------------------- bytes
    @property
    def bytes_per_cell_token(self) -> int:
        """`b` of RIPE Eq. (3): keys plus values of one cell for one token."""
        return 2 * self.num_kv_heads * self.head_dim * self.bytes_per_element

    def full_bytes_per_token(self) -> int:
        """RIPE Eq. (3), full cache: `b (n_pre + n_coda + R n_core)` per token."""
        return self.bytes_per_cell_token * self.num_cells

    def plane_bytes_per_token(self) -> int:
        """RIPE Eq. (3), deepest plane only: `b (n_pre + n_coda + n_core)` per token."""
        return self.bytes_per_cell_token * (self.n_prelude + self.n_coda + self.n_core)

    def full_bytes(self, seq_len: int) -> int:
        """`M_full(L)` of RIPE Eq. (3)."""
        return self.full_bytes_per_token() * seq_len

    def deepest_plane_bytes(self, seq_len: int) -> int:
        """`M_deep(L)` of RIPE Eq. (3)."""
        return self.plane_bytes_per_token() * seq_len

    def ripe_bytes(self, seq_len: int, window: int) -> int:
        """`M_RIPE(L) = M_deep(L) + b n_core (R - 1) min(W, L)`, RIPE Eq. (10)."""
        extra = self.bytes_per_cell_token * self.n_core * (self.num_loops - 1) * min(window, seq_len)
        return self.deepest_plane_bytes(seq_len) + extra

    def describe(self) -> str:
        parts = [f"{self.name}: "]
        if self.n_prelude:
            parts.append(f"prelude {self.n_prelude}, ")
        parts.append(f"core {self.n_core} x {self.num_loops} loops")
        if self.n_coda:
            parts.append(f", coda {self.n_coda}")
        parts.append(f", {self.num_kv_heads} KV heads of {self.head_dim}")
        return "".join(parts)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LoopLayout:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown LoopLayout fields {sorted(unknown)}; allowed: {sorted(known)}")
        return cls(**data)
