#!/bin/bash
# session 35: self-speculation over LoopKV kivi4-share with verification blocks read at both planes
# (`v_precision_blocks=False`, cache `loopkv-kivi4-share-verify-int4`) against V precision in the blocks (the default),
# each with the defaults and with session 34's opt-ins (ROW1_TUNING vprec_waves=6, mma_lo_ahead=true); then the
# opt-ins' op A/B. The baseline sides name the defaults of the call (vprec_waves 0, mma_lo_ahead false), so that it
# reruns as it ran. Run from the repository root on the GPU machine with $OUT set; writes $OUT/s35/{log.txt,all.json}.
set -u
. benchmarks/gpu_calls.sh
start s35 ${BUDGET:-560}
S="python3 -W ignore -m benchmarks.bench_selfspec --mode graph --shapes ouro-1.4b --caches loopkv-kivi4-share loopkv-kivi4-share-verify-int4 --new-tokens 256 --no-probe --budget-s 260"
OLD="--row1-tuning vprec_waves=0 mma_lo_ahead=false"
NEW="--row1-tuning vprec_waves=6 mma_lo_ahead=true"
run 150 ss_b8_def $S --batches 8 $OLD --out /tmp/s35/ss_b8_def
run 80 ss_b1_def $S --batches 1 $OLD --out /tmp/s35/ss_b1_def
run 150 ss_b8_new $S --batches 8 $NEW --out /tmp/s35/ss_b8_new
run 80 ss_b1_new $S --batches 1 $NEW --out /tmp/s35/ss_b1_new
T="python3 -W ignore -m benchmarks.tune_coded_attention --providers int4-vprec"
C=1,2,1,8,1
run 50 q5_1k $T --queries 5 --batches 8 --contexts 1280 --static-capacity 1536 --configs $C $C,mma_lo_ahead=1 --out /tmp/s35/q5_1k.json
run 60 q1_8k $T --queries 1 --batches 1 8 16 --contexts 8192 --configs $C,vprec_waves=0 $C,vprec_waves=6 --out /tmp/s35/q1_8k.json
finish
