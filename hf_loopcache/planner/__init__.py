"""LoopKV planning: per-cell damage profile, exact knapsack, and plans as data (`CachePlan`)."""

from hf_loopcache.planner.allocate import (
    parse_bytes,
    parse_damage,
    plan_at_bytes,
    plan_costs,
    plan_from_profile,
    predicted_damage,
)
from hf_loopcache.planner.knapsack import (
    KnapsackSolution,
    OptionCost,
    pareto_frontier,
    solve_knapsack,
    uniform_solution,
)
from hf_loopcache.planner.profile import CellProfile, profile_cells

__all__ = [
    "CellProfile",
    "KnapsackSolution",
    "OptionCost",
    "pareto_frontier",
    "parse_bytes",
    "parse_damage",
    "plan_at_bytes",
    "plan_costs",
    "plan_from_profile",
    "predicted_damage",
    "profile_cells",
    "solve_knapsack",
    "uniform_solution",
]
