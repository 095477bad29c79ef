#!/bin/bash
# session 38 (`bash benchmarks/v38_gpu.sh N`, from the repository root on the GPU machine with $OUT set; writes
# $OUT/<call>/{log.txt,all.json}). Call 1: session 37's last call (`v37_gpu.sh 7`, refused for lack of device time):
# the GPU tests of the static caches after a shared cell's one-token read over a BF16 source follows the dense
# cells' rule (the kernel while the storage is at most 2/3 full), then the deepest plane and RIPE(64) self-speculation
# rows on Ouro-1.4B's shape, batch 8 and 1. Call 2: the GPU test of the shared cells' cuDNN read with its source set to
# `read_method = "sdpa"` (call 1 found it expecting cuDNN where "auto" now reads by the kernel), then Ouro-1.4B's
# self-speculation at block sizes 2 and 3 (Eq. 8's best at the tiny-ouro fixture's acceptance and a draft cost of
# half a step), every cache, batch 8 and 1 (only gamma 3 at batch 1 ran: the rows' time estimates from the warm-up
# exceeded the budgets given). Call 3: the rest of call 2 with room (the block budgets the step's timeout guards).
# Its gamma-2 rows are void: the sequential way's capture run decoded 3 tokens, and with a storage of 1,795 positions
# its step reads by cuDNN from 1,197 held on, a graph captured inside the timed run (sequential 96.2 tok/s at batch 1
# where gamma 3's run had 153.7). Call 4: after the fix (both ways capture over the whole length; a timed run that
# captures is an error), gamma 2, 3 and 4 at batch 8 in one process each, and gamma 2 at batch 1. Call 5: LoopKV's
# 3-token blocks (gamma 2) on v8's tensor-core path (`mma_rows_min=3`) against the default (v7's word loop per row
# below 4 rows), the same process order both ways. Call 6: after `mma_rows_min` became 3, the GPU tests of the
# coded-attention kernels and of the static LoopKV caches; then Huginn-0125's shape, full cache, batch 1, at block
# sizes 4 and 8 (Eq. 8's best at its fixture's acceptance is above 4).
set -u
. benchmarks/gpu_calls.sh
OURO="python3 -W ignore -m benchmarks.bench_selfspec --mode graph --shapes ouro-1.4b --new-tokens 256 --no-probe"
ALL="--caches full deepest ripe64 loopkv-kivi4-share --budget-s 900"
if [ "${1:-1}" = 1 ]; then
  start s38a ${BUDGET:-400}
  run 170 tests python3 -m pytest -q -p no:cacheprovider -m gpu tests/cache/test_static.py \
    tests/cache/test_static_loopkv.py
  run 210 ss python3 -W ignore -m benchmarks.bench_selfspec --mode graph --shapes ouro-1.4b --new-tokens 256 \
    --no-probe --budget-s 200 --batches 8 1 --caches deepest ripe64 --out /tmp/s38a/ss_ripe_deepest_shared_auto
elif [ "${1:-1}" = 2 ]; then
  start s38b ${BUDGET:-420}
  run 90 tests python3 -m pytest -q -p no:cacheprovider -m gpu tests/cache/test_static.py \
    -k test_shared_cells_read_a_bf16_source_through_cudnn_cuda
  for g in 2 3; do
    run 170 ss_g$g python3 -W ignore -m benchmarks.bench_selfspec --mode graph --shapes ouro-1.4b --new-tokens 256 \
      --no-probe --budget-s 160 --batches 8 1 --block-size $g --caches full deepest ripe64 loopkv-kivi4-share \
      --out /tmp/s38b/ss_ouro_g$g
  done
elif [ "${1:-1}" = 3 ]; then
  start s38c ${BUDGET:-480}
  S="$OURO $ALL"
  run 270 ss_g2 $S --batches 8 1 --block-size 2 --out /tmp/s38c/ss_ouro_g2
  run 200 ss_g3 $S --batches 8 --block-size 3 --out /tmp/s38c/ss_ouro_g3_b8
elif [ "${1:-1}" = 4 ]; then
  start s38d ${BUDGET:-420}
  S="$OURO $ALL"
  run 200 ss_g2 $S --batches 8 1 --block-size 2 --out /tmp/s38d/ss_ouro_g2
  run 110 ss_g3 $S --batches 8 --block-size 3 --out /tmp/s38d/ss_ouro_g3_b8
  run 110 ss_g4 $S --batches 8 --block-size 4 --out /tmp/s38d/ss_ouro_g4_b8
elif [ "${1:-1}" = 5 ]; then
  start s38e ${BUDGET:-240}
  S="$OURO --caches loopkv-kivi4-share --budget-s 900 --batches 8 1 --block-size 2"
  run 110 ss_mma3 $S --row1-tuning mma_rows_min=3 --out /tmp/s38e/ss_ouro_g2_loopkv_mma3
  run 110 ss_default $S --out /tmp/s38e/ss_ouro_g2_loopkv
elif [ "${1:-1}" = 6 ]; then
  start s38f ${BUDGET:-480}
  run 250 tests python3 -m pytest -q -p no:cacheprovider -m gpu tests/ops/test_coded_attention_kernels.py \
    tests/ops/test_coded_attention_static.py tests/cache/test_static_loopkv.py
  S="python3 -W ignore -m benchmarks.bench_selfspec --mode graph --shapes huginn-0125 --new-tokens 192 --no-probe"
  S="$S --caches full --budget-s 900 --batches 1"
  for g in 8 4; do run 110 ss_g$g $S --block-size $g --out /tmp/s38f/ss_huginn_full_g$g; done
fi
finish
