"""Self-speculative decoding over a static cache with captured drafts and verifications.

On CUDA every draft (one token, `d` loops) and verification (`gamma + 1` tokens, every loop) after the prefill replays
a CUDA graph per (batch, depth, block length) (`DecodeGraphs`); rows' holes are device-side key validity, written at the
commit (`LoopCache.write_key_valid`), and a draft's shared cells read their sources up to a device-side length. On the
CPU the same runner is driven with recording and replay stood in for (a replay reruns the step with every host length
frozen at its recording, as a CUDA graph replays kernels whose host arguments were fixed then), and the step is run
under a dispatch mode that raises on any host read of a device value. Greedy output equals sequential greedy decoding
(full cache; RIPE with `W >= gamma`) and the eager static run (deepest plane, approximate).
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hf_loopcache import DeepestPlaneCache, FullLoopCache, RIPECache, build_cache, self_speculative_generate
from hf_loopcache.cache.read import effective_positions
from tests.helpers import call_kwargs, host_state, make_model, stand_in_graphs

GAMMA = 3
CACHES = {
    "full": lambda model, **kw: FullLoopCache(model, **kw),
    "ripe3": lambda model, **kw: RIPECache(model, window=GAMMA, **kw),  # W = gamma: RIPE Proposition 1 holds
    "deepest": lambda model, **kw: DeepestPlaneCache(model, **kw),
}
EXACT = {"full", "ripe3"}

# LoopKV plans and RIPE with a sink: static coded cells (`StaticCodedLayer`, `StaticCodedSharedLayer`), W >= gamma
_CODED_OPTIONS = dict(group_size=8, window=4, sink=2, page_size=4)
CODED = {
    "kivi4": lambda model, **kw: build_cache(model, "loopkv:kivi4", **_CODED_OPTIONS, **kw),
    "kivi4-share": lambda model, **kw: build_cache(model, "loopkv:kivi4-share", **_CODED_OPTIONS, **kw),
    "hand": lambda model, **kw: build_cache(model, "loopkv:hand", **_CODED_OPTIONS, **kw),
    "ripe3-sink": lambda model, **kw: RIPECache(model, window=GAMMA, sink=2, **kw),
}
EVERY = {**CACHES, **CODED}


def _batch():
    ids = torch.tensor([[5, 9, 17, 33, 12, 8, 40, 7], [0, 0, 0, 21, 3, 44, 6, 50], [0, 11, 29, 4, 60, 13, 8, 31]])
    return ids, (ids != 0).long()


def _spec(model, arch, cache, ids, mask, new=12, block_size=GAMMA, **kw):
    return self_speculative_generate(
        model, ids, attention_mask=mask, cache=cache, draft_loops=model.loop_layout.num_loops - 1,
        block_size=block_size, max_new_tokens=new, eos_token_id=None, pad_token_id=0, **call_kwargs(arch), **kw,
    )


@torch.no_grad()
@pytest.mark.parametrize("name", sorted(CACHES))
@pytest.mark.parametrize("arch", ["ouro", "huginn"])
def test_captured_drafts_and_verifications_equal_sequential_greedy(monkeypatch, arch, name):
    """Left-padded batch of 3 whose rows accept different lengths: drafts and verifications replay their recordings
    (host lengths frozen), and the tokens equal sequential greedy decoding (exact caches) and the eager static run;
    a reset cache replays the same recordings again."""
    stand_in_graphs(monkeypatch)
    model = make_model(arch).float()
    ids, mask = _batch()
    sequential = _spec(model, arch, CACHES[name](model), ids, mask, block_size=0)  # `block_size` 0: plain greedy
    cache = CACHES[name](model, static=True, max_batch_size=3, max_cache_len=80)
    eager = _spec(model, arch, cache, ids, mask, disable_compile=True)
    eager_host = host_state(cache)
    assert not cache._graphs
    cache.reset()
    captured = _spec(model, arch, cache, ids, mask)
    # the recordings ran the host side of their steps once more: undone (ring bounds and floors as eager left them)
    assert host_state(cache) == eager_host
    kinds = {(key[0], key[1], dict(key[-1]).get(model.loop_kwarg)) for key in cache._graphs}
    draft, loops = model.loop_layout.num_loops - 1, model.loop_layout.num_loops
    assert (3, 1, draft) in kinds and (3, GAMMA + 1, None) in kinds  # drafts and full-depth verifications
    replays = sum(entry.graph.replays for entry in cache._graphs.values())
    assert replays > 10
    cache.reset()
    recorded = len(cache._graphs)
    again = _spec(model, arch, cache, ids, mask)
    assert len(cache._graphs) == recorded  # nothing recorded anew
    assert sum(entry.graph.replays for entry in cache._graphs.values()) > 2 * replays
    assert torch.equal(captured, eager) and torch.equal(again, eager)
    if name in EXACT:
        assert torch.equal(eager, sequential)
    assert loops > draft


@torch.no_grad()
@pytest.mark.parametrize("arch", ["ouro", "huginn"])
def test_static_sequential_decoding_through_the_captured_step(monkeypatch, arch):
    """`block_size=0` (the benchmarks' sequential baseline) over a static cache replays one captured one-token step."""
    stand_in_graphs(monkeypatch)
    model = make_model(arch).float()
    ids, mask = _batch()
    expected = _spec(model, arch, FullLoopCache(model), ids, mask, block_size=0)
    cache = FullLoopCache(model, static=True, max_batch_size=3, max_cache_len=40)
    assert torch.equal(_spec(model, arch, cache, ids, mask, block_size=0), expected)
    assert [(key[0], key[1]) for key in cache._graphs] == [(3, 1)]
    assert next(iter(cache._graphs.values())).graph.replays == 10  # 12 tokens: prefill, the recorded step, 10


class _NoHostSync(TorchDispatchMode):
    """Raises on any op that reads a device value on the host (`.item()`, `bool(t)`, `int(t)`, data-dependent
    shapes), which a CUDA graph cannot hold and which would stall the host on every step."""

    SYNCS = {"_local_scalar_dense", "is_nonzero", "item", "nonzero", "equal", "masked_select", "allclose", "unique"}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        bool_index = name == "index" and any(
            isinstance(t, torch.Tensor) and t.dtype == torch.bool for t in (args[1] if len(args) > 1 else [])
        )
        if name in self.SYNCS or bool_index:
            raise AssertionError(f"host sync in the captured step: aten.{name}")
        return func(*args, **(kwargs or {}))


@torch.no_grad()
@pytest.mark.parametrize("name", sorted(EVERY))
@pytest.mark.parametrize("arch", ["ouro", "huginn"])
def test_draft_and_verification_steps_read_no_device_value_on_the_host(monkeypatch, arch, name):
    """The forwards a captured self-speculative block runs (a draft step with `d` loops, a second draft step whose
    deep cells lag, a verification of `gamma + 1` tokens over rows with holes), as the static cache runs them after
    the prefill: no op reads a device value on the host (`.tolist()` is patched to raise as well), over every plan
    (static coded cells included: their boundaries in effective positions and their page flush are device values).
    The check fails if, e.g., a verification tests its mask on the host for the unmasked path."""
    model = make_model(arch).float()
    ids, mask = _batch()
    cache = EVERY[name](model, static=True, max_batch_size=3, max_cache_len=40)
    cache.set_max_rollback(GAMMA)
    kwargs = call_kwargs(arch)
    draft = model.draft_kwargs(model.loop_layout.num_loops - 1)
    model(input_ids=ids, attention_mask=mask, cache=cache, use_cache=True, logits_to_keep=1, **kwargs)
    n = cache.get_seq_length()
    model(input_ids=ids[:, :GAMMA + 1], cache=cache, use_cache=True, logits_to_keep=GAMMA + 1, **kwargs)
    cache.rollback(n + 2)
    cache.write_key_valid(n, torch.tensor([[True, True], [True, False], [True, False]]))  # holes
    token = ids[:, -1:]

    def tolist(self):
        raise AssertionError("host sync in the captured step: tolist")

    monkeypatch.setattr(torch.Tensor, "tolist", tolist)
    with _NoHostSync():
        model(input_ids=token, cache=cache, use_cache=True, logits_to_keep=1, **kwargs, **draft)
        model(input_ids=token, cache=cache, use_cache=True, logits_to_keep=1, **kwargs, **draft)
    monkeypatch.undo()
    cache.rollback(n + 2)
    monkeypatch.setattr(torch.Tensor, "tolist", tolist)
    new_columns = torch.ones(3, GAMMA + 1, dtype=torch.long)  # what the graph runner hands a block's forward
    with _NoHostSync():
        model(input_ids=ids[:, :GAMMA + 1], attention_mask=new_columns, cache=cache, use_cache=True,
              logits_to_keep=GAMMA + 1, **kwargs)
    monkeypatch.undo()
    cache.rollback(n + 2)
    monkeypatch.setattr(torch.Tensor, "tolist", tolist)
    with _NoHostSync():  # a verification block without a mask (a captured block's first call), after the holes
        model(input_ids=ids[:, :GAMMA + 1], cache=cache, use_cache=True, logits_to_keep=GAMMA + 1, **kwargs)


def test_the_no_host_sync_check_catches_a_host_read():
    """The mode above is a real check: the growable cache's forward tests its mask on the host (`bool(mask.all())`)."""
    model = make_model("ouro").float()
    ids, mask = _batch()
    cache = FullLoopCache(model)
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, cache=cache)
        with pytest.raises(AssertionError, match="host sync"), _NoHostSync():
            model(input_ids=ids[:, :2], attention_mask=torch.cat([mask, torch.ones(3, 2)], dim=1).long(), cache=cache)


