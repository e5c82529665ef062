"""The producer's side: making an object's chunks readable, until Ray frees it.

For each non-empty chunk of an object, in leaf order, `Exports.export` puts in
the metadata the address a consumer reads, its device index, and the
registered region it lies in:

* small host chunks (up to `PACK_MAX_CHUNK` bytes) are copied into one pooled
  staging buffer (region id 0), so an object of a thousand small leaves costs
  one registration and, on the consumer, one descriptor;
* cuda chunks likewise into one pooled staging region per device (region
  id `1 + device index`, copied on the device; needs torch): all of an
  object's chunks on a device while they fit in a region the pool keeps,
  else the small ones (`device_chunks_to_copy` says why);
* every other chunk is read in place (region id `-1 - chunk index`): its
  registration is cached per buffer and shared across objects, and the
  array's buffer is held (`_dlpack.hold_buffer`) so it is not donated while
  the object lives.

Each export gets a serial, and the metadata lists the serials live at that
moment (`staleness` explains what a consumer does with them), kept as ranges
that each export and release update in place (`LiveSerials`): an export
copies them, never sorts. `release` undoes an export when Ray frees the
object.
"""

from __future__ import annotations

import bisect
import ctypes
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rdt_jax import _dlpack, _faults, _limits, _memory, _process, _settings
from rdt_jax.transports._destinations import memory_kind
from rdt_jax.transports.nixl.metadata import NixlTransportMetadata, region_starts, where_digest
from rdt_jax.transports.nixl.registrations import Key, Registrations, nixl_memory

__all__ = ["Exports", "LiveSerials", "device_chunks_to_copy", "ipc_handles"]


#: A non-empty chunk to export: (pointer, nbytes, device as NIXL sees it).
_Chunk = tuple[int, int, _dlpack.Device]


class LiveSerials:
  """The export serials live now, as sorted, disjoint inclusive ranges.

  Serials are handed out in increasing order, so `add` extends or appends
  the last range (O(1)); `remove` shrinks or splits one range (a binary
  search). There are never more ranges than live serials, so the list is
  bounded by the objects exported now, however they were freed; the
  metadata's pickled form is bounded further (`NixlTransportMetadata.live`).
  """

  def __init__(self) -> None:
    self._starts: list[int] = []
    self._ends: list[int] = []

  def __len__(self) -> int:
    """The number of ranges."""
    return len(self._starts)

  def add(self, serial: int) -> None:
    """Adds `serial`, larger than every serial added before."""
    if self._ends and self._ends[-1] + 1 == serial:
      self._ends[-1] = serial
    else:
      self._starts.append(serial)
      self._ends.append(serial)

  def remove(self, serial: int) -> None:
    """Removes `serial` (nothing if it is not live)."""
    i = bisect.bisect_right(self._starts, serial) - 1
    if i < 0 or serial > self._ends[i]:
      return
    start, end = self._starts[i], self._ends[i]
    if start == end:
      del self._starts[i], self._ends[i]
    elif serial == start:
      self._starts[i] = serial + 1
    elif serial == end:
      self._ends[i] = serial - 1
    else:
      self._ends[i] = serial - 1
      self._starts.insert(i + 1, serial + 1)
      self._ends.insert(i + 1, end)

  def ranges(self) -> list[tuple[int, int]]:
    """The ranges, as `NixlTransportMetadata.live` holds them."""
    return list(zip(self._starts, self._ends))


@dataclass
class _Export:
  """What the producer holds for one object until Ray frees it."""

  keys: list[Key] = field(default_factory=list)
  serial: int = 0
  staging: Any = None  # the pooled host staging buffer of packed chunks
  holds: list[Any] = field(default_factory=list)  # see _dlpack.hold_buffer
  regions: list[Any] = field(default_factory=list)  # pooled device staging regions


