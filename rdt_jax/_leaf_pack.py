"""Many small jax leaves of one returned value travel as one host buffer.

A value of many leaves would otherwise cost per leaf everywhere: Ray's
pickler calls a reducer for each, Ray keeps each as a tensor of the RDT
object, the transport describes, exports, plans and rebuilds each. On the
producer, while Ray's serializer runs (`begin` ... `finish`, called by
`rdt_jax._ray.serialization`), each packable leaf (`_dlpack.packable`:
an unsharded host `jax.Array` of at most `_limits.PACK_MAX_CHUNK` bytes) is
taken here instead of becoming a tensor of its own: the pickle names the
k-th leaf of the pack in Ray's tensor `slot` (`rdt_jax._ray.serialization`).
At the end every packed leaf is copied (`block_until_ready` once, then one
memmove each) into one pooled host buffer laid out as the consumer's receive
buffer (`_layout.host_layout`), which takes tensor `slot`'s place. Ray and
the transport then move one numpy array; the leaf table (each leaf's spec
and its position among all the value's leaves) travels in the transport's
metadata (`DlpackTransportMetadata.packed`), and the consumer rebuilds the
leaves from the received buffer (`rdt_jax.transports._packed`).

The table is made once per pytree structure (`rdt_jax._pack_table`): the
structure's last value left what it packed (`_Structure`: each packed leaf's
place among `tree_flatten`'s leaves, its kind, its position), and while the
leaves a serialization packs are the arrays at those places, of those
kinds, met in that order, it gets the same table; at the first leaf that is
not, the table is made anew from the leaves (and kept for the next value).

Only jax leaves are packed: a `jax.Array` is immutable, so a copy taken at
return is what a consumer would read anyway. NumPy and torch leaves, which
a producer may change in place after returning them (and a consumer then
sees the change), keep their own tensors; so do device, sharded and large
leaves, and typed keys.

Values with fewer leaves than the setting `RDT_JAX_PACK_MIN_LEAVES` (64 by
default; 0 turns packing off) are sent as before.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, NamedTuple

from rdt_jax import _dlpack, _handoff, _layout, _limits, _memory, _pack_table, _settings
from rdt_jax._pack_table import PackTable

__all__ = ["PACKED_PATH", "begin", "end", "finish", "structures_kept", "take", "take_table"]

#: The path of a pack buffer's own leaf spec (no pytree path looks like it).
PACKED_PATH = "<packed leaves>"


class _Structure(NamedTuple):
  """What the last value of one pytree structure packed, for the next one.

  Attributes:
    order: per packed leaf (pack order), its index among `tree_flatten`'s leaves.
    kinds: per packed leaf, its `PackKind` (the one `_dlpack.packable` keeps).
    positions: per packed leaf, its position among the value's leaves.
    table: the pack's table (`rdt_jax._pack_table`).
  """

  order: list[int]
  kinds: list[_dlpack.PackKind]
  positions: list[int]
  table: PackTable


#: treedef -> what its last value packed; most recently used last, at most `PATHS_KEPT`.
_structures: OrderedDict[Any, _Structure] = OrderedDict()
_structures_lock = threading.Lock()


class _Pack:
  """The pack of one value being serialized (on one thread)."""

  __slots__ = ("addresses", "expect", "flat", "kinds", "leaves", "positions", "slot", "treedef")

  def __init__(self, flat: list[Any], treedef: Any, expect: _Structure | None):
    self.slot = -1  # the pack buffer's index in `tensors`, once reserved
    self.leaves: list[Any] = []  # the packed jax arrays, in pack order
    self.kinds: list[_dlpack.PackKind] = []
    self.addresses: list[int] = []
    self.positions: list[int] = []
    self.flat = flat  # the value's leaves in tree_flatten order
    self.treedef = treedef
    # What the structure's last value packed, while every leaf packed so far
    # is this value's array at the place that value's was, of the same kind
    # (None once one is not).
    self.expect = expect


#: `_Packing.pack` before the value's first jax leaf decided whether it packs.
_UNDECIDED: Any = object()


class _Packing(threading.local):
  """The serialization running on this thread: `_UNDECIDED`, its `_Pack`, or
  None (no serialization, or a value that does not pack)."""

  pack: Any = None


_packing = _Packing()


def begin() -> None:
  """Starts a serialization on this thread (nothing packed yet)."""
  _packing.pack = _UNDECIDED


def end() -> None:
  """Ends what `begin` started; what was not finished is dropped."""
  _packing.pack = None


def _decide() -> _Pack | None:
  """At the value's first jax leaf: its `_Pack` if it packs (enough leaves),
  knowing what its structure packed last time; else None."""
  _packing.pack = None
  minimum = _settings.value("RDT_JAX_PACK_MIN_LEAVES")
  if minimum <= 0:
    return None
  found = _handoff.flattened()
  if found is None or len(found[0]) < minimum:
    return None
  flat, treedef = found
  with _structures_lock:
    expect = _structures.get(treedef)
  _packing.pack = pack = _Pack(flat, treedef, expect)
  return pack


def take(leaf: Any, tensors: list[Any]) -> tuple[int, int] | None:
  """Packs jax leaf `leaf` if it may be packed: returns `(slot, k)`, where the
  consumer finds it (the k-th leaf of the pack in Ray's tensor `slot`); None
  if it travels as a tensor of its own. `tensors` is Ray's list of the
  value's tensors so far; the first packed leaf reserves the pack's slot."""
  p = _packing.pack
  if p is None:
    return None
  if p is _UNDECIDED:
    p = _decide()
    if p is None:
      return None
  found = _dlpack.packable(leaf, _limits.PACK_MAX_CHUNK)
  if found is None:
    return None
  if p.slot < 0:
    tensors.append(None)  # the pack buffer's place, filled by `finish`
    p.slot = len(tensors) - 1
  leaves = p.leaves
  k = len(leaves)
  kind = found[0]
  expect = p.expect
  if expect is not None and not (
      k < len(expect.order) and expect.kinds[k] is kind and p.flat[expect.order[k]] is leaf
  ):
    p.expect = None  # not where the structure's last value had its k-th packed leaf: a table of its own
  leaves.append(leaf)
  p.kinds.append(kind)
  p.addresses.append(found[1])
  # Leaves met before this one: k packed, and every tensor but the pack's slot.
  p.positions.append(k + len(tensors) - 1)
  return p.slot, k


def finish(tensors: list[Any]) -> None:
  """Copies this serialization's packed leaves into one pooled host buffer
  and puts it in the pack's slot of `tensors` (Ray's list, as serialized),
  described for the transport's extract under `PACKED_PATH`."""
  p = _packing.pack
  if p is None or p is _UNDECIDED or not p.leaves:
    return
  table = _table(p)
  starts, sizes, need = table.layout()
  _dlpack.block_until_ready(p.leaves)
  buffer = _memory.host_pool.acquire(max(need, 1))
  _layout.copy_packed_into(buffer, p.addresses, starts, sizes)
  tensors[p.slot] = buffer
  _handoff.record_described(buffer, _dlpack.describe(buffer, PACKED_PATH))
  _remember(buffer, table)
  end()


