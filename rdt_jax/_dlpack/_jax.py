"""jax arrays: describe (sharded ones too), hold against donation, export,
rebuild from host or device buffers.

Knows jax and numpy (the layer's host buffer type) only; conversions from and
to other frameworks are in `_interop`.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from rdt_jax import _compat, _limits
from rdt_jax._dlpack._devices import PLATFORM_KIND, Device, jax_device, parse_device
from rdt_jax._dlpack._dtypes import check_dtype, is_64_bit
from rdt_jax._dlpack._errors import UnsupportedLeafError
from rdt_jax._dlpack._specs import ChunkSpec, DescribedLeaf, LeafSpec, ShardingLayout, single_chunk

if TYPE_CHECKING:
  import jax


def check_alive(x: Any, path: str) -> None:
  """Raises if `x` was deleted or donated (before DLPack is touched, whose
  own error does not say so)."""
  if x.is_deleted():
    raise UnsupportedLeafError(
        path,
        f"is a deleted jax.Array (dtype {x.dtype}, shape {x.shape}); it was "
        "donated or explicitly deleted",
        "Return a live array: copy it before donating it, or return it "
        "before deleting it.",
    )


def is_prng_key(x: Any) -> bool:
  """True if `x` is a typed PRNG key array (`jax.random.key`, `nnx.Rngs` state)."""
  key_type = _compat.prng_key_array_type()
  return key_type is not None and isinstance(x, key_type)


def prng_key_parts(key: Any) -> tuple[Any, str]:
  """A typed key array as (its raw `jax.random.key_data`, its implementation's
  name), which `wrap_prng_key` turns back into the same key. The data has
  the key's sharding and shape plus the implementation's trailing axes."""
  import jax

  return jax.random.key_data(key), str(jax.random.key_impl(key))


def wrap_prng_key(data: Any, impl: str) -> Any:
  """The typed key array of implementation `impl` over raw key `data` (a
  `jax.Array` of `uint32`, as `prng_key_parts` gives), zero-copy."""
  import jax

  return jax.random.wrap_key_data(data, impl=impl)


#: jax devices of this process that single-device leaves were described on.
_LOCAL_DEVICES: dict[Any, Device] = {}


def describe(x: Any, path: str) -> DescribedLeaf:
  """A jax leaf as one chunk, or one chunk per distinct shard.

  Waits for the array (`block_until_ready`) so its buffer holds the final
  values.

  Raises:
    UnsupportedLeafError: for a PRNG key array, a deleted array, a dtype
      rdt_jax cannot move, an array spanning processes or an unsupported
      platform, a non-default layout or memory kind (`check_placement`),
      naming the leaf and the fix.
  """
  if is_prng_key(x):
    raise UnsupportedLeafError(
        path,
        "is a PRNG key array (jax.random.key), which has no DLPack form",
        "Describe its raw data instead (prng_key_parts; rdt_jax transports do "
        "so for every key in a value, and wrap_prng_key rebuilds it).",
    )
  check_alive(x, path)
  dtype = check_dtype(np.dtype(x.dtype), path)
  devices_set = x.sharding.device_set
  if len(devices_set) == 1:
    # Fast path: a leaf on one device this process has seen before (checks
    # done once per device, not per leaf: they dominate objects of many
    # leaves). On a cpu every memory kind is host memory: only the layout
    # is checked (`placement_problem`).
    known = _LOCAL_DEVICES.get(next(iter(devices_set)))
    if known is not None:
      _raise_placement(_layout_problem(x) if known.kind == "cpu" else placement_problem(x), path)
      x.block_until_ready()
      shape = x.shape
      address = 0 if 0 in shape else int(x.unsafe_buffer_pointer())
      return single_chunk(shape, path, "jax", dtype, known.kind, known.index, address, x)
  check_placement(x, path)
  if not x.is_fully_addressable:
    raise UnsupportedLeafError(
        path,
        "is a jax.Array spanning several processes (not fully addressable)",
        "Send each process's local shards from that process instead.",
    )
  devices = list(x.sharding.device_set)
  platform = devices[0].platform
  if platform not in PLATFORM_KIND:
    raise UnsupportedLeafError(
        path,
        f"lives on jax platform {platform!r} ({devices[0]}), which rdt_jax cannot move",
        "Move it to a cpu or gpu device first (jax.device_put), or return it "
        "from a method without tensor_transport.",
    )
  x.block_until_ready()
  if len(devices) > 1:
    return _describe_sharded(x, path, dtype)
  dev = parse_device(devices[0])
  _LOCAL_DEVICES[devices[0]] = dev  # addressable, on a supported platform
  shape = tuple(int(d) for d in x.shape)
  return single_chunk(shape, path, "jax", dtype, dev.kind, dev.index, pointer(x), x)


class PackKind(NamedTuple):
  """What every packable leaf of one (device, shape, dtype) shares.

  Attributes:
    dtype: the numpy dtype.
    chunks: the leaf's one chunk (`single_chunk`'s, shared).
    device_index: the cpu device's index.
  """

  dtype: np.dtype
  chunks: tuple[ChunkSpec, ...]
  device_index: int


def packed_spec(path: str, kind: PackKind) -> LeafSpec:
  """The spec of a packed leaf of `kind` at pytree path `path`."""
  chunks = kind.chunks
  return tuple.__new__(LeafSpec, (path, chunks[0].shape, kind.dtype, "jax", "cpu", chunks, None))


#: (sharding key, shape, dtype, max bytes) -> its `PackKind` and the buffer
#: layout (jaxlib's `PjRtLayout`, or None) of a row-major array of it, or None
#: where such a leaf is never packable; bounded by `_limits.PACK_KINDS_MAX`.
_PACK_KINDS: dict[tuple[Any, ...], tuple[PackKind, Any] | None] = {}


def packable(x: Any, max_nbytes: int) -> tuple[PackKind, int] | None:
  """`(kind, address)` if jax array `x` may travel packed with other leaves
  in one host buffer (a copy taken at return), where `address` is its
  buffer's first byte (0 if empty); None if it must travel as a leaf of its
  own (where `describe` says what is wrong with it, if anything).

  Packable: a live, unsharded `jax.Array` (not a PRNG key) on one cpu device
  this process can address, in the default layout, of a dtype rdt_jax moves,
  of at most `max_nbytes` bytes. The checks are made once per device, shape
  and dtype (`PackKind`); per leaf only whether it is deleted, its buffer's
  layout (compared with the kind's row-major one) and its address are read.
  Does not wait for the array: the caller waits for every packed leaf at once
  (`block_until_ready`) before copying.
  """
  if x.is_deleted():  # deleted or donated: `describe` says so (and a deleted
    return None  # array's buffer layout must not be read: it crashes jaxlib 0.10)
  key = (_compat.sharding_key(x.sharding), x.shape, x.dtype, max_nbytes)
  try:
    found = _PACK_KINDS[key]
  except KeyError:
    found = _pack_kind(x, max_nbytes)
    if len(_PACK_KINDS) < _limits.PACK_KINDS_MAX:
      _PACK_KINDS[key] = found
  if found is None:
    return None
  kind, row_major = found
  # Per leaf: one layout compared with the kind's row-major one (or checked in full).
  if (row_major is None or getattr(x, "_pjrt_layout", None) != row_major) and _layout_problem(x) is not None:
    return None
  return kind, (int(x.unsafe_buffer_pointer()) if kind.chunks[0].nbytes else 0)


def _pack_kind(x: Any, max_nbytes: int) -> tuple[PackKind, Any] | None:
  """The `PackKind` of `x`'s device, shape and dtype, with the buffer layout
  of a row-major array of it (None if the backend reports none, or `x` is
  not row-major); None if leaves like it are never packable (not on one
  addressable cpu device, a dtype rdt_jax does not move, or more than
  `max_nbytes` bytes)."""
  devices = x.sharding.device_set
  if len(devices) != 1 or not x.is_fully_addressable:
    return None
  device = next(iter(devices))
  if device.platform != "cpu":
    return None
  try:
    dtype = check_dtype(np.dtype(x.dtype), "")
  except (UnsupportedLeafError, TypeError):
    return None
  shape = tuple(int(d) for d in x.shape)
  if math.prod(shape) * dtype.itemsize > max_nbytes:
    return None
  known = _LOCAL_DEVICES.setdefault(device, parse_device(device))
  chunks = single_chunk(shape, "", "jax", dtype, "cpu", known.index, 0, None).spec.chunks
  row_major = getattr(x, "_pjrt_layout", None) if _layout_problem(x) is None else None
  return PackKind(dtype, chunks, known.index), row_major


def placement_problem(x: Any) -> str | None:
  """What keeps `x`'s buffers from being sent as plain row-major bytes of its
  device kind, or None.

  Two things are refused:

  * a layout other than row-major without tiles (`jax.device_put(x,
    Format(Layout(...), ...))` or a jit's `out_shardings=Format(...)`): the
    buffer's bytes are in another order than the shape says;
  * on a gpu, a memory kind other than the device's default (`pinned_host`,
    `unpinned_host`): the bytes are in host memory while the array's device
    says cuda. On a cpu every memory kind is host memory, so any is sent as is.

  Reads `x.format.layout`, `x.sharding.memory_kind` and the devices'
  `platform` and `default_memory()`. `x.format` costs about 5 us per leaf,
  so a layout once found row-major is remembered per shape and dtype, and
  later arrays whose buffer layout equals it skip that call (`_row_major`).
  """
  problem = _layout_problem(x)
  if problem is not None:
    return problem
  kind = x.sharding.memory_kind
  device = next(iter(x.sharding.device_set))
  if kind is None or device.platform == "cpu" or kind == device.default_memory().kind:
    return None
  return (
      f"lives in memory kind {kind!r} of {device.platform} device {device} (its default is "
      f"{device.default_memory().kind!r})"
  )


#: (shape, dtype) -> the buffer layout (jaxlib's `PjRtLayout`) an array of
#: that shape and dtype was found to have in row-major order; bounded.
_ROW_MAJOR: dict[tuple[Any, Any], Any] = {}


def _layout_problem(x: Any) -> str | None:
  """Why `x`'s buffer is not plain row-major bytes, or None (see `placement_problem`)."""
  buffer_layout = getattr(x, "_pjrt_layout", None)  # cheap; compared, never interpreted
  if buffer_layout is not None:
    known = _ROW_MAJOR.get((x.shape, x.dtype))
    if known is not None and buffer_layout == known:
      return None
  layout = x.format.layout  # None where the backend keeps no layout (its default)
  row_major = tuple(range(len(x.shape)))
  order = row_major if layout is None else tuple(layout.major_to_minor)
  tiling = () if layout is None else tuple(layout.tiling or ())
  if order != row_major or tiling:
    return (
        f"has a non-default layout (major_to_minor={order}, tiling={tiling}; row-major is "
        f"major_to_minor={row_major} without tiles)"
    )
  if buffer_layout is not None and len(_ROW_MAJOR) < _limits.JAX_ROW_MAJOR_MAX:
    _ROW_MAJOR[(x.shape, x.dtype)] = buffer_layout
  return None


def check_placement(x: Any, path: str) -> None:
  """Raises if `x` cannot be sent as plain row-major bytes (`placement_problem`).

  Raises:
    UnsupportedLeafError: naming the leaf, the layout or memory kind found and
      how to move it to the default one.
  """
  _raise_placement(placement_problem(x), path)


def _raise_placement(problem: str | None, path: str) -> None:
  """Raises `check_placement`'s error for `problem` (nothing for None)."""
  if problem is not None:
    raise UnsupportedLeafError(
        path, problem,
        "Return it in the default layout and memory kind: x.copy() for a layout, "
        "jax.device_put(x, x.sharding.with_memory_kind(device.default_memory().kind)) for a "
        "memory kind.",
    )


def _describe_sharded(x: Any, path: str, dtype: np.dtype) -> DescribedLeaf:
  """A `NamedSharding`-sharded array as one chunk per distinct shard.

  Replicated shards cross the wire once: every device holding the same index
  range maps to one chunk (`ShardingLayout.device_chunks`).

  Raises:
    UnsupportedLeafError: for any other kind of sharding.
  """
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
  boxes: list[tuple[tuple[int, int], ...]] = []
  global_shape = tuple(int(n) for n in x.shape)
  for d in mesh.devices.flat:
    shard = by_device[d]
    key = tuple((s.start, s.stop, s.step) for s in shard.index)
    if key not in chunk_of_index:  # replicated shards cross the wire once
      chunk_of_index[key] = len(chunks)
      data = shard.data
      shape = tuple(int(n) for n in data.shape)
      chunks.append(ChunkSpec(shape, math.prod(shape) * dtype.itemsize))
      boxes.append(tuple(s.indices(n)[:2] for s, n in zip(shard.index, global_shape)))
      pointers.append(pointer(data))
      arrays.append(data)
      device_indices.append(parse_device(d).index)
    device_chunks.append(chunk_of_index[key])
  layout = ShardingLayout(
      mesh_shape=tuple(int(n) for n in mesh.devices.shape),
      axis_names=tuple(mesh.axis_names),
      spec=tuple(sharding.spec),
      device_chunks=tuple(device_chunks),
      boxes=tuple(boxes),
  )
  spec = LeafSpec(
      path=path,
      shape=global_shape,
      dtype=dtype,
      framework="jax",
      device=PLATFORM_KIND[mesh.devices.flat[0].platform],
      chunks=tuple(chunks),
      sharding=layout,
  )
  return DescribedLeaf(spec, tuple(pointers), tuple(device_indices), tuple(arrays))


def pointer(x: Any) -> int:
  """The address of a single-device array's buffer (0 when empty)."""
  return int(x.unsafe_buffer_pointer()) if x.size else 0


def device(x: Any) -> Device:
  """The device of `x` (its first, for a sharded array)."""
  return parse_device(next(iter(x.sharding.device_set)))


def dtype(x: Any) -> np.dtype:
  return np.dtype(x.dtype)


def hold_buffer(x: Any) -> Any:
  """An unconsumed DLPack capsule of `x`: while it is alive, XLA cannot donate
  the buffer (a `jit(..., donate_argnums=...)` of the array copies instead of
  writing in place)."""
  return x.__dlpack__()


def check_x64(dtype: np.dtype, path: str) -> None:
  """Raises if a 64-bit leaf would arrive as jax while x64 is off.

  Without this check jax would silently downcast it to 32 bits.

  Raises:
    UnsupportedLeafError: naming the leaf and dtype, suggesting
      `receive_as('numpy')` or enabling x64.
  """
  import jax

  if is_64_bit(dtype) and not jax.config.jax_enable_x64:  # type: ignore[attr-defined]
    raise UnsupportedLeafError(
        path,
        f"has 64-bit dtype {dtype.name} but this process has jax_enable_x64 "
        "off, so it cannot arrive as a jax.Array without a silent downcast",
        "Call rdt_jax.receive_as('numpy') (or 'torch') in this process, or "
        "enable x64 with jax.config.update('jax_enable_x64', True).",
    )


def from_host(x: np.ndarray, path: str, device: jax.Device | None = None) -> Any:
  """A host numpy array as a jax.Array; zero-copy when 64-byte aligned on a
  cpu device, otherwise a copy that has finished when this returns (`x` may
  be written or reused at once)."""
  import jax

  check_x64(x.dtype, path)
  if device is None:
    device = jax.local_devices(backend="cpu")[0]
  # Placing host memory on the cpu backend aliases 64-byte aligned buffers for
  # every dtype, bfloat16 and float8 included, which numpy's DLPack export
  # refuses; tests/test_dlpack.py checks that no copy happens.
  if device.platform == "cpu":
    return _compat.host_arrays_to_jax([x], device)[0]
  return _compat.settled(jax.device_put(x, device))


def from_host_many(views: list[np.ndarray], device: Device) -> list[Any]:
  """Host numpy arrays as jax.Arrays on the cpu `device`, zero-copy, in one
  call (jax's per-array overhead dominates objects of many small leaves).

  The caller has checked 64-bit dtypes (`check_x64`).
  """
  return _compat.host_arrays_to_jax(views, jax_device(device))


def to_host(x: Any, path: str) -> np.ndarray:
  check_alive(x, path)
  return np.asarray(x)


def from_device_bytes(buf: Any, dtype: np.dtype, shape: tuple[int, ...], path: str) -> Any:
  """A leaf's bytes in a uint8 jax array as a jax.Array on the same device.

  Args:
    buf: a uint8 jax array of at least the leaf's bytes (a received region
      of a process without torch, or a byte view `_interop` imported).
    dtype, shape: the leaf's.

  A bitcast on the device (one device copy, never through the host). An
  empty leaf is made fresh (no bytes to alias).

  Raises:
    UnsupportedLeafError: for a 64-bit leaf while x64 is off.
  """
  import jax
  import jax.numpy as jnp

  check_x64(dtype, path)
  n = math.prod(shape)
  if n == 0:
    return jnp.zeros(shape, dtype, device=next(iter(buf.sharding.device_set)))
  raw = buf[: n * dtype.itemsize]
  if dtype.itemsize > 1:
    raw = raw.reshape(n, dtype.itemsize)
  return jax.lax.bitcast_convert_type(raw, dtype).reshape(shape)


def zeros(shape: tuple[int, ...], dtype: np.dtype, device: Device) -> Any:
  """A fresh zero-filled jax.Array on `device`."""
  import jax.numpy as jnp

  return jnp.zeros(shape, dtype, device=jax_device(device))


def bytes_of(x: Any) -> Any:
  """A single-device array's values as a flat uint8 jax array on its device
  (a bitcast: one device copy)."""
  import jax
  import jax.numpy as jnp

  raw = jax.lax.bitcast_convert_type(x.reshape(-1), jnp.uint8)
  return raw.reshape(-1)


def from_dlpack(x: Any) -> Any:
  """`jnp.from_dlpack(x)`: a jax.Array aliasing any DLPack producer's memory.

  The caller checks the dtype against x64 (`check_x64`) first.
  """
  import jax.numpy as jnp

  return jnp.from_dlpack(x)


def from_dlpack_exact(x: Any, path: str) -> Any:
  """A DLPack producer whose `dtype` is a numpy dtype (a cupy array) as a
  jax.Array on its device, zero-copy.

  Raises:
    UnsupportedLeafError: for a 64-bit leaf while x64 is off.
  """
  check_x64(np.dtype(x.dtype), path)
  return from_dlpack(x)


def empty_bytes(nbytes: int, device: Device) -> tuple[Any, int]:
  """A uint8 jax array of `nbytes` on `device` and its address, made by
  XLA's allocator (inside its preallocated pool on a GPU) and ready (its
  zero fill finished) before any transfer writes it."""
  import jax.numpy as jnp

  a = jnp.zeros((nbytes,), jnp.uint8, device=jax_device(device))
  a.block_until_ready()
  return a, int(a.unsafe_buffer_pointer())
