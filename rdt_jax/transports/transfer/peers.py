"""The consumer's connections to producers, and how it asks one for an offer.

* `probe`: a connection to a producer's offer service that fails within
  `_limits.TRANSFER_CONNECT_TIMEOUT_S`, saying whether the producer exited (nothing listens
  at its address: connection refused) or this node cannot reach it (no
  route, or no answer in time).
* `Pool`: authenticated offer connections (`protocol.answer_challenge`), each
  used by one request at a time; at most `_limits.TRANSFER_POOL_PER_PRODUCER` idle ones are
  kept per producer.
* `Peers`: the pool and the JAX transfer connections to producers' transfer
  servers. `request_offer` asks a producer to offer an object under a uuid,
  waiting for the answer at most `_limits.TRANSFER_ANSWER_TIMEOUT_S` (and no lock held
  meanwhile), and returns the connection the offer was made on: the consumer
  holds it until the pull ends, then says "done" and gives it back to the
  pool, or, after a failure, closes it.

Connections unused for `_limits.TRANSFER_IDLE_S` are closed and forgotten (`prune`, at each
pull), and every connection to a producer that is gone is dropped at once
(`forget`), so that the next request connects afresh.
"""

from __future__ import annotations

import errno
import socket
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from rdt_jax import _limits
from rdt_jax.transports.transfer import protocol

if TYPE_CHECKING:
  from rdt_jax.transports.transfer.metadata import TransferTransportMetadata
  from rdt_jax.transports.transfer.server import TransferServers


def probe(address: tuple[str, int], obj_id: str) -> socket.socket:
  """Connects to `address` with a timeout, so that an unreachable producer
  fails within `_limits.TRANSFER_CONNECT_TIMEOUT_S` (a plain connect waits for the kernel's,
  minutes) and the error says which it is. Returns the connection.

  Raises:
    RuntimeError: the producer exited (connection refused), or its host
      cannot be reached.
  """
  where = f"{address[0]}:{address[1]}"
  try:
    sock = socket.create_connection(address, timeout=_limits.TRANSFER_CONNECT_TIMEOUT_S)
  except ConnectionRefusedError:
    raise RuntimeError(
        f"Nothing listens at {where}, the offer service of object {obj_id}'s producer: the "
        "producer process has exited (the object died with it)."
    ) from None
  except OSError as e:
    unreachable = isinstance(e, TimeoutError) or e.errno in (errno.EHOSTUNREACH, errno.ENETUNREACH)
    if not unreachable:
      raise
    raise RuntimeError(
        f"Cannot reach {where}, the offer service of object {obj_id}'s producer, from this "
        f"node within {_limits.TRANSFER_CONNECT_TIMEOUT_S:g}s ({e.strerror or 'timed out'}): the network between "
        "the two nodes is down or filters the port. jax_transfer needs the producer's node "
        "address reachable on any port from the consumer's node."
    ) from None
  sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
  return sock


class Pool:
  """The consumer's authenticated connections to producers' offer services,
  each used by one request at a time; idle ones are closed after `_limits.TRANSFER_IDLE_S`
  (and forgotten with their producer)."""

  def __init__(self) -> None:
    self._lock = threading.Lock()
    self._idle: dict[tuple[str, int], list[tuple[float, socket.socket]]] = {}

  def __len__(self) -> int:
    """Producers with idle connections."""
    with self._lock:
      return len(self._idle)

  def take(self, address: tuple[str, int], authkey: bytes, obj_id: str,
           interrupted: Callable[[], bool] | None = None) -> socket.socket:
    """An idle connection to `address`, or a new one (authenticated).

    Raises:
      RuntimeError: the producer exited or cannot be reached (`probe`), or
        did not complete the challenge in time, or `interrupted()` turned
        True while it was awaited.
    """
    self.prune()
    with self._lock:
      idle = self._idle.get(address)
      if idle:
        sock = idle.pop()[1]
        if not idle:
          del self._idle[address]
        return sock
    sock = probe(address, obj_id)
    try:
      protocol.answer_challenge(sock, authkey, interrupted)
    except (EOFError, OSError, TimeoutError, protocol.ProtocolError, ValueError) as e:
      sock.close()
      raise RuntimeError(
          f"The offer service of object {obj_id}'s producer at {address[0]}:{address[1]} refused "
          f"or did not answer the connection ({type(e).__name__}: {e}): the producer may have "
          "died or be overloaded, or the metadata's key does not match."
      ) from None
    return sock

  def give_back(self, address: tuple[str, int], sock: socket.socket) -> None:
    with self._lock:
      idle = self._idle.setdefault(address, [])
      if len(idle) < _limits.TRANSFER_POOL_PER_PRODUCER:
        idle.append((time.monotonic(), sock))
        return
    sock.close()

  def forget(self, address: tuple[str, int]) -> None:
    """Closes every idle connection to `address` (its producer is gone)."""
    with self._lock:
      idle = self._idle.pop(address, [])
    for _, sock in idle:
      sock.close()

  def prune(self) -> None:
    """Closes connections idle longer than `_limits.TRANSFER_IDLE_S`."""
    cutoff = time.monotonic() - _limits.TRANSFER_IDLE_S
    stale = []
    with self._lock:
      for address in list(self._idle):
        keep = [(t, s) for t, s in self._idle[address] if t >= cutoff]
        stale += [s for t, s in self._idle[address] if t < cutoff]
        if keep:
          self._idle[address] = keep
        else:
          del self._idle[address]
    for sock in stale:
      sock.close()


