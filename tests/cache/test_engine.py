"""The engine: plans, memory accounting (RIPE Eq. 3 and 10, Table 2), RIPE semantics, Proposition 1, crop."""

from __future__ import annotations

import json

import pytest
import torch

from hf_loopcache import CachePlan, Cell, DeepestPlaneCache, FullLoopCache, LoopCache, LoopLayout, RIPECache
from tests.helpers import call_kwargs, make_model, teacher_forced_logprob
from tests.test_layout import HUGINN, RAVEN_LLAMA

TINY = LoopLayout(n_core=2, num_loops=3, num_kv_heads=2, head_dim=32, n_prelude=1, n_coda=1, name="tiny")


# ------------------------------------------------------------------------------------------------ plans
@pytest.mark.parametrize(
    "options, match",
    [
        ({Cell("core", 2, 0): "share"}, "cannot `share`"),
        ({Cell("prelude", 0, 0): "share"}, "cannot `share`"),
        ({Cell("core", 0, 1): "fp8"}, "must be one of"),
    ],
)
def test_plan_rejects_bad_options(options, match):
    base = dict.fromkeys(TINY.cells(), "bf16")
    with pytest.raises(ValueError, match=match):
        CachePlan(TINY, {**base, **options})


def test_plan_rejects_missing_cells_and_bad_sizes():
    with pytest.raises(ValueError, match="every cell"):
        CachePlan(TINY, {Cell("core", 0, 0): "bf16"})
    with pytest.raises(ValueError, match="window"):
        CachePlan.uniform(TINY, "bf16", window=-1)
    with pytest.raises(ValueError, match="page_size"):
        CachePlan.uniform(TINY, "bf16", page_size=0)
    with pytest.raises(ValueError, match="group_size"):
        CachePlan.uniform(TINY, "int4", group_size=24)


def test_plan_json_round_trip(tmp_path):
    plan = CachePlan.from_rule(
        TINY,
        lambda c: (
            "share" if c.stage == "core" and c.loop == 1 else ("int2" if c.stage == "core" and c.loop == 0 else "int4")
        ),
        sink=4,
        window=8,
        page_size=32,
        metadata={"model": "tiny"},
    )
    assert CachePlan.from_json(plan.to_json()) == plan
    path = plan.save_pretrained(tmp_path / "plan")
    assert CachePlan.from_pretrained(tmp_path / "plan") == plan
    assert CachePlan.from_pretrained(path) == plan
    data = json.loads(plan.to_json())
    assert data["cells"]["loop1.layer0"] == "share" and data["schema_version"] == 1
    with pytest.raises(ValueError, match="schema_version"):
        CachePlan.from_dict({**data, "schema_version": 99})


def test_plan_from_unreachable_hub_is_a_clear_error(monkeypatch):
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    with pytest.raises(OSError, match="is not a local path, and the Hugging Face Hub cannot be reached"):
        CachePlan.from_pretrained("nobody/does-not-exist-plan")


# -------------------------------------------------------------------------------------- memory accounting
def _fill(cache: LoopCache, layout: LoopLayout, length: int, dtype=torch.bfloat16) -> None:
    """Write `length` positions into every cell through the plain `update` path, in the order a model would."""
    k = torch.zeros(1, layout.num_kv_heads, length, layout.head_dim, dtype=dtype)
    for cell in layout.cells():
        cache.update(k, k, layout.slot(cell))


@pytest.mark.parametrize(
    "layout, window, fraction",
    [
        pytest.param(HUGINN, 64, 0.119, id="huginn-W64"),
        pytest.param(HUGINN, 0, 0.061, id="huginn-deepest"),
        pytest.param(RAVEN_LLAMA, 64, 0.128, id="raven-W64"),
        pytest.param(RAVEN_LLAMA, 0, 0.070, id="raven-deepest"),
    ],
)
def test_ripe_memory_equals_eq10_at_1024(layout, window, fraction):
    cache = RIPECache(layout, window=window)
    _fill(cache, layout, 1024)
    expected = layout.ripe_bytes(1024, window)
    assert cache.stored_bytes() == expected == cache.nbytes() == cache.plan.expected_stored_bytes(1024)
    assert round(cache.stored_bytes() / layout.full_bytes(1024), 3) == fraction


