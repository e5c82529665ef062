#!/usr/bin/env bash
# Runs rdt_jax's GPU checks on a GPU host without internet whose Python
# already has CUDA builds of jax and torch (cupy optional), within one lend
# of a GPU machine (about 10 minutes with the default budget):
#
#   scripts/gpu.sh [--wheels DIR] [--python PY] [--out DIR] [--budget S] [--steps LIST] [--dry-run | --plan]
#
# 1. prints the host (GPU, driver, Python, jax, torch, cupy);
# 2. installs Ray, NIXL and Ray's missing dependencies from the wheel folder
#    made by scripts/gpu_wheels.sh into .gpu-site/ (--no-index --no-deps:
#    nothing is downloaded, the host's packages are left as they are); rdt_jax
#    runs from this checkout;
# 3. runs, each under its share of --budget seconds (default 500) and in this
#    order: the device-to-device cases of `rdt-jax bench --device gpu` (plain
#    returns: jax_nixl by default and with CUDA IPC reads on, jax_transfer,
#    Ray's NIXL and CUDA_IPC with torch, the object store, the device memcpy
#    limit; 4 KiB, 64 MiB, 256 MiB and 1,000 leaves); tests/gpu in full;
#    `rdt-jax bench --weight-sync --device gpu` (weights in device memory; 1,
#    2 and 4 generators; one leaf, 1,000 and 10,000 leaves, or WS_LEAVES; the
#    paths rdt, rdt_donate and store, or WS_PATHS); and the device profile
#    (scripts/profile_overhead.py --device gpu: the per-side split of one
#    256 MiB array and of 1,000 leaves). Each benchmark gets 85% of its share
#    as its own --budget, so it skips the rows that no longer fit and ends
#    with its outputs written; after a step that ran out of time, the end of
#    Ray's logs. --steps picks some of them (comma-separated: bench, tests,
#    weight-sync, profile); the budget is shared by those;
# 4. prints a summary: each step's exit status and seconds, tests/gpu's
#    result line, and the plain-return times and ratios of jax_nixl with CUDA
#    IPC reads (run.log keeps it with the rest).
# Logs and benchmark files go to --out (default docs/benchmarks/gpu).
# --dry-run prints the plan and checks only the host; --plan prints each
# step's share of the budget and exits, on any host.
set -uo pipefail
cd "$(dirname "$0")/.."
WHEELS=gpu-wheels PY=${PYTHON:-python3} DRY=0 PLAN=0 OUT_DIR=docs/benchmarks/gpu BUDGET=500 STEPS=bench,tests,weight-sync,profile
while [ $# -gt 0 ]; do
  case "$1" in
    --wheels) WHEELS=$2; shift 2 ;;
    --python) PY=$2; shift 2 ;;
    --out) OUT_DIR=$2; shift 2 ;;
    --budget) BUDGET=$2; shift 2 ;;
    --steps) STEPS=$2; shift 2 ;;
    --dry-run) DRY=1; shift ;;
    --plan) PLAN=1; shift ;;
    -h|--help) sed -n '2,33p' "$0"; exit 0 ;;
    *) echo "gpu.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
run() { echo "+ $*"; [ "$DRY" = 1 ] || "$@"; }
# Shares of the budget, in percent, of the steps asked for: tests/gpu took
# 149 s for 28 tests on one H200; the benchmarks end within their own budget.
declare -A WEIGHT=([tests]=41 [weight-sync]=24 [bench]=20 [profile]=15)
# The weight-sync rows: WS_LEAVES and WS_PATHS override the defaults (rows that
# no longer fit the step's budget are skipped, the one-leaf rows come first).
WS_LEAVES=${WS_LEAVES:-1000,10000} WS_PATHS=${WS_PATHS:-rdt,rdt_donate,store}
TOTAL=0
for step in ${STEPS//,/ }; do
  [ -n "${WEIGHT[$step]:-}" ] || { echo "gpu.sh: unknown step $step (bench, tests, weight-sync, profile)" >&2; exit 2; }
  TOTAL=$(( TOTAL + WEIGHT[$step] ))
done
wanted() { [[ ",$STEPS," == *",$1,"* ]]; }
share() { echo $(( BUDGET * WEIGHT[$1] / TOTAL )); }
# A step's own --budget: 85% of its share, the rest for ending a row cut off
# by it (Ray's shutdown, the outputs) before `timeout` ends the step.
own_budget() { echo $(( $(share "$1") * 85 / 100 )); }
if [ "$PLAN" = 1 ]; then
  for step in bench tests weight-sync profile; do
    wanted "$step" || continue
    case "$step" in
      bench|weight-sync) echo "$step: $(share "$step") s (the benchmark's own --budget $(own_budget "$step") s)" ;;
      *) echo "$step: $(share "$step") s" ;;
    esac
  done
  exit 0
