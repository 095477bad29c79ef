# Shared by the benchmarks/v*_gpu.sh device calls (sourced, after `set -u`): `start NAME [BUDGET]` opens $OUT/NAME
# (log.txt) and /tmp/NAME, prints the versions and the GPU; `run SECONDS LABEL CMD...` runs a step with a timeout cut
# to the budget left (skipped under 10 s), its output's tail logged; `finish` writes $OUT/NAME/all.json, one JSON of
# every /tmp/NAME/*.json (the device tool returns few files per call), and the wall time.
start() {
  NAME=$1; BUDGET=${2:-560}; START=$(date +%s)
  D=$OUT/$NAME; mkdir -p "$D" "/tmp/$NAME"; L=$D/log.txt
  export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
  python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'tf', transformers.__version__, torch.cuda.get_device_name())" 2>&1 | tee "$L"
}
left() { echo $(( BUDGET - ($(date +%s) - START) )); }
run() {
  local s=$1 name=$2; shift 2
  local l; l=$(left); [ "$l" -lt "$s" ] && s=$l
  [ "$s" -lt 10 ] && { echo "== skip $name" | tee -a "$L"; return; }
  echo "== $name (timeout ${s}s, t=$(( $(date +%s) - START ))s)" | tee -a "$L"
  timeout "$s" "$@" 2>&1 | grep -v Warning | grep -v "^{'mode'" | tail -30 | tee -a "$L"
}
finish() {
  python3 - "$NAME" <<'PY' 2>&1 | tee -a "$L"
import glob, json, os, sys
name = sys.argv[1]
out = {os.path.basename(f)[:-5]: json.load(open(f)) for f in sorted(glob.glob(f"/tmp/{name}/*.json"))}
json.dump(out, open(os.path.join(os.environ["OUT"], name, "all.json"), "w"))
print("wrote all.json:", list(out))
PY
  echo "== done in $(( $(date +%s) - START ))s" | tee -a "$L"
}
