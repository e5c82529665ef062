"""The metadata fuzz, extended to weight sync: corrupted or hostile packed
layouts, handles and kept-versions tables never crash a subscriber, never
write outside its template, and never deliver bytes the publisher did not
pack.

No Ray: one process plays publisher and subscriber of a packed version (the
publisher's `Stream` and `KeptTable`, the subscriber's `PackedPlan` and its
node-local read of the publisher's memory), as a pull on the trainer's host
does. Each case corrupts one field of what the publisher sends:

* the structure's layout (offsets, sizes, total, shapes, array positions)
  and its published leaves (shape, dtype, kind);
* a handle's `PackedSource` (addresses, size, slot count, non-array leaves,
  digest), either garbled (its digest no longer matches) or forged (its
  digest recomputed, as a hostile publisher would);
* the words of the kept-versions table.

Then it runs what a pull runs, in order, into sentinel-filled templates
fenced by guard bytes: the pull either refuses with `MetadataError` (or the
template check's `ValueError`, or `ForeignTable` for a table) with every
template byte untouched, or fails its read with `OSError` (a forged address
the kernel cannot read), or delivers exactly the packed bytes; a guard byte
never changes. A forged source that names another address of the
publisher's own memory is read from there (the subscriber cannot tell a
publisher's lie about its own memory from the truth): for those the test
checks only that every byte lands inside the template.
"""

from __future__ import annotations

import copy
import dataclasses
import random
import uuid

import numpy as np
import pytest

from rdt_jax import _dlpack, _memory, _node_local, _process
from rdt_jax._metadata import MetadataError
from rdt_jax.weights import _handle, _packed, _packed_checks, _packed_plan, _routes

SENTINEL = 0xAB
GUARD = 0x5C
CASES = 300
VERSION = 3


def _published() -> dict:
  rng = np.random.default_rng(7)
  return {
      "w": rng.standard_normal((16, 24)).astype(np.float32),
      "b": np.arange(40, dtype=np.int16),
      "e": np.zeros((0, 3), np.float64),
      "n": rng.integers(0, 1 << 40, 9, dtype=np.int64),
      "step": 12,  # a non-array leaf: travels in the handle's `rest`
  }


class Version:
  """A packed version as its publisher holds it, in this process."""

  def __init__(self):
    self.tree = _published()
    self.publisher = uuid.uuid4().hex
    self.stream = _packed.Stream(2, self.publisher)
    self.entries = _handle.structure_of(self.tree)
    structure, _, arrays, rest = self.stream.structure(
        self.tree, lambda t: _handle.digest(_handle.structure_of(t), t), _handle.array_paths)
    assert structure is not None
    self.info = structure.info
    self.buffer = np.zeros(self.info.layout.total, np.uint8)
    structure.packer.pack(arrays, _memory.host_pointer(self.buffer))
    self.source = self.stream.source(VERSION, self.buffer, rest)
    self.stream.table.add(VERSION)


@pytest.fixture(scope="module")
def version():
  return Version()


class Template:
  """numpy templates for the published arrays, each inside a fenced block:
  `GUARD` bytes before and after, `SENTINEL` bytes in the template."""

  FENCE = 256

  def __init__(self, tree: dict):
    self.blocks, self.leaves = {}, {}
    for name, x in tree.items():
      if not isinstance(x, np.ndarray):
        continue
      block = np.full(x.nbytes + 2 * self.FENCE, GUARD, np.uint8)
      block[self.FENCE : self.FENCE + x.nbytes] = SENTINEL
      self.blocks[name] = block
      self.leaves[name] = block[self.FENCE : self.FENCE + x.nbytes].view(x.dtype).reshape(x.shape)

  def flat(self) -> list:
    return _handle.flatten(self.leaves)

  def guards_hold(self) -> bool:
    return all((b[: self.FENCE] == GUARD).all() and (b[len(b) - self.FENCE :] == GUARD).all()
               for b in self.blocks.values())

  def untouched(self) -> bool:
    return all((x.view(np.uint8) == SENTINEL).all() for x in self.leaves.values())


def _pull(v: Version, info, entries, source, template: Template):
  """What a node-local pull of `source` runs, in order (`WeightSubscriber`'s
  `_plan` and `_pull_packed`, `_routes.pull_node_local`), without Ray."""
  _handle.check_template(template.flat(), entries)
  _packed_checks.check_layout(info, entries, "fuzz")
  plan = _packed_plan.PackedPlan(info, entries, dict(template.flat()), atomic=False)
  source = _packed_checks.check_source(source, "fuzz", plan, VERSION)
  if not _routes.can_read_directly(source):
    return "elsewhere"  # the pull would go through Ray
  kept = _routes.read_table(source, v.publisher)
  if VERSION not in kept:
    return "stale"
  staging = _memory.host_pool.acquire(plan.staging_bytes) if plan.staging_bytes else None
  _node_local.read(source.origin, plan.prepared(source.buffer, 0 if staging is None else _memory.host_pointer(staging)))
  leaves = plan.commit(staging)
  return _packed_plan.unflatten(plan.info, leaves, source.rest)


def _outcome(v: Version, info, entries, source, what: str, forged: bool = False) -> str:
  template = Template(v.tree)
  try:
    got = _pull(v, info, entries, source, template)
  except (MetadataError, ValueError, _packed.ForeignTable, _dlpack.UnsupportedLeafError) as e:
    assert template.untouched(), f"{what}: the template was written before {type(e).__name__}: {e}"
    outcome = "refused"
  except OSError:
    outcome = "read failed"  # a forged address the kernel could not read: bytes may have moved, inside the template
  else:
    if got in ("stale", "elsewhere"):
      assert template.untouched(), what
      outcome = got
    elif forged:
      outcome = "read where the forged source says"
    else:
      for name, x in v.tree.items():
        if isinstance(x, np.ndarray):
          np.testing.assert_array_equal(got[name], x, err_msg=what)
      outcome = "read"
  assert template.guards_hold(), f"{what}: a byte outside the template changed"
  return outcome


