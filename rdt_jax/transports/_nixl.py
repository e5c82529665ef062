"""`jax_nixl`: one-sided transfers with NIXL (UCX), for cpu and cuda memory.

The producer makes each leaf's buffer readable through its process's NIXL
agent and puts the chunk addresses and the agent's metadata in the RDT
metadata. The consumer takes receive buffers, and issues one NIXL READ for the
whole object; `ray.get` of many refs starts every READ before waiting on any.

Choices, each measured on this project's 2-core CPU host (docs/performance.md
has the figures):

* One agent per process, created on first use, with NIXL's progress thread
  off: idle, that thread spins a core. The agent is progressed instead by a
  thread that calls `get_new_notifs()` every 10 ms, and only while this
  process exports objects, is connected to another agent, or has parked READs
  or deregistrations to retry; otherwise it sleeps on a condition.
* Small host leaves (up to `PACK_MAX_CHUNK` bytes) are copied into one pooled
  staging buffer on the producer, so an object of a thousand small leaves costs
  one registration and, on the consumer, one descriptor; small cuda leaves
  likewise into one pooled staging region per device
  (`rdt_jax._dlpack.device_pool`, copied on the device); large leaves are read
  where they are, their registrations cached per buffer and reference-counted
  across objects (sending the same array twice registers it once).
* Receive (and staging) buffers come from the host buffer pool
  (`rdt_jax._dlpack.host_pool`) and the device region pool
  (`rdt_jax._dlpack.device_pool`, one region per object and device): already
  faulted in / allocated, and registered once while the pools keep them.
* A consumer's view of a producer's agent is extended (metadata loaded again,
  connection kept) when the producer registered new memory, and rebuilt (the
  agent removed and added, which reconnects) at most every
  `VIEW_REBUILD_INTERVAL_S` (30 s by default) when the producer deregistered
  memory, never while a transfer from it is in flight:
  removing an agent kills its in-flight transfers, which is how Ray's own
  NIXL transport fails batched gets while the producer frees objects.
* A consumer on the producer's host reads host memory itself with
  `process_vm_readv` (`rdt_jax.transports._cma`), in several threads for large
  objects (UCX's `cma` transport makes the same call from one thread per
  READ); NIXL remains the path for device
  memory, other hosts, and processes the kernel does not let read each other.
* A READ in flight is never released or posted again; memory it may still
  write is quarantined until NIXL reports it ended (`NixlTransport` states
  the lifecycle guarantees; docs/faults.md the bounds).
"""

from __future__ import annotations

import atexit
import ctypes
import os
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Final

from rdt_jax import _compat, _dlpack, _faults, _process
from rdt_jax._metadata import DlpackTransportMetadata
from rdt_jax.transports import _cma
from rdt_jax.transports._base import Destination, DlpackTransport

#: Seconds between progress polls of a process that exports objects.
PROGRESS_INTERVAL_S: Final = 0.01
#: Host chunks up to this size are packed into one staging buffer.
PACK_MAX_CHUNK: Final = 256 << 10
#: A consumer rebuilds its view of a producer whose memory was deregistered at
#: most this often (env var RDT_JAX_NIXL_VIEW_REBUILD_S): a rebuild reconnects,
#: which costs tens of ms here, so rebuilding on every change would slow every
#: weight-sync step; stale descriptors stop working within this time.
VIEW_REBUILD_INTERVAL_S: Final = float(os.environ.get("RDT_JAX_NIXL_VIEW_REBUILD_S", "30"))
#: A parked READ (abandoned while in flight) still not finished after this many
#: seconds is ended by removing its producer's agent from this agent's view
#: (which NIXL does by failing its transfers), once no live transfer from that
#: producer is in flight; its memory is reclaimed when NIXL reports it ended.
PARK_END_AFTER_S: Final = float(os.environ.get("RDT_JAX_NIXL_PARK_END_S", "10"))


