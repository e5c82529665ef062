"""Packed versions: a weight stream whose steady state costs the bytes.

A trainer publishes the same structure every step in new arrays. Sent as a
pytree, each version pays per leaf: describing, registering and planning
every leaf, metadata listing every leaf, rebuilding every leaf. A packed
version pays per leaf only a pointer lookup and a copy on each side:

* the publisher copies every array leaf of a host-resident version into one
  pooled host buffer (`rdt_jax._layout.Packer`; leaf offsets fixed per
  structure); that buffer becomes RDT objects (one per bucket) only if a
  subscriber on another host asks for them;
* a subscriber learns the structure's layout at its first pull (from the
  publisher, with the structure check) and keeps a plan per structure: where
  each leaf's bytes go (straight into the template's numpy and torch
  arrays, or into a pooled buffer from which new jax arrays are made);
* on the publisher's host it copies the bytes itself (`process_vm_readv`,
  the system-call arguments prepared once per plan and publisher buffer),
  checking before and after the copy that the version is still kept by
  reading the publisher's table of kept versions (`KeptTable`): no call to
  the publisher, no Ray object fetch;
* elsewhere it asks the publisher for the buffer as RDT objects of
  `RDT_JAX_WEIGHT_BUCKET_BYTES` each (made at the first request for the
  version), fetches them with `ray.get` (NIXL, one READ each), the next one
  while the last one is copied out, and copies the leaves out of them.

This module holds the geometry (layouts, tables, plans, buckets) and the
checks of what a publisher sends; the reads themselves are
`rdt_jax.weights._routes`.

A packed pull writes the template only after the bytes arrived and the
version was still kept after they did, except a node-local pull with
`atomic=False`, which copies straight into the template (`version` is then
None if that copy fails or the version was freed during it).

The table of kept versions is what makes the node-local check safe: the
publisher removes a version from it before the version's buffer can be
reused (its RDT object is freed only after), and a reader that finds the
version in the table both before and after its copy copied bytes no
publish could have touched.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import math
import threading
import zlib
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final

import numpy as np

from rdt_jax import _dlpack, _layout, _memory, _process, _state
from rdt_jax import _node_local as node_local
from rdt_jax._metadata import MetadataError

__all__ = [
  "EMPTY",
  "MAX_NBYTES",
  "MAX_SLOTS",
  "ForeignTable",
  "KeptTable",
  "PackedLayoutInfo",
  "PackedPlan",
  "PackedSource",
  "PublishedStructure",
  "Stream",
  "bucket_runs",
  "check_layout",
  "check_source",
  "table_token",
  "unflatten",
]

#: A slot of the kept-versions table that holds no version.
EMPTY: Final = np.iinfo(np.int64).min
#: Prepared node-local reads kept per plan (one per publisher buffer seen).
PREPARED_KEPT: Final = 8


# --------------------------------------------------------------------------
# What crosses: the layout of a structure, and where a version lies.


@dataclass(frozen=True)
class PackedLayoutInfo:
  """A packed structure as its subscribers need it (sent once per structure).

  Attributes:
    layout: each array leaf's offset and size in a version's buffer.
    treedef: the published value's pytree structure (array leaves and other
      leaves in order).
    array_positions: the leaf indices of `treedef` that are array leaves
      (the others travel in each handle's `rest`).
    shapes: each array leaf's packed shape (a typed key's: its key data's).
  """

  layout: _layout.PackedLayout
  treedef: Any
  array_positions: tuple[int, ...]
  shapes: tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class PackedSource:
  """Where a packed version's bytes lie in its publisher's process, for
  subscribers on the same host.

  Attributes:
    origin: the publisher's process (`rdt_jax._process.Identity`).
    buffer: the address of the version's packed buffer.
    nbytes: its size.
    table: the address of the publisher's `KeptTable`.
    slots: the table's length.
    rest: the value's non-array leaves, in `treedef` order.
    digest: CRC-32 of the fields above (catches corruption, not forgery).
  """

  origin: _process.Identity | None
  buffer: int
  nbytes: int
  table: int
  slots: int
  rest: tuple[Any, ...] = ()
  digest: int = 0

  def expected_digest(self, version: int) -> int:
    values = array("q", (self.buffer, self.nbytes, self.table, self.slots, version))
    return zlib.crc32(f"{self.origin}".encode(), zlib.crc32(values))


# --------------------------------------------------------------------------
# Publisher


@functools.lru_cache(maxsize=64)
def table_token(publisher: str) -> tuple[int, int]:
  """The two int64 words heading publisher `publisher`'s table (its id, a
  128-bit hex string, read as two signed 64-bit integers)."""
  raw = int(publisher, 16).to_bytes(16, "little", signed=False)
  return int.from_bytes(raw[:8], "little", signed=True), int.from_bytes(raw[8:], "little", signed=True)


class ForeignTable(LookupError):
  """A kept-versions table that no longer belongs to the handle's publisher:
  it was closed, or its memory now holds another publisher's table (a
  publisher created again in the same process) or anything else."""


class KeptTable:
  """The versions a publisher keeps, in memory its subscribers on the same
  host read directly.

  Two header words name the publisher (`table_token`: a subscriber reads the
  table only as the table of its handle's publisher; a closed table's header
  is cleared), then one int64 slot per kept version (`EMPTY` when free). Each
  slot changes with one aligned 8-byte store, so a reader sees a version
  either present or not. A version leaves the table before its buffer can be
  reused.
  """

  HEADER: Final = 2

  def __init__(self, slots: int, publisher: str):
    self._words = np.full(slots + self.HEADER, EMPTY, np.int64)
    self._words[: self.HEADER] = table_token(publisher)
    self._slots = self._words[self.HEADER :]
    self.address = _memory.host_pointer(self._words)
    self.slots = slots

  def add(self, version: int) -> None:
    free = np.flatnonzero(self._slots == EMPTY)
    if not free.size:
      raise RuntimeError("no free slot in the kept-versions table: drop a version first")
    self._slots[int(free[0])] = version

  def drop(self, version: int) -> None:
    for i in np.flatnonzero(self._slots == version):
      self._slots[int(i)] = EMPTY

  def clear(self) -> None:
    for i in range(self.slots):
      self._slots[i] = EMPTY

  def retire(self) -> None:
    """Empties the table and clears its header: a subscriber holding a
    handle of this publisher then finds the table foreign."""
    self.clear()
    self._words[: self.HEADER] = 0


@dataclass
class PublishedStructure:
  """What a publisher knows of one structure it publishes packed."""

  info: PackedLayoutInfo
  packer: _layout.Packer
  key_positions: frozenset[int]  # array positions (indices into the array leaves) holding typed PRNG keys


def _signature(arrays: Sequence[Any]) -> list[Any]:
  """What must not change for a structure's layout to hold: each array
  leaf's type, shape and dtype (a jax array's abstract value says both, and
  one jitted function's outputs share theirs from call to call)."""
  return [getattr(x, "aval", None) or (type(x), tuple(x.shape), x.dtype) for x in arrays]


