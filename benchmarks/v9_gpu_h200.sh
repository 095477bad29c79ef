#!/bin/bash
# v9 (session 16, s16-v8vp) on the H200: v8 old vs pipelined at 5 tokens, V precision v7 vs v9, INT2, 4 tokens,
# decode, the v9 GPU tests; 8K x 1 / 8 / 16, bf16, graph replay, L2 flushed (`benchmarks.tune_coded_attention`).
# Self-contained for a combined device call: untars .devcarry/s16-v8vp/w.tar.gz (git archive of triton_ops,
# hf_loopcache, benchmarks, tests) into /tmp/v8vp and writes $OUT/v8vp/{log.txt,v9.json,pytest.txt}; ~200 s wall.
set -u
START=$(date +%s)
BUDGET=${V9_BUDGET:-195}
D=$OUT/v8vp
mkdir -p $D /tmp/v8vp/res && tar -xzf .devcarry/s16-v8vp/w.tar.gz -C /tmp/v8vp && cd /tmp/v8vp || exit 1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/v8vp
L=$D/log.txt
left() { echo $(( BUDGET - ($(date +%s) - START) )); }
step() {  # step SECONDS NAME ARGS...: run the tuner with at most SECONDS (and what is left of the budget)
  local s=$1 name=$2; shift 2
  local l; l=$(left); [ "$l" -lt "$s" ] && s=$l
  [ "$s" -lt 5 ] && { echo "== skip $name (no time left)" | tee -a $L; return; }
  echo "== $name (timeout ${s}s, t=$(( $(date +%s) - START ))s)" | tee -a $L
  timeout $s python3 -W ignore -m benchmarks.tune_coded_attention --batches 1 8 16 --contexts 8192 \
    --out /tmp/v8vp/res/$name.json "$@" 2>&1 | tee -a $L
}
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())" 2>&1 | tee $L
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv 2>&1 | tee -a $L
C=1,2,1,8,1  # ROW1_TUNING's default (5 tokens: v8 at one warp, mma_stages 1 = the old v8)
S3=$C,mma_stages=3
step 75 q5_int4 --queries 5 --providers int4 --configs $C $C,mma_stages=2 $S3 $C,mma_programs_per_sm=7 \
  $S3,mma_programs_per_sm=7 $S3,mma_warps=2 $S3,mma_warps=2,mma_programs_per_sm=5
step 55 q5_vprec --queries 5 --providers int4-vprec --configs $C,mma_vprec=0 $C $S3 $S3,mma_programs_per_sm=7 \
  $C,mma_programs_per_sm=7
step 25 q5_int2 --queries 5 --providers int2 --configs $C $S3 $S3,mma_programs_per_sm=7
step 15 q1 --queries 1 --providers int4 int2 --configs $C
step 10 q4_int4 --queries 4 --providers int4 --configs $C $S3,mma_programs_per_sm=7
l=$(left)
if [ "$l" -ge 15 ]; then
  echo "== pytest (timeout ${l}s)" | tee -a $L
  timeout $l python3 -m pytest -q -x -p no:cacheprovider tests/ops/test_coded_attention_kernels.py \
    -k "mma_vprec_matches or all_cold or pipelined or default_paths" 2>&1 | tail -8 | tee $D/pytest.txt
fi
python3 - <<'PY' 2>&1 | tee -a $L
import glob, json, os
out = {"runs": {}}
for f in sorted(glob.glob("/tmp/v8vp/res/*.json")):
    d = json.load(open(f))
    out.update(device=d["device"], torch=d["torch"])
    out["runs"][os.path.basename(f)[:-5]] = d["rows"]
import triton
out["triton"] = triton.__version__
json.dump(out, open(os.environ["OUT"] + "/v8vp/v9.json", "w"))
print("wrote v9.json:", {k: len(v) for k, v in out["runs"].items()})
PY
echo "== done in $(( $(date +%s) - START ))s" | tee -a $L
