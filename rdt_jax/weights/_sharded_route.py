"""Pulling a version published by every process of a multi-controller trainer.

A combined handle (`WeightsHandle.combine`; the parts are
`rdt_jax.weights._shards`) names one part per trainer process, each holding
some boxes of the global leaves. A subscriber's template says which box of
each leaf it needs (the whole leaf, a `Slice`, or one box per distinct shard
of a target sharding). `ShardedPlan`, made once per combined structure and
template, says where each needed byte comes from: the destinations are
those of a `PackedPlan` over the global structure (the template's arrays,
or the pooled buffer new jax arrays are made from), and each part gets the
byte runs from its pieces into them (`PartPlan`): only the intersections of
what it holds with what the template needs.

A pull then reads every part at once, one thread per part, each by the
route a single version would take (`rdt_jax.weights._routes`): copied from
the trainer process's memory on this host, or its buckets through Ray; a
part sent as a pytree comes through Ray whole. Every part's kept-versions
check runs before any byte may reach the template (so a stale part leaves
the template as it was) and again after its bytes arrived. A part that
fails fails the pull, once every other part's reads have ended (nothing
writes after a pull returns), with an error naming its trainer process.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import dataclasses
import math
import threading
from collections.abc import Callable, Sequence
from typing import Any, cast

import numpy as np
import ray

from rdt_jax import _dlpack, _layout, _limits, _memory
from rdt_jax import _node_local as node_local
from rdt_jax._metadata import MetadataError
from rdt_jax.weights._handle import WeightsHandle, check_template, label
from rdt_jax.weights._mapping import MappedPlan, Source
from rdt_jax.weights._packed import PackedLayoutInfo
from rdt_jax.weights._packed_checks import check_layout, check_source
from rdt_jax.weights._packed_plan import PackedPlan, PreparedReads, unflatten
from rdt_jax.weights._parts import PartLayout, ShardedPart, check_coverage, check_part_layout
from rdt_jax.weights._protocol import ask_object
from rdt_jax.weights._pull import Pull, committing, torn
from rdt_jax.weights._routes import can_read_directly, kept_table, pull_buckets, pull_node_local

__all__ = ["MappedShardedPlan", "PartPlan", "ShardedPlan", "pull_sharded", "pull_sharded_mapped", "sharded_plan"]

#: One run of a part: (piece index, into staging?, destination (address, or
#: offset in staging), source offset in the piece, nbytes).
Run = tuple[int, bool, int, int, int]


class PartPlan:
  """The reads of one trainer process's part of a version: byte runs from
  its pieces into the pull's destinations. Has what the read routes need of
  a plan (`info`, `writes_in_place`, `pairs`, `prepared`).

  Args:
    info: the part's packed layout (its pieces, in order), or None for a
      part sent as a pytree.
    runs: the part's `Run`s.
    piece_bytes: each piece's size.
  """

  def __init__(self, info: PackedLayoutInfo | None, runs: list[Run], piece_bytes: list[int]):
    self.info = info
    self.runs = runs
    self.piece_bytes = piece_bytes
    self.nbytes = sum(n for *_, n in runs)
    #: True if a read writes into the template (runs not into staging).
    self.writes_in_place = any(not staged for _, staged, _, _, _ in runs)
    self._prepared = PreparedReads()

  def pairs(self, staging: int) -> list[tuple[int, int, int]]:
    """(local address, offset in the part's packed buffer, nbytes) of every
    run, with the pull's staging buffer at `staging`."""
    assert self.info is not None
    offsets = self.info.layout.offsets
    return [(staging + at if staged else at, offsets[k] + s, n) for k, staged, at, s, n in self.runs]

  def prepared(self, remote: int, staging: int) -> node_local.Prepared:
    """The node-local read of the part's buffer at publisher address
    `remote`, prepared once per pair of addresses."""
    return self._prepared.get(remote, staging, self.pairs)

  def copy_from(self, pieces: Sequence[np.ndarray], staging: int, where: str) -> None:
    """Copies the runs out of the part's pieces, received as host arrays.

    Raises:
      MetadataError: for pieces that are not the part's (count or sizes).
    """
    if [int(p.nbytes) for p in pieces] != self.piece_bytes:
      raise MetadataError(where, "value", "does not hold the pieces its handle lists")
    memmove = ctypes.memmove
    pointers = [_memory.host_pointer(p) for p in pieces]
    for k, staged, at, s, n in self.runs:
      memmove(staging + at if staged else at, pointers[k] + s, n)


class ShardedPlan:
  """A subscriber's plan for one combined structure and template.

  Args:
    parts: each trainer process's `PartLayout`, in process order.
    layouts: each part's packed layout (None for a part sent as a pytree).
    template: the subscriber's flattened template, by path.
    atomic: as `WeightSubscriber`'s.

  Raises:
    UnsupportedLeafError: as `PackedPlan`, naming the template leaf.
    MetadataError: for a part whose layout does not hold its pieces.
  """

  def __init__(self, parts: Sequence[PartLayout], layouts: Sequence[PackedLayoutInfo | None],
               template: dict[str, Any], atomic: bool):
    first = parts[0]
    itemsizes = [_dlpack.np_dtype_from_name(what).itemsize for _, _, _, what in first.entries]
    sizes = [math.prod(shape) * n for (_, _, shape, _), n in zip(first.entries, itemsizes)]
    self.info = PackedLayoutInfo(_layout.PackedLayout.of(sizes), first.treedef, first.positions,
                                 tuple(tuple(shape) for _, _, shape, _ in first.entries))
    #: Where every needed byte goes, and how the pulled leaves are made.
    self.dest = PackedPlan(self.info, first.entries, template, atomic)
    destinations = [_destinations(leaf, atomic) for leaf in self.dest.leaves]
    self.parts: list[PartPlan] = []
    for part, info in zip(parts, layouts):
      if info is not None and len(info.layout.sizes) != len(part.pieces):
        raise MetadataError(f"trainer process {part.process}", "packed layout",
                            f"has {len(info.layout.sizes)} leaves for {len(part.pieces)} pieces")
      runs: list[Run] = []
      for k, (i, box) in enumerate(part.pieces):
        if info is not None and info.layout.sizes[k] != math.prod(_dlpack.box_shape(box)) * itemsizes[i]:
          raise MetadataError(f"trainer process {part.process}", f"packed layout of piece {k}",
                              f"has {info.layout.sizes[k]} bytes for box {box} of {first.entries[i][0]}")
        for staged, at, want in destinations[i]:
          common = _dlpack.intersect(box, want)
          if common is not None:
            runs += [(k, staged, at + d, s, n) for s, d, n in _layout.copy_runs(box, want, common, itemsizes[i])]
      self.parts.append(PartPlan(info, runs, [math.prod(_dlpack.box_shape(box)) * itemsizes[i]
                                              for i, box in part.pieces]))


def _destinations(leaf: Any, atomic: bool) -> list[tuple[bool, int, Any]]:
  """(into staging?, address or staging offset, global box held there) of
  each buffer a `PackedPlan` leaf receives into."""
  if leaf.kind == "in_place":
    return [(True, leaf.staged, leaf.box)] if atomic else [(False, leaf.pointer, leaf.box)]
  if leaf.pieces is not None:
    return [(True, leaf.staged + at, piece) for (at, _), piece in zip(leaf.pieces, leaf.layout.pieces)]
  return [(True, leaf.staged, leaf.box)]


_pool: list[concurrent.futures.ThreadPoolExecutor] = []
_pool_lock = threading.Lock()


def _parts_pool() -> concurrent.futures.ThreadPoolExecutor:
  """The threads that read the parts of a pull (one per part, at once)."""
  with _pool_lock:
    if not _pool:
      _pool.append(concurrent.futures.ThreadPoolExecutor(_limits.WEIGHTS_PART_THREADS,
                                                         thread_name_prefix="rdt-jax-part"))
    return _pool[0]


def _part_pull(pull: Pull, part: WeightsHandle) -> Pull:
  """A part's own pull: its handle and label; the subscriber's version is
  set by the whole pull, not by a part."""
  return dataclasses.replace(pull, handle=part, label=label(part), set_version=lambda _: None, route="ray",
                             objects=0, kept=None, layout=None)


def _each(parts: Sequence[Pull], step: Callable[[int, Pull], Any]) -> list[Any]:
  """`step(i, part)` for every part at once; once all ended, the first
  error (in process order) is raised, naming its trainer process."""
  futures = [_parts_pool().submit(step, i, p) for i, p in enumerate(parts)]
  concurrent.futures.wait(futures)
  for i, f in enumerate(futures):
    error = f.exception()
    if error is not None:
      error.add_note(f"rdt_jax: from trainer process {i} of {len(parts)} ({parts[i].label}).")
      raise error
  return [f.result() for f in futures]


def _ask_layouts(pull: Pull, subs: list[Pull]) -> list[tuple[PartLayout, PackedLayoutInfo | None]]:
  """Every part's layout and, for a part packed in host memory, its packed
  layout, asked of its publisher (all at once) and checked: one structure,
  every element of every leaf covered once."""
  handle = pull.handle
  parts = [p.handle.shards for p in subs]
  if any(part is None or part.digest != parts[0].digest for part in parts):  # type: ignore[union-attr]
    raise MetadataError(pull.label, "parts", "are not parts of one structure (combine them with WeightsHandle.combine)")

  def layout_of(i: int, sub: Pull) -> tuple[PartLayout, PackedLayoutInfo | None]:
    answer = sub.ask(want_structure=True)
    if answer is None:
      raise RuntimeError(f"Trainer process {i} no longer knows the structure of version {handle.version}.")
    layout = check_part_layout(answer.shards, cast(ShardedPart, sub.handle.shards), sub.label)
    source = sub.handle.packed
    if source is None or source.device >= 0:
      return layout, None
    if answer.packed is None:
      raise RuntimeError(f"Trainer process {i} no longer knows the packed structure of version {handle.version}.")
    check_layout(answer.packed, answer.entries, sub.label)
    return layout, answer.packed

  answers = _each(subs, layout_of)
  check_coverage([layout for layout, _ in answers])  # a handle made by hand, too: no template byte left unwritten
  return answers


def sharded_plan(pull: Pull, template: list[tuple[str, Any]], atomic: bool,
                 answers: list[tuple[PartLayout, PackedLayoutInfo | None]] | None = None) -> ShardedPlan:
  """The plan of the pulled combined structure and its parts' routes, made
  at its first pull: every part's layout asked (`_ask_layouts`, unless the
  caller asked them as `answers`), then the template checked against the
  global structure."""
  if answers is None:
    answers = _ask_layouts(pull, [_part_pull(pull, part) for part in pull.handle.parts])
  layouts = [layout for layout, _ in answers]
  check_template(template, layouts[0].entries)
  return ShardedPlan(layouts, [packed for _, packed in answers], dict(template), atomic)


def pull_sharded(pull: Pull, plan: ShardedPlan, atomic: bool) -> tuple[Any, int]:
  """A pull of a combined handle, the subscriber's lock held, with the plan
  `sharded_plan` made for its structure and routes: each part's needed
  bytes read from its trainer process, all parts at once. Returns the
  pulled value and the bytes read.

  Raises:
    StaleWeightsError: a part's version is not kept (before or after its
      read), naming its trainer process.
    ValueError, UnsupportedLeafError: a template that does not fit.
    RayDirectTransportError, ray.exceptions.RayError: a part could not be
      read (its trainer process died, say), naming it.
  """
  handle = pull.handle
  subs = [_part_pull(pull, part) for part in handle.parts]
  for sub, part in zip(subs, plan.parts):
    if part.info is not None:
      check_source(sub.handle.packed, sub.label, cast(PackedPlan, part), handle.version)
  rest = cast(ShardedPart, handle.parts[0].shards).rest
  if not isinstance(rest, tuple) or len(plan.info.array_positions) + len(rest) != plan.info.treedef.num_leaves:
    raise MetadataError(pull.label, "parts[0].shards.rest", "does not hold the structure's non-array leaves")
  plan.dest.check_targets()
  staging = _memory.host_pool.acquire(plan.dest.staging_bytes) if plan.dest.staging_bytes else None
  base = 0 if staging is None else _memory.host_pointer(staging)
  needed = [i for i, part in enumerate(plan.parts) if part.runs]

  def check(i: int, sub: Pull) -> bool:
    """Before any byte may reach the template: the part's version is kept.
    True if its publisher's memory can be read from here."""
    source = sub.handle.packed
    if i not in needed:
      return False
    if source is not None and plan.parts[i].info is not None and can_read_directly(source):
      try:
        kept_table(sub, source)
        return True
      except PermissionError:
        pass
    sub.ask()
    return False

  direct = _each(subs, check)
  pull.check_cancelled()
  if not atomic and any(plan.parts[i].writes_in_place for i in needed):
    pull.tear()

  def read(i: int, sub: Pull) -> None:
    part = plan.parts[i]
    if i not in needed:
      return
    if part.info is None:
      _read_tree(sub, part, base)
    elif not (direct[i] and pull_node_local(sub, cast(PackedPlan, part), staging, atomic)):
      pull_buckets(sub, cast(PackedPlan, part), staging, atomic)

  _each(subs, read)
  pull.check_cancelled()
  routes = {sub.route for i, sub in enumerate(subs) if i in needed}
  pull.route = routes.pop() if len(routes) == 1 else "mixed"
  pull.objects = sum(sub.objects for sub in subs)
  pull.kept = next((subs[i].kept for i in needed), None)
  with committing(pull, plan.dest.commits_into_template):
    arrays = plan.dest.commit(staging)
  return unflatten(plan.info, arrays, rest), sum(plan.parts[i].nbytes for i in needed)


def _read_tree(sub: Pull, part: PartPlan, staging: int) -> None:
  """A part sent as a pytree (or packed in device memory: asked for as
  one): its value through Ray, the runs copied out of its pieces."""
  import jax

  handle = sub.handle
  ref = handle.ref if handle.packed is None else ask_object(handle, sub.label, sub.left(), sub.current)
  value = ray.get(ref, timeout=sub.left())
  sub.route, sub.objects = "ray", 1
  pieces = [x if isinstance(x, np.ndarray) else _dlpack.convert_leaf(x, "numpy", sub.label)
            for x in jax.tree_util.tree_leaves(value)]
  part.copy_from(pieces, staging, sub.label)
  del value, pieces
  sub.ask(after_read=True)


@dataclasses.dataclass(frozen=True)
class MappedShardedPlan:
  """The plan of a subscriber with `source=` (an engine's own names and
  layouts) for one combined structure and its parts' routes, whole: the
  mapping, the host arrays the mapped published leaves are assembled in
  (one more copy of those leaves in memory, where a one-process version
  needs about a bucket), and the plan of the reads into them. One piece,
  made and dropped together: the reads always write into these arrays.

  Attributes:
    mapped: the mapping into the engine's tensors.
    arrays: the host array of each published leaf the mapping reads, by path.
    reads: the plan of the combined version's reads into `arrays` (leaves
      the mapping does not read are not read).
  """

  mapped: MappedPlan
  arrays: dict[str, np.ndarray]
  reads: ShardedPlan

  @classmethod
  def make(cls, pull: Pull, template: list[tuple[str, Any]], source: Source, atomic: bool) -> MappedShardedPlan:
    """Made at the combined structure's first pull: every part's layout
    asked once, the mapping checked against the global structure.

    Raises:
      As `sharded_plan`, and as `MappedPlan`.
    """
    answers = _ask_layouts(pull, [_part_pull(pull, part) for part in pull.handle.parts])
    entries = answers[0][0].entries
    mapped = MappedPlan(entries, template, source, atomic)
    arrays: dict[str, np.ndarray] = {}
    flat: list[tuple[str, Any]] = []
    for path, _, shape, what in entries:
      if path in mapped.writes or not shape:
        arrays[path] = np.empty(shape, _dlpack.np_dtype_from_name(what))
        flat.append((path, arrays[path]))
      else:  # not read: an empty Slice of it
        empty = np.empty((0, *shape[1:]), _dlpack.np_dtype_from_name(what))
        flat.append((path, _layout.Slice((slice(0, 0),), into=empty)))
    # Into the plan's own arrays: the engine's tensors are written after.
    return cls(mapped, arrays, sharded_plan(pull, flat, False, answers))


def pull_sharded_mapped(pull: Pull, plan: MappedShardedPlan, atomic: bool) -> int:
  """A pull of a combined handle by a subscriber with `source=`, its lock
  held, with its `MappedShardedPlan`; returns the bytes read.

  The published leaves the mapping reads are assembled from every part
  into the plan's host arrays by `pull_sharded`, then each is written
  through the mapping as a one-process mapped pull writes it. With
  `atomic=False` the template is torn from the first of those writes; with
  `atomic=True` they land in staging, committed at the end.

  Raises:
    As `pull_sharded`.
  """
  handle = pull.handle
  mapped = plan.mapped
  mapped.begin()
  # Into this subscriber's own arrays: the engine's tensors are not written yet.
  inner = dataclasses.replace(pull, set_version=lambda _: None)
  _, nbytes = pull_sharded(inner, plan.reads, False)
  pull.route, pull.objects, pull.kept = inner.route, inner.objects, inner.kept
  pull.check_cancelled()
  if not atomic:
    pull.tear()
  try:
    for path, array in plan.arrays.items():
      mapped.write(path, array)
  except BaseException as e:
    if not atomic:
      torn(e, handle.version, "while it wrote the engine's tensors")
    raise
  with committing(pull):
    mapped.finish()
  return nbytes
