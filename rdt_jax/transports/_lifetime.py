"""The lifetime contract: an RDT object lives in its producer.

Once the producing actor has died, every consumer's fetch of its objects
fails with the same error (`ProducerDiedError`), on every host, for every
size, path and backend: the consumer asks Ray whether the producer is dead
(`rdt_jax._ray.state.actor_dead`, one GCS lookup) after the bytes are in place and
after any failure of the backend, so

* a fetch that finishes after `ray.kill(producer)` returned is refused, even
  while the killed process is still exiting and its memory still readable;
* one lookup serves every fetch from that producer whose bytes were in place
  before it started (`in_place_at`): the fetches of one batched `ray.get`
  read their objects before Ray waits for the first, so they share a lookup
  instead of paying one each, and the answer is the same: the bytes were
  read before any death the lookup would have seen;
* a backend's own account of a dead peer (a refused connection, a closed
  socket, a failed node-local read) gives way to this one error.

Two-sided backends (`jax_gloo`, `jax_nccl`) follow Ray's rule for its own
GLOO and NCCL: a transfer whose producer died before sending ends with Ray
killing both actors, so the consumer's task fails with `ActorDiedError`; the
consumer waits for that kill (`await_kill`) instead of racing it. A send that
ran in the dying producer before its death (`ray.kill` is asynchronous: Ray
may still hand the producer's process a send after it recorded the death)
completes a receive that no kill follows; the consumer then raises
`ProducerActorDiedError`, an `ActorDiedError` too, so a two-sided consumer
sees one error type whichever of the two raced ahead.

An object's producer is the actor that stored it (`DlpackTransportMetadata
.producer`); objects the driver stores have none (the driver's exit ends the
job). Objects the producer freed are Ray's to refuse: Ray frees an object only
once no reference is left, and a fetch after that is refused before any
transport runs (`rdt_jax.UnknownObjectError` for `ray.get`).
"""

from __future__ import annotations

import threading
import time

from ray.exceptions import ActorDiedError

from rdt_jax import _limits, _ray
from rdt_jax._error_base import RdtJaxError

__all__ = [
    "ProducerActorDiedError", "ProducerDiedError", "await_kill", "check_producer", "dead_remembered", "died",
    "lookups", "producer_id",
]


_dead: dict[str, None] = {}
#: producer -> when (`time.monotonic`) the latest lookup that found it alive started.
_alive_at: dict[str, float] = {}
_lookups = 0  # lookups in Ray's actor table this process made
_lock = threading.Lock()


class ProducerDiedError(RdtJaxError, RuntimeError):
  """The actor that produced an RDT object has died; the object died with it.

  One-sided transports (`jax_nixl`, `jax_transfer`) and weight pulls: raised
  on the consumer when a fetch finds its producer actor dead, after any
  failure and after a read that seemed to succeed (its bytes are refused).
  Ray wraps it: `ray.get` raises Ray's `RayDirectTransportError` caused by it
  (`except ray.exceptions.RayError`, then `e.__cause__`), and so does a
  weight pull, whatever its route. Keep the producer alive, and the ref in scope, until every
  consumer has fetched the object.
  """


class ProducerActorDiedError(RdtJaxError, ActorDiedError):
  """Two-sided transports: the producer of an RDT object has died, the object
  with it, and this consumer was not killed with it (its receive completed
  from a send the producer ran before dying). An `ActorDiedError`, as when Ray
  kills both actors of a failed two-sided transfer; `actor_id` is the
  producer's."""

  def __init__(self, message: str, actor_id: str) -> None:
    super().__init__()
    self.error_msg = message
    self.actor_id = actor_id


# Public as rdt_jax.<name>: tracebacks and pickles name that path.
for _cls in (ProducerDiedError, ProducerActorDiedError):
  _cls.__module__ = "rdt_jax"


def lookups() -> int:
  """How many times this process asked Ray whether a producer is dead."""
  with _lock:
    return _lookups


def dead_remembered() -> tuple[str, ...]:
  """The producers known dead, oldest first (at most `_limits.MAX_DEAD_REMEMBERED`)."""
  with _lock:
    return tuple(_dead)


def producer_id() -> str | None:
  """Producer: the id to record in an object's metadata (this actor's, or
  None in a driver or task)."""
  return _ray.state.current_actor_id()


def check_producer(obj_id: str, producer: str | None, in_place_at: float | None = None) -> None:
  """Consumer: refuses object `obj_id` if its producer actor has died.

  `in_place_at`: when (`time.monotonic`) the fetch had every byte in place,
  if known; a lookup that started since and found the producer alive
  answers for it (`died`).

  Raises:
    ProducerDiedError: naming the object and the producer actor (`died`).
  """
  message = died(obj_id, producer, in_place_at)
  if message is not None:
    raise ProducerDiedError(message)


def died(obj_id: str, producer: str | None, in_place_at: float | None = None) -> str | None:
  """Consumer: the lifetime error's message if the producer of object
  `obj_id` has died, else None (also for an object with no producer).

  A dead actor stays dead: the answer is remembered per actor, so only the
  first fetch after a death, and fetches from live producers, ask Ray. A
  fetch whose bytes were in place at `in_place_at` asks no more if a lookup
  that started at or after that time found the producer alive: that lookup
  came after the read, as the fetch's own would.
  """
  if producer is None:
    return None
  with _lock:
    dead = producer in _dead
    if not dead and in_place_at is not None and _alive_at.get(producer, -1.0) >= in_place_at:
      return None
  started = time.monotonic()
  if not dead and _asked_dead(producer):
    with _lock:
      _dead[producer] = None
      _alive_at.pop(producer, None)
      while len(_dead) > _limits.MAX_DEAD_REMEMBERED:
        del _dead[next(iter(_dead))]
    dead = True
  if not dead:
    with _lock:
      if producer not in _dead and _alive_at.get(producer, -1.0) < started:
        _alive_at.pop(producer, None)  # most recent last
        _alive_at[producer] = started
        while len(_alive_at) > _limits.MAX_ALIVE_REMEMBERED:
          del _alive_at[next(iter(_alive_at))]
    return None
  return (
      f"The producer of object {obj_id} (actor {producer}) has died: the object died with it. "
      "Keep the producing actor alive until every consumer has fetched the object."
  )


def _asked_dead(producer: str) -> bool:
  """Asks Ray whether actor `producer` is dead (one GCS lookup), counted."""
  global _lookups
  with _lock:
    _lookups += 1
  return _ray.state.actor_dead(producer)


def await_kill() -> None:
  """Consumer of a two-sided transfer whose producer died before sending:
  waits for Ray to kill this actor, which Ray does to both actors of a
  transfer whose send failed (`RDTManager._abort_transport`), so that the
  consumer's task ends with Ray's `ActorDiedError` every time. Returns (for
  the caller to raise the lifetime error) only if no kill came within Ray's
  RDT fetch timeout and `KILL_GRACE_S`.
  """
  time.sleep(_ray.state.rdt_fetch_timeout_s() + _limits.KILL_GRACE_S)