def test_write_key_valid_needs_a_static_cache_that_ran():
    model = make_model("ouro").float()
    with pytest.raises(ValueError, match="write_key_valid"):
        FullLoopCache(model, static=True, max_batch_size=1, max_cache_len=8).write_key_valid(0, torch.ones(1, 1).bool())


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(CACHES))
@pytest.mark.parametrize("arch", ["ouro", "huginn"])
def test_captured_self_speculation_equals_eager_cuda(arch, name):
    """On CUDA (fp32): self-speculation replaying captured drafts and verifications gives the eager static run's
    tokens, which equal sequential greedy decoding for the exact caches; a reset cache replays without recapturing."""
    model = make_model(arch).float().cuda()
    ids, mask = (t.cuda() for t in _batch())
    cache = CACHES[name](model, static=True, max_batch_size=3, max_cache_len=80)
    eager = _spec(model, arch, cache, ids, mask, disable_compile=True)
    cache.reset()
    captured = _spec(model, arch, cache, ids, mask)
    steps = cache.captured_steps()
    assert {(s["batch"], s["tokens"]) for s in steps} >= {(3, 1), (3, GAMMA + 1)}
    cache.reset()
    again = _spec(model, arch, cache, ids, mask)
    assert len(cache.captured_steps()) == len(steps)
    assert torch.equal(captured, eager) and torch.equal(again, eager)
    if name in EXACT:
        assert torch.equal(eager, _spec(model, arch, CACHES[name](model), ids, mask, block_size=0))



