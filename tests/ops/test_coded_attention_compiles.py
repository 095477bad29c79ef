"""The coded-attention kernel's history paths compile for sm_90 under whichever Triton is installed (no GPU, no
instruction counts). The SASS tests count instructions under CI's Triton only; the GPU machine runs another release
(3.6.0), whose layout passes rejected every `vprec_lookback` launch that 3.9.0 compiled (session 29). `.ci/run` runs
this module a second time with that release put first on the path."""

from __future__ import annotations

import glob
import os

import pytest

triton = pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") == "1"
    or not glob.glob(os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/ptxas")),
    reason="needs Triton's compiler and its ptxas (not the interpreter)",
)

# (settings of `benchmarks.sass_coded_attention.compile_row1`): the default decode and verification launches, V
# precision in two launches, in one (the lookback handshake) and optimistic, at Ouro-1.4B's head dim and Huginn-0125's
# padded one
LOOKBACK = {"READ_PREFIX": True, "LOOKBACK": True, "USE_VALID": True}
SETTINGS = {
    "row1-int4": dict(fmt=4, warps=2, extra={"WORDS": True}),
    "row1-vprec-scores": dict(fmt=4, warps=2, vprec=True, extra={"WORDS": True, "VPIPE": True, "SCORES": True}),
    "row1-vprec-lookback": dict(fmt=4, warps=2, vprec=True, extra={"WORDS": True, **LOOKBACK}),
    "row1-vprec-scores-lookback-fp16": dict(
        fmt=4, warps=2, vprec=True, dtype="fp16", extra={"WORDS": True, "VPIPE": True, "SCORES": True, **LOOKBACK}
    ),
    "mma-vprec-lookback": dict(
        fmt=4, warps=1, vprec=True, extra={"ROW1": False, "WORDS": False, "MMA": True, **LOOKBACK}
    ),
    "mma-int2-dh96": dict(fmt=2, warps=2, extra={"ROW1": False, "WORDS": False, "MMA": True, "DH": 96}),
    # V precision's optimistic pass and its check (`vprec_optimistic`), on v4's loop and on v9
    "row1-vprec-optimistic": dict(fmt=4, warps=2, vprec=True, extra={"WORDS": True, "OPT": 1, "COUNT": True}),
    "row1-vprec-optimistic-check": dict(
        fmt=4, warps=2, vprec=True, extra={"WORDS": True, "OPT": 2, "READ_PREFIX": True, "COUNT": True}
    ),
    "mma-vprec-optimistic": dict(
        fmt=4, warps=1, vprec=True, extra={"ROW1": False, "WORDS": False, "MMA": True, "OPT": 1, "COUNT": True}
    ),
    "mma-vprec-optimistic-check-dh96": dict(
        fmt=4, warps=1, vprec=True,
        extra={"ROW1": False, "WORDS": False, "MMA": True, "OPT": 2, "READ_PREFIX": True, "COUNT": True, "DH": 96},
    ),
    # `mma_lo_ahead` (session 34): the `lo` words loaded with the `hi` ones, optimistic pass and plain value pass
    "mma-vprec-optimistic-lo-ahead": dict(
        fmt=4, warps=1, vprec=True,
        extra={"ROW1": False, "WORDS": False, "MMA": True, "OPT": 1, "COUNT": True, "LO_AHEAD": True},
    ),
    "mma-vprec-lo-ahead-dh96": dict(
        fmt=4, warps=1, vprec=True, extra={"ROW1": False, "WORDS": False, "MMA": True, "LO_AHEAD": True, "DH": 96}
    ),
}


@pytest.mark.parametrize("name", list(SETTINGS))
def test_history_paths_compile_for_sm90(name):
    from benchmarks.sass_coded_attention import compile_row1

    kw = SETTINGS[name]
    cubin, _ = compile_row1(pages=1, **kw)
    assert len(cubin) > 0, (triton.__version__, name)
