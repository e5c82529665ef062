"""The device half of the array layer, run on the host (no Ray, no GPU).

Every function here is the code a cuda process runs, called with cpu torch
tensors and jax cpu arrays standing in for device buffers: byte views and
bitcasts of received regions, the region pool's reuse rule, the device
lookups that must never pick another device, and the stream helpers' host
branches. What only a GPU can run is in tests/gpu/.
"""

from __future__ import annotations

import ctypes
import gc
import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch

from _helpers import sample
from rdt_jax import _dlpack, _layout, _memory
from rdt_jax._dlpack import ChunkSpec, Device, LeafSpec, UnsupportedLeafError, _cupy, _dtypes, _interop, _jax, _torch
from rdt_jax._memory._regions import RegionPool

CPU = Device("cpu")
ALL_DTYPES = sorted(d.name for d in _dtypes.SUPPORTED_DTYPES)
TORCH_LACKS = [n for n in ALL_DTYPES if not isinstance(getattr(torch, n, None), torch.dtype)]


def received(x: np.ndarray, extra: int = 0) -> torch.Tensor:
  """A uint8 torch byte view holding x's bytes (plus `extra` trailing bytes),
  as a region view is after a transfer landed."""
  buf = torch.zeros(x.nbytes + extra, dtype=torch.uint8)
  buf[: x.nbytes] = torch.from_numpy(np.ascontiguousarray(x).reshape(-1).view(np.uint8).copy())
  return buf


def test_torch_lacks_some_float8():
  # The bitcast branch below is only meaningful if such dtypes exist.
  assert "float8_e3m4" in TORCH_LACKS


@pytest.mark.parametrize("name", ALL_DTYPES)
@pytest.mark.parametrize("shape", [(3, 5), (), (0,), (0, 4)])
def test_device_bytes_to_jax_every_dtype(name, shape):
  with jax.enable_x64(True):
    x = sample(shape, name)
    out = _interop.device_bytes_to_jax(received(x, extra=7), x.dtype, shape, "['w']")
    assert isinstance(out, jax.Array) and out.dtype == x.dtype and out.shape == shape
    np.testing.assert_array_equal(np.asarray(out).reshape(-1).view(np.uint8), x.reshape(-1).view(np.uint8))


@pytest.mark.parametrize("name", TORCH_LACKS)
def test_device_bytes_to_jax_dtype_torch_lacks_is_bitcast(name):
  # Was unreachable: the torch view raised first, telling the user to do
  # what they were doing (receive it as jax).
  x = sample((4, 2), name)
  out = _interop.device_bytes_to_jax(received(x), x.dtype, (4, 2), "['f8']")
  np.testing.assert_array_equal(np.asarray(out).reshape(-1).view(np.uint8), x.reshape(-1).view(np.uint8))


def test_device_bytes_from_jax_region():
  # A process without torch keeps regions as jax arrays: bitcast on device.
  x = sample((3, 3), "bfloat16")
  region = jnp.asarray(received(x, extra=5).numpy())
  out = _jax.from_device_bytes(region, x.dtype, (3, 3), "['w']")
  np.testing.assert_array_equal(np.asarray(out), x)
  empty = _jax.from_device_bytes(region, np.dtype(np.float32), (0, 2), "['e']")
  assert empty.shape == (0, 2) and empty.dtype == np.float32
  # The cross-framework entry point takes jax regions as they are.
  np.testing.assert_array_equal(np.asarray(_interop.device_bytes_to_jax(region, x.dtype, (3, 3), "['w']")), x)


def test_device_bytes_to_jax_is_zero_copy_when_aligned():
  x = sample((16,), "float32")
  buf = torch.empty(x.nbytes + 256, dtype=torch.uint8)
  off = (-buf.data_ptr()) % 256
  view = buf[off : off + x.nbytes]
  view.copy_(torch.from_numpy(x.view(np.uint8)))
  out = _interop.device_bytes_to_jax(view, x.dtype, (16,), "['w']")
  assert out.unsafe_buffer_pointer() == view.data_ptr()


@pytest.mark.parametrize("name", [n for n in ALL_DTYPES if n not in TORCH_LACKS])
@pytest.mark.parametrize("shape", [(2, 3), (), (0, 3)])
def test_device_bytes_to_torch(name, shape):
  x = sample(shape, name)
  buf = received(x, extra=3)
  out = _torch.from_device_bytes(buf, x.dtype, shape, "['t']")
  assert tuple(out.shape) == shape
  if math.prod(shape):
    assert out.data_ptr() == buf.data_ptr()  # zero-copy
  np.testing.assert_array_equal(_torch.to_host(out, "").reshape(-1).view(np.uint8), x.reshape(-1).view(np.uint8))


def test_device_bytes_to_torch_dtype_torch_lacks_names_leaf():
  x = sample((2,), "float8_e3m4")
  with pytest.raises(UnsupportedLeafError, match=r"Leaf \['f'\] has dtype float8_e3m4"):
    _torch.from_device_bytes(received(x), x.dtype, (2,), "['f']")


