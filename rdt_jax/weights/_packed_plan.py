"""The subscriber's side of packed versions: a plan per structure and template.

`PackedPlan` says where each array leaf of a packed version goes on this
subscriber (straight into the template's numpy and torch arrays, or into a
pooled buffer from which new jax arrays are made), prepares the node-local
reads of a version (`rdt_jax._node_local`) and makes the pulled leaves once
the bytes arrived (`PackedPlan.commit`); `unflatten` puts them back into the
published tree. `bucket_runs` cuts a plan's copies along the buckets a
version travels in through Ray.

A plan is made only from a layout that passed the checks of
`rdt_jax.weights._packed_checks`; the overview is `rdt_jax.weights._packed`.
"""

from __future__ import annotations

import ctypes
import dataclasses
import math
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from rdt_jax import _dlpack, _layout, _limits, _memory, _receive_mode
from rdt_jax import _node_local as node_local
from rdt_jax.weights._packed import PackedLayoutInfo

__all__ = ["PackedPlan", "PreparedReads", "bucket_runs", "unflatten"]


@dataclass
class _Leaf:
  """Where one array leaf of a packed version goes on this subscriber."""

  index: int  # in the structure's array leaves
  path: str
  kind: str  # "in_place": written into `array`; "new": a new array from the pool buffer
  runs: list[tuple[int, int, int]]  # (destination offset, source offset in the version, nbytes)
  array: Any = None  # in_place: the array written (template leaf, or a Slice's `into`)
  pointer: int = 0  # in_place: its address when the plan was made
  returned: Any = None  # in_place: what the pulled tree holds (the template leaf, or `into`)
  shape: tuple[int, ...] = ()  # new: the arriving array's shape
  dtype: np.dtype | None = None  # new: its dtype (uint32 key data for a key)
  staged: int = 0  # new (or atomic in_place): the offset of its bytes in the pool buffer
  place: Any = None  # new: a sharding or jax device to put it on, or None
  impl: str | None = None  # new: the key implementation of a typed PRNG key leaf
  framework: str = "jax"  # new, from a Slice without `into`: the receive mode's framework
  layout: Any = None  # new, placed with a sharding: its `TargetLayout` (one staged piece per distinct shard)
  pieces: list[tuple[int, tuple[int, ...]]] | None = None  # (offset in the leaf's staging, shape) per piece
  build: Callable[[list[np.ndarray]], Any] | None = None  # new, placed with a sharding: makes it from its pieces
  spans: list[tuple[int, int, tuple[int, ...]]] = dataclasses.field(default_factory=list)  # new: (start, stop,
  # shape) in the pool buffer of each piece (of the whole leaf if it has no pieces), fixed by the plan
  box: Any = None  # the global box of the leaf it receives (the whole leaf, or a Slice's)

  @property
  def span(self) -> int:
    """Bytes this leaf takes in the pool buffer."""
    if self.pieces is not None and self.dtype is not None:
      itemsize = self.dtype.itemsize
      return sum(_memory.aligned(math.prod(shape) * itemsize) for _, shape in self.pieces)
    return _memory.aligned(sum(n for _, _, n in self.runs))


