"""What a part of a multi-process version says of itself, and the check that
the parts of a version cover it.

A version published by every process of a multi-controller trainer is one
part per process (`rdt_jax.weights._shards` makes them; `WeightsHandle`
carries each one's `ShardedPart`); `check_coverage` holds the parts of one
version against its global structure when `WeightsHandle.combine` meets
them for the first time.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rdt_jax import _dlpack
from rdt_jax._dlpack import Box

__all__ = ["ShardedPart", "check_coverage"]


@dataclass(frozen=True)
class ShardedPart:
  """What one trainer process's handle says of its part of a version.

  Attributes:
    process: the publishing process's `jax.process_index()`.
    processes: `jax.process_count()` of the trainer.
    digest: the digest of the global structure (leaf paths, global shapes,
      dtypes and the pytree), the same in every process publishing it.
    entries: the global structure's array leaves (`LeafEntry`s: global
      shapes).
    treedef: the global tree's pytree structure.
    positions: the indices of `treedef`'s leaves that are array leaves.
    pieces: for each piece of this part, in the order the part's own tree
      flattens: (index of its leaf in `entries`, the global box it holds).
    rest: the global tree's other leaves (in `treedef` order).
  """

  process: int
  processes: int
  digest: str
  entries: tuple[tuple[str, str, tuple[int, ...], str], ...]
  treedef: Any
  positions: tuple[int, ...]
  pieces: tuple[tuple[int, Box], ...]
  rest: tuple[Any, ...] = ()


def check_coverage(parts: Sequence[ShardedPart]) -> None:
  """Raises unless the pieces of `parts` cover every leaf of the structure
  exactly once (naming the leaf, and the processes at fault)."""
  entries = parts[0].entries
  by_leaf: list[list[tuple[Box, int]]] = [[] for _ in entries]
  for part in parts:
    for i, box in part.pieces:
      if not 0 <= i < len(entries) or len(box) != len(entries[i][2]):
        raise ValueError(f"Process {part.process} published a piece that is not of the structure's leaves.")
      by_leaf[i].append((box, part.process))
  for (path, _, shape, _), pieces in zip(entries, by_leaf):
    size = math.prod(shape)
    for n, (a, pa) in enumerate(pieces):
      if any(not 0 <= lo <= hi <= s for (lo, hi), s in zip(a, shape)):
        raise ValueError(f"Process {pa} published a piece {a} of leaf {path} outside its shape {shape}.")
      for b, pb in pieces[n + 1:]:
        if _dlpack.intersect(a, b) is not None:
          raise ValueError(
              f"Leaf {path} has two pieces for one part of it: {a} from process {pa} and {b} from process {pb}. "
              "Each element must come from one process (a replicated shard is published by its first replica).")
    covered = sum(math.prod(_dlpack.box_shape(b)) for b, _ in pieces)
    if covered != size:
      have = sorted({p for _, p in pieces})
      raise ValueError(
          f"Leaf {path} (shape {tuple(shape)}) is not covered: the pieces of processes {have} hold {covered} of its "
          f"{size} elements. Every process of the trainer must publish the same version of the same tree.")
