"""The hand-off from rdt_jax's serializer to the transport's extract.

The serializer sees each leaf with its pytree path;
`DlpackTransport.extract_tensor_transport_metadata` gets only the leaves Ray
extracted. This module carries each leaf's `DescribedLeaf` from the one to
the other, so a leaf is described once and its error names its path. It is
keyed by the leaves, not the thread: Ray may extract on another thread than
the one that serialized. Kept apart from the Ray wiring (`_ray`) and the
transports so that neither imports the other.
"""

from __future__ import annotations

import contextlib
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rdt_jax import _dlpack, _limits, _memory


class _SerializationState(threading.local):
  """Per-thread state of the rdt_jax serialization in progress, if any.

  A serialization runs on one thread from start to end (Ray's serializer
  itself keeps its out-of-band leaves in thread-local state), so what the
  reducers see while it runs is kept per thread. What must outlive it, the
  descriptions handed to `extract_tensor_transport_metadata`, is published to
  a process-wide map by `finish_serialization`.
  """

  def __init__(self) -> None:
    self.transport: str | None = None
    self.context: Any = None
    self.root: Any = None
    self.paths: dict[int, str] | None = None
    # (tree_flatten's leaves, treedef) of `root`, once flattened; () if jax cannot flatten it.
    self.flat: tuple[Any, ...] | None = None
    # id(leaf) -> (leaf, DescribedLeaf) of the serialization in progress.
    self.described: dict[int, tuple[Any, _dlpack.DescribedLeaf]] = {}
    # The cyclic GC pause of a serialization of many leaves (`record_described`).
    self.gc_pause: contextlib.ExitStack | None = None


serializing = _SerializationState()


def begin_serialization(transport: str, context: Any, root: Any) -> None:
  """Marks this thread as serializing `root` for rdt_jax transport `transport`."""
  serializing.transport, serializing.context, serializing.root = transport, context, root
  serializing.paths, serializing.described, serializing.flat = None, {}, None


def end_serialization() -> None:
  """Ends what `begin_serialization` started on this thread.

  Descriptions not published by `finish_serialization` (the serialization
  failed) are dropped here, so nothing of a failed serialization stays.
  """
  serializing.transport, serializing.context, serializing.root = None, None, None
  serializing.paths, serializing.described, serializing.flat = None, {}, None
  if serializing.gc_pause is not None:
    serializing.gc_pause.close()
    serializing.gc_pause = None


_paths_by_structure: OrderedDict[Any, tuple[str, ...]] = OrderedDict()
_paths_lock = threading.Lock()


def leaf_path(leaf: Any) -> str:
  """The pytree path of `leaf` in the value being serialized ("" if unknown)."""
  if serializing.paths is None:
    serializing.paths = _paths_of(serializing.root)
  return serializing.paths.get(id(leaf), "")


def flattened() -> tuple[list[Any], Any] | None:
  """`jax.tree_util.tree_flatten` of the value being serialized: its leaves
  and treedef, flattened once per serialization; None for a value jax
  cannot flatten (a dict whose keys do not sort)."""
  if serializing.flat is None:
    serializing.flat = _flatten(serializing.root) or ()
  return serializing.flat or None


def _flatten(root: Any) -> tuple[list[Any], Any] | None:
  import jax

  try:
    return jax.tree_util.tree_flatten(root)
  except Exception:  # a value jax cannot flatten: paths stay unknown
    return None


def structure_paths(treedef: Any, root: Any, count: int) -> tuple[str, ...] | None:
  """The pytree path of each of the `count` leaves of `root` (of structure
  `treedef`), in `tree_flatten` order, as `keystr` prints them; None where
  jax cannot name them. Computed once per structure and kept for the last
  `PATHS_KEPT` structures."""
  import jax

  with _paths_lock:
    names = _paths_by_structure.get(treedef)
    if names is not None:
      _paths_by_structure.move_to_end(treedef)
  if names is None or len(names) != count:
    try:
      with_path, _ = jax.tree_util.tree_flatten_with_path(root)
    except Exception:
      return None
    names = tuple(jax.tree_util.keystr(path) for path, _ in with_path)
    if len(names) != count:
      return None
    with _paths_lock:
      _paths_by_structure[treedef] = names
      while len(_paths_by_structure) > _limits.PATHS_KEPT:
        _paths_by_structure.popitem(last=False)
  return names


def _paths_of(root: Any) -> dict[int, str]:
  """id -> pytree path of each leaf of `root` (the first path of a leaf that
  appears twice); {} for a value jax cannot flatten. A value of a structure
  seen before costs a `tree_flatten` (`structure_paths`), none more for the
  value being serialized (`flattened`)."""
  found = flattened() if root is serializing.root and root is not None else _flatten(root)
  if found is None:
    return {}
  flat, treedef = found
  names = structure_paths(treedef, root, len(flat))
  if names is None:
    return {}
  paths: dict[int, str] = {}
  setdefault = paths.setdefault
  for name, x in zip(names, flat):
    setdefault(id(x), name)
  return paths


def structures_kept() -> int:
  """How many structures' leaf paths are kept now (at most `_limits.PATHS_KEPT`)."""
  with _paths_lock:
    return len(_paths_by_structure)


def set_leaf_path(leaf: Any, path: str) -> None:
  """Names `leaf`, an array made during the serialization in progress (a
  typed key's raw data), by `path` for `leaf_path`. The caller keeps `leaf`
  alive until the serialization ends (its id stays unique)."""
  leaf_path(leaf)  # the value's paths, computed once
  assert serializing.paths is not None
  serializing.paths[id(leaf)] = path