@dataclass
class NixlTransportMetadata(DlpackTransportMetadata):
  """`jax_nixl` metadata: where the producer's chunks are and who has them.

  Attributes:
    agent_name: the producer's NIXL agent.
    agent_meta: that agent's metadata (for `add_remote_agent`).
    agent_version: bumped whenever the producer registers new memory, so a
      consumer extends its view of the agent only when needed.
    dereg_epoch: bumped whenever the producer deregisters memory, so a
      consumer knows its view holds regions that are gone.
    addresses: the address of each non-empty chunk, in leaf order.
    device_ids: the device index of each non-empty chunk.
    regions: for each non-empty chunk, the registered region it lies in
      (chunks of one region may be read with one descriptor).
    serial: the object's export serial on its producer (never reused).
    live: the producer's live export serials when this object was exported,
      as inclusive (first, last) ranges: a consumer that holds metadata of an
      object whose serial is missing from the newest `live` it has seen
      from that producer knows the object was freed, and refuses to read it.
  """

  agent_name: str | None = None
  agent_meta: bytes | None = None
  agent_version: int = 0
  dereg_epoch: int = 0
  addresses: list[int] = field(default_factory=list)
  device_ids: list[int] = field(default_factory=list)
  regions: list[int] = field(default_factory=list)
  serial: int = 0
  live: list[tuple[int, int]] = field(default_factory=list)

  __eq__ = object.__eq__
  __hash__ = object.__hash__


def _mem_type(kind: str) -> str:
  return "DRAM" if kind == "cpu" else "VRAM"


def _host_or(device: _dlpack.Device) -> _dlpack.Device:
  """NIXL's view of a device: host memory is one region space (index 0)."""
  return _dlpack.Device("cpu") if device.kind == "cpu" else device


def coalesce(
    local: list[tuple[int, int, int]],
    remote: list[tuple[int, int, int]],
    regions: list[Any],
) -> tuple[list[tuple[int, int, int]], list[tuple[int, int, int]]]:
  """Merges neighbouring (address, nbytes, device) descriptor pairs.

  Two chunks merge when they lie in the same registered region on both sides
  (`regions` holds a (local, remote) region pair per chunk) and both their
  local and remote copies follow each other with the same 64-byte padding, so
  one descriptor (padding included) moves both. A descriptor must never span
  two registrations, even of adjacent memory.
  """
  out_l: list[list[int]] = []
  out_r: list[list[int]] = []
  last_region = None
  for (la, n, ld), (ra, _, rd), region in zip(local, remote, regions):
    if (
        out_l
        and region == last_region
        and out_l[-1][2] == ld
        and out_r[-1][2] == rd
        and out_l[-1][0] + _dlpack.aligned(out_l[-1][1]) == la
        and out_r[-1][0] + _dlpack.aligned(out_r[-1][1]) == ra
    ):
      out_l[-1][1] = la + n - out_l[-1][0]
      out_r[-1][1] = ra + n - out_r[-1][0]
    else:
      out_l.append([la, n, ld])
      out_r.append([ra, n, rd])
    last_region = region
  return [(a, b, c) for a, b, c in out_l], [(a, b, c) for a, b, c in out_r]


def read_pairs(
    dests: list[Destination], meta: NixlTransportMetadata
) -> tuple[list[tuple[int, int, int]], list[tuple[int, int, int]], list[Any]]:
  """The (local, remote, region key) lists `coalesce` takes, one per
  non-empty destination: each reads `nbytes` at its source chunk's address
  plus `source_offset`. A byte run of a resharded leaf (`part`) gets a region
  key of its own: the bytes after it are not padding, so it never merges.
  """
  # meta.addresses lists only non-empty chunks, in leaf order.
  nonempty = [i for i, c in enumerate(c for leaf in meta.leaves for c in leaf.chunks) if c.nbytes]
  slot = {chunk: k for k, chunk in enumerate(nonempty)}
  local, remote, regions = [], [], []
  for n, d in enumerate(dests):
    k = slot[d.source] if d.source >= 0 else n
    local.append((d.pointer, d.nbytes, _host_or(d.device).index))
    remote.append((meta.addresses[k] + d.source_offset, d.nbytes, meta.device_ids[k]))
    regions.append((d.region, meta.regions[k], n) if d.part else (d.region, meta.regions[k]))
  return local, remote, regions


def _ranges(serials: list[int]) -> list[tuple[int, int]]:
  """Sorted serials as inclusive (first, last) ranges (objects are mostly
  freed in the order they were made, so a few ranges cover many)."""
  out: list[list[int]] = []
  for n in sorted(serials):
    if out and out[-1][1] + 1 == n:
      out[-1][1] = n
    else:
      out.append([n, n])
  return [(a, b) for a, b in out]


