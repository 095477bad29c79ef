#!/bin/bash
# session 40 (`bash benchmarks/v40_gpu.sh N`, from the repository root on the GPU machine with $OUT set; writes
# $OUT/<call>/{log.txt,all.json}). Call 1: session 39's call 2, self-speculation with `block_size="auto"` on
# Ouro-1.4B's shape (up to 4, every cache, batch 8 then 1) against sequential decoding through the same captured
# steps (batch 1 with the one-row rings), then Huginn-0125's shape at batch 1, up to 8, LoopKV kivi4-share (one-row
# rings) and the full cache. Call 2: the coded-attention GPU tests session 39's call 1 did not reach (the tail of
# `test_coded_head_dims_that_are_no_power_of_two_vprec_modes_gpu`), then Huginn-0125 at batch 8 with `auto`.
# Both ran on an H100 (README "Session 40"); the LoopKV row of call 2 ran out of memory (rings at a reserve of 8), and a
# third call ran Huginn-0125 at batch 8 up to 4 (`--block-size 4 --batches 8 --caches loopkv-kivi4-share full`, out
# /tmp/s40c/ss_huginn_auto4_b8; the full cache's row, after LoopKV's in the same process, ran out of memory).
set -u
. benchmarks/gpu_calls.sh
S="python3 -W ignore -m benchmarks.bench_selfspec --mode graph --no-probe --budget-s 900"
if [ "${1:-1}" = 1 ]; then
  start s40a ${BUDGET:-570}
  run 300 ss_ouro_auto $S --auto-block --shapes ouro-1.4b --new-tokens 256 --block-size 4 --batches 8 1 \
    --caches full deepest ripe64 loopkv-kivi4-share --out /tmp/s40a/ss_ouro_auto4
  run 250 ss_huginn_auto $S --auto-block --shapes huginn-0125 --new-tokens 192 --block-size 8 --batches 1 \
    --caches loopkv-kivi4-share full --out /tmp/s40a/ss_huginn_auto8_b1
elif [ "${1:-1}" = 2 ]; then
  start s40b ${BUDGET:-570}
  run 330 tests python3 -m pytest -q -p no:cacheprovider -m gpu tests/ops/test_coded_attention_kernels.py \
    -k "vprec_modes_gpu and unroll or vprec_modes_gpu and scores and np2"
  run 220 ss_huginn_auto_b8 $S --auto-block --shapes huginn-0125 --new-tokens 192 --block-size 8 --batches 8 \
    --caches full loopkv-kivi4-share --out /tmp/s40b/ss_huginn_auto8_b8
fi
finish
