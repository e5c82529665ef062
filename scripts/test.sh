#!/usr/bin/env bash
# Sets up .venv and runs the test suite (and the docs build, warnings as errors).
# For the full suite (no pytest args, as CI runs it) it first lints (ruff, mypy)
# and afterwards runs the wheel check: the contract tests against the built
# wheel installed in a fresh environment.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
if [ $# -eq 0 ]; then
  bash scripts/lint.sh
fi
python -m pytest tests "$@"
if [ $# -eq 0 ]; then
  bash scripts/test_wheel.sh
fi
