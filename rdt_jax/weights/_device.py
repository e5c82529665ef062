"""Packed versions in device memory: a weight stream that stays on the GPU.

A version whose array leaves all live on one CUDA device is packed as host
versions are (`rdt_jax.weights._packed`), into device memory:

* the publisher copies every array leaf into one CUDA allocation of its own
  per kept version (`DeviceBuffers`: made with `cuMemAlloc`, which CUDA IPC
  can always map and no framework's allocator reuses; a buffer is reused for
  a newer version once its own version left the kept-versions table);
* a subscriber on the publisher's host whose template can take the bytes
  directly (`DevicePlan`: every array leaf a CUDA torch or cupy tensor of
  the published shape and dtype, written in place, `atomic=False`) maps the
  allocation once (`rdt_jax._memory._ipc`) and copies each leaf into its
  tensor, reading the publisher's kept-versions table before and after the
  copy (`pull_device_local`): no Ray object, no NIXL, no call to the
  publisher;
* any other subscriber (another host, jax or host templates, `Slice`,
  `atomic=True`) asks the publisher for the version as one RDT object of the
  tree (`device_arrays`: made at the first request, from a copy of the
  packed bytes, freed with the version) and pulls it as a pytree version.

The leaves are packed by `rdt_jax._layout.DevicePacker`; the copy into a
subscriber's tensors is `rdt_jax.weights._device_route`.

The table makes the copy safe as it does for host memory: the publisher
removes a version from the table before its buffer can be reused, and a
copy that found the version in the table both before and after it copied
bytes no publish touched. A publisher's `device_pack=False` (default: the
setting `RDT_JAX_WEIGHT_DEVICE_PACK`) turns device packing off for its
stream (`rdt_jax.weights._packed.Stream`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from rdt_jax import _dlpack, _memory

if TYPE_CHECKING:
  from rdt_jax.weights._packed import PackedLayoutInfo

__all__ = [
  "DeviceBuffer",
  "DeviceBuffers",
  "DevicePlan",
  "device_arrays",
]


# --------------------------------------------------------------------------
# Publisher


@dataclass(frozen=True)
class DeviceBuffer:
  """A publisher's allocation holding one packed version."""

  pointer: int
  nbytes: int
  device: int
  handle: bytes  # its CUDA IPC handle
  offset: int  # the buffer's offset in the exported allocation (0: its own)


class DeviceBuffers:
  """A publisher's device buffers: each kept version holds one; a buffer
  whose version left the window is reused for the next of its size.
  Buffers of another size (a changed structure) are freed at the next
  `acquire`."""

  def __init__(self) -> None:
    self._free: list[DeviceBuffer] = []

  def acquire(self, nbytes: int, device: int) -> DeviceBuffer:
    """A buffer of `nbytes` on `device`.

    Raises:
      IpcError: the allocation or its export failed.
    """
    for i, buf in enumerate(self._free):
      if buf.nbytes == nbytes and buf.device == device:
        return self._free.pop(i)
    for buf in self._free:
      _memory.ipc_free(buf.pointer, buf.device)
    self._free.clear()
    pointer = _memory.ipc_allocate(nbytes, device)
    try:
      handle, offset = _memory.ipc_export(pointer, device)
    except BaseException:
      _memory.ipc_free(pointer, device)
      raise
    return DeviceBuffer(pointer, nbytes, device, handle, offset)

  def release(self, buf: DeviceBuffer) -> None:
    """Returns a buffer whose version left the kept-versions table."""
    self._free.append(buf)

  def close(self, held: Sequence[DeviceBuffer] = ()) -> None:
    """Frees every free buffer and `held`."""
    for buf in [*self._free, *held]:
      _memory.ipc_free(buf.pointer, buf.device)
    self._free.clear()


