"""The consumer's read: three strategies behind one interface.

* `NixlRead`: one NIXL READ for the whole object, posted and left in flight
  (`ray.get` of many refs posts every READ before waiting on any); waited for,
  retired or parked by `inflight`.
* `NodeLocalRead`: a producer on this host whose memory and the consumer's are
  both host memory is read with `process_vm_readv` (`node_local`), in several
  threads for large objects; the bytes are in place when `start` returns. NIXL
  remains the path for device memory, other hosts, and processes the kernel
  does not let read each other.
* `CudaIpcRead` (opt-in, `RDT_JAX_NIXL_CUDA_IPC`): a producer on this host
  that put CUDA IPC handles of its device regions in the metadata
  (`export.ipc_handles`), read into device memory: each region is mapped
  once (`rdt_jax._memory.ipc_mapped`, kept per allocation) and the object
  copied with device-to-device copies on rdt_jax's own stream, ended when
  `start` returns. Where a handle is missing or cannot be mapped, nothing is
  read and NIXL reads the object (`cuda_ipc_fallback` in `receive_stats`).

A NIXL READ may still run after its fetch gave up (it is parked with its
memory, `inflight`), so it never reads into caller memory (`Destination.caller`:
`NixlRead.start` raises `StageCallerMemory`, and the fetch is planned again
with that memory staged in rdt_jax's own buffers); a node-local read has ended
when `start` returns or raises, so it reads into caller memory directly.

All call the same staleness check (`staleness.FreedObjects.check`) before
reading, and all read the same descriptor pairs (`read_pairs`, merged by
`coalesce`). `NixlTransport._read_strategy` picks one per object.
"""

from __future__ import annotations

import bisect
import contextlib
import logging
from collections.abc import Callable
from typing import Any, Protocol

from rdt_jax import _dlpack, _faults, _memory, _process, _settings
from rdt_jax import _node_local as node_local
from rdt_jax._metadata import MetadataError
from rdt_jax.transports._destinations import Destination, MemoryKind, StageCallerMemory, memory_kind
from rdt_jax.transports.nixl.agent import READ_NOTIF
from rdt_jax.transports.nixl.inflight import InFlight, PostedRead
from rdt_jax.transports.nixl.metadata import NixlTransportMetadata, region_starts
from rdt_jax.transports.nixl.registrations import Key, NixlError, Registrations, nixl_error, nixl_memory
from rdt_jax.transports.nixl.staleness import FreedObjects
from rdt_jax.transports.nixl.views import DeviceViewBusy, RemoteViews

__all__ = [
    "READ_FIX", "CudaIpcRead", "NixlRead", "NodeLocalRead", "ReadRefused", "ReadStrategy", "check_registered",
    "coalesce", "read_pairs",
]

logger = logging.getLogger(__name__)

#: What to do after a READ failed to load, prepare or post.
READ_FIX = (
    "The producer may have died, freed the object, or be unreachable from this process; "
    "fetch again while the ObjectRef is alive, and check the producing actor."
)
_LOAD_FIX = (
    "The producer's agent metadata could not be used: producer and consumer may run different "
    "NIXL versions, or the producer's host is unreachable; run one NIXL version everywhere."
)

#: A transfer descriptor: (address, nbytes, device index).
Descriptor = tuple[int, int, int]


class ReadRefused(Exception):
  """A strategy cannot read this object after all (nothing was read); the
  caller reads it with another."""


class ReadStrategy(Protocol):
  """How a consumer reads an object's chunks into its destinations."""

  def start(self, obj_id: str, meta: NixlTransportMetadata, dests: list[Destination]) -> PostedRead | None:
    """Checks staleness, then starts reading every destination's bytes.

    Returns the posted READ to wait for, or None if the bytes are already in
    place.

    Raises:
      ReadRefused: nothing was read; read with another strategy.
      RuntimeError: the object is stale, or the read failed.
    """
    ...


def coalesce(
    local: list[Descriptor],
    remote: list[Descriptor],
    regions: list[Any],
) -> tuple[list[Descriptor], list[Descriptor]]:
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
        and out_l[-1][0] + _memory.aligned(out_l[-1][1]) == la
        and out_r[-1][0] + _memory.aligned(out_r[-1][1]) == ra
    ):
      out_l[-1][1] = la + n - out_l[-1][0]
      out_r[-1][1] = ra + n - out_r[-1][0]
    else:
      out_l.append([la, n, ld])
      out_r.append([ra, n, rd])
    last_region = region
  return [(a, b, c) for a, b, c in out_l], [(a, b, c) for a, b, c in out_r]


