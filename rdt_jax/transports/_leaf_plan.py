"""One leaf's receive plan (`ReceivePlan` holds one per leaf of an object)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rdt_jax import _dlpack, _layout, _memory
from rdt_jax._dlpack import Device, Framework, LeafSpec

__all__ = ["JaxPending", "LeafPlan"]


@dataclass(frozen=True)
class JaxPending:
  """A host view that build() turns into a jax.Array with its batch."""

  view: np.ndarray
  device: Device


@dataclass
class LeafPlan:
  """How one leaf arrives: as which framework on which device, into which
  memory (offsets in the plan's host buffer or a device region, a caller's
  target, resharded pieces), and whether caller memory is staged."""

  spec: LeafSpec
  framework: Framework
  device: Device
  target: Any = None  # a numpy/torch array received in place, or a jax template
  host_offsets: list[int] = field(default_factory=list)
  region: _memory.Region | None = None  # the device region its chunks lie in
  device_offsets: list[int] = field(default_factory=list)
  layout: _layout.TargetLayout | None = None  # set when resharded on receive
  into: Any = None  # a numpy/torch array a resharded leaf lands in
  piece_offsets: list[int] = field(default_factory=list)
  staged: bool = False  # caller memory received into rdt_jax's memory, copied after success

  @property
  def in_place(self) -> bool:
    """True if the leaf is received straight into a numpy/torch target."""
    return (
        not self.staged
        and self.target is not None
        and _dlpack.framework_of(self.target) != "jax"
        and self.spec.sharding is None
    )

  @property
  def into_direct(self) -> bool:
    """True if a resharded leaf's pieces are received straight into `into`."""
    return self.into is not None and not self.staged