class PackedPlan:
  """A subscriber's plan for one packed structure and template.

  Args:
    info: the structure's layout.
    entries: the published structure (`rdt_jax.weights._handle.LeafEntry`s,
      array leaves in order).
    template: the subscriber's flattened template, by path.
    atomic: whether in-place leaves are staged and committed after the checks.

  Raises:
    UnsupportedLeafError: naming the leaf, for a template leaf that cannot
      receive (a 64-bit leaf as jax with x64 off, a non-contiguous or
      read-only in-place array).
  """

  def __init__(self, info: PackedLayoutInfo, entries: Sequence[tuple[str, str, tuple[int, ...], str]],
               template: dict[str, Any], atomic: bool):
    self.info = info
    self.atomic = atomic
    self.leaves: list[_Leaf] = []
    #: Sharded placements already laid out, by (box, dtype, sharding): leaves
    #: of one shape and sharding (most of a model's) share the work.
    self._sharded: dict[tuple[Any, ...], tuple[Any, list[tuple[int, tuple[int, ...]]], list[tuple[int, int, int]],
                                               Callable[[list[np.ndarray]], Any]]] = {}
    #: Copy runs relative to a leaf's offset, by (shape's box, received box, itemsize).
    self._runs: dict[tuple[Any, ...], list[tuple[int, int, int]]] = {}
    staged = 0
    layout = info.layout
    for i, (path, kind, shape, what) in enumerate(entries):
      leaf = self._leaf(i, path, kind, shape, what, template[path], layout.offsets[i], layout.sizes[i])
      if leaf.kind == "new" or atomic:
        leaf.staged = staged
        staged += leaf.span
      if leaf.kind == "new":
        leaf.spans = _spans(leaf)
      self.leaves.append(leaf)
    self.staging_bytes = staged
    self._in_place = [leaf for leaf in self.leaves if leaf.kind == "in_place"]
    self._new = [leaf for leaf in self.leaves if leaf.kind != "in_place"]
    self._written = [leaf.array for leaf in self._in_place]
    self._pointers = [leaf.pointer for leaf in self._in_place]
    #: True if a pull writes into the template while it copies (in place, not atomic).
    self.writes_in_place = bool(self._in_place) and not atomic
    #: True if `commit` copies into the template's arrays (atomic in-place
    #: leaves, and templates that take a copy: device memory).
    self.commits_into_template = (bool(self._in_place) and atomic) or any(
        leaf.framework == "copy" for leaf in self._new)
    self._direct = [(leaf.pointer + d, s, n) for leaf in self.leaves if leaf.kind == "in_place" and not atomic
                    for d, s, n in leaf.runs]
    self._prepared = PreparedReads()

  def _leaf(self, i: int, path: str, kind: str, shape: tuple[int, ...], what: str, target: Any,
            offset: int, size: int) -> _Leaf:
    if kind == "key":
      return _Leaf(i, path, "new", [(0, offset, size)] if size else [], shape=self.info.shapes[i],
                   dtype=np.dtype(np.uint32), place=_layout.jax_placement(target), impl=what,
                   box=_dlpack.full_box(tuple(self.info.shapes[i])))
    dtype = _dlpack.np_dtype_from_name(what)
    into, box = target, _dlpack.full_box(tuple(shape))
    if isinstance(target, _layout.Slice):
      box = target.box(tuple(shape), path)
      into = target.into
    full = _dlpack.full_box(tuple(shape))

    def runs() -> list[tuple[int, int, int]]:
      if not size:
        return []
      key = (full, box, dtype.itemsize)
      rel = self._runs.get(key)
      if rel is None:
        rel = self._runs[key] = [(d, s, n) for s, d, n in _layout.copy_runs(full, box, box, dtype.itemsize)]
      return [(d, offset + s, n) for d, s, n in rel]

    out_shape = _dlpack.box_shape(box)
    fw = _dlpack.framework_of(into)
    returned = target.into if isinstance(target, _layout.Slice) else target
    if fw is not None and fw != "jax":
      if tuple(into.shape) != out_shape or _dlpack.dtype_of(into) != dtype:
        raise _dlpack.UnsupportedLeafError(
            path, f"has a Slice into an array of shape {tuple(into.shape)}, dtype {_dlpack.dtype_of(into).name}; "
            f"the slice has shape {out_shape}, dtype {dtype.name}",
            "Give `into` the slice's shape and the published dtype.")
      if not (_dlpack.is_c_contiguous(into) and _dlpack.is_writable(into)):
        raise _dlpack.UnsupportedLeafError(
            path, "is a template array that is not C-contiguous and writable",
            "Give a contiguous, writable array.")
      if _dlpack.device_of(into).kind == "cpu" and fw != "cupy":
        return _Leaf(i, path, "in_place", runs(), array=into, pointer=_dlpack.buffer_pointer(into),
                     returned=returned, box=box)
      # Device memory: the bytes arrive on the host, then are copied in.
      return _Leaf(i, path, "new", runs(), array=into, returned=returned, shape=out_shape, dtype=dtype,
                   framework="copy", box=box)
    framework = "jax"
    if isinstance(target, _layout.Slice) and into is None:
      mode = _receive_mode.receive_mode()
      framework = "jax" if mode == "source" else mode
    if framework == "jax":
      _dlpack.check_x64(dtype, path)
    place = _layout.jax_placement(into)
    if framework != "jax" or place is None or not size or not _layout.is_cpu_sharding(place):
      return _Leaf(i, path, "new", runs(), shape=out_shape, dtype=dtype, place=place, framework=framework, box=box)
    # Placed with a sharding: each distinct shard is staged on its own, so
    # every device's array is made from its own host view without a copy.
    key = (box, dtype.str, place)
    known = self._sharded.get(key)
    if known is None:
      layout = _layout.target_layout(box, place, path)
      rel: list[tuple[int, int, int]] = []
      pieces: list[tuple[int, tuple[int, ...]]] = []
      at = 0
      for piece in layout.pieces:
        piece_shape = _dlpack.box_shape(piece)
        pieces.append((at, piece_shape))
        rel += [(at + d, s, n) for s, d, n in _layout.copy_runs(full, piece, piece, dtype.itemsize)]
        at += _memory.aligned(math.prod(piece_shape) * dtype.itemsize)
      known = self._sharded[key] = (layout, pieces, rel, _layout.sharded_builder(layout, dtype, path))
    layout, pieces, rel, build = known
    return _Leaf(i, path, "new", [(d, offset + s, n) for d, s, n in rel], shape=out_shape, dtype=dtype,
                 place=place, framework=framework, layout=layout, pieces=pieces, build=build, box=box)

  # ---- per pull

  def check_targets(self) -> None:
    """Raises if an in-place target's memory moved since the plan was made
    (a torch tensor given new storage): the plan would write freed memory."""
    if _dlpack.buffer_pointers(self._written) == self._pointers:
      return
    for leaf in self._in_place:
      if _dlpack.buffer_pointer(leaf.array) != leaf.pointer:
        raise _dlpack.UnsupportedLeafError(
            leaf.path, "is a template array whose memory moved since the subscriber's first pull",
            "Keep the template's arrays in place (copy into them, never rebind their storage), "
            "or create a new WeightSubscriber.")

  def pairs(self, staging: int) -> list[tuple[int, int, int]]:
    """(local address, source offset, nbytes) of every run, with the pool
    buffer at `staging`."""
    out = list(self._direct)
    for leaf in self.leaves:
      if leaf.kind == "new" or self.atomic:
        at = staging + leaf.staged
        out.extend((at + d, s, n) for d, s, n in leaf.runs)
    return out

  def prepared(self, remote: int, staging: int) -> node_local.Prepared:
    """The node-local read of a version at publisher address `remote` into
    the pool buffer at `staging`, prepared once per pair of addresses."""
    return self._prepared.get(remote, staging, self.pairs)

  def commit(self, buffer: np.ndarray | None) -> list[Any]:
    """Makes the pulled array leaves, in structure order, after the bytes
    arrived: new arrays from the pool `buffer`, in-place leaves marked
    written (atomic: copied from the pool buffer into the template first)."""
    out: list[Any] = [None] * len(self.leaves)
    host_jax: list[tuple[int, np.ndarray, Any]] = []
    copies: list[tuple[Any, np.ndarray]] = []
    if self._in_place:
      if self.atomic:
        assert buffer is not None
        staging = _memory.host_pointer(buffer)
        for leaf in self._in_place:
          for d, _, n in leaf.runs:
            ctypes.memmove(leaf.pointer + d, staging + leaf.staged + d, n)
      _dlpack.mark_written_many(self._written)
      for leaf in self._in_place:
        out[leaf.index] = leaf.returned
    for leaf in self._new:
      assert buffer is not None and leaf.dtype is not None
      if leaf.build is not None:
        out[leaf.index] = leaf.build([buffer[a:b].view(leaf.dtype).reshape(shape) for a, b, shape in leaf.spans])
        continue
      a, b, shape = leaf.spans[0]
      view = buffer[a:b].view(leaf.dtype).reshape(shape)
      if leaf.framework == "copy":
        copies.append((leaf.array, view))
        out[leaf.index] = leaf.returned
      elif leaf.framework in ("numpy", "torch"):
        out[leaf.index] = _dlpack.rebuild_view(view, leaf.framework, _dlpack.Device("cpu"), leaf.path)  # type: ignore[arg-type]
      elif leaf.place is None:
        host_jax.append((leaf.index, view, leaf))
      else:
        out[leaf.index] = _finish_jax(_put(view, leaf.place), leaf)
    if copies:  # device (or other non-host) templates: ordered with every stream of their devices
      _memory.copy_into_many(copies)
      _dlpack.mark_written_many([target for target, _ in copies])
    if host_jax:
      made = _dlpack.host_to_jax_many([v for _, v, _ in host_jax], _dlpack.Device("cpu"))
      for (i, _, leaf), x in zip(host_jax, made):
        out[i] = _finish_jax(x, leaf)
    return out