class Stream:
  """The publisher's side of packed versions: one structure at a time.

  Args:
    keep: how many versions are kept (the table's length).
    publisher: the publisher's id (heads its table).
  """

  def __init__(self, keep: int, publisher: str):
    self.table = KeptTable(keep, publisher)
    self._structure: PublishedStructure | None = None
    self._treedef: Any = None
    self._signature: list[Any] | None = None
    self._digest: str | None = None
    self._split_treedef: Any = None
    self._split_types: list[type] = []
    self._positions: list[int] = []

  def split(self, tree: Any) -> tuple[Any, list[Any], list[int], list[Any]]:
    """(treedef, array leaves, their positions, the other leaves) of `tree`.
    Which leaves are arrays depends on their types alone: a tree of the last
    split's structure and leaf types reuses its positions."""
    import jax

    leaves, treedef = jax.tree_util.tree_flatten(tree)
    types = list(map(type, leaves))
    if self._split_treedef is not None and treedef == self._split_treedef and types == self._split_types:
      positions = self._positions
    else:
      positions = [i for i, x in enumerate(leaves) if _dlpack.is_array(x) or _dlpack.is_prng_key(x)]
      self._split_treedef, self._split_types, self._positions = treedef, types, positions
    arrays = [leaves[i] for i in positions]
    if len(positions) == len(leaves):
      return treedef, arrays, positions, []
    taken = set(positions)
    rest = [x for i, x in enumerate(leaves) if i not in taken]
    return treedef, arrays, positions, rest

  def structure(
      self, tree: Any, digest_of: Callable[[Any], str], paths_of: Callable[[Any], list[str]]
  ) -> tuple[PublishedStructure | None, str, list[Any], tuple[Any, ...]]:
    """The packed structure of `tree` (None if it cannot be packed: a leaf in
    device memory), its digest, its array leaves (typed keys as their key
    data) and its other leaves. Checks a new structure in full; a structure
    seen at the last publish costs a signature comparison.

    Args:
      digest_of: the structure digest of `tree` (computed for a new structure only).
      paths_of: the pytree path of each array leaf of `tree`, in order.
    """
    treedef, arrays, positions, rest = self.split(tree)
    signature = _signature(arrays)
    if self._digest is None or treedef != self._treedef or signature != self._signature:
      self._digest = self._signature = None
      self._structure = self._build(treedef, arrays, positions, paths_of(tree))
      self._digest = digest_of(tree)
      self._treedef, self._signature = treedef, signature  # checked: packable or not, known until it changes
    assert self._digest is not None
    if self._structure is None:
      return None, self._digest, arrays, tuple(rest)
    keys = self._structure.key_positions
    data = [_dlpack.prng_key_parts(x)[0] if i in keys else x for i, x in enumerate(arrays)]
    return self._structure, self._digest, data, tuple(rest)

  @staticmethod
  def _build(treedef: Any, arrays: list[Any], positions: list[int], paths: list[str]) -> PublishedStructure | None:
    keys = frozenset(i for i, x in enumerate(arrays) if _dlpack.is_prng_key(x))
    sizes, shapes = [], []
    for i, x in enumerate(arrays):
      leaf = _dlpack.describe(_dlpack.prng_key_parts(x)[0] if i in keys else x, paths[i])
      if leaf.spec.device != "cpu":
        return None
      sizes.append(leaf.spec.nbytes)
      shapes.append(leaf.spec.shape)
    layout = _layout.PackedLayout.of(sizes)
    if not layout.total:
      return None
    info = PackedLayoutInfo(layout, treedef, tuple(positions), tuple(shapes))
    return PublishedStructure(info, _layout.Packer(layout, paths), keys)

  def source(self, version: int, buffer: np.ndarray, rest: tuple[Any, ...]) -> PackedSource:
    """The `PackedSource` of a version packed into `buffer`."""
    src = PackedSource(_process.identity(), _memory.host_pointer(buffer), int(buffer.nbytes),
                       self.table.address, self.table.slots, rest)
    return dataclasses.replace(src, digest=src.expected_digest(version))


