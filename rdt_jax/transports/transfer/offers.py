"""The producer's side: the objects it offers, and the offers made to consumers.

Every leaf is offered as a `jax.Array` of its own dtype (`Offers.export`):
jax leaves as they are, sharding included; numpy and torch leaves through
the DLPack layer (`_dlpack.to_jax_exact`), as owned copies, so what a consumer
reads is the value at return. The arrays are held until Ray frees the object
(`release`).

An offer can be pulled once, and an RDT object may have any number of
consumers, so each pull gets an offer of its own: a consumer picks a random
uuid and asks the producer's offer service (`server.OfferService`) to
`offer` the object's arrays under it, which `await_pull`s them on this
process's transfer server. The offer is pending until the consumer reports
it pulled (`pulled`) or its connection closes first (`withdraw`).

Resharding is done here: jax's transfer server (jax 0.10) pairs source and
destination shards by position, so pulling with another sharding moves the
wrong bytes or fails. A consumer names the boxes it needs (`cuts`), and each
is offered as a single-device array cut from the leaf (`boxes.cut`, a device
copy on the producer).
"""

from __future__ import annotations

import threading
from typing import Any

from rdt_jax import _dlpack
from rdt_jax.transports.transfer import boxes
from rdt_jax.transports.transfer.metadata import TransferTransportMetadata
from rdt_jax.transports.transfer.server import OfferService, TransferServers, platform_of


class Offers:
  """The producer's offered objects and pending offers, and its offer
  service (started with the first export), under a lock of their own that
  is never held while a transfer server works."""

  def __init__(self, servers: TransferServers) -> None:
    self._lock = threading.Lock()
    self._servers = servers
    self._objects: dict[str, tuple[str, list[Any]]] = {}  # obj_id -> (platform, arrays)
    self._pending: dict[int, tuple[str, list[Any]]] = {}  # uuid -> (platform, arrays) offered, not pulled
    self._service: OfferService | None = None

  def num_offers(self) -> int:
    """How many RDT objects this process offers now."""
    with self._lock:
      return len(self._objects)

  def num_pending(self) -> int:
    """Offers made to consumers and not pulled yet (each holds its arrays)."""
    with self._lock:
      return len(self._pending)

  def export(
      self,
      obj_id: str,
      arrays: list[Any],
      leaves: list[_dlpack.DescribedLeaf],
      meta: TransferTransportMetadata,
  ) -> None:
    """Offers `arrays` (one per leaf) as object `obj_id`; says in `meta`
    where to ask for them."""
    offered = [
        # Owned copies of numpy and torch leaves: what a consumer reads is the
        # value at return, whatever the buffer's alignment (docs/concepts.md).
        _dlpack.to_jax_exact(a, d.spec.path, own=True)
        for a, d in zip(arrays, leaves)
        if d.spec.nbytes  # a pull of only empty arrays never completes
    ]
    platform = platform_of(meta.tensor_device or "cpu")
    server = self._servers.get(platform)
    with self._lock:
      if self._service is None:
        self._service = OfferService(self)
      self._objects[obj_id] = (platform, offered)
    meta.server_address = server.address()
    meta.offer_address = self._service.address
    meta.authkey = self._service.authkey

  def offer(self, obj_id: str, uuid: int, cuts: list[Any] | None = None) -> str | None:
    """Offers `obj_id`'s arrays for one pull under `uuid`.

    Args:
      cuts: per offered array, None (offer it as it is) or a list of boxes
        (one `(start, stop)` per axis each): offer instead, for each non-empty
        box, that part of the array as a single-device array (a slice computed
        on the producer's devices), in order.

    Returns:
      None, or why it cannot (the object was freed, the cuts do not fit).
    """
    with self._lock:
      entry = self._objects.get(obj_id)
    if entry is None:
      return f"object {obj_id} is no longer offered (it was freed)"
    platform, arrays = entry
    if cuts is not None:
      if len(cuts) != len(arrays) or any(
          parts is not None and any(not boxes.fits(box, a.shape) for box in parts)
          for parts, a in zip(cuts, arrays)
      ):
        return f"the requested parts do not fit object {obj_id}'s arrays"
      arrays = [
          part
          for a, parts in zip(arrays, cuts)
          for part in ([a] if parts is None else [boxes.cut(a, box) for box in parts if boxes.volume(box)])
      ]
    with self._lock:
      if uuid in self._pending:
        return f"uuid {uuid} is already offered"
      self._pending[uuid] = (platform, arrays)
    self._servers.get(platform).await_pull(uuid, arrays)
    return None

  def pulled(self, uuid: int) -> None:
    """The consumer reported offer `uuid` pulled: its arrays are the server's
    no more."""
    with self._lock:
      self._pending.pop(uuid, None)

  def withdraw(self, uuid: int) -> None:
    """Ends offer `uuid`, whose consumer left without pulling it (died, gave
    up, timed out): this process pulls it itself and drops the copy, which
    is how JAX's transfer server lets go of the offered arrays. An offer the
    consumer pulled after all ends with nobody's pull."""
    with self._lock:
      entry = self._pending.pop(uuid, None)
    if entry is None:
      return
    import jax

    platform, arrays = entry
    structs = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding) for a in arrays]
    try:
      server = self._servers.get(platform)
      server.connect(server.address()).pull(uuid, structs)
    except Exception:  # the process is shutting down; nothing left to free
      pass

  def release(self, obj_id: str) -> None:
    """Ray freed object `obj_id`: its arrays are offered no more."""
    with self._lock:
      self._objects.pop(obj_id, None)
