"""jax_nixl's CUDA IPC read of plain returns (`RDT_JAX_NIXL_CUDA_IPC`, opt-in),
where no GPU is: every decision of the path, driven with a fake driver.

The driver's three calls (`_memory.ipc_export`, `ipc_mapped`, `ipc_copy`) are
replaced by fakes over host memory standing in for device memory, so the
addresses the path computes are checked by the bytes that arrive: which
strategy reads an object, what the producer exports, how a region is mapped
(once per allocation, not in the producer's own process), how the copies are
grouped, and every refusal that sends the object to NIXL instead. The copies
themselves run on a GPU in tests/gpu/test_gpu_backends.py.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

import numpy as np
import pytest

from rdt_jax import _limits, _memory, _process
from rdt_jax._dlpack import ChunkSpec, Device, LeafSpec
from rdt_jax._metadata import MetadataError
from rdt_jax.transports._destinations import Destination
from rdt_jax.transports.nixl import export
from rdt_jax.transports.nixl.metadata import NixlTransportMetadata, region_starts, where_digest
from rdt_jax.transports.nixl.read import CudaIpcRead, ReadRefused
from rdt_jax.transports.nixl.staleness import FreedObjects

CUDA = Device("cuda", 0)
#: The chunks of the object: two packed into staging region 1, one read in place.
SIZES = (256, 512, 1024)
STAGING_HANDLE, IN_PLACE_HANDLE = b"S" * 64, b"C" * 64
#: Where each region starts in its (fake) allocation.
STAGING_OFFSET, IN_PLACE_OFFSET = 4096, 128


class Producer:
  """A producer's memory (host memory standing in for device memory) and
  the metadata of the object it exports."""

  def __init__(self, origin=None, ipc: bool = True):
    rng = np.random.default_rng(0)
    self.staging = rng.integers(0, 255, 1024, np.uint8)
    self.in_place = rng.integers(0, 255, SIZES[2], np.uint8)
    staging = self.staging.ctypes.data
    self.allocations = {
        STAGING_HANDLE: staging - STAGING_OFFSET, IN_PLACE_HANDLE: self.in_place.ctypes.data - IN_PLACE_OFFSET,
    }
    leaves = [
        LeafSpec(f"['x{i}']", (n // 4,), np.dtype("float32"), "torch", "cuda", (ChunkSpec((n // 4,), n),))
        for i, n in enumerate(SIZES)
    ]
    here = _process.identity()
    assert here is not None
    self.meta = NixlTransportMetadata(
        tensor_meta=[(leaf.shape, leaf.dtype) for leaf in leaves], tensor_device="cuda", leaves=leaves,
        agent_name="producer", agent_meta=b"m", addresses=[staging, staging + 256, self.in_place.ctypes.data],
        device_ids=[0, 0, 0], regions=[1, 1, -3], spans=[(1, staging, self.staging.nbytes)], serial=1,
        live=[(1, 1)],
        ipc=[(-3, IN_PLACE_HANDLE, IN_PLACE_OFFSET), (1, STAGING_HANDLE, STAGING_OFFSET)] if ipc else [],
    )
    self.meta.origin = origin if origin is not None else (*here[:2], here[2] + 1, here[3])
    self.seal()

  def seal(self) -> None:
    self.meta.digest = where_digest(self.meta, list(SIZES))

  def chunk(self, i: int) -> np.ndarray:
    return np.concatenate([self.staging[:256], self.staging[256:768], self.in_place])[
        sum(SIZES[:i]) : sum(SIZES[: i + 1])
    ]


class Driver:
  """Fakes of the CUDA driver calls, over a producer's host memory."""

  def __init__(
      self, producer: Producer, monkeypatch: pytest.MonkeyPatch, refuse: bool = False, fail_copy: bool = False
  ):
    self.producer = producer
    self.opened: list[tuple[bytes, int]] = []
    self.copies: list[tuple[int, list[tuple[int, int, int]]]] = []
    self.refuse, self.fail_copy = refuse, fail_copy
    monkeypatch.setattr(_memory, "ipc_mapped", self.mapped)
    monkeypatch.setattr(_memory, "ipc_copy", self.copy)

  @contextlib.contextmanager
  def mapped(self, handle: bytes, device: int) -> Iterator[int]:
    if self.refuse:
      raise _memory.IpcError("cuIpcOpenMemHandle failed with CUDA error 201 (CUDA_ERROR_INVALID_CONTEXT)")
    self.opened.append((handle, device))
    yield self.producer.allocations[handle]

  def copy(self, runs: list[tuple[int, int, int]], device: int) -> None:
    if self.fail_copy:
      raise _memory.IpcError("cuMemcpyDtoDAsync of 256 bytes failed with CUDA error 700 (CUDA_ERROR_ILLEGAL_ADDRESS)")
    self.copies.append((device, list(runs)))
    for dst, src, n in runs:
      np.ctypeslib.as_array((np.ctypeslib.ctypes.c_uint8 * n).from_address(dst))[:] = np.ctypeslib.as_array(
          (np.ctypeslib.ctypes.c_uint8 * n).from_address(src)
      )


