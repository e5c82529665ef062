"""Transfers across nodes of a simulated cluster, and a node lost mid-transfer.

`ray.cluster_utils.Cluster` starts a head node and two worker nodes on this
host, each with its own raylet and object store. Actors are pinned to nodes by
custom resources, so every transfer below crosses a node boundary.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import ray
from ray.cluster_utils import Cluster
from ray.experimental.collective import create_collective_group, destroy_collective_group

import rdt_jax
from _helpers import race, tree_fingerprint
from conftest import WORKER_PYTHONPATH

rdt_jax.register()

DEATH_BOUND_S = 30.0
BACKENDS = ["jax_nixl", "jax_gloo", "jax_transfer"]


def values(nbytes: int, seed: int):
  rng = np.random.default_rng(seed)
  return {
      "w": jnp.asarray(rng.integers(0, 255, nbytes, dtype=np.uint8)),
      "b": jnp.asarray(rng.standard_normal(7).astype(np.float32)),
      "n": rng.integers(0, 9, 5).astype(np.int32),
  }


def expected(nbytes: int, seed: int) -> dict:
  return tree_fingerprint(values(nbytes, seed))


@ray.remote(enable_tensor_transport=True)
class Node:
  def where(self) -> str:
    return ray.get_runtime_context().get_node_id()

  def ucx_tls(self) -> str | None:
    import os

    return os.environ.get("UCX_TLS")

  def make(self, nbytes: int, seed: int):
    return values(nbytes, seed)

  def digests(self, value) -> dict:
    return tree_fingerprint(value)


#: Every test runs twice: with the defaults (the simulated nodes share a host,
#: so jax_nixl reads node-locally, rdt_jax._node_local) and with UCX
#: restricted to TCP and node-local reads off, so that NIXL reads over sockets
#: as it does between real nodes without RDMA. One cluster serves both: the
#: environment is each actor's (`runtime_env`), the actors are new per run.
UCX_ENVS = {"default-ucx": {}, "ucx-tcp": {"UCX_TLS": "tcp", "RDT_JAX_NIXL_CMA": "0"}}


@pytest.fixture(scope="module")
def cluster():
  c = Cluster(
      initialize_head=True,
      head_node_args={"num_cpus": 2, "resources": {"head": 10}},
  )
  nodes = [c.add_node(num_cpus=2, resources={f"node{i}": 10}) for i in (1, 2)]
  c.wait_for_nodes()
  ray.init(address=c.address, logging_level="warning", runtime_env={"env_vars": {"PYTHONPATH": WORKER_PYTHONPATH}})
  yield c, nodes
  ray.shutdown()
  c.shutdown()


@pytest.fixture(scope="module", params=list(UCX_ENVS))
def ucx(request) -> str:
  """This run's UCX setting (a key of `UCX_ENVS`)."""
  return request.param


def on(resource: str, ucx: str):
  env = {"PYTHONPATH": WORKER_PYTHONPATH, **UCX_ENVS[ucx]}
  return Node.options(resources={resource: 1}, num_cpus=0, runtime_env={"env_vars": env})


@pytest.fixture(scope="module")
def pair(cluster, ucx):
  a, b = on("node1", ucx).remote(), on("node2", ucx).remote()
  group = create_collective_group([a, b], backend="torch_gloo")
  assert ray.get(a.where.remote()) != ray.get(b.where.remote())
  # The UCX restriction of this run reached the actors.
  assert ray.get(a.ucx_tls.remote()) == UCX_ENVS[ucx].get("UCX_TLS")
  yield a, b
  destroy_collective_group(group)
  ray.kill(a)
  ray.kill(b)


@pytest.mark.parametrize("transport", BACKENDS)
def test_transfer_across_nodes(pair, transport):
  a, b = pair
  ref = a.make.options(tensor_transport=transport).remote(1 << 20, 1)
  assert ray.get(b.digests.remote(ref), timeout=120) == expected(1 << 20, 1)


@pytest.mark.parametrize("transport", ["jax_nixl", "jax_transfer"])
def test_driver_get_from_another_node(pair, transport):
  a, _ = pair
  ref = a.make.options(tensor_transport=transport).remote(256 << 10, 2)
  got = ray.get(ref, timeout=120)
  assert tree_fingerprint(got) == expected(256 << 10, 2)


def test_node_removed_mid_transfer(cluster, ucx, pair):
  c, _ = cluster
  doomed = f"doomed-{ucx}"
  doomed_node = c.add_node(num_cpus=2, resources={doomed: 10})
  c.wait_for_nodes()
  producer, consumer = on(doomed, ucx).remote(), on("head", ucx).remote()
  ref = producer.make.options(tensor_transport="jax_nixl").remote(256 << 20, 3)
  ray.wait([ref])
  outcome, elapsed = race(
      lambda: ray.get(consumer.digests.remote(ref), timeout=DEATH_BOUND_S * 3),
      lambda: c.remove_node(doomed_node),
      DEATH_BOUND_S * 3,
  )
  assert elapsed < DEATH_BOUND_S * 2, "the fetch hung after its node was removed"
  if "value" in outcome:  # the read finished before the node went away
    assert outcome["value"] == expected(256 << 20, 3)
  else:
    assert isinstance(outcome["error"], ray.exceptions.RayError)
  # The consumer on the surviving node keeps working.
  other = pair[0]  # on node1
  ref2 = other.make.options(tensor_transport="jax_nixl").remote(1 << 20, 4)
  assert ray.get(consumer.digests.remote(ref2), timeout=120) == expected(1 << 20, 4)
  ray.kill(consumer)
