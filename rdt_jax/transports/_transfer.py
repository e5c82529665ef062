"""`jax_transfer`: one-sided pulls with JAX's own transfer server.

`jax.experimental.transfer` is how JAX moves arrays between hosts without
NIXL (TPU slices over DCN, GPU hosts): a process starts a transfer server,
offers arrays with `await_pull(uuid, arrays)`, and a peer connected to it
pulls them with `pull(uuid, shape_dtype_structs)`, which allocates the arrays
on the peer's devices with the shardings it asks for.

How rdt_jax uses it:

* Producer (`export_arrays`): every leaf is offered as a `jax.Array` of its own dtype. jax
  leaves are offered as they are, sharding included; numpy and torch leaves
  go through the DLPack layer (`_dlpack.to_jax_exact`: zero-copy for torch cpu
  tensors and 64-byte aligned numpy arrays, a copy otherwise). The arrays are
  held until Ray frees the object (`garbage_collect`).
* An offer can be pulled once, and an RDT object may have any number of
  consumers, so each pull gets its own offer: the consumer picks a random
  uuid, asks the producer's offer service (`_OfferService`, a small TCP
  server, address and key in the metadata) to `await_pull` the object's
  arrays under it, and pulls. A pull that nobody offers would wait forever,
  so the offer comes first; the pull itself returns at once and
  `wait_pull` waits for the arrays to be ready.
* The offer protocol (`_send` / `_receive`): length-prefixed JSON messages of
  at most `MAX_MESSAGE` bytes, each field checked; nothing received is
  unpickled. A connection starts with an HMAC-SHA256 challenge on the key
  from the metadata. The key keeps peers that never saw an object's metadata
  (a port scan, a stray client) from having objects offered; anyone who can
  read the metadata from Ray's object store holds it, so it protects nothing
  from processes of the Ray cluster itself.
* Bounded waits and state: the producer's answer is awaited at most
  `ANSWER_TIMEOUT_S` (checking Ray's abort meanwhile), and no lock is held
  while waiting. The offer request runs in a thread of its own from
  `start_pull` (Ray starts every fetch of a `ray.get` before it waits for
  any), and `wait_pull` waits for it within the caller's timeout, the one
  `ray.get(ref, timeout=...)` was given: a stopped producer fails the
  caller's `ray.get` when its timeout passes, and the request stops at
  once. The consumer holds the connection its offer was made on
  until the pull ends: it then says "done" and pools the connection, or,
  after a failure, closes it. The producer pulls every offer still pending
  on a closed connection itself (a consumer that died, gave up or timed out),
  so its arrays are not kept after release. Pooled connections and JAX
  transfer connections unused for `IDLE_S` are closed and forgotten.
* Consumer: each leaf is pulled onto the device the receive plan chose, with
  the producer's mesh shape, axis names and partition spec for a sharded leaf
  (`_dlpack.receive_sharding`), or onto a single-device jax target; then the
  base converts it to the leaf's arriving type (numpy/torch leaves arrive as
  their source type again).
* Resharding (a target sharding or an `rdt_jax.Slice`) is done by the
  producer: jax's transfer server (jax 0.10) pairs source and destination
  shards by position, so pulling with another sharding moves the wrong bytes
  or fails. The offer request names the boxes the consumer needs (each
  distinct target shard, or the slice); the producer offers each as a
  single-device array cut from the leaf (a device copy on the producer), and
  only those bytes cross; replicated target shards are copied on the
  consumer.

Addresses: every server binds, and advertises in the metadata, this node's
Ray address (`ray.util.get_node_ip_address()`, the address other nodes reach
it at), so producer and consumer may run on different hosts; a process
outside Ray binds the loopback address. A consumer tells a producer that
exited (nothing listens at its address: connection refused) from one it
cannot reach (no route, or no answer within `CONNECT_TIMEOUT_S`).

Limits: a sharded leaf needs as many devices on the consumer as on the
producer, whatever type it arrives as (the pull moves shard to shard),
unless the consumer gives a target sharding or slice of its own. gpu and
tpu transfer servers have not run yet.
"""

