"""The producer's side of an object, shared by every transport: Ray's
`extract_tensor_transport_metadata` and `send_multiple_tensors`.

`extract` takes back the descriptions the reducers recorded for the leaves
Ray extracted (`rdt_jax._handoff`), checks that they share one device kind the
transport moves (`common_device`), builds the object's metadata (naming its
producer actor, `_lifetime.producer_id`) and routes the object: in band where
it fits (`rdt_jax.transports._inband`; no backend hook runs for it), otherwise
to the backend (the transport's `_export`: `export_buffers`, or
`export_arrays` for a whole-array backend). `Exported` counts the objects
handed to the backend until Ray frees them. `send` hands a two-sided backend
the buffers of the leaves Ray kept, described again.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

from ray.experimental.rdt.tensor_transport_manager import CommunicatorMetadata

from rdt_jax import _dlpack, _handoff, _leaf_pack, _memory
from rdt_jax._metadata import DlpackTransportMetadata
from rdt_jax.transports import _inband, _lifetime

if TYPE_CHECKING:
  from rdt_jax.transports._base import DlpackTransport

__all__ = ["Exported", "common_device", "extract", "send"]


class Exported:
  """The objects a transport exported that Ray has not freed yet
  (`counters()["exports"]`); safe to use from any thread."""

  def __init__(self) -> None:
    self._ids: set[str] = set()
    self._lock = threading.Lock()

  def add(self, obj_id: str) -> None:
    with self._lock:
      self._ids.add(obj_id)

  def discard(self, obj_id: str) -> None:
    with self._lock:
      self._ids.discard(obj_id)

  def __len__(self) -> int:
    with self._lock:
      return len(self._ids)


def extract(t: DlpackTransport, obj_id: str, rdt_object: list[Any]) -> DlpackTransportMetadata:
  """`DlpackTransport.extract_tensor_transport_metadata` (its docstring says
  what it raises)."""
  with _memory.gc_paused(len(rdt_object)):
    described = _handoff.take_described(rdt_object)
    device = common_device(t, described)
    meta = t.metadata_class(
        tensor_meta=[(d.spec.shape, d.spec.dtype) for d in described],
        tensor_device=device,
        leaves=[d.spec for d in described],
        producer=_lifetime.producer_id(),
    )
    for slot, x in enumerate(rdt_object):
      table = _leaf_pack.take_table(x)
      if table is not None:
        meta.packed = (slot, table.specs, table.positions)
        break
    if described:
      # Queued device work writing the leaves finishes before any read.
      _memory.wait_for_producers(described)
      if t.is_one_sided() and _inband.fits(device, meta):
        _inband.pack(described, meta)
      else:
        t._export(obj_id, rdt_object, described, meta)
        t._exported.add(obj_id)
  return meta


def common_device(t: DlpackTransport, described: list[_dlpack.DescribedLeaf]) -> str | None:
  """The device kind every leaf lives on, or None for no leaves.

  Raises:
    UnsupportedLeafError: for a leaf on a device kind `t` does not move, or
      on another kind than the first leaf, naming the leaf and the fix.
  """
  if not described:
    return None
  first = described[0]
  for d in described:
    if d.device not in t.devices:
      raise _dlpack.UnsupportedLeafError(
          d.spec.path,
          f"(dtype {d.spec.dtype.name}) lives on a {d.device} device, which "
          f"the {t.name} transport does not move (it moves "
          f"{', '.join(t.devices)})",
          "Use a transport for that device (jax_nixl moves cpu and cuda), "
          "or move the array first.",
      )
    if d.device != first.device:
      raise _dlpack.UnsupportedLeafError(
          d.spec.path,
          f"lives on {d.device} but leaf {first.spec.path} lives on "
          f"{first.device}; one RDT object holds leaves of one device kind",
          "Return the cpu and cuda leaves from separate RDT methods, or "
          "move them to one device kind.",
      )
  return first.device


def send(
    t: DlpackTransport,
    tensors: list[Any],
    meta: DlpackTransportMetadata,
    communicator_metadata: CommunicatorMetadata,
) -> None:
  """`DlpackTransport.send_multiple_tensors` (its docstring says what it raises)."""
  if t.is_one_sided():
    raise NotImplementedError(
        f"{t.name} is one-sided: Ray never calls send_multiple_tensors on it."
    )
  described = [_dlpack.describe(x, spec.path) for x, spec in zip(tensors, meta.leaves)]
  _memory.wait_for_producers(described)
  t.send_buffers(described, meta, communicator_metadata)
