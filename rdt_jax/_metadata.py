"""Transport metadata: framework-neutral descriptions of what an RDT object holds.

Metadata crosses processes (Ray pickles it into the object store and hands it
to the consumer), so it holds only plain Python values and `np.dtype`s: never
a jax, torch or NIXL object. `ml_dtypes` makes bfloat16 and the float8 types
real `np.dtype`s, so every dtype we send has one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal, NamedTuple

import numpy as np
from ray.experimental.rdt.tensor_transport_manager import TensorTransportMetadata

Framework = Literal["jax", "torch", "numpy"]
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
  """

  mesh_shape: tuple[int, ...]
  axis_names: tuple[str, ...]
  spec: tuple
  device_chunks: tuple[int, ...]

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


@dataclass
class DlpackTransportMetadata(TensorTransportMetadata):
  """Metadata every rdt_jax transport produces for an RDT object.

  `tensor_meta` (Ray's field) holds `(shape tuple, np.dtype)` pairs, one per
  leaf, and `tensor_device` the device kind, as Ray expects. `leaves` carries
  the rest: source framework, chunks and sharding. Backends subclass this to
  add what they need to move the bytes (addresses, agent names, ...).
  """

  leaves: list[LeafSpec] = field(default_factory=list)

  # Ray compares metadata by identity (its NIXL metadata does the same).
  __eq__ = object.__eq__
  __hash__ = object.__hash__

  @property
  def nbytes(self) -> int:
    return sum(leaf.nbytes for leaf in self.leaves)
