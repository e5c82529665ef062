"""The shared half of every rdt_jax transport.

`DlpackTransport` implements Ray's `TensorTransportManager` for any array
type: it turns the leaves Ray extracted into framework-neutral metadata and raw
buffers (through the DLPack layer, `rdt_jax._dlpack`), plans the receive
(`ReceivePlan`), and rebuilds the consumer's arrays. A backend subclass only
moves bytes: register, move, release. It implements:

* `export_buffers` (producer): make the described buffers reachable and add
  what consumers need to the metadata (one-sided backends register memory);
* `start_receive` / `wait_receive` (consumer): move the bytes of every chunk
  into the given destinations; `finish_receive` (after success) /
  `cancel_receive` (after failure, or a dropped request) release what the
  receive took;
* `release` (producer): undo `export_buffers` when Ray frees the object;
* `send_buffers` (producer, two-sided backends only): push every chunk to the
  consumer, whose `wait_receive` takes them in the same order. When the
  consumer cannot take an object (a 64-bit leaf where x64 is off, a target
  that does not fit), the base still receives the bytes, into scratch
  buffers, so the sender never blocks on a receive that will not come.

A backend that moves whole jax arrays rather than bytes (`jax_transfer`)
subclasses `WholeArrayTransport` instead, whose hooks are `export_arrays`,
`start_pull` and `wait_pull`.

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

import math
import threading
import time
import traceback
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from ray.experimental.rdt.tensor_transport_manager import (
    CommunicatorMetadata,
    FetchRequest,
    TensorTransportManager,
)

from rdt_jax import _dlpack, _faults, _memory, _seam, _state, _targets
from rdt_jax._metadata import DlpackTransportMetadata
from rdt_jax.transports import _inband, _lifetime
from rdt_jax.transports._plan import Destination, MemoryKind, Placement, ReceivePlan, StageCallerMemory

if TYPE_CHECKING:
  import ray

#: How many aborted objects a process remembers. Ray aborts a failed transfer
#: on both sides; on a producer no fetch ever consumes the mark, so the oldest
#: are forgotten (and `release` forgets an object's mark when Ray frees it).
MAX_ABORTED = 4096
#: Actors whose answer to `actor_has_tensor_transport` a process keeps at most.
MAX_ACTORS_KNOWN = 4096
#: Seconds an actor's answer is kept after its last use (a gone actor's goes then).
ACTOR_ANSWER_IDLE_S = 600.0

__all__ = [
    "Destination",
    "DlpackFetchRequest",
    "DlpackTransport",
    "Placement",
    "WholeArrayTransport",
]


@dataclass
class DlpackFetchRequest(FetchRequest):
  """An in-flight fetch: the receive plan and the backend's transfer handle.

  `transport` is None for an in-band object (nothing of the backend's to
  release if the request is dropped unfinished).
  """

  plan: ReceivePlan | None = None
  handle: Any = None
  transport: DlpackTransport | None = None
  done: bool = False
  inline: bool = False
  producer: str | None = None

  def __post_init__(self) -> None:
    _seam.track_fetch(self)

  def give_up(self) -> None:
    """Releases an unfinished fetch now: the backend retires or parks its
    transfer, the plan's memory is quarantined. Called for every fetch of a
    batched `ray.get` that Ray dropped when another one failed or timed out,
    so none stays in flight until the request happens to be collected."""
    if self.done:
      return
    self.done = True
    if self.transport is not None:
      self.transport._abandon(self.handle)
    if self.plan is not None:
      self.plan.quarantine()

  def __del__(self) -> None:
    if self.transport is not None and not self.done:
      self.transport._abandon(self.handle)


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

  and implements, on the producer, `export_buffers(obj_id, leaves, meta)`
  (make the described buffers reachable, add what consumers need to `meta`)
  and `release(obj_id)` (undo it when Ray frees the object); a two-sided
  backend also `send_buffers(...)`. On the consumer it implements
  `start_receive(obj_id, meta, communicator_metadata, destinations)` (start
  moving every chunk into its destination; return a handle),
  `wait_receive(handle, obj_id, timeout)`, and `finish_receive(handle)` /
  `cancel_receive(handle)` to release what the receive took. Register a
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
  #: Marks rdt_jax transports in Ray's registry (read by `rdt_jax._seam`).
  _rdt_jax_transport: ClassVar[bool] = True

  def __init__(self) -> None:
    self._aborted: OrderedDict[str, None] = OrderedDict()
    self._aborted_lock = threading.Lock()
    # actor id -> (can run this transport, time.monotonic() of its last use)
    self._actors_with_transport: OrderedDict[str, tuple[bool, float]] = OrderedDict()
    self._actors_lock = threading.Lock()
    self._stats = {"fetches": 0, "bytes": 0, "destinations": 0, "descriptors": 0, "inline": 0, "direct": 0}
    self._stats_lock = threading.Lock()
    # Objects the backend exported that Ray has not freed yet (`counters`).
    self._exported: set[str] = set()
    self._exported_lock = threading.Lock()

  def receive_stats(self, reset: bool = False) -> dict[str, int]:
    """What this process's fetches asked the backend to move, since the last
    reset: `fetches`, `bytes` (payload bytes of every destination),
    `destinations`, `descriptors` (transfer descriptors the backend
    posted, for backends that count them; jax_nixl does), `inline`
    (fetches of objects that arrived in band, which moved nothing) and
    `direct` (jax_nixl fetches read node-locally, `rdt_jax._node_local`).

    Args:
      reset: zero the counters after reading them.
    """
    with self._stats_lock:
      out = dict(self._stats)
      if reset:
        self._stats = dict.fromkeys(self._stats, 0)
    return out

  def _count(self, **counts: int) -> None:
    with self._stats_lock:
      for k, v in counts.items():
        self._stats[k] += v

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
    import ray

    actor_id = _seam.actor_id(actor)
    with self._actors_lock:
      known = self._actors_with_transport.get(actor_id)
    if known is None:
      ref = _seam.call_on_system_group(actor, _actor_can_run, type(self))
      known = (bool(ray.get(ref)), 0.0)
    with self._actors_lock:
      self._actors_with_transport[actor_id] = (known[0], time.monotonic())
      self._actors_with_transport.move_to_end(actor_id)
      self._forget_actors()
    return known[0]

  def _forget_actors(self) -> None:
    """Drops cached answers beyond `MAX_ACTORS_KNOWN`, or unused for
    `ACTOR_ANSWER_IDLE_S` (lock held): a gone actor's answer does not stay."""
    expired = time.monotonic() - ACTOR_ANSWER_IDLE_S
    answers = self._actors_with_transport
    while answers and (len(answers) > MAX_ACTORS_KNOWN or next(iter(answers.values()))[1] < expired):
      answers.popitem(last=False)

  def counters(self) -> dict[str, int]:
    """Everything this process holds for transfers, as counts (backends add
    theirs): `exports` (objects the backend exported, through
    `export_buffers` or `export_arrays`, that Ray has not freed: `release`
    has not run for them), `abort_marks` (bounded by `MAX_ABORTED`) and
    `actors_known` (cached `actor_has_tensor_transport` answers, bounded by
    `MAX_ACTORS_KNOWN` and dropped after `ACTOR_ANSWER_IDLE_S` unused). A
    process whose peers are gone or idle returns to its baseline."""
    with self._actors_lock:
      self._forget_actors()
      actors = len(self._actors_with_transport)
    with self._exported_lock:
      exports = len(self._exported)
    return {"exports": exports, "abort_marks": self.num_aborted(), "actors_known": actors}

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
    with _memory.gc_paused(len(rdt_object)):
      described = _state.take_described(rdt_object)
      device = self._common_device(described)
      meta = self.metadata_class(
          tensor_meta=[(d.spec.shape, d.spec.dtype) for d in described],
          tensor_device=device,
          leaves=[d.spec for d in described],
          producer=_lifetime.producer_id(),
      )
      if described:
        # Queued device work writing the leaves finishes before any read.
        _memory.wait_for_producers(described)
        if self.is_one_sided() and _inband.fits(device, meta):
          _inband.pack(described, meta)
        else:
          self._export(obj_id, rdt_object, described, meta)
          with self._exported_lock:
            self._exported.add(obj_id)
    return meta

  def _export(
      self,
      obj_id: str,
      arrays: list[Any],
      leaves: list[_dlpack.DescribedLeaf],
      meta: DlpackTransportMetadata,
  ) -> None:
    self.export_buffers(obj_id, leaves, meta)

  def _common_device(self, described: list[_dlpack.DescribedLeaf]) -> str | None:
    if not described:
      return None
    first = described[0]
    for d in described:
      if d.device not in self.devices:
        raise _dlpack.UnsupportedLeafError(
            d.spec.path,
            f"(dtype {d.spec.dtype.name}) lives on a {d.device} device, which "
            f"the {self.name} transport does not move (it moves "
            f"{', '.join(self.devices)})",
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
    self._raise_if_aborted(obj_id)
    tensor_transport_metadata.validate(obj_id)  # MetadataError before any memory is taken
    target = _targets.pop_target(obj_id)
    if target is None and target_buffers:
      target = _targets.Target(buffers={f"[{i}]": b for i, b in enumerate(target_buffers)})
    if _inband.carried(tensor_transport_metadata):
      return self._fetch_in_band(obj_id, tensor_transport_metadata, target)
    meta = tensor_transport_metadata
    try:
      with _memory.gc_paused(len(meta.leaves)):
        plan = ReceivePlan(meta.leaves, _state.receive_mode(), target, obj_id)
        self._prepare(plan, stage=not self.receives_synchronously(meta, plan.memory_kinds()))
    except Exception:
      if not self.is_one_sided():
        # The producer is already sending: take its bytes so it does not block.
        self._drain(obj_id, meta, communicator_metadata)
      raise
    request = DlpackFetchRequest(obj_id=obj_id, tensors=[], plan=plan, transport=self)
    try:
      with _memory.gc_paused(len(plan.plans)):
        try:
          request.handle = self._start(obj_id, meta, communicator_metadata, plan)
        except StageCallerMemory:  # nothing was written: plan again, caller memory staged
          plan.return_regions()
          plan = request.plan = ReceivePlan(meta.leaves, _state.receive_mode(), target, obj_id)
          plan.allocate(self.reads_parts, stage=True)
          request.handle = self._start(obj_id, meta, communicator_metadata, plan)
    except BaseException as e:
      request.done = True  # the backend released (or parked) what it took
      plan.quarantine()
      if not isinstance(e, Exception):
        raise
      error = e
    else:
      request.producer = tensor_transport_metadata.producer
      return request
    try:
      self._check_producer(obj_id, tensor_transport_metadata.producer, failed=True)  # before the backend's error
      raise error
    finally:
      del error  # see wait_fetch_complete

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

  def _fetch_in_band(
      self, obj_id: str, meta: DlpackTransportMetadata, target: _targets.Target | None
  ) -> DlpackFetchRequest:
    """Receives an in-band object from its metadata; no backend hook runs."""
    with _memory.gc_paused(len(meta.leaves)):
      plan = ReceivePlan(meta.leaves, _state.receive_mode(), target, obj_id)
      plan.allocate(reads_parts=True)
    self._count(fetches=1, bytes=plan.nbytes, destinations=len(plan.destinations))
    try:
      _inband.copy_out(meta, plan.destinations)
    except BaseException:
      plan.quarantine()
      raise
    self._count(inline=1)
    return DlpackFetchRequest(obj_id=obj_id, tensors=[], plan=plan, inline=True, producer=meta.producer)

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
    return self._wrap_errors(
        obj_id, self.start_receive, obj_id, meta, communicator_metadata, plan.destinations
    )

  def _drain(
      self,
      obj_id: str,
      meta: DlpackTransportMetadata,
      communicator_metadata: CommunicatorMetadata,
  ) -> None:
    """Receives an object this process cannot take into scratch buffers."""
    scratch = ReceivePlan(meta.leaves, "numpy")
    destinations = scratch.allocate()
    if destinations:
      handle = self.start_receive(obj_id, meta, communicator_metadata, destinations)
      self.wait_receive(handle, obj_id, -1)
      self.finish_receive(handle)
    scratch.return_regions()

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
    try:
      if fetch_request.inline:
        leaves = _build(fetch_request)  # the bytes arrived with the metadata
      else:
        leaves = self._complete(fetch_request, timeout)
    except Exception as e:
      error = e
    else:
      self._check_producer(fetch_request.obj_id, fetch_request.producer, failed=False)
      return leaves
    try:
      self._check_producer(fetch_request.obj_id, fetch_request.producer, failed=True)  # before the backend's error
      raise error
    finally:
      # A local naming the error it raises would keep this frame, the
      # error and its traceback in a cycle, and with them every frame the
      # error passes on its way up: the caller's `refs`, Ray's list of the
      # object's refs. Ray would count them held (the producer keeps the
      # object) until Python's cyclic collector ran, seconds or minutes later.
      del error

  def _check_producer(self, obj_id: str, producer: str | None, failed: bool) -> None:
    """Raises the lifetime error if the producer of `obj_id` has died
    (`_lifetime.check_producer`); `failed`: the backend's move failed.

    One-sided: `RayDirectTransportError` wrapping `ProducerDiedError`.
    Two-sided: a move fails when its producer died before sending; Ray then
    kills both actors of the transfer (its rule for GLOO and NCCL), so the
    consumer waits for that kill (`ActorDiedError`, as with Ray's own
    transports) rather than race it with an error of its own. A move that
    completed from a send the producer ran before dying is followed by no
    kill: `ProducerActorDiedError`, an `ActorDiedError` as well.
    """
    if _faults.ON:
      _faults.hit("lifetime.check")
    if self.is_one_sided():
      self._wrap_errors(obj_id, _lifetime.check_producer, obj_id, producer)
      return
    if producer is None:
      return  # stored by the driver: no producer actor to outlive
    message = self._wrap_errors(obj_id, _lifetime.died, obj_id, producer)
    if message is not None:
      if failed:
        _lifetime.await_kill()
      raise _lifetime.ProducerActorDiedError(message, producer)

  def _complete(self, request: DlpackFetchRequest, timeout: float) -> list[Any]:
    if request.handle is not None:
      try:
        self._wrap_errors(request.obj_id, self.wait_receive, request.handle, request.obj_id, timeout)
      except BaseException:
        # Given up (timeout, abort, error): release now, not when collected.
        request.done = True
        self._abandon(request.handle)
        if request.plan is not None:
          request.plan.quarantine()
        raise
      request.done = True
      self.finish_receive(request.handle)
      request.handle = None  # what the backend held for the move is no longer needed
    return _build(request)

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
    return self.wait_fetch_complete(request, timeout=_seam.rdt_fetch_timeout_s())

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
    if self.is_one_sided():
      raise NotImplementedError(
          f"{self.name} is one-sided: Ray never calls send_multiple_tensors on it."
      )
    leaves = tensor_transport_metadata.leaves
    described = [_dlpack.describe(t, spec.path) for t, spec in zip(tensors, leaves)]
    _memory.wait_for_producers(described)
    self.send_buffers(described, tensor_transport_metadata, communicator_metadata)

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
      with self._exported_lock:
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
    with self._aborted_lock:
      self._aborted[obj_id] = None
      while len(self._aborted) > MAX_ABORTED:
        self._aborted.popitem(last=False)

  def aborted(self, obj_id: str) -> bool:
    """True (once) if Ray aborted the transfer of `obj_id` here."""
    with self._aborted_lock:
      return self._aborted.pop(obj_id, False) is None

  def forget_abort(self, obj_id: str) -> None:
    """Drops the abort mark of `obj_id` (called when Ray frees the object)."""
    with self._aborted_lock:
      self._aborted.pop(obj_id, None)

  def num_aborted(self) -> int:
    """Abort marks this process holds (bounded by `MAX_ABORTED`)."""
    with self._aborted_lock:
      return len(self._aborted)

  def _raise_if_aborted(self, obj_id: str) -> None:
    if self.aborted(obj_id):
      raise RuntimeError(f"{self.name} transfer of object {obj_id} was aborted.")

  def _wrap_errors(self, obj_id: str, fn: Any, *args: Any) -> Any:
    """Runs a backend hook; failures become RayDirectTransportError."""
    from ray.exceptions import RayDirectTransportError

    try:
      return fn(*args)
    except (TimeoutError, _dlpack.UnsupportedLeafError, ImportError, ValueError, StageCallerMemory):
      raise
    except Exception:
      raise RayDirectTransportError(
          f"The {self.name} transfer of object {obj_id} failed. The source "
          "actor may have died during the transfer. The backend raised:\n"
          f"{traceback.format_exc()}"
      ) from None

  # ---- The backend's half.

  def export_buffers(
      self,
      obj_id: str,
      leaves: list[_dlpack.DescribedLeaf],
      meta: DlpackTransportMetadata,
  ) -> None:
    """Producer: make the leaves' buffers reachable; extend `meta` in place."""

  def send_buffers(
      self,
      leaves: list[_dlpack.DescribedLeaf],
      meta: DlpackTransportMetadata,
      communicator_metadata: CommunicatorMetadata,
  ) -> None:
    """Producer of a two-sided backend: push every non-empty chunk, in leaf
    order, to the consumer named by `communicator_metadata`."""
    raise NotImplementedError(f"{self.name} is two-sided but has no send_buffers.")

  def start_receive(
      self,
      obj_id: str,
      meta: DlpackTransportMetadata,
      communicator_metadata: CommunicatorMetadata,
      destinations: list[Destination],
  ) -> Any:
    """Consumer: start moving every chunk into `destinations`; return a handle."""
    raise NotImplementedError

  def wait_receive(self, handle: Any, obj_id: str, timeout: float) -> None:
    """Consumer: block until the move started by `start_receive` is done.

    Raises:
      TimeoutError: after `timeout` seconds (-1: no limit).
    """

  def finish_receive(self, handle: Any) -> None:
    """Consumer: release what `start_receive` took, after success."""

  def cancel_receive(self, handle: Any) -> None:
    """Consumer: release what `start_receive` took, after failure or if the
    request was dropped unfinished."""

  def release(self, obj_id: str) -> None:
    """Producer: undo `export_buffers` for `obj_id`."""


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
  """

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
    return self._wrap_errors(
        obj_id, self.start_pull, obj_id, meta, communicator_metadata, placements
    )

  def _complete(self, request: DlpackFetchRequest, timeout: float) -> list[Any]:
    arrays: list[Any] = []
    if request.handle is not None:
      arrays = self._wrap_errors(
          request.obj_id, self.wait_pull, request.handle, request.obj_id, timeout
      )
    request.done = True
    assert request.plan is not None
    with _memory.gc_paused(len(request.plan.plans)):
      return request.plan.adopt(arrays)

  def _abandon(self, handle: Any) -> None:
    self.cancel_pull(handle)

  # ---- The backend's half.

  def export_arrays(
      self,
      obj_id: str,
      arrays: list[Any],
      leaves: list[_dlpack.DescribedLeaf],
      meta: DlpackTransportMetadata,
  ) -> None:
    """Producer: offer `arrays` (one per leaf, any framework); extend `meta`."""
    raise NotImplementedError

  def start_pull(
      self,
      obj_id: str,
      meta: DlpackTransportMetadata,
      communicator_metadata: CommunicatorMetadata,
      placements: list[Placement],
  ) -> Any:
    """Consumer: start moving one array per leaf onto its placement."""
    raise NotImplementedError

  def wait_pull(self, handle: Any, obj_id: str, timeout: float) -> list[Any]:
    """Consumer: the arrays `start_pull` moved, one per leaf, once ready.

    Raises:
      TimeoutError: after `timeout` seconds (-1: no limit).
    """
    raise NotImplementedError

  def cancel_pull(self, handle: Any) -> None:
    """Consumer: release what `start_pull` took if the fetch was dropped."""


def _build(request: DlpackFetchRequest) -> list[Any]:
  """The leaves of a fetch whose bytes are all in its plan's memory."""
  request.done = True
  assert request.plan is not None
  with _memory.gc_paused(len(request.plan.plans)):
    return request.plan.build()


def _actor_can_run(self: Any, cls: type[DlpackTransport]) -> bool:
  """Runs on an actor: whether it can run transport `cls`."""
  _seam.install()
  return cls.available_in_process()


# A worker that unpickles an rdt_jax transport class (Ray ships them to every
# new actor) or its metadata gets the reducers and wrappers before its first
# RDT call.
_seam.install()
