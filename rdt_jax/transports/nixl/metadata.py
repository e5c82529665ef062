"""`jax_nixl` metadata: what a consumer needs to read a producer's object,
and the checks it passes on arrival (`NixlTransportMetadata.validate`)."""

from __future__ import annotations

import zlib
from array import array
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rdt_jax import _limits
from rdt_jax._metadata import DlpackTransportMetadata, MetadataError, check_int, check_ints

__all__ = ["NixlTransportMetadata", "region_starts", "where_digest"]


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
    device_dereg_epoch: bumped whenever the producer deregisters device
      memory (pooled regions included), whose addresses its allocator hands
      out again: a consumer rebuilds its view before loading metadata that
      may hold such an address under a new registration.
    addresses: the address of each non-empty chunk, in leaf order.
    device_ids: the device index of each non-empty chunk.
    regions: for each non-empty chunk, the registered region it lies in
      (chunks of one region may be read with one descriptor): `-1 - k` for
      the k-th non-empty chunk registered in place (the region is the chunk),
      a non-negative id for a staging region listed in `spans`.
    spans: `(region id, start address, nbytes)` of each staging region the
      chunks use, as the producer registered it: every chunk of such a region
      lies inside it, and every read stays inside a chunk.
    ipc: with `RDT_JAX_NIXL_CUDA_IPC` on in the producer, `(region id,
      handle, offset)` of each device region the chunks lie in (a staging
      region of `spans`, or a chunk read in place, `-1 - k`): the CUDA IPC
      handle of the allocation holding it and where in that allocation the
      region starts. Empty otherwise, or where CUDA IPC cannot map one of
      them (then a consumer reads the object through NIXL).
    digest: a CRC-32 the producer takes of every other field here and of
      each chunk's size (`where_digest`): a consumer refuses metadata whose
      read locations, serials or agent changed on the way (an accidental
      change; no defence against a forger: docs/faults.md).
    serial: the object's export serial on its producer (never reused).
    live: the producer's live export serials when this object was exported,
      as sorted, disjoint inclusive (first, last) ranges: a consumer that
      holds metadata of an object whose serial is missing from the newest
      `live` it has seen from that producer knows the object was freed, and
      refuses to read it. Pickled as packed integers.
  """

  agent_name: str | None = None
  agent_meta: bytes | None = None
  agent_version: int = 0
  dereg_epoch: int = 0
  device_dereg_epoch: int = 0
  addresses: list[int] = field(default_factory=list)
  device_ids: list[int] = field(default_factory=list)
  regions: list[int] = field(default_factory=list)
  spans: list[tuple[int, int, int]] = field(default_factory=list)
  ipc: list[tuple[int, bytes, int]] = field(default_factory=list)
  digest: int = 0
  serial: int = 0
  live: list[tuple[int, int]] = field(default_factory=list)

  __eq__ = object.__eq__
  __hash__ = object.__hash__

  def __getstate__(self) -> dict[str, Any]:
    state = super().__getstate__()
    live = state.get("live")
    if type(live) is list and live and all(type(r) is tuple and len(r) == 2 for r in live):
      try:
        state["live"] = _LiveRanges.encode(live)
      except (OverflowError, TypeError, ValueError):
        pass  # pickled as it is; refused on arrival
    return state

  def __setstate__(self, state: dict[str, Any]) -> None:
    live = state.get("live")
    if type(live) is _LiveRanges:
      state["live"] = live.decode()
    super().__setstate__(state)

  def validate(self, obj_id: str) -> None:
    """Consumer: refuses metadata that cannot name readable memory, before
    any byte moves (extends `DlpackTransportMetadata.validate`).

    Beyond the leaves (for an object not sent in band): a named agent with
    metadata, one address, device
    index and region per non-empty chunk, each chunk inside user space and
    inside the staging region it names (`spans`), in-place chunks naming
    themselves, non-negative counters, and `live` ranges that are sorted,
    disjoint and hold this object's own serial.

    Raises:
      MetadataError: naming the object and the field.
    """
    super().validate(obj_id)
    if self.inline is not None:
      return  # sent in band: nothing was exported, nothing is read from the producer
    if not isinstance(self.agent_name, str) or not self.agent_name:
      raise MetadataError(obj_id, "agent_name", f"is {self.agent_name!r}, not the producer's agent name")
    if type(self.agent_meta) is not bytes or not self.agent_meta:
      raise MetadataError(obj_id, "agent_meta", f"is a {type(self.agent_meta).__name__}, not the agent's bytes")
    for name in ("agent_version", "dereg_epoch", "device_dereg_epoch"):
      check_int(obj_id, name, getattr(self, name), 0, 1 << 63)
    sizes = [c.nbytes for leaf in self.leaves for c in leaf.chunks if c.nbytes]
    hosts = [leaf.device == "cpu" for leaf in self.leaves for c in leaf.chunks if c.nbytes]
    n = len(sizes)
    addresses = check_ints(obj_id, "addresses", self.addresses, n, 1, _limits.NIXL_ADDRESS_LIMIT)
    device_ids = check_ints(obj_id, "device_ids", self.device_ids, n, 0, _limits.NIXL_MAX_DEVICES)
    regions = check_ints(obj_id, "regions", self.regions, n, -n, _limits.NIXL_MAX_DEVICES + 1)
    spans = self._spans(obj_id)
    self._check_chunks(obj_id, addresses, sizes, device_ids, regions, hosts, spans)
    self._check_ipc(obj_id, regions, hosts, spans)
    serial = check_int(obj_id, "serial", self.serial, 1, 1 << 63)
    self._check_live(obj_id, serial)
    if self.digest != where_digest(self, sizes):
      raise MetadataError(
          obj_id, "digest", "does not match the addresses, regions, serials or agent: they changed after export"
      )

  @staticmethod
  def _check_chunks(
      obj_id: str, addresses: list[int], sizes: list[int], device_ids: list[int], regions: list[int],
      hosts: list[bool], spans: dict[int, tuple[int, int]],
  ) -> None:
    """Each chunk inside user space, on device 0 if in host memory, and in
    the region it names: itself (`-1 - k`) or a listed staging region.
    Checked on arrays (a thousand chunks cost microseconds); the first
    offending chunk is then named; a few chunks are checked without arrays
    (building them costs more than the loop)."""
    if len(addresses) <= _limits.NIXL_CHECK_LOOP_MAX:
      for k, (address, n, device, r, host) in enumerate(zip(addresses, sizes, device_ids, regions, hosts)):
        span = spans.get(r) if r >= 0 else None
        if not (
            address + n <= _limits.NIXL_ADDRESS_LIMIT and not (host and device)
            and (r == -1 - k if r < 0 else span is not None and span[0] <= address and address + n <= sum(span))
        ):
          break
      else:
        return
    a, size, region = (np.array(v, np.int64) for v in (addresses, sizes, regions))
    end = a + size
    index = np.arange(len(a))
    bad = (end > _limits.NIXL_ADDRESS_LIMIT) | (np.array(hosts, bool) & (np.array(device_ids, np.int64) != 0))
    bad |= (region < 0) & (region != -1 - index)
    known = np.zeros(len(a), bool)
    for rid, (start, nbytes) in spans.items():
      mine = region == rid
      known |= mine
      bad |= mine & ((a < start) | (end > start + nbytes))
    bad |= (region >= 0) & ~known
    if not bad.any():
      return
    k = int(np.flatnonzero(bad)[0])
    address, n, device, r = addresses[k], sizes[k], device_ids[k], regions[k]
    if address + n > _limits.NIXL_ADDRESS_LIMIT:
      raise MetadataError(obj_id, f"addresses[{k}]", f"{address:#x} + {n} bytes ends outside user space")
    if hosts[k] and device:
      raise MetadataError(obj_id, f"device_ids[{k}]", f"is {device} for a chunk in host memory (0 expected)")
    if r < 0:
      raise MetadataError(obj_id, f"regions[{k}]", f"is {r}: a chunk read in place names itself ({-1 - k})")
    if r not in spans:
      raise MetadataError(obj_id, f"regions[{k}]", f"names staging region {r}, which spans does not list")
    start, nbytes = spans[r]
    raise MetadataError(
        obj_id, f"addresses[{k}]",
        f"{address:#x} + {n} bytes lies outside staging region {r} ({start:#x} + {nbytes} bytes, as registered)",
    )

  def _spans(self, obj_id: str) -> dict[int, tuple[int, int]]:
    spans = self.spans
    if type(spans) is not list:
      raise MetadataError(obj_id, "spans", f"is a {type(spans).__name__}, not a list")
    out: dict[int, tuple[int, int]] = {}
    for i, span in enumerate(spans):
      if (
          type(span) is not tuple or len(span) != 3 or not all(type(v) is int for v in span)
          or span[0] < 0 or span[0] in out
          or not (0 < span[1] and 0 < span[2] and span[1] + span[2] <= _limits.NIXL_ADDRESS_LIMIT)
      ):
        raise MetadataError(obj_id, f"spans[{i}]", f"is {span!r}, not a (region id, start, nbytes) in user space")
      out[span[0]] = (span[1], span[2])
    return out

  def _check_ipc(
      self, obj_id: str, regions: list[int], hosts: list[bool], spans: dict[int, tuple[int, int]]
  ) -> None:
    """Each `ipc` entry names, once, a region of device memory the chunks
    use, with a handle of CUDA's size and an offset inside user space."""
    ipc = self.ipc
    if type(ipc) is not list:
      raise MetadataError(obj_id, "ipc", f"is a {type(ipc).__name__}, not a list")
    device_regions = {r for r, host in zip(regions, hosts) if not host}
    seen: set[int] = set()
    for i, entry in enumerate(ipc):
      if not (
          type(entry) is tuple and len(entry) == 3 and type(entry[0]) is int and type(entry[1]) is bytes
          and len(entry[1]) == _limits.CUDA_IPC_HANDLE_BYTES and type(entry[2]) is int
          and 0 <= entry[2] < _limits.NIXL_ADDRESS_LIMIT
      ):
        raise MetadataError(obj_id, f"ipc[{i}]", "is not a (region id, 64-byte CUDA IPC handle, offset)")
      region = entry[0]
      if region in seen or region not in device_regions or (region >= 0 and region not in spans):
        raise MetadataError(
            obj_id, f"ipc[{i}]", f"names region {region}, which is not a device region of the object's chunks "
            "(or is named twice)",
        )
      seen.add(region)

  def _check_live(self, obj_id: str, serial: int) -> None:
    live = self.live
    if type(live) is not list or not live:
      raise MetadataError(obj_id, "live", f"is {live!r}, not a non-empty list of serial ranges")
    last = 0
    for i, r in enumerate(live):
      if type(r) is not tuple or len(r) != 2 or not all(type(v) is int for v in r) or not last < r[0] <= r[1]:
        raise MetadataError(obj_id, f"live[{i}]", f"is {r!r}: ranges must be sorted, disjoint and positive")
      last = r[1]
    if not any(a <= serial <= b for a, b in live):
      raise MetadataError(obj_id, "live", f"does not hold the object's own serial {serial}")


