"""`jax_nixl`: one-sided transfers with NIXL (UCX), for cpu and cuda memory.

The producer makes each leaf's buffer readable through its process's NIXL
agent and puts the chunk addresses and the agent's metadata in the RDT
metadata. The consumer takes receive buffers, and issues one NIXL READ for the
whole object; `ray.get` of many refs starts every READ before waiting on any.

Choices, each measured on this project's 2-core CPU host (docs/performance.md
has the figures):

* One agent per process, created on first use, with NIXL's progress thread
  off: idle, that thread spins a core. The producer side is progressed
  instead by a thread that calls `get_new_notifs()` every 10 ms, and only
  while this process exports objects; otherwise it sleeps on a condition.
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
"""

from __future__ import annotations

import ctypes
import os
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Final

from rdt_jax import _compat, _dlpack
from rdt_jax._metadata import DlpackTransportMetadata
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
#: A READ still in progress after this many seconds is posted again, once.
STALL_RETRY_S: Final = 5.0


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
  """

  agent_name: str | None = None
  agent_meta: bytes | None = None
  agent_version: int = 0
  dereg_epoch: int = 0
  addresses: list[int] = field(default_factory=list)
  device_ids: list[int] = field(default_factory=list)
  regions: list[int] = field(default_factory=list)

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


class _Poller:
  """Progresses an agent's target side while the process exports objects."""

  def __init__(self, agent: Any):
    self._agent = agent
    self._cond = threading.Condition()
    self._active = False
    self._thread = threading.Thread(target=self._run, name="rdt-jax-nixl-progress", daemon=True)
    self._thread.start()

  def set_active(self, active: bool) -> None:
    with self._cond:
      self._active = active
      self._cond.notify()

  def _run(self) -> None:
    while True:
      with self._cond:
        while not self._active:
          self._cond.wait()
      try:
        self._agent.get_new_notifs()
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
  staging: Any = None  # the pooled staging buffer of packed chunks
  holds: list[Any] = field(default_factory=list)  # see _dlpack.hold_buffer
  regions: list[Any] = field(default_factory=list)  # pooled device staging regions


@dataclass
class _Receive:
  xfer: Any
  keys: list[tuple]
  remote: str | None
  post: Any = None  # re-creates and posts the READ (for a retry after a stall)
  retried: bool = False


