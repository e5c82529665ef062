#!/usr/bin/env bash
# Downloads, on a machine with internet, the wheels scripts/gpu.sh installs on
# a GPU host without internet: Ray, NIXL for CUDA 12 and 13, their small
# pure-Python dependencies, and rdt_jax itself. Assumes the GPU host's Python
# already has CUDA builds of jax and torch (and optionally cupy).
#
#   scripts/gpu_wheels.sh [--out DIR] [--python-version 3.12] [--dry-run]
#
# Large wheels are split into 60 MiB chunks (DIR/*.part-NN) when --split is
# given, after stripping what rdt_jax never uses (ray/jars/, nixl_ep_cu13/).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=gpu-wheels PYV=3.12 DRY=0 SPLIT=0
while [ $# -gt 0 ]; do
  case "$1" in
    --out) OUT=$2; shift 2 ;;
    --python-version) PYV=$2; shift 2 ;;
    --dry-run) DRY=1; shift ;;
    --split) SPLIT=1; shift ;;
    -h|--help) sed -n '2,11p' "$0"; exit 0 ;;
    *) echo "gpu_wheels.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
# The main tested combination's Ray (docs/ray_integration.md); RAY_VERSION=2.59.0
# picks the other tested minor.
RAY=${RAY_VERSION:-2.60.0}
NIXL=$(sed -n 's/.*"nixl-cu12>=\([0-9.]*\),.*/\1/p' pyproject.toml | head -1)
PLAT="--platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64"
run() { echo "+ $*"; [ "$DRY" = 1 ] || "$@"; }
run mkdir -p "$OUT"
run python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PYV" $PLAT \
  -d "$OUT" "ray==$RAY" "nixl==$NIXL" "nixl-cu12==$NIXL" "nixl-cu13==$NIXL"
# Ray's runtime dependencies that GPU images often lack (pure Python or abi3).
run python3 -m pip download -q --only-binary=:all: --python-version "$PYV" $PLAT -d "$OUT" \
  "click>=7.0" "filelock" "jsonschema" "msgpack<2.0.0,>=1.0.0" "protobuf>=3.20.3" \
  "pyyaml" "requests" "ml_dtypes" "pytest" "pytest-timeout"
run python3 -m pip wheel -q --no-deps -w "$OUT" .
if [ "$SPLIT" = 1 ]; then
  for whl in "$OUT"/ray-*.whl "$OUT"/nixl_cu13-*.whl; do
    [ -e "$whl" ] || continue
    run zip -q -d "$whl" 'ray/jars/*' 'nixl_ep_cu13/*' || true
    run split -b 60m -d "$whl" "$whl.part-"
    run rm "$whl"
  done
fi
echo "wheels in $OUT; copy the folder to the GPU host and run scripts/gpu.sh --wheels $OUT"
