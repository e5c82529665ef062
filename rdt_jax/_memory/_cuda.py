"""Every CUDA-specific step of rdt_jax, and nothing else: stream ordering.

Transports never touch streams themselves; they call these through the
`rdt_jax._memory` namespace. Each function is a no-op for host memory, so
the callers run the same code on cpu (where the tests exercise it) and cuda.

Rules (docs/gpu.md states them for users):

* Producer: before a backend reads an object's device memory,
  `wait_for_producers` waits once per object and device: one CUDA event
  recorded on the current torch (or cupy) stream of each device the object's
  tensors live on, synchronized; jax leaves were already waited for one by
  one (`block_until_ready` when described: that waits for the array's own
  computation, not the device). Work a user queued on a side stream of their
  own must be synchronized by them, as for Ray's own transports.
* Consumer: memory freshly taken from a framework's caching allocator may
  still be the target of kernels queued on its stream (the allocator reuses
  blocks in stream order; a DMA engine does not wait for that order):
  `settle_fresh` waits for the allocating stream once per region.
* Consumer, reused region: a pooled region is reused once no array built on
  it is alive, but kernels queued against those arrays (on any stream: jax's,
  torch's, a user's) may still be running when the last Python reference
  goes. `settle_reuse` waits for every stream of the device before the region
  is handed to a new transfer.
* Consumer, caller memory: a transfer into a caller's cuda target (a weight
  sync into live parameters) writes outside stream order, so kernels still
  queued against the target (the previous step reading or writing it) would
  race the DMA. `settle_targets` waits for every stream of each device that
  holds an in-place target, once per object, before the transfer is posted;
  `copy_into_many` waits the same way around copies into caller arrays.
* Consumer of a two-sided backend: Ray's NCCL receive runs on Ray's own
  stream, which it does not expose; `wait_received` synchronizes each
  receiving device once per object (not per leaf).
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterable
from typing import Any, Final

import numpy as np

from rdt_jax._dlpack import _dispatch, _torch
from rdt_jax._dlpack._bytes import CudaBytes, host_bytes
from rdt_jax._dlpack._devices import Device
from rdt_jax._dlpack._lazy import importable, loaded_type
from rdt_jax._dlpack._specs import DescribedLeaf


def wait_for_producers(leaves: Iterable[DescribedLeaf]) -> int:
  """Waits until queued work writing the leaves' cuda memory is done.

  One event per (framework, device) of the object's torch and cupy cuda
  leaves, recorded on that framework's current stream of the device and
  synchronized. jax leaves need nothing here (described after
  `block_until_ready`).

  Returns:
    the number of events waited on (0 for an object in host memory).
  """
  wanted: set[tuple[str, int]] = set()
  for leaf in leaves:
    if leaf.device == "cuda" and leaf.spec.framework != "jax":
      for index in leaf.device_indices:
        wanted.add((_framework_of_arrays(leaf), index))
  for framework, index in sorted(wanted):
    _record_and_wait(framework, index)
  return len(wanted)


def _framework_of_arrays(leaf: DescribedLeaf) -> str:
  cupy_array = loaded_type("cupy", "ndarray")
  if cupy_array is not None and leaf.arrays and isinstance(leaf.arrays[0], cupy_array):
    return "cupy"
  return "torch"


def _record_and_wait(framework: str, index: int) -> None:
  if framework == "cupy":
    import cupy

    with cupy.cuda.Device(index):
      event = cupy.cuda.Event(block=False, disable_timing=True)
      event.record(cupy.cuda.get_current_stream())
      event.synchronize()
    return
  import torch

  event = torch.cuda.Event()
  event.record(torch.cuda.current_stream(index))
  event.synchronize()


def settle_fresh(device: Device) -> None:
  """Waits for torch's current stream on `device` (no-op for host memory):
  called once for each region freshly taken from torch's caching allocator,
  before a transfer writes it outside stream order."""
  if device.kind == "cpu":
    return
  import torch

  torch.cuda.current_stream(device.index).synchronize()


def settle_reuse(device: Device) -> None:
  """Waits for every stream of `device` (no-op for host memory): called
  before a pooled region whose arrays are gone is written again, so no kernel
  still queued against one of them reads the new bytes."""
  if device.kind == "cpu":
    return
  if not importable("torch") and importable("cupy"):
    import cupy

    cupy.cuda.Device(device.index).synchronize()
    return
  import torch

  torch.cuda.synchronize(device.index)


def settle_targets(devices: Iterable[Device]) -> None:
  """Waits for every stream of each cuda device in `devices`, once each
  (no-op for host memory): called before a transfer writes caller-owned
  memory there, so work queued against the target runs before the write."""
  for device in sorted({d for d in devices if d.kind != "cpu"}, key=str):
    settle_reuse(device)


def wait_received(devices: Iterable[Device]) -> None:
  """Makes bytes a two-sided receive wrote visible to the arrays built on
  them: synchronizes each cuda device once (Ray's NCCL stream is private)."""
  for index in sorted({d.index for d in devices if d.kind != "cpu"}):
    import torch

    torch.cuda.synchronize(index)


def copy_into(target: Any, leaf: Any) -> None:
  """Copies `leaf`'s values into the numpy, torch or cupy array `target`
  (`copy_into_many` with one pair: a CUDA target is written in order with
  every stream of its device, and the copy has ended on return)."""
  copy_into_many([(target, leaf)])


def copy_into_many(pairs: list[tuple[Any, Any]]) -> None:
  """Copies each `(target, leaf)`'s values into the numpy, torch or cupy
  array `target`.

  Where a target lives in CUDA memory, waits first for every stream of its
  device (once per device), so work queued against the target on any stream
  (a side stream still reading the old parameters) runs before the write;
  and waits for the copies before returning, so the source may be freed or
  its memory reused at once (XLA's allocator does not follow torch's
  streams) and the target read from any stream.
  """
  devices = {_dispatch.device_of(target) for target, _ in pairs}
  settle_targets(devices)
  _dispatch.copy_values(pairs)
  settle_targets(devices)  # the copies have ended, on whichever stream they ran


def copy_bytes(dst: int, src: int, nbytes: int, device: Device) -> None:
  """Copies `nbytes` from `src` to `dst`, both on `device`, in stream order
  (the current torch stream; call `wait_for_copies` before anything outside
  that order reads `dst`)."""
  if device.kind == "cpu":
    ctypes.memmove(dst, src, nbytes)
    return
  _torch.bytes_tensor(dst, nbytes, device).copy_(_torch.bytes_tensor(src, nbytes, device))


def copy_from_host(dst: int, src: memoryview, device: Device) -> None:
  """Copies the bytes of host buffer `src` to `dst` on `device`, and waits
  for the copy (the bytes are in place on return).

  For cuda it uses torch if it is installed, else cupy (untested here: no GPU).

  Raises:
    ImportError: for a cuda `device` where neither torch nor cupy is
      installed, saying what to install.
  """
  data = np.frombuffer(src, np.uint8)
  if device.kind == "cpu":
    host_bytes(dst, data.nbytes)[:] = data
    return
  if importable("torch"):
    import torch

    _torch.bytes_tensor(dst, data.nbytes, device).copy_(torch.from_numpy(data.copy()))
    wait_for_copies(device)
    return
  if importable("cupy"):
    import cupy

    with cupy.cuda.Device(device.index):
      cupy.asarray(CudaBytes(dst, data.nbytes)).set(data)
      cupy.cuda.get_current_stream().synchronize()
    return
  raise ImportError(
      f"Copying an in-band object to {device} needs torch or cupy: pip install torch (or cupy-cuda12x)."
  )


def wait_for_copies(device: Device) -> None:
  """Waits for the copies `copy_bytes` queued on `device` (no-op on cpu)."""
  if device.kind == "cpu":
    return
  import torch

  event = torch.cuda.Event()
  event.record(torch.cuda.current_stream(device.index))
  event.synchronize()


#: cuPointerGetAttribute's CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE (cuda.h).
_IS_LEGACY_CUDA_IPC_CAPABLE: Final = 10


def ipc_capable(pointer: int) -> bool | None:
  """Whether the CUDA allocation holding device address `pointer` can be
  mapped by another process with `cudaIpcOpenMemHandle` (what UCX's
  cuda_ipc transport uses): True for `cudaMalloc` memory (torch's caching
  allocator without expandable segments), False for memory from CUDA's
  virtual memory API or a stream-ordered pool (XLA's allocator). None where
  the driver cannot tell (no CUDA driver, or an error)."""
  try:
    cuda = ctypes.CDLL("libcuda.so.1")
  except OSError:
    return None
  value = ctypes.c_int(0)
  rc = cuda.cuPointerGetAttribute(ctypes.byref(value), _IS_LEGACY_CUDA_IPC_CAPABLE, ctypes.c_uint64(pointer))
  return bool(value.value) if rc == 0 else None


def cuda_available(framework: str) -> bool:
  """True if `framework` ("torch", "jax" or "cupy") sees a cuda device here;
  imports nothing that is not importable."""
  if not importable(framework):
    return False
  try:
    if framework == "torch":
      import torch

      return bool(torch.cuda.is_available())
    if framework == "jax":
      import jax

      return bool(jax.devices("gpu"))
    import cupy

    return int(cupy.cuda.runtime.getDeviceCount()) > 0
  except Exception:
    return False