class Exports:
  """The objects this process exports (see the module docstring).

  Args:
    agent: returns the agent (created on first use).
    registrations: the agent's registration cache.
    changed: called (no lock held) when the set of exported objects changes.
  """

  def __init__(
      self,
      agent: Callable[[], Any],
      registrations: Registrations,
      changed: Callable[[], None],
  ):
    self._agent = agent
    self._lock = threading.Lock()
    self._registrations = registrations
    self._changed = changed
    self._exports: dict[str, _Export] = {}
    self._serial = 0  # the last export serial handed out
    self._live = LiveSerials()
    self._agent_meta: tuple[tuple[int, int, int], bytes] | None = None

  def __len__(self) -> int:
    """Objects exported now."""
    return len(self._exports)

  def export(self, obj_id: str, leaves: list[_dlpack.DescribedLeaf], meta: NixlTransportMetadata) -> None:
    """Makes every non-empty chunk of `leaves` readable and fills `meta`'s
    NIXL fields. On failure, nothing stays registered or held."""
    agent = self._agent()
    chunks = _chunks(leaves)
    arrays = [
        array
        for leaf in leaves
        for chunk, array in zip(leaf.spec.chunks, leaf.arrays)
        if chunk.nbytes
    ]
    paths = [leaf.spec.path for leaf in leaves for chunk in leaf.spec.chunks if chunk.nbytes]
    export = _Export()
    purpose = f"for object {obj_id}"
    try:
      packed = self._pack_host(chunks, export, meta, purpose) | self._pack_device(chunks, export, meta, purpose)
      for i, (pointer, nbytes, device) in enumerate(chunks):
        if i in packed:  # a copy: later changes to the array cannot reach it
          address, region = packed[i]
        else:  # read in place: keep the buffer from being donated meanwhile
          if memory_kind(device) == "device":
            _warn_if_not_ipc(pointer, nbytes, paths[i])
          export.keys.append(
              self._registrations.register(pointer, nbytes, device, purpose=f"{purpose}, leaf {paths[i]}")
          )
          export.holds.append(_dlpack.hold_buffer(arrays[i]) if i < len(arrays) else None)
          address, region = pointer, -1 - i
        meta.addresses.append(address)
        meta.device_ids.append(device.index)
        meta.regions.append(region)
      if _settings.value("RDT_JAX_NIXL_CUDA_IPC"):
        meta.ipc = ipc_handles(meta, chunks)
      if _faults.ON:
        _faults.hit("nixl.export")
      epochs, agent_meta = self._agent_metadata()
    except BaseException:
      self._undo(export)  # no consumer has seen these registrations
      raise
    with self._lock:
      self._serial += 1
      export.serial = meta.serial = self._serial
      self._exports[obj_id] = export
      self._live.add(export.serial)
      meta.live = self._live.ranges()
    # The epochs the agent metadata was fetched at, which cover this
    # object's registrations: a consumer's view loaded from this metadata
    # is extended when a later object needs a newer registration.
    meta.agent_version, meta.dereg_epoch, meta.device_dereg_epoch = epochs
    self._changed()
    meta.agent_name = agent.name
    meta.agent_meta = agent_meta
    meta.origin = _process.identity()
    meta.digest = where_digest(meta, [n for _, n, _ in chunks])

  def release(self, obj_id: str) -> None:
    """Deregisters what `obj_id` registered; its memory may then be reused.

    One-sided READs give the producer no notice, so a READ a consumer gave up
    (timeout, abort) may still be reading when Ray frees the object. Its bytes
    are never delivered: the consumer's fetch has already failed, and its
    receive memory is parked until NIXL ends the READ. A consumer that posts
    after the release is refused (`staleness`), or fails with
    NIXL_ERR_NOT_FOUND once its view of this agent is rebuilt (`views`).
    """
    with self._lock:
      export = self._exports.pop(obj_id, None)
      if export is not None:
        self._live.remove(export.serial)
    self._changed()
    if export is not None:
      self._undo(export)

  def _undo(self, export: _Export) -> None:
    self._registrations.unregister(export.keys, export)
    for region in export.regions:
      region.release()

  def _agent_metadata(self) -> tuple[tuple[int, int, int], bytes]:
    """This agent's metadata and the registration epochs it covers
    (`Registrations.epochs`, read before it was fetched); fetched again only
    after the registrations changed, outside the lock."""
    key = self._registrations.epochs()
    with self._lock:
      cached = self._agent_meta
    if cached is not None and cached[0] == key:
      return cached
    fetched = (key, self._agent().get_agent_metadata())
    with self._lock:
      if self._agent_meta is None or self._agent_meta[0] <= key:  # epochs only grow
        self._agent_meta = fetched
    return fetched

  def _pack_host(
      self, chunks: list[_Chunk], export: _Export, meta: NixlTransportMetadata, purpose: str
  ) -> dict[int, tuple[int, int]]:
    """Copies small host chunks into one pooled staging buffer, and lists the
    registered region in `meta.spans`.

    Returns, per packed chunk index, its address in the staging buffer and
    the staging buffer's region id (0).
    """
    small = [i for i, (_, n, d) in enumerate(chunks) if memory_kind(d) == "host" and n <= _limits.PACK_MAX_CHUNK]
    if not small:
      return {}
    total = sum(_memory.aligned(chunks[i][1]) for i in small)
    staging = export.staging = _memory.host_pool.acquire(total)
    base = _memory.host_pointer(staging)
    region = _memory.host_pool.region_of(staging)
    host = _dlpack.Device("cpu")
    purpose = f"{purpose} (the staging buffer of its small chunks)"
    if region is not None:
      self._registrations.register(region[0], region[1], host, pooled=True, purpose=purpose)
    else:
      export.keys.append(self._registrations.register(base, total, host, purpose=purpose))
      region = (base, total)
    meta.spans.append((0, region[0], region[1]))
    packed, offset = {}, 0
    for i in small:
      pointer, nbytes, _ = chunks[i]
      ctypes.memmove(base + offset, pointer, nbytes)
      packed[i] = (base + offset, 0)
      offset += _memory.aligned(nbytes)
    return packed

  def _pack_device(
      self, chunks: list[_Chunk], export: _Export, meta: NixlTransportMetadata, purpose: str
  ) -> dict[int, tuple[int, int]]:
    """Copies cuda chunks (`device_chunks_to_copy`) into one pooled staging
    region per device (device-to-device copies, waited for once per device),
    each listed in `meta.spans`.

    Needs torch here (the copies are torch byte copies); without it every
    chunk is read in place. Region ids are `1 + device index`.
    """
    if not _dlpack.importable("torch"):
      return {}
    by_device: dict[_dlpack.Device, list[int]] = {}
    for i, (_, _, d) in enumerate(chunks):
      if memory_kind(d) == "device":
        by_device.setdefault(d, []).append(i)
    packed = {}
    for device, indices in by_device.items():
      small = device_chunks_to_copy([chunks[i][1] for i in indices], _memory.device_pool.max_bytes)
      small = [indices[j] for j in small]
      if not small:
        continue
      total = sum(_memory.aligned(chunks[i][1]) for i in small)
      region = _memory.device_pool.acquire(total, device, "torch")
      export.regions.append(region)
      key = self._registrations.register(
          region.pointer, region.nbytes, device, pooled=region.kept, purpose=f"{purpose} (device staging region)"
      )
      if not region.kept:
        export.keys.append(key)
      meta.spans.append((1 + device.index, region.pointer, region.nbytes))
      offset = 0
      for i in small:
        pointer, nbytes, _ = chunks[i]
        _memory.copy_bytes(region.pointer + offset, pointer, nbytes, device)
        packed[i] = (region.pointer + offset, 1 + device.index)
        offset += _memory.aligned(nbytes)
      _memory.wait_for_copies(device)
    return packed


