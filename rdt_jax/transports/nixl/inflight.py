"""Posted NIXL READs: waiting for them, and their lifecycle until retired.

The states of a READ, and what moves it on:

    posted --(wait: NIXL reports DONE)--> finished --(retire)--> retired
    posted --(given up: error, timeout, abort, request dropped)--> retire or park
    parked --(progress thread sees NIXL report DONE or ERR)--> retired
    parked --(still running after park_end_after_s())--> producer's agent removed
           --> NIXL fails it --> retired

Guarantees:

* a READ in flight is never released, cancelled or posted again; a fetch ends
  only when NIXL reports the READ DONE or ERR, or Ray's timeout or abort gives
  it up;
* memory a READ may still write (its receive buffers, `PostedRead.memory`) is
  never reused, deregistered or freed before NIXL reports it DONE or ERR: a
  READ given up while in flight is parked with its memory, and the progress
  thread retires it when NIXL reports it ended (`reap`);
* a parked READ still running after `park_end_after_s()` seconds
  (`RDT_JAX_NIXL_PARK_END_S`) is ended by removing
  its producer's agent from this agent's view (NIXL fails the transfers of a
  removed agent), once no live READ from that producer is in flight.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rdt_jax import _faults, _settings
from rdt_jax.transports.nixl.registrations import Key, Registrations
from rdt_jax.transports.nixl.views import RemoteViews

__all__ = ["InFlight", "PostedRead", "park_end_after_s"]



@functools.cache
def park_end_after_s() -> float:
  """Seconds after which a parked READ still running is ended: the setting
  `RDT_JAX_NIXL_PARK_END_S`, read once per process (at the first parked
  READ's check)."""
  return float(_settings.value("RDT_JAX_NIXL_PARK_END_S"))


@dataclass
class PostedRead:
  """One posted READ and everything it may still write into.

  `memory` references every receive buffer of the READ (views of a pooled host
  buffer, device buffers, targets: each `Destination.keepalive`). While it
  does, the host buffer pool does not hand those buffers out again (it reuses a
  buffer only once nothing references it), so the READ is retired, and
  `memory` dropped, only once NIXL reports it DONE or ERR.
  """

  xfer: Any
  keys: list[Key]
  remote: str | None  # None once retired
  obj_id: str = ""
  memory: list[Any] = field(default_factory=list)
  parked_at: float = 0.0
  ended: bool = False  # its producer's agent was removed to end it
  held_until: float = 0.0  # injected (RDT_JAX_FAULTS nixl.park): looks in flight until then


class InFlight:
  """The READs this process posted, from wait to retirement (see the module
  docstring).

  Args:
    agent: returns the agent.
    registrations: where a retired READ's receive memory registrations go back.
    views: counts READs in flight per producer; ends parked READs.
    changed: called (no lock held) when the parked set changes.
  """

  def __init__(
      self,
      agent: Callable[[], Any],
      registrations: Registrations,
      views: RemoteViews,
      changed: Callable[[], None],
  ):
    self._agent = agent
    self._lock = threading.Lock()
    self._registrations = registrations
    self._views = views
    self._changed = changed
    self._parked: list[PostedRead] = []
    self.parked_total = 0  # READs ever parked (counters()["parked_total"])

  def parked(self) -> int:
    """READs parked now (given up while in flight, their memory kept until
    NIXL ends them); the posted READs not yet retired are
    `RemoteViews.inflight()`."""
    return len(self._parked)

  def wait(self, read: PostedRead, obj_id: str, timeout: float, aborted: Callable[[str], bool]) -> None:
    """Blocks until NIXL reports `read` DONE.

    Raises:
      RuntimeError: if NIXL reports ERR, or Ray aborted the transfer.
      TimeoutError: after `timeout` seconds (None or negative: no limit).
    """
    agent = self._agent()
    deadline = None if timeout is None or timeout < 0 else time.monotonic() + timeout
    held_until = 0.0  # an injected delay: the READ looks in flight until then
    if _faults.ON:
      held_until = time.monotonic() + _faults.hit("nixl.wait", sleep=False)
    sleep = 0.0
    while True:
      state = agent.check_xfer_state(read.xfer)
      if state == "DONE" and time.monotonic() >= held_until:
        if _faults.ON:
          _faults.hit("nixl.complete")
        return
      if state == "ERR":
        raise RuntimeError(f"NIXL READ of object {obj_id} entered the error state.")
      if aborted(obj_id):
        raise RuntimeError(f"NIXL READ of object {obj_id} was aborted.")
      if deadline is not None and time.monotonic() >= deadline:
        raise TimeoutError(f"NIXL READ of object {obj_id} timed out after {timeout}s.")
      # Spin briefly for small transfers, then back off to 1 ms sleeps.
      sleep = min(0.001, sleep + 0.00005)
      time.sleep(sleep)

  def retire_or_park(self, read: PostedRead | None) -> None:
    """Retires `read` if NIXL reports it ended; parks it otherwise.

    A READ still in flight is never released (NIXL would try to cancel it,
    and a failed cancel leaves it writing): its memory stays referenced by
    the parked handle until the progress thread sees it end.
    """
    if read is None or read.remote is None:
      return
    if _faults.ON:
      read.held_until = time.monotonic() + _faults.hit("nixl.park", sleep=False)
    if not self._retire(read):
      with self._lock:
        read.parked_at = time.monotonic()
        self._parked.append(read)
        self.parked_total += 1
      self._changed()

  def _retire(self, read: PostedRead) -> bool:
    """Releases a READ that NIXL reports DONE or ERR, and what it held."""
    if not read.ended and time.monotonic() < read.held_until:
      return False
    agent = self._agent()
    try:
      state = agent.check_xfer_state(read.xfer)
    except Exception:  # its remote agent was removed: ended if we removed it
      state = "ERR" if read.ended else "PROC"
    if state == "PROC":
      return False
    try:
      if _faults.ON:
        _faults.hit("nixl.release")
      agent.release_xfer_handle(read.xfer)
    except Exception:  # stays parked; the progress thread tries again
      return False
    self._registrations.unregister(read.keys, read.memory)
    read.keys, read.memory = [], []
    assert read.remote is not None
    if state == "ERR" and not read.ended:
      self._views.mark_broken(read.remote)
    self._views.close_read(read.remote)
    read.remote = None
    return True

  def reap(self) -> None:
    """Progress-thread tick: retires parked READs NIXL reports ended, and
    ends those parked longer than `park_end_after_s()` (the only caller that
    retires parked READs)."""
    with self._lock:
      if not self._parked:
        return
      parked, self._parked = self._parked, []
    still = [r for r in parked if not self._retire(r)]
    now = time.monotonic()
    end_after = park_end_after_s()
    with self._lock:
      self._parked.extend(still)
      overdue = {r.remote for r in self._parked if r.remote is not None and now - r.parked_at > end_after}
      plan = {remote: [r for r in self._parked if r.remote == remote] for remote in overdue}
    for remote, mine in plan.items():
      if self._views.end_parked(remote, len(mine)):  # refused while a live READ from `remote` is in flight
        for r in mine:
          r.ended = True
    self._changed()
