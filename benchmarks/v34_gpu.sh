#!/bin/bash
# session 34: times ROW1_TUNING["vprec_waves"] (V precision one-token decode split count) and ["mma_lo_ahead"] (v9 V
# precision, lo words loaded with hi) against the defaults: op A/B, then self-speculation over kivi4-share in the model.
# Run from the repository root on the GPU machine with $OUT set; writes $OUT/s34b/{log.txt,all.json}; ~470 s wall.
set -u
START=$(date +%s); BUDGET=${BUDGET:-470}
D=$OUT/s34b; mkdir -p $D /tmp/s34b
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
L=$D/log.txt
left() { echo $(( BUDGET - ($(date +%s) - START) )); }
run() {
  local s=$1 name=$2; shift 2
  local l; l=$(left); [ "$l" -lt "$s" ] && s=$l
  [ "$s" -lt 10 ] && { echo "== skip $name" | tee -a $L; return; }
  echo "== $name (timeout ${s}s, t=$(( $(date +%s) - START ))s)" | tee -a $L
  timeout $s "$@" 2>&1 | grep -v Warning | grep -v "^{'mode'" | tail -30 | tee -a $L
}
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'tf', transformers.__version__, torch.cuda.get_device_name())" 2>&1 | tee $L
T="python3 -W ignore -m benchmarks.tune_coded_attention --providers int4-vprec"
C=1,2,1,8,1
run 50 q5_1k $T --queries 5 --batches 8 --contexts 1280 --static-capacity 1536 --configs $C $C,mma_lo_ahead=1 --out /tmp/s34b/q5_1k.json
S="python3 -W ignore -m benchmarks.bench_selfspec --mode graph --shapes ouro-1.4b --caches loopkv-kivi4-share --new-tokens 256 --no-probe --budget-s 200"
run 70 ss_b8_def $S --batches 8 --out /tmp/s34b/ss_b8_def
run 75 ss_b8_new $S --batches 8 --row1-tuning vprec_waves=6 mma_lo_ahead=true --out /tmp/s34b/ss_b8_new
run 40 ss_b1_def $S --batches 1 --out /tmp/s34b/ss_b1_def
run 40 ss_b1_new $S --batches 1 --row1-tuning vprec_waves=6 mma_lo_ahead=true --out /tmp/s34b/ss_b1_new
run 80 q5_8k $T --queries 5 --batches 1 8 16 64 --contexts 8192 --configs $C $C,mma_lo_ahead=1 --out /tmp/s34b/q5_8k.json
run 50 q1_1k $T --queries 1 --batches 1 8 --contexts 1280 --static-capacity 1536 --configs $C $C,vprec_waves=6 --out /tmp/s34b/q1_1k.json
run 80 q1_8k $T --queries 1 --batches 1 2 4 8 16 32 --contexts 8192 --configs $C $C,vprec_waves=6 --out /tmp/s34b/q1_8k.json
run 60 q1_32k $T --queries 1 --batches 1 4 8 --contexts 32768 --configs $C $C,vprec_waves=6 --out /tmp/s34b/q1_32k.json
python3 - <<'PY' 2>&1 | tee -a $L
import glob, json, os
out = {}
for f in sorted(glob.glob("/tmp/s34b/*.json")):
    out[os.path.basename(f)[:-5]] = json.load(open(f))
json.dump(out, open(os.environ["OUT"] + "/s34b/all.json", "w"))
print("wrote all.json:", list(out))
PY
echo "== done in $(( $(date +%s) - START ))s" | tee -a $L
