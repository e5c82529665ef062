#!/usr/bin/env bash
# Runs the contract-level test modules on the tested combinations other than
# the main one (.venv: Python 3.11, Ray 2.60, jax 0.10, torch; scripts/test.sh
# runs the whole suite there). One venv per leg, created on first use and
# reused while pyproject.toml and this script are unchanged; pip caches the
# downloads. Prints each leg's pytest summary and wall time.
#
#   bash scripts/matrix.sh            # every leg (a leg whose Python is not
#                                     # installed is skipped with a loud line;
#                                     # with CI=true it fails)
#   bash scripts/matrix.sh ray259     # one leg (ray259 | py312)
#   MATRIX_SETUP_ONLY=1 bash scripts/matrix.sh   # create the venvs, run nothing
#   MATRIX_CHECK_ONLY=1 bash scripts/matrix.sh   # only check each leg's Python is here
#   MATRIX_SUMMARY=docs/matrix/ray_matrix.md bash scripts/matrix.sh   # and write the docs table
#
# Legs:
#   ray259  Python 3.11, Ray 2.59.0, jax 0.10.2, torch 2.13 (CPU): the
#           Ray-integration module (RAY_MODULES)
#   py312   Python 3.12, Ray 2.60.0, the newest jax pip offers (0.12.x), and
#           torch only where a CPU build can be had (scripts/install_torch.py
#           --optional; on a GPU host, the CUDA build): PyPI's torch for 3.12
#           is a multi-GB CUDA build. nixl-cu12 requires torch, so NIXL is
#           installed without its dependencies (it imports torch only when
#           given torch tensors); without torch, tests that need it skip.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD

# The modules that cover the public contract on another Python and jax:
# jax_nixl end to end (test_nixl), every backend (test_backends), mixed
# frameworks, receive_as, targets and sharding (test_mixed), the DLPack layer
# (test_dlpack). The seam's own module (test_ray_integration) depends on Ray's
# version, not Python's: it runs on both Ray versions under Python 3.11 (the
# suite and the ray259 leg), and every transfer here goes through the seam.
MODULES=(tests/test_nixl.py tests/test_backends.py tests/test_mixed.py tests/test_dlpack.py)
# The module that depends on Ray's version: registration and every touch of
# Ray's internals (the seam), checked at install. The ray259 leg runs only
# this: Ray 2.59's RDT files (manager, serialization, transport interface)
# are byte-identical to 2.60's, and its jax, jaxlib and torch are the main
# venv's, so the transports and conversions run as in the full suite.
RAY_MODULES=(tests/test_ray_integration.py)

py311() { PYENV_VERSION=${PY311_VERSION:-3.11.7} python3.11 "$@"; }
py312() { PYENV_VERSION=${PY312_VERSION:-3.12.1} python3.12 "$@"; }

pip_q() {  # runs pip quietly; prints its output only if it fails
  local out
  if ! out=$("$@" 2>&1); then echo "$out" >&2; return 1; fi
}

make_venv() {  # make_venv DIR PYTHON-FUNCTION INSTALL-FUNCTION
  local dir=$1 py=$2 install=$3 stamp=$1/.rdt-jax-matrix
  if [ -f "$stamp" ] && [ "$stamp" -nt pyproject.toml ] && [ "$stamp" -nt scripts/matrix.sh ] \
      && [ "$stamp" -nt scripts/constraints.txt ]; then
    return
  fi
  rm -rf "$dir"
  "$py" -m venv "$dir"
  pip_q "$dir/bin/python" -m pip install -q --no-compile --upgrade pip
  "$install" "$dir/bin/python"
  touch "$stamp"
}

install_ray259() {
  local python=$1
  # torch first, by the rule scripts/setup.sh follows.
  "$python" scripts/install_torch.py
  pip_q "$python" -m pip install -q --no-compile -c scripts/constraints.txt -e ".[torch,test]" "ray==2.59.0" "jax==0.10.2" "jaxlib==0.10.2"
  # Ray's own NIXL transport (the interop tests) imports the `nixl` package.
  pip_q "$python" -m pip install -q --no-compile --no-deps "nixl==1.5.1"
}

