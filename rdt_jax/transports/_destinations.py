"""What a backend receives into, as a receive plan hands it over: one
`Destination` per chunk (byte backends) or one `Placement` per leaf
(whole-array backends), and `memory_kind`, the one host-or-device decision
about receive memory, here and in the backends.

A `ReceivePlan` (`rdt_jax.transports._plan`) makes them; backends see only
these. A destination marked `caller` is the caller's own memory (a
numpy/torch target, a `Slice(into=...)` buffer), which a backend may write
only while its receive hooks run; a backend that cannot end every write by
then raises `StageCallerMemory` from `start_receive`, before writing
anything, and the fetch is planned again with that memory staged (`_plan`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from rdt_jax import _layout
from rdt_jax._dlpack import Device

__all__ = ["Destination", "MemoryKind", "Placement", "StageCallerMemory", "memory_kind"]

#: What memory a buffer is: host memory (any cpu device: one address space)
#: or the memory of one accelerator device.
MemoryKind = Literal["host", "device"]


def memory_kind(device: Device) -> MemoryKind:
  """The memory kind of buffers on `device`: "host" for a cpu device, whatever
  its index, "device" for any other. Every host-or-device decision about
  receive memory, here and in the backends, goes through this function."""
  return "host" if device.kind == "cpu" else "device"


@dataclass
class Destination:
  """Where one chunk lands on the consumer.

  Attributes:
    pointer: address of the chunk's first byte.
    nbytes: the chunk's size.
    device: the device the memory is on.
    keepalive: the framework object owning the memory (a uint8 numpy view,
      a torch tensor or a jax array). Holding it keeps the memory from being
      freed or reused: a backend whose transfer may still write after the
      fetch gave up keeps this reference until the transfer ended. Also
      readable as `array` (the former name).
    region: `(pointer, nbytes)` of the whole allocation the chunk lies in
      (chunks of one object share a host buffer): what a backend registers.
    pooled: True if `region` belongs to the process's host buffer pool and
      outlives this transfer (a backend may keep it registered until the
      pool evicts it; see `rdt_jax._memory.HostBufferPool`).
    source: the index of the source chunk this destination's bytes come
      from, counting every chunk of every leaf of the object in leaf order.
    source_offset: where in that source chunk the bytes start.
    part: True if this is a byte run of a resharded leaf (a part of a chunk,
      or a chunk going to a buffer laid out differently): only backends that
      read parts (`DlpackTransport.reads_parts`) are given such destinations,
      and the bytes after `nbytes` are not padding (never read past them).
    caller: True if the memory is the caller's (a numpy/torch target or a
      `Slice(into=...)` buffer): a backend may write it only while its
      receive hooks run (see the module docstring), and must raise
      `StageCallerMemory` from `start_receive`, before writing anything, if
      it cannot.
  """

  pointer: int
  nbytes: int
  device: Device
  keepalive: Any
  region: tuple[int, int]
  pooled: bool = False
  source: int = -1
  source_offset: int = 0
  part: bool = False
  caller: bool = False

  @property
  def array(self) -> Any:
    """Deprecated, read-only alias of `keepalive` (kept for custom transports)."""
    return self.keepalive


class StageCallerMemory(Exception):
  """Raised by a backend's `start_receive`, before it wrote anything, when it
  cannot finish every write into a `Destination.caller` destination before its
  receive hooks return: the fetch is planned again with caller memory staged."""


@dataclass(frozen=True)
class Placement:
  """Where one whole leaf should arrive, for backends that move arrays.

  Attributes:
    device: the leaf's receive device.
    template: a jax target array whose sharding the leaf should get, or None
      (its sharding has the producer's layout, or one device).
    layout: for a leaf resharded on receive, what the consumer asks for (a
      box of the leaf, split into pieces over `layout.devices`); the backend
      must deliver exactly that, with `layout.sharding` (or on `device` when
      it is None). None otherwise.
  """

  device: Device
  template: Any = None
  layout: _layout.TargetLayout | None = None