def record_described(leaf: Any, described: _dlpack.DescribedLeaf) -> None:
  """Keeps `leaf`'s description for the serialization in progress.

  From the `GC_PAUSE_MIN_LEAVES`-th leaf of a serialization on, the cyclic
  collector is paused until `end_serialization` (`rdt_jax._memory.gc_paused`):
  Ray's pickler runs the reducers, so the pause cannot wrap them from outside
  knowing the leaf count.
  """
  described_now = serializing.described
  described_now[id(leaf)] = (leaf, described)
  if (
      len(described_now) == _limits.GC_PAUSE_MIN_LEAVES
      and serializing.transport is not None
      and serializing.gc_pause is None
  ):
    stack = contextlib.ExitStack()
    stack.enter_context(_memory.gc_paused(len(described_now)))
    serializing.gc_pause = stack


# --------------------------------------------------------------------------
# The hand-off from a finished serialization to extract_tensor_transport_metadata.
#
# Ray may call `extract_tensor_transport_metadata` on another thread than the
# one that serialized the value (an open Ray change runs it on a thread pool),
# so the hand-off is keyed by the leaves themselves: the identities of the
# extracted leaves, in order, which Ray passes on unchanged. An entry holds no
# array: the leaves and the arrays behind their chunks by weak reference, the
# rest of each description (its spec: pytree path, shape, dtype, chunks) as
# is. An entry is taken once, and dropped when a leaf dies or after
# HANDOFF_TTL_S seconds; at most HANDOFF_MAX are kept. Where an entry's
# arrays are gone the leaf is described again under the recorded path; where
# the whole entry is gone, without a path.


@dataclass
class _Handoff:
  leaves: list[Callable[[], Any]]
  # Per leaf: its description without arrays, and weak references to them
  # (None: the one array is the leaf itself, referenced by `leaves`).
  described: list[tuple[_dlpack.DescribedLeaf, tuple[Callable[[], Any], ...] | None] | None]
  created: float


_handoff_lock = threading.Lock()
_handoffs: dict[tuple[int, ...], list[_Handoff]] = {}


def _ref(x: Any) -> Callable[[], Any]:
  try:
    return weakref.ref(x)
  except TypeError:  # a type without weak references: held until taken or expired
    return lambda: x


def _prune(now: float) -> None:
  """Drops expired entries and entries whose leaves died (lock held)."""
  for key in list(_handoffs):
    alive = [
        h for h in _handoffs[key]
        if now - h.created < _limits.HANDOFF_TTL_S and all(r() is not None for r in h.leaves)
    ]
    if alive:
      _handoffs[key] = alive
    else:
      del _handoffs[key]
  while sum(len(v) for v in _handoffs.values()) > _limits.HANDOFF_MAX:
    oldest = min(_handoffs, key=lambda k: _handoffs[k][0].created)
    _handoffs[oldest].pop(0)
    if not _handoffs[oldest]:
      del _handoffs[oldest]


def finish_serialization(leaves: list[Any]) -> None:
  """Publishes the descriptions of this thread's serialization for `leaves`
  (the out-of-band leaves Ray collected, in order), for `take_described` on
  any thread."""
  described = serializing.described
  serializing.described = {}
  if not leaves:
    return
  found: list[tuple[_dlpack.DescribedLeaf, tuple[Callable[[], Any], ...] | None] | None] = []
  new = tuple.__new__  # a third of NamedTuple._replace's time, per leaf
  for leaf in leaves:
    hit = described.get(id(leaf))
    if hit is None or hit[0] is not leaf:
      found.append(None)
      continue
    d = hit[1]
    arrays = d.arrays
    bare = new(_dlpack.DescribedLeaf, (d.spec, d.pointers, d.device_indices, ()))
    # The common case, one chunk whose array is the leaf itself: the leaf's
    # own reference (the hand-off's key) covers it; None stands for (leaf,).
    if len(arrays) == 1 and arrays[0] is leaf:
      found.append((bare, None))
    else:
      found.append((bare, tuple(_ref(a) for a in arrays)))
  if not any(f is not None for f in found):
    return
  entry = _Handoff([_ref(x) for x in leaves], found, time.monotonic())
  with _handoff_lock:
    _prune(entry.created)
    _handoffs.setdefault(tuple(id(x) for x in leaves), []).append(entry)


def pending_handoffs() -> int:
  """How many published hand-offs wait for their extract (after pruning)."""
  with _handoff_lock:
    _prune(time.monotonic())
    return sum(len(v) for v in _handoffs.values())


def take_described(leaves: list[Any]) -> list[_dlpack.DescribedLeaf]:
  """The DescribedLeaf for each leaf of an object being stored, on any thread.

  Uses what the serializer published for exactly these leaves, describing
  again where it has nothing (without a pytree path), e.g. for a retried task
  or an expired hand-off.
  """
  key = tuple(id(x) for x in leaves)
  entry = None
  with _handoff_lock:
    for i, h in enumerate(_handoffs.get(key, [])):
      if all(r() is x for r, x in zip(h.leaves, leaves)):
        entry = _handoffs[key].pop(i)
        break
    if key in _handoffs and not _handoffs[key]:
      del _handoffs[key]
  out = []
  new = tuple.__new__
  for i, leaf in enumerate(leaves):
    hit = entry.described[i] if entry is not None else None
    if hit is None:
      out.append(_dlpack.describe(leaf, f"<leaf {i}>"))
      continue
    d, refs = hit
    arrays = (leaf,) if refs is None else tuple(r() for r in refs)
    if refs is None or all(a is not None for a in arrays):
      out.append(new(_dlpack.DescribedLeaf, (d.spec, d.pointers, d.device_indices, arrays)))
    else:  # the chunks' arrays (shards made for the description) are gone
      out.append(_dlpack.describe(leaf, d.spec.path))
  return out
