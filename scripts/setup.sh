#!/usr/bin/env bash
# Creates .venv (if needed) and installs rdt_jax with everything the demo,
# tests, benchmark and docs use. Idempotent: a second run installs nothing new.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
stamp=.venv/.rdt-jax-setup
# --no-compile: pip would byte-compile every module of torch, jax and Ray (about
# half of an install's time here); Python compiles the modules a process
# imports, once, on first import.
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ scripts/setup.sh -nt "$stamp" ] \
    || [ scripts/constraints.txt -nt "$stamp" ]; then
  python -m pip install -q --no-compile --upgrade pip
  # torch first, by the one rule (scripts/install_torch.py): nixl-cu12
  # requires `torch`, and pip alone would take PyPI's CUDA build, several GB.
  # Without an NVIDIA GPU the rule takes a CPU build, or stops here with the
  # command that installs one.
  python scripts/install_torch.py
  # scripts/constraints.txt: what the development environment pins, and why.
  python -m pip install -q --no-compile -c scripts/constraints.txt -e ".[torch,test,testing,bench,docs]"
  # `import nixl` (Ray's built-in NIXL transport, our benchmark's baseline)
  # needs the `nixl` meta package; --no-deps keeps it from pulling the CUDA 13
  # build: the meta package then uses the nixl-cu12 we already have.
  python -m pip install -q --no-compile --no-deps "nixl==1.5.1"
  touch "$stamp"
fi
