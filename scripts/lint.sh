#!/usr/bin/env bash
# Lints with the versions pinned in the `test` extra: ruff over the package,
# tests and examples; mypy over the package (settings in pyproject.toml).
# Usage: bash scripts/lint.sh  (exits non-zero if either reports a finding)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
status=0
ruff check rdt_jax tests examples || status=1
mypy || status=1
exit $status
