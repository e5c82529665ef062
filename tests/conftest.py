"""Shared fixtures: one local Ray session per test module."""

from __future__ import annotations

import os
import pathlib
import time

import pytest
import ray

TESTS_DIR = pathlib.Path(__file__).parent
REPO = TESTS_DIR.parent
# Workers import the test modules' actor and transport classes by reference.
# examples/ too: a transport registered by one test module (the shm example)
# stays in this process's Ray registry for the modules after it, whose new
# actors then receive it, so their workers must be able to import it.
WORKER_PYTHONPATH = os.pathsep.join([str(TESTS_DIR), str(REPO), str(REPO / "examples")])


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


def wait_for(predicate, timeout: float = 30.0, interval: float = 0.2) -> bool:
  """Polls `predicate` until it is true or `timeout` seconds pass."""
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    if predicate():
      return True
    time.sleep(interval)
  return predicate()


def wait_meta(ref):
  """Waits until this process (the owner) knows the ref's transport metadata.

  Ray lends an RDT ref inside a container (e.g. `actor.f.remote([ref])`) only
  once that is so; `ray.wait` alone returns slightly earlier.
  """
  manager = ray._private.worker.global_worker.rdt_manager
  meta = manager.wait_for_tensor_transport_metadata(ref.hex(), timeout=60)
  assert meta is not None, f"no transport metadata for {ref} after 60 s"
  return meta


@pytest.fixture(scope="module")
def ray_session():
  start_ray()
  yield
  ray.shutdown()
