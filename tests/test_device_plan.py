"""The receive plan's device branch, with host memory standing in for cuda.

`ReceivePlan` packs every cuda chunk of an object into one pooled region per
device. The pool takes its allocator as a parameter; here a stand-in gives
cpu torch tensors for `cuda:N`, so the plan's real code runs: layout,
destinations, one region per device, rebuild as jax/torch/numpy, release only
after success, reuse once the leaves are gone. (No Ray session; Ray is
imported by the transports package.)
"""

from __future__ import annotations

import ctypes
import gc

import jax
import numpy as np
import pytest
import torch

from rdt_jax import _dlpack, _layout, _limits, _memory
from rdt_jax._dlpack import ChunkSpec, Device, LeafSpec
from rdt_jax._memory._regions import RegionPool
from rdt_jax.transports._plan import ReceivePlan


class HostStandIn:
  """Host memory for every device: the pool's `Allocator` protocol."""

  def __init__(self):
    self.allocated: list[tuple[int, Device, str]] = []
    self.reused: list[tuple[int, Device]] = []

  def allocate(self, nbytes, device, source):
    t = torch.empty(nbytes, dtype=torch.uint8)
    self.allocated.append((nbytes, device, source))
    return t, int(t.data_ptr())

  def in_use(self, root):
    return _dlpack._torch.storage_use_count(root) > 1

  def view(self, root, offset, nbytes):
    return root[offset : offset + nbytes]

  def reuse(self, root, device):
    self.reused.append((int(root.data_ptr()), device))


@pytest.fixture
def pool(monkeypatch):
  allocator = HostStandIn()
  p = RegionPool(allocator, max_bytes=1 << 20)
  monkeypatch.setattr(_memory, "device_pool", p)
  # This host has no cuda device; the plan is told it has two.
  monkeypatch.setattr(_dlpack, "check_device", lambda d, path="": d)
  p.stand_in = allocator
  return p


def spec(path, x, framework="jax", device="cuda"):
  return LeafSpec(path, x.shape, x.dtype, framework, device, (ChunkSpec(x.shape, x.nbytes),))


def land(destinations, arrays):
  """What a backend does: the bytes of each leaf into its destination."""
  for d, x in zip(destinations, arrays):
    assert d.nbytes == x.nbytes
    if x.nbytes:
      ctypes.memmove(d.pointer, x.ctypes.data, x.nbytes)


def test_device_chunks_share_one_region_per_device(pool):
  xs = [np.arange(6, dtype=np.float32), np.zeros((0, 3), np.float32), np.array(7, np.int32),
        np.arange(4, dtype=np.float32).astype(_dlpack.np_dtype_from_name("bfloat16"))]
  specs = [spec(f"['{i}']", x, fw) for i, (x, fw) in enumerate(zip(xs, ["jax", "torch", "jax", "torch"]))]
  plan = ReceivePlan(specs, "source")
  dests = plan.allocate()
  assert len(plan.regions) == 1 and pool.stand_in.allocated == [(768, Device("cuda"), "jax")]
  region = plan.regions[0]
  assert {d.region for d in dests} == {(region.pointer, region.nbytes)} and all(d.pooled for d in dests)
  assert all((d.pointer - region.pointer) % _limits.DEVICE_ALIGNMENT == 0 for d in dests)
  land(dests, xs)
  leaves = plan.build()
  assert [_dlpack.framework_of(x) for x in leaves] == ["jax", "torch", "jax", "torch"]
  for x, leaf in zip(xs, leaves):
    np.testing.assert_array_equal(_dlpack.convert_leaf(leaf, "numpy"), x)
  assert leaves[0].unsafe_buffer_pointer() == region.pointer  # zero-copy
  assert not region.held  # released after the build
  again = ReceivePlan(specs, "source")
  again.allocate()
  assert again.regions[0] is not region  # its leaves are alive
  del leaves, leaf  # the loop variable holds the last leaf
  gc.collect()
  assert pool.stand_in.reused == []
  third = ReceivePlan(specs, "source")
  third.allocate()
  assert third.regions[0] is region
  assert pool.stand_in.reused == [(region.pointer, Device("cuda"))]  # streams drained first


def test_one_region_per_device(pool):
  a, b = np.ones(3, np.float32), np.full(5, 2, np.int32)
  plan = ReceivePlan([spec("['a']", a), spec("['b']", b)], "torch")
  plan.plans[1].device = Device("cuda", 1)  # as a target device would
  dests = plan.allocate()
  assert [r.device for r in plan.regions] == [Device("cuda", 0), Device("cuda", 1)]
  assert all(r.source == "torch" for r in plan.regions)
  land(dests, [a, b])
  out = plan.build()
  np.testing.assert_array_equal(out[1].numpy(), b)