def read_pairs(
    dests: list[Destination], meta: NixlTransportMetadata, obj_id: str = ""
) -> tuple[list[Descriptor], list[Descriptor], list[Any]]:
  """The (local, remote, region key) lists `coalesce` takes, one per
  non-empty destination: each reads `nbytes` at its source chunk's address
  plus `source_offset`. A byte run of a resharded leaf (`part`) gets a region
  key of its own: the bytes after it are not padding, so it never merges.

  Every read lies inside its source chunk, so inside memory the producer
  registered (`NixlTransportMetadata.validate` checked that each chunk lies
  in its region).

  Raises:
    MetadataError: for a destination that reads outside its source chunk,
      or names no non-empty chunk of `meta`.
  """
  # meta.addresses lists only non-empty chunks, in leaf order.
  sizes = [c.nbytes for leaf in meta.leaves for c in leaf.chunks if c.nbytes]
  slot: dict[int, int] = {}
  for i, c in enumerate(c for leaf in meta.leaves for c in leaf.chunks):
    if c.nbytes:
      slot[i] = len(slot)
  local, remote, regions = [], [], []
  device_index: dict[Any, int] = {}  # nixl_memory per device, once
  for n, d in enumerate(dests):
    k = slot.get(d.source, -1) if d.source >= 0 else n
    if not (
        0 <= k < min(len(sizes), len(meta.addresses))
        and 0 <= d.source_offset and d.source_offset + d.nbytes <= sizes[k]
    ):
      raise MetadataError(
          obj_id, f"chunks[{d.source}]",
          f"is read at offset {d.source_offset} for {d.nbytes} bytes, outside the chunk the producer registered",
      )
    index = device_index.get(d.device)
    if index is None:
      index = device_index[d.device] = nixl_memory(d.device)[1].index
    local.append((d.pointer, d.nbytes, index))
    remote.append((meta.addresses[k] + d.source_offset, d.nbytes, meta.device_ids[k]))
    regions.append((d.region, meta.regions[k], n) if d.part else (d.region, meta.regions[k]))
  return local, remote, regions


def check_registered(obj_id: str, meta: NixlTransportMetadata, remote: list[Descriptor]) -> None:
  """Refuses a read of the producer's memory outside what it registered for
  this object: its staging regions (`meta.spans`) and its chunks read in place.

  Raises:
    MetadataError: naming the object and the first descriptor outside.
  """
  extents = sorted(
      [(start, start + n) for _, start, n in meta.spans]
      + [
          (a, a + n)
          for a, n, r in zip(meta.addresses, (c.nbytes for leaf in meta.leaves for c in leaf.chunks if c.nbytes),
                             meta.regions)
          if r < 0
      ]
  )
  starts = [a for a, _ in extents]
  for k, (address, nbytes, _) in enumerate(remote):
    i = bisect.bisect_right(starts, address) - 1
    if i < 0 or address + nbytes > extents[i][1]:
      raise MetadataError(
          obj_id, "addresses", f"lead to a read of {nbytes} bytes at {address:#x} (descriptor {k}), outside "
          "every region the producer registered for the object",
      )


def _mem_type(dests: list[Destination], obj_id: str) -> str:
  """NIXL's memory type of every destination of one READ (one per list).

  Raises:
    ValueError: if the destinations mix host and device memory.
  """
  types = {nixl_memory(d.device)[0] for d in dests}
  if len(types) > 1:
    raise ValueError(
        f"jax_nixl reads object {obj_id} into host and device memory at once, which one "
        "READ cannot do: give every leaf's target (or target device) the same memory kind."
    )
  return types.pop()


