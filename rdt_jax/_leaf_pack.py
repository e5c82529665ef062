"""Many small jax leaves of one returned value travel as one host buffer.

A value of many leaves would otherwise cost per leaf everywhere: Ray's
pickler calls a reducer for each, Ray keeps each as a tensor of the RDT
object, the transport describes, exports, plans and rebuilds each. On the
producer, while Ray's serializer runs (`begin` ... `finish`, called by
`rdt_jax._ray.serialization`), each packable leaf (`_dlpack.packable`:
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
    self.decided = False  # whether this value packs was decided (at its first jax leaf)
    self.active = False
    self.slot = -1  # the pack buffer's index in Ray's tensors, once reserved
    self.leaves: list[Any] = []  # the packed jax arrays, in pack order
    self.kinds: list[_dlpack.PackKind] = []
    self.addresses: list[int] = []
    self.positions: list[int] = []
    self.nbytes = 0  # the pack buffer's size so far (each leaf aligned, as `host_layout`)


_packing = _Packing()


def begin() -> None:
  """Starts a serialization on this thread (nothing packed yet)."""
  _packing.__init__()  # type: ignore[misc]


def end() -> None:
  """Ends what `begin` started; what was not finished is dropped."""
  _packing.__init__()  # type: ignore[misc]


def _decide(leaf: Any) -> bool:
  """At the value's first jax leaf: whether this value packs (enough leaves)."""
  _packing.decided = True
  minimum = _settings.value("RDT_JAX_PACK_MIN_LEAVES")
  if minimum <= 0:
    return False
  _handoff.leaf_path(leaf)  # the value's leaf paths, computed once per structure
  _packing.active = len(_handoff.serializing.paths or ()) >= minimum
  return _packing.active


def take(leaf: Any, tensors: list[Any]) -> tuple[int, int] | None:
  """Packs jax leaf `leaf` if it may be packed: returns `(slot, k)`, where the
  consumer finds it (the k-th leaf of the pack in Ray's tensor `slot`); None
  if it travels as a tensor of its own. `tensors` is Ray's list of the
  value's tensors so far; the first packed leaf reserves the pack's slot."""
  p = _packing
  if not (p.active or (not p.decided and _decide(leaf))):
    return None
  found = _dlpack.packable(leaf, _limits.PACK_MAX_CHUNK)
  if found is None:
    return None
  if p.slot < 0:
    tensors.append(None)  # the pack buffer's place, filled by `finish`
    p.slot = len(tensors) - 1
  k = len(p.leaves)
  p.leaves.append(leaf)
  p.kinds.append(found[0])
  p.addresses.append(found[1])
  p.nbytes += _memory.aligned(found[0].chunks[0].nbytes)
  # Leaves met before this one: k packed, and every tensor but the pack's slot.
  p.positions.append(k + len(tensors) - 1)
  return p.slot, k


def finish(tensors: list[Any]) -> None:
  """Copies this serialization's packed leaves into one pooled host buffer
  and puts it in the pack's slot of `tensors` (Ray's list, as serialized),
  described for the transport's extract under `PACKED_PATH`."""
  p = _packing
  if not p.leaves:
    return
  _dlpack.block_until_ready(p.leaves)
  buffer = _memory.host_pool.acquire(max(p.nbytes, 1))
  _layout.copy_packed_into(buffer, p.addresses, p.kinds)
  paths = _handoff.serializing.paths or {}
  specs = [
      _dlpack.packed_spec(paths.get(id(leaf), ""), kind) for leaf, kind in zip(p.leaves, p.kinds)
  ]
  tensors[p.slot] = buffer
  _handoff.record_described(buffer, _dlpack.describe(buffer, PACKED_PATH))
  _remember(buffer, PackTable(specs, p.positions))
  end()


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
