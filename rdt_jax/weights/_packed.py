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
  the publisher's `bucket_bytes` each (made at the first request for the
  version), fetches them with `ray.get` (NIXL, one READ each), the next one
  while the last one is copied out, and copies the leaves out of them.

The rooms of packed versions, each readable alone (no cycles):

* this module: what crosses (`PackedLayoutInfo`, a structure's layout;
  `PackedSource`, where a version lies), the table of kept versions
  (`KeptTable`) and the publisher's `Stream`;
* `rdt_jax.weights._packed_checks`: the checks of what a publisher sends
  (`check_source`, `check_layout`): nothing is trusted before them;
* `rdt_jax.weights._packed_plan`: the subscriber's `PackedPlan` (where each
  leaf's bytes go, the node-local reads prepared, the pulled leaves made),
  `unflatten` and the buckets (`bucket_runs`).

The reads themselves are `rdt_jax.weights._routes`.

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

import dataclasses
import functools
import zlib
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final

import numpy as np

from rdt_jax import _dlpack, _layout, _memory, _process

__all__ = [
  "EMPTY",
  "ForeignTable",
  "KeptTable",
  "PackedLayoutInfo",
  "PackedSource",
  "PublishedStructure",
  "Stream",
  "device_packing",
  "table_token",
]

#: A slot of the kept-versions table that holds no version.
EMPTY: Final = np.iinfo(np.int64).min


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
    digest: CRC-32 of the fields above and below (catches corruption, not
      forgery).
    device: for a version in device memory (`rdt_jax.weights._device`),
      the index of the CUDA device holding it in the publisher's process;
      -1 for host memory.
    ipc: for device memory, the CUDA IPC handle of the allocation holding
      the buffer (`rdt_jax._memory._ipc.export`).
    ipc_offset: the buffer's offset in that allocation.
  """

  origin: _process.Identity | None
  buffer: int
  nbytes: int
  table: int
  slots: int
  rest: tuple[Any, ...] = ()
  digest: int = 0
  device: int = -1
  ipc: bytes = b""
  ipc_offset: int = 0

  def expected_digest(self, version: int) -> int:
    values = array("q", (self.buffer, self.nbytes, self.table, self.slots, version, self.device, self.ipc_offset))
    return zlib.crc32(self.ipc, zlib.crc32(f"{self.origin}".encode(), zlib.crc32(values)))


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


def device_packing() -> bool:
  """True if versions in device memory can be packed here: the CUDA driver
  loads (a publisher packs them only with `device_pack` on)."""
  return _memory.ipc_usable()


@dataclass
class PublishedStructure:
  """What a publisher knows of one structure it publishes packed."""

  info: PackedLayoutInfo
  packer: Any  # `rdt_jax._layout.Packer`, or for device memory `rdt_jax._layout.DevicePacker`
  key_positions: frozenset[int]  # array positions (indices into the array leaves) holding typed PRNG keys
  device: int = -1  # the CUDA device index of a structure packed in device memory; -1: host memory
  frameworks: tuple[str, ...] = ()  # each array leaf's framework when the structure was checked


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
    device_pack: whether a structure whose array leaves all live on one
      CUDA device is packed in device memory (the publisher's
      `device_pack`); False: such structures are not packed.
  """

  def __init__(self, keep: int, publisher: str, device_pack: bool = True):
    self.table = KeptTable(keep, publisher)
    self._structure: PublishedStructure | None = None
    self._treedef: Any = None
    self._signature: list[Any] | None = None
    self._digest: str | None = None
    self._split_treedef: Any = None
    self._split_types: list[type] = []
    self._positions: list[int] = []
    #: Whether a structure in device memory may be packed (`device_pack`, `no_device`).
    self.device_ok = device_pack

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
    """The packed structure of `tree` (None if it cannot be packed: leaves
    in device memory, unless all on one CUDA device and device packing is
    on and possible here), its digest, its array leaves (typed keys as their key
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

  def no_device(self) -> None:
    """Packs no more structures in device memory (their buffers could not
    be made here); the structure is checked again at the next publish."""
    self.device_ok = False
    self._digest = None

  def _build(self, treedef: Any, arrays: list[Any], positions: list[int],
             paths: list[str]) -> PublishedStructure | None:
    keys = frozenset(i for i, x in enumerate(arrays) if _dlpack.is_prng_key(x))
    sizes, shapes, described = [], [], []
    for i, x in enumerate(arrays):
      leaf = _dlpack.describe(_dlpack.prng_key_parts(x)[0] if i in keys else x, paths[i])
      described.append(leaf)
      sizes.append(leaf.spec.nbytes)
      shapes.append(leaf.spec.shape)
    device = -1
    if any(leaf.spec.device != "cpu" for leaf in described):
      found = _layout.cuda_device_of(described) if self.device_ok and device_packing() else None
      if found is None:
        return None
      device = found
    layout = _layout.PackedLayout.of(sizes)
    if not layout.total:
      return None
    info = PackedLayoutInfo(layout, treedef, tuple(positions), tuple(shapes))
    packer = _layout.Packer(layout, paths) if device < 0 else _layout.DevicePacker(layout, paths, device)
    return PublishedStructure(info, packer, keys, device, tuple(leaf.spec.framework for leaf in described))

  def source(self, version: int, buffer: Any, rest: tuple[Any, ...]) -> PackedSource:
    """The `PackedSource` of a version packed into `buffer` (a host buffer,
    or a `rdt_jax.weights._device.DeviceBuffer`)."""
    if isinstance(buffer, np.ndarray):
      src = PackedSource(_process.identity(), _memory.host_pointer(buffer), int(buffer.nbytes),
                         self.table.address, self.table.slots, rest)
    else:
      src = PackedSource(_process.identity(), buffer.pointer, buffer.nbytes, self.table.address, self.table.slots,
                         rest, device=buffer.device, ipc=buffer.handle, ipc_offset=buffer.offset)
    return dataclasses.replace(src, digest=src.expected_digest(version))

