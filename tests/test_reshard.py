"""Resharding on receive: target shardings, per-process slices, their errors.

An 8-device producer (forced host devices) shards a leaf over a 2x4 mesh;
consumers with 2 or 4 devices ask for it with a sharding of their own or for
one slice each (`rdt_jax.Slice`), through `rdt_jax.set_target_for_ref`. Every
test checks the values bit for bit against the gathered array and the bytes
the consumer asked its backend to move (`DlpackTransport.receive_stats`):
with jax_nixl and jax_transfer only what the consumer needs, with a backend
that cannot read parts (the shared-memory example) every chunk, cut on the
host.
"""

from __future__ import annotations

import ctypes
import math
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import ray

import conftest
import rdt_jax
from _helpers import wait_meta
from rdt_jax import _dlpack, _layout

sys.path.insert(0, str(conftest.REPO / "examples"))
from shm_transport import ShmTransport

rdt_jax.register()
rdt_jax.register_transport(ShmTransport)

WORKER_PATH = os.pathsep.join([conftest.WORKER_PYTHONPATH, str(conftest.REPO / "examples")])


def devices_env(n: int) -> dict:
  return {"env_vars": {"XLA_FLAGS": f"--xla_force_host_platform_device_count={n}", "PYTHONPATH": WORKER_PATH}}


SHAPE = (16, 12)
FULL = np.arange(math.prod(SHAPE), dtype=np.float32).reshape(SHAPE)
NBYTES = FULL.nbytes


# Builders run on the producer (8 devices).


def sharded(spec: tuple, mesh_shape: tuple = (2, 4), names: tuple = ("a", "b")):
  from jax.sharding import Mesh, NamedSharding, PartitionSpec

  devices = np.array(jax.devices()[: math.prod(mesh_shape)]).reshape(mesh_shape)
  sharding = NamedSharding(Mesh(devices, names), PartitionSpec(*spec))
  return {"w": jax.device_put(jnp.asarray(FULL), sharding)}


def two_leaves():
  value = sharded(("a", "b"))
  value["b"] = jnp.arange(12, dtype=jnp.int32)
  return value


# Targets, built on the consumer (shardings hold this process's devices).


def mesh_sharding(mesh_shape: tuple, spec: tuple):
  from jax.sharding import Mesh, NamedSharding, PartitionSpec

  names = ("x", "y")[: len(mesh_shape)]
  devices = np.array(jax.local_devices()[: math.prod(mesh_shape)]).reshape(mesh_shape)
  return NamedSharding(Mesh(devices, names), PartitionSpec(*spec))


def sharding_target(mesh_shape: tuple, spec: tuple):
  return {"w": mesh_sharding(mesh_shape, spec)}


def template_target(mesh_shape: tuple, spec: tuple, shape: tuple = SHAPE, dtype: str = "float32"):
  return {"w": jax.device_put(jnp.zeros(shape, dtype), mesh_sharding(mesh_shape, spec))}


def slice_target(index: tuple, into: str | None = None, mesh: tuple | None = None):
  box = rdt_jax.Slice(index).box(SHAPE, "['w']")
  shape = tuple(b - a for a, b in box)
  if into == "numpy":
    buf = np.zeros(shape, np.float32)
  elif into == "numpy_f64":
    buf = np.zeros(shape, np.float64)
  elif into == "torch":
    import torch

    buf = torch.zeros(shape, dtype=torch.float32)
  elif mesh is not None:
    buf = mesh_sharding(*mesh)
  else:
    buf = None
  return {"w": rdt_jax.Slice(index, into=buf)}


def abstract_target():
  from jax.sharding import AbstractMesh, NamedSharding, PartitionSpec

  return {"w": NamedSharding(AbstractMesh((2,), ("x",)), PartitionSpec("x"))}


def two_leaf_slices(r: int, k: int):
  return {"w": rdt_jax.Slice[r * k : (r + 1) * k, :], "b": rdt_jax.Slice[:]}


def describe(x) -> dict:
  out = {"framework": _dlpack.framework_of(x), "values": np.array(rdt_jax.to_numpy(x))}
  if out["framework"] == "jax":
    s = x.sharding
    out["mesh"] = dict(s.mesh.shape) if hasattr(s, "mesh") else None
    out["spec"] = tuple(s.spec) if hasattr(s, "spec") else None
    out["devices"] = sorted(d.id for d in s.device_set)
    out["shards"] = sorted((s.device.id, tuple(s.data.shape)) for s in x.addressable_shards)
  return out


