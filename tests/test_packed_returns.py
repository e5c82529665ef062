"""Many small jax leaves of one return travel as one buffer, and nothing else changes.

A value of at least `RDT_JAX_PACK_MIN_LEAVES` leaves (64 by default) sends its
small host jax leaves as one host buffer (`rdt_jax._leaf_pack`): Ray and the
transport see one tensor for all of them. These tests check that a consumer
cannot tell: values byte for byte, in every receive mode, with targets (by
structure, positional, a device, a slice), beside numpy, torch, large, typed-key
and non-array leaves, on every one-sided transport and in band.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import ray

import rdt_jax
from _helpers import framework_of, is_array, tree_fingerprint, wait_meta

torch = pytest.importorskip("torch")

rdt_jax.register()

pytestmark = pytest.mark.usefixtures("ray_session")

SMALL = 80  # leaves that pack


def many_leaves(n: int = SMALL, scale: float = 1.0):
  """A value of `n` small jax leaves of several dtypes and shapes, inserted out
  of key order, beside leaves that never pack."""
  small = {}
  for i in reversed(range(n)):  # insertion order differs from jax's sorted order
    shape = (i % 5 + 1, 3) if i % 2 else (i % 7 + 1,)
    dtype = (jnp.float32, jnp.int8, jnp.bfloat16, jnp.int16)[i % 4]
    small[f"s{i:03d}"] = (jnp.arange(int(np.prod(shape)), dtype=jnp.float32).reshape(shape) * scale + i).astype(dtype)
  return {
      "small": small,
      "nested": [jnp.full((2, 2), 7.0 * scale), (jnp.zeros((0, 3)), jnp.asarray(3.5 * scale))],
      "big": jnp.ones((128, 1024), jnp.float32) * scale,  # 512 KiB: a tensor of its own
      "numpy": np.full((4,), 2.0 * scale, np.float32),
      "torch": torch.arange(6, dtype=torch.int32) * int(scale),
      "key": jax.random.key(int(scale)),
      "step": 11,
      "none": None,
  }


def fingerprint(value):
  """`tree_fingerprint`, a typed key by its key data (which has a numpy form)."""
  return tree_fingerprint(jax.tree_util.tree_map(
      lambda x: jax.random.key_data(x) if rdt_jax_key(x) else x, value, is_leaf=rdt_jax_key
  ))


def rdt_jax_key(x) -> bool:
  return isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def want(*args):
  """The fingerprint of `many_leaves(*args)`, built here."""
  return fingerprint(many_leaves(*args))


def packed_count(n: int = SMALL) -> int:
  """Leaves of `many_leaves(n)` that pack: the small ones, the nested ones and
  the typed key's data."""
  return n + 4


@ray.remote(enable_tensor_transport=True)
class Node:
  def __init__(self, mode: str = "source"):
    rdt_jax.receive_as(mode)

  def set_mode(self, mode: str) -> None:
    rdt_jax.receive_as(mode)

  @ray.method(tensor_transport="jax_nixl")
  def make(self, build, *args):
    return build(*args)

  @ray.method(tensor_transport="jax_transfer")
  def make_transfer(self, build, *args):
    return build(*args)

  @ray.method(tensor_transport="jax_nixl")
  def make_and_change(self, n: int):
    """Returns a value with a large numpy leaf, which `change_numpy` changes in
    place after the return (jax_nixl reads a large host leaf in place at each
    READ, so a consumer sees that; docs/concepts.md, mutability)."""
    value = many_leaves(n)
    value["numpy"] = np.full((128 * 1024,), 2.0, np.float32)
    self.kept = value
    return value

  def change_numpy(self) -> None:
    self.kept["numpy"][:] = -1.0

  def fingerprint(self, value):
    return fingerprint(value)

  def kinds(self, value):
    return jax.tree_util.tree_map(lambda x: framework_of(x) or type(x).__name__, value, is_leaf=is_array)

  def devices_on(self, refs, index: int):
    """Gets `refs[0]` onto this process's cpu device `index`: the devices of its small leaves."""
    rdt_jax.set_target_device_for_ref(refs[0], jax.devices("cpu")[index])
    value = ray.get(refs[0])
    return {d.id for x in jax.tree_util.tree_leaves(value["small"]) for d in x.devices()}

  def numpy_leaf(self, value):
    return value["numpy"].copy()

  def pack_counts(self):
    from rdt_jax import _leaf_pack, _pack_table

    return {**_pack_table.counts(), "structures": _leaf_pack.structures_kept()}

  def into_targets(self, refs, target):
    # Arrays from Ray's object store are read-only: targets are copies.
    target = jax.tree_util.tree_map(lambda x: x.copy() if isinstance(x, np.ndarray) else x, target)
    rdt_jax.set_target_for_ref(refs[0], target)
    got = ray.get(refs[0])
    same = [got["small"][k] is v for k, v in target["small"].items() if isinstance(v, np.ndarray)]
    return all(same) and bool(same), fingerprint(got)


