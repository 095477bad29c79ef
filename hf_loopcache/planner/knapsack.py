"""Exact multiple-choice knapsack behind the LoopKV planner (LoopKV paper, Section 3.1, Eq. (2)).

Every cell `c` of a looped model's KV cache (one layer in one loop) takes exactly one storage option `o` ("int4",
"int2", "share", ...). Option `o` of cell `c` stores `s_{c,o}` bytes and reads `r_{c,o}` bytes per history token and
does a profiled damage `d_{c,o}` (its single-cell KL). The planner solves

    minimize    sum_c r_{c,o(c)}
    subject to  sum_c d_{c,o(c)} <= eps            (damage budget)
                sum_c s_{c,o(c)} <= M              (storage budget, optional)

*exactly*. Because every byte cost is a multiple of a unit (0.5 KiB for KIVI-style codes: INT4 is 5 units per token
and layer, INT2 3 units, a shared cell 0 stored / 5 read), a dynamic program over (stored units, read units) states
whose value is the minimum damage covers every plan; damages stay real numbers and are minimised, not discretised.

Implementation notes (see `solve_knapsack` for the tie rule):

- The DP runs over the cells in *reverse* order, so that back-pointers are read in the given cell order when a plan
  is rebuilt. State `(s, r)` of stage `k` holds the minimum damage of cells `k..n-1` that store `s` and read `r`
  (units, relative to the cheapest option of each cell, and divided by the gcd of all such offsets).
- Each stage is vectorised over all states: one shifted `np.minimum`-style update per option.
- The state box grows cell by cell and is clipped at the storage budget, and back-pointers are `uint8` (at most 255
  options per cell), so memory is about `sum_k |box_k|` bytes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from numbers import Integral, Real

import numpy as np

__all__ = ["KnapsackSolution", "OptionCost", "pareto_frontier", "solve_knapsack", "uniform_solution"]

# Slack on the damage budget that absorbs float64 summation order: the DP adds damages from the last cell to the first,
# while a caller usually sums a reference plan in cell order. Relative to the budget, far above rounding of any
# realistic number of cells and far below any meaningful damage difference.
_DAMAGE_RTOL = 1e-12
_MAX_OPTIONS = int(np.iinfo(np.uint8).max)


@dataclass(frozen=True)
class OptionCost:
    """Cost of one storage option for one cell.

    Args:
        damage (`float`): profiled damage of the cell under this option (e.g. its single-cell KL), finite and >= 0.
        stored_bytes (`int`): bytes the cell stores per history token under this option, >= 0. `solve_knapsack`
            requires a multiple of its `unit`.
        read_bytes (`int`): bytes the cell reads per history token and decode step under this option, >= 0. Also a
            multiple of `unit`.
    """

    damage: float
    stored_bytes: int
    read_bytes: int

    def __post_init__(self) -> None:
        if isinstance(self.damage, bool) or not isinstance(self.damage, Real):
            raise TypeError(f"`damage` must be a real number, got {type(self.damage).__name__} {self.damage!r}")
        if not math.isfinite(self.damage) or self.damage < 0:
            raise ValueError(f"`damage` must be a finite number >= 0, got {self.damage!r}")
        for field in ("stored_bytes", "read_bytes"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, Integral):
                raise TypeError(f"`{field}` must be an int, got {type(value).__name__} {value!r}")
            if value < 0:
                raise ValueError(f"`{field}` must be >= 0, got {value!r}")


@dataclass(frozen=True)
class KnapsackSolution:
    """One plan: an option for every cell, and its totals.

    Args:
        choice (`dict[str, str]`): cell name -> chosen option name, in the cell order of the cost table.
        damage (`float`): sum of the chosen options' damages (the plan's predicted damage), summed exactly
            (`math.fsum`) in cell order.
        stored_bytes (`int`): total stored bytes per history token.
        read_bytes (`int`): total read bytes per history token and decode step.
    """

    choice: dict[str, str]
    damage: float
    stored_bytes: int
    read_bytes: int

    def count(self, option: str) -> int:
        """Number of cells that take `option`."""
        return sum(1 for chosen in self.choice.values() if chosen == option)


@dataclass
class _Table:
    """Cost table in DP units: per cell, the option names and their damages and relative, gcd-scaled byte costs."""

    cells: list[str]
    options: list[list[str]]
    damage: list[np.ndarray]  # per cell, float64 [n_options]
    stored: list[np.ndarray]  # per cell, int64 [n_options], (s - min s) / stored_step
    read: list[np.ndarray]  # per cell, int64 [n_options], (r - min r) / read_step
    base_stored_units: int  # sum over cells of the cheapest stored cost, in units
    stored_step: int  # units per stored DP step


@dataclass
class _DP:
    """Result of the DP: `value[s, r]` = min damage of all cells at relative state `(s, r)`, plus back-pointers."""

    table: _Table
    value: np.ndarray  # float64 [S + 1, R + 1], inf where unreachable
    back: list[np.ndarray]  # back[k]: uint8 [S_k + 1, R_k + 1], option index of cell k at stage k's state


def _check_unit(unit: int) -> None:
    if isinstance(unit, bool) or not isinstance(unit, Integral) or unit <= 0:
        raise ValueError(f"`unit` must be a positive int (bytes), got {unit!r}")


def _check_storage_budget(storage_budget: int | None) -> None:
    if storage_budget is None:
        return
    if isinstance(storage_budget, bool) or not isinstance(storage_budget, Integral) or storage_budget < 0:
        raise ValueError(f"`storage_budget` must be None or an int >= 0 (bytes), got {storage_budget!r}")


def _check_costs(costs: Mapping[str, Mapping[str, OptionCost]]) -> None:
    if not isinstance(costs, Mapping):
        raise TypeError(f"`costs` must be a mapping cell -> option -> OptionCost, got {type(costs).__name__}")
    if len(costs) == 0:
        raise ValueError("`costs` must contain at least one cell, got an empty mapping")
    for cell, options in costs.items():
        if not isinstance(options, Mapping):
            raise TypeError(f"`costs[{cell!r}]` must be a mapping option -> OptionCost, got {type(options).__name__}")
        if not 1 <= len(options) <= _MAX_OPTIONS:
            raise ValueError(f"`costs[{cell!r}]` must offer between 1 and {_MAX_OPTIONS} options, got {len(options)}")
        for option, cost in options.items():
            if not isinstance(cost, OptionCost):
                raise TypeError(f"`costs[{cell!r}][{option!r}]` must be an OptionCost, got {type(cost).__name__}")


def _build_table(costs: Mapping[str, Mapping[str, OptionCost]], unit: int) -> _Table:
    _check_unit(unit)
    _check_costs(costs)
    cells, options, damage, stored_units, read_units = [], [], [], [], []
    for cell, cell_options in costs.items():
        for option, cost in cell_options.items():
            for field in ("stored_bytes", "read_bytes"):
                value = getattr(cost, field)
                if value % unit != 0:
                    raise ValueError(
                        f"`costs[{cell!r}][{option!r}].{field}` must be a multiple of `unit`={unit} bytes, "
                        f"got {value} ({value / unit:g} units)"
                    )
        cells.append(cell)
        options.append(list(cell_options))
        damage.append(np.array([float(c.damage) for c in cell_options.values()], dtype=np.float64))
        stored_units.append(np.array([c.stored_bytes // unit for c in cell_options.values()], dtype=np.int64))
        read_units.append(np.array([c.read_bytes // unit for c in cell_options.values()], dtype=np.int64))

    base_stored = int(sum(int(s.min()) for s in stored_units))
    stored_rel = [s - s.min() for s in stored_units]
    read_rel = [r - r.min() for r in read_units]
    # Dividing by the gcd of all offsets shrinks the state box without losing any plan.
    stored_step = math.gcd(*(int(x) for s in stored_rel for x in s)) or 1
    read_step = math.gcd(*(int(x) for r in read_rel for x in r)) or 1
    return _Table(
        cells=cells,
        options=options,
        damage=damage,
        stored=[s // stored_step for s in stored_rel],
        read=[r // read_step for r in read_rel],
        base_stored_units=base_stored,
        stored_step=stored_step,
    )


def _run_dp(table: _Table, stored_cap: int | None) -> _DP:
    """Fill the DP from the last cell to the first; `stored_cap` bounds the relative stored state (None = no bound)."""
    value = np.zeros((1, 1), dtype=np.float64)
    back: list[np.ndarray] = [np.empty(0, dtype=np.uint8)] * len(table.cells)
    for k in range(len(table.cells) - 1, -1, -1):
        damage, stored, read = table.damage[k], table.stored[k], table.read[k]
        prev_s, prev_r = value.shape
        n_s = prev_s + int(stored.max())
        if stored_cap is not None:
            n_s = min(n_s, stored_cap + 1)
        n_r = prev_r + int(read.max())
        new = np.full((n_s, n_r), np.inf, dtype=np.float64)
        ptr = np.zeros((n_s, n_r), dtype=np.uint8)
        cand = np.empty_like(value)
        better = np.empty(value.shape, dtype=bool)
        for j in range(len(damage)):
            s, r = int(stored[j]), int(read[j])
            rows = min(prev_s, n_s - s)
            if rows <= 0:
                continue  # this option alone overflows the storage budget
            src, c, b = value[:rows], cand[:rows], better[:rows]
            np.add(src, damage[j], out=c)
            dst = new[s : s + rows, r : r + prev_r]
            # Strict `<`: among options giving the same damage at a state, the first one in the given order wins.
            np.less(c, dst, out=b)
            np.copyto(dst, c, where=b)
            np.copyto(ptr[s : s + rows, r : r + prev_r], np.uint8(j), where=b)
        value, back[k] = new, ptr
    return _DP(table=table, value=value, back=back)


def _stored_cap(table: _Table, storage_budget: int | None, unit: int) -> int | None:
    """Largest relative stored DP state under `storage_budget` (None: unbounded; -1: the cheapest plan overflows)."""
    if storage_budget is None:
        return None
    spare = storage_budget // unit - table.base_stored_units
    return -1 if spare < 0 else spare // table.stored_step


def _reconstruct(costs: Mapping[str, Mapping[str, OptionCost]], dp: _DP, s: int, r: int) -> KnapsackSolution:
    table = dp.table
    choice: dict[str, str] = {}
    for k, cell in enumerate(table.cells):
        j = int(dp.back[k][s, r])
        choice[cell] = table.options[k][j]
        s -= int(table.stored[k][j])
        r -= int(table.read[k][j])
    if s != 0 or r != 0:
        raise RuntimeError(f"internal error: knapsack back-pointers end at state ({s}, {r}) instead of (0, 0)")
    return _solution_from_choice(costs, choice)


def _solution_from_choice(costs: Mapping[str, Mapping[str, OptionCost]], choice: dict[str, str]) -> KnapsackSolution:
    chosen = [costs[cell][option] for cell, option in choice.items()]
    return KnapsackSolution(
        choice=choice,
        damage=math.fsum(c.damage for c in chosen),
        stored_bytes=sum(int(c.stored_bytes) for c in chosen),
        read_bytes=sum(int(c.read_bytes) for c in chosen),
    )


def _storage_infeasible_error(costs: Mapping[str, Mapping[str, OptionCost]], storage_budget: int) -> ValueError:
    min_stored = sum(min(int(c.stored_bytes) for c in options.values()) for options in costs.values())
    min_damage = math.fsum(min(c.damage for c in options.values()) for options in costs.values())
    return ValueError(
        f"no plan fits `storage_budget`={storage_budget} bytes: the smallest achievable storage is {min_stored} bytes "
        f"per token; choose `storage_budget` >= {min_stored} or None (the smallest achievable damage without a "
        f"storage budget is {min_damage!r})"
    )


def solve_knapsack(
    costs: Mapping[str, Mapping[str, OptionCost]],
    damage_budget: float,
    storage_budget: int | None = None,
    unit: int = 512,
) -> KnapsackSolution:
    """Minimum-read plan under a damage budget and an optional storage budget, solved exactly (Eq. (2)).

    The DP state is (stored units, read units) -> minimum damage, filled cell by cell with one vectorised update per
    option. With `C` cells of at most `K` options whose stored / read costs span at most `a` / `b` units within a cell,
    it takes `O(K * sum_k S_k * R_k) <= O(K * C^3 * a * b)` time and `sum_k S_k * R_k` bytes of back-pointers, where
    `S_k <= min(k * a, M / unit)` and `R_k <= k * b` bound the state box after `k` cells (gcd-compressed). For
    Ouro-1.4B's 72 cells with INT4 / INT2 / share (a = 5, b = 2 units, b = 1 step after gcd) that is a 361 x 73 box.

    Tie rule: among the plans that meet both budgets, the solver returns the one with
    1. the fewest read bytes (the objective), then
    2. the smallest damage (compared as float64 sums), then
    3. the fewest stored bytes, then
    4. the lexicographically first choice in the given orders: the first cell takes the earliest option in its
       given order that still allows an otherwise equal plan, then the second cell, and so on.

    The damage budget is checked with a relative slack of 1e-12, so a budget computed as the damage of some plan (e.g.
    `uniform_solution(costs, "int4").damage`) always admits that plan despite float summation order.

    Args:
        costs (`Mapping[str, Mapping[str, OptionCost]]`): cell name -> option name -> `OptionCost`, in the order used
            for tie-breaking. Every stored and read byte count must be a multiple of `unit`.
        damage_budget (`float`): `eps`, the largest allowed sum of chosen damages (>= 0; `math.inf` for none).
        storage_budget (`int`, *optional*): `M`, the largest allowed total stored bytes per token. `None` (default)
            leaves storage unconstrained (the read-optimized plan, LoopKV-R).
        unit (`int`, *optional*, defaults to 512): granularity of byte costs (0.5 KiB).

    Returns:
        `KnapsackSolution`: the chosen option per cell with its total damage, stored and read bytes.

    Raises:
        `ValueError`: on invalid arguments, on a byte cost that is not a multiple of `unit` (naming the cell and
            option), or if no plan meets the budgets; the message then gives the smallest achievable damage under
            the storage budget and the smallest achievable storage.

    Example:

    ```python
    >>> from hf_loopcache.planner.knapsack import OptionCost, solve_knapsack
    >>> kib = 1024
    >>> costs = {
    ...     cell: {
    ...         "int4": OptionCost(damage=d4, stored_bytes=5 * kib // 2, read_bytes=5 * kib // 2),
    ...         "int2": OptionCost(damage=d2, stored_bytes=3 * kib // 2, read_bytes=3 * kib // 2),
    ...         "share": OptionCost(damage=ds, stored_bytes=0, read_bytes=5 * kib // 2),
    ...     }
    ...     for cell, (d4, d2, ds) in {"loop0.layer0": (0.01, 0.5, 2.0), "loop1.layer0": (0.01, 0.1, 0.05)}.items()
    ... }
    >>> solve_knapsack(costs, damage_budget=0.2).choice
    {'loop0.layer0': 'int4', 'loop1.layer0': 'int2'}
    >>> solve_knapsack(costs, damage_budget=0.2, storage_budget=3 * kib).choice
    {'loop0.layer0': 'int4', 'loop1.layer0': 'share'}

    ```
    """
    if isinstance(damage_budget, bool) or not isinstance(damage_budget, Real):
        raise TypeError(f"`damage_budget` must be a real number, got {type(damage_budget).__name__}")
    if math.isnan(damage_budget) or damage_budget < 0:
        raise ValueError(f"`damage_budget` must be a number >= 0 (math.inf for no budget), got {damage_budget!r}")
    _check_storage_budget(storage_budget)
    table = _build_table(costs, unit)
    cap = _stored_cap(table, storage_budget, unit)
    if cap == -1:
        raise _storage_infeasible_error(costs, storage_budget)  # type: ignore[arg-type]
    dp = _run_dp(table, cap)

    value = dp.value
    limit = float(damage_budget) * (1.0 + _DAMAGE_RTOL)
    col_min = value.min(axis=0)  # [R + 1], min damage per read state over all stored states within the budget
    feasible = np.flatnonzero(col_min <= limit)
    if feasible.size == 0:
        best = _reconstruct(costs, dp, *np.unravel_index(int(np.argmin(value)), value.shape))
        min_stored = sum(min(int(c.stored_bytes) for c in options.values()) for options in costs.values())
        where = "" if storage_budget is None else f" under `storage_budget`={storage_budget} bytes"
        raise ValueError(
            f"no plan meets `damage_budget`={damage_budget!r}{where}: the smallest achievable damage{where} is "
            f"{best.damage!r} (that plan stores {best.stored_bytes} and reads {best.read_bytes} bytes per token), and "
            f"the smallest achievable storage is {min_stored} bytes per token; choose `damage_budget` >= "
            f"{best.damage!r}" + ("" if storage_budget is None else " or a larger `storage_budget`")
        )
    r = int(feasible[0])
    s = int(np.argmin(value[:, r]))  # first minimum: the smallest stored state among the minimum-damage ones
    return _reconstruct(costs, dp, s, r)


def pareto_frontier(
    costs: Mapping[str, Mapping[str, OptionCost]],
    storage_budget: int | None = None,
    unit: int = 512,
) -> list[KnapsackSolution]:
    """Read / damage Pareto frontier of all plans within a storage budget.

    For every achievable read total, the minimum-damage plan (ties broken as in `solve_knapsack`), keeping only the
    Pareto-optimal points: the list is sorted by increasing `read_bytes` with strictly decreasing `damage`. Its first
    point is the minimum-read plan, its last the minimum-damage plan, and each point equals
    `solve_knapsack(costs, damage_budget=point.damage, storage_budget=storage_budget, unit=unit)`. One DP serves
    all points, so the cost is that of one `solve_knapsack` call plus `O(C)` per point.

    Args:
        costs (`Mapping[str, Mapping[str, OptionCost]]`): as in `solve_knapsack`.
        storage_budget (`int`, *optional*): largest total stored bytes per token; `None` (default) for none.
        unit (`int`, *optional*, defaults to 512): granularity of byte costs.

    Returns:
        `list[KnapsackSolution]`: the frontier, by increasing reads.

    Raises:
        `ValueError`: on invalid arguments or if no plan fits `storage_budget`.
    """
    _check_storage_budget(storage_budget)
    table = _build_table(costs, unit)
    cap = _stored_cap(table, storage_budget, unit)
    if cap == -1:
        raise _storage_infeasible_error(costs, storage_budget)  # type: ignore[arg-type]
    dp = _run_dp(table, cap)
    col_min = dp.value.min(axis=0)
    col_arg = dp.value.argmin(axis=0)
    frontier: list[KnapsackSolution] = []
    best = math.inf
    for r in range(col_min.shape[0]):
        if col_min[r] < best:
            best = float(col_min[r])
            frontier.append(_reconstruct(costs, dp, int(col_arg[r]), r))
    return frontier


def uniform_solution(costs: Mapping[str, Mapping[str, OptionCost]], option: str) -> KnapsackSolution:
    """The plan that gives every cell the same `option` (e.g. uniform INT4, the KIVI-4 baseline), for comparisons.

    Args:
        costs (`Mapping[str, Mapping[str, OptionCost]]`): as in `solve_knapsack`.
        option (`str`): option name every cell must offer.

    Returns:
        `KnapsackSolution`: that plan with its totals (no budget is checked).

    Raises:
        `ValueError`: if a cell does not offer `option`.
    """
    _check_costs(costs)
    missing = [cell for cell, options in costs.items() if option not in options]
    if missing:
        shown = ", ".join(repr(cell) for cell in missing[:5]) + (
            f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        )
        allowed = sorted(set.intersection(*(set(options) for options in costs.values())))
        raise ValueError(
            f"`option`={option!r} is not offered by {len(missing)} cell(s) ({shown}); options offered by every cell: "
            f"{allowed}"
        )
    return _solution_from_choice(costs, dict.fromkeys(costs, option))
