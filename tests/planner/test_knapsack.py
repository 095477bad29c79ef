"""Exactness and behaviour of the LoopKV multiple-choice knapsack (`hf_loopcache.planner.knapsack`)."""

from __future__ import annotations

import doctest
import itertools
import math
import re

import numpy as np
import pytest

from hf_loopcache.planner import knapsack
from hf_loopcache.planner.knapsack import (
    KnapsackSolution,
    OptionCost,
    pareto_frontier,
    solve_knapsack,
    uniform_solution,
)

UNIT = 512
OURO_OPTIONS = {"int4": (5, 5), "int2": (3, 3), "share": (0, 5)}  # (stored, read) units per token and layer


# ----------------------------------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------------------------------


def random_costs(
    rng: np.random.Generator, n_cells: int, n_options: int, max_units: int = 5, integer_damage: bool = False
) -> dict[str, dict[str, OptionCost]]:
    """Random table; integer damages (exact in float64) make exact ties frequent."""
    costs = {}
    for c in range(n_cells):
        options = {}
        for o in range(n_options):
            damage = float(rng.integers(0, 4)) if integer_damage else float(rng.exponential(1.0))
            options[f"opt{o}"] = OptionCost(
                damage=damage,
                stored_bytes=int(rng.integers(0, max_units + 1)) * UNIT,
                read_bytes=int(rng.integers(0, max_units + 1)) * UNIT,
            )
        costs[f"cell{c}"] = options
    return costs


def ouro_costs(rng: np.random.Generator, n_cells: int) -> dict[str, dict[str, OptionCost]]:
    """Ouro-like profile: INT4 cheap in damage, INT2 and sharing costlier and cell dependent."""
    costs = {}
    for c in range(n_cells):
        d4 = float(rng.exponential(0.01))
        d2 = d4 + float(rng.exponential(0.1))
        ds = float(rng.exponential(0.15))
        damages = {"int4": d4, "int2": d2, "share": ds}
        costs[f"loop{c // 24}.layer{c % 24}"] = {
            name: OptionCost(damage=damages[name], stored_bytes=s * UNIT, read_bytes=r * UNIT)
            for name, (s, r) in OURO_OPTIONS.items()
        }
    return costs


def brute_force(costs, damage_budget, storage_budget=None) -> KnapsackSolution | None:
    """Enumerate every plan; key = (reads, damage, stored, option indices in cell order) as the tie rule states."""
    cells = list(costs)
    names = [list(costs[c]) for c in cells]
    best_key, best_choice = None, None
    for idx in itertools.product(*(range(len(n)) for n in names)):
        chosen = [costs[c][names[k][j]] for k, (c, j) in enumerate(zip(cells, idx, strict=True))]
        damage = math.fsum(o.damage for o in chosen)
        stored = sum(o.stored_bytes for o in chosen)
        read = sum(o.read_bytes for o in chosen)
        if damage > damage_budget or (storage_budget is not None and stored > storage_budget):
            continue
        key = (read, damage, stored, idx)
        if best_key is None or key < best_key:
            best_key, best_choice = key, {c: names[k][j] for k, (c, j) in enumerate(zip(cells, idx, strict=True))}
    if best_key is None:
        return None
    return KnapsackSolution(choice=best_choice, damage=best_key[1], stored_bytes=best_key[2], read_bytes=best_key[0])


def check_totals(costs, sol: KnapsackSolution) -> None:
    chosen = [costs[c][o] for c, o in sol.choice.items()]
    assert list(sol.choice) == list(costs)
    assert sol.damage == math.fsum(o.damage for o in chosen)
    assert sol.stored_bytes == sum(o.stored_bytes for o in chosen)
    assert sol.read_bytes == sum(o.read_bytes for o in chosen)


