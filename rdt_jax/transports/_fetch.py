"""One fetch on the consumer, from Ray's `fetch_multiple_tensors` to its
`wait_fetch_complete`.

`start` refuses an aborted transfer and unreadable metadata, plans the
receive (`ReceivePlan`) and hands it to the backend through the transport's
kind-specific steps (`_prepare`, `_start`: byte backends get `Destination`s,
whole-array backends `Placement`s); an in-band object is copied out of its
metadata instead (`fetch_in_band`, no backend hook runs). `finish` waits for
the backend (`_complete`) and rebuilds the leaves. The request between the
two (`DlpackFetchRequest`), dropped unfinished, releases what it took.

Every fetch, whatever its path, ends with the lifetime check
(`check_producer`, `rdt_jax.transports._lifetime`), after success and before
a backend's own error; a backend's failure reaches the caller as Ray's
`RayDirectTransportError` (`wrap_errors`). A two-sided consumer that cannot
take an object still receives its bytes, into scratch memory (`drain`), so
the sender never blocks on a receive that will not come.
"""

from __future__ import annotations

import logging
import threading
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ray.experimental.rdt.tensor_transport_manager import CommunicatorMetadata, FetchRequest

from rdt_jax import _dlpack, _faults, _memory, _metrics, _ray, _receive_mode, _targets
from rdt_jax._metadata import DlpackTransportMetadata
from rdt_jax.transports import _inband, _lifetime, _packed
from rdt_jax.transports._destinations import StageCallerMemory
from rdt_jax.transports._plan import ReceivePlan

if TYPE_CHECKING:
  from rdt_jax.transports._base import DlpackTransport

__all__ = [
    "DlpackFetchRequest", "ReceiveCounts", "check_producer", "complete", "finish", "start", "unpack", "wrap_errors",
]

logger = logging.getLogger(__name__)


class ReceiveCounts:
  """What a process's fetches asked one backend to move
  (`DlpackTransport.receive_stats`), counted under a lock of its own."""

  def __init__(self) -> None:
    self._counts = {
        "fetches": 0, "bytes": 0, "destinations": 0, "descriptors": 0, "inline": 0, "direct": 0, "cuda_ipc": 0,
        "cuda_ipc_fallback": 0,
    }
    self._lock = threading.Lock()

  def add(self, **counts: int) -> None:
    with self._lock:
      for k, v in counts.items():
        self._counts[k] += v

  def read(self, reset: bool = False) -> dict[str, int]:
    """The counts (zeroed after reading them with `reset`)."""
    with self._lock:
      out = dict(self._counts)
      if reset:
        self._counts = dict.fromkeys(self._counts, 0)
    return out


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
  pack: _packed.Split | None = None  # a pack's target, for `finish` (`_packed`)
  in_place_at: float | None = None  # when every byte was in place (`time.monotonic`), once known
  packed: tuple[int, Sequence[Any], Sequence[int]] | None = None
  started: float = field(default_factory=time.perf_counter)  # for rdt_jax's metrics
  nbytes: int = 0  # bytes the plan receives, for rdt_jax's metrics
  route: str = "in band"  # how the bytes moved (`DlpackTransport.route_of`), for the DEBUG log

  def __post_init__(self) -> None:
    _ray.fetch.track_fetch(self)

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


