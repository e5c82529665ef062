"""The packing of many host leaves into one buffer (`rdt_jax._layout._packing`)
and the weight stream's pieces that need no Ray actor: the kept-versions
table read node-locally, the packed source's digest, a subscriber's plan."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rdt_jax import _dlpack, _memory, _process
from rdt_jax._layout import _packing
from rdt_jax.weights import _packed_plan

torch = pytest.importorskip("torch")


def test_layout_aligns_every_leaf():
  layout = _packing.PackedLayout.of([3, 0, 64, 65])
  assert layout.offsets == (0, 64, 64, 128)
  assert layout.sizes == (3, 0, 64, 65)
  assert layout.total == 256


def test_pack_copies_every_framework_at_its_offset():
  step = jax.jit(lambda x: x + 1)
  leaves = [
      step(jnp.arange(10, dtype=jnp.float32)),
      np.arange(7, dtype=np.int16),
      torch.arange(5, dtype=torch.float64),
      jnp.ones((2, 3), jnp.bfloat16),
      jnp.zeros((0,), jnp.float32),
  ]
  sizes = [40, 14, 40, 12, 0]
  layout = _packing.PackedLayout.of(sizes)
  packer = _packing.Packer(layout, [f"[{i}]" for i in range(len(leaves))])
  buf = _memory.host_pool.acquire(layout.total)
  for _ in range(2):  # the second time, the jax leaves take the checked fast path
    buf[:] = 0
    packer.pack(leaves, _memory.host_pointer(buf))
    for x, offset, size in zip(leaves, layout.offsets, layout.sizes):
      want = np.ascontiguousarray(_dlpack.convert_leaf(x, "numpy")).view(np.uint8).ravel()
      assert bytes(buf[offset : offset + size]) == want.tobytes()


SHARDED = """
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from rdt_jax import _memory
from rdt_jax._layout import _packing
mesh = Mesh(np.array(jax.devices()[:2]), ("x",))
x = jax.device_put(jnp.arange(16.0).reshape(4, 4), NamedSharding(mesh, PartitionSpec("x")))
layout = _packing.PackedLayout.of([64])
buf = _memory.host_pool.acquire(layout.total)
_packing.Packer(layout, ["['w']"]).pack([x], _memory.host_pointer(buf))
assert np.array_equal(buf[:64].view(np.float32).reshape(4, 4), np.arange(16.0).reshape(4, 4))
print("gathered")
"""


@pytest.mark.slow  # jax with several host devices, in a subprocess
def test_pack_gathers_a_sharded_leaf():
  env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
  out = subprocess.run([sys.executable, "-c", SHARDED], env=env, capture_output=True, text=True, timeout=120)
  assert out.stdout.strip() == "gathered", out.stderr[-2000:]


def test_pack_refuses_a_deleted_leaf_by_name_and_a_wrong_size():
  step = jax.jit(lambda x: x * 2)
  x = step(jnp.ones(4))
  layout = _packing.PackedLayout.of([16])
  packer = _packing.Packer(layout, ["['w']"])
  buf = _memory.host_pool.acquire(layout.total)
  packer.pack([x], _memory.host_pointer(buf))  # checked: its sharding is known now
  x.delete()
  with pytest.raises(_dlpack.UnsupportedLeafError, match=r"\['w'\].*deleted"):
    packer.pack([x], _memory.host_pointer(buf))
  with pytest.raises(_dlpack.UnsupportedLeafError, match=r"\['w'\] has 32 bytes .* has 16"):
    packer.pack([np.ones(4, np.float64)], _memory.host_pointer(buf))
  with pytest.raises(ValueError, match="2 leaves for a layout of 1"):
    packer.pack([np.ones(4), np.ones(4)], _memory.host_pointer(buf))


def test_jax_placement():
  assert _packing.jax_placement(None) is None
  assert _packing.jax_placement(jnp.ones(3)) is None  # the first cpu device: aliasing allowed
  assert _packing.jax_placement(np.ones(3)) is None
  devices = jax.devices()
  if len(devices) >= 2:
    from jax.sharding import SingleDeviceSharding

    other = SingleDeviceSharding(devices[1])
    assert _packing.jax_placement(other) is other


def test_kept_table_is_read_node_locally():
  from rdt_jax.weights import _packed as packed
  from rdt_jax.weights import _routes

  publisher, other = "0123456789abcdef" * 2, "fedcba9876543210" * 2
  table = packed.KeptTable(2, publisher)
  table.add(7)
  table.add(9)
  with pytest.raises(RuntimeError, match="no free slot"):
    table.add(10)
  source = packed.PackedSource(_process.identity(), 0, 0, table.address, table.slots)
  assert _routes.read_table(source, publisher) == {7, 9}
  table.drop(7)
  table.add(11)
  assert _routes.read_table(source, publisher) == {9, 11}
  table.clear()
  assert _routes.read_table(source, publisher) == set()
  with pytest.raises(packed.ForeignTable, match=other):  # read as another publisher's table
    _routes.read_table(source, other)
  table.retire()
  with pytest.raises(packed.ForeignTable):
    _routes.read_table(source, publisher)
  assert _routes.read_table_or_empty(source, publisher) == set()


def test_packed_source_digest_covers_every_field():
  from rdt_jax.weights import _packed as packed

  src = packed.PackedSource(_process.identity(), 4096, 128, 8192, 2)
  digest = src.expected_digest(5)
  assert digest != src.expected_digest(6)
  for field, value in [("buffer", 4160), ("nbytes", 64), ("table", 8256), ("slots", 3), ("device", 0),
                       ("ipc", b"\x01" * 64), ("ipc_offset", 256)]:
    other = packed.PackedSource(**{**src.__dict__, field: value})
    assert other.expected_digest(5) != digest


def _plan(template: dict, atomic: bool = False, published: dict | None = None):
  from rdt_jax.weights import _handle as _weights
  from rdt_jax.weights import _packed as packed

  if published is None:
    published = {"w": jnp.arange(12.0).reshape(3, 4), "b": jnp.ones(5, jnp.bfloat16)}
  entries = _weights.structure_of(published)
  leaves, treedef = jax.tree_util.tree_flatten(published)
  layout = _packing.PackedLayout.of([x.nbytes for x in leaves])
  info = packed.PackedLayoutInfo(layout, treedef, tuple(range(len(leaves))), tuple(x.shape for x in leaves))
  plan = _packed_plan.PackedPlan(info, entries, dict(_weights.flatten(template)), atomic)
  source = _memory.host_pool.acquire(layout.total)
  _packing.Packer(layout, [path for path, *_ in entries]).pack(leaves, _memory.host_pointer(source))
  return plan, source, published


def copy_in_buckets(plan, source, staging, size: int = 64) -> None:
  """Copies a version's runs out of `source` (its packed buffer, in this
  process) bucket by bucket, as a pull through Ray does (`bucket_runs`);
  64-byte buckets cut most leaves in two."""
  total = plan.info.layout.total
  count = -(-total // size)
  pairs = plan.pairs(0 if staging is None else _memory.host_pointer(staging))
  base = _memory.host_pointer(source)
  for i, runs in enumerate(_packed_plan.bucket_runs(pairs, size, count)):
    for local, offset, n in runs:
      ctypes.memmove(local, base + i * size + offset, n)


@pytest.mark.parametrize("atomic", [False, True])
def test_plan_copies_into_torch_in_place_and_a_row_slice(atomic):
  import rdt_jax

  into = np.zeros((2, 4), np.float32)
  template = {"w": rdt_jax.Slice[1:3, :] if not atomic else torch.zeros(3, 4),
              "b": torch.zeros(5, dtype=torch.bfloat16)}
  if not atomic:
    template["w"] = rdt_jax.Slice(template["w"].index, into)
  plan, source, published = _plan(template, atomic)
  staging = _memory.host_pool.acquire(plan.staging_bytes) if plan.staging_bytes else None
  copy_in_buckets(plan, source, staging)
  leaves = plan.commit(staging)
  b, w = leaves
  assert b is template["b"] and torch.equal(b.float(), torch.ones(5))
  want_w = np.asarray(published["w"])[1:3] if not atomic else np.asarray(published["w"])
  assert np.array_equal(_dlpack.convert_leaf(w, "numpy"), want_w)
  assert (w is into) if not atomic else (w is template["w"])


def test_plan_makes_new_jax_leaves_and_refuses_a_moved_target():
  b = torch.zeros(5, dtype=torch.bfloat16)
  plan, source, published = _plan({"w": jnp.zeros((3, 4)), "b": b})
  staging = _memory.host_pool.acquire(plan.staging_bytes)
  copy_in_buckets(plan, source, staging)
  _, w = plan.commit(staging)
  assert isinstance(w, jax.Array) and np.array_equal(np.asarray(w), np.asarray(published["w"]))
  b.set_(torch.zeros(5, dtype=torch.bfloat16))  # new storage: the plan's address is stale
  with pytest.raises(_dlpack.UnsupportedLeafError, match=r"\['b'\].*memory moved"):
    plan.check_targets()


SHARED_LAYOUTS = """
import sys
sys.path.insert(0, sys.argv[1])
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from rdt_jax import _memory
from test_packing import _plan, copy_in_buckets

