"""Many leaves in one buffer: the weight stream's per-step copy.

A trainer publishes the same structure (leaf count, shapes, dtypes) every
step, in new arrays. Describing, registering and planning each leaf anew
every step costs tens of microseconds per leaf; copying every leaf into one
host buffer at fixed offsets (`PackedLayout`) costs a pointer lookup and a
`memmove` per leaf, and leaves one buffer to send.

`Packer.pack` makes the checks of `describe` once per leaf placement, not
per step: a single-device jax array whose sharding object is the one the
leaf at its position had when it was last checked (jit outputs of one
function keep theirs from call to call) is copied after a pointer lookup
alone; any other leaf goes through `describe`, which checks it in full and
names it in any error.

`DevicePacker` does the same for leaves that all live on one CUDA device,
into a device buffer, with device-to-device copies (`rdt_jax._memory._ipc`).
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from rdt_jax._dlpack._dispatch import block_until_ready, describe, framework_of
from rdt_jax._dlpack._errors import UnsupportedLeafError
from rdt_jax._dlpack._sharding import is_sharding
from rdt_jax._dlpack._specs import DescribedLeaf
from rdt_jax._memory._cuda import wait_for_producers
from rdt_jax._memory._host import aligned
from rdt_jax._memory._ipc import copy_runs

__all__ = ["DevicePacker", "NotHostMemory", "NotOnDevice", "PackedLayout", "Packer", "cuda_device_of",
           "is_cpu_sharding", "jax_placement"]


class NotHostMemory(UnsupportedLeafError):
  """A leaf to pack lives in device memory; the caller sends it another way."""


class NotOnDevice(UnsupportedLeafError):
  """A leaf to pack on a CUDA device is not one buffer on that device; the
  caller sends it another way."""


@dataclass(frozen=True)
class PackedLayout:
  """Where each leaf's bytes lie in a packed buffer.

  Attributes:
    offsets: each leaf's first byte, on a 64-byte boundary.
    sizes: each leaf's byte count (0 for an empty leaf).
    total: the buffer's size.
  """

  offsets: tuple[int, ...]
  sizes: tuple[int, ...]
  total: int

  @classmethod
  def of(cls, sizes: Sequence[int]) -> PackedLayout:
    """Leaves of `sizes` bytes one after the other, each 64-byte aligned."""
    offsets, at = [], 0
    for n in sizes:
      offsets.append(at)
      at += aligned(int(n))
    return cls(tuple(offsets), tuple(int(n) for n in sizes), at)


def _host_source(x: Any, path: str) -> tuple[int, int, Any]:
  """A leaf's (host pointer, nbytes, what keeps the bytes alive), checked in
  full (`describe`). A sharded jax array on cpu devices is gathered into one
  host copy.

  Raises:
    NotHostMemory: the leaf lives in device memory.
    UnsupportedLeafError: naming the leaf, for anything `describe` refuses.
  """
  leaf = describe(x, path)
  if leaf.spec.device != "cpu":
    raise NotHostMemory(
        path, f"lives in {leaf.spec.device} memory", "Pack only host leaves; send device leaves as they are."
    )
  if len(leaf.pointers) == 1:
    return leaf.pointers[0], leaf.spec.nbytes, x
  gathered = np.ascontiguousarray(np.asarray(x))
  return int(gathered.ctypes.data), int(gathered.nbytes), gathered


def _wait_ready(leaves: Sequence[Any], paths: Sequence[str]) -> None:
  """Waits for the jax leaves' computations; a deleted leaf is named."""
  try:
    block_until_ready(list(leaves))
  except Exception:
    for x, path in zip(leaves, paths):
      describe(x, path)  # names a deleted leaf
    raise


class Packer:
  """Copies the array leaves of one structure into host buffers, step after step.

  Args:
    layout: where each leaf goes (`PackedLayout.of` the leaves' sizes).
    paths: each leaf's pytree path, for errors.
  """

  def __init__(self, layout: PackedLayout, paths: Sequence[str]):
    if len(paths) != len(layout.sizes):
      raise ValueError(f"{len(paths)} paths for a layout of {len(layout.sizes)} leaves")
    self.layout = layout
    self.paths = tuple(paths)
    # per leaf position: the sharding object of the single-device host jax
    # leaf last checked there in full (a jitted function's outputs keep theirs
    # from call to call), or None
    self._checked: list[Any] = [None] * len(paths)
    #: (position, offset, size) of every leaf with bytes to copy
    self._nonempty = [(i, o, n) for i, (o, n) in enumerate(zip(layout.offsets, layout.sizes)) if n]

  def pack(self, leaves: Sequence[Any], base: int) -> None:
    """Copies each leaf's bytes to `base` plus its offset; returns when every
    byte is in place (jax leaves are waited for first).

    Args:
      leaves: arrays of the layout's sizes, in layout order.
      base: the address of a host buffer of at least `layout.total` bytes.

    Raises:
      NotHostMemory: a leaf lives in device memory (nothing is copied from it).
      UnsupportedLeafError: naming the leaf: deleted, or another size than
        the layout's, or anything `describe` refuses.
    """
    if len(leaves) != len(self.layout.sizes):
      raise ValueError(f"{len(leaves)} leaves for a layout of {len(self.layout.sizes)}")
    _wait_ready(leaves, self.paths)
    memmove = ctypes.memmove
    checked = self._checked
    for i, offset, size in self._nonempty:
      x = leaves[i]
      pointer = None
      sharding = getattr(x, "sharding", None)
      if sharding is not None and checked[i] is sharding:
        try:
          pointer = x.unsafe_buffer_pointer()
        except Exception:  # deleted since: describe names it
          pointer = None
      keep: Any = None
      if pointer is None:
        path = self.paths[i]
        pointer, nbytes, keep = _host_source(x, path)
        if nbytes != size:
          raise UnsupportedLeafError(
              path, f"has {nbytes} bytes where the structure it was published with has {size}",
              "Publish leaves of the structure's shapes and dtypes.",
          )
        checked[i] = sharding if framework_of(x) == "jax" and keep is x else None
      memmove(base + offset, pointer, size)
      del keep


