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

import itertools
from array import array
from dataclasses import dataclass, field
from operator import itemgetter
from typing import Any

import numpy as np
from ray.experimental.rdt.tensor_transport_manager import TensorTransportMetadata

from rdt_jax import _layout, _limits
from rdt_jax._dlpack import ChunkSpec, LeafSpec, UnsupportedLeafError, spec_problem
from rdt_jax._error_base import RdtJaxError
from rdt_jax._leaf_pack import PACKED_PATH

__all__ = ["DlpackTransportMetadata", "MetadataError", "check_int", "check_ints"]

_PATH = itemgetter(0)
_SIGNATURE = itemgetter(1, 2, 3, 4, 5, 6)
_SHAPE_DTYPE = itemgetter(1, 2)
_DEVICE = itemgetter(4)

_SEP = "\x00"


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
    raise MetadataError(obj_id, name, f"holds {_length(values)} entries, not {count}")
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


def _length(x: object) -> str:
  try:
    return str(len(x))  # type: ignore[arg-type]
  except TypeError:
    return f"no ({type(x).__name__})"


class _Undecodable:
  """A field whose packed form could not be decoded: `validate` refuses it
  (unpickling cannot raise an error naming the object)."""

  def __init__(self, problem: str):
    self.problem = problem

  def __repr__(self) -> str:
    return f"<undecodable: {self.problem}>"


class _Leaves:
  """The pickled form of a list of unsharded, single-chunk `LeafSpec`s.

  Attributes:
    paths: every leaf's path, joined by NUL.
    signatures: the distinct (shape, dtype, framework, device) of the leaves.
    index: per leaf, its signature's position (packed unsigned ints).
  """

  __slots__ = ("index", "paths", "signatures")

  def __init__(self, paths: str, signatures: list[tuple], index: bytes):
    self.paths, self.signatures, self.index = paths, signatures, index

  def __reduce__(self) -> tuple[Any, ...]:
    return _Leaves, (self.paths, self.signatures, self.index)

  @staticmethod
  def encode(leaves: list[LeafSpec]) -> _Leaves | None:
    """The compact form of `leaves`, or None if some leaf needs its full spec
    (sharded, several chunks, or a path holding NUL)."""
    table: dict[tuple, int] = {}
    index = array("I")
    for leaf in leaves:
      if type(leaf) is not LeafSpec:
        return None  # pickled as it is (and refused on arrival)
      chunks = leaf.chunks
      if (
          leaf.sharding is not None or type(chunks) is not tuple or len(chunks) != 1
          or type(chunks[0]) is not ChunkSpec or chunks[0].shape != leaf.shape
          or type(leaf.path) is not str
      ):
        return None
      key = (leaf.shape, leaf.dtype, leaf.framework, leaf.device, chunks[0].nbytes)
      try:
        i = table.get(key)
      except TypeError:  # an unhashable field
        return None
      if i is None:
        i = table[key] = len(table)
      index.append(i)
    paths = _SEP.join([leaf.path for leaf in leaves])
    if paths.count(_SEP) != max(0, len(leaves) - 1):
      return None
    return _Leaves(paths, list(table), index.tobytes())

  def decode(self) -> tuple[list[LeafSpec], list[tuple]]:
    """The leaf specs, equal to those encoded, and their `tensor_meta`
    entries (one `(shape, dtype)` tuple shared per signature)."""
    index = array("I")
    index.frombytes(self.index)
    if not index:
      return [], []
    specs = [
        (shape, dtype, framework, device, (ChunkSpec(shape, nbytes),), None)
        for shape, dtype, framework, device, nbytes in self.signatures
    ]
    pairs = [(s[0], s[1]) for s in self.signatures]
    new = tuple.__new__
    leaves = [new(LeafSpec, (path, *specs[i])) for path, i in zip(self.paths.split(_SEP), index)]
    return leaves, [pairs[i] for i in index]


