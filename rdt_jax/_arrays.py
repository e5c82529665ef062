"""The DLPack layer: describe, allocate and rebuild arrays of any framework.

Data flows one way through rdt_jax::

  producer leaf -> describe() -> LeafSpec + raw buffers -> (a backend moves bytes)
  -> receive buffers from allocate_*() -> rebuild() -> consumer leaf

This module is the only place that knows about jax, torch and numpy array
types. `framework_of` is the single dispatch point for array types and
`parse_device` the single one for devices. Frameworks are imported lazily: a
type can only be a `torch.Tensor` if torch is already imported, so we look in
`sys.modules` instead of importing it (as `array_api_compat` does).
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Final

import ml_dtypes
import numpy as np

from rdt_jax._metadata import (
    ChunkSpec,
    DeviceKind,
    Framework,
    LeafSpec,
    ShardingLayout,
)

if TYPE_CHECKING:
  import jax

#: Host receive buffers start on this boundary: `jnp.from_dlpack` and
#: `jax.device_put` alias (do not copy) host memory aligned to 64 bytes.
ALIGNMENT: Final = 64

# Every dtype we can move: what DLPack carries, plus bfloat16 and the float8
# family through a byte view (`ml_dtypes` gives them real numpy dtypes).
_NUMPY_NATIVE_DTYPES: Final = frozenset(
    np.dtype(n)
    for n in (
        "bool", "int8", "int16", "int32", "int64", "uint8", "uint16",
        "uint32", "uint64", "float16", "float32", "float64", "complex64",
        "complex128",
    )
)
_ML_DTYPES: Final = frozenset(
    np.dtype(getattr(ml_dtypes, n))
    for n in (
        "bfloat16", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
        "float8_e5m2fnuz", "float8_e4m3b11fnuz", "float8_e3m4",
        "float8_e4m3", "float8_e8m0fnu",
    )
    if hasattr(ml_dtypes, n)
)
SUPPORTED_DTYPES: Final = _NUMPY_NATIVE_DTYPES | _ML_DTYPES
# DLPack has no sub-byte types; jax packs them in ways that differ per backend.
SUB_BYTE_DTYPE_NAMES: Final = frozenset(
    {"int2", "uint2", "int4", "uint4", "float4_e2m1fn"}
)

# One table for devices: DLPack device type -> our device kind.
_DL_DEVICE_KIND: Final[dict[int, DeviceKind]] = {
    1: "cpu",  # kDLCPU
    2: "cuda",  # kDLCUDA
    3: "cpu",  # kDLCUDAHost (pinned host memory)
}
# jax platform names -> our device kind.
_JAX_PLATFORM_KIND: Final[dict[str, DeviceKind]] = {
    "cpu": "cpu",
    "gpu": "cuda",
    "cuda": "cuda",
}


class UnsupportedLeafError(ValueError):
  """A leaf that rdt_jax cannot send or rebuild as asked.

  The message names the leaf by its pytree path (as `jax.tree_util.keystr`
  prints it), its dtype or device, and what to do instead.

  Attributes:
    path: the offending leaf's pytree path ("" if unknown).
  """

  def __init__(self, path: str, problem: str, fix: str):
    self.path = path
    where = f"Leaf {path}" if path else "A leaf"
    super().__init__(f"{where} {problem}. {fix}")

  def __reduce__(self):
    # Crosses processes inside Ray's task errors.
    return _restore_leaf_error, (type(self), self.path, self.args[0])


def _restore_leaf_error(cls: type, path: str, message: str) -> UnsupportedLeafError:
  err = cls.__new__(cls)
  ValueError.__init__(err, message)
  err.path = path
  return err


# --------------------------------------------------------------------------
# Array types: the one dispatch point.


def _module_type(modname: str, attr: str) -> type | None:
  mod = sys.modules.get(modname)
  return getattr(mod, attr, None) if mod is not None else None


def framework_of(x: Any) -> Framework | None:
  """Returns which framework's array `x` is, or None if it is not an array.

  Never imports a framework: a value can only be a `torch.Tensor` if torch is
  already imported.
  """
  if isinstance(x, np.ndarray):
    return "numpy"
  jax_array = _module_type("jax", "Array")
  if jax_array is not None and isinstance(x, jax_array):
    return "jax"
  tensor = _module_type("torch", "Tensor")
  if tensor is not None and isinstance(x, tensor):
    return "torch"
  return None


def is_array(x: Any) -> bool:
  """True if `x` is a `jax.Array`, `torch.Tensor` or `np.ndarray`."""
  return framework_of(x) is not None


# --------------------------------------------------------------------------
# Dtypes.


def np_dtype_from_name(name: str) -> np.dtype:
  """The numpy dtype for a dtype name (`"float32"`, `"bfloat16"`, ...)."""
  try:
    return np.dtype(name)
  except TypeError:
    pass
  try:
    return np.dtype(getattr(ml_dtypes, name))
  except (AttributeError, TypeError):
    raise TypeError(f"No numpy dtype named {name!r}.") from None


def _torch_dtype(dtype: np.dtype, path: str) -> Any:
  import torch

  tdt = getattr(torch, dtype.name, None)
  if not isinstance(tdt, torch.dtype):
    raise UnsupportedLeafError(
        path,
        f"has dtype {dtype.name}, which PyTorch {torch.__version__} has no "
        "type for",
        "Receive it as jax or numpy (rdt_jax.receive_as('jax'|'numpy')) or "
        "cast it on the producer.",
    )
  return tdt


def _unsigned_view_dtype(dtype: np.dtype) -> np.dtype:
  return np.dtype(f"uint{dtype.itemsize * 8}")


def _check_dtype(dtype: np.dtype, path: str) -> np.dtype:
  if dtype in SUPPORTED_DTYPES:
    return dtype
  if dtype.name in SUB_BYTE_DTYPE_NAMES:
    raise UnsupportedLeafError(
        path,
        f"has sub-byte dtype {dtype.name}, which DLPack cannot carry",
        "Cast it to int8/uint8 (or pack it into a uint8 array) before "
        "returning it from an RDT method.",
    )
  if dtype.hasobject:
    raise UnsupportedLeafError(
        path,
        f"has dtype {dtype.name}: an object array holds Python objects, not "
        "bytes that can be moved out-of-band",
        "Convert it to a numeric dtype, or return it from a method without "
        "tensor_transport so it goes through the object store.",
    )
  raise UnsupportedLeafError(
      path,
      f"has dtype {dtype.name} ({dtype.str}), which rdt_jax cannot move",
      "Use a numeric dtype (bool, int, uint, float, complex, bfloat16 or "
      "float8).",
  )


# --------------------------------------------------------------------------
# Devices: the one parse point.


@dataclass(frozen=True)
class Device:
  """A framework-neutral device: a kind and an index."""

  kind: DeviceKind
  index: int = 0

  def __str__(self) -> str:
    return "cpu" if self.kind == "cpu" else f"{self.kind}:{self.index}"


def parse_device(device: Any) -> Device:
  """Parses a device given as a string, a `jax.Device` or a `torch.device`.

  Accepts `"cpu"`, `"cuda"`, `"cuda:1"`, `"gpu"`, `"gpu:0"`, jax devices of the
  cpu and gpu platforms, and torch devices of type cpu and cuda.

  Raises:
    ValueError: for any other device, naming it.
  """
  if isinstance(device, Device):
    return device
  if isinstance(device, str):
    kind, _, index = device.partition(":")
    kind = _JAX_PLATFORM_KIND.get(kind.lower())
    if kind is None or (index and not index.isdigit()):
      raise ValueError(
          f"Unsupported device {device!r}: rdt_jax moves arrays on 'cpu' and "
          "'cuda[:N]' (or 'gpu[:N]') devices."
      )
    return Device(kind, int(index) if index else 0)
  platform = getattr(device, "platform", None)
  if platform is not None:  # a jax.Device
    kind = _JAX_PLATFORM_KIND.get(platform)
    if kind is None:
      raise ValueError(
          f"Unsupported device {device!r} (platform {platform!r}): rdt_jax "
          "moves arrays on cpu and gpu devices."
      )
    index = device.id if kind == "cpu" else device.local_hardware_id
    return Device(kind, index or 0)
  torch_device = _module_type("torch", "device")
  if torch_device is not None and isinstance(device, torch_device):
    return parse_device(str(device))
  raise ValueError(
      f"Unsupported device {device!r}: pass a string ('cpu', 'cuda:0'), a "
      "jax.Device or a torch.device."
  )


def jax_device(device: Device) -> "jax.Device":
  """The local jax device for `device`.

  Raises:
    UnsupportedLeafError: if this process's jax has no such platform.
  """
  import jax

  platform = "cpu" if device.kind == "cpu" else "gpu"
  try:
    devices = jax.local_devices(backend=platform)
  except RuntimeError:
    raise UnsupportedLeafError(
        "",
        f"must arrive on {device}, but this process's jax has no {platform} "
        "backend",
        "Receive it as numpy or torch, or set a target device "
        "(rdt_jax.set_target_device_for_ref).",
    ) from None
  for d in devices:
    if (d.id if device.kind == "cpu" else d.local_hardware_id) == device.index:
      return d
  return devices[0]


# --------------------------------------------------------------------------
# Producer side: describe a leaf.


@dataclass(frozen=True)
class DescribedLeaf:
  """A producer-side leaf: its spec and the raw buffers behind its chunks.

  Attributes:
    spec: the metadata sent to consumers.
    pointers: the address of each chunk's first byte.
    device_indices: the device index each chunk lives on (0 for host memory).
    arrays: the framework array behind each chunk (the leaf, or a shard).
  """

  spec: LeafSpec
  pointers: tuple[int, ...]
  device_indices: tuple[int, ...]
  arrays: tuple[Any, ...] = ()

  @property
  def device(self) -> DeviceKind:
    return self.spec.device


def hold_buffer(array: Any) -> Any:
  """A reference that keeps `array`'s buffer from being reused while held.

  For a jax array this is an unconsumed DLPack capsule: while it is alive,
  XLA cannot donate the buffer (a `jit(..., donate_argnums=...)` of the array
  copies instead of writing in place), so a producer that donates an array
  after returning it cannot change what consumers read. Returns None for
  numpy and torch arrays, whose memory lives as long as the array does.
  """
  if framework_of(array) == "jax":
    return array.__dlpack__()
  return None


def describe(x: Any, path: str = "") -> DescribedLeaf:
  """Describes a leaf as raw buffers plus framework-neutral metadata.

  Validates everything a transport needs before it touches the bytes: the
  array is alive, its dtype can cross DLPack, it is contiguous, it lives on a
  cpu or cuda device. A jax array is waited on (`block_until_ready`) so its
  buffer holds the final values.

  Args:
    x: a `jax.Array`, `torch.Tensor` or `np.ndarray`.
    path: the leaf's pytree path, for error messages.

  Raises:
    UnsupportedLeafError: naming the leaf, its dtype or device, and the fix.
    TypeError: if `x` is not an array of a supported framework.
  """
  fw = framework_of(x)
  if fw == "jax":
    return _describe_jax(x, path)
  if fw == "torch":
    return _describe_torch(x, path)
  if fw == "numpy":
    return _describe_numpy(x, path)
  raise TypeError(
      f"Leaf {path or '?'} of type {type(x).__name__} is not a jax.Array, "
      "torch.Tensor or np.ndarray."
  )


def _single_chunk(
    x: Any, path: str, fw: Framework, dtype: np.dtype, device: Device, ptr: int
) -> DescribedLeaf:
  shape = tuple(int(d) for d in x.shape)
  nbytes = math.prod(shape) * dtype.itemsize
  spec = LeafSpec(
      path=path,
      shape=shape,
      dtype=dtype,
      framework=fw,
      device=device.kind,
      chunks=(ChunkSpec(shape, nbytes),),
  )
  return DescribedLeaf(spec, (ptr,), (device.index,), (x,))


def _describe_numpy(x: np.ndarray, path: str) -> DescribedLeaf:
  dtype = _check_dtype(x.dtype, path)
  if not x.flags.c_contiguous:
    raise UnsupportedLeafError(
        path,
        f"is a non-contiguous numpy array (shape {x.shape}, strides "
        f"{x.strides})",
        "Return np.ascontiguousarray(x) instead.",
    )
  return _single_chunk(x, path, "numpy", dtype, Device("cpu"), x.ctypes.data)


def _describe_torch(x: Any, path: str) -> DescribedLeaf:
  import torch

  if x.layout != torch.strided:
    raise UnsupportedLeafError(
        path,
        f"is a {x.layout} torch tensor",
        "Convert it with .to_dense() before returning it.",
    )
  name = str(x.dtype).removeprefix("torch.")
  try:
    dtype = np_dtype_from_name(name)
  except TypeError:
    raise UnsupportedLeafError(
        path,
        f"has torch dtype {name}, which has no numpy/ml_dtypes equivalent",
        "Cast it to a standard dtype before returning it.",
    ) from None
  dtype = _check_dtype(dtype, path)
  if not x.is_contiguous():
    raise UnsupportedLeafError(
        path,
        f"is a non-contiguous torch tensor (shape {tuple(x.shape)}, stride "
        f"{x.stride()})",
        "Return x.contiguous() instead.",
    )
  try:
    device = parse_device(x.device)
  except ValueError:
    raise UnsupportedLeafError(
        path,
        f"lives on torch device {x.device}, which rdt_jax cannot move",
        "Move it to 'cpu' or 'cuda' first.",
    ) from None
  if device.kind == "cuda":
    torch.cuda.synchronize(x.device)
  return _single_chunk(x, path, "torch", dtype, device, x.data_ptr())


def _describe_jax(x: Any, path: str) -> DescribedLeaf:
  from rdt_jax import _compat

  key_type = _compat.prng_key_array_type()
  if key_type is not None and isinstance(x, key_type):
    raise UnsupportedLeafError(
        path,
        "is a PRNG key array (jax.random.key), which has no DLPack form",
        "Send jax.random.key_data(key) and rebuild it with "
        "jax.random.wrap_key_data on the consumer.",
    )
  if x.is_deleted():
    raise UnsupportedLeafError(
        path,
        f"is a deleted jax.Array (dtype {x.dtype}, shape {x.shape}); it was "
        "donated or explicitly deleted",
        "Return a live array: copy it before donating it, or return it "
        "before deleting it.",
    )
  dtype = _check_dtype(np.dtype(x.dtype), path)
  if not x.is_fully_addressable:
    raise UnsupportedLeafError(
        path,
        "is a jax.Array spanning several processes (not fully addressable)",
        "Send each process's local shards from that process instead.",
    )
  devices = list(x.sharding.device_set)
  platform = devices[0].platform
  if platform not in _JAX_PLATFORM_KIND:
    raise UnsupportedLeafError(
        path,
        f"lives on jax platform {platform!r} ({devices[0]}), which rdt_jax "
        "cannot move",
        "Move it to a cpu or gpu device first (jax.device_put), or return it "
        "from a method without tensor_transport.",
    )
  x.block_until_ready()
  if len(devices) == 1:
    device = parse_device(devices[0])
    ptr = x.unsafe_buffer_pointer() if x.size else 0
    return _single_chunk(x, path, "jax", dtype, device, ptr)
  return _describe_sharded(x, path, dtype)


def _describe_sharded(x: Any, path: str, dtype: np.dtype) -> DescribedLeaf:
  import jax

  sharding = x.sharding
  if not isinstance(sharding, jax.sharding.NamedSharding):
    raise UnsupportedLeafError(
        path,
        f"is sharded with {type(sharding).__name__}; rdt_jax rebuilds "
        "NamedSharding layouts only",
        "Reshard it with jax.device_put(x, NamedSharding(mesh, spec)).",
    )
  mesh = sharding.mesh
  by_device = {s.device: s for s in x.addressable_shards}
  chunk_of_index: dict[tuple, int] = {}
  chunks: list[ChunkSpec] = []
  pointers: list[int] = []
  device_indices: list[int] = []
  arrays: list[Any] = []
  device_chunks: list[int] = []
  for d in mesh.devices.flat:
    shard = by_device[d]
    key = tuple((s.start, s.stop, s.step) for s in shard.index)
    if key not in chunk_of_index:  # replicated shards cross the wire once
      chunk_of_index[key] = len(chunks)
      data = shard.data
      shape = tuple(int(n) for n in data.shape)
      chunks.append(ChunkSpec(shape, math.prod(shape) * dtype.itemsize))
      pointers.append(data.unsafe_buffer_pointer() if data.size else 0)
      arrays.append(data)
      device_indices.append(parse_device(d).index)
    device_chunks.append(chunk_of_index[key])
  layout = ShardingLayout(
      mesh_shape=tuple(int(n) for n in mesh.devices.shape),
      axis_names=tuple(mesh.axis_names),
      spec=tuple(sharding.spec),
      device_chunks=tuple(device_chunks),
  )
  spec = LeafSpec(
      path=path,
      shape=tuple(int(n) for n in x.shape),
      dtype=dtype,
      framework="jax",
      device=_JAX_PLATFORM_KIND[mesh.devices.flat[0].platform],
      chunks=tuple(chunks),
      sharding=layout,
  )
  return DescribedLeaf(spec, tuple(pointers), tuple(device_indices), tuple(arrays))


# --------------------------------------------------------------------------
# Consumer side: allocate receive buffers.


def aligned_host_buffer(nbytes: int) -> np.ndarray:
  """A fresh uint8 host buffer of `nbytes`, starting on an `ALIGNMENT` boundary."""
  raw = np.empty(nbytes + ALIGNMENT, dtype=np.uint8)
  offset = (-raw.ctypes.data) % ALIGNMENT
  return raw[offset : offset + nbytes]


#: Host memory a process keeps for reuse between transfers, by default.
DEFAULT_POOL_BYTES: Final = 1 << 30


class HostBufferPool:
  """Reuses host buffers whose pages are already faulted in (and registered).

  A fresh buffer costs a page fault per 4 KiB page on first write: receiving
  256 MiB into fresh memory took over 10x longer here than into reused memory.
  Received leaves are zero-copy views of their buffer, so a buffer is free
  again only once no view of it is alive; the pool checks that by reference
  count when a buffer is asked for, and never hands out one still in use.

  Free buffers are kept up to `max_bytes` in total (env var
  `RDT_JAX_HOST_POOL_BYTES`, default 1 GiB; 0 disables reuse); the least
  recently used are dropped first, after telling every eviction listener (a
  backend deregisters the memory).
  """

  def __init__(self, max_bytes: int | None = None):
    import os
    import threading

    if max_bytes is None:
      max_bytes = int(os.environ.get("RDT_JAX_HOST_POOL_BYTES", DEFAULT_POOL_BYTES))
    self.max_bytes = max_bytes
    self._buffers: list[np.ndarray] = []  # aligned uint8 views, oldest first
    self._listeners: list[Callable[[int, int], None]] = []
    self._lock = threading.Lock()

  def add_eviction_listener(self, fn: Callable[[int, int], None]) -> None:
    """Calls `fn(pointer, nbytes)` for each buffer the pool stops keeping."""
    with self._lock:
      self._listeners.append(fn)

  def _free_at(self, i: int) -> bool:
    # numpy views all reference the allocation's owner (`.base`) directly, so
    # it is free when referenced only by the pooled view (plus the argument).
    return sys.getrefcount(self._buffers[i].base) <= 2

  def acquire(self, nbytes: int) -> np.ndarray:
    """A 64-byte aligned uint8 buffer of exactly `nbytes`.

    Reuses a free pooled buffer (the smallest that fits, up to 2x `nbytes`),
    else allocates a fresh one and keeps it for later. The result is a view
    of the pooled buffer, which stays in use while the view, or any array
    built on it, is alive.
    """
    with self._lock:
      best = None
      for i, buf in enumerate(self._buffers):
        del buf
        size = self._buffers[i].nbytes
        if nbytes <= size <= 2 * nbytes and self._free_at(i):
          if best is None or size < self._buffers[best].nbytes:
            best = i
      if best is not None:
        buf = self._buffers.pop(best)
        self._buffers.append(buf)  # most recently used last
        return buf[:nbytes]
      buf = aligned_host_buffer(nbytes)
      evicted = []
      if 0 < nbytes <= self.max_bytes:
        self._buffers.append(buf)
        evicted = self._evict(self.max_bytes)
      listeners = list(self._listeners)
    self._notify(evicted, listeners)
    return buf[:nbytes]

  def _evict(self, limit: int) -> list[tuple[int, int]]:
    """Drops free buffers, oldest first, until at most `limit` bytes are kept."""
    evicted = []
    total = sum(b.nbytes for b in self._buffers)
    i = 0
    while total > limit and i < len(self._buffers):
      if self._free_at(i):
        buf = self._buffers.pop(i)
        total -= buf.nbytes
        evicted.append((buf.ctypes.data, buf.nbytes))
        del buf
      else:
        i += 1
    return evicted

  @staticmethod
  def _notify(evicted: list[tuple[int, int]], listeners: list) -> None:
    for pointer, nbytes in evicted:
      for fn in listeners:
        fn(pointer, nbytes)

  def region_of(self, view: np.ndarray) -> tuple[int, int] | None:
    """`(pointer, nbytes)` of the pooled buffer `view` lies in, if any."""
    p, n = view.ctypes.data, view.nbytes
    with self._lock:
      for b in self._buffers:
        if b.ctypes.data <= p and p + n <= b.ctypes.data + b.nbytes:
          return b.ctypes.data, b.nbytes
    return None

  def clear(self) -> None:
    """Drops every free buffer (telling the listeners)."""
    with self._lock:
      evicted = self._evict(0)
      listeners = list(self._listeners)
    self._notify(evicted, listeners)

  def pooled_bytes(self) -> int:
    """Bytes the pool keeps now, in use or free."""
    with self._lock:
      return sum(b.nbytes for b in self._buffers)


#: The process's host buffer pool (receive buffers and send staging buffers).
host_pool = HostBufferPool()


def host_layout(specs: list[LeafSpec]) -> tuple[list[list[int]], int]:
  """Packs every chunk of `specs` into one host buffer.

  Returns:
    per leaf, the byte offset of each chunk; and the total buffer size. Every
    chunk starts on an `ALIGNMENT` boundary so jax can alias it.
  """
  offsets: list[list[int]] = []
  total = 0
  for spec in specs:
    leaf_offsets = []
    for chunk in spec.chunks:
      leaf_offsets.append(total)
      total += -(-chunk.nbytes // ALIGNMENT) * ALIGNMENT
    offsets.append(leaf_offsets)
  return offsets, total


def host_chunk(buffer: np.ndarray, offset: int, dtype: np.dtype, chunk: ChunkSpec) -> np.ndarray:
  """A zero-copy typed view of one chunk inside a host receive buffer."""
  return buffer[offset : offset + chunk.nbytes].view(dtype).reshape(chunk.shape)


@dataclass
class DeviceBuffer:
  """A receive buffer in device memory, owned by the framework that made it."""

  array: Any  # a torch uint8 tensor or a jax uint8 array
  pointer: int
  nbytes: int
  device: Device


def allocate_device_buffer(nbytes: int, device: Device) -> DeviceBuffer:
  """A fresh uint8 buffer of `nbytes` on a cuda device.

  Uses torch when it is importable (its allocator hands out writable memory);
  otherwise a jax array whose buffer the transport writes into before anyone
  else sees it. Untested here: this machine has no GPU.
  """
  if "torch" in sys.modules or _try_import("torch"):
    import torch

    t = torch.empty(max(nbytes, 1), dtype=torch.uint8, device=str(device))
    return DeviceBuffer(t, t.data_ptr(), nbytes, device)
  import jax.numpy as jnp

  a = jnp.zeros((max(nbytes, 1),), jnp.uint8, device=jax_device(device))
  a.block_until_ready()
  return DeviceBuffer(a, a.unsafe_buffer_pointer(), nbytes, device)


def _try_import(name: str) -> bool:
  try:
    __import__(name)
  except ImportError:
    return False
  return True


# --------------------------------------------------------------------------
# Byte views: raw memory as an array, for backends whose library takes arrays.


class _HostBytes:
  """`nbytes` of host memory at `pointer`, as numpy's array interface."""

  def __init__(self, pointer: int, nbytes: int):
    self.__array_interface__ = {
        "shape": (nbytes,), "typestr": "|u1", "data": (pointer, False), "version": 3,
    }