def destinations(device: Device = CUDA) -> tuple[list[Destination], np.ndarray]:
  """One receive buffer (host memory standing in for device memory) with a
  destination per chunk, each at a 64-byte aligned offset."""
  buffer = np.zeros(sum(_memory.aligned(n) for n in SIZES), np.uint8)
  base, out, offset = buffer.ctypes.data, [], 0
  for i, n in enumerate(SIZES):
    out.append(Destination(base + offset, n, device, buffer, (base, buffer.nbytes), source=i))
    offset += _memory.aligned(n)
  return out, buffer


def received(buffer: np.ndarray, i: int) -> np.ndarray:
  start = sum(_memory.aligned(n) for n in SIZES[:i])
  return buffer[start : start + SIZES[i]]


class Counts:
  def __init__(self) -> None:
    self.counts: dict[str, int] = {}

  def __call__(self, **counts: int) -> None:
    for k, v in counts.items():
      self.counts[k] = self.counts.get(k, 0) + v


@pytest.fixture
def ipc_on(monkeypatch):
  monkeypatch.setenv("RDT_JAX_NIXL_CUDA_IPC", "1")


def strategy() -> tuple[CudaIpcRead, Counts]:
  counts = Counts()
  return CudaIpcRead(FreedObjects(lambda: None), counts), counts


# ---- which strategy


def test_the_path_is_off_by_default(monkeypatch):
  monkeypatch.delenv("RDT_JAX_NIXL_CUDA_IPC", raising=False)
  assert not CudaIpcRead.applies(Producer().meta, {"device"})


def test_it_applies_to_device_memory_of_a_producer_on_this_host_only(ipc_on):
  meta = Producer().meta
  assert CudaIpcRead.applies(meta, {"device"})
  assert not CudaIpcRead.applies(meta, {"host"})
  assert not CudaIpcRead.applies(meta, {"device", "host"})
  other_host = Producer(origin=("another-boot-id", 1, 2, 3)).meta
  assert not CudaIpcRead.applies(other_host, {"device"})
  host_object = Producer().meta
  host_object.tensor_device = "cpu"
  assert not CudaIpcRead.applies(host_object, {"device"})


def test_the_transport_picks_it_reads_synchronously_and_names_the_route(ipc_on, monkeypatch):
  pytest.importorskip("nixl_cu12", reason="the transport's construction needs no agent, but its module imports NIXL's")
  from rdt_jax.transports.nixl.transport import NixlTransport

  t = NixlTransport()
  producer = Producer()
  dests, buffer = destinations()
  driver = Driver(producer, monkeypatch)
  monkeypatch.setattr(t, "agent", lambda: None)
  assert t._read_strategy(producer.meta, dests) is t._cuda_ipc_read
  assert t.receives_synchronously(producer.meta, {"device"})
  assert t.start_receive("obj", producer.meta, None, dests) is None
  assert t.route_of(None) == "CUDA IPC"
  assert all(np.array_equal(received(buffer, i), producer.chunk(i)) for i in range(3))
  assert t.receive_stats()["cuda_ipc"] == 1 and len(driver.copies) == 1
  # Without the producer's handles the read will be NIXL's: caller memory is staged for it.
  assert not t.receives_synchronously(Producer(ipc=False).meta, {"device"})


def test_a_refusal_reads_through_nixl_and_is_counted(ipc_on, monkeypatch):
  pytest.importorskip("nixl_cu12", reason="the transport's module imports NIXL's")
  from rdt_jax.transports.nixl.transport import NixlTransport

  t = NixlTransport()
  producer = Producer()
  dests, _ = destinations()
  Driver(producer, monkeypatch, refuse=True)
  monkeypatch.setattr(t, "agent", lambda: None)
  posted = object()
  monkeypatch.setattr(t._nixl_read, "start", lambda obj_id, meta, dests: posted)
  assert t.start_receive("obj", producer.meta, None, dests) is posted
  assert t.route_of(posted) == "NIXL READ"
  stats = t.receive_stats()
  assert stats["cuda_ipc_fallback"] == 1 and stats["cuda_ipc"] == 0


# ---- the consumer's read


