"""One path for jax, torch and numpy: mixed values, receive_as, targets, sharding."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import ray

# Mixing frameworks needs torch: on a host without it (the Python 3.12 leg of
# scripts/matrix.sh) the module skips.
torch = pytest.importorskip("torch")

import rdt_jax
from _helpers import framework_of, is_array, wait_meta

rdt_jax.register()

FOUR_DEVICES = {"env_vars": {"XLA_FLAGS": "--xla_force_host_platform_device_count=4"}}
TWO_DEVICES = {"env_vars": {"XLA_FLAGS": "--xla_force_host_platform_device_count=2"}}


def kinds(tree):
  return jax.tree_util.tree_map(
      lambda x: framework_of(x) or type(x).__name__, tree, is_leaf=is_array
  )


def mixed_value(scale: float = 1.0):
  return {
      "jax": jnp.arange(6, dtype=jnp.float32).reshape(2, 3) * scale,
      "torch": torch.arange(4, dtype=torch.int32) * int(scale),
      "param": torch.nn.Parameter(torch.ones(3) * scale),
      "numpy": np.full((2, 2), scale, np.float16),
      "bf16": torch.ones(2, dtype=torch.bfloat16) * scale,
      "step": 7,
  }


def sharded_value(spec: tuple, mesh_shape=(2, 2), names=("data", "model")):
  from jax.sharding import Mesh, NamedSharding, PartitionSpec

  devices = np.array(jax.devices()[: int(np.prod(mesh_shape))]).reshape(mesh_shape)
  mesh = Mesh(devices, names)
  x = jnp.arange(8 * 6, dtype=jnp.float32).reshape(8, 6)
  return {"w": jax.device_put(x, NamedSharding(mesh, PartitionSpec(*spec)))}


@ray.remote(enable_tensor_transport=True)
class Node:
  """A pipeline stage: makes, receives, converts and forwards values."""

  def __init__(self, mode: str = "source"):
    rdt_jax.receive_as(mode)
    self.params = None

  @ray.method(tensor_transport="jax_nixl")
  def make(self, build, *args):
    return build(*args)

  def set_mode(self, mode: str):
    rdt_jax.receive_as(mode)

  def describe(self, value):
    return kinds(value), rdt_jax.to_numpy(value)

  @ray.method(tensor_transport="jax_nixl")
  def forward(self, value, scale: float):
    """Receives a value and returns it scaled, as whatever type it arrived as."""
    out = {}
    for k, v in value.items():
      fw = framework_of(v)
      if fw in ("jax", "numpy"):
        out[k] = (v * scale).astype(v.dtype)
      elif fw == "torch":
        out[k] = (v.detach() * scale).to(v.dtype)
      else:
        out[k] = v
    return out

  def sharding_of(self, value):
    s = value["w"].sharding
    return (
        dict(s.mesh.shape),
        tuple(s.spec),
        len(s.device_set),
        np.asarray(value["w"]).tolist(),
    )

  def set_params(self, build, *args):
    # Writable copies: numpy views of jax arrays are read-only, as they must be.
    self.params = {
        k: np.array(v) if isinstance(v, np.ndarray) else v
        for k, v in rdt_jax.to_numpy(build(*args)).items()
    }
    return [id(v) for v in self.params.values() if isinstance(v, np.ndarray)]

  def sync_into_params(self, refs):
    rdt_jax.set_target_for_ref(refs[0], self.params)
    got = ray.get(refs[0])
    same = all(got[k] is v for k, v in self.params.items() if isinstance(v, np.ndarray))
    return same, rdt_jax.to_numpy(self.params)

  def get_on_device(self, refs, device):
    rdt_jax.set_target_device_for_ref(refs[0], device)
    value = ray.get(refs[0])
    return kinds(value), [d.id for d in value["jax"].devices()]


# One local Ray session for the module (conftest.ray_session).
pytestmark = pytest.mark.usefixtures("ray_session")


@pytest.fixture(scope="module")
def nodes():
  """Three plain nodes, reused by the tests (each sets its receive mode)."""
  return [Node.remote() for _ in range(3)]


@pytest.fixture(scope="module")
def four():
  """Two nodes with four cpu devices each."""
  return [Node.options(runtime_env=FOUR_DEVICES).remote() for _ in range(2)]


@pytest.fixture(scope="module")
def two():
  """A node with two cpu devices."""
  return Node.options(runtime_env=TWO_DEVICES).remote()


def modes(nodes, *names):
  ray.get([n.set_mode.remote(m) for n, m in zip(nodes, names, strict=False)])
  return nodes


def expected_numpy(build, *args):
  return rdt_jax.to_numpy(build(*args))


def assert_tree_equal(got, want):
  assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(want)
  for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want), strict=True):
    if isinstance(b, np.ndarray):
      assert a.dtype == b.dtype and a.shape == b.shape
      np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))
    else:
      assert a == b


def test_mixed_leaves_from_a_fresh_actors_first_call():
  producer, consumer = Node.remote(), Node.remote()  # fresh on purpose
  ref = producer.make.remote(mixed_value)  # the producer's first RDT call
  got_kinds, values = ray.get(consumer.describe.remote(ref))
  assert got_kinds == {
      "jax": "jax", "torch": "torch", "param": "torch", "numpy": "numpy",
      "bf16": "torch", "step": "int",
  }
  assert_tree_equal(values, expected_numpy(mixed_value))
  # Every array went out-of-band: the transport metadata lists all five.
  meta = ray._private.worker.global_worker.rdt_manager.get_rdt_metadata(ref.hex())
  assert len(meta.tensor_transport_meta.leaves) == 5


@pytest.mark.parametrize("mode", ["jax", "torch", "numpy"])
def test_receive_as_in_an_actor(nodes, mode):
  producer, consumer, _ = modes(nodes, "source", mode)
  got_kinds, values = ray.get(consumer.describe.remote(producer.make.remote(mixed_value)))
  assert {k: v for k, v in got_kinds.items() if k != "step"} == dict.fromkeys(
      ["jax", "torch", "param", "numpy", "bf16"], mode
  )
  assert_tree_equal(values, expected_numpy(mixed_value))


def test_receive_as_in_the_driver(nodes):
  producer = nodes[0]
  ref = producer.make.remote(mixed_value)
  rdt_jax.receive_as("numpy")
  try:
    value = ray.get(ref)
  finally:
    rdt_jax.receive_as("source")
  assert {k: framework_of(v) for k, v in value.items() if k != "step"} == dict.fromkeys(
      ["jax", "torch", "param", "numpy", "bf16"], "numpy"
  )


def test_jax_to_torch_to_jax_pipeline(nodes):
  """Three hops, each a different framework, values checked at every hop."""
  first, second, third = modes(nodes, "jax", "torch", "jax")
  ref0 = first.make.remote(mixed_value)
  ref1 = second.forward.remote(ref0, 2.0)  # arrives as torch, leaves as torch
  ref2 = third.forward.remote(ref1, 3.0)   # arrives as jax
  hop1_kinds, hop1 = ray.get(second.describe.remote(ref0))
  hop2_kinds, hop2 = ray.get(third.describe.remote(ref1))
  hop3_kinds, hop3 = ray.get(first.describe.remote(ref2))
  assert set(hop1_kinds.values()) - {"int"} == {"torch"}
  assert set(hop2_kinds.values()) - {"int"} == {"jax"}
  assert set(hop3_kinds.values()) - {"int"} == {"jax"}
  assert_tree_equal(hop1, expected_numpy(mixed_value))
  assert_tree_equal(hop2, expected_numpy(mixed_value, 2.0))
  assert_tree_equal(hop3, expected_numpy(mixed_value, 6.0))


def test_target_buffers_receive_in_place(nodes):
  producer, generator, _ = modes(nodes, "source", "source")
  ray.get(generator.set_params.remote(mixed_value, 0.0))
  ref = producer.make.remote(mixed_value, 5.0)
  wait_meta(ref)  # Ray lends an RDT ref inside a list only once it exists
  same, values = ray.get(generator.sync_into_params.remote([ref]))
  assert same  # ray.get returned the generator's own numpy arrays
  assert_tree_equal(values, expected_numpy(mixed_value, 5.0))


def test_target_torch_and_jax_in_the_driver(nodes):
  producer = nodes[0]
  ref = producer.make.remote(mixed_value, 3.0)
  target = rdt_jax.to_torch(mixed_value(0.0))
  target["jax"] = jnp.zeros((2, 3), jnp.float32)  # a jax target is a placement template
  target["step"] = None
  rdt_jax.set_target_for_ref(ref, target)
  got = ray.get(ref)
  assert got["torch"] is target["torch"] and got["bf16"] is target["bf16"]
  assert isinstance(got["jax"], jax.Array) and got["jax"] is not target["jax"]
  assert_tree_equal(rdt_jax.to_numpy(got), expected_numpy(mixed_value, 3.0))


def test_target_shape_mismatch_names_the_leaf(nodes):
  producer = nodes[0]
  ref = producer.make.remote(mixed_value)
  wait_meta(ref)
  bad = rdt_jax.to_torch(mixed_value())
  bad["numpy"] = np.zeros((3, 3), np.float16)
  with pytest.raises(ValueError, match=r"\['numpy'\].*\(3, 3\).*\(2, 2\)"):
    rdt_jax.set_target_for_ref(ref, bad)
  bad["numpy"] = np.zeros((2, 2), np.float32)
  with pytest.raises(ValueError, match=r"\['numpy'\].*float32.*float16"):
    rdt_jax.set_target_for_ref(ref, bad)
  bad["numpy"] = np.zeros((2, 2), np.float16)
  bad["jax"] = rdt_jax.to_numpy(mixed_value())["jax"]  # a read-only view of jax memory
  with pytest.raises(ValueError, match=r"\['jax'\] is a read-only numpy array"):
    rdt_jax.set_target_for_ref(ref, bad)


def test_target_on_a_plain_ref_is_refused():
  with pytest.raises(ValueError, match="not an RDT object"):
    rdt_jax.set_target_for_ref(ray.put(1), [np.zeros(1)])
  with pytest.raises(TypeError, match="ObjectRef"):
    rdt_jax.set_target_device_for_ref("not a ref", "cpu")


@pytest.mark.parametrize("device", ["cpu", "jax-cpu-1"])
def test_target_device(nodes, two, device):
  producer, consumer = modes(nodes, "source")[0], two
  ref = producer.make.remote(mixed_value)
  ray.wait([ref])
  wait_meta(ref)
  given = device if device == "cpu" else _JaxDevice(1)
  got_kinds, devices = ray.get(consumer.get_on_device.remote([ref], given))
  assert got_kinds["jax"] == "jax"
  assert devices == ([1] if device == "jax-cpu-1" else [0])


class _JaxDevice:
  """Pickles as an index; becomes that jax cpu device on the consumer."""

  def __init__(self, index: int):
    self.index = index

  def __reduce__(self):
    return _jax_cpu_device, (self.index,)


def _jax_cpu_device(index: int):
  return jax.devices("cpu")[index]


def test_unsupported_target_device(nodes):
  producer = nodes[0]
  ref = producer.make.remote(mixed_value)
  with pytest.raises(ValueError, match="Unsupported device 'tpu'"):
    rdt_jax.set_target_device_for_ref(ref, "tpu")


@pytest.mark.parametrize(
    "spec", [("data", "model"), ("data", None), (None, None), (("data", "model"), None)]
)
def test_sharded_round_trip(four, spec):
  producer, consumer = modes(four, "source", "source")
  ref = producer.make.remote(sharded_value, spec)
  mesh, got_spec, ndev, values = ray.get(consumer.sharding_of.remote(ref))
  assert mesh == {"data": 2, "model": 2}
  assert got_spec == tuple(spec)
  assert ndev == 4
  assert values == np.arange(48, dtype=np.float32).reshape(8, 6).tolist()


def test_sharded_replicas_cross_once(four):
  producer = four[0]
  ref = producer.make.remote(sharded_value, ("data", None))
  leaf = wait_meta(ref).leaves[0]
  assert len(leaf.chunks) == 2  # 4 devices, 2 distinct shards
  assert leaf.sharding.device_chunks == (0, 0, 1, 1)


def test_sharded_to_fewer_devices_errors_with_both_counts(four, two):
  producer, small = four[0], two
  ray.get(small.set_mode.remote("source"))
  ref = producer.make.remote(sharded_value, ("data", "model"))
  with pytest.raises(Exception, match=r"\['w'\].*sharded over 4 devices.*only 2 cpu device"):
    ray.get(small.sharding_of.remote(ref), timeout=60)


def test_sharded_to_fewer_devices_as_numpy_assembles(four, two):
  producer, small = four[0], two
  ray.get(small.set_mode.remote("numpy"))
  ref = producer.make.remote(sharded_value, ("data", "model"))
  got_kinds, values = ray.get(small.describe.remote(ref))
  assert got_kinds == {"w": "numpy"}
  np.testing.assert_array_equal(values["w"], np.arange(48, dtype=np.float32).reshape(8, 6))
