"""Kernels on each tensor's device (issue #20): Triton launches on the *current* CUDA device, so a launcher must make
the tensor's device current, or a model split over GPUs (`device_map`) would launch every cell's kernel on GPU 0.

The CPU tests check the helpers; the two-GPU tests (`gpu` mark, skipped with fewer than two CUDA devices) record the
current device inside every launch while a model split over `cuda:0` / `cuda:1` generates through a LoopKV cache, and
compare its tokens with the same model on one GPU. They have not been run yet (no two-GPU machine was lent)."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import pytest
import torch

from hf_loopcache import LoopKVCache
from hf_loopcache.cache import loopkv_preset
from tests.helpers import make_model
from triton_ops._dispatch import check_same_device, launch_device

TWO_GPUS = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")


@dataclass
class _Inner:
    a: torch.Tensor


@dataclass
class _Outer:
    x: torch.Tensor
    inner: _Inner
    none: torch.Tensor | None = None
    n: int = 3


def test_launch_device_is_a_no_op_off_cuda():
    with launch_device(torch.zeros(1)):
        pass
    with launch_device(torch.zeros(1, device="meta")):
        pass


def test_check_same_device_names_the_tensor_on_another_device():
    cpu = torch.zeros(1)
    check_same_device(cpu, "query", _Outer(cpu, _Inner(cpu)))
    with pytest.raises(ValueError, match=r"`inner.a` is on meta but `query` is on cpu"):
        check_same_device(cpu, "query", _Outer(cpu, _Inner(torch.zeros(1, device="meta"))))


def _record_launch_devices(monkeypatch) -> list[tuple[str, int, int]]:
    """Wrap the host launchers: each call records (op, the tensor's device index, the current device index)."""
    from triton_ops.coded_attention import ops as attn_ops
    from triton_ops.quant import ops as quant_ops

    seen: list[tuple[str, int, int]] = []

    def wrap(module, name, first):
        inner = getattr(module, name)

        def launcher(*args, **kwargs):
            seen.append((name, args[first].device.index, torch.cuda.current_device()))
            return inner(*args, **kwargs)

        monkeypatch.setattr(module, name, launcher)

    wrap(attn_ops, "_coded_attention_fwd", 0)
    wrap(quant_ops, "_quantize_keys_fwd", 0)
    wrap(quant_ops, "_quantize_values_fwd", 0)
    return seen


@pytest.mark.gpu
@TWO_GPUS
def test_kernels_launch_on_each_cells_device_in_a_split_model(monkeypatch):
    """Ouro (head_dim 64, so coded history takes the kernel) split layer 0 -> cuda:0, layer 1 -> cuda:1, through a
    LoopKV kivi4-share cache: every launch runs with its tensors' device current, launches happen on both GPUs, each
    cell sits on its layer's GPU, and the tokens equal the same model on one GPU."""
    from accelerate import dispatch_model

    model = make_model("ouro", hidden_size=256, num_attention_heads=4, num_key_value_heads=4, intermediate_size=256)
    plan = lambda m: loopkv_preset(m.loop_layout, "kivi4-share", sink=4, window=32, page_size=32, group_size=32)  # noqa: E731
    ids = torch.randint(3, 60, (2, 150), generator=torch.Generator().manual_seed(0))
    kw = dict(max_new_tokens=40, do_sample=False, pad_token_id=0)
    one = copy.deepcopy(model).to("cuda:0")
    ref = one.generate(ids.to("cuda:0"), past_key_values=LoopKVCache(one, plan(one), tau=14.0), **kw)
    device_map = {
        "model.embed_tokens": 0,
        "model.rotary_emb": 0,
        "model.layers.0": 0,
        "model.layers.1": 1,
        "model.norm": 1,
        "model.early_exit_gate": 1,
        "lm_head": 1,
    }
    split = dispatch_model(copy.deepcopy(model), device_map=device_map)
    seen = _record_launch_devices(monkeypatch)
    torch.cuda.set_device(0)
    cache = LoopKVCache(split, plan(split), tau=14.0)
    out = split.generate(ids.to("cuda:0"), past_key_values=cache, **kw)
    assert torch.equal(out.cpu(), ref.cpu())
    assert seen and all(tensor == current for _, tensor, current in seen)
    assert {tensor for _, tensor, _ in seen} == {0, 1}
    for flat, device in enumerate(cache.cell_devices()):
        assert device == torch.device("cuda", cache.layout.cell_at(flat).layer)
