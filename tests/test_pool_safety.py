"""Memory a transfer may still touch is never reused or freed: the pools'
eviction order, stranded memory, stream ordering before reuse and before
writes into caller memory (CUDA steps checked with recording stand-ins for
`torch.cuda` where this host has no GPU; they run for real in tests/gpu).
"""

from __future__ import annotations

import gc
import logging
import threading
import weakref

import numpy as np
import pytest
import torch

from rdt_jax import _dlpack, _faults, _memory
from rdt_jax._dlpack import ChunkSpec, Device, LeafSpec, _torch
from rdt_jax._dlpack._devices import CPU
from rdt_jax._memory import _cuda
from rdt_jax._memory._regions import FrameworkAllocator, RegionPool

CUDA0, CUDA1 = Device("cuda", 0), Device("cuda", 1)


class RecordingCuda:
  """Stands in for `torch.cuda`'s synchronization calls on a host without CUDA."""

  def __init__(self):
    self.synchronized: list[int] = []

  def synchronize(self, index):
    self.synchronized.append(index)


@pytest.fixture
def cuda_calls(monkeypatch):
  fake = RecordingCuda()
  monkeypatch.setattr(torch.cuda, "synchronize", fake.synchronize)
  return fake.synchronized


def test_settle_reuse_drains_the_device_and_skips_host_memory(cuda_calls):
  _cuda.settle_reuse(CPU)
  assert cuda_calls == []
  _cuda.settle_reuse(CUDA1)
  assert cuda_calls == [1]


def test_settle_targets_drains_each_cuda_device_once(cuda_calls):
  _cuda.settle_targets([CPU, CUDA1, CUDA0, CUDA1, CPU])
  assert sorted(cuda_calls) == [0, 1]


def test_framework_allocator_drains_the_device_before_reuse(cuda_calls):
  pool = RegionPool(FrameworkAllocator(), max_bytes=1 << 20)
  r = pool.acquire(4096, CPU, "torch")
  r.release()
  assert pool.acquire(4096, CPU, "torch") is r
  assert cuda_calls == []  # host memory: nothing to drain

  class CountingAllocator(FrameworkAllocator):
    def reuse(self, root, device):
      super().reuse(root, CUDA0)  # as if the region were on cuda:0

  pool = RegionPool(CountingAllocator(), max_bytes=1 << 20)
  r = pool.acquire(4096, CPU, "torch")
  r.release()
  assert cuda_calls == []  # a fresh region is settled at allocation, not here
  assert pool.acquire(4096, CPU, "torch") is r
  assert cuda_calls == [0]


def test_a_region_whose_drain_fails_is_released_not_lost():
  class Failing(FrameworkAllocator):
    def reuse(self, root, device):
      raise RuntimeError("CUDA error: an illegal memory access was encountered")

  pool = RegionPool(Failing(), max_bytes=1 << 20)
  r = pool.acquire(1024, CPU, "torch")
  r.release()
  with pytest.raises(RuntimeError, match="illegal memory access"):
    pool.acquire(1024, CPU, "torch")
  assert not r.held and pool.quarantined() == 0


def test_plan_drains_devices_of_in_place_targets_before_the_transfer(cuda_calls, monkeypatch):
  from rdt_jax.transports._plan import ReceivePlan

  monkeypatch.setattr(_dlpack, "check_device", lambda d, path="": d)
  x = np.arange(4, dtype=np.float32)
  leaf = LeafSpec("['w']", x.shape, x.dtype, "torch", "cpu", (ChunkSpec(x.shape, x.nbytes),))
  plan = ReceivePlan([leaf], "torch")
  plan.allocate()
  assert cuda_calls == []  # host memory only
  plan.quarantine()
  plan = ReceivePlan([leaf], "torch")
  plan.plans[0].target = torch.zeros(4)  # an in-place target ...
  plan.plans[0].device = CUDA1  # ... on cuda:1, as a CUDA parameter would be
  plan.allocate()
  assert cuda_calls == [1]
  plan.quarantine()


def test_use_count_probe_holds_here():
  assert _torch.storage_use_count_works()


def test_untrusted_use_count_means_never_reuse(monkeypatch):
  monkeypatch.setattr(_torch, "storage_use_count_works", lambda: False)
  pool = RegionPool(FrameworkAllocator(), max_bytes=1 << 20)
  r = pool.acquire(512, CPU, "torch")
  r.release()
  assert pool.acquire(512, CPU, "torch") is not r


# --------------------------------------------------------------------------
# Eviction: listeners run while the memory is alive; a failing one strands it.


def test_a_fresh_host_buffer_is_in_use_before_another_thread_can_see_it():
  # Two threads that each allocate a fresh buffer must never share one: the
  # second acquire runs in the window after the first put its new buffer in
  # the pool and released the lock, before it returned (where the listeners
  # of evicted buffers are told).
  pool = _memory.HostBufferPool(max_bytes=1 << 20)
  other: dict[str, np.ndarray] = {}
  tell = pool._notify

  def notify(evicted, listeners):
    if "started" not in other:  # the first acquire only
      other["started"] = True
      t = threading.Thread(target=lambda: other.setdefault("view", pool.acquire(4096)))
      t.start()
      t.join(timeout=30)
    tell(evicted, listeners)

  pool._notify = notify  # type: ignore[method-assign]
  first = pool.acquire(4096)
  assert _memory.host_pointer(first) != _memory.host_pointer(other["view"])
  first[:] = 1
  other["view"][:] = 2
  assert (first == 1).all()


