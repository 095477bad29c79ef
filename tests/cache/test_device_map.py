"""Caches of a model split by `device_map` (accelerate's big-model inference): each cell sits on the device of the
layer that writes it (every loop of a layer on that layer's device; a shared cell with its source), nothing moves a
cell to another device, and generation through a split model gives the unsplit model's tokens.

CPU has one real device, so placement is checked with `torch.device("meta")` as the second device (a model whose
prelude runs on the CPU and the rest on meta: every cell lands where the map says), and the numerics with maps that
split the model over CPU modules (accelerate's hooks and our per-device moves all run; the devices coincide). The
same tests on two GPUs are item 4 of issue #20 (`benchmarks/bench_multi_gpu.py`, `tests/ops/test_multi_gpu.py`)."""

from __future__ import annotations

import copy

import pytest
import torch
from accelerate import dispatch_model

from hf_loopcache import FullLoopCache, LoopKVCache, RIPECache, SpeculativeStats, self_speculative_generate
from hf_loopcache.attention import AttentionInputs
from hf_loopcache.cache import SharedLayer, loopkv_preset
from hf_loopcache.cache.read import VPrecisionStats
from tests.helpers import call_kwargs, make_model

SMALL_PLAN = dict(sink=2, window=4, page_size=4, group_size=8)

CACHES = {
    "full": lambda m: FullLoopCache(m),
    "ripe": lambda m: RIPECache(m, window=4),
    "loopkv": lambda m: LoopKVCache(m, loopkv_preset(m.loop_layout, "kivi4-share", **SMALL_PLAN), tau=14.0),
}


def _layer_module(model, cell) -> str:
    """The module that writes `cell` (what a device map places)."""
    if model.config.model_type == "ouro":
        return f"model.layers.{cell.layer}"
    part = {"prelude": "prelude", "core": "core_block", "coda": "coda"}[cell.stage]
    return f"transformer.{part}.{cell.layer}"


def _mapped_device(device_map: dict[str, str], module: str) -> torch.device:
    """The device `device_map` gives `module` (its longest listed prefix, as accelerate resolves it)."""
    prefixes = [k for k in device_map if k == "" or module == k or module.startswith(k + ".")]
    return torch.device(device_map[max(prefixes, key=len)])


def _split_map(arch: str, second: str = "cpu") -> dict[str, str]:
    """A device map over every top-level block; the deep part on `second`. Ouro's loops return to layer 0, so only a
    real device can be its second device; Huginn's core and coda run after the prelude, so they can go to meta."""
    if arch == "ouro":
        return {
            "model.embed_tokens": "cpu",
            "model.rotary_emb": "cpu",
            "model.layers.0": "cpu",
            "model.layers.1": second,
            "model.norm": second,
            "model.early_exit_gate": second,
            "lm_head": second,
        }
    return {
        "transformer.wte": "cpu",
        "transformer.prelude": "cpu",
        "transformer.adapter": second,
        "transformer.core_block.0": second,
        "transformer.core_block.1": second,
        "transformer.coda": second,
        "transformer.ln_f": second,
        "lm_head": second,
    }


def _dispatched(model, device_map):
    model = dispatch_model(copy.deepcopy(model), device_map=device_map, main_device="cpu", force_hooks=True)
    assert hasattr(model, "_hf_hook")  # accelerate's hooks run (they move each block's inputs to its device)
    return model


def _batch():
    ids = torch.tensor([[5, 9, 17, 33, 12, 8, 40, 7, 3, 22, 9], [0, 0, 0, 21, 3, 44, 6, 50, 9, 4, 11]])
    return ids, (ids != 0).long()


