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

from rdt_jax import _settings
from rdt_jax.transports.nixl.metadata import NixlTransportMetadata

__all__ = ["DeviceViewBusy", "RemoteViews", "view_rebuild_interval_s"]


class DeviceViewBusy(RuntimeError):
  """A producer deregistered device memory while READs from it are in flight
  in this process: its view cannot be rebuilt now, and extending it could
  make NIXL refuse that producer for good (see the module docstring)."""


@functools.cache
def view_rebuild_interval_s() -> float:
  """How often at most a view of a producer that deregistered memory is
  rebuilt: the setting `RDT_JAX_NIXL_VIEW_REBUILD_S`, read once per process."""
  return float(_settings.value("RDT_JAX_NIXL_VIEW_REBUILD_S"))


class RemoteViews:
  """Remote agents loaded into this agent, and READs in flight per producer.

  Args:
    agent: returns the agent (created on first use).
    lock: the transport's lock.
    changed: called (lock held) when a view is added or removed.
  """

  def __init__(self, agent: Callable[[], Any], lock: threading.RLock, changed: Callable[[], None]):
    self._agent = agent
    self._lock = lock
    self._changed = changed
    # remote agent -> (version loaded, dereg epoch of the last rebuild, when,
    # device dereg epoch of the last rebuild)
    self._views: dict[str, tuple[int, int, float, int]] = {}
    self._host_only: set[str] = set()  # views loaded with no READ of device memory (see the module docstring)
    self._inflight: dict[str, int] = {}
    self._broken: set[str] = set()  # views whose last READ ended in error
    self.rebuilds = 0  # views rebuilt (each a reconnect), since this process started

  def __bool__(self) -> bool:
    """True while connected to any other agent."""
    return bool(self._views)

  def __len__(self) -> int:
    """Producers' agents loaded into this agent."""
    with self._lock:
      return len(self._views)

  def forget(self, remote: str) -> bool:
    """Removes the view of `remote` (disconnects) unless a READ from it is in
    flight or parked; True if none is left."""
    with self._lock:
      if self._inflight.get(remote):
        return False
      if remote in self._views:
        self.drop(remote)
        self._changed()
      return True

  def open_read(self, meta: NixlTransportMetadata, device: bool = False) -> str:
    """Brings the view of `meta`'s producer up to what `meta` needs (see the
    module docstring) and counts a READ from it in flight; returns the
    producer's agent name. `device`: the READ moves device memory (on
    either side). Every call is paired with one `close_read`."""
    remote = meta.agent_name
    assert remote is not None and meta.agent_meta is not None
    with self._lock:
      agent = self._agent()
      view = self._views.get(remote)
      now = time.monotonic()
      fresh = (meta.agent_version, meta.dereg_epoch, now, meta.device_dereg_epoch)
      device_freed = view is not None and meta.device_dereg_epoch > view[3]
      if view is None:
        agent.add_remote_agent(meta.agent_meta)
        self._views[remote] = fresh
        self._loaded(remote, device)
      elif not self._inflight.get(remote) and (
          remote in self._broken
          or device_freed
          or (device and remote in self._host_only)
          or (meta.dereg_epoch > view[1] and now - view[2] >= view_rebuild_interval_s())
      ):
        agent.remove_remote_agent(remote)
        del self._views[remote]
        self._broken.discard(remote)
        agent.add_remote_agent(meta.agent_meta)
        self._views[remote] = fresh
        self._loaded(remote, device)
        self.rebuilds += 1
      elif device_freed:
        raise DeviceViewBusy(
            f"producer agent {remote} deregistered device memory since this process loaded its metadata, "
            f"and {self._inflight[remote]} READ(s) from it are still in flight here, so its view cannot be "
            "rebuilt now; loading the new metadata over the old view could make NIXL refuse this producer "
            "for good (a device address registered again). Fetch this object once the fetches from that "
            "producer in flight have ended (for example, get the refs one at a time)."
        )
      elif meta.agent_version > view[0]:
        agent.add_remote_agent(meta.agent_meta)
        self._views[remote] = (meta.agent_version, view[1], view[2], view[3])
      self._inflight[remote] = self._inflight.get(remote, 0) + 1
      self._changed()
    return remote

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

  def drop(self, remote: str) -> None:
    """Removes `remote` from this agent's view (lock held by the caller);
    NIXL fails every transfer from it still in flight."""
    try:
      self._agent().remove_remote_agent(remote)
    except Exception:
      pass
    self._views.pop(remote, None)
    self._broken.discard(remote)
    self._host_only.discard(remote)
