"""The profiler scores a shared cell against its source *as coded* (LoopKV Proposition 2: `delta_c = Q(x_s) - x_c`),
and a profile scored the old way (against the exact source, schema version 1) is refused, not reused."""

from __future__ import annotations

import json

import pytest
import torch

from hf_loopcache import CachePlan, Cell
from hf_loopcache.fidelity import measure_fidelity
from hf_loopcache.planner import CellProfile, plan_from_profile, profile_cells
from tests.helpers import make_model

STORAGE = dict(sink=4, window=8, page_size=8, group_size=16)


@pytest.fixture(scope="module")
def setup():
    torch.set_num_threads(1)
    model = make_model("ouro", hidden_size=64, num_attention_heads=4, num_key_value_heads=4)
    docs = [torch.randint(3, 60, (48,), generator=torch.Generator().manual_seed(10 + i)) for i in range(2)]
    return model, docs


@pytest.fixture(scope="module")
def share_profile(setup, tmp_path_factory):
    model, docs = setup
    path = tmp_path_factory.mktemp("share") / "profile.json"
    return profile_cells(model, docs, options=("share",), prefix=16, out_path=path, progress=False, **STORAGE), path


def _plan(layout, rule):
    return CachePlan.from_rule(layout, rule, **STORAGE)


@pytest.mark.parametrize("cell", [Cell("core", 0, 1), Cell("core", 1, 0)], ids=["loop0-layer1", "loop1-layer0"])
def test_share_damage_is_what_sharing_adds_to_the_int4_source(setup, share_profile, cell):
    """d(c, share) = KL(c reads the INT4-coded final loop, which is INT4 itself) - KL(final loop INT4 alone), each
    measured here with the fidelity harness; scoring against the exact source gives another number."""
    model, docs = setup
    prof, _ = share_profile
    layout = model.loop_layout
    source = layout.source_cell(cell)
    coded = measure_fidelity(
        model, docs, _plan(layout, lambda c: {cell: "share", source: "int4"}.get(c, "bf16")), prefix=16, block=9
    )
    alone = measure_fidelity(
        model, docs, _plan(layout, lambda c: "int4" if c == source else "bf16"), prefix=16, block=9
    )
    exact = measure_fidelity(model, docs, _plan(layout, lambda c: "share" if c == cell else "bf16"), prefix=16, block=9)
    assert prof.settings["share_source"] == "int4"
    assert prof.damage[source]["int4"] == pytest.approx(alone.mean_kl, rel=1e-6)  # the baseline, kept in the profile
    assert prof.damage[cell]["share"] == pytest.approx(max(0.0, coded.mean_kl - alone.mean_kl), rel=1e-6, abs=1e-12)
    # the case tells the two scorings apart
    assert abs(exact.mean_kl - prof.damage[cell]["share"]) > 1e-3 * exact.mean_kl


def test_bf16_share_source_scores_against_the_exact_source(setup):
    model, docs = setup
    prof = profile_cells(model, docs[:1], options=("share",), share_source="bf16", prefix=16, progress=False, **STORAGE)
    cell = Cell("core", 1, 1)
    exact = measure_fidelity(
        model, docs[:1], _plan(model.loop_layout, lambda c: "share" if c == cell else "bf16"), prefix=16, block=9
    )
    assert prof.damage[cell]["share"] == pytest.approx(exact.mean_kl, rel=1e-6)
    with pytest.raises(ValueError, match="final_option"):
        plan_from_profile(prof, damage_budget=1.0)  # final loop INT4, profile scored against BF16
    with pytest.raises(ValueError, match="share_source"):
        profile_cells(model, docs, share_source="int8", progress=False, **STORAGE)


def test_a_version_1_profile_is_refused(share_profile, tmp_path, setup):
    model, docs = setup
    prof, path = share_profile
    old = {**prof.to_dict(), "schema_version": 1}
    with pytest.raises(ValueError, match=r"schema_version.*2.*got 1.*exact source"):
        CellProfile.from_dict(old)
    stale = tmp_path / "old.json"
    stale.write_text(json.dumps(old))
    with pytest.raises(ValueError, match="got 1"):  # the resumable profiler does not reuse it either
        profile_cells(model, docs, options=("share",), prefix=16, out_path=stale, progress=False, **STORAGE)
    with pytest.raises(ValueError, match="final_option"):
        plan_from_profile(prof, damage_budget=1.0, final_option="int2")