class _CudaBytes:
  """`nbytes` of cuda memory at `pointer`, as the CUDA Array Interface."""

  def __init__(self, pointer: int, nbytes: int):
    self.__cuda_array_interface__ = {
        "shape": (nbytes,), "typestr": "|u1", "data": (pointer, False), "version": 3,
        "strides": None,
    }


def host_bytes(pointer: int, nbytes: int) -> np.ndarray:
  """A writable 1-D uint8 numpy view of `nbytes` of host memory at `pointer`.

  Zero-copy and framework-neutral: the memory may belong to any framework's
  array. The view does not own it; the caller keeps the owner alive while the
  view is in use.
  """
  return np.asarray(_HostBytes(pointer, nbytes))


def torch_bytes(pointer: int, nbytes: int, device: Device) -> Any:
  """A 1-D `torch.uint8` tensor over `nbytes` at `pointer` on `device`.

  Zero-copy, for backends whose library takes torch tensors (Ray's GLOO and
  NCCL collective groups): host memory goes through DLPack from a
  `host_bytes` view, cuda memory through the CUDA Array Interface (untested
  here: no GPU). The tensor does not own the memory; the caller keeps the
  owner alive while the tensor is in use.
  """
  import torch

  if device.kind == "cpu":
    return torch.from_dlpack(host_bytes(pointer, nbytes))
  return torch.as_tensor(_CudaBytes(pointer, nbytes), device=str(device))


