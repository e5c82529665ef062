#!/usr/bin/env bash
# Sets up .venv and runs the test suite (and the docs build, warnings as errors).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
python -m pytest tests "$@"
