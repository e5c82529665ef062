"""A pack's leaf table: made once per structure on each side, checked once.

A return of many small jax leaves travels as one host buffer
(`rdt_jax._leaf_pack`) with a table in its metadata: each packed leaf's spec
(path, shape, dtype; its chunk laid out in the buffer as `host_layout` places
it), in pack order, and its position among all the value's leaves. A training
loop or a generator returns the same structure again and again, so the table
is the same every time; made per object it cost several microseconds per leaf
in every process it crossed: the specs made and encoded on the producer,
decoded and encoded again on the owner, decoded and checked on the consumer.
Here a table is one immutable `PackTable`:

* the producer makes one per structure (`make`; `rdt_jax._leaf_pack` reuses
  it while the leaves a serialization meets are those it was made for);
* its wire form (`CompactLeaves` and `CompactInts`, `rdt_jax._compact`) is
  encoded once per table (`wire`);
* a process that unpickles a table (the owner, each consumer) maps a wire form
  it has seen before to the table it decoded then (`received`, keyed by the
  form's exact content), and a table is checked once (`PackTable.problem`).

Tables are kept per process, the most recently used last, at most
`_limits.PACK_TABLES_KEPT`; a forgotten one is decoded and checked again.
Nothing is trusted for being cached: a received table is found by the exact
bytes that arrived, so it is what those bytes decode to, and the checks of an
object against its own metadata (its buffer's size, its other leaves) run for
every object (`rdt_jax._metadata`).
"""

from __future__ import annotations

import itertools
import threading
from collections import OrderedDict
from collections.abc import Sequence
from operator import itemgetter
from typing import Any

from rdt_jax import _limits
from rdt_jax._compact import CompactInts, CompactLeaves, Undecodable, length_of
from rdt_jax._dlpack import LeafSpec, spec_problem
from rdt_jax._memory import aligned

__all__ = ["PackTable", "counts", "keep", "make", "of", "received", "table_problem", "wire"]

_SIGNATURE = itemgetter(1, 2, 3, 4, 5, 6)

#: A check's finding: (field, problem, leaf path).
Problem = tuple[str, str, str]


class PackTable:
  """One pack's leaf table. Immutable: one object serves every value of its
  structure, in every thread.

  Attributes:
    specs: each packed leaf's spec, in pack order.
    positions: each packed leaf's position among all the leaves of the value,
      in the order Ray's serializer met them (the order a positional target
      lists them in).
  """

  __slots__ = ("_key", "_layout", "_problem", "_wire", "positions", "specs")

  def __init__(self, specs: Sequence[Any], positions: Sequence[Any]):
    self.specs = specs
    self.positions = positions
    self._key: tuple | None = None  # the wire form's content, where it was received
    self._layout: tuple[list[int], list[int], int] | None = None
    self._problem: list[Problem | None] = []  # [] until checked
    self._wire: tuple[Any, Any] | None = None

  def problem(self) -> Problem | None:
    """What makes this table unreadable, as `(field, problem, path)` with
    `field` named as in the metadata (`packed[1][3].shape`), or None; found
    once per table (`table_problem`)."""
    if not self._problem:
      found = table_problem(self.specs, self.positions)
      with _lock:
        _counts["checked"] += 1
      self._problem.append(found)
    return self._problem[0]

  def layout(self) -> tuple[list[int], list[int], int]:
    """Where each packed leaf lies in the pack buffer: per leaf its start and
    its size in bytes, and the bytes the buffer needs in all (`host_layout`'s
    offsets: each leaf on a 64-byte boundary). Only for a table whose
    `problem` is None (or made by the producer from its own leaves)."""
    if self._layout is None:
      starts, sizes, total = [], [], 0
      for spec in self.specs:
        nbytes = spec.chunks[0].nbytes
        starts.append(total)
        sizes.append(nbytes)
        total += aligned(nbytes)
      self._layout = (starts, sizes, total)
    return self._layout

  def wire(self) -> tuple[Any, Any]:
    """The table's pickled form (specs, positions), encoded once."""
    if self._wire is None:
      specs: Any = self.specs
      positions: Any = self.positions
      if isinstance(specs, (list, tuple)):
        specs = (CompactLeaves.encode(specs) if specs else None) or list(specs)
      if isinstance(positions, (list, tuple)):
        ints = all(type(p) is int for p in positions)
        positions = (CompactInts.encode(positions) if positions and ints else None) or list(positions)
      self._wire = (specs, positions)  # anything else pickled as it is (and refused on arrival)
    return self._wire