@pytest.mark.parametrize("framework", ["jax", "torch", "numpy"])
def test_rebuild_device_from_byte_views(framework):
  x = sample((4, 4), "bfloat16")
  spec = LeafSpec("['w']", (4, 4), x.dtype, "jax", "cuda", (ChunkSpec((4, 4), x.nbytes),))
  out = _dlpack.rebuild_device([received(x, extra=9)], spec, framework)
  assert _dlpack.framework_of(out) == framework
  np.testing.assert_array_equal(_dlpack.convert_leaf(out, "numpy"), x)


def test_rebuild_device_as_cupy_without_cupy_names_the_fix():
  x = sample((2,), "float32")
  spec = LeafSpec("['c']", (2,), x.dtype, "cupy", "cuda", (ChunkSpec((2,), x.nbytes),))
  with pytest.raises(UnsupportedLeafError, match=r"Leaf \['c'\] was sent as a cupy array.*receive_as"):
    _dlpack.rebuild_device([received(x)], spec, "cupy")


def test_rebuild_device_sharded_names_the_fix():
  layout = _dlpack.ShardingLayout((2,), ("x",), ("x",), (0, 1))
  spec = LeafSpec("['s']", (4,), np.dtype(np.float32), "jax", "cuda",
                  (ChunkSpec((2,), 8), ChunkSpec((2,), 8)), layout)
  with pytest.raises(UnsupportedLeafError, match=r"Leaf \['s'\] is a sharded.*set_target_device_for_ref"):
    _dlpack.rebuild_device([received(np.zeros(4, np.float32))] * 2, spec, "jax")


# --------------------------------------------------------------------------
# Devices: never silently another one.


def test_jax_device_never_falls_back_to_another_device():
  assert _dlpack.jax_device(Device("cpu", 0)) == jax.devices("cpu")[0]
  with pytest.raises(UnsupportedLeafError, match=r"Leaf \['w'\] must arrive on cpu:7.*it has cpu:0"):
    _dlpack.jax_device(Device("cpu", 7), "['w']")


def test_jax_device_without_gpu_backend_names_device():
  with pytest.raises(UnsupportedLeafError, match=r"must arrive on cuda:3.*no gpu backend"):
    _dlpack.jax_device(Device("cuda", 3))


def test_check_device_refuses_a_missing_cuda_device_by_name():
  assert _dlpack.check_device(CPU) == CPU
  with pytest.raises(UnsupportedLeafError, match=r"Leaf \['w'\] must arrive on cuda:2, but this process has no cuda"):
    _dlpack.check_device(Device("cuda", 2), "['w']")


def test_to_torch_keeps_dtype_dlpack_lacks_on_cpu():
  x = jnp.asarray(sample((3,), "float8_e3m4"))
  with pytest.raises(UnsupportedLeafError, match="float8_e3m4, which PyTorch"):
    _interop.jax_to_torch(x, "['x']")
  y = jnp.asarray(sample((3,), "float8_e4m3fn"))
  t = _interop.jax_to_torch(y, "['y']")
  assert t.device.type == "cpu" and t.dtype == torch.float8_e4m3fn


def test_jax_bytes_of_is_a_device_bitcast():
  x = jnp.asarray(sample((2, 3), "bfloat16"))
  raw = _jax.bytes_of(x)
  assert raw.dtype == jnp.uint8 and raw.shape == (12,)
  np.testing.assert_array_equal(np.asarray(raw), np.asarray(x).reshape(-1).view(np.uint8))
  t = torch.from_dlpack(raw).view(torch.bfloat16).reshape(2, 3)
  np.testing.assert_array_equal(_torch.to_host(t, ""), np.asarray(x))


def test_cupy_is_recognised_without_importing_it():
  import sys

  assert "cupy" not in sys.modules
  assert _dlpack.framework_of(np.zeros(2)) == "numpy"
  with pytest.raises(UnsupportedLeafError, match="cupy is not importable"):
    _cupy.from_dlpack(torch.zeros(2), "['c']")
  with pytest.raises(UnsupportedLeafError, match=r"host memory.*cannot become a cupy array"):
    _dlpack.convert_leaf(np.zeros(2), "cupy", "['c']")


# --------------------------------------------------------------------------
# The region pool, with host memory standing in for device memory.


def aligned_view(region: _memory.Region, nbytes: int) -> torch.Tensor:
  return region.view(0, nbytes)


@pytest.mark.parametrize("source", ["torch", "jax"])
def test_region_pool_reuses_only_released_unused_regions(source):
  pool = RegionPool(max_bytes=1 << 20)
  a = pool.acquire(4096, CPU, source)
  assert a.held and a.kept and pool.quarantined() == 1
  b = pool.acquire(4096, CPU, source)
  assert b.pointer != a.pointer  # a is held: a transfer may still write it
  a.release()
  leaf = a.view(0, 64).view(torch.float32)  # a received leaf on the region
  c = pool.acquire(4096, CPU, source)
  assert c.pointer not in (a.pointer, b.pointer)  # a has a live leaf
  del leaf
  gc.collect()
  d = pool.acquire(4096, CPU, source)
  assert d is a and d.held  # released and unused: reused


