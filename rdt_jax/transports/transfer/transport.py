"""`jax_transfer`: one-sided pulls with JAX's own transfer server.

`jax.experimental.transfer` is how JAX moves arrays between hosts without
NIXL (TPU slices over DCN, GPU hosts): a process starts a transfer server,
offers arrays with `await_pull(uuid, arrays)`, and a peer connected to it
pulls them with `pull(uuid, shape_dtype_structs)`, which allocates the arrays
on the peer's devices with the shardings it asks for.

How rdt_jax uses it (`TransferTransport` composes the package's rooms, each
readable alone):

* `offers`: the producer (`export_arrays`) offers every leaf as a `jax.Array`,
  held until Ray frees the object (`garbage_collect`). An offer can be pulled
  once, and an RDT object may have any number of consumers, so each pull gets
  its own offer, made on request under the consumer's random uuid; the
  producer cuts the boxes a resharding consumer asks for (`boxes`).
* `server`: the offer service that takes those requests (address and key in
  the metadata, `metadata`), and this process's transfer servers.
* `protocol`: the requests' wire format (length-prefixed JSON, nothing
  unpickled) and the HMAC challenge that starts each connection.
* `peers`: the consumer's connections to producers, pooled and pruned, and
  the offer request itself.
* `pull`: what a consumer pulls for each leaf, and how the leaves are made
  from the pulled arrays.

A pull that nobody offers would wait forever, so the offer comes first: the
consumer asks for it in a thread of its own from `start_pull`, then starts
the pull, which returns at once; `wait_pull` waits for the arrays to be
ready. Waits are bounded: the producer's answer is awaited at most
`_limits.TRANSFER_ANSWER_TIMEOUT_S` (checking Ray's abort meanwhile), and
`wait_pull` waits for the request within the caller's timeout, the one
`ray.get(ref, timeout=...)` was given: a stopped producer fails the caller's
`ray.get` when its timeout passes, and the request stops at once. The
consumer holds the connection its offer was made on until the pull ends: it
then says "done" and pools the connection, or, after a failure, closes it,
and the producer withdraws the offer. Each room keeps its state under a lock
of its own, and none is held while awaiting a producer's answer.

Limits: a sharded leaf needs as many devices on the consumer as on the
producer, whatever type it arrives as (the pull moves shard to shard),
unless the consumer gives a target sharding or slice of its own. gpu and
tpu transfer servers have not run yet.
"""

from __future__ import annotations

import concurrent.futures
import secrets
import socket
import threading
import time
from typing import Any

from rdt_jax import _compat, _dlpack
from rdt_jax.transports._destinations import Placement
from rdt_jax.transports._whole_array import WholeArrayTransport
from rdt_jax.transports.transfer import protocol, pull
from rdt_jax.transports.transfer.metadata import TransferTransportMetadata
from rdt_jax.transports.transfer.offers import Offers
from rdt_jax.transports.transfer.peers import Peers
from rdt_jax.transports.transfer.pull import Pull
from rdt_jax.transports.transfer.server import TransferServers, platform_of

__all__ = ["TransferTransport"]