def test_each_region_is_mapped_once_and_the_object_copied_on_the_consumer_s_device(ipc_on, monkeypatch):
  producer = Producer()
  driver = Driver(producer, monkeypatch)
  s, counts = strategy()
  dests, buffer = destinations(Device("cuda", 1))
  assert s.start("obj", producer.meta, dests) is None
  for i in range(3):
    assert np.array_equal(received(buffer, i), producer.chunk(i)), f"chunk {i}"
  assert sorted(driver.opened) == [(IN_PLACE_HANDLE, 1), (STAGING_HANDLE, 1)]
  # The two packed chunks follow each other on both sides: one copy moves both.
  assert [(device, len(runs)) for device, runs in driver.copies] == [(1, 2)]
  assert counts.counts == {"descriptors": 2, "cuda_ipc": 1}


def test_the_producer_s_own_memory_is_read_without_a_mapping(ipc_on, monkeypatch):
  producer = Producer(origin=_process.identity())
  driver = Driver(producer, monkeypatch)
  s, _ = strategy()
  dests, buffer = destinations()
  s.start("obj", producer.meta, dests)
  assert driver.opened == []
  assert all(np.array_equal(received(buffer, i), producer.chunk(i)) for i in range(3))


def test_a_part_of_a_chunk_is_read_at_its_offset(ipc_on, monkeypatch):
  producer = Producer()
  Driver(producer, monkeypatch)
  s, _ = strategy()
  out = np.zeros(100, np.uint8)
  dest = Destination(out.ctypes.data, 100, CUDA, out, (out.ctypes.data, 100), source=2, source_offset=300, part=True)
  s.start("obj", producer.meta, [dest])
  assert np.array_equal(out, producer.in_place[300:400])


def test_a_missing_handle_refuses_before_any_mapping(ipc_on, monkeypatch):
  producer = Producer(ipc=False)
  driver = Driver(producer, monkeypatch)
  s, counts = strategy()
  dests, buffer = destinations()
  with pytest.raises(ReadRefused, match="no CUDA IPC handle for region -3"):
    s.start("obj", producer.meta, dests)
  assert driver.opened == [] and driver.copies == [] and not buffer.any()
  assert counts.counts == {"cuda_ipc_fallback": 1}


def test_a_mapping_cuda_refuses_writes_nothing(ipc_on, monkeypatch, caplog):
  producer = Producer()
  driver = Driver(producer, monkeypatch, refuse=True)
  s, counts = strategy()
  dests, buffer = destinations()
  for _ in range(2):
    with pytest.raises(ReadRefused, match="CUDA_ERROR_INVALID_CONTEXT"):
      s.start("obj", producer.meta, dests)
  assert driver.copies == [] and not buffer.any()
  assert counts.counts == {"cuda_ipc_fallback": 2}
  assert len([r for r in caplog.records if "not CUDA IPC" in r.getMessage()]) == 1  # warned once


def test_a_failed_copy_is_an_error_not_a_fallback(ipc_on, monkeypatch):
  producer = Producer()
  Driver(producer, monkeypatch, fail_copy=True)
  s, counts = strategy()
  dests, _ = destinations()
  with pytest.raises(RuntimeError, match=r"CUDA IPC copy of object obj from pid .*CUDA_ERROR_ILLEGAL_ADDRESS"):
    s.start("obj", producer.meta, dests)
  assert "cuda_ipc" not in counts.counts


def test_an_object_its_producer_freed_is_refused_before_any_mapping(ipc_on, monkeypatch):
  producer = Producer()
  driver = Driver(producer, monkeypatch)
  s, _ = strategy()
  later = Producer()
  later.meta.serial, later.meta.live = 2, [(2, 2)]  # object 1 is gone
  later.seal()
  s.start("later", later.meta, destinations()[0])
  driver.opened.clear()
  with pytest.raises(RuntimeError, match="freed"):
    s.start("obj", producer.meta, destinations()[0])
  assert driver.opened == []


def test_a_read_outside_what_the_producer_registered_is_refused(ipc_on, monkeypatch):
  producer = Producer()
  driver = Driver(producer, monkeypatch)
  s, _ = strategy()
  producer.meta.spans = [(1, producer.staging.ctypes.data, 768)]  # staging region cut short: chunk 1 still inside
  producer.meta.addresses[1] = producer.staging.ctypes.data + 700  # chunk 1 now runs past it
  producer.seal()
  with pytest.raises(MetadataError):
    producer.meta.validate("obj")
  with pytest.raises(MetadataError, match="outside every region"):
    s.start("obj", producer.meta, destinations()[0])
  assert driver.opened == []


# ---- what the producer exports


