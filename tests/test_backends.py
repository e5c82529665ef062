"""Every rdt_jax backend through one suite: jax_nixl, jax_gloo, jax_transfer.
The example shared-memory transport (examples/shm_transport.py) passes the
same contract through the kit users run on theirs (`rdt_jax.testing`:
examples/test_shm_transport.py, run by tests/test_examples.py).

One Ray session and three actors for the module: a producer and a "wide"
consumer (x64 on, 4 cpu devices) and a "narrow" one (x64 off, 1 device), all
in one `torch_gloo` collective group. Every transport method is chosen per
call with `.options(tensor_transport=...)`.
"""

from __future__ import annotations

import os
import signal
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import ray

# jax_gloo runs on Ray's torch_gloo groups (Ray's collective module imports
# torch) and the shared trees hold torch leaves: on a host without torch (the
# Python 3.12 leg of scripts/matrix.sh) the module skips.
pytest.importorskip("torch")

from ray.experimental.collective import create_collective_group, destroy_collective_group

import conftest
import rdt_jax
from _helpers import (
    expected,
    int4_leaf,
    sample,
    transport_manager,
    tree_fingerprint,
    wait_for,
    wait_meta,
)

# Before the classes below: @ray.method checks transport names on definition.
rdt_jax.register()

TRANSPORTS = ["jax_nixl", "jax_gloo", "jax_transfer"]
ONE_SIDED = ["jax_nixl", "jax_transfer"]
FOUR_CPUS = "--xla_force_host_platform_device_count=4"
WIDE = {"env_vars": {"JAX_ENABLE_X64": "1", "XLA_FLAGS": FOUR_CPUS}}

DTYPES = [
    "bool", "int8", "uint16", "int32", "int64", "float16", "bfloat16", "float32",
    "float64", "complex64", "float8_e4m3fn", "float8_e5m2", "float8_e3m4",
]


# Builders run on the producer (pickled by reference; tests/ is on PYTHONPATH).


def mixed_tree():
  import torch

  return {
      "w": jnp.arange(64 * 64, dtype=jnp.float32).reshape(64, 64),
      "b": jnp.ones(7, jnp.bfloat16),
      "t": torch.arange(10, dtype=torch.float32),
      "tb": torch.ones(3, dtype=torch.bfloat16),
      "n": np.arange(6, dtype=np.int32).reshape(2, 3),
      "step": 3,
      "name": "learner",
      "nested": [jnp.full((4,), 2, jnp.int8), (np.full((), 1.5),)],
  }


def every_dtype():
  return {name: jnp.asarray(sample((3, 5), name, i)) for i, name in enumerate(DTYPES)}


def odd_shapes():
  import torch

  return {
      "scalar": jnp.float32(2.5) * jnp.ones(()),
      "empty": jnp.zeros((0,), jnp.float32),
      "empty3": jnp.zeros((4, 0, 3), jnp.int8),
      "one": jnp.ones((1,), jnp.float16),
      "np_empty": np.zeros((0, 2), np.float32),
      "torch_scalar": torch.tensor(7, dtype=torch.int32),
  }


def float32_tree(n: int = 32, seed: int = 0):
  return {"x": jnp.asarray(sample((n, n), "float32", seed)), "n": np.arange(n, dtype=np.float32)}


def sharded_values():
  return {"x": jnp.arange(8 * 6, dtype=jnp.float32).reshape(8, 6)}


def sharded_leaf():
  """`sharded_values()` over a 2x2 mesh of 4 devices (the producer has 4)."""
  from jax.sharding import Mesh, NamedSharding, PartitionSpec

  mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("a", "b"))
  return jax.device_put(sharded_values(), NamedSharding(mesh, PartitionSpec("a", None)))


def many_small_leaves():
  """A value whose small jax leaves travel packed as one buffer (80 of them,
  above `RDT_JAX_PACK_MIN_LEAVES`), beside numpy and torch leaves that never pack."""
  import torch

  small = {f"s{i:03d}": jnp.full((i % 5 + 1, 2), i, (jnp.float32, jnp.int8)[i % 2]) for i in range(80)}
  return {"small": small, "n": np.arange(4.0), "t": torch.arange(3), "step": 5}


def int64_leaf():
  return {"i": jnp.arange(5, dtype=jnp.int64)}


@ray.remote(enable_tensor_transport=True)
class Producer:
  def make(self, build, *args):
    return build(*args)

  def num_exported(self, transport: str) -> int:
    return transport_manager(transport).counters()["offers"]


