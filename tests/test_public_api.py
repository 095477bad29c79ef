"""The public surface is deliberate (STYLE 21): additions and removals show up here."""

import subprocess
import sys

import hf_loopcache
import triton_ops
import triton_ops.quant


def test_hf_loopcache_all():
    assert sorted(hf_loopcache.__all__) == sorted(
        [
            "CachePlan",
            "Cell",
            "DeepestPlaneCache",
            "FullLoopCache",
            "HuginnConfig",
            "HuginnForCausalLM",
            "LoopCache",
            "LoopKVCache",
            "LoopLayout",
            "OuroConfig",
            "OuroForCausalLM",
            "RIPECache",
            "SpeculativeStats",
            "__version__",
            "build_cache",
            "list_fixtures",
            "load_fixture",
            "register",
            "self_speculative",
            "self_speculative_generate",
        ]
    )
    for name in hf_loopcache.__all__:
        assert getattr(hf_loopcache, name) is not None


def test_triton_ops_all():
    assert triton_ops.__all__ == []
    assert "quantize_keys" in triton_ops.quant.__all__ and "dequantize_values" in triton_ops.quant.__all__


def test_import_has_no_side_effects_beyond_registration():
    """`import hf_loopcache` registers the Auto classes and touches neither the environment nor Triton or lm_eval.

    torch imports Triton itself when it is installed (`transformers.modeling_utils` reaches `torch._dynamo`), so the
    subprocess hides it (`sys.modules["triton"] = None` makes any `import triton` fail, which torch tolerates) and
    checks that none of our kernel modules was loaded."""
    code = (
        "import os, sys; before = dict(os.environ); sys.modules['triton'] = None; import hf_loopcache; "
        "from transformers import AutoConfig; AutoConfig.for_model('ouro'); AutoConfig.for_model('huginn_raven'); "
        "assert dict(os.environ) == before; assert 'lm_eval' not in sys.modules; "
        "assert not [m for m in sys.modules if m.startswith('triton_ops') and m.endswith('.kernels')]"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_typed_and_side_modules():
    """py.typed ships with both packages (the API is typed); the CLI and fixture modules' surfaces."""
    from pathlib import Path

    import hf_loopcache.cli
    import hf_loopcache.fixtures

    assert (Path(hf_loopcache.__file__).parent / "py.typed").is_file()
    assert (Path(triton_ops.__file__).parent / "py.typed").is_file()
    assert hf_loopcache.cli.__all__ == ["UsageError", "main"]
    assert "FixturesNotInstalledError" in hf_loopcache.fixtures.__all__
    assert issubclass(hf_loopcache.fixtures.FixturesNotInstalledError, FileNotFoundError)
