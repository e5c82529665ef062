#!/usr/bin/env bash
# Downloads, on a machine with internet, the wheels scripts/gpu.sh installs on
# a GPU host without internet: Ray, NIXL for the host's CUDA major version and
# Ray's dependencies that GPU images often lack. Assumes the GPU host's Python
# already has CUDA builds of jax and torch (and optionally cupy); rdt_jax runs
# from the checkout.
#
#   scripts/gpu_wheels.sh [--out DIR] [--cuda 12|13] [--python-version 3.12] [--dry-run]
#
# What rdt_jax never uses is stripped from the two large wheels, which brings
# them to about 56 MB together: Ray's Java jars, dashboard web client and
# libraries (data, serve, tune, train, rllib, llm); NIXL's expert-parallel
# kernels, storage plugins (GDS, object stores, ...) and the libraries only
# they load. NIXL keeps its UCX and POSIX plugins.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=gpu-wheels PYV=3.12 DRY=0 CUDA=13
while [ $# -gt 0 ]; do
  case "$1" in
    --out) OUT=$2; shift 2 ;;
    --cuda) CUDA=$2; shift 2 ;;
    --python-version) PYV=$2; shift 2 ;;
    --dry-run) DRY=1; shift ;;
    -h|--help) sed -n '2,15p' "$0"; exit 0 ;;
    *) echo "gpu_wheels.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
case "$CUDA" in 12|13) ;; *) echo "gpu_wheels.sh: --cuda 12 or 13" >&2; exit 2 ;; esac
# The main tested combination's Ray (docs/ray_integration.md); RAY_VERSION=2.59.0
# picks the other tested minor.
RAY=${RAY_VERSION:-2.60.0}
NIXL=$(sed -n 's/.*"nixl-cu12>=\([0-9.]*\),.*/\1/p' pyproject.toml | head -1)
PLAT="--platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64"
run() { echo "+ $*"; [ "$DRY" = 1 ] || "$@"; }
run mkdir -p "$OUT"
run python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PYV" --implementation cp $PLAT \
  -d "$OUT" "ray==$RAY" "nixl==$NIXL" "nixl-cu$CUDA==$NIXL" \
  jsonschema jsonschema-specifications referencing rpds-py

strip() {  # strip WHEEL PATTERN...: deletes the members matching any pattern
  local whl=$1; shift
  if [ "$DRY" = 1 ]; then echo "+ strip $whl $*"; return; fi
  local names
  names=$(python3 - "$whl" "$@" <<'PY'
import fnmatch, sys, zipfile
whl, patterns = sys.argv[1], sys.argv[2:]
print("\n".join(n for n in zipfile.ZipFile(whl).namelist() if any(fnmatch.fnmatch(n, p) for p in patterns)))
PY
)
  [ -z "$names" ] || echo "$names" | run xargs zip -q -d "$whl"
}
strip "$OUT"/ray-"$RAY"-*.whl 'ray/jars/*' 'ray/dashboard/client/*' 'ray/rllib/*' 'ray/llm/*' \
  'ray/data/*' 'ray/serve/*' 'ray/tune/*' 'ray/train/*' 'ray/air/*'
strip "$OUT"/nixl_cu"$CUDA"-*.whl "nixl_ep_cu$CUDA/*" "*/ucx/libucx_perftest*" "nixl_cu$CUDA-*.data/headers/*" \
  "nixl_cu$CUDA.scripts/*" '*/libplugin_AZURE_BLOB.so' '*/libplugin_GDS*.so' '*/libplugin_GPUNETIO.so' \
  '*/libplugin_GUSLI.so' '*/libplugin_INFINIA.so' '*/libplugin_LIBFABRIC.so' '*/libplugin_OBJ.so' \
  '*/libtelemetry_exporter_*.so' '*/libtrace_backend_*.so' '*/libaws-cpp-sdk-s3*' '*/libazure-*' \
  '*/libgusli_clnt-*' '*/libpull-*' '*/libxml2-*'
recompress() {  # recompress WHEEL: the same members, LZMA-compressed
  if [ "$DRY" = 1 ]; then echo "+ recompress $1"; return; fi
  python3 - "$1" <<'PY'
import os, sys, zipfile
whl = sys.argv[1]
with zipfile.ZipFile(whl) as src, zipfile.ZipFile(whl + ".tmp", "w", zipfile.ZIP_LZMA) as dst:
  for info in src.infolist():
    dst.writestr(info, src.read(info.filename), compress_type=zipfile.ZIP_LZMA)
os.replace(whl + ".tmp", whl)
PY
}
recompress "$OUT"/ray-"$RAY"-*.whl
recompress "$OUT"/nixl_cu"$CUDA"-*.whl
[ "$DRY" = 1 ] || du -sh "$OUT"
echo "wheels in $OUT; copy the folder to the GPU host and run scripts/gpu.sh --wheels $OUT"