def start(
    t: DlpackTransport,
    obj_id: str,
    meta: DlpackTransportMetadata,
    communicator_metadata: CommunicatorMetadata,
    target_buffers: list[Any] | None,
) -> DlpackFetchRequest:
  """`DlpackTransport.fetch_multiple_tensors` (its docstring says what it raises)."""
  if t.aborted(obj_id):
    raise RuntimeError(f"{t.name} transfer of object {obj_id} was aborted.")
  meta.validate(obj_id)  # MetadataError before any memory is taken
  target = _targets.pop_target(obj_id)
  if target is None and target_buffers:
    target = _targets.Target(buffers={f"[{i}]": b for i, b in enumerate(target_buffers)})
  pack = _packed.split_target(meta, target) if meta.packed is not None else None
  if _inband.carried(meta):
    return fetch_in_band(t, obj_id, meta, target, pack)
  try:
    with _memory.gc_paused(len(meta.leaves)):
      plan = _plan(meta, target, obj_id, pack)
      t._prepare(plan, stage=not t.receives_synchronously(meta, plan.memory_kinds()))
  except Exception:
    if not t.is_one_sided():
      # The producer is already sending: take its bytes so it does not block.
      drain(t, obj_id, meta, communicator_metadata)
    raise
  request = DlpackFetchRequest(obj_id=obj_id, tensors=[], plan=plan, transport=t, pack=pack, packed=meta.packed,
                               nbytes=plan.nbytes)
  try:
    with _memory.gc_paused(len(plan.plans)):
      try:
        request.handle = t._start(obj_id, meta, communicator_metadata, plan)
      except StageCallerMemory:  # nothing was written: plan again, caller memory staged
        plan.return_regions()
        plan = request.plan = _plan(meta, target, obj_id, pack)
        plan.allocate(t.reads_parts, stage=True)
        request.handle = t._start(obj_id, meta, communicator_metadata, plan)
    request.route = t.route_of(request.handle) if plan.destinations else "nothing to move"
    if request.handle is None:  # nothing in flight: the backend moved the bytes in `_start`
      request.in_place_at = time.monotonic()
  except BaseException as e:
    request.done = True  # the backend released (or parked) what it took
    plan.quarantine()
    if not isinstance(e, Exception):
      raise
    error = e
  else:
    request.producer = meta.producer
    return request
  _metrics.count_transfer(t.name, 0, 0.0, False)
  try:
    check_producer(t, obj_id, meta.producer, failed=True)  # before the backend's error
    raise error
  finally:
    del error  # see finish


def _plan(
    meta: DlpackTransportMetadata, target: _targets.Target | None, obj_id: str, pack: _packed.Split | None
) -> ReceivePlan:
  """The receive plan of an object; a pack buffer arrives as raw host bytes,
  and the other leaves get their share of the target (`_packed.split_target`)."""
  mode = _receive_mode.receive_mode()
  if pack is None or meta.packed is None:
    return ReceivePlan(meta.leaves, mode, target, obj_id)
  device = _targets.Target(device=pack.device) if pack.device is not None else None
  return ReceivePlan(meta.leaves, mode, device, obj_id, raw=meta.packed[0], aligned=pack.outer)


def fetch_in_band(
    t: DlpackTransport,
    obj_id: str,
    meta: DlpackTransportMetadata,
    target: _targets.Target | None,
    pack: _packed.Split | None = None,
) -> DlpackFetchRequest:
  """Receives an in-band object from its metadata; no backend hook runs."""
  with _memory.gc_paused(len(meta.leaves)):
    plan = _plan(meta, target, obj_id, pack)
    plan.allocate(reads_parts=True)
  t._count(fetches=1, bytes=plan.nbytes, destinations=len(plan.destinations))
  try:
    _inband.copy_out(meta, plan.destinations)
  except BaseException:
    plan.quarantine()
    raise
  t._count(inline=1)
  return DlpackFetchRequest(
      obj_id=obj_id, tensors=[], plan=plan, inline=True, producer=meta.producer, pack=pack, packed=meta.packed,
      nbytes=plan.nbytes,
      in_place_at=time.monotonic(),
  )


def drain(
    t: DlpackTransport,
    obj_id: str,
    meta: DlpackTransportMetadata,
    communicator_metadata: CommunicatorMetadata,
) -> None:
  """Receives an object this process cannot take into scratch buffers."""
  scratch = ReceivePlan(meta.leaves, "numpy")
  destinations = scratch.allocate()
  if destinations:
    handle = t.start_receive(obj_id, meta, communicator_metadata, destinations)
    t.wait_receive(handle, obj_id, -1)
    t.finish_receive(handle)
  scratch.return_regions()


