#!/bin/bash
# session 37 (`bash benchmarks/v37_gpu.sh N`, from the repository root on the GPU machine with $OUT set; writes
# $OUT/<call>/{log.txt,all.json}). Before these, session 36's `v36_gpu.sh 5` ran whole (the window_reach plan timed:
# `results/selfspec_h100_graph_s37_reach.json`, `profile_selfspec_h100_s37_reach.json`,
# `profile_verify_h100_s37_graph_r4.json`). Call 1: self-speculation on Huginn-0125's shape after sessions 35-36's
# changes (LoopKV with blocks at both planes and with V precision in blocks, the full cache), batch 1 and 8. Call 2:
# after `v_precision_blocks=None` became the default (a self-speculative decode's blocks at both planes): Huginn-0125's
# forwards profiled (LoopKV against the full cache, batch 8, the bench's static capacity for 192 new tokens, the
# rollback reserve), and on Ouro-1.4B's shape the default LoopKV cache beside `-vprec-blocks`, batch 8 and 1.
set -u
. benchmarks/gpu_calls.sh
if [ "${1:-1}" = 1 ]; then
  start s37a ${BUDGET:-540}
  S="python3 -W ignore -m benchmarks.bench_selfspec --mode graph --shapes huginn-0125 --no-probe --batches 1 8"
  run 300 ss_loopkv $S --new-tokens 192 --budget-s 290 --caches loopkv-kivi4-share-verify-int4 loopkv-kivi4-share \
    --out /tmp/s37a/ss_huginn_loopkv
  run 230 ss_full $S --new-tokens 192 --budget-s 220 --caches full --out /tmp/s37a/ss_huginn_full
elif [ "${1:-1}" = 2 ]; then
  start s37b ${BUDGET:-540}
  run 150 pv_huginn python3 -W ignore -m benchmarks.profile_verify --shape huginn-0125 --batch 8 --prompt 1024 --graph \
    --capacity 1989 --rollback 4 --caches loopkv-kivi4-share full --out /tmp/s37b/pv_huginn_graph_1989_r4
  run 300 ss_ouro python3 -W ignore -m benchmarks.bench_selfspec --mode graph --shapes ouro-1.4b --new-tokens 256 \
    --no-probe --budget-s 290 --batches 8 1 --caches loopkv-kivi4-share loopkv-kivi4-share-vprec-blocks \
    --out /tmp/s37b/ss_ouro_loopkv_default
elif [ "${1:-1}" = 3 ]; then
  # call 2's profile ran out of memory on an H100 (the LoopKV cache's rings sized for the rollback reserve at batch
  # 8; no H200 could be started): without the reserve (the window_reach plan reads the same either way), one cache per
  # process
  start s37c ${BUDGET:-300}
  P="python3 -W ignore -m benchmarks.profile_verify --shape huginn-0125 --batch 8 --prompt 1024 --graph --capacity 1989"
  run 150 pv_loopkv $P --caches loopkv-kivi4-share --out /tmp/s37c/pv_huginn_loopkv
  run 120 pv_full $P --caches full --out /tmp/s37c/pv_huginn_full
elif [ "${1:-1}" = 4 ]; then
  # a static dense cell's one-token read when the storage holds fewer positions than it allocates: cuDNN over the
  # whole storage (the default) against the kernel to the device-side length
  start s37d ${BUDGET:-200}
  run 100 live_8k python3 -W ignore -m benchmarks.bench_static_read --length 8192 --live 1024 2048 4096 6144 8191 \
    --out-dir /tmp/s37d/8k
  run 60 live_2309 python3 -W ignore -m benchmarks.bench_static_read --length 2309 --live 1024 2308 --out-dir /tmp/s37d/2k
  mv /tmp/s37d/8k/static_read_live.json /tmp/s37d/live_8192.json; mv /tmp/s37d/2k/static_read_live.json /tmp/s37d/live_2309.json
elif [ "${1:-1}" = 5 ]; then
  # after `read_method = "auto"` (the kernel while the storage is at most 2/3 full): the GPU tests of the static
  # reads, then the full cache's self-speculation row (its sequential step reads 1,024-1,280 of 2,309 positions)
  start s37e ${BUDGET:-330}
  run 120 tests python3 -m pytest -q -x -p no:cacheprovider -m gpu tests/cache/test_static.py \
    -k "captured_decode_equals_eager_cuda and (auto or kernel)"
  run 180 ss_full python3 -W ignore -m benchmarks.bench_selfspec --mode graph --shapes ouro-1.4b --new-tokens 256 \
    --no-probe --budget-s 170 --batches 8 1 --caches full --out /tmp/s37e/ss_full_auto
elif [ "${1:-1}" = 6 ]; then
  # the same for RIPE(64) and the deepest plane (their dense cells and the deepest plane's one-token source reads)
  start s37f ${BUDGET:-200}
  run 190 ss python3 -W ignore -m benchmarks.bench_selfspec --mode graph --shapes ouro-1.4b --new-tokens 256 \
    --no-probe --budget-s 180 --batches 8 1 --caches deepest ripe64 --out /tmp/s37f/ss_ripe_deepest_auto
elif [ "${1:-1}" = 7 ]; then
  # after a shared cell's one-token read over a BF16 source follows the same rule (the kernel while the storage is at
  # most 2/3 full): the deepest plane and RIPE(64) at batch 8 (what device time was left)
  start s37g ${BUDGET:-90}
  run 85 ss python3 -W ignore -m benchmarks.bench_selfspec --mode graph --shapes ouro-1.4b --new-tokens 128 \
    --no-probe --budget-s 80 --batches 8 --caches deepest ripe64 --out /tmp/s37g/ss_ripe_deepest_shared_auto
fi
finish