def _in_ranges(n: int, ranges: list[tuple[int, int]]) -> bool:
  return any(a <= n <= b for a, b in ranges)


class _Poller:
  """Progresses an agent's target side, and reclaims parked memory.

  Runs `tick()` every `PROGRESS_INTERVAL_S` while `set_active(True)` (the
  process exports objects, or holds parked transfers or registrations);
  otherwise it sleeps on a condition and costs nothing. Stopped at interpreter
  exit (`atexit`), before Python finalizes: a daemon thread caught inside a NIXL
  call while the interpreter shuts down is unwound through C++ frames, which
  aborts the process.
  """

  def __init__(self, agent: Any, tick: Any = None):
    self._agent = agent
    self._tick = tick
    self._cond = threading.Condition()
    self._active = False
    self._stopped = False
    self._thread = threading.Thread(target=self._run, name="rdt-jax-nixl-progress", daemon=True)
    self._thread.start()
    atexit.register(self.stop)

  def set_active(self, active: bool) -> None:
    with self._cond:
      self._active = active
      self._cond.notify()

  def stop(self, timeout: float = 5.0) -> None:
    """Ends the thread after its current poll (waits up to `timeout` s)."""
    with self._cond:
      self._stopped = True
      self._cond.notify()
    if self._thread is not threading.current_thread():
      self._thread.join(timeout)

  def _run(self) -> None:
    while True:
      with self._cond:
        while not self._active and not self._stopped:
          self._cond.wait()
        if self._stopped:
          return
      try:
        self._agent.get_new_notifs()
        if self._tick is not None:
          self._tick()
      except Exception:  # a broken peer must not stop progress for the others
        pass
      time.sleep(PROGRESS_INTERVAL_S)


@dataclass
class _Registration:
  handle: Any
  count: int  # 0 for a pooled buffer's registration: kept until evicted


@dataclass
class _Export:
  """What the producer holds for one object until Ray frees it."""

  keys: list[tuple] = field(default_factory=list)
  serial: int = 0
  staging: Any = None  # the pooled staging buffer of packed chunks
  holds: list[Any] = field(default_factory=list)  # see _dlpack.hold_buffer
  regions: list[Any] = field(default_factory=list)  # pooled device staging regions


@dataclass
class _Receive:
  """One posted READ and everything it may still write into.

  `memory` references every receive buffer of the READ (views of a pooled host
  buffer, device buffers, targets). While it does, the host buffer pool does not
  hand those buffers out again (it reuses a buffer only once nothing references
  it), so the READ is retired, and `memory` dropped, only once NIXL reports
  it DONE or ERR; an abandoned READ is parked until then.
  """

  xfer: Any
  keys: list[tuple]
  remote: str | None
  obj_id: str = ""
  memory: list[Any] = field(default_factory=list)
  parked_at: float = 0.0
  ended: bool = False  # its producer's agent was removed to end it
  held_until: float = 0.0  # injected (RDT_JAX_FAULTS nixl.park): looks in flight until then