mesh = Mesh(np.array(jax.devices()[:2]), ("y",))
split, whole = NamedSharding(mesh, PartitionSpec("y")), NamedSharding(mesh, PartitionSpec())
published = {
    "a": jnp.arange(8.0, dtype=jnp.float32),
    "b": jnp.arange(100, 108, dtype=jnp.int32),
    "c": jnp.arange(8.0, dtype=jnp.float32) * 2,
    "d": jnp.arange(16.0, dtype=jnp.float32).reshape(4, 4),
    "e": jnp.arange(8.0, dtype=jnp.float32) + 7,
}
template = {"a": split, "b": split, "c": split, "d": split, "e": whole}
plan, source, published = _plan(template, published=published)
assert len(plan._sharded) == 4, plan._sharded  # "a" and "c" share theirs
for _ in range(2):  # a second pull reuses the plan
  staging = _memory.host_pool.acquire(plan.staging_bytes)
  copy_in_buckets(plan, source, staging)
  got = dict(zip(sorted(published), plan.commit(staging)))
  for name, x in got.items():
    assert x.sharding == template[name], name
    assert x.dtype == published[name].dtype and np.array_equal(np.asarray(x), np.asarray(published[name])), name
print("arrived")
"""


@pytest.mark.slow  # jax with several host devices, in a subprocess
def test_plan_shares_sharded_layouts_only_between_leaves_of_one_shape_dtype_and_sharding():
  """Leaves of one shape, dtype and sharding share the plan's layout work
  (a model's layers mostly are such leaves); a leaf that differs in any of
  the three still arrives as itself, bit for bit, on its own sharding, at
  every pull of the plan."""
  env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
  out = subprocess.run([sys.executable, "-c", SHARED_LAYOUTS, os.path.dirname(__file__)], env=env,
                       capture_output=True, text=True, timeout=120)
  assert out.stdout.strip() == "arrived", out.stderr[-2000:]


def test_plan_refuses_a_slice_into_of_another_shape():
  import rdt_jax

  with pytest.raises(_dlpack.UnsupportedLeafError, match=r"\['w'\].*shape \(3, 4\).*slice has shape \(2, 4\)"):
    _plan({"w": rdt_jax.Slice(rdt_jax.Slice[0:2].index, np.zeros((3, 4), np.float32)),
           "b": torch.zeros(5, dtype=torch.bfloat16)})


def test_prepared_node_local_read_of_this_process():
  from rdt_jax import _node_local as node_local

  src = np.arange(5000, dtype=np.uint8)
  dst = np.zeros(5000, np.uint8)
  pairs = [(int(dst.ctypes.data) + i, int(src.ctypes.data) + i, 1) for i in range(0, 5000, 2)]
  prepared = node_local.Prepared(pairs)
  assert prepared.count == 2500 and len(prepared.runs[0]) == 3  # 1024 descriptors a call
  node_local.read(_process.identity(), prepared)
  assert np.array_equal(dst[::2], src[::2]) and not dst[1::2].any()
  assert os.getpid() == _process.identity()[2]


def test_stream_split_reuses_positions_only_for_the_same_leaf_types():
  """A publisher's split of a known structure reuses where its array leaves
  are; a tree of the same structure whose leaf types changed is split anew."""
  from rdt_jax.weights import _packed as packed

  stream = packed.Stream(2, "ab" * 16)
  first = {"a": jnp.ones(2), "b": 3}
  _, arrays, positions, rest = stream.split(first)
  assert positions == [0] and arrays[0] is first["a"] and rest == [3]
  swapped = {"a": 4, "b": np.ones(2)}  # the same treedef, other leaf types
  _, arrays, positions, rest = stream.split(swapped)
  assert positions == [1] and arrays[0] is swapped["b"] and rest == [4]
  again = {"a": jnp.zeros(2), "b": 5}
  _, arrays, positions, rest = stream.split(again)
  assert positions == [0] and arrays[0] is again["a"] and rest == [5]
  both = {"a": jnp.zeros(2), "b": torch.ones(2)}
  _, arrays, positions, rest = stream.split(both)
  assert positions == [0, 1] and rest == []
