"""Versions published by every process of a multi-controller JAX trainer.

A trainer past one process runs `jax.distributed`: one process per host (or
per group of devices), global `jax.Array`s whose shards are spread over every
process. No process holds a whole version, so each publishes its own part:

* `Splitter.split` (in each trainer process, from `WeightPublisher.publish`)
  takes the shards of the tree this process holds with `replica_id == 0` (a
  replicated shard is published once, by its first replica) and makes them a
  tree of their own, the part's "pieces", published like any other version
  (packed in the process's own buffer where it can be). Leaves that are not
  global arrays (numpy, torch, a jax array on this process's devices alone)
  are taken to be the same in every process and published by process 0. The
  part's handle carries a `ShardedPart` (`rdt_jax.weights._parts`): the
  global structure, and which box of which leaf each piece holds.
* `WeightsHandle.combine` (wherever the handles meet: the driver, or an actor
  collecting them) checks that the parts are one version of one structure
  from every process, and that their pieces cover every leaf exactly once,
  and makes one handle of them (`WeightsHandle.parts`), which a subscriber
  pulls like any other (`rdt_jax.weights._sharded_route`).

No cross-process step is added to the trainer's publish: each process packs
what it holds.
"""

from __future__ import annotations

import hashlib
import threading
from dataclasses import dataclass, replace
from typing import Any

from rdt_jax import _dlpack
from rdt_jax._dlpack import Box
from rdt_jax.weights._handle import LeafEntry, entry_of
from rdt_jax.weights._parts import PartLayout, ShardedPart

__all__ = ["Splitter"]


def _signature(x: Any) -> Any:
  """What must not change for a leaf's pieces to stay where they were."""
  if _dlpack.framework_of(x) == "jax":
    return x.aval, x.sharding
  shape = getattr(x, "shape", None)
  return type(x) if shape is None else (type(x), tuple(shape), str(getattr(x, "dtype", "")))


def _key(digest: str, i: int, box: Box) -> str:
  """A piece's key in the part's tree (sorted as jax sorts dict keys: leaf,
  then box). The global structure's digest in every key makes the part's
  own structure digest change with the global structure."""
  return f"{digest}|{i:09d}@" + ",".join(f"{a}:{b}" for a, b in box)


@dataclass
class _Known:
  """A structure `split` has seen: its signature, and what it takes of a tree."""

  signature: tuple[Any, ...]
  part: ShardedPart
  layout: PartLayout
  take: list[tuple[str, int, int]]  # per piece: (key, leaf position in the flat tree, shard index or -1: the leaf)
  rest: list[int]  # the positions of the tree's other leaves


class Splitter:
  """One publisher's `split`, remembering the last structure it split."""

  def __init__(self) -> None:
    self._known: _Known | None = None
    self._lock = threading.Lock()

  def split(self, tree: Any) -> tuple[dict[str, Any], ShardedPart, PartLayout] | None:
    """This process's part of `tree`: its pieces (by key, the arrays to
    publish), its `ShardedPart` and its structure's `PartLayout`. None if
    no leaf of `tree` is a global array spanning processes.

    Raises:
      UnsupportedLeafError: naming the leaf, for a typed PRNG key array in
        a tree that spans processes.
    """
    import jax

    if jax.process_count() == 1:
      return None
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    signature = (treedef, *map(_signature, leaves))
    with self._lock:
      known = self._known
    if known is None or known.signature != signature:
      if not any(_dlpack.spans_processes(x) for x in leaves):
        return None
      known = _analyse(tree, treedef, signature)
      with self._lock:
        self._known = known
    pieces: dict[str, Any] = {}
    shards: dict[int, list[Any]] = {}
    for key, position, shard in known.take:
      x = leaves[position]
      if shard < 0:
        pieces[key] = x
        continue
      if position not in shards:
        shards[position] = _dlpack.shard_arrays(x)
      pieces[key] = shards[position][shard]
    return pieces, replace(known.part, rest=tuple(leaves[i] for i in known.rest)), known.layout


def _analyse(tree: Any, treedef: Any, signature: tuple[Any, ...]) -> _Known:
  """The `_Known` of a new structure (see `Splitter.split`)."""
  import jax

  flat, _ = jax.tree_util.tree_flatten_with_path(tree)
  process = jax.process_index()
  leaves: list[tuple[int, Any]] = []  # (position in the flat tree, array leaf)
  entries: list[LeafEntry] = []
  for position, (p, x) in enumerate(flat):
    if _dlpack.is_prng_key(x):
      raise _dlpack.UnsupportedLeafError(
          jax.tree_util.keystr(p), "is a typed PRNG key array in a tree that spans processes; a multi-process publish "
          "sends arrays of numbers",
          "Publish its key data (jax.random.key_data) and wrap it with jax.random.wrap_key_data after the pull.")
    if _dlpack.is_array(x):
      leaves.append((position, x))
      entries.append(entry_of(jax.tree_util.keystr(p), x))
  digest = hashlib.blake2b(f"{tuple(entries)!r}|{treedef}".encode(), digest_size=12).hexdigest()
  found: list[tuple[str, int, int, int, Box]] = []  # (key, position, shard index or -1, leaf, box)
  for i, (position, x) in enumerate(leaves):
    if _dlpack.spans_processes(x):
      found += [(_key(digest, i, box), position, j, i, box) for j, box in _dlpack.owned_shards(x)]
    elif process == 0:
      box = _dlpack.full_box(tuple(int(n) for n in x.shape))
      found.append((_key(digest, i, box), position, -1, i, box))
  found.sort(key=lambda t: t[0])  # the order the pieces' dict flattens in
  take = [(key, position, j) for key, position, j, _, _ in found]
  positions = tuple(position for position, _ in leaves)
  part = ShardedPart(process, jax.process_count(), digest)
  layout = PartLayout(process, digest, tuple(entries), treedef, positions, tuple((i, box) for *_, i, box in found))
  taken = set(positions)
  return _Known(signature, part, layout, take, [i for i in range(len(flat)) if i not in taken])