# ------------------------------------------------------------------------------------------------- placement (meta)
@pytest.mark.parametrize("cache_name", list(CACHES))
def test_each_cell_sits_on_the_device_of_the_layer_that_writes_it(cache_name):
    """Huginn split: prelude on CPU, adapter / core / coda / head on meta. After a prefill (RIPE's past its window,
    so shared cells read their sources), every cell is on its layer's device as the map names it: 2 prelude cells on CPU, all 4 x 2 core
    cells (every loop of a core layer) and the coda on meta; a shared cell where its source is."""
    model = make_model("huginn")
    device_map = _split_map("huginn", second="meta")
    split = _dispatched(model, device_map)
    split._hf_hook.io_same_device = False  # meta logits cannot come back to the CPU; the cells are what we check
    cache = CACHES[cache_name](model)
    # meta tensors hold no data: coding a page checks its scales on the host, so LoopKV's prompt stays in its window
    length = 6 if cache_name == "loopkv" else 21
    ids = torch.randint(3, 60, (2, length), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0  # a left-padded row: the key mask (built on the CPU) must reach the meta cells as a copy
    with torch.no_grad():
        out = split(ids, attention_mask=mask, past_key_values=cache, use_cache=True, **call_kwargs("huginn"))
    assert out.logits.device.type == "meta"
    layout = cache.layout
    devices = cache.cell_devices()
    assert all(d is not None for d in devices)
    for flat, device in enumerate(devices):
        cell = layout.cell_at(flat)
        assert device == _mapped_device(device_map, _layer_module(model, cell)), cell
        layer = cache.cells[flat]
        if isinstance(layer, SharedLayer):
            assert layer.source.device == device
    assert {str(d) for d in devices[: layout.n_prelude]} == {"cpu"}
    assert {str(d) for d in devices[layout.n_prelude :]} == {"meta"}
    if cache_name != "full":
        assert any(isinstance(layer, SharedLayer) for layer in cache.cells)
    # still a pytree (torch.export) with a read state per device
    leaves, spec = torch.utils._pytree.tree_flatten(cache)
    assert torch.utils._pytree.tree_unflatten(leaves, spec).cell_devices() == devices


def test_cells_are_placed_by_the_first_forward_not_at_construction():
    """Ouro with its embedding on CPU and every layer on meta: the cache holds no device until the first forward, then
    all 2 x 3 cells (every loop of both layers) are on meta, although the model's first device is the CPU."""
    model = make_model("ouro")
    device_map = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.layers": "meta", "model.norm": "meta"}
    device_map |= {"model.early_exit_gate": "meta", "lm_head": "meta"}
    split = _dispatched(model, device_map)
    split._hf_hook.io_same_device = False
    cache = RIPECache(model, window=2)
    assert cache.cell_devices() == [None] * cache.layout.num_cells
    with torch.no_grad():
        split(torch.tensor([[5, 9, 17, 4, 4]]), past_key_values=cache, use_cache=True)
    assert [str(d) for d in cache.cell_devices()] == ["meta"] * cache.layout.num_cells
    for flat, device in enumerate(cache.cell_devices()):
        assert device == _mapped_device(device_map, _layer_module(model, cache.layout.cell_at(flat)))


# ------------------------------------------------------------------------------------------------- nothing moves
def test_a_cell_is_never_moved_to_another_device():
    model = make_model("ouro")
    cache = RIPECache(model, window=4)
    with torch.no_grad():
        model(torch.tensor([[5, 9, 17, 33, 12, 8]]), past_key_values=cache, use_cache=True)
    lengths = [layer.get_seq_length() for layer in cache.cells]
    key = torch.zeros(1, cache.layout.num_kv_heads, 1, cache.layout.head_dim, device="meta")
    with pytest.raises(ValueError, match=r"stored on cpu, but the keys to write are on meta"):
        cache.update(key, key, 0)
    meta_model = make_model("ouro").to("meta")
    with pytest.raises(ValueError, match=r"stored on cpu, but the keys to write are on meta"):
        meta_model(torch.tensor([[4]], device="meta"), past_key_values=cache, use_cache=True)
    assert [layer.get_seq_length() for layer in cache.cells] == lengths  # nothing was written
    assert {str(d) for d in cache.cell_devices()} == {"cpu"}


def test_a_shared_cell_must_be_written_on_its_sources_device():
    """A shared cell reads its source's storage in place; keys on another device than the source are refused."""
    model = make_model("ouro")
    cache = RIPECache(model, window=4)
    layout = cache.layout
    kv = lambda device: torch.zeros(1, layout.num_kv_heads, 1, layout.head_dim, device=device)  # noqa: E731
    source = layout.source_cell(layout.cell(0))
    cache.update(kv("meta"), kv("meta"), layout.slot(source))  # the final loop's layer 0 on meta
    with pytest.raises(ValueError, match=r"shares the history of cell .* stored on meta, but its keys are on cpu"):
        cache.update(kv("cpu"), kv("cpu"), 0)


def test_each_device_reads_its_own_copy_of_the_forwards_mask():
    """One `ReadState` per device per forward: the key mask copied once to each device; the hole positions computed
    once on the mask's device (a host sync) and copied to the others."""
    model = make_model("ouro")
    cache = RIPECache(model, window=2)
    cache.begin_forward(cache.layout, cache.layout.num_loops, 1)
    key_valid = torch.tensor([[True, True, False, True], [False, True, True, True]])  # row 0 has a hole
    inputs = AttentionInputs(key_valid=key_valid, scaling=0.5)
    home, meta = cache.read_state(inputs), cache.read_state(inputs, torch.device("meta"))
    assert home.key_valid.device.type == "cpu" and meta.key_valid.device.type == "meta"
    assert cache.read_state(inputs, torch.device("meta")) is meta and cache.read_state(inputs, "cpu") is home
    assert meta.home is home and home.home is None
    assert torch.equal(home.effective, torch.tensor([[0, 1, 2, 2, 3], [0, 1, 2, 3, 4]]))
    assert meta.effective.device.type == "meta" and meta.effective.shape == home.effective.shape
    assert cache.read_state(AttentionInputs(key_valid=None, scaling=0.5), torch.device("meta")).key_valid is None


def test_v_precision_counts_per_device_and_sums():
    stats = VPrecisionStats()
    cpu = stats.tensor(torch.device("cpu"))
    assert stats.tensor("cpu") is cpu
    meta = stats.tensor(torch.device("meta"))
    assert meta.device.type == "meta" and meta is not cpu
    stats.device_counts.pop("meta")
    cpu += torch.tensor([3, 7])
    assert dict(stats) == {"cold": 3.0, "history": 7.0}
    other = VPrecisionStats()
    other.device_counts = {"cuda:0": torch.tensor([1, 2]), "cuda:1": torch.tensor([4, 8])}  # (CPU tensors stand in)
    assert dict(other) == {"cold": 5.0, "history": 10.0}


# ------------------------------------------------------------------------------------------------- same tokens
@pytest.mark.parametrize("cache_name", list(CACHES))
@pytest.mark.parametrize("device_map", ["whole", "split"])
def test_generate_through_a_device_map_gives_the_same_tokens(arch, cache_name, device_map):
    """`generate` on a left-padded batch through a model dispatched with `{"": "cpu"}` or a map over every block
    equals the same model without a map, for the full, RIPE and LoopKV caches (V precision on)."""
    model = make_model(arch)
    split = _dispatched(model, {"": "cpu"} if device_map == "whole" else _split_map(arch))
    ids, mask = _batch()
    kw = dict(attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0, **call_kwargs(arch))
    ref_cache, cache = CACHES[cache_name](model), CACHES[cache_name](model)
    if cache_name == "loopkv":
        ref_stats, stats = ref_cache.track_v_precision(), cache.track_v_precision()
    ref = model.generate(ids, past_key_values=ref_cache, **kw)
    out = split.generate(ids, past_key_values=cache, **kw)
    assert torch.equal(out, ref)
    assert cache.stored_bytes() == ref_cache.stored_bytes()
    if cache_name == "loopkv":
        assert dict(stats) == dict(ref_stats) and stats["history"] > 0


@pytest.mark.parametrize("cache_name", ["full", "ripe"])
def test_self_speculative_through_a_device_map(arch, cache_name):
    """Self-speculative decoding (drafts, rollback, holes in a left-padded batch) through a split model gives the
    unsplit model's tokens."""
    model = make_model(arch)
    split = _dispatched(model, _split_map(arch))
    ids, mask = _batch()
    draft = model.loop_layout.num_loops - 1
    kw = dict(attention_mask=mask, draft_loops=draft, block_size=3, max_new_tokens=9, **call_kwargs(arch))
    stats_ref, stats = SpeculativeStats(), SpeculativeStats()
    ref = self_speculative_generate(model, ids, cache=CACHES[cache_name](model), speculative_stats=stats_ref, **kw)
    out = self_speculative_generate(split, ids, cache=CACHES[cache_name](model), speculative_stats=stats, **kw)
    assert torch.equal(out, ref)
    assert stats.accepted == stats_ref.accepted


@pytest.mark.parametrize("cache_name", ["full", "ripe"])
def test_crop_through_a_device_map(arch, cache_name):
    """`crop` of a cache written through a split model, then decoding again one token at a time, gives the same
    tokens (RIPE with `max_rollback` covering the cut, so the cut is exact)."""
    model = make_model(arch)
    split = _dispatched(model, _split_map(arch))
    ids, mask = _batch()
    cache = FullLoopCache(model) if cache_name == "full" else RIPECache(model, window=4, max_rollback=8)
    kw = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0, **call_kwargs(arch))
    out = split.generate(ids, past_key_values=cache, **kw)
    keep = ids.shape[1] + 3
    cache.crop(keep - cache.get_seq_length())
    assert cache.get_seq_length() == keep
    full_mask = torch.cat([mask, torch.ones(2, out.shape[1] - ids.shape[1], dtype=mask.dtype)], 1)
    with torch.no_grad():
        for t in range(keep, out.shape[1] - 1):  # the cache holds [0, t): feed token t, predict t + 1
            logits = split(
                out[:, t : t + 1],
                attention_mask=full_mask[:, : t + 1],
                past_key_values=cache,
                use_cache=True,
                **call_kwargs(arch),
            ).logits
            assert torch.equal(logits[:, -1].argmax(-1), out[:, t + 1])
    assert cache.get_seq_length() == out.shape[1] - 1