@pytest.fixture(scope="module")
def pair():
  """A producer, and a consumer with two cpu devices (each test sets its receive mode)."""
  two = {"env_vars": {"XLA_FLAGS": "--xla_force_host_platform_device_count=2"}}
  producer, consumer = Node.remote(), Node.options(runtime_env=two).remote()
  yield producer, consumer
  ray.get(consumer.set_mode.remote("source"))


@pytest.fixture
def producer(pair):
  return pair[0]


@pytest.fixture
def consumer(pair):
  ray.get(pair[1].set_mode.remote("source"))
  return pair[1]


def _meta(ref):
  return wait_meta(ref)


def strip(tree):
  """Fingerprints without their framework: (dtype, shape, digest) per leaf."""
  def is_print(x) -> bool:
    return isinstance(x, tuple) and len(x) == 4 and isinstance(x[3], str) and len(x[3]) == 64

  return jax.tree_util.tree_map(lambda f: f[1:] if is_print(f) else f, tree, is_leaf=is_print)


def _fingerprint_without_key(tree):
  tree = dict(tree)
  tree.pop("key")
  return tree


def test_a_many_leaf_value_travels_as_one_buffer_and_arrives_byte_for_byte(producer, consumer):
  ref = producer.make.remote(many_leaves)
  got = ray.get(consumer.fingerprint.remote(ref))
  assert got == want()
  meta = _meta(ref)
  slot, specs, positions = meta.packed
  assert len(specs) == packed_count() and meta.leaves[slot].path == "<packed leaves>"
  # Ray sees the pack, the big leaf, numpy and torch: four tensors.
  assert len(meta.tensor_meta) == len(meta.leaves) == 4
  assert len(meta.value_leaves()) == packed_count() + 3
  assert list(positions) == sorted(positions)
  # The driver gets the same value.
  assert fingerprint(ray.get(ref)) == want()


@pytest.mark.parametrize("mode", ["jax", "torch", "numpy"])
def test_packed_leaves_arrive_as_the_receive_mode_asks(producer, consumer, mode):
  ray.get(consumer.set_mode.remote(mode))
  ref = producer.make.remote(many_leaves)
  kinds = ray.get(consumer.kinds.remote(ref))
  assert set(kinds["small"].values()) == {mode}
  assert kinds["numpy"] == mode and kinds["big"] == mode and kinds["step"] == "int"
  got = _fingerprint_without_key(ray.get(consumer.fingerprint.remote(ref)))
  wanted = _fingerprint_without_key(want())
  assert strip(got) == strip(wanted)  # bytes, dtypes and shapes; the framework is the mode's


def test_a_value_below_the_threshold_is_not_packed(producer):
  ref = producer.make.remote(many_leaves, 40)  # 40 + 11 leaves < 64
  assert _meta(ref).packed is None
  assert fingerprint(ray.get(ref)) == want(40)


def test_packing_turned_off_sends_every_leaf_alone():
  producer = Node.options(runtime_env={"env_vars": {"RDT_JAX_PACK_MIN_LEAVES": "0"}}).remote()
  ref = producer.make.remote(many_leaves)
  meta = _meta(ref)
  assert meta.packed is None and len(meta.leaves) == packed_count() + 3
  assert fingerprint(ray.get(ref)) == want()


def test_a_large_numpy_leaf_beside_a_pack_is_still_read_in_place(producer, consumer):
  ref = producer.make_and_change.remote(SMALL)
  wait_meta(ref)
  ray.get(producer.change_numpy.remote())
  assert (ray.get(consumer.numpy_leaf.remote(ref)) == -1.0).all()


