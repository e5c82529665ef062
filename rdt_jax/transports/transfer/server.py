"""The servers a `jax_transfer` process runs, and the address they bind.

* `TransferServers`: this process's JAX transfer servers, one per platform
  (`platform_of`), started on first use. The producer offers arrays on its
  server; the consumer connects through its own to producers' servers.
* `OfferService`: the producer's offer service, a small TCP server that
  answers consumers' requests (`protocol`) to offer an object's arrays under
  a uuid, one thread per connection. The offers themselves are
  `offers.Offers`'s; every offer still pending on a connection that closes
  (a consumer that died, gave up or timed out) is withdrawn, so its arrays
  are not kept after release.

Addresses: every server binds, and advertises in the metadata, this node's
Ray address (`node_address`: `ray.util.get_node_ip_address()`, the address
other nodes reach it at), so producer and consumer may run on different
hosts; a process outside Ray binds the loopback address.
"""

from __future__ import annotations

import secrets
import socket
import threading
from typing import TYPE_CHECKING, Any, Final

from rdt_jax import _limits
from rdt_jax.transports.transfer import protocol

if TYPE_CHECKING:
  from rdt_jax.transports.transfer.offers import Offers

#: Where a process outside Ray binds its servers.
LOOPBACK: Final = "127.0.0.1"


def node_address() -> str:
  """The address this process's servers bind and advertise: this node's Ray
  address, which other nodes reach it at, or the loopback outside Ray."""
  import ray

  if not ray.is_initialized():
    return LOOPBACK
  return ray.util.get_node_ip_address()


def platform_of(kind: str) -> str:
  """The JAX platform of the transfer server for a device kind."""
  return "cpu" if kind == "cpu" else "gpu"


class TransferServers:
  """This process's JAX transfer servers, by platform, under a lock of their own."""

  def __init__(self) -> None:
    self._lock = threading.Lock()
    self._servers: dict[str, Any] = {}

  def get(self, platform: str) -> Any:
    """This process's transfer server for `platform`, started on first use."""
    with self._lock:
      if platform not in self._servers:
        import jax
        from jax.experimental import transfer

        client = jax.local_devices(backend=platform)[0].client
        host = node_address()
        self._servers[platform] = transfer.start_transfer_server(
            client, f"{host}:0", [f"{host}:0"] * _limits.TRANSFER_BULK_SOCKETS
        )
      return self._servers[platform]


class OfferService:
  """Answers consumers' requests to offer an object's arrays under a uuid
  (the protocol: `protocol`). One thread per connection."""

  def __init__(self, offers: Offers):
    self.authkey = secrets.token_bytes(32)
    self._offers = offers
    self._listener = socket.create_server((node_address(), 0))
    self.address: tuple[str, int] = self._listener.getsockname()[:2]
    threading.Thread(target=self._accept, name="rdt-jax-transfer-offers", daemon=True).start()

  def _accept(self) -> None:
    while True:
      try:
        conn, _ = self._listener.accept()
      except OSError:
        continue
      threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

  def _serve(self, conn: socket.socket) -> None:
    pending: set[int] = set()  # uuids offered on this connection, not yet pulled
    with conn:
      try:
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        if not protocol.challenge(conn, self.authkey):
          return
        while True:
          message = protocol.receive(conn)
          if message.get("op") == "done":
            uuid = message.get("uuid")
            if type(uuid) is int and uuid in pending:
              pending.discard(uuid)
              self._offers.pulled(uuid)
            continue
          if message.get("op") != "offer":
            raise protocol.ProtocolError(f"an unknown operation {message.get('op')!r}")
          obj_id, uuid, cuts = protocol.offer_request(message)
          problem = self._offers.offer(obj_id, uuid, cuts)
          if problem is None:
            pending.add(uuid)
          protocol.send(conn, {"error": problem})
      except (EOFError, OSError, TimeoutError, protocol.ProtocolError, ValueError):
        pass  # the consumer left, or broke the protocol: the connection ends
      finally:
        for uuid in pending:
          self._offers.withdraw(uuid)