def test_host_pool_tells_listeners_while_the_buffer_is_alive():
  pool = _memory.HostBufferPool(max_bytes=1 << 20)
  seen = []

  def listener(pointer, nbytes, keepalive):
    assert _memory.host_pointer(keepalive) == pointer and keepalive.nbytes == nbytes
    seen.append(weakref.ref(keepalive.base))

  pool.add_eviction_listener(listener)
  buf = pool.acquire(4096)
  del buf
  pool.clear()
  assert len(seen) == 1
  gc.collect()
  assert seen[0]() is None  # freed once every listener returned


def test_host_pool_strands_a_buffer_a_listener_failed_on(caplog):
  pool = _memory.HostBufferPool(max_bytes=1 << 20)
  kept = []

  def failing(pointer, nbytes, keepalive):
    kept.append(weakref.ref(keepalive.base))
    raise RuntimeError("deregistration failed")

  pool.add_eviction_listener(failing)
  pool.acquire(4096)
  with caplog.at_level(logging.WARNING):
    pool.clear()  # does not raise into the caller
  assert "eviction listener failed" in caplog.text
  gc.collect()
  assert pool.stranded() == 1 and kept[0]() is not None  # never freed
  assert pool.pooled_bytes() == 0  # and never handed out again


def test_region_pool_strands_a_region_a_listener_failed_on():
  pool = RegionPool(max_bytes=1 << 20)
  pool.add_eviction_listener(lambda p, n, d, keepalive: (_ for _ in ()).throw(RuntimeError("boom")))
  r = pool.acquire(1024, CPU, "torch")
  r.release()
  pool.clear()  # does not raise
  assert pool.stranded() == 1 and r not in pool._regions
  assert pool.acquire(1024, CPU, "torch") is not r


def test_failed_deregistration_on_eviction_keeps_the_memory_until_a_retry():
  pytest.importorskip("nixl_cu12", reason="NIXL is not installed")
  from rdt_jax.transports.nixl.agent import create_agent
  from rdt_jax.transports.nixl.registrations import Registrations

  agent = create_agent()
  regs = Registrations(lambda: agent, lambda: None)
  pool = _memory.HostBufferPool(max_bytes=1 << 20)
  pool.add_eviction_listener(regs.on_host_eviction)
  buf = pool.acquire(1 << 16)
  regs.register(_memory.host_pointer(buf), buf.nbytes, CPU, pooled=True)
  base = weakref.ref(buf.base)
  del buf
  _faults.configure("nixl.deregister:fail*1")
  try:
    pool.clear()
  finally:
    _faults.configure(None)
  gc.collect()
  assert regs.has_stuck() and base() is not None  # still registered: still alive
  regs.retry_stuck()
  gc.collect()
  assert not regs.has_stuck() and base() is None


# --------------------------------------------------------------------------
# Steady state: the previous object's buffer is reused, never a new one.


def test_back_to_back_objects_reuse_one_host_buffer_with_the_collector_idle():
  """jax releases the buffer behind a zero-copy array only at the next
  garbage collection; the pool runs those releases before growing, so two
  objects received back to back share one buffer (no fresh allocation,
  page faults and registration in the steady state)."""
  import jax

  from rdt_jax.transports._plan import ReceivePlan

  x = np.arange(1 << 16, dtype=np.float32)
  specs = [LeafSpec(f"['l{i}']", x.shape, x.dtype, "jax", "cpu", (ChunkSpec(x.shape, x.nbytes),)) for i in range(8)]
  pool = _memory.HostBufferPool(max_bytes=1 << 30)
  seen = set()
  was_enabled = gc.isenabled()
  gc.disable()
  try:
    for _ in range(4):
      plan = ReceivePlan(specs, "source")
      with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_memory, "host_pool", pool)
        plan.allocate()
      leaves = plan.build()
      assert all(isinstance(leaf, jax.Array) for leaf in leaves)
      seen.add(_memory.host_pointer(plan.host) if plan.host is not None else None)
      del leaves, plan
  finally:
    if was_enabled:
      gc.enable()
  assert pool.counters()["buffers"] == 1 and len(seen) == 1


def test_one_read_into_host_and_device_memory_is_refused_by_name():
  """A READ has one memory type for all its local descriptors: a cuda object
  with a host target for one leaf (or the reverse) is refused, never read with
  device pointers described as host memory."""
  pytest.importorskip("nixl_cu12", reason="NIXL is not installed")
  from rdt_jax.transports._destinations import Destination
  from rdt_jax.transports.nixl.read import _mem_type

  host = Destination(0x1000, 8, CPU, None, (0x1000, 8))
  device = Destination(0x2000, 8, CUDA0, None, (0x2000, 8))
  assert _mem_type([host, host], "obj") == "DRAM"
  assert _mem_type([device], "obj") == "VRAM"
  with pytest.raises(ValueError, match="object obj into host and device memory at once"):
    _mem_type([host, device], "obj")