from __future__ import annotations

import concurrent.futures
import errno
import hashlib
import hmac
import json
import math
import secrets
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final

from rdt_jax import _compat, _dlpack
from rdt_jax._metadata import DlpackTransportMetadata, MetadataError
from rdt_jax.transports._destinations import Placement
from rdt_jax.transports._whole_array import WholeArrayTransport

#: Where a process outside Ray binds its servers.
LOOPBACK: Final = "127.0.0.1"
#: A consumer gives up connecting to a producer's offer service after this.
CONNECT_TIMEOUT_S: Final = 10.0
#: A consumer gives up waiting for the offer service's answer after this.
ANSWER_TIMEOUT_S: Final = 30.0
#: Pooled offer connections and transfer connections unused this long are closed.
IDLE_S: Final = 60.0
#: The largest offer-protocol message either side accepts (bytes of JSON).
MAX_MESSAGE: Final = 1 << 20
#: Idle offer connections kept per producer.
POOL_PER_PRODUCER: Final = 4
#: Threads making offer requests (each waits for a producer's answer).
REQUEST_THREADS: Final = 16


def node_address() -> str:
  """The address this process's servers bind and advertise: this node's Ray
  address, which other nodes reach it at, or the loopback outside Ray."""
  import ray

  if not ray.is_initialized():
    return LOOPBACK
  return ray.util.get_node_ip_address()

#: Bulk-data sockets per transfer server. Every rdt_jax server uses the same
#: number: in jaxlib 0.10 a pull by a peer with fewer than the producer's
#: aborts the puller ("Check failed: bind(cfd, ...)"). One is as fast as four
#: on a 2-core host.
BULK_SOCKETS: Final = 1


@dataclass
class TransferTransportMetadata(DlpackTransportMetadata):
  """`jax_transfer` metadata: where to ask for an offer and where to pull.

  Attributes:
    server_address: the producer's transfer server for the leaves' platform.
    offer_address: `(host, port)` of the producer's offer service.
    authkey: the key the offer service's challenge asks for (see the module
      docstring for what it protects, and what not).
  """

  server_address: str | None = None
  offer_address: tuple[str, int] | None = None
  authkey: bytes | None = None

  __eq__ = object.__eq__
  __hash__ = object.__hash__

  def validate(self, obj_id: str) -> None:
    """Consumer: refuses metadata that cannot name a producer to pull from
    (extends `DlpackTransportMetadata.validate`).

    Raises:
      MetadataError: naming the object and the field.
    """
    super().validate(obj_id)
    if self.inline is not None:
      return
    if not isinstance(self.server_address, str) or not 0 < len(self.server_address) <= 256:
      raise MetadataError(obj_id, "server_address", f"is {self.server_address!r}, not host:port")
    address = self.offer_address
    if not (
        type(address) is tuple and len(address) == 2 and isinstance(address[0], str)
        and type(address[1]) is int and 0 < address[1] < 1 << 16
    ):
      raise MetadataError(obj_id, "offer_address", f"is {address!r}, not (host, port)")
    if type(self.authkey) is not bytes or len(self.authkey) != 32:
      raise MetadataError(obj_id, "authkey", "is not the 32-byte key of the offer service")


def _platform(kind: str) -> str:
  return "cpu" if kind == "cpu" else "gpu"


class ProtocolError(Exception):
  """A peer of the offer protocol sent something the protocol does not allow."""


def _send(sock: socket.socket, message: dict[str, Any]) -> None:
  data = json.dumps(message, separators=(",", ":")).encode()
  sock.sendall(struct.pack(">I", len(data)) + data)


