"""Run transformers' own `ModelTesterMixin` and `GenerationTesterMixin` against hf_loopcache's native models.

transformers' model tests are not in its wheel (its sdist carries only the top-level `tests/*.py`, without
`tests/generation/`), and this script downloads nothing: point it at a folder laid out like transformers'
`tests/` that holds at least `test_modeling_common.py`, `test_configuration_common.py` and
`generation/test_utils.py` (a checkout of the release you test, e.g. `git clone -b v5.24.0 ...`), and install
`parameterized` (the mixins import it). It copies those files into a scratch folder, adds a model test module that
plugs tiny configs of `OuroModel` / `OuroForCausalLM`, `HuginnForCausalLM` (and, with `--control`, a stock Llama)
into the mixins the way a model test file inside transformers does, runs pytest there, and prints pass / fail / skip
counts per test class.

    OMP_NUM_THREADS=1 python examples/conformance/run_transformers_mixins.py /path/to/transformers/tests --control
    python examples/conformance/run_transformers_mixins.py TESTS -k "hidden_states or attention" --junitxml out.xml

The failures the README's "Native models as transformers models" section names as architectural are expected:
`test_past_key_values_format` and the `*_use_cache` generate tests (one cache layer per (loop, layer) cell, not per
model layer), `test_num_layers_is_small` (the testers count layer calls of the unrolled loops), `test_sliding_window_mask`
(sliding windows refused) and Huginn's `test_model_base_model_prefix` (no base model). Test files from another
release than the installed transformers add failures of their own; `--control` shows which (Llama fails them too).
"""

from __future__ import annotations

import argparse
import collections
import os
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

NEEDED = ("test_modeling_common.py", "test_configuration_common.py", "generation/test_utils.py")
OPTIONAL = ("exporters/test_export.py", "test_pipeline_mixin.py", "test_training_mixin.py")

EXPORT_STAND_IN = '''"""Stand-in: the given tests folder has no exporters/test_export.py, so its export tests do not run here."""


class ExportTesterMixin:
    pass
'''

HARNESS = '''"""Tiny configs of hf_loopcache's looped models in transformers' ModelTesterMixin and GenerationTesterMixin.

A tester's `num_hidden_layers` is the number of layer calls of the unrolled loops: what `hidden_states` (plus the
embeddings) and `attentions` have one entry per."""

import functools
import inspect
import unittest

import torch
from transformers import LlamaConfig, LlamaForCausalLM, LlamaModel
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, MODEL_MAPPING_NAMES

from hf_loopcache import HuginnConfig, HuginnForCausalLM, OuroConfig, OuroForCausalLM
from hf_loopcache.models.ouro.modeling_ouro import OuroModel

from ...generation.test_utils import GenerationTesterMixin
from ...test_modeling_common import ModelTesterMixin, ids_tensor, random_attention_mask

torch.set_num_threads(1)

# What being a model inside transformers means to the mixins: its class names are in the auto name tables (they
# decide, e.g., which class gets `labels` and which one is a base model).
MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.setdefault("ouro", "OuroForCausalLM")
MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.setdefault("huginn_raven", "HuginnForCausalLM")
MODEL_MAPPING_NAMES.setdefault("ouro", "OuroModel")

# Huginn draws a random initial state unless `init_scale` is 0; where forward does not yet read a config default
# for it, default it from the config here so that outputs are deterministic.
if inspect.signature(HuginnForCausalLM.forward).parameters["init_scale"].default == 1.0:
    _forward = HuginnForCausalLM.forward

    @functools.wraps(_forward)
    def _deterministic_forward(self, *args, init_scale=None, **kwargs):
        if init_scale is None:
            init_scale = 1.0 if self.training else getattr(self.config, "init_scale", 1.0)
        return _forward(self, *args, init_scale=init_scale, **kwargs)

    HuginnForCausalLM.forward = _deterministic_forward


class _Tester:
    batch_size = 3
    seq_length = 7
    vocab_size = 99
    hidden_size = 32
    num_attention_heads = 4
    is_training = True

    def __init__(self, parent, config_class, config_kwargs, layer_calls):
        self.parent = parent
        self.config_class = config_class
        self.config_kwargs = config_kwargs
        self.num_hidden_layers = layer_calls

    def get_config(self):
        return self.config_class(**self.config_kwargs)

    def prepare_config_and_inputs_for_common(self):
        input_ids = ids_tensor([self.batch_size, self.seq_length], self.vocab_size)
        mask = random_attention_mask([self.batch_size, self.seq_length])
        return self.get_config(), {"input_ids": input_ids, "attention_mask": mask}


COMMON = dict(vocab_size=99, bos_token_id=1, eos_token_id=2, pad_token_id=0)


class OuroMixinTest(ModelTesterMixin, GenerationTesterMixin, unittest.TestCase):
    all_model_classes = (OuroModel, OuroForCausalLM)

    def setUp(self):
        kwargs = dict(
            COMMON, hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, total_ut_steps=2, max_position_embeddings=512, rope_theta=10000.0,
        )
        self.model_tester = _Tester(self, OuroConfig, kwargs, layer_calls=2 * 2)


class HuginnMixinTest(ModelTesterMixin, GenerationTesterMixin, unittest.TestCase):
    all_model_classes = (HuginnForCausalLM,)

    def setUp(self):
        kwargs = dict(
            COMMON, n_embd=32, n_heads=4, n_layers_in_prelude=1, n_layers_in_recurrent_block=2,
            n_layers_in_coda=1, intermediate_size=37, mean_recurrence=2, block_size=64, init_scale=0.0,
        )
        self.model_tester = _Tester(self, HuginnConfig, kwargs, layer_calls=1 + 2 * 2 + 1)


class LlamaControlTest(ModelTesterMixin, GenerationTesterMixin, unittest.TestCase):
    all_model_classes = (LlamaModel, LlamaForCausalLM)

    def setUp(self):
        kwargs = dict(
            COMMON, hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512,
        )
        self.model_tester = _Tester(self, LlamaConfig, kwargs, layer_calls=2)
'''