# ----------------------------------------------------------------------------------------------------------------------
# exactness against brute force
# ----------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "seed, storage_bound",
    [
        pytest.param(seed, bound, id=f"seed{seed}-{'storage' if bound else 'nostorage'}")
        for seed in range(4)
        for bound in (False, True)
    ],
)
def test_matches_brute_force_real_damages(seed: int, storage_bound: bool):
    rng = np.random.default_rng(seed)
    costs = random_costs(rng, n_cells=6, n_options=3)
    min_damage = math.fsum(min(o.damage for o in opts.values()) for opts in costs.values())
    max_damage = math.fsum(max(o.damage for o in opts.values()) for opts in costs.values())
    max_stored = sum(max(o.stored_bytes for o in opts.values()) for opts in costs.values())
    n_feasible = 0
    for _ in range(25):
        eps = float(rng.uniform(0.8 * min_damage, 1.05 * max_damage))
        budget = int(rng.integers(0, max_stored + UNIT)) if storage_bound else None
        expected = brute_force(costs, eps, budget)
        if expected is None:
            with pytest.raises(ValueError, match="no plan"):
                solve_knapsack(costs, eps, budget)
            continue
        n_feasible += 1
        got = solve_knapsack(costs, eps, budget)
        check_totals(costs, got)
        assert got.choice == expected.choice, (eps, budget)
        assert got.read_bytes == expected.read_bytes
        assert got.damage <= eps and (budget is None or got.stored_bytes <= budget)
    assert n_feasible > 5


@pytest.mark.parametrize(
    "seed, n_options, storage_bound",
    [
        pytest.param(seed, k, bound, id=f"seed{seed}-K{k}-{'storage' if bound else 'nostorage'}")
        for seed, k in [(10, 2), (11, 3), (12, 4)]
        for bound in (False, True)
    ],
)
def test_matches_brute_force_with_exact_ties(seed: int, n_options: int, storage_bound: bool):
    """Integer damages and few byte values create many exactly tied plans: the full tie rule must match."""
    rng = np.random.default_rng(seed)
    costs = random_costs(rng, n_cells=5, n_options=n_options, max_units=2, integer_damage=True)
    max_stored = sum(max(o.stored_bytes for o in opts.values()) for opts in costs.values())
    for eps in np.arange(0.0, 16.0, 1.0):
        for budget in range(0, max_stored + UNIT, UNIT) if storage_bound else [None]:
            expected = brute_force(costs, float(eps), budget)
            if expected is None:
                with pytest.raises(ValueError, match="no plan"):
                    solve_knapsack(costs, float(eps), budget)
                continue
            got = solve_knapsack(costs, float(eps), budget)
            assert (got.choice, got.damage, got.stored_bytes, got.read_bytes) == (
                expected.choice,
                expected.damage,
                expected.stored_bytes,
                expected.read_bytes,
            ), (eps, budget)


def test_tie_prefers_earlier_option_and_earlier_cell():
    same = OptionCost(damage=1.0, stored_bytes=UNIT, read_bytes=UNIT)
    costs = {"a": {"x": same, "y": same}, "b": {"y": same, "x": same}}
    sol = solve_knapsack(costs, damage_budget=10.0)
    assert sol.choice == {"a": "x", "b": "y"}  # first option in each cell's given order

    # (p, q) and (q, p) tie on (read, damage, stored); (p, p) overflows storage and (q, q) the damage budget.
    # The earlier cell takes its earlier option and the later cell adapts.
    option_p, option_q = OptionCost(1.0, 2 * UNIT, UNIT), OptionCost(2.0, UNIT, 2 * UNIT)
    costs = {"a": {"p": option_p, "q": option_q}, "b": {"p": option_p, "q": option_q}}
    sol = solve_knapsack(costs, damage_budget=3.0, storage_budget=3 * UNIT)
    assert sol.choice == {"a": "p", "b": "q"}
    assert [solve_knapsack(costs, 3.0, 3 * UNIT).choice for _ in range(3)] == [sol.choice] * 3
    reordered = {"a": {"q": option_q, "p": option_p}, "b": {"p": option_p, "q": option_q}}
    assert solve_knapsack(reordered, 3.0, 3 * UNIT).choice == {"a": "q", "b": "p"}


def test_ties_on_reads_break_by_damage_then_stored():
    costs = {
        "a": {
            "more_damage": OptionCost(0.5, 0, UNIT),
            "more_stored": OptionCost(0.1, 3 * UNIT, UNIT),
            "best": OptionCost(0.1, UNIT, UNIT),
        }
    }
    assert solve_knapsack(costs, damage_budget=1.0).choice == {"a": "best"}


