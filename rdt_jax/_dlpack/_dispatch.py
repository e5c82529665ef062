"""The one dispatch point on array types.

Everything outside the layer asks these functions about an array (its
framework, pointer, device, dtype) and to describe, rebuild or convert it;
each picks the framework module (`_numpy`, `_jax`, `_torch`, `_cupy`) with one flat
`if`/`elif` on `framework_of`, or hands a conversion between two frameworks
to `_interop`. Frameworks are never imported here: a value can only be a
`torch.Tensor` if torch is already imported.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any, Final

import numpy as np

from rdt_jax import _limits
from rdt_jax._dlpack import _cupy, _dtypes, _interop, _jax, _numpy, _sharding, _torch
from rdt_jax._dlpack._devices import Device, jax_device
from rdt_jax._dlpack._errors import UnsupportedLeafError
from rdt_jax._dlpack._lazy import loaded_type
from rdt_jax._dlpack._sharding import Box
from rdt_jax._dlpack._specs import DescribedLeaf, Framework, LeafSpec

_MODULES: Final[dict[str, ModuleType]] = {
    "numpy": _numpy, "jax": _jax, "torch": _torch, "cupy": _cupy,
}


#: framework_of's answer per type. A type is a framework's array type only
#: if that framework is imported, and a type's bases never change, so an
#: answer never goes stale; the cache is bounded by the types ever asked about.
_FRAMEWORK_OF_TYPE: dict[type, Framework | None] = {}


def framework_of(x: Any) -> Framework | None:
  """Returns which framework's array `x` is, or None if it is not an array.

  Never imports a framework.
  """
  cls = type(x)
  try:
    return _FRAMEWORK_OF_TYPE[cls]
  except KeyError:
    pass
  fw = _framework_of_type(x)
  if len(_FRAMEWORK_OF_TYPE) < 4096:
    _FRAMEWORK_OF_TYPE[cls] = fw
  return fw


def _framework_of_type(x: Any) -> Framework | None:
  if isinstance(x, np.ndarray):
    return "numpy"
  jax_array = loaded_type("jax", "Array")
  if jax_array is not None and isinstance(x, jax_array):
    return "jax"
  tensor = loaded_type("torch", "Tensor")
  if tensor is not None and isinstance(x, tensor):
    return "torch"
  cupy_array = loaded_type("cupy", "ndarray")
  if cupy_array is not None and isinstance(x, cupy_array):
    return "cupy"
  return None


def is_array(x: Any) -> bool:
  """True if `x` is a `jax.Array`, `torch.Tensor`, `np.ndarray` or `cupy.ndarray`."""
  return framework_of(x) is not None


def _module_of(x: Any, path: str = "") -> ModuleType:
  fw = framework_of(x)
  if fw is None:
    raise TypeError(
        f"Leaf {path or '?'} of type {type(x).__name__} is not a jax.Array, "
        "torch.Tensor, np.ndarray or cupy.ndarray."
    )
  return _MODULES[fw]


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
  return _module_of(x, path).describe(x, path)


def hold_buffer(x: Any) -> Any:
  """A reference that keeps `x`'s buffer from being reused while held.

  For a jax array this is an unconsumed DLPack capsule: while it is alive,
  XLA cannot donate the buffer, so a producer that donates an array after
  returning it cannot change what consumers read. Returns None for numpy and
  torch arrays, whose memory lives as long as the array does.
  """
  return _jax.hold_buffer(x) if framework_of(x) == "jax" else None


def buffer_pointer(x: Any) -> int:
  """The address of an unsharded array's first byte."""
  return int(_module_of(x).pointer(x))


def buffer_pointers(xs: list[Any]) -> list[int]:
  """`buffer_pointer` of each array of `xs` (arrays of one type: one dispatch)."""
  if xs and all(type(x) is type(xs[0]) for x in xs):
    pointer = _module_of(xs[0]).pointer
    return [pointer(x) for x in xs]
  return [int(_module_of(x).pointer(x)) for x in xs]


