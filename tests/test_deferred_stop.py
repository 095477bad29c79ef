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

from hf_loopcache import FullLoopCache, RIPECache, _compat
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
}


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
@pytest.mark.parametrize("static", [False, True], ids=["growable", "captured"])
def test_deferred_on_cuda_equals_sequential(arch, static):
    """On CUDA the deferred check runs by itself (no stand-ins; a static cache replays its captured step): an
    end-of-sequence stop runs one step more, and the tokens and the cache left behind equal sequential decoding's."""
    model = make_model(arch).to("cuda", torch.float32)
    ids = _prompt().cuda()
    kw = dict(static=True, max_batch_size=2, max_cache_len=40) if static else {}
    eos = _eos_for(model, arch, ids, FullLoopCache(model, **kw))
    seq_cache, def_cache = FullLoopCache(model, **kw), FullLoopCache(model, **kw)
    expected, seq_steps = _generate(model, arch, ids, seq_cache, defer=False, eos=eos)
    got, def_steps = _generate(model, arch, ids, def_cache, defer=True, eos=eos)
    assert def_steps == seq_steps + 1 and torch.equal(got, expected)
    assert def_cache.get_seq_length() == seq_cache.get_seq_length() == expected.shape[1] - 1
    if static:
        assert def_cache.captured_steps()
    more_seq, _ = _generate(model, arch, expected, seq_cache, defer=False, new=5)
    more_def, _ = _generate(model, arch, got, def_cache, defer=False, new=5)
    assert torch.equal(more_def, more_seq)
