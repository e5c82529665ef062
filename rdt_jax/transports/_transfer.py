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
  uuid, asks the producer's offer service (a small authenticated socket
  server, address and key in the metadata) to `await_pull` the object's
  arrays under it, and pulls. A pull that nobody offers would wait forever,
  so the offer comes first; the pull itself returns at once and
  `wait_pull` waits for the arrays to be ready.
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

import errno
import math
import secrets
import socket
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Client, Listener
from typing import Any, Final

from rdt_jax import _compat, _dlpack
from rdt_jax._metadata import DlpackTransportMetadata
from rdt_jax.transports._base import Placement, WholeArrayTransport

#: Where a process outside Ray binds its servers.
LOOPBACK: Final = "127.0.0.1"
#: A consumer gives up connecting to a producer's offer service after this.
CONNECT_TIMEOUT_S: Final = 10.0


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
    authkey: the key the offer service accepts (Ray's object store carries it
      to consumers only).
  """

  server_address: str | None = None
  offer_address: tuple[str, int] | None = None
  authkey: bytes | None = None

  __eq__ = object.__eq__
  __hash__ = object.__hash__


def _platform(kind: str) -> str:
  return "cpu" if kind == "cpu" else "gpu"


class _OfferService:
  """Answers consumers' requests to offer an object's arrays under a uuid."""

  def __init__(self, transport: TransferTransport):
    self.authkey = secrets.token_bytes(32)
    self._transport = transport
    self._listener = Listener((node_address(), 0), authkey=self.authkey)
    self.address: tuple[str, int] = self._listener.address
    threading.Thread(target=self._accept, name="rdt-jax-transfer-offers", daemon=True).start()

  def _accept(self) -> None:
    while True:
      try:
        conn = self._listener.accept()
      except Exception:  # a peer that failed authentication
        continue
      threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

  def _serve(self, conn: Any) -> None:
    with conn:
      while True:
        try:
          obj_id, uuid, cuts = conn.recv()
        except (EOFError, OSError):
          return
        try:
          conn.send(self._transport.offer(obj_id, uuid, cuts))
        except (EOFError, OSError):
          return


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
    self._service: _OfferService | None = None
    self._connections: dict[tuple[str, str], Any] = {}
    self._clients: dict[tuple[str, int], tuple[Any, threading.Lock]] = {}

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

  # ---- producer

  def export_arrays(
      self,
      obj_id: str,
      arrays: list[Any],
      leaves: list[_dlpack.DescribedLeaf],
      meta: TransferTransportMetadata,
  ) -> None:
    offered = [
        _dlpack.to_jax_exact(a, d.spec.path)
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
      None, or why it cannot (the object was freed).
    """
    with self._lock:
      entry = self._offers.get(obj_id)
    if entry is None:
      return f"object {obj_id} is no longer offered (it was freed)"
    platform, arrays = entry
    if cuts is not None:
      arrays = [
          part
          for a, boxes in zip(arrays, cuts)
          for part in ([a] if boxes is None else [_cut(a, box) for box in boxes if _volume(box)])
      ]
    self._server(platform).await_pull(uuid, arrays)
    return None

  def release(self, obj_id: str) -> None:
    with self._lock:
      self._offers.pop(obj_id, None)

  # ---- consumer

  def _connection(self, platform: str, address: str) -> Any:
    with self._lock:
      key = (platform, address)
      if key not in self._connections:
        self._connections[key] = self._server(platform).connect(address)
      return self._connections[key]

  def _request_offer(
      self, meta: TransferTransportMetadata, obj_id: str, uuid: int, cuts: list[Any]
  ) -> None:
    assert meta.offer_address is not None
    address = (meta.offer_address[0], int(meta.offer_address[1]))
    try:
      with self._lock:
        if address not in self._clients:
          _probe(address, obj_id)
          self._clients[address] = (Client(address, authkey=meta.authkey), threading.Lock())
        client, lock = self._clients[address]
      with lock:
        client.send((obj_id, uuid, cuts))
        problem = client.recv()
    except (EOFError, OSError):
      with self._lock:
        self._clients.pop(address, None)
      raise RuntimeError(
          f"Cannot reach the offer service of object {obj_id}'s producer at "
          f"{address[0]}:{address[1]}; the producer may have died."
      ) from None
    if problem is not None:
      raise RuntimeError(f"Cannot pull: {problem}.")

  def start_pull(
      self,
      obj_id: str,
      meta: TransferTransportMetadata,
      communicator_metadata: Any,
      placements: list[Placement],
  ) -> list[Any]:
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
    pulled = []
    if structs:
      platform = _platform(placements[0].device.kind)
      assert meta.server_address is not None
      connection = self._connection(platform, meta.server_address)
      uuid = secrets.randbits(62)
      self._request_offer(meta, obj_id, uuid, cuts)
      pulled = connection.pull(uuid, structs)
    return [pulled, recipes]

  def wait_pull(self, handle: list[Any], obj_id: str, timeout: float) -> list[Any]:
    import jax
    import jax.numpy as jnp

    pulled, recipes = handle
    deadline = None if timeout is None or timeout < 0 else time.monotonic() + timeout
    sleep = 0.0
    while not all(a.is_ready() for a in pulled):
      if self.aborted(obj_id):
        raise RuntimeError(f"jax_transfer pull of object {obj_id} was aborted.")
      if deadline is not None and time.monotonic() >= deadline:
        raise TimeoutError(f"jax_transfer pull of object {obj_id} timed out after {timeout}s.")
      sleep = min(0.001, sleep + 0.00005)
      time.sleep(sleep)
    for a in pulled:
      a.block_until_ready()  # raises the pull's error, if any

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


def _probe(address: tuple[str, int], obj_id: str) -> None:
  """Connects to `address` once with a timeout, so that an unreachable
  producer fails within `CONNECT_TIMEOUT_S` (a plain connect waits for the
  kernel's, minutes) and the error says which it is.

  Raises:
    RuntimeError: the producer exited (connection refused), or its host
      cannot be reached.
  """
  where = f"{address[0]}:{address[1]}"
  try:
    socket.create_connection(address, timeout=CONNECT_TIMEOUT_S).close()
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


def _volume(box: Any) -> int:
  return math.prod(hi - lo for lo, hi in box)


def _cut(array: Any, box: Any) -> Any:
  """`array[box]` as a single-device array on the producer (a copy)."""
  import jax

  part = array[tuple(slice(lo, hi) for lo, hi in box)]
  return jax.device_put(part, next(iter(array.devices())))
