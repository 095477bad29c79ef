"""A static coded cell codes each history page once, in the forward where it becomes due (`flush_page`'s `coded`
slots), a complete forward flushes every coded cell in one launch (`FlushGroup`, `flush_page_table`), and the cache
decodes exactly as when every forward re-codes every cell's `K` pages cell by cell (the flush before): the same logits
and every byte a reader reads, across page flushes, a left-padded batch, a crop into coded pages (whose pages must be
coded again) and a new prefill after `reset`. Two seeded faults show that the comparison catches a page that became
due and was skipped: slots that claim the next page before it is coded, and a crop that forgets no slot.

The reference flush runs here (CPU); `test_static_flush_kernel.py` holds the kernel to it byte for byte, slots
included, and `test_selfspec_graphs.py` runs self-speculation (drafts, rollbacks, holes) over the slots.
"""

from __future__ import annotations

import pytest
import torch

from hf_loopcache.cache.layers import StaticCodedLayer, static_coded
from hf_loopcache.cache.layers.static_coded import FlushGroup
from tests.cache.test_static_loopkv import _cache, _model, _prompt
from tests.helpers import call_kwargs
from triton_ops.quant import naive


def _readable(cache) -> list[torch.Tensor]:
    """Every coded byte a reader reads (the scratch page and the slots left out), rings and lengths."""
    out = []
    for cell in cache.cells:
        if isinstance(cell, StaticCodedLayer) and cell.qk is not None:
            keys, values = cell._codes(cell.num_pages)
            out += [keys.codes, keys.scale, keys.zero, values.hi, values.scale, values.zero]
            out += [] if values.lo is None else [values.lo]
        for name in ("k", "v", "sink_k", "sink_v", "floor_t"):
            if getattr(cell, name, None) is not None:
                out.append(getattr(cell, name))
    return [t.clone() for t in out]


SCENARIOS = {  # (tokens decoded before the crop, positions cropped, rollback reserve)
    "deep-crop": (8, 9, 0),  # 17 -> 8: below the window start, the straddling page restored from its codes
    "shallow-crop": (6, 7, 3),  # 15 -> 8: within the ring, into the coded page [6, 10)
}


def _run(monkeypatch, name, *, slots=True, fault=None, scenario="deep-crop"):
    """Prefill a left-padded batch of 2 (9 tokens; sink 2, window 4, pages of 4), decode, crop into a coded page,
    decode 8 more, reset, prefill again and decode 5: the logits of every forward, the readable state after each
    phase, and the pages coded (one count per row, head and plane that a flush coded)."""
    first, crop, rollback = SCENARIOS[scenario]
    model = _model("ouro")
    kwargs = call_kwargs("ouro")
    ids, mask = _prompt(2, True)
    cache = _cache(model, name, static=True, max_batch_size=2, max_cache_len=40)
    if rollback:
        cache.set_max_rollback(rollback)
    coded: list[int] = []  # per decode forward: slots that changed (row, head, plane codings), over every cell
    cells = [c for c in cache.cells if isinstance(c, StaticCodedLayer)]

    def forward(**inputs):
        before = [None if c.coded_t is None else c.coded_t.clone() for c in cells]
        out = model(**inputs, cache=cache, **kwargs).logits
        if slots:
            coded.append(sum(int((c.coded_t != b).sum()) for c, b in zip(cells, before) if b is not None))
        if fault == "claim-next":  # the slot of the page after the last coded one claims it before it is coded
            for c in cells:
                if c.coded_t is not None:
                    nxt = c.coded_t.amax() + 1
                    c.coded_t[..., int(nxt) % c.coded_t.shape[-1]] = nxt.to(torch.int32)
        return out

    with monkeypatch.context() as m:
        if not slots:  # the flush before the slots and the table: every due page, one launch per cell
            m.setattr(StaticCodedLayer, "_coded_slots", lambda self: None)
            m.setattr(FlushGroup, "flush", lambda self, cell, read, positions: False)
        calls = {"table": 0, "cell": 0}
        table_fn, cell_fn = static_coded.flush_page_table, static_coded.flush_page
        m.setattr(static_coded, "flush_page_table", lambda *a, **k: calls.__setitem__("table", calls["table"] + 1)
                  or table_fn(*a, **k))  # fmt: skip
        m.setattr(static_coded, "flush_page", lambda *a, **k: calls.__setitem__("cell", calls["cell"] + 1)
                  or cell_fn(*a, **k))  # fmt: skip
        if fault == "keep-on-crop":
            m.setattr(StaticCodedLayer, "_coded_reach", lambda self, high: 0)  # a crop never forgets
        logits, states = [], []
        with torch.no_grad():

            def decode(tokens, start):
                nonlocal mask
                for i in range(tokens):
                    mask = torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], 1)
                    token = torch.full((2, 1), 5 + (start + 3 * i) % 50)
                    logits.append(forward(input_ids=token, attention_mask=mask))

            forward(input_ids=ids, attention_mask=mask)
            coded.clear()  # the prefill forgets every slot
            decode(first, 0)
            if slots:  # a decode step (complete) flushes every coded cell in one launch
                assert calls == {"table": first, "cell": 0}
            else:
                assert calls == {"table": 0, "cell": first * len(cells)}
            states.append(_readable(cache))
            cache.crop(-crop)
            deep = [c.floor > c.sink for c in cache.cells if isinstance(c, StaticCodedLayer)]
            assert deep and all(deep) == (scenario == "deep-crop") and any(deep) == all(deep)
            mask = mask[:, :-crop]
            decode(8, 7)
            states.append(_readable(cache))
            cache.reset()
            ids2, mask = _prompt(2, True, length=11, seed=1)
            model(input_ids=ids2, attention_mask=mask, cache=cache, **kwargs)
            coded.append(0)
            decode(5, 11)
            states.append(_readable(cache))
    return logits, states, coded


