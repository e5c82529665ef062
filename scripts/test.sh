#!/usr/bin/env bash
# Sets up .venv and runs the test suite (and the docs build, warnings as errors).
# For the full suite (no pytest args, as CI runs it) it first lints (ruff, mypy)
# and afterwards runs the wheel check (the contract tests against the built
# wheel installed in a fresh environment) and the version matrix; the pytest
# stage writes its slowest tests to docs/development/test-durations.txt.
# `--fast` (the loop to run while working, a few minutes): lint, then the tests
# that start no Ray (minus the Sphinx builds) and one Ray smoke test
# (tests/_selection.py).
# Usage: bash scripts/test.sh | bash scripts/test.sh --fast | bash scripts/test.sh <pytest args>
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
# Bytecode of rdt_jax and the tests is written once and reused by every Ray
# worker the suite starts (an environment may turn writing it off).
unset PYTHONDONTWRITEBYTECODE
if [ $# -eq 0 ]; then
  # A matrix leg's missing Python is reported now, not after the suite
  # (fatal with CI=true).
  MATRIX_CHECK_ONLY=1 bash scripts/matrix.sh
  bash scripts/lint.sh
  RDT_JAX_TEST_DURATIONS=docs/development/test-durations.txt python -m pytest tests
  bash scripts/test_wheel.sh
  # Contract-level modules on Ray 2.59 and on Python 3.12 with the newest jax
  # (docs/ray_integration.md lists the matrix).
  bash scripts/matrix.sh
elif [ "$1" = "--fast" ]; then
  shift
  bash scripts/lint.sh
  python -m pytest tests --fast "$@"
else
  python -m pytest tests "$@"
fi