fi
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

SUMMARY=()
record() {  # a step's exit status and seconds, for the log and the summary
  local line="$1 exit $2 in $(( SECONDS - began )) s"
  echo "$line" | tee -a "$LOG"
  SUMMARY+=("$line")
}
ray_logs() {  # what Ray's processes said, after a step that timed out
  for f in $(ls -t /tmp/ray/session_latest/logs/*.err /tmp/ray/session_latest/logs/raylet.out 2>/dev/null | head -8); do
    echo "--- $f"; tail -n 15 "$f"
  done
}
if wanted bench; then
  began=$SECONDS
  run timeout "$(share bench)" "$PY" -m rdt_jax bench --device gpu --label gpu --reps 5 --no-pause \
    --paths jax_nixl,jax_nixl_cuda_ipc,jax_transfer,ray_nixl_torch,ray_cuda_ipc_torch,object_store_jax,device_memcpy \
    --cases gpu:4KiB,gpu:64MiB,gpu:256MiB,gpu:tree1000 --budget "$(own_budget bench)" --out "$OUT_DIR" 2>&1 \
    | tee -a "$LOG"
  status=${PIPESTATUS[0]}
  record bench "$status"
  [ "$status" != 124 ] || ray_logs >> "$LOG" 2>&1
fi
if wanted tests; then
  began=$SECONDS
  run timeout "$(share tests)" "$PY" -m pytest tests/gpu -v -rs -p no:cacheprovider --timeout 120 2>&1 \
    | tee "$OUT_DIR/tests.log"
  record tests/gpu "${PIPESTATUS[0]}"
fi
if wanted weight-sync; then
  began=$SECONDS
  run timeout "$(share weight-sync)" "$PY" -m rdt_jax bench --weight-sync --device gpu \
    --weight-sync-generators 1,2,4 --weight-sync-leaves "$WS_LEAVES" --weight-sync-paths "$WS_PATHS" \
    --reps 4 --budget "$(own_budget weight-sync)" --out "$OUT_DIR" 2>&1 | tee -a "$LOG"
  status=${PIPESTATUS[0]}
  record weight-sync "$status"
  [ "$status" != 124 ] || ray_logs >> "$LOG" 2>&1
fi
if wanted profile; then
  began=$SECONDS  # where the plain device path's time goes, per side
  run timeout "$(share profile)" "$PY" scripts/profile_overhead.py --device gpu --leaves 1,1000 \
    --one-bytes 268435456 --bytes 67108864 --reps 5 --profile --top 25 2>&1 | tee "$OUT_DIR/profile-gpu.txt"
  record profile "${PIPESTATUS[0]}"
fi
{
  echo "=== gpu.sh summary (budget $BUDGET s, steps $STEPS, $SECONDS s in all)"
  for line in "${SUMMARY[@]}"; do echo "  $line"; done
  [ ! -f "$OUT_DIR/tests.log" ] || grep -E "^=+ .*(passed|failed|error).* in " "$OUT_DIR/tests.log" | tail -n 1
  if [ -f "$OUT_DIR/bench-gpu.md" ]; then
    # The plain returns' times, and jax_nixl's with CUDA IPC reads against each baseline.
    awk '/^## End-to-end time/ || /^## jax_nixl_cuda_ipc: ratio/ {on=1} on && /^## / && !/End-to-end|jax_nixl_cuda_ipc/ {on=0} on' \
      "$OUT_DIR/bench-gpu.md"
  fi
} 2>&1 | tee -a "$LOG"