def test_jax_transfer_moves_a_pack(producer, consumer):
  ref = producer.make_transfer.remote(many_leaves)
  assert ray.get(consumer.fingerprint.remote(ref)) == want()
  assert _meta(ref).packed is not None


def test_a_pack_travels_in_band_when_that_is_turned_on(consumer):
  env = {"env_vars": {"RDT_JAX_INLINE_MAX_BYTES": str(8 << 20)}}
  producer = Node.options(runtime_env=env).remote()
  ref = producer.make.remote(lambda: {k: v for k, v in many_leaves(70).items() if k not in ("big", "torch", "key")})
  got = ray.get(consumer.fingerprint.remote(ref))
  assert got == fingerprint({k: v for k, v in many_leaves(70).items() if k not in ("big", "torch", "key")})
  meta = _meta(ref)
  assert meta.packed is not None and meta.inline is not None


def _numpy_target(scale: float = 0.0):
  value = many_leaves(SMALL, scale)
  target = jax.tree_util.tree_map(
      lambda x: np.array(x) if isinstance(x, jax.Array) and not rdt_jax_key(x) else x, value, is_leaf=rdt_jax_key
  )
  target["torch"] = torch.zeros(6, dtype=torch.int32)
  target["key"] = jax.random.key(0)  # a typed key target: a placement template
  return target


def test_a_target_by_structure_receives_packed_leaves_in_place(producer, consumer):
  ref = producer.make.remote(many_leaves, SMALL, 3.0)
  wait_meta(ref)
  target = _numpy_target()
  same, got = ray.get(consumer.into_targets.remote([ref], target))
  assert same
  wanted = want(SMALL, 3.0)
  assert strip(got["small"]) == strip(wanted["small"]) and strip(got["nested"]) == strip(wanted["nested"])
  assert got["big"][1:] == wanted["big"][1:] and got["step"] == 11


def test_a_positional_target_counts_leaves_in_the_producers_order(producer):
  ref = producer.make.remote(many_leaves, SMALL, 2.0)
  meta = wait_meta(ref)
  order = meta.value_leaves()
  buffers = [np.zeros(spec.shape, spec.dtype) for spec, _ in order]
  rdt_jax.set_target_for_ref(ref, buffers)
  got = ray.get(ref)
  # Every buffer was written in place, in the producer's order (insertion
  # order: s079 first), not jax's sorted order.
  assert order[0][0].path == "['small']['s079']"
  assert got["small"]["s079"] is buffers[0]
  value = many_leaves(SMALL, 2.0)
  np.testing.assert_array_equal(buffers[0], np.asarray(value["small"]["s079"]))
  np.testing.assert_array_equal(got["nested"][0], np.asarray(value["nested"][0]))


def test_a_positional_target_that_does_not_fit_names_the_leaf_before_anything_moves(producer):
  ref = producer.make.remote(many_leaves)
  meta = wait_meta(ref)
  buffers = [np.zeros(spec.shape, spec.dtype) for spec, _ in meta.value_leaves()]
  buffers[0] = np.zeros((99,), np.float32)
  with pytest.raises(ValueError, match=r"\['small'\]\['s079'\]"):
    rdt_jax.set_target_for_ref(ref, buffers)


def test_a_device_target_places_packed_leaves(producer, consumer):
  ref = producer.make.remote(many_leaves)
  wait_meta(ref)
  assert ray.get(consumer.devices_on.remote([ref], 1)) == {1}


def test_a_slice_of_a_packed_leaf(producer):
  ref = producer.make.remote(many_leaves)
  wait_meta(ref)
  target = _numpy_target()
  target["small"]["s009"] = rdt_jax.Slice[1:3]  # shape (5, 3): rows 1 and 2
  rdt_jax.set_target_for_ref(ref, target)
  got = ray.get(ref)
  want = np.asarray(many_leaves()["small"]["s009"])[1:3]
  assert np.asarray(got["small"]["s009"]).shape == (2, 3)
  np.testing.assert_array_equal(np.asarray(got["small"]["s009"]), want)


def _with_deleted_leaf():
  value = many_leaves()
  value["small"]["s040"].delete()
  return value


def test_a_deleted_leaf_in_a_packed_value_is_refused_by_name(producer):
  ref = producer.make.remote(_with_deleted_leaf)
  with pytest.raises(Exception, match=r"\['small'\]\['s040'\].*deleted"):
    ray.get(ref)