def build(tests: Path, scratch: Path) -> Path:
    missing = [name for name in NEEDED if not (tests / name).is_file()]
    if missing:
        raise SystemExit(f"{tests} lacks {missing}: pass a folder laid out like transformers' tests/ (see --help)")
    root = scratch / "tests"
    for name in NEEDED + OPTIONAL:
        if (tests / name).is_file():
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(tests / name, root / name)
    if not (root / "exporters" / "test_export.py").is_file():
        print("note: no exporters/test_export.py in the given folder; export tests are not run", file=sys.stderr)
        (root / "exporters").mkdir(exist_ok=True)
        (root / "exporters" / "test_export.py").write_text(EXPORT_STAND_IN)
    for package in ("", "generation", "exporters", "models", "models/looped"):
        (root / package).mkdir(parents=True, exist_ok=True)
        (root / package / "__init__.py").touch()
    module = root / "models" / "looped" / "test_modeling_looped.py"
    module.write_text(HARNESS)
    return module


def summarize(junit: Path) -> dict[str, collections.Counter]:
    counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for case in ET.parse(junit).getroot().iter("testcase"):
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error"):
                outcome = "failed"
            elif child.tag == "skipped":
                outcome = "skipped"
        counts[case.get("classname", "").rsplit(".", 1)[-1]][outcome] += 1
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("tests", type=Path, help="folder laid out like transformers' tests/ (see the module doc)")
    parser.add_argument("-k", default=None, help="pytest -k expression (the whole run takes about a minute a class)")
    parser.add_argument("--control", action="store_true", help="also run a stock Llama through the same harness")
    parser.add_argument("--junitxml", type=Path, default=None, help="keep pytest's junit XML here")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="loopcache-mixins-") as scratch:
        module = build(args.tests.resolve(), Path(scratch))
        junit = args.junitxml.resolve() if args.junitxml else Path(scratch) / "junit.xml"
        select = [] if args.control else ["-k", "not LlamaControl"]
        if args.k:
            select = ["-k", f"({args.k})" + ("" if args.control else " and not LlamaControl")]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
        env.setdefault("OMP_NUM_THREADS", "1")
        command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "--tb=line", "-rf"]
        command += [str(module.relative_to(scratch)), f"--junitxml={junit}", *select]
        subprocess.run(command, cwd=scratch, env=env, check=False)
        for name, count in summarize(junit).items():
            print(f"{name}: {count['passed']} passed, {count['failed']} failed, {count['skipped']} skipped")


if __name__ == "__main__":
    main()