@torch.no_grad()
@pytest.mark.parametrize("arch", ["ouro", "huginn"])
def test_a_replayed_draft_advances_only_the_cells_it_writes(monkeypatch, arch):
    """After replayed draft steps the cache reports what an eager draft leaves: planes `< d` hold the draft positions,
    planes `>= d` do not (`loop_lengths`), so `rollback` and the next verification see the state they expect."""
    stand_in_graphs(monkeypatch)
    model = make_model(arch).float()
    ids, mask = _batch()
    d = model.loop_layout.num_loops - 1
    runner = model.get_compiled_call(None)
    cache = FullLoopCache(model, static=True, max_batch_size=3, max_cache_len=40)
    kwargs = {**call_kwargs(arch), **model.draft_kwargs(d)}
    runner(input_ids=ids, attention_mask=mask, cache=cache, use_cache=True, logits_to_keep=1, **call_kwargs(arch))
    n = cache.get_seq_length()
    for _ in range(3):  # the first is recorded, the others replay it
        runner(input_ids=ids[:, -1:], cache=cache, use_cache=True, logits_to_keep=1, **kwargs)
    assert next(iter(cache._graphs.values())).graph.replays == 2
    assert cache.loop_lengths() == [n + 3] * d + [n] * (model.loop_layout.num_loops - d)
    assert cache.get_seq_length() == n + 3


