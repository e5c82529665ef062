"""`jax_nixl`: one-sided transfers with NIXL (UCX), for cpu and cuda memory.

The producer makes each leaf's buffer readable through its process's NIXL
agent and puts the chunk addresses and the agent's metadata in the RDT
metadata; the consumer takes receive buffers and reads the whole object at
once. `NixlTransport` composes the package's rooms, each readable alone:

* `agent`: the process's agent (progress thread off) and the `Poller` that
  progresses it while anything needs it;
* `registrations`: the registration cache, pooled buffers, retried
  deregistrations;
* `export`: the producer's side (packing, in-place registration, serials);
* `read`: the consumer's three read strategies (NIXL READ, node-local, CUDA
  IPC);
* `staleness`: the check every strategy makes before reading;
* `views`: the consumer's view of each producer's agent;
* `inflight`: a posted READ's wait, retirement and parking.

Each room keeps its state under a lock of its own, and no lock is held
across NIXL's connection work (loading or removing a producer's agent) or
its registrations: a connection to an unreachable producer, or gigabytes
being pinned, never stall this process's exports, releases or READs from
other producers. A room tells the transport it changed (`_update_poller`)
with no lock of its own held; the poller's lock is taken last.

docs/performance.md has the measurements behind each choice.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from rdt_jax import _compat, _dlpack, _limits, _memory
from rdt_jax.transports._base import Destination, DlpackTransport
from rdt_jax.transports._destinations import MemoryKind, memory_kind
from rdt_jax.transports.nixl import agent as _agent
from rdt_jax.transports.nixl.export import Exports
from rdt_jax.transports.nixl.inflight import InFlight, PostedRead
from rdt_jax.transports.nixl.metadata import NixlTransportMetadata
from rdt_jax.transports.nixl.read import READ_FIX, CudaIpcRead, NixlRead, NodeLocalRead, ReadRefused, ReadStrategy
from rdt_jax.transports.nixl.registrations import Registrations, nixl_error
from rdt_jax.transports.nixl.staleness import FreedObjects, producer_idle_s
from rdt_jax.transports.nixl.views import RemoteViews

__all__ = ["NixlTransport"]


class NixlTransport(DlpackTransport):
  """The `jax_nixl` transport: one-sided NIXL READs of cpu and cuda memory.

  A READ in flight is never released or posted again, and memory it may
  still write is never reused before NIXL reports it ended
  (`rdt_jax.transports.nixl.inflight` states the lifecycle; docs/faults.md
  the bounds). A deregistration that fails keeps the region registered and
  its memory alive; the progress thread tries again.
  """

  name = "jax_nixl"
  devices = ("cpu", "cuda")
  metadata_class = NixlTransportMetadata
  reads_parts = True  # a READ descriptor may start anywhere in a chunk

  def __init__(self) -> None:
    super().__init__()
    self._agent_lock = threading.Lock()  # the agent's creation
    self._poll_lock = threading.Lock()  # whether the progress thread runs
    self._agent: Any = None
    self._poller: _agent.Poller | None = None
    self._registrations = Registrations(self.agent, self._update_poller)
    self._exports = Exports(self.agent, self._registrations, self._update_poller)
    self._views = RemoteViews(self.agent, self._update_poller)
    self._inflight = InFlight(self.agent, self._registrations, self._views, self._update_poller)
    self._freed = FreedObjects(self._update_poller)
    self._nixl_read = NixlRead(self.agent, self._registrations, self._views, self._inflight, self._freed, self._count)
    self._node_local_read = NodeLocalRead(self._freed, self._count)
    self._cuda_ipc_read = CudaIpcRead(self._freed, self._count)
    self._routes = threading.local()  # the route of this thread's last read that ended in `start_receive`
    self._polling = False
    self._next_forget = 0.0

  @staticmethod
  def is_one_sided() -> bool:
    return True

  @staticmethod
  def can_abort_transport() -> bool:
    return True

  @classmethod
  def available_in_process(cls) -> bool:
    return _compat.nixl_available()

  def agent(self) -> Any:
    """This process's NIXL agent, created on first use (with its progress
    poller and the pools' eviction listeners).

    Raises:
      ImportError: if NIXL is not installed here, saying what to install.
    """
    if self._agent is not None:
      return self._agent
    with self._agent_lock:
      if self._agent is None:
        agent = _agent.create_agent()
        self._poller = _agent.Poller(agent, self._tick)
        _memory.host_pool.add_eviction_listener(self._registrations.on_host_eviction)
        _memory.device_pool.add_eviction_listener(self._registrations.on_device_eviction)
        self._agent = agent
      return self._agent

  def _tick(self) -> None:
    """Progress-thread work after each poll; each step runs even if one
    before it raised (the first error is raised after all ran)."""
    error: Exception | None = None
    for step in (self._inflight.reap, self._registrations.retry_stuck, self._forget_producers):
      try:
        step()
      except Exception as e:
        error = error or e
    try:
      if error is not None:
        raise error
    finally:
      del error  # a local naming the raised error would hold this frame in a cycle with it

  def _forget_producers(self) -> None:
    """At most every `_limits.NIXL_FORGET_CHECK_S`: forgets each producer idle for
    `producer_idle_s()` or exited (its record of freed objects and its view,
    which disconnects), unless a READ from it is in flight or parked."""
    now = time.monotonic()
    if now < self._next_forget:
      return
    self._next_forget = now + _limits.NIXL_FORGET_CHECK_S
    for remote in self._freed.idle_or_gone(producer_idle_s(), now):
      if self._views.forget(remote):
        self._freed.forget(remote)

  def _update_poller(self) -> None:
    """Runs the progress thread while anything needs it (called by a room
    after it changed, with none of its locks held): objects
    exported, parked READs or failed deregistrations to retry, a
    connection to another agent (UCX completes a connection's wire-up only
    while both sides progress; a consumer that progressed only inside its own
    waits left a producer's reverse wire-up pending), or a producer to
    forget once idle. With none of these it stops."""
    with self._poll_lock:
      if self._poller is not None:
        self._polling = bool(
            len(self._exports) or self._inflight.parked() or self._registrations.has_stuck() or self._views
            or len(self._freed)
        )
        self._poller.set_active(self._polling)

  # ---- counters (tests, soak and chaos reports)

  def counters(self) -> dict[str, int]:
    """Everything this process holds for transfers, as counts: what a
    long-running process must see return to its baseline once its peers are
    gone or idle (`DlpackTransport.counters`, plus `objects` exported,
    `registrations` outside the pools, `pooled_registrations`, `stuck`
    deregistrations to retry, READs `inflight` and `parked`, `views` (remote
    agents loaded), `producers` tracked for staleness, and `polling`: 1 while
    the progress poll runs). Two entries are running totals instead, which
    never return to a baseline: `view_rebuilds`, the views of producers
    this process rebuilt (each one a reconnect before a READ) since it
    started, which the steady state of repeated transfers leaves alone; and
    `parked_total`, the READs ever parked. Each room
    is read under its own lock, so counts taken while transfers run may
    come from slightly different moments."""
    return {
        **super().counters(),
        "objects": len(self._exports),
        "registrations": self._registrations.count(),
        "pooled_registrations": self._registrations.count_pooled(),
        "stuck": int(self._registrations.has_stuck()),
        "inflight": self._views.inflight(),
        "parked": self._inflight.parked(),
        "views": len(self._views),
        "producers": len(self._freed),
        "polling": int(self._polling),
        "view_rebuilds": self._views.rebuilds,
        "parked_total": self._inflight.parked_total,
    }

  # ---- producer

  def export_buffers(
      self,
      obj_id: str,
      leaves: list[_dlpack.DescribedLeaf],
      meta: NixlTransportMetadata,
  ) -> None:
    self._exports.export(obj_id, leaves, meta)

  def release(self, obj_id: str) -> None:
    """Deregisters what `obj_id` registered (`export.Exports.release`)."""
    self._exports.release(obj_id)

  # ---- consumer

  def route_of(self, handle: Any) -> str:
    """"NIXL READ" for a read posted (`NixlRead`); for one done while it
    started, "node-local read" (`NodeLocalRead`) or "CUDA IPC"
    (`CudaIpcRead`), whichever this thread's last read was."""
    return "NIXL READ" if handle is not None else getattr(self._routes, "last", "node-local read")

  def _read_strategy(self, meta: NixlTransportMetadata, dests: list[Destination]) -> ReadStrategy:
    """The one choice of how to read an object: node-local where it applies
    (`read.NodeLocalRead.applies`), else CUDA IPC where it applies
    (`read.CudaIpcRead.applies`, opt-in), else a NIXL READ."""
    kinds = {memory_kind(d.device) for d in dests}
    if NodeLocalRead.applies(meta, kinds):
      return self._node_local_read
    if CudaIpcRead.applies(meta, kinds):
      return self._cuda_ipc_read
    return self._nixl_read

  def receives_synchronously(self, meta: NixlTransportMetadata, kinds: set[MemoryKind]) -> bool:
    """True where the object is read node-locally, or through CUDA IPC with
    the producer's handles in hand (the copy ends inside `start_receive`); a
    NIXL READ may outlive a fetch given up, so caller memory is staged for
    it (and for an object a CUDA IPC read then refuses, whose NIXL READ asks
    for staging)."""
    return NodeLocalRead.applies(meta, kinds) or (bool(meta.ipc) and CudaIpcRead.applies(meta, kinds))

  def start_receive(
      self,
      obj_id: str,
      meta: NixlTransportMetadata,
      communicator_metadata: Any,
      destinations: list[Destination],
  ) -> PostedRead | None:
    dests = [d for d in destinations if d.nbytes > 0]
    if not dests:
      return None
    self.agent()  # a consumer's first read creates its agent and progress thread
    strategy = self._read_strategy(meta, dests)
    try:
      handle = strategy.start(obj_id, meta, dests)
    except ReadRefused:  # nothing was read (node-local: the kernel refused, and such reads are off from now on)
      return self._nixl_read.start(obj_id, meta, dests)
    if handle is None:
      self._routes.last = "CUDA IPC" if strategy is self._cuda_ipc_read else "node-local read"
    return handle

  def wait_receive(self, handle: PostedRead | None, obj_id: str, timeout: float) -> None:
    if handle is None:
      return
    producer = handle.remote
    try:
      self._inflight.wait(handle, obj_id, timeout, self.aborted)
    except Exception as e:
      if not type(e).__module__.startswith("nixl"):
        raise
      raise nixl_error(  # NIXL's own exception, raised while the READ ran
          "complete the READ of", f"object {obj_id} from producer agent {producer}", e, READ_FIX, obj_id
      ) from None

  def finish_receive(self, handle: PostedRead | None) -> None:
    """Retires a READ `wait_receive` saw DONE (parked instead while an
    injected delay makes it look in flight)."""
    self._inflight.retire_or_park(handle)

  def cancel_receive(self, handle: PostedRead | None) -> None:
    """Gives up a READ (failure, timeout, abort, dropped request): retires it
    if NIXL reports it ended, parks it otherwise."""
    self._inflight.retire_or_park(handle)