def table_problem(specs: Any, positions: Any) -> Problem | None:
  """What makes `specs` and `positions` (from another process) no pack
  table, or None: each spec a consistent unsharded host jax `LeafSpec` of one
  chunk (each distinct signature checked once), one position per spec,
  non-negative ints, increasing. Whether the positions fit the value's other
  leaves is the object's to check."""
  if not isinstance(specs, (list, tuple)) or not specs:
    return "packed[1]", f"is {specs!r:.200}, not a list of leaf specs", ""
  first: dict[Any, int] = {}
  for i, spec in enumerate(specs):
    if type(spec) is not LeafSpec or tuple.__len__(spec) != 7 or type(spec.path) is not str:
      return f"packed[1][{i}]", f"is a {type(spec).__name__}, not a LeafSpec", ""
    try:
      first.setdefault(_SIGNATURE(spec), i)
    except TypeError:
      return f"packed[1][{i}]", "has an unhashable field", spec.path
  for i in first.values():
    spec = specs[i]
    problem = spec_problem(spec)
    if problem is not None:
      return f"packed[1][{i}].{problem[0]}", problem[1], spec.path
    if spec.framework != "jax" or spec.device != "cpu" or spec.sharding is not None or len(spec.chunks) != 1:
      return f"packed[1][{i}]", "is not an unsharded host jax leaf", spec.path
  if not isinstance(positions, (list, tuple)) or len(positions) != len(specs):
    return "packed[2]", f"holds {length_of(positions)} entries for {len(specs)} packed leaves", ""
  for i, p in enumerate(positions):
    if type(p) is not int or p < 0:
      return f"packed[2][{i}]", f"is {p!r}, not a non-negative int", ""
  if any(a >= b for a, b in itertools.pairwise(positions)):
    return "packed[2]", "is not increasing", ""
  return None


# --------------------------------------------------------------------------
# The tables this process keeps: by identity of their specs (what metadata
# holds), and, for tables it received, by the content of their wire form.

_lock = threading.Lock()
_kept: OrderedDict[int, PackTable] = OrderedDict()  # id(table.specs) -> table, most recent last
_by_wire: dict[tuple, PackTable] = {}
_counts = {"made": 0, "decoded": 0, "checked": 0}


def counts() -> dict[str, int]:
  """How many pack tables this process made (`make`, producer), decoded from
  a wire form it had not kept (`received`), and checked (`PackTable.problem`);
  and how many it keeps now (`kept`, at most `_limits.PACK_TABLES_KEPT`)."""
  with _lock:
    return {**_counts, "kept": len(_kept)}


def _keep(table: PackTable) -> None:
  """Keeps `table` (lock held), forgetting the least recently used past the bound."""
  _kept[id(table.specs)] = table
  _kept.move_to_end(id(table.specs))
  while len(_kept) > _limits.PACK_TABLES_KEPT:
    _, old = _kept.popitem(last=False)
    if old._key is not None and _by_wire.get(old._key) is old:
      del _by_wire[old._key]


def make(specs: Sequence[LeafSpec], positions: Sequence[int]) -> PackTable:
  """Producer: the table of a pack of leaves `specs` at `positions`, kept."""
  table = PackTable(tuple(specs), tuple(positions))
  with _lock:
    _counts["made"] += 1
    _keep(table)
  return table


def keep(table: PackTable) -> None:
  """Producer: keeps `table` (again, if it was forgotten), as most recently used."""
  with _lock:
    _keep(table)


def of(specs: Any) -> PackTable | None:
  """The kept table whose specs are `specs` (the same object), or None."""
  with _lock:
    table = _kept.get(id(specs))
    if table is None or table.specs is not specs:
      return None
    _kept.move_to_end(id(specs))
    return table


def wire(specs: Any, positions: Any) -> tuple[Any, Any]:
  """The pickled form of a pack's `specs` and `positions`: its kept table's,
  encoded once, or (for a table this process does not keep) encoded now."""
  table = of(specs)
  if table is None or table.positions is not positions:
    table = PackTable(specs, positions)
  return table.wire()


def received(specs_form: Any, positions_form: Any) -> tuple[Any, Any]:
  """The (specs, positions) a pack's pickled form stands for: a kept table's
  where this exact form was received before, else decoded now (and kept);
  an `Undecodable` in place of what could not be decoded (the metadata's
  checks refuse it). Forms that are not compact pass through as they are."""
  key = _wire_key(specs_form, positions_form)
  if key is not None:
    with _lock:
      table = _by_wire.get(key)
      if table is not None and _kept.get(id(table.specs)) is table:
        _kept.move_to_end(id(table.specs))
        return table.specs, table.positions
  try:
    specs = tuple(specs_form.decode()[0]) if type(specs_form) is CompactLeaves else specs_form
    positions = tuple(positions_form.decode()) if type(positions_form) is CompactInts else positions_form
  except (ValueError, TypeError, IndexError, OverflowError, AttributeError) as e:
    return Undecodable(str(e)), positions_form
  if key is None:
    return specs, positions
  table = PackTable(specs, positions)
  table._key = key
  with _lock:
    _counts["decoded"] += 1
    _by_wire[key] = table
    _keep(table)
  return table.specs, table.positions


def _wire_key(specs_form: Any, positions_form: Any) -> tuple | None:
  """The exact content of a compact pickled pack table, hashable, or None."""
  if type(specs_form) is not CompactLeaves or type(positions_form) is not CompactInts:
    return None
  key = (
      specs_form.paths, specs_form.index, specs_form.signatures, positions_form.typecode, positions_form.data
  )
  if not (type(key[0]) is str and type(key[1]) is bytes and type(key[2]) is list and type(key[3]) is str
          and type(key[4]) is bytes):
    return None
  # The signatures by their repr: exact where equality is not (1 == True, a
  # shape that is a list), and a handful per table.
  return (key[0], key[1], repr(key[2]), key[3], key[4])
