"""Receive plans: where each chunk of an object lands on the consumer, and how
its leaves are rebuilt from there.

A `ReceivePlan` decides, per leaf, the array type it arrives as (receive mode
or target), its device, and its memory: host chunks share one pooled, 64-byte
aligned buffer (one allocation and one registration for an object of many
small leaves, every leaf a zero-copy view into it); device chunks get a
buffer each; leaves with a numpy/torch target are received straight into the
target's memory. Backends see only the resulting `Destination`s.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rdt_jax import _dlpack
from rdt_jax._dlpack import Device, Framework, LeafSpec
from rdt_jax._targets import Target, align_targets


@dataclass
class Destination:
  """Where one chunk lands on the consumer.

  Attributes:
    pointer: address of the chunk's first byte.
    nbytes: the chunk's size.
    device: the device the memory is on.
    array: the framework object owning the memory (a uint8 numpy view, a
      torch tensor or a jax array), for backends that need one.
    region: `(pointer, nbytes)` of the whole allocation the chunk lies in
      (chunks of one object share a host buffer): what a backend registers.
    pooled: True if `region` belongs to the process's host buffer pool and
      outlives this transfer (a backend may keep it registered until the
      pool evicts it; see `rdt_jax._dlpack.HostBufferPool`).
  """

  pointer: int
  nbytes: int
  device: Device
  array: Any
  region: tuple[int, int]
  pooled: bool = False


@dataclass(frozen=True)
class Placement:
  """Where one whole leaf should arrive, for backends that move arrays.

  Attributes:
    device: the leaf's receive device.
    template: a jax target array whose sharding the leaf should get, or None.
  """

  device: Device
  template: Any = None


@dataclass(frozen=True)
class _JaxPending:
  """A host view that build() turns into a jax.Array with its batch."""

  view: np.ndarray
  device: Device


@dataclass
class _LeafPlan:
  spec: LeafSpec
  framework: Framework
  device: Device
  target: Any = None  # a numpy/torch array received in place, or a jax template
  host_offsets: list[int] = field(default_factory=list)
  device_buffers: list[_dlpack.DeviceBuffer] = field(default_factory=list)

  @property
  def in_place(self) -> bool:
    """True if the leaf is received straight into a numpy/torch target."""
    return (
        self.target is not None
        and _dlpack.framework_of(self.target) != "jax"
        and self.spec.sharding is None
    )


class ReceivePlan:
  """Receive buffers for one object, and how to rebuild its leaves from them.

  Raises (on construction):
    UnsupportedLeafError: for a 64-bit leaf that would arrive as jax while
      x64 is off, naming the leaf.
    ValueError: for a target that does not fit the object.
  """

  def __init__(self, leaves: list[LeafSpec], mode: str, target: Target | None = None):
    targets: list[Any] = (
        align_targets(target.buffers, leaves)
        if target is not None and target.buffers is not None
        else [None] * len(leaves)
    )
    self.plans = [
        self._plan_leaf(spec, mode, t, target.device if target else None)
        for spec, t in zip(leaves, targets)
    ]
    self.host: np.ndarray | None = None
    self._host_region: tuple[int, int] | None = None
    self.destinations: list[Destination] = []

  def placements(self) -> list[Placement]:
    """One `Placement` per leaf, for backends that receive whole arrays."""
    return [
        Placement(p.device, p.target if _dlpack.framework_of(p.target) == "jax" else None)
        for p in self.plans
    ]

  @staticmethod
  def _plan_leaf(spec: LeafSpec, mode: str, target: Any, device: Device | None) -> _LeafPlan:
    target_fw = _dlpack.framework_of(target)
    if target_fw is not None:
      device = _dlpack.device_of(target)
    elif device is None:
      device = Device(spec.device)
    framework: Framework = target_fw or (spec.framework if mode == "source" else mode)  # type: ignore[assignment]
    if framework == "jax":
      _dlpack.check_x64(spec.dtype, spec.path)
    return _LeafPlan(spec, framework, device, target if target_fw else None)

  def allocate(self) -> list[Destination]:
    """Takes the receive memory of every chunk; returns (and keeps) one
    `Destination` per chunk, in leaf order."""
    host_plans = [p for p in self.plans if p.device.kind == "cpu" and not p.in_place]
    offsets, total = _dlpack.host_layout([p.spec for p in host_plans])
    if host_plans:
      self.host = _dlpack.host_pool.acquire(total)
      self._host_region = _dlpack.host_pool.region_of(self.host)
    for plan, leaf_offsets in zip(host_plans, offsets):
      plan.host_offsets = leaf_offsets
    for plan in self.plans:
      for i, chunk in enumerate(plan.spec.chunks):
        self.destinations.append(self._destination(plan, i, chunk.nbytes))
    return self.destinations

  def _destination(self, plan: _LeafPlan, i: int, nbytes: int) -> Destination:
    if plan.in_place:
      t = plan.target
      pointer = _dlpack.buffer_pointer(t)
      return Destination(pointer, nbytes, plan.device, t, (pointer, nbytes))
    if plan.device.kind == "cpu":
      assert self.host is not None
      offset = plan.host_offsets[i]
      view = self.host[offset : offset + nbytes]
      base = _dlpack.host_pointer(self.host)
      if self._host_region is not None:  # a pooled buffer: faulted in, reusable
        return Destination(base + offset, nbytes, plan.device, view, self._host_region, True)
      return Destination(base + offset, nbytes, plan.device, view, (base, self.host.nbytes))
    buf = _dlpack.allocate_device_buffer(nbytes, plan.device)
    plan.device_buffers.append(buf)
    return Destination(buf.pointer, nbytes, plan.device, buf.array, (buf.pointer, buf.nbytes))

  def release(self) -> None:
    """Drops this plan's references to its receive memory (after a failed
    fetch). The backend keeps its own references for as long as a transfer
    may still write there; the plan's must not outlive the failure in a
    traceback that Ray keeps, or the host pool could not reuse the buffer."""
    for d in self.destinations:
      d.array = None
    self.destinations = []
    self.host = None
    self._host_region = None
    for plan in self.plans:
      plan.device_buffers = []

  def build(self) -> list[Any]:
    """The received leaves, as each plan's framework (after the bytes moved)."""
    leaves = [self._build_leaf(p) for p in self.plans]
    # Host leaves arriving as jax are made in one call per device: jax's
    # per-array overhead dominates objects of many small leaves.
    batches: dict[Device, list[int]] = {}
    for i, leaf in enumerate(leaves):
      if isinstance(leaf, _JaxPending):
        batches.setdefault(leaf.device, []).append(i)
    for device, indices in batches.items():
      arrays = _dlpack.host_to_jax_many([leaves[i].view for i in indices], device)
      for i, array in zip(indices, arrays):
        leaves[i] = array
    return leaves

  def adopt(self, received: list[Any]) -> list[Any]:
    """The leaves from whole arrays a backend received (one per leaf, any
    framework): converted to each plan's framework, or copied into
    numpy/torch targets."""
    return [self._adopt_leaf(p, x) for p, x in zip(self.plans, received)]

  @staticmethod
  def _adopt_leaf(plan: _LeafPlan, leaf: Any) -> Any:
    if plan.target is not None and plan.framework != "jax":
      _dlpack.copy_into(plan.target, leaf)
      return plan.target
    return _dlpack.convert_leaf(leaf, plan.framework, plan.spec.path)

  def _build_leaf(self, plan: _LeafPlan) -> Any:
    spec = plan.spec
    if plan.in_place:
      return plan.target
    if plan.device.kind != "cpu":
      return _dlpack.rebuild_device(plan.device_buffers, spec, plan.framework)
    assert self.host is not None
    views = [
        _dlpack.host_chunk(self.host, off, spec.dtype, chunk)
        for off, chunk in zip(plan.host_offsets, spec.chunks)
    ]
    if plan.framework == "jax" and spec.sharding is None:
      return _JaxPending(views[0], plan.device)  # made in build(), batched
    leaf = _dlpack.rebuild_host(views, spec, plan.framework, plan.device)
    if plan.target is not None and plan.framework != "jax":
      # A sharded leaf received for a numpy/torch target: one copy into it.
      _dlpack.copy_into(plan.target, leaf)
      return plan.target
    return leaf
