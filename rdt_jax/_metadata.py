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
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from ray.experimental.rdt.tensor_transport_manager import TensorTransportMetadata

from rdt_jax._dlpack import ChunkSpec, LeafSpec

#: Integer lists at least this long pickle as packed int64 bytes.
_PACK_INTS_MIN = 16
_SEP = "\x00"


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
      chunks = leaf.chunks
      if leaf.sharding is not None or len(chunks) != 1 or chunks[0].shape != leaf.shape:
        return None
      key = (leaf.shape, leaf.dtype, leaf.framework, leaf.device, chunks[0].nbytes)
      i = table.get(key)
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
  """

  # Narrows Ray's annotation (torch or numpy pairs) to the numpy pairs rdt_jax writes.
  tensor_meta: list[tuple[tuple[int, ...], np.dtype]]  # type: ignore[assignment]
  tensor_device: str | None = None
  leaves: list[LeafSpec] = field(default_factory=list)
  inline: bytes | None = None
  origin: tuple[str, int, int, int] | None = None
  producer: str | None = None

  # Ray compares metadata by identity (its NIXL metadata does the same).
  __eq__ = object.__eq__
  __hash__ = object.__hash__

  @property
  def nbytes(self) -> int:
    """Payload bytes of every leaf together."""
    return sum(leaf.nbytes for leaf in self.leaves)

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
    for key, value in state.items():
      if type(value) is list and len(value) >= _PACK_INTS_MIN and all(type(v) is int for v in value):
        packed_ints = _Ints.encode(value)
        if packed_ints is not None:
          state[key] = packed_ints
    return state

  def __setstate__(self, state: dict[str, Any]) -> None:
    for key, value in state.items():
      if type(value) is _Ints:
        state[key] = value.decode()
    leaves = state.get("leaves")
    if type(leaves) is _Leaves:
      state["leaves"], tensor_meta = leaves.decode()
      if state.get("tensor_meta") is None:
        state["tensor_meta"] = tensor_meta
    self.__dict__.update(state)