# ----------------------------------------------------------------------------------------------------------------------
# structure of the plans
# ----------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [pytest.param(s, id=f"seed{s}") for s in range(3)])
def test_read_optimized_never_picks_same_read_more_damage(seed: int):
    """Without a storage budget, an option that reads as much as another but does more damage is never chosen."""
    rng = np.random.default_rng(seed)
    costs = ouro_costs(rng, n_cells=24)
    for opts in costs.values():  # make sharing strictly worse than INT4 in every cell, as on Ouro
        opts["share"] = OptionCost(opts["int4"].damage + 0.01 + opts["share"].damage, 0, 5 * UNIT)
    lo = uniform_solution(costs, "int4").damage
    hi = uniform_solution(costs, "int2").damage
    for eps in np.linspace(lo, hi, 9):
        sol = solve_knapsack(costs, float(eps))
        assert sol.count("share") == 0
        for cell, option in sol.choice.items():
            mine = costs[cell][option]
            assert not any(
                other.read_bytes == mine.read_bytes and other.damage < mine.damage for other in costs[cell].values()
            ), (cell, option)
    # With a storage budget below INT4 + INT2 everywhere, sharing becomes necessary.
    tight = solve_knapsack(costs, hi + 10.0, storage_budget=24 * 2 * UNIT)
    assert tight.count("share") > 0 and tight.stored_bytes <= 24 * 2 * UNIT


def test_uniform_plans_are_feasible_at_their_own_damage():
    rng = np.random.default_rng(3)
    costs = ouro_costs(rng, n_cells=48)
    for option in OURO_OPTIONS:
        ref = uniform_solution(costs, option)
        sol = solve_knapsack(costs, ref.damage, storage_budget=ref.stored_bytes)
        assert sol.read_bytes <= ref.read_bytes
        assert sol.stored_bytes <= ref.stored_bytes
    int4 = uniform_solution(costs, "int4")
    assert int4.read_bytes == int4.stored_bytes == 48 * 5 * UNIT
    assert int4.choice == dict.fromkeys(costs, "int4")


# ----------------------------------------------------------------------------------------------------------------------
# Pareto frontier
# ----------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "seed, storage_bound",
    [pytest.param(s, b, id=f"seed{s}-{'storage' if b else 'nostorage'}") for s in range(3) for b in (False, True)],
)
def test_pareto_frontier_monotone_and_optimal(seed: int, storage_bound: bool):
    rng = np.random.default_rng(100 + seed)
    costs = random_costs(rng, n_cells=6, n_options=3)
    budget = sum(min(o.stored_bytes for o in opts.values()) for opts in costs.values()) + 4 * UNIT
    budget = budget if storage_bound else None
    frontier = pareto_frontier(costs, storage_budget=budget)
    assert frontier
    reads = [p.read_bytes for p in frontier]
    damages = [p.damage for p in frontier]
    assert all(a < b for a, b in itertools.pairwise(reads))
    assert all(a > b for a, b in itertools.pairwise(damages))
    for point in frontier:
        check_totals(costs, point)
        assert budget is None or point.stored_bytes <= budget
        assert solve_knapsack(costs, point.damage, storage_budget=budget) == point
        expected = brute_force(costs, point.damage, budget)
        assert expected is not None and expected.read_bytes == point.read_bytes
        assert math.isclose(expected.damage, point.damage, rel_tol=1e-12)

    # Brute force: every plan within storage is weakly dominated by a frontier point.
    names = [list(costs[c]) for c in costs]
    min_read, min_damage = math.inf, math.inf
    for choice in itertools.product(*names):
        chosen = [costs[c][o] for c, o in zip(costs, choice, strict=True)]
        if budget is not None and sum(o.stored_bytes for o in chosen) > budget:
            continue
        read, damage = sum(o.read_bytes for o in chosen), math.fsum(o.damage for o in chosen)
        min_read, min_damage = min(min_read, read), min(min_damage, damage)
        assert any(p.read_bytes <= read and p.damage <= damage * (1 + 1e-12) for p in frontier)
    # Ends of the frontier: the minimum-read plan first, the minimum-damage plan last.
    assert frontier[0].read_bytes == min_read
    assert frontier[-1].damage == pytest.approx(min_damage, rel=1e-12)