class Peers:
  """The consumer's connections to producers: the offer connections' `pool`,
  and transfer connections (kept while used, closed after `_limits.TRANSFER_IDLE_S` unused)
  under a lock of their own."""

  def __init__(self, servers: TransferServers) -> None:
    self.pool = Pool()
    self._servers = servers
    self._lock = threading.Lock()
    self._connections: dict[tuple[str, str], tuple[float, Any]] = {}  # -> (last use, connection)

  def __len__(self) -> int:
    """Producers this consumer keeps connections to (pooled offer
    connections and transfer connections); idle ones go after `_limits.TRANSFER_IDLE_S`."""
    with self._lock:
      return len(self._connections) + len(self.pool)

  def connection(self, platform: str, address: str) -> Any:
    """The transfer connection to the producer's server at `address` (kept
    while used, closed after `_limits.TRANSFER_IDLE_S` unused)."""
    self.prune()
    now = time.monotonic()
    with self._lock:
      key = (platform, address)
      entry = self._connections.get(key)
      connection = entry[1] if entry is not None else self._servers.get(platform).connect(address)
      self._connections[key] = (now, connection)
      return connection

  def prune(self) -> None:
    """Closes offer connections and forgets transfer connections unused for
    `_limits.TRANSFER_IDLE_S` (called at each pull)."""
    self.pool.prune()
    cutoff = time.monotonic() - _limits.TRANSFER_IDLE_S
    with self._lock:
      for key in [k for k, (t, _) in self._connections.items() if t < cutoff]:
        del self._connections[key]

  def forget(self, meta: TransferTransportMetadata, address: tuple[str, int]) -> None:
    """Drops every connection to a producer that is gone."""
    self.pool.forget(address)
    with self._lock:
      for key in [k for k in self._connections if k[1] == meta.server_address]:
        del self._connections[key]

  def request_offer(
      self, meta: TransferTransportMetadata, obj_id: str, uuid: int, cuts: list[Any],
      interrupted: Callable[[], bool],
  ) -> tuple[socket.socket, tuple[str, int]]:
    """Asks the producer to offer `obj_id` under `uuid`; returns the
    connection the offer was made on (held until the pull ends) and its
    address.

    Raises:
      RuntimeError: the producer is gone, did not answer within
        `_limits.TRANSFER_ANSWER_TIMEOUT_S`, or cannot offer the object; or `interrupted()`
        turned True meanwhile (Ray aborted the fetch, or the pull stopped).
    """
    address = (meta.offer_address[0], int(meta.offer_address[1]))  # type: ignore[index]
    where = f"{address[0]}:{address[1]}"
    sock = self.pool.take(address, meta.authkey or b"", obj_id, interrupted)
    try:
      protocol.send(sock, {"op": "offer", "obj": obj_id, "uuid": uuid, "cuts": cuts})
      answer = protocol.receive(sock, time.monotonic() + _limits.TRANSFER_ANSWER_TIMEOUT_S, interrupted)
    except TimeoutError:
      sock.close()
      raise RuntimeError(
          f"The offer service of object {obj_id}'s producer at {where} did not answer within "
          f"{_limits.TRANSFER_ANSWER_TIMEOUT_S:g}s: the producer process is stopped or overloaded. Retry the "
          "fetch, or check the producing actor."
      ) from None
    except InterruptedError:
      sock.close()
      raise RuntimeError(f"jax_transfer pull of object {obj_id} was aborted.") from None
    except (EOFError, OSError, protocol.ProtocolError):
      sock.close()
      self.forget(meta, address)
      raise RuntimeError(
          f"Cannot reach the offer service of object {obj_id}'s producer at {where}; the "
          "producer may have died."
      ) from None
    problem = answer.get("error")
    if problem is not None:
      self.pool.give_back(address, sock)
      raise RuntimeError(f"Cannot pull: {problem}.")
    return sock, address