install_py312() {
  local python=$1
  # torch by the same rule, but optional: with no CPU build of torch for
  # Python 3.12 to take (and no GPU), the leg goes on without torch.
  "$python" scripts/install_torch.py --optional
  pip_q "$python" -m pip install -q --no-compile --no-deps "nixl-cu12>=1.5.1,<1.6" "nixl==1.5.1"
  # rdt_jax's dependencies from pyproject.toml, less NIXL (installed above
  # without its torch requirement), with the newest jax in range.
  pip_q "$python" -m pip install -q --no-compile --no-deps -e .
  "$python" - <<'PY' > /tmp/rdt-jax-py312-reqs.txt
import tomllib
p = tomllib.load(open("pyproject.toml", "rb"))["project"]
reqs = [r for r in p["dependencies"] if not r.startswith("nixl")]
print("\n".join(reqs + p["optional-dependencies"]["test"]))
PY
  pip_q "$python" -m pip install -q --no-compile -r /tmp/rdt-jax-py312-reqs.txt "ray==2.60.0"
  pip_q "$python" -m pip install -q --no-compile --upgrade "jax<0.13" "jaxlib<0.13"
}

run_leg() {  # run_leg NAME DIR MODULE...
  local name=$1 dir=$2 start end rc=0
  shift 2
  local modules=("$@")
  echo "=== matrix leg $name: $("$dir/bin/python" -c 'import sys, ray, jax; print(f"Python {sys.version.split()[0]}, Ray {ray.__version__}, jax {jax.__version__}")')"
  start=$(date +%s)
  (
    cd "$REPO"
    PYTHONPATH="$REPO" "$dir/bin/python" -m pytest "${modules[@]}" -q -p no:cacheprovider --timeout 600
  ) || rc=$?
  end=$(date +%s)
  echo "=== matrix leg $name: exit $rc, tests $((end - start)) s"
  return $rc
}

leg_python_found() {  # leg_python_found LEG: whether the leg's interpreter runs here
  case $1 in
    ray259) py311 -c pass >/dev/null 2>&1 ;;
    py312) py312 -c pass >/dev/null 2>&1 ;;
    *) return 0 ;;
  esac
}

main() {
  local legs=("$@") status=0 leg start dir modules
  [ ${#legs[@]} -gt 0 ] || legs=(ray259 py312)
  for leg in "${legs[@]}"; do
    start=$(date +%s)
    if ! leg_python_found "$leg"; then
      if [ "${CI:-}" = "true" ]; then
        echo "=== matrix leg $leg: FAILED: its Python is not installed on this host (CI=true)" >&2
        status=1
      else
        echo "=== matrix leg $leg: SKIPPED: its Python is not installed on this host (install it, e.g. with pyenv, to run this leg)" >&2
      fi
      continue
    fi
    [ -z "${MATRIX_CHECK_ONLY:-}" ] || continue
    case $leg in
      ray259) make_venv .venv-ray259 py311 install_ray259; dir=.venv-ray259; modules=("${RAY_MODULES[@]}") ;;
      py312) make_venv .venv-py312 py312 install_py312; dir=.venv-py312; modules=("${MODULES[@]}") ;;
      *) echo "unknown leg $leg (ray259 | py312)" >&2; return 2 ;;
    esac
    echo "=== matrix leg $leg: venv ready in $(( $(date +%s) - start )) s"
    [ -z "${MATRIX_SETUP_ONLY:-}" ] || continue
    run_leg "$leg" "$dir" "${modules[@]}" || status=1
  done
  return $status
}

# MATRIX_SUMMARY=docs/matrix/ray_matrix.md also writes the table that
# docs/ray_integration.md includes, from this run's output.
if [ -n "${MATRIX_SUMMARY:-}" ]; then
  log=$(mktemp)
  status=0
  main "$@" 2>&1 | tee "$log" || status=$?
  .venv/bin/python scripts/matrix_summary.py "$log" > "$MATRIX_SUMMARY" 2>/dev/null \
    || python3 scripts/matrix_summary.py "$log" > "$MATRIX_SUMMARY"
  rm -f "$log"
  exit $status
fi
main "$@"