def test_a_failed_transfer_region_returns_only_after_the_backend_lets_go(pool):
  x = np.ones(8, np.float32)
  plan = ReceivePlan([spec("['w']", x)], "jax")
  dests = plan.allocate()
  failed = plan.regions[0]
  backend_holds = [d.keepalive for d in dests]  # a READ given up in flight keeps these
  plan.quarantine()
  del plan, dests
  gc.collect()
  other = ReceivePlan([spec("['w']", x)], "jax")
  other.allocate()
  assert other.regions[0] is not failed  # the late READ could still write it
  assert pool.quarantined() == 1  # `other`'s, held for its transfer
  del backend_holds  # NIXL reported the READ ended: the backend drops its memory
  gc.collect()
  third = ReceivePlan([spec("['w']", x)], "jax")
  third.allocate()
  assert third.regions[0] is failed  # reused, not leaked


def test_a_failed_jax_copy_region_stays_quarantined(pool):
  x = np.ones(8, np.float32)
  region = pool.acquire(64, Device("cuda"), "jax-copy")
  assert not region.counts_users and region.lease(0, 32) is region.root
  plan = ReceivePlan([spec("['w']", x)], "jax")
  plan.regions.append(region)
  plan.quarantine()
  assert region.held  # nothing counts its users: never reused


def test_build_error_after_landing_releases(pool):
  x = np.ones(2, _dlpack.np_dtype_from_name("float8_e3m4"))
  plan = ReceivePlan([spec("['f']", x)], "torch")
  land(plan.allocate(), [x])
  with pytest.raises(_dlpack.UnsupportedLeafError, match=r"Leaf \['f'\] has dtype float8_e3m4"):
    plan.build()
  assert plan.regions == [] and pool.quarantined() == 0


def test_64_bit_leaf_as_jax_without_x64_is_refused_before_allocating(pool):
  x = np.ones(2, np.float64)
  assert not jax.config.jax_enable_x64
  with pytest.raises(_dlpack.UnsupportedLeafError, match="jax_enable_x64"):
    ReceivePlan([spec("['d']", x)], "jax")
  assert pool.stand_in.allocated == []


def test_cupy_leaf_to_host_arrives_as_numpy(pool):
  x = np.arange(3, dtype=np.float32)
  plan = ReceivePlan(
      [spec("['c']", x, framework="cupy")], "source",
      _targets_device("cpu"),
  )
  land(plan.allocate(), [x])
  (out,) = plan.build()
  assert isinstance(out, np.ndarray)
  np.testing.assert_array_equal(out, x)


def _targets_device(device):
  from rdt_jax._targets import Target

  return Target(device=_dlpack.parse_device(device))


# ---- caller memory: written straight, or staged and copied after success


@pytest.mark.parametrize("stage", [False, True])
@pytest.mark.parametrize("kind", ["numpy", "torch", "slice"])
def test_caller_memory_is_staged_only_when_asked(kind, stage):
  from rdt_jax._targets import Target

  x = np.arange(64, dtype=np.float32)
  if kind == "slice":
    buf = np.zeros(16, np.float32)
    target = _layout.Slice((slice(8, 24),), buf)
    want = x[8:24]
  else:
    buf = np.zeros(64, np.float32) if kind == "numpy" else torch.zeros(64)
    target, want = buf, x
  plan = ReceivePlan([spec("['w']", x, "numpy", "cpu")], "source", Target(buffers={"['w']": target}))
  dests = plan.allocate(reads_parts=True, stage=stage)
  host = buf if kind != "torch" else buf.numpy()
  inside = [host.ctypes.data <= d.pointer < host.ctypes.data + host.nbytes for d in dests]
  assert all(d.caller for d in dests) == (not stage) and any(inside) == (not stage)
  for d in dests:  # what a backend does: each run's bytes from the source chunk
    src = x.view(np.uint8)[d.source_offset : d.source_offset + d.nbytes]
    ctypes.memmove(d.pointer, src.ctypes.data, d.nbytes)
  if stage:
    np.testing.assert_array_equal(host, 0)  # nothing in the caller's memory before build
  (leaf,) = plan.build()
  assert leaf is buf
  np.testing.assert_array_equal(host, want)
