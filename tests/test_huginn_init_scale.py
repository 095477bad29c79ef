"""Huginn's initial core state: `config.init_scale` is the inference default of `forward` (0.0: zeros, deterministic),
so plain calls, `generate`, scoring and the shipped fixture agree without anyone passing `init_scale=0.0`."""

from __future__ import annotations

import json

import pytest
import torch

from hf_loopcache import HuginnConfig, HuginnForCausalLM
from hf_loopcache.fixtures import fixture_path
from tests.helpers import tiny_huginn

IDS = torch.tensor([[5, 9, 17, 33, 12, 8, 40]])


def seeded(model, seed, **kwargs):
    torch.manual_seed(seed)
    with torch.no_grad():
        return model(IDS, num_steps=3, **kwargs).logits


def test_eval_default_is_the_zero_state_of_the_config():
    model = tiny_huginn()
    assert model.config.init_scale == 0.0
    zero = seeded(model, 0, init_scale=0.0)
    torch.testing.assert_close(seeded(model, 0), zero, rtol=0, atol=0)
    torch.testing.assert_close(seeded(model, 123), zero, rtol=0, atol=0)  # no randomness left


def test_config_value_is_read_when_not_passed():
    model = tiny_huginn()
    model.config.init_scale = 1.0
    random_state = seeded(model, 7, init_scale=1.0)
    torch.testing.assert_close(seeded(model, 7), random_state, rtol=0, atol=0)
    assert not torch.allclose(random_state, seeded(model, 7, init_scale=0.0))
    # an explicit argument wins over the config
    torch.testing.assert_close(seeded(model, 7, init_scale=0.0), seeded(model.eval(), 99, init_scale=0.0))


def test_training_mode_keeps_the_official_random_state():
    model = tiny_huginn().train()
    torch.testing.assert_close(seeded(model, 5), seeded(model, 5, init_scale=1.0), rtol=0, atol=0)
    assert not torch.allclose(seeded(model, 5), seeded(model, 5, init_scale=0.0))


def test_generate_uses_the_default():
    model = tiny_huginn()
    torch.manual_seed(1)
    plain = model.generate(IDS, max_new_tokens=5, do_sample=False, pad_token_id=0, num_steps=3)
    torch.manual_seed(2)
    explicit = model.generate(IDS, max_new_tokens=5, do_sample=False, pad_token_id=0, num_steps=3, init_scale=0.0)
    assert plain.tolist() == explicit.tolist()


def test_config_round_trip_and_official_config_without_the_field(tmp_path):
    config = HuginnConfig(n_embd=32, n_heads=4, vocab_size=64, mean_recurrence=2, init_scale=0.5)
    config.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["init_scale"] == 0.5
    assert HuginnConfig.from_pretrained(tmp_path).init_scale == 0.5
    official = {"model_type": "huginn_raven", "n_embd": 32, "n_heads": 4, "vocab_size": 64}  # no init_scale field
    assert HuginnConfig(**{k: v for k, v in official.items() if k != "model_type"}).init_scale == 0.0


@pytest.mark.parametrize("bad", [-0.5, "zero", True], ids=["negative", "string", "bool"])
def test_bad_init_scale_is_refused(bad):
    with pytest.raises(ValueError, match="init_scale"):
        HuginnConfig(n_embd=32, n_heads=4, vocab_size=64, init_scale=bad)


def test_shipped_fixture_sets_it():
    assert json.loads((fixture_path("tiny-huginn") / "config.json").read_text())["init_scale"] == 0.0
    model = HuginnForCausalLM.from_pretrained(fixture_path("tiny-huginn")).eval()
    assert model.config.init_scale == 0.0