@ray.remote(enable_tensor_transport=True)
class Consumer:
  def fingerprint(self, value):
    return tree_fingerprint(value)

  def placement(self, value):
    x = value["x"]
    mesh = x.sharding.mesh
    return dict(mesh.shape), tuple(x.sharding.spec), sorted(d.id for d in x.sharding.device_set)

  def get_onto_device(self, refs, device_id):
    ref = refs[0]
    template = jax.device_put(jnp.zeros((32, 32), jnp.float32), jax.devices()[device_id])
    rdt_jax.set_target_for_ref(ref, {"x": template, "n": np.zeros(32, np.float32)})
    value = ray.get(ref)
    devices = sorted(d.id for d in value["x"].devices())
    return devices, type(value["n"]).__name__, tree_fingerprint(value)


@pytest.fixture(scope="module")
def actors():
  # examples/ is on the workers' PYTHONPATH; each backend moves every object, whatever its size.
  conftest.start_ray(env=conftest.NOT_IN_BAND_ENV, num_cpus=4)
  producer = Producer.options(runtime_env=WIDE).remote()
  wide = Consumer.options(runtime_env=WIDE).remote()
  narrow = Consumer.remote()
  group = create_collective_group([producer, wide, narrow], backend="torch_gloo")
  yield producer, wide, narrow
  destroy_collective_group(group)
  ray.shutdown()


@pytest.fixture(params=TRANSPORTS)
def transport(request):
  return request.param


def make(producer, transport: str, build, *args):
  return producer.make.options(tensor_transport=transport).remote(build, *args)




# ---- the suite every backend passes


def test_register_names_every_backend():
  names = rdt_jax.register()
  assert names == rdt_jax.register()
  assert {"jax_nixl", "jax_gloo", "jax_nccl", "jax_transfer"} <= set(names)
  assert all(n == n.lower() for n in names)


def test_mixed_leaves_arrive_as_their_source_type(actors, transport):
  producer, wide, _ = actors
  got = ray.get(wide.fingerprint.remote(make(producer, transport, mixed_tree)))
  assert got == expected(mixed_tree)
  kinds = [got[k][0] for k in ("w", "b", "t", "tb", "n")]
  assert kinds == ["jax", "jax", "torch", "torch", "numpy"]
  assert got["nested"][0][0] == "jax" and got["nested"][1][0][0] == "numpy"
  assert got["step"] == 3 and got["name"] == "learner"


def test_every_dtype(actors, transport):
  producer, wide, _ = actors
  got = ray.get(wide.fingerprint.remote(make(producer, transport, every_dtype)))
  want = expected(every_dtype)
  assert {k: got[k] for k in DTYPES} == {k: want[k] for k in DTYPES}


def test_zero_d_and_empty(actors, transport):
  producer, wide, _ = actors
  got = ray.get(wide.fingerprint.remote(make(producer, transport, odd_shapes)))
  assert got == expected(odd_shapes)
  assert got["scalar"][2] == () and got["empty3"][2] == (4, 0, 3)


def test_multiple_consumers_of_one_ref(actors, transport):
  producer, wide, narrow = actors
  ref = make(producer, transport, float32_tree, 48, 1)
  got = ray.get([c.fingerprint.remote(ref) for c in (wide, narrow, wide)])
  assert got == [expected(float32_tree, 48, 1)] * 3


def test_sharded_leaf_keeps_mesh_and_spec(actors, transport):
  producer, wide, _ = actors
  ref = make(producer, transport, sharded_leaf)
  assert ray.get(wide.placement.remote(ref)) == ({"a": 2, "b": 2}, ("a", None), [0, 1, 2, 3])
  assert ray.get(wide.fingerprint.remote(ref)) == expected(sharded_values)


def test_sharded_leaf_on_fewer_devices_names_both_counts(actors, transport):
  producer, _, narrow = actors
  ref = make(producer, transport, sharded_leaf)
  with pytest.raises(Exception, match=r"\['x'\].*over 4 devices.*only 1 cpu device"):
    ray.get(narrow.fingerprint.remote(ref), timeout=60)
  # The transport is still usable between the two (gloo: nothing left queued).
  ref = make(producer, transport, float32_tree, 8, 2)
  assert ray.get(narrow.fingerprint.remote(ref), timeout=60) == expected(float32_tree, 8, 2)


def test_x64_off_consumer_refuses_64_bit_jax_leaf(actors, transport):
  producer, _, narrow = actors
  ref = make(producer, transport, int64_leaf)
  with pytest.raises(Exception, match=r"\['i'\].*int64.*receive_as\('numpy'\)"):
    ray.get(narrow.fingerprint.remote(ref), timeout=60)
  # Two-sided: the consumer took the bytes anyway, so the producer is free.
  ref = make(producer, transport, float32_tree, 8, 3)
  assert ray.get(narrow.fingerprint.remote(ref), timeout=60) == expected(float32_tree, 8, 3)


def test_sub_byte_dtype_names_leaf_and_dtype(actors, transport):
  producer, wide, _ = actors
  ref = make(producer, transport, int4_leaf)
  with pytest.raises(Exception, match=r"\['q'\].*int4.*int8"):
    ray.get(wide.fingerprint.remote(ref), timeout=60)