@torch.no_grad()
def test_a_static_rollback_costs_a_few_device_ops_not_one_per_ring():
    """Self-speculation rolls the cache back twice a block; a static RIPE cache's shared cells read their rings from
    the device-side length (a crop within the rollback reserve moves no ring bound), so a rollback fills a few
    scalars, not one per ring (Huginn-0125's shape: 124 rings, 250 launches a block)."""
    model = make_model("huginn", mean_recurrence=8).float()
    ids, mask = _batch()
    cache = RIPECache(model, window=GAMMA, static=True, max_batch_size=3, max_cache_len=64)
    cache.set_max_rollback(GAMMA)
    rings = sum(1 for layer in cache.cells if type(layer).__name__ == "StaticCodedSharedLayer")
    model(input_ids=ids, attention_mask=mask, cache=cache, **call_kwargs("huginn"))
    for _ in range(3):
        model(input_ids=ids[:, :GAMMA + 1], cache=cache, **call_kwargs("huginn"))
    fills = []
    fill, zero = torch.Tensor.fill_, torch.Tensor.zero_
    torch.Tensor.fill_ = lambda self, *a: (fills.append(1), fill(self, *a))[1]
    torch.Tensor.zero_ = lambda self: (fills.append(1), zero(self))[1]
    try:
        cache.rollback(cache.get_seq_length() - 2)
    finally:
        torch.Tensor.fill_, torch.Tensor.zero_ = fill, zero
    assert rings > 10 and len(fills) <= 3, (rings, len(fills))


def test_the_plain_function_decodes_without_autograd(monkeypatch):
    """`self_speculative_generate` runs its forwards under `no_grad` as `generate` does (the benchmarks call it: with
    autograd on, every op of every forward was recorded, and a captured step would record it too)."""
    model = make_model("ouro").float()
    seen = []
    forward = type(model).forward

    def spy(self, *args, **kwargs):
        seen.append(torch.is_grad_enabled())
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(type(model), "forward", spy)
    ids, mask = _batch()
    _spec(model, "ouro", FullLoopCache(model), ids, mask, new=4)
    assert seen and not any(seen)


def _holes(cache) -> bool:
    """Whether the static cache's key validity holds a hole (a padded position after a row's first real token)."""
    return effective_positions(cache._valid_t[: cache.batch_size, : cache.get_seq_length()]) is not None


@torch.no_grad()
@pytest.mark.parametrize("name", sorted(CODED))
@pytest.mark.parametrize("arch", ["ouro", "huginn"])
def test_batched_self_speculation_over_static_coded_cells_equals_growable_fp64(monkeypatch, arch, name):
    """A left-padded batch of 3 whose rows accept different lengths (holes) over static coded cells: eager drafts and
    verifications, and the same replayed from their recordings (host lengths frozen), give exactly the growable
    cache's tokens (whose cells count boundaries in effective positions); a reset cache replays without recording."""
    stand_in_graphs(monkeypatch)
    model = make_model(arch).double()
    ids, mask = _batch()
    growable = _spec(model, arch, CODED[name](model), ids, mask, new=16)
    cache = CODED[name](model, static=True, max_batch_size=3, max_cache_len=80)
    eager = _spec(model, arch, cache, ids, mask, new=16, disable_compile=True)
    assert _holes(cache) and not cache._graphs
    cache.reset()
    captured = _spec(model, arch, cache, ids, mask, new=16)
    kinds = {(key[0], key[1]) for key in cache._graphs}
    assert (3, 1) in kinds and (3, GAMMA + 1) in kinds
    replays = sum(entry.graph.replays for entry in cache._graphs.values())
    assert replays > 10
    cache.reset()
    again = _spec(model, arch, cache, ids, mask, new=16)
    assert sum(entry.graph.replays for entry in cache._graphs.values()) > 2 * replays
    assert torch.equal(eager, growable)
    assert torch.equal(captured, growable) and torch.equal(again, growable)


