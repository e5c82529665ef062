"""Shared fixtures: one local Ray session per test module.

Helpers the modules share (arrays, digests, waiting) live in `_helpers`.
"""

from __future__ import annotations

import os
import pathlib

import pytest
import ray

# Re-exported: test modules use them as conftest.wait_for / conftest.wait_meta.
from _helpers import wait_for, wait_meta  # noqa: F401

TESTS_DIR = pathlib.Path(__file__).parent
REPO = TESTS_DIR.parent
# Workers import the test modules' actor and transport classes by reference.
# examples/ too: a transport registered by one test module (the shm example)
# stays in this process's Ray registry for the modules after it, whose new
# actors then receive it, so their workers must be able to import it.
# Not the repository root: workers import rdt_jax as installed (editable in
# .venv, from the wheel in scripts/test_wheel.sh), like the driver.
WORKER_PYTHONPATH = os.pathsep.join([str(TESTS_DIR), str(REPO / "examples")])


def start_ray(**kwargs) -> None:
  """Starts a local Ray for one test module, workers able to import tests."""
  import rdt_jax

  rdt_jax.register()
  runtime_env = kwargs.pop("runtime_env", {})
  env_vars = {"PYTHONPATH": WORKER_PYTHONPATH, **runtime_env.pop("env_vars", {})}
  ray.init(
      # A new local cluster even when another process on this machine has
      # `ray start`ed one (ray.init() would join it, and refuse num_cpus).
      address=kwargs.pop("address", "local"),
      num_cpus=kwargs.pop("num_cpus", 8),
      include_dashboard=False,
      logging_level="warning",
      runtime_env={"env_vars": env_vars, **runtime_env},
      **kwargs,
  )


@pytest.fixture(scope="module")
def ray_session():
  start_ray()
  yield
  ray.shutdown()