@pytest.mark.parametrize("one_sided", ONE_SIDED)
def test_driver_get(actors, one_sided):
  producer, _, _ = actors
  value = ray.get(make(producer, one_sided, mixed_tree))
  assert tree_fingerprint(value) == expected(mixed_tree)
  assert isinstance(value["w"], jax.Array) and isinstance(value["n"], np.ndarray)


@pytest.mark.parametrize("one_sided", ONE_SIDED)
def test_driver_put_to_actor(actors, one_sided):
  import torch

  _, wide, _ = actors
  value = {"a": jnp.arange(10, dtype=jnp.float32), "n": np.arange(4.0), "t": torch.ones(3)}
  ref = ray.put(value, _tensor_transport=one_sided)
  assert ray.get(wide.fingerprint.remote(ref)) == tree_fingerprint(value)


def test_a_value_of_many_small_jax_leaves_arrives_byte_for_byte(actors, transport):
  producer, _, narrow = actors
  ref = make(producer, transport, many_small_leaves)
  assert ray.get(narrow.fingerprint.remote(ref)) == tree_fingerprint(many_small_leaves())


# ---- jax_gloo


def test_gloo_driver_get_is_refused_naming_the_fixes(actors):
  producer, _, _ = actors
  ref = make(producer, "jax_gloo", float32_tree, 8)
  refusal = r"two-sided transport jax_gloo.*_use_object_store=True.*'jax_nixl'"
  with pytest.raises(ValueError, match=refusal):
    ray.get(ref)
  # The fix it names works: the object store carries the stored leaves.
  value = ray.get(ref, _use_object_store=True)
  assert tree_fingerprint(value) == expected(float32_tree, 8)


def test_gloo_put_is_refused(actors):
  with pytest.raises(ValueError, match=r"two-sided"):
    ray.put({"x": np.ones(3)}, _tensor_transport="jax_gloo")


def test_gloo_needs_a_group(actors):
  outsider = Producer.remote()
  with pytest.raises(ValueError, match=r"create_collective_group\(.*backend='torch_gloo'\)"):
    make(outsider, "jax_gloo", float32_tree, 8)
  ray.kill(outsider)


# ---- jax_transfer


def test_transfer_pulls_onto_the_target_device(actors):
  producer, wide, _ = actors
  ref = make(producer, "jax_transfer", float32_tree, 32, 4)
  wait_meta(ref)  # Ray lends an RDT ref inside a list only once the owner has its metadata
  devices, n_type, got = ray.get(wide.get_onto_device.remote([ref], 2))
  assert devices == [2] and n_type == "ndarray"
  assert got == expected(float32_tree, 32, 4)


def test_transfer_offers_released_when_freed(actors):
  producer, wide, _ = actors
  # Objects of earlier tests are freed asynchronously: count once they are.
  counts = [ray.get(producer.num_exported.remote("jax_transfer"))]
  while len(counts) < 3 or len(set(counts[-3:])) > 1:
    time.sleep(0.5)
    counts.append(ray.get(producer.num_exported.remote("jax_transfer")))
  before = counts[-1]
  refs = [make(producer, "jax_transfer", float32_tree, 8, i) for i in range(3)]
  ray.get([wide.fingerprint.remote(r) for r in refs])
  assert ray.get(producer.num_exported.remote("jax_transfer")) == before + 3
  del refs
  assert wait_for(lambda: ray.get(producer.num_exported.remote("jax_transfer")) == before)


def test_transfer_fails_fast_when_the_producer_died(actors):
  _, wide, _ = actors
  doomed = Producer.remote()
  ref = make(doomed, "jax_transfer", float32_tree, 8)
  wait_meta(ref)
  ray.kill(doomed)
  start = time.monotonic()
  # The lifetime check names the dead producer (docs/concepts.md: one error for every path).
  with pytest.raises(ray.exceptions.RayError, match=r"has died: the object died with it"):
    ray.get(wide.fingerprint.remote(ref), timeout=60)
  assert time.monotonic() - start < 30


def test_transfer_get_timeout_is_honoured_when_the_producer_is_stopped(actors):
  """A stopped producer never answers the offer request: the caller's
  `ray.get` timeout ends the wait (not the 30 s the answer is awaited), and
  once the producer runs again the object arrives exactly."""
  stopped = Producer.remote()
  ref = make(stopped, "jax_transfer", float32_tree, 8)
  wait_meta(ref)
  pid = ray.get(stopped.__ray_call__.remote(lambda self: os.getpid()))
  os.kill(pid, signal.SIGSTOP)
  try:
    start = time.monotonic()
    with pytest.raises(ray.exceptions.GetTimeoutError):
      ray.get(ref, timeout=2)
    assert time.monotonic() - start < 10
  finally:
    os.kill(pid, signal.SIGCONT)
  assert tree_fingerprint(ray.get(ref, timeout=60)) == expected(float32_tree, 8)
  ray.kill(stopped)