class PreparedReads:
  """A plan's node-local reads, prepared once per pair of addresses (the
  publisher's buffer, the pull's staging buffer); the last
  `_limits.WEIGHTS_PREPARED_KEPT` pairs are kept."""

  def __init__(self) -> None:
    self._kept: OrderedDict[tuple[int, int], node_local.Prepared] = OrderedDict()
    self._lock = threading.Lock()

  def get(self, remote: int, staging: int,
          pairs: Callable[[int], list[tuple[int, int, int]]]) -> node_local.Prepared:
    """The read of the buffer at publisher address `remote` into staging at
    `staging`; `pairs(staging)` gives its (local address, offset in the
    buffer, nbytes) runs when it is first prepared."""
    key = (remote, staging)
    with self._lock:
      found = self._kept.get(key)
      if found is not None:
        self._kept.move_to_end(key)
        return found
    found = node_local.Prepared([(local, remote + s, n) for local, s, n in pairs(staging)])
    with self._lock:
      self._kept[key] = found
      while len(self._kept) > _limits.WEIGHTS_PREPARED_KEPT:
        self._kept.popitem(last=False)
    return found


def _spans(leaf: _Leaf) -> list[tuple[int, int, tuple[int, ...]]]:
  """(start, stop, shape) in the pool buffer of each piece of a new leaf
  (one span for a leaf without pieces)."""
  assert leaf.dtype is not None
  itemsize = leaf.dtype.itemsize
  pieces = leaf.pieces if leaf.pieces is not None else [(0, leaf.shape)]
  out = []
  for at, shape in pieces:
    start = leaf.staged + at
    out.append((start, start + math.prod(shape) * itemsize, tuple(shape)))
  return out