# ----------------------------------------------------------------------------------------------------------------------
# errors
# ----------------------------------------------------------------------------------------------------------------------


def test_infeasible_damage_error_reports_smallest_damage_and_storage():
    costs = {
        "a": {"int4": OptionCost(0.25, 5 * UNIT, 5 * UNIT), "share": OptionCost(1.0, 0, 5 * UNIT)},
        "b": {"int4": OptionCost(0.5, 5 * UNIT, 5 * UNIT), "int2": OptionCost(2.0, 3 * UNIT, 3 * UNIT)},
    }
    with pytest.raises(ValueError) as info:
        solve_knapsack(costs, damage_budget=0.5)
    msg = str(info.value)
    assert "`damage_budget`=0.5" in msg
    assert "smallest achievable damage is 0.75" in msg
    assert "smallest achievable storage is 1536 bytes" in msg

    with pytest.raises(ValueError) as info:
        solve_knapsack(costs, damage_budget=1.0, storage_budget=5 * UNIT)
    msg = str(info.value)
    assert "under `storage_budget`=2560 bytes" in msg
    assert "smallest achievable damage under `storage_budget`=2560 bytes is 1.5" in msg  # share a, int4 b
    assert "smallest achievable storage is 1536 bytes" in msg
    assert solve_knapsack(costs, damage_budget=1.5, storage_budget=5 * UNIT).choice == {"a": "share", "b": "int4"}


def test_infeasible_storage_error_reports_smallest_storage():
    costs = {"a": {"int4": OptionCost(0.1, 5 * UNIT, 5 * UNIT), "int2": OptionCost(0.3, 3 * UNIT, 3 * UNIT)}}
    for call in (lambda: solve_knapsack(costs, 1.0, storage_budget=UNIT), lambda: pareto_frontier(costs, UNIT)):
        with pytest.raises(
            ValueError,
            match=r"no plan fits `storage_budget`=512 bytes.*smallest achievable storage "
            r"is 1536 bytes",
        ):
            call()


@pytest.mark.parametrize("field", ["stored_bytes", "read_bytes"])
def test_non_multiple_of_unit_names_cell_and_option(field: str):
    bad = {"stored_bytes": 5 * UNIT, "read_bytes": 5 * UNIT, field: 5 * UNIT + 100}
    costs = {
        "loop0.layer0": {"int4": OptionCost(0.1, 5 * UNIT, 5 * UNIT)},
        "loop0.layer1": {"int4": OptionCost(0.1, 5 * UNIT, 5 * UNIT), "odd": OptionCost(0.2, **bad)},
    }
    pattern = re.escape(f"`costs['loop0.layer1']['odd'].{field}` must be a multiple of `unit`=512 bytes, got 2660")
    with pytest.raises(ValueError, match=pattern):
        solve_knapsack(costs, 1.0)
    with pytest.raises(ValueError, match=pattern):
        pareto_frontier(costs)
    assert solve_knapsack(costs, 1.0, unit=4).choice["loop0.layer1"] == "int4"  # fine on a finer unit


@pytest.mark.parametrize(
    "kwargs, pattern",
    [
        pytest.param({"damage_budget": -1.0}, "`damage_budget` must be a number >= 0", id="negative-damage-budget"),
        pytest.param({"damage_budget": math.nan}, "`damage_budget` must be a number >= 0", id="nan-damage-budget"),
        pytest.param({"storage_budget": -1}, "`storage_budget` must be None or an int >= 0", id="negative-storage"),
        pytest.param({"storage_budget": 1.5}, "`storage_budget` must be None or an int >= 0", id="float-storage"),
        pytest.param({"unit": 0}, "`unit` must be a positive int", id="zero-unit"),
    ],
)
def test_invalid_arguments(kwargs, pattern):
    costs = {"a": {"int4": OptionCost(0.1, 5 * UNIT, 5 * UNIT)}}
    call = {"costs": costs, "damage_budget": 1.0, **kwargs}
    with pytest.raises(ValueError, match=pattern):
        solve_knapsack(**call)


