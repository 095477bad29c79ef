"""`generate` reading its stop flag one step late with a looped-model cache (transformers' `DeferredStopCheck`,
enabled by `_compat.deferred_stop_check` on CUDA where the cache can take the extra step back exactly).

On the CPU the check runs with `torch.Event` stood in (the CPU has no events; its ops finish before they return), so
the same code path is exercised: the extra step after an end-of-sequence stop runs, its token is dropped and the cache
is cropped by one position. What `generate` returns, and the cache it leaves (read back by decoding on from it), must
equal sequential decoding; a cache whose crop would not be exact is never deferred.
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache, LogitsProcessor, LogitsProcessorList
from transformers.generation.utils import DeferredStopCheck

from hf_loopcache import DeepestPlaneCache, FullLoopCache, LoopKVCache, RIPECache, _compat
from hf_loopcache.cache.layers import StaticCodedLayer, StaticCodedSharedLayer
from hf_loopcache.cache.plan import loopkv_preset
from hf_loopcache.models._common import _NonFiniteLogits
from tests.helpers import call_kwargs, make_model, stand_in_graphs

CUDA = torch.device("cuda")  # a device object only: `is_supported` reads its type


class _Event:
    """`torch.Event` on the CPU, where every op has finished when it returns."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def record(self, *args, **kwargs) -> None:
        pass

    def synchronize(self) -> None:
        pass


@pytest.fixture
def cpu_defers(monkeypatch):
    monkeypatch.setattr(_compat, "_DEFER_DEVICES", frozenset({"cuda", "cpu"}))
    monkeypatch.setattr(torch, "Event", _Event)


class _Steps(LogitsProcessor):
    """Counts the forwards whose scores `generate` processed (kept or not)."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, input_ids, scores):
        self.calls += 1
        return scores


CACHES = {
    "full": lambda model, **kw: FullLoopCache(model, **kw),
    "full-static": lambda model, **kw: FullLoopCache(model, static=True, max_batch_size=2, max_cache_len=40, **kw),
    "ripe3-rollback1": lambda model, **kw: RIPECache(model, window=3, max_rollback=1, **kw),
    "ripe3-static-rollback1": lambda model, **kw: RIPECache(
        model, window=3, max_rollback=1, static=True, max_batch_size=2, max_cache_len=40, **kw
    ),
    # no reserve: a static RIPE / deepest-plane cache takes one step back exactly (its ring holds it)
    "ripe3-static": lambda model, **kw: RIPECache(model, window=3, static=True, max_batch_size=2, max_cache_len=40,
                                                  **kw),
    "deepest-static": lambda model, **kw: DeepestPlaneCache(model, static=True, max_batch_size=2, max_cache_len=40,
                                                            **kw),
    # and LoopKV plans (coded cells: their ring of W + 2P also keeps the page the next step codes again)
    "kivi4-share-static": lambda model, **kw: _loopkv_static(model, "kivi4-share", **kw),
    "kivi4-static": lambda model, **kw: _loopkv_static(model, "kivi4", **kw),
}


def _loopkv_static(model, name, **kw):
    """A static LoopKV cache whose small sink, window and pages (2, 4, 4) cross several boundaries in a short run."""
    plan = loopkv_preset(model.loop_layout, name, sink=2, window=4, page_size=4, group_size=8)
    return LoopKVCache(model, plan, tau=1.0, static=True, max_batch_size=2, max_cache_len=40, **kw)


def _prompt(batch: int = 2, length: int = 9) -> torch.Tensor:
    return torch.randint(3, 64, (batch, length), generator=torch.Generator().manual_seed(1))


def _generate(model, arch, ids, cache, *, defer, new=12, eos=None):
    steps = _Steps()
    kw = dict(max_new_tokens=new, do_sample=False, pad_token_id=0, **call_kwargs(arch))
    if eos is not None:
        kw["eos_token_id"] = eos
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), cache=cache, defer_stop=defer,
        logits_processor=LogitsProcessorList([steps]), **kw,
    )
    return out, steps.calls


def _eos_for(model, arch, ids, cache, stop_at: int = 4) -> list[int]:
    """End-of-sequence tokens that end greedy decoding through `cache` at generated step `stop_at` at the latest in
    every row: each row's token at that step."""
    out, _ = _generate(model, arch, ids, cache, defer=False)
    return sorted(set(out[:, ids.shape[1] + stop_at].tolist()))