def _table(p: _Pack) -> PackTable:
  """The pack table of `p`: the one its structure's last value made, if
  the leaves, their kinds and their positions are those it packed; else
  made now (and kept for the structure's next value)."""
  expect = p.expect
  if expect is not None and len(expect.order) == len(p.leaves) and expect.positions == p.positions:
    with _structures_lock:
      if p.treedef in _structures:
        _structures.move_to_end(p.treedef)
    _pack_table.keep(expect.table)
    return expect.table
  paths = [_handoff.leaf_path(leaf) for leaf in p.leaves]
  table = _pack_table.make([_dlpack.packed_spec(path, kind) for path, kind in zip(paths, p.kinds)], p.positions)
  index: dict[int, int] = {}
  for i, x in enumerate(p.flat):
    index.setdefault(id(x), i)
  order = [index.get(id(leaf), -1) for leaf in p.leaves]
  # A packed leaf that is no leaf of the pytree (a typed key's data, made per
  # serialization; an array inside an object jax does not flatten) can never
  # be met again: such a structure's tables are made anew every time.
  if -1 not in order:
    structure = _Structure(order, list(p.kinds), list(p.positions), table)
    with _structures_lock:
      _structures[p.treedef] = structure
      _structures.move_to_end(p.treedef)
      while len(_structures) > _limits.PATHS_KEPT:
        _structures.popitem(last=False)
  return table


def structures_kept() -> int:
  """How many structures' packs are kept for their next value (at most `_limits.PATHS_KEPT`)."""
  with _structures_lock:
    return len(_structures)


# --------------------------------------------------------------------------
# Pack tables waiting for the transport's extract, by buffer.

_tables_lock = threading.Lock()
#: id(buffer) -> (weak reference to the buffer, its table, when it was made).
_tables: dict[int, tuple[Callable[[], Any], PackTable, float]] = {}


def _remember(buffer: Any, table: PackTable) -> None:
  now = time.monotonic()
  with _tables_lock:
    for key, (ref, _, made) in list(_tables.items()):
      if ref() is None or now - made >= _limits.HANDOFF_TTL_S:
        del _tables[key]
    while len(_tables) >= _limits.HANDOFF_MAX:
      del _tables[next(iter(_tables))]
    _tables[id(buffer)] = (weakref.ref(buffer), table, now)


def take_table(x: Any) -> PackTable | None:
  """The table of pack buffer `x`, removed (taken once, by the extract of the
  object it belongs to); None if `x` is not a pack buffer."""
  if id(x) not in _tables:  # most leaves: no lock taken
    return None
  with _tables_lock:
    entry = _tables.get(id(x))
    if entry is None or entry[0]() is not x:
      return None
    del _tables[id(x)]
  return entry[1]