# --------------------------------------------------------------------------
# Consumer side: rebuild leaves. Conversion between frameworks lives here only.


def check_x64(dtype: np.dtype, path: str) -> None:
  """Raises if a 64-bit leaf would arrive as jax while x64 is off.

  Without this check jax would silently downcast it to 32 bits.
  """
  import jax

  if dtype.itemsize == 8 and dtype.kind in "iuf" or dtype == np.complex128:
    if not jax.config.jax_enable_x64:
      raise UnsupportedLeafError(
          path,
          f"has 64-bit dtype {dtype.name} but this process has jax_enable_x64 "
          "off, so it cannot arrive as a jax.Array without a silent downcast",
          "Call rdt_jax.receive_as('numpy') (or 'torch') in this process, or "
          "enable x64 with jax.config.update('jax_enable_x64', True).",
      )


def _host_to_jax(x: np.ndarray, path: str, device: "jax.Device | None" = None) -> Any:
  """A host numpy array as a jax.Array; zero-copy when 64-byte aligned."""
  import jax

  from rdt_jax import _compat

  check_x64(x.dtype, path)
  if device is None:
    device = jax.local_devices(backend="cpu")[0]
  # Placing host memory on the cpu backend aliases 64-byte aligned buffers for
  # every dtype, bfloat16 and float8 included, which numpy's DLPack export
  # refuses; tests/test_arrays.py checks that no copy happens.
  if device.platform == "cpu":
    return _compat.host_arrays_to_jax([x], device)[0]
  return jax.device_put(x, device)


