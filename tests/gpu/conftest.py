"""GPU tests: collected everywhere, run only where torch and jax see CUDA.

On a host without CUDA every test here is skipped with the reason, never an
error. `scripts/gpu.sh` runs them on a GPU host.

What the modules share: the Ray session (`gpu_ray`), the GPU count, the
actors' environment and their share of a GPU. Modules import the constants
as `from gpu.conftest import ...` (tests/ is on the path of the driver and
of every worker).
"""

from __future__ import annotations

import os
import pathlib

import pytest
import ray

import rdt_jax
from rdt_jax import _memory

#: Every actor's environment: it takes a share of one GPU, so XLA's
#: preallocation is off (docs/gpu.md: the memory rule).
GPU_ENV = {"XLA_PYTHON_CLIENT_PREALLOCATE": "false", "NIXL_LOG_LEVEL": "WARN"}
#: Each actor's share of the GPU: a module's actors fit on one GPU together.
SHARE = 0.1


def gpu_count() -> int:
  """The CUDA devices torch sees here (0 without torch or CUDA)."""
  try:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0
  except ImportError:
    return 0


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


@pytest.fixture(scope="module")
def gpu_ray():
  """A local Ray for the module with every local GPU, its workers able to
  import the GPU test modules (and rdt_jax) and run in `GPU_ENV`."""
  here = pathlib.Path(__file__).resolve().parent
  paths = [str(here), str(here.parent), str(here.parents[1]), os.environ.get("PYTHONPATH", "")]
  rdt_jax.register()
  ray.init(
      num_cpus=8,
      num_gpus=gpu_count(),
      include_dashboard=False,
      logging_level="warning",
      runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join(p for p in paths if p), **GPU_ENV}},
  )
  yield
  ray.shutdown()
