#!/usr/bin/env bash
# Sets up .venv and runs the test suite (and the docs build, warnings as errors),
# then, for the full suite (no pytest args), the wheel check: the contract
# tests against the built wheel installed in a fresh environment.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
python -m pytest tests "$@"
if [ $# -eq 0 ]; then
  bash scripts/test_wheel.sh
fi
