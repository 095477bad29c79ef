"""From a `CellProfile` to a `CachePlan`: the exact multiple-choice knapsack of LoopKV Eq. (2).

The final loop's cells, which every shared cell reads, are fixed to one option (INT4 by default, as in the paper)
and enter every plan as a constant. Every other cell takes the option that minimises the plan's read bytes per token
under a damage budget (sum of the cells' profiled damages) and an optional storage budget (stored bytes per token).
A shared cell stores nothing and reads its source's bytes. Byte costs are exact multiples of a unit (the greatest
common divisor of all option costs: 0.5 KiB on Ouro-1.4B's layout), so the dynamic programme is exact.
"""

from __future__ import annotations

import math
import re
from functools import reduce
from typing import TYPE_CHECKING, Any

from hf_loopcache.cache.plan import CachePlan
from hf_loopcache.layout import Cell
from hf_loopcache.planner.knapsack import KnapsackSolution, OptionCost, pareto_frontier, solve_knapsack

if TYPE_CHECKING:
    from collections.abc import Sequence

    from hf_loopcache.planner.profile import CellProfile

__all__ = ["parse_bytes", "parse_damage", "plan_at_bytes", "plan_costs", "plan_from_profile", "predicted_damage"]

_UNITS = {"": 1, "b": 1, "kib": 1024, "kb": 1000, "mib": 1024**2, "mb": 1000**2}


def parse_bytes(value: int | str | None) -> int | None:
    """`156KiB`, `160000`, `1.5MiB` -> bytes (per token)."""
    if value is None or isinstance(value, int):
        return value
    match = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]*)\s*", value)
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(f"`storage_budget` must be bytes like 160000, '156KiB' or '1.5MiB', got {value!r}")
    return int(round(float(match.group(1)) * _UNITS[match.group(2).lower()]))


def parse_damage(value: float | str, kl_share: float | None) -> float:
    """An absolute KL, or `'1.19x'` for a multiple of the profile's `KL_share`."""
    if isinstance(value, (int, float)):
        return float(value)
    text = value.strip().lower()
    if text.endswith("x"):
        if kl_share is None:
            raise ValueError("a relative `damage_budget` ('1.19x') needs a profile that measured KL_share")
        return float(text[:-1]) * kl_share
    try:
        return float(text)
    except ValueError as err:
        raise ValueError(
            f"`damage_budget` must be a KL like 2e-4 or a multiple of KL_share like '1.19x', got {value!r}"
        ) from err


def _base_plan(profile: CellProfile, choice: dict[Cell, str]) -> CachePlan:
    s = profile.settings
    return CachePlan(
        profile.layout,
        choice,
        sink=s.get("sink", 32),
        window=s.get("window", 256),
        page_size=s.get("page_size", 32),
        group_size=s.get("group_size", 32),
    )


def plan_costs(
    profile: CellProfile, options: Sequence[str] = ("int4", "int2", "share"), final_option: str = "int4"
) -> tuple[dict[str, dict[str, OptionCost]], dict[Cell, str], int]:
    """Knapsack costs of the free cells, the fixed final-loop choice, and the byte unit."""
    layout = profile.layout
    source = profile.settings.get("share_source")
    if "share" in options and source != final_option:
        raise ValueError(
            f"the profile scored `share` against a final loop stored as {source!r}, but `final_option` is "
            f"{final_option!r}: plan with final_option={source!r}, or profile with share_source={final_option!r}"
        )
    fixed = dict.fromkeys(layout.core_cells(layout.final_loop), final_option)
    probe = _base_plan(profile, dict.fromkeys(layout.cells(), "bf16"))
    per_option = {
        "bf16": layout.bytes_per_cell_token,
        "int4": probe.coded_bytes_per_token(4),
        "int2": probe.coded_bytes_per_token(2),
    }
    source_bytes = per_option[final_option]
    costs: dict[str, dict[str, tuple[float, int, int]]] = {}
    for cell in layout.cells():
        if cell in fixed:
            continue
        measured = profile.options_of(cell)
        row: dict[str, tuple[float, int, int]] = {}
        for option in options:
            if option == "share" and not (cell.stage == "core" and cell.loop < layout.final_loop):
                continue
            if option not in measured:
                raise ValueError(f"the profile has no damage for cell {cell} option {option!r}; profile it first")
            stored = 0 if option == "share" else per_option[option]
            read = source_bytes if option == "share" else per_option[option]
            row[option] = (measured[option], stored, read)
        costs[str(cell)] = row
    values = [b for row in costs.values() for (_, s, r) in row.values() for b in (s, r)] + [source_bytes]
    unit = reduce(math.gcd, [v for v in values if v] or [1])
    table = {name: {o: OptionCost(d, s, r) for o, (d, s, r) in row.items()} for name, row in costs.items()}
    return table, fixed, unit


def predicted_damage(profile: CellProfile, plan: CachePlan) -> float:
    """The plan's predicted KL: the sum of its cells' profiled damages (LoopKV Proposition 2)."""
    return sum(profile.options_of(c).get(o, math.nan) for c, o in plan.options.items())


