"""Corrupted and truncated transport metadata on the consumer: always
`rdt_jax.MetadataError` before any byte moves, never a crash, a hang or a
write into the receiver's memory.

No Ray cluster: one process plays producer and consumer of `jax_nixl` (two
NIXL agents), as `scripts/overhead_micro.py` does, with the defaults except
that small objects are not sent in band (the path under test reads them).
Each case corrupts one field of real metadata, pickles it again (the packed
forms are decoded on the way), and fetches it into sentinel-filled targets:
the fetch either raises `MetadataError` with every target untouched, or (a
change that does not matter, such as a leaf's path) delivers exactly the
producer's bytes.
"""

from __future__ import annotations

import copy
import pickle
import random

import numpy as np
import pytest
from ray.experimental.rdt.tensor_transport_manager import CommunicatorMetadata

import rdt_jax
from rdt_jax import _dlpack, _handoff
from rdt_jax._dlpack import ChunkSpec, LeafSpec, ShardingLayout
from rdt_jax._metadata import DlpackTransportMetadata, MetadataError
from rdt_jax.transports._plan import ReceivePlan
from rdt_jax.transports.nixl import NixlTransport, NixlTransportMetadata

pytest.importorskip("nixl")

SENTINEL = 0xAB
CASES = 240


@pytest.fixture(scope="module", params=["node-local", "nixl"])
def pair(request):
  """(producer, consumer, tree, metadata) of one exported object."""
  env = {"RDT_JAX_INLINE_MAX_BYTES": "0", "RDT_JAX_NIXL_CMA": "1" if request.param == "node-local" else "0"}
  with pytest.MonkeyPatch.context() as mp:
    for k, v in env.items():
      mp.setenv(k, v)
    prod, cons = NixlTransport(), NixlTransport()
    tree = [
        np.arange(64, dtype=np.float32),  # packed into the staging buffer
        np.arange(3 * 5, dtype=np.int16).reshape(3, 5),
        np.zeros((0, 4), np.float64),  # empty: no chunk read
        np.arange(100_000, dtype=np.int64),  # read in place (above the packing limit)
    ]
    for i, x in enumerate(tree):
      _handoff.record_described(x, _dlpack.describe(x, f"[{i}]"))
    meta = prod.extract_tensor_transport_metadata("fuzz", tree)
    yield prod, cons, tree, meta
    prod.garbage_collect("fuzz", meta, tree)


def _sentinel_targets(tree):
  out = []
  for x in tree:
    t = np.empty_like(x)
    t.view(np.uint8)[...] = SENTINEL
    out.append(t)
  return out


def _fetch(cons, meta, targets):
  request = cons.fetch_multiple_tensors("fuzz", meta, CommunicatorMetadata(), targets)
  return cons.wait_fetch_complete(request, 30)


def _round_trip(meta):
  return pickle.loads(pickle.dumps(meta))


def test_genuine_metadata_is_read(pair):
  _, cons, tree, meta = pair
  targets = _sentinel_targets(tree)
  got = _fetch(cons, _round_trip(meta), targets)
  for g, x in zip(got, tree):
    np.testing.assert_array_equal(g, x)


# ---- the corruptions

BAD_INTS = [-1, 0, 1, 7, 1 << 57, 1 << 64, -(1 << 70), "12", None, 1.5, True, [3]]


def _bad_int(rng, value):
  if type(value) is int and rng.random() < 0.4:
    return value ^ (1 << rng.randrange(0, 48)) if value > 0 else value - 1 - rng.randrange(8)
  return rng.choice(BAD_INTS)


def _bad_list(rng, values):
  kind = rng.randrange(5)
  if kind == 0:
    return values[:-1]  # truncated
  if kind == 1:
    return values + values[-1:]  # one too many
  if kind == 2:
    return tuple(values)
  if kind == 3:
    return None
  out = list(values)
  if out:
    i = rng.randrange(len(out))
    out[i] = _bad_int(rng, out[i])
  return out