# --------------------------------------------------------------------------
# Subscriber


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
    self._direct = [(leaf.pointer + d, s, n) for leaf in self.leaves if leaf.kind == "in_place" and not atomic
                    for d, s, n in leaf.runs]
    self._prepared: OrderedDict[tuple[int, int], node_local.Prepared] = OrderedDict()
    self._lock = threading.Lock()

  def _leaf(self, i: int, path: str, kind: str, shape: tuple[int, ...], what: str, target: Any,
            offset: int, size: int) -> _Leaf:
    if kind == "key":
      return _Leaf(i, path, "new", [(0, offset, size)] if size else [], shape=self.info.shapes[i],
                   dtype=np.dtype(np.uint32), place=_layout.jax_placement(target), impl=what)
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
                     returned=returned)
      # Device memory: the bytes arrive on the host, then are copied in.
      return _Leaf(i, path, "new", runs(), array=into, returned=returned, shape=out_shape, dtype=dtype,
                   framework="copy")
    framework = "jax"
    if isinstance(target, _layout.Slice) and into is None:
      mode = _state.receive_mode()
      framework = "jax" if mode == "source" else mode
    if framework == "jax":
      _dlpack.check_x64(dtype, path)
    place = _layout.jax_placement(into)
    if framework != "jax" or place is None or not size or not _layout.is_cpu_sharding(place):
      return _Leaf(i, path, "new", runs(), shape=out_shape, dtype=dtype, place=place, framework=framework)
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
                 place=place, framework=framework, layout=layout, pieces=pieces, build=build)

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
    key = (remote, staging)
    with self._lock:
      found = self._prepared.get(key)
      if found is not None:
        self._prepared.move_to_end(key)
        return found
    found = node_local.Prepared([(local, remote + s, n) for local, s, n in self.pairs(staging)])
    with self._lock:
      self._prepared[key] = found
      while len(self._prepared) > PREPARED_KEPT:
        self._prepared.popitem(last=False)
    return found

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
# Checks of what the publisher sent (nothing is trusted before them)


#: At most this many slots in a kept-versions table a handle names (a bound on what is trusted).
MAX_SLOTS: Final = 1 << 16
#: At most this many bytes in a packed version a handle names.
MAX_NBYTES: Final = 1 << 46


def check_source(source: Any, label: str, plan: PackedPlan | None = None, version: int = 0) -> PackedSource:
  """Checks a handle's `PackedSource` before anything is read or allocated
  from it: every field's type and bounds, and, given the `plan` of its
  structure, its digest (for `version`), its size and its count of
  non-array leaves. Returns `source`.

  Raises:
    MetadataError: naming the field out of bounds, of the wrong type, or
      not matching the plan.
  """
  if not isinstance(source, PackedSource):
    raise MetadataError(label, "packed", f"is a {type(source).__name__}, not a PackedSource")
  for name, low, high in (("buffer", 1, 2**63 - 1), ("nbytes", 0, MAX_NBYTES), ("table", 1, 2**63 - 1),
                          ("slots", 1, MAX_SLOTS)):
    value = getattr(source, name)
    if type(value) is not int or not low <= value <= high:
      raise MetadataError(label, f"packed.{name}", f"is {value!r}, outside [{low}, {high}]")
  if not isinstance(source.rest, tuple):
    raise MetadataError(label, "packed.rest", f"is a {type(source.rest).__name__}, not a tuple")
  if plan is not None:
    _check_against(plan, source, version, label)
  return source


