"""Sharded `jax.Array`s: the box each chunk covers, the consistency checks
of leaf specs from another process (`spec_problem`), and the producer's
layout rebuilt on receive.

Describing a sharded array (one chunk per distinct shard) is `_jax`'s;
resharding on receive (slices, target layouts, byte runs between boxes) is
`rdt_jax._layout`'s, built on the boxes here.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from rdt_jax import _limits
from rdt_jax._dlpack import _jax
from rdt_jax._dlpack._devices import Device, jax_device, jax_platform
from rdt_jax._dlpack._errors import UnsupportedLeafError
from rdt_jax._dlpack._lazy import loaded_type
from rdt_jax._dlpack._specs import ChunkSpec, LeafSpec, ShardingLayout


def spec_problem(spec: object) -> tuple[str, str] | None:
  """What is wrong with a `LeafSpec` that came from another process, as
  `(field, problem)`, or None if it is consistent.

  Checks types and internal consistency only (no framework imported): every
  shape a tuple of non-negative ints, a known framework and device kind, a
  numeric dtype, each chunk's `nbytes` equal to its shape's size, one chunk
  of the leaf's shape for an unsharded leaf, and for a sharded one a layout
  whose chunk boxes lie in the leaf, match their chunk's shape, do not
  overlap, cover the leaf, and agree with the mesh and partition spec
  (`layout_problem`).
  """
  if type(spec) is not LeafSpec:
    return "leaf", f"is a {type(spec).__name__}, not a LeafSpec"
  if not isinstance(spec.path, str):
    return "path", f"is a {type(spec.path).__name__}, not a str"
  problem = _shape_problem(spec.shape)
  if problem:
    return "shape", problem
  dtype = spec.dtype
  if not isinstance(dtype, np.dtype) or dtype.hasobject or dtype.itemsize == 0:
    return "dtype", f"is {dtype!r}, not a numeric numpy dtype"
  if spec.framework not in ("jax", "torch", "numpy", "cupy"):
    return "framework", f"is {spec.framework!r}"
  if spec.device not in ("cpu", "cuda"):
    return "device", f"is {spec.device!r}, not 'cpu' or 'cuda'"
  chunks = spec.chunks
  if type(chunks) is not tuple or not chunks:
    return "chunks", f"is {type(chunks).__name__} of {_length(chunks)}, not a non-empty tuple"
  for i, chunk in enumerate(chunks):
    if type(chunk) is not ChunkSpec:
      return f"chunks[{i}]", f"is a {type(chunk).__name__}, not a ChunkSpec"
    problem = _shape_problem(chunk.shape)
    if problem:
      return f"chunks[{i}].shape", problem
    want = math.prod(chunk.shape) * dtype.itemsize
    if type(chunk.nbytes) is not int or chunk.nbytes != want:
      return f"chunks[{i}].nbytes", (
          f"is {chunk.nbytes!r} but shape {chunk.shape} of {dtype.name} holds {want} bytes"
      )
  if spec.sharding is None:
    if len(chunks) != 1 or chunks[0].shape != spec.shape:
      return "chunks", (
          f"are {[c.shape for c in chunks]} for an unsharded leaf of shape {spec.shape} "
          "(one chunk of the leaf's shape expected)"
      )
    return None
  if type(spec.sharding) is not ShardingLayout:
    return "sharding", f"is a {type(spec.sharding).__name__}, not a ShardingLayout"
  return layout_problem(spec)


def _shape_problem(shape: object) -> str | None:
  if type(shape) is not tuple:
    return f"is a {type(shape).__name__}, not a tuple"
  if len(shape) > _limits.SHARDING_MAX_NDIM:
    return f"has {len(shape)} axes (at most {_limits.SHARDING_MAX_NDIM})"
  if not all(type(n) is int and n >= 0 for n in shape):
    return f"is {shape!r}, not non-negative ints"
  if math.prod(shape) >= _limits.SHARDING_MAX_ELEMENTS:
    return f"is {shape!r}, more elements than any buffer holds"
  return None


def _length(x: object) -> str:
  try:
    return f"length {len(x)}"  # type: ignore[arg-type]
  except TypeError:
    return "no length"


def derived_boxes(spec: LeafSpec) -> list[Box] | None:
  """The box each chunk of a sharded leaf covers as its mesh and partition
  spec imply it, for a spec whose partitioned axes divide the shape evenly
  (what jax's `NamedSharding` requires), or None where that does not hold:
  a spec naming an axis the mesh lacks, more entries than axes, or a size
  its parts do not divide.

  Pure Python (imports no jax): the consumer checks the boxes the producer
  sent against it, and uses it for layouts built without boxes (tests).
  """
  layout = spec.sharding
  assert layout is not None
  mesh_axes = dict(zip(layout.axis_names, layout.mesh_shape))
  entries = tuple(layout.spec)
  if len(entries) > len(spec.shape):
    return None
  seen: dict[int, Box] = {}
  for flat, chunk_id in enumerate(layout.device_chunks):
    coords = dict(zip(layout.axis_names, np.unravel_index(flat, layout.mesh_shape)))
    box = []
    for dim, size in enumerate(spec.shape):
      entry = entries[dim] if dim < len(entries) else None
      names = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
      parts, pos = 1, 0
      for name in names:
        if name not in mesh_axes:
          return None
        pos = pos * mesh_axes[name] + int(coords[name])
        parts *= mesh_axes[name]
      if size % parts:
        return None
      step = size // parts
      box.append((pos * step, (pos + 1) * step))
    if seen.setdefault(chunk_id, tuple(box)) != tuple(box):
      return None  # one chunk for two different parts of the leaf
  if sorted(seen) != list(range(len(spec.chunks))):
    return None
  return [seen[i] for i in range(len(spec.chunks))]


def layout_problem(spec: LeafSpec) -> tuple[str, str] | None:
  """What is wrong with a sharded leaf's layout (`ShardingLayout`), as
  `(field, problem)`, or None. `spec`'s shape, dtype and chunks are already
  checked (`spec_problem`).

  The layout must name a mesh of positive sizes with one axis name each,
  map every mesh position to an existing chunk (every chunk used), and send
  one box per chunk that lies in the leaf, has its chunk's shape, overlaps
  no other box, and together with the others covers the leaf; the boxes must
  be those the mesh and partition spec imply (`derived_boxes`), since the
  consumer rebuilds the leaf with that mesh and spec.
  """
  layout = spec.sharding
  assert layout is not None
  mesh, names = layout.mesh_shape, layout.axis_names
  if type(mesh) is not tuple or not mesh or not all(type(n) is int and 0 < n <= 1 << 20 for n in mesh):
    return "sharding.mesh_shape", f"is {mesh!r}, not a tuple of positive ints"
  if type(names) is not tuple or len(names) != len(mesh) or not all(isinstance(n, str) for n in names):
    return "sharding.axis_names", f"is {names!r}, not one name per mesh axis {mesh}"
  if type(layout.spec) is not tuple or not all(
      e is None or isinstance(e, str) or (type(e) is tuple and all(isinstance(n, str) for n in e))
      for e in layout.spec
  ):
    return "sharding.spec", f"is {layout.spec!r}, not a tuple of None, axis names or tuples of them"
  chunks = layout.device_chunks
  if type(chunks) is not tuple or len(chunks) != math.prod(mesh):
    return "sharding.device_chunks", f"has {_count(chunks)} entries for a mesh of {math.prod(mesh)} devices"
  if not all(type(c) is int for c in chunks) or set(chunks) != set(range(len(spec.chunks))):
    return "sharding.device_chunks", (
        f"is {chunks!r}: every entry must index one of the {len(spec.chunks)} chunks, each chunk used"
    )
  boxes = layout.boxes
  if boxes == ():
    return None if derived_boxes(spec) is not None else ("sharding.spec", f"{layout.spec!r} does not fit mesh "
                                                         f"{dict(zip(names, mesh))} and shape {spec.shape}")
  if type(boxes) is not tuple or len(boxes) != len(spec.chunks):
    return "sharding.boxes", f"has {_count(boxes)} boxes for {len(spec.chunks)} chunks"
  full = full_box(spec.shape)
  for i, (box, chunk) in enumerate(zip(boxes, spec.chunks)):
    if (
        type(box) is not tuple or len(box) != len(full)
        or not all(type(b) is tuple and len(b) == 2 and all(type(v) is int for v in b) for b in box)
    ):
      return f"sharding.boxes[{i}]", f"is {box!r}, not one (start, stop) pair of ints per axis of {spec.shape}"
    if any(not 0 <= a <= b <= n for (a, b), (_, n) in zip(box, full)):
      return f"sharding.boxes[{i}]", f"{box!r} does not lie in the leaf's shape {spec.shape}"
    if box_shape(box) != chunk.shape:
      return f"sharding.boxes[{i}]", f"{box!r} has shape {box_shape(box)} but its chunk has shape {chunk.shape}"
  for i in range(len(boxes)):
    for j in range(i):
      if intersect(boxes[i], boxes[j]) is not None:
        return f"sharding.boxes[{i}]", f"{boxes[i]!r} overlaps boxes[{j}] {boxes[j]!r}"
  if sum(math.prod(box_shape(b)) for b in boxes) != math.prod(spec.shape):
    return "sharding.boxes", f"do not cover the leaf's shape {spec.shape}"
  if derived_boxes(spec) != list(boxes):
    return "sharding.boxes", (
        f"{list(boxes)!r} are not the parts mesh {dict(zip(names, mesh))} with spec "
        f"{layout.spec!r} gives each device"
    )
  return None


def _count(x: object) -> str:
  try:
    return str(len(x))  # type: ignore[arg-type]
  except TypeError:
    return "no"


def assemble_host(chunk_views: list[np.ndarray], spec: LeafSpec) -> np.ndarray:
  """Gathers a sharded leaf's chunks into one host array (one copy)."""
  out = np.empty(spec.shape, spec.dtype)
  for box, view in zip(source_boxes(spec), chunk_views):
    out[tuple(slice(a, b) for a, b in box)] = view
  return out


def mesh_sharding(spec: LeafSpec, platform: str, fix: str) -> Any:
  """The producer's mesh shape, axis names and partition spec, rebuilt on this
  process's first devices of `platform` ("cpu" or "gpu").

  Raises:
    UnsupportedLeafError: if there are fewer such devices than the mesh has,
      naming both counts; `fix` says what to do.
  """
  import jax
  from jax.sharding import Mesh, NamedSharding, PartitionSpec

  layout = spec.sharding
  assert layout is not None
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


def rebuild_sharded(chunk_views: list[np.ndarray], spec: LeafSpec) -> Any:
  """Rebuilds a sharded jax.Array from host chunks with the producer's mesh
  shape, axis names and partition spec, on this process's first cpu devices."""
  import jax

  layout = spec.sharding
  assert layout is not None
  sharding = mesh_sharding(
      spec,
      "cpu",
      "Give the consumer at least as many devices (e.g. XLA_FLAGS="
      f"--xla_force_host_platform_device_count={layout.num_devices} in "
      "its runtime_env), ask for a sharding over this process's devices "
      "(rdt_jax.set_target_for_ref with a jax.sharding.Sharding leaf, which "
      "reshards on receive), or receive it as numpy (rdt_jax.receive_as('numpy')), "
      "which assembles the global array.",
  )
  arrays = [
      _jax.from_host(chunk_views[chunk_id], spec.path, device)
      for device, chunk_id in zip(sharding.mesh.devices.flat, layout.device_chunks)
  ]
  return jax.make_array_from_single_device_arrays(spec.shape, sharding, arrays)


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
  return mesh_sharding(spec, jax_platform(device.kind), fix)


def is_sharding(x: Any) -> bool:
  """True if `x` is a `jax.sharding.Sharding` (never imports jax)."""
  sharding = loaded_type("jax.sharding", "Sharding")
  return sharding is not None and isinstance(x, sharding)


# --------------------------------------------------------------------------
# Boxes: which part of a leaf each chunk holds.
#
# A box is one half-open (start, stop) range per axis of a leaf's global
# shape. The producer's chunks are boxes (`source_boxes`, sent in
# `ShardingLayout.boxes`); resharding on receive (`rdt_jax._layout`) cuts
# the pieces a consumer asks for out of them.

Box = tuple[tuple[int, int], ...]


def box_shape(box: Box) -> tuple[int, ...]:
  return tuple(b - a for a, b in box)


def full_box(shape: tuple[int, ...]) -> Box:
  return tuple((0, int(n)) for n in shape)


def intersect(a: Box, b: Box) -> Box | None:
  """The common part of two boxes, or None if they share no element."""
  out = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b))
  if any(lo >= hi for lo, hi in out):
    return None
  return out