def device_of(x: Any) -> Device:
  """The device an array lives on (its first device, if sharded)."""
  return _module_of(x).device(x)


def dtype_of(x: Any) -> np.dtype:
  """An array's dtype as a numpy dtype (`ml_dtypes` for bfloat16, float8)."""
  return _module_of(x).dtype(x)


def is_c_contiguous(x: Any) -> bool:
  """True if a numpy or torch array's memory is C-contiguous (jax: always)."""
  fw = framework_of(x)
  return fw == "jax" or bool(_module_of(x).is_c_contiguous(x))


def is_writable(x: Any) -> bool:
  """True if bytes may be written into the array in place (never for jax)."""
  fw = framework_of(x)
  return fw != "jax" and bool(_module_of(x).is_writable(x))


def mark_written(x: Any) -> None:
  """Records that bytes were written raw into the array `x` (a receive
  target): a torch tensor's version counter is bumped, so autograd sees the
  change as it sees an in-place operation; numpy and cupy arrays keep no
  such record."""
  if framework_of(x) == "torch":
    _torch.mark_written(x)


def mark_written_many(xs: list[Any]) -> None:
  """`mark_written` of every array of `xs`, torch tensors in one call."""
  _torch.mark_written_many([x for x in xs if framework_of(x) == "torch"])


def check_x64(dtype: np.dtype, path: str) -> None:
  """Raises `UnsupportedLeafError` if a 64-bit leaf would arrive as jax
  while this process has `jax_enable_x64` off (a silent downcast)."""
  _jax.check_x64(dtype, path)


# --------------------------------------------------------------------------
# Conversion: same framework kept here, another one through `_interop`.


def convert_leaf(x: Any, framework: Framework, path: str = "") -> Any:
  """Converts one array to `framework`'s type, zero-copy where DLPack allows.

  Non-array values are returned unchanged.

  Raises:
    UnsupportedLeafError: for a deleted jax array, a dtype the target
      framework lacks, or a 64-bit leaf becoming jax while x64 is off.
  """
  src = framework_of(x)
  if src is None:
    return x
  if src == framework:
    if src == "jax":
      _jax.check_alive(x, path)
    return x
  return _interop.convert(x, src, framework, path)


def to_jax_exact(x: Any, path: str = "", own: bool = False) -> Any:
  """`x` as a `jax.Array` of exactly its dtype, for backends that move jax
  arrays (`jax_transfer`).

  Like `convert_leaf(x, "jax")` (zero-copy where DLPack allows), except that a
  64-bit leaf stays 64-bit even where this process has `jax_enable_x64` off:
  the array only carries the bytes to a receiver, whose own setting decides
  what it may become there.

  With `own`, a numpy or torch leaf never shares memory with the result: it
  is copied whenever the conversion was zero-copy (which depends on the
  buffer's alignment), so later writes into `x` never reach the result: the
  copy has finished when this returns (jax's copy is asynchronous).
  """
  import jax

  with jax.enable_x64(True):
    out = convert_leaf(x, "jax", path)
    fw = framework_of(x)
    if own and fw in ("numpy", "torch") and out.size and _jax.pointer(out) == buffer_pointer(x):
      out = out.copy()
      out.block_until_ready()
    return out


def block_until_ready(leaves: list[Any]) -> None:
  """Waits for the computations producing the jax arrays among `leaves`
  (each array's own, not the device's); other leaves are ready as they are."""
  arrays = [x for x in leaves if framework_of(x) == "jax"]
  if arrays:
    import jax

    jax.block_until_ready(arrays)


def copy_values(pairs: list[tuple[Any, Any]]) -> None:
  """Copies each `(target, leaf)`'s values into the numpy, torch or cupy
  array `target`, the leaf converted to the target's framework.

  Queued on the current stream of a CUDA target, in no order with the
  device's other streams: callers go through `rdt_jax._memory.copy_into_many`,
  which waits for every stream of each target's device before and after.
  """
  for target, leaf in pairs:
    fw = framework_of(target)
    if fw == "numpy":
      _numpy.copy_into(target, convert_leaf(leaf, "numpy"))
    elif fw == "cupy":
      _cupy.copy_into(target, convert_leaf(leaf, "cupy"))
    else:
      _torch.copy_into(target, convert_leaf(leaf, "torch"))