def test_which_jax_leaves_may_pack():
  """`_dlpack.packable`: unsharded live host leaves up to the size limit, in
  the default layout; the kind is checked once, the address read per leaf."""
  from rdt_jax import _dlpack

  small = jnp.arange(6, dtype=jnp.int16).reshape(2, 3)
  kind, address = _dlpack.packable(small, 1 << 10)
  assert address == small.unsafe_buffer_pointer()
  assert kind.dtype == np.int16 and kind.chunks[0].shape == (2, 3) and kind.chunks[0].nbytes == 12
  other = jnp.ones((2, 3), jnp.int16)
  assert _dlpack.packable(other, 1 << 10) == (kind, other.unsafe_buffer_pointer())
  assert _dlpack.packable(jnp.ones((2, 3), jnp.int16), 8) is None  # too large
  empty = jnp.zeros((0, 4))
  assert _dlpack.packable(empty, 1 << 10)[1] == 0
  deleted = jnp.ones((3,))
  deleted.delete()
  assert _dlpack.packable(deleted, 1 << 10) is None
  spec = _dlpack.packed_spec("['a']", kind)
  assert (spec.path, spec.shape, spec.dtype, spec.framework, spec.device) == ("['a']", (2, 3), np.int16, "jax", "cpu")


# ---- one table per structure (rdt_jax._pack_table): made once, never a wrong one


def plain_leaves(order: str = "reversed", n: int = 96, change: str = ""):
  """A value of `n` small jax leaves only (no typed key: a key's data is made
  anew at each serialization), inserted in `order`; `change` alters one leaf:
  its shape, its dtype, or makes it a NumPy array (which never packs)."""
  keys = list(range(n)) if order == "sorted" else list(reversed(range(n))) if order == "reversed" else \
      [i for i in range(n) if i % 2] + [i for i in range(n) if not i % 2]
  small = {}
  for i in keys:
    x = jnp.arange(6, dtype=jnp.float32).reshape(2, 3) + i
    if i == 17 and change == "shape":
      x = x.reshape(3, 2)
    elif i == 17 and change == "dtype":
      x = x.astype(jnp.int16)
    elif i == 17 and change == "numpy":
      x = np.asarray(x)
    small[f"w{i:03d}"] = x
  return {"small": small, "step": n}


def test_a_structure_returned_again_reuses_its_table_on_every_side(producer, consumer):
  before = ray.get(producer.pack_counts.remote())
  refs = [producer.make.remote(plain_leaves) for _ in range(3)]
  for ref in refs:
    assert ray.get(consumer.fingerprint.remote(ref)) == fingerprint(plain_leaves())
  after = ray.get(producer.pack_counts.remote())
  assert after["made"] == before["made"] + 1  # made for the first value, reused for the other two
  assert after["structures"] >= 1
  # The driver (the refs' owner) decoded the table once and holds one object for all three.
  specs = [_meta(ref).packed[1] for ref in refs]
  assert specs[0] is specs[1] is specs[2]
  assert [s.path for s in specs[0]][:2] == ["['small']['w095']", "['small']['w094']"]  # the producer's order


@pytest.mark.parametrize("change", ["shape", "dtype", "numpy"])
def test_a_changed_leaf_or_order_under_one_structure_is_never_read_with_the_old_table(producer, consumer, change):
  """Values jax flattens to one treedef but that pack differently (insertion
  order, one leaf's shape or dtype, a leaf that does not pack) each get the
  table of their own leaves, in any sequence."""
  sequence = [("reversed", ""), ("sorted", ""), ("reversed", change), ("interleaved", ""), ("reversed", ""),
              ("reversed", change), ("reversed", change)]
  for order, changed in sequence:
    ref = producer.make.remote(plain_leaves, order, 96, changed)
    want_print = fingerprint(plain_leaves(order, 96, changed))
    assert ray.get(consumer.fingerprint.remote(ref)) == want_print, (order, changed)
    assert fingerprint(ray.get(ref)) == want_print
    paths = [s.path for s in _meta(ref).packed[1]]
    first = f"['small']['w{(95 if order == 'reversed' else 0 if order == 'sorted' else 1):03d}']"
    assert paths[0] == first, (order, changed, paths[:3])