def region_starts(meta: NixlTransportMetadata) -> dict[int, int]:
  """The first byte, in the producer, of every region the object's chunks
  lie in: each staging region of `meta.spans` (0 for host memory, `1 +
  device index` on a device), and each chunk read in place (`-1 - k`, the
  chunk itself)."""
  starts = {region: start for region, start, _ in meta.spans}
  starts.update((region, address) for address, region in zip(meta.addresses, meta.regions) if region < 0)
  return starts


def where_digest(meta: NixlTransportMetadata, sizes: list[int]) -> int:
  """CRC-32 of what tells a consumer where and whether to read an object
  (`NixlTransportMetadata.digest`): every field this class adds but the
  digest itself, the producer's `origin` (whose memory a node-local read
  copies), and the size of each non-empty chunk (`sizes`)."""
  values = array("q", meta.addresses)
  values.extend(meta.device_ids)
  values.extend(meta.regions)
  values.extend(sizes)
  for span in meta.spans:
    values.extend(span)
  for r in meta.live:
    values.extend(r)
  for region, _, offset in meta.ipc:
    values.extend((region, offset))
  values.extend((meta.serial, meta.agent_version, meta.dereg_epoch, meta.device_dereg_epoch))
  crc = zlib.crc32(values)
  crc = zlib.crc32(f"{meta.agent_name}\x00{meta.origin}".encode(), crc)
  for _, handle, _ in meta.ipc:
    crc = zlib.crc32(handle, crc)
  return zlib.crc32(meta.agent_meta or b"", crc)


