#!/bin/bash
# session 36: where a batch-8 verification's time goes (`bash benchmarks/v36_gpu.sh N`, from the repository root on
# the GPU machine with $OUT set; writes $OUT/<call>/{log.txt,all.json}). Before these, session 35's second call ran
# (its script since removed: profile_verify eager at 1,088, `results/profile_verify_h100_s36_eager.json`; its bench
# row did not fit its budget and ran again alone, `results/selfspec_h100_graph_s36_before_b8.json`, the full cache
# and LoopKV with blocks at both planes at batch 8). Call 1 (ran): benchmarks.profile_verify
# --graph, LoopKV kivi4-share with blocks at both planes against the full cache, at bench_selfspec's static capacity
# (1,024 + 257 x 5 = 2,309) and at a tight one (1,088). Call 2 (ran twice, the second time with the phases):
# benchmarks.profile_selfspec, the whole decode as bench_selfspec times it, batch 8 and 1. Call 3 (ran): the same at
# batch 8 with every draft accepted, and none (no holes either way). Call 4 (ran): after the ring read, the profile
# again and self-speculation over five caches at batch 1 and 8. Call 5 (not run whole): after the tail plan follows
# `window_reach`, the static kernel tests on the GPU, the block alone with the reserve, the profile, the bench.
set -u
. benchmarks/gpu_calls.sh
if [ "${1:-2}" = 1 ]; then
  start s36b ${BUDGET:-300}
  P="python3 -W ignore -m benchmarks.profile_verify --shape ouro-1.4b --batch 8 --prompt 1024 --graph"
  run 120 pv_2309 $P --capacity 2309 --caches loopkv-kivi4-share-verify-int4 full --out /tmp/s36b/pv_graph_2309
  run 120 pv_1088 $P --capacity 1088 --caches loopkv-kivi4-share-verify-int4 full --out /tmp/s36b/pv_graph_1088
elif [ "${1:-2}" = 3 ]; then
  start s36d ${BUDGET:-300}
  P="python3 -W ignore -m benchmarks.profile_selfspec --shape ouro-1.4b --prompt 1024 --new-tokens 128 --batch 8"
  run 100 pss_a1 $P --alpha 1.0 --caches loopkv-kivi4-share-verify-int4 --out /tmp/s36d/pss_b8_a1
  run 100 pss_a0 $P --alpha 0.0 --caches loopkv-kivi4-share-verify-int4 --out /tmp/s36d/pss_b8_a0
elif [ "${1:-2}" = 4 ]; then
  # after the ring fix (kernels._attend_dense reads a ring from the oldest position a row sees)
  start s36e ${BUDGET:-480}
  run 80 pss_b8 python3 -W ignore -m benchmarks.profile_selfspec --shape ouro-1.4b --prompt 1024 --new-tokens 128 \
    --batch 8 --caches loopkv-kivi4-share-verify-int4 --out /tmp/s36e/pss_b8
  run 380 ss python3 -W ignore -m benchmarks.bench_selfspec --mode graph --shapes ouro-1.4b --new-tokens 256 \
    --no-probe --budget-s 370 --batches 1 8 --caches loopkv-kivi4-share-verify-int4 loopkv-kivi4-share full ripe64 \
    deepest --out /tmp/s36e/ss
elif [ "${1:-2}" = 5 ]; then
  # after planning the tail programs for the view's window_reach: the static kernel tests on the GPU, the profile,
  # self-speculation at batch 1 and 8
  # (ran once with a 359 s limit: 18 static tests passed in 90 s, then it ran out; not run whole yet)
  start s36f ${BUDGET:-540}
  run 100 tests python3 -m pytest -q -x -p no:cacheprovider tests/ops/test_coded_attention_static.py \
    -k "reach or device_lengths_matches or tail_chunks"
  run 60 pv_r4 python3 -W ignore -m benchmarks.profile_verify --shape ouro-1.4b --batch 8 --prompt 1024 --graph \
    --capacity 2309 --rollback 4 --caches loopkv-kivi4-share-verify-int4 --out /tmp/s36f/pv_graph_2309_r4
  run 90 pss_b8 python3 -W ignore -m benchmarks.profile_selfspec --shape ouro-1.4b --prompt 1024 --new-tokens 128 \
    --batch 8 --caches loopkv-kivi4-share-verify-int4 --out /tmp/s36f/pss_b8
  run 280 ss python3 -W ignore -m benchmarks.bench_selfspec --mode graph --shapes ouro-1.4b --new-tokens 256 \
    --no-probe --budget-s 270 --batches 1 8 --caches loopkv-kivi4-share-verify-int4 loopkv-kivi4-share deepest \
    ripe64 full --out /tmp/s36f/ss
else
  start s36c ${BUDGET:-300}
  P="python3 -W ignore -m benchmarks.profile_selfspec --shape ouro-1.4b --prompt 1024 --new-tokens 128"
  run 150 pss_b8 $P --batch 8 --caches full loopkv-kivi4-share-verify-int4 --out /tmp/s36c/pss_b8
  run 120 pss_b1 $P --batch 1 --caches loopkv-kivi4-share-verify-int4 --out /tmp/s36c/pss_b1
fi
finish
