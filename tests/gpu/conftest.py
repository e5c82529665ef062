"""GPU tests: collected everywhere, run only where torch and jax see CUDA.

On a host without CUDA every test here is skipped with the reason, never an
error. `scripts/gpu.sh` runs them on a GPU host.
"""

from __future__ import annotations

import pytest

from rdt_jax import _memory


def cuda_skip_reason() -> str | None:
  """None if this host can run the GPU tests, else why not."""
  missing = [fw for fw in ("jax", "torch") if not _memory.cuda_available(fw)]
  if missing:
    return f"no CUDA device visible to {' and '.join(missing)} on this host"
  return None


def pytest_collection_modifyitems(config, items):
  reason = cuda_skip_reason()
  if reason is None:
    return
  here = str(config.rootpath / "tests" / "gpu")
  for item in items:
    if str(item.fspath).startswith(here):
      item.add_marker(pytest.mark.skip(reason=reason))
