"""Transport metadata: what an rdt_jax transport tells consumers about an object.

Metadata crosses processes (Ray pickles it into the object store and hands it
to the consumer), so it holds only plain Python values and the DLPack layer's
framework-neutral leaf specs (`rdt_jax._dlpack.LeafSpec`): never a jax, torch
or NIXL object.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ray.experimental.rdt.tensor_transport_manager import TensorTransportMetadata

from rdt_jax._dlpack import LeafSpec


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