def _put(view: np.ndarray, place: Any) -> Any:
  """`view` (in a pooled buffer) placed with `place`. Where jax aliases the
  host memory instead of copying it, the array holds `view`, so the pool
  does not reuse the buffer while it lives."""
  import jax

  return jax.device_put(view, place)


def _finish_jax(x: Any, leaf: _Leaf) -> Any:
  return _dlpack.wrap_prng_key(x, leaf.impl) if leaf.impl is not None else x


# --------------------------------------------------------------------------
# The pulled value, and the buckets a version travels in


def unflatten(info: PackedLayoutInfo, arrays: list[Any], rest: tuple[Any, ...]) -> Any:
  """A pulled packed value: the published tree with `arrays` at its array
  leaves and `rest` at the others."""
  positions = set(info.array_positions)
  it_arrays, it_rest = iter(arrays), iter(rest)
  leaves = [next(it_arrays) if i in positions else next(it_rest) for i in range(len(positions) + len(rest))]
  return info.treedef.unflatten(leaves)


def bucket_runs(pairs: Sequence[tuple[int, int, int]], size: int, count: int) -> list[list[tuple[int, int, int]]]:
  """`pairs` (local address, offset in the version's buffer, nbytes) as
  (local address, offset in the bucket, nbytes) per bucket of `size` bytes
  (`count` buckets); a pair that crosses a bucket boundary is cut in two.

  Raises:
    ValueError: for a pair outside the `count` buckets (a plan that does not
      match the version).
  """
  out: list[list[tuple[int, int, int]]] = [[] for _ in range(count)]
  for local, offset, n in pairs:
    if offset < 0 or offset + n > size * count:
      raise ValueError(f"a copy of {n} bytes at offset {offset} lies outside {count} buckets of {size} bytes")
    while n:
      i, at = divmod(offset, size)
      take = min(n, size - at)
      out[i].append((local, at, take))
      local, offset, n = local + take, offset + take, n - take
  return out