def host_to_jax_many(views: list[np.ndarray], device: Device) -> list[Any]:
  """Host numpy arrays as jax.Arrays on the cpu `device`, zero-copy.

  The caller has checked 64-bit dtypes (`check_x64`).
  """
  from rdt_jax import _compat

  return _compat.host_arrays_to_jax(views, jax_device(device))


def _host_to_torch(x: np.ndarray, path: str) -> Any:
  import torch

  tdt = _torch_dtype(x.dtype, path)
  if x.dtype in _NUMPY_NATIVE_DTYPES:
    return torch.from_numpy(x)
  return torch.from_numpy(x.view(_unsigned_view_dtype(x.dtype))).view(tdt)


def _torch_to_host(t: Any, path: str) -> np.ndarray:
  import torch

  dtype = np_dtype_from_name(str(t.dtype).removeprefix("torch."))
  t = t.detach()
  if t.device.type != "cpu":
    t = t.cpu()
  if dtype in _NUMPY_NATIVE_DTYPES:
    return t.numpy()
  bits = getattr(torch, f"uint{dtype.itemsize * 8}")
  return t.view(bits).numpy().view(dtype)


def _jax_to_host(x: Any, path: str) -> np.ndarray:
  if x.is_deleted():
    _describe_jax(x, path)  # raises the deleted-array error
  return np.asarray(x)