def _receive(
    sock: socket.socket, deadline: float | None = None, interrupted: Callable[[], bool] | None = None
) -> dict[str, Any]:
  """One message: a JSON object of at most `MAX_MESSAGE` bytes.

  Waits until `deadline` (`time.monotonic()`; None: no limit), checking
  `interrupted` every 0.1 s.

  Raises:
    EOFError: the peer closed the connection.
    TimeoutError: the deadline passed.
    InterruptedError: `interrupted()` turned True.
    ProtocolError: a message too long, not JSON, or not an object.
  """
  header = _receive_exactly(sock, 4, deadline, interrupted)
  (n,) = struct.unpack(">I", header)
  if n > MAX_MESSAGE:
    raise ProtocolError(f"a message of {n} bytes (at most {MAX_MESSAGE})")
  try:
    message = json.loads(_receive_exactly(sock, n, deadline, interrupted))
  except (UnicodeDecodeError, json.JSONDecodeError) as e:
    raise ProtocolError(f"a message that is not JSON ({e})") from None
  if type(message) is not dict:
    raise ProtocolError("a message that is not a JSON object")
  return message


def _receive_exactly(
    sock: socket.socket, n: int, deadline: float | None, interrupted: Callable[[], bool] | None
) -> bytes:
  chunks, left = [], n
  while left:
    if deadline is not None or interrupted is not None:
      wait = 0.1 if deadline is None else min(0.1, deadline - time.monotonic())
      if deadline is not None and wait <= 0:
        raise TimeoutError
      sock.settimeout(max(wait, 0.001))
    try:
      data = sock.recv(min(left, 1 << 16))
    except TimeoutError:  # socket.timeout
      if interrupted is not None and interrupted():
        raise InterruptedError from None
      continue
    if not data:
      raise EOFError
    chunks.append(data)
    left -= len(data)
  return b"".join(chunks)


def _mac(key: bytes, nonce: str) -> str:
  return hmac.new(key, bytes.fromhex(nonce), hashlib.sha256).hexdigest()


def _offer_request(message: dict[str, Any]) -> tuple[str, int, list[Any] | None]:
  """`(obj_id, uuid, cuts)` of an "offer" message, every field checked.

  Raises:
    ProtocolError: naming the field that does not hold what the protocol allows.
  """
  obj_id, uuid, cuts = message.get("obj"), message.get("uuid"), message.get("cuts")
  if not isinstance(obj_id, str) or not 0 < len(obj_id) <= 256:
    raise ProtocolError("an offer without an object id")
  if type(uuid) is not int or not 0 <= uuid < 1 << 63:
    raise ProtocolError("an offer without a uuid")
  if cuts is not None:
    if type(cuts) is not list or not all(c is None or _is_boxes(c) for c in cuts):
      raise ProtocolError("an offer whose cuts are not boxes")
    cuts = [None if c is None else [tuple(tuple(r) for r in box) for box in c] for c in cuts]
  return obj_id, uuid, cuts


def _is_boxes(value: Any) -> bool:
  return type(value) is list and all(
      type(box) is list and all(
          type(r) is list and len(r) == 2 and all(type(v) is int and v >= 0 for v in r) and r[0] <= r[1]
          for r in box
      )
      for box in value
  )


class _OfferService:
  """Answers consumers' requests to offer an object's arrays under a uuid
  (the protocol: the module docstring). One thread per connection."""

  def __init__(self, transport: TransferTransport):
    self.authkey = secrets.token_bytes(32)
    self._transport = transport
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
        nonce = secrets.token_hex(32)
        _send(conn, {"nonce": nonce})
        answer = _receive(conn, time.monotonic() + ANSWER_TIMEOUT_S)
        if not isinstance(answer.get("mac"), str) or not hmac.compare_digest(answer["mac"], _mac(self.authkey, nonce)):
          return
        conn.settimeout(None)
        _send(conn, {"ok": True})
        while True:
          message = _receive(conn)
          if message.get("op") == "done":
            uuid = message.get("uuid")
            if type(uuid) is int and uuid in pending:
              pending.discard(uuid)
              self._transport.pulled(uuid)
            continue
          if message.get("op") != "offer":
            raise ProtocolError(f"an unknown operation {message.get('op')!r}")
          obj_id, uuid, cuts = _offer_request(message)
          problem = self._transport.offer(obj_id, uuid, cuts)
          if problem is None:
            pending.add(uuid)
          _send(conn, {"error": problem})
      except (EOFError, OSError, TimeoutError, ProtocolError, ValueError):
        pass  # the consumer left, or broke the protocol: the connection ends
      finally:
        for uuid in pending:
          self._transport.withdraw(uuid)


