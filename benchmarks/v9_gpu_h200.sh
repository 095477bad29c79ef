#!/bin/bash
# v9 GPU run (session 16, s16-v8vp): one call, v8 old / pipelined / V precision, 8K x 1 / 8 / 16
set -u
mkdir -p /tmp/w && tar -xzf .devcarry/s16-v8vp/w.tar.gz -C /tmp/w && cd /tmp/w
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/w
L=$OUT/log.txt
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())" 2>&1 | tee $L
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv 2>&1 | tee -a $L
T="python3 -W ignore -m benchmarks.tune_coded_attention --batches 1 8 16 --contexts 8192"
C=1,2,1,8,1
t0=$(date +%s)
timeout 110 $T --queries 5 --providers int4 --configs $C $C,mma_stages=2 $C,mma_stages=3 $C,mma_stages=3,mma_warps=2 --out $OUT/v9_q5_int4.json 2>&1 | tee -a $L
echo "== $(( $(date +%s) - t0 ))s" | tee -a $L
timeout 80 $T --queries 5 --providers int4-vprec --configs $C,mma_vprec=0 $C $C,mma_stages=3 --out $OUT/v9_q5_vprec.json 2>&1 | tee -a $L
echo "== $(( $(date +%s) - t0 ))s" | tee -a $L
timeout 45 $T --queries 5 --providers int2 --configs $C $C,mma_stages=3 --out $OUT/v9_q5_int2.json 2>&1 | tee -a $L
echo "== $(( $(date +%s) - t0 ))s" | tee -a $L
timeout 50 python3 -m pytest -q -x -p no:cacheprovider tests/ops/test_coded_attention_kernels.py -k "mma_vprec_matches or all_cold or pipelined" 2>&1 | tail -8 | tee $OUT/pytest.txt
echo "== $(( $(date +%s) - t0 ))s" | tee -a $L
timeout 25 $T --queries 4 --providers int4 --configs $C $C,mma_stages=3 --out $OUT/v9_q4_int4.json 2>&1 | tee -a $L
echo "== $(( $(date +%s) - t0 ))s" | tee -a $L
timeout 35 $T --queries 1 --providers int4 int2 --configs $C --out $OUT/v9_q1.json 2>&1 | tee -a $L
echo "== $(( $(date +%s) - t0 ))s" | tee -a $L