@pytest.mark.parametrize("name", sorted(CACHES))
def test_end_of_sequence_stop_deferred_equals_sequential(arch, name, cpu_defers, monkeypatch):
    stand_in_graphs(monkeypatch)
    model = make_model(arch).float()
    ids = _prompt()
    eos = _eos_for(model, arch, ids, CACHES[name](model))
    seq_cache, def_cache = CACHES[name](model), CACHES[name](model)
    expected, seq_steps = _generate(model, arch, ids, seq_cache, defer=False, eos=eos)
    got, def_steps = _generate(model, arch, ids, def_cache, defer=True, eos=eos)
    assert expected.shape[1] < ids.shape[1] + 12  # it stopped at the end-of-sequence token, before the length
    assert def_steps == seq_steps + 1  # one step ran past the stop and was taken back
    assert torch.equal(got, expected)
    assert def_cache.get_seq_length() == seq_cache.get_seq_length() == expected.shape[1] - 1
    # the cache each left behind decodes on to the same tokens (positions, windows and pages as sequential left them)
    more_seq, _ = _generate(model, arch, expected, seq_cache, defer=False, new=5)
    more_def, _ = _generate(model, arch, got, def_cache, defer=False, new=5)
    assert torch.equal(more_def, more_seq)


def test_length_stop_runs_no_extra_step(arch, cpu_defers):
    model = make_model(arch).float()
    ids = _prompt()
    cache = FullLoopCache(model)
    out, steps = _generate(model, arch, ids, cache, defer=True, new=7)
    assert steps == 7 and out.shape[1] == ids.shape[1] + 7
    assert cache.get_seq_length() == ids.shape[1] + 6


def test_not_deferred_where_the_crop_is_not_exact(cpu_defers):
    """RIPE with no rollback drops a position's shallow planes when it leaves the window: one step past the stop could
    not be taken back exactly, so a cache handed back is not deferred (no extra step)."""
    model = make_model("ouro").float()
    ids = _prompt()
    eos = _eos_for(model, "ouro", ids, RIPECache(model, window=3))
    cache = RIPECache(model, window=3)
    assert not cache.exact_crop(1) and RIPECache(model, window=3, max_rollback=1).exact_crop(1)
    _, seq_steps = _generate(model, "ouro", ids, RIPECache(model, window=3), defer=False, eos=eos)
    _, steps = _generate(model, "ouro", ids, cache, defer=True, eos=eos)
    assert steps == seq_steps


def _exact_crop_cases(model):
    """Caches of every kind of windowed cell, with and without a rollback reserve (small windows and pages, so a short
    decode crosses several boundaries)."""
    static = dict(static=True, max_batch_size=2, max_cache_len=40)

    def loopkv(name, **kw):
        plan = loopkv_preset(model.loop_layout, name, sink=2, window=4, page_size=4, group_size=8)
        return lambda: LoopKVCache(model, plan, tau=1.0, **kw)

    return {
        "ripe1-static": lambda: RIPECache(model, window=1, **static),
        "ripe3-static": lambda: RIPECache(model, window=3, **static),
        "deepest-static": lambda: DeepestPlaneCache(model, **static),
        "ripe3": lambda: RIPECache(model, window=3),
        "deepest": lambda: DeepestPlaneCache(model),
        "ripe3-static-rollback1": lambda: RIPECache(model, window=3, max_rollback=1, **static),
        "kivi4-static": loopkv("kivi4", **static),
        "kivi4-share-static": loopkv("kivi4-share", **static),
        "hand-static": loopkv("hand", **static),
        "kivi4-share-static-rollback1": loopkv("kivi4-share", max_rollback=1, **static),
    }


