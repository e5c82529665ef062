"""The driver and Ray's workers import one and the same rdt_jax.

scripts/test_wheel.sh runs this module first, with the contract tests, against
the wheel installed in a fresh virtual environment, and sets
RDT_JAX_EXPECT_INSTALLED_IN to that environment's site-packages: then rdt_jax
must come from there in both, not from a source tree.
"""

from __future__ import annotations

import os
import pathlib

import pytest
import ray

import rdt_jax

pytestmark = pytest.mark.usefixtures("ray_session")


@ray.remote
def rdt_jax_file() -> str:
  import rdt_jax

  return rdt_jax.__file__


def test_driver_and_workers_import_one_rdt_jax():
  here = pathlib.Path(rdt_jax.__file__).resolve()
  there = pathlib.Path(ray.get(rdt_jax_file.remote(), timeout=120)).resolve()
  assert there == here, f"the driver imports {here}, a worker {there}"
  expected = os.environ.get("RDT_JAX_EXPECT_INSTALLED_IN")
  if expected:
    assert here.is_relative_to(pathlib.Path(expected).resolve()), (
        f"rdt_jax comes from {here}, not from the installed wheel in {expected}"
    )
