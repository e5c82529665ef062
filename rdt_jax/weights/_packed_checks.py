"""The checks of what a publisher sends about a packed version: nothing it
sends is trusted before them.

`check_source` checks a handle's `PackedSource` (every field's type and
bounds, then, against the plan of its structure, its digest, size and count
of non-array leaves) before anything is read or allocated from it;
`check_layout` checks a structure's `PackedLayoutInfo` against the published
array leaves before a plan (`rdt_jax.weights._packed_plan`) is made from it.
`_limits.WEIGHTS_MAX_SLOTS` and `_limits.WEIGHTS_MAX_NBYTES` bound what a handle may name. The overview is
`rdt_jax.weights._packed`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from rdt_jax import _dlpack, _layout, _limits
from rdt_jax._memory import _ipc
from rdt_jax._metadata import MetadataError
from rdt_jax.weights._packed import PackedLayoutInfo, PackedSource

if TYPE_CHECKING:
  from rdt_jax.weights._packed_plan import PackedPlan

__all__ = ["check_layout", "check_source", "source_kind"]


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
  for name, low, high in (("buffer", 1, 2**63 - 1), ("nbytes", 0, _limits.WEIGHTS_MAX_NBYTES), ("table", 1, 2**63 - 1),
                          ("slots", 1, _limits.WEIGHTS_MAX_SLOTS)):
    value = getattr(source, name)
    if type(value) is not int or not low <= value <= high:
      raise MetadataError(label, f"packed.{name}", f"is {value!r}, outside [{low}, {high}]")
  if not isinstance(source.rest, tuple):
    raise MetadataError(label, "packed.rest", f"is a {type(source.rest).__name__}, not a tuple")
  device, ipc, offset = source.device, source.ipc, source.ipc_offset
  if type(device) is not int or not -1 <= device < _limits.NIXL_MAX_DEVICES:
    raise MetadataError(label, "packed.device", f"is {device!r}, not -1 (host) or a CUDA device index")
  want = 0 if device < 0 else _ipc.HANDLE_BYTES
  if type(ipc) is not bytes or len(ipc) != want:
    raise MetadataError(label, "packed.ipc", f"is not the {want} bytes a version in {source_kind(source)} carries")
  if type(offset) is not int or not 0 <= offset < _limits.NIXL_ADDRESS_LIMIT or (device < 0 and offset):
    raise MetadataError(label, "packed.ipc_offset", f"is {offset!r}")
  if plan is not None:
    _check_against(plan, source, version, label)
  return source


def source_kind(source: PackedSource) -> str:
  """'host memory' or 'device memory (cuda:N)': where a version lies."""
  return "host memory" if source.device < 0 else f"device memory (cuda:{source.device})"


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
  if type(layout.total) is not int or not 0 <= layout.total <= _limits.WEIGHTS_MAX_NBYTES:
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

