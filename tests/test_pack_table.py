"""A pack's leaf table is made, pickled and checked once per structure, and
never trusted for being cached (`rdt_jax._pack_table`).

No Ray here: the tables, their wire forms, the metadata's round trips through
an owner, and the checks. `test_packed_returns.py` checks the same through
Ray, from a producer actor's serializer to a consumer.
"""

from __future__ import annotations

import copy
import pickle

import numpy as np
import pytest

from rdt_jax import _limits, _pack_table
from rdt_jax._compact import CompactInts, CompactLeaves, Undecodable
from rdt_jax._dlpack import ChunkSpec, LeafSpec, ShardingLayout
from rdt_jax._leaf_pack import PACKED_PATH
from rdt_jax._metadata import DlpackTransportMetadata, MetadataError

F32 = np.dtype("float32")
I8 = np.dtype("int8")


def _spec(i: int, shape=(3, 2), dtype=F32) -> LeafSpec:
  nbytes = int(np.prod(shape)) * dtype.itemsize
  return LeafSpec(f"['p{i}']", shape, dtype, "jax", "cpu", (ChunkSpec(shape, nbytes),))


def _specs(n: int = 100, tag: str = "") -> list[LeafSpec]:
  return [_spec(i, (i % 4 + 1, 2), (F32, I8)[i % 2])._replace(path=f"['p{i}']{tag}") for i in range(n)]


def _meta(table: _pack_table.PackTable, extra: int = 2) -> DlpackTransportMetadata:
  """The metadata of a value of the packed leaves of `table` and `extra` others."""
  need = table.layout()[2]
  buffer = LeafSpec(PACKED_PATH, (need,), np.dtype("uint8"), "numpy", "cpu", (ChunkSpec((need,), need),))
  leaves = [buffer] + [_spec(1000 + i)._replace(framework="numpy") for i in range(extra)]
  return DlpackTransportMetadata(
      tensor_meta=[(s.shape, s.dtype) for s in leaves], tensor_device="cpu", leaves=leaves,
      packed=(0, table.specs, table.positions),
  )


def _wire_round_trip(specs_form, positions_form):
  """The forms as another process receives them: pickled and unpickled."""
  return pickle.loads(pickle.dumps((specs_form, positions_form)))


def test_a_table_is_encoded_once_and_known_by_its_specs():
  table = _pack_table.make(_specs(), range(100))
  assert _pack_table.of(table.specs) is table
  assert _pack_table.of(list(table.specs)) is None  # equal, but not the table's own specs
  first = table.wire()
  assert table.wire() is first and type(first[0]) is CompactLeaves and type(first[1]) is CompactInts
  assert _pack_table.wire(table.specs, table.positions) is first


def test_a_received_form_decodes_once_to_one_table():
  table = _pack_table.make(_specs(tag="[r]"), range(0, 200, 2))
  before = _pack_table.counts()
  specs, positions = _pack_table.received(*_wire_round_trip(*table.wire()))
  assert list(specs) == list(table.specs) and list(positions) == list(table.positions)
  again = _pack_table.received(*_wire_round_trip(*table.wire()))  # new objects, the same bytes
  assert again[0] is specs and again[1] is positions
  after = _pack_table.counts()
  assert after["decoded"] == before["decoded"] + 1
  # The receiver pickles the table on (an owner to a consumer) from the form it keeps.
  assert _pack_table.wire(specs, positions) is _pack_table.of(specs).wire()


def test_a_form_that_differs_in_any_byte_is_another_table():
  table = _pack_table.make(_specs(tag="[d]"), range(100))
  specs_form, positions_form = _wire_round_trip(*table.wire())
  specs, _ = _pack_table.received(specs_form, positions_form)
  renamed = copy.copy(specs_form)
  renamed.paths = renamed.paths.replace("['p7']", "['q7']")
  other, _ = _pack_table.received(renamed, positions_form)
  assert other is not specs and other[7].path == "['q7'][d]" and specs[7].path == "['p7'][d]"
  moved = CompactInts(positions_form.typecode, CompactInts.encode([p + 1 for p in table.positions]).data)
  _, shifted = _pack_table.received(specs_form, moved)
  assert list(shifted) == [p + 1 for p in table.positions]
  # A signature equal by == but not the same (True for 1) is not taken for the kept one.
  sigs = copy.copy(specs_form)
  sigs.signatures = [(tuple(True if d == 1 else d for d in s[0]), *s[1:]) for s in specs_form.signatures]
  odd, _ = _pack_table.received(sigs, positions_form)
  assert odd is not specs


@pytest.mark.parametrize("field, mutate", [
    ("index", lambda b: b[:-1]),
    ("index", lambda b: b"\xff" * len(b)),
    ("paths", lambda p: p + "\x00extra"),
    ("paths", lambda p: 7),
    ("signatures", lambda s: [("not", "a", "signature")]),
])
def test_an_undecodable_form_is_refused_by_the_metadata(field, mutate):
  table = _pack_table.make(_specs(tag="[u]"), range(100))
  meta = _meta(table)
  state = meta.__getstate__()
  slot, specs_form, positions_form = state["packed"]
  broken = copy.copy(specs_form)
  setattr(broken, field, mutate(getattr(broken, field)))
  got = DlpackTransportMetadata.__new__(DlpackTransportMetadata)
  got.__setstate__({**state, "packed": (slot, broken, positions_form)})
  with pytest.raises(MetadataError, match=r"packed\[1\]"):
    got.validate("obj")


