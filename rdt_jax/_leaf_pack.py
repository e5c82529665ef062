"""Many small jax leaves of one returned value travel as one host buffer.

A value of many leaves would otherwise cost per leaf everywhere: Ray's
pickler calls a reducer for each, Ray keeps each as a tensor of the RDT
object, the transport describes, exports, plans and rebuilds each. On the
producer, while Ray's serializer runs (`begin` ... `finish`, called by
`rdt_jax._ray.serialization`), each packable leaf (`_dlpack.describe_packable`:
an unsharded host `jax.Array` of at most `_limits.PACK_MAX_CHUNK` bytes) is
taken here instead of becoming a tensor of its own: the pickle holds
`(slot, k)`, the k-th leaf of the pack in Ray's tensor `slot`. At the end
every packed leaf is copied (`block_until_ready` once, then one memmove
each) into one pooled host buffer laid out as the consumer's receive buffer
(`_layout.host_layout`), which takes tensor `slot`'s place. Ray and the
transport then move one numpy array; the leaf table (each leaf's spec and
its position among all the value's leaves) travels in the transport's
metadata (`DlpackTransportMetadata.packed`), and the consumer rebuilds the
leaves from the received buffer (`rdt_jax.transports._packed`).

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
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rdt_jax import _dlpack, _handoff, _layout, _limits, _memory, _settings

__all__ = ["PACKED_PATH", "PackTable", "begin", "end", "finish", "take", "take_table"]

#: The path of a pack buffer's own leaf spec (no pytree path looks like it).
PACKED_PATH = "<packed leaves>"


@dataclass
class PackTable:
  """What a consumer needs to rebuild a pack's leaves from its buffer.

  Attributes:
    specs: each packed leaf's spec, in pack order (chunks as `host_layout`
      places them in the buffer).
    positions: each packed leaf's position among all the leaves of the
      value, in the order Ray's serializer met them (the order a positional
      target lists them in).
  """

  specs: list[_dlpack.LeafSpec]
  positions: list[int]


class _Packing(threading.local):
  """The pack of the serialization running on this thread, if any."""

  def __init__(self) -> None:
    self.decided = False  # whether this value packs was decided (at its first packable leaf)
    self.active = False
    self.slot = -1  # the pack buffer's index in Ray's tensors, once reserved
    self.leaves: list[_dlpack.DescribedLeaf] = []
    self.positions: list[int] = []


_packing = _Packing()


def begin() -> None:
  """Starts a serialization on this thread (nothing packed yet)."""
  _packing.decided, _packing.active, _packing.slot = False, False, -1
  _packing.leaves, _packing.positions = [], []


def end() -> None:
  """Ends what `begin` started; what was not finished is dropped."""
  begin()


def _decide() -> bool:
  """At the first packable leaf: whether this value packs (enough leaves)."""
  _packing.decided = True
  minimum = _settings.value("RDT_JAX_PACK_MIN_LEAVES")
  # The serializer's leaf paths hold every leaf of the value (computed once per structure).
  leaves = len(_handoff.serializing.paths or ())
  _packing.active = minimum > 0 and leaves >= minimum
  return _packing.active


def take(leaf: Any, path: str, tensors: list[Any]) -> tuple[int, int] | None:
  """Packs jax leaf `leaf` if it may be packed: returns `(slot, k)`, where the
  consumer finds it (the k-th leaf of the pack in Ray's tensor `slot`); None
  if it travels as a tensor of its own. `tensors` is Ray's list of the
  value's tensors so far; the first packed leaf reserves the pack's slot."""
  if not (_packing.active or (not _packing.decided and _decide())):
    return None
  described = _dlpack.describe_packable(leaf, path, _limits.PACK_MAX_CHUNK)
  if described is None:
    return None
  if _packing.slot < 0:
    tensors.append(None)  # the pack buffer's place, filled by `finish`
    _packing.slot = len(tensors) - 1
  k = len(_packing.leaves)
  _packing.leaves.append(described)
  # Leaves met before this one: k packed, and every tensor but the pack's slot.
  _packing.positions.append(k + len(tensors) - 1)
  return _packing.slot, k


def finish(tensors: list[Any]) -> None:
  """Copies this serialization's packed leaves into one pooled host buffer
  and puts it in the pack's slot of `tensors` (Ray's list, as serialized),
  described for the transport's extract under `PACKED_PATH`."""
  leaves = _packing.leaves
  if not leaves:
    return
  _dlpack.block_until_ready([d.arrays[0] for d in leaves])
  specs = [d.spec for d in leaves]
  offsets, total = _layout.host_layout(specs)
  buffer = _memory.host_pool.acquire(max(total, 1))
  _layout.copy_leaves_into(buffer, offsets, leaves)
  tensors[_packing.slot] = buffer
  _handoff.record_described(buffer, _dlpack.describe(buffer, PACKED_PATH))
  _remember(buffer, PackTable(specs, _packing.positions))
  _packing.leaves, _packing.positions = [], []


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
