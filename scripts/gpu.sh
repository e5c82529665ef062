#!/usr/bin/env bash
# Runs rdt_jax's GPU checks on a GPU host without internet whose Python
# already has CUDA builds of jax and torch (cupy optional):
#
#   scripts/gpu.sh [--wheels DIR] [--python PY] [--out DIR] [--budget S] [--steps LIST] [--dry-run]
#
# 1. prints the host (GPU, driver, Python, jax, torch, cupy);
# 2. installs Ray, NIXL and Ray's missing dependencies from the wheel folder
#    made by scripts/gpu_wheels.sh into .gpu-site/ (--no-index --no-deps:
#    nothing is downloaded, the host's packages are left as they are); rdt_jax
#    runs from this checkout;
# 3. runs, each under its share of --budget seconds (default 520; tests/gpu
#    took 149 s on one H200) and in this
#    order: tests/gpu, `rdt-jax bench --weight-sync --device gpu` (1, 2 and 4
#    generators; one leaf, 1,000 and 10,000 leaves, or WS_LEAVES; the paths
#    rdt, rdt_donate and store, or WS_PATHS; given 85% of its share as
#    its own --budget, so it skips the rows that no longer fit and ends with
#    its outputs written) and the device-to-device cases of
#    `rdt-jax bench --device gpu` (rdt_jax's one-sided transports, Ray's NIXL
#    and CUDA_IPC with torch, the object store, the device memcpy limit); after
#    a step that ran out of time, the end of Ray's logs. --steps picks some of
#    them (comma-separated: tests, weight-sync, bench, and profile, which is
#    not run unless asked: scripts/profile_overhead.py --device gpu, the
#    per-side split of one 256 MiB array and of 1,000 leaves); the budget is
#    shared by those.
# Logs and benchmark files go to --out (default docs/benchmarks/gpu).
# --dry-run prints the plan and checks only the host.
set -uo pipefail
cd "$(dirname "$0")/.."
WHEELS=gpu-wheels PY=${PYTHON:-python3} DRY=0 OUT_DIR=docs/benchmarks/gpu BUDGET=520 STEPS=tests,weight-sync,bench
while [ $# -gt 0 ]; do
  case "$1" in
    --wheels) WHEELS=$2; shift 2 ;;
    --python) PY=$2; shift 2 ;;
    --out) OUT_DIR=$2; shift 2 ;;
    --budget) BUDGET=$2; shift 2 ;;
    --steps) STEPS=$2; shift 2 ;;
    --dry-run) DRY=1; shift ;;
    -h|--help) sed -n '2,27p' "$0"; exit 0 ;;
    *) echo "gpu.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
run() { echo "+ $*"; [ "$DRY" = 1 ] || "$@"; }
# Shares of the budget, in percent, of the steps asked for.
declare -A WEIGHT=([tests]=36 [weight-sync]=34 [bench]=30 [profile]=30)
# The weight-sync rows: WS_LEAVES and WS_PATHS override the defaults (rows that
# no longer fit the step's budget are skipped, the one-leaf rows come first).
WS_LEAVES=${WS_LEAVES:-1000,10000} WS_PATHS=${WS_PATHS:-rdt,rdt_donate,store}
TOTAL=0
for step in ${STEPS//,/ }; do
  [ -n "${WEIGHT[$step]:-}" ] || { echo "gpu.sh: unknown step $step (tests, weight-sync, bench, profile)" >&2; exit 2; }
  TOTAL=$(( TOTAL + WEIGHT[$step] ))
done
LOG=/dev/null
[ "$DRY" = 1 ] || { mkdir -p "$OUT_DIR" && LOG="$OUT_DIR/run.log"; }

"$PY" - <<'PY' 2>&1 | tee -a "$LOG"
import platform, subprocess
print("python", platform.python_version(), platform.platform())
try:
  print(subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                       capture_output=True, text=True, timeout=30).stdout.strip())
except Exception as e:  # noqa: BLE001
  print("nvidia-smi:", e)
for name in ("jax", "jaxlib", "torch", "cupy", "numpy", "ml_dtypes"):
  try:
    m = __import__(name)
    print(name, m.__version__)
  except Exception as e:  # noqa: BLE001
    print(name, "missing:", type(e).__name__, e)