class NixlRead:
  """The NIXL READ strategy: registers the receive memory, loads the
  producer's agent (`views`), posts one READ for the object."""

  def __init__(
      self,
      agent: Callable[[], Any],
      registrations: Registrations,
      views: RemoteViews,
      inflight: InFlight,
      freed: FreedObjects,
      count: Callable[..., None],
  ):
    self._agent = agent
    self._registrations = registrations
    self._views = views
    self._inflight = inflight
    self._freed = freed
    self._count = count

  def start(self, obj_id: str, meta: NixlTransportMetadata, dests: list[Destination]) -> PostedRead:
    """Posts one READ of the object (see `ReadStrategy.start`).

    Raises:
      StageCallerMemory: if a destination is caller memory (nothing was
        read): a READ given up in flight could land there later.
    """
    if any(d.caller for d in dests):
      raise StageCallerMemory(f"a NIXL READ of object {obj_id} would write into caller memory")
    self._freed.check(obj_id, meta)
    agent = self._agent()
    local_type = _mem_type(dests, obj_id)
    remote_type = nixl_memory(_dlpack.Device(meta.tensor_device or "cpu"))[0]  # type: ignore[arg-type]
    subject = f"object {obj_id} from producer agent {meta.agent_name}"
    try:
      remote = self._views.open_read(meta, device="VRAM" in (local_type, remote_type))
    except (MetadataError, NixlError):
      raise
    except DeviceViewBusy as e:
      raise NixlError(f"jax_nixl cannot read {subject} now: {e}", "load the agent metadata to read", obj_id) from None
    except Exception as e:
      raise nixl_error("load the agent metadata to read", subject, e, _LOAD_FIX, obj_id) from None
    keys: list[Key] = []
    try:
      keys = self._register_destinations(dests, keys, f"as receive memory of {subject}")
      local, remote_descs = coalesce(*read_pairs(dests, meta, obj_id))
      self._count(descriptors=len(local))
      try:
        xfer = agent.initialize_xfer(
            "READ",
            agent.get_xfer_descs(local, mem_type=local_type),
            agent.get_xfer_descs(remote_descs, mem_type=remote_type),
            remote,
            READ_NOTIF,  # wakes the producer's poll to its busy period (agent.py)
        )
      except Exception as e:
        raise nixl_error("prepare the READ of", subject, e, READ_FIX, obj_id) from None
    except BaseException:
      self._registrations.unregister(keys)
      self._views.mark_broken(remote)  # the producer may be unreachable: reconnect next time
      self._views.close_read(remote)
      raise
    read = PostedRead(xfer, keys, remote, obj_id, [d.keepalive for d in dests])
    try:
      if _faults.ON:
        _faults.hit("nixl.post")
      state = agent.transfer(xfer)
    except _faults.InjectedFault:
      self._inflight.retire_or_park(read)
      raise
    except BaseException as e:
      self._inflight.retire_or_park(read)  # never posted, or posted and failed
      if isinstance(e, Exception):
        raise nixl_error("post the READ of", subject, e, READ_FIX, obj_id) from None
      raise
    if state == "ERR":
      self._inflight.retire_or_park(read)
      raise NixlError(
          f"jax_nixl's READ of {subject} entered NIXL's error state when posted. {READ_FIX}", "read", obj_id
      )
    return read

  def _register_destinations(self, dests: list[Destination], keys: list[Key], purpose: str = "") -> list[Key]:
    """Registers the receive memory, each distinct allocation once.

    Pooled buffers stay registered for reuse and need no release; the keys
    of the others are appended to `keys` (as they are taken, so a failure
    half way leaves `keys` naming exactly what to undo) and returned.
    """
    for (pointer, nbytes), device, pooled in {(d.region, nixl_memory(d.device)[1], d.pooled): None for d in dests}:
      key = self._registrations.register(pointer, nbytes, device, pooled=pooled, purpose=purpose)
      if not pooled:
        keys.append(key)
    return keys


class NodeLocalRead:
  """The node-local strategy: `process_vm_readv` of a producer on this host."""

  def __init__(self, freed: FreedObjects, count: Callable[..., None]):
    self._freed = freed
    self._count = count

  @staticmethod
  def applies(meta: NixlTransportMetadata, kinds: set[MemoryKind]) -> bool:
    """True if this strategy may read the object into receive memory of
    `kinds`: host memory on both sides, a producer on this host, and
    node-local reads enabled here."""
    if meta.tensor_device is None or memory_kind(_dlpack.Device(meta.tensor_device)) != "host":  # type: ignore[arg-type]
      return False
    if kinds - {"host"}:
      return False
    return node_local.can_read(meta.origin)

  def start(self, obj_id: str, meta: NixlTransportMetadata, dests: list[Destination]) -> None:
    self._freed.check(obj_id, meta)
    local, remote = coalesce(*read_pairs(dests, meta, obj_id))
    check_registered(obj_id, meta, remote)  # process_vm_readv itself checks nothing
    if _faults.ON:
      _faults.hit("nixl.post")
    assert meta.origin is not None
    try:
      node_local.read(meta.origin, [(a, r, n) for (a, n, _), (r, _, _) in zip(local, remote)])
    except PermissionError:
      raise ReadRefused(f"the kernel refused a node-local read of pid {meta.origin[2]}") from None
    except OSError as e:
      raise RuntimeError(f"Node-local read of object {obj_id} from pid {meta.origin[2]} failed: {e}") from None
    self._count(descriptors=len(local), direct=1)