def finish(t: DlpackTransport, request: DlpackFetchRequest, timeout: float) -> list[Any]:
  """`DlpackTransport.wait_fetch_complete` (its docstring says what it raises)."""
  try:
    if request.inline:
      leaves = build(request)  # the bytes arrived with the metadata
    else:
      leaves = t._complete(request, timeout)
  except Exception as e:
    error = e
  else:
    check_producer(t, request.obj_id, request.producer, failed=False, in_place_at=request.in_place_at)
    if request.packed is not None:
      leaves = unpack(request, leaves)
    seconds = time.perf_counter() - request.started
    _metrics.count_transfer(t.name, request.nbytes, seconds, True)
    if logger.isEnabledFor(logging.DEBUG):
      logger.debug("rdt_jax: %s received object %s: %d bytes in %.2f ms (%s)", t.name, request.obj_id,
                   request.nbytes, seconds * 1e3, request.route)
    return leaves
  _metrics.count_transfer(t.name, 0, 0.0, False)
  if logger.isEnabledFor(logging.DEBUG):
    logger.debug("rdt_jax: %s failed to receive object %s after %.2f ms (%s): %s", t.name, request.obj_id,
                 (time.perf_counter() - request.started) * 1e3, request.route, type(error).__name__)
  try:
    check_producer(t, request.obj_id, request.producer, failed=True)  # before the backend's error
    raise error
  finally:
    # A local naming the error it raises would keep this frame, the
    # error and its traceback in a cycle, and with them every frame the
    # error passes on its way up: the caller's `refs`, Ray's list of the
    # object's refs. Ray would count them held (the producer keeps the
    # object) until Python's cyclic collector ran, seconds or minutes later.
    del error


def unpack(request: DlpackFetchRequest, leaves: list[Any]) -> list[Any]:
  """`leaves` with the pack buffer replaced by the packed leaves made from it
  (a tuple, which Ray's deserializer indexes: `_ray.serialization`)."""
  assert request.packed is not None
  slot, specs, _ = request.packed
  inner = request.pack.inner if request.pack is not None else None
  out = list(leaves)
  with _memory.gc_paused(len(specs)):
    out[slot] = _packed.unpack(out[slot], specs, inner, _receive_mode.receive_mode(), request.obj_id)
  return out


def complete(t: DlpackTransport, request: DlpackFetchRequest, timeout: float) -> list[Any]:
  """A byte backend's end of a fetch: waits for the move, releases what the
  backend took (at once after a failure, not when the request is collected),
  then rebuilds the leaves."""
  if request.handle is not None:
    try:
      wrap_errors(t.name, request.obj_id, t.wait_receive, request.handle, request.obj_id, timeout)
    except BaseException:
      # Given up (timeout, abort, error): release now, not when collected.
      request.done = True
      t._abandon(request.handle)
      if request.plan is not None:
        request.plan.quarantine()
      raise
    request.done = True
    request.in_place_at = time.monotonic()
    t.finish_receive(request.handle)
    request.handle = None  # what the backend held for the move is no longer needed
  return build(request)


def build(request: DlpackFetchRequest) -> list[Any]:
  """The leaves of a fetch whose bytes are all in its plan's memory."""
  request.done = True
  assert request.plan is not None
  with _memory.gc_paused(len(request.plan.plans)):
    return request.plan.build()


def check_producer(
    t: DlpackTransport, obj_id: str, producer: str | None, failed: bool, in_place_at: float | None = None
) -> None:
  """Raises the lifetime error if the producer of `obj_id` has died
  (`_lifetime.check_producer`); `failed`: the backend's move failed;
  `in_place_at`: when the move had every byte in place, if it succeeded.

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
  if t.is_one_sided():
    wrap_errors(t.name, obj_id, _lifetime.check_producer, obj_id, producer, in_place_at)
    return
  if producer is None:
    return  # stored by the driver: no producer actor to outlive
  message = wrap_errors(t.name, obj_id, _lifetime.died, obj_id, producer, in_place_at)
  if message is not None:
    if failed:
      _lifetime.await_kill()
    raise _lifetime.ProducerActorDiedError(message, producer)


def wrap_errors(name: str, obj_id: str, fn: Any, *args: Any) -> Any:
  """Runs a backend hook of transport `name`; failures become RayDirectTransportError."""
  from ray.exceptions import RayDirectTransportError

  try:
    return fn(*args)
  except (TimeoutError, _dlpack.UnsupportedLeafError, ImportError, ValueError, StageCallerMemory):
    raise
  except Exception:
    raise RayDirectTransportError(
        f"The {name} transfer of object {obj_id} failed. The source "
        "actor may have died during the transfer. The backend raised:\n"
        f"{traceback.format_exc()}"
    ) from None