def manager(name: str):
  from ray.experimental.rdt.util import get_tensor_transport_manager

  return get_tensor_transport_manager(name.upper())


@ray.remote(enable_tensor_transport=True)
class Node:
  def __init__(self, mode: str = "source"):
    rdt_jax.receive_as(mode)
    self.into = None

  def set_mode(self, mode: str):
    rdt_jax.receive_as(mode)

  def device_count(self):
    return jax.device_count()

  @ray.method(tensor_transport="jax_nixl")
  def make(self, build, *args):
    return build(*args)

  def fetch(self, refs, transport: str, make_target=None, *args):
    """Sets the target (if any), gets the ref; returns what arrived and the
    backend's counters for this fetch."""
    manager(transport).receive_stats(reset=True)
    ref = refs[0]
    target = make_target(*args) if make_target is not None else None
    if target is not None:
      rdt_jax.set_target_for_ref(ref, target)
    value = ray.get(ref)
    stats = manager(transport).receive_stats(reset=True)
    into = [
        t.into is value[k]
        for k, t in (target or {}).items()
        if isinstance(t, rdt_jax.Slice) and _dlpack.is_array(t.into) and _dlpack.framework_of(t.into) != "jax"
    ]
    return {k: describe(v) for k, v in value.items()}, stats, all(into)

  def fetch_error(self, refs, transport: str, make_target, *args):
    """Like fetch, for a target that must fail: where it failed, the error,
    and the backend's counters (nothing may have moved)."""
    manager(transport).receive_stats(reset=True)
    ref = refs[0]
    try:
      rdt_jax.set_target_for_ref(ref, make_target(*args))
    except Exception as e:
      return "set", type(e).__name__, str(e), manager(transport).receive_stats(reset=True)
    try:
      ray.get(ref, timeout=60)
    except Exception as e:
      return "get", type(e).__name__, str(e), manager(transport).receive_stats(reset=True)
    return "none", "", "", manager(transport).receive_stats(reset=True)


#: What each backend moves, for objects of every size (conftest.NOT_IN_BAND_ENV).
RAY_ENV = conftest.NOT_IN_BAND_ENV
pytestmark = pytest.mark.usefixtures("ray_session")


@pytest.fixture(scope="module")
def trainer():
  node = Node.options(runtime_env=devices_env(8)).remote()
  assert ray.get(node.device_count.remote()) == 8
  return node


@pytest.fixture(scope="module")
def gens():
  """Four consumers with two devices each (the per-process slice tests)."""
  return [Node.options(runtime_env=devices_env(2)).remote() for _ in range(4)]


@pytest.fixture(scope="module")
def wide():
  """A consumer with four devices."""
  return Node.options(runtime_env=devices_env(4)).remote()


@pytest.fixture(scope="module")
def eight():
  """A consumer with eight devices, as many as the trainer."""
  return Node.options(runtime_env=devices_env(8)).remote()


def make(trainer, transport: str, build, *args):
  ref = trainer.make.options(tensor_transport=transport).remote(build, *args)
  wait_meta(ref)  # Ray lends a ref in a list only once it has its metadata
  return ref


def modes(nodes, mode):
  ray.get([n.set_mode.remote(mode) for n in nodes])
  return nodes


# ---- mesh to mesh


RESHARD_CASES = [
    # (producer spec over 2x4, consumer mesh, consumer spec)
    (("a", "b"), (2, 2), ("x", "y")),  # 8 -> 4 devices, split along both axes
    (("a", "b"), (4,), (None, "x")),  # 8 -> 4, columns only
    (("a", "b"), (2,), ("x",)),  # 8 -> 2, rows only
    (("a", "b"), (4,), ()),  # 8 -> 4, replicated on the consumer
    ((None, "b"), (2, 2), ("y", "x")),  # rows replicated at the source, transposed axes
    ((), (2, 2), ("x", "y")),  # a fully replicated source: one chunk, read once
    ((("a", "b"), None), (4,), (None, "x")),  # two mesh axes on one array axis
]