def test_full_cache_memory_equals_eq3():
    cache = FullLoopCache(TINY)
    _fill(cache, TINY, 100)
    assert cache.stored_bytes() == cache.nbytes() == TINY.full_bytes(100)


@pytest.mark.parametrize("plan_name", ["ripe", "coded"])
def test_stored_bytes_follow_the_plan_while_decoding(plan_name):
    layout = TINY
    if plan_name == "ripe":
        plan = CachePlan.ripe(layout, window=5, sink=2)
    else:
        plan = CachePlan.from_rule(
            layout,
            lambda c: "share" if c.stage == "core" and c.loop == 0 else "int4",
            sink=3,
            window=7,
            page_size=4,
            group_size=16,
        )
    cache = LoopCache(layout, plan)
    _fill(cache, layout, 9)
    for length in range(10, 40):
        _fill(cache, layout, 1)
        assert cache.get_seq_length() == length
        assert cache.stored_bytes() == plan.expected_stored_bytes(length)


def test_plain_update_returns_the_same_length_for_every_cell():
    cache = RIPECache(TINY, window=3)
    k = torch.randn(1, 2, 6, 32)
    lengths = {cache.update(k, k, TINY.slot(c))[0].shape[2] for c in TINY.cells()}
    assert lengths == {6}
    k1 = torch.randn(1, 2, 1, 32)
    lengths = {cache.update(k1, k1, TINY.slot(c))[0].shape[2] for c in TINY.cells()}
    assert lengths == {7}


# ------------------------------------------------------------------------------------------ RIPE semantics
def _prompt(length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 60, (1, length), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def test_ripe_with_a_window_covering_everything_equals_the_full_cache(arch):
    model = make_model(arch)
    ids = torch.tensor([[5, 9, 17, 33, 12, 8, 40]])
    kw = dict(
        max_new_tokens=8,
        do_sample=False,
        pad_token_id=0,
        output_logits=True,
        return_dict_in_generate=True,
        **call_kwargs(arch),
    )
    ripe = model.generate(ids, cache=RIPECache(model, window=64), **kw)
    full = model.generate(ids, **kw)
    assert torch.equal(ripe.sequences, full.sequences)
    for a, b in zip(ripe.logits, full.logits):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_deepest_plane_cells_read_the_final_loop(arch):
    """W=0: after a prefill, every shared cell reads exactly the final loop's keys and values of its layer."""
    model = make_model(arch)
    cache = DeepestPlaneCache(model)
    model(_prompt(12), cache=cache, use_cache=True, **call_kwargs(arch))
    layout = model.loop_layout
    for cell in layout.core_cells():
        k, v = cache.cell_states(cell)
        k_src, v_src = cache.cell_states(layout.source_cell(cell))
        assert torch.equal(k, k_src) and torch.equal(v, v_src)
    assert cache.stored_bytes() == layout.deepest_plane_bytes(12) * 2  # fp32 model: 4 bytes per element, not 2


@torch.no_grad()
@pytest.mark.parametrize("window, gamma", [(4, 4), (6, 3), (3, 1)])
def test_proposition1_block_verification_equals_sequential_decoding(arch, window, gamma):
    """RIPE Proposition 1, fp64: with W >= gamma, one pass over gamma + 1 tokens gives the logits and cached keys and
    values of decoding them one at a time."""
    model = make_model(arch).double()
    ids = _prompt(20 + gamma + 1, seed=3)
    kw = call_kwargs(arch)
    sequential, block = RIPECache(model, window=window), RIPECache(model, window=window)
    model(ids[:, :20], cache=sequential, use_cache=True, **kw)
    model(ids[:, :20], cache=block, use_cache=True, **kw)
    one_by_one = torch.cat(
        [
            model(ids[:, t : t + 1], cache=sequential, use_cache=True, **kw).logits
            for t in range(20, 21 + gamma)
        ],
        1,
    )
    at_once = model(ids[:, 20 : 21 + gamma], cache=block, use_cache=True, **kw).logits
    torch.testing.assert_close(at_once, one_by_one, atol=1e-10, rtol=1e-10)
    for cell in model.loop_layout.cells():
        for a, b in zip(block.cell_states(cell), sequential.cell_states(cell)):
            torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)


