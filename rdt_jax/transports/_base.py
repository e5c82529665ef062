"""The shared half of every rdt_jax transport: `DlpackTransport`.

`DlpackTransport` implements Ray's `TensorTransportManager` for any array
type: it turns the leaves Ray extracted into framework-neutral metadata and raw
buffers (through the DLPack layer, `rdt_jax._dlpack`), plans the receive
(`ReceivePlan`), and rebuilds the consumer's arrays. A backend subclass only
moves bytes: register, move, release. Its hooks are declared here, each
required of one kind of transport (one-sided or two-sided) or optional; a
subclass that misses one its kind needs is refused when it is defined. A
backend that moves whole jax arrays rather than bytes (`jax_transfer`)
subclasses `WholeArrayTransport` instead (`_whole_array`).

This module is Ray's interface and the hooks; the work is done in rooms of
their own under `rdt_jax.transports`:

* `_extract`: the producer's side (describe, check, in band or export, send);
* `_fetch`: the consumer's side (plan, start, wait, rebuild; two-sided
  scratch receives; a backend's errors wrapped for Ray);
* `_aborts`: the marks `abort_transport` leaves;
* `_capabilities`: the cached answers to `actor_has_tensor_transport`;
* `_required`: which hooks each kind needs, checked at definition and on
  registration.

Where in-band sending is turned on (`RDT_JAX_INLINE_MAX_BYTES` above 0; off
by default), small objects of one-sided backends travel in band
(`rdt_jax.transports._inband`): an object whose leaves are all host memory and
hold at most that many bytes in all is copied into its metadata, and no
backend hook runs for it on either side (`DlpackTransport` states the
contract); counted in `receive_stats()` as `inline`.

Every fetch, whatever its path, ends with the lifetime check
(`rdt_jax.transports._lifetime`): an object whose producer actor has died is
refused with one error on every host.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from ray.experimental.rdt.tensor_transport_manager import (
    CommunicatorMetadata,
    TensorTransportManager,
)

from rdt_jax import _dlpack, _handoff, _ray, _targets
from rdt_jax._metadata import DlpackTransportMetadata
from rdt_jax.transports import _extract, _fetch, _inband, _required
from rdt_jax.transports._aborts import AbortMarks
from rdt_jax.transports._capabilities import ActorCapabilities
from rdt_jax.transports._destinations import Destination, MemoryKind, Placement
from rdt_jax.transports._extract import Exported
from rdt_jax.transports._fetch import DlpackFetchRequest, ReceiveCounts
from rdt_jax.transports._plan import ReceivePlan
from rdt_jax.transports._required import abstract_hook

if TYPE_CHECKING:
  import ray

__all__ = [
    "Destination",
    "DlpackFetchRequest",
    "DlpackTransport",
    "Placement",
]


class DlpackTransport(TensorTransportManager):
  """Base class of every rdt_jax transport: subclass it to add a backend.

  The base implements Ray's `TensorTransportManager` for jax, torch and numpy
  leaves alike: it validates and describes the leaves Ray extracted, builds
  the metadata (`DlpackTransportMetadata`), allocates receive buffers (a
  `Destination` per chunk), rebuilds each leaf as the type the consumer asked
  for (`rdt_jax.receive_as`) and handles targets, aborts and errors. A
  subclass only moves bytes. It sets:

  * `name`: the lower-case transport name users pass as `tensor_transport`;
  * `devices`: the device kinds it moves ("cpu", "cuda");
  * `is_one_sided()` and `can_abort_transport()` (Ray's static methods);
  * `reads_parts` (default False): True if `start_receive` honours each
    destination's `source` and `source_offset` (and may be given byte runs
    of chunks, `Destination.part`), so a resharded or sliced leaf moves only
    the bytes the consumer needs; otherwise such a leaf's chunks arrive
    whole, one destination per chunk in order, and are cut on the host;

  and implements the hooks its kind needs. On the producer, a one-sided
  backend implements `export_buffers(obj_id, leaves, meta)` (make the
  described buffers reachable, add what consumers need to `meta`) and
  `release(obj_id)` (undo it when Ray frees the object); a two-sided one
  `send_buffers(leaves, meta, communicator_metadata)`. On the consumer both
  implement `start_receive(obj_id, meta, communicator_metadata,
  destinations)` (start moving every chunk into its destination; return a
  handle); `wait_receive(handle, obj_id, timeout)`, and
  `finish_receive(handle)` / `cancel_receive(handle)` to release what the
  receive took, are optional. A subclass that sets `name` and
  `is_one_sided()` but misses a hook its kind needs is refused with a
  `TypeError` when it is defined (and `register_transport` refuses one
  without `is_one_sided()` / `can_abort_transport()`). Register a
  subclass with `rdt_jax.register_transport(MyTransport)`;
  `examples/shm_transport.py` is a complete one in under 100 lines.

  Which objects reach the backend's hooks: where in-band sending is turned
  on (`RDT_JAX_INLINE_MAX_BYTES` above 0; 0, the default, turns it off), an
  object of a one-sided backend whose leaves are all host memory and hold at
  most that many bytes in all travels in band, inside its metadata
  (`rdt_jax.transports._inband`). For such an object no hook runs, on either
  side: not `export_buffers` / `export_arrays`, `send_buffers`,
  `start_receive`, `wait_receive`, `finish_receive`, `cancel_receive`,
  `start_pull`, `wait_pull`, nor `release`. Every other object is the
  backend's: `export_buffers` (or `export_arrays`) runs once when Ray stores
  it, and `release` once when Ray frees it (never for an object the backend
  did not export). On each consumer, for an object with bytes to move,
  `start_receive` runs once; if it returns a handle other than None (None:
  the bytes are already in place), `wait_receive` follows, then
  `finish_receive` after success or `cancel_receive` after a failure,
  timeout or abort, or when the fetch request is dropped unfinished (a
  `start_receive` that raises has released what it took itself).
  `WholeArrayTransport`'s `start_pull` / `wait_pull` / `cancel_pull` follow
  the same order.
  """

  name: ClassVar[str]
  devices: ClassVar[tuple[str, ...]] = ("cpu",)
  metadata_class: ClassVar[type[DlpackTransportMetadata]] = DlpackTransportMetadata
  #: True if the backend reads any byte range of a source chunk (see above).
  reads_parts: ClassVar[bool] = False
  #: Marks rdt_jax transports in Ray's registry (read by `rdt_jax._ray`).
  _rdt_jax_transport: ClassVar[bool] = True

  def __init_subclass__(cls, **kwargs: Any) -> None:
    super().__init_subclass__(**kwargs)
    _required.check_defined(cls)  # a transport that misses a hook its kind needs is refused

  def __init__(self) -> None:
    self._aborted = AbortMarks()
    self._actors = ActorCapabilities()
    self._stats = ReceiveCounts()
    # Objects the backend exported that Ray has not freed yet (`counters`).
    self._exported = Exported()

  def receive_stats(self, reset: bool = False) -> dict[str, int]:
    """What this process's fetches asked the backend to move, since the last
    reset: `fetches`, `bytes` (payload bytes of every destination),
    `destinations`, `descriptors` (transfer descriptors the backend
    posted, for backends that count them; jax_nixl does), `inline`
    (fetches of objects that arrived in band, which moved nothing),
    `direct` (jax_nixl fetches read node-locally, `rdt_jax._node_local`),
    `cuda_ipc` (jax_nixl fetches copied through CUDA IPC,
    `RDT_JAX_NIXL_CUDA_IPC`) and `cuda_ipc_fallback` (fetches that setting
    sent there but NIXL read, as a warning says once: memory CUDA IPC
    cannot export or map). `reset` zeroes the counters after reading them.
    """
    return self._stats.read(reset)

  def _count(self, **counts: int) -> None:
    self._stats.add(**counts)

  # ---- Ray's interface, shared by every backend.

  def tensor_transport_backend(self) -> str:
    """Ray calls this to name the transport in its records and errors.

    Returns:
      `name` in upper case (Ray's registry keys), e.g. "JAX_NIXL".
    """
    return self.name.upper()

  @classmethod
  def available_in_process(cls) -> bool:
    """True if this process can run the transport (its dependencies import)."""
    return True

  def actor_has_tensor_transport(self, actor: ray.actor.ActorHandle) -> bool:
    """Ray calls this in the caller before it submits a method with this
    transport to `actor` (and before it sends the actor an RDT argument).

    Asks the actor once, on Ray's system concurrency group (so never
    behind a running method), whether it can run the transport
    (`available_in_process()` there); the answer is cached per actor.

    Returns:
      True if `actor` can run the transport. On False Ray refuses the call
      with a `ValueError`; a two-sided backend's override instead raises an
      error naming the missing collective group.
    """
    return self._actors.can_run(actor, type(self))

  def counters(self) -> dict[str, int]:
    """Everything this process holds for transfers, as counts (backends add
    theirs): `exports` (objects the backend exported, through
    `export_buffers` or `export_arrays`, that Ray has not freed: `release`
    has not run for them), `abort_marks` (bounded by `MAX_ABORTED`) and
    `actors_known` (cached `actor_has_tensor_transport` answers, bounded by
    `MAX_ACTORS_KNOWN` and dropped after `ACTOR_ANSWER_IDLE_S` unused),
    and two of the process, whichever transport is asked: receive `targets`
    set and not yet used or dropped, and serializer `handoffs` waiting for
    their extract. A process whose peers are gone or idle returns to its baseline."""
    return {
        "exports": len(self._exported), "abort_marks": self.num_aborted(), "actors_known": len(self._actors),
        "targets": _targets.num_targets(), "handoffs": _handoff.pending_handoffs(),
    }

  def extract_tensor_transport_metadata(
      self, obj_id: str, rdt_object: list[Any]
  ) -> DlpackTransportMetadata:
    """Ray calls this on the producer when a method with this transport
    returns (or `ray.put(..., _tensor_transport=...)` stores a value).

    Describes every leaf Ray extracted (`rdt_object`, in order), checks that
    they share one device kind this transport moves, and builds the object's
    metadata: small host objects get their bytes in band
    (`DlpackTransportMetadata.inline`); any other object is handed to the
    backend's `export_buffers` (or `export_arrays`).

    Returns:
      The object's metadata, which Ray pickles and hands to every consumer.

    Raises:
      UnsupportedLeafError: for a leaf that cannot be sent (deleted, sub-byte
        dtype, unsupported device, ...), naming it by its pytree path.
    """
    return _extract.extract(self, obj_id, rdt_object)

  def _export(
      self,
      obj_id: str,
      arrays: list[Any],
      leaves: list[_dlpack.DescribedLeaf],
      meta: DlpackTransportMetadata,
  ) -> None:
    self.export_buffers(obj_id, leaves, meta)

  def get_communicator_metadata(
      self,
      src_actor: ray.actor.ActorHandle | None,
      dst_actor: ray.actor.ActorHandle | None,
      backend: str | None = None,
  ) -> CommunicatorMetadata:
    """Ray calls this in the caller before a transfer from `src_actor` to
    `dst_actor` (None for the driver).

    Returns:
      What the backend needs to reach the peer. One-sided backends need
      nothing (an empty `CommunicatorMetadata`); two-sided backends override
      this to return the ranks of both actors in their collective group.
    """
    return CommunicatorMetadata()

  def fetch_multiple_tensors(
      self,
      obj_id: str,
      tensor_transport_metadata: DlpackTransportMetadata,
      communicator_metadata: CommunicatorMetadata,
      target_buffers: list[Any] | None = None,
  ) -> DlpackFetchRequest:
    """Ray calls this on the consumer to start receiving object `obj_id`
    (`ray.get`, or a task argument), before `wait_fetch_complete`.

    Plans the receive from the metadata (the type each leaf arrives as, per
    `rdt_jax.receive_as`, and any target set with
    `rdt_jax.set_target_for_ref` / `set_target_device_for_ref` or Ray's
    `target_buffers`), allocates the destinations and calls the backend's
    `start_receive`; an in-band object is copied out of its metadata here.

    Returns:
      The request `wait_fetch_complete` finishes; dropped unfinished, it
      releases what it took.

    Raises:
      UnsupportedLeafError: if a leaf cannot arrive as asked (a 64-bit leaf
        as jax with x64 off, a sharding this process cannot hold, a target
        that does not fit), naming the leaf and what to do.
      rdt_jax.MetadataError: (an `UnsupportedLeafError`) if the metadata
        does not describe a readable object, naming the object and the
        field; nothing was read.
      RuntimeError: if Ray aborted this transfer.
      ray.exceptions.RayDirectTransportError: if the backend failed to start,
        or the object's producer actor has died (`_lifetime`).
    """
    return _fetch.start(self, obj_id, tensor_transport_metadata, communicator_metadata, target_buffers)

  def receives_synchronously(self, meta: DlpackTransportMetadata, kinds: set[MemoryKind]) -> bool:
    """True if every write into this object's receive memory (of memory
    `kinds`) ends before `start_receive` / `wait_receive` return or raise, so
    a fetch that failed or was given up cannot write later. Only then are
    bytes received straight into caller memory (numpy/torch targets,
    `Slice(into=...)` buffers); otherwise they are staged in rdt_jax's memory
    and copied into the caller's after the transfer succeeded
    (`rdt_jax.transports._plan`).

    The default: True for two-sided backends (their receive blocks until the
    bytes are in), False for one-sided ones. A one-sided backend that may say
    True for an object it then cannot read so must raise `StageCallerMemory`
    from `start_receive` before writing anything.
    """
    return not self.is_one_sided()

  def _prepare(self, plan: ReceivePlan, stage: bool = False) -> None:
    plan.allocate(self.reads_parts, stage)
    self._count(fetches=1, bytes=plan.nbytes, destinations=len(plan.destinations))

  def _start(
      self,
      obj_id: str,
      meta: DlpackTransportMetadata,
      communicator_metadata: CommunicatorMetadata,
      plan: ReceivePlan,
  ) -> Any:
    if not plan.destinations:
      return None
    return _fetch.wrap_errors(
        self.name, obj_id, self.start_receive, obj_id, meta, communicator_metadata, plan.destinations
    )

  def route_of(self, handle: Any) -> str:
    """How a receive moves its bytes, given what `start_receive` (or
    `start_pull`) returned, for rdt_jax's DEBUG log of each transfer: the
    transport's name, unless a backend with several routes says which."""
    return self.name

  def wait_fetch_complete(
      self, fetch_request: DlpackFetchRequest, timeout: float = -1
  ) -> list[Any]:
    """Ray calls this on the consumer after `fetch_multiple_tensors`: waits
    for the backend's move, then rebuilds each leaf as the consumer's array
    type (zero-copy through DLPack where the framework allows).

    Returns:
      The leaves in the order of the metadata; Ray puts them back into the
      value's structure.

    Raises:
      TimeoutError: if `timeout` (seconds, -1 for none) passes first.
      ray.exceptions.RayDirectTransportError: if the transfer failed, or the
        object's producer actor has died (checked once the bytes are in
        place, and after any failure: `_lifetime`).
    """
    return _fetch.finish(self, fetch_request, timeout)

  def _complete(self, request: DlpackFetchRequest, timeout: float) -> list[Any]:
    return _fetch.complete(self, request, timeout)

  def _abandon(self, handle: Any) -> None:
    """A fetch request was dropped unfinished: release what it took."""
    self.cancel_receive(handle)

  def recv_multiple_tensors(
      self,
      obj_id: str,
      tensor_transport_metadata: DlpackTransportMetadata,
      communicator_metadata: CommunicatorMetadata,
      target_buffers: list[Any] | None = None,
  ) -> list[Any]:
    """Ray calls this on the consumer of a task argument sent over a
    two-sided transport (`__ray_recv__`): `fetch_multiple_tensors`, then
    `wait_fetch_complete`, which waits at most Ray's RDT fetch timeout
    (`RAY_rdt_fetch_fail_timeout_milliseconds`, 60 s by default): Ray gives
    this call no timeout, and its monitor's abort is the only other bound.

    Returns:
      The leaves, as `wait_fetch_complete` returns them.

    Raises:
      TimeoutError: the leaves did not arrive within Ray's fetch timeout
        (Ray stores the error for the object, so its getters raise it).
    """
    request = self.fetch_multiple_tensors(
        obj_id, tensor_transport_metadata, communicator_metadata, target_buffers
    )
    return self.wait_fetch_complete(request, timeout=_ray.state.rdt_fetch_timeout_s())

  def send_multiple_tensors(
      self,
      tensors: list[Any],
      tensor_transport_metadata: DlpackTransportMetadata,
      communicator_metadata: CommunicatorMetadata,
  ) -> None:
    """Ray calls this on the producer of a two-sided transport, once per
    consumer task that takes the object as an argument.

    `tensors` are the leaves this process stored for the object, in the order
    of `tensor_transport_metadata.leaves`; they are described again (cheap:
    no bytes move) and their buffers handed to `send_buffers`.

    Raises:
      NotImplementedError: on a one-sided transport (Ray never calls it there).
    """
    _extract.send(self, tensors, tensor_transport_metadata, communicator_metadata)

  def garbage_collect(
      self,
      obj_id: str,
      tensor_transport_meta: DlpackTransportMetadata,
      tensors: list[Any],
  ) -> None:
    """Ray calls this on the producer once every ref to the object is out of
    scope: forgets its abort mark and, for an object the backend exported
    (not one sent in band), calls the backend's `release`."""
    self.forget_abort(obj_id)
    if not _inband.carried(tensor_transport_meta):
      self._exported.discard(obj_id)
      self.release(obj_id)

  def abort_transport(
      self, obj_id: str, communicator_metadata: CommunicatorMetadata
  ) -> None:
    """Ray calls this on the producer and the consumer after a transfer of
    `obj_id` failed or timed out (for transports whose
    `can_abort_transport()` is True): the consumer's wait stops early with a
    `RuntimeError` saying the transfer was aborted, and a later fetch of the
    object starts afresh."""
    self._aborted.mark(obj_id)

  def aborted(self, obj_id: str) -> bool:
    """True (once) if Ray aborted the transfer of `obj_id` here."""
    return self._aborted.take(obj_id)

  def forget_abort(self, obj_id: str) -> None:
    """Drops the abort mark of `obj_id` (called when Ray frees the object)."""
    self._aborted.forget(obj_id)

  def num_aborted(self) -> int:
    """Abort marks this process holds (bounded by `MAX_ABORTED`)."""
    return len(self._aborted)

  # ---- The backend's half. A hook marked `abstract_hook` is required of the
  # kinds `_required_hooks` names; a subclass that misses one is refused.

  #: The hooks each kind implements, one-sided (True) or two-sided (False):
  #: checked when a subclass is defined (`rdt_jax.transports._required`).
  _required_hooks: ClassVar[dict[bool, tuple[str, ...]]] = {
      True: ("export_buffers", "start_receive", "release"),
      False: ("send_buffers", "start_receive"),
  }

  @abstract_hook
  def export_buffers(
      self,
      obj_id: str,
      leaves: list[_dlpack.DescribedLeaf],
      meta: DlpackTransportMetadata,
  ) -> None:
    """Producer: make the leaves' buffers reachable; extend `meta` in place.
    Required of one-sided transports; optional for two-sided ones, whose
    `send_buffers` pushes the bytes (the default exports nothing)."""

  @abstract_hook
  def send_buffers(
      self,
      leaves: list[_dlpack.DescribedLeaf],
      meta: DlpackTransportMetadata,
      communicator_metadata: CommunicatorMetadata,
  ) -> None:
    """Producer of a two-sided backend: push every non-empty chunk, in leaf
    order, to the consumer named by `communicator_metadata`. Required of
    two-sided transports (Ray never calls it on one-sided ones)."""
    raise NotImplementedError(f"{self.name} is two-sided but has no send_buffers.")

  @abstract_hook
  def start_receive(
      self,
      obj_id: str,
      meta: DlpackTransportMetadata,
      communicator_metadata: CommunicatorMetadata,
      destinations: list[Destination],
  ) -> Any:
    """Consumer: start moving every chunk into `destinations`; return a
    handle, or None once the bytes are in place. Required."""
    raise NotImplementedError

  def wait_receive(self, handle: Any, obj_id: str, timeout: float) -> None:
    """Optional: on the consumer, block until the move started by
    `start_receive` is done (the default returns at once: for a
    `start_receive` that moves the bytes itself).

    Raises:
      TimeoutError: after `timeout` seconds (-1: no limit).
    """

  def finish_receive(self, handle: Any) -> None:
    """Optional: on the consumer, release what `start_receive` took, after
    success (the default holds nothing)."""

  def cancel_receive(self, handle: Any) -> None:
    """Optional: on the consumer, release what `start_receive` took, after
    failure or if the request was dropped unfinished (the default holds
    nothing)."""

  @abstract_hook
  def release(self, obj_id: str) -> None:
    """Producer: undo `export_buffers` for `obj_id`. Required of one-sided
    transports; optional for two-sided ones (the default releases nothing)."""


# A worker that unpickles an rdt_jax transport class (Ray ships them to every
# new actor) or its metadata gets the reducers and wrappers before its first
# RDT call.
_ray.install()
