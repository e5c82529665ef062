"""The consumer's side of a pack: many small jax leaves received as one buffer.

A producer may send the small host jax leaves of a value as one host buffer
(`rdt_jax._leaf_pack`; the metadata's `packed` names the buffer's leaf, each
packed leaf's spec and its position among the value's leaves). The fetch
receives that buffer like any leaf, as raw host bytes (`ReceivePlan`'s
`raw`), and `unpack` makes the packed leaves from it for Ray's deserializer,
which finds the k-th one at the buffer's index (`_ray.serialization`):

* without a target, the leaves are views of the received buffer, laid out
  as `host_layout` lays them out, each arriving as a `ReceivePlan` decides
  for its dtype, jax leaves made in one call per device as every host jax
  leaf is: no copy, and no per-leaf plan;
* with a target (arrays to write into, a device, a `Slice`, a sharding), the
  packed leaves get a `ReceivePlan` of their own with their share of it and
  their bytes are copied from the buffer into what it took, so a target
  means the same for a packed leaf as for any other.

`split_target` shares a target between the pack's leaves and the others: a
positional target (a list, as with Ray's own function) counts every leaf of
the value in the order the producer's serializer met them, packed or not.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from rdt_jax import _dlpack, _memory, _pack_table
from rdt_jax._dlpack import LeafSpec
from rdt_jax._metadata import DlpackTransportMetadata, MetadataError
from rdt_jax._targets import Target, align_targets
from rdt_jax.transports._destinations import memory_kind
from rdt_jax.transports._plan import ReceivePlan

__all__ = ["Split", "split_target", "unpack"]


class Split:
  """A target shared between a pack's leaves and the value's other leaves.

  Attributes:
    outer: each of the metadata's leaves' targets (None for the pack buffer
      and for leaves without one), or None for no targets by leaf.
    inner: the packed leaves' target, or None.
    device: a device every leaf is received to, or None.
  """

  def __init__(self, outer: list[Any] | None, inner: Target | None, device: Any) -> None:
    self.outer, self.inner, self.device = outer, inner, device


def split_target(meta: DlpackTransportMetadata, target: Target | None) -> Split:
  """Shares `target` between the pack of `meta` and its other leaves.

  Raises:
    ValueError, UnsupportedLeafError: as `align_targets`, for a target that
      does not fit the value (naming the leaf).
  """
  if target is None:
    return Split(None, None, None)
  if target.buffers is None:
    return Split(None, Target(device=target.device), target.device)
  order = meta.value_leaves()
  aligned = align_targets(target.buffers, [spec for spec, _ in order])
  outer: list[Any] = [None] * len(meta.leaves)
  inner: dict[str, Any] = {}
  for (spec, i), t in zip(order, aligned):
    if i < 0:
      inner[spec.path] = t
    else:
      outer[i] = t
  return Split(outer, Target(buffers=inner), None)


def unpack(
    buffer: np.ndarray, specs: Sequence[LeafSpec], target: Target | None, mode: str, obj_id: str
) -> tuple[Any, ...]:
  """The packed leaves, rebuilt from the received pack `buffer` (uint8, host)
  as `mode` and `target` ask, in pack order.

  Raises:
    MetadataError: if the specs lay out more bytes than `buffer` holds.
    ValueError, UnsupportedLeafError: for a target that does not fit.
  """
  starts, _, need = _layout_of(specs)
  if need > buffer.nbytes:
    raise MetadataError(obj_id, "packed", f"lays out {need} bytes in a buffer of {buffer.nbytes}")
  if target is None:
    leaves = _views_as_received(buffer, specs, starts, mode, obj_id)
    if leaves is not None:
      return leaves
  plan = ReceivePlan(list(specs), mode, target, obj_id)
  try:
    destinations = plan.allocate()
    view = memoryview(buffer.data)
    for d in destinations:
      if d.nbytes:
        begin = starts[d.source] + d.source_offset
        _memory.copy_from_host(d.pointer, view[begin : begin + d.nbytes], d.device)
  except BaseException:
    plan.quarantine()
    raise
  return tuple(plan.build())


def _layout_of(specs: Sequence[LeafSpec]) -> tuple[list[int], list[int], int]:
  """Where each packed leaf lies in the buffer (`PackTable.layout`): its
  table's, laid out once per table, for specs of a table this process keeps."""
  table = _pack_table.of(specs)
  return (table if table is not None else _pack_table.PackTable(specs, ())).layout()


def _views_as_received(
    buffer: np.ndarray, specs: Sequence[LeafSpec], starts: list[int], mode: str, obj_id: str
) -> tuple[Any, ...] | None:
  """The packed leaves without a target: zero-copy views of `buffer` (leaf
  `i` at byte `starts[i]`), each as the framework and device a `ReceivePlan`
  gives its dtype in `mode` (decided once per dtype, not per leaf); jax
  leaves made in one call per device. None where some dtype arrives in
  device memory (the caller plans and copies instead). The caller checked
  that the buffer holds every leaf.

  Raises:
    UnsupportedLeafError: for a 64-bit leaf arriving as jax while x64 is off.
  """
  first: dict[Any, LeafSpec] = {}
  for spec in specs:
    if spec.dtype not in first:
      first[spec.dtype] = spec
  plans = dict(zip(first, ReceivePlan(list(first.values()), mode, None, obj_id).plans))
  if any(memory_kind(p.device) != "host" for p in plans.values()):
    return None
  frameworks = {dtype: plan.framework for dtype, plan in plans.items()}
  view = np.ndarray
  if all(f == "numpy" for f in frameworks.values()):
    return tuple([view(spec.shape, spec.dtype, buffer, start) for spec, start in zip(specs, starts)])
  out: list[Any] = []
  jax_at: dict[Any, list[int]] = {}
  for spec, start in zip(specs, starts):
    leaf = view(spec.shape, spec.dtype, buffer, start)
    framework = frameworks[spec.dtype]
    if framework == "jax":
      jax_at.setdefault(plans[spec.dtype].device, []).append(len(out))
    elif framework != "numpy":
      leaf = _dlpack.rebuild_view(leaf, framework, plans[spec.dtype].device, spec.path)
    out.append(leaf)
  for device, indices in jax_at.items():
    for i, array in zip(indices, _dlpack.host_to_jax_many([out[i] for i in indices], device)):
      out[i] = array
  return tuple(out)
