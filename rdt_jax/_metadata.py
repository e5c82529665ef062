"""Transport metadata: what an rdt_jax transport tells consumers about an object.

Metadata crosses processes (Ray pickles it into the object store and hands it
to the consumer), so it holds only plain Python values and the DLPack layer's
framework-neutral leaf specs (`rdt_jax._dlpack.LeafSpec`): never a jax, torch
or NIXL object.

Ray pickles an object's metadata at least twice on its way to a consumer
(producer to owner, owner to consumer), so its pickled form is per object,
not per leaf, where it can be: leaves that share a signature (shape, dtype,
framework, device) are sent as one table entry plus an index, the paths as
one string, and long integer lists (addresses) as packed bytes
(docs/performance.md has the measurements).
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from operator import itemgetter
from typing import Any

import numpy as np
from ray.experimental.rdt.tensor_transport_manager import TensorTransportMetadata

from rdt_jax import _limits, _pack_table
from rdt_jax._compact import CompactInts, CompactLeaves, Undecodable, length_of
from rdt_jax._dlpack import LeafSpec, UnsupportedLeafError, spec_problem
from rdt_jax._error_base import RdtJaxError
from rdt_jax._leaf_pack import PACKED_PATH

__all__ = ["DlpackTransportMetadata", "MetadataError", "check_int", "check_ints"]

_PATH = itemgetter(0)
_SIGNATURE = itemgetter(1, 2, 3, 4, 5, 6)
_SHAPE_DTYPE = itemgetter(1, 2)
_DEVICE = itemgetter(4)

# The compact forms under the names this module's tests and older code use.
_Leaves, _Ints, _Undecodable = CompactLeaves, CompactInts, Undecodable


class MetadataError(UnsupportedLeafError, RdtJaxError, ValueError):
  """Transport metadata that does not describe a readable object: a field
  of the wrong type, sizes or boxes that disagree, an address outside what
  the producer registered, a list cut short.

  A `ValueError` (and an `rdt_jax.RdtJaxError`). It is also an
  `UnsupportedLeafError`, for code written before the family existed; that
  parent is deprecated (`docs/errors.md`): the leaves were not the problem,
  the description of them was. Catch `ValueError` or this class.

  Raised on the consumer before any byte moves (`DlpackTransportMetadata
  .validate`, and the checks of each receive plan and read), so nothing is
  written anywhere. The metadata was corrupted between producer and consumer,
  or the two run different rdt_jax versions: run one version everywhere; if
  they match, report the message.

  Attributes:
    object_id: the object whose metadata it is.
    field: the offending field (`leaves[3].chunks[0].nbytes`, `addresses`).
    path: the leaf's pytree path when the field belongs to a leaf, else "".
  """

  _deprecated_parents = (UnsupportedLeafError,)

  def __init__(self, object_id: str, field: str, problem: str, path: str = ""):
    self.object_id, self.field, self.path = object_id, field, path
    leaf = f" (leaf {path})" if path else ""
    ValueError.__init__(
        self,
        f"Transport metadata of object {object_id} is invalid: field {field}{leaf} {problem}. "
        "Nothing was read. The metadata was corrupted on its way, or the producer and this "
        "process run different rdt_jax versions: run one version everywhere.",
    )

  def __reduce__(self) -> tuple[Any, ...]:
    return _restore_metadata_error, (self.object_id, self.field, self.path, self.args[0])


MetadataError.__module__ = "rdt_jax"  # public as rdt_jax.MetadataError


def _restore_metadata_error(object_id: str, field: str, path: str, message: str) -> MetadataError:
  err = MetadataError.__new__(MetadataError)
  ValueError.__init__(err, message)
  err.object_id, err.field, err.path = object_id, field, path
  return err


def check_int(obj_id: str, name: str, value: object, lo: int, hi: int) -> int:
  """`value`, if it is an int (not a bool) with `lo <= value < hi`.

  Raises:
    MetadataError: naming the object and field `name` otherwise.
  """
  if type(value) is not int or not lo <= value < hi:
    raise MetadataError(obj_id, name, f"is {value!r}, not an int in [{lo}, {hi})")
  return value


def check_ints(obj_id: str, name: str, values: object, count: int, lo: int, hi: int) -> list[int]:
  """`values`, if it is a list of `count` ints each in `[lo, hi)` (`lo` and
  `hi` within int64).

  Raises:
    MetadataError: naming the object, the field and the first offending entry.
  """
  if type(values) is not list or len(values) != count:
    raise MetadataError(obj_id, name, f"holds {length_of(values)} entries, not {count}")
  try:
    # C loops: every entry an int64 (array refuses anything else), none a bool.
    fine = not values or (
        bool not in set(map(type, values)) and lo <= min(array("q", values)) and max(values) < hi
    )
  except (TypeError, OverflowError):
    fine = False
  if not fine:
    for i, v in enumerate(values):
      if type(v) is not int or not lo <= v < hi:
        raise MetadataError(obj_id, f"{name}[{i}]", f"is {v!r}, not an int in [{lo}, {hi})")
  return values


@dataclass
class DlpackTransportMetadata(TensorTransportMetadata):
  """Metadata every rdt_jax transport produces for an RDT object.

  Built on the producer by `DlpackTransport.extract_tensor_transport_metadata`
  and handed by Ray to every consumer, where the backend's hooks read it. It
  holds only plain Python values and `LeafSpec`s, never a jax, torch or NIXL
  object. Backends subclass it (a dataclass) to add what they need to move
  the bytes (addresses, agent names, ...); their fields pickle as they are,
  lists of ints compactly.

  Attributes:
    tensor_meta: one `(shape tuple, numpy.dtype)` pair per leaf, in leaf
      order (Ray's field, with framework-neutral types).
    tensor_device: the device kind of every leaf, "cpu" or "cuda" (None for
      an object without leaves).
    leaves: one `LeafSpec` per leaf: pytree path, shape, dtype, source
      framework, device, chunks and sharding.
    inline: the object's bytes (every chunk, in leaf order) when the producer
      sent it in band (host leaves of at most `RDT_JAX_INLINE_MAX_BYTES` in
      all); the backend then exported nothing and moves nothing. None
      otherwise.
    origin: the producer process (host boot id, pid namespace, pid, start
      time), or None where it cannot be told: jax_nixl reads a producer's
      host memory directly on its host.
    producer: the Ray actor id (hex) of the producer, None for an object the
      driver stored: a consumer refuses the object once that actor is dead
      (`rdt_jax.transports._lifetime`).
    packed: None, or `(slot, specs, positions)` when many small jax leaves
      of the value travel as one host buffer, leaf `slot` (`rdt_jax._leaf_pack`):
      each packed leaf's spec, laid out in that buffer as `host_layout` places
      them, and its position among all the value's leaves. `specs` and
      `positions` are read-only sequences (tuples) that every object of one
      structure shares: a pack's table is made, pickled and checked once per
      structure in each process (`rdt_jax._pack_table`).
  """

  # Narrows Ray's annotation (torch or numpy pairs) to the numpy pairs rdt_jax writes.
  tensor_meta: list[tuple[tuple[int, ...], np.dtype]]  # type: ignore[assignment]
  tensor_device: str | None = None
  leaves: list[LeafSpec] = field(default_factory=list)
  inline: bytes | None = None
  origin: tuple[str, int, int, int] | None = None
  producer: str | None = None
  packed: tuple[int, Sequence[LeafSpec], Sequence[int]] | None = None

  # Ray compares metadata by identity (its NIXL metadata does the same).
  __eq__ = object.__eq__
  __hash__ = object.__hash__

  @property
  def nbytes(self) -> int:
    """Payload bytes of every leaf together."""
    return sum(leaf.nbytes for leaf in self.leaves)

  def value_leaves(self) -> list[tuple[LeafSpec, int]]:
    """Every leaf of the value in the order the producer's serializer met
    them (the order a positional target lists them in), each with where it
    travels: its index in `leaves`, or `-1 - k` for the k-th packed leaf.
    Without a pack: `leaves`, in order."""
    leaves = self.leaves
    if self.packed is None:
      return [(leaf, i) for i, leaf in enumerate(leaves)]
    slot, specs, positions = self.packed
    packed_at = dict(zip(positions, range(len(specs))))
    others = iter([i for i in range(len(leaves)) if i != slot])
    out = []
    for position in range(len(specs) + len(leaves) - 1):
      k = packed_at.get(position)
      if k is not None:
        out.append((specs[k], -1 - k))
      else:
        i = next(others)
        out.append((leaves[i], i))
    return out

  def __getstate__(self) -> dict[str, Any]:
    state = dict(self.__dict__)
    leaves = state["leaves"]
    packed = _Leaves.encode(leaves) if leaves else None
    if packed is not None:
      state["leaves"] = packed
      tensor_meta = state.get("tensor_meta")
      if tensor_meta is not None and len(tensor_meta) == len(leaves) and all(
          t[0] == leaf.shape and t[1] == leaf.dtype for t, leaf in zip(tensor_meta, leaves)
      ):
        state["tensor_meta"] = None  # rebuilt from the leaves
    pack = state.get("packed")
    if type(pack) is tuple and len(pack) == 3:
      state["packed"] = (pack[0], *_pack_table.wire(pack[1], pack[2]))  # encoded once per table
    for key, value in state.items():
      if type(value) is list and len(value) >= _limits.METADATA_PACK_INTS_MIN and all(type(v) is int for v in value):
        packed_ints = _Ints.encode(value)
        if packed_ints is not None:
          state[key] = packed_ints
    return state

  def __setstate__(self, state: dict[str, Any]) -> None:
    for key, value in state.items():
      if type(value) is _Ints:
        try:
          state[key] = value.decode()
        except (ValueError, TypeError) as e:
          state[key] = _Undecodable(str(e))
    leaves = state.get("leaves")
    if type(leaves) is _Leaves:
      try:
        state["leaves"], tensor_meta = leaves.decode()
      except (ValueError, TypeError, IndexError) as e:
        state["leaves"], tensor_meta = _Undecodable(str(e)), []
      if state.get("tensor_meta") is None:
        state["tensor_meta"] = tensor_meta
    pack = state.get("packed")
    if type(pack) is tuple and len(pack) == 3:
      state["packed"] = (pack[0], *_pack_table.received(pack[1], pack[2]))  # decoded once per table
    self.__dict__.update(state)

  def validate(self, obj_id: str) -> None:
    """Consumer: refuses metadata that does not describe a readable object,
    before any memory is taken or any byte moves.

    Checks every field this class defines: one consistent `LeafSpec` per leaf
    (`rdt_jax._dlpack.spec_problem`: shapes, dtype, chunk sizes, shard boxes),
    `tensor_meta` and `tensor_device` agreeing with the leaves, in-band bytes
    of exactly the leaves' size, a well-formed origin and producer. Backends extend it for
    their own fields (addresses, ...). Leaves that share a signature are
    checked once.

    Raises:
      MetadataError: naming the object, the field and, for a leaf's field,
        the leaf.
    """
    leaves = self.leaves
    if type(leaves) is not list:
      raise MetadataError(obj_id, "leaves", f"is {leaves!r}, not a list of leaf specs")
    # The common case in C loops: leaf specs with str paths, few distinct signatures.
    try:
      if set(map(type, leaves)) - {LeafSpec} or set(map(type, map(_PATH, leaves))) - {str}:
        raise TypeError
      signatures = set(map(_SIGNATURE, leaves))
    except (TypeError, IndexError):  # an unhashable field, or not a LeafSpec: found below
      signatures = None
    if signatures is None:
      for i, leaf in enumerate(leaves):
        self._check_leaf(obj_id, i, leaf)
    elif len(signatures) == 1:
      self._check_leaf(obj_id, 0, leaves[0])
    elif signatures:
      first: dict[Any, int] = {}
      for i, sig in enumerate(map(_SIGNATURE, leaves)):
        first.setdefault(sig, i)
      for i in first.values():
        self._check_leaf(obj_id, i, leaves[i])
    tensor_meta = self.tensor_meta
    if type(tensor_meta) is not list or len(tensor_meta) != len(leaves):
      raise MetadataError(obj_id, "tensor_meta", f"holds {length_of(tensor_meta)} entries for {len(leaves)} leaves")
    if list(map(_SHAPE_DTYPE, leaves)) != tensor_meta:
      for i, (pair, leaf) in enumerate(zip(tensor_meta, leaves)):
        if type(pair) is not tuple or len(pair) != 2 or pair[0] != leaf.shape or pair[1] != leaf.dtype:
          raise MetadataError(
              obj_id, f"tensor_meta[{i}]", f"is {pair!r}, not the leaf's (shape, dtype)", leaf.path
          )
    kinds = sorted(set(map(_DEVICE, leaves)))
    if kinds != ([self.tensor_device] if leaves else []) or (not leaves and self.tensor_device is not None):
      raise MetadataError(obj_id, "tensor_device", f"is {self.tensor_device!r} for leaves on {kinds}")
    inline = self.inline
    if inline is not None:
      want = sum(leaf.nbytes for leaf in leaves)
      if type(inline) is not bytes or len(inline) != want:
        raise MetadataError(obj_id, "inline", f"holds {length_of(inline)} bytes but the leaves describe {want}")
    self._check_origin(obj_id)
    if self.packed is not None:
      self._check_packed(obj_id)
    producer = self.producer
    if producer is not None and not (type(producer) is str and _is_hex(producer)):
      raise MetadataError(obj_id, "producer", f"is {producer!r}, not a Ray actor id in hex")

  def _check_packed(self, obj_id: str) -> None:
    """The pack's buffer leaf and its table: the table itself once per
    table (`PackTable.problem`: each signature's spec, the positions
    increasing), and for this object that the positions fall among its
    leaves and the buffer holds what the table lays out."""
    pack = self.packed
    if type(pack) is not tuple or len(pack) != 3:
      raise MetadataError(obj_id, "packed", f"is {pack!r:.200}, not (slot, specs, positions)")
    slot, specs, positions = pack
    leaves = self.leaves
    if type(slot) is not int or not 0 <= slot < len(leaves):
      raise MetadataError(obj_id, "packed[0]", f"is {slot!r}, not a leaf index below {len(leaves)}")
    buffer = leaves[slot]
    if buffer.path != PACKED_PATH or buffer.framework != "numpy" or buffer.device != "cpu" or len(buffer.shape) != 1 \
        or buffer.dtype != np.uint8:
      raise MetadataError(obj_id, f"leaves[{slot}]", "is not a pack buffer (1-D uint8 numpy in host memory)")
    table = _pack_table.of(specs)
    if table is None or table.positions is not positions:
      table = _pack_table.PackTable(specs, positions)  # not one this process keeps: checked now
    problem = table.problem()
    if problem is not None:
      raise MetadataError(obj_id, *problem)
    total = len(specs) + len(leaves) - 1
    if positions[-1] >= total:
      raise MetadataError(obj_id, "packed[2]", f"names position {positions[-1]} of a value of {total} leaves")
    need = table.layout()[2]
    if need > buffer.nbytes:
      raise MetadataError(obj_id, "packed[1]", f"lays out {need} bytes in a buffer of {buffer.nbytes}")

  @staticmethod
  def _check_leaf(obj_id: str, i: int, leaf: Any) -> None:
    if type(leaf) is not LeafSpec or tuple.__len__(leaf) != 7:
      raise MetadataError(obj_id, f"leaves[{i}]", f"is a {type(leaf).__name__}, not a LeafSpec")
    problem = spec_problem(leaf)
    if problem is not None:
      path = leaf.path if isinstance(leaf.path, str) else ""
      raise MetadataError(obj_id, f"leaves[{i}].{problem[0]}", problem[1], path)

  def _check_origin(self, obj_id: str) -> None:
    origin = self.origin
    if origin is not None and not (
        type(origin) is tuple and len(origin) == 4 and isinstance(origin[0], str)
        and all(type(v) is int and v >= 0 for v in origin[1:])
    ):
      raise MetadataError(obj_id, "origin", f"is {origin!r}, not (boot id, pid namespace, pid, start time)")


def _is_hex(text: str) -> bool:
  """True if `text` is a non-empty even-length string of hex digits."""
  try:
    return bool(text) and bytes.fromhex(text).hex() == text.lower()
  except ValueError:
    return False
