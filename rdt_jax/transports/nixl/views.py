"""This agent's view of each producer's agent, and the READs in flight from each.

A consumer loads a producer's agent metadata (`add_remote_agent`) before its
first READ from it. The view is extended (metadata loaded again, connection
kept) when the producer registered new memory (`agent_version` grew), and
rebuilt (the agent removed and added, which reconnects) when the producer
deregistered memory (`dereg_epoch` grew), at most every
`view_rebuild_interval_s()` seconds (`RDT_JAX_NIXL_VIEW_REBUILD_S`) and never while a READ from that producer is in
flight: removing an agent kills its in-flight transfers, which is how Ray's own
NIXL transport fails batched gets while the producer frees objects. A rebuild
reconnects, which costs tens of ms here, so rebuilding on every change would
slow every weight-sync step; a stale descriptor stops working within the
interval (the NIXL-side defence `staleness` describes).

Device memory is the exception: a view is rebuilt, whatever the interval,
once the producer deregistered device memory (`device_dereg_epoch` grew).
Device allocators hand a freed address out again, and a region registered
anew at an address NIXL already holds for that producer (same address, size
and device, another registration) makes NIXL refuse the whole metadata
(NIXL_ERR_NOT_ALLOWED, "metadata updates" are unsupported). The refusal also
drops NIXL's record of the producer but not UCX's connection to it, after
which no load of that producer's metadata succeeds in this process again.
Host memory registered again at the same address carried the same remote
key in our checks (UCX, this NIXL version), so host deregistrations keep the
interval. While a READ from the producer is in flight the
rebuild cannot happen; the new READ is then refused with an error that says
so (`DeviceViewBusy`), never risked.

A view loaded for host memory alone is rebuilt once before its first READ
of device memory. UCX sets a connection's lanes up when the view is loaded,
and a process (a thread) with no CUDA context at that moment gets a
connection that reads device memory by emulation, through host memory and
TCP, however UCX is configured: on one H200, 64 MiB took 144 ms that way
against 0.08 ms through CUDA IPC
(docs/benchmarks/gpu/2026-11-27/connect-order/). A view loaded for a device
READ was loaded with a context: its receive memory was allocated in this
thread just before. While a READ from that producer is in flight the rebuild
waits; the device READ goes ahead on the old view (slow, never wrong), and
the rebuild happens at the next READ that finds none in flight.

A READ that ended in error (a producer's host unreachable, a link down) may
leave UCX's connection to that producer failed for good; the view is then
marked broken (`mark_broken`) and rebuilt at the next READ from it once none
is in flight, so a consumer reconnects when the network comes back.

A view is removed (`forget`, which disconnects) when the transport forgets
its producer (idle, or exited: `staleness.FreedObjects.idle_or_gone`), never
while a READ from it is in flight or parked.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable
from typing import Any

from rdt_jax import _faults, _settings
from rdt_jax._error_base import RdtJaxError
from rdt_jax.transports.nixl.metadata import NixlTransportMetadata

__all__ = ["DeviceViewBusy", "RemoteViews", "view_rebuild_interval_s"]


class DeviceViewBusy(RdtJaxError, RuntimeError):
  """A producer deregistered device memory while READs from it are in flight
  in this process: its view cannot be rebuilt now, and extending it could
  make NIXL refuse that producer for good (see the module docstring).

  jax_nixl turns it into the `NixlError` a `ray.get` meets ("cannot read
  object ... now"); public so code built on the views can catch it by name.
  Get the refs one at a time, or again once the fetches in flight have ended.
  """


DeviceViewBusy.__module__ = "rdt_jax"  # public as rdt_jax.DeviceViewBusy


@functools.cache
def view_rebuild_interval_s() -> float:
  """How often at most a view of a producer that deregistered memory is
  rebuilt: the setting `RDT_JAX_NIXL_VIEW_REBUILD_S`, read once per process."""
  return float(_settings.value("RDT_JAX_NIXL_VIEW_REBUILD_S"))


class RemoteViews:
  """Remote agents loaded into this agent, and READs in flight per producer.

  Connection work (loading, reloading or removing a producer's agent) runs
  outside this room's lock, with that producer marked pending: READs from
  other producers, and every export and release of this process, go on
  meanwhile; a READ from the same producer waits for the work to end.

  Args:
    agent: returns the agent (created on first use).
    changed: called (no lock held) when a view is added or removed.
  """

  def __init__(self, agent: Callable[[], Any], changed: Callable[[], None]):
    self._agent = agent
    self._lock = threading.Lock()
    self._cond = threading.Condition(self._lock)  # a producer left the pending set
    self._changed = changed
    # remote agent -> (version loaded, dereg epoch of the last rebuild, when,
    # device dereg epoch of the last rebuild)
    self._views: dict[str, tuple[int, int, float, int]] = {}
    self._host_only: set[str] = set()  # views loaded with no READ of device memory (see the module docstring)
    self._inflight: dict[str, int] = {}
    self._broken: set[str] = set()  # views whose last READ ended in error
    self._pending: set[str] = set()  # producers whose agent is being loaded, reloaded or removed
    self.rebuilds = 0  # views rebuilt (each a reconnect), since this process started

  def __bool__(self) -> bool:
    """True while connected to any other agent (read without the lock)."""
    return bool(self._views)

  def __len__(self) -> int:
    """Producers' agents loaded into this agent."""
    with self._lock:
      return len(self._views)

  def open_read(self, meta: NixlTransportMetadata, device: bool = False) -> str:
    """Brings the view of `meta`'s producer up to what `meta` needs (see the
    module docstring) and counts a READ from it in flight; returns the
    producer's agent name. `device`: the READ moves device memory (on
    either side). Every call is paired with one `close_read`.

    Raises:
      DeviceViewBusy: the view must be rebuilt and READs from the producer
        are in flight (see the module docstring).
      Exception: NIXL's own, from loading the producer's agent.
    """
    remote = meta.agent_name
    assert remote is not None and meta.agent_meta is not None
    with self._lock:
      while remote in self._pending:
        self._cond.wait()
      now = time.monotonic()
      work = self._work(meta, device, now)
      if work is None:
        self._inflight[remote] = self._inflight.get(remote, 0) + 1
        return remote
      self._pending.add(remote)
      view = self._views.get(remote)
    removed = committed = False
    try:
      agent = self._agent()
      if _faults.ON:
        _faults.hit("nixl.connect")
      if work == "rebuild":
        agent.remove_remote_agent(remote)
        removed = True
      agent.add_remote_agent(meta.agent_meta)
      with self._lock:
        if work == "extend":
          assert view is not None
          self._views[remote] = (meta.agent_version, view[1], view[2], view[3])
        else:
          self._views[remote] = (meta.agent_version, meta.dereg_epoch, now, meta.device_dereg_epoch)
          self._broken.discard(remote)
          self._loaded(remote, device)
          self.rebuilds += work == "rebuild"
        self._inflight[remote] = self._inflight.get(remote, 0) + 1
        committed = True
    finally:  # whatever happened, the producer is no longer pending
      with self._lock:
        if removed and not committed:
          self._forget_view(remote)
        self._pending.discard(remote)
        self._cond.notify_all()
      self._changed()
    return remote

  def _work(self, meta: NixlTransportMetadata, device: bool, now: float) -> str | None:
    """What the view of `meta`'s producer needs before a READ (lock held):
    "add", "rebuild", "extend", or None (it is ready).

    Raises:
      DeviceViewBusy: see `open_read`.
    """
    remote = meta.agent_name
    assert remote is not None
    view = self._views.get(remote)
    if view is None:
      return "add"
    device_freed = meta.device_dereg_epoch > view[3]
    if not self._inflight.get(remote) and (
        remote in self._broken
        or device_freed
        or (device and remote in self._host_only)
        or (meta.dereg_epoch > view[1] and now - view[2] >= view_rebuild_interval_s())
    ):
      return "rebuild"
    if device_freed:
      raise DeviceViewBusy(
          f"producer agent {remote} deregistered device memory since this process loaded its metadata, "
          f"and {self._inflight[remote]} READ(s) from it are still in flight here, so its view cannot be "
          "rebuilt now; loading the new metadata over the old view could make NIXL refuse this producer "
          "for good (a device address registered again). Fetch this object once the fetches from that "
          "producer in flight have ended (for example, get the refs one at a time)."
      )
    if meta.agent_version > view[0]:
      return "extend"
    return None

  def _loaded(self, remote: str, device: bool) -> None:
    """Records whether the view of `remote` was just loaded for a READ of
    device memory (lock held)."""
    if device:
      self._host_only.discard(remote)
    else:
      self._host_only.add(remote)

  def mark_broken(self, remote: str) -> None:
    """A READ from `remote` ended in error: rebuild its view (reconnect) at
    the next READ from it that finds none in flight."""
    with self._lock:
      if remote in self._views:
        self._broken.add(remote)

  def close_read(self, remote: str) -> None:
    """A READ from `remote` counted by `open_read` is retired."""
    with self._lock:
      self._inflight[remote] -= 1
      if not self._inflight[remote]:
        del self._inflight[remote]

  def inflight(self, remote: str | None = None) -> int:
    """READs not yet retired, from `remote` or from every producer."""
    with self._lock:
      if remote is None:
        return sum(self._inflight.values())
      return self._inflight.get(remote, 0)

  def forget(self, remote: str) -> bool:
    """Removes the view of `remote` (disconnects) unless a READ from it is in
    flight or parked, or its agent is being loaded; True if no view is left."""
    return self._remove(remote, parked=0)

  def end_parked(self, remote: str, parked: int) -> bool:
    """Removes `remote`'s agent from this agent's view, so NIXL fails the
    READs from it still running, if the `parked` READs from it are all it
    has in flight (a live READ would be failed too); True if it did."""
    return self._remove(remote, parked)

  def _remove(self, remote: str, parked: int) -> bool:
    """Removes the view of `remote` unless more than `parked` READs from it
    are in flight or its agent is being loaded (then False); the removal
    (a disconnect) runs outside the lock."""
    with self._lock:
      if self._inflight.get(remote, 0) > parked or remote in self._pending:
        return False
      if remote not in self._views:
        return True
      self._forget_view(remote)
      self._pending.add(remote)
    try:
      if _faults.ON:
        _faults.hit("nixl.connect")
      self._agent().remove_remote_agent(remote)
    except Exception:  # NIXL no longer holds it, or cannot reach it: either way it is gone here
      pass
    finally:
      with self._lock:
        self._pending.discard(remote)
        self._cond.notify_all()
      self._changed()
    return True

  def _forget_view(self, remote: str) -> None:
    """Drops what this room knows of `remote`'s view (lock held)."""
    self._views.pop(remote, None)
    self._broken.discard(remote)
    self._host_only.discard(remote)