def region_writer(into: Any, axis: int, start: int, n: int, source: np.dtype, perm: tuple[int, ...] | None,
                  shape: tuple[int, ...] | None, box: Box | None, path: str) -> Callable[..., None]:
  """A function `write(v, row=None)` that writes a host array of dtype
  `source` into the numpy, torch or cupy array `into`: transposed by
  `perm`, reshaped to `shape`, cut to `box` (each optional, in that order)
  and cast to `into`'s dtype, into the `n` indices of `into` from `start`
  on `axis` (a fused tensor's part; all of every other axis; all of a 0-d
  array). Made once per plan: the region, the framework and the copy are
  chosen here, not per call.

  With `row`, `v` is rows `row` to `row + len(v)` of the source's first
  axis only (a leaf read in parts, `chunkable`): the part of the result they
  make is written, the rest of the region is left as it is.

  A torch region is written outside autograd (a parameter that requires grad
  changes like any tensor). Host regions up to `_limits.MAP_NUMPY_COPY_BYTES`
  are written by numpy (the faster copy of a small transposed array here),
  larger ones by torch (multi-threaded). Writes into CUDA memory are queued
  on the current stream; callers wait as `copy_values` says.
  """
  fw = framework_of(into)
  if getattr(into, "ndim", 0) == 0:
    region = into.detach() if fw == "torch" else into
  elif fw == "torch":
    region = into.detach().narrow(axis, start, n)
  else:
    region = into[(slice(None),) * axis + (slice(start, start + n),)]
  nbytes = int(np.prod(region.shape)) * dtype_of(region).itemsize
  small = nbytes <= _limits.MAP_NUMPY_COPY_BYTES and device_of(region).kind == "cpu"
  if fw == "torch" and small and source in _dtypes.NUMPY_NATIVE_DTYPES and dtype_of(region) in (
      _dtypes.NUMPY_NATIVE_DTYPES):
    region, fw = region.numpy(), "numpy"
  rows = _rows(perm, shape, box, len(region.shape))
  if fw == "torch":
    return _torch.region_writer(region, source, perm, shape, box, rows, path)
  cut = None if box is None else tuple(slice(a, b) for a, b in box)
  out_shape = tuple(region.shape)

  def transformed(v: np.ndarray) -> np.ndarray:
    if perm is not None:
      v = v.transpose(perm)
    if shape is not None:
      v = v.reshape(shape)
    if cut is not None:
      v = v[cut]
    return v.reshape(out_shape)

  if fw == "numpy":
    def to_numpy(v: np.ndarray, row: int | None = None) -> None:
      if row is None:
        np.copyto(region, transformed(v), casting="unsafe")
        return
      part = rows.part(row, len(v)) if rows is not None else None
      if part is not None:
        src, index, dst = part
        rows_in = v[src] if perm is None else v[src].transpose(perm)
        np.copyto(region[dst], rows_in[index], casting="unsafe")

    return to_numpy
  target = dtype_of(region)

  def to_cupy(v: np.ndarray, row: int | None = None) -> None:
    if row is not None:
      raise ValueError(f"{path}: a cupy tensor takes a leaf whole")
    region[...] = convert_leaf(np.ascontiguousarray(transformed(v).astype(target, copy=False)), "cupy")

  return to_cupy