class _Ints:
  """A long list of ints, pickled as packed bytes of the narrowest signed
  type that holds them (one byte each for device ids and region ids)."""

  __slots__ = ("data", "typecode")

  def __init__(self, typecode: str, data: bytes):
    self.typecode, self.data = typecode, data

  def __reduce__(self) -> tuple[Any, ...]:
    return _Ints, (self.typecode, self.data)

  @staticmethod
  def encode(values: list[int]) -> _Ints | None:
    """The packed form of `values`, or None if some value exceeds int64."""
    lo, hi = min(values), max(values)
    for typecode in ("b", "h", "i", "q"):
      bits = 8 * array(typecode).itemsize - 1
      if -(1 << bits) <= lo and hi < (1 << bits):
        return _Ints(typecode, array(typecode, values).tobytes())
    return None

  def decode(self) -> list[int]:
    values = array(self.typecode)
    values.frombytes(self.data)
    return values.tolist()


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
      them, and its position among all the value's leaves.
  """

  # Narrows Ray's annotation (torch or numpy pairs) to the numpy pairs rdt_jax writes.
  tensor_meta: list[tuple[tuple[int, ...], np.dtype]]  # type: ignore[assignment]
  tensor_device: str | None = None
  leaves: list[LeafSpec] = field(default_factory=list)
  inline: bytes | None = None
  origin: tuple[str, int, int, int] | None = None
  producer: str | None = None
  packed: tuple[int, list[LeafSpec], list[int]] | None = None

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
      specs, positions = pack[1], pack[2]
      state["packed"] = (
          pack[0],
          (_Leaves.encode(specs) if type(specs) is list and specs else None) or specs,
          (_Ints.encode(positions) if type(positions) is list and positions else None) or positions,
      )
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
      specs, positions = pack[1], pack[2]
      try:
        if type(specs) is _Leaves:
          specs = specs.decode()[0]
        if type(positions) is _Ints:
          positions = positions.decode()
      except (ValueError, TypeError, IndexError) as e:
        specs = _Undecodable(str(e))
      state["packed"] = (pack[0], specs, positions)
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
      raise MetadataError(obj_id, "tensor_meta", f"holds {_length(tensor_meta)} entries for {len(leaves)} leaves")
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
        raise MetadataError(obj_id, "inline", f"holds {_length(inline)} bytes but the leaves describe {want}")
    self._check_origin(obj_id)
    if self.packed is not None:
      self._check_packed(obj_id)
    producer = self.producer
    if producer is not None and not (type(producer) is str and _is_hex(producer)):
      raise MetadataError(obj_id, "producer", f"is {producer!r}, not a Ray actor id in hex")

  def _check_packed(self, obj_id: str) -> None:
    """The pack's buffer leaf, its leaves' specs (each signature once) and
    their positions (increasing, within the value's leaves)."""
    pack = self.packed
    if type(pack) is not tuple or len(pack) != 3:
      raise MetadataError(obj_id, "packed", f"is {pack!r}, not (slot, specs, positions)")
    slot, specs, positions = pack
    leaves = self.leaves
    if type(slot) is not int or not 0 <= slot < len(leaves):
      raise MetadataError(obj_id, "packed[0]", f"is {slot!r}, not a leaf index below {len(leaves)}")
    buffer = leaves[slot]
    if buffer.path != PACKED_PATH or buffer.framework != "numpy" or buffer.device != "cpu" or len(buffer.shape) != 1 \
        or buffer.dtype != np.uint8:
      raise MetadataError(obj_id, f"leaves[{slot}]", "is not a pack buffer (1-D uint8 numpy in host memory)")
    if type(specs) is not list or not specs:
      raise MetadataError(obj_id, "packed[1]", f"is {specs!r}, not a list of leaf specs")
    first: dict[Any, int] = {}
    for i, spec in enumerate(specs):
      if type(spec) is not LeafSpec or tuple.__len__(spec) != 7 or type(spec.path) is not str:
        raise MetadataError(obj_id, f"packed[1][{i}]", f"is a {type(spec).__name__}, not a LeafSpec")
      try:
        first.setdefault(_SIGNATURE(spec), i)
      except TypeError:
        raise MetadataError(obj_id, f"packed[1][{i}]", "has an unhashable field", spec.path) from None
    for i in first.values():
      spec = specs[i]
      problem = spec_problem(spec)
      if problem is not None:
        raise MetadataError(obj_id, f"packed[1][{i}].{problem[0]}", problem[1], spec.path)
      if spec.framework != "jax" or spec.device != "cpu" or spec.sharding is not None or len(spec.chunks) != 1:
        raise MetadataError(obj_id, f"packed[1][{i}]", "is not an unsharded host jax leaf", spec.path)
    total = len(specs) + len(leaves) - 1
    check_ints(obj_id, "packed[2]", positions, len(specs), 0, total)
    if any(a >= b for a, b in itertools.pairwise(positions)):
      raise MetadataError(obj_id, "packed[2]", "is not increasing")
    _, need = _layout.host_layout(specs)
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