def test_an_undecodable_form_is_undecodable():
  broken = CompactLeaves("a\x00b", [((2,), F32, "jax", "cpu", 8)], b"\x00\x00")  # cut short
  specs, _ = _pack_table.received(broken, CompactInts.encode([0, 1]))
  assert type(specs) is Undecodable


def _bad(specs, positions):
  return _pack_table.table_problem(specs, positions)


def test_each_table_problem_names_its_field():
  good = _specs(4)
  assert _bad(good, [0, 1, 2, 3]) is None
  assert _bad([], [])[0] == "packed[1]"
  assert _bad("specs", [0])[0] == "packed[1]"
  assert _bad([good[0], ("not", "a", "spec")], [0, 1])[0] == "packed[1][1]"
  sharded = good[1]._replace(sharding=ShardingLayout((1,), ("x",), (None,), (0,)))
  assert _bad([good[0], sharded], [0, 1])[0] == "packed[1][1]"
  torch_leaf = good[2]._replace(framework="torch")
  assert _bad([good[0], torch_leaf], [0, 1]) == ("packed[1][1]", "is not an unsharded host jax leaf", "['p2']")
  wrong_size = good[3]._replace(chunks=(ChunkSpec(good[3].shape, 1),))
  field, _, path = _bad([wrong_size], [0])
  assert field.startswith("packed[1][0].") and path == "['p3']"
  assert _bad(good, [0, 1, 2])[0] == "packed[2]"
  assert _bad(good, [0, 1, -2, 3])[0] == "packed[2][2]"
  assert _bad(good, [0, 1, 1, 3]) == ("packed[2]", "is not increasing", "")
  assert _bad(good, [0, 1, True, 3])[0] == "packed[2][2]"


def test_a_kept_table_is_checked_once_and_each_object_against_its_own_leaves():
  table = _pack_table.make(_specs(tag="[c]"), range(100))
  before = _pack_table.counts()["checked"]
  for _ in range(3):
    _meta(table).validate("obj")
  assert _pack_table.counts()["checked"] == before + 1
  # A position past the value's leaves, or a buffer too small, is this object's fault.
  meta = _meta(table, extra=0)  # 100 packed leaves and the buffer: positions up to 99 fit
  meta.validate("obj")
  late = _pack_table.make(_specs(tag="[c]"), range(1, 101))
  with pytest.raises(MetadataError, match="names position 100 of a value of 100 leaves"):
    _meta(late, extra=0).validate("obj")
  small = _meta(table)
  small.leaves[0] = small.leaves[0]._replace(shape=(8,), chunks=(ChunkSpec((8,), 8),))
  small.tensor_meta[0] = ((8,), np.dtype("uint8"))
  with pytest.raises(MetadataError, match=r"lays out \d+ bytes in a buffer of 8"):
    small.validate("obj")


def test_metadata_round_trips_through_an_owner_with_the_same_table():
  table = _pack_table.make(_specs(tag="[o]"), range(3, 103))
  meta = _meta(table, extra=3)
  at_owner = pickle.loads(pickle.dumps(meta))
  at_consumer = pickle.loads(pickle.dumps(at_owner))
  assert list(at_consumer.packed[1]) == list(table.specs)
  assert at_consumer.packed[1] is at_owner.packed[1]  # one process here: the form it decoded once
  at_consumer.validate("obj")
  assert [i for _, i in at_consumer.value_leaves()][:5] == [1, 2, 3, -1, -2]


def test_hand_built_metadata_with_lists_is_checked_in_full():
  specs = _specs(10)
  table = _pack_table.PackTable(specs, list(range(10)))  # not kept: as a hand-built object
  meta = _meta(table)
  meta.packed = (0, specs, list(range(10)))
  meta.validate("obj")
  meta.packed = (0, specs, list(range(9, -1, -1)))
  with pytest.raises(MetadataError, match="not increasing"):
    meta.validate("obj")
  got = pickle.loads(pickle.dumps(meta))
  with pytest.raises(MetadataError, match="not increasing"):
    got.validate("obj")


def test_tables_kept_are_bounded_and_a_forgotten_one_still_pickles():
  first = _pack_table.make(_specs(tag="[first]"), range(100))
  for i in range(_limits.PACK_TABLES_KEPT):
    _pack_table.make(_specs(tag=f"[{i}]"), range(100))
  assert _pack_table.of(first.specs) is None
  assert _pack_table.counts()["kept"] <= _limits.PACK_TABLES_KEPT
  got = pickle.loads(pickle.dumps(_meta(first)))
  assert list(got.packed[1]) == list(first.specs)
  got.validate("obj")