class _Pool:
  """The consumer's authenticated connections to producers' offer services,
  each used by one request at a time; idle ones are closed after `IDLE_S`
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
      RuntimeError: the producer exited or cannot be reached (`_probe`), or
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
    sock = _probe(address, obj_id)
    try:
      deadline = time.monotonic() + ANSWER_TIMEOUT_S
      nonce = _receive(sock, deadline, interrupted).get("nonce")
      if not isinstance(nonce, str):
        raise ProtocolError("no challenge")
      _send(sock, {"mac": _mac(authkey, nonce)})
      if _receive(sock, deadline, interrupted).get("ok") is not True:
        raise ProtocolError("the challenge was not accepted")
    except (EOFError, OSError, TimeoutError, ProtocolError, ValueError) as e:
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
      if len(idle) < POOL_PER_PRODUCER:
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
    """Closes connections idle longer than `IDLE_S`."""
    cutoff = time.monotonic() - IDLE_S
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


@dataclass
class _Pull:
  """A pull in progress: the pulled arrays, how to make the leaves, the
  offer connection it holds until the pull ends, and the request that
  makes the offer and starts the pull (`TransferTransport._begin`, in a
  thread; `stop` ends it, and once set no connection is kept)."""

  pulled: list[Any]
  recipes: list[tuple[Any, ...]]
  sock: socket.socket | None = None
  address: tuple[str, int] = ("", 0)
  uuid: int = 0
  done: bool = field(default=False)
  request: concurrent.futures.Future[None] | None = None
  stop: threading.Event = field(default_factory=threading.Event)
  lock: threading.Lock = field(default_factory=threading.Lock)


_request_pool: list[concurrent.futures.ThreadPoolExecutor] = []
_request_pool_lock = threading.Lock()


def _requests() -> concurrent.futures.ThreadPoolExecutor:
  """The threads offer requests run in (created at the first pull)."""
  with _request_pool_lock:
    if not _request_pool:
      _request_pool.append(concurrent.futures.ThreadPoolExecutor(REQUEST_THREADS, thread_name_prefix="rdt-jax-offer"))
    return _request_pool[0]


class TransferTransport(WholeArrayTransport):
  """The `jax_transfer` transport: pulls through JAX's transfer server."""

  name = "jax_transfer"
  devices = ("cpu", "cuda")
  metadata_class = TransferTransportMetadata

  def __init__(self) -> None:
    super().__init__()
    self._lock = threading.RLock()
    self._servers: dict[str, Any] = {}
    self._offers: dict[str, tuple[str, list[Any]]] = {}
    self._pending: dict[int, tuple[str, list[Any]]] = {}  # uuid -> (platform, arrays) offered, not pulled
    self._service: _OfferService | None = None
    self._connections: dict[tuple[str, str], tuple[float, Any]] = {}  # -> (last use, connection)
    self._pool = _Pool()

  @staticmethod
  def is_one_sided() -> bool:
    return True

  @staticmethod
  def can_abort_transport() -> bool:
    return True

  @classmethod
  def available_in_process(cls) -> bool:
    return _compat.has_jax_transfer()

  def _server(self, platform: str) -> Any:
    """This process's transfer server for `platform`, started on first use."""
    with self._lock:
      if platform not in self._servers:
        import jax
        from jax.experimental import transfer

        client = jax.local_devices(backend=platform)[0].client
        host = node_address()
        self._servers[platform] = transfer.start_transfer_server(
            client, f"{host}:0", [f"{host}:0"] * BULK_SOCKETS
        )
      return self._servers[platform]

  def num_offers(self) -> int:
    """How many RDT objects this process offers now."""
    with self._lock:
      return len(self._offers)

  def num_pending_offers(self) -> int:
    """Offers made to consumers and not pulled yet (each holds its arrays)."""
    with self._lock:
      return len(self._pending)

  def num_peers(self) -> int:
    """Producers this consumer keeps connections to (pooled offer
    connections and transfer connections); idle ones go after `IDLE_S`."""
    with self._lock:
      return len(self._connections) + len(self._pool)

  # ---- producer

  def export_arrays(
      self,
      obj_id: str,
      arrays: list[Any],
      leaves: list[_dlpack.DescribedLeaf],
      meta: TransferTransportMetadata,
  ) -> None:
    offered = [
        # Owned copies of numpy and torch leaves: what a consumer reads is the
        # value at return, whatever the buffer's alignment (docs/concepts.md).
        _dlpack.to_jax_exact(a, d.spec.path, own=True)
        for a, d in zip(arrays, leaves)
        if d.spec.nbytes  # a pull of only empty arrays never completes
    ]
    platform = _platform(meta.tensor_device or "cpu")
    server = self._server(platform)
    with self._lock:
      if self._service is None:
        self._service = _OfferService(self)
      self._offers[obj_id] = (platform, offered)
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
      entry = self._offers.get(obj_id)
    if entry is None:
      return f"object {obj_id} is no longer offered (it was freed)"
    platform, arrays = entry
    if cuts is not None:
      if len(cuts) != len(arrays) or any(
          boxes is not None and any(not _fits(box, a.shape) for box in boxes) for boxes, a in zip(cuts, arrays)
      ):
        return f"the requested parts do not fit object {obj_id}'s arrays"
      arrays = [
          part
          for a, boxes in zip(arrays, cuts)
          for part in ([a] if boxes is None else [_cut(a, box) for box in boxes if _volume(box)])
      ]
    with self._lock:
      if uuid in self._pending:
        return f"uuid {uuid} is already offered"
      self._pending[uuid] = (platform, arrays)
    self._server(platform).await_pull(uuid, arrays)
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
      server = self._server(platform)
      server.connect(server.address()).pull(uuid, structs)
    except Exception:  # the process is shutting down; nothing left to free
      pass

  def release(self, obj_id: str) -> None:
    with self._lock:
      self._offers.pop(obj_id, None)

  # ---- consumer

  def _connection(self, platform: str, address: str) -> Any:
    """The transfer connection to the producer's server at `address` (kept
    while used, closed after `IDLE_S` unused)."""
    self.prune()
    now = time.monotonic()
    with self._lock:
      key = (platform, address)
      entry = self._connections.get(key)
      connection = entry[1] if entry is not None else self._server(platform).connect(address)
      self._connections[key] = (now, connection)
      return connection

  def prune(self) -> None:
    """Closes offer connections and forgets transfer connections unused for
    `IDLE_S` (called at each pull)."""
    self._pool.prune()
    cutoff = time.monotonic() - IDLE_S
    with self._lock:
      for key in [k for k, (t, _) in self._connections.items() if t < cutoff]:
        del self._connections[key]

  def _forget_producer(self, meta: TransferTransportMetadata, address: tuple[str, int]) -> None:
    """Drops every connection to a producer that is gone."""
    self._pool.forget(address)
    with self._lock:
      for key in [k for k in self._connections if k[1] == meta.server_address]:
        del self._connections[key]

  def _request_offer(
      self, meta: TransferTransportMetadata, obj_id: str, uuid: int, cuts: list[Any], stop: threading.Event
  ) -> tuple[socket.socket, tuple[str, int]]:
    """Asks the producer to offer `obj_id` under `uuid`; returns the
    connection the offer was made on (held until the pull ends) and its
    address.

    Raises:
      RuntimeError: the producer is gone, did not answer within
        `ANSWER_TIMEOUT_S`, or cannot offer the object; or Ray aborted the
        fetch, or `stop` was set, meanwhile.
    """
    address = (meta.offer_address[0], int(meta.offer_address[1]))  # type: ignore[index]
    where = f"{address[0]}:{address[1]}"

    def interrupted() -> bool:
      return stop.is_set() or self.aborted(obj_id)

    sock = self._pool.take(address, meta.authkey or b"", obj_id, interrupted)
    try:
      _send(sock, {"op": "offer", "obj": obj_id, "uuid": uuid, "cuts": cuts})
      answer = _receive(sock, time.monotonic() + ANSWER_TIMEOUT_S, interrupted)
    except TimeoutError:
      sock.close()
      raise RuntimeError(
          f"The offer service of object {obj_id}'s producer at {where} did not answer within "
          f"{ANSWER_TIMEOUT_S:g}s: the producer process is stopped or overloaded. Retry the "
          "fetch, or check the producing actor."
      ) from None
    except InterruptedError:
      sock.close()
      raise RuntimeError(f"jax_transfer pull of object {obj_id} was aborted.") from None
    except (EOFError, OSError, ProtocolError):
      sock.close()
      self._forget_producer(meta, address)
      raise RuntimeError(
          f"Cannot reach the offer service of object {obj_id}'s producer at {where}; the "
          "producer may have died."
      ) from None
    problem = answer.get("error")
    if problem is not None:
      self._pool.give_back(address, sock)
      raise RuntimeError(f"Cannot pull: {problem}.")
    return sock, address

  def start_pull(
      self,
      obj_id: str,
      meta: TransferTransportMetadata,
      communicator_metadata: Any,
      placements: list[Placement],
  ) -> _Pull:
    import jax

    structs: list[Any] = []  # what is pulled, in offer order
    cuts: list[Any] = []  # per offered (non-empty) leaf: None or its boxes
    recipes: list[tuple[Any, ...]] = []  # per leaf: how to make it from `structs`
    for spec, p in zip(meta.leaves, placements):
      if p.layout is None:
        sharding = p.template.sharding if p.template is not None else _dlpack.receive_sharding(spec, p.device)
        struct = jax.ShapeDtypeStruct(spec.shape, spec.dtype, sharding=sharding)
        if spec.nbytes:
          cuts.append(None)
          recipes.append(("whole", len(structs)))
          structs.append(struct)
        else:  # empty leaves hold no bytes (and are not offered): made here
          recipes.append(("empty", struct))
        continue
      # Resharded: each distinct target piece is cut on the producer and
      # pulled as a single-device array onto the first device that holds it
      # (jax's transfer server pairs shards by position, so pulling the whole
      # array with another sharding would move the wrong bytes).
      layout = p.layout
      devices = [
          layout.devices[layout.device_pieces.index(i)] if layout.sharding is not None
          else _dlpack.jax_device(p.device)
          for i in range(len(layout.pieces))
      ]
      indices: list[Any] = []
      for box, device in zip(layout.pieces, devices):
        struct = jax.ShapeDtypeStruct(
            _dlpack.box_shape(box), spec.dtype, sharding=jax.sharding.SingleDeviceSharding(device)
        )
        if _volume(box):
          indices.append(len(structs))
          structs.append(struct)
        else:
          indices.append(struct)
      if spec.nbytes:
        cuts.append(list(layout.pieces))
      recipes.append(("pieces", indices, layout, devices))
    if not structs:
      return _Pull([], recipes)
    platform = _platform(placements[0].device.kind)
    handle = _Pull([], recipes, uuid=secrets.randbits(62))
    handle.request = _requests().submit(self._begin, handle, meta, obj_id, cuts, structs, platform)
    return handle

  def _begin(self, handle: _Pull, meta: TransferTransportMetadata, obj_id: str, cuts: list[Any],
             structs: list[Any], platform: str) -> None:
    """A pull's request (in a thread of `_requests()`): asks the producer
    for the offer, then starts the pull. A pull stopped meanwhile
    (`handle.stop`: given up, timed out or cancelled) keeps no connection."""
    assert meta.server_address is not None
    connection = self._connection(platform, meta.server_address)
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

  def _wait_request(self, handle: _Pull, obj_id: str, deadline: float | None, timeout: float) -> None:
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

  def _end_pull(self, handle: _Pull, pulled: bool) -> None:
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
        _send(sock, {"op": "done", "uuid": handle.uuid})
        self._pool.give_back(handle.address, sock)
        return
      except OSError:
        pass
    sock.close()

  def cancel_pull(self, handle: Any) -> None:
    """A fetch dropped unfinished: its offer connection closes (the producer
    withdraws the offer)."""
    if isinstance(handle, _Pull):
      self._end_pull(handle, pulled=False)

  def wait_pull(self, handle: _Pull, obj_id: str, timeout: float) -> list[Any]:
    import jax
    import jax.numpy as jnp

    deadline = None if timeout is None or timeout < 0 else time.monotonic() + timeout
    sleep = 0.0
    try:
      if handle.request is not None:
        self._wait_request(handle, obj_id, deadline, timeout)
      pulled, recipes = handle.pulled, handle.recipes
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

    def empty(struct: Any) -> Any:
      with jax.enable_x64(True):
        return jnp.zeros(struct.shape, struct.dtype, device=struct.sharding)

    out = []
    for recipe in recipes:
      if recipe[0] == "whole":
        out.append(pulled[recipe[1]])
      elif recipe[0] == "empty":
        out.append(empty(recipe[1]))
      else:
        _, indices, layout, devices = recipe
        pieces = [pulled[i] if isinstance(i, int) else empty(i) for i in indices]
        if layout.sharding is None:
          out.append(pieces[0])
          continue
        # Replicated target shards: the piece crossed once; copies are local.
        shards = [
            pieces[i] if devices[i] == d else jax.device_put(pieces[i], d)
            for d, i in zip(layout.devices, layout.device_pieces)
        ]
        out.append(jax.make_array_from_single_device_arrays(layout.shape, layout.sharding, shards))
    return out