def test_from_pretrained_with_a_device_map(tmp_path, arch):
    """The users' door: `from_pretrained(folder, device_map=...)` (transformers' own dispatch) of a saved model, then
    `generate` through a RIPE cache, gives the tokens of the model it was saved from."""
    from transformers import AutoModelForCausalLM

    model = make_model(arch)
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, device_map=_split_map(arch), dtype=torch.float32)
    assert type(loaded) is type(model)  # (a map over one device only places the weights: no hooks)
    ids, mask = _batch()
    kw = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0, **call_kwargs(arch))
    cache = RIPECache(loaded, window=4)
    out = loaded.generate(ids, past_key_values=cache, **kw)
    assert torch.equal(out, model.generate(ids, past_key_values=RIPECache(model, window=4), **kw))
    assert {str(d) for d in cache.cell_devices()} == {"cpu"}


def test_huginn_moves_the_prelude_output_to_the_core_once_per_forward(monkeypatch):
    """Prelude on CPU, adapter and core on meta: the hidden states cross from the CPU to meta twice per forward (the
    first step's adapter input, then the prelude's output once for the later steps), not once per step."""
    model = make_model("huginn")  # 4 steps
    split = _dispatched(model, _split_map("huginn", second="meta"))
    split._hf_hook.io_same_device = False
    width = model.config.n_embd
    crossings: list[tuple[int, ...]] = []
    to = torch.Tensor.to

    def counting_to(self, *args, **kwargs):
        out = to(self, *args, **kwargs)
        if self.device.type == "cpu" and out.device.type == "meta" and self.shape[-1] in (width, 2 * width):
            crossings.append(tuple(self.shape))
        return out

    monkeypatch.setattr(torch.Tensor, "to", counting_to)
    with torch.no_grad():
        split(torch.tensor([[5, 9, 17]]), past_key_values=FullLoopCache(model), use_cache=True, init_scale=0.0)
    assert sorted(crossings) == [(1, 3, width), (1, 3, 2 * width)]