def _device_to_jax(buf: Any, dtype: np.dtype, shape: tuple, path: str) -> Any:
  """A cuda receive buffer (torch or jax uint8) as a jax.Array. Untested here."""
  import jax
  import jax.numpy as jnp

  check_x64(dtype, path)
  fw = framework_of(buf)
  if fw == "torch":
    t = buf.view(_torch_dtype(dtype, path)) if dtype.itemsize else buf
    t = t[: math.prod(shape)].reshape(shape)
    if dtype in _NUMPY_NATIVE_DTYPES or dtype == np.dtype(ml_dtypes.bfloat16):
      return jnp.from_dlpack(t)
    buf = jnp.from_dlpack(buf)
  n = math.prod(shape)
  raw = buf[: n * dtype.itemsize]
  if dtype.itemsize == 1:
    return jax.lax.bitcast_convert_type(raw, dtype).reshape(shape)
  return jax.lax.bitcast_convert_type(raw.reshape(n, dtype.itemsize), dtype).reshape(shape)


def _device_to_torch(buf: Any, dtype: np.dtype, shape: tuple, path: str) -> Any:
  """A cuda receive buffer as a torch tensor. Untested here."""
  import torch

  if framework_of(buf) == "jax":
    buf = torch.from_dlpack(buf)
  tdt = _torch_dtype(dtype, path)
  return buf[: math.prod(shape) * dtype.itemsize].view(tdt).reshape(shape)