def _decode_on(model, kw, cache, ids, mask, tokens, n, cut):
    """Logits of the 5 steps after `tokens[:, n]`, decoded one at a time into `cache` after the prompt `ids` and `n +
    cut` tokens of which the last `cut` were cropped again."""
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, cache=cache, **kw)
        for i in range(n + cut):
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
            model(input_ids=tokens[:, i : i + 1], attention_mask=mask, cache=cache, **kw)
        if cut:
            cache.crop(-cut)
            mask = mask[:, :-cut]
        out = []
        for i in range(n, n + 5):
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
            out.append(model(input_ids=tokens[:, i : i + 1], attention_mask=mask, cache=cache, **kw).logits)
    return torch.cat(out, 1)


@pytest.mark.parametrize("arch", ["ouro", "huginn"])
def test_exact_crop_is_exact_where_it_says_so(arch):
    """Wherever `exact_crop(k)` says a crop of `k` positions right after a forward is exact (`k` = 1, 2), it is: a cache
    that decoded `n + k` tokens and was cropped by `k` decodes on with the same logits, to the last bit in fp64, as
    one that decoded `n` (a left-padded row; `n` across several windows, pages and flushes). And it says so where that is what makes
    `generate` defer its stop check: every static cache without a reserve (RIPE, the deepest plane and LoopKV plans:
    their rings hold the position, and a coded cell's ring of `W + 2P` also the page the next step codes again from
    it), any cache within its reserve; not a growable window without one (it drops the position's planes, or codes
    them, which the sweep shows when the claim is forced)."""
    model = make_model(arch, **({"hidden_size": 64} if arch == "ouro" else {"n_embd": 64})).double()
    kw = call_kwargs(arch)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 64, (2, 6), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    tokens = torch.randint(3, 64, (2, 24), generator=g)
    claims, cells = {}, {}
    for name, make in _exact_crop_cases(model).items():
        cache = make()
        for cut in (1, 2):
            claims[name, cut] = cache.exact_crop(cut)
        for cell in cache.cells:  # shared cells: LoopKV's pages of 4 need the reserve
            if isinstance(cell, StaticCodedSharedLayer):
                cells.setdefault((name, type(cell.source).__name__), set()).add(cell.exact_crop(1))
        for cut in (c for c in (1, 2) if claims[name, c]):
            for n in range(1, 12):
                exact = _decode_on(model, kw, make(), ids, mask, tokens, n, 0)
                assert torch.equal(exact, _decode_on(model, kw, make(), ids, mask, tokens, n, cut)), (name, cut, n)
    assert {name for (name, cut), claim in claims.items() if claim and cut == 1} == {
        "ripe1-static", "ripe3-static", "deepest-static", "ripe3-static-rollback1", "kivi4-static",
        "kivi4-share-static", "hand-static", "kivi4-share-static-rollback1",
    }  # fmt: skip
    assert {name for (name, cut), claim in claims.items() if claim and cut == 2} == {
        "ripe3-static", "deepest-static", "ripe3-static-rollback1", "kivi4-share-static-rollback1",
    }  # fmt: skip
    assert cells == {  # shared cells: a cut of 1 (2 for RIPE(3)'s ring of W + 2 and LoopKV's of W + P + 1)
        ("ripe1-static", "StaticDenseLayer"): {True}, ("ripe3-static", "StaticDenseLayer"): {True},
        ("deepest-static", "StaticDenseLayer"): {True}, ("ripe3-static-rollback1", "StaticDenseLayer"): {True},
        ("kivi4-share-static", "StaticCodedLayer"): {True}, ("hand-static", "StaticCodedLayer"): {True},
        ("kivi4-share-static-rollback1", "StaticCodedLayer"): {True},
    }  # fmt: skip
    for name, make in _exact_crop_cases(model).items():  # a coded cell's ring of W + 2P keeps one position
        coded = [cell for cell in make().cells if isinstance(cell, StaticCodedLayer)]
        assert all(cell.exact_crop(1) and cell.exact_crop(2) == ("rollback1" in name) for cell in coded), name


