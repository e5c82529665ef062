"""Which actors can run a transport: the answers behind Ray's
`actor_has_tensor_transport`.

Ray asks a transport, in the caller, whether an actor can run it before it
submits a method with the transport to that actor (or sends the actor an RDT
argument). The transport asks the actor once, on Ray's system concurrency
group (so never behind a running method), and keeps the answer: an LRU cache
of at most `MAX_ACTORS_KNOWN` actors, whose entries go once unused for
`ACTOR_ANSWER_IDLE_S` (a gone actor's answer does not stay).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from rdt_jax import _limits, _ray

if TYPE_CHECKING:
  import ray

  from rdt_jax.transports._base import DlpackTransport

__all__ = ["ActorCapabilities"]


class ActorCapabilities:
  """One transport's cached answers, by actor id; safe to use from any thread."""

  def __init__(self) -> None:
    # actor id -> (can run this transport, time.monotonic() of its last use)
    self._answers: OrderedDict[str, tuple[bool, float]] = OrderedDict()
    self._lock = threading.Lock()

  def can_run(self, actor: ray.actor.ActorHandle, cls: type[DlpackTransport]) -> bool:
    """True if `actor` can run transport `cls` (`available_in_process()`
    there): asked once, then answered from the cache."""
    import ray

    actor_id = _ray.state.actor_id(actor)
    with self._lock:
      known = self._answers.get(actor_id)
    if known is None:
      ref = _ray.state.call_on_system_group(actor, _actor_can_run, cls)
      known = (bool(ray.get(ref)), 0.0)
    with self._lock:
      self._answers[actor_id] = (known[0], time.monotonic())
      self._answers.move_to_end(actor_id)
      self._forget()
    return known[0]

  def __len__(self) -> int:
    """Answers kept now (after dropping the expired ones)."""
    with self._lock:
      self._forget()
      return len(self._answers)

  def _forget(self) -> None:
    """Drops answers beyond `MAX_ACTORS_KNOWN`, or unused for
    `ACTOR_ANSWER_IDLE_S` (lock held): a gone actor's answer does not stay."""
    expired = time.monotonic() - _limits.ACTOR_ANSWER_IDLE_S
    answers = self._answers
    while answers and (len(answers) > _limits.MAX_ACTORS_KNOWN or next(iter(answers.values()))[1] < expired):
      answers.popitem(last=False)


def _actor_can_run(self: Any, cls: type[DlpackTransport]) -> bool:
  """Runs on an actor: whether it can run transport `cls`."""
  _ray.install()
  return cls.available_in_process()
