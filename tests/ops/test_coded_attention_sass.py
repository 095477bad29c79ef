"""The v4 one-row coded-attention loop compiled for sm_90 on any machine (no GPU): the instruction count per code
element that `benchmarks/notes_coded_attention.md` records, and no local memory (`benchmarks/sass_coded_attention.py`)."""

from __future__ import annotations

import glob
import os

import pytest

triton = pytest.importorskip("triton")
TOOLS = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin")
pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") == "1" or not glob.glob(os.path.join(TOOLS, "cuobjdump")),
    reason="needs Triton's NVIDIA tools (ptxas, cuobjdump) and the compiler (not the interpreter)",
)


def test_default_int4_loop_stays_lean():
    from benchmarks.sass_coded_attention import report
    from triton_ops.coded_attention.ops import ROW1_TUNING

    r = report(fmt=4, pages=ROW1_TUNING["pages"], warps=ROW1_TUNING["num_warps"], extra={"WORDS": ROW1_TUNING["words"]})
    assert r["stack"] == 0 and r["local_ins"] == 0, r  # nothing spilled to local memory
    # v4 measured 4.37 SASS instructions per K + V code element; v3 (bytes, 2 pages) 6.99
    assert r["per_element"] < 5.0, r
    assert r["ops"].get("PRMT", 0) < 20, r  # no per-byte extraction
