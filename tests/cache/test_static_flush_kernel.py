"""A static LoopKV cache whose decode steps flush through the fused Triton kernel (`triton_ops.quant.flush_page`, one
launch per coded cell) decodes exactly as with the reference flush (the torch ops it replaces): the same tokens and
logits, and every byte of the cache's device state equal (codes, scales, zero points, both INT4 value planes, rings,
lengths; not the scratch page, whose bytes are unspecified: the reference sends the pages that are not due there, the
kernel skips them), for kivi4 / kivi2 / kivi4-share, a left-padded batch (partial validity in the flushed pages), a
step with no page due and flush boundaries crossed every 4 tokens; kivi4 also when every step
after the first is a replay of a recording (the CUDA-graph stand-in), which a flush that read a host value would get
wrong.

The kernel runs on the CPU under `TRITON_INTERPRET=1` (started by `tests/ops/test_triton_interpreter.py`); on CUDA
the captured-step tests in `test_static_loopkv.py` run it for real.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.cache.test_static_loopkv import _cache, _generate, _prompt
from tests.helpers import device_state, make_model, stand_in_graphs
from triton_ops import _dispatch
from triton_ops.quant import naive, ops

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
NEW = 10  # 9-token prompt, sink 2, window 4, pages of 4: the first step flushes to the scratch page, then pages 0-1
pytestmark = pytest.mark.skipif(
    not INTERPRET or torch.cuda.is_available(),
    reason="runs the kernel on CPU tensors under TRITON_INTERPRET=1 (see test_triton_interpreter)",
)


def _route(monkeypatch, fused: bool) -> list[str]:
    """Send `flush_page` to the fused kernel (`fused`) or the reference, whatever the device; record which ran."""
    ran: list[str] = []
    kernel, reference = ops._flush_page_fwd, naive._flush_page
    monkeypatch.setattr(ops, "use_triton", lambda op, *t: fused if op == "flush_page" else _dispatch.use_triton(op, *t))
    monkeypatch.setattr(ops, "_flush_page_fwd", lambda *a: ran.append("fused") or kernel(*a))
    monkeypatch.setattr(naive, "_flush_page", lambda *a: ran.append("reference") or reference(*a))
    return ran


def _decode(monkeypatch, name, fused, replayed=False):
    # small enough for the interpreter (one layer x 3 loops, one KV head of 32 (GQA 2), 2 rows: 4 programs a launch)
    model = make_model("ouro", hidden_size=64, num_attention_heads=2, num_key_value_heads=1, num_hidden_layers=1).float()
    ids, mask = _prompt(2, True)
    cache = _cache(model, name, static=True, max_batch_size=3, max_cache_len=24)
    kwargs = {}
    if replayed:
        from transformers import CompileConfig

        stand_in_graphs(monkeypatch)
        config = CompileConfig()
        config._compile_all_devices = True  # transformers' switch to take the compiled call off CUDA
        kwargs["compile_config"] = config
    with monkeypatch.context() as m:
        ran = _route(m, fused)
        out = _generate(model, "ouro", ids, mask, cache, new=NEW, **kwargs)
    for cell in cache.cells:  # the scratch page (past every page a reader reads): unspecified bytes
        if getattr(cell, "qk", None) is not None:
            n, p = cell.num_pages, cell.page
            cell.qk.scale[:, :, n:] = 0
            cell.qk.zero[:, :, n:] = 0
            for t in (cell.qk.codes, cell.qv.hi, cell.qv.lo, cell.qv.scale, cell.qv.zero):
                if t is not None:
                    t[:, :, n * p :] = 0
    return out, [t.clone() for t in device_state(cache)], ran


def _assert_same(got, want):
    (out, state, ran), (ref_out, ref_state, ref_ran) = got, want
    # (a complete forward flushes its cells in one launch: one fused call against one reference call per cell)
    assert set(ran) == {"fused"} and set(ref_ran) == {"reference"} and len(ref_ran) >= len(ran) > 0
    assert torch.equal(out.sequences, ref_out.sequences)
    for a, b in zip(out.logits, ref_out.logits):
        assert torch.equal(a, b)
    assert len(state) == len(ref_state)
    for a, b in zip(state, ref_state):
        assert torch.equal(a.view(torch.uint8) if a.is_floating_point() else a,
                           b.view(torch.uint8) if b.is_floating_point() else b)  # fmt: skip


@pytest.mark.parametrize(
    "name,replayed",
    [pytest.param("kivi4", True, id="kivi4-replayed"), pytest.param("kivi2", False, id="kivi2"),
     pytest.param("kivi4-share", False, id="kivi4-share")],
)  # fmt: skip
def test_fused_flush_decodes_as_the_reference(monkeypatch, name, replayed):
    """(`replayed`: every step after the first is a replay of its recording, with the host lengths frozen.)"""
    _assert_same(_decode(monkeypatch, name, True, replayed), _decode(monkeypatch, name, False, replayed))
