"""CPU CI runs the Triton kernel tests under the interpreter: `TRITON_INTERPRET=1` must be set before the kernels are
decorated, so this test starts those modules in a subprocess with the variable set (fp32 / fp16, small shapes)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
MODULES = [
    "tests/ops/test_quant_kernels.py",
    "tests/ops/test_coded_attention_kernels.py",
    "tests/ops/test_coded_attention_static.py",
    "tests/ops/test_fused_kernels.py",
    "tests/ops/test_flush_page.py",
    "tests/ops/test_gemv_kernels.py",
    "tests/cache/test_static_flush_kernel.py",
]


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA the kernel tests run on the device directly")
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="already under the interpreter")
@pytest.mark.parametrize("module", MODULES)
def test_triton_kernels_under_interpreter(module):
    """One subprocess per module, each with its own time limit (the coded-attention file alone takes about 7 minutes
    on a 2-core machine)."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not gpu", module]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    tail = proc.stdout[-4000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, tail
    assert " passed" in proc.stdout and " failed" not in proc.stdout, tail
