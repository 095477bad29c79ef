"""Our native models against outputs of the official remote code (tests/data/official/README.md says how they were
made: tiny random weights under the official parameter names, official code on transformers 4.57.6, fp32 CPU)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from hf_loopcache import FullLoopCache, HuginnForCausalLM, OuroForCausalLM

DATA = Path(__file__).parent / "data" / "official"
TOL = dict(atol=1e-4, rtol=1e-4)


def _load(name: str):
    model = AutoModelForCausalLM.from_pretrained(DATA / name)  # no trust_remote_code: our registered class
    return model.eval(), load_file(DATA / name / "golden.safetensors")


def test_official_folders_load_as_native_classes_without_remote_code():
    with (DATA / "ouro_tiny" / "config.json").open() as f:
        assert "auto_map" in json.load(f)
    assert isinstance(_load("ouro_tiny")[0], OuroForCausalLM)
    assert isinstance(_load("huginn_tiny")[0], HuginnForCausalLM)


@torch.no_grad()
def test_ouro_matches_official_forward():
    model, g = _load("ouro_tiny")
    ids = g["input_ids"]
    torch.testing.assert_close(model(ids, use_cache=False).logits, g["a_logits"], **TOL)
    base = model.model(ids, use_cache=False)
    torch.testing.assert_close(torch.stack(base.loop_hidden_states), g["a_loop_hidden"], **TOL)
    torch.testing.assert_close(torch.stack(base.exit_gate_logits), g["a_loop_gate_logits"], **TOL)
    torch.testing.assert_close(model(ids, exit_at_step=1).logits, g["b_logits_exit_at_step_1"], **TOL)
    torch.testing.assert_close(model(ids, exit_threshold=0.5).logits, g["f_logits_exit_threshold_0p5"], **TOL)
    model.config.early_exit_threshold = None
    try:
        torch.testing.assert_close(model(ids, use_weighted_exit=True).logits, g["c_logits_weighted_exit"], **TOL)
    finally:
        model.config.early_exit_threshold = 1.0
    out = model(ids, labels=ids)
    torch.testing.assert_close(out.loss, g["d_loss"].reshape(()), **TOL)
    torch.testing.assert_close(out.logits, g["d_logits_with_labels"], **TOL)


@torch.no_grad()
def test_ouro_matches_official_cache_and_generate():
    model, g = _load("ouro_tiny")
    ids = g["input_ids"]
    cache = FullLoopCache(model)
    torch.testing.assert_close(model(ids[:, :8], cache=cache).logits, g["g_prefill8_logits"], **TOL)
    torch.testing.assert_close(model(ids[:, 8:], cache=cache).logits, g["g_chunk3_logits"], **TOL)
    out = model.generate(g["e_generate_prompt"], max_new_tokens=8, do_sample=False)
    assert torch.equal(out, g["e_generate_sequences"])


@torch.no_grad()
def test_huginn_matches_official_forward():
    model, g = _load("huginn_tiny")
    ids = g["input_ids"]
    out = model(ids, num_steps=3, init_scale=0.0)
    torch.testing.assert_close(out.logits, g["a_logits_steps3_init0"], **TOL)
    torch.testing.assert_close(out.latent_states, g["a_latent_states"], **TOL)
    torch.testing.assert_close(model(ids, num_steps=5, init_scale=0.0).logits, g["b_logits_steps5_init0"], **TOL)
    out = model(ids, num_steps=3, input_states=g["c_input_states"])
    torch.testing.assert_close(out.logits, g["c_logits_steps3_input_states"], **TOL)
    torch.testing.assert_close(out.latent_states, g["c_latent_states"], **TOL)
    out = model(ids, num_steps=3, input_states=g["d_initial_state"])
    torch.testing.assert_close(out.logits, g["d_logits_steps3_init1_seed123"], **TOL)
    loss = model(ids, num_steps=3, init_scale=0.0, labels=ids, unshifted_loss=True).loss
    torch.testing.assert_close(loss, g["f_loss_labels_eq_input_ids"].reshape(()), **TOL)


@torch.no_grad()
def test_huginn_random_state_draws_like_official():
    model, g = _load("huginn_tiny")
    torch.manual_seed(123)
    state = model.initialize_state(model.transformer.wte(g["input_ids"]) * model.emb_scale, scale=1.0)
    torch.testing.assert_close(state, g["d_initial_state"], atol=0, rtol=0)
    torch.manual_seed(123)
    logits = model(g["input_ids"], num_steps=3, init_scale=1.0).logits
    torch.testing.assert_close(logits, g["d_logits_steps3_init1_seed123"], **TOL)


@torch.no_grad()
def test_huginn_matches_official_cache_slots_and_generate(monkeypatch):
    model, g = _load("huginn_tiny")
    ids = g["input_ids"]
    cache = FullLoopCache(model)
    slots: list[int] = []
    attend = cache.attend
    monkeypatch.setattr(cache, "attend", lambda slot, *a: (slots.append(slot), attend(slot, *a))[1])
    prefill = model(ids[:, :6], num_steps=3, init_scale=0.0, use_cache=True, cache=cache).logits
    assert slots == g["e_prefill_slot_sequence"].tolist()
    slots.clear()
    decode = model(ids[:, 6:7], num_steps=3, init_scale=0.0, use_cache=True, cache=cache).logits
    assert slots == g["e_decode_slot_sequence"].tolist()
    torch.testing.assert_close(prefill, g["e_prefill6_logits"], **TOL)
    torch.testing.assert_close(decode, g["e_decode_token7_logits"], **TOL)
    out = model.generate(ids[:1], max_new_tokens=6, do_sample=False, num_steps=3, init_scale=0.0)
    assert torch.equal(out, g["g_generate_sequences"])


def test_state_dict_uses_official_names():
    for name in ("ouro_tiny", "huginn_tiny"):
        model, _ = _load(name)
        with safe_open(DATA / name / "model.safetensors", "pt") as f:
            official = set(f.keys()) - {"freqs_cis"}
        assert set(model.state_dict()) == official


def test_save_and_reload_round_trip(tmp_path):
    for name in ("ouro_tiny", "huginn_tiny"):
        model, g = _load(name)
        model.save_pretrained(tmp_path / name)
        again = AutoModelForCausalLM.from_pretrained(tmp_path / name).eval()
        for (k1, v1), (k2, v2) in zip(sorted(model.state_dict().items()), sorted(again.state_dict().items())):
            assert k1 == k2 and torch.equal(v1, v2), k1
        kwargs = {"num_steps": 3, "init_scale": 0.0} if name.startswith("huginn") else {}
        with torch.no_grad():
            torch.testing.assert_close(model(g["input_ids"], **kwargs).logits, again(g["input_ids"], **kwargs).logits)
