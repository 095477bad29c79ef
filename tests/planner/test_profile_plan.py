"""Profiler and allocator on a tiny model: measured damages, resumption, plans within budgets, CLI round trip."""

from __future__ import annotations

import json

import pytest
import torch

from hf_loopcache import CachePlan, LoopKVCache
from hf_loopcache.cli import main as cli_main
from hf_loopcache.fidelity import measure_fidelity
from hf_loopcache.planner import (
    CellProfile,
    parse_bytes,
    parse_damage,
    plan_from_profile,
    predicted_damage,
    profile_cells,
)
from tests.helpers import make_model

STORAGE = dict(sink=4, window=8, page_size=8, group_size=16)


@pytest.fixture(scope="module")
def setup():
    model = make_model("ouro", hidden_size=64, num_attention_heads=4, num_key_value_heads=4)
    docs = [torch.randint(3, 60, (48,), generator=torch.Generator().manual_seed(i)) for i in range(2)]
    return model, docs


@pytest.fixture(scope="module")
def profile(setup, tmp_path_factory):
    model, docs = setup
    path = tmp_path_factory.mktemp("profile") / "profile.json"
    return profile_cells(model, docs, prefix=16, out_path=path, progress=False, **STORAGE), path


def test_profile_measures_every_cell_and_option(setup, profile):
    model, _ = setup
    prof, _ = profile
    layout = model.loop_layout
    for cell in layout.cells():
        expected = {"int4", "int2"} | ({"share"} if cell.loop < layout.final_loop else set())
        assert set(prof.damage[cell]) == expected
        assert all(v >= 0 for v in prof.damage[cell].values())
        assert prof.damage[cell]["int2"] > prof.damage[cell]["int4"]
    assert prof.kl_share > 0
    assert prof.settings["documents"] == 2 and prof.settings["sink"] == 4


def test_profile_damage_is_the_fidelity_of_a_single_cell_plan(setup, profile):
    model, docs = setup
    prof, _ = profile
    cell = model.loop_layout.cells()[3]
    plan = CachePlan.from_rule(model.loop_layout, lambda c: "int2" if c == cell else "bf16", **STORAGE)
    report = measure_fidelity(model, docs, plan, prefix=16, block=9)
    assert report.mean_kl == pytest.approx(prof.damage[cell]["int2"], rel=1e-6)


def test_profile_resumes_without_measuring_again(setup, profile, monkeypatch):
    model, docs = setup
    prof, path = profile
    calls = []
    import hf_loopcache.planner.profile as mod

    monkeypatch.setattr(mod, "replay_logits", lambda *a, **k: calls.append(1))
    again = profile_cells(model, docs, prefix=16, out_path=path, progress=False, **STORAGE)
    assert calls == [] and again.damage == prof.damage
    with pytest.raises(ValueError, match="other settings"):
        profile_cells(model, docs, prefix=16, out_path=path, progress=False, **{**STORAGE, "window": 4})
    assert CellProfile.load(path).to_dict() == prof.to_dict()
    # the same layout and documents with other weights (a retrained model) must not resume from these damages
    other = make_model("ouro", hidden_size=64, num_attention_heads=4, num_key_value_heads=4, seed=1)
    with pytest.raises(ValueError, match="other settings"):
        profile_cells(other, docs, prefix=16, out_path=path, progress=False, **STORAGE)


def test_read_and_memory_optimised_plans_respect_their_budgets(profile):
    prof, _ = profile
    read_opt = plan_from_profile(prof, damage_budget="1.5x")
    assert read_opt.metadata["predicted_damage"] <= 1.5 * prof.kl_share * (1 + 1e-9)
    assert read_opt.metadata["predicted_damage"] == pytest.approx(predicted_damage(prof, read_opt))
    stored, read = read_opt.bytes_per_token()
    tight = stored - 2 * read_opt.coded_bytes_per_token(4)
    mem_opt = plan_from_profile(prof, damage_budget="4x", storage_budget=tight)
    assert mem_opt.bytes_per_token()[0] <= tight
    assert mem_opt.counts()["share"] > 0
    assert {
        c: o for c, o in mem_opt.options.items() if c.loop == prof.layout.final_loop and c.stage == "core"
    } == dict.fromkeys(prof.layout.core_cells(prof.layout.final_loop), "int4")
    with pytest.raises(ValueError, match="damage"):
        plan_from_profile(prof, damage_budget=0.0)


def test_budget_parsing():
    assert parse_bytes("156KiB") == 156 * 1024 and parse_bytes(1000) == 1000 and parse_bytes("1.5MiB") == 1572864
    assert parse_damage("2x", 0.5) == 1.0 and parse_damage(3e-4, None) == 3e-4
    with pytest.raises(ValueError, match="storage_budget"):
        parse_bytes("lots")
    with pytest.raises(ValueError, match="KL_share"):
        parse_damage("2x", None)


def test_plan_cli_writes_a_loadable_plan(profile, tmp_path, setup):
    model, docs = setup
    _, path = profile
    assert cli_main(["plan", "--profile", str(path), "--damage-budget", "2x", "--out", str(tmp_path / "plan")]) == 0
    plan = CachePlan.from_pretrained(tmp_path / "plan")
    data = json.loads((tmp_path / "plan" / "loopcache_plan.json").read_text())
    assert data["metadata"]["planner"] == "loopkv-knapsack" and data["metadata"]["profile"]["documents"] == 2
    out = model.generate(
        docs[0][None, :20], cache=LoopKVCache(model, plan), max_new_tokens=5, do_sample=False, pad_token_id=0
    )
    assert out.shape[1] >= 21
