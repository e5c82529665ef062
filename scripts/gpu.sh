#!/usr/bin/env bash
# Sets up and runs rdt_jax's GPU checks on a GPU host without internet whose
# Python already has CUDA builds of jax and torch:
#
#   scripts/gpu.sh [--wheels DIR] [--python PY] [--quick] [--dry-run]
#
# 1. detects the host's CUDA major version (torch.version.cuda, else nvidia-smi);
# 2. installs Ray, the matching NIXL (nixl-cu12 or nixl-cu13) and rdt_jax from
#    the wheel folder made by scripts/gpu_wheels.sh (chunks are joined first),
#    with --no-index: nothing is downloaded;
# 3. runs tests/gpu and `rdt-jax bench --device gpu`, writing their logs to
#    docs/benchmarks/gpu/.
# --dry-run prints the plan and checks only the host (CUDA, Python packages).
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=gpu-wheels PY=${PYTHON:-python3} DRY=0 QUICK=""
while [ $# -gt 0 ]; do
  case "$1" in
    --wheels) WHEELS=$2; shift 2 ;;
    --python) PY=$2; shift 2 ;;
    --quick) QUICK=--quick; shift ;;
    --dry-run) DRY=1; shift ;;
    -h|--help) sed -n '2,14p' "$0"; exit 0 ;;
    *) echo "gpu.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
run() { echo "+ $*"; [ "$DRY" = 1 ] || "$@"; }

CUDA=$("$PY" - <<'PY' 2>/dev/null || true
try:
  import torch
  print((torch.version.cuda or "").split(".")[0] if torch.cuda.is_available() else "")
except Exception:
  print("")
PY
)
if [ -z "$CUDA" ] && command -v nvidia-smi >/dev/null 2>&1; then
  CUDA=$(nvidia-smi 2>/dev/null | sed -n 's/.*CUDA Version: *\([0-9]*\).*/\1/p' | head -1)
fi
if [ -z "$CUDA" ]; then
  echo "gpu.sh: no CUDA GPU found: torch.cuda.is_available() is False for $PY and" >&2
  echo "nvidia-smi reports no CUDA version. Run this on a GPU host whose Python has" >&2
  echo "CUDA builds of jax and torch (pass it with --python)." >&2
  exit 3
fi
case "$CUDA" in
  12) NIXL=nixl-cu12 ;;
  13) NIXL=nixl-cu13 ;;
  *) echo "gpu.sh: CUDA $CUDA found; NIXL wheels exist for CUDA 12 and 13 only." >&2; exit 3 ;;
esac
echo "CUDA $CUDA: installing $NIXL; python $("$PY" -c 'import sys; print(sys.version.split()[0])')"
"$PY" -c "import jax; assert jax.devices('gpu'), 'no jax gpu device'" \
  || { echo "gpu.sh: jax in $PY has no GPU backend (install a CUDA build of jax)." >&2; exit 3; }

if [ "$DRY" = 0 ] && [ ! -d "$WHEELS" ]; then
  echo "gpu.sh: wheel folder $WHEELS not found; make it with scripts/gpu_wheels.sh." >&2
  exit 4
fi
for part in "$WHEELS"/*.part-00; do
  [ -e "$part" ] || continue
  run sh -c "cat '${part%.part-00}'.part-* > '${part%.part-00}' && rm '${part%.part-00}'.part-*"
done
run "$PY" -m pip install -q --no-index --find-links "$WHEELS" ray "$NIXL" rdt_jax pytest pytest-timeout
run "$PY" -m pip install -q --no-index --find-links "$WHEELS" --no-deps nixl

LOGS=docs/benchmarks/gpu
run mkdir -p "$LOGS"
stamp=$(git rev-parse --short HEAD 2>/dev/null || echo local)
run sh -c "'$PY' -m pytest tests/gpu -v -rs --timeout 900 2>&1 | tee '$LOGS/tests-$stamp.log'"
run sh -c "'$PY' -m rdt_jax bench --device gpu $QUICK --out '$LOGS/bench-$stamp' 2>&1 | tee '$LOGS/bench-$stamp.log'"