def _assert_same(got, want):
    (logits, states, _), (ref_logits, ref_states, _) = got, want
    assert len(logits) == len(ref_logits)
    for a, b in zip(logits, ref_logits):
        assert torch.equal(a, b)
    for phase, ref_phase in zip(states, ref_states):
        for a, b in zip(phase, ref_phase):
            assert torch.equal(a.view(torch.uint8) if a.is_floating_point() else a,
                               b.view(torch.uint8) if b.is_floating_point() else b)  # fmt: skip


@pytest.mark.parametrize("scenario", list(SCENARIOS))
@pytest.mark.parametrize("name", ["kivi4", "kivi4-share"])
def test_pages_coded_once_decode_as_recoding_every_forward(monkeypatch, name, scenario):
    got = _run(monkeypatch, name, scenario=scenario)
    _assert_same(got, _run(monkeypatch, name, slots=False, scenario=scenario))
    coded = got[2]
    assert sum(1 for c in coded if c) < len(coded) / 2  # most forwards code nothing (a page every 4 steps)
    assert max(coded) > 0


@pytest.mark.parametrize("scenario", list(SCENARIOS))
@pytest.mark.parametrize("fault", ["claim-next", "keep-on-crop"])
def test_a_skipped_due_page_is_caught(monkeypatch, fault, scenario):
    """Seeded faults: a slot claiming a page before it is coded, a crop into coded pages that forgets no slot. The
    comparison above must fail on each."""
    want = _run(monkeypatch, "kivi4", slots=False, scenario=scenario)
    with pytest.raises(AssertionError):
        _assert_same(_run(monkeypatch, "kivi4", fault=fault, scenario=scenario), want)


def test_flush_slots_reference_codes_only_new_pages():
    """`naive.flush_page` with `coded`: a due page is written where its slot does not hold it, and its slot then
    does; a page whose slot holds it is not written again; a page that is not due leaves the slots alone."""
    from triton_ops.quant import QuantizedKeys, QuantizedValues

    torch.manual_seed(0)
    ring = torch.randn(1, 2, 40, 64)
    z = lambda *s, dt=torch.uint8: torch.zeros(*s, dtype=dt)  # noqa: E731
    keys = QuantizedKeys(z(1, 2, 128, 32), z(1, 2, 4, 64, dt=torch.float16), z(1, 2, 4, 64, dt=torch.float16), 4, 32)
    values = QuantizedValues(z(1, 2, 128, 16), z(1, 2, 128, 16), z(1, 2, 128, 2, dt=torch.float16),
                             z(1, 2, 128, 2, dt=torch.float16), 4, 32)  # fmt: skip
    coded = torch.full((1, 2, 2, 2), -1, dtype=torch.int32)
    one = lambda *v, dt=torch.long: torch.tensor(v, dtype=dt)  # noqa: E731
    args = dict(slots=torch.arange(16, 80) % 40, page=one(0, 1), start=one(16, 48), floor=one(16), scratch_page=3)
    naive.flush_page(ring, ring, keys, values, due=one(False, True, dt=torch.bool), coded=coded, **args)
    assert coded.tolist() == [[[[-1, 1], [-1, 1]], [[-1, 1], [-1, 1]]]]
    assert bool(keys.scale[:, :, 1].any()) and not keys.scale[:, :, 0].any()
    keys.scale[:, :, 1] = 0  # page 1 is held by its slot: not written again
    naive.flush_page(ring, ring, keys, values, due=one(True, True, dt=torch.bool), coded=coded, **args)
    assert not keys.scale[:, :, 1].any() and bool(keys.scale[:, :, 0].any())
    assert coded.tolist() == [[[[0, 1], [0, 1]], [[0, 1], [0, 1]]]]