import jax
print("jax devices", jax.devices())
import torch
print("torch cuda", torch.version.cuda, torch.cuda.is_available(), torch.cuda.device_count())
PY
CUDA=$("$PY" -c 'import torch; print((torch.version.cuda or "").split(".")[0] if torch.cuda.is_available() else "")' 2>/dev/null)
if [ -z "$CUDA" ]; then
  echo "gpu.sh: no CUDA GPU found: torch.cuda.is_available() is False for $PY. Run this on a GPU host" >&2
  echo "whose Python has CUDA builds of jax and torch (pass it with --python)." >&2
  exit 3
fi
if [ "$DRY" = 0 ] && [ ! -d "$WHEELS" ]; then
  echo "gpu.sh: wheel folder $WHEELS not found; make it with scripts/gpu_wheels.sh --cuda $CUDA." >&2
  exit 4
fi
SITE=$PWD/.gpu-site
run "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
  "$WHEELS"/*.whl 2>&1 | grep -v "Running pip as the 'root' user" | tee -a "$LOG"
export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
# Several processes share the GPU: no process may take 75% of it at its first jax call.
export XLA_PYTHON_CLIENT_PREALLOCATE=false NIXL_LOG_LEVEL=WARN PYTHONUNBUFFERED=1
[ "$DRY" = 1 ] || "$PY" -c "import ray, rdt_jax; print('ray', ray.__version__, 'transports', rdt_jax.register())" 2>&1 | tee -a "$LOG"

wanted() { [[ ",$STEPS," == *",$1,"* ]]; }
share() { echo $(( BUDGET * WEIGHT[$1] / TOTAL )); }
# A step's own --budget: 85% of its share, the rest for ending a row cut off
# by it (Ray's shutdown, the outputs) before `timeout` ends the step.
own_budget() { echo $(( $(share "$1") * 85 / 100 )); }
ray_logs() {  # what Ray's processes said, after a step that timed out
  for f in $(ls -t /tmp/ray/session_latest/logs/*.err /tmp/ray/session_latest/logs/raylet.out 2>/dev/null | head -8); do
    echo "--- $f"; tail -n 15 "$f"
  done
}
if wanted tests; then
  run timeout "$(share tests)" "$PY" -m pytest tests/gpu -v -rs -p no:cacheprovider --timeout 120 2>&1 \
    | tee "$OUT_DIR/tests.log"
  echo "tests/gpu exit ${PIPESTATUS[0]}" | tee -a "$LOG"
fi
if wanted weight-sync; then
  run timeout "$(share weight-sync)" "$PY" -m rdt_jax bench --weight-sync --device gpu \
    --weight-sync-generators 1,2,4 --weight-sync-leaves "$WS_LEAVES" --weight-sync-paths "$WS_PATHS" \
    --reps 4 --budget "$(own_budget weight-sync)" --out "$OUT_DIR" 2>&1 | tee -a "$LOG"
  status=${PIPESTATUS[0]}
  echo "weight-sync exit $status" | tee -a "$LOG"
  [ "$status" != 124 ] || ray_logs >> "$LOG" 2>&1
fi
if wanted profile; then  # not a default step: where the plain device path's time goes, per side
  run timeout "$(share profile)" "$PY" scripts/profile_overhead.py --device gpu --leaves 1,1000 \
    --one-bytes 268435456 --bytes 67108864 --reps 5 --profile --top 25 2>&1 | tee "$OUT_DIR/profile-gpu.txt"
  echo "profile exit ${PIPESTATUS[0]}" | tee -a "$LOG"
fi
if wanted bench; then
  run timeout "$(share bench)" "$PY" -m rdt_jax bench --device gpu --label gpu --reps 5 --no-pause \
    --paths jax_nixl,jax_transfer,ray_nixl_torch,ray_cuda_ipc_torch,object_store_jax,device_memcpy \
    --cases gpu:4KiB,gpu:64MiB,gpu:256MiB,gpu:tree1000 --out "$OUT_DIR" 2>&1 | tee -a "$LOG"
  status=${PIPESTATUS[0]}
  echo "bench exit $status" | tee -a "$LOG"
  [ "$status" != 124 ] || ray_logs >> "$LOG" 2>&1
fi
