#!/usr/bin/env bash
# Sets up .venv and runs the demo: a JAX learner sends its parameters to two
# workers over jax_nixl, next to the same transfer through Ray's object store.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
python examples/demo.py "$@"