def cuda_device_of(leaves: Sequence[DescribedLeaf]) -> int | None:
  """The CUDA device index every described leaf lives on, one buffer each,
  or None if they are not all so (host memory, several devices, sharded,
  no leaves)."""
  found: set[int] = set()
  for leaf in leaves:
    if leaf.spec.device != "cuda" or len(leaf.pointers) != 1:
      return None
    found.update(leaf.device_indices)
  return found.pop() if len(found) == 1 else None


class DevicePacker:
  """Copies the array leaves of one structure into device buffers, step
  after step: `Packer`'s twin for leaves that all live on one CUDA device.

  Args:
    layout: where each leaf goes.
    paths: each leaf's pytree path, for errors.
    device: the CUDA device index every leaf lives on.
  """

  def __init__(self, layout: PackedLayout, paths: Sequence[str], device: int):
    if len(paths) != len(layout.sizes):
      raise ValueError(f"{len(paths)} paths for a layout of {len(layout.sizes)} leaves")
    self.layout = layout
    self.paths = tuple(paths)
    self.device = device
    self._checked: list[Any] = [None] * len(paths)
    self._nonempty = [(i, o, n) for i, (o, n) in enumerate(zip(layout.offsets, layout.sizes)) if n]

  def pack(self, leaves: Sequence[Any], base: int) -> None:
    """Copies each leaf's bytes to device address `base` plus its offset
    (a buffer of at least `layout.total` bytes on the device); returns when
    every byte is in place. jax leaves are waited for first, and the current
    streams of torch and cupy leaves.

    Raises:
      NotOnDevice: a leaf is not one buffer on the structure's device any
        more (nothing was copied).
      UnsupportedLeafError: naming the leaf: deleted, or another size.
    """
    if len(leaves) != len(self.layout.sizes):
      raise ValueError(f"{len(leaves)} leaves for a layout of {len(self.layout.sizes)}")
    _wait_ready(leaves, self.paths)
    runs: list[tuple[int, int, int]] = []
    others: list[DescribedLeaf] = []
    checked = self._checked
    for i, offset, size in self._nonempty:
      x = leaves[i]
      sharding = getattr(x, "sharding", None)
      pointer = None
      if sharding is not None and checked[i] is sharding:
        try:
          pointer = x.unsafe_buffer_pointer()
        except Exception:  # deleted since: describe names it
          pointer = None
      if pointer is None:
        path = self.paths[i]
        leaf = describe(x, path)
        if cuda_device_of([leaf]) != self.device:
          raise NotOnDevice(path, f"is not one buffer on cuda:{self.device}, where its structure was packed",
                            "Publish every leaf on one device.")
        if leaf.spec.nbytes != size:
          raise UnsupportedLeafError(
              path, f"has {leaf.spec.nbytes} bytes where the structure it was published with has {size}",
              "Publish leaves of the structure's shapes and dtypes.")
        pointer = leaf.pointers[0]
        if leaf.spec.framework == "jax":
          checked[i] = sharding
        else:
          others.append(leaf)
      runs.append((base + offset, pointer, size))
    wait_for_producers(others)
    copy_runs(runs, self.device)


def jax_placement(target: Any) -> Any:
  """Where a jax leaf received for template leaf `target` goes: None for the
  first cpu device (a leaf can then alias received host memory), else a
  sharding: `target` itself if it is one, the sharding of a jax array or
  typed key `target`. None also for anything else (no jax template)."""
  if target is None:
    return None
  sharding = target if is_sharding(target) else getattr(target, "sharding", None)
  if sharding is None or framework_of(target) not in (None, "jax"):
    return None
  devices = sharding.device_set
  if len(devices) == 1:
    device = next(iter(devices))
    if device.platform == "cpu" and device.id == 0 and getattr(sharding, "memory_kind", None) in (None, "device"):
      return None
  return sharding


def is_cpu_sharding(sharding: Any) -> bool:
  """True if every device of `sharding` is a cpu device (its arrays live in
  host memory, so they can be made from host views without a copy)."""
  return all(d.platform == "cpu" for d in sharding.device_set)
