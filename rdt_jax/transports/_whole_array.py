"""`WholeArrayTransport`: the base of backends that move whole arrays.

A byte backend (`DlpackTransport`) is given receive memory and moves bytes
into it; a whole-array backend (`jax_transfer`, JAX's transfer server)
allocates its own arrays on the consumer. The base takes no receive memory
for it: it hands the producer's arrays to `export_arrays`, one `Placement`
per leaf to `start_pull`, and converts the arrays `wait_pull` returns to the
type each leaf should arrive as, or copies them into numpy/torch targets
(`ReceivePlan.adopt`). Everything else (Ray's interface, in-band objects,
aborts, the lifetime check) is `DlpackTransport`'s.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

from ray.experimental.rdt.tensor_transport_manager import CommunicatorMetadata

from rdt_jax import _dlpack, _memory
from rdt_jax._metadata import DlpackTransportMetadata
from rdt_jax.transports import _fetch
from rdt_jax.transports._base import DlpackTransport
from rdt_jax.transports._destinations import Placement
from rdt_jax.transports._fetch import DlpackFetchRequest
from rdt_jax.transports._plan import ReceivePlan
from rdt_jax.transports._required import abstract_hook

__all__ = ["WholeArrayTransport"]


class WholeArrayTransport(DlpackTransport):
  """Base of backends that move whole jax arrays instead of bytes.

  Such a backend (`jax_transfer`) allocates its own arrays on the consumer,
  so the base takes no receive memory. It implements, on the producer,
  `export_arrays(obj_id, arrays, leaves, meta)` (offer the arrays) and
  `release(obj_id)`; on the consumer `start_pull(obj_id, meta,
  communicator_metadata, placements)` (start moving one array per leaf onto
  its `Placement`; return a handle) and `wait_pull(handle, obj_id, timeout)`
  (return one array per leaf). The base converts the arrays to the type each
  leaf should arrive as, or copies them into numpy/torch targets.

  `cancel_pull` is optional. A subclass that misses a hook its kind needs
  is refused with a `TypeError` when it is defined or registered.
  """

  #: The hooks each kind implements, one-sided (True) or two-sided (False):
  #: checked when a subclass is defined (`rdt_jax.transports._required`).
  _required_hooks: ClassVar[dict[bool, tuple[str, ...]]] = {
      True: ("export_arrays", "start_pull", "wait_pull", "release"),
      False: ("export_arrays", "send_buffers", "start_pull", "wait_pull"),
  }

  def _export(
      self,
      obj_id: str,
      arrays: list[Any],
      leaves: list[_dlpack.DescribedLeaf],
      meta: DlpackTransportMetadata,
  ) -> None:
    self.export_arrays(obj_id, arrays, leaves, meta)

  def _prepare(self, plan: ReceivePlan, stage: bool = False) -> None:
    pass  # the backend allocates the arrays it pulls, copied into targets after success

  def _start(
      self,
      obj_id: str,
      meta: DlpackTransportMetadata,
      communicator_metadata: CommunicatorMetadata,
      plan: ReceivePlan,
  ) -> Any:
    placements = plan.placements()
    if not placements:
      return None
    pulled = [
        spec.nbytes if p.layout is None
        else sum(math.prod(_dlpack.box_shape(b)) for b in p.layout.pieces) * spec.dtype.itemsize
        for spec, p in zip(meta.leaves, placements)
    ]
    self._count(fetches=1, bytes=sum(pulled), destinations=len(placements))
    return _fetch.wrap_errors(
        self.name, obj_id, self.start_pull, obj_id, meta, communicator_metadata, placements
    )

  def _complete(self, request: DlpackFetchRequest, timeout: float) -> list[Any]:
    arrays: list[Any] = []
    if request.handle is not None:
      arrays = _fetch.wrap_errors(
          self.name, request.obj_id, self.wait_pull, request.handle, request.obj_id, timeout
      )
    request.done = True
    assert request.plan is not None
    with _memory.gc_paused(len(request.plan.plans)):
      return request.plan.adopt(arrays)

  def _abandon(self, handle: Any) -> None:
    self.cancel_pull(handle)

  # ---- The backend's half.

  @abstract_hook
  def export_arrays(
      self,
      obj_id: str,
      arrays: list[Any],
      leaves: list[_dlpack.DescribedLeaf],
      meta: DlpackTransportMetadata,
  ) -> None:
    """Producer: offer `arrays` (one per leaf, any framework); extend `meta`.
    Required."""
    raise NotImplementedError

  @abstract_hook
  def start_pull(
      self,
      obj_id: str,
      meta: DlpackTransportMetadata,
      communicator_metadata: CommunicatorMetadata,
      placements: list[Placement],
  ) -> Any:
    """Consumer: start moving one array per leaf onto its placement; return a
    handle for `wait_pull`. Required."""
    raise NotImplementedError

  @abstract_hook
  def wait_pull(self, handle: Any, obj_id: str, timeout: float) -> list[Any]:
    """Consumer: the arrays `start_pull` moved, one per leaf, once ready.
    Required.

    Raises:
      TimeoutError: after `timeout` seconds (-1: no limit).
    """
    raise NotImplementedError

  def cancel_pull(self, handle: Any) -> None:
    """Optional: on the consumer, release what `start_pull` took if the
    fetch was dropped (the default holds nothing)."""
