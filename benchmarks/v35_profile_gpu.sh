#!/bin/bash
# session 35, second call: per-kernel GPU time of a 5-token verification against a decode step (benchmarks.profile_verify)
# over LoopKV kivi4-share with blocks at both planes, the full cache and V precision in blocks, batch 8; then
# self-speculation over the full cache at batch 8 beside the blocks-at-both-planes row (same machine).
# Not run yet: the device did not start again in session 35 (six tries). Run from the repository root on the GPU
# machine with $OUT set; writes $OUT/s35b/{log.txt,all.json}.
set -u
. benchmarks/gpu_calls.sh
start s35b ${BUDGET:-400}
run 200 profile_verify python3 -W ignore -m benchmarks.profile_verify --shape ouro-1.4b --batch 8 --prompt 1024 \
  --caches loopkv-kivi4-share-verify-int4 full loopkv-kivi4-share --out /tmp/s35b/profile_verify
run 160 ss_full_b8 python3 -W ignore -m benchmarks.bench_selfspec --mode graph --shapes ouro-1.4b \
  --caches full loopkv-kivi4-share-verify-int4 --new-tokens 256 --no-probe --budget-s 150 --batches 8 --out /tmp/s35b/ss_b8
finish