@torch.no_grad()
def test_many_holes_need_several_pages_coded_per_forward_and_a_larger_ring():
    """A long run with dense holes (batch 4, gamma 4, one draft loop of three, 40 tokens): a row's boundary, counted in
    its effective positions, then moves over several storage pages in one forward, and a row's window spans up to
    `gamma + 1` storage positions per real token. With the ring and the pages per forward sized for that
    (`coded_ring_capacity`, `flush_pages`) the static cache gives the growable cache's tokens; one page a forward, or
    the ring sized without holes, does not."""
    from hf_loopcache.cache.layers.static_coded import coded_ring_capacity, flush_pages

    model = make_model("ouro", seed=0).double()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 64, (4, 9), generator=g)
    mask = torch.ones_like(ids)
    mask[-1, :3] = 0
    ids[-1, :3] = 0
    kw = dict(attention_mask=mask, draft_loops=1, block_size=4, max_new_tokens=40, eos_token_id=None, pad_token_id=0)
    growable = self_speculative_generate(model, ids, cache=CODED["kivi4"](model), **kw)
    cache = CODED["kivi4"](model, static=True, max_batch_size=4, max_cache_len=250)
    assert torch.equal(self_speculative_generate(model, ids, cache=cache, disable_compile=True, **kw), growable)
    assert _holes(cache)
    coded = [layer for layer in cache.cells if hasattr(layer, "qk")]
    assert coded and all(layer.capacity == coded_ring_capacity(4, 4, 4) for layer in coded)
    assert flush_pages(4, 4) > 1 and flush_pages(4, 0) == 1


@torch.no_grad()
@pytest.mark.parametrize("name", ["kivi4-share", "hand", "ripe3-sink"])
@pytest.mark.parametrize("fixture", ["tiny-ouro", "tiny-huginn"])
def test_batched_self_speculation_over_static_coded_cells_on_trained_fixtures_fp32(monkeypatch, fixture, name):
    """The shipped (trained) fixtures, fp32, real text, a left-padded batch of three: captured (replayed) drafts and
    verifications over static coded cells give the growable cache's tokens, with holes in the rows."""
    from hf_loopcache import load_fixture

    stand_in_graphs(monkeypatch)
    model, tok = load_fixture(fixture)
    model = model.float()
    # Huginn at 4 recurrent steps (a call-time loop count; the caches are built for it) to keep the test short
    kwargs, loops = ({"init_scale": 0.0, "num_steps": 4}, {"num_loops": 4}) if fixture == "tiny-huginn" else ({}, {})
    tok.padding_side = "left"
    enc = tok(["The capital of the old kingdom was", "Once upon a time", "In the"], return_tensors="pt", padding=True)
    ids, mask = enc["input_ids"], enc["attention_mask"]
    options = dict(max_new_tokens=16, draft_loops=2, block_size=GAMMA, eos_token_id=None, pad_token_id=0, **kwargs)
    growable = self_speculative_generate(model, ids, attention_mask=mask, cache=CODED[name](model, **loops), **options)
    cache = CODED[name](model, static=True, max_batch_size=3, max_cache_len=ids.shape[1] + 32, **loops)
    captured = self_speculative_generate(model, ids, attention_mask=mask, cache=cache, **options)
    assert cache._graphs and _holes(cache)
    assert torch.equal(captured, growable)


class _CountHostReads(TorchDispatchMode):
    """Counts the ops that read a device value on the host (as `_NoHostSync` names them)."""

    def __init__(self):
        super().__init__()
        self.reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in _NoHostSync.SYNCS:
            self.reads += 1
        return func(*args, **(kwargs or {}))