def device_chunks_to_copy(sizes: list[int], pool_bytes: int) -> list[int]:
  """Which of an object's chunks on one device (their `sizes`, in order) are
  copied into a pooled staging region at export (indices into `sizes`).

  All of them, while they fit in one region the device pool keeps
  (`pool_bytes`, `RDT_JAX_DEVICE_POOL_BYTES`): that region stays registered
  and is reused, so freeing the object deregisters nothing and no consumer
  reconnects to this producer; and it comes from torch's allocator, whose
  memory CUDA IPC can map (XLA's cannot, so UCX would emulate a READ of a
  jax array in place through host memory and TCP). A device-to-device copy
  costs well under a millisecond per 256 MiB. Otherwise only the chunks up
  to `PACK_MAX_CHUNK` are copied, and the others read in place.
  """
  if sum(_memory.aligned(n) for n in sizes) <= pool_bytes:
    return list(range(len(sizes)))
  return [i for i, n in enumerate(sizes) if n <= _limits.PACK_MAX_CHUNK]


def ipc_handles(meta: NixlTransportMetadata, chunks: list[_Chunk]) -> list[tuple[int, bytes, int]]:
  """`NixlTransportMetadata.ipc` of an exported object (`RDT_JAX_NIXL_CUDA_IPC`
  on): `(region id, handle, offset)` of each device region its chunks lie
  in, a device staging region (`meta.spans`) or a chunk read in place, in
  region order. All or nothing: where CUDA IPC cannot export one of them
  (memory of XLA's allocator, torch with expandable segments; no driver),
  none, with a warning once per process saying why, and a consumer reads
  the object through NIXL."""
  out = []
  for region, start in sorted(region_starts(meta).items()):
    if region >= 0:  # a staging region: 0 in host memory, 1 + device index on a device
      if region == 0:
        continue
      index = region - 1
    else:  # the in-place chunk -1 - region
      device = chunks[-1 - region][2]
      if memory_kind(device) != "device":
        continue
      index = device.index
    try:
      handle, offset = _memory.ipc_export(start, index)
    except _memory.IpcError as e:
      _warn_not_exported(e, region)
      return []
    out.append((region, handle, offset))
  return out