class NixlTransport(DlpackTransport):
  """The `jax_nixl` transport: one-sided NIXL READs of cpu and cuda memory."""

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
    self._remote_meta: dict[str, bytes] = {}  # the latest metadata seen per agent

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
        self._poller = _Poller(self._agent)
        _dlpack.host_pool.add_eviction_listener(self._on_pool_eviction)
        _dlpack.device_pool.add_eviction_listener(self._on_device_pool_eviction)
      return self._agent

  def _register(self, pointer: int, nbytes: int, device: _dlpack.Device, pooled: bool = False) -> tuple:
    """Registers a region (or takes another reference to its registration)."""
    key = (pointer, nbytes, device.kind, device.index)
    with self._lock:
      reg = self._registrations.get(key)
      if reg is None:
        handle = self.agent().register_memory(
            [(pointer, nbytes, device.index, "")], mem_type=_mem_type(device.kind)
        )
        reg = self._registrations[key] = _Registration(handle, 0)
        self._version += 1
      if not pooled:
        reg.count += 1
      return key

  def _unregister(self, keys: list[tuple]) -> None:
    with self._lock:
      for key in keys:
        reg = self._registrations.get(key)
        if reg is None or reg.count == 0:
          continue
        reg.count -= 1
        if reg.count == 0:
          del self._registrations[key]
          self._agent.deregister_memory(reg.handle)
          self._dereg_epoch += 1  # consumers drop the region from their view

  def _on_pool_eviction(self, pointer: int, nbytes: int) -> None:
    with self._lock:
      key = (pointer, nbytes, "cpu", 0)
      reg = self._registrations.pop(key, None)
      if reg is not None:
        self._agent.deregister_memory(reg.handle)

  def _on_device_pool_eviction(self, pointer: int, nbytes: int, device: _dlpack.Device) -> None:
    with self._lock:
      reg = self._registrations.pop((pointer, nbytes, device.kind, device.index), None)
      if reg is not None:
        self._agent.deregister_memory(reg.handle)

  def num_registrations(self) -> int:
    """Registered regions outside the host buffer pool (0 when idle)."""
    with self._lock:
      return sum(1 for r in self._registrations.values() if r.count > 0)

  def num_pooled_registrations(self) -> int:
    """Registered pooled buffers, kept for reuse (bounded by the pool)."""
    with self._lock:
      return sum(1 for r in self._registrations.values() if r.count == 0)

  def num_objects(self) -> int:
    """How many RDT objects this process currently exports."""
    with self._lock:
      return len(self._exports)

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
    with self._lock:
      self._exports[obj_id] = export
      meta.agent_version = self._version
      meta.dereg_epoch = self._dereg_epoch
      assert self._poller is not None
      self._poller.set_active(True)
    meta.agent_name = agent.name
    meta.agent_meta = self._agent_metadata()

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
    staging = _dlpack.host_pool.acquire(total)
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
    export.staging = staging
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
    with self._lock:
      export = self._exports.pop(obj_id, None)
      if not self._exports and self._poller is not None:
        self._poller.set_active(False)
    if export is not None:
      self._unregister(export.keys)
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
    self._refresh_remote(remote, meta)
    keys = self._register_destinations(dests)
    try:
      local, remote_descs = coalesce(*read_pairs(dests, meta))
      self._count(descriptors=len(local))
      local_mem = _mem_type(dests[0].device.kind)
      remote_mem = _mem_type(meta.tensor_device or "cpu")

      def post() -> Any:
        xfer = agent.initialize_xfer(
            "READ",
            agent.get_xfer_descs(local, mem_type=local_mem),
            agent.get_xfer_descs(remote_descs, mem_type=remote_mem),
            remote,
            b"",
        )
        if agent.transfer(xfer) == "ERR":
          agent.release_xfer_handle(xfer)
          raise RuntimeError("NIXL transfer entered the error state on start.")
        return xfer

      receive = _Receive(post(), keys, remote, post)
    except BaseException:
      self._unregister(keys)
      self._done_with(remote)
      raise
    return receive

  def _refresh_remote(self, remote: str, meta: NixlTransportMetadata) -> None:
    """Brings this agent's view of `remote` up to what `meta` needs.

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
      self._remote_meta[remote] = meta.agent_meta
      if view is None:
        self._agent.add_remote_agent(meta.agent_meta)
        self._views[remote] = (meta.agent_version, meta.dereg_epoch, now)
      elif (
          meta.dereg_epoch > view[1]
          and now - view[2] >= VIEW_REBUILD_INTERVAL_S
          and not self._inflight.get(remote)
      ):
        self._agent.remove_remote_agent(remote)
        self._agent.add_remote_agent(meta.agent_meta)
        self._views[remote] = (meta.agent_version, meta.dereg_epoch, now)
      elif meta.agent_version > view[0]:
        self._agent.add_remote_agent(meta.agent_meta)
        self._views[remote] = (meta.agent_version, view[1], view[2])
      self._inflight[remote] = self._inflight.get(remote, 0) + 1

  def _done_with(self, remote: str) -> None:
    with self._lock:
      self._inflight[remote] -= 1

  def _register_destinations(self, dests: list[Destination]) -> list[tuple]:
    """Registers the receive memory, each distinct allocation once.

    Pooled buffers stay registered for reuse and need no release; the keys
    of the others are returned for `finish_receive`.
    """
    keys = []
    for (pointer, nbytes), device, pooled in {(d.region, _host_or(d.device), d.pooled): None for d in dests}:
      key = self._register(pointer, nbytes, device, pooled=pooled)
      if not pooled:
        keys.append(key)
    return keys

  def wait_receive(self, handle: _Receive | None, obj_id: str, timeout: float) -> None:
    if handle is None:
      return
    agent = self._agent
    started = time.monotonic()
    deadline = None if timeout is None or timeout < 0 else started + timeout
    sleep = 0.0
    while True:
      state = agent.check_xfer_state(handle.xfer)
      if state == "DONE":
        return
      if state == "ERR":
        raise RuntimeError(f"NIXL READ of object {obj_id} entered the error state.")
      if self.aborted(obj_id):
        raise RuntimeError(f"NIXL READ of object {obj_id} was aborted.")
      now = time.monotonic()
      if deadline is not None and now >= deadline:
        raise TimeoutError(f"NIXL READ of object {obj_id} timed out after {timeout}s.")
      if now - started > STALL_RETRY_S and not handle.retried:
        self._retry(handle)
        started = time.monotonic()
      # Spin briefly for small transfers, then back off to 1 ms sleeps.
      sleep = min(0.001, sleep + 0.00005)
      time.sleep(sleep)

  def _retry(self, handle: _Receive) -> None:
    """Posts a stalled READ again, once, over a fresh connection if possible.

    Rarely, when several new consumers connect to one producer at once (seen
    on a 2-core host), a READ stays in progress forever. Reposting it, after rebuilding the view of the producer
    when no other transfer from it is in flight, turns that hang into a delay.
    """
    assert handle.remote is not None
    handle.retried = True
    self._agent.release_xfer_handle(handle.xfer)
    with self._lock:
      if self._inflight.get(handle.remote) == 1 and handle.remote in self._views:
        meta_version, epoch, _ = self._views[handle.remote]
        self._agent.remove_remote_agent(handle.remote)
        self._agent.add_remote_agent(self._remote_meta[handle.remote])
        self._views[handle.remote] = (meta_version, epoch, time.monotonic())
    handle.xfer = handle.post()

  def finish_receive(self, handle: _Receive | None) -> None:
    if handle is None or handle.remote is None:
      return
    self._agent.release_xfer_handle(handle.xfer)
    self._unregister(handle.keys)
    handle.keys = []
    self._done_with(handle.remote)
    handle.remote = None

  def cancel_receive(self, handle: _Receive | None) -> None:
    if handle is None or handle.remote is None:
      return
    try:
      self._agent.release_xfer_handle(handle.xfer)
    except Exception:  # NIXL refuses to release a handle still in flight
      pass
    self._unregister(handle.keys)
    handle.keys = []
    self._done_with(handle.remote)
    handle.remote = None
