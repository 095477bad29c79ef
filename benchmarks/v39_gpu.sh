#!/bin/bash
# session 39 (`bash benchmarks/v39_gpu.sh N`, from the repository root on the GPU machine with $OUT set; writes
# $OUT/<call>/{log.txt,all.json}). Call 1: the GPU tests session 38's last call did not reach (coded-attention
# kernels and static coded views after `mma_rows_min` became 3, the static LoopKV caches) and the captured
# `block_size="auto"` tests. Call 2: self-speculation with `block_size="auto"` on Ouro-1.4B's shape (up to 4, every
# cache, batch 8 then 1) against sequential decoding through the same captured steps (batch 1 with the one-row
# rings), then Huginn-0125's shape at batch 1, up to 8, LoopKV kivi4-share (one-row rings) and the full cache.
# Call 1 ran (H100; the tests were cut by the 540 s timeout after 177 results, none failed); call 2 found no
# machine in five tries and ran in session 40 as `benchmarks/v40_gpu.sh 1` (the same steps; this call runs that one).
set -u
. benchmarks/gpu_calls.sh
if [ "${1:-1}" = 1 ]; then
  start s39a ${BUDGET:-560}
  run 540 tests python3 -m pytest -q -p no:cacheprovider -m gpu tests/generation/test_selfspec_graphs.py \
    tests/ops/test_coded_attention_static.py tests/cache/test_static_loopkv.py tests/ops/test_coded_attention_kernels.py
elif [ "${1:-1}" = 2 ]; then
  exec bash benchmarks/v40_gpu.sh 1
fi
finish