def test_invalid_costs():
    with pytest.raises(ValueError, match="`damage` must be a finite number >= 0, got -0.1"):
        OptionCost(-0.1, 0, 0)
    with pytest.raises(ValueError, match="`damage` must be a finite number >= 0, got inf"):
        OptionCost(math.inf, 0, 0)
    with pytest.raises(ValueError, match="`read_bytes` must be >= 0, got -512"):
        OptionCost(0.0, 0, -512)
    with pytest.raises(TypeError, match="`stored_bytes` must be an int"):
        OptionCost(0.0, 1.5, 0)
    with pytest.raises(ValueError, match="at least one cell"):
        solve_knapsack({}, 1.0)
    with pytest.raises(ValueError, match=r"`costs\['a'\]` must offer between 1 and 255 options, got 0"):
        solve_knapsack({"a": {}}, 1.0)
    with pytest.raises(TypeError, match=r"`costs\['a'\]\['x'\]` must be an OptionCost"):
        solve_knapsack({"a": {"x": (0.1, 512, 512)}}, 1.0)


def test_uniform_solution_missing_option():
    costs = {
        "a": {"int4": OptionCost(0.1, 5 * UNIT, 5 * UNIT), "share": OptionCost(0.2, 0, 5 * UNIT)},
        "b": {"int4": OptionCost(0.1, 5 * UNIT, 5 * UNIT)},
    }
    with pytest.raises(ValueError, match=r"`option`='share' is not offered by 1 cell\(s\) \('b'\).*\['int4'\]"):
        uniform_solution(costs, "share")
    assert uniform_solution(costs, "int4").damage == pytest.approx(0.2)


# ----------------------------------------------------------------------------------------------------------------------
# scale
# ----------------------------------------------------------------------------------------------------------------------


def test_ouro_scale_instance_solves():
    """96 cells x 3 options (Ouro-like bytes): both plans meet their budgets; no timing assertion."""
    rng = np.random.default_rng(7)
    costs = ouro_costs(rng, n_cells=96)
    int4 = uniform_solution(costs, "int4")
    eps = 2.0 * int4.damage + 0.5
    read_opt = solve_knapsack(costs, eps)
    assert read_opt.damage <= eps and read_opt.read_bytes < int4.read_bytes
    mem_opt = solve_knapsack(costs, eps, storage_budget=int(0.7 * int4.stored_bytes))
    assert mem_opt.damage <= eps and mem_opt.stored_bytes <= 0.7 * int4.stored_bytes
    assert mem_opt.read_bytes >= read_opt.read_bytes
    frontier = pareto_frontier(costs, storage_budget=int(0.7 * int4.stored_bytes))
    assert next(p for p in frontier if p.damage <= eps) == mem_opt


def test_bf16_option_with_gcd_units():
    """A BF16 option (16 units) next to INT4 / INT2 / share, and a coarser common step (all costs even units)."""
    rng = np.random.default_rng(8)
    costs = ouro_costs(rng, n_cells=12)
    for opts in costs.values():
        opts["bf16"] = OptionCost(0.0, 16 * UNIT, 16 * UNIT)
    sol = solve_knapsack(costs, damage_budget=0.0)
    assert sol.choice == dict.fromkeys(costs, "bf16")
    small = {c: costs[c] for c in list(costs)[:6]}
    even = {
        c: {o: OptionCost(v.damage, 2 * v.stored_bytes, 2 * v.read_bytes) for o, v in opts.items()}
        for c, opts in small.items()
    }
    n_feasible = 0
    for table, scale in ((small, 1), (even, 2)):
        for eps in (0.0, 0.05, 0.2, 0.6):
            for budget in (None, 0, 10 * scale * UNIT, 30 * scale * UNIT + UNIT, 61 * scale * UNIT):
                expected = brute_force(table, eps, storage_budget=budget)
                if expected is None:
                    with pytest.raises(ValueError, match="no plan"):
                        solve_knapsack(table, eps, storage_budget=budget)
                    continue
                n_feasible += 1
                assert solve_knapsack(table, eps, storage_budget=budget).choice == expected.choice, (eps, budget)
    assert n_feasible > 10


def test_docstring_examples():
    result = doctest.testmod(knapsack, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0