def check_layout(info: Any, entries: Sequence[Any], label: str) -> None:
  """Checks a packed structure's layout, as its publisher sent it, against
  the published array leaves `entries` before a plan is made from it: one
  offset, size and shape per leaf, every leaf's bytes inside the buffer and
  apart from the others, each size what its shape and dtype take.

  Raises:
    MetadataError: naming the field and leaf that do not hold together.
  """
  if not isinstance(info, PackedLayoutInfo) or not isinstance(info.layout, _layout.PackedLayout):
    raise MetadataError(label, "packed layout", "is not a packed layout")
  layout = info.layout
  n = len(entries)
  for name, seq in (("offsets", layout.offsets), ("sizes", layout.sizes), ("shapes", info.shapes),
                    ("array_positions", info.array_positions)):
    if not isinstance(seq, tuple) or len(seq) != n:
      raise MetadataError(label, f"packed layout.{name}", f"has {len(seq) if isinstance(seq, tuple) else '?'} "
                          f"entries for {n} array leaves")
  if type(layout.total) is not int or not 0 <= layout.total <= MAX_NBYTES:
    raise MetadataError(label, "packed layout.total", f"is {layout.total!r}")
  end = 0
  for _i, (entry, offset, size, shape) in enumerate(zip(entries, layout.offsets, layout.sizes, info.shapes)):
    path, kind = entry[0], entry[1]
    where = f"packed layout, leaf {path or '(the value itself)'}"
    if type(offset) is not int or type(size) is not int or offset < end or size < 0 or offset + size > layout.total:
      raise MetadataError(label, where, f"has offset {offset!r} and size {size!r}, outside the buffer of "
                          f"{layout.total} bytes or over the leaf before it")
    if not (isinstance(shape, tuple) and all(type(d) is int and d >= 0 for d in shape)):
      raise MetadataError(label, where, f"has shape {shape!r}")
    try:
      itemsize = 4 if kind == "key" else _dlpack.np_dtype_from_name(entry[3]).itemsize
    except TypeError:
      raise MetadataError(label, where, f"has dtype {entry[3]!r}, which numpy and ml_dtypes lack") from None
    if kind != "key" and tuple(shape) != tuple(entry[2]):
      raise MetadataError(label, where, f"has shape {shape}, the structure {entry[2]}")
    if size != math.prod(shape) * itemsize:
      raise MetadataError(label, where, f"has {size} bytes; shape {shape} takes {math.prod(shape) * itemsize}")
    end = offset + size
  positions = info.array_positions
  if any(type(p) is not int for p in positions) or list(positions) != sorted(set(positions)) or (
      positions and not 0 <= positions[0] <= positions[-1] < info.treedef.num_leaves):
    raise MetadataError(label, "packed layout.array_positions", "are not increasing leaf indices of the structure")


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


def _check_against(plan: PackedPlan, source: PackedSource, version: int, label: str) -> None:
  """Checks a `PackedSource` whose fields are in bounds against the plan of
  its structure: its digest, its size, its count of non-array leaves."""
  if source.digest != source.expected_digest(version):
    raise MetadataError(label, "packed", "does not match its digest (the handle was corrupted)")
  if source.nbytes != plan.info.layout.total:
    raise MetadataError(label, "packed.nbytes",
                        f"is {source.nbytes}, but the structure's layout takes {plan.info.layout.total} bytes")
  if len(plan.info.array_positions) + len(source.rest) != plan.info.treedef.num_leaves:
    raise MetadataError(label, "packed.rest",
                        f"holds {len(source.rest)} leaves; the structure has "
                        f"{plan.info.treedef.num_leaves - len(plan.info.array_positions)} non-array leaves")


def unflatten(info: PackedLayoutInfo, arrays: list[Any], rest: tuple[Any, ...]) -> Any:
  """A pulled packed value: the published tree with `arrays` at its array
  leaves and `rest` at the others."""
  positions = set(info.array_positions)
  it_arrays, it_rest = iter(arrays), iter(rest)
  leaves = [next(it_arrays) if i in positions else next(it_rest) for i in range(len(positions) + len(rest))]
  return info.treedef.unflatten(leaves)
