"""What a part of a multi-process version says of itself, and the check that
the parts of a version cover it.

A version published by every process of a multi-controller trainer is one
part per process (`rdt_jax.weights._shards` makes them). Each part's handle
carries a small `ShardedPart` (its process, the global structure's digest,
the non-array leaves); what does not change from version to version, which
box of which global leaf each piece holds (`PartLayout`), its publisher
sends once per structure, with the structure (`Published.shards`), so a
handle stays small whatever the model's size. `check_coverage` holds the
parts of a version against the global structure when `WeightsHandle.combine`
first meets them, and again when a subscriber plans their pull.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rdt_jax import _dlpack
from rdt_jax._dlpack import Box
from rdt_jax._metadata import MetadataError

__all__ = ["PartLayout", "ShardedPart", "check_coverage", "check_part_layout"]


@dataclass(frozen=True)
class ShardedPart:
  """What one trainer process's handle says of its part of a version.

  Attributes:
    process: the publishing process's `jax.process_index()`.
    processes: `jax.process_count()` of the trainer.
    digest: the digest of the global structure (leaf paths, global shapes,
      dtypes and the pytree), the same in every process publishing it.
    rest: the global tree's non-array leaves, in pytree order.
  """

  process: int
  processes: int
  digest: str
  rest: tuple[Any, ...] = ()


@dataclass(frozen=True)
class PartLayout:
  """What one process's part of a structure holds (sent once per structure).

  Attributes:
    process: the publishing process's `jax.process_index()`.
    digest: the global structure's digest (as `ShardedPart.digest`).
    entries: the global structure's array leaves (`LeafEntry`s: global
      shapes).
    treedef: the global tree's pytree structure.
    positions: the indices of `treedef`'s leaves that are array leaves.
    pieces: for each piece of the part, in the order the part's own tree
      flattens (its packed layout's order): (index of its leaf in
      `entries`, the global box it holds).
  """

  process: int
  digest: str
  entries: tuple[tuple[str, str, tuple[int, ...], str], ...]
  treedef: Any
  positions: tuple[int, ...]
  pieces: tuple[tuple[int, Box], ...]


def check_part_layout(layout: Any, part: ShardedPart, where: str) -> PartLayout:
  """`layout`, as a publisher sent it for `part`, checked to be a
  `PartLayout` of that process and structure.

  Raises:
    MetadataError: naming the process, for anything else.
  """
  if not (isinstance(layout, PartLayout) and layout.process == part.process and layout.digest == part.digest
          and isinstance(layout.entries, tuple) and isinstance(layout.pieces, tuple)):
    raise MetadataError(where, "structure.shards", f"is not the layout of trainer process {part.process}'s part")
  return layout


def check_coverage(parts: Sequence[PartLayout]) -> None:
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