class _LiveRanges:
  """`live`'s pickled form, whichever of two is smaller: the range bounds as
  packed int64s (16 bytes a range), or one bit per serial from the first
  live serial to the last (a serial's bit set if it is live). Ranges never
  outnumber live objects, so `live` pickles to at most
  min(16 x live objects, (last - first) / 8) bytes, however objects were freed.
  """

  __slots__ = ("data", "first", "kind")

  def __init__(self, kind: str, first: int, data: bytes):
    self.kind, self.first, self.data = kind, first, data

  def __reduce__(self) -> tuple[Any, ...]:
    return _LiveRanges, (self.kind, self.first, self.data)

  @staticmethod
  def encode(live: list[tuple[int, int]]) -> _LiveRanges:
    first, span = live[0][0], live[-1][1] - live[0][0] + 1
    if 0 < span <= 16 * 8 * len(live) and span < 1 << 32:
      bits = np.zeros(span, np.bool_)
      for a, b in live:
        bits[a - first : b - first + 1] = True
      return _LiveRanges("bits", first, np.packbits(bits).tobytes())
    return _LiveRanges("ranges", 0, array("q", [v for r in live for v in r]).tobytes())

  def decode(self) -> Any:
    """The ranges, or the raw form (refused by `validate`) if it does not
    decode."""
    if type(self.data) is not bytes or type(self.first) is not int:
      return self
    if self.kind == "bits":
      bits = np.unpackbits(np.frombuffer(self.data, np.uint8)).astype(np.int8)
      edges = np.diff(np.concatenate(([0], bits, [0])))
      starts, ends = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1) - 1
      first = self.first
      return [(first + int(a), first + int(b)) for a, b in zip(starts, ends)]
    if self.kind != "ranges" or len(self.data) % 16:
      return self
    values = array("q")
    values.frombytes(self.data)
    it = iter(values.tolist())
    return list(zip(it, it))