def _probe(address: tuple[str, int], obj_id: str) -> socket.socket:
  """Connects to `address` with a timeout, so that an unreachable producer
  fails within `CONNECT_TIMEOUT_S` (a plain connect waits for the kernel's,
  minutes) and the error says which it is. Returns the connection.

  Raises:
    RuntimeError: the producer exited (connection refused), or its host
      cannot be reached.
  """
  where = f"{address[0]}:{address[1]}"
  try:
    sock = socket.create_connection(address, timeout=CONNECT_TIMEOUT_S)
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
        f"node within {CONNECT_TIMEOUT_S:g}s ({e.strerror or 'timed out'}): the network between "
        "the two nodes is down or filters the port. jax_transfer needs the producer's node "
        "address reachable on any port from the consumer's node."
    ) from None
  sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
  return sock


def _fits(box: Any, shape: tuple[int, ...]) -> bool:
  return len(box) == len(shape) and all(0 <= lo <= hi <= n for (lo, hi), n in zip(box, shape))


def _volume(box: Any) -> int:
  return math.prod(hi - lo for lo, hi in box)


def _cut(array: Any, box: Any) -> Any:
  """`array[box]` as a single-device array on the producer (a copy)."""
  import jax

  part = array[tuple(slice(lo, hi) for lo, hi in box)]
  return jax.device_put(part, next(iter(array.devices())))