def test_which_caches_defer():
    model = make_model("ouro").float()
    full, ripe = FullLoopCache(model), RIPECache(model, window=3)
    supported = DeferredStopCheck.is_supported
    with _compat.deferred_stop_check(True):
        assert supported(CUDA, full, True, False)
        assert not supported(CUDA, full, True, True)  # an assistant model's loop: transformers' choice
        assert not supported(torch.device("cpu"), full, True, False)
        assert not supported(CUDA, ripe, True, False)  # handed back and not exactly croppable
        assert supported(CUDA, ripe, False, False)  # not handed back: nothing to crop
        assert not supported(CUDA, DynamicCache(), True, False)  # not ours: transformers' choice (mps only)
    with _compat.deferred_stop_check(False):
        assert not supported(CUDA, full, True, False)
    assert not supported(CUDA, full, True, False)  # outside a looped model's `generate`


def test_defer_stop_must_be_a_bool():
    model = make_model("ouro").float()
    with pytest.raises(ValueError, match="`defer_stop` must be True or False, got 'yes'"):
        model.generate(_prompt(), max_new_tokens=2, pad_token_id=0, defer_stop="yes")


def test_non_finite_check_judges_the_kept_steps_only():
    monitor = _NonFiniteLogits()
    for value in (0.0, 1.0, float("nan")):
        monitor(None, torch.full((1, 4), value))
    assert monitor.first_bad(2) == -1 and monitor.first_bad() == 2
    monitor.check(2)
    with pytest.raises(FloatingPointError, match="step 2 of 3"):
        monitor.check()


@pytest.mark.gpu
@pytest.mark.parametrize(
    "static,kind",
    [(False, "full"), (True, "full"), (True, "ripe3"), (True, "kivi4-share")],
    ids=["growable", "captured", "captured-ripe3", "captured-kivi4-share"],
)
def test_deferred_on_cuda_equals_sequential(arch, static, kind):
    """On CUDA the deferred check runs by itself (no stand-ins; a static cache replays its captured step): an
    end-of-sequence stop runs one step more, and the tokens and the cache left behind equal sequential decoding's
    (static RIPE and LoopKV caches without a rollback reserve too: their rings take the step back; LoopKV's at head
    dim 128, which the coded-attention kernel reads, with pages of 16 and a prompt after which the step past a stop at
    the fourth token codes a page)."""
    wide = {"hidden_size": 256, "num_attention_heads": 2, "num_key_value_heads": 2} if arch == "ouro" else {
        "n_embd": 256, "n_heads": 2}  # fmt: skip
    model = make_model(arch, **(wide if kind == "kivi4-share" else {})).to("cuda", torch.float32)
    ids = _prompt(length=33 if kind == "kivi4-share" else 9).cuda()
    kw = dict(static=True, max_batch_size=2, max_cache_len=64) if static else {}

    def make():
        if kind == "kivi4-share":
            plan = loopkv_preset(model.loop_layout, kind, sink=2, window=4, page_size=16, group_size=32)
            return LoopKVCache(model, plan, tau=14.0, **kw)
        return FullLoopCache(model, **kw) if kind == "full" else RIPECache(model, window=3, **kw)

    eos = _eos_for(model, arch, ids, make())
    seq_cache, def_cache = make(), make()
    expected, seq_steps = _generate(model, arch, ids, seq_cache, defer=False, eos=eos)
    got, def_steps = _generate(model, arch, ids, def_cache, defer=True, eos=eos)
    assert def_steps == seq_steps + 1 and torch.equal(got, expected)
    assert def_cache.get_seq_length() == seq_cache.get_seq_length() == expected.shape[1] - 1
    if static:
        assert def_cache.captured_steps()
    more_seq, _ = _generate(model, arch, expected, seq_cache, defer=False, new=5)
    more_def, _ = _generate(model, arch, got, def_cache, defer=False, new=5)
    assert torch.equal(more_def, more_seq)