def source_boxes(spec: LeafSpec) -> list[Box]:
  """The global box each chunk of a leaf covers (one chunk: the whole leaf):
  the boxes the producer sent (`ShardingLayout.boxes`), checked on arrival;
  derived from the mesh and spec only for a layout built without them."""
  if spec.sharding is None:
    return [full_box(spec.shape)]
  if spec.sharding.boxes:
    return list(spec.sharding.boxes)
  boxes = derived_boxes(spec)
  if boxes is None:
    raise UnsupportedLeafError(
        spec.path, f"has a sharding layout {spec.sharding} that does not fit its shape {spec.shape}",
        "Send the leaf from a producer running this rdt_jax version.",
    )
  return boxes


# --------------------------------------------------------------------------
# Global arrays of a multi-controller program: the shards a process owns.


def spans_processes(x: Any) -> bool:
  """True if `x` is a `jax.Array` with shards in other processes (a global
  array of a multi-controller program)."""
  array = loaded_type("jax", "Array")
  return array is not None and isinstance(x, array) and not getattr(x, "is_fully_addressable", True)


def owned_shards(x: Any) -> list[tuple[int, Box]]:
  """The shards of global array `x` this process publishes: (index in
  `x.addressable_shards`, the global box it holds) of each one whose
  `replica_id` is 0 (a replicated shard belongs to its first replica)."""
  shape = tuple(int(n) for n in x.shape)
  out = []
  for j, shard in enumerate(x.addressable_shards):
    if shard.replica_id == 0:
      index = tuple(shard.index) + (slice(None),) * (len(shape) - len(shard.index))
      out.append((j, tuple((s.indices(n)[0], s.indices(n)[1]) for s, n in zip(index, shape))))
  return out


def shard_arrays(x: Any) -> list[Any]:
  """Each addressable shard of `x` as a single-device `jax.Array` (no copy)."""
  return [shard.data for shard in x.addressable_shards]
