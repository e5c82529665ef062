"""Shared fixtures: one local Ray session per test module.

Helpers the modules share (arrays, digests, waiting) live in `_helpers`.
"""

from __future__ import annotations

import os
import pathlib
import sys

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
# The driver imports the example transport as a user's module, by name.
sys.path.insert(0, str(REPO / "examples"))


#: The environment of modules that test the out-of-band mechanisms themselves
#: (NIXL READs, registrations, parking, faults, bytes each backend moves):
#: small objects not sent in band (the default, kept explicit), and no
#: node-local reads, so that every object takes the path under test whatever
#: its size. Every other module runs with the defaults, which read a producer
#: on the same host directly (test_cma); in-band sending is opt-in (test_inline).
OUT_OF_BAND_ENV = {"RDT_JAX_INLINE_MAX_BYTES": "0", "RDT_JAX_NIXL_CMA": "0"}
#: Only small objects out of band (node-local reads as by default).
NOT_IN_BAND_ENV = {"RDT_JAX_INLINE_MAX_BYTES": "0"}


def worker_env(**env: str) -> dict:
  """An actor's `runtime_env`: its worker can import the tests, with `env` set
  (fault rules in `RDT_JAX_FAULTS` enabled with `RDT_JAX_FAULTS_ENABLE`)."""
  if env.get("RDT_JAX_FAULTS"):
    env = {"RDT_JAX_FAULTS_ENABLE": "1", **env}
  return {"env_vars": {"PYTHONPATH": WORKER_PYTHONPATH, **env}}


def start_ray(env: dict[str, str] | None = None, **kwargs) -> None:
  """Starts a local Ray for one test module, workers able to import tests.

  `env` is set in this process (restored after the module) and in every
  worker's environment.
  """
  import rdt_jax

  os.environ.update(env or {})
  rdt_jax.register()
  runtime_env = kwargs.pop("runtime_env", {})
  env_vars = {"PYTHONPATH": WORKER_PYTHONPATH, **(env or {}), **runtime_env.pop("env_vars", {})}
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


@pytest.fixture(scope="module", autouse=True)
def _restore_environment():
  """Undoes a module's `start_ray(env=...)` in this process after the module."""
  saved = {k: os.environ.get(k) for k in OUT_OF_BAND_ENV}
  yield
  for k, v in saved.items():
    if v is None:
      os.environ.pop(k, None)
    else:
      os.environ[k] = v


@pytest.fixture(scope="module")
def ray_session(request):
  """A local Ray for the module, in the module's `RAY_ENV` and with its
  `RAY_NUM_CPUS` (default 8) if it sets them."""
  start_ray(env=getattr(request.module, "RAY_ENV", None), num_cpus=getattr(request.module, "RAY_NUM_CPUS", 8))
  yield
  ray.shutdown()