def rebuild_host(
    views: list[np.ndarray], spec: LeafSpec, framework: Framework, device: Device
) -> Any:
  """Rebuilds a leaf received into host memory as `framework`'s array type.

  Args:
    views: a typed, zero-copy numpy view of each of the leaf's chunks.
    spec: the leaf's metadata.
    framework: the array type to build.
    device: where a jax leaf should live (a cpu device).

  Zero-copy for every framework except a sharded leaf arriving as numpy or
  torch, which is assembled into one array (one copy).
  """
  if spec.sharding is not None:
    if framework == "jax":
      return _rebuild_sharded(views, spec)
    x = _assemble_host(views, spec)
  else:
    x = views[0]
  if framework == "numpy":
    return x
  if framework == "jax":
    return _host_to_jax(x, spec.path, jax_device(device))
  return _host_to_torch(x, spec.path)


def copy_into(target: Any, leaf: Any) -> None:
  """Copies `leaf`'s values into the numpy or torch array `target`."""
  if framework_of(target) == "numpy":
    np.copyto(target, convert_leaf(leaf, "numpy"))
  else:
    target.copy_(convert_leaf(leaf, "torch"))


def rebuild_device(buffers: list[DeviceBuffer], spec: LeafSpec, framework: Framework) -> Any:
  """Rebuilds a leaf received into cuda memory. Untested here (no GPU)."""
  chunk = spec.chunks[0]
  if spec.sharding is not None:
    raise UnsupportedLeafError(
        spec.path,
        "is a sharded jax.Array on cuda devices; rebuilding cuda shards is "
        "not implemented yet",
        "Gather it on the producer, or fetch it to host memory with "
        "rdt_jax.set_target_device_for_ref(ref, 'cpu').",
    )
  buf = buffers[0].array
  if framework == "jax":
    return _device_to_jax(buf, spec.dtype, chunk.shape, spec.path)
  if framework == "torch":
    return _device_to_torch(buf, spec.dtype, chunk.shape, spec.path)
  host = _torch_to_host(buf, spec.path) if framework_of(buf) == "torch" else np.asarray(buf)
  return host[: spec.nbytes].view(spec.dtype).reshape(spec.shape)