@torch.no_grad()
def test_deepest_plane_breaks_block_independence(arch):
    """W = 0 violates the premise: the block's outputs differ from sequential decoding (fp64, so not rounding)."""
    model = make_model(arch).double()
    ids = _prompt(24, seed=4)
    kw = call_kwargs(arch)
    sequential, block = DeepestPlaneCache(model), DeepestPlaneCache(model)
    model(ids[:, :20], cache=sequential, use_cache=True, **kw)
    model(ids[:, :20], cache=block, use_cache=True, **kw)
    one_by_one = torch.cat(
        [model(ids[:, t : t + 1], cache=sequential, use_cache=True, **kw).logits for t in range(20, 24)], 1
    )
    at_once = model(ids[:, 20:24], cache=block, use_cache=True, **kw).logits
    torch.testing.assert_close(at_once[:, :1], one_by_one[:, :1], atol=1e-10, rtol=1e-10)  # the first token agrees
    assert (at_once[:, 1:] - one_by_one[:, 1:]).abs().max() > 1e-6  # later ones depend on where the block starts


@torch.no_grad()
def test_crop_within_the_rollback_reserve_is_exact(arch):
    model = make_model(arch).double()
    ids = _prompt(30, seed=5)
    kw = call_kwargs(arch)
    spec = RIPECache(model, window=2, max_rollback=4)
    model(ids[:, :20], cache=spec, use_cache=True, **kw)
    model(ids[:, 20:24], cache=spec, use_cache=True, **kw)  # a rejected block of 4 ...
    spec.crop(-4)  # ... rolled back
    seq = RIPECache(model, window=2)
    model(ids[:, :20], cache=seq, use_cache=True, **kw)
    for t in range(20, 26):
        a = model(ids[:, t : t + 1], cache=spec, use_cache=True, **kw).logits
        b = model(ids[:, t : t + 1], cache=seq, use_cache=True, **kw).logits
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)


@torch.no_grad()
def test_padding_is_never_read_by_ripe(arch):
    model = make_model(arch)
    ids = torch.tensor([[0, 0, 0, 5, 9, 17, 33, 12, 8, 40, 7, 7, 9]])
    mask = (ids != 0).long()
    kw = dict(
        attention_mask=mask,
        max_new_tokens=6,
        do_sample=False,
        pad_token_id=0,
        output_logits=True,
        return_dict_in_generate=True,
        **call_kwargs(arch),
    )
    a = model.generate(ids, cache=RIPECache(model, window=2), **kw)
    other = ids.clone()
    other[0, :3] = torch.tensor([44, 45, 46])  # different tokens under the padding mask
    b = model.generate(other, cache=RIPECache(model, window=2), **kw)
    assert torch.equal(a.sequences[:, 13:], b.sequences[:, 13:])
    for x, y in zip(a.logits, b.logits):
        torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_beam_search_and_reorder_with_ripe(arch):
    model = make_model(arch)
    ids = torch.tensor([[5, 9, 17, 33, 12]])
    kw = dict(max_new_tokens=5, do_sample=False, num_beams=3, pad_token_id=0, **call_kwargs(arch))
    wide = model.generate(ids, cache=RIPECache(model, window=32), **kw)
    assert torch.equal(wide, model.generate(ids, **kw))
    narrow = model.generate(
        ids,
        cache=RIPECache(model, window=1),
        min_new_tokens=5,
        length_penalty=0.0,
        output_scores=True,
        return_dict_in_generate=True,
        **kw,
    )
    assert narrow.sequences.shape == wide.shape
    # the best beam's score is its log-probability under a fresh cache fed its tokens: the reordered rows followed it
    expected = teacher_forced_logprob(
        model, narrow.sequences[:1], ids.shape[1], RIPECache(model, window=1), **call_kwargs(arch)
    )
    assert float(narrow.sequences_scores[0]) == pytest.approx(expected, abs=1e-4)
