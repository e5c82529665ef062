"""Transport metadata pickles per object, not per leaf, and round-trips exactly."""

from __future__ import annotations

import pickle

import ml_dtypes
import numpy as np

from rdt_jax._dlpack import ChunkSpec, LeafSpec, ShardingLayout
from rdt_jax._metadata import DlpackTransportMetadata, _Ints, _Leaves
from rdt_jax.transports.nixl import NixlTransportMetadata

F32 = np.dtype("float32")


def _leaf(i: int, shape=(4, 2), dtype=F32, framework="jax") -> LeafSpec:
  nbytes = int(np.prod(shape)) * dtype.itemsize
  return LeafSpec(f"['w'][{i}]", shape, dtype, framework, "cpu", (ChunkSpec(shape, nbytes),))


def _round_trip(meta):
  return pickle.loads(pickle.dumps(meta))


def test_many_leaves_round_trip_compactly():
  bf16 = np.dtype(ml_dtypes.bfloat16)
  leaves = [_leaf(i, (i % 3, 5), bf16 if i % 2 else np.dtype("int64"), "torch" if i % 5 else "numpy")
            for i in range(1000)]
  leaves.append(_leaf(1000, (), np.dtype("uint8")))
  meta = NixlTransportMetadata(
      tensor_meta=[(s.shape, s.dtype) for s in leaves], tensor_device="cpu", leaves=leaves,
      agent_name="a", agent_meta=b"m", addresses=[(1 << 46) + 64 * i for i in range(1001)],
      device_ids=[0] * 1001, regions=[-1 - i if i % 2 else 0 for i in range(1001)],
  )
  state = meta.__getstate__()
  assert type(state["leaves"]) is _Leaves and state["tensor_meta"] is None
  assert len(state["leaves"].signatures) == 3 * 2 * 2 + 1
  assert all(type(state[k]) is _Ints for k in ("addresses", "device_ids", "regions"))
  assert state["device_ids"].typecode == "b"
  got = _round_trip(meta)
  assert got.leaves == leaves and got.tensor_meta == meta.tensor_meta
  assert (got.addresses, got.device_ids, got.regions) == (meta.addresses, meta.device_ids, meta.regions)
  assert (got.agent_name, got.agent_meta, got.tensor_device) == ("a", b"m", "cpu")
  assert len(pickle.dumps(meta)) < len(pickle.dumps(meta.__dict__)) / 2


def test_leaves_that_need_their_full_spec_are_sent_as_they_are():
  layout = ShardingLayout((2,), ("x",), ("x",), (0, 1))
  sharded = LeafSpec("['s']", (4,), np.dtype("float32"), "jax", "cpu",
                     (ChunkSpec((2,), 8), ChunkSpec((2,), 8)), layout)
  for leaves in ([_leaf(0), sharded], [_leaf(0), _leaf(1)._replace(path="a\x00b")]):
    meta = DlpackTransportMetadata(tensor_meta=[(s.shape, s.dtype) for s in leaves],
                                   tensor_device="cpu", leaves=leaves)
    assert type(meta.__getstate__()["leaves"]) is list
    got = _round_trip(meta)
    assert got.leaves == leaves and got.tensor_meta == meta.tensor_meta


def test_custom_tensor_meta_and_huge_ints_are_kept():
  leaves = [_leaf(i) for i in range(20)]
  custom = [((8,), np.dtype("uint8"))] * 20  # a backend may describe bytes differently
  meta = NixlTransportMetadata(tensor_meta=custom, tensor_device="cpu", leaves=leaves,
                               addresses=[1 << 64] * 20, device_ids=[], regions=[True] * 20)
  state = meta.__getstate__()
  assert state["tensor_meta"] == custom and type(state["addresses"]) is list
  assert type(state["regions"]) is list  # bools are not ints here
  got = _round_trip(meta)
  assert got.tensor_meta == custom and got.addresses == [1 << 64] * 20 and got.leaves == leaves
  empty = _round_trip(DlpackTransportMetadata(tensor_meta=[], tensor_device=None))
  assert empty.leaves == [] and empty.tensor_meta == []