def _bad_leaf(rng, leaf: LeafSpec) -> LeafSpec:
  field = rng.choice(["shape", "dtype", "framework", "device", "chunks", "nbytes", "chunk_shape", "type"])
  if field == "shape":
    shape = list(leaf.shape) or [0]
    i = rng.randrange(len(shape))
    shape[i] = rng.choice([shape[i] + 1, shape[i] - 1, -1, 1 << 60, "3", None])
    return leaf._replace(shape=tuple(shape) if rng.random() < 0.8 else shape)
  if field == "dtype":
    return leaf._replace(dtype=rng.choice([np.dtype(object), "float32", None, np.dtype("V0")]))
  if field == "framework":
    return leaf._replace(framework=rng.choice(["jaxx", None, 3]))
  if field == "device":
    return leaf._replace(device=rng.choice(["tpu", "", None]))
  if field == "chunks":
    return leaf._replace(chunks=rng.choice([(), list(leaf.chunks), leaf.chunks * 2, None]))
  chunk = leaf.chunks[0]
  if field == "nbytes":
    n = rng.choice([chunk.nbytes + 1, chunk.nbytes - 1, chunk.nbytes * 2, -8, 1 << 62, "8", None])
    return leaf._replace(chunks=(ChunkSpec(chunk.shape, n),))
  if field == "chunk_shape":
    return leaf._replace(chunks=(ChunkSpec((*chunk.shape, 1, 2), chunk.nbytes),))
  return rng.choice([tuple(leaf), leaf[:5], None, "leaf"])  # type: ignore[return-value]


