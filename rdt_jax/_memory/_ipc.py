"""CUDA IPC: another process's device memory, mapped and copied from here.

A weight publisher keeps each packed version of device leaves in one CUDA
allocation of its own (`rdt_jax.weights._device`). A subscriber on the same
host maps that allocation once (`cuIpcOpenMemHandle`) and copies each
version's bytes straight into its CUDA tensors: one device-to-device copy
per leaf, no Ray object, no NIXL. Everything here goes through CUDA's driver
API (`libcuda.so.1`, present wherever a GPU is usable), so it needs neither
cupy nor a particular CUDA runtime.

* `export(pointer)`: the IPC handle of the allocation holding a device
  address, and the address's offset in it. Memory from CUDA's virtual memory
  API or a stream-ordered pool (XLA's allocator, torch with expandable
  segments) has no such handle: `IpcError`.
* `mapped(handle, device)`: the address of that allocation in this process,
  opened at the first use of `handle` and kept (an allocation the exporter
  frees and makes again gets a new handle, so a kept mapping never names
  other memory); at most `_limits.IPC_MAPPINGS_KEPT` are kept.
* `copy_runs(runs, device)`: device-to-device copies on a stream of
  rdt_jax's own, waited for before it returns.
* `allocate(nbytes, device)`, `free(pointer, device)`: allocations of
  rdt_jax's own (`cuMemAlloc`), which CUDA IPC can always map and no
  framework's allocator reuses.

The calls run in the device's primary context (torch's, and jax's), pushed
for the call and popped after, so the calling thread's current context is
left as it was. None of this decides when a copy is safe; the weight routes
check the publisher's kept-versions table before and after each copy, as
for host memory.
"""

from __future__ import annotations

import ctypes
import threading
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Final

from rdt_jax import _limits

__all__ = ["IpcError", "allocate", "copy_runs", "export", "free", "mapped", "mappings", "usable"]

#: CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS (cuda.h): a mapping on another GPU of the host enables peer access itself.
_LAZY_ENABLE_PEER_ACCESS: Final = 1
#: CU_STREAM_NON_BLOCKING (cuda.h): the stream does not wait for, nor hold up, the legacy default stream.
_STREAM_NON_BLOCKING: Final = 1
#: sizeof(CUipcMemHandle) (cuda.h).
HANDLE_BYTES: Final = _limits.CUDA_IPC_HANDLE_BYTES


class IpcError(OSError):
  """A CUDA driver call of the IPC path failed: the message names the call
  and CUDA's error."""


class _Handle(ctypes.Structure):
  # Unsigned bytes, not c_char: a c_char array field reads back cut at its first zero byte.
  _fields_ = [("reserved", ctypes.c_ubyte * HANDLE_BYTES)]


_lock = threading.Lock()
_driver: list[ctypes.CDLL | None] = []
_contexts: dict[int, ctypes.c_void_p] = {}
_streams: dict[int, ctypes.c_void_p] = {}
_mappings: OrderedDict[tuple[bytes, int], int] = OrderedDict()
_busy: dict[tuple[bytes, int], int] = {}


def _lib() -> ctypes.CDLL | None:
  """The CUDA driver, initialized; None where it cannot be loaded."""
  with _lock:
    if not _driver:
      try:
        lib = ctypes.CDLL("libcuda.so.1")
        lib.cuIpcOpenMemHandle_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64), _Handle, ctypes.c_uint]
        lib.cuMemcpyDtoDAsync_v2.argtypes = [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p]
        lib.cuStreamSynchronize.argtypes = [ctypes.c_void_p]
        lib.cuIpcCloseMemHandle.argtypes = [ctypes.c_uint64]
        lib.cuMemGetAddressRange_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_size_t),
                                                ctypes.c_uint64]
        lib.cuIpcGetMemHandle.argtypes = [ctypes.POINTER(_Handle), ctypes.c_uint64]
        _driver.append(lib if lib.cuInit(0) == 0 else None)
      except (OSError, AttributeError):
        _driver.append(None)
    return _driver[0]


def usable() -> bool:
  """True if the CUDA driver loads and initializes here."""
  return _lib() is not None


def _check(rc: int, call: str) -> None:
  if rc == 0:
    return
  lib = _lib()
  name = ctypes.c_char_p()
  if lib is not None:
    lib.cuGetErrorName(rc, ctypes.byref(name))
  raise IpcError(f"{call} failed with CUDA error {rc} ({(name.value or b'?').decode()})")


def _driver_or_raise() -> ctypes.CDLL:
  lib = _lib()
  if lib is None:
    raise IpcError("the CUDA driver (libcuda.so.1) cannot be loaded or initialized in this process")
  return lib