class TransferTransport(WholeArrayTransport):
  """The `jax_transfer` transport: pulls through JAX's transfer server."""

  name = "jax_transfer"
  devices = ("cpu", "cuda")
  metadata_class = TransferTransportMetadata

  def __init__(self) -> None:
    super().__init__()
    self._servers = TransferServers()
    self._offers = Offers(self._servers)
    self._peers = Peers(self._servers)

  @staticmethod
  def is_one_sided() -> bool:
    return True

  @staticmethod
  def can_abort_transport() -> bool:
    return True

  @classmethod
  def available_in_process(cls) -> bool:
    return _compat.has_jax_transfer()

  def counters(self) -> dict[str, int]:
    """`DlpackTransport.counters`, plus the producer's `offers` (objects
    offered now), `pending_offers` (offers made to consumers and not pulled
    yet, each holding its arrays) and the consumer's `peers` (producers it
    keeps connections to, pooled offer and transfer connections; idle ones
    go after `_limits.TRANSFER_IDLE_S`)."""
    return {
        **super().counters(),
        "offers": self._offers.num_offers(),
        "pending_offers": self._offers.num_pending(),
        "peers": len(self._peers),
    }

  # ---- producer

  def export_arrays(
      self,
      obj_id: str,
      arrays: list[Any],
      leaves: list[_dlpack.DescribedLeaf],
      meta: TransferTransportMetadata,
  ) -> None:
    self._offers.export(obj_id, arrays, leaves, meta)

  def release(self, obj_id: str) -> None:
    self._offers.release(obj_id)

  # ---- consumer

  def prune(self) -> None:
    """Closes offer connections and forgets transfer connections unused for
    `_limits.TRANSFER_IDLE_S` (called at each pull)."""
    self._peers.prune()

  def _request_offer(
      self, meta: TransferTransportMetadata, obj_id: str, uuid: int, cuts: list[Any], stop: threading.Event
  ) -> tuple[socket.socket, tuple[str, int]]:
    """`Peers.request_offer`, interrupted by Ray's abort of the fetch or by
    `stop`."""

    def interrupted() -> bool:
      return stop.is_set() or self.aborted(obj_id)

    return self._peers.request_offer(meta, obj_id, uuid, cuts, interrupted)

  def start_pull(
      self,
      obj_id: str,
      meta: TransferTransportMetadata,
      communicator_metadata: Any,
      placements: list[Placement],
  ) -> Pull:
    structs, cuts, recipes = pull.plan(meta.leaves, placements)
    if not structs:
      return Pull([], recipes)
    platform = platform_of(placements[0].device.kind)
    handle = Pull([], recipes, uuid=secrets.randbits(62))
    handle.request = pull.requests().submit(self._begin, handle, meta, obj_id, cuts, structs, platform)
    return handle

  def _begin(self, handle: Pull, meta: TransferTransportMetadata, obj_id: str, cuts: list[Any],
             structs: list[Any], platform: str) -> None:
    """A pull's request (in a thread of `pull.requests()`): asks the producer
    for the offer, then starts the pull. A pull stopped meanwhile
    (`handle.stop`: given up, timed out or cancelled) keeps no connection."""
    assert meta.server_address is not None
    connection = self._peers.connection(platform, meta.server_address)
    sock, address = self._request_offer(meta, obj_id, handle.uuid, cuts, handle.stop)
    with handle.lock:
      if handle.stop.is_set():
        sock.close()  # the producer withdraws the offer
        raise InterruptedError(f"the pull of object {obj_id} was stopped")
      handle.sock, handle.address = sock, address
    try:
      handle.pulled = connection.pull(handle.uuid, structs)
    except BaseException:
      with handle.lock:
        handle.sock = None
      sock.close()  # the producer withdraws the offer
      raise

  def _wait_request(self, handle: Pull, obj_id: str, deadline: float | None, timeout: float) -> None:
    """Waits for a pull's request (`_begin`) until `deadline`, checking
    Ray's abort; raises what the request raised."""
    assert handle.request is not None
    while True:
      wait = 0.1 if deadline is None else min(0.1, max(0.0, deadline - time.monotonic()))
      try:
        handle.request.result(timeout=wait)
        return
      except concurrent.futures.TimeoutError:
        pass
      if self.aborted(obj_id):
        raise RuntimeError(f"jax_transfer pull of object {obj_id} was aborted.")
      if deadline is not None and time.monotonic() >= deadline:
        raise TimeoutError(
            f"jax_transfer pull of object {obj_id} timed out after {timeout}s waiting for its producer's "
            "offer service to answer (the producer may be stopped or overloaded).")

  def _end_pull(self, handle: Pull, pulled: bool) -> None:
    """Says "done" and pools the offer connection after a pull; closes it
    otherwise, so the producer withdraws the offer. Stops the pull's request
    if it still runs."""
    with handle.lock:
      handle.stop.set()
      sock, handle.sock = handle.sock, None
    if sock is None:
      return
    if pulled:
      try:
        protocol.send(sock, {"op": "done", "uuid": handle.uuid})
        self._peers.pool.give_back(handle.address, sock)
        return
      except OSError:
        pass
    sock.close()

  def cancel_pull(self, handle: Any) -> None:
    """A fetch dropped unfinished: its offer connection closes (the producer
    withdraws the offer)."""
    if isinstance(handle, Pull):
      self._end_pull(handle, pulled=False)

  def wait_pull(self, handle: Pull, obj_id: str, timeout: float) -> list[Any]:
    deadline = None if timeout is None or timeout < 0 else time.monotonic() + timeout
    sleep = 0.0
    try:
      if handle.request is not None:
        self._wait_request(handle, obj_id, deadline, timeout)
      pulled = handle.pulled
      while not all(a.is_ready() for a in pulled):
        if self.aborted(obj_id):
          raise RuntimeError(f"jax_transfer pull of object {obj_id} was aborted.")
        if deadline is not None and time.monotonic() >= deadline:
          raise TimeoutError(f"jax_transfer pull of object {obj_id} timed out after {timeout}s.")
        sleep = min(0.001, sleep + 0.00005)
        time.sleep(sleep)
      for a in pulled:
        a.block_until_ready()  # raises the pull's error, if any
    except BaseException:
      self._end_pull(handle, pulled=False)
      raise
    self._end_pull(handle, pulled=True)
    return pull.assemble(pulled, handle.recipes)
