"""Sharded `jax.Array`s: rebuild the producer's layout, the geometry of
resharding on receive (`Slice`, target layouts, byte runs between boxes), and
the consistency checks of leaf specs from another process (`spec_problem`).

Describing a sharded array (one chunk per distinct shard) is `_jax`'s.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

import numpy as np

from rdt_jax import _compat
from rdt_jax._dlpack import _jax
from rdt_jax._dlpack._devices import Device, jax_device, jax_platform
from rdt_jax._dlpack._errors import UnsupportedLeafError
from rdt_jax._dlpack._lazy import loaded_type
from rdt_jax._dlpack._specs import ChunkSpec, LeafSpec, ShardingLayout

#: Bounds on what a leaf spec from another process may hold: axes per leaf,
#: and elements per leaf (no buffer of that many bytes exists).
MAX_NDIM: Final = 64
MAX_ELEMENTS: Final = 1 << 56


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
  if len(shape) > MAX_NDIM:
    return f"has {len(shape)} axes (at most {MAX_NDIM})"
  if not all(type(n) is int and n >= 0 for n in shape):
    return f"is {shape!r}, not non-negative ints"
  if math.prod(shape) >= MAX_ELEMENTS:
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


# --------------------------------------------------------------------------
# Resharding on receive: which part of which source chunk lands where.
#
# A box is one half-open (start, stop) range per axis of a leaf's global
# shape. The producer's chunks are boxes (`source_boxes`); the consumer asks
# for pieces, boxes it allocates one buffer each for (one per distinct shard
# of a target sharding, or one for a slice). Every byte a piece needs comes
# from the intersection of its box with each source chunk's box; `copy_runs`
# turns one intersection into contiguous byte runs of both buffers.

Box = tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class Slice:
  """A request for one index range per axis of a leaf: receive only that part.

  Used as a leaf of the tree given to :func:`rdt_jax.set_target_for_ref`.
  `rdt_jax.Slice[r * k:(r + 1) * k, :]` asks for rows `r*k` to `(r+1)*k` of a
  2-D leaf; axes not named are taken whole (`Slice[2:4]` on a 3-D leaf is
  `Slice[2:4, :, :]`). Only the slice's bytes cross; the leaf arrives as a
  C-contiguous array of the slice's shape.

  Attributes:
    index: one `slice` (step 1 or None) or int per leading axis; an int keeps
      its axis with length 1.
    into: where the slice arrives. None: a new array of the receive mode's type
      (`rdt_jax.receive_as`; jax arrays on the default cpu device). A numpy
      array or cpu torch tensor of the slice's shape and dtype (C-contiguous,
      writable, in host memory): the bytes are written straight into it;
      arrays in device memory (cuda tensors, cupy arrays) are refused. A
      `jax.sharding.Sharding` (or a jax array whose sharding is used): the
      slice arrives as a `jax.Array` of the slice's shape with that sharding,
      each device reading only its own shard.
  """

  index: tuple[Any, ...]
  into: Any = None

  def __class_getitem__(cls, index: Any) -> Slice:
    return cls(index if isinstance(index, tuple) else (index,))

  def box(self, shape: tuple[int, ...], path: str) -> Box:
    """The global box this slice covers on a leaf of `shape`.

    Raises:
      UnsupportedLeafError: naming the leaf, for more indices than axes, a
        step other than 1, or an index outside the leaf's shape.
    """
    index = self.index
    if any(i is Ellipsis for i in index):
      raise UnsupportedLeafError(
          path, f"has a Slice with an Ellipsis ({_show_index(index)})",
          "Name the leading axes explicitly; trailing axes are taken whole.",
      )
    if len(index) > len(shape):
      raise UnsupportedLeafError(
          path,
          f"has shape {shape} ({len(shape)} axes) but its Slice has "
          f"{len(index)} indices ({_show_index(index)})",
          "Give at most one index per axis.",
      )
    box = []
    for axis, (i, n) in enumerate(zip(index + (slice(None),) * (len(shape) - len(index)), shape)):
      if isinstance(i, (int, np.integer)) and not isinstance(i, bool):
        start, stop = int(i), int(i) + 1
      elif isinstance(i, slice):
        if i.step not in (None, 1):
          raise UnsupportedLeafError(
              path, f"has a Slice with step {i.step} on axis {axis}",
              "Ask for a contiguous range (step 1) and subsample after receiving.",
          )
        start = 0 if i.start is None else int(i.start)
        stop = n if i.stop is None else int(i.stop)
      else:
        raise UnsupportedLeafError(
            path, f"has a Slice index {i!r} on axis {axis}",
            "Use ints and slices with step 1.",
        )
      if not 0 <= start <= stop <= n:
        raise UnsupportedLeafError(
            path,
            f"has shape {shape} but its Slice asks for [{start}:{stop}] on "
            f"axis {axis} (size {n}); index out of range",
            "Use non-negative bounds within the leaf's shape, start <= stop.",
        )
      box.append((start, stop))
    return tuple(box)


def _show_index(index: tuple[Any, ...]) -> str:
  def one(i: Any) -> str:
    if isinstance(i, slice):
      s = f"{'' if i.start is None else i.start}:{'' if i.stop is None else i.stop}"
      return s + (f":{i.step}" if i.step is not None else "")
    return "..." if i is Ellipsis else repr(i)

  return "[" + ", ".join(one(i) for i in index) + "]"


def is_sharding(x: Any) -> bool:
  """True if `x` is a `jax.sharding.Sharding` (never imports jax)."""
  sharding = loaded_type("jax.sharding", "Sharding")
  return sharding is not None and isinstance(x, sharding)


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


def _bounds(s: slice, n: int) -> tuple[int, int]:
  start, stop, _ = s.indices(n)
  return start, stop


def copy_runs(src: Box, dst: Box, part: Box, itemsize: int) -> list[tuple[int, int, int]]:
  """The byte runs that copy `part` from a C-contiguous buffer holding box
  `src` into one holding box `dst` (`part` lies in both).

  Returns:
    `(source byte offset, destination byte offset, nbytes)` per run, in
    increasing order of both offsets. A run spans every trailing axis that
    `part` covers whole in both buffers, plus the next axis' range: a slice
    of leading rows is one run, a column block one run per row.
  """
  ndim = len(part)
  if ndim == 0:
    return [(0, 0, itemsize)]
  src_shape, dst_shape = box_shape(src), box_shape(dst)
  # k: the first axis of the run; axes after it are whole in src, dst and part.
  k = ndim - 1
  while k > 0 and (
      part[k][1] - part[k][0] == src_shape[k] == dst_shape[k]
  ):
    k -= 1
  run_elems = math.prod(box_shape(part)[k:])
  src_strides = _strides(src_shape)
  dst_strides = _strides(dst_shape)
  runs = []
  for lead in np.ndindex(*box_shape(part)[:k]):
    s_off = d_off = 0
    for axis in range(ndim):
      g = part[axis][0] + (lead[axis] if axis < k else 0)
      s_off += (g - src[axis][0]) * src_strides[axis]
      d_off += (g - dst[axis][0]) * dst_strides[axis]
    runs.append((s_off * itemsize, d_off * itemsize, run_elems * itemsize))
  return runs


def _strides(shape: tuple[int, ...]) -> list[int]:
  strides, acc = [0] * len(shape), 1
  for axis in range(len(shape) - 1, -1, -1):
    strides[axis] = acc
    acc *= shape[axis]
  return strides


def cut(dst_view: np.ndarray, dst: Box, src_view: np.ndarray, src: Box) -> None:
  """Copies the common part of two host arrays holding boxes `src` and `dst`."""
  part = intersect(src, dst)
  if part is None:
    return
  dst_view[tuple(slice(a - d0, b - d0) for (a, b), (d0, _) in zip(part, dst))] = src_view[
      tuple(slice(a - s0, b - s0) for (a, b), (s0, _) in zip(part, src))
  ]


@dataclass(frozen=True)
class TargetLayout:
  """What a consumer asks for of one leaf: a box and how it is split.

  Attributes:
    box: the part of the leaf's global shape to receive (the whole leaf for a
      target sharding; a slice's box).
    pieces: the distinct boxes the consumer allocates one buffer each for
      (global coordinates). One piece unless `sharding` splits `box`.
    sharding: the `jax.sharding.Sharding` of the arriving jax array (over
      `box`'s shape), or None for one array on one device.
    device_pieces: for each device of `sharding` (in its
      `addressable_devices_indices_map` order), the piece it holds.
  """

  box: Box
  pieces: tuple[Box, ...]
  sharding: Any = None
  devices: tuple[Any, ...] = ()
  device_pieces: tuple[int, ...] = ()

  @property
  def shape(self) -> tuple[int, ...]:
    return box_shape(self.box)


def target_layout(box: Box, sharding: Any, path: str) -> TargetLayout:
  """Splits `box` the way `sharding` (over the box's shape) lays it out.

  Replicated target shards share a piece: their bytes cross once and every
  replica is made from the same received buffer.

  Raises:
    UnsupportedLeafError: naming the leaf, for a sharding over devices this
      process does not have (an abstract mesh, other processes' devices), on
      a platform other than cpu, or that does not fit the shape.
  """
  shape = box_shape(box)
  if sharding is None:
    return TargetLayout(box, (box,))
  import jax

  problem = None
  try:
    devices = sharding.device_set
    local = set(jax.local_devices(backend="cpu"))
    missing = sorted(str(d) for d in devices if d not in local)
    if missing:
      problem = (
          f"has a target sharding over device(s) {', '.join(missing[:4])} that "
          "this process does not have as cpu devices"
      )
  except (ValueError, RuntimeError) as e:
    problem = f"has a target sharding over devices this process does not have ({e})"
  if problem is not None:
    raise UnsupportedLeafError(
        path, problem,
        "Build the target sharding from this process's devices, e.g. "
        "NamedSharding(Mesh(np.array(jax.local_devices()[:n]).reshape(...), names), spec); "
        "resharding on receive lands in cpu memory.",
    )
  try:
    index_map = sharding.addressable_devices_indices_map(shape)
  except Exception as e:  # a spec that does not divide the shape, wrong rank, ...
    raise UnsupportedLeafError(
        path, f"does not fit its target sharding {sharding} over shape {shape} ({e})",
        "Pick a sharding whose partitioned axes divide the received shape.",
    ) from None
  piece_of: dict[Box, int] = {}
  pieces: list[Box] = []
  devices_out, device_pieces = [], []
  for device, index in index_map.items():
    local_box = tuple(_bounds(s, n) for s, n in zip(index, shape))
    glob = tuple((a + b0, b + b0) for (a, b), (b0, _) in zip(local_box, box))
    if glob not in piece_of:
      piece_of[glob] = len(pieces)
      pieces.append(glob)
    devices_out.append(device)
    device_pieces.append(piece_of[glob])
  return TargetLayout(box, tuple(pieces), sharding, tuple(devices_out), tuple(device_pieces))


def build_sharded(views: list[np.ndarray], layout: TargetLayout, path: str) -> Any:
  """A `jax.Array` of `layout.sharding` from one host view per piece, each
  device's shard zero-copy where jax aliases host memory (64-byte aligned
  views on cpu devices: the arrays then keep the views alive).

  Raises:
    UnsupportedLeafError: for a 64-bit dtype while x64 is off (`check_x64`).
  """
  return sharded_builder(layout, views[0].dtype, path)(views)


def sharded_builder(layout: TargetLayout, dtype: np.dtype, path: str) -> Callable[[list[np.ndarray]], Any]:
  """`build_sharded` prepared for arrays of one layout and dtype: a function
  of the piece views alone (one per `layout.pieces`, in order), for a caller
  that builds such an array at every pull of a weight stream.

  Raises:
    UnsupportedLeafError: for a 64-bit dtype while x64 is off (`check_x64`),
      when prepared.
  """
  _jax.check_x64(dtype, path)
  put = _compat.host_shards_putter(list(layout.devices), layout.sharding, layout.shape, dtype)
  order = layout.device_pieces
  if order == tuple(range(len(order))):
    return put
  return lambda views: put([views[p] for p in order])