def test_the_genuine_version_is_read(version):
  assert _outcome(version, version.info, version.entries, version.source, "genuine") == "read"


# ---- the corruptions

BAD_INTS = [-1, 0, 1, 7, 1 << 47, 1 << 64, "12", None, 1.5, True]


def _bad_int(rng: random.Random, value):
  if type(value) is int and rng.random() < 0.5:
    return value ^ (1 << rng.randrange(0, 40)) if value > 0 else value - 1
  return rng.choice(BAD_INTS)


def _bad_seq(rng: random.Random, values: tuple):
  kind = rng.randrange(5)
  if kind == 0:
    return values[:-1]
  if kind == 1:
    return (*values, values[-1])
  if kind == 2:
    return list(values)
  if kind == 3:
    return values[::-1]
  out = list(values)
  i = rng.randrange(len(out))
  out[i] = _bad_int(rng, out[i]) if not isinstance(out[i], tuple) else rng.choice([(), (1 << 40,), ("3",), None])
  return tuple(out)


def _corrupt_layout(rng: random.Random, v: Version):
  """(info, entries, what) with one field of the layout or the leaves changed."""
  info, entries = v.info, list(v.entries)
  field = rng.choice(["offsets", "sizes", "total", "shapes", "array_positions", "entry", "layout"])
  layout = info.layout
  if field in ("offsets", "sizes"):
    layout = dataclasses.replace(layout, **{field: _bad_seq(rng, getattr(layout, field))})
  elif field == "total":
    layout = dataclasses.replace(layout, total=_bad_int(rng, layout.total))
  elif field == "layout":
    return dataclasses.replace(info, layout=rng.choice([None, (0, 1), "layout"])), tuple(entries), field
  if field in ("shapes", "array_positions"):
    info = dataclasses.replace(info, **{field: _bad_seq(rng, getattr(info, field))})
  elif field == "entry":
    i = rng.randrange(len(entries))
    path, kind, shape, dtype = entries[i]
    entries[i] = rng.choice([
        (path, kind, (*shape, 1), dtype), (path, kind, tuple(n + 1 for n in shape) or (1,), dtype),
        (path, "key", shape, dtype), (path, kind, shape, rng.choice(["float64", "int8", "float99", "object"])),
        (path + "x", kind, shape, dtype),
    ])
  return dataclasses.replace(info, layout=layout), tuple(entries), field


def _corrupt_source(rng: random.Random, v: Version):
  """(source, field, forged): one field of the handle's source changed; forged ones
  carry a recomputed digest."""
  src = v.source
  field = rng.choice(["buffer", "nbytes", "table", "slots", "rest", "digest", "origin"])
  if field == "rest":
    changed = dataclasses.replace(src, rest=rng.choice([(), (1, 2), [12], None]))
  elif field == "origin":
    origin = src.origin
    assert origin is not None
    other = rng.choice([None, (*origin[:3], origin[3] + 1), (*origin[:2], 1, origin[3])])
    changed = dataclasses.replace(src, origin=other)
  elif field in ("buffer", "table") and rng.random() < 0.5:
    changed = dataclasses.replace(src, **{field: getattr(src, field) + rng.choice([8, 64, -64, 4096, 1 << 20])})
  else:
    changed = dataclasses.replace(src, **{field: _bad_int(rng, getattr(src, field))})
  forged = field != "digest" and rng.random() < 0.5
  if forged:
    try:
      changed = dataclasses.replace(changed, digest=changed.expected_digest(VERSION))
    except (TypeError, OverflowError):
      forged = False  # a value no digest can be computed from: garbled only
  return changed, field, forged


def test_corrupted_and_forged_layouts_and_handles_never_write_outside_the_template(version):
  rng = random.Random(20261127)
  outcomes: dict[str, int] = {}
  for case in range(CASES):
    forged = False
    if rng.random() < 0.5:
      info, entries, what = _corrupt_layout(rng, version)
      source = version.source
    else:
      source, what, forged = _corrupt_source(rng, version)
      info, entries = version.info, version.entries
    outcome = _outcome(version, info, entries, source, f"case {case} ({what}{', forged' if forged else ''})", forged)
    outcomes[outcome] = outcomes.get(outcome, 0) + 1
  assert outcomes.get("refused", 0) > CASES * 0.7, outcomes
  # The genuine version still reads afterwards.
  test_the_genuine_version_is_read(version)


def test_a_corrupted_kept_versions_table_is_foreign_or_bounded(version):
  """Random words in the table: read as another publisher's (`ForeignTable`)
  unless the header survives, and then at most `slots` versions, never the
  empty marker."""
  v = copy.copy(version)
  table = _packed.KeptTable(4, v.publisher)
  words = table._words
  source = _packed.PackedSource(_process.identity(), 0, 0, table.address, table.slots)
  rng = random.Random(11)
  foreign = 0
  for _ in range(200):
    saved = words.copy()
    i = rng.randrange(len(words))
    words[i] = rng.choice([0, -1, _packed.EMPTY, VERSION, rng.randrange(-(1 << 63), 1 << 63)])
    try:
      kept = _routes.read_table(source, v.publisher)
    except _packed.ForeignTable:
      foreign += 1
      assert i < _packed.KeptTable.HEADER and words[i] != saved[i]
    else:
      assert len(kept) <= table.slots and _packed.EMPTY not in kept
      assert kept == {int(w) for w in words[_packed.KeptTable.HEADER :]} - {_packed.EMPTY}
    words[...] = saved
  assert foreign > 0