@pytest.mark.parametrize("transport", ["jax_nixl", "jax_transfer"])
@pytest.mark.parametrize("src_spec, mesh, spec", RESHARD_CASES, ids=str)
def test_mesh_to_mesh(trainer, wide, transport, src_spec, mesh, spec):
  ref = make(trainer, transport, sharded, src_spec)
  got, stats, _ = ray.get(wide.fetch.remote([ref], transport, sharding_target, mesh, spec))
  w = got["w"]
  assert w["framework"] == "jax"
  np.testing.assert_array_equal(w["values"], FULL)
  assert w["mesh"] == dict(zip(("x", "y"), mesh))
  assert w["spec"] == tuple(spec)
  assert w["devices"] == list(range(math.prod(mesh)))
  # Every device holds its own shard: shapes as the target sharding says.
  split = [1] * 2
  for dim, entry in enumerate(spec):
    for name in (entry,) if isinstance(entry, str) else entry or ():
      split[dim] *= dict(zip(("x", "y"), mesh))[name]
  assert {shape for _, shape in w["shards"]} == {(SHAPE[0] // split[0], SHAPE[1] // split[1])}
  # Each byte of the leaf crosses once: replicated source shards are read
  # once, replicated target shards share one received buffer.
  assert stats["bytes"] == NBYTES
  assert stats["fetches"] == 1


@pytest.mark.parametrize("transport", ["jax_nixl", "jax_transfer"])
def test_same_device_count_other_spec(trainer, eight, transport):
  """8 devices to 8 devices, other layouts. On jax_transfer this is the case
  where a pull with the target sharding paired shards by position and
  delivered wrong values; the producer now cuts each target shard."""
  for mesh, spec in (((8,), (None, None)), ((4, 2), ("y", "x")), ((8,), ("x",))):
    ref = make(trainer, transport, sharded, ("a", "b"))
    got, stats, _ = ray.get(eight.fetch.remote([ref], transport, template_target, mesh, spec))
    np.testing.assert_array_equal(got["w"]["values"], FULL)
    assert got["w"]["mesh"] == dict(zip(("x", "y"), mesh)) and got["w"]["spec"] == spec
    assert len(got["w"]["devices"]) == 8
    assert stats["bytes"] == NBYTES


def test_backend_without_partial_reads_moves_whole_chunks_and_cuts(trainer, wide):
  """The example shm transport cannot read parts: the chunks arrive whole
  and the consumer cuts them (values identical; every byte moves)."""
  ref = make(trainer, "shm_example", sharded, ("a", "b"))
  got, stats, _ = ray.get(wide.fetch.remote([ref], "shm_example", sharding_target, (2, 2), ("x", "y")))
  np.testing.assert_array_equal(got["w"]["values"], FULL)
  assert got["w"]["mesh"] == {"x": 2, "y": 2}
  assert stats["bytes"] == NBYTES and stats["destinations"] == 8  # one per source chunk
  ref = make(trainer, "shm_example", sharded, ("a", "b"))
  got, stats, _ = ray.get(wide.fetch.remote([ref], "shm_example", slice_target, (slice(0, 4),)))
  np.testing.assert_array_equal(got["w"]["values"], FULL[:4])
  assert stats["bytes"] == NBYTES


# ---- one slice per consumer process


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("transport", ["jax_nixl", "jax_transfer"])
def test_row_slice_per_process(trainer, gens, n, transport):
  """n generators each pull rows [r*k:(r+1)*k] of every leaf: jax, torch and
  numpy consumers, each getting only its rows."""
  k = SHAPE[0] // n
  kinds = ["jax", "torch", "numpy", "source"][:n]
  consumers = gens[:n]
  for c, mode in zip(consumers, kinds):
    ray.get(c.set_mode.remote(mode))
  ref = make(trainer, transport, sharded, ("a", "b"))
  results = ray.get([
      c.fetch.remote([ref], transport, slice_target, (slice(r * k, (r + 1) * k),))
      for r, c in enumerate(consumers)
  ])
  for r, ((got, stats, _), mode) in enumerate(zip(results, kinds)):
    w = got["w"]
    assert w["framework"] == ("jax" if mode == "source" else mode)
    np.testing.assert_array_equal(w["values"], FULL[r * k : (r + 1) * k])
    assert w["values"].flags.c_contiguous
    assert stats["bytes"] == NBYTES // n  # only this process's rows
  modes(consumers, "source")


@pytest.mark.parametrize("transport", ["jax_nixl", "jax_transfer"])
def test_column_slice_per_process(trainer, gens, transport):
  """A slice along a non-leading axis (tensor-parallel columns): strided in
  the source, still only its bytes move; nixl reads one run per row of each
  source shard it overlaps."""
  ref = make(trainer, transport, sharded, ("a", None))  # rows split: chunks (8, 12)
  results = ray.get([
      c.fetch.remote([ref], transport, slice_target, (slice(None), slice(r * 6, (r + 1) * 6)), "numpy")
      for r, c in enumerate(gens[:2])
  ])
  for r, (got, stats, into_used) in enumerate(results):
    np.testing.assert_array_equal(got["w"]["values"], FULL[:, r * 6 : (r + 1) * 6])
    assert into_used  # received straight into the given array
    assert stats["bytes"] == NBYTES // 2
    if transport == "jax_nixl":
      assert stats["destinations"] == SHAPE[0]  # one 24-byte run per row
      assert stats["descriptors"] == SHAPE[0]


def test_slice_into_torch_and_sharded_jax(trainer, gens):
  ref = make(trainer, "jax_nixl", sharded, ("a", "b"))
  (t, t_stats, t_into), (j, j_stats, _) = ray.get([
      gens[0].fetch.remote([ref], "jax_nixl", slice_target, (slice(8, 16),), "torch"),
      gens[1].fetch.remote([ref], "jax_nixl", slice_target, (slice(0, 8),), None, ((2,), (None, "x"))),
  ])
  assert t["w"]["framework"] == "torch" and t_into
  np.testing.assert_array_equal(t["w"]["values"], FULL[8:])
  assert j["w"]["framework"] == "jax" and j["w"]["mesh"] == {"x": 2} and j["w"]["spec"] == (None, "x")
  assert j["w"]["shards"] == [(0, (8, 6)), (1, (8, 6))]
  np.testing.assert_array_equal(j["w"]["values"], FULL[:8])
  assert t_stats["bytes"] == j_stats["bytes"] == NBYTES // 2


def test_every_leaf_sliced_across_four_processes(trainer, gens):
  """A tree: each generator takes its rows of "w" and all of "b"; together
  they cover "w" exactly once."""
  ref = make(trainer, "jax_nixl", two_leaves)
  results = ray.get([
      g.fetch.remote([ref], "jax_nixl", two_leaf_slices, r, 4) for r, g in enumerate(gens)
  ])
  rows = np.concatenate([got["w"]["values"] for got, _, _ in results])
  np.testing.assert_array_equal(rows, FULL)
  for got, stats, _ in results:
    np.testing.assert_array_equal(got["b"]["values"], np.arange(12, dtype=np.int32))
    assert stats["bytes"] == NBYTES // 4 + 12 * 4


def test_slice_of_unsharded_leaf_and_scalar_index(trainer, gens):
  def plain():
    return {"w": jnp.asarray(FULL)}

  ref = make(trainer, "jax_nixl", plain)
  got, stats, _ = ray.get(gens[0].fetch.remote([ref], "jax_nixl", slice_target, (3, slice(2, 5))))
  np.testing.assert_array_equal(got["w"]["values"], FULL[3:4, 2:5])
  assert stats["bytes"] == 3 * 4 and stats["destinations"] == 1


# ---- errors: before any byte moves, naming the leaf and the fix


ERROR_CASES = [
    # (target builder, args, pattern)
    (template_target, ((2,), ("x",), (16, 10)), r"Target for leaf \['w'\] has shape \(16, 10\).*\(16, 12\)"),
    (template_target, ((2,), ("x",), SHAPE, "int32"), r"Target for leaf \['w'\].*dtype int32.*float32"),
    (slice_target, ((slice(0, 4),), "numpy_f64"), r"Target for leaf \['w'\].*dtype float64.*float32"),
    (slice_target, ((slice(8, 20),),), r"Leaf \['w'\] has shape \(16, 12\).*\[8:20\] on axis 0.*out of range"),
    (slice_target, ((slice(0, 2), slice(0, 2), slice(0, 1)),), r"Leaf \['w'\] has shape \(16, 12\).*3 indices"),
    (slice_target, ((slice(0, 8, 2),),), r"Leaf \['w'\] has a Slice with step 2"),
    (abstract_target, (), r"Leaf \['w'\] has a target sharding over devices this process does not have"),
    (sharding_target, ((2,), (None, None, "x")), r"Leaf \['w'\] does not fit its target sharding"),
]


@pytest.mark.parametrize("build, args, pattern", ERROR_CASES, ids=lambda v: getattr(v, "__name__", None))
def test_bad_target_fails_before_any_byte_moves(trainer, gens, build, args, pattern):
  ref = make(trainer, "jax_nixl", sharded, ("a", "b"))
  wait_meta(ref)
  where, _kind, message, stats = ray.get(gens[0].fetch_error.remote([ref], "jax_nixl", build, *args))
  assert where in ("set", "get"), "the target was accepted"
  import re

  assert re.search(pattern, message), message
  assert stats["bytes"] == 0 and stats["fetches"] == 0
  # The consumer is fine afterwards: the same ref arrives whole.
  got, _, _ = ray.get(gens[0].fetch.remote([ref], "jax_nixl", slice_target, ()))
  np.testing.assert_array_equal(got["w"]["values"], FULL)


def test_bad_target_at_fetch_start_when_metadata_was_unknown(trainer):
  """When set_target_for_ref cannot see the metadata yet, the same checks run
  when the fetch starts, before the plan takes memory or posts a read."""
  from rdt_jax._targets import Target
  from rdt_jax.transports._plan import ReceivePlan

  spec = _dlpack.describe(jnp.asarray(FULL), "['w']").spec
  with pytest.raises(rdt_jax.UnsupportedLeafError, match=r"\['w'\].*\[0:99\] on axis 1"):
    ReceivePlan([spec], "source", Target(buffers={"['w']": rdt_jax.Slice[:, 0:99]}))
  with pytest.raises(ValueError, match=r"Target for leaf \['w'\] has shape \(2,\)"):
    ReceivePlan([spec], "source", Target(buffers={"['w']": rdt_jax.Slice((0,), into=np.zeros(2, np.float32))}))


def test_two_sided_ref_refuses_targets(trainer, wide):
  from ray.experimental.collective import create_collective_group, destroy_collective_group

  group = create_collective_group([trainer, wide], backend="torch_gloo")
  try:
    ref = make(trainer, "jax_gloo", sharded, ("a", "b"))
    wait_meta(ref)
    with pytest.raises(ValueError, match=r"two-sided transport.*jax_nixl"):
      rdt_jax.set_target_for_ref(ref, {"w": rdt_jax.Slice[0:8]})
  finally:
    destroy_collective_group(group)


# ---- the plan itself, without Ray: runs and bytes


@pytest.mark.parametrize(
    "target, error, pattern",
    [
        (rdt_jax.Slice[..., 0:2], rdt_jax.UnsupportedLeafError, r"\['w'\] has a Slice with an Ellipsis"),
        (rdt_jax.Slice["a"], rdt_jax.UnsupportedLeafError, r"\['w'\] has a Slice index 'a' on axis 0"),
        (rdt_jax.Slice[2:1], rdt_jax.UnsupportedLeafError, r"\['w'\].*\[2:1\] on axis 0.*start <= stop"),
        (rdt_jax.Slice((slice(0, 2),), into=[1, 2]), TypeError, r"Slice.into for leaf \['w'\] is a list"),
    ],
    ids=["ellipsis", "not-an-index", "reversed", "into-not-an-array"],
)
def test_more_bad_slices(target, error, pattern):
  from rdt_jax._targets import Target
  from rdt_jax.transports._plan import ReceivePlan

  spec = _dlpack.describe(jnp.asarray(FULL), "['w']").spec
  with pytest.raises(error, match=pattern):
    ReceivePlan([spec], "source", Target(buffers={"['w']": target}))


def test_copy_runs_match_numpy_cut():
  rng = np.random.default_rng(0)
  for _ in range(200):
    ndim = int(rng.integers(1, 4))
    shape = tuple(int(n) for n in rng.integers(1, 7, ndim))
    full = rng.standard_normal(shape).astype(np.float32)

    def rand_box(shape=shape):
      out = []
      for n in shape:
        a = int(rng.integers(0, n))
        out.append((a, int(rng.integers(a + 1, n + 1))))
      return tuple(out)

    src, dst = rand_box(), rand_box()
    part = _dlpack.intersect(src, dst)
    src_buf = np.ascontiguousarray(full[tuple(slice(a, b) for a, b in src)])
    dst_buf = np.zeros(_dlpack.box_shape(dst), np.float32)
    want = dst_buf.copy()
    _layout.cut(want, dst, src_buf, src)
    if part is not None:
      for s, d, n in _layout.copy_runs(src, dst, part, 4):
        ctypes.memmove(dst_buf.ctypes.data + d, src_buf.ctypes.data + s, n)
      assert sum(n for _, _, n in _layout.copy_runs(src, dst, part, 4)) == math.prod(_dlpack.box_shape(part)) * 4
    np.testing.assert_array_equal(dst_buf, want)


def test_leading_axis_slice_is_one_run_per_overlapping_chunk():
  box = ((0, 8), (0, 12))
  assert _layout.copy_runs(box, ((4, 8), (0, 12)), ((4, 8), (0, 12)), 4) == [(4 * 48, 0, 4 * 48)]
  # A column block: one run per row.
  assert len(_layout.copy_runs(box, ((0, 8), (6, 12)), ((0, 8), (6, 12)), 4)) == 8