def test_the_producer_exports_each_device_region_once_in_region_order(monkeypatch):
  producer = Producer(ipc=False)
  calls: list[tuple[int, int]] = []

  def ipc_export(pointer: int, device: int) -> tuple[bytes, int]:
    calls.append((pointer, device))
    return bytes([len(calls)]) * 64, 8 * len(calls)

  monkeypatch.setattr(_memory, "ipc_export", ipc_export)
  chunks = [(a, n, CUDA) for a, n in zip(producer.meta.addresses, SIZES)]
  got = export.ipc_handles(producer.meta, chunks)
  assert calls == [(producer.in_place.ctypes.data, 0), (producer.staging.ctypes.data, 0)]
  assert got == [(-3, b"\x01" * 64, 8), (1, b"\x02" * 64, 16)]
  producer.meta.ipc = got
  producer.seal()
  producer.meta.validate("obj")


def test_host_regions_get_no_handle(monkeypatch):
  meta = NixlTransportMetadata(
      tensor_meta=[], tensor_device="cpu", addresses=[1 << 40, 1 << 41], regions=[0, -2],
      spans=[(0, 1 << 40, 4096)],
  )
  monkeypatch.setattr(_memory, "ipc_export", lambda pointer, device: pytest.fail("exported host memory"))
  assert export.ipc_handles(meta, [(1 << 40, 64, Device("cpu")), (1 << 41, 1 << 20, Device("cpu"))]) == []


def test_memory_cuda_ipc_cannot_export_sends_no_handle_and_warns_once(monkeypatch):
  producer = Producer(ipc=False)
  monkeypatch.setattr(export, "_warned_not_exported", [])

  def refuse(pointer: int, device: int) -> tuple[bytes, int]:
    raise _memory.IpcError("cuIpcGetMemHandle failed with CUDA error 1 (CUDA_ERROR_INVALID_VALUE)")

  monkeypatch.setattr(_memory, "ipc_export", refuse)
  chunks = [(a, n, CUDA) for a, n in zip(producer.meta.addresses, SIZES)]
  with pytest.warns(RuntimeWarning, match="cannot export a device chunk read in place .*CUDA_ERROR_INVALID_VALUE"):
    assert export.ipc_handles(producer.meta, chunks) == []
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    assert export.ipc_handles(producer.meta, chunks) == []


# ---- the metadata


@pytest.mark.parametrize(
    "ipc, field",
    [
        ({"not": "a list"}, "ipc"),
        ([(1, b"S" * 16, 0)], r"ipc\[0\]"),
        ([(1, STAGING_HANDLE, -1)], r"ipc\[0\]"),
        ([(1, STAGING_HANDLE, _limits.NIXL_ADDRESS_LIMIT)], r"ipc\[0\]"),
        ([(1, "S" * 64, 0)], r"ipc\[0\]"),
        ([(7, STAGING_HANDLE, 0)], r"ipc\[0\]"),
        ([(1, STAGING_HANDLE, 0), (1, STAGING_HANDLE, 0)], r"ipc\[1\]"),
        ([(-1, STAGING_HANDLE, 0)], r"ipc\[0\]"),  # chunk 0 lies in region 1, not in place
    ],
)
def test_malformed_handles_are_refused_naming_the_field(ipc, field):
  producer = Producer()
  producer.meta.ipc = ipc
  with pytest.raises(MetadataError, match=field):
    producer.meta.validate("obj")


def test_a_handle_of_host_memory_is_refused():
  producer = Producer()
  producer.meta.leaves = [leaf._replace(device="cpu") for leaf in producer.meta.leaves]
  producer.meta.tensor_device = "cpu"
  producer.seal()
  with pytest.raises(MetadataError, match=r"ipc\[0\]"):
    producer.meta.validate("obj")


def test_handles_are_covered_by_the_digest():
  producer = Producer()
  producer.meta.validate("obj")
  producer.meta.ipc = [(-3, IN_PLACE_HANDLE, IN_PLACE_OFFSET), (1, IN_PLACE_HANDLE, STAGING_OFFSET)]
  with pytest.raises(MetadataError, match="digest"):
    producer.meta.validate("obj")
  producer.meta.ipc = [(-3, IN_PLACE_HANDLE, IN_PLACE_OFFSET), (1, STAGING_HANDLE, 0)]
  with pytest.raises(MetadataError, match="digest"):
    producer.meta.validate("obj")


def test_handles_survive_pickling():
  import pickle

  meta = pickle.loads(pickle.dumps(Producer().meta))
  assert meta.ipc == [(-3, IN_PLACE_HANDLE, IN_PLACE_OFFSET), (1, STAGING_HANDLE, STAGING_OFFSET)]
  meta.validate("obj")


def test_region_starts_name_staging_regions_and_chunks_read_in_place():
  producer = Producer()
  assert region_starts(producer.meta) == {1: producer.staging.ctypes.data, -3: producer.in_place.ctypes.data}
