"""Compact pickled forms of what transport metadata carries per leaf.

Ray pickles an object's metadata at least twice on its way to a consumer
(producer to owner, owner to consumer), so what it holds per leaf is pickled
as one record rather than one object per leaf: leaves that share a signature
(shape, dtype, framework, device) as one table entry plus an index, their
paths as one string, long integer lists as packed bytes. Unpickling never
raises: a form that cannot be decoded becomes an `Undecodable`, which the
metadata's checks refuse naming the object (`rdt_jax._metadata`).

Imports no Ray, so a pack's leaf table (`rdt_jax._pack_table`) can use the
same forms.
"""

from __future__ import annotations

from array import array
from typing import Any

from rdt_jax._dlpack import ChunkSpec, LeafSpec

__all__ = ["SEP", "CompactInts", "CompactLeaves", "Undecodable", "length_of"]

#: What joins the paths of a `CompactLeaves` (no `keystr` path holds it).
SEP = "\x00"


def length_of(x: object) -> str:
  """How many entries `x`, a field from another process, holds, for an error
  message ("no (int)" for a value without a length)."""
  try:
    return str(len(x))  # type: ignore[arg-type]
  except TypeError:
    return f"no ({type(x).__name__})"


class Undecodable:
  """A field whose compact form could not be decoded: the metadata's checks
  refuse it (unpickling cannot raise an error naming the object)."""

  def __init__(self, problem: str):
    self.problem = problem

  def __repr__(self) -> str:
    return f"<undecodable: {self.problem}>"


class CompactLeaves:
  """The pickled form of a list of unsharded, single-chunk `LeafSpec`s.

  Attributes:
    paths: every leaf's path, joined by NUL.
    signatures: the distinct (shape, dtype, framework, device, nbytes) of the leaves.
    index: per leaf, its signature's position (packed unsigned ints).
  """

  __slots__ = ("index", "paths", "signatures")

  def __init__(self, paths: str, signatures: list[tuple], index: bytes):
    self.paths, self.signatures, self.index = paths, signatures, index

  def __reduce__(self) -> tuple[Any, ...]:
    return CompactLeaves, (self.paths, self.signatures, self.index)

  @staticmethod
  def encode(leaves: list[LeafSpec] | tuple[LeafSpec, ...]) -> CompactLeaves | None:
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
    paths = SEP.join([leaf.path for leaf in leaves])
    if paths.count(SEP) != max(0, len(leaves) - 1):
      return None
    return CompactLeaves(paths, list(table), index.tobytes())

  def decode(self) -> tuple[list[LeafSpec], list[tuple]]:
    """The leaf specs, equal to those encoded, and their `tensor_meta`
    entries (one `(shape, dtype)` tuple shared per signature).

    Raises:
      ValueError, TypeError, IndexError: for a form that was cut short or garbled.
    """
    index = array("I")
    index.frombytes(self.index)
    if not index:
      return [], []
    specs = [
        (shape, dtype, framework, device, (ChunkSpec(shape, nbytes),), None)
        for shape, dtype, framework, device, nbytes in self.signatures
    ]
    pairs = [(s[0], s[1]) for s in self.signatures]
    paths = self.paths.split(SEP)
    if len(paths) != len(index):
      raise ValueError(f"{len(paths)} paths for {len(index)} leaves")
    new = tuple.__new__
    leaves = [new(LeafSpec, (path, *specs[i])) for path, i in zip(paths, index)]
    return leaves, [pairs[i] for i in index]


class CompactInts:
  """A long list of ints, pickled as packed bytes of the narrowest signed
  type that holds them (one byte each for device ids and region ids)."""

  __slots__ = ("data", "typecode")

  def __init__(self, typecode: str, data: bytes):
    self.typecode, self.data = typecode, data

  def __reduce__(self) -> tuple[Any, ...]:
    return CompactInts, (self.typecode, self.data)

  @staticmethod
  def encode(values: list[int] | tuple[int, ...]) -> CompactInts | None:
    """The packed form of `values`, or None if some value exceeds int64."""
    lo, hi = min(values), max(values)
    for typecode in ("b", "h", "i", "q"):
      bits = 8 * array(typecode).itemsize - 1
      if -(1 << bits) <= lo and hi < (1 << bits):
        return CompactInts(typecode, array(typecode, values).tobytes())
    return None

  def decode(self) -> list[int]:
    """The ints, equal to those encoded.

    Raises:
      ValueError, TypeError: for a form that was cut short or garbled.
    """
    values = array(self.typecode)
    values.frombytes(self.data)
    return values.tolist()