def _assemble_host(chunk_views: list[np.ndarray], spec: LeafSpec) -> np.ndarray:
  """Gathers a sharded leaf's chunks into one host array (one copy)."""
  out = np.empty(spec.shape, spec.dtype)
  for index, view in zip(_chunk_indices(spec), chunk_views):
    out[index] = view
  return out


def _chunk_indices(spec: LeafSpec) -> list[tuple[slice, ...]]:
  """The global index each chunk of a sharded leaf covers."""
  from jax.sharding import PartitionSpec

  layout = spec.sharding
  mesh_axes = dict(zip(layout.axis_names, layout.mesh_shape))
  seen: dict[int, tuple[slice, ...]] = {}
  for flat, chunk_id in enumerate(layout.device_chunks):
    if chunk_id in seen:
      continue
    coords = dict(zip(layout.axis_names, np.unravel_index(flat, layout.mesh_shape)))
    index = []
    for dim, entry in enumerate(PartitionSpec(*layout.spec)):
      size = spec.shape[dim]
      names = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
      parts, pos = 1, 0
      for name in names:
        pos = pos * mesh_axes[name] + int(coords[name])
        parts *= mesh_axes[name]
      step = size // parts
      index.append(slice(pos * step, (pos + 1) * step))
    index += [slice(None)] * (len(spec.shape) - len(index))
    seen[chunk_id] = tuple(index)
  return [seen[i] for i in range(len(spec.chunks))]


def _rebuild_sharded(chunk_views: list[np.ndarray], spec: LeafSpec) -> Any:
  """Rebuilds a sharded jax.Array with the producer's mesh shape, axis names
  and partition spec, on this process's first devices of the platform."""
  import jax

  sharding = _mesh_sharding(
      spec,
      "cpu",
      "Give the consumer at least as many devices (e.g. XLA_FLAGS="
      f"--xla_force_host_platform_device_count={spec.sharding.num_devices} in "
      "its runtime_env), or receive it as numpy (rdt_jax.receive_as('numpy')), "
      "which assembles the global array.",
  )
  layout = spec.sharding
  arrays = [
      _host_to_jax(chunk_views[chunk_id], spec.path, device)
      for device, chunk_id in zip(sharding.mesh.devices.flat, layout.device_chunks)
  ]
  return jax.make_array_from_single_device_arrays(spec.shape, sharding, arrays)