def _corrupt(rng: random.Random, meta: NixlTransportMetadata) -> tuple[NixlTransportMetadata, str]:
  """A copy of `meta` with one field corrupted, and what was done."""
  m = copy.deepcopy(meta)
  field = rng.choice([
      "addresses", "device_ids", "regions", "spans", "live", "serial", "digest", "agent_version",
      "dereg_epoch", "agent_name", "agent_meta", "leaves", "leaf", "tensor_meta", "tensor_device",
      "origin", "inline",
  ])
  if field in ("addresses", "device_ids", "regions"):
    setattr(m, field, _bad_list(rng, getattr(m, field)))
  elif field == "spans":
    spans = list(m.spans)
    choice = rng.randrange(4)
    if choice == 0:
      spans = []
    elif choice == 1:
      rid, start, n = spans[0]
      spans[0] = (rid, start + rng.choice([8, 64, -64]), n)
    elif choice == 2:
      rid, start, n = spans[0]
      spans[0] = (rid, start, rng.choice([1, n // 2, -n]))
    else:
      spans[0] = rng.choice([None, spans[0][:2], [*spans[0]]])
    m.spans = spans
  elif field == "live":
    m.live = rng.choice([[], None, [(m.serial + 1, m.serial + 2)], [(3, 1)], [(0, m.serial)], "1-5"])
  elif field in ("serial", "digest", "agent_version", "dereg_epoch"):
    setattr(m, field, _bad_int(rng, getattr(m, field)))
  elif field == "agent_name":
    m.agent_name = rng.choice([None, "", 5, m.agent_name + "x", m.agent_name[:-1]])
  elif field == "agent_meta":
    m.agent_meta = rng.choice([None, b"", "text", m.agent_meta[:-1], m.agent_meta + b"\0"])
  elif field == "leaves":
    m.leaves = rng.choice([m.leaves[:-1], m.leaves + m.leaves[:1], tuple(m.leaves), None, m.leaves[::-1]])
  elif field == "leaf":
    i = rng.choice([0, 1, 3])
    m.leaves = list(m.leaves)
    m.leaves[i] = _bad_leaf(rng, m.leaves[i])
  elif field == "tensor_meta":
    m.tensor_meta = rng.choice([m.tensor_meta[:-1], None, [((1,), np.dtype("float32"))] * len(m.leaves)])
  elif field == "tensor_device":
    m.tensor_device = rng.choice(["cuda", None, "tpu", 0])
  elif field == "origin":
    origin = m.origin
    assert origin is not None
    m.origin = rng.choice([None, (origin[0], origin[1], origin[2] + 1, origin[3]), origin[:3], "pid"])
  else:
    m.inline = rng.choice([b"", b"\0" * 7])
  return m, field


def _check_one(cons, tree, meta, what):
  targets = _sentinel_targets(tree)
  try:
    got = _fetch(cons, _round_trip(meta), targets)
  except MetadataError as e:
    assert "Transport metadata of object fuzz is invalid: field" in str(e), what
    for t in targets:
      assert (t.view(np.uint8) == SENTINEL).all(), f"{what}: a target was written before the error"
    return "refused"
  for g, x in zip(got, tree):
    np.testing.assert_array_equal(g, x, err_msg=what)
  return "read"


def test_corrupted_metadata_is_refused_before_any_write(pair):
  _, cons, tree, meta = pair
  rng = random.Random(20261125)
  outcomes: dict[str, int] = {}
  for case in range(CASES):
    corrupted, field = _corrupt(rng, meta)
    outcome = _check_one(cons, tree, corrupted, f"case {case} ({field})")
    outcomes[outcome] = outcomes.get(outcome, 0) + 1
  assert outcomes.get("refused", 0) > CASES * 0.8, outcomes
  # The consumer still reads the genuine object afterwards.
  test_genuine_metadata_is_read(pair)


def test_packed_forms_cut_short_are_refused(pair):
  """The pickled forms of the leaves and integer lists, truncated or
  garbled, decode into a value `validate` refuses (unpickling never raises
  an error that cannot name the object)."""
  _, cons, tree, meta = pair
  state = meta.__getstate__()
  for key in ("leaves", "live"):
    packed = state[key]
    for mutate in (lambda b: b[:-1], lambda b: b[: len(b) // 2], lambda b: b"\xff" * len(b), lambda b: b""):
      broken = copy.copy(packed)
      field = "index" if key == "leaves" else "data"
      setattr(broken, field, mutate(getattr(packed, field)))
      m = NixlTransportMetadata.__new__(NixlTransportMetadata)
      m.__setstate__({**state, key: broken})
      targets = _sentinel_targets(tree)
      with pytest.raises(MetadataError):
        _fetch(cons, m, targets)
      assert all((t.view(np.uint8) == SENTINEL).all() for t in targets)


# ---- sharded leaves: boxes travel in the metadata and are checked

F32 = np.dtype("float32")


def _sharded(boxes=None, shape=(4, 6), mesh=(2,), spec=("x",), device_chunks=(0, 1)):
  layout = ShardingLayout(mesh, ("x",), spec, device_chunks,
                          ((((0, 2), (0, 6)), ((2, 4), (0, 6)))) if boxes is None else boxes)
  chunk = ChunkSpec((2, 6), 2 * 6 * 4)
  return LeafSpec("['s']", shape, F32, "jax", "cpu", (chunk, chunk), layout)


def _meta(leaf):
  return DlpackTransportMetadata(tensor_meta=[(leaf.shape, leaf.dtype)], tensor_device="cpu", leaves=[leaf])


def test_sharded_leaf_with_its_boxes_is_valid():
  _meta(_sharded()).validate("s")
  assert _dlpack.source_boxes(_sharded()) == [((0, 2), (0, 6)), ((2, 4), (0, 6))]


@pytest.mark.parametrize("boxes, field", [
    ((((0, 2), (0, 6)),), "sharding.boxes"),  # one box for two chunks
    ((((0, 2), (0, 6)), ((1, 3), (0, 6))), "sharding.boxes[1]"),  # overlaps
    ((((0, 2), (0, 6)), ((2, 4), (0, 5))), "sharding.boxes[1]"),  # shape is not its chunk's
    ((((0, 2), (0, 6)), ((3, 5), (0, 6))), "sharding.boxes[1]"),  # outside the leaf
    ((((2, 4), (0, 6)), ((0, 2), (0, 6))), "sharding.boxes"),  # not where the spec puts them
    ((((0, 2), (0, 6)), ((2, 4),)), "sharding.boxes[1]"),  # an axis missing
    ((((0, 2), (0, 6)), [(2, 4), (0, 6)]), "sharding.boxes[1]"),  # wrong type
])
def test_wrong_shard_boxes_are_refused_naming_the_field(boxes, field):
  with pytest.raises(MetadataError, match=r"field leaves\[0\]\." + field.replace("[", r"\[").replace("]", r"\]")) as e:
    _meta(_sharded(boxes)).validate("s")
  assert e.value.path == "['s']" and e.value.object_id == "s"


@pytest.mark.parametrize("kwargs, field", [
    ({"mesh": (3,), "device_chunks": (0, 1, 1)}, "sharding.boxes"),  # 4 rows do not split in 3
    ({"device_chunks": (0,)}, "sharding.device_chunks"),
    ({"device_chunks": (0, 2)}, "sharding.device_chunks"),
    ({"spec": ("y",)}, "sharding.boxes"),  # an axis the mesh lacks
    ({"spec": (3,)}, "sharding.spec"),
    ({"mesh": (0,)}, "sharding.mesh_shape"),
])
def test_inconsistent_layouts_are_refused(kwargs, field):
  with pytest.raises(MetadataError, match=field):
    _meta(_sharded(**kwargs)).validate("s")


def test_plan_never_reads_past_a_chunk_of_unchecked_metadata():
  """A receive plan built from metadata that skipped `validate` (a custom
  transport's own path) still refuses runs outside a source chunk."""
  leaf = _sharded()
  bad = leaf._replace(chunks=(ChunkSpec((2, 6), 8), ChunkSpec((2, 6), 8)))  # sizes cut short
  plan = ReceivePlan([bad], "numpy", _target_slice(), "s")
  with pytest.raises(MetadataError, match=r"chunks\[0\]"):
    plan.allocate()


def _target_slice():
  from rdt_jax._targets import Target

  return Target(buffers={"['s']": rdt_jax.Slice[1:3]})


def test_metadata_error_pickles_with_its_fields():
  e = MetadataError("obj", "addresses[3]", "is -1", "['w']")
  back = pickle.loads(pickle.dumps(e))
  assert type(back) is MetadataError and str(back) == str(e)
  assert (back.object_id, back.field, back.path) == ("obj", "addresses[3]", "['w']")
  assert isinstance(back, rdt_jax.UnsupportedLeafError)


def test_sharded_describe_sends_the_shard_boxes():
  """The producer sends each shard's box as jax reports it; the consumer's
  checks accept it."""
  import os
  import subprocess
  import sys

  code = """
import jax, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from rdt_jax import _dlpack
mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("x", "y"))
x = jax.device_put(np.arange(8 * 6, dtype=np.float32).reshape(8, 6), NamedSharding(mesh, P("x", None)))
spec = _dlpack.describe(x, "['s']").spec
want = sorted({tuple(s.indices(n)[:2] for s, n in zip(sh.index, x.shape)) for sh in x.addressable_shards})
assert sorted(spec.sharding.boxes) == want, (spec.sharding.boxes, want)
assert len(spec.chunks) == 2 and _dlpack.spec_problem(spec) is None
assert _dlpack.source_boxes(spec) == list(spec.sharding.boxes)
print("ok")
"""
  env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu"}
  out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
  assert out.stdout.strip() == "ok", out.stderr


# ---- live serials: bounded, exact

def test_live_serials_stay_exact_when_freed_out_of_order():
  from rdt_jax.transports.nixl.export import LiveSerials
  from rdt_jax.transports.nixl.staleness import live_ranges

  rng = random.Random(7)
  live, serials = LiveSerials(), set()
  for n in range(1, 3001):
    live.add(n)
    serials.add(n)
    if rng.random() < 0.6:
      gone = rng.choice(sorted(serials))
      live.remove(gone)
      serials.discard(gone)
      live.remove(gone)  # twice: nothing
    assert len(live) <= len(serials)
  assert live.ranges() == live_ranges(sorted(serials))


def test_live_ranges_pickle_compactly_and_exactly():
  """Every other serial freed: as many ranges as live objects, pickled as
  one bit per serial instead of 16 bytes a range."""
  live = [(n, n) for n in range(1, 20_001, 2)]
  meta = NixlTransportMetadata(tensor_meta=[], live=live, serial=1)
  back = _round_trip(meta)
  assert back.live == live
  assert len(pickle.dumps(meta)) < 20_000 // 8 + 1_000
  few = [(1, 5), (1_000_000, 1_000_003)]
  meta.live = few
  assert _round_trip(meta).live == few and len(pickle.dumps(meta)) < 1_000


def test_node_local_reads_stay_inside_registered_memory(pair):
  """The node-local read checks each descriptor against the regions the
  producer registered, whatever produced the descriptor."""
  from rdt_jax.transports.nixl.read import check_registered

  _, _, tree, meta = pair
  span = meta.spans[0]
  check_registered("fuzz", meta, [(span[1], span[2], 0), (meta.addresses[-1], tree[-1].nbytes, 0)])
  for address, nbytes in ((span[1] - 8, 16), (span[1] + span[2] - 8, 16), (meta.addresses[-1] + 8, tree[-1].nbytes)):
    with pytest.raises(MetadataError, match="outside every region the producer registered"):
      check_registered("fuzz", meta, [(address, nbytes, 0)])


def test_plan_never_writes_past_an_in_place_target_of_unchecked_metadata():
  """An in-place destination takes the target's own size: a chunk the
  (unchecked) metadata says is larger than the target is refused."""
  from rdt_jax._targets import Target

  spec = LeafSpec("['w']", (4,), F32, "numpy", "cpu", (ChunkSpec((4,), 32),))
  target = np.full(4, 7.0, np.float32)
  plan = ReceivePlan([spec], "numpy", Target(buffers={"['w']": target}), "w")
  with pytest.raises(MetadataError, match=r"plans 32 bytes into its target, which holds 16"):
    plan.allocate()
  assert (target == 7.0).all()