class _RowParts:
  """Where rows of a source leaf land in a region: source axis 0 is the
  result's axis `q` after the transpose, cut there to `lo`..`hi`."""

  def __init__(self, q: int, lo: int, hi: int, cut: tuple[slice, ...]):
    self.q, self.lo, self.hi, self.cut = q, lo, hi, cut

  def part(self, row: int, count: int) -> tuple[slice, tuple[slice, ...], tuple[slice, ...]] | None:
    """(rows of the part to take, the index to cut its transpose with, the
    region's index it lands at), or None where the rows fall outside the cut."""
    a, b = max(row, self.lo), min(row + count, self.hi)
    if a >= b:
      return None
    index = (*self.cut[: self.q], slice(None), *self.cut[self.q + 1 :])
    dst = (slice(None),) * self.q + (slice(a - self.lo, b - self.lo),)
    return slice(a - row, b - row), index, dst


def _rows(perm: tuple[int, ...] | None, shape: tuple[int, ...] | None, box: Box | None, ndim: int) -> _RowParts | None:
  """How rows of the source land (None where a reshape mixes them: the leaf
  must come whole)."""
  if shape is not None or ndim == 0:
    return None
  q = 0 if perm is None else perm.index(0)
  cut = tuple(slice(None) for _ in range(ndim)) if box is None else tuple(slice(a, b) for a, b in box)
  lo, hi = (0, 1 << 62) if box is None else box[q]
  return _RowParts(q, lo, hi, cut)


def chunkable(perm: tuple[int, ...] | None, shape: tuple[int, ...] | None, framework: str) -> bool:
  """Whether a leaf written by `region_writer` with this transform may
  arrive in parts of rows (no reshape; not into cupy)."""
  return shape is None and framework != "cupy"


# --------------------------------------------------------------------------
# Rebuilding received leaves.


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
      return _sharding.rebuild_sharded(views, spec)
    x = _sharding.assemble_host(views, spec)
  else:
    x = views[0]
  return rebuild_view(x, framework, device, spec.path)


def rebuild_view(x: np.ndarray, framework: Framework, device: Device, path: str) -> Any:
  """One typed host view as `framework`'s array, zero-copy (jax on the cpu
  `device`; the view must be 64-byte aligned for jax to alias it)."""
  if framework == "numpy":
    return x
  if framework == "jax":
    return _jax.from_host(x, path, jax_device(device, path))
  return _torch.from_host(x, path)


def host_to_jax_many(views: list[np.ndarray], device: Device) -> list[Any]:
  """Host numpy arrays as jax.Arrays on the cpu `device`, zero-copy, in one
  call. The caller has checked 64-bit dtypes (`check_x64`)."""
  return _jax.from_host_many(views, device)


def rebuild_device(views: list[Any], spec: LeafSpec, framework: Framework) -> Any:
  """Rebuilds a leaf received into device memory as `framework`'s array type.

  Args:
    views: a uint8 byte view of each of the leaf's chunks inside its received
      region (torch tensors, or jax arrays in a process without torch).
    spec: the leaf's metadata.
    framework: the array type to build; "jax", "torch" and "cupy" stay on the
      device (zero-copy from torch views), "numpy" is copied to the host
      (the consumer asked for host arrays).

  Raises:
    UnsupportedLeafError: for a sharded leaf (rebuilding shards on cuda
      devices is not implemented), for a dtype the target framework lacks,
      or a 64-bit leaf arriving as jax while x64 is off.
  """
  if spec.sharding is not None:
    raise UnsupportedLeafError(
        spec.path,
        "is a sharded jax.Array on cuda devices; rebuilding cuda shards is not implemented yet",
        "Gather it on the producer, or fetch it to host memory with "
        "rdt_jax.set_target_device_for_ref(ref, 'cpu').",
    )
  buf = views[0]
  shape = spec.chunks[0].shape
  if framework == "jax":
    return _interop.device_bytes_to_jax(buf, spec.dtype, shape, spec.path)
  if framework == "torch":
    return _torch.from_device_bytes(buf, spec.dtype, shape, spec.path)
  if framework == "cupy":
    return _cupy.from_device_bytes(buf, spec.dtype, shape, spec.path)
  raw = _torch.to_host(buf, spec.path) if framework_of(buf) == "torch" else np.asarray(buf)
  return raw[: spec.nbytes].view(spec.dtype).reshape(spec.shape)