@torch.no_grad()
@pytest.mark.parametrize("arch", ["ouro", "huginn"])
def test_the_decoder_reads_the_device_once_per_verification(monkeypatch, arch):
    """Over a static cache with captured drafts and verifications (batch 3, forced acceptance, rows accepting
    different lengths), the decoding loop reads device values on the host once per verification (the accepted
    lengths and tokens in one `.tolist()`): the difference between a longer and a shorter run is one read per extra
    verification. A `SpeculativeStats(phase_timing=False)` adds one device sync per call (after the loop), none per
    block; with phase timing every phase syncs."""
    import importlib

    from hf_loopcache import SpeculativeStats

    strategy = importlib.import_module("hf_loopcache.generation.self_speculative")  # the module, not the function

    stand_in_graphs(monkeypatch)
    model = make_model(arch).float()
    model.generation_config.eos_token_id = None
    ids, mask = _batch()
    cache = FullLoopCache(model, static=True, max_batch_size=3, max_cache_len=120)
    reads = {"n": 0}
    tolist = torch.Tensor.tolist

    def counted_tolist(self):
        reads["n"] += 1
        return tolist(self)

    def run(new, stats=None):
        cache.reset()
        gen = torch.Generator().manual_seed(0)
        return _spec(model, arch, cache, ids, mask, new=new, forced_acceptance=0.6, generator=gen,
                     speculative_stats=stats)

    run(24)  # records every step
    counts = {}
    for new in (8, 24):
        stats = SpeculativeStats()
        run(new, stats)
        monkeypatch.setattr(torch.Tensor, "tolist", counted_tolist)
        reads["n"] = 0
        with _CountHostReads() as mode:
            run(new)
        monkeypatch.undo()
        stand_in_graphs(monkeypatch)
        counts[new] = (stats.verifications, reads["n"] + mode.reads)
    (v_short, r_short), (v_long, r_long) = counts[8], counts[24]
    assert v_long > v_short + 3
    assert r_long - r_short == v_long - v_short

    syncs = {"n": 0}
    monkeypatch.setattr(strategy, "_sync", lambda device: syncs.__setitem__("n", syncs["n"] + 1))
    stats = SpeculativeStats(phase_timing=False)
    run(24, stats)
    assert syncs["n"] == 1 and stats.decode_time_s > 0 and stats.prefill_time_s == 0.0
    assert stats.row_tokens == [24, 24, 24]
    assert sum(stats.row_accepted) == stats.accepted_tokens and sum(stats.row_reached) == sum(stats.reached)
    assert len(set(stats.row_accepted)) > 1  # the rows accepted different lengths
    syncs["n"] = 0
    run(24, SpeculativeStats())
    assert syncs["n"] == 1 + 2 + 4 * stats.verifications  # prefill, drafts and verifications, and the end


@torch.no_grad()
def test_a_block_outside_a_decode_does_not_replay_its_verification(monkeypatch):
    """A captured step is keyed by the cache's read mode (`LoopCache.speculating`): after a self-speculative decode
    has recorded its verification (a default LoopKV cache reads it at both planes), a block of the same shape run
    through the captured-step runner outside a decode is recorded anew and reads with V precision per row, as the
    eager forward does."""
    stand_in_graphs(monkeypatch)
    model = make_model("ouro").float()
    ids, mask = _batch()
    block = ids[:, : GAMMA + 1]

    def build(**options):
        options = dict(static=True, max_batch_size=3, max_cache_len=80, tau=1.0, **options)
        cache = build_cache(model, "loopkv:kivi4-share", **_CODED_OPTIONS, **options)
        model(input_ids=ids, attention_mask=mask, cache=cache, use_cache=True)  # the prefill
        return cache

    def logits(cache, call):
        return call(input_ids=block, attention_mask=None, use_cache=True, logits_to_keep=GAMMA + 1, cache=cache).logits

    rows = logits(build(), model)  # eager: V precision per row
    both = logits(build(v_precision_blocks=False), model)
    assert (rows - both).abs().max() > 1e-4
    cache = build()
    cache.reset()
    _spec(model, "ouro", cache, ids, mask)  # records its drafts and verifications
    recorded = len(cache._graphs)
    cache.reset()
    model(input_ids=ids, attention_mask=mask, cache=cache, use_cache=True)
    got = logits(cache, model.get_compiled_call(None))
    assert len(cache._graphs) == recorded + 1
    torch.testing.assert_close(got, rows)


def _auto_captured(model, arch, name, ids, mask):
    cache = CACHES[name](model, static=True, max_batch_size=3, max_cache_len=120)
    options = dict(block_size="auto", max_block_size=GAMMA, draft_cost_ratio=0.05, new=20)
    eager = _spec(model, arch, cache, ids, mask, disable_compile=True, **options)
    cache.reset()
    captured = _spec(model, arch, cache, ids, mask, **options)
    lengths = {key[1] for key in cache._graphs}
    return eager, captured, lengths, cache.max_rollback