class NixlTransport(DlpackTransport):
  """The `jax_nixl` transport: one-sided NIXL READs of cpu and cuda memory.

  Lifecycle guarantees (docs/faults.md states them for users):

  * a READ in flight is never released, cancelled or posted again; a fetch
    ends only when NIXL reports the READ DONE or ERR, or Ray's timeout or abort
    gives it up;
  * memory a READ may still write (its receive buffers) is never reused,
    deregistered or freed before NIXL reports it DONE or ERR: a READ given up
    while in flight is parked with its memory, and the progress thread retires
    it when NIXL reports it ended. A parked READ still running after
    `PARK_END_AFTER_S` is ended by removing its producer's agent from this
    agent's view (NIXL fails the transfers of a removed agent), once no live
    transfer from that producer is in flight;
  * a deregistration that fails keeps the region registered and its memory
    alive; the progress thread tries again.
  """

  name = "jax_nixl"
  devices = ("cpu", "cuda")
  metadata_class = NixlTransportMetadata
  reads_parts = True  # a READ descriptor may start anywhere in a chunk

  def __init__(self) -> None:
    super().__init__()
    self._lock = threading.RLock()
    self._agent: Any = None
    self._poller: _Poller | None = None
    self._registrations: dict[tuple, _Registration] = {}
    self._exports: dict[str, _Export] = {}
    self._version = 0
    self._agent_meta: tuple[tuple[int, int], bytes] | None = None
    self._inflight: dict[str, int] = {}
    self._dereg_epoch = 0
    # remote agent -> (version loaded, dereg epoch of the last rebuild, when)
    self._views: dict[str, tuple[int, int, float]] = {}
    self._serial = 0  # the last export serial handed out (producer)
    # remote agent -> (newest export serial seen, that producer's live serials then)
    self._latest: dict[str, tuple[int, list[tuple[int, int]]]] = {}
    self._parked: list[_Receive] = []  # abandoned READs not yet ended
    self._stuck: list[tuple[Any, Any]] = []  # (handle, memory) deregistrations that failed
    self.parked_total = 0  # READs ever parked (for tests and the soak report)

  @staticmethod
  def is_one_sided() -> bool:
    return True

  @staticmethod
  def can_abort_transport() -> bool:
    return True

  @classmethod
  def available_in_process(cls) -> bool:
    return _compat.nixl_available()

  # ---- agent and registrations

  def agent(self) -> Any:
    """This process's NIXL agent, created on first use.

    Raises:
      ImportError: if NIXL is not installed here, saying what to install.
    """
    with self._lock:
      if self._agent is None:
        api = _compat.nixl_api()
        import ray

        actor_id = ray.get_runtime_context().get_actor_id() if ray.is_initialized() else None
        name = f"rdt-jax-{actor_id or 'driver'}-{uuid.uuid4().hex[:8]}"
        config = api.nixl_agent_config(
            enable_prog_thread=False,
            backends=["UCX"],
            sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT,
        )
        self._agent = api.nixl_agent(name, config)
        self._poller = _Poller(self._agent, self._reap)
        _dlpack.host_pool.add_eviction_listener(self._on_pool_eviction)
        _dlpack.device_pool.add_eviction_listener(self._on_device_pool_eviction)
      return self._agent

  def _register(self, pointer: int, nbytes: int, device: _dlpack.Device, pooled: bool = False) -> tuple:
    """Registers a region (or takes another reference to its registration)."""
    key = (pointer, nbytes, device.kind, device.index)
    with self._lock:
      reg = self._registrations.get(key)
      if reg is None:
        if _faults.ON:
          _faults.hit("nixl.register")
        handle = self.agent().register_memory(
            [(pointer, nbytes, device.index, "")], mem_type=_mem_type(device.kind)
        )
        reg = self._registrations[key] = _Registration(handle, 0)
        self._version += 1
      if not pooled:
        reg.count += 1
      return key

  def _unregister(self, keys: list[tuple], memory: Any = None) -> None:
    """Drops a reference to each registration; deregisters the last.

    A deregistration that fails keeps the region registered, and `memory`
    (what keeps the region's buffers alive) with it, for the progress thread
    to try again: registered memory is never freed.
    """
    with self._lock:
      for key in keys:
        reg = self._registrations.get(key)
        if reg is None or reg.count == 0:
          continue
        reg.count -= 1
        if reg.count == 0:
          del self._registrations[key]
          self._dereg_epoch += 1  # consumers drop the region from their view
          if not self._deregister(reg.handle):
            self._stuck.append((reg.handle, memory))
      self._update_poller()

  def _deregister(self, handle: Any) -> bool:
    try:
      if _faults.ON:
        _faults.hit("nixl.deregister")
      self._agent.deregister_memory(handle)
    except Exception:  # kept registered; retried by the progress thread
      return False
    return True

  def _on_pool_eviction(self, pointer: int, nbytes: int) -> None:
    with self._lock:
      key = (pointer, nbytes, "cpu", 0)
      reg = self._registrations.pop(key, None)
      if reg is not None and not self._deregister(reg.handle):
        self._stuck.append((reg.handle, None))
        self._update_poller()

  def _update_poller(self) -> None:
    """Runs the progress thread while anything needs it (lock held): objects
    exported, parked READs or failed deregistrations to retry, or a
    connection to another agent (UCX completes a connection's wire-up only
    while both sides progress; a consumer that progressed only inside its own
    waits left a producer's reverse wire-up pending)."""
    if self._poller is not None:
      self._poller.set_active(bool(self._exports or self._parked or self._stuck or self._views))

  def _on_device_pool_eviction(self, pointer: int, nbytes: int, device: _dlpack.Device) -> None:
    with self._lock:
      reg = self._registrations.pop((pointer, nbytes, device.kind, device.index), None)
      if reg is not None:
        self._agent.deregister_memory(reg.handle)

  def num_registrations(self) -> int:
    """Registered regions outside the host buffer pool (0 when idle),
    including those whose deregistration failed and waits for a retry."""
    with self._lock:
      return sum(1 for r in self._registrations.values() if r.count > 0) + len(self._stuck)

  def num_pooled_registrations(self) -> int:
    """Registered pooled buffers, kept for reuse (bounded by the pool)."""
    with self._lock:
      return sum(1 for r in self._registrations.values() if r.count == 0)

  def num_objects(self) -> int:
    """How many RDT objects this process currently exports."""
    with self._lock:
      return len(self._exports)

  def num_inflight(self) -> int:
    """READs this process posted that are not yet retired (parked included)."""
    with self._lock:
      return sum(self._inflight.values())

  def num_parked(self) -> int:
    """READs given up while in flight, whose memory waits for NIXL to end them."""
    with self._lock:
      return len(self._parked)

  # ---- producer

  def export_buffers(
      self,
      obj_id: str,
      leaves: list[_dlpack.DescribedLeaf],
      meta: NixlTransportMetadata,
  ) -> None:
    agent = self.agent()
    devices: dict[tuple[str, int], _dlpack.Device] = {}  # one Device per object and device

    def device_of(kind: str, index: int) -> _dlpack.Device:
      d = devices.get((kind, index))
      if d is None:
        d = devices[(kind, index)] = _host_or(_dlpack.Device(kind, index))  # type: ignore[arg-type]
      return d

    chunks = [
        (pointer, chunk.nbytes, device_of(leaf.spec.device, index))
        for leaf in leaves
        for pointer, chunk, index in zip(leaf.pointers, leaf.spec.chunks, leaf.device_indices)
        if chunk.nbytes
    ]
    arrays = [
        array
        for leaf in leaves
        for chunk, array in zip(leaf.spec.chunks, leaf.arrays)
        if chunk.nbytes
    ]
    export = _Export()
    try:
      packed = self._pack(chunks, export) | self._pack_device(chunks, export)
      for i, (pointer, nbytes, device) in enumerate(chunks):
        if i in packed:  # a copy: later changes to the array cannot reach it
          address, region = packed[i]
        else:  # read in place: keep the buffer from being donated meanwhile
          export.keys.append(self._register(pointer, nbytes, device))
          export.holds.append(_dlpack.hold_buffer(arrays[i]) if i < len(arrays) else None)
          address, region = pointer, -1 - i
        meta.addresses.append(address)
        meta.device_ids.append(device.index)
        meta.regions.append(region)
      if _faults.ON:
        _faults.hit("nixl.export")
      agent_meta = self._agent_metadata()
    except BaseException:
      # No consumer has seen these registrations: undo them all.
      self._unregister(export.keys, export)
      for region in export.regions:
        region.release()
      raise
    with self._lock:
      self._serial += 1
      export.serial = meta.serial = self._serial
      self._exports[obj_id] = export
      meta.live = _ranges([e.serial for e in self._exports.values()])
      meta.agent_version = self._version
      meta.dereg_epoch = self._dereg_epoch
      self._update_poller()
    meta.agent_name = agent.name
    meta.agent_meta = agent_meta
    meta.origin = _process.identity()

  def _agent_metadata(self) -> bytes:
    """This agent's metadata, fetched again only after new registrations."""
    with self._lock:
      key = (self._version, self._dereg_epoch)
      if self._agent_meta is None or self._agent_meta[0] != key:
        self._agent_meta = (key, self._agent.get_agent_metadata())
      return self._agent_meta[1]

  def _pack(self, chunks: list[tuple[int, int, _dlpack.Device]], export: _Export) -> dict[int, tuple[int, int]]:
    """Copies small host chunks into one pooled staging buffer.

    Returns, per packed chunk index, its address in the staging buffer and
    the staging buffer's region id (0).
    """
    small = [i for i, (_, n, d) in enumerate(chunks) if d.kind == "cpu" and n <= PACK_MAX_CHUNK]
    if not small:
      return {}
    total = sum(_dlpack.aligned(chunks[i][1]) for i in small)
    staging = export.staging = _dlpack.host_pool.acquire(total)
    base = _dlpack.host_pointer(staging)
    region = _dlpack.host_pool.region_of(staging)
    if region is not None:
      self._register(region[0], region[1], _dlpack.Device("cpu"), pooled=True)
    else:
      export.keys.append(self._register(base, total, _dlpack.Device("cpu")))
    packed, offset = {}, 0
    for i in small:
      pointer, nbytes, _ = chunks[i]
      ctypes.memmove(base + offset, pointer, nbytes)
      packed[i] = (base + offset, 0)
      offset += _dlpack.aligned(nbytes)
    return packed

  def _pack_device(
      self, chunks: list[tuple[int, int, _dlpack.Device]], export: _Export
  ) -> dict[int, tuple[int, int]]:
    """Copies small cuda chunks into one pooled staging region per device
    (a device-to-device copy, waited for once per device).

    Needs torch here (the copies are torch byte copies); without it every
    chunk is read in place. Region ids are `1 + device index` (0 is the host
    staging buffer, negative ids are chunks read in place).
    """
    if not _dlpack.importable("torch"):
      return {}
    by_device: dict[_dlpack.Device, list[int]] = {}
    for i, (_, n, d) in enumerate(chunks):
      if d.kind != "cpu" and n <= PACK_MAX_CHUNK:
        by_device.setdefault(d, []).append(i)
    packed = {}
    for device, small in by_device.items():
      total = sum(_dlpack.aligned(chunks[i][1]) for i in small)
      region = _dlpack.device_pool.acquire(total, device, "torch")
      export.regions.append(region)
      self._register(region.pointer, region.nbytes, device, pooled=region.kept)
      if not region.kept:
        export.keys.append((region.pointer, region.nbytes, device.kind, device.index))
      offset = 0
      for i in small:
        pointer, nbytes, _ = chunks[i]
        _dlpack.copy_bytes(region.pointer + offset, pointer, nbytes, device)
        packed[i] = (region.pointer + offset, 1 + device.index)
        offset += _dlpack.aligned(nbytes)
      _dlpack.wait_for_copies(device)
    return packed

  def release(self, obj_id: str) -> None:
    """Deregisters what `obj_id` registered; its memory may then be reused.

    One-sided READs give the producer no notice, so a READ a consumer gave up
    (timeout, abort) may still be reading when Ray frees the object. Its bytes
    are never delivered: the consumer's fetch has already failed, and its
    receive memory is parked until NIXL ends the READ. A consumer that posts
    after the release fails with NIXL_ERR_NOT_FOUND once its view of this
    agent is rebuilt (see `_refresh_remote`).
    """
    with self._lock:
      export = self._exports.pop(obj_id, None)
      self._update_poller()
    if export is not None:
      self._unregister(export.keys, export)
      for region in export.regions:
        region.release()

  # ---- consumer

  def start_receive(
      self,
      obj_id: str,
      meta: NixlTransportMetadata,
      communicator_metadata: Any,
      destinations: list[Destination],
  ) -> _Receive | None:
    dests = [d for d in destinations if d.nbytes > 0]
    if not dests:
      return None
    agent = self.agent()
    remote = meta.agent_name
    assert remote is not None and meta.agent_meta is not None
    self._check_live(obj_id, remote, meta)
    if self._read_directly(obj_id, meta, dests):
      return None
    self._refresh_remote(remote, meta)  # counts the transfer in flight
    keys: list[tuple] = []
    try:
      keys = self._register_destinations(dests, keys)
      local, remote_descs = coalesce(*read_pairs(dests, meta))
      self._count(descriptors=len(local))
      xfer = agent.initialize_xfer(
          "READ",
          agent.get_xfer_descs(local, mem_type=_mem_type(dests[0].device.kind)),
          agent.get_xfer_descs(remote_descs, mem_type=_mem_type(meta.tensor_device or "cpu")),
          remote,
          b"",
      )
    except BaseException:
      self._unregister(keys)
      self._done_with(remote)
      raise
    receive = _Receive(xfer, keys, remote, obj_id, [d.keepalive for d in dests])
    try:
      if _faults.ON:
        _faults.hit("nixl.post")
      state = agent.transfer(xfer)
    except BaseException:
      self.cancel_receive(receive)  # never posted, or posted and failed: retire or park
      raise
    if state == "ERR":
      self.cancel_receive(receive)
      raise RuntimeError(f"NIXL READ of object {obj_id} entered the error state on start.")
    return receive

  def _read_directly(self, obj_id: str, meta: NixlTransportMetadata, dests: list[Destination]) -> bool:
    """Reads host memory of a producer on this host with `process_vm_readv`
    (`rdt_jax.transports._cma`); False (nothing read) where that does not
    apply or the kernel refuses it, and the caller READs through NIXL.

    Raises:
      RuntimeError: the producer exited, or its memory could not be read.
    """
    if meta.tensor_device != "cpu" or not _cma.can_read(meta.origin):
      return False
    if any(d.device.kind != "cpu" for d in dests):
      return False
    local, remote = coalesce(*read_pairs(dests, meta))
    if _faults.ON:
      _faults.hit("nixl.post")
    assert meta.origin is not None
    try:
      _cma.read(meta.origin, [(a, r, n) for (a, n, _), (r, _, _) in zip(local, remote)])
    except PermissionError:
      return False
    except OSError as e:
      raise RuntimeError(f"Node-local read of object {obj_id} from pid {meta.origin[2]} failed: {e}") from None
    self._count(descriptors=len(local), direct=1)
    return True

  def _check_live(self, obj_id: str, remote: str, meta: NixlTransportMetadata) -> None:
    """Refuses to read an object its producer is known to have freed.

    Every metadata carries the producer's live export serials at its export;
    the newest seen per producer is kept. An object whose serial is missing
    from it was freed (its memory may hold another object's bytes by now).

    Raises:
      RuntimeError: naming the object, if it is known to be freed.
    """
    with self._lock:
      latest = self._latest.get(remote)
      if latest is None or meta.serial > latest[0]:
        latest = self._latest[remote] = (meta.serial, list(meta.live))
    if meta.serial and not _in_ranges(meta.serial, latest[1]):
      raise RuntimeError(
          f"Object {obj_id} was freed by its producer (agent {remote}) before "
          "this read: its transport metadata is stale. Keep the ObjectRef alive "
          "until every consumer has fetched it."
      )

  def _refresh_remote(self, remote: str, meta: NixlTransportMetadata) -> None:
    """Brings this agent's view of `remote` up to what `meta` needs, and
    counts a transfer from `remote` in flight (`_done_with` uncounts it).

    New registrations extend the view (loading the metadata again is cheap
    and keeps the connection). Regions the producer has deregistered leave
    the view only when it is rebuilt: removed and added again, which
    reconnects. That is done at most every `VIEW_REBUILD_INTERVAL_S`, and never
    while a transfer from `remote` is in flight (removing an agent kills its
    transfers), so a stale descriptor stops working within that interval.
    """
    with self._lock:
      view = self._views.get(remote)
      now = time.monotonic()
      assert meta.agent_meta is not None
      if view is None:
        self._agent.add_remote_agent(meta.agent_meta)
        self._views[remote] = (meta.agent_version, meta.dereg_epoch, now)
      elif (
          meta.dereg_epoch > view[1]
          and now - view[2] >= VIEW_REBUILD_INTERVAL_S
          and not self._inflight.get(remote)
      ):
        self._agent.remove_remote_agent(remote)
        del self._views[remote]
        self._agent.add_remote_agent(meta.agent_meta)
        self._views[remote] = (meta.agent_version, meta.dereg_epoch, now)
      elif meta.agent_version > view[0]:
        self._agent.add_remote_agent(meta.agent_meta)
        self._views[remote] = (meta.agent_version, view[1], view[2])
      self._inflight[remote] = self._inflight.get(remote, 0) + 1
      self._update_poller()

  def _done_with(self, remote: str) -> None:
    with self._lock:
      self._inflight[remote] -= 1
      if not self._inflight[remote]:
        del self._inflight[remote]

  def _register_destinations(self, dests: list[Destination], keys: list[tuple]) -> list[tuple]:
    """Registers the receive memory, each distinct allocation once.

    Pooled buffers stay registered for reuse and need no release; the keys
    of the others are appended to `keys` (as they are taken, so a failure
    half way leaves `keys` naming exactly what to undo) and returned.
    """
    for (pointer, nbytes), device, pooled in {(d.region, _host_or(d.device), d.pooled): None for d in dests}:
      key = self._register(pointer, nbytes, device, pooled=pooled)
      if not pooled:
        keys.append(key)
    return keys

  def wait_receive(self, handle: _Receive | None, obj_id: str, timeout: float) -> None:
    if handle is None:
      return
    agent = self._agent
    deadline = None if timeout is None or timeout < 0 else time.monotonic() + timeout
    held_until = 0.0  # an injected delay: the READ looks in flight until then
    if _faults.ON:
      held_until = time.monotonic() + _faults.hit("nixl.wait", sleep=False)
    sleep = 0.0
    while True:
      state = agent.check_xfer_state(handle.xfer)
      if state == "DONE" and time.monotonic() >= held_until:
        if _faults.ON:
          _faults.hit("nixl.complete")
        return
      if state == "ERR":
        raise RuntimeError(f"NIXL READ of object {obj_id} entered the error state.")
      if self.aborted(obj_id):
        raise RuntimeError(f"NIXL READ of object {obj_id} was aborted.")
      if deadline is not None and time.monotonic() >= deadline:
        raise TimeoutError(f"NIXL READ of object {obj_id} timed out after {timeout}s.")
      # Spin briefly for small transfers, then back off to 1 ms sleeps.
      sleep = min(0.001, sleep + 0.00005)
      time.sleep(sleep)

  def finish_receive(self, handle: _Receive | None) -> None:
    """Retires a READ that `wait_receive` saw DONE (parked instead if an
    injected delay makes it look in flight)."""
    self._retire_or_park(handle)

  def cancel_receive(self, handle: _Receive | None) -> None:
    """Gives up a READ (failure, timeout, abort, dropped request): retires it
    if NIXL reports it ended, parks it otherwise."""
    self._retire_or_park(handle)

  def _retire_or_park(self, handle: _Receive | None) -> None:
    """Retires the READ if NIXL reports it ended; parks it otherwise.

    A READ still in flight is never released (NIXL would try to cancel it,
    and a failed cancel leaves it writing): its memory stays referenced by
    the parked handle until the progress thread sees it end.
    """
    if handle is None or handle.remote is None:
      return
    if _faults.ON:
      handle.held_until = time.monotonic() + _faults.hit("nixl.park", sleep=False)
    if not self._retire(handle):
      with self._lock:
        handle.parked_at = time.monotonic()
        self._parked.append(handle)
        self.parked_total += 1
        self._update_poller()

  def _retire(self, handle: _Receive) -> bool:
    """Releases a READ that NIXL reports DONE or ERR, and what it held."""
    if not handle.ended and time.monotonic() < handle.held_until:
      return False
    try:
      state = self._agent.check_xfer_state(handle.xfer)
    except Exception:  # its remote agent was removed: ended if we removed it
      state = "ERR" if handle.ended else "PROC"
    if state == "PROC":
      return False
    try:
      if _faults.ON:
        _faults.hit("nixl.release")
      self._agent.release_xfer_handle(handle.xfer)
    except Exception:  # stays parked; the progress thread tries again
      return False
    self._unregister(handle.keys, handle.memory)
    handle.keys, handle.memory = [], []
    assert handle.remote is not None
    self._done_with(handle.remote)
    handle.remote = None
    return True

  def _reap(self) -> None:
    """Progress-thread tick: retires parked READs NIXL reports ended, ends
    those parked too long, and retries failed deregistrations."""
    with self._lock:
      if not self._parked and not self._stuck:
        return
      parked, self._parked = self._parked, []
      stuck, self._stuck = self._stuck, []
    still = [h for h in parked if not self._retire(h)]
    stuck = [(h, m) for h, m in stuck if not self._deregister(h)]
    now = time.monotonic()
    with self._lock:
      self._parked.extend(still)
      self._stuck.extend(stuck)
      for remote in {h.remote for h in self._parked if now - h.parked_at > PARK_END_AFTER_S}:
        mine = [h for h in self._parked if h.remote == remote]
        if remote is None or self._inflight.get(remote, 0) > len(mine):
          continue  # a live transfer from `remote` would be killed too
        try:
          self._agent.remove_remote_agent(remote)
        except Exception:
          pass
        self._views.pop(remote, None)
        for h in mine:
          h.ended = True
      self._update_poller()
