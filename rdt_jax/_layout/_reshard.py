"""Resharding on receive: which part of which source chunk lands where.

The producer's chunks are boxes (`rdt_jax._dlpack.source_boxes`); the
consumer asks for pieces, boxes it allocates one buffer each for (one per
distinct shard of a target sharding, or one for a slice). Every byte a piece
needs comes from the intersection of its box with each source chunk's box;
`copy_runs` turns one intersection into contiguous byte runs of both buffers,
`cut` copies it between two host arrays. `build_sharded` makes the arriving
`jax.Array` from one host view per piece.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from rdt_jax import _compat
from rdt_jax._dlpack import _jax
from rdt_jax._dlpack._errors import UnsupportedLeafError
from rdt_jax._dlpack._sharding import Box, box_shape, intersect


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