@torch.no_grad()
@pytest.mark.parametrize("name", ["full", "ripe3"])
def test_auto_block_sizes_replay_a_recording_per_block_length(monkeypatch, name):
    """`block_size="auto"` over a static cache (left-padded batch of 3): each block length the rule takes is a
    recording of its own (one-token drafts and steps, and verifications of 2 .. max + 1 tokens), the rollback reserve
    is the largest block, and the tokens equal sequential greedy decoding (RIPE's window is the largest block)."""
    stand_in_graphs(monkeypatch)
    model = make_model("ouro").float()
    ids, mask = _batch()
    eager, captured, lengths, reserve = _auto_captured(model, "ouro", name, ids, mask)
    assert torch.equal(captured, eager)
    assert torch.equal(eager, _spec(model, "ouro", CACHES[name](model), ids, mask, block_size=0, new=20))
    assert reserve == GAMMA and 1 in lengths and len(lengths - {1}) >= 2 and max(lengths) <= GAMMA + 1


@pytest.mark.gpu
@torch.no_grad()
@pytest.mark.parametrize("name", ["full", "ripe3"])
def test_auto_block_sizes_captured_on_cuda(name):
    """The same on CUDA (fp32), every step a CUDA graph."""
    model = make_model("ouro").float().cuda()
    ids, mask = (t.cuda() for t in _batch())
    eager, captured, lengths, reserve = _auto_captured(model, "ouro", name, ids, mask)
    assert torch.equal(captured, eager)
    assert torch.equal(eager, _spec(model, "ouro", CACHES[name](model), ids, mask, block_size=0, new=20))
    assert reserve == GAMMA and len(lengths - {1}) >= 2


@torch.no_grad()
@pytest.mark.parametrize("name", sorted(CODED))
@pytest.mark.parametrize("arch", ["ouro", "huginn"])
def test_one_row_sizes_its_rings_without_holes(monkeypatch, arch, name):
    """A cache of one row never holds a hole (a verification keeps exactly what its one row accepted), so its rings
    and the pages it codes per forward are sized for one storage position per real token (`hole_span`): a long run
    at block size 4 with a window of 4 and pages of 4 (the boundary crosses pages every forward), eager and replayed,
    gives the growable cache's tokens with rings 2.7-2.8x smaller than a batch's here."""
    from hf_loopcache.cache.layers.static import ring_capacity
    from hf_loopcache.cache.layers.static_coded import coded_ring_capacity, flush_pages

    stand_in_graphs(monkeypatch)
    model = make_model(arch).double()
    ids = torch.tensor([[5, 9, 17, 33, 12, 8, 40, 7, 3]])
    kw = dict(draft_loops=model.loop_layout.num_loops - 1, block_size=4, max_new_tokens=48, eos_token_id=None,
              pad_token_id=0, **call_kwargs(arch))  # fmt: skip
    growable = self_speculative_generate(model, ids, cache=CODED[name](model), **kw)
    cache = CODED[name](model, static=True, max_batch_size=1, max_cache_len=80)
    assert torch.equal(self_speculative_generate(model, ids, cache=cache, disable_compile=True, **kw), growable)
    cache.reset()
    assert torch.equal(self_speculative_generate(model, ids, cache=cache, **kw), growable)
    assert cache._graphs
    rings = {layer.capacity for layer in cache.cells if hasattr(layer, "holes")}
    window, page = (GAMMA, 1) if name == "ripe3-sink" else (4, 4)
    coded = coded_ring_capacity(window, page, 4, holes=False)
    shared = ring_capacity(window, page, 4, holes=False)
    assert rings and rings <= {coded, shared} and not any(layer.holes for layer in cache.cells if hasattr(layer, "holes"))
    assert coded_ring_capacity(4, 4, 4) / coded_ring_capacity(4, 4, 4, holes=False) > 2.6
    assert ring_capacity(3, 1, 4) / ring_capacity(3, 1, 4, holes=False) > 2.7
    assert flush_pages(4, 4, holes=False) < flush_pages(4, 4)
