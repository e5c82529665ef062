"""Framework-neutral descriptions of a leaf: what crosses between processes.

These hold only plain Python values and `np.dtype`s (never a jax, torch or
NIXL object), so transport metadata built from them pickles anywhere.
`ml_dtypes` makes bfloat16 and the float8 types real `np.dtype`s.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, NamedTuple

import numpy as np

#: The array types a leaf can be sent as. "cupy" is a source only: it is no
#: receive mode (see `rdt_jax._dlpack._cupy`).
Framework = Literal["jax", "torch", "numpy", "cupy"]
DeviceKind = Literal["cpu", "cuda"]

#: Receive modes accepted by :func:`rdt_jax.receive_as`.
RECEIVE_MODES: tuple[str, ...] = ("source", "jax", "torch", "numpy")


@dataclass(frozen=True)
class ShardingLayout:
  """How a sharded `jax.Array` was laid out on its producer.

  Attributes:
    mesh_shape: shape of the producer's device mesh.
    axis_names: the mesh's axis names.
    spec: the `PartitionSpec` entries as plain tuples (None, a name, or a tuple
      of names per array dimension).
    device_chunks: for each mesh position (in `mesh.devices.flat` order), the
      index of the chunk that device holds. Replicated shards share a chunk, so
      each distinct shard crosses the wire once.
    boxes: for each chunk, the part of the global shape it holds, one
      half-open `(start, stop)` per axis, as the producer's jax reported it
      (`addressable_shards[i].index`). Empty only for layouts built by hand
      (tests); the consumer then derives them from the mesh and spec.
  """

  mesh_shape: tuple[int, ...]
  axis_names: tuple[str, ...]
  spec: tuple
  device_chunks: tuple[int, ...]
  boxes: tuple[tuple[tuple[int, int], ...], ...] = ()

  @property
  def num_devices(self) -> int:
    return math.prod(self.mesh_shape)


class ChunkSpec(NamedTuple):
  """One contiguous buffer of a leaf: the whole leaf, or one distinct shard."""

  shape: tuple[int, ...]
  nbytes: int


class LeafSpec(NamedTuple):
  """What the consumer needs to rebuild one leaf.

  A named tuple rather than a dataclass: metadata of an object with many
  leaves crosses several processes, and tuples pickle several times faster.

  Attributes:
    path: the leaf's position in the value, as `jax.tree_util.keystr` prints it
      (best effort: "" when the producer could not tell).
    shape: the leaf's global shape.
    dtype: its numpy dtype (`ml_dtypes` types for bfloat16 and float8).
    framework: the array type it was sent as.
    device: the device kind it lives on ("cpu" or "cuda").
    chunks: the buffers that make up the leaf, one unless it is sharded.
    sharding: the producer's layout for a sharded `jax.Array`, else None.
  """

  path: str
  shape: tuple[int, ...]
  dtype: np.dtype
  framework: Framework
  device: DeviceKind
  chunks: tuple[ChunkSpec, ...]
  sharding: ShardingLayout | None = None

  @property
  def nbytes(self) -> int:
    return sum(c.nbytes for c in self.chunks)


class DescribedLeaf(NamedTuple):
  """A producer-side leaf: its spec and the raw buffers behind its chunks.

  Stays in the producing process (it holds the arrays); only `spec` crosses.
  A named tuple: one is made per leaf per object, and a tuple is made in a
  third of a frozen dataclass's time.

  Attributes:
    spec: the metadata sent to consumers.
    pointers: the address of each chunk's first byte.
    device_indices: the device index each chunk lives on (0 for host memory).
    arrays: the framework array behind each chunk (the leaf, or a shard).
  """

  spec: LeafSpec
  pointers: tuple[int, ...]
  device_indices: tuple[int, ...]
  arrays: tuple[object, ...] = ()

  @property
  def device(self) -> DeviceKind:
    return self.spec.device


def single_chunk(
    shape: tuple[int, ...],
    path: str,
    framework: Framework,
    dtype: np.dtype,
    device: DeviceKind,
    device_index: int,
    pointer: int,
    array: object,
) -> DescribedLeaf:
  """The description of an unsharded leaf: one chunk, the whole array."""
  chunks = _CHUNKS.get((shape, dtype))
  if chunks is None:
    chunks = (ChunkSpec(shape, math.prod(shape) * dtype.itemsize),)
    if len(_CHUNKS) < 4096:
      _CHUNKS[(shape, dtype)] = chunks
  new = tuple.__new__
  return new(DescribedLeaf, (
      new(LeafSpec, (path, shape, dtype, framework, device, chunks, None)),
      (pointer,), (device_index,), (array,),
  ))


#: One chunk tuple per (shape, dtype) seen, shared by the leaves that have it.
_CHUNKS: dict[tuple, tuple[ChunkSpec, ...]] = {}