def device_arrays(info: PackedLayoutInfo, frameworks: Sequence[str], entries: Sequence[Any],
                  buf: DeviceBuffer) -> list[Any]:
  """A device-packed version's array leaves as they were published, for a
  subscriber that pulls it through Ray: each a new array of its published
  framework on the buffer's device, copied from the buffer (which is reused
  once the version is dropped; the object's arrays are its own). Typed keys
  come back as keys."""
  import torch

  device = _dlpack.Device("cuda", buf.device)
  whole = _dlpack.torch_bytes(buf.pointer, buf.nbytes, device)
  made: list[tuple[Any, str, str, str, str]] = []
  with torch.cuda.device(buf.device):
    for (path, kind, _, what), framework, shape, offset, size in zip(
        entries, frameworks, info.shapes, info.layout.offsets, info.layout.sizes):
      dtype = np.dtype(np.uint32) if kind == "key" else _dlpack.np_dtype_from_name(what)
      piece = whole[offset : offset + size].clone()
      made.append((_dlpack.torch_from_device_bytes(piece, dtype, tuple(shape), path), kind, what, framework, path))
    torch.cuda.current_stream(buf.device).synchronize()
  out = []
  for t, kind, what, framework, path in made:
    x = t if framework == "torch" else _dlpack.convert_leaf(t, framework, path)  # type: ignore[arg-type]
    out.append(_dlpack.wrap_prng_key(x, what) if kind == "key" else x)
  return out


# --------------------------------------------------------------------------
# Subscriber


@dataclass
class DevicePlan:
  """A subscriber's plan for one device-packed structure whose template
  takes the bytes directly: every array leaf a CUDA tensor written in place.

  Attributes:
    info: the structure's layout.
    targets: the template's tensors, in array-leaf order.
    pointers: their addresses when the plan was made.
    runs: (destination address, source offset in the version, nbytes).
    devices: the devices the targets live on.
  """

  info: PackedLayoutInfo
  targets: list[Any]
  pointers: list[int]
  runs: list[tuple[int, int, int]]
  devices: set[_dlpack.Device]

  @classmethod
  def make(cls, info: PackedLayoutInfo, entries: Sequence[Any], template: dict[str, Any],
           atomic: bool) -> DevicePlan | None:
    """The plan, or None where the template cannot take the bytes directly
    (atomic, a typed key, a `Slice`, a jax, numpy or host leaf, another
    shape or dtype, memory not contiguous and writable)."""
    if atomic:
      return None
    targets, pointers, runs, devices = [], [], [], set()
    for (path, kind, shape, what), offset, size in zip(entries, info.layout.offsets, info.layout.sizes):
      target = template.get(path)
      if kind != "array" or target is None or _dlpack.framework_of(target) not in ("torch", "cupy"):
        return None
      device = _dlpack.device_of(target)
      if device.kind != "cuda" or tuple(target.shape) != tuple(shape):
        return None
      if _dlpack.dtype_of(target) != _dlpack.np_dtype_from_name(what):
        return None
      if not (_dlpack.is_c_contiguous(target) and _dlpack.is_writable(target)):
        return None
      if size != math.prod(shape) * _dlpack.dtype_of(target).itemsize:
        return None
      pointer = _dlpack.buffer_pointer(target)
      targets.append(target)
      pointers.append(pointer)
      devices.add(device)
      if size:
        runs.append((pointer, offset, size))
    if len(devices) != 1:
      return None  # copies run on one device's stream
    return cls(info, targets, pointers, runs, devices)

  def check_targets(self) -> None:
    """Raises if a target's memory moved since the plan was made."""
    if _dlpack.buffer_pointers(self.targets) == self.pointers:
      return
    raise _dlpack.UnsupportedLeafError(
        "", "is a template whose tensors' memory moved since the subscriber's first pull",
        "Keep the template's tensors in place (copy into them, never rebind their storage), "
        "or create a new WeightSubscriber.")

  @property
  def device(self) -> int:
    """The index of the CUDA device the targets live on."""
    return next(iter(self.devices)).index

  def copy(self, base: int) -> None:
    """Copies a version whose buffer is at `base` (valid here) into the
    targets: after every stream of the targets' device, so work queued
    against them runs first; returns once the bytes are in place."""
    _memory.settle_targets(self.devices)
    _memory.ipc_copy([(dst, base + offset, n) for dst, offset, n in self.runs], self.device)

  def written(self) -> list[Any]:
    """The targets, marked written (the pulled leaves, in order)."""
    _dlpack.mark_written_many(self.targets)
    return list(self.targets)