_warned_not_exported: list[bool] = []


def _warn_not_exported(error: Exception, region: int) -> None:
  if _warned_not_exported:
    return
  _warned_not_exported.append(True)
  what = "its device staging region" if region >= 0 else "a device chunk read in place (XLA's memory)"
  warnings.warn(
      f"rdt_jax (jax_nixl): RDT_JAX_NIXL_CUDA_IPC is on, but CUDA IPC cannot export {what}: {error}. Consumers "
      "on this host read such objects through NIXL. Objects whose device bytes fit one region of the device pool "
      "(RDT_JAX_DEVICE_POOL_BYTES) are copied into memory of torch's allocator, which CUDA IPC can map, unless "
      "torch runs with expandable segments.",
      RuntimeWarning, stacklevel=3,
  )


_warned_not_ipc = False


def _warn_if_not_ipc(pointer: int, nbytes: int, path: str) -> None:
  """Warns once per process when a device chunk read in place lies in memory
  CUDA IPC cannot map (XLA's): a READ of it from this host is then emulated
  through host memory and TCP (about 0.5 GB/s)."""
  global _warned_not_ipc
  if _warned_not_ipc or _memory.ipc_capable(pointer) is not False:
    return
  _warned_not_ipc = True
  if not _dlpack.importable("torch"):
    why, fix = ("because torch is not installed in the producer (its pooled regions come from torch's "
                "allocator)", "Install torch in the producer's environment")
  else:
    why, fix = (f"because the object's device bytes exceed one region of the device pool "
                f"(RDT_JAX_DEVICE_POOL_BYTES={_memory.device_pool.max_bytes})",
                "Set RDT_JAX_DEVICE_POOL_BYTES above the object's size in the producer")
  warnings.warn(
      f"rdt_jax (jax_nixl): leaf {path} ({nbytes} bytes) is read in place from device memory that CUDA IPC "
      f"cannot map (XLA's allocator), {why}: a READ of it from this host is emulated through host memory and "
      f"TCP, about 0.5 GB/s. {fix}, so its device bytes are copied into memory CUDA IPC can map.",
      RuntimeWarning, stacklevel=2,
  )


def _chunks(leaves: list[_dlpack.DescribedLeaf]) -> list[_Chunk]:
  """The non-empty chunks of `leaves`, in leaf order, each with its device as
  NIXL sees it (one `Device` object per device)."""
  devices: dict[tuple[str, int], _dlpack.Device] = {}

  def device_of(kind: str, index: int) -> _dlpack.Device:
    d = devices.get((kind, index))
    if d is None:
      d = devices[(kind, index)] = nixl_memory(_dlpack.Device(kind, index))[1]  # type: ignore[arg-type]
    return d

  return [
      (pointer, chunk.nbytes, device_of(leaf.spec.device, index))
      for leaf in leaves
      for pointer, chunk, index in zip(leaf.pointers, leaf.spec.chunks, leaf.device_indices)
      if chunk.nbytes
  ]
