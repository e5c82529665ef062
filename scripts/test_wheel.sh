#!/usr/bin/env bash
# The wheel is what users get. Builds it, checks that it holds every file of
# the source package (rdt_jax/), installs it, not editable, into a fresh
# virtual environment (.venv-wheel), and runs the contract tests against it
# from a copy of tests/ outside the source tree, so that neither the driver nor
# Ray's workers can import rdt_jax/ from here.
# Usage: bash scripts/test_wheel.sh [pytest args]  (scripts/test.sh runs it)
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
bash scripts/setup.sh  # .venv builds the wheel and runs the check
PY=${PYTHON:-python3}
# Test modules that exercise the public API (and the one checking where
# rdt_jax is imported from). They may import only tests/ modules.
# The transfers: jax_nixl end to end through Ray, every dtype, driver gets and
# puts, and the error when a consumer lacks NIXL (the whole of test_nixl runs
# in the suite and in the matrix).
CONTRACT_TESTS=(
  tests/test_installed.py
  tests/test_nixl.py::test_pytree_reaches_consumer_bit_exact
  tests/test_nixl.py::test_every_dtype
  tests/test_nixl.py::test_driver_get
  tests/test_nixl.py::test_driver_put_to_actor
  tests/test_nixl.py::test_nixl_missing_on_consumer
)

start=$SECONDS
# A clean build: setuptools copies into build/lib but never deletes there, so
# a module removed (or moved) since the last build would stay in the wheel.
rm -rf build
.venv/bin/python -m pip wheel --no-deps -q -w build/wheel .
wheel=$(echo build/wheel/rdt_jax-*.whl)

# Every file of the source package is in the wheel, and nothing else is.
.venv/bin/python - "$wheel" <<'EOF'
import pathlib
import sys
import zipfile

wheel = sys.argv[1]
tree = {
    p.as_posix()
    for p in pathlib.Path("rdt_jax").rglob("*")
    if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"
}
packed = {n for n in zipfile.ZipFile(wheel).namelist() if n.startswith("rdt_jax/")}
missing, extra = sorted(tree - packed), sorted(packed - tree)
assert "rdt_jax/py.typed" in tree, "rdt_jax/py.typed is missing from the source tree"
if missing or extra:
  sys.exit(
      f"{wheel} does not match rdt_jax/:\n"
      + "".join(f"  missing from the wheel: {n}\n" for n in missing)
      + "".join(f"  in the wheel, not in rdt_jax/: {n}\n" for n in extra)
      + "Package data other than .py files needs [tool.setuptools.package-data] "
      "in pyproject.toml."
  )
print(f"{wheel}: all {len(tree)} files of rdt_jax/")
EOF

# A fresh environment with what a user installs: the wheel and its extras
# (torch first, by the rule scripts/setup.sh follows), not the nixl meta
# package setup.sh adds for Ray's own transport.
venv=$repo/.venv-wheel
"$PY" -m venv --clear "$venv"
"$venv/bin/python" scripts/install_torch.py
"$venv/bin/python" -m pip install -q --no-compile "$wheel[torch,test,testing]"
site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "wheel installed in $venv ($((SECONDS - start)) s)"

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cp -r tests "$work/tests"
find "$work/tests" -name __pycache__ -prune -exec rm -rf {} +
cd "$work"
# Only the fresh environment: no PYTHONPATH, no .venv on PATH. Ray puts the
# driver's working directory (here: $work) on its workers' sys.path.
path=":$PATH:"
path=${path//":$repo/.venv/bin:"/:}
path=${path#:}
in_venv() {
  env -u PYTHONPATH -u VIRTUAL_ENV PATH="$venv/bin:${path%:}" "$@"
}
in_venv rdt-jax --help >/dev/null  # the console script is installed and starts
# tests/test_installed.py checks that the driver and a worker import rdt_jax
# from $site.
RDT_JAX_EXPECT_INSTALLED_IN="$site" \
  in_venv python -m pytest -p no:cacheprovider -ra "${CONTRACT_TESTS[@]}" "$@"
echo "wheel check done in $((SECONDS - start)) s"
