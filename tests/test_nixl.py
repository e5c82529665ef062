"""The `jax_nixl` transport end to end, on one local Ray session."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import ray

import rdt_jax
from _helpers import (
  expected,
  fingerprint,
  int4_leaf,
  jax_bytes,
  nixl_counts,
  process_rss,
  sample,
  transport_manager,
  tree_fingerprint,
  wait_for,
  wait_meta,
)
from conftest import OUT_OF_BAND_ENV

# Before the classes below: @ray.method checks the transport name on definition.
rdt_jax.register()

X64 = {"env_vars": {"JAX_ENABLE_X64": "1"}}

JAX_DTYPES = [
    "bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32",
    "uint64", "float16", "bfloat16", "float32", "float64", "complex64",
    "complex128", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
    "float8_e5m2fnuz", "float8_e4m3b11fnuz", "float8_e3m4", "float8_e4m3",
    "float8_e8m0fnu",
]


@ray.remote(enable_tensor_transport=True)
class Producer:
  """Makes values with a builder function and returns them over jax_nixl."""

  def __init__(self):
    self.kept = None

  @ray.method(tensor_transport="jax_nixl")
  def make(self, build, *args):
    return build(*args)

  @ray.method(tensor_transport="jax_nixl")
  def make_and_keep(self, build, *args):
    self.kept = build(*args)
    return self.kept

  def donate_kept(self):
    """A training step that donates the kept parameters (writes in place)."""
    step = jax.jit(lambda w: w * 0 - 1, donate_argnums=0)
    self.kept = {**self.kept, "w": step(self.kept["w"])}
    return float(self.kept["w"].sum())

  @ray.method(tensor_transport="jax_nixl")
  def return_kept(self):
    return self.kept

  def put(self, build, *args):
    return [ray.put(build(*args), _tensor_transport="jax_nixl")]

  def stats(self):
    return nixl_counts()

  def rss(self):
    return process_rss()


@ray.remote(enable_tensor_transport=True)
class Consumer:
  def fingerprint(self, value):
    return tree_fingerprint(value)

  def get(self, refs):
    return tree_fingerprint(ray.get(refs[0]))

  def first_action_put(self, n):
    ref = ray.put({"x": jnp.arange(n, dtype=jnp.float32)}, _tensor_transport="jax_nixl")
    return [ref]

  def stats(self):
    return nixl_counts()[0]

  def pooled(self):
    from rdt_jax import _memory

    pooled_regs = transport_manager("jax_nixl").counters()["pooled_registrations"]
    return pooled_regs, _memory.host_pool.pooled_bytes()

  def rss(self):
    return process_rss()


# Builders run on the producer (pickled by reference; tests/ is on PYTHONPATH).


def params_tree(n: int = 256):
  return {
      "w": jnp.ones((n, n), jnp.float32) * 0.5,
      "b": jnp.arange(n, dtype=jnp.float32),
      "step": 3,
      "layers": [jnp.full((4,), i, jnp.int32) for i in range(3)],
      "name": "learner",
  }


def jax_leaf(shape, dtype_name, seed=0):
  return {"x": jnp.asarray(sample(shape, dtype_name, seed))}


def deleted_leaf():
  x = jnp.ones(3)
  x.delete()
  return {"params": {"w": x}}


def prng_leaf():
  return {"key": jax.random.key(0)}


def object_leaf():
  return {"o": np.array([{"a": 1}], dtype=object)}


def meta_device_leaf():
  import torch

  return {"meta": torch.empty(3, device="meta")}


# One local Ray session for the module (conftest.ray_session).
#: NIXL's own READ path, for objects of every size (conftest.OUT_OF_BAND_ENV).
RAY_ENV = OUT_OF_BAND_ENV
pytestmark = pytest.mark.usefixtures("ray_session")


@pytest.fixture(scope="module")
def producer():
  return Producer.options(runtime_env=X64).remote()


@pytest.fixture(scope="module")
def consumer():
  return Consumer.options(runtime_env=X64).remote()


@pytest.fixture(scope="module")
def plain_consumers():
  """Three consumers with jax_enable_x64 off (the default)."""
  return [Consumer.remote() for _ in range(3)]


def test_register_is_idempotent():
  names = rdt_jax.register()
  assert "jax_nixl" in names and all(n == n.lower() for n in names)
  assert rdt_jax.register() == names


@pytest.mark.smoke  # the Ray test `--fast` runs
def test_pytree_reaches_consumer_bit_exact(producer, consumer):
  ref = producer.make.remote(params_tree)
  got = ray.get(consumer.fingerprint.remote(ref))
  assert got == expected(params_tree)
  assert got["w"][0] == "jax" and got["step"] == 3 and got["name"] == "learner"


@pytest.mark.parametrize("dtype_name", JAX_DTYPES)
def test_every_dtype(producer, consumer, dtype_name):
  ref = producer.make.remote(jax_leaf, (3, 5), dtype_name)
  assert ray.get(consumer.fingerprint.remote(ref)) == expected(jax_leaf, (3, 5), dtype_name)


@pytest.mark.parametrize("shape", [(), (0,), (4, 0, 3), (1,)])
def test_zero_d_and_empty(producer, consumer, shape):
  ref = producer.make.remote(jax_leaf, shape, "float32")
  got = ray.get(consumer.fingerprint.remote(ref))
  assert got == expected(jax_leaf, shape, "float32")
  assert got["x"][2] == shape


def test_256_mib_array(producer, consumer):
  nbytes = 256 << 20
  ref = producer.make.remote(jax_bytes, nbytes)
  assert ray.get(consumer.fingerprint.remote(ref)) == expected(jax_bytes, nbytes)


def test_driver_get(producer):
  ref = producer.make.remote(params_tree, 64)
  value = ray.get(ref)
  assert isinstance(value["w"], jax.Array)
  assert tree_fingerprint(value) == expected(params_tree, 64)


def test_driver_put_to_actor(consumer):
  value = {"a": jnp.arange(10, dtype=jnp.float32), "n": np.arange(4, dtype=np.int32)}
  ref = ray.put(value, _tensor_transport="jax_nixl")
  assert ray.get(consumer.fingerprint.remote(ref)) == tree_fingerprint(value)
  # The driver reading its own object gets the stored objects back.
  assert ray.get(ref)["a"] is value["a"]


def test_actor_put_then_driver_get(producer):
  [ref] = ray.get(producer.put.remote(params_tree, 32))
  assert tree_fingerprint(ray.get(ref)) == expected(params_tree, 32)


def test_put_is_a_fresh_actors_first_action():
  fresh = [Consumer.remote() for _ in range(3)]  # three new workers, started together
  refs = [ref for [ref] in ray.get([f.first_action_put.remote(5) for f in fresh])]
  for ref in refs:
    assert ray.get(ref)["x"].tolist() == [0, 1, 2, 3, 4]
  for f in fresh:
    ray.kill(f)


def test_eight_refs_in_one_get(producer):
  refs = [producer.make.remote(jax_bytes, 1 << 20, seed) for seed in range(8)]
  values = ray.get(refs)
  for seed, v in enumerate(values):
    assert fingerprint(v) == expected(jax_bytes, 1 << 20, seed)


def test_three_consumers_of_one_ref(producer, plain_consumers):
  ref = producer.make.remote(params_tree, 128)
  got = ray.get([c.fingerprint.remote(ref) for c in plain_consumers])
  assert got == [expected(params_tree, 128)] * 3


def test_batched_get_while_producer_frees_objects(producer):
  for round_ in range(10):
    keep = [producer.make.remote(jax_bytes, 256 << 10, round_ * 16 + i) for i in range(8)]
    drop = [producer.make.remote(jax_bytes, 256 << 10, 999) for _ in range(8)]
    ray.wait(drop, num_returns=len(drop))
    del drop  # frees race with the fetches below
    values = ray.get(keep)
    assert [fingerprint(v) for v in values] == [
        expected(jax_bytes, 256 << 10, round_ * 16 + i) for i in range(8)
    ]




def test_same_array_twice_registers_once():
  p = Producer.remote()
  ref1 = p.make_and_keep.remote(params_tree, 16)
  ray.get(ref1)  # fetch once so the object exists
  base = ray.get(p.stats.remote())
  ref2 = p.return_kept.remote()  # the same arrays in a second object
  assert tree_fingerprint(ray.get(ref2)) == expected(params_tree, 16)
  assert ray.get(p.stats.remote()) == (base[0], 2)
  del ref1, ref2
  assert wait_for(lambda: ray.get(p.stats.remote()) == (0, 0))
  ray.kill(p)


def test_donating_after_return_does_not_change_what_consumers_read(producer, consumer):
  ref = producer.make_and_keep.remote(params_tree, 512)  # 1 MiB "w": read in place
  ray.wait([ref])
  assert ray.get(producer.donate_kept.remote()) == -512 * 512
  assert ray.get(consumer.fingerprint.remote(ref)) == expected(params_tree, 512)


def test_registrations_released_and_rss_bounded():
  p, c = Producer.remote(), Consumer.remote()
  for i in range(20):  # warm up: agents, connections, allocator pools
    ray.get(c.fingerprint.remote(p.make.remote(jax_bytes, 1 << 20, i)))
  rss_p, rss_c = ray.get(p.rss.remote()), ray.get(c.rss.remote())
  for i in range(200):
    ref = p.make.remote(jax_bytes, 1 << 20, i)
    ray.get(c.fingerprint.remote(ref))
    del ref
  assert wait_for(lambda: ray.get(p.stats.remote()) == (0, 0))
  assert ray.get(c.stats.remote()) == 0
  # Receive buffers are pooled for reuse: a few 1 MiB buffers, not 200.
  pooled_regs, pooled_bytes = ray.get(c.pooled.remote())
  assert pooled_regs <= 4 and pooled_bytes <= 8 << 20
  # 200 MiB moved; each side may keep allocator slack (the producer's grew
  # 65 MiB once under heavy load) but not the payloads.
  assert ray.get(p.rss.remote()) - rss_p < 96 << 20
  assert ray.get(c.rss.remote()) - rss_c < 96 << 20
  ray.kill(p)
  ray.kill(c)


# ---- errors


def test_deleted_array_names_the_leaf(producer):
  with pytest.raises(rdt_jax.UnsupportedLeafError, match=r"\['params'\]\['w'\].*deleted"):
    ray.get(producer.make.remote(deleted_leaf))


def test_sub_byte_dtype_names_leaf_and_dtype(producer):
  with pytest.raises(rdt_jax.UnsupportedLeafError, match=r"\['q'\].*int4.*int8"):
    ray.get(producer.make.remote(int4_leaf))


def test_prng_key_crosses_as_a_typed_key(producer):
  key = ray.get(producer.make.remote(prng_leaf))["key"]
  assert jax.random.key_impl(key) == jax.random.key_impl(jax.random.key(0))
  np.testing.assert_array_equal(jax.random.key_data(key), jax.random.key_data(jax.random.key(0)))


def test_object_dtype_is_refused(producer):
  with pytest.raises(rdt_jax.UnsupportedLeafError, match=r"\['o'\].*object"):
    ray.get(producer.make.remote(object_leaf))


def test_unsupported_device_is_refused(producer):
  pytest.importorskip("torch")  # the unsupported device is torch's meta device
  with pytest.raises(rdt_jax.UnsupportedLeafError, match=r"\['meta'\].*meta"):
    ray.get(producer.make.remote(meta_device_leaf))


def test_nixl_missing_on_consumer(producer):
  hidden = {"env_vars": {"PYTHONPATH": f"{_no_nixl_dir()}:{_worker_path()}"}}
  from _blind import BlindConsumer

  blind = BlindConsumer.options(runtime_env=hidden).remote()
  ref = producer.make.remote(params_tree, 8)
  with pytest.raises(Exception, match=r"NIXL is not installed.*pip install nixl-cu12"):
    ray.get(blind.leaf_types.remote(ref), timeout=60)
  ray.kill(blind)


def test_x64_off_consumer_refuses_64_bit_jax_leaf(producer, plain_consumers):
  plain = plain_consumers[0]  # jax_enable_x64 off
  ref = producer.make.remote(jax_leaf, (3,), "int64")
  with pytest.raises(Exception, match=r"\['x'\].*int64.*receive_as\('numpy'\)"):
    ray.get(plain.fingerprint.remote(ref), timeout=60)


def _no_nixl_dir() -> str:
  import conftest

  return str(conftest.TESTS_DIR / "_no_nixl")


def _worker_path() -> str:
  import conftest

  return conftest.WORKER_PYTHONPATH


def test_coalesce_merges_only_within_one_registration():
  from rdt_jax.transports.nixl import coalesce

  local = [(1000, 10, 0), (1064, 20, 0), (1128, 5, 0)]
  remote = [(5000, 10, 0), (5064, 20, 0), (5128, 5, 0)]
  same = [("L", 0)] * 3
  assert coalesce(local, remote, same) == ([(1000, 133, 0)], [(5000, 133, 0)])
  # Adjacent memory in two local registrations (e.g. two target tensors).
  split = [("L1", 0), ("L1", 0), ("L2", 0)]
  assert coalesce(local, remote, split) == (
      [(1000, 84, 0), (1128, 5, 0)],
      [(5000, 84, 0), (5128, 5, 0)],
  )
  # Not contiguous on the remote side.
  gap = [(5000, 10, 0), (6000, 20, 0), (6064, 5, 0)]
  assert coalesce(local, gap, same) == (
      [(1000, 10, 0), (1064, 69, 0)],
      [(5000, 10, 0), (6000, 69, 0)],
  )


@ray.remote  # no enable_tensor_transport: a consumer-only actor
class PlainConsumer:
  def fingerprint(self, value):
    return tree_fingerprint(value)

  def get(self, refs):
    return tree_fingerprint(ray.get(refs[0]))

  def put_after_import(self):
    import rdt_jax  # noqa: F401 - what makes jax_nixl known in this process

    return [ray.put({"y": jnp.ones(2)}, _tensor_transport="jax_nixl")]


def test_consumer_without_enable_tensor_transport(producer):
  plain = PlainConsumer.remote()
  ref = producer.make.remote(params_tree, 16)
  assert ray.get(plain.fingerprint.remote(ref)) == expected(params_tree, 16)
  wait_meta(ref)
  assert ray.get(plain.get.remote([ref])) == expected(params_tree, 16)
  [put_ref] = ray.get(plain.put_after_import.remote())
  assert ray.get(put_ref)["y"].tolist() == [1.0, 1.0]
  ray.kill(plain)