class CudaIpcRead:
  """The CUDA IPC strategy (opt-in): device memory of a producer on this
  host, mapped and copied on the device (see the module docstring)."""

  def __init__(self, freed: FreedObjects, count: Callable[..., None]):
    self._freed = freed
    self._count = count
    self._warned = False

  @staticmethod
  def applies(meta: NixlTransportMetadata, kinds: set[MemoryKind]) -> bool:
    """True if this strategy is the one to try for an object read into
    receive memory of `kinds`: `RDT_JAX_NIXL_CUDA_IPC` on here, the object's
    chunks and every destination in device memory, and a producer on this
    host. `start` may still refuse (no handles, a mapping CUDA refuses)."""
    if meta.tensor_device is None or memory_kind(_dlpack.Device(meta.tensor_device)) != "device":  # type: ignore[arg-type]
      return False
    if kinds != {"device"} or not _settings.value("RDT_JAX_NIXL_CUDA_IPC"):
      return False
    return _process.same_host(meta.origin)

  def start(self, obj_id: str, meta: NixlTransportMetadata, dests: list[Destination]) -> None:
    """Copies the object through CUDA IPC mappings (see `ReadStrategy.start`).

    Raises:
      ReadRefused: the producer sent no handle for a region read here, or
        CUDA refused a mapping (nothing was written); counted as
        `cuda_ipc_fallback`.
      RuntimeError: a copy failed after the mappings were made.
    """
    self._freed.check(obj_id, meta)
    local, remote, regions = read_pairs(dests, meta, obj_id)
    check_registered(obj_id, meta, remote)
    handles = {region: (handle, offset) for region, handle, offset in meta.ipc}
    missing = sorted({r[1] for r in regions} - handles.keys())
    if missing:
      self._refuse(obj_id, f"the producer sent no CUDA IPC handle for region {missing[0]} (see its warning)")
    starts = region_starts(meta)
    own = tuple(meta.origin or ()) == _process.identity()  # this process's own memory: no mapping
    with contextlib.ExitStack() as stack:
      bases: dict[tuple[int, int], int] = {}  # (region, local device) -> the region's first byte, here
      try:
        for (_, _, device), r in zip(local, regions):
          key = (r[1], device)
          if key not in bases:
            handle, offset = handles[r[1]]
            bases[key] = (starts[r[1]] if own
                          else stack.enter_context(_memory.ipc_mapped(handle, device)) + offset)
      except _memory.IpcError as e:
        self._refuse(obj_id, f"CUDA refused to map the producer's memory: {e}")
      mapped = [
          (bases[(r[1], device)] + address - starts[r[1]], n, device)
          for (address, n, _), (_, _, device), r in zip(remote, local, regions)
      ]
      local, mapped = coalesce(local, mapped, regions)
      if _faults.ON:
        _faults.hit("nixl.post")
      by_device: dict[int, list[tuple[int, int, int]]] = {}
      for (dst, n, device), (src, _, _) in zip(local, mapped):
        by_device.setdefault(device, []).append((dst, src, n))
      try:
        for device, runs in sorted(by_device.items()):
          _memory.ipc_copy(runs, device)
      except _memory.IpcError as e:
        raise RuntimeError(
            f"jax_nixl's CUDA IPC copy of object {obj_id} from pid {meta.origin and meta.origin[2]} failed: {e}"
        ) from None
    self._count(descriptors=len(local), cuda_ipc=1)

  def _refuse(self, obj_id: str, why: str) -> None:
    self._count(cuda_ipc_fallback=1)
    if not self._warned:
      self._warned = True
      logger.warning("rdt_jax: jax_nixl reads object %s through NIXL, not CUDA IPC: %s. Later objects that fall "
                     "back are counted as cuda_ipc_fallback in receive_stats().", obj_id, why)
    raise ReadRefused(why)