def test_region_pool_counts_jax_arrays_made_from_views():
  pool = RegionPool(max_bytes=1 << 20)
  r = pool.acquire(1024, CPU, "torch")
  x = sample((16,), "float32")
  _memory.copy_bytes(r.pointer, x.ctypes.data, x.nbytes, CPU)
  leaf = _interop.device_bytes_to_jax(r.view(0, x.nbytes), x.dtype, (16,), "['w']")
  assert leaf.unsafe_buffer_pointer() == r.pointer  # aliases the region
  r.release()
  assert pool.acquire(1024, CPU, "torch") is not r
  np.testing.assert_array_equal(np.asarray(leaf), x)
  del leaf
  gc.collect()
  assert pool.acquire(1024, CPU, "torch") is r


def test_region_pool_never_reuses_a_quarantined_region():
  pool = RegionPool(max_bytes=1 << 20)
  failed = pool.acquire(256, CPU, "torch")  # its transfer failed: never released
  got = {pool.acquire(256, CPU, "torch").pointer for _ in range(3)}
  assert failed.pointer not in got
  pool.clear()
  assert pool.quarantined() == 4
  assert failed in pool._regions


def test_region_pool_keys_on_device_and_source():
  pool = RegionPool(max_bytes=1 << 20)
  r = pool.acquire(512, CPU, "torch")
  r.release()
  assert pool.acquire(512, CPU, "jax") is not r
  assert pool.acquire(512, CPU, "torch") is r


def test_region_pool_evicts_and_tells_listeners():
  pool = RegionPool(max_bytes=8192)
  told = []
  pool.add_eviction_listener(lambda p, n, d, keepalive: told.append((p, n, d)))
  a = pool.acquire(4096, CPU, "torch")
  b = pool.acquire(4096, CPU, "torch")
  a.release()
  b.release()
  assert told == [] and pool.pooled_bytes() == 8192
  c = pool.acquire(8000, CPU, "torch")  # over the limit: free ones go, oldest first
  assert told == [(a.pointer, 4096, CPU), (b.pointer, 4096, CPU)]
  big = pool.acquire(1 << 20, CPU, "torch")  # larger than the pool: never kept
  assert not big.kept
  big.release()
  assert big not in pool._regions and (big.pointer, 1 << 20, CPU) not in told
  pool.clear()
  c.release()
  pool.clear()
  assert {t[0] for t in told} == {a.pointer, b.pointer, c.pointer}


def test_region_pool_jax_copy_regions():
  pool = RegionPool(max_bytes=1 << 20)
  r = pool.acquire(64, CPU, "jax-copy")
  assert isinstance(r.root, jax.Array)
  x = sample((4,), "float32")
  ctypes.memmove(r.pointer, x.ctypes.data, x.nbytes)
  leaf = _jax.from_device_bytes(r.view(0, 16), x.dtype, (4,), "['w']")
  jax.block_until_ready(leaf)
  r.release()
  assert pool.acquire(64, CPU, "jax-copy") is r  # leaves are copies: reusable at once
  np.testing.assert_array_equal(np.asarray(leaf), x)


def test_pack_layout():
  specs = [
      LeafSpec("a", (3,), np.dtype(np.float32), "jax", "cuda", (ChunkSpec((3,), 12),)),
      LeafSpec("b", (0,), np.dtype(np.float32), "jax", "cuda", (ChunkSpec((0,), 0),)),
      LeafSpec("c", (300,), np.dtype(np.uint8), "torch", "cuda", (ChunkSpec((300,), 300),)),
  ]
  offsets, total = _layout.pack_layout(specs)
  assert offsets == [[0], [256], [256]] and total == 768
  assert _layout.pack_layout([specs[1]]) == ([[0]], 1)  # empty objects still have an address


def test_region_source_follows_the_consumer_framework():
  assert _memory.region_source({"jax", "torch"}) == "jax"
  assert _memory.region_source({"torch"}) == "torch"
  assert _memory.region_source({"numpy"}) == "torch"


# --------------------------------------------------------------------------
# Stream helpers: their host branches (the cuda ones need a GPU: tests/gpu).


def test_stream_helpers_are_noops_for_host_memory():
  leaves = [_dlpack.describe(torch.ones(3), "['t']"), _dlpack.describe(np.ones(2), "['n']")]
  assert _memory.wait_for_producers(leaves) == 0
  _memory.wait_received([CPU])
  _memory.wait_for_copies(CPU)
  src, dst = np.arange(8, dtype=np.uint8), np.zeros(8, np.uint8)
  _memory.copy_bytes(dst.ctypes.data, src.ctypes.data, 8, CPU)
  np.testing.assert_array_equal(dst, src)


def test_cuda_available_agrees_with_the_framework():
  assert _memory.cuda_available("torch") == torch.cuda.is_available()
  if not _dlpack.importable("cupy"):
    assert not _memory.cuda_available("cupy")  # never imports what is not there


def test_ml_dtypes_float8_e3m4_is_supported():
  assert np.dtype(ml_dtypes.float8_e3m4) in _dtypes.SUPPORTED_DTYPES