def _mesh_sharding(spec: LeafSpec, platform: str, fix: str) -> Any:
  """The producer's mesh shape, axis names and partition spec, rebuilt on this
  process's first devices of `platform` ("cpu" or "gpu").

  Raises:
    UnsupportedLeafError: if there are fewer such devices than the mesh has,
      naming both counts; `fix` says what to do.
  """
  import jax
  from jax.sharding import Mesh, NamedSharding, PartitionSpec

  layout = spec.sharding
  available = jax.local_devices(backend=platform)
  if len(available) < layout.num_devices:
    raise UnsupportedLeafError(
        spec.path,
        f"is sharded over {layout.num_devices} devices (mesh "
        f"{dict(zip(layout.axis_names, layout.mesh_shape))}) but this process "
        f"has only {len(available)} {platform} device(s)",
        fix,
    )
  devices = np.array(available[: layout.num_devices], dtype=object).reshape(layout.mesh_shape)
  return NamedSharding(Mesh(devices, layout.axis_names), PartitionSpec(*layout.spec))


def receive_sharding(spec: LeafSpec, device: Device) -> Any:
  """The `jax.sharding.Sharding` a leaf gets when a backend receives it as a
  whole `jax.Array` (as `jax_transfer` pulls it).

  A sharded leaf gets the producer's mesh shape, axis names and partition spec
  on this process's first devices of `device`'s platform; any other leaf
  lives on `device`.

  Raises:
    UnsupportedLeafError: if this process has fewer devices than the
      producer's mesh, naming both counts, or no jax backend for `device`.
  """
  import jax

  if spec.sharding is None:
    return jax.sharding.SingleDeviceSharding(jax_device(device))
  n = spec.sharding.num_devices
  fix = (
      "A whole-array backend moves each shard to its own device: give the "
      "consumer at least as many devices (e.g. XLA_FLAGS="
      f"--xla_force_host_platform_device_count={n} on cpu), or send it with "
      "jax_nixl, which can assemble it for a numpy receiver."
  )
  return _mesh_sharding(spec, "cpu" if device.kind == "cpu" else "gpu", fix)


# --------------------------------------------------------------------------
# Converting any leaf: the layer behind to_jax / to_torch / to_numpy.


def convert_leaf(x: Any, framework: Framework, path: str = "") -> Any:
  """Converts one array to `framework`'s type, zero-copy where DLPack allows.

  Non-array values are returned unchanged.
  """
  src = framework_of(x)
  if src is None or src == framework:
    if src == "jax" and x.is_deleted():
      _describe_jax(x, path)
    return x
  return _CONVERTERS[(src, framework)](x, path)


def to_jax_exact(x: Any, path: str = "") -> Any:
  """`x` as a `jax.Array` of exactly its dtype, for backends that move jax
  arrays (`jax_transfer`).

  Like `convert_leaf(x, "jax")` (zero-copy where DLPack allows), except that a
  64-bit leaf stays 64-bit even where this process has `jax_enable_x64` off:
  the array only carries the bytes to a receiver, whose own setting decides
  what it may become there.
  """
  import jax

  with jax.enable_x64(True):
    return convert_leaf(x, "jax", path)


def _jax_to_torch(x: Any, path: str) -> Any:
  import torch

  if x.is_deleted():
    _describe_jax(x, path)
  dtype = np.dtype(x.dtype)
  _torch_dtype(dtype, path)
  if len(x.sharding.device_set) > 1:
    return _host_to_torch(np.asarray(x), path)
  try:
    return torch.from_dlpack(x)
  except (BufferError, RuntimeError, TypeError):
    # float8 variants torch cannot import through DLPack: go by a byte view.
    return _host_to_torch(np.asarray(x), path)


def _torch_to_jax(t: Any, path: str) -> Any:
  import jax.numpy as jnp

  dtype = np_dtype_from_name(str(t.dtype).removeprefix("torch."))
  check_x64(dtype, path)
  t = t.detach()
  if not t.is_contiguous():
    t = t.contiguous()
  if dtype in _NUMPY_NATIVE_DTYPES or dtype == np.dtype(ml_dtypes.bfloat16):
    return jnp.from_dlpack(t)
  if t.device.type == "cpu":
    return _host_to_jax(_torch_to_host(t, path), path)
  return _device_to_jax(t.view(-1).view(__import__("torch").uint8), dtype, tuple(t.shape), path)


_CONVERTERS: Final[dict[tuple[str, str], Callable[[Any, str], Any]]] = {
    ("numpy", "jax"): _host_to_jax,
    ("numpy", "torch"): _host_to_torch,
    ("jax", "numpy"): _jax_to_host,
    ("jax", "torch"): _jax_to_torch,
    ("torch", "numpy"): _torch_to_host,
    ("torch", "jax"): _torch_to_jax,
}