@contextmanager
def _in_context(device: int) -> Iterator[ctypes.CDLL]:
  """Runs the body with `device`'s primary context current, then restores
  the thread's own."""
  lib = _driver_or_raise()
  with _lock:
    ctx = _contexts.get(device)
    if ctx is None:
      dev = ctypes.c_int()
      _check(lib.cuDeviceGet(ctypes.byref(dev), device), f"cuDeviceGet({device})")
      ctx = ctypes.c_void_p()
      _check(lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
      _contexts[device] = ctx
  _check(lib.cuCtxPushCurrent_v2(ctx), "cuCtxPushCurrent")
  try:
    yield lib
  finally:
    popped = ctypes.c_void_p()
    lib.cuCtxPopCurrent_v2(ctypes.byref(popped))


def export(pointer: int, device: int) -> tuple[bytes, int]:
  """(IPC handle, offset of `pointer` in its allocation) of the CUDA
  allocation holding device address `pointer` on `device`.

  Raises:
    IpcError: no driver, or the allocation cannot be exported (memory from
      CUDA's virtual memory API or a stream-ordered pool).
  """
  with _in_context(device) as lib:
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    _check(lib.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), pointer), "cuMemGetAddressRange")
    handle = _Handle()
    _check(lib.cuIpcGetMemHandle(ctypes.byref(handle), base.value), "cuIpcGetMemHandle")
  return bytes(handle.reserved), pointer - base.value


@contextmanager
def mapped(handle: bytes, device: int) -> Iterator[int]:
  """The address in this process of the allocation `handle` names, mapped
  on `device`, while the body runs (it is not unmapped meanwhile).

  Raises:
    IpcError: the handle cannot be opened (its allocation was freed, the
      exporter exited, or it is this process's own allocation).
  """
  if len(handle) != HANDLE_BYTES:
    raise IpcError(f"an IPC handle has {HANDLE_BYTES} bytes, not {len(handle)}")
  key = (handle, device)
  with _lock:
    base = _mappings.get(key)
    if base is not None:
      _mappings.move_to_end(key)
      _busy[key] = _busy.get(key, 0) + 1
  if base is None:
    with _in_context(device) as lib:
      raw = _Handle.from_buffer_copy(handle)
      out = ctypes.c_uint64()
      _check(lib.cuIpcOpenMemHandle_v2(ctypes.byref(out), raw, _LAZY_ENABLE_PEER_ACCESS), "cuIpcOpenMemHandle")
    with _lock:
      known = _mappings.get(key)
      stale = 0
      if known is None:
        _mappings[key] = base = out.value
      else:  # another thread mapped it meanwhile: keep one mapping
        base, stale = known, out.value
      _busy[key] = _busy.get(key, 0) + 1
    if stale:
      with _in_context(device) as lib:
        lib.cuIpcCloseMemHandle(stale)
  try:
    yield base
  finally:
    with _lock:
      _busy[key] -= 1
      if not _busy[key]:
        del _busy[key]
      evict = [k for k in _mappings if k not in _busy][: max(0, len(_mappings) - _limits.IPC_MAPPINGS_KEPT)]
      closing = [(k[1], _mappings.pop(k)) for k in evict]
    for dev, address in closing:
      with _in_context(dev) as lib:
        lib.cuIpcCloseMemHandle(address)


def allocate(nbytes: int, device: int) -> int:
  """A CUDA allocation of `nbytes` (at least 1) on `device`, made with
  `cuMemAlloc` in the device's primary context: memory CUDA IPC can map,
  owned by the caller until `free`.

  Raises:
    IpcError: no driver, or the allocation failed (out of memory).
  """
  with _in_context(device) as lib:
    out = ctypes.c_uint64()
    _check(lib.cuMemAlloc_v2(ctypes.byref(out), ctypes.c_size_t(max(1, nbytes))), f"cuMemAlloc of {nbytes} bytes")
  return out.value


def free(pointer: int, device: int) -> None:
  """Frees an allocation of `allocate` once the work queued on rdt_jax's
  stream of `device` has ended."""
  with _in_context(device) as lib:
    lib.cuStreamSynchronize(_stream(lib, device))
    _check(lib.cuMemFree_v2(ctypes.c_uint64(pointer)), "cuMemFree")


def mappings() -> int:
  """How many IPC mappings this process keeps open (for tests and tools)."""
  with _lock:
    return len(_mappings)


def _stream(lib: ctypes.CDLL, device: int) -> ctypes.c_void_p:
  """rdt_jax's own non-blocking stream on `device` (context pushed)."""
  with _lock:
    stream = _streams.get(device)
    if stream is None:
      stream = ctypes.c_void_p()
      _check(lib.cuStreamCreate(ctypes.byref(stream), _STREAM_NON_BLOCKING), "cuStreamCreate")
      _streams[device] = stream
  return stream


def copy_runs(runs: Sequence[tuple[int, int, int]], device: int) -> None:
  """Copies each `(destination, source, nbytes)` between device addresses
  (any GPU of this host; both valid in this process) on a stream of
  rdt_jax's own on `device`, and returns once every copy has ended.

  The stream waits for no other work: the caller orders the copies with
  what else touches the memory (waits for the producers of the sources and
  for work queued against the destinations first).

  Raises:
    IpcError: a copy could not be queued or failed.
  """
  if not runs:
    return
  with _in_context(device) as lib:
    stream = _stream(lib, device)
    memcpy = lib.cuMemcpyDtoDAsync_v2
    try:
      for dst, src, n in runs:
        if n:
          rc = memcpy(dst, src, n, stream)
          if rc:
            _check(rc, f"cuMemcpyDtoDAsync of {n} bytes")
    finally:
      _check(lib.cuStreamSynchronize(stream), "cuStreamSynchronize")