def plan_from_profile(
    profile: CellProfile,
    *,
    damage_budget: float | str,
    storage_budget: int | str | None = None,
    options: Sequence[str] = ("int4", "int2", "share"),
    final_option: str = "int4",
    model_id: str | None = None,
    revision: str | None = None,
    profile_path: str | None = None,
) -> CachePlan:
    """The read-optimised plan (no `storage_budget`) or the memory-optimised plan (with one).

    Args:
        profile: the measured cell damages.
        damage_budget: bound on the summed damage of the whole plan (final loop included): a KL, or `'1.19x'` times
            the profile's `KL_share`.
        storage_budget: bound on stored bytes per history token (all cells), e.g. `'156KiB'`; None = unbounded.
        options: options the free cells may take (add `'bf16'` to allow keeping a cell exact).
        final_option: option of the final loop's cells, the sharing source (`int4` as in LoopKV).
        model_id, revision, profile_path: provenance recorded in the plan's metadata.
    """
    bad = [o for o in options if o not in ("bf16", "int4", "int2", "share")]
    if bad:
        raise ValueError(f"`options` must be drawn from ('bf16', 'int4', 'int2', 'share'), got {bad}")
    if final_option not in ("bf16", "int4", "int2"):
        raise ValueError(f"`final_option` must be one of ('bf16', 'int4', 'int2'), got {final_option!r}")
    costs, fixed, unit = plan_costs(profile, options, final_option)
    fixed_damage = sum(profile.options_of(c)[final_option] for c in fixed)
    fixed_bytes = sum(
        _base_plan(profile, {**dict.fromkeys(profile.layout.cells(), "bf16"), **fixed}).own_bytes_per_token(c)
        for c in fixed
    )
    budget = parse_damage(damage_budget, profile.kl_share)
    storage = parse_bytes(storage_budget)
    free_storage = None if storage is None else storage - fixed_bytes
    if free_storage is not None and free_storage < 0:
        raise ValueError(f"`storage_budget` ({storage} B) is below what the final loop alone stores ({fixed_bytes} B)")
    # whole-plan bounds (final loop included), so no message speaks of the knapsack's internal, free-cell budgets
    least_damage = fixed_damage + math.fsum(min(c.damage for c in row.values()) for row in costs.values())
    least_stored = fixed_bytes + sum(min(int(c.stored_bytes) for c in row.values()) for row in costs.values())
    if not budget >= least_damage:  # also NaN
        raise ValueError(
            f"`damage_budget` {damage_budget!r} = {budget:.3e} is below the least damage any plan over options "
            f"{list(options)} with a {final_option!r} final loop reaches ({least_damage:.3e}); choose at least that, "
            f"or add 'bf16' to the options"
        )
    if storage is not None and storage < least_stored:
        raise ValueError(
            f"`storage_budget` ({storage} B per token) is below the least any plan over options {list(options)} "
            f"stores ({least_stored} B per token); choose at least that"
        )
    try:
        solution: KnapsackSolution = solve_knapsack(costs, budget - fixed_damage, free_storage, unit=unit)
    except ValueError:
        raise ValueError(
            f"no plan meets both `damage_budget` ({budget:.3e}) and `storage_budget` ({storage} B per token): each is "
            f"reachable alone (least damage {least_damage:.3e}, least storage {least_stored} B), not both; relax one"
        ) from None
    return _finish(
        profile,
        fixed,
        fixed_damage,
        solution,
        options,
        final_option,
        {
            "objective": "minimise read bytes per token",
            "damage_budget": budget,
            "damage_budget_in_kl_share": budget / profile.kl_share if profile.kl_share else None,
            "storage_budget_bytes_per_token": storage,
            "model_id": model_id,
            "revision": revision,
        },
        profile_path,
    )


def plan_at_bytes(
    profile: CellProfile,
    *,
    storage_budget: int | str,
    read_budget: int | str,
    options: Sequence[str] = ("int4", "int2", "share"),
    final_option: str = "int4",
    profile_path: str | None = None,
) -> CachePlan:
    """The plan of least predicted damage that stores and reads at most the given bytes per token (used to compare
    the planner with a uniform or hand-made plan at equal bytes)."""
    costs, fixed, unit = plan_costs(profile, options, final_option)
    fixed_damage = sum(profile.options_of(c)[final_option] for c in fixed)
    probe = _base_plan(profile, {**dict.fromkeys(profile.layout.cells(), "bf16"), **fixed})
    fixed_bytes = sum(probe.own_bytes_per_token(c) for c in fixed)
    storage, reads = parse_bytes(storage_budget), parse_bytes(read_budget)
    frontier = pareto_frontier(costs, storage_budget=storage - fixed_bytes, unit=unit)  # type: ignore[operator]
    fitting = [s for s in frontier if s.read_bytes + fixed_bytes <= reads]  # type: ignore[operator]
    if not fitting:
        raise ValueError(f"no plan stores <= {storage} B and reads <= {reads} B per token under this profile")
    best = min(fitting, key=lambda s: s.damage)
    return _finish(
        profile,
        fixed,
        fixed_damage,
        best,
        options,
        final_option,
        {
            "objective": "minimise predicted damage at given bytes",
            "storage_budget_bytes_per_token": storage,
            "read_budget_bytes_per_token": reads,
        },
        profile_path,
    )


def _finish(
    profile: CellProfile,
    fixed: dict[Cell, str],
    fixed_damage: float,
    solution: KnapsackSolution,
    options: Sequence[str],
    final_option: str,
    extra: dict[str, Any],
    profile_path: str | None,
) -> CachePlan:
    choice = {**fixed, **{Cell.parse(name): option for name, option in solution.choice.items()}}
    plan = _base_plan(profile, choice)
    stored, read = plan.bytes_per_token()
    predicted = solution.damage + fixed_damage
    metadata: dict[str, Any] = {
        "planner": "loopkv-knapsack",
        **extra,
        "final_option": final_option,
        "options": list(options),
        "predicted_damage": predicted,
        "predicted_damage_in_kl_share": predicted / profile.kl_share if profile.kl_share else None,
        "bytes_per_token": {"stored": stored, "read": read},
        "profile": {"path": profile_path, "kl_share": profile.kl_share, **profile.settings},
    }
    return plan.with_metadata(**metadata)
